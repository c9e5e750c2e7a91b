//! `quant_fp8` through its public tensor API: exact e4m3fn encodings, code round trips, derived
//! round-trip error bounds on seeded random data for every scheme, the special-value policy and
//! input validation.
//!
//! The reference decoder/encoder here are written from the format (bias 7, 3 mantissa bits) and
//! share nothing with the crate or float8.

use fmoe_core::{DType, Device, F8E4M3, Tensor};
use fmoe_kernels::Error;
use fmoe_kernels::quant_fp8::{
    FP8_BLOCK, FP8_GROUP, dequantize_block, dequantize_per_tensor, dequantize_per_token_group,
    quantize_block, quantize_per_tensor, quantize_per_token_group, quantize_static_deferred,
    quantize_with_scale, scale_from_amax,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Cauchy, Distribution, Normal};

/// f32 unit roundoff.
const U: f32 = f32::EPSILON / 2.0;

fn cpu() -> Device {
    Device::Cpu
}

fn t32(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &cpu()).unwrap()
}

fn codes(q: &Tensor) -> Vec<u8> {
    assert_eq!(q.dtype(), DType::F8E4M3);
    let s = q.cpu_slice::<F8E4M3>("test", "q").unwrap();
    s.iter().map(|c| c.to_bits()).collect()
}

fn code_tensor(c: &[u8], shape: &[usize]) -> Tensor {
    let v: Vec<F8E4M3> = c.iter().map(|&b| F8E4M3::from_bits(b)).collect();
    Tensor::from_vec(v, shape, &cpu()).unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    assert_eq!(t.dtype(), DType::F32);
    t.to_f32_vec().unwrap()
}

/// Static quantization of each value with scale 1: the raw f32 -> e4m3fn conversion.
fn encode(xs: &[f32]) -> Vec<u8> {
    codes(&quantize_with_scale(&t32(xs, &[xs.len()]), 1.0).unwrap())
}

fn is_nan_code(b: u8) -> bool {
    b & 0x7F == 0x7F
}

/// Decodes a code from its bit fields; None for NaN.
fn ref_decode(b: u8) -> Option<f64> {
    if is_nan_code(b) {
        return None;
    }
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 0xF), f64::from(b & 7));
    Some(if e == 0 {
        sign * m * 2f64.powi(-9)
    } else {
        sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
    })
}

/// RNE with saturation, by search over the 127 non-negative finite codes (ascending in value).
/// Clamping |x| to 448 first is exact RNE-then-saturate: every |x| > 448 rounds to 448 or to the
/// overflowing 480, and both saturate to 448.
fn ref_encode(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = f64::from(x).abs().min(448.0);
    let vals: Vec<f64> = (0..=0x7Eu8).map(|c| ref_decode(c).unwrap()).collect();
    let hi = vals.partition_point(|&v| v < a);
    if hi == 0 {
        return sign;
    }
    let lo = hi - 1;
    let (dl, dh) = (a - vals[lo], vals[hi] - a);
    // Adjacent codes differ by one, so exactly one of them is even on a tie.
    let c = if dl < dh || (dl == dh && lo % 2 == 0) {
        lo
    } else {
        hi
    };
    c as u8 | sign
}

