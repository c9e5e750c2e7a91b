//! `fmoe bench moe`: time every method × kernel family of one MoE layer against the f64 reference.
//!
//! On the CPU: wall-clock medians, errors against the f64 reference. On CUDA: see
//! [`super::bench_cuda`] (device-side data, CUDA events, the roofline floor).

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use fmoe_core::env::FusedSwitches;
use fmoe_core::{DType, Device, Tensor, checked_product, checked_sum};
use fmoe_kernels::moe_align::align_routes;
use fmoe_kernels::routing::{TopK, topk_softmax};
use fmoe_moe::reference::{moe_f64, rel_err};
use fmoe_moe::stages::ExpertOperands;
use fmoe_moe::{CheckpointExperts, FusedMoe, KernelFamily, MoeConfig, QuantScheme, Routing};
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::Serialize;

#[derive(clap::Subcommand)]
pub enum Bench {
    /// One MoE layer: every method × kernel family at several token counts.
    Moe(MoeArgs),
    /// A whole model end to end: prefill (TTFT), decode steps (TPOT), tokens/s, and the
    /// weight-streaming floor of a decode step.
    Model(super::bench_model::ModelArgs),
    /// Whole requests through the engine, all queued at once: requests/s and tokens/s (after
    /// `vllm bench throughput`).
    Throughput(super::bench_engine::ThroughputArgs),
    /// Batches of whole requests through the engine: latency mean and percentiles (after
    /// `vllm bench latency`).
    Latency(super::bench_engine::LatencyArgs),
    /// Streaming requests against a running server: TTFT, TPOT, ITL and E2E latency,
    /// throughput (after `vllm bench serve`).
    Serve(super::bench_serve::ServeArgs),
}

#[derive(clap::Args)]
pub struct MoeArgs {
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(super) device: Device,
    /// Shapes, comma-separated: mixtral-small, deepseek-small (defaults, seconds on 2 cores) or the
    /// real mixtral-8x7b, mixtral-8x22b, deepseek-v3.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "mixtral-small,deepseek-small"
    )]
    pub(super) shape: Vec<String>,
    /// Token counts M, comma-separated [default: 1,4,16,64 on the CPU;
    /// 1,2,4,…,8192,16384 (powers of two) on CUDA].
    #[arg(long, value_delimiter = ',')]
    pub(super) tokens: Vec<usize>,
    /// Methods (unquantized, fp8-tensor, fp8-block); all by default (the fp8 methods need an
    /// sm_90 GPU on CUDA).
    #[arg(long, value_delimiter = ',')]
    pub(super) method: Vec<QuantScheme>,
    /// Kernel families (fused, portable); both by default.
    #[arg(long, value_delimiter = ',', value_parser = parse_family)]
    pub(super) kernel: Vec<KernelFamily>,
    /// Append one JSON object per row to this file.
    #[arg(long)]
    pub(super) json: Option<PathBuf>,
    /// CPU: minimum timed seconds per row (at least 3 runs, at most 50). CUDA uses fixed run
    /// counts instead.
    #[arg(long, default_value_t = 0.15)]
    pub(super) min_time: f64,
    /// Skip the f64 references (rel_err / quant_err become null); for the real shapes on a CPU.
    /// On CUDA only the -small shapes get a reference anyway.
    #[arg(long)]
    pub(super) no_reference: bool,
    /// Random seed for weights, activations and router logits.
    #[arg(long, default_value_t = 0)]
    pub(super) seed: u64,
    /// CUDA: read the ceilings (bw_TBps, bf16_TFLOPs; copy_TBps, read_TBps optional) from the first
    /// JSON object line of this file (e.g. the peers script's first output line, from the same
    /// device call) instead of measuring them.
    #[arg(long)]
    pub(super) ceilings_json: Option<PathBuf>,
    /// CUDA: how a forward is timed. auto: replays of a CUDA graph of the layer for M <= 256,
    /// eager launches above; eager: eager launches only; graph: graph replays at every M; both:
    /// auto's graph rows plus eager rows at the same M, side by side.
    #[arg(long, value_enum, default_value_t = super::bench_cuda::Timing::Auto)]
    pub(super) timing: super::bench_cuda::Timing,
}

fn parse_family(s: &str) -> Result<KernelFamily, String> {
    KernelFamily::ALL
        .into_iter()
        .find(|f| f.as_str() == s)
        .ok_or_else(|| format!("unknown kernel `{s}` (fused or portable)"))
}

