//! The generation loop: prefill every prompt in one forward pass, then decode one token per live
//! sequence per pass until each stops (max tokens, an EOS id, a stop string, or the model's last
//! position).

use std::time::Instant;

use fmoe_models::{CausalLm, LogitsFor, SeqChunk, SeqId, Tokenizer};

use crate::kv_cache::ModelKvCache;
use crate::sampler::{Sampler, SamplingParams};
use crate::{Error, Result};

/// What to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    /// Most new tokens per prompt.
    pub max_tokens: usize,
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

/// Why a sequence stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached (or the model's last position).
    Length,
    /// An EOS token was generated (it is the last of `token_ids`).
    Eos,
    /// The text reached this stop string.
    Stop(String),
}

impl FinishReason {
    /// `length`, `eos` or `stop` (OpenAI reports both of the last as `stop`).
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Eos => "eos",
            FinishReason::Stop(_) => "stop",
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
    /// Seconds in the prefill pass (its sampling included).
    pub prefill_s: f64,
    /// Seconds in decode passes.
    pub decode_s: f64,
    pub decode_steps: usize,
    /// Tokens sampled in decode passes.
    pub decode_tokens: usize,
}

impl Stats {
    /// Generated tokens per second of the whole call.
    pub fn tokens_per_s(&self) -> f64 {
        rate(self.generated_tokens as f64, self.prefill_s + self.decode_s)
    }
    /// Tokens per second of decode passes (each prompt's first token comes from prefill).
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

struct Live {
    seq: SeqId,
    index: usize,
    pos: usize,
    sampler: Sampler,
}

/// Generates a continuation of every prompt (token ids), batched.
pub fn generate(
    model: &dyn CausalLm,
    tokenizer: Option<&Tokenizer>,
    prompts: &[Vec<u32>],
    params: &GenerateParams,
) -> Result<Generation> {
    params.sampling.validate()?;
    let info = model.info();
    if !params.stop.is_empty() && tokenizer.is_none() {
        return Err(Error::Request(
            "stop strings need a tokenizer (no tokenizer.json)".into(),
        ));
    }
    if params.stop.iter().any(String::is_empty) {
        return Err(Error::Request("a stop string is empty".into()));
    }
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(Error::Request(format!("prompt {i} has no tokens")));
        }
        if p.len() >= info.max_position_embeddings {
            return Err(Error::Request(format!(
                "prompt {i} has {} tokens; the model's context is {}",
                p.len(),
                info.max_position_embeddings
            )));
        }
        if let Some(bad) = p.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(Error::Request(format!(
                "prompt {i}: token id {bad} is out of range for vocab_size {}",
                info.vocab_size
            )));
        }
    }
    let mut outputs: Vec<Output> = prompts
        .iter()
        .map(|p| Output {
            prompt_tokens: p.len(),
            token_ids: Vec::new(),
            text: tokenizer.map(|_| String::new()),
            finish_reason: FinishReason::Length,
        })
        .collect();
    let mut stats = Stats {
        prompt_tokens: prompts.iter().map(Vec::len).sum(),
        ..Stats::default()
    };
    if prompts.is_empty() || params.max_tokens == 0 {
        return Ok(Generation { outputs, stats });
    }

    // Each sequence may reach prompt + max_tokens positions (the model's context at most): a
    // slab cache is sized for exactly that, once.
    let reach = |p: &Vec<u32>| (p.len() + params.max_tokens).min(info.max_position_embeddings);
    let mut cache = ModelKvCache::for_model(info, prompts.iter().map(reach).sum())?;
    let mut live: Vec<Live> = Vec::with_capacity(prompts.len());
    for (index, p) in prompts.iter().enumerate() {
        live.push(Live {
            seq: cache.allocate(reach(p))?,
            index,
            pos: p.len(),
            sampler: Sampler::new(params.sampling, index as u64)?,
        });
    }
    let mut chunks: Vec<SeqChunk> = live
        .iter()
        .zip(prompts)
        .map(|(l, p)| SeqChunk {
            seq: l.seq,
            tokens: p.clone(),
            start_pos: 0,
        })
        .collect();
    let mut prefill = true;
    while !live.is_empty() {
        let t0 = Instant::now();
        let logits = model.forward(&chunks, &mut cache, LogitsFor::Last)?;
        let vocab = info.vocab_size;
        let rows = logits.cpu_slice::<f32>("generate", "logits")?;
        let mut still = Vec::with_capacity(live.len());
        for (i, mut l) in live.into_iter().enumerate() {
            let tok = l.sampler.sample(&rows[i * vocab..(i + 1) * vocab])?;
            let out = &mut outputs[l.index];
            out.token_ids.push(tok);
            tracing::trace!(prompt = l.index, token = tok, "sampled");
            if let Some(reason) = finished(out, tok, l.pos + 1, tokenizer, params, info)? {
                out.finish_reason = reason;
                cache.free(l.seq);
                continue;
            }
            l.pos += 1;
            still.push(l);
        }
        live = still;
        let dt = t0.elapsed().as_secs_f64();
        if prefill {
            stats.prefill_s = dt;
            prefill = false;
        } else {
            stats.decode_s += dt;
            stats.decode_steps += 1;
            stats.decode_tokens += chunks.len();
        }
        chunks = live
            .iter()
            .map(|l| SeqChunk {
                seq: l.seq,
                tokens: vec![*outputs[l.index].token_ids.last().unwrap_or(&0)],
                start_pos: l.pos - 1,
            })
            .collect();
    }
    if let Some(tok) = tokenizer {
        for out in &mut outputs {
            let mut text = tok.decode(&out.token_ids)?;
            if let FinishReason::Stop(s) = &out.finish_reason
                && let Some(at) = text.find(s.as_str())
            {
                text.truncate(at);
            }
            out.text = Some(text);
        }
    }
    stats.generated_tokens = outputs.iter().map(|o| o.token_ids.len()).sum();
    Ok(Generation { outputs, stats })
}

