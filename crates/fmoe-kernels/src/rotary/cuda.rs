//! CUDA twin of `rotary` (placeholder until the kernel lands).

use fmoe_core::Tensor;
use fmoe_core::cuda::CudaStorage;

use super::Geometry;
use crate::Result;
use crate::error::no_cuda_kernel;

pub(super) fn apply(
    op: &'static str,
    x: &CudaStorage,
    _cos: &Tensor,
    _sin: &Tensor,
    _g: &Geometry,
) -> Result<CudaStorage> {
    Err(no_cuda_kernel(op, x))
}
