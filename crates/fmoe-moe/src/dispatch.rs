//! Kernel selection: the one place where the `FMOE_*` switches combine.
//!
//! | FMOE_USE_FUSED | FMOE_USE_FUSED_MOE | FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE | unquantized | fp8-tensor | fp8-block |
//! |---|---|---|---|---|---|
//! | 0 (default) | any | any | portable | portable | portable |
//! | 1 | 1 (default) | 0 (default) | fused | fused | portable |
//! | 1 | 1 | 1 | fused | fused | fused |
//! | 1 | 0 | any | portable | portable | portable |
//!
//! The block-scaled kernel needs all three switches, as its seed (vLLM's AITER integration) did.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Mutex, OnceLock};

use fmoe_core::Device;
use fmoe_core::env::{
    FMOE_USE_FUSED, FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE, FMOE_USE_FUSED_MOE, FusedSwitches,
};

use crate::{QuantScheme, Result};

/// The two kernel families every device provides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelFamily {
    /// fmoe's fused library path.
    Fused,
    /// The unfused per-expert baseline.
    Portable,
}

impl KernelFamily {
    pub const ALL: [KernelFamily; 2] = [KernelFamily::Fused, KernelFamily::Portable];
    pub fn as_str(self) -> &'static str {
        match self {
            KernelFamily::Fused => "fused",
            KernelFamily::Portable => "portable",
        }
    }
}

impl fmt::Display for KernelFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A resolved choice and why it was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelChoice {
    pub family: KernelFamily,
    pub reason: String,
}

/// Combines the switches for one layer's scheme on one device.
pub fn resolve(
    switches: &FusedSwitches,
    scheme: QuantScheme,
    device: Device,
) -> Result<KernelChoice> {
    let _ = device; // both families exist on every supported device
    let (family, reason) = if !switches.use_fused {
        (KernelFamily::Portable, format!("{FMOE_USE_FUSED} is off"))
    } else if !switches.use_fused_moe {
        (KernelFamily::Portable, format!("{FMOE_USE_FUSED_MOE}=0"))
    } else {
        match scheme {
            QuantScheme::Unquantized | QuantScheme::Fp8PerTensor => (
                KernelFamily::Fused,
                format!("{FMOE_USE_FUSED}=1 and {FMOE_USE_FUSED_MOE} on"),
            ),
            QuantScheme::Fp8Block if switches.use_fused_fp8_block_scaled_moe => (
                KernelFamily::Fused,
                format!(
                    "{FMOE_USE_FUSED}=1, {FMOE_USE_FUSED_MOE} on and {FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE}=1"
                ),
            ),
            QuantScheme::Fp8Block => (
                KernelFamily::Portable,
                format!(
                    "{FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE} is off (block-scaled fp8 needs it even under {FMOE_USE_FUSED}=1)"
                ),
            ),
        }
    };
    Ok(KernelChoice { family, reason })
}

/// Logs a layer's choice at info level the first time each (scheme, device, family) is seen.
pub fn log_choice_once(scheme: QuantScheme, device: Device, choice: &KernelChoice) {
    static SEEN: OnceLock<Mutex<HashSet<(QuantScheme, Device, KernelFamily)>>> = OnceLock::new();
    let seen = SEEN.get_or_init(|| Mutex::new(HashSet::new()));
    let first = seen
        .lock()
        .map(|mut s| s.insert((scheme, device, choice.family)))
        .unwrap_or(true);
    if first {
        tracing::info!(method = %scheme, %device, kernel = %choice.family, reason = %choice.reason, "MoE kernel selected");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The truth table of the module docs, row by row, for every method.
    #[test]
    fn full_truth_table() {
        use KernelFamily::{Fused as F, Portable as P};
        // (use_fused, use_fused_moe, block) → (unquantized, fp8-tensor, fp8-block)
        let table = [
            ((false, false, false), [P, P, P]),
            ((false, false, true), [P, P, P]),
            ((false, true, false), [P, P, P]),
            ((false, true, true), [P, P, P]),
            ((true, false, false), [P, P, P]),
            ((true, false, true), [P, P, P]),
            ((true, true, false), [F, F, P]),
            ((true, true, true), [F, F, F]),
        ];
        for ((a, b, c), want) in table {
            let sw = FusedSwitches {
                use_fused: a,
                use_fused_moe: b,
                use_fused_fp8_block_scaled_moe: c,
            };
            for (scheme, want) in QuantScheme::ALL.into_iter().zip(want) {
                for device in [Device::Cpu, Device::Cuda(0)] {
                    let got = resolve(&sw, scheme, device).unwrap();
                    assert_eq!(got.family, want, "{sw:?} {scheme} {device}");
                    assert!(!got.reason.is_empty());
                }
            }
        }
    }

    #[test]
    fn defaults_are_portable_and_reasons_name_the_deciding_variable() {
        let d = FusedSwitches::default();
        for scheme in QuantScheme::ALL {
            let c = resolve(&d, scheme, Device::Cpu).unwrap();
            assert_eq!(c.family, KernelFamily::Portable);
            assert!(c.reason.contains(FMOE_USE_FUSED), "{}", c.reason);
        }
        let parent = FusedSwitches {
            use_fused: true,
            ..d
        };
        let c = resolve(&parent, QuantScheme::Fp8Block, Device::Cpu).unwrap();
        assert_eq!(c.family, KernelFamily::Portable);
        assert!(
            c.reason.contains(FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE),
            "{}",
            c.reason
        );
        let off = FusedSwitches {
            use_fused: true,
            use_fused_moe: false,
            use_fused_fp8_block_scaled_moe: true,
        };
        let c = resolve(&off, QuantScheme::Fp8Block, Device::Cpu).unwrap();
        assert!(c.reason.contains(FMOE_USE_FUSED_MOE), "{}", c.reason);
    }
}