/// Whether `out` (which just got `tok`, now holding `len` positions) stops, and why.
fn finished(
    out: &Output,
    tok: u32,
    len: usize,
    tokenizer: Option<&Tokenizer>,
    params: &GenerateParams,
    info: &fmoe_models::ModelInfo,
) -> Result<Option<FinishReason>> {
    if !params.ignore_eos && info.eos_token_ids.contains(&tok) {
        return Ok(Some(FinishReason::Eos));
    }
    if let (Some(t), false) = (tokenizer, params.stop.is_empty()) {
        let text = t.decode(&out.token_ids)?;
        if let Some(s) = params.stop.iter().find(|s| text.contains(s.as_str())) {
            return Ok(Some(FinishReason::Stop(s.clone())));
        }
    }
    if out.token_ids.len() >= params.max_tokens || len >= info.max_position_embeddings {
        return Ok(Some(FinishReason::Length));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use fmoe_core::{Device, Tensor};
    use fmoe_models::{KvCache, KvLayout, KvStorage, ModelInfo};

    use super::*;

    /// Predicts `(last token + 1) % vocab`, with a one-stream cache of width 1.
    struct Counter {
        info: ModelInfo,
    }

    impl Counter {
        fn new(max_positions: usize) -> Counter {
            Counter {
                info: ModelInfo {
                    architecture: "Counter",
                    vocab_size: 8,
                    max_position_embeddings: max_positions,
                    eos_token_ids: vec![7],
                    bos_token_id: None,
                    kv_layout: KvLayout {
                        num_layers: 1,
                        streams: vec![1],
                    },
                    kv_storage: KvStorage::HostF32,
                    moe: None,
                },
            }
        }
    }

    impl CausalLm for Counter {
        fn info(&self) -> &ModelInfo {
            &self.info
        }
        fn forward(
            &self,
            chunks: &[SeqChunk],
            cache: &mut dyn KvCache,
            which: LogitsFor,
        ) -> fmoe_models::Result<Tensor> {
            assert_eq!(which, LogitsFor::Last);
            let mut out = Vec::new();
            for c in chunks {
                assert_eq!(cache.cached(c.seq, 0)?, c.start_pos);
                let rows: Vec<f32> = c.tokens.iter().map(|&t| t as f32).collect();
                cache.append(c.seq, 0, 0, &rows)?;
                let next = (*c.tokens.last().unwrap() as usize + 1) % 8;
                out.extend((0..8).map(|i| if i == next { 1.0 } else { 0.0 }));
            }
            Ok(Tensor::from_vec(out, [chunks.len(), 8], &Device::Cpu)?)
        }
    }

    fn ids(g: &Generation) -> Vec<Vec<u32>> {
        g.outputs.iter().map(|o| o.token_ids.clone()).collect()
    }

    #[test]
    fn stops_at_eos_max_tokens_and_the_last_position() {
        let m = Counter::new(64);
        let p = GenerateParams {
            max_tokens: 4,
            ..GenerateParams::default()
        };
        let g = generate(&m, None, &[vec![1], vec![4, 5]], &p).unwrap();
        assert_eq!(ids(&g), vec![vec![2, 3, 4, 5], vec![6, 7]]);
        assert_eq!(g.outputs[0].finish_reason, FinishReason::Length);
        assert_eq!(g.outputs[1].finish_reason, FinishReason::Eos);
        assert_eq!(g.stats.generated_tokens, 6);
        assert_eq!(g.stats.decode_tokens, 4);
        assert_eq!(g.outputs[1].prompt_tokens, 2);

        let p = GenerateParams {
            ignore_eos: true,
            ..p
        };
        let g = generate(&m, None, &[vec![5]], &p).unwrap();
        assert_eq!(ids(&g), vec![vec![6, 7, 0, 1]]);

        // A context of 4 positions: a 2-token prompt gets 2 new tokens.
        let g = generate(&Counter::new(4), None, &[vec![0, 0]], &p).unwrap();
        assert_eq!(ids(&g), vec![vec![1, 2]]);
    }

    #[test]
    fn bad_requests_are_errors() {
        let m = Counter::new(4);
        let p = GenerateParams::default();
        let err = |prompts: &[Vec<u32>], p: &GenerateParams| {
            generate(&m, None, prompts, p).unwrap_err().to_string()
        };
        assert!(err(&[vec![]], &p).contains("prompt 0 has no tokens"));
        assert!(err(&[vec![1], vec![9]], &p).contains("token id 9"));
        assert!(err(&[vec![1; 4]], &p).contains("context is 4"));
        let stop = GenerateParams {
            stop: vec!["x".into()],
            ..p.clone()
        };
        assert!(err(&[vec![1]], &stop).contains("tokenizer"));
        let hot = GenerateParams {
            sampling: SamplingParams {
                temperature: -1.0,
                ..SamplingParams::default()
            },
            ..p.clone()
        };
        assert!(err(&[vec![1]], &hot).contains("temperature"));
        let none = GenerateParams { max_tokens: 0, ..p };
        let g = generate(&m, None, &[vec![1]], &none).unwrap();
        assert!(g.outputs[0].token_ids.is_empty());
    }
}
