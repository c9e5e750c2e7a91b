//! fmoe-moe: the fused-MoE layer between the kernel library and the models.
//!
//! - [`MoeConfig`] describes a layer (experts, widths, top-k, [`Routing`]); [`QuantScheme`] says how
//!   its expert weights are stored: unquantized, fp8 with per-tensor scales, or fp8 in 128×128 blocks.
//! - [`dispatch::resolve`] turns the `FMOE_*` switches, the scheme and the device into a
//!   [`KernelChoice`] (`fused` or `portable`) with the reason. The switch cascade lives here and
//!   nowhere else.
//! - A [`MoeMethod`] ([`UnquantizedMoeMethod`], [`Fp8MoeMethod`]) owns its weights:
//!   `process_weights_after_loading` converts checkpoint tensors into what the chosen kernel reads
//!   (fp8 scale merging and requantization, online quantization), `apply` runs the experts.
//! - [`FusedMoe`] is the layer: router logits → [`router`] → method → (+ shared expert).
//! - [`reference`](mod@reference) is the f64 reference the tests and benchmarks measure kernels against.
//!
//! The pipeline of `apply` ([`stages`]): prepare (quantize a1, align routes by expert) → experts
//! (GEMM1 + SiLU⊙mul, quantize a2, GEMM2) → finalize (routing weight and top-k sum, fused into GEMM2
//! on the fused path).

mod config;
pub mod dispatch;
mod error;
mod layer;
pub mod method;
pub mod reference;
pub mod router;
pub mod stages;

pub use config::{ActScales, MoeConfig, QuantScheme, Routing};
pub use dispatch::{KernelChoice, KernelFamily};
pub use error::{Error, Result};
pub use layer::{FusedMoe, SharedExpert};
pub use method::{CheckpointExperts, Fp8MoeMethod, MoeMethod, UnquantizedMoeMethod};