#[test]
fn boundary_encodings_are_exact() {
    // (value, code) reasoned from the format: normal = (1 + m/8) * 2^(e - 7), subnormal = m * 2^-9.
    let cases: &[(f32, u8)] = &[
        (0.0, 0x00),
        (-0.0, 0x80),
        (1.0, 0x38),                        // e = 7, m = 0
        (448.0, 0x7E),                      // 1.75 * 2^8: e = 15, m = 6
        (-448.0, 0xFE),                     //
        (464.0, 0x7E),                      // tie 448 (m = 6, even) / 480 (overflow): 448
        (1e6, 0x7E),                        // saturates
        (f32::INFINITY, 0x7E),              //
        (f32::NEG_INFINITY, 0xFE),          //
        (2f32.powi(-6), 0x08),              // min normal: e = 1, m = 0
        (2f32.powi(-9), 0x01),              // min subnormal
        (7.0 * 2f32.powi(-9), 0x07),        // max subnormal
        (2f32.powi(-10), 0x00),             // tie 0 / 2^-9: even 0
        (-(2f32.powi(-10)), 0x80),          // same, negative zero
        (3.0 * 2f32.powi(-10), 0x02),       // tie codes 1 / 2: even 2
        (1.0625, 0x38),                     // tie 1.0 (m = 0) / 1.125 (m = 1): 1.0
        (1.1875, 0x3A),                     // tie 1.125 (m = 1) / 1.25 (m = 2): 1.25
        (15.0, 0x57),                       // 1.875 * 2^3: e = 10, m = 7
        (240.0, 0x77),                      // 1.875 * 2^7: e = 14, m = 7
        (256.0, 0x78),                      // 2^8: e = 15, m = 0
        (416.0, 0x7D),                      // 1.625 * 2^8: m = 5
        (432.0, 0x7E),                      // tie 416 (m = 5) / 448 (m = 6): 448
        (2f32.powi(-10) * 1.000_001, 0x01), // just above the first tie
    ];
    let xs: Vec<f32> = cases.iter().map(|c| c.0).collect();
    for ((x, want), got) in cases.iter().zip(encode(&xs)) {
        assert_eq!(got, *want, "{x:e}: got {got:#04x}, want {want:#04x}");
        assert_eq!(
            ref_encode(*x),
            *want,
            "reference encoder disagrees at {x:e}"
        );
    }
    let nan = encode(&[f32::NAN, -f32::NAN]);
    assert!(nan.iter().all(|&b| is_nan_code(b)), "{nan:?}");
}

#[test]
fn conversion_matches_reference_at_every_rounding_boundary() {
    // Every code value, every midpoint between neighbours (exact in f32: at most 5 significant
    // bits), and the f32 neighbours of each: a monotone rounding that is right there is right
    // between them. Then a strided sweep over all f32 bit patterns.
    let mut xs = vec![];
    let nudge = |x: f32| {
        [
            f32::from_bits(x.to_bits() - 1),
            x,
            f32::from_bits(x.to_bits() + 1),
        ]
    };
    for c in 1..=0x7Eu8 {
        let v = ref_decode(c).unwrap();
        let mid = (v + ref_decode(c - 1).unwrap()) / 2.0;
        xs.extend(nudge(v as f32));
        xs.extend(nudge(mid as f32));
    }
    xs.extend(nudge(464.0));
    xs.extend([0.0, f32::MIN_POSITIVE, 1e-45, f32::MAX, f32::INFINITY]);
    xs.extend((0..u32::MAX).step_by(4093).map(f32::from_bits));
    xs.retain(|x| !x.is_nan());
    let negs: Vec<f32> = xs.iter().map(|x| -x).collect();
    xs.extend(negs);
    for (x, got) in xs.iter().zip(encode(&xs)) {
        assert_eq!(got, ref_encode(*x), "{x:e} ({:#010x})", x.to_bits());
    }
}

#[test]
fn every_finite_code_round_trips() {
    let all: Vec<u8> = (0..=255).collect();
    let q = code_tensor(&all, &[256]);
    for scale in [1.0f32, 0.037, 3.1e-5, 17.0] {
        let deq = f32s(&dequantize_per_tensor(&q, scale).unwrap());
        // deq = fl(v * s) and fl(deq / s) = v (1 + d), |d| <= 2u: far inside v's half-spacing.
        let back = codes(&quantize_with_scale(&t32(&deq, &[256]), scale).unwrap());
        for ((&c, &b), &d) in all.iter().zip(&back).zip(&deq) {
            match ref_decode(c) {
                None => assert!(d.is_nan() && is_nan_code(b), "code {c:#04x}"),
                Some(v) => {
                    assert_eq!(b, c, "scale {scale}: code {c:#04x} came back as {b:#04x}");
                    assert_eq!(d, v as f32 * scale, "scale {scale}: code {c:#04x}");
                }
            }
        }
    }
    // amax of the finite codes is 448, so the dynamic scale is exactly 1.
    let finite: Vec<u8> = all.into_iter().filter(|&c| !is_nan_code(c)).collect();
    let deq = f32s(&dequantize_per_tensor(&code_tensor(&finite, &[254]), 1.0).unwrap());
    let (q, s) = quantize_per_tensor(&t32(&deq, &[254])).unwrap();
    assert_eq!(f32s(&s), vec![1.0]);
    assert_eq!(codes(&q), finite);
}

