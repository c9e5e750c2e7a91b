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

use fmoe_core::Tensor;
use fmoe_moe::{FusedMoe, MoeConfig, Routing};

use crate::config::QuantizationConfig;
use crate::layers::moe::{MoeOptions, load_experts, resolve_scheme};
use crate::layers::{
    Attention, AttentionSpec, ExpertNames, Linear, LmEnds, MoeBlock, RmsNorm, RopeStyle, Rotary,
    add_in_place,
};
use crate::loader::Vb;
use crate::model::{CausalLm, ForwardBatch, KvCache, KvLayout, LogitsFor, ModelInfo, SeqChunk};
use crate::{Error, Result};

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
        let e = cfg.num_local_experts;
        // The router stays unquantized in fp8 checkpoints.
        let gate = Linear::load(&moe_vb.pp("gate"), e, h, &QuantizationConfig::None)?;
        let experts = load_experts(
            &moe_vb.pp("experts"),
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
        let fused = FusedMoe::new(
            config,
            scheme,
            experts,
            None,
            None,
            &moe.switches,
            moe.device,
        )?;
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
    ends: LmEnds,
    layers: Vec<DecoderLayer>,
    rotary: Rotary,
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

    /// Builds the model from `vb` (the checkpoint root). `moe` picks the MoE method, kernels and
    /// device; dense layers run on the CPU in f32 from their stored weights.
    pub fn load(cfg: &Config, vb: &Vb, moe: &MoeOptions) -> Result<MixtralForCausalLM> {
        let bad = |m: String| Error::Options(format!("MixtralForCausalLM: {m}"));
        let quant = cfg.quantization().map_err(bad)?;
        let rope = cfg.rope().map_err(bad)?;
        let m = vb.pp("model");
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let ends = LmEnds::load(vb, v, h, cfg.rms_norm_eps, cfg.tie_word_embeddings)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::load(cfg, &m.pp("layers").pp(i), &quant, moe))
            .collect::<Result<Vec<_>>>()?;
        let spec = attention_spec(cfg);
        let moe_summary = layers.first().map(|l| {
            let e = l.block_sparse_moe.experts();
            (e.scheme(), e.kernel().family)
        });
        let info = ModelInfo {
            architecture: "MixtralForCausalLM",
            vocab_size: v,
            max_position_embeddings: cfg.max_position_embeddings,
            eos_token_ids: cfg.eos_token_ids(),
            bos_token_id: cfg.bos_token_id,
            kv_layout: KvLayout {
                num_layers: cfg.num_hidden_layers,
                streams: Attention::cache_streams(&spec),
            },
            moe: moe_summary,
        };
        Ok(MixtralForCausalLM {
            ends,
            layers,
            rotary: Rotary::new(&rope, cfg.head_dim(), RopeStyle::HalfSplit),
            info,
        })
    }

    /// The MoE layers (kernel choice, method) for inspection.
    pub fn moe_layers(&self) -> impl Iterator<Item = &FusedMoe> {
        self.layers.iter().map(|l| l.block_sparse_moe.experts())
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
        let t = batch.num_tokens();
        let rope = self.rotary.table(&batch.positions);
        let mut h = self.ends.embed(&batch.tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let a = layer.input_layernorm.forward(&h)?;
            let a = layer
                .self_attn
                .forward(&a, &batch, &self.rotary, &rope, i, cache)?;
            add_in_place(&mut h, &a);
            let m = layer.post_attention_layernorm.forward(&h)?;
            let m = layer.block_sparse_moe.forward(&m, t)?;
            add_in_place(&mut h, &m);
        }
        self.ends.logits(&h, &batch, which, self.info.vocab_size)
    }
}
