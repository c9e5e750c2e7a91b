//! The dense-path ops on CUDA (`linear`, `norm`, `rotary`, `elementwise::{silu_mul, gather_rows,
//! gather_rows_at, narrow_cols, narrow_rows, concat_heads, rand_uniform}`,
//! `kv_cache::append_rows`) against independent f64 references written here, on fresh seeded random data at odd sizes and at Mixtral / DeepSeek-V3 widths.
//!
//! Allocations are poisoned (0xFF bytes: NaN in every float dtype), so an element a kernel never
//! writes fails its comparison (every check is `diff <= tol`, false for NaN). Tolerances, per
//! output element with reference value `r`:
//! - bf16 outputs: |got − r| ≤ 2⁻⁷·|r| + slack (one rounding to bf16 is ≤ 2⁻⁹ relative; the f32
//!   arithmetic before it can flip an intermediate rounding, hence a few ulps), f16: 2⁻¹⁰·|r|,
//!   f32: 2⁻¹⁷·|r| (f32 vs f64 summation order), plus half the dtype's smallest subnormal step
//!   (f16 results below 6.1e-5 round on an absolute grid of 2⁻²⁴); `slack` is the op's own
//!   arithmetic scale (e.g. Σ|x·w| for linear times the accumulation error), stated at each
//!   check.
//! - copies and the dummy generator: bit-exact.
//!
//! Without a CUDA device every test prints "skipping: <reason>" and passes, unless
//! `FMOE_REQUIRE_CUDA=1`, which turns a skip into a failure. `linear_mixtral_shapes_timed` prints
//! informal M = 1 timings (run with `--test-threads=1 --nocapture` to see them undisturbed).

use fmoe_core::cuda::cudarc::driver::sys::CUevent_flags;
use fmoe_core::cuda::{CudaBackend, set_poison_allocations, test_backend_or_skip};
use fmoe_core::{DType, Device, Storage, Tensor};
use fmoe_kernels::elementwise::{
    RowIndex, concat_heads, gather_rows, gather_rows_at, narrow_cols, narrow_rows, rand_uniform,
    silu_mul, sum,
};
use fmoe_kernels::kv_cache::{KvSource, append_rows};
use fmoe_kernels::linear::linear;
use fmoe_kernels::norm::{add_rms_norm, rms_norm};
use fmoe_kernels::rotary::{RotaryStyle, apply_rotary};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

const CUDA: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;
const FLOATS: [DType; 3] = [DType::BF16, DType::F16, DType::F32];
const ROWS: [usize; 4] = [0, 1, 7, 300];

/// Normal values times `scale`, rounded to `dtype`, on the host; also their exact values.
fn normal(dims: &[usize], dtype: DType, scale: f32, seed: u64) -> (Tensor, Vec<f64>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let z: f32 = StandardNormal.sample(&mut rng);
            scale * z
        })
        .collect();
    let t = Tensor::from_f32(&v, dims, dtype, &CPU).unwrap();
    let exact = t
        .to_f32_vec()
        .unwrap()
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    (t, exact)
}

/// The relative size of one rounding to `dtype` (half an ulp is 2^-(mantissa+1)), loosened to a
/// few ulps for the f32 arithmetic that precedes it.
fn rel_tol(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
        _ => 2f64.powi(-17),
    }
}

/// Half the smallest subnormal spacing of `dtype`: the absolute part of a rounding's error, which
/// the relative part misses for subnormal results (f16's start below 6.1e-5).
fn abs_tol(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-134),
        DType::F16 => 2f64.powi(-25),
        _ => 2f64.powi(-150),
    }
}

/// `v` rounded to `dtype` and back (the reference's DT(·)).
fn round(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::BF16 => f64::from(fmoe_core::bf16::from_f64(v).to_f32()),
        DType::F16 => f64::from(fmoe_core::f16::from_f64(v).to_f32()),
        _ => f64::from(v as f32),
    }
}

fn download(t: &Tensor) -> Vec<f64> {
    assert_eq!(t.device(), CUDA, "output left the device");
    t.to_f32_vec()
        .unwrap()
        .iter()
        .map(|&x| f64::from(x))
        .collect()
}

