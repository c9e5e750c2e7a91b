//! CUDA twin of [`super::causal_attention`] (kernels land in the next commit).

use fmoe_core::cuda::CudaStorage;

use super::{AttentionParams, SeqSpan};
use crate::Result;
use crate::catalog::KernelVariant;

pub(crate) fn variants() -> Vec<KernelVariant> {
    Vec::new()
}

pub(super) fn causal_attention(
    op: &'static str,
    q: &CudaStorage,
    _k: &CudaStorage,
    _v: &CudaStorage,
    _rows: usize,
    _spans: &[SeqSpan],
    _p: &AttentionParams,
) -> Result<CudaStorage> {
    Err(crate::error::no_cuda_kernel(op, q))
}
