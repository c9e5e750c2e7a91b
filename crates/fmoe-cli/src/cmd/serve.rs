//! `fmoe serve`: the OpenAI-compatible server ([`fmoe_server`]) over a model directory, with
//! the engine flags `generate` takes and vLLM's server flags.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use fmoe_core::Device;
use fmoe_core::env::FusedSwitches;
use fmoe_engine::Engine;
use fmoe_models::{LoadOptions, MoeOptions, Tokenizer, load};
use fmoe_server::{Loaded, ServerConfig, TokenizerConfig};

use super::engine_flags::{LoadFormatArg, Quantization};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory: config.json, the safetensors checkpoint, tokenizer.json and (for chat)
    /// tokenizer_config.json.
    #[arg(long)]
    model: PathBuf,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// MoE method for a bf16 checkpoint: fp8 or fp8-block (see `fmoe generate --help`).
    #[arg(long, value_enum)]
    quantization: Option<Quantization>,
    /// Where weights come from: auto (the directory's safetensors) or dummy (random, from --seed).
    #[arg(long, value_enum, default_value = "auto")]
    load_format: LoadFormatArg,
    /// Load only the first N decoder layers.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    num_layers: Option<u64>,
    /// Seed of dummy weights and of the engine's RNG (requests without a seed draw from it).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Accepted for vLLM's command lines: fmoe captures no CUDA graphs, every step is eager.
    #[arg(long)]
    enforce_eager: bool,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: a free one, named in the `listening on` log line).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients send and see [default: the --model path as given].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on /v1/* [default: $FMOE_API_KEY, else none].
    #[arg(long)]
    api_key: Option<String>,
    /// Admitted requests still waiting for their first output, at most: past it a request gets 429.
    #[arg(long, default_value_t = 1024)]
    max_queued_requests: usize,
    /// Bytes of a request body, at most: past it a request gets 413.
    #[arg(long, default_value_t = 4 << 20)]
    max_request_bytes: usize,
    /// A Jinja chat template file that replaces the model's (tokenizer_config.json's).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Seconds requests in flight may run on after SIGINT/SIGTERM before they are aborted.
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    #[command(flatten)]
    engine: super::engine_flags::EngineFlags,
}

pub fn run(args: Args) -> Result<()> {
    let switches = FusedSwitches::from_env()?;
    let device = super::require_device(args.device)?;
    if !(args.shutdown_timeout.is_finite() && args.shutdown_timeout >= 0.0) {
        bail!(
            "--shutdown-timeout must be a number of seconds >= 0, got {}",
            args.shutdown_timeout
        );
    }
    if args.max_request_bytes == 0 {
        bail!("--max-request-bytes must be at least 1");
    }
    let chat_template = match &args.chat_template {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("--chat-template {}", p.display()))?,
        ),
        None => None,
    };
    let api_key = match args.api_key.clone() {
        Some(k) => Some(k),
        None => std::env::var("FMOE_API_KEY").ok().filter(|k| !k.is_empty()),
    };
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        served_model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| args.model.display().to_string()),
        api_key,
        max_queued_requests: args.max_queued_requests,
        max_request_bytes: args.max_request_bytes,
        chat_template,
        shutdown_grace: Duration::from_secs_f64(args.shutdown_timeout),
    };
    let scheme = args.quantization.map(Quantization::scheme);
    let opts = LoadOptions {
        format: args.load_format.format(args.seed),
        moe: MoeOptions { scheme, switches },
        progress: true,
        num_layers: args.num_layers.map(|n| n as usize),
        device,
        dtype: None,
    };
    let dir = args.model.clone();
    let engine_args = args.engine.args(args.seed);
    let load_model = move || -> Result<Loaded> {
        let tokenizer_config = TokenizerConfig::from_dir(&dir)?;
        let loaded = load(&dir, &opts).with_context(|| format!("loading {}", dir.display()))?;
        // The engine keeps one tokenizer for its text deltas; the server encodes with its own.
        let tokenizer = Tokenizer::from_dir(&dir)?;
        let model: std::sync::Arc<dyn fmoe_models::CausalLm> = std::sync::Arc::from(loaded.model);
        let config = engine_args.resolve(&model)?;
        let engine = Engine::new(model, loaded.tokenizer, config)?;
        Ok(Loaded {
            engine,
            tokenizer,
            tokenizer_config,
        })
    };
    fmoe_server::serve_blocking(config, move || load_model().map_err(|e| format!("{e:#}")))?;
    Ok(())
}
