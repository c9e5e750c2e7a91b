//! CUDA twin of `moe_align`: `cuda/moe_align.cu` (one thread block, `-D BLOCK_M`).

use fmoe_core::cuda::cudarc::driver::LaunchConfig;
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{DType, Error as CoreError, Storage, Tensor};

use super::{AlignedRoutes, OP, capacity};
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

/// The kernel's `-D` set for M tiles of `block_m`.
fn defines(block_m: usize) -> Vec<(&'static str, String)> {
    vec![("BLOCK_M", format!("{block_m}u"))]
}

/// The variants for the M tiles `block_ms` (those of the grouped GEMMs: the only `block_m` the
/// MoE layer aligns to on CUDA).
pub(crate) fn variants(block_ms: &[usize]) -> Vec<KernelVariant> {
    block_ms
        .iter()
        .map(|&bm| KernelVariant {
            family: FAMILY,
            source: SRC,
            entry: ENTRY,
            defines: defines(bm),
        })
        .collect()
}

pub(super) fn align_routes(
    ids_tensor: &Tensor,
    ids: &CudaStorage,
    num_experts: usize,
    block_m: usize,
) -> Result<AlignedRoutes> {
    if num_experts > MAX_EXPERTS {
        return Err(CoreError::Unsupported {
            op: OP,
            device: ids.device(),
            reason: format!(
                "the CUDA kernel aligns at most {MAX_EXPERTS} experts (shared memory), got {num_experts}"
            ),
        }
        .into());
    }
    let backend = ids.backend();
    let num_routes = ids.len();
    let slots = capacity(num_routes, num_experts, block_m);
    let routes_u32 = u32_arg(OP, "number of routes", num_routes)?;
    let experts_u32 = u32_arg(OP, "number of experts", num_experts)?;
    let slots_u32 = u32_arg(OP, "aligned slots", slots)?;
    // Every output is written by the kernel (all `slots` slots and blocks, offsets, counts, total).
    let mut sorted = CudaStorage::alloc(backend, DType::U32, slots)?;
    let mut blocks = CudaStorage::alloc(backend, DType::U32, slots / block_m)?;
    let mut offsets = CudaStorage::alloc(backend, DType::U32, num_experts + 1)?;
    let mut counts = CudaStorage::alloc(backend, DType::U32, num_experts)?;
    let mut total = CudaStorage::alloc(backend, DType::U32, 1)?;
    let mut flag =
        crate::elementwise::cuda::zeros_chain("moe chain: zero fill", backend, DType::U32, 1)?;

    let (f, pdl) = crate::launch::load_chain(backend, FAMILY, SRC, ENTRY, &defines(block_m))?;
    let launch = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (ALIGN_THREADS, 1, 1),
        shared_mem_bytes: ((3 * num_experts + 1) * 4) as u32,
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
    // SAFETY: the arguments match `fmoe_moe_align`'s parameters in order and type (u32 pointers
    // and u32 scalars); `ids` holds num_routes ids; sorted holds `slots` and blocks
    // `slots / BLOCK_M` elements, which is what the kernel writes (`capacity` bounds the padded
    // total, so the scatter stays inside); offsets E + 1, counts E, total and flag 1; shared memory
    // is the kernel's 3E + 1 words (≤ 48 KiB by MAX_EXPERTS).
    unsafe { b.launch(launch) }.map_err(|e| cuda_error("moe_align: launch", e))?;

    let cuda = |s: CudaStorage, dims: Vec<usize>| Tensor::from_storage(Storage::Cuda(s), dims);
    Ok(AlignedRoutes {
        sorted_routes: cuda(sorted, vec![slots])?,
        block_experts: cuda(blocks, vec![slots / block_m])?,
        expert_offsets: cuda(offsets, vec![num_experts + 1])?,
        expert_counts: cuda(counts, vec![num_experts])?,
        total: cuda(total, vec![1])?,
        num_routes,
        num_experts,
        block_m,
        pending_check: Some((ids_tensor.clone(), cuda(flag, vec![1])?)),
    })
}
