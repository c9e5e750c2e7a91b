//! DeepSeek-V3 (`DeepseekV3ForCausalLM`), as transformers computes it.
//!
//! References: DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv:2412.19437); transformers'
//! `models/deepseek_v3/modeling_deepseek_v3.py`. Each decoder layer is
//! `h += mla(rms(h)); h += ffn(rms(h))`, where attention is multi-head latent attention
//! ([`Mla`]: low-rank q, a compressed KV latent + shared rope key, YaRN with interleaved pairs)
//! and the FFN is a dense SwiGLU MLP for the first `first_k_dense_replace` layers and a MoE
//! after: 256 routed experts chosen by "noaux_tc" grouped sigmoid routing (in f32; the
//! `e_score_correction_bias` steers the choice only; weights renormalized and × 2.5) plus an
//! always-on shared expert.
//!
//! The checkpoint, as this file reads it (`N` < `num_hidden_layers`; the extra multi-token
//! prediction layers after them are never read):
//!
//! ```text
//! model.embed_tokens.weight                                      [vocab, hidden]
//! model.layers.N.input_layernorm.weight                          [hidden]
//! model.layers.N.self_attn.q_a_proj.weight                       [q_lora, hidden]
//! model.layers.N.self_attn.q_a_layernorm.weight                  [q_lora]
//! model.layers.N.self_attn.q_b_proj.weight                       [heads·(nope+rope), q_lora]
//!   (or self_attn.q_proj.weight [heads·(nope+rope), hidden] when q_lora_rank is null)
//! model.layers.N.self_attn.kv_a_proj_with_mqa.weight             [kv_lora+rope, hidden]
//! model.layers.N.self_attn.kv_a_layernorm.weight                 [kv_lora]
//! model.layers.N.self_attn.kv_b_proj.weight                      [heads·(nope+v), kv_lora]
//! model.layers.N.self_attn.o_proj.weight                         [hidden, heads·v]
//! model.layers.N.post_attention_layernorm.weight                 [hidden]
//! dense layers:  model.layers.N.mlp.{gate,up,down}_proj.weight   [I, hidden] [I, hidden] [hidden, I]
//! MoE layers:    model.layers.N.mlp.gate.weight                  [experts, hidden]
//!                model.layers.N.mlp.gate.e_score_correction_bias [experts] (f32)
//!                model.layers.N.mlp.experts.J.{gate,up,down}_proj.weight
//!                model.layers.N.mlp.shared_experts.{gate,up,down}_proj.weight
//! model.norm.weight                                              [hidden]
//! lm_head.weight                                                 [vocab, hidden]
//! ```
//!
//! fp8 checkpoints (DeepSeek's own: 128×128 blocks) add `weight_scale_inv` beside every
//! attention, MLP and expert linear; embeddings, norms, the router gate and its bias, and
//! lm_head stay unquantized.

use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::routing::TopK;
use fmoe_moe::{FusedMoe, MoeConfig, Routing};

use crate::config::QuantizationConfig;
use crate::device::{self, DeviceCtx};
use crate::input::{AttentionLayout, ForwardInput};
use crate::kv_pool::KvPool;
use crate::layers::moe::{MoeOptions, load_experts, load_single_expert, resolve_scheme};
use crate::layers::{ExpertNames, Linear, MlaSpec, RopeStyle, Rotary};
use crate::loader::Vb;
use crate::model::{CausalLm, ForwardOutput, ModelInfo};
use crate::{Error, Result};

pub use crate::config::DeepseekV3Config as Config;

/// The routing a MoE layer chose for each token of a forward pass (see
/// [`DeepseekV3ForCausalLM::forward_traced`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RouterTrace {
    pub layer: usize,
    pub top_k: usize,
    /// [tokens, top_k] expert ids, best first.
    pub ids: Vec<u32>,
    /// [tokens, top_k] routing weights (renormalized and scaled).
    pub weights: Vec<f32>,
}

/// Router gate (unquantized), routed experts + shared expert (on `device`) and the selection bias
/// under `vb` (`…mlp`).
fn load_moe(
    cfg: &Config,
    vb: &Vb,
    quant: &QuantizationConfig,
    moe: &MoeOptions,
    device: Device,
) -> Result<(Linear, FusedMoe, Tensor)> {
    let (e, h, inter) = (
        cfg.n_routed_experts,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
    );
    let gate = Linear::load(&vb.pp("gate"), e, h, &QuantizationConfig::None)?;
    let bias = vb
        .pp("gate")
        .get("e_score_correction_bias", &[e], &[DType::F32, DType::BF16])?
        .to_dtype(DType::F32)?;
    let experts = load_experts(&vb.pp("experts"), ExpertNames::DEFAULT, e, h, inter, quant)?;
    let shared = cfg
        .shared_intermediate()
        .map(|ns| load_single_expert(&vb.pp("shared_experts"), ExpertNames::DEFAULT, h, ns, quant))
        .transpose()?;
    let config = MoeConfig {
        num_experts: e,
        top_k: cfg.num_experts_per_tok,
        hidden: h,
        intermediate: inter,
        routing: Routing::GroupedSigmoid {
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            renormalize: cfg.norm_topk_prob,
            routed_scaling_factor: cfg.routed_scaling_factor as f32,
        },
        shared_intermediate: cfg.shared_intermediate(),
    };
    let scheme = resolve_scheme(quant, moe.scheme)?;
    let fused = FusedMoe::new(
        config,
        scheme,
        experts,
        shared,
        Some(bias.clone()),
        &moe.switches,
        device,
    )?;
    Ok((gate, fused, bias))
}

