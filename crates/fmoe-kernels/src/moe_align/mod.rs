//! `moe_align`: group the routes of a batch by expert and pad each expert's run to the GEMM's M tile.
//!
//! A route is one (token, slot) pair of the top-k selection, numbered `r = token * top_k + slot`.
//! [`align_routes`] returns the routes sorted by expert (stable: ascending route within an expert),
//! each expert's run padded to a multiple of `block_m` with the sentinel [`AlignedRoutes::pad`]
//! (= number of routes), and the expert of every `block_m` block, so a grouped GEMM can give each
//! block to one expert. Experts with no routes get no blocks.

mod cpu;

use fmoe_core::{DType, Storage, Tensor};

use crate::{Error, Result};

const OP: &str = "moe_align";

/// Routes sorted by expert and padded to `block_m`.
#[derive(Clone, Debug)]
pub struct AlignedRoutes {
    /// u32 [num_padded]: route indices grouped by expert; padding slots hold `pad`.
    pub sorted_routes: Tensor,
    /// u32 [num_padded / block_m]: the expert of each block.
    pub block_experts: Tensor,
    /// u32 [num_experts + 1]: start of each expert's run in `sorted_routes` (padded offsets).
    pub expert_offsets: Tensor,
    /// u32 [num_experts]: routes each expert received (before padding).
    pub expert_counts: Tensor,
    pub num_routes: usize,
    pub num_experts: usize,
    pub block_m: usize,
}

impl AlignedRoutes {
    /// The padding sentinel: one past the last route.
    pub fn pad(&self) -> u32 {
        self.num_routes as u32
    }
    /// Number of experts that received at least one route.
    pub fn experts_touched(&self) -> Result<usize> {
        let counts = self.expert_counts.cpu_slice::<u32>(OP, "expert_counts")?;
        Ok(counts.iter().filter(|&&c| c > 0).count())
    }
}

/// Sorts the routes of `topk_ids` (u32 [M, top_k]) by expert, padding each run to `block_m`.
pub fn align_routes(
    topk_ids: &Tensor,
    num_experts: usize,
    block_m: usize,
) -> Result<AlignedRoutes> {
    topk_ids.expect_rank(OP, "topk_ids", 2, "[tokens, top_k]")?;
    topk_ids.expect_dtype(OP, "topk_ids", &[DType::U32])?;
    if block_m == 0 || num_experts == 0 {
        return Err(Error::invalid(
            OP,
            format!("block_m ({block_m}) and num_experts ({num_experts}) must be positive"),
        ));
    }
    match topk_ids.storage() {
        Storage::Cuda(s) => Err(crate::error::no_cuda_kernel(OP, s)),
        Storage::Cpu(_) => cpu::align_routes(
            topk_ids.cpu_slice::<u32>(OP, "topk_ids")?,
            num_experts,
            block_m,
        ),
    }
}
