//! Golden tests: tiny Mixtral (tests/fixtures/tiny-mixtral, made by transformers 5.17 with f32
//! compute over bf16 weights) against transformers' prefill logits and greedy continuations, for
//! every MoE method × kernel family.
//!
//! Tolerances:
//! - Unquantized: fmoe computes in f32 from the same bf16 weights, so the only differences are
//!   f32 summation order: |Δlogit| ≤ `common::f32_tol` = 1e-4·(1 + max|logit|) (two layers, a few
//!   hundred-term dot products at u = 6e-8 each; measured about 1e-6). Greedy must match exactly.
//! - fp8 (MoE weights and activations in e4m3, u = 2^-4; dense layers stay f32 over bf16): the
//!   logits' relative 2-norm error is held to the MoE layer's documented worst case,
//!   (1 + 2^-4)^4 − 1 ≈ 0.27 (four e4m3 roundings: a1, w13, a2, w2; fmoe-moe's `QUANT_TOL`).
//!   For scale: the fixture's own bf16-compute run differs from f32 by 0.03–0.09 in max |Δlogit|,
//!   and e4m3's unit roundoff is 16× bf16's. Greedy is required to match for a prompt only where
//!   its smallest top-1/top-2 margin over the 16 steps (`min_margin`) exceeds twice the measured
//!   max |Δlogit| at prefill; otherwise the match is reported, not required.

mod common;

use std::path::PathBuf;

use common::{Expected, Target, load_model};
use fmoe_engine::{GenerateParams, generate};
use fmoe_models::{LoadOptions, load};
use fmoe_moe::{KernelFamily, QuantScheme};

fn fixture() -> PathBuf {
    common::fixture("tiny-mixtral")
}

fn expected() -> Expected {
    common::read_expected(&fixture())
}

#[test]
fn every_method_and_kernel_matches_transformers() {
    common::every_method_and_kernel_matches_transformers(
        Target::Host,
        &fixture(),
        &expected(),
        &load_model,
        None,
    );
}

#[test]
fn fixture_margins_are_what_the_tests_assume() {
    common::fixture_margins_are_what_the_tests_assume(&expected());
}

#[test]
fn decode_with_the_cache_equals_one_full_pass() {
    // Logits of each generated position, computed incrementally through the KV cache, equal the
    // logits of one forward pass over prompt + continuation.
    let exp = expected();
    let model = load_model(&fixture(), QuantScheme::Unquantized, KernelFamily::Portable);
    let mut chunks = vec![exp.prompt_ids[1].clone()];
    chunks.extend(exp.greedy_ids[1].iter().map(|&t| vec![t]));
    common::decode_with_the_cache_equals_one_full_pass(Target::Host, &model, &chunks, "");
}

#[test]
fn tokenizer_encodes_the_prompts_as_transformers_did() {
    common::tokenizer_encodes_the_prompts_as_transformers_did(&fixture(), &expected());
}

#[test]
fn stop_strings_cut_the_text() {
    let exp = expected();
    let loaded = load(&fixture(), &LoadOptions::default()).unwrap();
    let full = loaded
        .tokenizer
        .as_ref()
        .unwrap()
        .decode(&exp.greedy_ids[0])
        .unwrap();
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
    let model: std::sync::Arc<dyn fmoe_models::CausalLm> = std::sync::Arc::from(loaded.model);
    let config = fmoe_engine::EngineArgs::default().resolve(&model).unwrap();
    let mut engine = fmoe_engine::Engine::new(model, loaded.tokenizer, config).unwrap();
    let g = generate(&mut engine, &exp.prompt_ids[..1], &params).unwrap();
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
    common::both_config_layouts_load_to_the_same_model(
        &fixture(),
        "fmoe-golden",
        &expected(),
        &load_model,
    );
}
