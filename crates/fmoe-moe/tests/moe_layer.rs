//! Every method × kernel family against the f64 reference, on fresh seeded random data.
//!
//! Tolerances (relative 2-norm error):
//! - same operands (`rel_err`): the kernels multiply exact f32 images of bf16 values / fp8 codes and
//!   accumulate in f32. A length-L dot product's rounding error is ≤ γ_L ≈ L·2⁻²⁴ worst case
//!   (√L·2⁻²⁴ typical); L = K then N gives ≤ (K+N)·2⁻²⁴ < 1e-3 for these shapes. The output is
//!   rounded once to its dtype: ≤ u(out) (2⁻⁹ for bf16). fp8 paths requantize the intermediate;
//!   an f32-vs-f64 difference in h can move a code across a rounding boundary (one fp8 step, 2⁻³
//!   relative, for the rare elements within ~1e-6 of a boundary). Bound: 2·u(out) + (K+N)·2⁻²⁴ + 2e-3.
//! - vs the unquantized reference (`quant_err`): four e4m3 roundings (a1, w13, a2, w2), each
//!   ≤ u_fp8 = 2⁻⁴ relative for normal-range values, so ≤ (1+2⁻⁴)⁴ − 1 ≈ 0.27 worst case.

use fmoe_core::env::FusedSwitches;
use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::quant_fp8;
use fmoe_kernels::routing::{TopK, topk_softmax};
use fmoe_moe::reference::{moe_f64, rel_err};
use fmoe_moe::stages::ExpertOperands;
use fmoe_moe::{CheckpointExperts, FusedMoe, KernelFamily, MoeConfig, QuantScheme, Routing};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| StandardNormal.sample(rng))
        .map(|v: f32| v * scale)
        .collect()
}

struct Case {
    m: usize,
    e: usize,
    k: usize,
    n: usize,
    top_k: usize,
}

const CASES: &[Case] = &[
    Case {
        m: 0,
        e: 4,
        k: 64,
        n: 32,
        top_k: 2,
    },
    Case {
        m: 1,
        e: 4,
        k: 64,
        n: 32,
        top_k: 2,
    },
    Case {
        m: 5,
        e: 1,
        k: 96,
        n: 40,
        top_k: 1,
    },
    Case {
        m: 7,
        e: 4,
        k: 130,
        n: 72,
        top_k: 4,
    },
    Case {
        m: 33,
        e: 8,
        k: 256,
        n: 200,
        top_k: 2,
    },
    Case {
        m: 17,
        e: 6,
        k: 200,
        n: 136,
        top_k: 3,
    },
];

fn switches_for(family: KernelFamily) -> FusedSwitches {
    let on = family == KernelFamily::Fused;
    FusedSwitches {
        use_fused: on,
        use_fused_moe: true,
        use_fused_fp8_block_scaled_moe: on,
    }
}

fn config(c: &Case) -> MoeConfig {
    MoeConfig {
        num_experts: c.e,
        top_k: c.top_k,
        hidden: c.k,
        intermediate: c.n,
        routing: Routing::Softmax { renormalize: true },
        shared_intermediate: None,
    }
}

struct Inputs {
    x: Tensor,
    logits: Tensor,
    w13: Tensor,
    w2: Tensor,
}

fn inputs(c: &Case, seed: u64) -> Inputs {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let cpu = Device::Cpu;
    let x = randn(&mut rng, c.m * c.k, 1.0);
    let logits = randn(&mut rng, c.m * c.e, 1.0);
    let w13 = randn(&mut rng, c.e * 2 * c.n * c.k, 1.0 / (c.k as f32).sqrt());
    let w2 = randn(&mut rng, c.e * c.k * c.n, 1.0 / (c.n as f32).sqrt());
    Inputs {
        x: Tensor::from_f32(&x, [c.m, c.k], DType::BF16, &cpu).unwrap(),
        logits: Tensor::from_vec(logits, [c.m, c.e], &cpu).unwrap(),
        w13: Tensor::from_f32(&w13, [c.e, 2 * c.n, c.k], DType::BF16, &cpu).unwrap(),
        w2: Tensor::from_f32(&w2, [c.e, c.k, c.n], DType::BF16, &cpu).unwrap(),
    }
}

