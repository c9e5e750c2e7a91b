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
//! from [`LARGE_TILE_ROUTES_PER_EXPERT`] routes per expert on average):
//! - per-tensor, small ([`FP8_TENSOR_SMALL`]): BM 64, WG_N 128, 4 stages, **PROMOTE=1** (the
//!   tensor-core sums of each 128-wide K tile are added into f32 registers: ~2e-4 relative GEMM
//!   error instead of ~2e-3, free while bandwidth-bound);
//! - per-tensor, large ([`FP8_TENSOR_LARGE`]): BM 128, WG_N 256, 4 stages, unpromoted (the whole
//!   reduction stays in the tensor-core accumulator: 1.3-1.6× faster when compute-bound, ~2e-3
//!   GEMM error). So per-tensor results differ slightly with the batch size (the variant changes
//!   at 128 routes per expert), by about that GEMM error, far below fp8's own ~6.5e-2;
//! - block ([`FP8_BLOCK_SCALED`]): BM 64, 256 weight rows, 5 stages (always promoted).
//!
//! Fused pipeline (what [`gemm1_quant`] and [`gemm2`] launch, the layer aligning routes with the
//! variant's `block_m` first):
//! - per-tensor: [x's amax, cast: the caller's `ActOperand::quantize_deferred`] → GEMM1 (bf16 h,
//!   amax of |h|) → cast of h with that amax (`quant_fp8.cu`, the one pass left) → GEMM2. The GPU
//!   requantizes the **bf16-rounded** h, while the CPU twin quantizes its f32 h: codes can differ
//!   by one step where bf16 rounding crosses a code boundary (within the tests' 1e-2).
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

use fmoe_core::cuda::cudarc::driver::sys::CUfunction_attribute;
use fmoe_core::cuda::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{DType, Device, Error as CoreError, Storage, Tensor};

use super::cuda::{
    DEFAULT_SMEM_LIMIT, GLUE_FAMILY, GLUE_SRC, LARGE_TILE_ROUTES_PER_EXPERT, glue_launch,
};
use super::{ActOperand, ActQuant, WeightOperand};
use crate::catalog::KernelVariant;
use crate::launch::{cuda_storage, u32_arg};
use crate::moe_align::{AlignedRoutes, align_routes};
use crate::nvrtc;
use crate::quant_fp8::{FiniteCheck, cuda as qcuda};
use crate::{Error, Result};

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
    /// Per-tensor: `-D PROMOTE` (WG_N 128 only). The block kernel always promotes.
    pub promote: bool,
}

/// Per-tensor, decode-sized batches: promoted, 64 × 128 tiles.
pub const FP8_TENSOR_SMALL: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::PerTensor,
    bm: 64,
    wg_n: 128,
    stages: 4,
    promote: true,
};

/// Per-tensor, prefill-sized batches: unpromoted, 128 × 256 tiles.
pub const FP8_TENSOR_LARGE: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::PerTensor,
    bm: 128,
    wg_n: 256,
    stages: 4,
    promote: false,
};

/// Block-scaled: 64 × 256 tiles, 5 stages.
pub const FP8_BLOCK_SCALED: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::Block,
    bm: 64,
    wg_n: 256,
    stages: 5,
    promote: true,
};

const TENSOR_FAMILY: &str = "moe_gemm_fp8_sm90";
const TENSOR_SRC: &str = include_str!("../../cuda/moe_gemm_fp8_sm90.cu");
const TENSOR_ENTRY: &str = "fmoe_moe_gemm_fp8";
const BLOCK_FAMILY: &str = "moe_gemm_fp8_block_sm90";
const BLOCK_SRC: &str = include_str!("../../cuda/moe_gemm_fp8_block_sm90.cu");
const BLOCK_ENTRY: &str = "fmoe_moe_gemm_fp8_block";
/// K and N must be multiples of this (16-byte rows of e4m3 codes).
pub const FP8_K_MULTIPLE: usize = 16;

