use crate::{DType, Device, Shape};

/// Errors of fmoe-core. Every variant names the operation and, where there is one, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op}: tensor `{tensor}` has shape {got}, expected {expected}")]
    ShapeMismatch {
        op: &'static str,
        tensor: String,
        expected: String,
        got: Shape,
    },

    #[error("{op}: tensor `{tensor}` has dtype {got}, expected {expected}")]
    DTypeMismatch {
        op: &'static str,
        tensor: String,
        expected: String,
        got: DType,
    },

    #[error("{op}: tensor `{tensor}` is on {got}, expected {expected}")]
    DeviceMismatch {
        op: &'static str,
        tensor: String,
        expected: Device,
        got: Device,
    },

    #[error("{op}: {len} elements cannot fill shape {shape}")]
    DataLength {
        op: &'static str,
        len: usize,
        shape: Shape,
    },

    #[error("{op}: tensor `{tensor}` holds a non-finite value ({value}) at flat index {index}")]
    NonFinite {
        op: &'static str,
        tensor: String,
        index: usize,
        value: f32,
    },

    #[error("{op}: {msg}")]
    InvalidArgument { op: &'static str, msg: String },

    /// A size computed from outside input (a config, a header, a flag) does not fit `usize`.
    #[error("{what}: {expr} overflows the {}-bit size range", usize::BITS)]
    SizeOverflow { what: String, expr: String },

    /// A request larger than what the device has free ([`crate::memory::check_budget`]).
    #[error(
        "{request}: needs {} ({bytes} bytes) on {device}, more than the {} available ({limit})",
        crate::memory::human_bytes(*bytes),
        crate::memory::human_bytes(*available)
    )]
    OutOfMemory {
        request: String,
        bytes: usize,
        available: usize,
        limit: &'static str,
        device: Device,
    },

    #[error(
        "environment variable {var} has invalid value {value:?}: expected 0, 1, true or false (case-insensitive)"
    )]
    InvalidEnv { var: &'static str, value: String },

    #[error(transparent)]
    DevOverride(#[from] crate::env::DevOverrideError),

    #[error("{op} is not available on {device}: {reason}")]
    Unsupported {
        op: &'static str,
        device: Device,
        reason: String,
    },

    /// The CUDA driver library, or a usable device, is missing. Always one line (the CLI prints
    /// it as is).
    #[error("no CUDA device/driver found: {reason}")]
    NoCuda { reason: String },

    /// A CUDA driver call failed (allocation, copy, launch, module load).
    #[error("{op}: CUDA driver error: {msg}")]
    Cuda { op: &'static str, msg: String },

    /// NVRTC is missing or failed to compile a kernel family; for a compile failure `msg` holds
    /// NVRTC's log.
    #[error("nvrtc: kernel family `{family}`: {msg}")]
    Nvrtc { family: &'static str, msg: String },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// [`Error::NoCuda`] with `reason` flattened to one line.
    pub fn no_cuda(reason: impl Into<String>) -> Self {
        let reason: String = reason.into();
        Error::NoCuda {
            reason: reason.split_whitespace().collect::<Vec<_>>().join(" "),
        }
    }

    pub fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            msg: msg.into(),
        }
    }
}
