//! CUDA twin of `rotary`: `cuda/rotary.cu`, one block per token row.

use fmoe_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{DType, Tensor};

use super::{Geometry, RotaryStyle};
use crate::Result;
use crate::catalog::KernelVariant;
use crate::elementwise::cuda::{code, dtype_code};
use crate::launch::{MAX_GRID_STRIDE_BLOCKS, cuda_storage, u32_arg};
use crate::nvrtc;

const FAMILY: &str = "rotary";
const SRC: &str = include_str!("../../cuda/rotary.cu");
const THREADS: u32 = 256;

pub(crate) fn variants() -> Vec<KernelVariant> {
    [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .map(|d| KernelVariant {
            family: FAMILY,
            source: SRC,
            entry: "fmoe_rotary",
            defines: vec![("DT", dtype_code(d).unwrap_or("0").to_string())],
        })
        .collect()
}

pub(super) fn apply(
    op: &'static str,
    x: &CudaStorage,
    cos: &Tensor,
    sin: &Tensor,
    g: &Geometry,
) -> Result<CudaStorage> {
    let defines = [("DT", code(op, x, x.dtype())?.to_string())];
    let backend = x.backend();
    let mut y = CudaStorage::alloc(backend, x.dtype(), x.len())?;
    if g.tokens == 0 || x.is_empty() {
        return Ok(y);
    }
    let c = cuda_storage(op, "cos", cos, x.device())?;
    let s = cuda_storage(op, "sin", sin, x.device())?;
    let heads = u32_arg(op, "heads", g.heads)?;
    let head_dim = u32_arg(op, "head_dim", g.head_dim)?;
    u32_arg(op, "heads·head_dim", g.heads * g.head_dim)?;
    let rot_offset = u32_arg(op, "rot_offset", g.rot_offset)?;
    let rot_dim = u32_arg(op, "rot_dim", g.rot_dim)?;
    let interleaved = u32::from(g.style == RotaryStyle::Interleaved);
    let tokens = g.tokens as u64;
    let f = nvrtc::load(backend, FAMILY, SRC, "fmoe_rotary", &defines)?;
    let stream = backend.stream();
    let dst = y.buffer_mut()?;
    let mut l = stream.launch_builder(&f);
    l.arg(x.buffer())
        .arg(c.buffer())
        .arg(s.buffer())
        .arg(dst)
        .arg(&tokens)
        .arg(&heads)
        .arg(&head_dim)
        .arg(&rot_offset)
        .arg(&rot_dim)
        .arg(&interleaved);
    let cfg = LaunchConfig {
        grid_dim: (g.tokens.min(MAX_GRID_STRIDE_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: (const T*, const float*, const float*, T*, u64, u32 × 5) as declared, T compiled
    // from x's dtype; x and y hold tokens·heads·head_dim elements, cos and sin tokens·rot_dim/2
    // f32 (checked by mod.rs); rot_offset + rot_dim <= head_dim, so every index stays in its row.
    unsafe { l.launch(cfg) }.map_err(|e| cuda_error("rotary::apply_rotary launch", e))?;
    Ok(y)
}
