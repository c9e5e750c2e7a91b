//! CUDA twin of the routing kernels: `cuda/topk_softmax.cu`, compiled by [`crate::nvrtc`].
//!
//! Callers (`super`) have validated shapes and parameters; finiteness is checked by the kernel
//! (a device flag read back after the launch).

use fmoe_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{DType, Error as CoreError};

use crate::Result;
use crate::catalog::KernelVariant;
use crate::nvrtc::{self, KernelSpec};

const TOPK_SOFTMAX: &str = "topk_softmax";
const TOPK_SOFTMAX_SRC: &str = include_str!("../../cuda/topk_softmax.cu");
const TOPK_SOFTMAX_ENTRY: &str = "fmoe_topk_softmax";

/// The most experts the kernel handles: 32 register slots per lane (its `taken` mask is 32 bits).
/// Also keeps the dynamic shared memory (4 warps × (E + 2k) floats) within the default 48 KiB.
pub(crate) const TOPK_SOFTMAX_MAX_EXPERTS: usize = 32 * 32;

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

/// What the kernel is compiled for: its `-D` defines come from these fields only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TopKSoftmaxConfig {
    logits_dtype: DType,
    /// `ceil(E / 32)` rounded up to a power of two: one compiled variant serves a range of E.
    experts_per_lane: u32,
    warps_per_block: u32,
}

impl TopKSoftmaxConfig {
    const WARPS_PER_BLOCK: u32 = 4;

    fn new(logits_dtype: DType, experts: usize) -> TopKSoftmaxConfig {
        let per_lane = experts.div_ceil(32).max(1).next_power_of_two();
        TopKSoftmaxConfig {
            logits_dtype,
            experts_per_lane: u32::try_from(per_lane).unwrap_or(u32::MAX),
            warps_per_block: Self::WARPS_PER_BLOCK,
        }
    }

    fn defines(&self) -> Result<Vec<(&'static str, String)>> {
        let dtype = match self.logits_dtype {
            DType::F32 => 0,
            DType::BF16 => 1,
            DType::F16 => 2,
            other => return Err(super::logits_dtype_error(TOPK_SOFTMAX, other)),
        };
        Ok(vec![
            ("FMOE_LOGITS_DTYPE", dtype.to_string()),
            ("EXPERTS_PER_LANE", self.experts_per_lane.to_string()),
            ("WARPS_PER_BLOCK", self.warps_per_block.to_string()),
        ])
    }

    /// Per block: each warp keeps E exps and the k selected (value, id) pairs.
    fn shared_mem_bytes(&self, experts: usize, top_k: usize) -> usize {
        self.warps_per_block as usize * (experts + 2 * top_k) * 4
    }
}

/// Every compiled variant: each logits dtype × each experts-per-lane step up to the maximum E.
pub(crate) fn variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let mut experts = 32;
        while experts <= TOPK_SOFTMAX_MAX_EXPERTS {
            let defines = TopKSoftmaxConfig::new(dtype, experts)
                .defines()
                .expect("a logits dtype of the kernel");
            v.push(KernelVariant {
                family: TOPK_SOFTMAX,
                source: TOPK_SOFTMAX_SRC,
                entry: TOPK_SOFTMAX_ENTRY,
                defines,
            });
            experts *= 2;
        }
    }
    v
}

