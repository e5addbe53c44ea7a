//! llama2.c checkpoint reader ("legacy" version 0 layout, as `run.c` reads it).
//!
//! Layout (little endian): 7 × i32 header `dim, hidden_dim, n_layers, n_heads, n_kv_heads,
//! vocab_size, seq_len` (a negative `vocab_size` means an untied classifier follows), then f32
//! tensors: token embedding `[vocab][dim]`, `rms_att [L][dim]`, `wq [L][dim][dim]`,
//! `wk [L][kv_dim][dim]`, `wv [L][kv_dim][dim]`, `wo [L][dim][dim]`, `rms_ffn [L][dim]`,
//! `w1 [L][hidden][dim]`, `w2 [L][dim][hidden]`, `w3 [L][hidden][dim]`, `rms_final [dim]`, then
//! `2 × seq_len × head_dim/2` unused RoPE floats, then the classifier `[vocab][dim]` if untied.
//!
//! The file length must equal exactly what the header implies; it is checked before any large
//! allocation, so a hostile header cannot make us allocate more than the file holds.

use std::io::Read;

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::weights::{
    LAYER_TENSOR_NAMES, LayerWeights, Weights, check_host_memory, layer_tensor_sizes, try_vec,
};

/// Bytes of the header (7 × i32).
pub const HEADER_BYTES: u64 = 28;
/// llama2.c's RoPE base (not stored in the file).
pub const LLAMA2C_ROPE_THETA: f32 = 10_000.0;
/// llama2.c's RMSNorm epsilon (not stored in the file).
pub const LLAMA2C_NORM_EPS: f32 = 1e-5;
/// Bytes converted per read while streaming tensors from the file.
const READ_CHUNK_BYTES: usize = 1 << 20;

/// Parses the 28-byte header into a validated configuration.
pub fn parse_header(header: &[u8; HEADER_BYTES as usize]) -> Result<ModelConfig, ModelError> {
    let field = |i: usize| {
        i32::from_le_bytes([
            header[4 * i],
            header[4 * i + 1],
            header[4 * i + 2],
            header[4 * i + 3],
        ])
    };
    let names = [
        "dim",
        "hidden_dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "vocab_size",
        "seq_len",
    ];
    let mut v = [0usize; 7];
    for (i, name) in names.iter().enumerate() {
        let raw = field(i);
        let abs = if i == 5 {
            raw.unsigned_abs()
        } else if raw > 0 {
            raw as u32
        } else {
            0
        };
        if abs == 0 {
            return Err(ModelError::InvalidConfig {
                reason: format!("header field {name} = {raw} must be positive"),
            });
        }
        v[i] = abs as usize;
    }
    let config = ModelConfig {
        dim: v[0],
        hidden_dim: v[1],
        n_layers: v[2],
        n_heads: v[3],
        n_kv_heads: v[4],
        vocab_size: v[5],
        max_seq_len: v[6],
        rope_theta: LLAMA2C_ROPE_THETA,
        norm_eps: LLAMA2C_NORM_EPS,
        shared_classifier: field(5) > 0,
    };
    config.validate()?;
    Ok(config)
}

/// Total file size the configuration implies, in bytes.
pub fn expected_file_bytes(c: &ModelConfig) -> u64 {
    let (d, v) = (c.dim as u64, c.vocab_size as u64);
    let layer: u64 = layer_tensor_sizes(c).iter().map(|&s| s as u64).sum();
    let rope = c.max_seq_len as u64 * c.head_dim() as u64; // 2 × seq_len × head_dim/2
    let classifier = if c.shared_classifier { 0 } else { v * d };
    HEADER_BYTES + 4 * (v * d + c.n_layers as u64 * layer + d + rope + classifier)
}

/// Reads f32 tensors from a byte stream, converting in chunks.
struct TensorReader<R> {
    /// The source, positioned after the header.
    inner: R,
    /// Conversion buffer, reused.
    buf: Vec<u8>,
}

