//! `kv_cache`: a batch's new key/value rows written into preallocated KV-cache slabs, in place.
//!
//! A slab is a `[slots, width]` tensor holding one (layer, stream) of every sequence's cache (the
//! engine's `SlabKvCache`). [`append_rows`] writes row `t` of each source — a column range of a
//! 2-D tensor, e.g. the values inside the fused q/k/v output — to row `slots[t]` of its slab:
//! vLLM's `reshape_and_cache` with a slot mapping. The mapping is a [`RowIndex`], uploaded once
//! per forward pass and read by every layer, and one call writes up to [`MAX_STREAMS`] slabs (a
//! layer's K and V), so a layer's append is one launch whatever the batch, where per-sequence
//! copies cost one launch per (sequence, stream).
//!
//! Validation is on the host: shapes, dtypes (a source and its slab share one; any dtype, bytes
//! move unchanged), devices, and the slots against each slab's rows from the bound the
//! [`RowIndex`] was built with. Slots must be distinct: two tokens sent to one slot leave either
//! row there on CUDA (the CPU twin writes them in token order).
//!
//! CUDA: `cuda/kv_append.cu`, blocks over (token, stream), threads over the row in the widest
//! word (up to 16 bytes) every offset and width allows; no upload, no synchronization.

mod cpu;
mod cuda;

pub(crate) use cuda::variants as cuda_variants;

use fmoe_core::{Storage, Tensor};

pub use crate::elementwise::RowIndex;
use crate::{Error, Result};

const OP: &str = "kv_cache::append_rows";

/// Most slabs one [`append_rows`] call writes (the kernel's streams).
pub const MAX_STREAMS: usize = 2;

/// Where one slab's new rows come from: columns `col..col + width` (the slab's width) of the 2-D
/// `src`, whose row `t` is the batch's token `t`.
#[derive(Clone, Copy, Debug)]
pub struct KvSource<'a> {
    pub src: &'a Tensor,
    pub col: usize,
}

