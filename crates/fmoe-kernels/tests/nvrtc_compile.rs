//! Every CUDA kernel variant of [`fmoe_kernels::catalog`] compiles for sm_90a with NVRTC, through
//! `nvrtc.rs` (its shared headers included), on any machine: no GPU and no driver, only the NVRTC
//! library and the CUDA headers (`cuda_bf16.h` and friends).
//!
//! NVRTC, in order: `FMOE_NVRTC_LIB` (the path of `libnvrtc.so.*`; CUDA headers from the `include`
//! folder beside its `lib` folder, the layout of a toolkit and of the pip wheels
//! `nvidia-cuda-nvrtc` + `nvidia-cuda-runtime`), then the wheels `.ci/run` installs under
//! `.ci/nvrtc`, then fmoe's usual search (loader path, `$CUDA_HOME`) with headers from
//! `$CUDA_HOME/include`. Without NVRTC the compile test prints "skipping: <reason>" and passes,
//! unless `FMOE_REQUIRE_NVRTC=1` (set by `.ci/run` once its install succeeded), which makes a skip
//! a failure. The header-table checks run everywhere.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use fmoe_core::cuda::{cuda_home, nvrtc_version};
use fmoe_kernels::catalog::{self, KernelVariant};
use fmoe_kernels::nvrtc::{HEADERS, compile_only_with};

const HOPPER: (u32, u32) = (9, 0);

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `libnvrtc.so.<major>` of the pip wheels under `.ci/nvrtc`, if `.ci/run` installed them.
fn ci_wheel_lib() -> Option<PathBuf> {
    let nvidia = manifest_dir().join("../../.ci/nvrtc/nvidia");
    let mut libs: Vec<PathBuf> = std::fs::read_dir(nvidia)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("lib")))
        .filter_map(|lib| std::fs::read_dir(lib).ok())
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc.so.") && !n.contains("builtins"))
        })
        .collect();
    libs.sort();
    libs.pop()
}

/// Loads NVRTC (once per process) and returns the CUDA root whose `include` holds the headers, or
/// why there is none.
fn nvrtc_root() -> Result<PathBuf, String> {
    static ROOT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    static LIB: OnceLock<libloading::Library> = OnceLock::new();
    ROOT.get_or_init(|| {
        let named = std::env::var_os("FMOE_NVRTC_LIB")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        let root = match named.or_else(ci_wheel_lib) {
            Some(lib) => {
                // SAFETY: loading NVRTC runs only its initializers. Kept loaded for the process,
                // so NVRTC's own open by soname (cudarc) finds this copy.
                let l = unsafe { libloading::Library::new(&lib) }
                    .map_err(|e| format!("cannot load {}: {e}", lib.display()))?;
                let _ = LIB.set(l);
                lib.parent()
                    .and_then(Path::parent)
                    .map(Path::to_path_buf)
                    .ok_or_else(|| format!("{} has no parent folder", lib.display()))?
            }
            None => cuda_home(),
        };
        let (major, minor) = nvrtc_version().map_err(|e| e.to_string())?;
        let header = root.join("include").join("cuda_bf16.h");
        if !header.exists() {
            return Err(format!(
                "NVRTC {major}.{minor} is loaded but {} does not exist (install the CUDA headers: \
                 pip install nvidia-cuda-runtime, or set CUDA_HOME)",
                header.display()
            ));
        }
        println!(
            "NVRTC {major}.{minor}, CUDA headers from {}",
            header.display()
        );
        Ok(root)
    })
    .clone()
}

