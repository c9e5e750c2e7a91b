//! `moe_gemm`: the grouped expert GEMMs of a MoE layer, in two kernel families.
//!
//! Both compute, for every route r = (token t, slot j) with expert e = ids[t, j]:
//! h_r = silu(W1_e a_t) ⊙ (W3_e a_t) and y_t = Σ_j w_tj · W2_e h_r, where w13 = [W1; W3] is
//! [E, 2N, K] (gate rows first) and w2 is [E, K, N]. Operands are quantization-aware
//! ([`ActOperand`], [`WeightOperand`]): fp8 codes are multiplied as exact f32 values and accumulated
//! in f32; per-tensor scales are applied once per dot product, block scales once per 128-wide K
//! block (the promotion a tensor-core kernel performs).
//!
//! - `fused` ([`gemm1_silu_mul`], [`gemm2_weighted_sum`], [`gemm2_weighted_sum_to`]): routes
//!   pre-sorted by expert
//!   ([`crate::moe_align`]); each thread takes a tile of one expert's weight rows, converts it to f32
//!   once, and runs every route of that expert through it with SiLU⊙mul (GEMM1) or the routing
//!   weight and top-k sum (GEMM2) applied in the epilogue. Weights are never dequantized as a whole.
//! - `portable` ([`portable_expert_loop`]): the unfused baseline, Hugging Face's per-expert loop:
//!   one expert at a time, dequantized weight copies, separate activation and scatter-add passes.
//!
//! Activation quantization between the GEMMs (a2) belongs to the caller, so both families see the
//! same quantized inputs.
//!
//! GEMM2's top-k sum on CUDA: f32 reductions into y32 (order unspecified) and a cast, or, at large
//! batches with top-k ≥ 4 ([`route_rows_pay`]), per-route bf16 rows that [`sum_route_rows`]
//! adds in fixed order (deterministic), rounding once to the output dtype.
//!
//! CUDA, both families, no host synchronization:
//! - `cuda.rs`: bf16 activations and bf16 weights;
//! - `cuda_fp8/` (Hopper, sm_90, only): fp8 per-tensor activations with per-tensor weights, and
//!   1×128-group activations with 128×128-block weights. GEMM1 quantizes h for GEMM2 in its
//!   epilogue or right after ([`gemm1_silu_mul_quant`]); the variant and its M tile come from
//!   [`block_m_for`] ([`Fp8GemmConfig::select`]).
//!
//! f16/f32 operands, fp8 mixed with bf16, and fp8 on other GPUs are
//! [`fmoe_core::Error::Unsupported`] naming what is missing ([`check_device_support`]).

pub(crate) mod cpu;
mod cpu_portable;
mod cuda;
mod cuda_fp8;
mod operand;
pub(crate) mod simd;
mod tma;

pub use cuda::{
    BM as CUDA_BLOCK_M, DEV_ROUTE_ROWS_ENV, DEV_SWAPAB_WIDE_ROUTES_ENV, Gemm2Sum, GemmConfig,
    GemmKind, K_MULTIPLE as CUDA_K_MULTIPLE, LARGE_TILE_ROUTES_PER_EXPERT,
    MID_TILE_MAX_ROUTES_PER_EXPERT, MIXED_TILE_ROUTES_PER_EXPERT, MMA, SM90_LARGE, SM90_MID,
    SM90_SMALL, SM90_SWAPAB, SM90_TALL, route_rows_pay,
};
pub use cuda_fp8::{
    DEV_FP8_LARGE_ENV, DEV_FP8_LONE_WG_ENV, DEV_SWAPAB_BN_ENV, DEV_SWAPAB_ENV,
    DEV_SWAPAB_PERSIST_ENV, FP8_BLOCK_LARGE, FP8_BLOCK_LARGE_HALVES, FP8_BLOCK_LARGE_QUARTERS,
    FP8_BLOCK_SCALED, FP8_BLOCK_SWAPAB, FP8_K_MULTIPLE as CUDA_FP8_K_MULTIPLE, FP8_TENSOR_LARGE,
    FP8_TENSOR_SMALL, FP8_TENSOR_SWAPAB, FP8_TENSOR_SYNC, Fp8GemmConfig, Fp8Scheme,
    SWAPAB_BLOCK_WIDE_ROUTES_PER_EXPERT, SWAPAB_MID_ROUTES_PER_EXPERT, SWAPAB_ROUTE_BLOCKS,
    SWAPAB_ROUTES_PER_EXPERT, SWAPAB_WIDE_ROUTES_PER_EXPERT, swapab_dynamic, swapab_persistent,
    swapab_route_block, swapab_route_block_for, swapab_stages,
};
pub use operand::{ActOperand, ActQuant, ActScale, QBLOCK, WeightOperand};

