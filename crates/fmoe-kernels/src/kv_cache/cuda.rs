//! CUDA twin of [`super::append_rows`]: `cuda/kv_append.cu`, one launch for every stream.

use fmoe_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaStorage, cuda_error};
use fmoe_core::{Storage, Tensor};

use super::{KvSource, OP, Stream};
use crate::Result;
use crate::catalog::KernelVariant;
use crate::launch::{MAX_GRID_STRIDE_BLOCKS, cuda_storage};
use crate::nvrtc;

const FAMILY: &str = "kv_append";
const SRC: &str = include_str!("../../cuda/kv_append.cu");
const ENTRY: &str = "fmoe_kv_append";
/// Word sizes (bytes) the kernel is compiled for; a call uses the widest its geometry allows.
const WORDS: [usize; 5] = [16, 8, 4, 2, 1];
/// A Mixtral K or V row (8 kv heads × 128 bf16) is 128 words of 16 bytes: one per thread.
const THREADS: u32 = 128;

pub(crate) fn variants() -> Vec<KernelVariant> {
    WORDS
        .iter()
        .map(|w| KernelVariant {
            family: FAMILY,
            source: SRC,
            entry: ENTRY,
            defines: vec![("WORD", w.to_string())],
        })
        .collect()
}

/// The widest word dividing every byte quantity of every stream (allocations are 256-byte
/// aligned, so the word accesses are aligned).
fn word(streams: &[Stream], elem: usize) -> usize {
    WORDS
        .into_iter()
        .find(|&w| {
            streams.iter().all(|g| {
                [g.src_width, g.col, g.width]
                    .iter()
                    .all(|&q| (q * elem).is_multiple_of(w))
            })
        })
        .unwrap_or(1)
}

/// Validated by the caller: 1 or 2 streams, shapes, dtypes, devices, slots in range.
pub(super) fn append(
    slabs: &mut [Tensor],
    sources: &[KvSource<'_>],
    slots: &CudaStorage,
    streams: &[Stream],
) -> Result<()> {
    let device = slots.device();
    let srcs: Vec<&CudaStorage> = sources
        .iter()
        .enumerate()
        .map(|(i, s)| cuda_storage(OP, &format!("sources[{i}]"), s.src, device))
        .collect::<Result<_>>()?;
    let elem = srcs[0].dtype().size_in_bytes();
    // One word for all streams: they share the launch.
    let w = word(streams, elem);
    let in_words = |v: usize| (v * elem / w) as u64;
    let backend = slots.backend();
    let f = nvrtc::load(backend, FAMILY, SRC, ENTRY, &[("WORD", w.to_string())])?;
    let tokens = slots.len();
    let tokens_u64 = tokens as u64;
    let geo: Vec<[u64; 3]> = streams
        .iter()
        .map(|g| [in_words(g.src_width), in_words(g.col), in_words(g.width)])
        .collect();
    let mut dsts: Vec<&mut CudaStorage> = Vec::with_capacity(slabs.len());
    for slab in slabs.iter_mut() {
        match slab.storage_mut(OP)? {
            Storage::Cuda(s) => dsts.push(s),
            Storage::Cpu(_) => {
                return Err(crate::Error::invalid(OP, "a slab is not on the device"));
            }
        }
    }
    let stream = backend.stream();
    let null: u64 = 0;
    let zero: u64 = 0;
    let n = dsts.len();
    let mut it = dsts.into_iter();
    let (Some(d0), d1) = (it.next(), it.next()) else {
        return Err(crate::Error::invalid(OP, "no slab to write"));
    };
    let mut l = stream.launch_builder(&f);
    l.arg(slots.buffer()).arg(&tokens_u64);
    l.arg(srcs[0].buffer())
        .arg(&geo[0][0])
        .arg(&geo[0][1])
        .arg(d0.buffer_mut()?)
        .arg(&geo[0][2]);
    match d1 {
        Some(d1) => {
            l.arg(srcs[1].buffer())
                .arg(&geo[1][0])
                .arg(&geo[1][1])
                .arg(d1.buffer_mut()?)
                .arg(&geo[1][2]);
        }
        None => {
            l.arg(&null).arg(&zero).arg(&zero).arg(&null).arg(&zero);
        }
    }
    let cfg = LaunchConfig {
        grid_dim: (tokens.clamp(1, MAX_GRID_STRIDE_BLOCKS) as u32, n as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match fmoe_kv_append (slots pointer, u64, then per stream a source
    // pointer, two u64, a slab pointer, a u64; the second stream's are null/0 and never read when
    // gridDim.y is 1). The caller checked: each source holds `tokens` rows of src_width elements
    // with col + width <= src_width, each slab's rows exceed every slot id, source and slab share
    // the dtype; every quantity is a whole number of WORD-byte words (chosen above); the slabs
    // are distinct unshared buffers (storage_mut), so no source aliases a destination.
    unsafe { l.launch(cfg) }.map_err(|e| cuda_error(OP, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_is_the_widest_every_stream_allows() {
        let g = |src_width, col, width| Stream {
            src_width,
            col,
            width,
        };
        // Mixtral bf16: K [T, 1024] from col 0, V from col 5120 of [T, 6144].
        assert_eq!(word(&[g(1024, 0, 1024), g(6144, 5120, 1024)], 2), 16);
        // DeepSeek-V3: latent 512 of [T, 512], k_pe 64 at col 512 of [T, 576].
        assert_eq!(word(&[g(512, 0, 512), g(576, 512, 64)], 2), 16);
        // One odd quantity narrows the word of both streams.
        assert_eq!(word(&[g(1024, 0, 1024), g(6, 2, 3)], 2), 2);
        assert_eq!(word(&[g(5, 1, 3)], 1), 1);
        assert_eq!(variants().len(), WORDS.len());
    }
}
