//! DeepSeek-V3's forward.
//!
//! MLA: `q = q_b(rms(q_a(x)))` (or `q_proj(x)`), interleaved rotary on each head's rope dims
//! (YaRN cos/sin from the host table); `kv_a(x) = [latent | k_pe]`, rotary on `k_pe`, the latent
//! normalized; latent (stream 0) and `k_pe` (stream 1) appended to the slab cache (one launch
//! through the step's slot mapping). Attention decompresses the cached tokens of the batch's
//! sequences: their latent rows are gathered from the pool (by the step's gather index), `k_nope = latent·W_ukᵀ`, `v = latent·W_uvᵀ` (kv_b's key and value rows, split at
//! load), per head `k = [k_nope_h | k_pe]` (`concat_heads`), then `causal_attention` with
//! q·k over nope + rope and v of `v_head_dim`. (The absorbed form, attention in latent space,
//! needs a per-head batched GEMM the kernel library does not have yet.)
//!
//! FFN: the first `first_k_dense_replace` layers a SwiGLU MLP (gate and up rows in one GEMM,
//! `silu_mul`, down); after them the router gate (f32 logits) → grouped sigmoid routing →
//! [`fmoe_moe::FusedMoe`] with the shared expert (the routing's NaN/Inf check deferred to the
//! pass's end).

use fmoe_core::Tensor;
use fmoe_kernels::attention::{AttentionParams, causal_attention_planned};
use fmoe_kernels::elementwise::{concat_heads, gather_rows_at, narrow_cols, silu_mul};
use fmoe_kernels::kv_cache::KvSource;
use fmoe_kernels::linear::linear;
use fmoe_kernels::rotary::{RotaryStyle, apply_rotary};
use fmoe_kernels::routing::TopK;
use fmoe_moe::FusedMoe;

use super::{
    Checks, DeviceCtx, DeviceMoe, Ends, Norm, Residual, RopeTensors, concat_rows, load_dense,
};
use crate::Error;
use crate::Result;
use crate::config::{DeepseekV3Config, QuantizationConfig};
use crate::input::ForwardInput;
use crate::kv_pool::KvPool;
use crate::layers::mla::MLA_NORM_EPS;
use crate::layers::{MlaSpec, Rotary};
use crate::loader::Vb;
use crate::model::{ForwardOutput, KvLayout};

enum QProj {
    Lora { a: Tensor, norm: Norm, b: Tensor },
    Plain(Tensor),
}

struct Mla {
    q: QProj,
    kv_a_proj_with_mqa: Tensor,
    kv_a_layernorm: Norm,
    /// kv_b's key rows of every head: `[heads·nope, kv_lora_rank]`.
    w_uk: Tensor,
    /// kv_b's value rows of every head: `[heads·v, kv_lora_rank]`.
    w_uv: Tensor,
    o_proj: Tensor,
}

enum Ffn {
    /// `[gate; up]` rows `[2I, hidden]`, down `[hidden, I]`.
    Dense {
        gate_up: Tensor,
        down: Tensor,
    },
    Moe(Box<DeviceMoe>),
}

struct Layer {
    input_layernorm: Norm,
    self_attn: Mla,
    post_attention_layernorm: Norm,
    mlp: Ffn,
}

/// A MoE layer's parts as the model file loads them: gate, experts, selection bias.
pub(crate) type MoeParts = (Tensor, FusedMoe, Tensor);

/// The decoder stack and ends of a DeepSeek-V3 model on the device.
pub struct Model {
    ends: Ends,
    layers: Vec<Layer>,
    rope: RopeTensors,
    spec: MlaSpec,
    layout: KvLayout,
    ctx: DeviceCtx,
}

