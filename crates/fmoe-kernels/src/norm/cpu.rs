//! CPU twin of `norm`. Rows are independent; the sum of squares accumulates in f64.

use fmoe_core::DType;
use rayon::prelude::*;

/// f32 → `dtype` → f32 (round to nearest even), the kernels' `DT(v)`.
pub(crate) fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => fmoe_core::bf16::from_f32(v).to_f32(),
        DType::F16 => fmoe_core::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// y = DT(w · DT(x · rsqrt(mean(x²) + eps))) per row of width `h` (x and w already DT values).
pub(super) fn rms_norm(x: &[f32], w: &[f32], h: usize, eps: f32, dtype: DType) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    if h == 0 {
        return y;
    }
    y.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .for_each(|(out, row)| {
            let ms = row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                / h as f64;
            let inv = 1.0 / ((ms as f32) + eps).sqrt();
            for ((o, &v), &g) in out.iter_mut().zip(row).zip(w) {
                *o = round_to(dtype, g * round_to(dtype, v * inv));
            }
        });
    y
}
