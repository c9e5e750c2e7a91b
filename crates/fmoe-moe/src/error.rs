/// Errors of the MoE layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Core(#[from] fmoe_core::Error),

    #[error(transparent)]
    Kernel(#[from] fmoe_kernels::Error),

    #[error("MoE config: {0}")]
    Config(String),

    #[error("{method}: {msg}")]
    Weights { method: &'static str, msg: String },
}

pub type Result<T> = std::result::Result<T, Error>;
