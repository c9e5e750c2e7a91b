//! `fmoe bench serve`: a load generator after `vllm bench serve`. Random prompts of token ids
//! (lengths uniform within `random_range_ratio` of the asked ones) are sent as streaming
//! completions, arriving as a Poisson process of `request_rate` per second (`inf`: all at
//! once) with at most `max_concurrency` in flight. Every chunk's arrival is timed: TTFT (the
//! first chunk), ITL (between chunks), TPOT ((latency − TTFT)/(tokens − 1)), E2E latency.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

/// What `fmoe bench serve` runs.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub base_url: String,
    pub endpoint: String,
    /// The model name to send [default: the server's first in /v1/models].
    pub model: Option<String>,
    pub dataset_name: String,
    pub random_input_len: usize,
    pub random_output_len: usize,
    pub random_range_ratio: f64,
    pub num_prompts: usize,
    /// Requests per second; infinite sends all at once.
    pub request_rate: f64,
    pub max_concurrency: Option<usize>,
    pub ignore_eos: bool,
    pub seed: u64,
    pub api_key: Option<String>,
    pub progress: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{field} {value}: {msg}")]
    Config {
        field: &'static str,
        value: String,
        msg: &'static str,
    },
    #[error("{url}: {msg}")]
    Server { url: String, msg: String },
    #[error("starting the async runtime: {0}")]
    Runtime(std::io::Error),
}

/// The results, as vLLM names them.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub request_rate: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub mean_ttft_ms: f64,
    pub median_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub mean_tpot_ms: f64,
    pub median_tpot_ms: f64,
    pub p99_tpot_ms: f64,
    pub mean_itl_ms: f64,
    pub median_itl_ms: f64,
    pub p99_itl_ms: f64,
    pub mean_e2el_ms: f64,
    pub median_e2el_ms: f64,
    pub p99_e2el_ms: f64,
    /// The first few failures' messages.
    pub errors: Vec<String>,
}

/// One request's timings.
#[derive(Default)]
struct Outcome {
    ok: bool,
    error: Option<String>,
    prompt_len: usize,
    output_tokens: usize,
    ttft: f64,
    itl: Vec<f64>,
    latency: f64,
}

fn check(cfg: &BenchConfig) -> Result<(), BenchError> {
    let bad = |field, value: String, msg| Err(BenchError::Config { field, value, msg });
    if cfg.dataset_name != "random" {
        return bad(
            "--dataset-name",
            cfg.dataset_name.clone(),
            "only `random` is supported",
        );
    }
    if cfg.endpoint != "/v1/completions" {
        return bad(
            "--endpoint",
            cfg.endpoint.clone(),
            "only /v1/completions is supported",
        );
    }
    if !(0.0..1.0).contains(&cfg.random_range_ratio) {
        return bad(
            "--random-range-ratio",
            cfg.random_range_ratio.to_string(),
            "must be in [0, 1)",
        );
    }
    if cfg.random_input_len == 0 || cfg.random_output_len == 0 {
        return bad(
            "--random-input-len/--random-output-len",
            format!("{}/{}", cfg.random_input_len, cfg.random_output_len),
            "must be at least 1",
        );
    }
    if cfg.num_prompts == 0 {
        return bad("--num-prompts", "0".into(), "must be at least 1");
    }
    if cfg.request_rate.is_nan() || cfg.request_rate <= 0.0 {
        return bad(
            "--request-rate",
            cfg.request_rate.to_string(),
            "must be positive (inf: all at once)",
        );
    }
    if cfg.max_concurrency == Some(0) {
        return bad("--max-concurrency", "0".into(), "must be at least 1");
    }
    Ok(())
}

