//! Routing kernels against independent f64 references, hand-computed cases and bad inputs.

use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::Error;
use fmoe_kernels::routing::{GroupedTopKParams, TopK, grouped_topk, topk_softmax};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

/// f32 unit roundoff.
const U: f64 = 1.0 / (1u64 << 24) as f64;

fn logits_tensor(data: &[f32], m: usize, e: usize) -> Tensor {
    Tensor::from_vec(data.to_vec(), [m, e], &Device::Cpu).unwrap()
}

fn bias_tensor(data: &[f32]) -> Tensor {
    Tensor::from_vec(data.to_vec(), [data.len()], &Device::Cpu).unwrap()
}

/// Checks the output contract (shapes, dtypes) and returns host copies.
fn unpack(t: &TopK, m: usize, k: usize) -> (Vec<f32>, Vec<u32>) {
    assert_eq!(t.weights.dims(), &[m, k]);
    assert_eq!(t.ids.dims(), &[m, k]);
    assert_eq!(t.weights.dtype(), DType::F32);
    assert_eq!(t.ids.dtype(), DType::U32);
    let w = t
        .weights
        .cpu_slice::<f32>("test", "weights")
        .unwrap()
        .to_vec();
    let ids = t.ids.cpu_slice::<u32>("test", "ids").unwrap().to_vec();
    (w, ids)
}

fn random_vec(rng: &mut ChaCha8Rng, n: usize, sigma: f32) -> Vec<f32> {
    let d = Normal::new(0.0f32, sigma).unwrap();
    (0..n).map(|_| d.sample(rng)).collect()
}

/// Indices of `scores` sorted by (score desc, index asc).
fn order_desc(scores: &[f64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap().then(a.cmp(&b)));
    idx
}

// ---------------------------------------------------------------------------------------------
// topk_softmax
// ---------------------------------------------------------------------------------------------

/// Full softmax in f64, full sort, first k, optional renormalization.
fn ref_topk_softmax(row: &[f32], k: usize, renormalize: bool) -> (Vec<f64>, Vec<u32>) {
    let x: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    let p: Vec<f64> = e.iter().map(|v| v / s).collect();
    let ids: Vec<usize> = order_desc(&p).into_iter().take(k).collect();
    let mut w: Vec<f64> = ids.iter().map(|&i| p[i]).collect();
    if renormalize {
        let t: f64 = w.iter().sum();
        w.iter_mut().for_each(|v| *v /= t);
    }
    (w, ids.into_iter().map(|i| i as u32).collect())
}

/// Relative error bound of an f32 softmax weight against exact arithmetic, first order in u:
/// `x_i - max` rounds with error ≤ D·u (D = max - min of the row), which becomes a relative error
/// of D·u after exp; exp itself is within 1 ulp (≤ 2u); the sequential sum of E positive terms
/// adds ≤ (E-1)·u; the division u. A weight is a ratio of two such quantities: ≤ 2(D+2)u +
/// (E-1)u + u. Renormalization cancels the sum's error but adds ≤ (k+1)u. Hence (2D + E + k + 8)u.
fn softmax_tol(row: &[f32], e: usize, k: usize) -> f64 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let min = row.iter().cloned().fold(f32::INFINITY, f32::min);
    let d = f64::from(max) - f64::from(min);
    (2.0 * d + (e + k + 8) as f64) * U
}

#[test]
fn topk_softmax_matches_f64_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0001);
    let shapes = [
        (0, 8, 2),
        (1, 8, 2),
        (7, 8, 2),
        (5, 8, 8),
        (3, 1, 1),
        (33, 64, 6),
        (9, 256, 8),
    ];
    for (m, e, k) in shapes {
        for sigma in [1.0f32, 4.0] {
            let logits = random_vec(&mut rng, m * e, sigma);
            let t = logits_tensor(&logits, m, e);
            for renormalize in [true, false] {
                let (w, ids) = unpack(&topk_softmax(&t, k, renormalize).unwrap(), m, k);
                for r in 0..m {
                    let row = &logits[r * e..(r + 1) * e];
                    let (rw, rids) = ref_topk_softmax(row, k, renormalize);
                    let ctx =
                        format!("M={m} E={e} k={k} sigma={sigma} renorm={renormalize} row={r}");
                    assert_eq!(&ids[r * k..(r + 1) * k], &rids[..], "{ctx}");
                    let tol = softmax_tol(row, e, k);
                    for j in 0..k {
                        let got = f64::from(w[r * k + j]);
                        let rel = (got - rw[j]).abs() / rw[j];
                        assert!(
                            rel <= tol,
                            "{ctx} j={j}: {got} vs {} (rel {rel:e} > {tol:e})",
                            rw[j]
                        );
                    }
                    if renormalize {
                        let sum: f64 = w[r * k..(r + 1) * k].iter().map(|&v| f64::from(v)).sum();
                        assert!((sum - 1.0).abs() <= 1e-6, "{ctx}: sum {sum}");
                    }
                }
            }
        }
    }
}

