//! The paged KV pool: for every layer and cache stream one `[num_blocks · block_size, width]`
//! tensor in the model's dtype on the model's device, allocated once. A sequence's tokens live in
//! blocks of `block_size` rows that the engine assigns (its block table): position `p` is row
//! `table[p / block_size] · block_size + p % block_size` of every tensor. The pool knows nothing of
//! sequences; the engine's block manager does. A forward pass writes its new tokens' rows through
//! the step's slot mapping ([`crate::ForwardInput::slots`]), one launch per layer.

use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::elementwise::RowIndex;
use fmoe_kernels::kv_cache::{self, KvSource};

use crate::model::KvLayout;
use crate::{Error, Result};

const OP: &str = "KvPool";

/// Every layer's cache rows, in blocks (see the module docs).
pub struct KvPool {
    layout: KvLayout,
    dtype: DType,
    device: Device,
    block_size: usize,
    num_blocks: usize,
    /// [layer][stream] `[num_blocks · block_size, width]`.
    tensors: Vec<Vec<Tensor>>,
}

impl KvPool {
    /// A zero-filled pool of `num_blocks` blocks of `block_size` tokens for `layout`.
    pub fn new(
        layout: &KvLayout,
        dtype: DType,
        device: Device,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<KvPool> {
        if num_blocks == 0 || block_size == 0 {
            return Err(Error::input(
                OP,
                format!(
                    "a pool needs at least one block of at least one token (num_blocks {num_blocks}, block_size {block_size})"
                ),
            ));
        }
        let rows = num_blocks
            .checked_mul(block_size)
            .filter(|&r| r <= u32::MAX as usize + 1);
        let Some(rows) = rows else {
            return Err(Error::input(
                OP,
                format!("{num_blocks} blocks of {block_size} tokens exceed the u32 slot ids"),
            ));
        };
        Self::bytes_per_block(layout, dtype, block_size)?
            .checked_mul(num_blocks)
            .ok_or_else(|| {
                Error::input(OP, format!("{num_blocks} blocks overflow the pool's size"))
            })?;
        let tensors = (0..layout.num_layers)
            .map(|_| {
                layout
                    .streams
                    .iter()
                    .map(|&w| Ok(Tensor::zeros([rows, w], dtype, &device)?))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvPool {
            layout: layout.clone(),
            dtype,
            device,
            block_size,
            num_blocks,
            tensors,
        })
    }

    /// Bytes one block of `block_size` tokens takes over all layers and streams.
    pub fn bytes_per_block(layout: &KvLayout, dtype: DType, block_size: usize) -> Result<usize> {
        let width: usize = layout.streams.iter().sum();
        block_size
            .checked_mul(width)
            .and_then(|v| v.checked_mul(layout.num_layers))
            .and_then(|v| v.checked_mul(dtype.size_in_bytes()))
            .ok_or_else(|| {
                Error::input(
                    OP,
                    format!(
                        "a block of {block_size} tokens × {} layers × {width} values overflows",
                        layout.num_layers
                    ),
                )
            })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Token slots (rows of each tensor).
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// The rows of (`layer`, `stream`), `[num_slots, width]`.
    pub fn tensor(&self, layer: usize, stream: usize) -> Result<&Tensor> {
        self.tensors
            .get(layer)
            .and_then(|l| l.get(stream))
            .ok_or_else(|| {
                Error::input(
                    OP,
                    format!(
                        "(layer {layer}, stream {stream}) is outside the pool's {} layers × {} streams",
                        self.layout.num_layers,
                        self.layout.streams.len()
                    ),
                )
            })
    }

    /// Writes row `t` of each source (stream `i` takes `sources[i]`) to row `slots[t]` of layer
    /// `layer`'s tensors: one launch per two streams.
    pub fn append(
        &mut self,
        layer: usize,
        sources: &[KvSource<'_>],
        slots: &RowIndex,
    ) -> Result<()> {
        let streams = self.layout.streams.len();
        if sources.len() != streams {
            return Err(Error::input(
                OP,
                format!(
                    "{} sources for the {streams} streams of layer {layer}",
                    sources.len()
                ),
            ));
        }
        let Some(tensors) = self.tensors.get_mut(layer) else {
            return Err(Error::input(
                OP,
                format!(
                    "layer {layer} out of range ({} layers)",
                    self.layout.num_layers
                ),
            ));
        };
        for (dst, src) in tensors
            .chunks_mut(kv_cache::MAX_STREAMS)
            .zip(sources.chunks(kv_cache::MAX_STREAMS))
        {
            kv_cache::append_rows(dst, src, slots)?;
        }
        Ok(())
    }

    /// Checks that the pool is what a model on `device` in `dtype` with `layout` writes to.
    pub fn check_for(&self, layout: &KvLayout, dtype: DType, device: Device) -> Result<()> {
        if (&self.layout, self.dtype, self.device) != (layout, dtype, device) {
            return Err(Error::input(
                "CausalLm::forward",
                format!(
                    "the model needs a KV pool of {layout:?} in {dtype} on {device}; this one is {:?} in {} on {}",
                    self.layout, self.dtype, self.device
                ),
            ));
        }
        Ok(())
    }
}
