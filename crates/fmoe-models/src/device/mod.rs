//! The one forward of each model: every layer on the model's device through fmoe-kernels'
//! tensor functions (CUDA kernels and cuBLAS on a GPU; their CPU twins on the CPU). Activations
//! are in the model's dtype: f32 on the CPU (the golden reference against transformers), the
//! checkpoint's bf16/f16 on a GPU. The KV cache is the engine's paged pool on the same device
//! ([`crate::KvPool`]); the logits stay on the device.
//!
//! What the two models share lives here: dense weights (`load_dense`: fp8 checkpoints'
//! linears are dequantized to the activation dtype at load; only the MoE experts stay fp8), norms,
//! the residual stream with its fused add + RMSNorm (`Residual`), the ends (embedding lookup,
//! final norm, lm_head over the requested rows: `Ends`), the rotary tables of every position
//! (`RopeTensors`, made at load; a pass gathers its positions' rows) and the MoE block
//! (`DeviceMoe`: router gate → routing → [`FusedMoe`]). The model files hold the rest:
//! [`mixtral`] and [`deepseek_v3`].
//!
//! A pass uploads nothing: the engine's [`crate::ForwardInput`] holds the token ids, positions,
//! slot mapping, attention plan and logits rows, uploaded once per step. Nothing waits for the
//! device either: the routing kernels' NaN/Inf flags (and the fp8 MoE quantizations') are
//! collected over the layers as one [`FiniteCheck`] (`Checks`) and returned with the logits
//! ([`crate::ForwardOutput`]); the engine reads them where it downloads the logits, which gives
//! the error the first flagged layer would have given at once (a NonFinite error naming
//! `router_logits`). A NaN therefore does not stop the pass at its layer: the rest of the pass
//! runs on meaningless values (valid expert ids) and the error comes at its end.

pub mod deepseek_v3;
pub mod mixtral;

use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::elementwise::{self, RowIndex};
use fmoe_kernels::linear::linear;
use fmoe_kernels::norm::{add_rms_norm, rms_norm};
use fmoe_kernels::quant_fp8::FiniteCheck;
use fmoe_kernels::routing::TopK;
use fmoe_moe::FusedMoe;

use crate::Result;
use crate::config::QuantizationConfig;
use crate::input::ForwardInput;
use crate::layers::Linear;
use crate::loader::Vb;
use crate::model::ForwardOutput;

/// Where the device path runs and in which dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCtx {
    pub device: Device,
    /// Activations, dense weights and the KV cache.
    pub dtype: DType,
}

impl DeviceCtx {
    /// On `device` in `dtype` when given; else f32 on the CPU, and on a GPU the checkpoint's
    /// dtype when the kernels take it (bf16, f16), else bf16.
    pub fn new(device: Device, checkpoint_dtype: Option<DType>, dtype: Option<DType>) -> DeviceCtx {
        let dtype = dtype.unwrap_or(match (device, checkpoint_dtype) {
            (Device::Cpu, _) => DType::F32,
            (_, Some(DType::F16)) => DType::F16,
            _ => DType::BF16,
        });
        DeviceCtx { device, dtype }
    }

    /// `t` in this dtype on this device (no copy when it already is).
    fn place(&self, t: Tensor) -> Result<Tensor> {
        let t = t.to_device(self.device)?;
        Ok(elementwise::to_dtype(&t, self.dtype)?)
    }
}

/// `weight` [out, in] under `vb` (fp8 scale beside it when `quant` says so), dequantized to the
/// activation dtype, on the device.
pub(crate) fn load_dense(
    vb: &Vb,
    out: usize,
    inp: usize,
    quant: &QuantizationConfig,
    ctx: &DeviceCtx,
) -> Result<Tensor> {
    let l = Linear::load(vb, out, inp, quant)?;
    ctx.place(l.dequantized(ctx.dtype)?)
}

/// Weights stacked along their output rows (e.g. q/k/v into one GEMM): `[Σ out, in]`.
pub(crate) fn concat_rows(parts: &[Tensor], ctx: &DeviceCtx) -> Result<Tensor> {
    let inp = parts.first().map_or(0, |p| p.dims()[1]);
    let total: usize = parts.iter().map(|p| p.dims()[0]).sum();
    let mut out = Tensor::zeros([total, inp], ctx.dtype, &ctx.device)?;
    let mut at = 0;
    for p in parts {
        out.copy_rows_from(at, p, 0, 0, p.dims()[0])?;
        at += p.dims()[0];
    }
    Ok(out)
}

