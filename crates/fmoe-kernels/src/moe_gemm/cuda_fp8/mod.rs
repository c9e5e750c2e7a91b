//! CUDA twin of `moe_gemm` for fp8 (e4m3) operands: Hopper only (wgmma, `sm_90a`).
//!
//! Kernels (launch recipes of `bench/gpu/moe_fp8_cupy.py`, which ran them on an H200):
//! - per-tensor scales, `cuda/moe_gemm_fp8_sm90.cu` (`fmoe_moe_gemm_fp8`): activations with one
//!   scale, weights with one scale per expert; MODE 1 = GEMM1 with SiLU⊙mul, h in bf16 plus the
//!   atomic amax of |h|; MODE 2 = GEMM2 with the routing weight and top-k sum (f32 vector atomics
//!   into a zeroed y, split-K allowed).
//! - 128×128 block scales, `cuda/moe_gemm_fp8_block_sm90.cu` (`fmoe_moe_gemm_fp8_block`): 1×128
//!   activation groups, DeepSeek-V3's weight blocks, promotion into f32 registers every 128-wide K
//!   block; MODE 1 fuses SiLU⊙mul and the 1×128 group quantization of h (codes and scales are the
//!   GEMM2 operand); MODE 2 as above.
//!
//! Variants ([`Fp8GemmConfig::select`], the bf16 rule of [`super::GemmConfig::select`]: large tiles
//! from [`LARGE_TILE_ROUTES_PER_EXPERT`](super::cuda::LARGE_TILE_ROUTES_PER_EXPERT) routes per
//! expert on average):
//! - per-tensor, small ([`FP8_TENSOR_SMALL`]): BM 64, WG_N 128, 4 stages, **PROMOTE=1** (the
//!   tensor-core sums of each 128-wide K tile are added into f32 registers: ~2e-4 relative GEMM
//!   error instead of ~2e-3, free while bandwidth-bound);
//! - per-tensor, large ([`FP8_TENSOR_LARGE`]): BM 128, WG_N 256, 4 stages, unpromoted (the whole
//!   reduction stays in the tensor-core accumulator: 1.3-1.6× faster when compute-bound, ~2e-3
//!   GEMM error). So per-tensor results differ slightly with the batch size (the variant changes
//!   at 64 routes per expert), by about that GEMM error, far below fp8's own ~6.5e-2;
//! - block ([`FP8_BLOCK_SCALED`]): BM 64, 256 weight rows, 5 stages (always promoted).
//!
//! Fused pipeline (what [`gemm1_quant`] and [`gemm2`] launch, the layer aligning routes with the
//! variant's `block_m` first):
//! - per-tensor: [x's amax, cast: the caller's `ActOperand::quantize_deferred`] → GEMM1 (bf16 h,
//!   amax of |h|) → cast of h with that amax (`quant_fp8.cu`, the one pass left) → GEMM2. The GPU
//!   requantizes the **bf16-rounded** h, while the CPU twin quantizes its f32 h: codes can differ
//!   by one step where bf16 rounding crosses a code boundary (within the tests' 1e-2).
//!   With a static scale for h (`ActScale::Static`, a static checkpoint's `input_scale`) GEMM1
//!   skips the amax atomics and the cast reads that device scalar instead
//!   (`fmoe_fp8_quant_tensor_static`); the portable path casts h the same way.
//! - block: [x's 1×128 group quantization] → GEMM1 (codes and scales of h, from f32 h, as the
//!   CPU twin) → GEMM2.
//!
//! Portable (unfused) pipeline, [`portable`]: the same kernels, no fusion, every intermediate in
//! device memory and each step a launch (as the bf16 portable path): align; gather the token rows
//! of the quantized a1 per route (codes, and for block scales their group scales); GEMM1 as a plain
//! grouped GEMM (MODE 2 with top_k = 1 and unit weights: one exact product per element into a
//! zeroed f32 [R, 2N]); SiLU⊙mul into bf16 (per-tensor, so h is rounded where the fused kernel
//! rounds it) or f32 (block) [R, N]; requantization of h with the quantization kernels
//! (amax + cast, or 1×128 groups); GEMM2 the same way into f32 [R, K]; the weighted top-k sum.
//! No host synchronization on either path.
//!
//! NaN/Inf in h (an overflow) sets the kernels' device flag, returned as a
//! [`FiniteCheck`] (no index: h is not kept).
//!
//! Contract (checked, naming the dimension): K and N multiples of 16 (16-byte rows of codes;
//! GEMM2's reduction length is N). Activations and weights must be fp8 of the same scheme
//! (per-tensor with per-tensor, 1×128 groups with 128×128 blocks).
//!
//! Files: this one has the public variants and their selection ([`Fp8GemmConfig`]); `support.rs`
//! decides which operands and devices the kernels take; `launch.rs` turns operands and aligned
//! routes into device buffers and launches one GEMM; `fused.rs` and `unfused.rs` are the two
//! pipelines above ([`gemm1_quant`], [`gemm1_h`], [`gemm2`]; [`portable`]).
//!
//! [`FiniteCheck`]: crate::quant_fp8::FiniteCheck

