//! `zerolayer converse`: a multi-turn conversation run in-process through the engine and its
//! context handles. Each `--turn` appends a user message to the transcript (which holds the
//! previous replies as returned), sends the whole transcript with the last handle, and prints
//! the reply with its prompt tokens, cached tokens and time to first token. With `--no-reuse`
//! the engine runs as the layered baseline (no handles, every turn prefilled from scratch).
//!
//! Output: per turn a header line `[turn N] prompt_tokens=… cached_tokens=… ttft_ms=…` then the
//! text; with `--json`, one JSON object per turn and line with the keys `turn` (from 1), `text`,
//! `prompt_tokens`, `cached_tokens` and `ttft_ms`. Logs go to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use zerolayer_engine::api::{
    Caller, Event, GenerateRequest, Message, Role, SamplingOptions, Truncation,
};
use zerolayer_engine::config::DEFAULT_KV_BLOCKS;
use zerolayer_engine::{Engine, EngineConfig, SafetyConfig};
use zerolayer_handle::KeyRing;
use zerolayer_model::load_model;

/// The tenant the conversation runs as (in-process: no authentication).
const TENANT: &str = "converse";

/// Arguments of `zerolayer converse`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model: a llama2.c checkpoint path or `dummy:NAME[@SEED]` (tiny, small, 1b, 8b).
    #[arg(long, env = "ZEROLAYER_MODEL")]
    pub model: String,
    /// llama2.c tokenizer file (default: tokenizer.bin, else tok<vocab>.bin beside the model).
    #[arg(long, env = "ZEROLAYER_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// A user turn, in order; repeat the flag for every turn.
    #[arg(
        long = "turn",
        env = "ZEROLAYER_TURN",
        required = true,
        allow_hyphen_values = true
    )]
    pub turns: Vec<String>,
    /// Tokens to generate per turn at most (default: the engine's default, clamped to the
    /// context window).
    #[arg(long, env = "ZEROLAYER_MAX_TOKENS")]
    pub max_tokens: Option<u32>,
    /// Run without KV reuse (the layered baseline: no handles, full prefill every turn).
    #[arg(long, env = "ZEROLAYER_NO_REUSE")]
    pub no_reuse: bool,
    /// One JSON object per turn and line instead of text.
    #[arg(long, env = "ZEROLAYER_JSON")]
    pub json: bool,
    /// Worker threads (default: available cores).
    #[arg(long, env = "ZEROLAYER_THREADS")]
    pub threads: Option<usize>,
    /// KV pool size in blocks of 16 positions.
    #[arg(long, env = "ZEROLAYER_KV_BLOCKS", default_value_t = DEFAULT_KV_BLOCKS)]
    pub kv_blocks: usize,
}

/// What one turn produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The reply's text.
    pub text: String,
    /// Prompt tokens of the turn (the whole transcript).
    pub prompt_tokens: u32,
    /// Prompt tokens served from the KV cache.
    pub cached_tokens: u32,
    /// Time to first token inside the engine, milliseconds.
    pub ttft_ms: f64,
}

/// Runs `zerolayer converse`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let threads = match args.threads {
        Some(0) => anyhow::bail!("--threads must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    if args.max_tokens == Some(0) {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    let model = load_model(&args.model, args.tokenizer.as_deref())
        .with_context(|| format!("loading {}", args.model))?;
    let config = EngineConfig {
        reuse: !args.no_reuse,
        threads,
        kv_blocks: args.kv_blocks,
        ..EngineConfig::default()
    };
    let keys = Arc::new(KeyRing::ephemeral().context("generating an ephemeral handle key")?);
    let engine = Engine::start_cpu(&model, keys, SafetyConfig::none(), config)
        .context("starting the engine")?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let result = converse(&engine, &args.turns, args.max_tokens, |i, turn| {
        if args.json {
            let line = serde_json::json!({
                "turn": i + 1,
                "text": turn.text,
                "prompt_tokens": turn.prompt_tokens,
                "cached_tokens": turn.cached_tokens,
                "ttft_ms": turn.ttft_ms,
            });
            writeln!(out, "{line}")?;
        } else {
            writeln!(
                out,
                "[turn {}] prompt_tokens={} cached_tokens={} ttft_ms={:.3}",
                i + 1,
                turn.prompt_tokens,
                turn.cached_tokens,
                turn.ttft_ms
            )?;
            writeln!(out, "{}", turn.text)?;
        }
        out.flush()?;
        Ok(())
    });
    engine.shutdown();
    engine.join();
    result
}

/// Runs the conversation on `engine`, calling `on_turn` after each turn.
pub fn converse(
    engine: &Engine,
    turns: &[String],
    max_tokens: Option<u32>,
    mut on_turn: impl FnMut(usize, &Turn) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let caller = Caller::new(TENANT);
    let mut transcript: Vec<Message> = Vec::with_capacity(turns.len() * 2);
    let mut handle: Option<Vec<u8>> = None;
    for (i, text) in turns.iter().enumerate() {
        transcript.push(Message::new(Role::User, text.clone()));
        let req = GenerateRequest {
            messages: transcript.clone(),
            handle: handle.take(),
            delta: false,
            sampling: SamplingOptions {
                max_tokens,
                seed: Some(0),
                ..SamplingOptions::default()
            },
            truncation: Truncation::Reject,
            request_id: format!("converse-{}", i + 1),
        };
        let mut stream = engine.generate(&caller, req);
        let mut reply = String::new();
        let turn = loop {
            match stream.blocking_next() {
                Some(Ok(Event::Tokens { text, .. })) => reply.push_str(&text),
                Some(Ok(Event::Finished(info))) => {
                    handle = info.handle;
                    break Turn {
                        text: std::mem::take(&mut reply),
                        prompt_tokens: info.usage.prompt_tokens,
                        cached_tokens: info.usage.cached_prompt_tokens,
                        ttft_ms: info.timings.ttft_ns as f64 / 1e6,
                    };
                }
                Some(Err(e)) => return Err(e).with_context(|| format!("turn {}", i + 1)),
                None => anyhow::bail!(
                    "turn {}: the engine closed the stream without a final event",
                    i + 1
                ),
            }
        };
        transcript.push(Message::new(Role::Assistant, turn.text.clone()));
        on_turn(i, &turn)?;
    }
    Ok(())
}
