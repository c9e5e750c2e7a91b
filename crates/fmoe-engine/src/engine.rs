//! The engine: a model runner, the scheduler and the requests in flight.
//! [`Engine::add_request`] queues a request (each of its `n` samples is a sequence),
//! [`Engine::step`] schedules one forward pass over the running batch (see
//! [`crate::scheduler`]), samples the sequences that finished computing their tokens, and returns
//! what each produced; [`Engine::abort`] drops a request at once, its blocks back in the pool.
//!
//! A step the model fails on (a NaN in one request's hidden states, say) is run again one
//! sequence at a time, so only the sequences that fail alone finish with
//! [`FinishReason::Error`]: no request loses its output to another's.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use fmoe_models::{CausalLm, ModelInfo, SeqStep, StepLogits, Tokenizer};

use crate::block_manager::{BlockManager, SeqBlocks};
use crate::detokenize::{IncrementalDecoder, StopMatcher};
use crate::request::{FinishReason, Request, RequestId, RequestOutput, Timings};
use crate::runner::{ModelRunner, StepOutput};
use crate::sampler::{Sampler, TokenLogprobs, logprobs};
use crate::scheduler::{Schedulable, Scheduled, Scheduler, SchedulerConfig};
use crate::{Error, Result};

/// Sizes of the engine (see `fmoe generate --help` for the defaults per device).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    pub scheduler: SchedulerConfig,
    pub prefix_caching: bool,
    /// Seed of the engine's RNG, which draws the seed of every request that gives none.
    pub seed: u64,
}

/// Counters since the engine started, and the state now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub preemptions: u64,
    /// Prompt tokens looked up in / found in the prefix cache.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Most blocks in use at once.
    pub peak_blocks: usize,
    pub used_blocks: usize,
    pub num_blocks: usize,
    pub running: usize,
    pub waiting: usize,
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
}

struct Seq {
    id: RequestId,
    index: usize,
    tokens: Vec<u32>,
    prompt_len: usize,
    num_computed: usize,
    blocks: SeqBlocks,
    sampler: Sampler,
    decoder: Option<(IncrementalDecoder, StopMatcher)>,
    params: crate::request::RequestParams,
    /// Prompt logprobs collected so far (index = prompt position; 0 is None).
    prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    prompt_logprobs_sent: bool,
    preemptions: usize,
    timings: Timings,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

impl Schedulable for Seq {
    fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    fn num_computed(&self) -> usize {
        self.num_computed
    }
    fn set_num_computed(&mut self, n: usize) {
        self.num_computed = n;
    }
    fn blocks(&mut self) -> &mut SeqBlocks {
        &mut self.blocks
    }
    fn prefix_cacheable(&self) -> bool {
        // Prompt logprobs need every prompt position computed; once sent, a recompute (after a
        // preemption) may reuse cached blocks like any other sequence.
        self.params.prompt_logprobs.is_none() || self.prompt_logprobs_sent
    }
    fn preempted(&mut self) {
        self.preemptions += 1;
    }
}

/// The serving engine (see the module docs).
pub struct Engine {
    runner: ModelRunner,
    tokenizer: Option<Tokenizer>,
    scheduler: Scheduler<Seq>,
    config: EngineConfig,
    rng: ChaCha8Rng,
    next_id: RequestId,
    stats: EngineStats,
    /// Outputs of requests finished outside a step (aborts), returned by the next step.
    pending: Vec<RequestOutput>,
}

impl Engine {
    /// An engine over `model` with a pool of `config.num_blocks` blocks.
    pub fn new(
        model: Arc<dyn CausalLm>,
        tokenizer: Option<Tokenizer>,
        config: EngineConfig,
    ) -> Result<Engine> {
        let c = config.scheduler;
        if c.max_num_batched_tokens == 0 || c.max_num_seqs == 0 {
            return Err(Error::Request(format!(
                "max_num_batched_tokens ({}) and max_num_seqs ({}) must be at least 1",
                c.max_num_batched_tokens, c.max_num_seqs
            )));
        }
        let runner = ModelRunner::new(model, config.num_blocks, config.block_size)?;
        let blocks =
            BlockManager::new(config.num_blocks, config.block_size, config.prefix_caching)?;
        tracing::info!(
            blocks = config.num_blocks,
            block_size = config.block_size,
            tokens = config.num_blocks * config.block_size,
            "KV pool: {} blocks of {} tokens ({} tokens)",
            config.num_blocks,
            config.block_size,
            config.num_blocks * config.block_size
        );
        Ok(Engine {
            runner,
            tokenizer,
            scheduler: Scheduler::new(config.scheduler, blocks),
            config,
            rng: ChaCha8Rng::seed_from_u64(config.seed),
            next_id: 0,
            stats: EngineStats {
                num_blocks: config.num_blocks,
                ..EngineStats::default()
            },
            pending: Vec::new(),
        })
    }

