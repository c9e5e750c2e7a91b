//! Where weights come from: a safetensors [`Checkpoint`] (one file or shards listed by
//! `model.safetensors.index.json`, memory-mapped), or [`DummyWeights`] (random values of the
//! requested shapes from a seed, `--load-format dummy`). [`WeightSource`] joins the two behind
//! one interface, and [`Vb`] walks it by checkpoint name prefixes (`vb.pp("model").pp("layers")`)
//! so model files read like a map of the checkpoint.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use fmoe_core::{CpuStorage, DType, Device, F8E4M3, Tensor, bf16, f16};
use fmoe_kernels::elementwise;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::tensor::{Dtype as StDtype, Metadata};

use crate::{Error, Result};

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One memory-mapped safetensors file with its parsed header.
struct ShardFile {
    path: PathBuf,
    mmap: Mmap,
    /// Bytes before the data section (8-byte length + JSON header).
    data_start: usize,
    metadata: Metadata,
}

impl ShardFile {
    fn open(path: &Path) -> Result<ShardFile> {
        let file = File::open(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            err: source,
        })?;
        // SAFETY: the map is read-only; a checkpoint modified while mapped is the caller's fault
        // (as in every mmap-based loader), and reads stay inside the mapped length.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| Error::Io {
            path: path.to_path_buf(),
            err: source,
        })?;
        // read_metadata validates the header and that the data section fills the file exactly,
        // so a truncated file is an error here, not an out-of-bounds read later.
        let (n, metadata) =
            safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| Error::Safetensors {
                path: path.to_path_buf(),
                msg: format!("{e}"),
            })?;
        Ok(ShardFile {
            path: path.to_path_buf(),
            mmap,
            data_start: 8 + n,
            metadata,
        })
    }

    fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.path.display().to_string())
    }
}

/// A safetensors checkpoint directory, memory-mapped. Tensors are copied out (and converted to
/// fmoe's element types) on [`Checkpoint::get`].
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<ShardFile>,
    /// Tensor name → index into `files`.
    names: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` and its shards, else `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join(INDEX_FILE);
        let paths = if index.is_file() {
            shard_paths(&index, dir)?
        } else {
            let single = dir.join(SINGLE_FILE);
            if !single.is_file() {
                return Err(Error::Io {
                    path: dir.to_path_buf(),
                    err: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("neither {SINGLE_FILE} nor {INDEX_FILE} is there"),
                    ),
                });
            }
            vec![single]
        };
        let files: Vec<ShardFile> = paths
            .iter()
            .map(|p| ShardFile::open(p))
            .collect::<Result<_>>()?;
        let mut names = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.metadata.tensors().keys() {
                if let Some(prev) = names.insert(name.clone(), i) {
                    return Err(Error::Safetensors {
                        path: f.path.clone(),
                        msg: format!("tensor `{name}` is also in {}", files[prev].path.display()),
                    });
                }
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            names,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of tensors across all files.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.names.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// The files, for error messages: `model.safetensors` or `3 shards in DIR`.
    fn describe_files(&self) -> String {
        match self.files.as_slice() {
            [one] => one.path.display().to_string(),
            many => format!(
                "{} shards of {}",
                many.len(),
                self.dir.join(INDEX_FILE).display()
            ),
        }
    }

    fn locate(&self, name: &str) -> Result<(&ShardFile, &safetensors::tensor::TensorInfo)> {
        let missing = || Error::MissingTensor {
            name: name.to_string(),
            files: self.describe_files(),
        };
        let file = &self.files[*self.names.get(name).ok_or_else(missing)?];
        let info = file.metadata.info(name).ok_or_else(missing)?;
        Ok((file, info))
    }

    /// The stored shape and dtype of `name` without reading it.
    pub fn info(&self, name: &str) -> Result<(Vec<usize>, String)> {
        let (_, info) = self.locate(name)?;
        Ok((info.shape.clone(), format!("{:?}", info.dtype)))
    }

    /// Reads `name` as a CPU tensor of its stored dtype (BF16, F16, F32, F8_E4M3 or U32).
    pub fn get(&self, name: &str) -> Result<Tensor> {
        let (file, info) = self.locate(name)?;
        let (start, end) = info.data_offsets;
        let bytes = &file.mmap[file.data_start + start..file.data_start + end];
        let storage = match info.dtype {
            StDtype::BF16 => CpuStorage::BF16(decode(bytes, |b| bf16::from_bits(le16(b)))),
            StDtype::F16 => CpuStorage::F16(decode(bytes, |b| f16::from_bits(le16(b)))),
            StDtype::F32 => CpuStorage::F32(decode(bytes, |b| f32::from_bits(le32(b)))),
            StDtype::U32 => CpuStorage::U32(decode(bytes, le32)),
            StDtype::F8_E4M3 => CpuStorage::F8E4M3(decode(bytes, |b| F8E4M3::from_bits(b[0]))),
            other => {
                return Err(Error::TensorDType {
                    name: name.to_string(),
                    file: file.file_name(),
                    expected: "one of BF16, F16, F32, F8_E4M3, U32".into(),
                    got: format!("{other:?}"),
                });
            }
        };
        Ok(Tensor::from_cpu_storage(
            storage,
            info.shape.clone(),
            &Device::Cpu,
        )?)
    }

    /// [`Checkpoint::get`], checking the shape first (before any data is copied).
    pub fn get_with_shape(&self, name: &str, dims: &[usize]) -> Result<Tensor> {
        let (file, info) = self.locate(name)?;
        if info.shape != dims {
            return Err(Error::TensorShape {
                name: name.to_string(),
                file: file.file_name(),
                expected: dims.to_vec(),
                got: info.shape.clone(),
            });
        }
        self.get(name)
    }

    /// [`Checkpoint::get_with_shape`], also checking that the dtype is one of `dtypes` (before
    /// any data is copied).
    pub fn get_typed(&self, name: &str, dims: &[usize], dtypes: &[DType]) -> Result<Tensor> {
        let (file, info) = self.locate(name)?;
        let stored = fmoe_dtype(info.dtype);
        if !stored.is_some_and(|d| dtypes.contains(&d)) {
            return Err(Error::TensorDType {
                name: name.to_string(),
                file: file.file_name(),
                expected: join_dtypes(dtypes),
                got: stored.map_or_else(|| format!("{:?}", info.dtype), |d| d.to_string()),
            });
        }
        self.get_with_shape(name, dims)
    }
}

