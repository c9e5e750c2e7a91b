//! `fmoe bench throughput` and `fmoe bench latency`, after `vllm bench throughput|latency`: whole
//! requests through the engine (continuous batching, the paged pool), random prompts of the
//! asked lengths, EOS ignored. Throughput: N requests queued at once; requests/s, total
//! (prompt + output) tokens/s and output tokens/s. Latency: a batch of B requests at a time,
//! `--num-iters` times after a warm-up; mean and p10/p50/p90/p99 of the whole batch's latency.
//! `--kernels fused,portable` runs each MoE kernel family in one invocation (the model is loaded
//! once per family), each row naming its method and kernel.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use fmoe_core::Device;
use fmoe_core::env::FusedSwitches;
use fmoe_engine::{Engine, Request, RequestParams};
use fmoe_models::{CausalLm, LoadOptions, MoeOptions, load};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::engine_flags::{LoadFormatArg, Quantization};

use super::engine_flags::EngineFlags;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kernels {
    /// `FMOE_USE_FUSED=1` (every fused MoE kernel on, the block-scaled one included).
    Fused,
    /// `FMOE_USE_FUSED=0`: the per-expert portable path.
    Portable,
}

#[derive(clap::Args)]
pub struct Common {
    /// Model directory (config.json; checkpoint and tokenizer unless --load-format dummy).
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = "cpu")]
    device: Device,
    #[arg(long, value_enum, default_value = "auto")]
    load_format: LoadFormatArg,
    #[arg(long, value_enum)]
    quantization: Option<Quantization>,
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    num_layers: Option<u64>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 32)]
    input_len: usize,
    /// Generated tokens per request.
    #[arg(long, default_value_t = 16)]
    output_len: usize,
    /// Kernel families to run, comma-separated (default: as the FMOE_* switches say).
    #[arg(long, value_enum, value_delimiter = ',')]
    kernels: Vec<Kernels>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Append one JSON row per kernel family to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineFlags,
}

#[derive(clap::Args)]
pub struct ThroughputArgs {
    #[command(flatten)]
    common: Common,
    #[arg(long, default_value_t = 64)]
    num_prompts: usize,
    /// Lengths drawn uniformly from [len·(1 − r), len·(1 + r)].
    #[arg(long, default_value_t = 0.0)]
    random_range_ratio: f64,
}

#[derive(clap::Args)]
pub struct LatencyArgs {
    #[command(flatten)]
    common: Common,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    #[arg(long, default_value_t = 5)]
    num_iters: usize,
    #[arg(long, default_value_t = 1)]
    num_iters_warmup: usize,
}

#[derive(Serialize)]
struct Row {
    bench: &'static str,
    model: String,
    device: String,
    moe_method: Option<String>,
    moe_kernel: Option<String>,
    num_requests: usize,
    input_len: usize,
    output_len: usize,
    num_kv_blocks: usize,
    block_size: usize,
    preemptions: u64,
    elapsed_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    requests_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    total_tokens_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    output_tokens_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_ms_mean: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_ms_p10: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_ms_p50: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_ms_p90: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_ms_p99: Option<f64>,
}

fn switches_for(k: Option<Kernels>) -> Result<FusedSwitches> {
    let env = FusedSwitches::from_env()?;
    Ok(match k {
        None => env,
        Some(Kernels::Fused) => FusedSwitches {
            use_fused: true,
            use_fused_moe: true,
            use_fused_fp8_block_scaled_moe: true,
        },
        Some(Kernels::Portable) => FusedSwitches {
            use_fused: false,
            ..env
        },
    })
}

/// The engine over the model for one kernel family.
fn engine_for(c: &Common, kernels: Option<Kernels>) -> Result<Engine> {
    let device = super::require_device(c.device)?;
    let opts = LoadOptions {
        format: c.load_format.format(c.seed),
        moe: MoeOptions {
            scheme: c.quantization.map(Quantization::scheme),
            switches: switches_for(kernels)?,
        },
        progress: false,
        num_layers: c.num_layers.map(|n| n as usize),
        device,
        dtype: None,
    };
    let loaded = load(&c.model, &opts).with_context(|| format!("loading {}", c.model.display()))?;
    let model: Arc<dyn CausalLm> = Arc::from(loaded.model);
    let config = c.engine.args(c.seed).resolve(&model)?;
    Ok(Engine::new(model, None, config)?)
}

fn families(c: &Common) -> Vec<Option<Kernels>> {
    if c.kernels.is_empty() {
        vec![None]
    } else {
        c.kernels.iter().copied().map(Some).collect()
    }
}

fn random_prompt(rng: &mut ChaCha8Rng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|_| rng.random_range(1..vocab.max(2)) as u32)
        .collect()
}

fn request(prompt: Vec<u32>, output_len: usize) -> Request {
    Request {
        prompt,
        params: RequestParams {
            max_tokens: output_len,
            ignore_eos: true,
            ..RequestParams::default()
        },
    }
}

/// Steps until every request is done, with a progress bar over finished requests; returns
/// (seconds, output tokens).
fn drain(engine: &mut Engine, bar: &indicatif::ProgressBar) -> Result<(f64, usize)> {
    let t0 = Instant::now();
    let mut out_tokens = 0;
    while engine.has_unfinished() {
        for o in engine.step()? {
            out_tokens += o.new_token_ids.len();
            if let Some(r) = &o.finish_reason {
                if let fmoe_engine::FinishReason::Error(e) = r {
                    bail!("request {} failed: {e}", o.id);
                }
                bar.inc(1);
            }
        }
    }
    Ok((t0.elapsed().as_secs_f64(), out_tokens))
}

