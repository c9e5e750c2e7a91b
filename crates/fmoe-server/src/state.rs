//! What every handler shares: the server's phase (starting, ready with the engine, stopping),
//! the queue of admitted requests that have not produced anything yet (bounded by
//! `--max-queued-requests`), and how a request goes to the engine and its outputs come back
//! ([`submit`], [`Running`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use metrics_exporter_prometheus::PrometheusHandle;

use fmoe_engine::{EngineHandle, Request, RequestOutput};
use fmoe_models::{ModelInfo, Tokenizer};

use crate::ServerConfig;
use crate::chat::{ChatTemplate, TokenizerConfig};
use crate::error::{ApiError, from_engine};
use crate::metrics::Tracker;

/// The loaded model and its engine.
pub struct Ready {
    pub handle: EngineHandle,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub info: ModelInfo,
    pub tokenizer_config: TokenizerConfig,
    pub chat_template: Option<ChatTemplate>,
    pub num_blocks: usize,
    pub block_size: usize,
}

impl Ready {
    pub fn max_model_len(&self) -> usize {
        self.info.max_position_embeddings
    }

    /// The tokenizer, or a 400 saying the model has none.
    pub fn tokenizer(&self, what: &str) -> Result<&Tokenizer, ApiError> {
        self.tokenizer.as_deref().ok_or_else(|| {
            ApiError::invalid(format!(
                "{what} needs a tokenizer; the model has no tokenizer.json"
            ))
        })
    }
}

pub enum Phase {
    Starting,
    Ready(Arc<Ready>),
    Stopping,
}

pub struct Shared {
    pub config: ServerConfig,
    pub phase: RwLock<Phase>,
    /// Admitted engine requests without output yet.
    pub queued: AtomicUsize,
    pub prometheus: PrometheusHandle,
}

pub type AppState = Arc<Shared>;

impl Shared {
    /// The engine, or a 503 while starting or stopping.
    pub fn ready(&self) -> Result<Arc<Ready>, ApiError> {
        match &*self.phase.read().unwrap_or_else(|p| p.into_inner()) {
            Phase::Ready(r) => Ok(r.clone()),
            Phase::Starting => Err(ApiError::unavailable(
                "the server is starting: the model is loading",
            )),
            Phase::Stopping => Err(ApiError::unavailable("the server is stopping")),
        }
    }

    pub fn set_phase(&self, phase: Phase) {
        *self.phase.write().unwrap_or_else(|p| p.into_inner()) = phase;
    }

    /// `k` queue places at once, or a 429 when the queue cannot take them.
    fn reserve(self: &Arc<Self>, k: usize) -> Result<Vec<Slot>, ApiError> {
        let max = self.config.max_queued_requests;
        let mut now = self.queued.load(Ordering::Acquire);
        loop {
            if now.saturating_add(k) > max {
                return Err(ApiError::new(
                    axum::http::StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "the server is busy: {now} requests are queued (--max-queued-requests {max}); retry later"
                    ),
                ));
            }
            match self.queued.compare_exchange_weak(
                now,
                now + k,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(v) => now = v,
            }
        }
        Ok((0..k)
            .map(|_| Slot {
                shared: self.clone(),
                held: true,
            })
            .collect())
    }
}

/// One queue place, given back at the request's first output or when it is dropped.
pub struct Slot {
    shared: AppState,
    held: bool,
}

impl Slot {
    pub fn release(&mut self) {
        if std::mem::take(&mut self.held) {
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.release();
    }
}

/// The outputs of a client request's engine requests (one per prompt), merged as they come.
/// Dropping it drops the receivers, which aborts what is still running at the engine's next
/// step.
pub struct Running {
    merged: SelectAll<BoxStream<'static, (usize, RequestOutput)>>,
    trackers: Vec<Tracker>,
}

impl Running {
    /// The next output and the index of the prompt it belongs to; `None` when every request has
    /// finished (or the engine stopped).
    pub async fn next(&mut self) -> Option<(usize, RequestOutput)> {
        let (p, out) = self.merged.next().await?;
        if let Some(t) = self.trackers.get_mut(p) {
            t.observe(&out);
        }
        Some((p, out))
    }
}

/// Queues `reqs` (a 429 when the queue is full) and sends them to the engine.
pub async fn submit(
    shared: &AppState,
    ready: &Arc<Ready>,
    reqs: Vec<Request>,
) -> Result<Running, ApiError> {
    let slots = shared.reserve(reqs.len())?;
    let handle = ready.handle.clone();
    let ns: Vec<usize> = reqs.iter().map(|r| r.params.n).collect();
    // The engine answers an add between steps: wait for it off the async workers.
    let added = tokio::task::spawn_blocking(move || {
        let mut streams = Vec::with_capacity(reqs.len());
        for r in reqs {
            // On an error the streams already added are dropped, aborting them.
            streams.push(handle.add(r)?);
        }
        Ok::<_, fmoe_engine::Error>(streams)
    })
    .await
    .map_err(|e| ApiError::internal(format!("adding the request: {e}")))?
    .map_err(from_engine)?;
    let mut merged = SelectAll::new();
    for (p, s) in added.into_iter().enumerate() {
        let rx = s.outputs;
        let st = stream::unfold(rx, move |mut rx| async move {
            rx.recv().await.map(|o| ((p, o), rx))
        });
        merged.push(st.boxed());
    }
    let trackers = slots
        .into_iter()
        .zip(ns)
        .map(|(slot, n)| Tracker::new(slot, n))
        .collect();
    Ok(Running { merged, trackers })
}