/// Every CUDA grouped GEMM and glue kernel variant (see [`crate::catalog`]).
pub(crate) fn cuda_variants() -> Vec<crate::catalog::KernelVariant> {
    let mut v = cuda::variants();
    v.extend(cuda_fp8::variants());
    v
}

/// The family of the portable path's glue kernels (gather, SiLU⊙mul, top-k sum), never PDL.
pub(crate) const GLUE_FAMILY: &str = cuda::GLUE_FAMILY;

/// The mixed (short, tall) M tiles routes are aligned to on CUDA ([`GemmConfig::tiling`]).
pub(crate) fn cuda_mixed_tiles() -> Vec<(usize, usize)> {
    vec![(SM90_LARGE.bm, SM90_TALL.bm)]
}

/// The M tiles of every CUDA GEMM variant, ascending: the `block_m` values routes are aligned to.
pub(crate) fn cuda_block_ms() -> Vec<usize> {
    let mut bms: Vec<usize> = [
        MMA,
        SM90_SWAPAB,
        SM90_SMALL,
        SM90_MID,
        SM90_LARGE,
        SM90_TALL,
    ]
    .iter()
    .map(|c| c.bm)
    .chain(SWAPAB_ROUTE_BLOCKS)
    .chain(cuda_fp8::ALL.iter().map(|c| c.bm))
    .collect();
    bms.sort_unstable();
    bms.dedup();
    bms
}

use fmoe_core::{DType, Device, Storage, Tensor};

use crate::moe_align::{AlignedRoutes, RouteTiling};
use crate::quant_fp8::FiniteCheck;
use crate::{Error, Result};

/// The `block_m` the fused GEMMs of `device` need from [`crate::moe_align::align_routes`] for a
/// batch of `num_routes` routes over `experts` experts: on CUDA the M tile of the kernel variant
/// [`GemmConfig::select`] picks; on the CPU any value works and `cpu_block_m` is used. Errors: a
/// bad `FMOE_DEV_*` value, or one that cannot apply on the device
/// ([`fmoe_core::env::DevOverrides::check_device`]).
pub fn block_m(
    device: Device,
    cpu_block_m: usize,
    num_routes: usize,
    experts: usize,
) -> Result<usize> {
    match device {
        Device::Cpu => Ok(cpu_block_m),
        Device::Cuda(i) => {
            let cc = fmoe_core::cuda::cuda_backend(i)?.compute_capability();
            crate::dev::checked(Some(cc))?;
            Ok(GemmConfig::select(cc, num_routes, experts).bm)
        }
    }
}

