use anyhow::Result;
use fmoe_core::Device;
use fmoe_core::env::FusedSwitches;
use fmoe_moe::{QuantScheme, dispatch};

#[derive(clap::Args)]
pub struct Args {
    /// MoE method: unquantized, fp8-tensor or fp8-block.
    #[arg(long)]
    method: QuantScheme,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Also print why (on a second line).
    #[arg(long)]
    explain: bool,
}

pub fn run(args: Args) -> Result<()> {
    let switches = FusedSwitches::from_env()?;
    let device = super::require_device(args.device)?;
    let choice = dispatch::resolve(&switches, args.method, device)?;
    println!("{} on {}: {}", args.method, device, choice.family);
    if args.explain {
        println!("reason: {}", choice.reason);
    }
    Ok(())
}
