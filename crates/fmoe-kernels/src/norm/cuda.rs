//! CUDA twin of `norm` (placeholder until the kernels land).

use fmoe_core::cuda::CudaStorage;

use crate::Result;
use crate::error::no_cuda_kernel;

pub(super) fn rms_norm(
    op: &'static str,
    x: &CudaStorage,
    _w: &CudaStorage,
    _m: usize,
    _h: usize,
    _eps: f32,
) -> Result<CudaStorage> {
    Err(no_cuda_kernel(op, x))
}

pub(super) fn add_rms_norm(
    op: &'static str,
    _r: &CudaStorage,
    x: &CudaStorage,
    _w: &CudaStorage,
    _m: usize,
    _h: usize,
    _eps: f32,
) -> Result<(CudaStorage, CudaStorage)> {
    Err(no_cuda_kernel(op, x))
}