mod fused;
mod launch;
mod support;
mod unfused;

use super::cuda::large_tile_routes_per_expert;
use crate::catalog::KernelVariant;

pub(super) use fused::{gemm1_h, gemm1_quant, gemm2};
pub(super) use support::{check_support, is_fp8_act, is_fp8_weight};
pub(super) use unfused::portable;

/// Which fp8 scaling the operands use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Scheme {
    /// Activations: one scale; weights: one scale per expert (`moe_gemm_fp8_sm90.cu`).
    PerTensor,
    /// Activations: 1×128 groups; weights: 128×128 blocks (`moe_gemm_fp8_block_sm90.cu`).
    Block,
}

/// One fp8 grouped GEMM variant and its compile-time tunables (`-D` defines).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8GemmConfig {
    pub scheme: Fp8Scheme,
    /// M tile (routes per block) = `moe_align`'s `block_m`: 64 or 128 (per-tensor), 64 (block).
    pub bm: usize,
    /// Weight rows per block: wgmma N of the per-tensor kernel (`-D WG_N`, 128 or 256); the block
    /// kernel always reads 256 (two warpgroups of 128).
    pub wg_n: usize,
    /// cp.async ring depth (`-D STAGES`).
    pub stages: usize,
    /// Per-tensor: `-D PROMOTE` (WG_N 128 only). The block kernel always promotes.
    pub promote: bool,
}

/// Per-tensor, decode-sized batches: promoted, 64 × 128 tiles.
pub const FP8_TENSOR_SMALL: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::PerTensor,
    bm: 64,
    wg_n: 128,
    stages: 4,
    promote: true,
};

/// Per-tensor, prefill-sized batches: unpromoted, 128 × 256 tiles.
pub const FP8_TENSOR_LARGE: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::PerTensor,
    bm: 128,
    wg_n: 256,
    stages: 4,
    promote: false,
};

/// Block-scaled: 64 × 256 tiles, 5 stages.
pub const FP8_BLOCK_SCALED: Fp8GemmConfig = Fp8GemmConfig {
    scheme: Fp8Scheme::Block,
    bm: 64,
    wg_n: 256,
    stages: 5,
    promote: true,
};

const TENSOR_FAMILY: &str = "moe_gemm_fp8_sm90";
const TENSOR_SRC: &str = include_str!("../../../cuda/moe_gemm_fp8_sm90.cu");
const TENSOR_ENTRY: &str = "fmoe_moe_gemm_fp8";
const BLOCK_FAMILY: &str = "moe_gemm_fp8_block_sm90";
const BLOCK_SRC: &str = include_str!("../../../cuda/moe_gemm_fp8_block_sm90.cu");
const BLOCK_ENTRY: &str = "fmoe_moe_gemm_fp8_block";
/// K and N must be multiples of this (16-byte rows of e4m3 codes).
pub const FP8_K_MULTIPLE: usize = 16;

/// Every fp8 GEMM variant ([`FP8_TENSOR_SMALL`], [`FP8_TENSOR_LARGE`], [`FP8_BLOCK_SCALED`], both
/// modes); the glue kernels are listed with the bf16 ones.
pub(super) fn variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    for cfg in [FP8_TENSOR_SMALL, FP8_TENSOR_LARGE, FP8_BLOCK_SCALED] {
        let (family, source, entry) = cfg.source();
        for mode in [1, 2] {
            v.push(KernelVariant {
                family,
                source,
                entry,
                defines: cfg.defines(mode),
            });
        }
    }
    v
}

impl Fp8GemmConfig {
    /// The variant for `num_routes` routes over `experts` experts (see the module docs).
    pub fn select(scheme: Fp8Scheme, num_routes: usize, experts: usize) -> Fp8GemmConfig {
        match scheme {
            Fp8Scheme::Block => FP8_BLOCK_SCALED,
            Fp8Scheme::PerTensor
                if num_routes >= large_tile_routes_per_expert() * experts.max(1) =>
            {
                FP8_TENSOR_LARGE
            }
            Fp8Scheme::PerTensor => FP8_TENSOR_SMALL,
        }
    }

