//! What a model offers the engine ([`CausalLm`]) and what it needs from it ([`KvCache`]).
//!
//! A forward pass takes [`SeqChunk`]s: for each sequence, the tokens not yet in its cache and the
//! position of the first. Prefill passes the whole prompt, decode one token per sequence; both are
//! the same call, so a batch may mix them. The model appends what attention needs to the cache
//! (per layer, per sequence, in "streams" of fixed width per token: Mixtral keeps K and V; MLA
//! keeps the compressed latent and the shared rope key) and returns logits.
//!
//! A cache keeps its rows one of two ways ([`KvStorage`]), and a model says which it needs
//! ([`ModelInfo::kv_storage`]): f32 rows on the host, read back as slices (the CPU path), or one
//! preallocated `[slots, width]` slab per layer and stream on the model's device, in the model's
//! dtype, each sequence owning a contiguous slot range (the device path: attention reads the slabs
//! in place). A device forward pass asks the slab cache once for the batch's [`SlotMapping`] (one
//! upload) and appends each layer's rows through it, every stream in one launch
//! ([`KvCache::append_mapped`]).

use std::collections::HashSet;

use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::elementwise::RowIndex;
use fmoe_kernels::kv_cache::KvSource;

use crate::{Error, Result};

/// A sequence's handle in the KV cache.
pub type SeqId = u64;

/// What a model caches per token and layer: `streams[i]` values in stream `i` (f32 on the host,
/// the model's dtype in a slab).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub streams: Vec<usize>,
}

/// How a KV cache stores its rows (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvStorage {
    /// f32 rows on the host, grown per sequence ([`KvCache::append`], [`KvCache::stream`]).
    HostF32,
    /// Preallocated `[slots, width]` slabs in `dtype` on `device` ([`KvCache::append_rows`],
    /// [`KvCache::slot_mapping`], [`KvCache::append_mapped`], [`KvCache::slab`],
    /// [`KvCache::base_slot`]).
    Slab { device: Device, dtype: DType },
}

/// Per-layer, per-sequence cache storage, owned by the engine. Rows are appended in token order.
/// A host cache ([`KvStorage::HostF32`]) reads a stream back as one contiguous `[tokens, width]`
/// slice; a slab cache ([`KvStorage::Slab`]) exposes its slabs as tensors, and the slab methods'
/// default bodies are the host cache's "not a slab cache" errors.
pub trait KvCache: Sync {
    /// Tokens cached for `seq` at `layer` (in stream 0).
    fn cached(&self, seq: SeqId, layer: usize) -> Result<usize>;
    /// Appends `rows` (whole rows of the stream's width) for `seq` at `layer`.
    fn append(&mut self, seq: SeqId, layer: usize, stream: usize, rows: &[f32]) -> Result<()>;
    /// Everything cached for `seq` in one stream of `layer` (host caches).
    fn stream(&self, seq: SeqId, layer: usize, stream: usize) -> Result<&[f32]>;

    /// How this cache stores its rows.
    fn storage(&self) -> KvStorage {
        KvStorage::HostF32
    }
    /// The first slot of `seq`'s range (the same in every slab): token `i` of the sequence is
    /// row `base_slot + i` of each slab.
    fn base_slot(&self, seq: SeqId) -> Result<usize> {
        let _ = seq;
        Err(not_a_slab_cache("base_slot"))
    }
    /// Appends rows `first..first + n`, columns `col..col + width` of the 2-D `src` (on the
    /// cache's device, in its dtype) to `seq`'s range in (`layer`, `stream`).
    #[allow(clippy::too_many_arguments)]
    fn append_rows(
        &mut self,
        seq: SeqId,
        layer: usize,
        stream: usize,
        src: &Tensor,
        first: usize,
        col: usize,
        n: usize,
    ) -> Result<()> {
        let _ = (seq, layer, stream, src, first, col, n);
        Err(not_a_slab_cache("append_rows"))
    }
    /// The slab `[slots, width]` of (`layer`, `stream`), every sequence's rows in place.
    fn slab(&self, layer: usize, stream: usize) -> Result<&Tensor> {
        let _ = (layer, stream);
        Err(not_a_slab_cache("slab"))
    }
    /// Where a batch's new tokens go: `chunks` are (sequence, new tokens) in batch order, the
    /// batch's rows being those tokens in that order. Made once per forward pass (one upload on a
    /// device), read by every layer's [`KvCache::append_mapped`].
    fn slot_mapping(&self, chunks: &[(SeqId, usize)]) -> Result<SlotMapping> {
        let _ = chunks;
        Err(not_a_slab_cache("slot_mapping"))
    }
    /// Appends the batch's rows to every stream of `layer` through `map`: stream `i` takes columns
    /// `sources[i].col..+width` of each row of `sources[i].src` (on the cache's device, in its
    /// dtype; one source per stream). On a device one launch per two streams.
    fn append_mapped(
        &mut self,
        layer: usize,
        sources: &[KvSource<'_>],
        map: &SlotMapping,
    ) -> Result<()> {
        let _ = (layer, sources, map);
        Err(not_a_slab_cache("append_mapped"))
    }
}

/// A batch's slot mapping (see [`KvCache::slot_mapping`]): token `t` of the batch goes to slot
/// `slots[t]` of every slab.
#[derive(Clone, Debug)]
pub struct SlotMapping {
    /// (sequence, tokens cached before the batch, new tokens), in batch order.
    pub chunks: Vec<(SeqId, usize, usize)>,
    /// The slot of each token of the batch, u32 on the cache's device.
    pub slots: RowIndex,
}

fn not_a_slab_cache(op: &'static str) -> Error {
    Error::input(
        op,
        "this KV cache keeps f32 rows on the host; the device path needs a slab cache \
         (KvStorage::Slab, e.g. fmoe_engine::SlabKvCache)",
    )
}

/// New tokens of one sequence. `start_pos` must equal the number of tokens already cached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqChunk {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    pub start_pos: usize,
}

