//! `moe_align`: group the routes of a batch by expert and pad each expert's run to the GEMM's M tile.
//!
//! A route is one (token, slot) pair of the top-k selection, numbered `r = token * top_k + slot`.
//! [`align_routes`] returns the routes sorted by expert, each expert's run padded to a multiple of
//! `block_m` with the sentinel [`AlignedRoutes::pad`] (= number of routes), and the expert of every
//! `block_m` block, so a grouped GEMM can give each block to one expert. Experts with no routes get
//! no blocks.
//!
//! # CPU and CUDA
//! - CPU: exact sizes, computed on the host. Routes keep ascending order inside an expert. An
//!   expert id `>= num_experts` is an [`Error::ExpertId`] right away.
//! - CUDA (`cuda/moe_align.cu`, one thread block, `BLOCK_M` = `block_m`): nothing is read back,
//!   so the host never waits. The outputs are sized for the worst case,
//!   [`capacity`]`(num_routes, num_experts, block_m)` slots, and the padded length actually used
//!   is the device scalar [`AlignedRoutes::total`]: slots past it hold `pad` and their blocks the
//!   expert `num_experts`, and GEMM blocks past it exit at once. Route order inside an expert is
//!   unspecified (atomics). An expert id `>= num_experts` is dropped from the alignment (that route
//!   contributes nothing downstream) and raises a device flag; [`AlignedRoutes::check`] reads it
//!   (one synchronization, not done on the hot path) and returns the CPU twin's
//!   [`Error::ExpertId`] for the first bad route.
//!
//! # Mixed tile heights
//! [`align_routes_tiled`] with [`RouteTiling::Mixed`] (tall = 3/2 · short: 128 and 192 rows) lays
//! each expert's run out as [`mixed_blocks`] short blocks or tall blocks, whichever pads it less
//! (129 routes: one 192-row block instead of two 128-row ones; 100: one 128-row block instead of a
//! 192-row one), instead of every expert of the batch paying one height's padding. The short
//! blocks form the usual layout ([`AlignedRoutes::expert_offsets`]: each expert's first short
//! slot); the tall blocks a second segment after it ([`AlignedRoutes::tall`]), which a GEMM runs as
//! a second launch with its tall tiles. The layout takes an expert's routes as short blocks then
//! tall ones (full short blocks, the padding in the last block), but the rule never splits an
//! expert: each launch would stream its weights (H200: splitting 257–320 routes into 128 + 192
//! lost 4–5 % at DeepSeek-V3 M = 8192 and Mixtral-8x7B M = 1024–2048 despite 17 % less padding).

mod cpu;
mod cuda;

pub(crate) use cuda::variants as cuda_variants;

use fmoe_core::{DType, Device, Storage, Tensor};

use crate::{Error, Result};

const OP: &str = "moe_align";

/// The M tiles routes are padded to: one height for every expert, or per expert the short or the
/// tall one (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteTiling {
    Uniform(usize),
    Mixed { short: usize, tall: usize },
}

impl RouteTiling {
    /// The short (or only) M tile: [`AlignedRoutes::block_m`].
    pub fn block_m(&self) -> usize {
        match *self {
            RouteTiling::Uniform(bm) => bm,
            RouteTiling::Mixed { short, .. } => short,
        }
    }
}

/// The second segment of a [`RouteTiling::Mixed`] alignment: the experts' tall blocks.
#[derive(Clone, Debug)]
pub struct TallRuns {
    /// M tile of this segment.
    pub block_m: usize,
    /// u32 [num_experts + 1]: the first slot (in `sorted_routes`) of each expert's tall blocks; the
    /// last entry is the end of the segment's runs.
    pub expert_offsets: Tensor,
    /// Its first slot in [`AlignedRoutes::sorted_routes`] (the short segment's slots before it).
    pub slot_base: usize,
    /// Its first block in [`AlignedRoutes::block_experts`].
    pub block_base: usize,
    /// u32 \[1\]: the segment's padded length in use, counted from `slot_base`.
    pub total: Tensor,
}

