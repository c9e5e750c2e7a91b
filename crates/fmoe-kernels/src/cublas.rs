//! cuBLAS, loaded at run time: [`load`] finds libcublas, [`with_handle`] hands out the one handle
//! of a backend (created on first use, bound to the backend's stream, so cuBLAS work is ordered
//! with every other kernel without synchronization; reductions kept in f32).
//!
//! Nothing loads libcublas until a cuBLAS-backed op ([`crate::linear`], the benchmark's GEMM
//! ceiling) runs on CUDA. A missing library is [`Error::NoCublas`] (one line naming where it
//! looked); a library that lacks a symbol cudarc resolves lazily (cudarc panics then) becomes an
//! error too.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use fmoe_core::cuda::cudarc::cublas::{result as cb, sys as cbs};
use fmoe_core::cuda::{CudaBackend, cuda_home};

use crate::{Error, Result};

/// Makes libcublas loadable by name (once per process): already on the loader path, or opened by
/// full path (its libcublasLt first, which it links against) from `$FMOE_CUBLAS_DIR`, then
/// `$CUDA_HOME/{lib64,lib,targets/x86_64-linux/lib}`.
pub fn load() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(find_and_load)
        .clone()
        .map_err(|reason| Error::no_cublas("cublas::load", reason))
}

fn find_and_load() -> std::result::Result<(), String> {
    static PRELOADED: OnceLock<Vec<libloading::Library>> = OnceLock::new();
    // SAFETY: only dlopens candidate names.
    if unsafe { cbs::is_culib_present() } {
        return Ok(());
    }
    let home = cuda_home();
    let mut dirs: Vec<PathBuf> = std::env::var_os("FMOE_CUBLAS_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .into_iter()
        .collect();
    dirs.extend(["lib64", "lib", "targets/x86_64-linux/lib"].map(|d| home.join(d)));
    for dir in &dirs {
        for ver in ["13", "12"] {
            let cublas = dir.join(format!("libcublas.so.{ver}"));
            if !cublas.exists() {
                continue;
            }
            let mut libs = Vec::new();
            // SAFETY: loading cuBLAS runs only its initializers.
            if let Ok(l) =
                unsafe { libloading::Library::new(dir.join(format!("libcublasLt.so.{ver}"))) }
            {
                libs.push(l);
            }
            // SAFETY: as above.
            if let Ok(l) = unsafe { libloading::Library::new(&cublas) } {
                libs.push(l);
                let _ = PRELOADED.set(libs);
                // SAFETY: only dlopens candidate names.
                if unsafe { cbs::is_culib_present() } {
                    return Ok(());
                }
            }
        }
    }
    Err(format!(
        "libcublas is not on the loader path nor in {} (set FMOE_CUBLAS_DIR or CUDA_HOME)",
        dirs.iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// A cuBLAS handle bound to one backend's stream. Calls through it are serialized by the
/// [`with_handle`] lock (a handle must not be used by two threads at once).
struct Handle(cbs::cublasHandle_t);

// SAFETY: the raw handle is only used under the per-backend mutex below, one thread at a time.
unsafe impl Send for Handle {}

type Handles = HashMap<usize, Arc<Mutex<Handle>>>;

/// Runs `f` with the cuBLAS handle of `backend` (created on first use, its stream set to the
/// backend's stream), the backend's context current on this thread. `f` issues work on that
/// stream; a panic inside it (cudarc's missing-symbol panic) becomes [`Error::NoCublas`].
pub fn with_handle<T>(
    op: &'static str,
    backend: &Arc<CudaBackend>,
    f: impl FnOnce(cbs::cublasHandle_t) -> Result<T>,
) -> Result<T> {
    static HANDLES: OnceLock<Mutex<Handles>> = OnceLock::new();
    load().map_err(|e| match e {
        Error::NoCublas { reason, .. } => Error::no_cublas(op, reason),
        e => e,
    })?;
    backend
        .context()
        .bind_to_thread()
        .map_err(|e| fmoe_core::cuda::cuda_error("cublas: binding the context", e))?;
    let handle = {
        let mut handles = HANDLES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match handles.get(&backend.ordinal()) {
            Some(h) => h.clone(),
            None => {
                let h = Arc::new(Mutex::new(create(op, backend)?));
                handles.insert(backend.ordinal(), h.clone());
                h
            }
        }
    };
    let guard = handle.lock().unwrap_or_else(PoisonError::into_inner);
    let raw = guard.0;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(raw))).unwrap_or_else(|_| {
        Err(Error::no_cublas(
            op,
            "libcublas is unusable (missing symbol?)",
        ))
    })
}

fn create(op: &'static str, backend: &CudaBackend) -> Result<Handle> {
    let made = std::panic::catch_unwind(|| -> std::result::Result<Handle, String> {
        let h = cb::create_handle().map_err(|e| format!("cublasCreate: {e}"))?;
        // SAFETY (both calls): a live handle, and the backend's live stream (cuBLAS takes the
        // driver's CUstream). Split-K partial sums stay f32 even for bf16/f16 outputs (the
        // library may otherwise reduce them in the output type), as `linear` promises f32
        // accumulation.
        let setup = unsafe {
            cb::set_stream(h, backend.stream().cu_stream() as cbs::cudaStream_t)
                .map_err(|e| format!("cublasSetStream: {e}"))
                .and_then(|()| {
                    cbs::cublasSetMathMode(
                        h,
                        cbs::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
                    )
                    .result()
                    .map_err(|e| format!("cublasSetMathMode: {e}"))
                })
        };
        if let Err(msg) = setup {
            // SAFETY: created just above, not used since.
            let _ = unsafe { cb::destroy_handle(h) };
            return Err(msg);
        }
        Ok(Handle(h))
    });
    match made {
        Ok(Ok(h)) => Ok(h),
        Ok(Err(msg)) => Err(Error::invalid(op, msg)),
        Err(_) => Err(Error::no_cublas(
            op,
            "libcublas is unusable (missing symbol?)",
        )),
    }
}

/// cuBLAS status as an error of `op`.
pub(crate) fn status(op: &'static str, what: &str, e: cb::CublasError) -> Error {
    Error::Core(fmoe_core::Error::Cuda {
        op,
        msg: format!("{what}: {e}"),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn load_is_ok_or_a_one_line_error() {
        match super::load() {
            Ok(()) => println!("libcublas loaded"),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("cuBLAS unavailable") && msg.contains("libcublas"),
                    "{msg}"
                );
                assert_eq!(msg.lines().count(), 1, "{msg}");
            }
        }
    }
}
