//! The model runner: a model and its paged KV pool. A step is a list of [`SeqStep`]s (new tokens,
//! tokens already cached, block table, which logits); the runner builds the step's
//! [`ForwardInput`] (the one upload), runs the model and brings the logits and the pass's NaN/Inf
//! checks down together (the one synchronization).
//!
//! [`DirectSession`] drives a runner without a scheduler: sequences get fresh blocks as they
//! grow, every call runs the chunks it is given. Tests and `fmoe bench model` use it where they
//! need exact control of each forward pass.

use std::collections::HashMap;
use std::sync::Arc;

use fmoe_core::Tensor;
use fmoe_models::{CausalLm, ForwardInput, KvPool, ModelInfo, SeqStep, StepLogits};

use crate::{Error, Result};

/// A step's logits on the host, f32 `[rows, vocab]` as the download left them (no copy), and
/// each sequence's (first row, rows).
pub struct StepOutput {
    logits: Tensor,
    spans: Vec<(usize, usize)>,
    vocab: usize,
}

impl StepOutput {
    /// Every row, sequence after sequence.
    pub fn logits(&self) -> Result<&[f32]> {
        Ok(self.logits.cpu_slice::<f32>("ModelRunner::run", "logits")?)
    }

    pub fn spans(&self) -> &[(usize, usize)] {
        &self.spans
    }

    /// The rows of the step's sequence `i`.
    pub fn rows(&self, i: usize) -> Result<&[f32]> {
        let (first, n) = self.spans[i];
        Ok(&self.logits()?[first * self.vocab..(first + n) * self.vocab])
    }
}

/// A model and its KV pool.
pub struct ModelRunner {
    model: Arc<dyn CausalLm>,
    pool: KvPool,
}

impl ModelRunner {
    /// A pool of `num_blocks` blocks of `block_size` tokens on the model's device, in its dtype.
    pub fn new(model: Arc<dyn CausalLm>, num_blocks: usize, block_size: usize) -> Result<Self> {
        let info = model.info();
        let pool = KvPool::new(
            &info.kv_layout,
            info.dtype,
            info.device,
            num_blocks,
            block_size,
        )?;
        Ok(ModelRunner { model, pool })
    }

    pub fn info(&self) -> &ModelInfo {
        self.model.info()
    }

    pub fn model(&self) -> &dyn CausalLm {
        self.model.as_ref()
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// Runs one step; returns its logits on the host (rows in step order, each sequence's as its
    /// [`StepLogits`] says).
    pub fn run(&mut self, seqs: &[SeqStep<'_>]) -> Result<StepOutput> {
        let input = ForwardInput::new(
            self.model.info(),
            self.pool.block_size(),
            self.pool.num_blocks(),
            seqs,
        )?;
        let out = self.model.forward(&input, &mut self.pool)?;
        let logits: Tensor = out.into_host()?;
        Ok(StepOutput {
            logits,
            spans: input.logit_spans().to_vec(),
            vocab: self.model.info().vocab_size,
        })
    }
}

/// A sequence's handle in a [`DirectSession`].
pub type SeqId = u64;

/// One sequence's new tokens; `start_pos` must equal the tokens already cached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqChunk {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    pub start_pos: usize,
}

/// Which positions of each chunk get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// Every token: `[total tokens, vocab]`.
    All,
    /// Each chunk's last token: `[chunks, vocab]`.
    Last,
}

struct DirectSeq {
    blocks: Vec<u32>,
    len: usize,
}

/// A [`ModelRunner`] driven chunk by chunk (see the module docs).
pub struct DirectSession {
    runner: ModelRunner,
    free: Vec<u32>,
    seqs: HashMap<SeqId, DirectSeq>,
    next: SeqId,
}

impl DirectSession {
    /// A session whose pool holds `max_tokens` tokens in all (in blocks of 16).
    pub fn new(model: Arc<dyn CausalLm>, max_tokens: usize) -> Result<DirectSession> {
        Self::with_blocks(model, max_tokens.div_ceil(16).max(1) + 1, 16)
    }

    pub fn with_blocks(
        model: Arc<dyn CausalLm>,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<DirectSession> {
        let runner = ModelRunner::new(model, num_blocks, block_size)?;
        let free = (0..num_blocks as u32).rev().collect();
        Ok(DirectSession {
            runner,
            free,
            seqs: HashMap::new(),
            next: 0,
        })
    }

    pub fn runner(&self) -> &ModelRunner {
        &self.runner
    }

    pub fn model(&self) -> &dyn CausalLm {
        self.runner.model()
    }

    /// A new, empty sequence.
    pub fn allocate(&mut self) -> SeqId {
        let id = self.next;
        self.next += 1;
        self.seqs.insert(
            id,
            DirectSeq {
                blocks: Vec::new(),
                len: 0,
            },
        );
        id
    }

    /// Returns a sequence's blocks to the pool (unknown ids are ignored).
    pub fn free(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.free.extend(s.blocks.into_iter().rev());
        }
    }

    /// Tokens cached for `seq`.
    pub fn cached(&self, seq: SeqId) -> Result<usize> {
        Ok(self.get(seq)?.len)
    }

    fn get(&self, seq: SeqId) -> Result<&DirectSeq> {
        self.seqs
            .get(&seq)
            .ok_or_else(|| Error::Request(format!("unknown sequence {seq}")))
    }

    /// Runs `chunks` (each sequence once) in one forward pass; returns f32 logits of the
    /// positions `which` says, on the host.
    pub fn forward(&mut self, chunks: &[SeqChunk], which: LogitsFor) -> Result<Vec<f32>> {
        let bs = self.runner.pool().block_size();
        for c in chunks {
            let s = self.get(c.seq)?;
            if s.len != c.start_pos {
                return Err(Error::Request(format!(
                    "sequence {}: start_pos {} but {} tokens are cached",
                    c.seq, c.start_pos, s.len
                )));
            }
            if chunks.iter().filter(|o| o.seq == c.seq).count() > 1 {
                return Err(Error::Request(format!(
                    "sequence {} appears twice in one batch",
                    c.seq
                )));
            }
            let need = (c.start_pos + c.tokens.len()).div_ceil(bs);
            let s = self.seqs.get_mut(&c.seq).expect("checked above");
            while s.blocks.len() < need {
                let Some(b) = self.free.pop() else {
                    return Err(Error::Request(format!(
                        "the session's {} blocks of {bs} tokens are all in use",
                        self.runner.pool().num_blocks()
                    )));
                };
                s.blocks.push(b);
            }
        }
        let logits = match which {
            LogitsFor::All => StepLogits::All,
            LogitsFor::Last => StepLogits::Last,
        };
        let steps: Vec<SeqStep> = chunks
            .iter()
            .map(|c| SeqStep {
                tokens: &c.tokens,
                past: c.start_pos,
                block_table: &self.seqs[&c.seq].blocks,
                logits,
            })
            .collect();
        let rows = self.runner.run(&steps)?.logits()?.to_vec();
        for c in chunks {
            if let Some(s) = self.seqs.get_mut(&c.seq) {
                s.len += c.tokens.len();
            }
        }
        Ok(rows)
    }
}
