//! The `FMOE_*` switches. Each variable is parsed on its own, with its own default; no variable's
//! meaning depends on another here. What a combination means (which kernel a layer runs) is decided
//! by the MoE layer, where kernels are chosen.
//!
//! | variable | default | meaning on its own |
//! |---|---|---|
//! | `FMOE_USE_FUSED` | off | parent switch: use fmoe's fused kernel library |
//! | `FMOE_USE_FUSED_MOE` | on | fused MoE kernels (bf16/fp16 and per-tensor fp8) |
//! | `FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE` | off | the block-scaled fp8 fused MoE kernel |
//!
//! Accepted values: `0`, `1`, `true`, `false`, in any case. Anything else (the empty string
//! included) is an [`Error::InvalidEnv`] naming the variable.
//!
//! The `FMOE_DEV_*` developer overrides are parsed beside them, in [`DevOverrides`] (`env/dev.rs`).

use crate::{Error, Result};

mod dev;
pub use dev::*;

pub const FMOE_USE_FUSED: &str = "FMOE_USE_FUSED";
pub const FMOE_USE_FUSED_MOE: &str = "FMOE_USE_FUSED_MOE";
pub const FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE: &str = "FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE";

/// The raw values of the switches, each already defaulted. No cascade.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedSwitches {
    pub use_fused: bool,
    pub use_fused_moe: bool,
    pub use_fused_fp8_block_scaled_moe: bool,
}

impl Default for FusedSwitches {
    fn default() -> Self {
        FusedSwitches {
            use_fused: false,
            use_fused_moe: true,
            use_fused_fp8_block_scaled_moe: false,
        }
    }
}

impl FusedSwitches {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Reads through `lookup` (tests pass a map instead of touching the process environment).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let d = FusedSwitches::default();
        Ok(FusedSwitches {
            use_fused: parse_switch(
                FMOE_USE_FUSED,
                lookup(FMOE_USE_FUSED).as_deref(),
                d.use_fused,
            )?,
            use_fused_moe: parse_switch(
                FMOE_USE_FUSED_MOE,
                lookup(FMOE_USE_FUSED_MOE).as_deref(),
                d.use_fused_moe,
            )?,
            use_fused_fp8_block_scaled_moe: parse_switch(
                FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE,
                lookup(FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE).as_deref(),
                d.use_fused_fp8_block_scaled_moe,
            )?,
        })
    }
}

/// Parses one boolean switch; `None` (unset) gives `default`.
pub fn parse_switch(var: &'static str, value: Option<&str>, default: bool) -> Result<bool> {
    let Some(value) = value else {
        return Ok(default);
    };
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        _ => Err(Error::InvalidEnv {
            var,
            value: value.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn switches(pairs: &[(&str, &str)]) -> Result<FusedSwitches> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        FusedSwitches::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_when_unset() {
        assert_eq!(switches(&[]).unwrap(), FusedSwitches::default());
        let d = FusedSwitches::default();
        assert!(!d.use_fused && d.use_fused_moe && !d.use_fused_fp8_block_scaled_moe);
    }

    #[test]
    fn accepts_the_four_spellings_in_any_case() {
        for (v, want) in [
            ("1", true),
            ("0", false),
            ("true", true),
            ("FALSE", false),
            ("True", true),
        ] {
            assert_eq!(
                parse_switch(FMOE_USE_FUSED, Some(v), !want).unwrap(),
                want,
                "{v}"
            );
        }
    }

    #[test]
    fn each_variable_is_parsed_alone() {
        // The parent being off does not change what the children read as.
        let s = switches(&[
            (FMOE_USE_FUSED, "0"),
            (FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE, "1"),
        ])
        .unwrap();
        assert!(!s.use_fused && s.use_fused_moe && s.use_fused_fp8_block_scaled_moe);
    }

    #[test]
    fn bad_values_name_the_variable() {
        for bad in ["yes", "2", "", " 1", "on"] {
            for var in [
                FMOE_USE_FUSED,
                FMOE_USE_FUSED_MOE,
                FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE,
            ] {
                let err = switches(&[(var, bad)]).unwrap_err().to_string();
                assert!(err.contains(var), "{err}");
                assert!(err.contains(&format!("{bad:?}")), "{err}");
            }
        }
    }
}
