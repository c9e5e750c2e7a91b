//! CUDA twin of `linear`: one `cublasGemmEx` on the backend's stream.
//!
//! Row-major y [M, N] = x [M, K] · w [N, K]ᵀ is, read column-major, yᵀ (N×M, ld N) = w' · x' with
//! w' = the column-major K×N view of w transposed (op T, lda K) and x' = the column-major K×M view
//! of x (op N, ldb K): no copies, no transposes in memory.

use std::ffi::c_void;

use fmoe_core::cuda::CudaStorage;
use fmoe_core::cuda::cudarc::cublas::{result as cb, sys as cbs};
use fmoe_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut};
use fmoe_core::{DType, Error as CoreError};

use crate::launch::u32_arg;
use crate::{Result, cublas};

fn data_type(d: DType) -> Option<cbs::cudaDataType> {
    match d {
        DType::BF16 => Some(cbs::cudaDataType::CUDA_R_16BF),
        DType::F16 => Some(cbs::cudaDataType::CUDA_R_16F),
        DType::F32 => Some(cbs::cudaDataType::CUDA_R_32F),
        _ => None,
    }
}

pub(super) fn linear(
    op: &'static str,
    x: &CudaStorage,
    w: &CudaStorage,
    [m, n, k]: [usize; 3],
    out: DType,
) -> Result<CudaStorage> {
    let unsupported = |d: DType| -> crate::Error {
        CoreError::Unsupported {
            op,
            device: x.device(),
            reason: format!("no cuBLAS GEMM for {d}"),
        }
        .into()
    };
    let in_t = data_type(x.dtype()).ok_or_else(|| unsupported(x.dtype()))?;
    let out_t = data_type(out).ok_or_else(|| unsupported(out))?;
    let backend = x.backend();
    if m == 0 || n == 0 {
        return Ok(CudaStorage::alloc(backend, out, m * n)?);
    }
    if k == 0 {
        return Ok(CudaStorage::zeros(backend, out, m * n)?);
    }
    // cuBLAS takes int dimensions; u32_arg then i32 keeps the message of an overflow readable.
    let dim = |what: &str, v: usize| -> Result<i32> {
        i32::try_from(u32_arg(op, what, v)?).map_err(|_| {
            crate::Error::invalid(op, format!("{what} = {v} exceeds cuBLAS's int range"))
        })
    };
    let (mi, ni, ki) = (dim("M", m)?, dim("N", n)?, dim("K", k)?);
    let mut y = CudaStorage::alloc(backend, out, m * n)?;
    let stream = backend.stream().clone();
    cublas::with_handle(op, backend, |handle| {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (pw, _rw) = w.buffer().device_ptr(&stream);
        let (px, _rx) = x.buffer().device_ptr(&stream);
        let (py, _ry) = y.buffer_mut()?.device_ptr_mut(&stream);
        // SAFETY: w holds n·k, x m·k and y m·n elements of the dtypes passed (checked by mod.rs and
        // allocated above), all live device buffers used on the handle's stream; alpha and beta are
        // host f32 (the default pointer mode, f32 for CUBLAS_COMPUTE_32F) outliving the call.
        unsafe {
            cb::gemm_ex(
                handle,
                cbs::cublasOperation_t::CUBLAS_OP_T,
                cbs::cublasOperation_t::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                (&alpha as *const f32).cast::<c_void>(),
                pw as *const c_void,
                in_t,
                ki,
                px as *const c_void,
                in_t,
                ki,
                (&beta as *const f32).cast::<c_void>(),
                py as *mut c_void,
                out_t,
                ni,
                cbs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cbs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| cublas::status(op, "cublasGemmEx", e))
    })?;
    Ok(y)
}
