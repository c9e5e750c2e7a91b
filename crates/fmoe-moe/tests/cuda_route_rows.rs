//! The fused MoE layer on CUDA with GEMM2's per-route rows forced on (the dev knob
//! `FMOE_DEV_ROUTE_ROWS=on`, set before anything reads it: this binary holds one test), every
//! method, against the f64 reference on fresh seeded random data with poisoned device
//! allocations. The rule picks the rows only for top-k ≥ 4 where y32 outgrows L2 (tens of MB); the
//! knob runs them at sizes a test can check on the CPU, top-1 and top-2 included.
//!
//! Without a CUDA device the test prints "skipping: <reason>" and passes, unless
//! `FMOE_REQUIRE_CUDA=1`, which turns a skip into a failure.
//!
//! Tolerance ≤ 1e-2 (relative 2-norm, the contract for bf16 inputs): bf16 against `moe_f64` over
//! the bf16 operands; fp8 against `moe_f64` over the layer's own quantized operands (fp8-tensor
//! with h rounded to bf16 first, as its GEMM1 does; see `cuda_moe_fp8.rs`). The rows add one bf16
//! rounding per route (2⁻⁹ relative, typical) before the f32 top-k sum.

mod common;
use common::*;
use fmoe_core::cuda::test_backend_or_skip;
use fmoe_core::{DType, Device};
use fmoe_kernels::moe_gemm::DEV_ROUTE_ROWS_ENV;
use fmoe_kernels::nvrtc::trace_launches;
use fmoe_kernels::routing::topk_softmax;
use fmoe_moe::reference::{moe_f64, moe_f64_h_rounded, rel_err};
use fmoe_moe::stages::ExpertOperands;
use fmoe_moe::{CheckpointExperts, FusedMoe, KernelFamily, QuantScheme};

const CUDA: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;
const TOL: f64 = 1e-2;

/// ≥ 64 routes per expert (the 128-row prefill kernels), GEMM2's reduction N ≤ 496 (one K
/// split): top-1, top-2 with ragged K = 208, E = 4 top-4 (every token's experts distinct, all
/// experts), E = 256 top-8 at M = 2048 (64 routes per expert, sparse).
const CASES: &[Case] = &[
    case(1024, 8, 208, 256, 1),
    case(600, 8, 208, 400, 2),
    case(512, 4, 256, 128, 4),
    case(2048, 256, 256, 144, 8),
];

#[test]
fn route_rows_layers_match_the_f64_reference() {
    // "on" unless the run asks for another forced setting ("cs": streaming stores).
    if !matches!(
        std::env::var(DEV_ROUTE_ROWS_ENV).as_deref(),
        Ok("on" | "cs")
    ) {
        // SAFETY: the only test of this binary, before any thread reads the environment.
        unsafe { std::env::set_var(DEV_ROUTE_ROWS_ENV, "on") };
    }
    let Some(b) = test_backend_or_skip() else {
        return;
    };
    if b.compute_capability() != (9, 0) {
        println!("skipping: the route-rows GEMM2 runs on sm_90 only");
        return;
    }
    for (i, c) in CASES.iter().enumerate() {
        let inp = inputs(c, 9900 + i as u64);
        let x = inp.x.to_device(CUDA).unwrap();
        let topk = topk_softmax(&inp.logits.to_device(CUDA).unwrap(), c.top_k, true).unwrap();
        let htopk = host_topk(&topk);
        for scheme in [
            QuantScheme::Unquantized,
            QuantScheme::Fp8PerTensor,
            QuantScheme::Fp8Block,
        ] {
            let what = format!("{c:?} {scheme}");
            let experts = CheckpointExperts::Dense {
                w13: inp.w13.to_device(CUDA).unwrap(),
                w2: inp.w2.to_device(CUDA).unwrap(),
            };
            let layer = FusedMoe::new(
                config(c),
                scheme,
                experts,
                None,
                None,
                &switches(KernelFamily::Fused),
                CUDA,
            )
            .unwrap();
            let want = match scheme {
                QuantScheme::Unquantized => moe_f64(
                    &inp.x,
                    &htopk,
                    &ExpertOperands::unquantized(&inp.w13, &inp.w2),
                ),
                QuantScheme::Fp8PerTensor => {
                    let ops = layer.method().operands().unwrap().to_device(CPU).unwrap();
                    moe_f64_h_rounded(&inp.x, &htopk, &ops, Some(DType::BF16))
                }
                _ => {
                    let ops = layer.method().operands().unwrap().to_device(CPU).unwrap();
                    moe_f64(&inp.x, &htopk, &ops)
                }
            }
            .unwrap();
            let ((y, check), launches) =
                trace_launches(|| layer.forward_routed_deferred(&x, &topk).unwrap());
            check.check().unwrap();
            assert!(
                launches.iter().any(|l| l.contains("ROUTE_ROWS=1"))
                    && launches.iter().any(|l| l.starts_with("moe_finalize/")),
                "{what}: the route-rows GEMM2 and its sum did not run: {launches:?}"
            );
            let got = checked_output(&y, c.m, c.k, &what);
            let err = rel_err(&got, &want);
            println!("{what}: rel_err {err:.2e}");
            assert!(err <= TOL, "{what}: rel_err {err:.3e} > {TOL:e}");
        }
    }
}
