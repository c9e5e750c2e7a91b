//! DeepSeek-V3 against tests/fixtures/tiny-deepseek-v3: both config layouts parse to the same
//! values; YaRN's frequencies, cos/sin factor and MLA softmax scale match transformers'; fp8
//! checkpoints (DeepSeek's 128×128 blocks, with the ragged kv_a block, and per tensor) load and
//! stay within the fp8 bound; broken checkpoints and configs name the tensor or field; dummy
//! weights run with fewer layers. (Logits, greedy and routing against transformers:
//! fmoe-engine's tests/deepseek_v3_golden.rs.)

mod common;

use common::{Edit, Fixture, load_err, load_with};
use fmoe_models::config::RopeScaling;
use fmoe_models::layers::rotary::yarn_mscale;
use fmoe_models::layers::{MlaSpec, RopeStyle, Rotary};
use fmoe_models::{
    CausalLm, DeepseekV3Config, DeepseekV3ForCausalLM, LoadFormat, LoadOptions, ModelConfig, load,
};
use fmoe_moe::QuantScheme;
use safetensors::tensor::Dtype;
use tempfile::TempDir;

const FIXTURE: Fixture = Fixture("tiny-deepseek-v3");

fn config(file: &str) -> DeepseekV3Config {
    match ModelConfig::from_file(&FIXTURE.dir().join(file)).unwrap() {
        ModelConfig::DeepseekV3(c) => c,
        other => panic!("{other:?}"),
    }
}

#[test]
fn both_layouts_parse_to_the_same_config() {
    let (v5, v4) = (config("config.json"), config("config.v4.json"));
    assert_eq!(v5.rope().unwrap(), v4.rope().unwrap());
    assert_eq!(v5.dtype().unwrap(), v4.dtype().unwrap());
    assert_eq!(
        (
            v5.n_routed_experts,
            v5.n_group,
            v5.topk_group,
            v5.q_lora_rank
        ),
        (
            v4.n_routed_experts,
            v4.n_group,
            v4.topk_group,
            v4.q_lora_rank
        )
    );
    assert!(!v5.is_moe_layer(0) && v5.is_moe_layer(1));
    assert!(matches!(
        v5.rope().unwrap().scaling,
        RopeScaling::Yarn { .. }
    ));
}

#[test]
fn yarn_matches_transformers() {
    let exp = expected();
    let want: Vec<f32> = serde_json::from_value(exp["rope"]["inv_freq"].clone()).unwrap();
    let c = config("config.json");
    let rope = c.rope().unwrap();
    let r = Rotary::new(&rope, c.qk_rope_head_dim, RopeStyle::Interleaved);
    for (got, want) in r.inv_freq().iter().zip(&want) {
        assert!(
            (got - want).abs() <= 1e-7 * want.abs().max(1e-3),
            "{got} vs {want}"
        );
    }
    assert_eq!(r.inv_freq().len(), want.len());
    let factor = exp["rope"]["cos_sin_attention_scaling"].as_f64().unwrap();
    assert!((f64::from(r.attention_factor()) - factor).abs() < 1e-6);
    // MLA: softmax scale = (qk_nope + qk_rope)^-0.5 · mscale(factor, mscale_all_dim)².
    let RopeScaling::Yarn {
        factor,
        mscale_all_dim,
        ..
    } = rope.scaling
    else {
        unreachable!()
    };
    let m = yarn_mscale(factor, mscale_all_dim.unwrap_or(0.0));
    let scale = ((c.qk_nope_head_dim + c.qk_rope_head_dim) as f64).powf(-0.5) * m * m;
    let want = exp["rope"]["softmax_scale"].as_f64().unwrap();
    assert!((scale - want).abs() < 1e-9, "{scale} vs {want}");
}

#[test]
fn mla_spec_reads_the_config() {
    let c = config("config.json");
    let spec = MlaSpec::from_config(&c).unwrap();
    assert_eq!(spec.qk_head_dim(), 24);
    assert_eq!(spec.cache_streams(), vec![24, 8]);
    assert!((f64::from(spec.scale) - 0.2646422579642267).abs() < 1e-7);
}

fn expected() -> serde_json::Value {
    FIXTURE.expected()
}

/// Last-position logits of the fixture's prompt 0.
fn logits(model: &dyn CausalLm) -> Vec<f32> {
    let prompt: Vec<u32> = serde_json::from_value(expected()["prompt_ids"][0].clone()).unwrap();
    common::prefill(model, prompt)
}

#[test]
fn the_fixture_loads_and_counts_its_tensors() {
    let c = config("config.json");
    // Every tensor of the fixture is read exactly once (no MTP layers in it).
    assert_eq!(
        DeepseekV3ForCausalLM::num_tensors(&c),
        FIXTURE.tensors().len() as u64
    );
    let loaded = load(&FIXTURE.dir(), &LoadOptions::default()).unwrap();
    let info = loaded.model.info();
    assert_eq!(info.architecture, "DeepseekV3ForCausalLM");
    assert_eq!(info.kv_layout.streams, vec![24, 8]);
    assert_eq!(info.kv_layout.num_layers, 3);
    let want: Vec<f32> =
        serde_json::from_value(expected()["prefill_logits"][0][0].clone()).unwrap();
    let got = logits(loaded.model.as_ref());
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(err < 1e-4, "{err}");
}

