use std::cell::Cell;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use super::*;

const INF: f32 = f32::INFINITY;

fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p,
        top_k,
        seed: 7,
    }
}

/// How often each token comes out of `n` draws.
fn counts(p: SamplingParams, logits: &[f32], n: usize) -> Vec<usize> {
    let mut s = Sampler::new(p, 0).unwrap();
    let mut c = vec![0; logits.len()];
    for _ in 0..n {
        c[s.sample(logits).unwrap() as usize] += 1;
    }
    c
}

/// Each token's probability after temperature, top-k and top-p, the plain way: f64 weights,
/// a full sort (logit descending, id ascending), cut, renormalize. Also whether the top-p cut is
/// too close to call in floating point (a cumulative mass within 1e-6 of the target).
fn reference(logits: &[f32], p: &SamplingParams) -> (Vec<f64>, bool) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weight = |l: f32| {
        let l = l as f64;
        if max == f64::INFINITY {
            if l == f64::INFINITY { 1.0 } else { 0.0 }
        } else {
            ((l - max) / p.temperature as f64).exp()
        }
    };
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
    if p.top_k > 0 {
        order.truncate(p.top_k);
    }
    let total: f64 = order.iter().map(|&i| weight(logits[i])).sum();
    let mut close = false;
    if p.top_p < 1.0 {
        let target = p.top_p as f64 * total;
        let mut cum = 0.0;
        let mut keep = order.len();
        for (n, &i) in order.iter().enumerate() {
            cum += weight(logits[i]);
            close |= (cum - target).abs() <= 1e-6 * total;
            if cum >= target {
                keep = n + 1;
                break;
            }
        }
        order.truncate(keep);
    }
    let mass: f64 = order.iter().map(|&i| weight(logits[i])).sum();
    let mut probs = vec![0.0; logits.len()];
    for &i in &order {
        probs[i] = weight(logits[i]) / mass;
    }
    (probs, close)
}

/// The kept set's probabilities by id, as the sampler draws from it.
fn kept_probs(logits: &[f32], p: &SamplingParams) -> Vec<f64> {
    let max = check_logits("test", logits).unwrap();
    let w = Weight::new(max, p.temperature);
    let k = kept(logits, p, &w);
    assert!(k.windows(2).all(|x| x[0].0 < x[1].0), "not in id order");
    let total: f64 = k.iter().map(|&(_, l)| w.of(l) as f64).sum();
    let mut probs = vec![0.0; logits.len()];
    for (i, l) in k {
        probs[i as usize] = w.of(l) as f64 / total;
    }
    probs
}

#[test]
fn greedy_is_argmax_with_first_index_on_ties() {
    let mut s = Sampler::new(SamplingParams::default(), 0).unwrap();
    assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).unwrap(), 1);
    assert_eq!(s.sample(&[-0.0, 0.0]).unwrap(), 0);
    assert_eq!(s.sample(&[0.0, INF, INF]).unwrap(), 1);
    assert_eq!(s.sample(&[f32::NEG_INFINITY, -1e30]).unwrap(), 1);
    assert!(s.sample(&[0.0, f32::NAN]).is_err());
}

#[test]
fn top_p_keeps_the_nucleus_and_seeds_reproduce() {
    let params = params(1.0, 0, 0.5);
    // Token 2 alone holds > 50%: top-p 0.5 always picks it.
    let logits = [0.0, 1.0, 3.0, 0.5];
    let mut s = Sampler::new(params, 0).unwrap();
    assert!((0..50).all(|_| s.sample(&logits).unwrap() == 2));
    // Full sampling visits several tokens, and the same seed repeats the sequence.
    let p = SamplingParams {
        top_p: 1.0,
        ..params
    };
    let draw = |stream| {
        let mut s = Sampler::new(p, stream).unwrap();
        (0..64)
            .map(|_| s.sample(&logits).unwrap())
            .collect::<Vec<_>>()
    };
    let a = draw(0);
    assert_eq!(a, draw(0));
    assert_ne!(a, draw(1));
    assert!(a.iter().any(|&t| t != 2));
}

#[test]
fn bad_parameters_are_rejected() {
    for (t, p) in [
        (-1.0, 1.0),
        (f32::NAN, 1.0),
        (INF, 1.0),
        (1.0, 0.0),
        (1.0, 1.5),
    ] {
        let err = Sampler::new(params(t, 3, p), 0).err().unwrap().to_string();
        let field = if t == 1.0 { "top_p" } else { "temperature" };
        assert!(err.contains(field), "{t} {p}: {err}");
    }
    assert_eq!(SamplingParams::default().top_k, 0);
    SamplingParams::default().validate().unwrap();
}

