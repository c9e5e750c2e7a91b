//! `fmoe bench model`: a whole model end to end: B prompts of P random token ids prefilled in one
//! forward pass (TTFT), then N greedy decode steps of one token per sequence (TPOT = the median
//! step), against the weight-streaming floor of a decode step.
//!
//! - Weights: the model directory's checkpoint, or (`--load-format dummy`, the default) random
//!   weights of the config's shapes generated where the model runs (on CUDA a full-size model
//!   never exists on the host), so a `config.json` alone is enough (`bench/configs/*`).
//! - Timing: each forward pass (its logits download included: the step's end) between two CUDA
//!   events on the backend's stream on CUDA, wall clock on the CPU. One untimed warm-up
//!   (prefill + 2 steps: kernels compile on first use) per batch size.
//! - Floor (CUDA): a decode step must at least read, once, every dense weight (attention, router
//!   gates, norms, dense MLPs, lm_head; fp8 checkpoints' dense linears count as bf16, as they are
//!   dequantized at load), the experts the step's B tokens touch (the expected number of distinct
//!   experts when each token picks top-k of E uniformly: E·(1 − (1 − k/E)^B) per MoE layer, at
//!   the method's bytes per expert, scales included; DeepSeek's shared expert always), and the KV
//!   cache of every sequence at the steps' mean context (DeepSeek: the cached latent and rope key,
//!   which an absorbed attention reads; the device path decompresses them, so it moves more).
//!   floor = bytes / bw, bw = max(copy, read) bandwidth measured in the same run (the ceilings of
//!   `fmoe bench moe`), ×floor = TPOT / floor.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use fmoe_core::cuda::cudarc::driver::sys::CUevent_flags;
use fmoe_core::env::FusedSwitches;
use fmoe_core::memory::check_budget;
use fmoe_core::{DType, Device, checked_product, checked_sum};
use fmoe_engine::{DirectSession, LogitsFor, SeqChunk, argmax};
use fmoe_models::{CausalLm, LoadOptions, ModelConfig, MoeOptions, load};
use fmoe_moe::QuantScheme;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::engine_flags::{LoadFormatArg, Quantization};

use super::bench_cuda::{Ceilings, measure_ceilings, read_ceilings};

#[derive(clap::Args)]
pub struct ModelArgs {
    /// Model directory (config.json; the checkpoint too with --load-format auto).
    #[arg(long)]
    model: PathBuf,
    /// Device: cpu, cuda or cuda:N (the whole model runs there).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Where weights come from: dummy (random, from --seed; only config.json is read) or auto
    /// (the directory's safetensors).
    #[arg(long, value_enum, default_value = "dummy")]
    load_format: LoadFormatArg,
    /// Load only the first N decoder layers.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    num_layers: Option<u64>,
    /// MoE method for a bf16 checkpoint: fp8 (per-tensor) or fp8-block (experts quantized at
    /// load).
    #[arg(long, value_enum)]
    quantization: Option<Quantization>,
    /// Sequences per batch, comma-separated (one row each).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Decode steps timed after the prefill.
    #[arg(long, default_value_t = 16)]
    decode_steps: usize,
    /// Seed of the dummy weights and the prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Append one JSON object per row to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// CUDA: read the ceilings (bw_TBps, bf16_TFLOPs) from the first JSON object line of this
    /// file instead of measuring them.
    #[arg(long)]
    ceilings_json: Option<PathBuf>,
}

/// One JSON row.
#[derive(Serialize)]
struct Row {
    date: String,
    device: String,
    gpu: Option<String>,
    model: String,
    config: String,
    num_layers: usize,
    method: Option<String>,
    kernel: Option<String>,
    batch: usize,
    prompt_len: usize,
    decode_steps: usize,
    load_s: f64,
    ttft_ms: f64,
    prefill_tokens_per_s: f64,
    /// Median decode step.
    tpot_ms: f64,
    tpot_min_ms: f64,
    tpot_max_ms: f64,
    decode_tokens_per_s: f64,
    /// Bytes a decode step reads at least (see the module docs), and its parts.
    bytes_per_step: f64,
    dense_bytes: f64,
    expert_bytes: f64,
    kv_bytes: f64,
    experts_touched_per_layer: f64,
    #[serde(rename = "bw_TBps")]
    bw_tbps: Option<f64>,
    floor_ms: Option<f64>,
    x_floor: Option<f64>,
    ceilings: Option<String>,
}

