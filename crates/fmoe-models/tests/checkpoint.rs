//! Loading checkpoints: the tiny Mixtral fixture rewritten as shards, as fp8 checkpoints, and
//! broken in every way a download can be broken (missing tensor, wrong shape, wrong dtype,
//! truncated file, bad config.json). Every error must name the problem.

mod common;

use std::path::Path;

use common::{Edit, Fixture, Raw, Tensors, load_err, write};
use fmoe_core::{DType, Device, Tensor};
use fmoe_models::StepLogits;
use fmoe_models::{CausalLm, Checkpoint, Error, LoadFormat, LoadOptions, Result, load};
use fmoe_moe::QuantScheme;
use safetensors::tensor::Dtype;

const FIXTURE: Fixture = Fixture("tiny-mixtral");

fn load_with(dir: &Path, scheme: Option<QuantScheme>) -> Result<Box<dyn CausalLm>> {
    common::load_with(dir, &common::options(scheme))
}

const PROMPT: [u32; 5] = [1, 442, 326, 14, 270];

fn logits(model: &dyn CausalLm) -> Vec<f32> {
    common::prefill(model, PROMPT.to_vec())
}

fn expected_logits() -> Vec<f32> {
    let v = FIXTURE.expected();
    assert_eq!(v["prompt_ids"][0], serde_json::json!(PROMPT));
    serde_json::from_value(v["prefill_logits"][0][0].clone()).unwrap()
}

#[test]
fn checkpoint_reads_names_shapes_and_dtypes() {
    let ck = Checkpoint::open(&FIXTURE.dir()).unwrap();
    let name = "model.layers.0.block_sparse_moe.experts.0.w1.weight";
    assert!(ck.contains(name) && ck.len() > 10);
    let t = ck.get(name).unwrap();
    assert_eq!((t.dims(), t.dtype()), (&[96, 64][..], DType::BF16));
    let e = ck.get_with_shape(name, &[64, 96]).unwrap_err().to_string();
    assert!(
        e.contains(name) && e.contains("[64, 96]") && e.contains("[96, 64]"),
        "{e}"
    );
    let e = ck
        .get_typed(name, &[96, 64], &[DType::F8E4M3])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(name) && e.contains("f8e4m3") && e.contains("bf16"),
        "{e}"
    );
    let e = ck.get("model.no_such.weight").unwrap_err().to_string();
    assert!(
        e.contains("model.no_such.weight") && e.contains("model.safetensors"),
        "{e}"
    );
}

#[test]
fn sharded_checkpoints_load_to_the_same_model() {
    let tensors = FIXTURE.tensors();
    let dir = FIXTURE.model_dir(&Tensors::new(), |_| {});
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let mut shards: [Tensors; 2] = Default::default();
    let mut map = serde_json::Map::new();
    for (i, (name, raw)) in tensors.iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i % 2 + 1);
        shards[i % 2].insert(name.clone(), raw.clone());
        map.insert(name.clone(), file.into());
    }
    for (i, s) in shards.iter().enumerate() {
        write(
            &dir.path()
                .join(format!("model-{:05}-of-00002.safetensors", i + 1)),
            s,
        );
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map.clone()});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let sharded = load_with(dir.path(), None).unwrap();
    let single = load_with(&FIXTURE.dir(), None).unwrap();
    assert_eq!(logits(sharded.as_ref()), logits(single.as_ref()));

    // A tensor the index lists but no shard holds is named, with the index and the shard it
    // is filed under, when the checkpoint is opened.
    let victim = "model.layers.1.self_attn.k_proj.weight";
    for (i, s) in shards.iter_mut().enumerate() {
        if s.remove(victim).is_some() {
            write(
                &dir.path()
                    .join(format!("model-{:05}-of-00002.safetensors", i + 1)),
                s,
            );
        }
    }
    let e = load_err(dir.path());
    assert!(
        e.contains(victim)
            && e.contains("index.json")
            && e.contains(map[victim].as_str().unwrap())
            && e.contains("does not hold it"),
        "{e}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let mut t = FIXTURE.tensors();
    let victim = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
    t.remove(victim).unwrap();
    let dir = FIXTURE.model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(e.contains(victim) && e.contains("model.safetensors"), "{e}");
}

