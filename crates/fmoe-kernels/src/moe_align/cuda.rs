//! CUDA twin of `moe_align`: `cuda/moe_align.cu` (one thread block, `-D BLOCK_M`, and for mixed
//! tile heights `-D TALL_M`).

use fmoe_core::cuda::cudarc::driver::LaunchConfig;
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{DType, Error as CoreError, Storage, Tensor};

use super::{AlignedRoutes, OP, TallRuns, capacity};
use crate::Result;
use crate::catalog::KernelVariant;
use crate::launch::u32_arg;

const FAMILY: &str = "moe_align";
const SRC: &str = include_str!("../../cuda/moe_align.cu");
const ENTRY: &str = "fmoe_moe_align";

/// The kernel is one block; its threads stride over routes, experts and slots.
pub const ALIGN_THREADS: u32 = 1024;

/// The kernel keeps counts, cursors and offsets (3E + 1 u32) in shared memory, plus 32 words of
/// its prefix scan, within the default 48 KiB per block.
pub const MAX_EXPERTS: usize = (48 * 1024 / 4 - 1 - 32) / 3;

/// Mixed tiles: one more E + 1 words of offsets, and the prefix scan's 32 words twice as wide.
pub const MAX_EXPERTS_MIXED: usize = (48 * 1024 / 4 - 2 - 64) / 4;

/// The kernel's `-D` set for M tiles of `block_m` (and `tall` ones: mixed).
fn defines(block_m: usize, tall: Option<usize>) -> Vec<(&'static str, String)> {
    let mut d = vec![("BLOCK_M", format!("{block_m}u"))];
    if let Some(t) = tall {
        d.push(("TALL_M", format!("{t}u")));
    }
    d
}

/// The variants for the M tiles `block_ms` and the mixed pairs `mixed` (those of the grouped
/// GEMMs: the only tiles the MoE layer aligns to on CUDA).
pub(crate) fn variants(block_ms: &[usize], mixed: &[(usize, usize)]) -> Vec<KernelVariant> {
    let uniform = block_ms.iter().map(|&bm| (bm, None));
    let mixed = mixed.iter().map(|&(s, t)| (s, Some(t)));
    uniform
        .chain(mixed)
        .map(|(bm, tall)| KernelVariant {
            family: FAMILY,
            source: SRC,
            entry: ENTRY,
            defines: defines(bm, tall),
        })
        .collect()
}

