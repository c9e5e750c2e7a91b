//! Rotary position embeddings. Two independent choices, both data:
//!
//! - the frequency schedule ([`RopeScaling`]): `Default` (`θ^(-2i/d)`) or `Yarn` (DeepSeek-V3:
//!   interpolated and extrapolated frequencies blended by a linear ramp between the correction
//!   dims of `beta_fast`/`beta_slow`; cos/sin × `attention_factor`), as transformers'
//!   `_compute_yarn_parameters` computes them;
//! - how pairs are formed ([`RopeStyle`]): `HalfSplit` rotates `(x[i], x[i + d/2])` (Mixtral,
//!   Llama: `rotate_half`); `Interleaved` rotates `(x[2i], x[2i+1])` (DeepSeek-V3's
//!   `rope_interleave`). transformers implements the interleaved form by permuting q and k to
//!   half-split order first; q·k is the same either way, which is all attention reads.
//!
//! Per forward pass, [`Rotary::table`] computes cos/sin once for the batch's positions; every
//! layer and head then applies it ([`Rotary::apply`]).

use crate::config::{RopeConfig, RopeScaling};

/// Which elements of a head form a rotation pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// `(x[i], x[i + d/2])`.
    HalfSplit,
    /// `(x[2i], x[2i + 1])`.
    Interleaved,
}

/// Inverse frequencies of one rotary dimension, and how to apply them.
#[derive(Clone, Debug)]
pub struct Rotary {
    inv_freq: Vec<f32>,
    attention_factor: f32,
    style: RopeStyle,
}

/// cos/sin for each token of a batch: `[tokens, rotary_dim / 2]` each.
#[derive(Clone, Debug)]
pub struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl RopeTable {
    /// cos `[tokens, rotary_dim / 2]` (× the attention factor), row-major.
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }
    /// sin, as [`Self::cos`].
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }
    /// `rotary_dim / 2`.
    pub fn half(&self) -> usize {
        self.half
    }
}

impl Rotary {
    /// The schedule of `cfg` for `rotary_dim` (even) dimensions.
    pub fn new(cfg: &RopeConfig, rotary_dim: usize, style: RopeStyle) -> Rotary {
        let (inv_freq, attention_factor) = match &cfg.scaling {
            RopeScaling::Default => (default_inv_freq(cfg.theta, rotary_dim), 1.0),
            RopeScaling::Yarn { .. } => yarn(cfg, rotary_dim),
        };
        Rotary {
            inv_freq,
            attention_factor: attention_factor as f32,
            style,
        }
    }

    pub fn rotary_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The factor cos and sin are multiplied by (1 unless YaRN says otherwise).
    pub fn attention_factor(&self) -> f32 {
        self.attention_factor
    }

    /// cos/sin for every position in `positions` (f32 products, as transformers computes them).
    pub fn table(&self, positions: &[usize]) -> RopeTable {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos() * self.attention_factor);
                sin.push(a.sin() * self.attention_factor);
            }
        }
        RopeTable { cos, sin, half }
    }

    /// Rotates the first `rotary_dim` elements of `head` (one head's vector of token `t` of the
    /// table) in place.
    pub fn apply(&self, table: &RopeTable, t: usize, head: &mut [f32]) {
        let h = table.half;
        let cos = &table.cos[t * h..(t + 1) * h];
        let sin = &table.sin[t * h..(t + 1) * h];
        match self.style {
            RopeStyle::HalfSplit => {
                let (a, b) = head[..2 * h].split_at_mut(h);
                for i in 0..h {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
            RopeStyle::Interleaved => {
                for i in 0..h {
                    let (x1, x2) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = x1 * cos[i] - x2 * sin[i];
                    head[2 * i + 1] = x2 * cos[i] + x1 * sin[i];
                }
            }
        }
    }
}

fn default_inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| (1.0 / theta.powf((2 * i) as f64 / dim as f64)) as f32)
        .collect()
}