// ---------------------------------------------------------------------------------------------
// Random data and the round-trip check shared by every scheme.

#[derive(Clone, Copy, Debug)]
enum Dist {
    Normal,
    /// Heavy tails: a few elements dominate amax, most fall far below it.
    Cauchy,
    /// N(0, 1) times 2^k, k uniform in [-24, 8]: many binades, many fp8 subnormals and zeros.
    Mixed,
}

const DISTS: [Dist; 3] = [Dist::Normal, Dist::Cauchy, Dist::Mixed];
const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// A seeded random tensor of `dtype`; values are clamped into f16's finite range for f16.
fn random(seed: u64, dist: Dist, shape: &[usize], dtype: DType) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    let cauchy = Cauchy::new(0.0f32, 1.0).unwrap();
    let v: Vec<f32> = (0..n)
        .map(|_| match dist {
            Dist::Normal => normal.sample(&mut rng),
            Dist::Cauchy => cauchy.sample(&mut rng),
            Dist::Mixed => normal.sample(&mut rng) * 2f32.powi(rng.random_range(-24..=8)),
        })
        .map(|x| {
            if dtype == DType::F16 {
                x.clamp(-6e4, 6e4)
            } else {
                x
            }
        })
        .collect();
    Tensor::from_f32(&v, shape, dtype, &cpu()).unwrap()
}

/// Checks a dynamic quantization of `x` (the values the kernel saw) whose element i uses scale
/// `scales[unit(i)]`:
///
/// 1. each scale equals max(amax of its elements, 1e-10) / 448, recomputed here;
/// 2. `deq` is exactly fl(decode(code) * s);
/// 3. the error bound. With y = x / s, ŷ = fl(y) = y(1 + d0), q = rne8(ŷ), deq = q s (1 + d1),
///    |d0|, |d1| <= u = 2^-24:
///    - normal range 2^-6 <= |ŷ|: the spacing in [2^e, 2^(e+1)) is 2^(e-3), so |q - ŷ| <= 2^(e-4),
///      which relative to |ŷ| is worst at the first tie above 2^e: |q - ŷ| <= |ŷ| / 17 (the
///      saturated band (448, 464] gives at most 16/464). So |deq - x| <= s(|q - ŷ| + |ŷ - y| +
///      u|q|) <= |x|(1/17 + 3u) < 2^-4 |x|.
///    - subnormal range |ŷ| < 2^-6: spacing 2^-9, |q - ŷ| <= 2^-10 and |q|, |ŷ| <= 2^-6, so
///      |deq - x| <= s(2^-10 + 2u 2^-6 (1 + u)) <= 2^-10 s (1 + 2^-18).
///    - overall: |x - deq| <= max(2^-4 |x|, 2^-10 s (1 + 2^-18)).
/// 4. the first element with |x| = amax gets code ±0x7E and dequantizes to ±fl(448 s), which is
///    within 1 ulp of amax (fl(448 fl(a / 448)) is; proved exhaustively in the cpu unit tests).
fn check_dynamic(
    what: &str,
    x: &[f32],
    unit: impl Fn(usize) -> usize,
    q: &[u8],
    scales: &[f32],
    deq: &[f32],
) {
    assert_eq!(x.len(), q.len(), "{what}");
    assert_eq!(x.len(), deq.len(), "{what}");
    let mut amax = vec![0.0f32; scales.len()];
    let mut top = vec![None; scales.len()];
    for (i, v) in x.iter().enumerate() {
        let u = unit(i);
        if top[u].is_none() || v.abs() > amax[u] {
            amax[u] = v.abs();
            top[u] = Some(i);
        }
    }
    for (u, (&a, &s)) in amax.iter().zip(scales).enumerate() {
        let want = a.max(1e-10) / 448.0;
        assert_eq!(
            s.to_bits(),
            want.to_bits(),
            "{what}: scale {u}: {s:e} vs {want:e}"
        );
    }
    let sub_bound = 2f32.powi(-10) * (1.0 + 2f32.powi(-18));
    let mut normal_seen = 0usize;
    for (i, ((&xi, &c), &d)) in x.iter().zip(q).zip(deq).enumerate() {
        let s = scales[unit(i)];
        let v = ref_decode(c).unwrap_or_else(|| panic!("{what}: NaN code at {i}"));
        assert_eq!(d.to_bits(), (v as f32 * s).to_bits(), "{what}: deq at {i}");
        let err = (xi - d).abs();
        let bound = (xi.abs() / 16.0).max(sub_bound * s);
        assert!(err <= bound, "{what}: x[{i}] = {xi:e}, deq {d:e}, s {s:e}");
        if (xi / s).abs() >= 2f32.powi(-6) {
            normal_seen += 1;
            assert!(
                err <= xi.abs() * (1.0 / 17.0 + 3.0 * U),
                "{what}: x[{i}] = {xi:e}"
            );
        }
    }
    assert!(
        normal_seen > 0 || x.is_empty(),
        "{what}: no normal-range element"
    );
    for (u, (&a, t)) in amax.iter().zip(&top).enumerate() {
        let Some(i) = *t else { continue };
        if a < 1e-10 {
            continue;
        }
        let s = scales[u];
        assert_eq!(
            q[i] & 0x7F,
            0x7E,
            "{what}: unit {u} top element code {:#04x}",
            q[i]
        );
        assert_eq!(deq[i].abs(), 448.0 * s, "{what}: unit {u}");
        let ulps = deq[i].abs().to_bits().abs_diff(a.to_bits());
        assert!(
            ulps <= 1,
            "{what}: unit {u}: amax {a:e} came back as {:e}",
            deq[i]
        );
    }
}

