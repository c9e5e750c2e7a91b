use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// How router logits become top-k experts and weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    /// Mixtral: softmax → top-k → renormalize (if set).
    Softmax { renormalize: bool },
    /// DeepSeek-V3 "noaux_tc": sigmoid, bias for selection, grouped top-k, scaling.
    GroupedSigmoid {
        n_group: usize,
        topk_group: usize,
        renormalize: bool,
        routed_scaling_factor: f32,
    },
}

/// Shape of one MoE layer. `hidden` is K (model width), `intermediate` is N (per expert).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub routing: Routing,
    /// Width of the always-on shared expert (DeepSeek-V3), if any.
    pub shared_intermediate: Option<usize>,
}

impl MoeConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.num_experts == 0 || self.hidden == 0 || self.intermediate == 0 {
            return bad(format!(
                "num_experts ({}), hidden ({}) and intermediate ({}) must be positive",
                self.num_experts, self.hidden, self.intermediate
            ));
        }
        if self.top_k == 0 || self.top_k > self.num_experts {
            return bad(format!(
                "top_k {} is not in 1..={} (num_experts)",
                self.top_k, self.num_experts
            ));
        }
        if let Routing::GroupedSigmoid {
            n_group,
            topk_group,
            ..
        } = self.routing
        {
            if n_group == 0 || !self.num_experts.is_multiple_of(n_group) {
                return bad(format!(
                    "n_group {n_group} must divide num_experts {}",
                    self.num_experts
                ));
            }
            if topk_group == 0 || topk_group > n_group {
                return bad(format!(
                    "topk_group {topk_group} is not in 1..={n_group} (n_group)"
                ));
            }
            if self.top_k > topk_group * (self.num_experts / n_group) {
                return bad(format!(
                    "top_k {} exceeds the {} experts in the {topk_group} kept groups",
                    self.top_k,
                    topk_group * (self.num_experts / n_group)
                ));
            }
        }
        if self.shared_intermediate == Some(0) {
            return bad("shared_intermediate must be positive when present".into());
        }
        Ok(())
    }
}

/// How the expert weights are stored; each value is one MoE method configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantScheme {
    /// bf16/f16/f32 weights, activations unquantized.
    Unquantized,
    /// e4m3 weights with one scale per expert and matrix; dynamic per-tensor activation scales.
    Fp8PerTensor,
    /// e4m3 weights in 128×128 blocks; dynamic 1×128 per-token-group activation scales.
    Fp8Block,
}

impl QuantScheme {
    pub const ALL: [QuantScheme; 3] = [
        QuantScheme::Unquantized,
        QuantScheme::Fp8PerTensor,
        QuantScheme::Fp8Block,
    ];

    /// The name used by the CLI and benchmark rows.
    pub fn as_str(self) -> &'static str {
        match self {
            QuantScheme::Unquantized => "unquantized",
            QuantScheme::Fp8PerTensor => "fp8-tensor",
            QuantScheme::Fp8Block => "fp8-block",
        }
    }
}

impl fmt::Display for QuantScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for QuantScheme {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        QuantScheme::ALL
            .into_iter()
            .find(|q| q.as_str() == s)
            .ok_or_else(|| {
                format!("unknown MoE method `{s}` (expected unquantized, fp8-tensor or fp8-block)")
            })
    }
}
