//! The shape of multi-head latent attention (DeepSeek-V2/V3), as transformers'
//! `DeepseekV3Attention` computes it, with a compressed-latent KV cache.
//!
//! Per token `x`:
//! - `q = q_b(RMSNorm(q_a(x)))` (or `q_proj(x)` when `q_lora_rank` is null), per head
//!   `[nope | rope]`; the rope part is rotated (interleaved pairs, YaRN frequencies);
//! - `kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]`; the latent
//!   is normalized (`kv_a_layernorm`), `k_rope` rotated; it is shared by all heads;
//! - keys and values per head: `kv_b(latent) = [k_nope | v]`, `k = [k_nope | k_rope]`;
//! - `softmax(q·k · scale)·v` with `scale = (nope + rope)^-0.5 · mscale²`
//!   (`mscale = 0.1·mscale_all_dim·ln(factor) + 1` under YaRN), then `o_proj`.
//!
//! q_a/kv_a norms use eps 1e-6 whatever `rms_norm_eps` says (transformers hard-codes it).
//!
//! The cache holds what the heads share, per token: stream 0 the normalized latent
//! (`kv_lora_rank`), stream 1 the rotated `k_rope` (`qk_rope_head_dim`): 576 values per token and
//! layer for DeepSeek-V3 instead of 128 heads × (192 + 128).
//!
//! The forward (`crate::device::deepseek_v3`) decompresses: `kv_b` over every cached latent the
//! step reads, then standard attention.

use crate::config::{DeepseekV3Config, RopeScaling};
use crate::layers::rotary::yarn_mscale;

/// eps of `q_a_layernorm` and `kv_a_layernorm` (fixed in transformers, not `rms_norm_eps`).
pub const MLA_NORM_EPS: f64 = 1e-6;

/// Shape of an MLA block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaSpec {
    pub hidden: usize,
    pub num_heads: usize,
    /// None: a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Softmax scale (`(nope + rope)^-0.5 · mscale²`).
    pub scale: f32,
}

impl MlaSpec {
    /// The block `cfg` describes; the scale follows transformers: `qk_head_dim^-0.5`, times
    /// `yarn_mscale(factor, mscale_all_dim)²` when the rope is YaRN with a nonzero
    /// `mscale_all_dim`.
    pub fn from_config(cfg: &DeepseekV3Config) -> std::result::Result<MlaSpec, String> {
        if cfg.qk_nope_head_dim == 0 {
            return Err("qk_nope_head_dim must be positive".into());
        }
        let qk = cfg.qk_head_dim();
        let mut scale = (qk as f64).powf(-0.5);
        if let RopeScaling::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } = cfg.rope()?.scaling
            && m != 0.0
        {
            let ms = yarn_mscale(factor, m);
            scale *= ms * ms;
        }
        Ok(MlaSpec {
            hidden: cfg.hidden_size,
            num_heads: cfg.num_attention_heads,
            q_lora_rank: cfg.q_lora_rank,
            kv_lora_rank: cfg.kv_lora_rank,
            qk_nope_head_dim: cfg.qk_nope_head_dim,
            qk_rope_head_dim: cfg.qk_rope_head_dim,
            v_head_dim: cfg.v_head_dim,
            scale: scale as f32,
        })
    }

    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Cache streams per layer: the normalized latent and the rotated shared rope key.
    pub fn cache_streams(&self) -> Vec<usize> {
        vec![self.kv_lora_rank, self.qk_rope_head_dim]
    }
}
