//! The MoE kernels' CUDA twins against their CPU twins: `moe_align`, the grouped GEMMs' contract
//! errors, the fp8 grouped GEMMs at both M tiles, and `elementwise`.
//!
//! Without a CUDA device every test prints "skipping: <reason>" and passes, unless
//! `FMOE_REQUIRE_CUDA=1`, which turns a skip into a failure. Allocations are poisoned (0xFF), so
//! an output element a kernel never writes shows up as NaN / u32::MAX.

use std::collections::BTreeSet;

use fmoe_core::cuda::test_backend_or_skip;
use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::Error;
use fmoe_kernels::elementwise;
use fmoe_kernels::moe_align::{
    AlignedRoutes, RouteTiling, align_routes, align_routes_tiled, capacity, mixed_blocks,
};
use fmoe_kernels::moe_gemm::{self, ActOperand, ActQuant, CUDA_BLOCK_M, Fp8Scheme, WeightOperand};
use fmoe_kernels::quant_fp8;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;
use common::{hopper_or_skip, randn, rel};

const CUDA: Device = Device::Cuda(0);

fn u32s(t: &Tensor) -> Vec<u32> {
    let t = t.to_device(Device::Cpu).unwrap();
    t.cpu_slice::<u32>("test", "t").unwrap().to_vec()
}

/// The GPU alignment describes the same grouping as the CPU twin: same counts, offsets, total and
/// block experts; the same set of routes in each expert's run (order is unspecified on the GPU);
/// pad in the padding slots and in every slot past the total.
fn assert_same_alignment(gpu: &AlignedRoutes, cpu: &AlignedRoutes, what: &str) {
    let bm = cpu.block_m;
    let total = cpu.slots();
    assert_eq!(gpu.total_host().unwrap(), total, "{what}: total");
    assert_eq!(
        gpu.slots(),
        capacity(cpu.num_routes, cpu.num_experts, bm),
        "{what}"
    );
    assert_eq!(
        u32s(&gpu.expert_counts),
        u32s(&cpu.expert_counts),
        "{what}: counts"
    );
    let offsets = u32s(&cpu.expert_offsets);
    assert_eq!(u32s(&gpu.expert_offsets), offsets, "{what}: offsets");
    let blocks = u32s(&gpu.block_experts);
    assert_eq!(
        &blocks[..total / bm],
        &u32s(&cpu.block_experts)[..],
        "{what}: block experts"
    );
    assert!(
        blocks[total / bm..]
            .iter()
            .all(|&b| b as usize == cpu.num_experts),
        "{what}: blocks past the total"
    );
    let (gs, cs) = (u32s(&gpu.sorted_routes), u32s(&cpu.sorted_routes));
    for e in 0..cpu.num_experts {
        let run = offsets[e] as usize..offsets[e + 1] as usize;
        let g: BTreeSet<u32> = gs[run.clone()].iter().copied().collect();
        let c: BTreeSet<u32> = cs[run.clone()].iter().copied().collect();
        assert_eq!(g, c, "{what}: expert {e}");
        let pads = gs[run].iter().filter(|&&r| r == cpu.pad()).count();
        assert_eq!(
            pads,
            (offsets[e + 1] - offsets[e]) as usize - u32s(&cpu.expert_counts)[e] as usize,
            "{what}: expert {e} padding"
        );
    }
    assert!(
        gs[total..].iter().all(|&r| r == cpu.pad()),
        "{what}: slots past the total"
    );
}

/// Expert ids [m, k] on the CPU, skewed: with probability `p` a route goes to the first half of
/// the experts, so those take most routes and some experts get none.
fn skewed_ids(rng: &mut ChaCha8Rng, m: usize, e: usize, k: usize, p: f32) -> Tensor {
    let ids: Vec<u32> = (0..m * k)
        .map(|_| {
            if rng.random::<f32>() < p {
                rng.random_range(0..e.div_ceil(2)) as u32
            } else {
                rng.random_range(0..e) as u32
            }
        })
        .collect();
    Tensor::from_vec(ids, [m, k], &Device::Cpu).unwrap()
}

