use rayon::prelude::*;

pub(super) fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

pub(super) fn sum(v: &[f32]) -> f32 {
    v.iter().map(|&x| f64::from(x)).sum::<f64>() as f32
}

/// splitmix64's finalizer (the kernel's `mix64`).
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The kernel's Box-Muller normal for flat index `i` (see `cuda/elementwise.cu`).
pub(super) fn normal(seed: u64, i: u64) -> f32 {
    const TWO_POW_M24: f32 = 1.0 / 16_777_216.0;
    let h = mix64(i ^ mix64(seed));
    let u1 = ((h >> 40) + 1) as f32 * TWO_POW_M24;
    let u2 = ((h >> 16) & 0xff_ffff) as f32 * TWO_POW_M24;
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

pub(super) fn randn(n: usize, scale: f32, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .into_par_iter()
        .map(|i| scale * normal(seed, i))
        .collect()
}

/// silu(gate) · up per row of `[gate (i) | up (i)]`, rounded once to `dtype`.
pub(super) fn silu_mul(x: &[f32], i: usize, dtype: fmoe_core::DType) -> Vec<f32> {
    use crate::moe_gemm::cpu::silu;
    use crate::norm::cpu::round_to;
    let mut y = Vec::with_capacity(x.len() / 2);
    if i == 0 {
        return y;
    }
    for row in x.chunks(2 * i) {
        let (g, u) = row.split_at(i);
        y.extend(g.iter().zip(u).map(|(&g, &u)| round_to(dtype, silu(g) * u)));
    }
    y
}
