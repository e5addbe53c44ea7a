//! The `zerolayer` command-line binary: every subcommand of the project in one place.
//!
//! # Layout
//! - `main.rs`: argument parsing (clap, every flag also read from `ZEROLAYER_*`) and dispatch.
//! - one module per subcommand; each exposes `Args` (clap) and `run(args)`.

pub mod bench;
pub mod bench_gpu;
pub mod bench_model;
pub mod chat;
pub mod converse;
pub mod demo;
pub mod generate;
pub mod health;
pub mod keygen;
pub mod serve;

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
    /// Run a multi-turn conversation in-process through context handles (KV reuse).
    Converse(converse::Args),
    /// Run a serving process (collapsed, engine, front or orchestrator).
    Serve(Box<serve::Args>),
    /// Check a server's gRPC health (exit 0 when SERVING).
    Health(health::Args),
    /// Start split and collapsed on a built-in model and run a conversation through each.
    Demo(demo::Args),
    /// Hold a multi-turn conversation with a running server (any mode).
    Chat(chat::Args),
    /// Benchmarks: `bench model`, `bench run` (one endpoint), `bench compare` (modes side by side).
    Bench(bench::Args),
}

/// Initialises `tracing` logging to stderr; `RUST_LOG` overrides `default_filter`.
pub fn init_logging(default_filter: &str) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // A second initialisation (tests calling into the library) is harmless: ignore it.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Runs one parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Keygen(args) => keygen::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Converse(args) => converse::run(args),
        Command::Serve(args) => serve::run(*args),
        Command::Health(args) => health::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Bench(args) => bench::run(args),
    }
}