/// Mixed tiles: the GPU's two segments describe the CPU twin's grouping. The GPU's tall segment
/// starts at the short tile's capacity (the CPU's right after the short blocks), so tall offsets
/// and blocks are compared relative to each side's segment start; which of an expert's routes fill
/// its short blocks is unspecified on the GPU, so its routes are compared as one set.
fn assert_same_mixed_alignment(gpu: &AlignedRoutes, cpu: &AlignedRoutes, what: &str) {
    let (ct, gt) = (cpu.tall.as_ref().unwrap(), gpu.tall.as_ref().unwrap());
    let (short, tall) = (cpu.block_m, ct.block_m);
    let (r, e) = (cpu.num_routes, cpu.num_experts);
    let short_total = ct.slot_base;
    let tall_total = cpu.slots() - ct.slot_base;
    assert_eq!(
        gpu.total_host().unwrap(),
        short_total,
        "{what}: short total"
    );
    assert_eq!(
        u32s(&gt.total),
        vec![tall_total as u32],
        "{what}: tall total"
    );
    assert_eq!(gt.slot_base, capacity(r, e, short), "{what}: tall base");
    assert_eq!(
        gt.block_base,
        gt.slot_base / short,
        "{what}: tall block base"
    );
    assert_eq!(gpu.slots(), gt.slot_base + capacity(r, e, tall), "{what}");
    let counts = u32s(&cpu.expert_counts);
    assert_eq!(u32s(&gpu.expert_counts), counts, "{what}: counts");
    let (co, go) = (u32s(&cpu.expert_offsets), u32s(&gpu.expert_offsets));
    assert_eq!(go, co, "{what}: short offsets");
    let (cto, gto) = (u32s(&ct.expert_offsets), u32s(&gt.expert_offsets));
    let rebased =
        |v: &[u32], base: usize| -> Vec<usize> { v.iter().map(|&o| o as usize - base).collect() };
    assert_eq!(
        rebased(&gto, gt.slot_base),
        rebased(&cto, ct.slot_base),
        "{what}: tall offsets"
    );
    let (cs, gs) = (u32s(&cpu.sorted_routes), u32s(&gpu.sorted_routes));
    for x in 0..e {
        let c = counts[x] as usize;
        let (a, b) = mixed_blocks(c, short);
        let runs = |s: &[u32], so: &[u32], to: &[u32]| -> Vec<u32> {
            let (s0, t0) = (so[x] as usize, to[x] as usize);
            let mut v = s[s0..s0 + a * short].to_vec();
            v.extend_from_slice(&s[t0..t0 + b * tall]);
            v
        };
        let (g, cv) = (runs(&gs, &go, &gto), runs(&cs, &co, &cto));
        let set = |v: &[u32]| v.iter().copied().collect::<BTreeSet<u32>>();
        assert_eq!(set(&g), set(&cv), "{what}: expert {x}");
        let pads = g.iter().filter(|&&v| v == cpu.pad()).count();
        assert_eq!(pads, g.len() - c, "{what}: expert {x} padding");
        if b > 0 {
            let short_pads = g[..a * short].iter().filter(|&&v| v == cpu.pad()).count();
            assert_eq!(short_pads, 0, "{what}: expert {x}'s short blocks are full");
        }
    }
    let pad_from = |from: usize, to: usize| gs[from..to].iter().all(|&v| v == cpu.pad());
    assert!(
        pad_from(short_total, gt.slot_base),
        "{what}: short slots past the total"
    );
    assert!(
        pad_from(gt.slot_base + tall_total, gs.len()),
        "{what}: tall slots past the total"
    );
    let (cb, gb) = (u32s(&cpu.block_experts), u32s(&gpu.block_experts));
    let none = |b: &[u32]| b.iter().all(|&v| v as usize == e);
    assert_eq!(
        gb[..short_total / short],
        cb[..ct.block_base],
        "{what}: short blocks"
    );
    assert!(
        none(&gb[short_total / short..gt.block_base]),
        "{what}: short blocks past the total"
    );
    let tall_blocks = tall_total / tall;
    assert_eq!(
        gb[gt.block_base..gt.block_base + tall_blocks],
        cb[ct.block_base..],
        "{what}: tall blocks"
    );
    assert!(
        none(&gb[gt.block_base + tall_blocks..]),
        "{what}: tall blocks past the total"
    );
}

#[test]
fn moe_align_mixed_tiles_match_the_cpu_twin() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0xa12);
    let cases: [(usize, usize, usize); 9] = [
        (0, 8, 2),
        (1, 8, 2),
        (5, 4, 4),
        (300, 256, 8),
        (512, 8, 2),
        (4096, 256, 8),
        (5000, 256, 8),
        (16384, 8, 2),
        (3000, 1500, 6),
    ];
    for (m, e, k) in cases {
        let cpu_ids = skewed_ids(&mut rng, m, e, k, 0.7);
        for (short, tall) in [(128, 192), (16, 24)] {
            let what = format!("M={m} E={e} k={k} tiles {short}/{tall}");
            let tiling = RouteTiling::Mixed { short, tall };
            let cpu = align_routes_tiled(&cpu_ids, e, tiling).unwrap();
            let gpu = align_routes_tiled(&cpu_ids.to_device(CUDA).unwrap(), e, tiling).unwrap();
            gpu.check().unwrap();
            assert_eq!(gpu.tiling(), tiling);
            assert_same_mixed_alignment(&gpu, &cpu, &what);
        }
    }
}