#[test]
fn topk_softmax_hand_examples() {
    // Experts 1 and 3 tie on the top logit: both chosen, lower index first, equal halves.
    let t = logits_tensor(&[1.0, 3.0, 2.0, 3.0], 1, 4);
    let (w, ids) = unpack(&topk_softmax(&t, 2, true).unwrap(), 1, 2);
    assert_eq!(ids, [1, 3]);
    assert_eq!(w, [0.5, 0.5]);
    // Unnormalized: e^0 / (e^-2 + 1 + e^-1 + 1) = 0.399486304650...
    let (w, ids) = unpack(&topk_softmax(&t, 3, false).unwrap(), 1, 3);
    assert_eq!(ids, [1, 3, 2]);
    for (got, want) in w
        .iter()
        .zip([0.3994863046503028, 0.3994863046503028, 0.14696279851039795])
    {
        assert!((f64::from(*got) - want).abs() <= 1e-7, "{got} vs {want}");
    }

    // logits ln(1..=4) give probabilities 0.1, 0.2, 0.3, 0.4.
    let l: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|v| v.ln()).collect();
    let t = logits_tensor(&l, 1, 4);
    let (w, ids) = unpack(&topk_softmax(&t, 3, false).unwrap(), 1, 3);
    assert_eq!(ids, [3, 2, 1]);
    for (got, want) in w.iter().zip([0.4, 0.3, 0.2]) {
        assert!((f64::from(*got) - want).abs() <= 1e-6, "{got} vs {want}");
    }
    let (w, _) = unpack(&topk_softmax(&t, 3, true).unwrap(), 1, 3);
    for (got, want) in w.iter().zip([4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0]) {
        assert!((f64::from(*got) - want).abs() <= 1e-6, "{got} vs {want}");
    }
}

#[test]
fn topk_softmax_extreme_but_finite_logits() {
    // A huge spread must not overflow (max subtraction) and the losers underflow to 0 cleanly.
    let t = logits_tensor(&[-3e38, 3e38, 0.0, 1e30], 1, 4);
    let (w, ids) = unpack(&topk_softmax(&t, 2, false).unwrap(), 1, 2);
    assert_eq!(ids, [1, 3]);
    assert_eq!(w, [1.0, 0.0]);
}

// ---------------------------------------------------------------------------------------------
// grouped_topk
// ---------------------------------------------------------------------------------------------

struct GroupedRef {
    weights: Vec<f64>,
    ids: Vec<u32>,
    kept_groups: Vec<usize>,
}

