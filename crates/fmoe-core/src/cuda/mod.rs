//! The CUDA backend: one [`CudaBackend`] per device ordinal (context, stream, device facts) and
//! [`CudaStorage`], the device memory behind [`Storage::Cuda`](crate::Storage::Cuda).
//!
//! Nothing here needs a CUDA toolkit to build: cudarc loads `libcuda` and `libnvrtc` at run time
//! (its `dynamic-loading` feature), and the crate feature (`cuda-13000`, `cuda-12080`) only picks
//! which API version the bindings speak. A machine without the driver gets
//! [`Error::NoCuda`] from [`cuda_backend`]; nothing in this module lets cudarc panic on a missing
//! library (cudarc panics when it is asked to call into a library it could not load, so every
//! entry point checks presence first).
//!
//! # Streams and memory
//! Every backend owns one explicit (non-blocking) stream, and all fmoe work on the device (copies,
//! kernels, frees) is issued on it, in order. cudarc's per-buffer event tracking exists to order
//! several streams; with one stream it only adds two `cuEventCreate` per allocation and event
//! records per launch, so it is switched off. Whoever adds a second stream must order it against
//! this one explicitly (events), or turn tracking back on.
//!
//! Allocation is stream-ordered: cudarc allocates with `cuMemAllocAsync` and frees with
//! `cuMemFreeAsync` on the buffer's stream whenever the device supports memory pools (every
//! Hopper does). These draw from the device's current memory pool (the default pool unless some
//! other code in the process replaced it with `cuDeviceSetMemPool`), and [`cuda_backend`] sets
//! that pool's release threshold to `u64::MAX`: freed blocks stay in the pool instead of going back
//! to the driver at each synchronization, so after warm-up an allocation of a size seen before is
//! served from the pool, without a `cudaMalloc`-style driver allocation in the hot path. On a
//! device without pools cudarc falls back to synchronous `cuMemAlloc`/`cuMemFree`
//! ([`CudaBackend::has_stream_ordered_pool`] says which).
//!
//! # Graphs
//! [`capture_graph`] records the work a closure issues on the stream into a CUDA graph and
//! [`CapturedGraph::replay`] relaunches it with one call; its docs say what capture allows.

mod graph;
mod storage;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

pub use cudarc;
use cudarc::driver::{CudaContext, CudaStream, DriverError, result, sys};
pub use graph::{CapturedGraph, capture_graph};
pub use storage::CudaStorage;

use crate::{Device, Error, Result};

/// A CUDA device ready for work: its context, the one stream fmoe issues work on, and the facts
/// kernels are compiled for. Get it from [`cuda_backend`] (cached per ordinal).
pub struct CudaBackend {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    compute_capability: (u32, u32),
    name: String,
    stream_ordered_pool: bool,
    multiprocessors: u32,
    l2_bytes: usize,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .field("stream_ordered_pool", &self.stream_ordered_pool)
            .finish()
    }
}

impl CudaBackend {
    /// The device ordinal (`cuda:N`).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// (major, minor): (9, 0) on H100/H200.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// The device's marketing name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Streaming multiprocessors (132 on an H200): what launch heuristics (split-K) size waves by.
    pub fn multiprocessor_count(&self) -> u32 {
        self.multiprocessors
    }

    /// Bytes of L2 cache (50 MiB on an H200; 0 if the driver does not say): what launch rules
    /// that trade DRAM traffic for L2 hits compare buffers against.
    pub fn l2_cache_bytes(&self) -> usize {
        self.l2_bytes
    }

    /// Whether allocations are stream-ordered from a memory pool that keeps freed blocks (see the
    /// module docs); false only on devices without memory-pool support.
    pub fn has_stream_ordered_pool(&self) -> bool {
        self.stream_ordered_pool
    }

