//! `quant_fp8`'s CUDA twin against its CPU twin: codes and scales bit for bit on seeded random
//! data (per tensor, 1×128 token groups, 128×128 blocks; bf16 and f32 input; ragged shapes), the
//! NaN/Inf flag reported as the CPU's error, and clear errors for what has no CUDA kernel; plus
//! the fp8 grouped GEMMs' contract errors.
//!
//! Without a CUDA device every test prints "skipping: <reason>" and passes, unless
//! `FMOE_REQUIRE_CUDA=1`, which turns a skip into a failure. Allocations are poisoned (0xFF: the
//! e4m3 NaN code, NaN scales), so an element a kernel never writes counts as a mismatch.

use fmoe_core::cuda::test_backend_or_skip;
use fmoe_core::{DType, Device, F8E4M3, Tensor};
use fmoe_kernels::moe_align::align_routes;
use fmoe_kernels::moe_gemm::{self, ActOperand, ActQuant, WeightOperand};
use fmoe_kernels::quant_fp8::{
    FP8_BLOCK, FP8_GROUP, quantize_block, quantize_per_tensor, quantize_per_tensor_deferred,
    quantize_per_token_group, quantize_per_token_group_deferred, quantize_static_deferred,
    quantize_with_scale,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

const CUDA: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

/// Rows of standard normals, each row scaled by exp(3·z) (magnitudes over many binades, so
/// subnormal codes, saturation-free maxima and every exponent occur), x[0] = 0.
fn data(rows: usize, cols: usize, dtype: DType, seed: u64) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut v = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let z: f32 = StandardNormal.sample(&mut rng);
        let s = (3.0 * z).exp();
        for _ in 0..cols {
            let z: f32 = StandardNormal.sample(&mut rng);
            v.push(z * s);
        }
    }
    if let Some(first) = v.first_mut() {
        *first = 0.0;
    }
    Tensor::from_f32(&v, [rows, cols], dtype, &CPU).unwrap()
}

fn codes(q: &Tensor) -> Vec<u8> {
    assert_eq!(q.dtype(), DType::F8E4M3);
    let q = q.to_device(CPU).unwrap();
    q.cpu_slice::<F8E4M3>("test", "q")
        .unwrap()
        .iter()
        .map(|c| c.to_bits())
        .collect()
}

fn bits(s: &Tensor) -> Vec<u32> {
    assert_eq!(s.dtype(), DType::F32);
    s.to_f32_vec()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn mismatches<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).filter(|(x, y)| x != y).count()
}

#[test]
fn quantization_kernels_are_bit_exact_with_the_cpu_twin() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let shapes = [
        (2048, 7168, DType::BF16),
        (37, 4000, DType::BF16),
        // Either side of the one-block per-tensor kernel's limit (64 Ki elements).
        (16, 4096, DType::BF16),
        (17, 4096, DType::BF16),
        (33, 1000, DType::F32),
        (3, 5, DType::F32),
        (1, 1, DType::BF16),
        (0, 16, DType::BF16),
    ];
    for (i, &(rows, cols, dtype)) in shapes.iter().enumerate() {
        let what = format!("{rows}x{cols} {dtype}");
        let x = data(rows, cols, dtype, 100 + i as u64);
        let xg = x.to_device(CUDA).unwrap();

        let (qc, sc) = quantize_per_tensor(&x).unwrap();
        let (qg, sg, check) = quantize_per_tensor_deferred(&xg).unwrap();
        assert!(check.is_pending());
        check.check().unwrap();
        assert_eq!(
            (qg.device(), qg.dims(), sg.device(), sg.dims()),
            (CUDA, x.dims(), CUDA, &[1][..]),
            "{what}"
        );
        let (m, ms) = (
            mismatches(&codes(&qg), &codes(&qc)),
            mismatches(&bits(&sg), &bits(&sc)),
        );
        println!(
            "per-tensor {what}: code mismatches {m} / {}, scale {ms}",
            x.elem_count()
        );
        assert_eq!((m, ms), (0, 0), "per-tensor {what}");

        let (qc, sc) = quantize_per_token_group(&x, FP8_GROUP).unwrap();
        let (qg, sg) = quantize_per_token_group(&xg, FP8_GROUP).unwrap();
        assert_eq!(sg.dims(), sc.dims(), "{what}");
        let (m, ms) = (
            mismatches(&codes(&qg), &codes(&qc)),
            mismatches(&bits(&sg), &bits(&sc)),
        );
        println!(
            "per-group  {what}: code mismatches {m} / {}, scale mismatches {ms} / {}",
            x.elem_count(),
            sc.elem_count()
        );
        assert_eq!((m, ms), (0, 0), "per-group {what}");

        // ActOperand (what the MoE layer calls) gives the same operands on both devices.
        for scheme in [ActQuant::Fp8PerTensor, ActQuant::Fp8Group] {
            let (a, c) = ActOperand::quantize_deferred(&xg, scheme).unwrap();
            c.check().unwrap();
            let b = ActOperand::quantize(&x, scheme).unwrap();
            assert_eq!(codes(a.data()), codes(b.data()), "{what} {scheme:?}");
        }
    }
    let blocks = [
        (3, 300, 200, DType::BF16),
        (2, 128, 256, DType::F32),
        (4, 257, 129, DType::F32),
        (1, 5, 3, DType::BF16),
        (8, 512, 448, DType::BF16),
    ];
    for (i, &(mats, rows, cols, dtype)) in blocks.iter().enumerate() {
        let what = format!("{mats}x{rows}x{cols} {dtype}");
        let x = data(mats * rows, cols, dtype, 200 + i as u64)
            .reshape([mats, rows, cols])
            .unwrap();
        let (qc, sc) = quantize_block(&x, FP8_BLOCK).unwrap();
        let (qg, sg) = quantize_block(&x.to_device(CUDA).unwrap(), FP8_BLOCK).unwrap();
        assert_eq!((qg.device(), sg.dims()), (CUDA, sc.dims()), "{what}");
        let (m, ms) = (
            mismatches(&codes(&qg), &codes(&qc)),
            mismatches(&bits(&sg), &bits(&sc)),
        );
        println!(
            "per-block  {what}: code mismatches {m} / {}, scale mismatches {ms} / {}",
            x.elem_count(),
            sc.elem_count()
        );
        assert_eq!((m, ms), (0, 0), "per-block {what}");
    }
}

