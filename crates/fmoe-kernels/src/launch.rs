//! Small helpers shared by the CUDA twins: argument conversion with errors instead of truncation,
//! grid sizes for grid-stride kernels, access to a tensor's device storage, and the shared-memory
//! opt-in of the big-tile kernels.

use fmoe_core::cuda::cudarc::driver::CudaFunction;
use fmoe_core::cuda::cudarc::driver::sys::CUfunction_attribute;
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{Device, Storage, Tensor};

use crate::{Error, Result};

/// Dynamic shared memory a block may use without opting in (`cuFuncSetAttribute`).
const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;

/// Lets `f` launch with `bytes` of dynamic shared memory (a no-op up to the default 48 KiB);
/// `what` names the kernel in the error.
pub(crate) fn opt_in_smem(f: &CudaFunction, bytes: u32, what: &'static str) -> Result<()> {
    if bytes > DEFAULT_SMEM_LIMIT {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| cuda_error(what, e))?;
    }
    Ok(())
}

/// Threads per block of the grid-stride elementwise kernels.
pub(crate) const ELEMENTWISE_THREADS: u32 = 256;

/// Most blocks a grid-stride kernel is launched with: a few waves on any current GPU (132 SMs on
/// an H200); more blocks only add scheduling work.
pub(crate) const MAX_GRID_STRIDE_BLOCKS: usize = 4096;

/// Blocks for a grid-stride loop over `n` items, `per_block` items per block per pass (at least 1
/// block, so a launch over nothing is still valid).
pub(crate) fn grid_stride_blocks(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block.max(1))
        .clamp(1, MAX_GRID_STRIDE_BLOCKS) as u32
}

/// `v` as a kernel's `unsigned int`, or an error naming what overflowed.
pub(crate) fn u32_arg(op: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        Error::invalid(
            op,
            format!("{what} = {v} exceeds the CUDA kernel's 32-bit range"),
        )
    })
}

/// The device storage of `t`, or a device-mismatch error naming `op` and `name`.
pub(crate) fn cuda_storage<'a>(
    op: &'static str,
    name: &str,
    t: &'a Tensor,
    device: Device,
) -> Result<&'a CudaStorage> {
    t.expect_device(op, name, device)?;
    match t.storage() {
        Storage::Cuda(s) => Ok(s),
        Storage::Cpu(_) => Err(fmoe_core::Error::DeviceMismatch {
            op,
            tensor: name.to_string(),
            expected: device,
            got: Device::Cpu,
        }
        .into()),
    }
}
