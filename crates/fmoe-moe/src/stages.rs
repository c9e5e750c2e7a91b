//! The expert pipeline shared by every method: prepare → experts → finalize.
//!
//! The same code runs on every device: the kernel library dispatches on the tensors' storage. On
//! CUDA the whole pipeline is issued on the backend's stream without a host synchronization
//! (bf16, and fp8 per-tensor or block-scaled on sm_90). The NaN/Inf flags of the CUDA
//! quantization kernels come back as a [`FiniteCheck`] from [`run_experts_deferred`], to read
//! where the caller synchronizes anyway; [`run_experts`] drops it (on the CPU non-finite values
//! are reported at once, so nothing is ever pending there).

use fmoe_core::{Device, Tensor};
use fmoe_kernels::elementwise;
use fmoe_kernels::moe_align::align_routes_tiled;
use fmoe_kernels::moe_gemm::{self, ActOperand, ActQuant, ActScale, Gemm2Sum, WeightOperand};
use fmoe_kernels::quant_fp8::FiniteCheck;
use fmoe_kernels::routing::TopK;

use crate::{KernelFamily, Result};

/// Rows of a GEMM tile on the CPU's fused path; each expert's routes are padded to it. On CUDA the
/// kernel variant's own M tiles are used ([`moe_gemm::tiling_for`]).
pub const BLOCK_M: usize = 16;

/// Expert weights ready for a kernel, with the activation quantization their method implies.
#[derive(Clone, Debug)]
pub struct ExpertOperands {
    pub w13: WeightOperand,
    pub w2: WeightOperand,
    pub act_quant: ActQuant,
    /// Scale of a1 (GEMM1's input) and of h (GEMM2's input): dynamic, or static tensors on the
    /// weights' device (fp8 per-tensor only).
    pub a13_scale: ActScale,
    pub a2_scale: ActScale,
}

impl ExpertOperands {
    /// The same operands with every tensor on `device` (e.g. a CUDA layer's processed weights
    /// downloaded for the f64 reference).
    pub fn to_device(&self, device: Device) -> Result<ExpertOperands> {
        Ok(ExpertOperands {
            w13: self.w13.to_device(device)?,
            w2: self.w2.to_device(device)?,
            act_quant: self.act_quant,
            a13_scale: self.a13_scale.to_device(device)?,
            a2_scale: self.a2_scale.to_device(device)?,
        })
    }
}

/// y = Σ_j w_j · W2_e(silu(W1_e x) ⊙ W3_e x) for every token of `x` [M, K]; returns x's dtype,
/// on x's device. On CUDA the quantization kernels' NaN/Inf flags are not read (see
/// [`run_experts_deferred`]).
pub fn run_experts(
    x: &Tensor,
    topk: &TopK,
    ops: &ExpertOperands,
    family: KernelFamily,
) -> Result<Tensor> {
    Ok(run_experts_deferred(x, topk, ops, family)?.0)
}

/// [`run_experts`], also returning the NaN/Inf check of every dynamic quantization it issued
/// (a1, and the intermediate h); nothing is pending on the CPU.
pub fn run_experts_deferred(
    x: &Tensor,
    topk: &TopK,
    ops: &ExpertOperands,
    family: KernelFamily,
) -> Result<(Tensor, FiniteCheck)> {
    let device = x.device();
    let num_experts = ops.w13.data().dims().first().copied().unwrap_or(0);
    moe_gemm::check_device_support(device, ops.act_quant, &ops.w13, &ops.w2)?;
    // Prepare: quantize a1 (same function on both paths).
    let (a1, mut check) = ActOperand::quantize_scaled_deferred(x, ops.act_quant, &ops.a13_scale)?;
    let y = match family {
        KernelFamily::Fused => {
            let tiling = moe_gemm::tiling_for(
                device,
                BLOCK_M,
                topk.ids.elem_count(),
                num_experts,
                &ops.w13,
            )?;
            let routes = align_routes_tiled(&topk.ids, num_experts, tiling)?;
            let top_k = topk.ids.dims().get(1).copied().unwrap_or(1);
            // Experts: GEMM1 with SiLU⊙mul and the quantization of h (a2) for GEMM2.
            let (a2, c2) = moe_gemm::gemm1_silu_mul_quant_scaled(
                &a1,
                &routes,
                top_k,
                &ops.w13,
                ops.act_quant,
                &ops.a2_scale,
            )?;
            check.merge(c2);
            // Finalize (routing weights, top-k sum) is fused into GEMM2, which returns x's dtype:
            // f32 reductions and a cast, or at large M per-route rows and their top-k sum
            // (`moe_gemm::gemm2_weighted_sum_to`).
            moe_gemm::gemm2_weighted_sum_to(
                &a2,
                &routes,
                &topk.ids,
                &topk.weights,
                &ops.w2,
                x.dtype(),
                Gemm2Sum::Auto,
            )?
        }
        KernelFamily::Portable => {
            let (y, c) = moe_gemm::portable_expert_loop_scaled_deferred(
                &a1,
                &topk.ids,
                &topk.weights,
                &ops.w13,
                &ops.w2,
                ops.act_quant,
                &ops.a2_scale,
            )?;
            check.merge(c);
            y
        }
    };
    // f32 → x's dtype on the device (a cast kernel on CUDA, no host round trip; a no-op for the
    // fused path, whose y already has it).
    Ok((elementwise::to_dtype(&y, x.dtype())?, check))
}
