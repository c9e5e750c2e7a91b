//! Bad input to the `fmoe` binary, one test per case: each must end with exit code 1 and exactly
//! one stderr line starting `error:` that names the problem (or, for a closed stdout, exit 0),
//! never a panic (101), a signal, a hang or a silent wrong answer.
//!
//! Every run is capped at 1 GiB of address space (`ulimit -v`), so a case that used to allocate
//! without bound (or try to) now has to fail cleanly under that cap: its peak memory is below
//! 1 GiB. Runs that could hang (a FIFO) have a deadline.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{describe, run_with};

use fmoe_core::{DType, Device, F8E4M3, Tensor};
use serde_json::{Value, json};
use tempfile::TempDir;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-mixtral")
}

fn run(args: &[&str]) -> Output {
    run_with(args, &[], None)
}

/// Asserts the outcome of bad input: exit code 1 (not a panic's 101, not a signal), one stderr
/// line, starting `error:`, containing every one of `words`. Returns that line.
fn assert_error(args: &[&str], out: &Output, words: &[&str]) -> String {
    let what = describe(args, out);
    assert_eq!(out.status.code(), Some(1), "{what}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one stderr line expected: {what}");
    assert!(lines[0].starts_with("error: "), "{what}");
    for w in words {
        assert!(lines[0].contains(w), "`{w}` not named: {what}");
    }
    lines[0].to_string()
}

fn bad(args: &[&str], words: &[&str]) -> String {
    assert_error(args, &run(args), words)
}

/// A copy of the tiny Mixtral (config.json edited by `edit`, checkpoint, tokenizer).
fn model_dir(edit: impl FnOnce(&mut Value)) -> TempDir {
    let dir = TempDir::new().unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture().join(f), dir.path().join(f)).unwrap();
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    edit(&mut cfg);
    write_json(&dir.path().join("config.json"), &cfg);
    dir
}

fn write_json(path: &Path, v: &Value) {
    std::fs::write(path, v.to_string()).unwrap();
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `fmoe generate` on `dir` from two token ids, one new token.
fn generate_args(dir: &Path) -> Vec<&str> {
    vec![
        "generate",
        "--model",
        path_str(dir),
        "--device",
        "cpu",
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "1",
    ]
}

fn generate_dummy_args(dir: &Path) -> Vec<&str> {
    let mut a = generate_args(dir);
    a.extend(["--load-format", "dummy"]);
    a
}

fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo").arg(path).status().unwrap();
    assert!(ok.success(), "mkfifo {}", path.display());
}

// ---- safetensors by hand (the format is a length, a JSON header and the bytes) ----

/// One stored tensor: safetensors dtype name, shape, little-endian bytes.
#[derive(Clone)]
struct Stored {
    dtype: String,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn read_safetensors(path: &Path) -> Vec<(String, Stored)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, v)| {
            let off = v["data_offsets"].as_array().unwrap();
            let (a, b) = (
                off[0].as_u64().unwrap() as usize,
                off[1].as_u64().unwrap() as usize,
            );
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            let dtype = v["dtype"].as_str().unwrap().to_string();
            (
                k,
                Stored {
                    dtype,
                    shape,
                    data: data[a..b].to_vec(),
                },
            )
        })
        .collect()
}

