//! The engine's sizes from what a user sets (vLLM's flags): [`EngineArgs::resolve`] turns
//! `--num-kv-blocks`, `--kv-cache-memory` (CPU), `--gpu-memory-utilization` (CUDA),
//! `--max-num-batched-tokens`, `--max-num-seqs`, `--block-size` and `--no-prefix-caching` into an
//! [`EngineConfig`] for a loaded model.
//!
//! The pool's size: `--num-kv-blocks` when given; on CUDA, `utilization · total` minus what is in
//! use after the weights and a profile forward pass of the largest step (one sequence of
//! `max_num_batched_tokens` tokens: its activations' peak stays in the stream's memory pool); on
//! the CPU, `--kv-cache-memory` bytes (default 4 GiB). Neither takes more blocks than
//! `max_num_seqs` sequences of the model's full context could use.

use std::sync::Arc;

use fmoe_core::Device;
use fmoe_models::{CausalLm, KvPool};

use crate::engine::EngineConfig;
use crate::runner::{DirectSession, LogitsFor, SeqChunk};
use crate::scheduler::SchedulerConfig;
use crate::{Error, Result};

/// What a user sets (see the module docs); `None` picks the device's default.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineArgs {
    pub block_size: usize,
    pub num_kv_blocks: Option<usize>,
    /// CPU pool bytes.
    pub kv_cache_memory: Option<usize>,
    /// CUDA: the fraction of the GPU's memory fmoe may use in all.
    pub gpu_memory_utilization: f64,
    /// Default 8192 on CUDA, 512 on the CPU.
    pub max_num_batched_tokens: Option<usize>,
    /// Default 256 on CUDA, 16 on the CPU.
    pub max_num_seqs: Option<usize>,
    pub prefix_caching: bool,
    pub seed: u64,
}

impl Default for EngineArgs {
    fn default() -> Self {
        EngineArgs {
            block_size: 16,
            num_kv_blocks: None,
            kv_cache_memory: None,
            gpu_memory_utilization: 0.9,
            max_num_batched_tokens: None,
            max_num_seqs: None,
            prefix_caching: true,
            seed: 0,
        }
    }
}

/// CPU pool default.
pub const DEFAULT_KV_CACHE_MEMORY: usize = 4 << 30;

impl EngineArgs {
    /// The engine's sizes for `model` (on CUDA this runs the profile pass).
    pub fn resolve(&self, model: &Arc<dyn CausalLm>) -> Result<EngineConfig> {
        let info = model.info();
        let bad = |m: String| Err(Error::Request(m));
        if self.block_size == 0 || self.block_size > 1024 {
            return bad(format!(
                "block_size must be in 1..=1024, got {}",
                self.block_size
            ));
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            return bad(format!(
                "gpu_memory_utilization must be in (0, 1], got {}",
                self.gpu_memory_utilization
            ));
        }
        let cuda = !info.device.is_cpu();
        let max_num_seqs = self.max_num_seqs.unwrap_or(if cuda { 256 } else { 16 });
        let max_num_batched_tokens =
            self.max_num_batched_tokens
                .unwrap_or(if cuda { 8192 } else { 512 });
        if max_num_seqs == 0 || max_num_batched_tokens == 0 {
            return bad("max_num_seqs and max_num_batched_tokens must be at least 1".into());
        }
        let per_block = KvPool::bytes_per_block(&info.kv_layout, info.dtype, self.block_size)?;
        let useful = max_num_seqs
            .saturating_mul(info.max_position_embeddings.div_ceil(self.block_size))
            .max(1);
        let num_blocks = match self.num_kv_blocks {
            Some(0) => return bad("num_kv_blocks must be at least 1".into()),
            Some(n) => n,
            None => {
                let budget = match info.device {
                    Device::Cpu => self.kv_cache_memory.unwrap_or(DEFAULT_KV_CACHE_MEMORY),
                    Device::Cuda(i) => self.cuda_budget(model, i, max_num_batched_tokens)?,
                };
                let n = (budget / per_block.max(1)).min(useful);
                if n == 0 {
                    return bad(format!(
                        "no room for a KV block of {per_block} bytes in {budget} bytes; lower the weights' footprint or raise the memory limit"
                    ));
                }
                n
            }
        };
        Ok(EngineConfig {
            block_size: self.block_size,
            num_blocks,
            scheduler: SchedulerConfig {
                max_num_batched_tokens,
                max_num_seqs,
            },
            prefix_caching: self.prefix_caching,
            seed: self.seed,
        })
    }

    /// Bytes left for the pool on GPU `ordinal` after the weights and a profile pass.
    fn cuda_budget(
        &self,
        model: &Arc<dyn CausalLm>,
        ordinal: usize,
        tokens: usize,
    ) -> Result<usize> {
        let backend = fmoe_core::cuda::cuda_backend(ordinal)?;
        let info = model.info();
        let tokens = tokens.min(info.max_position_embeddings).max(1);
        // What earlier models and pools freed must not count as this one's peak.
        backend.trim_pool()?;
        profile_pass(model, tokens)?;
        backend.synchronize()?;
        let (free, total) = backend.memory_info()?;
        let used = total - free;
        let allowed = (total as f64 * self.gpu_memory_utilization) as usize;
        tracing::info!(
            total_gib = total as f64 / (1u64 << 30) as f64,
            used_gib = used as f64 / (1u64 << 30) as f64,
            "GPU memory after the weights and a {tokens}-token profile pass: {:.2} of {:.2} GiB in use",
            used as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        );
        Ok(allowed.saturating_sub(used))
    }
}

/// One forward pass of `tokens` tokens (token id 0) through a pool just large enough.
fn profile_pass(model: &Arc<dyn CausalLm>, tokens: usize) -> Result<()> {
    let mut s = DirectSession::new(model.clone(), tokens)?;
    let seq = s.allocate();
    s.forward(
        &[SeqChunk {
            seq,
            tokens: vec![0; tokens],
            start_pos: 0,
        }],
        LogitsFor::Last,
    )?;
    Ok(())
}