fn same_operand_tol(c: &Case, out: DType) -> f64 {
    2.0 * out.unit_roundoff() + (c.k + c.n) as f64 * 2f64.powi(-24) + 2e-3
}

const QUANT_TOL: f64 = 0.27;

#[test]
fn every_method_and_family_matches_the_f64_reference() {
    for (ci, c) in CASES.iter().enumerate() {
        let inp = inputs(c, 1000 + ci as u64);
        let topk = topk_softmax(&inp.logits, c.top_k, true).unwrap();
        let exact = moe_f64(
            &inp.x,
            &topk,
            &ExpertOperands::unquantized(&inp.w13, &inp.w2),
        )
        .unwrap();
        for scheme in QuantScheme::ALL {
            let mut outputs = Vec::new();
            for family in KernelFamily::ALL {
                let experts = CheckpointExperts::Dense {
                    w13: inp.w13.clone(),
                    w2: inp.w2.clone(),
                };
                let layer = FusedMoe::new(
                    config(c),
                    scheme,
                    experts,
                    None,
                    None,
                    &switches_for(family),
                    Device::Cpu,
                )
                .unwrap();
                assert_eq!(layer.kernel().family, family);
                // Poison: the output must be a fresh tensor of the right shape, never stale data.
                let y = layer.forward(&inp.x, &inp.logits).unwrap();
                assert_eq!(y.dims(), &[c.m, c.k]);
                assert_eq!(y.dtype(), DType::BF16);
                let got = y.to_f32_vec().unwrap();
                assert!(got.iter().all(|v| v.is_finite()));
                let want = moe_f64(&inp.x, &topk, layer.method().operands().unwrap()).unwrap();
                let err = rel_err(&got, &want);
                let tol = same_operand_tol(c, DType::BF16);
                assert!(
                    err <= tol,
                    "case {ci} {scheme} {family}: rel_err {err:.3e} > {tol:.3e}"
                );
                let qerr = rel_err(&got, &exact);
                eprintln!(
                    "case {ci} {scheme:>11} {family:>8}: rel_err {err:.2e} (tol {tol:.2e}) quant_err {qerr:.2e}"
                );
                let qtol = if scheme == QuantScheme::Unquantized {
                    tol
                } else {
                    QUANT_TOL
                };
                assert!(
                    qerr <= qtol,
                    "case {ci} {scheme} {family}: quant_err {qerr:.3e} > {qtol:.3e}"
                );
                if c.m > 0 && scheme != QuantScheme::Unquantized {
                    // fp8 must actually have been applied: its error dominates the kernel's.
                    assert!(
                        qerr > err,
                        "case {ci} {scheme} {family}: quant_err {qerr:.3e} <= rel_err {err:.3e}"
                    );
                }
                outputs.push(got);
            }
            // The two families agree with each other as closely as each agrees with the reference.
            let want: Vec<f64> = outputs[1].iter().map(|&v| f64::from(v)).collect();
            let err = rel_err(&outputs[0], &want);
            assert!(
                err <= 2.0 * same_operand_tol(c, DType::BF16),
                "case {ci} {scheme}: fused vs portable {err:.3e}"
            );
        }
    }
}

#[test]
fn f32_activations_are_tight() {
    let c = &Case {
        m: 9,
        e: 4,
        k: 160,
        n: 96,
        top_k: 2,
    };
    let inp = inputs(c, 7);
    let x = inp.x.to_dtype(DType::F32).unwrap();
    let topk = topk_softmax(&inp.logits, c.top_k, true).unwrap();
    for family in KernelFamily::ALL {
        let experts = CheckpointExperts::Dense {
            w13: inp.w13.clone(),
            w2: inp.w2.clone(),
        };
        let layer = FusedMoe::new(
            config(c),
            QuantScheme::Unquantized,
            experts,
            None,
            None,
            &switches_for(family),
            Device::Cpu,
        )
        .unwrap();
        let got = layer
            .forward_routed(&x, &topk)
            .unwrap()
            .to_f32_vec()
            .unwrap();
        let want = moe_f64(&x, &topk, layer.method().operands().unwrap()).unwrap();
        // f32 out: only accumulation error remains, ≤ (K+N)·2⁻²⁴.
        let tol = (c.k + c.n) as f64 * 2f64.powi(-24);
        let err = rel_err(&got, &want);
        assert!(err <= tol, "{family}: {err:.3e} > {tol:.3e}");
    }
}

