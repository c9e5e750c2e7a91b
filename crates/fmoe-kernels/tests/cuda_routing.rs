//! `topk_softmax` and `grouped_topk` on CUDA against their CPU twins, and the NVRTC cache.
//!
//! Without a CUDA device every GPU test prints "skipping: <reason>" and passes, unless
//! `FMOE_REQUIRE_CUDA=1` (GPU CI), which turns a skip into a failure.
//! `no_gpu_is_a_one_line_error` runs everywhere.

use std::path::Path;
use std::sync::Arc;

use fmoe_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use fmoe_core::cuda::{CudaBackend, cuda_backend, set_poison_allocations, test_backend_or_skip};
use fmoe_core::{DType, Device, Error as CoreError, Tensor};
use fmoe_kernels::Error;
use fmoe_kernels::nvrtc::{KernelCache, KernelSpec, Origin};
use fmoe_kernels::routing::{GroupedTopKParams, TopK, grouped_topk, topk_softmax};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

const CUDA: Device = Device::Cuda(0);

#[test]
fn no_gpu_is_a_one_line_error() {
    match cuda_backend(0) {
        Ok(b) => {
            assert_eq!(b.device(), CUDA);
            println!(
                "cuda:0 = {} (sm_{}{})",
                b.name(),
                b.compute_capability().0,
                b.compute_capability().1
            );
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.starts_with("no CUDA device/driver found"),
                "unexpected error: {msg}"
            );
            assert_eq!(msg.lines().count(), 1, "{msg}");
            assert!(matches!(e, CoreError::NoCuda { .. }), "{e:?}");
            // Creating a CUDA tensor fails the same way, and so does routing on it.
            let err = Tensor::zeros([2, 8], DType::F32, &CUDA).unwrap_err();
            assert!(err.to_string().starts_with("no CUDA device/driver found"));
        }
    }
}

/// Logits with frequent exact ties (values on a 1/4 grid, ±0.0 included) in some rows and
/// continuous values in the others, so both the tie rule and the arithmetic are exercised.
fn logits(rng: &mut ChaCha8Rng, m: usize, e: usize) -> Vec<f32> {
    let normal = Normal::new(0.0f32, 2.5).unwrap();
    let mut v = Vec::with_capacity(m * e);
    for row in 0..m {
        let tied = row % 3 == 1;
        for _ in 0..e {
            let x = normal.sample(rng);
            v.push(if tied {
                let q = (x * 4.0).round() / 4.0;
                // Half the zeros negative: -0.0 == +0.0 must tie on the index.
                if q == 0.0 && rng.random::<bool>() {
                    -0.0
                } else {
                    q
                }
            } else {
                x
            });
        }
    }
    v
}

fn host(t: &TopK) -> (Vec<f32>, Vec<u32>) {
    let w = t.weights.to_f32_vec().unwrap();
    let ids = t.ids.to_device(Device::Cpu).unwrap();
    let ids = ids.cpu_slice::<u32>("test", "ids").unwrap().to_vec();
    (w, ids)
}

