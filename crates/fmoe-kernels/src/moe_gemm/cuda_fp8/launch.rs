//! One fp8 grouped GEMM launch: the operands' and aligned routes' device buffers, the variant's
//! kernel (compiled through [`crate::nvrtc`]) and its arguments.

use fmoe_core::cuda::cudarc::driver::{CudaView, LaunchConfig};
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{Device, Storage, Tensor};

use super::support::{check_arch, pair_scheme};
use super::{Fp8GemmConfig, Fp8Scheme};
use crate::launch::{cuda_storage, opt_in_smem};
use crate::moe_align::AlignedRoutes;
use crate::moe_gemm::cuda::{GemmGrid, gemm_grid, persistent_grid, tile_counter};
use crate::moe_gemm::tma::{TmaElem, weight_tensor_map};
use crate::moe_gemm::{ActOperand, WeightOperand};
use crate::{Error, Result};

/// Codes and scales of an fp8 activation operand.
fn act_parts(a: &ActOperand) -> Option<(&Tensor, &Tensor)> {
    match a {
        ActOperand::Plain(_) => None,
        ActOperand::Fp8PerTensor { q, scale } => Some((q, scale)),
        ActOperand::Fp8Group { q, scales } => Some((q, scales)),
    }
}

/// Codes and scales of fp8 weights.
pub(super) fn weight_parts(w: &WeightOperand) -> Option<(&Tensor, &Tensor)> {
    match w {
        WeightOperand::Plain(_) => None,
        WeightOperand::Fp8PerTensor { q, scales } => Some((q, scales)),
        WeightOperand::Fp8Block { q, scale_inv } => Some((q, scale_inv)),
    }
}

/// Device buffers (codes, scales) of one operand.
pub(super) struct Operand<'a> {
    pub(super) q: &'a CudaStorage,
    pub(super) s: &'a CudaStorage,
}

/// The matching fp8 activation and weight operands on one device, or the error naming why not.
pub(super) fn operands<'a>(
    op: &'static str,
    a: &'a ActOperand,
    aname: &str,
    w: &'a WeightOperand,
    wname: &str,
) -> Result<(Fp8Scheme, Operand<'a>, Operand<'a>, Device)> {
    let device = a.data().device();
    let scheme = pair_scheme(op, device, a.scheme(), w, wname)?;
    let ((aq, as_), (wq, ws)) = match (act_parts(a), weight_parts(w)) {
        (Some(x), Some(y)) => (x, y),
        // pair_scheme accepts fp8 operands only; an error rather than a panic if that ever drifts.
        _ => {
            return Err(Error::invalid(
                op,
                "expected fp8 activation and weight operands",
            ));
        }
    };
    let act = Operand {
        q: cuda_storage(op, aname, aq, device)?,
        s: cuda_storage(op, &format!("{aname}_scale"), as_, device)?,
    };
    let weight = Operand {
        q: cuda_storage(op, wname, wq, device)?,
        s: cuda_storage(op, &format!("{wname}_scale"), ws, device)?,
    };
    Ok((scheme, act, weight, device))
}

/// Aligned routes' device buffers, with the variant their M tile belongs to.
pub(super) struct Fp8Routes<'a> {
    pub(super) cfg: Fp8GemmConfig,
    sorted: &'a CudaStorage,
    blocks: &'a CudaStorage,
    total: &'a CudaStorage,
    slots: usize,
}

pub(super) fn fp8_routes<'a>(
    op: &'static str,
    routes: &'a AlignedRoutes,
    device: Device,
    scheme: Fp8Scheme,
) -> Result<Fp8Routes<'a>> {
    if let Some(tall) = &routes.tall {
        return Err(Error::invalid(
            op,
            format!(
                "routes are aligned to mixed M tiles ({} and {}); the CUDA {scheme:?} fp8 GEMMs \
                 take one tile height",
                routes.block_m, tall.block_m
            ),
        ));
    }
    let Some(cfg) = Fp8GemmConfig::for_routes(
        scheme,
        routes.block_m,
        routes.num_routes,
        routes.num_experts,
    ) else {
        return Err(Error::invalid(
            op,
            format!(
                "routes are aligned to block_m = {}; the CUDA {scheme:?} fp8 GEMM takes {} (its M \
                 tiles)",
                routes.block_m, "16, 32, 64 or 128"
            ),
        ));
    };
    Ok(Fp8Routes {
        cfg,
        sorted: cuda_storage(op, "sorted_routes", &routes.sorted_routes, device)?,
        blocks: cuda_storage(op, "block_experts", &routes.block_experts, device)?,
        total: cuda_storage(op, "total", &routes.total, device)?,
        slots: routes.slots(),
    })
}

