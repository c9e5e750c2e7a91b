//! Mixtral's forward. Per layer: `add_rms_norm` (the previous branch's output joins the stream
//! there) → one q/k/v GEMM over the weights concatenated at load → half-split rotary on q and k →
//! K and V appended to the KV pool (the rotated k, and V straight from its columns of the q/k/v
//! rows: one launch through the step's slot mapping) → `causal_attention` over the pool's rows
//! (on the step's plan) → o_proj → `add_rms_norm` → router gate (f32 logits) → softmax top-k (its
//! NaN/Inf check deferred to the pass's end) → [`fmoe_moe::FusedMoe`].

use fmoe_core::Tensor;
use fmoe_kernels::attention::{AttentionParams, causal_attention_planned};
use fmoe_kernels::elementwise::{gather_rows_at, narrow_cols};
use fmoe_kernels::kv_cache::KvSource;
use fmoe_kernels::linear::linear;
use fmoe_kernels::rotary::{RotaryStyle, apply_rotary};
use fmoe_moe::FusedMoe;

use super::{
    Checks, DeviceCtx, DeviceMoe, Ends, Norm, Residual, RopeTensors, concat_rows, load_dense,
};
use crate::Result;
use crate::config::{MixtralConfig, QuantizationConfig};
use crate::input::ForwardInput;
use crate::kv_pool::KvPool;
use crate::layers::{AttentionSpec, Rotary};
use crate::loader::Vb;
use crate::model::{ForwardOutput, KvLayout};

struct Layer {
    input_layernorm: Norm,
    /// [q; k; v] rows: `[(heads + 2·kv_heads)·head_dim, hidden]`.
    qkv_proj: Tensor,
    o_proj: Tensor,
    post_attention_layernorm: Norm,
    moe: DeviceMoe,
}

/// The decoder stack and ends of a Mixtral model on the device.
pub struct Model {
    ends: Ends,
    layers: Vec<Layer>,
    rope: RopeTensors,
    spec: AttentionSpec,
    layout: KvLayout,
    ctx: DeviceCtx,
}

impl Model {
    /// Loads the weights under the checkpoint root `vb`; `moe(i, vb)` builds layer `i`'s experts
    /// (on `ctx.device`) from its `block_sparse_moe` cursor.
    pub(crate) fn load(
        cfg: &MixtralConfig,
        vb: &Vb,
        quant: &QuantizationConfig,
        rotary: Rotary,
        spec: AttentionSpec,
        ctx: DeviceCtx,
        moe: impl Fn(&Vb) -> Result<FusedMoe>,
    ) -> Result<Model> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let ends = Ends::load(vb, v, h, cfg.rms_norm_eps, cfg.tie_word_embeddings, &ctx)?;
        let d = spec.head_dim;
        let (q_out, kv_out) = (spec.num_heads * d, spec.num_kv_heads * d);
        let m = vb.pp("model");
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| -> Result<Layer> {
                let vb = m.pp("layers").pp(i);
                let a = vb.pp("self_attn");
                let parts = [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)]
                    .map(|(name, out)| load_dense(&a.pp(name), out, h, quant, &ctx));
                let [q, k, v] = parts;
                let qkv_proj = concat_rows(&[q?, k?, v?], &ctx)?;
                let moe_vb = vb.pp("block_sparse_moe");
                // The router stays unquantized in fp8 checkpoints.
                let gate = load_dense(
                    &moe_vb.pp("gate"),
                    cfg.num_local_experts,
                    h,
                    &QuantizationConfig::None,
                    &ctx,
                )?;
                Ok(Layer {
                    input_layernorm: Norm::load(
                        &vb.pp("input_layernorm"),
                        h,
                        cfg.rms_norm_eps,
                        &ctx,
                    )?,
                    qkv_proj,
                    o_proj: load_dense(&a.pp("o_proj"), h, q_out, quant, &ctx)?,
                    post_attention_layernorm: Norm::load(
                        &vb.pp("post_attention_layernorm"),
                        h,
                        cfg.rms_norm_eps,
                        &ctx,
                    )?,
                    moe: DeviceMoe::new(gate, moe(&moe_vb)?, None)?,
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
                streams: vec![spec.num_kv_heads * spec.head_dim; 2],
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
        self.layers.iter().map(|l| l.moe.experts())
    }

    /// The attention parameters of every layer.
    pub(crate) fn attention_params(spec: &AttentionSpec) -> AttentionParams {
        let d = spec.head_dim;
        AttentionParams {
            num_heads: spec.num_heads,
            num_kv_heads: spec.num_kv_heads,
            qk_dim: d,
            v_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            sliding_window: spec.sliding_window,
        }
    }

    pub(crate) fn forward(&self, input: &ForwardInput, kv: &mut KvPool) -> Result<ForwardOutput> {
        kv.check_for(&self.layout, self.ctx.dtype, self.ctx.device)?;
        let s = &self.spec;
        let d = s.head_dim;
        let (q_w, kv_w) = (s.num_heads * d, s.num_kv_heads * d);
        let dtype = self.ctx.dtype;
        let (cos, sin) = self.rope.rows(&input.positions)?;
        let rotate = |x: &Tensor, heads: usize| -> Result<Tensor> {
            Ok(apply_rotary(
                x,
                heads,
                d,
                0,
                d,
                &cos,
                &sin,
                RotaryStyle::HalfSplit,
            )?)
        };
        let mut checks = Checks::default();
        let mut res = Residual::new(self.ends.embed(input)?);
        for (i, l) in self.layers.iter().enumerate() {
            let a = res.norm(&l.input_layernorm)?;
            let qkv = linear(&a, &l.qkv_proj, dtype)?;
            let q = rotate(&narrow_cols(&qkv, 0, q_w)?, s.num_heads)?;
            let k = rotate(&narrow_cols(&qkv, q_w, kv_w)?, s.num_kv_heads)?;
            // V straight from its columns of the q/k/v rows.
            let sources = [
                KvSource { src: &k, col: 0 },
                KvSource {
                    src: &qkv,
                    col: q_w + kv_w,
                },
            ];
            kv.append(i, &sources, &input.slots)?;
            let (k_all, v_all) = (kv.tensor(i, 0)?, kv.tensor(i, 1)?);
            let o = match &input.gather {
                Some(rows) => causal_attention_planned(
                    &q,
                    &gather_rows_at(k_all, rows)?,
                    &gather_rows_at(v_all, rows)?,
                    &input.attention,
                )?,
                None => causal_attention_planned(&q, k_all, v_all, &input.attention)?,
            };
            res.push(linear(&o, &l.o_proj, dtype)?);
            let m = res.norm(&l.post_attention_layernorm)?;
            let (y, check) = l.moe.forward(&m, None)?;
            checks.add(check)?;
            res.push(y);
        }
        self.ends.logits(res, input, checks)
    }
}
