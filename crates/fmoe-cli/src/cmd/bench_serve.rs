//! `fmoe bench serve`: load against a running `fmoe serve` (or any OpenAI-compatible server),
//! after `vllm bench serve` ([`fmoe_server::bench`]).

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use fmoe_server::bench::{BenchConfig, run};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The server, e.g. http://127.0.0.1:8000.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    base_url: String,
    /// The API path requests go to.
    #[arg(long, default_value = "/v1/completions")]
    endpoint: String,
    /// The model name to send [default: the server's first in /v1/models].
    #[arg(long)]
    model: Option<String>,
    /// Prompts: random (token ids drawn from the server's vocabulary).
    #[arg(long, default_value = "random")]
    dataset_name: String,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 1024)]
    random_input_len: usize,
    /// Most new tokens per request.
    #[arg(long, default_value_t = 128)]
    random_output_len: usize,
    /// Lengths are uniform in [len·(1−r), len·(1+r)].
    #[arg(long, default_value_t = 0.0)]
    random_range_ratio: f64,
    /// Requests in all.
    #[arg(long, default_value_t = 1000)]
    num_prompts: usize,
    /// Requests per second, as a Poisson process; inf sends all at once.
    #[arg(long, default_value = "inf")]
    request_rate: f64,
    /// Requests in flight at most.
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Ask the server to go past EOS (every request generates its full length).
    #[arg(long)]
    ignore_eos: bool,
    /// Seed of the prompts and of the arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Bearer key [default: $FMOE_API_KEY, else none].
    #[arg(long)]
    api_key: Option<String>,
    /// Append the results as one JSON object (a line) to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn serve(args: ServeArgs) -> Result<()> {
    let cfg = BenchConfig {
        base_url: args.base_url,
        endpoint: args.endpoint,
        model: args.model,
        dataset_name: args.dataset_name,
        random_input_len: args.random_input_len,
        random_output_len: args.random_output_len,
        random_range_ratio: args.random_range_ratio,
        num_prompts: args.num_prompts,
        request_rate: args.request_rate,
        max_concurrency: args.max_concurrency,
        ignore_eos: args.ignore_eos,
        seed: args.seed,
        api_key: args
            .api_key
            .or_else(|| std::env::var("FMOE_API_KEY").ok().filter(|k| !k.is_empty())),
        progress: true,
    };
    let report = run(&cfg)?;
    let mut out = std::io::stdout().lock();
    write!(out, "{}", report.table()).map_err(super::stdout_error)?;
    for e in &report.errors {
        eprintln!("failed: {e}");
    }
    if let Some(path) = &args.json {
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("--json {}", path.display()))?;
        writeln!(f, "{}", serde_json::to_string(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
