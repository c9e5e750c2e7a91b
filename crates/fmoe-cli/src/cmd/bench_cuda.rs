//! `fmoe bench moe --device cuda`: the MoE layer on a CUDA device, every method (unquantized bf16,
//! fp8-tensor, fp8-block) × both kernel families, timed with CUDA events, against the roofline
//! floor measured in the same run.
//!
//! - Weights, activations and router logits are generated on the device
//!   (`elementwise::randn`, a counter-based normal: DeepSeek-V3's 22.5 GB of bf16 experts take
//!   milliseconds); routing is `topk_softmax` on the device (softmax → top-k → renormalize, the
//!   peers' routing). fp8 methods quantize those bf16 weights online on the device (per expert
//!   and matrix for fp8-tensor, 128×128 blocks for fp8-block) once per shape and method: the
//!   first family's layer quantizes, the other family's layer is built from its operands (the
//!   same codes and scales, shared memory).
//! - Timing: per run, a CUDA event before and after the work on the backend's stream, then a
//!   wait; the median over the runs after two warm-up runs (the first compiles the kernels).
//!   Runs: fused 20 (10 from M = 2048), portable 10 (5 from M = 4096). The work is either eager
//!   (`forward_routed`: the host launches each kernel, so the device idles between short ones)
//!   or, for M ≤ [`GRAPH_MAX_TOKENS`] (`--timing auto`), one replay of a CUDA graph of that
//!   forward (`fmoe_core::cuda::capture_graph`, captured after the eager runs; its allocations
//!   become graph allocations). Routing stays outside both: `forward_routed` takes a TopK made
//!   once per batch (topk_softmax reads its NaN flag back, which capture forbids). The rows say
//!   which (`timing`); `--timing both` adds the eager rows beside the graph ones. Graph rows
//!   compare the last replay's output with the eager one: `graph_bitwise`, `graph_vs_eager`
//!   (relative 2-norm difference) beside `eager_vs_eager` (two eager runs). The fused GEMM2 sums
//!   top-k and split-K partials with atomics, in no fixed order, so bit-identity holds only where
//!   each element gets at most two terms; the bench fails if a replay is off by 1e-2 or more (one
//!   bf16 rounding step per element is < 4e-3).
//! - Ceilings, measured once per run before the shapes (or read from `--ceilings-json`, e.g. the
//!   peers script's first output line of the same device call): copy bandwidth (a 4 GiB
//!   device-to-device copy, bytes read + written), read bandwidth (the `elementwise::sum` kernel
//!   over the same 4 GiB), bf16 GEMM rate (cuBLAS `cublasGemmEx` bf16 8192³, f32 accumulate,
//!   through `fmoe_kernels::linear`; libcublas is loaded at run time by `fmoe_kernels::cublas`
//!   from the loader path, `$FMOE_CUBLAS_DIR` or `$CUDA_HOME/lib64`; if none loads, the GEMM
//!   ceiling and the floor are null). The fp8 GEMM
//!   rate is not measured here (that needs cuBLASLt's fp8 matmul with its scale attributes, not
//!   wired): it comes only from `--ceilings-json` (`fp8_TFLOPs`, which the peers script measures
//!   with `torch._scaled_mm` 8192³); without it the fp8 rows' floor is null. As in the peers
//!   script: bw = max(copy, read); floor = max(bytes / bw, FLOPs / GEMM rate), the rate of the
//!   method's operands (bf16 or fp8), with bytes = touched experts' weights and their scales (e4m3
//!   for fp8) + activations (bf16) read and written once.
//! - Errors: `-small` shapes are checked against the f64 CPU reference (rel_err); the real shapes
//!   are too big for it, so their rel_err is null, and the fused row carries `fused_vs_portable`,
//!   the relative difference between the two families' outputs (both measured against each other,
//!   on every shape).

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use fmoe_core::cuda::cudarc::driver::sys::CUevent_flags;
use fmoe_core::cuda::{CudaBackend, CudaStorage, capture_graph, cuda_backend};
use fmoe_core::env::FusedSwitches;
use fmoe_core::{DType, Device, Storage, Tensor};
use fmoe_kernels::elementwise;
use fmoe_kernels::linear::linear;
use fmoe_kernels::moe_align::align_routes;
use fmoe_kernels::moe_gemm::CUDA_BLOCK_M;
use fmoe_kernels::moe_gemm::WeightOperand;
use fmoe_kernels::routing::{TopK, topk_softmax};
use fmoe_moe::reference::{moe_f64, rel_err};
use fmoe_moe::stages::ExpertOperands;
use fmoe_moe::{CheckpointExperts, FusedMoe, KernelFamily, MoeConfig, QuantScheme, Routing};
use indicatif::ProgressBar;

