//! CUDA twin of `moe_gemm` for bf16 activations and bf16 weights (fp8 operands: `cuda_fp8/`,
//! which the entry points here hand them to).
//!
//! - fused ([`gemm1_silu_mul`], [`gemm2_weighted_sum`]): `cuda/moe_gemm_bf16.cu`, MODE 1 (GEMM1
//!   with SiLU⊙mul in the epilogue, h in bf16) and MODE 2 (GEMM2 with the routing weight and the
//!   top-k sum in the epilogue, f32 atomics into a zeroed y). MODE 2 of the persistent 128-row
//!   kernel (and of the fp8 warp-specialized ones) can instead store each route's weighted row as
//!   bf16 (`-D ROUTE_ROWS=1`) for `cuda/moe_finalize.cu` to sum in fixed order straight into the
//!   output dtype ([`sum_route_rows`]): by [`route_rows_pay`] (top-k ≥ 4 and y32 past L2).
//! - portable ([`portable`]): the same grouped GEMM engine without fusion. Each GEMM is MODE 2 with
//!   top_k = 1 and unit weights, which is a plain grouped GEMM into a zeroed f32 buffer
//!   (`out[r, c] = a[r] · W_e(r)[c]`: one product per element, added to 0.0, exact), and the glue
//!   runs as separate kernels (`cuda/moe_unfused.cu`): gather the token rows per route, GEMM1 into
//!   f32 `[R, 2N]`, SiLU⊙mul into bf16 `[R, N]`, GEMM2 into f32 `[R, K]`, then the weighted top-k
//!   sum. Every intermediate round-trips through device memory and each step is a launch: what
//!   the fused epilogues save, measured with the same tiles. No host synchronization on either.
//!
//! Launch geometry lives in one place: the variants [`MMA`], [`SM90_SWAPAB`], [`SM90_SMALL`],
//! [`SM90_LARGE`], [`SM90_TALL`] (kernel, tiles, stages, split-K; change them together with the `.cu` sources) and
//! the rule that picks one per batch, [`GemmConfig::select`]: on Hopper the swap-AB decode kernel
//! below [`SWAPAB_ROUTES_PER_EXPERT`](super::SWAPAB_ROUTES_PER_EXPERT) routes per expert on average (as the fp8 GEMMs; with
//! 32-route blocks from 16 to below [`SWAPAB_MID_ROUTES_PER_EXPERT`](super::SWAPAB_MID_ROUTES_PER_EXPERT)), the 64-route
//! tiles below [`LARGE_TILE_ROUTES_PER_EXPERT`], the 128 × 256 prefill tiles from there, 192 × 192
//! ones within [`TALL_TILE_ROUTES_PER_EXPERT`]; or both, one launch each, over routes aligned with
//! mixed tile heights ([`GemmConfig::tiling`]). Per launch ([`launch_cfg`]), uniform 192-row tiles
//! may narrow to [`SM90_TALL_NARROW`] to fill the last wave ([`wave_fit`]) and let warpgroups of
//! padding skip ([`GemmConfig::skip_pad_wg`]), and the persistent kernels walk one M block at a time
//! where every expert fits one block ([`one_block_raster`]). Contract (checked, with the dimension
//! named): the reduction length (K for GEMM1, N for GEMM2) is a multiple of [`K_MULTIPLE`], because
//! the kernel loads 16-byte chunks of bf16; routes come from `moe_align` with the chosen variant's
//! `block_m`.

use std::sync::Arc;

use fmoe_core::cuda::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaBackend, CudaStorage, cuda_error};
use fmoe_core::env::Sm90Mid;
use fmoe_core::{DType, Device, Error as CoreError, Storage, Tensor};

use super::cuda_fp8::{swapab_route_block, swapab_stages, swapab_stages_for};
use super::tma::{TmaElem, weight_tensor_map};
use super::{ActOperand, ActQuant, WeightOperand, cuda_fp8};
use crate::catalog::KernelVariant;
use crate::dev::dev;
use crate::launch::{MAX_GRID_STRIDE_BLOCKS, cuda_storage, opt_in_smem, u32_arg};
use crate::moe_align::{AlignedRoutes, RouteTiling, align_routes};
use crate::nvrtc;
use crate::{Error, Result};

/// Which grouped GEMM kernel runs, and its compile-time tunables: the one place that decides the
/// launch geometry (tile sizes, threads, shared memory, split-K), mirroring the bring-up harness
/// `bench/gpu/moe_bf16_cupy.py`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmConfig {
    pub kind: GemmKind,
    /// M tile (routes per block) = `moe_align`'s `block_m`. `Mma`: 64 (fixed in its source);
    /// `Sm90`: 64 or 128 (`-D BM`).
    pub bm: usize,
    /// Reduction tile. `Mma`: 32 or 64 (`-D BK`); `Sm90`: 64 (fixed in its source).
    pub bk: usize,
    /// cp.async ring depth (`-D STAGES`).
    pub stages: usize,
    /// `Sm90` only: wgmma N (`-D WG_N`, 128 or 256) = weight rows per block.
    pub wg_n: usize,
    /// Split GEMM2's reduction over `gridDim.z` when the grid is too small to fill the GPU.
    pub split_k: bool,
    /// `Sm90`/`Sm90Pipe`: blocks take their tiles in groups of this many M blocks, M fastest
    /// (`-D RASTER_GM`; 0 = launch order, N fastest).
    pub raster_gm: usize,
    /// `Sm90Pipe` with 192-row tiles: a warpgroup whose 64 rows of a tile are all padding hands
    /// the tile's stages back without multiplying them (`-D SKIP_PAD_WG=1`; set per launch).
    pub skip_pad_wg: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKind {
    /// `cuda/moe_gemm_bf16.cu`: mma.sync m16n8k16 (sm_80+), 64 × 128 weight-row tiles, 4 warps.
    Mma,
    /// `cuda/moe_gemm_bf16_sm90.cu`: wgmma (sm_90a only), BM × WG_N tiles, BM/64 warpgroups.
    Sm90,
    /// `cuda/moe_gemm_bf16_sm90_pipe.cu`: wgmma, warp-specialized (one loader warpgroup, two MMA
    /// warpgroups, an mbarrier ring), the weight tile through TMA (a tensor map over the weights
    /// as one more argument), the loader keeping every stage in flight (cp.async completion
    /// tracked by the mbarrier), GEMM2 with vector reductions, BM 128 or 64;
    /// `persistent`: one block per SM walks the tiles, the next tile's loads overlapping this
    /// tile's epilogue; `dynamic` (persistent only): blocks claim tiles from a global counter
    /// instead of a fixed stride. Takes the tile space (n_tiles, m_blocks, splits) and the
    /// counter (zeroed u32, null unless `dynamic`) as four more arguments.
    Sm90Pipe { persistent: bool, dynamic: bool },
    /// `cuda/moe_gemm_swapab_sm90.cu` with `ELEM_BF16=1` (the fp8 swap-AB source): the weights
    /// are the wgmma M operand (a 256-row tile as four 64-row slabs, through TMA: one more
    /// argument, the tensor map) and the `bm` = 16 routes of one expert's block its N
    /// (m64n16k16); one loader warp, two MMA warpgroups, an mbarrier ring. Route blocks in
    /// `gridDim.x`, N tiles in `y`, K splits in `z`.
    SwapAb,
}

/// mma.sync kernel: any sm_80+ device.
pub const MMA: GemmConfig = GemmConfig {
    kind: GemmKind::Mma,
    bm: 64,
    bk: 64,
    stages: 4,
    wg_n: 128,
    split_k: true,
    raster_gm: 0,
    skip_pad_wg: false,
};

/// Swap-AB decode kernel, below [`SWAPAB_ROUTES_PER_EXPERT`](super::SWAPAB_ROUTES_PER_EXPERT) routes per expert on average: 256
/// weight rows × 16 routes per block, a 3-deep ring of 32 KiB weight stages (the fp8 kernels'
/// bytes: 64 bf16 of K per stage instead of 128 e4m3), 103 KiB of shared memory, two blocks per
/// SM. Only the route blocks that can be busy are launched; GEMM2's split-K evens the waves
/// (`swap_ab_splits`). Dev-only [`DEV_SWAPAB_ENV`](super::DEV_SWAPAB_ENV)`=off` gives
/// [`SM90_SMALL`] back there, a number sets the ring depth.
pub const SM90_SWAPAB: GemmConfig = GemmConfig {
    kind: GemmKind::SwapAb,
    bm: 16,
    bk: 64,
    stages: 3,
    wg_n: 256,
    split_k: true,
    raster_gm: 0,
    skip_pad_wg: false,
};

/// [`SM90_SWAPAB`] with route blocks of `bn` (wgmma N, `-D BN`) and a ring of `stages`.
pub const fn sm90_swapab(bn: usize, stages: usize) -> GemmConfig {
    GemmConfig {
        bm: bn,
        stages,
        ..SM90_SWAPAB
    }
}

/// wgmma kernel, decode-sized batches: 64-row tiles and 128 weight rows keep two blocks per SM
/// and enough blocks to stream the weights from every SM. Launch order: the grouped order of
/// [`SM90_LARGE`] removed the re-reads of an expert's second M block (H200, Mixtral-8x7B M = 256:
/// GEMM1 DRAM reads 2.78 → 1.90 GB) but not the time (L2-bound 64 × 128 tiles), and cost 1-5 %
/// below; from 64 routes per expert the large tiles run instead.
pub const SM90_SMALL: GemmConfig = GemmConfig {
    kind: GemmKind::Sm90,
    bm: 64,
    bk: 64,
    stages: 4,
    wg_n: 128,
    split_k: true,
    raster_gm: 0,
    skip_pad_wg: false,
};

/// wgmma kernel, prefill-sized batches: 128 × 256 tiles halve the weight re-reads per route. The
/// pipe kernel (loader with every stage in flight, GEMM2 with vector reductions), persistent,
/// tiles claimed from a counter in grouped order (H200, decision D-014: 1.19–1.27× faster than
/// the warp-specialized kernel before it (`moe_gemm_bf16_sm90_ws.cu`, removed; its loader kept
/// two stages in flight) at M = 1024–16384 on Mixtral-8x7B/8x22B and DeepSeek-V3 at 16384; the
/// non-persistent "pipe" and the fixed-stride "persist" are within the run-to-run noise of it).
pub const SM90_LARGE: GemmConfig = GemmConfig {
    kind: GemmKind::Sm90Pipe {
        persistent: true,
        dynamic: true,
    },
    bm: 128,
    bk: 64,
    stages: 4,
    wg_n: 256,
    split_k: true,
    raster_gm: 16,
    skip_pad_wg: false,
};

/// [`SM90_LARGE`] with 192 × 192 tiles: three MMA warpgroups of 64 rows (512 threads, so 128
/// registers each: 64 × 192 accumulator slabs; 64 × 256 would need 154), 4 stages of 48 KiB. An
/// expert with 129–192 routes takes one M block instead of two 128-row ones (one pass over its
/// weights instead of two: DeepSeek-V3 at M = 4096 read 1.45× its GEMM1 weight bytes from DRAM
/// with 128-row tiles), and a tile pulls 1.13× fewer L2 bytes per FLOP than 128 × 256; the
/// tensor pipe is as busy as with 128 × 256 where both are compute-bound.
pub const SM90_TALL: GemmConfig = GemmConfig {
    bm: 192,
    wg_n: 192,
    ..SM90_LARGE
};

/// [`SM90_TALL`] with 176 weight rows per tile (m64n176): the same work in more, narrower tiles, for
/// a launch whose 192-row tiles would leave the last wave of SMs mostly idle ([`wave_fit`]).
pub const SM90_TALL_NARROW: GemmConfig = GemmConfig {
    wg_n: 176,
    ..SM90_TALL
};

