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

use fmoe_core::{Device, Tensor};
use fmoe_moe::{FusedMoe, MoeConfig, Routing};

use crate::config::QuantizationConfig;
use crate::device::{self, DeviceCtx};
use crate::layers::moe::{MoeOptions, load_expert_act_scales, load_experts, resolve_scheme};
use crate::layers::{
    Attention, AttentionSpec, ExpertNames, Linear, LmEnds, MoeBlock, RmsNorm, RopeStyle, Rotary,
    add_in_place,
};
use crate::loader::Vb;
use crate::model::{
    CausalLm, ForwardBatch, KvCache, KvLayout, KvStorage, LogitsFor, ModelInfo, SeqChunk,
};
use crate::{Error, Placement, Result};

pub use crate::config::MixtralConfig as Config;

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    block_sparse_moe: MoeBlock,
}

impl DecoderLayer {
    fn load(
        cfg: &Config,
        vb: &Vb,
        quant: &QuantizationConfig,
        moe: &MoeOptions,
    ) -> Result<DecoderLayer> {
        let h = cfg.hidden_size;
        let spec = attention_spec(cfg);
        let self_attn = Attention::load(&vb.pp("self_attn"), spec, quant)?;
        let moe_vb = vb.pp("block_sparse_moe");
        // The router stays unquantized in fp8 checkpoints.
        let gate = Linear::load(
            &moe_vb.pp("gate"),
            cfg.num_local_experts,
            h,
            &QuantizationConfig::None,
        )?;
        let fused = load_moe(cfg, &moe_vb, quant, moe, Device::Cpu)?;
        Ok(DecoderLayer {
            input_layernorm: RmsNorm::load(&vb.pp("input_layernorm"), h, cfg.rms_norm_eps)?,
            self_attn,
            post_attention_layernorm: RmsNorm::load(
                &vb.pp("post_attention_layernorm"),
                h,
                cfg.rms_norm_eps,
            )?,
            block_sparse_moe: MoeBlock::new(gate, fused),
        })
    }
}

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
    path: ModelPath,
    info: ModelInfo,
}

enum ModelPath {
    /// f32 layers on the host.
    Host {
        ends: LmEnds,
        layers: Vec<DecoderLayer>,
        rotary: Rotary,
    },
    Device(device::mixtral::Model),
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

    /// Builds the host model (f32 layers on the CPU, [`Placement::Host`]) from `vb` (the
    /// checkpoint root); `moe` picks the MoE method and kernels.
    pub fn load(cfg: &Config, vb: &Vb, moe: &MoeOptions) -> Result<MixtralForCausalLM> {
        MixtralForCausalLM::load_on(cfg, vb, moe, Placement::Host)
    }

    /// Builds the model from `vb` (the checkpoint root) to run as `placement` says; `moe` picks
    /// the MoE method and kernels (the experts live where the model runs).
    pub fn load_on(
        cfg: &Config,
        vb: &Vb,
        moe: &MoeOptions,
        placement: Placement,
    ) -> Result<MixtralForCausalLM> {
        let bad = |m: String| Error::Options(format!("MixtralForCausalLM: {m}"));
        let quant = cfg.quantization().map_err(bad)?;
        let rope = cfg.rope().map_err(bad)?;
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let spec = attention_spec(cfg);
        let rotary = Rotary::new(&rope, cfg.head_dim(), RopeStyle::HalfSplit);
        let (path, kv_storage) = match placement {
            Placement::Host => {
                let m = vb.pp("model");
                let ends = LmEnds::load(vb, v, h, cfg.rms_norm_eps, cfg.tie_word_embeddings)?;
                let layers = (0..cfg.num_hidden_layers)
                    .map(|i| DecoderLayer::load(cfg, &m.pp("layers").pp(i), &quant, moe))
                    .collect::<Result<Vec<_>>>()?;
                (
                    ModelPath::Host {
                        ends,
                        layers,
                        rotary,
                    },
                    KvStorage::HostF32,
                )
            }
            Placement::Device(device) => {
                let ctx = DeviceCtx::new(device, cfg.dtype().ok().flatten());
                let model =
                    device::mixtral::Model::load(cfg, vb, &quant, rotary, spec, ctx, |vb| {
                        load_moe(cfg, vb, &quant, moe, device)
                    })?;
                (ModelPath::Device(model), ctx.kv_storage())
            }
        };
        let mut model = MixtralForCausalLM {
            path,
            info: ModelInfo {
                architecture: "MixtralForCausalLM",
                vocab_size: v,
                max_position_embeddings: cfg.max_position_embeddings,
                eos_token_ids: cfg.eos_token_ids(),
                bos_token_id: cfg.bos_token_id,
                kv_layout: KvLayout {
                    num_layers: cfg.num_hidden_layers,
                    streams: Attention::cache_streams(&spec),
                },
                kv_storage,
                moe: None,
            },
        };
        let moe = model
            .moe_layers()
            .next()
            .map(|e| (e.scheme(), e.kernel().family));
        model.info.moe = moe;
        Ok(model)
    }

    /// The MoE layers (kernel choice, method) for inspection.
    pub fn moe_layers(&self) -> Box<dyn Iterator<Item = &FusedMoe> + '_> {
        match &self.path {
            ModelPath::Host { layers, .. } => {
                Box::new(layers.iter().map(|l| l.block_sparse_moe.experts()))
            }
            ModelPath::Device(m) => Box::new(m.moe_layers()),
        }
    }
}

impl CausalLm for MixtralForCausalLM {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(
        &self,
        chunks: &[SeqChunk],
        cache: &mut dyn KvCache,
        which: LogitsFor,
    ) -> Result<Tensor> {
        let batch = ForwardBatch::new(chunks, cache, self.info.max_position_embeddings)?;
        let (ends, layers, rotary) = match &self.path {
            ModelPath::Host {
                ends,
                layers,
                rotary,
            } => (ends, layers, rotary),
            ModelPath::Device(m) => return m.forward(&batch, cache, which),
        };
        let t = batch.num_tokens();
        let rope = rotary.table(&batch.positions);
        let mut h = ends.embed(&batch.tokens)?;
        for (i, layer) in layers.iter().enumerate() {
            let a = layer.input_layernorm.forward(&h)?;
            let a = layer
                .self_attn
                .forward(&a, &batch, rotary, &rope, i, cache)?;
            add_in_place(&mut h, &a);
            let m = layer.post_attention_layernorm.forward(&h)?;
            let m = layer.block_sparse_moe.forward(&m, t)?;
            add_in_place(&mut h, &m);
        }
        ends.logits(&h, &batch, which, self.info.vocab_size)
    }
}
