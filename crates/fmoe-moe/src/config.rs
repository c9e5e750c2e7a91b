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

/// Where the fp8 per-tensor activation scales of a layer come from (vLLM's `activation_scheme`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum ActScales {
    /// Computed from each batch's amax (a1 before GEMM1, h before GEMM2).
    #[default]
    Dynamic,
    /// Fixed by a static checkpoint: `a13` scales the layer input for GEMM1 (the max over experts
    /// of the w1/w3 `input_scale`s), `a2` the SiLU⊙mul intermediate for GEMM2 (the max of the w2
    /// `input_scale`s). Values beyond 448 · scale saturate to ±448.
    Static { a13: f32, a2: f32 },
}

impl ActScales {
    /// The static scales of per-expert `input_scale`s (w1/w3 ones in `a13`, w2 ones in `a2`):
    /// their maxima, as vLLM's fp8 MoE takes them (one scale per GEMM serves every expert). Where
    /// experts' scales differ the max is a requantization choice, logged once per process. Scales
    /// must be finite and positive.
    pub fn from_expert_input_scales(a13: &[f32], a2: &[f32]) -> Result<ActScales> {
        let max = |name: &str, s: &[f32]| -> Result<f32> {
            if let Some((i, v)) = s
                .iter()
                .enumerate()
                .find(|(_, v)| !(v.is_finite() && **v > 0.0))
            {
                return Err(Error::Config(format!(
                    "{name} input_scale #{i} is {v}; static activation scales must be finite and positive"
                )));
            }
            s.iter()
                .copied()
                .reduce(f32::max)
                .ok_or_else(|| Error::Config(format!("no {name} input_scale given")))
        };
        let (m13, m2) = (max("w1/w3", a13)?, max("w2", a2)?);
        let differ = |s: &[f32], m: f32| s.iter().any(|&v| v != m);
        if differ(a13, m13) || differ(a2, m2) {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                let min = |s: &[f32]| s.iter().copied().fold(f32::INFINITY, f32::min);
                tracing::info!(
                    a13_min = min(a13),
                    a13_max = m13,
                    a2_min = min(a2),
                    a2_max = m2,
                    "experts' static input_scales differ: each GEMM uses their max (activations of \
                     experts with a smaller scale are quantized more coarsely than calibrated)"
                );
            });
        }
        Ok(ActScales::Static { a13: m13, a2: m2 })
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
