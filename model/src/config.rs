//! Model hyper-parameters and the named dummy configurations.

use crate::error::ModelError;

/// Largest accepted model width: 4× Llama-3-405B's 16384, far above anything a CPU runs.
pub const MAX_DIM: usize = 65_536;
/// Largest accepted FFN width (Llama-3-405B: 53248).
pub const MAX_HIDDEN_DIM: usize = 262_144;
/// Largest accepted layer count (Llama-3-405B: 126).
pub const MAX_LAYERS: usize = 1_024;
/// Largest accepted head count (query or KV).
pub const MAX_HEADS: usize = 1_024;
/// Largest accepted vocabulary (Gemma's 256k with room to spare).
pub const MAX_VOCAB: usize = 1 << 21;
/// Largest accepted context length (Llama-3.1's 131072 with room to spare).
pub const MAX_SEQ_LEN: usize = 1 << 20;
/// Smallest vocabulary: ids 0 (`<unk>`), 1 (BOS) and 2 (EOS) are reserved by llama2.c.
pub const MIN_VOCAB: usize = 3;

/// Model hyper-parameters (Llama architecture).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Residual stream width (`n_heads × head_dim`).
    pub dim: usize,
    /// SwiGLU inner width.
    pub hidden_dim: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention: `n_heads` is a multiple of it).
    pub n_kv_heads: usize,
    /// Token ids are `0..vocab_size`.
    pub vocab_size: usize,
    /// Longest sequence (positions `0..max_seq_len`); the RoPE table covers it.
    pub max_seq_len: usize,
    /// RoPE base frequency (10000 for Llama 2 / llama2.c, 500000 for Llama 3).
    pub rope_theta: f32,
    /// RMSNorm epsilon (1e-5 in llama2.c).
    pub norm_eps: f32,
    /// The classifier is the token embedding matrix (tied weights).
    pub shared_classifier: bool,
}

impl ModelConfig {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }

    /// Width of the key (and value) projection: `n_kv_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim()
    }

    /// Parameter count, embedding and (untied) classifier included.
    pub fn n_params(&self) -> u64 {
        let (d, h, v, kv) = (
            self.dim as u64,
            self.hidden_dim as u64,
            self.vocab_size as u64,
            self.kv_dim() as u64,
        );
        let per_layer = 2 * d + d * d * 2 + 2 * d * kv + 3 * d * h;
        let classifier = if self.shared_classifier { 0 } else { v * d };
        v * d + self.n_layers as u64 * per_layer + d + classifier
    }

    /// Bytes of f32 weights a forward pass of one token reads: every projection, one embedding row
    /// and the classifier (for tied weights the embedding matrix is read as the classifier).
    pub fn weight_bytes_per_token(&self) -> u64 {
        let (d, h, v, kv) = (
            self.dim as u64,
            self.hidden_dim as u64,
            self.vocab_size as u64,
            self.kv_dim() as u64,
        );
        let per_layer = 2 * d + d * d * 2 + 2 * d * kv + 3 * d * h;
        4 * (self.n_layers as u64 * per_layer + d + v * d + d)
    }

    /// Multiply-adds ×2 of the projections for one token (attention excluded), without the
    /// classifier: the FLOPs of prefill per prompt token.
    pub fn matmul_flops_per_token(&self) -> u64 {
        let (d, h, kv) = (
            self.dim as u64,
            self.hidden_dim as u64,
            self.kv_dim() as u64,
        );
        2 * self.n_layers as u64 * (2 * d * d + 2 * d * kv + 3 * d * h)
    }

    /// Checks that the shapes are consistent and within the named limits.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |reason: String| Err(ModelError::InvalidConfig { reason });
        let ranges = [
            ("dim", self.dim, 1, MAX_DIM),
            ("hidden_dim", self.hidden_dim, 1, MAX_HIDDEN_DIM),
            ("n_layers", self.n_layers, 1, MAX_LAYERS),
            ("n_heads", self.n_heads, 1, MAX_HEADS),
            ("n_kv_heads", self.n_kv_heads, 1, MAX_HEADS),
            ("vocab_size", self.vocab_size, MIN_VOCAB, MAX_VOCAB),
            ("max_seq_len", self.max_seq_len, 1, MAX_SEQ_LEN),
        ];
        for (name, v, lo, hi) in ranges {
            if !(lo..=hi).contains(&v) {
                return bad(format!("{name} = {v} is outside {lo}..={hi}"));
            }
        }
        if !self.dim.is_multiple_of(self.n_heads) {
            return bad(format!(
                "dim {} is not a multiple of n_heads {}",
                self.dim, self.n_heads
            ));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "n_heads {} is not a multiple of n_kv_heads {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "head_dim {} is odd (RoPE rotates pairs)",
                self.head_dim()
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return bad(format!(
                "rope_theta {} must be finite and > 1",
                self.rope_theta
            ));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return bad(format!("norm_eps {} must be finite and > 0", self.norm_eps));
        }
        Ok(())
    }

    /// The named dummy configurations (`dummy:NAME`): `tiny`, `small`, `1b`, `8b`.
    pub fn dummy(name: &str) -> Option<ModelConfig> {
        let llama2 =
            |dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len| ModelConfig {
                dim,
                hidden_dim,
                n_layers,
                n_heads,
                n_kv_heads,
                vocab_size,
                max_seq_len,
                rope_theta: 10_000.0,
                norm_eps: 1e-5,
                shared_classifier: true,
            };
        match name {
            // ≈0.86M parameters: fast enough for every test.
            "tiny" => Some(llama2(128, 384, 4, 4, 2, 512, 2048)),
            // ≈110M parameters (85M in the blocks + a 32000×768 tied embedding).
            "small" => Some(llama2(768, 2048, 12, 12, 12, 32_000, 2048)),
            // Llama-3.2-1B shape (tied embedding), context capped at 8192.
            "1b" => Some(ModelConfig {
                rope_theta: 500_000.0,
                ..llama2(2048, 8192, 16, 32, 8, 128_256, 8192)
            }),
            // Llama-3-8B shape (untied classifier).
            "8b" => Some(ModelConfig {
                rope_theta: 500_000.0,
                shared_classifier: false,
                ..llama2(4096, 14_336, 32, 32, 8, 128_256, 8192)
            }),
            _ => None,
        }
    }

    /// Names accepted by [`ModelConfig::dummy`].
    pub const DUMMY_NAMES: [&'static str; 4] = ["tiny", "small", "1b", "8b"];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dummy_configs_are_valid_and_sized_as_documented() {
        for name in ModelConfig::DUMMY_NAMES {
            ModelConfig::dummy(name).unwrap().validate().unwrap();
        }
        let tiny = ModelConfig::dummy("tiny").unwrap().n_params();
        assert!(
            (700_000..1_200_000).contains(&tiny),
            "tiny has {tiny} params"
        );
        let b1 = ModelConfig::dummy("1b").unwrap().n_params();
        assert!(
            (1_200_000_000..1_300_000_000).contains(&b1),
            "1b has {b1} params"
        );
        let b8 = ModelConfig::dummy("8b").unwrap().n_params();
        assert!(
            (7_900_000_000..8_100_000_000).contains(&b8),
            "8b has {b8} params"
        );
    }
}
