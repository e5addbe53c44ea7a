//! `zerolayer generate`: local text generation with llama2.c-compatible output.
//!
//! stdout gets exactly what llama2.c's `run.c` prints: the prompt (decoded from its tokens, BOS
//! and the dummy-prefix space dropped) followed by the continuation, each piece printed unless it
//! is a single unprintable byte (`safe_printf`), then a newline. Logs and statistics go to stderr.
//! Generation stops after `--max-tokens` generated tokens or when the model produces BOS (as
//! `run.c` does) or EOS.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use zerolayer_model::generate::check_request;
use zerolayer_model::tokenizer::is_printable_piece;
use zerolayer_model::{
    CpuBackend, GenerateError, GenerateOptions, KvCacheConfig, SamplingParams, generate, load_model,
};

/// KV block size of the single sequence (any value works; 16 matches the engine's default).
const KV_BLOCK_SIZE: usize = 16;

/// Arguments of `zerolayer generate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model: a llama2.c checkpoint path or `dummy:NAME[@SEED]` (tiny, small, 1b, 8b).
    #[arg(long, env = "ZEROLAYER_MODEL")]
    pub model: String,
    /// llama2.c tokenizer file (default: tokenizer.bin, else tok<vocab>.bin beside the model).
    #[arg(long, env = "ZEROLAYER_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Prompt text (must not be empty).
    #[arg(long, env = "ZEROLAYER_PROMPT", allow_hyphen_values = true)]
    pub prompt: String,
    /// Tokens to generate (the prompt does not count); prompt + max tokens must fit the context.
    #[arg(long, env = "ZEROLAYER_MAX_TOKENS")]
    pub max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(
        long,
        env = "ZEROLAYER_TEMPERATURE",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = no limit).
    #[arg(long, env = "ZEROLAYER_TOP_K", default_value_t = 0)]
    pub top_k: u32,
    /// Nucleus sampling mass in (0, 1] (1 = no limit).
    #[arg(
        long,
        env = "ZEROLAYER_TOP_P",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub top_p: f32,
    /// Seed of the sampler's random draws (same seed, same output).
    #[arg(long, env = "ZEROLAYER_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Worker threads (default: available cores).
    #[arg(long, env = "ZEROLAYER_THREADS")]
    pub threads: Option<usize>,
}

/// Writes one piece the way `safe_printf` does, flushing so output streams.
fn print_piece(out: &mut impl Write, piece: &[u8]) -> std::io::Result<()> {
    if !piece.is_empty() && is_printable_piece(piece) {
        out.write_all(piece)?;
        out.flush()?;
    }
    Ok(())
}

/// Runs `zerolayer generate`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let sampling = SamplingParams::new(args.temperature, args.top_k, args.top_p, args.seed)?;
    if args.prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt.into());
    }
    if args.max_tokens == 0 {
        return Err(GenerateError::ZeroMaxTokens.into());
    }
    let threads = match args.threads {
        Some(0) => anyhow::bail!("--threads must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let model = load_model(&args.model, args.tokenizer.as_deref())
        .with_context(|| format!("loading {}", args.model))?;
    let config = model.weights.config().clone();
    let tok = &model.tokenizer;
    let prompt = tok.encode(&args.prompt, true, false);
    check_request(prompt.len(), args.max_tokens, config.max_seq_len)?;
    let kv = KvCacheConfig {
        block_size: KV_BLOCK_SIZE,
        num_blocks: (prompt.len() + args.max_tokens).div_ceil(KV_BLOCK_SIZE),
    };
    let mut backend = CpuBackend::new(model.weights.clone(), kv, threads)?;
    tracing::info!(
        model = %model.name,
        params = config.n_params(),
        threads,
        isa = backend.kernels().isa().name(),
        prompt_tokens = prompt.len(),
        "generating"
    );
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for pair in prompt.windows(2) {
        print_piece(&mut out, tok.decode_piece(pair[0], pair[1]))?;
    }
    let options = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling,
        stop_sequences: Vec::new(),
    };
    let mut write_error = None;
    let outcome = generate(&mut backend, tok, &prompt, &options, &mut |_, piece| {
        if write_error.is_none() {
            write_error = print_piece(&mut out, piece).err();
        }
    })?;
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    out.write_all(b"\n")?;
    out.flush()?;
    let generated = outcome.tokens.len();
    let decode_s = outcome.decode_time.as_secs_f64();
    tracing::info!(
        generated,
        finish = ?outcome.finish,
        prefill_ms = outcome.prefill_time.as_secs_f64() * 1e3,
        decode_tok_per_s = if decode_s > 0.0 { generated.saturating_sub(1) as f64 / decode_s } else { 0.0 },
        "done"
    );
    Ok(())
}
