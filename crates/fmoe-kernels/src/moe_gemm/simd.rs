//! Dot-product micro-kernels. Written as plain lane arrays so LLVM vectorizes them; on x86-64 an
//! AVX2 copy is chosen at run time (the default target only guarantees SSE2).

const LANES: usize = 8;

/// d[i][j] = Σ a_i[c] · w_j[c]; all slices have the length of `a0`.
pub fn dot_2x4(a0: &[f32], a1: &[f32], w: [&[f32]; 4]) -> [[f32; 4]; 2] {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { dot_2x4_avx2(a0, a1, w) };
    }
    dot_2x4_generic(a0, a1, w)
}

/// Σ a[c] · b[c].
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { dot_avx2(a, b) };
    }
    dot_generic(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dot_2x4_avx2(a0: &[f32], a1: &[f32], w: [&[f32]; 4]) -> [[f32; 4]; 2] {
    dot_2x4_generic(a0, a1, w)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_generic(a, b)
}

#[inline(always)]
fn dot_2x4_generic(a0: &[f32], a1: &[f32], w: [&[f32]; 4]) -> [[f32; 4]; 2] {
    let n = a0.len();
    let (a1, w) = (&a1[..n], w.map(|r| &r[..n]));
    let (x0, x0r) = a0.as_chunks::<LANES>();
    let (x1, _) = a1.as_chunks::<LANES>();
    let (y0, _) = w[0].as_chunks::<LANES>();
    let (y1, _) = w[1].as_chunks::<LANES>();
    let (y2, _) = w[2].as_chunks::<LANES>();
    let (y3, _) = w[3].as_chunks::<LANES>();
    let mut acc = [[[0f32; LANES]; 4]; 2];
    for c in 0..x0.len() {
        let (p, q) = (&x0[c], &x1[c]);
        let ys = [&y0[c], &y1[c], &y2[c], &y3[c]];
        for (j, y) in ys.iter().enumerate() {
            for l in 0..LANES {
                acc[0][j][l] += p[l] * y[l];
                acc[1][j][l] += q[l] * y[l];
            }
        }
    }
    let mut d = [[0f32; 4]; 2];
    for i in 0..2 {
        for j in 0..4 {
            d[i][j] = acc[i][j].iter().sum();
        }
    }
    let tail = n - x0r.len();
    for c in tail..n {
        for j in 0..4 {
            d[0][j] += a0[c] * w[j][c];
            d[1][j] += a1[c] * w[j][c];
        }
    }
    d
}

#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    let b = &b[..a.len()];
    let (xa, ra) = a.as_chunks::<LANES>();
    let (xb, rb) = b.as_chunks::<LANES>();
    let mut acc = [0f32; LANES];
    for (p, q) in xa.iter().zip(xb) {
        for l in 0..LANES {
            acc[l] += p[l] * q[l];
        }
    }
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(p, q)| p * q).sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_kernels_match_a_scalar_loop() {
        for n in [0usize, 1, 7, 8, 9, 128, 131] {
            let v = |s: usize| {
                (0..n)
                    .map(|c| ((c * 7 + s * 13) % 11) as f32 - 5.0)
                    .collect::<Vec<f32>>()
            };
            let (a0, a1, w) = (v(0), v(1), [v(2), v(3), v(4), v(5)]);
            let d = dot_2x4(&a0, &a1, [&w[0], &w[1], &w[2], &w[3]]);
            for j in 0..4 {
                // Small integers: every partial sum is exact in f32, so equality must hold.
                let s0: f32 = a0.iter().zip(&w[j]).map(|(x, y)| x * y).sum();
                let s1: f32 = a1.iter().zip(&w[j]).map(|(x, y)| x * y).sum();
                assert_eq!(d[0][j], s0);
                assert_eq!(d[1][j], s1);
                assert_eq!(dot(&a0, &w[j]), s0);
            }
        }
    }
}