/// Dev-only: `FMOE_DEV_TALL_N=<192|176>` runs every uniform [`SM90_TALL`] launch with that many
/// weight rows per tile instead of [`wave_fit`]'s choice (read once per process; not a user setting).
/// The tile a uniform 192-row launch runs: [`SM90_TALL`] or [`SM90_TALL_NARROW`], whichever
/// finishes its tiles in fewer tile-widths of time over `sms` SMs (equal tiles, one per SM at a
/// time, so the time is the rounds of tiles times the tile's width; GEMM2's split divides the
/// reduction), the wide one unless the narrow one saves at least 3 %. `busy_blocks` is the M
/// blocks the routes are expected to fill. Mixtral-8x7B at M = 512 (8 experts of ~128 routes, one
/// 192-row block each): GEMM1's 8 x 150 tiles of 96 output columns take 10 rounds on 132 SMs, the
/// last one 12 tiles; 8 x 163 tiles of 88 columns take 10 rounds of 0.92 the width.
fn wave_fit(
    mode: u32,
    n_out: usize,
    kd: usize,
    busy_blocks: usize,
    splits_of: impl Fn(&GemmConfig, usize) -> usize,
    sms: usize,
) -> GemmConfig {
    match dev().tall_n {
        Some(176) => return SM90_TALL_NARROW,
        Some(192) => return SM90_TALL,
        _ => {}
    }
    let cost = |c: &GemmConfig| {
        let n_tiles = n_out.div_ceil(c.n_tile(mode));
        let splits = splits_of(c, n_tiles).max(1);
        let tiles = n_tiles * busy_blocks.max(1) * splits;
        // Rounds x (weight rows x K steps per tile), in units of 8 rows x one K step.
        tiles.div_ceil(sms.max(1)) * (c.wg_n / 8) * kd.div_ceil(c.bk * splits)
    };
    let (wide, narrow) = (cost(&SM90_TALL), cost(&SM90_TALL_NARROW));
    if narrow * 100 <= wide * 97 {
        SM90_TALL_NARROW
    } else {
        SM90_TALL
    }
}

/// The first [`SM90_LARGE`]: `moe_gemm_bf16_sm90.cu` with 128 × 256 tiles (two warpgroups that
/// both load and multiply, a block barrier per K tile), launch order. Kept as the baseline
/// experiment "sync".
pub const SM90_SYNC: GemmConfig = GemmConfig {
    kind: GemmKind::Sm90,
    bm: 128,
    bk: 64,
    stages: 4,
    wg_n: 256,
    split_k: true,
    raster_gm: 0,
    skip_pad_wg: false,
};

/// Dev-only: `FMOE_DEV_SM90_LARGE=<name>` swaps the kernel that runs routes aligned for
/// [`SM90_LARGE`] for one of these experiments (read once per process; not a user setting), so
/// one binary can test and time them all.
/// The experiments of `FMOE_DEV_SM90_LARGE`, by name ("default" is [`SM90_LARGE`], the
/// persistent pipe kernel with the dynamic schedule, measured as "dyn").
pub const SM90_LARGE_EXPERIMENTS: [(&str, GemmConfig); 6] = [
    ("default", SM90_LARGE),
    ("sync", SM90_SYNC),
    // SM90_SYNC in grouped tile order: resident blocks share weight tiles.
    (
        "raster",
        GemmConfig {
            raster_gm: 16,
            ..SM90_SYNC
        },
    ),
    // One tile per block (no persistent grid).
    (
        "pipe",
        GemmConfig {
            kind: GemmKind::Sm90Pipe {
                persistent: false,
                dynamic: false,
            },
            ..SM90_LARGE
        },
    ),
    // Persistent with a fixed stride instead of the tile counter.
    (
        "persist",
        GemmConfig {
            kind: GemmKind::Sm90Pipe {
                persistent: true,
                dynamic: false,
            },
            ..SM90_LARGE
        },
    ),
    // The default in groups of 8 M blocks.
    (
        "dyn_gm8",
        GemmConfig {
            raster_gm: 8,
            ..SM90_LARGE
        },
    ),
];

/// [`SM90_LARGE`], or the experiment `FMOE_DEV_SM90_LARGE` names (validated at parse time
/// against the same names, [`fmoe_core::env::SM90_LARGE_EXPERIMENTS`]).
fn sm90_large() -> GemmConfig {
    let Some(name) = dev().sm90_large else {
        return SM90_LARGE;
    };
    SM90_LARGE_EXPERIMENTS
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(SM90_LARGE, |(_, cfg)| *cfg)
}

/// The pipe kernel with 64-row M tiles, for batches just past [`LARGE_TILE_ROUTES_PER_EXPERT`]:
/// with ~128 routes per expert, 128-row tiles leave about half the experts a second, mostly
/// empty tile (DeepSeek-V3 at M = 4096: 1.5× the routes' FLOPs), 64-row tiles about 1.25×. Off
/// unless `FMOE_DEV_SM90_MID` turns it on: on the H200 the 64 × 256 tile loses about what the
/// padding saves (DeepSeek-V3 M = 4096: 8.47–9.3 ms vs 8.43–8.54 with 128-row tiles; Mixtral-8x7B
/// at M = 1024, 256 routes per expert: 1.68 vs 1.35 ms).
pub const SM90_MID: GemmConfig = GemmConfig {
    kind: GemmKind::Sm90Pipe {
        persistent: true,
        dynamic: true,
    },
    bm: 64,
    bk: 64,
    stages: 5,
    wg_n: 256,
    split_k: true,
    raster_gm: 16,
    skip_pad_wg: false,
};

/// [`SM90_MID`], with the schedule of the `FMOE_DEV_SM90_LARGE` experiment when that is a pipe
/// kernel too (so one experiment name compares both tile heights).
fn sm90_mid() -> GemmConfig {
    match sm90_large().kind {
        kind @ GemmKind::Sm90Pipe { .. } => GemmConfig { kind, ..SM90_MID },
        _ => SM90_MID,
    }
}

/// Average routes per expert below which [`SM90_MID`] replaces [`SM90_LARGE`] (from
/// [`LARGE_TILE_ROUTES_PER_EXPERT`] on) when `FMOE_DEV_SM90_MID` is `on`.
pub const MID_TILE_MAX_ROUTES_PER_EXPERT: usize = 256;

/// Dev-only: `FMOE_DEV_SM90_MID=<off|on|wide>` sets the upper end of [`SM90_MID`]'s range (never,
/// the default; [`MID_TILE_MAX_ROUTES_PER_EXPERT`]; 512 routes per expert), read once per process.
fn mid_max_routes_per_expert() -> usize {
    match dev().sm90_mid {
        Sm90Mid::Off => 0,
        Sm90Mid::On => MID_TILE_MAX_ROUTES_PER_EXPERT,
        Sm90Mid::Wide => 512,
    }
}

/// Average routes per expert from which [`SM90_LARGE`] wins (H200, decision D-009):
/// at 64 the 64-row tiles are full on average, some experts already need two of them, and the
/// small tiles' L2 traffic (a 64 × 128 tile per 64-wide K step) caps them below the DRAM rate
/// (Mixtral-8x7B M = 256: 0.977 → 0.774 ms bf16, 0.574 → 0.476 ms fp8 per-tensor). Swept again for
/// all three methods (decision D-009, measured beside D-028): 192 or
/// 384 lose 1.23–2.15× wherever they move a batch to the 64-row tiles (DeepSeek-V3 at 128 routes per
/// expert too, despite the 128-row tiles' 1.5× padding there); 32 wins and loses alike.
pub const LARGE_TILE_ROUTES_PER_EXPERT: usize = 64;

/// Average routes per expert where [`SM90_TALL`] replaces [`SM90_LARGE`] when tiles are uniform
/// (few experts; [`GemmConfig::tiling`] aligns many experts with mixed tiles): there most experts fit
/// one 192-row block, where 128-row tiles give many of them a second, mostly empty block that
/// streams the expert's weights again. H200 (decision D-040): 1.13-1.20x at 128 and
/// 160 routes per expert on DeepSeek-V3, 1.16x at 160 and a tie at 128 on Mixtral-8x7B; 0.87-0.94x
/// at 96 (one 128-row block already holds an expert), 192 and 256 (experts past 192 routes need
/// two 192-row blocks), 0.98-1.0x where compute-bound (4096 per expert).
pub const TALL_TILE_ROUTES_PER_EXPERT: std::ops::Range<usize> = 128..176;

/// Dev-only: `FMOE_DEV_TALL_ROUTES=<lo>-<hi>` runs [`SM90_TALL`] from `lo` to below `hi` routes per
/// expert on average instead of [`TALL_TILE_ROUTES_PER_EXPERT`] (`0`: never); read once per process.
/// [`TALL_TILE_ROUTES_PER_EXPERT`], or the `FMOE_DEV_TALL_ROUTES` override.
fn tall_tile_routes_per_expert() -> std::ops::Range<usize> {
    dev()
        .tall_routes
        .clone()
        .unwrap_or(TALL_TILE_ROUTES_PER_EXPERT)
}

/// Average routes per expert from which bf16 routes are aligned with mixed tile heights: each
/// expert's run in [`SM90_LARGE`]'s 128-row or [`SM90_TALL`]'s 192-row blocks, whichever pads it
/// less ([`crate::moe_align::RouteTiling::Mixed`]), and each GEMM runs both kernels, one launch per
/// segment. H200, bf16 (decision D-043), against one height: DeepSeek-V3 M =
/// 4096-16384 1.03-1.08x, Mixtral-8x7B M = 2048 1.08x and 768 1.03x; with 8 experts the two
/// launches' tails cost 1-3 % where little padding goes (Mixtral-8x7B M = 384-640), so
/// below this only batches over `MIXED_TILE_MANY_EXPERTS` (64) experts take mixed tiles from
/// `MIXED_TILE_MANY_EXPERTS_ROUTES_PER_EXPERT` (128).
pub const MIXED_TILE_ROUTES_PER_EXPERT: usize = 176;

/// Experts from which mixed tiles start at [`MIXED_TILE_MANY_EXPERTS_ROUTES_PER_EXPERT`].
pub const MIXED_TILE_MANY_EXPERTS: usize = 64;

/// Average routes per expert from which batches over [`MIXED_TILE_MANY_EXPERTS`] take mixed tiles
/// (DeepSeek-V3 M = 4096, 128 per expert: 1.05x; M = 3072, 96 per expert: 0.99-1.0x).
pub const MIXED_TILE_MANY_EXPERTS_ROUTES_PER_EXPERT: usize = 128;

/// Dev-only: `FMOE_DEV_MIXED_ROUTES=<lo>-<hi>` aligns with mixed tiles from `lo` to below `hi`
/// routes per expert on average, whatever the experts, instead of the rule above (`0`: never).
/// Whether `num_routes` routes over `experts` experts take mixed tiles: the rule above, or the
/// `FMOE_DEV_MIXED_ROUTES` override.
fn mixed_tiles_pay(num_routes: usize, experts: usize) -> bool {
    let per_expert = num_routes / experts.max(1);
    if let Some(knob) = &dev().mixed_routes {
        return knob.contains(&per_expert);
    }
    let from = if experts >= MIXED_TILE_MANY_EXPERTS {
        MIXED_TILE_MANY_EXPERTS_ROUTES_PER_EXPERT
    } else {
        MIXED_TILE_ROUTES_PER_EXPERT
    };
    per_expert >= from
}

/// Dev-only knobs for sweeps on the device (read once per process; not user settings):
/// `FMOE_DEV_LARGE_ROUTES=<n>` replaces [`LARGE_TILE_ROUTES_PER_EXPERT`] in both select rules;
/// `FMOE_DEV_SWAPAB_ROUTES=<n>` sets the upper end of the swap-AB range in both select rules;
/// `FMOE_DEV_SWAPAB_WIDE_ROUTES=<n>` the upper end of the 64-route range, every scheme (at or
/// below the swap-AB range's end: none);
/// `FMOE_DEV_SPLITS=<n>` forces GEMM2's split-K factor (swap-AB's too).
pub const DEV_SWAPAB_WIDE_ROUTES_ENV: &str = fmoe_core::env::FMOE_DEV_SWAPAB_WIDE_ROUTES;

/// [`LARGE_TILE_ROUTES_PER_EXPERT`], or the `FMOE_DEV_LARGE_ROUTES` override.
pub(super) fn large_tile_routes_per_expert() -> usize {
    dev().large_routes.unwrap_or(LARGE_TILE_ROUTES_PER_EXPERT)
}

/// The `FMOE_DEV_SWAPAB_ROUTES` override of the swap-AB range's upper end
/// ([`SWAPAB_MID_ROUTES_PER_EXPERT`](super::cuda_fp8::SWAPAB_MID_ROUTES_PER_EXPERT)).
pub(super) fn swapab_routes_per_expert() -> Option<usize> {
    dev().swapab_routes
}

/// The [`DEV_SWAPAB_WIDE_ROUTES_ENV`] override of the 64-route range's upper end
/// ([`SWAPAB_WIDE_ROUTES_PER_EXPERT`](super::cuda_fp8::SWAPAB_WIDE_ROUTES_PER_EXPERT),
/// [`SWAPAB_BLOCK_WIDE_ROUTES_PER_EXPERT`](super::cuda_fp8::SWAPAB_BLOCK_WIDE_ROUTES_PER_EXPERT)).
pub(super) fn swapab_wide_routes_per_expert() -> Option<usize> {
    dev().swapab_wide_routes
}

impl GemmConfig {
    /// The variant for a batch of `num_routes` routes over `experts` experts on a device of
    /// compute capability `cc`. No tuning files: the choice is this rule.
    pub fn select(cc: (u32, u32), num_routes: usize, experts: usize) -> GemmConfig {
        Self::select_with_mid(cc, num_routes, experts, mid_max_routes_per_expert())
    }

