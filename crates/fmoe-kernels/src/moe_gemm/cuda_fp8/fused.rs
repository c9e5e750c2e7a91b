//! The fused pipeline (see the module docs): GEMM1 with SiLU⊙mul and the quantization of h, GEMM2
//! with the routing weight and the top-k sum.

use fmoe_core::cuda::CudaStorage;
use fmoe_core::{DType, Tensor};

use super::Fp8Scheme;
use super::launch::{Fp8Gemm, cuda_tensor, fp8_routes, launch, operands, plan};
use super::support::{act_kind, check_dims, unsupported};
use crate::Result;
use crate::launch::cuda_storage;
use crate::moe_align::AlignedRoutes;
use crate::moe_gemm::cuda::{Gemm2Sum, gemm2_summed};
use crate::moe_gemm::{ActOperand, ActQuant, ActScale, WeightOperand};
use crate::quant_fp8::{FiniteCheck, cuda as qcuda};

/// The activation quantization that pairs with `scheme` (GEMM1's h is quantized so).
fn act_quant_of(scheme: Fp8Scheme) -> ActQuant {
    match scheme {
        Fp8Scheme::PerTensor => ActQuant::Fp8PerTensor,
        Fp8Scheme::Block => ActQuant::Fp8Group,
    }
}

/// Fused GEMM1: SiLU⊙mul and the quantization of h for GEMM2 (see the module docs), with h's
/// scale from its amax or, per-tensor, a static device scale (`a2_scale`). Returns the GEMM2
/// operand (rows in route order) and the NaN/Inf check of h.
pub(crate) fn gemm1_quant(
    op: &'static str,
    a: &ActOperand,
    routes: &AlignedRoutes,
    top_k: usize,
    w13: &WeightOperand,
    a2_quant: ActQuant,
    a2_scale: &ActScale,
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
        route_rows: false,
    };
    let mut hq = CudaStorage::alloc(backend, DType::F8E4M3, r * n)?;
    match (scheme, a2_scale) {
        (Fp8Scheme::PerTensor, ActScale::Static(s)) => {
            // No amax: GEMM1 writes bf16 h only, the cast uses the scale uploaded at load.
            let sc = cuda_storage(op, "a2_scale", s, device)?;
            let mut h = CudaStorage::alloc(backend, DType::BF16, r * n)?;
            let flag = crate::elementwise::cuda::zeros_chain(
                "moe chain: zero fill",
                backend,
                DType::U32,
                1,
            )?;
            launch(op, &g, Some(&mut h), None, None, None)?;
            {
                let word = flag.buffer().slice(0..4);
                qcuda::cast_with_scale(op, &h, r * n, sc, &mut hq, &word)?;
            }
            Ok((
                ActOperand::Fp8PerTensor {
                    q: cuda_tensor(hq, &[r, n])?,
                    scale: s.clone(),
                },
                FiniteCheck::device_flag(op, "h", cuda_tensor(flag, &[1])?, 0, None),
            ))
        }
        (Fp8Scheme::Block, ActScale::Static(_)) => Err(unsupported(
            op,
            device,
            "a static scale for h needs per-tensor fp8 (the block-scaled GEMM1 quantizes h in \
             1×128 groups)"
                .into(),
        )),
        (Fp8Scheme::PerTensor, ActScale::Dynamic) => {
            // GEMM1 writes bf16 h and atomicMax(|h|) into ctrl[0]; the cast pass turns that into
            // the scale and flags a non-finite amax in ctrl[1].
            let mut h = CudaStorage::alloc(backend, DType::BF16, r * n)?;
            let ctrl = crate::elementwise::cuda::zeros_chain(
                "moe chain: zero fill",
                backend,
                DType::U32,
                2,
            )?;
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
        (Fp8Scheme::Block, ActScale::Dynamic) => {
            let groups = n.div_ceil(qcuda::GROUP);
            let mut hs = CudaStorage::alloc(backend, DType::F32, r * groups)?;
            let flag = crate::elementwise::cuda::zeros_chain(
                "moe chain: zero fill",
                backend,
                DType::U32,
                1,
            )?;
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
pub(crate) fn gemm1_h(
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
        route_rows: false,
    };
    launch(op, &g, Some(&mut h), None, None, None)?;
    cuda_tensor(h, &[r, n])
}

/// Fused GEMM2: y [M, K] in `out_dtype` = Σ routing weight · W2 h over each token's routes:
/// f32 atomics into a zeroed y32 and the cast, or (the warp-specialized kernels with one K split,
/// as `sum` and the rule say: [`crate::moe_gemm::cuda::route_rows_pay`]) per-route bf16 rows and
/// their top-k sum.
pub(crate) fn gemm2(
    op: &'static str,
    h: &ActOperand,
    routes: &AlignedRoutes,
    (topk_ids, topk_weights): (Option<&Tensor>, &Tensor),
    w2: &WeightOperand,
    out_dtype: DType,
    sum: Gemm2Sum,
) -> Result<Tensor> {
    let (scheme, act, weight, device) = operands(op, h, "a2", w2, "w2")?;
    let d = w2.data().dims();
    let (k, n) = (d[1], d[2]);
    check_dims(op, k, n)?;
    let weights = cuda_storage(op, "topk_weights", topk_weights, device)?;
    let (m, top_k) = (topk_weights.dims()[0], topk_weights.dims()[1]);
    let rb = fp8_routes(op, routes, device, scheme)?;
    let backend = act.q.backend();
    let mut g = Fp8Gemm {
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
        route_rows: false,
    };
    let (_, _, splits) = plan(&g, backend.multiprocessor_count() as usize);
    // Route rows: only the warp-specialized kernels with one K split store them.
    let kernel_can = rb.cfg.ws && splits == 1;
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
            g.route_rows = route_rows;
            launch(op, &g, None, None, None, Some(out))
        },
    )
}