#[test]
fn topk_softmax_matches_the_cpu_twin() {
    let Some(_backend) = test_backend_or_skip() else {
        return;
    };
    // Every output element the kernel leaves unwritten would read as NaN / u32::MAX.
    set_poison_allocations(true);
    let shapes = [
        (0, 8, 2),
        (1, 8, 2),
        (37, 8, 2),
        (5, 8, 8),
        (3, 1, 1),
        (513, 64, 6),
        (1000, 256, 8),
        (7, 1024, 3),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_70b5);
    for (m, e, k) in shapes {
        let data = logits(&mut rng, m, e);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let cpu_logits = Tensor::from_f32(&data, [m, e], dtype, &Device::Cpu).unwrap();
            let gpu_logits = cpu_logits.to_device(CUDA).unwrap();
            assert_eq!(gpu_logits.device(), CUDA);
            for renormalize in [false, true] {
                let what = format!("M={m} E={e} k={k} {dtype} renormalize={renormalize}");
                let want = topk_softmax(&cpu_logits, k, renormalize).unwrap();
                let got = topk_softmax(&gpu_logits, k, renormalize).unwrap();
                assert_eq!(got.weights.device(), CUDA, "{what}");
                assert_eq!(got.ids.device(), CUDA, "{what}");
                assert_eq!(got.weights.dims(), &[m, k], "{what}");
                assert_eq!(got.ids.dims(), &[m, k], "{what}");
                assert_eq!(got.weights.dtype(), DType::F32, "{what}");
                assert_eq!(got.ids.dtype(), DType::U32, "{what}");
                let (gw, gi) = host(&got);
                let (cw, ci) = host(&want);
                assert!(
                    gi.iter().all(|&i| (i as usize) < e),
                    "{what}: unwritten or bad id"
                );
                assert!(gw.iter().all(|w| w.is_finite()), "{what}: unwritten weight");
                assert_eq!(gi, ci, "{what}: ids differ");
                // The kernel does the twin's arithmetic in the twin's order (same max, same
                // sequential sums, IEEE division); only expf differs from Rust's exp, by at most
                // 2 ulp, which moves a weight by a few ulp: 2e-6 relative is ~16 ulp of room.
                for (j, (&g, &c)) in gw.iter().zip(&cw).enumerate() {
                    let tol = 2e-6 * c.abs().max(f32::MIN_POSITIVE);
                    assert!(
                        (g - c).abs() <= tol,
                        "{what}: weight {j} (row {}): gpu {g:e} cpu {c:e}",
                        j / k
                    );
                }
            }
        }
    }
    set_poison_allocations(false);
}

#[test]
fn non_finite_logits_give_the_cpu_twins_error() {
    let Some(_backend) = test_backend_or_skip() else {
        return;
    };
    let (m, e) = (9, 16);
    let mut data = vec![0.5f32; m * e];
    data[7 * e + 2] = f32::INFINITY;
    data[3 * e + 5] = f32::NAN;
    data[3 * e + 9] = f32::NEG_INFINITY;
    for dtype in [DType::F32, DType::BF16] {
        let cpu_logits = Tensor::from_f32(&data, [m, e], dtype, &Device::Cpu).unwrap();
        let gpu_logits = cpu_logits.to_device(CUDA).unwrap();
        let want = topk_softmax(&cpu_logits, 2, true).unwrap_err();
        let got = topk_softmax(&gpu_logits, 2, true).unwrap_err();
        assert!(
            matches!(
                got,
                Error::Core(CoreError::NonFinite {
                    index: 53, // 3 * 16 + 5
                    ..
                })
            ),
            "{got:?}"
        );
        assert_eq!(got.to_string(), want.to_string());
    }
}

