//! The f64 reference of the MoE layer, written independently of the kernels: weights and
//! activations become f64 values (codes × scales), every sum runs in f64. Only the activation
//! quantization itself is shared with the kernels (the same `ActOperand::quantize`), so a
//! comparison with the same operands measures the GEMMs, and a comparison with
//! [`ExpertOperands::unquantized`] weights measures fp8 as a whole.

use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::moe_gemm::{ActOperand, ActQuant, ActScale, QBLOCK, WeightOperand};
use fmoe_kernels::routing::TopK;
use rayon::prelude::*;

use crate::Result;
use crate::stages::ExpertOperands;

impl ExpertOperands {
    /// Dense operands with unquantized activations (the "unquantized reference" of a method).
    pub fn unquantized(w13: &Tensor, w2: &Tensor) -> ExpertOperands {
        ExpertOperands {
            w13: WeightOperand::Plain(w13.clone()),
            w2: WeightOperand::Plain(w2.clone()),
            act_quant: ActQuant::None,
            a13_scale: ActScale::Dynamic,
            a2_scale: ActScale::Dynamic,
        }
    }
}

/// Real values of an activation operand, row-major [rows, cols].
fn act_values(a: &ActOperand) -> Result<Vec<f64>> {
    let data: Vec<f64> = a.data().to_f32_vec()?.into_iter().map(f64::from).collect();
    let cols = a.data().dims()[1].max(1);
    Ok(match a {
        ActOperand::Plain(_) => data,
        ActOperand::Fp8PerTensor { scale, .. } => {
            let s = f64::from(scale.to_f32_vec()?[0]);
            data.iter().map(|v| v * s).collect()
        }
        ActOperand::Fp8Group { scales, .. } => {
            let s = scales.to_f32_vec()?;
            let g = cols.div_ceil(QBLOCK);
            data.iter()
                .enumerate()
                .map(|(i, v)| v * f64::from(s[(i / cols) * g + (i % cols) / QBLOCK]))
                .collect()
        }
    })
}

/// Real values of expert `e`, row-major [rows, cols].
fn expert_values(w: &WeightOperand, e: usize) -> Result<Vec<f64>> {
    let d = w.data().dims();
    let (rows, cols) = (d[1], d[2]);
    let data: Vec<f64> = w
        .data()
        .index0(e)?
        .to_f32_vec()?
        .into_iter()
        .map(f64::from)
        .collect();
    Ok(match w {
        WeightOperand::Plain(_) => data,
        WeightOperand::Fp8PerTensor { scales, .. } => {
            let s = f64::from(scales.to_f32_vec()?[e]);
            data.iter().map(|v| v * s).collect()
        }
        WeightOperand::Fp8Block { scale_inv, .. } => {
            let s = scale_inv.index0(e)?.to_f32_vec()?;
            let cb = cols.div_ceil(QBLOCK);
            let _ = rows;
            data.iter()
                .enumerate()
                .map(|(i, v)| {
                    v * f64::from(s[(i / cols.max(1)) / QBLOCK * cb + (i % cols.max(1)) / QBLOCK])
                })
                .collect()
        }
    })
}

/// y [M, K] in f64 for `x` [M, K] routed by `topk` through `ops`.
pub fn moe_f64(x: &Tensor, topk: &TopK, ops: &ExpertOperands) -> Result<Vec<f64>> {
    moe_f64_h_rounded(x, topk, ops, None)
}

/// [`moe_f64`] with the intermediate h rounded to `h_dtype` (f64 → f32 → `h_dtype`, round to
/// nearest even) before it is quantized for GEMM2, when `ops` quantizes activations. This is the
/// reference with the same operands for the CUDA fp8 per-tensor path, whose GEMM1 writes h in
/// bf16 and requantizes that (`h_dtype` = bf16); the CPU twins quantize f32 h (`None`).
pub fn moe_f64_h_rounded(
    x: &Tensor,
    topk: &TopK,
    ops: &ExpertOperands,
    h_dtype: Option<DType>,
) -> Result<Vec<f64>> {
    let (m, k) = (x.dims()[0], x.dims()[1]);
    let ids = topk.ids.to_f32_vec()?;
    let weights = topk.weights.to_f32_vec()?;
    let top_k = topk.ids.dims()[1];
    let (e_count, n) = (ops.w13.data().dims()[0], ops.w2.data().dims()[2]);
    // Static scales where each quantization runs (a1 on x's device, h on the CPU).
    let a13_scale = ops.a13_scale.to_device(x.device())?;
    let a2_scale = ops.a2_scale.to_device(Device::Cpu)?;
    let a1 = act_values(&ActOperand::quantize_scaled(x, ops.act_quant, &a13_scale)?)?;
    let silu = |v: f64| v / (1.0 + (-v).exp());

    let mut h = vec![0f64; m * top_k * n];
    for e in 0..e_count {
        let routes: Vec<usize> = (0..m * top_k).filter(|&r| ids[r] as usize == e).collect();
        if routes.is_empty() {
            continue;
        }
        let w = expert_values(&ops.w13, e)?;
        let rows: Vec<(usize, Vec<f64>)> = routes
            .par_iter()
            .map(|&r| {
                let xt = &a1[(r / top_k) * k..(r / top_k + 1) * k];
                let dot = |row: usize| {
                    xt.iter()
                        .zip(&w[row * k..(row + 1) * k])
                        .map(|(a, b)| a * b)
                        .sum::<f64>()
                };
                (r, (0..n).map(|j| silu(dot(j)) * dot(n + j)).collect())
            })
            .collect();
        for (r, row) in rows {
            h[r * n..(r + 1) * n].copy_from_slice(&row);
        }
    }
    let a2 = match ops.act_quant {
        ActQuant::None => h,
        q => {
            let h32: Vec<f32> = h.iter().map(|&v| v as f32).collect();
            let dtype = h_dtype.unwrap_or(DType::F32);
            let t = Tensor::from_f32(&h32, [m * top_k, n], dtype, &Device::Cpu)?;
            act_values(&ActOperand::quantize_scaled(&t, q, &a2_scale)?)?
        }
    };

    let mut y = vec![0f64; m * k];
    for e in 0..e_count {
        let routes: Vec<usize> = (0..m * top_k).filter(|&r| ids[r] as usize == e).collect();
        if routes.is_empty() {
            continue;
        }
        let w = expert_values(&ops.w2, e)?;
        let outs: Vec<(usize, Vec<f64>)> = routes
            .par_iter()
            .map(|&r| {
                let hr = &a2[r * n..(r + 1) * n];
                (
                    r,
                    (0..k)
                        .map(|c| {
                            hr.iter()
                                .zip(&w[c * n..(c + 1) * n])
                                .map(|(a, b)| a * b)
                                .sum()
                        })
                        .collect(),
                )
            })
            .collect();
        for (r, out) in outs {
            let t = r / top_k;
            let wt = f64::from(weights[r]);
            for (yc, o) in y[t * k..(t + 1) * k].iter_mut().zip(out) {
                *yc += wt * o;
            }
        }
    }
    Ok(y)
}

/// ‖got − want‖₂ / ‖want‖₂ (0 when both are zero).
pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += (f64::from(*g) - w).powi(2);
        den += w * w;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}
