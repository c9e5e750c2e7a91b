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

    #[error(
        "environment variable {var} has invalid value {value:?}: expected 0, 1, true or false (case-insensitive)"
    )]
    InvalidEnv { var: &'static str, value: String },

    #[error("{op} is not available on {device}: {reason}")]
    Unsupported {
        op: &'static str,
        device: Device,
        reason: String,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            msg: msg.into(),
        }
    }
}
