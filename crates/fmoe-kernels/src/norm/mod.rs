//! `norm`: RMSNorm as transformers computes it, and vLLM's fused residual add + RMSNorm.
//!
//! For a row x of width H (f32 math, `DT` = the tensors' dtype, roundings as in transformers'
//! `LlamaRMSNorm`/`MixtralRMSNorm`/`DeepseekV3RMSNorm`):
//! `n = DT(x · rsqrt(mean(x²) + eps))`, `y = DT(w · n)`. The mean is a sum of squares in f32 on
//! CUDA (a tree over the block) and in f64 on the CPU, rounded to f32: the two differ by f32
//! rounding of the sum only. [`add_rms_norm`] first forms `r' = DT(r + x)` and normalizes r'.
//!
//! Dtypes f32, bf16, f16; x `[M, H]`, w `[H]`, one dtype and device. CUDA: `cuda/norm.cu`, one
//! block per row, 16-byte loads when H allows.

pub(crate) mod cpu;
pub(crate) mod cuda;

use fmoe_core::{DType, Device, Storage, Tensor};

use crate::{Error, Result};

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// (M, H) after checking x [M, H] and w [H] (same dtype and device).
fn check(op: &'static str, x: &Tensor, w: &Tensor, eps: f32) -> Result<(usize, usize)> {
    let dtype = x.expect_dtype(op, "x", &DTYPES)?;
    let &[m, h] = x.expect_rank(op, "x", 2, "[M, H]")? else {
        unreachable!("rank checked")
    };
    w.expect_dims(op, "w", &[h])?;
    w.expect_dtype(op, "w", &[dtype])?;
    w.expect_device(op, "w", x.device())?;
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::invalid(
            op,
            format!("eps = {eps} must be finite and >= 0"),
        ));
    }
    Ok((m, h))
}

/// RMSNorm as transformers computes it: n = dtype(x_f32 · rsqrt(mean(x_f32²) + eps)); y = dtype(w · n).
/// x \[M, H\], w \[H\], same dtype.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    const OP: &str = "norm::rms_norm";
    let (m, h) = check(OP, x, w, eps)?;
    match (x.storage(), w.storage()) {
        (Storage::Cuda(xs), Storage::Cuda(ws)) => {
            let y = cuda::rms_norm(OP, xs, ws, m, h, eps)?;
            Ok(Tensor::from_storage(Storage::Cuda(y), [m, h])?)
        }
        _ => {
            let y = cpu::rms_norm(&x.to_f32_vec()?, &w.to_f32_vec()?, h, eps, x.dtype());
            Ok(Tensor::from_f32(&y, [m, h], x.dtype(), &Device::Cpu)?)
        }
    }
}

