//! What a client asks the engine for ([`Request`]) and what the engine streams back
//! ([`RequestOutput`], one per step in which a request produced something or finished).

use std::time::Instant;

use crate::sampler::{SamplingParams, TokenLogprobs};

/// A request's handle.
pub type RequestId = u64;

/// How one request is generated.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestParams {
    /// Most new tokens per sample (0: only the prompt is run, e.g. for prompt logprobs).
    pub max_tokens: usize,
    /// Temperature, top-p, top-k and the seed (`seed: None` draws one from the engine's RNG).
    pub sampling: SamplingParams,
    pub seed: Option<u64>,
    /// Stop when the text contains one of these (it is cut before it; needs a tokenizer).
    pub stop: Vec<String>,
    /// Stop after generating one of these ids (kept in the output), besides the EOS ids.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's EOS ids.
    pub ignore_eos: bool,
    /// Top-N logprobs of every generated token (the chosen token's own always included).
    pub logprobs: Option<usize>,
    /// Every prompt token's logprob and its top-N (the first token has none).
    pub prompt_logprobs: Option<usize>,
    /// Samples of the prompt, each its own output (`RequestOutput::index`).
    pub n: usize,
}

impl Default for RequestParams {
    fn default() -> Self {
        RequestParams {
            max_tokens: 16,
            sampling: SamplingParams::default(),
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            n: 1,
        }
    }
}

/// A prompt (token ids) and how to continue it.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: RequestParams,
}

/// Why a sample stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached (or the model's last position).
    Length,
    /// An EOS token was generated (it is the last of the ids).
    Eos,
    /// One of `stop_token_ids` was generated (it is the last of the ids).
    StopToken(u32),
    /// The text reached this stop string (the text is cut before it).
    Stop(String),
    /// [`crate::Engine::abort`].
    Abort,
    /// The model failed on this request's tokens (the message says how); other requests go on.
    Error(String),
}

impl FinishReason {
    /// `length`, `eos`, `stop`, `abort` or `error` (OpenAI reports eos as `stop` too).
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Eos => "eos",
            FinishReason::StopToken(_) | FinishReason::Stop(_) => "stop",
            FinishReason::Abort => "abort",
            FinishReason::Error(_) => "error",
        }
    }
}

/// When things happened to a request (the first sample's, for `n` > 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timings {
    pub arrival: Instant,
    /// First scheduled into a step.
    pub scheduled: Option<Instant>,
    pub first_token: Option<Instant>,
    pub finished: Option<Instant>,
}

/// What one step produced for one sample of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    pub id: RequestId,
    /// Which of the request's `n` samples.
    pub index: usize,
    /// Tokens generated in this step (at most one today).
    pub new_token_ids: Vec<u32>,
    /// The text those tokens added (a stop string and what follows it cut; a possible start of a
    /// stop string held back until it is decided).
    pub text_delta: String,
    /// Logprobs of `new_token_ids`, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
    /// With the sample's first output when asked for: per prompt token, its logprob and top-N
    /// (`None` for the first token).
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    pub finish_reason: Option<FinishReason>,
    pub prompt_tokens: usize,
    /// Tokens generated so far by this sample.
    pub generated_tokens: usize,
    /// Times the sample was preempted (its cache dropped and recomputed).
    pub preemptions: usize,
    pub timings: Timings,
}