#[test]
fn moe_align_matches_the_cpu_twin() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0xa11);
    // E > 1024 gives the block-wide prefix several experts per thread; 4085 is the largest E.
    let cases: [(usize, usize, usize); 11] = [
        (0, 8, 2),
        (1, 8, 2),
        (1, 256, 8),
        (7, 1, 1),
        (5, 4, 4),
        (300, 256, 8),
        (2048, 8, 2),
        (4096, 256, 8),
        (16384, 8, 2),
        (3000, 1500, 6),
        (64, 4085, 2),
    ];
    for (m, e, k) in cases {
        let cpu_ids = skewed_ids(&mut rng, m, e, k, 0.8);
        for bm in [CUDA_BLOCK_M, 16, 192] {
            let what = format!("M={m} E={e} k={k} block_m={bm}");
            let cpu = align_routes(&cpu_ids, e, bm).unwrap();
            let gpu = align_routes(&cpu_ids.to_device(CUDA).unwrap(), e, bm).unwrap();
            assert_eq!(gpu.device(), CUDA);
            gpu.check().unwrap();
            assert_same_alignment(&gpu, &cpu, &what);
            assert_eq!(
                gpu.experts_touched().unwrap(),
                cpu.experts_touched().unwrap()
            );
        }
    }
}

#[test]
fn out_of_range_expert_ids_are_reported_by_check() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let ids = Tensor::from_vec(vec![0u32, 3, 9, 1, 12, 2], [3, 2], &CUDA).unwrap();
    let a = align_routes(&ids, 8, CUDA_BLOCK_M).unwrap(); // no synchronization, no error yet
    let err = a.check().unwrap_err();
    assert!(
        matches!(
            err,
            Error::ExpertId {
                id: 9,
                route: 2,
                experts: 8,
                ..
            }
        ),
        "{err:?}"
    );
    let cpu_err = align_routes(&ids.to_device(Device::Cpu).unwrap(), 8, CUDA_BLOCK_M)
        .unwrap_err()
        .to_string();
    assert_eq!(err.to_string(), cpu_err);
    // The valid routes are still aligned (the bad ones dropped).
    assert_eq!(u32s(&a.expert_counts), vec![1, 1, 1, 1, 0, 0, 0, 0]);
}

#[test]
fn gemm_contract_errors_name_the_dimension_and_the_missing_kernel() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let (m, e, k, n, top_k) = (3, 2, 100, 32, 1);
    let x = Tensor::zeros([m, k], DType::BF16, &CUDA).unwrap();
    let ids = Tensor::zeros([m, top_k], DType::U32, &CUDA).unwrap();
    let w13 = WeightOperand::Plain(Tensor::zeros([e, 2 * n, k], DType::BF16, &CUDA).unwrap());
    let routes = align_routes(&ids, e, CUDA_BLOCK_M).unwrap();
    let err = moe_gemm::gemm1_silu_mul(&ActOperand::Plain(x.clone()), &routes, top_k, &w13)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("K (hidden size") && err.contains("100") && err.contains("multiple of 8"),
        "{err}"
    );
    // Routes aligned to a tile no CUDA kernel has are refused, naming the tiles.
    let (k, x) = (64, Tensor::zeros([m, 64], DType::BF16, &CUDA).unwrap());
    let w13 = WeightOperand::Plain(Tensor::zeros([e, 2 * n, k], DType::BF16, &CUDA).unwrap());
    let odd = align_routes(&ids, e, 48).unwrap();
    let err = moe_gemm::gemm1_silu_mul(&ActOperand::Plain(x.clone()), &odd, top_k, &w13)
        .unwrap_err()
        .to_string();
    assert!(err.contains("block_m = 48") && err.contains("64"), "{err}");
    // f16 and fp8 operands: Unsupported, naming what is missing.
    let w16 = WeightOperand::Plain(Tensor::zeros([e, 2 * n, k], DType::F16, &CUDA).unwrap());
    let err = moe_gemm::gemm1_silu_mul(&ActOperand::Plain(x.clone()), &routes, top_k, &w16)
        .unwrap_err()
        .to_string();
    assert!(err.contains("f16") && err.contains("cuda:0"), "{err}");
    let w8 = WeightOperand::Fp8PerTensor {
        q: Tensor::zeros([e, 2 * n, k], DType::F8E4M3, &CUDA).unwrap(),
        scales: Tensor::full([e], DType::F32, 1.0, &CUDA).unwrap(),
    };
    let err = moe_gemm::gemm1_silu_mul(&ActOperand::Plain(x), &routes, top_k, &w8)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fp8") && err.contains("no CUDA kernel") && err.contains("moe_gemm"),
        "{err}"
    );
}

