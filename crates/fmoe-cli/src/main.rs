//! `fmoe`: a thin front over the fmoe crates. Parses flags, installs logging, maps errors to a
//! one-line message and a non-zero exit code.

mod cmd;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// fmoe: fused Mixture-of-Experts kernels and inference (Mixtral, DeepSeek-V3) on CPU and NVIDIA Hopper.
///
/// Kernel selection follows three switches, read at start-up:
/// FMOE_USE_FUSED (parent, default 0), FMOE_USE_FUSED_MOE (default 1, only under the parent),
/// FMOE_USE_FUSED_FP8_BLOCK_SCALED_MOE (default 0, even under the parent). Values: 0, 1, true, false.
/// Logging: RUST_LOG (e.g. RUST_LOG=info).
#[derive(Parser)]
#[command(name = "fmoe", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the MoE kernel family (fused or portable) a method gets under the current environment,
    /// or (--catalog-json) every CUDA kernel program fmoe can build.
    Kernels(cmd::kernels::Args),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(cmd::bench::Bench),
    /// Generate text with a model directory (Mixtral): prints the text and tokens/s.
    Generate(cmd::generate::Args),
    /// An OpenAI-compatible HTTP server over the engine (/v1/completions, /v1/chat/completions,
    /// /metrics, ...), after `vllm serve`.
    Serve(cmd::serve::Args),
}

fn main() -> ExitCode {
    catch_stdout_panics();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_exit(e),
    };
    // Warnings (an unwritable kernel cache, an ignored dev knob) show without RUST_LOG; RUST_LOG
    // (e.g. `info` for the layers' kernel choice) replaces that default. The server also logs
    // its start-up (address, model, KV blocks, MoE kernel) and stop.
    let mut filter = tracing_subscriber::EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
        .from_env_lossy();
    if matches!(cli.command, Command::Serve(_))
        && std::env::var_os("RUST_LOG").is_none()
        && let Ok(d) = "fmoe_server=info".parse()
    {
        filter = filter.add_directive(d);
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = start_up().and_then(|()| match cli.command {
        Command::Kernels(args) => cmd::kernels::run(args),
        Command::Bench(b) => cmd::bench::run(b),
        Command::Generate(args) => cmd::generate::run(args),
        Command::Serve(args) => cmd::serve::run(args),
    });
    // What print! left in stdout's buffer: a failure here is a failed write too.
    let result = result.and_then(|()| std::io::stdout().flush().map_err(cmd::stdout_error));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A closed stdout (`fmoe … | head -1`): the reader has what it wanted.
        Err(e) if cmd::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, whatever the error's text holds.
            let msg = format!("{e:#}");
            eprintln!("error: {}", one_line(&msg));
            ExitCode::FAILURE
        }
    }
}

/// Checks every start-up switch before any command runs: a bad value stops fmoe whatever the
/// command and device (the README's promise). The `FMOE_DEV_*` overrides only change CUDA
/// launches, but a typo in one (or an experiment-only one in a build without `dev-knobs`, or two
/// that contradict) is reported on the CPU too.
fn start_up() -> anyhow::Result<()> {
    fmoe_core::env::dev_overrides()?;
    Ok(())
}

/// `text` with its lines joined by `; ` (blank ones dropped).
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// clap's verdict: help and version go to stdout (exit 0; a closed pipe is fine), a usage error
/// becomes one `error:` line on stderr and exit 1, as every other bad input.
fn clap_exit(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let mut out = std::io::stdout().lock();
        let written = write!(out, "{}", e.render()).and_then(|()| out.flush());
        return match written {
            Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => {
                eprintln!("error: writing to stdout: {err}");
                ExitCode::FAILURE
            }
            _ => ExitCode::SUCCESS,
        };
    }
    let text = e.render().to_string();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information")
        })
        .collect();
    let joined = lines.join(" ");
    let msg = joined.strip_prefix("error:").unwrap_or(&joined).trim();
    eprintln!("error: {msg}");
    ExitCode::FAILURE
}

/// `print!` panics when stdout cannot be written ("failed printing to stdout: …"): a closed pipe
/// or a full disk. fmoe's own output goes through fallible writes ([`cmd::stdout_error`]); this
/// hook turns any `print!` that is left into the same outcome (exit 0 on a closed pipe, one
/// `error:` line and exit 1 otherwise) instead of a panic. Every other panic reaches the default
/// hook.
fn catch_stdout_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied());
        if let Some(err) = msg.and_then(|m| m.strip_prefix("failed printing to stdout: ")) {
            if os_error_kind(err) == Some(std::io::ErrorKind::BrokenPipe) {
                std::process::exit(0);
            }
            eprintln!("error: writing to stdout: {err}");
            std::process::exit(1);
        }
        default(info);
    }));
}

/// The kind of an `io::Error` from its text ("… (os error 32)").
fn os_error_kind(text: &str) -> Option<std::io::ErrorKind> {
    let code = text.rsplit_once("(os error ")?.1.strip_suffix(')')?;
    Some(std::io::Error::from_raw_os_error(code.parse().ok()?).kind())
}
