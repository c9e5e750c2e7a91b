//! CPU twin: [`attend_head`] per (sequence, head), in parallel over the pairs.
//!
//! `attend_head` and its dot product are fmoe-models' CPU attention moved here verbatim (same
//! operations in the same order), so the models' CPU logits do not change when they call it.

use rayon::prelude::*;

use super::{KvPaging, SeqSpan};

/// One head's attention geometry for [`attend_head`].
#[derive(Clone, Copy, Debug)]
pub struct HeadGeometry {
    /// q·k width.
    pub qk_dim: usize,
    pub v_dim: usize,
    /// Row stride of `k` and `v` (all kv heads of a token), and this head's offset within it.
    pub k_stride: usize,
    pub k_offset: usize,
    pub v_stride: usize,
    pub v_offset: usize,
    pub scale: f32,
    pub sliding_window: Option<usize>,
}

/// `softmax(q·kᵀ·scale + causal mask)·v` for one head: `q` is `[n, qk_dim]` (dense rows) for
/// positions `past..past + n`; `k`/`v` hold rows for positions `0..past + n`. Returns `[n, v_dim]`.
pub fn attend_head(q: &[f32], k: &[f32], v: &[f32], past: usize, g: &HeadGeometry) -> Vec<f32> {
    attend_rows(q, k, v, past, g, |j| j)
}

/// [`attend_head`] with position `j`'s key and value in row `row(j)` of `k` and `v` (paged K/V
/// reads through the block table): the same operations in the same order, so the same rows give
/// the same bits wherever they lie.
fn attend_rows(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    past: usize,
    g: &HeadGeometry,
    row: impl Fn(usize) -> usize,
) -> Vec<f32> {
    let n = q.len() / g.qk_dim;
    let mut out = vec![0f32; n * g.v_dim];
    let mut scores = Vec::new();
    for i in 0..n {
        let pos = past + i;
        let first = match g.sliding_window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        let qi = &q[i * g.qk_dim..(i + 1) * g.qk_dim];
        scores.clear();
        scores.extend((first..=pos).map(|j| {
            let kj = &k[row(j) * g.k_stride + g.k_offset..][..g.qk_dim];
            dot(qi, kj) * g.scale
        }));
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let o = &mut out[i * g.v_dim..(i + 1) * g.v_dim];
        for (s, j) in scores.iter().zip(first..=pos) {
            let p = s / sum;
            let vj = &v[row(j) * g.v_stride + g.v_offset..][..g.v_dim];
            for (a, b) in o.iter_mut().zip(vj) {
                *a += p * b;
            }
        }
    }
    out
}

/// `[T, heads·v_dim]` f32: every span's heads through [`attend_head`] (its k/v rows found
/// through `paging`'s block tables when given), rows outside the spans 0. Shapes and spans were
/// validated by the caller.
pub(super) fn causal_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    rows: usize,
    spans: &[SeqSpan],
    p: &super::AttentionParams,
    paging: Option<&KvPaging>,
) -> Vec<f32> {
    let (h, dq, dv) = (p.num_heads, p.qk_dim, p.v_dim);
    let group = h / p.num_kv_heads;
    let (q_w, k_w, v_w, o_w) = (h * dq, p.num_kv_heads * dq, p.num_kv_heads * dv, h * dv);
    let work: Vec<(usize, usize)> = (0..spans.len())
        .filter(|&i| spans[i].q_len > 0)
        .flat_map(|i| (0..h).map(move |head| (i, head)))
        .collect();
    let heads: Vec<Vec<f32>> = work
        .par_iter()
        .map(|&(i, head)| {
            let sp = &spans[i];
            // This head's query rows, made dense.
            let qh: Vec<f32> = (sp.q_start..sp.q_start + sp.q_len)
                .flat_map(|r| q[r * q_w + head * dq..][..dq].iter().copied())
                .collect();
            let kvh = head / group;
            let g = HeadGeometry {
                qk_dim: dq,
                v_dim: dv,
                k_stride: k_w,
                k_offset: kvh * dq,
                v_stride: v_w,
                v_offset: kvh * dv,
                scale: p.scale,
                sliding_window: p.sliding_window,
            };
            match paging {
                None => {
                    let kv_rows = sp.past + sp.q_len;
                    let ks = &k[sp.kv_start * k_w..(sp.kv_start + kv_rows) * k_w];
                    let vs = &v[sp.kv_start * v_w..(sp.kv_start + kv_rows) * v_w];
                    attend_head(&qh, ks, vs, sp.past, &g)
                }
                Some(pg) => attend_rows(&qh, k, v, sp.past, &g, |j| pg.row(sp.kv_start, j)),
            }
        })
        .collect();
    let mut out = vec![0f32; rows * o_w];
    for (&(i, head), o) in work.iter().zip(&heads) {
        let sp = &spans[i];
        for (r, row) in o.chunks(dv).enumerate() {
            let at = (sp.q_start + r) * o_w + head * dv;
            out[at..at + dv].copy_from_slice(row);
        }
    }
    out
}