/// One launch of an fp8 grouped GEMM.
pub(super) struct Fp8Gemm<'a> {
    pub(super) mode: u32,
    pub(super) act: &'a Operand<'a>,
    pub(super) weight: &'a Operand<'a>,
    pub(super) routes: &'a Fp8Routes<'a>,
    /// MODE 2: f32 [num_routes].
    pub(super) topk_weights: Option<&'a CudaStorage>,
    pub(super) num_routes: usize,
    pub(super) top_k: usize,
    /// Reduction length (K for GEMM1, N for GEMM2).
    pub(super) kd: usize,
    /// Output columns (N for GEMM1, K for GEMM2; 2N for the portable path's GEMM1).
    pub(super) n_out: usize,
    pub(super) experts: usize,
    /// MODE 2 with `-D ROUTE_ROWS=1` (warp-specialized kernels, one K split): `y32` is bf16
    /// [num_routes, n_out], one weighted row per route.
    pub(super) route_rows: bool,
}

/// The launch's (M blocks, N tiles, K splits) on `sms` SMs: swap-AB launches only the route
/// blocks that can be busy and evens GEMM2's waves with its split; the others cover the slots and
/// split GEMM2 by [`Fp8GemmConfig::splits`].
pub(super) fn plan(g: &Fp8Gemm<'_>, sms: usize) -> (usize, usize, usize) {
    let cfg = g.routes.cfg;
    let n_tiles = g.n_out.div_ceil(cfg.n_tile(g.mode));
    let blocks_m = if cfg.swap_ab {
        cfg.swap_ab_blocks(g.num_routes, g.experts, g.routes.slots)
    } else {
        g.routes.slots / cfg.bm
    };
    let splits = if g.mode == 2 && cfg.swap_ab {
        cfg.swap_ab_splits(blocks_m * n_tiles, g.kd, sms)
    } else if g.mode == 2 {
        cfg.splits(g.num_routes, g.experts, g.routes.slots, n_tiles, g.kd, sms)
    } else {
        1
    };
    (blocks_m, n_tiles, splits)
}

