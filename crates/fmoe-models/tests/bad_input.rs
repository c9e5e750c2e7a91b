//! Bad input to the loading library, below the CLI: files that are not regular files, a
//! checkpoint that shrinks after it was opened, an index whose `weight_map` disagrees with the
//! shards, encoding limits, config sizes and f32 validation, and the dummy weights' memory budget.
//! Each asserts the error names what is wrong.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use fmoe_core::{DType, Device};
use fmoe_models::loader::{Checkpoint, DummyWeights};
use fmoe_models::tokenizer::{EncodeLimits, Tokenizer};
use fmoe_models::{Error, ModelConfig};
use tempfile::TempDir;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn copy_of(name: &str) -> TempDir {
    let dir = TempDir::new().unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture(name).join(f), dir.path().join(f)).unwrap();
    }
    dir
}

/// `f()` on another thread, failing the test if it takes longer than 30 s (a hang).
fn within_deadline<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("did not return within 30 s (a hang)")
}

fn mkfifo(path: &Path) {
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(ok.success());
}

#[test]
fn checkpoint_truncated_after_open_is_an_error_not_sigbus() {
    // The header was valid when opened; the file then shrinks (rewritten by another process).
    // With a memory map the next read was a SIGBUS; now it is a short read, reported.
    let dir = copy_of("tiny-mixtral");
    let path = dir.path().join("model.safetensors");
    let ck = Checkpoint::open(dir.path()).unwrap();
    let name = "model.layers.1.self_attn.o_proj.weight";
    let before = ck.get(name).unwrap().to_f32_vec().unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len / 4)
        .unwrap();
    let names = ck.names().iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let mut failed = 0;
    for n in &names {
        match ck.get(n) {
            Ok(t) if n == name => assert_eq!(t.to_f32_vec().unwrap(), before),
            Ok(_) => {}
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains("model.safetensors") && e.contains("truncated or rewritten"),
                    "{e}"
                );
                assert!(e.contains(&format!("tensor `{n}`")), "{e}");
                failed += 1;
            }
        }
    }
    // Three quarters of the data are gone: most tensors cannot be read.
    assert!(failed > names.len() / 2, "{failed} of {}", names.len());
}

#[test]
fn fifos_and_directories_are_refused_without_blocking() {
    for (file, fifo) in [
        ("model.safetensors", true),
        ("model.safetensors", false),
        ("model.safetensors.index.json", true),
    ] {
        let dir = copy_of("tiny-mixtral");
        let path = dir.path().join(file);
        let _ = std::fs::remove_file(&path);
        if fifo {
            mkfifo(&path);
        } else {
            std::fs::create_dir(&path).unwrap();
        }
        let d = dir.path().to_path_buf();
        let e = within_deadline(move || Checkpoint::open(&d).err().map(|e| e.to_string()))
            .expect("opened");
        let kind = if fifo { "FIFO" } else { "a directory" };
        assert!(
            e.contains(file) && e.contains("must be a regular file") && e.contains(kind),
            "{e}"
        );
    }
    // tokenizer.json and config.json through their own readers.
    let dir = copy_of("tiny-mixtral");
    for f in ["tokenizer.json", "config.json"] {
        let p = dir.path().join(f);
        std::fs::remove_file(&p).unwrap();
        mkfifo(&p);
    }
    let d = dir.path().to_path_buf();
    let e = within_deadline(move || Tokenizer::from_dir(&d).err().map(|e| e.to_string()))
        .expect("a FIFO is not a missing tokenizer");
    assert!(e.contains("tokenizer.json") && e.contains("FIFO"), "{e}");
    let p = dir.path().join("config.json");
    let e = within_deadline(move || ModelConfig::from_file(&p).err().map(|e| e.to_string()))
        .expect("parsed a FIFO");
    assert!(e.contains("config.json") && e.contains("FIFO"), "{e}");
    // A missing tokenizer is still just missing.
    let empty = TempDir::new().unwrap();
    assert!(Tokenizer::from_dir(empty.path()).unwrap().is_none());
}