#[test]
fn bad_logits_are_errors_naming_them() {
    let mut s = Sampler::new(params(1.0, 0, 1.0), 0).unwrap();
    let err = |s: &mut Sampler, l: &[f32]| s.sample(l).unwrap_err().to_string();
    assert!(err(&mut s, &[]).contains("no logits"));
    assert!(err(&mut s, &[0.0, 1.0, f32::NAN]).contains("logit 2 is NaN"));
    let ninf = [f32::NEG_INFINITY; 3];
    assert!(err(&mut s, &ninf).contains("all 3 logits are -inf"));
    let mut g = Sampler::new(SamplingParams::default(), 0).unwrap();
    assert!(err(&mut g, &ninf).contains("-inf"));
}

#[test]
fn infinite_logits() {
    // +inf takes everything (an old bug: (inf - inf) made NaN and the last id came out).
    for (k, p) in [(0, 1.0), (2, 1.0), (0, 0.3)] {
        let c = counts(params(1.0, k, p), &[INF, 0.0, 5.0], 200);
        assert_eq!(c, [200, 0, 0], "top_k {k} top_p {p}");
    }
    // Several +inf: evenly among them.
    let c = counts(params(0.8, 0, 1.0), &[INF, 9.0, INF, 0.0], 4000);
    assert_eq!((c[1], c[3]), (0, 0));
    assert!((1800..2200).contains(&c[0]), "{c:?}");
    // ... and top-k 1 keeps the lowest id.
    let c = counts(params(1.0, 1, 1.0), &[0.0, INF, INF], 100);
    assert_eq!(c, [0, 100, 0]);
    // -inf never comes out, even at a high temperature.
    let ninf = f32::NEG_INFINITY;
    let c = counts(params(50.0, 0, 1.0), &[ninf, 0.0, ninf, -3.0, ninf], 2000);
    assert_eq!((c[0], c[2], c[4]), (0, 0, 0));
    assert!(c[1] > 0 && c[3] > 0);
}

#[test]
fn top_k_keeps_the_k_best_ties_by_id() {
    let c = counts(params(1.0, 2, 1.0), &[1.0, 3.0, 2.0, 0.0], 1000);
    assert_eq!((c[0], c[3]), (0, 0));
    assert!(c[1] > c[2] && c[2] > 0, "{c:?}");
    // Three tokens tie for the top two places: ids 0 and 2 stay.
    let c = counts(params(1.0, 2, 1.0), &[4.0, 1.0, 4.0, 4.0], 1000);
    assert_eq!((c[1], c[3]), (0, 0));
    assert!((400..600).contains(&c[0]), "{c:?}");
    // top-p then works on what top-k kept: weights [6, 3, 1 x 6]; top-k 2 leaves [6, 3] / 9,
    // and 6 / 9 >= 0.55 keeps the first alone; without top-k, 6 / 15 < 0.55 keeps two.
    let mut l = vec![0f32; 8];
    l[0] = 6f32.ln();
    l[1] = 3f32.ln();
    assert_eq!(counts(params(1.0, 2, 0.55), &l, 300)[0], 300);
    let c = counts(params(1.0, 0, 0.55), &l, 1000);
    assert!(
        c[0] > 0 && c[1] > 0 && c[2..].iter().all(|&n| n == 0),
        "{c:?}"
    );
}

#[test]
fn the_draw_never_picks_a_weightless_token() {
    assert_eq!(draw([(0, 0.0), (1, 1.0), (2, 0.0)].into_iter(), 5.0), 1);
    assert_eq!(draw([(3, 0.5), (4, 0.5)].into_iter(), 0.5), 4);
    assert_eq!(draw([(3, 0.5), (4, 0.5)].into_iter(), 0.0), 3);
}

#[test]
fn sampled_frequencies_follow_the_reference_distribution() {
    let logits: Vec<f32> = (0..40)
        .map(|i| ((i * 37 % 17) as f32) * 0.3 - 2.0)
        .collect();
    let n = 40_000;
    for p in [
        params(1.0, 0, 1.0),
        params(0.7, 0, 1.0),
        params(1.3, 5, 1.0),
        params(0.9, 0, 0.8),
        params(2.0, 12, 0.7),
    ] {
        let (want, _) = reference(&logits, &p);
        let c = counts(p, &logits, n);
        for (i, (&got, &q)) in c.iter().zip(&want).enumerate() {
            let f = got as f64 / n as f64;
            let sigma = (q * (1.0 - q) / n as f64).sqrt();
            assert!(
                (f - q).abs() <= 5.0 * sigma + 1e-4,
                "{p:?} token {i}: {f} vs {q}"
            );
            if q == 0.0 {
                assert_eq!(got, 0);
            }
        }
    }
}

