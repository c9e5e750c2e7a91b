//! fmoe-server: an OpenAI-compatible HTTP server over [`fmoe_engine::EngineHandle`], and
//! `fmoe bench serve`'s load generator ([`bench`]).
//!
//! [`serve`] binds first and answers 503 while the model loads (the `load` callback, run off the
//! async workers), then serves:
//! - `POST /v1/completions` ([`completions`]) and `POST /v1/chat/completions` ([`chat_api`],
//!   templates in [`chat`]), whole or streamed over SSE; a client that goes away drops its
//!   output receivers, which aborts its requests at the engine's next step;
//! - `GET /v1/models`, `/health`, `/version`, `/tokenizer_info`, `POST /tokenize`,
//!   `/detokenize` ([`misc`]); `GET /metrics` ([`metrics`]: vLLM's names under `fmoe:`).
//!
//! Errors are OpenAI bodies ([`error::ApiError`]); bodies are bounded by
//! `max_request_bytes` (413), admitted requests waiting for their first output by
//! `max_queued_requests` (429), `/v1/*` by the API key (401). SIGINT or SIGTERM stops the
//! listener, lets what is in flight finish for `shutdown_grace` and returns.

pub mod bench;
pub mod chat;
pub mod chat_api;
pub mod completions;
pub mod error;
mod http;
pub mod metrics;
pub mod misc;
pub mod protocol;
mod respond;
mod state;

use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use tokio::net::TcpListener;

use fmoe_engine::{Engine, EngineHandle};
use fmoe_models::Tokenizer;

pub use chat::{ChatTemplate, TokenizerConfig};
pub use error::{ApiError, Result, ServerError};
use state::{Phase, Ready, Shared};

/// How the server runs (`fmoe serve`'s flags).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port (the log line `listening on http://ADDR` names it).
    pub port: u16,
    pub served_model_name: String,
    pub api_key: Option<String>,
    /// Admitted requests without output yet, at most (429 past it).
    pub max_queued_requests: usize,
    /// Request body bytes, at most (413 past it).
    pub max_request_bytes: usize,
    /// A chat template's source that replaces the model's.
    pub chat_template: Option<String>,
    /// How long requests in flight may finish after SIGINT/SIGTERM.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8000,
            served_model_name: "fmoe".into(),
            api_key: None,
            max_queued_requests: 1024,
            max_request_bytes: 4 << 20,
            chat_template: None,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// What `load` gives the server: the engine and the tokenizer side of the model directory.
pub struct Loaded {
    pub engine: Engine,
    /// The server's own copy (the engine keeps one for text deltas).
    pub tokenizer: Option<Tokenizer>,
    pub tokenizer_config: TokenizerConfig,
}

/// Binds, loads the model with `load`, serves until SIGINT or SIGTERM (see the crate docs).
pub async fn serve<F>(config: ServerConfig, load: F) -> Result<()>
where
    F: FnOnce() -> std::result::Result<Loaded, String> + Send + 'static,
{
    let prometheus = metrics::install()?;
    let addr = format!("{}:{}", config.host, config.port);
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let local = listener.local_addr().map_err(|source| ServerError::Bind {
        addr: addr.clone(),
        source,
    })?;
    tracing::info!("listening on http://{local}");
    // Histogram samples wait in the recorder until drained: drain them on a timer, so memory
    // stays bounded between scrapes (or without any).
    let upkeep = prometheus.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    let grace = config.shutdown_grace;
    let shared = Arc::new(Shared {
        config,
        phase: RwLock::new(Phase::Starting),
        queued: Default::default(),
        prometheus,
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(http::serve(
        listener,
        router(shared.clone()),
        async move {
            let _ = stop_rx.await;
        },
        grace,
    ));
    let mut signal = std::pin::pin!(stop_signal());
    let loading = tokio::task::spawn_blocking(load);
    let loaded = tokio::select! {
        r = loading => r.map_err(|e| ServerError::Load(e.to_string()))?.map_err(ServerError::Load),
        () = &mut signal => {
            tracing::info!("stopping while the model loads");
            shared.set_phase(Phase::Stopping);
            let _ = stop_tx.send(());
            let _ = server.await;
            return Ok(());
        }
    };
    let loaded = match loaded {
        Ok(l) => l,
        Err(e) => {
            let _ = stop_tx.send(());
            let _ = server.await;
            return Err(e);
        }
    };
    let ready = Arc::new(ready(&shared, loaded)?);
    shared.set_phase(Phase::Ready(ready.clone()));
    tracing::info!("ready: serving `{}`", shared.config.served_model_name);
    signal.await;
    tracing::info!("stopping: finishing the requests in flight");
    shared.set_phase(Phase::Stopping);
    let _ = stop_tx.send(());
    let _ = server.await;
    // The engine thread lives while this handle does: requests in flight finish first.
    drop(ready);
    tracing::info!("stopped");
    Ok(())
}

/// [`serve`] on a runtime of its own; returns once it has stopped (what is still running after
/// the grace period is dropped).
pub fn serve_blocking<F>(config: ServerConfig, load: F) -> Result<()>
where
    F: FnOnce() -> std::result::Result<Loaded, String> + Send + 'static,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("fmoe-server")
        .build()
        .map_err(|source| ServerError::Io {
            what: "starting the async runtime".into(),
            source,
        })?;
    let r = rt.block_on(serve(config, load));
    rt.shutdown_timeout(Duration::from_secs(2));
    r
}

/// Starts the engine thread and logs what serves.
fn ready(shared: &Shared, loaded: Loaded) -> Result<Ready> {
    let Loaded {
        engine,
        tokenizer,
        tokenizer_config,
    } = loaded;
    let source = shared
        .config
        .chat_template
        .clone()
        .or_else(|| tokenizer_config.chat_template.clone());
    let chat_template = source
        .map(|s| ChatTemplate::new(s, &tokenizer_config))
        .transpose()?;
    let info = engine.info().clone();
    let cfg = *engine.config();
    let (method, kernel) = match info.moe {
        Some((m, k)) => (m.to_string(), k.to_string()),
        None => ("none".into(), "none".into()),
    };
    tracing::info!(
        "model {} ({} layers, vocab {}, context {}) on {} in {}",
        info.architecture,
        info.kv_layout.num_layers,
        info.vocab_size,
        info.max_position_embeddings,
        info.device,
        info.dtype
    );
    tracing::info!(
        "KV cache: {} blocks of {} tokens ({} tokens)",
        cfg.num_blocks,
        cfg.block_size,
        cfg.num_blocks * cfg.block_size
    );
    tracing::info!("MoE method {method}: {kernel} kernel");
    if chat_template.is_none() {
        tracing::info!("no chat template: /v1/chat/completions answers 400");
    }
    metrics::set_info(&shared.config.served_model_name, &method, &kernel);
    let (handle, _thread) = EngineHandle::spawn(engine);
    Ok(Ready {
        handle,
        tokenizer: tokenizer.map(Arc::new),
        info,
        tokenizer_config,
        chat_template,
        num_blocks: cfg.num_blocks,
        block_size: cfg.block_size,
    })
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions::handler))
        .route("/v1/chat/completions", post(chat_api::handler))
        .route("/v1/models", get(misc::models))
        .route("/health", get(misc::health))
        .route("/version", get(misc::version))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route("/tokenizer_info", get(misc::tokenizer_info))
        .route("/metrics", get(misc::metrics))
        .fallback(misc::not_found)
        .method_not_allowed_fallback(misc::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            http::require_key,
        ))
        .with_state(shared)
}

/// SIGINT or SIGTERM.
async fn stop_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot watch SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}