pub fn run(args: ModelArgs) -> Result<()> {
    let switches = FusedSwitches::from_env()?;
    let device = super::require_device(args.device)?;
    if args.batch.contains(&0) || args.prompt_len == 0 {
        bail!("--batch and --prompt-len must be positive");
    }
    if args.decode_steps == 0 {
        bail!("--decode-steps must be positive (TPOT is the median decode step)");
    }
    // The config first (no weights yet): every size the flags imply is checked, and compared with
    // what the device has, before the model loads.
    let config_path = fmoe_models::config::config_path(&args.model);
    let mut config = ModelConfig::from_file(&config_path)
        .with_context(|| format!("loading {}", args.model.display()))?;
    if let Some(n) = args.num_layers {
        let n = usize::try_from(n).context("--num-layers does not fit this machine's usize")?;
        config = config.with_num_hidden_layers(n)?;
    }
    let reach = checked_sum(
        "positions a sequence reaches",
        &[
            ("--prompt-len", args.prompt_len),
            ("--decode-steps", args.decode_steps),
            ("the last step's token", 1),
        ],
    )?;
    if reach > config.max_position_embeddings() {
        bail!(
            "--prompt-len {} + --decode-steps {} reach position {reach}, beyond max_position_embeddings {}",
            args.prompt_len,
            args.decode_steps,
            config.max_position_embeddings()
        );
    }
    check_budget(
        &format!(
            "bench model: weights of {} ({} layers)",
            config.architecture(),
            config.num_hidden_layers()
        ),
        config.weight_bytes()?,
        device,
    )?;
    for &b in &args.batch {
        check_budget(
            &format!(
                "bench model --batch {b} --prompt-len {}: prompt ids, hidden states, logits and \
                 the KV cache of {reach} positions per sequence",
                args.prompt_len
            ),
            session_bytes(&config, b, args.prompt_len, reach, device)?,
            device,
        )?;
    }
    // Ceilings first: their 8 GiB of buffers go back to the pool before the model loads.
    let (ceilings, gpu) = match device {
        Device::Cpu => (None, None),
        Device::Cuda(i) => {
            let backend = fmoe_core::cuda::cuda_backend(i)?;
            let c = match &args.ceilings_json {
                Some(p) => read_ceilings(p)?,
                None => measure_ceilings(&backend)?,
            };
            (Some(c), Some(backend.name().to_string()))
        }
    };
    let opts = LoadOptions {
        format: args.load_format.format(args.seed),
        moe: MoeOptions {
            scheme: args.quantization.map(Quantization::scheme),
            switches,
        },
        progress: false,
        num_layers: args.num_layers.map(|n| n as usize),
        device,
        dtype: None,
    };
    let t0 = Instant::now();
    let loaded =
        load(&args.model, &opts).with_context(|| format!("loading {}", args.model.display()))?;
    if let Device::Cuda(i) = device {
        fmoe_core::cuda::cuda_backend(i)?.synchronize()?;
    }
    let load_s = t0.elapsed().as_secs_f64();
    let model: std::sync::Arc<dyn CausalLm> = std::sync::Arc::from(loaded.model);
    let info = model.info();
    let moe = match info.moe {
        Some((scheme, family)) => format!("MoE {scheme}/{family}"),
        None => "no MoE layer".to_owned(),
    };
    eprintln!(
        "loaded {} ({} layers) on {device} in {load_s:.1} s; {moe}",
        info.architecture, info.kv_layout.num_layers
    );
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
    let mut rows = Vec::new();
    for &b in &args.batch {
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed ^ 0x5eed ^ b as u64);
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|_| {
                (0..args.prompt_len)
                    .map(|_| rng.random_range(0..info.vocab_size as u32))
                    .collect()
            })
            .collect();
        session(&model, device, &prompts, 2)?;
        let (ttft_ms, mut steps) = session(&model, device, &prompts, args.decode_steps)?;
        steps.sort_by(f64::total_cmp);
        let tpot_ms = steps.get(steps.len() / 2).copied().unwrap_or(f64::NAN);
        let scheme = info.moe.map(|m| m.0);
        let ctx = args.prompt_len as f64 + (args.decode_steps as f64 + 1.0) / 2.0;
        let t = decode_traffic(&loaded.config, scheme, b, ctx);
        let bw = ceilings.as_ref().and_then(|c: &Ceilings| c.bw_tbps);
        let floor_ms = bw.map(|bw| t.total() / (bw * 1e12) * 1e3);
        rows.push(Row {
            date: super::bench::today(),
            device: device.to_string(),
            gpu: gpu.clone(),
            model: info.architecture.to_string(),
            config: args.model.display().to_string(),
            num_layers: info.kv_layout.num_layers,
            method: info.moe.map(|m| m.0.to_string()),
            kernel: info.moe.map(|m| m.1.to_string()),
            batch: b,
            prompt_len: args.prompt_len,
            decode_steps: args.decode_steps,
            load_s,
            ttft_ms,
            prefill_tokens_per_s: (b * args.prompt_len) as f64 / (ttft_ms * 1e-3),
            tpot_ms,
            tpot_min_ms: steps.first().copied().unwrap_or(f64::NAN),
            tpot_max_ms: steps.last().copied().unwrap_or(f64::NAN),
            decode_tokens_per_s: b as f64 / (tpot_ms * 1e-3),
            bytes_per_step: t.total(),
            dense_bytes: t.dense,
            expert_bytes: t.experts,
            kv_bytes: t.kv,
            experts_touched_per_layer: t.touched,
            bw_tbps: bw,
            floor_ms,
            x_floor: floor_ms.map(|f| tpot_ms / f),
            ceilings: ceilings.as_ref().map(|c| c.source.clone()),
        });
        let row = rows.last().context("no row")?;
        if let Some(f) = json.as_mut() {
            writeln!(f, "{}", serde_json::to_string(row)?)?;
        }
    }
    print_table(&rows)
}