/// Fused residual add + RMSNorm (vLLM's fused_add_rms_norm): r' = dtype(r + x); returns (r', rms_norm(r', w, eps)).
pub fn add_rms_norm(
    residual: &Tensor,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "norm::add_rms_norm";
    let (m, h) = check(OP, x, w, eps)?;
    residual.expect_dims(OP, "residual", &[m, h])?;
    residual.expect_dtype(OP, "residual", &[x.dtype()])?;
    residual.expect_device(OP, "residual", x.device())?;
    match (residual.storage(), x.storage(), w.storage()) {
        (Storage::Cuda(rs), Storage::Cuda(xs), Storage::Cuda(ws)) => {
            let (r, y) = cuda::add_rms_norm(OP, rs, xs, ws, m, h, eps)?;
            Ok((
                Tensor::from_storage(Storage::Cuda(r), [m, h])?,
                Tensor::from_storage(Storage::Cuda(y), [m, h])?,
            ))
        }
        _ => {
            let dtype = x.dtype();
            let sum = crate::elementwise::add(residual, x)?;
            let y = cpu::rms_norm(&sum.to_f32_vec()?, &w.to_f32_vec()?, h, eps, dtype);
            Ok((sum, Tensor::from_f32(&y, [m, h], dtype, &Device::Cpu)?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fmoe_core::bf16;

    fn round(v: f64) -> f64 {
        f64::from(bf16::from_f64(v).to_f32())
    }

    #[test]
    fn rounds_like_transformers() {
        let (m, h) = (3, 37);
        let x: Vec<f32> = (0..m * h)
            .map(|i| ((i * 29 % 23) as f32 - 11.0) / 3.0)
            .collect();
        let w: Vec<f32> = (0..h).map(|i| 1.0 + (i % 5) as f32 / 16.0).collect();
        let xt = Tensor::from_f32(&x, [m, h], DType::BF16, &Device::Cpu).unwrap();
        let wt = Tensor::from_f32(&w, [h], DType::BF16, &Device::Cpu).unwrap();
        let (xb, wb) = (xt.to_f32_vec().unwrap(), wt.to_f32_vec().unwrap());
        let y = rms_norm(&xt, &wt, 1e-5).unwrap().to_f32_vec().unwrap();
        for r in 0..m {
            let row = &xb[r * h..(r + 1) * h];
            let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / h as f64;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            for c in 0..h {
                let want = round(f64::from(wb[c]) * round(f64::from(row[c]) * inv));
                let got = f64::from(y[r * h + c]);
                // One bf16 ulp: f32 vs f64 arithmetic may round a tie the other way.
                assert!(
                    (got - want).abs() <= want.abs() / 128.0 + 1e-30,
                    "{r},{c}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn add_rms_norm_is_add_then_norm() {
        let (m, h) = (2, 8);
        let r: Vec<f32> = (0..m * h).map(|i| i as f32 / 7.0).collect();
        let x: Vec<f32> = (0..m * h).map(|i| 1.0 - i as f32 / 5.0).collect();
        let w = vec![0.5f32; h];
        let t = |v: &[f32], d: &[usize]| Tensor::from_f32(v, d, DType::BF16, &Device::Cpu).unwrap();
        let (rt, xt, wt) = (t(&r, &[m, h]), t(&x, &[m, h]), t(&w, &[h]));
        let (sum, y) = add_rms_norm(&rt, &xt, &wt, 1e-6).unwrap();
        let want_sum = crate::elementwise::add(&rt, &xt).unwrap();
        assert_eq!(sum.to_f32_vec().unwrap(), want_sum.to_f32_vec().unwrap());
        let want_y = rms_norm(&want_sum, &wt, 1e-6).unwrap();
        assert_eq!(y.to_f32_vec().unwrap(), want_y.to_f32_vec().unwrap());
        // A zero row stays zero (eps > 0).
        let z = Tensor::zeros([1, h], DType::F32, &Device::Cpu).unwrap();
        let wf = Tensor::from_f32(&w, [h], DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            rms_norm(&z, &wf, 1e-6).unwrap().to_f32_vec().unwrap(),
            vec![0.0; h]
        );
    }

    #[test]
    fn bad_operands_are_errors() {
        let cpu = Device::Cpu;
        let x = Tensor::zeros([2, 8], DType::BF16, &cpu).unwrap();
        let w = Tensor::zeros([8], DType::BF16, &cpu).unwrap();
        let w7 = Tensor::zeros([7], DType::BF16, &cpu).unwrap();
        assert!(
            rms_norm(&x, &w7, 1e-5)
                .unwrap_err()
                .to_string()
                .contains("`w`")
        );
        let wf = Tensor::zeros([8], DType::F32, &cpu).unwrap();
        assert!(
            rms_norm(&x, &wf, 1e-5)
                .unwrap_err()
                .to_string()
                .contains("`w`")
        );
        assert!(
            rms_norm(&x, &w, f32::NAN)
                .unwrap_err()
                .to_string()
                .contains("eps")
        );
        let r = Tensor::zeros([3, 8], DType::BF16, &cpu).unwrap();
        let msg = add_rms_norm(&r, &x, &w, 1e-5).unwrap_err().to_string();
        assert!(msg.contains("`residual`"), "{msg}");
    }
}
