//! What the kernel GPU tests share: seeded normal data and the relative error they compare with.

#![allow(dead_code)] // each test binary uses its own subset

use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// `n` standard-normal samples times `scale`.
pub fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| StandardNormal.sample(rng))
        .map(|v: f32| v * scale)
        .collect()
}

/// Relative 2-norm error of `got` against `want`.
pub fn rel(got: &[f32], want: &[f32]) -> f64 {
    let (mut d, mut w) = (0.0f64, 0.0f64);
    for (g, x) in got.iter().zip(want) {
        d += (f64::from(*g) - f64::from(*x)).powi(2);
        w += f64::from(*x).powi(2);
    }
    (d / w.max(1e-300)).sqrt()
}

/// Whether the sm_90a-only kernels can run: a CUDA device of compute capability 9.0. Otherwise
/// prints "skipping: <what> runs on sm_90 only" (or the missing device's reason, which fails under
/// `FMOE_REQUIRE_CUDA=1`) and returns false.
pub fn hopper_or_skip(what: &str) -> bool {
    let Some(b) = fmoe_core::cuda::test_backend_or_skip() else {
        return false;
    };
    if b.compute_capability() != (9, 0) {
        println!("skipping: {what} runs on sm_90 only");
        return false;
    }
    true
}
