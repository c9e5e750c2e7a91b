//! What the bad-input tests and the size fuzzing share: running `fmoe` under a 1 GiB
//! address-space cap with a deadline.

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The address-space cap of every run, KiB.
pub const LIMIT_KIB: u64 = 1 << 20;
/// The longest a run may take.
pub const DEADLINE: Duration = Duration::from_secs(120);

/// `fmoe args…` under the memory cap, with `stdout` as its standard output (None: captured),
/// killed after [`DEADLINE`].
pub fn run_with(args: &[&str], env: &[(&str, &str)], stdout: Option<Stdio>) -> Output {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!("ulimit -v {LIMIT_KIB} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_fmoe"))
        .args(args);
    for var in [
        "FMOE_USE_FUSED",
        "FMOE_USE_FUSED_MOE",
        "FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE",
        "RUST_LOG",
        "RUST_BACKTRACE",
    ]
    .into_iter()
    .chain(fmoe_core::env::ALL)
    {
        cmd.env_remove(var);
    }
    // Few malloc arenas: their reserved address space must not count against the cap.
    cmd.env("MALLOC_ARENA_MAX", "2");
    cmd.envs(env.iter().copied());
    let captured = stdout.is_none();
    cmd.stdin(Stdio::null())
        .stdout(stdout.unwrap_or_else(Stdio::piped))
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run fmoe {args:?}: {e}"));
    let mut out_pipe = child.stdout.take();
    let mut err_pipe = child.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(p) = out_pipe.as_mut() {
            let _ = p.read_to_end(&mut v);
        }
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("fmoe {args:?} did not finish in {DEADLINE:?} (a hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = out_reader.join().unwrap();
    assert!(captured || stdout.is_empty());
    Output {
        status,
        stdout,
        stderr: err_reader.join().unwrap(),
    }
}

pub fn describe(args: &[&str], out: &Output) -> String {
    format!(
        "fmoe {args:?}: {}\n--- stdout ---\n{}--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
