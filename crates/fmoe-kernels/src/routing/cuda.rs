//! CUDA twin of the routing kernels: `cuda/topk_softmax.cu` and `cuda/grouped_topk.cu` (sharing
//! `cuda/common/routing.cuh`), compiled by [`crate::nvrtc`]. Both run one warp per row.
//!
//! Callers (`super`) have validated shapes and parameters; finiteness is checked by the kernels:
//! device flags, set with a memset and returned with the outputs, which `super` reads at once or
//! hands back as a deferred check. Nothing here waits for the device.

use std::sync::Arc;

use fmoe_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaBackend, CudaStorage, cuda_error};
use fmoe_core::{DType, Error as CoreError};

use crate::Result;
use crate::catalog::KernelVariant;
use crate::nvrtc::{self, KernelSpec};

const TOPK_SOFTMAX: &str = "topk_softmax";
const TOPK_SOFTMAX_SRC: &str = include_str!("../../cuda/topk_softmax.cu");
const TOPK_SOFTMAX_ENTRY: &str = "fmoe_topk_softmax";

const GROUPED_TOPK: &str = "grouped_topk";
const GROUPED_TOPK_SRC: &str = include_str!("../../cuda/grouped_topk.cu");
const GROUPED_TOPK_ENTRY: &str = "fmoe_grouped_topk";

/// The most experts either kernel handles: 32 register slots per lane (a lane's `taken` mask is
/// 32 bits). Also keeps the dynamic shared memory within the default 48 KiB: topk_softmax's
/// 4 warps × (E + 2k) floats, grouped_topk's 4 warps × (E + n_group + n_group/32) floats.
pub(crate) const MAX_EXPERTS: usize = 32 * 32;

/// One `topk_softmax` launch, named.
pub(crate) struct TopKSoftmaxArgs<'a> {
    /// `[rows, experts]`, f32/bf16/f16.
    pub logits: &'a CudaStorage,
    pub rows: usize,
    pub experts: usize,
    /// In `1..=experts`.
    pub top_k: usize,
    pub renormalize: bool,
}

/// One `grouped_topk` launch, named.
pub(crate) struct GroupedTopKArgs<'a> {
    /// `[rows, experts]`, f32/bf16/f16.
    pub logits: &'a CudaStorage,
    /// `[experts]`, f32.
    pub bias: &'a CudaStorage,
    pub rows: usize,
    pub experts: usize,
    /// Checked by `super::check_groups`.
    pub params: super::GroupedTopKParams,
}

/// What a routing kernel is compiled for: its `-D` defines come from these fields only. Both
/// kernels take the same ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WarpPerRowConfig {
    logits_dtype: DType,
    /// `ceil(E / 32)` rounded up to a power of two: one compiled variant serves a range of E.
    experts_per_lane: u32,
    warps_per_block: u32,
}

impl WarpPerRowConfig {
    const WARPS_PER_BLOCK: u32 = 4;

    fn new(logits_dtype: DType, experts: usize) -> WarpPerRowConfig {
        let per_lane = experts.div_ceil(32).max(1).next_power_of_two();
        WarpPerRowConfig {
            logits_dtype,
            experts_per_lane: u32::try_from(per_lane).unwrap_or(u32::MAX),
            warps_per_block: Self::WARPS_PER_BLOCK,
        }
    }

    fn defines(&self, op: &'static str) -> Result<Vec<(&'static str, String)>> {
        let dtype = match self.logits_dtype {
            DType::F32 => 0,
            DType::BF16 => 1,
            DType::F16 => 2,
            other => return Err(super::logits_dtype_error(op, other)),
        };
        Ok(vec![
            ("FMOE_LOGITS_DTYPE", dtype.to_string()),
            ("EXPERTS_PER_LANE", self.experts_per_lane.to_string()),
            ("WARPS_PER_BLOCK", self.warps_per_block.to_string()),
        ])
    }