/// The fp8 grouped GEMMs (GEMM1 with SiLU⊙mul and h's quantization, GEMM2 with the weighted top-k
/// sum) of both schemes, with routes aligned to 16 (the swap-AB decode kernels), 64 (the 64-route
/// tiles) and to 128 (the warp-specialized prefill kernels), at M = 1, 5, 32 and 1500, against the CPU twin on the same quantized operands. Ragged
/// K = 272 and N = 1040 (not multiples of 128 or 256: N % 128 = 16, so GEMM1's up rows straddle
/// two weight blocks), only half the experts routed to, GEMM2 split over K (2 splits of its 9 K
/// blocks at both M).
#[test]
fn fp8_grouped_gemms_match_the_cpu_twin_at_both_m_tiles() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    let cpu = Device::Cpu;
    let (e, k, n, top_k) = (8usize, 272usize, 1040usize, 2usize);
    let mut rng = ChaCha8Rng::seed_from_u64(0xf8);
    let w13f = randn(&mut rng, e * 2 * n * k, 1.0 / (k as f32).sqrt());
    let w2f = randn(&mut rng, e * k * n, 1.0 / (n as f32).sqrt());
    let w13 = Tensor::from_f32(&w13f, [e, 2 * n, k], DType::BF16, &cpu).unwrap();
    let w2 = Tensor::from_f32(&w2f, [e, k, n], DType::BF16, &cpu).unwrap();
    let q = |w: &Tensor, quant| weight_operand(w, quant, e, 8.0);
    let schemes = [
        (
            ActQuant::Fp8PerTensor,
            q(&w13, ActQuant::Fp8PerTensor),
            q(&w2, ActQuant::Fp8PerTensor),
        ),
        (
            ActQuant::Fp8Group,
            q(&w13, ActQuant::Fp8Group),
            q(&w2, ActQuant::Fp8Group),
        ),
    ];
    for m in [1usize, 5, 32, 1500] {
        let x = Tensor::from_f32(&randn(&mut rng, m * k, 1.0), [m, k], DType::BF16, &cpu).unwrap();
        let ids: Vec<u32> = (0..m * top_k)
            .map(|_| rng.random_range(0..e / 2) as u32)
            .collect();
        let ids = Tensor::from_vec(ids, [m, top_k], &cpu).unwrap();
        let tw: Vec<f32> = (0..m * top_k).map(|_| rng.random_range(0.1..1.0)).collect();
        let tw = Tensor::from_vec(tw, [m, top_k], &cpu).unwrap();
        for (quant, w13q, w2q) in &schemes {
            let a = ActOperand::quantize(&x, *quant).unwrap();
            let routes = align_routes(&ids, e, 16).unwrap();
            let (h, _) = moe_gemm::gemm1_silu_mul_quant(&a, &routes, top_k, w13q, *quant).unwrap();
            let want = moe_gemm::gemm2_weighted_sum(&h, &routes, &tw, w2q)
                .unwrap()
                .to_f32_vec()
                .unwrap();
            let ag = a.to_device(CUDA).unwrap();
            let (w13g, w2g) = (w13q.to_device(CUDA).unwrap(), w2q.to_device(CUDA).unwrap());
            let (idsg, twg) = (ids.to_device(CUDA).unwrap(), tw.to_device(CUDA).unwrap());
            for bm in [16, 64, 128] {
                let what = format!("{quant:?} M={m} block_m={bm}");
                let gpu = GpuLayer {
                    a: &ag,
                    ids: &idsg,
                    topk_weights: &twg,
                    w13: &w13g,
                    w2: &w2g,
                };
                gpu.check(*quant, e, bm, &want, &what);
            }
        }
    }
}

