//! `zerolayer generate`: local text generation. (Filled in by the model work.)

/// Arguments of `zerolayer generate`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `zerolayer generate`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("generate is not implemented yet")
}
