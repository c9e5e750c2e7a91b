//! NVRTC: the one place fmoe compiles CUDA.
//!
//! A kernel is a [`KernelSpec`]: the family name, the `.cu` source (`include_str!` of
//! `crates/fmoe-kernels/cuda/<family>.cu`), the `extern "C"` entry point and the `-D` defines that
//! instantiate it (its tunables). [`load`] turns it into a launchable `CudaFunction`:
//!
//! 1. options: `--gpu-architecture=sm_{major}{minor}` for the device, with the `a` suffix from
//!    Hopper on (`sm_90a`: wgmma, setmaxnreg and friends need it; such code runs on that exact
//!    architecture only, which a per-device cubin does anyway), `-std=c++17`,
//!    `-I{cuda_home}/include` (`$CUDA_HOME`, else `$CUDA_PATH`, else `/usr/local/cuda`: for
//!    `cuda_bf16.h` and friends), then the defines. No `--use_fast_math`: kernels keep IEEE
//!    division and accurate `expf` unless a family asks otherwise through its own source.
//! 2. key: `<family>-<FNV-1a 128 hex>` over a format tag, the NVRTC version, family, entry,
//!    source, every shared header of [`HEADERS`] (name and text: editing a header recompiles
//!    every kernel) and every option (the arch and defines included). FNV is written here because
//!    std's `DefaultHasher` is not stable across Rust releases, and a disk cache outlives the
//!    binary.
//! 3. memory cache (per device ordinal and key), then the disk cache
//!    `$FMOE_CACHE_DIR/nvrtc/<key>.cubin`, else `$HOME/.cache/fmoe/nvrtc/<key>.cubin` (no disk
//!    cache if neither variable is set), then NVRTC. A cache file has a 32-byte header (magic,
//!    format, kind, length, FNV-1a 64 of the payload) before the image; a file that fails the
//!    check, or whose image the driver rejects, is logged at debug and recompiled over.
//! 4. the image is a CUBIN (`nvrtcGetCUBIN`: real-arch SASS, no driver JIT at load). PTX is only
//!    the fallback for when NVRTC has no CUBIN to give (a virtual `compute_XX` target, which fmoe
//!    does not request today); the driver then JIT-compiles it at load.
//!
//! NVRTC has no libstdc++ and no `cuda.h`: sources use `unsigned int`, `unsigned long long`, and
//! NVRTC's built-in device functions; `cuda_bf16.h`/`cuda_fp16.h`/`cuda_fp8.h` work through the
//! `-I` path. fmoe's own shared device code (`cuda/common/*.cuh`: cp.async, wgmma, mma.sync, fp8
//! encoding, ...) is included as `#include "common/<name>.cuh"` and handed to NVRTC from memory,
//! [`HEADERS`] (`include_str!`, so the binary needs no source tree); tools that compile the files
//! from disk (the CuPy harnesses, `scripts/cuda/cubin_fingerprint.py`) pass
//! `-I crates/fmoe-kernels/cuda` instead.
//!
//! [`compile_only`] compiles a spec for a compute capability without a device or a cache (the
//! CPU-only test `tests/nvrtc_compile.rs` builds every kernel of [`crate::catalog`] with it).
//!
//! Errors: a missing NVRTC library and a failed compilation are [`fmoe_core::Error::Nvrtc`]
//! naming the family (a compilation error carries NVRTC's log); driver failures loading the
//! image are [`fmoe_core::Error::Cuda`].

use std::collections::HashMap;
use std::ffi::{CString, c_char};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Instant;

use fmoe_core::cuda::cudarc::driver::CudaFunction;
use fmoe_core::cuda::cudarc::nvrtc::{Ptx, result as nvrtc_result, sys as nvrtc_sys};
use fmoe_core::cuda::{CudaBackend, cuda_error, cuda_home, nvrtc_version};
use fmoe_core::tracing;

use crate::Result;

/// Root of fmoe's on-disk caches; NVRTC images go to its `nvrtc/` folder.
pub const FMOE_CACHE_DIR: &str = "FMOE_CACHE_DIR";

