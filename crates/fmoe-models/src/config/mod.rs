//! `config.json` as Hugging Face writes it, for the architectures fmoe serves.
//!
//! The serde structs mirror the file's field names. Both layouts transformers writes are accepted:
//! 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters: {rope_theta,
//! rope_type, ...}`, `dtype`). The typed accessors ([`MixtralConfig::rope`],
//! [`MixtralConfig::quantization`], ...) resolve the two layouts into one value, so models never
//! look at raw JSON.
//!
//! Files: this one has [`ModelConfig`] (the architecture dispatch) and the pieces both
//! architectures share; `mixtral.rs` and `deepseek_v3.rs` the per-architecture structs and their
//! validation; `rope.rs` the rotary parameters; `quantization.rs` `quantization_config`.

mod deepseek_v3;
mod mixtral;
mod quantization;
mod rope;

use std::path::{Path, PathBuf};

use fmoe_core::DType;
use serde::Deserialize;
use serde_json::Value;

use crate::{Error, Result};

pub use deepseek_v3::DeepseekV3Config;
pub use mixtral::MixtralConfig;
pub use quantization::{ActivationScheme, QuantizationConfig};
pub use rope::{RopeConfig, RopeParametersJson, RopeScaling};

/// The largest `config.json` read (real ones are a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// A parsed `config.json`: one variant per supported architecture.
#[derive(Clone, Debug)]
pub enum ModelConfig {
    Mixtral(MixtralConfig),
    DeepseekV3(DeepseekV3Config),
}

impl ModelConfig {
    /// Reads and parses `path` (a `config.json`: a regular file of at most
    /// [`MAX_CONFIG_BYTES`]).
    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text = crate::loader::read_regular_file(path, "config.json", MAX_CONFIG_BYTES)?;
        let text = String::from_utf8(text)
            .map_err(|e| Error::config(path, format!("not UTF-8 text: {e}")))?;
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

    /// The weights' element counts (see [`WeightCounts`]).
    pub fn weight_counts(&self) -> fmoe_core::Result<WeightCounts> {
        match self {
            ModelConfig::Mixtral(c) => c.weight_counts(),
            ModelConfig::DeepseekV3(c) => c.weight_counts(),
        }
    }

    /// A lower bound of the bytes the model's weights take once loaded: every weight in the
    /// checkpoint's dtype (bf16 unless `dtype` says otherwise), the experts of an fp8
    /// checkpoint at one byte. What a memory budget compares with before loading.
    pub fn weight_bytes(&self) -> fmoe_core::Result<usize> {
        let (dtype, quant) = match self {
            ModelConfig::Mixtral(c) => (c.dtype(), c.quantization()),
            ModelConfig::DeepseekV3(c) => (c.dtype(), c.quantization()),
        };
        let dense = dtype.ok().flatten().unwrap_or(DType::BF16).size_in_bytes();
        let expert = match quant {
            Ok(QuantizationConfig::None) | Err(_) => dense,
            Ok(_) => 1,
        };
        let c = self.weight_counts()?;
        fmoe_core::checked_sum(
            "weight bytes",
            &[
                (
                    "dense",
                    fmoe_core::checked_bytes("dense weights", c.dense, dense)?,
                ),
                (
                    "experts",
                    fmoe_core::checked_bytes("expert weights", c.experts, expert)?,
                ),
            ],
        )
    }

    /// The number of decoder layers.
    pub fn num_hidden_layers(&self) -> usize {
        match self {
            ModelConfig::Mixtral(c) => c.num_hidden_layers,
            ModelConfig::DeepseekV3(c) => c.num_hidden_layers,
        }
    }

    /// This config with `n` decoder layers (what `--num-layers` loads); the sizes that depend on
    /// the layer count are checked again.
    pub fn with_num_hidden_layers(mut self, n: usize) -> fmoe_core::Result<ModelConfig> {
        match &mut self {
            ModelConfig::Mixtral(c) => c.num_hidden_layers = n,
            ModelConfig::DeepseekV3(c) => c.num_hidden_layers = n,
        }
        check_model_sizes(
            self.weight_counts(),
            self.kv_elems_per_token(),
            self.max_position_embeddings(),
        )?;
        Ok(self)
    }

