pub mod bench;
mod bench_cuda;
mod bench_engine;
mod bench_model;
mod bench_serve;
pub mod engine_flags;
pub mod generate;
pub mod kernels;
pub mod serve;

use anyhow::Result;
use fmoe_core::Device;

/// A failed write to stdout, as an error (`print!` would panic): a closed pipe, which `main`
/// turns into a quiet exit 0, or e.g. a full disk, reported as one line.
pub fn stdout_error(e: std::io::Error) -> anyhow::Error {
    anyhow::Error::new(e).context("writing to stdout")
}

/// Whether `e` is (caused by) a write to a closed pipe.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

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
