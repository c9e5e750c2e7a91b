//! fmoe-core: the types every other fmoe crate speaks.
//!
//! - [`DType`] names element types (f32, bf16, f16 and OCP fp8 e4m3fn); [`WithDType`] ties each to
//!   its Rust type so kernels can be generic over weights.
//! - [`Tensor`] is a shaped, typed buffer on a [`Device`]. Its [`Storage`] is an enum with one
//!   variant per backend, so a new backend (CUDA) adds a variant and kernel arms, while layer and
//!   model code keep calling the same kernel-library functions.
//! - [`Error`] is the crate's error: every variant names the operation and the tensor at fault.
//! - [`cuda`] is the CUDA backend: [`cuda::cuda_backend`] opens a device (context, one stream, a
//!   memory pool that keeps freed blocks) and [`cuda::CudaStorage`] is the memory behind
//!   [`Storage::Cuda`]. The driver and NVRTC are loaded at run time, so building needs no CUDA
//!   toolkit and a machine without a GPU gets an [`Error::NoCuda`], never a panic.
//! - [`size`] is checked size arithmetic for sizes from outside (configs, headers, flags):
//!   overflow is an [`Error::SizeOverflow`] naming the operands.
//! - [`memory`] is the memory budget: [`memory::check_budget`] refuses a request larger than what
//!   the host or a device has free, naming the request, its size and the limit.
//! - [`env`](mod@env) parses the `FMOE_*` switches, each variable on its own (no cascade here: the MoE layer
//!   decides what a combination means).
//!
//! ```
//! use fmoe_core::{Device, DType, Tensor};
//! let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], &Device::Cpu).unwrap();
//! assert_eq!(t.dims(), &[2, 2]);
//! assert_eq!(t.to_dtype(DType::BF16).unwrap().dtype(), DType::BF16);
//! ```

pub mod cuda;
mod device;
mod dtype;
pub mod env;
mod error;
pub mod memory;
mod shape;
pub mod size;
mod tensor;

pub use device::Device;
pub use dtype::{DType, F8E4M3, FP8_E4M3_MAX, FP8_E4M3_TO_F32, WithDType, bf16, f16};
pub use error::{Error, Result};
pub use shape::Shape;
pub use size::{checked_bytes, checked_product, checked_sum};
pub use tensor::{CpuStorage, Storage, Tensor};

/// Re-exported for fmoe-kernels' NVRTC logging (its manifest does not name `tracing` yet).
#[doc(hidden)]
pub use tracing;
