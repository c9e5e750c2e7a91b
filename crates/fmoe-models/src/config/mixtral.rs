//! Mixtral's `config.json` (`MixtralForCausalLM`) and its validation.

use std::path::Path;

use fmoe_core::DType;
use serde::Deserialize;
use serde_json::Value;

use super::{
    QuantizationConfig, RopeConfig, RopeParametersJson, TokenIds, WeightCounts, check_model_sizes,
    check_token_ids, default_silu, parse_dtype, positive_f32,
};
use crate::{Error, Result};

fn default_rms_norm_eps() -> f64 {
    1e-5
}
fn default_max_positions() -> usize {
    32768
}

/// Mixtral's config.json (`MixtralForCausalLM`).
#[derive(Clone, Debug, Deserialize)]
pub struct MixtralConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Per expert.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    pub sliding_window: Option<usize>,
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default = "default_silu")]
    pub hidden_act: String,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<TokenIds>,
    /// 4.x layout.
    pub rope_theta: Option<f64>,
    /// 4.x layout.
    pub rope_scaling: Option<RopeParametersJson>,
    /// 5.x layout.
    pub rope_parameters: Option<RopeParametersJson>,
    /// 4.x layout.
    pub torch_dtype: Option<String>,
    /// 5.x layout.
    pub dtype: Option<String>,
    pub quantization_config: Option<Value>,
}

impl MixtralConfig {
    pub(super) fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(Error::config(path, format!("MixtralForCausalLM: {m}")));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_kv_heads()),
            ("head_dim", self.head_dim()),
            ("num_local_experts", self.num_local_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(format!("`{name}` must be positive"));
            }
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(format!(
                "hidden_size {} is not a multiple of num_attention_heads {} (and head_dim is unset)",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even for rotary",
                self.head_dim()
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads()) {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_kv_heads()
            ));
        }
        if self.num_experts_per_tok > self.num_local_experts {
            return bad(format!(
                "num_experts_per_tok {} exceeds num_local_experts {}",
                self.num_experts_per_tok, self.num_local_experts
            ));
        }
        if self.hidden_act != "silu" {
            return bad(format!(
                "hidden_act `{}` is not supported (silu)",
                self.hidden_act
            ));
        }
        if self.sliding_window == Some(0) {
            return bad("`sliding_window` must be positive or null".into());
        }
        positive_f32("rms_norm_eps", self.rms_norm_eps)
            .map_err(|m| Error::config(path, format!("MixtralForCausalLM: {m}")))?;
        check_token_ids(self.vocab_size, self.bos_token_id, &self.eos_token_ids()).or_else(bad)?;
        check_model_sizes(
            self.weight_counts(),
            self.kv_elems_per_token(),
            self.max_position_embeddings,
        )
        .map_err(|e| Error::config(path, format!("MixtralForCausalLM: {e}")))?;
        self.rope().map_err(|m| Error::config(path, m))?;
        self.quantization().map_err(|m| Error::config(path, m))?;
        self.dtype().map_err(|m| Error::config(path, m))?;
        Ok(())
    }

    /// The weights' element counts, checked (see [`WeightCounts`]).
    pub fn weight_counts(&self) -> fmoe_core::Result<WeightCounts> {
        use fmoe_core::{checked_product as mul, checked_sum as add};
        let (h, d, l) = (self.hidden_size, self.head_dim(), self.num_hidden_layers);
        let (heads, kv) = (self.num_attention_heads, self.num_kv_heads());
        let q = mul(
            "q_proj/o_proj elements",
            &[
                ("num_attention_heads", heads),
                ("head_dim", d),
                ("hidden_size", h),
            ],
        )?;
        let k = mul(
            "k_proj/v_proj elements",
            &[
                ("num_key_value_heads", kv),
                ("head_dim", d),
                ("hidden_size", h),
            ],
        )?;
        let gate = mul(
            "router gate elements",
            &[
                ("num_local_experts", self.num_local_experts),
                ("hidden_size", h),
            ],
        )?;
        let layer = add(
            "dense elements per layer",
            &[
                (
                    "q_proj + o_proj",
                    mul("q_proj + o_proj", &[("", q), ("", 2)])?,
                ),
                (
                    "k_proj + v_proj",
                    mul("k_proj + v_proj", &[("", k), ("", 2)])?,
                ),
                ("gate", gate),
                ("norms", mul("norms", &[("hidden_size", h), ("", 2)])?),
            ],
        )?;
        let embed = mul(
            "embed_tokens elements",
            &[("vocab_size", self.vocab_size), ("hidden_size", h)],
        )?;
        let heads_out = if self.tie_word_embeddings { 0 } else { embed };
        let dense = add(
            "dense weight elements",
            &[
                (
                    "layers",
                    mul(
                        "dense layer elements",
                        &[("num_hidden_layers", l), ("per layer", layer)],
                    )?,
                ),
                ("embed_tokens", embed),
                ("lm_head", heads_out),
                ("norm", h),
            ],
        )?;
        let experts = mul(
            "expert weight elements",
            &[
                ("num_hidden_layers", l),
                ("num_local_experts", self.num_local_experts),
                ("3 matrices", 3),
                ("intermediate_size", self.intermediate_size),
                ("hidden_size", h),
            ],
        )?;
        Ok(WeightCounts { dense, experts })
    }

    /// KV-cache elements one token takes across all layers (k and v rows).
    pub fn kv_elems_per_token(&self) -> fmoe_core::Result<usize> {
        fmoe_core::checked_product(
            "KV elements per token",
            &[
                ("num_hidden_layers", self.num_hidden_layers),
                ("k and v", 2),
                ("num_key_value_heads", self.num_kv_heads()),
                ("head_dim", self.head_dim()),
            ],
        )
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Rotary parameters from `rope_theta`/`rope_scaling` (4.x) or `rope_parameters` (5.x);
    /// θ defaults to Mixtral's 1e6.
    pub fn rope(&self) -> std::result::Result<RopeConfig, String> {
        RopeConfig::resolve(
            self.rope_theta,
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
            self.max_position_embeddings,
            1e6,
        )
    }

    pub fn quantization(&self) -> std::result::Result<QuantizationConfig, String> {
        QuantizationConfig::parse(self.quantization_config.as_ref())
    }

    /// The checkpoint's dtype (`dtype`, else `torch_dtype`), if stated.
    pub fn dtype(&self) -> std::result::Result<Option<DType>, String> {
        parse_dtype(self.dtype.as_deref().or(self.torch_dtype.as_deref()))
    }

    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }
}
