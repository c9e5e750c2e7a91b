//! The engine under pressure on the CPU: a pool of a few blocks, a token budget smaller than the
//! prompts and four sequences at once, so chunked prefill, preemption and prefix-cache hits all
//! happen (each asserted), with requests arriving in a seeded random order while the engine
//! steps. Greedy ids must equal transformers' (unquantized) and each request run alone (every
//! method whose numerics do not depend on the batch), sampled ids must not depend on the batch,
//! and 10,000 requests must leave the pool empty and the memory flat.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use common::{Expected, Target, load_model_on};
use fmoe_engine::{
    Engine, EngineConfig, FinishReason, Request, RequestParams, SamplingParams, SchedulerConfig,
};
use fmoe_models::CausalLm;
use fmoe_moe::{KernelFamily, QuantScheme};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn config(num_blocks: usize, block_size: usize, seqs: usize, tokens: usize) -> EngineConfig {
    EngineConfig {
        block_size,
        num_blocks,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: tokens,
            max_num_seqs: seqs,
        },
        prefix_caching: true,
        seed: 0,
    }
}

/// Runs `reqs` through `engine`, adding them in a seeded random interleaving with steps;
/// returns each request's generated ids (in `reqs` order) and finish reasons.
fn run_arrivals(
    engine: &mut Engine,
    reqs: &[Request],
    seed: u64,
) -> (Vec<Vec<u32>>, Vec<FinishReason>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let mut ids = vec![Vec::new(); reqs.len()];
    let mut reasons = vec![None; reqs.len()];
    let mut of: HashMap<u64, usize> = HashMap::new();
    let mut next = 0;
    while next < order.len() || engine.has_unfinished() {
        // Zero to three arrivals before each step.
        for _ in 0..rng.random_range(0..=3) {
            if next < order.len() {
                let i = order[next];
                of.insert(engine.add_request(reqs[i].clone()).unwrap(), i);
                next += 1;
            }
        }
        for out in engine.step().unwrap() {
            let i = of[&out.id];
            ids[i].extend(&out.new_token_ids);
            if let Some(r) = out.finish_reason {
                assert!(reasons[i].is_none(), "request {i} finished twice");
                reasons[i] = Some(r);
            }
        }
    }
    (ids, reasons.into_iter().map(Option::unwrap).collect())
}

fn alone(model: &Arc<dyn CausalLm>, req: &Request) -> Vec<u32> {
    let mut e = Engine::new(model.clone(), None, config(64, 16, 1, 4096)).unwrap();
    let (ids, _) = run_arrivals(&mut e, std::slice::from_ref(req), 0);
    assert_eq!(e.stats().preemptions, 0);
    ids.into_iter().next().unwrap()
}

fn greedy(prompt: &[u32], max_tokens: usize) -> Request {
    Request {
        prompt: prompt.to_vec(),
        params: RequestParams {
            max_tokens,
            ignore_eos: true,
            ..RequestParams::default()
        },
    }
}

fn arrivals_under_pressure(name: &str, target: Target) {
    let dir = common::fixture(name);
    let exp: Expected = common::read_expected(&dir);
    let steps = exp.greedy_ids[0].len();
    // 32 requests over the fixture's prompts, some truncated, so prompts share prefixes.
    let reqs: Vec<Request> = (0..32)
        .map(|i| {
            let p = &exp.prompt_ids[i % exp.prompt_ids.len()];
            greedy(p, steps)
        })
        .collect();
    let longest = reqs.iter().map(|r| r.prompt.len()).max().unwrap() + steps;
    let block_size = 4;
    // One request fits (longest / 4 blocks), a few running ones do not.
    let num_blocks = longest.div_ceil(block_size) + 3;
    for scheme in QuantScheme::ALL {
        for family in KernelFamily::ALL {
            let model = load_model_on(target, &dir, scheme, family);
            let mut engine =
                Engine::new(model.clone(), None, config(num_blocks, block_size, 4, 8)).unwrap();
            let (ids, reasons) = run_arrivals(&mut engine, &reqs, 7);
            let s = engine.stats();
            println!("{name} {scheme}/{family}: {s:?}");
            assert!(
                s.preemptions > 0,
                "{scheme}/{family}: no preemption happened"
            );
            assert!(s.prefix_cache_hits > 0, "{scheme}/{family}: no prefix hit");
            assert_eq!(s.used_blocks, 0, "{scheme}/{family}: blocks left in use");
            assert!(s.peak_blocks <= num_blocks);
            assert!(reasons.iter().all(|r| *r == FinishReason::Length));
            // Per-tensor fp8 scales its activations by the whole batch's amax: its tokens may
            // depend on what else is in the step, so only its lengths are checked here. On CUDA
            // the GEMM tiles change with the batch too (bf16 rounding apart, the same sums):
            // there the unquantized path is held to equality.
            let exact = match target {
                Target::Cuda => scheme == QuantScheme::Unquantized,
                _ => scheme != QuantScheme::Fp8PerTensor,
            };
            if !exact {
                assert!(ids.iter().all(|t| t.len() == steps));
                continue;
            }
            let mut solo: HashMap<Vec<u32>, Vec<u32>> = HashMap::new();
            for (i, r) in reqs.iter().enumerate() {
                let want = solo
                    .entry(r.prompt.clone())
                    .or_insert_with(|| alone(&model, r));
                assert_eq!(
                    &ids[i], want,
                    "{scheme}/{family} request {i}: batched vs alone"
                );
                if scheme == QuantScheme::Unquantized && target == Target::Host {
                    let p = i % exp.prompt_ids.len();
                    assert_eq!(ids[i], exp.greedy_ids[p], "request {i}: vs transformers");
                }
            }
        }
    }
}