/// A lower bound of the bytes one batch takes: `b` prompts of `p` ids, the prefill's hidden
/// states (f32), the last rows' logits (f32), and the KV cache of `reach` positions per sequence
/// (f32 rows on the CPU, bf16 on CUDA).
fn session_bytes(
    config: &ModelConfig,
    b: usize,
    p: usize,
    reach: usize,
    device: Device,
) -> Result<usize> {
    let what = format!("bench model --batch {b} --prompt-len {p}: bytes");
    let kv_bytes = if device.is_cpu() { 4 } else { 2 };
    let tokens = checked_product(&what, &[("--batch", b), ("--prompt-len", p)])?;
    Ok(checked_sum(
        &what,
        &[
            (
                "prompt ids",
                checked_product(&what, &[("tokens", tokens), ("u32", 4)])?,
            ),
            (
                "hidden states",
                checked_product(
                    &what,
                    &[
                        ("tokens", tokens),
                        ("hidden_size", config.hidden_size()),
                        ("f32", 4),
                    ],
                )?,
            ),
            (
                "logits",
                checked_product(
                    &what,
                    &[
                        ("--batch", b),
                        ("vocab_size", config.vocab_size()),
                        ("f32", 4),
                    ],
                )?,
            ),
            (
                "KV cache",
                checked_product(
                    &what,
                    &[
                        ("--batch", b),
                        ("positions", reach),
                        ("KV elements per token", config.kv_elems_per_token()?),
                        ("bytes per element", kv_bytes),
                    ],
                )?,
            ),
        ],
    )?)
}

