//! safetensors checkpoints: one file or the shards of an index, headers validated at open,
//! tensors read with positioned reads (see the parent module's docs).

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fmoe_core::{CpuStorage, DType, Device, F8E4M3, Tensor, bf16, f16};
use rayon::prelude::*;
use safetensors::tensor::{Dtype as StDtype, Metadata};

use super::files::{Entry, entry, not_regular, open_regular, read_regular_file};
use super::{INDEX_FILE, SINGLE_FILE};
use crate::{Error, Result};

/// The largest safetensors header read (the format's own limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// The largest `model.safetensors.index.json` read (DeepSeek-V3's is about 9 MB).
pub const MAX_INDEX_BYTES: u64 = 256 << 20;
/// Tensors at least this large are compared with the host's free memory before they are read.
const BUDGET_CHECK_BYTES: usize = 64 << 20;

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
    pub(super) fn describe_files(&self) -> String {
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