#[test]
fn wrong_shape_names_the_tensor_and_both_shapes() {
    let mut t = FIXTURE.tensors();
    let victim = "model.layers.0.self_attn.q_proj.weight";
    let raw = t.get_mut(victim).unwrap();
    raw.shape = vec![32, 128];
    let dir = FIXTURE.model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(
        e.contains(victim) && e.contains("[32, 128]") && e.contains("[64, 64]"),
        "{e}"
    );
}

#[test]
fn wrong_dtype_names_the_tensor() {
    // An integer dtype safetensors knows but fmoe does not read.
    let mut t = FIXTURE.tensors();
    let victim = "model.norm.weight";
    let raw = t.get_mut(victim).unwrap();
    raw.dtype = Dtype::I16;
    let dir = FIXTURE.model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(e.contains(victim) && e.contains("I16"), "{e}");

    // An fp8 weight in a checkpoint whose config says it is not quantized.
    let mut t = FIXTURE.tensors();
    let victim = "model.layers.0.self_attn.v_proj.weight";
    let raw = t.get_mut(victim).unwrap();
    let q = Tensor::from_f32(
        &raw.to_tensor().to_f32_vec().unwrap(),
        raw.shape.clone(),
        DType::F8E4M3,
        &Device::Cpu,
    )
    .unwrap();
    *raw = Raw::from_tensor(&q);
    let dir = FIXTURE.model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(e.contains(victim) && e.contains("f8e4m3"), "{e}");
}

#[test]
fn truncated_file_is_rejected() {
    let dir = FIXTURE.model_dir(&FIXTURE.tensors(), |_| {});
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    for keep in [bytes.len() - 100, 6, 0] {
        std::fs::write(&path, &bytes[..keep]).unwrap();
        let e = load_err(dir.path());
        assert!(
            e.contains("model.safetensors") && e.contains("not a valid safetensors"),
            "{keep}: {e}"
        );
    }
}

#[test]
fn bad_config_is_rejected() {
    let t = FIXTURE.tensors();
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|c| c["architectures"] = serde_json::json!(["GPT2LMHeadModel"])),
            "unknown architecture `GPT2LMHeadModel`",
        ),
        (
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("hidden_size");
            }),
            "hidden_size",
        ),
        (
            Box::new(|c| c["num_key_value_heads"] = serde_json::json!(3)),
            "num_key_value_heads 3",
        ),
        (
            Box::new(|c| c["quantization_config"] = serde_json::json!({"quant_method": "gptq"})),
            "gptq",
        ),
        (
            Box::new(|c| c["vocab_size"] = serde_json::json!(1000)),
            "model.embed_tokens.weight",
        ),
    ];
    common::assert_config_errors(&FIXTURE, &t, cases);
    let dir = FIXTURE.model_dir(&t, |_| {});
    std::fs::write(dir.path().join("config.json"), "{\"architectures\": [").unwrap();
    let e = load_err(dir.path());
    assert!(
        e.contains("config.json") && e.contains("invalid JSON"),
        "{e}"
    );
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    assert!(load_err(dir.path()).contains("config.json"));
}

#[test]
fn fp8_checkpoints_load_and_stay_within_the_fp8_bound() {
    // Quantize the fixture as Mixtral-FP8 (per tensor) and DeepSeek-style (128×128 blocks)
    // checkpoints would store it: attention and expert linears in e4m3 with scales; router,
    // norms, embeddings and lm_head in bf16.
    let want = expected_logits();
    for block in [false, true] {
        let t = common::quantize_fp8(FIXTURE.tensors(), block, |name, _| {
            name.ends_with("_proj.weight") || name.contains(".experts.")
        });
        let qc = common::fp8_quantization_config(block);
        let dir = FIXTURE.model_dir(&t, |c| c["quantization_config"] = qc);
        let model = load_with(dir.path(), None).unwrap();
        common::assert_within_fp8_bound(&logits(model.as_ref()), &want, block);
        // The checkpoint's experts serve only their own method.
        common::assert_not_served_unquantized(dir.path());
    }
}

fn static_fp8_tensors(base: f32) -> Tensors {
    common::static_fp8(&FIXTURE, base)
}

fn static_config(c: &mut serde_json::Value) {
    c["quantization_config"] = common::static_fp8_quantization_config();
}

