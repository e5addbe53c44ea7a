//! Entry point of the `zerolayer` binary; see the library crate for the subcommands.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    zerolayer_cli::init_logging("info");
    zerolayer_cli::run(zerolayer_cli::Cli::parse())
}
