//! The fp8 MoE methods on CUDA (fp8-tensor, fp8-block) × both kernel families, against the f64
//! reference on the CPU, on fresh seeded random data with poisoned device allocations.
//!
//! Each layer is built from dense bf16 weights on the device, so the online quantization runs on
//! the GPU too (`quant_fp8`'s CUDA twin, bit-exact with the CPU's); the references read that
//! layer's processed operands, downloaded.
//!
//! Without a CUDA device every test prints "skipping: <reason>" and passes, unless
//! `FMOE_REQUIRE_CUDA=1`, which turns a skip into a failure.
//!
//! Tolerances (relative 2-norm error):
//! - `same` ≤ 1e-2: vs `moe_f64` over the same quantized operands (the layer's e4m3 weights and
//!   scales; a1 quantized by the same bit-exact rule). What remains is the GPU's arithmetic:
//!   tensor-core fp8 products are exact, their accumulation keeps fewer bits than f32 (measured
//!   ~2e-4 with per-128 promotion, ~2e-3 without at K = 4096-7168, less at these K ≤ 1040); h is
//!   requantized, and where the GPU's h and the reference's straddle an e4m3 rounding boundary a
//!   code moves one step (2⁻³ relative): for an h perturbation of relative size δ that adds about
//!   5·δ^½·1e-1 (simulated: δ = 2e-4 → 3e-3, δ = 1e-3 → 7e-3); y is rounded to bf16 (2⁻⁹). For
//!   fp8-tensor the reference rounds h to bf16 before requantizing (`moe_f64_h_rounded`), as the
//!   CUDA kernel does: the GPU quantizes the bf16 h its GEMM1 writes, while the CPU twin
//!   quantizes f32 h. Against the f32-h reference (`f32h`, printed, bound 3e-2) that double
//!   rounding alone moves about 1/32 of the codes by one step and shifts the scale: 1.1-1.4e-2
//!   simulated on random data.
//! - `quant` ≤ 0.27: vs the unquantized f64 reference (bf16 weights and activations as given):
//!   four e4m3 roundings (a1, w13, a2, w2), each ≤ 2⁻⁴ relative, (1 + 2⁻⁴)⁴ − 1 ≈ 0.27 worst case;
//!   typically ≈ 6.5e-2.

mod common;
use common::*;
use fmoe_core::cuda::test_backend_or_skip;
use fmoe_core::env::FusedSwitches;
use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::nvrtc::trace_launches;
use fmoe_kernels::routing::topk_softmax;
use fmoe_moe::reference::{moe_f64, moe_f64_h_rounded, rel_err};
use fmoe_moe::stages::ExpertOperands;
use fmoe_moe::{CheckpointExperts, FusedMoe, KernelFamily, QuantScheme};

const CUDA: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;
const TOL_SAME: f64 = 1e-2;
const TOL_F32H: f64 = 3e-2;
const TOL_QUANT: f64 = 0.27;
const FP8: [QuantScheme; 2] = [QuantScheme::Fp8PerTensor, QuantScheme::Fp8Block];

/// M = 0, 1, 33, 300; E = 1 and 256 (top-8, most experts without tokens); top-k = E; K and N
/// multiples of 16 but not of 128 (ragged last K blocks, 1×128 groups and N tiles).
const SMALL: &[Case] = &[
    case(0, 8, 256, 128, 2),
    case(1, 8, 256, 128, 2),
    case(1, 256, 384, 272, 8),
    case(33, 1, 144, 80, 1),
    case(33, 4, 272, 208, 4),
    case(33, 256, 512, 144, 8),
    case(300, 8, 1040, 1008, 2),
];

/// M = 2048: the large (warp-specialized) variants of both schemes (≥ 128 routes per expert:
/// E = 8 and 16; ragged K = 1040 and N = 1008, N = 384 not a multiple of 256), E = 256 top-8
/// (small tiles).
const LARGE: &[Case] = &[
    case(2048, 8, 1040, 1008, 2),
    case(2048, 16, 512, 384, 4),
    case(2048, 256, 400, 144, 8),
];