    /// [`Self::select`] with [`SM90_MID`] below `mid_max` routes per expert (0: never).
    fn select_with_mid(
        cc: (u32, u32),
        num_routes: usize,
        experts: usize,
        mid_max: usize,
    ) -> GemmConfig {
        if cc != (9, 0) {
            return MMA;
        }
        let experts = experts.max(1);
        if let Some(bn) = swapab_route_block(num_routes, experts) {
            sm90_swapab(bn, swapab_stages_for(bn))
        } else if num_routes < large_tile_routes_per_expert() * experts {
            SM90_SMALL
        } else if num_routes < mid_max * experts {
            SM90_MID
        } else if tall_tile_routes_per_expert().contains(&(num_routes / experts)) {
            SM90_TALL
        } else {
            SM90_LARGE
        }
    }

    /// The M tiles to align a batch of `num_routes` routes over `experts` experts to on a device
    /// of capability `cc`: mixed 128 / 192-row tiles on Hopper from [`MIXED_TILE_ROUTES_PER_EXPERT`]
    /// (or `MIXED_TILE_MANY_EXPERTS_ROUTES_PER_EXPERT` over many experts), else
    /// [`Self::select`]'s M tile.
    pub fn tiling(cc: (u32, u32), num_routes: usize, experts: usize) -> RouteTiling {
        if cc == (9, 0) && mixed_tiles_pay(num_routes, experts) {
            RouteTiling::Mixed {
                short: SM90_LARGE.bm,
                tall: SM90_TALL.bm,
            }
        } else {
            RouteTiling::Uniform(Self::select(cc, num_routes, experts).bm)
        }
    }

    /// The variant that runs routes aligned to `block_m` for a batch of `num_routes` routes over
    /// `experts` experts: [`Self::select`]'s when its M tile matches (so [`SM90_MID`] and
    /// [`SM90_SMALL`], both 64 rows, are told apart), else [`Self::for_block_m`]'s.
    pub fn for_routes(
        cc: (u32, u32),
        block_m: usize,
        num_routes: usize,
        experts: usize,
    ) -> Option<GemmConfig> {
        let picked = Self::select(cc, num_routes, experts);
        if picked.bm != block_m {
            return Self::for_block_m(cc, block_m);
        }
        Some(match picked {
            SM90_LARGE => sm90_large(),
            SM90_MID => sm90_mid(),
            _ => picked,
        })
    }

    /// The variant that consumes routes aligned to `block_m` on a device of capability `cc` (16
    /// and 32: [`SM90_SWAPAB`]'s route blocks, with the ring depth of
    /// [`DEV_SWAPAB_ENV`](super::DEV_SWAPAB_ENV) if set).
    pub fn for_block_m(cc: (u32, u32), block_m: usize) -> Option<GemmConfig> {
        let swapab = |bn| sm90_swapab(bn, swapab_stages_for(bn));
        [
            swapab(16),
            swapab(32),
            SM90_SMALL,
            SM90_LARGE,
            SM90_TALL,
            MMA,
        ]
        .into_iter()
        .find(|c| c.bm == block_m && (c.kind != GemmKind::Mma) == (cc == (9, 0)))
        .map(|c| if c == SM90_LARGE { sm90_large() } else { c })
    }
}

impl GemmConfig {
    /// Weight rows one block reads per tile.
    pub const fn b_rows(&self) -> usize {
        match self.kind {
            GemmKind::Mma => 128,
            GemmKind::Sm90 | GemmKind::Sm90Pipe { .. } | GemmKind::SwapAb => self.wg_n,
        }
    }
    /// Output columns per block: GEMM1 (MODE 1) pairs half its weight rows (gate) with the other
    /// half (up); GEMM2 (MODE 2) writes one column per weight row.
    pub const fn n_tile(&self, mode: u32) -> usize {
        if mode == 1 {
            self.b_rows() / 2
        } else {
            self.b_rows()
        }
    }
    pub const fn threads(&self) -> u32 {
        match self.kind {
            GemmKind::Mma => 128,
            GemmKind::Sm90 => (self.bm / 64 * 128) as u32,
            // A loader warpgroup and two MMA warpgroups (three for 192-row tiles).
            GemmKind::Sm90Pipe { .. } => {
                if self.bm == 192 {
                    512
                } else {
                    384
                }
            }
            // Two MMA warpgroups and one loader warp (a loader warpgroup from BN = 64 on).
            GemmKind::SwapAb => super::cuda_fp8::swapab_threads(self.bm),
        }
    }
    /// Whether the launch runs in 2-block clusters (`-D CLUSTER=2`, the pipe kernel's header): the
    /// persistent claimed 128-row tiles, not one M block at a time (where no pair would share).
    pub(super) fn pairs(&self) -> bool {
        matches!(
            self.kind,
            GemmKind::Sm90Pipe {
                persistent: true,
                dynamic: true
            }
        ) && self.bm == 128
            && self.raster_gm > 1
            && dev_bf16_pair()
    }

    /// Dynamic shared memory per block (the sources' formulas).
    pub const fn smem_bytes(&self) -> u32 {
        (match self.kind {
            GemmKind::Mma => self.stages * (64 + 128) * (self.bk + 8) * 2,
            GemmKind::Sm90 | GemmKind::Sm90Pipe { .. } => {
                self.stages * (self.bm + self.wg_n) * 64 * 2 + 1024
            }
            // 128 bytes of K per weight row and route per stage.
            GemmKind::SwapAb => self.stages * (self.wg_n + self.bm) * 128 + 1024,
        }) as u32
    }
    fn source(&self) -> (&'static str, &'static str) {
        match self.kind {
            GemmKind::Mma => (GEMM_FAMILY, GEMM_SRC),
            GemmKind::Sm90 => (GEMM_SM90_FAMILY, GEMM_SM90_SRC),
            GemmKind::Sm90Pipe { .. } => (GEMM_SM90_PIPE_FAMILY, GEMM_SM90_PIPE_SRC),
            GemmKind::SwapAb => (GEMM_SWAPAB_FAMILY, SWAPAB_SRC),
        }
    }
    fn defines(&self, mode: u32) -> Vec<(&'static str, String)> {
        let mut d = vec![("MODE", mode.to_string())];
        match self.kind {
            GemmKind::Mma => {
                d.push(("BK", self.bk.to_string()));
                d.push(("STAGES", self.stages.to_string()));
            }
            GemmKind::Sm90 => {
                d.push(("WG_N", self.wg_n.to_string()));
                d.push(("STAGES", self.stages.to_string()));
                d.push(("BM", self.bm.to_string()));
                if self.raster_gm > 0 {
                    d.push(("RASTER_GM", self.raster_gm.to_string()));
                }
            }
            GemmKind::Sm90Pipe {
                persistent,
                dynamic,
            } => {
                d.push(("STAGES", self.stages.to_string()));
                d.push(("RASTER_GM", self.raster_gm.to_string()));
                d.push(("BM", self.bm.to_string()));
                d.push(("PERSIST", u32::from(persistent).to_string()));
                d.push(("DYNAMIC", u32::from(dynamic).to_string()));
                if self.wg_n != 256 {
                    d.push(("WG_N", self.wg_n.to_string()));
                }
                if self.skip_pad_wg {
                    d.push(("SKIP_PAD_WG", "1".to_string()));
                }
                if self.pairs() {
                    d.push(("CLUSTER", "2".to_string()));
                }
            }
            GemmKind::SwapAb => {
                d.push(("ELEM_BF16", "1".to_string()));
                d.push(("STAGES", self.stages.to_string()));
                d.push(("BN", self.bm.to_string()));
                d.extend(super::cuda_fp8::swapab_persist_defines(self.bm, mode));
            }
        }
        d
    }
    /// GEMM2's split-K factor (the harness's `splits_for`): enough splits for about four blocks per
    /// SM, at most one per 8 reduction tiles. `blocks` counts the M tiles that can be busy.
    pub fn splits(
        &self,
        num_routes: usize,
        experts: usize,
        slots: usize,
        n_tiles: usize,
        kd: usize,
        sms: usize,
    ) -> usize {
        if !self.split_k {
            return 1;
        }
        // At most one split per 8 reduction tiles.
        let max_splits = ((kd / self.bk) / 8).max(1);
        split_k(
            num_routes, experts, slots, self.bm, n_tiles, max_splits, sms,
        )
    }
}

/// The M tile every device's grouped GEMMs accept ([`MMA`] and [`SM90_SMALL`] both use it): the
/// `block_m` of the portable path, and of callers that align routes without choosing a variant.
pub const BM: usize = MMA.bm;
/// The reduction length must be a multiple of this (16-byte loads of bf16).
pub const K_MULTIPLE: usize = 8;
/// Threads per block of the portable path's glue kernels.
const GLUE_THREADS: u32 = 256;

const GEMM_FAMILY: &str = "moe_gemm_bf16";
const GEMM_SRC: &str = include_str!("../../cuda/moe_gemm_bf16.cu");
const GEMM_SM90_FAMILY: &str = "moe_gemm_bf16_sm90";
const GEMM_SM90_SRC: &str = include_str!("../../cuda/moe_gemm_bf16_sm90.cu");
const GEMM_SM90_PIPE_FAMILY: &str = "moe_gemm_bf16_sm90_pipe";
const GEMM_SM90_PIPE_SRC: &str = include_str!("../../cuda/moe_gemm_bf16_sm90_pipe.cu");
const GEMM_SWAPAB_FAMILY: &str = "moe_gemm_bf16_swapab_sm90";
/// The swap-AB source of both element types (the fp8 variants compile it as their own family).
pub(super) const SWAPAB_SRC: &str = include_str!("../../cuda/moe_gemm_swapab_sm90.cu");
const GEMM_ENTRY: &str = "fmoe_moe_gemm_bf16";
const FINALIZE_FAMILY: &str = "moe_finalize";
const FINALIZE_SRC: &str = include_str!("../../cuda/moe_finalize.cu");
const FINALIZE_ENTRY: &str = "fmoe_moe_finalize";
pub(super) const GLUE_FAMILY: &str = "moe_unfused";
pub(super) const GLUE_SRC: &str = include_str!("../../cuda/moe_unfused.cu");

/// The entry points of `GLUE_SRC` (the portable paths' glue kernels, bf16 and fp8).
pub(super) const GLUE_ENTRIES: [&str; 5] = [
    "fmoe_gather_rows",
    "fmoe_silu_mul",
    "fmoe_topk_reduce",
    "fmoe_gather_words",
    "fmoe_silu_mul_f32",
];

/// Every bf16 GEMM variant ([`MMA`], [`SM90_SWAPAB`], [`SM90_SMALL`], [`SM90_MID`], [`SM90_LARGE`]
/// and its experiments, both modes) and the glue.
pub(super) fn variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    let experiments = SM90_LARGE_EXPERIMENTS.iter().map(|(_, c)| *c);
    // SM90_MID takes the schedule of a pipe experiment (`sm90_mid`).
    let mids = SM90_LARGE_EXPERIMENTS
        .iter()
        .filter_map(|(_, c)| match c.kind {
            kind @ GemmKind::Sm90Pipe { .. } => Some(GemmConfig { kind, ..SM90_MID }),
            _ => None,
        });
    let mut seen: Vec<GemmConfig> = Vec::new();
    let swapabs = super::cuda_fp8::SWAPAB_ROUTE_BLOCKS.map(|bn| sm90_swapab(bn, swapab_stages(bn)));
    let one_block = [SM90_LARGE, SM90_TALL].map(|c| GemmConfig { raster_gm: 1, ..c });
    // Uniform 192-row launches: their padding warpgroups skip (launch_cfg).
    let skipping = [SM90_TALL, SM90_TALL_NARROW].map(|c| GemmConfig {
        skip_pad_wg: true,
        ..c
    });
    for cfg in [MMA, SM90_SMALL, SM90_MID, SM90_TALL, SM90_TALL_NARROW]
        .into_iter()
        .chain(one_block)
        .chain(skipping)
        .chain(swapabs)
        .chain(experiments)
        .chain(mids)
    {
        // "default" is also one of the named experiments.
        if seen.contains(&cfg) {
            continue;
        }
        seen.push(cfg);
        let (family, source) = cfg.source();
        for mode in [1, 2] {
            v.push(KernelVariant {
                family,
                source,
                entry: GEMM_ENTRY,
                defines: cfg.defines(mode),
            });
        }
    }
    // GEMM2 with per-route rows (the pipe kernels of SM90_LARGE and SM90_TALL) and their top-k sum.
    for cfg in [SM90_LARGE, SM90_TALL, SM90_TALL_NARROW]
        .into_iter()
        .chain(one_block)
    {
        let (family, source) = cfg.source();
        let mut defines = cfg.defines(2);
        defines.push(route_rows_define());
        v.push(KernelVariant {
            family,
            source,
            entry: GEMM_ENTRY,
            defines,
        });
    }
    // The pipe kernels' even-width builds (every real model's; launch_gemm adds the define after
    // ROUTE_ROWS).
    let even: Vec<KernelVariant> = v
        .iter()
        .filter(|k| k.family == GEMM_SM90_PIPE_FAMILY)
        .map(|k| {
            let mut k = k.clone();
            k.defines.push(n_out_even_define());
            k
        })
        .collect();
    v.extend(even);
    for out_f32 in ["0", "1"] {
        v.push(KernelVariant {
            family: FINALIZE_FAMILY,
            source: FINALIZE_SRC,
            entry: FINALIZE_ENTRY,
            defines: vec![("OUT_F32", out_f32.to_string())],
        });
    }
    v.extend(GLUE_ENTRIES.map(|entry| KernelVariant {
        family: GLUE_FAMILY,
        source: GLUE_SRC,
        entry,
        defines: Vec::new(),
    }));
    v
}

