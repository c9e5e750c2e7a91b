//! Bad input to the MoE layer gets an `Err` whose message names the problem (the tensor, the
//! shapes, the value), never a panic. Every case that builds a layer runs for both kernel families.
//!
//! The simplest proof of "no panic" is that each test completes and sees an `Err`.

use fmoe_core::env::FusedSwitches;
use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::routing::TopK;
use fmoe_moe::{CheckpointExperts, FusedMoe, KernelFamily, MoeConfig, QuantScheme, Routing};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

const E: usize = 4;
const K: usize = 64;
const N: usize = 32;
const TOP_K: usize = 2;
const M: usize = 3;
const CPU: Device = Device::Cpu;

fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| StandardNormal.sample(rng))
        .map(|v: f32| v * scale)
        .collect()
}

fn switches(family: KernelFamily) -> FusedSwitches {
    FusedSwitches {
        use_fused: family == KernelFamily::Fused,
        use_fused_moe: true,
        use_fused_fp8_block_scaled_moe: true,
    }
}

fn config() -> MoeConfig {
    MoeConfig {
        num_experts: E,
        top_k: TOP_K,
        hidden: K,
        intermediate: N,
        routing: Routing::Softmax { renormalize: true },
        shared_intermediate: None,
    }
}

fn grouped_config(n_group: usize, topk_group: usize) -> MoeConfig {
    MoeConfig {
        routing: Routing::GroupedSigmoid {
            n_group,
            topk_group,
            renormalize: true,
            routed_scaling_factor: 2.5,
        },
        ..config()
    }
}

/// Random weights of `dims` in `dtype`, scaled by 1/√fan_in.
fn weight(seed: u64, dims: &[usize], dtype: DType) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let fan_in = *dims.last().unwrap();
    let v = randn(
        &mut rng,
        dims.iter().product(),
        1.0 / (fan_in as f32).sqrt(),
    );
    Tensor::from_f32(&v, dims, dtype, &CPU).unwrap()
}

/// Dense bf16 experts: w13 [e, 2n, k], w2 [e, k, n].
fn dense_of(e: usize, k: usize, n: usize) -> CheckpointExperts {
    CheckpointExperts::Dense {
        w13: weight(1, &[e, 2 * n, k], DType::BF16),
        w2: weight(2, &[e, k, n], DType::BF16),
    }
}

fn dense() -> CheckpointExperts {
    dense_of(E, K, N)
}

fn ones(dims: &[usize]) -> Tensor {
    Tensor::from_vec(vec![1.0f32; dims.iter().product()], dims, &CPU).unwrap()
}

/// An fp8 per-tensor checkpoint with the given scale shapes (the valid ones are [E] and [E]).
fn fp8_tensor(w13_scale: &[usize], w2_scale: &[usize]) -> CheckpointExperts {
    CheckpointExperts::Fp8PerTensor {
        w13: weight(3, &[E, 2 * N, K], DType::F8E4M3),
        w13_scale: ones(w13_scale),
        w2: weight(4, &[E, K, N], DType::F8E4M3),
        w2_scale: ones(w2_scale),
    }
}

/// An fp8 block checkpoint for (k, n) with the given scale_inv shapes.
fn fp8_block(
    k: usize,
    n: usize,
    w13_scale_inv: &[usize],
    w2_scale_inv: &[usize],
) -> CheckpointExperts {
    CheckpointExperts::Fp8Block {
        w13: weight(5, &[E, 2 * n, k], DType::F8E4M3),
        w13_scale_inv: ones(w13_scale_inv),
        w2: weight(6, &[E, k, n], DType::F8E4M3),
        w2_scale_inv: ones(w2_scale_inv),
    }
}

/// The valid block scale shape of a [E, rows, cols] weight.
fn block_scale_dims(rows: usize, cols: usize) -> [usize; 3] {
    [E, rows.div_ceil(128), cols.div_ceil(128)]
}

fn x() -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    Tensor::from_f32(&randn(&mut rng, M * K, 1.0), [M, K], DType::BF16, &CPU).unwrap()
}

