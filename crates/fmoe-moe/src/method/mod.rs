//! MoE methods: one per weight format. Lifecycle (as in vLLM): create from checkpoint tensors →
//! `process_weights_after_loading` once the kernel is chosen → `apply` per batch.

mod fp8;
mod unquantized;

pub use fp8::Fp8MoeMethod;
pub use unquantized::UnquantizedMoeMethod;

use fmoe_core::Tensor;
use fmoe_kernels::quant_fp8::FiniteCheck;
use fmoe_kernels::routing::TopK;

use crate::stages::ExpertOperands;
use crate::{ActScales, Error, KernelFamily, QuantScheme, Result};

/// Expert tensors as a checkpoint (or the dummy loader) provides them.
#[derive(Clone, Debug)]
pub enum CheckpointExperts {
    /// bf16/f16/f32: w13 [E, 2N, K] (gate rows, then up rows), w2 [E, K, N].
    Dense { w13: Tensor, w2: Tensor },
    /// e4m3 with per-tensor scales: `w13_scale` is \[E\] or \[E, 2\] (separate w1 and w3 scales, as
    /// Mixtral fp8 checkpoints store them); `w2_scale` is \[E\].
    Fp8PerTensor {
        w13: Tensor,
        w13_scale: Tensor,
        w2: Tensor,
        w2_scale: Tensor,
    },
    /// e4m3 in 128×128 blocks with DeepSeek-V3's `weight_scale_inv` layout
    /// [E, ceil(rows/128), ceil(cols/128)].
    Fp8Block {
        w13: Tensor,
        w13_scale_inv: Tensor,
        w2: Tensor,
        w2_scale_inv: Tensor,
    },
}

impl CheckpointExperts {
    fn kind(&self) -> &'static str {
        match self {
            CheckpointExperts::Dense { .. } => "dense",
            CheckpointExperts::Fp8PerTensor { .. } => "fp8 per-tensor",
            CheckpointExperts::Fp8Block { .. } => "fp8 block",
        }
    }

    /// The same experts with every tensor on `device` (tensors already there are shared, not
    /// copied).
    pub fn to_device(&self, device: fmoe_core::Device) -> Result<CheckpointExperts> {
        let d = |t: &Tensor| t.to_device(device);
        Ok(match self {
            CheckpointExperts::Dense { w13, w2 } => CheckpointExperts::Dense {
                w13: d(w13)?,
                w2: d(w2)?,
            },
            CheckpointExperts::Fp8PerTensor {
                w13,
                w13_scale,
                w2,
                w2_scale,
            } => CheckpointExperts::Fp8PerTensor {
                w13: d(w13)?,
                w13_scale: d(w13_scale)?,
                w2: d(w2)?,
                w2_scale: d(w2_scale)?,
            },
            CheckpointExperts::Fp8Block {
                w13,
                w13_scale_inv,
                w2,
                w2_scale_inv,
            } => CheckpointExperts::Fp8Block {
                w13: d(w13)?,
                w13_scale_inv: d(w13_scale_inv)?,
                w2: d(w2)?,
                w2_scale_inv: d(w2_scale_inv)?,
            },
        })
    }

    fn weights(&self) -> (&Tensor, &Tensor) {
        match self {
            CheckpointExperts::Dense { w13, w2 }
            | CheckpointExperts::Fp8PerTensor { w13, w2, .. }
            | CheckpointExperts::Fp8Block { w13, w2, .. } => (w13, w2),
        }
    }

    /// Checks w13 [E, 2N, K] and w2 [E, K, N] against the expected sizes.
    pub fn check_dims(&self, method: &'static str, e: usize, k: usize, n: usize) -> Result<()> {
        let (w13, w2) = self.weights();
        for (name, t, want) in [("w13", w13, [e, 2 * n, k]), ("w2", w2, [e, k, n])] {
            if t.dims() != want {
                return Err(Error::Weights {
                    method,
                    msg: format!(
                        "expert weight `{name}` has shape {}, expected {want:?}",
                        t.shape()
                    ),
                });
            }
        }
        Ok(())
    }
}

/// A MoE quantization method.
pub trait MoeMethod: Send + Sync {
    fn scheme(&self) -> QuantScheme;

    /// Converts the checkpoint tensors into the operands `kernel` reads. Called once, after
    /// loading and kernel selection.
    fn process_weights_after_loading(&mut self, kernel: KernelFamily) -> Result<()>;

    /// The processed operands (an error before processing).
    fn operands(&self) -> Result<&ExpertOperands>;

    /// The activation scales the method quantizes with (dynamic unless set).
    fn act_scales(&self) -> ActScales {
        ActScales::Dynamic
    }

    /// Sets the activation scales (before or after processing the weights). Only the fp8
    /// per-tensor method takes static scales; for any other `Static` is an error.
    fn set_act_scales(&mut self, scales: ActScales) -> Result<()> {
        match scales {
            ActScales::Dynamic => Ok(()),
            ActScales::Static { .. } => Err(static_needs_per_tensor(self.scheme())),
        }
    }

    /// Runs the experts for routed tokens `x` [M, K].
    fn apply(&self, x: &Tensor, topk: &TopK, kernel: KernelFamily) -> Result<Tensor> {
        Ok(self.apply_deferred(x, topk, kernel)?.0)
    }

    /// [`Self::apply`], also returning the NaN/Inf check of its dynamic quantizations (see
    /// [`crate::stages::run_experts_deferred`]).
    fn apply_deferred(
        &self,
        x: &Tensor,
        topk: &TopK,
        kernel: KernelFamily,
    ) -> Result<(Tensor, FiniteCheck)> {
        crate::stages::run_experts_deferred(x, topk, self.operands()?, kernel)
    }
}

/// Builds the method for `scheme` over checkpoint experts of shape (E, K, N).
pub fn create(
    scheme: QuantScheme,
    experts: CheckpointExperts,
    dims: (usize, usize, usize),
) -> Result<Box<dyn MoeMethod>> {
    Ok(match scheme {
        QuantScheme::Unquantized => Box::new(UnquantizedMoeMethod::create_weights(experts, dims)?),
        QuantScheme::Fp8PerTensor | QuantScheme::Fp8Block => {
            Box::new(Fp8MoeMethod::create_weights(scheme, experts, dims)?)
        }
    })
}

fn static_needs_per_tensor(scheme: QuantScheme) -> Error {
    Error::Config(format!(
        "static activation scales need the fp8 per-tensor MoE method (fp8-tensor); this layer is \
         {scheme}"
    ))
}

fn not_processed(method: &'static str) -> Error {
    Error::Weights {
        method,
        msg: "weights used before process_weights_after_loading".into(),
    }
}
