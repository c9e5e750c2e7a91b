//! The block-scaled prefill GEMM's promotion schedules (`FMOE_DEV_FP8_LARGE` = the default =
//! `promote-ordered` (the halves, the two MMA warpgroups taking turns at issuing), `promote-halves`
//! (issued at will), `promote-drain1|2|4` (quarters in both GEMMs), `promote-gemm2-halves` and
//! `promote-gemm2-ordered` (quarters in GEMM1)) give the same bits: the pipelined 64-row
//! quarters do the same tensor-core products, the same `fmaf` with the same scale products, in
//! the same order as the 128-row halves, so GEMM1's h (codes and group scales) and GEMM2's y must
//! be bit-identical, not merely close. The same holds with the lone warpgroup off
//! (`FMOE_DEV_FP8_LONE_WG=off`): where a tile's rows 64.. are all padding the second MMA
//! warpgroup skips it by default, and the first one's rows must not change.
//!
//! The switch is read once per process, so the test runs this binary again once per schedule
//! (child processes, marked by [`CHILD_ENV`]) and compares what the children write. GEMM2 is
//! deterministic here: top-1 routing and a reduction of 4 K blocks (never split), so each
//! output element gets exactly one atomic add onto zero.
//!
//! Without a CUDA device the test prints "skipping: <reason>" and passes, unless
//! `FMOE_REQUIRE_CUDA=1`, which turns a skip into a failure.

use std::path::Path;
use std::process::Command;

use fmoe_core::cuda::test_backend_or_skip;
use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::moe_align::align_routes;
use fmoe_kernels::moe_gemm::{
    self, ActOperand, ActQuant, DEV_FP8_LARGE_ENV, DEV_FP8_LONE_WG_ENV, WeightOperand,
};
use fmoe_kernels::quant_fp8;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;
use common::randn;

const CUDA: Device = Device::Cuda(0);
/// Set in a child: where it writes its outputs.
const CHILD_ENV: &str = "FMOE_TEST_PROMOTION_DUMP";
const TEST_NAME: &str = "promotion_schedules_give_the_same_bits";

fn bits(t: &Tensor, out: &mut Vec<u8>) {
    for v in t.to_f32_vec().unwrap() {
        out.extend_from_slice(&v.to_bits().to_le_bytes());
    }
}

/// The child's work: one block-scaled GEMM1 + GEMM2 on the large (128-route) tiles. E = 4, top-1,
/// M = 1024 with 40, 300, 193 and 491 routes per expert (last blocks of 40, 44, 65 and 107
/// routes: two all-padding second halves, two live ones); K = 1040 (GEMM1: 9 K blocks, odd, the
/// last ragged; GEMM2's output ragged past 4 tiles of 256); N = 400 (N % 128 = 16: GEMM1's up rows straddle two weight
/// blocks; GEMM2: 4 K blocks, one 2- or 4-block iteration).
fn run_child(path: &Path) {
    let _b = test_backend_or_skip().expect("a child runs only where its parent found the GPU");
    let (m, e, k, n) = (1024usize, 4usize, 1040usize, 400usize);
    let cpu = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(0x9f8);
    let block = |w: &[f32], dims: [usize; 3]| {
        let w = Tensor::from_f32(w, dims, DType::BF16, &cpu).unwrap();
        let (q, scale_inv) = quant_fp8::quantize_block(&w, [128, 128]).unwrap();
        WeightOperand::Fp8Block { q, scale_inv }
    };
    let w13 = block(
        &randn(&mut rng, e * 2 * n * k, 1.0 / (k as f32).sqrt()),
        [e, 2 * n, k],
    );
    let w2 = block(
        &randn(&mut rng, e * k * n, 1.0 / (n as f32).sqrt()),
        [e, k, n],
    );
    let x = Tensor::from_f32(&randn(&mut rng, m * k, 1.0), [m, k], DType::BF16, &cpu).unwrap();
    let counts = [40usize, 300, 193, 491];
    assert_eq!(counts.iter().sum::<usize>(), m);
    let mut ids: Vec<u32> = (0..e as u32)
        .flat_map(|x| std::iter::repeat_n(x, counts[x as usize]))
        .collect();
    for i in (1..m).rev() {
        ids.swap(i, rng.random_range(0..=i));
    }
    let ids = Tensor::from_vec(ids, [m, 1], &cpu).unwrap();
    let tw: Vec<f32> = (0..m).map(|_| rng.random_range(0.1..1.0)).collect();
    let tw = Tensor::from_vec(tw, [m, 1], &cpu).unwrap();

    let a = ActOperand::quantize(&x, ActQuant::Fp8Group)
        .unwrap()
        .to_device(CUDA)
        .unwrap();
    let (w13, w2) = (w13.to_device(CUDA).unwrap(), w2.to_device(CUDA).unwrap());
    let (ids, tw) = (ids.to_device(CUDA).unwrap(), tw.to_device(CUDA).unwrap());
    let routes = align_routes(&ids, e, 128).unwrap();
    let (h, check) =
        moe_gemm::gemm1_silu_mul_quant(&a, &routes, 1, &w13, ActQuant::Fp8Group).unwrap();
    let y = moe_gemm::gemm2_weighted_sum(&h, &routes, &tw, &w2).unwrap();
    check.check().unwrap();
    let ActOperand::Fp8Group { q, scales } = &h else {
        panic!("GEMM1 gave {h:?}, not 1×128 groups");
    };
    let mut out = Vec::new();
    bits(q, &mut out);
    bits(scales, &mut out);
    bits(&y, &mut out);
    assert!(
        y.to_f32_vec().unwrap().iter().all(|v| v.is_finite()),
        "unwritten y"
    );
    std::fs::write(path, out).unwrap();
}

#[test]
fn promotion_schedules_give_the_same_bits() {
    if let Some(path) = std::env::var_os(CHILD_ENV) {
        run_child(Path::new(&path));
        return;
    }
    if test_backend_or_skip().is_none() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut dumps = Vec::new();
    for (schedule, lone) in [
        ("promote-halves", "off"),
        ("promote-halves", "block"),
        ("default", "block"),
        ("default", "off"),
        ("promote-drain1", "block"),
        ("promote-drain2", "block"),
        ("promote-drain4", "block"),
        ("promote-gemm2-halves", "block"),
        ("promote-ordered", "block"),
        ("promote-gemm2-ordered", "block"),
    ] {
        let path = std::env::temp_dir().join(format!(
            "fmoe_promotion_{}_{schedule}_{lone}.bin",
            std::process::id()
        ));
        let v = format!("{schedule}, lone warpgroup {lone}");
        let status = Command::new(&exe)
            .args([TEST_NAME, "--exact", "--test-threads", "1", "--quiet"])
            .env(DEV_FP8_LARGE_ENV, schedule)
            .env(DEV_FP8_LONE_WG_ENV, lone)
            .env(CHILD_ENV, &path)
            .status()
            .unwrap();
        assert!(status.success(), "{v}: child failed ({status})");
        let d = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        dumps.push((v, d));
    }
    let (v0, d0) = &dumps[0];
    assert!(!d0.is_empty());
    for (v, d) in &dumps[1..] {
        assert_eq!(d.len(), d0.len(), "{v} vs {v0}: sizes");
        let diff = d
            .chunks(4)
            .zip(d0.chunks(4))
            .filter(|(a, b)| a != b)
            .count();
        println!("{v} vs {v0}: {diff} of {} words differ", d.len() / 4);
        assert_eq!(diff, 0, "{v} vs {v0}");
    }
}