/// The CUDA root, or `None` after printing why the test is skipped; panics instead under
/// `FMOE_REQUIRE_NVRTC=1`.
fn root_or_skip() -> Option<PathBuf> {
    match nvrtc_root() {
        Ok(root) => Some(root),
        Err(why) => {
            assert!(
                std::env::var("FMOE_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "FMOE_REQUIRE_NVRTC=1 but {why}"
            );
            println!("skipping: {why}");
            None
        }
    }
}

#[test]
fn every_kernel_variant_compiles_for_sm90a() {
    let Some(root) = root_or_skip() else {
        return;
    };
    let variants = catalog::all();
    let programs = catalog::programs(&variants);
    let next = Mutex::new(programs.iter());
    let failures = Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let Some((program, entries)) = next.lock().unwrap().next() else {
                        break;
                    };
                    let name = program.name();
                    let cubin = match compile_only_with(&program.spec(), HOPPER, &root) {
                        Ok(c) => c,
                        Err(e) => {
                            failures.lock().unwrap().push(format!("{name}: {e}"));
                            continue;
                        }
                    };
                    if !cubin.starts_with(b"\x7fELF") {
                        failures
                            .lock()
                            .unwrap()
                            .push(format!("{name}: not an ELF image"));
                    }
                    // Each entry the launch code loads is a kernel of this image.
                    for entry in entries {
                        let section = format!(".text.{entry}\0");
                        if !cubin
                            .windows(section.len())
                            .any(|w| w == section.as_bytes())
                        {
                            failures
                                .lock()
                                .unwrap()
                                .push(format!("{name}: no kernel `{entry}` in the CUBIN"));
                        }
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    println!(
        "{} kernel variants ({} programs) compiled for sm_90a",
        variants.len(),
        programs.len()
    );
}

#[test]
fn catalog_covers_every_source_and_gemm_config() {
    let variants = catalog::all();
    let families: BTreeSet<&str> = variants.iter().map(|v| v.family).collect();
    let expected = [
        "attention_decode",
        "attention_prefill",
        "copy",
        "elementwise",
        "grouped_topk",
        "kv_append",
        "moe_align",
        "moe_finalize",
        "moe_gemm_bf16",
        "moe_gemm_bf16_sm90",
        "moe_gemm_bf16_sm90_pipe",
        "moe_gemm_bf16_swapab_sm90",
        "moe_gemm_fp8_block_sm90",
        "moe_gemm_fp8_sm90",
        "moe_gemm_fp8_sm90_ws",
        "moe_gemm_fp8_swapab_sm90",
        "moe_unfused",
        "norm",
        "quant_fp8",
        "rotary",
        "topk_softmax",
    ];
    assert_eq!(families, expected.into_iter().collect());
    // Every .cu file is some family's source.
    let cuda = manifest_dir().join("cuda");
    let mut files: Vec<String> = std::fs::read_dir(&cuda)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    files.sort();
    for text in &files {
        assert!(
            variants.iter().any(|v| v.source == text),
            "a .cu file under cuda/ is no family's source:\n{}",
            &text[..text.len().min(200)]
        );
    }
    // Every M tile is aligned for, as the GEMMs need (16: the swap-AB decode kernels).
    for bm in ["16u", "64u", "128u"] {
        assert!(
            variants
                .iter()
                .any(|v| v.family == "moe_align" && v.defines == [("BLOCK_M", bm.to_string())]),
            "{bm}"
        );
    }
    let names: BTreeSet<String> = variants.iter().map(KernelVariant::name).collect();
    assert_eq!(names.len(), variants.len(), "duplicate variants");
}

#[test]
fn source_table_matches_the_cuda_folder_and_names_every_variant() {
    let cuda = manifest_dir().join("cuda");
    let on_disk: BTreeSet<String> = std::fs::read_dir(&cuda)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let table: BTreeSet<String> = catalog::SOURCES
        .iter()
        .map(|(n, _)| n.to_string())
        .collect();
    assert_eq!(table, on_disk, "catalog::SOURCES must list every cuda/*.cu");
    for (name, text) in catalog::SOURCES {
        assert_eq!(
            *text,
            std::fs::read_to_string(cuda.join(name)).unwrap(),
            "{name}"
        );
    }
    for v in catalog::all() {
        assert!(
            v.source_file().is_some(),
            "{}: source not in catalog::SOURCES",
            v.name()
        );
    }
}

#[test]
fn header_table_matches_the_common_folder_and_the_includes() {
    let common = manifest_dir().join("cuda").join("common");
    let on_disk: BTreeSet<String> = std::fs::read_dir(&common)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cuh"))
        .map(|p| format!("common/{}", p.file_name().unwrap().to_string_lossy()))
        .collect();
    let table: BTreeSet<String> = HEADERS.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(
        table, on_disk,
        "nvrtc::HEADERS must list every cuda/common/*.cuh"
    );
    for (name, text) in HEADERS {
        assert_eq!(
            *text,
            std::fs::read_to_string(manifest_dir().join("cuda").join(name)).unwrap(),
            "{name}"
        );
    }
    // Every quoted include of a source or header names a table entry.
    let mut texts: Vec<String> = catalog::all()
        .iter()
        .map(|v| v.source.to_string())
        .collect();
    texts.extend(HEADERS.iter().map(|(_, t)| t.to_string()));
    for text in &texts {
        for line in text.lines() {
            if let Some(rest) = line.trim_start().strip_prefix("#include \"") {
                let name = rest.split('"').next().unwrap();
                assert!(
                    table.contains(name),
                    "#include \"{name}\" is not in nvrtc::HEADERS"
                );
            }
        }
    }
}