use super::bench::{Case, CudaFields, MoeArgs, Row, Shape};

/// Token counts when `--tokens` is not given.
pub(super) const DEFAULT_TOKENS: &[usize] = &[
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
];

/// Largest batch timed by graph replay under `--timing auto`: up to here a layer is a few short
/// kernels whose launch gaps are a visible share of its time (decode and small prefill
/// batches); above, each kernel runs long enough to hide the host's next launch.
pub(super) const GRAPH_MAX_TOKENS: usize = 256;

/// `--timing`: which timings a CUDA row gets (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Timing {
    /// Graph replay for M ≤ 256 (`GRAPH_MAX_TOKENS`), eager above.
    Auto,
    /// Eager forwards only.
    Eager,
    /// Graph replay at every M.
    Graph,
    /// Auto's rows, plus an eager row wherever auto replays a graph.
    Both,
}

impl Timing {
    fn graph_row(self, m: usize) -> bool {
        match self {
            Timing::Auto | Timing::Both => m <= GRAPH_MAX_TOKENS,
            Timing::Graph => true,
            Timing::Eager => false,
        }
    }

    fn eager_row(self, m: usize) -> bool {
        match self {
            Timing::Both | Timing::Eager => true,
            Timing::Graph => false,
            Timing::Auto => m > GRAPH_MAX_TOKENS,
        }
    }
}

/// The ceilings the floor is computed from (TB/s, TFLOP/s).
#[derive(Clone, Debug, Default)]
pub(super) struct Ceilings {
    pub copy_tbps: Option<f64>,
    pub read_tbps: Option<f64>,
    pub bw_tbps: Option<f64>,
    pub bf16_tflops: Option<f64>,
    pub fp8_tflops: Option<f64>,
    pub source: String,
}

impl Ceilings {
    /// max(bytes / bw, flops / rate), rate = the fp8 or the bf16 GEMM rate.
    fn floor_ms(&self, bytes: f64, flops: f64, fp8: bool) -> Option<f64> {
        let bw = self.bw_tbps?;
        let rate = if fp8 {
            self.fp8_tflops?
        } else {
            self.bf16_tflops?
        };
        Some((bytes / (bw * 1e12)).max(flops / (rate * 1e12)) * 1e3)
    }
}

/// The fp8 checkpoint of a layer's processed operands (the same device tensors), so a second
/// layer of the same method shares the first one's quantized weights.
fn checkpoint_of(layer: &FusedMoe) -> Result<CheckpointExperts> {
    let ops = layer.method().operands()?;
    Ok(match (&ops.w13, &ops.w2) {
        (
            WeightOperand::Fp8PerTensor {
                q: w13,
                scales: w13_scale,
            },
            WeightOperand::Fp8PerTensor {
                q: w2,
                scales: w2_scale,
            },
        ) => CheckpointExperts::Fp8PerTensor {
            w13: w13.clone(),
            w13_scale: w13_scale.clone(),
            w2: w2.clone(),
            w2_scale: w2_scale.clone(),
        },
        (
            WeightOperand::Fp8Block {
                q: w13,
                scale_inv: w13_scale_inv,
            },
            WeightOperand::Fp8Block {
                q: w2,
                scale_inv: w2_scale_inv,
            },
        ) => CheckpointExperts::Fp8Block {
            w13: w13.clone(),
            w13_scale_inv: w13_scale_inv.clone(),
            w2: w2.clone(),
            w2_scale_inv: w2_scale_inv.clone(),
        },
        _ => CheckpointExperts::Dense {
            w13: ops.w13.data().clone(),
            w2: ops.w2.data().clone(),
        },
    })
}

