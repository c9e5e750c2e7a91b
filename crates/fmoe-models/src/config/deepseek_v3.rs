//! DeepSeek-V3's `config.json` (`DeepseekV3ForCausalLM`), its defaults and its validation.

use std::path::Path;

use fmoe_core::DType;
use serde::Deserialize;
use serde_json::Value;

use super::{
    QuantizationConfig, RopeConfig, RopeParametersJson, TokenIds, WeightCounts, check_model_sizes,
    check_token_ids, default_silu, parse_dtype, positive_f32,
};
use crate::{Error, Result};

fn default_true() -> bool {
    true
}
fn default_sigmoid() -> String {
    "sigmoid".into()
}
fn default_noaux_tc() -> String {
    "noaux_tc".into()
}
fn default_one() -> usize {
    1
}

/// DeepSeek-V3's config.json (`DeepseekV3ForCausalLM`). Defaults are DeepSeek-V3's.
#[derive(Clone, Debug, Deserialize)]
pub struct DeepseekV3Config {
    #[serde(default = "ds::vocab_size")]
    pub vocab_size: usize,
    #[serde(default = "ds::hidden_size")]
    pub hidden_size: usize,
    /// Dense MLP width (the first `first_k_dense_replace` layers).
    #[serde(default = "ds::intermediate_size")]
    pub intermediate_size: usize,
    /// Per routed expert.
    #[serde(default = "ds::moe_intermediate_size")]
    pub moe_intermediate_size: usize,
    #[serde(default = "ds::num_hidden_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "ds::num_attention_heads")]
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    #[serde(default = "ds::n_routed_experts")]
    pub n_routed_experts: usize,
    #[serde(default = "default_one")]
    pub n_shared_experts: usize,
    #[serde(default = "ds::num_experts_per_tok")]
    pub num_experts_per_tok: usize,
    #[serde(default = "ds::n_group")]
    pub n_group: usize,
    #[serde(default = "ds::topk_group")]
    pub topk_group: usize,
    #[serde(default = "ds::routed_scaling_factor")]
    pub routed_scaling_factor: f64,
    #[serde(default = "default_true")]
    pub norm_topk_prob: bool,
    #[serde(default = "ds::first_k_dense_replace")]
    pub first_k_dense_replace: usize,
    #[serde(default = "default_one")]
    pub moe_layer_freq: usize,
    /// `null` → a plain `q_proj`.
    #[serde(default = "ds::q_lora_rank")]
    pub q_lora_rank: Option<usize>,
    #[serde(default = "ds::kv_lora_rank")]
    pub kv_lora_rank: usize,
    #[serde(default = "ds::qk_nope_head_dim")]
    pub qk_nope_head_dim: usize,
    #[serde(default = "ds::qk_rope_head_dim")]
    pub qk_rope_head_dim: usize,
    #[serde(default = "ds::v_head_dim")]
    pub v_head_dim: usize,
    #[serde(default = "default_true")]
    pub rope_interleave: bool,
    #[serde(default = "default_one")]
    pub num_nextn_predict_layers: usize,
    #[serde(default = "default_sigmoid")]
    pub scoring_func: String,
    #[serde(default = "default_noaux_tc")]
    pub topk_method: String,
    #[serde(default = "ds::max_position_embeddings")]
    pub max_position_embeddings: usize,
    #[serde(default = "ds::rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_silu")]
    pub hidden_act: String,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<TokenIds>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<RopeParametersJson>,
    pub rope_parameters: Option<RopeParametersJson>,
    pub torch_dtype: Option<String>,
    pub dtype: Option<String>,
    pub quantization_config: Option<Value>,
}