/// fmoe's element type for a safetensors dtype, where fmoe has one.
fn fmoe_dtype(d: StDtype) -> Option<DType> {
    match d {
        StDtype::BF16 => Some(DType::BF16),
        StDtype::F16 => Some(DType::F16),
        StDtype::F32 => Some(DType::F32),
        StDtype::U32 => Some(DType::U32),
        StDtype::F8_E4M3 => Some(DType::F8E4M3),
        _ => None,
    }
}

fn join_dtypes(dtypes: &[DType]) -> String {
    dtypes
        .iter()
        .map(|d| d.as_str())
        .collect::<Vec<_>>()
        .join(" or ")
}

fn le16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}
fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Decodes little-endian elements of `size_of::<T>()` bytes each, in parallel for large tensors.
fn decode<T: Send>(bytes: &[u8], f: impl Fn(&[u8]) -> T + Sync) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    if bytes.len() >= 1 << 20 {
        bytes.par_chunks_exact(size).map(&f).collect()
    } else {
        bytes.chunks_exact(size).map(f).collect()
    }
}

/// The shard files named by `weight_map` of an index file, in first-seen order.
fn shard_paths(index: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|source| Error::Io {
        path: index.to_path_buf(),
        err: source,
    })?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Safetensors {
        path: index.to_path_buf(),
        msg: format!("invalid JSON: {e}"),
    })?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Safetensors {
            path: index.to_path_buf(),
            msg: "no `weight_map` object".into(),
        })?;
    let mut seen = BTreeSet::new();
    let mut paths = Vec::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| Error::Safetensors {
            path: index.to_path_buf(),
            msg: format!("weight_map entry for `{name}` is not a file name"),
        })?;
        // Shards live beside the index: refuse paths that leave the directory.
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(Error::Safetensors {
                path: index.to_path_buf(),
                msg: format!("shard name `{file}` (for `{name}`) is not a plain file name"),
            });
        }
        if seen.insert(file.to_string()) {
            paths.push(dir.join(file));
        }
    }
    if paths.is_empty() {
        return Err(Error::Safetensors {
            path: index.to_path_buf(),
            msg: "`weight_map` is empty".into(),
        });
    }
    Ok(paths)
}

/// Random weights from a seed, for `--load-format dummy`: any name exists, with the requested
/// shape and the first requested dtype (or `dtype`, when allowed). Values are uniform with a
/// standard deviation of 0.02 for weights, 1 ± 0.1 (std) for norms, and for fp8 checkpoints e4m3
/// codes of std 28 with scales of 0.02/28 (so the dequantized weights have std 0.02, as a
/// checkpoint's would); each tensor's values depend only on (seed, name).
///
/// Tensors are generated on `device` ([`elementwise::rand_uniform`], [`Tensor::full`]): on CUDA a
/// dummy model never exists on the host, and the values are bit for bit those of `Device::Cpu`.
pub struct DummyWeights {
    pub seed: u64,
    /// The preferred dtype for floating-point weights (the config's `dtype`, else bf16).
    pub dtype: DType,
    /// Where the tensors are created.
    pub device: Device,
}

