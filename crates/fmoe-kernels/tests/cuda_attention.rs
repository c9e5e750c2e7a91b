//! `attention::causal_attention` on CUDA (and its CPU twin) against an f64 reference written
//! here, on fresh random data: head widths, GQA groups, sliding windows, varlen batches mixing
//! prefill from empty, chunked prefill, decode at long contexts, split and unsplit KV. Every case
//! also runs through a plan made once (`plan_attention`) and used twice, as a forward pass's
//! layers do, which must give the one-call result bit for bit.
//!
//! Allocations are poisoned (0xFF = NaN), and the rows of k/v between sequences and the q rows
//! outside every span hold NaN: a kernel that writes too little or reads outside its span shows
//! up as NaN. Without a CUDA device the GPU tests print "skipping: <reason>" and pass, unless
//! `FMOE_REQUIRE_CUDA=1`. The timing against torch's SDPA is
//! `attention::cuda::tests::timing_vs_peer` (ignored) in the library's unit tests.
//!
//! The `paged_` tests (run them alone with the filter `paged_`) move each case's K/V into a
//! block pool for `plan_attention_paged`: shuffled block ids, NaN in the unused blocks and in the
//! slots past each sequence's end, out-of-range ids in the table entries between the spans'
//! slices (never to be read), and two sequences sharing their prefix blocks. Paged must give the
//! contiguous call's bits on either device, and paged CUDA must match the CPU twin.

use fmoe_core::cuda::test_backend_or_skip;
use fmoe_core::{DType, Device, Error as CoreError, Tensor};
use fmoe_kernels::Error;
use fmoe_kernels::attention::{
    AttentionParams, KvPaging, SeqSpan, causal_attention, causal_attention_planned, plan_attention,
    plan_attention_paged,
};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;

const CUDA: Device = Device::Cuda(0);

/// A batch: per sequence (q_len, past); q rows and k/v rows are laid out with gaps (NaN rows)
/// between sequences, and `extra_q` NaN q rows at the end that no span covers.
struct Case {
    name: String,
    heads: usize,
    kv_heads: usize,
    dq: usize,
    dv: usize,
    window: Option<usize>,
    seqs: Vec<(usize, usize)>,
    extra_q: usize,
}

struct Data {
    spans: Vec<SeqSpan>,
    p: AttentionParams,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    t: usize,
    r: usize,
}

fn build(c: &Case, seed: u64) -> Data {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    let mut spans = Vec::new();
    let (mut t, mut r) = (0, 0);
    for (i, &(q_len, past)) in c.seqs.iter().enumerate() {
        // A one-row gap before every other sequence, in q and in k/v.
        let gap = i % 2;
        spans.push(SeqSpan {
            q_start: t + gap,
            q_len,
            kv_start: r + gap,
            past,
        });
        t += gap + q_len;
        r += gap + past + q_len;
    }
    t += c.extra_q;
    let (qw, kw, vw) = (c.heads * c.dq, c.kv_heads * c.dq, c.kv_heads * c.dv);
    let mut q = vec![f32::NAN; t * qw];
    let mut k = vec![f32::NAN; r * kw];
    let mut v = vec![f32::NAN; r * vw];
    for s in &spans {
        for x in &mut q[s.q_start * qw..(s.q_start + s.q_len) * qw] {
            *x = normal.sample(&mut rng);
        }
        let kv = s.kv_start..s.kv_start + s.past + s.q_len;
        for x in &mut k[kv.start * kw..kv.end * kw] {
            *x = normal.sample(&mut rng);
        }
        for x in &mut v[kv.start * vw..kv.end * vw] {
            *x = normal.sample(&mut rng);
        }
    }
    let p = AttentionParams {
        num_heads: c.heads,
        num_kv_heads: c.kv_heads,
        qk_dim: c.dq,
        v_dim: c.dv,
        scale: 1.0 / (c.dq as f32).sqrt(),
        sliding_window: c.window,
    };
    Data {
        spans,
        p,
        q,
        k,
        v,
        t,
        r,
    }
}

