//! What one forward pass reads besides the weights and the KV pool: [`ForwardInput`], built by
//! the engine once per step from the scheduled sequences ([`SeqStep`]) and uploaded there — token
//! ids, positions, the slot of every new token, the attention plan over the pool, and which rows
//! get logits. A model's forward only launches kernels on it: it never uploads, never allocates
//! the cache and never waits for the device.
//!
//! How attention reads the pool is the model's choice ([`AttentionLayout`]): through the block
//! tables in place (the plan uploads the step's tables once), or (MLA, which decompresses what it
//! reads) from the batch's cached rows gathered by one index; either way one plan serves every
//! layer.

use fmoe_core::Device;
use fmoe_kernels::attention::{
    AttentionParams, AttentionPlan, KvPaging, SeqSpan, plan_attention, plan_attention_paged,
};
use fmoe_kernels::elementwise::RowIndex;

use crate::model::ModelInfo;
use crate::{Error, Result};

const OP: &str = "ForwardInput";

/// Which positions of a sequence's new tokens get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepLogits {
    /// None (a prompt chunk that does not end the prompt).
    None,
    /// The last new token's (the next token is sampled from it).
    Last,
    /// Every new token's (prompt logprobs, teacher forcing).
    All,
}

/// One sequence's part of a step: its new tokens after `past` tokens already in the pool, and
/// its block table, which must cover `past + tokens.len()` positions.
#[derive(Clone, Copy, Debug)]
pub struct SeqStep<'a> {
    pub tokens: &'a [u32],
    pub past: usize,
    pub block_table: &'a [u32],
    pub logits: StepLogits,
}

/// How a model's attention reads the KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionLayout {
    /// Attention reads the pool in place through the step's block tables (Mixtral).
    Paged,
    /// The step gathers every scheduled sequence's cached rows (positions `0..past + new`) into
    /// one contiguous batch with one index, and attention runs over those rows (MLA, which
    /// decompresses what it reads).
    Gathered,
}

/// A step's uploaded inputs (see the module docs).
#[derive(Debug)]
pub struct ForwardInput {
    /// u32 `[tokens]`: the new tokens, sequence after sequence.
    pub token_ids: RowIndex,
    /// u32 `[tokens]`: each token's position.
    pub positions: RowIndex,
    /// u32 `[tokens]`: each token's row in the pool.
    pub slots: RowIndex,
    /// [`AttentionLayout::Gathered`]: the pool rows attention reads, in the plan's k/v order
    /// (`None` for [`AttentionLayout::Paged`]: the plan reads the pool through the tables).
    pub gather: Option<RowIndex>,
    pub attention: AttentionPlan,
    /// Rows of the batch that get logits, in order (`None`: every row).
    pub logit_rows: Option<RowIndex>,
    num_tokens: usize,
    num_logits: usize,
    /// Per sequence: (first logits row, logits rows).
    logit_spans: Vec<(usize, usize)>,
}