    /// KV-cache elements one token takes across all layers (see the architectures' own).
    pub fn kv_elems_per_token(&self) -> fmoe_core::Result<usize> {
        match self {
            ModelConfig::Mixtral(c) => c.kv_elems_per_token(),
            ModelConfig::DeepseekV3(c) => c.kv_elems_per_token(),
        }
    }

    pub fn max_position_embeddings(&self) -> usize {
        match self {
            ModelConfig::Mixtral(c) => c.max_position_embeddings,
            ModelConfig::DeepseekV3(c) => c.max_position_embeddings,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Mixtral(c) => c.vocab_size,
            ModelConfig::DeepseekV3(c) => c.vocab_size,
        }
    }

    pub fn hidden_size(&self) -> usize {
        match self {
            ModelConfig::Mixtral(c) => c.hidden_size,
            ModelConfig::DeepseekV3(c) => c.hidden_size,
        }
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

/// A float field the model uses as f32: it must be finite and positive *as an f32* (1e300 is a
/// finite f64 but an infinite f32; 1e-300 rounds to 0).
fn positive_f32(name: &str, value: f64) -> std::result::Result<f32, String> {
    let v = value as f32;
    if !(value.is_finite() && v.is_finite() && v > 0.0) {
        return Err(format!(
            "{name} must be positive and finite as an f32 (the precision it is used in), got {value}"
        ));
    }
    Ok(v)
}

/// Token ids are u32: the vocabulary must fit them, and every `bos_token_id` / `eos_token_id` must
/// name one of its tokens.
fn check_token_ids(
    vocab_size: usize,
    bos: Option<u32>,
    eos: &[u32],
) -> std::result::Result<(), String> {
    if vocab_size > u32::MAX as usize {
        return Err(format!(
            "vocab_size {vocab_size} exceeds the range of u32 token ids"
        ));
    }
    let in_vocab = |id: u32| (id as usize) < vocab_size;
    if let Some(id) = bos.filter(|&id| !in_vocab(id)) {
        return Err(format!(
            "bos_token_id {id} is outside the vocabulary (vocab_size {vocab_size})"
        ));
    }
    if let Some(id) = eos.iter().copied().find(|&id| !in_vocab(id)) {
        return Err(format!(
            "eos_token_id {id} is outside the vocabulary (vocab_size {vocab_size})"
        ));
    }
    Ok(())
}

/// The weights a config describes, counted in elements (checked: every product and sum is an
/// [`fmoe_core::Error::SizeOverflow`] naming the fields when it does not fit `usize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightCounts {
    /// Everything but the routed and shared experts: embeddings, attention, norms, router gates,
    /// dense MLPs, lm_head.
    pub dense: usize,
    /// The MoE experts (routed and shared), which fp8 checkpoints store as e4m3.
    pub experts: usize,
}

impl WeightCounts {
    pub fn total(&self) -> fmoe_core::Result<usize> {
        fmoe_core::checked_sum(
            "weight elements",
            &[("dense", self.dense), ("experts", self.experts)],
        )
    }
}

/// Checks that every size a model derives from its config fits: the weights (as f32, the
/// widest form a layer holds), and the KV cache of a full context (f32 rows).
fn check_model_sizes(
    counts: fmoe_core::Result<WeightCounts>,
    kv_elems_per_token: fmoe_core::Result<usize>,
    max_position_embeddings: usize,
) -> fmoe_core::Result<()> {
    let total = counts?.total()?;
    fmoe_core::checked_bytes("weights as f32", total, 4)?;
    let kv = fmoe_core::checked_product(
        "KV cache of a full context as f32",
        &[
            ("elements per token", kv_elems_per_token?),
            ("max_position_embeddings", max_position_embeddings),
        ],
    )?;
    fmoe_core::checked_bytes("KV cache of a full context as f32", kv, 4)?;
    Ok(())
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

fn default_silu() -> String {
    "silu".into()
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