fn logits() -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    Tensor::from_vec(randn(&mut rng, M * E, 1.0), [M, E], &CPU).unwrap()
}

fn build(
    config: MoeConfig,
    scheme: QuantScheme,
    experts: CheckpointExperts,
    family: KernelFamily,
) -> fmoe_moe::Result<FusedMoe> {
    FusedMoe::new(config, scheme, experts, None, None, &switches(family), CPU)
}

/// A valid softmax layer of `scheme` for `family`.
fn layer(scheme: QuantScheme, family: KernelFamily) -> FusedMoe {
    let layer = build(config(), scheme, dense(), family)
        .unwrap_or_else(|e| panic!("valid {scheme} layer for {family}: {e}"));
    assert_eq!(layer.kernel().family, family);
    layer
}

/// Asserts `r` is an error whose message contains every one of `words`; returns the message.
#[track_caller]
fn expect_err<T>(r: fmoe_moe::Result<T>, case: &str, words: &[&str]) -> String {
    let msg = match r {
        Ok(_) => panic!("{case}: expected an error, got Ok"),
        Err(e) => e.to_string(),
    };
    for w in words {
        assert!(msg.contains(w), "{case}: `{w}` missing from: {msg}");
    }
    eprintln!("{case}: {msg}");
    msg
}

#[test]
fn valid_inputs_work() {
    // The baseline every bad case departs from by one thing.
    for family in KernelFamily::ALL {
        for scheme in QuantScheme::ALL {
            let y = layer(scheme, family).forward(&x(), &logits()).unwrap();
            assert_eq!(y.dims(), &[M, K]);
        }
        let ckpts = [
            (QuantScheme::Fp8PerTensor, fp8_tensor(&[E], &[E])),
            (QuantScheme::Fp8PerTensor, fp8_tensor(&[E, 2], &[E])),
            (
                QuantScheme::Fp8Block,
                fp8_block(K, N, &block_scale_dims(2 * N, K), &block_scale_dims(K, N)),
            ),
        ];
        for (scheme, ckpt) in ckpts {
            let l = build(config(), scheme, ckpt, family).unwrap();
            l.forward(&x(), &logits()).unwrap();
        }
        let bias = ones(&[E]);
        let l = FusedMoe::new(
            grouped_config(2, 1),
            QuantScheme::Unquantized,
            dense(),
            None,
            Some(bias),
            &switches(family),
            CPU,
        )
        .unwrap();
        l.forward(&x(), &logits()).unwrap();
    }
}

#[test]
fn hidden_states_of_the_wrong_width() {
    let bad = Tensor::zeros([M, K + 1], DType::BF16, &CPU).unwrap();
    for family in KernelFamily::ALL {
        for scheme in QuantScheme::ALL {
            let l = layer(scheme, family);
            let case = format!("{scheme} {family} x [3, 65]");
            expect_err(
                l.forward(&bad, &logits()),
                &case,
                &["hidden_states", "65", "[3, 65]"],
            );
            expect_err(
                l.forward_routed(
                    &bad,
                    &fmoe_kernels::routing::topk_softmax(&logits(), 2, true).unwrap(),
                ),
                &case,
                &["hidden_states", "[3, 65]"],
            );
        }
    }
}

#[test]
fn router_logits_of_the_wrong_shape() {
    for family in KernelFamily::ALL {
        let l = layer(QuantScheme::Unquantized, family);
        let wrong_e = Tensor::zeros([M, E + 1], DType::F32, &CPU).unwrap();
        expect_err(
            l.forward(&x(), &wrong_e),
            &format!("{family} logits [3, 5]"),
            &["router_logits", "[3, 5]"],
        );
        let wrong_m = Tensor::zeros([M - 1, E], DType::F32, &CPU).unwrap();
        expect_err(
            l.forward(&x(), &wrong_m),
            &format!("{family} logits [2, 4]"),
            &["router_logits", "[2, 4]"],
        );
        let rank1 = Tensor::zeros([M * E], DType::F32, &CPU).unwrap();
        expect_err(
            l.forward(&x(), &rank1),
            &format!("{family} logits [12]"),
            &["router_logits"],
        );
    }
}

