//! `zerolayer keygen`: writes a signing key for context handles. (Filled in by the handle work.)

/// Arguments of `zerolayer keygen`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `zerolayer keygen`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("keygen is not implemented yet")
}