/// DeepSeek-V3's defaults (transformers' `DeepseekV3Config`).
mod ds {
    pub fn vocab_size() -> usize {
        129280
    }
    pub fn hidden_size() -> usize {
        7168
    }
    pub fn intermediate_size() -> usize {
        18432
    }
    pub fn moe_intermediate_size() -> usize {
        2048
    }
    pub fn num_hidden_layers() -> usize {
        61
    }
    pub fn num_attention_heads() -> usize {
        128
    }
    pub fn n_routed_experts() -> usize {
        256
    }
    pub fn num_experts_per_tok() -> usize {
        8
    }
    pub fn n_group() -> usize {
        8
    }
    pub fn topk_group() -> usize {
        4
    }
    pub fn routed_scaling_factor() -> f64 {
        2.5
    }
    pub fn first_k_dense_replace() -> usize {
        3
    }
    pub fn q_lora_rank() -> Option<usize> {
        Some(1536)
    }
    pub fn kv_lora_rank() -> usize {
        512
    }
    pub fn qk_nope_head_dim() -> usize {
        128
    }
    pub fn qk_rope_head_dim() -> usize {
        64
    }
    pub fn v_head_dim() -> usize {
        128
    }
    pub fn max_position_embeddings() -> usize {
        4096
    }
    pub fn rms_norm_eps() -> f64 {
        1e-6
    }
}

