//! Layers shared by the model files. Activations are f32 on the CPU (`Vec<f32>`, row-major
//! `[tokens, width]`); weights stay in their checkpoint dtype and are widened per row inside the
//! matmul.
//!
//! - [`linear`]: `y = x·Wᵀ` for bf16/f16/f32 weights and fp8 e4m3 weights with a per-tensor scale
//!   or DeepSeek-V3's 128×128 `weight_scale_inv`, multi-threaded over output rows (rayon);
//!   [`Embedding`] lookups.
//! - [`rms_norm`]: RMSNorm in f32.
//! - [`rotary`]: rotary position embeddings: the inverse-frequency schedule (default or YaRN) is
//!   separate from how it is applied (half-split as in Mixtral/Llama, or interleaved pairs as in
//!   DeepSeek-V3), and both are data ([`RopeScaling`](crate::config::RopeScaling),
//!   [`RopeStyle`]).
//! - [`attention`]: the causal softmax attention core (GQA, optional sliding window, separate q·k
//!   and v head widths so MLA can use it) and [`Attention`], the standard q/k/v/o block with a KV
//!   cache (Mixtral).
//! - [`moe`]: expert weights from a checkpoint into [`fmoe_moe::CheckpointExperts`] (names as
//!   data: Mixtral `w1/w3/w2`, DeepSeek `gate_proj/up_proj/down_proj`), the quant-scheme choice,
//!   and [`MoeBlock`] (router gate + [`fmoe_moe::FusedMoe`]).
//! - [`mla`]: DeepSeek's multi-head latent attention ([`Mla`]) over a compressed-latent KV cache.
//! - [`mlp`]: the dense SwiGLU MLP ([`Mlp`]).
//! - [`lm_head`]: embeddings in, final norm and language-model head out ([`LmEnds`]).

pub mod attention;
pub mod linear;
pub mod lm_head;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod rms_norm;
pub mod rotary;

pub use attention::{Attention, AttentionSpec};
pub use linear::{Embedding, Linear, WeightScale};
pub use lm_head::LmEnds;
pub use mla::{Mla, MlaPath, MlaSpec};
pub use mlp::Mlp;
pub use moe::{ExpertNames, MoeBlock};
pub use rms_norm::RmsNorm;
pub use rotary::{RopeStyle, RopeTable, Rotary};

/// `acc += x`, element by element (residual connections).
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += *b;
    }
}