#[test]
fn per_tensor_round_trip_bounds() {
    for (k, dist) in DISTS.into_iter().enumerate() {
        for (j, dtype) in DTYPES.into_iter().enumerate() {
            let seed = 1000 + 10 * k as u64 + j as u64;
            let x = random(seed, dist, &[37, 53], dtype);
            let (q, s) = quantize_per_tensor(&x).unwrap();
            assert_eq!(q.dims(), &[37, 53]);
            assert_eq!(s.dims(), &[1]);
            let scale = f32s(&s)[0];
            let deq = f32s(&dequantize_per_tensor(&q, scale).unwrap());
            let what = format!("per-tensor {dist:?} {dtype}");
            let xs = x.to_f32_vec().unwrap();
            check_dynamic(&what, &xs, |_| 0, &codes(&q), &[scale], &deq);
            // Static quantization with the same scale gives the same codes.
            assert_eq!(codes(&quantize_with_scale(&x, scale).unwrap()), codes(&q));
        }
    }
}

#[test]
fn per_token_group_round_trip_bounds() {
    let g = FP8_GROUP;
    for m in [1, 3] {
        // 300 = 2 full groups + 44; 64 < one group.
        for k in [128, 256, 300, 64, 7168] {
            for (d, dist) in DISTS.into_iter().enumerate() {
                for (j, dtype) in DTYPES.into_iter().enumerate() {
                    let seed = (m * 100_000 + k * 10 + d) as u64 * 3 + j as u64;
                    let x = random(seed, dist, &[m, k], dtype);
                    let (q, s) = quantize_per_token_group(&x, g).unwrap();
                    let groups = k.div_ceil(g);
                    assert_eq!(q.dims(), &[m, k]);
                    assert_eq!(s.dims(), &[m, groups]);
                    let deq = f32s(&dequantize_per_token_group(&q, &s, g).unwrap());
                    let what = format!("group [{m}, {k}] {dist:?} {dtype}");
                    let xs = x.to_f32_vec().unwrap();
                    let unit = |i: usize| i / k * groups + i % k / g;
                    check_dynamic(&what, &xs, unit, &codes(&q), &f32s(&s), &deq);
                }
            }
        }
    }
}