fn seed_for(base: u64, tag: u64, m: usize) -> u64 {
    base.wrapping_mul(1_000_003)
        .wrapping_add(tag.wrapping_mul(65_537))
        .wrapping_add(m as u64)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    args: &MoeArgs,
    device: Device,
    shapes: &[&Shape],
    methods: &[QuantScheme],
    families: &[KernelFamily],
    tokens: &[usize],
    json: &mut Option<File>,
    date: &str,
    bar: &ProgressBar,
) -> Result<Vec<Row>> {
    let Device::Cuda(ordinal) = device else {
        bail!("bench_cuda::run needs a CUDA device");
    };
    let backend = cuda_backend(ordinal)?;
    bar.set_message("measuring ceilings");
    let ceilings = match &args.ceilings_json {
        Some(path) => read_ceilings(path)?,
        None => measure_ceilings(&backend)?,
    };
    bar.println(format!(
        "{} (sm_{}{}, {} SMs): copy {} TB/s, read {} TB/s, bf16 GEMM {} TFLOP/s, fp8 GEMM {} \
         TFLOP/s ({})",
        backend.name(),
        backend.compute_capability().0,
        backend.compute_capability().1,
        backend.multiprocessor_count(),
        fmt_opt(ceilings.copy_tbps, 2),
        fmt_opt(ceilings.read_tbps, 2),
        fmt_opt(ceilings.bf16_tflops, 0),
        fmt_opt(ceilings.fp8_tflops, 0),
        ceilings.source
    ));
    if ceilings.fp8_tflops.is_none() && methods.iter().any(|m| *m != QuantScheme::Unquantized) {
        eprintln!(
            "warning: no fp8 GEMM ceiling (pass --ceilings-json with fp8_TFLOPs, e.g. the peers \
             script's first output line); the fp8 rows' floor_ms is null"
        );
    }

    let mut rows = Vec::new();
    for shape in shapes {
        let (e, k, n) = (shape.experts, shape.hidden, shape.intermediate);
        bar.set_message(format!("{}: making weights on the device", shape.name));
        let w13 = elementwise::randn(
            &[e, 2 * n, k],
            DType::BF16,
            1.0 / (k as f32).sqrt(),
            seed_for(args.seed, 1, 0),
            &device,
        )?;
        let w2 = elementwise::randn(
            &[e, k, n],
            DType::BF16,
            1.0 / (n as f32).sqrt(),
            seed_for(args.seed, 2, 0),
            &device,
        )?;
        let with_reference = shape.name.ends_with("-small") && !args.no_reference;
        let host_weights = if with_reference {
            Some((w13.to_device(Device::Cpu)?, w2.to_device(Device::Cpu)?))
        } else {
            None
        };
        let config = MoeConfig {
            num_experts: e,
            top_k: shape.top_k,
            hidden: k,
            intermediate: n,
            routing: Routing::Softmax { renormalize: true },
            shared_intermediate: None,
        };
        for &scheme in methods {
            bar.set_message(format!("{} {scheme}: preparing weights", shape.name));
            // fp8: the first layer quantizes the bf16 weights on the device; the second is built
            // from its operands (same codes and scales, shared device memory).
            let mut layers: Vec<FusedMoe> = Vec::with_capacity(families.len());
            for &f in families {
                let sw = FusedSwitches {
                    use_fused: f == KernelFamily::Fused,
                    use_fused_moe: true,
                    use_fused_fp8_block_scaled_moe: true,
                };
                let experts = match layers.first() {
                    Some(first) if scheme != QuantScheme::Unquantized => checkpoint_of(first)?,
                    _ => CheckpointExperts::Dense {
                        w13: w13.clone(),
                        w2: w2.clone(),
                    },
                };
                layers.push(FusedMoe::new(
                    config.clone(),
                    scheme,
                    experts,
                    None,
                    None,
                    &sw,
                    device,
                )?);
            }
            let fp8 = scheme != QuantScheme::Unquantized;
            for &m in tokens {
                let x = elementwise::randn(
                    &[m, k],
                    DType::BF16,
                    1.0,
                    seed_for(args.seed, 3, m),
                    &device,
                )?;
                let logits = elementwise::randn(
                    &[m, e],
                    DType::F32,
                    1.0,
                    seed_for(args.seed, 4, m),
                    &device,
                )?;
                let topk = topk_softmax(&logits, shape.top_k, true)?;
                let touched = align_routes(&topk.ids, e, CUDA_BLOCK_M)?.experts_touched()?;
                // (same operands, unquantized) references on the host, -small shapes only.
                let references = match (&host_weights, layers.first()) {
                    (Some((hw13, hw2)), Some(first)) => {
                        bar.set_message(format!("{} {scheme} M={m}: f64 reference", shape.name));
                        let host_topk = TopK {
                            ids: topk.ids.to_device(Device::Cpu)?,
                            weights: topk.weights.to_device(Device::Cpu)?,
                        };
                        let hx = x.to_device(Device::Cpu)?;
                        let exact =
                            moe_f64(&hx, &host_topk, &ExpertOperands::unquantized(hw13, hw2))?;
                        let same = if fp8 {
                            let ops = first.method().operands()?.to_device(Device::Cpu)?;
                            moe_f64(&hx, &host_topk, &ops)?
                        } else {
                            exact.clone()
                        };
                        Some((same, exact))
                    }
                    _ => None,
                };
                let ops = match layers.first() {
                    Some(l) => l.method().operands()?,
                    None => break,
                };
                let case = Case::new(date, device, shape, scheme, m, touched, ops);
                let floor = ceilings.floor_ms(case.bytes as f64, case.flops, fp8);
                let start = rows.len();
                let mut outputs: Vec<(KernelFamily, Vec<f32>)> = Vec::new();
                for layer in &layers {
                    let family = layer.kernel().family;
                    bar.set_message(format!("{} {scheme} M={m}: {family}", shape.name));
                    let iters = match family {
                        KernelFamily::Fused if m >= 2048 => 10,
                        KernelFamily::Fused => 20,
                        KernelFamily::Portable if m >= 4096 => 5,
                        KernelFamily::Portable => 10,
                    };
                    // Eager runs always: the graph rows' reference output comes from them.
                    let (ms, y, y_again) = time_layer(&backend, layer, &x, &topk, iters)?;
                    let y = y.to_f32_vec()?;
                    let errors = |y: &[f32]| match &references {
                        Some((same, exact)) => (Some(rel_err(y, same)), Some(rel_err(y, exact))),
                        None => (None, None),
                    };
                    let fields = |timing: &'static str, ms: f64| CudaFields {
                        gpu: backend.name().to_string(),
                        timing,
                        graph_vs_eager: None,
                        graph_bitwise: None,
                        eager_vs_eager: None,
                        floor_ms: floor,
                        x_floor: floor.map(|f| ms / f),
                        copy_tbps: ceilings.copy_tbps,
                        read_tbps: ceilings.read_tbps,
                        bw_tbps: ceilings.bw_tbps,
                        bf16_tflops: ceilings.bf16_tflops,
                        fp8_tflops: ceilings.fp8_tflops,
                        ceilings: ceilings.source.clone(),
                        fused_vs_portable: None,
                    };
                    let graph = if args.timing.graph_row(m) {
                        bar.set_message(format!("{} {scheme} M={m}: {family} graph", shape.name));
                        Some(
                            time_graph(&backend, layer, &x, &topk, iters).with_context(|| {
                                format!("{} {scheme} M={m} {family}: CUDA graph", shape.name)
                            })?,
                        )
                    } else {
                        None
                    };
                    if args.timing.eager_row(m) {
                        let row =
                            case.row(family, ms, iters, errors(&y), Some(fields("eager", ms)));
                        rows.push(row);
                    }
                    if let Some((gms, gy)) = graph {
                        let y_again = y_again.to_f32_vec()?;
                        let (g_vs_e, e_vs_e, bitwise) = check_graph_output(&gy, &y, &y_again)
                            .with_context(|| format!("{} {scheme} M={m} {family}", shape.name))?;
                        let mut f = fields("graph", gms);
                        f.graph_vs_eager = Some(g_vs_e);
                        f.eager_vs_eager = Some(e_vs_e);
                        f.graph_bitwise = Some(bitwise);
                        rows.push(case.row(family, gms, iters, errors(&gy), Some(f)));
                    }
                    outputs.push((family, y));
                    bar.inc(1);
                }
                let find = |f: KernelFamily| outputs.iter().find(|(g, _)| *g == f).map(|(_, y)| y);
                if let (Some(fy), Some(py)) =
                    (find(KernelFamily::Fused), find(KernelFamily::Portable))
                {
                    let p: Vec<f64> = py.iter().map(|&v| f64::from(v)).collect();
                    let diff = rel_err(fy, &p);
                    // Speed-ups compare like with like: graph with graph, eager with eager.
                    let timing = |r: &Row| r.cuda.as_ref().map(|c| c.timing);
                    let portable: Vec<(Option<&str>, f64)> = rows[start..]
                        .iter()
                        .filter(|r| r.kernel == KernelFamily::Portable.as_str())
                        .map(|r| (timing(r), r.ms))
                        .collect();
                    for r in rows[start..]
                        .iter_mut()
                        .filter(|r| r.kernel == KernelFamily::Fused.as_str())
                    {
                        let t = timing(r);
                        r.speedup_vs_portable = portable
                            .iter()
                            .find(|(pt, _)| *pt == t)
                            .map(|(_, p)| p / r.ms);
                        if let Some(c) = r.cuda.as_mut() {
                            c.fused_vs_portable = Some(diff);
                        }
                    }
                }
                if let Some(f) = json.as_mut() {
                    for row in &rows[start..] {
                        writeln!(f, "{}", serde_json::to_string(row)?)?;
                    }
                }
            }
        }
    }
    Ok(rows)
}

