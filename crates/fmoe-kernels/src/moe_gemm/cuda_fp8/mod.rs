//! CUDA twin of `moe_gemm` for fp8 (e4m3) operands: Hopper only (wgmma, `sm_90a`).
//!
//! Kernels (launch recipes of `bench/gpu/moe_fp8_cupy.py`, which ran them on an H200):
//! - per-tensor scales, `cuda/moe_gemm_fp8_sm90.cu` (`fmoe_moe_gemm_fp8`): activations with one
//!   scale, weights with one scale per expert; MODE 1 = GEMM1 with SiLU⊙mul, h in bf16 plus the
//!   atomic amax of |h|; MODE 2 = GEMM2 with the routing weight and top-k sum (f32 vector atomics
//!   into a zeroed y, split-K allowed).
//! - 128×128 block scales, `cuda/moe_gemm_fp8_block_sm90.cu` (`fmoe_moe_gemm_fp8_block`): 1×128
//!   activation groups, DeepSeek-V3's weight blocks, promotion into f32 registers every 128-wide K
//!   block; MODE 1 fuses SiLU⊙mul and the 1×128 group quantization of h (codes and scales are the
//!   GEMM2 operand); MODE 2 as above.
//!
//! Variants ([`Fp8GemmConfig::select`], the bf16 rule of [`super::GemmConfig::select`]: large tiles
//! from [`LARGE_TILE_ROUTES_PER_EXPERT`](super::cuda::LARGE_TILE_ROUTES_PER_EXPERT) routes per
//! expert on average):
//! - per-tensor, small ([`FP8_TENSOR_SMALL`]): BM 64, WG_N 128, 4 stages, **PROMOTE=1** (the
//!   tensor-core sums of each 128-wide K tile are added into f32 registers: ~2e-4 relative GEMM
//!   error instead of ~2e-3, free while bandwidth-bound);
//! - per-tensor, large ([`FP8_TENSOR_LARGE`]): `cuda/moe_gemm_fp8_sm90_ws.cu`, 128 × 256 tiles,
//!   warp-specialized (one cp.async loader warpgroup gathering A by route with every stage of the
//!   4-deep mbarrier ring in flight, the weights through TMA, two wgmma warpgroups), persistent
//!   (one block per SM claiming tiles in grouped order from a global counter, the next tile's loads
//!   overlapping this tile's epilogue, as the bf16 prefill GEMM), unpromoted (the whole
//!   reduction stays in the tensor-core accumulator, ~2e-3 GEMM error). So per-tensor results differ
//!   slightly with the batch size (the variant changes at 64 routes per expert), by about that
//!   GEMM error, far below fp8's own ~6.5e-2;
//! - block, small ([`FP8_BLOCK_SCALED`]): `moe_gemm_fp8_block_sm90.cu`, BM 64, 256 weight rows,
//!   5 stages (always promoted);
//! - both schemes, few routes per expert (below [`SWAPAB_ROUTES_PER_EXPERT`] = 16 on average:
//!   decode) ([`FP8_TENSOR_SWAPAB`], [`FP8_BLOCK_SWAPAB`]): `moe_gemm_swapab_sm90.cu` (also bf16's
//!   [`SM90_SWAPAB`](super::SM90_SWAPAB)), "swap-AB":
//!   the weights are the wgmma M operand (64-row slabs of a 256-row tile through TMA, a 3-deep
//!   mbarrier ring fed by one loader warp, two blocks per SM) and the 16 routes of one expert's block its N
//!   (m64n16k32), promoted per 128-wide K tile (block scales per route column and weight row);
//!   same epilogues and outputs. Only the route blocks that can be busy are launched, and GEMM2's
//!   split-K evens the waves ([`Fp8GemmConfig::swap_ab_splits`]). Dev-only [`DEV_SWAPAB_ENV`]`=off`
//!   brings the 64-route kernels back there; from 16 to below [`SWAPAB_MID_ROUTES_PER_EXPERT`] = 25
//!   routes per expert the same kernels with 32-route blocks (m64n32k32; [`swapab_route_block`]),
//!   GEMM2 unsplit once its grid fills a wave; from 25 to below [`SWAPAB_WIDE_ROUTES_PER_EXPERT`]
//!   = 49 (block-scaled: [`SWAPAB_BLOCK_WIDE_ROUTES_PER_EXPERT`] = 57) with 64-route blocks, one
//!   block per SM, both GEMMs on a persistent grid claiming tiles from a counter
//!   ([`swapab_route_block_for`], [`swapab_persistent`], [`swapab_dynamic`]);
//! - block, large ([`FP8_BLOCK_LARGE`]): the warp-specialized source with `BLOCK_SCALED=1`, 128 ×
//!   256 tiles, promotion per 128-wide K block: each MMA warpgroup multiplies the tile's two
//!   128-row halves into a 64-register partial in turn, waits for and promotes each, and the two
//!   warpgroups take turns at issuing, so one's MMAs run while the other promotes (setmaxnreg 40 /
//!   232), A's group scales carried in the stage by the loaders. The other promotion schedules
//!   ([`FP8_BLOCK_LARGE_HALVES`]: unordered; [`FP8_BLOCK_LARGE_QUARTERS`]: 64-row quarters, each
//!   promoted while the next multiplies) give the same bits; on the H200 the ordered halves match
//!   or beat both (decision D-049). In both large variants a tile whose rows 64..
//!   are all padding is multiplied by one warpgroup ([`lone_warpgroup`]).
//!
//! H200 (decisions D-013, D-023): the large variants are 1.13-1.26×
//! (per-tensor) and 1.34-1.73× (block) faster than the kernels they replaced, at M = 1024-16384;
//! all stages in flight and the persistent grid added 1.03-1.13× (block) and up to 1.07×
//! (per-tensor) ("fp8 prefill GEMMs: every stage in flight"; ncu: bound by L2→SM traffic).
//! Dev-only [`DEV_FP8_LARGE_ENV`]`=sync` brings those back for comparison ([`FP8_TENSOR_SYNC`],
//! and [`FP8_BLOCK_SCALED`] at every size).
//!
//! Fused pipeline (what [`gemm1_quant`] and [`gemm2`] launch, the layer aligning routes with the
//! variant's `block_m` first):
//! - per-tensor: [x's amax, cast: the caller's `ActOperand::quantize_deferred`] → GEMM1 (bf16 h,
//!   amax of |h|) → cast of h with that amax (`quant_fp8.cu`, the one pass left) → GEMM2. The GPU
//!   requantizes the **bf16-rounded** h, while the CPU twin quantizes its f32 h: codes can differ
//!   by one step where bf16 rounding crosses a code boundary (within the tests' 1e-2).
//!   With a static scale for h (`ActScale::Static`, a static checkpoint's `input_scale`) GEMM1
//!   skips the amax atomics and the cast reads that device scalar instead
//!   (`fmoe_fp8_quant_tensor_static`); the portable path casts h the same way.
//! - block: [x's 1×128 group quantization] → GEMM1 (codes and scales of h, from f32 h, as the
//!   CPU twin) → GEMM2.
//!
//! Portable (unfused) pipeline, [`portable`]: the same kernels, no fusion, every intermediate in
//! device memory and each step a launch (as the bf16 portable path): align; gather the token rows
//! of the quantized a1 per route (codes, and for block scales their group scales); GEMM1 as a plain
//! grouped GEMM (MODE 2 with top_k = 1 and unit weights: one exact product per element into a
//! zeroed f32 [R, 2N]); SiLU⊙mul into bf16 (per-tensor, so h is rounded where the fused kernel
//! rounds it) or f32 (block) [R, N]; requantization of h with the quantization kernels
//! (amax + cast, or 1×128 groups); GEMM2 the same way into f32 [R, K]; the weighted top-k sum.
//! No host synchronization on either path.
//!
//! NaN/Inf in h (an overflow) sets the kernels' device flag, returned as a
//! [`FiniteCheck`] (no index: h is not kept).
//!
//! Contract (checked, naming the dimension): K and N multiples of 16 (16-byte rows of codes;
//! GEMM2's reduction length is N). Activations and weights must be fp8 of the same scheme
//! (per-tensor with per-tensor, 1×128 groups with 128×128 blocks).
//!
//! Files: this one has the public variants and their selection ([`Fp8GemmConfig`]); `support.rs`
//! decides which operands and devices the kernels take; `launch.rs` turns operands and aligned
//! routes into device buffers and launches one GEMM; `fused.rs` and `unfused.rs` are the two
//! pipelines above ([`gemm1_quant`], [`gemm1_h`], [`gemm2`]; [`portable`]).
//!
//! [`FiniteCheck`]: crate::quant_fp8::FiniteCheck

mod fused;
mod launch;
mod support;
mod unfused;

