//! Continuous batching over the paged KV pool (vLLM's v1 scheduler, in its essentials).
//!
//! Every step takes, under a token budget (`max_num_batched_tokens`) and a sequence cap
//! (`max_num_seqs`):
//! 1. the running sequences in admission order, each with what it has left to compute — one
//!    token for a decode, the rest of its prompt (up to the budget) for a prefill in chunks — so
//!    prefill chunks and decodes share one forward pass;
//! 2. then, if nothing was preempted in this step, waiting sequences first come first served,
//!    each first matched against the prefix cache (its leading full blocks already computed by
//!    another sequence are shared, not recomputed).
//!
//! A sequence needs blocks for every token it will have computed after the step. When the pool
//! has none left, the most recently admitted running sequence is preempted: its blocks are freed
//! and it goes back to the front of the queue to be recomputed from its tokens (prompt and what
//! it generated, so its output does not change). The sequence being scheduled may be that one.
//! Every sequence fits the pool alone (checked when its request is added), so the oldest
//! running sequence always makes progress.

use std::collections::VecDeque;

use crate::block_manager::{BlockManager, SeqBlocks};

/// The scheduler's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens per step, prefill chunks and decodes together.
    pub max_num_batched_tokens: usize,
    /// Sequences running at once.
    pub max_num_seqs: usize,
}

/// What the scheduler needs of a sequence; the engine's sequences carry the rest.
pub(crate) trait Schedulable {
    /// Every token of the sequence: prompt and generated.
    fn tokens(&self) -> &[u32];
    /// Tokens whose KV is in the pool.
    fn num_computed(&self) -> usize;
    fn set_num_computed(&mut self, n: usize);
    fn blocks(&mut self) -> &mut SeqBlocks;
    /// Whether its prompt may come from the prefix cache (not when prompt logprobs are asked).
    fn prefix_cacheable(&self) -> bool;
    /// Called when the sequence loses its blocks.
    fn preempted(&mut self);
}

/// One sequence's part of a step: `running[index]` computes `num_tokens` more tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Scheduled {
    pub index: usize,
    pub num_tokens: usize,
}

/// Waiting and running sequences and the block manager (see the module docs).
pub(crate) struct Scheduler<S> {
    pub config: SchedulerConfig,
    pub blocks: BlockManager,
    pub waiting: VecDeque<S>,
    /// In admission order.
    pub running: Vec<S>,
    pub num_preemptions: u64,
}

impl<S: Schedulable> Scheduler<S> {
    pub fn new(config: SchedulerConfig, blocks: BlockManager) -> Self {
        Scheduler {
            config,
            blocks,
            waiting: VecDeque::new(),
            running: Vec::new(),
            num_preemptions: 0,
        }
    }

    /// Frees a sequence's blocks and puts it at the front of the queue.
    fn preempt(&mut self, mut seq: S) {
        let blocks = std::mem::take(seq.blocks());
        self.blocks.free(blocks);
        seq.set_num_computed(0);
        seq.preempted();
        self.num_preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// The next step's sequences (indices into `running`, which this may reorder only by
    /// preempting from its end and admitting to it).
    pub fn schedule(&mut self) -> Vec<Scheduled> {
        let mut budget = self.config.max_num_batched_tokens;
        let mut out = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &mut self.running[i];
            let left = seq.tokens().len() - seq.num_computed();
            let n = left.min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let want = seq.num_computed() + n;
            loop {
                let seq = &mut self.running[i];
                if self.blocks.allocate(seq.blocks(), want).is_ok() {
                    out.push(Scheduled {
                        index: i,
                        num_tokens: n,
                    });
                    budget -= n;
                    i += 1;
                    break;
                }
                // Out of blocks: the newest running sequence goes back to the queue.
                let last = self.running.pop().expect("running holds sequence i");
                preempted = true;
                let was_self = self.running.len() == i;
                self.preempt(last);
                if was_self {
                    break;
                }
            }
        }
        if preempted {
            return out;
        }
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if seq.num_computed() == 0 && seq.blocks().blocks().is_empty() && seq.prefix_cacheable()
            {
                let tokens = seq.tokens().to_vec();
                let hit = self.blocks.acquire_prefix(seq.blocks(), &tokens);
                seq.set_num_computed(hit);
            }
            let n = (seq.tokens().len() - seq.num_computed()).min(budget);
            let want = seq.num_computed() + n;
            if self.blocks.allocate(seq.blocks(), want).is_err() {
                let blocks = std::mem::take(seq.blocks());
                self.blocks.free(blocks);
                seq.set_num_computed(0);
                self.waiting.push_front(seq);
                break;
            }
            self.running.push(seq);
            out.push(Scheduled {
                index: self.running.len() - 1,
                num_tokens: n,
            });
            budget -= n;
        }
        out
    }
}