/// Which positions get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// Every token of the batch: `[total tokens, vocab]`.
    All,
    /// The last token of each chunk: `[chunks, vocab]` (prefill for generation, and decode).
    Last,
}

/// Facts about a loaded model the engine needs.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub architecture: &'static str,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub kv_layout: KvLayout,
    /// The KV cache [`CausalLm::forward`] needs.
    pub kv_storage: KvStorage,
    /// The MoE layers' method and kernel family (the same for every layer of a model).
    pub moe: Option<(fmoe_moe::QuantScheme, fmoe_moe::KernelFamily)>,
}

/// A causal language model.
pub trait CausalLm: Send + Sync {
    fn info(&self) -> &ModelInfo;

    /// Runs `chunks` (each sequence at most once), appending to `cache`; returns f32 logits as
    /// `which` says. After an error the cache of the batch's sequences may hold a partial pass:
    /// drop those sequences.
    fn forward(
        &self,
        chunks: &[SeqChunk],
        cache: &mut dyn KvCache,
        which: LogitsFor,
    ) -> Result<Tensor>;
}

/// One sequence's tokens within a flattened batch.
#[derive(Clone, Debug)]
pub struct Span {
    pub seq: SeqId,
    /// First row of the sequence in the batch's `[tokens, ...]` activations.
    pub offset: usize,
    pub len: usize,
    /// Position of the first token (= tokens already cached).
    pub start_pos: usize,
}

/// A validated batch: flattened tokens, their positions, and per-sequence spans.
#[derive(Clone, Debug)]
pub struct ForwardBatch {
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    pub spans: Vec<Span>,
}

impl ForwardBatch {
    /// Checks `chunks` against the cache (each sequence once, no empty chunk, `start_pos` equal to
    /// what is cached, positions below `max_positions`) and flattens them.
    pub fn new(
        chunks: &[SeqChunk],
        cache: &dyn KvCache,
        max_positions: usize,
    ) -> Result<ForwardBatch> {
        const OP: &str = "CausalLm::forward";
        if chunks.is_empty() {
            return Err(Error::input(OP, "empty batch"));
        }
        let mut seen = HashSet::new();
        let mut b = ForwardBatch {
            tokens: Vec::new(),
            positions: Vec::new(),
            spans: Vec::with_capacity(chunks.len()),
        };
        for c in chunks {
            if !seen.insert(c.seq) {
                return Err(Error::input(
                    OP,
                    format!("sequence {} appears twice in one batch", c.seq),
                ));
            }
            if c.tokens.is_empty() {
                return Err(Error::input(
                    OP,
                    format!("sequence {} has no tokens", c.seq),
                ));
            }
            let cached = cache.cached(c.seq, 0)?;
            if cached != c.start_pos {
                return Err(Error::input(
                    OP,
                    format!(
                        "sequence {}: start_pos {} but {cached} tokens are cached",
                        c.seq, c.start_pos
                    ),
                ));
            }
            let end = c.start_pos + c.tokens.len();
            if end > max_positions {
                return Err(Error::input(
                    OP,
                    format!(
                        "sequence {} would reach position {end}, beyond max_position_embeddings {max_positions}",
                        c.seq
                    ),
                ));
            }
            b.spans.push(Span {
                seq: c.seq,
                offset: b.tokens.len(),
                len: c.tokens.len(),
                start_pos: c.start_pos,
            });
            b.tokens.extend_from_slice(&c.tokens);
            b.positions.extend(c.start_pos..end);
        }
        Ok(b)
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Rows whose logits `which` asks for.
    pub fn logit_rows(&self, which: LogitsFor) -> Vec<usize> {
        match which {
            LogitsFor::All => (0..self.tokens.len()).collect(),
            LogitsFor::Last => self.spans.iter().map(|s| s.offset + s.len - 1).collect(),
        }
    }
}
