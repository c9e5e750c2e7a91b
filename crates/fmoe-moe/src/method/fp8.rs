use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::moe_gemm::{ActQuant, ActScale, WeightOperand};
use fmoe_kernels::quant_fp8::{self, FP8_BLOCK};

use super::{CheckpointExperts, MoeMethod, not_processed, static_needs_per_tensor};
use crate::stages::ExpertOperands;
use crate::{ActScales, Error, KernelFamily, QuantScheme, Result};

const NAME: &str = "Fp8MoeMethod";

/// e4m3 expert weights, per-tensor (Mixtral-FP8) or 128×128 block-scaled (DeepSeek-V3), with
/// activation quantization to match: dynamic, or per-tensor with static scales
/// ([`ActScales::Static`], set through [`MoeMethod::set_act_scales`]). Accepts fp8 checkpoints
/// of its scheme, or dense weights that it quantizes online.
#[derive(Debug)]
pub struct Fp8MoeMethod {
    scheme: QuantScheme,
    act_scales: ActScales,
    checkpoint: Option<CheckpointExperts>,
    operands: Option<ExpertOperands>,
}

impl Fp8MoeMethod {
    pub fn create_weights(
        scheme: QuantScheme,
        experts: CheckpointExperts,
        (e, k, n): (usize, usize, usize),
    ) -> Result<Self> {
        let fits = matches!(
            (&experts, scheme),
            (CheckpointExperts::Dense { .. }, _)
                | (
                    CheckpointExperts::Fp8PerTensor { .. },
                    QuantScheme::Fp8PerTensor
                )
                | (CheckpointExperts::Fp8Block { .. }, QuantScheme::Fp8Block)
        );
        if !fits || scheme == QuantScheme::Unquantized {
            return Err(Error::Weights {
                method: NAME,
                msg: format!("cannot serve {} experts as {scheme}", experts.kind()),
            });
        }
        experts.check_dims(NAME, e, k, n)?;
        let (w13, w2) = experts.weights();
        let allowed: &[DType] = match experts {
            CheckpointExperts::Dense { .. } => &[DType::BF16, DType::F16, DType::F32],
            _ => &[DType::F8E4M3],
        };
        w13.expect_dtype(NAME, "w13", allowed)?;
        w2.expect_dtype(NAME, "w2", allowed)?;
        Ok(Fp8MoeMethod {
            scheme,
            act_scales: ActScales::Dynamic,
            checkpoint: Some(experts),
            operands: None,
        })
    }
}

impl MoeMethod for Fp8MoeMethod {
    fn scheme(&self) -> QuantScheme {
        self.scheme
    }

    /// Per-tensor: one scale per expert and matrix; a checkpoint's separate w1/w3 scales are
    /// merged by requantizing both halves to their max. Block: the checkpoint's scales are kept.
    /// Dense weights are quantized here (online quantization), on the weights' device (CUDA:
    /// the `quant_fp8` kernels, bf16 or f32 weights; one synchronization per quantization for its
    /// NaN/Inf check, at load time). The kernels read the resulting row-major layout directly;
    /// every operand stays on the checkpoint's device.
    fn process_weights_after_loading(&mut self, _kernel: KernelFamily) -> Result<()> {
        let Some(ckpt) = self.checkpoint.take() else {
            return Ok(());
        };
        let (w13, w2, act_quant) = match (ckpt, self.scheme) {
            (CheckpointExperts::Dense { w13, w2 }, QuantScheme::Fp8PerTensor) => (
                quantize_per_expert(&w13)?,
                quantize_per_expert(&w2)?,
                ActQuant::Fp8PerTensor,
            ),
            (CheckpointExperts::Dense { w13, w2 }, _) => {
                let (q13, s13) = quant_fp8::quantize_block(&w13, FP8_BLOCK)?;
                let (q2, s2) = quant_fp8::quantize_block(&w2, FP8_BLOCK)?;
                (
                    WeightOperand::Fp8Block {
                        q: q13,
                        scale_inv: s13,
                    },
                    WeightOperand::Fp8Block {
                        q: q2,
                        scale_inv: s2,
                    },
                    ActQuant::Fp8Group,
                )
            }
            (
                CheckpointExperts::Fp8PerTensor {
                    w13,
                    w13_scale,
                    w2,
                    w2_scale,
                },
                _,
            ) => (
                merge_w13_scales(&w13, &w13_scale)?,
                WeightOperand::Fp8PerTensor {
                    q: w2,
                    scales: w2_scale,
                },
                ActQuant::Fp8PerTensor,
            ),
            (
                CheckpointExperts::Fp8Block {
                    w13,
                    w13_scale_inv,
                    w2,
                    w2_scale_inv,
                },
                _,
            ) => (
                WeightOperand::Fp8Block {
                    q: w13,
                    scale_inv: w13_scale_inv,
                },
                WeightOperand::Fp8Block {
                    q: w2,
                    scale_inv: w2_scale_inv,
                },
                ActQuant::Fp8Group,
            ),
        };
        // Validates every scale shape against its weight before the first batch.
        w13.dims(NAME, "w13")?;
        w2.dims(NAME, "w2")?;
        let (a13_scale, a2_scale) = static_scale_tensors(self.act_scales, w13.data().device())?;
        self.operands = Some(ExpertOperands {
            w13,
            w2,
            act_quant,
            a13_scale,
            a2_scale,
        });
        Ok(())
    }

