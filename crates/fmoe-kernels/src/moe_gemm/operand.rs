//! GEMM operands as data: what is stored, and which scales turn it back into real values.

use fmoe_core::{DType, Device, Storage, Tensor};

use crate::quant_fp8::{self, FiniteCheck};
use crate::{Error, Result};

/// Width of activation scale groups and weight scale blocks (DeepSeek-V3's 1×128 and 128×128).
pub const QBLOCK: usize = 128;

/// How activations are quantized before a GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActQuant {
    /// Kept in their dtype (bf16/f16/f32).
    None,
    /// e4m3 with one dynamic scale for the whole tensor.
    Fp8PerTensor,
    /// e4m3 with one dynamic scale per row and 128 columns.
    Fp8Group,
}

/// Where the scale of a per-tensor fp8 activation comes from.
#[derive(Clone, Debug, Default)]
pub enum ActScale {
    /// Computed from the tensor's amax for every batch.
    #[default]
    Dynamic,
    /// Fixed, f32 `[1]` on the activations' device (a static checkpoint's `input_scale`, uploaded
    /// once at load): values beyond 448 · scale saturate to ±448.
    Static(Tensor),
}

impl ActScale {
    /// The same scale with its tensor on `device`.
    pub fn to_device(&self, device: Device) -> Result<ActScale> {
        Ok(match self {
            ActScale::Dynamic => ActScale::Dynamic,
            ActScale::Static(s) => ActScale::Static(s.to_device(device)?),
        })
    }
}

/// The A operand of a grouped GEMM: one row per token (GEMM1) or per route (GEMM2).
#[derive(Clone, Debug)]
pub enum ActOperand {
    Plain(Tensor),
    /// e4m3 codes with one dynamic scale: `scale` is f32 `[1]` on the codes' device (on CUDA it is
    /// written by a kernel and never read by the host).
    Fp8PerTensor {
        q: Tensor,
        scale: Tensor,
    },
    /// e4m3 codes with one scale per row and 128 columns: `scales` f32 [rows, ceil(K/128)].
    Fp8Group {
        q: Tensor,
        scales: Tensor,
    },
}

impl ActOperand {
    /// Quantizes `x` [rows, K] as `scheme` says. Both kernel families and the references use this.
    /// NaN/Inf in `x` is an error on every device (on CUDA reading the kernel's flag is a
    /// synchronization: the MoE layer uses [`Self::quantize_deferred`]).
    pub fn quantize(x: &Tensor, scheme: ActQuant) -> Result<ActOperand> {
        let (a, check) = ActOperand::quantize_deferred(x, scheme)?;
        check.check()?;
        Ok(a)
    }

    /// [`Self::quantize`], returning the NaN/Inf check instead of waiting for it on CUDA (nothing
    /// is pending on the CPU, which reports non-finite input at once).
    pub fn quantize_deferred(x: &Tensor, scheme: ActQuant) -> Result<(ActOperand, FiniteCheck)> {
        Ok(match scheme {
            ActQuant::None => (ActOperand::Plain(x.clone()), FiniteCheck::none()),
            ActQuant::Fp8PerTensor => {
                let (q, scale, check) = quant_fp8::quantize_per_tensor_deferred(x)?;
                (ActOperand::Fp8PerTensor { q, scale }, check)
            }
            ActQuant::Fp8Group => {
                let (q, scales, check) = quant_fp8::quantize_per_token_group_deferred(x, QBLOCK)?;
                (ActOperand::Fp8Group { q, scales }, check)
            }
        })
    }

    /// [`Self::quantize_deferred`] with the scale `scale` says: a static scale needs
    /// `ActQuant::Fp8PerTensor` (the codes are `quant_fp8::quantize_static_deferred`'s and the
    /// operand carries that scale tensor).
    pub fn quantize_scaled_deferred(
        x: &Tensor,
        scheme: ActQuant,
        scale: &ActScale,
    ) -> Result<(ActOperand, FiniteCheck)> {
        match (scale, scheme) {
            (ActScale::Dynamic, _) => ActOperand::quantize_deferred(x, scheme),
            (ActScale::Static(s), ActQuant::Fp8PerTensor) => {
                let (q, check) = quant_fp8::quantize_static_deferred(x, s)?;
                Ok((
                    ActOperand::Fp8PerTensor {
                        q,
                        scale: s.clone(),
                    },
                    check,
                ))
            }
            (ActScale::Static(_), other) => Err(Error::invalid(
                "ActOperand::quantize",
                format!(
                    "a static activation scale needs fp8 per-tensor quantization, not {other:?}"
                ),
            )),
        }
    }