#[test]
fn non_finite_input_is_reported_like_the_cpu_twin() {
    if test_backend_or_skip().is_none() {
        return;
    }
    // 64 rows: one-block per-tensor kernel; 256 rows: the two-launch one (over SMALL_TENSOR).
    for (rows, bad) in [64, 256]
        .into_iter()
        .flat_map(|r| [f32::INFINITY, f32::NEG_INFINITY, f32::NAN].map(|b| (r, b)))
    {
        let mut v = data(rows, 300, DType::F32, 7).to_f32_vec().unwrap();
        v[5 * 300 + 77] = bad;
        let x = Tensor::from_f32(&v, [rows, 300], DType::BF16, &CPU).unwrap();
        let xg = x.to_device(CUDA).unwrap();
        let cpu = quantize_per_tensor(&x).unwrap_err().to_string();
        assert!(cpu.contains("1577"), "{cpu}");
        assert_eq!(quantize_per_tensor(&xg).unwrap_err().to_string(), cpu);
        // Deferred: no error until the check is read.
        let (_, _, check) = quantize_per_tensor_deferred(&xg).unwrap();
        assert_eq!(check.check().unwrap_err().to_string(), cpu);
        let cpu = quantize_per_token_group(&x, FP8_GROUP)
            .unwrap_err()
            .to_string();
        let (_, _, check) = quantize_per_token_group_deferred(&xg, FP8_GROUP).unwrap();
        assert_eq!(check.check().unwrap_err().to_string(), cpu);
        let w = x.reshape([2, rows / 2, 300]).unwrap();
        let cpu = quantize_block(&w, FP8_BLOCK).unwrap_err().to_string();
        let gpu = quantize_block(&w.to_device(CUDA).unwrap(), FP8_BLOCK)
            .unwrap_err()
            .to_string();
        assert_eq!(gpu, cpu);
    }
}

/// The static scale kernel (`fmoe_fp8_quant_tensor_static`) against the CPU twin, code for code:
/// bf16 and f32 input, ragged lengths, a scale that fits (amax / 448), one 16× too small (about
/// half the elements saturate to ±448) and one 2⁸× too large (subnormal codes and zeros).
#[test]
fn static_scale_quantization_is_bit_exact_with_the_cpu_twin() {
    if test_backend_or_skip().is_none() {
        return;
    }
    for (rows, cols) in [(1, 1), (3, 37), (64, 300), (257, 1024)] {
        for dtype in [DType::BF16, DType::F32] {
            let x = data(rows, cols, dtype, 11 + rows as u64);
            let xs = x.to_f32_vec().unwrap();
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let fit = amax.max(1e-6) / 448.0;
            for s in [fit, fit / 16.0, fit * 256.0] {
                let sc = Tensor::from_vec(vec![s], [1], &CPU).unwrap();
                let (want, _) = quantize_static_deferred(&x, &sc).unwrap();
                // The public static CPU function gives the same codes.
                assert_eq!(codes(&want), codes(&quantize_with_scale(&x, s).unwrap()));
                let (got, check) = quantize_static_deferred(
                    &x.to_device(CUDA).unwrap(),
                    &sc.to_device(CUDA).unwrap(),
                )
                .unwrap();
                check.check().unwrap();
                let (w, g) = (codes(&want), codes(&got));
                let what = format!("[{rows}, {cols}] {dtype} scale {s:e}");
                assert_eq!(mismatches(&w, &g), 0, "{what}");
                // Every |x|/s ≥ 448 lands on ±448 (0x7E): at least those codes, and some exist
                // whenever the scale is below the fitting one.
                let saturated = g.iter().filter(|&&c| c & 0x7F == 0x7E).count();
                let over = xs.iter().filter(|v| v.abs() / s >= 448.0).count();
                assert!(
                    saturated >= over,
                    "{what}: {saturated} codes at 448, {over} inputs over"
                );
                if s < fit && amax > 0.0 {
                    assert!(over > 0, "{what}: no input over 448·s");
                }
            }
        }
    }
    let x = data(4, 64, DType::BF16, 1).to_device(CUDA).unwrap();
    let on_cpu = Tensor::from_vec(vec![1f32], [1], &CPU).unwrap();
    let err = quantize_static_deferred(&x, &on_cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("scale") && err.contains("cpu"), "{err}");
}