impl Mla {
    fn load(vb: &Vb, s: &MlaSpec, quant: &QuantizationConfig, ctx: &DeviceCtx) -> Result<Mla> {
        let (h, nh, r) = (s.hidden, s.num_heads, s.kv_lora_rank);
        let (dn, dv) = (s.qk_nope_head_dim, s.v_head_dim);
        let q_out = nh * s.qk_head_dim();
        let q = match s.q_lora_rank {
            Some(rank) => QProj::Lora {
                a: load_dense(&vb.pp("q_a_proj"), rank, h, quant, ctx)?,
                norm: Norm::load(&vb.pp("q_a_layernorm"), rank, MLA_NORM_EPS, ctx)?,
                b: load_dense(&vb.pp("q_b_proj"), q_out, rank, quant, ctx)?,
            },
            None => QProj::Plain(load_dense(&vb.pp("q_proj"), q_out, h, quant, ctx)?),
        };
        let kv_a_proj_with_mqa = load_dense(
            &vb.pp("kv_a_proj_with_mqa"),
            r + s.qk_rope_head_dim,
            h,
            quant,
            ctx,
        )?;
        let kv_a_layernorm = Norm::load(&vb.pp("kv_a_layernorm"), r, MLA_NORM_EPS, ctx)?;
        // kv_b rows are per head [nope | v]: gather each half's rows into its own weight.
        let kv_b = load_dense(&vb.pp("kv_b_proj"), nh * (dn + dv), r, quant, ctx)?;
        let mut w_uk = Tensor::zeros([nh * dn, r], ctx.dtype, &ctx.device)?;
        let mut w_uv = Tensor::zeros([nh * dv, r], ctx.dtype, &ctx.device)?;
        for head in 0..nh {
            w_uk.copy_rows_from(head * dn, &kv_b, head * (dn + dv), 0, dn)?;
            w_uv.copy_rows_from(head * dv, &kv_b, head * (dn + dv) + dn, 0, dv)?;
        }
        Ok(Mla {
            q,
            kv_a_proj_with_mqa,
            kv_a_layernorm,
            w_uk,
            w_uv,
            o_proj: load_dense(&vb.pp("o_proj"), h, nh * dv, quant, ctx)?,
        })
    }
}

impl Model {
    /// Loads the weights under the checkpoint root `vb`; `moe(vb)` builds a MoE layer's parts
    /// (experts on `ctx.device`) from its `mlp` cursor.
    pub(crate) fn load(
        cfg: &DeepseekV3Config,
        vb: &Vb,
        quant: &QuantizationConfig,
        rotary: Rotary,
        spec: MlaSpec,
        ctx: DeviceCtx,
        moe: impl Fn(&Vb) -> Result<MoeParts>,
    ) -> Result<Model> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let ends = Ends::load(vb, v, h, cfg.rms_norm_eps, cfg.tie_word_embeddings, &ctx)?;
        let m = vb.pp("model");
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| -> Result<Layer> {
                let vb = m.pp("layers").pp(i);
                let mlp_vb = vb.pp("mlp");
                let mlp = if cfg.is_moe_layer(i) {
                    let (gate, experts, bias) = moe(&mlp_vb)?;
                    Ffn::Moe(Box::new(DeviceMoe::new(gate, experts, Some(bias))?))
                } else {
                    let inter = cfg.intermediate_size;
                    let gate = load_dense(&mlp_vb.pp("gate_proj"), inter, h, quant, &ctx)?;
                    let up = load_dense(&mlp_vb.pp("up_proj"), inter, h, quant, &ctx)?;
                    Ffn::Dense {
                        gate_up: concat_rows(&[gate, up], &ctx)?,
                        down: load_dense(&mlp_vb.pp("down_proj"), h, inter, quant, &ctx)?,
                    }
                };
                Ok(Layer {
                    input_layernorm: Norm::load(
                        &vb.pp("input_layernorm"),
                        h,
                        cfg.rms_norm_eps,
                        &ctx,
                    )?,
                    self_attn: Mla::load(&vb.pp("self_attn"), &spec, quant, &ctx)?,
                    post_attention_layernorm: Norm::load(
                        &vb.pp("post_attention_layernorm"),
                        h,
                        cfg.rms_norm_eps,
                        &ctx,
                    )?,
                    mlp,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            ends,
            layers,
            rope: RopeTensors::new(&rotary, cfg.max_position_embeddings, ctx.device)?,
            spec,
            layout: KvLayout {
                num_layers: cfg.num_hidden_layers,
                streams: spec.cache_streams(),
            },
            ctx,
        })
    }

    /// What the model caches per token and layer.
    pub fn kv_layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn ctx(&self) -> DeviceCtx {
        self.ctx
    }

    pub(crate) fn moe_layers(&self) -> impl Iterator<Item = &FusedMoe> {
        self.layers.iter().filter_map(|l| match &l.mlp {
            Ffn::Moe(m) => Some(m.experts()),
            Ffn::Dense { .. } => None,
        })
    }

