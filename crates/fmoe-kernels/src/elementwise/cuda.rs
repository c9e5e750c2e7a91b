//! CUDA twin of `elementwise`: `cuda/elementwise.cu`, compiled by [`crate::nvrtc`].

use std::sync::Arc;

use fmoe_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaBackend, CudaStorage, cuda_error};
use fmoe_core::{DType, Error as CoreError};

use crate::Result;
use crate::catalog::KernelVariant;
use crate::launch::{ELEMENTWISE_THREADS, MAX_GRID_STRIDE_BLOCKS, grid_stride_blocks};
use crate::nvrtc;

const FAMILY: &str = "elementwise";
const SRC: &str = include_str!("../../cuda/elementwise.cu");

/// The kernel's dtype code (`-D SRC_DT/DST_DT/DT`), if it has one.
pub(crate) fn dtype_code(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("0"),
        DType::BF16 => Some("1"),
        DType::F16 => Some("2"),
        _ => None,
    }
}

/// [`dtype_code`], or `Unsupported` naming what is missing.
pub(crate) fn code(op: &'static str, s: &CudaStorage, dtype: DType) -> Result<&'static str> {
    dtype_code(dtype).ok_or_else(|| {
        CoreError::Unsupported {
            op,
            device: s.device(),
            reason: format!("no CUDA elementwise kernel for {dtype} (f32, bf16 and f16 only)"),
        }
        .into()
    })
}

/// Every variant: casts between the kernel dtypes, add, randn, silu_mul and rand_uniform per
/// dtype, the bf16 sum, the e4m3 rand_uniform; the PDL builds (`-D PDL=1`) of the casts and of the
/// zero fill, which exists only there.
pub(crate) fn variants() -> Vec<KernelVariant> {
    let codes: Vec<&'static str> = super::FLOATS
        .iter()
        .filter_map(|&d| dtype_code(d))
        .collect();
    let variant = |entry, defines| KernelVariant {
        family: FAMILY,
        source: SRC,
        entry,
        defines,
    };
    let mut v = Vec::new();
    for &s in &codes {
        for &d in &codes {
            v.push(variant(
                "fmoe_cast",
                vec![("SRC_DT", s.to_string()), ("DST_DT", d.to_string())],
            ));
        }
    }
    for &c in &codes {
        v.push(variant("fmoe_add", vec![("DT", c.to_string())]));
        v.push(variant("fmoe_randn", vec![("DT", c.to_string())]));
        v.push(variant("fmoe_silu_mul", vec![("DT", c.to_string())]));
        v.push(variant("fmoe_rand_uniform", vec![("DT", c.to_string())]));
    }
    v.push(variant("fmoe_sum_bf16", Vec::new()));
    v.push(variant("fmoe_rand_uniform_e4m3", Vec::new()));
    let casts: Vec<KernelVariant> = v
        .iter()
        .filter(|k| k.entry == "fmoe_cast")
        .map(crate::catalog::pdl_build)
        .collect();
    v.extend(casts);
    v.push(variant(
        "fmoe_zero_words",
        vec![crate::launch::pdl_define()],
    ));
    v
}

fn launch_1d(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid_stride_blocks(n, ELEMENTWISE_THREADS as usize), 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn cast(op: &'static str, src: &CudaStorage, dtype: DType) -> Result<CudaStorage> {
    let defines = [
        ("SRC_DT", code(op, src, src.dtype())?.to_string()),
        ("DST_DT", code(op, src, dtype)?.to_string()),
    ];
    let backend = src.backend();
    let mut out = CudaStorage::alloc(backend, dtype, src.len())?;
    let n = src.len();
    if n == 0 {
        return Ok(out);
    }
    let (f, pdl) = crate::launch::load_chain(backend, FAMILY, SRC, "fmoe_cast", &defines)?;
    let n64 = n as u64;
    let dst = out.buffer_mut()?;
    let mut b = crate::launch::PdlLaunch::new(backend, &f, pdl);
    b.arg(src.buffer()).arg(dst).arg(&n64);
    // SAFETY: (const SRC*, DST*, u64) as declared, the dtypes compiled from the buffers' own; both
    // hold n elements; the grid-stride loop stays below n.
    unsafe { b.launch(launch_1d(n)) }.map_err(|e| cuda_error("elementwise::cast launch", e))?;
    Ok(out)
}

pub(super) fn add(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<CudaStorage> {
    let defines = [("DT", code(op, a, a.dtype())?.to_string())];
    let backend = a.backend();
    let n = a.len();
    let mut out = CudaStorage::alloc(backend, a.dtype(), n)?;
    if n == 0 {
        return Ok(out);
    }
    let f = nvrtc::load(backend, FAMILY, SRC, "fmoe_add", &defines)?;
    let n64 = n as u64;
    let stream = backend.stream();
    let dst = out.buffer_mut()?;
    let mut l = stream.launch_builder(&f);
    l.arg(a.buffer()).arg(b.buffer()).arg(dst).arg(&n64);
    // SAFETY: (const T*, const T*, T*, u64); the caller checked that a and b have the same dtype
    // (compiled as DT) and length n; out holds n elements.
    unsafe { l.launch(launch_1d(n)) }.map_err(|e| cuda_error("elementwise::add launch", e))?;
    Ok(out)
}

pub(super) fn randn(
    op: &'static str,
    backend: &Arc<CudaBackend>,
    dtype: DType,
    n: usize,
    scale: f32,
    seed: u64,
) -> Result<CudaStorage> {
    let mut out = CudaStorage::alloc(backend, dtype, n)?;
    let defines = [("DT", code(op, &out, dtype)?.to_string())];
    if n == 0 {
        return Ok(out);
    }
    let f = nvrtc::load(backend, FAMILY, SRC, "fmoe_randn", &defines)?;
    let n64 = n as u64;
    let stream = backend.stream();
    let dst = out.buffer_mut()?;
    let mut l = stream.launch_builder(&f);
    l.arg(dst).arg(&n64).arg(&seed).arg(&scale);
    // SAFETY: (T*, u64, u64, float) as declared; out holds n elements of the compiled dtype.
    unsafe { l.launch(launch_1d(n)) }.map_err(|e| cuda_error("elementwise::randn launch", e))?;
    Ok(out)
}

pub(super) fn sum(op: &'static str, x: &CudaStorage) -> Result<CudaStorage> {
    if x.dtype() != DType::BF16 {
        return Err(CoreError::Unsupported {
            op,
            device: x.device(),
            reason: format!("the CUDA sum kernel reads bf16, not {}", x.dtype()),
        }
        .into());
    }
    let backend = x.backend();
    let mut out = CudaStorage::zeros(backend, DType::F32, 1)?;
    let n = x.len();
    if n == 0 {
        return Ok(out);
    }
    let f = nvrtc::load(backend, FAMILY, SRC, "fmoe_sum_bf16", &[])?;
    let n64 = n as u64;
    let stream = backend.stream();
    let dst = out.buffer_mut()?;
    let mut l = stream.launch_builder(&f);
    l.arg(x.buffer()).arg(&n64).arg(dst);
    // SAFETY: (const bf16*, u64, float*); x holds n bf16 (its allocation is 256-byte aligned, so
    // the 16-byte loads of the first n/8 chunks are aligned and in bounds); out holds one f32,
    // zeroed above.
    unsafe { l.launch(launch_1d(n / 8)) }.map_err(|e| cuda_error("elementwise::sum launch", e))?;
    Ok(out)
}

pub(super) fn silu_mul(
    op: &'static str,
    x: &CudaStorage,
    rows: usize,
    inner: usize,
) -> Result<CudaStorage> {
    let defines = [("DT", code(op, x, x.dtype())?.to_string())];
    let backend = x.backend();
    let mut out = CudaStorage::alloc(backend, x.dtype(), rows * inner)?;
    if rows == 0 || inner == 0 {
        return Ok(out);
    }
    let f = nvrtc::load(backend, FAMILY, SRC, "fmoe_silu_mul", &defines)?;
    let vec = u32::from((inner * x.dtype().size_in_bytes()).is_multiple_of(16));
    let (rows64, inner64) = (rows as u64, inner as u64);
    let stream = backend.stream();
    let dst = out.buffer_mut()?;
    let mut l = stream.launch_builder(&f);
    l.arg(x.buffer())
        .arg(dst)
        .arg(&rows64)
        .arg(&inner64)
        .arg(&vec);
    let cfg = LaunchConfig {
        grid_dim: (rows.min(MAX_GRID_STRIDE_BLOCKS) as u32, 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: (const T*, T*, u64, u64, u32) as declared, T compiled from x's dtype; x holds
    // rows·2·inner and out rows·inner elements; `vec` only when every row half is a whole number
    // of 16-byte words (allocations are 256-byte aligned).
    unsafe { l.launch(cfg) }.map_err(|e| cuda_error("elementwise::silu_mul launch", e))?;
    Ok(out)
}

pub(super) fn rand_uniform(
    op: &'static str,
    backend: &Arc<CudaBackend>,
    dtype: DType,
    n: usize,
    [scale, offset]: [f32; 2],
    seed: u64,
) -> Result<CudaStorage> {
    let mut out = CudaStorage::alloc(backend, dtype, n)?;
    let (entry, defines) = if dtype == DType::F8E4M3 {
        ("fmoe_rand_uniform_e4m3", Vec::new())
    } else {
        (
            "fmoe_rand_uniform",
            vec![("DT", code(op, &out, dtype)?.to_string())],
        )
    };
    if n == 0 {
        return Ok(out);
    }
    let f = nvrtc::load(backend, FAMILY, SRC, entry, &defines)?;
    let n64 = n as u64;
    let stream = backend.stream();
    let dst = out.buffer_mut()?;
    let mut l = stream.launch_builder(&f);
    l.arg(dst).arg(&n64).arg(&seed).arg(&scale).arg(&offset);
    // SAFETY: (T*, u64, u64, float, float) as declared, T the compiled dtype (one byte for the
    // e4m3 entry); out holds n elements of it.
    unsafe { l.launch(launch_1d(n)) }
        .map_err(|e| cuda_error("elementwise::rand_uniform launch", e))?;
    Ok(out)
}

/// A zeroed buffer of `len` elements of a 4-byte `dtype` for the MoE layer's kernel chain: in a
/// chain that uses Programmatic Dependent Launch (`crate::PdlChain`) a zero-fill kernel launched
/// with it, so the chain's kernels stay adjacent on the stream (a memset between them would serialize
/// the next launch); otherwise, or for other dtypes, a stream-ordered memset.
pub(crate) fn zeros_chain(
    op: &'static str,
    backend: &Arc<CudaBackend>,
    dtype: DType,
    len: usize,
) -> Result<CudaStorage> {
    if dtype.size_in_bytes() != 4 || len == 0 || !crate::PdlChain::active() {
        return Ok(CudaStorage::zeros(backend, dtype, len)?);
    }
    let mut out = CudaStorage::alloc(backend, dtype, len)?;
    // The kernel exists only in the PDL build.
    let f = nvrtc::load(
        backend,
        FAMILY,
        SRC,
        "fmoe_zero_words",
        &[crate::launch::pdl_define()],
    )?;
    let n64 = len as u64;
    let dst = out.buffer_mut()?;
    let mut b = crate::launch::PdlLaunch::new(backend, &f, true);
    b.arg(dst).arg(&n64);
    // SAFETY: (u32*, u64) as declared; out holds len 4-byte elements; the grid-stride loop stays
    // below len.
    unsafe { b.launch(launch_1d(len)) }.map_err(|e| cuda_error(op, e))?;
    Ok(out)
}
