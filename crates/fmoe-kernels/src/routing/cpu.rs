//! CPU twin of the routing kernels: slice-level, one row (token) at a time.
//!
//! Callers (`super`) have validated shapes, parameters and finiteness; these functions only
//! `debug_assert!` their preconditions.

use fmoe_core::WithDType;
use rayon::prelude::*;

use super::GroupedTopKParams;

/// Below this many rows the rayon fork/join costs more than the rows themselves.
const PAR_MIN_ROWS: usize = 128;

/// Flat index and value (as f32) of the first NaN or ±Inf in `v`.
pub(crate) fn first_non_finite<T: WithDType>(v: &[T]) -> Option<(usize, f32)> {
    v.iter()
        .map(|x| x.to_f32())
        .enumerate()
        .find(|(_, x)| !x.is_finite())
}

/// The selection order: higher score first, then lower index. A strict total order on finite
/// scores (-0.0 and +0.0 compare equal, so they tie on the index like any equal pair).
#[inline]
fn ranks_before(a: (f32, u32), b: (f32, u32)) -> bool {
    a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
}

/// Keeps the `k` best (score, index) pairs seen so far, sorted by [`ranks_before`].
///
/// Insertion into a short sorted buffer: O(E) when most candidates lose to the k-th, O(E·k) at
/// worst; k ≤ 8 in practice, so it beats a full sort.
struct TopKBuf {
    k: usize,
    items: Vec<(f32, u32)>,
}

impl TopKBuf {
    fn new(k: usize) -> Self {
        TopKBuf {
            k,
            items: Vec::with_capacity(k + 1),
        }
    }

    fn clear(&mut self) {
        self.items.clear();
    }

    #[inline]
    fn push(&mut self, cand: (f32, u32)) {
        if self.items.len() == self.k {
            match self.items.last() {
                Some(&worst) if ranks_before(cand, worst) => {}
                _ => return,
            }
        }
        let pos = self
            .items
            .iter()
            .position(|&it| ranks_before(cand, it))
            .unwrap_or(self.items.len());
        self.items.insert(pos, cand);
        self.items.truncate(self.k);
    }
}

/// Logistic function without overflow: `exp` only ever sees a non-positive argument.
#[inline]
pub(crate) fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// Runs `row_fn(scratch, logits_row, weights_row, ids_row)` over all rows, in parallel when
/// there are enough of them. Each row is computed the same way on either path, so the result
/// does not depend on the thread count.
fn for_each_row<T, S, I, F>(
    logits: &[T],
    experts: usize,
    top_k: usize,
    weights: &mut [f32],
    ids: &mut [u32],
    init: I,
    row_fn: F,
) where
    T: WithDType,
    I: Fn() -> S + Sync + Send,
    F: Fn(&mut S, &[T], &mut [f32], &mut [u32]) + Sync + Send,
{
    debug_assert!(experts > 0 && top_k > 0);
    debug_assert_eq!(logits.len() / experts, weights.len() / top_k);
    debug_assert_eq!(weights.len(), ids.len());
    let rows = logits.len() / experts;
    if rows >= PAR_MIN_ROWS {
        weights
            .par_chunks_mut(top_k)
            .zip(ids.par_chunks_mut(top_k))
            .zip(logits.par_chunks(experts))
            .with_min_len(16)
            .for_each_init(init, |s, ((w, id), row)| row_fn(s, row, w, id));
    } else {
        let mut s = init();
        for ((w, id), row) in weights
            .chunks_mut(top_k)
            .zip(ids.chunks_mut(top_k))
            .zip(logits.chunks(experts))
        {
            row_fn(&mut s, row, w, id);
        }
    }
}

/// Mixtral routing. `logits` is [M, E] row-major, `weights`/`ids` are [M, k].
pub(crate) fn topk_softmax<T: WithDType>(
    logits: &[T],
    experts: usize,
    top_k: usize,
    renormalize: bool,
    weights: &mut [f32],
    ids: &mut [u32],
) {
    for_each_row(
        logits,
        experts,
        top_k,
        weights,
        ids,
        || (vec![0f32; experts], TopKBuf::new(top_k)),
        |(x, best), row, w, id| softmax_row(row, renormalize, x, best, w, id),
    );
}

fn softmax_row<T: WithDType>(
    row: &[T],
    renormalize: bool,
    x: &mut [f32],
    best: &mut TopKBuf,
    w: &mut [f32],
    id: &mut [u32],
) {
    for (xi, v) in x.iter_mut().zip(row) {
        *xi = v.to_f32();
    }
    // Softmax is monotonic, so selecting on the logits gives the exact softmax order; selecting on
    // rounded probabilities could turn two distinct logits into a tie.
    best.clear();
    for (i, &xi) in x.iter().enumerate() {
        best.push((xi, i as u32));
    }
    // The best logit is the row max; subtracting it keeps every exp in (0, 1].
    let max = best.items[0].0;
    let sum: f32 = x.iter().map(|&xi| (xi - max).exp()).sum();
    for ((wi, idi), &(xi, i)) in w.iter_mut().zip(id.iter_mut()).zip(&best.items) {
        *wi = (xi - max).exp() / sum;
        *idi = i;
    }
    if renormalize {
        // ≥ the top probability, which is ≥ 1/E, so never zero.
        let s: f32 = w.iter().sum();
        w.iter_mut().for_each(|wi| *wi /= s);
    }
}

