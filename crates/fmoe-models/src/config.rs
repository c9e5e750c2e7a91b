//! `config.json` as Hugging Face writes it, for the architectures fmoe serves.
//!
//! The serde structs mirror the file's field names. Both layouts transformers writes are accepted:
//! 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters: {rope_theta,
//! rope_type, ...}`, `dtype`). The typed accessors ([`MixtralConfig::rope`],
//! [`MixtralConfig::quantization`], ...) resolve the two layouts into one value, so models never
//! look at raw JSON.

use std::path::{Path, PathBuf};

use fmoe_core::DType;
use serde::Deserialize;
use serde_json::Value;

use crate::{Error, Result};

/// A parsed `config.json`: one variant per supported architecture.
#[derive(Clone, Debug)]
pub enum ModelConfig {
    Mixtral(MixtralConfig),
    DeepseekV3(DeepseekV3Config),
}

impl ModelConfig {
    /// Reads and parses `path` (a `config.json`).
    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            err: source,
        })?;
        ModelConfig::from_json_str(&text, path)
    }

    /// Parses config.json text; `path` only names the file in errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<ModelConfig> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::config(path, format!("invalid JSON: {e}")))?;
        let arch = architecture_of(&value, path)?;
        let parse_err = |e: serde_json::Error| Error::config(path, format!("{arch}: {e}"));
        let config = match arch.as_str() {
            "MixtralForCausalLM" => {
                let c: MixtralConfig = serde_json::from_value(value).map_err(parse_err)?;
                c.validate(path)?;
                ModelConfig::Mixtral(c)
            }
            "DeepseekV3ForCausalLM" => {
                let c: DeepseekV3Config = serde_json::from_value(value).map_err(parse_err)?;
                c.validate(path)?;
                ModelConfig::DeepseekV3(c)
            }
            _ => {
                return Err(Error::UnknownArchitecture {
                    path: path.to_path_buf(),
                    arch,
                });
            }
        };
        Ok(config)
    }

    /// The Hugging Face architecture name.
    pub fn architecture(&self) -> &'static str {
        match self {
            ModelConfig::Mixtral(_) => "MixtralForCausalLM",
            ModelConfig::DeepseekV3(_) => "DeepseekV3ForCausalLM",
        }
    }
}

/// `architectures[0]`, else the `model_type` mapped to its architecture.
fn architecture_of(value: &Value, path: &Path) -> Result<String> {
    if let Some(arch) = value
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
    {
        return Ok(arch.to_string());
    }
    match value.get("model_type").and_then(Value::as_str) {
        Some("mixtral") => Ok("MixtralForCausalLM".into()),
        Some("deepseek_v3") => Ok("DeepseekV3ForCausalLM".into()),
        Some(other) => Ok(other.to_string()),
        None => Err(Error::config(
            path,
            "neither `architectures` nor `model_type` is set",
        )),
    }
}

/// `eos_token_id`: one id or a list.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// `rope_scaling` (4.x) or `rope_parameters` (5.x), as written. Every field is optional here;
/// [`RopeConfig::resolve`] checks what each rope type needs.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct RopeParametersJson {
    pub rope_type: Option<String>,
    /// Older files spell `rope_type` as `type`.
    #[serde(rename = "type")]
    pub type_: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub original_max_position_embeddings: Option<usize>,
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub attention_factor: Option<f64>,
    pub truncate: Option<bool>,
}

/// Rotary embedding parameters, resolved from either layout.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// The frequency schedule.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `inv_freq[i] = θ^(-2i/d)`.
    Default,
    /// YaRN (DeepSeek-V3): interpolation and extrapolation blended by a ramp between the
    /// correction dims of `beta_fast`/`beta_slow`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
        truncate: bool,
    },
}

impl RopeConfig {
    /// Combines the 4.x fields (`rope_theta`, `rope_scaling`) and the 5.x `rope_parameters`
    /// (which wins where both are present). `max_position_embeddings` is YaRN's default original
    /// length.
    pub fn resolve(
        rope_theta: Option<f64>,
        rope_scaling: Option<&RopeParametersJson>,
        rope_parameters: Option<&RopeParametersJson>,
        max_position_embeddings: usize,
        default_theta: f64,
    ) -> std::result::Result<RopeConfig, String> {
        let p = rope_parameters.or(rope_scaling);
        let theta = p
            .and_then(|p| p.rope_theta)
            .or(rope_theta)
            .unwrap_or(default_theta);
        if !(theta.is_finite() && theta > 0.0) {
            return Err(format!("rope_theta must be positive, got {theta}"));
        }
        let kind = p.and_then(|p| p.rope_type.as_deref().or(p.type_.as_deref()));
        let scaling = match kind {
            None | Some("default") => RopeScaling::Default,
            Some("yarn") => {
                let p = p.cloned().unwrap_or_default();
                let factor = p
                    .factor
                    .ok_or("rope type yarn needs `factor`".to_string())?;
                if !(factor.is_finite() && factor >= 1.0) {
                    return Err(format!("yarn `factor` must be >= 1, got {factor}"));
                }
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: p
                        .original_max_position_embeddings
                        .unwrap_or(max_position_embeddings),
                    beta_fast: p.beta_fast.unwrap_or(32.0),
                    beta_slow: p.beta_slow.unwrap_or(1.0),
                    mscale: p.mscale,
                    mscale_all_dim: p.mscale_all_dim,
                    attention_factor: p.attention_factor,
                    truncate: p.truncate.unwrap_or(true),
                }
            }
            Some(other) => {
                return Err(format!(
                    "unsupported rope type `{other}` (supported: default, yarn)"
                ));
            }
        };
        Ok(RopeConfig { theta, scaling })
    }
}

