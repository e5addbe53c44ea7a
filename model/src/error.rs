//! Error types of the model crate, one enum per layer.

use std::path::PathBuf;

/// Loading a model or tokenizer failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file ends before the data its header announces.
    #[error("{what} is truncated: needs {needed} bytes, has {actual}")]
    Truncated {
        /// Which file or part.
        what: &'static str,
        /// Bytes the header implies.
        needed: u64,
        /// Bytes present.
        actual: u64,
    },
    /// The file is longer than its header implies (wrong file or wrong format version).
    #[error("{what} has {actual} bytes but its header implies {expected}")]
    SizeMismatch {
        /// Which file.
        what: &'static str,
        /// Bytes the header implies.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },
    /// A header field is out of range or inconsistent.
    #[error("invalid model configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
    /// A weight is NaN or infinite.
    #[error("weight tensor {tensor} has a non-finite value at element {index}")]
    NonFiniteWeight {
        /// Tensor name (`layers.3.wq`, …).
        tensor: String,
        /// Element index inside the tensor.
        index: usize,
    },
    /// A tensor handed to [`crate::Weights::new`] has the wrong number of elements.
    #[error("tensor {tensor} has {actual} elements, expected {expected}")]
    TensorShape {
        /// Tensor name.
        tensor: String,
        /// Elements the configuration implies.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// The tokenizer file is malformed.
    #[error("invalid tokenizer file: {reason}")]
    InvalidTokenizer {
        /// What is wrong.
        reason: String,
    },
    /// `dummy:NAME` with a name that is not configured.
    #[error("unknown dummy model {name:?} (known: tiny, small, 1b, 8b)")]
    UnknownDummy {
        /// The name given.
        name: String,
    },
    /// `dummy:NAME@SEED` with a seed that is not a u64.
    #[error("invalid dummy seed {seed:?}: expected an unsigned 64-bit integer")]
    InvalidSeed {
        /// The text given.
        seed: String,
    },
    /// No tokenizer was given and none was found beside the checkpoint.
    #[error(
        "no tokenizer found for {checkpoint}: pass --tokenizer or put tokenizer.bin or {fallback} beside it"
    )]
    TokenizerNotFound {
        /// The checkpoint path.
        checkpoint: PathBuf,
        /// The `tok<vocab>.bin` name that was tried too.
        fallback: String,
    },
    /// The host cannot allocate the weights (more than its available memory, or the allocator
    /// refused).
    #[error("cannot allocate {bytes} bytes for the weights: not enough host memory")]
    OutOfMemory {
        /// Bytes requested.
        bytes: u64,
    },
}

impl ModelError {
    /// Stable machine-readable reason (metric label).
    pub fn error_type(&self) -> &'static str {
        match self {
            ModelError::Io { .. } => "io",
            ModelError::Truncated { .. } => "truncated",
            ModelError::SizeMismatch { .. } => "size_mismatch",
            ModelError::InvalidConfig { .. } => "invalid_config",
            ModelError::NonFiniteWeight { .. } => "non_finite_weight",
            ModelError::TensorShape { .. } => "tensor_shape",
            ModelError::InvalidTokenizer { .. } => "invalid_tokenizer",
            ModelError::UnknownDummy { .. } => "unknown_dummy",
            ModelError::InvalidSeed { .. } => "invalid_seed",
            ModelError::TokenizerNotFound { .. } => "tokenizer_not_found",
            ModelError::OutOfMemory { .. } => "out_of_memory",
        }
    }
}

/// A forward step was rejected or could not run. Every field of a [`crate::SeqChunk`] is checked
/// before any work starts, so an error leaves the KV cache untouched.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BackendError {
    /// The batch is empty.
    #[error("empty batch")]
    EmptyBatch,
    /// A chunk has no tokens.
    #[error("chunk {chunk} has no tokens")]
    EmptyChunk {
        /// Index of the chunk in the batch.
        chunk: usize,
    },
    /// A token id is not in the vocabulary.
    #[error("chunk {chunk}: token {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange {
        /// Index of the chunk in the batch.
        chunk: usize,
        /// The token id.
        token: u32,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// The chunk's last position is at or past the model's context.
    #[error("chunk {chunk}: positions up to {end} exceed the context of {max_seq_len}")]
    ContextOverflow {
        /// Index of the chunk in the batch.
        chunk: usize,
        /// `start_pos + len`.
        end: usize,
        /// The model's context length.
        max_seq_len: usize,
    },
    /// The block table does not cover the chunk's positions.
    #[error("chunk {chunk}: block table has {actual} blocks, positions need {needed}")]
    BlockTableTooShort {
        /// Index of the chunk in the batch.
        chunk: usize,
        /// Blocks needed.
        needed: usize,
        /// Blocks given.
        actual: usize,
    },
    /// A block id is outside the pool.
    #[error("chunk {chunk}: block {block} is outside the pool of {num_blocks} blocks")]
    BlockOutOfRange {
        /// Index of the chunk in the batch.
        chunk: usize,
        /// The block id.
        block: u32,
        /// Pool size.
        num_blocks: usize,
    },
    /// An output buffer has the wrong size.
    #[error("{what} has length {actual}, expected {expected}")]
    BufferSize {
        /// Which buffer (`logits`, `sampling`, `out`).
        what: &'static str,
        /// Required length.
        expected: usize,
        /// Given length.
        actual: usize,
    },
    /// A banned token id is outside the vocabulary.
    #[error("banned token {token} is outside the vocabulary (size {vocab_size})")]
    BannedOutOfRange {
        /// The token id.
        token: u32,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// The KV geometry or thread count is unusable.
    #[error("invalid backend configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
    /// Memory for the KV pool or scratch buffers could not be allocated.
    #[error("cannot allocate {bytes} bytes for {what}")]
    OutOfMemory {
        /// What was being allocated.
        what: &'static str,
        /// Bytes requested.
        bytes: u64,
    },
    /// The backend does not implement an optional operation.
    #[error("{operation} is not supported by this backend")]
    Unsupported {
        /// The operation.
        operation: &'static str,
    },
    /// The device failed or is unusable (no driver or GPU, a kernel that did not compile or
    /// launch, a cuBLAS failure): raised by device backends such as the CUDA one.
    #[error("device error ({kind}): {reason}")]
    Device {
        /// Stable reason of the device layer (`library_missing`, `no_device`, `launch`, …).
        kind: &'static str,
        /// The full message, naming the library, call or kernel.
        reason: String,
    },
}

impl BackendError {
    /// Stable machine-readable reason (metric label).
    pub fn error_type(&self) -> &'static str {
        match self {
            BackendError::EmptyBatch => "empty_batch",
            BackendError::EmptyChunk { .. } => "empty_chunk",
            BackendError::TokenOutOfRange { .. } => "token_out_of_range",
            BackendError::ContextOverflow { .. } => "context_overflow",
            BackendError::BlockTableTooShort { .. } => "block_table_too_short",
            BackendError::BlockOutOfRange { .. } => "block_out_of_range",
            BackendError::BufferSize { .. } => "buffer_size",
            BackendError::BannedOutOfRange { .. } => "banned_out_of_range",
            BackendError::InvalidConfig { .. } => "invalid_config",
            BackendError::OutOfMemory { .. } => "out_of_memory",
            BackendError::Unsupported { .. } => "unsupported",
            BackendError::Device { .. } => "device",
        }
    }
}
