//! `zerolayer chat --endpoint URL --turn TEXT …`: a multi-turn conversation with a running
//! server (any mode) through the client library: it keeps the context handle between turns
//! and prints per turn what was reused. Scripts (the compose test) use `--json`.

use std::{path::PathBuf, time::Duration};

use anyhow::Context as _;
use zerolayer_client::{Client, ClientConfig, RetryPolicy};
use zerolayer_proto::v1;

/// Arguments of `zerolayer chat`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Server URL.
    #[arg(
        long,
        env = "ZEROLAYER_ENDPOINT",
        default_value = "http://127.0.0.1:50051"
    )]
    pub endpoint: String,
    /// API key (`authorization: Bearer …`).
    #[arg(long, env = "ZEROLAYER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// User turns, in order.
    #[arg(long = "turn", required = true)]
    pub turns: Vec<String>,
    /// Tokens to generate per turn.
    #[arg(long, env = "ZEROLAYER_MAX_TOKENS", default_value_t = 32)]
    pub max_tokens: u32,
    /// Send only new messages (delta mode).
    #[arg(long)]
    pub delta: bool,
    /// Stream shaping: text bytes per chunk at most (0 = unlimited).
    #[arg(long, default_value_t = 0)]
    pub max_buffer_size: u32,
    /// Stream shaping: minimum milliseconds between chunks.
    #[arg(long, default_value_t = 0)]
    pub min_delay_ms: u32,
    /// Attempts for UNAVAILABLE before giving up (1 = no retry).
    #[arg(long, default_value_t = 5)]
    pub attempts: u32,
    /// One JSON object per turn on stdout.
    #[arg(long)]
    pub json: bool,
    /// Write the conversation's final handle (hex) to this file.
    #[arg(long)]
    pub handle_out: Option<PathBuf>,
}

/// Runs `zerolayer chat`. Exits non-zero with the error reason (e.g. `ENGINE_UNAVAILABLE`)
/// on the first failed turn.
pub fn run(args: Args) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut config = ClientConfig::new(args.endpoint.clone()).retry(RetryPolicy {
            max_attempts: args.attempts.max(1),
            ..RetryPolicy::default()
        });
        config.api_key = args.api_key.clone();
        let client = Client::new(config)?;
        let mut conversation = client
            .conversation()
            .delta(args.delta)
            .sampling(v1::SamplingParams {
                max_tokens: Some(args.max_tokens),
                ..Default::default()
            })
            .stream_options(v1::StreamOptions {
                max_buffer_size: args.max_buffer_size,
                min_delay_ms: args.min_delay_ms,
                network_rtt_ms: 0,
            });
        for (i, turn) in args.turns.iter().enumerate() {
            let result = conversation.turn(turn.clone()).await.map_err(|e| {
                anyhow::anyhow!(
                    "{}: turn {} failed: {}",
                    e.reason.short_name(),
                    i + 1,
                    e.message
                )
            })?;
            let usage = result.usage();
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "turn": i + 1,
                        "text": result.text,
                        "prompt_tokens": usage.prompt_tokens,
                        "cached_tokens": usage.cached_prompt_tokens,
                        "prefilled_tokens": usage.prefilled_prompt_tokens,
                        "generated_tokens": usage.generated_tokens,
                        "reuse": result.reuse().as_str_name(),
                        "ttft_ms": ms(result.ttft.unwrap_or_default()),
                        "e2e_ms": ms(result.e2e),
                        "resent_full": result.resent_full,
                    })
                );
            } else {
                println!(
                    "turn {}: prompt {} cached {} generated {} ttft {:.1} ms total {:.1} ms\n  {}",
                    i + 1,
                    usage.prompt_tokens,
                    usage.cached_prompt_tokens,
                    usage.generated_tokens,
                    ms(result.ttft.unwrap_or_default()),
                    ms(result.e2e),
                    result.text
                );
            }
        }
        if let Some(path) = &args.handle_out {
            std::fs::write(path, hex_encode(conversation.handle()))
                .with_context(|| format!("writing {}", path.display()))?;
        }
        anyhow::Ok(())
    })
}

fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