    /// topk_softmax, per block: each warp keeps E exps and the k selected (value, id) pairs.
    fn softmax_shared_bytes(&self, experts: usize, top_k: usize) -> usize {
        self.warps_per_block as usize * (experts + 2 * top_k) * 4
    }

    /// grouped_topk, per block: each warp keeps E biased scores, the group scores and one bit per
    /// group.
    fn grouped_shared_bytes(&self, experts: usize, n_group: usize) -> usize {
        self.warps_per_block as usize * (experts + n_group + n_group.div_ceil(32)) * 4
    }

    /// One warp per row; at least one block, so that grouped_topk's bias check runs at M = 0.
    fn launch(&self, op: &'static str, rows: usize, shared_bytes: usize) -> Result<LaunchConfig> {
        let blocks = rows.div_ceil(self.warps_per_block as usize).max(1);
        let grid = u32::try_from(blocks)
            .map_err(|_| crate::Error::invalid(op, format!("{rows} rows exceed the grid limit")))?;
        Ok(LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (self.warps_per_block * 32, 1, 1),
            shared_mem_bytes: u32::try_from(shared_bytes)
                .map_err(|_| crate::Error::invalid(op, "shared memory size overflows u32"))?,
        })
    }
}

/// Every compiled variant: each kernel × logits dtype × experts-per-lane step up to the maximum E.
pub(crate) fn variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    for (family, source, entry) in [
        (TOPK_SOFTMAX, TOPK_SOFTMAX_SRC, TOPK_SOFTMAX_ENTRY),
        (GROUPED_TOPK, GROUPED_TOPK_SRC, GROUPED_TOPK_ENTRY),
    ] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let mut experts = 32;
            while experts <= MAX_EXPERTS {
                let defines = WarpPerRowConfig::new(dtype, experts)
                    .defines(family)
                    .expect("a logits dtype of the kernel");
                v.push(KernelVariant {
                    family,
                    source,
                    entry,
                    defines,
                });
                experts *= 2;
            }
        }
    }
    v
}

fn check_experts(op: &'static str, logits: &CudaStorage, experts: usize) -> Result<()> {
    if experts > MAX_EXPERTS {
        return Err(CoreError::Unsupported {
            op,
            device: logits.device(),
            reason: format!("the CUDA kernel handles at most {MAX_EXPERTS} experts, got {experts}"),
        }
        .into());
    }
    Ok(())
}

/// `n` device words of "no non-finite value seen" (`u64::MAX`, by a memset: nothing uploaded),
/// which a kernel lowers with `atomicMin`.
fn non_finite_flags(backend: &Arc<CudaBackend>, n: usize) -> Result<CudaStorage> {
    // Two u32 per u64; a fresh allocation is at least 256-byte aligned.
    let mut flags = CudaStorage::alloc(backend, DType::U32, 2 * n)?;
    flags.fill_bytes(0xFF)?;
    Ok(flags)
}

/// What a routing launch leaves on the device: weights f32 `[rows·k]`, ids u32 `[rows·k]`, and
/// the non-finite flags (u32 words: each u64 pair the lowest flat index of a NaN/Inf, `u64::MAX`
/// for none; `None` when nothing was launched).
pub(crate) struct Routed {
    pub weights: CudaStorage,
    pub ids: CudaStorage,
    pub flags: Option<CudaStorage>,
}