impl ForwardInput {
    /// Validates `seqs` against `info` and a pool of `num_blocks` blocks of `block_size` tokens
    /// and uploads the step's inputs to `info.device` (each check's error names the sequence and
    /// the value).
    pub fn new(
        info: &ModelInfo,
        block_size: usize,
        num_blocks: usize,
        seqs: &[SeqStep<'_>],
    ) -> Result<ForwardInput> {
        if seqs.is_empty() {
            return Err(Error::input(OP, "a step needs at least one sequence"));
        }
        if block_size == 0 {
            return Err(Error::input(OP, "block_size must be at least 1"));
        }
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut logit_rows = Vec::new();
        let mut logit_spans = Vec::with_capacity(seqs.len());
        let paged = info.attention_layout == AttentionLayout::Paged;
        let mut gather = Vec::new();
        let mut tables = Vec::new();
        let mut spans = Vec::with_capacity(seqs.len());
        for (i, s) in seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(Error::input(OP, format!("sequence {i} has no new tokens")));
            }
            let end = s
                .past
                .checked_add(s.tokens.len())
                .filter(|&e| e <= info.max_position_embeddings);
            let Some(end) = end else {
                return Err(Error::input(
                    OP,
                    format!(
                        "sequence {i}: {} new tokens after {} would pass max_position_embeddings {}",
                        s.tokens.len(),
                        s.past,
                        info.max_position_embeddings
                    ),
                ));
            };
            if let Some(bad) = s.tokens.iter().find(|&&t| t as usize >= info.vocab_size) {
                return Err(Error::input(
                    OP,
                    format!(
                        "sequence {i}: token id {bad} is out of range for vocab_size {}",
                        info.vocab_size
                    ),
                ));
            }
            let need = end.div_ceil(block_size);
            if s.block_table.len() < need {
                return Err(Error::input(
                    OP,
                    format!(
                        "sequence {i}: {end} positions need {need} blocks of {block_size}; its table has {}",
                        s.block_table.len()
                    ),
                ));
            }
            if let Some(bad) = s.block_table[..need]
                .iter()
                .find(|&&b| b as usize >= num_blocks)
            {
                return Err(Error::input(
                    OP,
                    format!("sequence {i}: block {bad} is outside the pool's {num_blocks} blocks"),
                ));
            }
            let slot = |p: usize| {
                (s.block_table[p / block_size] as usize * block_size + p % block_size) as u32
            };
            let q_start = tokens.len();
            tokens.extend_from_slice(s.tokens);
            positions.extend((s.past..end).map(|p| p as u32));
            slots.extend((s.past..end).map(slot));
            spans.push(SeqSpan {
                q_start,
                q_len: s.tokens.len(),
                kv_start: if paged { tables.len() } else { gather.len() },
                past: s.past,
            });
            if paged {
                tables.extend_from_slice(&s.block_table[..need]);
            } else {
                gather.extend((0..end).map(slot));
            }
            let first = logit_rows.len();
            match s.logits {
                StepLogits::None => {}
                StepLogits::Last => logit_rows.push((tokens.len() - 1) as u32),
                StepLogits::All => logit_rows.extend((q_start..tokens.len()).map(|r| r as u32)),
            }
            logit_spans.push((first, logit_rows.len() - first));
        }
        let device: Device = info.device;
        let t = tokens.len();
        let attention = match info.attention_layout {
            AttentionLayout::Gathered => {
                plan_attention(t, gather.len(), &spans, &info.attention, device)?
            }
            AttentionLayout::Paged => {
                let paging = KvPaging {
                    block_size,
                    block_tables: tables,
                };
                let rows = num_blocks.checked_mul(block_size).ok_or_else(|| {
                    Error::input(OP, format!("{num_blocks} blocks of {block_size} overflow"))
                })?;
                plan_attention_paged(t, rows, &spans, &info.attention, &paging, device)?
            }
        };
        let num_logits = logit_rows.len();
        Ok(ForwardInput {
            token_ids: RowIndex::new(&tokens, device)?,
            positions: RowIndex::new(&positions, device)?,
            slots: RowIndex::new(&slots, device)?,
            gather: if paged {
                None
            } else {
                Some(RowIndex::new(&gather, device)?)
            },
            attention,
            logit_rows: if num_logits == t {
                None
            } else {
                Some(RowIndex::new(&logit_rows, device)?)
            },
            num_tokens: t,
            num_logits,
            logit_spans,
        })
    }

    /// New tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Rows of the logits the forward returns.
    pub fn num_logits(&self) -> usize {
        self.num_logits
    }

    /// Per sequence of the step: (its first row in the logits, its number of rows).
    pub fn logit_spans(&self) -> &[(usize, usize)] {
        &self.logit_spans
    }

    /// The attention parameters the plan was made with.
    pub fn attention_params(&self) -> &AttentionParams {
        self.attention.params()
    }
}
