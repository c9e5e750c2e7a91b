//! What completions and chat share when answering: ids and timestamps, the SSE response, a
//! choice's accumulated outputs, logprob values as vLLM writes them.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use serde_json::{Value, json};

use fmoe_engine::{FinishReason, RequestOutput, TokenLogprobs};
use fmoe_models::Tokenizer;

use crate::error::ApiError;

/// vLLM's floor for a logprob (`-inf` has no JSON form).
pub const MIN_LOGPROB: f64 = -9999.0;

pub fn logprob(v: f32) -> f64 {
    (v as f64).max(MIN_LOGPROB)
}

/// A response id: `prefix-` and 24 hex digits, unique in the process.
pub fn response_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let r: u64 = rand::random();
    format!("{prefix}-{r:016x}{n:08x}")
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A token's text alone ("" without a tokenizer or for a special token).
pub fn token_text(tok: Option<&Tokenizer>, id: u32) -> String {
    tok.and_then(|t| t.decode(&[id]).ok()).unwrap_or_default()
}

/// `data: JSON\n\n`.
pub fn sse_event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

pub fn sse_done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

pub fn sse_response(events: impl Stream<Item = Bytes> + Send + 'static) -> Response {
    use futures_util::StreamExt;
    let body = Body::from_stream(events.map(Ok::<_, Infallible>));
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// An error in the middle of a stream, as vLLM sends it.
pub fn sse_error(e: &ApiError) -> Bytes {
    let v: Value = serde_json::from_str(&e.body()).unwrap_or(Value::Null);
    sse_event(&v)
}

/// One choice's outputs so far.
#[derive(Default)]
pub struct Choice {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    pub finish: Option<FinishReason>,
    pub generated: usize,
}

impl Choice {
    pub fn push(&mut self, o: &RequestOutput) {
        self.text.push_str(&o.text_delta);
        self.token_ids.extend_from_slice(&o.new_token_ids);
        self.logprobs.extend(o.logprobs.iter().cloned());
        if let Some(p) = &o.prompt_logprobs {
            self.prompt_logprobs = Some(p.clone());
        }
        if let Some(r) = &o.finish_reason {
            self.finish = Some(r.clone());
        }
        self.generated = o.generated_tokens;
    }
}

/// The error a choice's finish carries, if it failed.
pub fn finish_error(r: Option<&FinishReason>) -> Option<ApiError> {
    match r {
        Some(FinishReason::Error(m)) => Some(ApiError::internal(format!("generation failed: {m}"))),
        None => Some(ApiError::unavailable(
            "the engine stopped before the request finished",
        )),
        _ => None,
    }
}

/// `usage` for `prompt_tokens` prompt tokens and `completion` generated ones.
pub fn usage(prompt_tokens: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    })
}