    /// Bytes an allocation can get now: the device's free memory (`cuMemGetInfo`) plus, with a
    /// stream-ordered pool, the blocks the pool holds freed (reserved − used), which it hands out
    /// again before asking the driver. What [`crate::memory::check_budget`] compares with.
    pub fn free_memory(&self) -> Result<usize> {
        let (free, _total) = self
            .context
            .mem_get_info()
            .map_err(|e| cuda_error("CudaBackend::free_memory", e))?;
        if !self.stream_ordered_pool {
            return Ok(free);
        }
        let attr = |a: sys::CUmemPool_attribute| -> std::result::Result<u64, DriverError> {
            let mut v: u64 = 0;
            // SAFETY: the device handle comes from this live context; the reserved/used
            // attributes are `cuuint64_t`, which `v` is, and it outlives the call.
            unsafe {
                let pool = result::device::get_mem_pool(self.context.cu_device())?;
                result::mem_pool::get_attribute(pool, a, (&mut v as *mut u64).cast())?;
            }
            Ok(v)
        };
        let pooled = attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
            .and_then(|r| {
                attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
                    .map(|u| r.saturating_sub(u))
            })
            .map_err(|e| cuda_error("CudaBackend::free_memory", e))?;
        Ok(free.saturating_add(usize::try_from(pooled).unwrap_or(usize::MAX)))
    }

    /// The cudarc context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The one stream all of fmoe's device work is issued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// (free, total) bytes of device memory, as the driver sees them now (memory the stream's
    /// pool keeps for reuse counts as used).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_error("CudaBackend::memory_info", e))?;
        result::mem_get_info().map_err(|e| cuda_error("CudaBackend::memory_info", e))
    }

    /// Waits for the stream, then returns the memory its pool keeps for reuse (freed blocks) to
    /// the driver, so that [`Self::memory_info`] counts only live allocations.
    pub fn trim_pool(&self) -> Result<()> {
        self.synchronize()?;
        if !self.stream_ordered_pool {
            return Ok(());
        }
        let op = "CudaBackend::trim_pool";
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_error(op, e))?;
        // SAFETY: the pool is the device's current memory pool, from the driver for a live
        // context; trimming releases only memory no allocation holds.
        unsafe {
            let pool = result::device::get_mem_pool(self.context.cu_device())
                .map_err(|e| cuda_error(op, e))?;
            result::mem_pool::trim_to(pool, 0).map_err(|e| cuda_error(op, e))
        }
    }

    /// Waits for all work issued so far on [`Self::stream`]; reports errors of earlier
    /// asynchronous work (e.g. a faulting kernel).
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_error("CudaBackend::synchronize", e))
    }

    fn open(ordinal: usize) -> Result<CudaBackend> {
        ensure_driver_library()?;
        // cudarc panics if the driver lacks a symbol it resolves lazily (a driver older than the
        // bindings); the library is present at this point, so that is the only panic left, and it
        // becomes an error too.
        std::panic::catch_unwind(|| CudaBackend::open_checked(ordinal)).unwrap_or_else(|panic| {
            Err(Error::no_cuda(format!(
                "the CUDA driver library is unusable: {}",
                panic_message(panic.as_ref())
            )))
        })
    }

    fn open_checked(ordinal: usize) -> Result<CudaBackend> {
        let count = CudaContext::device_count().map_err(|e| {
            Error::no_cuda(format!(
                "CUDA driver initialization failed: {}",
                driver_message(e)
            ))
        })?;
        let count = usize::try_from(count).unwrap_or(0);
        if count == 0 {
            return Err(Error::no_cuda("the CUDA driver reports no devices"));
        }
        if ordinal >= count {
            return Err(Error::no_cuda(format!(
                "cuda:{ordinal} requested, but the CUDA driver reports {count} device(s) (cuda:0..cuda:{})",
                count - 1
            )));
        }
        let unusable = |what: &str, e: DriverError| {
            Error::no_cuda(format!(
                "cuda:{ordinal}: {what} failed: {}",
                driver_message(e)
            ))
        };
        let context = CudaContext::new(ordinal).map_err(|e| unusable("creating the context", e))?;
        let (major, minor) = context
            .compute_capability()
            .map_err(|e| unusable("querying the compute capability", e))?;
        let name = context
            .name()
            .map_err(|e| unusable("querying the name", e))?;
        // One stream, ordered by issue order: see the module docs. Must precede `new_stream`, which
        // would otherwise synchronize the whole context to enter cudarc's multi-stream mode.
        // SAFETY: no buffer of this context exists yet, and all buffers fmoe creates live on
        // `stream`, so there is no cross-stream use to track.
        unsafe { context.disable_event_tracking() };
        let stream = context
            .new_stream()
            .map_err(|e| unusable("creating the stream", e))?;
        let multiprocessors = context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| unusable("querying the multiprocessor count", e))?;
        let l2_bytes = context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_err(|e| unusable("querying the L2 cache size", e))?;
        let stream_ordered_pool = context.has_async_alloc();
        if stream_ordered_pool {
            keep_freed_memory_in_pool(&context)
                .map_err(|e| unusable("configuring the memory pool", e))?;
        }
        let backend = CudaBackend {
            context,
            stream,
            ordinal,
            compute_capability: (
                u32::try_from(major).unwrap_or(0),
                u32::try_from(minor).unwrap_or(0),
            ),
            name,
            stream_ordered_pool,
            multiprocessors: u32::try_from(multiprocessors).unwrap_or(1).max(1),
            l2_bytes: usize::try_from(l2_bytes).unwrap_or(0),
        };
        tracing::debug!(
            "CUDA backend cuda:{ordinal}: {} (sm_{major}{minor}), stream-ordered pool: {stream_ordered_pool}",
            backend.name
        );
        Ok(backend)
    }
}