/// The `block_m` the fused GEMMs need for weights `w13` (its operand kind picks the kernel): on
/// CUDA the M tile of [`GemmConfig::select`] (bf16) or [`Fp8GemmConfig::select`] (fp8: 16 below
/// [`SWAPAB_ROUTES_PER_EXPERT`] routes per expert, 64 below the large-tile threshold, 128 from
/// there); on the CPU `cpu_block_m`.
pub fn block_m_for(
    device: Device,
    cpu_block_m: usize,
    num_routes: usize,
    experts: usize,
    w13: &WeightOperand,
) -> Result<usize> {
    let scheme = match w13 {
        WeightOperand::Plain(_) => return block_m(device, cpu_block_m, num_routes, experts),
        WeightOperand::Fp8PerTensor { .. } => Fp8Scheme::PerTensor,
        WeightOperand::Fp8Block { .. } => Fp8Scheme::Block,
    };
    match device {
        Device::Cpu => Ok(cpu_block_m),
        Device::Cuda(i) => {
            let cc = fmoe_core::cuda::cuda_backend(i)?.compute_capability();
            crate::dev::checked(Some(cc))?;
            Ok(Fp8GemmConfig::select(scheme, num_routes, experts).bm)
        }
    }
}

/// The M tiles the fused GEMMs of `device` need from [`crate::moe_align::align_routes_tiled`] for
/// weights `w13`: on CUDA, bf16 weights on Hopper [`GemmConfig::tiling`] (mixed 128 / 192-row
/// tiles where they pay), otherwise [`block_m_for`]'s one tile.
pub fn tiling_for(
    device: Device,
    cpu_block_m: usize,
    num_routes: usize,
    experts: usize,
    w13: &WeightOperand,
) -> Result<RouteTiling> {
    match (device, w13) {
        (Device::Cuda(i), WeightOperand::Plain(_)) => {
            let cc = fmoe_core::cuda::cuda_backend(i)?.compute_capability();
            crate::dev::checked(Some(cc))?;
            Ok(GemmConfig::tiling(cc, num_routes, experts))
        }
        _ => Ok(RouteTiling::Uniform(block_m_for(
            device,
            cpu_block_m,
            num_routes,
            experts,
            w13,
        )?)),
    }
}

/// Ok when `device` has kernels for these operands. On the CPU every operand is supported; on CUDA
/// bf16 weights with unquantized activations are, and fp8 weights with their scheme's activation
/// quantization on an sm_90 device; anything else is an [`fmoe_core::Error::Unsupported`] naming
/// the missing CUDA kernel. The MoE layer calls it before quantizing activations, so the error
/// names the kernels rather than the first one reached.
pub fn check_device_support(
    device: Device,
    act_quant: ActQuant,
    w13: &WeightOperand,
    w2: &WeightOperand,
) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(_) => cuda::check_support("moe_gemm", device, act_quant, w13, w2),
    }
}

/// GEMM1 with SiLU⊙mul fused: returns h [num_routes, N], rows in route order (t * top_k + j):
/// f32 on the CPU; bf16 on CUDA (the kernel rounds h once in its epilogue, as the GEMM2 operand).
/// On CUDA: bf16 `a` and `w13` with K a multiple of 8, or fp8 per-tensor operands with K and N
/// multiples of 16 (the block-scaled kernel only writes h quantized: use
/// [`gemm1_silu_mul_quant`]); routes aligned with the variant's `block_m` ([`block_m_for`]).
pub fn gemm1_silu_mul(
    a: &ActOperand,
    routes: &AlignedRoutes,
    top_k: usize,
    w13: &WeightOperand,
) -> Result<Tensor> {
    const OP: &str = "moe_gemm::gemm1_silu_mul";
    let (e, two_n, k) = w13.dims(OP, "w13")?;
    if two_n % 2 != 0 {
        return Err(Error::invalid(
            OP,
            format!("w13 has {two_n} rows; it must stack gate and up rows (2N)"),
        ));
    }
    let rows = a.check(OP, "a1", k)?;
    check_routes(OP, routes, rows * top_k, e)?;
    match a.storage() {
        Storage::Cuda(_) => cuda::gemm1_silu_mul(OP, a, routes, top_k, w13),
        Storage::Cpu(_) => cpu::gemm1_silu_mul(a, routes, top_k, w13),
    }
}