/// For each stream `i` and token `t`: row `slots[t]` of `slabs[i]` `[S_i, W_i]` ← columns
/// `sources[i].col..+W_i` of row `t` of `sources[i].src` `[T, *]` (see the module docs).
/// `slabs` and `sources` pair up, 1 to [`MAX_STREAMS`] of them; `slots` has T ids. Each slab's
/// storage must be unshared (it is written in place).
pub fn append_rows(slabs: &mut [Tensor], sources: &[KvSource<'_>], slots: &RowIndex) -> Result<()> {
    if slabs.len() != sources.len() || slabs.is_empty() || slabs.len() > MAX_STREAMS {
        return Err(Error::invalid(
            OP,
            format!(
                "{} slabs and {} sources: they pair up, 1 to {MAX_STREAMS} of them",
                slabs.len(),
                sources.len()
            ),
        ));
    }
    // The slabs set the device; ids elsewhere are named as such.
    let device = slabs[0].device();
    slots.ids().expect_device(OP, "ids", device)?;
    let tokens = slots.len();
    let mut geometry = Vec::with_capacity(slabs.len());
    for (i, (slab, s)) in slabs.iter().zip(sources).enumerate() {
        let (slab_name, src_name) = (format!("slabs[{i}]"), format!("sources[{i}]"));
        let &[rows, width] = slab.expect_rank(OP, &slab_name, 2, "[slots, width]")? else {
            unreachable!("rank checked")
        };
        let &[src_rows, src_width] = s.src.expect_rank(OP, &src_name, 2, "[tokens, width]")? else {
            unreachable!("rank checked")
        };
        slab.expect_device(OP, &slab_name, device)?;
        s.src.expect_device(OP, &src_name, device)?;
        s.src.expect_dtype(OP, &src_name, &[slab.dtype()])?;
        if src_rows != tokens {
            return Err(Error::invalid(
                OP,
                format!("`{src_name}` has {src_rows} rows for {tokens} slots"),
            ));
        }
        if s.col.checked_add(width).is_none_or(|end| end > src_width) {
            return Err(Error::invalid(
                OP,
                format!(
                    "columns {}..{}+{width} of `{src_name}` [{src_rows}, {src_width}] are out of range",
                    s.col, s.col
                ),
            ));
        }
        slots.check_for(OP, &slab_name, rows, device)?;
        geometry.push(Stream {
            src_width,
            col: s.col,
            width,
        });
    }
    if tokens == 0 {
        return Ok(());
    }
    match slots.ids().storage() {
        Storage::Cpu(_) => {
            let ids = slots.ids().cpu_slice::<u32>(OP, "slots")?;
            for ((slab, s), g) in slabs.iter_mut().zip(sources).zip(&geometry) {
                cpu::append(slab, s.src, ids, g)?;
            }
            Ok(())
        }
        Storage::Cuda(ids) => cuda::append(slabs, sources, ids, &geometry),
    }
}

/// One stream's geometry, in elements: the source's row width, the first column, the row width.
#[derive(Clone, Copy, Debug)]
struct Stream {
    src_width: usize,
    col: usize,
    width: usize,
}

#[cfg(test)]
mod tests {
    use fmoe_core::{DType, Device};

    use super::*;

    const CPU: Device = Device::Cpu;

    fn seq(rows: usize, cols: usize, from: f32) -> Tensor {
        let v: Vec<f32> = (0..rows * cols).map(|i| from + i as f32).collect();
        Tensor::from_f32(&v, [rows, cols], DType::BF16, &CPU).unwrap()
    }

    #[test]
    fn rows_land_at_their_slots_and_nothing_else_moves() {
        // Stream 0: all 3 columns of k [4, 3]; stream 1: columns 2..4 of qkv [4, 5].
        let (k, qkv) = (seq(4, 3, 0.0), seq(4, 5, 100.0));
        let mut slabs = [seq(6, 3, -50.0), seq(6, 2, -90.0)];
        let before: Vec<Vec<f32>> = slabs.iter().map(|s| s.to_f32_vec().unwrap()).collect();
        let slots = RowIndex::new(&[5, 0, 2, 3], CPU).unwrap();
        let src = [KvSource { src: &k, col: 0 }, KvSource { src: &qkv, col: 2 }];
        append_rows(&mut slabs, &src, &slots).unwrap();
        let (kv, qv) = (k.to_f32_vec().unwrap(), qkv.to_f32_vec().unwrap());
        for (i, (slab, (w, src_w, col, src))) in slabs
            .iter()
            .zip([(3, 3, 0, &kv), (2, 5, 2, &qv)])
            .enumerate()
        {
            let got = slab.to_f32_vec().unwrap();
            let mut want = before[i].clone();
            for (t, slot) in [5usize, 0, 2, 3].into_iter().enumerate() {
                want[slot * w..][..w].copy_from_slice(&src[t * src_w + col..][..w]);
            }
            assert_eq!(got, want, "stream {i}");
            // Row 1 and 4 untouched.
            assert_eq!(got[w..2 * w], before[i][w..2 * w]);
        }
        // No tokens: nothing happens.
        let none = RowIndex::new(&[], CPU).unwrap();
        let e = [KvSource {
            src: &seq(0, 3, 0.0),
            col: 0,
        }];
        append_rows(&mut slabs[..1], &e, &none).unwrap();
    }

    #[test]
    fn bad_calls_are_errors_naming_what_is_wrong() {
        let k = seq(2, 4, 0.0);
        let mut slabs = [seq(3, 2, 0.0), seq(3, 2, 0.0)];
        let slots = RowIndex::new(&[0, 2], CPU).unwrap();
        let one = [KvSource { src: &k, col: 1 }];
        let err = |slabs: &mut [Tensor], src: &[KvSource<'_>], slots: &RowIndex| {
            let e = append_rows(slabs, src, slots).unwrap_err().to_string();
            assert!(e.starts_with(OP), "{e}");
            e
        };
        assert!(err(&mut slabs, &one, &slots).contains("pair up"));
        let e = err(&mut slabs[..1], &[KvSource { src: &k, col: 3 }], &slots);
        assert!(e.contains("columns 3") && e.contains("sources[0]"), "{e}");
        let e = err(&mut slabs[..1], &one, &RowIndex::new(&[0, 3], CPU).unwrap());
        assert!(e.contains("row id 3") && e.contains("slabs[0]"), "{e}");
        let e = err(&mut slabs[..1], &one, &RowIndex::new(&[0], CPU).unwrap());
        assert!(e.contains("2 rows for 1 slots"), "{e}");
        let f = k.to_dtype(DType::F32).unwrap();
        let e = err(&mut slabs[..1], &[KvSource { src: &f, col: 0 }], &slots);
        assert!(e.contains("sources[0]") && e.contains("f32"), "{e}");
        // A slab shared with another tensor is not written.
        let alias = slabs[0].clone();
        let e = err(&mut slabs[..1], &one, &slots);
        assert!(e.contains("shared"), "{e}");
        drop(alias);
        append_rows(&mut slabs[..1], &one, &slots).unwrap();
    }
}
