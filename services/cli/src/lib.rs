//! The `zerolayer` command-line binary: every subcommand of the project in one place.
//!
//! # Layout
//! - `main.rs`: argument parsing (clap, every flag also read from `ZEROLAYER_*`) and dispatch.
//! - one module per subcommand; each exposes `Args` (clap) and `run(args)`.

pub mod keygen;
pub mod generate;

use clap::{Parser, Subcommand};

/// zerolayer: an LLM serving stack without an orchestrator tier.
#[derive(Debug, Parser)]
#[command(name = "zerolayer", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands of the `zerolayer` binary.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate an Ed25519 signing key for context handles (and its public key).
    Keygen(keygen::Args),
    /// Generate text from a prompt with a local model (llama2.c-compatible output).
    Generate(generate::Args),
}

/// Initialises `tracing` logging to stderr; `RUST_LOG` overrides `default_filter`.
pub fn init_logging(default_filter: &str) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // A second initialisation (tests calling into the library) is harmless: ignore it.
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// Runs one parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Keygen(args) => keygen::run(args),
        Command::Generate(args) => generate::run(args),
    }
}