/// Asserts |got − want| ≤ tol(i) element by element (NaN fails).
fn check(what: &str, got: &[f64], want: &[f64], tol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let t = tol(i);
        assert!(
            (g - w).abs() <= t,
            "{what}: element {i}: got {g}, want {w} (tol {t})"
        );
    }
}

/// Raw bits of a host tensor, for exact comparisons (NaN payloads and -0.0 included).
fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.to_device(CPU).unwrap();
    match t.storage() {
        Storage::Cpu(s) => match s {
            fmoe_core::CpuStorage::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            fmoe_core::CpuStorage::BF16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
            fmoe_core::CpuStorage::F16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
            fmoe_core::CpuStorage::F8E4M3(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
            fmoe_core::CpuStorage::U32(v) => v.clone(),
        },
        Storage::Cuda(_) => unreachable!("downloaded"),
    }
}

/// Median of `iters` CUDA-event timings of `work`, in ms.
fn median_ms(backend: &CudaBackend, iters: usize, mut work: impl FnMut()) -> f64 {
    let stream = backend.stream();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            let start = stream.record_event(timing).unwrap();
            work();
            let end = stream.record_event(timing).unwrap();
            f64::from(start.elapsed_ms(&end).unwrap())
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// y = x·wᵀ in f64 at the given output positions, with Σ|x·w| (the accumulation error's scale).
fn linear_ref(x: &[f64], w: &[f64], k: usize, at: &[(usize, usize)]) -> Vec<(f64, f64)> {
    at.iter()
        .map(|&(i, j)| {
            let (xr, wr) = (&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
            let dot = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
            let abs = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum();
            (dot, abs)
        })
        .collect()
}

#[test]
fn linear_matches_f64_at_odd_and_model_sizes() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut seed = 100;
    for &(n, k) in &[(13usize, 37usize), (1, 8), (4096, 4096), (100, 14336)] {
        for &m in &ROWS {
            for dtype in FLOATS {
                seed += 1;
                let (x, xv) = normal(&[m, k], dtype, 1.0, seed);
                let (w, wv) = normal(&[n, k], dtype, 0.05, seed + 1000);
                let (xg, wg) = (x.to_device(CUDA).unwrap(), w.to_device(CUDA).unwrap());
                // Full check for small outputs, 500 random positions for large ones.
                let at: Vec<(usize, usize)> = if m * n <= 20_000 {
                    (0..m).flat_map(|i| (0..n).map(move |j| (i, j))).collect()
                } else {
                    (0..500)
                        .map(|_| (rng.random_range(0..m), rng.random_range(0..n)))
                        .collect()
                };
                let refs = linear_ref(&xv, &wv, k, &at);
                for out in [dtype, DType::F32] {
                    let y = linear(&xg, &wg, out).unwrap();
                    assert_eq!((y.dims(), y.dtype()), (&[m, n][..], out));
                    let yv = download(&y);
                    let got: Vec<f64> = at.iter().map(|&(i, j)| yv[i * n + j]).collect();
                    let want: Vec<f64> = refs.iter().map(|r| r.0).collect();
                    // Accumulation: f32 products of exact inputs, f32 sums: ≤ ~k·2⁻²⁴·Σ|x·w|;
                    // bounded here by 2⁻¹⁶·Σ|x·w| (K ≤ 14336 < 2⁸ · 64).
                    check(
                        &format!("linear {dtype}->{out} m={m} n={n} k={k}"),
                        &got,
                        &want,
                        |i| {
                            refs[i].1 * 2f64.powi(-16) + rel_tol(out) * want[i].abs() + abs_tol(out)
                        },
                    );
                }
            }
        }
    }
    // K = 0 gives zeros; errors name the op.
    let x = Tensor::zeros([3, 0], DType::BF16, &CUDA).unwrap();
    let w = Tensor::zeros([5, 0], DType::BF16, &CUDA).unwrap();
    assert_eq!(
        download(&linear(&x, &w, DType::F32).unwrap()),
        vec![0.0; 15]
    );
    let xc = Tensor::zeros([3, 4], DType::BF16, &CPU).unwrap();
    let wg = Tensor::zeros([5, 4], DType::BF16, &CUDA).unwrap();
    let msg = linear(&xc, &wg, DType::F32).unwrap_err().to_string();
    assert!(msg.contains("linear") && msg.contains("`w`"), "{msg}");
}

#[test]
fn linear_mixtral_shapes_timed() {
    let Some(b) = test_backend_or_skip() else {
        return;
    };
    let k = 4096;
    let blocker = rand_uniform(&[1 << 31], DType::BF16, 1.0, 0.0, 9, &CUDA).unwrap();
    for n in [4096usize, 14336] {
        let w = rand_uniform(&[n, k], DType::BF16, 0.03, 0.0, 7, &CUDA).unwrap();
        let x = rand_uniform(&[1, k], DType::BF16, 1.0, 0.0, 8, &CUDA).unwrap();
        // Correctness at this shape first (f64 reference on the downloaded operands).
        let (xv, wv) = (download(&x), download(&w));
        let at: Vec<(usize, usize)> = (0..n).step_by(97).map(|j| (0, j)).collect();
        let refs = linear_ref(&xv, &wv, k, &at);
        let y = download(&linear(&x, &w, DType::BF16).unwrap());
        let got: Vec<f64> = at.iter().map(|&(_, j)| y[j]).collect();
        let want: Vec<f64> = refs.iter().map(|r| r.0).collect();
        check(&format!("linear timed n={n}"), &got, &want, |i| {
            refs[i].1 * 2f64.powi(-16) + rel_tol(DType::BF16) * want[i].abs() + abs_tol(DType::BF16)
        });
        set_poison_allocations(false);
        for _ in 0..3 {
            linear(&x, &w, DType::BF16).unwrap();
        }
        // Host-paced: events around each call, so launch overhead (allocation, cuBLAS's host
        // work) counts when it exceeds the GPU time.
        let paced = median_ms(&b, 50, || {
            linear(&x, &w, DType::BF16).unwrap();
        });
        // GPU time: ~1 ms of other work first lets the host queue all `REPS` calls before the
        // GPU reaches them, so the events see back-to-back execution.
        const REPS: usize = 20;
        let mut per_call = Vec::new();
        for _ in 0..7 {
            sum(&blocker).unwrap();
            let start = b
                .stream()
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .unwrap();
            for _ in 0..REPS {
                linear(&x, &w, DType::BF16).unwrap();
            }
            let end = b
                .stream()
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .unwrap();
            per_call.push(f64::from(start.elapsed_ms(&end).unwrap()) / REPS as f64);
        }
        per_call.sort_by(f64::total_cmp);
        let ms = per_call[per_call.len() / 2];
        set_poison_allocations(true);
        let bytes = (n * k * 2) as f64;
        let tbps = bytes / (ms * 1e-3) / 1e12;
        println!(
            "linear M=1 {n}x{k} bf16: GPU {:.1} us/call back to back = {tbps:.2} TB/s of weights ({:.0}% of a 4.8 TB/s floor of {:.1} us); host-paced {:.1} us/call",
            ms * 1e3,
            100.0 * tbps / 4.8,
            bytes / 4.8e12 * 1e6,
            paced * 1e3
        );
    }
}

/// n = DT(x·inv), y = DT(w·n), inv = 1/sqrt(mean(x²) + eps), in f64.
fn rms_ref(x: &[f64], w: &[f64], h: usize, eps: f64, dtype: DType) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(h) {
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / h as f64 + eps).sqrt();
        y.extend(
            row.iter()
                .zip(w)
                .map(|(v, g)| round(dtype, g * round(dtype, v * inv))),
        );
    }
    y
}