/// The bf16 grouped GEMMs (GEMM1 with SiLU⊙mul into bf16 h, GEMM2 with the weighted top-k sum)
/// with routes aligned to 16 (the swap-AB decode kernel on Hopper), 64 and 128, at M = 1, 5, 32
/// and 600, against the CPU twin on the same operands. Ragged K = 200 (not a multiple of the
/// 64-wide K step; GEMM2's 200 outputs inside one 256-row tile) and N = 1000 (GEMM1's last
/// 128-column tile and GEMM2's last K step ragged), only half the experts routed to, GEMM2 split
/// over K at decode sizes. h is compared too: it is the bf16 rounding of the same
/// f32 products (exact in f32), so the tolerance is bf16's, not a GEMM error.
#[test]
fn bf16_grouped_gemms_match_the_cpu_twin_at_every_m_tile() {
    let Some(b) = test_backend_or_skip() else {
        return;
    };
    let cpu = Device::Cpu;
    let (e, k, n, top_k) = (8usize, 200usize, 1000usize, 2usize);
    let mut rng = ChaCha8Rng::seed_from_u64(0xbf16);
    let w13f = randn(&mut rng, e * 2 * n * k, 1.0 / (k as f32).sqrt());
    let w2f = randn(&mut rng, e * k * n, 1.0 / (n as f32).sqrt());
    let w13 =
        WeightOperand::Plain(Tensor::from_f32(&w13f, [e, 2 * n, k], DType::BF16, &cpu).unwrap());
    let w2 = WeightOperand::Plain(Tensor::from_f32(&w2f, [e, k, n], DType::BF16, &cpu).unwrap());
    let (w13g, w2g) = (w13.to_device(CUDA).unwrap(), w2.to_device(CUDA).unwrap());
    let block_ms: &[usize] = if b.compute_capability() == (9, 0) {
        &[16, 64, 128, 192]
    } else {
        &[64]
    };
    for m in [1usize, 5, 32, 600] {
        let x = Tensor::from_f32(&randn(&mut rng, m * k, 1.0), [m, k], DType::BF16, &cpu).unwrap();
        let ids: Vec<u32> = (0..m * top_k)
            .map(|_| rng.random_range(0..e / 2) as u32)
            .collect();
        let ids = Tensor::from_vec(ids, [m, top_k], &cpu).unwrap();
        let tw: Vec<f32> = (0..m * top_k).map(|_| rng.random_range(0.1..1.0)).collect();
        let tw = Tensor::from_vec(tw, [m, top_k], &cpu).unwrap();
        let a = ActOperand::Plain(x.clone());
        let routes = align_routes(&ids, e, 16).unwrap();
        let h_want = moe_gemm::gemm1_silu_mul(&a, &routes, top_k, &w13).unwrap();
        let want =
            moe_gemm::gemm2_weighted_sum(&ActOperand::Plain(h_want.clone()), &routes, &tw, &w2)
                .unwrap()
                .to_f32_vec()
                .unwrap();
        let h_want = h_want.to_f32_vec().unwrap();
        let ag = ActOperand::Plain(x.to_device(CUDA).unwrap());
        let (idsg, twg) = (ids.to_device(CUDA).unwrap(), tw.to_device(CUDA).unwrap());
        for &bm in block_ms {
            let what = format!("bf16 M={m} block_m={bm}");
            let routes = align_routes(&idsg, e, bm).unwrap();
            let h = moe_gemm::gemm1_silu_mul(&ag, &routes, top_k, &w13g).unwrap();
            assert_eq!(
                (h.device(), h.dims()),
                (CUDA, &[m * top_k, n][..]),
                "{what}"
            );
            let hv = h.to_f32_vec().unwrap();
            assert!(hv.iter().all(|v| v.is_finite()), "{what}: unwritten h");
            let herr = rel(&hv, &h_want);
            let y =
                moe_gemm::gemm2_weighted_sum(&ActOperand::Plain(h), &routes, &twg, &w2g).unwrap();
            assert_eq!((y.device(), y.dims()), (CUDA, &[m, k][..]), "{what}");
            let got = y.to_f32_vec().unwrap();
            assert!(got.iter().all(|v| v.is_finite()), "{what}: unwritten y");
            let err = rel(&got, &want);
            println!("{what}: rel_err vs the CPU twin h {herr:.2e} y {err:.2e}");
            // Both sides sum exact f32 products in different orders (≤ (K + N)·2⁻²⁴ apart) and
            // round h to bf16 (a different rounding where the sums straddle a tie: ≤ 2⁻⁸ on
            // those elements): 4e-3 leaves room for both, far below a wrong tile (~1).
            assert!(herr <= 4e-3, "{what}: h {herr:.3e}");
            assert!(err <= 4e-3, "{what}: y {err:.3e}");
        }
    }
}

/// The swap-AB route block the rule picks for `quant`'s kernels (block-scaled fp8 also runs
/// 64-route blocks past the 32-route range).
fn route_block(quant: ActQuant, num_routes: usize, e: usize) -> Option<usize> {
    match quant {
        ActQuant::Fp8Group => moe_gemm::swapab_route_block_for(Fp8Scheme::Block, num_routes, e),
        _ => moe_gemm::swapab_route_block(num_routes, e),
    }
}

/// Smallest and largest M (up to `max_m`) at which the rule runs swap-AB route blocks of `bn`
/// for `top_k` routes per token over `e` experts with `quant`'s kernels.
fn m_range_for_route_block(
    quant: ActQuant,
    bn: usize,
    top_k: usize,
    e: usize,
    max_m: usize,
) -> Option<(usize, usize)> {
    let ms: Vec<usize> = (1..=max_m)
        .filter(|m| route_block(quant, m * top_k, e) == Some(bn))
        .collect();
    Some((*ms.first()?, *ms.last()?))
}

/// `w` [E, rows, cols] as the weight operand `quant`'s kernels take: plain bf16; per-tensor fp8
/// (the codes of one scale, dequantized with a different scale per expert: 1 + i / `spread`
/// times it, so a kernel that mixes up the experts' scales shows); or 128×128 block-scaled fp8.
fn weight_operand(w: &Tensor, quant: ActQuant, e: usize, spread: f32) -> WeightOperand {
    match quant {
        ActQuant::None => WeightOperand::Plain(w.clone()),
        ActQuant::Fp8PerTensor => {
            let (q, s) = quant_fp8::quantize_per_tensor(w).unwrap();
            let s = s.to_f32_vec().unwrap()[0];
            let scales: Vec<f32> = (0..e).map(|i| s * (1.0 + i as f32 / spread)).collect();
            WeightOperand::Fp8PerTensor {
                q,
                scales: Tensor::from_vec(scales, [e], &Device::Cpu).unwrap(),
            }
        }
        ActQuant::Fp8Group => {
            let (q, scale_inv) = quant_fp8::quantize_block(w, [128, 128]).unwrap();
            WeightOperand::Fp8Block { q, scale_inv }
        }
    }
}

/// One layer's expert weights (`quant`'s weight operands) on the CPU and on the GPU: `e` experts,
/// hidden size `k`, intermediate size `n`, per-tensor weight scales that differ per expert.
struct LayerWeights {
    quant: ActQuant,
    e: usize,
    k: usize,
    cpu: (WeightOperand, WeightOperand),
    gpu: (WeightOperand, WeightOperand),
}