#[test]
fn per_token_group_leading_dims_and_other_group_sizes() {
    let x = random(7, Dist::Mixed, &[2, 3, 100], DType::F32);
    let xs = x.to_f32_vec().unwrap();
    for g in [1, 32, 100, 128] {
        let (q, s) = quantize_per_token_group(&x, g).unwrap();
        let groups = 100usize.div_ceil(g);
        assert_eq!(s.dims(), &[2, 3, groups]);
        let deq = f32s(&dequantize_per_token_group(&q, &s, g).unwrap());
        let unit = |i: usize| i / 100 * groups + i % 100 / g;
        check_dynamic(
            &format!("group {g}"),
            &xs,
            unit,
            &codes(&q),
            &f32s(&s),
            &deq,
        );
    }
}

/// Scale index of flat element i of a `[.., rows, cols]` tensor under `block`.
fn block_unit(i: usize, rows: usize, cols: usize, block: [usize; 2]) -> usize {
    let (br, bc) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    let (m, r, c) = (i / (rows * cols), i % (rows * cols) / cols, i % cols);
    m * br * bc + r / block[0] * bc + c / block[1]
}

#[test]
fn block_round_trip_bounds() {
    // [576, 256]: ragged rows 512 + 64; [256, 300]: ragged cols; [3, 130, 129]: experts, both.
    let shapes: [&[usize]; 4] = [&[576, 256], &[256, 300], &[3, 130, 129], &[128, 128]];
    for (n, shape) in shapes.into_iter().enumerate() {
        let [.., rows, cols] = *shape else {
            unreachable!()
        };
        let mut want = shape[..shape.len() - 2].to_vec();
        want.extend([rows.div_ceil(128), cols.div_ceil(128)]);
        for (d, dist) in DISTS.into_iter().enumerate() {
            for (j, dtype) in DTYPES.into_iter().enumerate() {
                let seed = 5000 + 100 * n as u64 + 10 * d as u64 + j as u64;
                let w = random(seed, dist, shape, dtype);
                let (q, s) = quantize_block(&w, FP8_BLOCK).unwrap();
                assert_eq!(q.dims(), shape);
                assert_eq!(s.dims(), &want[..]);
                let deq = f32s(&dequantize_block(&q, &s, FP8_BLOCK).unwrap());
                let what = format!("block {shape:?} {dist:?} {dtype}");
                let ws = w.to_f32_vec().unwrap();
                let unit = |i| block_unit(i, rows, cols, FP8_BLOCK);
                check_dynamic(&what, &ws, unit, &codes(&q), &f32s(&s), &deq);
            }
        }
    }
}

#[test]
fn non_square_blocks() {
    let w = random(11, Dist::Cauchy, &[2, 50, 70], DType::BF16);
    let ws = w.to_f32_vec().unwrap();
    let block = [16, 32];
    let (q, s) = quantize_block(&w, block).unwrap();
    assert_eq!(s.dims(), &[2, 4, 3]);
    let deq = f32s(&dequantize_block(&q, &s, block).unwrap());
    let unit = |i| block_unit(i, 50, 70, block);
    check_dynamic("block 16x32", &ws, unit, &codes(&q), &f32s(&s), &deq);
}

