//! `fmoe serve` against a corpus of malformed and hostile requests (bad JSON, wrong types,
//! huge numbers, invalid UTF-8, a 10 MB prompt, 1000 stop strings, n = 10⁶, ids beyond the
//! vocabulary, half-sent bodies, slow clients, hang-ups mid-stream): each gets its status and
//! an OpenAI error body, the server serves on, and afterwards nothing is running, waiting or
//! holding KV blocks.

#[path = "server_common/mod.rs"]
mod common;

use std::io::Write;
use std::net::Shutdown;
use std::time::Duration;

use common::{Server, Stream, chat_template, fixture};

enum Case {
    /// POST this body to this path; expect this status (and an error body unless 200).
    Post(&'static str, String, u16),
    /// Send these raw bytes; expect this status with an error body.
    Raw(Vec<u8>, u16),
}

fn post(path: &'static str, body: impl Into<String>, status: u16) -> Case {
    Case::Post(path, body.into(), status)
}

fn c(body: impl Into<String>, status: u16) -> Case {
    post("/v1/completions", body, status)
}

fn chat(body: impl Into<String>, status: u16) -> Case {
    post("/v1/chat/completions", body, status)
}

fn raw_post(path: &str, body: &[u8]) -> Vec<u8> {
    let mut v = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    v.extend_from_slice(body);
    v
}

fn corpus() -> Vec<(&'static str, Case)> {
    let ids = |n: usize| {
        let v: Vec<String> = (0..n).map(|i| (3 + i % 500).to_string()).collect();
        v.join(",")
    };
    let stops: Vec<String> = (0..1000).map(|i| format!("\"s{i}\"")).collect();
    let prompts: Vec<String> = (0..300).map(|_| "\"a\"".to_string()).collect();
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let ten_mb = format!(
        "{{\"prompt\":\"{}\",\"max_tokens\":1}}",
        "a".repeat(10 << 20)
    );
    let msg = r#"[{"role":"user","content":"hi"}]"#;
    vec![
        ("bad JSON", c("{", 400)),
        ("JSON array", c("[]", 400)),
        ("JSON string", c("\"prompt\"", 400)),
        ("empty body", c("", 400)),
        ("whitespace body", c("   \n", 400)),
        ("trailing garbage", c(r#"{"prompt":"a"} xyz"#, 400)),
        ("duplicate field", c(r#"{"prompt":"a","prompt":"b"}"#, 400)),
        (
            "nesting 10000 deep",
            c(format!(r#"{{"prompt":{deep}}}"#), 400),
        ),
        (
            "invalid UTF-8",
            Case::Raw(
                raw_post("/v1/completions", b"{\"prompt\":\"\xff\xfe\"}"),
                400,
            ),
        ),
        ("no prompt", c("{}", 400)),
        ("prompt a number", c(r#"{"prompt":5}"#, 400)),
        ("prompt an object", c(r#"{"prompt":{"a":1}}"#, 400)),
        ("prompt empty string", c(r#"{"prompt":""}"#, 400)),
        ("prompt empty list", c(r#"{"prompt":[]}"#, 400)),
        ("prompt list of empty list", c(r#"{"prompt":[[]]}"#, 400)),
        (
            "prompt list with empty string",
            c(r#"{"prompt":["a",""]}"#, 400),
        ),
        ("prompt id beyond vocab", c(r#"{"prompt":[1,999999]}"#, 400)),
        ("prompt id = vocab", c(r#"{"prompt":[512]}"#, 400)),
        ("prompt id negative", c(r#"{"prompt":[-1]}"#, 400)),
        ("prompt id fractional", c(r#"{"prompt":[1.5]}"#, 400)),
        ("prompt id beyond u32", c(r#"{"prompt":[4294967296]}"#, 400)),
        ("prompt mixed types", c(r#"{"prompt":["a",1]}"#, 400)),
        (
            "prompt lists, one beyond vocab",
            c(r#"{"prompt":[[1,2],[70000]]}"#, 400),
        ),
        (
            "300 prompts",
            c(format!(r#"{{"prompt":[{}]}}"#, prompts.join(",")), 400),
        ),
        (
            "prompt beyond the context",
            c(format!(r#"{{"prompt":[{}]}}"#, ids(300)), 400),
        ),
        (
            "prompt + max_tokens beyond the context",
            c(
                format!(r#"{{"prompt":[{}],"max_tokens":100}}"#, ids(200)),
                400,
            ),
        ),
        ("10 MB prompt", c(ten_mb, 413)),
        (
            "max_tokens negative",
            c(r#"{"prompt":"a","max_tokens":-1}"#, 400),
        ),
        (
            "max_tokens a string",
            c(r#"{"prompt":"a","max_tokens":"5"}"#, 400),
        ),
        (
            "max_tokens 1e30",
            c(r#"{"prompt":"a","max_tokens":1e30}"#, 400),
        ),
        (
            "max_tokens 10^18",
            c(r#"{"prompt":"a","max_tokens":1000000000000000000}"#, 400),
        ),
        (
            "max_tokens beyond i64",
            c(
                r#"{"prompt":"a","max_tokens":99999999999999999999999}"#,
                400,
            ),
        ),
        (
            "max_tokens 0 without echo",
            c(r#"{"prompt":"a","max_tokens":0}"#, 400),
        ),
        (
            "temperature negative",
            c(r#"{"prompt":"a","temperature":-1}"#, 400),
        ),
        (
            "temperature a string",
            c(r#"{"prompt":"a","temperature":"hot"}"#, 400),
        ),
        (
            "temperature out of f64 range",
            c(r#"{"prompt":"a","temperature":1e999}"#, 400),
        ),
        (
            "temperature 1e300",
            c(r#"{"prompt":"a","temperature":1e300}"#, 400),
        ),
        ("top_p 0", c(r#"{"prompt":"a","top_p":0}"#, 400)),
        ("top_p 1.5", c(r#"{"prompt":"a","top_p":1.5}"#, 400)),
        ("top_k -5", c(r#"{"prompt":"a","top_k":-5}"#, 400)),
        ("top_k fractional", c(r#"{"prompt":"a","top_k":1.5}"#, 400)),
        ("n 0", c(r#"{"prompt":"a","n":0}"#, 400)),
        ("n 10^6", c(r#"{"prompt":"a","n":1000000}"#, 400)),
        ("n negative", c(r#"{"prompt":"a","n":-1}"#, 400)),
        ("logprobs 21", c(r#"{"prompt":"a","logprobs":21}"#, 400)),
        ("logprobs -1", c(r#"{"prompt":"a","logprobs":-1}"#, 400)),
        ("logprobs true", c(r#"{"prompt":"a","logprobs":true}"#, 400)),
        (
            "1000 stop strings",
            c(
                format!(r#"{{"prompt":"a","stop":[{}]}}"#, stops.join(",")),
                400,
            ),
        ),
        ("stop a number", c(r#"{"prompt":"a","stop":5}"#, 400)),
        (
            "stop of 2000 bytes",
            c(
                format!(r#"{{"prompt":"a","stop":"{}"}}"#, "x".repeat(2000)),
                400,
            ),
        ),
        (
            "stop_token_ids beyond vocab",
            c(r#"{"prompt":"a","stop_token_ids":[99999]}"#, 400),
        ),
        (
            "stop_token_ids strings",
            c(r#"{"prompt":"a","stop_token_ids":["a"]}"#, 400),
        ),
        ("seed a string", c(r#"{"prompt":"a","seed":"x"}"#, 400)),
        ("seed fractional", c(r#"{"prompt":"a","seed":1.5}"#, 400)),
        ("echo a string", c(r#"{"prompt":"a","echo":"yes"}"#, 400)),
        (
            "stream a string",
            c(r#"{"prompt":"a","stream":"yes"}"#, 400),
        ),
        (
            "stream_options a number",
            c(r#"{"prompt":"a","stream_options":5}"#, 400),
        ),
        (
            "ignore_eos a string",
            c(r#"{"prompt":"a","ignore_eos":"no"}"#, 400),
        ),
        ("unknown model", c(r#"{"model":"gpt-5","prompt":"a"}"#, 400)),
        ("model a number", c(r#"{"model":5,"prompt":"a"}"#, 400)),
        (
            "unknown fields ignored",
            c(
                r#"{"prompt":"a","max_tokens":1,"frobnicate":{"x":[1]}}"#,
                200,
            ),
        ),
        (
            "control characters in the prompt",
            c(r#"{"prompt":"\u0000\u001f\uffff","max_tokens":2}"#, 200),
        ),
        (
            "echo with max_tokens 0",
            c(
                r#"{"prompt":[1,5,9],"max_tokens":0,"echo":true,"logprobs":3}"#,
                200,
            ),
        ),
        ("chat: messages null", chat(r#"{"messages":null}"#, 400)),
        (
            "GET on completions",
            Case::Raw(
                b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
                405,
            ),
        ),
        (
            "unknown path",
            post("/v1/embeddings", r#"{"input":"a"}"#, 404),
        ),
        ("chat: no messages", chat(r#"{"max_tokens":1}"#, 400)),
        ("chat: messages empty", chat(r#"{"messages":[]}"#, 400)),
        ("chat: messages a string", chat(r#"{"messages":"hi"}"#, 400)),
        (
            "chat: message without role",
            chat(r#"{"messages":[{"content":"hi"}]}"#, 400),
        ),
        (
            "chat: content a number",
            chat(r#"{"messages":[{"role":"user","content":5}]}"#, 400),
        ),
        (
            "chat: image part",
            chat(
                r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
                400,
            ),
        ),
        (
            "chat: role the template rejects",
            chat(r#"{"messages":[{"role":"wizard","content":"hi"}]}"#, 400),
        ),
        (
            "chat: top_logprobs without logprobs",
            chat(format!(r#"{{"messages":{msg},"top_logprobs":2}}"#), 400),
        ),
        (
            "chat: top_logprobs 50",
            chat(
                format!(r#"{{"messages":{msg},"logprobs":true,"top_logprobs":50}}"#),
                400,
            ),
        ),
        (
            "chat: max_completion_tokens negative",
            chat(
                format!(r#"{{"messages":{msg},"max_completion_tokens":-5}}"#),
                400,
            ),
        ),
        (
            "chat: max_tokens beyond the context",
            chat(format!(r#"{{"messages":{msg},"max_tokens":100000}}"#), 400),
        ),
        (
            "chat: unknown model",
            chat(format!(r#"{{"model":"x","messages":{msg}}}"#), 400),
        ),
        (
            "chat: n 10^6",
            chat(format!(r#"{{"messages":{msg},"n":1000000}}"#), 400),
        ),
        (
            "tokenize: nothing to tokenize",
            post("/tokenize", "{}", 400),
        ),
        (
            "tokenize: prompt a number",
            post("/tokenize", r#"{"prompt":5}"#, 400),
        ),
        (
            "detokenize: id beyond vocab",
            post("/detokenize", r#"{"tokens":[1,100000]}"#, 400),
        ),
        (
            "detokenize: strings",
            post("/detokenize", r#"{"tokens":["a"]}"#, 400),
        ),
    ]
}

#[test]
fn hostile_corpus_is_answered_and_leaves_nothing_behind() {
    let template = chat_template();
    let server = Server::start(
        &fixture("tiny-mixtral"),
        &["--chat-template", template.to_str().unwrap()],
    );
    let cases = corpus();
    let mut count = 0;
    for (name, case) in cases {
        let r = match &case {
            Case::Post(path, body, _) => server.post(path, body),
            Case::Raw(bytes, _) => server.raw(bytes),
        };
        let status = match case {
            Case::Post(_, _, s) | Case::Raw(_, s) => s,
        };
        if status == 200 {
            assert_eq!(r.status, 200, "{name}: {}", r.text());
            assert!(
                r.json()["choices"][0]["text"].is_string(),
                "{name}: {}",
                r.text()
            );
        } else {
            r.assert_error(status, name);
        }
        count += 1;
    }

    // Half-sent body: the client promises 100 bytes, sends 10 and closes its side.
    let mut s = server.connect();
    common::send_head(&mut s, "POST", "/v1/completions", &[], Some(100));
    s.write_all(br#"{"prompt":"#).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    common::read_response(&mut s).assert_error(400, "half-sent body");
    count += 1;

    // A slow client: the body in pieces with pauses is still served.
    let body = br#"{"prompt":[1,2,3],"max_tokens":2,"temperature":0}"#;
    let mut s = server.connect();
    common::send_head(&mut s, "POST", "/v1/completions", &[], Some(body.len()));
    for piece in body.chunks(8) {
        s.write_all(piece).unwrap();
        s.flush().unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = common::read_response(&mut s);
    assert_eq!(r.status, 200, "slow client: {}", r.text());
    count += 1;

    // A slow client's headers do not stop others being served meanwhile.
    let mut slow = server.connect();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let r = server.post("/v1/completions", r#"{"prompt":[1,2],"max_tokens":1}"#);
    assert_eq!(
        r.status,
        200,
        "while a client sends its headers slowly: {}",
        r.text()
    );
    drop(slow);
    count += 1;

    // Hang-ups mid-stream, with n > 1 and several prompts.
    for body in [
        r#"{"prompt":[1,2,3],"max_tokens":200,"ignore_eos":true,"stream":true}"#,
        r#"{"prompt":[[1,2],[3,4]],"n":3,"max_tokens":200,"ignore_eos":true,"stream":true}"#,
    ] {
        let mut st = Stream::open(&server, "/v1/completions", body);
        assert_eq!(st.status, 200);
        assert!(st.next_event().is_some(), "no first event");
        st.close();
        count += 1;
    }
    // A client that sends a whole request and hangs up before the answer.
    let mut s = server.connect();
    let body = br#"{"prompt":[1,2,3],"max_tokens":200,"ignore_eos":true}"#;
    common::send_head(&mut s, "POST", "/v1/completions", &[], Some(body.len()));
    s.write_all(body).unwrap();
    drop(s);
    count += 1;

    assert!(count >= 60, "the corpus has {count} cases");
    // Still serving, and nothing left behind.
    let r = server.post(
        "/v1/completions",
        r#"{"prompt":[1,2,3],"max_tokens":3,"temperature":0}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    server.assert_idle();
}