#[test]
fn fp8_checkpoints_load_and_stay_within_the_fp8_bound() {
    // Quantize the fixture as DeepSeek's fp8 checkpoint stores it (128×128 blocks: kv_a's 32
    // rows are one ragged block, the experts' 48 rows too), and per tensor: every attention, MLP
    // and expert linear (shared expert included) in e4m3 with scales; router gate, its bias,
    // norms, embeddings and lm_head as they were.
    let want: Vec<f32> =
        serde_json::from_value(expected()["prefill_logits"][0][0].clone()).unwrap();
    for block in [true, false] {
        let t = common::quantize_fp8(FIXTURE.tensors(), block, |name, raw| {
            let quantized =
                name.ends_with("_proj.weight") || name.ends_with("kv_a_proj_with_mqa.weight");
            if quantized {
                // Quantized from bf16.
                assert_eq!(raw.dtype, Dtype::BF16);
            }
            quantized
        });
        let qc = common::fp8_quantization_config(block);
        let dir = FIXTURE.model_dir(&t, |c| c["quantization_config"] = qc);
        let ModelConfig::DeepseekV3(c) =
            ModelConfig::from_file(&dir.path().join("config.json")).unwrap()
        else {
            unreachable!()
        };
        assert_eq!(DeepseekV3ForCausalLM::num_tensors(&c), t.len() as u64);
        let model = load_with(dir.path(), &LoadOptions::default()).unwrap();
        let scheme = if block {
            QuantScheme::Fp8Block
        } else {
            QuantScheme::Fp8PerTensor
        };
        assert_eq!(model.info().moe.map(|m| m.0), Some(scheme));
        common::assert_within_fp8_bound(&logits(model.as_ref()), &want, block);
        common::assert_not_served_unquantized(dir.path());
    }
}

#[test]
fn broken_checkpoints_name_the_tensor() {
    // Missing tensors.
    for victim in [
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.2.mlp.shared_experts.down_proj.weight",
        "model.layers.2.mlp.experts.7.up_proj.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.0.mlp.gate_proj.weight",
    ] {
        let mut t = FIXTURE.tensors();
        t.remove(victim).unwrap();
        let dir = FIXTURE.model_dir(&t, |_| {});
        let e = load_err(dir.path());
        assert!(
            e.contains(victim) && e.contains("not found") && e.contains("model.safetensors"),
            "{e}"
        );
    }
    // kv_a_proj_with_mqa one row short of kv_lora_rank + qk_rope_head_dim.
    let mut t = FIXTURE.tensors();
    let victim = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight";
    let raw = t.get_mut(victim).unwrap();
    assert_eq!(raw.shape, vec![32, 64]);
    raw.shape = vec![31, 64];
    raw.data.truncate(31 * 64 * 2);
    let dir = FIXTURE.model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(
        e.contains(victim) && e.contains("[31, 64]") && e.contains("[32, 64]"),
        "{e}"
    );
    // The bias as an integer tensor.
    let mut t = FIXTURE.tensors();
    let victim = "model.layers.2.mlp.gate.e_score_correction_bias";
    t.get_mut(victim).unwrap().dtype = Dtype::I32;
    let dir = FIXTURE.model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(e.contains(victim) && e.contains("I32"), "{e}");
    // q_lora_rank null: the model wants a plain q_proj.
    let dir = FIXTURE.model_dir(&FIXTURE.tensors(), |c| {
        c["q_lora_rank"] = serde_json::Value::Null
    });
    let e = load_err(dir.path());
    assert!(e.contains("model.layers.0.self_attn.q_proj.weight"), "{e}");
}

#[test]
fn bad_configs_name_the_field() {
    let t = FIXTURE.tensors();
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|c| c["n_group"] = 3.into()), "n_group 3"),
        (Box::new(|c| c["topk_group"] = 3.into()), "topk_group 3"),
        (
            Box::new(|c| c["num_experts_per_tok"] = 5.into()),
            "num_experts_per_tok 5",
        ),
        (
            Box::new(|c| c["qk_rope_head_dim"] = 7.into()),
            "qk_rope_head_dim 7",
        ),
        (Box::new(|c| c["q_lora_rank"] = 0.into()), "q_lora_rank"),
        (
            Box::new(|c| c["scoring_func"] = "softmax".into()),
            "scoring_func `softmax`",
        ),
        (
            Box::new(|c| c["kv_lora_rank"] = 25.into()),
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        ),
    ];
    common::assert_config_errors(&FIXTURE, &t, cases);
}

#[test]
fn dummy_weights_run_with_fewer_layers() {
    // Only config.json is read; `num_layers` keeps the first N layers (1 dense + 1 MoE here).
    let dir = TempDir::new().unwrap();
    std::fs::copy(
        FIXTURE.dir().join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let run = |seed, num_layers, q_lora: bool| {
        if !q_lora {
            let text = std::fs::read_to_string(FIXTURE.dir().join("config.json")).unwrap();
            let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
            cfg["q_lora_rank"] = serde_json::Value::Null;
            std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
        }
        let opts = LoadOptions {
            format: LoadFormat::Dummy { seed },
            num_layers,
            ..LoadOptions::default()
        };
        let loaded = load(dir.path(), &opts).unwrap();
        let n = loaded.model.info().kv_layout.num_layers;
        (logits(loaded.model.as_ref()), n, loaded.model.info().moe)
    };
    let (a, n, moe) = run(1, Some(2), true);
    assert_eq!(n, 2);
    assert!(moe.is_some());
    assert!(a.iter().all(|v| v.is_finite()));
    assert_eq!(a, run(1, Some(2), true).0);
    assert_ne!(a, run(2, Some(2), true).0);
    // One dense layer only: no MoE.
    assert_eq!(run(1, Some(1), true).2, None);
    let (b, _, _) = run(1, None, false);
    assert!(b.iter().all(|v| v.is_finite()));
    let opts = LoadOptions {
        format: LoadFormat::Dummy { seed: 0 },
        num_layers: Some(0),
        ..LoadOptions::default()
    };
    let e = load_with(dir.path(), &opts).err().unwrap().to_string();
    assert!(e.contains("num_layers"), "{e}");
}