/// The shared device headers, `(include name, text)`: every program gets them all (NVRTC reads
/// only those a source includes), and every cache key hashes them all. A new file under
/// `cuda/common/` must be added here.
pub const HEADERS: &[(&str, &str)] = &[
    (
        "common/async_copy.cuh",
        include_str!("../cuda/common/async_copy.cuh"),
    ),
    (
        "common/atomics.cuh",
        include_str!("../cuda/common/atomics.cuh"),
    ),
    ("common/elem.cuh", include_str!("../cuda/common/elem.cuh")),
    (
        "common/flash_attention.cuh",
        include_str!("../cuda/common/flash_attention.cuh"),
    ),
    ("common/fp8.cuh", include_str!("../cuda/common/fp8.cuh")),
    (
        "common/k_split.cuh",
        include_str!("../cuda/common/k_split.cuh"),
    ),
    ("common/math.cuh", include_str!("../cuda/common/math.cuh")),
    ("common/pdl.cuh", include_str!("../cuda/common/pdl.cuh")),
    (
        "common/moe_epilogue.cuh",
        include_str!("../cuda/common/moe_epilogue.cuh"),
    ),
    (
        "common/moe_tile.cuh",
        include_str!("../cuda/common/moe_tile.cuh"),
    ),
    (
        "common/mma_sm80.cuh",
        include_str!("../cuda/common/mma_sm80.cuh"),
    ),
    (
        "common/sm90_pipeline.cuh",
        include_str!("../cuda/common/sm90_pipeline.cuh"),
    ),
    (
        "common/sm90_wgmma.cuh",
        include_str!("../cuda/common/sm90_wgmma.cuh"),
    ),
    (
        "common/routing.cuh",
        include_str!("../cuda/common/routing.cuh"),
    ),
];

/// One kernel instantiation to compile and load.
#[derive(Clone, Copy, Debug)]
pub struct KernelSpec<'a> {
    /// The family (snake_case, e.g. `topk_softmax`): names errors, log lines and cache files.
    pub family: &'static str,
    /// The whole `.cu` source.
    pub source: &'static str,
    /// The `extern "C" __global__` function to load, e.g. `fmoe_topk_softmax`.
    pub entry: &'a str,
    /// `-D{name}={value}` options, in this order.
    pub defines: &'a [(&'a str, String)],
}

/// Where [`KernelCache::load_traced`] found a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Already loaded in this cache (this process).
    Memory,
    /// Read from the disk cache and loaded; no compilation.
    Disk,
    /// Compiled by NVRTC now (and written to the disk cache, if there is one).
    Compiled,
}

/// Compiled kernels: loaded functions in memory, images on disk. [`KernelCache::global`] is the
/// one [`load`] uses; separate instances exist for tests and tools.
pub struct KernelCache {
    dir: Option<PathBuf>,
    loaded: Mutex<HashMap<(usize, String), CudaFunction>>,
    /// The hot-path memo in front of `loaded`: keyed by the spec itself (the source by address,
    /// since sources are `'static` `include_str!`s), so a launch that finds its kernel here hashes
    /// a few short strings instead of the whole source. Assumes `CUDA_HOME` does not change while
    /// the process runs (it is part of the full key, not of this one).
    memo: Mutex<HashMap<MemoKey, CudaFunction>>,
}

/// (device ordinal, family, entry, source address and length, defines).
type MemoKey = (
    usize,
    &'static str,
    String,
    usize,
    usize,
    Vec<(String, String)>,
);

fn memo_key(backend: &CudaBackend, spec: &KernelSpec<'_>) -> MemoKey {
    (
        backend.ordinal(),
        spec.family,
        spec.entry.to_string(),
        spec.source.as_ptr() as usize,
        spec.source.len(),
        spec.defines
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    )
}

impl std::fmt::Debug for KernelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelCache")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

