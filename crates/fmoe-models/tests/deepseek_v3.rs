//! DeepSeek-V3 against tests/fixtures/tiny-deepseek-v3: both config layouts parse to the same
//! values; YaRN's frequencies, cos/sin factor and MLA softmax scale match transformers'; fp8
//! checkpoints (DeepSeek's 128×128 blocks, with the ragged kv_a block, and per tensor) load and
//! stay within the fp8 bound; broken checkpoints and configs name the tensor or field; dummy
//! weights run with fewer layers. (Logits, greedy and routing against transformers:
//! fmoe-engine's tests/deepseek_v3_golden.rs.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fmoe_core::{DType, Device, Tensor};
use fmoe_models::config::RopeScaling;
use fmoe_models::layers::rotary::yarn_mscale;
use fmoe_models::layers::{MlaSpec, RopeStyle, Rotary};
use fmoe_models::model::{KvCache, SeqChunk};
use fmoe_models::{
    CausalLm, DeepseekV3Config, DeepseekV3ForCausalLM, LoadFormat, LoadOptions, LogitsFor,
    ModelConfig, MoeOptions, Result, SeqId, load,
};
use fmoe_moe::QuantScheme;
use safetensors::tensor::{Dtype, View};
use tempfile::TempDir;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-deepseek-v3")
}

