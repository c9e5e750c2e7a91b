//! CUDA twin of `norm`: `cuda/norm.cu`, one block per row.

use fmoe_core::DType;
use fmoe_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaStorage, cuda_error};

use crate::Result;
use crate::catalog::KernelVariant;
use crate::elementwise::cuda::{code, dtype_code};
use crate::launch::{MAX_GRID_STRIDE_BLOCKS, u32_arg};
use crate::nvrtc;

const FAMILY: &str = "norm";
const SRC: &str = include_str!("../../cuda/norm.cu");
const THREADS: u32 = 256;
const ENTRIES: [&str; 2] = ["fmoe_rms_norm", "fmoe_add_rms_norm"];

pub(crate) fn variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    for d in super::DTYPES {
        for entry in ENTRIES {
            v.push(KernelVariant {
                family: FAMILY,
                source: SRC,
                entry,
                defines: vec![("DT", dtype_code(d).unwrap_or("0").to_string())],
            });
        }
    }
    v
}

fn config(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_GRID_STRIDE_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// 16-byte accesses when a row is a whole number of 16-byte words.
fn vec(dtype: DType, h: usize) -> u32 {
    u32::from((h * dtype.size_in_bytes()).is_multiple_of(16))
}

pub(super) fn rms_norm(
    op: &'static str,
    x: &CudaStorage,
    w: &CudaStorage,
    m: usize,
    h: usize,
    eps: f32,
) -> Result<CudaStorage> {
    let defines = [("DT", code(op, x, x.dtype())?.to_string())];
    let backend = x.backend();
    let mut y = CudaStorage::alloc(backend, x.dtype(), m * h)?;
    if m == 0 || h == 0 {
        return Ok(y);
    }
    let h32 = u32_arg(op, "H", h)?;
    let (rows, v) = (m as u64, vec(x.dtype(), h));
    let f = nvrtc::load(backend, FAMILY, SRC, "fmoe_rms_norm", &defines)?;
    let stream = backend.stream();
    let dst = y.buffer_mut()?;
    let mut l = stream.launch_builder(&f);
    l.arg(x.buffer())
        .arg(w.buffer())
        .arg(dst)
        .arg(&rows)
        .arg(&h32)
        .arg(&eps)
        .arg(&v);
    // SAFETY: (const T*, const T*, T*, u64, u32, float, u32) as declared, T compiled from x's dtype
    // (w has it too, checked by mod.rs); x and y hold m·h, w h elements; 16-byte accesses only
    // when h·sizeof(T) is a multiple of 16 (allocations are 256-byte aligned).
    unsafe { l.launch(config(m)) }.map_err(|e| cuda_error("norm::rms_norm launch", e))?;
    Ok(y)
}

pub(super) fn add_rms_norm(
    op: &'static str,
    r: &CudaStorage,
    x: &CudaStorage,
    w: &CudaStorage,
    m: usize,
    h: usize,
    eps: f32,
) -> Result<(CudaStorage, CudaStorage)> {
    let defines = [("DT", code(op, x, x.dtype())?.to_string())];
    let backend = x.backend();
    let mut r_out = CudaStorage::alloc(backend, x.dtype(), m * h)?;
    let mut y = CudaStorage::alloc(backend, x.dtype(), m * h)?;
    if m == 0 || h == 0 {
        return Ok((r_out, y));
    }
    let h32 = u32_arg(op, "H", h)?;
    let (rows, v) = (m as u64, vec(x.dtype(), h));
    let f = nvrtc::load(backend, FAMILY, SRC, "fmoe_add_rms_norm", &defines)?;
    let stream = backend.stream();
    let ro = r_out.buffer_mut()?;
    let dst = y.buffer_mut()?;
    let mut l = stream.launch_builder(&f);
    l.arg(r.buffer())
        .arg(x.buffer())
        .arg(w.buffer())
        .arg(ro)
        .arg(dst)
        .arg(&rows)
        .arg(&h32)
        .arg(&eps)
        .arg(&v);
    // SAFETY: (const T*, const T*, const T*, T*, T*, u64, u32, float, u32) as declared; r, x,
    // r_out and y hold m·h, w h elements of the compiled dtype (checked by mod.rs); 16-byte
    // accesses only when h·sizeof(T) is a multiple of 16.
    unsafe { l.launch(config(m)) }.map_err(|e| cuda_error("norm::add_rms_norm launch", e))?;
    Ok((r_out, y))
}
