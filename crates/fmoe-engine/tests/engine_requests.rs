//! What a request can ask of the engine, each against an independent reference on the CPU:
//! logprobs of generated tokens and of the prompt against an f64 log-softmax of one
//! teacher-forced pass, `n` samples, stop token ids, stop strings through the incremental
//! detokenizer, and the engine thread's streams (a dropped stream aborts its request).

mod common;

use std::sync::Arc;

use common::{Expected, Target, load_model_on};
use fmoe_engine::{
    Engine, EngineConfig, EngineHandle, FinishReason, LogitsFor, Request, RequestOutput,
    RequestParams, SamplingParams, SchedulerConfig,
};
use fmoe_models::CausalLm;
use fmoe_moe::{KernelFamily, QuantScheme};

fn config(num_blocks: usize) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_blocks,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 8,
            max_num_seqs: 4,
        },
        prefix_caching: true,
        seed: 0,
    }
}

fn model() -> (Arc<dyn CausalLm>, Expected) {
    let dir = common::fixture("tiny-mixtral");
    let exp = common::read_expected(&dir);
    (
        load_model_on(
            Target::Host,
            &dir,
            QuantScheme::Unquantized,
            KernelFamily::Portable,
        ),
        exp,
    )
}

/// Every output of `reqs` run to the end.
fn run(engine: &mut Engine, reqs: Vec<Request>) -> Vec<Vec<RequestOutput>> {
    let ids: Vec<u64> = reqs
        .into_iter()
        .map(|r| engine.add_request(r).unwrap())
        .collect();
    let mut outs = vec![Vec::new(); ids.len()];
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            let i = ids.iter().position(|&id| id == o.id).unwrap();
            outs[i].push(o);
        }
    }
    outs
}

/// log-softmax of `row` at `token`, in f64.
fn log_softmax(row: &[f32], token: u32) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row[token as usize] as f64 - max - z.ln()
}

#[test]
fn logprobs_of_prompt_and_generated_tokens_match_one_teacher_forced_pass() {
    let (m, exp) = model();
    let prompt = exp.prompt_ids[2].clone();
    let mut e = Engine::new(m.clone(), None, config(40)).unwrap();
    let req = Request {
        prompt: prompt.clone(),
        params: RequestParams {
            max_tokens: 6,
            ignore_eos: true,
            logprobs: Some(3),
            prompt_logprobs: Some(2),
            ..RequestParams::default()
        },
    };
    let outs = run(&mut e, vec![req]).remove(0);
    let generated: Vec<u32> = outs.iter().flat_map(|o| o.new_token_ids.clone()).collect();
    assert_eq!(generated, exp.greedy_ids[2][..6]);
    // The prompt (23 tokens) went in chunks of at most 8: logprobs came from several steps.
    let prompt_lp = outs
        .iter()
        .find_map(|o| o.prompt_logprobs.clone())
        .expect("prompt logprobs");
    assert_eq!(prompt_lp.len(), prompt.len());
    assert!(prompt_lp[0].is_none());
    // One pass over prompt + continuation gives every position's logits.
    let full: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    let logits = common::forward(&m, &full, LogitsFor::All);
    let vocab = m.info().vocab_size;
    let row = |p: usize| &logits[p * vocab..(p + 1) * vocab];
    for (i, lp) in prompt_lp.iter().enumerate().skip(1) {
        let lp = lp.as_ref().unwrap();
        assert_eq!(lp.token, prompt[i]);
        let want = log_softmax(row(i - 1), prompt[i]);
        assert!(
            (lp.logprob as f64 - want).abs() < 1e-4,
            "prompt {i}: {} vs {want}",
            lp.logprob
        );
        assert_eq!(lp.top.len(), 2);
        assert!(lp.top[0].1 >= lp.top[1].1);
    }
    let gen_lp: Vec<_> = outs.iter().flat_map(|o| o.logprobs.clone()).collect();
    assert_eq!(gen_lp.len(), 6);
    for (s, lp) in gen_lp.iter().enumerate() {
        let p = prompt.len() - 1 + s;
        let want = log_softmax(row(p), generated[s]);
        assert!((lp.logprob as f64 - want).abs() < 1e-4, "step {s}");
        // Greedy: the chosen token is the most likely one.
        assert_eq!(lp.top[0].0, generated[s]);
        assert_eq!(lp.top.len(), 3);
    }
    // max_tokens 0: only the prompt runs, and its logprobs still come.
    let req = Request {
        prompt: prompt.clone(),
        params: RequestParams {
            max_tokens: 0,
            prompt_logprobs: Some(0),
            ..RequestParams::default()
        },
    };
    let outs = run(&mut e, vec![req]).remove(0);
    assert!(outs.iter().all(|o| o.new_token_ids.is_empty()));
    let lp = outs.iter().find_map(|o| o.prompt_logprobs.clone()).unwrap();
    let sum: f64 = lp.iter().flatten().map(|l| l.logprob as f64).sum();
    let want: f64 = (1..prompt.len())
        .map(|i| log_softmax(row(i - 1), prompt[i]))
        .sum();
    assert!((sum - want).abs() < 1e-3, "{sum} vs {want}");
    assert_eq!(
        outs.last().unwrap().finish_reason,
        Some(FinishReason::Length)
    );
}