/// The DeepSeek-V3 rule spelled out in f64: all group scores, sort groups, mask, sort experts.
fn ref_grouped(row: &[f32], bias: &[f32], p: &GroupedTopKParams) -> GroupedRef {
    let e = row.len();
    let gs = e / p.n_group;
    let s: Vec<f64> = row
        .iter()
        .map(|&x| 1.0 / (1.0 + (-f64::from(x)).exp()))
        .collect();
    let b: Vec<f64> = s.iter().zip(bias).map(|(s, &c)| s + f64::from(c)).collect();
    let group_scores: Vec<f64> = (0..p.n_group)
        .map(|g| {
            let mut v = b[g * gs..(g + 1) * gs].to_vec();
            v.sort_by(|x, y| y.partial_cmp(x).unwrap());
            v.iter().take(2).sum()
        })
        .collect();
    let kept_groups: Vec<usize> = order_desc(&group_scores)
        .into_iter()
        .take(p.topk_group)
        .collect();
    let masked: Vec<f64> = (0..e)
        .map(|j| {
            if kept_groups.contains(&(j / gs)) {
                b[j]
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    let ids: Vec<usize> = order_desc(&masked).into_iter().take(p.top_k).collect();
    let mut weights: Vec<f64> = ids.iter().map(|&j| s[j]).collect();
    if p.renormalize {
        let t: f64 = weights.iter().sum::<f64>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= t);
    }
    weights
        .iter_mut()
        .for_each(|w| *w *= f64::from(p.routed_scaling_factor));
    GroupedRef {
        weights,
        ids: ids.into_iter().map(|j| j as u32).collect(),
        kept_groups,
    }
}

/// Relative error bound of a grouped weight, first order in u: the f32 sigmoid takes the exact
/// logit, so exp (≤ 2u), 1+e (u) and the division (u), plus e/(1+e)·2u, stay ≤ 6u; renormalizing
/// divides two such quantities (12u) after a k-term sum ((k-1)u) with one rounding (u); the scale
/// one more (u). Hence (k + 13)u; we allow (k + 16)u.
fn grouped_tol(k: usize) -> f64 {
    (k + 16) as f64 * U
}

fn params(top_k: usize, n_group: usize, topk_group: usize) -> GroupedTopKParams {
    GroupedTopKParams {
        top_k,
        n_group,
        topk_group,
        renormalize: false,
        routed_scaling_factor: 1.0,
    }
}

#[test]
fn grouped_topk_matches_f64_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0003);
    // (E, n_group, topk_group, top_k): DeepSeek-V3, a small grouped case, a single group, and
    // groups of one expert.
    let configs = [(256, 8, 4, 8), (16, 4, 2, 4), (8, 1, 1, 2), (8, 8, 8, 8)];
    for (e, n_group, topk_group, top_k) in configs {
        let gs = e / n_group;
        for m in [0usize, 1, 37] {
            let logits = random_vec(&mut rng, m * e, 2.0);
            // Bias of the order of the sigmoid spread, so it does change selections.
            let bias = random_vec(&mut rng, e, 0.1);
            let t = logits_tensor(&logits, m, e);
            let bt = bias_tensor(&bias);
            let mut bias_mattered = false;
            for renormalize in [true, false] {
                for routed_scaling_factor in [2.5f32, 1.0] {
                    let p = GroupedTopKParams {
                        top_k,
                        n_group,
                        topk_group,
                        renormalize,
                        routed_scaling_factor,
                    };
                    let (w, ids) = unpack(&grouped_topk(&t, &bt, &p).unwrap(), m, top_k);
                    for r in 0..m {
                        let row = &logits[r * e..(r + 1) * e];
                        let rf = ref_grouped(row, &bias, &p);
                        let ctx =
                            format!("E={e} groups={n_group}/{topk_group} k={top_k} {p:?} row={r}");
                        let got_ids = &ids[r * top_k..(r + 1) * top_k];
                        let got_w = &w[r * top_k..(r + 1) * top_k];
                        assert_eq!(got_ids, &rf.ids[..], "{ctx}");
                        for (j, (&g, &want)) in got_w.iter().zip(&rf.weights).enumerate() {
                            let rel = (f64::from(g) - want).abs() / want;
                            assert!(
                                rel <= grouped_tol(top_k),
                                "{ctx} j={j}: {g} vs {want} (rel {rel:e})"
                            );
                        }
                        for &id in got_ids {
                            assert!(
                                rf.kept_groups.contains(&(id as usize / gs)),
                                "{ctx}: id {id}"
                            );
                        }
                        if renormalize {
                            let sum: f64 = got_w.iter().map(|&v| f64::from(v)).sum();
                            let want = f64::from(routed_scaling_factor);
                            assert!(
                                (sum - want).abs() <= want * grouped_tol(top_k),
                                "{ctx}: sum {sum} vs {want}"
                            );
                        }
                        let zero = vec![0.0f32; e];
                        bias_mattered |= ref_grouped(row, &zero, &p).ids != rf.ids;
                    }
                }
            }
            if m == 37 && top_k < e {
                assert!(
                    bias_mattered,
                    "E={e}: the random bias never changed a selection"
                );
            }
        }
    }
}

