//! `fmoe generate` end to end on the tiny Mixtral and DeepSeek-V3 fixtures: the `--json` line
//! against transformers' greedy continuation, text prompts, dummy weights with fewer layers, and
//! bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-mixtral")
}

fn fmoe(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fmoe"));
    for var in [
        "FMOE_USE_FUSED",
        "FMOE_USE_FUSED_MOE",
        "FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE",
        "RUST_LOG",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    cmd.args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run fmoe {args:?}: {e}"))
}

fn describe(out: &Output) -> String {
    format!(
        "{}\n--- stdout ---\n{}--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn deepseek_fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-deepseek-v3")
}

fn expected() -> serde_json::Value {
    expected_in(&fixture())
}

fn expected_in(dir: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The last stdout line as JSON.
fn last_json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", describe(out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {}", describe(out)))
}

fn ids_arg(v: &serde_json::Value) -> String {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn greedy_json_matches_transformers() {
    let exp = expected();
    let model = fixture();
    let model = model.to_str().unwrap();
    let prompt = ids_arg(&exp["prompt_ids"][0]);
    let args = [
        "generate",
        "--model",
        model,
        "--device",
        "cpu",
        "--prompt-ids",
        &prompt,
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--json",
    ];
    for env in [&[][..], &[("FMOE_USE_FUSED", "1")][..]] {
        let j = last_json(&fmoe(&args, env));
        assert_eq!(j["token_ids"], exp["greedy_ids"][0], "{env:?}: {j}");
        assert_eq!(j["prompt_tokens"], 5);
        assert_eq!(j["finish_reason"], "length");
        assert!(j["text"].is_string() && j["tokens_per_s"].as_f64().unwrap() > 0.0);
        let kernel = if env.is_empty() { "portable" } else { "fused" };
        assert_eq!(j["moe_kernel"], kernel);
        assert_eq!(j["moe_method"], "unquantized");
    }
}

#[test]
fn text_prompts_batch_and_tokenize_like_transformers() {
    let exp = expected();
    let model = fixture();
    let p0 = exp["prompts"][0].as_str().unwrap();
    let p2 = exp["prompts"][2].as_str().unwrap();
    let out = fmoe(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            p0,
            "--prompt",
            p2,
            "--max-tokens",
            "16",
            "--json",
        ],
        &[],
    );
    let j = last_json(&out);
    assert_eq!(j["outputs"][0]["token_ids"], exp["greedy_ids"][0], "{j}");
    assert_eq!(j["outputs"][1]["token_ids"], exp["greedy_ids"][2], "{j}");
    assert_eq!(j["outputs"][1]["prompt_tokens"], 23);
    // Without --json: the text, and tokens/s on stderr.
    let out = fmoe(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            p0,
            "--max-tokens",
            "4",
            "--quantization",
            "fp8",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tokens/s"));
}

#[test]
fn bad_input_is_a_one_line_error() {
    let model = fixture();
    let model = model.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--model", model, "--prompt-ids", "1,x"],
            "`x` is not a token id",
        ),
        (
            &["--model", model, "--prompt-ids", "1,9999"],
            "token id 9999",
        ),
        (&["--model", model], "--prompt"),
        (
            &["--model", model, "--prompt-ids", "1", "--top-p", "0"],
            "top_p",
        ),
        (
            &["--model", "/nonexistent-fmoe", "--prompt-ids", "1"],
            "/nonexistent-fmoe/config.json",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec!["generate"];
        args.extend_from_slice(extra);
        let out = fmoe(&args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want) && err.trim().lines().count() == 1,
            "{args:?}: {}",
            describe(&out)
        );
    }
}

#[test]
fn cuda_without_a_gpu_is_the_one_line_error() {
    let out = fmoe(
        &[
            "generate",
            "--model",
            fixture().to_str().unwrap(),
            "--device",
            "cuda",
            "--prompt-ids",
            "1,2",
            "--max-tokens",
            "2",
        ],
        &[],
    );
    if out.status.success() {
        println!("skipped: a CUDA device is present");
        return;
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("error: no CUDA device/driver found") && err.trim().lines().count() == 1,
        "{}",
        describe(&out)
    );
}

#[test]
fn deepseek_greedy_json_matches_transformers() {
    let dir = deepseek_fixture();
    let exp = expected_in(&dir);
    let prompt = ids_arg(&exp["prompt_ids"][0]);
    let args = [
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--device",
        "cpu",
        "--prompt-ids",
        &prompt,
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--json",
    ];
    for env in [&[][..], &[("FMOE_USE_FUSED", "1")][..]] {
        let j = last_json(&fmoe(&args, env));
        assert_eq!(j["token_ids"], exp["greedy_ids"][0], "{env:?}: {j}");
        assert_eq!(j["model"], "DeepseekV3ForCausalLM");
        assert_eq!(j["num_layers"], 3);
        assert_eq!(j["prompt_tokens"], 5);
        assert_eq!(j["finish_reason"], "length");
        let kernel = if env.is_empty() { "portable" } else { "fused" };
        assert_eq!(j["moe_kernel"], kernel);
        assert_eq!(j["moe_method"], "unquantized");
    }
}

