//! The HTTP side: the accept loop (HTTP/1.1 with a header-read timeout and a bound on open
//! connections, each connection watched for a graceful shutdown), reading a body within
//! `--max-request-bytes` and a time limit, and the API-key check.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::state::AppState;

/// A client must send its request headers within this.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// ... and its body within this.
const BODY_TIMEOUT: Duration = Duration::from_secs(60);
/// Open connections at most; the accept loop waits for one to close past this.
const MAX_CONNECTIONS: usize = 4096;

/// Serves `app` on `listener` until `stop` resolves, then lets the connections finish what they
/// are doing for at most `grace`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    stop: impl Future<Output = ()>,
    grace: Duration,
) {
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut stop = std::pin::pin!(stop);
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            () = &mut stop => break,
        };
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little, keep serving.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .max_buf_size(256 << 10);
        let conn = builder.serve_connection(TokioIo::new(stream), svc);
        let watched = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = watched.await {
                tracing::debug!("connection: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "requests still running after {:.0} s: aborting them",
            grace.as_secs_f64()
        );
    }
}

/// The request's body, at most `limit` bytes (413 past it, from the Content-Length header
/// before anything is read when there is one), sent within [`BODY_TIMEOUT`] (408).
pub async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let too_large = |n: String| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is {n} bytes, more than --max-request-bytes {limit}"),
        )
    };
    if let Some(len) = headers.get(header::CONTENT_LENGTH) {
        let len = len
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| ApiError::invalid("Content-Length is not a number"))?;
        if len > limit as u64 {
            return Err(too_large(len.to_string()));
        }
    }
    let read = async {
        let mut buf: Vec<u8> = Vec::new();
        let mut data = body.into_data_stream();
        while let Some(chunk) = data.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::invalid(format!("reading the request body: {e} (incomplete body?)"))
            })?;
            if buf.len() + chunk.len() > limit {
                return Err(too_large(format!("more than {limit}")));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    match tokio::time::timeout(BODY_TIMEOUT, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s",
                BODY_TIMEOUT.as_secs()
            ),
        )),
    }
}

/// `/v1/*` needs `Authorization: Bearer KEY` when the server has a key (401 otherwise).
pub async fn require_key(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.config.api_key
        && req.uri().path().starts_with("/v1")
    {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let ok = given.is_some_and(|g| same(g.as_bytes(), key.as_bytes()));
        if !ok {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or wrong API key: send `Authorization: Bearer KEY`",
            )
            .into_response();
        }
    }
    next.run(req).await
}

/// Equality in time independent of where the bytes differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