/// softmax(q·kᵀ·scale + mask)·v in f64, straight from the definition (0 for uncovered rows).
fn reference(d: &Data, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f64> {
    let p = &d.p;
    let (h, dq, dv, kvh) = (p.num_heads, p.qk_dim, p.v_dim, p.num_kv_heads);
    let mut out = vec![0f64; d.t * h * dv];
    let rows: Vec<(usize, usize, usize)> = d
        .spans
        .iter()
        .flat_map(|s| (0..s.q_len).map(move |i| (s.q_start + i, s.kv_start, s.past + i)))
        .collect();
    let done: Vec<(usize, Vec<f64>)> = rows
        .par_iter()
        .map(|&(row, kv_start, pos)| {
            let mut o = vec![0f64; h * dv];
            for head in 0..h {
                let kh = head / (h / kvh);
                let qr = &q[row * h * dq + head * dq..][..dq];
                let first = p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let sc: Vec<f64> = (first..=pos)
                    .map(|j| {
                        let kr = &k[(kv_start + j) * kvh * dq + kh * dq..][..dq];
                        qr.iter()
                            .zip(kr)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>()
                            * f64::from(p.scale)
                    })
                    .collect();
                let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (w, j) in e.iter().zip(first..=pos) {
                    let vr = &v[(kv_start + j) * kvh * dv + kh * dv..][..dv];
                    for (a, &b) in o[head * dv..(head + 1) * dv].iter_mut().zip(vr) {
                        *a += w / z * f64::from(b);
                    }
                }
            }
            (row, o)
        })
        .collect();
    for (row, o) in done {
        out[row * h * dv..(row + 1) * h * dv].copy_from_slice(&o);
    }
    out
}

/// max |got - want| / max |want| over covered rows, or what is wrong: a non-finite element,
/// a non-zero uncovered row.
fn rel_err(d: &Data, got: &[f32], want: &[f64]) -> Result<f64, String> {
    let w = d.p.num_heads * d.p.v_dim;
    if got.len() != d.t * w {
        return Err(format!("output length {} != {}", got.len(), d.t * w));
    }
    let mut covered = vec![false; d.t];
    for s in &d.spans {
        covered[s.q_start..s.q_start + s.q_len].fill(true);
    }
    let (mut err, mut scale) = (0f64, 0f64);
    for (row, c) in covered.iter().enumerate() {
        for i in row * w..(row + 1) * w {
            let g = f64::from(got[i]);
            if !g.is_finite() {
                return Err(format!("element {i} (row {row}) is {g}"));
            }
            if *c {
                err = err.max((g - want[i]).abs());
                scale = scale.max(want[i].abs());
            } else if g != 0.0 {
                return Err(format!("uncovered row {row} element {i} is {g}"));
            }
        }
    }
    Ok(if scale == 0.0 { err } else { err / scale })
}

/// Per span: (q_len, past, max |err|, non-finite count), to say which kind of span went wrong.
fn per_span(d: &Data, got: &[f32], want: &[f64]) -> String {
    let w = d.p.num_heads * d.p.v_dim;
    d.spans
        .iter()
        .map(|s| {
            let r = s.q_start * w..(s.q_start + s.q_len) * w;
            let bad = got[r.clone()].iter().filter(|x| !x.is_finite()).count();
            let err = got[r.clone()]
                .iter()
                .zip(&want[r])
                .map(|(&g, &w)| (f64::from(g) - w).abs())
                .filter(|e| e.is_finite())
                .fold(0f64, f64::max);
            format!(
                "(q_len {}, past {}: err {err:.2e}, {bad} non-finite)",
                s.q_len, s.past
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn tensor(v: &[f32], rows: usize, dtype: DType, device: Device) -> Tensor {
    let cols = v.len().checked_div(rows).unwrap_or(0);
    Tensor::from_f32(v, [rows, cols], dtype, &device).unwrap()
}

/// Runs a case on the CPU in f32 and (with a device) on CUDA in `dtype`, both against the f64
/// reference of the values rounded to `dtype`, which both saw.
fn check(c: &Case, dtype: DType, seed: u64, gpu: bool) -> Result<(), String> {
    let d = build(c, seed);
    let (qw, kw, vw) = (c.heads * c.dq, c.kv_heads * c.dq, c.kv_heads * c.dv);
    let round = |x: &[f32], w: usize, rows: usize| {
        let v = tensor(x, rows, dtype, Device::Cpu).to_f32_vec().unwrap();
        assert_eq!(v.len(), rows * w);
        v
    };
    let (q, k, v) = (
        round(&d.q, qw, d.t),
        round(&d.k, kw, d.r),
        round(&d.v, vw, d.r),
    );
    let want = reference(&d, &q, &k, &v);

    let cpu = |x: &[f32], rows| tensor(x, rows, DType::F32, Device::Cpu);
    let out = causal_attention(&cpu(&q, d.t), &cpu(&k, d.r), &cpu(&v, d.r), &d.spans, &d.p)
        .unwrap_or_else(|e| panic!("{} cpu: {e}", c.name));
    let e = rel_err(&d, &out.to_f32_vec().unwrap(), &want)
        .map_err(|e| format!("{} cpu: {e}", c.name))?;
    if e > 1e-5 {
        return Err(format!("{} cpu: error {e:.3e}", c.name));
    }
    if !gpu {
        return Ok(());
    }

    let gq = tensor(&q, d.t, dtype, CUDA);
    let gk = tensor(&k, d.r, dtype, CUDA);
    let gv = tensor(&v, d.r, dtype, CUDA);
    let out = causal_attention(&gq, &gk, &gv, &d.spans, &d.p)
        .map_err(|e| format!("{} {dtype}: {e}", c.name))?;
    assert_eq!(out.dims(), &[d.t, c.heads * c.dv]);
    assert_eq!((out.dtype(), out.device()), (dtype, CUDA));
    let got = out.to_f32_vec().unwrap();
    let plan = plan_attention(d.t, d.r, &d.spans, &d.p, CUDA)
        .map_err(|e| format!("{} {dtype}: plan: {e}", c.name))?;
    for layer in 0..2 {
        let planned = causal_attention_planned(&gq, &gk, &gv, &plan)
            .map_err(|e| format!("{} {dtype}: planned: {e}", c.name))?;
        let same = planned
            .to_f32_vec()
            .unwrap()
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        if !same {
            return Err(format!(
                "{} {dtype}: the planned call (use {layer}) differs from the one-call result",
                c.name
            ));
        }
    }
    let spans = || per_span(&d, &got, &want);
    let e = rel_err(&d, &got, &want)
        .map_err(|e| format!("{} {dtype}: cuda: {e}; per span {}", c.name, spans()))?;
    println!("{} {dtype}: cuda max|err|/max|ref| = {e:.2e}", c.name);
    if e > 2e-2 {
        return Err(format!(
            "{} {dtype}: cuda error {e:.3e}; per span {}",
            c.name,
            spans()
        ));
    }
    Ok(())
}

/// Every case runs; the test fails at the end listing all failures.
fn all_pass(results: Vec<Result<(), String>>) {
    let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(
        failures.is_empty(),
        "{} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A mixed batch: prefill from empty (q_len not a multiple of 64), chunked prefill after a
/// past, decode at several contexts (one q_len 3), and uncovered q rows.
fn mixed(heads: usize, kv_heads: usize, dq: usize, dv: usize, window: Option<usize>) -> Case {
    Case {
        name: format!("mixed h{heads}/kv{kv_heads} d{dq}/{dv} window {window:?}"),
        heads,
        kv_heads,
        dq,
        dv,
        window,
        seqs: vec![(100, 0), (37, 150), (1, 300), (3, 70), (1, 0), (70, 1)],
        extra_q: 2,
    }
}

#[test]
fn head_widths_and_windows() {
    let gpu = test_backend_or_skip().is_some();
    let mut r = Vec::new();
    let mut seed = 1;
    for (dq, dv) in [(16, 16), (24, 16), (64, 64), (128, 128), (192, 128)] {
        for window in [None, Some(48)] {
            r.push(check(&mixed(8, 2, dq, dv, window), DType::BF16, seed, gpu));
            seed += 1;
        }
    }
    r.push(check(
        &mixed(8, 2, 128, 128, Some(48)),
        DType::F16,
        seed,
        gpu,
    ));
    r.push(check(&mixed(4, 4, 64, 64, None), DType::F16, seed + 1, gpu));
    all_pass(r);
}

#[test]
fn gqa_groups() {
    let gpu = test_backend_or_skip().is_some();
    let mut r = Vec::new();
    // Groups 1, 4, 8, 16 (one decode tile exactly) and 32 (decode spans on the prefill kernel).
    for (i, (h, kvh)) in [(8, 8), (32, 8), (32, 4), (16, 1), (32, 1)]
        .into_iter()
        .enumerate()
    {
        let c = mixed(h, kvh, 128, 128, None);
        r.push(check(&c, DType::BF16, 100 + i as u64, gpu));
    }
    // q_len 16 with group 1: 16 packed rows, the largest decode tile.
    let c = Case {
        name: "q_len 16 group 1".into(),
        seqs: vec![(16, 500), (17, 20), (15, 0)],
        extra_q: 0,
        ..mixed(4, 4, 64, 64, Some(100))
    };
    r.push(check(&c, DType::BF16, 120, gpu));
    all_pass(r);
}

#[test]
fn long_decode_and_long_prefill() {
    // Long cases need the device (their reference alone is seconds on a small CPU).
    if test_backend_or_skip().is_none() {
        return;
    }
    let mut r = Vec::new();
    // Decode contexts around the 64-key tiles up to 8192 (split KV), windowed and not.
    for (i, window) in [None, Some(4096), Some(1000)].into_iter().enumerate() {
        let c = Case {
            name: format!("decode 32/8 d128 window {window:?}"),
            seqs: [1, 63, 64, 65, 1000, 4096, 5000, 8192]
                .into_iter()
                .map(|ctx| (1, ctx - 1))
                .collect(),
            extra_q: 0,
            ..mixed(32, 8, 128, 128, window)
        };
        r.push(check(&c, DType::BF16, 200 + i as u64, true));
    }
    // One long prefill (enough tiles that nothing splits), and a chunk at a long past (splits).
    let c = Case {
        name: "prefill 1000 + chunk 20 at past 3000".into(),
        seqs: vec![(1000, 0), (20, 3000)],
        extra_q: 0,
        ..mixed(32, 8, 128, 128, None)
    };
    r.push(check(&c, DType::BF16, 210, true));
    let c = Case {
        name: "windowed prefill 700".into(),
        seqs: vec![(700, 30)],
        extra_q: 0,
        ..mixed(16, 4, 64, 64, Some(200))
    };
    r.push(check(&c, DType::BF16, 211, true));
    all_pass(r);
}

#[test]
fn empty_batches_and_unsupported_inputs() {
    if test_backend_or_skip().is_none() {
        return;
    }
    let p = AttentionParams {
        num_heads: 4,
        num_kv_heads: 2,
        qk_dim: 16,
        v_dim: 16,
        scale: 0.25,
        sliding_window: None,
    };
    let z = |rows, cols, dtype| Tensor::zeros([rows, cols], dtype, &CUDA).unwrap();
    // T = 0.
    let out = causal_attention(
        &z(0, 64, DType::BF16),
        &z(0, 32, DType::BF16),
        &z(0, 32, DType::BF16),
        &[],
        &p,
    )
    .unwrap();
    assert_eq!(out.dims(), &[0, 64]);
    // Rows but no spans (or only empty ones): all zeros, despite poisoned allocations.
    let q = Tensor::full([5, 64], DType::BF16, f32::NAN, &CUDA).unwrap();
    let empty = [SeqSpan {
        q_start: 2,
        q_len: 0,
        kv_start: 0,
        past: 0,
    }];
    let out = causal_attention(
        &q,
        &z(3, 32, DType::BF16),
        &z(3, 32, DType::BF16),
        &empty,
        &p,
    )
    .unwrap();
    assert!(out.to_f32_vec().unwrap().iter().all(|&x| x == 0.0));
    // f32 and widths that are not multiples of 8 are the CPU twin's only.
    let f = z(1, 64, DType::F32);
    let span = [SeqSpan {
        q_start: 0,
        q_len: 1,
        kv_start: 0,
        past: 0,
    }];
    let e =
        causal_attention(&f, &z(1, 32, DType::F32), &z(1, 32, DType::F32), &span, &p).unwrap_err();
    assert!(
        matches!(e, Error::Core(CoreError::Unsupported { .. })),
        "{e}"
    );
    let p12 = AttentionParams { qk_dim: 12, ..p };
    let e = causal_attention(
        &z(1, 48, DType::BF16),
        &z(1, 24, DType::BF16),
        &z(1, 32, DType::BF16),
        &span,
        &p12,
    )
    .unwrap_err();
    assert!(e.to_string().contains("multiples of 8"), "{e}");
    // Mixed devices are an error naming the tensor.
    let cpu_k = Tensor::zeros([1, 32], DType::BF16, &Device::Cpu).unwrap();
    let e = causal_attention(
        &z(1, 64, DType::BF16),
        &cpu_k,
        &z(1, 32, DType::BF16),
        &span,
        &p,
    )
    .unwrap_err();
    assert!(e.to_string().contains("`k`"), "{e}");
}

/// A case's K/V moved into a block pool: the paged spans (`kv_start` = first table entry), the
/// tables, the pool's k and v rows, and what the layout holds (for the tests to assert).
struct Paged {
    spans: Vec<SeqSpan>,
    paging: KvPaging,
    k: Vec<f32>,
    v: Vec<f32>,
    rows: usize,
    /// Blocks the first two sequences share (their common prefix).
    shared: usize,
    /// Table entries (of blocks in use) whose id differs from their rank: the ids are shuffled.
    moved: usize,
}

/// Pages `d` (its values already rounded to the test's dtype) in blocks of `bs`: with `share`,
/// the second sequence's prefix is made equal to the first's (in `d` too, so the contiguous call
/// sees the same K/V) for as many whole blocks as both hold, and both tables point at the same
/// blocks.
fn page(d: &mut Data, bs: usize, share: bool, seed: u64) -> Paged {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (kw, vw) = (d.p.num_kv_heads * d.p.qk_dim, d.p.num_kv_heads * d.p.v_dim);
    let kv_len = |s: &SeqSpan| s.past + s.q_len;
    let shared = match d.spans.get(..2) {
        Some([a, b]) if share => kv_len(a).min(kv_len(b)) / bs,
        _ => 0,
    };
    if shared > 0 {
        let (a, b) = (d.spans[0].kv_start, d.spans[1].kv_start);
        d.k.copy_within(a * kw..(a + shared * bs) * kw, b * kw);
        d.v.copy_within(a * vw..(a + shared * bs) * vw, b * vw);
    }
    let need: usize = d
        .spans
        .iter()
        .map(|s| kv_len(s).div_ceil(bs))
        .sum::<usize>()
        - shared;
    let blocks = need + 3; // three blocks no table uses
    let mut ids: Vec<u32> = (0..blocks as u32).collect();
    ids.shuffle(&mut rng);
    let mut next = ids.into_iter();
    let (mut tables, mut spans): (Vec<u32>, Vec<SeqSpan>) = (Vec::new(), Vec::new());
    for (i, s) in d.spans.iter().enumerate() {
        if i % 2 == 1 {
            tables.push(u32::MAX); // an entry between two slices
        }
        let kv_start = tables.len();
        for b in 0..kv_len(s).div_ceil(bs) {
            let id = if i == 1 && b < shared {
                tables[spans[0].kv_start + b]
            } else {
                next.next().unwrap()
            };
            tables.push(id);
        }
        spans.push(SeqSpan { kv_start, ..*s });
    }
    let rows = blocks * bs;
    let (mut k, mut v) = (vec![f32::NAN; rows * kw], vec![f32::NAN; rows * vw]);
    for (s, ps) in d.spans.iter().zip(&spans) {
        for j in 0..kv_len(s) {
            let row = tables[ps.kv_start + j / bs] as usize * bs + j % bs;
            let src = s.kv_start + j;
            k[row * kw..(row + 1) * kw].copy_from_slice(&d.k[src * kw..(src + 1) * kw]);
            v[row * vw..(row + 1) * vw].copy_from_slice(&d.v[src * vw..(src + 1) * vw]);
        }
    }
    let moved = tables
        .iter()
        .filter(|&&id| id != u32::MAX)
        .enumerate()
        .filter(|&(rank, &id)| id as usize != rank)
        .count();
    Paged {
        spans,
        paging: KvPaging {
            block_size: bs,
            block_tables: tables,
        },
        k,
        v,
        rows,
        shared,
        moved,
    }
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// One paged case: the CPU twin on the paged plan gives the contiguous call's bits (and, unless
/// `long`, the f64 reference within 1e-5); on CUDA (with `gpu`), the paged plan gives the
/// contiguous CUDA call's bits on two uses and matches the paged CPU twin within `check`'s
/// tolerance (both see the values rounded to `dtype`).
#[allow(clippy::too_many_arguments)]
fn check_paged(
    c: &Case,
    bs: usize,
    share: bool,
    dtype: DType,
    seed: u64,
    gpu: bool,
    long: bool,
) -> Result<(), String> {
    let name = format!("{} block {bs} {dtype}", c.name);
    let mut d = build(c, seed);
    let round = |x: &[f32], rows| tensor(x, rows, dtype, Device::Cpu).to_f32_vec().unwrap();
    d.q = round(&d.q, d.t);
    d.k = round(&d.k, d.r);
    d.v = round(&d.v, d.r);
    let pg = page(&mut d, bs, share, seed + 1000);
    if pg.moved == 0 || (share && pg.shared == 0) {
        return Err(format!(
            "{name}: the layout is not paged as meant ({} moved, {} shared)",
            pg.moved, pg.shared
        ));
    }
    let cpu = |x: &[f32], rows| tensor(x, rows, DType::F32, Device::Cpu);
    let (q, k, v) = (cpu(&d.q, d.t), cpu(&d.k, d.r), cpu(&d.v, d.r));
    let contiguous = causal_attention(&q, &k, &v, &d.spans, &d.p)
        .map_err(|e| format!("{name} cpu: {e}"))?
        .to_f32_vec()
        .unwrap();
    let plan = plan_attention_paged(d.t, pg.rows, &pg.spans, &d.p, &pg.paging, Device::Cpu)
        .map_err(|e| format!("{name} cpu: paged plan: {e}"))?;
    let (pk, pv) = (cpu(&pg.k, pg.rows), cpu(&pg.v, pg.rows));
    let twin = causal_attention_planned(&q, &pk, &pv, &plan)
        .map_err(|e| format!("{name} cpu: paged: {e}"))?
        .to_f32_vec()
        .unwrap();
    if !bits_equal(&twin, &contiguous) {
        return Err(format!("{name} cpu: paged differs from contiguous"));
    }
    if !long {
        let want = reference(&d, &d.q, &d.k, &d.v);
        let e = rel_err(&d, &twin, &want).map_err(|e| format!("{name} cpu: {e}"))?;
        if e > 1e-5 {
            return Err(format!("{name} cpu: error {e:.3e}"));
        }
    }
    if !gpu {
        return Ok(());
    }

    let gq = tensor(&d.q, d.t, dtype, CUDA);
    let (gk, gv) = (
        tensor(&d.k, d.r, dtype, CUDA),
        tensor(&d.v, d.r, dtype, CUDA),
    );
    let contiguous = causal_attention(&gq, &gk, &gv, &d.spans, &d.p)
        .map_err(|e| format!("{name} cuda: {e}"))?
        .to_f32_vec()
        .unwrap();
    let plan = plan_attention_paged(d.t, pg.rows, &pg.spans, &d.p, &pg.paging, CUDA)
        .map_err(|e| format!("{name} cuda: paged plan: {e}"))?;
    let (pk, pv) = (
        tensor(&pg.k, pg.rows, dtype, CUDA),
        tensor(&pg.v, pg.rows, dtype, CUDA),
    );
    for layer in 0..2 {
        let got = causal_attention_planned(&gq, &pk, &pv, &plan)
            .map_err(|e| format!("{name} cuda: paged: {e}"))?
            .to_f32_vec()
            .unwrap();
        if !bits_equal(&got, &contiguous) {
            let want: Vec<f64> = contiguous.iter().map(|&x| f64::from(x)).collect();
            return Err(format!(
                "{name} cuda: paged (use {layer}) differs from contiguous; per span {}",
                per_span(&d, &got, &want)
            ));
        }
    }
    let want: Vec<f64> = twin.iter().map(|&x| f64::from(x)).collect();
    let spans = || per_span(&d, &contiguous, &want);
    let e = rel_err(&d, &contiguous, &want)
        .map_err(|e| format!("{name} cuda: {e}; per span {}", spans()))?;
    println!("{name}: paged cuda vs cpu twin max|err|/max|ref| = {e:.2e}");
    if e > 2e-2 {
        return Err(format!(
            "{name} cuda: error {e:.3e} vs the cpu twin; per span {}",
            spans()
        ));
    }
    Ok(())
}

/// The paged cases: block sizes 1 to 64 (24: not a power of two), GQA groups 1 to 4, MLA's
/// 192/128, windows; the mixed batch's first two sequences share their prefix blocks.
fn paged_cases() -> Vec<(Case, usize)> {
    vec![
        (mixed(8, 2, 64, 64, None), 1),
        (mixed(8, 2, 64, 64, Some(48)), 2),
        (mixed(8, 2, 192, 128, None), 4),
        (mixed(8, 2, 192, 128, Some(48)), 4),
        (mixed(32, 8, 128, 128, None), 8),
        (mixed(4, 4, 128, 128, Some(48)), 16),
        (mixed(8, 2, 24, 16, None), 16),
        (mixed(8, 1, 128, 128, None), 24),
        (mixed(8, 2, 128, 128, Some(100)), 32),
        (mixed(8, 2, 192, 128, None), 64),
    ]
}

#[test]
fn paged_cpu_twin_matches_contiguous_bit_for_bit() {
    let r = paged_cases()
        .iter()
        .enumerate()
        .map(|(i, (c, bs))| check_paged(c, *bs, true, DType::BF16, 300 + i as u64, false, false))
        .collect();
    all_pass(r);
}

#[test]
fn paged_cuda_matches_contiguous_and_the_cpu_twin() {
    let gpu = test_backend_or_skip().is_some();
    if !gpu {
        return;
    }
    let r = paged_cases()
        .iter()
        .enumerate()
        .map(|(i, (c, bs))| check_paged(c, *bs, true, DType::BF16, 400 + i as u64, true, false))
        .chain([check_paged(
            &mixed(8, 2, 128, 128, Some(48)),
            16,
            true,
            DType::F16,
            420,
            true,
            false,
        )])
        .collect();
    all_pass(r);
}

#[test]
fn paged_cuda_long_decode_and_chunked_prefill() {
    // Long cases need the device (their CPU twin alone is seconds on a small CPU).
    if test_backend_or_skip().is_none() {
        return;
    }
    let mut r = Vec::new();
    // 8 sequences decoding at 4000 cached tokens: split KV (see plan.rs's paged decode test).
    let c = Case {
        name: "paged decode 8 x 4000".into(),
        seqs: vec![(1, 4000); 8],
        extra_q: 0,
        ..mixed(32, 8, 128, 128, None)
    };
    r.push(check_paged(&c, 16, true, DType::BF16, 500, true, true));
    // A 256-token chunk over a 3000-token cached prefix (and a decode sharing that prefix).
    let c = Case {
        name: "paged chunk 256 at past 3000".into(),
        seqs: vec![(256, 3000), (1, 3100)],
        extra_q: 0,
        ..mixed(32, 8, 128, 128, None)
    };
    r.push(check_paged(&c, 16, true, DType::BF16, 501, true, true));
    let c = Case {
        name: "paged MLA chunk 100 at past 3000, window 1000".into(),
        seqs: vec![(100, 3000), (1, 3000)],
        extra_q: 0,
        ..mixed(16, 16, 192, 128, Some(1000))
    };
    r.push(check_paged(&c, 64, true, DType::BF16, 502, true, true));
    all_pass(r);
}
