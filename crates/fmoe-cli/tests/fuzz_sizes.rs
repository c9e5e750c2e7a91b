//! Property tests of the size flags (`bench moe --tokens`, `bench model --batch / --prompt-len /
//! --decode-steps / --num-layers`): whatever the numbers (0, powers of two up to 2^64, u64::MAX,
//! garbage), `fmoe` under a 1 GiB address-space cap exits 0, or 1 with exactly one stderr line
//! starting `error:`; never a panic, an abort, a signal or a hang.
//!
//! Cases per property: `FMOE_FUZZ_CASES` (default 100, each case runs the binary; CI runs the
//! default). For a longer run: `FMOE_FUZZ_CASES=2000 cargo test --release -p fmoe-cli --test
//! fuzz_sizes`.

mod common;

use std::path::PathBuf;

use proptest::prelude::*;
use proptest::test_runner::Config;

fn config() -> Config {
    Config {
        cases: std::env::var("FMOE_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100),
        // Each shrinking step runs the binary too.
        max_shrink_iters: 64,
        ..Config::default()
    }
}

/// A size flag's text: small values that run quickly, values far too large for any machine,
/// overflow edges, and text that is not a number. (Mid-sized values would only make the
/// benchmark run long.)
fn size_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => (0u64..4).prop_map(|v| v.to_string()),
        3 => (20u32..64).prop_map(|k| (1u64 << k).to_string()),
        2 => (0u64..4).prop_map(|d| (u64::MAX - d).to_string()),
        1 => Just("18446744073709551616".to_string()),
        1 => Just("-1".to_string()),
        1 => "[a-z ,]{0,6}",
    ]
}

fn check(args: &[&str]) -> Result<(), TestCaseError> {
    let out = common::run_with(args, &[], None);
    let what = common::describe(args, &out);
    match out.status.code() {
        Some(0) => {}
        Some(1) => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let lines: Vec<&str> = stderr.lines().collect();
            prop_assert_eq!(lines.len(), 1, "{}", what);
            prop_assert!(lines[0].starts_with("error: "), "{}", what);
        }
        _ => prop_assert!(false, "neither 0 nor 1: {}", what),
    }
    Ok(())
}

fn fixture() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-mixtral")
        .to_str()
        .unwrap()
        .to_string()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn bench_moe_token_counts(tokens in proptest::collection::vec(size_text(), 1..3)) {
        let tokens = tokens.join(",");
        check(&[
            "bench", "moe", "--device", "cpu", "--shape", "deepseek-small",
            "--method", "unquantized", "--kernel", "portable", "--min-time", "0",
            "--no-reference", "--tokens", &tokens,
        ])?;
    }

    #[test]
    fn bench_model_sizes(
        batch in size_text(),
        prompt in size_text(),
        steps in size_text(),
        layers in proptest::option::of(size_text()),
    ) {
        let model = fixture();
        let mut args = vec![
            "bench", "model", "--model", &model, "--batch", &batch, "--prompt-len", &prompt,
            "--decode-steps", &steps,
        ];
        if let Some(l) = &layers {
            args.extend(["--num-layers", l]);
        }
        check(&args)?;
    }
}
