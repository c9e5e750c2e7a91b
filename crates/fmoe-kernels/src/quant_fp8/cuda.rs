//! CUDA twin of `quant_fp8`: `cuda/quant_fp8.cu`, bit for bit the CPU twin's arithmetic (scale =
//! `max(amax, 1e-10) / 448` by IEEE division, codes = `sat_rne(x / scale)`).
//!
//! Input dtypes: bf16 (the default build of the source) and f32 (`-D QUANT_IN_F32=1`); f16 is
//! [`fmoe_core::Error::Unsupported`]. A NaN or ±Inf sets a device error flag instead of failing
//! the call (that would need a synchronization); the flag comes back inside a
//! [`super::FiniteCheck`].
//!
//! Launch recipes (those of `bench/gpu/moe_fp8_cupy.py`, which ran these kernels on an H200):
//! - `fmoe_fp8_amax` / `fmoe_fp8_quant_tensor`: 256 threads, grid `min(ceil(n / (VEC·256)),
//!   8·SMs)` (VEC = 8 bf16 or 4 f32 per 16-byte load), the amax word zeroed before; up to
//!   [`SMALL_TENSOR`] elements `fmoe_fp8_quant_tensor_small` instead: one block of 1024 threads,
//!   one launch in place of three (zeroing, amax, cast) for decode-sized activations;
//! - `fmoe_fp8_quant_group`: one warp per 1×128 group, 256 threads, grid
//!   `ceil(rows·ceil(k/128) / 8)`;
//! - `fmoe_fp8_quant_block`: 256 threads per 128×128 block, grid `(ceil(C/128), ceil(R/128),
//!   matrices)`.
//!
//! Every buffer comes from the stream-ordered pool, 256-byte aligned (the 16-byte loads and the
//! 8-byte code stores of the per-tensor kernels need 16).

use fmoe_core::cuda::cudarc::driver::{CudaFunction, CudaView, LaunchConfig};
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{DType, Error as CoreError};

use crate::catalog::KernelVariant;
use crate::launch::u32_arg;
use crate::{Error, Result};

const FAMILY: &str = "quant_fp8";
const SRC: &str = include_str!("../../cuda/quant_fp8.cu");
/// Threads per block of every quantization kernel.
const THREADS: u32 = 256;
/// The group width `fmoe_fp8_quant_group` is written for.
pub(crate) const GROUP: usize = 128;
/// The block `fmoe_fp8_quant_block` is written for.
pub(crate) const BLOCK: [usize; 2] = [128, 128];
const GRID_LIMIT: usize = 65_535;

/// Largest x that dynamic per-tensor quantization handles in one block (64 elements per thread
/// of 1024: a 16-token Mixtral or a 9-token DeepSeek-V3 batch).
pub(crate) const SMALL_TENSOR: usize = 64 * 1024;
/// Threads of `fmoe_fp8_quant_tensor_small`'s one block.
const SMALL_THREADS: u32 = 1024;

/// The input dtypes the kernels are built for.
const INPUT_DTYPES: [DType; 2] = [DType::BF16, DType::F32];
/// The entry points of the source.
const ENTRIES: [&str; 6] = [
    "fmoe_fp8_amax",
    "fmoe_fp8_quant_tensor",
    "fmoe_fp8_quant_tensor_small",
    "fmoe_fp8_quant_tensor_static",
    "fmoe_fp8_quant_group",
    "fmoe_fp8_quant_block",
];

/// `-D` defines for input of `dtype`, if the kernels take it.
fn dtype_defines(dtype: DType) -> Option<Vec<(&'static str, String)>> {
    match dtype {
        DType::BF16 => Some(Vec::new()),
        DType::F32 => Some(vec![("QUANT_IN_F32", "1".to_string())]),
        _ => None,
    }
}

/// `-D` defines for the input dtype, or `Unsupported` naming it.
fn input_defines(op: &'static str, x: &CudaStorage) -> Result<Vec<(&'static str, String)>> {
    dtype_defines(x.dtype()).ok_or_else(|| {
        CoreError::Unsupported {
            op,
            device: x.device(),
            reason: format!(
                "no CUDA quantization kernel for {} input (bf16 and f32 only; the CPU takes f16 \
                 too)",
                x.dtype()
            ),
        }
        .into()
    })
}

