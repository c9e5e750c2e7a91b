//! Static fp8 activation scales (`ActScales::Static`, a static checkpoint's `input_scale`s) in the
//! fp8 per-tensor MoE layer: both kernel families on the CPU and on CUDA, against an f64
//! reference written here with its own static quantization (x / a13 and h / a2, one e4m3
//! rounding each, saturating at ±448), on fresh seeded random data (poisoned device allocations).
//!
//! Tolerances (relative 2-norm error), as in `cuda_moe_fp8.rs`:
//! - ≤ 1e-2 vs the reference with the same quantization (the layer's e4m3 weights; a1 and h
//!   quantized with the static scales). On CUDA the reference rounds h to bf16 first, as the
//!   GPU's GEMM1 writes it; the CPU twins quantize f32 h.
//! - ≤ 0.27 vs the unquantized reference (four e4m3 roundings, (1 + 2⁻⁴)⁴ − 1) when the scales
//!   cover the activations. A deliberately small a13 saturates a1: then the same-quantization
//!   reference still holds on both devices (saturation happens identically) while the unquantized
//!   one is far off.
//!
//! Without a CUDA device the CUDA tests print "skipping: <reason>" and pass, unless
//! `FMOE_REQUIRE_CUDA=1`.

mod common;
use common::*;
use fmoe_core::cuda::test_backend_or_skip;
use fmoe_core::{DType, Device, F8E4M3, Tensor};
use fmoe_kernels::moe_gemm::{ActOperand, ActQuant, ActScale, WeightOperand};
use fmoe_kernels::nvrtc::trace_launches;
use fmoe_kernels::routing::{TopK, topk_softmax};
use fmoe_moe::reference::{moe_f64, rel_err};
use fmoe_moe::stages::ExpertOperands;
use fmoe_moe::{ActScales, CheckpointExperts, FusedMoe, KernelFamily, QuantScheme};

const CUDA: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;
const TOL_SAME: f64 = 1e-2;
const TOL_QUANT: f64 = 0.27;

/// K, N multiples of 16 (the CUDA contract), not of 128; M = 1 to 300 (small tiles on CUDA).
const CASES: &[Case] = &[
    case(1, 8, 256, 128, 2),
    case(33, 4, 272, 208, 4),
    case(300, 8, 528, 336, 2),
];

/// 256 routes per expert (≥ 128): the large per-tensor CUDA tiles.
const LARGE: Case = case(1024, 8, 528, 336, 2);

/// An fp8 per-tensor layer on `device` (weights quantized online there) with `scales`.
fn layer(
    c: &Case,
    inp: &Inputs,
    family: KernelFamily,
    scales: ActScales,
    device: Device,
) -> FusedMoe {
    let experts = CheckpointExperts::Dense {
        w13: inp.w13.to_device(device).unwrap(),
        w2: inp.w2.to_device(device).unwrap(),
    };
    let l = FusedMoe::new(
        config(c),
        QuantScheme::Fp8PerTensor,
        experts,
        None,
        None,
        &switches(family),
        device,
    )
    .unwrap()
    .with_act_scales(scales)
    .unwrap();
    assert_eq!(l.kernel().family, family);
    assert_eq!(l.method().act_scales(), scales);
    l
}

/// v quantized to e4m3 with scale s (round to nearest even, ±448 saturation) and back, in f64.
fn q(v: f32, s: f32) -> f64 {
    f64::from(F8E4M3::from_f32(v / s).to_f32()) * f64::from(s)
}

/// Real values of per-tensor expert weights, [E][rows·cols].
fn weight_values(w: &WeightOperand) -> Vec<Vec<f64>> {
    let WeightOperand::Fp8PerTensor { q, scales } = w else {
        panic!("not per-tensor fp8: {w:?}");
    };
    let s = scales.to_f32_vec().unwrap();
    (0..s.len())
        .map(|e| {
            let codes = q.index0(e).unwrap().to_f32_vec().unwrap();
            codes
                .iter()
                .map(|&c| f64::from(c) * f64::from(s[e]))
                .collect()
        })
        .collect()
}