/// A per-tensor fp8 checkpoint with separate w1/w3 scales: the method merges them to the max and
/// requantizes; the half that already had the max scale keeps its codes bit for bit.
#[test]
fn per_tensor_checkpoint_scales_are_merged() {
    let c = &Case {
        m: 6,
        e: 3,
        k: 128,
        n: 64,
        top_k: 2,
    };
    let inp = inputs(c, 11);
    let (mut q13, mut s13) = (Vec::new(), Vec::new());
    for e in 0..c.e {
        let expert = inp.w13.index0(e).unwrap().to_f32_vec().unwrap();
        let (gate, up) = expert.split_at(c.n * c.k);
        // Make w3 twice as large so its scale differs.
        let up: Vec<f32> = up.iter().map(|v| v * 2.0).collect();
        let (qg, sg) = quant_fp8::quantize_per_tensor(
            &Tensor::from_vec(gate.to_vec(), [c.n, c.k], &Device::Cpu).unwrap(),
        )
        .unwrap();
        let (qu, su) = quant_fp8::quantize_per_tensor(
            &Tensor::from_vec(up, [c.n, c.k], &Device::Cpu).unwrap(),
        )
        .unwrap();
        let mut both = qg.to_f32_vec().unwrap();
        both.extend(qu.to_f32_vec().unwrap());
        q13.push(Tensor::from_f32(&both, [2 * c.n, c.k], DType::F8E4M3, &Device::Cpu).unwrap());
        s13.extend([sg.to_f32_vec().unwrap()[0], su.to_f32_vec().unwrap()[0]]);
    }
    let w13 = Tensor::stack0(&q13).unwrap();
    let w13_scale = Tensor::from_vec(s13.clone(), [c.e, 2], &Device::Cpu).unwrap();
    let mut q2 = Vec::new();
    let mut s2 = Vec::new();
    for e in 0..c.e {
        let (q, s) = quant_fp8::quantize_per_tensor(&inp.w2.index0(e).unwrap()).unwrap();
        q2.push(q);
        s2.extend(s.to_f32_vec().unwrap());
    }
    let experts = CheckpointExperts::Fp8PerTensor {
        w13: w13.clone(),
        w13_scale,
        w2: Tensor::stack0(&q2).unwrap(),
        w2_scale: Tensor::from_vec(s2, [c.e], &Device::Cpu).unwrap(),
    };
    let layer = FusedMoe::new(
        config(c),
        QuantScheme::Fp8PerTensor,
        experts,
        None,
        None,
        &switches_for(KernelFamily::Fused),
        Device::Cpu,
    )
    .unwrap();
    let ops = layer.method().operands().unwrap();
    let fmoe_kernels::moe_gemm::WeightOperand::Fp8PerTensor { q, scales } = &ops.w13 else {
        panic!("expected per-tensor operands");
    };
    let merged = scales.to_f32_vec().unwrap();
    let before = w13.to_f32_vec().unwrap();
    let after = q.to_f32_vec().unwrap();
    let per = 2 * c.n * c.k;
    for e in 0..c.e {
        assert_eq!(merged[e], s13[2 * e].max(s13[2 * e + 1]));
        // w3 had the larger scale: its codes are unchanged.
        assert_eq!(
            &after[e * per + per / 2..(e + 1) * per],
            &before[e * per + per / 2..(e + 1) * per]
        );
        // w1 values survive requantization within one fp8 rounding (2⁻⁴ relative, or the subnormal step).
        for i in 0..per / 2 {
            let (v0, v1) = (
                before[e * per + i] * s13[2 * e],
                after[e * per + i] * merged[e],
            );
            assert!(
                (v0 - v1).abs() <= v0.abs() * 0.0625 + merged[e] * 2f32.powi(-10),
                "{v0} vs {v1}"
            );
        }
    }
    let topk = topk_softmax(&inp.logits, c.top_k, true).unwrap();
    let got = layer
        .forward_routed(&inp.x, &topk)
        .unwrap()
        .to_f32_vec()
        .unwrap();
    let want = moe_f64(&inp.x, &topk, ops).unwrap();
    assert!(rel_err(&got, &want) <= same_operand_tol(c, DType::BF16));
}