    /// The variant of `scheme` that consumes routes aligned to `block_m`.
    pub fn for_block_m(scheme: Fp8Scheme, block_m: usize) -> Option<Fp8GemmConfig> {
        [FP8_TENSOR_SMALL, FP8_TENSOR_LARGE, FP8_BLOCK_SCALED]
            .into_iter()
            .find(|c| c.scheme == scheme && c.bm == block_m)
    }

    /// Output columns per block: MODE 1 pairs gate with up rows (half the weight rows), MODE 2
    /// writes one column per weight row.
    pub const fn n_tile(&self, mode: u32) -> usize {
        match (self.scheme, mode) {
            (Fp8Scheme::PerTensor, 1) => self.wg_n / 2,
            (Fp8Scheme::PerTensor, _) => self.wg_n,
            (Fp8Scheme::Block, 1) => 128,
            (Fp8Scheme::Block, _) => 256,
        }
    }

    pub const fn threads(&self) -> u32 {
        match self.scheme {
            Fp8Scheme::PerTensor => (self.bm / 64 * 128) as u32,
            Fp8Scheme::Block => 256,
        }
    }

    /// Dynamic shared memory per block (the sources' formulas).
    pub const fn smem_bytes(&self) -> u32 {
        (match self.scheme {
            Fp8Scheme::PerTensor => self.stages * (self.bm + self.wg_n) * 128 + 1024,
            Fp8Scheme::Block => self.stages * (64 + 256) * 128 + 1024,
        }) as u32
    }

    fn source(&self) -> (&'static str, &'static str, &'static str) {
        match self.scheme {
            Fp8Scheme::PerTensor => (TENSOR_FAMILY, TENSOR_SRC, TENSOR_ENTRY),
            Fp8Scheme::Block => (BLOCK_FAMILY, BLOCK_SRC, BLOCK_ENTRY),
        }
    }

    fn defines(&self, mode: u32) -> Vec<(&'static str, String)> {
        let mut d = vec![("MODE", mode.to_string())];
        if self.scheme == Fp8Scheme::PerTensor {
            d.push(("WG_N", self.wg_n.to_string()));
        }
        d.push(("STAGES", self.stages.to_string()));
        if self.scheme == Fp8Scheme::PerTensor {
            d.push(("BM", self.bm.to_string()));
            d.push(("PROMOTE", u32::from(self.promote).to_string()));
        }
        d
    }

    /// GEMM2's split-K factor (the harness's `splits_for`): enough splits for about four blocks
    /// per SM, each split at least 4 K tiles of 128.
    pub fn splits(
        &self,
        num_routes: usize,
        experts: usize,
        slots: usize,
        n_tiles: usize,
        kd: usize,
        sms: usize,
    ) -> usize {
        // Each split at least 4 K tiles of 128.
        let max_splits = ((kd / 128) / 4).max(1);
        super::cuda::split_k(
            num_routes, experts, slots, self.bm, n_tiles, max_splits, sms,
        )
    }
}

#[cfg(test)]
mod tests {
    use fmoe_core::{DType, Device, Tensor};

    use super::support::{check_arch, check_dims, pair_scheme};
    use super::*;
    use crate::moe_gemm::{ActQuant, WeightOperand};