fn bar(n: usize) -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::with_draw_target(
        Some(n as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    b.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b
}

fn base_row(bench: &'static str, e: &Engine, c: &Common, n: usize) -> Row {
    let info = e.info();
    Row {
        bench,
        model: info.architecture.to_string(),
        device: info.device.to_string(),
        moe_method: info.moe.map(|(m, _)| m.to_string()),
        moe_kernel: info.moe.map(|(_, k)| k.to_string()),
        num_requests: n,
        input_len: c.input_len,
        output_len: c.output_len,
        num_kv_blocks: e.config().num_blocks,
        block_size: e.config().block_size,
        preemptions: 0,
        elapsed_s: 0.0,
        requests_per_s: None,
        total_tokens_per_s: None,
        output_tokens_per_s: None,
        latency_ms_mean: None,
        latency_ms_p10: None,
        latency_ms_p50: None,
        latency_ms_p90: None,
        latency_ms_p99: None,
    }
}

fn emit(rows: &[Row], json: &Option<PathBuf>) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for r in rows {
        writeln!(out, "{}", serde_json::to_string(r)?).map_err(super::stdout_error)?;
    }
    if let Some(p) = json {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .with_context(|| format!("--json {}", p.display()))?;
        for r in rows {
            writeln!(f, "{}", serde_json::to_string(r)?)?;
        }
    }
    Ok(())
}

fn check(c: &Common) -> Result<()> {
    if c.input_len == 0 {
        bail!("--input-len must be at least 1");
    }
    Ok(())
}

pub fn throughput(a: ThroughputArgs) -> Result<()> {
    let c = &a.common;
    check(c)?;
    if a.num_prompts == 0 {
        bail!("--num-prompts must be at least 1");
    }
    if !(0.0..1.0).contains(&a.random_range_ratio) {
        bail!("--random-range-ratio must be in [0, 1)");
    }
    let mut rows = Vec::new();
    for k in families(c) {
        let mut e = engine_for(c, k)?;
        let vocab = e.info().vocab_size;
        let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
        let r = a.random_range_ratio;
        let len = |rng: &mut ChaCha8Rng, n: usize| -> usize {
            let lo = ((n as f64) * (1.0 - r)).floor().max(1.0) as usize;
            let hi = ((n as f64) * (1.0 + r)).ceil().max(lo as f64) as usize;
            rng.random_range(lo..=hi)
        };
        let mut prompt_tokens = 0;
        for _ in 0..a.num_prompts {
            let (i, o) = (
                len(&mut rng, c.input_len),
                len(&mut rng, c.output_len.max(1)),
            );
            prompt_tokens += i;
            e.add_request(request(random_prompt(&mut rng, i, vocab), o))?;
        }
        let b = bar(a.num_prompts);
        let (s, out) = drain(&mut e, &b)?;
        b.finish_and_clear();
        let mut row = base_row("throughput", &e, c, a.num_prompts);
        row.preemptions = e.stats().preemptions;
        row.elapsed_s = s;
        row.requests_per_s = Some(a.num_prompts as f64 / s);
        row.total_tokens_per_s = Some((prompt_tokens + out) as f64 / s);
        row.output_tokens_per_s = Some(out as f64 / s);
        eprintln!(
            "{}: {:.2} requests/s, {:.1} total tokens/s, {:.1} output tokens/s",
            row.moe_kernel.as_deref().unwrap_or("dense"),
            a.num_prompts as f64 / s,
            (prompt_tokens + out) as f64 / s,
            out as f64 / s
        );
        rows.push(row);
    }
    emit(&rows, &c.json)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p / 100.0).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub fn latency(a: LatencyArgs) -> Result<()> {
    let c = &a.common;
    check(c)?;
    if a.batch_size == 0 || a.num_iters == 0 {
        bail!("--batch-size and --num-iters must be at least 1");
    }
    let mut rows = Vec::new();
    for k in families(c) {
        let mut e = engine_for(c, k)?;
        let vocab = e.info().vocab_size;
        let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
        let b = bar(a.num_iters * a.batch_size);
        let mut times = Vec::with_capacity(a.num_iters);
        for it in 0..a.num_iters_warmup + a.num_iters {
            for _ in 0..a.batch_size {
                e.add_request(request(
                    random_prompt(&mut rng, c.input_len, vocab),
                    c.output_len,
                ))?;
            }
            let hidden = indicatif::ProgressBar::hidden();
            let shown = if it < a.num_iters_warmup { &hidden } else { &b };
            let (s, _) = drain(&mut e, shown)?;
            if it >= a.num_iters_warmup {
                times.push(s * 1e3);
            }
        }
        b.finish_and_clear();
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        times.sort_by(f64::total_cmp);
        let mut row = base_row("latency", &e, c, a.batch_size);
        row.preemptions = e.stats().preemptions;
        row.elapsed_s = times.iter().sum::<f64>() / 1e3;
        row.latency_ms_mean = Some(mean);
        row.latency_ms_p10 = Some(percentile(&times, 10.0));
        row.latency_ms_p50 = Some(percentile(&times, 50.0));
        row.latency_ms_p90 = Some(percentile(&times, 90.0));
        row.latency_ms_p99 = Some(percentile(&times, 99.0));
        eprintln!(
            "{}: batch {} latency mean {mean:.1} ms, p50 {:.1} ms, p99 {:.1} ms",
            row.moe_kernel.as_deref().unwrap_or("dense"),
            a.batch_size,
            percentile(&times, 50.0),
            percentile(&times, 99.0)
        );
        rows.push(row);
    }
    emit(&rows, &c.json)
}
