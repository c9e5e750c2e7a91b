//! Golden tests of the device path (every layer through fmoe-kernels' tensor functions, bf16
//! activations, a slab KV cache) on tiny Mixtral and tiny DeepSeek-V3 against transformers, for
//! every MoE method × kernel family: on the CPU (the kernels' CPU twins, always) and on CUDA
//! (skipped with a message without a device; a failure under `FMOE_REQUIRE_CUDA=1`).
//!
//! Tolerances (transformers computed in f32 over the same bf16 weights):
//! - Unquantized: the device path rounds every activation to bf16 (unit roundoff u = 2^-8)
//!   between kernels: norms, q/k/v, rotary, attention output, o_proj, the residual stream, the
//!   MoE's GEMMs, a few dozen roundings per layer, 2–3 layers, each relative error in the
//!   values it rounds. The logits' relative 2-norm error is held to 2^-5 (8u, `BF16_REL_TOL`):
//!   roundings that do not cancel would need to compound coherently through every layer to reach
//!   it. For scale, transformers' own bf16 run of these fixtures (expected.json's
//!   `bf16_compute_check`) differs from f32 by 0.03–0.09 in max |Δlogit| on logits of max 4–5.
//! - fp8: relative 2-norm ≤ 0.27, the fp8 MoE layer's documented worst case (as on the host).
//! - Greedy: a prompt's free greedy continuation must equal transformers' where its smallest
//!   top-1/top-2 margin exceeds twice the measured max |Δlogit| at prefill (else reported), and
//!   teacher-forced argmax must agree at every step whose margin does.
//! - Incremental decode through the slab cache vs one pass over the whole sequence, and two
//!   sequences batched vs alone: relative 2-norm ≤ `BF16_REL_TOL` (different GEMM shapes round
//!   differently), argmax equal where the margin exceeds twice the difference.

mod common;

use std::path::{Path, PathBuf};

use common::{Expected, Target, load_model_on};
use fmoe_models::CausalLm;
use fmoe_moe::{KernelFamily, QuantScheme};

const MODELS: [&str; 2] = ["tiny-mixtral", "tiny-deepseek-v3"];

fn loader(target: Target) -> impl Fn(&Path, QuantScheme, KernelFamily) -> Box<dyn CausalLm> {
    move |dir, scheme, family| {
        let m = load_model_on(target, dir, scheme, family);
        assert_eq!(m.info().moe, Some((scheme, family)), "{scheme}/{family}");
        m
    }
}

fn fixture(name: &str) -> (PathBuf, Expected) {
    let dir = common::fixture(name);
    let exp = common::read_expected(&dir);
    (dir, exp)
}

fn matches_transformers(target: Target) {
    for name in MODELS {
        println!("== {name}");
        let (dir, exp) = fixture(name);
        common::every_method_and_kernel_matches_transformers(target, &dir, &exp, &loader(target));
    }
}

fn decode_and_batches(target: Target) {
    for name in MODELS {
        let (dir, exp) = fixture(name);
        let model = load_model_on(target, &dir, QuantScheme::Unquantized, KernelFamily::Fused);
        // Prompt 2 (23 tokens) in two chunks, then its greedy continuation a token at a time.
        let p = &exp.prompt_ids[2];
        let mut chunks = vec![p[..20].to_vec(), p[20..].to_vec()];
        chunks.extend(exp.greedy_ids[2].iter().map(|&t| vec![t]));
        let worst = common::decode_with_the_cache_equals_one_full_pass(
            target,
            model.as_ref(),
            &chunks,
            &format!("{name} "),
        );
        println!("{name}: incremental vs full pass, max |Δlogit| {worst:.2e}");
        common::batched_equals_one_by_one(
            model.as_ref(),
            &exp.prompt_ids[0],
            &exp.prompt_ids[2],
            6,
        );
    }
}

#[test]
fn cpu_twins_match_transformers() {
    matches_transformers(Target::DeviceOnCpu);
}

#[test]
fn cpu_twins_decode_and_batch_consistently() {
    decode_and_batches(Target::DeviceOnCpu);
}

#[test]
fn cuda_matches_transformers() {
    if common::cuda_or_skip() {
        matches_transformers(Target::Cuda);
    }
}

#[test]
fn cuda_decodes_and_batches_consistently() {
    if common::cuda_or_skip() {
        decode_and_batches(Target::Cuda);
    }
}

#[test]
fn a_host_cache_is_refused_by_the_device_path() {
    let (dir, exp) = fixture("tiny-mixtral");
    let model = load_model_on(
        Target::DeviceOnCpu,
        &dir,
        QuantScheme::Unquantized,
        KernelFamily::Portable,
    );
    let mut cache = fmoe_engine::ContiguousKvCache::new(model.info().kv_layout.clone());
    let seq = cache.allocate();
    let chunk = fmoe_models::SeqChunk {
        seq,
        tokens: exp.prompt_ids[0].clone(),
        start_pos: 0,
    };
    let err = model
        .forward(&[chunk], &mut cache, fmoe_models::LogitsFor::Last)
        .unwrap_err()
        .to_string();
    assert!(err.contains("slab KV cache"), "{err}");
}
