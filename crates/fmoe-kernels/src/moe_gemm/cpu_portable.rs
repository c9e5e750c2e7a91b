//! The unfused CPU baseline, written the way Hugging Face's Mixtral block runs: one expert at a
//! time, its weights dequantized into a full f32 copy, then GEMM1, the activation, GEMM2 and a
//! weighted scatter-add as separate single-threaded passes.

use fmoe_core::{Device, Tensor};

use super::cpu::{ActRows, WeightRows, WeightScale, silu};
use super::operand::{ActOperand, ActQuant, ActScale, QBLOCK, WeightOperand};
use super::simd::dot;
use crate::Result;

const OP: &str = "moe_gemm::portable_expert_loop";

/// Expert `e` of `w` as real values [rows, cols] (a materialized copy).
fn dequantize_expert(w: &WeightRows, e: usize) -> Vec<f32> {
    let mut out = Vec::new();
    w.convert(e, 0..w.rows, &mut out);
    match w.scale {
        WeightScale::One => {}
        WeightScale::PerExpert(s) => out.iter_mut().for_each(|v| *v *= s[e]),
        WeightScale::Block(s) => {
            let (rb, cb) = (w.rows.div_ceil(QBLOCK), w.cols.div_ceil(QBLOCK));
            for (r, row) in out.chunks_mut(w.cols.max(1)).enumerate() {
                for (c, v) in row.iter_mut().enumerate() {
                    *v *= s[(e * rb + r / QBLOCK) * cb + c / QBLOCK];
                }
            }
        }
    }
    out
}

pub(super) fn expert_loop(
    a1: &ActOperand,
    topk_ids: &Tensor,
    topk_weights: &Tensor,
    w13: &WeightOperand,
    w2: &WeightOperand,
    a2_quant: ActQuant,
    a2_scale: &ActScale,
) -> Result<Tensor> {
    let x = ActRows::from_operand(a1, OP)?;
    let x_values = x.dequantized();
    let w13 = WeightRows::new(w13, OP, "w13")?;
    let w2r = WeightRows::new(w2, OP, "w2")?;
    let ids = topk_ids.cpu_slice::<u32>(OP, "topk_ids")?;
    let weights = topk_weights.cpu_slice::<f32>(OP, "topk_weights")?;
    let (m, top_k) = (topk_ids.dims()[0], topk_ids.dims()[1]);
    let (n, k) = (w2r.cols, w2r.rows);
    let num_experts = w13.experts;
    if let Some((route, &id)) = ids
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= num_experts)
    {
        return Err(crate::Error::ExpertId {
            op: OP,
            id,
            route,
            experts: num_experts,
        });
    }

    // Pass 1: GEMM1 and the activation, expert by expert.
    let mut h = vec![0.0f32; m * top_k * n];
    for e in 0..num_experts {
        let routes: Vec<usize> = (0..m * top_k).filter(|&r| ids[r] as usize == e).collect();
        if routes.is_empty() {
            continue;
        }
        let w = dequantize_expert(&w13, e);
        for &r in &routes {
            let xt = &x_values[(r / top_k) * k..(r / top_k + 1) * k];
            for j in 0..n {
                let gate = dot(xt, &w[j * k..(j + 1) * k]);
                let up = dot(xt, &w[(n + j) * k..(n + j + 1) * k]);
                h[r * n + j] = silu(gate) * up;
            }
        }
    }

    // Pass 2: quantize the intermediate as the method says, then back to values.
    let h = Tensor::from_vec(h, [m * top_k, n], &Device::Cpu)?;
    let h = ActRows::from_operand(&ActOperand::quantize_scaled(&h, a2_quant, a2_scale)?, OP)?
        .dequantized();

    // Pass 3: GEMM2 and the weighted scatter-add.
    let mut y = vec![0.0f32; m * k];
    for e in 0..num_experts {
        let routes: Vec<usize> = (0..m * top_k).filter(|&r| ids[r] as usize == e).collect();
        if routes.is_empty() {
            continue;
        }
        let w = dequantize_expert(&w2r, e);
        for &r in &routes {
            let hr = &h[r * n..(r + 1) * n];
            let t = r / top_k;
            for c in 0..k {
                y[t * k + c] += weights[r] * dot(hr, &w[c * n..(c + 1) * n]);
            }
        }
    }
    Ok(Tensor::from_vec(y, [m, k], &Device::Cpu)?)
}