use super::cuda::{
    large_tile_routes_per_expert, swapab_routes_per_expert, swapab_wide_routes_per_expert,
};
use crate::catalog::KernelVariant;
use crate::dev::dev;
/// What [`DEV_FP8_LARGE_ENV`] asks for.
use fmoe_core::env::Fp8Large as DevLarge;
use fmoe_core::env::{Fp8Schemes, SwapAb};

pub(super) use fused::{gemm1_h, gemm1_quant, gemm2};
pub(super) use support::{check_support, is_fp8_act, is_fp8_weight};
pub(super) use unfused::portable;

/// Which fp8 scaling the operands use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Scheme {
    /// Activations: one scale; weights: one scale per expert (`moe_gemm_fp8_sm90.cu`).
    PerTensor,
    /// Activations: 1×128 groups; weights: 128×128 blocks (`moe_gemm_fp8_block_sm90.cu`).
    Block,
}

/// One fp8 grouped GEMM variant and its compile-time tunables (`-D` defines).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8GemmConfig {
    pub scheme: Fp8Scheme,
    /// M tile (routes per block) = `moe_align`'s `block_m`: 64 or 128 (per-tensor), 64 (block).
    pub bm: usize,
    /// Weight rows per block: wgmma N of the per-tensor kernel (`-D WG_N`, 128 or 256); the block
    /// kernel always reads 256 (two warpgroups of 128).
    pub wg_n: usize,
    /// cp.async ring depth (`-D STAGES`).
    pub stages: usize,
    /// Per-tensor: `-D PROMOTE` (WG_N 128 only). The block kernels always promote.
    pub promote: bool,
    /// The warp-specialized kernel (`moe_gemm_fp8_sm90_ws.cu`: 128 × 256 tiles, one loader
    /// warpgroup, weights through TMA, an mbarrier ring, a persistent grid of at most one block per
    /// SM) instead of the kernel of its scheme whose warpgroups all load and multiply.
    pub ws: bool,
    /// `ws` only: blocks take their tiles in groups of this many M blocks (`-D RASTER_GM`).
    pub raster_gm: usize,
    /// The swap-AB decode kernel (`moe_gemm_swapab_sm90.cu`): weights as the MMA's M operand
    /// (256 weight rows per block through TMA), the `bm` = 16 routes of one expert as its N.
    pub swap_ab: bool,
    /// Block-scaled `ws` only, how the promotion meets the MMAs (`-D PIPE_PROMOTE`): 0 = each
    /// warpgroup multiplies a 128-row half, waits and promotes it (tensor cores idle meanwhile
    /// unless the other warpgroup multiplies); p = 1, 2, 4 = 64-row quarters, each promoted while
    /// the next one multiplies, the wgmma pipe drained once per p K blocks. GEMM1 (MODE 1) only
    /// where [`Self::promote_pipe_gemm2`] differs.
    pub promote_pipe: usize,
    /// `promote_pipe` of GEMM2 (MODE 2): the two modes compile separately, so each can take the
    /// schedule that suits it.
    pub promote_pipe_gemm2: usize,
    /// Block-scaled `ws` only, for the modes on the halves (`promote_pipe` 0): the two MMA
    /// warpgroups take turns at issuing (`-D ORDER_MMA`), so one multiplies while the other promotes.
    pub order_mma: bool,
}

/// Per-tensor, decode-sized batches: promoted, 64 × 128 tiles.
pub const FP8_TENSOR_SMALL: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::PerTensor,
    bm: 64,
    wg_n: 128,
    stages: 4,
    promote: true,
    ws: false,
    raster_gm: 0,
    swap_ab: false,
    promote_pipe: 0,
    promote_pipe_gemm2: 0,
    order_mma: false,
};

/// Per-tensor, prefill-sized batches: unpromoted, 128 × 256 tiles, warp-specialized with TMA
/// weights, persistent (tiles claimed in grouped order from a counter).
pub const FP8_TENSOR_LARGE: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::PerTensor,
    bm: 128,
    wg_n: 256,
    stages: 4,
    promote: false,
    ws: true,
    raster_gm: 16,
    swap_ab: false,
    promote_pipe: 0,
    promote_pipe_gemm2: 0,
    order_mma: false,
};

/// The previous [`FP8_TENSOR_LARGE`]: `moe_gemm_fp8_sm90.cu` with 128 × 256 tiles (two warpgroups
/// that both load and multiply, a block barrier per K tile, launch order). Kept as the dev
/// experiment "sync" of [`DEV_FP8_LARGE_ENV`].
pub const FP8_TENSOR_SYNC: Fp8GemmConfig = Fp8GemmConfig {
    ws: false,
    raster_gm: 0,
    ..FP8_TENSOR_LARGE
};

/// Block-scaled, decode-sized batches: 64 × 256 tiles, 5 stages.
pub const FP8_BLOCK_SCALED: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::Block,
    bm: 64,
    wg_n: 256,
    stages: 5,
    promote: true,
    ws: false,
    raster_gm: 0,
    swap_ab: false,
    promote_pipe: 0,
    promote_pipe_gemm2: 0,
    order_mma: false,
};

/// Block-scaled, prefill-sized batches: 128 × 256 tiles, warp-specialized with TMA weights,
/// promoted per 128-wide K block in 128-row halves, each waited for and promoted, the two MMA
/// warpgroups taking turns at issuing so one multiplies while the other promotes (`-D ORDER_MMA`;
/// H200: 0.97-1.05× the quarters in GEMM1 / halves in GEMM2 it replaced, noise-level, with 6 %
/// fewer instructions, and 1.02-1.10× the unordered halves at M = 1536-16384, decision
/// D-049); persistent (tiles claimed in grouped order from a counter).
pub const FP8_BLOCK_LARGE: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::Block,
    bm: 128,
    wg_n: 256,
    stages: 4,
    promote: true,
    ws: true,
    raster_gm: 16,
    swap_ab: false,
    promote_pipe: 0,
    promote_pipe_gemm2: 0,
    order_mma: true,
};

/// [`FP8_BLOCK_LARGE`] with both warpgroups issuing at will: the halves' promotion before the
/// ordered issue. The dev experiment "promote-halves" of [`DEV_FP8_LARGE_ENV`].
pub const FP8_BLOCK_LARGE_HALVES: Fp8GemmConfig = Fp8GemmConfig {
    order_mma: false,
    ..FP8_BLOCK_LARGE
};

/// [`FP8_BLOCK_LARGE`] with 64-row quarters in both GEMMs, each promoted while the next one
/// multiplies (drained every 2 K blocks). The dev experiment "promote-drain2" of
/// [`DEV_FP8_LARGE_ENV`]; with GEMM2 on the unordered halves ("promote-gemm2-halves", whose two
/// CUBINs are this one's MODE 1 and the halves' MODE 2) it was the default before the ordered issue.
pub const FP8_BLOCK_LARGE_QUARTERS: Fp8GemmConfig = Fp8GemmConfig {
    promote_pipe: 2,
    promote_pipe_gemm2: 2,
    order_mma: false,
    ..FP8_BLOCK_LARGE
};

/// Per-tensor, few routes per expert (below [`SWAPAB_ROUTES_PER_EXPERT`] on average): swap-AB,
/// 256 weight rows × 16 routes per block, promoted per 128-wide K tile, a 3-deep TMA ring (103
/// KiB: two blocks per SM, 192 KiB of weights in flight per SM; on the H200 3 stages beat 4 and
/// 6, one block per SM, by 1-5 %, decision D-019).
pub const FP8_TENSOR_SWAPAB: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::PerTensor,
    bm: 16,
    wg_n: 256,
    stages: 3,
    promote: true,
    ws: false,
    raster_gm: 0,
    swap_ab: true,
    promote_pipe: 0,
    promote_pipe_gemm2: 0,
    order_mma: false,
};

/// Block-scaled, few routes per expert: the swap-AB kernel with `BLOCK_SCALED=1`.
pub const FP8_BLOCK_SWAPAB: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::Block,
    ..FP8_TENSOR_SWAPAB
};

/// Below this many routes per expert on average the swap-AB variants run with 16-route blocks
/// (one block per expert on average; with more, an expert's 16-route blocks each stream its
/// weights, through L2).
pub const SWAPAB_ROUTES_PER_EXPERT: usize = 16;

/// The swap-AB kernels' route blocks (wgmma N, `-D BN`, = `moe_align`'s `block_m`): 16, 32 and 64
/// run by the rule ([`swapab_route_block`]); 128 only through [`DEV_SWAPAB_BN_ENV`].
pub const SWAPAB_ROUTE_BLOCKS: [usize; 4] = [16, 32, 64, 128];

