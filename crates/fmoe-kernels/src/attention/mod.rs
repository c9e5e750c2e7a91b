//! `attention`: causal (optionally sliding-window) softmax attention over a varlen batch, with
//! grouped-query heads and separate q·k and v widths (DeepSeek's MLA: 192/128).
//!
//! [`causal_attention`] takes packed rows: `q [T, heads·qk_dim]`, `k [R, kv_heads·qk_dim]`,
//! `v [R, kv_heads·v_dim]` and one [`SeqSpan`] per sequence saying which q rows and which k/v
//! rows are its own. Query `i` of a span sits at position `past + i` and sees keys `j` with
//! `j <= past + i` (and `past + i - j < window` with a sliding window). Scores, softmax and the
//! weighted sum are f32; the output is `[T, heads·v_dim]` in q's dtype, rows outside every span 0.
//!
//! The CPU twin ([`attend_head`] per (span, head), rayon over the pairs) is public: the models'
//! CPU path calls it directly, on f32 rows it already holds. It takes f32, bf16 and f16.
//!
//! # Paged K/V
//!
//! With [`plan_attention_paged`] k and v are a pool of `num_blocks · block_size` rows and each
//! span reads its keys through a block table ([`KvPaging`]): position `j` of span `s` is row
//! `block_tables[s.kv_start + j / block_size] · block_size + j % block_size`, so `kv_start` is
//! the index of the span's first table entry. Spans may share blocks (a common prefix). Both
//! devices compute exactly what the contiguous call computes on the same logical K/V, bit for
//! bit: the CPU twin runs the same [`attend_head`] arithmetic on rows found through the table,
//! and the CUDA kernels (their `FMOE_ATTN_PAGED` build) only change where each key row of a
//! 64-key tile is loaded from.
//!
//! # CUDA
//!
//! bf16 and f16 (f32 is [`fmoe_core::Error::Unsupported`] there: the tensor-core kernels take
//! 16-bit operands); `qk_dim` and `v_dim` multiples of 8 up to 256 (compiled padded to 16, 32, 64,
//! 128, 192 or 256, the padding zero-filled). FlashAttention-2 style on `mma.sync` m16n8k16, f32
//! softmax and accumulation (`cuda/common/flash_attention.cuh`). The work unit is a tile of
//! *packed rows* — (query, head) pairs of one sequence sharing one kv head, so K/V are read once
//! per GQA group — walking the key tiles of the causal / sliding-window band only.
//! Within a key tile, masked keys get probability 0 and still enter the P·V product, so a NaN
//! or Inf in a masked key's value reaches earlier queries (0·NaN), as in matmul attention
//! (torch, transformers); the CPU twin skips masked keys. Finite inputs give the same result.
//!
//! Kernel choice, per span, with `group = num_heads / num_kv_heads`:
//! - `q_len · group <= 16` → the decode kernel (`attention_decode.cu`, flash-decoding): one
//!   16-row tile per (span, kv head), the 4 warps splitting each 64-key tile;
//! - otherwise → the prefill kernel (`attention_prefill.cu`): tiles of 128 packed rows (64 when a
//!   width exceeds 128), the 4 warps splitting the rows.
//!
//! A mixed batch launches each kernel on its spans. KV splits (split-KV, both kernels): with `n`
//! tiles over all spans, `s = clamp(ceil(2 · SMs / (n · num_kv_heads)), 1, 64)`; a tile whose
//! band has `b` key tiles of 64 keys gets `min(s, ceil(b / 4))` splits, each writing f32 partials
//! that `fmoe_attention_combine` merges. So decode batches and short chunks at long contexts fill
//! the GPU, and a long prefill (enough tiles) never splits. Tiles run heaviest first. One
//! metadata upload per call, no host synchronization.
//!
//! # One plan, many layers
//!
//! Every layer of a forward pass attends over the same spans with the same parameters:
//! [`plan_attention`] validates them and (on CUDA) plans the tiles and uploads their metadata once,
//! and [`causal_attention_planned`] runs a layer on that plan (only the kernels, no host work
//! beyond argument checks). [`causal_attention`] is the two in one call.

mod cpu;
mod cuda;

