//! CUDA graphs: record the work a closure issues on a backend's stream once, replay it with one
//! launch. For small batches, where a layer is a handful of short kernels and the host's launch
//! overhead leaves the GPU idle between them. See [`capture_graph`].

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::{CudaBackend, cuda_error};
use crate::{Error, Result};

const OP: &str = "capture_graph";

/// An instantiated graph of the work a closure issued, and the closure's result (see
/// [`capture_graph`]). Not `Send`: graphs are not internally synchronized.
pub struct CapturedGraph<'a, T> {
    /// Declared before `graph` so that it is dropped first: its graph allocations are freed on
    /// the stream after the last replay, then the graph is destroyed.
    output: T,
    graph: CudaGraph,
    backend: Arc<CudaBackend>,
    /// The borrows of the captured closure: the graph reads them at every replay.
    _inputs: PhantomData<&'a ()>,
}

impl<T> std::fmt::Debug for CapturedGraph<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedGraph")
            .field("device", &self.backend.device())
            .finish_non_exhaustive()
    }
}

impl<T> CapturedGraph<'_, T> {
    /// Launches the graph on the backend's stream (asynchronous, like the eager work it replaces).
    pub fn replay(&self) -> Result<()> {
        self.graph
            .launch()
            .map_err(|e| cuda_error("CapturedGraph::replay", e))
    }

    /// What the captured closure returned; its device buffers hold the latest replay's results
    /// once the stream reaches them (a download waits for that). Clones share those buffers, so
    /// they change with each replay too.
    pub fn output(&self) -> &T {
        &self.output
    }
}

/// Captures the work `work` issues on `backend`'s stream into a graph, instantiates it and
/// launches it once, so that what `work` returned holds results. (Capture records work, it does
/// not run it: nothing `work` returns is computed before that first launch.)
///
/// Capture is thread-local: a prohibited call from this thread (a synchronization, a copy to
/// pageable host memory) fails that call and invalidates the capture.
///
/// Memory: allocations made during capture are stream-ordered (`cuMemAllocAsync`), so they
/// become graph allocation nodes. Those freed inside `work` are freed by the graph; those that
/// escape in its result (output tensors) keep a fixed address for the graph's lifetime, and the
/// graph is instantiated with auto-free-on-launch, so each replay frees and re-allocates them at
/// that address: the result always holds the latest replay's output. It is dropped (freed on the
/// stream, after the last replay) before the graph.
///
/// The graph reads `work`'s inputs by address at every replay: the [`CapturedGraph`] borrows
/// whatever `work` borrowed, so the inputs outlive it. `work` must issue all its device work on
/// the backend's stream and keep nothing it allocates beyond its result (a cache filled during
/// capture would point into graph memory): run it once eagerly before capturing it (kernel
/// compilation and loading, lazy caches).
///
/// Errors: the device has no stream-ordered memory pool (allocation inside capture needs one);
/// `work` fails (its error is returned as is: a call that breaks capture names itself and the
/// driver's `CUDA_ERROR_STREAM_CAPTURE_*`); or the capture was invalidated without `work` seeing
/// an error. After a failure the stream is out of capture mode and usable, and the errors that
/// the failed capture left in cudarc's deferred error slot (from frees during capture) are
/// discarded, so they do not surface at an unrelated later call.
pub fn capture_graph<'a, T, E>(
    backend: &Arc<CudaBackend>,
    work: impl FnOnce() -> std::result::Result<T, E> + 'a,
) -> std::result::Result<CapturedGraph<'a, T>, E>
where
    E: From<Error>,
{
    if !backend.has_stream_ordered_pool() {
        return Err(Error::Unsupported {
            op: OP,
            device: backend.device(),
            reason: "graph capture needs stream-ordered allocation (a memory pool), which this \
                     device lacks"
                .into(),
        }
        .into());
    }
    let stream = backend.stream();
    // Work issued before the capture must not be mistaken for errors of the captured work.
    backend.synchronize()?;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| cuda_error(OP, e))?;
    let output = work();
    let ended = stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    let (output, graph) = match (output, ended) {
        (Ok(output), Ok(Some(graph))) => (output, graph),
        (output, ended) => {
            let why = match &ended {
                Ok(None) => "the capture recorded no work".to_string(),
                Ok(Some(_)) => String::new(),
                Err(e) => super::driver_message(*e),
            };
            // The result's buffers were never allocated (the graph never ran): drop them, and the
            // graph, before clearing what their frees reported.
            drop(ended);
            let output = output.map(drop);
            let _ = backend.context().check_err();
            output?;
            return Err(Error::Cuda {
                op: OP,
                msg: format!("the work could not be captured: {why}"),
            }
            .into());
        }
    };
    let captured = CapturedGraph {
        output,
        graph,
        backend: backend.clone(),
        _inputs: PhantomData,
    };
    captured
        .graph
        .upload()
        .map_err(|e| cuda_error("capture_graph: upload", e))?;
    captured.replay()?;
    Ok(captured)
}