/// Every entry point for every input dtype.
pub(crate) fn variants() -> Vec<KernelVariant> {
    INPUT_DTYPES
        .into_iter()
        .filter_map(dtype_defines)
        .flat_map(|defines| {
            ENTRIES.map(|entry| KernelVariant {
                family: FAMILY,
                source: SRC,
                entry,
                defines: defines.clone(),
            })
        })
        .collect()
}

/// The entry `entry` of the source, compiled for x's dtype (and the MoE chain's PDL choice,
/// returned for `PdlLaunch`).
fn kernel(op: &'static str, x: &CudaStorage, entry: &str) -> Result<(CudaFunction, bool)> {
    crate::launch::load_chain(x.backend(), FAMILY, SRC, entry, &input_defines(op, x)?)
}

/// Grid of the grid-stride per-tensor kernels: `min(ceil(n / (VEC·256)), 8·SMs)`, at least 1.
fn tensor_grid(x: &CudaStorage, n: usize) -> u32 {
    let vec = if x.dtype() == DType::F32 { 4 } else { 8 };
    let sms = x.backend().multiprocessor_count() as usize;
    n.div_ceil(vec * THREADS as usize).clamp(1, 8 * sms.max(1)) as u32
}

fn launch_1d(blocks: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `atomicMax`es the bits of max |x[0..n)| into the u32 at `amax` (zeroed by the caller).
pub(crate) fn amax_into(
    op: &'static str,
    x: &CudaStorage,
    n: usize,
    amax: &CudaView<'_, u8>,
) -> Result<()> {
    let backend = x.backend();
    let (f, pdl) = kernel(op, x, "fmoe_fp8_amax")?;
    let n64 = n as u64;
    let mut b = crate::launch::PdlLaunch::new(backend, &f, pdl);
    b.arg(x.buffer()).arg(&n64).arg(amax);
    // SAFETY: (const in_t*, u64, u32*) as declared, in_t compiled from x's dtype; x holds at least
    // n elements in a 256-byte aligned allocation (the kernel's 16-byte loads cover the first
    // n / VEC chunks, scalar loads the rest); `amax` is 4 bytes of a live allocation.
    unsafe { b.launch(launch_1d(tensor_grid(x, n))) }
        .map_err(|e| cuda_error("quant_fp8: amax launch", e))?;
    Ok(())
}

/// `q = sat_rne(x / s)` with `s = max(amax, 1e-10) / 448` from the u32 bits at `amax`; writes s
/// to `scale` (f32 [1]) and sets the u32 at `flag` when the amax is not finite.
pub(crate) fn cast_with_amax(
    op: &'static str,
    x: &CudaStorage,
    n: usize,
    amax: &CudaView<'_, u8>,
    q: &mut CudaStorage,
    scale: &mut CudaStorage,
    flag: &CudaView<'_, u8>,
) -> Result<()> {
    let backend = x.backend();
    let (f, pdl) = kernel(op, x, "fmoe_fp8_quant_tensor")?;
    let n64 = n as u64;
    let mut b = crate::launch::PdlLaunch::new(backend, &f, pdl);
    b.arg(x.buffer())
        .arg(&n64)
        .arg(amax)
        .arg(q.buffer_mut()?)
        .arg(scale.buffer_mut()?)
        .arg(flag);
    // SAFETY: (const in_t*, u64, const u32*, u8*, float*, u32*) as declared; x holds n elements of
    // the compiled dtype, q n bytes, scale one f32, all 256-byte aligned (16-byte loads, 8- or
    // 4-byte code stores); amax and flag are 4 bytes each of a live allocation.
    unsafe { b.launch(launch_1d(tensor_grid(x, n))) }
        .map_err(|e| cuda_error("quant_fp8: quant_tensor launch", e))?;
    Ok(())
}

/// `q = sat_rne(x / s)` with the f32 scale s at `scale` (a static input_scale, never read by
/// the host); sets the u32 at `flag` when any element is not finite.
pub(crate) fn cast_with_scale(
    op: &'static str,
    x: &CudaStorage,
    n: usize,
    scale: &CudaStorage,
    q: &mut CudaStorage,
    flag: &CudaView<'_, u8>,
) -> Result<()> {
    let backend = x.backend();
    let (f, pdl) = kernel(op, x, "fmoe_fp8_quant_tensor_static")?;
    if scale.dtype() != DType::F32 || scale.len() != 1 {
        return Err(Error::invalid(
            op,
            format!(
                "the static scale must be one f32, got {} {}",
                scale.len(),
                scale.dtype()
            ),
        ));
    }
    let n64 = n as u64;
    let mut b = crate::launch::PdlLaunch::new(backend, &f, pdl);
    b.arg(x.buffer())
        .arg(&n64)
        .arg(scale.buffer())
        .arg(q.buffer_mut()?)
        .arg(flag);
    // SAFETY: (const in_t*, u64, const float*, u8*, u32*) as declared; x holds n elements of the
    // compiled dtype, q n bytes, both 256-byte aligned (16-byte loads, 8- or 4-byte code stores);
    // scale is one f32 (checked above), flag 4 bytes of a live allocation.
    unsafe { b.launch(launch_1d(tensor_grid(x, n))) }
        .map_err(|e| cuda_error("quant_fp8: quant_tensor_static launch", e))?;
    Ok(())
}

/// Amax and cast of x[0..n) in one block ([`SMALL_TENSOR`] elements at most): writes the codes to
/// `q`, the scale to `scale` (f32 [1]) and both control words (amax bits, error flag) to `ctrl`
/// (u32 [2], need not be zeroed).
fn quant_tensor_small(
    op: &'static str,
    x: &CudaStorage,
    n: usize,
    ctrl: &mut CudaStorage,
    q: &mut CudaStorage,
    scale: &mut CudaStorage,
) -> Result<()> {
    let (f, pdl) = kernel(op, x, "fmoe_fp8_quant_tensor_small")?;
    let n64 = n as u64;
    let mut b = crate::launch::PdlLaunch::new(x.backend(), &f, pdl);
    b.arg(x.buffer())
        .arg(&n64)
        .arg(ctrl.buffer_mut()?)
        .arg(q.buffer_mut()?)
        .arg(scale.buffer_mut()?);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (SMALL_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: (const in_t*, u64, u32*, u8*, float*) as declared, in_t compiled from x's
    // dtype; x holds n elements, q n bytes, ctrl two u32, scale one f32, all 256-byte aligned
    // (16-byte loads, 8- or 4-byte code stores); one block of the 1024 threads the kernel's
    // launch bounds name.
    unsafe { b.launch(cfg) }.map_err(|e| cuda_error("quant_fp8: quant_tensor_small launch", e))?;
    Ok(())
}

/// Static per-tensor quantization of `x` (all its elements) with the device scale `scale` (f32
/// [1]): (q u8 codes, error flag u32 [1]).
pub(crate) fn per_tensor_static(
    op: &'static str,
    x: &CudaStorage,
    scale: &CudaStorage,
) -> Result<(CudaStorage, CudaStorage)> {
    input_defines(op, x)?;
    let backend = x.backend();
    let n = x.len();
    let flag =
        crate::elementwise::cuda::zeros_chain("moe chain: zero fill", backend, DType::U32, 1)?;
    let mut q = CudaStorage::alloc(backend, DType::F8E4M3, n)?;
    {
        let word = flag.buffer().slice(0..4);
        cast_with_scale(op, x, n, scale, &mut q, &word)?;
    }
    Ok((q, flag))
}

/// Dynamic per-tensor quantization of `x` (all its elements): (q u8 codes, scale f32 [1],
/// control words u32 [2] = amax bits and the error flag).
pub(crate) fn per_tensor(
    op: &'static str,
    x: &CudaStorage,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    input_defines(op, x)?;
    let backend = x.backend();
    let n = x.len();
    let mut q = CudaStorage::alloc(backend, DType::F8E4M3, n)?;
    let mut scale = CudaStorage::alloc(backend, DType::F32, 1)?;
    if n <= SMALL_TENSOR {
        let mut ctrl = CudaStorage::alloc(backend, DType::U32, 2)?;
        quant_tensor_small(op, x, n, &mut ctrl, &mut q, &mut scale)?;
        return Ok((q, scale, ctrl));
    }
    let ctrl =
        crate::elementwise::cuda::zeros_chain("moe chain: zero fill", backend, DType::U32, 2)?;
    {
        let (amax, flag) = (ctrl.buffer().slice(0..4), ctrl.buffer().slice(4..8));
        amax_into(op, x, n, &amax)?;
        cast_with_amax(op, x, n, &amax, &mut q, &mut scale, &flag)?;
    }
    Ok((q, scale, ctrl))
}

/// Dynamic 1×128 group quantization of `x` [rows, k]: (q [rows, k], scales f32
/// [rows, ceil(k/128)], error flag u32 [1]).
pub(crate) fn per_group(
    op: &'static str,
    x: &CudaStorage,
    rows: usize,
    k: usize,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let defines = input_defines(op, x)?;
    let backend = x.backend();
    let groups = k.div_ceil(GROUP);
    let mut flag =
        crate::elementwise::cuda::zeros_chain("moe chain: zero fill", backend, DType::U32, 1)?;
    let mut q = CudaStorage::alloc(backend, DType::F8E4M3, rows * k)?;
    let mut scales = CudaStorage::alloc(backend, DType::F32, rows * groups)?;
    let total = rows * groups;
    if total == 0 {
        return Ok((q, scales, flag));
    }
    let rows32 = u32_arg(op, "rows", rows)?;
    let k32 = u32_arg(op, "k", k)?;
    let blocks = u32_arg(op, "quantization blocks", total.div_ceil(8))?;
    let (f, pdl) =
        crate::launch::load_chain(backend, FAMILY, SRC, "fmoe_fp8_quant_group", &defines)?;
    let mut b = crate::launch::PdlLaunch::new(backend, &f, pdl);
    b.arg(x.buffer())
        .arg(&rows32)
        .arg(&k32)
        .arg(q.buffer_mut()?)
        .arg(scales.buffer_mut()?)
        .arg(flag.buffer_mut()?);
    // SAFETY: (const in_t*, u32, u32, u8*, float*, u32*) as declared; x holds rows·k elements of the
    // compiled dtype, q rows·k bytes, scales rows·ceil(k/128) f32, flag one u32; 8 warps per
    // block, one per group, and warps past the last group return.
    unsafe { b.launch(launch_1d(blocks)) }
        .map_err(|e| cuda_error("quant_fp8: quant_group launch", e))?;
    Ok((q, scales, flag))
}

/// Dynamic 128×128 block quantization of `mats` row-major `rows × cols` matrices: (q, scale_inv
/// f32 [mats, ceil(rows/128), ceil(cols/128)], error flag u32 [1]).
pub(crate) fn per_block(
    op: &'static str,
    x: &CudaStorage,
    mats: usize,
    rows: usize,
    cols: usize,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let defines = input_defines(op, x)?;
    let backend = x.backend();
    let (rb, cb) = (rows.div_ceil(BLOCK[0]), cols.div_ceil(BLOCK[1]));
    let mut flag =
        crate::elementwise::cuda::zeros_chain("moe chain: zero fill", backend, DType::U32, 1)?;
    let mut q = CudaStorage::alloc(backend, DType::F8E4M3, mats * rows * cols)?;
    let mut scale_inv = CudaStorage::alloc(backend, DType::F32, mats * rb * cb)?;
    if mats * rows * cols == 0 {
        return Ok((q, scale_inv, flag));
    }
    if rb > GRID_LIMIT || mats > GRID_LIMIT {
        return Err(Error::invalid(
            op,
            format!(
                "{mats} matrices of {rows} rows need a grid of ({cb}, {rb}, {mats}) blocks; the \
                 CUDA kernel takes at most {GRID_LIMIT} in y and z"
            ),
        ));
    }
    let rows32 = u32_arg(op, "rows", rows)?;
    let cols32 = u32_arg(op, "cols", cols)?;
    let grid_x = u32_arg(op, "column blocks", cb)?;
    let (f, pdl) =
        crate::launch::load_chain(backend, FAMILY, SRC, "fmoe_fp8_quant_block", &defines)?;
    let mut b = crate::launch::PdlLaunch::new(backend, &f, pdl);
    b.arg(x.buffer())
        .arg(&rows32)
        .arg(&cols32)
        .arg(q.buffer_mut()?)
        .arg(scale_inv.buffer_mut()?)
        .arg(flag.buffer_mut()?);
    let launch = LaunchConfig {
        grid_dim: (grid_x, rb as u32, mats as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: (const in_t*, u32, u32, u8*, float*, u32*) as declared; x holds mats·rows·cols
    // elements of the compiled dtype and q as many bytes; block (bx, by, bz) covers rows
    // [128·by, min(128·by + 128, rows)) and the matching columns of matrix bz only, and writes
    // scale_inv[(bz·rb + by)·cb + bx] < mats·rb·cb; flag is one u32.
    unsafe { b.launch(launch) }.map_err(|e| cuda_error("quant_fp8: quant_block launch", e))?;
    Ok((q, scale_inv, flag))
}
