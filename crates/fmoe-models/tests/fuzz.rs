//! Property tests (fuzzing) of what the loader reads from disk: safetensors headers, config.json
//! and model.safetensors.index.json. Every input must give `Ok` or an `Err`, never a panic (a
//! failing case), and what is accepted must be usable: an accepted header's tensors read back with
//! the shapes it states, an accepted config has checked sizes and finite rotary tables and norm
//! eps in f32, an accepted index serves every tensor it lists.
//!
//! Cases per property: `FMOE_FUZZ_CASES` (default 2048, a few seconds; CI runs the default). For a
//! longer run: `FMOE_FUZZ_CASES=100000 cargo test --release -p fmoe-models --test fuzz`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use fmoe_models::ModelConfig;
use fmoe_models::layers::{RopeStyle, Rotary};
use fmoe_models::loader::Checkpoint;
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{Value, json};
use tempfile::TempDir;

fn cases() -> u32 {
    std::env::var("FMOE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2048)
}

fn config() -> Config {
    Config {
        cases: cases(),
        max_shrink_iters: 512,
        ..Config::default()
    }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Sizes that break arithmetic: 0, small, powers of two up to 2^63, u64::MAX and its neighbours.
fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..20,
        (0u32..64).prop_map(|k| 1u64 << k),
        (0u32..64).prop_map(|k| (1u64 << k).wrapping_sub(1)),
        (0u64..4).prop_map(|d| u64::MAX - d),
        any::<u64>(),
    ]
}

fn edge_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(1.0),
        Just(-1.0),
        Just(1e-300),
        Just(1e-45),
        Just(1e-38),
        Just(1e-10),
        Just(1e38),
        Just(3.5e38),
        Just(1e300),
        (-40i32..40).prop_map(|e| 10f64.powi(e)),
        any::<f64>().prop_filter("JSON has no NaN/Inf", |v| v.is_finite()),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => edge_u64().prop_map(Value::from),
        3 => edge_f64().prop_map(Value::from),
        1 => (-100i64..0).prop_map(Value::from),
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::from),
        1 => "[a-z_]{0,12}".prop_map(Value::from),
        1 => proptest::collection::vec(edge_u64(), 0..3).prop_map(|v| json!(v)),
    ]
}

// ---- safetensors headers ----