#[test]
fn kept_sets_match_a_full_sort() {
    // Logits from a small grid, so ties (and ties at the cuts) are common, with some -inf; in
    // some cases a few +inf.
    let logit = prop_oneof![
        20 => (-16i32..16).prop_map(|v| v as f32 * 0.5),
        2 => Just(f32::NEG_INFINITY),
    ];
    let strategy = (
        prop::collection::vec(logit, 1..500),
        prop_oneof![7 => Just(Vec::new()), 1 => prop::collection::vec(any::<prop::sample::Index>(), 1..3)],
        prop_oneof![Just(0.05f32), Just(0.5), Just(1.0), Just(3.0)],
        prop_oneof![Just(0usize), 1usize..8, 50usize..400],
        prop_oneof![Just(1.0f32), 0.01f32..1.0, 0.9f32..1.0],
    );
    let (checked, close, deep) = (Cell::new(0usize), Cell::new(0usize), Cell::new(0usize));
    let mut runner = TestRunner::new(Config {
        cases: 512,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&strategy, |(mut logits, infs, t, k, top_p)| {
            for i in infs {
                let n = logits.len();
                logits[i.index(n)] = INF;
            }
            prop_assume!(logits.iter().any(|&l| l > f32::NEG_INFINITY));
            let p = params(t, k, top_p);
            let (want, ambiguous) = reference(&logits, &p);
            if ambiguous {
                close.set(close.get() + 1);
                return Ok(());
            }
            let got = kept_probs(&logits, &p);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                prop_assert!((a - b).abs() <= 1e-5, "token {}: {} vs {}", i, a, b);
            }
            checked.set(checked.get() + 1);
            // A nucleus past the first sorted chunk of 64.
            if top_p < 1.0 && want.iter().filter(|&&q| q > 0.0).count() > 64 {
                deep.set(deep.get() + 1);
            }
            Ok(())
        })
        .unwrap();
    assert!(checked.get() > 10 * close.get(), "{checked:?} / {close:?}");
    assert!(deep.get() > 20, "{} nuclei past one chunk", deep.get());
}

/// log-softmax by the definition, in f64, for logits small enough not to need the max shift.
fn reference_logprobs(logits: &[f32]) -> Vec<f64> {
    let sum: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
    logits
        .iter()
        .map(|&l| ((l as f64).exp() / sum).ln())
        .collect()
}

#[test]
fn logprobs_match_the_definition() {
    let strategy = (
        prop::collection::vec(-30.0f32..30.0, 1..200),
        any::<prop::sample::Index>(),
        0usize..8,
    );
    let mut runner = TestRunner::new(Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&strategy, |(logits, pick, top_n)| {
            let token = pick.index(logits.len()) as u32;
            let want = reference_logprobs(&logits);
            let got = logprobs(&logits, token, top_n).unwrap();
            prop_assert_eq!(got.token, token);
            prop_assert!((got.logprob as f64 - want[token as usize]).abs() < 1e-4);
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
            order.truncate(top_n);
            let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
            let want_ids: Vec<u32> = order.iter().map(|&i| i as u32).collect();
            prop_assert_eq!(ids, want_ids);
            for &(i, lp) in &got.top {
                prop_assert!((lp as f64 - want[i as usize]).abs() < 1e-4);
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn logprobs_edge_cases() {
    // Large logits need the max shift (exp(1e4) overflows f64).
    let got = logprobs(&[1e4, 1e4, 0.0], 0, 3).unwrap();
    assert!((got.logprob - -(2f32.ln())).abs() < 1e-6);
    assert_eq!(got.top[0].0, 0);
    assert_eq!(got.top[1].0, 1);
    assert_eq!(got.top[2], (2, -1e4 - 2f32.ln()));
    // Ties by id; top_n past the vocabulary gives all.
    let got = logprobs(&[1.0, 2.0, 2.0, 1.0], 3, 10).unwrap();
    let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
    assert_eq!(ids, [1, 2, 0, 3]);
    assert_eq!(logprobs(&[1.0, 2.0], 0, 0).unwrap().top, []);
    // Infinities.
    let ninf = f32::NEG_INFINITY;
    let got = logprobs(&[INF, 0.0, INF], 1, 3).unwrap();
    assert_eq!(got.logprob, ninf);
    assert_eq!(got.top, [(0, -(2f32.ln())), (2, -(2f32.ln())), (1, ninf)]);
    let got = logprobs(&[ninf, 0.0], 0, 1).unwrap();
    assert_eq!((got.logprob, got.top.clone()), (ninf, vec![(1, 0.0)]));
    // Errors.
    let err = |l: &[f32], t| logprobs(l, t, 1).unwrap_err().to_string();
    assert!(err(&[0.0, 1.0], 2).contains("token 2 is out of range for 2 logits"));
    assert!(err(&[], 0).contains("no logits"));
    assert!(err(&[f32::NAN], 0).contains("logit 0 is NaN"));
    assert!(err(&[ninf, ninf], 0).contains("all 2 logits are -inf"));
}
