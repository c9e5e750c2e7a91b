//! What the golden tests (tiny Mixtral, tiny DeepSeek-V3 against transformers) share: the
//! fixture's expected.json, loading a model per MoE method × kernel family on one of the paths
//! ([`Target`]), prefill and full-pass logits, the error measures and tolerances (each test
//! file's module docs say why they hold), and the checks both models run unchanged.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fmoe_core::env::FusedSwitches;
use fmoe_core::{DType, Device};
use fmoe_engine::{
    DirectSession, Engine, EngineArgs, GenerateParams, Generation, LogitsFor, SamplingParams,
    SeqChunk, generate,
};
use fmoe_models::{CausalLm, LoadOptions, MoeOptions, load};
use fmoe_moe::{KernelFamily, QuantScheme};
use serde::Deserialize;

/// A model of the fixture in a directory, for one MoE method and kernel family.
pub type Loader<'a> = &'a dyn Fn(&Path, QuantScheme, KernelFamily) -> Arc<dyn CausalLm>;

/// For a method, kernel family and token sequence: per position, whether a routing decision
/// differing from transformers' may have moved that position's logits (see
/// `every_method_and_kernel_matches_transformers`).
pub type RoutingFlips<'a> = &'a dyn Fn(QuantScheme, KernelFamily, &[u32]) -> Vec<bool>;

/// Where a golden test runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The CPU in f32 (the default there: the golden reference).
    Host,
    /// The CPU in bf16 (the kernels' CPU twins with the GPU's activation dtype).
    DeviceOnCpu,
    /// CUDA device 0 (bf16 activations).
    Cuda,
}

impl Target {
    pub fn options(self, moe: MoeOptions) -> LoadOptions {
        let (device, dtype) = match self {
            Target::Host => (Device::Cpu, None),
            Target::DeviceOnCpu => (Device::Cpu, Some(DType::BF16)),
            Target::Cuda => (Device::Cuda(0), None),
        };
        LoadOptions {
            moe,
            device,
            dtype,
            ..LoadOptions::default()
        }
    }

    /// Whether activations are bf16 (the device path) rather than f32.
    pub fn is_bf16(self) -> bool {
        self != Target::Host
    }
}

/// Whether CUDA tests run ([`fmoe_core::cuda::test_backend_or_skip`]: allocations poisoned, a
/// printed reason to skip, a failure under `FMOE_REQUIRE_CUDA=1`).
pub fn cuda_or_skip() -> bool {
    fmoe_core::cuda::test_backend_or_skip().is_some()
}

/// The part of a fixture's expected.json that both models' tests read.
#[derive(Deserialize)]
pub struct Expected {
    pub prompts: Vec<String>,
    pub prompt_ids: Vec<Vec<u32>>,
    pub greedy_ids: Vec<Vec<u32>>,
    /// [prompt][1][vocab]: the last prompt position.
    pub prefill_logits: Vec<Vec<Vec<f32>>>,
    pub min_margin: Vec<f32>,
    /// [prompt][step][0] = transformers' top-1 minus top-2 logit at that greedy step.
    pub step_margins: Vec<Vec<Vec<f32>>>,
}

/// tests/fixtures/`name` at the workspace root.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// `dir`/expected.json, parsed as `T`.
pub fn read_expected<T: for<'de> Deserialize<'de>>(dir: &Path) -> T {
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn switches(family: KernelFamily) -> FusedSwitches {
    FusedSwitches {
        use_fused: family == KernelFamily::Fused,
        use_fused_moe: true,
        use_fused_fp8_block_scaled_moe: true,
    }
}

pub fn moe_options(scheme: QuantScheme, family: KernelFamily) -> MoeOptions {
    MoeOptions {
        scheme: Some(scheme),
        switches: switches(family),
    }
}

pub fn load_model(dir: &Path, scheme: QuantScheme, family: KernelFamily) -> Arc<dyn CausalLm> {
    load_model_on(Target::Host, dir, scheme, family)
}

pub fn load_model_on(
    target: Target,
    dir: &Path,
    scheme: QuantScheme,
    family: KernelFamily,
) -> Arc<dyn CausalLm> {
    Arc::from(
        load(dir, &target.options(moe_options(scheme, family)))
            .unwrap()
            .model,
    )
}

/// A session over `model` whose pool holds `tokens` tokens.
pub fn cache_for(model: &Arc<dyn CausalLm>, tokens: usize) -> DirectSession {
    DirectSession::new(model.clone(), tokens).unwrap()
}

/// `prompts` generated through an engine over `model` with the default sizes.
pub fn generate_all(
    model: &Arc<dyn CausalLm>,
    prompts: &[Vec<u32>],
    params: &GenerateParams,
) -> Generation {
    let config = EngineArgs::default().resolve(model).unwrap();
    let mut engine = Engine::new(model.clone(), None, config).unwrap();
    generate(&mut engine, prompts, params).unwrap()
}

/// Logits of `which` positions of `tokens`, prefilled alone (all finite: the error measures
/// below would let a NaN through).
pub fn forward(model: &Arc<dyn CausalLm>, tokens: &[u32], which: LogitsFor) -> Vec<f32> {
    let mut cache = cache_for(model, tokens.len());
    let seq = cache.allocate();
    let chunk = SeqChunk {
        seq,
        tokens: tokens.to_vec(),
        start_pos: 0,
    };
    let logits = cache.forward(&[chunk], which).unwrap();
    assert_finite(&logits);
    logits
}

/// Panics naming the first non-finite value.
pub fn assert_finite(v: &[f32]) {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        panic!("logit {i} is {}", v[i]);
    }
}