/// Median CUDA-event time of `forward_routed` (routing excluded, as in the peers script) over
/// `iters` runs after two warm-ups; also returns the two warm-ups' outputs.
fn time_layer(
    backend: &Arc<CudaBackend>,
    layer: &FusedMoe,
    x: &Tensor,
    topk: &TopK,
    iters: usize,
) -> Result<(f64, Tensor, Tensor)> {
    let y = layer.forward_routed(x, topk)?;
    let y_again = layer.forward_routed(x, topk)?;
    let ms = median_event_ms(backend, iters, || {
        layer.forward_routed(x, topk)?;
        Ok(())
    })?;
    Ok((ms, y, y_again))
}

/// Median CUDA-event time of one replay of `forward_routed` captured as a CUDA graph, over
/// `iters` replays after two warm-up replays (the capture follows [`time_layer`]'s eager runs,
/// so kernels are compiled and loaded); also returns the last replay's output.
fn time_graph(
    backend: &Arc<CudaBackend>,
    layer: &FusedMoe,
    x: &Tensor,
    topk: &TopK,
    iters: usize,
) -> Result<(f64, Vec<f32>)> {
    let graph = capture_graph(backend, || layer.forward_routed(x, topk))?;
    graph.replay()?;
    graph.replay()?;
    let ms = median_event_ms(backend, iters, || Ok(graph.replay()?))?;
    let y = graph.output().to_f32_vec()?;
    Ok((ms, y))
}