/// From [`SWAPAB_ROUTES_PER_EXPERT`] up to below this many routes per expert on average the
/// swap-AB variants run with 32-route blocks: up to about 25 a block holds an expert's mean + 1.5
/// standard deviations of routes (mean m, deviation about sqrt(m)), so nearly every expert streams
/// its weights once, two blocks per SM, GEMM2 unsplit. H200 (decisions D-032 and
/// D-033), against the 64-row tiles: DeepSeek-V3 at 16 routes per expert 1.06-1.13x faster, at
/// 24 1.01-1.08x, Mixtral-8x7B at 24 1.03-1.22x (every method); at 32 (about half the experts
/// need a second block) 1.06-1.17x slower; 64-route blocks take over from here
/// ([`SWAPAB_WIDE_ROUTES_PER_EXPERT`]).
pub const SWAPAB_MID_ROUTES_PER_EXPERT: usize = 25;

/// From the 32-route range's end ([`SWAPAB_MID_ROUTES_PER_EXPERT`]) up to below this many routes
/// per expert on average the swap-AB kernels run with 64-route blocks (one block per SM, a 5-deep
/// TMA ring, GEMM1 on the persistent grid, [`swapab_persistent`]) instead of the 64-row tiles, bf16
/// and per-tensor fp8 (block-scaled: [`SWAPAB_BLOCK_WIDE_ROUTES_PER_EXPERT`]). H200 (decisions
/// D-055, D-058): DeepSeek-V3 at 32 and 48 routes per expert 1.04-1.06x faster than the
/// tiles (bf16 and per-tensor); before GEMM1 was persistent they lost 1.01-1.03x at 32.
pub const SWAPAB_WIDE_ROUTES_PER_EXPERT: usize = 49;

/// [`SWAPAB_WIDE_ROUTES_PER_EXPERT`] for block-scaled fp8, whose 64-row tiles pay the per-K-block
/// promotion on the MMA warps' critical path while swap-AB's stream the weights through TMA with
/// the promotion under the loads. H200 (decisions D-036 and
/// D-058): 1.05-1.09x faster on DeepSeek-V3 at 28-48 routes per expert,
/// 1.15-1.17x on Mixtral-8x7B (a tie at 24, where the 32-route blocks stay), and with the
/// persistent GEMM1 1.03-1.05x at 56 on DeepSeek-V3; at 64 per expert 1.16-1.24x slower (second
/// blocks stream the weights again), so the range ends past 56.
pub const SWAPAB_BLOCK_WIDE_ROUTES_PER_EXPERT: usize = 57;

/// The swap-AB route block for `num_routes` routes over `experts` experts, or `None` where the
/// tile kernels run, for bf16 and per-tensor fp8 (block-scaled: [`swapab_route_block_for`]): 16
/// below [`SWAPAB_ROUTES_PER_EXPERT`] routes per expert on average, 32 below
/// [`SWAPAB_MID_ROUTES_PER_EXPERT`], 64 below [`SWAPAB_WIDE_ROUTES_PER_EXPERT`]. Dev knobs:
/// [`DEV_SWAPAB_ENV`]`=off` never, [`DEV_SWAPAB_BN_ENV`] forces the block,
/// `FMOE_DEV_SWAPAB_ROUTES` moves the 32-route range's end, `FMOE_DEV_SWAPAB_WIDE_ROUTES` the
/// 64-route one's (both schemes; ≤ the 32-route end: none).
pub fn swapab_route_block(num_routes: usize, experts: usize) -> Option<usize> {
    route_block_with_wide_end(num_routes, experts, SWAPAB_WIDE_ROUTES_PER_EXPERT)
}

/// [`swapab_route_block`] for an fp8 scheme: block-scaled batches take 64-route blocks up to
/// [`SWAPAB_BLOCK_WIDE_ROUTES_PER_EXPERT`].
pub fn swapab_route_block_for(
    scheme: Fp8Scheme,
    num_routes: usize,
    experts: usize,
) -> Option<usize> {
    let wide_end = match scheme {
        Fp8Scheme::Block => SWAPAB_BLOCK_WIDE_ROUTES_PER_EXPERT,
        Fp8Scheme::PerTensor => SWAPAB_WIDE_ROUTES_PER_EXPERT,
    };
    route_block_with_wide_end(num_routes, experts, wide_end)
}

fn route_block_with_wide_end(num_routes: usize, experts: usize, wide_end: usize) -> Option<usize> {
    dev_swapab()?;
    let experts = experts.max(1);
    let mid = swapab_routes_per_expert().unwrap_or(SWAPAB_MID_ROUTES_PER_EXPERT);
    let wide = swapab_wide_routes_per_expert().unwrap_or(wide_end);
    let bn = if num_routes < SWAPAB_ROUTES_PER_EXPERT * experts && num_routes < mid * experts {
        16
    } else if num_routes < mid * experts {
        32
    } else if num_routes < wide * experts {
        64
    } else {
        return None;
    };
    Some(dev_swapab_bn().unwrap_or(bn))
}

/// Threads of a swap-AB block with route block `bn`: two MMA warpgroups and one loader warp, a
/// loader warpgroup from 64 routes on (the source's `NTHREADS`).
pub const fn swapab_threads(bn: usize) -> u32 {
    if bn >= 64 { 384 } else { 288 }
}

/// Whether swap-AB launches of `mode` (1 = GEMM1, 2 = GEMM2) with route block `bn` walk their
/// tiles with one persistent block per SM (`-D PERSISTENT=1`, N tiles fastest): both GEMMs from 64
/// routes on, where one block fills an SM, so a block's ring would otherwise drain and refill at
/// every tile (its loader now runs into the next tile while the MMA warps finish this one), and
/// N tiles fastest read each route block's activations once (ncu, DeepSeek-V3 fp8-block M = 1536:
/// 8.3 → 7.8 GB from DRAM, GEMM1 2.00 → 1.88 ms). The tiles are claimed from a counter
/// ([`swapab_dynamic`]): with a static stride GEMM2 ran slower persistent than a block per tile
/// (1.38 → 1.40-1.52 ms), the slowest SM's share deciding; claimed, both GEMMs persistent beat
/// GEMM1 alone on DeepSeek-V3 by 1.5-6 % (decisions D-056, D-060).
/// Dev-only [`DEV_SWAPAB_PERSIST_ENV`] overrides.
pub fn swapab_persistent(bn: usize, mode: u32) -> bool {
    bn >= 64
        && match swapab_persist_mode() {
            PersistMode::Off => false,
            PersistMode::Gemm1 | PersistMode::DynamicGemm1 => mode == 1,
            PersistMode::NFastest | PersistMode::RouteBlocksFastest | PersistMode::Dynamic => true,
        }
}

/// Whether a persistent swap-AB launch of `mode` claims its tiles from a global counter
/// (`-D DYNAMIC=1`, as the warp-specialized prefill kernels do): the default, and
/// [`DEV_SWAPAB_PERSIST_ENV`]`=dyn|dyn1`; the strided schedule with `gemm1|on|rb`.
pub fn swapab_dynamic(bn: usize, mode: u32) -> bool {
    swapab_persistent(bn, mode)
        && matches!(
            swapab_persist_mode(),
            PersistMode::Dynamic | PersistMode::DynamicGemm1
        )
}

/// [`DEV_SWAPAB_PERSIST_ENV`]'s choice.
pub(in crate::moe_gemm) use fmoe_core::env::SwapAbPersist as PersistMode;

pub(in crate::moe_gemm) fn swapab_persist_mode() -> PersistMode {
    dev().swapab_persist
}

/// The persistent swap-AB defines of `mode` for route block `bn` (none below 64).
pub(in crate::moe_gemm) fn swapab_persist_defines(
    bn: usize,
    mode: u32,
) -> Vec<(&'static str, String)> {
    if bn < 64 {
        return vec![];
    }
    let persistent = swapab_persistent(bn, mode);
    let mut d = vec![("PERSISTENT", u32::from(persistent).to_string())];
    if persistent && swapab_persist_mode() == PersistMode::RouteBlocksFastest {
        d.push(("ROUTE_BLOCKS_FASTEST", "1".to_string()));
    }
    if swapab_dynamic(bn, mode) {
        d.push(("DYNAMIC", "1".to_string()));
    }
    d
}

/// Dev-only: `FMOE_DEV_SWAPAB_PERSIST=<dyn|dyn1|gemm1|on|off|rb>` = both GEMMs persistent claiming
/// tiles from a counter (the default), GEMM1 only claiming, persistent GEMM1 only with a static
/// stride (the previous default), both strided, neither (a block per tile), both strided with
/// route blocks fastest ([`swapab_persistent`], [`swapab_dynamic`];
/// read once per process; not a user setting).
pub const DEV_SWAPAB_PERSIST_ENV: &str = fmoe_core::env::FMOE_DEV_SWAPAB_PERSIST;