/// Every fp8 GEMM variant ([`FP8_TENSOR_SMALL`], [`FP8_TENSOR_LARGE`], [`FP8_BLOCK_SCALED`], both
/// modes); the glue kernels are listed with the bf16 ones.
pub(super) fn variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    for cfg in [FP8_TENSOR_SMALL, FP8_TENSOR_LARGE, FP8_BLOCK_SCALED] {
        let (family, source, entry) = cfg.source();
        for mode in [1, 2] {
            v.push(KernelVariant {
                family,
                source,
                entry,
                defines: cfg.defines(mode),
            });
        }
    }
    v
}

impl Fp8GemmConfig {
    /// The variant for `num_routes` routes over `experts` experts (see the module docs).
    pub fn select(scheme: Fp8Scheme, num_routes: usize, experts: usize) -> Fp8GemmConfig {
        match scheme {
            Fp8Scheme::Block => FP8_BLOCK_SCALED,
            Fp8Scheme::PerTensor if num_routes >= LARGE_TILE_ROUTES_PER_EXPERT * experts.max(1) => {
                FP8_TENSOR_LARGE
            }
            Fp8Scheme::PerTensor => FP8_TENSOR_SMALL,
        }
    }

    /// The variant of `scheme` that consumes routes aligned to `block_m`.
    pub fn for_block_m(scheme: Fp8Scheme, block_m: usize) -> Option<Fp8GemmConfig> {
        [FP8_TENSOR_SMALL, FP8_TENSOR_LARGE, FP8_BLOCK_SCALED]
            .into_iter()
            .find(|c| c.scheme == scheme && c.bm == block_m)
    }

    /// Output columns per block: MODE 1 pairs gate with up rows (half the weight rows), MODE 2
    /// writes one column per weight row.
    pub const fn n_tile(&self, mode: u32) -> usize {
        match (self.scheme, mode) {
            (Fp8Scheme::PerTensor, 1) => self.wg_n / 2,
            (Fp8Scheme::PerTensor, _) => self.wg_n,
            (Fp8Scheme::Block, 1) => 128,
            (Fp8Scheme::Block, _) => 256,
        }
    }

    pub const fn threads(&self) -> u32 {
        match self.scheme {
            Fp8Scheme::PerTensor => (self.bm / 64 * 128) as u32,
            Fp8Scheme::Block => 256,
        }
    }

    /// Dynamic shared memory per block (the sources' formulas).
    pub const fn smem_bytes(&self) -> u32 {
        (match self.scheme {
            Fp8Scheme::PerTensor => self.stages * (self.bm + self.wg_n) * 128 + 1024,
            Fp8Scheme::Block => self.stages * (64 + 256) * 128 + 1024,
        }) as u32
    }

    fn source(&self) -> (&'static str, &'static str, &'static str) {
        match self.scheme {
            Fp8Scheme::PerTensor => (TENSOR_FAMILY, TENSOR_SRC, TENSOR_ENTRY),
            Fp8Scheme::Block => (BLOCK_FAMILY, BLOCK_SRC, BLOCK_ENTRY),
        }
    }

    fn defines(&self, mode: u32) -> Vec<(&'static str, String)> {
        let mut d = vec![("MODE", mode.to_string())];
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
        let bm = self.bm;
        let blocks = (slots / bm).min(num_routes.div_ceil(bm) + experts.min(num_routes));
        let want = (4 * sms).div_ceil((n_tiles * blocks).max(1));
        want.min(((kd / 128) / 4).max(1)).max(1)
    }
}

fn unsupported(op: &'static str, device: Device, reason: String) -> Error {
    CoreError::Unsupported { op, device, reason }.into()
}

/// The fp8 kernels run on Hopper (compute capability 9.0) only.
pub(super) fn check_arch(op: &'static str, device: Device, cc: (u32, u32)) -> Result<()> {
    if cc == (9, 0) {
        return Ok(());
    }
    Err(unsupported(
        op,
        device,
        format!(
            "the CUDA fp8 grouped GEMMs use wgmma and need sm_90 (Hopper: H100/H200); this device \
             is sm_{}{}",
            cc.0, cc.1
        ),
    ))
}

pub(super) fn is_fp8_act(a: &ActOperand) -> bool {
    !matches!(a, ActOperand::Plain(_))
}

pub(super) fn is_fp8_weight(w: &WeightOperand) -> bool {
    !matches!(w, WeightOperand::Plain(_))
}

