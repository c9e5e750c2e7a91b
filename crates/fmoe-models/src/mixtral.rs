//! Mixtral (`MixtralForCausalLM`), as transformers computes it.
//!
//! References: Mistral AI, "Mixtral of Experts" (arXiv:2401.04088); transformers'
//! `models/mixtral/modeling_mixtral.py`. Each decoder layer is
//! `h += attn(rms(h)); h += moe(rms(h))`, attention is GQA with half-split rotary (θ from the
//! config) and an optional sliding window, and the MoE routes each token to the top-k of
//! softmax(x·Wgᵀ) (f32) with the weights renormalized.
//!
//! The checkpoint, as this file reads it:
//!
//! ```text
//! model.embed_tokens.weight                                  [vocab, hidden]
//! model.layers.N.input_layernorm.weight                      [hidden]
//! model.layers.N.self_attn.{q,k,v,o}_proj.weight             [heads·d, hidden] … [hidden, heads·d]
//! model.layers.N.post_attention_layernorm.weight             [hidden]
//! model.layers.N.block_sparse_moe.gate.weight                [experts, hidden]
//! model.layers.N.block_sparse_moe.experts.J.{w1,w3,w2}.weight  [I, hidden] [I, hidden] [hidden, I]
//! model.norm.weight                                          [hidden]
//! lm_head.weight                                             [vocab, hidden] (absent when tied)
//! ```
//!
//! w1/w3 of every expert are stacked into w13 [E, 2I, H] (w1 rows first) and w2 into [E, H, I]
//! for [`fmoe_moe::FusedMoe`]. fp8 checkpoints add `weight_scale` (per tensor) or
//! `weight_scale_inv` (128×128 blocks) beside each quantized weight; the router gate, norms,
//! embeddings and lm_head stay bf16.

use fmoe_core::{DType, Device};
use fmoe_moe::{FusedMoe, MoeConfig, Routing};

use crate::config::QuantizationConfig;
use crate::device::{self, DeviceCtx};
use crate::input::{AttentionLayout, ForwardInput};
use crate::kv_pool::KvPool;
use crate::layers::moe::{MoeOptions, load_expert_act_scales, load_experts, resolve_scheme};
use crate::layers::{AttentionSpec, ExpertNames, RopeStyle, Rotary};
use crate::loader::Vb;
use crate::model::{CausalLm, ForwardOutput, ModelInfo};
use crate::{Error, Result};

pub use crate::config::MixtralConfig as Config;

/// The experts of one layer under `vb` (`…block_sparse_moe`), on `device`.
fn load_moe(
    cfg: &Config,
    vb: &Vb,
    quant: &QuantizationConfig,
    moe: &MoeOptions,
    device: Device,
) -> Result<FusedMoe> {
    let (e, h) = (cfg.num_local_experts, cfg.hidden_size);
    let experts = load_experts(
        &vb.pp("experts"),
        ExpertNames::MIXTRAL,
        e,
        h,
        cfg.intermediate_size,
        quant,
    )?;
    let config = MoeConfig {
        num_experts: e,
        top_k: cfg.num_experts_per_tok,
        hidden: h,
        intermediate: cfg.intermediate_size,
        routing: Routing::Softmax { renormalize: true },
        shared_intermediate: None,
    };
    let scheme = resolve_scheme(quant, moe.scheme)?;
    let act_scales = load_expert_act_scales(&vb.pp("experts"), ExpertNames::MIXTRAL, e, quant)?;
    Ok(
        FusedMoe::new(config, scheme, experts, None, None, &moe.switches, device)?
            .with_act_scales(act_scales)?,
    )
}

fn attention_spec(cfg: &Config) -> AttentionSpec {
    AttentionSpec {
        hidden: cfg.hidden_size,
        num_heads: cfg.num_attention_heads,
        num_kv_heads: cfg.num_kv_heads(),
        head_dim: cfg.head_dim(),
        sliding_window: cfg.sliding_window,
    }
}

/// Mixtral with a language-model head.
pub struct MixtralForCausalLM {
    model: device::mixtral::Model,
    info: ModelInfo,
}

impl MixtralForCausalLM {
    /// Tensors [`MixtralForCausalLM::load`] reads (for the progress bar).
    pub fn num_tensors(cfg: &Config) -> u64 {
        let quant = cfg.quantization().unwrap_or(QuantizationConfig::None);
        let per_linear = quant.tensors_per_linear();
        let per_layer = 2 + 1 + (4 + 3 * cfg.num_local_experts) * per_linear;
        let head = if cfg.tie_word_embeddings { 0 } else { 1 };
        (2 + head + cfg.num_hidden_layers * per_layer) as u64
    }

    /// Builds the model from `vb` (the checkpoint root) on the CPU in f32 (the golden reference);
    /// `moe` picks the MoE method and kernels.
    pub fn load(cfg: &Config, vb: &Vb, moe: &MoeOptions) -> Result<MixtralForCausalLM> {
        MixtralForCausalLM::load_on(cfg, vb, moe, Device::Cpu, None)
    }

    /// Builds the model from `vb` (the checkpoint root) to run on `device` with activations in
    /// `dtype` (default: f32 on the CPU, the checkpoint's 16-bit dtype on a GPU); `moe` picks the
    /// MoE method and kernels (the experts live where the model runs).
    pub fn load_on(
        cfg: &Config,
        vb: &Vb,
        moe: &MoeOptions,
        device: Device,
        dtype: Option<DType>,
    ) -> Result<MixtralForCausalLM> {
        let bad = |m: String| Error::Options(format!("MixtralForCausalLM: {m}"));
        let quant = cfg.quantization().map_err(bad)?;
        let rope = cfg.rope().map_err(bad)?;
        let spec = attention_spec(cfg);
        let rotary = Rotary::new(&rope, cfg.head_dim(), RopeStyle::HalfSplit);
        let ctx = DeviceCtx::new(device, cfg.dtype().ok().flatten(), dtype);
        let model = device::mixtral::Model::load(cfg, vb, &quant, rotary, spec, ctx, |vb| {
            load_moe(cfg, vb, &quant, moe, device)
        })?;
        let moe = model
            .moe_layers()
            .next()
            .map(|e| (e.scheme(), e.kernel().family));
        Ok(MixtralForCausalLM {
            info: ModelInfo {
                architecture: "MixtralForCausalLM",
                vocab_size: cfg.vocab_size,
                max_position_embeddings: cfg.max_position_embeddings,
                eos_token_ids: cfg.eos_token_ids(),
                bos_token_id: cfg.bos_token_id,
                kv_layout: model.kv_layout().clone(),
                device,
                dtype: ctx.dtype,
                attention_layout: AttentionLayout::Paged,
                attention: device::mixtral::Model::attention_params(&spec),
                moe,
            },
            model,
        })
    }

    /// The MoE layers (kernel choice, method) for inspection.
    pub fn moe_layers(&self) -> impl Iterator<Item = &FusedMoe> {
        self.model.moe_layers()
    }
}

impl CausalLm for MixtralForCausalLM {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(&self, input: &ForwardInput, kv: &mut KvPool) -> Result<ForwardOutput> {
        self.model.forward(input, kv)
    }
}