#[test]
fn top_k_out_of_range() {
    for family in KernelFamily::ALL {
        let cfg = MoeConfig {
            top_k: 5,
            ..config()
        };
        expect_err(
            build(cfg, QuantScheme::Unquantized, dense(), family),
            &format!("{family} top_k 5"),
            &["top_k", "5", "4"],
        );
        let cfg = MoeConfig {
            top_k: 0,
            ..config()
        };
        expect_err(
            build(cfg, QuantScheme::Unquantized, dense(), family),
            &format!("{family} top_k 0"),
            &["top_k", "0"],
        );
    }
}

#[test]
fn expert_weights_of_the_wrong_shape() {
    for family in KernelFamily::ALL {
        for scheme in QuantScheme::ALL {
            let case = format!("{scheme} {family}");
            let w13 = CheckpointExperts::Dense {
                w13: weight(1, &[E, 2 * N - 1, K], DType::BF16),
                w2: weight(2, &[E, K, N], DType::BF16),
            };
            expect_err(
                build(config(), scheme, w13, family),
                &format!("{case} w13 [4, 63, 64]"),
                &["w13", "[4, 63, 64]", "[4, 64, 64]"],
            );
            let w2 = CheckpointExperts::Dense {
                w13: weight(1, &[E, 2 * N, K], DType::BF16),
                w2: weight(2, &[E, K, N + 1], DType::BF16),
            };
            expect_err(
                build(config(), scheme, w2, family),
                &format!("{case} w2 [4, 64, 33]"),
                &["w2", "[4, 64, 33]", "[4, 64, 32]"],
            );
            let rank2 = CheckpointExperts::Dense {
                w13: weight(1, &[E * 2 * N, K], DType::BF16),
                w2: weight(2, &[E, K, N], DType::BF16),
            };
            expect_err(
                build(config(), scheme, rank2, family),
                &format!("{case} w13 [256, 64]"),
                &["w13", "[256, 64]"],
            );
        }
    }
}

#[test]
fn wrong_dtypes() {
    for family in KernelFamily::ALL {
        let f8_dense = CheckpointExperts::Dense {
            w13: weight(1, &[E, 2 * N, K], DType::F8E4M3),
            w2: weight(2, &[E, K, N], DType::F8E4M3),
        };
        expect_err(
            build(config(), QuantScheme::Unquantized, f8_dense, family),
            &format!("{family} f8e4m3 dense weights, unquantized"),
            &["w13", "f8e4m3"],
        );
        let u32_dense = CheckpointExperts::Dense {
            w13: weight(1, &[E, 2 * N, K], DType::U32),
            w2: weight(2, &[E, K, N], DType::U32),
        };
        for scheme in QuantScheme::ALL {
            expect_err(
                build(config(), scheme, u32_dense.clone(), family),
                &format!("{family} u32 dense weights, {scheme}"),
                &["w13", "u32"],
            );
        }
        // An fp8 checkpoint whose codes are bf16.
        let bf16_codes = CheckpointExperts::Fp8PerTensor {
            w13: weight(3, &[E, 2 * N, K], DType::BF16),
            w13_scale: ones(&[E]),
            w2: weight(4, &[E, K, N], DType::BF16),
            w2_scale: ones(&[E]),
        };
        expect_err(
            build(config(), QuantScheme::Fp8PerTensor, bf16_codes, family),
            &format!("{family} bf16 codes in an fp8 checkpoint"),
            &["w13", "bf16"],
        );
        for scheme in QuantScheme::ALL {
            let l = layer(scheme, family);
            let x_u32 = Tensor::from_vec(vec![1u32; M * K], [M, K], &CPU).unwrap();
            expect_err(
                l.forward(&x_u32, &logits()),
                &format!("{scheme} {family} u32 hidden_states"),
                &["hidden_states", "u32"],
            );
            let logits_u32 = Tensor::from_vec(vec![1u32; M * E], [M, E], &CPU).unwrap();
            expect_err(
                l.forward(&x(), &logits_u32),
                &format!("{scheme} {family} u32 router_logits"),
                &["router_logits", "u32"],
            );
        }
    }
}