#[test]
fn grouped_topk_bias_steers_selection_not_weights() {
    let logits = logits_tensor(&[0.5; 4], 1, 4);
    let sig = 1.0 / (1.0 + (-0.5f64).exp()); // 0.6224593312...
    let p = params(1, 1, 1);

    // No bias: a four-way tie goes to expert 0.
    let (_, ids) = unpack(
        &grouped_topk(&logits, &bias_tensor(&[0.0; 4]), &p).unwrap(),
        1,
        1,
    );
    assert_eq!(ids, [0]);

    let bias = bias_tensor(&[0.0, 0.0, 0.1, 0.0]);
    for scale in [1.0f32, 2.5] {
        let p = GroupedTopKParams {
            routed_scaling_factor: scale,
            ..p
        };
        let (w, ids) = unpack(&grouped_topk(&logits, &bias, &p).unwrap(), 1, 1);
        assert_eq!(ids, [2]);
        // The weight is the unbiased sigmoid (0.62..), not the biased 0.72...
        let want = sig * f64::from(scale);
        assert!((f64::from(w[0]) - want).abs() <= 1e-6, "{} vs {want}", w[0]);
    }
    // One expert renormalized is the scale itself.
    let p = GroupedTopKParams {
        renormalize: true,
        routed_scaling_factor: 2.5,
        ..p
    };
    let (w, ids) = unpack(&grouped_topk(&logits, &bias, &p).unwrap(), 1, 1);
    assert_eq!(ids, [2]);
    assert!((w[0] - 2.5).abs() <= 1e-6, "{}", w[0]);
}

#[test]
fn grouped_topk_best_expert_in_losing_group_is_not_chosen() {
    // Group 0 = {0, 1}: sigmoid 0.9933 + 0.0067 = 1.0. Group 1 = {2, 3}: 0.8808 + 0.8808 = 1.76.
    // Expert 0 is the best single expert, but its group loses on the top-2 sum.
    let logits = logits_tensor(&[5.0, -5.0, 2.0, 2.0], 1, 4);
    let bias = bias_tensor(&[0.0; 4]);
    let (w, ids) = unpack(
        &grouped_topk(&logits, &bias, &params(1, 2, 1)).unwrap(),
        1,
        1,
    );
    assert_eq!(ids, [2]);
    assert!(
        (f64::from(w[0]) - 0.8807970779778823).abs() <= 1e-6,
        "{}",
        w[0]
    );
    let (_, ids) = unpack(
        &grouped_topk(&logits, &bias, &params(2, 2, 1)).unwrap(),
        1,
        2,
    );
    assert_eq!(ids, [2, 3]);
    // With both groups kept, expert 0 wins again.
    let (_, ids) = unpack(
        &grouped_topk(&logits, &bias, &params(2, 2, 2)).unwrap(),
        1,
        2,
    );
    assert_eq!(ids, [0, 2]);
}

#[test]
fn ties_resolve_to_lower_indices() {
    for (e, k) in [(8, 2), (8, 8), (64, 6), (256, 8)] {
        let logits = logits_tensor(&vec![0.25; 3 * e], 3, e);
        let want: Vec<u32> = (0..3).flat_map(|_| 0..k as u32).collect();
        for renormalize in [false, true] {
            let (w, ids) = unpack(&topk_softmax(&logits, k, renormalize).unwrap(), 3, k);
            assert_eq!(ids, want, "softmax E={e} k={k}");
            let expect = if renormalize {
                1.0 / k as f32
            } else {
                1.0 / e as f32
            };
            assert!(
                w.iter().all(|&v| (v - expect).abs() <= 1e-6 * expect),
                "{w:?}"
            );
        }
        for (n_group, topk_group) in [(1, 1), (2, 1), (4, 2), (8, 4)] {
            if e % n_group != 0 || k > topk_group * (e / n_group) {
                continue;
            }
            let p = GroupedTopKParams {
                renormalize: true,
                ..params(k, n_group, topk_group)
            };
            let (w, ids) = unpack(
                &grouped_topk(&logits, &bias_tensor(&vec![0.0; e]), &p).unwrap(),
                3,
                k,
            );
            assert_eq!(ids, want, "grouped E={e} k={k} {p:?}");
            assert!(
                w.iter().all(|&v| (v - 1.0 / k as f32).abs() <= 1e-6),
                "{w:?}"
            );
        }
    }
}