    /// [`Self::quantize_scaled_deferred`], waiting for the NaN/Inf check.
    pub fn quantize_scaled(x: &Tensor, scheme: ActQuant, scale: &ActScale) -> Result<ActOperand> {
        let (a, check) = ActOperand::quantize_scaled_deferred(x, scheme, scale)?;
        check.check()?;
        Ok(a)
    }

    /// The quantization scheme this operand carries.
    pub fn scheme(&self) -> ActQuant {
        match self {
            ActOperand::Plain(_) => ActQuant::None,
            ActOperand::Fp8PerTensor { .. } => ActQuant::Fp8PerTensor,
            ActOperand::Fp8Group { .. } => ActQuant::Fp8Group,
        }
    }

    /// The same operand with every tensor on `device`.
    pub fn to_device(&self, device: Device) -> Result<ActOperand> {
        Ok(match self {
            ActOperand::Plain(t) => ActOperand::Plain(t.to_device(device)?),
            ActOperand::Fp8PerTensor { q, scale } => ActOperand::Fp8PerTensor {
                q: q.to_device(device)?,
                scale: scale.to_device(device)?,
            },
            ActOperand::Fp8Group { q, scales } => ActOperand::Fp8Group {
                q: q.to_device(device)?,
                scales: scales.to_device(device)?,
            },
        })
    }

    pub fn data(&self) -> &Tensor {
        match self {
            ActOperand::Plain(t)
            | ActOperand::Fp8PerTensor { q: t, .. }
            | ActOperand::Fp8Group { q: t, .. } => t,
        }
    }

    pub(crate) fn storage(&self) -> &Storage {
        self.data().storage()
    }

    /// Validates shape [rows, cols] and dtypes; returns rows.
    pub(crate) fn check(&self, op: &'static str, name: &str, cols: usize) -> Result<usize> {
        let t = self.data();
        let dims = t.expect_rank(op, name, 2, "[rows, K]")?;
        if dims[1] != cols {
            return Err(fmoe_core::Error::ShapeMismatch {
                op,
                tensor: name.to_string(),
                expected: format!("[rows, {cols}]"),
                got: t.shape().clone(),
            }
            .into());
        }
        let rows = dims[0];
        match self {
            ActOperand::Plain(t) => {
                t.expect_dtype(op, name, &[DType::F32, DType::BF16, DType::F16])?;
            }
            ActOperand::Fp8PerTensor { q, scale } => {
                q.expect_dtype(op, name, &[DType::F8E4M3])?;
                let scale_name = format!("{name}_scale");
                scale.expect_dtype(op, &scale_name, &[DType::F32])?;
                scale.expect_dims(op, &scale_name, &[1])?;
                scale.expect_device(op, &scale_name, q.device())?;
                // The value is checked where it is on the host; on CUDA reading it would be a
                // synchronization (a kernel wrote it from a finite amax, or flagged the input).
                if let Storage::Cpu(_) = scale.storage() {
                    let s = scale.cpu_slice::<f32>(op, &scale_name)?[0];
                    if !(s.is_finite() && s > 0.0) {
                        return Err(Error::invalid(
                            op,
                            format!(
                                "activation scale of `{name}` is {s}; it must be finite and positive"
                            ),
                        ));
                    }
                }
            }
            ActOperand::Fp8Group { q, scales } => {
                q.expect_dtype(op, name, &[DType::F8E4M3])?;
                scales.expect_dtype(op, &format!("{name}_scales"), &[DType::F32])?;
                scales.expect_device(op, &format!("{name}_scales"), q.device())?;
                let want = [rows, cols.div_ceil(QBLOCK)];
                if scales.dims() != want {
                    return Err(Error::ScaleShape {
                        op,
                        tensor: format!("{name}_scales"),
                        expected: format!("{want:?}"),
                        got: scales.shape().clone(),
                    });
                }
            }
        }
        Ok(rows)
    }
}