#[test]
fn cuda_tensors_refuse_host_access() {
    let Some(_backend) = test_backend_or_skip() else {
        return;
    };
    let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], &CUDA).unwrap();
    let err = t.cpu_slice::<f32>("some_op", "x").unwrap_err();
    assert!(matches!(err, CoreError::DeviceMismatch { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("some_op") && msg.contains("`x`") && msg.contains("cuda:0"),
        "{msg}"
    );
}

/// `[E]` biases: continuous, on a coarse grid (exact ties between experts whose logits tie), or
/// zero.
fn bias(rng: &mut ChaCha8Rng, e: usize, kind: usize) -> Vec<f32> {
    let normal = Normal::new(0.0f32, 0.3).unwrap();
    (0..e)
        .map(|_| match kind {
            0 => normal.sample(rng),
            1 => (normal.sample(rng) * 4.0).round() / 4.0,
            _ => 0.0,
        })
        .collect()
}

/// Runs `grouped_topk` on the CPU and on the GPU (logits as `dtype`) and checks that the ids are
/// identical and the weights within 1e-6 relative.
fn check_grouped(data: &[f32], b: &[f32], m: usize, dtype: DType, p: &GroupedTopKParams) {
    let e = b.len();
    let what = format!("M={m} E={e} {dtype} {p:?}");
    let cpu_logits = Tensor::from_f32(data, [m, e], dtype, &Device::Cpu).unwrap();
    let cpu_bias = Tensor::from_vec(b.to_vec(), [e], &Device::Cpu).unwrap();
    let want = grouped_topk(&cpu_logits, &cpu_bias, p).unwrap();
    let got = grouped_topk(
        &cpu_logits.to_device(CUDA).unwrap(),
        &cpu_bias.to_device(CUDA).unwrap(),
        p,
    )
    .unwrap();
    let k = p.top_k;
    assert_eq!(got.weights.device(), CUDA, "{what}");
    assert_eq!(got.ids.device(), CUDA, "{what}");
    assert_eq!(got.weights.dims(), &[m, k], "{what}");
    assert_eq!(got.ids.dims(), &[m, k], "{what}");
    assert_eq!(got.weights.dtype(), DType::F32, "{what}");
    assert_eq!(got.ids.dtype(), DType::U32, "{what}");
    let (gw, gi) = host(&got);
    let (cw, ci) = host(&want);
    assert!(
        gi.iter().all(|&i| (i as usize) < e),
        "{what}: unwritten or bad id"
    );
    assert!(gw.iter().all(|w| w.is_finite()), "{what}: unwritten weight");
    if let Some(j) = gi.iter().zip(&ci).position(|(g, c)| g != c) {
        let row = j / k;
        panic!(
            "{what}: ids differ first in row {row}: gpu {:?} cpu {:?}",
            &gi[row * k..row * k + k],
            &ci[row * k..row * k + k]
        );
    }
    // Same selection, same f32 steps; only exp may differ (see grouped_topk.cu), by an ulp where
    // the host's expf misrounds: 1e-6 is ~8 ulp of room.
    for (j, (&g, &c)) in gw.iter().zip(&cw).enumerate() {
        let tol = 1e-6 * c.abs().max(f32::MIN_POSITIVE);
        assert!(
            (g - c).abs() <= tol,
            "{what}: weight {j} (row {}): gpu {g:e} cpu {c:e}",
            j / k
        );
    }
}

fn params(top_k: usize, n_group: usize, topk_group: usize, renormalize: bool) -> GroupedTopKParams {
    GroupedTopKParams {
        top_k,
        n_group,
        topk_group,
        renormalize,
        routed_scaling_factor: 2.5,
    }
}

#[test]
fn grouped_topk_matches_the_cpu_twin_on_deepseek_v3() {
    let Some(_backend) = test_backend_or_skip() else {
        return;
    };
    // Every output element the kernel leaves unwritten would read as NaN / u32::MAX.
    set_poison_allocations(true);
    let e = 256;
    let mut rng = ChaCha8Rng::seed_from_u64(0xdee9_5eed);
    for m in [0, 1, 7, 1000, 16384] {
        let data = logits(&mut rng, m, e);
        for (kind, dtype) in [(0, DType::BF16), (1, DType::F32), (2, DType::F16)] {
            let b = bias(&mut rng, e, kind);
            for renormalize in [true, false] {
                check_grouped(&data, &b, m, dtype, &params(8, 8, 4, renormalize));
            }
        }
    }
    set_poison_allocations(false);
}

#[test]
fn grouped_topk_matches_the_cpu_twin_on_odd_configs() {
    let Some(_backend) = test_backend_or_skip() else {
        return;
    };
    set_poison_allocations(true);
    let mut rng = ChaCha8Rng::seed_from_u64(0x0dd_c0f9);
    // (E, n_group, topk_group, k): E not a power of two, one expert per group, one group, every
    // expert, k past a warp's 32 lanes, the largest E.
    let configs = [
        (160, 8, 3, 6),
        (96, 3, 2, 8),
        (60, 60, 10, 4),
        (64, 1, 1, 8),
        (7, 7, 7, 7),
        (24, 4, 1, 6),
        (256, 8, 8, 40),
        (1024, 32, 4, 16),
        (1, 1, 1, 1),
    ];
    for (e, n_group, topk_group, k) in configs {
        for m in [1, 5, 333] {
            let data = logits(&mut rng, m, e);
            for kind in 0..3 {
                let b = bias(&mut rng, e, kind);
                check_grouped(
                    &data,
                    &b,
                    m,
                    DType::BF16,
                    &params(k, n_group, topk_group, kind != 1),
                );
            }
        }
    }
    // Saturated rows: every score 1 (all tied but for the bias) or 0 (the renormalization guard).
    for x in [200.0f32, -200.0, 0.0] {
        let (m, e) = (3, 256);
        let data = vec![x; m * e];
        for kind in 1..3 {
            let b = bias(&mut rng, e, kind);
            for renormalize in [true, false] {
                check_grouped(&data, &b, m, DType::F32, &params(8, 8, 4, renormalize));
            }
        }
    }
    set_poison_allocations(false);
}

#[test]
fn grouped_topk_non_finite_gives_the_cpu_twins_error() {
    let Some(_backend) = test_backend_or_skip() else {
        return;
    };
    let (m, e) = (9, 16);
    let p = params(2, 4, 2, true);
    let clean = vec![0.5f32; m * e];
    let mut bad_logits = clean.clone();
    bad_logits[7 * e + 2] = f32::INFINITY;
    bad_logits[3 * e + 5] = f32::NAN;
    bad_logits[3 * e + 9] = f32::NEG_INFINITY;
    let clean_bias = vec![0.1f32; e];
    let mut bad_bias = clean_bias.clone();
    bad_bias[11] = f32::NEG_INFINITY;
    bad_bias[13] = f32::NAN;
    // (logits, bias, rows, expected tensor, index): a bad logit wins over a bad bias, as on the
    // CPU; with no rows the bias is still checked.
    let cases = [
        (&bad_logits, &clean_bias, m, "router_logits", 53), // 3 * 16 + 5
        (&bad_logits, &bad_bias, m, "router_logits", 53),
        (&clean, &bad_bias, m, "e_score_correction_bias", 11),
        (&clean, &bad_bias, 0, "e_score_correction_bias", 11),
    ];
    for (data, b, rows, tensor, index) in cases {
        for dtype in [DType::F32, DType::BF16] {
            let cpu_logits =
                Tensor::from_f32(&data[..rows * e], [rows, e], dtype, &Device::Cpu).unwrap();
            let cpu_bias = Tensor::from_vec(b.clone(), [e], &Device::Cpu).unwrap();
            let want = grouped_topk(&cpu_logits, &cpu_bias, &p).unwrap_err();
            let got = grouped_topk(
                &cpu_logits.to_device(CUDA).unwrap(),
                &cpu_bias.to_device(CUDA).unwrap(),
                &p,
            )
            .unwrap_err();
            match &got {
                Error::Core(CoreError::NonFinite {
                    tensor: t,
                    index: i,
                    ..
                }) => assert_eq!((t.as_str(), *i), (tensor, index), "{got}"),
                other => panic!("{other:?}"),
            }
            assert_eq!(got.to_string(), want.to_string());
        }
    }
}

#[test]
fn routing_past_the_kernels_expert_limit_is_unsupported() {
    let Some(_backend) = test_backend_or_skip() else {
        return;
    };
    let e = 1025;
    let logits = Tensor::zeros([2, e], DType::F32, &CUDA).unwrap();
    let b = Tensor::zeros([e], DType::F32, &CUDA).unwrap();
    let errs = [
        topk_softmax(&logits, 2, true).unwrap_err(),
        grouped_topk(&logits, &b, &params(2, 5, 1, true)).unwrap_err(),
    ];
    for err in errs {
        assert!(
            matches!(err, Error::Core(CoreError::Unsupported { .. })),
            "{err:?}"
        );
        assert!(err.to_string().contains("at most 1024 experts"), "{err}");
    }
}

/// A small kernel for the cache test; `SCALE` makes each define set a distinct cache entry.
const DOUBLER: &str = r#"
extern "C" __global__ void fmoe_test_scale(unsigned int* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i * SCALE;
}
"#;

fn cubin_files(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "cubin"))
                .collect()
        })
        .unwrap_or_default()
}