/// The swap-AB ring depth for route block `bn`: 3 x 32 KiB of weights at 16 and 32 routes (two
/// blocks per SM), as deep as shared memory allows with one block per SM at 64 (5) and 128 (4).
pub const fn swapab_stages(bn: usize) -> usize {
    match bn {
        0..=32 => 3,
        33..=64 => 5,
        _ => 4,
    }
}

/// Dev-only: `FMOE_DEV_SWAPAB=off` runs few-routes batches on the 64-route kernels the swap-AB
/// ones replaced, fp8 and bf16; a number sets the swap-AB ring depth of every route block (not a
/// catalog variant: compiled when used). Read once per process; not a user setting; "on" or unset
/// = the default.
pub const DEV_SWAPAB_ENV: &str = fmoe_core::env::FMOE_DEV_SWAPAB;

/// Dev-only: `FMOE_DEV_SWAPAB_BN=<16|32|64|128>` runs every swap-AB batch with that route block
/// (read once per process; not a user setting; an unknown value is reported and
/// ignored).
pub const DEV_SWAPAB_BN_ENV: &str = fmoe_core::env::FMOE_DEV_SWAPAB_BN;

/// [`DEV_SWAPAB_ENV`]: `None` = off, `Some(0)` = each route block's own depth
/// ([`swapab_stages`]), `Some(stages)` a forced depth (an unknown value is reported once on
/// stderr and ignored).
pub(in crate::moe_gemm) fn dev_swapab() -> Option<usize> {
    match dev().swapab {
        SwapAb::On => Some(0),
        SwapAb::Off => None,
        SwapAb::Stages(n) => Some(n),
    }
}

/// The swap-AB ring depth for route block `bn`: [`DEV_SWAPAB_ENV`]'s if it sets one.
pub(in crate::moe_gemm) fn swapab_stages_for(bn: usize) -> usize {
    match dev_swapab() {
        Some(n) if n > 0 => n,
        _ => swapab_stages(bn),
    }
}

fn dev_swapab_bn() -> Option<usize> {
    dev().swapab_bn
}

/// Dev-only: `FMOE_DEV_FP8_LARGE=sync` runs prefill-sized batches on the kernels the
/// warp-specialized ones replaced ([`FP8_TENSOR_SYNC`]; block-scaled: [`FP8_BLOCK_SCALED`], the
/// only block kernel before). The block-scaled warp-specialized kernel's promotion schedules
/// ([`Fp8GemmConfig::promote_pipe`], [`Fp8GemmConfig::order_mma`]): `promote-ordered` = the
/// default, `promote-halves` the halves issued at will in both GEMMs ([`FP8_BLOCK_LARGE_HALVES`]),
/// `promote-drain1|2|4` quarters in both GEMMs drained every 1, 2 or 4 K blocks (2:
/// [`FP8_BLOCK_LARGE_QUARTERS`]), `promote-gemm2-halves` quarters in GEMM1 and the halves in GEMM2
/// (the previous default), `promote-gemm2-ordered` the same with the ordered halves in GEMM2 (the
/// schedules outside the catalog are compiled when used), so one binary can time and test them all
/// (read once per process; not a user setting; "default" or unset = the kernels as selected).
pub const DEV_FP8_LARGE_ENV: &str = fmoe_core::env::FMOE_DEV_FP8_LARGE;

/// Dev-only: `FMOE_DEV_FP8_RASTER_GM=<n>` (1..=64) gives the warp-specialized fp8 kernels
/// groups of n M blocks in their tile order instead of [`FP8_TENSOR_LARGE`]'s and
/// [`FP8_BLOCK_LARGE`]'s 16 (compiled when used; read once per process; not a user setting).
/// `FMOE_DEV_FP8_RASTER_GM`.
fn dev_raster_gm() -> Option<usize> {
    dev().fp8_raster_gm
}

/// Whether the warp-specialized kernel of `scheme` lets its second MMA warpgroup skip a tile whose
/// rows 64.. are all padding (`-D SKIP_PAD_WG`: an expert's last block of at most 64 routes; the
/// first warpgroup multiplies it alone), both schemes: the block-scaled kernel's MMA warps bound
/// it, so half such a tile's multiplies and promotions go (H200, DeepSeek-V3 M = 2048-16384:
/// 1.02-1.05×; per-tensor 1.00-1.04×, decision D-059). Dev-only
/// `FMOE_DEV_FP8_LONE_WG=<all|tensor|block|off>` ([`DEV_FP8_LONE_WG_ENV`]) picks the schemes.
fn lone_warpgroup(scheme: Fp8Scheme) -> bool {
    covers(dev().fp8_lone_wg, scheme)
}

/// Whether the schemes of a dev knob (`all`, `tensor`, `block` or `off`) cover `scheme`.
fn covers(schemes: Fp8Schemes, scheme: Fp8Scheme) -> bool {
    match scheme {
        Fp8Scheme::PerTensor => schemes.tensor,
        Fp8Scheme::Block => schemes.block,
    }
}

/// Dev-only knob of `lone_warpgroup` (read once per process; not a user setting).
pub const DEV_FP8_LONE_WG_ENV: &str = fmoe_core::env::FMOE_DEV_FP8_LONE_WG;

/// Dev-only: `FMOE_DEV_FP8_PAIR=<all|tensor|block|off>` picks the schemes whose warp-specialized
/// kernels run in 2-block clusters ([`Fp8GemmConfig::pairs`]; default `tensor`), so one binary can
/// time them all (read once per process; not a user setting).
/// `FMOE_DEV_FP8_PAIR` for `scheme`.
fn dev_pair(scheme: Fp8Scheme) -> bool {
    covers(dev().fp8_pair, scheme)
}

/// [`DEV_FP8_LARGE_ENV`]'s promotion schedule `(gemm1, gemm2, ordered)`.
#[cfg(test)]
const fn promote(gemm1: usize, gemm2: usize, ordered: bool) -> DevLarge {
    DevLarge::Promote {
        gemm1,
        gemm2,
        ordered,
    }
}

/// [`DEV_FP8_LARGE_ENV`].
fn dev_large() -> DevLarge {
    dev().fp8_large
}

fn dev_sync() -> bool {
    dev_large() == DevLarge::Sync
}

/// `cfg` with the promotion [`DEV_FP8_LARGE_ENV`] asks for, when it is the block-scaled large one.
fn with_dev_promote(cfg: Fp8GemmConfig, dev: DevLarge) -> Fp8GemmConfig {
    match dev {
        DevLarge::Promote {
            gemm1,
            gemm2,
            ordered,
        } if cfg == FP8_BLOCK_LARGE => Fp8GemmConfig {
            promote_pipe: gemm1,
            promote_pipe_gemm2: gemm2,
            order_mma: ordered,
            ..cfg
        },
        _ => cfg,
    }
}

const TENSOR_FAMILY: &str = "moe_gemm_fp8_sm90";
const TENSOR_SRC: &str = include_str!("../../../cuda/moe_gemm_fp8_sm90.cu");
const TENSOR_ENTRY: &str = "fmoe_moe_gemm_fp8";
const BLOCK_FAMILY: &str = "moe_gemm_fp8_block_sm90";
const BLOCK_SRC: &str = include_str!("../../../cuda/moe_gemm_fp8_block_sm90.cu");
const BLOCK_ENTRY: &str = "fmoe_moe_gemm_fp8_block";
const WS_FAMILY: &str = "moe_gemm_fp8_sm90_ws";
const WS_SRC: &str = include_str!("../../../cuda/moe_gemm_fp8_sm90_ws.cu");
const SWAPAB_FAMILY: &str = "moe_gemm_fp8_swapab_sm90";
use super::cuda::SWAPAB_SRC;
/// K and N must be multiples of this (16-byte rows of e4m3 codes).
pub const FP8_K_MULTIPLE: usize = 16;

/// Every fp8 GEMM variant (both modes); the glue kernels are listed with the bf16 ones.
pub(super) const ALL: [Fp8GemmConfig; 15] = [
    FP8_TENSOR_SWAPAB,
    FP8_BLOCK_SWAPAB,
    Fp8GemmConfig::swap_ab(Fp8Scheme::PerTensor, 32, swapab_stages(32)),
    Fp8GemmConfig::swap_ab(Fp8Scheme::Block, 32, swapab_stages(32)),
    Fp8GemmConfig::swap_ab(Fp8Scheme::PerTensor, 64, swapab_stages(64)),
    Fp8GemmConfig::swap_ab(Fp8Scheme::Block, 64, swapab_stages(64)),
    Fp8GemmConfig::swap_ab(Fp8Scheme::PerTensor, 128, swapab_stages(128)),
    Fp8GemmConfig::swap_ab(Fp8Scheme::Block, 128, swapab_stages(128)),
    FP8_TENSOR_SMALL,
    FP8_TENSOR_LARGE,
    FP8_TENSOR_SYNC,
    FP8_BLOCK_SCALED,
    FP8_BLOCK_LARGE,
    FP8_BLOCK_LARGE_QUARTERS,
    FP8_BLOCK_LARGE_HALVES,
];

