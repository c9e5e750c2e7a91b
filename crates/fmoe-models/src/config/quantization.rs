//! `quantization_config`, typed: none, fp8 per-tensor, or fp8 128×128 blocks.

use serde_json::Value;

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

    /// Checkpoint tensors per linear layer: the weight, plus its scale when quantized (for the
    /// loading progress bar).
    pub fn tensors_per_linear(&self) -> usize {
        match self {
            QuantizationConfig::None => 1,
            _ => 2,
        }
    }
}
