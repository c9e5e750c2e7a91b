//! The device path: every layer of a forward pass on the model's device, through fmoe-kernels'
//! tensor functions (CUDA kernels and cuBLAS on a GPU; their CPU twins on the CPU, which is how
//! the path is tested without one). Activations are in the model's dtype (bf16 unless the
//! checkpoint is f16), the KV cache is a slab cache on the same device
//! ([`crate::KvStorage::Slab`]), and only the logits rows asked for come back
//! to the host, as f32.
//!
//! What the two models share lives here: dense weights (`load_dense`: fp8 checkpoints'
//! linears are dequantized to the activation dtype at load; only the MoE experts stay fp8), norms,
//! the residual stream with its fused add + RMSNorm (`Residual`), the ends (embedding lookup,
//! final norm, lm_head over the requested rows: `Ends`), the per-pass rotary tables
//! (`RopeTensors`) and the MoE block (`DeviceMoe`: router gate → routing → [`FusedMoe`]).
//! The model files hold the rest: [`mixtral`] and [`deepseek_v3`].
//!
//! Host work per pass, not per layer: what every layer reads the same way is uploaded once per
//! forward pass — the rotary tables, the KV cache's slot mapping
//! ([`crate::model::KvCache::slot_mapping`]), the attention plan
//! ([`fmoe_kernels::attention::plan_attention`]) and DeepSeek-V3's cached-row index — and nothing
//! waits for the device before the logits: the routing kernels' NaN/Inf flags (and the fp8 MoE
//! quantizations') are collected over the layers as one [`FiniteCheck`] (`Checks`) and read
//! once, just before the logits come down, giving the error the first flagged layer would have
//! given at once (a NonFinite error naming `router_logits`). A NaN therefore no longer stops the
//! pass at its layer: the rest of the pass runs on meaningless values (valid expert ids) and the
//! error comes at its end.

pub mod deepseek_v3;
pub mod mixtral;

use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::elementwise;
use fmoe_kernels::linear::linear;
use fmoe_kernels::norm::{add_rms_norm, rms_norm};
use fmoe_kernels::quant_fp8::FiniteCheck;
use fmoe_kernels::routing::TopK;
use fmoe_moe::FusedMoe;

use crate::config::QuantizationConfig;
use crate::layers::{Linear, RopeTable};
use crate::loader::Vb;
use crate::model::{ForwardBatch, KvCache, KvStorage, LogitsFor};
use crate::{Error, Result};

/// Where the device path runs and in which dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCtx {
    pub device: Device,
    /// Activations, dense weights and the KV cache.
    pub dtype: DType,
}

impl DeviceCtx {
    /// On `device`, in the checkpoint's dtype when the kernels take it (bf16, f16), else bf16.
    pub fn new(device: Device, checkpoint_dtype: Option<DType>) -> DeviceCtx {
        let dtype = match checkpoint_dtype {
            Some(DType::F16) => DType::F16,
            _ => DType::BF16,
        };
        DeviceCtx { device, dtype }
    }

    pub fn kv_storage(&self) -> KvStorage {
        KvStorage::Slab {
            device: self.device,
            dtype: self.dtype,
        }
    }

    /// `t` in this dtype on this device (no copy when it already is).
    fn place(&self, t: Tensor) -> Result<Tensor> {
        let t = t.to_device(self.device)?;
        Ok(elementwise::to_dtype(&t, self.dtype)?)
    }

    /// Checks that `cache` is the slab cache this path writes to.
    pub(crate) fn check_cache(&self, cache: &dyn KvCache) -> Result<()> {
        let want = self.kv_storage();
        if cache.storage() != want {
            return Err(Error::input(
                "CausalLm::forward",
                format!(
                    "the model runs on {} in {} and needs a slab KV cache there ({want:?}); the cache is {:?}",
                    self.device,
                    self.dtype,
                    cache.storage()
                ),
            ));
        }
        Ok(())
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

/// cos/sin `[tokens, rotary_dim / 2]` f32 of a pass, uploaded once and used by every layer.
pub(crate) struct RopeTensors {
    pub cos: Tensor,
    pub sin: Tensor,
}

impl RopeTensors {
    pub(crate) fn new(table: &RopeTable, tokens: usize, device: Device) -> Result<RopeTensors> {
        let dims = [tokens, table.half()];
        Ok(RopeTensors {
            cos: Tensor::from_vec(table.cos().to_vec(), dims, &device)?,
            sin: Tensor::from_vec(table.sin().to_vec(), dims, &device)?,
        })
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

    /// Hidden states `[tokens, hidden]` of the batch's ids (an id ≥ vocab is an error naming it).
    pub(crate) fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        Ok(elementwise::gather_rows(&self.embed, tokens)?)
    }

    /// f32 logits `[rows, vocab]` on the host for the rows `which` asks for: those rows of the
    /// stream are picked first, so the final norm and lm_head see only them. The pass's deferred
    /// `checks` are read first (the one synchronization of the pass, with the logits' download).
    pub(crate) fn logits(
        &self,
        res: Residual,
        batch: &ForwardBatch,
        which: LogitsFor,
        checks: Checks,
    ) -> Result<Tensor> {
        let rows = batch.logit_rows(which);
        let pick = |t: &Tensor| -> Result<Tensor> {
            if rows.len() == batch.num_tokens() {
                return Ok(t.clone());
            }
            let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            Ok(elementwise::gather_rows(t, &ids)?)
        };
        let mut last = Residual {
            h: pick(&res.h)?,
            pending: res.pending.as_ref().map(pick).transpose()?,
        };
        let n = last.norm(&self.norm)?;
        let logits = linear(&n, &self.lm_head, DType::F32)?;
        checks.resolve()?;
        let logits = logits.to_device(Device::Cpu)?;
        logits.expect_dims("CausalLm::forward", "logits", &[rows.len(), self.vocab])?;
        Ok(logits)
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
    pub(crate) fn resolve(self) -> Result<()> {
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
