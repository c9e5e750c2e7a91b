//! The deferred routings (`topk_softmax_deferred`, `grouped_topk_deferred`) on CUDA: the eager
//! calls' top-k; nothing read back (the calls are captured into a CUDA graph, where any
//! synchronization fails the capture); a NaN/Inf comes back as a pending check whose error is the
//! eager call's, also merged with other layers' checks (all read in one download, the first
//! flagged in merge order reported).
//!
//! One test in its own binary: capture records whatever reaches the backend's one stream, so no
//! other test may issue work meanwhile. Without a CUDA device it prints "skipping: <reason>" and
//! passes, unless `FMOE_REQUIRE_CUDA=1`, which turns a skip into a failure.

use fmoe_core::cuda::{capture_graph, test_backend_or_skip};
use fmoe_core::{DType, Device, Error as CoreError, Tensor};
use fmoe_kernels::Error;
use fmoe_kernels::routing::{
    FiniteCheck, GroupedTopKParams, TopK, grouped_topk, grouped_topk_deferred, topk_softmax,
    topk_softmax_deferred,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

const CUDA: Device = Device::Cuda(0);

fn host(t: &TopK) -> (Vec<f32>, Vec<u32>) {
    let w = t.weights.to_f32_vec().unwrap();
    let ids = t.ids.to_device(Device::Cpu).unwrap();
    (w, ids.cpu_slice::<u32>("test", "ids").unwrap().to_vec())
}

#[test]
fn deferred_routing_waits_for_nothing_and_reports_later() {
    let Some(backend) = test_backend_or_skip() else {
        return;
    };
    let (m, e) = (9, 16);
    let p = GroupedTopKParams {
        top_k: 2,
        n_group: 4,
        topk_group: 2,
        renormalize: true,
        routed_scaling_factor: 2.5,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    let normal = Normal::new(0.0f32, 2.0).unwrap();
    let clean: Vec<f32> = (0..m * e).map(|_| normal.sample(&mut rng)).collect();
    let mut bad = clean.clone();
    bad[3 * e + 5] = f32::NAN;
    bad[7 * e + 2] = f32::INFINITY;
    let bias_v: Vec<f32> = (0..e).map(|_| 0.1 * normal.sample(&mut rng)).collect();
    let gpu = |v: &[f32]| Tensor::from_f32(v, [m, e], DType::BF16, &CUDA).unwrap();
    let b = Tensor::from_vec(bias_v.clone(), [e], &CUDA).unwrap();
    let (clean_g, bad_g) = (gpu(&clean), gpu(&bad));

    // Clean logits: the eager result, a pending check that finds nothing.
    let (t, check) = topk_softmax_deferred(&clean_g, 2, true).unwrap();
    assert!(check.is_pending());
    check.check().unwrap();
    assert_eq!(host(&t), host(&topk_softmax(&clean_g, 2, true).unwrap()));
    let (t, check) = grouped_topk_deferred(&clean_g, &b, &p).unwrap();
    check.check().unwrap();
    assert_eq!(host(&t), host(&grouped_topk(&clean_g, &b, &p).unwrap()));

    // Captured into a graph (the kernels were loaded above): nothing inside synchronizes.
    for data in [&clean_g, &bad_g] {
        let g = capture_graph(&backend, || {
            let (a, ca) = topk_softmax_deferred(data, 2, true)?;
            let (g, cg) = grouped_topk_deferred(data, &b, &p)?;
            Ok::<_, Error>((a, ca, g, cg))
        })
        .unwrap_or_else(|e| panic!("the deferred routings could not be captured: {e}"));
        g.replay().unwrap();
        let (a, ca, gt, cg) = g.output();
        match (topk_softmax(data, 2, true), grouped_topk(data, &b, &p)) {
            (Ok(want_a), Ok(want_g)) => {
                ca.check().unwrap();
                cg.check().unwrap();
                assert_eq!(host(a), host(&want_a));
                assert_eq!(host(gt), host(&want_g));
            }
            (Err(want_a), Err(want_g)) => {
                assert_eq!(ca.check().unwrap_err().to_string(), want_a.to_string());
                assert_eq!(cg.check().unwrap_err().to_string(), want_g.to_string());
            }
            other => panic!("the eager routings disagree: {other:?}"),
        }
    }
    // (The eager call cannot be captured: it reads its flag back.)
    let eager = capture_graph(&backend, || topk_softmax(&clean_g, 2, true));
    println!(
        "capturing the eager topk_softmax: {:?}",
        eager.err().map(|e| e.to_string())
    );

    // NaN: the deferred call succeeds; its check is the eager error (index 53 = 3·16 + 5), the
    // CPU twin's.
    let want = topk_softmax(&bad_g, 2, true).unwrap_err();
    assert!(
        matches!(want, Error::Core(CoreError::NonFinite { index: 53, .. })),
        "{want:?}"
    );
    let cpu_bad = bad_g.to_device(Device::Cpu).unwrap();
    assert_eq!(
        topk_softmax(&cpu_bad, 2, true).unwrap_err().to_string(),
        want.to_string()
    );
    let (_, bad_check) = topk_softmax_deferred(&bad_g, 2, true).unwrap();
    assert_eq!(bad_check.check().unwrap_err().to_string(), want.to_string());
    // Three "layers" merged, the second bad: its error; a clean set checks clean.
    let mut all = FiniteCheck::none();
    for data in [&clean_g, &bad_g, &clean_g] {
        all.merge(topk_softmax_deferred(data, 2, true).unwrap().1);
    }
    all.merge(grouped_topk_deferred(&bad_g, &b, &p).unwrap().1);
    assert_eq!(all.check().unwrap_err().to_string(), want.to_string());
    let mut ok = FiniteCheck::none();
    for _ in 0..3 {
        ok.merge(topk_softmax_deferred(&clean_g, 2, true).unwrap().1);
        ok.merge(grouped_topk_deferred(&clean_g, &b, &p).unwrap().1);
    }
    assert!(ok.held_bytes() > 0);
    ok.check().unwrap();
    // A bad bias alone: the eager error naming the bias.
    let mut bias_bad = bias_v;
    bias_bad[11] = f32::NAN;
    let bb = Tensor::from_vec(bias_bad, [e], &CUDA).unwrap();
    let want = grouped_topk(&clean_g, &bb, &p).unwrap_err();
    assert!(
        want.to_string().contains("e_score_correction_bias"),
        "{want}"
    );
    let (_, c) = grouped_topk_deferred(&clean_g, &bb, &p).unwrap();
    assert_eq!(c.check().unwrap_err().to_string(), want.to_string());
    // On the CPU nothing is deferred: the error comes at once, a clean call has nothing pending.
    assert!(topk_softmax_deferred(&cpu_bad, 2, true).is_err());
    let cpu_clean = clean_g.to_device(Device::Cpu).unwrap();
    assert!(
        !topk_softmax_deferred(&cpu_clean, 2, true)
            .unwrap()
            .1
            .is_pending()
    );
    backend.synchronize().unwrap();
}