/// A `[dim]` vector (norm weights) in the activation dtype, on the device.
pub(crate) fn load_vector(vb: &Vb, dim: usize, ctx: &DeviceCtx) -> Result<Tensor> {
    let w = vb.get("weight", &[dim], &[DType::BF16, DType::F16, DType::F32])?;
    ctx.place(w)
}

/// RMSNorm weights and eps.
pub(crate) struct Norm {
    weight: Tensor,
    eps: f32,
}

impl Norm {
    pub(crate) fn load(vb: &Vb, dim: usize, eps: f64, ctx: &DeviceCtx) -> Result<Norm> {
        Ok(Norm {
            weight: load_vector(vb, dim, ctx)?,
            eps: eps as f32,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(x, &self.weight, self.eps)?)
    }
}

/// The residual stream `h` and the last branch output not yet added to it: the add is fused
/// into the next norm (`add_rms_norm`), as vLLM does.
pub(crate) struct Residual {
    h: Tensor,
    pending: Option<Tensor>,
}

impl Residual {
    pub(crate) fn new(h: Tensor) -> Residual {
        Residual { h, pending: None }
    }

    /// `norm(h + pending)`, with `h + pending` becoming the stream.
    pub(crate) fn norm(&mut self, norm: &Norm) -> Result<Tensor> {
        match self.pending.take() {
            None => norm.forward(&self.h),
            Some(p) => {
                let (h, n) = add_rms_norm(&self.h, &p, &norm.weight, norm.eps)?;
                self.h = h;
                Ok(n)
            }
        }
    }

    /// A branch's output, added at the next norm.
    pub(crate) fn push(&mut self, y: Tensor) {
        debug_assert!(self.pending.is_none());
        self.pending = Some(y);
    }
}

/// cos/sin `[max positions, rotary_dim / 2]` f32 on the device, made at load; a pass gathers the
/// rows of its positions ([`RopeTensors::rows`]).
pub(crate) struct RopeTensors {
    cos: Tensor,
    sin: Tensor,
}

impl RopeTensors {
    pub(crate) fn new(
        rotary: &crate::layers::Rotary,
        max_positions: usize,
        device: Device,
    ) -> Result<RopeTensors> {
        let positions: Vec<usize> = (0..max_positions).collect();
        let table = rotary.table(&positions);
        let dims = [max_positions, table.half()];
        Ok(RopeTensors {
            cos: Tensor::from_vec(table.cos().to_vec(), dims, &device)?,
            sin: Tensor::from_vec(table.sin().to_vec(), dims, &device)?,
        })
    }

    /// (cos, sin) `[tokens, rotary_dim / 2]` of a pass's positions.
    pub(crate) fn rows(&self, positions: &RowIndex) -> Result<(Tensor, Tensor)> {
        Ok((
            elementwise::gather_rows_at(&self.cos, positions)?,
            elementwise::gather_rows_at(&self.sin, positions)?,
        ))
    }
}

/// Embeddings in; final norm and lm_head out.
pub(crate) struct Ends {
    embed: Tensor,
    norm: Norm,
    lm_head: Tensor,
    vocab: usize,
}

impl Ends {
    /// `model.embed_tokens`, `model.norm`, `lm_head` (or the embeddings when tied) under the
    /// checkpoint root `vb`.
    pub(crate) fn load(
        vb: &Vb,
        vocab: usize,
        hidden: usize,
        eps: f64,
        tie_word_embeddings: bool,
        ctx: &DeviceCtx,
    ) -> Result<Ends> {
        let m = vb.pp("model");
        let embed = m.pp("embed_tokens").get(
            "weight",
            &[vocab, hidden],
            &[DType::BF16, DType::F16, DType::F32],
        )?;
        let embed = ctx.place(embed)?;
        let lm_head = if tie_word_embeddings {
            embed.clone()
        } else {
            load_dense(
                &vb.pp("lm_head"),
                vocab,
                hidden,
                &QuantizationConfig::None,
                ctx,
            )?
        };
        Ok(Ends {
            embed,
            norm: Norm::load(&m.pp("norm"), hidden, eps, ctx)?,
            lm_head,
            vocab,
        })
    }

    /// Hidden states `[tokens, hidden]` of the step's ids.
    pub(crate) fn embed(&self, input: &ForwardInput) -> Result<Tensor> {
        Ok(elementwise::gather_rows_at(&self.embed, &input.token_ids)?)
    }

