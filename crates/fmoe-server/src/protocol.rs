//! The request bodies the server reads, and their checks. A body is parsed with
//! `serde_path_to_error`, so a field of the wrong type is a 400 naming that field; fields the
//! server does not know are ignored (as vLLM does); every known field's value is checked against
//! its range before anything reaches the engine.

use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Most prompts one completions request may carry.
pub const MAX_PROMPTS: usize = 256;
/// Most stop strings, and the longest one (bytes).
pub const MAX_STOPS: usize = 64;
pub const MAX_STOP_BYTES: usize = 1024;
/// Most stop token ids.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;
/// Most samples per prompt (`n`).
pub const MAX_N: usize = 64;
/// Most logprobs per token (OpenAI's bound).
pub const MAX_LOGPROBS: i64 = 20;
/// Most chat messages.
pub const MAX_MESSAGES: usize = 4096;

/// `body` as a `T`, or a 400 naming the field that is wrong.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid UTF-8: {e}")))?;
    if text.trim().is_empty() {
        return Err(ApiError::invalid("the body is empty; send a JSON object"));
    }
    let de = &mut serde_json::Deserializer::from_str(text);
    match serde_path_to_error::deserialize::<_, T>(&mut *de) {
        Ok(v) => {
            de.end()
                .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))?;
            Ok(v)
        }
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let msg = format!("invalid JSON body: {inner}");
            if path.is_empty() || path == "." {
                Err(ApiError::invalid(msg))
            } else {
                Err(ApiError::bad(&path, format!("{path}: {msg}")))
            }
        }
    }
}

/// `prompt` in any of the four shapes OpenAI's completions take.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// A string or a list of strings (`stop`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The sampling fields completions and chat share.
#[derive(Clone, Debug, Default)]
pub struct SamplingFields {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub n: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Option<Prompt>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub n: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub echo: Option<bool>,
    pub logprobs: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Ignored (OpenAI's end-user id).
    #[allow(dead_code)]
    pub user: Option<serde_json::Value>,
}

/// A chat message's content: text, or a list of parts of which the text ones are joined.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Option<Vec<Message>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub n: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub add_generation_prompt: Option<bool>,
    #[allow(dead_code)]
    pub user: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Message>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Option<Vec<u32>>,
}

macro_rules! sampling_fields {
    ($t:ty) => {
        impl $t {
            /// The sampling fields (not flattened in the struct, so that a field's type error
            /// names the field).
            pub fn sampling(&self) -> SamplingFields {
                SamplingFields {
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    n: self.n,
                    seed: self.seed,
                    stop: self.stop.clone(),
                    stop_token_ids: self.stop_token_ids.clone(),
                    ignore_eos: self.ignore_eos,
                }
            }
        }
    };
}
sampling_fields!(CompletionRequest);
sampling_fields!(ChatRequest);

/// The engine's sampling parameters from the shared fields; `vocab` bounds the stop ids.
pub fn engine_params(
    s: &SamplingFields,
    vocab: usize,
    default_temperature: f64,
) -> Result<fmoe_engine::RequestParams, ApiError> {
    let temperature = s.temperature.unwrap_or(default_temperature);
    if !(temperature.is_finite() && (0.0..=100.0).contains(&temperature)) {
        return Err(ApiError::bad(
            "temperature",
            format!("temperature must be in [0, 100], got {temperature}"),
        ));
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            "top_p",
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match s.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX).min(vocab),
        Some(k) => {
            return Err(ApiError::bad(
                "top_k",
                format!("top_k must be -1 (off) or positive, got {k}"),
            ));
        }
    };
    let n = s.n.unwrap_or(1);
    if !(1..=MAX_N as i64).contains(&n) {
        return Err(ApiError::bad(
            "n",
            format!("n must be in 1..={MAX_N}, got {n}"),
        ));
    }
    // Any i64 is a seed (a negative one by its two's complement bits).
    let seed = s.seed.map(|v| v as u64);
    let stop = match &s.stop {
        None => Vec::new(),
        Some(OneOrMany::One(t)) => vec![t.clone()],
        Some(OneOrMany::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::bad(
            "stop",
            format!("at most {MAX_STOPS} stop strings, got {}", stop.len()),
        ));
    }
    if let Some(t) = stop.iter().find(|t| t.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(
            "stop",
            format!(
                "a stop string may have at most {MAX_STOP_BYTES} bytes, got {}",
                t.len()
            ),
        ));
    }
    let stop: Vec<String> = stop.into_iter().filter(|t| !t.is_empty()).collect();
    let ids = s.stop_token_ids.clone().unwrap_or_default();
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::bad(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} stop token ids, got {}",
                ids.len()
            ),
        ));
    }
    let mut stop_token_ids = Vec::with_capacity(ids.len());
    for id in ids {
        if id < 0 || id as u64 >= vocab as u64 {
            return Err(ApiError::bad(
                "stop_token_ids",
                format!("stop token id {id} is outside the vocabulary (0..{vocab})"),
            ));
        }
        stop_token_ids.push(id as u32);
    }
    Ok(fmoe_engine::RequestParams {
        max_tokens: 16,
        sampling: fmoe_engine::SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            seed: 0,
        },
        seed,
        stop,
        stop_token_ids,
        ignore_eos: s.ignore_eos.unwrap_or(false),
        logprobs: None,
        prompt_logprobs: None,
        n: n as usize,
    })
}

/// `max_tokens` checked: not negative, and (with the prompt) within the context.
pub fn max_tokens(
    field: &str,
    value: Option<i64>,
    default: usize,
    prompt_len: usize,
    max_model_len: usize,
    allow_zero: bool,
) -> Result<usize, ApiError> {
    let m = match value {
        None => default.min(max_model_len.saturating_sub(prompt_len)),
        Some(v) if v < 0 => {
            return Err(ApiError::bad(
                field,
                format!("{field} must be at least 0, got {v}"),
            ));
        }
        Some(0) if !allow_zero => {
            return Err(ApiError::bad(
                field,
                format!("{field} must be at least 1 (0 only with echo)"),
            ));
        }
        Some(v) => usize::try_from(v).unwrap_or(usize::MAX),
    };
    if prompt_len >= max_model_len || prompt_len.saturating_add(m) > max_model_len {
        return Err(ApiError::bad(
            field,
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt_len} in the prompt, {m} in the completion). Please reduce the length of the prompt or {field}.",
                prompt_len.saturating_add(m)
            ),
        ));
    }
    Ok(m)
}

/// A logprobs count in 0..=20.
pub fn logprobs_count(field: &str, v: i64) -> Result<usize, ApiError> {
    if !(0..=MAX_LOGPROBS).contains(&v) {
        return Err(ApiError::bad(
            field,
            format!("{field} must be in 0..={MAX_LOGPROBS}, got {v}"),
        ));
    }
    Ok(v as usize)
}