/// [`ALL`], both modes, as catalog entries (once each: the block-scaled large variants share
/// one mode's CUBIN pairwise, as their promotion is chosen per mode).
pub(super) fn variants() -> Vec<KernelVariant> {
    let mut v: Vec<KernelVariant> = Vec::new();
    // The warp-specialized kernels also walk one M block at a time (super::cuda::one_block_raster).
    let one_block =
        [FP8_TENSOR_LARGE, FP8_BLOCK_LARGE].map(|c| Fp8GemmConfig { raster_gm: 1, ..c });
    for cfg in ALL.into_iter().chain(one_block) {
        let (family, source, entry) = cfg.source();
        let mut all = vec![cfg.defines(1), cfg.defines(2)];
        // GEMM2 with per-route rows (fused::gemm2), the warp-specialized kernels only.
        if cfg.ws {
            let mut defines = cfg.defines(2);
            defines.push(super::cuda::route_rows_define());
            all.push(defines);
        }
        for defines in all {
            let kv = KernelVariant {
                family,
                source,
                entry,
                defines,
            };
            if !v.iter().any(|x| x.name() == kv.name()) {
                v.push(kv);
            }
        }
    }
    v
}

impl Fp8GemmConfig {
    /// The variant for `num_routes` routes over `experts` experts (see the module docs).
    pub fn select(scheme: Fp8Scheme, num_routes: usize, experts: usize) -> Fp8GemmConfig {
        if let Some(bn) = swapab_route_block_for(scheme, num_routes, experts) {
            return Self::swap_ab(scheme, bn, swapab_stages_for(bn));
        }
        let large = num_routes >= large_tile_routes_per_expert() * experts.max(1);
        let cfg = with_dev_promote(Self::select_with(scheme, large, dev_sync()), dev_large());
        match dev_raster_gm() {
            Some(raster_gm) if cfg.ws => Fp8GemmConfig { raster_gm, ..cfg },
            _ if cfg.ws && super::cuda::one_block_raster(num_routes, experts, cfg.bm) => {
                Fp8GemmConfig {
                    raster_gm: 1,
                    ..cfg
                }
            }
            _ => cfg,
        }
    }

    /// The swap-AB variant of `scheme` with route blocks of `bn` and a ring of `stages`.
    pub const fn swap_ab(scheme: Fp8Scheme, bn: usize, stages: usize) -> Fp8GemmConfig {
        let base = match scheme {
            Fp8Scheme::PerTensor => FP8_TENSOR_SWAPAB,
            Fp8Scheme::Block => FP8_BLOCK_SWAPAB,
        };
        Fp8GemmConfig {
            bm: bn,
            stages,
            ..base
        }
    }

    /// The variant that runs routes aligned to `block_m` for a batch of `num_routes` routes over
    /// `experts` experts: [`Self::select`]'s when its M tile matches (swap-AB's route blocks of 64
    /// and 128 share their `block_m` with the tile kernels), else [`Self::for_block_m`]'s.
    pub fn for_routes(
        scheme: Fp8Scheme,
        block_m: usize,
        num_routes: usize,
        experts: usize,
    ) -> Option<Fp8GemmConfig> {
        let picked = Self::select(scheme, num_routes, experts);
        if picked.bm == block_m {
            return Some(picked);
        }
        Self::for_block_m(scheme, block_m)
    }

    /// [`Self::select`] once the batch size is judged (`large`), with `sync` =
    /// [`DEV_FP8_LARGE_ENV`] asking for the previous large-batch kernels.
    const fn select_with(scheme: Fp8Scheme, large: bool, sync: bool) -> Fp8GemmConfig {
        match (scheme, large, sync) {
            (Fp8Scheme::PerTensor, false, _) => FP8_TENSOR_SMALL,
            (Fp8Scheme::PerTensor, true, false) => FP8_TENSOR_LARGE,
            (Fp8Scheme::PerTensor, true, true) => FP8_TENSOR_SYNC,
            (Fp8Scheme::Block, true, false) => FP8_BLOCK_LARGE,
            (Fp8Scheme::Block, _, _) => FP8_BLOCK_SCALED,
        }
    }

    /// The variant of `scheme` that consumes routes aligned to `block_m` (16 and 32: swap-AB;
    /// per-tensor 128: the one [`DEV_FP8_LARGE_ENV`] picks).
    pub fn for_block_m(scheme: Fp8Scheme, block_m: usize) -> Option<Fp8GemmConfig> {
        let stages = swapab_stages_for(block_m);
        Self::for_block_m_with(scheme, block_m, dev_sync(), stages)
            .map(|c| with_dev_promote(c, dev_large()))
    }

    fn for_block_m_with(
        scheme: Fp8Scheme,
        block_m: usize,
        sync: bool,
        swapab_stages: usize,
    ) -> Option<Fp8GemmConfig> {
        let tensor_large = Self::select_with(Fp8Scheme::PerTensor, true, sync);
        [
            Self::swap_ab(Fp8Scheme::PerTensor, 16, swapab_stages),
            Self::swap_ab(Fp8Scheme::Block, 16, swapab_stages),
            Self::swap_ab(Fp8Scheme::PerTensor, 32, swapab_stages),
            Self::swap_ab(Fp8Scheme::Block, 32, swapab_stages),
            FP8_TENSOR_SMALL,
            tensor_large,
            FP8_BLOCK_SCALED,
            FP8_BLOCK_LARGE,
        ]
        .into_iter()
        .find(|c| c.scheme == scheme && c.bm == block_m)
    }

    /// Output columns per block: MODE 1 pairs gate with up rows (half the weight rows), MODE 2
    /// writes one column per weight row.
    pub const fn n_tile(&self, mode: u32) -> usize {
        if self.swap_ab {
            return if mode == 1 { 128 } else { 256 };
        }
        match (self.scheme, mode) {
            (Fp8Scheme::PerTensor, 1) => self.wg_n / 2,
            (Fp8Scheme::PerTensor, _) => self.wg_n,
            (Fp8Scheme::Block, 1) => 128,
            (Fp8Scheme::Block, _) => 256,
        }
    }

    pub const fn threads(&self) -> u32 {
        if self.swap_ab {
            return swapab_threads(self.bm);
        }
        match (self.ws, self.scheme) {
            (true, _) => 384,
            (false, Fp8Scheme::PerTensor) => (self.bm / 64 * 128) as u32,
            (false, Fp8Scheme::Block) => 256,
        }
    }

    /// Whether the launch runs in 2-block clusters (`-D CLUSTER=2`): the two M blocks of a pair
    /// share the weight tile by TMA multicast when they are one expert's, so a block reads 32 KB
    /// per K step from L2 instead of 48. Per-tensor, warp-specialized, and not walking one M block
    /// at a time (there every expert fits one block and no pair would share). H200 (decision
    /// D-077), per-tensor: Mixtral-8x7B M = 1024-16384 1.01-1.04× in two calls (a
    /// third less L2 traffic; GEMM1 ran at a higher clock under the power cap), DeepSeek-V3 a tie;
    /// block-scaled 0.94-1.02× (its MMA warps bound it, and the pair's rings move in step), so it
    /// stays solo (`FMOE_DEV_FP8_PAIR` overrides).
    pub(super) fn pairs(&self) -> bool {
        self.ws && self.raster_gm > 1 && dev_pair(self.scheme)
    }

    /// Dynamic shared memory per block (the sources' formulas).
    pub const fn smem_bytes(&self) -> u32 {
        if self.swap_ab {
            return (self.stages * (256 + self.bm) * 128 + 1024) as u32;
        }
        (match (self.ws, self.scheme) {
            (true, _) => self.stages * (128 + 256) * 128 + 1024,
            (false, Fp8Scheme::PerTensor) => self.stages * (self.bm + self.wg_n) * 128 + 1024,
            (false, Fp8Scheme::Block) => self.stages * (64 + 256) * 128 + 1024,
        }) as u32
    }