    /// f32 logits `[rows, vocab]` on the device for the rows the input asks for: those rows of the
    /// stream are picked first, so the final norm and lm_head see only them.
    pub(crate) fn logits(
        &self,
        res: Residual,
        input: &ForwardInput,
        checks: Checks,
    ) -> Result<ForwardOutput> {
        let rows = input.num_logits();
        let logits = if rows == 0 {
            Tensor::zeros([0, self.vocab], DType::F32, &self.embed.device())?
        } else {
            let pick = |t: &Tensor| -> Result<Tensor> {
                Ok(match &input.logit_rows {
                    None => t.clone(),
                    Some(ids) => elementwise::gather_rows_at(t, ids)?,
                })
            };
            let mut last = Residual {
                h: pick(&res.h)?,
                pending: res.pending.as_ref().map(pick).transpose()?,
            };
            let n = last.norm(&self.norm)?;
            linear(&n, &self.lm_head, DType::F32)?
        };
        logits.expect_dims("CausalLm::forward", "logits", &[rows, self.vocab])?;
        Ok(ForwardOutput {
            logits,
            checks: checks.0,
        })
    }
}

/// The NaN/Inf checks a forward pass defers to its end (see the module docs).
#[derive(Default)]
pub(crate) struct Checks(FiniteCheck);

impl Checks {
    /// Past this many device bytes kept alive by pending checks (the flagged activations: a long
    /// fp8 prefill keeps each layer's MoE input), they are read at once: such a pass is long
    /// enough that one more synchronization does not show.
    const HELD_BYTES_LIMIT: usize = 256 << 20;

    pub(crate) fn add(&mut self, c: FiniteCheck) -> Result<()> {
        self.0.merge(c);
        if self.0.held_bytes() > Self::HELD_BYTES_LIMIT {
            std::mem::take(self).resolve()?;
        }
        Ok(())
    }

    /// Reads every flag (one synchronization on CUDA): the first set is the error routing or
    /// the MoE layer would have returned at once, as the MoE layer's error.
    fn resolve(self) -> Result<()> {
        self.0
            .check()
            .map_err(|e| crate::Error::Moe(fmoe_moe::Error::Kernel(e)))
    }
}

/// Router gate (f32 logits) → routing → [`FusedMoe`] (its shared expert included).
pub(crate) struct DeviceMoe {
    gate: Tensor,
    experts: FusedMoe,
    /// DeepSeek-V3's `e_score_correction_bias` [E] f32, on the device and on the host.
    bias: Option<(Tensor, Tensor)>,
}

impl DeviceMoe {
    /// `bias`: the selection bias [E] f32 (grouped routing), as given to [`FusedMoe::new`].
    pub(crate) fn new(gate: Tensor, experts: FusedMoe, bias: Option<Tensor>) -> Result<DeviceMoe> {
        let bias = bias
            .map(|b| -> Result<(Tensor, Tensor)> {
                Ok((b.to_device(experts.device())?, b.to_device(Device::Cpu)?))
            })
            .transpose()?;
        Ok(DeviceMoe {
            gate,
            experts,
            bias,
        })
    }

    pub(crate) fn experts(&self) -> &FusedMoe {
        &self.experts
    }

    /// `x` [rows, hidden] → [rows, hidden], with the routing's and the experts' NaN/Inf checks
    /// unread (nothing here waits for the device; see the module docs); the routing is pushed
    /// onto `trace` (downloaded) when given.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        trace: Option<&mut Vec<TopK>>,
    ) -> Result<(Tensor, FiniteCheck)> {
        let logits = linear(x, &self.gate, DType::F32)?;
        let config = self.experts.config();
        let device_bias = self.bias.as_ref().map(|b| &b.0);
        let (topk, mut check) = match fmoe_moe::router::route_deferred(config, &logits, device_bias)
        {
            Ok(t) => t,
            // More experts than the CUDA routing kernels take: route on the host (the f32
            // logits come down, the top-k goes up: a synchronization, checked at once).
            Err(fmoe_moe::Error::Kernel(fmoe_kernels::Error::Core(
                fmoe_core::Error::Unsupported { .. },
            ))) if !logits.device().is_cpu() => {
                let host = logits.to_device(Device::Cpu)?;
                let t = fmoe_moe::router::route(config, &host, self.bias.as_ref().map(|b| &b.1))?;
                let topk = TopK {
                    ids: t.ids.to_device(logits.device())?,
                    weights: t.weights.to_device(logits.device())?,
                };
                (topk, FiniteCheck::none())
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(trace) = trace {
            trace.push(TopK {
                ids: topk.ids.to_device(Device::Cpu)?,
                weights: topk.weights.to_device(Device::Cpu)?,
            });
        }
        let (y, c) = self.experts.forward_routed_deferred(x, &topk)?;
        check.merge(c);
        Ok((y, check))
    }
}
