//! What the model files load with: [`linear`] (dense weights, bf16/f16/f32 or fp8 e4m3 with a
//! per-tensor scale or DeepSeek-V3's 128×128 `weight_scale_inv`, dequantized where the model
//! runs), [`rotary`] (the inverse-frequency schedule, default or YaRN, apart from how it is
//! applied: half-split as in Mixtral/Llama or interleaved pairs as in DeepSeek-V3, both data:
//! [`RopeScaling`](crate::config::RopeScaling), [`RopeStyle`]), [`attention`] and [`mla`] (the
//! attention blocks' shapes and cache streams), and [`moe`] (expert weights from a checkpoint
//! into [`fmoe_moe::CheckpointExperts`], names as data: Mixtral `w1/w3/w2`, DeepSeek
//! `gate_proj/up_proj/down_proj`; the quant-scheme choice; static activation scales).

pub mod attention;
pub mod linear;
pub mod mla;
pub mod moe;
pub mod rotary;

pub use attention::AttentionSpec;
pub use linear::{Embedding, Linear, WeightScale};
pub use mla::{MLA_NORM_EPS, MlaSpec};
pub use moe::ExpertNames;
pub use rotary::{RopeStyle, RopeTable, Rotary};