impl LayerWeights {
    fn random(rng: &mut ChaCha8Rng, quant: ActQuant, e: usize, k: usize, n: usize) -> Self {
        let cpu = Device::Cpu;
        let w13f = randn(rng, e * 2 * n * k, 1.0 / (k as f32).sqrt());
        let w2f = randn(rng, e * k * n, 1.0 / (n as f32).sqrt());
        let w13 = Tensor::from_f32(&w13f, [e, 2 * n, k], DType::BF16, &cpu).unwrap();
        let w2 = Tensor::from_f32(&w2f, [e, k, n], DType::BF16, &cpu).unwrap();
        let (w13q, w2q) = (
            weight_operand(&w13, quant, e, 4.0),
            weight_operand(&w2, quant, e, 4.0),
        );
        let gpu = (w13q.to_device(CUDA).unwrap(), w2q.to_device(CUDA).unwrap());
        LayerWeights {
            quant,
            e,
            k,
            cpu: (w13q, w2q),
            gpu,
        }
    }

    /// GEMM1 (SiLU ⊙ mul, and the quantization the method needs) then GEMM2 (weighted top-k sum)
    /// over random tokens routed to `ids` ([M · top_k] experts), on the GPU (whose rule must pick
    /// `block_m`) against the CPU twin on the same operands; y is checked finite (outputs are
    /// poisoned) and within the method's tolerance. Returns the relative error.
    fn check_layer(
        &self,
        rng: &mut ChaCha8Rng,
        ids: Vec<u32>,
        top_k: usize,
        block_m: usize,
        what: &str,
    ) -> f64 {
        let (cpu, quant, e, k) = (Device::Cpu, self.quant, self.e, self.k);
        let m = ids.len() / top_k;
        let got_m = moe_gemm::block_m_for(CUDA, 16, m * top_k, e, &self.gpu.0).unwrap();
        assert_eq!(got_m, block_m, "{what}: the layer's block_m");
        let x = Tensor::from_f32(&randn(rng, m * k, 1.0), [m, k], DType::BF16, &cpu).unwrap();
        let ids = Tensor::from_vec(ids, [m, top_k], &cpu).unwrap();
        let tw: Vec<f32> = (0..m * top_k).map(|_| rng.random_range(0.1..1.0)).collect();
        let tw = Tensor::from_vec(tw, [m, top_k], &cpu).unwrap();
        let a = ActOperand::quantize(&x, quant).unwrap();
        let routes = align_routes(&ids, e, 16).unwrap();
        let (h, _) =
            moe_gemm::gemm1_silu_mul_quant(&a, &routes, top_k, &self.cpu.0, quant).unwrap();
        let want = moe_gemm::gemm2_weighted_sum(&h, &routes, &tw, &self.cpu.1)
            .unwrap()
            .to_f32_vec()
            .unwrap();
        let (ag, idsg, twg) = (
            a.to_device(CUDA).unwrap(),
            ids.to_device(CUDA).unwrap(),
            tw.to_device(CUDA).unwrap(),
        );
        let gpu = GpuLayer {
            a: &ag,
            ids: &idsg,
            topk_weights: &twg,
            w13: &self.gpu.0,
            w2: &self.gpu.1,
        };
        gpu.check(quant, e, block_m, &want, what)
    }
}

/// One layer's operands on the GPU: activations (quantized as the method does), routing, weights.
struct GpuLayer<'a> {
    a: &'a ActOperand,
    ids: &'a Tensor,
    topk_weights: &'a Tensor,
    w13: &'a WeightOperand,
    w2: &'a WeightOperand,
}

impl GpuLayer<'_> {
    /// GEMM1 then GEMM2 over routes aligned to `block_m` against `want` (the CPU twin's y):
    /// y is [M, K] on the GPU, finite (outputs are poisoned), within the method's tolerance.
    /// Returns the relative error.
    fn check(&self, quant: ActQuant, e: usize, block_m: usize, want: &[f32], what: &str) -> f64 {
        let (m, top_k) = (self.ids.dims()[0], self.ids.dims()[1]);
        let routes = align_routes(self.ids, e, block_m).unwrap();
        let (h, check) =
            moe_gemm::gemm1_silu_mul_quant(self.a, &routes, top_k, self.w13, quant).unwrap();
        let y = moe_gemm::gemm2_weighted_sum(&h, &routes, self.topk_weights, self.w2).unwrap();
        check.check().unwrap();
        let k = want.len() / m;
        assert_eq!((y.device(), y.dims()), (CUDA, &[m, k][..]), "{what}");
        let got = y.to_f32_vec().unwrap();
        assert!(got.iter().all(|v| v.is_finite()), "{what}: unwritten y");
        let err = rel(&got, want);
        println!("{what}: rel_err vs the CPU twin {err:.2e}");
        // bf16: exact products summed in another order, h rounded to bf16 (4e-3, as the bf16
        // test); per-tensor fp8: the GPU requantizes the bf16-rounded h, the CPU its f32 h (one
        // code step apart where that rounding crosses a boundary), hence 3e-2.
        let tol = match quant {
            ActQuant::None => 4e-3,
            ActQuant::Fp8Group => 1e-2,
            ActQuant::Fp8PerTensor => 3e-2,
        };
        assert!(err <= tol, "{what}: {err:.3e}");
        err
    }
}

