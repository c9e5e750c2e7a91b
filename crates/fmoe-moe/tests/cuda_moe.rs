//! The MoE layer on CUDA, both kernel families, against the f64 reference on the CPU, on fresh
//! seeded random data; fp8 checkpoints loading onto CUDA; bad input as errors. (The fp8 methods'
//! accuracy and the dispatch truth table on CUDA are in `cuda_moe_fp8.rs`.)
//!
//! Without a CUDA device every test prints "skipping: <reason>" and passes, unless
//! `FMOE_REQUIRE_CUDA=1`, which turns a skip into a failure. Every allocation is poisoned (0xFF
//! bytes: NaN in bf16/f32), so an output element no kernel wrote fails the finiteness check.
//!
//! Tolerance: relative 2-norm error ≤ 1e-2 against `moe_f64` over the same bf16 x, w13, w2 and
//! routing. The CUDA path rounds twice to bf16, each a relative error ≤ u = 2⁻⁸: the intermediate
//! h (GEMM1's epilogue writes bf16, GEMM2 reads it) and the output y (f32 → bf16). Products of
//! bf16 values are exact in f32 and the sums of lengths K and N accumulate in f32, adding
//! ≤ (K + N)·2⁻²⁴ (< 2e-4 for K + N ≤ 2048, worst case; √(K+N)·2⁻²⁴ typical); `__expf` in SiLU
//! is within 2 ulp of f32. Total ≤ 2·2⁻⁸ + 2e-4 ≈ 8.0e-3 < 1e-2. With a shared expert, y and the
//! shared output are each rounded to bf16 and their sum once more: 3·2⁻⁸ + 2e-4 ≈ 1.19e-2, so
//! that test allows 1.25e-2.

mod common;
use common::*;
use fmoe_core::cuda::test_backend_or_skip;
use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::moe_align::align_routes;
use fmoe_kernels::moe_gemm::CUDA_BLOCK_M;
use fmoe_kernels::nvrtc::trace_launches;
use fmoe_kernels::quant_fp8::{self, FP8_BLOCK};
use fmoe_kernels::routing::{TopK, topk_softmax};
use fmoe_moe::reference::{moe_f64, rel_err};
use fmoe_moe::stages::ExpertOperands;
use fmoe_moe::{CheckpointExperts, FusedMoe, KernelFamily, MoeConfig, QuantScheme};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const CUDA: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;
/// See the module docs.
const TOL: f64 = 1e-2;
const TOL_SHARED: f64 = 1.25e-2;

/// M = 0, 1, 7, 300; E = 1 and 256 (top-8, most experts without tokens at M = 7); top-k = E; N
/// not a multiple of the 64/128 tiles (72, 200, 1000); K with a ragged 32-wide K tile (136).
const SMALL: &[Case] = &[
    case(0, 8, 256, 128, 2),
    case(1, 8, 256, 128, 2),
    case(7, 1, 128, 200, 1),
    case(7, 4, 136, 72, 4),
    case(7, 256, 256, 128, 8),
    case(300, 8, 512, 1000, 2),
    case(300, 256, 256, 200, 8),
];

/// M = 2048 (also with E = 256, top-8) and M = 16384 on a smaller K/N; 128 routes per expert
/// with ragged N (half the experts in a second, mostly empty 128-row tile; SM90_MID's 64-row
/// tiles with FMOE_DEV_SM90_MID=on); a long GEMM2 reduction over few tiles (split-K).
const LARGE: &[Case] = &[
    case(2048, 8, 1024, 1000, 2),
    case(2048, 256, 256, 136, 8),
    case(16384, 8, 256, 128, 2),
    case(2048, 64, 256, 1000, 4),
    case(1024, 8, 256, 2048, 2),
];

/// Decode-sized batches (fewer than 16 routes per expert on average): the swap-AB kernel on
/// Hopper. M = 1..16; E = 1 (15 routes: one block of one expert), 4, 8, 16 and 256 (top-8: most
/// experts without routes); N = 72 (one ragged GEMM1 tile), 200, 1000 and 2056 (GEMM2's reduction
/// of 33 K steps of 64, the last ragged, split); K = 136 and 264 (a ragged last K step) and 1000
/// (GEMM2's output ragged past 3 tiles of 256).
const DECODE: &[Case] = &[
    case(1, 1, 136, 72, 1),
    case(1, 8, 256, 200, 2),
    case(2, 8, 1000, 2056, 2),
    case(2, 256, 264, 200, 8),
    case(7, 16, 136, 1000, 8),
    case(13, 4, 264, 72, 2),
    case(15, 1, 1000, 2056, 1),
    case(16, 256, 256, 136, 8),
];