fn unsupported(op: &'static str, device: Device, reason: String) -> Error {
    CoreError::Unsupported { op, device, reason }.into()
}

/// Why fp8 operands cannot meet bf16 ones in one CUDA GEMM.
const FP8_MIXED: &str = "no CUDA kernel for fp8 mixed with bf16 operands (the fp8 grouped GEMMs \
     take fp8 activations and fp8 weights of one scheme)";

/// The bf16 activation tensor of `a`, or `Unsupported` naming what is missing.
fn bf16_act<'a>(op: &'static str, name: &str, a: &'a ActOperand) -> Result<&'a Tensor> {
    match a {
        ActOperand::Plain(t) if t.dtype() == DType::BF16 => Ok(t),
        ActOperand::Plain(t) => Err(unsupported(
            op,
            t.device(),
            format!(
                "`{name}` is {}; the CUDA grouped GEMM takes bf16 activations (no {} kernel yet)",
                t.dtype(),
                t.dtype()
            ),
        )),
        ActOperand::Fp8PerTensor { q, .. } | ActOperand::Fp8Group { q, .. } => Err(unsupported(
            op,
            q.device(),
            format!("`{name}` is fp8: {FP8_MIXED}"),
        )),
    }
}

/// The bf16 weight tensor of `w`, or `Unsupported` naming what is missing.
fn bf16_weight<'a>(op: &'static str, name: &str, w: &'a WeightOperand) -> Result<&'a Tensor> {
    match w {
        WeightOperand::Plain(t) if t.dtype() == DType::BF16 => Ok(t),
        WeightOperand::Plain(t) => Err(unsupported(
            op,
            t.device(),
            format!(
                "`{name}` is {}; the CUDA grouped GEMM takes bf16 weights (no {} kernel yet)",
                t.dtype(),
                t.dtype()
            ),
        )),
        WeightOperand::Fp8PerTensor { q, .. } | WeightOperand::Fp8Block { q, .. } => Err(
            unsupported(op, q.device(), format!("`{name}` is fp8: {FP8_MIXED}")),
        ),
    }
}

/// Ok if the CUDA kernels can run these operands (bf16 weights with unquantized activations, or
/// fp8 weights with the activation quantization of their scheme on an sm_90 device); else the
/// `Unsupported` error naming the missing kernel. Callers check this before quantizing, so an
/// unsupported combination fails here rather than deep in `quant_fp8`.
pub(super) fn check_support(
    op: &'static str,
    device: Device,
    act_quant: ActQuant,
    w13: &WeightOperand,
    w2: &WeightOperand,
) -> Result<()> {
    if act_quant != ActQuant::None || cuda_fp8::is_fp8_weight(w13) || cuda_fp8::is_fp8_weight(w2) {
        return cuda_fp8::check_support(op, device, act_quant, w13, w2);
    }
    bf16_weight(op, "w13", w13)?;
    bf16_weight(op, "w2", w2)?;
    Ok(())
}

fn check_reduction(op: &'static str, what: &str, len: usize) -> Result<()> {
    if !len.is_multiple_of(K_MULTIPLE) {
        return Err(Error::invalid(
            op,
            format!(
                "{what} = {len} must be a multiple of {K_MULTIPLE} on CUDA (the grouped GEMM loads \
                 16-byte chunks of bf16 along the reduction)"
            ),
        ));
    }
    Ok(())
}

/// The device buffers of aligned routes, checked against the kernel's tile.
/// One segment of aligned routes as a GEMM launch reads it: the whole alignment, or with mixed
/// tiles the short or the tall runs (views into the alignment's buffers).
struct RouteBuffers<'a> {
    /// The kernel variant whose M tile these routes are aligned to.
    cfg: GemmConfig,
    /// One segment holds every route (uniform tiles), so the busy M blocks can be estimated from
    /// the routes per expert ([`launch_cfg`]).
    uniform: bool,
    sorted: CudaView<'a, u8>,
    blocks: CudaView<'a, u8>,
    total: CudaView<'a, u8>,
    slots: usize,
}

/// The segments of `routes` (one, or two with mixed tiles), each with its kernel.
fn route_segments<'a>(
    op: &'static str,
    routes: &'a AlignedRoutes,
    device: Device,
) -> Result<Vec<RouteBuffers<'a>>> {
    let sorted_storage = cuda_storage(op, "sorted_routes", &routes.sorted_routes, device)?;
    let cc = sorted_storage.backend().compute_capability();
    let sorted = sorted_storage.buffer();
    let blocks = cuda_storage(op, "block_experts", &routes.block_experts, device)?.buffer();
    let total = cuda_storage(op, "total", &routes.total, device)?.buffer();
    let kernel_for = |block_m: usize| {
        let cfg = if routes.tall.is_some() {
            GemmConfig::for_block_m(cc, block_m)
        } else {
            GemmConfig::for_routes(cc, block_m, routes.num_routes, routes.num_experts)
        };
        cfg.ok_or_else(|| {
            Error::invalid(
                op,
                format!(
                    "routes are aligned to block_m = {block_m}; the CUDA grouped GEMMs of this \
                     device take {} (their M tiles)",
                    if cc == (9, 0) {
                        "16, 32, 64, 128 or 192"
                    } else {
                        "64"
                    }
                ),
            )
        })
    };
    let u32_bytes = DType::U32.size_in_bytes();
    let Some(tall) = &routes.tall else {
        return Ok(vec![RouteBuffers {
            cfg: kernel_for(routes.block_m)?,
            uniform: true,
            sorted: sorted.slice(..),
            blocks: blocks.slice(..),
            total: total.slice(..),
            slots: routes.slots(),
        }]);
    };
    let tall_total = cuda_storage(op, "tall total", &tall.total, device)?.buffer();
    Ok(vec![
        RouteBuffers {
            cfg: kernel_for(routes.block_m)?,
            uniform: false,
            sorted: sorted.slice(..tall.slot_base * u32_bytes),
            blocks: blocks.slice(..tall.block_base * u32_bytes),
            total: total.slice(..),
            slots: tall.slot_base,
        },
        RouteBuffers {
            cfg: kernel_for(tall.block_m)?,
            uniform: false,
            sorted: sorted.slice(tall.slot_base * u32_bytes..),
            blocks: blocks.slice(tall.block_base * u32_bytes..),
            total: tall_total.slice(..),
            slots: routes.slots() - tall.slot_base,
        },
    ])
}

/// One launch of `fmoe_moe_gemm_bf16`.
struct Gemm<'a> {
    mode: u32,
    a: &'a CudaStorage,
    w: &'a CudaStorage,
    routes: &'a RouteBuffers<'a>,
    /// MODE 2: f32 [num_routes].
    topk_weights: Option<&'a CudaStorage>,
    num_routes: usize,
    top_k: usize,
    /// Reduction length (K for GEMM1, N for GEMM2).
    kd: usize,
    /// Output columns (N for GEMM1, K for GEMM2).
    n_out: usize,
    /// Experts (for the split-K heuristic).
    experts: usize,
    /// MODE 2 with `-D ROUTE_ROWS=1`: `out` is bf16 [num_routes, n_out], one weighted row per
    /// route (plain stores; needs one K split, see [`gemm_plan`]).
    route_rows: bool,
}

/// Split-K factor of a grouped GEMM2 (the harness's `splits_for`): enough splits for about four
/// blocks per SM, at most `max_splits`. The busy M tiles are bounded both by the routes' slots and
/// by ceil(routes / bm) plus one partial tile per expert that has routes.
pub(super) fn split_k(
    num_routes: usize,
    experts: usize,
    slots: usize,
    bm: usize,
    n_tiles: usize,
    max_splits: usize,
    sms: usize,
) -> usize {
    if let Some(s) = dev().splits {
        return s;
    }
    let blocks = (slots / bm).min(num_routes.div_ceil(bm) + experts.min(num_routes));
    let want = (4 * sms).div_ceil((n_tiles * blocks).max(1));
    want.min(max_splits).max(1)
}

/// Route blocks a swap-AB launch covers (`bm` routes each): the busy ones are at most
/// ceil(routes / bm) plus one partial block per expert with routes, so decode launches no blocks
/// that would only exit (DeepSeek-V3 at M = 1: 8 instead of 240).
pub(super) fn swap_ab_blocks(bm: usize, num_routes: usize, experts: usize, slots: usize) -> usize {
    (slots / bm).min(num_routes / bm + experts.min(num_routes))
}

/// Swap-AB GEMM2's split-K factor for `ctas` blocks (route blocks × N tiles) before splitting,
/// over a reduction of `ktiles` K steps: the one (≤ a quarter of the K steps) that minimizes
/// waves × K steps per block over `sms` SMs with as many blocks per SM as `smem_bytes` allows, the
/// fewest splits on a tie (fewer partial sums into y). Route blocks of `bm` ≥ 32 (from 16 routes
/// per expert on average) are never split once the grid fills a wave: there the cost model's
/// gains are a fraction of a wave (the grid counts blocks that exit at once) while every split
/// adds a partial sum of each output into y (H200, DeepSeek-V3 bf16 at M = 512, 32-route blocks:
/// 4 splits 5.47 ms, none 5.41; 64-route blocks at M = 1024 split 8 ways: 7.37 ms, none 5.91).
pub(super) fn swap_ab_splits(
    smem_bytes: usize,
    bm: usize,
    ctas: usize,
    ktiles: usize,
    sms: usize,
) -> usize {
    if let Some(s) = dev().splits {
        return s;
    }
    let ktiles = ktiles.max(1);
    let per_sm = (228 * 1024 / (smem_bytes + 1024)).max(1);
    let slots = (sms * per_sm).max(1);
    if bm >= 32 && ctas >= slots {
        return 1;
    }
    let cost = |s: usize| (ctas * s).div_ceil(slots) * ktiles.div_ceil(s);
    (1..=(ktiles / 4).max(1))
        .min_by_key(|&s| (cost(s), s))
        .unwrap_or(1)
}

/// The launch grid of a grouped GEMM over aligned routes and its u32 scalar arguments, with the
/// errors naming what does not fit.
pub(super) struct GemmGrid {
    pub(super) grid: (u32, u32, u32),
    pub(super) num_routes: u32,
    pub(super) top_k: u32,
    pub(super) kd: u32,
    pub(super) n_out: u32,
}

/// A zeroed u32 tile counter for one launch of a GEMM that claims its tiles (the persistent
/// kernels' dynamic schedule: one increment per claimed tile).
pub(super) fn tile_counter(backend: &Arc<CudaBackend>) -> Result<CudaStorage> {
    crate::elementwise::cuda::zeros_chain("moe chain: zero fill", backend, DType::U32, 1)
}

/// The grid of a persistent GEMM over the tile space `(n_tiles, m_blocks, splits)`: at most one
/// block per SM (each walks the tiles in the kernel's own order).
pub(super) fn persistent_grid(
    op: &'static str,
    (n_tiles, m_blocks, splits): (u32, u32, u32),
    sms: usize,
) -> Result<(u32, u32, u32)> {
    let tiles = n_tiles as usize * m_blocks as usize * splits as usize;
    Ok((
        u32_arg(op, "persistent blocks", tiles.min(sms).max(1))?,
        1,
        1,
    ))
}