#[test]
fn fp8_scales_of_the_wrong_shape() {
    for family in KernelFamily::ALL {
        let s = QuantScheme::Fp8PerTensor;
        expect_err(
            build(config(), s, fp8_tensor(&[E, 3], &[E]), family),
            &format!("{family} w13_scale [4, 3]"),
            &["w13_scale", "[4, 3]", "[4]", "[4, 2]"],
        );
        expect_err(
            build(config(), s, fp8_tensor(&[E + 1], &[E]), family),
            &format!("{family} w13_scale [5]"),
            &["w13_scale", "[5]", "[4]"],
        );
        for bad in [E - 1, E + 1] {
            expect_err(
                build(config(), s, fp8_tensor(&[E], &[bad]), family),
                &format!("{family} w2_scale [{bad}]"),
                &["w2_scale", &format!("[{bad}]"), "[4]"],
            );
        }

        let s = QuantScheme::Fp8Block;
        let (w13_ok, w2_ok) = (block_scale_dims(2 * N, K), block_scale_dims(K, N));
        // For K = 64, N = 32 every valid block scale is [4, 1, 1]; a wrong shape must say so.
        assert_eq!(w13_ok, [E, 1, 1]);
        expect_err(
            build(config(), s, fp8_block(K, N, &[E, 2, 1], &w2_ok), family),
            &format!("{family} w13_scale_inv [4, 2, 1]"),
            &["w13_scale_inv", "[4, 2, 1]", "[4, 1, 1]"],
        );
        expect_err(
            build(config(), s, fp8_block(K, N, &[E, 1], &w2_ok), family),
            &format!("{family} w13_scale_inv [4, 1]"),
            &["w13_scale_inv", "[4, 1]", "[4, 1, 1]"],
        );
        expect_err(
            build(
                config(),
                s,
                fp8_block(K, N, &w13_ok, &[E - 1, 1, 1]),
                family,
            ),
            &format!("{family} w2_scale_inv [3, 1, 1]"),
            &["w2_scale_inv", "[3, 1, 1]", "[4, 1, 1]"],
        );
        // A layer with several blocks per matrix, where [E, 1, 1] is wrong:
        // w13 [4, 320, 256] needs [4, 3, 2], w2 [4, 256, 160] needs [4, 2, 2].
        let (k, n) = (256, 160);
        let cfg = MoeConfig {
            hidden: k,
            intermediate: n,
            ..config()
        };
        expect_err(
            build(
                cfg.clone(),
                s,
                fp8_block(k, n, &[E, 1, 1], &block_scale_dims(k, n)),
                family,
            ),
            &format!("{family} w13_scale_inv [4, 1, 1] for K=256 N=160"),
            &["w13_scale_inv", "[4, 1, 1]", "[4, 3, 2]"],
        );
        expect_err(
            build(
                cfg.clone(),
                s,
                fp8_block(k, n, &block_scale_dims(2 * n, k), &[E, 1, 1]),
                family,
            ),
            &format!("{family} w2_scale_inv [4, 1, 1] for K=256 N=160"),
            &["w2_scale_inv", "[4, 1, 1]", "[4, 2, 2]"],
        );
        // And that layer works with the right scales.
        let l = build(
            cfg,
            s,
            fp8_block(k, n, &block_scale_dims(2 * n, k), &block_scale_dims(k, n)),
            family,
        )
        .unwrap();
        let xk = Tensor::zeros([M, k], DType::BF16, &CPU).unwrap();
        l.forward(&xk, &logits()).unwrap();
    }
}

#[test]
fn checkpoint_of_another_scheme() {
    for family in KernelFamily::ALL {
        expect_err(
            build(
                config(),
                QuantScheme::Fp8Block,
                fp8_tensor(&[E], &[E]),
                family,
            ),
            &format!("{family} per-tensor checkpoint as fp8-block"),
            &["cannot serve", "fp8-block"],
        );
        let block = fp8_block(K, N, &block_scale_dims(2 * N, K), &block_scale_dims(K, N));
        expect_err(
            build(config(), QuantScheme::Fp8PerTensor, block.clone(), family),
            &format!("{family} block checkpoint as fp8-tensor"),
            &["cannot serve", "fp8-tensor"],
        );
        expect_err(
            build(config(), QuantScheme::Unquantized, block, family),
            &format!("{family} block checkpoint as unquantized"),
            &["dense"],
        );
    }
}