fn gpu_layer(c: &Case, inp: &Inputs, family: KernelFamily) -> FusedMoe {
    let experts = CheckpointExperts::Dense {
        w13: inp.w13.to_device(CUDA).unwrap(),
        w2: inp.w2.to_device(CUDA).unwrap(),
    };
    let layer = FusedMoe::new(
        config(c),
        QuantScheme::Unquantized,
        experts,
        None,
        None,
        &switches(family),
        CUDA,
    )
    .unwrap();
    assert_eq!(layer.kernel().family, family);
    layer
}

/// Runs one case through both families with routing `topk` (on the device) and checks each against
/// the f64 reference and against each other.
fn check_case(what: &str, c: &Case, inp: &Inputs, topk: &TopK) {
    let x = inp.x.to_device(CUDA).unwrap();
    let want = moe_f64(
        &inp.x,
        &host_topk(topk),
        &ExpertOperands::unquantized(&inp.w13, &inp.w2),
    )
    .unwrap();
    let mut outs = Vec::new();
    for family in KernelFamily::ALL {
        let layer = gpu_layer(c, inp, family);
        let y = layer.forward_routed(&x, topk).unwrap();
        let got = checked_output(&y, c.m, c.k, &format!("{what} {family}"));
        let err = rel_err(&got, &want);
        println!("{what} {family:>8}: rel_err {err:.2e}");
        assert!(err <= TOL, "{what} {family}: rel_err {err:.3e} > {TOL:e}");
        outs.push(got);
    }
    let f: Vec<f64> = outs[1].iter().map(|&v| f64::from(v)).collect();
    let d = rel_err(&outs[0], &f);
    assert!(d <= TOL, "{what}: fused vs portable {d:.3e}");
}

/// The layer's own routing on the device (topk_softmax's CUDA twin); the reference uses the same
/// ids and weights, downloaded.
fn device_routing(c: &Case, inp: &Inputs) -> TopK {
    topk_softmax(&inp.logits.to_device(CUDA).unwrap(), c.top_k, true).unwrap()
}

fn run_cases(cases: &[Case], seed0: u64) {
    for (i, c) in cases.iter().enumerate() {
        let inp = inputs(c, seed0 + i as u64);
        check_case(&format!("{c:?}"), c, &inp, &device_routing(c, &inp));
    }
}

#[test]
fn small_shapes_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    run_cases(SMALL, 7000);
}

#[test]
fn large_shapes_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    run_cases(LARGE, 8000);
}

/// DeepSeek-V3-like routing with one 128-row block per expert (256 experts, 64 routes each on
/// average): the persistent kernel walks its tiles one M block at a time, both GEMMs.
#[test]
fn one_block_raster_layer_matches_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let c = case(2048, 256, 256, 136, 8);
    let inp = inputs(&c, 9500);
    let what = "one M block at a time";
    let ((), launches) = trace_launches(|| check_case(what, &c, &inp, &device_routing(&c, &inp)));
    assert_both_gemms_ran(what, &launches, "moe_gemm_bf16_sm90_pipe/", "RASTER_GM=1,");
}

/// Routes per expert around the edges of the prefill GEMM's 128-row tiles and of its two 64-row
/// warpgroup halves: 2, 64 (the second half all padding), 65 (one live row in it), 127, 128 (one
/// full tile), 129 and 192 (a second tile with 1 and 64 routes), 193: 112 per expert on average
/// over 8 experts, so uniform 128-row tiles; N = 2040 gives GEMM2 a split reduction with a ragged
/// last K tile.
#[test]
fn large_tile_edges_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let counts = [2usize, 64, 65, 127, 128, 129, 192, 193];
    tile_edges_case(&counts, 9100, &["BM=128"]);
}