fn act_kind(a: ActQuant) -> &'static str {
    match a {
        ActQuant::None => "unquantized",
        ActQuant::Fp8PerTensor => "fp8 per-tensor",
        ActQuant::Fp8Group => "fp8 1×128-group",
    }
}

fn weight_kind(w: &WeightOperand) -> String {
    match w {
        WeightOperand::Plain(t) => t.dtype().to_string(),
        WeightOperand::Fp8PerTensor { .. } => "fp8 per-tensor".into(),
        WeightOperand::Fp8Block { .. } => "fp8 128×128-block".into(),
    }
}

/// The scheme of matching fp8 operands, or `Unsupported` naming the combination.
fn pair_scheme(
    op: &'static str,
    device: Device,
    act: ActQuant,
    w: &WeightOperand,
    wname: &str,
) -> Result<Fp8Scheme> {
    match (act, w) {
        (ActQuant::Fp8PerTensor, WeightOperand::Fp8PerTensor { .. }) => Ok(Fp8Scheme::PerTensor),
        (ActQuant::Fp8Group, WeightOperand::Fp8Block { .. }) => Ok(Fp8Scheme::Block),
        _ => Err(unsupported(
            op,
            device,
            format!(
                "no CUDA kernel for {} activations with {} weights `{wname}` (the CUDA fp8 GEMMs \
                 take fp8 per-tensor with fp8 per-tensor, fp8 1×128-group with fp8 128×128-block; \
                 bf16 with bf16)",
                act_kind(act),
                weight_kind(w)
            ),
        )),
    }
}

/// Ok if the fp8 kernels can run these operands on `device` (see [`super::check_device_support`]).
pub(super) fn check_support(
    op: &'static str,
    device: Device,
    act_quant: ActQuant,
    w13: &WeightOperand,
    w2: &WeightOperand,
) -> Result<()> {
    let s1 = pair_scheme(op, device, act_quant, w13, "w13")?;
    let s2 = pair_scheme(op, device, act_quant, w2, "w2")?;
    debug_assert_eq!(s1, s2);
    let Device::Cuda(i) = device else {
        return Ok(());
    };
    check_arch(
        op,
        device,
        fmoe_core::cuda::cuda_backend(i)?.compute_capability(),
    )
}

/// `K` and `N` must be multiples of 16.
fn check_dims(op: &'static str, k: usize, n: usize) -> Result<()> {
    for (what, v) in [
        ("K (hidden size, GEMM1's reduction length)", k),
        ("N (intermediate size, GEMM2's reduction length)", n),
    ] {
        if !v.is_multiple_of(FP8_K_MULTIPLE) {
            return Err(Error::invalid(
                op,
                format!(
                    "{what} = {v} must be a multiple of {FP8_K_MULTIPLE} for the CUDA fp8 GEMMs \
                     (16-byte rows of e4m3 codes)"
                ),
            ));
        }
    }
    Ok(())
}

/// Codes and scales of an fp8 activation operand.
fn act_parts(a: &ActOperand) -> Option<(&Tensor, &Tensor)> {
    match a {
        ActOperand::Plain(_) => None,
        ActOperand::Fp8PerTensor { q, scale } => Some((q, scale)),
        ActOperand::Fp8Group { q, scales } => Some((q, scales)),
    }
}

/// Codes and scales of fp8 weights.
fn weight_parts(w: &WeightOperand) -> Option<(&Tensor, &Tensor)> {
    match w {
        WeightOperand::Plain(_) => None,
        WeightOperand::Fp8PerTensor { q, scales } => Some((q, scales)),
        WeightOperand::Fp8Block { q, scale_inv } => Some((q, scale_inv)),
    }
}

/// Device buffers (codes, scales) of one operand.
struct Operand<'a> {
    q: &'a CudaStorage,
    s: &'a CudaStorage,
}

/// The matching fp8 activation and weight operands on one device, or the error naming why not.
fn operands<'a>(
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
struct Fp8Routes<'a> {
    cfg: Fp8GemmConfig,
    sorted: &'a CudaStorage,
    blocks: &'a CudaStorage,
    total: &'a CudaStorage,
    slots: usize,
}