pub use cpu::{HeadGeometry, attend_head};
pub(crate) use cuda::variants as cuda_variants;

use fmoe_core::{DType, Device, Storage, Tensor};

use crate::{Error, Result};

const OP: &str = "attention::causal_attention";

/// One sequence of a varlen batch. Queries are rows `q_start..q_start+q_len` of q, at positions
/// `past..past+q_len`. The sequence's keys/values for positions `0..past+q_len` are rows
/// `kv_start..kv_start+past+q_len` of k and v; in a paged plan ([`plan_attention_paged`]) they
/// are found through the block table entries from `kv_start` on instead (see [`KvPaging`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    pub q_start: usize,
    pub q_len: usize,
    pub kv_start: usize,
    pub past: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    /// GQA: `num_heads % num_kv_heads == 0`; q head `h` reads kv head `h / (num_heads / num_kv_heads)`.
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// e.g. 128/128 Mixtral, 192/128 DeepSeek MLA, 16/16 and 24/16 for tiny test models.
    pub qk_dim: usize,
    pub v_dim: usize,
    pub scale: f32,
    /// Key `j` is visible to the query at position `p` iff `j <= p && p - j < window`.
    pub sliding_window: Option<usize>,
}

/// Paged K/V (see the module docs): `k`/`v` rows are `num_blocks · block_size`; span `s`'s
/// position `j` is row `block_tables[s.kv_start + j / block_size] · block_size + j % block_size`
/// (so in paged mode [`SeqSpan::kv_start`] is the index of the span's first table entry). The
/// tables of all spans are one list; entries no span reaches are never read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPaging {
    pub block_size: usize,
    pub block_tables: Vec<u32>,
}

impl KvPaging {
    /// The k/v row of position `j` of a span whose table starts at `table_start` (validated
    /// spans only: the entry exists).
    fn row(&self, table_start: usize, j: usize) -> usize {
        self.block_tables[table_start + j / self.block_size] as usize * self.block_size
            + j % self.block_size
    }
}

/// A batch's attention geometry, validated and planned once for every layer of a forward pass
/// (see the module docs): built by [`plan_attention`] or [`plan_attention_paged`], used by
/// [`causal_attention_planned`].
#[derive(Debug)]
pub struct AttentionPlan {
    spans: Vec<SeqSpan>,
    params: AttentionParams,
    q_rows: usize,
    kv_rows: usize,
    device: Device,
    /// How the spans find their k/v rows when they are paged.
    paging: Option<KvPaging>,
    /// The tile plan and its uploaded metadata (CUDA).
    cuda: Option<cuda::Prepared>,
}

impl AttentionPlan {
    pub fn params(&self) -> &AttentionParams {
        &self.params
    }
    pub fn spans(&self) -> &[SeqSpan] {
        &self.spans
    }
    /// The block tables of a paged plan; `None` for contiguous spans.
    pub fn paging(&self) -> Option<&KvPaging> {
        self.paging.as_ref()
    }
}

/// Validates `spans` and `p` for q of `q_rows` rows and k/v of `kv_rows` rows on `device` and
/// plans the call; on CUDA the tile metadata is uploaded here (one host-to-device copy, no
/// synchronization), so that every [`causal_attention_planned`] on the plan is only its kernels.
pub fn plan_attention(
    q_rows: usize,
    kv_rows: usize,
    spans: &[SeqSpan],
    p: &AttentionParams,
    device: Device,
) -> Result<AttentionPlan> {
    plan(q_rows, kv_rows, spans, p, None, device)
}

/// [`plan_attention`] for paged K/V: k and v of `kv_rows` rows are `kv_rows / block_size`
/// blocks, and each span's positions are found through `paging`'s block tables (see
/// [`KvPaging`]). Checks `block_size >= 1`, `kv_rows` a multiple of it, every span's table slice
/// `kv_start .. kv_start + ceil((past + q_len) / block_size)` inside `block_tables`, and every
/// block id in those slices below `kv_rows / block_size`. On CUDA the tables are uploaded with
/// the tile metadata (the same one copy).
pub fn plan_attention_paged(
    q_rows: usize,
    kv_rows: usize,
    spans: &[SeqSpan],
    p: &AttentionParams,
    paging: &KvPaging,
    device: Device,
) -> Result<AttentionPlan> {
    plan(q_rows, kv_rows, spans, p, Some(paging), device)
}

