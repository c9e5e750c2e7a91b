//! `moe_gemm`: the grouped expert GEMMs of a MoE layer, in two kernel families.
//!
//! Both compute, for every route r = (token t, slot j) with expert e = ids[t, j]:
//! h_r = silu(W1_e a_t) ⊙ (W3_e a_t) and y_t = Σ_j w_tj · W2_e h_r, where w13 = [W1; W3] is
//! [E, 2N, K] (gate rows first) and w2 is [E, K, N]. Operands are quantization-aware
//! ([`ActOperand`], [`WeightOperand`]): fp8 codes are multiplied as exact f32 values and accumulated
//! in f32; per-tensor scales are applied once per dot product, block scales once per 128-wide K
//! block (the promotion a tensor-core kernel performs).
//!
//! - `fused` ([`gemm1_silu_mul`], [`gemm2_weighted_sum`]): routes pre-sorted by expert
//!   ([`crate::moe_align`]); each thread takes a tile of one expert's weight rows, converts it to f32
//!   once, and runs every route of that expert through it with SiLU⊙mul (GEMM1) or the routing
//!   weight and top-k sum (GEMM2) applied in the epilogue. Weights are never dequantized as a whole.
//! - `portable` ([`portable_expert_loop`]): the unfused baseline, Hugging Face's per-expert loop:
//!   one expert at a time, dequantized weight copies, separate activation and scatter-add passes.
//!
//! Activation quantization between the GEMMs (a2) belongs to the caller, so both families see the
//! same quantized inputs.

mod cpu;
mod cpu_portable;
mod operand;
mod simd;

pub use operand::{ActOperand, ActQuant, QBLOCK, WeightOperand};

use fmoe_core::{DType, Storage, Tensor};

use crate::moe_align::AlignedRoutes;
use crate::{Error, Result};

/// GEMM1 with SiLU⊙mul fused: returns h, f32 [num_routes, N], rows in route order (t * top_k + j).
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
        Storage::Cuda(s) => Err(crate::error::no_cuda_kernel(OP, s)),
        Storage::Cpu(_) => cpu::gemm1_silu_mul(a, routes, top_k, w13),
    }
}

/// GEMM2 with the routing weight and top-k reduction fused: y_t = Σ_j w_tj · W2_e h_(t·k+j),
/// f32 [M, K]. `h` holds one row per route; `topk_weights` is f32 [M, top_k].
pub fn gemm2_weighted_sum(
    h: &ActOperand,
    routes: &AlignedRoutes,
    topk_weights: &Tensor,
    w2: &WeightOperand,
) -> Result<Tensor> {
    const OP: &str = "moe_gemm::gemm2_weighted_sum";
    let (e, _k, n) = w2.dims(OP, "w2")?;
    let rows = h.check(OP, "a2", n)?;
    let dims = topk_weights.expect_rank(OP, "topk_weights", 2, "[tokens, top_k]")?;
    topk_weights.expect_dtype(OP, "topk_weights", &[DType::F32])?;
    if dims[0] * dims[1] != rows {
        return Err(Error::invalid(
            OP,
            format!(
                "h has {rows} route rows but topk_weights {:?} describes {}",
                dims,
                dims[0] * dims[1]
            ),
        ));
    }
    check_routes(OP, routes, rows, e)?;
    match h.storage() {
        Storage::Cuda(s) => Err(crate::error::no_cuda_kernel(OP, s)),
        Storage::Cpu(_) => cpu::gemm2_weighted_sum(h, routes, topk_weights, w2),
    }
}

/// The unfused baseline: per-expert loop over dequantized weights. `a1` is the (quantized)
/// input; the intermediate is quantized with `a2_quant`, through the same
/// [`ActOperand::quantize`] the fused path's caller uses. Returns y, f32 [M, K].
pub fn portable_expert_loop(
    a1: &ActOperand,
    topk_ids: &Tensor,
    topk_weights: &Tensor,
    w13: &WeightOperand,
    w2: &WeightOperand,
    a2_quant: ActQuant,
) -> Result<Tensor> {
    const OP: &str = "moe_gemm::portable_expert_loop";
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
        Storage::Cuda(s) => Err(crate::error::no_cuda_kernel(OP, s)),
        Storage::Cpu(_) => cpu_portable::expert_loop(a1, topk_ids, topk_weights, w13, w2, a2_quant),
    }
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