/// Large variants at their edges: exactly 128 routes per expert with GEMM2's reduction
/// N = 2064 split over 4 K ranges (17 K blocks, the last ragged; N % 128 = 16, so GEMM1's up rows
/// straddle two weight blocks); with [`skewed`] routing, 2048 routes on 16 experts of which
/// only the first 8 get any (ragged N = 400, K = 384: GEMM2's second N tile half past K); and
/// for the persistent schedule, GEMM1 with one K step per tile and ~4 tiles per block (K = 128,
/// 16 N tiles × 36 M blocks on 132 SMs: the ring wraps inside and across tiles, M blocks past
/// the routes' total are claimed and skipped) and GEMM2 split over 4 K ranges of one N tile.
const LARGE_EDGES: &[(Case, bool)] = &[
    (case(1024, 8, 256, 2064, 1), false),
    (case(1024, 16, 384, 400, 2), true),
    (case(2048, 4, 128, 2048, 2), false),
];

/// Decode-sized batches (fewer than 16 routes per expert on average): the swap-AB kernels of both
/// schemes. M = 1..16; E = 1 (one expert, 15 routes: one full block), E = 256 top-8 (most experts
/// without routes); N = 80 and 144 (one ragged GEMM1 N tile), N = 1040 (N % 128 = 16: the up rows
/// straddle two weight blocks) and 2064 (GEMM2 reduction of 17 K blocks, split); K = 144, 272 and
/// 400 (ragged last K block) and 1040 (GEMM2's output ragged past 4 tiles of 256).
const SWAPAB: &[Case] = &[
    case(1, 1, 144, 80, 1),
    case(1, 8, 256, 208, 2),
    case(2, 256, 384, 272, 8),
    case(7, 16, 272, 1040, 8),
    case(13, 4, 400, 144, 2),
    case(15, 1, 1040, 2064, 1),
    case(16, 256, 512, 144, 8),
];

/// Routing logits that send every token to the first half of the experts (the others get no
/// routes), keeping the average per expert for the variant choice.
fn skewed(c: &Case, mut inp: Inputs) -> Inputs {
    let mut l = inp.logits.to_f32_vec().unwrap();
    for (i, v) in l.iter_mut().enumerate() {
        if i % c.e >= c.e / 2 {
            *v -= 30.0;
        }
    }
    inp.logits = Tensor::from_vec(l, [c.m, c.e], &CPU).unwrap();
    inp
}

/// A layer of `scheme` on CUDA from dense bf16 device weights (quantized on the device).
fn gpu_layer(
    c: &Case,
    inp: &Inputs,
    scheme: QuantScheme,
    sw: &FusedSwitches,
) -> fmoe_moe::Result<FusedMoe> {
    let experts = CheckpointExperts::Dense {
        w13: inp.w13.to_device(CUDA).unwrap(),
        w2: inp.w2.to_device(CUDA).unwrap(),
    };
    FusedMoe::new(config(c), scheme, experts, None, None, sw, CUDA)
}

