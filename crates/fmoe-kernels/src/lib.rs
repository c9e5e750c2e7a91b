//! fmoe-kernels: the fused-MoE kernel library and the dense kernels around it. It knows tensors,
//! not models.
//!
//! Families (one folder each; `mod.rs` validates and dispatches on the device, `cpu.rs` is the
//! mandatory CPU twin, a `cuda.rs` joins it when the backend exists):
//! - [`routing`]: router logits → top-k expert ids and weights (Mixtral softmax, DeepSeek-V3
//!   grouped sigmoid "noaux_tc").
//! - [`moe_align`]: routes sorted by expert and padded to the GEMM's M tile.
//! - [`quant_fp8`]: e4m3 quantization: dynamic per-tensor, 1×128 per-token-group, 128×128 blocks.
//! - [`moe_gemm`]: the grouped expert GEMMs: GEMM1 over w13 with SiLU⊙mul fused, GEMM2 over w2 with
//!   the routing weight and top-k reduction fused (`fused` family), and the per-expert loop
//!   baseline (`portable` family).
//! - [`elementwise`]: casts, adds, random fills and sums on the tensor's device (the glue around
//!   the GEMMs, and the benchmark's device-side weights); SiLU⊙mul and the row/column copies the
//!   dense model path needs (embedding gather, narrows, per-head concatenation).
//!
//! The dense model path (attention blocks, dense MLPs, norms, heads):
//! - [`attention`]: causal / sliding-window softmax attention over a varlen batch (GQA, separate
//!   q·k and v widths), the dense layers' one heavy kernel: flash-attention prefill on tensor cores
//!   and split-KV flash-decoding.
//! - [`linear`]: `y = x·wᵀ` (nn.Linear layout), cuBLAS on CUDA ([`cublas`] loads it at run time
//!   and keeps one handle per backend, on the backend's stream).
//! - [`norm`]: RMSNorm and the fused residual add + RMSNorm.
//! - [`rotary`]: rotary embeddings, half-split (Mixtral) or interleaved (DeepSeek-V3), on a slice
//!   of each head.
//! - [`kv_cache`]: a batch's new K/V rows scattered into preallocated KV-cache slabs by a slot
//!   mapping, every stream of a layer in one launch.
//!
//! [`nvrtc`] is the one place that compiles CUDA (sources in `crates/fmoe-kernels/cuda/`, shared
//! device code in `cuda/common/*.cuh`, compiled at run time for the device, cached in memory and on
//! disk); [`catalog`] lists every kernel instantiation the families launch.
//!
//! The MoE layer (fmoe-moe) composes them: prepare (quantize, align) → experts → finalize.

pub mod attention;
pub mod catalog;
pub mod cublas;
mod dev;
pub mod elementwise;
mod error;
pub mod kv_cache;
mod launch;
pub mod linear;
pub mod moe_align;
pub mod moe_gemm;
pub mod norm;
pub mod nvrtc;
pub mod quant_fp8;
pub mod rotary;
pub mod routing;

pub use error::{Error, Result};
pub use launch::{FMOE_DEV_PDL, PDL_MAX_TOKENS, PdlChain, pdl_switch};
