//! Where weights come from: a safetensors [`Checkpoint`] (one file or shards listed by
//! `model.safetensors.index.json`), or [`DummyWeights`] (random values of the requested shapes
//! from a seed, `--load-format dummy`). [`WeightSource`] joins the two behind one interface, and
//! [`Vb`] walks it by checkpoint name prefixes (`vb.pp("model").pp("layers")`) so model files read
//! like a map of the checkpoint.
//!
//! Checkpoint files are read with positioned reads (`pread`), not memory-mapped: every tensor is
//! copied out and converted anyway, and a file that shrinks while it is read is then an error
//! naming it (a read past the end), where a mapping would kill the process with SIGBUS. Every
//! path opened here must be a regular file ([`open_regular`]): a directory, FIFO, socket or
//! device is an error naming the path and what it is, and a FIFO never blocks the open.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fmoe_core::{CpuStorage, DType, Device, F8E4M3, Shape, Tensor, bf16, f16};
use fmoe_kernels::elementwise;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use safetensors::tensor::{Dtype as StDtype, Metadata};

use crate::{Error, Result};

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The largest safetensors header read (the format's own limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// The largest `model.safetensors.index.json` read (DeepSeek-V3's is about 9 MB).
pub const MAX_INDEX_BYTES: u64 = 256 << 20;
/// Tensors at least this large are compared with the host's free memory before they are read.
const BUDGET_CHECK_BYTES: usize = 64 << 20;

/// What is at a path, for the regular-file checks.
enum Entry {
    Missing,
    Regular,
    /// Something else: "a directory", "a FIFO (named pipe)", ...
    Other(&'static str),
}

fn entry(path: &Path) -> std::io::Result<Entry> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata(path) {
        Ok(m) => {
            let t = m.file_type();
            Ok(if t.is_file() {
                Entry::Regular
            } else if t.is_dir() {
                Entry::Other("a directory")
            } else if t.is_fifo() {
                Entry::Other("a FIFO (named pipe)")
            } else if t.is_socket() {
                Entry::Other("a socket")
            } else if t.is_block_device() || t.is_char_device() {
                Entry::Other("a device")
            } else {
                Entry::Other("not a regular file")
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Entry::Missing),
        Err(e) => Err(e),
    }
}

fn not_regular(path: &Path, what: &str, kind: &str) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        err: std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{what} must be a regular file, but this is {kind}"),
        ),
    }
}

/// Opens `path` for reading if it is a regular file (`what` names it in errors, e.g.
/// "config.json"). The open itself is non-blocking, so a FIFO swapped in after the check cannot
/// hang it, and the opened file is checked again (`fstat`).
pub fn open_regular(path: &Path, what: &str) -> Result<File> {
    let io = |err| Error::Io {
        path: path.to_path_buf(),
        err,
    };
    if let Entry::Other(kind) = entry(path).map_err(io)? {
        return Err(not_regular(path, what, kind));
    }
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    if !file.metadata().map_err(io)?.is_file() {
        return Err(not_regular(path, what, "not a regular file"));
    }
    Ok(file)
}

/// The contents of the regular file `path`, at most `max_bytes` of them (a larger file is an
/// error naming the limit, not a large allocation).
pub fn read_regular_file(path: &Path, what: &str, max_bytes: u64) -> Result<Vec<u8>> {
    let file = open_regular(path, what)?;
    let io = |err| Error::Io {
        path: path.to_path_buf(),
        err,
    };
    let len = file.metadata().map_err(io)?.len();
    let too_big = |len: u64| Error::Io {
        path: path.to_path_buf(),
        err: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{what} is {len} bytes, more than the {max_bytes} read"),
        ),
    };
    if len > max_bytes {
        return Err(too_big(len));
    }
    let mut out = Vec::with_capacity(len as usize);
    // `take` guards a file that grows between the size check and the read.
    file.take(max_bytes + 1).read_to_end(&mut out).map_err(io)?;
    if out.len() as u64 > max_bytes {
        return Err(too_big(out.len() as u64));
    }
    Ok(out)
}

/// One safetensors file with its parsed header.
struct ShardFile {
    path: PathBuf,
    file: File,
    /// Bytes before the data section (8-byte length + JSON header).
    data_start: u64,
    metadata: Metadata,
}