    pub fn info(&self) -> &ModelInfo {
        self.runner.info()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// Tokens the pool holds.
    pub fn capacity_tokens(&self) -> usize {
        self.config.num_blocks * self.config.block_size
    }

    /// Checks `req` and queues its samples; errors name what is wrong (and a request that could
    /// never fit the pool names its length and the pool's capacity).
    pub fn add_request(&mut self, req: Request) -> Result<RequestId> {
        let info = self.runner.info();
        let p = &req.params;
        p.sampling.validate()?;
        let bad = |m: String| Err(Error::Request(m));
        if req.prompt.is_empty() {
            return bad("the prompt has no tokens".into());
        }
        if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return bad(format!(
                "token id {t} is out of range for vocab_size {}",
                info.vocab_size
            ));
        }
        if p.n == 0 || p.n > self.config.scheduler.max_num_seqs.max(1) * 16 {
            return bad(format!(
                "n must be in 1..={}, got {}",
                self.config.scheduler.max_num_seqs * 16,
                p.n
            ));
        }
        if let Some(t) = p
            .stop_token_ids
            .iter()
            .find(|&&t| t as usize >= info.vocab_size)
        {
            return bad(format!(
                "stop token id {t} is out of range for vocab_size {}",
                info.vocab_size
            ));
        }
        for (what, n) in [
            ("logprobs", p.logprobs),
            ("prompt_logprobs", p.prompt_logprobs),
        ] {
            if let Some(n) = n
                && n > info.vocab_size
            {
                return bad(format!(
                    "{what} {n} exceeds the vocabulary ({})",
                    info.vocab_size
                ));
            }
        }
        if !p.stop.is_empty() && self.tokenizer.is_none() {
            return bad("stop strings need a tokenizer (no tokenizer.json)".into());
        }
        let total = req.prompt.len().checked_add(p.max_tokens);
        let ctx = info.max_position_embeddings;
        match total {
            Some(t) if t <= ctx => {}
            _ if req.prompt.len() >= ctx => {
                return bad(format!(
                    "the prompt has {} tokens; the model's context is {ctx}",
                    req.prompt.len()
                ));
            }
            _ => {}
        }
        // A sample is cut at the context; it must fit the pool alone.
        let reach = total.unwrap_or(usize::MAX).min(ctx);
        if reach > self.capacity_tokens() {
            return bad(format!(
                "the request needs up to {reach} tokens (prompt {} + max_tokens {}) but the KV pool holds {} ({} blocks of {})",
                req.prompt.len(),
                p.max_tokens,
                self.capacity_tokens(),
                self.config.num_blocks,
                self.config.block_size
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        let seed = p.seed.unwrap_or_else(|| self.rng.random());
        let now = Instant::now();
        for index in 0..p.n {
            let sampling = crate::SamplingParams { seed, ..p.sampling };
            let decoder = match &self.tokenizer {
                Some(_) => Some((
                    IncrementalDecoder::new(&req.prompt),
                    StopMatcher::new(p.stop.clone())?,
                )),
                None => None,
            };
            self.scheduler.waiting.push_back(Seq {
                id,
                index,
                tokens: req.prompt.clone(),
                prompt_len: req.prompt.len(),
                num_computed: 0,
                blocks: SeqBlocks::new(),
                sampler: Sampler::new(sampling, index as u64)?,
                decoder,
                params: p.clone(),
                prompt_logprobs: p.prompt_logprobs.map(|_| vec![None]),
                prompt_logprobs_sent: false,
                preemptions: 0,
                timings: Timings {
                    arrival: now,
                    scheduled: None,
                    first_token: None,
                    finished: None,
                },
            });
        }
        self.stats.prompt_tokens += req.prompt.len() as u64;
        Ok(id)
    }

    /// Drops every sample of request `id`, wherever it is; its blocks are free at once. Returns
    /// whether it was there. Its outputs (finish reason `abort`) come with the next step.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let mut found = false;
        let mut dropped = Vec::new();
        let waiting = std::mem::take(&mut self.scheduler.waiting);
        for s in waiting {
            if s.id == id {
                dropped.push(s);
            } else {
                self.scheduler.waiting.push_back(s);
            }
        }
        let running = std::mem::take(&mut self.scheduler.running);
        for s in running {
            if s.id == id {
                dropped.push(s);
            } else {
                self.scheduler.running.push(s);
            }
        }
        for mut s in dropped {
            found = true;
            s.timings.finished = Some(Instant::now());
            let out = self.output(
                &s,
                Vec::new(),
                String::new(),
                Vec::new(),
                Some(FinishReason::Abort),
            );
            self.scheduler.blocks.free(std::mem::take(&mut s.blocks));
            self.pending.push(out);
        }
        found
    }

    /// Whether any request is queued or running.
    pub fn has_unfinished(&self) -> bool {
        !self.scheduler.waiting.is_empty() || !self.scheduler.running.is_empty()
    }

    pub fn stats(&self) -> EngineStats {
        let p = self.scheduler.blocks.prefix_stats();
        EngineStats {
            preemptions: self.scheduler.num_preemptions,
            prefix_cache_queries: p.queries,
            prefix_cache_hits: p.hits,
            used_blocks: self.scheduler.blocks.num_used_blocks(),
            running: self.scheduler.running.len(),
            waiting: self.scheduler.waiting.len(),
            ..self.stats
        }
    }

    /// Fraction of the pool's blocks in use.
    pub fn kv_usage(&self) -> f64 {
        self.scheduler.blocks.usage()
    }

    fn output(
        &self,
        s: &Seq,
        new_token_ids: Vec<u32>,
        text_delta: String,
        logprobs: Vec<TokenLogprobs>,
        finish_reason: Option<FinishReason>,
    ) -> RequestOutput {
        RequestOutput {
            id: s.id,
            index: s.index,
            new_token_ids,
            text_delta,
            logprobs,
            prompt_logprobs: None,
            finish_reason,
            prompt_tokens: s.prompt_len,
            generated_tokens: s.generated(),
            preemptions: s.preemptions,
            timings: s.timings,
        }
    }

    /// One step: schedule, run the forward pass, sample, and return what every sample produced
    /// (a new token, a finish, or both; aborted samples too).
    pub fn step(&mut self) -> Result<Vec<RequestOutput>> {
        let mut outputs = std::mem::take(&mut self.pending);
        let scheduled = self.scheduler.schedule();
        if scheduled.is_empty() {
            return Ok(outputs);
        }
        self.stats.steps += 1;
        let now = Instant::now();
        for sc in &scheduled {
            let s = &mut self.scheduler.running[sc.index];
            s.timings.scheduled.get_or_insert(now);
        }
        let results = self.run_isolating(&scheduled);
        let vocab = self.runner.info().vocab_size;
        let mut finished = Vec::new();
        for (sc, result) in scheduled.iter().zip(results) {
            let s = &mut self.scheduler.running[sc.index];
            let rows = match result.as_ref().map(|r| r.out.rows(r.index)) {
                Ok(Ok(rows)) => rows,
                Ok(Err(e)) => {
                    finished.push((sc.index, None, Some(FinishReason::Error(e.to_string()))));
                    continue;
                }
                Err(e) => {
                    finished.push((sc.index, None, Some(FinishReason::Error(e.to_string()))));
                    continue;
                }
            };
            let start = s.num_computed;
            s.num_computed += sc.num_tokens;
            self.scheduler
                .blocks
                .commit(&mut s.blocks, &s.tokens, s.num_computed);
            // Prompt logprobs: row r (position start + r) scores the token at start + r + 1.
            if let (Some(n), Some(collected)) = (s.params.prompt_logprobs, &mut s.prompt_logprobs)
                && rows.len() == sc.num_tokens * vocab
            {
                let failed = (0..sc.num_tokens).find_map(|r| {
                    let next = start + r + 1;
                    if next >= s.prompt_len || next != collected.len() {
                        return None;
                    }
                    match logprobs(&rows[r * vocab..(r + 1) * vocab], s.tokens[next], n) {
                        Ok(l) => {
                            collected.push(Some(l));
                            None
                        }
                        Err(e) => Some(e),
                    }
                });
                if let Some(e) = failed {
                    // The sample ends here: it is neither sampled nor finished a second time.
                    finished.push((sc.index, None, Some(FinishReason::Error(e.to_string()))));
                    continue;
                }
            }
            if s.num_computed < s.tokens.len() {
                continue;
            }
            if s.params.max_tokens == 0 {
                finished.push((sc.index, None, Some(FinishReason::Length)));
                continue;
            }
            let last = &rows[rows.len() - vocab..];
            match sample_one(s, last, self.runner.info(), self.tokenizer.as_ref()) {
                Ok((sampled, reason)) => {
                    s.timings.first_token.get_or_insert_with(Instant::now);
                    self.stats.generation_tokens += 1;
                    finished.push((sc.index, Some(sampled), reason));
                }
                Err(e) => finished.push((sc.index, None, Some(FinishReason::Error(e.to_string())))),
            }
        }
        // Outputs in step order; finished samples leave the running list (back to front, so the
        // indices stay valid).
        let mut done = Vec::new();
        for (index, sampled, reason) in finished {
            let s = &mut self.scheduler.running[index];
            let (ids, text, lp) = match sampled {
                Some(x) => (vec![x.token], x.text, x.logprobs.into_iter().collect()),
                None => (Vec::new(), String::new(), Vec::new()),
            };
            let mut text = text;
            if reason.is_some() {
                s.timings.finished = Some(Instant::now());
                if let (Some(tok), Some((dec, stop))) = (self.tokenizer.as_ref(), &mut s.decoder)
                    && !matches!(reason, Some(FinishReason::Stop(_)))
                {
                    // A trailing incomplete character, then whatever the stop matcher held.
                    let (released, _) = stop.push(&dec.flush(tok).unwrap_or_default());
                    text.push_str(&released);
                    text.push_str(&stop.flush());
                }
            }
            let mut out = self.output(
                &self.scheduler.running[index],
                ids,
                text,
                lp,
                reason.clone(),
            );
            let s = &mut self.scheduler.running[index];
            if !s.prompt_logprobs_sent && s.num_computed >= s.prompt_len {
                out.prompt_logprobs = s.prompt_logprobs.take();
                s.prompt_logprobs_sent = true;
            }
            if reason.is_some() {
                done.push(index);
            }
            outputs.push(out);
        }
        done.sort_unstable();
        done.dedup();
        for index in done.into_iter().rev() {
            let mut s = self.scheduler.running.remove(index);
            self.scheduler.blocks.free(std::mem::take(&mut s.blocks));
        }
        let used = self.scheduler.blocks.num_used_blocks();
        self.stats.peak_blocks = self.stats.peak_blocks.max(used);
        Ok(outputs)
    }

    /// Runs the scheduled sequences in one pass; if that fails, each half again (recursively),
    /// so that only the sequences that fail alone get the error, in about log2(batch) extra
    /// passes per failing sequence. Returns each sequence's logits rows. (A failed pass leaves
    /// its new tokens' pool rows undefined, but nothing advanced: the rerun writes them again.)
    fn run_isolating(&mut self, scheduled: &[Scheduled]) -> Vec<Result<SeqRows>> {
        // Track the peak before the pass: blocks were allocated by the scheduler.
        let used = self.scheduler.blocks.num_used_blocks();
        self.stats.peak_blocks = self.stats.peak_blocks.max(used);
        self.run_halving(scheduled)
    }

    fn run_halving(&mut self, scheduled: &[Scheduled]) -> Vec<Result<SeqRows>> {
        match self.run(scheduled) {
            Ok(rows) => rows.into_iter().map(Ok).collect(),
            Err(e) if scheduled.len() == 1 => vec![Err(e)],
            Err(_) => {
                let (a, b) = scheduled.split_at(scheduled.len() / 2);
                let mut out = self.run_halving(a);
                out.extend(self.run_halving(b));
                out
            }
        }
    }

    fn run(&mut self, scheduled: &[Scheduled]) -> Result<Vec<SeqRows>> {
        let running = &self.scheduler.running;
        let steps: Vec<SeqStep> = scheduled
            .iter()
            .map(|sc| {
                let s = &running[sc.index];
                let end = s.num_computed + sc.num_tokens;
                let wants_prompt = s.prompt_logprobs.is_some() && s.num_computed + 1 < s.prompt_len;
                let logits = if wants_prompt {
                    StepLogits::All
                } else if end == s.tokens.len() {
                    StepLogits::Last
                } else {
                    StepLogits::None
                };
                SeqStep {
                    tokens: &s.tokens[s.num_computed..end],
                    past: s.num_computed,
                    block_table: s.blocks.blocks(),
                    logits,
                }
            })
            .collect();
        let out = Rc::new(self.runner.run(&steps)?);
        Ok((0..scheduled.len())
            .map(|i| SeqRows {
                out: out.clone(),
                index: i,
            })
            .collect())
    }
}

/// One sequence's logits rows in a step's output (shared by the step's sequences, not copied).
struct SeqRows {
    out: Rc<StepOutput>,
    index: usize,
}

struct Sampled {
    token: u32,
    text: String,
    logprobs: Option<TokenLogprobs>,
}

/// Samples `s`'s next token from `row`, appends it, and says whether the sample is done.
fn sample_one(
    s: &mut Seq,
    row: &[f32],
    info: &ModelInfo,
    tokenizer: Option<&Tokenizer>,
) -> Result<(Sampled, Option<FinishReason>)> {
    let token = s.sampler.sample(row)?;
    let lp = match s.params.logprobs {
        Some(n) => Some(logprobs(row, token, n)?),
        None => None,
    };
    s.tokens.push(token);
    let mut text = String::new();
    let mut reason = None;
    if !s.params.ignore_eos && info.eos_token_ids.contains(&token) {
        reason = Some(FinishReason::Eos);
    } else if s.params.stop_token_ids.contains(&token) {
        reason = Some(FinishReason::StopToken(token));
    }
    if let (Some(tok), Some((dec, stop))) = (tokenizer, &mut s.decoder) {
        let delta = dec.push(tok, token)?;
        let (released, hit) = stop.push(&delta);
        text = released;
        if reason.is_none()
            && let Some(hit) = hit
        {
            reason = Some(FinishReason::Stop(hit));
        }
    }
    if reason.is_none()
        && (s.generated() >= s.params.max_tokens || s.tokens.len() >= info.max_position_embeddings)
    {
        reason = Some(FinishReason::Length);
    }
    Ok((
        Sampled {
            token,
            text,
            logprobs: lp,
        },
        reason,
    ))
}