/// fp8 activation scales: computed per batch, or fixed by the checkpoint (`input_scale`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationScheme {
    Dynamic,
    Static,
}

/// `quantization_config`, typed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuantizationConfig {
    /// No `quantization_config`: weights are bf16/f16/f32.
    None,
    /// `{quant_method: fp8, activation_scheme}`: e4m3 weights with a scalar `weight_scale` each
    /// (and `input_scale` when static).
    Fp8PerTensor { activation_scheme: ActivationScheme },
    /// `{quant_method: fp8, weight_block_size: [128, 128]}`: e4m3 weights with
    /// `weight_scale_inv` [⌈out/128⌉, ⌈in/128⌉] each.
    Fp8Block {
        block: [usize; 2],
        activation_scheme: ActivationScheme,
    },
}

impl QuantizationConfig {
    /// Parses the raw `quantization_config` object (`None` → not quantized).
    pub fn parse(raw: Option<&Value>) -> std::result::Result<QuantizationConfig, String> {
        let Some(raw) = raw else {
            return Ok(QuantizationConfig::None);
        };
        if raw.is_null() {
            return Ok(QuantizationConfig::None);
        }
        let field = |k: &str| raw.get(k).and_then(Value::as_str);
        let method = field("quant_method")
            .ok_or("quantization_config: `quant_method` is missing or not a string")?;
        if method != "fp8" {
            return Err(format!(
                "quantization_config: unsupported quant_method `{method}` (supported: fp8)"
            ));
        }
        if let Some(fmt) = field("fmt")
            && fmt != "e4m3"
        {
            return Err(format!(
                "quantization_config: unsupported fp8 fmt `{fmt}` (supported: e4m3)"
            ));
        }
        let activation_scheme = match field("activation_scheme").unwrap_or("dynamic") {
            "dynamic" => ActivationScheme::Dynamic,
            "static" => ActivationScheme::Static,
            other => {
                return Err(format!(
                    "quantization_config: unknown activation_scheme `{other}` (dynamic or static)"
                ));
            }
        };
        match raw.get("weight_block_size") {
            None | Some(Value::Null) => Ok(QuantizationConfig::Fp8PerTensor { activation_scheme }),
            Some(v) => {
                let block: Vec<u64> = v
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                if block != [128, 128] {
                    return Err(format!(
                        "quantization_config: weight_block_size {v} is not supported (only [128, 128])"
                    ));
                }
                Ok(QuantizationConfig::Fp8Block {
                    block: [128, 128],
                    activation_scheme,
                })
            }
        }
    }
}

/// Parses `torch_dtype` (4.x) / `dtype` (5.x).
fn parse_dtype(dtype: Option<&str>) -> std::result::Result<Option<DType>, String> {
    dtype
        .map(|s| {
            s.trim_start_matches("torch.")
                .parse::<DType>()
                .map_err(|e| format!("dtype: {e}"))
        })
        .transpose()
}

fn default_rms_norm_eps() -> f64 {
    1e-5
}
fn default_silu() -> String {
    "silu".into()
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
    fn validate(&self, path: &Path) -> Result<()> {
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
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps must be positive, got {}",
                self.rms_norm_eps
            ));
        }
        self.rope().map_err(|m| Error::config(path, m))?;
        self.quantization().map_err(|m| Error::config(path, m))?;
        self.dtype().map_err(|m| Error::config(path, m))?;
        Ok(())
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
    fn validate(&self, path: &Path) -> Result<()> {
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
        let dense_layers = (0..self.num_hidden_layers).any(|i| !self.is_moe_layer(i));
        if dense_layers && self.intermediate_size == 0 {
            return bad("`intermediate_size` must be positive (dense MLP layers)".into());
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps must be positive, got {}",
                self.rms_norm_eps
            ));
        }
        if !(self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0) {
            return bad(format!(
                "routed_scaling_factor must be positive, got {}",
                self.routed_scaling_factor
            ));
        }
        self.rope().map_err(|m| Error::config(path, m))?;
        self.quantization().map_err(|m| Error::config(path, m))?;
        self.dtype().map_err(|m| Error::config(path, m))?;
        Ok(())
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

