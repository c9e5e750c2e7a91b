//! Rotary embedding parameters: `rope_scaling` (4.x) or `rope_parameters` (5.x) as written, and
//! the resolved [`RopeConfig`].

use serde::Deserialize;

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
        // Rotary runs in f32: θ must be a normal positive f32, and the largest angle, position ×
        // inverse frequency (at most max(1, 1/θ): θ^(-2i/d) for 2i < d), must be finite there,
        // or cos/sin become NaN (θ = 1e-300 is a positive f64 but 0 as an f32).
        let theta32 = theta as f32;
        if !(theta.is_finite() && theta > 0.0 && theta32.is_finite() && theta32.is_normal()) {
            return Err(format!(
                "rope_theta must be positive and finite as an f32 (the precision rotary runs in), got {theta}"
            ));
        }
        let max_angle = max_position_embeddings as f64 * (1.0 / theta).max(1.0);
        if !(max_angle as f32).is_finite() {
            return Err(format!(
                "rope_theta {theta}: rotary angles reach max_position_embeddings {max_position_embeddings} × 1/θ = {max_angle:e}, beyond f32"
            ));
        }
        let kind = p.and_then(|p| p.rope_type.as_deref().or(p.type_.as_deref()));
        let scaling = match kind {
            None | Some("default") => RopeScaling::Default,
            Some("yarn") => {
                let p = p.cloned().unwrap_or_default();
                let factor = p
                    .factor
                    .ok_or("rope type yarn needs `factor`".to_string())?;
                if !(factor.is_finite() && (factor as f32).is_finite() && factor >= 1.0) {
                    return Err(format!(
                        "yarn `factor` must be >= 1 and finite, got {factor}"
                    ));
                }
                // The correction dims divide by ln θ.
                if theta == 1.0 {
                    return Err("rope type yarn needs rope_theta != 1".into());
                }
                let (beta_fast, beta_slow) =
                    (p.beta_fast.unwrap_or(32.0), p.beta_slow.unwrap_or(1.0));
                for (name, v) in [("beta_fast", beta_fast), ("beta_slow", beta_slow)] {
                    // ln(original / (β · 2π)) needs β > 0.
                    if !(v.is_finite() && v > 0.0) {
                        return Err(format!("yarn `{name}` must be positive, got {v}"));
                    }
                }
                for (name, v) in [
                    ("mscale", p.mscale),
                    ("mscale_all_dim", p.mscale_all_dim),
                    ("attention_factor", p.attention_factor),
                ] {
                    if let Some(v) = v.filter(|v| !(v.is_finite() && (*v as f32).is_finite())) {
                        return Err(format!("yarn `{name}` must be finite, got {v}"));
                    }
                }
                let af = crate::layers::rotary::yarn_attention_factor(
                    factor,
                    p.mscale,
                    p.mscale_all_dim,
                    p.attention_factor,
                );
                if !((af as f32).is_finite() && af > 0.0) {
                    return Err(format!(
                        "yarn's attention factor (from factor, mscale, mscale_all_dim, attention_factor) must be positive and finite as an f32, got {af}"
                    ));
                }
                let original = p
                    .original_max_position_embeddings
                    .unwrap_or(max_position_embeddings);
                if original == 0 {
                    return Err("yarn `original_max_position_embeddings` must be positive".into());
                }
                // The correction dims are d · ln(original / (β · 2π)) / (2 ln θ): the logarithm
                // must be finite, or the ramp between them is NaN.
                for (name, beta) in [("beta_fast", beta_fast), ("beta_slow", beta_slow)] {
                    let l = (original as f64 / (beta * 2.0 * std::f64::consts::PI)).ln();
                    if !l.is_finite() {
                        return Err(format!(
                            "yarn `{name}` {beta} with original_max_position_embeddings {original}: \
                             its correction dimension is not finite"
                        ));
                    }
                }
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast,
                    beta_slow,
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
