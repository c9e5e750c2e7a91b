//! The device KV cache: per layer and stream one `[slots, width]` slab in the model's dtype on the
//! model's device, allocated once from a token budget. Each sequence owns a contiguous slot range
//! (first fit over the free ranges), so its rows for positions `0..n` are slab rows
//! `base..base + n` in every layer and stream: attention reads them in place
//! (`SeqSpan::kv_start = base`). A forward pass gets the batch's slot mapping once
//! ([`KvCache::slot_mapping`]: the slot of each new token, one upload) and appends each layer
//! through it: one launch for two streams, whatever the batch ([`KvCache::append_mapped`],
//! `fmoe_kernels::kv_cache`). [`KvCache::append_rows`] (one device-to-device copy per call)
//! remains for single sequences. No KV traffic between host and device after the allocation.

use std::collections::{HashMap, HashSet};

use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::elementwise::RowIndex;
use fmoe_kernels::kv_cache::{self, KvSource};
use fmoe_models::{Error, KvCache, KvLayout, KvStorage, Result, SeqId, SlotMapping};

const OP: &str = "SlabKvCache";

struct Seq {
    base: usize,
    capacity: usize,
    /// [layer][stream] rows appended.
    len: Vec<Vec<usize>>,
}

/// Preallocated slabs for a model's [`KvLayout`] (see the module docs).
pub struct SlabKvCache {
    layout: KvLayout,
    dtype: DType,
    device: Device,
    slots: usize,
    /// [layer][stream] `[slots, width]`.
    slabs: Vec<Vec<Tensor>>,
    seqs: HashMap<SeqId, Seq>,
    /// Free slot ranges (start, len), sorted by start, coalesced.
    free: Vec<(usize, usize)>,
    next: SeqId,
}