/// Loads through `cache`, runs the kernel, checks `out[i] = i * scale`.
fn load_and_run(backend: &Arc<CudaBackend>, cache: &KernelCache, scale: u32) -> Origin {
    let defines = [("SCALE", format!("{scale}u"))];
    let spec = KernelSpec {
        family: "nvrtc_cache_test",
        source: DOUBLER,
        entry: "fmoe_test_scale",
        defines: &defines,
    };
    let (f, origin) = cache.load_traced(backend, &spec).unwrap();
    let n = 1000u32;
    let stream = backend.stream();
    let mut out = stream.alloc_zeros::<u32>(n as usize).unwrap();
    let mut b = stream.launch_builder(&f);
    b.arg(&mut out).arg(&n);
    // SAFETY: (unsigned int*, unsigned int) as declared; `out` holds n elements.
    unsafe { b.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    let got = stream.clone_dtoh(&out).unwrap();
    assert!(got.iter().enumerate().all(|(i, &v)| v == i as u32 * scale));
    origin
}

/// One test for everything that touches the cache folder, so nothing races on it.
#[test]
fn nvrtc_disk_cache_is_written_reused_and_repaired() {
    let Some(backend) = test_backend_or_skip() else {
        return;
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!(
        "fmoe-nvrtc-cache-test-{}-{nanos}",
        std::process::id()
    ));

    let first = KernelCache::new(Some(dir.clone()));
    assert_eq!(load_and_run(&backend, &first, 3), Origin::Compiled);
    let files = cubin_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(
        files[0]
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("nvrtc_cache_test-")),
        "{files:?}"
    );
    assert_eq!(load_and_run(&backend, &first, 3), Origin::Memory);

    // A fresh memory map over the same folder: a disk hit, no compilation.
    let second = KernelCache::new(Some(dir.clone()));
    assert_eq!(load_and_run(&backend, &second, 3), Origin::Disk);

    // Other defines, other entry.
    assert_eq!(load_and_run(&backend, &second, 5), Origin::Compiled);
    assert_eq!(cubin_files(&dir).len(), 2);

    // A corrupt file is recompiled over, then read again.
    let mut data = std::fs::read(&files[0]).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0x5a;
    std::fs::write(&files[0], &data).unwrap();
    assert_eq!(
        load_and_run(&backend, &KernelCache::new(Some(dir.clone())), 3),
        Origin::Compiled
    );
    assert_eq!(
        load_and_run(&backend, &KernelCache::new(Some(dir.clone())), 3),
        Origin::Disk
    );
    std::fs::write(&files[0], b"short").unwrap();
    assert_eq!(
        load_and_run(&backend, &KernelCache::new(Some(dir.clone())), 3),
        Origin::Compiled
    );
    assert_eq!(cubin_files(&dir).len(), 2);

    // A compile error names the family and carries NVRTC's log.
    let spec = KernelSpec {
        family: "nvrtc_cache_test",
        source: "extern \"C\" __global__ void broken() { this_is_not_cuda; }",
        entry: "broken",
        defines: &[],
    };
    let err = first.load(&backend, &spec).unwrap_err().to_string();
    assert!(
        err.contains("nvrtc_cache_test") && err.contains("this_is_not_cuda"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn random_rows_agree_at_decode_sizes() {
    // Small M (decode) over many seeds, where a per-row indexing slip would show.
    let Some(_backend) = test_backend_or_skip() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    for _ in 0..20 {
        let m = rng.random_range(1..9);
        let e = [8usize, 16, 60, 128, 160][rng.random_range(0..5)];
        let k = rng.random_range(1..=e.min(8));
        let data = logits(&mut rng, m, e);
        let cpu_logits = Tensor::from_f32(&data, [m, e], DType::BF16, &Device::Cpu).unwrap();
        let want = host(&topk_softmax(&cpu_logits, k, true).unwrap());
        let got = host(&topk_softmax(&cpu_logits.to_device(CUDA).unwrap(), k, true).unwrap());
        assert_eq!(got.1, want.1, "M={m} E={e} k={k}");
        for (g, c) in got.0.iter().zip(&want.0) {
            assert!(
                (g - c).abs() <= 2e-6 * c.abs(),
                "M={m} E={e} k={k}: {g} vs {c}"
            );
        }
    }
}