/// A small valid safetensors file: a few tensors of fmoe's dtypes and one it does not read.
fn valid_file() -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, elem) in [
        ("a.weight", "F32", vec![2usize, 3], 4usize),
        ("b.weight", "BF16", vec![4], 2),
        ("c.ids", "U32", vec![1, 1, 2], 4),
        ("d.q", "F8_E4M3", vec![5], 1),
        ("e.i16", "I16", vec![3], 2),
        ("f.empty", "F16", vec![0, 7], 2),
    ] {
        let n: usize = shape.iter().product::<usize>() * elem;
        let start = data.len();
        data.extend((0..n).map(|i| (i * 37 % 251) as u8 & 0x3f));
        header.insert(
            name.into(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    assemble(&Value::Object(header).to_string().into_bytes(), &data)
}

fn assemble(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// A header written from random entries (dtype names, shapes and offsets of edge values) with
/// `data_len` bytes of data.
fn random_header_file() -> impl Strategy<Value = Vec<u8>> {
    let entry = (
        "[a-c]{1,2}",
        prop_oneof![
            Just("F32"),
            Just("BF16"),
            Just("F16"),
            Just("U32"),
            Just("F8_E4M3"),
            Just("I64"),
            Just("BOOL"),
            Just("F4"),
            Just("nope")
        ],
        proptest::collection::vec(edge_u64(), 0..4),
        (edge_u64(), edge_u64()),
    );
    (proptest::collection::vec(entry, 0..4), 0usize..64).prop_map(|(entries, data_len)| {
        let mut h = serde_json::Map::new();
        for (name, dtype, shape, (a, b)) in entries {
            h.insert(
                name,
                json!({"dtype": dtype, "shape": shape, "data_offsets": [a, b]}),
            );
        }
        assemble(
            &Value::Object(h).to_string().into_bytes(),
            &vec![0u8; data_len],
        )
    })
}

/// The valid file, damaged: bytes replaced, the length prefix rewritten, cut short or extended.
fn damaged_file() -> impl Strategy<Value = Vec<u8>> {
    let base = valid_file();
    let len = base.len();
    prop_oneof![
        proptest::collection::vec((0..len, any::<u8>()), 1..6).prop_map({
            let base = base.clone();
            move |edits| {
                let mut b = base.clone();
                for (i, v) in edits {
                    b[i] = v;
                }
                b
            }
        }),
        edge_u64().prop_map({
            let base = base.clone();
            move |n| {
                let mut b = base.clone();
                b[..8].copy_from_slice(&n.to_le_bytes());
                b
            }
        }),
        (0..len).prop_map({
            let base = base.clone();
            move |keep| base[..keep].to_vec()
        }),
        (1usize..16).prop_map(move |extra| {
            let mut b = base.clone();
            b.extend(std::iter::repeat_n(0u8, extra));
            b
        }),
    ]
}

fn check_file(bytes: &[u8]) -> Result<(), TestCaseError> {
    let dir = TempDir::new().unwrap();
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    let Ok(ck) = Checkpoint::open(dir.path()) else {
        return Ok(());
    };
    for name in ck.names() {
        let (shape, _) = ck.info(name).unwrap();
        if let Ok(t) = ck.get(name) {
            prop_assert_eq!(t.dims(), &shape[..]);
            let n = fmoe_core::Shape::from(shape.clone())
                .checked_elem_count()
                .unwrap();
            prop_assert_eq!(t.elem_count(), n);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn safetensors_headers_never_panic(bytes in prop_oneof![
        damaged_file(),
        random_header_file(),
        proptest::collection::vec(any::<u8>(), 0..64),
    ]) {
        check_file(&bytes)?;
    }
}

#[test]
fn the_valid_file_is_read_back() {
    // The base of the damaged files is itself accepted (so the fuzzing starts from a good file).
    let dir = TempDir::new().unwrap();
    std::fs::write(dir.path().join("model.safetensors"), valid_file()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.len(), 6);
    assert_eq!(ck.get("a.weight").unwrap().dims(), &[2, 3]);
    assert!(ck.get("e.i16").unwrap_err().to_string().contains("I16"));
}

// ---- config.json ----

/// Keys worth changing, per architecture (nested rope keys as `rope_parameters.x`).
const MIXTRAL_KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "sliding_window",
    "num_local_experts",
    "num_experts_per_tok",
    "bos_token_id",
    "eos_token_id",
    "rope_parameters.rope_theta",
    "tie_word_embeddings",
];
const DEEPSEEK_KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "moe_layer_freq",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "eos_token_id",
    "rope_parameters.rope_theta",
    "rope_parameters.factor",
    "rope_parameters.beta_fast",
    "rope_parameters.beta_slow",
    "rope_parameters.mscale",
    "rope_parameters.mscale_all_dim",
    "rope_parameters.original_max_position_embeddings",
];

fn fixture_json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap())
        .unwrap()
}

fn set(v: &mut Value, key: &str, value: Value) {
    match key.split_once('.') {
        Some((outer, inner)) => v[outer][inner] = value,
        None => v[key] = value,
    }
}

fn check_config(text: &str) -> Result<(), TestCaseError> {
    let Ok(cfg) = ModelConfig::from_json_str(text, Path::new("config.json")) else {
        return Ok(());
    };
    let counts = cfg.weight_counts();
    prop_assert!(
        counts.is_ok(),
        "accepted with unchecked sizes: {:?}",
        counts
    );
    prop_assert!(cfg.weight_bytes().is_ok());
    prop_assert!(cfg.kv_elems_per_token().is_ok());
    let (eps, rope, rotary_dim, style) = match &cfg {
        ModelConfig::Mixtral(c) => (
            c.rms_norm_eps,
            c.rope().unwrap(),
            c.head_dim(),
            RopeStyle::HalfSplit,
        ),
        ModelConfig::DeepseekV3(c) => (
            c.rms_norm_eps,
            c.rope().unwrap(),
            c.qk_rope_head_dim,
            RopeStyle::Interleaved,
        ),
    };
    let eps = eps as f32;
    prop_assert!(eps.is_finite() && eps > 0.0, "eps {} accepted", eps);
    // Rotary in f32 at the last position: only for tables small enough to build here.
    if rotary_dim <= 1 << 12 {
        let r = Rotary::new(&rope, rotary_dim, style);
        let last = cfg.max_position_embeddings() - 1;
        let t = r.table(&[0, last]);
        prop_assert!(
            t.cos().iter().chain(t.sin()).all(|v| v.is_finite()),
            "non-finite rotary table accepted: theta {} at position {}",
            rope.theta,
            last
        );
    }
    Ok(())
}

fn mutated_config(
    name: &'static str,
    keys: &'static [&'static str],
) -> impl Strategy<Value = String> {
    proptest::collection::vec((proptest::sample::select(keys), json_value()), 1..4).prop_map(
        move |edits| {
            let mut v = fixture_json(name);
            for (k, val) in edits {
                set(&mut v, k, val);
            }
            v.to_string()
        },
    )
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn mixtral_configs_never_panic(text in mutated_config("tiny-mixtral", MIXTRAL_KEYS)) {
        check_config(&text)?;
    }

    #[test]
    fn deepseek_configs_never_panic(text in mutated_config("tiny-deepseek-v3", DEEPSEEK_KEYS)) {
        check_config(&text)?;
    }

    #[test]
    fn arbitrary_config_text_never_panics(text in "\\PC{0,200}") {
        let _ = ModelConfig::from_json_str(&text, Path::new("config.json"));
    }
}