#[test]
fn half_precision_logits_are_converted_to_f32_first() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0006);
    let (m, e, k) = (11, 64, 6);
    let logits = random_vec(&mut rng, m * e, 2.0);
    let bias = bias_tensor(&random_vec(&mut rng, e, 0.1));
    let p = GroupedTopKParams {
        renormalize: true,
        routed_scaling_factor: 2.5,
        ..params(k, 8, 3)
    };
    for dtype in [DType::BF16, DType::F16] {
        let half = Tensor::from_f32(&logits, [m, e], dtype, &Device::Cpu).unwrap();
        // The same values, already widened: results must be bit-identical.
        let widened = logits_tensor(&half.to_f32_vec().unwrap(), m, e);
        let a = unpack(&topk_softmax(&half, k, true).unwrap(), m, k);
        let b = unpack(&topk_softmax(&widened, k, true).unwrap(), m, k);
        assert_eq!(a, b, "{dtype}");
        let a = unpack(&grouped_topk(&half, &bias, &p).unwrap(), m, k);
        let b = unpack(&grouped_topk(&widened, &bias, &p).unwrap(), m, k);
        assert_eq!(a, b, "{dtype}");
    }
}

#[test]
fn many_rows_give_the_same_bits_as_one_row_at_a_time() {
    // Enough rows for the parallel path; each row alone takes the serial one.
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0007);
    let (m, e, k) = (300, 64, 4);
    let logits = random_vec(&mut rng, m * e, 2.0);
    let bias_v = random_vec(&mut rng, e, 0.1);
    let bias = bias_tensor(&bias_v);
    let p = GroupedTopKParams {
        renormalize: true,
        routed_scaling_factor: 2.5,
        ..params(k, 8, 4)
    };
    let all_soft = unpack(
        &topk_softmax(&logits_tensor(&logits, m, e), k, true).unwrap(),
        m,
        k,
    );
    let all_grp = unpack(
        &grouped_topk(&logits_tensor(&logits, m, e), &bias, &p).unwrap(),
        m,
        k,
    );
    for r in 0..m {
        let one = logits_tensor(&logits[r * e..(r + 1) * e], 1, e);
        let (w, ids) = unpack(&topk_softmax(&one, k, true).unwrap(), 1, k);
        assert_eq!(w[..], all_soft.0[r * k..(r + 1) * k], "softmax row {r}");
        assert_eq!(ids[..], all_soft.1[r * k..(r + 1) * k], "softmax row {r}");
        let (w, ids) = unpack(&grouped_topk(&one, &bias, &p).unwrap(), 1, k);
        assert_eq!(w[..], all_grp.0[r * k..(r + 1) * k], "grouped row {r}");
        assert_eq!(ids[..], all_grp.1[r * k..(r + 1) * k], "grouped row {r}");
    }
}

// ---------------------------------------------------------------------------------------------
// Bad inputs: errors naming the problem, never a panic.
// ---------------------------------------------------------------------------------------------

fn assert_err_contains<T: std::fmt::Debug>(r: Result<T, Error>, needles: &[&str]) -> Error {
    let err = r.unwrap_err();
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "`{msg}` lacks `{n}`");
    }
    err
}

#[test]
fn bad_top_k_is_a_topk_error() {
    let t = logits_tensor(&[0.0; 16], 2, 8);
    let e = assert_err_contains(
        topk_softmax(&t, 0, true),
        &["topk_softmax", "top-k 0", "1..=8"],
    );
    assert!(
        matches!(
            e,
            Error::TopK {
                k: 0,
                experts: 8,
                ..
            }
        ),
        "{e:?}"
    );
    let e = assert_err_contains(
        topk_softmax(&t, 9, true),
        &["topk_softmax", "top-k 9", "1..=8"],
    );
    assert!(
        matches!(
            e,
            Error::TopK {
                k: 9,
                experts: 8,
                ..
            }
        ),
        "{e:?}"
    );
    let bias = bias_tensor(&[0.0; 8]);
    for k in [0, 9] {
        let e = assert_err_contains(grouped_topk(&t, &bias, &params(k, 1, 1)), &["grouped_topk"]);
        assert!(matches!(e, Error::TopK { experts: 8, .. }), "{e:?}");
    }
    // E = 0: no k is valid.
    let empty = Tensor::from_vec(Vec::<f32>::new(), [3, 0], &Device::Cpu).unwrap();
    assert_err_contains(topk_softmax(&empty, 1, false), &["top-k 1", "1..=0"]);
}

