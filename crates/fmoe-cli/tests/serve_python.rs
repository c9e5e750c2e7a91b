//! Real Python clients against `fmoe serve`, unmodified: the `openai` client (completions, chat,
//! streaming) and `lm_eval --model local-completions` on a tiny gsm8k-format generate_until task
//! and a log-likelihood (multiple-choice) task. Their results are checked against the engine's
//! own, run in this process on the same fixture: greedy text equal, summed logprobs within 1e-4.
//!
//! The clients live in `.ci/venv` (made by `.ci/run` from `.ci/python-requirements.txt`). Without
//! it the test says so and passes, except under CI (`CI=true`), where it fails.

#[path = "server_common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use common::{Server, chat_template, fixture};
use fmoe_engine::{Engine, EngineArgs, FinishReason, Request, RequestParams, SamplingParams};
use fmoe_models::{LoadOptions, Tokenizer, load};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The venv's python, if it has the clients.
fn python() -> Option<PathBuf> {
    let venv = std::env::var_os("FMOE_PY_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".ci/venv"));
    let py = venv.join("bin/python");
    let ok = Command::new(&py)
        .args(["-c", "import openai, lm_eval"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    let msg = format!(
        "no Python clients in {} (pip unreachable? .ci/run installs them from .ci/python-requirements.txt)",
        venv.display()
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{msg}");
    }
    eprintln!("skipping: {msg}");
    None
}

/// The engine on the tiny Mixtral, as `fmoe serve` builds it with its default flags.
fn engine(dir: &Path) -> (Engine, Tokenizer) {
    let m = load(dir, &LoadOptions::default()).unwrap();
    let model: Arc<dyn fmoe_models::CausalLm> = Arc::from(m.model);
    let config = EngineArgs::default().resolve(&model).unwrap();
    let tok = Tokenizer::from_dir(dir).unwrap().unwrap();
    (Engine::new(model, m.tokenizer, config).unwrap(), tok)
}

struct Run {
    text: String,
    finish: FinishReason,
    /// Per prompt position (the first `None`).
    prompt_logprobs: Vec<Option<f32>>,
}

fn run(engine: &mut Engine, prompt: Vec<u32>, params: RequestParams) -> Run {
    let id = engine.add_request(Request { prompt, params }).unwrap();
    let mut text = String::new();
    let mut prompt_logprobs = Vec::new();
    loop {
        for o in engine.step().unwrap() {
            if o.id != id {
                continue;
            }
            text.push_str(&o.text_delta);
            if let Some(p) = o.prompt_logprobs {
                prompt_logprobs = p.into_iter().map(|l| l.map(|l| l.logprob)).collect();
            }
            if let Some(f) = o.finish_reason {
                return Run {
                    text,
                    finish: f,
                    prompt_logprobs,
                };
            }
        }
    }
}

fn greedy(max_tokens: usize, stop: Vec<String>) -> RequestParams {
    RequestParams {
        max_tokens,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        stop,
        ..RequestParams::default()
    }
}

#[test]
fn openai_client_and_lm_eval_match_the_engine() {
    let Some(py) = python() else { return };
    let dir = fixture("tiny-mixtral");
    let template = chat_template();
    let server = Server::start(&dir, &["--chat-template", template.to_str().unwrap()]);
    let base = format!("http://{}/v1", server.addr);
    let (mut eng, tok) = engine(&dir);
    let work = tempfile::tempdir().unwrap();

    // The openai client.
    let out = work.path().join("openai.json");
    let st = Command::new(&py)
        .arg(repo().join("tests/python/openai_clients.py"))
        .args([&base, "tiny", "1,17,42,99,7"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(
        st.success(),
        "openai_clients.py failed\n{}",
        server.log_text()
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let want = run(&mut eng, vec![1, 17, 42, 99, 7], greedy(20, vec![]));
    assert_eq!(v["completion"]["text"], want.text.as_str());
    assert_eq!(v["completion_stream"]["text"], want.text.as_str());
    assert!(v["completion_stream"]["chunks"].as_u64().unwrap() > 1);
    assert_eq!(
        v["completion_stream"]["usage"],
        v["completion"]["completion_tokens"]
    );
    let reason = if want.finish == FinishReason::Length {
        "length"
    } else {
        "stop"
    };
    assert_eq!(v["completion"]["finish_reason"], reason);
    let chat_text = "<s>[INST] Hello there [/INST]";
    let chat_ids = tok.encode(chat_text, false).unwrap();
    assert_eq!(v["chat"]["prompt_tokens"], chat_ids.len());
    let want = run(&mut eng, chat_ids, greedy(12, vec![]));
    assert_eq!(v["chat"]["text"], want.text.as_str());
    assert_eq!(v["chat"]["role"], "assistant");
    assert_eq!(v["chat_stream"]["text"], want.text.as_str());
    assert_eq!(v["bad_model"]["status"], 400);
    assert_eq!(v["models"][0], "tiny");

    // lm_eval on a local generate_until task and a log-likelihood task.
    let tasks = work.path().join("tasks");
    std::fs::create_dir(&tasks).unwrap();
    let gsm = tasks.join("gsm.jsonl");
    std::fs::write(
        &gsm,
        concat!(
            r#"{"question": "Tom has 3 apples and buys 2 more. How many apples does he have?", "answer": "3 + 2 = 5\n#### 5"}"#, "\n",
            r#"{"question": "A box holds 4 pens. How many pens are in 3 boxes?", "answer": "3 * 4 = 12\n#### 12"}"#, "\n",
            r#"{"question": "What is 10 minus 7?", "answer": "10 - 7 = 3\n#### 3"}"#, "\n",
        ),
    )
    .unwrap();
    let ll = tasks.join("ll.jsonl");
    std::fs::write(
        &ll,
        concat!(
            r#"{"context": "The sky is", "choices": ["blue", "green"], "label": 0}"#, "\n",
            r#"{"context": "Two plus two is", "choices": ["four", "five", "many things"], "label": 0}"#, "\n",
        ),
    )
    .unwrap();
    std::fs::write(
        tasks.join("tiny_gsm8k.yaml"),
        format!(
            "task: tiny_gsm8k\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\noutput_type: generate_until\ndoc_to_text: \"Question: {{{{question}}}}\\nAnswer:\"\ndoc_to_target: \"{{{{answer.split('#### ')[-1]}}}}\"\ngeneration_kwargs:\n  until: [\"\\n\\n\", \"Question:\"]\n  do_sample: false\n  max_gen_toks: 32\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n",
            gsm.display()
        ),
    )
    .unwrap();
    std::fs::write(
        tasks.join("tiny_ll.yaml"),
        format!(
            "task: tiny_ll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{{{context}}}}\"\ndoc_to_choice: \"{{{{choices}}}}\"\ndoc_to_target: \"{{{{label}}}}\"\nmetric_list:\n  - metric: acc\n",
            ll.display()
        ),
    )
    .unwrap();
    let results = work.path().join("results");
    let lm_eval = py.with_file_name("lm_eval");
    let o = Command::new(&lm_eval)
        .args(["--model", "local-completions", "--model_args"])
        .arg(format!(
            "model=tiny,base_url={base}/completions,tokenizer_backend=remote,num_concurrent=1,max_retries=1"
        ))
        .args(["--tasks", "tiny_gsm8k,tiny_ll", "--include_path"])
        .arg(&tasks)
        .arg("--output_path")
        .arg(&results)
        .arg("--log_samples")
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", work.path().join("hf"))
        .current_dir(work.path())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "lm_eval failed:\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let samples = |task: &str| -> Vec<Value> {
        let dir = std::fs::read_dir(results.join("tiny")).unwrap();
        let f = dir
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(&format!("samples_{task}_"))
            })
            .unwrap_or_else(|| panic!("no samples of {task}"));
        std::fs::read_to_string(f)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };

    // generate_until: lm_eval's prompt is the context without special tokens; its stops are
    // `until` and the EOS string.
    let gen_samples = samples("tiny_gsm8k");
    assert_eq!(gen_samples.len(), 3);
    for s in &gen_samples {
        let args = &s["arguments"]["gen_args_0"];
        let ctx = args["arg_0"].as_str().unwrap();
        let mut stop: Vec<String> = args["arg_1"]["until"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u.as_str().unwrap().to_string())
            .collect();
        stop.push("</s>".into());
        let want = run(&mut eng, tok.encode(ctx, false).unwrap(), greedy(32, stop));
        assert_eq!(s["resps"][0][0], want.text.as_str(), "{ctx}");
    }

    // Log-likelihood: lm_eval sums the continuation's prompt logprobs of context + continuation
    // (the continuation's ids are what the whole text's encoding has past the context's).
    let ll_samples = samples("tiny_ll");
    assert_eq!(ll_samples.len(), 2);
    let mut checked = 0;
    for s in &ll_samples {
        for (k, args) in s["arguments"].as_object().unwrap() {
            let ctx = args["arg_0"].as_str().unwrap();
            let cont = args["arg_1"].as_str().unwrap();
            let whole = tok.encode(&format!("{ctx}{cont}"), false).unwrap();
            let ctx_len = tok.encode(ctx, false).unwrap().len();
            let mut p = RequestParams {
                max_tokens: 0,
                prompt_logprobs: Some(1),
                ..RequestParams::default()
            };
            p.sampling.temperature = 0.0;
            let want = run(&mut eng, whole.clone(), p);
            let sum: f64 = want.prompt_logprobs[ctx_len..]
                .iter()
                .map(|l| l.unwrap() as f64)
                .sum();
            let i: usize = k.strip_prefix("gen_args_").unwrap().parse().unwrap();
            let got: f64 = s["resps"][i][0][0].as_str().unwrap().parse().unwrap();
            assert!(
                (got - sum).abs() < 1e-4,
                "{ctx:?} + {cont:?}: lm_eval {got}, engine {sum}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 5);
    server.assert_idle();
}
