//! End-to-end tests of the `fmoe` binary: kernel selection under every combination of the
//! `FMOE_*` switches, bad switch values, bad flags, a missing CUDA device, and the JSON rows of
//! `fmoe bench moe`.
//!
//! Every run starts from an environment without the `FMOE_*` switches (and without `RUST_LOG`), so
//! the results never depend on the caller's environment.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Output};

const FUSED: &str = "FMOE_USE_FUSED";
const FUSED_MOE: &str = "FMOE_USE_FUSED_MOE";
const BLOCK: &str = "FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE";
const VARS: [&str; 3] = [FUSED, FUSED_MOE, BLOCK];
const METHODS: [&str; 3] = ["unquantized", "fp8-tensor", "fp8-block"];

/// Runs `fmoe args…` with exactly the switches in `env` set.
fn fmoe(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fmoe"));
    for var in VARS {
        cmd.env_remove(var);
    }
    cmd.env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run fmoe {args:?}: {e}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A readable account of a run for assertion messages.
fn describe(args: &[&str], env: &[(&str, &str)], out: &Output) -> String {
    format!(
        "fmoe {args:?} with {env:?}: {}\n--- stdout ---\n{}--- stderr ---\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    )
}

/// The words of `line`, lowercased (split at anything that is not a letter, digit, `-` or `_`).
fn words(line: &str) -> Vec<String> {
    line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect()
}

/// A switch value as 0/1; `None` when unset. Accepts 0, 1, true, false in any case.
fn normalize(value: Option<&str>) -> Option<&'static str> {
    value.map(|v| match v.to_ascii_lowercase().as_str() {
        "1" | "true" => "1",
        "0" | "false" => "0",
        other => panic!("test bug: {other:?} is not a valid switch value"),
    })
}

/// The documented cascade, written out independently of the library: fused iff FUSED=1 and
/// FUSED_MOE is not 0 and (the method is not fp8-block or BLOCK=1).
fn expected_kernel(
    fused: Option<&str>,
    fused_moe: Option<&str>,
    block: Option<&str>,
    method: &str,
) -> &'static str {
    let (fused, fused_moe, block) = (normalize(fused), normalize(fused_moe), normalize(block));
    if fused == Some("1") && fused_moe != Some("0") && (method != "fp8-block" || block == Some("1"))
    {
        "fused"
    } else {
        "portable"
    }
}

/// (FMOE_USE_FUSED, FMOE_USE_FUSED_MOE, FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE, method); `None` = unset.
type Switches = (
    Option<&'static str>,
    Option<&'static str>,
    Option<&'static str>,
    &'static str,
);

/// Runs `fmoe kernels` for `method` under the given switches and checks its verdict.
fn check_kernels(fused: Option<&str>, fused_moe: Option<&str>, block: Option<&str>, method: &str) {
    let env: Vec<(&str, &str)> = [(FUSED, fused), (FUSED_MOE, fused_moe), (BLOCK, block)]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect();
    let args = ["kernels", "--method", method, "--device", "cpu"];
    let out = fmoe(&args, &env);
    let what = describe(&args, &env, &out);
    assert!(out.status.success(), "{what}");
    let stdout = text(&out.stdout);
    let lower = stdout.to_ascii_lowercase();
    assert!(
        lower.contains("fused") != lower.contains("portable"),
        "stdout must name exactly one of fused / portable: {what}"
    );
    let verdicts: Vec<String> = stdout
        .lines()
        .flat_map(words)
        .filter(|w| w == "fused" || w == "portable")
        .collect();
    let lines = stdout
        .lines()
        .filter(|l| words(l).iter().any(|w| w == "fused" || w == "portable"))
        .count();
    assert_eq!(lines, 1, "one verdict line expected: {what}");
    assert_eq!(verdicts.len(), 1, "one verdict word expected: {what}");
    let want = expected_kernel(fused, fused_moe, block, method);
    assert_eq!(verdicts[0], want, "{what}");
}

#[test]
fn kernels_follows_the_full_truth_table() {
    let values = [None, Some("0"), Some("1")];
    let mut fused_count = 0;
    for fused in values {
        for fused_moe in values {
            for block in values {
                for method in METHODS {
                    check_kernels(fused, fused_moe, block, method);
                    if expected_kernel(fused, fused_moe, block, method) == "fused" {
                        fused_count += 1;
                    }
                }
            }
        }
    }
    // Sanity of the table itself: FUSED=1 (1 of 3) × FUSED_MOE ≠ 0 (2 of 3) × 3 BLOCK values gives
    // 6 combinations; unquantized and fp8-tensor are fused in all 6, fp8-block in the 2 with BLOCK=1.
    assert_eq!(fused_count, 6 + 6 + 2);
}

