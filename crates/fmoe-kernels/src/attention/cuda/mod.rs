//! CUDA twin of [`super::causal_attention`]: `cuda/attention_prefill.cu`, `cuda/attention_decode.cu`
//! (both on the tile routine of `cuda/common/flash_attention.cuh`), compiled by [`crate::nvrtc`].
//!
//! A call is planned on the host ([`plan`](plan::plan) in `plan.rs`, pure and unit-tested), then
//! runs as at most four launches on the backend's stream with no host synchronization: one
//! metadata upload (the tile descriptors of both kernels, the lists of split tiles and, for paged
//! K/V, the block tables), the prefill kernel over its tiles, the decode kernel over its tiles,
//! and `fmoe_attention_combine` for each kernel that split KV. See the module docs of [`super`]
//! for the kernel-choice and split rules. Paged K/V runs the `FMOE_ATTN_PAGED` build of each tile
//! kernel (two more arguments: the block tables and the block size); the combine is shared.

mod plan;

use fmoe_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{CpuStorage, DType, Device, Error as CoreError};

use super::{AttentionParams, KvPaging, SeqSpan};
use crate::catalog::KernelVariant;
use crate::launch::opt_in_smem;
use crate::nvrtc;
use crate::{Error, Result};
use plan::PADDED_DIMS;
use plan::{Kind, TilePlan, padded, plan, prefill_mi};

const PREFILL: &str = "attention_prefill";
const PREFILL_SRC: &str = include_str!("../../../cuda/attention_prefill.cu");
const DECODE: &str = "attention_decode";
const DECODE_SRC: &str = include_str!("../../../cuda/attention_decode.cu");
const COMBINE_ENTRY: &str = "fmoe_attention_combine";

/// `FA_THREADS`.
const THREADS: u32 = 128;
/// Positions, rows and packed rows stay below this, so no 32-bit index in the kernels wraps.
const INDEX_LIMIT: usize = i32::MAX as usize;

impl Kind {
    fn family(self) -> &'static str {
        match self {
            Kind::Prefill => PREFILL,
            Kind::Decode => DECODE,
        }
    }
    fn source(self) -> &'static str {
        match self {
            Kind::Prefill => PREFILL_SRC,
            Kind::Decode => DECODE_SRC,
        }
    }
    fn entry(self) -> &'static str {
        match self {
            Kind::Prefill => "fmoe_attention_prefill",
            Kind::Decode => "fmoe_attention_decode",
        }
    }
}