/// Compares a graph replay's output with two eager outputs: (graph vs eager, eager vs eager) as
/// relative 2-norm differences, and whether the replay is bit-identical to the eager output.
/// Bit-identity cannot be demanded here: where the fused GEMM2 sums more than two terms per
/// element with atomics (top-k > 2 or split-K), the order, and so the rounding, varies from run to
/// run, graph or eager (two eager runs may agree by chance and a replay still differ). The replay
/// must stay within one bf16 rounding step per element of the eager output (< 1e-2 relative);
/// `crates/fmoe-moe/tests/cuda_graph.rs` checks bit-identity on a layer whose eager path is reproducible.
fn check_graph_output(
    graph: &[f32],
    eager: &[f32],
    eager_again: &[f32],
) -> Result<(f64, f64, bool)> {
    let as_f64 = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
    let g_vs_e = rel_err(graph, &as_f64(eager));
    let e_vs_e = rel_err(eager_again, &as_f64(eager));
    let bitwise = graph.len() == eager.len()
        && graph
            .iter()
            .zip(eager)
            .all(|(g, e)| g.to_bits() == e.to_bits());
    if g_vs_e.is_nan() || g_vs_e >= 1e-2 {
        bail!(
            "the graph replay's output differs from the eager output by {g_vs_e:e} (eager runs \
             differ by {e_vs_e:e})"
        );
    }
    Ok((g_vs_e, e_vs_e, bitwise))
}

/// Median over `iters` runs of the time between CUDA events recorded on the backend's stream
/// before and after `work` (which issues work on that stream).
pub(super) fn median_event_ms(
    backend: &CudaBackend,
    iters: usize,
    mut work: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let stream = backend.stream();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let start = stream.record_event(timing)?;
        work()?;
        let end = stream.record_event(timing)?;
        times.push(f64::from(start.elapsed_ms(&end)?));
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:.prec$}"))
}

