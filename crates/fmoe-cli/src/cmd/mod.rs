pub mod bench;
pub mod kernels;

use anyhow::{Result, bail};
use fmoe_core::Device;

/// Resolves `--device`: the CPU always works; CUDA needs a backend this build does not have yet.
pub fn require_device(device: Device) -> Result<Device> {
    match device {
        Device::Cpu => Ok(device),
        Device::Cuda(_) => bail!(
            "no CUDA device/driver found: this build of fmoe has no CUDA backend; use --device cpu"
        ),
    }
}