/// Dot product in f32 (AVX2/FMA when the CPU has them) over the first `min(a.len(), b.len())`
/// elements. fmoe-models' `dot` (its 1×1 tile), reproduced operation for operation.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { avx2::dot(a, b) };
    }
    dot_portable(a, b)
}

/// Eight independent accumulators (vectorizes; no FMA libcalls).
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// 8 lanes at a time with FMA; the `k % 8` tail in scalar (`k` the shorter length).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot(x: &[f32], w: &[f32]) -> f32 {
        let k = x.len().min(w.len());
        let k8 = k - k % 8;
        let mut acc = _mm256_setzero_ps();
        let mut p = 0;
        while p < k8 {
            // SAFETY: p + 8 <= k8 <= k, the length of the shorter row.
            let wv = unsafe { _mm256_loadu_ps(w.as_ptr().add(p)) };
            // SAFETY: as above.
            let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(p)) };
            acc = _mm256_fmadd_ps(xv, wv, acc);
            p += 8;
        }
        let hi = _mm256_extractf128_ps(acc, 1);
        let lo = _mm256_castps256_ps128(acc);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        let mut v = _mm_cvtss_f32(s);
        for q in k8..k {
            v += x[q] * w[q];
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_is_causal_and_windowed() {
        // One dim; keys all equal → uniform weights over the visible keys.
        let k = vec![1.0; 4];
        let v = vec![1.0, 2.0, 3.0, 4.0];
        let g = HeadGeometry {
            qk_dim: 1,
            v_dim: 1,
            k_stride: 1,
            k_offset: 0,
            v_stride: 1,
            v_offset: 0,
            scale: 1.0,
            sliding_window: None,
        };
        // Queries at positions 0..4 see 1, 2, 3, 4 keys.
        let out = attend_head(&[0.0; 4], &k, &v, 0, &g);
        assert_eq!(out, vec![1.0, 1.5, 2.0, 2.5]);
        // Decode at position 3 with a window of 2 sees positions 2 and 3.
        let w = HeadGeometry {
            sliding_window: Some(2),
            ..g
        };
        assert_eq!(attend_head(&[0.0], &k, &v, 3, &w), vec![3.5]);
    }

    #[test]
    fn dot_paths_agree_with_the_portable_order() {
        // Lengths around the 8-lane boundary; values exact in f32 products so both paths give
        // the same sum regardless of FMA.
        for n in [0, 1, 7, 8, 9, 16, 23, 64, 129] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.25).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 13) as f32 - 6.0) * 0.5).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert_eq!(dot(&a, &b), want, "n={n}");
            assert_eq!(dot_portable(&a, &b), want, "n={n}");
        }
    }

    #[test]
    fn dot_of_unequal_rows_stops_at_the_shorter() {
        // A row past the other's end is never read: both orders give the dot of the common part.
        let a: Vec<f32> = (0..40).map(|i| (i % 5) as f32 - 2.0).collect();
        let b: Vec<f32> = (0..19).map(|i| (i % 3) as f32 * 0.5).collect();
        let want = dot(&a[..19], &b);
        assert_eq!(dot(&a, &b), want);
        assert_eq!(dot(&b, &a), want);
        assert_eq!(want, a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>());
    }
}