/// A benchmark shape: one MoE layer.
pub(super) struct Shape {
    pub(super) name: &'static str,
    pub(super) experts: usize,
    pub(super) hidden: usize,
    pub(super) intermediate: usize,
    pub(super) top_k: usize,
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "mixtral-small",
        experts: 8,
        hidden: 512,
        intermediate: 1792,
        top_k: 2,
    },
    Shape {
        name: "deepseek-small",
        experts: 32,
        hidden: 448,
        intermediate: 160,
        top_k: 8,
    },
    Shape {
        name: "mixtral-8x7b",
        experts: 8,
        hidden: 4096,
        intermediate: 14336,
        top_k: 2,
    },
    Shape {
        name: "mixtral-8x22b",
        experts: 8,
        hidden: 6144,
        intermediate: 16384,
        top_k: 2,
    },
    Shape {
        name: "deepseek-v3",
        experts: 256,
        hidden: 7168,
        intermediate: 2048,
        top_k: 8,
    },
];

/// One JSON row. The fields after `speedup_vs_portable` exist on CUDA rows only (omitted on the
/// CPU).
#[derive(Serialize)]
pub(super) struct Row {
    pub(super) date: String,
    pub(super) device: String,
    pub(super) shape: String,
    pub(super) method: String,
    pub(super) kernel: String,
    pub(super) tokens: usize,
    pub(super) experts: usize,
    pub(super) hidden: usize,
    pub(super) intermediate: usize,
    pub(super) top_k: usize,
    pub(super) experts_touched: usize,
    pub(super) ms: f64,
    pub(super) iters: usize,
    pub(super) gb_per_s: f64,
    pub(super) gflop_per_s: f64,
    pub(super) bytes: usize,
    pub(super) flops: f64,
    pub(super) rel_err: Option<f64>,
    pub(super) quant_err: Option<f64>,
    /// portable ms / fused ms, on fused rows measured beside a portable row.
    pub(super) speedup_vs_portable: Option<f64>,
    /// CUDA rows only (absent from CPU rows).
    #[serde(flatten)]
    pub(super) cuda: Option<CudaFields>,
}

/// The fields a CUDA row adds (missing values are null).
#[derive(Serialize)]
pub(super) struct CudaFields {
    pub(super) gpu: String,
    /// "graph" (median of CUDA-graph replays of the layer) or "eager" (median of eager forwards).
    pub(super) timing: &'static str,
    /// Graph rows: relative 2-norm difference of the replayed output from the eager output
    /// (0 when bit-identical).
    pub(super) graph_vs_eager: Option<f64>,
    /// Graph rows: whether the replayed output is bit-identical to the eager output.
    pub(super) graph_bitwise: Option<bool>,
    /// Graph rows: the same between two eager runs (non-zero where the fused GEMM2's atomic
    /// top-k and split-K sums land in a different order), the yardstick for `graph_vs_eager`.
    pub(super) eager_vs_eager: Option<f64>,
    /// max(bytes / bw_TBps, flops / GEMM rate), ms, the rate being bf16_TFLOPs for unquantized
    /// rows and fp8_TFLOPs for fp8 rows; null without that ceiling.
    pub(super) floor_ms: Option<f64>,
    /// ms / floor_ms.
    pub(super) x_floor: Option<f64>,
    #[serde(rename = "copy_TBps")]
    pub(super) copy_tbps: Option<f64>,
    #[serde(rename = "read_TBps")]
    pub(super) read_tbps: Option<f64>,
    /// The bandwidth the floor uses: max(copy, read).
    #[serde(rename = "bw_TBps")]
    pub(super) bw_tbps: Option<f64>,
    #[serde(rename = "bf16_TFLOPs")]
    pub(super) bf16_tflops: Option<f64>,
    /// The fp8 GEMM rate the fp8 rows' floor uses (from `--ceilings-json` only).
    #[serde(rename = "fp8_TFLOPs")]
    pub(super) fp8_tflops: Option<f64>,
    /// Where the ceilings come from.
    pub(super) ceilings: String,
    /// Fused rows: relative 2-norm difference between the fused and the portable output.
    pub(super) fused_vs_portable: Option<f64>,
}

/// What one row measures: a shape, a method and a batch, and the traffic they imply. Both devices
/// build their rows from it, so the byte and FLOP counts are written once.
pub(super) struct Case<'a> {
    pub(super) date: &'a str,
    pub(super) device: Device,
    pub(super) shape: &'a Shape,
    pub(super) scheme: QuantScheme,
    pub(super) tokens: usize,
    pub(super) experts_touched: usize,
    /// Touched experts' weights and scales, plus the activations read and written once (bf16).
    pub(super) bytes: usize,
    /// 2 · routes · 3 · N · K.
    pub(super) flops: f64,
}