#[test]
fn static_fp8_checkpoints_load_and_stay_within_the_fp8_bound() {
    // The MoE inputs of the fixture (post-norm hidden states) stay below ~4 and the SiLU⊙mul
    // intermediates far below: scales for |x| up to 448 · 0.01 = 4.48.
    let want = expected_logits();
    let t = static_fp8_tensors(0.01);
    let dir = FIXTURE.model_dir(&t, static_config);
    let model = load_with(dir.path(), None).unwrap();
    let got = logits(model.as_ref());
    common::assert_within_fp8_bound(&got, &want, false);
    // The static scales are used: the dynamic checkpoint of the same weights differs.
    let dynamic = FIXTURE.model_dir(&t, |c| {
        c["quantization_config"] = common::fp8_quantization_config(false)
    });
    let d = logits(load_with(dynamic.path(), None).unwrap().as_ref());
    assert!(
        common::rel_l2(&got, &d) > 1e-4,
        "static logits equal dynamic ones"
    );
    // A scale far too small saturates the activations: the logits leave the bound.
    let tiny = FIXTURE.model_dir(&static_fp8_tensors(1e-5), static_config);
    let sat = logits(load_with(tiny.path(), None).unwrap().as_ref());
    assert!(common::rel_l2(&sat, &want) > 0.27, "no saturation");
    common::assert_not_served_unquantized(dir.path());
}

#[test]
fn static_fp8_checkpoint_errors_name_the_problem() {
    let name = "model.layers.1.block_sparse_moe.experts.3.w2.input_scale";
    let mut t = static_fp8_tensors(0.01);
    t.remove(name);
    let dir = FIXTURE.model_dir(&t, static_config);
    let e = load_err(dir.path());
    assert!(e.contains(name), "{e}");
    // Block-scaled checkpoints have no static scheme.
    let t = common::quantize_fp8(FIXTURE.tensors(), true, |name, _| {
        name.ends_with("_proj.weight") || name.contains(".experts.")
    });
    let dir = FIXTURE.model_dir(&t, |c| {
        c["quantization_config"] = serde_json::json!({"quant_method": "fp8",
            "activation_scheme": "static", "weight_block_size": [128, 128]})
    });
    let e = load_err(dir.path());
    assert!(e.contains("static") && e.contains("per-tensor"), "{e}");
}

#[test]
fn dummy_weights_run_and_depend_only_on_the_seed() {
    let run = |seed| {
        let opts = LoadOptions {
            format: LoadFormat::Dummy { seed },
            ..LoadOptions::default()
        };
        // Only config.json is read.
        let dir = FIXTURE.model_dir(&Tensors::new(), |_| {});
        std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
        logits(load(dir.path(), &opts).unwrap().model.as_ref())
    };
    let a = run(1);
    assert!(a.iter().all(|v| v.is_finite()));
    assert_eq!(a, run(1));
    assert_ne!(a, run(2));
}

#[test]
fn forward_rejects_bad_input() {
    let model = load_with(&FIXTURE.dir(), None).unwrap();
    let model = model.as_ref();
    let mut pool = common::pool_for(model, 1);
    let err = |tokens: &[u32], past, pool: &mut fmoe_models::KvPool| -> String {
        match common::step(model, pool, &[(tokens, past)], StepLogits::Last) {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        }
    };
    assert!(err(&[1, 512], 0, &mut pool).contains("token id 512"));
    assert!(err(&[], 0, &mut pool).contains("no new tokens"));
    assert!(err(&[1; 257], 0, &mut pool).contains("max_position_embeddings"));
    assert!(err(&[1], 256, &mut pool).contains("max_position_embeddings"));
    // A block table that does not cover the positions, and blocks outside the pool.
    let info = model.info();
    let short = [0u32];
    let step = fmoe_models::SeqStep {
        tokens: &[1; 17],
        past: 0,
        block_table: &short,
        logits: StepLogits::Last,
    };
    let e = fmoe_models::ForwardInput::new(info, 16, 4, &[step]).unwrap_err();
    assert!(e.to_string().contains("need 2 blocks"), "{e}");
    let far = [9u32];
    let step = fmoe_models::SeqStep {
        block_table: &far,
        tokens: &[1],
        ..step
    };
    let e: Error = fmoe_models::ForwardInput::new(info, 16, 4, &[step]).unwrap_err();
    assert!(e.to_string().contains("block 9"), "{e}");
}
