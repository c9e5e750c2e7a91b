//! The host KV cache: per sequence, per layer, per stream, one contiguous `Vec<f32>` that grows
//! as tokens are appended (the CPU path). [`ModelKvCache`] is whichever cache a model needs: this
//! one or the device slabs of [`SlabKvCache`]. (A paged cache replaces both behind the same
//! [`fmoe_models::KvCache`] trait once the scheduler batches many requests.)

use std::collections::HashMap;

use fmoe_core::Tensor;
use fmoe_kernels::kv_cache::KvSource;
use fmoe_models::{Error, KvCache, KvLayout, KvStorage, ModelInfo, Result, SeqId, SlotMapping};

use crate::SlabKvCache;

const OP: &str = "KvCache";

/// Contiguous per-sequence storage for a model's [`KvLayout`].
pub struct ContiguousKvCache {
    layout: KvLayout,
    /// seq → [layer][stream] rows.
    seqs: HashMap<SeqId, Vec<Vec<Vec<f32>>>>,
    next: SeqId,
}

impl ContiguousKvCache {
    pub fn new(layout: KvLayout) -> ContiguousKvCache {
        ContiguousKvCache {
            layout,
            seqs: HashMap::new(),
            next: 0,
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// A new, empty sequence.
    pub fn allocate(&mut self) -> SeqId {
        let id = self.next;
        self.next += 1;
        let layers = (0..self.layout.num_layers)
            .map(|_| vec![Vec::new(); self.layout.streams.len()])
            .collect();
        self.seqs.insert(id, layers);
        id
    }

    /// Drops a sequence's cache (unknown ids are ignored).
    pub fn free(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// f32 values held, all sequences.
    pub fn num_values(&self) -> usize {
        self.seqs
            .values()
            .flat_map(|layers| layers.iter().flatten())
            .map(Vec::len)
            .sum()
    }

    fn seq(&self, seq: SeqId) -> Result<&Vec<Vec<Vec<f32>>>> {
        self.seqs.get(&seq).ok_or_else(|| unknown(seq))
    }

    fn width(&self, layer: usize, stream: usize) -> Result<usize> {
        if layer >= self.layout.num_layers {
            return Err(Error::Input {
                op: OP,
                msg: format!(
                    "layer {layer} out of range ({} layers)",
                    self.layout.num_layers
                ),
            });
        }
        self.layout
            .streams
            .get(stream)
            .copied()
            .ok_or_else(|| Error::Input {
                op: OP,
                msg: format!(
                    "stream {stream} out of range ({} streams)",
                    self.layout.streams.len()
                ),
            })
    }
}

fn unknown(seq: SeqId) -> Error {
    Error::Input {
        op: OP,
        msg: format!("unknown sequence {seq}"),
    }
}

impl KvCache for ContiguousKvCache {
    fn cached(&self, seq: SeqId, layer: usize) -> Result<usize> {
        let w = self.width(layer, 0)?;
        Ok(self.seq(seq)?[layer][0].len() / w.max(1))
    }

    fn append(&mut self, seq: SeqId, layer: usize, stream: usize, rows: &[f32]) -> Result<()> {
        let w = self.width(layer, stream)?;
        if w == 0 || !rows.len().is_multiple_of(w) {
            return Err(Error::Input {
                op: OP,
                msg: format!(
                    "{} values are not whole rows of width {w} (layer {layer}, stream {stream})",
                    rows.len()
                ),
            });
        }
        let s = self.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        s[layer][stream].extend_from_slice(rows);
        Ok(())
    }

    fn stream(&self, seq: SeqId, layer: usize, stream: usize) -> Result<&[f32]> {
        self.width(layer, stream)?;
        Ok(&self.seq(seq)?[layer][stream])
    }
}

/// The KV cache a model's [`ModelInfo::kv_storage`] asks for.
pub enum ModelKvCache {
    Host(ContiguousKvCache),
    Slab(SlabKvCache),
}

impl ModelKvCache {
    /// A cache for `info`'s model; a slab cache holds `slots` tokens (all sequences together).
    pub fn for_model(info: &ModelInfo, slots: usize) -> Result<ModelKvCache> {
        Ok(match info.kv_storage {
            KvStorage::HostF32 => {
                ModelKvCache::Host(ContiguousKvCache::new(info.kv_layout.clone()))
            }
            KvStorage::Slab { device, dtype } => ModelKvCache::Slab(SlabKvCache::new(
                info.kv_layout.clone(),
                dtype,
                device,
                slots,
            )?),
        })
    }

    /// A new, empty sequence of at most `max_tokens` tokens (a bound only slab caches hold
    /// sequences to).
    pub fn allocate(&mut self, max_tokens: usize) -> Result<SeqId> {
        match self {
            ModelKvCache::Host(c) => Ok(c.allocate()),
            ModelKvCache::Slab(c) => c.allocate(max_tokens),
        }
    }

    pub fn free(&mut self, seq: SeqId) {
        match self {
            ModelKvCache::Host(c) => c.free(seq),
            ModelKvCache::Slab(c) => c.free(seq),
        }
    }

    fn inner(&self) -> &dyn KvCache {
        match self {
            ModelKvCache::Host(c) => c,
            ModelKvCache::Slab(c) => c,
        }
    }

    fn inner_mut(&mut self) -> &mut dyn KvCache {
        match self {
            ModelKvCache::Host(c) => c,
            ModelKvCache::Slab(c) => c,
        }
    }
}

impl KvCache for ModelKvCache {
    fn cached(&self, seq: SeqId, layer: usize) -> Result<usize> {
        self.inner().cached(seq, layer)
    }
    fn append(&mut self, seq: SeqId, layer: usize, stream: usize, rows: &[f32]) -> Result<()> {
        self.inner_mut().append(seq, layer, stream, rows)
    }
    fn stream(&self, seq: SeqId, layer: usize, stream: usize) -> Result<&[f32]> {
        self.inner().stream(seq, layer, stream)
    }
    fn storage(&self) -> KvStorage {
        self.inner().storage()
    }
    fn base_slot(&self, seq: SeqId) -> Result<usize> {
        self.inner().base_slot(seq)
    }
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
        self.inner_mut()
            .append_rows(seq, layer, stream, src, first, col, n)
    }
    fn slab(&self, layer: usize, stream: usize) -> Result<&Tensor> {
        self.inner().slab(layer, stream)
    }
    fn slot_mapping(&self, chunks: &[(SeqId, usize)]) -> Result<SlotMapping> {
        self.inner().slot_mapping(chunks)
    }
    fn append_mapped(
        &mut self,
        layer: usize,
        sources: &[KvSource<'_>],
        map: &SlotMapping,
    ) -> Result<()> {
        self.inner_mut().append_mapped(layer, sources, map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_grow_independently() {
        let mut c = ContiguousKvCache::new(KvLayout {
            num_layers: 2,
            streams: vec![2, 3],
        });
        let a = c.allocate();
        let b = c.allocate();
        c.append(a, 0, 0, &[1.0, 2.0, 3.0, 4.0]).unwrap();
        c.append(a, 0, 1, &[0.0; 6]).unwrap();
        assert_eq!(c.cached(a, 0).unwrap(), 2);
        assert_eq!(c.cached(a, 1).unwrap(), 0);
        assert_eq!(c.cached(b, 0).unwrap(), 0);
        assert_eq!(c.stream(a, 0, 0).unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert!(
            c.append(a, 0, 1, &[0.0; 4])
                .unwrap_err()
                .to_string()
                .contains("width 3")
        );
        assert!(c.append(a, 2, 0, &[0.0; 2]).is_err());
        c.free(a);
        assert!(
            c.cached(a, 0)
                .unwrap_err()
                .to_string()
                .contains("unknown sequence")
        );
        assert_eq!(c.num_sequences(), 1);
    }
}