/// The 192-row tiles' edges: 2, 64 and 65 (the first warpgroup's 64 rows full, one row for the
/// second), 128 and 130 (the third warpgroup empty, one row), 191, 192 (one full tile), 193 (a
/// second tile with one route), 300 (a second tile with 108); 129 per expert on average over 9
/// experts, in the uniform 192-row tiles' range.
#[test]
fn tall_tile_edges_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    tile_edges_case(
        &[2, 64, 65, 128, 130, 191, 192, 193, 300],
        9200,
        &["BM=192"],
    );
}

/// Mixed tile heights (222 routes per expert on average, 13 experts): 2, 64, 65 and 128 routes in
/// one 128-row block, 193, 385 and 599 in several, 130, 191 and 192 in one 192-row block, 257, 300
/// and 384 in two; both persistent kernels run, one launch per segment, into the same h and y.
#[test]
fn mixed_tile_edges_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    tile_edges_case(
        &[2, 64, 65, 128, 130, 191, 192, 193, 257, 300, 384, 385, 600],
        9300,
        &["BM=128", "BM=192"],
    );
}

/// One layer whose experts get exactly `counts` routes (top-2), checked against the f64 reference;
/// asserts the persistent pipe kernel ran with exactly `tiles` (both GEMMs).
fn tile_edges_case(counts: &[usize], seed: u64, tiles: &[&str]) {
    let routes: usize = counts.iter().sum();
    let c = case(routes / 2, counts.len(), 256, 2040, 2);
    let inp = inputs(&c, seed);
    // Expert ids in runs, token t taking runs[t] and runs[t + M]: two different experts per
    // token, as no expert has more than M routes.
    let runs: Vec<u32> = (0u32..)
        .zip(counts.iter().copied())
        .flat_map(|(e, n)| std::iter::repeat_n(e, n))
        .collect();
    assert!(counts.iter().all(|&n| n <= c.m));
    let ids: Vec<u32> = (0..c.m).flat_map(|t| [runs[t], runs[t + c.m]]).collect();
    let weights: Vec<f32> = (0..c.m)
        .flat_map(|t| [0.25 + (t % 7) as f32 * 0.1, 0.5])
        .collect();
    let topk = TopK {
        ids: Tensor::from_vec(ids, [c.m, 2], &CUDA).unwrap(),
        weights: Tensor::from_vec(weights, [c.m, 2], &CUDA).unwrap(),
    };
    let ((), launches) =
        trace_launches(|| check_case(&format!("{} tile edges", tiles.join("+")), &c, &inp, &topk));
    for bm in ["BM=64,", "BM=128,", "BM=192,"] {
        let ran = launches
            .iter()
            .any(|l| l.starts_with("moe_gemm_bf16_sm90_pipe/") && l.contains(bm));
        let want = tiles.iter().any(|t| bm.starts_with(&format!("{t},")));
        assert_eq!(
            ran, want,
            "{bm} prefill GEMM ran: {ran}, wanted {tiles:?}: {launches:?}"
        );
    }
    for tile in tiles {
        for mode in ["MODE=1", "MODE=2"] {
            assert!(
                launches
                    .iter()
                    .any(|l| l.starts_with("moe_gemm_bf16_sm90_pipe/")
                        && l.contains(&format!("{tile},"))
                        && l.contains(mode)),
                "the {tile} {mode} prefill GEMM did not run: {launches:?}"
            );
        }
    }
}

/// Both GEMMs of the fused forward ran the swap-AB kernel (on Hopper; elsewhere the 64-route
/// tiles run and there is nothing to check).
fn assert_swap_ab_ran(what: &str, launches: &[String]) {
    assert_both_gemms_ran(what, launches, "moe_gemm_bf16_swapab_sm90/", "");
}

/// Both GEMMs of the fused forward ran a kernel of `family` (the launch trace's prefix) compiled
/// with `define` (on Hopper; elsewhere the mma.sync kernels run and there is nothing to check).
fn assert_both_gemms_ran(what: &str, launches: &[String], family: &str, define: &str) {
    let hopper = fmoe_core::cuda::cuda_backend(0)
        .map(|b| b.compute_capability() == (9, 0))
        .unwrap_or(false);
    for mode in ["[MODE=1", "[MODE=2"] {
        assert!(
            !hopper
                || launches
                    .iter()
                    .any(|l| l.starts_with(family) && l.contains(mode) && l.contains(define)),
            "{what}: the {family} {mode}] GEMM with {define:?} did not run: {launches:?}"
        );
    }
}