impl ShardFile {
    fn open(path: &Path) -> Result<ShardFile> {
        let file = open_regular(path, "a checkpoint file")?;
        let bad = |msg: String| Error::Safetensors {
            path: path.to_path_buf(),
            msg,
        };
        let io = |err| Error::Io {
            path: path.to_path_buf(),
            err,
        };
        let len = file.metadata().map_err(io)?.len();
        let mut n = [0u8; 8];
        if len < 8 {
            return Err(bad(format!(
                "the file is {len} bytes, too short for the 8-byte header length"
            )));
        }
        file.read_exact_at(&mut n, 0)
            .map_err(|e| shrank_or(path, e, "the header length"))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER_BYTES {
            return Err(bad(format!(
                "header length {n} exceeds the format's limit of {MAX_HEADER_BYTES} bytes"
            )));
        }
        if n > len - 8 {
            return Err(bad(format!(
                "header length {n} runs past the end of the file ({len} bytes)"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|e| shrank_or(path, e, "the header"))?;
        // Metadata's deserializer validates the header: offsets contiguous from 0, each tensor's
        // byte length equal to its shape × dtype size (checked arithmetic).
        let metadata: Metadata =
            serde_json::from_slice(&header).map_err(|e| bad(format!("invalid header: {e}")))?;
        let data_end = metadata
            .tensors()
            .values()
            .map(|t| t.data_offsets.1 as u64)
            .max()
            .unwrap_or(0);
        let data_len = len - 8 - n;
        if data_end != data_len {
            return Err(bad(format!(
                "the header describes {data_end} bytes of tensor data, the file holds {data_len} \
                 (truncated or padded)"
            )));
        }
        Ok(ShardFile {
            path: path.to_path_buf(),
            file,
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

/// A read error of `path`: a short read (`read_exact_at`'s `UnexpectedEof`) means the file shrank
/// after its header was checked.
fn shrank_or(path: &Path, e: std::io::Error, what: &str) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::Safetensors {
            path: path.to_path_buf(),
            msg: format!(
                "the file ended while reading {what}: it was truncated or rewritten while fmoe \
                 was loading it"
            ),
        }
    } else {
        Error::Io {
            path: path.to_path_buf(),
            err: e,
        }
    }
}

/// A safetensors checkpoint directory. Tensors are read (and converted to fmoe's element types)
/// on [`Checkpoint::get`].
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<ShardFile>,
    /// Tensor name → index into `files`.
    names: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` and its shards, else `dir/model.safetensors`.
    /// With an index, its `weight_map` says where each tensor is, and it is checked against the
    /// shards' headers: every tensor it lists must be in the shard it names, and every tensor of
    /// a shard must be listed, under that shard.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join(INDEX_FILE);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |err| Error::Io { path, err }
        };
        match entry(&index).map_err(io(&index))? {
            Entry::Regular => return Checkpoint::open_sharded(dir, &index),
            Entry::Other(kind) => return Err(not_regular(&index, INDEX_FILE, kind)),
            Entry::Missing => {}
        }
        let single = dir.join(SINGLE_FILE);
        match entry(&single).map_err(io(&single))? {
            Entry::Regular => {}
            Entry::Other(kind) => return Err(not_regular(&single, SINGLE_FILE, kind)),
            Entry::Missing => {
                return Err(Error::Io {
                    path: dir.to_path_buf(),
                    err: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("neither {SINGLE_FILE} nor {INDEX_FILE} is there"),
                    ),
                });
            }
        }
        let file = ShardFile::open(&single)?;
        let names = file
            .metadata
            .tensors()
            .into_keys()
            .map(|n| (n, 0))
            .collect();
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files: vec![file],
            names,
        })
    }

    fn open_sharded(dir: &Path, index: &Path) -> Result<Checkpoint> {
        let map = weight_map(index)?;
        let mut shard_names: Vec<String> = Vec::new();
        let mut shard_of: HashMap<&str, usize> = HashMap::new();
        let mut names = HashMap::with_capacity(map.len());
        for (tensor, shard) in &map {
            let i = *shard_of.entry(shard.as_str()).or_insert_with(|| {
                shard_names.push(shard.clone());
                shard_names.len() - 1
            });
            names.insert(tensor.clone(), i);
        }
        let files: Vec<ShardFile> = shard_names
            .iter()
            .map(|f| ShardFile::open(&dir.join(f)))
            .collect::<Result<_>>()?;
        let bad = |msg: String| Error::Safetensors {
            path: index.to_path_buf(),
            msg,
        };
        // Where each tensor really is, refusing one held twice.
        let mut held: HashMap<String, usize> = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.metadata.tensors().into_keys() {
                if let Some(prev) = held.insert(name.clone(), i) {
                    return Err(Error::Safetensors {
                        path: f.path.clone(),
                        msg: format!("tensor `{name}` is also in {}", files[prev].path.display()),
                    });
                }
            }
        }
        // Sorted, so the first inconsistency reported does not depend on hash order.
        let listed: BTreeSet<&String> = names.keys().collect();
        for name in listed {
            let want = names[name];
            match held.get(name) {
                Some(&got) if got == want => {}
                Some(&got) => {
                    return Err(bad(format!(
                        "weight_map files `{name}` under {}, but it is in {}",
                        shard_names[want], shard_names[got]
                    )));
                }
                None => {
                    return Err(bad(format!(
                        "weight_map files `{name}` under {}, which does not hold it",
                        shard_names[want]
                    )));
                }
            }
        }
        let unlisted: BTreeSet<&String> = held.keys().filter(|n| !names.contains_key(*n)).collect();
        if let Some(name) = unlisted.first() {
            return Err(bad(format!(
                "tensor `{name}` of {} is not in weight_map",
                shard_names[held[*name]]
            )));
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
        let len = end - start;
        if len >= BUDGET_CHECK_BYTES {
            fmoe_core::memory::check_budget(
                &format!("tensor `{name}` {:?} of {}", info.shape, file.file_name()),
                len,
                Device::Cpu,
            )?;
        }
        let at = file.data_start + start as u64;
        let pread = |buf: &mut [u8], off: u64| file.file.read_exact_at(buf, at + off);
        let shrank = |e| shrank_or(&file.path, e, &format!("tensor `{name}`"));
        let storage = match info.dtype {
            StDtype::BF16 => {
                CpuStorage::BF16(decode(len, &pread, |b| bf16::from_bits(le16(b))).map_err(shrank)?)
            }
            StDtype::F16 => {
                CpuStorage::F16(decode(len, &pread, |b| f16::from_bits(le16(b))).map_err(shrank)?)
            }
            StDtype::F32 => {
                CpuStorage::F32(decode(len, &pread, |b| f32::from_bits(le32(b))).map_err(shrank)?)
            }
            StDtype::U32 => CpuStorage::U32(decode(len, &pread, le32).map_err(shrank)?),
            StDtype::F8_E4M3 => CpuStorage::F8E4M3(
                decode(len, &pread, |b| F8E4M3::from_bits(b[0])).map_err(shrank)?,
            ),
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

/// Bytes read and decoded per step: large enough for parallel decoding, small enough that a
/// tensor is never held twice (raw bytes beside the decoded values).
const READ_CHUNK: usize = 8 << 20;

/// Decodes `len` bytes of little-endian elements of `size_of::<T>()` bytes each, read with `read`
/// (`(buffer, offset)`) a chunk at a time, in parallel for large chunks.
fn decode<T: Send>(
    len: usize,
    read: &dyn Fn(&mut [u8], u64) -> std::io::Result<()>,
    f: impl Fn(&[u8]) -> T + Sync,
) -> std::io::Result<Vec<T>> {
    let size = std::mem::size_of::<T>();
    // The header validated len = elements × dtype size, and size_of::<T>() is that dtype's size.
    let mut out = Vec::with_capacity(len / size);
    let chunk = READ_CHUNK - READ_CHUNK % size;
    let mut buf = vec![0u8; chunk.min(len)];
    let mut off = 0;
    while off < len {
        let take = chunk.min(len - off);
        let bytes = &mut buf[..take];
        read(bytes, off as u64)?;
        if take >= 1 << 20 {
            out.par_extend(bytes.par_chunks_exact(size).map(&f));
        } else {
            out.extend(bytes.chunks_exact(size).map(&f));
        }
        off += take;
    }
    Ok(out)
}

/// `weight_map` of an index file: tensor name → shard file name (a plain name beside the index).
fn weight_map(index: &Path) -> Result<Vec<(String, String)>> {
    let text = read_regular_file(index, INDEX_FILE, MAX_INDEX_BYTES)?;
    let bad = |msg: String| Error::Safetensors {
        path: index.to_path_buf(),
        msg,
    };
    let value: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut out = Vec::with_capacity(map.len());
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("weight_map entry for `{name}` is not a file name")))?;
        // Shards live beside the index: refuse paths that leave the directory, and names that
        // are the directory itself.
        if file.contains('/') || file.contains('\\') || matches!(file, "" | "." | "..") {
            return Err(bad(format!(
                "shard name `{file}` (for `{name}`) is not a plain file name"
            )));
        }
        out.push((name.clone(), file.to_string()));
    }
    if out.is_empty() {
        return Err(bad("`weight_map` is empty".into()));
    }
    Ok(out)
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
        // The shape comes from the config: count it checked, and compare its bytes with what the
        // device has free before generating (each tensor, so a model too large for the device
        // stops at the tensor that no longer fits, with the error naming it).
        let shape = Shape::from(dims);
        let elems = shape.checked_elem_count()?;
        let bytes = fmoe_core::checked_bytes(
            &format!("dummy weight `{name}` {shape}"),
            elems,
            dtype.size_in_bytes(),
        )?;
        fmoe_core::memory::check_budget(
            &format!("dummy weight `{name}` {shape} {dtype}"),
            bytes,
            self.device,
        )?;
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
