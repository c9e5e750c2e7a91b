//! `POST /v1/chat/completions`: the messages rendered with the chat template, encoded without
//! added special tokens (the template writes them), generated as a completion; the answer (or
//! its stream of `chat.completion.chunk`s) in OpenAI's chat shape.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{Value, json};

use fmoe_engine::{Request, RequestOutput, TokenLogprobs};
use fmoe_models::Tokenizer;

use crate::chat::ChatTemplate;
use crate::completions::{check_ids, check_model, encode, stop_reason};
use crate::error::ApiError;
use crate::http::read_body;
use crate::metrics::openai_reason;
use crate::protocol::{
    ChatRequest, MAX_MESSAGES, engine_params, logprobs_count, max_tokens, parse,
};
use crate::respond::{
    Choice, finish_error, logprob, response_id, sse_done, sse_error, sse_event, sse_response,
    token_text, unix_now, usage,
};
use crate::state::{AppState, Ready, Running, submit};

/// The model's chat template, or the 400 the issue asks for when it has none.
pub fn template(ready: &Ready) -> Result<&ChatTemplate, ApiError> {
    ready.chat_template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "this model has no chat template (none in its tokenizer_config.json): start the server with --chat-template FILE",
        )
    })
}

pub async fn handler(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match chat(&s, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

struct Shape {
    id: String,
    created: u64,
    model: String,
    n: usize,
    top_n: Option<usize>,
    include_usage: bool,
    prompt_tokens: usize,
    tokenizer: Option<Arc<Tokenizer>>,
}

async fn chat(s: &AppState, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let ready = s.ready()?;
    let bytes: Bytes = read_body(headers, body, s.config.max_request_bytes).await?;
    let req: ChatRequest = parse(&bytes)?;
    check_model(s, req.model.as_deref())?;
    let messages = req
        .messages
        .as_ref()
        .ok_or_else(|| ApiError::bad("messages", "`messages` is required"))?;
    if messages.is_empty() || messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad(
            "messages",
            format!(
                "messages must hold 1..={MAX_MESSAGES} messages, got {}",
                messages.len()
            ),
        ));
    }
    let tok = ready.tokenizer("chat")?;
    let text = template(&ready)?.render(messages, req.add_generation_prompt.unwrap_or(true))?;
    let ids = encode(tok, &text, false, s.config.max_request_bytes)?;
    check_ids(&ids, ready.info.vocab_size, "messages")?;
    let top_n = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (true, t) => Some(logprobs_count("top_logprobs", t.unwrap_or(0))?),
        (false, Some(_)) => {
            return Err(ApiError::bad(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        }
        (false, None) => None,
    };
    let mut params = engine_params(&req.sampling(), ready.info.vocab_size, 1.0)?;
    params.logprobs = top_n;
    let (field, value) = match req.max_completion_tokens {
        Some(v) => ("max_completion_tokens", Some(v)),
        None => ("max_tokens", req.max_tokens),
    };
    params.max_tokens = max_tokens(
        field,
        value,
        usize::MAX,
        ids.len(),
        ready.max_model_len(),
        false,
    )?;
    let shape = Shape {
        id: response_id("chatcmpl"),
        created: unix_now(),
        model: s.config.served_model_name.clone(),
        n: params.n,
        top_n,
        include_usage: req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        prompt_tokens: ids.len(),
        tokenizer: ready.tokenizer.clone(),
    };
    let running = submit(
        s,
        &ready,
        vec![Request {
            prompt: ids,
            params,
        }],
    )
    .await?;
    if req.stream.unwrap_or(false) {
        Ok(sse_response(stream_events(running, shape)))
    } else {
        whole(running, shape).await
    }
}

/// OpenAI's chat `logprobs.content` entries.
fn content_logprobs(
    tok: Option<&Tokenizer>,
    ids: &[u32],
    lps: &[TokenLogprobs],
    top_n: usize,
) -> Value {
    let entry = |id: u32, v: f32| {
        let t = token_text(tok, id);
        json!({ "token": t, "logprob": logprob(v), "bytes": t.as_bytes() })
    };
    let content: Vec<Value> = ids
        .iter()
        .zip(lps)
        .map(|(&id, lp)| {
            let mut e = entry(id, lp.logprob);
            let top: Vec<Value> = lp
                .top
                .iter()
                .take(top_n)
                .map(|&(t, v)| entry(t, v))
                .collect();
            e["top_logprobs"] = Value::Array(top);
            e
        })
        .collect();
    json!({ "content": content })
}

async fn whole(mut running: Running, shape: Shape) -> Result<Response, ApiError> {
    let mut choices: Vec<Choice> = (0..shape.n).map(|_| Choice::default()).collect();
    while let Some((_, o)) = running.next().await {
        if let Some(c) = choices.get_mut(o.index) {
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
        completion += c.generated;
        let logprobs = match shape.top_n {
            None => Value::Null,
            Some(n) => content_logprobs(tok, &c.token_ids, &c.logprobs, n),
        };
        out.push(json!({
            "index": i,
            "message": { "role": "assistant", "content": c.text },
            "logprobs": logprobs,
            "finish_reason": c.finish.as_ref().map(openai_reason),
            "stop_reason": stop_reason(c.finish.as_ref()),
        }));
    }
    Ok(axum::Json(json!({
        "id": shape.id,
        "object": "chat.completion",
        "created": shape.created,
        "model": shape.model,
        "choices": out,
        "usage": usage(shape.prompt_tokens, completion),
    }))
    .into_response())
}

struct StreamState {
    running: Running,
    shape: Shape,
    choices: Vec<Choice>,
    role_sent: Vec<bool>,
    done: bool,
}

fn stream_events(running: Running, shape: Shape) -> impl futures_util::Stream<Item = Bytes> {
    let n = shape.n;
    let st = StreamState {
        running,
        shape,
        choices: (0..n).map(|_| Choice::default()).collect(),
        role_sent: vec![false; n],
        done: false,
    };
    stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        match st.running.next().await {
            Some((_, o)) => {
                let ev = st.chunk(&o);
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
    fn event(&self, choices: Value) -> Bytes {
        sse_event(&json!({
            "id": self.shape.id,
            "object": "chat.completion.chunk",
            "created": self.shape.created,
            "model": self.shape.model,
            "choices": choices,
        }))
    }

    fn chunk(&mut self, o: &RequestOutput) -> Bytes {
        let i = o.index;
        let Some(choice) = self.choices.get_mut(i) else {
            return Bytes::new();
        };
        choice.push(o);
        if let Some(fmoe_engine::FinishReason::Error(m)) = &o.finish_reason {
            return sse_error(&ApiError::internal(format!("generation failed: {m}")));
        }
        let mut out = Vec::new();
        if !self.role_sent[i] {
            self.role_sent[i] = true;
            out.extend_from_slice(&self.event(json!([{
                "index": i,
                "delta": { "role": "assistant", "content": "" },
                "logprobs": null,
                "finish_reason": null,
            }])));
        }
        let logprobs = match self.shape.top_n {
            None => Value::Null,
            Some(n) => content_logprobs(
                self.shape.tokenizer.as_deref(),
                &o.new_token_ids,
                &o.logprobs,
                n,
            ),
        };
        let delta = if o.text_delta.is_empty() && o.finish_reason.is_some() {
            json!({})
        } else {
            json!({ "content": o.text_delta })
        };
        out.extend_from_slice(&self.event(json!([{
            "index": i,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": o.finish_reason.as_ref().map(openai_reason),
            "stop_reason": stop_reason(o.finish_reason.as_ref()),
        }])));
        Bytes::from(out)
    }

    fn finish(&mut self) -> Bytes {
        let mut out = Vec::new();
        if self.choices.iter().any(|c| c.finish.is_none()) {
            out.extend_from_slice(&sse_error(&ApiError::unavailable(
                "the engine stopped before the request finished",
            )));
        }
        if self.shape.include_usage {
            let completion: usize = self.choices.iter().map(|c| c.generated).sum();
            out.extend_from_slice(&sse_event(&json!({
                "id": self.shape.id,
                "object": "chat.completion.chunk",
                "created": self.shape.created,
                "model": self.shape.model,
                "choices": [],
                "usage": usage(self.shape.prompt_tokens, completion),
            })));
        }
        out.extend_from_slice(&sse_done());
        Bytes::from(out)
    }
}