/// Runs one case through both fp8 methods × both families and checks each against the references.
fn check_case(what: &str, c: &Case, inp: &Inputs) {
    let x = inp.x.to_device(CUDA).unwrap();
    let topk = topk_softmax(&inp.logits.to_device(CUDA).unwrap(), c.top_k, true).unwrap();
    let htopk = host_topk(&topk);
    let exact = moe_f64(
        &inp.x,
        &htopk,
        &ExpertOperands::unquantized(&inp.w13, &inp.w2),
    )
    .unwrap();
    for scheme in FP8 {
        let layers: Vec<FusedMoe> = KernelFamily::ALL
            .iter()
            .map(|&f| gpu_layer(c, inp, scheme, &switches(f)).unwrap())
            .collect();
        // The same operands: the fused layer's processed weights, downloaded (both layers quantize
        // the same bf16 weights with the same deterministic kernels).
        let ops = layers[0]
            .method()
            .operands()
            .unwrap()
            .to_device(CPU)
            .unwrap();
        let ops_p = layers[1]
            .method()
            .operands()
            .unwrap()
            .to_device(CPU)
            .unwrap();
        assert_eq!(
            ops.w13.data().to_f32_vec().unwrap(),
            ops_p.w13.data().to_f32_vec().unwrap(),
            "{what} {scheme}: both layers quantize alike"
        );
        let f32h = moe_f64(&inp.x, &htopk, &ops).unwrap();
        let same = match scheme {
            QuantScheme::Fp8PerTensor => {
                moe_f64_h_rounded(&inp.x, &htopk, &ops, Some(DType::BF16)).unwrap()
            }
            _ => f32h.clone(),
        };
        let mut outs = Vec::new();
        for layer in &layers {
            let family = layer.kernel().family;
            let (y, check) = layer.forward_routed_deferred(&x, &topk).unwrap();
            check.check().unwrap();
            let got = checked_output(&y, c.m, c.k, &format!("{what} {scheme} {family}"));
            let (e_same, e_f32h, e_quant) = (
                rel_err(&got, &same),
                rel_err(&got, &f32h),
                rel_err(&got, &exact),
            );
            println!(
                "{what} {scheme:>10} {family:>8}: same {e_same:.2e}, f32h {e_f32h:.2e}, quant \
                 {e_quant:.2e}"
            );
            if c.m > 0 {
                assert!(
                    e_same <= TOL_SAME,
                    "{what} {scheme} {family}: same {e_same:.3e}"
                );
                assert!(
                    e_f32h <= TOL_F32H,
                    "{what} {scheme} {family}: f32h {e_f32h:.3e}"
                );
                assert!(
                    e_quant <= TOL_QUANT,
                    "{what} {scheme} {family}: quant {e_quant:.3e}"
                );
            }
            outs.push(got);
        }
        let p: Vec<f64> = outs[1].iter().map(|&v| f64::from(v)).collect();
        let d = rel_err(&outs[0], &p);
        println!("{what} {scheme:>10}: fused vs portable {d:.2e}");
        assert!(
            d <= 2.0 * TOL_SAME,
            "{what} {scheme}: fused vs portable {d:.3e}"
        );
    }
}

fn run_cases(cases: &[Case], seed0: u64) {
    for (i, c) in cases.iter().enumerate() {
        check_case(&format!("{c:?}"), c, &inputs(c, seed0 + i as u64));
    }
}

#[test]
fn small_fp8_layers_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    run_cases(SMALL, 17_000);
}

#[test]
fn large_fp8_layers_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    run_cases(LARGE, 18_000);
}

#[test]
fn large_fp8_layers_at_the_edges_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    for (i, (c, skew)) in LARGE_EDGES.iter().enumerate() {
        let inp = inputs(c, 18_500 + i as u64);
        let inp = if *skew { skewed(c, inp) } else { inp };
        check_case(&format!("{c:?} skewed={skew}"), c, &inp);
    }
}

/// Routes per expert around the edges of the prefill GEMMs' 128-row tiles and of their two 64-row
/// warpgroup halves, as `cuda_moe.rs` `large_tile_edges…` for bf16: 2, 64 (rows 64..127 all
/// padding), 65 (one live row there), 127, 128, 129 and 192 (a second tile with 1 and 64
/// routes), 193; 112 per expert on average, so the warp-specialized kernels run for both schemes. N = 2064 (N % 128 = 16: GEMM1's up rows straddle two weight
/// blocks; GEMM2's reduction over 17 K blocks).
/// DeepSeek-V3-like routing with one 128-row block per expert (256 experts, 64 routes each on
/// average): both warp-specialized kernels walk their tiles one M block at a time.
#[test]
fn one_block_raster_fp8_layer_matches_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let c = case(2048, 256, 400, 144, 8);
    let ((), launches) =
        trace_launches(|| check_case("one M block at a time", &c, &inputs(&c, 19_900)));
    for entry in ["fmoe_moe_gemm_fp8", "fmoe_moe_gemm_fp8_block"] {
        for mode in ["[MODE=1,", "[MODE=2,"] {
            let name = format!("moe_gemm_fp8_sm90_ws/{entry}{mode}");
            assert!(
                launches
                    .iter()
                    .any(|l| l.starts_with(&name) && l.contains("RASTER_GM=1,")),
                "{entry} {mode} did not walk one M block at a time: {launches:?}"
            );
        }
    }
}

