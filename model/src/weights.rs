//! f32 host weights with validated shapes.

use crate::config::ModelConfig;
use crate::error::ModelError;

/// One transformer block's weights; every projection is row-major `[out][in]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// Attention RMSNorm gain, `[dim]`.
    pub rms_att: Vec<f32>,
    /// Query projection, `[dim][dim]`.
    pub wq: Vec<f32>,
    /// Key projection, `[kv_dim][dim]`.
    pub wk: Vec<f32>,
    /// Value projection, `[kv_dim][dim]`.
    pub wv: Vec<f32>,
    /// Attention output projection, `[dim][dim]`.
    pub wo: Vec<f32>,
    /// FFN RMSNorm gain, `[dim]`.
    pub rms_ffn: Vec<f32>,
    /// SwiGLU gate projection, `[hidden_dim][dim]`.
    pub w1: Vec<f32>,
    /// SwiGLU down projection, `[dim][hidden_dim]`.
    pub w2: Vec<f32>,
    /// SwiGLU up projection, `[hidden_dim][dim]`.
    pub w3: Vec<f32>,
}

/// Names of a layer's tensors in storage order (llama2.c order inside a layer).
pub const LAYER_TENSOR_NAMES: [&str; 9] = [
    "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3",
];

impl LayerWeights {
    /// The tensors in [`LAYER_TENSOR_NAMES`] order.
    pub fn tensors(&self) -> [&Vec<f32>; 9] {
        [
            &self.rms_att,
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.rms_ffn,
            &self.w1,
            &self.w2,
            &self.w3,
        ]
    }
}

/// Element counts of a layer's tensors in [`LAYER_TENSOR_NAMES`] order.
pub fn layer_tensor_sizes(c: &ModelConfig) -> [usize; 9] {
    let (d, h, kv) = (c.dim, c.hidden_dim, c.kv_dim());
    [d, d * d, kv * d, kv * d, d * d, d, h * d, d * h, h * d]
}

/// A whole model's f32 weights. Built only through [`Weights::new`], so every instance has a valid
/// configuration and tensors of the right sizes: backends need not re-check.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    /// Validated hyper-parameters.
    config: ModelConfig,
    /// `[vocab][dim]`; also the classifier when `config.shared_classifier`.
    token_embedding: Vec<f32>,
    /// `n_layers` blocks.
    layers: Vec<LayerWeights>,
    /// Final RMSNorm gain, `[dim]`.
    rms_final: Vec<f32>,
    /// Untied classifier `[vocab][dim]`; `None` exactly when `config.shared_classifier`.
    classifier: Option<Vec<f32>>,
}

impl Weights {
    /// Validates the configuration and every tensor size.
    pub fn new(
        config: ModelConfig,
        token_embedding: Vec<f32>,
        layers: Vec<LayerWeights>,
        rms_final: Vec<f32>,
        classifier: Option<Vec<f32>>,
    ) -> Result<Weights, ModelError> {
        config.validate()?;
        let check = |name: String, expected: usize, actual: usize| {
            if expected == actual {
                Ok(())
            } else {
                Err(ModelError::TensorShape {
                    tensor: name,
                    expected,
                    actual,
                })
            }
        };
        let (d, v) = (config.dim, config.vocab_size);
        check("token_embedding".into(), v * d, token_embedding.len())?;
        check("layers".into(), config.n_layers, layers.len())?;
        let sizes = layer_tensor_sizes(&config);
        for (l, layer) in layers.iter().enumerate() {
            for ((name, &size), t) in LAYER_TENSOR_NAMES.iter().zip(&sizes).zip(layer.tensors()) {
                check(format!("layers.{l}.{name}"), size, t.len())?;
            }
        }
        check("rms_final".into(), d, rms_final.len())?;
        match (&classifier, config.shared_classifier) {
            (None, true) => {}
            (Some(c), false) => check("classifier".into(), v * d, c.len())?,
            (Some(_), true) => {
                return Err(ModelError::InvalidConfig {
                    reason: "a classifier was given for a model with a shared classifier".into(),
                });
            }
            (None, false) => {
                return Err(ModelError::InvalidConfig {
                    reason: "the model has an untied classifier but none was given".into(),
                });
            }
        }
        Ok(Weights {
            config,
            token_embedding,
            layers,
            rms_final,
            classifier,
        })
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Token embedding `[vocab][dim]`.
    pub fn token_embedding(&self) -> &[f32] {
        &self.token_embedding
    }

    /// Transformer blocks.
    pub fn layers(&self) -> &[LayerWeights] {
        &self.layers
    }

    /// Final RMSNorm gain `[dim]`.
    pub fn rms_final(&self) -> &[f32] {
        &self.rms_final
    }

    /// Classifier `[vocab][dim]`: the untied matrix, or the token embedding when tied.
    pub fn classifier(&self) -> &[f32] {
        self.classifier.as_deref().unwrap_or(&self.token_embedding)
    }

    /// Whether the classifier is a separate matrix.
    pub fn has_untied_classifier(&self) -> bool {
        self.classifier.is_some()
    }
}

/// An empty `Vec<f32>` with capacity for exactly `len` elements, reporting allocation failure as
/// an error instead of aborting (a hostile header cannot get this far: sizes are checked against
/// the file length first, but a dummy 8b model on a small host can). Callers fill it with
/// `extend`/`par_extend`, which write each element once.
pub(crate) fn try_vec(len: usize) -> Result<Vec<f32>, ModelError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| ModelError::OutOfMemory {
            bytes: len as u64 * 4,
        })?;
    Ok(v)
}

/// Bytes the kernel reports as available for new allocations (`MemAvailable` of
/// `/proc/meminfo`), or `None` where that is unknown (non-Linux).
pub fn host_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses up front to materialise `bytes` of weights that the host cannot hold: with Linux
/// overcommit, per-tensor allocations would succeed and the process would be killed while
/// filling them. Skipped where the available memory is unknown.
pub(crate) fn check_host_memory(bytes: u64) -> Result<(), ModelError> {
    match host_available_bytes() {
        Some(avail) if bytes > avail => Err(ModelError::OutOfMemory { bytes }),
        _ => Ok(()),
    }
}