fn config(file: &str) -> DeepseekV3Config {
    match ModelConfig::from_file(&fixture().join(file)).unwrap() {
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
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let exp: serde_json::Value = serde_json::from_str(&text).unwrap();
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

/// A tensor as stored: dtype, shape, little-endian bytes.
#[derive(Clone)]
struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

impl Raw {
    fn from_tensor(t: &Tensor) -> Raw {
        let (dtype, data) = match t.dtype() {
            DType::F32 => (
                Dtype::F32,
                t.to_f32_vec()
                    .unwrap()
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            ),
            DType::F8E4M3 => (
                Dtype::F8_E4M3,
                t.cpu_slice::<fmoe_core::F8E4M3>("test", "t")
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
            ),
            other => panic!("test helper: {other}"),
        };
        Raw {
            dtype,
            shape: t.dims().to_vec(),
            data,
        }
    }

    /// A bf16 tensor as f32.
    fn to_tensor(&self) -> Tensor {
        assert_eq!(self.dtype, Dtype::BF16);
        let v: Vec<f32> = self
            .data
            .chunks(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        Tensor::from_f32(&v, self.shape.clone(), DType::F32, &Device::Cpu).unwrap()
    }
}

type Tensors = BTreeMap<String, Raw>;

fn read_fixture() -> Tensors {
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.iter()
        .map(|(name, v)| {
            (
                name.to_string(),
                Raw {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    data: v.data().to_vec(),
                },
            )
        })
        .collect()
}

/// A model directory: the fixture's config.json (edited by `edit`) and `tensors`.
fn model_dir(tensors: &Tensors, edit: impl FnOnce(&mut serde_json::Value)) -> TempDir {
    let dir = TempDir::new().unwrap();
    let text = std::fs::read_to_string(fixture().join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    safetensors::serialize_to_file(
        tensors.iter().map(|(k, v)| (k.clone(), v)),
        None,
        &dir.path().join("model.safetensors"),
    )
    .unwrap();
    dir
}

fn load_with(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn CausalLm>> {
    load(dir, opts).map(|m| m.model)
}

fn load_err(dir: &Path) -> String {
    match load_with(dir, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// A minimal cache for driving the model directly.
struct TestCache {
    streams: Vec<Vec<Vec<f32>>>,
    widths: Vec<usize>,
}

impl TestCache {
    fn new(model: &dyn CausalLm) -> TestCache {
        let l = &model.info().kv_layout;
        TestCache {
            streams: vec![vec![Vec::new(); l.streams.len()]; l.num_layers],
            widths: l.streams.clone(),
        }
    }
}

impl KvCache for TestCache {
    fn cached(&self, _: SeqId, layer: usize) -> Result<usize> {
        Ok(self.streams[layer][0].len() / self.widths[0])
    }
    fn append(&mut self, _: SeqId, layer: usize, stream: usize, rows: &[f32]) -> Result<()> {
        self.streams[layer][stream].extend_from_slice(rows);
        Ok(())
    }
    fn stream(&self, _: SeqId, layer: usize, stream: usize) -> Result<&[f32]> {
        Ok(&self.streams[layer][stream])
    }
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Last-position logits of the fixture's prompt 0.
fn logits(model: &dyn CausalLm) -> Vec<f32> {
    let prompt: Vec<u32> = serde_json::from_value(expected()["prompt_ids"][0].clone()).unwrap();
    let mut cache = TestCache::new(model);
    let chunk = SeqChunk {
        seq: 0,
        tokens: prompt,
        start_pos: 0,
    };
    model
        .forward(&[chunk], &mut cache, LogitsFor::Last)
        .unwrap()
        .to_f32_vec()
        .unwrap()
}

fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    let d: f32 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let n: f32 = want.iter().map(|b| b * b).sum();
    (d / n).sqrt()
}

#[test]
fn the_fixture_loads_and_counts_its_tensors() {
    let c = config("config.json");
    // Every tensor of the fixture is read exactly once (no MTP layers in it).
    assert_eq!(
        DeepseekV3ForCausalLM::num_tensors(&c),
        read_fixture().len() as u64
    );
    let loaded = load(&fixture(), &LoadOptions::default()).unwrap();
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
        let mut t = Tensors::new();
        for (name, raw) in read_fixture() {
            let quantized =
                name.ends_with("_proj.weight") || name.ends_with("kv_a_proj_with_mqa.weight");
            if !quantized {
                t.insert(name, raw);
                continue;
            }
            let w = raw.to_tensor();
            let base = name.trim_end_matches(".weight");
            if block {
                let (q, s) = fmoe_kernels::quant_fp8::quantize_block(&w, [128, 128]).unwrap();
                t.insert(format!("{base}.weight_scale_inv"), Raw::from_tensor(&s));
                t.insert(name, Raw::from_tensor(&q));
            } else {
                let (q, s) = fmoe_kernels::quant_fp8::quantize_per_tensor(&w).unwrap();
                let s = s.reshape(Vec::<usize>::new()).unwrap();
                t.insert(format!("{base}.weight_scale"), Raw::from_tensor(&s));
                t.insert(name, Raw::from_tensor(&q));
            }
        }
        let qc = if block {
            serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
        } else {
            serde_json::json!({"quant_method": "fp8", "activation_scheme": "dynamic"})
        };
        let dir = model_dir(&t, |c| c["quantization_config"] = qc);
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
        let err = rel_l2(&logits(model.as_ref()), &want);
        println!("fp8 checkpoint (block: {block}): logits rel 2-norm error {err:.3e}");
        assert!(err < 0.27, "block {block}: {err}");
        let opts = LoadOptions {
            moe: MoeOptions {
                scheme: Some(QuantScheme::Unquantized),
                ..MoeOptions::default()
            },
            ..LoadOptions::default()
        };
        let e = match load_with(dir.path(), &opts) {
            Ok(_) => panic!("an fp8 checkpoint served as unquantized"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("cannot be served as unquantized"), "{e}");
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
        let mut t = read_fixture();
        t.remove(victim).unwrap();
        let dir = model_dir(&t, |_| {});
        let e = load_err(dir.path());
        assert!(
            e.contains(victim) && e.contains("not found") && e.contains("model.safetensors"),
            "{e}"
        );
    }
    // kv_a_proj_with_mqa one row short of kv_lora_rank + qk_rope_head_dim.
    let mut t = read_fixture();
    let victim = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight";
    let raw = t.get_mut(victim).unwrap();
    assert_eq!(raw.shape, vec![32, 64]);
    raw.shape = vec![31, 64];
    raw.data.truncate(31 * 64 * 2);
    let dir = model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(
        e.contains(victim) && e.contains("[31, 64]") && e.contains("[32, 64]"),
        "{e}"
    );
    // The bias as an integer tensor.
    let mut t = read_fixture();
    let victim = "model.layers.2.mlp.gate.e_score_correction_bias";
    t.get_mut(victim).unwrap().dtype = Dtype::I32;
    let dir = model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(e.contains(victim) && e.contains("I32"), "{e}");
    // q_lora_rank null: the model wants a plain q_proj.
    let dir = model_dir(&read_fixture(), |c| {
        c["q_lora_rank"] = serde_json::Value::Null
    });
    let e = load_err(dir.path());
    assert!(e.contains("model.layers.0.self_attn.q_proj.weight"), "{e}");
}

#[test]
fn bad_configs_name_the_field() {
    let t = read_fixture();
    type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
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
    for (edit, want) in cases {
        let dir = model_dir(&t, edit);
        let e = load_err(dir.path());
        assert!(e.contains(want), "want {want:?} in: {e}");
    }
}

#[test]
fn dummy_weights_run_with_fewer_layers() {
    // Only config.json is read; `num_layers` keeps the first N layers (1 dense + 1 MoE here).
    let dir = TempDir::new().unwrap();
    std::fs::copy(
        fixture().join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let run = |seed, num_layers, q_lora: bool| {
        if !q_lora {
            let text = std::fs::read_to_string(fixture().join("config.json")).unwrap();
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