#[test]
fn rms_norm_and_add_rms_norm_match_f64() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let eps = 1e-6f32;
    let mut seed = 200;
    for h in [4096usize, 7168, 37, 100] {
        for &m in &ROWS {
            for dtype in FLOATS {
                seed += 1;
                let (x, xv) = normal(&[m, h], dtype, 3.0, seed);
                let (r, rv) = normal(&[m, h], dtype, 1.0, seed + 1);
                let (w, wv) = normal(&[h], dtype, 0.3, seed + 2);
                let (xg, rg, wg) = (
                    x.to_device(CUDA).unwrap(),
                    r.to_device(CUDA).unwrap(),
                    w.to_device(CUDA).unwrap(),
                );
                // The inner DT(x·inv) may round a near-tie the other way in f32: one ulp of n,
                // times |w|, on top of the final rounding.
                let tol = |want: &[f64], i: usize| {
                    2.0 * rel_tol(dtype) * (want[i].abs() + wv[i % h.max(1)].abs() * 1e-3)
                        + abs_tol(dtype)
                };
                let y = rms_norm(&xg, &wg, eps).unwrap();
                assert_eq!((y.dims(), y.dtype()), (&[m, h][..], dtype));
                let want = rms_ref(&xv, &wv, h, f64::from(eps), dtype);
                check(
                    &format!("rms_norm {dtype} m={m} h={h}"),
                    &download(&y),
                    &want,
                    |i| tol(&want, i),
                );

                let (sum, y) = add_rms_norm(&rg, &xg, &wg, eps).unwrap();
                // r' = DT(f32(r) + f32(x)): exactly what the kernel computes.
                let sum_want = Tensor::from_f32(
                    &rv.iter()
                        .zip(&xv)
                        .map(|(a, b)| *a as f32 + *b as f32)
                        .collect::<Vec<_>>(),
                    [m, h],
                    dtype,
                    &CPU,
                )
                .unwrap();
                assert_eq!(
                    bits(&sum),
                    bits(&sum_want),
                    "add_rms_norm residual {dtype} m={m} h={h}"
                );
                let sv: Vec<f64> = sum_want
                    .to_f32_vec()
                    .unwrap()
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect();
                let want = rms_ref(&sv, &wv, h, f64::from(eps), dtype);
                check(
                    &format!("add_rms_norm {dtype} m={m} h={h}"),
                    &download(&y),
                    &want,
                    |i| tol(&want, i),
                );
            }
        }
    }
}

