//! Loading checkpoints: the tiny Mixtral fixture rewritten as shards, as fp8 checkpoints, and
//! broken in every way a download can be broken (missing tensor, wrong shape, wrong dtype,
//! truncated file, bad config.json). Every error must name the problem.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fmoe_core::{DType, Device, Tensor};
use fmoe_models::model::{KvCache, SeqChunk};
use fmoe_models::{
    CausalLm, Checkpoint, Error, LoadFormat, LoadOptions, LogitsFor, MoeOptions, Result, SeqId,
    load,
};
use fmoe_moe::QuantScheme;
use safetensors::tensor::{Dtype, View};
use tempfile::TempDir;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-mixtral")
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
        let v = t.to_f32_vec().unwrap();
        let (dtype, data) = match t.dtype() {
            DType::F32 => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            DType::BF16 => (
                Dtype::BF16,
                v.iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
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

    fn to_tensor(&self) -> Tensor {
        let v: Vec<f32> = match self.dtype {
            Dtype::BF16 => self
                .data
                .chunks(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F32 => self
                .data
                .chunks(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            other => panic!("test helper: {other:?}"),
        };
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

fn write(path: &Path, tensors: &Tensors) {
    safetensors::serialize_to_file(tensors.iter().map(|(k, v)| (k.clone(), v)), None, path)
        .unwrap();
}

/// A model directory: the fixture's config.json (optionally edited) and `tensors`.
fn model_dir(tensors: &Tensors, config: impl FnOnce(&mut serde_json::Value)) -> TempDir {
    let dir = TempDir::new().unwrap();
    let text = std::fs::read_to_string(fixture().join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    config(&mut cfg);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    write(&dir.path().join("model.safetensors"), tensors);
    dir
}

fn load_with(dir: &Path, scheme: Option<QuantScheme>) -> Result<Box<dyn CausalLm>> {
    let opts = LoadOptions {
        moe: MoeOptions {
            scheme,
            ..MoeOptions::default()
        },
        ..LoadOptions::default()
    };
    load(dir, &opts).map(|m| m.model)
}

fn load_err(dir: &Path) -> String {
    match load_with(dir, None) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// A minimal cache for driving the model directly (the engine has the real one).
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

const PROMPT: [u32; 5] = [1, 442, 326, 14, 270];

fn logits(model: &dyn CausalLm) -> Vec<f32> {
    let mut cache = TestCache::new(model);
    let chunk = SeqChunk {
        seq: 0,
        tokens: PROMPT.to_vec(),
        start_pos: 0,
    };
    model
        .forward(&[chunk], &mut cache, LogitsFor::Last)
        .unwrap()
        .to_f32_vec()
        .unwrap()
}

fn expected_logits() -> Vec<f32> {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["prompt_ids"][0], serde_json::json!(PROMPT));
    serde_json::from_value(v["prefill_logits"][0][0].clone()).unwrap()
}

fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    let d: f32 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let n: f32 = want.iter().map(|b| b * b).sum();
    (d / n).sqrt()
}

#[test]
fn checkpoint_reads_names_shapes_and_dtypes() {
    let ck = Checkpoint::open(&fixture()).unwrap();
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
    let tensors = read_fixture();
    let dir = model_dir(&Tensors::new(), |_| {});
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
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let sharded = load_with(dir.path(), None).unwrap();
    let single = load_with(&fixture(), None).unwrap();
    assert_eq!(logits(sharded.as_ref()), logits(single.as_ref()));

    // A tensor missing from every shard is named, with the index.
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
        e.contains(victim) && e.contains("2 shards") && e.contains("index.json"),
        "{e}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let mut t = read_fixture();
    let victim = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
    t.remove(victim).unwrap();
    let dir = model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(e.contains(victim) && e.contains("model.safetensors"), "{e}");
}

#[test]
fn wrong_shape_names_the_tensor_and_both_shapes() {
    let mut t = read_fixture();
    let victim = "model.layers.0.self_attn.q_proj.weight";
    let raw = t.get_mut(victim).unwrap();
    raw.shape = vec![32, 128];
    let dir = model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(
        e.contains(victim) && e.contains("[32, 128]") && e.contains("[64, 64]"),
        "{e}"
    );
}

#[test]
fn wrong_dtype_names_the_tensor() {
    // An integer dtype safetensors knows but fmoe does not read.
    let mut t = read_fixture();
    let victim = "model.norm.weight";
    let raw = t.get_mut(victim).unwrap();
    raw.dtype = Dtype::I16;
    let dir = model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(e.contains(victim) && e.contains("I16"), "{e}");

    // An fp8 weight in a checkpoint whose config says it is not quantized.
    let mut t = read_fixture();
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
    let dir = model_dir(&t, |_| {});
    let e = load_err(dir.path());
    assert!(e.contains(victim) && e.contains("f8e4m3"), "{e}");
}

#[test]
fn truncated_file_is_rejected() {
    let dir = model_dir(&read_fixture(), |_| {});
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
    let t = read_fixture();
    type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
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
    for (edit, want) in cases {
        let dir = model_dir(&t, edit);
        let e = load_err(dir.path());
        assert!(e.contains(want), "want {want:?} in: {e}");
    }
    let dir = model_dir(&t, |_| {});
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
        let mut t = Tensors::new();
        for (name, raw) in read_fixture() {
            let quantized = name.ends_with("_proj.weight") || name.contains(".experts.");
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
        let model = load_with(dir.path(), None).unwrap();
        let err = rel_l2(&logits(model.as_ref()), &want);
        println!("fp8 checkpoint (block: {block}): logits rel 2-norm error {err:.3e}");
        assert!(err < 0.27, "block {block}: {err}");
        // The checkpoint's experts serve only their own method.
        let e = match load_with(dir.path(), Some(QuantScheme::Unquantized)) {
            Ok(_) => panic!("an fp8 checkpoint served as unquantized"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("cannot be served as unquantized"), "{e}");
    }
}

#[test]
fn dummy_weights_run_and_depend_only_on_the_seed() {
    let run = |seed| {
        let opts = LoadOptions {
            format: LoadFormat::Dummy { seed },
            ..LoadOptions::default()
        };
        // Only config.json is read.
        let dir = model_dir(&Tensors::new(), |_| {});
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
    let model = load_with(&fixture(), None).unwrap();
    let mut cache = TestCache::new(model.as_ref());
    let chunk = |tokens: Vec<u32>, start_pos| SeqChunk {
        seq: 0,
        tokens,
        start_pos,
    };
    let err = |c: SeqChunk, cache: &mut TestCache| -> String {
        match model.forward(&[c], cache, LogitsFor::Last) {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        }
    };
    assert!(err(chunk(vec![1, 512], 0), &mut cache).contains("token id 512"));
    assert!(err(chunk(vec![], 0), &mut cache).contains("no tokens"));
    assert!(err(chunk(vec![1], 3), &mut cache).contains("start_pos 3"));
    assert!(err(chunk(vec![1; 257], 0), &mut cache).contains("max_position_embeddings"));
    let e: Error = model
        .forward(
            &[chunk(vec![1], 0), chunk(vec![2], 0)],
            &mut cache,
            LogitsFor::Last,
        )
        .unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
}