/// The swap-AB GEMMs at every route block the rule picks (16, 32 and 64 routes per block = wgmma
/// N, 64 up to [`moe_gemm::SWAPAB_WIDE_ROUTES_PER_EXPERT`] routes per expert, block-scaled fp8 up
/// to [`moe_gemm::SWAPAB_BLOCK_WIDE_ROUTES_PER_EXPERT`]; 64 and 128 everywhere when the dev knobs
/// force them), bf16 and both fp8 schemes, at the smallest and largest M of each block's
/// range, against the CPU twin on the same operands: 8 experts of which only 3 are routed to (5
/// with 0 routes, the routed ones with 2.7x the mean, so several ragged blocks each) and E = 1
/// (every route in one expert); K and N not multiples of 128 (fp8: K = 272, N = 1040; bf16: K =
/// 200, N = 1000), GEMM2 split over K where the grid is small. Outputs are poisoned (NaN) first.
#[test]
fn swap_ab_route_blocks_match_the_cpu_twin() {
    if !hopper_or_skip("the swap-AB GEMM") {
        return;
    }
    let top_k = 2usize;
    let mut rng = ChaCha8Rng::seed_from_u64(0x5a9b);
    let mut covered: BTreeSet<(String, usize)> = BTreeSet::new();
    for (quant, k, n) in [
        (ActQuant::None, 200usize, 1000usize),
        (ActQuant::Fp8PerTensor, 272, 1040),
        (ActQuant::Fp8Group, 272, 1040),
    ] {
        for e in [8usize, 1] {
            let w = LayerWeights::random(&mut rng, quant, e, k, n);
            for bn in moe_gemm::SWAPAB_ROUTE_BLOCKS {
                let Some((lo, hi)) = m_range_for_route_block(quant, bn, top_k, e, 400) else {
                    continue;
                };
                // The range is contiguous and its neighbours run another block (or the tiles).
                for m in lo..=hi {
                    assert_eq!(
                        route_block(quant, m * top_k, e),
                        Some(bn),
                        "{quant:?} M={m}"
                    );
                }
                for m in [lo - 1, hi + 1]
                    .into_iter()
                    .filter(|m| (1..=400).contains(m))
                {
                    assert_ne!(
                        route_block(quant, m * top_k, e),
                        Some(bn),
                        "{quant:?} M={m}"
                    );
                }
                for m in BTreeSet::from([lo, hi]) {
                    let what = format!("{quant:?} E={e} M={m} route block {bn}");
                    // E = 8: experts 1, 4 and 6 only (distinct per token where top_k allows).
                    let routed: &[u32] = if e == 1 { &[0] } else { &[1, 4, 6] };
                    let ids: Vec<u32> = (0..m * top_k)
                        .map(|_| routed[rng.random_range(0..routed.len())])
                        .collect();
                    w.check_layer(&mut rng, ids, top_k, bn, &what);
                    covered.insert((format!("{quant:?}"), bn));
                }
            }
        }
    }
    // Every route block the rule uses ran (16, 32 and 64), or the one the dev knob forces (the
    // device script runs this test once per route block with FMOE_DEV_SWAPAB_BN and
    // FMOE_DEV_SWAPAB_ROUTES set).
    let forced: Option<usize> = std::env::var(moe_gemm::DEV_SWAPAB_BN_ENV)
        .ok()
        .and_then(|v| v.parse().ok());
    // 64-route blocks unless the dev knob ends their range at or before the 32-route one's end.
    let wide = std::env::var(moe_gemm::DEV_SWAPAB_WIDE_ROUTES_ENV)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .is_none_or(|end| end > moe_gemm::SWAPAB_MID_ROUTES_PER_EXPERT);
    for q in ["None", "Fp8PerTensor", "Fp8Group"] {
        let blocks = match forced {
            None if wide => vec![16, 32, 64],
            None => vec![16, 32],
            Some(bn) => vec![bn],
        };
        for bn in blocks {
            assert!(
                covered.contains(&(q.to_string(), bn)),
                "{q}: route block {bn} not run"
            );
        }
    }
}