#[test]
fn non_finite_inputs() {
    for family in KernelFamily::ALL {
        for scheme in QuantScheme::ALL {
            let l = layer(scheme, family);
            let topk = fmoe_kernels::routing::topk_softmax(&logits(), TOP_K, true).unwrap();
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let case = format!("{scheme} {family} {bad}");
                let mut v = x().to_f32_vec().unwrap();
                v[5] = bad;
                let xb = Tensor::from_f32(&v, [M, K], DType::BF16, &CPU).unwrap();
                let msg = expect_err(
                    l.forward(&xb, &logits()),
                    &format!("{case} in hidden_states"),
                    &["hidden_states", "5"],
                );
                assert!(msg.contains("index 5"), "{msg}");
                expect_err(
                    l.forward_routed(&xb, &topk),
                    &format!("{case} in hidden_states, routed"),
                    &["hidden_states", "index 5"],
                );
                let mut lv = logits().to_f32_vec().unwrap();
                lv[7] = bad;
                let lb = Tensor::from_vec(lv, [M, E], &CPU).unwrap();
                expect_err(
                    l.forward(&x(), &lb),
                    &format!("{case} in router_logits"),
                    &["router_logits", "7"],
                );
            }
        }
    }
}

#[test]
fn grouped_routing_needs_a_bias_of_e_entries() {
    for family in KernelFamily::ALL {
        let sw = switches(family);
        // No bias: refused at construction or at the first forward, naming the bias.
        let r = FusedMoe::new(
            grouped_config(2, 1),
            QuantScheme::Unquantized,
            dense(),
            None,
            None,
            &sw,
            CPU,
        )
        .and_then(|l| l.forward(&x(), &logits()));
        expect_err(
            r,
            &format!("{family} no bias"),
            &["e_score_correction_bias"],
        );
        for dims in [&[E - 1][..], &[E + 1], &[1, E]] {
            let r = FusedMoe::new(
                grouped_config(2, 1),
                QuantScheme::Unquantized,
                dense(),
                None,
                Some(ones(dims)),
                &sw,
                CPU,
            );
            expect_err(
                r,
                &format!("{family} bias {dims:?}"),
                &["e_score_correction_bias", &format!("{dims:?}")],
            );
        }
        let r = FusedMoe::new(
            grouped_config(2, 1),
            QuantScheme::Unquantized,
            dense(),
            None,
            Some(Tensor::zeros([E], DType::BF16, &CPU).unwrap()),
            &sw,
            CPU,
        );
        expect_err(
            r,
            &format!("{family} bf16 bias"),
            &["e_score_correction_bias", "bf16"],
        );
    }
}

#[test]
fn bad_groups() {
    for family in KernelFamily::ALL {
        for (n_group, topk_group, words) in [
            (3, 1, &["n_group", "3", "4"][..]),
            (0, 1, &["n_group", "0"]),
            (8, 1, &["n_group", "8"]),
            (2, 3, &["topk_group", "3", "2"]),
            (2, 0, &["topk_group", "0"]),
        ] {
            let r = FusedMoe::new(
                grouped_config(n_group, topk_group),
                QuantScheme::Unquantized,
                dense(),
                None,
                Some(ones(&[E])),
                &switches(family),
                CPU,
            );
            expect_err(
                r,
                &format!("{family} n_group {n_group} topk_group {topk_group}"),
                words,
            );
        }
        // top_k larger than the experts of the kept groups (1 group of 2 experts, top_k 3).
        let cfg = MoeConfig {
            top_k: 3,
            ..grouped_config(2, 1)
        };
        let r = FusedMoe::new(
            cfg,
            QuantScheme::Unquantized,
            dense(),
            None,
            Some(ones(&[E])),
            &switches(family),
            CPU,
        );
        expect_err(
            r,
            &format!("{family} top_k 3 > 2 reachable"),
            &["top_k", "3"],
        );
    }
}