/// Runs the kernel; returns (weights f32 `[rows·k]`, ids u32 `[rows·k]`) on the logits' device.
pub(crate) fn topk_softmax(args: &TopKSoftmaxArgs<'_>) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = TOPK_SOFTMAX;
    let TopKSoftmaxArgs {
        logits,
        rows,
        experts,
        top_k,
        renormalize,
    } = *args;
    let backend = logits.backend();
    if experts > TOPK_SOFTMAX_MAX_EXPERTS {
        return Err(CoreError::Unsupported {
            op: OP,
            device: logits.device(),
            reason: format!(
                "the CUDA kernel handles at most {TOPK_SOFTMAX_MAX_EXPERTS} experts, got {experts}"
            ),
        }
        .into());
    }
    let n = rows * top_k;
    let mut weights = CudaStorage::alloc(backend, DType::F32, n)?;
    let mut ids = CudaStorage::alloc(backend, DType::U32, n)?;
    if rows == 0 {
        return Ok((weights, ids));
    }

    let cfg = TopKSoftmaxConfig::new(logits.dtype(), experts);
    let defines = cfg.defines()?;
    let function = nvrtc::KernelCache::global().load(
        backend,
        &KernelSpec {
            family: TOPK_SOFTMAX,
            source: TOPK_SOFTMAX_SRC,
            entry: TOPK_SOFTMAX_ENTRY,
            defines: &defines,
        },
    )?;
    let grid = u32::try_from(rows.div_ceil(cfg.warps_per_block as usize))
        .map_err(|_| crate::Error::invalid(OP, format!("{rows} rows exceed the grid limit")))?;
    let launch = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (cfg.warps_per_block * 32, 1, 1),
        // ≤ 4 · (1024 + 2 · 1024) · 4 = 48 KiB by TOPK_SOFTMAX_MAX_EXPERTS.
        shared_mem_bytes: u32::try_from(cfg.shared_mem_bytes(experts, top_k))
            .map_err(|_| crate::Error::invalid(OP, "shared memory size overflows u32"))?,
    };

    let stream = backend.stream();
    // Lowest flat index of a non-finite logit; u64::MAX = none.
    let mut bad_index = stream
        .clone_htod(&[u64::MAX])
        .map_err(|e| cuda_error("topk_softmax: flag upload", e))?;
    // Kernel scalars; they must outlive the launch call (the driver copies them at launch).
    let rows_u64 = rows as u64;
    let experts_u32 = experts as u32;
    let top_k_u32 = top_k as u32;
    let renormalize_i32 = i32::from(renormalize);
    let w_buf = weights.buffer_mut()?;
    let id_buf = ids.buffer_mut()?;
    let mut b = stream.launch_builder(&function);
    b.arg(logits.buffer())
        .arg(w_buf)
        .arg(id_buf)
        .arg(&mut bad_index)
        .arg(&rows_u64)
        .arg(&experts_u32)
        .arg(&top_k_u32)
        .arg(&renormalize_i32);
    // SAFETY: the arguments match `fmoe_topk_softmax`'s parameters in order and type (pointers,
    // u64, u32, u32, i32); `logits` holds rows·experts elements of the dtype compiled for (the
    // config is built from it), the outputs rows·top_k elements each; the grid covers every row
    // and the kernel writes every output element; all buffers live on `stream`.
    unsafe { b.launch(launch) }.map_err(|e| cuda_error("topk_softmax: launch", e))?;

    // The download waits for the kernel: this call synchronizes with the host once.
    let bad = stream
        .clone_dtoh(&bad_index)
        .map_err(|e| cuda_error("topk_softmax: flag download", e))?;
    if let Some(&index) = bad.first().filter(|&&i| i != u64::MAX) {
        let index = usize::try_from(index).unwrap_or(usize::MAX);
        let value = logits
            .copy_range(index..index.saturating_add(1))?
            .to_cpu()
            .map(|c| first_f32(&c))?;
        return Err(super::non_finite(OP, super::LOGITS, index, value));
    }
    Ok((weights, ids))
}

fn first_f32(c: &fmoe_core::CpuStorage) -> f32 {
    use fmoe_core::{CpuStorage, WithDType};
    match c {
        CpuStorage::F32(v) => v.first().copied(),
        CpuStorage::BF16(v) => v.first().map(|x| x.to_f32()),
        CpuStorage::F16(v) => v.first().map(|x| x.to_f32()),
        CpuStorage::F8E4M3(v) => v.first().map(|x| x.to_f32()),
        CpuStorage::U32(v) => v.first().map(|x| x.to_f32()),
    }
    .unwrap_or(f32::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_text_comes_from_named_fields() {
        let c = TopKSoftmaxConfig::new(DType::BF16, 256);
        assert_eq!(c.experts_per_lane, 8);
        assert_eq!(
            c.defines().unwrap(),
            [
                ("FMOE_LOGITS_DTYPE", "1".to_string()),
                ("EXPERTS_PER_LANE", "8".to_string()),
                ("WARPS_PER_BLOCK", "4".to_string()),
            ]
        );
        for (e, per_lane) in [(1, 1), (8, 1), (32, 1), (33, 2), (64, 2), (65, 4), (160, 8)] {
            assert_eq!(
                TopKSoftmaxConfig::new(DType::F32, e).experts_per_lane,
                per_lane,
                "E={e}"
            );
        }
        assert_eq!(
            TopKSoftmaxConfig::new(DType::F32, TOPK_SOFTMAX_MAX_EXPERTS).experts_per_lane,
            32
        );
        assert!(TopKSoftmaxConfig::new(DType::U32, 8).defines().is_err());
        let max = TopKSoftmaxConfig::new(DType::F32, TOPK_SOFTMAX_MAX_EXPERTS);
        assert!(
            max.shared_mem_bytes(TOPK_SOFTMAX_MAX_EXPERTS, TOPK_SOFTMAX_MAX_EXPERTS) <= 48 * 1024
        );
    }
}
