//! The copies behind [`super::gather_rows`], [`super::narrow_cols`], [`super::narrow_rows`] and
//! [`super::concat_heads`]: each is one or two [`Part`]s of a strided row copy, run by the same CPU
//! loop and the same CUDA kernel (`cuda/copy.cu`). Elements move unchanged, so any dtype works.

use fmoe_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{CpuStorage, Storage, Tensor};

use crate::Result;
use crate::catalog::KernelVariant;
use crate::launch::{MAX_GRID_STRIDE_BLOCKS, cuda_storage};
use crate::nvrtc;

const FAMILY: &str = "copy";
const SRC: &str = include_str!("../../cuda/copy.cu");
/// Word sizes (bytes) the kernel is compiled for; a copy uses the widest one its geometry allows.
const WORDS: [usize; 5] = [16, 8, 4, 2, 1];
const THREADS: u32 = 256;

/// Which source rows output rows 0.. read.
#[derive(Clone, Copy, Debug)]
pub(super) enum Rows<'a> {
    /// Rows first, first + 1, ...
    Range(usize),
    /// Row ids[r] (checked in range by the caller).
    Ids(&'a [u32]),
    /// Row ids[r] of u32 ids already on the device (checked in range by the caller); CUDA only.
    Uploaded(&'a CudaStorage),
}

/// `dst[r, dst_offset + h·dst_block_stride + c] = src[row(r), src_offset + h·block_stride + c]` for
/// every output row r, block h < blocks and column c < width (indices in elements; rows of the
/// source are `src_stride` apart, rows of the output the output's width).
#[derive(Clone, Copy, Debug)]
pub(super) struct Part<'a> {
    /// Index into the sources.
    pub src: usize,
    pub rows: Rows<'a>,
    pub src_stride: usize,
    pub src_offset: usize,
    pub blocks: usize,
    pub block_stride: usize,
    pub width: usize,
    pub dst_offset: usize,
    pub dst_block_stride: usize,
}

impl Part<'_> {
    fn src_row(&self, r: usize) -> usize {
        match self.rows {
            Rows::Range(first) => first + r,
            Rows::Ids(ids) => ids[r] as usize,
            Rows::Uploaded(_) => unreachable!("device ids only reach the CUDA path"),
        }
    }
}

