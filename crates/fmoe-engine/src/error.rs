/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] fmoe_models::Error),

    #[error(transparent)]
    Core(#[from] fmoe_core::Error),

    /// A request the engine cannot serve (bad sampling parameters, empty prompt, ...).
    #[error("request: {0}")]
    Request(String),

    /// An engine part set up with values it cannot work with (a KV pool of 0 blocks, ...).
    #[error("{op}: {msg}")]
    Config { op: &'static str, msg: String },
}

pub type Result<T> = std::result::Result<T, Error>;
