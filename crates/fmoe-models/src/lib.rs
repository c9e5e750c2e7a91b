//! fmoe-models: model definitions and everything needed to load them.
//!
//! - [`config`]: `config.json` as serde structs with Hugging Face's field names
//!   ([`MixtralConfig`], [`DeepseekV3Config`]), accepting the transformers 4.x and 5.x layouts,
//!   with `quantization_config` typed as [`QuantizationConfig`].
//! - [`loader`]: safetensors checkpoints ([`Checkpoint`]: one file or shards, read with `pread`),
//!   random [`DummyWeights`], and [`Vb`], the cursor model files load through by checkpoint name.
//! - [`tokenizer`]: `tokenizer.json` ([`Tokenizer`]).
//! - [`layers`]: what models share: linear/embedding, RMSNorm, rotary, attention, MoE blocks.
//! - [`mixtral`]: [`MixtralForCausalLM`], in candle's shape: private blocks, a public model,
//!   loading by checkpoint names.
//! - [`deepseek_v3`]: [`DeepseekV3ForCausalLM`] in the same shape (MLA, dense-first layers,
//!   grouped sigmoid routing with a shared expert).
//! - [`model`]: the interface to the engine: [`CausalLm`] (one forward over a step's
//!   [`ForwardInput`] and the engine's paged [`KvPool`], logits out on the device).
//! - [`device`]: each model's one forward, every layer on the model's device through
//!   fmoe-kernels' tensor functions (their CPU twins on the CPU).
//!
//! [`load`] ties them together: `config.json` → architecture → weights → model (+ tokenizer).
//! [`LoadOptions::device`] places the whole model (the MoE experts included): on the CPU every
//! layer computes in f32 from the stored weights (the golden reference), on CUDA in the
//! checkpoint's bf16. fp8 checkpoints' dense linears (attention, dense MLPs) are dequantized to
//! the activation dtype at load; only the MoE experts stay fp8, served by the fp8 MoE methods.
//!
//! ```no_run
//! use fmoe_models::{LoadOptions, load};
//! let loaded = load(std::path::Path::new("tests/fixtures/tiny-mixtral"), &LoadOptions::default())?;
//! println!("{} with {} layers", loaded.model.info().architecture, loaded.model.info().kv_layout.num_layers);
//! # Ok::<(), fmoe_models::Error>(())
//! ```

pub mod config;
pub mod deepseek_v3;
pub mod device;
mod error;
pub mod input;
pub mod kv_pool;
pub mod layers;
pub mod loader;
pub mod mixtral;
pub mod model;
pub mod tokenizer;

use std::path::Path;

use fmoe_core::{DType, Device};

pub use config::{DeepseekV3Config, MixtralConfig, ModelConfig, QuantizationConfig};
pub use deepseek_v3::DeepseekV3ForCausalLM;
pub use error::{Error, Result};
pub use input::{AttentionLayout, ForwardInput, SeqStep, StepLogits};
pub use kv_pool::KvPool;
pub use layers::moe::MoeOptions;
pub use loader::{Checkpoint, DummyWeights, Vb, WeightSource};
pub use mixtral::MixtralForCausalLM;
pub use model::{CausalLm, ForwardOutput, KvLayout, ModelInfo};
pub use tokenizer::Tokenizer;

/// Where weights come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LoadFormat {
    /// The directory's safetensors checkpoint.
    #[default]
    Auto,
    /// Random weights of the right shapes and dtypes from `seed` (only `config.json` is read).
    Dummy { seed: u64 },
}

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    pub format: LoadFormat,
    pub moe: MoeOptions,
    /// Show a progress bar over tensors (drawn only when stderr is a terminal).
    pub progress: bool,
    /// Load only the first N decoder layers (overrides `num_hidden_layers`; e.g. full-width
    /// dummy models for benchmarks).
    pub num_layers: Option<usize>,
    /// The device the whole model runs on (the MoE experts included).
    pub device: Device,
    /// Activations' (and the KV pool's) dtype: default f32 on the CPU (the golden reference),
    /// the checkpoint's bf16/f16 on a GPU. bf16 on the CPU runs the GPU's numerics on the
    /// kernels' CPU twins (tests).
    pub dtype: Option<DType>,
}

/// A model with its config and, when the directory has one, its tokenizer.
pub struct LoadedModel {
    pub config: ModelConfig,
    pub model: Box<dyn CausalLm>,
    pub tokenizer: Option<Tokenizer>,
}

/// Loads the model in `dir`: `config.json` picks the architecture, weights come from the
/// safetensors checkpoint (or a seed), `tokenizer.json` is loaded if present.
pub fn load(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let path = config::config_path(dir);
    let mut config = ModelConfig::from_file(&path)?;
    if let Some(n) = opts.num_layers {
        if n == 0 {
            return Err(Error::Options("num_layers must be positive".into()));
        }
        config = config.with_num_hidden_layers(n)?;
    }
    let tokenizer = Tokenizer::from_dir(dir)?;
    let device = opts.device;
    // The stored weights must fit where the model runs (f32 copies of dense weights on the CPU
    // come on top; the check is against the smaller, certain amount).
    let arch = match &config {
        ModelConfig::Mixtral(_) => "MixtralForCausalLM",
        ModelConfig::DeepseekV3(_) => "DeepseekV3ForCausalLM",
    };
    fmoe_core::memory::check_budget(
        &format!(
            "the weights of {arch} ({} layers)",
            config.num_hidden_layers()
        ),
        config.weight_bytes()?,
        device,
    )?;
    let model: Box<dyn CausalLm> = match &config {
        ModelConfig::Mixtral(cfg) => {
            let source = weight_source(dir, opts.format, cfg.dtype().ok().flatten(), device)?;
            let bar = loader::progress_bar(MixtralForCausalLM::num_tensors(cfg), opts.progress);
            let vb = Vb::new(&source, &bar);
            let model = MixtralForCausalLM::load_on(cfg, &vb, &opts.moe, device, opts.dtype)?;
            bar.finish_and_clear();
            Box::new(model)
        }
        ModelConfig::DeepseekV3(cfg) => {
            let source = weight_source(dir, opts.format, cfg.dtype().ok().flatten(), device)?;
            let bar = loader::progress_bar(DeepseekV3ForCausalLM::num_tensors(cfg), opts.progress);
            let vb = Vb::new(&source, &bar);
            let model = DeepseekV3ForCausalLM::load_on(cfg, &vb, &opts.moe, device, opts.dtype)?;
            bar.finish_and_clear();
            Box::new(model)
        }
    };
    let info = model.info();
    tracing::info!(device = %info.device, dtype = %info.dtype, "model runs on {} in {}", info.device, info.dtype);
    Ok(LoadedModel {
        config,
        model,
        tokenizer,
    })
}

/// The weights of `dir` as `format` says; dummy weights are generated where the model runs (a
/// full-size model never exists on the host).
fn weight_source(
    dir: &Path,
    format: LoadFormat,
    dtype: Option<DType>,
    device: Device,
) -> Result<WeightSource> {
    Ok(match format {
        LoadFormat::Auto => WeightSource::Checkpoint(Checkpoint::open(dir)?),
        LoadFormat::Dummy { seed } => WeightSource::Dummy(DummyWeights {
            seed,
            dtype: dtype.unwrap_or(DType::BF16),
            device,
        }),
    })
}
