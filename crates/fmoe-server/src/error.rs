//! The server's errors: [`ServerError`] for what stops it (binding, loading, a bad chat
//! template), [`ApiError`] for what one request gets back, as an OpenAI-style body
//! `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// What stops the server from starting or serving.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("loading the model: {0}")]
    Load(String),
    #[error("the chat template: {0}")]
    Template(String),
    #[error("{path}: {msg}")]
    TokenizerConfig { path: String, msg: String },
    #[error("the metrics recorder: {0}")]
    Metrics(String),
    #[error(transparent)]
    Engine(#[from] fmoe_engine::Error),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, ServerError>;

/// One request's failure, sent as an OpenAI error body.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: u16,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// A 400 about request field `param`.
    pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    /// A 400 about the request as a whole.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// OpenAI's error type for the status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 404 | 405 | 408 | 413 | 415 => "invalid_request_error",
            401 => "authentication_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        let body = Body {
            error: Inner {
                message: &self.message,
                kind: self.kind(),
                param: self.param.as_deref(),
                code: self.status.as_u16(),
            },
        };
        serde_json::to_string(&body).unwrap_or_else(|_| String::from("{\"error\":{}}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (
            self.status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            self.body(),
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        r
    }
}

/// An engine error for a request: the engine's own checks are the client's fault (400), a
/// stopped engine is 503, anything else 500.
pub fn from_engine(e: fmoe_engine::Error) -> ApiError {
    match e {
        fmoe_engine::Error::Request(m) if m.contains("engine has stopped") => {
            ApiError::unavailable("the server is stopping")
        }
        fmoe_engine::Error::Request(m) => ApiError::invalid(m),
        other => ApiError::internal(other.to_string()),
    }
}