    #[test]
    fn variants_follow_the_kernel_authors_recipes() {
        assert_eq!(
            (
                FP8_TENSOR_SMALL.n_tile(1),
                FP8_TENSOR_SMALL.n_tile(2),
                FP8_TENSOR_SMALL.threads()
            ),
            (64, 128, 128)
        );
        assert_eq!(FP8_TENSOR_SMALL.smem_bytes(), 4 * (64 + 128) * 128 + 1024);
        assert_eq!(
            (
                FP8_TENSOR_LARGE.n_tile(1),
                FP8_TENSOR_LARGE.n_tile(2),
                FP8_TENSOR_LARGE.threads()
            ),
            (128, 256, 256)
        );
        assert_eq!(FP8_TENSOR_LARGE.smem_bytes(), 4 * (128 + 256) * 128 + 1024);
        assert_eq!(
            (
                FP8_BLOCK_SCALED.n_tile(1),
                FP8_BLOCK_SCALED.n_tile(2),
                FP8_BLOCK_SCALED.threads()
            ),
            (128, 256, 256)
        );
        assert_eq!(FP8_BLOCK_SCALED.smem_bytes(), 5 * 40_960 + 1024);
        for c in [FP8_TENSOR_SMALL, FP8_TENSOR_LARGE, FP8_BLOCK_SCALED] {
            assert!(c.smem_bytes() <= 227 * 1024, "{c:?}");
            assert!(!c.promote || c.scheme == Fp8Scheme::Block || c.wg_n == 128);
        }
        assert_eq!(
            FP8_TENSOR_SMALL.defines(1),
            [
                ("MODE", "1".to_string()),
                ("WG_N", "128".to_string()),
                ("STAGES", "4".to_string()),
                ("BM", "64".to_string()),
                ("PROMOTE", "1".to_string())
            ]
        );
        assert_eq!(
            FP8_BLOCK_SCALED.defines(2),
            [("MODE", "2".to_string()), ("STAGES", "5".to_string())]
        );
    }

    #[test]
    fn selection_uses_the_bf16_rule_and_block_m_finds_the_variant() {
        use Fp8Scheme::*;
        assert_eq!(Fp8GemmConfig::select(PerTensor, 2, 8), FP8_TENSOR_SMALL);
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 63 * 8, 8),
            FP8_TENSOR_SMALL
        );
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 64 * 8, 8),
            FP8_TENSOR_LARGE
        );
        assert_eq!(
            Fp8GemmConfig::select(PerTensor, 4096 * 8, 256),
            FP8_TENSOR_LARGE
        );
        assert_eq!(Fp8GemmConfig::select(Block, 1 << 20, 8), FP8_BLOCK_SCALED);
        assert_eq!(
            Fp8GemmConfig::for_block_m(PerTensor, 64),
            Some(FP8_TENSOR_SMALL)
        );
        assert_eq!(
            Fp8GemmConfig::for_block_m(PerTensor, 128),
            Some(FP8_TENSOR_LARGE)
        );
        assert_eq!(
            Fp8GemmConfig::for_block_m(Block, 64),
            Some(FP8_BLOCK_SCALED)
        );
        assert_eq!(Fp8GemmConfig::for_block_m(Block, 128), None);
    }

    #[test]
    fn split_k_matches_the_harness() {
        // Mixtral decode GEMM2 (K = 4096 outputs, N = 14336 reduction), 2 routes, small tiles:
        // 32 N tiles · min(128 / 64, 1 + 2) = 64 blocks → ceil(528 / 64) = 9 ≤ 14336 / 128 / 4 = 28.
        assert_eq!(FP8_TENSOR_SMALL.splits(2, 8, 128, 32, 14336, 132), 9);
        // Short reductions are never split.
        assert_eq!(FP8_BLOCK_SCALED.splits(2, 8, 128, 1, 256, 132), 1);
        assert_eq!(FP8_TENSOR_LARGE.splits(8192, 8, 9216, 16, 14336, 132), 1);
    }

    #[test]
    fn non_hopper_devices_get_an_error_naming_sm_90() {
        let err = check_arch("op", Device::Cuda(0), (8, 9))
            .unwrap_err()
            .to_string();
        assert!(err.contains("sm_90") && err.contains("sm_89"), "{err}");
        assert!(check_arch("op", Device::Cuda(0), (10, 0)).is_err());
        assert!(check_arch("op", Device::Cuda(0), (9, 0)).is_ok());
    }

    #[test]
    fn mixed_operands_name_the_combination() {
        let w = WeightOperand::Fp8Block {
            q: Tensor::zeros([1, 2, 16], DType::F8E4M3, &Device::Cpu).unwrap(),
            scale_inv: Tensor::zeros([1, 1, 1], DType::F32, &Device::Cpu).unwrap(),
        };
        let err = pair_scheme("op", Device::Cuda(0), ActQuant::Fp8PerTensor, &w, "w13")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("per-tensor") && err.contains("128×128") && err.contains("w13"),
            "{err}"
        );
        assert!(check_dims("op", 144, 80).is_ok());
        let err = check_dims("op", 136, 80).unwrap_err().to_string();
        assert!(
            err.contains("K (hidden") && err.contains("136") && err.contains("16"),
            "{err}"
        );
        let err = check_dims("op", 144, 72).unwrap_err().to_string();
        assert!(
            err.contains("N (intermediate") && err.contains("72"),
            "{err}"
        );
    }
}
