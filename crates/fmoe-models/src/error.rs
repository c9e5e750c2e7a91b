use std::path::PathBuf;

/// Errors of fmoe-models. Each names the file, field or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// (The I/O error is part of the message, not a `source`, so a chain prints it once.)
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },

    /// config.json (or another JSON file) does not parse or has an invalid field.
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },

    #[error(
        "{}: unknown architecture `{arch}` (supported: MixtralForCausalLM, DeepseekV3ForCausalLM)",
        path.display()
    )]
    UnknownArchitecture { path: PathBuf, arch: String },

    /// A safetensors file that cannot be read (truncated, bad header, bad index).
    #[error("{}: not a valid safetensors checkpoint: {msg}", path.display())]
    Safetensors { path: PathBuf, msg: String },

    #[error("tensor `{name}` not found in the checkpoint ({files})")]
    MissingTensor { name: String, files: String },

    #[error("tensor `{name}` in {file} has shape {got:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        file: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },

    #[error("tensor `{name}` in {file} has dtype {got}, expected {expected}")]
    TensorDType {
        name: String,
        file: String,
        expected: String,
        got: String,
    },

    #[error("{}: tokenizer: {msg}", path.display())]
    Tokenizer { path: PathBuf, msg: String },

    /// Load options that do not fit the checkpoint (e.g. an MoE method its experts cannot serve).
    #[error("load options: {0}")]
    Options(String),

    /// Bad input to a forward pass (token id out of range, cache out of step).
    #[error("{op}: {msg}")]
    Input { op: &'static str, msg: String },

    #[error(transparent)]
    Core(#[from] fmoe_core::Error),

    #[error(transparent)]
    Moe(#[from] fmoe_moe::Error),

    #[error(transparent)]
    Kernel(#[from] fmoe_kernels::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn config(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Config {
            path: path.into(),
            msg: msg.into(),
        }
    }

    pub fn input(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Input {
            op,
            msg: msg.into(),
        }
    }
}