impl<'a> Case<'a> {
    pub(super) fn new(
        date: &'a str,
        device: Device,
        shape: &'a Shape,
        scheme: QuantScheme,
        tokens: usize,
        experts_touched: usize,
        ops: &ExpertOperands,
    ) -> Case<'a> {
        let (k, n) = (shape.hidden, shape.intermediate);
        let bytes =
            experts_touched * (ops.w13.expert_bytes() + ops.w2.expert_bytes()) + 2 * tokens * k * 2;
        let flops = 2.0 * (tokens * shape.top_k) as f64 * 3.0 * (n * k) as f64;
        Case {
            date,
            device,
            shape,
            scheme,
            tokens,
            experts_touched,
            bytes,
            flops,
        }
    }

    /// The row of one kernel family's timing.
    pub(super) fn row(
        &self,
        family: KernelFamily,
        ms: f64,
        iters: usize,
        errors: (Option<f64>, Option<f64>),
        cuda: Option<CudaFields>,
    ) -> Row {
        let shape = self.shape;
        Row {
            date: self.date.to_string(),
            device: self.device.to_string(),
            shape: shape.name.to_string(),
            method: self.scheme.to_string(),
            kernel: family.to_string(),
            tokens: self.tokens,
            experts: shape.experts,
            hidden: shape.hidden,
            intermediate: shape.intermediate,
            top_k: shape.top_k,
            experts_touched: self.experts_touched,
            ms,
            iters,
            gb_per_s: self.bytes as f64 / (ms * 1e-3) / 1e9,
            gflop_per_s: self.flops / (ms * 1e-3) / 1e9,
            bytes: self.bytes,
            flops: self.flops,
            rel_err: errors.0,
            quant_err: errors.1,
            speedup_vs_portable: None,
            cuda,
        }
    }
}