/// x rotated per head in f64 (cos/sin from the f32 tables).
#[allow(clippy::too_many_arguments)]
fn rotary_ref(
    x: &[f64],
    heads: usize,
    hd: usize,
    off: usize,
    rd: usize,
    cos: &[f32],
    sin: &[f32],
    style: RotaryStyle,
) -> (Vec<f64>, Vec<f64>) {
    let mut y = x.to_vec();
    let mut scale = vec![0f64; x.len()];
    let half = rd / 2;
    for (t, row) in y.chunks_mut(heads * hd).enumerate() {
        for h in 0..heads {
            for i in 0..half {
                let (ia, ib) = match style {
                    RotaryStyle::HalfSplit => (off + i, off + i + half),
                    RotaryStyle::Interleaved => (off + 2 * i, off + 2 * i + 1),
                };
                let (ia, ib) = (h * hd + ia, h * hd + ib);
                let (a, b) = (row[ia], row[ib]);
                let (c, s) = (f64::from(cos[t * half + i]), f64::from(sin[t * half + i]));
                row[ia] = a * c - b * s;
                row[ib] = b * c + a * s;
                let mag = a.abs() + b.abs();
                scale[t * heads * hd + ia] = mag;
                scale[t * heads * hd + ib] = mag;
            }
        }
    }
    (y, scale)
}

#[test]
fn rotary_matches_f64() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    // (heads, head_dim, rot_offset, rot_dim, style): Mixtral q and k, DeepSeek-V3 q (nope 128 +
    // rope 64, interleaved) and its shared rope key, and an odd small geometry.
    let geoms = [
        (32, 128, 0, 128, RotaryStyle::HalfSplit),
        (8, 128, 0, 128, RotaryStyle::HalfSplit),
        (128, 192, 128, 64, RotaryStyle::Interleaved),
        (1, 64, 0, 64, RotaryStyle::Interleaved),
        (3, 10, 2, 6, RotaryStyle::HalfSplit),
        (3, 10, 2, 6, RotaryStyle::Interleaved),
    ];
    let mut seed = 300;
    for &(heads, hd, off, rd, style) in &geoms {
        for &t in &ROWS {
            for dtype in FLOATS {
                seed += 1;
                let (x, xv) = normal(&[t, heads * hd], dtype, 2.0, seed);
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let ang: Vec<f64> = (0..t * rd / 2)
                    .map(|_| rng.random_range(-50.0..50.0))
                    .collect();
                let cos: Vec<f32> = ang.iter().map(|a| a.cos() as f32).collect();
                let sin: Vec<f32> = ang.iter().map(|a| a.sin() as f32).collect();
                // The tables on the host: apply_rotary moves them.
                let ct = Tensor::from_vec(cos.clone(), [t, rd / 2], &CPU).unwrap();
                let st = Tensor::from_vec(sin.clone(), [t, rd / 2], &CPU).unwrap();
                let y = apply_rotary(
                    &x.to_device(CUDA).unwrap(),
                    heads,
                    hd,
                    off,
                    rd,
                    &ct,
                    &st,
                    style,
                )
                .unwrap();
                assert_eq!((y.dims(), y.dtype()), (&[t, heads * hd][..], dtype));
                let (want, mag) = rotary_ref(&xv, heads, hd, off, rd, &cos, &sin, style);
                // Rotated: one rounding of a two-term f32 expression; copied dims: exact (mag 0).
                check(
                    &format!("rotary {style:?} {dtype} t={t} {heads}x{hd} {off}+{rd}"),
                    &download(&y),
                    &want,
                    |i| rel_tol(dtype) * want[i].abs() + 2f64.powi(-22) * mag[i] + abs_tol(dtype),
                );
            }
        }
    }
}