#[test]
fn mixtral_arrivals_under_pressure_match_alone_and_transformers() {
    arrivals_under_pressure("tiny-mixtral", Target::Host);
}

#[test]
fn deepseek_v3_arrivals_under_pressure_match_alone_and_transformers() {
    arrivals_under_pressure("tiny-deepseek-v3", Target::Host);
}

#[test]
fn cuda_arrivals_under_pressure_match_alone() {
    if !common::cuda_or_skip() {
        return;
    }
    arrivals_under_pressure("tiny-mixtral", Target::Cuda);
    arrivals_under_pressure("tiny-deepseek-v3", Target::Cuda);
}

fn tiny(dir: &Path) -> Arc<dyn CausalLm> {
    load_model_on(
        Target::Host,
        dir,
        QuantScheme::Unquantized,
        KernelFamily::Portable,
    )
}

#[test]
fn seeded_samples_do_not_depend_on_the_batch() {
    let dir = common::fixture("tiny-mixtral");
    let exp: Expected = common::read_expected(&dir);
    let model = tiny(&dir);
    let sampled = |p: usize, seed| Request {
        prompt: exp.prompt_ids[p].clone(),
        params: RequestParams {
            max_tokens: 12,
            ignore_eos: true,
            sampling: SamplingParams {
                temperature: 1.0,
                top_p: 0.9,
                top_k: 20,
                seed: 0,
            },
            seed: Some(seed),
            ..RequestParams::default()
        },
    };
    let reqs: Vec<Request> = (0..12)
        .map(|i| sampled(i % 3, 100 + i as u64 % 4))
        .collect();
    let mut e = Engine::new(model.clone(), None, config(12, 4, 4, 8)).unwrap();
    let (ids, _) = run_arrivals(&mut e, &reqs, 3);
    assert!(e.stats().preemptions > 0);
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(ids[i], alone(&model, r), "request {i}");
    }
    // Different seeds do sample differently (the test would pass vacuously otherwise).
    assert_ne!(alone(&model, &sampled(0, 1)), alone(&model, &sampled(0, 2)));
}

#[test]
fn abort_frees_blocks_and_unfit_requests_are_refused() {
    let dir = common::fixture("tiny-mixtral");
    let exp: Expected = common::read_expected(&dir);
    let model = tiny(&dir);
    let mut e = Engine::new(model, None, config(8, 4, 4, 8)).unwrap();
    let a = e.add_request(greedy(&exp.prompt_ids[0], 10)).unwrap();
    let b = e.add_request(greedy(&exp.prompt_ids[1], 10)).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.stats().used_blocks > 0);
    assert!(e.abort(a));
    assert!(!e.abort(a));
    let out = e.step().unwrap();
    assert!(
        out.iter()
            .any(|o| o.id == a && o.finish_reason == Some(FinishReason::Abort))
    );
    assert!(e.abort(b));
    e.step().unwrap();
    assert_eq!(e.stats().used_blocks, 0);
    assert!(!e.has_unfinished());
    // 8 blocks of 4 hold 32 tokens: 23 + 10 do not fit, whatever else runs.
    let err = e
        .add_request(greedy(&exp.prompt_ids[2], 10))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("33 tokens") && err.contains("holds 32"),
        "{err}"
    );
    let err = e.add_request(greedy(&[], 1)).unwrap_err().to_string();
    assert!(err.contains("no tokens"), "{err}");
    let err = e
        .add_request(greedy(&[100_000], 1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("token id 100000"), "{err}");
}

fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn ten_thousand_requests_leave_the_pool_empty_and_memory_flat() {
    let dir = common::fixture("tiny-mixtral");
    let model = tiny(&dir);
    let mut e = Engine::new(model, None, config(64, 4, 16, 64)).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut finished = 0usize;
    let mut run = |e: &mut Engine, n: usize, finished: &mut usize| {
        let mut added = 0;
        while added < n || e.has_unfinished() {
            while added < n && e.stats().waiting < 32 {
                let len = rng.random_range(1..6);
                let prompt: Vec<u32> = (0..len).map(|_| rng.random_range(1..500)).collect();
                e.add_request(greedy(&prompt, rng.random_range(1..4)))
                    .unwrap();
                added += 1;
            }
            for o in e.step().unwrap() {
                if o.finish_reason.is_some() {
                    *finished += 1;
                }
            }
        }
    };
    run(&mut e, 1000, &mut finished);
    let before = resident_bytes();
    run(&mut e, 9000, &mut finished);
    let after = resident_bytes();
    assert_eq!(finished, 10_000);
    let s = e.stats();
    assert_eq!(s.used_blocks, 0);
    assert_eq!((s.running, s.waiting), (0, 0));
    println!("resident {before} → {after} bytes over 9000 requests; {s:?}");
    assert!(
        after < before + (16 << 20),
        "resident memory grew from {before} to {after} bytes"
    );
}