impl SlabKvCache {
    /// Slabs for `slots` tokens (all sequences together) of `layout`, in `dtype` on `device`
    /// (zero-filled: a memset on CUDA).
    pub fn new(layout: KvLayout, dtype: DType, device: Device, slots: usize) -> Result<Self> {
        if slots == 0 {
            return Err(Error::input(OP, "a slab cache needs at least one slot"));
        }
        let slabs = (0..layout.num_layers)
            .map(|_| {
                layout
                    .streams
                    .iter()
                    .map(|&w| Ok(Tensor::zeros([slots, w], dtype, &device)?))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SlabKvCache {
            layout,
            dtype,
            device,
            slots,
            slabs,
            seqs: HashMap::new(),
            free: vec![(0, slots)],
            next: 0,
        })
    }

    /// Bytes of `slots` tokens of `layout` in `dtype` (what [`SlabKvCache::new`] allocates).
    pub fn bytes_for(layout: &KvLayout, dtype: DType, slots: usize) -> usize {
        slots * layout.num_layers * layout.streams.iter().sum::<usize>() * dtype.size_in_bytes()
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The token budget (slots of each slab).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Slots not owned by any sequence.
    pub fn free_slots(&self) -> usize {
        self.free.iter().map(|f| f.1).sum()
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// A new, empty sequence that may grow to `max_tokens` tokens (a contiguous slot range).
    pub fn allocate(&mut self, max_tokens: usize) -> Result<SeqId> {
        let id = self.next;
        if max_tokens == 0 {
            return Err(Error::input(
                OP,
                format!("sequence {id}: a sequence needs at least one slot"),
            ));
        }
        let Some(at) = self.free.iter().position(|f| f.1 >= max_tokens) else {
            return Err(Error::input(
                OP,
                format!(
                    "sequence {id} needs {max_tokens} contiguous slots; the budget is {} tokens, {} free (largest free range {})",
                    self.slots,
                    self.free_slots(),
                    self.free.iter().map(|f| f.1).max().unwrap_or(0)
                ),
            ));
        };
        let (base, len) = self.free[at];
        if len == max_tokens {
            self.free.remove(at);
        } else {
            self.free[at] = (base + max_tokens, len - max_tokens);
        }
        self.next += 1;
        let n = self.layout.streams.len();
        self.seqs.insert(
            id,
            Seq {
                base,
                capacity: max_tokens,
                len: vec![vec![0; n]; self.layout.num_layers],
            },
        );
        Ok(id)
    }

    /// Drops a sequence, returning its slots (unknown ids are ignored). Its rows stay in the
    /// slabs until overwritten: nothing reads slots outside a live sequence's range.
    pub fn free(&mut self, seq: SeqId) {
        let Some(s) = self.seqs.remove(&seq) else {
            return;
        };
        let at = self.free.partition_point(|f| f.0 < s.base);
        self.free.insert(at, (s.base, s.capacity));
        // Coalesce with the neighbours.
        if at + 1 < self.free.len() && self.free[at].0 + self.free[at].1 == self.free[at + 1].0 {
            self.free[at].1 += self.free[at + 1].1;
            self.free.remove(at + 1);
        }
        if at > 0 && self.free[at - 1].0 + self.free[at - 1].1 == self.free[at].0 {
            self.free[at - 1].1 += self.free[at].1;
            self.free.remove(at);
        }
    }

    fn seq(&self, seq: SeqId) -> Result<&Seq> {
        self.seqs.get(&seq).ok_or_else(|| unknown(seq))
    }

    fn width(&self, layer: usize, stream: usize) -> Result<usize> {
        if layer >= self.layout.num_layers {
            return Err(Error::input(
                OP,
                format!(
                    "layer {layer} out of range ({} layers)",
                    self.layout.num_layers
                ),
            ));
        }
        self.layout.streams.get(stream).copied().ok_or_else(|| {
            Error::input(
                OP,
                format!(
                    "stream {stream} out of range ({} streams)",
                    self.layout.streams.len()
                ),
            )
        })
    }

    /// Checks that `n` more rows fit `seq`'s range at (layer, stream); returns (slot, seq len).
    fn reserve(&self, seq: SeqId, layer: usize, stream: usize, n: usize) -> Result<usize> {
        self.width(layer, stream)?;
        let s = self.seq(seq)?;
        let len = s.len[layer][stream];
        if len + n > s.capacity {
            return Err(Error::input(
                OP,
                format!(
                    "sequence {seq}: {n} more tokens at layer {layer} would make {}, beyond its {} slots (cache budget {} tokens)",
                    len + n,
                    s.capacity,
                    self.slots
                ),
            ));
        }
        Ok(s.base + len)
    }
}

fn unknown(seq: SeqId) -> Error {
    Error::input(OP, format!("unknown sequence {seq}"))
}

impl KvCache for SlabKvCache {
    fn cached(&self, seq: SeqId, layer: usize) -> Result<usize> {
        self.width(layer, 0)?;
        Ok(self.seq(seq)?.len[layer][0])
    }

    /// Host rows: converted to the cache's dtype and uploaded (one copy per call).
    fn append(&mut self, seq: SeqId, layer: usize, stream: usize, rows: &[f32]) -> Result<()> {
        let w = self.width(layer, stream)?;
        if w == 0 || !rows.len().is_multiple_of(w) {
            return Err(Error::input(
                OP,
                format!(
                    "{} values are not whole rows of width {w} (layer {layer}, stream {stream})",
                    rows.len()
                ),
            ));
        }
        let n = rows.len() / w;
        let t = Tensor::from_f32(rows, [n, w], self.dtype, &self.device)?;
        self.append_rows(seq, layer, stream, &t, 0, 0, n)
    }

    fn stream(&self, seq: SeqId, layer: usize, stream: usize) -> Result<&[f32]> {
        let _ = (seq, layer, stream);
        Err(Error::input(
            OP,
            "a slab cache has no host rows: read its slabs (KvCache::slab)",
        ))
    }

    fn storage(&self) -> KvStorage {
        KvStorage::Slab {
            device: self.device,
            dtype: self.dtype,
        }
    }

    fn base_slot(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.base)
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
        let slot = self.reserve(seq, layer, stream, n)?;
        self.slabs[layer][stream].copy_rows_from(slot, src, first, col, n)?;
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.len[layer][stream] += n;
        }
        Ok(())
    }

    fn slab(&self, layer: usize, stream: usize) -> Result<&Tensor> {
        self.width(layer, stream)?;
        Ok(&self.slabs[layer][stream])
    }

    /// Each chunk's tokens go to the slots after its sequence's rows at layer 0 (every layer
    /// holds as many at the start of a pass; [`KvCache::append_mapped`] checks it).
    fn slot_mapping(&self, chunks: &[(SeqId, usize)]) -> Result<SlotMapping> {
        let mut seen = HashSet::new();
        let mut slots = Vec::with_capacity(chunks.iter().map(|c| c.1).sum());
        let mut out = Vec::with_capacity(chunks.len());
        for &(seq, n) in chunks {
            if !seen.insert(seq) {
                return Err(Error::input(
                    OP,
                    format!("sequence {seq} appears twice in one slot mapping"),
                ));
            }
            let start = self.seq(seq)?.len[0][0];
            let slot = self.reserve(seq, 0, 0, n)?;
            slots.extend((slot..slot + n).map(|s| s as u32));
            out.push((seq, start, n));
        }
        if self.slots > u32::MAX as usize + 1 {
            return Err(Error::input(
                OP,
                format!("{} slots exceed the u32 slot ids", self.slots),
            ));
        }
        Ok(SlotMapping {
            chunks: out,
            slots: RowIndex::new(&slots, self.device)?,
        })
    }

    fn append_mapped(
        &mut self,
        layer: usize,
        sources: &[KvSource<'_>],
        map: &SlotMapping,
    ) -> Result<()> {
        let streams = self.layout.streams.len();
        self.width(layer, 0)?;
        if sources.len() != streams {
            return Err(Error::input(
                OP,
                format!(
                    "{} sources for the {streams} streams of layer {layer}",
                    sources.len()
                ),
            ));
        }
        let mut tokens = 0;
        for &(seq, start, n) in &map.chunks {
            let s = self.seq(seq)?;
            for (stream, &len) in s.len[layer].iter().enumerate() {
                if len != start {
                    return Err(Error::input(
                        OP,
                        format!(
                            "sequence {seq}: layer {layer} stream {stream} holds {len} rows, the slot mapping was made at {start}"
                        ),
                    ));
                }
            }
            self.reserve(seq, layer, 0, n)?;
            tokens += n;
        }
        if tokens != map.slots.len() {
            return Err(Error::input(
                OP,
                format!(
                    "the slot mapping's chunks hold {tokens} tokens, its slots {}",
                    map.slots.len()
                ),
            ));
        }
        for (slabs, srcs) in self.slabs[layer]
            .chunks_mut(kv_cache::MAX_STREAMS)
            .zip(sources.chunks(kv_cache::MAX_STREAMS))
        {
            kv_cache::append_rows(slabs, srcs, &map.slots)?;
        }
        for &(seq, _, n) in &map.chunks {
            if let Some(s) = self.seqs.get_mut(&seq) {
                s.len[layer].iter_mut().for_each(|l| *l += n);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            streams: vec![2, 3],
        }
    }

    #[test]
    fn sequences_own_contiguous_ranges_and_overflow_names_the_budget() {
        let mut c = SlabKvCache::new(layout(), DType::F32, Device::Cpu, 10).unwrap();
        let a = c.allocate(4).unwrap();
        let b = c.allocate(5).unwrap();
        assert_eq!((c.base_slot(a).unwrap(), c.base_slot(b).unwrap()), (0, 4));
        // Rows 1..3 of src, columns 1..3, into a's stream 0 of layer 1.
        let src =
            Tensor::from_vec((0..12).map(|i| i as f32).collect(), [3, 4], &Device::Cpu).unwrap();
        c.append_rows(a, 1, 0, &src, 1, 1, 2).unwrap();
        assert_eq!(c.cached(a, 1).unwrap(), 2);
        assert_eq!(c.cached(a, 0).unwrap(), 0);
        let slab = c.slab(1, 0).unwrap().to_f32_vec().unwrap();
        assert_eq!(&slab[..4], &[5.0, 6.0, 9.0, 10.0]);
        // Host rows go through the same path.
        c.append(b, 0, 1, &[1.0, 2.0, 3.0]).unwrap();
        let slab = c.slab(0, 1).unwrap().to_f32_vec().unwrap();
        assert_eq!(&slab[4 * 3..5 * 3], &[1.0, 2.0, 3.0]);
        assert!(c.append(b, 0, 1, &[1.0, 2.0]).is_err());
        // a holds 4 slots: 2 more fit, 3 do not.
        let err = c
            .append_rows(a, 1, 0, &src, 0, 0, 3)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("sequence 0") && err.contains("4 slots") && err.contains("budget 10"),
            "{err}"
        );
        let err = c.allocate(2).unwrap_err().to_string();
        assert!(
            err.contains("sequence 2") && err.contains("1 free"),
            "{err}"
        );
        // Freed ranges coalesce and are reused.
        c.free(a);
        c.free(b);
        assert_eq!(c.free_slots(), 10);
        let d = c.allocate(10).unwrap();
        assert_eq!(c.base_slot(d).unwrap(), 0);
        assert!(c.stream(d, 0, 0).is_err());
        assert!(c.cached(a, 0).unwrap_err().to_string().contains("unknown"));
        assert_eq!(
            SlabKvCache::bytes_for(&layout(), DType::BF16, 10),
            10 * 2 * 5 * 2
        );
    }

    #[test]
    fn a_slot_mapping_appends_every_layer_like_per_sequence_copies() {
        // Two sequences, a: 2 tokens cached, b: none; the batch is a's 1 new token, then b's 3.
        let src = |rows: usize, w: usize, from: f32| {
            Tensor::from_vec(
                (0..rows * w).map(|i| from + i as f32).collect(),
                [rows, w],
                &Device::Cpu,
            )
            .unwrap()
        };
        let mut mapped = SlabKvCache::new(layout(), DType::F32, Device::Cpu, 12).unwrap();
        let mut copied = SlabKvCache::new(layout(), DType::F32, Device::Cpu, 12).unwrap();
        let (a, b) = (mapped.allocate(4).unwrap(), mapped.allocate(6).unwrap());
        assert_eq!(
            (copied.allocate(4).unwrap(), copied.allocate(6).unwrap()),
            (a, b)
        );
        let past = src(2, 5, -20.0);
        for c in [&mut mapped, &mut copied] {
            for layer in 0..2 {
                c.append_rows(a, layer, 0, &past, 0, 0, 2).unwrap();
                c.append_rows(a, layer, 1, &past, 0, 2, 2).unwrap();
            }
        }
        let map = mapped.slot_mapping(&[(a, 1), (b, 3)]).unwrap();
        assert_eq!(map.chunks, vec![(a, 2, 1), (b, 0, 3)]);
        assert_eq!(
            map.slots.ids().cpu_slice::<u32>("t", "slots").unwrap(),
            &[2, 4, 5, 6]
        );
        for layer in 0..2 {
            // Stream 0 from k [4, 2]; stream 1 from columns 2..5 of qkv [4, 5].
            let (k, qkv) = (src(4, 2, 100.0 * layer as f32), src(4, 5, 7.0));
            let kv = [KvSource { src: &k, col: 0 }, KvSource { src: &qkv, col: 2 }];
            mapped.append_mapped(layer, &kv, &map).unwrap();
            for (seq, first, n) in [(a, 0, 1), (b, 1, 3)] {
                copied.append_rows(seq, layer, 0, &k, first, 0, n).unwrap();
                copied
                    .append_rows(seq, layer, 1, &qkv, first, 2, n)
                    .unwrap();
            }
            for stream in 0..2 {
                assert_eq!(
                    mapped.slab(layer, stream).unwrap().to_f32_vec().unwrap(),
                    copied.slab(layer, stream).unwrap().to_f32_vec().unwrap(),
                    "layer {layer} stream {stream}"
                );
            }
            assert_eq!(mapped.cached(a, layer).unwrap(), 3);
            assert_eq!(mapped.cached(b, layer).unwrap(), 3);
        }
        // A mapping is for one pass: a layer already appended through it is refused, as are
        // the wrong number of sources, repeated or unknown sequences and overflowing chunks.
        let (k, qkv) = (src(4, 2, 0.0), src(4, 5, 0.0));
        let kv = [KvSource { src: &k, col: 0 }, KvSource { src: &qkv, col: 2 }];
        let e = mapped.append_mapped(0, &kv, &map).unwrap_err().to_string();
        assert!(e.contains("holds 3 rows") && e.contains("made at 2"), "{e}");
        let e = mapped
            .append_mapped(0, &kv[..1], &map)
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 sources for the 2 streams"), "{e}");
        let e = mapped
            .slot_mapping(&[(a, 1), (a, 1)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("twice"), "{e}");
        assert!(mapped.slot_mapping(&[(9, 1)]).is_err());
        let e = mapped.slot_mapping(&[(a, 2)]).unwrap_err().to_string();
        assert!(e.contains("4 slots"), "{e}");
    }
}