#[test]
fn all_zero_units_get_the_floor_scale_and_exact_zeros() {
    let floor = 1e-10f32 / 448.0;
    assert_eq!(scale_from_amax(0.0), floor);

    // Zero block (1, 2) of a [256, 300] weight: rows 128..256, cols 256..300.
    let mut w = random(21, Dist::Normal, &[256, 300], DType::F32)
        .to_f32_vec()
        .unwrap();
    for r in 128..256 {
        w[r * 300 + 256..r * 300 + 300].fill(0.0);
    }
    w[200 * 300 + 280] = -0.0;
    let (q, s) = quantize_block(&t32(&w, &[256, 300]), FP8_BLOCK).unwrap();
    let (c, sv) = (codes(&q), f32s(&s));
    assert_eq!(sv[5], floor);
    let deq = f32s(&dequantize_block(&q, &s, FP8_BLOCK).unwrap());
    for r in 128..256 {
        for i in r * 300 + 256..r * 300 + 300 {
            assert_eq!(c[i] & 0x7F, 0, "code at {i}");
            assert_eq!(deq[i], 0.0, "deq at {i}");
        }
    }
    assert_eq!(c[200 * 300 + 280], 0x80); // -0 keeps its sign
    check_dynamic(
        "zero block",
        &w,
        |i| block_unit(i, 256, 300, FP8_BLOCK),
        &c,
        &sv,
        &deq,
    );

    // Whole tensor and one token group.
    let (q, s) = quantize_per_tensor(&t32(&[0.0; 10], &[10])).unwrap();
    assert_eq!(f32s(&s), vec![floor]);
    assert!(codes(&q).iter().all(|&b| b == 0));
    assert!(
        f32s(&dequantize_per_tensor(&q, floor).unwrap())
            .iter()
            .all(|&v| v == 0.0)
    );
    // 0.875 / 448 = 2^-9 exactly, so dequantization gives 0.875 back exactly.
    let mut x = vec![0.875f32; 2 * 200];
    x[128..200].fill(0.0);
    let (q, s) = quantize_per_token_group(&t32(&x, &[2, 200]), 128).unwrap();
    assert_eq!(
        f32s(&s),
        vec![2f32.powi(-9), floor, 2f32.powi(-9), 2f32.powi(-9)]
    );
    let deq = f32s(&dequantize_per_token_group(&q, &s, 128).unwrap());
    assert_eq!(deq, x);
}

#[test]
fn empty_tensors_do_not_panic() {
    let (q, s) = quantize_per_token_group(&t32(&[], &[3, 0]), 128).unwrap();
    assert_eq!((q.dims(), s.dims()), (&[3, 0][..], &[3, 0][..]));
    let (q, s) = quantize_block(&t32(&[], &[0, 5, 7]), FP8_BLOCK).unwrap();
    assert_eq!(s.dims(), &[0, 1, 1]);
    assert_eq!(
        dequantize_block(&q, &s, FP8_BLOCK).unwrap().dims(),
        &[0, 5, 7]
    );
    let (_, s) = quantize_per_tensor(&t32(&[], &[0])).unwrap();
    assert_eq!(f32s(&s), vec![1e-10 / 448.0]);
}

// ---------------------------------------------------------------------------------------------
// Special values and validation.

fn expect_non_finite(r: fmoe_kernels::Result<(Tensor, Tensor)>, op: &str, name: &str, idx: usize) {
    let err = r.unwrap_err();
    let msg = err.to_string();
    match err {
        Error::Core(fmoe_core::Error::NonFinite { index, .. }) => assert_eq!(index, idx, "{msg}"),
        other => panic!("expected NonFinite, got {other:?}"),
    }
    assert!(msg.contains(op), "{msg}");
    assert!(msg.contains(&format!("`{name}`")), "{msg}");
    assert!(msg.contains(&format!("index {idx}")), "{msg}");
}

#[test]
fn dynamic_quantization_rejects_nan_and_inf_with_first_index() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for dtype in DTYPES {
            let mut v: Vec<f32> = (0..32).map(|i| i as f32 - 10.0).collect();
            v[5] = bad;
            v[8] = f32::NAN; // later in flat order, must not be reported
            let x = Tensor::from_f32(&v, [4, 8], dtype, &cpu()).unwrap();
            expect_non_finite(quantize_per_tensor(&x), "quantize_per_tensor", "x", 5);
            let r = quantize_per_token_group(&x, 3);
            expect_non_finite(r, "quantize_per_token_group", "x", 5);
            // With 2 x 2 blocks, flat 8 (block (0, 0)) is met before flat 5 (block (0, 2)) by a
            // block-by-block scan; the flat-order first must still win.
            expect_non_finite(quantize_block(&x, [2, 2]), "quantize_block", "w", 5);
            let w = x.reshape([2, 2, 8]).unwrap();
            expect_non_finite(quantize_block(&w, FP8_BLOCK), "quantize_block", "w", 5);
        }
    }
}

