//! The engine on its own thread: [`EngineHandle::spawn`] moves an [`Engine`] there; requests go
//! in through a channel and each request's outputs come back on its own channel as they are
//! produced, so an async server streams tokens while the engine steps. Dropping a request's
//! receiver aborts it at the next step; dropping every handle stops the thread after the
//! requests in flight are aborted.

use std::collections::HashMap;
use std::sync::mpsc;
use std::thread::JoinHandle;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::Result;
use crate::engine::{Engine, EngineStats};
use crate::request::{Request, RequestId, RequestOutput};

enum Command {
    Add(
        Request,
        UnboundedSender<RequestOutput>,
        mpsc::Sender<Result<RequestId>>,
    ),
    Abort(RequestId),
    Stats(mpsc::Sender<(EngineStats, f64)>),
}

/// A request's outputs as they come (see the module docs).
pub struct RequestStream {
    pub id: RequestId,
    pub outputs: UnboundedReceiver<RequestOutput>,
}

/// Talks to the engine thread (cheap to clone).
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
}

impl EngineHandle {
    /// Starts the engine's thread.
    pub fn spawn(engine: Engine) -> (EngineHandle, JoinHandle<()>) {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("fmoe-engine".into())
            .spawn(move || run(engine, rx))
            .expect("spawning the engine thread");
        (EngineHandle { tx }, thread)
    }

    /// Queues `req`; its outputs arrive on the stream. An invalid request is the engine's error.
    pub fn add(&self, req: Request) -> Result<RequestStream> {
        let (out_tx, out_rx) = unbounded_channel();
        let (done_tx, done_rx) = mpsc::channel();
        self.tx
            .send(Command::Add(req, out_tx, done_tx))
            .map_err(|_| stopped())?;
        let id = done_rx.recv().map_err(|_| stopped())??;
        Ok(RequestStream {
            id,
            outputs: out_rx,
        })
    }

    /// Aborts request `id` (its blocks are free at the next step).
    pub fn abort(&self, id: RequestId) {
        let _ = self.tx.send(Command::Abort(id));
    }

    /// The engine's counters and KV usage (fraction of blocks in use).
    pub fn stats(&self) -> Result<(EngineStats, f64)> {
        let (tx, rx) = mpsc::channel();
        self.tx.send(Command::Stats(tx)).map_err(|_| stopped())?;
        rx.recv().map_err(|_| stopped())
    }
}

fn stopped() -> crate::Error {
    crate::Error::Request("the engine has stopped".into())
}

fn run(mut engine: Engine, rx: mpsc::Receiver<Command>) {
    // Each request's sender and how many of its samples are still going.
    let mut streams: Streams = HashMap::new();
    loop {
        // Block for a command when idle; otherwise take what is there and step.
        let first = if engine.has_unfinished() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => break,
            }
        };
        let mut next = first;
        while let Some(cmd) = next {
            match cmd {
                Command::Add(req, out, done) => {
                    let n = req.params.n;
                    let r = engine.add_request(req);
                    if let Ok(id) = &r {
                        streams.insert(*id, (out, n));
                    }
                    let _ = done.send(r);
                }
                Command::Abort(id) => {
                    engine.abort(id);
                }
                Command::Stats(tx) => {
                    let _ = tx.send((engine.stats(), engine.kv_usage()));
                }
            }
            next = rx.try_recv().ok();
        }
        // Clients gone: abort their requests.
        let gone: Vec<RequestId> = streams
            .iter()
            .filter(|(_, (s, _))| s.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            engine.abort(id);
            streams.remove(&id);
        }
        if !engine.has_unfinished() {
            // Deliver abort outputs, if any.
            if let Ok(outs) = engine.step() {
                deliver(&mut streams, outs);
            }
            continue;
        }
        match engine.step() {
            Ok(outs) => deliver(&mut streams, outs),
            Err(e) => {
                tracing::error!("engine step failed: {e}");
            }
        }
    }
    // Stopping: what is still in flight is aborted, and its clients get the abort outputs.
    let ids: Vec<RequestId> = streams.keys().copied().collect();
    for id in ids {
        engine.abort(id);
    }
    if let Ok(outs) = engine.step() {
        deliver(&mut streams, outs);
    }
}

type Streams = HashMap<RequestId, (UnboundedSender<RequestOutput>, usize)>;

fn deliver(streams: &mut Streams, outs: Vec<RequestOutput>) {
    for out in outs {
        let id = out.id;
        let finished = out.finish_reason.is_some();
        let Some((tx, left)) = streams.get_mut(&id) else {
            continue;
        };
        let _ = tx.send(out);
        if finished {
            *left = left.saturating_sub(1);
            if *left == 0 {
                // Dropping the sender ends the client's stream.
                streams.remove(&id);
            }
        }
    }
}