fn fp8_routes<'a>(
    op: &'static str,
    routes: &'a AlignedRoutes,
    device: Device,
    scheme: Fp8Scheme,
) -> Result<Fp8Routes<'a>> {
    let Some(cfg) = Fp8GemmConfig::for_block_m(scheme, routes.block_m) else {
        return Err(Error::invalid(
            op,
            format!(
                "routes are aligned to block_m = {}; the CUDA {scheme:?} fp8 GEMM takes {} (its M \
                 tiles)",
                routes.block_m,
                match scheme {
                    Fp8Scheme::PerTensor => "64 or 128",
                    Fp8Scheme::Block => "64",
                }
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
struct Fp8Gemm<'a> {
    mode: u32,
    act: &'a Operand<'a>,
    weight: &'a Operand<'a>,
    routes: &'a Fp8Routes<'a>,
    /// MODE 2: f32 [num_routes].
    topk_weights: Option<&'a CudaStorage>,
    num_routes: usize,
    top_k: usize,
    /// Reduction length (K for GEMM1, N for GEMM2).
    kd: usize,
    /// Output columns (N for GEMM1, K for GEMM2; 2N for the portable path's GEMM1).
    n_out: usize,
    experts: usize,
}

/// Launches `g`. Outputs by mode and scheme:
/// - MODE 1, per-tensor: `out` = h bf16 [R, n_out]; `word` = the amax word (or none);
/// - MODE 1, block: `out` = codes [R, n_out], `out_scales` = f32 [R, ceil(n_out/128)], `word` = the
///   error flag (required);
/// - MODE 2: `y32` = f32 [R / top_k, n_out], zeroed by the caller.
fn launch(
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
    let grid_y = u32::try_from(blocks_m)
        .ok()
        .filter(|&y| y <= 65_535)
        .ok_or_else(|| {
            Error::invalid(
                op,
                format!(
                    "{} routes need {blocks_m} M tiles of {}; one launch takes at most 65535",
                    g.num_routes, cfg.bm
                ),
            )
        })?;
    let n_tiles = g.n_out.div_ceil(cfg.n_tile(g.mode));
    let splits = if g.mode == 2 {
        cfg.splits(
            g.num_routes,
            g.experts,
            g.routes.slots,
            n_tiles,
            g.kd,
            backend.multiprocessor_count() as usize,
        )
    } else {
        1
    };
    let grid_x = u32_arg(op, "N tiles", n_tiles)?;
    let grid_z = u32_arg(op, "split-K", splits)?;
    let num_routes = u32_arg(op, "number of routes", g.num_routes)?;
    let top_k = u32_arg(op, "top_k", g.top_k)?;
    let kd = u32_arg(op, "reduction length", g.kd)?;
    let n_out = u32_arg(op, "output columns", g.n_out)?;
    let (family, source, entry) = cfg.source();
    let f = nvrtc::load(backend, family, source, entry, &cfg.defines(g.mode))?;
    let smem = cfg.smem_bytes();
    if smem > DEFAULT_SMEM_LIMIT {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| cuda_error("moe_gemm fp8: shared memory opt-in", e))?;
    }
    let launch = LaunchConfig {
        grid_dim: (grid_x, grid_y, grid_z),
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
    let stream = backend.stream();
    let mut b = stream.launch_builder(&f);
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
    // SAFETY: the arguments match the entry's parameters in order and type (pointers, then four
    // u32) for the compiled scheme, as written out above. The callers checked: the activation codes
    // are e4m3 [rows, kd] with rows = num_routes / top_k (MODE 1) or num_routes (MODE 2) and their
    // scales f32 [1] (per-tensor) or [rows, ceil(kd/128)] (block); the weights are e4m3
    // [E, 2·n_out (MODE 1) or n_out (MODE 2), kd] with scales f32 [E] or
    // [E, ceil(rows/128), ceil(kd/128)]; kd and (MODE 1) n_out are multiples of 16 and every buffer
    // is a 256-byte aligned allocation (16-byte cp.async rows, paired and vector stores); the routes
    // come from moe_align with BLOCK_M = cfg.bm over these num_routes routes and E experts, so
    // sorted holds grid_y · bm slots, block ids are < E before *total and route ids < num_routes
    // or the pad; MODE 1's outputs hold num_routes rows (h bf16, or codes and group scales) and
    // its `word` is a live u32 (zeroed amax, or the error flag); MODE 2's topk_weights hold
    // num_routes f32 and y32 (num_routes / top_k)·n_out f32, zeroed since split-K and the top-k
    // sum add into it; each mode's unused pointers are null and never dereferenced by that mode;
    // MODE 1 runs with gridDim.z = 1; the dynamic shared memory is the source's formula for these
    // defines, opted in above 48 KiB (≤ 227 KiB).
    unsafe { b.launch(launch) }.map_err(|e| cuda_error("moe_gemm fp8: launch", e))?;
    Ok(())
}

fn cuda_tensor(s: CudaStorage, dims: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_storage(Storage::Cuda(s), dims)?)
}

/// The activation quantization that pairs with `scheme` (GEMM1's h is quantized so).
fn act_quant_of(scheme: Fp8Scheme) -> ActQuant {
    match scheme {
        Fp8Scheme::PerTensor => ActQuant::Fp8PerTensor,
        Fp8Scheme::Block => ActQuant::Fp8Group,
    }
}

/// Fused GEMM1: SiLU⊙mul and the quantization of h for GEMM2 (see the module docs). Returns the
/// GEMM2 operand (rows in route order) and the NaN/Inf check of h.
pub(super) fn gemm1_quant(
    op: &'static str,
    a: &ActOperand,
    routes: &AlignedRoutes,
    top_k: usize,
    w13: &WeightOperand,
    a2_quant: ActQuant,
) -> Result<(ActOperand, FiniteCheck)> {
    let (scheme, act, weight, device) = operands(op, a, "a1", w13, "w13")?;
    if a2_quant != act_quant_of(scheme) {
        return Err(unsupported(
            op,
            device,
            format!(
                "the fused CUDA {scheme:?} fp8 GEMM1 quantizes h {}, not {}",
                act_kind(act_quant_of(scheme)),
                act_kind(a2_quant)
            ),
        ));
    }
    let d = w13.data().dims();
    let (n, k) = (d[1] / 2, d[2]);
    check_dims(op, k, n)?;
    let rb = fp8_routes(op, routes, device, scheme)?;
    let r = routes.num_routes;
    let backend = act.q.backend();
    let g = Fp8Gemm {
        mode: 1,
        act: &act,
        weight: &weight,
        routes: &rb,
        topk_weights: None,
        num_routes: r,
        top_k,
        kd: k,
        n_out: n,
        experts: routes.num_experts,
    };
    let mut hq = CudaStorage::alloc(backend, DType::F8E4M3, r * n)?;
    match scheme {
        Fp8Scheme::PerTensor => {
            // GEMM1 writes bf16 h and atomicMax(|h|) into ctrl[0]; the cast pass turns that into
            // the scale and flags a non-finite amax in ctrl[1].
            let mut h = CudaStorage::alloc(backend, DType::BF16, r * n)?;
            let ctrl = CudaStorage::zeros(backend, DType::U32, 2)?;
            let mut hs = CudaStorage::alloc(backend, DType::F32, 1)?;
            {
                let (amax, flag) = (ctrl.buffer().slice(0..4), ctrl.buffer().slice(4..8));
                launch(op, &g, Some(&mut h), None, Some(&amax), None)?;
                qcuda::cast_with_amax(op, &h, r * n, &amax, &mut hq, &mut hs, &flag)?;
            }
            let ctrl = cuda_tensor(ctrl, &[2])?;
            Ok((
                ActOperand::Fp8PerTensor {
                    q: cuda_tensor(hq, &[r, n])?,
                    scale: cuda_tensor(hs, &[1])?,
                },
                FiniteCheck::device_flag(op, "h", ctrl, 1, None),
            ))
        }
        Fp8Scheme::Block => {
            let groups = n.div_ceil(qcuda::GROUP);
            let mut hs = CudaStorage::alloc(backend, DType::F32, r * groups)?;
            let flag = CudaStorage::zeros(backend, DType::U32, 1)?;
            {
                let word = flag.buffer().slice(0..4);
                launch(op, &g, Some(&mut hq), Some(&mut hs), Some(&word), None)?;
            }
            let flag = cuda_tensor(flag, &[1])?;
            Ok((
                ActOperand::Fp8Group {
                    q: cuda_tensor(hq, &[r, n])?,
                    scales: cuda_tensor(hs, &[r, groups])?,
                },
                FiniteCheck::device_flag(op, "h", flag, 0, None),
            ))
        }
    }
}

/// GEMM1 with SiLU⊙mul and h as bf16 (per-tensor only: the block-scaled kernel writes h
/// quantized, see [`gemm1_quant`]).
pub(super) fn gemm1_h(
    op: &'static str,
    a: &ActOperand,
    routes: &AlignedRoutes,
    top_k: usize,
    w13: &WeightOperand,
) -> Result<Tensor> {
    let (scheme, act, weight, device) = operands(op, a, "a1", w13, "w13")?;
    if scheme == Fp8Scheme::Block {
        return Err(unsupported(
            op,
            device,
            "the block-scaled CUDA GEMM1 writes h quantized (codes and 1×128 group scales); use \
             moe_gemm::gemm1_silu_mul_quant"
                .into(),
        ));
    }
    let d = w13.data().dims();
    let (n, k) = (d[1] / 2, d[2]);
    check_dims(op, k, n)?;
    let rb = fp8_routes(op, routes, device, scheme)?;
    let r = routes.num_routes;
    let mut h = CudaStorage::alloc(act.q.backend(), DType::BF16, r * n)?;
    let g = Fp8Gemm {
        mode: 1,
        act: &act,
        weight: &weight,
        routes: &rb,
        topk_weights: None,
        num_routes: r,
        top_k,
        kd: k,
        n_out: n,
        experts: routes.num_experts,
    };
    launch(op, &g, Some(&mut h), None, None, None)?;
    cuda_tensor(h, &[r, n])
}

/// Fused GEMM2: y f32 [M, K] += routing weight · W2 h, the top-k sum through f32 atomics.
pub(super) fn gemm2(
    op: &'static str,
    h: &ActOperand,
    routes: &AlignedRoutes,
    topk_weights: &Tensor,
    w2: &WeightOperand,
) -> Result<Tensor> {
    let (scheme, act, weight, device) = operands(op, h, "a2", w2, "w2")?;
    let d = w2.data().dims();
    let (k, n) = (d[1], d[2]);
    check_dims(op, k, n)?;
    let weights = cuda_storage(op, "topk_weights", topk_weights, device)?;
    let (m, top_k) = (topk_weights.dims()[0], topk_weights.dims()[1]);
    let rb = fp8_routes(op, routes, device, scheme)?;
    let mut y = CudaStorage::zeros(act.q.backend(), DType::F32, m * k)?;
    let g = Fp8Gemm {
        mode: 2,
        act: &act,
        weight: &weight,
        routes: &rb,
        topk_weights: Some(weights),
        num_routes: routes.num_routes,
        top_k,
        kd: n,
        n_out: k,
        experts: routes.num_experts,
    };
    launch(op, &g, None, None, None, Some(&mut y))?;
    cuda_tensor(y, &[m, k])
}

/// The unfused fp8 baseline on CUDA (see the module docs): y f32 [M, K] and the NaN/Inf check of
/// the requantized h.
pub(super) fn portable(
    op: &'static str,
    a1: &ActOperand,
    topk_ids: &Tensor,
    topk_weights: &Tensor,
    w13: &WeightOperand,
    w2: &WeightOperand,
    a2_quant: ActQuant,
) -> Result<(Tensor, FiniteCheck)> {
    let (scheme, act, weight13, device) = operands(op, a1, "a1", w13, "w13")?;
    let scheme2 = pair_scheme(op, device, a2_quant, w2, "w2")?;
    if scheme2 != scheme {
        return Err(unsupported(
            op,
            device,
            format!("w13 is {scheme:?}-scaled fp8 but w2 is {scheme2:?}-scaled"),
        ));
    }
    let (w2q, w2s) = weight_parts(w2).ok_or_else(|| Error::invalid(op, "w2 is not fp8"))?;
    let weight2 = Operand {
        q: cuda_storage(op, "w2", w2q, device)?,
        s: cuda_storage(op, "w2_scale", w2s, device)?,
    };
    let weights = cuda_storage(op, "topk_weights", topk_weights, device)?;
    let (e, k, n) = (
        w13.data().dims()[0],
        w13.data().dims()[2],
        w2.data().dims()[2],
    );
    check_dims(op, k, n)?;
    let (m, top_k) = (topk_ids.dims()[0], topk_ids.dims()[1]);
    let r = m * top_k;
    let backend = act.q.backend().clone();
    check_arch(op, device, backend.compute_capability())?;
    let mut y = CudaStorage::alloc(&backend, DType::F32, m * k)?;
    if r == 0 || k == 0 {
        return Ok((cuda_tensor(y, &[m, k])?, FiniteCheck::none()));
    }
    let cfg = Fp8GemmConfig::select(scheme, r, e);
    let routes = align_routes(topk_ids, e, cfg.bm)?;
    let rb = fp8_routes(op, &routes, device, scheme)?;
    let stream = backend.stream();
    let (r64, m64) = (r as u64, m as u64);
    let (top_k32, k32, n32) = (
        u32_arg(op, "top_k", top_k)?,
        u32_arg(op, "K", k)?,
        u32_arg(op, "N", n)?,
    );
    let glue_fn = |entry: &str| nvrtc::load(&backend, GLUE_FAMILY, GLUE_SRC, entry, &[]);

    // xr[r] = a1[r / top_k]: the codes (K / 16 chunks of 16 bytes) and, for groups, their scales.
    let mut xr = CudaStorage::alloc(&backend, DType::F8E4M3, r * k)?;
    let chunks = u32_arg(op, "K / 16", k / FP8_K_MULTIPLE)?;
    let f = glue_fn("fmoe_gather_rows")?;
    let mut b = stream.launch_builder(&f);
    b.arg(act.q.buffer())
        .arg(xr.buffer_mut()?)
        .arg(&r64)
        .arg(&top_k32)
        .arg(&chunks);
    // SAFETY: (const uint4*, uint4*, u64, u32, u32); a1 holds M·K bytes = M·chunks 16-byte chunks
    // (K % 16 == 0, 256-byte aligned allocation), xr R·chunks; row r reads token r / top_k < M.
    unsafe { b.launch(glue_launch(r)) }.map_err(|e| cuda_error("moe_unfused: gather", e))?;
    let xsr = match scheme {
        Fp8Scheme::PerTensor => None,
        Fp8Scheme::Block => {
            let words = k.div_ceil(qcuda::GROUP);
            let mut s = CudaStorage::alloc(&backend, DType::F32, r * words)?;
            let words32 = u32_arg(op, "K / 128", words)?;
            let f = glue_fn("fmoe_gather_words")?;
            let mut b = stream.launch_builder(&f);
            b.arg(act.s.buffer())
                .arg(s.buffer_mut()?)
                .arg(&r64)
                .arg(&top_k32)
                .arg(&words32);
            // SAFETY: (const u32*, u32*, u64, u32, u32); the group scales are M·words f32 (checked
            // [M, ceil(K/128)] by the caller), s holds R·words; row r reads token r / top_k < M.
            unsafe { b.launch(glue_launch(r)) }
                .map_err(|e| cuda_error("moe_unfused: gather scales", e))?;
            Some(s)
        }
    };
    let gathered = Operand {
        q: &xr,
        s: xsr.as_ref().unwrap_or(act.s),
    };
    let mut ones = CudaStorage::alloc(&backend, DType::F32, r)?;
    ones.fill(1.0)?;

    // gu = xr · w13ᵀ per expert, f32 [R, 2N] (MODE 2, top_k = 1, unit weights).
    let mut gu = CudaStorage::zeros(&backend, DType::F32, r * 2 * n)?;
    let g1 = Fp8Gemm {
        mode: 2,
        act: &gathered,
        weight: &weight13,
        routes: &rb,
        topk_weights: Some(&ones),
        num_routes: r,
        top_k: 1,
        kd: k,
        n_out: 2 * n,
        experts: e,
    };
    launch(op, &g1, None, None, None, Some(&mut gu))?;

    // h = silu(gate) ⊙ up (bf16 for per-tensor, as the fused GEMM1 rounds it; f32 for block),
    // then its quantization as the scheme says.
    let (silu_entry, h_dtype) = match scheme {
        Fp8Scheme::PerTensor => ("fmoe_silu_mul", DType::BF16),
        Fp8Scheme::Block => ("fmoe_silu_mul_f32", DType::F32),
    };
    let mut h = CudaStorage::alloc(&backend, h_dtype, r * n)?;
    let f = glue_fn(silu_entry)?;
    let mut b = stream.launch_builder(&f);
    b.arg(gu.buffer()).arg(h.buffer_mut()?).arg(&r64).arg(&n32);
    // SAFETY: (const float*, bf16* or float* as compiled for `silu_entry`, u64, u32); gu holds
    // R·2N f32, h R·N elements of that type.
    unsafe { b.launch(glue_launch(r)) }.map_err(|e| cuda_error("moe_unfused: silu_mul", e))?;
    drop(gu);
    let (hq, hs, check) = match scheme {
        Fp8Scheme::PerTensor => {
            let (hq, hs, ctrl) = qcuda::per_tensor(op, &h)?;
            let check = FiniteCheck::device_flag(op, "h", cuda_tensor(ctrl, &[2])?, 1, None);
            (hq, hs, check)
        }
        Fp8Scheme::Block => {
            let (hq, hs, flag) = qcuda::per_group(op, &h, r, n)?;
            let check = FiniteCheck::device_flag(op, "h", cuda_tensor(flag, &[1])?, 0, None);
            (hq, hs, check)
        }
    };
    drop(h);

    // o = hq · w2ᵀ per expert, f32 [R, K].
    let h_op = Operand { q: &hq, s: &hs };
    let mut o = CudaStorage::zeros(&backend, DType::F32, r * k)?;
    let g2 = Fp8Gemm {
        mode: 2,
        act: &h_op,
        weight: &weight2,
        routes: &rb,
        topk_weights: Some(&ones),
        num_routes: r,
        top_k: 1,
        kd: n,
        n_out: k,
        experts: e,
    };
    launch(op, &g2, None, None, None, Some(&mut o))?;

    // y[t] = Σ_j w[t, j] · o[t·top_k + j]
    let f = glue_fn("fmoe_topk_reduce")?;
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
    Ok((cuda_tensor(y, &[m, k])?, check))
}

#[cfg(test)]
mod tests {
    use super::*;

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
            (128, 256, 256)
        );
        assert_eq!(FP8_TENSOR_LARGE.smem_bytes(), 4 * (128 + 256) * 128 + 1024);
        assert_eq!(
            (
                FP8_BLOCK_SCALED.n_tile(1),
                FP8_BLOCK_SCALED.n_tile(2),
                FP8_BLOCK_SCALED.threads()
            ),
            (128, 256, 256)
        );
        assert_eq!(FP8_BLOCK_SCALED.smem_bytes(), 5 * 40_960 + 1024);
        for c in [FP8_TENSOR_SMALL, FP8_TENSOR_LARGE, FP8_BLOCK_SCALED] {
            assert!(c.smem_bytes() <= 227 * 1024, "{c:?}");
            assert!(!c.promote || c.scheme == Fp8Scheme::Block || c.wg_n == 128);
        }
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
    fn selection_uses_the_bf16_rule_and_block_m_finds_the_variant() {
        use Fp8Scheme::*;
        assert_eq!(Fp8GemmConfig::select(PerTensor, 2, 8), FP8_TENSOR_SMALL);
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 127 * 8, 8),
            FP8_TENSOR_SMALL
        );
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 128 * 8, 8),
            FP8_TENSOR_LARGE
        );
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 4096 * 8, 256),
            FP8_TENSOR_LARGE
        );
        assert_eq!(Fp8GemmConfig::select(Block, 1 << 20, 8), FP8_BLOCK_SCALED);
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
        assert_eq!(Fp8GemmConfig::for_block_m(Block, 128), None);
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
