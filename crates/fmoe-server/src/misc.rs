//! The small endpoints: `/v1/models`, `/health`, `/version`, `/tokenize`, `/detokenize`,
//! `/tokenizer_info` (what lm_eval's remote tokenizer asks), `/metrics`, and the JSON 404/405.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::completions::{check_ids, check_model, encode};
use crate::error::ApiError;
use crate::http::read_body;
use crate::protocol::{DetokenizeRequest, MAX_MESSAGES, TokenizeRequest, parse};
use crate::respond::unix_now;
use crate::state::AppState;

fn reply(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}

pub async fn models(State(s): State<AppState>) -> Response {
    reply((|| {
        let ready = s.ready()?;
        Ok(axum::Json(json!({
            "object": "list",
            "data": [{
                "id": s.config.served_model_name,
                "object": "model",
                "created": unix_now(),
                "owned_by": "fmoe",
                "root": s.config.served_model_name,
                "parent": null,
                "max_model_len": ready.max_model_len(),
            }],
        }))
        .into_response())
    })())
}

/// 200 once the model is loaded, 503 while starting or stopping.
pub async fn health(State(s): State<AppState>) -> Response {
    match s.ready() {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn version() -> Response {
    axum::Json(json!({ "version": env!("CARGO_PKG_VERSION") })).into_response()
}

pub async fn tokenize(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    reply(
        async {
            let ready = s.ready()?;
            let bytes = read_body(&headers, body, s.config.max_request_bytes).await?;
            let req: TokenizeRequest = parse(&bytes)?;
            check_model(&s, req.model.as_deref())?;
            let tok = ready.tokenizer("/tokenize")?;
            let tokens = match (&req.prompt, &req.messages) {
                (Some(p), None) => encode(
                    tok,
                    p,
                    req.add_special_tokens.unwrap_or(true),
                    s.config.max_request_bytes,
                )?,
                (None, Some(m)) => {
                    if m.len() > MAX_MESSAGES {
                        return Err(ApiError::bad(
                            "messages",
                            format!("at most {MAX_MESSAGES} messages"),
                        ));
                    }
                    let t = crate::chat_api::template(&ready)?;
                    let text = t.render(m, req.add_generation_prompt.unwrap_or(true))?;
                    encode(
                        tok,
                        &text,
                        req.add_special_tokens.unwrap_or(false),
                        s.config.max_request_bytes,
                    )?
                }
                _ => {
                    return Err(ApiError::invalid(
                        "give exactly one of `prompt` and `messages`",
                    ));
                }
            };
            Ok(axum::Json(json!({
                "count": tokens.len(),
                "max_model_len": ready.max_model_len(),
                "tokens": tokens,
            }))
            .into_response())
        }
        .await,
    )
}

pub async fn detokenize(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    reply(
        async {
            let ready = s.ready()?;
            let bytes = read_body(&headers, body, s.config.max_request_bytes).await?;
            let req: DetokenizeRequest = parse(&bytes)?;
            check_model(&s, req.model.as_deref())?;
            let tok = ready.tokenizer("/detokenize")?;
            let ids = req
                .tokens
                .ok_or_else(|| ApiError::bad("tokens", "`tokens` is required"))?;
            if !ids.is_empty() {
                check_ids(&ids, ready.info.vocab_size, "tokens")?;
            }
            let text = tok
                .decode(&ids)
                .map_err(|e| ApiError::bad("tokens", format!("decoding: {e}")))?;
            Ok(axum::Json(json!({ "prompt": text })).into_response())
        }
        .await,
    )
}

pub async fn tokenizer_info(State(s): State<AppState>) -> Response {
    reply((|| {
        let ready = s.ready()?;
        let c = &ready.tokenizer_config;
        let template = ready.chat_template.as_ref().map(|t| t.source.clone());
        Ok(axum::Json(json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": c.bos_token,
            "eos_token": c.eos_token,
            "model_max_length": c.model_max_length.unwrap_or(ready.max_model_len() as f64),
            "max_model_len": ready.max_model_len(),
            "chat_template": template,
            "vocab_size": ready.info.vocab_size,
        }))
        .into_response())
    })())
}

/// Prometheus text: the engine's state read now, then everything recorded.
pub async fn metrics(State(s): State<AppState>) -> Response {
    if let Ok(ready) = s.ready() {
        let h = ready.handle.clone();
        if let Ok(Ok((stats, kv))) = tokio::task::spawn_blocking(move || h.stats()).await {
            crate::metrics::set_engine(&stats, kv);
        }
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.prometheus.render(),
    )
        .into_response()
}

pub async fn not_found() -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint").into_response()
}

pub async fn method_not_allowed() -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "this method is not allowed on this endpoint",
    )
    .into_response()
}