#[test]
fn silu_mul_matches_f64() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let mut seed = 400;
    for i in [14336usize, 37, 1, 2048] {
        for &m in &ROWS {
            for dtype in FLOATS {
                seed += 1;
                let (x, xv) = normal(&[m, 2 * i], dtype, 2.0, seed);
                let y = silu_mul(&x.to_device(CUDA).unwrap()).unwrap();
                assert_eq!((y.dims(), y.dtype()), (&[m, i][..], dtype));
                let mut want = Vec::with_capacity(m * i);
                let mut mag = Vec::with_capacity(m * i);
                for row in xv.chunks(2 * i) {
                    for c in 0..i {
                        let (g, u) = (row[c], row[i + c]);
                        want.push(g / (1.0 + (-g).exp()) * u);
                        mag.push((g * u).abs());
                    }
                }
                // __expf is a few f32 ulps off: 2⁻²⁰ of |g·u| on top of the output rounding.
                check(
                    &format!("silu_mul {dtype} m={m} i={i}"),
                    &download(&y),
                    &want,
                    |k| rel_tol(dtype) * want[k].abs() + 2f64.powi(-20) * mag[k] + abs_tol(dtype),
                );
            }
        }
    }
}

#[test]
fn copies_are_exact() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let dtypes = [
        DType::BF16,
        DType::F16,
        DType::F32,
        DType::F8E4M3,
        DType::U32,
    ];
    for dtype in dtypes {
        for &(v, h) in &[(1000usize, 4096usize), (50, 37), (9, 7168), (4, 1)] {
            let table = match dtype {
                DType::U32 => {
                    let d: Vec<u32> = (0..v * h).map(|_| rng.random()).collect();
                    Tensor::from_vec(d, [v, h], &CPU).unwrap()
                }
                _ => normal(&[v, h], dtype, 4.0, rng.random()).0,
            };
            let tv = bits(&table);
            let tg = table.to_device(CUDA).unwrap();
            for &m in &ROWS {
                // Embedding lookup, repeats included.
                let ids: Vec<u32> = (0..m).map(|_| rng.random_range(0..v as u32)).collect();
                let g = gather_rows(&tg, &ids).unwrap();
                assert_eq!((g.dims(), g.dtype()), (&[m, h][..], dtype));
                let want: Vec<u32> = ids
                    .iter()
                    .flat_map(|&r| tv[r as usize * h..][..h].to_vec())
                    .collect();
                assert_eq!(bits(&g), want, "gather_rows {dtype} v={v} h={h} m={m}");
                // The same ids uploaded once, read twice.
                let index = RowIndex::new(&ids, CUDA).unwrap();
                for _ in 0..2 {
                    let g = gather_rows_at(&tg, &index).unwrap();
                    assert_eq!(bits(&g), want, "gather_rows_at {dtype} v={v} h={h} m={m}");
                }
            }
            // Column and row windows, odd starts.
            for (start, len) in [
                (0, h),
                (h / 3, h - h / 3),
                (1, h.saturating_sub(2)),
                (h - 1, 1),
            ] {
                let c = narrow_cols(&tg, start, len).unwrap();
                let want: Vec<u32> = (0..v)
                    .flat_map(|r| tv[r * h + start..][..len].to_vec())
                    .collect();
                assert_eq!(
                    bits(&c),
                    want,
                    "narrow_cols {dtype} [{v}, {h}] {start}+{len}"
                );
            }
            for (start, len) in [(0, v), (v / 2, v - v / 2), (v - 1, 1), (3.min(v), 0)] {
                let r = narrow_rows(&tg, start, len).unwrap();
                assert_eq!(r.dims(), &[len, h]);
                assert_eq!(
                    bits(&r),
                    tv[start * h..(start + len) * h].to_vec(),
                    "narrow_rows {dtype}"
                );
            }
        }
        let t = Tensor::zeros([4, 3], dtype, &CUDA).unwrap();
        let msg = gather_rows(&t, &[1, 4]).unwrap_err().to_string();
        assert!(msg.contains("id 4 at position 1"), "{msg}");
        let index = RowIndex::new(&[1, 4], CUDA).unwrap();
        let msg = gather_rows_at(&t, &index).unwrap_err().to_string();
        assert!(msg.contains("row id 4"), "{msg}");
    }
}