#[test]
fn large_fp8_tile_edges_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let counts = [2usize, 64, 65, 127, 128, 129, 192, 193];
    let routes: usize = counts.iter().sum();
    let c = case(routes / 2, counts.len(), 256, 2064, 2);
    let mut inp = inputs(&c, 18_700);
    // Token t's two largest logits on experts runs[t] and runs[t + M] (different, as no expert
    // has more than M routes), so the softmax top-2 routes exactly `counts` to the experts.
    let runs: Vec<usize> = counts
        .iter()
        .enumerate()
        .flat_map(|(e, &n)| std::iter::repeat_n(e, n))
        .collect();
    assert!(counts.iter().all(|&n| n <= c.m));
    let mut logits = inp.logits.to_f32_vec().unwrap();
    for t in 0..c.m {
        logits[t * c.e + runs[t]] += 8.0;
        logits[t * c.e + runs[t + c.m]] += 7.0;
    }
    inp.logits = Tensor::from_vec(logits, [c.m, c.e], &CPU).unwrap();
    let ((), launches) = trace_launches(|| check_case("128-row tile edges", &c, &inp));
    for entry in ["fmoe_moe_gemm_fp8", "fmoe_moe_gemm_fp8_block"] {
        let name = format!("moe_gemm_fp8_sm90_ws/{entry}[");
        assert!(
            launches.iter().any(|l| l.starts_with(&name)),
            "the warp-specialized {entry} GEMM did not run: {launches:?}"
        );
    }
}

#[test]
fn decode_fp8_layers_match_the_f64_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    run_cases(SWAPAB, 20_000);
    // Skewed: 80 routes on the first 4 of 8 experts (10 per expert on average, so swap-AB, but
    // about 20 on each routed expert: two 16-route blocks share an expert's weight tiles).
    let c = case(40, 8, 256, 208, 2);
    check_case(
        &format!("{c:?} skewed"),
        &c,
        &skewed(&c, inputs(&c, 20_100)),
    );
}

/// One large layer (both schemes' warp-specialized kernels, split-K GEMM2, ragged tiles) for
/// `compute-sanitizer --tool memcheck`.
#[test]
fn sanitizer_large_fp8_layer() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let c = case(1024, 8, 144, 1040, 1);
    check_case(&format!("{c:?}"), &c, &inputs(&c, 19_500));
}

/// A few tiny layers for `compute-sanitizer --tool memcheck` (every kernel of both methods and
/// families, ragged tiles, experts without tokens).
#[test]
fn sanitizer_tiny_fp8_layers() {
    if test_backend_or_skip().is_none() {
        return;
    }
    run_cases(
        &[
            case(5, 1, 144, 80, 1),
            case(33, 4, 272, 208, 4),
            case(3, 256, 128, 144, 8),
            case(7, 16, 272, 1040, 8),
            case(15, 1, 1040, 2064, 1),
        ],
        19_000,
    );
}

#[test]
fn non_finite_input_reaches_the_deferred_check_not_a_synchronization() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let c = case(9, 4, 256, 128, 2);
    let inp = inputs(&c, 19_500);
    let mut v = inp.x.to_f32_vec().unwrap();
    v[3 * c.k + 5] = f32::INFINITY;
    let x = Tensor::from_f32(&v, [c.m, c.k], DType::BF16, &CUDA).unwrap();
    let topk = topk_softmax(&inp.logits.to_device(CUDA).unwrap(), c.top_k, true).unwrap();
    for scheme in FP8 {
        for family in KernelFamily::ALL {
            let layer = gpu_layer(&c, &inp, scheme, &switches(family)).unwrap();
            // forward_routed neither waits nor fails; the deferred check reports the input.
            layer.forward_routed(&x, &topk).unwrap();
            let (_, check) = layer.forward_routed_deferred(&x, &topk).unwrap();
            let err = check.check().unwrap_err().to_string();
            assert!(
                err.contains("non-finite") || err.contains("NaN or Inf") || err.contains("inf"),
                "{scheme} {family}: {err}"
            );
            assert!(
                err.contains(&format!("{}", 3 * c.k + 5)),
                "{scheme} {family}: {err}"
            );
        }
    }
}