/// The allocator policy: the pool that `cuMemAllocAsync` draws from keeps every freed block
/// (release threshold = `u64::MAX`), so steady-state allocations are pool hits, not driver calls.
fn keep_freed_memory_in_pool(context: &CudaContext) -> std::result::Result<(), DriverError> {
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the device handle comes from a live context; the release-threshold attribute is a
    // `cuuint64_t`, which `threshold` is, and it outlives the call.
    unsafe {
        let pool = result::device::get_mem_pool(context.cu_device())?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
}

/// The backend of device `cuda:ordinal`, created on first use and shared afterwards.
///
/// Errors with [`Error::NoCuda`] (one line: "no CUDA device/driver found: ...") when the driver
/// library cannot be loaded, reports no devices or fewer than `ordinal + 1`, or the device cannot
/// be initialized. Failures are not cached: a later call tries again.
pub fn cuda_backend(ordinal: usize) -> Result<Arc<CudaBackend>> {
    static BACKENDS: OnceLock<Mutex<HashMap<usize, Arc<CudaBackend>>>> = OnceLock::new();
    let mut backends = BACKENDS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(backend) = backends.get(&ordinal) {
        return Ok(backend.clone());
    }
    let backend = Arc::new(CudaBackend::open(ordinal)?);
    backends.insert(ordinal, backend.clone());
    Ok(backend)
}

/// Checks that `libcuda` can be loaded before any cudarc driver call (which would panic if not).
fn ensure_driver_library() -> Result<()> {
    // SAFETY: only tries to dlopen the candidate names; no symbol is called.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::no_cuda(
            "the NVIDIA driver library (libcuda.so) could not be loaded; is the NVIDIA driver installed?",
        ))
    }
}

/// The CUDA toolkit root: `$CUDA_HOME`, else `$CUDA_PATH`, else `/usr/local/cuda`. NVRTC's
/// `-I{root}/include` and the library fallback of [`nvrtc_version`] use it.
pub fn cuda_home() -> PathBuf {
    ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .find(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/usr/local/cuda"), PathBuf::from)
}

/// Loads NVRTC (once per process) and returns its version (major, minor).
///
/// Looks under the loader's usual search path first (the names cudarc knows), then in
/// `{cuda_home()}/lib64`, `lib` and `targets/x86_64-linux/lib`: a library found there is opened by
/// full path and kept loaded, so cudarc's later open by soname finds it. Errors are
/// [`Error::Nvrtc`] with family `*` (callers put their family in).
pub fn nvrtc_version() -> Result<(u32, u32)> {
    static VERSION: OnceLock<std::result::Result<(u32, u32), String>> = OnceLock::new();
    VERSION
        .get_or_init(load_nvrtc)
        .clone()
        .map_err(|msg| Error::Nvrtc { family: "*", msg })
}

fn load_nvrtc() -> std::result::Result<(u32, u32), String> {
    use cudarc::nvrtc::sys as nvrtc;
    static PRELOADED: OnceLock<libloading::Library> = OnceLock::new();
    // SAFETY: only dlopens candidate names.
    if !unsafe { nvrtc::is_culib_present() } {
        let home = cuda_home();
        let dirs = ["lib64", "lib", "targets/x86_64-linux/lib"].map(|d| home.join(d));
        let names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];
        let found = dirs
            .iter()
            .flat_map(|d| names.map(|n| d.join(n)))
            .find_map(|path| {
                // SAFETY: loading NVRTC runs only its (side-effect free) initializers.
                unsafe { libloading::Library::new(&path) }.ok()
            });
        match found {
            Some(lib) => {
                let _ = PRELOADED.set(lib);
            }
            None => {
                return Err(format!(
                    "the NVRTC library (libnvrtc.so) could not be loaded from the loader path nor from {}/{{lib64,lib}}; \
                     install the CUDA toolkit's NVRTC or set CUDA_HOME / LD_LIBRARY_PATH",
                    home.display()
                ));
            }
        }
        // SAFETY: as above.
        if !unsafe { nvrtc::is_culib_present() } {
            return Err(
                "libnvrtc was found under CUDA_HOME but cudarc cannot open it by name (unexpected soname)".into(),
            );
        }
    }
    let (mut major, mut minor) = (0i32, 0i32);
    let version = std::panic::catch_unwind(move || {
        // SAFETY: the library is present; both pointers are valid for writes.
        let r = unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
        (r, major, minor)
    });
    match version {
        Ok((nvrtc::nvrtcResult::NVRTC_SUCCESS, major, minor)) => Ok((
            u32::try_from(major).unwrap_or(0),
            u32::try_from(minor).unwrap_or(0),
        )),
        Ok((r, _, _)) => Err(format!("nvrtcVersion failed: {r:?}")),
        Err(panic) => Err(format!(
            "the NVRTC library is unusable: {}",
            panic_message(panic.as_ref())
        )),
    }
}