    /// (family, source, entry). The warp-specialized source has both schemes' entry points.
    fn source(&self) -> (&'static str, &'static str, &'static str) {
        if self.swap_ab {
            let entry = match self.scheme {
                Fp8Scheme::PerTensor => TENSOR_ENTRY,
                Fp8Scheme::Block => BLOCK_ENTRY,
            };
            return (SWAPAB_FAMILY, SWAPAB_SRC, entry);
        }
        match (self.ws, self.scheme) {
            (true, Fp8Scheme::PerTensor) => (WS_FAMILY, WS_SRC, TENSOR_ENTRY),
            (true, Fp8Scheme::Block) => (WS_FAMILY, WS_SRC, BLOCK_ENTRY),
            (false, Fp8Scheme::PerTensor) => (TENSOR_FAMILY, TENSOR_SRC, TENSOR_ENTRY),
            (false, Fp8Scheme::Block) => (BLOCK_FAMILY, BLOCK_SRC, BLOCK_ENTRY),
        }
    }

    fn defines(&self, mode: u32) -> Vec<(&'static str, String)> {
        let mut d = vec![("MODE", mode.to_string())];
        if self.swap_ab {
            let block = u32::from(self.scheme == Fp8Scheme::Block);
            d.push(("BLOCK_SCALED", block.to_string()));
            d.push(("STAGES", self.stages.to_string()));
            d.push(("BN", self.bm.to_string()));
            d.extend(swapab_persist_defines(self.bm, mode));
            return d;
        }
        if self.ws {
            let block = u32::from(self.scheme == Fp8Scheme::Block);
            d.push(("BLOCK_SCALED", block.to_string()));
            d.push(("STAGES", self.stages.to_string()));
            d.push(("RASTER_GM", self.raster_gm.to_string()));
            let pipe = if mode == 2 {
                self.promote_pipe_gemm2
            } else {
                self.promote_pipe
            };
            if pipe > 0 {
                d.push(("PIPE_PROMOTE", pipe.to_string()));
            } else if self.order_mma && block == 1 {
                d.push(("ORDER_MMA", "1".to_string()));
            }
            if pipe == 0 && lone_warpgroup(self.scheme) {
                d.push(("SKIP_PAD_WG", "1".to_string()));
            }
            if self.pairs() {
                d.push(("CLUSTER", "2".to_string()));
            }
            return d;
        }
        if self.scheme == Fp8Scheme::PerTensor {
            d.push(("WG_N", self.wg_n.to_string()));
        }
        d.push(("STAGES", self.stages.to_string()));
        if self.scheme == Fp8Scheme::PerTensor {
            d.push(("BM", self.bm.to_string()));
            d.push(("PROMOTE", u32::from(self.promote).to_string()));
        }
        d
    }

    /// GEMM2's split-K factor (the harness's `splits_for`): enough splits for about four blocks
    /// per SM, each split at least 4 K tiles of 128.
    pub fn splits(
        &self,
        num_routes: usize,
        experts: usize,
        slots: usize,
        n_tiles: usize,
        kd: usize,
        sms: usize,
    ) -> usize {
        // Each split at least 4 K tiles of 128.
        let max_splits = ((kd / 128) / 4).max(1);
        super::cuda::split_k(
            num_routes, experts, slots, self.bm, n_tiles, max_splits, sms,
        )
    }

    /// Route blocks a swap-AB launch covers: the busy ones are at most ceil(routes / bm) plus one
    /// partial block per expert with routes, so decode launches no blocks that would only exit
    /// (DeepSeek-V3 at M = 1: 8 instead of 240).
    pub fn swap_ab_blocks(&self, num_routes: usize, experts: usize, slots: usize) -> usize {
        super::cuda::swap_ab_blocks(self.bm, num_routes, experts, slots)
    }

    /// Swap-AB GEMM2's split-K factor for `ctas` blocks (route blocks × N tiles) before splitting:
    /// the one (≤ a quarter of the K tiles) that minimizes waves × K tiles per block over `sms` SMs with as many blocks per SM as shared memory holds, the
    /// fewest splits on a tie (fewer partial sums into y).
    pub fn swap_ab_splits(&self, ctas: usize, kd: usize, sms: usize) -> usize {
        super::cuda::swap_ab_splits(
            self.smem_bytes() as usize,
            self.bm,
            ctas,
            kd.div_ceil(128),
            sms,
        )
    }
}

#[cfg(test)]
mod tests {
    use fmoe_core::{DType, Device, Tensor};

    use super::support::{check_arch, check_dims, pair_scheme};
    use super::*;
    use crate::moe_gemm::{ActQuant, WeightOperand};