/// The kernels a forward launches, summarized: (fused GEMM1 with its epilogue seen, portable glue
/// seen, the grouped GEMM families seen).
fn launched(trace: &[String]) -> (bool, bool, Vec<&'static str>) {
    let fused = trace.iter().any(|t| t.contains("[MODE=1"));
    let portable = trace.iter().any(|t| t.starts_with("moe_unfused/"));
    let families = [
        "moe_gemm_bf16/",
        "moe_gemm_bf16_sm90/",
        "moe_gemm_bf16_swapab_sm90/",
        "moe_gemm_fp8_sm90/",
        "moe_gemm_fp8_block_sm90/",
        "moe_gemm_fp8_swapab_sm90/",
    ]
    .into_iter()
    .filter(|f| trace.iter().any(|t| t.starts_with(f)))
    .collect();
    (fused, portable, families)
}

#[test]
fn dispatch_truth_table_holds_on_cuda_per_scheme() {
    if test_backend_or_skip().is_none() {
        return;
    }
    // 10 routes on 4 experts: every scheme runs a swap-AB decode kernel (the fp8 ones an entry per
    // scheme; bf16 its own family, under the "moe_gemm_bf16" prefix checked here).
    let c = case(5, 4, 128, 64, 2);
    let inp = inputs(&c, 19_600);
    let x = inp.x.to_device(CUDA).unwrap();
    let logits = inp.logits.to_device(CUDA).unwrap();
    let gemm_family = |scheme: QuantScheme| match scheme {
        QuantScheme::Unquantized => "moe_gemm_bf16",
        QuantScheme::Fp8PerTensor | QuantScheme::Fp8Block => "moe_gemm_fp8_swapab_sm90/",
    };
    let gemm_entry = |scheme: QuantScheme| match scheme {
        QuantScheme::Unquantized => "",
        QuantScheme::Fp8PerTensor => "/fmoe_moe_gemm_fp8[",
        QuantScheme::Fp8Block => "/fmoe_moe_gemm_fp8_block[",
    };
    let bools = [false, true];
    for use_fused in bools {
        for use_fused_moe in bools {
            for block in bools {
                let sw = FusedSwitches {
                    use_fused,
                    use_fused_moe,
                    use_fused_fp8_block_scaled_moe: block,
                };
                for scheme in QuantScheme::ALL {
                    // The documented cascade, written out independently of `dispatch`.
                    let fused =
                        use_fused && use_fused_moe && (scheme != QuantScheme::Fp8Block || block);
                    let want = if fused {
                        KernelFamily::Fused
                    } else {
                        KernelFamily::Portable
                    };
                    let what = format!("{sw:?} {scheme}");
                    let layer =
                        gpu_layer(&c, &inp, scheme, &sw).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(layer.kernel().family, want, "{what}");
                    let (y, trace) = trace_launches(|| layer.forward(&x, &logits));
                    let y = y.unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(y.dims(), &[c.m, c.k]);
                    assert!(
                        y.to_f32_vec().unwrap().iter().all(|v| v.is_finite()),
                        "{what}"
                    );
                    let (saw_fused, saw_portable, gemms) = launched(&trace);
                    assert_eq!(
                        (saw_fused, saw_portable),
                        (fused, !fused),
                        "{what}: launched {trace:?}"
                    );
                    assert!(
                        gemms.len() == 1 && gemms[0].starts_with(gemm_family(scheme)),
                        "{what}: grouped GEMMs {gemms:?} in {trace:?}"
                    );
                    assert!(
                        trace.iter().any(|t| t.contains(gemm_entry(scheme))),
                        "{what}: entry {} not in {trace:?}",
                        gemm_entry(scheme)
                    );
                }
            }
        }
    }
}
