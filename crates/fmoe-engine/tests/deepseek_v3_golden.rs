//! Golden tests: tiny DeepSeek-V3 (tests/fixtures/tiny-deepseek-v3, made by transformers 5.17
//! with f32 compute over bf16 weights: 3 layers, the first dense, MLA with q_lora 32 / kv_lora
//! 24 / nope 16 / rope 8 / v 16, YaRN factor 4, 8 experts in 2 groups, top-2 of the best group,
//! a shared expert, a random `e_score_correction_bias`) against transformers' prefill logits,
//! greedy continuations and per-layer routing, for every MoE method × kernel family.
//!
//! Tolerances:
//! - Unquantized: fmoe computes in f32 from the same bf16 weights as transformers did, so the
//!   only differences are f32 rounding and summation order. A length-K f32 dot product is off
//!   by at most ≈ K·u·Σ|aᵢbᵢ| (u = 6e-8, K ≤ 80 here: ≤ 5e-6 relative per product); a few dozen
//!   such products and normalizations in sequence over 3 layers bound the logits' error by
//!   ≈ 1e-4 relative to their scale, hence `|Δlogit| ≤ 1e-4·(1 + max|logit|)` (as for Mixtral).
//!   Rounding errors are not worst-case aligned in practice: measured ≈ 1e-6. Greedy must
//!   match exactly (min top-1/top-2 margin 0.13 ≫ 1e-4).
//! - fp8 (MoE experts, routed and shared, and their activations in e4m3; attention, dense MLP,
//!   router stay f32 over bf16): logits' relative 2-norm error ≤ 0.27, the fp8 MoE layer's
//!   documented worst case (1 + 2^-4)^4 − 1 (fmoe-moe's `QUANT_TOL`). Teacher-forced argmax
//!   (one pass over prompt + transformers' continuation) must agree at every step whose
//!   transformers margin exceeds twice the measured max |Δlogit| at prefill; free greedy is
//!   required only when the prompt's smallest margin does, else reported.
//! - Routing (unquantized): per prompt token and MoE layer, the chosen experts equal
//!   transformers' as sets (its top-k order is unspecified), and each expert's weight agrees
//!   within 1e-5·routed_scaling_factor (f32 sigmoid of logits that agree to ≈ 1e-6).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{Expected, Target, moe_options};
use fmoe_models::deepseek_v3::RouterTrace;
use fmoe_models::{
    CausalLm, Checkpoint, DeepseekV3ForCausalLM, ForwardInput, KvPool, ModelConfig, SeqStep,
    StepLogits, Vb, WeightSource,
};
use fmoe_moe::{KernelFamily, QuantScheme};
use serde::Deserialize;

#[derive(Deserialize)]
struct LayerRouting {
    topk_ids: Vec<Vec<u32>>,
    topk_weights: Vec<Vec<f32>>,
}

/// expected.json's routing: [prompt] → MoE layer index → routing of each prompt token.
#[derive(Deserialize)]
struct Routing {
    router_topk: Vec<BTreeMap<String, LayerRouting>>,
}

fn fixture() -> PathBuf {
    common::fixture("tiny-deepseek-v3")
}

fn expected() -> Expected {
    common::read_expected(&fixture())
}

fn load_model(dir: &Path, scheme: QuantScheme, family: KernelFamily) -> Arc<dyn CausalLm> {
    let model = common::load_model(dir, scheme, family);
    assert_eq!(model.info().architecture, "DeepseekV3ForCausalLM");
    model
}

/// The concrete model (for its routing trace).
fn load_concrete(dir: &Path) -> DeepseekV3ForCausalLM {
    let ModelConfig::DeepseekV3(cfg) = ModelConfig::from_file(&dir.join("config.json")).unwrap()
    else {
        panic!("not a DeepSeek-V3 config")
    };
    let source = WeightSource::Checkpoint(Checkpoint::open(dir).unwrap());
    let bar = fmoe_models::loader::progress_bar(0, false);
    let vb = Vb::new(&source, &bar);
    let moe = moe_options(QuantScheme::Unquantized, KernelFamily::Portable);
    DeepseekV3ForCausalLM::load(&cfg, &vb, &moe).unwrap()
}