/// Last-position logits of `prompt`, prefilled alone.
pub fn prefill(model: &Arc<dyn CausalLm>, prompt: &[u32]) -> Vec<f32> {
    forward(model, prompt, LogitsFor::Last)
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    let d: f32 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let n: f32 = want.iter().map(|b| b * b).sum();
    (d / n).sqrt()
}

/// The fp8 MoE layer's worst-case relative error (fmoe-moe tests' `QUANT_TOL`).
const FP8_REL_TOL: f32 = 0.27;

/// f32 compute over the same bf16 weights: `|Δlogit| ≤ 1e-4·(1 + max|logit|)`.
pub fn f32_tol(want: &[f32]) -> f32 {
    1e-4 * (1.0 + max_abs(want))
}

/// bf16 activations (the device path; see `device_golden.rs` for the derivation): the logits'
/// relative 2-norm error ≤ 2^-5, eight bf16 unit roundoffs.
pub const BF16_REL_TOL: f32 = 1.0 / 32.0;

/// (measured error, tolerance) in the measure each scheme is held to on `target`.
fn error_and_tolerance(
    target: Target,
    scheme: QuantScheme,
    got: &[f32],
    want: &[f32],
) -> (f32, f32) {
    match scheme {
        QuantScheme::Unquantized if target.is_bf16() => (rel_l2(got, want), BF16_REL_TOL),
        QuantScheme::Unquantized => (max_abs_diff(got, want), f32_tol(want)),
        QuantScheme::Fp8PerTensor | QuantScheme::Fp8Block => (rel_l2(got, want), FP8_REL_TOL),
    }
}