fn plan(
    q_rows: usize,
    kv_rows: usize,
    spans: &[SeqSpan],
    p: &AttentionParams,
    paging: Option<&KvPaging>,
    device: Device,
) -> Result<AttentionPlan> {
    check_params(p)?;
    check_spans(spans, q_rows, kv_rows, paging)?;
    let cuda = match device {
        Device::Cpu => None,
        Device::Cuda(_) => Some(cuda::prepare(
            OP, device, q_rows, kv_rows, spans, p, paging, None,
        )?),
    };
    Ok(AttentionPlan {
        spans: spans.to_vec(),
        params: *p,
        q_rows,
        kv_rows,
        device,
        paging: paging.cloned(),
        cuda,
    })
}

/// [`causal_attention`] on a plan (contiguous or paged): q `[plan's q rows, num_heads·qk_dim]`,
/// k and v of the plan's k/v rows, on the plan's device (each checked, naming the tensor).
pub fn causal_attention_planned(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    plan: &AttentionPlan,
) -> Result<Tensor> {
    let p = &plan.params;
    let (dtype, rows, kv_rows) = check_tensors(q, k, v, p)?;
    q.expect_device(OP, "q", plan.device)?;
    if (rows, kv_rows) != (plan.q_rows, plan.kv_rows) {
        return Err(Error::invalid(
            OP,
            format!(
                "q has {rows} rows and k/v {kv_rows}; the plan was made for {} and {}",
                plan.q_rows, plan.kv_rows
            ),
        ));
    }
    let out_dims = [rows, p.num_heads * p.v_dim];
    match (q.storage(), k.storage(), v.storage(), &plan.cuda) {
        (Storage::Cuda(qs), Storage::Cuda(ks), Storage::Cuda(vs), Some(prep)) => {
            let out = cuda::launch(OP, qs, ks, vs, rows, p, prep)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), out_dims)?)
        }
        _ => {
            let (qf, kf, vf) = (f32_view(q)?, f32_view(k)?, f32_view(v)?);
            let out =
                cpu::causal_attention(&qf, &kf, &vf, rows, &plan.spans, p, plan.paging.as_ref());
            Ok(Tensor::from_f32(&out, out_dims, dtype, &Device::Cpu)?)
        }
    }
}

/// `softmax(q·kᵀ·scale + causal/window mask)·v` per (sequence, head); see the module docs.
///
/// q `[T, num_heads·qk_dim]`, k `[R, num_kv_heads·qk_dim]`, v `[R, num_kv_heads·v_dim]`: one
/// dtype (f32, bf16 or f16), one device. Returns `[T, num_heads·v_dim]` in q's dtype (f32
/// accumulation). Rows of q not covered by a span are zero. Spans must not overlap in q and must
/// stay in bounds.
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[SeqSpan],
    p: &AttentionParams,
) -> Result<Tensor> {
    let dtype = check(q, k, v, spans, p)?;
    let rows = q.dims()[0];
    let out_dims = [rows, p.num_heads * p.v_dim];
    match (q.storage(), k.storage(), v.storage()) {
        (Storage::Cuda(qs), Storage::Cuda(ks), Storage::Cuda(vs)) => {
            let out = cuda::causal_attention(OP, qs, ks, vs, rows, spans, p)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), out_dims)?)
        }
        _ => {
            // f32 inputs are read in place; other dtypes are widened once.
            let (qf, kf, vf) = (f32_view(q)?, f32_view(k)?, f32_view(v)?);
            let out = cpu::causal_attention(&qf, &kf, &vf, rows, spans, p, None);
            Ok(Tensor::from_f32(&out, out_dims, dtype, &Device::Cpu)?)
        }
    }
}

fn f32_view(t: &Tensor) -> Result<std::borrow::Cow<'_, [f32]>> {
    Ok(match t.dtype() {
        DType::F32 => std::borrow::Cow::Borrowed(t.cpu_slice::<f32>(OP, "x")?),
        _ => std::borrow::Cow::Owned(t.to_f32_vec()?),
    })
}