/// Random bits of `dtype` `[rows, cols]` on the host (u32: any word; floats: normal values).
fn random_rows(rng: &mut ChaCha8Rng, rows: usize, cols: usize, dtype: DType) -> Tensor {
    match dtype {
        DType::U32 => {
            let d: Vec<u32> = (0..rows * cols).map(|_| rng.random()).collect();
            Tensor::from_vec(d, [rows, cols], &CPU).unwrap()
        }
        _ => normal(&[rows, cols], dtype, 3.0, rng.random()).0,
    }
}

/// `kv_cache::append_rows` on CUDA and on the CPU twin: every slab equals its old contents with
/// row `slots[t]` replaced by source row `t`'s columns, bit for bit, at Mixtral (K from its own
/// tensor, V from the q/k/v rows at column 5120), DeepSeek-V3 (latent, and the rope key at column
/// 512 of [latent | k_pe]) and odd geometries (narrow words), one and two streams. The slabs start
/// random, so a row written where it should not be, or not at all, shows.
#[test]
fn kv_append_is_exact() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0x6b76);
    // Per stream (source width, column, slab width).
    let layouts: [&[(usize, usize, usize)]; 4] = [
        &[(1024, 0, 1024), (6144, 5120, 1024)],
        &[(512, 0, 512), (576, 512, 64)],
        &[(7, 1, 3), (5, 0, 5)],
        &[(9, 4, 5)],
    ];
    for dtype in [
        DType::BF16,
        DType::F16,
        DType::F32,
        DType::F8E4M3,
        DType::U32,
    ] {
        for layout in layouts {
            for (tokens, slots_n) in [(1usize, 3usize), (8, 40), (300, 301)] {
                // Distinct slots, in a random order.
                let mut all: Vec<u32> = (0..slots_n as u32).collect();
                for i in (1..all.len()).rev() {
                    all.swap(i, rng.random_range(0..=i));
                }
                let ids = &all[..tokens];
                let srcs: Vec<Tensor> = layout
                    .iter()
                    .map(|&(w, _, _)| random_rows(&mut rng, tokens, w, dtype))
                    .collect();
                let olds: Vec<Tensor> = layout
                    .iter()
                    .map(|&(_, _, w)| random_rows(&mut rng, slots_n, w, dtype))
                    .collect();
                let what = format!("{dtype} {layout:?} T={tokens} S={slots_n}");
                for device in [CUDA, CPU] {
                    let mut slabs: Vec<Tensor> =
                        olds.iter().map(|t| t.to_device(device).unwrap()).collect();
                    if device == CPU {
                        // A fresh buffer: not shared with `olds`.
                        slabs = slabs
                            .iter()
                            .map(|t| Tensor::from_storage(t.storage().clone(), t.dims()).unwrap())
                            .collect();
                    }
                    let on: Vec<Tensor> =
                        srcs.iter().map(|t| t.to_device(device).unwrap()).collect();
                    let sources: Vec<KvSource<'_>> = on
                        .iter()
                        .zip(layout.iter())
                        .map(|(t, &(_, col, _))| KvSource { src: t, col })
                        .collect();
                    let index = RowIndex::new(ids, device).unwrap();
                    append_rows(&mut slabs, &sources, &index).unwrap();
                    for (i, (slab, &(sw, col, w))) in slabs.iter().zip(layout.iter()).enumerate() {
                        assert_eq!(slab.device(), device);
                        let (sb, mut want) = (bits(&srcs[i]), bits(&olds[i]));
                        for (t, &slot) in ids.iter().enumerate() {
                            want[slot as usize * w..][..w]
                                .copy_from_slice(&sb[t * sw + col..][..w]);
                        }
                        assert_eq!(bits(slab), want, "{what} stream {i} on {device}");
                    }
                }
            }
        }
    }
    // Out-of-range slots and shared slabs are refused before any launch.
    let mut slab = [Tensor::zeros([4, 8], DType::BF16, &CUDA).unwrap()];
    let src = Tensor::zeros([2, 8], DType::BF16, &CUDA).unwrap();
    let s = [KvSource { src: &src, col: 0 }];
    let e = append_rows(&mut slab, &s, &RowIndex::new(&[1, 4], CUDA).unwrap()).unwrap_err();
    assert!(e.to_string().contains("row id 4"), "{e}");
    let alias = slab[0].clone();
    let e = append_rows(&mut slab, &s, &RowIndex::new(&[1, 2], CUDA).unwrap()).unwrap_err();
    assert!(e.to_string().contains("shared"), "{e}");
    drop(alias);
    let e = append_rows(&mut slab, &s, &RowIndex::new(&[1, 2], CPU).unwrap()).unwrap_err();
    assert!(e.to_string().contains("ids"), "{e}");
}

