//! `generate`: a thin loop over the [`Engine`]: every prompt a request, steps until all finish,
//! the outputs in prompt order with timings.

use std::time::Instant;

use crate::Result;
use crate::engine::{Engine, EngineStats};
use crate::request::{FinishReason, Request, RequestParams};
use crate::sampler::SamplingParams;

/// What to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    /// Most new tokens per prompt.
    pub max_tokens: usize,
    /// Prompt `i` samples with seed `sampling.seed + i`.
    pub sampling: SamplingParams,
    /// Stop when the decoded text contains one of these (the text is cut before it; needs a
    /// tokenizer).
    pub stop: Vec<String>,
    /// Keep going past the model's EOS ids.
    pub ignore_eos: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 16,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// One prompt's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    pub prompt_tokens: usize,
    /// Generated ids only (an EOS that ended generation included).
    pub token_ids: Vec<u32>,
    /// Decoded generated text (special tokens skipped, cut at a stop string); None without a
    /// tokenizer.
    pub text: Option<String>,
    pub finish_reason: FinishReason,
}

/// Timings of a [`generate`] call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Seconds in steps that ran a prompt chunk (their sampling included).
    pub prefill_s: f64,
    /// Seconds in steps that only decoded.
    pub decode_s: f64,
    pub decode_steps: usize,
    /// Tokens sampled in decode-only steps.
    pub decode_tokens: usize,
    /// The engine's counters after the call.
    pub engine: EngineStats,
}

impl Stats {
    /// Generated tokens per second of the whole call.
    pub fn tokens_per_s(&self) -> f64 {
        rate(self.generated_tokens as f64, self.prefill_s + self.decode_s)
    }
    /// Tokens per second of decode-only steps.
    pub fn decode_tokens_per_s(&self) -> f64 {
        rate(self.decode_tokens as f64, self.decode_s)
    }
    pub fn prefill_tokens_per_s(&self) -> f64 {
        rate(self.prompt_tokens as f64, self.prefill_s)
    }
}

fn rate(n: f64, s: f64) -> f64 {
    if s > 0.0 { n / s } else { 0.0 }
}

/// The result of a [`generate`] call: one output per prompt, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub outputs: Vec<Output>,
    pub stats: Stats,
}

/// Generates a continuation of every prompt (token ids) through `engine`, which must be idle.
pub fn generate(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    params: &GenerateParams,
) -> Result<Generation> {
    params.sampling.validate()?;
    if engine.has_unfinished() {
        return Err(crate::Error::Request(
            "generate needs an idle engine".into(),
        ));
    }
    let with_text = engine.tokenizer().is_some();
    let mut outputs: Vec<Output> = prompts
        .iter()
        .map(|p| Output {
            prompt_tokens: p.len(),
            token_ids: Vec::new(),
            text: with_text.then(String::new),
            finish_reason: FinishReason::Length,
        })
        .collect();
    let mut stats = Stats {
        prompt_tokens: prompts.iter().map(Vec::len).sum(),
        ..Stats::default()
    };
    let mut ids = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let req = Request {
            prompt: p.clone(),
            params: RequestParams {
                max_tokens: params.max_tokens,
                sampling: params.sampling,
                seed: Some(params.sampling.seed.wrapping_add(i as u64)),
                stop: params.stop.clone(),
                ignore_eos: params.ignore_eos,
                ..RequestParams::default()
            },
        };
        match engine.add_request(req) {
            Ok(id) => ids.push(id),
            Err(e) => {
                for id in ids {
                    engine.abort(id);
                }
                engine.step()?;
                return Err(crate::Error::Request(format!("prompt {i}: {e}")));
            }
        }
    }
    let index_of: std::collections::HashMap<u64, usize> =
        ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let mut unfinished = if params.max_tokens == 0 {
        0
    } else {
        prompts.len()
    };
    if params.max_tokens == 0 {
        for id in ids.clone() {
            engine.abort(id);
        }
        engine.step()?;
    }
    while unfinished > 0 {
        let t0 = Instant::now();
        let step = engine.step()?;
        let dt = t0.elapsed().as_secs_f64();
        let mut sampled = 0;
        let mut prefill = false;
        for out in step {
            let Some(&i) = index_of.get(&out.id) else {
                continue;
            };
            let o = &mut outputs[i];
            if o.token_ids.is_empty() && !out.new_token_ids.is_empty() {
                prefill = true;
            }
            sampled += out.new_token_ids.len();
            o.token_ids.extend(&out.new_token_ids);
            if let Some(t) = &mut o.text {
                t.push_str(&out.text_delta);
            }
            if let Some(reason) = out.finish_reason {
                if let FinishReason::Error(e) = &reason {
                    // Leave the engine idle: the other prompts' requests go too.
                    for &id in &ids {
                        engine.abort(id);
                    }
                    engine.step()?;
                    return Err(crate::Error::Request(format!("prompt {i}: {e}")));
                }
                o.finish_reason = reason;
                unfinished -= 1;
            }
        }
        if prefill || sampled == 0 {
            stats.prefill_s += dt;
        } else {
            stats.decode_s += dt;
            stats.decode_steps += 1;
            stats.decode_tokens += sampled;
        }
    }
    stats.generated_tokens = outputs.iter().map(|o| o.token_ids.len()).sum();
    stats.engine = engine.stats();
    Ok(Generation { outputs, stats })
}