/// GEMM1 with SiLU⊙mul fused and h quantized as `a2_quant` says: returns the GEMM2 operand (rows
/// in route order) and the NaN/Inf check of that quantization (nothing pending on the CPU, which
/// reports it at once).
///
/// - CPU: [`gemm1_silu_mul`] (f32 h), then [`ActOperand::quantize_deferred`].
/// - CUDA, bf16: [`gemm1_silu_mul`]'s bf16 h as is (`a2_quant` must be `None`).
/// - CUDA, fp8 per-tensor: GEMM1 writes bf16 h and the amax of |h| (atomics in its epilogue), then
///   one cast pass quantizes h with it: the bf16-rounded h is quantized, where the CPU quantizes
///   its f32 h (codes may differ by one step where that rounding crosses a boundary).
/// - CUDA, fp8 block: GEMM1 writes h's e4m3 codes and 1×128 group scales directly (quantized from
///   f32 h, as on the CPU).
pub fn gemm1_silu_mul_quant(
    a: &ActOperand,
    routes: &AlignedRoutes,
    top_k: usize,
    w13: &WeightOperand,
    a2_quant: ActQuant,
) -> Result<(ActOperand, FiniteCheck)> {
    gemm1_silu_mul_quant_scaled(a, routes, top_k, w13, a2_quant, &ActScale::Dynamic)
}

/// [`gemm1_silu_mul_quant`] with h's per-tensor scale given by `a2_scale`. A static scale (fp8
/// per-tensor only) replaces the amax → scale step: on the CPU f32 h is quantized with it; on
/// CUDA GEMM1 writes bf16 h without the amax atomics and one cast pass quantizes it with the
/// device scale.
pub fn gemm1_silu_mul_quant_scaled(
    a: &ActOperand,
    routes: &AlignedRoutes,
    top_k: usize,
    w13: &WeightOperand,
    a2_quant: ActQuant,
    a2_scale: &ActScale,
) -> Result<(ActOperand, FiniteCheck)> {
    const OP: &str = "moe_gemm::gemm1_silu_mul_quant";
    check_static(OP, a2_quant, a2_scale)?;
    let (e, two_n, k) = w13.dims(OP, "w13")?;
    if two_n % 2 != 0 {
        return Err(Error::invalid(
            OP,
            format!("w13 has {two_n} rows; it must stack gate and up rows (2N)"),
        ));
    }
    let rows = a.check(OP, "a1", k)?;
    check_routes(OP, routes, rows * top_k, e)?;
    match a.storage() {
        Storage::Cuda(_) if a2_quant != ActQuant::None || cuda_fp8::is_fp8_weight(w13) => {
            cuda_fp8::gemm1_quant(OP, a, routes, top_k, w13, a2_quant, a2_scale)
        }
        Storage::Cuda(_) => Ok((
            ActOperand::Plain(cuda::gemm1_silu_mul(OP, a, routes, top_k, w13)?),
            FiniteCheck::none(),
        )),
        Storage::Cpu(_) => {
            let h = cpu::gemm1_silu_mul(a, routes, top_k, w13)?;
            ActOperand::quantize_scaled_deferred(&h, a2_quant, a2_scale)
        }
    }
}

/// GEMM2 with the routing weight and top-k reduction fused: y_t = Σ_j w_tj · W2_e h_(t·k+j),
/// f32 [M, K]. `h` holds one row per route; `topk_weights` is f32 [M, top_k]. On CUDA: bf16 `h`
/// and `w2` with N a multiple of 8, or fp8 operands of one scheme with K and N multiples of 16; y
/// is zeroed on the stream and accumulated with f32 atomics (and split-K partial sums), so the
/// order of the additions is unspecified.
pub fn gemm2_weighted_sum(
    h: &ActOperand,
    routes: &AlignedRoutes,
    topk_weights: &Tensor,
    w2: &WeightOperand,
) -> Result<Tensor> {
    const OP: &str = "moe_gemm::gemm2_weighted_sum";
    check_gemm2(OP, h, routes, topk_weights, w2)?;
    match h.storage() {
        Storage::Cuda(_) => cuda::gemm2_weighted_sum(
            OP,
            h,
            routes,
            (None, topk_weights),
            w2,
            DType::F32,
            Gemm2Sum::Atomic,
        ),
        Storage::Cpu(_) => cpu::gemm2_weighted_sum(h, routes, topk_weights, w2),
    }
}