/// Validates everything the kernels rely on; returns the dtype.
fn check(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[SeqSpan],
    p: &AttentionParams,
) -> Result<DType> {
    check_params(p)?;
    let (dtype, t, r) = check_tensors(q, k, v, p)?;
    check_spans(spans, t, r, None)?;
    Ok(dtype)
}

/// dtypes, devices and shapes of q, k, v under `p`; returns (dtype, q rows, k/v rows).
fn check_tensors(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttentionParams,
) -> Result<(DType, usize, usize)> {
    let dtype = q.expect_dtype(OP, "q", &[DType::F32, DType::BF16, DType::F16])?;
    k.expect_dtype(OP, "k", &[dtype])?;
    v.expect_dtype(OP, "v", &[dtype])?;
    k.expect_device(OP, "k", q.device())?;
    v.expect_device(OP, "v", q.device())?;
    let qd = q.expect_rank(OP, "q", 2, "[tokens, num_heads·qk_dim]")?;
    let kd = k.expect_rank(OP, "k", 2, "[kv_rows, num_kv_heads·qk_dim]")?;
    v.expect_rank(OP, "v", 2, "[kv_rows, num_kv_heads·v_dim]")?;
    let (t, r) = (qd[0], kd[0]);
    q.expect_dims(OP, "q", &[t, p.num_heads * p.qk_dim])?;
    k.expect_dims(OP, "k", &[r, p.num_kv_heads * p.qk_dim])?;
    v.expect_dims(OP, "v", &[r, p.num_kv_heads * p.v_dim])?;
    Ok((dtype, t, r))
}

fn check_params(p: &AttentionParams) -> Result<()> {
    // checked_rem covers num_kv_heads = 0 (and avoids `is_multiple_of`, newer than our MSRV).
    if p.num_heads == 0 || p.num_heads.checked_rem(p.num_kv_heads) != Some(0) {
        return Err(Error::invalid(
            OP,
            format!(
                "num_heads {} must be a positive multiple of num_kv_heads {} (>= 1)",
                p.num_heads, p.num_kv_heads
            ),
        ));
    }
    if p.qk_dim == 0 || p.v_dim == 0 {
        return Err(Error::invalid(
            OP,
            format!("qk_dim {} and v_dim {} must be >= 1", p.qk_dim, p.v_dim),
        ));
    }
    if !p.scale.is_finite() {
        return Err(Error::invalid(
            OP,
            format!("scale must be finite, got {}", p.scale),
        ));
    }
    if p.sliding_window == Some(0) {
        // A window of 0 hides every key, the query's own included: softmax over nothing.
        return Err(Error::invalid(OP, "sliding_window must be >= 1 (got 0)"));
    }
    Ok(())
}

/// In bounds (checked arithmetic: huge values are errors, not wraps) and disjoint in q; with
/// `paging`, k/v bounds through the block tables ([`check_paging`]).
fn check_spans(
    spans: &[SeqSpan],
    q_rows: usize,
    kv_rows: usize,
    paging: Option<&KvPaging>,
) -> Result<()> {
    let oob = |i: usize, s: &SeqSpan, what: &str, rows: usize| {
        Error::invalid(
            OP,
            format!("spans[{i}] = {s:?} reaches past the {rows} rows of `{what}`"),
        )
    };
    for (i, s) in spans.iter().enumerate() {
        let q_end = s.q_start.checked_add(s.q_len);
        if q_end.is_none_or(|e| e > q_rows) {
            return Err(oob(i, s, "q", q_rows));
        }
        if paging.is_some() {
            continue;
        }
        let kv_end = s
            .past
            .checked_add(s.q_len)
            .and_then(|n| n.checked_add(s.kv_start));
        if kv_end.is_none_or(|e| e > kv_rows) {
            return Err(oob(i, s, "k/v", kv_rows));
        }
    }
    if let Some(paging) = paging {
        check_paging(spans, kv_rows, paging)?;
    }
    let mut order: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].q_len > 0).collect();
    order.sort_by_key(|&i| spans[i].q_start);
    for w in order.windows(2) {
        let (a, b) = (&spans[w[0]], &spans[w[1]]);
        if a.q_start + a.q_len > b.q_start {
            return Err(Error::invalid(
                OP,
                format!(
                    "spans[{}] = {a:?} and spans[{}] = {b:?} overlap in the rows of `q`",
                    w[0], w[1]
                ),
            ));
        }
    }
    Ok(())
}