#[test]
fn bad_logits_shape_or_dtype() {
    let rank1 = Tensor::from_vec(vec![0.0f32; 8], [8], &Device::Cpu).unwrap();
    let rank3 = Tensor::from_vec(vec![0.0f32; 8], [1, 2, 4], &Device::Cpu).unwrap();
    let bias = bias_tensor(&[0.0; 8]);
    for t in [&rank1, &rank3] {
        assert_err_contains(
            topk_softmax(t, 2, true),
            &["topk_softmax", "router_logits", "rank 2"],
        );
        assert_err_contains(
            grouped_topk(t, &bias, &params(2, 1, 1)),
            &["grouped_topk", "router_logits", "rank 2"],
        );
    }
    for dtype in [DType::U32, DType::F8E4M3] {
        let t = Tensor::zeros([2, 8], dtype, &Device::Cpu).unwrap();
        assert_err_contains(
            topk_softmax(&t, 2, true),
            &["router_logits", dtype.as_str()],
        );
        assert_err_contains(
            grouped_topk(&t, &bias, &params(2, 1, 1)),
            &["router_logits", dtype.as_str()],
        );
    }
}

#[test]
fn bad_bias() {
    let t = logits_tensor(&[0.0; 16], 2, 8);
    let p = params(2, 2, 1);
    assert_err_contains(
        grouped_topk(&t, &bias_tensor(&[0.0; 9]), &p),
        &["e_score_correction_bias", "[9]", "[8]"],
    );
    let bf = Tensor::zeros([8], DType::BF16, &Device::Cpu).unwrap();
    assert_err_contains(
        grouped_topk(&t, &bf, &p),
        &["e_score_correction_bias", "bf16", "f32"],
    );
    let mut v = [0.0f32; 8];
    v[6] = f32::NAN;
    let e = assert_err_contains(
        grouped_topk(&t, &bias_tensor(&v), &p),
        &["e_score_correction_bias", "index 6"],
    );
    assert!(
        matches!(e, Error::Core(fmoe_core::Error::NonFinite { index: 6, .. })),
        "{e:?}"
    );
}

#[test]
fn bad_group_parameters() {
    let t = logits_tensor(&[0.0; 32], 2, 16);
    let bias = bias_tensor(&[0.0; 16]);
    let run = |p: GroupedTopKParams| grouped_topk(&t, &bias, &p);
    assert_err_contains(
        run(params(2, 3, 1)),
        &["grouped_topk", "n_group 3", "16 experts"],
    );
    assert_err_contains(run(params(2, 0, 1)), &["n_group 0"]);
    assert_err_contains(run(params(2, 4, 5)), &["topk_group 5", "1..=4"]);
    assert_err_contains(run(params(2, 4, 0)), &["topk_group 0"]);
    // 2 kept groups of 4 experts hold 8 experts; 9 cannot be chosen.
    assert_err_contains(
        run(params(9, 4, 2)),
        &[
            "top_k 9",
            "8 experts",
            "topk_group 2",
            "4 experts per group",
        ],
    );
    assert!(run(params(8, 4, 2)).is_ok());
    for bad in [f32::NAN, f32::INFINITY] {
        let p = GroupedTopKParams {
            routed_scaling_factor: bad,
            ..params(2, 4, 2)
        };
        assert_err_contains(run(p), &["routed_scaling_factor"]);
    }
}

#[test]
fn non_finite_logits_are_errors_naming_the_index() {
    let bias = bias_tensor(&[0.0; 4]);
    for (bad, shown) in [
        (f32::NAN, "NaN"),
        (f32::INFINITY, "inf"),
        (f32::NEG_INFINITY, "-inf"),
    ] {
        let mut v = [0.0f32; 8];
        v[5] = bad;
        // A second bad value later on: the first one is reported.
        v[7] = f32::NAN;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let t = Tensor::from_f32(&v, [2, 4], dtype, &Device::Cpu).unwrap();
            let needles = ["router_logits", "index 5", shown];
            let e = assert_err_contains(topk_softmax(&t, 2, true), &needles);
            assert!(
                matches!(e, Error::Core(fmoe_core::Error::NonFinite { index: 5, .. })),
                "{e:?}"
            );
            let e = assert_err_contains(grouped_topk(&t, &bias, &params(2, 2, 1)), &needles);
            assert!(
                matches!(e, Error::Core(fmoe_core::Error::NonFinite { index: 5, .. })),
                "{e:?}"
            );
        }
    }
}