/// GEMM2's operand checks (shared by both entry points).
fn check_gemm2(
    op: &'static str,
    h: &ActOperand,
    routes: &AlignedRoutes,
    topk_weights: &Tensor,
    w2: &WeightOperand,
) -> Result<()> {
    let (e, _k, n) = w2.dims(op, "w2")?;
    let rows = h.check(op, "a2", n)?;
    let dims = topk_weights.expect_rank(op, "topk_weights", 2, "[tokens, top_k]")?;
    topk_weights.expect_dtype(op, "topk_weights", &[DType::F32])?;
    if dims[0] * dims[1] != rows {
        return Err(Error::invalid(
            op,
            format!(
                "h has {rows} route rows but topk_weights {:?} describes {}",
                dims,
                dims[0] * dims[1]
            ),
        ));
    }
    check_routes(op, routes, rows, e)
}

/// [`gemm2_weighted_sum`] with y in `out_dtype` (the layer's output dtype) and the top-k sum as
/// `sum` says. CPU: [`gemm2_weighted_sum`], then the cast (so its numbers are the f32 path's).
/// CUDA: either f32 reductions into y32 and the cast, or (bf16/f32 out, the persistent 128-row
/// prefill GEMMs with one K split, K % 8 == 0; [`Gemm2Sum::Auto`]: when [`route_rows_pay`]) GEMM2
/// stores each route's weighted row as bf16 and [`sum_route_rows`] adds a token's rows in fixed
/// order, rounding once (deterministic; one more bf16 rounding per route than y32). `topk_ids` is
/// u32 [M, top_k], the ids the routes were aligned from (a route whose id is out of range was
/// dropped by the alignment and contributes nothing on either path).
pub fn gemm2_weighted_sum_to(
    h: &ActOperand,
    routes: &AlignedRoutes,
    topk_ids: &Tensor,
    topk_weights: &Tensor,
    w2: &WeightOperand,
    out_dtype: DType,
    sum: Gemm2Sum,
) -> Result<Tensor> {
    const OP: &str = "moe_gemm::gemm2_weighted_sum_to";
    topk_ids.expect_dtype(OP, "topk_ids", &[DType::U32])?;
    topk_ids.expect_dims(OP, "topk_ids", topk_weights.dims())?;
    match h.storage() {
        Storage::Cuda(_) => {
            check_gemm2(OP, h, routes, topk_weights, w2)?;
            cuda::gemm2_weighted_sum(
                OP,
                h,
                routes,
                (Some(topk_ids), topk_weights),
                w2,
                out_dtype,
                sum,
            )
        }
        Storage::Cpu(_) => {
            let y = gemm2_weighted_sum(h, routes, topk_weights, w2)?;
            crate::elementwise::to_dtype(&y, out_dtype)
        }
    }
}