thread_local! {
    /// The launch trace of [`trace_launches`] on this thread, while one runs.
    static TRACE: std::cell::RefCell<Option<Vec<String>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` and returns, with its result, the kernels a [`KernelCache`] was asked for on this
/// thread while it ran, in order, each as `family/entry` followed by its defines
/// (`[MODE=1,BM=64]`, omitted when there are none). Every launch of fmoe's kernels loads its
/// function through the cache right before launching it (work is issued on the calling thread),
/// so this is the launch sequence of `f`: a test and debugging aid (e.g. which kernel family a MoE
/// layer really ran). Costs one thread-local lookup per launch while no trace is active.
pub fn trace_launches<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    let outer = TRACE.with(|t| t.borrow_mut().replace(Vec::new()));
    let r = f();
    let launches = TRACE
        .with(|t| std::mem::replace(&mut *t.borrow_mut(), outer))
        .unwrap_or_default();
    TRACE.with(|t| {
        if let Some(o) = t.borrow_mut().as_mut() {
            o.extend(launches.iter().cloned());
        }
    });
    (r, launches)
}

fn record_launch(family: &str, entry: &str, defines: &[(&str, String)]) {
    TRACE.with(|t| {
        if let Some(v) = t.borrow_mut().as_mut() {
            let mut name = format!("{family}/{entry}");
            if !defines.is_empty() {
                let d: Vec<String> = defines.iter().map(|(k, v)| format!("{k}={v}")).collect();
                name.push_str(&format!("[{}]", d.join(",")));
            }
            v.push(name);
        }
    });
}

/// Compiles (or finds in the caches) `entry` of `source` for `backend`'s device, through the
/// process-wide [`KernelCache::global`].
pub fn load(
    backend: &CudaBackend,
    family: &'static str,
    source: &'static str,
    entry: &str,
    defines: &[(&str, String)],
) -> Result<CudaFunction> {
    // An invalid FMOE_DEV_PDL stops every kernel load with the switch's error (PdlLaunch itself
    // cannot report it through the driver's error type).
    crate::launch::pdl_enabled(backend)?;
    let spec = KernelSpec {
        family,
        source,
        entry,
        defines,
    };
    KernelCache::global().load(backend, &spec)
}

impl KernelCache {
    /// A cache with an empty memory map, keeping images under `dir` (created on first write), or
    /// in memory only with `None`.
    pub fn new(dir: Option<PathBuf>) -> KernelCache {
        KernelCache {
            dir,
            loaded: Mutex::new(HashMap::new()),
            memo: Mutex::new(HashMap::new()),
        }
    }

    /// The process-wide cache; its folder comes from the environment at first use (see
    /// [`cache_dir_from`]).
    pub fn global() -> &'static KernelCache {
        static GLOBAL: OnceLock<KernelCache> = OnceLock::new();
        GLOBAL.get_or_init(|| KernelCache::new(cache_dir_from(|k| std::env::var_os(k))))
    }

    /// The folder holding the images, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    pub fn load(&self, backend: &CudaBackend, spec: &KernelSpec<'_>) -> Result<CudaFunction> {
        Ok(self.load_traced(backend, spec)?.0)
    }

    /// As [`Self::load`], also saying which cache level answered.
    pub fn load_traced(
        &self,
        backend: &CudaBackend,
        spec: &KernelSpec<'_>,
    ) -> Result<(CudaFunction, Origin)> {
        let family = spec.family;
        record_launch(family, spec.entry, spec.defines);
        let fast = memo_key(backend, spec);
        if let Some(f) = self
            .memo
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&fast)
        {
            return Ok((f.clone(), Origin::Memory));
        }
        let (major, minor) = nvrtc_version().map_err(|e| with_family(e, family))?;
        let mut options = options(backend.compute_capability(), &cuda_home(), spec.defines);
        options.extend(dev_extra_defines(family)?);
        let key = cache_key(spec, &options, (major, minor));
        let map_key = (backend.ordinal(), key.clone());
        let found = self.lock().get(&map_key).cloned();
        let (function, origin) = match found {
            Some(f) => (f, Origin::Memory),
            None => {
                let (function, origin) = self.load_uncached(backend, spec, &options, &key)?;
                (
                    self.lock().entry(map_key).or_insert(function).clone(),
                    origin,
                )
            }
        };
        self.memo
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(fast, function.clone());
        Ok((function, origin))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(usize, String), CudaFunction>> {
        self.loaded.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn load_uncached(
        &self,
        backend: &CudaBackend,
        spec: &KernelSpec<'_>,
        options: &[String],
        key: &str,
    ) -> Result<(CudaFunction, Origin)> {
        let family = spec.family;
        let path = self.dir.as_ref().map(|d| d.join(format!("{key}.cubin")));
        if let Some(path) = &path {
            match read_image(path) {
                Ok(Some(image)) => match load_function(backend, &image, spec) {
                    Ok(f) => {
                        tracing::debug!("nvrtc: {family}: loaded {}", path.display());
                        return Ok((f, Origin::Disk));
                    }
                    Err(e) => tracing::debug!(
                        "nvrtc: {family}: cached image {} rejected ({e}); recompiling",
                        path.display()
                    ),
                },
                Ok(None) => {}
                Err(why) => tracing::debug!(
                    "nvrtc: {family}: cache file {} is unusable ({why}); recompiling",
                    path.display()
                ),
            }
        }
        let start = Instant::now();
        let image = compile(spec, options)?;
        tracing::debug!(
            "nvrtc: compiled {family} ({}, {} bytes {}) in {:.3} s",
            spec.entry,
            image.bytes.len(),
            image.kind.name(),
            start.elapsed().as_secs_f64()
        );
        let function = load_function(backend, &image, spec)?;
        if let Some(path) = &path
            && let Err(e) = write_image(path, &image)
        {
            tracing::warn!(
                "nvrtc: {family}: cannot write the kernel cache {}: {e}",
                path.display()
            );
        }
        Ok((function, Origin::Compiled))
    }
}

/// The disk cache folder: `$FMOE_CACHE_DIR/nvrtc`, else `$HOME/.cache/fmoe/nvrtc`, else none
/// (empty values count as unset). `lookup` reads a variable (tests pass a map).
pub fn cache_dir_from(lookup: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let var = |k: &str| lookup(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var(FMOE_CACHE_DIR)
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("fmoe")))
        .map(|root| root.join("nvrtc"))
}

/// Dev-only (a `dev-knobs` build): `FMOE_DEV_EXTRA_DEFINES=<family>:<NAME>=<value>[,<NAME>=<value>...][;<family>:...]`
/// appends `-D` options to every program of those families, for timing experiments with a
/// kernel's diagnostic switches (parsed once per process by [`fmoe_core::env::DevOverrides`]; not
/// a user setting; outputs may be wrong).
pub const DEV_EXTRA_DEFINES_ENV: &str = fmoe_core::env::FMOE_DEV_EXTRA_DEFINES;

/// The [`DEV_EXTRA_DEFINES_ENV`] options of `family`, or the overrides' parse error.
fn dev_extra_defines(family: &str) -> crate::Result<Vec<String>> {
    Ok(crate::dev::checked(None)?
        .extra_defines
        .iter()
        .filter(|(f, _)| f == family)
        .map(|(_, d)| d.clone())
        .collect())
}

/// `sm_XY`, with the `a` (architecture-specific features) suffix from compute capability 9 on.
pub fn gpu_arch((major, minor): (u32, u32)) -> String {
    let suffix = if major >= 9 { "a" } else { "" };
    format!("sm_{major}{minor}{suffix}")
}

/// The NVRTC options for a device of compute capability `cc`, in order.
pub fn options(cc: (u32, u32), cuda_home: &Path, defines: &[(&str, String)]) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={}", gpu_arch(cc)),
        "-std=c++17".to_string(),
        format!("-I{}", cuda_home.join("include").display()),
    ];
    o.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    o
}

/// Compiles `spec` for a device of compute capability `cc` (CUDA headers from
/// [`cuda_home`]`/include`) and returns the CUBIN, without a device, a driver or any cache: a
/// build check of the sources (every variant, in CI) and a way to inspect the machine code.
pub fn compile_only(spec: &KernelSpec<'_>, cc: (u32, u32)) -> Result<Vec<u8>> {
    compile_only_with(spec, cc, &cuda_home())
}

/// As [`compile_only`], with the CUDA headers from `cuda_root/include` (e.g. the folder of a pip
/// NVRTC wheel, whose `include` sits beside its `lib`).
pub fn compile_only_with(
    spec: &KernelSpec<'_>,
    cc: (u32, u32),
    cuda_root: &Path,
) -> Result<Vec<u8>> {
    nvrtc_version().map_err(|e| with_family(e, spec.family))?;
    let image = compile(spec, &options(cc, cuda_root, spec.defines))?;
    match image.kind {
        ImageKind::Cubin => Ok(image.bytes),
        ImageKind::Ptx => Err(nvrtc_error(
            spec.family,
            format!("no CUBIN for {} (NVRTC gave PTX only)", gpu_arch(cc)),
        )),
    }
}

/// `<family>-<32 hex digits>`: FNV-1a 128 over everything that changes the image.
pub fn cache_key(spec: &KernelSpec<'_>, options: &[String], nvrtc: (u32, u32)) -> String {
    key_over(spec, HEADERS, options, nvrtc)
}

/// [`cache_key`] with the header table as a parameter (tests vary it).
fn key_over(
    spec: &KernelSpec<'_>,
    headers: &[(&str, &str)],
    options: &[String],
    nvrtc: (u32, u32),
) -> String {
    let mut h = Fnv128::new();
    h.field(FORMAT_TAG.as_bytes());
    h.field(&nvrtc.0.to_le_bytes());
    h.field(&nvrtc.1.to_le_bytes());
    h.field(spec.family.as_bytes());
    h.field(spec.entry.as_bytes());
    h.field(spec.source.as_bytes());
    for (name, text) in headers {
        h.field(name.as_bytes());
        h.field(text.as_bytes());
    }
    for o in options {
        h.field(o.as_bytes());
    }
    format!("{}-{:032x}", spec.family, h.0)
}

/// Bumped when the cache file format or the key's contents change (v2: the shared headers).
const FORMAT_TAG: &str = "fmoe-nvrtc-v2";

/// FNV-1a, 128-bit. Each field is length-prefixed so that ("ab", "c") and ("a", "bc") differ.
struct Fnv128(u128);

impl Fnv128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013B;

    fn new() -> Fnv128 {
        Fnv128(Self::OFFSET)
    }

    fn bytes(&mut self, data: &[u8]) {
        for &b in data {
            self.0 = (self.0 ^ u128::from(b)).wrapping_mul(Self::PRIME);
        }
    }

    fn field(&mut self, data: &[u8]) {
        self.bytes(&(data.len() as u64).to_le_bytes());
        self.bytes(data);
    }
}

/// FNV-1a, 64-bit: the payload checksum of cache files.
fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ImageKind {
    Cubin = 1,
    /// NUL-terminated PTX text.
    Ptx = 2,
}

impl ImageKind {
    fn name(self) -> &'static str {
        match self {
            ImageKind::Cubin => "cubin",
            ImageKind::Ptx => "ptx",
        }
    }
}

#[derive(Debug)]
struct Image {
    kind: ImageKind,
    bytes: Vec<u8>,
}

const MAGIC: &[u8; 8] = b"FMOENVRT";
const FILE_FORMAT: u32 = 1;
const HEADER_LEN: usize = 32;

/// `Ok(None)`: no file. `Err(why)`: a file that is not a valid image (read error, truncated,
/// foreign, checksum mismatch).
fn read_image(path: &Path) -> std::result::Result<Option<Image>, String> {
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let (header, payload) = data
        .split_at_checked(HEADER_LEN)
        .ok_or("shorter than the header")?;
    let u32_at = |i: usize| header[i..i + 4].try_into().map(u32::from_le_bytes);
    let u64_at = |i: usize| header[i..i + 8].try_into().map(u64::from_le_bytes);
    let bad = |_| "malformed header".to_string();
    if &header[..8] != MAGIC || u32_at(8).map_err(bad)? != FILE_FORMAT {
        return Err("not an fmoe NVRTC cache file of this format".into());
    }
    let kind = match u32_at(12).map_err(bad)? {
        1 => ImageKind::Cubin,
        2 => ImageKind::Ptx,
        k => return Err(format!("unknown image kind {k}")),
    };
    if u64_at(16).map_err(bad)? != payload.len() as u64 {
        return Err("length mismatch (truncated?)".into());
    }
    if u64_at(24).map_err(bad)? != fnv1a64(payload) || payload.is_empty() {
        return Err("checksum mismatch".into());
    }
    Ok(Some(Image {
        kind,
        bytes: payload.to_vec(),
    }))
}

/// Writes through a temporary file and a rename, so a concurrent reader sees the whole file or
/// none.
fn write_image(path: &Path, image: &Image) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut data = Vec::with_capacity(HEADER_LEN + image.bytes.len());
    data.extend_from_slice(MAGIC);
    data.extend_from_slice(&FILE_FORMAT.to_le_bytes());
    data.extend_from_slice(&(image.kind as u32).to_le_bytes());
    data.extend_from_slice(&(image.bytes.len() as u64).to_le_bytes());
    data.extend_from_slice(&fnv1a64(&image.bytes).to_le_bytes());
    data.extend_from_slice(&image.bytes);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = path.with_extension(format!("tmp-{}-{nanos}", std::process::id()));
    std::fs::write(&tmp, &data)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

fn load_function(
    backend: &CudaBackend,
    image: &Image,
    spec: &KernelSpec<'_>,
) -> Result<CudaFunction> {
    // cudarc hands the bytes to cuModuleLoadData, which takes a cubin or NUL-terminated PTX.
    let module = backend
        .context()
        .load_module(Ptx::from_binary(image.bytes.clone()))
        .map_err(|e| cuda_error("nvrtc: cuModuleLoadData", e))?;
    // load_function panics on an interior NUL; entries are our own identifiers, but check.
    if spec.entry.contains('\0') {
        return Err(nvrtc_error(spec.family, "entry point name contains NUL"));
    }
    module
        .load_function(spec.entry)
        .map_err(|e| cuda_error("nvrtc: cuModuleGetFunction", e).into())
}

/// Destroys the program however compilation ends.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by create_program and destroyed only here.
        let _ = unsafe { nvrtc_result::destroy_program(self.0) };
    }
}

fn compile(spec: &KernelSpec<'_>, options: &[String]) -> Result<Image> {
    let family = spec.family;
    let err = |msg: String| nvrtc_error(family, msg);
    // cudarc's compile_program panics on an option with a NUL byte: refuse it here.
    if let Some(o) = options.iter().find(|o| o.contains('\0')) {
        return Err(err(format!("option {o:?} contains NUL")));
    }
    let src = CString::new(spec.source).map_err(|_| err("source contains NUL".into()))?;
    let name = CString::new(format!("{family}.cu")).map_err(|_| err("bad family name".into()))?;
    let cstr =
        |s: &str, what: &str| CString::new(s).map_err(|_| err(format!("{what} contains NUL")));
    let header_names = HEADERS
        .iter()
        .map(|(n, _)| cstr(n, "header name"))
        .collect::<Result<Vec<_>>>()?;
    let header_texts = HEADERS
        .iter()
        .map(|(n, t)| cstr(t, n))
        .collect::<Result<Vec<_>>>()?;
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let mut raw = std::mem::MaybeUninit::uninit();
    // SAFETY: every pointer is a NUL-terminated string that outlives the program (`program` is
    // declared after them, so it is destroyed first); both arrays hold HEADERS.len() entries.
    unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            raw.as_mut_ptr(),
            src.as_ptr(),
            name.as_ptr(),
            HEADERS.len() as std::ffi::c_int,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    }
    .result()
    .map_err(|e| err(format!("nvrtcCreateProgram failed: {e:?}")))?;
    // SAFETY: initialized by the successful call above.
    let program = Program(unsafe { raw.assume_init() });
    // SAFETY: `program` is live until dropped at the end of this function.
    let compiled = unsafe { nvrtc_result::compile_program(program.0, options) };
    // SAFETY: as above.
    let log = unsafe { nvrtc_result::get_program_log(program.0) }
        .map(|l| c_chars_to_string(&l))
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(err(format!(
            "compilation failed ({:?}) with options {options:?}:\n{}",
            e.0,
            log.trim_end()
        )));
    }
    if !log.trim().is_empty() {
        tracing::debug!("nvrtc: {family}: compiler log:\n{}", log.trim_end());
    }
    // SAFETY: as above; buffers are sized by the matching *Size call.
    unsafe {
        let mut size = 0usize;
        let has_cubin = nvrtc_sys::nvrtcGetCUBINSize(program.0, &mut size)
            .result()
            .is_ok();
        if has_cubin && size > 0 {
            let mut bytes = vec![0u8; size];
            nvrtc_sys::nvrtcGetCUBIN(program.0, bytes.as_mut_ptr().cast::<c_char>())
                .result()
                .map_err(|e| err(format!("nvrtcGetCUBIN failed: {e:?}")))?;
            return Ok(Image {
                kind: ImageKind::Cubin,
                bytes,
            });
        }
        // No CUBIN (virtual target): PTX, which the driver JIT-compiles at load.
        let ptx = nvrtc_result::get_ptx(program.0)
            .map_err(|e| err(format!("nvrtcGetPTX failed: {e:?}")))?;
        let mut bytes: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
        if bytes.last() != Some(&0) {
            bytes.push(0);
        }
        Ok(Image {
            kind: ImageKind::Ptx,
            bytes,
        })
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn nvrtc_error(family: &'static str, msg: impl Into<String>) -> crate::Error {
    fmoe_core::Error::Nvrtc {
        family,
        msg: msg.into(),
    }
    .into()
}

/// Puts `family` into an [`fmoe_core::Error::Nvrtc`] from [`nvrtc_version`].
fn with_family(e: fmoe_core::Error, family: &'static str) -> crate::Error {
    match e {
        fmoe_core::Error::Nvrtc { msg, .. } => fmoe_core::Error::Nvrtc { family, msg },
        other => other,
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::ffi::OsString;

    fn spec<'a>(defines: &'a [(&'a str, String)]) -> KernelSpec<'a> {
        KernelSpec {
            family: "demo",
            source: "extern \"C\" __global__ void fmoe_demo() {}",
            entry: "fmoe_demo",
            defines,
        }
    }

    #[test]
    fn options_carry_arch_std_include_and_defines_in_order() {
        let d = [("A", "1".to_string()), ("B", "x".to_string())];
        let o = options((9, 0), Path::new("/opt/cuda"), &d);
        assert_eq!(
            o,
            [
                "--gpu-architecture=sm_90a",
                "-std=c++17",
                "-I/opt/cuda/include",
                "-DA=1",
                "-DB=x"
            ]
        );
        assert!(!o.iter().any(|o| o.contains("fast_math")));
        assert_eq!(gpu_arch((8, 9)), "sm_89");
        assert_eq!(gpu_arch((10, 0)), "sm_100a");
    }

    #[test]
    fn cache_key_is_stable_and_covers_every_input() {
        let d = [("A", "1".to_string())];
        let o = options((9, 0), Path::new("/usr/local/cuda"), &d);
        // A fixed value (computed independently, without headers): the key must not change
        // between builds or Rust versions, or every disk cache would go stale.
        assert_eq!(
            key_over(&spec(&d), &[], &o, (13, 0)),
            "demo-82539258584eaa13f86d16041e66fb58"
        );
        // Every shared header, name and text, is in the key.
        let h = [("common/a.cuh", "int a;")];
        let base = key_over(&spec(&d), &h, &o, (13, 0));
        assert_ne!(base, key_over(&spec(&d), &[], &o, (13, 0)));
        assert_ne!(
            base,
            key_over(&spec(&d), &[("common/a.cuh", "int b;")], &o, (13, 0))
        );
        assert_ne!(
            base,
            key_over(&spec(&d), &[("common/b.cuh", "int a;")], &o, (13, 0))
        );
        let k = cache_key(&spec(&d), &o, (13, 0));
        assert_eq!(k, key_over(&spec(&d), HEADERS, &o, (13, 0)));
        assert!(
            k.starts_with("demo-") && k.len() == "demo-".len() + 32,
            "{k}"
        );
        assert_ne!(k, cache_key(&spec(&d), &o, (13, 1)));
        let o2 = options((8, 0), Path::new("/usr/local/cuda"), &d);
        assert_ne!(k, cache_key(&spec(&d), &o2, (13, 0)));
        let mut s = spec(&d);
        s.source = "extern \"C\" __global__ void fmoe_demo() { }";
        assert_ne!(k, cache_key(&s, &o, (13, 0)));
        let mut s = spec(&d);
        s.entry = "fmoe_demo2";
        assert_ne!(k, cache_key(&s, &o, (13, 0)));
    }

    #[test]
    fn launch_traces_nest_and_record_defines() {
        let ((), outer) = trace_launches(|| {
            record_launch("a", "f", &[]);
            let ((), inner) = trace_launches(|| record_launch("b", "g", &[("MODE", "1".into())]));
            assert_eq!(inner, ["b/g[MODE=1]"]);
        });
        assert_eq!(outer, ["a/f", "b/g[MODE=1]"]);
        record_launch("c", "h", &[]); // no trace active: nothing recorded, no panic
    }

    #[test]
    fn fnv_matches_reference_vectors() {
        // Published FNV-1a test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
        let mut h = Fnv128::new();
        h.bytes(b"a");
        assert_eq!(h.0, 0xd228cb696f1a8caf78912b704e4a8964);
    }

    #[test]
    fn cache_dir_prefers_fmoe_cache_dir_then_home() {
        let env = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, OsString> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), OsString::from(v)))
                .collect();
            cache_dir_from(move |k| m.get(k).cloned())
        };
        assert_eq!(
            env(&[(FMOE_CACHE_DIR, "/c"), ("HOME", "/h")]),
            Some(PathBuf::from("/c/nvrtc"))
        );
        assert_eq!(
            env(&[(FMOE_CACHE_DIR, ""), ("HOME", "/h")]),
            Some(PathBuf::from("/h/.cache/fmoe/nvrtc"))
        );
        assert_eq!(env(&[]), None);
    }

    #[test]
    fn cache_files_round_trip_and_reject_corruption() {
        let dir = std::env::temp_dir().join(format!("fmoe-nvrtc-unit-{}", std::process::id()));
        let path = dir.join("k.cubin");
        let image = Image {
            kind: ImageKind::Cubin,
            bytes: b"\x7fELF fake cubin".to_vec(),
        };
        assert!(read_image(&path).unwrap().is_none());
        write_image(&path, &image).unwrap();
        let back = read_image(&path).unwrap().unwrap();
        assert_eq!((back.kind, back.bytes), (image.kind, image.bytes.clone()));

        let mut data = std::fs::read(&path).unwrap();
        *data.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &data).unwrap();
        assert!(read_image(&path).unwrap_err().contains("checksum"));
        std::fs::write(&path, &data[..HEADER_LEN + 3]).unwrap();
        assert!(read_image(&path).unwrap_err().contains("length"));
        std::fs::write(&path, b"garbage").unwrap();
        assert!(read_image(&path).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
