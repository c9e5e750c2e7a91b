//! `fmoe`: a thin front over the fmoe crates. Parses flags, installs logging, maps errors to a
//! one-line message and a non-zero exit code.

mod cmd;

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
}

fn main() -> ExitCode {
    // Warnings (an unwritable kernel cache, an ignored dev knob) show without RUST_LOG; RUST_LOG
    // (e.g. `info` for the layers' kernel choice) replaces that default.
    let filter = tracing_subscriber::EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
        .from_env_lossy();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Kernels(args) => cmd::kernels::run(args),
        Command::Bench(b) => cmd::bench::run(b),
        Command::Generate(args) => cmd::generate::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
