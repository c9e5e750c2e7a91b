use std::io::Write;

use anyhow::{Context, Result};
use fmoe_core::Device;
use fmoe_core::env::FusedSwitches;
use fmoe_kernels::catalog;
use fmoe_moe::{QuantScheme, dispatch};
use serde::Serialize;

#[derive(clap::Args)]
pub struct Args {
    /// MoE method: unquantized, fp8-tensor or fp8-block.
    #[arg(long, required_unless_present = "catalog_json")]
    method: Option<QuantScheme>,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Also print why (on a second line).
    #[arg(long)]
    explain: bool,
    /// Instead: print every CUDA kernel program fmoe can build (the kernel catalog), one JSON
    /// object a line: {"family", "source" (file under crates/fmoe-kernels/cuda/), "entries",
    /// "defines" ([name, value] pairs in -D order)}. No GPU needed.
    #[arg(long, conflicts_with_all = ["method", "device", "explain"])]
    catalog_json: bool,
}

pub fn run(args: Args) -> Result<()> {
    if args.catalog_json {
        return print_catalog();
    }
    let method = args.method.context("--method is required")?;
    let switches = FusedSwitches::from_env()?;
    let device = super::require_device(args.device)?;
    let choice = dispatch::resolve(&switches, method, device)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{} on {}: {}", method, device, choice.family).map_err(super::stdout_error)?;
    if args.explain {
        writeln!(out, "reason: {}", choice.reason).map_err(super::stdout_error)?;
    }
    out.flush().map_err(super::stdout_error)
}

/// One line of `--catalog-json`: an NVRTC program and the entries loaded from it.
#[derive(Serialize)]
struct Program<'a> {
    family: &'a str,
    source: &'a str,
    entries: &'a [&'a str],
    defines: Vec<(&'a str, &'a str)>,
}

fn print_catalog() -> Result<()> {
    let mut out = String::new();
    for (k, entries) in catalog::programs(&catalog::all()) {
        let source = k
            .source_file()
            .with_context(|| format!("{}: source not in catalog::SOURCES", k.name()))?;
        let line = Program {
            family: k.family,
            source,
            entries: &entries,
            defines: k.defines.iter().map(|(n, v)| (*n, v.as_str())).collect(),
        };
        out.push_str(&serde_json::to_string(&line)?);
        out.push('\n');
    }
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(super::stdout_error)
}