#[test]
fn kernels_accepts_true_false_spellings() {
    let cases: &[Switches] = &[
        (Some("true"), None, None, "unquantized"),
        (Some("True"), Some("TRUE"), Some("true"), "fp8-block"),
        (Some("true"), None, Some("FALSE"), "fp8-block"),
        (Some("TRUE"), Some("False"), Some("True"), "fp8-tensor"),
        (Some("FALSE"), Some("true"), Some("true"), "unquantized"),
        (Some("false"), None, None, "fp8-tensor"),
    ];
    for &(fused, fused_moe, block, method) in cases {
        check_kernels(fused, fused_moe, block, method);
    }
}

/// `text` mentions `var` itself, not only a longer name that starts with it (FMOE_USE_FUSED is a
/// prefix of the other two).
fn mentions_var(text: &str, var: &str) -> bool {
    text.match_indices(var).any(|(i, _)| {
        !text[i + var.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

fn assert_no_panic(what: &str, stderr: &str) {
    assert!(!stderr.contains("panicked"), "{what}");
    assert!(!stderr.contains("RUST_BACKTRACE"), "{what}");
}

#[test]
fn bad_switch_values_are_errors_naming_the_variable() {
    for var in VARS {
        for bad in ["yes", "2", ""] {
            let env = [(var, bad)];
            let runs: [&[&str]; 2] = [
                &["kernels", "--method", "unquantized", "--device", "cpu"],
                &[
                    "bench",
                    "moe",
                    "--device",
                    "cpu",
                    "--shape",
                    "deepseek-small",
                    "--tokens",
                    "1",
                    "--min-time",
                    "0",
                ],
            ];
            for args in runs {
                let out = fmoe(args, &env);
                let what = describe(args, &env, &out);
                let stderr = text(&out.stderr);
                assert!(!out.status.success(), "{what}");
                assert!(mentions_var(&stderr, var), "variable not named: {what}");
                // Quoted, so that the empty value is visible too.
                assert!(
                    stderr.contains(&format!("{bad:?}")),
                    "value not named: {what}"
                );
                for other in VARS.into_iter().filter(|o| *o != var) {
                    assert!(
                        !mentions_var(&stderr, other),
                        "wrong variable named: {what}"
                    );
                }
                assert_no_panic(&what, &stderr);
            }
        }
    }
}

#[test]
fn unknown_method_lists_the_valid_ones() {
    let args = ["kernels", "--method", "int4", "--device", "cpu"];
    let out = fmoe(&args, &[]);
    let what = describe(&args, &[], &out);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{what}");
    assert!(stderr.contains("int4"), "{what}");
    for m in METHODS {
        assert!(stderr.contains(m), "{m} not listed: {what}");
    }
    assert_no_panic(&what, &stderr);
}

#[test]
fn bench_on_cuda_without_a_device_is_one_line_error() {
    // No device visible, so a machine with a GPU checks the same path as one without (CI).
    let env = [("CUDA_VISIBLE_DEVICES", "")];
    let args = ["bench", "moe", "--device", "cuda", "--tokens", "1"];
    let out = fmoe(&args, &env);
    let what = describe(&args, &env, &out);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{what}");
    let lines: Vec<&str> = stderr.trim().lines().collect();
    assert_eq!(lines.len(), 1, "{what}");
    assert!(!lines[0].trim().is_empty(), "{what}");
    assert!(lines[0].contains("CUDA"), "{what}");
    assert_no_panic(&what, &stderr);
}

/// A fresh path in the temp dir, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(tag: &str) -> TempFile {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = std::env::temp_dir().join(format!(
            "fmoe-cli-test-{tag}-{}-{nanos}.jsonl",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn num(row: &serde_json::Value, key: &str) -> f64 {
    row[key]
        .as_f64()
        .unwrap_or_else(|| panic!("`{key}` is not a number in {row}"))
}

#[test]
fn bench_json_rows_are_complete_and_appended() {
    let file = TempFile::new("bench");
    let path = file.0.to_str().expect("temp path is UTF-8");
    let args = [
        "bench",
        "moe",
        "--device",
        "cpu",
        "--shape",
        "deepseek-small",
        "--tokens",
        "1,16",
        "--min-time",
        "0",
        "--json",
        path,
    ];
    for run in 1..=2 {
        let out = fmoe(&args, &[]);
        let what = describe(&args, &[], &out);
        assert!(out.status.success(), "{what}");
        assert_no_panic(&what, &text(&out.stderr));

        let contents = std::fs::read_to_string(&file.0).expect("bench wrote the JSON file");
        let lines: Vec<&str> = contents.lines().collect();
        assert_eq!(lines.len(), 12 * run, "run {run}:\n{contents}");
        let mut seen: HashMap<(String, String, u64), usize> = HashMap::new();
        for line in lines {
            let row: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            assert_eq!(row["shape"], "deepseek-small", "{row}");
            let method = row["method"].as_str().expect("method is a string");
            assert!(METHODS.contains(&method), "{row}");
            let kernel = row["kernel"].as_str().expect("kernel is a string");
            assert!(kernel == "fused" || kernel == "portable", "{row}");
            let tokens = row["tokens"].as_u64().expect("tokens is an integer");
            assert!(tokens == 1 || tokens == 16, "{row}");
            assert!(num(&row, "ms") > 0.0, "{row}");
            let rel = num(&row, "rel_err");
            let quant = num(&row, "quant_err");
            assert!((0.0..1e-2).contains(&rel), "{row}");
            if method == "unquantized" {
                // Same operands and unquantized operands are the same thing here.
                assert!((quant - rel).abs() <= 1e-9, "{row}");
            } else {
                assert!(quant > rel, "fp8 error must dominate: {row}");
                assert!(quant < 0.27, "{row}");
            }
            let touched = row["experts_touched"]
                .as_u64()
                .expect("experts_touched is an integer");
            assert!(touched > 0, "{row}");
            *seen
                .entry((method.to_string(), kernel.to_string(), tokens))
                .or_default() += 1;
        }
        assert_eq!(seen.len(), 3 * 2 * 2, "{seen:?}");
        assert!(seen.values().all(|&c| c == run), "{seen:?}");
    }
}

#[test]
fn help_mentions_the_switches() {
    let out = fmoe(&["--help"], &[]);
    let what = describe(&["--help"], &[], &out);
    assert!(out.status.success(), "{what}");
    assert!(text(&out.stdout).contains(FUSED), "{what}");

    let args = ["kernels", "--help"];
    let out = fmoe(&args, &[]);
    let what = describe(&args, &[], &out);
    assert!(out.status.success(), "{what}");
    assert!(text(&out.stdout).contains("--method"), "{what}");
}

/// `fmoe kernels --catalog-json`: one JSON object a line per NVRTC program, together exactly the
/// kernel catalog (every variant's family, entry and defines in order), each source a file under
/// crates/fmoe-kernels/cuda/ with the text the binary compiles.
#[test]
fn kernels_catalog_json_is_the_catalog() {
    let args = ["kernels", "--catalog-json"];
    let out = fmoe(&args, &[]);
    let what = describe(&args, &[], &out);
    assert!(out.status.success(), "{what}");
    let cuda = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fmoe-kernels/cuda");
    let mut names = Vec::new();
    let mut programs = std::collections::HashSet::new();
    for line in text(&out.stdout).lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let s = |key: &str| v[key].as_str().unwrap_or_else(|| panic!("{key}: {line}"));
        let (family, source) = (s("family"), s("source"));
        let on_disk = std::fs::read_to_string(cuda.join(source))
            .unwrap_or_else(|e| panic!("{source}: {e}: {line}"));
        let defines: Vec<String> = v["defines"]
            .as_array()
            .unwrap_or_else(|| panic!("defines: {line}"))
            .iter()
            .map(|d| match d.as_array().map(Vec::as_slice) {
                Some([n, x]) => format!("{}={}", n.as_str().unwrap(), x.as_str().unwrap()),
                _ => panic!("define {d}: {line}"),
            })
            .collect();
        assert!(
            programs.insert((family.to_string(), source.to_string(), defines.clone())),
            "program listed twice: {line}"
        );
        let entries = v["entries"].as_array().unwrap();
        assert!(!entries.is_empty(), "{line}");
        for e in entries {
            let entry = e.as_str().unwrap();
            // The source defines the entry point (as an extern "C" kernel).
            assert!(on_disk.contains(entry), "{entry} not in {source}");
            let mut name = format!("{family}/{entry}");
            if !defines.is_empty() {
                name.push_str(&format!("[{}]", defines.join(",")));
            }
            names.push((name, on_disk.clone()));
        }
    }
    let catalog = fmoe_kernels::catalog::all();
    assert_eq!(names.len(), catalog.len(), "{what}");
    for ((name, on_disk), k) in names.iter().zip(&catalog) {
        assert_eq!(*name, k.name());
        assert!(
            *on_disk == k.source,
            "{name}: source file is not its source"
        );
    }
    // The PDL builds are in it, PDL=1 last.
    assert!(names.iter().any(|(n, _)| n.ends_with(",PDL=1]")), "{what}");
}

#[test]
fn kernels_catalog_json_takes_no_method() {
    for args in [
        &["kernels", "--catalog-json", "--method", "unquantized"][..],
        &["kernels", "--catalog-json", "--device", "cpu"][..],
        &["kernels"][..],
    ] {
        let out = fmoe(args, &[]);
        let what = describe(args, &[], &out);
        assert!(!out.status.success(), "{what}");
        assert!(text(&out.stdout).is_empty(), "{what}");
        assert_no_panic(&what, &text(&out.stderr));
    }
}