/// Launches the kernel; `flags` holds one u64: the logits'.
pub(crate) fn topk_softmax(args: &TopKSoftmaxArgs<'_>) -> Result<Routed> {
    const OP: &str = TOPK_SOFTMAX;
    let TopKSoftmaxArgs {
        logits,
        rows,
        experts,
        top_k,
        renormalize,
    } = *args;
    let backend = logits.backend();
    check_experts(OP, logits, experts)?;
    let n = rows * top_k;
    let mut weights = CudaStorage::alloc(backend, DType::F32, n)?;
    let mut ids = CudaStorage::alloc(backend, DType::U32, n)?;
    if rows == 0 {
        return Ok(Routed {
            weights,
            ids,
            flags: None,
        });
    }

    let cfg = WarpPerRowConfig::new(logits.dtype(), experts);
    let defines = cfg.defines(OP)?;
    let function = nvrtc::KernelCache::global().load(
        backend,
        &KernelSpec {
            family: TOPK_SOFTMAX,
            source: TOPK_SOFTMAX_SRC,
            entry: TOPK_SOFTMAX_ENTRY,
            defines: &defines,
        },
    )?;
    // ≤ 4 · (1024 + 2 · 1024) · 4 = 48 KiB by MAX_EXPERTS.
    let launch = cfg.launch(OP, rows, cfg.softmax_shared_bytes(experts, top_k))?;

    // Lowest flat index of a non-finite logit.
    let mut flags = non_finite_flags(backend, 1)?;
    let stream = backend.stream();
    // Kernel scalars; they must outlive the launch call (the driver copies them at launch).
    let rows_u64 = rows as u64;
    let experts_u32 = experts as u32;
    let top_k_u32 = top_k as u32;
    let renormalize_i32 = i32::from(renormalize);
    let w_buf = weights.buffer_mut()?;
    let id_buf = ids.buffer_mut()?;
    let flag_buf = flags.buffer_mut()?;
    let mut b = stream.launch_builder(&function);
    b.arg(logits.buffer())
        .arg(w_buf)
        .arg(id_buf)
        .arg(flag_buf)
        .arg(&rows_u64)
        .arg(&experts_u32)
        .arg(&top_k_u32)
        .arg(&renormalize_i32);
    // SAFETY: the arguments match `fmoe_topk_softmax`'s parameters in order and type (pointers,
    // u64, u32, u32, i32); `logits` holds rows·experts elements of the dtype compiled for (the
    // config is built from it), the outputs rows·top_k elements each, the flag one u64 (8 bytes);
    // the grid covers every row and the kernel writes every output element; all buffers live on
    // `stream`.
    unsafe { b.launch(launch) }.map_err(|e| cuda_error("topk_softmax: launch", e))?;
    Ok(Routed {
        weights,
        ids,
        flags: Some(flags),
    })
}

