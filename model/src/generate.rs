//! A single-sequence generation loop over any [`Backend`] (the CLI and tests use it; the engine
//! has its own scheduler).

use std::time::{Duration, Instant};

use crate::backend::{Backend, SeqChunk};
use crate::error::BackendError;
use crate::sampling::{SampleInput, SampleOutcome, SamplingParams, sample_uniform};
use crate::tokenizer::{BOS_ID, EOS_ID, Tokenizer};

/// Prompt tokens per prefill step: bounds the step's scratch memory (≈ 100 KiB per token for a
/// 1B model) while keeping the matmuls large enough to run at full speed.
pub const PREFILL_CHUNK_TOKENS: usize = 512;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Generated tokens at most (the prompt does not count); must be ≥ 1.
    pub max_tokens: usize,
    /// Sampling parameters (the seed drives [`sample_uniform`] with the generated-token index).
    pub sampling: SamplingParams,
    /// Generation stops when the generated text contains one of these; the token completing it
    /// is not passed to the callback (earlier tokens already were).
    pub stop_sequences: Vec<String>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` generated.
    Length,
    /// The model produced BOS (llama2.c's stop) or EOS.
    Stop,
    /// A stop sequence appeared.
    StopSequence,
    /// Every token was masked.
    NothingAllowed,
}

/// Result of [`generate`].
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOutcome {
    /// Generated token ids passed to the callback, in order.
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub finish: FinishReason,
    /// Wall time of the prompt's forward passes.
    pub prefill_time: Duration,
    /// Wall time of the decode steps.
    pub decode_time: Duration,
}

/// Generation refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// No prompt tokens (the model needs at least BOS).
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` is 0.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// Prompt plus `max_tokens` exceed the model's context.
    #[error(
        "prompt ({prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of {context} tokens"
    )]
    ContextExceeded {
        /// Prompt tokens.
        prompt: usize,
        /// Requested generated tokens.
        max_tokens: usize,
        /// The model's context.
        context: usize,
    },
    /// The backend's KV pool is too small for this sequence.
    #[error("the KV pool holds {available} blocks, this generation needs {needed}")]
    KvTooSmall {
        /// Blocks needed.
        needed: usize,
        /// Blocks in the pool.
        available: usize,
    },
    /// The backend rejected a step.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Checks a generation request against the model's context.
pub fn check_request(
    prompt_len: usize,
    max_tokens: usize,
    context: usize,
) -> Result<(), GenerateError> {
    if prompt_len == 0 {
        return Err(GenerateError::EmptyPrompt);
    }
    if max_tokens == 0 {
        return Err(GenerateError::ZeroMaxTokens);
    }
    if prompt_len.saturating_add(max_tokens) > context {
        return Err(GenerateError::ContextExceeded {
            prompt: prompt_len,
            max_tokens,
            context,
        });
    }
    Ok(())
}

/// Generates a continuation of `prompt_tokens` (which normally start with BOS) on `backend`,
/// using blocks `0..n` of its pool as one contiguous block table. `on_token(id, bytes)` receives
/// each generated token and its decoded bytes ([`Tokenizer::decode_piece`] after the previous
/// token). Stops at BOS or EOS (not passed on), a stop sequence, or `max_tokens`.
pub fn generate(
    backend: &mut dyn Backend,
    tokenizer: &Tokenizer,
    prompt_tokens: &[u32],
    options: &GenerateOptions,
    on_token: &mut dyn FnMut(u32, &[u8]),
) -> Result<GenerateOutcome, GenerateError> {
    let config = backend.config().clone();
    check_request(prompt_tokens.len(), options.max_tokens, config.max_seq_len)?;
    let kv = backend.kv_config();
    // The last generated token is never fed back, so the KV needs prompt + max_tokens - 1.
    let needed = kv.blocks_for(prompt_tokens.len() + options.max_tokens - 1);
    if needed > kv.num_blocks {
        return Err(GenerateError::KvTooSmall {
            needed,
            available: kv.num_blocks,
        });
    }
    let table: Vec<u32> = (0..needed as u32).collect();
    let vocab = config.vocab_size;
    let mut logits = vec![0.0f32; vocab];
    let start = Instant::now();
    let mut pos = 0;
    for chunk in prompt_tokens.chunks(PREFILL_CHUNK_TOKENS) {
        let last = pos + chunk.len() == prompt_tokens.len();
        let end = pos + chunk.len();
        let step = SeqChunk {
            tokens: chunk,
            start_pos: pos,
            block_table: &table[..kv.blocks_for(end)],
            want_logits: last,
        };
        let out = if last { &mut logits[..] } else { &mut [][..] };
        backend.forward(&[step], out)?;
        pos = end;
    }
    let prefill_time = start.elapsed();
    let decode_start = Instant::now();
    let mut tokens = Vec::new();
    let mut text: Vec<u8> = Vec::new();
    let max_stop = options
        .stop_sequences
        .iter()
        .map(|s| s.len())
        .max()
        .unwrap_or(0);
    let mut sampler = crate::sampling::Sampler::new();
    // Invariant: the prompt is non-empty (checked above).
    let mut prev = *prompt_tokens.last().expect("non-empty prompt");
    let mut finish = FinishReason::Length;
    for step in 0..options.max_tokens {
        let input = SampleInput {
            params: &options.sampling,
            uniform: sample_uniform(options.sampling.seed(), step as u64),
            banned: &[],
        };
        let next = match sampler.sample(&logits, &input) {
            Ok(SampleOutcome::Token(t)) => t,
            Ok(SampleOutcome::NothingAllowed) => {
                finish = FinishReason::NothingAllowed;
                break;
            }
            Err(e) => {
                return Err(BackendError::InvalidConfig {
                    reason: e.to_string(),
                }
                .into());
            }
        };
        if next == BOS_ID || next == EOS_ID {
            finish = FinishReason::Stop;
            break;
        }
        let piece = tokenizer.decode_piece(prev, next);
        if max_stop > 0 {
            let keep_from = text.len().saturating_sub(max_stop);
            text.drain(..keep_from);
            text.extend_from_slice(piece);
            if options
                .stop_sequences
                .iter()
                .any(|s| !s.is_empty() && contains(&text, s.as_bytes()))
            {
                finish = FinishReason::StopSequence;
                break;
            }
        }
        on_token(next, piece);
        tokens.push(next);
        prev = next;
        if step + 1 == options.max_tokens {
            break;
        }
        let end = pos + 1;
        let chunk = SeqChunk {
            tokens: &[next],
            start_pos: pos,
            block_table: &table[..kv.blocks_for(end)],
            want_logits: true,
        };
        backend.forward(&[chunk], &mut logits)?;
        pos = end;
    }
    Ok(GenerateOutcome {
        tokens,
        finish,
        prefill_time,
        decode_time: decode_start.elapsed(),
    })
}

/// Whether `needle` occurs in `haystack`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