/// Per-row scratch of [`grouped_topk`].
struct GroupedScratch {
    /// Unbiased sigmoid scores: the weights come from here.
    s: Vec<f32>,
    /// Biased scores: selection only.
    b: Vec<f32>,
    kept_group: Vec<bool>,
    groups: TopKBuf,
    best: TopKBuf,
}

/// DeepSeek-V3 "noaux_tc" routing. `logits` is [M, E], `bias` is [E], `weights`/`ids` are [M, k].
pub(crate) fn grouped_topk<T: WithDType>(
    logits: &[T],
    bias: &[f32],
    p: &GroupedTopKParams,
    weights: &mut [f32],
    ids: &mut [u32],
) {
    let experts = bias.len();
    debug_assert_eq!(experts.checked_rem(p.n_group), Some(0));
    debug_assert!(p.topk_group >= 1 && p.topk_group <= p.n_group);
    let p = *p;
    for_each_row(
        logits,
        experts,
        p.top_k,
        weights,
        ids,
        || GroupedScratch {
            s: vec![0f32; experts],
            b: vec![0f32; experts],
            kept_group: vec![false; p.n_group],
            groups: TopKBuf::new(p.topk_group),
            best: TopKBuf::new(p.top_k),
        },
        |scr, row, w, id| grouped_row(row, bias, &p, scr, w, id),
    );
}

fn grouped_row<T: WithDType>(
    row: &[T],
    bias: &[f32],
    p: &GroupedTopKParams,
    scr: &mut GroupedScratch,
    w: &mut [f32],
    id: &mut [u32],
) {
    let group_size = bias.len() / p.n_group;
    for (((si, bi), v), &c) in scr.s.iter_mut().zip(scr.b.iter_mut()).zip(row).zip(bias) {
        *si = sigmoid(v.to_f32());
        *bi = *si + c;
    }

    // Group score: sum of the group's two best biased scores (the one score if the group has one).
    scr.groups.clear();
    for (g, grp) in scr.b.chunks(group_size).enumerate() {
        let (mut top1, mut top2) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for &v in grp {
            if v > top1 {
                top2 = top1;
                top1 = v;
            } else if v > top2 {
                top2 = v;
            }
        }
        let score = if group_size == 1 { top1 } else { top1 + top2 };
        scr.groups.push((score, g as u32));
    }
    scr.kept_group.fill(false);
    for &(_, g) in &scr.groups.items {
        scr.kept_group[g as usize] = true;
    }

    // Experts of dropped groups are never candidates (the "-inf mask").
    scr.best.clear();
    for (g, grp) in scr.b.chunks(group_size).enumerate() {
        if scr.kept_group[g] {
            for (j, &v) in grp.iter().enumerate() {
                scr.best.push((v, (g * group_size + j) as u32));
            }
        }
    }

    for ((wi, idi), &(_, e)) in w.iter_mut().zip(id.iter_mut()).zip(&scr.best.items) {
        *wi = scr.s[e as usize];
        *idi = e;
    }
    if p.renormalize {
        // sigmoid can underflow to 0 for very negative logits; the guard keeps 0/0 out.
        let s: f32 = w.iter().sum::<f32>() + 1e-20;
        w.iter_mut().for_each(|wi| *wi /= s);
    }
    w.iter_mut().for_each(|wi| *wi *= p.routed_scaling_factor);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigmoid_is_finite_and_saturates_at_extremes() {
        for x in [
            -1e30f32,
            -1000.0,
            -100.0,
            -88.0,
            0.0,
            88.0,
            100.0,
            1000.0,
            1e30,
            f32::MAX,
            f32::MIN,
        ] {
            let s = sigmoid(x);
            assert!((0.0..=1.0).contains(&s), "sigmoid({x}) = {s}");
        }
        assert_eq!(sigmoid(0.0), 0.5);
        assert_eq!(sigmoid(1000.0), 1.0);
        assert_eq!(sigmoid(-1000.0), 0.0);
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
        assert_eq!(sigmoid(f32::NEG_INFINITY), 0.0);
        // Symmetry where both sides are representable.
        for x in [0.25f32, 1.0, 3.0, 10.0] {
            assert!(
                (sigmoid(x) + sigmoid(-x) - 1.0).abs() <= f32::EPSILON,
                "{x}"
            );
        }
    }

    #[test]
    fn topk_buf_orders_by_score_then_index() {
        let scores = [1.0f32, 3.0, 2.0, 3.0, -0.0, 0.0, 2.0];
        for k in 1..=scores.len() {
            let mut b = TopKBuf::new(k);
            // Insertion order must not matter: feed it backwards too.
            let mut b_rev = TopKBuf::new(k);
            for (i, &s) in scores.iter().enumerate() {
                b.push((s, i as u32));
            }
            for (i, &s) in scores.iter().enumerate().rev() {
                b_rev.push((s, i as u32));
            }
            let got: Vec<u32> = b.items.iter().map(|&(_, i)| i).collect();
            let want = [1u32, 3, 2, 6, 0, 4, 5];
            assert_eq!(got, want[..k], "k={k}");
            assert_eq!(b.items, b_rev.items, "k={k}");
        }
    }

    #[test]
    fn first_non_finite_reports_lowest_index() {
        assert_eq!(first_non_finite(&[0.0f32, 1.0]), None);
        let (i, v) = first_non_finite(&[0.0f32, f32::INFINITY, f32::NAN]).unwrap();
        assert_eq!(i, 1);
        assert_eq!(v, f32::INFINITY);
    }
}