/// Launches `g`. Outputs by mode and scheme:
/// - MODE 1, per-tensor: `out` = h bf16 [R, n_out]; `word` = the amax word (or none);
/// - MODE 1, block: `out` = codes [R, n_out], `out_scales` = f32 [R, ceil(n_out/128)], `word` = the
///   error flag (required);
/// - MODE 2: `y32` = f32 [R / top_k, n_out], zeroed by the caller; with `route_rows` bf16
///   [R, n_out], every row written by the kernel.
pub(super) fn launch(
    op: &'static str,
    g: &Fp8Gemm<'_>,
    out: Option<&mut CudaStorage>,
    out_scales: Option<&mut CudaStorage>,
    word: Option<&CudaView<'_, u8>>,
    y32: Option<&mut CudaStorage>,
) -> Result<()> {
    let cfg = g.routes.cfg;
    let blocks_m = g.routes.slots / cfg.bm;
    if g.num_routes == 0 || g.n_out == 0 || blocks_m == 0 {
        return Ok(());
    }
    let backend = g.act.q.backend();
    check_arch(op, g.act.q.device(), backend.compute_capability())?;
    let consistent = match (g.mode, cfg.scheme) {
        (1, Fp8Scheme::PerTensor) => out.is_some() && out_scales.is_none() && y32.is_none(),
        (1, Fp8Scheme::Block) => {
            out.is_some() && out_scales.is_some() && word.is_some() && y32.is_none()
        }
        (2, _) => out.is_none() && out_scales.is_none() && y32.is_some(),
        _ => false,
    };
    if !consistent {
        return Err(Error::invalid(
            op,
            format!(
                "internal: fp8 GEMM MODE {} ({:?}) launched with the wrong outputs",
                g.mode, cfg.scheme
            ),
        ));
    }
    // Swap-AB: only the route blocks that can be busy, and the split that evens the waves.
    let (blocks_m, n_tiles, splits) = plan(g, backend.multiprocessor_count() as usize);
    if g.route_rows && (g.mode != 2 || splits != 1 || !cfg.ws) {
        return Err(Error::invalid(
            op,
            "internal: per-route GEMM2 rows need a warp-specialized kernel, MODE 2 and one K split",
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
    let (family, source, entry) = cfg.source();
    let mut defines = cfg.defines(g.mode);
    if g.route_rows {
        defines.push(crate::moe_gemm::cuda::route_rows_define());
    }
    let (f, pdl) = crate::launch::load_chain(backend, family, source, entry, &defines)?;
    let smem = cfg.smem_bytes();
    opt_in_smem(&f, smem, "moe_gemm fp8: shared memory opt-in")?;
    // The tile space; the warp-specialized kernels and the persistent swap-AB ones walk it with
    // one block per SM.
    let (n_tiles32, m_blocks32, splits32) = grid;
    let persistent_swap_ab = cfg.swap_ab && super::swapab_persistent(cfg.bm, g.mode);
    let grid = if cfg.pairs() {
        // 2-block clusters walking units of (N tile, two M blocks, split): an even grid.
        let units = (n_tiles32, m_blocks32.div_ceil(2), splits32);
        let (clusters, _, _) =
            persistent_grid(op, units, backend.multiprocessor_count() as usize / 2)?;
        (2 * clusters, 1, 1)
    } else if cfg.ws || persistent_swap_ab {
        persistent_grid(op, grid, backend.multiprocessor_count() as usize)?
    } else if cfg.swap_ab {
        // Route blocks fastest: an expert's blocks run together and share its weight tiles.
        (m_blocks32, n_tiles32, splits32)
    } else {
        grid
    };
    let launch = LaunchConfig {
        grid_dim: grid,
        block_dim: (cfg.threads(), 1, 1),
        shared_mem_bytes: smem,
    };
    let out = match out {
        Some(s) => Some(s.buffer_mut()?),
        None => None,
    };
    let out_scales = match out_scales {
        Some(s) => Some(s.buffer_mut()?),
        None => None,
    };
    let y32 = match y32 {
        Some(s) => Some(s.buffer_mut()?),
        None => None,
    };
    let null: u64 = 0;
    let mut b = crate::launch::PdlLaunch::new(backend, &f, pdl);
    let (r, bl, tot) = (
        g.routes.sorted.buffer(),
        g.routes.blocks.buffer(),
        g.routes.total.buffer(),
    );
    match cfg.scheme {
        Fp8Scheme::PerTensor => {
            // (a, w, sorted_routes, block_experts, total, topk_weights, a_scale, w_scale, h_out,
            //  h_amax, y32, num_routes, top_k, kd, n_out)
            b.arg(g.act.q.buffer())
                .arg(g.weight.q.buffer())
                .arg(r)
                .arg(bl)
                .arg(tot);
            match g.topk_weights {
                Some(w) => b.arg(w.buffer()),
                None => b.arg(&null),
            };
            b.arg(g.act.s.buffer()).arg(g.weight.s.buffer());
            match out {
                Some(h) => b.arg(h),
                None => b.arg(&null),
            };
            match word {
                Some(w) => b.arg(w),
                None => b.arg(&null),
            };
            match y32 {
                Some(y) => b.arg(y),
                None => b.arg(&null),
            };
        }
        Fp8Scheme::Block => {
            // (a, a_scale, w, w_scale, sorted_routes, block_experts, total, topk_weights, q_out,
            //  s_out, y32, error_flag, num_routes, top_k, kd, n_out)
            b.arg(g.act.q.buffer())
                .arg(g.act.s.buffer())
                .arg(g.weight.q.buffer())
                .arg(g.weight.s.buffer())
                .arg(r)
                .arg(bl)
                .arg(tot);
            match g.topk_weights {
                Some(w) => b.arg(w.buffer()),
                None => b.arg(&null),
            };
            match out {
                Some(q) => b.arg(q),
                None => b.arg(&null),
            };
            match out_scales {
                Some(s) => b.arg(s),
                None => b.arg(&null),
            };
            match y32 {
                Some(y) => b.arg(y),
                None => b.arg(&null),
            };
            match word {
                Some(w) => b.arg(w),
                None => b.arg(&null),
            };
        }
    }
    b.arg(&num_routes).arg(&top_k).arg(&kd).arg(&n_out);
    let b_map;
    if cfg.ws || cfg.swap_ab {
        // All experts' rows; each tile is two boxes of 128 rows (gate and up, or two halves).
        let rows = g.weight.q.len() / g.kd.max(1);
        b_map = weight_tensor_map(op, g.weight.q, TmaElem::Fp8, rows, g.kd, 128)?;
        b.arg(&b_map);
    }
    let swap_counter;
    if persistent_swap_ab {
        // The tile space in the kernel's order: route blocks (fastest), N tiles, K splits.
        b.arg(&m_blocks32).arg(&n_tiles32).arg(&splits32);
        if super::swapab_dynamic(cfg.bm, g.mode) {
            swap_counter = tile_counter(backend)?;
            b.arg(swap_counter.buffer());
        }
    }
    let counter;
    if cfg.ws {
        // The tile space and the tile counter (zeroed per launch, one increment per claimed tile).
        counter = tile_counter(backend)?;
        b.arg(&n_tiles32)
            .arg(&m_blocks32)
            .arg(&splits32)
            .arg(counter.buffer());
    }
    // SAFETY: the arguments match the entry's parameters in order and type (pointers, then four
    // u32) for the compiled scheme, as written out above. The callers checked: the activation codes
    // are e4m3 [rows, kd] with rows = num_routes / top_k (MODE 1) or num_routes (MODE 2) and their
    // scales f32 [1] (per-tensor) or [rows, ceil(kd/128)] (block); the weights are e4m3
    // [E, 2·n_out (MODE 1) or n_out (MODE 2), kd] with scales f32 [E] or
    // [E, ceil(rows/128), ceil(kd/128)]; kd and (MODE 1) n_out are multiples of 16 and every buffer
    // is a 256-byte aligned allocation (16-byte cp.async rows, paired and vector stores); the routes
    // come from moe_align with BLOCK_M = cfg.bm over these num_routes routes and E experts, so
    // sorted holds grid.1 · bm slots, block ids are < E before *total and route ids < num_routes
    // or the pad; MODE 1's outputs hold num_routes rows (h bf16, or codes and group scales) and
    // its `word` is a live u32 (zeroed amax, or the error flag); MODE 2's topk_weights hold
    // num_routes f32 and y32 (num_routes / top_k)·n_out f32, zeroed since split-K and the top-k
    // sum add into it (ROUTE_ROWS: num_routes·n_out bf16, plain stores, one split); each mode's unused pointers are null and never dereferenced by that mode;
    // MODE 1 runs with gridDim.z = 1; the dynamic shared memory is the source's formula for these
    // defines, opted in above 48 KiB (≤ 227 KiB). The warp-specialized variants (`cfg.ws`) take five
    // more arguments, pushed above: the weights' tensor map over [E · rows, kd] codes, the tile
    // space (three u32: N tiles, the M blocks of `sorted`, splits) that their grid of at most one
    // block per SM walks, and a zeroed u32 tile counter. Swap-AB variants take the tensor map;
    // their grids put the route blocks (at most the slots' blocks) in x and the N tiles in y, or,
    // persistent, walk that space with at most one block per SM, whose three u32 (route blocks, N
    // tiles, splits) follow the map, and with `-D DYNAMIC=1` a zeroed u32 tile counter after them.
    unsafe { b.launch(launch) }.map_err(|e| cuda_error("moe_gemm fp8: launch", e))?;
    Ok(())
}

pub(super) fn cuda_tensor(s: CudaStorage, dims: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_storage(Storage::Cuda(s), dims)?)
}