/// `blocks_m` M tiles of `bm` routes, `n_tiles` N tiles, `splits` K splits.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_grid(
    op: &'static str,
    num_routes: usize,
    top_k: usize,
    kd: usize,
    n_out: usize,
    bm: usize,
    blocks_m: usize,
    n_tiles: usize,
    splits: usize,
) -> Result<GemmGrid> {
    let grid_y = u32::try_from(blocks_m)
        .ok()
        .filter(|&y| y <= 65_535)
        .ok_or_else(|| {
            Error::invalid(
                op,
                format!(
                    "{num_routes} routes need {blocks_m} M tiles of {bm}; one launch takes at most 65535"
                ),
            )
        })?;
    Ok(GemmGrid {
        grid: (
            u32_arg(op, "N tiles", n_tiles)?,
            grid_y,
            u32_arg(op, "split-K", splits)?,
        ),
        num_routes: u32_arg(op, "number of routes", num_routes)?,
        top_k: u32_arg(op, "top_k", top_k)?,
        kd: u32_arg(op, "reduction length", kd)?,
        n_out: u32_arg(op, "output columns", n_out)?,
    })
}

/// The variant that runs `g`: its routes' kernel; for a uniform [`SM90_TALL`] launch with the tile
/// width [`wave_fit`] picks for the M blocks the routes are expected to fill (each expert's
/// average routes in 192-row blocks); for a persistent one whose experts each fit one M block,
/// N tiles fastest ([`one_block_raster`]).
fn launch_cfg(g: &Gemm<'_>, sms: usize) -> GemmConfig {
    let mut cfg = g.routes.cfg;
    if cfg == SM90_TALL && g.routes.uniform {
        let experts = g.experts.clamp(1, g.num_routes.max(1));
        let per_expert = g.num_routes.div_ceil(experts).div_ceil(cfg.bm);
        let busy = (experts * per_expert).min(g.routes.slots / cfg.bm);
        // The same plan with or without route rows: they are chosen from it (one split).
        let splits_of = |c: &GemmConfig, n_tiles: usize| {
            if g.mode == 2 {
                c.splits(g.num_routes, g.experts, g.routes.slots, n_tiles, g.kd, sms)
            } else {
                1
            }
        };
        cfg = wave_fit(g.mode, g.n_out, g.kd, busy, splits_of, sms);
        cfg.skip_pad_wg = skip_pad_wg();
    }
    if matches!(
        cfg.kind,
        GemmKind::Sm90Pipe {
            persistent: true,
            ..
        }
    ) && one_block_raster(g.num_routes, g.experts, cfg.bm)
    {
        cfg.raster_gm = 1;
    }
    cfg
}

/// Dev-only: `FMOE_DEV_SKIP_PAD_WG=off` multiplies the padding warpgroups of uniform 192-row
/// tiles too (read once per process).
/// Whether uniform 192-row launches let a warpgroup of all-padding rows skip the tile
/// ([`GemmConfig::skip_pad_wg`]): over few experts of 128-175 routes (Mixtral at M = 512-703)
/// about half the experts leave the third warpgroup of their one block empty.
fn skip_pad_wg() -> bool {
    dev().skip_pad_wg
}

/// Dev-only: `FMOE_DEV_BF16_PAIR=<on|off>` (default off) runs the persistent 128-row bf16 pipe
/// GEMMs in 2-block clusters ([`GemmConfig::pairs`]; read once per process; not a user setting).
fn dev_bf16_pair() -> bool {
    dev().bf16_pair
}

/// Experts from which [`one_block_raster`] applies.
pub const ONE_BLOCK_RASTER_MIN_EXPERTS: usize = 64;

/// Dev-only: `FMOE_DEV_ONE_BLOCK_RASTER=off` keeps the grouped order of 16 M blocks where
/// [`one_block_raster`] would walk N tiles fastest (bf16 and fp8; read once per process).
/// Whether a persistent prefill GEMM over `num_routes` routes and `experts` experts walks its tiles
/// N fastest, one M block at a time (`-D RASTER_GM=1`) instead of in groups of 16 M blocks: over
/// many experts (at least [`ONE_BLOCK_RASTER_MIN_EXPERTS`]) whose routes fit one `bm`-row block on
/// average, no two M blocks share a weight tile, so the groups only spread each block's activation
/// rows over 16 x (N tiles) claims, long enough for the streamed weights to evict them from L2
/// between uses. H200, DeepSeek-V3 (decision D-068): the four bf16 GEMM
/// launches at M = 4096 read 23.3 GB from DRAM instead of 26.1 (22.5 GB of weights); the layer
/// 1.06-1.11x faster at M = 2048-5120, fp8 per-tensor 1.075x and block-scaled 1.016x at 4096, a
/// tie at 8192 (two or more blocks per expert, where the groups do share weight tiles, so the rule
/// leaves them).
pub(super) fn one_block_raster(num_routes: usize, experts: usize, bm: usize) -> bool {
    dev().one_block_raster && experts >= ONE_BLOCK_RASTER_MIN_EXPERTS && num_routes <= bm * experts
}

/// The launch's (M blocks, N tiles, K splits) on `sms` SMs: swap-AB launches only the route
/// blocks that can be busy and evens GEMM2's waves with its split; the others cover the slots and
/// split GEMM2 by [`GemmConfig::splits`].
fn gemm_plan(g: &Gemm<'_>, cfg: &GemmConfig, sms: usize) -> (usize, usize, usize) {
    let n_tiles = g.n_out.div_ceil(cfg.n_tile(g.mode));
    let swap_ab = cfg.kind == GemmKind::SwapAb;
    let blocks_m = if swap_ab {
        swap_ab_blocks(cfg.bm, g.num_routes, g.experts, g.routes.slots)
    } else {
        g.routes.slots / cfg.bm
    };
    let splits = if g.mode == 2 && swap_ab {
        let ktiles = g.kd.div_ceil(cfg.bk);
        swap_ab_splits(
            cfg.smem_bytes() as usize,
            cfg.bm,
            blocks_m * n_tiles,
            ktiles,
            sms,
        )
    } else if g.mode == 2 {
        cfg.splits(g.num_routes, g.experts, g.routes.slots, n_tiles, g.kd, sms)
    } else {
        1
    };
    (blocks_m, n_tiles, splits)
}

/// MODE 1 writes `out` = h bf16 [num_routes, n_out]; MODE 2 adds into `out` = y32 f32
/// [num_routes / top_k, n_out], which the caller zeroed (MODE 2 may split the reduction: each
/// split adds its partial sum), or with `route_rows` stores every route's weighted row into `out`
/// = bf16 [num_routes, n_out] (one split).
fn launch_gemm(op: &'static str, g: &Gemm<'_>, out: &mut CudaStorage) -> Result<()> {
    let blocks_m = g.routes.slots / g.routes.cfg.bm;
    if g.num_routes == 0 || g.n_out == 0 || blocks_m == 0 {
        return Ok(());
    }
    let backend = g.a.backend();
    if g.routes.cfg.kind != GemmKind::Mma && backend.compute_capability() != (9, 0) {
        return Err(unsupported(
            op,
            g.a.device(),
            format!(
                "the wgmma grouped GEMM needs sm_90 (Hopper), this device is sm_{}{}",
                backend.compute_capability().0,
                backend.compute_capability().1
            ),
        ));
    }
    let sms = backend.multiprocessor_count() as usize;
    let cfg = launch_cfg(g, sms);
    let (blocks_m, n_tiles, splits) = gemm_plan(g, &cfg, sms);
    if g.route_rows
        && (g.mode != 2 || splits != 1 || !matches!(cfg.kind, GemmKind::Sm90Pipe { .. }))
    {
        return Err(Error::invalid(
            op,
            "internal: per-route GEMM2 rows need the pipe kernel, MODE 2 and one K split",
        ));
    }
    let GemmGrid {
        grid,
        num_routes,
        top_k,
        kd,
        n_out,
    } = gemm_grid(
        op,
        g.num_routes,
        g.top_k,
        g.kd,
        g.n_out,
        cfg.bm,
        blocks_m,
        n_tiles,
        splits,
    )?;
    let (family, source) = cfg.source();
    let mut defines = cfg.defines(g.mode);
    if g.route_rows {
        defines.push(route_rows_define());
    }
    if matches!(cfg.kind, GemmKind::Sm90Pipe { .. }) && g.n_out.is_multiple_of(2) {
        defines.push(n_out_even_define());
    }
    let (f, pdl) = crate::launch::load_chain(backend, family, source, GEMM_ENTRY, &defines)?;
    let smem = cfg.smem_bytes();
    opt_in_smem(&f, smem, "moe_gemm_bf16: shared memory opt-in")?;
    // The tile space, as the pipe kernel takes it; the persistent one walks it with a block per SM.
    let (n_tiles32, m_blocks32, splits32) = (grid.0, grid.1, grid.2);
    let persistent = match cfg.kind {
        GemmKind::Sm90Pipe { persistent, .. } => persistent,
        GemmKind::SwapAb => super::cuda_fp8::swapab_persistent(cfg.bm, g.mode),
        _ => false,
    };
    let grid = match cfg.kind {
        // 2-block clusters walking units of (N tile, two M blocks, split): an even grid.
        _ if cfg.pairs() => {
            let units = (grid.0, grid.1.div_ceil(2), grid.2);
            (2 * persistent_grid(op, units, sms / 2)?.0, 1, 1)
        }
        _ if persistent => persistent_grid(op, grid, sms)?,
        // Route blocks fastest: an expert's blocks run together and share its weight tiles.
        GemmKind::SwapAb => (grid.1, grid.0, grid.2),
        _ => grid,
    };
    let launch = LaunchConfig {
        grid_dim: grid,
        block_dim: (cfg.threads(), 1, 1),
        shared_mem_bytes: smem,
    };
    let null: u64 = 0;
    let out = out.buffer_mut()?;
    let mut b = crate::launch::PdlLaunch::new(backend, &f, pdl);
    b.arg(g.a.buffer())
        .arg(g.w.buffer())
        .arg(&g.routes.sorted)
        .arg(&g.routes.blocks)
        .arg(&g.routes.total);
    match g.topk_weights {
        Some(w) => b.arg(w.buffer()),
        None => b.arg(&null),
    };
    if g.mode == 1 {
        b.arg(out).arg(&null);
    } else {
        b.arg(&null).arg(out);
    }
    b.arg(&num_routes).arg(&top_k).arg(&kd).arg(&n_out);
    let b_map;
    if matches!(cfg.kind, GemmKind::Sm90Pipe { .. } | GemmKind::SwapAb) {
        // All experts' rows; MODE 1 loads the gate and the up half of each MMA warpgroup's
        // weight rows as two boxes (of 128 rows for BM = 128, of 64 for the pipe kernel's BM = 64).
        // Swap-AB: each 256-row tile is two boxes of 128 rows (gate and up, or two halves).
        let rows = g.w.len() / g.kd.max(1);
        let box_rows = if cfg.kind == GemmKind::SwapAb || cfg.pairs() {
            // Pairs: every tile as two 128-row boxes (one per block of a sharing pair).
            128
        } else if g.mode == 1 {
            // Two boxes per MMA warpgroup's weight rows (BM = 64: each warpgroup has half).
            if cfg.bm == 64 {
                cfg.wg_n / 4
            } else {
                cfg.wg_n / 2
            }
        } else {
            cfg.wg_n
        };
        b_map = weight_tensor_map(op, g.w, TmaElem::Bf16, rows, g.kd, box_rows)?;
        b.arg(&b_map);
    }
    let swap_counter;
    if cfg.kind == GemmKind::SwapAb && persistent {
        b.arg(&m_blocks32).arg(&n_tiles32).arg(&splits32);
        if super::cuda_fp8::swapab_dynamic(cfg.bm, g.mode) {
            swap_counter = tile_counter(backend)?;
            b.arg(swap_counter.buffer());
        }
    }
    let counter;
    if let GemmKind::Sm90Pipe { dynamic, .. } = cfg.kind {
        b.arg(&n_tiles32).arg(&m_blocks32).arg(&splits32);
        if dynamic {
            counter = tile_counter(backend)?;
            b.arg(counter.buffer());
        } else {
            b.arg(&null);
        }
    }
    // SAFETY: the arguments match `fmoe_moe_gemm_bf16`'s parameters in order and type (pointers,
    // then four u32), in both sources. The callers checked: `a` is bf16 with kd columns and
    // num_routes (MODE 2) or num_routes / top_k (MODE 1) rows; `w` is bf16 [E, 2·n_out or n_out,
    // kd]; kd is a multiple of 8 and every buffer starts 256-byte aligned (16-byte loads); the
    // routes come from moe_align with BLOCK_M = cfg.bm over these num_routes routes and E
    // experts, so sorted holds grid.1 · bm slots, block ids are < E for blocks before *total, and
    // route ids are < num_routes or the pad; MODE 1's h and MODE 2's topk_weights/y32 have the
    // sizes the kernel indexes (y32 zeroed, as split-K adds into it); the unused pointer of each
    // mode is null and never dereferenced; MODE 1 runs with gridDim.z = 1; the dynamic shared
    // memory is the source's formula for these defines, opted in above 48 KiB. `Sm90Pipe` takes
    // four more arguments, pushed above: the weights' tensor map, the tile space
    // (three u32; its grid covers it, or walks it when persistent) and the tile counter, a zeroed
    // u32 the dynamic schedule increments once per claimed tile (null otherwise, never read).
    // `SwapAb` takes the tensor map (boxes of 128 rows); its grid puts the route blocks (at most
    // the slots' blocks) in x, the N tiles in y and the K splits in z, or, persistent (`-D
    // PERSISTENT=1`), walks that tile space with at most one block per SM, whose three u32
    // (route blocks, N tiles, splits) follow the map, and with `-D DYNAMIC=1` a zeroed u32 tile
    // counter after them.
    unsafe { b.launch(launch) }.map_err(|e| cuda_error("moe_gemm_bf16: launch", e))?;
    Ok(())
}

