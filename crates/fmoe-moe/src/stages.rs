//! The expert pipeline shared by every method: prepare → experts → finalize.

use fmoe_core::Tensor;
use fmoe_kernels::moe_align::align_routes;
use fmoe_kernels::moe_gemm::{self, ActOperand, ActQuant, WeightOperand};
use fmoe_kernels::routing::TopK;

use crate::{KernelFamily, Result};

/// Rows of a GEMM tile on the fused path; each expert's routes are padded to it.
pub const BLOCK_M: usize = 16;

/// Expert weights ready for a kernel, with the activation quantization their method implies.
#[derive(Clone, Debug)]
pub struct ExpertOperands {
    pub w13: WeightOperand,
    pub w2: WeightOperand,
    pub act_quant: ActQuant,
}

/// y = Σ_j w_j · W2_e(silu(W1_e x) ⊙ W3_e x) for every token of `x` [M, K]; returns x's dtype.
pub fn run_experts(
    x: &Tensor,
    topk: &TopK,
    ops: &ExpertOperands,
    family: KernelFamily,
) -> Result<Tensor> {
    let num_experts = ops.w13.data().dims().first().copied().unwrap_or(0);
    // Prepare: quantize a1 (same function on both paths).
    let a1 = ActOperand::quantize(x, ops.act_quant)?;
    let y = match family {
        KernelFamily::Fused => {
            let routes = align_routes(&topk.ids, num_experts, BLOCK_M)?;
            let top_k = topk.ids.dims().get(1).copied().unwrap_or(1);
            let h = moe_gemm::gemm1_silu_mul(&a1, &routes, top_k, &ops.w13)?;
            let a2 = ActOperand::quantize(&h, ops.act_quant)?;
            // Finalize (routing weights, top-k sum) is fused into GEMM2.
            moe_gemm::gemm2_weighted_sum(&a2, &routes, &topk.weights, &ops.w2)?
        }
        KernelFamily::Portable => moe_gemm::portable_expert_loop(
            &a1,
            &topk.ids,
            &topk.weights,
            &ops.w13,
            &ops.w2,
            ops.act_quant,
        )?,
    };
    Ok(y.to_dtype(x.dtype())?)
}
