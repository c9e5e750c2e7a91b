//! What the commands that load a model share: the engine flags (named as vLLM names them) and the
//! `--quantization` / `--load-format` values.

use fmoe_engine::EngineArgs;
use fmoe_models::LoadFormat;
use fmoe_moe::QuantScheme;

/// `--quantization`: the MoE method for a bf16 checkpoint's experts.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Quantization {
    /// Per-tensor e4m3, quantized at load.
    Fp8,
    /// 128×128 blocks.
    Fp8Block,
}

impl Quantization {
    pub fn scheme(self) -> QuantScheme {
        match self {
            Quantization::Fp8 => QuantScheme::Fp8PerTensor,
            Quantization::Fp8Block => QuantScheme::Fp8Block,
        }
    }
}

/// `--load-format`: the directory's checkpoint, or random weights from a seed.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LoadFormatArg {
    Auto,
    Dummy,
}

impl LoadFormatArg {
    pub fn format(self, seed: u64) -> LoadFormat {
        match self {
            LoadFormatArg::Auto => LoadFormat::Auto,
            LoadFormatArg::Dummy => LoadFormat::Dummy { seed },
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct EngineFlags {
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks in the pool (overrides --gpu-memory-utilization and --kv-cache-memory).
    #[arg(long)]
    pub num_kv_blocks: Option<usize>,
    /// CPU: bytes of KV pool (default 4 GiB, at most what --max-num-seqs full-context
    /// sequences use).
    #[arg(long)]
    pub kv_cache_memory: Option<usize>,
    /// CUDA: the fraction of the GPU's memory for weights, activations and the KV pool.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Tokens per step, prefill chunks and decodes together (default 8192 on CUDA, 512 on the
    /// CPU).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Sequences running at once (default 256 on CUDA, 16 on the CPU).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Do not share computed prompt blocks between requests.
    #[arg(long)]
    pub no_prefix_caching: bool,
}

impl EngineFlags {
    pub fn args(&self, seed: u64) -> EngineArgs {
        EngineArgs {
            block_size: self.block_size,
            num_kv_blocks: self.num_kv_blocks,
            kv_cache_memory: self.kv_cache_memory,
            gpu_memory_utilization: self.gpu_memory_utilization,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            prefix_caching: !self.no_prefix_caching,
            seed,
        }
    }
}