/// `dir/config.json`.
pub fn config_path(dir: &Path) -> PathBuf {
    dir.join("config.json")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(text, Path::new("config.json"))
    }

    const MIXTRAL_V4: &str = r#"{
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "sliding_window": null, "num_local_experts": 8, "num_experts_per_tok": 2,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "tie_word_embeddings": false
    }"#;

    fn mixtral(text: &str) -> MixtralConfig {
        match parse(text).unwrap() {
            ModelConfig::Mixtral(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn mixtral_4x_and_5x_layouts_agree() {
        let v4 = mixtral(MIXTRAL_V4);
        let v5_text = MIXTRAL_V4
            .replace(
                r#""rope_theta": 1000000.0"#,
                r#""rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}"#,
            )
            .replace("torch_dtype", "dtype");
        let v5 = mixtral(&v5_text);
        assert_eq!(v4.rope().unwrap(), v5.rope().unwrap());
        assert_eq!(v4.rope().unwrap().theta, 1e6);
        assert_eq!(v4.dtype().unwrap(), Some(DType::BF16));
        assert_eq!(v5.dtype().unwrap(), Some(DType::BF16));
        assert_eq!(v4.head_dim(), 128);
        assert_eq!(v4.num_kv_heads(), 8);
        assert_eq!(v4.eos_token_ids(), vec![2]);
        assert_eq!(v4.quantization().unwrap(), QuantizationConfig::None);
    }

    #[test]
    fn quantization_configs_are_typed() {
        let q = |v: &str| QuantizationConfig::parse(Some(&serde_json::from_str(v).unwrap()));
        assert_eq!(
            q(
                r#"{"quant_method":"fp8","fmt":"e4m3","activation_scheme":"dynamic","weight_block_size":[128,128]}"#
            ),
            Ok(QuantizationConfig::Fp8Block {
                block: [128, 128],
                activation_scheme: ActivationScheme::Dynamic
            })
        );
        assert_eq!(
            q(r#"{"quant_method":"fp8","activation_scheme":"static"}"#),
            Ok(QuantizationConfig::Fp8PerTensor {
                activation_scheme: ActivationScheme::Static
            })
        );
        assert!(
            q(r#"{"quant_method":"fp8","weight_block_size":[64,64]}"#)
                .unwrap_err()
                .contains("[64,64]")
        );
        assert!(q(r#"{"quant_method":"awq"}"#).unwrap_err().contains("awq"));
        assert!(
            q(r#"{"quant_method":"fp8","activation_scheme":"weird"}"#)
                .unwrap_err()
                .contains("weird")
        );
    }

    #[test]
    fn bad_configs_name_the_problem() {
        let err = |t: &str| parse(t).unwrap_err().to_string();
        assert!(err("{not json").contains("invalid JSON"));
        let e = err(r#"{"architectures": ["LlamaForCausalLM"]}"#);
        assert!(e.contains("unknown architecture `LlamaForCausalLM`"), "{e}");
        let e = err(&MIXTRAL_V4.replace(r#""hidden_size": 4096,"#, ""));
        assert!(e.contains("hidden_size"), "{e}");
        let e =
            err(&MIXTRAL_V4.replace(r#""num_key_value_heads": 8"#, r#""num_key_value_heads": 5"#));
        assert!(e.contains("num_key_value_heads 5"), "{e}");
        let e =
            err(&MIXTRAL_V4.replace(r#""num_experts_per_tok": 2"#, r#""num_experts_per_tok": 9"#));
        assert!(e.contains("num_experts_per_tok 9"), "{e}");
        let e = err(&MIXTRAL_V4.replace(
            r#""rope_theta": 1000000.0"#,
            r#""rope_scaling": {"rope_type": "llama3", "factor": 8.0}"#,
        ));
        assert!(e.contains("llama3"), "{e}");
        let e = err(&MIXTRAL_V4.replace("bfloat16", "int4"));
        assert!(e.contains("int4"), "{e}");
        assert!(err("{}").contains("architectures"));
    }

    #[test]
    fn deepseek_defaults_and_yarn() {
        let c = match parse(
            r#"{"architectures": ["DeepseekV3ForCausalLM"], "max_position_embeddings": 163840,
                "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
                "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}"#,
        )
        .unwrap()
        {
            ModelConfig::DeepseekV3(c) => c,
            other => panic!("{other:?}"),
        };
        assert_eq!(c.n_routed_experts, 256);
        assert_eq!(c.q_lora_rank, Some(1536));
        assert!(!c.is_moe_layer(2) && c.is_moe_layer(3));
        let rope = c.rope().unwrap();
        assert_eq!(rope.theta, 10000.0);
        assert!(matches!(
            rope.scaling,
            RopeScaling::Yarn { factor, original_max_position_embeddings: 4096, .. } if factor == 40.0
        ));
        assert!(matches!(
            c.quantization().unwrap(),
            QuantizationConfig::Fp8Block { .. }
        ));
    }
}
