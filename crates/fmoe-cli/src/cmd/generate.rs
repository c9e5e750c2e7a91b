//! `fmoe generate`: load a model directory, generate from prompts, print the text and tokens/s
//! (or, with `--json`, one JSON object as the last line of stdout).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use fmoe_core::Device;
use fmoe_core::env::FusedSwitches;
use fmoe_engine::{Engine, GenerateParams, SamplingParams, generate};

use super::engine_flags::{LoadFormatArg, Quantization};
use fmoe_models::{LoadOptions, MoeOptions, load};
use serde::Serialize;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory: config.json, model.safetensors (or shards with
    /// model.safetensors.index.json) and tokenizer.json.
    #[arg(long)]
    model: PathBuf,
    /// Device: cpu, cuda or cuda:N. On CUDA the whole forward runs on the GPU (activations in
    /// the model's dtype, KV cache on the device); on the CPU every layer computes in f32.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Prompt text (repeat for a batch); needs tokenizer.json. BOS is added as the tokenizer
    /// says.
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Vec<String>,
    /// Prompt token ids, comma-separated, e.g. 1,2,3 (repeat for a batch).
    #[arg(long)]
    prompt_ids: Vec<String>,
    /// Most new tokens per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: keep the most probable tokens up to this mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most probable tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Seed of the sampler (prompt i samples with seed + i).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the text contains this string (repeatable); the text is cut before it.
    #[arg(long)]
    stop: Vec<String>,
    /// Do not stop at the model's EOS token.
    #[arg(long)]
    ignore_eos: bool,
    /// MoE method for a bf16 checkpoint: fp8 (per-tensor e4m3, quantized at load) or fp8-block
    /// (128×128 blocks). Only the MoE experts are quantized; attention, router, embeddings and
    /// lm_head stay in the checkpoint's dtype. fp8 checkpoints use their own format without
    /// this flag (on CUDA their dense linears are dequantized to bf16 at load).
    #[arg(long, value_enum)]
    quantization: Option<Quantization>,
    /// Where weights come from: auto (the directory's safetensors) or dummy (random weights
    /// from --seed; only config.json is read).
    #[arg(long, value_enum, default_value = "auto")]
    load_format: LoadFormatArg,
    /// Load only the first N decoder layers (overrides the config's num_hidden_layers): e.g.
    /// full-width dummy models for benchmarks.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    num_layers: Option<u64>,
    /// Print one JSON object (the last line of stdout): token_ids, text, finish_reason,
    /// prompt_tokens, tokens_per_s, ... of the first prompt, and `outputs` for all.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: super::engine_flags::EngineFlags,
}

#[derive(Serialize)]
struct OutputJson {
    token_ids: Vec<u32>,
    text: Option<String>,
    finish_reason: String,
    stop: Option<String>,
    prompt_tokens: usize,
}

#[derive(Serialize)]
struct EngineJson {
    preemptions: u64,
    prefix_cache_hits: u64,
    prefix_cache_queries: u64,
    peak_blocks: usize,
    num_blocks: usize,
    block_size: usize,
}

#[derive(Serialize)]
struct Report {
    token_ids: Vec<u32>,
    text: Option<String>,
    finish_reason: String,
    prompt_tokens: usize,
    generated_tokens: usize,
    tokens_per_s: f64,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    prefill_s: f64,
    decode_s: f64,
    load_s: f64,
    model: String,
    num_layers: usize,
    device: String,
    moe_method: Option<String>,
    moe_kernel: Option<String>,
    outputs: Vec<OutputJson>,
    engine: EngineJson,
}

fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .with_context(|| format!("--prompt-ids: `{t}` is not a token id"))
        })
        .collect()
}

