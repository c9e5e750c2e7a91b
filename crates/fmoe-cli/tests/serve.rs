//! `fmoe serve` on loopback: greedy text equal to `fmoe generate`'s, streaming (deltas, final
//! chunk, usage, `[DONE]`), echo + logprobs, chat through the template, the API key, 413, 429,
//! a hang-up mid-stream freeing its blocks, SIGTERM finishing what is in flight.

#[path = "server_common/mod.rs"]
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{Server, Stream, chat_template, fixture, slow_model};
use serde_json::Value;

fn generate(model: &str, ids: &str, max_tokens: usize) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_fmoe"))
        .args(["generate", "--model", model, "--prompt-ids", ids, "--json"])
        .args(["--max-tokens", &max_tokens.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

#[test]
fn greedy_text_matches_generate_whole_and_streamed() {
    for name in ["tiny-mixtral", "tiny-deepseek-v3"] {
        let dir = fixture(name);
        let server = Server::start(&dir, &[]);
        let g = generate(dir.to_str().unwrap(), "1,17,42,99,7", 24);
        let want = g["text"].as_str().unwrap();
        let body = r#"{"model":"tiny","prompt":[1,17,42,99,7],"max_tokens":24,"temperature":0}"#;
        let r = server.post("/v1/completions", body);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], want, "{name}");
        assert_eq!(
            v["choices"][0]["finish_reason"],
            if g["finish_reason"] == "length" {
                "length"
            } else {
                "stop"
            }
        );
        assert_eq!(v["usage"]["prompt_tokens"], 5);
        assert_eq!(
            v["usage"]["completion_tokens"],
            g["token_ids"].as_array().unwrap().len()
        );

        let body = r#"{"prompt":[1,17,42,99,7],"max_tokens":24,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}"#;
        let r = server.post("/v1/completions", body);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("text/event-stream"));
        let events = r.events();
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let usage = chunks.last().unwrap();
        assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
        assert_eq!(usage["usage"]["prompt_tokens"], 5);
        let body = &chunks[..chunks.len() - 1];
        assert!(body.len() > 1, "one chunk per step: {events:?}");
        let text: String = body
            .iter()
            .map(|c| c["choices"][0]["text"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(text, want, "{name}: streamed");
        let finishes: Vec<&Value> = body
            .iter()
            .map(|c| &c["choices"][0]["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finishes.len(), 1, "one final chunk: {events:?}");
        assert!(body.last().unwrap()["choices"][0]["finish_reason"].is_string());
        server.assert_idle();
    }
}

#[test]
fn echo_logprobs_and_chat() {
    let template = chat_template();
    let server = Server::start(
        &fixture("tiny-mixtral"),
        &["--chat-template", template.to_str().unwrap()],
    );
    // Echo with max_tokens 0: only the prompt, its first token's logprob null.
    let r = server.post(
        "/v1/completions",
        r#"{"prompt":[1,17,42,99],"max_tokens":0,"echo":true,"logprobs":2}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    let tl = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(tl.len(), 4);
    assert!(tl[0].is_null() && lp["top_logprobs"][0].is_null());
    for (i, t) in tl.iter().enumerate().skip(1) {
        let t = t.as_f64().unwrap();
        assert!((-9999.0..=0.0).contains(&t));
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(top.len() >= 2 && top.len() <= 3, "{top:?}");
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(best >= t);
    }
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["text_offset"][0], 0);
    // Echo with generation: the prompt's entries then the generated ones.
    let r = server.post(
        "/v1/completions",
        r#"{"prompt":[1,17,42,99],"max_tokens":3,"echo":true,"logprobs":1,"temperature":0,"ignore_eos":true}"#,
    );
    let v = r.json();
    assert_eq!(
        v["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        7
    );
    assert_eq!(v["usage"]["completion_tokens"], 3);

    // Chat: the template's prompt, generated greedily, equals a completion of the same ids.
    let msgs =
        r#"[{"role":"system","content":"  be brief  "},{"role":"user","content":"Hello there"}]"#;
    let t = server
        .post("/tokenize", &format!(r#"{{"messages":{msgs}}}"#))
        .json();
    let ids = t["tokens"].clone();
    assert!(t["count"].as_u64().unwrap() > 3);
    assert_eq!(ids[0], 1, "the template writes BOS: {t}");
    let chat = server.post(
        "/v1/chat/completions",
        &format!(r#"{{"model":"tiny","messages":{msgs},"max_tokens":12,"temperature":0,"logprobs":true,"top_logprobs":2}}"#),
    );
    assert_eq!(chat.status, 200, "{}", chat.text());
    let chat = chat.json();
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    let content = &chat["choices"][0]["logprobs"]["content"];
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    let plain = server
        .post(
            "/v1/completions",
            &format!(r#"{{"prompt":{ids},"max_tokens":12,"temperature":0}}"#),
        )
        .json();
    assert_eq!(
        chat["choices"][0]["message"]["content"],
        plain["choices"][0]["text"]
    );
    assert_eq!(chat["usage"]["prompt_tokens"], t["count"]);
    // Streamed chat: a role delta first, the same text, [DONE].
    let r = server.post(
        "/v1/chat/completions",
        &format!(r#"{{"messages":{msgs},"max_tokens":12,"temperature":0,"stream":true}}"#),
    );
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, plain["choices"][0]["text"].as_str().unwrap());

    // The other endpoints.
    let m = server.get("/v1/models").json();
    assert_eq!(m["data"][0]["id"], "tiny");
    assert_eq!(m["data"][0]["max_model_len"], 256);
    let d = server.post("/detokenize", r#"{"tokens":[458,299]}"#).json();
    assert!(d["prompt"].is_string());
    let info = server.get("/tokenizer_info").json();
    assert_eq!(info["eos_token"], "</s>");
    assert_eq!(info["bos_token"], "<s>");
    assert!(info["chat_template"].as_str().unwrap().contains("[INST]"));
    assert!(server.get("/version").json()["version"].is_string());
    let metrics = server.get("/metrics").text();
    for name in [
        "fmoe:num_requests_running",
        "fmoe:num_requests_waiting",
        "fmoe:kv_cache_usage_perc",
        "fmoe:prefix_cache_queries",
        "fmoe:prefix_cache_hits",
        "fmoe:num_preemptions",
        "fmoe:prompt_tokens_total",
        "fmoe:generation_tokens_total",
        "fmoe:request_success_total{finished_reason=\"length\"}",
        "fmoe:time_to_first_token_seconds_bucket",
        "fmoe:inter_token_latency_seconds_bucket",
        "fmoe:e2e_request_latency_seconds_bucket",
        "fmoe:request_queue_time_seconds_bucket",
        "fmoe:model_info{",
    ] {
        assert!(metrics.contains(name), "no {name} in\n{metrics}");
    }
    assert!(metrics.contains("moe_kernel=\"portable\""), "{metrics}");
}

#[test]
fn a_model_without_a_template_gets_400_for_chat() {
    let server = Server::start(&fixture("tiny-mixtral"), &[]);
    let r = server.post(
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
    );
    r.assert_error(400, "chat without a template");
    assert!(r.text().contains("--chat-template"), "{}", r.text());
}

#[test]
fn api_key_and_request_size() {
    let server = Server::start_env(
        &fixture("tiny-mixtral"),
        &["--max-request-bytes", "2000"],
        &[("FMOE_API_KEY", "sesame")],
    );
    let body = br#"{"prompt":[1,2],"max_tokens":1}"#;
    let plain = server.request("POST", "/v1/completions", &[], body);
    plain.assert_error(401, "no key");
    let wrong = server.request(
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer open")],
        body,
    );
    wrong.assert_error(401, "wrong key");
    let ok = server.request(
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer sesame")],
        body,
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(server.get("/health").status, 200, "health needs no key");
    let big = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(3000));
    server
        .request(
            "POST",
            "/v1/completions",
            &[("Authorization", "Bearer sesame")],
            big.as_bytes(),
        )
        .assert_error(413, "over --max-request-bytes");
}

#[test]
fn hang_up_mid_stream_frees_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let model = slow_model(dir.path());
    let server = Server::start(&model, &["--load-format", "dummy"]);
    assert_eq!(
        server.health_seen.first(),
        Some(&503),
        "503 while loading: {:?}",
        server.health_seen
    );
    let body = r#"{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20],"max_tokens":200,"ignore_eos":true,"stream":true}"#;
    let mut st = Stream::open(&server, "/v1/completions", body);
    assert_eq!(st.status, 200);
    for _ in 0..3 {
        assert!(st.next_event().is_some());
    }
    let m = server.metrics();
    assert_eq!(m["fmoe:num_requests_running"], 1.0, "{m:?}");
    assert!(m["fmoe:kv_blocks_used"] >= 2.0, "{m:?}");
    let before = m["fmoe:generation_tokens_total"];
    st.close();
    let t0 = Instant::now();
    server.assert_idle();
    let m = server.metrics();
    assert!(
        m["fmoe:generation_tokens_total"] < 100.0,
        "aborted, not run to the end ({before} tokens at the hang-up): {m:?}"
    );
    assert_eq!(
        m["fmoe:request_success_total{finished_reason=\"abort\"}"],
        1.0
    );
    eprintln!("blocks freed {:?} after the hang-up", t0.elapsed());
}

#[test]
fn a_full_queue_gets_429_and_sigterm_finishes_what_runs() {
    let dir = tempfile::tempdir().unwrap();
    let model = slow_model(dir.path());
    let mut server = Server::start(
        &model,
        &[
            "--load-format",
            "dummy",
            "--max-num-seqs",
            "1",
            "--max-queued-requests",
            "1",
        ],
    );
    let long = r#"{"prompt":[1,2,3],"max_tokens":240,"ignore_eos":true,"stream":true}"#;
    let mut a = Stream::open(&server, "/v1/completions", long);
    assert_eq!(a.status, 200);
    assert!(a.next_event().is_some(), "a runs");
    // b waits in the queue (a holds the only sequence slot); c finds the queue full.
    let b = Stream::open(&server, "/v1/completions", long);
    assert_eq!(b.status, 200);
    let m = server.metrics();
    assert_eq!(m["fmoe:num_requests_waiting"], 1.0, "{m:?}");
    server
        .post("/v1/completions", r#"{"prompt":[1,2],"max_tokens":1}"#)
        .assert_error(429, "queue full");
    b.close();
    // SIGTERM while a streams: a runs to its end, then the server exits 0.
    let short_wait = Instant::now();
    let pid = server.child.id();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap()
    });
    let mut events = Vec::new();
    while let Some(e) = a.next_event() {
        events.push(e);
    }
    let streamed_for = short_wait.elapsed();
    assert!(killer.join().unwrap().success());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(
        last["choices"][0]["finish_reason"], "length",
        "a finished: {last}"
    );
    assert!(
        streamed_for > Duration::from_millis(300),
        "a was still streaming when SIGTERM came ({streamed_for:?})"
    );
    assert_eq!(server.terminate_wait(), Some(0), "{}", server.log_text());
    assert!(
        server.log_text().contains("stopping"),
        "{}",
        server.log_text()
    );
}