/// The top-k sum of per-route rows: y[t, c] = Σ_j rows[t · top_k + j, c] over j = 0, 1, …, top_k − 1
/// in that order, in f32, rounded once to `out_dtype` (bf16 or f32), skipping routes whose
/// `topk_ids` entry is ≥ `num_experts`. `rows` is bf16 [M · top_k, K] (the route-rows GEMM2's
/// output), `topk_ids` u32 [M, top_k]; y is [M, K] on their device. On CUDA K must be a multiple of
/// 8. The CPU twin adds in the same order, so both give the same bits.
pub fn sum_route_rows(
    rows: &Tensor,
    topk_ids: &Tensor,
    num_experts: usize,
    out_dtype: DType,
) -> Result<Tensor> {
    const OP: &str = "moe_gemm::sum_route_rows";
    let rd = rows.expect_rank(OP, "rows", 2, "[tokens * top_k, K]")?;
    rows.expect_dtype(OP, "rows", &[DType::BF16])?;
    let ids = topk_ids.expect_rank(OP, "topk_ids", 2, "[tokens, top_k]")?;
    topk_ids.expect_dtype(OP, "topk_ids", &[DType::U32])?;
    topk_ids.expect_device(OP, "topk_ids", rows.device())?;
    let (m, top_k, k) = (ids[0], ids[1], rd[1]);
    if rd[0] != m * top_k {
        return Err(Error::invalid(
            OP,
            format!(
                "rows has {} rows but topk_ids {ids:?} describes {}",
                rd[0],
                m * top_k
            ),
        ));
    }
    if !matches!(out_dtype, DType::BF16 | DType::F32) {
        return Err(Error::invalid(
            OP,
            format!("the sum is written as bf16 or f32, not {out_dtype:?}"),
        ));
    }
    match (rows.storage(), topk_ids.storage()) {
        (Storage::Cuda(r), Storage::Cuda(i)) => {
            if !k.is_multiple_of(CUDA_K_MULTIPLE) {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "K = {k} must be a multiple of {CUDA_K_MULTIPLE} on CUDA (16-byte chunks of bf16)"
                    ),
                ));
            }
            let y = cuda::sum_route_rows(OP, r, i, num_experts, (m, top_k, k), out_dtype)?;
            Ok(Tensor::from_storage(Storage::Cuda(y), [m, k])?)
        }
        _ => {
            let ids = topk_ids.cpu_slice::<u32>(OP, "topk_ids")?;
            let y = cpu::sum_route_rows(&rows.to_f32_vec()?, ids, num_experts, top_k, k);
            Ok(Tensor::from_f32(&y, [m, k], out_dtype, &Device::Cpu)?)
        }
    }
}

/// The unfused baseline: per-expert loop over dequantized weights. `a1` is the (quantized)
/// input; the intermediate is quantized with `a2_quant`, through the same
/// [`ActOperand::quantize`] the fused path's caller uses. Returns y, f32 [M, K]. A NaN/Inf met by
/// the quantization of the intermediate is an error (on CUDA, for fp8, reading the kernel's flag:
/// a synchronization; see [`portable_expert_loop_deferred`]).
///
/// On CUDA: the fused family's grouped GEMM kernels without fusion, as separate launches with
/// every intermediate in device memory (alignment, row gather, GEMM1 into f32 [R, 2N],
/// SiLU⊙mul, for fp8 the requantization of h with the `quant_fp8` kernels, GEMM2 into f32
/// [R, K], weighted top-k sum); no host synchronization. Expert ids are not validated there (that
/// needs a synchronization): an id `>= E` contributes nothing; see
/// [`crate::moe_align::AlignedRoutes::check`].
pub fn portable_expert_loop(
    a1: &ActOperand,
    topk_ids: &Tensor,
    topk_weights: &Tensor,
    w13: &WeightOperand,
    w2: &WeightOperand,
    a2_quant: ActQuant,
) -> Result<Tensor> {
    let (y, check) = portable_expert_loop_deferred(a1, topk_ids, topk_weights, w13, w2, a2_quant)?;
    check.check()?;
    Ok(y)
}

/// [`portable_expert_loop`], returning the NaN/Inf check of the intermediate's quantization
/// instead of waiting for it on CUDA.
pub fn portable_expert_loop_deferred(
    a1: &ActOperand,
    topk_ids: &Tensor,
    topk_weights: &Tensor,
    w13: &WeightOperand,
    w2: &WeightOperand,
    a2_quant: ActQuant,
) -> Result<(Tensor, FiniteCheck)> {
    portable_expert_loop_scaled_deferred(
        a1,
        topk_ids,
        topk_weights,
        w13,
        w2,
        a2_quant,
        &ActScale::Dynamic,
    )
}