impl DeepseekV3Config {
    pub(super) fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(Error::config(path, format!("DeepseekV3ForCausalLM: {m}")));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
            ("moe_layer_freq", self.moe_layer_freq),
        ] {
            if v == 0 {
                return bad(format!("`{name}` must be positive"));
            }
        }
        if self.scoring_func != "sigmoid" {
            return bad(format!(
                "scoring_func `{}` is not supported (sigmoid)",
                self.scoring_func
            ));
        }
        if self.topk_method != "noaux_tc" {
            return bad(format!(
                "topk_method `{}` is not supported (noaux_tc)",
                self.topk_method
            ));
        }
        if self.hidden_act != "silu" {
            return bad(format!(
                "hidden_act `{}` is not supported (silu)",
                self.hidden_act
            ));
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return bad(format!(
                "qk_rope_head_dim {} must be even for rotary",
                self.qk_rope_head_dim
            ));
        }
        if self.q_lora_rank == Some(0) {
            return bad("`q_lora_rank` must be positive or null".into());
        }
        if !self.n_routed_experts.is_multiple_of(self.n_group) {
            return bad(format!(
                "n_group {} does not divide n_routed_experts {}",
                self.n_group, self.n_routed_experts
            ));
        }
        if self.topk_group > self.n_group {
            return bad(format!(
                "topk_group {} exceeds n_group {}",
                self.topk_group, self.n_group
            ));
        }
        let reachable = self.topk_group * (self.n_routed_experts / self.n_group);
        if self.num_experts_per_tok > reachable {
            return bad(format!(
                "num_experts_per_tok {} exceeds the {reachable} experts of the topk_group {} kept groups",
                self.num_experts_per_tok, self.topk_group
            ));
        }
        let dense_layers = self.num_moe_layers() < self.num_hidden_layers;
        if dense_layers && self.intermediate_size == 0 {
            return bad("`intermediate_size` must be positive (dense MLP layers)".into());
        }
        let f32_err = |m: String| Error::config(path, format!("DeepseekV3ForCausalLM: {m}"));
        positive_f32("rms_norm_eps", self.rms_norm_eps).map_err(f32_err)?;
        positive_f32("routed_scaling_factor", self.routed_scaling_factor).map_err(f32_err)?;
        check_token_ids(self.vocab_size, self.bos_token_id, &self.eos_token_ids()).or_else(bad)?;
        check_model_sizes(
            self.weight_counts(),
            self.kv_elems_per_token(),
            self.max_position_embeddings,
        )
        .map_err(|e| Error::config(path, format!("DeepseekV3ForCausalLM: {e}")))?;
        self.rope().map_err(|m| Error::config(path, m))?;
        self.quantization().map_err(|m| Error::config(path, m))?;
        self.dtype().map_err(|m| Error::config(path, m))?;
        Ok(())
    }

    /// The number of MoE layers among `num_hidden_layers` (counted, not looped over).
    pub fn num_moe_layers(&self) -> usize {
        let (l, first, freq) = (
            self.num_hidden_layers,
            self.first_k_dense_replace,
            self.moe_layer_freq.max(1),
        );
        if l <= first {
            return 0;
        }
        // Multiples of `freq` in first..l.
        let below = |n: usize| n.div_ceil(freq);
        below(l) - below(first)
    }

    /// The weights' element counts, checked (see [`WeightCounts`]).
    pub fn weight_counts(&self) -> fmoe_core::Result<WeightCounts> {
        use fmoe_core::{checked_product as mul, checked_sum as add};
        let (h, heads, l) = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_hidden_layers,
        );
        let qk = add(
            "qk_head_dim",
            &[
                ("qk_nope_head_dim", self.qk_nope_head_dim),
                ("qk_rope_head_dim", self.qk_rope_head_dim),
            ],
        )?;
        let q_rows = mul(
            "q_proj rows",
            &[("num_attention_heads", heads), ("qk_head_dim", qk)],
        )?;
        let q = match self.q_lora_rank {
            Some(r) => add(
                "q_a_proj + q_b_proj elements",
                &[
                    (
                        "q_a_proj",
                        mul(
                            "q_a_proj elements",
                            &[("q_lora_rank", r), ("hidden_size", h)],
                        )?,
                    ),
                    (
                        "q_b_proj",
                        mul(
                            "q_b_proj elements",
                            &[("q_proj rows", q_rows), ("q_lora_rank", r)],
                        )?,
                    ),
                    ("q_a_layernorm", r),
                ],
            )?,
            None => mul(
                "q_proj elements",
                &[("q_proj rows", q_rows), ("hidden_size", h)],
            )?,
        };
        let kv_a_rows = add(
            "kv_a_proj rows",
            &[
                ("kv_lora_rank", self.kv_lora_rank),
                ("qk_rope_head_dim", self.qk_rope_head_dim),
            ],
        )?;
        let kv_b_rows = mul(
            "kv_b_proj rows",
            &[
                ("num_attention_heads", heads),
                (
                    "qk_nope_head_dim + v_head_dim",
                    add(
                        "qk_nope_head_dim + v_head_dim",
                        &[
                            ("qk_nope_head_dim", self.qk_nope_head_dim),
                            ("v_head_dim", self.v_head_dim),
                        ],
                    )?,
                ),
            ],
        )?;
        let attn = add(
            "attention elements per layer",
            &[
                ("q", q),
                (
                    "kv_a_proj",
                    mul(
                        "kv_a_proj elements",
                        &[("kv_a_proj rows", kv_a_rows), ("hidden_size", h)],
                    )?,
                ),
                (
                    "kv_b_proj",
                    mul(
                        "kv_b_proj elements",
                        &[
                            ("kv_b_proj rows", kv_b_rows),
                            ("kv_lora_rank", self.kv_lora_rank),
                        ],
                    )?,
                ),
                (
                    "o_proj",
                    mul(
                        "o_proj elements",
                        &[
                            ("hidden_size", h),
                            ("num_attention_heads", heads),
                            ("v_head_dim", self.v_head_dim),
                        ],
                    )?,
                ),
                ("norms", mul("norms", &[("hidden_size", h), ("", 2)])?),
                ("kv_a_layernorm", self.kv_lora_rank),
            ],
        )?;
        let moe_layers = self.num_moe_layers();
        let dense_mlp = mul(
            "dense MLP elements",
            &[
                ("dense layers", l - moe_layers),
                ("3 matrices", 3),
                ("intermediate_size", self.intermediate_size),
                ("hidden_size", h),
            ],
        )?;
        // The router gate [E, H] and its e_score_correction_bias [E] per MoE layer.
        let gates = mul(
            "router gate elements",
            &[
                ("MoE layers", moe_layers),
                ("n_routed_experts", self.n_routed_experts),
                (
                    "hidden_size + bias",
                    add("hidden_size + bias", &[("hidden_size", h), ("bias", 1)])?,
                ),
            ],
        )?;
        let embed = mul(
            "embed_tokens elements",
            &[("vocab_size", self.vocab_size), ("hidden_size", h)],
        )?;
        let lm_head = if self.tie_word_embeddings { 0 } else { embed };
        let dense = add(
            "dense weight elements",
            &[
                (
                    "attention",
                    mul(
                        "attention elements",
                        &[("num_hidden_layers", l), ("per layer", attn)],
                    )?,
                ),
                ("dense MLPs", dense_mlp),
                ("router gates", gates),
                ("embed_tokens", embed),
                ("lm_head", lm_head),
                ("norm", h),
            ],
        )?;
        let per_expert = mul(
            "elements per expert",
            &[
                ("3 matrices", 3),
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("hidden_size", h),
            ],
        )?;
        let experts = mul(
            "expert weight elements",
            &[
                ("MoE layers", moe_layers),
                (
                    "n_routed_experts + n_shared_experts",
                    add(
                        "experts per layer",
                        &[
                            ("n_routed_experts", self.n_routed_experts),
                            ("n_shared_experts", self.n_shared_experts),
                        ],
                    )?,
                ),
                ("elements per expert", per_expert),
            ],
        )?;
        Ok(WeightCounts { dense, experts })
    }

    /// KV-cache elements one token takes across all layers: the compressed latent and rope key
    /// per layer, or, where the device path decompresses them, every head's k and v (the larger
    /// of the two, so a bound for either path).
    pub fn kv_elems_per_token(&self) -> fmoe_core::Result<usize> {
        use fmoe_core::{checked_product as mul, checked_sum as add};
        let latent = add(
            "latent KV width",
            &[
                ("kv_lora_rank", self.kv_lora_rank),
                ("qk_rope_head_dim", self.qk_rope_head_dim),
            ],
        )?;
        let heads = mul(
            "decompressed KV width",
            &[
                ("num_attention_heads", self.num_attention_heads),
                (
                    "qk_head_dim + v_head_dim",
                    add(
                        "qk_head_dim + v_head_dim",
                        &[
                            ("qk_nope_head_dim", self.qk_nope_head_dim),
                            ("qk_rope_head_dim", self.qk_rope_head_dim),
                            ("v_head_dim", self.v_head_dim),
                        ],
                    )?,
                ),
            ],
        )?;
        mul(
            "KV elements per token",
            &[
                ("num_hidden_layers", self.num_hidden_layers),
                ("width", latent.max(heads)),
            ],
        )
    }

    /// Per-head q·k width: `qk_nope_head_dim + qk_rope_head_dim` (transformers' `qk_head_dim`;
    /// the file's `head_dim` is the rope width and is not read).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Width of the shared-expert MLP (`moe_intermediate_size · n_shared_experts`), if any.
    pub fn shared_intermediate(&self) -> Option<usize> {
        match self.n_shared_experts {
            0 => None,
            n => Some(self.moe_intermediate_size * n),
        }
    }

    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    /// True when layer `i` is a MoE layer (the others have a dense MLP).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        i >= self.first_k_dense_replace && i.is_multiple_of(self.moe_layer_freq)
    }

    /// Rotary parameters; θ defaults to 10000.
    pub fn rope(&self) -> std::result::Result<RopeConfig, String> {
        RopeConfig::resolve(
            self.rope_theta,
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
            self.max_position_embeddings,
            10000.0,
        )
    }

    pub fn quantization(&self) -> std::result::Result<QuantizationConfig, String> {
        QuantizationConfig::parse(self.quantization_config.as_ref())
    }

    pub fn dtype(&self) -> std::result::Result<Option<DType>, String> {
        parse_dtype(self.dtype.as_deref().or(self.torch_dtype.as_deref()))
    }
}
