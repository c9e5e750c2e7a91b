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

/// The kernel's `uniform_at` before scaling: a value in [-1, 1) from (seed, i), exact in f32.
pub(super) fn uniform(seed: u64, i: u64) -> f32 {
    let mut z = seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// `offset + scale·uniform(seed, i)` for i < n, converted to `dtype` (in parallel: a dummy expert
/// stack is billions of values, and the software f32 → e4m3 conversion is slow serially).
pub(super) fn rand_uniform(
    n: usize,
    dtype: fmoe_core::DType,
    [scale, offset]: [f32; 2],
    seed: u64,
) -> fmoe_core::CpuStorage {
    use fmoe_core::{DType, F8E4M3, WithDType, bf16, f16};
    fn fill<T: WithDType + Send>(n: usize, f: impl Fn(u64) -> f32 + Sync) -> fmoe_core::CpuStorage {
        T::into_storage(
            (0..n as u64)
                .into_par_iter()
                .map(|i| T::from_f32(f(i)))
                .collect(),
        )
    }
    let value = |i: u64| offset + scale * uniform(seed, i);
    match dtype {
        DType::BF16 => fill::<bf16>(n, value),
        DType::F16 => fill::<f16>(n, value),
        DType::F8E4M3 => fill::<F8E4M3>(n, value),
        DType::U32 => fill::<u32>(n, value),
        DType::F32 => fill::<f32>(n, value),
    }
}
