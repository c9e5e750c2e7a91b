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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fmoe_core::env::FusedSwitches;
use fmoe_engine::{ContiguousKvCache, GenerateParams, SamplingParams, generate};
use fmoe_models::deepseek_v3::RouterTrace;
use fmoe_models::{
    CausalLm, Checkpoint, DeepseekV3ForCausalLM, LoadOptions, LogitsFor, ModelConfig, MoeOptions,
    SeqChunk, Vb, WeightSource, load,
};
use fmoe_moe::{KernelFamily, QuantScheme};
use serde::Deserialize;

#[derive(Deserialize)]
struct LayerRouting {
    topk_ids: Vec<Vec<u32>>,
    topk_weights: Vec<Vec<f32>>,
}

#[derive(Deserialize)]
struct Expected {
    prompts: Vec<String>,
    prompt_ids: Vec<Vec<u32>>,
    greedy_ids: Vec<Vec<u32>>,
    /// [prompt][1][vocab]: the last prompt position.
    prefill_logits: Vec<Vec<Vec<f32>>>,
    min_margin: Vec<f32>,
    /// [prompt][step][0] = transformers' top-1 minus top-2 logit at that greedy step.
    step_margins: Vec<Vec<Vec<f32>>>,
    /// [prompt] → MoE layer index → routing of each prompt token.
    router_topk: Vec<BTreeMap<String, LayerRouting>>,
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-deepseek-v3")
}