/// DeepSeek-V3 shape in miniature: grouped sigmoid routing, a shared expert, a block-scaled
/// checkpoint with ragged blocks, run through both families.
#[test]
fn deepseek_style_layer_with_shared_expert() {
    let (m, e, k, n, ns) = (11, 16, 200, 72, 144);
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let cpu = Device::Cpu;
    let x = Tensor::from_f32(&randn(&mut rng, m * k, 1.0), [m, k], DType::BF16, &cpu).unwrap();
    let logits = Tensor::from_vec(randn(&mut rng, m * e, 1.0), [m, e], &cpu).unwrap();
    let bias = Tensor::from_vec(randn(&mut rng, e, 0.1), [e], &cpu).unwrap();
    let w = |rng: &mut ChaCha8Rng, d: [usize; 3], fan_in: usize| {
        Tensor::from_f32(
            &randn(rng, d.iter().product(), 1.0 / (fan_in as f32).sqrt()),
            d,
            DType::BF16,
            &cpu,
        )
        .unwrap()
    };
    let (w13, w2) = (w(&mut rng, [e, 2 * n, k], k), w(&mut rng, [e, k, n], n));
    let (s13, s2) = (w(&mut rng, [1, 2 * ns, k], k), w(&mut rng, [1, k, ns], ns));
    let block = |t: &Tensor| quant_fp8::quantize_block(t, quant_fp8::FP8_BLOCK).unwrap();
    let ckpt = |a: &Tensor, b: &Tensor| {
        let ((q13, si13), (q2, si2)) = (block(a), block(b));
        CheckpointExperts::Fp8Block {
            w13: q13,
            w13_scale_inv: si13,
            w2: q2,
            w2_scale_inv: si2,
        }
    };
    let cfg = MoeConfig {
        num_experts: e,
        top_k: 4,
        hidden: k,
        intermediate: n,
        routing: Routing::GroupedSigmoid {
            n_group: 4,
            topk_group: 2,
            renormalize: true,
            routed_scaling_factor: 2.5,
        },
        shared_intermediate: Some(ns),
    };
    let mut outs = Vec::new();
    for family in KernelFamily::ALL {
        let layer = FusedMoe::new(
            cfg.clone(),
            QuantScheme::Fp8Block,
            ckpt(&w13, &w2),
            Some(ckpt(&s13, &s2)),
            Some(bias.clone()),
            &switches_for(family),
            cpu,
        )
        .unwrap();
        assert_eq!(layer.kernel().family, family);
        let got = layer.forward(&x, &logits).unwrap().to_f32_vec().unwrap();
        // Reference: routed experts + shared expert, each in f64 with the layer's operands.
        let topk = fmoe_moe::router::route(&cfg, &logits, Some(&bias)).unwrap();
        let routed = moe_f64(&x, &topk, layer.method().operands().unwrap()).unwrap();
        let all = TopK {
            ids: Tensor::from_vec(vec![0u32; m], [m, 1], &cpu).unwrap(),
            weights: Tensor::from_vec(vec![1f32; m], [m, 1], &cpu).unwrap(),
        };
        let shared_ops = {
            let ((q13, si13), (q2, si2)) = (block(&s13), block(&s2));
            ExpertOperands {
                w13: fmoe_kernels::moe_gemm::WeightOperand::Fp8Block {
                    q: q13,
                    scale_inv: si13,
                },
                w2: fmoe_kernels::moe_gemm::WeightOperand::Fp8Block {
                    q: q2,
                    scale_inv: si2,
                },
                act_quant: fmoe_kernels::moe_gemm::ActQuant::Fp8Group,
                a13_scale: Default::default(),
                a2_scale: Default::default(),
            }
        };
        let shared = moe_f64(&x, &all, &shared_ops).unwrap();
        let want: Vec<f64> = routed.iter().zip(&shared).map(|(a, b)| a + b).collect();
        let err = rel_err(&got, &want);
        assert!(
            err <= 2.0 * DType::BF16.unit_roundoff() + 4e-3,
            "{family}: {err:.3e}"
        );
        outs.push(got);
    }
    assert_ne!(outs[0], vec![0.0; m * k]);
}