fn bf16_operands<'a>(
    op: &'static str,
    x: &'a Tensor,
    w: &'a Tensor,
    wname: &str,
) -> Result<(&'a CudaStorage, &'a CudaStorage, Device)> {
    let device = x.device();
    let xs = cuda_storage(op, "activations", x, device)?;
    let ws = cuda_storage(op, wname, w, device)?;
    Ok((xs, ws, device))
}

/// GEMM1 with SiLU⊙mul: h bf16 [num_routes, N], row = route.
pub(super) fn gemm1_silu_mul(
    op: &'static str,
    a: &ActOperand,
    routes: &AlignedRoutes,
    top_k: usize,
    w13: &WeightOperand,
) -> Result<Tensor> {
    if cuda_fp8::is_fp8_act(a) || cuda_fp8::is_fp8_weight(w13) {
        return cuda_fp8::gemm1_h(op, a, routes, top_k, w13);
    }
    let x = bf16_act(op, "a1", a)?;
    let w = bf16_weight(op, "w13", w13)?;
    let (xs, ws, device) = bf16_operands(op, x, w, "w13")?;
    let (two_n, k) = (w.dims()[1], w.dims()[2]);
    let n = two_n / 2;
    check_reduction(op, "K (hidden size, GEMM1's reduction length)", k)?;
    let r = routes.num_routes;
    let mut h = CudaStorage::alloc(xs.backend(), DType::BF16, r * n)?;
    for rb in &route_segments(op, routes, device)? {
        let g = Gemm {
            mode: 1,
            a: xs,
            w: ws,
            routes: rb,
            topk_weights: None,
            num_routes: r,
            top_k,
            kd: k,
            n_out: n,
            experts: routes.num_experts,
            route_rows: false,
        };
        launch_gemm(op, &g, &mut h)?;
    }
    Ok(Tensor::from_storage(Storage::Cuda(h), [r, n])?)
}

/// GEMM2 with the routing weight and top-k sum: y [M, K] in `out_dtype`. Either f32 atomics into
/// a zeroed y32, then the cast to `out_dtype` (F32: none), or, where `sum` and [`route_rows_pay`]
/// say so and the kernel can (the pipe kernel, one K split, K % 8 == 0, bf16/f32 out), per-route
/// bf16 rows summed by [`sum_route_rows`].
pub(super) fn gemm2_weighted_sum(
    op: &'static str,
    h: &ActOperand,
    routes: &AlignedRoutes,
    topk: (Option<&Tensor>, &Tensor),
    w2: &WeightOperand,
    out_dtype: DType,
    sum: Gemm2Sum,
) -> Result<Tensor> {
    if cuda_fp8::is_fp8_act(h) || cuda_fp8::is_fp8_weight(w2) {
        return cuda_fp8::gemm2(op, h, routes, topk, w2, out_dtype, sum);
    }
    let (topk_ids, topk_weights) = topk;
    let a = bf16_act(op, "a2", h)?;
    let w = bf16_weight(op, "w2", w2)?;
    let (hs, ws, device) = bf16_operands(op, a, w, "w2")?;
    let (k, n) = (w.dims()[1], w.dims()[2]);
    check_reduction(op, "N (intermediate size, GEMM2's reduction length)", n)?;
    let weights = cuda_storage(op, "topk_weights", topk_weights, device)?;
    let (m, top_k) = (topk_weights.dims()[0], topk_weights.dims()[1]);
    let segments = route_segments(op, routes, device)?;
    let backend = hs.backend();
    let gemms: Vec<Gemm<'_>> = segments
        .iter()
        .map(|rb| Gemm {
            mode: 2,
            a: hs,
            w: ws,
            routes: rb,
            topk_weights: Some(weights),
            num_routes: routes.num_routes,
            top_k,
            kd: n,
            n_out: k,
            experts: routes.num_experts,
            route_rows: false,
        })
        .collect();
    // Route rows: only the persistent pipe kernels with one K split store them (every segment's).
    let sms = backend.multiprocessor_count() as usize;
    let kernel_can = gemms.iter().all(|g| {
        matches!(g.routes.cfg.kind, GemmKind::Sm90Pipe { .. })
            && gemm_plan(g, &launch_cfg(g, sms), sms).2 == 1
    });
    gemm2_summed(
        op,
        backend,
        routes,
        topk_ids,
        (m, top_k, k),
        out_dtype,
        sum,
        kernel_can,
        |out, route_rows| {
            for mut g in gemms {
                g.route_rows = route_rows;
                launch_gemm(op, &g, out)?;
            }
            Ok(())
        },
    )
}

/// GEMM2's output side, the same for the bf16 and the fp8 kernels: where [`route_rows_chosen`]
/// says so (`kernel_can`: the caller's planned launch can store route rows; `topk_ids` given),
/// per-route bf16 rows [R, K] summed by [`sum_route_rows`]; else f32 atomics into a zeroed y32
/// [M, K] and the cast to `out_dtype`. `launch(out, route_rows)` launches GEMM2 into `out`.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm2_summed(
    op: &'static str,
    backend: &Arc<CudaBackend>,
    routes: &AlignedRoutes,
    topk_ids: Option<&Tensor>,
    (m, top_k, k): (usize, usize, usize),
    out_dtype: DType,
    sum: Gemm2Sum,
    kernel_can: bool,
    launch: impl FnOnce(&mut CudaStorage, bool) -> Result<()>,
) -> Result<Tensor> {
    if let Some(topk_ids) = topk_ids
        && route_rows_chosen(
            sum,
            kernel_can,
            (m, top_k, k),
            out_dtype,
            backend.l2_cache_bytes(),
        )
    {
        let mut rows = CudaStorage::alloc(backend, DType::BF16, routes.num_routes * k)?;
        launch(&mut rows, true)?;
        // backend.device() is the operands' device (their storage's backend).
        let ids = cuda_storage(op, "topk_ids", topk_ids, backend.device())?;
        let y = sum_route_rows(op, &rows, ids, routes.num_experts, (m, top_k, k), out_dtype)?;
        return Ok(Tensor::from_storage(Storage::Cuda(y), [m, k])?);
    }
    let mut y =
        crate::elementwise::cuda::zeros_chain("moe chain: zero fill", backend, DType::F32, m * k)?;
    launch(&mut y, false)?;
    let y = Tensor::from_storage(Storage::Cuda(y), [m, k])?;
    crate::elementwise::to_dtype(&y, out_dtype)
}

/// How GEMM2 meets the top-k routes of a token (see [`super::gemm2_weighted_sum_to`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gemm2Sum {
    /// [`route_rows_pay`] decides (or the dev knob [`DEV_ROUTE_ROWS_ENV`]).
    Auto,
    /// f32 reductions into y32 (the cast to the output dtype after).
    Atomic,
    /// Per-route bf16 rows and [`super::sum_route_rows`] wherever the kernel allows (the
    /// persistent 128-row prefill GEMMs with one K split, K % 8 == 0, bf16/f32 out); elsewhere
    /// [`Gemm2Sum::Atomic`].
    RouteRows,
}

/// Dev-only: `FMOE_DEV_ROUTE_ROWS=<off|on>` makes [`Gemm2Sum::Auto`] mean [`Gemm2Sum::Atomic`] or
/// [`Gemm2Sum::RouteRows`] (read once per process; not a user setting; unset or "auto" = the rule),
/// so one binary can time and test both.
pub const DEV_ROUTE_ROWS_ENV: &str = fmoe_core::env::FMOE_DEV_ROUTE_ROWS;

/// The knob: `None` = the rule.
fn dev_route_rows() -> Option<bool> {
    dev().route_rows
}

/// The define of a route-rows GEMM2 (`common/moe_epilogue.cuh` `gemm2_row`).
pub(super) fn route_rows_define() -> (&'static str, String) {
    ("ROUTE_ROWS", "1".to_string())
}

/// `-D N_OUT_EVEN=1`: the pipe kernel's epilogue stores column pairs only (every real model: its
/// output width is the other GEMM's reduction, a multiple of [`K_MULTIPLE`]). Without it the
/// epilogue also carries the odd-width path, which doubled its instructions (ptxas, MODE 1).
fn n_out_even_define() -> (&'static str, String) {
    ("N_OUT_EVEN", "1".to_string())
}

/// Top-k from which [`route_rows_pay`] picks per-route rows.
pub const ROUTE_ROWS_MIN_TOP_K: usize = 4;

/// The rule of [`Gemm2Sum::Auto`]: per-route rows for top-k ≥ `ROUTE_ROWS_MIN_TOP_K` (4) when y32
/// (f32 [tokens, K]) outgrows L2. Why (H200, decision D-028, GEMM2 without the y32
/// read-modify-write): the rows take GEMM2's reductions out (ncu: DeepSeek-V3 bf16 M = 16384
/// GEMM2 6.93 → 6.67 ms, fp8-block M = 8192 2.70 → 2.52) but their top-k sum reads routes × K × 2
/// bytes where the cast read tokens × K × 4 (0.25 → 0.50 ms, at the DRAM rate). They pay where
/// the reductions are costly: with top-8 a token's 8 routes add into one y32 row from blocks that
/// run at once (DeepSeek-V3: the layer 1.01–1.04× faster at M = 2048–4096, 0.995–1.012× at
/// 8192–16384); with top-2 they are a wash (Mixtral-8x7B 0.95–1.02×, in the run-to-run noise). While
/// y32 fits in L2 the reductions resolve there, and the rows would only add DRAM traffic.
pub fn route_rows_pay(tokens: usize, top_k: usize, k: usize, l2_bytes: usize) -> bool {
    top_k >= ROUTE_ROWS_MIN_TOP_K && tokens.saturating_mul(k).saturating_mul(4) > l2_bytes
}

/// Whether GEMM2 writes per-route rows: as `sum` says (Auto: the knob, else [`route_rows_pay`]),
/// and only where the kernel can (`kernel_can`: the persistent 128-row kernel with one K split),
/// K % 8 == 0 (the sum's 16-byte chunks) and the output is bf16 or f32.
pub(super) fn route_rows_chosen(
    sum: Gemm2Sum,
    kernel_can: bool,
    (tokens, top_k, k): (usize, usize, usize),
    out_dtype: DType,
    l2_bytes: usize,
) -> bool {
    let wanted = match sum {
        Gemm2Sum::Atomic => false,
        Gemm2Sum::RouteRows => true,
        Gemm2Sum::Auto => {
            dev_route_rows().unwrap_or_else(|| route_rows_pay(tokens, top_k, k, l2_bytes))
        }
    };
    wanted
        && kernel_can
        && k.is_multiple_of(K_MULTIPLE)
        && matches!(out_dtype, DType::BF16 | DType::F32)
}

