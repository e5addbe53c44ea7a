//! `load_model`: one entry point for `dummy:NAME[@SEED]` specs and llama2.c checkpoint files.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::dummy::{DEFAULT_DUMMY_SEED, dummy_weights};
use crate::error::ModelError;
use crate::llama2c::read_checkpoint;
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;

/// Largest tokenizer file we read (a 256k vocabulary with 64-byte pieces is ~19 MB).
pub const MAX_TOKENIZER_FILE_BYTES: u64 = 256 << 20;

/// A loaded model: weights plus tokenizer.
#[derive(Clone, Debug)]
pub struct Model {
    /// The spec it was loaded from (`dummy:small@42`, a path, …), for logs and metrics.
    pub name: String,
    /// Shared weights (backends keep an `Arc`).
    pub weights: Arc<Weights>,
    /// Shared tokenizer.
    pub tokenizer: Arc<Tokenizer>,
}

/// Loads `spec`: `dummy:NAME[@SEED]` (see [`ModelConfig::dummy`]; byte-level tokenizer unless
/// `tokenizer` is given) or a llama2.c checkpoint path. The tokenizer of a checkpoint is
/// `tokenizer`, else `tokenizer.bin` beside it, else `tok<vocab>.bin` beside it.
pub fn load_model(spec: &str, tokenizer: Option<&Path>) -> Result<Model, ModelError> {
    let weights = match parse_dummy_spec(spec)? {
        Some((config, seed)) => dummy_weights(&config, seed)?,
        None => load_checkpoint(Path::new(spec))?,
    };
    let tok = tokenizer_for(spec, tokenizer, weights.config().vocab_size)?;
    Ok(Model {
        name: spec.to_string(),
        weights: Arc::new(weights),
        tokenizer: Arc::new(tok),
    })
}

/// Parses a `dummy:NAME[@SEED]` spec into its configuration and seed; `None` for any other spec
/// (a checkpoint path).
pub(crate) fn parse_dummy_spec(spec: &str) -> Result<Option<(ModelConfig, u64)>, ModelError> {
    let Some(rest) = spec.strip_prefix("dummy:") else {
        return Ok(None);
    };
    let (name, seed) = match rest.split_once('@') {
        Some((n, s)) => (
            n,
            s.parse::<u64>().map_err(|_| ModelError::InvalidSeed {
                seed: s.to_string(),
            })?,
        ),
        None => (rest, DEFAULT_DUMMY_SEED),
    };
    let config = ModelConfig::dummy(name).ok_or_else(|| ModelError::UnknownDummy {
        name: name.to_string(),
    })?;
    Ok(Some((config, seed)))
}

/// The tokenizer of the model `spec` with `vocab` entries: `tokenizer` if given, else byte-level
/// for a dummy model, else the one found beside the checkpoint ([`find_tokenizer`]).
pub(crate) fn tokenizer_for(
    spec: &str,
    tokenizer: Option<&Path>,
    vocab: usize,
) -> Result<Tokenizer, ModelError> {
    match (tokenizer, spec.starts_with("dummy:")) {
        (Some(path), _) => load_tokenizer(path, vocab),
        (None, true) => Tokenizer::byte_level(vocab),
        (None, false) => load_tokenizer(&find_tokenizer(Path::new(spec), vocab)?, vocab),
    }
}

/// Reads a llama2.c checkpoint file.
pub fn load_checkpoint(path: &Path) -> Result<Weights, ModelError> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    read_checkpoint(BufReader::new(file), len).map_err(|e| match e {
        ModelError::Io { source, .. } => ModelError::Io {
            path: path.to_path_buf(),
            source,
        },
        other => other,
    })
}

/// Reads a llama2.c tokenizer file for a vocabulary of `vocab_size`.
pub fn load_tokenizer(path: &Path, vocab_size: usize) -> Result<Tokenizer, ModelError> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > MAX_TOKENIZER_FILE_BYTES {
        return Err(ModelError::InvalidTokenizer {
            reason: format!(
                "{} is {len} bytes, above the {MAX_TOKENIZER_FILE_BYTES}-byte limit",
                path.display()
            ),
        });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    Tokenizer::from_llama2c_bytes(&bytes, vocab_size)
}

/// `tokenizer.bin` beside the checkpoint, else `tok<vocab>.bin` beside it.
pub fn find_tokenizer(checkpoint: &Path, vocab_size: usize) -> Result<PathBuf, ModelError> {
    let dir = checkpoint.parent().unwrap_or(Path::new("."));
    let fallback = format!("tok{vocab_size}.bin");
    for name in ["tokenizer.bin", fallback.as_str()] {
        let p = dir.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(ModelError::TokenizerNotFound {
        checkpoint: checkpoint.to_path_buf(),
        fallback,
    })
}