/// One generation: prefill `prompts` together, then `steps` greedy decode steps. Returns the
/// prefill's ms and each step's ms.
fn session(
    model: &std::sync::Arc<dyn CausalLm>,
    device: Device,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Result<(f64, Vec<f64>)> {
    let info = model.info();
    let reach = prompts[0].len() + steps + 1;
    if reach > info.max_position_embeddings {
        bail!(
            "prompt + decode steps reach position {reach}, beyond max_position_embeddings {}",
            info.max_position_embeddings
        );
    }
    let mut cache = DirectSession::new(model.clone(), (reach + 16) * prompts.len())?;
    let mut chunks = prompts
        .iter()
        .map(|p| SeqChunk {
            seq: cache.allocate(),
            tokens: p.clone(),
            start_pos: 0,
        })
        .collect::<Vec<_>>();
    let vocab = info.vocab_size;
    let mut times = Vec::with_capacity(steps + 1);
    for _ in 0..=steps {
        let (ms, rows) = timed(device, || Ok(cache.forward(&chunks, LogitsFor::Last)?))?;
        times.push(ms);
        for (i, c) in chunks.iter_mut().enumerate() {
            c.start_pos += c.tokens.len();
            c.tokens = vec![argmax(&rows[i * vocab..(i + 1) * vocab])];
        }
    }
    let prefill = times.remove(0);
    Ok((prefill, times))
}

/// ms of `work` (which ends with a download, so the device is idle after it): CUDA events on
/// the backend's stream, or the wall clock on the CPU.
fn timed<T>(device: Device, work: impl FnOnce() -> Result<T>) -> Result<(f64, T)> {
    match device {
        Device::Cpu => {
            let t0 = Instant::now();
            let out = work()?;
            Ok((t0.elapsed().as_secs_f64() * 1e3, out))
        }
        Device::Cuda(i) => {
            let backend = fmoe_core::cuda::cuda_backend(i)?;
            let stream = backend.stream();
            let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
            let start = stream.record_event(timing)?;
            let out = work()?;
            let end = stream.record_event(timing)?;
            Ok((f64::from(start.elapsed_ms(&end)?), out))
        }
    }
}

/// The bytes a decode step reads at least (see the module docs).
struct Traffic {
    dense: f64,
    experts: f64,
    kv: f64,
    /// Expected distinct routed experts per MoE layer.
    touched: f64,
}

impl Traffic {
    fn total(&self) -> f64 {
        self.dense + self.experts + self.kv
    }
}

/// E·(1 − (1 − k/E)^B): the expected number of distinct experts B tokens touch when each picks
/// k of E uniformly.
fn distinct_experts(e: usize, k: usize, b: usize) -> f64 {
    let e = e as f64;
    e * (1.0 - (1.0 - k as f64 / e).powi(b as i32))
}

/// Bytes of one expert (gate, up, down: 3·H·I weights) under `scheme`, scales included.
fn expert_bytes(scheme: Option<QuantScheme>, h: usize, i: usize) -> f64 {
    let w = 3.0 * (h * i) as f64;
    match scheme {
        None | Some(QuantScheme::Unquantized) => 2.0 * w,
        // One f32 scale per matrix.
        Some(QuantScheme::Fp8PerTensor) => w + 3.0 * 4.0,
        // One f32 per 128×128 block of each matrix.
        Some(QuantScheme::Fp8Block) => w + 3.0 * 4.0 * (h.div_ceil(128) * i.div_ceil(128)) as f64,
    }
}

fn decode_traffic(cfg: &ModelConfig, scheme: Option<QuantScheme>, b: usize, ctx: f64) -> Traffic {
    // Dense weights and activations are bf16 (fp8 checkpoints' dense linears are dequantized).
    let act = DType::BF16.size_in_bytes() as f64;
    match cfg {
        ModelConfig::Mixtral(c) => {
            let (h, d, l) = (c.hidden_size, c.head_dim(), c.num_hidden_layers);
            let (nh, nkv) = (c.num_attention_heads, c.num_kv_heads());
            let (e, k) = (c.num_local_experts, c.num_experts_per_tok);
            let per_layer = (nh + 2 * nkv) * d * h + h * nh * d + e * h + 2 * h;
            let head = if c.tie_word_embeddings { 0 } else { 1 };
            let dense = (l * per_layer + h + (head * c.vocab_size + b) * h) as f64 * act;
            let touched = distinct_experts(e, k, b);
            Traffic {
                dense,
                experts: l as f64 * touched * expert_bytes(scheme, h, c.intermediate_size),
                kv: b as f64 * ctx * (l * 2 * nkv * d) as f64 * act,
                touched,
            }
        }
        ModelConfig::DeepseekV3(c) => {
            let (h, l, nh) = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads);
            let (r, dn, dr, dv) = (
                c.kv_lora_rank,
                c.qk_nope_head_dim,
                c.qk_rope_head_dim,
                c.v_head_dim,
            );
            let q = match c.q_lora_rank {
                Some(rq) => rq * h + rq + nh * (dn + dr) * rq,
                None => nh * (dn + dr) * h,
            };
            let attn = q + (r + dr) * h + r + nh * (dn + dv) * r + h * nh * dv + 2 * h;
            let moe_layers = (0..l).filter(|&i| c.is_moe_layer(i)).count();
            let dense_mlp = (l - moe_layers) * 3 * h * c.intermediate_size;
            let gates = moe_layers * c.n_routed_experts * h;
            let head = if c.tie_word_embeddings { 0 } else { 1 };
            let dense =
                (l * attn + dense_mlp + gates + h + (head * c.vocab_size + b) * h) as f64 * act;
            let touched = distinct_experts(c.n_routed_experts, c.num_experts_per_tok, b);
            let shared = c
                .shared_intermediate()
                .map_or(0.0, |ns| expert_bytes(scheme, h, ns));
            let routed = touched * expert_bytes(scheme, h, c.moe_intermediate_size);
            Traffic {
                dense,
                experts: moe_layers as f64 * (routed + shared),
                kv: b as f64 * ctx * (l * (r + dr)) as f64 * act,
                touched,
            }
        }
    }
}

