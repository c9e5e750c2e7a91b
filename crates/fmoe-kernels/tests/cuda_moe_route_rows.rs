//! GEMM2 with per-route rows and their top-k sum (`moe_gemm::gemm2_weighted_sum_to` with
//! `Gemm2Sum::RouteRows`, `moe_gemm::sum_route_rows`) on CUDA, against the CPU twins.
//!
//! Without a CUDA device every test prints "skipping: <reason>" and passes, unless
//! `FMOE_REQUIRE_CUDA=1`, which turns a skip into a failure. Allocations are poisoned (0xFF), so
//! a row or output element no kernel wrote shows up as NaN.

use fmoe_core::cuda::test_backend_or_skip;
use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::moe_align::align_routes;
use fmoe_kernels::moe_gemm::{self, ActOperand, ActQuant, Gemm2Sum, WeightOperand};
use fmoe_kernels::nvrtc::trace_launches;
use fmoe_kernels::quant_fp8;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;
use common::{hopper_or_skip, randn, rel};

const CUDA: Device = Device::Cuda(0);

/// The finalize kernel against its CPU twin, bit for bit (same f32 additions in the same order,
/// one rounding): top_k = 1, 2, 8, bf16 and f32 out, some routes with an out-of-range expert id
/// (left out on both), ragged M, and an f64 sum in the test as the independent check.
#[test]
fn sum_route_rows_matches_its_cpu_twin() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0xf1a);
    let e = 16usize;
    for (m, top_k, k) in [
        (1usize, 1usize, 8usize),
        (37, 2, 200),
        (300, 8, 7168 / 4),
        (5, 8, 16),
    ] {
        let rows = randn(&mut rng, m * top_k * k, 1.0);
        let rows = Tensor::from_f32(&rows, [m * top_k, k], DType::BF16, &Device::Cpu).unwrap();
        // One route in 7 has an id past the experts (dropped by the alignment: adds nothing).
        let ids: Vec<u32> = (0..m * top_k)
            .map(|_| {
                if rng.random_range(0..7) == 0 {
                    e as u32 + 3
                } else {
                    rng.random_range(0..e) as u32
                }
            })
            .collect();
        let ids = Tensor::from_vec(ids.clone(), [m, top_k], &Device::Cpu).unwrap();
        let (rv, iv) = (
            rows.to_f32_vec().unwrap(),
            ids.cpu_slice::<u32>("test", "ids").unwrap().to_vec(),
        );
        let mut want64 = vec![0.0f64; m * k];
        for t in 0..m {
            for j in 0..top_k {
                let r = t * top_k + j;
                if (iv[r] as usize) < e {
                    for c in 0..k {
                        want64[t * k + c] += f64::from(rv[r * k + c]);
                    }
                }
            }
        }
        let want64: Vec<f32> = want64.iter().map(|&v| v as f32).collect();
        let (rg, ig) = (rows.to_device(CUDA).unwrap(), ids.to_device(CUDA).unwrap());
        for out in [DType::BF16, DType::F32] {
            let what = format!("M={m} top_k={top_k} K={k} {out:?}");
            let cpu = moe_gemm::sum_route_rows(&rows, &ids, e, out).unwrap();
            let gpu = moe_gemm::sum_route_rows(&rg, &ig, e, out).unwrap();
            assert_eq!(
                (gpu.device(), gpu.dims(), gpu.dtype()),
                (CUDA, &[m, k][..], out)
            );
            let (c, g) = (cpu.to_f32_vec().unwrap(), gpu.to_f32_vec().unwrap());
            assert!(g.iter().all(|v| v.is_finite()), "{what}: unwritten y");
            let same = c.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: GPU differs from the CPU twin");
            // f32 sums of ≤ 8 bf16 terms: within f32 rounding of the f64 sum (bf16 out: its ulp).
            let tol = if out == DType::BF16 { 4e-3 } else { 1e-6 };
            let err = rel(&c, &want64);
            assert!(err <= tol, "{what}: {err:.3e} vs the f64 sum");
        }
    }
    // K not a multiple of 8 on CUDA is a clear error.
    let rows = Tensor::zeros([4, 12], DType::BF16, &CUDA).unwrap();
    let ids = Tensor::zeros([2, 2], DType::U32, &CUDA).unwrap();
    let err = moe_gemm::sum_route_rows(&rows, &ids, 4, DType::BF16)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("multiple of 8") && err.contains("sum_route_rows"),
        "{err}"
    );
}

/// Expert operands of one method, on the CPU.
fn operands(
    method: &str,
    w13: &Tensor,
    w2: &Tensor,
    e: usize,
) -> (ActQuant, WeightOperand, WeightOperand) {
    let per_tensor = |w: &Tensor| {
        let (q, s) = quant_fp8::quantize_per_tensor(w).unwrap();
        let s = s.to_f32_vec().unwrap()[0];
        let scales: Vec<f32> = (0..e).map(|i| s * (1.0 + (i % 8) as f32 / 8.0)).collect();
        WeightOperand::Fp8PerTensor {
            q,
            scales: Tensor::from_vec(scales, [e], &Device::Cpu).unwrap(),
        }
    };
    let block = |w: &Tensor| {
        let (q, scale_inv) = quant_fp8::quantize_block(w, [128, 128]).unwrap();
        WeightOperand::Fp8Block { q, scale_inv }
    };
    match method {
        "bf16" => (
            ActQuant::None,
            WeightOperand::Plain(w13.clone()),
            WeightOperand::Plain(w2.clone()),
        ),
        "fp8-tensor" => (ActQuant::Fp8PerTensor, per_tensor(w13), per_tensor(w2)),
        _ => (ActQuant::Fp8Group, block(w13), block(w2)),
    }
}