#[test]
fn deepseek_dummy_weights_with_fewer_layers() {
    // Only config.json: a DeepSeek-V3 config (the tiny one, as CI stands in for real widths),
    // dummy weights, the first 2 of its 3 layers (one dense, one MoE), fp8-block experts.
    let dir = std::env::temp_dir().join(format!("fmoe-cli-ds-dummy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        deepseek_fixture().join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let model = dir.to_str().unwrap();
    let run = |layers: &str| {
        fmoe(
            &[
                "generate",
                "--model",
                model,
                "--load-format",
                "dummy",
                "--num-layers",
                layers,
                "--quantization",
                "fp8-block",
                "--prompt-ids",
                "1,2,3",
                "--max-tokens",
                "4",
                "--ignore-eos",
                "--json",
            ],
            &[],
        )
    };
    let j = last_json(&run("2"));
    assert_eq!(j["model"], "DeepseekV3ForCausalLM", "{j}");
    assert_eq!(j["num_layers"], 2);
    assert_eq!(j["generated_tokens"], 4);
    assert_eq!(j["token_ids"].as_array().unwrap().len(), 4);
    assert_eq!(j["moe_method"], "fp8-block");
    let out = run("0");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--num-layers") && err.contains('0'),
        "{}",
        describe(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every fixture prompt four times, through a pool of a few 4-token blocks, 4 sequences at once
/// and a budget of 8 tokens a step: the greedy ids are still transformers', prompt by prompt,
/// and the engine line shows that preemption and prefix hits happened.
#[test]
fn engine_flags_under_pressure_keep_the_greedy_ids() {
    for dir in [fixture(), deepseek_fixture()] {
        let exp = expected_in(&dir);
        let prompts: Vec<String> = (0..12)
            .map(|i| ids_arg(&exp["prompt_ids"][i % 3]))
            .collect();
        let mut args = vec![
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--device",
            "cpu",
            "--max-tokens",
            "16",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
            "--num-kv-blocks",
            "14",
            "--block-size",
            "4",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "8",
        ];
        for p in &prompts {
            args.extend(["--prompt-ids", p.as_str()]);
        }
        let j = last_json(&fmoe(&args, &[]));
        for i in 0..12 {
            assert_eq!(
                j["outputs"][i]["token_ids"],
                exp["greedy_ids"][i % 3],
                "{}: prompt {i}: {j}",
                dir.display()
            );
        }
        let e = &j["engine"];
        assert!(e["preemptions"].as_u64().unwrap() > 0, "{e}");
        assert!(e["prefix_cache_hits"].as_u64().unwrap() > 0, "{e}");
        assert!(e["peak_blocks"].as_u64().unwrap() <= 14, "{e}");
        assert!(
            e["prefix_cache_queries"].as_u64().unwrap() >= e["prefix_cache_hits"].as_u64().unwrap()
        );
    }
}

#[test]
fn bench_throughput_and_latency_run_both_kernel_families() {
    let dir = fixture();
    let model = dir.to_str().unwrap();
    let json = std::env::temp_dir().join(format!("fmoe-bench-engine-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&json);
    let common = [
        "--model",
        model,
        "--device",
        "cpu",
        "--input-len",
        "12",
        "--output-len",
        "4",
        "--kernels",
        "fused,portable",
        "--json",
        json.to_str().unwrap(),
    ];
    let mut t = vec![
        "bench",
        "throughput",
        "--num-prompts",
        "16",
        "--random-range-ratio",
        "0.5",
    ];
    t.extend(common);
    let out = fmoe(&t, &[]);
    assert!(out.status.success(), "{}", describe(&out));
    let mut l = vec!["bench", "latency", "--batch-size", "4", "--num-iters", "3"];
    l.extend(common);
    let out = fmoe(&l, &[]);
    assert!(out.status.success(), "{}", describe(&out));
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    std::fs::remove_file(&json).ok();
    assert_eq!(rows.len(), 4);
    let kernels: Vec<&str> = rows
        .iter()
        .map(|r| r["moe_kernel"].as_str().unwrap())
        .collect();
    assert_eq!(kernels, ["fused", "portable", "fused", "portable"]);
    for r in &rows[..2] {
        assert_eq!(r["num_requests"], 16);
        for f in [
            "requests_per_s",
            "output_tokens_per_s",
            "total_tokens_per_s",
        ] {
            assert!(r[f].as_f64().unwrap() > 0.0, "{f}: {r}");
        }
        assert!(r["total_tokens_per_s"].as_f64() > r["output_tokens_per_s"].as_f64());
        assert_eq!(r["moe_method"], "unquantized");
    }
    for r in &rows[2..] {
        let (p50, p99) = (
            r["latency_ms_p50"].as_f64().unwrap(),
            r["latency_ms_p99"].as_f64().unwrap(),
        );
        assert!(p50 > 0.0 && p99 >= p50, "{r}");
        assert!(r["latency_ms_mean"].as_f64().unwrap() > 0.0);
    }
}
