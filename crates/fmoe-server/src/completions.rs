//! `POST /v1/completions`: prompts as text, lists of text, token ids or lists of ids; `echo`
//! and `logprobs` as vLLM returns them (with echo, the prompt's tokens first, the first one's
//! logprob `null`); streamed over SSE or answered whole.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{Map, Value, json};

use fmoe_engine::{Request, RequestOutput, TokenLogprobs};
use fmoe_models::Tokenizer;
use fmoe_models::tokenizer::EncodeLimits;

use crate::error::ApiError;
use crate::http::read_body;
use crate::metrics::openai_reason;
use crate::protocol::{
    CompletionRequest, MAX_PROMPTS, Prompt, engine_params, logprobs_count, max_tokens, parse,
};
use crate::respond::{
    Choice, finish_error, logprob, response_id, sse_done, sse_error, sse_event, sse_response,
    token_text, unix_now, usage,
};
use crate::state::{AppState, Ready, Running, submit};

pub async fn handler(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match completions(&s, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The served model's name checked against the request's (a 400 naming it when it differs).
pub fn check_model(s: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != s.config.served_model_name => Err(ApiError::bad(
            "model",
            format!(
                "the model `{m}` does not exist; this server serves `{}`",
                s.config.served_model_name
            ),
        )),
        _ => Ok(()),
    }
}

/// Encodes a text prompt within the request-size bounds.
pub fn encode(
    tok: &Tokenizer,
    text: &str,
    special: bool,
    limit: usize,
) -> Result<Vec<u32>, ApiError> {
    let limits = EncodeLimits {
        max_input_bytes: limit,
        max_normalized_bytes: limit.saturating_mul(4),
        max_tokens: limit,
    };
    tok.encode_with_limits(text, special, &limits)
        .map_err(|e| ApiError::bad("prompt", format!("tokenizing the prompt: {e}")))
}

/// Checks token ids against the vocabulary.
pub fn check_ids(ids: &[u32], vocab: usize, field: &str) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::bad(field, format!("{field} is empty")));
    }
    if let Some(t) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad(
            field,
            format!("token id {t} is outside the vocabulary (0..{vocab})"),
        ));
    }
    Ok(())
}

/// The prompts as ids, each with the text it echoes.
fn prompts(
    ready: &Ready,
    prompt: Option<&Prompt>,
    limit: usize,
) -> Result<Vec<(Vec<u32>, String)>, ApiError> {
    let vocab = ready.info.vocab_size;
    let tok = ready.tokenizer.as_deref();
    let text = |t: &str| -> Result<(Vec<u32>, String), ApiError> {
        if t.is_empty() {
            return Err(ApiError::bad("prompt", "the prompt is empty"));
        }
        let tok = ready.tokenizer("a text prompt")?;
        let ids = encode(tok, t, true, limit)?;
        check_ids(&ids, vocab, "prompt")?;
        Ok((ids, t.to_string()))
    };
    let ids = |v: &[u32]| -> Result<(Vec<u32>, String), ApiError> {
        check_ids(v, vocab, "prompt")?;
        let echo = tok.and_then(|t| t.decode(v).ok()).unwrap_or_default();
        Ok((v.to_vec(), echo))
    };
    let out: Vec<(Vec<u32>, String)> = match prompt {
        None => return Err(ApiError::bad("prompt", "`prompt` is required")),
        Some(Prompt::Text(t)) => vec![text(t)?],
        Some(Prompt::Ids(v)) => vec![ids(v)?],
        Some(Prompt::Texts(v)) => {
            bounded(v.len())?;
            v.iter().map(|t| text(t)).collect::<Result<_, _>>()?
        }
        Some(Prompt::IdLists(v)) => {
            bounded(v.len())?;
            v.iter().map(|t| ids(t)).collect::<Result<_, _>>()?
        }
    };
    Ok(out)
}

fn bounded(n: usize) -> Result<(), ApiError> {
    if n == 0 {
        return Err(ApiError::bad("prompt", "the prompt list is empty"));
    }
    if n > MAX_PROMPTS {
        return Err(ApiError::bad(
            "prompt",
            format!("at most {MAX_PROMPTS} prompts per request, got {n}"),
        ));
    }
    Ok(())
}

/// How the answer is shaped.
struct Shape {
    id: String,
    created: u64,
    model: String,
    n: usize,
    echo: bool,
    top_n: Option<usize>,
    include_usage: bool,
    prompts: Vec<(Vec<u32>, String)>,
    tokenizer: Option<Arc<Tokenizer>>,
}