    /// The attention parameters of every layer (decompressed MLA: q·k over nope + rope).
    pub(crate) fn attention_params(s: &MlaSpec) -> AttentionParams {
        AttentionParams {
            num_heads: s.num_heads,
            num_kv_heads: s.num_heads,
            qk_dim: s.qk_nope_head_dim + s.qk_rope_head_dim,
            v_dim: s.v_head_dim,
            scale: s.scale,
            sliding_window: None,
        }
    }

    /// The forward pass; each MoE layer's routing (downloaded) is pushed onto `trace` as
    /// (layer, top-k) when given.
    pub(crate) fn forward(
        &self,
        input: &ForwardInput,
        kv: &mut KvPool,
        mut trace: Option<&mut Vec<(usize, TopK)>>,
    ) -> Result<ForwardOutput> {
        kv.check_for(&self.layout, self.ctx.dtype, self.ctx.device)?;
        let s = &self.spec;
        let (nh, dn, dr, r) = (
            s.num_heads,
            s.qk_nope_head_dim,
            s.qk_rope_head_dim,
            s.kv_lora_rank,
        );
        let qk = dn + dr;
        let dtype = self.ctx.dtype;
        let Some(rows) = &input.gather else {
            return Err(Error::input(
                "DeepseekV3ForCausalLM::forward",
                "MLA decompresses the cached latent: the step must gather its rows (AttentionLayout::Gathered)",
            ));
        };
        let (cos, sin) = self.rope.rows(&input.positions)?;
        let rotate = |x: &Tensor, heads: usize, head_dim: usize, offset: usize| -> Result<Tensor> {
            Ok(apply_rotary(
                x,
                heads,
                head_dim,
                offset,
                dr,
                &cos,
                &sin,
                RotaryStyle::Interleaved,
            )?)
        };
        let mut checks = Checks::default();
        let mut res = Residual::new(self.ends.embed(input)?);
        for (i, l) in self.layers.iter().enumerate() {
            let x = res.norm(&l.input_layernorm)?;
            let a = &l.self_attn;
            let q = match &a.q {
                QProj::Lora { a, norm, b } => {
                    linear(&norm.forward(&linear(&x, a, dtype)?)?, b, dtype)?
                }
                QProj::Plain(p) => linear(&x, p, dtype)?,
            };
            let q = rotate(&q, nh, qk, dn)?;
            // [latent | k_pe] with k_pe rotated (the latent is copied through).
            let ckv = rotate(&linear(&x, &a.kv_a_proj_with_mqa, dtype)?, 1, r + dr, r)?;
            let latent = a.kv_a_layernorm.forward(&narrow_cols(&ckv, 0, r)?)?;
            let sources = [
                KvSource {
                    src: &latent,
                    col: 0,
                },
                KvSource { src: &ckv, col: r },
            ];
            kv.append(i, &sources, &input.slots)?;
            let lat = gather_rows_at(kv.tensor(i, 0)?, rows)?;
            let k_pe = gather_rows_at(kv.tensor(i, 1)?, rows)?;
            let k = concat_heads(&linear(&lat, &a.w_uk, dtype)?, &k_pe, nh)?;
            let v = linear(&lat, &a.w_uv, dtype)?;
            let o = causal_attention_planned(&q, &k, &v, &input.attention)?;
            res.push(linear(&o, &a.o_proj, dtype)?);
            let m = res.norm(&l.post_attention_layernorm)?;
            let y = match &l.mlp {
                Ffn::Dense { gate_up, down } => {
                    linear(&silu_mul(&linear(&m, gate_up, dtype)?)?, down, dtype)?
                }
                Ffn::Moe(moe) => {
                    let (y, check) = match trace.as_deref_mut() {
                        None => moe.forward(&m, None)?,
                        Some(trace) => {
                            let mut one = Vec::with_capacity(1);
                            let out = moe.forward(&m, Some(&mut one))?;
                            trace.extend(one.into_iter().map(|tk| (i, tk)));
                            out
                        }
                    };
                    checks.add(check)?;
                    y
                }
            };
            res.push(y);
        }
        self.ends.logits(res, input, checks)
    }
}