impl<R: Read> TensorReader<R> {
    /// Reads `len` f32 values and rejects non-finite ones.
    fn read(&mut self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let mut out = try_vec(len)?;
        let mut remaining = len * 4;
        while remaining > 0 {
            let n = remaining.min(READ_CHUNK_BYTES);
            self.buf.resize(n, 0);
            self.inner
                .read_exact(&mut self.buf)
                .map_err(|e| ModelError::Io {
                    path: "<checkpoint>".into(),
                    source: e,
                })?;
            out.extend(
                self.buf
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
            remaining -= n;
        }
        if let Some(index) = out.iter().position(|x| !x.is_finite()) {
            return Err(ModelError::NonFiniteWeight {
                tensor: name.to_string(),
                index,
            });
        }
        Ok(out)
    }

    /// Skips `len` f32 values.
    fn skip(&mut self, len: usize) -> Result<(), ModelError> {
        let bytes = len as u64 * 4;
        let copied = std::io::copy(&mut (&mut self.inner).take(bytes), &mut std::io::sink())
            .map_err(|e| ModelError::Io {
                path: "<checkpoint>".into(),
                source: e,
            })?;
        if copied != bytes {
            return Err(ModelError::Truncated {
                what: "checkpoint",
                needed: bytes,
                actual: copied,
            });
        }
        Ok(())
    }
}

/// Reads a checkpoint of `file_len` bytes from `reader` (positioned at its start).
pub fn read_checkpoint(mut reader: impl Read, file_len: u64) -> Result<Weights, ModelError> {
    if file_len < HEADER_BYTES {
        return Err(ModelError::Truncated {
            what: "checkpoint header",
            needed: HEADER_BYTES,
            actual: file_len,
        });
    }
    let mut header = [0u8; HEADER_BYTES as usize];
    reader.read_exact(&mut header).map_err(|e| ModelError::Io {
        path: "<checkpoint>".into(),
        source: e,
    })?;
    let config = parse_header(&header)?;
    let expected = expected_file_bytes(&config);
    if file_len < expected {
        return Err(ModelError::Truncated {
            what: "checkpoint",
            needed: expected,
            actual: file_len,
        });
    }
    if file_len > expected {
        return Err(ModelError::SizeMismatch {
            what: "checkpoint",
            expected,
            actual: file_len,
        });
    }
    check_host_memory(expected)?;
    let mut r = TensorReader {
        inner: reader,
        buf: Vec::new(),
    };
    let (d, v, l) = (config.dim, config.vocab_size, config.n_layers);
    let token_embedding = r.read("token_embedding", v * d)?;
    // The file stores each tensor kind for all layers together: read kind by kind.
    let sizes = layer_tensor_sizes(&config);
    let mut per_kind: Vec<Vec<Vec<f32>>> = Vec::with_capacity(9);
    for (name, &size) in LAYER_TENSOR_NAMES.iter().zip(&sizes) {
        let mut layers = Vec::with_capacity(l);
        for layer in 0..l {
            layers.push(r.read(&format!("layers.{layer}.{name}"), size)?);
        }
        per_kind.push(layers);
    }
    let rms_final = r.read("rms_final", d)?;
    r.skip(config.max_seq_len * config.head_dim())?;
    let classifier = if config.shared_classifier {
        None
    } else {
        Some(r.read("classifier", v * d)?)
    };
    let layers = (0..l)
        .map(|layer| {
            let mut take = |kind: usize| std::mem::take(&mut per_kind[kind][layer]);
            LayerWeights {
                rms_att: take(0),
                wq: take(1),
                wk: take(2),
                wv: take(3),
                wo: take(4),
                rms_ffn: take(5),
                w1: take(6),
                w2: take(7),
                w3: take(8),
            }
        })
        .collect();
    Weights::new(config, token_embedding, layers, rms_final, classifier)
}

/// Parses a checkpoint held in memory.
pub fn parse_checkpoint(bytes: &[u8]) -> Result<Weights, ModelError> {
    read_checkpoint(bytes, bytes.len() as u64)
}

/// Serialises weights in the llama2.c layout (tests write corrupt variants of it; RoPE floats are
/// written as zeros).
pub fn write_checkpoint(w: &Weights) -> Vec<u8> {
    let c = w.config();
    let mut out = Vec::with_capacity(expected_file_bytes(c) as usize);
    let vocab = if c.shared_classifier {
        c.vocab_size as i32
    } else {
        -(c.vocab_size as i32)
    };
    for f in [
        c.dim as i32,
        c.hidden_dim as i32,
        c.n_layers as i32,
        c.n_heads as i32,
        c.n_kv_heads as i32,
        vocab,
        c.max_seq_len as i32,
    ] {
        out.extend_from_slice(&f.to_le_bytes());
    }
    let mut put = |t: &[f32]| {
        for x in t {
            out.extend_from_slice(&x.to_le_bytes());
        }
    };
    put(w.token_embedding());
    for kind in 0..9 {
        for layer in w.layers() {
            put(layer.tensors()[kind]);
        }
    }
    put(w.rms_final());
    put(&vec![0.0; c.max_seq_len * c.head_dim()]);
    if w.has_untied_classifier() {
        put(w.classifier());
    }
    out
}