    #[test]
    fn variants_follow_the_kernel_authors_recipes() {
        assert_eq!(
            (
                FP8_TENSOR_SMALL.n_tile(1),
                FP8_TENSOR_SMALL.n_tile(2),
                FP8_TENSOR_SMALL.threads()
            ),
            (64, 128, 128)
        );
        assert_eq!(FP8_TENSOR_SMALL.smem_bytes(), 4 * (64 + 128) * 128 + 1024);
        assert_eq!(
            (
                FP8_TENSOR_LARGE.n_tile(1),
                FP8_TENSOR_LARGE.n_tile(2),
                FP8_TENSOR_LARGE.threads()
            ),
            (128, 256, 384)
        );
        assert_eq!(FP8_TENSOR_LARGE.smem_bytes(), 4 * (128 + 256) * 128 + 1024);
        assert_eq!(
            (
                FP8_TENSOR_SYNC.n_tile(1),
                FP8_TENSOR_SYNC.n_tile(2),
                FP8_TENSOR_SYNC.threads(),
                FP8_TENSOR_SYNC.smem_bytes()
            ),
            (128, 256, 256, 4 * (128 + 256) * 128 + 1024)
        );
        // The warp-specialized kernels: one loader + two MMA warpgroups, 128 × 256 tiles.
        assert_eq!(FP8_TENSOR_LARGE.threads(), 384);
        assert_eq!(
            (
                FP8_BLOCK_LARGE.n_tile(1),
                FP8_BLOCK_LARGE.n_tile(2),
                FP8_BLOCK_LARGE.threads(),
                FP8_BLOCK_LARGE.smem_bytes()
            ),
            (128, 256, 384, 4 * (128 + 256) * 128 + 1024)
        );
        assert_eq!(
            (
                FP8_BLOCK_SCALED.n_tile(1),
                FP8_BLOCK_SCALED.n_tile(2),
                FP8_BLOCK_SCALED.threads()
            ),
            (128, 256, 256)
        );
        assert_eq!(FP8_BLOCK_SCALED.smem_bytes(), 5 * 40_960 + 1024);
        for c in ALL {
            assert!(c.smem_bytes() <= 227 * 1024, "{c:?}");
            assert!(!c.promote || c.scheme == Fp8Scheme::Block || c.wg_n == 128 || c.swap_ab);
            // Swap-AB: 16-128-route blocks of 256 weight rows, no other kernel's flags.
            assert!(
                !c.swap_ab || (SWAPAB_ROUTE_BLOCKS.contains(&c.bm) && c.wg_n == 256 && !c.ws),
                "{c:?}"
            );
            // Warp-specialized: 128 × 256 tiles only.
            assert!(!c.ws || (c.bm, c.wg_n) == (128, 256), "{c:?}");
        }
        let mut want = vec![
            ("MODE", "1".to_string()),
            ("BLOCK_SCALED", "1".to_string()),
            ("STAGES", "4".to_string()),
            ("RASTER_GM", "16".to_string()),
            ("ORDER_MMA", "1".to_string()),
        ];
        // The lone warpgroup (default on, both schemes) on the halves, never on the quarters.
        let lone = ("SKIP_PAD_WG", "1".to_string());
        if lone_warpgroup(Fp8Scheme::Block) {
            want.push(lone.clone());
        }
        assert_eq!(FP8_BLOCK_LARGE.defines(1), want);
        assert!(!FP8_BLOCK_LARGE_QUARTERS.defines(1).contains(&lone));
        assert_eq!(
            FP8_TENSOR_LARGE.defines(2).contains(&lone),
            lone_warpgroup(Fp8Scheme::PerTensor)
        );
        // The default: the ordered halves in both GEMMs; the unordered halves and the quarters
        // stay catalog variants (the previous default's two CUBINs are among theirs).
        assert_eq!(
            FP8_BLOCK_LARGE.defines(2)[4],
            ("ORDER_MMA", "1".to_string())
        );
        assert_eq!(
            FP8_BLOCK_LARGE_QUARTERS.defines(1)[4],
            ("PIPE_PROMOTE", "2".to_string())
        );
        assert_eq!(
            FP8_BLOCK_LARGE_QUARTERS.defines(2)[4],
            ("PIPE_PROMOTE", "2".to_string())
        );
        // Ordering applies to the halves only: a quarters mode ignores it.
        assert_eq!(
            with_dev_promote(FP8_BLOCK_LARGE, promote(2, 0, true)).defines(1),
            FP8_BLOCK_LARGE_QUARTERS.defines(1)
        );
        let names: Vec<String> = variants().iter().map(KernelVariant::name).collect();
        let unique: std::collections::BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "duplicate catalog entries");
        for cfg in [
            FP8_BLOCK_LARGE,
            FP8_BLOCK_LARGE_QUARTERS,
            FP8_BLOCK_LARGE_HALVES,
        ] {
            let (family, source, entry) = cfg.source();
            for mode in [1, 2] {
                let v = KernelVariant {
                    family,
                    source,
                    entry,
                    defines: cfg.defines(mode),
                };
                assert!(
                    names.contains(&v.name()),
                    "{cfg:?} MODE {mode} not in the catalog"
                );
            }
        }
        // 3 block-scaled large schedules, and the default one walking one M block at a time, x (2
        // modes + GEMM2 with per-route rows): 12 CUBINs.
        let ws_block = names
            .iter()
            .filter(|n| n.starts_with(&format!("{WS_FAMILY}/{BLOCK_ENTRY}[")))
            .count();
        assert_eq!(ws_block, 12);
        // The unordered halves: the same source without either schedule define.
        assert_eq!(
            FP8_BLOCK_LARGE_HALVES.defines(2)[..4],
            [
                ("MODE", "2".to_string()),
                ("BLOCK_SCALED", "1".to_string()),
                ("STAGES", "4".to_string()),
                ("RASTER_GM", "16".to_string())
            ]
        );
        assert_eq!(
            FP8_BLOCK_LARGE_HALVES.defines(2).len(),
            4 + usize::from(lone_warpgroup(Fp8Scheme::Block))
        );
        for c in ALL {
            // Only the block-scaled warp-specialized kernel pipelines its promotion.
            assert!(
                c.promote_pipe + c.promote_pipe_gemm2 == 0
                    || (c.ws && c.scheme == Fp8Scheme::Block),
                "{c:?}"
            );
        }
        assert_eq!(FP8_TENSOR_LARGE.source().2, FP8_TENSOR_SYNC.source().2);
        assert_eq!(FP8_BLOCK_LARGE.source().2, FP8_BLOCK_SCALED.source().2);
        assert_eq!(FP8_TENSOR_LARGE.source().0, FP8_BLOCK_LARGE.source().0);
        assert_eq!(
            FP8_TENSOR_SMALL.defines(1),
            [
                ("MODE", "1".to_string()),
                ("WG_N", "128".to_string()),
                ("STAGES", "4".to_string()),
                ("BM", "64".to_string()),
                ("PROMOTE", "1".to_string())
            ]
        );
        assert_eq!(
            FP8_BLOCK_SCALED.defines(2),
            [("MODE", "2".to_string()), ("STAGES", "5".to_string())]
        );
    }

    #[test]
    fn swap_ab_variants_and_their_grid() {
        for c in [FP8_TENSOR_SWAPAB, FP8_BLOCK_SWAPAB] {
            assert_eq!((c.n_tile(1), c.n_tile(2), c.threads()), (128, 256, 288));
            assert_eq!(c.smem_bytes(), 3 * (256 + 16) * 128 + 1024);
            assert_eq!(c.source().0, SWAPAB_FAMILY);
        }
        assert_eq!(FP8_TENSOR_SWAPAB.source().2, TENSOR_ENTRY);
        assert_eq!(FP8_BLOCK_SWAPAB.source().2, BLOCK_ENTRY);
        assert_eq!(
            FP8_BLOCK_SWAPAB.defines(2),
            [
                ("MODE", "2".to_string()),
                ("BLOCK_SCALED", "1".to_string()),
                ("STAGES", "3".to_string()),
                ("BN", "16".to_string())
            ]
        );
        // 32-route blocks: two blocks per SM still (2 x 110 KiB + static shared memory).
        let c32 = Fp8GemmConfig::swap_ab(Fp8Scheme::PerTensor, 32, swapab_stages(32));
        assert_eq!(c32.smem_bytes(), 3 * (256 + 32) * 128 + 1024);
        assert!(2 * (c32.smem_bytes() + 2048 + 1024) <= 228 * 1024);
        assert_eq!(c32.defines(1)[3], ("BN", "32".to_string()));
        let c64 = Fp8GemmConfig::swap_ab(Fp8Scheme::Block, 64, swapab_stages(64));
        assert_eq!(c64.smem_bytes(), 5 * (256 + 64) * 128 + 1024);
        // From 64 routes a loader warpgroup: 384 threads.
        assert_eq!((c32.threads(), c64.threads()), (288, 384));
        let c = FP8_TENSOR_SWAPAB;
        // DeepSeek-V3 decode, M = 1: 8 routes on 8 of 256 experts, 8 + 256 · 15 slots.
        assert_eq!(c.swap_ab_blocks(8, 256, 8 + 256 * 15), 8);
        // 64 routes, 8 experts: at most 4 full blocks + one partial per expert.
        assert_eq!(c.swap_ab_blocks(64, 8, 1024), 12);
        // Never more than the slots hold.
        assert_eq!(c.swap_ab_blocks(3, 8, 16), 1);
        // Mixtral GEMM2 at M = 1: 2 blocks × 16 N tiles, 112 K tiles, 132 SMs with two blocks
        // each (103 KiB): 8 splits fill one wave of 256 blocks with 14 K tiles each.
        assert_eq!(c.swap_ab_splits(32, 14336, 132), 8);
        // Short reductions are never split.
        assert_eq!(c.swap_ab_splits(2, 256, 132), 1);
        // Whole waves already: splitting only adds partial sums; a ragged last wave is evened.
        assert_eq!(c.swap_ab_splits(8 * 132, 2048, 132), 1);
        assert_eq!(c.swap_ab_splits(300, 2048, 132), 4);
    }

    /// 2-block clusters: per-tensor prefill tiles in the grouped order only (the dev knob unset):
    /// not block-scaled, not the one-block order (no pair would share), not the other kernels; and
    /// the define follows.
    #[test]
    fn pairs_for_grouped_per_tensor_prefill_tiles_only() {
        if dev().value_of(fmoe_core::env::FMOE_DEV_FP8_PAIR).is_some() {
            return; // the rule under test is the default
        }
        let one_block = Fp8GemmConfig {
            raster_gm: 1,
            ..FP8_TENSOR_LARGE
        };
        assert!(FP8_TENSOR_LARGE.pairs());
        for c in [
            FP8_BLOCK_LARGE,
            one_block,
            FP8_TENSOR_SMALL,
            FP8_TENSOR_SYNC,
            FP8_TENSOR_SWAPAB,
        ] {
            assert!(!c.pairs(), "{c:?}");
        }
        let cluster = |c: Fp8GemmConfig| c.defines(1).contains(&("CLUSTER", "2".to_string()));
        assert!(cluster(FP8_TENSOR_LARGE));
        assert!(!cluster(FP8_BLOCK_LARGE) && !cluster(one_block));
    }

    #[test]
    fn selection_uses_the_bf16_rule_and_block_m_finds_the_variant() {
        use Fp8Scheme::*;
        // Few routes per expert: swap-AB (the default of the dev switch).
        assert_eq!(Fp8GemmConfig::select(PerTensor, 2, 8), FP8_TENSOR_SWAPAB);
        assert_eq!(Fp8GemmConfig::select(Block, 8, 256), FP8_BLOCK_SWAPAB);
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 16 * 8 - 1, 8),
            FP8_TENSOR_SWAPAB
        );
        // 16 to 25 routes per expert: 32-route blocks; from 25 the 64-row tiles.
        let swap32 = |scheme| Fp8GemmConfig::swap_ab(scheme, 32, 3);
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 16 * 8, 8),
            swap32(PerTensor)
        );
        assert_eq!(Fp8GemmConfig::select(Block, 16 * 8, 8), swap32(Block));
        assert_eq!(Fp8GemmConfig::select(Block, 512 * 8, 256), swap32(Block)); // DeepSeek-V3
        assert_eq!(Fp8GemmConfig::select(Block, 25 * 8 - 1, 8), swap32(Block));
        // 64-route swap-AB blocks from 25 to the wide range's end (per-tensor 49, block-scaled
        // 57), then tiles.
        let swap64t = Fp8GemmConfig::swap_ab(PerTensor, 64, swapab_stages(64));
        assert_eq!(Fp8GemmConfig::select(PerTensor, 25 * 8, 8), swap64t);
        let tw = SWAPAB_WIDE_ROUTES_PER_EXPERT;
        assert_eq!(Fp8GemmConfig::select(PerTensor, tw * 8 - 1, 8), swap64t);
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, tw * 8, 8),
            FP8_TENSOR_SMALL
        );
        let wide = SWAPAB_BLOCK_WIDE_ROUTES_PER_EXPERT;
        assert!(wide > tw);
        let swap64 = Fp8GemmConfig::swap_ab(Block, 64, swapab_stages(64));
        assert!(
            wide > SWAPAB_MID_ROUTES_PER_EXPERT
                && wide <= super::super::LARGE_TILE_ROUTES_PER_EXPERT
        );
        assert_eq!(Fp8GemmConfig::select(Block, 25 * 8, 8), swap64);
        assert_eq!(Fp8GemmConfig::select(Block, wide * 8 - 1, 8), swap64);
        assert_eq!(Fp8GemmConfig::select(Block, wide * 8, 8), FP8_BLOCK_SCALED);
        assert_eq!(Fp8GemmConfig::select(Block, 25 * 256, 256), swap64); // DeepSeek-V3
        assert_eq!(
            Fp8GemmConfig::select(Block, wide * 256, 256),
            FP8_BLOCK_SCALED
        );
        assert_eq!(swapab_route_block(25 * 8, 8), Some(64));
        assert_eq!(swapab_route_block(tw * 8, 8), None);
        assert_eq!(swapab_route_block_for(PerTensor, 25 * 8, 8), Some(64));
        assert_eq!(swapab_route_block_for(PerTensor, tw * 8, 8), None);
        assert_eq!(swapab_route_block_for(Block, tw * 8, 8), Some(64));
        assert_eq!(swapab_route_block_for(Block, 25 * 8, 8), Some(64));
        assert_eq!(swapab_route_block_for(Block, 24 * 8, 8), Some(32));
        assert_eq!(
            Fp8GemmConfig::for_routes(Block, 64, 25 * 8, 8),
            Some(swap64)
        );
        assert_eq!(Fp8GemmConfig::for_block_m(Block, 32), Some(swap32(Block)));
        // Routes aligned to 64 with a batch the rule gives the tiles: the tiles.
        assert_eq!(
            Fp8GemmConfig::for_routes(Block, 64, wide * 8, 8),
            Some(FP8_BLOCK_SCALED)
        );
        assert_eq!(
            Fp8GemmConfig::for_routes(PerTensor, 64, 25 * 8, 8),
            Some(swap64t)
        );
        assert_eq!(
            Fp8GemmConfig::for_routes(PerTensor, 64, tw * 8, 8),
            Some(FP8_TENSOR_SMALL)
        );
        assert_eq!(
            Fp8GemmConfig::for_routes(PerTensor, 32, 20 * 8, 8),
            Some(swap32(PerTensor))
        );
        assert_eq!(
            Fp8GemmConfig::for_block_m(PerTensor, 16),
            Some(FP8_TENSOR_SWAPAB)
        );
        assert_eq!(
            Fp8GemmConfig::for_block_m(Block, 16),
            Some(FP8_BLOCK_SWAPAB)
        );
        assert_eq!(
            Fp8GemmConfig::for_block_m_with(Block, 16, false, 6),
            Some(Fp8GemmConfig {
                stages: 6,
                ..FP8_BLOCK_SWAPAB
            })
        );
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 63 * 8, 8),
            FP8_TENSOR_SMALL
        );
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 64 * 8, 8),
            FP8_TENSOR_LARGE
        );
        // DeepSeek-V3 at M = 4096: one 128-row block per expert, so one M block at a time; at 8192
        // the grouped order.
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 4096 * 8, 256),
            Fp8GemmConfig {
                raster_gm: 1,
                ..FP8_TENSOR_LARGE
            }
        );
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 4096 * 8 + 1, 256),
            FP8_TENSOR_LARGE
        );
        assert_eq!(Fp8GemmConfig::select(Block, 4096 * 8, 256).raster_gm, 1);
        assert_eq!(Fp8GemmConfig::select(Block, 1 << 20, 8), FP8_BLOCK_LARGE);
        assert_eq!(Fp8GemmConfig::select(Block, 63 * 8, 8), FP8_BLOCK_SCALED);
        assert_eq!(Fp8GemmConfig::select(Block, 64 * 8, 8), FP8_BLOCK_LARGE);
        // The dev experiment "sync": the kernels before the warp-specialized ones.
        assert_eq!(
            Fp8GemmConfig::select_with(PerTensor, true, true),
            FP8_TENSOR_SYNC
        );
        assert_eq!(
            Fp8GemmConfig::select_with(Block, true, true),
            FP8_BLOCK_SCALED
        );
        assert_eq!(
            Fp8GemmConfig::select_with(PerTensor, false, true),
            FP8_TENSOR_SMALL
        );
        assert_eq!(
            Fp8GemmConfig::for_block_m_with(PerTensor, 128, true, 4),
            Some(FP8_TENSOR_SYNC)
        );
        assert_eq!(
            Fp8GemmConfig::for_block_m(PerTensor, 64),
            Some(FP8_TENSOR_SMALL)
        );
        assert_eq!(
            Fp8GemmConfig::for_block_m(PerTensor, 128),
            Some(FP8_TENSOR_LARGE)
        );
        assert_eq!(
            Fp8GemmConfig::for_block_m(Block, 64),
            Some(FP8_BLOCK_SCALED)
        );
        assert_eq!(
            Fp8GemmConfig::for_block_m(Block, 128),
            Some(FP8_BLOCK_LARGE)
        );
        assert_eq!(Fp8GemmConfig::for_block_m(Block, 48), None);
        // The dev promotions replace only the block-scaled large kernel.
        assert_eq!(
            with_dev_promote(FP8_BLOCK_LARGE, promote(0, 0, false)),
            FP8_BLOCK_LARGE_HALVES
        );
        assert_eq!(
            with_dev_promote(FP8_BLOCK_LARGE, promote(4, 4, false)).defines(2)[4],
            ("PIPE_PROMOTE", "4".to_string())
        );
        assert_eq!(
            with_dev_promote(FP8_BLOCK_LARGE, promote(0, 0, true)),
            FP8_BLOCK_LARGE
        );
        assert_eq!(
            with_dev_promote(FP8_BLOCK_LARGE, promote(2, 0, false)).defines(2),
            FP8_BLOCK_LARGE_HALVES.defines(2)
        );
        assert_eq!(
            with_dev_promote(FP8_BLOCK_LARGE, promote(2, 2, false)),
            FP8_BLOCK_LARGE_QUARTERS
        );
        assert_eq!(
            with_dev_promote(FP8_TENSOR_LARGE, promote(0, 0, false)),
            FP8_TENSOR_LARGE
        );
        assert_eq!(
            with_dev_promote(FP8_BLOCK_SCALED, promote(1, 1, false)),
            FP8_BLOCK_SCALED
        );
        assert_eq!(
            with_dev_promote(FP8_BLOCK_LARGE, DevLarge::Default),
            FP8_BLOCK_LARGE
        );
    }

    #[test]
    fn split_k_matches_the_harness() {
        // Mixtral decode GEMM2 (K = 4096 outputs, N = 14336 reduction), 2 routes, small tiles:
        // 32 N tiles · min(128 / 64, 1 + 2) = 64 blocks → ceil(528 / 64) = 9 ≤ 14336 / 128 / 4 = 28.
        assert_eq!(FP8_TENSOR_SMALL.splits(2, 8, 128, 32, 14336, 132), 9);
        // Short reductions are never split.
        assert_eq!(FP8_BLOCK_SCALED.splits(2, 8, 128, 1, 256, 132), 1);
        assert_eq!(FP8_TENSOR_LARGE.splits(8192, 8, 9216, 16, 14336, 132), 1);
    }

    #[test]
    fn non_hopper_devices_get_an_error_naming_sm_90() {
        let err = check_arch("op", Device::Cuda(0), (8, 9))
            .unwrap_err()
            .to_string();
        assert!(err.contains("sm_90") && err.contains("sm_89"), "{err}");
        assert!(check_arch("op", Device::Cuda(0), (10, 0)).is_err());
        assert!(check_arch("op", Device::Cuda(0), (9, 0)).is_ok());
    }

    #[test]
    fn mixed_operands_name_the_combination() {
        let w = WeightOperand::Fp8Block {
            q: Tensor::zeros([1, 2, 16], DType::F8E4M3, &Device::Cpu).unwrap(),
            scale_inv: Tensor::zeros([1, 1, 1], DType::F32, &Device::Cpu).unwrap(),
        };
        let err = pair_scheme("op", Device::Cuda(0), ActQuant::Fp8PerTensor, &w, "w13")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("per-tensor") && err.contains("128×128") && err.contains("w13"),
            "{err}"
        );
        assert!(check_dims("op", 144, 80).is_ok());
        let err = check_dims("op", 136, 80).unwrap_err().to_string();
        assert!(
            err.contains("K (hidden") && err.contains("136") && err.contains("16"),
            "{err}"
        );
        let err = check_dims("op", 144, 72).unwrap_err().to_string();
        assert!(
            err.contains("N (intermediate") && err.contains("72"),
            "{err}"
        );
    }
}
