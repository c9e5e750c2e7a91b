//! What a model offers the engine: [`CausalLm`], one forward per architecture over a step's
//! [`ForwardInput`] and the engine's [`KvPool`], on any device. The model appends what attention
//! needs to the pool (per layer, in "streams" of fixed width per token: Mixtral keeps K and V;
//! MLA keeps the compressed latent and the shared rope key, [`KvLayout`]) and returns the logits
//! rows the input asks for, on its device, with the NaN/Inf checks of the pass unread
//! ([`ForwardOutput`]): the engine reads both where it synchronizes anyway.

use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::attention::AttentionParams;
use fmoe_kernels::quant_fp8::FiniteCheck;

use crate::Result;
use crate::input::{AttentionLayout, ForwardInput};
use crate::kv_pool::KvPool;

/// What a model caches per token and layer: `streams[i]` values in stream `i`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub streams: Vec<usize>,
}

/// Facts about a loaded model the engine needs.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub architecture: &'static str,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub kv_layout: KvLayout,
    /// Where the model runs, and its activations' and KV pool's dtype (f32 on the CPU: the
    /// golden reference; the checkpoint's bf16/f16 on a GPU).
    pub device: Device,
    pub dtype: DType,
    /// How attention reads the pool, with which parameters.
    pub attention_layout: AttentionLayout,
    pub attention: AttentionParams,
    /// The MoE layers' method and kernel family (the same for every layer of a model).
    pub moe: Option<(fmoe_moe::QuantScheme, fmoe_moe::KernelFamily)>,
}

/// A forward pass's result: f32 logits `[input.num_logits(), vocab]` on the model's device and
/// the pass's deferred NaN/Inf checks.
pub struct ForwardOutput {
    pub logits: Tensor,
    pub checks: FiniteCheck,
}

impl ForwardOutput {
    /// Reads the checks (the first NaN/Inf any layer flagged is the error that layer would have
    /// returned) and brings the logits to the host: the pass's one synchronization.
    pub fn into_host(self) -> Result<Tensor> {
        self.checks
            .check()
            .map_err(|e| crate::Error::Moe(fmoe_moe::Error::Kernel(e)))?;
        Ok(self.logits.to_device(Device::Cpu)?)
    }
}

/// A causal language model.
pub trait CausalLm: Send + Sync {
    fn info(&self) -> &ModelInfo;

    /// Runs one step: appends the new tokens' rows to `kv` (a pool made for
    /// [`ModelInfo::kv_layout`], `dtype` and `device`) and computes the logits rows `input`
    /// asks for. After an error the pool rows of the step's new tokens are undefined.
    fn forward(&self, input: &ForwardInput, kv: &mut KvPool) -> Result<ForwardOutput>;
}
