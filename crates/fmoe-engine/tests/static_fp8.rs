//! A static per-tensor fp8 checkpoint (tiny Mixtral with `weight_scale` and `input_scale`s, as
//! Mixtral-8x7B-Instruct-FP8 stores them) on the device path: the device path on the CPU twins,
//! and on CUDA (skipped without a GPU unless `FMOE_REQUIRE_CUDA=1`), both kernel families. The
//! host path of the same checkpoint is in fmoe-models' tests/checkpoint.rs.
//!
//! The logits of prompt 0's last position stay within the fp8 MoE layer's worst-case relative
//! 2-norm error (0.27, as in device_golden.rs) of transformers'; the static scales are in use:
//! an `input_scale` 1000× too small saturates the expert activations and leaves that bound.

#[allow(dead_code)]
#[path = "../../fmoe-models/tests/common/mod.rs"]
mod ckpt;
mod common;

use ckpt::rel_l2;
use common::{Expected, Target, forward, load_model_on};
use fmoe_engine::LogitsFor;
use fmoe_moe::{KernelFamily, QuantScheme};

const FP8_BOUND: f32 = 0.27;

fn static_logits(target: Target, base: f32, family: KernelFamily) -> Vec<f32> {
    let fx = ckpt::Fixture("tiny-mixtral");
    let dir = fx.model_dir(&ckpt::static_fp8(&fx, base), |c| {
        c["quantization_config"] = ckpt::static_fp8_quantization_config()
    });
    let exp: Expected = common::read_expected(&common::fixture("tiny-mixtral"));
    let model = load_model_on(target, dir.path(), QuantScheme::Fp8PerTensor, family);
    forward(&model, &exp.prompt_ids[0], LogitsFor::Last)
}

fn static_checkpoint_within_the_fp8_bound(target: Target) {
    let exp: Expected = common::read_expected(&common::fixture("tiny-mixtral"));
    let want = &exp.prefill_logits[0][0];
    for family in KernelFamily::ALL {
        let err = rel_l2(&static_logits(target, 0.01, family), want);
        println!("{target:?} {family}: static fp8 logits rel 2-norm error {err:.3e}");
        assert!(err < FP8_BOUND, "{target:?} {family}: {err}");
        let sat = rel_l2(&static_logits(target, 1e-5, family), want);
        println!("{target:?} {family}: saturated {sat:.3e}");
        assert!(
            sat > FP8_BOUND,
            "{target:?} {family}: no saturation ({sat})"
        );
    }
}

#[test]
fn device_path_on_cpu_runs_a_static_fp8_checkpoint() {
    static_checkpoint_within_the_fp8_bound(Target::DeviceOnCpu);
}

#[test]
fn cuda_runs_a_static_fp8_checkpoint() {
    if !common::cuda_or_skip() {
        return;
    }
    static_checkpoint_within_the_fp8_bound(Target::Cuda);
}
