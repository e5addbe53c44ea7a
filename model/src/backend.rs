//! The backend trait the engine drives (CPU here; CUDA later) and its batch types.

use crate::config::ModelConfig;
use crate::error::BackendError;
use crate::sampling::{SampleInput, SampleOutcome, Sampler, SamplingError};

/// Paged KV geometry; the backend allocates the whole pool up front.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Token positions per block.
    pub block_size: usize,
    /// Blocks in the pool (block ids are `0..num_blocks`).
    pub num_blocks: usize,
}

impl KvCacheConfig {
    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size.max(1))
    }

    /// Checks the pool shape a backend is built with: positive sizes, block ids within `u32`.
    pub fn validate(&self) -> Result<(), BackendError> {
        let reason = if self.block_size == 0 || self.num_blocks == 0 {
            format!(
                "block_size {} and num_blocks {} must be positive",
                self.block_size, self.num_blocks
            )
        } else if self.num_blocks > u32::MAX as usize {
            format!(
                "num_blocks {} exceeds the u32 block id range",
                self.num_blocks
            )
        } else {
            return Ok(());
        };
        Err(BackendError::InvalidConfig { reason })
    }

    /// Checks that `table` covers positions `0..len` with block ids inside the pool (`chunk`
    /// names the table in the error).
    pub fn check_table(&self, chunk: usize, table: &[u32], len: usize) -> Result<(), BackendError> {
        let needed = self.blocks_for(len);
        let Some(covering) = table.get(..needed) else {
            return Err(BackendError::BlockTableTooShort {
                chunk,
                needed,
                actual: table.len(),
            });
        };
        match covering.iter().find(|&&b| b as usize >= self.num_blocks) {
            Some(&block) => Err(BackendError::BlockOutOfRange {
                chunk,
                block,
                num_blocks: self.num_blocks,
            }),
            None => Ok(()),
        }
    }
}

/// One sequence's part of a forward step.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    /// New tokens, written to KV positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in the KV cache.
    pub start_pos: usize,
    /// Pool blocks covering positions `0..start_pos + tokens.len()` (`block_size` each, in order).
    pub block_table: &'a [u32],
    /// Produce logits for the last token of this chunk.
    pub want_logits: bool,
}

/// A model executor. Results of a chunk never depend on the other chunks of the step (batch
/// invariance: see `zerolayer_kernels::cpu` for how the CPU backend guarantees it bit for bit).
pub trait Backend: Send {
    /// Model hyper-parameters.
    fn config(&self) -> &ModelConfig;

    /// KV pool geometry.
    fn kv_config(&self) -> KvCacheConfig;

    /// Runs one step over a batch of chunks of different sequences (decode tokens and prefill
    /// chunks mixed). Writes the logits of the last token of each chunk with `want_logits`, in
    /// batch order, into `logits` (`len` = wanting chunks × vocab). Validates everything (token
    /// ids < vocab, positions < max_seq_len, block ids < num_blocks, table long enough, buffer
    /// sizes) before touching the KV cache and returns [`BackendError`], never panics.
    ///
    /// Two chunks of one step must not write the same KV positions of the same blocks.
    fn forward(&mut self, batch: &[SeqChunk<'_>], logits: &mut [f32]) -> Result<(), BackendError>;

    /// [`Backend::forward`] plus sampling of one token per wanting chunk: `sampling[i]` and
    /// `out[i]` belong to the `i`-th wanting chunk. The default runs `forward` into a temporary
    /// buffer and samples on the CPU with [`Sampler`] (allocating per call); backends override it
    /// to reuse buffers or sample on the device.
    fn forward_sample(
        &mut self,
        batch: &[SeqChunk<'_>],
        sampling: &[SampleInput<'_>],
        out: &mut [SampleOutcome],
    ) -> Result<(), BackendError> {
        let wanting = batch.iter().filter(|c| c.want_logits).count();
        check_sampling_sizes(wanting, sampling.len(), out.len())?;
        let vocab = self.config().vocab_size;
        let mut logits = vec![0.0; wanting * vocab];
        self.forward(batch, &mut logits)?;
        let mut sampler = Sampler::new();
        sample_rows(&mut sampler, &logits, vocab, sampling, out)
    }

    /// Copies the KV contents of positions `0..len` from the blocks of `src` to those of `dst`
    /// (forking a sequence). Optional: the default returns [`BackendError::Unsupported`].
    fn copy_kv(&mut self, src: &[u32], dst: &[u32], len: usize) -> Result<(), BackendError> {
        let _ = (src, dst, len);
        Err(BackendError::Unsupported {
            operation: "copy_kv",
        })
    }
}

/// Checks the sizes of `forward_sample`'s per-chunk slices.
pub(crate) fn check_sampling_sizes(
    wanting: usize,
    sampling: usize,
    out: usize,
) -> Result<(), BackendError> {
    if sampling != wanting {
        return Err(BackendError::BufferSize {
            what: "sampling",
            expected: wanting,
            actual: sampling,
        });
    }
    if out != wanting {
        return Err(BackendError::BufferSize {
            what: "out",
            expected: wanting,
            actual: out,
        });
    }
    Ok(())
}

/// Samples one token per logits row.
pub(crate) fn sample_rows(
    sampler: &mut Sampler,
    logits: &[f32],
    vocab: usize,
    sampling: &[SampleInput<'_>],
    out: &mut [SampleOutcome],
) -> Result<(), BackendError> {
    for ((row, input), o) in logits.chunks_exact(vocab).zip(sampling).zip(out.iter_mut()) {
        *o = sampler.sample(row, input).map_err(|e| match e {
            SamplingError::BannedOutOfRange { token, vocab_size } => {
                BackendError::BannedOutOfRange { token, vocab_size }
            }
            // Parameters are validated at construction; only the banned list is checked here.
            other => BackendError::InvalidConfig {
                reason: other.to_string(),
            },
        })?;
    }
    Ok(())
}