/// The fixture split into two shards by tensor order, with the index `map` edits.
fn sharded(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> TempDir {
    let dir = copy_of("tiny-mixtral");
    let single = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&single).unwrap();
    std::fs::remove_file(&single).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut parts: [Vec<(String, safetensors::tensor::TensorView)>; 2] = Default::default();
    let mut map = serde_json::Map::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    for (i, n) in names.iter().enumerate() {
        parts[i % 2].push((n.clone(), st.tensor(n).unwrap()));
        map.insert(n.clone(), format!("s{}.safetensors", i % 2).into());
    }
    for (i, p) in parts.into_iter().enumerate() {
        safetensors::serialize_to_file(p, None, &dir.path().join(format!("s{i}.safetensors")))
            .unwrap();
    }
    edit(&mut map);
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({ "weight_map": map }).to_string(),
    )
    .unwrap();
    dir
}

#[test]
fn weight_map_is_honoured_and_checked() {
    let good = sharded(|_| {});
    let ck = Checkpoint::open(good.path()).unwrap();
    let single = Checkpoint::open(&fixture("tiny-mixtral")).unwrap();
    assert_eq!(ck.names(), single.names());
    let victim = "model.norm.weight";
    let err = |dir: &TempDir| Checkpoint::open(dir.path()).err().unwrap().to_string();
    // Filed under the other shard: it used to load anyway.
    let d = sharded(|m| {
        let other = if m[victim] == "s0.safetensors" {
            "s1"
        } else {
            "s0"
        };
        m.insert(victim.into(), format!("{other}.safetensors").into());
    });
    let e = err(&d);
    assert!(
        e.contains(victim) && e.contains("weight_map") && e.contains("but it is in"),
        "{e}"
    );
    // Held by a shard but not listed.
    let d = sharded(|m| {
        m.remove(victim);
    });
    let e = err(&d);
    assert!(e.contains(victim) && e.contains("not in weight_map"), "{e}");
    // Listed, but held by no shard.
    let d = sharded(|m| {
        m.insert("model.ghost.weight".into(), "s0.safetensors".into());
    });
    let e = err(&d);
    assert!(
        e.contains("model.ghost.weight") && e.contains("does not hold it"),
        "{e}"
    );
    // Names that are not a file beside the index.
    for bad in [".", "..", "", "../x.safetensors", "sub/x.safetensors"] {
        let d = sharded(|m| {
            m.insert(victim.into(), bad.into());
        });
        let e = err(&d);
        assert!(e.contains("not a plain file name"), "{bad:?}: {e}");
    }
}

#[test]
fn encode_limits_bound_input_normalized_text_and_tokens() {
    let tok = Tokenizer::from_file(&fixture("tiny-mixtral").join("tokenizer.json")).unwrap();
    let reference =
        tokenizers::Tokenizer::from_file(fixture("tiny-mixtral").join("tokenizer.json")).unwrap();
    let text = "The quick brown fox jumps over the lazy dog.";
    let want = reference.encode(text, true).unwrap().get_ids().to_vec();
    assert_eq!(tok.encode(text, true).unwrap(), want);
    let limits = |b, n, t| EncodeLimits {
        max_input_bytes: b,
        max_normalized_bytes: n,
        max_tokens: t,
    };
    let e = tok
        .encode_with_limits(text, true, &limits(10, 1 << 20, 1 << 20))
        .unwrap_err()
        .to_string();
    assert!(e.contains("44 bytes") && e.contains("10"), "{e}");
    let e = tok
        .encode_with_limits(text, true, &limits(1 << 20, 1 << 20, want.len() - 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains(&format!("{} tokens", want.len())), "{e}");
    assert_eq!(
        tok.encode_with_limits(text, true, &limits(44, 44, want.len()))
            .unwrap(),
        want
    );

    // A normalizer that expands each `a` 100 000-fold: refused before the expansion is built.
    let mut json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny-mixtral").join("tokenizer.json")).unwrap(),
    )
    .unwrap();
    json["normalizer"] = serde_json::json!({
        "type": "Replace", "pattern": {"String": "a"}, "content": "b".repeat(100_000)
    });
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    let big = Tokenizer::from_file(&path).unwrap();
    let e = big
        .encode(&"a".repeat(2000), false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("normalizer") && e.contains("2000-byte"), "{e}");
    // A short text under that normalizer is still fine (one `a` → 100 000 bytes).
    assert!(!big.encode("a", false).unwrap().is_empty());
}