#[test]
fn non_finite_input_to_a_static_scale_is_reported_like_the_cpu_twin() {
    if test_backend_or_skip().is_none() {
        return;
    }
    // 64 rows: one-block per-tensor kernel; 256 rows: the two-launch one (over SMALL_TENSOR).
    for (rows, bad) in [64, 256]
        .into_iter()
        .flat_map(|r| [f32::INFINITY, f32::NEG_INFINITY, f32::NAN].map(|b| (r, b)))
    {
        let mut v = data(rows, 300, DType::F32, 7).to_f32_vec().unwrap();
        v[5 * 300 + 77] = bad;
        let x = Tensor::from_f32(&v, [rows, 300], DType::BF16, &CPU).unwrap();
        let sc = Tensor::from_vec(vec![0.5f32], [1], &CPU).unwrap();
        let cpu = quantize_static_deferred(&x, &sc).unwrap_err().to_string();
        assert!(cpu.contains("1577"), "{cpu}");
        let (_, check) =
            quantize_static_deferred(&x.to_device(CUDA).unwrap(), &sc.to_device(CUDA).unwrap())
                .unwrap();
        assert_eq!(check.check().unwrap_err().to_string(), cpu);
    }
}

#[test]
fn what_has_no_cuda_kernel_is_a_clear_error() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let x = data(4, 256, DType::F16, 3).to_device(CUDA).unwrap();
    let err = quantize_per_tensor(&x).unwrap_err().to_string();
    assert!(err.contains("f16") && err.contains("cuda:0"), "{err}");
    let x = data(4, 256, DType::BF16, 3).to_device(CUDA).unwrap();
    let err = quantize_per_token_group(&x, 64).unwrap_err().to_string();
    assert!(err.contains("128") && err.contains("64"), "{err}");
    let err = quantize_with_scale(&x, 1.0).unwrap_err().to_string();
    assert!(err.contains("no CUDA kernel"), "{err}");
}

#[test]
fn fp8_gemm_contract_errors_name_the_dimension() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let (m, e, top_k) = (3, 2, 1);
    let ids = Tensor::zeros([m, top_k], DType::U32, &CUDA).unwrap();
    // K = 136 is a multiple of 8 (bf16's contract) but not of 16.
    for (k, n, dim) in [(136, 64, "K (hidden"), (128, 72, "N (intermediate")] {
        let x = data(m, k, DType::BF16, 9).to_device(CUDA).unwrap();
        let a = ActOperand::quantize(&x, ActQuant::Fp8PerTensor).unwrap();
        let w13 = WeightOperand::Fp8PerTensor {
            q: Tensor::zeros([e, 2 * n, k], DType::F8E4M3, &CUDA).unwrap(),
            scales: Tensor::full([e], DType::F32, 1.0, &CUDA).unwrap(),
        };
        let routes = align_routes(&ids, e, 64).unwrap();
        let err = moe_gemm::gemm1_silu_mul_quant(&a, &routes, top_k, &w13, ActQuant::Fp8PerTensor)
            .unwrap_err()
            .to_string();
        assert!(err.contains(dim) && err.contains("16"), "{err}");
    }
    // Mixed schemes: per-tensor activations with block-scaled weights.
    let (k, n) = (128, 64);
    let x = data(m, k, DType::BF16, 9).to_device(CUDA).unwrap();
    let a = ActOperand::quantize(&x, ActQuant::Fp8PerTensor).unwrap();
    let w13 = WeightOperand::Fp8Block {
        q: Tensor::zeros([e, 2 * n, k], DType::F8E4M3, &CUDA).unwrap(),
        scale_inv: Tensor::full([e, 1, 1], DType::F32, 1.0, &CUDA).unwrap(),
    };
    let routes = align_routes(&ids, e, 64).unwrap();
    let err = moe_gemm::gemm1_silu_mul_quant(&a, &routes, top_k, &w13, ActQuant::Fp8Group)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no CUDA kernel") && err.contains("per-tensor") && err.contains("128×128"),
        "{err}"
    );
    // Block-scaled routes need block_m = 16, 32, 64 or 128 (the kernels' M tiles).
    let a = ActOperand::quantize(&x, ActQuant::Fp8Group).unwrap();
    let routes = align_routes(&ids, e, 48).unwrap();
    let err = moe_gemm::gemm1_silu_mul_quant(&a, &routes, top_k, &w13, ActQuant::Fp8Group)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("block_m = 48") && err.contains("16, 32, 64 or 128"),
        "{err}"
    );
}