/// The persistent swap-AB launches (64- and 128-route blocks: one block per SM walks the tiles)
/// where each block walks several tiles of different experts, N tiles and (GEMM2) K splits, so
/// the ring's slots and phases carry across tiles: E = 8 all routed, 40 routes per expert on
/// average (every scheme runs 64-route blocks there by the rule, or the block the device script
/// forces with `FMOE_DEV_SWAPAB_BN`), K = 1040 and N = 4000 (GEMM1 about 13 route blocks × 32 N
/// tiles, over 400 tiles on 132 SMs; GEMM2 13 × 5 tiles split over K, persistent with
/// `FMOE_DEV_SWAPAB_PERSIST=on|rb|dyn`; `dyn|dyn1` claim the tiles from a counter). Against the
/// CPU twin.
#[test]
fn persistent_swap_ab_blocks_walk_many_tiles() {
    if !hopper_or_skip("the swap-AB GEMM") {
        return;
    }
    let (e, k, n, top_k, m) = (8usize, 1040usize, 4000usize, 2usize, 160usize);
    let mut rng = ChaCha8Rng::seed_from_u64(0x9e75);
    for quant in [ActQuant::None, ActQuant::Fp8PerTensor, ActQuant::Fp8Group] {
        let w = LayerWeights::random(&mut rng, quant, e, k, n);
        let block_m = moe_gemm::block_m_for(CUDA, 16, m * top_k, e, &w.gpu.0).unwrap();
        // 64-route blocks by the rule at 40 routes per expert, or the block the knob forces.
        let want = std::env::var(moe_gemm::DEV_SWAPAB_BN_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(64);
        assert_eq!(block_m, want, "{quant:?} at 40 routes per expert");
        let what = format!(
            "{quant:?} E={e} M={m} block_m {block_m} (persistent GEMM1/GEMM2: {}/{})",
            moe_gemm::swapab_persistent(block_m, 1),
            moe_gemm::swapab_persistent(block_m, 2)
        );
        // Two distinct experts per token, uniformly.
        let ids: Vec<u32> = (0..m)
            .flat_map(|_| {
                let first = rng.random_range(0..e as u32);
                let second = (first + rng.random_range(1..e as u32)) % e as u32;
                [first, second]
            })
            .collect();
        w.check_layer(&mut rng, ids, top_k, block_m, &what);
    }
}

#[test]
fn elementwise_kernels_match_their_cpu_twins() {
    let Some(_b) = test_backend_or_skip() else {
        return;
    };
    for n in [0usize, 1, 7, 1000, 100_003] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let what = format!("n={n} {dtype}");
            // randn: same generator; ln/cos/sqrt differ by a few ulps, bf16/f16 rounding may then
            // differ by one ulp of the output type.
            let g = elementwise::randn(&[n], dtype, 0.25, 99, &CUDA).unwrap();
            assert_eq!((g.device(), g.dtype(), g.dims()), (CUDA, dtype, &[n][..]));
            let c = elementwise::randn(&[n], dtype, 0.25, 99, &Device::Cpu).unwrap();
            let (gv, cv) = (g.to_f32_vec().unwrap(), c.to_f32_vec().unwrap());
            let tol = (2.0 * dtype.unit_roundoff() + 1e-5) as f32;
            for (i, (a, b)) in gv.iter().zip(&cv).enumerate() {
                assert!(
                    (a - b).abs() <= tol * b.abs().max(1.0),
                    "{what}: randn[{i}] gpu {a} cpu {b}"
                );
            }
            // cast and add: exact (same f32 arithmetic, one round-to-nearest-even).
            let x = Tensor::from_f32(&cv, [n], DType::F32, &Device::Cpu).unwrap();
            let xg = x.to_device(CUDA).unwrap();
            let cast = elementwise::to_dtype(&xg, dtype).unwrap();
            assert_eq!(cast.device(), CUDA);
            assert_eq!(
                cast.to_f32_vec().unwrap(),
                x.to_dtype(dtype).unwrap().to_f32_vec().unwrap(),
                "{what}: cast"
            );
            let back = elementwise::to_dtype(&cast, DType::F32).unwrap();
            assert_eq!(back.to_f32_vec().unwrap(), cast.to_f32_vec().unwrap());
            let y = elementwise::add(&cast, &cast).unwrap();
            let want = elementwise::add(
                &cast.to_device(Device::Cpu).unwrap(),
                &cast.to_device(Device::Cpu).unwrap(),
            )
            .unwrap();
            assert_eq!(
                y.to_f32_vec().unwrap(),
                want.to_f32_vec().unwrap(),
                "{what}: add"
            );
        }
        let b = elementwise::randn(&[n], DType::BF16, 1.0, 5, &CUDA).unwrap();
        let s = elementwise::sum(&b).unwrap().to_f32_vec().unwrap()[0];
        let want = elementwise::sum(&b.to_device(Device::Cpu).unwrap())
            .unwrap()
            .to_f32_vec()
            .unwrap()[0];
        assert!(
            (s - want).abs() <= 1e-4 * (n as f32).sqrt().max(1.0),
            "n={n}: sum {s} vs {want}"
        );
    }
    // fp8 has no CUDA cast: an error naming what is missing.
    let x = Tensor::zeros([4], DType::F32, &CUDA).unwrap();
    let err = elementwise::to_dtype(&x, DType::F8E4M3)
        .unwrap_err()
        .to_string();
    assert!(err.contains("f8e4m3") && err.contains("cuda:0"), "{err}");
}