/// DeepSeek-V3 with a language-model head.
pub struct DeepseekV3ForCausalLM {
    model: device::deepseek_v3::Model,
    info: ModelInfo,
}

impl DeepseekV3ForCausalLM {
    /// Tensors [`DeepseekV3ForCausalLM::load`] reads (for the progress bar).
    pub fn num_tensors(cfg: &Config) -> u64 {
        let quant = cfg.quantization().unwrap_or(QuantizationConfig::None);
        let per_linear = quant.tensors_per_linear();
        let attn = match cfg.q_lora_rank {
            Some(_) => 2 * per_linear + 1,
            None => per_linear,
        } + 3 * per_linear
            + 1;
        let dense = 3 * per_linear;
        let shared = if cfg.n_shared_experts > 0 { 3 } else { 0 };
        let moe = 2 + (3 * cfg.n_routed_experts + shared) * per_linear;
        let layers: usize = (0..cfg.num_hidden_layers)
            .map(|i| 2 + attn + if cfg.is_moe_layer(i) { moe } else { dense })
            .sum();
        let head = if cfg.tie_word_embeddings { 0 } else { 1 };
        (2 + head + layers) as u64
    }

    /// Builds the model from `vb` (the checkpoint root) on the CPU in f32 (the golden reference);
    /// `moe` picks the MoE method and kernels.
    pub fn load(cfg: &Config, vb: &Vb, moe: &MoeOptions) -> Result<DeepseekV3ForCausalLM> {
        DeepseekV3ForCausalLM::load_on(cfg, vb, moe, Device::Cpu, None)
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
    ) -> Result<DeepseekV3ForCausalLM> {
        let bad = |m: String| Error::Options(format!("DeepseekV3ForCausalLM: {m}"));
        let quant = cfg.quantization().map_err(bad)?;
        let rope = cfg.rope().map_err(bad)?;
        let spec = MlaSpec::from_config(cfg).map_err(bad)?;
        let rotary = Rotary::new(&rope, cfg.qk_rope_head_dim, RopeStyle::Interleaved);
        let ctx = DeviceCtx::new(device, cfg.dtype().ok().flatten(), dtype);
        let model = device::deepseek_v3::Model::load(cfg, vb, &quant, rotary, spec, ctx, |vb| {
            let (gate, fused, bias) = load_moe(cfg, vb, &quant, moe, device)?;
            let gate = gate.dequantized(ctx.dtype)?.to_device(device)?;
            Ok((gate, fused, bias))
        })?;
        let moe = model
            .moe_layers()
            .next()
            .map(|e| (e.scheme(), e.kernel().family));
        Ok(DeepseekV3ForCausalLM {
            info: ModelInfo {
                architecture: "DeepseekV3ForCausalLM",
                vocab_size: cfg.vocab_size,
                max_position_embeddings: cfg.max_position_embeddings,
                eos_token_ids: cfg.eos_token_ids(),
                bos_token_id: cfg.bos_token_id,
                kv_layout: model.kv_layout().clone(),
                device,
                dtype: ctx.dtype,
                attention_layout: AttentionLayout::Gathered,
                attention: device::deepseek_v3::Model::attention_params(&spec),
                moe,
            },
            model,
        })
    }

    /// The MoE layers (kernel choice, method) for inspection.
    pub fn moe_layers(&self) -> impl Iterator<Item = &FusedMoe> {
        self.model.moe_layers()
    }

    /// [`CausalLm::forward`], also returning every MoE layer's routing of the step's tokens
    /// (downloaded: a synchronization per MoE layer).
    pub fn forward_traced(
        &self,
        input: &ForwardInput,
        kv: &mut KvPool,
    ) -> Result<(ForwardOutput, Vec<RouterTrace>)> {
        let mut topk = Vec::new();
        let out = self.model.forward(input, kv, Some(&mut topk))?;
        let trace = topk
            .into_iter()
            .map(|(layer, tk)| router_trace(layer, &tk))
            .collect::<Result<Vec<_>>>()?;
        Ok((out, trace))
    }
}

/// A host top-k as a [`RouterTrace`] of `layer`.
fn router_trace(layer: usize, tk: &TopK) -> Result<RouterTrace> {
    const OP: &str = "DeepseekV3ForCausalLM::forward_traced";
    Ok(RouterTrace {
        layer,
        top_k: tk.ids.dims().get(1).copied().unwrap_or(0),
        ids: tk.ids.cpu_slice::<u32>(OP, "topk_ids")?.to_vec(),
        weights: tk.weights.to_f32_vec()?,
    })
}

impl CausalLm for DeepseekV3ForCausalLM {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(&self, input: &ForwardInput, kv: &mut KvPool) -> Result<ForwardOutput> {
        self.model.forward(input, kv, None)
    }
}