/// YaRN's `get_mscale`.
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// YaRN's attention factor (cos and sin are scaled by it): `attention_factor` if given, else
/// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are non-zero, else
/// `mscale(factor, 1)`.
pub(crate) fn yarn_attention_factor(
    factor: f64,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
    attention_factor: Option<f64>,
) -> f64 {
    attention_factor.unwrap_or(match (mscale, mscale_all_dim) {
        (Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
            yarn_mscale(factor, m) / yarn_mscale(factor, ma)
        }
        _ => yarn_mscale(factor, 1.0),
    })
}

/// transformers' `_compute_yarn_parameters`: (inv_freq, attention_factor).
fn yarn(cfg: &RopeConfig, dim: usize) -> (Vec<f32>, f64) {
    let RopeScaling::Yarn {
        factor,
        original_max_position_embeddings,
        beta_fast,
        beta_slow,
        mscale,
        mscale_all_dim,
        attention_factor,
        truncate,
    } = cfg.scaling.clone()
    else {
        return (default_inv_freq(cfg.theta, dim), 1.0);
    };
    let base = cfg.theta;
    let attention_factor = yarn_attention_factor(factor, mscale, mscale_all_dim, attention_factor);
    let orig = original_max_position_embeddings as f64;
    let correction_dim = |rot: f64| {
        dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let high = high.min(dim as f64 - 1.0);
    let high = if low == high { high + 0.001 } else { high };
    let inv_freq = (0..dim / 2)
        .map(|i| {
            let pos_freq = base.powf((2 * i) as f64 / dim as f64);
            let extrapolation = 1.0 / pos_freq;
            let interpolation = 1.0 / (factor * pos_freq);
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            (interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor)
                as f32
        })
        .collect();
    (inv_freq, attention_factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(scaling: RopeScaling) -> RopeConfig {
        RopeConfig {
            theta: 10000.0,
            scaling,
        }
    }

    #[test]
    fn half_split_rotates_pairs_half_apart_and_keeps_norms() {
        let r = Rotary::new(&rope(RopeScaling::Default), 4, RopeStyle::HalfSplit);
        assert_eq!(r.inv_freq(), &[1.0, 0.01]);
        let t = r.table(&[0, 1]);
        let mut x = [1.0, 0.0, 0.0, 0.0];
        r.apply(&t, 0, &mut x);
        assert_eq!(x, [1.0, 0.0, 0.0, 0.0]);
        r.apply(&t, 1, &mut x);
        // Pair (x0, x2) rotated by 1 rad.
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
        let mut y = [1.0, 0.0, 0.0, 0.0];
        let ri = Rotary::new(&rope(RopeScaling::Default), 4, RopeStyle::Interleaved);
        ri.apply(&t, 1, &mut y);
        // Pair (x0, x1) rotated by 1 rad.
        assert!((y[0] - 1f32.cos()).abs() < 1e-6 && (y[1] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn yarn_blends_between_extrapolation_and_interpolation() {
        let cfg = rope(RopeScaling::Yarn {
            factor: 40.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: Some(1.0),
            mscale_all_dim: Some(1.0),
            attention_factor: None,
            truncate: true,
        });
        let r = Rotary::new(&cfg, 64, RopeStyle::Interleaved);
        let d = default_inv_freq(10000.0, 64);
        // High frequencies are kept (extrapolation), low ones divided by the factor.
        assert_eq!(r.inv_freq()[0], d[0]);
        assert!((r.inv_freq()[31] - d[31] / 40.0).abs() < 1e-12);
        assert!(r.inv_freq().windows(2).all(|w| w[1] < w[0]));
        // mscale == mscale_all_dim → attention factor 1 (DeepSeek-V3).
        assert_eq!(r.attention_factor(), 1.0);
        assert!((yarn_mscale(40.0, 1.0) - (0.1 * 40f64.ln() + 1.0)).abs() < 1e-12);
    }
}