fn expected() -> Expected {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn switches(family: KernelFamily) -> FusedSwitches {
    FusedSwitches {
        use_fused: family == KernelFamily::Fused,
        use_fused_moe: true,
        use_fused_fp8_block_scaled_moe: true,
    }
}

fn moe_options(scheme: QuantScheme, family: KernelFamily) -> MoeOptions {
    MoeOptions {
        scheme: Some(scheme),
        switches: switches(family),
        ..MoeOptions::default()
    }
}

fn load_model(dir: &Path, scheme: QuantScheme, family: KernelFamily) -> Box<dyn CausalLm> {
    let opts = LoadOptions {
        moe: moe_options(scheme, family),
        ..LoadOptions::default()
    };
    let loaded = load(dir, &opts).unwrap();
    assert_eq!(loaded.model.info().architecture, "DeepseekV3ForCausalLM");
    loaded.model
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

/// Logits of `which` positions of `tokens`, prefilled alone.
fn forward(model: &dyn CausalLm, tokens: &[u32], which: LogitsFor) -> Vec<f32> {
    let mut cache = ContiguousKvCache::new(model.info().kv_layout.clone());
    let seq = cache.allocate();
    let chunk = SeqChunk {
        seq,
        tokens: tokens.to_vec(),
        start_pos: 0,
    };
    model
        .forward(&[chunk], &mut cache, which)
        .unwrap()
        .to_f32_vec()
        .unwrap()
}

fn prefill(model: &dyn CausalLm, prompt: &[u32]) -> Vec<f32> {
    forward(model, prompt, LogitsFor::Last)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
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

/// f32 compute over the same bf16 weights (see the module docs).
fn f32_tol(want: &[f32]) -> f32 {
    1e-4 * (1.0 + max_abs(want))
}

/// (measured error, tolerance) in the measure each scheme is held to.
fn error_and_tolerance(scheme: QuantScheme, got: &[f32], want: &[f32]) -> (f32, f32) {
    match scheme {
        QuantScheme::Unquantized => (max_abs_diff(got, want), f32_tol(want)),
        QuantScheme::Fp8PerTensor | QuantScheme::Fp8Block => (rel_l2(got, want), FP8_REL_TOL),
    }
}

#[test]
fn every_method_and_kernel_matches_transformers() {
    let exp = expected();
    let dir = fixture();
    let params = GenerateParams {
        max_tokens: exp.greedy_ids[0].len(),
        sampling: SamplingParams::default(),
        ..GenerateParams::default()
    };
    let mut failures = Vec::new();
    for scheme in QuantScheme::ALL {
        for family in KernelFamily::ALL {
            let model = load_model(&dir, scheme, family);
            assert_eq!(
                model.info().moe,
                Some((scheme, family)),
                "{scheme}/{family}"
            );
            let mut worst = 0f32;
            for (i, prompt) in exp.prompt_ids.iter().enumerate() {
                let got = prefill(model.as_ref(), prompt);
                let want = &exp.prefill_logits[i][0];
                let (err, tol) = error_and_tolerance(scheme, &got, want);
                worst = worst.max(max_abs_diff(&got, want));
                println!(
                    "{scheme:>11}/{family:<8} prompt {i}: prefill max |Δlogit| {:.2e}, rel 2-norm {:.2e}",
                    max_abs_diff(&got, want),
                    rel_l2(&got, want)
                );
                if err > tol {
                    failures.push(format!(
                        "{scheme}/{family} prompt {i}: prefill logit error {err:.3e} > {tol:.3e}"
                    ));
                }
            }
            for i in 0..exp.prompt_ids.len() {
                let (agree, required, bad) = teacher_forced(model.as_ref(), &exp, i, 2.0 * worst);
                println!(
                    "{scheme:>11}/{family:<8} prompt {i}: teacher-forced argmax agrees at {agree}/{} steps ({required} required)",
                    exp.greedy_ids[i].len()
                );
                if let Some(step) = bad {
                    failures.push(format!(
                        "{scheme}/{family} prompt {i}: teacher-forced argmax differs at step {step} (margin {:.3} > 2·{worst:.3e})",
                        exp.step_margins[i][step][0]
                    ));
                }
            }
            // All prompts in one batch: prefill of different lengths, then batched decode
            // (which attends in latent space: the absorbed path).
            let g = generate(model.as_ref(), None, &exp.prompt_ids, &params).unwrap();
            for (i, out) in g.outputs.iter().enumerate() {
                let matches = out.token_ids == exp.greedy_ids[i];
                let required =
                    scheme == QuantScheme::Unquantized || exp.min_margin[i] > 2.0 * worst;
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
/// required step that disagrees).
fn teacher_forced(
    model: &dyn CausalLm,
    exp: &Expected,
    i: usize,
    min_margin: f32,
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
        let must = exp.step_margins[i][step][0] > min_margin;
        agree += usize::from(got == want);
        required += usize::from(must);
        if must && got != want && bad.is_none() {
            bad = Some(step);
        }
    }
    (agree, required, bad)
}

#[test]
fn router_topk_matches_transformers() {
    let exp = expected();
    let model = load_concrete(&fixture());
    let scaling = 2.5f32;
    let mut checked = 0;
    for (i, prompt) in exp.prompt_ids.iter().enumerate() {
        let mut cache = ContiguousKvCache::new(model.info().kv_layout.clone());
        let seq = cache.allocate();
        let chunk = SeqChunk {
            seq,
            tokens: prompt.clone(),
            start_pos: 0,
        };
        let (_, trace) = model
            .forward_traced(&[chunk], &mut cache, LogitsFor::Last)
            .unwrap();
        let layers: Vec<usize> = trace.iter().map(|t| t.layer).collect();
        let want_layers: Vec<usize> = exp.router_topk[i]
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
            let want = &exp.router_topk[i][&layer.to_string()];
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
    let exp = expected();
    for (i, steps) in exp.step_margins.iter().enumerate() {
        let min = steps.iter().map(|s| s[0]).fold(f32::INFINITY, f32::min);
        assert!((min - exp.min_margin[i]).abs() < 1e-6, "prompt {i}: {min}");
        assert_eq!(steps.len(), exp.greedy_ids[i].len());
    }
}

#[test]
fn decode_with_the_cache_equals_one_full_pass() {
    // Logits of each generated position, computed incrementally through the compressed KV cache
    // (decode steps attend in latent space), equal those of one forward pass over prompt +
    // continuation (which decompresses the latent through kv_b). Prompt 2 (23 tokens) also
    // goes through one mid-sequence chunk of 3 tokens.
    let exp = expected();
    let model = load_model(&fixture(), QuantScheme::Unquantized, KernelFamily::Portable);
    let vocab = model.info().vocab_size;
    for i in [1, 2] {
        let prompt = &exp.prompt_ids[i];
        let cont = &exp.greedy_ids[i];
        let full: Vec<u32> = prompt.iter().chain(cont).copied().collect();
        let all = forward(model.as_ref(), &full, LogitsFor::All);

        let mut cache = ContiguousKvCache::new(model.info().kv_layout.clone());
        let seq = cache.allocate();
        let mut pos = 0;
        let mut chunks: Vec<Vec<u32>> = vec![prompt.clone()];
        if i == 2 {
            chunks = vec![prompt[..20].to_vec(), prompt[20..].to_vec()];
        }
        chunks.extend(cont.iter().map(|&t| vec![t]));
        let mut worst = 0f32;
        for (step, chunk) in chunks.iter().enumerate() {
            let c = SeqChunk {
                seq,
                tokens: chunk.clone(),
                start_pos: pos,
            };
            let got = model
                .forward(&[c], &mut cache, LogitsFor::Last)
                .unwrap()
                .to_f32_vec()
                .unwrap();
            pos += chunk.len();
            let row = &all[(pos - 1) * vocab..pos * vocab];
            let err = max_abs_diff(&got, row);
            worst = worst.max(err);
            assert!(err <= f32_tol(row), "prompt {i} step {step}: {err}");
        }
        println!("prompt {i}: incremental vs full pass, max |Δlogit| {worst:.2e}");
    }
}

#[test]
fn tokenizer_encodes_the_prompts_as_transformers_did() {
    let exp = expected();
    let tok = fmoe_models::Tokenizer::from_file(&fixture().join("tokenizer.json")).unwrap();
    for (text, ids) in exp.prompts.iter().zip(&exp.prompt_ids) {
        assert_eq!(&tok.encode(text, true).unwrap(), ids, "{text:?}");
    }
}

#[test]
fn both_config_layouts_load_to_the_same_model() {
    let src = fixture();
    let tmp = tempdir();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), tmp.join(f)).unwrap();
    }
    std::fs::copy(src.join("config.v4.json"), tmp.join("config.json")).unwrap();
    let exp = expected();
    let v5 = load_model(&src, QuantScheme::Unquantized, KernelFamily::Portable);
    let v4 = load_model(&tmp, QuantScheme::Unquantized, KernelFamily::Portable);
    for p in &exp.prompt_ids {
        assert_eq!(prefill(v5.as_ref(), p), prefill(v4.as_ref(), p));
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "fmoe-ds-golden-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