pub fn run(args: Args) -> Result<()> {
    let switches = FusedSwitches::from_env()?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
    };
    sampling.validate()?;
    let device = super::require_device(args.device)?;
    let scheme = args.quantization.map(Quantization::scheme);
    let opts = LoadOptions {
        format: args.load_format.format(args.seed),
        moe: MoeOptions { scheme, switches },
        progress: !args.json,
        num_layers: args.num_layers.map(|n| n as usize),
        device,
        dtype: None,
    };
    let t0 = Instant::now();
    let loaded =
        load(&args.model, &opts).with_context(|| format!("loading {}", args.model.display()))?;
    let load_s = t0.elapsed().as_secs_f64();
    let model: std::sync::Arc<dyn fmoe_models::CausalLm> = std::sync::Arc::from(loaded.model);
    let info = model.info().clone();
    tracing::info!(
        model = info.architecture,
        seconds = load_s,
        "loaded {}",
        args.model.display()
    );

    let prompts: Vec<Vec<u32>> = if !args.prompt_ids.is_empty() {
        args.prompt_ids
            .iter()
            .map(|s| parse_ids(s))
            .collect::<Result<_>>()?
    } else if !args.prompt.is_empty() {
        let Some(tok) = &loaded.tokenizer else {
            bail!(
                "--prompt needs {}/tokenizer.json; give --prompt-ids instead",
                args.model.display()
            );
        };
        args.prompt
            .iter()
            .map(|p| tok.encode(p, true).map_err(anyhow::Error::from))
            .collect::<Result<_>>()?
    } else {
        bail!("give --prompt TEXT or --prompt-ids 1,2,3");
    };

    let params = GenerateParams {
        max_tokens: args.max_tokens,
        sampling,
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
    };
    let config = args.engine.args(args.seed).resolve(&model)?;
    let mut engine = Engine::new(model, loaded.tokenizer, config)?;
    let g = generate(&mut engine, &prompts, &params)?;
    let s = &g.stats;
    if args.json {
        let outputs: Vec<OutputJson> = g
            .outputs
            .iter()
            .map(|o| OutputJson {
                token_ids: o.token_ids.clone(),
                text: o.text.clone(),
                finish_reason: o.finish_reason.as_str().to_string(),
                stop: match &o.finish_reason {
                    fmoe_engine::FinishReason::Stop(s) => Some(s.clone()),
                    _ => None,
                },
                prompt_tokens: o.prompt_tokens,
            })
            .collect();
        let first = &outputs[0];
        let report = Report {
            token_ids: first.token_ids.clone(),
            text: first.text.clone(),
            finish_reason: first.finish_reason.clone(),
            prompt_tokens: first.prompt_tokens,
            generated_tokens: s.generated_tokens,
            tokens_per_s: s.tokens_per_s(),
            prefill_tokens_per_s: s.prefill_tokens_per_s(),
            decode_tokens_per_s: s.decode_tokens_per_s(),
            prefill_s: s.prefill_s,
            decode_s: s.decode_s,
            load_s,
            model: info.architecture.to_string(),
            num_layers: info.kv_layout.num_layers,
            device: device.to_string(),
            moe_method: info.moe.map(|(m, _)| m.to_string()),
            moe_kernel: info.moe.map(|(_, k)| k.to_string()),
            outputs,
            engine: EngineJson {
                preemptions: s.engine.preemptions,
                prefix_cache_hits: s.engine.prefix_cache_hits,
                prefix_cache_queries: s.engine.prefix_cache_queries,
                peak_blocks: s.engine.peak_blocks,
                num_blocks: config.num_blocks,
                block_size: config.block_size,
            },
        };
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", serde_json::to_string(&report)?).map_err(super::stdout_error)?;
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    for o in &g.outputs {
        match &o.text {
            Some(t) => writeln!(out, "{t}"),
            None => writeln!(out, "{:?}", o.token_ids),
        }
        .map_err(super::stdout_error)?;
    }
    eprintln!(
        "{} tokens in {:.3} s: {:.1} tokens/s (prefill {} tokens at {:.1} tokens/s, decode {:.1} tokens/s)",
        s.generated_tokens,
        s.prefill_s + s.decode_s,
        s.tokens_per_s(),
        s.prompt_tokens,
        s.prefill_tokens_per_s(),
        s.decode_tokens_per_s()
    );
    Ok(())
}