/// The MoE layer in f64 with static quantization of a1 (`a13`) and h (`a2`); h is rounded to
/// bf16 first when `h_bf16` (the CUDA GEMM1's output). `quantize: false` keeps activations as
/// they are (for the scale-free intermediate amax). Returns (y, max |h|).
fn reference(
    inp: &Inputs,
    topk: &TopK,
    ops: &ExpertOperands,
    scales: Option<(f32, f32)>,
    h_bf16: bool,
) -> (Vec<f64>, f64) {
    let (m, k) = (inp.x.dims()[0], inp.x.dims()[1]);
    let top_k = topk.ids.dims()[1];
    let ids = topk.ids.to_f32_vec().unwrap();
    let tw = topk.weights.to_f32_vec().unwrap();
    let (w13, w2) = (weight_values(&ops.w13), weight_values(&ops.w2));
    let n = ops.w2.data().dims()[2];
    let x: Vec<f64> = inp
        .x
        .to_f32_vec()
        .unwrap()
        .iter()
        .map(|&v| scales.map_or(f64::from(v), |(a13, _)| q(v, a13)))
        .collect();
    let silu = |v: f64| v / (1.0 + (-v).exp());
    let mut y = vec![0f64; m * k];
    let mut hmax = 0f64;
    for t in 0..m {
        let xt = &x[t * k..(t + 1) * k];
        for j in 0..top_k {
            let e = ids[t * top_k + j] as usize;
            let dot = |row: usize| -> f64 {
                xt.iter()
                    .zip(&w13[e][row * k..(row + 1) * k])
                    .map(|(a, b)| a * b)
                    .sum()
            };
            let h: Vec<f64> = (0..n)
                .map(|i| {
                    let v = silu(dot(i)) * dot(n + i);
                    hmax = hmax.max(v.abs());
                    let mut v32 = v as f32;
                    if h_bf16 {
                        v32 = half_round(v32);
                    }
                    scales.map_or(v, |(_, a2)| q(v32, a2))
                })
                .collect();
            let w = f64::from(tw[t * top_k + j]);
            for (kk, yk) in y[t * k..(t + 1) * k].iter_mut().enumerate() {
                let row = &w2[e][kk * n..(kk + 1) * n];
                *yk += w * row.iter().zip(&h).map(|(a, b)| a * b).sum::<f64>();
            }
        }
    }
    (y, hmax)
}

/// f32 → bf16 → f32, round to nearest even (through the tensor conversion).
fn half_round(v: f32) -> f32 {
    Tensor::from_f32(&[v], [1], DType::BF16, &CPU)
        .unwrap()
        .to_f32_vec()
        .unwrap()[0]
}

fn amax(t: &Tensor) -> f32 {
    t.to_f32_vec()
        .unwrap()
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
}

/// Static scales that cover the activations (a13 from x's amax with 25% headroom, a2 from the
/// unquantized intermediate's), or, if `saturate`, an a13 8× too small.
fn scales_for(inp: &Inputs, topk: &TopK, ops: &ExpertOperands, saturate: bool) -> (f32, f32) {
    let (_, hmax) = reference(inp, topk, ops, None, false);
    let a13 = amax(&inp.x) * 1.25 / 448.0;
    let a2 = (hmax as f32) * 1.25 / 448.0;
    if saturate { (a13 / 8.0, a2) } else { (a13, a2) }
}