#[test]
fn decode_layers_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    for (i, c) in DECODE.iter().enumerate() {
        let what = format!("{c:?}");
        let inp = inputs(c, 9500 + i as u64);
        let topk = topk_softmax(&inp.logits.to_device(CUDA).unwrap(), c.top_k, true).unwrap();
        let ((), launches) = trace_launches(|| check_case(&what, c, &inp, &topk));
        assert_swap_ab_ran(&what, &launches);
    }
    // 80 routes on the first 4 of 8 experts: 10 per expert on average, so swap-AB, but 20 on
    // each routed expert: two 16-route blocks (one full, one with 4 routes) share an expert's
    // weight tiles, and half the experts have no routes.
    let c = case(40, 8, 264, 200, 2);
    let inp = inputs(&c, 9600);
    let ids: Vec<u32> = (0..c.m as u32).flat_map(|t| [t % 4, (t + 1) % 4]).collect();
    let weights: Vec<f32> = (0..c.m)
        .flat_map(|t| [0.3 + (t % 5) as f32 * 0.1, 0.4])
        .collect();
    let topk = TopK {
        ids: Tensor::from_vec(ids, [c.m, 2], &CUDA).unwrap(),
        weights: Tensor::from_vec(weights, [c.m, 2], &CUDA).unwrap(),
    };
    let ((), launches) = trace_launches(|| check_case("two blocks per expert", &c, &inp, &topk));
    assert_swap_ab_ran("two blocks per expert", &launches);
}

#[test]
fn small_experts_without_tokens_and_forward_with_routing() {
    if test_backend_or_skip().is_none() {
        return;
    }
    // Only experts 1 and 6 of 8 receive routes (the first and last expert get none).
    let c = case(37, 8, 264, 200, 2);
    let inp = inputs(&c, 9000);
    let ids: Vec<u32> = (0..c.m * 2)
        .map(|r| if r % 2 == 0 { 1 } else { 6 })
        .collect();
    let weights: Vec<f32> = (0..c.m * 2)
        .map(|r| if r % 2 == 0 { 0.75 } else { 0.25 })
        .collect();
    let topk = TopK {
        ids: Tensor::from_vec(ids, [c.m, 2], &CUDA).unwrap(),
        weights: Tensor::from_vec(weights, [c.m, 2], &CUDA).unwrap(),
    };
    check_case("experts 1 and 6 only", &c, &inp, &topk);

    // forward() routes on the device itself: the same as routing first.
    let c = case(65, 8, 128, 96, 2);
    let inp = inputs(&c, 9001);
    let x = inp.x.to_device(CUDA).unwrap();
    let logits = inp.logits.to_device(CUDA).unwrap();
    let topk = host_topk(&topk_softmax(&logits, 2, true).unwrap());
    let want = moe_f64(
        &inp.x,
        &topk,
        &ExpertOperands::unquantized(&inp.w13, &inp.w2),
    )
    .unwrap();
    for family in KernelFamily::ALL {
        let y = gpu_layer(&c, &inp, family).forward(&x, &logits).unwrap();
        let err = rel_err(&y.to_f32_vec().unwrap(), &want);
        assert!(err <= TOL, "forward {family}: {err:.3e}");
    }
}