#[test]
fn static_quantization_keeps_nan_and_saturates_inf() {
    let x = t32(
        &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, 1.0],
        &[6],
    );
    let c = codes(&quantize_with_scale(&x, 0.5).unwrap());
    assert!(is_nan_code(c[0]), "{:#04x}", c[0]);
    assert_eq!(&c[1..], &[0x7E, 0xFE, 0x7E, 0xFE, 0x40]); // 1 / 0.5 = 2 = 0x40
    let deq = f32s(&dequantize_per_tensor(&code_tensor(&c, &[6]), 0.5).unwrap());
    assert!(deq[0].is_nan());
    assert_eq!(&deq[1..], &[224.0, -224.0, 224.0, -224.0, 1.0]);
    // A tiny scale overflows x / s to Inf: still saturates.
    let c = codes(&quantize_with_scale(&t32(&[1e30, -1.0], &[2]), 1e-30).unwrap());
    assert_eq!(c, vec![0x7E, 0xFE]);
}

#[test]
fn quotient_is_a_division() {
    // 10.9375 / 7 = 1.5625 exactly: the tie 1.5 / 1.625 goes to even 1.5 (0x3C). Multiplying by
    // fl(1/7) (slightly above 1/7) gives 1.5625001 and would round up to 0x3D.
    assert!(10.9375f32 * (1.0 / std::hint::black_box(7.0f32)) > 1.5625);
    let c = codes(&quantize_with_scale(&t32(&[10.9375, -10.9375], &[2]), 7.0).unwrap());
    assert_eq!(c, vec![0x3C, 0xBC]);
}

#[test]
fn static_scale_must_be_finite_and_positive() {
    let x = t32(&[1.0, 2.0], &[2]);
    for s in [0.0, -0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let msg = quantize_with_scale(&x, s).unwrap_err().to_string();
        assert!(
            msg.contains("quantize_with_scale") && msg.contains("scale"),
            "{msg}"
        );
    }
}

fn expect_dtype_mismatch<T: std::fmt::Debug>(r: fmoe_kernels::Result<T>, name: &str) {
    match r.unwrap_err() {
        Error::Core(fmoe_core::Error::DTypeMismatch { tensor, .. }) => assert_eq!(tensor, name),
        other => panic!("expected DTypeMismatch for `{name}`, got {other:?}"),
    }
}

#[test]
fn dequantize_rejects_wrong_dtypes() {
    let x = t32(&[1.0; 256], &[2, 128]);
    let (q, s) = quantize_per_token_group(&x, 128).unwrap();
    let (qb, sb) = quantize_block(&x, FP8_BLOCK).unwrap();
    expect_dtype_mismatch(dequantize_per_tensor(&x, 1.0), "q");
    expect_dtype_mismatch(dequantize_per_token_group(&x, &s, 128), "q");
    expect_dtype_mismatch(dequantize_block(&x, &sb, FP8_BLOCK), "q");
    let s16 = s.to_dtype(DType::BF16).unwrap();
    expect_dtype_mismatch(dequantize_per_token_group(&q, &s16, 128), "scales");
    let sb16 = sb.to_dtype(DType::F16).unwrap();
    expect_dtype_mismatch(dequantize_block(&qb, &sb16, FP8_BLOCK), "scale_inv");
    // Quantizing codes or indices is a dtype error too.
    expect_dtype_mismatch(quantize_per_tensor(&q), "x");
    let ids = Tensor::from_vec(vec![1u32, 2], [2], &cpu()).unwrap();
    expect_dtype_mismatch(quantize_with_scale(&ids, 1.0), "x");
    expect_dtype_mismatch(quantize_block(&q, FP8_BLOCK), "w");
}