#[test]
fn concat_heads_is_exact() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let mut seed = 500;
    // (rows, heads, da, db): MLA keys (128 heads, nope 128 | rope 64), tiny DeepSeek (4, 16 | 8),
    // odd widths, and heads = 1 (a plain column concatenation).
    for &(heads, da, db) in &[
        (128usize, 128usize, 64usize),
        (4, 16, 8),
        (3, 5, 7),
        (1, 576, 3),
    ] {
        for &r in &ROWS {
            for dtype in [DType::BF16, DType::F32, DType::F8E4M3] {
                seed += 1;
                let (a, _) = normal(&[r, heads * da], dtype, 1.0, seed);
                let (bh, _) = normal(&[r, heads, db], dtype, 1.0, seed + 1);
                let (bs, _) = normal(&[r, db], dtype, 1.0, seed + 2);
                let (av, bhv, bsv) = (bits(&a), bits(&bh), bits(&bs));
                let ag = a.to_device(CUDA).unwrap();
                let w = heads * (da + db);
                for (b, bv, shared) in [(&bh, &bhv, false), (&bs, &bsv, true)] {
                    let y = concat_heads(&ag, &b.to_device(CUDA).unwrap(), heads).unwrap();
                    assert_eq!(y.dims(), &[r, w]);
                    let mut want = Vec::with_capacity(r * w);
                    for row in 0..r {
                        for h in 0..heads {
                            want.extend_from_slice(&av[row * heads * da + h * da..][..da]);
                            let bo = if shared {
                                row * db
                            } else {
                                row * heads * db + h * db
                            };
                            want.extend_from_slice(&bv[bo..][..db]);
                        }
                    }
                    assert_eq!(
                        bits(&y),
                        want,
                        "concat_heads {dtype} r={r} {heads}x({da}+{db}) shared={shared}"
                    );
                }
            }
        }
    }
}

#[test]
fn rand_uniform_is_bit_identical_to_the_cpu() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F8E4M3] {
        for (n, scale, offset, seed) in [
            (0usize, 1.0f32, 0.0f32, 1u64),
            (1, 0.5, 1.0, 2),
            (1_000_003, 48.5, 0.0, 3),
            (4097, 0.0346, 0.0, 4),
        ] {
            let c = rand_uniform(&[n], dtype, scale, offset, seed, &CPU).unwrap();
            let g = rand_uniform(&[n], dtype, scale, offset, seed, &CUDA).unwrap();
            assert_eq!(g.device(), CUDA);
            assert_eq!(bits(&g), bits(&c), "rand_uniform {dtype} n={n}");
        }
    }
}