/// An edit of a fixture's config.json.
type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;

fn parse(text: &str) -> fmoe_models::Result<ModelConfig> {
    ModelConfig::from_json_str(text, Path::new("config.json"))
}

fn fixture_config(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap())
            .unwrap();
    edit(&mut v);
    v.to_string()
}

#[test]
fn weight_counts_equal_the_fixture_checkpoints() {
    // The independent reference: the elements the checkpoints actually hold.
    for name in ["tiny-mixtral", "tiny-deepseek-v3"] {
        let cfg = parse(&fixture_config(name, |_| {})).unwrap();
        let ck = Checkpoint::open(&fixture(name)).unwrap();
        let held: usize = ck
            .names()
            .iter()
            .map(|n| ck.info(n).unwrap().0.iter().product::<usize>())
            .sum();
        assert_eq!(
            cfg.weight_counts().unwrap().total().unwrap(),
            held,
            "{name}"
        );
        // bf16 checkpoints: two bytes per element.
        assert_eq!(cfg.weight_bytes().unwrap(), 2 * held, "{name}");
    }
}

#[test]
fn config_values_used_as_f32_are_validated_as_f32() {
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "tiny-mixtral",
            Box::new(|c| c["rms_norm_eps"] = 1e300.into()),
            "rms_norm_eps",
        ),
        (
            "tiny-mixtral",
            Box::new(|c| c["rms_norm_eps"] = 1e-50.into()),
            "rms_norm_eps",
        ),
        (
            "tiny-mixtral",
            Box::new(|c| c["rope_parameters"]["rope_theta"] = 1e-300.into()),
            "rope_theta",
        ),
        (
            "tiny-mixtral",
            Box::new(|c| c["rope_parameters"]["rope_theta"] = 1e300.into()),
            "rope_theta",
        ),
        (
            // A normal f32 θ, but position × 1/θ overflows f32 within the context.
            "tiny-mixtral",
            Box::new(|c| c["rope_parameters"]["rope_theta"] = 1e-37.into()),
            "beyond f32",
        ),
        (
            "tiny-deepseek-v3",
            Box::new(|c| c["routed_scaling_factor"] = 1e39.into()),
            "routed_scaling_factor",
        ),
        (
            "tiny-deepseek-v3",
            Box::new(|c| c["rope_parameters"]["rope_theta"] = 1.0.into()),
            "rope_theta != 1",
        ),
        (
            "tiny-deepseek-v3",
            Box::new(|c| c["rope_parameters"]["beta_slow"] = 0.0.into()),
            "beta_slow",
        ),
        (
            "tiny-deepseek-v3",
            Box::new(|c| c["rope_parameters"]["mscale"] = 1e300.into()),
            "mscale",
        ),
        (
            // Found by the fuzzer: ln(original / (β · 2π)) = +inf made every inv_freq NaN.
            "tiny-deepseek-v3",
            Box::new(|c| {
                c["rope_parameters"]["beta_fast"] = 1e-300.into();
                c["rope_parameters"]["original_max_position_embeddings"] = u64::MAX.into();
            }),
            "correction dimension",
        ),
        (
            "tiny-deepseek-v3",
            Box::new(|c| c["rope_parameters"]["factor"] = 1e39.into()),
            "factor",
        ),
    ];
    for (name, edit, word) in cases {
        let e = parse(&fixture_config(name, edit)).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains(word),
            "{name}: {word}: {e}"
        );
    }
}