impl DummyWeights {
    pub fn get(&self, name: &str, dims: &[usize], dtypes: &[DType]) -> Result<Tensor> {
        let dtype = if dtypes.contains(&self.dtype) || dtypes.is_empty() {
            self.dtype
        } else {
            dtypes[0]
        };
        let seed = self.seed ^ fnv1a(name);
        // (std, mean) of uniform values: a hash per element, cheap, so a dummy model of billions
        // of parameters builds in seconds.
        let uniform = |std: f32, mean: f32, dtype: DType| -> Result<Tensor> {
            let a = std * 3f32.sqrt();
            Ok(elementwise::rand_uniform(
                dims,
                dtype,
                a,
                mean,
                seed,
                &self.device,
            )?)
        };
        let norm = name.ends_with("norm.weight") || name.ends_with("layernorm.weight");
        Ok(if name.contains("scale") {
            // fp8 scales: e4m3 codes of std 28 (below) times this are weights of std 0.02.
            Tensor::full(dims, dtype, 0.02 / 28.0, &self.device)?
        } else if dtype == DType::U32 {
            // Integer tensors: the float values truncated (zeros, but for a U32 "norm").
            let values = if norm {
                uniform(0.1, 1.0, DType::F32)?.to_dtype(DType::U32)?
            } else {
                Tensor::zeros(dims, DType::U32, &self.device)?
            };
            values.to_device(self.device)?
        } else if norm {
            uniform(0.1, 1.0, dtype)?
        } else if dtype == DType::F8E4M3 {
            uniform(28.0, 0.0, dtype)?
        } else {
            uniform(0.02, 0.0, dtype)?
        })
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Weights from a checkpoint or from a seed.
pub enum WeightSource {
    Checkpoint(Checkpoint),
    Dummy(DummyWeights),
}

impl WeightSource {
    /// `name` with shape `dims` and one of `dtypes` (all dtypes when empty).
    pub fn get(&self, name: &str, dims: &[usize], dtypes: &[DType]) -> Result<Tensor> {
        match self {
            WeightSource::Checkpoint(c) if dtypes.is_empty() => c.get_with_shape(name, dims),
            WeightSource::Checkpoint(c) => c.get_typed(name, dims, dtypes),
            WeightSource::Dummy(d) => d.get(name, dims, dtypes),
        }
    }

    /// Whether `name` exists (always, for dummy weights).
    pub fn contains(&self, name: &str) -> bool {
        match self {
            WeightSource::Checkpoint(c) => c.contains(name),
            WeightSource::Dummy(_) => true,
        }
    }
}

/// A cursor into a [`WeightSource`] at a name prefix, counting reads on a progress bar.
pub struct Vb<'a> {
    source: &'a WeightSource,
    prefix: String,
    progress: &'a ProgressBar,
}

impl<'a> Vb<'a> {
    pub fn new(source: &'a WeightSource, progress: &'a ProgressBar) -> Vb<'a> {
        Vb {
            source,
            prefix: String::new(),
            progress,
        }
    }

    /// The cursor at `prefix.sub`.
    pub fn pp(&self, sub: impl std::fmt::Display) -> Vb<'a> {
        let prefix = if self.prefix.is_empty() {
            sub.to_string()
        } else {
            format!("{}.{sub}", self.prefix)
        };
        Vb {
            source: self.source,
            prefix,
            progress: self.progress,
        }
    }

    /// The full checkpoint name of `name` under this prefix.
    pub fn name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// Reads `prefix.name`, checking its shape and dtype (any of `dtypes`).
    pub fn get(&self, name: &str, dims: &[usize], dtypes: &[DType]) -> Result<Tensor> {
        let full = self.name(name);
        let t = self.source.get(&full, dims, dtypes)?;
        self.progress.inc(1);
        Ok(t)
    }

    /// Reads a one-element tensor (shape `[]` or `[1]`, a float dtype) such as fp8's
    /// `weight_scale`.
    pub fn get_scalar(&self, name: &str) -> Result<f32> {
        let full = self.name(name);
        const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
        let t = match self.source {
            WeightSource::Checkpoint(c) => {
                let (shape, _) = c.info(&full)?;
                if shape.iter().product::<usize>() != 1 {
                    return Err(Error::TensorShape {
                        name: full,
                        file: c.describe_files(),
                        expected: vec![],
                        got: shape,
                    });
                }
                c.get_typed(&full, &shape, &FLOATS)?
            }
            WeightSource::Dummy(d) => d.get(&full, &[], &[DType::F32])?,
        };
        self.progress.inc(1);
        Ok(t.to_f32_vec()?.first().copied().unwrap_or(1.0))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.source.contains(&self.name(name))
    }

    pub fn source(&self) -> &WeightSource {
        self.source
    }
}