    fn operands(&self) -> Result<&ExpertOperands> {
        self.operands.as_ref().ok_or_else(|| not_processed(NAME))
    }

    fn act_scales(&self) -> ActScales {
        self.act_scales
    }

    /// Static scales are uploaded once to the weights' device here (or when the weights are
    /// processed); the kernels read them there, as they read a dynamic scale a kernel wrote.
    fn set_act_scales(&mut self, scales: ActScales) -> Result<()> {
        if let ActScales::Static { a13, a2 } = scales {
            if self.scheme != QuantScheme::Fp8PerTensor {
                return Err(static_needs_per_tensor(self.scheme));
            }
            for (name, s) in [("a13", a13), ("a2", a2)] {
                if !(s.is_finite() && s > 0.0) {
                    return Err(Error::Weights {
                        method: NAME,
                        msg: format!(
                            "static activation scale {name} is {s}; it must be finite and positive"
                        ),
                    });
                }
            }
        }
        if let Some(ops) = &mut self.operands {
            let (a13_scale, a2_scale) = static_scale_tensors(scales, ops.w13.data().device())?;
            ops.a13_scale = a13_scale;
            ops.a2_scale = a2_scale;
        }
        self.act_scales = scales;
        Ok(())
    }
}

/// The kernels' scale operands for `scales`: f32 `[1]` tensors on `device` when static.
fn static_scale_tensors(scales: ActScales, device: Device) -> Result<(ActScale, ActScale)> {
    Ok(match scales {
        ActScales::Dynamic => (ActScale::Dynamic, ActScale::Dynamic),
        ActScales::Static { a13, a2 } => (
            ActScale::Static(Tensor::from_vec(vec![a13], [1], &device)?),
            ActScale::Static(Tensor::from_vec(vec![a2], [1], &device)?),
        ),
    })
}

/// Online per-tensor quantization: one dynamic scale per expert, on w's device.
fn quantize_per_expert(w: &Tensor) -> Result<WeightOperand> {
    let e = w.dims()[0];
    let (mut qs, mut scales) = (Vec::with_capacity(e), Vec::with_capacity(e));
    for i in 0..e {
        let (q, s) = quant_fp8::quantize_per_tensor(&w.index0(i)?)?;
        qs.push(q);
        scales.push(s);
    }
    Ok(WeightOperand::Fp8PerTensor {
        q: Tensor::stack0(&qs)?,
        scales: Tensor::stack0(&scales)?.reshape([e])?,
    })
}

/// w13 scales [E] are used as is; [E, 2] (w1, w3) are merged: both halves are requantized to the
/// larger scale so one scale serves the whole fused GEMM1 (exact for the half that already has it).
fn merge_w13_scales(w13: &Tensor, scale: &Tensor) -> Result<WeightOperand> {
    let (e, two_n) = (w13.dims()[0], w13.dims()[1]);
    scale.expect_dtype(NAME, "w13_scale", &[DType::F32])?;
    if scale.dims() == [e] {
        return Ok(WeightOperand::Fp8PerTensor {
            q: w13.clone(),
            scales: scale.clone(),
        });
    }
    if scale.dims() != [e, 2] {
        return Err(fmoe_kernels::Error::ScaleShape {
            op: NAME,
            tensor: "w13_scale".into(),
            expected: format!("[{e}] or [{e}, 2]"),
            got: scale.shape().clone(),
        }
        .into());
    }
    let s = scale.to_f32_vec()?;
    let (mut qs, mut merged) = (Vec::with_capacity(e), Vec::with_capacity(e));
    for i in 0..e {
        let (s1, s3) = (s[2 * i], s[2 * i + 1]);
        if !(s1.is_finite() && s1 > 0.0 && s3.is_finite() && s3 > 0.0) {
            return Err(Error::Weights {
                method: NAME,
                msg: format!(
                    "w13_scale of expert {i} is ({s1}, {s3}); scales must be finite and positive"
                ),
            });
        }
        let target = s1.max(s3);
        let mut values = w13.index0(i)?.to_f32_vec()?;
        let half = values.len() / 2;
        values[..half].iter_mut().for_each(|v| *v *= s1);
        values[half..].iter_mut().for_each(|v| *v *= s3);
        let dims = [two_n, w13.dims()[2]];
        qs.push(quant_fp8::quantize_with_scale(
            &Tensor::from_vec(values, dims, &Device::Cpu)?,
            target,
        )?);
        merged.push(target);
    }
    // Computed on the host (a load-time operation); the operands live on the checkpoint's device.
    let device = w13.device();
    Ok(WeightOperand::Fp8PerTensor {
        q: Tensor::stack0(&qs)?.to_device(device)?,
        scales: Tensor::from_vec(merged, [e], &device)?,
    })
}