#[test]
fn config_sizes_and_token_ids_are_checked() {
    let cases: Vec<(&str, Edit, &[&str])> = vec![
        (
            "tiny-mixtral",
            Box::new(|c| {
                c["num_attention_heads"] = (1u64 << 60).into();
                c["num_key_value_heads"] = 4.into();
            }),
            &[
                "num_attention_heads 1152921504606846976",
                "head_dim 16",
                "overflows",
            ],
        ),
        (
            "tiny-mixtral",
            Box::new(|c| c["max_position_embeddings"] = (1u64 << 62).into()),
            &["max_position_embeddings", "overflows"],
        ),
        (
            "tiny-mixtral",
            Box::new(|c| c["eos_token_id"] = serde_json::json!([2, 600])),
            &["eos_token_id 600", "vocab_size 512"],
        ),
        (
            "tiny-mixtral",
            Box::new(|c| c["bos_token_id"] = 512.into()),
            &["bos_token_id 512"],
        ),
        (
            "tiny-deepseek-v3",
            Box::new(|c| c["qk_nope_head_dim"] = u64::MAX.into()),
            &["qk_nope_head_dim", "overflows"],
        ),
        (
            "tiny-deepseek-v3",
            Box::new(|c| c["n_routed_experts"] = (1u64 << 62).into()),
            &["n_routed_experts", "overflows"],
        ),
    ];
    for (name, edit, words) in cases {
        let e = parse(&fixture_config(name, edit)).unwrap_err().to_string();
        for w in words {
            assert!(e.contains(w), "{name}: `{w}` not in {e}");
        }
    }
    // 10^9 layers is a valid config (the memory budget refuses to load it), and a layer count
    // whose weights overflow is refused by with_num_hidden_layers.
    let cfg = parse(&fixture_config("tiny-deepseek-v3", |c| {
        c["num_hidden_layers"] = 1_000_000_000u64.into()
    }))
    .unwrap();
    assert_eq!(cfg.num_hidden_layers(), 1_000_000_000);
    let e = cfg
        .with_num_hidden_layers(usize::MAX / 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("overflows"), "{e}");
}

#[test]
fn the_shipped_bench_configs_still_validate() {
    let dir = fixture("").join("../../bench/configs");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path().join("config.json");
        if p.is_file() {
            let cfg = ModelConfig::from_file(&p).unwrap_or_else(|e| panic!("{e}"));
            assert!(cfg.weight_bytes().unwrap() > 1 << 30, "{}", p.display());
            n += 1;
        }
    }
    assert!(n >= 3, "{n} configs in {}", dir.display());
}

#[test]
fn dummy_weights_beyond_memory_are_refused_before_allocating() {
    let d = DummyWeights {
        seed: 0,
        dtype: DType::BF16,
        device: Device::Cpu,
    };
    let avail = fmoe_core::memory::available(Device::Cpu).unwrap();
    if avail.bytes == usize::MAX {
        return; // no limit readable on this host
    }
    // 2^31 × 2^20 bf16 = 4 PiB: named, with its size, instead of an abort.
    let e = d
        .get("lm_head.weight", &[1 << 31, 1 << 20], &[DType::BF16])
        .unwrap_err();
    assert!(
        matches!(e, Error::Core(fmoe_core::Error::OutOfMemory { .. })),
        "{e:?}"
    );
    let e = e.to_string();
    assert!(
        e.contains("dummy weight `lm_head.weight` [2147483648, 1048576] bf16")
            && e.contains(&format!("({} bytes)", 1usize << 52)),
        "{e}"
    );
    // Overflowing dims are a size error, not a wrapped count.
    let e = d
        .get("x.weight", &[1 << 40, 1 << 40], &[DType::BF16])
        .unwrap_err()
        .to_string();
    assert!(e.contains("overflows"), "{e}");
    // A small tensor is generated as before.
    assert_eq!(
        d.get("x.weight", &[3, 5], &[DType::BF16]).unwrap().dims(),
        &[3, 5]
    );
}
