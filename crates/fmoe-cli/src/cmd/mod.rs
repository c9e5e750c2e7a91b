pub mod bench;
mod bench_cuda;
mod bench_engine;
mod bench_model;
pub mod engine_flags;
pub mod generate;
pub mod kernels;

use anyhow::Result;
use fmoe_core::Device;

/// Resolves `--device`: the CPU always works; `cuda:N` opens that device's backend (driver,
/// context, stream), so a missing driver or device fails here with the one-line
/// "no CUDA device/driver found: ..." before any work starts.
pub fn require_device(device: Device) -> Result<Device> {
    match device {
        Device::Cpu => Ok(device),
        Device::Cuda(i) => {
            fmoe_core::cuda::cuda_backend(i)?;
            Ok(device)
        }
    }
}