#[test]
fn dequantize_rejects_wrong_scale_shapes() {
    let x = random(31, Dist::Normal, &[2, 300], DType::F32);
    let (q, s) = quantize_per_token_group(&x, 128).unwrap();
    let bad = t32(&f32s(&s)[..4], &[2, 2]);
    let msg = dequantize_per_token_group(&q, &bad, 128)
        .unwrap_err()
        .to_string();
    for part in ["dequantize_per_token_group", "`scales`", "[2, 3]", "[2, 2]"] {
        assert!(msg.contains(part), "missing {part}: {msg}");
    }
    // The group size must match the one the scales were made with.
    assert!(dequantize_per_token_group(&q, &s, 64).is_err());
    let flat = s.reshape([6]).unwrap();
    assert!(matches!(
        dequantize_per_token_group(&q, &flat, 128),
        Err(Error::ScaleShape { .. })
    ));

    let w = random(32, Dist::Normal, &[3, 130, 129], DType::F32);
    let (qw, sw) = quantize_block(&w, FP8_BLOCK).unwrap();
    let bad = sw.reshape([3, 4]).unwrap();
    let msg = dequantize_block(&qw, &bad, FP8_BLOCK)
        .unwrap_err()
        .to_string();
    for part in ["dequantize_block", "`scale_inv`", "[3, 2, 2]", "[3, 4]"] {
        assert!(msg.contains(part), "missing {part}: {msg}");
    }
    let bad = sw.reshape([2, 3, 2]).unwrap();
    assert!(matches!(
        dequantize_block(&qw, &bad, FP8_BLOCK),
        Err(Error::ScaleShape { .. })
    ));
    assert!(dequantize_block(&qw, &sw, [64, 128]).is_err());
}

#[test]
fn bad_group_block_and_rank_are_errors() {
    let x = t32(&[1.0; 8], &[2, 4]);
    let (q, s) = quantize_per_token_group(&x, 4).unwrap();
    for msg in [
        quantize_per_token_group(&x, 0).unwrap_err().to_string(),
        dequantize_per_token_group(&q, &s, 0)
            .unwrap_err()
            .to_string(),
    ] {
        assert!(msg.contains("group"), "{msg}");
    }
    for block in [[0, 128], [128, 0]] {
        let msg = quantize_block(&x, block).unwrap_err().to_string();
        assert!(msg.contains("block"), "{msg}");
        assert!(dequantize_block(&q, &s, block).is_err());
    }
    let scalar = t32(&[1.0], &[]);
    let msg = quantize_per_token_group(&scalar, 128)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("`x`") && msg.contains("rank"), "{msg}");
    let row = t32(&[1.0; 4], &[4]);
    let msg = quantize_block(&row, FP8_BLOCK).unwrap_err().to_string();
    assert!(msg.contains("`w`") && msg.contains("rank"), "{msg}");
    let qrow = code_tensor(&[0; 4], &[4]);
    let msg = dequantize_block(&qrow, &t32(&[1.0], &[1]), FP8_BLOCK)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("`q`") && msg.contains("rank"), "{msg}");
}

/// The static scale as a tensor: exact codes (x / s, nearest even, saturation at ±448 where x
/// exceeds 448 · s), the same as `quantize_with_scale`; non-finite input and bad scales are
/// errors naming them.
#[test]
fn static_scale_tensor_quantizes_with_saturation() {
    let s = 0.5f32;
    // 1.0 → 2 exactly; 224 → 448; 300 (600 > 448) and 1e6 saturate; 1.0625 / 0.5 = 2.125 lies
    // halfway between codes 2.0 and 2.25 → the even mantissa (2.0); negatives mirror.
    let x = t32(&[1.0, 224.0, 300.0, 1e6, 1.0625, -300.0, 0.0], &[7]);
    let sc = t32(&[s], &[1]);
    let (q, check) = quantize_static_deferred(&x, &sc).unwrap();
    assert!(!check.is_pending());
    let got: Vec<f32> = codes(&q)
        .iter()
        .map(|&c| F8E4M3::from_bits(c).to_f32())
        .collect();
    assert_eq!(got, [2.0, 448.0, 448.0, 448.0, 2.0, -448.0, 0.0]);
    assert_eq!(codes(&q), codes(&quantize_with_scale(&x, s).unwrap()));
    let err = quantize_static_deferred(&t32(&[1.0, f32::NAN], &[2]), &sc)
        .unwrap_err()
        .to_string();
    assert!(err.contains("NaN") && err.contains("1"), "{err}");
    for bad in [0.0, -1.0, f32::INFINITY] {
        let err = quantize_static_deferred(&x, &t32(&[bad], &[1]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("scale"), "{err}");
    }
    let err = quantize_static_deferred(&x, &t32(&[s, s], &[2]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("scale") && err.contains("[2]"), "{err}");
}
