//! What the checkpoint tests (tiny Mixtral, tiny DeepSeek-V3) share: a fixture's tensors as
//! stored, rewritten into model directories (with config.json edited), fp8-quantized as
//! checkpoints store them, loaded, and run through a minimal KV cache.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fmoe_core::{DType, Device, Tensor};
use fmoe_models::{CausalLm, LoadOptions, MoeOptions, Result, load};
use fmoe_models::{ForwardInput, KvPool, SeqStep, StepLogits};
use fmoe_moe::QuantScheme;
use safetensors::tensor::{Dtype, View};
use tempfile::TempDir;

/// tests/fixtures/`.0` at the workspace root.
pub struct Fixture(pub &'static str);

impl Fixture {
    pub fn dir(&self) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(self.0)
    }

    /// The fixture's expected.json.
    pub fn expected(&self) -> serde_json::Value {
        let text = std::fs::read_to_string(self.dir().join("expected.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// The fixture's tensors as stored.
    pub fn tensors(&self) -> Tensors {
        let bytes = std::fs::read(self.dir().join("model.safetensors")).unwrap();
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
    pub fn model_dir(
        &self,
        tensors: &Tensors,
        edit: impl FnOnce(&mut serde_json::Value),
    ) -> TempDir {
        let dir = TempDir::new().unwrap();
        let text = std::fs::read_to_string(self.dir().join("config.json")).unwrap();
        let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
        edit(&mut cfg);
        std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
        write(&dir.path().join("model.safetensors"), tensors);
        dir
    }
}

/// A tensor as stored: dtype, shape, little-endian bytes.
#[derive(Clone)]
pub struct Raw {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
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
    /// An f32, bf16 or e4m3 tensor as stored.
    pub fn from_tensor(t: &Tensor) -> Raw {
        let (dtype, data) = match t.dtype() {
            DType::F32 => (
                Dtype::F32,
                t.to_f32_vec()
                    .unwrap()
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            ),
            DType::BF16 => (
                Dtype::BF16,
                t.to_f32_vec()
                    .unwrap()
                    .iter()
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

    /// A bf16 or f32 tensor as f32.
    pub fn to_tensor(&self) -> Tensor {
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

pub type Tensors = BTreeMap<String, Raw>;

pub fn write(path: &Path, tensors: &Tensors) {
    safetensors::serialize_to_file(tensors.iter().map(|(k, v)| (k.clone(), v)), None, path)
        .unwrap();
}

/// `tensors` with each one `quantized` picks in e4m3, as fp8 checkpoints store it: 128×128
/// blocks with `.weight_scale_inv` (DeepSeek) if `block`, else per tensor with a scalar
/// `.weight_scale` (Mixtral-FP8). The rest as they were.
pub fn quantize_fp8(
    tensors: Tensors,
    block: bool,
    quantized: impl Fn(&str, &Raw) -> bool,
) -> Tensors {
    let mut t = Tensors::new();
    for (name, raw) in tensors {
        if !quantized(&name, &raw) {
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
    t
}

/// `fixture` as a static per-tensor fp8 checkpoint (Mixtral-8x7B-Instruct-FP8's layout): attention
/// and expert linears in e4m3 with `weight_scale` (`quantize_fp8`), each with an `input_scale`
/// of `base · (1 + j/8)` (j: the expert, 0 for attention), so experts' scales differ and the MoE
/// layer takes their max. Load it with [`static_fp8_quantization_config`].
// Not every test binary has a per-tensor static checkpoint (DeepSeek-V3's are block-scaled).
#[allow(dead_code)]
pub fn static_fp8(fixture: &Fixture, base: f32) -> Tensors {
    let mut t = quantize_fp8(fixture.tensors(), false, |name, _| {
        name.ends_with("_proj.weight") || name.contains(".experts.")
    });
    let names: Vec<String> = t
        .keys()
        .filter(|n| n.ends_with(".weight_scale"))
        .cloned()
        .collect();
    for n in names {
        let j = n
            .split(".experts.")
            .nth(1)
            .and_then(|r| r.split('.').next())
            .and_then(|j| j.parse::<u32>().ok())
            .unwrap_or(0);
        let s = base * (1.0 + j as f32 / 8.0);
        let s = Tensor::from_vec(vec![s], Vec::<usize>::new(), &Device::Cpu).unwrap();
        t.insert(
            n.replace(".weight_scale", ".input_scale"),
            Raw::from_tensor(&s),
        );
    }
    t
}

/// The `quantization_config` of a checkpoint `static_fp8` wrote.
#[allow(dead_code)]
pub fn static_fp8_quantization_config() -> serde_json::Value {
    serde_json::json!({"quant_method": "fp8", "activation_scheme": "static"})
}

/// The `quantization_config` of a checkpoint `quantize_fp8` wrote.
pub fn fp8_quantization_config(block: bool) -> serde_json::Value {
    if block {
        serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    } else {
        serde_json::json!({"quant_method": "fp8", "activation_scheme": "dynamic"})
    }
}

/// Load options asking for MoE method `scheme` (`None`: the checkpoint's).
pub fn options(scheme: Option<QuantScheme>) -> LoadOptions {
    LoadOptions {
        moe: MoeOptions {
            scheme,
            ..MoeOptions::default()
        },
        ..LoadOptions::default()
    }
}

pub fn load_with(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn CausalLm>> {
    load(dir, opts).map(|m| m.model)
}

/// The error loading `dir` with the default options gives.
pub fn load_err(dir: &Path) -> String {
    match load_with(dir, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// An fp8 checkpoint's experts serve only their own method.
pub fn assert_not_served_unquantized(dir: &Path) {
    let e = match load_with(dir, &options(Some(QuantScheme::Unquantized))) {
        Ok(_) => panic!("an fp8 checkpoint served as unquantized"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("cannot be served as unquantized"), "{e}");
}

/// An edit of config.json.
pub type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;

/// Each edit of the fixture's config.json (over `tensors`) fails to load with an error
/// containing its string.
pub fn assert_config_errors(fixture: &Fixture, tensors: &Tensors, cases: Vec<(Edit, &str)>) {
    for (edit, want) in cases {
        let dir = fixture.model_dir(tensors, edit);
        let e = load_err(dir.path());
        assert!(e.contains(want), "want {want:?} in: {e}");
    }
}

/// One step of `seqs` (new tokens, past) through `pool`, each sequence owning consecutive blocks
/// of 16 from block `16 · index` on (so a pool of 16 · seqs blocks fits 256 positions each).
pub fn step(
    model: &dyn CausalLm,
    pool: &mut KvPool,
    seqs: &[(&[u32], usize)],
    logits: StepLogits,
) -> Result<Vec<f32>> {
    let tables: Vec<Vec<u32>> = (0..seqs.len() as u32)
        .map(|i| (16 * i..16 * (i + 1)).collect())
        .collect();
    let steps: Vec<SeqStep> = seqs
        .iter()
        .zip(&tables)
        .map(|(&(tokens, past), t)| SeqStep {
            tokens,
            past,
            block_table: t,
            logits,
        })
        .collect();
    let input = ForwardInput::new(model.info(), 16, pool.num_blocks(), &steps)?;
    Ok(model.forward(&input, pool)?.into_host()?.to_f32_vec()?)
}

/// A pool for `seqs` sequences of `step`.
pub fn pool_for(model: &dyn CausalLm, seqs: usize) -> KvPool {
    let i = model.info();
    KvPool::new(&i.kv_layout, i.dtype, i.device, 16 * seqs, 16).unwrap()
}

/// Last-position logits of `prompt`, prefilled alone.
pub fn prefill(model: &dyn CausalLm, prompt: Vec<u32>) -> Vec<f32> {
    let mut pool = pool_for(model, 1);
    step(model, &mut pool, &[(&prompt, 0)], StepLogits::Last).unwrap()
}

pub fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    let d: f32 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let n: f32 = want.iter().map(|b| b * b).sum();
    (d / n).sqrt()
}

/// Logits `got` of an fp8 checkpoint (`block`: 128×128 blocks, else per tensor) within the fp8
/// MoE layer's worst-case relative 2-norm error of `want`.
pub fn assert_within_fp8_bound(got: &[f32], want: &[f32], block: bool) {
    let err = rel_l2(got, want);
    println!("fp8 checkpoint (block: {block}): logits rel 2-norm error {err:.3e}");
    assert!(err < 0.27, "block {block}: {err}");
}