async fn completions(s: &AppState, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let ready = s.ready()?;
    let bytes: Bytes = read_body(headers, body, s.config.max_request_bytes).await?;
    let req: CompletionRequest = parse(&bytes)?;
    check_model(s, req.model.as_deref())?;
    let prompts = prompts(&ready, req.prompt.as_ref(), s.config.max_request_bytes)?;
    let echo = req.echo.unwrap_or(false);
    let top_n = req
        .logprobs
        .map(|v| logprobs_count("logprobs", v))
        .transpose()?;
    let mut base = engine_params(&req.sampling(), ready.info.vocab_size, 1.0)?;
    base.logprobs = top_n;
    if echo {
        base.prompt_logprobs = top_n;
    }
    if !base.stop.is_empty() {
        ready.tokenizer("stop strings")?;
    }
    let mut reqs = Vec::with_capacity(prompts.len());
    for (ids, _) in &prompts {
        let m = max_tokens(
            "max_tokens",
            req.max_tokens,
            16,
            ids.len(),
            ready.max_model_len(),
            echo,
        )?;
        let mut params = base.clone();
        params.max_tokens = m;
        reqs.push(Request {
            prompt: ids.clone(),
            params,
        });
    }
    let shape = Shape {
        id: response_id("cmpl"),
        created: unix_now(),
        model: s.config.served_model_name.clone(),
        n: base.n,
        echo,
        top_n,
        include_usage: req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        prompts,
        tokenizer: ready.tokenizer.clone(),
    };
    let running = submit(s, &ready, reqs).await?;
    if req.stream.unwrap_or(false) {
        Ok(sse_response(stream_events(running, shape)))
    } else {
        whole(running, shape).await
    }
}

/// vLLM's completions `logprobs` object over `entries` (a token and its logprobs, `None` for
/// the first prompt token), text offsets counted in characters from `offset`.
fn logprobs_json(
    tok: Option<&Tokenizer>,
    entries: &[(u32, Option<&TokenLogprobs>)],
    offset: usize,
) -> Value {
    let mut tokens = Vec::with_capacity(entries.len());
    let mut token_logprobs = Vec::with_capacity(entries.len());
    let mut top = Vec::with_capacity(entries.len());
    let mut offsets = Vec::with_capacity(entries.len());
    let mut at = offset;
    for (id, lp) in entries {
        let text = token_text(tok, *id);
        offsets.push(at);
        at += text.chars().count();
        match lp {
            None => {
                token_logprobs.push(Value::Null);
                top.push(Value::Null);
            }
            Some(lp) => {
                token_logprobs.push(json!(logprob(lp.logprob)));
                let mut m = Map::new();
                m.insert(text.clone(), json!(logprob(lp.logprob)));
                for (t, v) in &lp.top {
                    let key = token_text(tok, *t);
                    m.entry(key).or_insert(json!(logprob(*v)));
                }
                top.push(Value::Object(m));
            }
        }
        tokens.push(Value::String(text));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// The prompt's entries: its ids with their logprobs (the first `None`).
fn prompt_entries<'a>(
    ids: &[u32],
    lps: Option<&'a Vec<Option<TokenLogprobs>>>,
) -> Vec<(u32, Option<&'a TokenLogprobs>)> {
    ids.iter()
        .enumerate()
        .map(|(i, &id)| (id, lps.and_then(|l| l.get(i)).and_then(|x| x.as_ref())))
        .collect()
}

async fn whole(mut running: Running, shape: Shape) -> Result<Response, ApiError> {
    let n = shape.n;
    let mut choices: Vec<Choice> = (0..shape.prompts.len() * n)
        .map(|_| Choice::default())
        .collect();
    while let Some((p, o)) = running.next().await {
        if let Some(c) = choices.get_mut(p * n + o.index) {
            c.push(&o);
        }
    }
    let tok = shape.tokenizer.as_deref();
    let mut out = Vec::with_capacity(choices.len());
    let mut completion = 0;
    for (i, c) in choices.iter().enumerate() {
        if let Some(e) = finish_error(c.finish.as_ref()) {
            return Err(e);
        }
        let (ids, prompt_text) = &shape.prompts[i / n];
        completion += c.generated;
        let mut text = String::new();
        if shape.echo {
            text.push_str(prompt_text);
        }
        text.push_str(&c.text);
        let logprobs = match shape.top_n {
            None => Value::Null,
            Some(_) => {
                let mut entries = Vec::new();
                if shape.echo {
                    entries = prompt_entries(ids, c.prompt_logprobs.as_ref());
                }
                entries.extend(c.token_ids.iter().copied().zip(c.logprobs.iter().map(Some)));
                logprobs_json(tok, &entries, 0)
            }
        };
        out.push(json!({
            "index": i,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish.as_ref().map(openai_reason),
            "stop_reason": stop_reason(c.finish.as_ref()),
        }));
    }
    let prompt_tokens: usize = shape.prompts.iter().map(|(ids, _)| ids.len()).sum();
    let body = json!({
        "id": shape.id,
        "object": "text_completion",
        "created": shape.created,
        "model": shape.model,
        "choices": out,
        "usage": usage(prompt_tokens, completion),
    });
    Ok(axum::Json(body).into_response())
}

/// vLLM's `stop_reason`: the stop string or stop token id, else null.
pub fn stop_reason(r: Option<&fmoe_engine::FinishReason>) -> Value {
    match r {
        Some(fmoe_engine::FinishReason::Stop(s)) => json!(s),
        Some(fmoe_engine::FinishReason::StopToken(t)) => json!(t),
        _ => Value::Null,
    }
}

/// Per choice while streaming: characters sent so far, whether the echo went out.
#[derive(Clone, Copy, Default)]
struct Sent {
    chars: usize,
    echoed: bool,
}

struct StreamState {
    running: Running,
    shape: Shape,
    sent: Vec<Sent>,
    choices: Vec<Choice>,
    done: bool,
}

fn stream_events(running: Running, shape: Shape) -> impl futures_util::Stream<Item = Bytes> {
    let k = shape.prompts.len() * shape.n;
    let st = StreamState {
        running,
        sent: vec![Sent::default(); k],
        choices: (0..k).map(|_| Choice::default()).collect(),
        shape,
        done: false,
    };
    stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        match st.running.next().await {
            Some((p, o)) => {
                let ev = st.chunk(p, &o);
                Some((ev, st))
            }
            None => {
                st.done = true;
                Some((st.finish(), st))
            }
        }
    })
}