fn topk(ids: Vec<u32>, dims: [usize; 2]) -> TopK {
    let n = ids.len();
    TopK {
        ids: Tensor::from_vec(ids, dims, &CPU).unwrap(),
        weights: Tensor::from_vec(vec![0.5f32; n], dims, &CPU).unwrap(),
    }
}

#[test]
fn routed_ids_out_of_range() {
    for family in KernelFamily::ALL {
        for scheme in QuantScheme::ALL {
            let l = layer(scheme, family);
            let t = topk(vec![0, 1, 2, 9, 3, 0], [M, TOP_K]);
            expect_err(
                l.forward_routed(&x(), &t),
                &format!("{scheme} {family} expert 9"),
                &["expert id 9", "4 experts"],
            );
        }
    }
}

#[test]
fn routing_of_the_wrong_shape() {
    for family in KernelFamily::ALL {
        for scheme in QuantScheme::ALL {
            let l = layer(scheme, family);
            let case = format!("{scheme} {family}");
            // ids [2, 2] for x [3, 64].
            expect_err(
                l.forward_routed(&x(), &topk(vec![0, 1, 2, 3], [M - 1, TOP_K])),
                &format!("{case} ids [2, 2]"),
                &["topk_ids", "[2, 2]", "[3, top_k]"],
            );
            // ids of rank 1.
            let t = TopK {
                ids: Tensor::from_vec(vec![0u32; M * TOP_K], [M * TOP_K], &CPU).unwrap(),
                weights: Tensor::from_vec(vec![0.5f32; M * TOP_K], [M * TOP_K], &CPU).unwrap(),
            };
            expect_err(
                l.forward_routed(&x(), &t),
                &format!("{case} ids [6]"),
                &["topk_ids", "[6]"],
            );
            // ids [3, 2] but weights [3, 1].
            let t = TopK {
                ids: Tensor::from_vec(vec![0u32, 1, 2, 3, 0, 1], [M, TOP_K], &CPU).unwrap(),
                weights: Tensor::from_vec(vec![1.0f32; M], [M, 1], &CPU).unwrap(),
            };
            expect_err(
                l.forward_routed(&x(), &t),
                &format!("{case} weights [3, 1]"),
                &["topk_weights", "[3, 1]", "[3, 2]"],
            );
            // ids as f32.
            let t = TopK {
                ids: Tensor::from_vec(vec![0f32; M * TOP_K], [M, TOP_K], &CPU).unwrap(),
                weights: Tensor::from_vec(vec![0.5f32; M * TOP_K], [M, TOP_K], &CPU).unwrap(),
            };
            expect_err(
                l.forward_routed(&x(), &t),
                &format!("{case} f32 ids"),
                &["topk_ids", "f32"],
            );
        }
    }
}

#[test]
fn shared_expert_without_width_and_width_without_expert() {
    let ns = 48;
    for family in KernelFamily::ALL {
        let shared = dense_of(1, K, ns);
        let r = FusedMoe::new(
            config(),
            QuantScheme::Unquantized,
            dense(),
            Some(shared.clone()),
            None,
            &switches(family),
            CPU,
        );
        expect_err(
            r,
            &format!("{family} shared weights, no width"),
            &["shared_intermediate"],
        );
        let cfg = MoeConfig {
            shared_intermediate: Some(ns),
            ..config()
        };
        let r = FusedMoe::new(
            cfg.clone(),
            QuantScheme::Unquantized,
            dense(),
            None,
            None,
            &switches(family),
            CPU,
        );
        expect_err(
            r,
            &format!("{family} width, no shared weights"),
            &["shared_intermediate"],
        );
        // Both given: works.
        let l = FusedMoe::new(
            cfg,
            QuantScheme::Unquantized,
            dense(),
            Some(shared),
            None,
            &switches(family),
            CPU,
        )
        .unwrap();
        l.forward(&x(), &logits()).unwrap();
    }
}
