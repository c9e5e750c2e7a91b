//! `elementwise`: the small device-side operations around the MoE GEMMs, each with its CPU twin.
//!
//! - [`to_dtype`]: cast through f32 with round-to-nearest-even (the layer's f32 → bf16 output).
//!   On the CPU it is [`Tensor::to_dtype`]; on CUDA a kernel, so a device tensor never makes a
//!   round trip through the host (`Tensor::to_dtype` itself lives in fmoe-core, which compiles no
//!   kernels, and downloads).
//! - [`add`]: `DT(f32(a) + f32(b))` (the shared expert's sum).
//! - [`randn`]: a counter-based normal fill from a seed (benchmark weights: 22.5 GB of DeepSeek-V3
//!   bf16 experts are written on the device in milliseconds instead of generated on the host and
//!   uploaded). Value `i` is a function of (seed, i) only, so any device and any launch geometry
//!   gives the same tensor (CPU and CUDA agree to a few f32 ulps: ln/cos/sqrt differ slightly).
//! - [`sum`]: the f32 sum of a tensor (the benchmark's read-bandwidth ceiling on CUDA).
//!
//! CUDA kernels: `cuda/elementwise.cu`. Dtypes on CUDA: f32, bf16 and f16 (fp8 and u32 casts are
//! [`fmoe_core::Error::Unsupported`] there); [`sum`] on CUDA takes bf16.

mod cpu;
mod cuda;

pub(crate) use cuda::variants as cuda_variants;

use fmoe_core::{DType, Device, Storage, Tensor};

use crate::Result;

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// A copy of `t` in `dtype` (the same tensor if it already is), on `t`'s device.
pub fn to_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "elementwise::to_dtype";
    if t.dtype() == dtype {
        return Ok(t.clone());
    }
    match t.storage() {
        Storage::Cpu(_) => Ok(t.to_dtype(dtype)?),
        Storage::Cuda(s) => {
            let out = cuda::cast(OP, s, dtype)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), t.shape().clone())?)
        }
    }
}

/// `a + b` elementwise, computed in f32 and rounded once to the operands' dtype (f32, bf16 or
/// f16; same dims, dtype and device).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "elementwise::add";
    let dtype = a.expect_dtype(OP, "a", &FLOATS)?;
    b.expect_dtype(OP, "b", &[dtype])?;
    b.expect_dims(OP, "b", a.dims())?;
    b.expect_device(OP, "b", a.device())?;
    match (a.storage(), b.storage()) {
        (Storage::Cuda(x), Storage::Cuda(y)) => {
            let out = cuda::add(OP, x, y)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), a.shape().clone())?)
        }
        _ => {
            let sum = cpu::add(&a.to_f32_vec()?, &b.to_f32_vec()?);
            Ok(Tensor::from_f32(
                &sum,
                a.shape().clone(),
                dtype,
                &Device::Cpu,
            )?)
        }
    }
}

/// A tensor of `scale · z_i`, `z_i` standard normal from (`seed`, flat index i), in `dtype`
/// (f32, bf16 or f16) on `device`. See the module docs for the generator.
pub fn randn(
    dims: &[usize],
    dtype: DType,
    scale: f32,
    seed: u64,
    device: &Device,
) -> Result<Tensor> {
    const OP: &str = "elementwise::randn";
    if !FLOATS.contains(&dtype) {
        return Err(crate::Error::invalid(
            OP,
            format!("randn fills f32, bf16 or f16 tensors, not {dtype}"),
        ));
    }
    match device {
        Device::Cpu => {
            let n = dims.iter().product();
            Ok(Tensor::from_f32(
                &cpu::randn(n, scale, seed),
                dims,
                dtype,
                device,
            )?)
        }
        Device::Cuda(i) => {
            let backend = fmoe_core::cuda::cuda_backend(*i)?;
            let n = dims.iter().product();
            let out = cuda::randn(OP, &backend, dtype, n, scale, seed)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), dims)?)
        }
    }
}

/// The sum of all elements, f32 `[1]`, on `t`'s device. The CPU adds in f64 and rounds once; the
/// CUDA kernel (bf16 input only) adds in f32 in an unspecified order.
pub fn sum(t: &Tensor) -> Result<Tensor> {
    const OP: &str = "elementwise::sum";
    t.expect_dtype(OP, "x", &FLOATS)?;
    match t.storage() {
        Storage::Cpu(_) => {
            let s = cpu::sum(&t.to_f32_vec()?);
            Ok(Tensor::from_vec(vec![s], [1], &Device::Cpu)?)
        }
        Storage::Cuda(s) => {
            let out = cuda::sum(OP, s)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), [1])?)
        }
    }
}

/// The CPU twin's normal value `i` of `seed` (what [`randn`] writes before scaling and rounding).
pub fn normal_at(seed: u64, i: u64) -> f32 {
    cpu::normal(seed, i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn randn_is_standard_normal_and_reproducible() {
        let t = randn(&[100_000], DType::F32, 1.0, 7, &Device::Cpu).unwrap();
        let v = t.to_f32_vec().unwrap();
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.03, "var {var}");
        assert!(v.iter().all(|x| x.is_finite()));
        let again = randn(&[100_000], DType::F32, 1.0, 7, &Device::Cpu).unwrap();
        assert_eq!(again.to_f32_vec().unwrap(), v);
        let other = randn(&[100_000], DType::F32, 1.0, 8, &Device::Cpu).unwrap();
        assert_ne!(other.to_f32_vec().unwrap(), v);
        // Scale and dtype: bf16 of scale·z.
        let b = randn(&[1000], DType::BF16, 0.5, 7, &Device::Cpu).unwrap();
        let want: Vec<f32> = v[..1000]
            .iter()
            .map(|&z| fmoe_core::bf16::from_f32(0.5 * z).to_f32())
            .collect();
        assert_eq!(b.to_f32_vec().unwrap(), want);
        assert!(randn(&[2], DType::U32, 1.0, 0, &Device::Cpu).is_err());
    }

    #[test]
    fn add_rounds_once_and_checks_operands() {
        let a = Tensor::from_f32(&[1.0, 2.0, 1.0 / 3.0], [3], DType::BF16, &Device::Cpu).unwrap();
        let b = Tensor::from_f32(&[0.5, -2.0, 1.0 / 3.0], [3], DType::BF16, &Device::Cpu).unwrap();
        let s = add(&a, &b).unwrap();
        assert_eq!(s.dtype(), DType::BF16);
        let third = fmoe_core::bf16::from_f32(1.0 / 3.0).to_f32();
        assert_eq!(
            s.to_f32_vec().unwrap(),
            vec![1.5, 0.0, fmoe_core::bf16::from_f32(third + third).to_f32()]
        );
        let c = Tensor::from_f32(&[1.0, 2.0], [2], DType::BF16, &Device::Cpu).unwrap();
        assert!(add(&a, &c).unwrap_err().to_string().contains("`b`"));
        let d = a.to_dtype(DType::F32).unwrap();
        assert!(add(&a, &d).is_err());
    }

    #[test]
    fn sum_and_to_dtype_on_the_cpu() {
        let t = Tensor::from_vec(vec![1.0f32, 2.5, -0.5], [3], &Device::Cpu).unwrap();
        assert_eq!(sum(&t).unwrap().to_f32_vec().unwrap(), vec![3.0]);
        let h = to_dtype(&t, DType::F16).unwrap();
        assert_eq!(h.dtype(), DType::F16);
        assert_eq!(h.to_f32_vec().unwrap(), vec![1.0, 2.5, -0.5]);
    }
}