/// Stacked expert weights [E, rows, K] and their scales.
#[derive(Clone, Debug)]
pub enum WeightOperand {
    /// bf16/f16/f32 values.
    Plain(Tensor),
    /// e4m3 codes with one scale per expert (`scales` f32 \[E\]).
    Fp8PerTensor { q: Tensor, scales: Tensor },
    /// e4m3 codes with one scale per 128×128 block (`scale_inv` f32 [E, ceil(rows/128), ceil(K/128)]).
    Fp8Block { q: Tensor, scale_inv: Tensor },
}

impl WeightOperand {
    /// The same weights with every tensor on `device` (tensors already there are shared).
    pub fn to_device(&self, device: Device) -> Result<WeightOperand> {
        Ok(match self {
            WeightOperand::Plain(t) => WeightOperand::Plain(t.to_device(device)?),
            WeightOperand::Fp8PerTensor { q, scales } => WeightOperand::Fp8PerTensor {
                q: q.to_device(device)?,
                scales: scales.to_device(device)?,
            },
            WeightOperand::Fp8Block { q, scale_inv } => WeightOperand::Fp8Block {
                q: q.to_device(device)?,
                scale_inv: scale_inv.to_device(device)?,
            },
        })
    }

    pub fn data(&self) -> &Tensor {
        match self {
            WeightOperand::Plain(t)
            | WeightOperand::Fp8PerTensor { q: t, .. }
            | WeightOperand::Fp8Block { q: t, .. } => t,
        }
    }

    /// Bytes a kernel reads for one expert (weights and their scales).
    pub fn expert_bytes(&self) -> usize {
        let per = |t: &Tensor| t.size_in_bytes() / t.dims().first().copied().unwrap_or(1).max(1);
        match self {
            WeightOperand::Plain(t) => per(t),
            WeightOperand::Fp8PerTensor { q, .. } => per(q) + 4,
            WeightOperand::Fp8Block { q, scale_inv } => per(q) + per(scale_inv),
        }
    }

    /// Validates shapes and dtypes; returns (E, rows, K).
    pub fn dims(&self, op: &'static str, name: &str) -> Result<(usize, usize, usize)> {
        let t = self.data();
        let d = t.expect_rank(op, name, 3, "[experts, rows, K]")?;
        let (e, rows, k) = (d[0], d[1], d[2]);
        let scale_err = |tensor: String, want: Vec<usize>, got: &Tensor| Error::ScaleShape {
            op,
            tensor,
            expected: format!("{want:?}"),
            got: got.shape().clone(),
        };
        match self {
            WeightOperand::Plain(t) => {
                t.expect_dtype(op, name, &[DType::F32, DType::BF16, DType::F16])?;
            }
            WeightOperand::Fp8PerTensor { q, scales } => {
                q.expect_dtype(op, name, &[DType::F8E4M3])?;
                scales.expect_dtype(op, &format!("{name}_scale"), &[DType::F32])?;
                scales.expect_device(op, &format!("{name}_scale"), q.device())?;
                if scales.dims() != [e] {
                    return Err(scale_err(format!("{name}_scale"), vec![e], scales));
                }
            }
            WeightOperand::Fp8Block { q, scale_inv } => {
                q.expect_dtype(op, name, &[DType::F8E4M3])?;
                scale_inv.expect_dtype(op, &format!("{name}_scale_inv"), &[DType::F32])?;
                scale_inv.expect_device(op, &format!("{name}_scale_inv"), q.device())?;
                let want = vec![e, rows.div_ceil(QBLOCK), k.div_ceil(QBLOCK)];
                if scale_inv.dims() != want.as_slice() {
                    return Err(scale_err(format!("{name}_scale_inv"), want, scale_inv));
                }
            }
        }
        Ok((e, rows, k))
    }
}
