use fmoe_core::Shape;

/// Errors of the kernel library. Each names the kernel (`op`) and what was wrong with its input.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Core(#[from] fmoe_core::Error),

    #[error("{op}: top-k {k} is not in 1..={experts} (the number of experts)")]
    TopK {
        op: &'static str,
        k: usize,
        experts: usize,
    },

    #[error("{op}: scale tensor `{tensor}` has shape {got}, expected {expected}")]
    ScaleShape {
        op: &'static str,
        tensor: String,
        expected: String,
        got: Shape,
    },

    #[error("{op}: expert id {id} at route {route} is out of range for {experts} experts")]
    ExpertId {
        op: &'static str,
        id: u32,
        route: usize,
        experts: usize,
    },

    /// libcublas could not be loaded (or is unusable); one line.
    #[error("{op}: cuBLAS unavailable: {reason}")]
    NoCublas { op: &'static str, reason: String },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Core(fmoe_core::Error::invalid(op, msg))
    }

    /// [`Error::NoCublas`] with `reason` flattened to one line.
    pub fn no_cublas(op: &'static str, reason: impl Into<String>) -> Self {
        let reason: String = reason.into();
        Error::NoCublas {
            op,
            reason: reason.split_whitespace().collect::<Vec<_>>().join(" "),
        }
    }
}

/// The error of a family whose CUDA twin does not exist yet.
pub(crate) fn no_cuda_kernel(op: &'static str, storage: &fmoe_core::cuda::CudaStorage) -> Error {
    Error::Core(fmoe_core::Error::Unsupported {
        op,
        device: storage.device(),
        reason: "no CUDA kernel yet".into(),
    })
}