// ---- model.safetensors.index.json ----

/// The fixture split into two shards (s0, s1), made once; each case writes its own index in a
/// fresh directory whose shards link to these.
fn shards() -> &'static (TempDir, Vec<(String, usize)>) {
    static SHARDS: OnceLock<(TempDir, Vec<(String, usize)>)> = OnceLock::new();
    SHARDS.get_or_init(|| {
        let dir = TempDir::new().unwrap();
        let bytes = std::fs::read(fixture("tiny-mixtral").join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
        names.sort();
        let mut parts: [Vec<(String, safetensors::tensor::TensorView)>; 2] = Default::default();
        let mut owner = Vec::new();
        for (i, n) in names.iter().enumerate() {
            parts[i % 2].push((n.clone(), st.tensor(n).unwrap()));
            owner.push((n.clone(), i % 2));
        }
        for (i, p) in parts.into_iter().enumerate() {
            safetensors::serialize_to_file(p, None, &dir.path().join(format!("s{i}.safetensors")))
                .unwrap();
        }
        (dir, owner)
    })
}

fn shard_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => (0usize..2).prop_map(|i| Value::from(format!("s{i}.safetensors"))),
        1 => Just(Value::from(".")),
        1 => Just(Value::from("..")),
        1 => Just(Value::from("")),
        1 => Just(Value::from("sub/s0.safetensors")),
        1 => Just(Value::from("missing.safetensors")),
        1 => json_value(),
    ]
}

/// Edits of an index: listed tensors refiled (`Some`) or dropped (`None`), new names filed, and
/// the index's overall form (0 and 4..: a `weight_map` object).
type IndexEdits = (Vec<(usize, Option<Value>)>, Vec<(String, Value)>, u8);

fn index_edits() -> impl Strategy<Value = IndexEdits> {
    (
        proptest::collection::vec((any::<usize>(), proptest::option::of(shard_value())), 0..4),
        proptest::collection::vec(("[a-z.]{1,8}", shard_value()), 0..2),
        0u8..8,
    )
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn index_files_never_panic((edits, extra, shape) in index_edits()) {
        let (base, owner) = shards();
        let dir = TempDir::new().unwrap();
        for i in 0..2 {
            let f = format!("s{i}.safetensors");
            std::os::unix::fs::symlink(base.path().join(&f), dir.path().join(&f)).unwrap();
        }
        let mut map = serde_json::Map::new();
        for (n, i) in owner {
            map.insert(n.clone(), Value::from(format!("s{i}.safetensors")));
        }
        let changed = !edits.is_empty() || !extra.is_empty() || shape != 0;
        for (i, to) in edits {
            let name = owner[i % owner.len()].0.clone();
            match to {
                Some(v) => map.insert(name, v),
                None => map.remove(&name),
            };
        }
        for (n, v) in extra {
            map.insert(n, v);
        }
        let index = match shape {
            1 => json!({"weight_map": []}),
            2 => json!({"no_map": map}),
            3 => json!({"weight_map": {}}),
            _ => json!({"metadata": {"total_size": 0}, "weight_map": map}),
        };
        std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
        match Checkpoint::open(dir.path()) {
            Ok(ck) => {
                // Accepted: the map agrees with the shards, so every tensor is where it says.
                prop_assert_eq!(ck.len(), owner.len());
                for (n, _) in owner {
                    prop_assert!(ck.get(n).is_ok(), "{} not served", n);
                }
            }
            Err(e) => prop_assert!(changed, "the unchanged index was refused: {}", e),
        }
    }
}