/// GEMM2 through per-route rows (forced with `Gemm2Sum::RouteRows`; routes aligned to 128, the
/// persistent prefill kernels) against the CPU twin on the same operands, for bf16, fp8
/// per-tensor and fp8 block-scaled: top_k = 1, 2 and 8, tokens whose top_k experts repeat (E = 4,
/// top_k = 8), E = 256 with sparse routing, ragged K = 208 (GEMM2's output inside one 256-wide
/// tile), N = 256 (one K split). The launch trace shows the route-rows GEMM2 and the finalize ran;
/// `Gemm2Sum::Atomic` on the same operands is the old path, compared too. N = 1040 is split over
/// K, where the request falls back to the reductions (and stays right).
#[test]
fn route_rows_gemm2_matches_the_cpu_twin() {
    if !hopper_or_skip("the route-rows GEMM2") {
        return;
    }
    let cpu = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(0x5e7);
    let k = 208usize;
    // (E, top_k, M, N, routed experts)
    let cases = [
        (8usize, 2usize, 600usize, 256usize, 8usize),
        (8, 1, 333, 256, 8),
        (4, 8, 100, 256, 4),
        (256, 8, 300, 256, 256),
        (8, 2, 200, 1040, 4),
    ];
    for (e, top_k, m, n, routed) in cases {
        let w13f = randn(&mut rng, e * 2 * n * k, 1.0 / (k as f32).sqrt());
        let w2f = randn(&mut rng, e * k * n, 1.0 / (n as f32).sqrt());
        let w13 = Tensor::from_f32(&w13f, [e, 2 * n, k], DType::BF16, &cpu).unwrap();
        let w2 = Tensor::from_f32(&w2f, [e, k, n], DType::BF16, &cpu).unwrap();
        let x = Tensor::from_f32(&randn(&mut rng, m * k, 1.0), [m, k], DType::BF16, &cpu).unwrap();
        let ids: Vec<u32> = (0..m * top_k)
            .map(|_| rng.random_range(0..routed) as u32)
            .collect();
        let ids = Tensor::from_vec(ids, [m, top_k], &cpu).unwrap();
        let tw: Vec<f32> = (0..m * top_k).map(|_| rng.random_range(0.1..1.0)).collect();
        let tw = Tensor::from_vec(tw, [m, top_k], &cpu).unwrap();
        let (idsg, twg) = (ids.to_device(CUDA).unwrap(), tw.to_device(CUDA).unwrap());
        for method in ["bf16", "fp8-tensor", "fp8-block"] {
            let (quant, w13q, w2q) = operands(method, &w13, &w2, e);
            let a = ActOperand::quantize(&x, quant).unwrap();
            // The CPU twin: GEMM1 (f32 h, quantized as the method says), GEMM2 in f32.
            let routes = align_routes(&ids, e, 16).unwrap();
            let (h_cpu, _) =
                moe_gemm::gemm1_silu_mul_quant(&a, &routes, top_k, &w13q, quant).unwrap();
            // The same h on both sides, so the comparison is GEMM2's alone: the GPU's own h for
            // bf16 (its h is bf16; the CPU's f32), the CPU's quantized h for fp8.
            let ag = a.to_device(CUDA).unwrap();
            let (w13g, w2g) = (w13q.to_device(CUDA).unwrap(), w2q.to_device(CUDA).unwrap());
            let routes_g = align_routes(&idsg, e, 128).unwrap();
            let h_g = if quant == ActQuant::None {
                let (h, _) =
                    moe_gemm::gemm1_silu_mul_quant(&ag, &routes_g, top_k, &w13g, quant).unwrap();
                h
            } else {
                h_cpu.to_device(CUDA).unwrap()
            };
            let h_ref = h_g.to_device(cpu).unwrap();
            let want = moe_gemm::gemm2_weighted_sum(&h_ref, &routes, &tw, &w2q)
                .unwrap()
                .to_f32_vec()
                .unwrap();
            let outs: &[DType] = if method == "bf16" {
                &[DType::BF16, DType::F32]
            } else {
                &[DType::BF16]
            };
            for &out in outs {
                let what = format!("{method} E={e} top_k={top_k} M={m} N={n} out {out:?}");
                let run = |sum| {
                    trace_launches(|| {
                        moe_gemm::gemm2_weighted_sum_to(
                            &h_g, &routes_g, &idsg, &twg, &w2g, out, sum,
                        )
                        .unwrap()
                    })
                };
                let (y, launches) = run(Gemm2Sum::RouteRows);
                let (y_old, _) = run(Gemm2Sum::Atomic);
                let split = n > 512;
                let rows_ran = launches.iter().any(|l| l.contains("ROUTE_ROWS=1"));
                let fin_ran = launches.iter().any(|l| l.starts_with("moe_finalize/"));
                assert_eq!(rows_ran && fin_ran, !split, "{what}: {launches:?}");
                assert_eq!((y.device(), y.dims(), y.dtype()), (CUDA, &[m, k][..], out));
                let got = y.to_f32_vec().unwrap();
                assert!(got.iter().all(|v| v.is_finite()), "{what}: unwritten y");
                let err = rel(&got, &want);
                let err_old = rel(&y_old.to_f32_vec().unwrap(), &want);
                println!("{what}: rel_err route rows {err:.2e}, reductions {err_old:.2e}");
                // One bf16 rounding per route (2⁻⁹ relative) and one of y: far below the
                // contract's 1e-2 and a wrong tile (~1).
                assert!(err <= 1e-2, "{what}: {err:.3e}");
                assert!(err_old <= 1e-2, "{what}: reductions {err_old:.3e}");
            }
        }
    }
}