/// For every MoE method × kernel family, the model `load` gives for `dir`: prefill logits
/// within the scheme's tolerance, teacher-forced argmax, and greedy continuations of all
/// prompts in one batch against transformers'. On the host path (f32) unquantized greedy must
/// match; otherwise a prompt's greedy continuation must match where its smallest margin exceeds
/// twice the measured prefill error, and is reported elsewhere.
///
/// Routing is discontinuous: where rounding (fp8, bf16) tips a near-tied expert choice, the
/// token's hidden state jumps, so the margin rule, which bounds a continuous error, does not
/// apply there. `flips`, when given, marks such positions (the routing compared with
/// transformers'); their teacher-forced argmax is reported, not required.
pub fn every_method_and_kernel_matches_transformers(
    target: Target,
    dir: &Path,
    exp: &Expected,
    load: Loader,
    flips: Option<RoutingFlips>,
) {
    let params = GenerateParams {
        max_tokens: exp.greedy_ids[0].len(),
        sampling: SamplingParams::default(),
        ..GenerateParams::default()
    };
    let mut failures = Vec::new();
    for scheme in QuantScheme::ALL {
        for family in KernelFamily::ALL {
            let model = load(dir, scheme, family);
            let mut worst = 0f32;
            for (i, prompt) in exp.prompt_ids.iter().enumerate() {
                let got = prefill(&model, prompt);
                let want = &exp.prefill_logits[i][0];
                let (err, tol) = error_and_tolerance(target, scheme, &got, want);
                worst = worst.max(max_abs_diff(&got, want));
                println!(
                    "{target:?} {scheme:>11}/{family:<8} prompt {i}: prefill max |Δlogit| {:.2e}, rel 2-norm {:.2e}",
                    max_abs_diff(&got, want),
                    rel_l2(&got, want)
                );
                if err > tol {
                    failures.push(format!(
                        "{scheme}/{family} prompt {i}: prefill logit error {err:.3e} > {tol:.3e}"
                    ));
                }
            }
            // Teacher-forced: one pass over prompt + expected continuation; at every step whose
            // margin exceeds twice the prefill error the argmax must be transformers' token.
            for i in 0..exp.prompt_ids.len() {
                let full: Vec<u32> = exp.prompt_ids[i]
                    .iter()
                    .chain(&exp.greedy_ids[i])
                    .copied()
                    .collect();
                let exempt =
                    flips.map_or_else(|| vec![false; full.len()], |f| f(scheme, family, &full));
                let (agree, required, bad) = teacher_forced(&model, exp, i, 2.0 * worst, &exempt);
                let flipped: Vec<usize> = (0..exp.greedy_ids[i].len())
                    .filter(|&st| exempt[exp.prompt_ids[i].len() - 1 + st])
                    .collect();
                println!(
                    "{scheme:>11}/{family:<8} prompt {i}: teacher-forced argmax agrees at {agree}/{} steps ({required} required; routing flipped at steps {flipped:?})",
                    exp.greedy_ids[i].len()
                );
                if let Some(step) = bad {
                    failures.push(format!(
                        "{scheme}/{family} prompt {i}: teacher-forced argmax differs at step {step} (margin {:.3} > 2·{worst:.3e})",
                        exp.step_margins[i][step][0]
                    ));
                }
            }
            // All prompts in one batch: prefill of different lengths, then batched decode.
            let g = generate_all(&model, &exp.prompt_ids, &params);
            for (i, out) in g.outputs.iter().enumerate() {
                let matches = out.token_ids == exp.greedy_ids[i];
                let required = (scheme == QuantScheme::Unquantized && target == Target::Host)
                    || exp.min_margin[i] > 2.0 * worst;
                let agree = out
                    .token_ids
                    .iter()
                    .zip(&exp.greedy_ids[i])
                    .take_while(|(a, b)| a == b)
                    .count();
                println!(
                    "{scheme:>11}/{family:<8} prompt {i}: worst prefill max |Δlogit| {worst:.2e}, min margin {:.3}, greedy {} (first {agree}/{} agree; {})",
                    exp.min_margin[i],
                    if matches { "matches" } else { "differs" },
                    exp.greedy_ids[i].len(),
                    if required { "required" } else { "reported" },
                );
                if required && !matches {
                    failures.push(format!(
                        "{scheme}/{family} prompt {i}: greedy {:?} != {:?}",
                        out.token_ids, exp.greedy_ids[i]
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Argmax agreement along transformers' greedy path: (steps agreeing, steps required, first
/// required step that disagrees). Positions marked in `exempt` are never required.
fn teacher_forced(
    model: &Arc<dyn CausalLm>,
    exp: &Expected,
    i: usize,
    min_margin: f32,
    exempt: &[bool],
) -> (usize, usize, Option<usize>) {
    let prompt = &exp.prompt_ids[i];
    let cont = &exp.greedy_ids[i];
    let full: Vec<u32> = prompt.iter().chain(cont).copied().collect();
    let all = forward(model, &full, LogitsFor::All);
    let vocab = model.info().vocab_size;
    let (mut agree, mut required, mut bad) = (0, 0, None);
    for (step, &want) in cont.iter().enumerate() {
        let pos = prompt.len() - 1 + step;
        let got = fmoe_engine::argmax(&all[pos * vocab..(pos + 1) * vocab]);
        let must = exp.step_margins[i][step][0] > min_margin && !exempt[pos];
        agree += usize::from(got == want);
        required += usize::from(must);
        if must && got != want && bad.is_none() {
            bad = Some(step);
        }
    }
    (agree, required, bad)
}

/// `min_margin` is the smallest of each prompt's step margins, one per greedy token.
pub fn fixture_margins_are_what_the_tests_assume(exp: &Expected) {
    for (i, steps) in exp.step_margins.iter().enumerate() {
        let min = steps.iter().map(|s| s[0]).fold(f32::INFINITY, f32::min);
        assert!((min - exp.min_margin[i]).abs() < 1e-6, "prompt {i}: {min}");
        assert_eq!(steps.len(), exp.greedy_ids[i].len());
    }
}

/// Feeds `chunks` (a prompt in one or more pieces, then the continuation a token at a time)
/// through one KV cache: each chunk's last-position logits must equal those of one forward pass
/// over all of them, within `f32_tol` on the host path, `BF16_REL_TOL` (relative 2-norm) on the
/// bf16 device path. `label` starts each failure message. Returns the largest |Δlogit|.
pub fn decode_with_the_cache_equals_one_full_pass(
    target: Target,
    model: &Arc<dyn CausalLm>,
    chunks: &[Vec<u32>],
    label: &str,
) -> f32 {
    let full: Vec<u32> = chunks.concat();
    let all = forward(model, &full, LogitsFor::All);
    let vocab = model.info().vocab_size;
    let mut cache = cache_for(model, full.len());
    let seq = cache.allocate();
    let mut pos = 0;
    let mut worst = 0f32;
    for (step, chunk) in chunks.iter().enumerate() {
        let c = SeqChunk {
            seq,
            tokens: chunk.clone(),
            start_pos: pos,
        };
        let got = cache.forward(&[c], LogitsFor::Last).unwrap();
        pos += chunk.len();
        let row = &all[(pos - 1) * vocab..pos * vocab];
        let err = max_abs_diff(&got, row);
        worst = worst.max(err);
        if target.is_bf16() {
            let rel = rel_l2(&got, row);
            assert!(rel <= BF16_REL_TOL, "{label}step {step}: rel {rel}");
        } else {
            assert!(err <= f32_tol(row), "{label}step {step}: {err}");
        }
    }
    worst
}

/// Two sequences of different lengths prefilled in one forward pass, then decoded together for
/// `steps` steps (each feeding its own greedy token), give the logits of running each alone
/// through the same steps: equal within `BF16_REL_TOL` (relative 2-norm) per row, and the same
/// greedy tokens where the row's top-1/top-2 margin exceeds twice the measured difference.
pub fn batched_equals_one_by_one(model: &Arc<dyn CausalLm>, a: &[u32], b: &[u32], steps: usize) {
    let vocab = model.info().vocab_size;
    // One sequence alone: last-position logits of the prefill and of each decode step.
    let alone = |prompt: &[u32]| -> Vec<Vec<f32>> {
        let mut cache = cache_for(model, prompt.len() + steps + 1);
        let seq = cache.allocate();
        let mut out = Vec::new();
        let mut chunk = SeqChunk {
            seq,
            tokens: prompt.to_vec(),
            start_pos: 0,
        };
        for _ in 0..=steps {
            let l = cache
                .forward(std::slice::from_ref(&chunk), LogitsFor::Last)
                .unwrap();
            chunk = SeqChunk {
                seq,
                tokens: vec![fmoe_engine::argmax(&l)],
                start_pos: chunk.start_pos + chunk.tokens.len(),
            };
            out.push(l);
        }
        out
    };
    let (want_a, want_b) = (alone(a), alone(b));
    // Both at once, each fed the token it got alone (so the inputs are the same).
    let mut cache = cache_for(model, a.len() + b.len() + 2 * steps + 32);
    let sa = cache.allocate();
    let sb = cache.allocate();
    let mut chunks = vec![
        SeqChunk {
            seq: sa,
            tokens: a.to_vec(),
            start_pos: 0,
        },
        SeqChunk {
            seq: sb,
            tokens: b.to_vec(),
            start_pos: 0,
        },
    ];
    let mut worst = 0f32;
    for step in 0..=steps {
        let got = cache.forward(&chunks, LogitsFor::Last).unwrap();
        for (j, want) in [&want_a[step], &want_b[step]].into_iter().enumerate() {
            let row = &got[j * vocab..(j + 1) * vocab];
            let rel = rel_l2(row, want);
            worst = worst.max(rel);
            assert!(rel <= BF16_REL_TOL, "step {step} sequence {j}: rel {rel}");
            let mut sorted = want.clone();
            sorted.sort_by(|x, y| y.total_cmp(x));
            if sorted[0] - sorted[1] > 2.0 * max_abs_diff(row, want) {
                assert_eq!(
                    fmoe_engine::argmax(row),
                    fmoe_engine::argmax(want),
                    "step {step} sequence {j}"
                );
            }
        }
        for c in &mut chunks {
            let next = if c.seq == sa { &want_a } else { &want_b };
            c.start_pos += c.tokens.len();
            c.tokens = vec![fmoe_engine::argmax(&next[step])];
        }
    }
    println!("batched vs one by one: worst relative 2-norm difference {worst:.2e}");
}

pub fn tokenizer_encodes_the_prompts_as_transformers_did(dir: &Path, exp: &Expected) {
    let tok = fmoe_models::Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    for (text, ids) in exp.prompts.iter().zip(&exp.prompt_ids) {
        assert_eq!(&tok.encode(text, true).unwrap(), ids, "{text:?}");
    }
}

/// `src` with config.v4.json as its config.json (in a temporary directory named from
/// `tmp_prefix`) prefills every prompt to the same logits as `src` itself.
pub fn both_config_layouts_load_to_the_same_model(
    src: &Path,
    tmp_prefix: &str,
    exp: &Expected,
    load: Loader,
) {
    let tmp = tempdir(tmp_prefix);
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), tmp.join(f)).unwrap();
    }
    std::fs::copy(src.join("config.v4.json"), tmp.join("config.json")).unwrap();
    let v5 = load(src, QuantScheme::Unquantized, KernelFamily::Portable);
    let v4 = load(&tmp, QuantScheme::Unquantized, KernelFamily::Portable);
    for p in &exp.prompt_ids {
        assert_eq!(prefill(&v5, p), prefill(&v4, p));
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

fn tempdir(prefix: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "{prefix}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