pub(super) fn align_routes(
    ids_tensor: &Tensor,
    ids: &CudaStorage,
    num_experts: usize,
    block_m: usize,
    tall: Option<usize>,
) -> Result<AlignedRoutes> {
    let max = if tall.is_some() {
        MAX_EXPERTS_MIXED
    } else {
        MAX_EXPERTS
    };
    if num_experts > max {
        return Err(CoreError::Unsupported {
            op: OP,
            device: ids.device(),
            reason: format!(
                "the CUDA kernel aligns at most {max} experts with these tiles (shared memory), got \
                 {num_experts}"
            ),
        }
        .into());
    }
    let backend = ids.backend();
    let num_routes = ids.len();
    // The short (or only) segment's slots, and the tall segment's after them (mixed).
    let slots = capacity(num_routes, num_experts, block_m);
    let tall_slots = tall.map_or(0, |t| capacity(num_routes, num_experts, t));
    let all_slots = slots + tall_slots;
    let all_blocks = slots / block_m + tall.map_or(0, |t| tall_slots / t);
    let routes_u32 = u32_arg(OP, "number of routes", num_routes)?;
    let experts_u32 = u32_arg(OP, "number of experts", num_experts)?;
    let slots_u32 = u32_arg(OP, "aligned slots", slots)?;
    let tall_slots_u32 = u32_arg(OP, "aligned slots of the tall tiles", tall_slots)?;
    u32_arg(OP, "aligned slots of both tiles", all_slots)?;
    // Every output is written by the kernel (all slots and blocks of both segments, offsets,
    // counts, totals).
    let mut sorted = CudaStorage::alloc(backend, DType::U32, all_slots)?;
    let mut blocks = CudaStorage::alloc(backend, DType::U32, all_blocks)?;
    let mut offsets = CudaStorage::alloc(backend, DType::U32, num_experts + 1)?;
    let mut counts = CudaStorage::alloc(backend, DType::U32, num_experts)?;
    let mut total = CudaStorage::alloc(backend, DType::U32, 1)?;
    // Mixed: each expert's first tall slot (E + 1) and the tall segment's padded length.
    let mut tall_bufs = match tall {
        Some(_) => Some((
            CudaStorage::alloc(backend, DType::U32, num_experts + 1)?,
            CudaStorage::alloc(backend, DType::U32, 1)?,
        )),
        None => None,
    };
    let mut flag =
        crate::elementwise::cuda::zeros_chain("moe chain: zero fill", backend, DType::U32, 1)?;

    let (f, pdl) = crate::launch::load_chain(backend, FAMILY, SRC, ENTRY, &defines(block_m, tall))?;
    let launch = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (ALIGN_THREADS, 1, 1),
        shared_mem_bytes: if tall.is_some() {
            ((4 * num_experts + 2) * 4) as u32
        } else {
            ((3 * num_experts + 1) * 4) as u32
        },
    };
    let mut b = crate::launch::PdlLaunch::new(backend, &f, pdl);
    b.arg(ids.buffer())
        .arg(&routes_u32)
        .arg(&experts_u32)
        .arg(sorted.buffer_mut()?)
        .arg(blocks.buffer_mut()?)
        .arg(offsets.buffer_mut()?)
        .arg(counts.buffer_mut()?)
        .arg(total.buffer_mut()?)
        .arg(flag.buffer_mut()?)
        .arg(&slots_u32);
    if let Some((offs, t)) = tall_bufs.as_mut() {
        b.arg(offs.buffer_mut()?)
            .arg(t.buffer_mut()?)
            .arg(&tall_slots_u32);
    }
    // SAFETY: the arguments match `fmoe_moe_align`'s parameters in order and type (u32 pointers
    // and u32 scalars; with -D TALL_M three more: the tall offsets, the tall total and the tall
    // segment's slots);
    // `ids` holds num_routes ids; sorted holds `slots` (+ `tall_slots`) and blocks
    // `slots / BLOCK_M` (+ `tall_slots / TALL_M`) elements, which is what the kernel writes
    // (`capacity` bounds each segment's padded total, so the scatter stays inside); offsets E + 1,
    // counts E, tall offsets E + 1, totals and flag 1; shared memory is the kernel's 3E + 1 words
    // (mixed: 4E + 2; ≤ 48 KiB by MAX_EXPERTS / MAX_EXPERTS_MIXED).
    unsafe { b.launch(launch) }.map_err(|e| cuda_error("moe_align: launch", e))?;

    let cuda = |s: CudaStorage, dims: Vec<usize>| Tensor::from_storage(Storage::Cuda(s), dims);
    let tall = match (tall, tall_bufs) {
        (Some(t), Some((offs, tt))) => Some(TallRuns {
            block_m: t,
            expert_offsets: cuda(offs, vec![num_experts + 1])?,
            slot_base: slots,
            block_base: slots / block_m,
            total: cuda(tt, vec![1])?,
        }),
        _ => None,
    };
    Ok(AlignedRoutes {
        sorted_routes: cuda(sorted, vec![all_slots])?,
        block_experts: cuda(blocks, vec![all_blocks])?,
        expert_offsets: cuda(offsets, vec![num_experts + 1])?,
        expert_counts: cuda(counts, vec![num_experts])?,
        total: cuda(total, vec![1])?,
        num_routes,
        num_experts,
        block_m,
        tall,
        pending_check: Some((ids_tensor.clone(), cuda(flag, vec![1])?)),
    })
}