#[test]
fn n_samples_stop_token_ids_and_stop_strings() {
    let (m, exp) = model();
    let mut e = Engine::new(m.clone(), None, config(60)).unwrap();
    let sampled = |n| Request {
        prompt: exp.prompt_ids[0].clone(),
        params: RequestParams {
            max_tokens: 10,
            ignore_eos: true,
            n,
            seed: Some(5),
            sampling: SamplingParams {
                temperature: 1.0,
                ..SamplingParams::default()
            },
            ..RequestParams::default()
        },
    };
    let outs = run(&mut e, vec![sampled(3)]).remove(0);
    let mut per: Vec<Vec<u32>> = vec![Vec::new(); 3];
    for o in &outs {
        per[o.index].extend(&o.new_token_ids);
    }
    assert!(per.iter().all(|p| p.len() == 10));
    assert!(
        per[0] != per[1] || per[1] != per[2],
        "three samples alike: {per:?}"
    );
    // Sample 0 of n = 3 is the n = 1 request with the same seed.
    let one = run(&mut e, vec![sampled(1)]).remove(0);
    let one: Vec<u32> = one.iter().flat_map(|o| o.new_token_ids.clone()).collect();
    assert_eq!(one, per[0]);

    // A stop token id ends generation with that token kept.
    let stop = exp.greedy_ids[1][3];
    let first = exp.greedy_ids[1].iter().position(|&t| t == stop).unwrap();
    let req = Request {
        prompt: exp.prompt_ids[1].clone(),
        params: RequestParams {
            max_tokens: 16,
            stop_token_ids: vec![stop],
            ignore_eos: true,
            ..RequestParams::default()
        },
    };
    let outs = run(&mut e, vec![req]).remove(0);
    let ids: Vec<u32> = outs.iter().flat_map(|o| o.new_token_ids.clone()).collect();
    assert_eq!(ids, exp.greedy_ids[1][..=first]);
    assert_eq!(
        outs.last().unwrap().finish_reason,
        Some(FinishReason::StopToken(stop))
    );
}

#[test]
fn text_deltas_add_up_to_the_decoded_text_and_stop_strings_cut_it() {
    let dir = common::fixture("tiny-mixtral");
    let exp: Expected = common::read_expected(&dir);
    let loaded = fmoe_models::load(&dir, &fmoe_models::LoadOptions::default()).unwrap();
    let tok = loaded.tokenizer.unwrap();
    let full = tok.decode(&exp.greedy_ids[2]).unwrap();
    let m: Arc<dyn CausalLm> = Arc::from(loaded.model);
    let mut e = Engine::new(m, Some(tok), config(60)).unwrap();
    let req = |stop: Vec<String>| Request {
        prompt: exp.prompt_ids[2].clone(),
        params: RequestParams {
            max_tokens: 16,
            ignore_eos: true,
            stop,
            ..RequestParams::default()
        },
    };
    let outs = run(&mut e, vec![req(vec![])]).remove(0);
    let text: String = outs.iter().map(|o| o.text_delta.as_str()).collect();
    assert_eq!(text, full);
    // A stop string from the middle of the text (three characters after the first five).
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 8, "{full:?}");
    let s: String = chars[5..8].iter().collect();
    let at = full.find(&s).unwrap();
    let outs = run(&mut e, vec![req(vec![s.clone()])]).remove(0);
    let text: String = outs.iter().map(|o| o.text_delta.as_str()).collect();
    assert_eq!(text, full[..at]);
    assert_eq!(
        outs.last().unwrap().finish_reason,
        Some(FinishReason::Stop(s))
    );
}

#[test]
fn the_engine_thread_streams_outputs_and_a_dropped_stream_aborts() {
    let (m, exp) = model();
    let (handle, thread) = EngineHandle::spawn(Engine::new(m, None, config(60)).unwrap());
    let greedy = |max_tokens| Request {
        prompt: exp.prompt_ids[1].clone(),
        params: RequestParams {
            max_tokens,
            ignore_eos: true,
            ..RequestParams::default()
        },
    };
    let mut a = handle.add(greedy(16)).unwrap();
    let mut ids = Vec::new();
    let mut last = None;
    while let Some(o) = a.outputs.blocking_recv() {
        ids.extend(o.new_token_ids);
        last = o.finish_reason;
    }
    assert_eq!(ids, exp.greedy_ids[1]);
    assert_eq!(last, Some(FinishReason::Length));
    // A long request whose stream is dropped after its first token: aborted, blocks back.
    let mut b = handle.add(greedy(200)).unwrap();
    let first = b.outputs.blocking_recv().unwrap();
    assert_eq!(first.new_token_ids.len(), 1);
    drop(b);
    let mut freed = false;
    for _ in 0..200 {
        let (s, _) = handle.stats().unwrap();
        if s.used_blocks == 0 && s.running == 0 {
            freed = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(freed, "the dropped request still holds blocks");
    let err = handle.add(greedy(1000)).err().unwrap().to_string();
    assert!(err.contains("KV pool holds"), "{err}");
    drop(handle);
    thread.join().unwrap();
}