#[test]
fn small_shared_expert_is_added_on_the_device() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let c = case(19, 8, 128, 64, 2);
    let ns = 136;
    let inp = inputs(&c, 9100);
    let mut rng = ChaCha8Rng::seed_from_u64(9101);
    let sw13 = Tensor::from_f32(
        &randn(&mut rng, 2 * ns * c.k, 1.0 / (c.k as f32).sqrt()),
        [1, 2 * ns, c.k],
        DType::BF16,
        &CPU,
    )
    .unwrap();
    let sw2 = Tensor::from_f32(
        &randn(&mut rng, c.k * ns, 1.0 / (ns as f32).sqrt()),
        [1, c.k, ns],
        DType::BF16,
        &CPU,
    )
    .unwrap();
    let topk = topk_softmax(&inp.logits, 2, true).unwrap();
    let all = TopK {
        ids: Tensor::zeros([c.m, 1], DType::U32, &CPU).unwrap(),
        weights: Tensor::full([c.m, 1], DType::F32, 1.0, &CPU).unwrap(),
    };
    let routed = moe_f64(
        &inp.x,
        &topk,
        &ExpertOperands::unquantized(&inp.w13, &inp.w2),
    )
    .unwrap();
    let shared = moe_f64(&inp.x, &all, &ExpertOperands::unquantized(&sw13, &sw2)).unwrap();
    let want: Vec<f64> = routed.iter().zip(&shared).map(|(a, b)| a + b).collect();
    let cfg = MoeConfig {
        shared_intermediate: Some(ns),
        ..config(&c)
    };
    let x = inp.x.to_device(CUDA).unwrap();
    let gtopk = TopK {
        ids: topk.ids.to_device(CUDA).unwrap(),
        weights: topk.weights.to_device(CUDA).unwrap(),
    };
    for family in KernelFamily::ALL {
        // Host checkpoint tensors: FusedMoe::new moves them to the device.
        let layer = FusedMoe::new(
            cfg.clone(),
            QuantScheme::Unquantized,
            CheckpointExperts::Dense {
                w13: inp.w13.clone(),
                w2: inp.w2.clone(),
            },
            Some(CheckpointExperts::Dense {
                w13: sw13.clone(),
                w2: sw2.clone(),
            }),
            None,
            &switches(family),
            CUDA,
        )
        .unwrap();
        let y = layer.forward_routed(&x, &gtopk).unwrap();
        assert_eq!((y.device(), y.dtype()), (CUDA, DType::BF16));
        let got = y.to_f32_vec().unwrap();
        assert!(got.iter().all(|v| v.is_finite()), "{family}");
        let err = rel_err(&got, &want);
        println!("shared expert {family}: rel_err {err:.2e}");
        assert!(err <= TOL_SHARED, "shared {family}: {err:.3e}");
    }
}

/// fp8 checkpoints (quantized on the host) for the fp8 schemes, dense bf16 for unquantized.
fn experts_for(scheme: QuantScheme, w13: &Tensor, w2: &Tensor) -> CheckpointExperts {
    match scheme {
        QuantScheme::Unquantized => CheckpointExperts::Dense {
            w13: w13.clone(),
            w2: w2.clone(),
        },
        QuantScheme::Fp8PerTensor => {
            let per = |w: &Tensor| {
                let (mut q, mut s) = (Vec::new(), Vec::new());
                for e in 0..w.dims()[0] {
                    let (qe, se) = quant_fp8::quantize_per_tensor(&w.index0(e).unwrap()).unwrap();
                    q.push(qe);
                    s.extend(se.to_f32_vec().unwrap());
                }
                let n = s.len();
                (
                    Tensor::stack0(&q).unwrap(),
                    Tensor::from_vec(s, [n], &CPU).unwrap(),
                )
            };
            let ((q13, s13), (q2, s2)) = (per(w13), per(w2));
            CheckpointExperts::Fp8PerTensor {
                w13: q13,
                w13_scale: s13,
                w2: q2,
                w2_scale: s2,
            }
        }
        QuantScheme::Fp8Block => {
            let (q13, s13) = quant_fp8::quantize_block(w13, FP8_BLOCK).unwrap();
            let (q2, s2) = quant_fp8::quantize_block(w2, FP8_BLOCK).unwrap();
            CheckpointExperts::Fp8Block {
                w13: q13,
                w13_scale_inv: s13,
                w2: q2,
                w2_scale_inv: s2,
            }
        }
    }
}

