//! `/metrics`: vLLM's metric names under an `fmoe:` prefix, through the `metrics` facade and the
//! Prometheus exporter. Engine state (running, waiting, KV usage, prefix cache, preemptions,
//! token counts) is read from the engine at each scrape; per-request latencies are recorded as
//! outputs arrive ([`Tracker`]).

use std::time::Instant;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use fmoe_engine::{EngineStats, FinishReason, RequestOutput};

use crate::error::ServerError;
use crate::state::Slot;

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
];

/// Installs the process's recorder (once; a second call reuses nothing and fails).
pub fn install() -> Result<PrometheusHandle, ServerError> {
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .map_err(|e| ServerError::Metrics(e.to_string()))?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| ServerError::Metrics(e.to_string()))?;
    // Every series present from the start (zero), so a scrape before any request shows them.
    for reason in ["stop", "length", "abort", "error"] {
        counter!("fmoe:request_success_total", "finished_reason" => reason).absolute(0);
    }
    Ok(handle)
}

/// The info metric: the MoE method and kernel family in use.
pub fn set_info(model: &str, method: &str, kernel: &str) {
    gauge!("fmoe:model_info", "model" => model.to_string(), "moe_method" => method.to_string(), "moe_kernel" => kernel.to_string()).set(1.0);
}

/// The engine's state now.
pub fn set_engine(s: &EngineStats, kv_usage: f64) {
    gauge!("fmoe:num_requests_running").set(s.running as f64);
    gauge!("fmoe:num_requests_waiting").set(s.waiting as f64);
    gauge!("fmoe:kv_cache_usage_perc").set(kv_usage);
    gauge!("fmoe:kv_blocks_used").set(s.used_blocks as f64);
    gauge!("fmoe:kv_blocks_total").set(s.num_blocks as f64);
    counter!("fmoe:prefix_cache_queries").absolute(s.prefix_cache_queries);
    counter!("fmoe:prefix_cache_hits").absolute(s.prefix_cache_hits);
    counter!("fmoe:num_preemptions").absolute(s.preemptions);
    counter!("fmoe:prompt_tokens_total").absolute(s.prompt_tokens);
    counter!("fmoe:generation_tokens_total").absolute(s.generation_tokens);
}

/// OpenAI's name of a finish reason.
pub fn openai_reason(r: &FinishReason) -> &'static str {
    match r {
        FinishReason::Eos | FinishReason::StopToken(_) | FinishReason::Stop(_) => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
        FinishReason::Error(_) => "error",
    }
}

/// One engine request's latencies as its outputs arrive; holds its queue place until the first
/// output. Samples that never finish (the client went away) count as aborted when it drops.
pub struct Tracker {
    slot: Slot,
    /// Per sample: when its last token arrived, and whether it finished.
    last_token: Vec<Option<Instant>>,
    finished: Vec<bool>,
    first_seen: bool,
}

impl Tracker {
    pub fn new(slot: Slot, n: usize) -> Tracker {
        Tracker {
            slot,
            last_token: vec![None; n],
            finished: vec![false; n],
            first_seen: false,
        }
    }

    pub fn observe(&mut self, out: &RequestOutput) {
        self.slot.release();
        let t = &out.timings;
        if !self.first_seen {
            self.first_seen = true;
            if let Some(s) = t.scheduled {
                histogram!("fmoe:request_queue_time_seconds")
                    .record(s.duration_since(t.arrival).as_secs_f64());
            }
            if let Some(f) = t.first_token {
                histogram!("fmoe:time_to_first_token_seconds")
                    .record(f.duration_since(t.arrival).as_secs_f64());
            }
        }
        let i = out.index;
        if i >= self.finished.len() {
            return;
        }
        if !out.new_token_ids.is_empty() {
            let now = Instant::now();
            if let Some(prev) = self.last_token[i] {
                histogram!("fmoe:inter_token_latency_seconds")
                    .record(now.duration_since(prev).as_secs_f64());
            }
            self.last_token[i] = Some(now);
        }
        if let Some(r) = &out.finish_reason
            && !self.finished[i]
        {
            self.finished[i] = true;
            let end = t.finished.unwrap_or_else(Instant::now);
            histogram!("fmoe:e2e_request_latency_seconds")
                .record(end.duration_since(t.arrival).as_secs_f64());
            counter!("fmoe:request_success_total", "finished_reason" => openai_reason(r))
                .increment(1);
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        let left = self.finished.iter().filter(|f| !**f).count() as u64;
        if left > 0 {
            counter!("fmoe:request_success_total", "finished_reason" => "abort").increment(left);
        }
    }
}