fn dtype_code(dtype: DType) -> Option<u32> {
    match dtype {
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

/// The define of the tile kernels' paged build.
fn paged_define() -> (&'static str, String) {
    ("FMOE_ATTN_PAGED", "1".to_string())
}

/// A tile kernel's defines; [`paged_define`] last for the paged build (the contiguous build's
/// defines, and so its program, are those without it).
fn tile_defines(
    kind: Kind,
    dtype: u32,
    dq: usize,
    dv: usize,
    mi: usize,
    paged: bool,
) -> Vec<(&'static str, String)> {
    let mut d = vec![
        ("FMOE_ATTN_DTYPE", dtype.to_string()),
        ("DQ", dq.to_string()),
        ("DV", dv.to_string()),
    ];
    if kind == Kind::Prefill {
        d.push(("MI", mi.to_string()));
    }
    if paged {
        d.push(paged_define());
    }
    d
}

/// Every compiled variant: both kernels × bf16/f16 × (DQ, DV) with DV <= DQ (prefill with the
/// [`prefill_mi`] of the widths), and the combine kernel per dtype; then the tile kernels' paged
/// builds (the combine serves both).
pub(crate) fn variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    for dtype in [1u32, 2] {
        for kind in Kind::ALL {
            for (i, &dq) in PADDED_DIMS.iter().enumerate() {
                for &dv in &PADDED_DIMS[..=i] {
                    v.push(KernelVariant {
                        family: kind.family(),
                        source: kind.source(),
                        entry: kind.entry(),
                        defines: tile_defines(kind, dtype, dq, dv, prefill_mi(dq, dv), false),
                    });
                }
            }
        }
        v.push(KernelVariant {
            family: DECODE,
            source: DECODE_SRC,
            entry: COMBINE_ENTRY,
            defines: vec![("FMOE_ATTN_DTYPE", dtype.to_string())],
        });
    }
    let paged: Vec<KernelVariant> = v
        .iter()
        .filter(|k| k.entry != COMBINE_ENTRY)
        .map(|k| KernelVariant {
            defines: [k.defines.clone(), vec![paged_define()]].concat(),
            ..k.clone()
        })
        .collect();
    v.extend(paged);
    v
}

fn unsupported(op: &'static str, device: Device, reason: String) -> Error {
    CoreError::Unsupported { op, device, reason }.into()
}

/// The kernels' dtype code of `dtype` (bf16 or f16), or the Unsupported error.
pub(super) fn dtype_supported(op: &'static str, device: Device, dtype: DType) -> Result<u32> {
    dtype_code(dtype).ok_or_else(|| {
        unsupported(
            op,
            device,
            format!("the CUDA kernels take bf16 or f16, not {dtype} (f32 runs on the CPU twin)"),
        )
    })
}

/// A call's launch plan, independent of the data: padded widths, the prefill kernel's row tiles
/// per warp, both kernels' tile plans and their metadata (with the block tables of paged K/V),
/// uploaded (nothing when no span has a query).
#[derive(Debug)]
pub(crate) struct Prepared {
    dq: usize,
    dv: usize,
    mi: usize,
    plans: [TilePlan; 2],
    /// [prefill desc | decode desc | prefill split list | decode split list | block tables];
    /// `None` when the spans cover no query row.
    meta: Option<CudaStorage>,
    desc_at: [usize; 2],
    list_at: [usize; 2],
    /// Paged K/V: where the block tables start in `meta` (in u32 words) and the block size.
    paged: Option<(usize, u32)>,
    /// q rows the spans cover.
    covered: usize,
}

/// `[rows, heads·v_dim]` in q's dtype. Shapes, dtypes, devices and spans were validated by the
/// caller (see [`super::causal_attention`]).
pub(super) fn causal_attention(
    op: &'static str,
    q: &CudaStorage,
    k: &CudaStorage,
    v: &CudaStorage,
    rows: usize,
    spans: &[SeqSpan],
    p: &AttentionParams,
) -> Result<CudaStorage> {
    run(op, q, k, v, rows, spans, p, None)
}

/// [`causal_attention`] with the prefill kernel's row tiles per warp forced to `mi_override`
/// (the timing test compares both; any `mi` in {1, 2} is correct, only registers differ).
#[allow(clippy::too_many_arguments)]
fn run(
    op: &'static str,
    q: &CudaStorage,
    k: &CudaStorage,
    v: &CudaStorage,
    rows: usize,
    spans: &[SeqSpan],
    p: &AttentionParams,
    mi_override: Option<usize>,
) -> Result<CudaStorage> {
    dtype_supported(op, q.device(), q.dtype())?;
    let kv_rows = k.len() / (p.num_kv_heads * p.qk_dim);
    let prep = prepare(op, q.device(), rows, kv_rows, spans, p, None, mi_override)?;
    launch(op, q, k, v, rows, p, &prep)
}

/// Plans a call over `rows` q rows and `kv_rows` k/v rows (validated spans, paged through
/// `paging` when given) on `device` and uploads its metadata (one host-to-device copy, no
/// synchronization).
#[allow(clippy::too_many_arguments)]
pub(super) fn prepare(
    op: &'static str,
    device: Device,
    rows: usize,
    kv_rows: usize,
    spans: &[SeqSpan],
    p: &AttentionParams,
    paging: Option<&KvPaging>,
    mi_override: Option<usize>,
) -> Result<Prepared> {
    let (qk_dim, v_dim) = (p.qk_dim, p.v_dim);
    let Some((dq, dv)) = padded(qk_dim, v_dim).filter(|_| qk_dim % 8 == 0 && v_dim % 8 == 0) else {
        return Err(unsupported(
            op,
            device,
            format!(
                "qk_dim {qk_dim} and v_dim {v_dim} must be multiples of 8 and at most 256 \
                 (16-byte loads, compiled widths)"
            ),
        ));
    };
    let group = p.num_heads / p.num_kv_heads;
    let too_big = [
        ("q rows", rows),
        ("k/v rows", kv_rows),
        (
            "packed rows (tokens · heads per kv head)",
            rows.saturating_mul(group),
        ),
        ("num_heads · v_dim", p.num_heads * dv.max(dq)),
        // Contiguous spans stay inside the k/v rows; paged ones only inside their tables.
        (
            "positions (past + q_len)",
            spans
                .iter()
                .map(|s| s.past.saturating_add(s.q_len))
                .max()
                .unwrap_or(0),
        ),
        (
            "block table entries",
            paging.map_or(0, |pg| pg.block_tables.len()),
        ),
        ("block_size", paging.map_or(0, |pg| pg.block_size)),
    ]
    .into_iter()
    .find(|&(_, n)| n >= INDEX_LIMIT);
    if let Some((what, n)) = too_big {
        return Err(unsupported(
            op,
            device,
            format!("{what} = {n} exceeds the kernels' 31-bit indices"),
        ));
    }
    let Device::Cuda(ordinal) = device else {
        return Err(crate::Error::invalid(
            op,
            "the CUDA plan needs a CUDA device",
        ));
    };
    let backend = fmoe_core::cuda::cuda_backend(ordinal)?;
    let covered: usize = spans.iter().map(|s| s.q_len).sum();
    let sms = backend.multiprocessor_count() as usize;
    let mi = mi_override.unwrap_or_else(|| prefill_mi(dq, dv));
    let plans = plan(spans, group, p.num_kv_heads, p.sliding_window, sms, mi);
    let mut meta: Vec<u32> = Vec::new();
    let mut desc_at = [0usize; 2];
    let mut list_at = [0usize; 2];
    for (i, pl) in plans.iter().enumerate() {
        desc_at[i] = meta.len();
        meta.extend_from_slice(&pl.desc);
    }
    for (i, pl) in plans.iter().enumerate() {
        list_at[i] = meta.len();
        meta.extend_from_slice(&pl.split_tiles);
    }
    // Sizes were checked against INDEX_LIMIT above.
    let paged = paging.map(|pg| {
        let at = meta.len();
        meta.extend_from_slice(&pg.block_tables);
        (at, pg.block_size as u32)
    });
    let meta = if covered == 0 {
        None
    } else {
        Some(CudaStorage::from_cpu(&backend, &CpuStorage::U32(meta))?)
    };
    Ok(Prepared {
        dq,
        dv,
        mi,
        plans,
        meta,
        desc_at,
        list_at,
        paged,
        covered,
    })
}

/// Runs a prepared call: `[rows, heads·v_dim]` in q's dtype (bf16/f16; shapes and devices
/// validated against the plan by the caller).
pub(super) fn launch(
    op: &'static str,
    q: &CudaStorage,
    k: &CudaStorage,
    v: &CudaStorage,
    rows: usize,
    p: &AttentionParams,
    prep: &Prepared,
) -> Result<CudaStorage> {
    let dtype = q.dtype();
    let code = dtype_supported(op, q.device(), dtype)?;
    let (qk_dim, v_dim) = (p.qk_dim, p.v_dim);
    let Prepared {
        dq,
        dv,
        mi,
        ref plans,
        ref meta,
        desc_at,
        list_at,
        paged,
        covered,
    } = *prep;
    let backend = q.backend();
    // Rows outside every span must read 0; when spans cover q (disjoint, validated) the kernels
    // write every element.
    let mut out = if covered == rows {
        CudaStorage::alloc(backend, dtype, rows * p.num_heads * v_dim)?
    } else {
        CudaStorage::zeros(backend, dtype, rows * p.num_heads * v_dim)?
    };
    let Some(meta) = meta else {
        return Ok(out);
    };
    // Window: distances fit 31 bits, so a wider window hides nothing (0 = none in the kernel).
    let window = p
        .sliding_window
        .map_or(0u32, |w| u32::try_from(w).unwrap_or(0));
    let scale_log2 = p.scale * std::f32::consts::LOG2_E;
    let (heads, kv_heads) = (p.num_heads as u32, p.num_kv_heads as u32);
    let (qk32, v32) = (qk_dim as u32, v_dim as u32);
    let stream = backend.stream();
    let null: u64 = 0;
    for kind in Kind::ALL {
        let pl = &plans[kind as usize];
        if pl.tiles() == 0 {
            continue;
        }
        let bm = kind.rows(mi);
        let mut ws = if pl.slots > 0 {
            let n = pl.slots * p.num_kv_heads * bm;
            Some((
                CudaStorage::alloc(backend, DType::F32, n * v_dim)?,
                CudaStorage::alloc(backend, DType::F32, n * 2)?,
            ))
        } else {
            None
        };
        let defines = tile_defines(kind, code, dq, dv, mi, paged.is_some());
        let f = nvrtc::load(
            backend,
            kind.family(),
            kind.source(),
            kind.entry(),
            &defines,
        )?;
        let smem = kind.smem_bytes(mi, dq, dv) as u32;
        opt_in_smem(&f, smem, "attention: shared memory opt-in")?;
        let grid_x = u32::try_from(pl.tiles() * p.num_kv_heads)
            .ok()
            .filter(|&x| x <= i32::MAX as u32)
            .ok_or_else(|| {
                unsupported(
                    op,
                    q.device(),
                    format!("{} tiles exceed the grid", pl.tiles() * p.num_kv_heads),
                )
            })?;
        let cfg = LaunchConfig {
            grid_dim: (grid_x, 1, pl.max_split as u32),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        let desc = meta.buffer().slice(desc_at[kind as usize] * 4..);
        let out_buf = out.buffer_mut()?;
        let mut b = stream.launch_builder(&f);
        b.arg(q.buffer())
            .arg(k.buffer())
            .arg(v.buffer())
            .arg(out_buf);
        match ws.as_mut() {
            Some((acc, ml)) => {
                b.arg(acc.buffer_mut()?).arg(ml.buffer_mut()?);
            }
            None => {
                b.arg(&null).arg(&null);
            }
        }
        b.arg(&desc)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&qk32)
            .arg(&v32)
            .arg(&scale_log2)
            .arg(&window);
        let tables = paged.map(|(at, bs)| (meta.buffer().slice(at * 4..), bs));
        if let Some((tables, bs)) = &tables {
            b.arg(tables).arg(bs);
        }
        // SAFETY: the arguments match `fmoe_attention_{prefill,decode}` in order and type (six
        // pointers, the descriptor pointer, four u32, f32, u32; the paged build, loaded exactly
        // when `paged` is set, then the block-table pointer and the u32 block size). q/k/v/out
        // hold [rows, heads·qk], [kv_rows, kv_heads·qk], [kv_rows, kv_heads·v], [rows, heads·v]
        // elements of the dtype compiled for; every descriptor was built by `plan` from spans
        // validated in bounds (paged: each span's table slice inside the uploaded tables, every
        // block id in it below kv_rows / block_size), with qk_dim <= DQ, v_dim <= DV, both
        // multiples of 8, and the buffers start 256-byte aligned.
        // A tile with nsplit > 1 writes slots ws_slot.. < pl.slots of the workspace (allocated
        // for them; never touched when it is null, since every nsplit is then 1). The dynamic
        // shared memory is the kernel's smem_bytes, opted in above 48 KiB.
        unsafe { b.launch(cfg) }.map_err(|e| cuda_error("attention: tile kernel launch", e))?;

        if let Some((acc, ml)) = &ws {
            let defines = vec![("FMOE_ATTN_DTYPE", code.to_string())];
            let f = nvrtc::load(backend, DECODE, DECODE_SRC, COMBINE_ENTRY, &defines)?;
            let cfg = LaunchConfig {
                grid_dim: ((pl.split_tiles.len() * p.num_kv_heads) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let list = meta.buffer().slice(list_at[kind as usize] * 4..);
            let bm32 = bm as u32;
            let out_buf = out.buffer_mut()?;
            let mut b = stream.launch_builder(&f);
            b.arg(acc.buffer())
                .arg(ml.buffer())
                .arg(out_buf)
                .arg(&desc)
                .arg(&list)
                .arg(&bm32)
                .arg(&heads)
                .arg(&kv_heads)
                .arg(&v32);
            // SAFETY: matches `fmoe_attention_combine` (five pointers, four u32); the list holds
            // the indices of this kernel's split tiles, whose partials the launch above wrote
            // (every split CTA writes all valid rows of its slot, empty splits included).
            unsafe { b.launch(cfg) }.map_err(|e| cuda_error("attention: combine launch", e))?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(q_start: usize, q_len: usize, kv_start: usize, past: usize) -> SeqSpan {
        SeqSpan {
            q_start,
            q_len,
            kv_start,
            past,
        }
    }

    #[test]
    fn widths_pad_to_compiled_variants() {
        assert_eq!(padded(16, 16), Some((16, 16)));
        assert_eq!(padded(24, 16), Some((32, 16)));
        assert_eq!(padded(128, 128), Some((128, 128)));
        assert_eq!(padded(192, 128), Some((192, 128)));
        assert_eq!(padded(64, 128), Some((128, 128)));
        assert_eq!(padded(256, 256), Some((256, 256)));
        assert_eq!(padded(264, 128), None);
        // Every padded pair is a compiled variant of both kernels.
        let v = variants();
        for q in (8..=256).step_by(8) {
            for d in (8..=256).step_by(8) {
                let (dq, dv) = padded(q, d).unwrap();
                for (kind, paged) in Kind::ALL.into_iter().flat_map(|k| [(k, false), (k, true)]) {
                    let defines = tile_defines(kind, 1, dq, dv, prefill_mi(dq, dv), paged);
                    assert!(
                        v.iter()
                            .any(|x| x.entry == kind.entry() && x.defines == defines),
                        "{q}/{d} paged {paged}"
                    );
                }
            }
        }
        // Every variant fits the 227 KiB of shared memory per block.
        for (dq, dv) in [(256, 256), (128, 128), (256, 128)] {
            for kind in Kind::ALL {
                assert!(kind.smem_bytes(prefill_mi(dq, dv), dq, dv) <= 227 * 1024);
            }
        }
        assert_eq!((prefill_mi(128, 128), prefill_mi(192, 128)), (2, 1));
    }

    /// Median seconds per call over `reps` back-to-back calls between CUDA events, 15 trials.
    fn time_calls(backend: &fmoe_core::cuda::CudaBackend, reps: usize, mut f: impl FnMut()) -> f64 {
        use fmoe_core::cuda::cudarc::driver::sys::CUevent_flags;
        let stream = backend.stream();
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        for _ in 0..3 {
            f();
        }
        let mut times: Vec<f64> = (0..15)
            .map(|_| {
                let a = stream.record_event(timing).unwrap();
                for _ in 0..reps {
                    f();
                }
                let b = stream.record_event(timing).unwrap();
                f64::from(a.elapsed_ms(&b).unwrap()) * 1e-3 / reps as f64
            })
            .collect();
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    }

    /// Mixtral's attention (32 q heads, 8 kv heads, d 128, bf16), the peer being
    /// `bench/gpu/attention_sdpa.py`: (a) prefill of one 4096-token sequence (the rule's MI and
    /// the other one), (b) decode of 8 sequences at context 4096. Prints median time, TFLOP/s
    /// (causal FLOPs 4·T²/2·heads·d) and TB/s (K and V bytes read) against the floors.
    #[test]
    #[ignore = "timing; on the GPU: --ignored --nocapture attention::cuda::tests::timing"]
    fn timing_vs_peer() {
        use fmoe_core::{Storage, Tensor};
        let backend = match fmoe_core::cuda::cuda_backend(0) {
            Ok(b) => b,
            Err(e) => {
                println!("skipping: {e}");
                return;
            }
        };
        let dev = fmoe_core::Device::Cuda(0);
        let (h, kvh, d) = (32usize, 8usize, 128usize);
        let p = AttentionParams {
            num_heads: h,
            num_kv_heads: kvh,
            qk_dim: d,
            v_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            sliding_window: None,
        };
        let rnd = |rows: usize, cols: usize, seed| -> Tensor {
            crate::elementwise::randn(&[rows, cols], DType::BF16, 1.0, seed, &dev).unwrap()
        };
        let cs = |t: &Tensor| match t.storage() {
            Storage::Cuda(s) => s.clone(),
            Storage::Cpu(_) => unreachable!("randn on the device"),
        };
        // (a) prefill.
        let t = 4096;
        let (q, k, v) = (rnd(t, h * d, 1), rnd(t, kvh * d, 2), rnd(t, kvh * d, 3));
        let (q, k, v) = (cs(&q), cs(&k), cs(&v));
        let spans = [span(0, t, 0, 0)];
        let flops = 4.0 * (t * t) as f64 / 2.0 * h as f64 * d as f64;
        let mut outs = Vec::new();
        for mi in [prefill_mi(d, d), 3 - prefill_mi(d, d)] {
            let go = || run("timing", &q, &k, &v, t, &spans, &p, Some(mi)).unwrap();
            outs.push(go().to_cpu().unwrap().to_f32_vec());
            let s = time_calls(&backend, 10, || drop(go()));
            println!(
                "fmoe attention prefill T={t} h={h} kv={kvh} d={d} bf16 (MI={mi}{}): {:.3} ms, \
                 {:.1} TFLOP/s ({:.0}% of 790)",
                if mi == prefill_mi(d, d) {
                    ", the rule's"
                } else {
                    ""
                },
                s * 1e3,
                flops / s / 1e12,
                flops / s / 790e12 * 100.0
            );
        }
        let diff = outs[0]
            .iter()
            .zip(&outs[1])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("  MI=1 vs MI=2 max |diff| = {diff:.3e}");
        paged_vs_contiguous(&backend, "prefill", (&q, &k, &v), t, &spans, &p, 10);
        // (b) decode.
        let (b, ctx) = (8usize, 4096usize);
        let (q, k, v) = (
            rnd(b, h * d, 4),
            rnd(b * ctx, kvh * d, 5),
            rnd(b * ctx, kvh * d, 6),
        );
        let (q, k, v) = (cs(&q), cs(&k), cs(&v));
        let spans: Vec<SeqSpan> = (0..b).map(|i| span(i, 1, i * ctx, ctx - 1)).collect();
        let s = time_calls(&backend, 50, || {
            drop(causal_attention("timing", &q, &k, &v, b, &spans, &p).unwrap());
        });
        let bytes = (2 * b * ctx * kvh * d * 2) as f64;
        println!(
            "fmoe attention decode B={b} ctx={ctx} h={h} kv={kvh} d={d} bf16: {:.1} us, \
             {:.2} TB/s ({:.0}% of 4.8; floor {:.1} us)",
            s * 1e6,
            bytes / s / 1e12,
            bytes / s / 4.8e12 * 100.0,
            bytes / 4.8e12 * 1e6
        );
        paged_vs_contiguous(&backend, "decode", (&q, &k, &v), b, &spans, &p, 50);
        // (c) MLA widths (DeepSeek-V3's 192/128, a kv head per head), paged against contiguous.
        let (h, dq, dv) = (16usize, 192usize, 128usize);
        let p = AttentionParams {
            num_heads: h,
            num_kv_heads: h,
            qk_dim: dq,
            v_dim: dv,
            scale: 1.0 / (dq as f32).sqrt(),
            sliding_window: None,
        };
        let (q, k, v) = (
            rnd(t, h * dq, 7),
            rnd(b * ctx, h * dq, 8),
            rnd(b * ctx, h * dv, 9),
        );
        let (q, k, v) = (cs(&q), cs(&k), cs(&v));
        let what = format!("MLA h={h} d={dq}/{dv} prefill T={t}");
        paged_vs_contiguous(
            &backend,
            &what,
            (&q, &k, &v),
            t,
            &[span(0, t, 0, 0)],
            &p,
            10,
        );
        let what = format!("MLA h={h} d={dq}/{dv} decode B={b} ctx={ctx}");
        paged_vs_contiguous(&backend, &what, (&q, &k, &v), b, &spans, &p, 50);
    }

    /// Prints the planned call's time on contiguous spans and on the same spans paged in blocks of
    /// 16 rows of the same k/v, in order and shuffled (kernels only: every plan is made once).
    fn paged_vs_contiguous(
        backend: &fmoe_core::cuda::CudaBackend,
        what: &str,
        (q, k, v): (&CudaStorage, &CudaStorage, &CudaStorage),
        rows: usize,
        spans: &[SeqSpan],
        p: &AttentionParams,
        reps: usize,
    ) {
        use rand::SeedableRng;
        use rand::seq::SliceRandom;
        let (bs, dev) = (16, q.device());
        let kv_rows = k.len() / (p.num_kv_heads * p.qk_dim);
        let in_order: Vec<u32> = (0..(kv_rows / bs) as u32).collect();
        let mut shuffled = in_order.clone();
        shuffled.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(7));
        // Each sequence's table is its own slice of the one list of all blocks.
        let paged: Vec<SeqSpan> = spans
            .iter()
            .map(|s| SeqSpan {
                kv_start: s.kv_start / bs,
                ..*s
            })
            .collect();
        let time = |sp: &[SeqSpan], pg: Option<Vec<u32>>| {
            let pg = pg.map(|block_tables| KvPaging {
                block_size: bs,
                block_tables,
            });
            let prep = prepare("timing", dev, rows, kv_rows, sp, p, pg.as_ref(), None).unwrap();
            time_calls(backend, reps, || {
                drop(launch("timing", q, k, v, rows, p, &prep).unwrap())
            })
        };
        let c = time(spans, None);
        let (o, s) = (time(&paged, Some(in_order)), time(&paged, Some(shuffled)));
        println!(
            "  {what} planned: contiguous {:.1} us; paged in blocks of {bs}: in order {:.1} us \
             ({:.3}x), shuffled {:.1} us ({:.3}x)",
            c * 1e6,
            o * 1e6,
            o / c,
            s * 1e6,
            s / c
        );
    }
}