/// [`portable_expert_loop_deferred`] with the intermediate's per-tensor scale given by
/// `a2_scale` (a static scale: fp8 per-tensor only; the intermediate is quantized with it
/// instead of its amax, as on the fused path).
pub fn portable_expert_loop_scaled_deferred(
    a1: &ActOperand,
    topk_ids: &Tensor,
    topk_weights: &Tensor,
    w13: &WeightOperand,
    w2: &WeightOperand,
    a2_quant: ActQuant,
    a2_scale: &ActScale,
) -> Result<(Tensor, FiniteCheck)> {
    const OP: &str = "moe_gemm::portable_expert_loop";
    check_static(OP, a2_quant, a2_scale)?;
    let (e, two_n, k) = w13.dims(OP, "w13")?;
    let (e2, k2, n) = w2.dims(OP, "w2")?;
    if e2 != e || k2 != k || two_n != 2 * n {
        return Err(Error::invalid(
            OP,
            format!(
                "w13 is [{e}, {two_n}, {k}] but w2 is [{e2}, {k2}, {n}]; expected w2 = [E, K, N] with 2N = {two_n}"
            ),
        ));
    }
    let m = a1.check(OP, "a1", k)?;
    let ids = topk_ids.expect_rank(OP, "topk_ids", 2, "[tokens, top_k]")?;
    topk_ids.expect_dtype(OP, "topk_ids", &[DType::U32])?;
    topk_weights.expect_dims(OP, "topk_weights", ids)?;
    topk_weights.expect_dtype(OP, "topk_weights", &[DType::F32])?;
    if ids[0] != m {
        return Err(Error::invalid(
            OP,
            format!("a1 has {m} rows but topk_ids has {}", ids[0]),
        ));
    }
    match a1.storage() {
        Storage::Cuda(s) => {
            cuda::check_support(OP, s.device(), a2_quant, w13, w2)?;
            if cuda_fp8::is_fp8_act(a1) || cuda_fp8::is_fp8_weight(w13) {
                cuda_fp8::portable(
                    OP,
                    a1,
                    topk_ids,
                    topk_weights,
                    w13,
                    w2,
                    (a2_quant, a2_scale),
                )
            } else {
                Ok((
                    cuda::portable(OP, a1, topk_ids, topk_weights, w13, w2)?,
                    FiniteCheck::none(),
                ))
            }
        }
        Storage::Cpu(_) => Ok((
            cpu_portable::expert_loop(a1, topk_ids, topk_weights, w13, w2, a2_quant, a2_scale)?,
            FiniteCheck::none(),
        )),
    }
}

/// A static scale goes with fp8 per-tensor quantization only, and must be f32 `[1]`.
fn check_static(op: &'static str, a2_quant: ActQuant, a2_scale: &ActScale) -> Result<()> {
    let ActScale::Static(s) = a2_scale else {
        return Ok(());
    };
    if a2_quant != ActQuant::Fp8PerTensor {
        return Err(Error::invalid(
            op,
            format!("a static scale for h needs fp8 per-tensor quantization, not {a2_quant:?}"),
        ));
    }
    s.expect_dtype(op, "a2_scale", &[DType::F32])?;
    s.expect_dims(op, "a2_scale", &[1])?;
    Ok(())
}

fn check_routes(
    op: &'static str,
    routes: &AlignedRoutes,
    num_routes: usize,
    experts: usize,
) -> Result<()> {
    if routes.num_routes != num_routes || routes.num_experts != experts {
        return Err(Error::invalid(
            op,
            format!(
                "aligned routes describe {} routes over {} experts; the operands need {num_routes} routes over {experts} experts",
                routes.num_routes, routes.num_experts
            ),
        ));
    }
    Ok(())
}