/// `moe_finalize.cu`: y [M, K] in `out_dtype` (bf16 or f32) = the top-k sum of `rows` (bf16
/// [M · top_k, K]) in j order, routes with an expert id ≥ `num_experts` left out.
pub(super) fn sum_route_rows(
    op: &'static str,
    rows: &CudaStorage,
    ids: &CudaStorage,
    num_experts: usize,
    (m, top_k, k): (usize, usize, usize),
    out_dtype: DType,
) -> Result<CudaStorage> {
    let backend = rows.backend();
    let mut y = CudaStorage::alloc(backend, out_dtype, m * k)?;
    let chunks = m * (k / K_MULTIPLE);
    if chunks == 0 {
        return Ok(y);
    }
    let out_f32 = match out_dtype {
        DType::BF16 => "0",
        DType::F32 => "1",
        other => {
            return Err(Error::invalid(
                op,
                format!("the top-k sum writes bf16 or f32, not {other:?}"),
            ));
        }
    };
    let (f, pdl) = crate::launch::load_chain(
        backend,
        FINALIZE_FAMILY,
        FINALIZE_SRC,
        FINALIZE_ENTRY,
        &[("OUT_F32", out_f32.to_string())],
    )?;
    let (chunks64, top_k32, k8, e32) = (
        chunks as u64,
        u32_arg(op, "top_k", top_k)?,
        u32_arg(op, "K / 8", k / K_MULTIPLE)?,
        u32_arg(op, "experts", num_experts)?,
    );
    let blocks = chunks
        .div_ceil(GLUE_THREADS as usize)
        .clamp(1, MAX_GRID_STRIDE_BLOCKS);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (GLUE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = crate::launch::PdlLaunch::new(backend, &f, pdl);
    b.arg(rows.buffer())
        .arg(ids.buffer())
        .arg(y.buffer_mut()?)
        .arg(&chunks64)
        .arg(&top_k32)
        .arg(&k8)
        .arg(&e32);
    // SAFETY: (const uint4*, const u32*, uint4* or float4*, u64, u32, u32, u32); rows holds
    // M·top_k·K bf16 (K % 8 == 0, 256-byte aligned: 16-byte chunks), ids M·top_k u32 (the callers
    // checked their dims), y M·K of out_dtype; the grid strides over the M·K/8 chunks.
    unsafe { b.launch(cfg) }.map_err(|e| cuda_error("moe_finalize: launch", e))?;
    Ok(y)
}

/// Launch shape of the glue kernels: one block per row (grid-stride over rows beyond the cap).
pub(super) fn glue_launch(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_GRID_STRIDE_BLOCKS) as u32, 1, 1),
        block_dim: (GLUE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The unfused baseline on CUDA (see the module docs): y f32 [M, K].
pub(super) fn portable(
    op: &'static str,
    a1: &ActOperand,
    topk_ids: &Tensor,
    topk_weights: &Tensor,
    w13: &WeightOperand,
    w2: &WeightOperand,
) -> Result<Tensor> {
    let x = bf16_act(op, "a1", a1)?;
    let w13t = bf16_weight(op, "w13", w13)?;
    let w2t = bf16_weight(op, "w2", w2)?;
    let (xs, w13s, device) = bf16_operands(op, x, w13t, "w13")?;
    let w2s = cuda_storage(op, "w2", w2t, device)?;
    let weights = cuda_storage(op, "topk_weights", topk_weights, device)?;
    let (e, k, n) = (w13t.dims()[0], w13t.dims()[2], w2t.dims()[2]);
    check_reduction(op, "K (hidden size, GEMM1's reduction length)", k)?;
    check_reduction(op, "N (intermediate size, GEMM2's reduction length)", n)?;
    let (m, top_k) = (topk_ids.dims()[0], topk_ids.dims()[1]);
    let r = m * top_k;
    let backend = xs.backend();
    let mut y = CudaStorage::alloc(backend, DType::F32, m * k)?;
    if r == 0 || k == 0 {
        return Ok(Tensor::from_storage(Storage::Cuda(y), [m, k])?);
    }
    let routes = align_routes(topk_ids, e, BM)?;
    let segments = route_segments(op, &routes, device)?;
    let rb = &segments[0]; // uniform tiles: one segment
    let stream = backend.stream();
    let (r64, m64) = (r as u64, m as u64);
    let (top_k32, k32, n32) = (
        u32_arg(op, "top_k", top_k)?,
        u32_arg(op, "K", k)?,
        u32_arg(op, "N", n)?,
    );

    // xr[r] = x[r / top_k]
    let mut xr = CudaStorage::alloc(backend, DType::BF16, r * k)?;
    let chunks = u32_arg(op, "K / 8", k / K_MULTIPLE)?;
    let f = nvrtc::load(backend, GLUE_FAMILY, GLUE_SRC, "fmoe_gather_rows", &[])?;
    let mut b = stream.launch_builder(&f);
    b.arg(xs.buffer())
        .arg(xr.buffer_mut()?)
        .arg(&r64)
        .arg(&top_k32)
        .arg(&chunks);
    // SAFETY: (const uint4*, uint4*, u64, u32, u32); x holds M·K bf16 = M·chunks 16-byte chunks
    // (K is a multiple of 8, buffers 256-byte aligned) and each row r reads token r / top_k < M;
    // xr holds R·chunks chunks.
    unsafe { b.launch(glue_launch(r)) }.map_err(|e| cuda_error("moe_unfused: gather", e))?;

    let mut ones = CudaStorage::alloc(backend, DType::F32, r)?;
    ones.fill(1.0)?;
    // gu = xr · w13ᵀ per expert, f32 [R, 2N]
    let mut gu = CudaStorage::zeros(backend, DType::F32, r * 2 * n)?;
    let g1 = Gemm {
        mode: 2,
        a: &xr,
        w: w13s,
        routes: rb,
        topk_weights: Some(&ones),
        num_routes: r,
        top_k: 1,
        kd: k,
        n_out: 2 * n,
        experts: e,
        route_rows: false,
    };
    launch_gemm(op, &g1, &mut gu)?;

    // h = silu(gate) ⊙ up, bf16 [R, N]
    let mut h = CudaStorage::alloc(backend, DType::BF16, r * n)?;
    let f = nvrtc::load(backend, GLUE_FAMILY, GLUE_SRC, "fmoe_silu_mul", &[])?;
    let mut b = stream.launch_builder(&f);
    b.arg(gu.buffer()).arg(h.buffer_mut()?).arg(&r64).arg(&n32);
    // SAFETY: (const float*, bf16*, u64, u32); gu holds R·2N f32, h R·N bf16.
    unsafe { b.launch(glue_launch(r)) }.map_err(|e| cuda_error("moe_unfused: silu_mul", e))?;

    // o = h · w2ᵀ per expert, f32 [R, K]
    let mut o = CudaStorage::zeros(backend, DType::F32, r * k)?;
    let g2 = Gemm {
        mode: 2,
        a: &h,
        w: w2s,
        routes: rb,
        topk_weights: Some(&ones),
        num_routes: r,
        top_k: 1,
        kd: n,
        n_out: k,
        experts: e,
        route_rows: false,
    };
    launch_gemm(op, &g2, &mut o)?;

    // y[t] = Σ_j w[t, j] · o[t·top_k + j]
    let f = nvrtc::load(backend, GLUE_FAMILY, GLUE_SRC, "fmoe_topk_reduce", &[])?;
    let mut b = stream.launch_builder(&f);
    b.arg(o.buffer())
        .arg(weights.buffer())
        .arg(y.buffer_mut()?)
        .arg(&m64)
        .arg(&top_k32)
        .arg(&k32);
    // SAFETY: (const float*, const float*, float*, u64, u32, u32); o holds M·top_k·K f32, the
    // weights M·top_k f32 (checked by the caller), y M·K f32.
    unsafe { b.launch(glue_launch(m)) }.map_err(|e| cuda_error("moe_unfused: topk_reduce", e))?;
    Ok(Tensor::from_storage(Storage::Cuda(y), [m, k])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The experiment names `FMOE_DEV_SM90_LARGE` is validated against are this table's.
    #[test]
    fn sm90_large_experiments_match_the_parsed_names() {
        let names: Vec<&str> = SM90_LARGE_EXPERIMENTS.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, fmoe_core::env::SM90_LARGE_EXPERIMENTS);
        assert_eq!(SM90_LARGE_EXPERIMENTS[0].1, SM90_LARGE);
    }

    #[test]
    fn geometry_follows_the_sources_formulas() {
        let mma = GemmConfig {
            kind: GemmKind::Mma,
            bm: 64,
            bk: 32,
            stages: 3,
            wg_n: 256,
            split_k: true,
            raster_gm: 0,
            skip_pad_wg: false,
        };
        assert_eq!(
            (mma.n_tile(1), mma.n_tile(2), mma.threads()),
            (64, 128, 128)
        );
        assert_eq!(mma.smem_bytes(), 46_080); // 3 · (64 + 128) · 40 · 2
        assert_eq!(
            mma.defines(2),
            [
                ("MODE", "2".to_string()),
                ("BK", "32".to_string()),
                ("STAGES", "3".to_string())
            ]
        );
        let sm90 = GemmConfig {
            kind: GemmKind::Sm90,
            bm: 128,
            stages: 4,
            wg_n: 128,
            bk: 64,
            split_k: true,
            raster_gm: 0,
            skip_pad_wg: false,
        };
        assert_eq!(
            (sm90.n_tile(1), sm90.n_tile(2), sm90.threads()),
            (64, 128, 256)
        );
        assert_eq!(sm90.smem_bytes(), 4 * (128 + 128) * 64 * 2 + 1024);
        // Decode on Mixtral's GEMM2 (K = 4096 outputs, N = 14336 reduction): 2 routes in 2 tiles,
        // 32 N tiles → ceil(4 · 132 / 64) = 9 splits (≤ 14336 / 32 / 8 = 56).
        assert_eq!(mma.splits(2, 8, 128, 32, 14336, 132), 9);
        // Prefill fills the GPU without splitting.
        assert_eq!(mma.splits(8192, 8, 8704, 32, 14336, 132), 1);
        // A short reduction is never split, nor with split_k off.
        assert_eq!(mma.splits(2, 8, 128, 1, 64, 132), 1);
        let off = GemmConfig {
            split_k: false,
            ..mma
        };
        assert_eq!(off.splits(2, 8, 128, 32, 14336, 132), 1);
        assert_eq!(BM, MMA.bm);
        assert_eq!(BM, SM90_SMALL.bm);
    }
}

#[cfg(test)]
mod select_tests {
    use super::*;

    /// One M block at a time over many experts that each fit one block of the tile.
    #[test]
    fn one_block_raster_over_many_experts_of_one_block() {
        assert!(one_block_raster(4096 * 8, 256, 128)); // DeepSeek-V3, M = 4096
        assert!(one_block_raster(6144 * 8, 256, 192));
        assert!(!one_block_raster(4096 * 8 + 1, 256, 128));
        assert!(!one_block_raster(8192 * 8, 256, 192)); // two blocks per expert share weights
        assert!(!one_block_raster(256 * 2, 8, 128)); // Mixtral: few experts
    }

    /// The tile-width rule on the H200's 132 SMs, at the shapes it exists for and where it must
    /// leave the 192-row tile alone.
    #[test]
    fn narrow_tall_tiles_where_they_fill_the_last_wave() {
        let sms = 132;
        let rule = |n_routes: usize, experts: usize, slots: usize| {
            move |c: &GemmConfig, n_tiles: usize| {
                c.splits(n_routes, experts, slots, n_tiles, 14336, sms)
            }
        };
        // Mixtral-8x7B M = 512, GEMM1: 8 x 150 tiles = 10 rounds (the last of 12 tiles); 8 x 163
        // = 10 rounds of 0.92 the width.
        let one = |_: &GemmConfig, _: usize| 1;
        assert_eq!(wave_fit(1, 14336, 4096, 8, one, sms), SM90_TALL_NARROW);
        // Its GEMM2 (3 splits by the rule): 22 x 8 x 3 = 528 tiles, 4 full rounds; 24 x 8 x 3 =
        // 576 would take 5.
        let slots = 8 * 192;
        let g2 = wave_fit(2, 4096, 14336, 8, rule(1024, 8, slots), sms);
        assert_eq!(g2, SM90_TALL);
        assert_eq!(SM90_TALL.splits(1024, 8, slots, 22, 14336, sms), 3);
        // Mixtral-8x22B M = 512, GEMM1: 11 rounds of 96 columns vs 12 of 88, a tie: the wide tile.
        assert_eq!(wave_fit(1, 16384, 6144, 8, one, sms), SM90_TALL);
        // One wave exactly (132 tiles of 96 columns) stays one wave.
        assert_eq!(wave_fit(1, 96 * 132, 4096, 1, one, sms), SM90_TALL);
    }

    #[test]
    fn mixed_tiles_from_176_routes_per_expert_or_128_over_many_experts() {
        let h = (9, 0);
        let mixed = RouteTiling::Mixed {
            short: 128,
            tall: 192,
        };
        let uniform = |bm| RouteTiling::Uniform(bm);
        assert_eq!(GemmConfig::tiling(h, 4096 * 8, 256), mixed); // DeepSeek-V3, M = 4096
        assert_eq!(GemmConfig::tiling(h, 16384 * 8, 256), mixed);
        assert_eq!(GemmConfig::tiling(h, 128 * 64 - 1, 64), uniform(128)); // 127 per expert
        assert_eq!(GemmConfig::tiling(h, 3072 * 8, 256), uniform(128)); // 96 per expert
        assert_eq!(GemmConfig::tiling(h, 512 * 2, 8), uniform(192)); // Mixtral, M = 512
        assert_eq!(GemmConfig::tiling(h, 176 * 8 - 1, 8), uniform(192));
        assert_eq!(GemmConfig::tiling(h, 176 * 8, 8), mixed);
        assert_eq!(GemmConfig::tiling(h, 16384 * 2, 8), mixed);
        assert_eq!(GemmConfig::tiling(h, 2, 8), uniform(16)); // decode: swap-AB
        assert_eq!(GemmConfig::tiling((8, 9), 1 << 20, 8), uniform(64));
    }

    #[test]
    fn hopper_picks_wgmma_tiles_by_routes_per_expert_and_others_get_mma() {
        let h = (9, 0);
        // Few routes per expert: swap-AB (the default of the dev switch).
        assert_eq!(GemmConfig::select(h, 2, 8), SM90_SWAPAB); // Mixtral decode
        assert_eq!(GemmConfig::select(h, 8, 256), SM90_SWAPAB); // DeepSeek-V3 decode
        assert_eq!(GemmConfig::select(h, 16 * 8 - 1, 8), SM90_SWAPAB);
        // 16 to 25 routes per expert: 32-route blocks.
        let swap32 = sm90_swapab(32, 3);
        assert_eq!(GemmConfig::select(h, 16 * 8, 8), swap32); // Mixtral, M = 64
        assert_eq!(GemmConfig::select(h, 25 * 8 - 1, 8), swap32);
        assert_eq!(GemmConfig::select(h, 512 * 8, 256), swap32); // DeepSeek-V3, M = 512
        // 25 to 49 routes per expert: 64-route blocks, then the 64-row tiles.
        let swap64 = sm90_swapab(64, 5);
        assert_eq!(GemmConfig::select(h, 25 * 8, 8), swap64);
        assert_eq!(GemmConfig::select(h, 49 * 8 - 1, 8), swap64);
        assert_eq!(GemmConfig::select(h, 49 * 8, 8), SM90_SMALL);
        assert_eq!(GemmConfig::for_routes(h, 64, 25 * 8, 8), Some(swap64));
        assert_eq!(GemmConfig::for_routes(h, 64, 49 * 8, 8), Some(SM90_SMALL));
        assert_eq!(GemmConfig::select((8, 9), 2, 8), MMA);
        assert_eq!(GemmConfig::select(h, 63 * 8, 8), SM90_SMALL);
        assert_eq!(GemmConfig::select(h, 64 * 8, 8), SM90_LARGE); // Mixtral, M = 256
        assert_eq!(GemmConfig::select(h, 127 * 8, 8), SM90_LARGE);
        // 128 to 175 routes per expert: the 192-row tiles.
        assert_eq!(GemmConfig::select(h, 128 * 8, 8), SM90_TALL); // Mixtral, M = 512
        assert_eq!(GemmConfig::select(h, 4096 * 8, 256), SM90_TALL); // DeepSeek-V3, M = 4096
        assert_eq!(GemmConfig::select(h, 176 * 8 - 1, 8), SM90_TALL);
        assert_eq!(GemmConfig::select(h, 176 * 8, 8), SM90_LARGE);
        assert_eq!(GemmConfig::select(h, 8192 * 8, 256), SM90_LARGE); // DeepSeek-V3, M = 8192
        assert_eq!(GemmConfig::select(h, 1024 * 8, 256), swap64); // 32 routes per expert
        assert_eq!(GemmConfig::select(h, 2048 * 8, 256), SM90_LARGE);
        assert_eq!(GemmConfig::select((8, 0), 1 << 20, 8), MMA);
        assert_eq!(GemmConfig::select((10, 0), 1 << 20, 8), MMA); // sm_90a code does not run there
        // The 64-row prefill tiles, when turned on: from 64 routes per expert up to mid_max.
        let mid = |r, e| GemmConfig::select_with_mid(h, r, e, MID_TILE_MAX_ROUTES_PER_EXPERT);
        assert_eq!(mid(63 * 8, 8), SM90_SMALL);
        assert_eq!(mid(2, 8), SM90_SWAPAB);
        assert_eq!(mid(64 * 8, 8), SM90_MID);
        assert_eq!(mid(4096 * 8, 256), SM90_MID); // DeepSeek-V3, M = 4096
        assert_eq!(mid(255 * 8, 8), SM90_MID);
        assert_eq!(mid(256 * 8, 8), SM90_LARGE);
        assert_eq!(GemmConfig::select_with_mid((8, 0), 64 * 8, 8, 256), MMA);
    }

    #[test]
    fn swap_ab_variant_and_its_grid() {
        let c = SM90_SWAPAB;
        assert_eq!((c.n_tile(1), c.n_tile(2), c.threads()), (128, 256, 288));
        // The fp8 kernels' bytes per stage: 256 weight rows + 16 routes of 128 bytes, 3 deep.
        assert_eq!(c.smem_bytes(), 3 * (256 + 16) * 128 + 1024);
        assert_eq!(c.source().0, "moe_gemm_bf16_swapab_sm90");
        assert_eq!(
            c.defines(2),
            [
                ("MODE", "2".to_string()),
                ("ELEM_BF16", "1".to_string()),
                ("STAGES", "3".to_string()),
                ("BN", "16".to_string())
            ]
        );
        // Larger route blocks: the same source with BN; 64 and 128 hold one block per SM.
        let c128 = sm90_swapab(128, swapab_stages(128));
        assert_eq!(c128.smem_bytes(), 4 * (256 + 128) * 128 + 1024);
        assert_eq!(c128.defines(1)[3], ("BN", "128".to_string()));
        assert_eq!(sm90_swapab(32, 3).smem_bytes(), 3 * (256 + 32) * 128 + 1024);
        // Mixtral M = 1: 2 routes in 2 of the 8 + 2 blocks of 16.
        assert_eq!(swap_ab_blocks(16, 2, 8, 16 * 10), 2);
        // Mixtral GEMM2 at M = 1: 2 blocks × 16 N tiles, 14336 / 64 = 224 K steps, 132 SMs with
        // two blocks each: 8 splits fill one wave of 256 blocks with 28 K steps each.
        assert_eq!(
            swap_ab_splits(c.smem_bytes() as usize, 16, 32, 14336 / 64, 132),
            8
        );
        // Short reductions are never split.
        assert_eq!(swap_ab_splits(c.smem_bytes() as usize, 16, 2, 3, 132), 1);
        // DeepSeek-V3 GEMM2 at M = 512 (bf16, 7168 outputs = 28 N tiles, 32 K steps): 16-route
        // blocks keep the cost model's 4 splits, 32-route blocks (a grid of many waves) none; a
        // small grid of 32-route blocks is still split.
        let c32 = sm90_swapab(32, 3);
        assert_eq!(
            swap_ab_splits(c.smem_bytes() as usize, 16, 384 * 28, 32, 132),
            4
        );
        assert_eq!(
            swap_ab_splits(c32.smem_bytes() as usize, 32, 384 * 28, 32, 132),
            1
        );
        assert_eq!(
            swap_ab_splits(c32.smem_bytes() as usize, 32, 2 * 16, 224, 132),
            8
        );
    }

    #[test]
    fn route_rows_rule_wants_top_k_4_and_y32_past_l2() {
        let l2 = 50 << 20;
        // DeepSeek-V3 (top-8, K = 7168): y32 is 59 MB at M = 2048, 29 MB at 1024.
        assert!(route_rows_pay(2048, 8, 7168, l2));
        assert!(!route_rows_pay(1024, 8, 7168, l2));
        // Mixtral-8x7B (top-2): never, whatever y32's size.
        assert!(!route_rows_pay(16384, 2, 4096, l2));
        assert!(route_rows_pay(16384, ROUTE_ROWS_MIN_TOP_K, 4096, l2));
        // Forced: only where the kernel can, K % 8 == 0 and bf16/f32 out.
        let dims = (16, 2, 64);
        assert!(route_rows_chosen(
            Gemm2Sum::RouteRows,
            true,
            dims,
            DType::BF16,
            l2
        ));
        assert!(route_rows_chosen(
            Gemm2Sum::RouteRows,
            true,
            dims,
            DType::F32,
            l2
        ));
        assert!(!route_rows_chosen(
            Gemm2Sum::RouteRows,
            false,
            dims,
            DType::BF16,
            l2
        ));
        assert!(!route_rows_chosen(
            Gemm2Sum::RouteRows,
            true,
            dims,
            DType::F16,
            l2
        ));
        assert!(!route_rows_chosen(
            Gemm2Sum::RouteRows,
            true,
            (16, 2, 60),
            DType::BF16,
            l2
        ));
        assert!(!route_rows_chosen(
            Gemm2Sum::Atomic,
            true,
            dims,
            DType::BF16,
            l2
        ));
    }

    #[test]
    fn split_k_fills_the_gpu_within_its_cap() {
        // Decode: 2 routes over 8 experts, 32 N tiles: at most ceil(2/64) + min(8, 2) = 3 busy M
        // tiles → 96 blocks; 132 SMs want ceil(528 / 96) = 6 splits, capped by the reduction.
        assert_eq!(split_k(2, 8, 8 * 64, 64, 32, 100, 132), 6);
        assert_eq!(split_k(2, 8, 8 * 64, 64, 32, 4, 132), 4);
        // A grid that already holds four blocks per SM is not split.
        assert_eq!(split_k(65_536, 8, 65_536 + 8 * 64, 64, 32, 100, 132), 1);
        // The bf16 cap is one split per 8 reduction tiles, at least one.
        let cfg = SM90_SMALL;
        assert_eq!(cfg.splits(2, 8, 8 * 64, 32, 14_336, 132), 6); // cap (14336 / 64) / 8 = 28
        assert_eq!(cfg.splits(2, 8, 8 * 64, 32, 64, 132), 1);
    }

    #[test]
    fn aligned_routes_find_their_kernel() {
        for cfg in [SM90_SWAPAB, SM90_SMALL, SM90_LARGE] {
            assert_eq!(GemmConfig::for_block_m((9, 0), cfg.bm), Some(cfg));
        }
        assert_eq!(GemmConfig::for_block_m((8, 9), 64), Some(MMA));
        assert_eq!(GemmConfig::for_block_m((8, 9), 128), None);
        assert_eq!(GemmConfig::for_block_m((8, 9), 16), None);
        assert_eq!(
            GemmConfig::for_block_m((9, 0), 32),
            Some(sm90_swapab(32, 3))
        );
        assert_eq!(GemmConfig::for_block_m((9, 0), 48), None);
        assert_eq!(
            GemmConfig::for_routes((9, 0), 32, 20 * 8, 8),
            Some(sm90_swapab(32, 3))
        );
        // Decode routes aligned to 16 run swap-AB; a larger batch aligned to 16 does too.
        assert_eq!(GemmConfig::for_routes((9, 0), 16, 2, 8), Some(SM90_SWAPAB));
        assert_eq!(
            GemmConfig::for_routes((9, 0), 16, 1500, 8),
            Some(SM90_SWAPAB)
        );
        // Routes aligned to 64 rows run SM90_SMALL unless the rule picked SM90_MID (off here).
        assert_eq!(GemmConfig::for_routes((9, 0), 64, 2, 8), Some(SM90_SMALL));
        assert_eq!(
            GemmConfig::for_routes((9, 0), 64, 128 * 8, 8),
            Some(SM90_SMALL)
        );
        assert_eq!(
            GemmConfig::for_routes((9, 0), 64, 4096 * 8, 8),
            Some(SM90_SMALL)
        );
        assert_eq!(
            GemmConfig::for_routes((9, 0), 128, 4096 * 8, 8),
            Some(SM90_LARGE)
        );
        assert_eq!(GemmConfig::for_routes((8, 9), 64, 4096 * 8, 8), Some(MMA));
        // Shared memory stays within the 227 KiB a Hopper block may opt into.
        for cfg in [SM90_SWAPAB, SM90_SMALL, SM90_MID, SM90_LARGE, MMA] {
            assert!(cfg.smem_bytes() + 2048 <= 227 * 1024, "{cfg:?}");
        }
        for bn in super::super::SWAPAB_ROUTE_BLOCKS {
            let cfg = sm90_swapab(bn, swapab_stages(bn));
            assert!(cfg.smem_bytes() + 8192 <= 227 * 1024, "{cfg:?}");
        }
        // The dev experiments replace SM90_LARGE: same M tile, within the limit (static shared
        // memory of the warp-specialized kernel included), distinct names, "default" first.
        assert_eq!(SM90_LARGE_EXPERIMENTS[0], ("default", SM90_LARGE));
        for (i, (name, cfg)) in SM90_LARGE_EXPERIMENTS.iter().enumerate() {
            assert_eq!(cfg.bm, SM90_LARGE.bm, "{name}");
            assert!(cfg.smem_bytes() + 2048 <= 227 * 1024, "{name}");
            assert!(SM90_LARGE_EXPERIMENTS[..i].iter().all(|(n, _)| n != name));
        }
    }
}