/// The GPU tests' entry point: device 0 with poisoned allocations (see
/// [`set_poison_allocations`]; `FMOE_TEST_POISON=0` leaves fresh memory unfilled for
/// compute-sanitizer's initcheck, to which a fill is an initialization), or `None` after printing
/// why the test skips. Under `FMOE_REQUIRE_CUDA=1` a missing GPU fails the test instead.
pub fn test_backend_or_skip() -> Option<Arc<CudaBackend>> {
    match cuda_backend(0) {
        Ok(b) => {
            set_poison_allocations(std::env::var("FMOE_TEST_POISON").as_deref() != Ok("0"));
            Some(b)
        }
        Err(e) => {
            assert!(
                std::env::var("FMOE_REQUIRE_CUDA").as_deref() != Ok("1"),
                "FMOE_REQUIRE_CUDA=1 but {e}"
            );
            println!("skipping: {e}");
            None
        }
    }
}

static POISON_ALLOCATIONS: AtomicBool = AtomicBool::new(false);

/// Debugging aid: while on, every buffer from [`CudaStorage::alloc`] is filled with `0xFF` bytes
/// (NaN as f32/bf16/f16, `u32::MAX` as an index) before it is handed out, so a test can tell an
/// output element a kernel never wrote. Process-wide; costs one memset per allocation.
pub fn set_poison_allocations(on: bool) {
    POISON_ALLOCATIONS.store(on, Ordering::Relaxed);
}

pub(crate) fn poison_allocations() -> bool {
    POISON_ALLOCATIONS.load(Ordering::Relaxed)
}

/// `CUDA_ERROR_NAME (description)` for a driver error. Only called once the library is loaded.
pub(crate) fn driver_message(e: DriverError) -> String {
    let name = e.error_name().map_or_else(
        |_| format!("{:?}", e.0),
        |s| s.to_string_lossy().into_owned(),
    );
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// [`Error::Cuda`] for a failed driver call of `op`.
pub fn cuda_error(op: &'static str, e: DriverError) -> Error {
    Error::Cuda {
        op,
        msg: driver_message(e),
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_is_ok_or_a_one_line_no_cuda_error() {
        match cuda_backend(0) {
            Ok(b) => assert_eq!(b.device(), Device::Cuda(0)),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.starts_with("no CUDA device/driver found: "), "{msg}");
                assert_eq!(msg.lines().count(), 1, "{msg}");
            }
        }
    }

    #[test]
    fn absurd_ordinal_is_an_error_not_a_panic() {
        let err = cuda_backend(1 << 20).unwrap_err().to_string();
        assert!(err.starts_with("no CUDA device/driver found: "), "{err}");
    }

    #[test]
    fn no_cuda_reason_is_flattened_to_one_line() {
        let e = Error::no_cuda("a\nb\r\n  c");
        assert_eq!(e.to_string(), "no CUDA device/driver found: a b c");
    }
}