/// Runs `c` on `device` through both families with static scales (and, if `saturate`, a13 too
/// small) and checks both tolerances; returns the outputs (fused, portable).
fn check(c: &Case, seed: u64, device: Device, saturate: bool) -> Vec<Vec<f32>> {
    let inp = inputs(c, seed);
    let dynamic = layer(c, &inp, KernelFamily::Fused, ActScales::Dynamic, device);
    let ops = dynamic.method().operands().unwrap().to_device(CPU).unwrap();
    let x = inp.x.to_device(device).unwrap();
    let topk = topk_softmax(&inp.logits.to_device(device).unwrap(), c.top_k, true).unwrap();
    let htopk = TopK {
        ids: topk.ids.to_device(CPU).unwrap(),
        weights: topk.weights.to_device(CPU).unwrap(),
    };
    let (a13, a2) = scales_for(&inp, &htopk, &ops, saturate);
    let scales = ActScales::Static { a13, a2 };
    let cuda = !device.is_cpu();
    let (same, _) = reference(&inp, &htopk, &ops, Some((a13, a2)), cuda);
    let exact = moe_f64(
        &inp.x,
        &htopk,
        &ExpertOperands::unquantized(&inp.w13, &inp.w2),
    )
    .unwrap();
    let mut outs = Vec::new();
    for family in KernelFamily::ALL {
        let l = layer(c, &inp, family, scales, device);
        let (y, fin) = l.forward_routed_deferred(&x, &topk).unwrap();
        fin.check().unwrap();
        assert_eq!((y.device(), y.dims()), (device, &[c.m, c.k][..]));
        let got = y.to_f32_vec().unwrap();
        let (e_same, e_quant) = (rel_err(&got, &same), rel_err(&got, &exact));
        println!(
            "{device} {family} {c:?} saturate {saturate}: a13 {a13:.3e} a2 {a2:.3e} same {e_same:.2e} \
             quant {e_quant:.2e}"
        );
        assert!(e_same <= TOL_SAME, "{device} {family} {c:?}: same {e_same}");
        if saturate {
            assert!(
                e_quant > TOL_QUANT,
                "{device} {family}: no saturation ({e_quant})"
            );
        } else {
            assert!(e_quant <= TOL_QUANT, "{device} {family}: quant {e_quant}");
        }
        // The static layer really differs from the dynamic one.
        let (yd, _) = dynamic.forward_routed_deferred(&x, &topk).unwrap();
        assert_ne!(
            yd.to_f32_vec().unwrap(),
            got,
            "{device} {family}: static == dynamic"
        );
        outs.push(got);
    }
    outs
}

#[test]
fn cpu_static_scales_match_the_same_quantization_reference() {
    for (i, c) in CASES.iter().enumerate() {
        check(c, 100 + i as u64, CPU, false);
    }
}

#[test]
fn cpu_small_a13_saturates_like_the_reference() {
    check(&CASES[2], 7, CPU, true);
}

#[test]
fn static_scales_are_refused_where_they_have_no_meaning() {
    let c = CASES[0];
    let inp = inputs(&c, 1);
    let s = ActScales::Static { a13: 0.1, a2: 0.1 };
    for scheme in [QuantScheme::Unquantized, QuantScheme::Fp8Block] {
        let experts = CheckpointExperts::Dense {
            w13: inp.w13.clone(),
            w2: inp.w2.clone(),
        };
        let l = FusedMoe::new(
            config(&c),
            scheme,
            experts,
            None,
            None,
            &switches(KernelFamily::Fused),
            CPU,
        )
        .unwrap();
        let err = l.with_act_scales(s).err().unwrap().to_string();
        assert!(
            err.contains("per-tensor") && err.contains(scheme.as_str()),
            "{err}"
        );
    }
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let experts = CheckpointExperts::Dense {
            w13: inp.w13.clone(),
            w2: inp.w2.clone(),
        };
        let l = FusedMoe::new(
            config(&c),
            QuantScheme::Fp8PerTensor,
            experts,
            None,
            None,
            &switches(KernelFamily::Fused),
            CPU,
        )
        .unwrap();
        let err = l
            .with_act_scales(ActScales::Static { a13: 0.1, a2: bad })
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("a2") && err.contains("positive"), "{err}");
    }
    let err = ActScales::from_expert_input_scales(&[0.1, 0.2], &[0.3, -0.3])
        .unwrap_err()
        .to_string();
    assert!(err.contains("w2 input_scale #1"), "{err}");
    assert_eq!(
        ActScales::from_expert_input_scales(&[0.1, 0.2, 0.15], &[0.3, 0.25]).unwrap(),
        ActScales::Static { a13: 0.2, a2: 0.3 }
    );
    // A static scale goes with per-tensor quantization only.
    let sc = ActScale::Static(Tensor::from_vec(vec![0.1f32], [1], &CPU).unwrap());
    let err = ActOperand::quantize_scaled(&inp.x, ActQuant::Fp8Group, &sc)
        .unwrap_err()
        .to_string();
    assert!(err.contains("per-tensor"), "{err}");
}

