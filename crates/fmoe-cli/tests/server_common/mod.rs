//! The `fmoe serve` tests' harness: the real binary on a free loopback port (`--port 0`, the
//! port read from its `listening on` log line), and a plain HTTP/1.1 client over `TcpStream`,
//! so that tests can send anything a hostile client would (half bodies, bad bytes, hang-ups).
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

pub fn chat_template() -> PathBuf {
    fixture("chat-template.jinja")
}

/// A running `fmoe serve`; killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: String,
    pub log: Arc<Mutex<Vec<String>>>,
    /// `/health` statuses seen while waiting for it to be ready.
    pub health_seen: Vec<u16>,
}

impl Server {
    /// `fmoe serve --model DIR --port 0 ARGS`, once `/health` answers 200.
    pub fn start(model: &Path, args: &[&str]) -> Server {
        Server::start_env(model, args, &[])
    }

    pub fn start_env(model: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_fmoe"));
        for var in [
            "FMOE_USE_FUSED",
            "FMOE_USE_FUSED_MOE",
            "FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE",
            "RUST_LOG",
            "FMOE_API_KEY",
        ] {
            cmd.env_remove(var);
        }
        cmd.envs(env.iter().copied());
        cmd.arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0", "--served-model-name", "tiny"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawning fmoe serve");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(i) = line.find("listening on http://") {
                    let _ = tx.send(line[i + 20..].trim().to_string());
                }
                sink.lock().unwrap().push(line);
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("fmoe serve did not start: {:?}", log.lock().unwrap());
            }
        };
        let mut s = Server {
            child,
            addr,
            log,
            health_seen: Vec::new(),
        };
        let t0 = Instant::now();
        loop {
            if let Ok(r) = s.try_get("/health") {
                s.health_seen.push(r.status);
                if r.status == 200 {
                    break;
                }
            }
            if let Ok(Some(st)) = s.child.try_wait() {
                panic!("fmoe serve exited ({st}): {:?}", s.log.lock().unwrap());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "not ready in 120 s: {:?}",
                s.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(&self.addr).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        s
    }

    /// Sends `raw` as it is and reads the whole answer (the request should say
    /// `Connection: close`).
    pub fn raw(&self, raw: &[u8]) -> Response {
        let mut s = self.connect();
        let _ = s.write_all(raw);
        read_response(&mut s)
    }

    /// Sends the body from another thread while the answer is read, as a browser would: a
    /// server may answer (413) before it has read the body, and stop reading it.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Response {
        let mut s = self.connect();
        send_head(&mut s, method, path, headers, Some(body.len()));
        let mut w = s.try_clone().unwrap();
        let body = body.to_vec();
        let writer = std::thread::spawn(move || {
            let _ = w.write_all(&body);
        });
        let r = read_response(&mut s);
        let _ = writer.join();
        r
    }

    pub fn post(&self, path: &str, body: &str) -> Response {
        self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        )
    }

    pub fn get(&self, path: &str) -> Response {
        self.request("GET", path, &[], b"")
    }

    pub fn try_get(&self, path: &str) -> std::io::Result<Response> {
        let mut s = TcpStream::connect(&self.addr)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )?;
        Ok(read_response(&mut s))
    }

    /// The `fmoe:` metrics, name (with labels) to value.
    pub fn metrics(&self) -> HashMap<String, f64> {
        let r = self.get("/metrics");
        assert_eq!(r.status, 200);
        r.text()
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect()
    }

    /// Waits (up to 10 s) for the server to have nothing running, waiting or holding blocks.
    pub fn assert_idle(&self) {
        let t0 = Instant::now();
        loop {
            let m = self.metrics();
            let v = |k: &str| *m.get(k).unwrap_or_else(|| panic!("no metric {k}"));
            let idle = v("fmoe:num_requests_running") == 0.0
                && v("fmoe:num_requests_waiting") == 0.0
                && v("fmoe:kv_blocks_used") == 0.0
                && v("fmoe:kv_cache_usage_perc") == 0.0;
            if idle {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "still busy after 10 s: {m:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM; waits for the exit and returns its status code.
    pub fn terminate(&mut self) -> Option<i32> {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(ok.success());
        self.terminate_wait()
    }

    /// Waits (up to 60 s) for the exit and returns its status code.
    pub fn terminate_wait(&mut self) -> Option<i32> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no exit 60 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn send_head(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    len: Option<usize>,
) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(n) = len {
        head.push_str(&format!("Content-Length: {n}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("sending the head");
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The SSE events' data, in order.
    pub fn events(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: ").map(str::to_string))
            .collect()
    }

    /// Asserts an OpenAI error body with this status.
    pub fn assert_error(&self, status: u16, what: &str) {
        assert_eq!(self.status, status, "{what}: {}", self.text());
        let v = self.json();
        let e = &v["error"];
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: no message in {v}"
        );
        assert!(e["type"].as_str().is_some(), "{what}: no type in {v}");
        assert!(e.get("param").is_some(), "{what}: no param in {v}");
        assert_eq!(e["code"].as_u64(), Some(status as u64), "{what}: {v}");
    }
}

/// Reads a status line, headers and the body (Content-Length, chunked, or to the end).
pub fn read_response(s: &mut TcpStream) -> Response {
    let mut r = BufReader::new(s.try_clone().expect("cloning the stream"));
    let (status, headers) = read_head(&mut r);
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let len = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok());
    let mut body = Vec::new();
    if chunked {
        while let Some(c) = read_chunk(&mut r) {
            body.extend_from_slice(&c);
        }
    } else if let Some(n) = len {
        body.resize(n, 0);
        r.read_exact(&mut body).expect("reading the body");
    } else {
        let _ = r.read_to_end(&mut body);
    }
    let _ = s.shutdown(Shutdown::Both);
    Response {
        status,
        headers,
        body,
    }
}

pub fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).expect("reading the status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).expect("reading a header");
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    (status, headers)
}

/// One chunk of a chunked body (`None` at the last one).
pub fn read_chunk(r: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut size = String::new();
    if r.read_line(&mut size).ok()? == 0 {
        return None;
    }
    let n = usize::from_str_radix(size.trim(), 16).ok()?;
    let mut data = vec![0; n + 2];
    r.read_exact(&mut data).ok()?;
    data.truncate(n);
    if n == 0 { None } else { Some(data) }
}

/// A streaming request whose events are read one by one.
pub struct Stream {
    pub reader: BufReader<TcpStream>,
    pub stream: TcpStream,
    pub status: u16,
    pending: String,
}

impl Stream {
    pub fn open(server: &Server, path: &str, body: &str) -> Stream {
        let mut s = server.connect();
        send_head(
            &mut s,
            "POST",
            path,
            &[("Content-Type", "application/json")],
            Some(body.len()),
        );
        s.write_all(body.as_bytes()).unwrap();
        let mut reader = BufReader::new(s.try_clone().unwrap());
        let (status, _) = read_head(&mut reader);
        Stream {
            reader,
            stream: s,
            status,
            pending: String::new(),
        }
    }

    /// The next event's data (`None` at the end of the body).
    pub fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.pending.find("\n\n") {
                let ev: String = self.pending.drain(..i + 2).collect();
                if let Some(d) = ev.trim_end().strip_prefix("data: ") {
                    return Some(d.to_string());
                }
                continue;
            }
            let c = read_chunk(&mut self.reader)?;
            self.pending.push_str(&String::from_utf8_lossy(&c));
        }
    }

    /// Hangs up.
    pub fn close(self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// A copy of the tiny Mixtral with a config large enough that a step takes milliseconds (dummy
/// weights): requests that are still running when a test looks at them.
pub fn slow_model(dir: &Path) -> PathBuf {
    let src = fixture("tiny-mixtral");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["hidden_size"] = 512.into();
    cfg["intermediate_size"] = 1024.into();
    cfg["num_hidden_layers"] = 6.into();
    cfg["num_attention_heads"] = 8.into();
    cfg["num_key_value_heads"] = 4.into();
    cfg["head_dim"] = 64.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir.to_path_buf()
}