#[test]
fn every_method_and_kernel_matches_transformers() {
    // Batched decode attends in latent space: the absorbed path.
    common::every_method_and_kernel_matches_transformers(
        Target::Host,
        &fixture(),
        &expected(),
        &|dir, scheme, family| {
            let model = load_model(dir, scheme, family);
            assert_eq!(
                model.info().moe,
                Some((scheme, family)),
                "{scheme}/{family}"
            );
            model
        },
        None,
    );
}

#[test]
fn router_topk_matches_transformers() {
    let exp = expected();
    let routing: Routing = common::read_expected(&fixture());
    let model = load_concrete(&fixture());
    let scaling = 2.5f32;
    let mut checked = 0;
    for (i, prompt) in exp.prompt_ids.iter().enumerate() {
        let info = model.info();
        let blocks: Vec<u32> = (0..prompt.len().div_ceil(16) as u32).collect();
        let mut pool =
            KvPool::new(&info.kv_layout, info.dtype, info.device, blocks.len(), 16).unwrap();
        let step = SeqStep {
            tokens: prompt,
            past: 0,
            block_table: &blocks,
            logits: StepLogits::Last,
        };
        let input = ForwardInput::new(info, 16, blocks.len(), &[step]).unwrap();
        let (_, trace) = model.forward_traced(&input, &mut pool).unwrap();
        let layers: Vec<usize> = trace.iter().map(|t| t.layer).collect();
        let want_layers: Vec<usize> = routing.router_topk[i]
            .keys()
            .map(|k| k.parse().unwrap())
            .collect();
        assert_eq!(layers, want_layers, "prompt {i}: MoE layers");
        for RouterTrace {
            layer,
            top_k,
            ids,
            weights,
        } in &trace
        {
            let want = &routing.router_topk[i][&layer.to_string()];
            assert_eq!(want.topk_ids.len(), prompt.len());
            for (t, (wids, wws)) in want.topk_ids.iter().zip(&want.topk_weights).enumerate() {
                let got_ids = &ids[t * top_k..(t + 1) * top_k];
                let got_w = &weights[t * top_k..(t + 1) * top_k];
                let mut a = got_ids.to_vec();
                let mut b = wids.clone();
                a.sort_unstable();
                b.sort_unstable();
                assert_eq!(a, b, "prompt {i} layer {layer} token {t}: experts");
                for (id, w) in wids.iter().zip(wws) {
                    let j = got_ids.iter().position(|g| g == id).unwrap();
                    assert!(
                        (got_w[j] - w).abs() <= 1e-5 * scaling,
                        "prompt {i} layer {layer} token {t} expert {id}: weight {} vs {w}",
                        got_w[j]
                    );
                }
                checked += 1;
            }
        }
    }
    println!("{checked} (token, layer) routings agree with transformers");
    assert_eq!(checked, 2 * (5 + 11 + 23));
}

#[test]
fn fixture_margins_are_what_the_tests_assume() {
    common::fixture_margins_are_what_the_tests_assume(&expected());
}

#[test]
fn decode_with_the_cache_equals_one_full_pass() {
    // Logits of each generated position, computed incrementally through the compressed KV cache
    // (decode steps attend in latent space), equal those of one forward pass over prompt +
    // continuation (which decompresses the latent through kv_b). Prompt 2 (23 tokens) also
    // goes through one mid-sequence chunk of 3 tokens.
    let exp = expected();
    let model = load_model(&fixture(), QuantScheme::Unquantized, KernelFamily::Portable);
    for i in [1, 2] {
        let prompt = &exp.prompt_ids[i];
        let mut chunks: Vec<Vec<u32>> = vec![prompt.clone()];
        if i == 2 {
            chunks = vec![prompt[..20].to_vec(), prompt[20..].to_vec()];
        }
        chunks.extend(exp.greedy_ids[i].iter().map(|&t| vec![t]));
        let worst = common::decode_with_the_cache_equals_one_full_pass(
            Target::Host,
            &model,
            &chunks,
            &format!("prompt {i} "),
        );
        println!("prompt {i}: incremental vs full pass, max |Δlogit| {worst:.2e}");
    }
}

#[test]
fn tokenizer_encodes_the_prompts_as_transformers_did() {
    common::tokenizer_encodes_the_prompts_as_transformers_did(&fixture(), &expected());
}

#[test]
fn both_config_layouts_load_to_the_same_model() {
    common::both_config_layouts_load_to_the_same_model(
        &fixture(),
        "fmoe-ds-golden",
        &expected(),
        &load_model,
    );
}
