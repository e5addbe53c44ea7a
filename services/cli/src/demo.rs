//! `zerolayer demo`: the README's main job. Starts split and collapsed deployments of the
//! built-in `dummy:tiny` model (or `--model`) as real processes, runs the same short
//! multi-turn conversation through each over real gRPC, and prints per turn and mode what the
//! engine reused and how long it took.

use std::{path::PathBuf, time::Duration};

use anyhow::Context as _;
use zerolayer_bench::launch::{Launcher, Mode};
use zerolayer_client::{Client, ClientConfig};
use zerolayer_proto::v1;

/// Arguments of `zerolayer demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model: `dummy:NAME[@SEED]` or a llama2.c checkpoint path.
    #[arg(long, env = "ZEROLAYER_MODEL", default_value = "dummy:tiny")]
    pub model: String,
    /// Tokenizer for checkpoints (default: beside the checkpoint).
    #[arg(long, env = "ZEROLAYER_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Tokens generated per turn.
    #[arg(long, default_value_t = 24)]
    pub max_tokens: u32,
    /// Also run the layered baseline (needs `redis-server` on PATH).
    #[arg(long)]
    pub layered: bool,
    /// User turns (default: a three-turn story).
    #[arg(long = "turn")]
    pub turns: Vec<String>,
}

const DEFAULT_TURNS: [&str; 3] = [
    "Once upon a time, there was a little robot who loved to count the stars.",
    "One night, the robot saw a star that was falling down to the garden.",
    "The robot ran outside to find the star and bring it back to the sky.",
];

/// Runs `zerolayer demo`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let bin = std::env::current_exe().context("locating the zerolayer binary")?;
    let work = tempfile::Builder::new()
        .prefix("zerolayer-demo-")
        .tempdir()?;
    let mut launcher = Launcher::new(bin, args.model.clone(), work.path());
    launcher.tokenizer = args.tokenizer.clone();
    launcher.metrics = false;
    let turns: Vec<String> = if args.turns.is_empty() {
        DEFAULT_TURNS.iter().map(|s| (*s).to_owned()).collect()
    } else {
        args.turns.clone()
    };
    let mut modes = vec![Mode::Split, Mode::Collapsed];
    if args.layered {
        modes.push(Mode::Layered);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    println!(
        "zerolayer demo: model {}, {} turns, {} tokens per turn\n",
        args.model,
        turns.len(),
        args.max_tokens
    );
    println!(
        "{:<10} {:>4} {:>7} {:>7} {:>9} {:>9} {:<8} {:>9} {:>9}  reply",
        "mode",
        "turn",
        "prompt",
        "cached",
        "prefilled",
        "generated",
        "reuse",
        "ttft_ms",
        "total_ms"
    );
    for mode in modes {
        eprintln!("starting {mode} …");
        let deployment = launcher
            .start(mode)
            .with_context(|| format!("starting {mode}"))?;
        runtime.block_on(async {
            // The channel spawns its connection task on the current runtime.
            let client = Client::new(ClientConfig::new(deployment.endpoint.clone()))?;
            let mut conversation = client.conversation().sampling(v1::SamplingParams {
                max_tokens: Some(args.max_tokens),
                ..Default::default()
            });
            for (i, turn) in turns.iter().enumerate() {
                let result = conversation
                    .turn(turn.clone())
                    .await
                    .with_context(|| format!("{mode} turn {}", i + 1))?;
                let usage = result.usage();
                let reply: String = result
                    .text
                    .chars()
                    .filter(|c| !c.is_control())
                    .take(48)
                    .collect();
                println!(
                    "{:<10} {:>4} {:>7} {:>7} {:>9} {:>9} {:<8} {:>9.2} {:>9.2}  {reply}",
                    mode.as_str(),
                    i + 1,
                    usage.prompt_tokens,
                    usage.cached_prompt_tokens,
                    usage.prefilled_prompt_tokens,
                    usage.generated_tokens,
                    reuse_label(result.reuse()),
                    ms(result.ttft.unwrap_or_default()),
                    ms(result.e2e),
                );
            }
            anyhow::Ok(())
        })?;
        drop(deployment);
    }
    println!(
        "\ncached = prompt tokens served from the engine's slot (not recomputed); layered never reuses."
    );
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn reuse_label(r: v1::ReuseOutcome) -> &'static str {
    match r {
        v1::ReuseOutcome::New => "new",
        v1::ReuseOutcome::Hit => "hit",
        v1::ReuseOutcome::Miss => "miss",
        v1::ReuseOutcome::Disabled => "disabled",
        v1::ReuseOutcome::Unspecified => "?",
    }
}