/// Runs the benchmark on a runtime of its own.
pub fn run(cfg: &BenchConfig) -> Result<BenchReport, BenchError> {
    check(cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(BenchError::Runtime)?;
    rt.block_on(run_async(cfg))
}

fn server_err(url: &str, msg: impl std::fmt::Display) -> BenchError {
    BenchError::Server {
        url: url.to_string(),
        msg: msg.to_string(),
    }
}

async fn get_json(client: &reqwest::Client, url: &str) -> Result<Value, BenchError> {
    let r = client
        .get(url)
        .send()
        .await
        .map_err(|e| server_err(url, e))?;
    if !r.status().is_success() {
        return Err(server_err(url, format!("status {}", r.status())));
    }
    r.json().await.map_err(|e| server_err(url, e))
}

/// Lengths uniform in `[len·(1−r), len·(1+r)]`, at least 1.
fn length(rng: &mut ChaCha8Rng, len: usize, ratio: f64) -> usize {
    let lo = ((len as f64) * (1.0 - ratio)).floor().max(1.0) as usize;
    let hi = ((len as f64) * (1.0 + ratio)).ceil().max(lo as f64) as usize;
    rng.random_range(lo..=hi)
}

async fn run_async(cfg: &BenchConfig) -> Result<BenchReport, BenchError> {
    let base = cfg.base_url.trim_end_matches('/').to_string();
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(k) = &cfg.api_key
        && let Ok(v) = reqwest::header::HeaderValue::from_str(&format!("Bearer {k}"))
    {
        headers.insert(reqwest::header::AUTHORIZATION, v);
    }
    let client = reqwest::Client::builder()
        .default_headers(headers)
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(|e| server_err(&base, e))?;
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => {
            let url = format!("{base}/v1/models");
            let v = get_json(&client, &url).await?;
            v["data"][0]["id"]
                .as_str()
                .ok_or_else(|| server_err(&url, "no model listed"))?
                .to_string()
        }
    };
    let url = format!("{base}/tokenizer_info");
    let vocab = get_json(&client, &url).await?["vocab_size"]
        .as_u64()
        .ok_or_else(|| server_err(&url, "no vocab_size"))? as u32;
    // Ids past the first few (the special tokens), as random text would tokenize to.
    let low = 3.min(vocab.saturating_sub(1));
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let requests: Vec<(Vec<u32>, usize)> = (0..cfg.num_prompts)
        .map(|_| {
            let n = length(&mut rng, cfg.random_input_len, cfg.random_range_ratio);
            let prompt = (0..n).map(|_| rng.random_range(low..vocab)).collect();
            let out = length(&mut rng, cfg.random_output_len, cfg.random_range_ratio);
            (prompt, out)
        })
        .collect();
    let bar = if cfg.progress {
        indicatif::ProgressBar::new(cfg.num_prompts as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    let limit = Arc::new(Semaphore::new(
        cfg.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let gaps = Exp::new(cfg.request_rate)
        .ok()
        .filter(|_| cfg.request_rate.is_finite());
    let target = format!("{base}{}", cfg.endpoint);
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (prompt, max_tokens) in requests {
        if let Some(exp) = &gaps {
            let gap: f64 = exp.sample(&mut rng);
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        }
        let permit = limit.clone().acquire_owned().await;
        let body = json!({
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": cfg.ignore_eos,
            "stream": true,
            "stream_options": { "include_usage": true },
        });
        let client = client.clone();
        let target = target.clone();
        let bar = bar.clone();
        let prompt_len = prompt.len();
        tasks.push(tokio::spawn(async move {
            let mut o = one(&client, &target, &body).await;
            o.prompt_len = prompt_len;
            drop(permit);
            bar.inc(1);
            o
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(t.await.unwrap_or_else(|e| Outcome {
            error: Some(format!("the request task failed: {e}")),
            ..Outcome::default()
        }));
    }
    let duration = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok(report(cfg, &outcomes, duration))
}

/// One streamed request, timed chunk by chunk.
async fn one(client: &reqwest::Client, url: &str, body: &Value) -> Outcome {
    let mut o = Outcome::default();
    let st = Instant::now();
    let mut resp = match client.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => {
            o.error = Some(format!("sending: {e}"));
            return o;
        }
    };
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        o.error = Some(format!("status {status}: {text}"));
        return o;
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut last = st;
    let mut chunks = 0usize;
    let mut done = false;
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => buf.extend_from_slice(&c),
            Ok(None) => break,
            Err(e) => {
                o.error = Some(format!("reading the stream: {e}"));
                return o;
            }
        }
        while let Some(i) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..i + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = match serde_json::from_str(data) {
                Ok(v) => v,
                Err(e) => {
                    o.error = Some(format!("a chunk is not JSON ({e}): {data}"));
                    return o;
                }
            };
            if let Some(e) = v.get("error") {
                o.error = Some(format!("error event: {e}"));
                return o;
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                o.output_tokens = n as usize;
            }
            if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                let now = Instant::now();
                if chunks == 0 {
                    o.ttft = now.duration_since(st).as_secs_f64();
                } else {
                    o.itl.push(now.duration_since(last).as_secs_f64());
                }
                last = now;
                chunks += 1;
            }
        }
    }
    o.latency = st.elapsed().as_secs_f64();
    if !done {
        o.error = Some("the stream ended without [DONE]".into());
        return o;
    }
    if o.output_tokens == 0 {
        o.output_tokens = chunks;
    }
    o.ok = true;
    o
}

/// Linear-interpolated percentile `q` (0–100) of `v` (NaN-free), 0 when empty.
fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let pos = q / 100.0 * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

fn stats_ms(v: &mut [f64]) -> (f64, f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    (
        mean * 1e3,
        percentile(v, 50.0) * 1e3,
        percentile(v, 99.0) * 1e3,
    )
}

fn report(cfg: &BenchConfig, outs: &[Outcome], duration: f64) -> BenchReport {
    let ok: Vec<&Outcome> = outs.iter().filter(|o| o.ok).collect();
    let mut ttft: Vec<f64> = ok.iter().map(|o| o.ttft).collect();
    let mut e2el: Vec<f64> = ok.iter().map(|o| o.latency).collect();
    let mut itl: Vec<f64> = ok.iter().flat_map(|o| o.itl.iter().copied()).collect();
    let mut tpot: Vec<f64> = ok
        .iter()
        .filter(|o| o.output_tokens > 1)
        .map(|o| (o.latency - o.ttft) / (o.output_tokens - 1) as f64)
        .collect();
    let input: usize = ok.iter().map(|o| o.prompt_len).sum();
    let output: usize = ok.iter().map(|o| o.output_tokens).sum();
    let d = duration.max(1e-9);
    let (mean_ttft_ms, median_ttft_ms, p99_ttft_ms) = stats_ms(&mut ttft);
    let (mean_tpot_ms, median_tpot_ms, p99_tpot_ms) = stats_ms(&mut tpot);
    let (mean_itl_ms, median_itl_ms, p99_itl_ms) = stats_ms(&mut itl);
    let (mean_e2el_ms, median_e2el_ms, p99_e2el_ms) = stats_ms(&mut e2el);
    BenchReport {
        completed: ok.len(),
        failed: outs.len() - ok.len(),
        duration_s: duration,
        total_input_tokens: input,
        total_output_tokens: output,
        request_throughput: ok.len() as f64 / d,
        output_throughput: output as f64 / d,
        total_token_throughput: (input + output) as f64 / d,
        request_rate: cfg.request_rate.is_finite().then_some(cfg.request_rate),
        max_concurrency: cfg.max_concurrency,
        mean_ttft_ms,
        median_ttft_ms,
        p99_ttft_ms,
        mean_tpot_ms,
        median_tpot_ms,
        p99_tpot_ms,
        mean_itl_ms,
        median_itl_ms,
        p99_itl_ms,
        mean_e2el_ms,
        median_e2el_ms,
        p99_e2el_ms,
        errors: outs
            .iter()
            .filter_map(|o| o.error.clone())
            .take(5)
            .collect(),
    }
}

impl BenchReport {
    /// vLLM's result table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let mut line = |k: &str, v: String| s.push_str(&format!("{k:<40}{v:<10}\n"));
        line(
            "============ Serving Benchmark Result ============",
            String::new(),
        );
        line("Successful requests:", self.completed.to_string());
        line("Failed requests:", self.failed.to_string());
        line("Benchmark duration (s):", format!("{:.2}", self.duration_s));
        line("Total input tokens:", self.total_input_tokens.to_string());
        line(
            "Total generated tokens:",
            self.total_output_tokens.to_string(),
        );
        line(
            "Request throughput (req/s):",
            format!("{:.2}", self.request_throughput),
        );
        line(
            "Output token throughput (tok/s):",
            format!("{:.2}", self.output_throughput),
        );
        line(
            "Total token throughput (tok/s):",
            format!("{:.2}", self.total_token_throughput),
        );
        for (title, m) in [
            (
                "Time to First Token",
                [self.mean_ttft_ms, self.median_ttft_ms, self.p99_ttft_ms],
            ),
            (
                "Time per Output Token (excl. 1st token)",
                [self.mean_tpot_ms, self.median_tpot_ms, self.p99_tpot_ms],
            ),
            (
                "Inter-token Latency",
                [self.mean_itl_ms, self.median_itl_ms, self.p99_itl_ms],
            ),
            (
                "End-to-end Latency",
                [self.mean_e2el_ms, self.median_e2el_ms, self.p99_e2el_ms],
            ),
        ] {
            let short = match title {
                "Time to First Token" => "TTFT",
                "Inter-token Latency" => "ITL",
                "End-to-end Latency" => "E2EL",
                _ => "TPOT",
            };
            line(&format!("{:-^50}", title), String::new());
            line(&format!("Mean {short} (ms):"), format!("{:.2}", m[0]));
            line(&format!("Median {short} (ms):"), format!("{:.2}", m[1]));
            line(&format!("P99 {short} (ms):"), format!("{:.2}", m[2]));
        }
        line(&"=".repeat(50), String::new());
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_as_numpy() {
        let mut v = vec![4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&mut v, 50.0), 2.5);
        assert!((percentile(&mut v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&mut [], 50.0), 0.0);
    }

    #[test]
    fn lengths_stay_in_the_range() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for _ in 0..1000 {
            let n = length(&mut rng, 100, 0.5);
            assert!((50..=150).contains(&n), "{n}");
        }
        assert!((0..100).all(|_| length(&mut rng, 7, 0.0) == 7));
    }
}