/// Launches the kernel; `flags` holds two u64: the logits' (words 0, 1), then the bias' (words
/// 2, 3).
pub(crate) fn grouped_topk(args: &GroupedTopKArgs<'_>) -> Result<Routed> {
    const OP: &str = GROUPED_TOPK;
    let GroupedTopKArgs {
        logits,
        bias,
        rows,
        experts,
        params: p,
    } = *args;
    let backend = logits.backend();
    check_experts(OP, logits, experts)?;
    let n = rows * p.top_k;
    let mut weights = CudaStorage::alloc(backend, DType::F32, n)?;
    let mut ids = CudaStorage::alloc(backend, DType::U32, n)?;

    let cfg = WarpPerRowConfig::new(logits.dtype(), experts);
    let defines = cfg.defines(OP)?;
    let function = nvrtc::KernelCache::global().load(
        backend,
        &KernelSpec {
            family: GROUPED_TOPK,
            source: GROUPED_TOPK_SRC,
            entry: GROUPED_TOPK_ENTRY,
            defines: &defines,
        },
    )?;
    // ≤ 4 · (1024 + 1024 + 32) · 4 = 33,280 bytes by MAX_EXPERTS (n_group ≤ E).
    let launch = cfg.launch(OP, rows, cfg.grouped_shared_bytes(experts, p.n_group))?;

    // [lowest flat index of a non-finite logit, lowest index of a non-finite bias entry].
    let mut flags = non_finite_flags(backend, 2)?;
    let stream = backend.stream();
    // Kernel scalars; they must outlive the launch call (the driver copies them at launch).
    let rows_u64 = rows as u64;
    let u32_of = |what: &str, v: usize| crate::launch::u32_arg(OP, what, v);
    let experts_u32 = u32_of("experts", experts)?;
    let n_group_u32 = u32_of("n_group", p.n_group)?;
    let topk_group_u32 = u32_of("topk_group", p.topk_group)?;
    let top_k_u32 = u32_of("top_k", p.top_k)?;
    let renormalize_i32 = i32::from(p.renormalize);
    let scaling = p.routed_scaling_factor;
    let w_buf = weights.buffer_mut()?;
    let id_buf = ids.buffer_mut()?;
    let flag_buf = flags.buffer_mut()?;
    let mut b = stream.launch_builder(&function);
    b.arg(logits.buffer())
        .arg(bias.buffer())
        .arg(w_buf)
        .arg(id_buf)
        .arg(flag_buf)
        .arg(&rows_u64)
        .arg(&experts_u32)
        .arg(&n_group_u32)
        .arg(&topk_group_u32)
        .arg(&top_k_u32)
        .arg(&renormalize_i32)
        .arg(&scaling);
    // SAFETY: the arguments match `fmoe_grouped_topk`'s parameters in order and type (pointers,
    // u64, u32 ×4, i32, f32); `logits` holds rows·experts elements of the dtype compiled for (the
    // config is built from it), `bias` experts f32 (checked by `super`), the outputs rows·top_k
    // elements each, the flags two u64 (16 bytes); n_group divides experts and top_k ≤
    // topk_group · experts / n_group (`super::check_groups`), so every row's k rounds find an
    // expert; the grid covers every row and the kernel writes every output element; all buffers
    // live on `stream`.
    unsafe { b.launch(launch) }.map_err(|e| cuda_error("grouped_topk: launch", e))?;
    Ok(Routed {
        weights,
        ids,
        flags: Some(flags),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_text_comes_from_named_fields() {
        let c = WarpPerRowConfig::new(DType::BF16, 256);
        assert_eq!(c.experts_per_lane, 8);
        assert_eq!(
            c.defines(TOPK_SOFTMAX).unwrap(),
            [
                ("FMOE_LOGITS_DTYPE", "1".to_string()),
                ("EXPERTS_PER_LANE", "8".to_string()),
                ("WARPS_PER_BLOCK", "4".to_string()),
            ]
        );
        for (e, per_lane) in [(1, 1), (8, 1), (32, 1), (33, 2), (64, 2), (65, 4), (160, 8)] {
            assert_eq!(
                WarpPerRowConfig::new(DType::F32, e).experts_per_lane,
                per_lane,
                "E={e}"
            );
        }
        assert_eq!(
            WarpPerRowConfig::new(DType::F32, MAX_EXPERTS).experts_per_lane,
            32
        );
        assert!(
            WarpPerRowConfig::new(DType::U32, 8)
                .defines(OP_ANY)
                .is_err()
        );
        let max = WarpPerRowConfig::new(DType::F32, MAX_EXPERTS);
        assert!(max.softmax_shared_bytes(MAX_EXPERTS, MAX_EXPERTS) <= 48 * 1024);
        assert!(max.grouped_shared_bytes(MAX_EXPERTS, MAX_EXPERTS) <= 48 * 1024);
    }

    const OP_ANY: &str = GROUPED_TOPK;

    #[test]
    fn launch_has_a_block_even_without_rows() {
        let c = WarpPerRowConfig::new(DType::F32, 256);
        assert_eq!(c.launch(OP_ANY, 0, 0).unwrap().grid_dim, (1, 1, 1));
        assert_eq!(c.launch(OP_ANY, 4, 0).unwrap().grid_dim, (1, 1, 1));
        assert_eq!(c.launch(OP_ANY, 5, 0).unwrap().grid_dim, (2, 1, 1));
        assert_eq!(c.launch(OP_ANY, 5, 0).unwrap().block_dim, (128, 1, 1));
    }

    #[test]
    fn both_kernels_have_a_variant_per_dtype_and_width() {
        let v = variants();
        for family in [TOPK_SOFTMAX, GROUPED_TOPK] {
            // 3 dtypes × experts-per-lane 1, 2, 4, 8, 16, 32.
            assert_eq!(
                v.iter().filter(|k| k.family == family).count(),
                18,
                "{family}"
            );
        }
    }
}