/// Paged k/v bounds: `block_size >= 1` dividing `kv_rows`; each span's table slice
/// `kv_start .. kv_start + ceil((past + q_len) / block_size)` inside `block_tables`, and every
/// block id in it below `kv_rows / block_size`.
fn check_paging(spans: &[SeqSpan], kv_rows: usize, paging: &KvPaging) -> Result<()> {
    let KvPaging {
        block_size: bs,
        ref block_tables,
    } = *paging;
    if bs == 0 {
        return Err(Error::invalid(
            OP,
            "paging: block_size must be >= 1 (got 0)",
        ));
    }
    if !kv_rows.is_multiple_of(bs) {
        return Err(Error::invalid(
            OP,
            format!("paging: `k/v` has {kv_rows} rows, not a multiple of block_size {bs}"),
        ));
    }
    let blocks = kv_rows / bs;
    for (i, s) in spans.iter().enumerate() {
        let need = s.past.checked_add(s.q_len).map(|n| n.div_ceil(bs));
        let end = need.and_then(|n| n.checked_add(s.kv_start));
        let Some(end) = end.filter(|&e| e <= block_tables.len()) else {
            let range = match (need, end) {
                (Some(n), Some(e)) => format!("{n} block table entries ({}..{e})", s.kv_start),
                _ => "more block table entries than fit an index".to_string(),
            };
            return Err(Error::invalid(
                OP,
                format!(
                    "paging: spans[{i}] = {s:?} needs {range} in blocks of {bs}, but \
                     block_tables has {} entries",
                    block_tables.len()
                ),
            ));
        };
        for (at, &id) in block_tables.iter().enumerate().take(end).skip(s.kv_start) {
            if id as usize >= blocks {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "paging: block_tables[{at}] = {id} (spans[{i}]'s block {}) is past the \
                         {blocks} blocks of `k/v` ({kv_rows} rows in blocks of {bs})",
                        at - s.kv_start
                    ),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(h: usize, kvh: usize, dq: usize, dv: usize) -> AttentionParams {
        AttentionParams {
            num_heads: h,
            num_kv_heads: kvh,
            qk_dim: dq,
            v_dim: dv,
            scale: 1.0 / (dq as f32).sqrt(),
            sliding_window: None,
        }
    }

    fn tensor(rows: usize, cols: usize, seed: u32, dtype: DType) -> Tensor {
        // Deterministic, irregular values in [-1, 1).
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let x = (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(seed * 97);
                (x >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect();
        Tensor::from_f32(&v, [rows, cols], dtype, &Device::Cpu).unwrap()
    }

    fn span(q_start: usize, q_len: usize, kv_start: usize, past: usize) -> SeqSpan {
        SeqSpan {
            q_start,
            q_len,
            kv_start,
            past,
        }
    }

    /// Straight from the definition, in f64.
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        rows: usize,
        spans: &[SeqSpan],
        p: &AttentionParams,
    ) -> Vec<f64> {
        let (h, dq, dv, kvh) = (p.num_heads, p.qk_dim, p.v_dim, p.num_kv_heads);
        let mut out = vec![0f64; rows * h * dv];
        for s in spans {
            for i in 0..s.q_len {
                let pos = s.past + i;
                for head in 0..h {
                    let kh = head / (h / kvh);
                    let qr = &q[(s.q_start + i) * h * dq + head * dq..][..dq];
                    let vis: Vec<usize> = (0..=pos)
                        .filter(|&j| p.sliding_window.is_none_or(|w| pos - j < w))
                        .collect();
                    let sc: Vec<f64> = vis
                        .iter()
                        .map(|&j| {
                            let kr = &k[(s.kv_start + j) * kvh * dq + kh * dq..][..dq];
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
                    for (w, &j) in e.iter().zip(&vis) {
                        let vr = &v[(s.kv_start + j) * kvh * dv + kh * dv..][..dv];
                        for d in 0..dv {
                            out[(s.q_start + i) * h * dv + head * dv + d] +=
                                w / z * f64::from(vr[d]);
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn cpu_matches_the_definition_on_a_mixed_batch() {
        for (dq, dv, h, kvh, window) in [
            (16, 16, 4, 4, None),
            (24, 16, 8, 2, Some(5)),
            (64, 64, 4, 1, None),
            (192, 128, 2, 1, Some(3)),
        ] {
            let p = AttentionParams {
                sliding_window: window,
                ..params(h, kvh, dq, dv)
            };
            // Prefill from empty, chunked prefill, decode, an uncovered q row (row 12) and an
            // empty span; kv rows of the sequences interleaved with unused rows.
            let spans = [
                span(0, 7, 0, 0),
                span(7, 4, 9, 6),
                span(11, 1, 21, 12),
                span(13, 0, 0, 0),
                span(13, 2, 40, 3),
            ];
            let (t, r) = (15, 45);
            let q = tensor(t, h * dq, 1, DType::F32);
            let k = tensor(r, kvh * dq, 2, DType::F32);
            let v = tensor(r, kvh * dv, 3, DType::F32);
            let out = causal_attention(&q, &k, &v, &spans, &p).unwrap();
            assert_eq!(out.dims(), &[t, h * dv]);
            assert_eq!(out.dtype(), DType::F32);
            let got = out.to_f32_vec().unwrap();
            let want = reference(
                &q.to_f32_vec().unwrap(),
                &k.to_f32_vec().unwrap(),
                &v.to_f32_vec().unwrap(),
                t,
                &spans,
                &p,
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (f64::from(*g) - w).abs() <= 1e-5,
                    "dq={dq} dv={dv} element {i}: {g} vs {w}"
                );
            }
            assert!(got[12 * h * dv..13 * h * dv].iter().all(|&x| x == 0.0));
        }
    }

    #[test]
    fn cpu_is_attend_head_per_head_and_rounds_once_to_q_dtype() {
        let p = AttentionParams {
            sliding_window: Some(4),
            ..params(4, 2, 24, 16)
        };
        let spans = [span(0, 3, 2, 5)];
        let q = tensor(3, 4 * 24, 5, DType::BF16);
        let k = tensor(10, 2 * 24, 6, DType::BF16);
        let v = tensor(10, 2 * 16, 7, DType::BF16);
        let out = causal_attention(&q, &k, &v, &spans, &p).unwrap();
        assert_eq!(out.dtype(), DType::BF16);
        let (qf, kf, vf) = (
            q.to_f32_vec().unwrap(),
            k.to_f32_vec().unwrap(),
            v.to_f32_vec().unwrap(),
        );
        let got = out.to_f32_vec().unwrap();
        for head in 0..4 {
            let qh: Vec<f32> = (0..3)
                .flat_map(|r| qf[r * 96 + head * 24..][..24].to_vec())
                .collect();
            let g = HeadGeometry {
                qk_dim: 24,
                v_dim: 16,
                k_stride: 48,
                k_offset: (head / 2) * 24,
                v_stride: 32,
                v_offset: (head / 2) * 16,
                scale: p.scale,
                sliding_window: Some(4),
            };
            let want = attend_head(&qh, &kf[2 * 48..], &vf[2 * 32..], 5, &g);
            for r in 0..3 {
                for d in 0..16 {
                    let w = fmoe_core::bf16::from_f32(want[r * 16 + d]).to_f32();
                    assert_eq!(
                        got[r * 64 + head * 16 + d],
                        w,
                        "head {head} row {r} dim {d}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_plan_serves_every_layer_and_checks_what_it_is_given() {
        let p = AttentionParams {
            sliding_window: Some(6),
            ..params(4, 2, 16, 16)
        };
        let spans = [span(0, 5, 0, 0), span(5, 1, 8, 9), span(6, 2, 20, 3)];
        let (t, r) = (9, 26);
        let plan = plan_attention(t, r, &spans, &p, Device::Cpu).unwrap();
        assert_eq!((plan.spans(), plan.params()), (&spans[..], &p));
        // Two "layers" on one plan: each as causal_attention computes it, bit for bit.
        for seed in [1, 4] {
            let q = tensor(t, 4 * 16, seed, DType::BF16);
            let k = tensor(r, 2 * 16, seed + 1, DType::BF16);
            let v = tensor(r, 2 * 16, seed + 2, DType::BF16);
            let got = causal_attention_planned(&q, &k, &v, &plan).unwrap();
            let want = causal_attention(&q, &k, &v, &spans, &p).unwrap();
            assert_eq!(got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
        }
        // Tensors that do not fit the plan, and plans that do not fit their spans.
        let q = tensor(t + 1, 64, 1, DType::BF16);
        let k = tensor(r, 32, 2, DType::BF16);
        let e = causal_attention_planned(&q, &k, &k, &plan)
            .unwrap_err()
            .to_string();
        assert!(e.contains("10 rows") && e.contains("made for 9"), "{e}");
        let e = plan_attention(t, 20, &spans, &p, Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("spans[2]") && e.contains("`k/v`"), "{e}");
        let bad = AttentionParams { qk_dim: 0, ..p };
        assert!(plan_attention(t, r, &spans, &bad, Device::Cpu).is_err());
    }

    #[test]
    fn paged_plans_check_their_block_tables() {
        let p = params(4, 2, 16, 16);
        let pg = |block_size, block_tables: &[u32]| KvPaging {
            block_size,
            block_tables: block_tables.to_vec(),
        };
        // 12 k/v rows in blocks of 4: ids 0..3. Span 1 (past 5 + 2 = 7 positions) needs 2
        // entries from 3 on; entry 2 is reached by no span, so its id is never checked.
        let spans = [span(0, 3, 0, 1), span(3, 2, 3, 5)];
        let ok = pg(4, &[2, u32::MAX, u32::MAX, 0, 1]);
        let plan = plan_attention_paged(5, 12, &spans, &p, &ok, Device::Cpu).unwrap();
        assert_eq!(plan.paging(), Some(&ok));
        assert_eq!(
            plan_attention(5, 12, &spans, &p, Device::Cpu)
                .unwrap()
                .paging(),
            None
        );
        let e = |paging: &KvPaging, kv_rows, spans: &[SeqSpan]| {
            let e = plan_attention_paged(5, kv_rows, spans, &p, paging, Device::Cpu)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(OP), "{e}");
            e
        };
        assert!(e(&pg(0, &[0]), 12, &spans).contains("paging: block_size must be >= 1"));
        let m = e(&ok, 10, &spans);
        assert!(m.contains("10 rows") && m.contains("block_size 4"), "{m}");
        let m = e(&pg(4, &[2, 0, 0, 0]), 12, &spans);
        assert!(
            m.contains("spans[1]") && m.contains("2 block table entries (3..5)"),
            "{m}"
        );
        assert!(m.contains("has 4 entries"), "{m}");
        let m = e(&pg(4, &[2, 0, 0, 0, 3]), 12, &spans);
        assert!(
            m.contains("block_tables[4] = 3") && m.contains("spans[1]'s block 1"),
            "{m}"
        );
        assert!(m.contains("3 blocks"), "{m}");
        let m = e(&ok, 12, &[span(0, 1, usize::MAX, 0)]);
        assert!(m.contains("more block table entries than fit"), "{m}");
        assert!(e(&ok, 12, &[span(0, 1, 0, usize::MAX)]).contains("spans[0]"));
        // The q checks stay: bounds and overlap.
        assert!(e(&ok, 12, &[span(4, 3, 0, 0)]).contains("`q`"));
        assert!(e(&ok, 12, &[span(0, 3, 0, 1), span(2, 2, 3, 5)]).contains("overlap"));
        // A paged plan serves tensors of its k/v rows only.
        let q = tensor(5, 64, 1, DType::BF16);
        let k = tensor(8, 32, 2, DType::BF16);
        let m = causal_attention_planned(&q, &k, &k, &plan)
            .unwrap_err()
            .to_string();
        assert!(m.contains("made for 5 and 12"), "{m}");
    }

    #[test]
    fn empty_batches_give_zero_rows() {
        let p = params(2, 1, 16, 16);
        let q = tensor(0, 32, 1, DType::F16);
        let k = tensor(0, 16, 1, DType::F16);
        let out = causal_attention(&q, &k, &k, &[], &p).unwrap();
        assert_eq!(out.dims(), &[0, 32]);
        let q = tensor(3, 32, 1, DType::F16);
        let out = causal_attention(&q, &k, &k, &[span(1, 0, 0, 0)], &p).unwrap();
        assert!(out.to_f32_vec().unwrap().iter().all(|&x| x == 0.0));
    }

    fn err(q: &Tensor, k: &Tensor, v: &Tensor, spans: &[SeqSpan], p: &AttentionParams) -> String {
        let e = causal_attention(q, k, v, spans, p).unwrap_err().to_string();
        assert!(e.starts_with(OP), "{e}");
        e
    }

    #[test]
    fn bad_inputs_are_errors_naming_what_is_wrong() {
        let p = params(4, 2, 16, 8);
        let q = tensor(4, 64, 1, DType::BF16);
        let k = tensor(6, 32, 2, DType::BF16);
        let v = tensor(6, 16, 3, DType::BF16);
        let ok = [span(0, 4, 0, 2)];
        assert!(causal_attention(&q, &k, &v, &ok, &p).is_ok());

        // Heads and widths.
        let e = err(&q, &k, &v, &ok, &params(4, 3, 16, 8));
        assert!(e.contains("num_kv_heads 3"), "{e}");
        assert!(err(&q, &k, &v, &ok, &params(0, 1, 16, 8)).contains("num_heads 0"));
        assert!(err(&q, &k, &v, &ok, &params(4, 2, 0, 8)).contains("qk_dim 0"));
        let e = err(&q, &k, &v, &ok, &params(4, 2, 8, 8));
        assert!(e.contains("`q`") && e.contains("[4, 32]"), "{e}");
        let e = err(&q, &k, &v, &ok, &params(4, 2, 16, 16));
        assert!(e.contains("`v`") && e.contains("[6, 32]"), "{e}");
        let nan = AttentionParams {
            scale: f32::NAN,
            ..p
        };
        assert!(err(&q, &k, &v, &ok, &nan).contains("scale"));
        let w0 = AttentionParams {
            sliding_window: Some(0),
            ..p
        };
        assert!(err(&q, &k, &v, &ok, &w0).contains("sliding_window"));

        // Shapes, dtypes.
        let k5 = tensor(5, 32, 2, DType::BF16);
        let e = err(&q, &k5, &v, &ok, &p);
        assert!(e.contains("`v`"), "{e}");
        let q3 = q.reshape([4, 4, 16]).unwrap();
        let e = err(&q3, &k, &v, &ok, &p);
        assert!(e.contains("`q`") && e.contains("rank 2"), "{e}");
        let kf = k.to_dtype(DType::F32).unwrap();
        let e = err(&q, &kf, &v, &ok, &p);
        assert!(e.contains("`k`") && e.contains("f32"), "{e}");
        let qu = Tensor::from_vec(vec![0u32; 4 * 64], [4, 64], &Device::Cpu).unwrap();
        assert!(err(&qu, &k, &v, &ok, &p).contains("`q`"));

        // Spans: out of bounds in q, in k/v, overflowing, overlapping.
        let e = err(&q, &k, &v, &[span(1, 4, 0, 0)], &p);
        assert!(e.contains("spans[0]") && e.contains("`q`"), "{e}");
        let e = err(&q, &k, &v, &[span(0, 4, 0, 3)], &p);
        assert!(e.contains("spans[0]") && e.contains("`k/v`"), "{e}");
        let e = err(&q, &k, &v, &[span(0, 1, usize::MAX, 0)], &p);
        assert!(e.contains("`k/v`"), "{e}");
        let e = err(&q, &k, &v, &[span(usize::MAX, 2, 0, 0)], &p);
        assert!(e.contains("`q`"), "{e}");
        let e = err(&q, &k, &v, &[span(2, 2, 0, 0), span(0, 3, 0, 0)], &p);
        assert!(e.contains("overlap") && e.contains("spans[1]"), "{e}");
        // Disjoint in q with shared k/v rows is fine (a common prefix).
        assert!(causal_attention(&q, &k, &v, &[span(0, 2, 0, 0), span(2, 2, 0, 0)], &p).is_ok());
    }
}