/// fp8 checkpoints made on the host (per-tensor with separate w1/w3 scales, merged at load; block)
/// load onto CUDA and run in both families; the dispatch truth table and the fp8 accuracy are
/// `cuda_moe_fp8.rs`'s.
#[test]
fn small_fp8_checkpoints_load_and_run_on_cuda() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let c = case(5, 4, 128, 64, 2);
    let inp = inputs(&c, 9200);
    let x = inp.x.to_device(CUDA).unwrap();
    let topk = topk_softmax(&inp.logits.to_device(CUDA).unwrap(), c.top_k, true).unwrap();
    let htopk = host_topk(&topk);
    for scheme in [QuantScheme::Fp8PerTensor, QuantScheme::Fp8Block] {
        let mut experts = experts_for(scheme, &inp.w13, &inp.w2);
        if let CheckpointExperts::Fp8PerTensor { w13_scale, .. } = &mut experts {
            // Separate w1/w3 scales ([E, 2]): the method requantizes both halves to their max.
            let s = w13_scale.to_f32_vec().unwrap();
            let two: Vec<f32> = s.iter().flat_map(|&v| [v, v * 0.75]).collect();
            *w13_scale = Tensor::from_vec(two, [c.e, 2], &CPU).unwrap();
        }
        for family in KernelFamily::ALL {
            let what = format!("{scheme} {family}");
            let layer = FusedMoe::new(
                config(&c),
                scheme,
                experts.clone(),
                None,
                None,
                &switches(family),
                CUDA,
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let ops = layer.method().operands().unwrap();
            assert_eq!(ops.w13.data().device(), CUDA, "{what}");
            let y = layer.forward_routed(&x, &topk).unwrap();
            let got = y.to_f32_vec().unwrap();
            assert!(got.iter().all(|v| v.is_finite()), "{what}");
            let ops = ops.to_device(CPU).unwrap();
            let h_dtype = (scheme == QuantScheme::Fp8PerTensor).then_some(DType::BF16);
            let want =
                fmoe_moe::reference::moe_f64_h_rounded(&inp.x, &htopk, &ops, h_dtype).unwrap();
            let err = rel_err(&got, &want);
            println!("fp8 checkpoint {what}: rel_err {err:.2e}");
            assert!(err <= TOL, "{what}: {err:.3e}");
        }
    }
}

#[test]
fn small_bad_input_on_cuda_is_an_error_not_a_panic() {
    if test_backend_or_skip().is_none() {
        return;
    }
    // K not a multiple of 8: the CUDA GEMM's contract, naming the dimension.
    let c = case(3, 4, 100, 64, 2);
    let inp = inputs(&c, 9300);
    let x = inp.x.to_device(CUDA).unwrap();
    let logits = inp.logits.to_device(CUDA).unwrap();
    for family in KernelFamily::ALL {
        let err = gpu_layer(&c, &inp, family)
            .forward(&x, &logits)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("K (hidden size") && err.contains("multiple of 8"),
            "{family}: {err}"
        );
    }
    // f16 weights: no CUDA kernel yet.
    let c = case(3, 4, 64, 64, 2);
    let inp = inputs(&c, 9301);
    let x = inp.x.to_device(CUDA).unwrap();
    let experts = CheckpointExperts::Dense {
        w13: inp.w13.to_dtype(DType::F16).unwrap(),
        w2: inp.w2.to_dtype(DType::F16).unwrap(),
    };
    let layer = FusedMoe::new(
        config(&c),
        QuantScheme::Unquantized,
        experts,
        None,
        None,
        &switches(KernelFamily::Fused),
        CUDA,
    )
    .unwrap();
    let topk = topk_softmax(&inp.logits.to_device(CUDA).unwrap(), 2, true).unwrap();
    let err = layer.forward_routed(&x, &topk).unwrap_err().to_string();
    assert!(err.contains("f16") && err.contains("bf16"), "{err}");
    // Input on the wrong device.
    let err = layer.forward_routed(&inp.x, &topk).unwrap_err().to_string();
    assert!(err.contains("hidden_states"), "{err}");
    // Out-of-range expert ids: not checked on the hot path (no synchronization); the aligned
    // routes' check() reports them, and the layer's output stays finite (the route is dropped).
    let ids = Tensor::from_vec(vec![0u32, 1, 2, 7, 3, 0], [3, 2], &CUDA).unwrap();
    let bad = TopK {
        ids: ids.clone(),
        weights: Tensor::full([3, 2], DType::F32, 0.5, &CUDA).unwrap(),
    };
    for family in KernelFamily::ALL {
        let y = gpu_layer(&c, &inp, family)
            .forward_routed(&x, &bad)
            .unwrap();
        assert!(y.to_f32_vec().unwrap().iter().all(|v| v.is_finite()));
    }
    let err = align_routes(&ids, 4, CUDA_BLOCK_M)
        .unwrap()
        .check()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("expert id 7") && err.contains("4 experts"),
        "{err}"
    );
}
