//! What the MoE GPU tests share: cases, seeded inputs, the layer config and switches they build.

#![allow(dead_code)] // each test binary uses its own subset

use fmoe_core::env::FusedSwitches;
use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::routing::TopK;
use fmoe_moe::{KernelFamily, MoeConfig, Routing};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

const CPU: Device = Device::Cpu;

/// The layer's output read back after the checks every GPU layer test makes: on the first CUDA
/// device, bf16, `[m, k]`, and every value finite (a NaN or Inf is an unwritten, poisoned row).
pub fn checked_output(y: &Tensor, m: usize, k: usize, what: &str) -> Vec<f32> {
    assert_eq!(
        (y.device(), y.dtype(), y.dims()),
        (Device::Cuda(0), DType::BF16, &[m, k][..]),
        "{what}"
    );
    let got = y.to_f32_vec().unwrap();
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: y[{i}] = {} (unwritten?)", got[i]);
    }
    got
}

pub fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| StandardNormal.sample(rng))
        .map(|v: f32| v * scale)
        .collect()
}

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub m: usize,
    pub e: usize,
    pub k: usize,
    pub n: usize,
    pub top_k: usize,
}

pub const fn case(m: usize, e: usize, k: usize, n: usize, top_k: usize) -> Case {
    Case { m, e, k, n, top_k }
}

pub fn config(c: &Case) -> MoeConfig {
    MoeConfig {
        num_experts: c.e,
        top_k: c.top_k,
        hidden: c.k,
        intermediate: c.n,
        routing: Routing::Softmax { renormalize: true },
        shared_intermediate: None,
    }
}

pub fn switches(family: KernelFamily) -> FusedSwitches {
    FusedSwitches {
        use_fused: family == KernelFamily::Fused,
        use_fused_moe: true,
        use_fused_fp8_block_scaled_moe: true,
    }
}

/// Host data of one case: x bf16 [M, K], logits f32 [M, E], w13 bf16 [E, 2N, K], w2 bf16 [E, K, N].
pub struct Inputs {
    pub x: Tensor,
    pub logits: Tensor,
    pub w13: Tensor,
    pub w2: Tensor,
}

pub fn inputs(c: &Case, seed: u64) -> Inputs {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x = randn(&mut rng, c.m * c.k, 1.0);
    let logits = randn(&mut rng, c.m * c.e, 1.0);
    let w13 = randn(&mut rng, c.e * 2 * c.n * c.k, 1.0 / (c.k as f32).sqrt());
    let w2 = randn(&mut rng, c.e * c.k * c.n, 1.0 / (c.n as f32).sqrt());
    Inputs {
        x: Tensor::from_f32(&x, [c.m, c.k], DType::BF16, &CPU).unwrap(),
        logits: Tensor::from_vec(logits, [c.m, c.e], &CPU).unwrap(),
        w13: Tensor::from_f32(&w13, [c.e, 2 * c.n, c.k], DType::BF16, &CPU).unwrap(),
        w2: Tensor::from_f32(&w2, [c.e, c.k, c.n], DType::BF16, &CPU).unwrap(),
    }
}

pub fn host_topk(t: &TopK) -> TopK {
    TopK {
        weights: t.weights.to_device(CPU).unwrap(),
        ids: t.ids.to_device(CPU).unwrap(),
    }
}