fn write_safetensors(path: &Path, tensors: &[(String, Stored)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, t) in tensors {
        let start = data.len();
        data.extend_from_slice(&t.data);
        header.insert(
            name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&h).unwrap();
    f.write_all(&data).unwrap();
}

fn f32_stored(shape: Vec<usize>, v: &[f32]) -> Stored {
    Stored {
        dtype: "F32".into(),
        shape,
        data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn bf16_values(t: &Stored) -> Vec<f32> {
    assert_eq!(t.dtype, "BF16");
    t.data
        .chunks_exact(2)
        .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
        .collect()
}

/// The tiny Mixtral as an fp8 checkpoint: attention and expert weights in e4m3 with one scale
/// per tensor (`weight_scale`), or, with `block`, one per 128×128 block (`weight_scale_inv`: one
/// block here); `scale_of(name)` may replace a scale. Everything else as stored.
fn fp8_model_dir(block: bool, scale_of: impl Fn(&str) -> Option<f32>) -> TempDir {
    let quant = if block {
        json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": [128, 128]})
    } else {
        json!({"quant_method": "fp8", "activation_scheme": "dynamic"})
    };
    let dir = model_dir(|c| c["quantization_config"] = quant);
    let path = dir.path().join("model.safetensors");
    let mut out = Vec::new();
    for (name, t) in read_safetensors(&path) {
        if !(name.ends_with("_proj.weight") || name.contains(".experts.")) {
            out.push((name, t));
            continue;
        }
        assert!(t.shape.iter().all(|&d| d <= 128), "one block per weight");
        let w = bf16_values(&t);
        let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax.max(1e-10) / 448.0;
        let codes: Vec<f32> = w.iter().map(|v| v / scale).collect();
        let q = Tensor::from_f32(&codes, t.shape.clone(), DType::F8E4M3, &Device::Cpu).unwrap();
        let bits: Vec<u8> = q
            .cpu_slice::<F8E4M3>("test", &name)
            .unwrap()
            .iter()
            .map(|c| c.to_bits())
            .collect();
        let s = scale_of(&name).unwrap_or(scale);
        let base = name.trim_end_matches(".weight").to_string();
        if block {
            out.push((
                format!("{base}.weight_scale_inv"),
                f32_stored(vec![1, 1], &[s]),
            ));
        } else {
            out.push((format!("{base}.weight_scale"), f32_stored(vec![], &[s])));
        }
        out.push((
            name,
            Stored {
                dtype: "F8_E4M3".into(),
                shape: t.shape,
                data: bits,
            },
        ));
    }
    write_safetensors(&path, &out);
    dir
}

/// The tiny Mixtral's checkpoint as two shards and an index; `edit` may change the weight_map.
fn sharded_model_dir(edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> TempDir {
    let dir = model_dir(|_| {});
    let single = dir.path().join("model.safetensors");
    let tensors = read_safetensors(&single);
    std::fs::remove_file(&single).unwrap();
    let mut shards: [Vec<(String, Stored)>; 2] = Default::default();
    let mut map = serde_json::Map::new();
    for (i, (name, t)) in tensors.into_iter().enumerate() {
        map.insert(name.clone(), json!(shard_name(i % 2)));
        shards[i % 2].push((name, t));
    }
    for (i, s) in shards.iter().enumerate() {
        write_safetensors(&dir.path().join(shard_name(i)), s);
    }
    edit(&mut map);
    write_json(
        &dir.path().join("model.safetensors.index.json"),
        &json!({"metadata": {}, "weight_map": map}),
    );
    dir
}

fn shard_name(i: usize) -> String {
    format!("model-{:05}-of-00002.safetensors", i + 1)
}

// ---- the cases ----

#[test]
fn good_input_still_works_under_the_memory_cap() {
    // The cap itself must not break a normal run (else every case below would pass vacuously).
    let dir = model_dir(|_| {});
    let args = generate_args(dir.path());
    let out = run(&args);
    assert!(out.status.success(), "{}", describe(&args, &out));
    let sharded = sharded_model_dir(|_| {});
    let args = generate_args(sharded.path());
    let out = run(&args);
    assert!(out.status.success(), "{}", describe(&args, &out));
}

#[test]
fn heads_times_head_dim_overflow() {
    // 2^60 heads × head_dim 16 wraps to 0 unchecked: attention panicked ("chunk size must be
    // non-zero").
    let dir = model_dir(|c| {
        c["num_attention_heads"] = json!(1u64 << 60);
        c["num_key_value_heads"] = json!(2);
    });
    bad(
        &generate_dummy_args(dir.path()),
        &[
            "config.json",
            "num_attention_heads 1152921504606846976",
            "head_dim 16",
            "overflows",
        ],
    );
}

#[test]
fn dummy_weights_vocab_2_pow_58() {
    // vocab 2^58 × hidden 64 wrapped to 0 elements. Token ids are u32, so such a vocabulary is
    // refused outright; the same overflow through the hidden size is named as one.
    let dir = model_dir(|c| c["vocab_size"] = json!(1u64 << 58));
    bad(
        &generate_dummy_args(dir.path()),
        &["config.json", "vocab_size 288230376151711744", "u32"],
    );
    let dir = model_dir(|c| c["hidden_size"] = json!(1u64 << 58));
    bad(
        &generate_dummy_args(dir.path()),
        &["config.json", "hidden_size 288230376151711744", "overflows"],
    );
}

#[test]
fn dummy_weights_2_pow_59_experts() {
    let dir = model_dir(|c| c["num_local_experts"] = json!(1u64 << 59));
    bad(
        &generate_dummy_args(dir.path()),
        &[
            "config.json",
            "num_local_experts 576460752303423488",
            "overflows",
        ],
    );
}

#[test]
fn bench_moe_tokens_2_pow_62() {
    bad(
        &[
            "bench",
            "moe",
            "--shape",
            "deepseek-small",
            "--tokens",
            "4611686018427387904",
        ],
        &["--tokens 4611686018427387904", "overflows"],
    );
}

#[test]
fn bench_model_decode_steps_near_u64_max() {
    let m = fixture();
    bad(
        &[
            "bench",
            "model",
            "--model",
            path_str(&m),
            "--decode-steps",
            "18446744073709551614",
        ],
        &["--decode-steps 18446744073709551614", "overflows"],
    );
}

#[test]
fn closed_stdout_pipe_exits_0() {
    // `fmoe kernels --catalog-json | head -1` with the reader already gone: every write fails
    // with EPIPE.
    for args in [
        &["kernels", "--catalog-json"][..],
        &["kernels", "--method", "unquantized"][..],
        &["--help"][..],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = run_with(args, &[], Some(Stdio::from(writer)));
        let what = describe(args, &out);
        assert_eq!(out.status.code(), Some(0), "{what}");
        assert!(out.stderr.is_empty(), "{what}");
    }
}

#[test]
fn full_stdout_is_one_error_line() {
    let dir = model_dir(|_| {});
    let generate = generate_args(dir.path());
    for args in [&["kernels", "--catalog-json"][..], &generate[..]] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = run_with(args, &[], Some(Stdio::from(full)));
        assert_error(
            args,
            &out,
            &["writing to stdout", "No space left on device"],
        );
    }
}

#[test]
fn bench_moe_tokens_1e8_beyond_memory() {
    bad(
        &[
            "bench",
            "moe",
            "--shape",
            "deepseek-small",
            "--tokens",
            "100000000",
        ],
        &["--tokens 100000000", "needs", "available"],
    );
}

#[test]
fn dummy_weights_huge_vocab() {
    let dir = model_dir(|c| c["vocab_size"] = json!(1u64 << 31));
    bad(
        &generate_dummy_args(dir.path()),
        &["weights of MixtralForCausalLM", "needs", "available"],
    );
}

#[test]
fn dummy_weights_huge_intermediate_size() {
    let dir = model_dir(|c| c["intermediate_size"] = json!(1u64 << 36));
    bad(
        &generate_dummy_args(dir.path()),
        &["weights of MixtralForCausalLM", "needs", "available"],
    );
}

#[test]
fn dummy_weights_huge_hidden_size() {
    let dir = model_dir(|c| c["hidden_size"] = json!(1u64 << 32));
    bad(
        &generate_dummy_args(dir.path()),
        &["weights of MixtralForCausalLM", "needs", "available"],
    );
}

#[test]
fn bench_model_dummy_weights_beyond_memory() {
    let dir = model_dir(|c| c["vocab_size"] = json!(1u64 << 31));
    bad(
        &["bench", "model", "--model", path_str(dir.path())],
        &["weights of MixtralForCausalLM", "needs", "available"],
    );
}

#[test]
fn bench_model_batch_1e9() {
    let m = fixture();
    bad(
        &[
            "bench",
            "model",
            "--model",
            path_str(&m),
            "--batch",
            "1000000000",
        ],
        &["--batch 1000000000", "needs", "available"],
    );
}

#[test]
fn bench_model_prompt_len_1e11() {
    let m = fixture();
    bad(
        &[
            "bench",
            "model",
            "--model",
            path_str(&m),
            "--prompt-len",
            "100000000000",
        ],
        &["--prompt-len 100000000000", "max_position_embeddings 256"],
    );
}

#[test]
fn truncated_checkpoint() {
    let dir = model_dir(|_| {});
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    bad(
        &generate_args(dir.path()),
        &["model.safetensors", "not a valid safetensors", "truncated"],
    );
}

#[test]
fn fifo_shard_is_an_error_not_a_hang() {
    let dir = sharded_model_dir(|_| {});
    let shard = dir.path().join(shard_name(1));
    std::fs::remove_file(&shard).unwrap();
    mkfifo(&shard);
    bad(
        &generate_args(dir.path()),
        &[&shard_name(1), "must be a regular file", "FIFO"],
    );
}

#[test]
fn tokenizer_normalizer_expansion_is_refused() {
    // One character → 100k: a 2000-character prompt used to become 18 GB before any check.
    let dir = model_dir(|_| {});
    let tok_path = dir.path().join("tokenizer.json");
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    tok["normalizer"] = json!({
        "type": "Replace",
        "pattern": {"String": "a"},
        "content": "b".repeat(100_000),
    });
    write_json(&tok_path, &tok);
    let prompt = "a".repeat(2000);
    let mut args = generate_args(dir.path());
    let ids = args.iter().position(|a| *a == "--prompt-ids").unwrap();
    args[ids] = "--prompt";
    args[ids + 1] = &prompt;
    bad(&args, &["tokenizer.json", "normalizer", "2000-byte"]);
}

#[test]
fn dummy_weights_1e9_layers() {
    let m = fixture();
    bad(
        &[
            "bench",
            "model",
            "--model",
            path_str(&m),
            "--num-layers",
            "1000000000",
        ],
        &["1000000000 layers", "needs", "available"],
    );
    let dir = model_dir(|c| c["num_hidden_layers"] = json!(1_000_000_000u64));
    bad(
        &["bench", "model", "--model", path_str(dir.path())],
        &["1000000000 layers", "needs", "available"],
    );
}

#[test]
fn rms_norm_eps_1e300() {
    // Finite in f64, infinite in the f32 the norm computes in: every token used to come out 0.
    let dir = model_dir(|c| c["rms_norm_eps"] = json!(1e300));
    bad(
        &generate_args(dir.path()),
        &["config.json", "rms_norm_eps", "f32"],
    );
}

#[test]
fn rope_theta_1e_minus_300() {
    let dir = model_dir(|c| c["rope_parameters"]["rope_theta"] = json!(1e-300));
    bad(
        &generate_args(dir.path()),
        &["config.json", "rope_theta", "f32"],
    );
}

#[test]
fn expert_weight_scale_zero_or_negative() {
    for s in [0.0f32, -1.0] {
        let dir = fp8_model_dir(false, |n| {
            (n == "model.layers.1.block_sparse_moe.experts.2.w3.weight").then_some(s)
        });
        bad(
            &generate_args(dir.path()),
            &[
                "model.layers.1.block_sparse_moe.experts.2.w3.weight",
                "weight_scale",
                "positive",
            ],
        );
    }
}

#[test]
fn expert_weight_scale_nan_or_inf() {
    for s in [f32::NAN, f32::INFINITY] {
        let dir = fp8_model_dir(false, |n| {
            (n == "model.layers.0.block_sparse_moe.experts.1.w2.weight").then_some(s)
        });
        bad(
            &generate_args(dir.path()),
            &[
                "model.layers.0.block_sparse_moe.experts.1.w2.weight",
                "weight_scale",
                "finite",
            ],
        );
    }
}

#[test]
fn block_weight_scale_inv_zero_or_negative() {
    // Anywhere: a dense (attention) weight and an expert.
    for victim in [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.block_sparse_moe.experts.0.w1.weight",
    ] {
        for s in [0.0f32, -2.0, f32::NAN] {
            let dir = fp8_model_dir(true, |n| (n == victim).then_some(s));
            bad(
                &generate_args(dir.path()),
                &[victim, "weight_scale_inv", "positive"],
            );
        }
    }
}

#[test]
fn a_good_fp8_checkpoint_loads() {
    // The fp8 checkpoints above differ from a loadable one only in the scale they break.
    for block in [false, true] {
        let dir = fp8_model_dir(block, |_| None);
        let args = generate_args(dir.path());
        let out = run(&args);
        assert!(out.status.success(), "{}", describe(&args, &out));
    }
}

#[test]
fn weight_map_wrong_shard() {
    let victim = "model.norm.weight";
    let dir = sharded_model_dir(|map| {
        let other = if map[victim] == json!(shard_name(0)) {
            shard_name(1)
        } else {
            shard_name(0)
        };
        map.insert(victim.into(), json!(other));
    });
    bad(
        &generate_args(dir.path()),
        &["weight_map", victim, "index.json"],
    );
}

#[test]
fn eos_token_id_outside_vocabulary() {
    let dir = model_dir(|c| c["eos_token_id"] = json!(512));
    bad(
        &generate_args(dir.path()),
        &["config.json", "eos_token_id 512", "vocab_size 512"],
    );
}

#[test]
fn bench_moe_tokens_0() {
    bad(
        &[
            "bench",
            "moe",
            "--shape",
            "deepseek-small",
            "--tokens",
            "1,0",
        ],
        &["--tokens", "positive"],
    );
}

#[test]
fn bench_model_decode_steps_0() {
    let m = fixture();
    bad(
        &[
            "bench",
            "model",
            "--model",
            path_str(&m),
            "--decode-steps",
            "0",
        ],
        &["--decode-steps", "positive"],
    );
}

#[test]
fn model_safetensors_is_a_directory() {
    let dir = model_dir(|_| {});
    let single = dir.path().join("model.safetensors");
    std::fs::remove_file(&single).unwrap();
    std::fs::create_dir(&single).unwrap();
    bad(
        &generate_args(dir.path()),
        &["model.safetensors", "must be a regular file", "a directory"],
    );
}

#[test]
fn tokenizer_json_is_a_directory_or_fifo() {
    for fifo in [false, true] {
        let dir = model_dir(|_| {});
        let tok = dir.path().join("tokenizer.json");
        std::fs::remove_file(&tok).unwrap();
        if fifo {
            mkfifo(&tok);
        } else {
            std::fs::create_dir(&tok).unwrap();
        }
        let kind = if fifo { "FIFO" } else { "a directory" };
        bad(
            &generate_args(dir.path()),
            &["tokenizer.json", "must be a regular file", kind],
        );
    }
}

#[test]
fn shard_named_dot_or_a_subdirectory() {
    let dir = sharded_model_dir(|map| {
        map.insert("model.norm.weight".into(), json!("."));
    });
    bad(
        &generate_args(dir.path()),
        &["shard name `.`", "not a plain file name"],
    );
    let dir = sharded_model_dir(|_| {});
    let shard = dir.path().join(shard_name(0));
    std::fs::remove_file(&shard).unwrap();
    std::fs::create_dir(&shard).unwrap();
    bad(
        &generate_args(dir.path()),
        &[&shard_name(0), "must be a regular file", "a directory"],
    );
}

#[test]
fn config_json_is_a_fifo() {
    let dir = model_dir(|_| {});
    let cfg = dir.path().join("config.json");
    std::fs::remove_file(&cfg).unwrap();
    mkfifo(&cfg);
    bad(
        &generate_args(dir.path()),
        &["config.json", "must be a regular file", "FIFO"],
    );
}

#[test]
fn fmoe_dev_pdl_garbage_on_cpu() {
    for args in [
        &["kernels", "--method", "unquantized", "--device", "cpu"][..],
        &["kernels", "--catalog-json"][..],
    ] {
        let out = run_with(args, &[("FMOE_DEV_PDL", "garbage")], None);
        assert_error(args, &out, &["FMOE_DEV_PDL", "\"garbage\""]);
    }
}

/// Every command fails fast on a bad developer override, an experiment-only one in a build
/// without `dev-knobs`, or two that contradict, whatever the device.
#[test]
fn fmoe_dev_overrides_fail_at_start_up() {
    let args = &["kernels", "--catalog-json"][..];
    let out = run_with(args, &[("FMOE_DEV_SPLITS", "0")], None);
    assert_error(
        args,
        &out,
        &["FMOE_DEV_SPLITS", "\"0\"", "positive integer"],
    );
    let out = run_with(
        args,
        &[("FMOE_DEV_SWAPAB", "off"), ("FMOE_DEV_SWAPAB_BN", "64")],
        None,
    );
    assert_error(
        args,
        &out,
        &["FMOE_DEV_SWAPAB_BN", "cannot apply", "FMOE_DEV_SWAPAB=off"],
    );
    if !cfg!(feature = "dev-knobs") {
        let out = run_with(args, &[("FMOE_DEV_EXTRA_DEFINES", "moe_align:X=1")], None);
        assert_error(
            args,
            &out,
            &["FMOE_DEV_EXTRA_DEFINES", "--features dev-knobs"],
        );
    }
}

#[test]
fn usage_errors_are_one_line() {
    bad(&["bench", "moe", "--tokens", "abc"], &["--tokens", "abc"]);
    bad(&["kernels"], &["--method"]);
    bad(&["bench", "moe", "--tokens", "-1"], &["-1"]);
}

#[test]
fn sampling_flags_are_checked_before_the_model_loads() {
    // The model directory does not exist: the flag's error comes first.
    for (flag, word) in [
        ("--temperature=-1", "temperature"),
        ("--temperature=nan", "temperature"),
        ("--top-p=0", "top_p"),
        ("--top-p=1.5", "top_p"),
    ] {
        bad(
            &[
                "generate",
                "--model",
                "/nonexistent/fmoe-model",
                "--prompt-ids",
                "1",
                flag,
            ],
            &[word],
        );
    }
}

#[test]
fn generate_max_tokens_near_usize_max_is_cut_at_the_context() {
    // prompt + max_tokens would wrap: generation stops at the model's context instead.
    let m = fixture();
    let mut args = generate_args(&m);
    let n = args.len();
    args[n - 1] = "18446744073709551615";
    args.extend(["--ignore-eos", "--json"]);
    let out = run(&args);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let j: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(j["finish_reason"], "length");
    // A 2-token prompt in a 256-position context: 254 new tokens.
    assert_eq!(j["token_ids"].as_array().unwrap().len(), 254, "{j}");
}