#[test]
fn cuda_static_scales_match_the_same_quantization_reference() {
    if test_backend_or_skip().is_none() {
        return;
    }
    for (i, c) in CASES.iter().chain([&LARGE]).enumerate() {
        check(c, 200 + i as u64, CUDA, false);
    }
}

/// a13 8× too small: the CPU and CUDA layers saturate a1 identically (the a1 codes agree bit for
/// bit), and both stay with the saturating reference.
#[test]
fn cuda_small_a13_saturates_like_the_cpu() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let c = CASES[2];
    let gpu = check(&c, 7, CUDA, true);
    let cpu = check(&c, 7, CPU, true);
    for (g, h) in gpu.iter().zip(&cpu) {
        let e = rel_err(g, &h.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
        assert!(e <= 3e-2, "CUDA vs CPU with saturation: {e}");
    }
    let inp = inputs(&c, 7);
    let s = amax(&inp.x) * 1.25 / 448.0 / 8.0;
    let codes = |x: &Tensor, dev: Device| -> Vec<u8> {
        let sc = ActScale::Static(Tensor::from_vec(vec![s], [1], &dev).unwrap());
        let a =
            ActOperand::quantize_scaled(&x.to_device(dev).unwrap(), ActQuant::Fp8PerTensor, &sc)
                .unwrap();
        let q = a.data().to_device(CPU).unwrap();
        q.cpu_slice::<F8E4M3>("test", "q")
            .unwrap()
            .iter()
            .map(|c| c.to_bits())
            .collect()
    };
    let (on_cpu, on_gpu) = (codes(&inp.x, CPU), codes(&inp.x, CUDA));
    assert_eq!(on_cpu, on_gpu);
    let saturated = on_gpu.iter().filter(|&&c| c & 0x7F == 0x7E).count();
    println!("a1 saturated: {saturated} of {}", on_gpu.len());
    assert!(saturated > on_gpu.len() / 100, "{saturated}");
}

/// With static scales no amax is computed on CUDA: a1 and h are cast by the static kernel (two
/// launches of it per forward, fused or portable), and the dynamic amax/cast kernels never run.
#[test]
fn cuda_static_forward_launches_no_amax() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let c = CASES[1];
    let inp = inputs(&c, 3);
    let x = inp.x.to_device(CUDA).unwrap();
    let topk = topk_softmax(&inp.logits.to_device(CUDA).unwrap(), c.top_k, true).unwrap();
    let scales = ActScales::Static {
        a13: 0.01,
        a2: 0.02,
    };
    for family in KernelFamily::ALL {
        let l = layer(&c, &inp, family, scales, CUDA);
        let (r, trace) = trace_launches(|| l.forward_routed_deferred(&x, &topk));
        r.unwrap().1.check().unwrap();
        // `family/entry`, defines stripped.
        let count = |name: &str| {
            trace
                .iter()
                .filter(|t| t.split('[').next() == Some(name))
                .count()
        };
        let q = "quant_fp8/";
        assert_eq!(
            count(&format!("{q}fmoe_fp8_quant_tensor_static")),
            2,
            "{family}: {trace:?}"
        );
        assert_eq!(
            count(&format!("{q}fmoe_fp8_amax")),
            0,
            "{family}: {trace:?}"
        );
        assert_eq!(
            count(&format!("{q}fmoe_fp8_quant_tensor")),
            0,
            "{family}: {trace:?}"
        );
        // The two per-tensor GEMMs, whichever fp8 GEMM family the rule picks for this batch.
        let gemms = trace
            .iter()
            .filter(|t| {
                let name = t.split('[').next().unwrap_or("");
                name.starts_with("moe_gemm_fp8") && name.ends_with("/fmoe_moe_gemm_fp8")
            })
            .count();
        assert_eq!(gemms, 2, "{family}: {trace:?}");
    }
}
