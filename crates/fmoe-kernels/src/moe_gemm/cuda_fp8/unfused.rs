//! The portable (unfused) pipeline (see the module docs): the same kernels, every intermediate in
//! device memory, each step a launch.

use fmoe_core::cuda::cudarc::driver::PushKernelArg;
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{DType, Tensor};

use super::launch::{Fp8Gemm, Operand, cuda_tensor, fp8_routes, launch, operands, weight_parts};
use super::support::{check_arch, check_dims, pair_scheme, unsupported};
use super::{FP8_K_MULTIPLE, Fp8GemmConfig, Fp8Scheme};
use crate::launch::{cuda_storage, u32_arg};
use crate::moe_align::align_routes;
use crate::moe_gemm::cuda::{GLUE_FAMILY, GLUE_SRC, glue_launch};
use crate::moe_gemm::{ActOperand, ActQuant, ActScale, WeightOperand};
use crate::nvrtc;
use crate::quant_fp8::{FiniteCheck, cuda as qcuda};
use crate::{Error, Result};

/// The unfused fp8 baseline on CUDA (see the module docs): y f32 [M, K] and the NaN/Inf check of
/// the requantized h (`a2`: its quantization, and for per-tensor a static scale or none).
pub(crate) fn portable(
    op: &'static str,
    a1: &ActOperand,
    topk_ids: &Tensor,
    topk_weights: &Tensor,
    w13: &WeightOperand,
    w2: &WeightOperand,
    (a2_quant, a2_scale): (ActQuant, &ActScale),
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
        route_rows: false,
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
    let (hq, hs, check) = match (scheme, a2_scale) {
        (Fp8Scheme::PerTensor, ActScale::Static(s)) => {
            let sc = cuda_storage(op, "a2_scale", s, device)?;
            let (hq, flag) = qcuda::per_tensor_static(op, &h, sc)?;
            let check = FiniteCheck::device_flag(op, "h", cuda_tensor(flag, &[1])?, 0, None);
            (hq, sc.clone(), check)
        }
        (Fp8Scheme::Block, ActScale::Static(_)) => {
            return Err(unsupported(
                op,
                device,
                "a static scale for h needs per-tensor fp8".into(),
            ));
        }
        (Fp8Scheme::PerTensor, ActScale::Dynamic) => {
            let (hq, hs, ctrl) = qcuda::per_tensor(op, &h)?;
            let check = FiniteCheck::device_flag(op, "h", cuda_tensor(ctrl, &[2])?, 1, None);
            (hq, hs, check)
        }
        (Fp8Scheme::Block, ActScale::Dynamic) => {
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
        route_rows: false,
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