/// Routes sorted by expert and padded to `block_m` (and, mixed, the tall runs: [`Self::tall`]).
#[derive(Clone, Debug)]
pub struct AlignedRoutes {
    /// u32 `[slots]`: route indices grouped by expert; padding slots hold `pad`. On the CPU
    /// `slots` is the padded total; on CUDA it is the worst-case [`capacity`] and the slots from
    /// [`Self::total`] on hold `pad`.
    pub sorted_routes: Tensor,
    /// u32 `[slots / block_m]`: the expert of each block (`num_experts` for blocks past `total`).
    pub block_experts: Tensor,
    /// u32 [num_experts + 1]: start of each expert's run in `sorted_routes` (padded offsets); the
    /// last entry is the end of the last run. Mixed: of the short blocks only.
    pub expert_offsets: Tensor,
    /// u32 \[num_experts\]: routes each expert received (before padding).
    pub expert_counts: Tensor,
    /// u32 \[1\]: the padded length in use (`expert_offsets[num_experts]`), on the routes' device;
    /// on the CPU equal to `sorted_routes`' length. Mixed: the short segment's padded length.
    pub total: Tensor,
    pub num_routes: usize,
    pub num_experts: usize,
    pub block_m: usize,
    /// Mixed tile heights: the segment of runs padded to the tall tile.
    pub tall: Option<TallRuns>,
    /// CUDA only: the ids aligned and the kernel's u32 [1] flag (non-zero: an id was out of
    /// range), for [`Self::check`].
    pending_check: Option<(Tensor, Tensor)>,
}

impl AlignedRoutes {
    /// The padding sentinel: one past the last route.
    pub fn pad(&self) -> u32 {
        self.num_routes as u32
    }

    /// Slots of `sorted_routes` (≥ the padded total in use), both segments when mixed.
    pub fn slots(&self) -> usize {
        self.sorted_routes.elem_count()
    }

    /// The tiling these routes were aligned with.
    pub fn tiling(&self) -> RouteTiling {
        match &self.tall {
            None => RouteTiling::Uniform(self.block_m),
            Some(t) => RouteTiling::Mixed {
                short: self.block_m,
                tall: t.block_m,
            },
        }
    }

    pub fn device(&self) -> Device {
        self.sorted_routes.device()
    }

    /// Number of experts that received at least one route. On CUDA this downloads the counts (a
    /// synchronization): for benchmarks and reports, not the hot path.
    pub fn experts_touched(&self) -> Result<usize> {
        let counts = self.expert_counts.to_device(Device::Cpu)?;
        let counts = counts.cpu_slice::<u32>(OP, "expert_counts")?;
        Ok(counts.iter().filter(|&&c| c > 0).count())
    }

    /// The padded total in use (on CUDA a download: a synchronization).
    pub fn total_host(&self) -> Result<usize> {
        let t = self.total.to_device(Device::Cpu)?;
        Ok(t.cpu_slice::<u32>(OP, "total")?
            .first()
            .copied()
            .unwrap_or(0) as usize)
    }

    /// Reports an expert id out of range as [`Error::ExpertId`] (the first such route). Free on the
    /// CPU (checked at alignment); on CUDA it reads the kernel's flag, which waits for the device:
    /// call it where a synchronization happens anyway, or in tests.
    pub fn check(&self) -> Result<()> {
        let Some((ids, flag)) = &self.pending_check else {
            return Ok(());
        };
        let flag = flag.to_device(Device::Cpu)?;
        if flag.cpu_slice::<u32>(OP, "error_flag")?.first() == Some(&0) {
            return Ok(());
        }
        let ids = ids.to_device(Device::Cpu)?;
        let ids = ids.cpu_slice::<u32>(OP, "topk_ids")?;
        match ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= self.num_experts)
        {
            Some((route, &id)) => Err(Error::ExpertId {
                op: OP,
                id,
                route,
                experts: self.num_experts,
            }),
            None => Err(Error::invalid(
                OP,
                "the CUDA kernel flagged an out-of-range expert id, but topk_ids holds none now",
            )),
        }
    }
}

/// Slots the CUDA alignment reserves for `num_routes` routes: each expert that receives routes
/// pads its run by at most `block_m - 1`, and at most `min(num_experts, num_routes)` experts
/// receive any; rounded up to a whole block.
pub fn capacity(num_routes: usize, num_experts: usize, block_m: usize) -> usize {
    let bm = block_m.max(1);
    (num_routes + num_experts.min(num_routes) * (bm - 1)).div_ceil(bm) * bm
}

/// Sorts the routes of `topk_ids` (u32 [M, top_k]) by expert, padding each run to `block_m`, on
/// `topk_ids`' device (see the module docs for what differs on CUDA).
pub fn align_routes(
    topk_ids: &Tensor,
    num_experts: usize,
    block_m: usize,
) -> Result<AlignedRoutes> {
    align_routes_tiled(topk_ids, num_experts, RouteTiling::Uniform(block_m))
}

