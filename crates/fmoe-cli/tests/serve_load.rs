//! Load on `fmoe serve`: `fmoe bench serve` against it (its JSON row), and a bounded soak of 64
//! concurrent streaming clients (`FMOE_SOAK_SECS`, default 60) with 0 failures and the server's
//! resident memory flat.

#[path = "server_common/mod.rs"]
mod common;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Server, Stream, fixture};
use serde_json::Value;

#[test]
fn bench_serve_writes_its_row() {
    let server = Server::start(&fixture("tiny-mixtral"), &[]);
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rows.json");
    for (rate, conc) in [("inf", "8"), ("200", "64")] {
        let out = Command::new(env!("CARGO_BIN_EXE_fmoe"))
            .args([
                "bench",
                "serve",
                "--base-url",
                &format!("http://{}", server.addr),
            ])
            .args(["--endpoint", "/v1/completions", "--dataset-name", "random"])
            .args(["--random-input-len", "24", "--random-output-len", "16"])
            .args(["--random-range-ratio", "0.5", "--num-prompts", "40"])
            .args([
                "--request-rate",
                rate,
                "--max-concurrency",
                conc,
                "--ignore-eos",
            ])
            .arg("--json")
            .arg(&json)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("Successful requests:"), "{stdout}");
        assert!(stdout.contains("P99 ITL (ms):"), "{stdout}");
    }
    let rows: Vec<Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(r["completed"], 40, "{r}");
        assert_eq!(r["failed"], 0, "{r}");
        for k in ["request_throughput", "output_throughput"] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {r}");
        }
        for m in ["ttft", "tpot", "itl", "e2el"] {
            let mean = r[format!("mean_{m}_ms")].as_f64().unwrap();
            let median = r[format!("median_{m}_ms")].as_f64().unwrap();
            let p99 = r[format!("p99_{m}_ms")].as_f64().unwrap();
            assert!(mean > 0.0 && median > 0.0 && p99 >= median, "{m}: {r}");
        }
        // ignore_eos: every request generated its full length (16 · (1 ± 0.5)).
        let out = r["total_output_tokens"].as_u64().unwrap();
        assert!((40 * 8..=40 * 24).contains(&out), "{r}");
    }
    assert!(rows[1]["request_rate"].as_f64() == Some(200.0));
    let m = server.metrics();
    assert_eq!(
        m["fmoe:request_success_total{finished_reason=\"length\"}"], 80.0,
        "{m:?}"
    );
    server.assert_idle();
}

/// The server's resident memory in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

#[test]
fn soak_64_streaming_clients() {
    let secs: u64 = std::env::var("FMOE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let server = Arc::new(Server::start(&fixture("tiny-mixtral"), &[]));
    let pid = server.child.id();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let done = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let clients: Vec<_> = (0..64)
        .map(|c| {
            let server = server.clone();
            let done = done.clone();
            let failures = failures.clone();
            std::thread::spawn(move || {
                let mut i = 0u64;
                while Instant::now() < deadline {
                    i += 1;
                    let len = 8 + (c * 7 + i as usize) % 40;
                    let ids: Vec<String> = (0..len).map(|k| (3 + (c * 31 + k) % 500).to_string()).collect();
                    let body = format!(
                        r#"{{"prompt":[{}],"max_tokens":{},"temperature":0.7,"seed":{i},"stream":true,"stream_options":{{"include_usage":true}}}}"#,
                        ids.join(","),
                        4 + (i % 29)
                    );
                    let mut st = Stream::open(&server, "/v1/completions", &body);
                    if st.status != 200 {
                        failures.lock().unwrap().push(format!("status {}", st.status));
                        continue;
                    }
                    let mut last = None;
                    let mut finish = false;
                    while let Some(e) = st.next_event() {
                        if e.contains("\"finish_reason\":\"") {
                            finish = true;
                        }
                        if e.contains("\"error\"") {
                            failures.lock().unwrap().push(e.clone());
                        }
                        last = Some(e);
                    }
                    if last.as_deref() != Some("[DONE]") || !finish {
                        failures.lock().unwrap().push(format!("ended with {last:?}"));
                        continue;
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Resident memory once warm (a sixth of the way) and then to the end.
    std::thread::sleep(Duration::from_secs(secs / 6));
    let warm = rss_kib(pid);
    let mut peak = warm;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        peak = peak.max(rss_kib(pid));
    }
    for c in clients {
        c.join().unwrap();
    }
    let end = rss_kib(pid);
    let failures = failures.lock().unwrap();
    let n = done.load(Ordering::Relaxed);
    eprintln!(
        "soak: {n} requests in {secs} s, RSS {warm} KiB warm, {peak} KiB peak, {end} KiB at the end"
    );
    assert!(
        failures.is_empty(),
        "{} failures: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(n as u64 >= 64 * secs / 4, "only {n} requests completed");
    assert!(
        peak <= warm + 8 * 1024,
        "resident memory grew: {warm} KiB warm, {peak} KiB peak"
    );
    server.assert_idle();
}