impl StreamState {
    fn chunk(&mut self, p: usize, o: &RequestOutput) -> Bytes {
        let n = self.shape.n;
        let i = p * n + o.index;
        let (Some(sent), Some(choice)) = (self.sent.get_mut(i), self.choices.get_mut(i)) else {
            return Bytes::new();
        };
        choice.push(o);
        if let Some(fmoe_engine::FinishReason::Error(m)) = &o.finish_reason {
            return sse_error(&ApiError::internal(format!("generation failed: {m}")));
        }
        let tok = self.shape.tokenizer.as_deref();
        let (ids, prompt_text) = &self.shape.prompts[p];
        let mut text = String::new();
        let mut entries = Vec::new();
        let echo_now = self.shape.echo && !sent.echoed;
        if echo_now {
            sent.echoed = true;
            text.push_str(prompt_text);
            entries = prompt_entries(ids, o.prompt_logprobs.as_ref());
        }
        text.push_str(&o.text_delta);
        entries.extend(
            o.new_token_ids
                .iter()
                .copied()
                .zip(o.logprobs.iter().map(Some)),
        );
        let logprobs = match self.shape.top_n {
            None => Value::Null,
            Some(_) => logprobs_json(tok, &entries, sent.chars),
        };
        sent.chars += text.chars().count();
        let v = json!({
            "id": self.shape.id,
            "object": "text_completion",
            "created": self.shape.created,
            "model": self.shape.model,
            "choices": [{
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": o.finish_reason.as_ref().map(openai_reason),
                "stop_reason": stop_reason(o.finish_reason.as_ref()),
            }],
        });
        sse_event(&v)
    }

    /// After the last output: the usage chunk when asked for, then `[DONE]` (an error event
    /// first when a choice never finished).
    fn finish(&mut self) -> Bytes {
        let mut out = Vec::new();
        if self.choices.iter().any(|c| c.finish.is_none()) {
            out.extend_from_slice(&sse_error(&ApiError::unavailable(
                "the engine stopped before the request finished",
            )));
        }
        if self.shape.include_usage {
            let prompt_tokens: usize = self.shape.prompts.iter().map(|(ids, _)| ids.len()).sum();
            let completion: usize = self.choices.iter().map(|c| c.generated).sum();
            let v = json!({
                "id": self.shape.id,
                "object": "text_completion",
                "created": self.shape.created,
                "model": self.shape.model,
                "choices": [],
                "usage": usage(prompt_tokens, completion),
            });
            out.extend_from_slice(&sse_event(&v));
        }
        out.extend_from_slice(&sse_done());
        Bytes::from(out)
    }
}
