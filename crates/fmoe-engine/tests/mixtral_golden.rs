//! Golden tests: tiny Mixtral (tests/fixtures/tiny-mixtral, made by transformers 5.17 with f32
//! compute over bf16 weights) against transformers' prefill logits and greedy continuations, for
//! every MoE method × kernel family.
//!
//! Tolerances:
//! - Unquantized: fmoe computes in f32 from the same bf16 weights, so the only differences are
//!   f32 summation order: |Δlogit| ≤ `F32_TOL` = 1e-4·(1 + max|logit|) (two layers, a few
//!   hundred-term dot products at u = 6e-8 each; measured about 1e-6). Greedy must match exactly.
//! - fp8 (MoE weights and activations in e4m3, u = 2^-4; dense layers stay f32 over bf16): the
//!   logits' relative 2-norm error is held to the MoE layer's documented worst case,
//!   (1 + 2^-4)^4 − 1 ≈ 0.27 (four e4m3 roundings: a1, w13, a2, w2; fmoe-moe's `QUANT_TOL`).
//!   For scale: the fixture's own bf16-compute run differs from f32 by 0.03–0.09 in max |Δlogit|,
//!   and e4m3's unit roundoff is 16× bf16's. Greedy is required to match for a prompt only where
//!   its smallest top-1/top-2 margin over the 16 steps (`min_margin`) exceeds twice the measured
//!   max |Δlogit| at prefill; otherwise the match is reported, not required.

use std::path::{Path, PathBuf};

use fmoe_core::env::FusedSwitches;
use fmoe_engine::{ContiguousKvCache, GenerateParams, SamplingParams, generate};
use fmoe_models::{CausalLm, LoadOptions, LogitsFor, MoeOptions, SeqChunk, load};
use fmoe_moe::{KernelFamily, QuantScheme};
use serde::Deserialize;

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
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-mixtral")
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

fn load_model(dir: &Path, scheme: QuantScheme, family: KernelFamily) -> Box<dyn CausalLm> {
    let opts = LoadOptions {
        moe: MoeOptions {
            scheme: Some(scheme),
            switches: switches(family),
            ..MoeOptions::default()
        },
        ..LoadOptions::default()
    };
    load(dir, &opts).unwrap().model
}

/// Last-position logits of each prompt, each prefilled alone.
fn prefill(model: &dyn CausalLm, prompt: &[u32]) -> Vec<f32> {
    let mut cache = ContiguousKvCache::new(model.info().kv_layout.clone());
    let seq = cache.allocate();
    let chunk = SeqChunk {
        seq,
        tokens: prompt.to_vec(),
        start_pos: 0,
    };
    model
        .forward(&[chunk], &mut cache, LogitsFor::Last)
        .unwrap()
        .to_f32_vec()
        .unwrap()
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

/// (measured error, tolerance) in the measure each scheme is held to.
fn error_and_tolerance(scheme: QuantScheme, got: &[f32], want: &[f32]) -> (f32, f32) {
    match scheme {
        QuantScheme::Unquantized => (max_abs_diff(got, want), 1e-4 * (1.0 + max_abs(want))),
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
            // Teacher-forced: one pass over prompt + expected continuation; at every step whose
            // margin exceeds twice the prefill error the argmax must be transformers' token.
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
            // All prompts in one batch: prefill of different lengths, then batched decode.
            let g = generate(model.as_ref(), None, &exp.prompt_ids, &params).unwrap();
            for (i, out) in g.outputs.iter().enumerate() {
                let matches = out.token_ids == exp.greedy_ids[i];
                let required =
                    scheme == QuantScheme::Unquantized || exp.min_margin[i] > 2.0 * worst;
                println!(
                    "{scheme:>11}/{family:<8} prompt {i}: worst prefill max |Δlogit| {worst:.2e}, min margin {:.3}, greedy {} ({})",
                    exp.min_margin[i],
                    if matches { "matches" } else { "differs" },
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
    let mut cache = ContiguousKvCache::new(model.info().kv_layout.clone());
    let seq = cache.allocate();
    let chunk = SeqChunk {
        seq,
        tokens: full,
        start_pos: 0,
    };
    let all = model
        .forward(&[chunk], &mut cache, LogitsFor::All)
        .unwrap()
        .to_f32_vec()
        .unwrap();
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
    // Logits of each generated position, computed incrementally through the KV cache, equal the
    // logits of one forward pass over prompt + continuation.
    let exp = expected();
    let model = load_model(&fixture(), QuantScheme::Unquantized, KernelFamily::Portable);
    let prompt = &exp.prompt_ids[1];
    let cont = &exp.greedy_ids[1];
    let full: Vec<u32> = prompt.iter().chain(cont).copied().collect();
    let vocab = model.info().vocab_size;

    let mut cache = ContiguousKvCache::new(model.info().kv_layout.clone());
    let seq = cache.allocate();
    let one = SeqChunk {
        seq,
        tokens: full.clone(),
        start_pos: 0,
    };
    let all = model
        .forward(&[one], &mut cache, LogitsFor::All)
        .unwrap()
        .to_f32_vec()
        .unwrap();

    let mut cache = ContiguousKvCache::new(model.info().kv_layout.clone());
    let seq = cache.allocate();
    let mut pos = 0;
    let mut chunk = prompt.clone();
    for step in 0..=cont.len() {
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
        assert!(err <= 1e-4 * (1.0 + max_abs(row)), "step {step}: {err}");
        if step < cont.len() {
            chunk = vec![cont[step]];
        }
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
fn stop_strings_cut_the_text() {
    let exp = expected();
    let loaded = load(&fixture(), &LoadOptions::default()).unwrap();
    let tok = loaded.tokenizer.as_ref().unwrap();
    let full = tok.decode(&exp.greedy_ids[0]).unwrap();
    // The first ASCII word of three or more letters in the greedy text, as a stop string.
    let word = full
        .split(|c: char| !c.is_ascii_alphabetic())
        .find(|w| w.len() >= 3)
        .expect("greedy text has a word")
        .to_string();
    let at = full.find(&word).unwrap();
    let params = GenerateParams {
        max_tokens: exp.greedy_ids[0].len(),
        stop: vec!["never appears \u{0}".into(), word.clone()],
        ..GenerateParams::default()
    };
    let g = generate(
        loaded.model.as_ref(),
        Some(tok),
        &exp.prompt_ids[..1],
        &params,
    )
    .unwrap();
    let out = &g.outputs[0];
    assert_eq!(
        out.finish_reason,
        fmoe_engine::FinishReason::Stop(word.clone())
    );
    assert_eq!(out.text.as_deref(), Some(&full[..at]));
    assert!(out.token_ids.len() < exp.greedy_ids[0].len());
    assert_eq!(out.token_ids[..], exp.greedy_ids[0][..out.token_ids.len()]);
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
        "fmoe-golden-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