/// A progress bar over `len` tensors on stderr (drawn only when stderr is a terminal), or a hidden
/// one.
pub fn progress_bar(len: u64, visible: bool) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("loading {bar:40} {pos}/{len} tensors [{elapsed_precise}]")
    {
        bar.set_style(style);
    }
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dummy generator as it was written here before moving to fmoe_kernels: dummy values of
    /// a (seed, name) must not change.
    fn old_values(seed: u64, n: usize, std: f32, offset: f32) -> Vec<f32> {
        let uniform = |seed: u64, i: u64| {
            let mut z = seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let a = std * 3f32.sqrt();
        (0..n as u64)
            .map(|i| offset + a * uniform(seed, i))
            .collect()
    }

    fn cases() -> Vec<(&'static str, Vec<usize>, DType, f32, f32)> {
        vec![
            (
                "model.layers.0.mlp.gate_proj.weight",
                vec![7, 33],
                DType::BF16,
                0.02,
                0.0,
            ),
            (
                "model.layers.0.input_layernorm.weight",
                vec![64],
                DType::BF16,
                0.1,
                1.0,
            ),
            ("model.norm.weight", vec![64], DType::F32, 0.1, 1.0),
            ("lm_head.weight", vec![5, 16], DType::F16, 0.02, 0.0),
            (
                "model.layers.1.mlp.experts.0.w1.weight",
                vec![9, 130],
                DType::F8E4M3,
                28.0,
                0.0,
            ),
        ]
    }

    #[test]
    fn cpu_dummy_values_are_unchanged() {
        let d = DummyWeights {
            seed: 3,
            dtype: DType::BF16,
            device: Device::Cpu,
        };
        for (name, dims, dtype, std, offset) in cases() {
            let t = d.get(name, &dims, &[dtype]).unwrap();
            assert_eq!(
                (t.dims(), t.dtype(), t.device()),
                (&dims[..], dtype, Device::Cpu)
            );
            let n = dims.iter().product();
            let want = Tensor::from_f32(
                &old_values(3 ^ fnv1a(name), n, std, offset),
                dims,
                dtype,
                &Device::Cpu,
            )
            .unwrap();
            assert_eq!(
                t.to_f32_vec().unwrap(),
                want.to_f32_vec().unwrap(),
                "{name}"
            );
        }
        let s = d
            .get(
                "model.layers.1.mlp.experts.0.w1.weight_scale_inv",
                &[2, 3],
                &[DType::F32],
            )
            .unwrap();
        assert_eq!(s.to_f32_vec().unwrap(), vec![0.02 / 28.0; 6]);
        let u = d.get("some.index", &[4], &[DType::U32]).unwrap();
        assert_eq!(u.to_f32_vec().unwrap(), vec![0.0; 4]);
    }

    /// On a GPU the same tensors, generated there. Skips without one (FMOE_REQUIRE_CUDA=1 makes
    /// that a failure).
    #[test]
    fn cuda_dummy_values_equal_the_cpu_ones() {
        if fmoe_core::cuda::test_backend_or_skip().is_none() {
            return;
        }
        let mk = |device| DummyWeights {
            seed: 11,
            dtype: DType::BF16,
            device,
        };
        let (cpu, gpu) = (mk(Device::Cpu), mk(Device::Cuda(0)));
        let mut all = cases();
        all.push(("big.weight", vec![1000, 1001], DType::BF16, 0.02, 0.0));
        all.push(("big.fp8.weight", vec![1000, 1001], DType::F8E4M3, 28.0, 0.0));
        all.push(("x.weight_scale_inv", vec![8, 8], DType::F32, 0.0, 0.0));
        for (name, dims, dtype, _, _) in all {
            let c = cpu.get(name, &dims, &[dtype]).unwrap();
            let g = gpu.get(name, &dims, &[dtype]).unwrap();
            assert_eq!(g.device(), Device::Cuda(0));
            assert_eq!(g.dtype(), c.dtype());
            // Bitwise: compare the raw storages.
            let gc = g.to_device(Device::Cpu).unwrap();
            let bits = |t: &Tensor| format!("{:?}", t.storage());
            assert_eq!(bits(&gc), bits(&c), "{name}");
        }
    }
}