pub fn run(b: Bench) -> Result<()> {
    let args = match b {
        Bench::Moe(args) => args,
        Bench::Model(args) => return super::bench_model::run(args),
        Bench::Throughput(args) => return super::bench_engine::throughput(args),
        Bench::Latency(args) => return super::bench_engine::latency(args),
        Bench::Serve(args) => return super::bench_serve::serve(args),
    };
    FusedSwitches::from_env()?; // a bad switch is a start-up error even though the bench picks kernels itself
    let device = super::require_device(args.device)?;
    let shapes = args
        .shape
        .iter()
        .map(|s| {
            SHAPES.iter().find(|x| x.name == s).with_context(|| {
                let names: Vec<_> = SHAPES.iter().map(|x| x.name).collect();
                format!("unknown shape `{s}` (one of {})", names.join(", "))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let tokens: Vec<usize> = match (args.tokens.is_empty(), device) {
        (false, _) => args.tokens.clone(),
        (true, Device::Cpu) => vec![1, 4, 16, 64],
        (true, Device::Cuda(_)) => super::bench_cuda::DEFAULT_TOKENS.to_vec(),
    };
    if let Some(&m) = tokens.iter().find(|&&m| m == 0) {
        bail!("--tokens: every token count must be positive, got {m}");
    }
    if !(args.min_time.is_finite() && args.min_time >= 0.0) {
        bail!(
            "--min-time must be a finite number of seconds >= 0, got {}",
            args.min_time
        );
    }
    // Every buffer size follows from a shape and M: check them all (and what they take) before
    // anything is allocated.
    for shape in &shapes {
        fmoe_core::memory::check_budget(
            &format!("bench moe {}: expert weights", shape.name),
            weight_bytes(shape, device)?,
            device,
        )?;
        for &m in &tokens {
            fmoe_core::memory::check_budget(
                &format!(
                    "bench moe {} --tokens {m}: activations, routes and intermediates",
                    shape.name
                ),
                batch_bytes(shape, m)?,
                device,
            )?;
        }
    }
    let methods = if args.method.is_empty() {
        QuantScheme::ALL.to_vec()
    } else {
        args.method.clone()
    };
    let families = if args.kernel.is_empty() {
        KernelFamily::ALL.to_vec()
    } else {
        args.kernel.clone()
    };
    let mut json = match &args.json {
        Some(p) => Some(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("opening {}", p.display()))?,
        ),
        None => None,
    };
    let total = shapes.len() * methods.len() * tokens.len() * families.len();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let date = today();
    if let Device::Cuda(_) = device {
        let rows = super::bench_cuda::run(
            &args, device, &shapes, &methods, &families, &tokens, &mut json, &date, &bar,
        )?;
        bar.finish_and_clear();
        return print_table(&rows);
    }
    let mut rows = Vec::new();
    for shape in &shapes {
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
        let (e, k, n) = (shape.experts, shape.hidden, shape.intermediate);
        bar.set_message(format!("{}: making weights", shape.name));
        let w13 = randn_tensor(&mut rng, [e, 2 * n, k], 1.0 / (k as f32).sqrt())?;
        let w2 = randn_tensor(&mut rng, [e, k, n], 1.0 / (n as f32).sqrt())?;
        let config = MoeConfig {
            num_experts: e,
            top_k: shape.top_k,
            hidden: k,
            intermediate: n,
            // The peers' routing (softmax → top-k → renormalize), so tables compare like with like.
            routing: Routing::Softmax { renormalize: true },
            shared_intermediate: None,
        };
        for &scheme in &methods {
            let layers = families
                .iter()
                .map(|&f| {
                    let sw = FusedSwitches {
                        use_fused: f == KernelFamily::Fused,
                        use_fused_moe: true,
                        use_fused_fp8_block_scaled_moe: true,
                    };
                    let experts = CheckpointExperts::Dense {
                        w13: w13.clone(),
                        w2: w2.clone(),
                    };
                    FusedMoe::new(config.clone(), scheme, experts, None, None, &sw, device)
                })
                .collect::<fmoe_moe::Result<Vec<_>>>()?;
            for &m in &tokens {
                let x = randn_tensor(&mut rng, [m, k], 1.0)?.to_dtype(DType::BF16)?;
                let logits = randn_tensor(&mut rng, [m, e], 1.0)?;
                let topk = topk_softmax(&logits, shape.top_k, true)?;
                let touched = align_routes(&topk.ids, e, 1)?.experts_touched()?;
                bar.set_message(format!("{} {scheme} M={m}: reference", shape.name));
                let references = if args.no_reference {
                    None
                } else {
                    let ops = layers[0].method().operands()?;
                    Some((
                        moe_f64(&x, &topk, ops)?,
                        moe_f64(&x, &topk, &ExpertOperands::unquantized(&w13, &w2))?,
                    ))
                };
                let case = Case::new(
                    &date,
                    device,
                    shape,
                    scheme,
                    m,
                    touched,
                    layers[0].method().operands()?,
                );
                let mut portable_ms = None;
                let mut fused_rows = Vec::new();
                for layer in &layers {
                    let family = layer.kernel().family;
                    bar.set_message(format!("{} {scheme} M={m}: {family}", shape.name));
                    let (ms, iters, y) = time_layer(layer, &x, &topk, args.min_time)?;
                    let y = y.to_f32_vec()?;
                    let (rel, quant) = match &references {
                        Some((same, exact)) => (Some(rel_err(&y, same)), Some(rel_err(&y, exact))),
                        None => (None, None),
                    };
                    if family == KernelFamily::Portable {
                        portable_ms = Some(ms);
                    }
                    let row = case.row(family, ms, iters, (rel, quant), None);
                    if family == KernelFamily::Fused {
                        fused_rows.push(rows.len());
                    }
                    rows.push(row);
                    bar.inc(1);
                }
                for i in fused_rows {
                    rows[i].speedup_vs_portable = portable_ms.map(|p| p / rows[i].ms);
                }
                let start = rows.len() - layers.len();
                if let Some(f) = json.as_mut() {
                    for row in &rows[start..] {
                        writeln!(f, "{}", serde_json::to_string(row)?)?;
                    }
                }
            }
        }
    }
    bar.finish_and_clear();
    print_table(&rows)
}

/// Bytes of one shape's weights as the bench makes them: bf16 w13 and w2 (on the CPU also the
/// f32 values they are rounded from, while each is made).
fn weight_bytes(shape: &Shape, device: Device) -> Result<usize> {
    let per_elem = if device.is_cpu() { 2 + 4 } else { 2 };
    Ok(checked_product(
        &format!("bench moe {}: expert weight bytes", shape.name),
        &[
            ("experts", shape.experts),
            ("3 matrices", 3),
            ("intermediate", shape.intermediate),
            ("hidden", shape.hidden),
            ("bytes per element", per_elem),
        ],
    )?)
}

/// The bytes one batch of `m` tokens takes at its peak, estimated: the activations (f32 while
/// made, bf16, the f32 output, the f64 reference's input and output), the router logits, and per
/// route its id and weight and the layer's f32 intermediates (h = [routes, 2I] and its SiLU⊙mul
/// half).
fn batch_bytes(shape: &Shape, m: usize) -> Result<usize> {
    let what = format!("bench moe {} --tokens {m}: bytes", shape.name);
    let (k, n, e, top_k) = (shape.hidden, shape.intermediate, shape.experts, shape.top_k);
    let per_token = checked_sum(
        &what,
        &[
            (
                "activations",
                checked_product(
                    &what,
                    &[
                        ("hidden", k),
                        ("f32 + bf16 + f32 out + 2 f64", 4 + 2 + 4 + 16),
                    ],
                )?,
            ),
            (
                "router logits",
                checked_product(&what, &[("experts", e), ("f32", 4)])?,
            ),
            (
                "routes",
                checked_product(
                    &what,
                    &[
                        ("top_k", top_k),
                        ("ids, weights, h and SiLU⊙mul (f32)", 8 + 12 * n),
                    ],
                )?,
            ),
        ],
    )?;
    Ok(checked_product(
        &what,
        &[("tokens", m), ("bytes per token", per_token)],
    )?)
}

/// Median wall time of `forward_routed` (routing excluded, as in the peers' script).
fn time_layer(
    layer: &FusedMoe,
    x: &Tensor,
    topk: &TopK,
    min_time: f64,
) -> Result<(f64, usize, Tensor)> {
    let y = layer.forward_routed(x, topk)?; // warm-up, and the output we check
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || (start.elapsed().as_secs_f64() < min_time && times.len() < 50) {
        let t = Instant::now();
        std::hint::black_box(layer.forward_routed(x, topk)?);
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], times.len(), y))
}

fn randn_tensor<const R: usize>(
    rng: &mut ChaCha8Rng,
    dims: [usize; R],
    scale: f32,
) -> Result<Tensor> {
    let n = fmoe_core::Shape::from(dims).checked_elem_count()?;
    let v: Vec<f32> = (0..n)
        .map(|_| StandardNormal.sample(rng))
        .map(|v: f32| v * scale)
        .collect();
    Ok(Tensor::from_f32(&v, dims, DType::BF16, &Device::Cpu)?)
}

/// Prints the rows as a table on stdout; a failed write (a closed pipe, a full disk) is an error.
fn print_table(rows: &[Row]) -> Result<()> {
    let mut out = std::io::stdout().lock();
    write_table(&mut out, rows)
        .and_then(|()| out.flush())
        .map_err(super::stdout_error)
}

fn write_table(out: &mut dyn Write, rows: &[Row]) -> std::io::Result<()> {
    let cuda = rows.iter().any(|r| r.cuda.is_some());
    write!(
        out,
        "{:<15} {:<11} {:<8} {:>6} {:>4} {:>10} {:>8} {:>9} {:>9} {:>9} {:>8}",
        "shape",
        "method",
        "kernel",
        "M",
        "exp",
        "ms",
        "GB/s",
        "GFLOP/s",
        "rel_err",
        "quant_err",
        "speedup"
    )?;
    if cuda {
        write!(
            out,
            " {:>9} {:>7} {:>9} {:>6} {:>9}",
            "floor_ms", "xfloor", "f_vs_p", "timing", "g_vs_e"
        )?;
    }
    writeln!(out)?;
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$e}"));
    let fixed = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    for r in rows {
        write!(
            out,
            "{:<15} {:<11} {:<8} {:>6} {:>4} {:>10.3} {:>8.2} {:>9.2} {:>9} {:>9} {:>8}",
            r.shape,
            r.method,
            r.kernel,
            r.tokens,
            r.experts_touched,
            r.ms,
            r.gb_per_s,
            r.gflop_per_s,
            opt(r.rel_err, 2),
            opt(r.quant_err, 2),
            r.speedup_vs_portable
                .map_or("-".to_string(), |s| format!("{s:.2}x")),
        )?;
        if let Some(c) = &r.cuda {
            write!(
                out,
                " {:>9} {:>7} {:>9} {:>6} {:>9}",
                fixed(c.floor_ms, 3),
                fixed(c.x_floor, 2),
                opt(c.fused_vs_portable, 1),
                c.timing,
                opt(c.graph_vs_eager, 1)
            )?;
        }
        writeln!(out)?;
    }
    Ok(())
}

/// UTC date as YYYY-MM-DD, from the system clock (civil-from-days).
pub(super) fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}