/// Runs `parts` into a new `[out_rows, out_w]` tensor of the sources' dtype and device (the
/// caller checked dtypes and geometry; this checks devices).
pub(super) fn run(
    op: &'static str,
    srcs: &[&Tensor],
    parts: &[Part<'_>],
    out_rows: usize,
    out_w: usize,
) -> Result<Tensor> {
    let first = srcs[0];
    for (i, s) in srcs.iter().enumerate().skip(1) {
        s.expect_device(op, &format!("source {i}"), first.device())?;
    }
    match first.storage() {
        Storage::Cpu(_) => {
            let cpu: Vec<&CpuStorage> = srcs
                .iter()
                .map(|s| s.cpu_storage(op, "source"))
                .collect::<fmoe_core::Result<_>>()?;
            let out = cpu_run(&cpu, parts, out_rows, out_w);
            Ok(Tensor::from_cpu_storage(
                out,
                [out_rows, out_w],
                &first.device(),
            )?)
        }
        Storage::Cuda(s0) => {
            let cuda: Vec<&CudaStorage> = srcs
                .iter()
                .map(|s| cuda_storage(op, "source", s, first.device()))
                .collect::<Result<_>>()?;
            let mut out = CudaStorage::alloc(s0.backend(), s0.dtype(), out_rows * out_w)?;
            for p in parts {
                cuda_part(op, cuda[p.src], &mut out, p, out_rows, out_w)?;
            }
            Ok(Tensor::from_storage(Storage::Cuda(out), [out_rows, out_w])?)
        }
    }
}

fn cpu_run(srcs: &[&CpuStorage], parts: &[Part<'_>], out_rows: usize, out_w: usize) -> CpuStorage {
    fn typed<T: Copy + Default>(
        srcs: &[&[T]],
        parts: &[Part<'_>],
        rows: usize,
        w: usize,
    ) -> Vec<T> {
        let mut out = vec![T::default(); rows * w];
        for p in parts {
            let src = srcs[p.src];
            for r in 0..rows {
                let s0 = p.src_row(r) * p.src_stride + p.src_offset;
                for h in 0..p.blocks {
                    let (s, d) = (
                        s0 + h * p.block_stride,
                        r * w + p.dst_offset + h * p.dst_block_stride,
                    );
                    out[d..d + p.width].copy_from_slice(&src[s..s + p.width]);
                }
            }
        }
        out
    }
    macro_rules! dispatch {
        ($($v:ident),*) => {
            match srcs[0] {
                $(CpuStorage::$v(_) => {
                    let typed_srcs: Vec<&[_]> = srcs
                        .iter()
                        .map(|s| match s {
                            CpuStorage::$v(v) => v.as_slice(),
                            _ => unreachable!("sources share a dtype (checked by the caller)"),
                        })
                        .collect();
                    CpuStorage::$v(typed(&typed_srcs, parts, out_rows, out_w))
                })*
            }
        };
    }
    dispatch!(F32, BF16, F16, F8E4M3, U32)
}

pub(super) fn cuda_variants() -> Vec<KernelVariant> {
    WORDS
        .iter()
        .map(|w| KernelVariant {
            family: FAMILY,
            source: SRC,
            entry: "fmoe_copy_rows",
            defines: vec![("WORD", w.to_string())],
        })
        .collect()
}

fn cuda_part(
    op: &'static str,
    src: &CudaStorage,
    out: &mut CudaStorage,
    p: &Part<'_>,
    out_rows: usize,
    out_w: usize,
) -> Result<()> {
    if out_rows == 0 || p.blocks == 0 || p.width == 0 {
        return Ok(());
    }
    let es = src.dtype().size_in_bytes();
    // Every byte offset and length the kernel forms is a multiple of the word; allocations are
    // 256-byte aligned, so the word loads and stores are aligned.
    let quantities = [
        p.src_stride,
        p.src_offset,
        p.block_stride,
        p.width,
        out_w,
        p.dst_offset,
        p.dst_block_stride,
    ];
    let word = WORDS
        .into_iter()
        .find(|&w| quantities.iter().all(|&q| (q * es).is_multiple_of(w)))
        .unwrap_or(1);
    let in_words = |v: usize| (v * es / word) as u64;
    let backend = src.backend();
    let uploaded = match p.rows {
        Rows::Ids(ids) => Some(CudaStorage::from_cpu(
            backend,
            &CpuStorage::U32(ids.to_vec()),
        )?),
        Rows::Range(_) | Rows::Uploaded(_) => None,
    };
    let ids = match p.rows {
        Rows::Uploaded(ids) => Some(ids),
        _ => uploaded.as_ref(),
    };
    let first_row = match p.rows {
        Rows::Range(first) => first as u64,
        Rows::Ids(_) | Rows::Uploaded(_) => 0,
    };
    let f = nvrtc::load(
        backend,
        FAMILY,
        SRC,
        "fmoe_copy_rows",
        &[("WORD", word.to_string())],
    )?;
    let stream = backend.stream();
    let (rows, blocks, width) = (out_rows as u64, p.blocks as u64, in_words(p.width));
    let (src_stride, src_offset, block_stride) = (
        in_words(p.src_stride),
        in_words(p.src_offset),
        in_words(p.block_stride),
    );
    let (dst_stride, dst_offset, dst_block_stride) = (
        in_words(out_w),
        in_words(p.dst_offset),
        in_words(p.dst_block_stride),
    );
    let use_ids = u32::from(ids.is_some());
    let dst = out.buffer_mut()?;
    let mut l = stream.launch_builder(&f);
    l.arg(src.buffer()).arg(dst);
    match ids {
        Some(ids) => l.arg(ids.buffer()),
        None => l.arg(src.buffer()),
    };
    l.arg(&use_ids)
        .arg(&rows)
        .arg(&first_row)
        .arg(&src_stride)
        .arg(&src_offset)
        .arg(&blocks)
        .arg(&block_stride)
        .arg(&width)
        .arg(&dst_stride)
        .arg(&dst_offset)
        .arg(&dst_block_stride);
    let cfg = LaunchConfig {
        grid_dim: (out_rows.clamp(1, MAX_GRID_STRIDE_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the argument list matches fmoe_copy_rows (WORD-byte words; ids read only when
    // use_ids is 1, and then it holds `rows` ids below the source's row count, checked by the
    // caller); the caller checked that every source index is inside src and every destination
    // index inside out ([out_rows, out_w]); all offsets are whole words (chosen above).
    unsafe { l.launch(cfg) }.map_err(|e| cuda_error(op, e))?;
    Ok(())
}