/// `{"bw_TBps": …, "bf16_TFLOPs": …}` (and optionally `copy_TBps`, `read_TBps`, `fp8_TFLOPs`):
/// the JSON object the peers script prints first, or any file holding those keys. Python's `NaN`
/// (the peers' value for a rate it could not measure) reads as missing.
pub(super) fn read_ceilings(path: &Path) -> Result<Ceilings> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| anyhow!("{}: no JSON object found", path.display()))?;
    let line = line
        .replace("-Infinity", "null")
        .replace("Infinity", "null")
        .replace("NaN", "null");
    let v: serde_json::Value =
        serde_json::from_str(&line).with_context(|| format!("parsing {}", path.display()))?;
    let get = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_f64)
            .filter(|x| x.is_finite() && *x > 0.0)
    };
    let bw = get("bw_TBps").ok_or_else(|| anyhow!("{}: no bw_TBps", path.display()))?;
    let rate = get("bf16_TFLOPs").ok_or_else(|| anyhow!("{}: no bf16_TFLOPs", path.display()))?;
    Ok(Ceilings {
        copy_tbps: get("copy_TBps"),
        read_tbps: get("read_TBps"),
        bw_tbps: Some(bw),
        bf16_tflops: Some(rate),
        fp8_tflops: get("fp8_TFLOPs"),
        source: format!("file {}", path.display()),
    })
}

pub(super) fn measure_ceilings(backend: &Arc<CudaBackend>) -> Result<Ceilings> {
    let device = backend.device();
    let n: usize = 1 << 31; // 4 GiB of bf16, as the peers script
    let bytes = (n * 2) as f64;
    // Source and destination of the copy at once.
    fmoe_core::memory::check_budget(
        "measuring the bandwidth ceilings: two 4 GiB buffers (or pass --ceilings-json)",
        2 * n * 2,
        device,
    )?;
    let a = elementwise::randn(&[n], DType::BF16, 1.0, 0xce11, &device)?;
    let Storage::Cuda(src) = a.storage() else {
        bail!("the ceiling buffer is not on the device");
    };
    let mut dst = CudaStorage::alloc(backend, DType::BF16, n)?;
    let stream = backend.stream().clone();
    let mut copy = || -> Result<()> {
        stream.memcpy_dtod(src.buffer(), dst.buffer_mut()?)?;
        Ok(())
    };
    copy()?;
    copy()?;
    let copy_ms = median_event_ms(backend, 10, &mut copy)?;
    drop(dst);
    let sum = || -> Result<()> {
        elementwise::sum(&a)?;
        Ok(())
    };
    sum()?;
    sum()?;
    let read_ms = median_event_ms(backend, 10, sum)?;
    drop(a);
    let copy_tbps = 2.0 * bytes / (copy_ms * 1e-3) / 1e12;
    let read_tbps = bytes / (read_ms * 1e-3) / 1e12;
    let (bf16_tflops, gemm_source) = match cublas_bf16_tflops(backend) {
        Ok(t) => (Some(t), "cuBLAS bf16 8192³".to_string()),
        Err(why) => {
            eprintln!(
                "warning: no bf16 GEMM ceiling ({why}); floor_ms is null (pass --ceilings-json)"
            );
            (None, format!("no GEMM ceiling: {why}"))
        }
    };
    Ok(Ceilings {
        copy_tbps: Some(copy_tbps),
        read_tbps: Some(read_tbps),
        bw_tbps: Some(copy_tbps.max(read_tbps)),
        bf16_tflops,
        fp8_tflops: None,
        source: format!("measured: 4 GiB d2d copy, sum kernel, {gemm_source}"),
    })
}

/// bf16 GEMM rate of cuBLAS, 8192³ (`linear`: y = x·wᵀ, bf16 in and out, f32 compute), TFLOP/s.
fn cublas_bf16_tflops(backend: &Arc<CudaBackend>) -> std::result::Result<f64, String> {
    cublas_gemm_run(backend).map_err(|e| format!("{e:#}"))
}

fn cublas_gemm_run(backend: &Arc<CudaBackend>) -> Result<f64> {
    const N: usize = 8192;
    let device = backend.device();
    let a = elementwise::randn(&[N, N], DType::BF16, 1.0, 0xa, &device)?;
    let b = elementwise::randn(&[N, N], DType::BF16, 1.0, 0xb, &device)?;
    let gemm = || -> Result<()> {
        linear(&a, &b, DType::BF16)?;
        Ok(())
    };
    gemm()?;
    gemm()?;
    let ms = median_event_ms(backend, 10, gemm)?;
    Ok(2.0 * (N as f64).powi(3) / (ms * 1e-3) / 1e12)
}
