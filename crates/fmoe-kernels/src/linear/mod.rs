//! `linear`: `y = x·wᵀ` in the nn.Linear layout (the dense projections around attention and the
//! dense MLPs). x `[M, K]`, w `[N, K]`, one dtype and device, f32 accumulation, y `[M, N]` in x's
//! dtype or f32.
//!
//! - CPU twin (`cpu.rs`): f32 dot products through the MoE GEMM's micro-kernel
//!   ([`crate::moe_gemm`]'s `simd::dot_2x4`), weight rows widened a tile at a time; f32, bf16 and
//!   f16.
//! - CUDA: cuBLAS `cublasGemmEx` (tensor cores for bf16/f16, `CUBLAS_COMPUTE_32F`) on the
//!   backend's stream, through [`crate::cublas`]; bf16, f16 and f32. libcublas is loaded at run
//!   time ([`crate::cublas::load`] says where it looks); without it the call is
//!   [`crate::Error::NoCublas`].
//!
//! M = 0 gives an empty `[0, N]`; K = 0 gives zeros.

mod cpu;
mod cuda;

use fmoe_core::{DType, Device, Storage, Tensor};

use crate::{Error, Result};

const OP: &str = "linear::linear";
const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

/// y = x·wᵀ (nn.Linear layout): x [M, K], w [N, K], same dtype (bf16/f16; CPU also f32) and device;
/// y [M, N] in `out` (x's dtype or F32); f32 accumulation. CUDA: cuBLAS (cublasGemmEx), M = 0 ok.
pub fn linear(x: &Tensor, w: &Tensor, out: DType) -> Result<Tensor> {
    let dtype = x.expect_dtype(OP, "x", &DTYPES)?;
    w.expect_dtype(OP, "w", &[dtype])?;
    w.expect_device(OP, "w", x.device())?;
    let &[m, k] = x.expect_rank(OP, "x", 2, "[M, K]")? else {
        unreachable!("rank checked")
    };
    let &[n, wk] = w.expect_rank(OP, "w", 2, "[N, K]")? else {
        unreachable!("rank checked")
    };
    if wk != k {
        return Err(Error::invalid(
            OP,
            format!(
                "x is [{m}, {k}] but w is [{n}, {wk}]: w must be [N, K] with K = {k} (nn.Linear layout)"
            ),
        ));
    }
    if out != dtype && out != DType::F32 {
        return Err(Error::invalid(
            OP,
            format!("output dtype {out} is neither x's dtype ({dtype}) nor f32"),
        ));
    }
    match (x.storage(), w.storage()) {
        (Storage::Cuda(xs), Storage::Cuda(ws)) => {
            let y = cuda::linear(OP, xs, ws, [m, n, k], out)?;
            Ok(Tensor::from_storage(Storage::Cuda(y), [m, n])?)
        }
        (Storage::Cpu(xs), Storage::Cpu(ws)) => {
            let y = cpu::linear(xs, ws, [m, n, k]);
            Ok(Tensor::from_f32(&y, [m, n], out, &Device::Cpu)?)
        }
        _ => unreachable!("devices checked"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], [m, n, k]: [usize; 3]) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k)
                    .map(|c| f64::from(x[i * k + c]) * f64::from(w[j * k + c]))
                    .sum();
            }
        }
        y
    }

    /// Values on a 1/8 grid: bf16-exact inputs whose f32 products and short sums are exact too.
    fn grid(n: usize, salt: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 + salt * 11) % 17) as f32 / 8.0 - 1.0)
            .collect()
    }

    #[test]
    fn matches_a_naive_product_at_odd_sizes() {
        for (m, n, k) in [(0, 5, 3), (1, 1, 1), (3, 7, 9), (7, 13, 37), (5, 70, 200)] {
            let (xv, wv) = (grid(m * k, 1), grid(n * k, 2));
            let want = naive(&xv, &wv, [m, n, k]);
            for dtype in DTYPES {
                let x = Tensor::from_f32(&xv, [m, k], dtype, &Device::Cpu).unwrap();
                let w = Tensor::from_f32(&wv, [n, k], dtype, &Device::Cpu).unwrap();
                let y = linear(&x, &w, DType::F32).unwrap();
                assert_eq!(y.dims(), &[m, n]);
                let got = y.to_f32_vec().unwrap();
                for (g, e) in got.iter().zip(&want) {
                    assert_eq!(f64::from(*g), *e, "{dtype} m={m} n={n} k={k}");
                }
                let yd = linear(&x, &w, dtype).unwrap();
                assert_eq!(yd.dtype(), dtype);
                let rounded = Tensor::from_f32(&got, [m, n], dtype, &Device::Cpu).unwrap();
                assert_eq!(yd.to_f32_vec().unwrap(), rounded.to_f32_vec().unwrap());
            }
        }
    }

    #[test]
    fn k_zero_is_zeros() {
        let x = Tensor::zeros([3, 0], DType::BF16, &Device::Cpu).unwrap();
        let w = Tensor::zeros([4, 0], DType::BF16, &Device::Cpu).unwrap();
        let y = linear(&x, &w, DType::F32).unwrap();
        assert_eq!(y.to_f32_vec().unwrap(), vec![0.0; 12]);
    }

    #[test]
    fn bad_operands_are_errors_naming_them() {
        let cpu = Device::Cpu;
        let x = Tensor::zeros([2, 8], DType::BF16, &cpu).unwrap();
        let w = Tensor::zeros([3, 8], DType::BF16, &cpu).unwrap();
        let wt = Tensor::zeros([8, 3], DType::BF16, &cpu).unwrap();
        let msg = linear(&x, &wt, DType::F32).unwrap_err().to_string();
        assert!(msg.contains("linear") && msg.contains("[N, K]"), "{msg}");
        let wf = Tensor::zeros([3, 8], DType::F32, &cpu).unwrap();
        let msg = linear(&x, &wf, DType::F32).unwrap_err().to_string();
        assert!(msg.contains("`w`") && msg.contains("f32"), "{msg}");
        let msg = linear(&x, &w, DType::F16).unwrap_err().to_string();
        assert!(msg.contains("output dtype f16"), "{msg}");
        let x3 = Tensor::zeros([1, 2, 8], DType::BF16, &cpu).unwrap();
        assert!(
            linear(&x3, &w, DType::F32)
                .unwrap_err()
                .to_string()
                .contains("`x`")
        );
        let q = Tensor::zeros([2, 8], DType::F8E4M3, &cpu).unwrap();
        assert!(linear(&q, &w, DType::F32).is_err());
    }
}