/// [`align_routes`] with the M tiles of `tiling` (mixed: see the module docs).
pub fn align_routes_tiled(
    topk_ids: &Tensor,
    num_experts: usize,
    tiling: RouteTiling,
) -> Result<AlignedRoutes> {
    topk_ids.expect_rank(OP, "topk_ids", 2, "[tokens, top_k]")?;
    topk_ids.expect_dtype(OP, "topk_ids", &[DType::U32])?;
    let (block_m, tall) = match tiling {
        RouteTiling::Uniform(bm) => (bm, None),
        RouteTiling::Mixed { short, tall } => (short, Some(tall)),
    };
    if block_m == 0 || num_experts == 0 || tall == Some(0) {
        return Err(Error::invalid(
            OP,
            format!("the M tiles ({tiling:?}) and num_experts ({num_experts}) must be positive"),
        ));
    }
    if tall.is_some_and(|t| 2 * t != 3 * block_m) {
        return Err(Error::invalid(
            OP,
            format!("mixed M tiles ({tiling:?}) must be 2 and 3 halves of the short tile"),
        ));
    }
    match topk_ids.storage() {
        Storage::Cuda(s) => cuda::align_routes(topk_ids, s, num_experts, block_m, tall),
        Storage::Cpu(_) => cpu::align_routes(
            topk_ids.cpu_slice::<u32>(OP, "topk_ids")?,
            num_experts,
            block_m,
            tall,
        ),
    }
}

/// The (short, tall) blocks of an expert with `count` routes under mixed tiles of `short` and
/// 3/2 · `short` rows (the CUDA kernel's `mixed_blocks`): all short or all tall, whichever pads it
/// to fewer slots; on a tie tall up to two tall blocks, short past that. H200, bf16 (decision
/// D-043): 257–384 routes as two tall blocks instead of three short ones gained 3 %
/// at DeepSeek-V3 M = 8192; ~1536 routes as eight tall blocks lost 4 % at Mixtral-8x7B M = 6144
/// (compute-bound, where the short tiles run faster).
pub fn mixed_blocks(count: usize, short: usize) -> (usize, usize) {
    let tall_m = short * 3 / 2;
    let (s, t) = (count.div_ceil(short), count.div_ceil(tall_m));
    let (s_slots, t_slots) = (s * short, t * tall_m);
    if count > 0 && (t_slots < s_slots || (t_slots == s_slots && t <= 2)) {
        (0, t)
    } else {
        (s, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_blocks_take_the_cheaper_height_and_break_ties_by_block_count() {
        let cases = [
            (0, (0, 0)),
            (1, (1, 0)),
            (128, (1, 0)),
            (129, (0, 1)),
            (192, (0, 1)),
            (193, (2, 0)),
            (256, (2, 0)),
            (257, (0, 2)), // 384 slots either way: two tall blocks, not three short
            (384, (0, 2)),
            (385, (4, 0)),
            (513, (0, 3)),
            (1536, (12, 0)), // a tie past two tall blocks: short
            (1537, (13, 0)),
        ];
        for (count, want) in cases {
            assert_eq!(mixed_blocks(count, 128), want, "{count} routes");
        }
    }

    #[test]
    fn capacity_bounds_every_padding() {
        assert_eq!(capacity(0, 8, 64), 0);
        assert_eq!(capacity(1, 256, 64), 64);
        assert_eq!(capacity(8, 256, 64), 8 * 64);
        assert_eq!(capacity(2 * 4096, 8, 64), 8192 + 8 * 63 + 8);
        assert_eq!(capacity(5, 3, 1), 5);
        // Exhaustively small: the CPU's exact total never exceeds it.
        for e in 1..5usize {
            for m in 0..7usize {
                for bm in [1usize, 2, 3, 4, 6] {
                    for seed in 0..5u32 {
                        let ids: Vec<u32> = (0..m as u32)
                            .map(|i| (i * 7 + seed * 3) % e as u32)
                            .collect();
                        let a = cpu::align_routes(&ids, e, bm, None).unwrap();
                        assert!(a.slots() <= capacity(m, e, bm), "e={e} m={m} bm={bm}");
                        // Mixed: each segment within its own tile's capacity.
                        if bm % 2 == 1 {
                            continue;
                        }
                        let t = bm * 3 / 2;
                        let a = cpu::align_routes(&ids, e, bm, Some(t)).unwrap();
                        let tall = a.tall.as_ref().unwrap();
                        let tall_total = a.slots() - tall.slot_base;
                        assert!(tall.slot_base <= capacity(m, e, bm), "e={e} m={m} bm={bm}");
                        assert!(tall_total <= capacity(m, e, t), "e={e} m={m} t={t}");
                    }
                }
            }
        }
    }
}
