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
