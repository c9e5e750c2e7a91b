//! CPU twin of [`super::append_rows`]: row copies in token order.

use fmoe_core::{CpuStorage, Storage, Tensor};

use super::{OP, Stream};
use crate::{Error, Result};

/// `slab[slots[t]] ← src[t, col..col + width]` for every token (validated by the caller).
pub(super) fn append(slab: &mut Tensor, src: &Tensor, slots: &[u32], g: &Stream) -> Result<()> {
    fn rows<T: Copy>(dst: &mut [T], src: &[T], slots: &[u32], g: &Stream) {
        for (t, &slot) in slots.iter().enumerate() {
            let from = t * g.src_width + g.col;
            dst[slot as usize * g.width..][..g.width].copy_from_slice(&src[from..from + g.width]);
        }
    }
    let src = src.cpu_storage(OP, "source")?;
    let Storage::Cpu(dst) = slab.storage_mut(OP)? else {
        return Err(Error::invalid(OP, "the slab is not in host memory"));
    };
    match (dst, src) {
        (CpuStorage::F32(d), CpuStorage::F32(s)) => rows(d, s, slots, g),
        (CpuStorage::BF16(d), CpuStorage::BF16(s)) => rows(d, s, slots, g),
        (CpuStorage::F16(d), CpuStorage::F16(s)) => rows(d, s, slots, g),
        (CpuStorage::F8E4M3(d), CpuStorage::F8E4M3(s)) => rows(d, s, slots, g),
        (CpuStorage::U32(d), CpuStorage::U32(s)) => rows(d, s, slots, g),
        _ => {
            return Err(Error::invalid(
                OP,
                "the slab and its source differ in dtype",
            ));
        }
    }
    Ok(())
}