/// Prints the rows as a table on stdout; a failed write (a closed pipe, a full disk) is an error.
fn print_table(rows: &[Row]) -> Result<()> {
    let mut out = std::io::stdout().lock();
    write_table(&mut out, rows)
        .and_then(|()| out.flush())
        .map_err(super::stdout_error)
}

fn write_table(out: &mut dyn Write, rows: &[Row]) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<22} {:>3} {:<11} {:<8} {:>3} {:>5} {:>10} {:>9} {:>10} {:>9} {:>9} {:>7}",
        "model",
        "L",
        "method",
        "kernel",
        "B",
        "P",
        "TTFT ms",
        "TPOT ms",
        "tok/s",
        "GB/step",
        "floor ms",
        "xfloor"
    )?;
    let fixed = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    for r in rows {
        writeln!(
            out,
            "{:<22} {:>3} {:<11} {:<8} {:>3} {:>5} {:>10.2} {:>9.3} {:>10.1} {:>9.2} {:>9} {:>7}",
            r.model,
            r.num_layers,
            r.method.as_deref().unwrap_or("-"),
            r.kernel.as_deref().unwrap_or("-"),
            r.batch,
            r.prompt_len,
            r.ttft_ms,
            r.tpot_ms,
            r.decode_tokens_per_s,
            r.bytes_per_step / 1e9,
            fixed(r.floor_ms, 3),
            fixed(r.x_floor, 2),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_experts_grow_from_k_to_e() {
        assert!((distinct_experts(8, 2, 1) - 2.0).abs() < 1e-12);
        // Two tokens: 8·(1 − (3/4)²) = 3.5.
        assert!((distinct_experts(8, 2, 2) - 3.5).abs() < 1e-12);
        assert!(distinct_experts(256, 8, 4096) > 255.99);
        assert_eq!(expert_bytes(None, 4, 8), 192.0);
        // fp8 blocks: 96 codes + 3 scales of 4 bytes (one block per matrix).
        assert_eq!(expert_bytes(Some(QuantScheme::Fp8Block), 4, 8), 108.0);
    }
}
