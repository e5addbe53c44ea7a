//! The CUDA backend: the Llama forward pass on an NVIDIA GPU through `zerolayer_kernels::cuda`
//! (our kernels compiled with NVRTC, cuBLAS GEMMs), with the CPU backend's paged KV semantics.
//!
//! # Modes ([`CudaDType`])
//! - `Bf16` (serving): bf16 weights and KV pool, cuBLAS GEMMs with f32 accumulation, split-KV
//!   attention. Logits match the CPU oracle within bf16 tolerance.
//! - `F32` (upcast, for parity): f32 weights and KV, and kernels that reproduce the oracle's
//!   per-element operation order (16-lane matmul, exact exp/softmax/RMSNorm/RoPE/SwiGLU), so
//!   logits are meant to be bit-identical to [`crate::CpuBackend`]; slow, for small models.
//!
//! # Per step
//! [`StepBuilder`] validates every chunk (the CPU backend's checks, same errors, same order)
//! and assembles one staging buffer (tokens, positions, block tables, attention tiles, logits
//! rows, sampling rows) that is copied to the device once. Then, per layer: RMSNorm → fused
//! q|k|v projection → RoPE + KV append → attention → output projection (+ residual) →
//! RMSNorm → fused gate|up projection → SiLU×mul → down projection (+ residual); finally the
//! norm and classifier of the rows wanting logits and, in [`Backend::forward_sample`],
//! sampling on the device (only token ids and status words are copied back).
//!
//! Kernel launches per step: 1 embedding + 9 or 10 per layer (the attention combine runs only
//! when KV is split) + 2 for the logits + 1 for sampling: about 300 for dummy:8b, independent
//! of the batch size. No CUDA graphs yet.
//!
//! # KV pool
//! Allocated once: K and V each `[n_layers][num_blocks][block_size][kv_dim]` (bf16 or f32),
//! indexed by the same block ids and tables as the CPU backend.

use std::path::Path;
use std::sync::Arc;

use zerolayer_kernels::cuda::{
    CudaError, DType, DeviceBuffer, DeviceStep, FloatBuffer, Gpu, KvPool, Matrix, ModelDims, Rows,
    SampleRow, StepBuilder, StepError, StepGeometry, consts,
};

use crate::backend::{Backend, KvCacheConfig, SeqChunk, check_sampling_sizes};
use crate::config::ModelConfig;
use crate::dummy::dummy_scale;
use crate::error::{BackendError, ModelError};
use crate::load::{load_checkpoint, parse_dummy_spec, tokenizer_for};
use crate::sampling::{SampleInput, SampleOutcome, Sampler, SamplingError};
use crate::tokenizer::Tokenizer;
use crate::weights::{Weights, layer_tensor_sizes};

/// Elements of the f32 staging buffer that uploads host weights converted on the device
/// (64 MiB: large enough that per-piece overhead is negligible, small next to any GPU).
const UPLOAD_STAGING_ELEMS: usize = 16 << 20;
/// (token, split) pairs the split-KV partial buffer holds: batch-1 decode gets up to
/// `MAX_SPLITS` splits, a 128-sequence decode step 32, big prefill steps run unsplit.
const PARTIAL_TOKEN_SPLITS: usize = 4096;
/// Smallest token capacity of the step buffers (they grow to the largest step, in powers of 2).
const MIN_TOKEN_CAPACITY: usize = 16;
/// Environment variable read by [`load_cuda_model`]'s callers to pick the mode (`bf16`, `f32`).
pub const CUDA_DTYPE_ENV: &str = "ZEROLAYER_CUDA_DTYPE";

/// Storage precision of a [`CudaBackend`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaDType {
    /// bf16 weights and KV, cuBLAS GEMMs (serving).
    Bf16,
    /// f32 weights and KV, the oracle's exact operation order (parity with the CPU).
    F32,
}

impl CudaDType {
    /// The kernels' storage type.
    fn dtype(self) -> DType {
        match self {
            CudaDType::Bf16 => DType::Bf16,
            CudaDType::F32 => DType::F32,
        }
    }

    /// Bytes per weight or KV element.
    pub fn size(self) -> usize {
        self.dtype().size()
    }

    /// `bf16` or `f32`.
    pub fn name(self) -> &'static str {
        self.dtype().name()
    }
}

impl std::str::FromStr for CudaDType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(CudaDType::Bf16),
            "f32" => Ok(CudaDType::F32),
            _ => Err(format!("unknown CUDA dtype {s:?}: use bf16 or f32")),
        }
    }
}

/// Maps the device layer's errors onto the backend's (allocation failures and rejected steps
/// keep their specific variants).
fn device_error(e: CudaError) -> BackendError {
    match e {
        CudaError::OutOfMemory { what, bytes, .. } => BackendError::OutOfMemory { what, bytes },
        CudaError::Step(s) => step_error(s),
        other => BackendError::Device {
            kind: other.error_type(),
            reason: other.to_string(),
        },
    }
}

/// Maps a rejected step onto the CPU backend's error for the same input.
fn step_error(e: StepError) -> BackendError {
    match e {
        StepError::EmptyBatch => BackendError::EmptyBatch,
        StepError::EmptyChunk { chunk } => BackendError::EmptyChunk { chunk },
        StepError::TokenOutOfRange {
            chunk,
            token,
            vocab_size,
        } => BackendError::TokenOutOfRange {
            chunk,
            token,
            vocab_size,
        },
        StepError::ContextOverflow {
            chunk,
            end,
            max_seq_len,
        } => BackendError::ContextOverflow {
            chunk,
            end,
            max_seq_len,
        },
        StepError::BlockTableTooShort {
            chunk,
            needed,
            actual,
        } => BackendError::BlockTableTooShort {
            chunk,
            needed,
            actual,
        },
        StepError::BlockOutOfRange {
            chunk,
            block,
            num_blocks,
        } => BackendError::BlockOutOfRange {
            chunk,
            block,
            num_blocks,
        },
        StepError::BannedOutOfRange { token, vocab_size } => {
            BackendError::BannedOutOfRange { token, vocab_size }
        }
        StepError::SamplingRows { expected, actual } => BackendError::BufferSize {
            what: "sampling",
            expected,
            actual,
        },
        StepError::TooLarge { .. } => BackendError::InvalidConfig {
            reason: e.to_string(),
        },
    }
}

/// The kernels' view of a model configuration.
fn model_dims(c: &ModelConfig) -> ModelDims {
    ModelDims {
        dim: c.dim,
        hidden_dim: c.hidden_dim,
        n_layers: c.n_layers,
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        vocab_size: c.vocab_size,
        max_seq_len: c.max_seq_len,
    }
}

/// The RoPE table exactly like the CPU backend's: `[max_seq_len][head_dim / 2][cos, sin]` with
/// `freq = 1 / powf(theta, j / head_dim)`, `val = pos · freq` (host `f32` math, so both
/// backends rotate with identical values).
pub fn rope_table(c: &ModelConfig) -> Vec<f32> {
    let hd = c.head_dim();
    let mut t = Vec::with_capacity(c.max_seq_len * hd);
    for pos in 0..c.max_seq_len {
        for j in (0..hd).step_by(2) {
            let freq = 1.0f32 / c.rope_theta.powf(j as f32 / hd as f32);
            let val = pos as f32 * freq;
            t.push(val.cos());
            t.push(val.sin());
        }
    }
    t
}

/// Blocks of `block_size` positions that fit in `mib` MiB of device memory for `config` at
/// `dtype` (K and V, every layer), at least 1.
pub fn kv_blocks_for_mib(
    config: &ModelConfig,
    block_size: usize,
    dtype: CudaDType,
    mib: usize,
) -> usize {
    let per_block = 2 * config.n_layers * block_size * config.kv_dim() * dtype.size();
    ((mib << 20) / per_block.max(1)).max(1)
}

/// One transformer block on the device.
struct DeviceLayer {
    /// Attention RMSNorm gain (f32).
    rms_att: DeviceBuffer<f32>,
    /// Fused `[wq; wk; wv]`, `[dim + 2·kv_dim][dim]`.
    wqkv: Matrix,
    /// Output projection `[dim][dim]`.
    wo: Matrix,
    /// FFN RMSNorm gain (f32).
    rms_ffn: DeviceBuffer<f32>,
    /// Fused `[w1; w3]`, `[2·hidden][dim]`.
    w13: Matrix,
    /// Down projection `[dim][hidden]`.
    w2: Matrix,
}

/// The model's weights on the device.
struct DeviceWeights {
    /// `[vocab][dim]`; also the classifier when tied.
    embedding: Matrix,
    /// Blocks.
    layers: Vec<DeviceLayer>,
    /// Final RMSNorm gain.
    rms_final: DeviceBuffer<f32>,
    /// Untied classifier `[vocab][dim]`.
    classifier: Option<Matrix>,
}

impl DeviceWeights {
    /// Allocates zeroed weights for `c`.
    fn alloc(gpu: &Gpu, c: &ModelConfig, dt: DType) -> Result<Self, CudaError> {
        let (d, h, kvd, v) = (c.dim, c.hidden_dim, c.kv_dim(), c.vocab_size);
        let mut layers = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            layers.push(DeviceLayer {
                rms_att: gpu.alloc(d, "weights")?,
                wqkv: gpu.alloc_matrix(dt, d + 2 * kvd, d, "weights")?,
                wo: gpu.alloc_matrix(dt, d, d, "weights")?,
                rms_ffn: gpu.alloc(d, "weights")?,
                w13: gpu.alloc_matrix(dt, 2 * h, d, "weights")?,
                w2: gpu.alloc_matrix(dt, d, h, "weights")?,
            });
        }
        Ok(DeviceWeights {
            embedding: gpu.alloc_matrix(dt, v, d, "weights")?,
            layers,
            rms_final: gpu.alloc(d, "weights")?,
            classifier: if c.shared_classifier {
                None
            } else {
                Some(gpu.alloc_matrix(dt, v, d, "weights")?)
            },
        })
    }

    /// The classifier matrix.
    fn classifier(&self) -> &Matrix {
        self.classifier.as_ref().unwrap_or(&self.embedding)
    }

    /// Bytes of all weights on the device.
    fn bytes(&self) -> u64 {
        let mut b = self.embedding.bytes() + self.classifier.as_ref().map_or(0, Matrix::bytes);
        for l in &self.layers {
            b += l.wqkv.bytes() + l.wo.bytes() + l.w13.bytes() + l.w2.bytes();
            b += 4 * (l.rms_att.len() + l.rms_ffn.len()) as u64;
        }
        b + 4 * self.rms_final.len() as u64
    }
}

/// Device buffers of one step, grown to the largest step seen.
struct Scratch {
    /// Tokens the token-sized buffers hold.
    tokens: usize,
    /// Logits rows the row-sized buffers hold.
    rows: usize,
    /// Residual stream `[T][dim]` f32.
    x: DeviceBuffer<f32>,
    /// Normalised GEMM input `[T][dim]` (model dtype).
    xb: FloatBuffer,
    /// Fused q|k|v `[T][dim + 2·kv_dim]` f32.
    qkv: DeviceBuffer<f32>,
    /// Attention output `[T][dim]` (model dtype).
    att: FloatBuffer,
    /// Fused gate|up `[T][2·hidden]` f32.
    h13: DeviceBuffer<f32>,
    /// SwiGLU output `[T][hidden]` (model dtype).
    hb: FloatBuffer,
    /// Final-normed rows wanting logits `[W][dim]` (model dtype).
    fin: FloatBuffer,
    /// Logits `[W][vocab]` f32.
    logits: DeviceBuffer<f32>,
    /// Sampling probabilities `[W][vocab]` f32.
    probs: DeviceBuffer<f32>,
    /// Sampling results `[W][2]` (status, token).
    result: DeviceBuffer<u32>,
    /// Split-KV partials (`PARTIAL_TOKEN_SPLITS × n_heads × (head_dim + 2)`; bf16 mode only).
    partial: DeviceBuffer<f32>,
    /// Block tables of `copy_kv` (two tables of the longest context).
    kv_tables: DeviceBuffer<u32>,
}

/// The CUDA backend (see the module docs).
pub struct CudaBackend {
    /// Device, kernels, cuBLAS.
    gpu: Gpu,
    /// Hyper-parameters.
    config: ModelConfig,
    /// Their kernel view.
    dims: ModelDims,
    /// Pool geometry.
    kv: KvCacheConfig,
    /// Storage mode.
    dtype: CudaDType,
    /// Weights on the device.
    weights: DeviceWeights,
    /// The KV pool.
    pool: KvPool,
    /// RoPE table `[max_seq_len][head_dim]` (cos, sin pairs).
    rope: DeviceBuffer<f32>,
    /// Host staging of the step metadata.
    builder: StepBuilder,
    /// Device copy of the step metadata.
    step: DeviceStep,
    /// Step buffers.
    scratch: Scratch,
    /// Sampling results copied back.
    host_result: Vec<u32>,
    /// A logits row copied back for host sampling.
    host_row: Vec<f32>,
    /// Sampler of the rows the device leaves to the host.
    sampler: Sampler,
    /// Rows sampled on the host so far (see [`CudaBackend::host_sampled_rows`]).
    host_sampled: u64,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", self.gpu.info())
            .field("dtype", &self.dtype)
            .field("kv", &self.kv)
            .finish()
    }
}

impl CudaBackend {
    /// Uploads host weights to device `ordinal` (converted to bf16 on the device for
    /// [`CudaDType::Bf16`]) and allocates the KV pool. Fails with
    /// [`BackendError::Device`] (kind `library_missing` or `no_device`) when no driver or GPU
    /// is usable, never panics.
    pub fn new(
        weights: &Weights,
        kv: KvCacheConfig,
        dtype: CudaDType,
        ordinal: usize,
    ) -> Result<Self, BackendError> {
        let mut b = Self::empty(weights.config(), kv, dtype, ordinal)?;
        b.upload_weights(weights).map_err(device_error)?;
        Ok(b)
    }

    /// Generates the dummy model `config` with `seed` directly on the device with the exact
    /// formula of [`crate::dummy_weight`] (the f32 values are computed on the device, then
    /// stored in `dtype`), so large models never exist in host memory.
    pub fn from_dummy(
        config: &ModelConfig,
        seed: u64,
        dtype: CudaDType,
        kv: KvCacheConfig,
        ordinal: usize,
    ) -> Result<Self, BackendError> {
        config.validate().map_err(|e| BackendError::InvalidConfig {
            reason: e.to_string(),
        })?;
        let mut b = Self::empty(config, kv, dtype, ordinal)?;
        b.generate_dummy(seed).map_err(device_error)?;
        Ok(b)
    }

    /// Opens the device, checks support, allocates weights (zeroed), pool and RoPE table.
    fn empty(
        config: &ModelConfig,
        kv: KvCacheConfig,
        dtype: CudaDType,
        ordinal: usize,
    ) -> Result<Self, BackendError> {
        let bad = |reason: String| Err(BackendError::InvalidConfig { reason });
        kv.validate()?;
        let dims = model_dims(config);
        dims.validate().map_err(device_error)?;
        let group = dims.group();
        match dtype {
            CudaDType::Bf16 => {
                if dims.head_dim() > consts::FA_MAX_HD || group > consts::FA_MAX_ROWS {
                    return bad(format!(
                        "the bf16 CUDA kernels support head_dim <= {} and <= {} query heads per KV head (model: {}, {group})",
                        consts::FA_MAX_HD,
                        consts::FA_MAX_ROWS,
                        dims.head_dim()
                    ));
                }
            }
            CudaDType::F32 => {
                if config.max_seq_len * 4 > zerolayer_kernels::cuda::device::DEFAULT_SMEM_BYTES {
                    return bad(format!(
                        "the f32 CUDA mode keeps a sequence's scores in 48 KiB of shared memory: max_seq_len {} > 12288",
                        config.max_seq_len
                    ));
                }
            }
        }
        let gpu = Gpu::new(ordinal).map_err(device_error)?;
        if dtype == CudaDType::Bf16 && !gpu.has_cublas() {
            return Err(device_error(
                zerolayer_kernels::cuda::ensure_library(
                    zerolayer_kernels::cuda::CudaLibrary::Cublas,
                )
                .err()
                .unwrap_or_else(|| CudaError::Unsupported("cuBLAS did not initialise".into())),
            ));
        }
        let dt = dtype.dtype();
        let alloc = || -> Result<_, CudaError> {
            let weights = DeviceWeights::alloc(&gpu, config, dt)?;
            let pool = gpu.alloc_kv_pool(
                dt,
                config.n_layers,
                kv.num_blocks,
                kv.block_size,
                config.kv_dim(),
            )?;
            let table = rope_table(config);
            let mut rope = gpu.alloc(table.len(), "RoPE table")?;
            gpu.upload(&table, &mut rope, 0)?;
            let heads_part = config.n_heads * (config.head_dim() + 2);
            let partial_len = if dtype == CudaDType::Bf16 {
                PARTIAL_TOKEN_SPLITS * heads_part
            } else {
                0
            };
            let scratch = Scratch {
                tokens: 0,
                rows: 0,
                x: gpu.alloc(0, "step buffers")?,
                xb: gpu.alloc_float(dt, 0, "step buffers")?,
                qkv: gpu.alloc(0, "step buffers")?,
                att: gpu.alloc_float(dt, 0, "step buffers")?,
                h13: gpu.alloc(0, "step buffers")?,
                hb: gpu.alloc_float(dt, 0, "step buffers")?,
                fin: gpu.alloc_float(dt, 0, "step buffers")?,
                logits: gpu.alloc(0, "step buffers")?,
                probs: gpu.alloc(0, "step buffers")?,
                result: gpu.alloc(0, "step buffers")?,
                partial: gpu.alloc(partial_len, "attention partials")?,
                kv_tables: gpu.alloc(2 * kv.blocks_for(config.max_seq_len), "copy_kv tables")?,
            };
            Ok((weights, pool, rope, scratch))
        };
        let (weights, pool, rope, scratch) = alloc().map_err(device_error)?;
        let geometry = StepGeometry {
            vocab_size: config.vocab_size,
            max_seq_len: config.max_seq_len,
            block_size: kv.block_size,
            num_blocks: kv.num_blocks,
            tile_tokens: StepGeometry::tile_tokens_for_group(group),
        };
        tracing::info!(
            device = %gpu.info().name,
            dtype = dtype.name(),
            weight_bytes = weights.bytes(),
            kv_bytes = pool.bytes(),
            "CUDA backend allocated"
        );
        Ok(CudaBackend {
            gpu,
            config: config.clone(),
            dims,
            kv,
            dtype,
            weights,
            pool,
            rope,
            builder: StepBuilder::new(geometry),
            step: DeviceStep::new(geometry),
            scratch,
            host_result: Vec::new(),
            host_row: Vec::new(),
            sampler: Sampler::new(),
            host_sampled: 0,
        })
    }

    /// Copies host weights into the (fused) device tensors.
    fn upload_weights(&mut self, w: &Weights) -> Result<(), CudaError> {
        let gpu = &self.gpu;
        let largest = w
            .token_embedding()
            .len()
            .max(w.layers().first().map_or(0, |l| l.w1.len()));
        let mut staging = gpu.alloc(
            if self.dtype == CudaDType::Bf16 {
                largest.min(UPLOAD_STAGING_ELEMS)
            } else {
                0
            },
            "upload staging",
        )?;
        let dw = &mut self.weights;
        gpu.upload_f32(
            w.token_embedding(),
            dw.embedding.buffer_mut(),
            0,
            &mut staging,
        )?;
        for (dl, hl) in dw.layers.iter_mut().zip(w.layers()) {
            gpu.upload(&hl.rms_att, &mut dl.rms_att, 0)?;
            gpu.upload(&hl.rms_ffn, &mut dl.rms_ffn, 0)?;
            let mut off = 0;
            for t in [&hl.wq, &hl.wk, &hl.wv] {
                gpu.upload_f32(t, dl.wqkv.buffer_mut(), off, &mut staging)?;
                off += t.len();
            }
            gpu.upload_f32(&hl.wo, dl.wo.buffer_mut(), 0, &mut staging)?;
            gpu.upload_f32(&hl.w1, dl.w13.buffer_mut(), 0, &mut staging)?;
            gpu.upload_f32(&hl.w3, dl.w13.buffer_mut(), hl.w1.len(), &mut staging)?;
            gpu.upload_f32(&hl.w2, dl.w2.buffer_mut(), 0, &mut staging)?;
        }
        gpu.upload(w.rms_final(), &mut dw.rms_final, 0)?;
        if let (Some(dc), true) = (dw.classifier.as_mut(), w.has_untied_classifier()) {
            gpu.upload_f32(w.classifier(), dc.buffer_mut(), 0, &mut staging)?;
        }
        gpu.synchronize()
    }

    /// Fills the device tensors with the dummy weights of `seed` (tensor numbering of
    /// `crate::dummy`: 0 embedding, `1 + 9l + j` layer tensors, `1 + 9L` final norm,
    /// `2 + 9L` classifier; norms exactly 1).
    fn generate_dummy(&mut self, seed: u64) -> Result<(), CudaError> {
        let c = &self.config;
        let gpu = &self.gpu;
        let sizes = layer_tensor_sizes(c);
        let sd = dummy_scale(c.dim);
        let sh = dummy_scale(c.hidden_dim);
        let dw = &mut self.weights;
        let n = dw.embedding.rows() * dw.embedding.cols();
        gpu.dummy_fill(dw.embedding.buffer_mut(), 0, n, seed, 0, 0, sd)?;
        for (l, dl) in dw.layers.iter_mut().enumerate() {
            let base = 1 + 9 * l as u32;
            gpu.fill_f32(&mut dl.rms_att, 1.0)?;
            gpu.fill_f32(&mut dl.rms_ffn, 1.0)?;
            // wq (1), wk (2), wv (3) stacked in wqkv.
            let mut off = 0;
            for j in 1..=3u32 {
                let len = sizes[j as usize];
                gpu.dummy_fill(dl.wqkv.buffer_mut(), off, len, seed, base + j, 0, sd)?;
                off += len;
            }
            gpu.dummy_fill(dl.wo.buffer_mut(), 0, sizes[4], seed, base + 4, 0, sd)?;
            // w1 (6) then w3 (8) stacked in w13; w2 (7).
            gpu.dummy_fill(dl.w13.buffer_mut(), 0, sizes[6], seed, base + 6, 0, sd)?;
            gpu.dummy_fill(
                dl.w13.buffer_mut(),
                sizes[6],
                sizes[8],
                seed,
                base + 8,
                0,
                sd,
            )?;
            gpu.dummy_fill(dl.w2.buffer_mut(), 0, sizes[7], seed, base + 7, 0, sh)?;
        }
        gpu.fill_f32(&mut dw.rms_final, 1.0)?;
        let last = 1 + 9 * c.n_layers as u32;
        if let Some(cls) = dw.classifier.as_mut() {
            let n = cls.rows() * cls.cols();
            gpu.dummy_fill(cls.buffer_mut(), 0, n, seed, last + 1, 0, sd)?;
        }
        gpu.synchronize()
    }

    /// The device in use.
    pub fn device(&self) -> &zerolayer_kernels::cuda::DeviceInfo {
        self.gpu.info()
    }

    /// The storage mode.
    pub fn dtype(&self) -> CudaDType {
        self.dtype
    }

    /// Bytes of weights on the device (what one decode step must read at least).
    pub fn weight_bytes(&self) -> u64 {
        self.weights.bytes()
    }

    /// Bytes of weights one decode step reads: every layer, the final norm and the classifier
    /// (the embedding table only through its one row, unless it is the classifier).
    pub fn weight_bytes_per_token(&self) -> u64 {
        let w = &self.weights;
        let mut b = w.classifier().bytes() + 4 * w.rms_final.len() as u64;
        for l in &w.layers {
            b += l.wqkv.bytes() + l.wo.bytes() + l.w13.bytes() + l.w2.bytes();
            b += 4 * (l.rms_att.len() + l.rms_ffn.len()) as u64;
        }
        b
    }

    /// Kernel launches and cuBLAS calls issued so far.
    pub fn launches(&self) -> u64 {
        self.gpu.launches()
    }

    /// Bytes of the KV pool.
    pub fn kv_bytes(&self) -> u64 {
        self.pool.bytes()
    }

    /// Logits rows the device could not sample exactly and left to the host sampler
    /// (identical result, slower; expected only for near-uniform distributions without a
    /// top-k/top-p cut over more than 4096 tokens, or a draw within 2⁻²⁴ of 1).
    pub fn host_sampled_rows(&self) -> u64 {
        self.host_sampled
    }

    /// Measured device-to-device copy bandwidth (bytes read + written per second).
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64, BackendError> {
        self.gpu.copy_bandwidth(bytes, reps).map_err(device_error)
    }

    /// Waits for all queued device work.
    pub fn synchronize(&self) -> Result<(), BackendError> {
        self.gpu.synchronize().map_err(device_error)
    }

    /// Samples given logits rows (`[W][vocab]`, `W = sampling.len()`) with the device sampler
    /// of [`Backend::forward_sample`], without running the model (for parity tests of the
    /// sampler and tools). The KV pool is not touched.
    pub fn sample_logits(
        &mut self,
        logits: &[f32],
        sampling: &[SampleInput<'_>],
        out: &mut [SampleOutcome],
    ) -> Result<(), BackendError> {
        let vocab = self.config.vocab_size;
        let rows = sampling.len();
        if logits.len() != rows * vocab {
            return Err(BackendError::BufferSize {
                what: "logits",
                expected: rows * vocab,
                actual: logits.len(),
            });
        }
        if rows == 0 {
            return check_sampling_sizes(0, 0, out.len());
        }
        // One single-token chunk per row (token 0 at position 0 in block 0): it gives the step
        // its logits rows; no forward pass runs, so the pool is never written.
        let table = [0u32];
        let chunks: Vec<SeqChunk<'_>> = (0..rows)
            .map(|_| SeqChunk {
                tokens: &[0],
                start_pos: 0,
                block_table: &table,
                want_logits: true,
            })
            .collect();
        self.stage(&chunks, Some(sampling), out.len())?;
        self.ensure_capacity(rows, rows).map_err(device_error)?;
        self.gpu
            .upload_step(&self.builder, &mut self.step)
            .map_err(device_error)?;
        self.gpu
            .upload(logits, &mut self.scratch.logits, 0)
            .map_err(device_error)?;
        self.sample_uploaded(sampling, out)
    }

    /// Samples the logits in `scratch.logits` for the uploaded step's sampling rows.
    fn sample_uploaded(
        &mut self,
        sampling: &[SampleInput<'_>],
        out: &mut [SampleOutcome],
    ) -> Result<(), BackendError> {
        let wanting = sampling.len();
        let s = &mut self.scratch;
        self.gpu
            .sample(&self.step, &mut s.logits, &mut s.probs, &mut s.result)
            .map_err(device_error)?;
        self.host_result.resize(2 * wanting, 0);
        self.gpu
            .download(&s.result, 0, &mut self.host_result)
            .map_err(device_error)?;
        let vocab = self.config.vocab_size;
        for (i, (o, input)) in out.iter_mut().zip(sampling).enumerate() {
            let (status, token) = (self.host_result[2 * i], self.host_result[2 * i + 1]);
            *o = match status {
                consts::SAMPLE_TOKEN if (token as usize) < vocab => SampleOutcome::Token(token),
                consts::SAMPLE_NOTHING_ALLOWED => SampleOutcome::NothingAllowed,
                consts::SAMPLE_HOST => {
                    self.host_row.resize(vocab, 0.0);
                    self.gpu
                        .download(&s.logits, i * vocab, &mut self.host_row)
                        .map_err(device_error)?;
                    self.host_sampled += 1;
                    tracing::debug!(
                        row = i,
                        "sampling row on the host (outside the device's exact prefix)"
                    );
                    self.sampler
                        .sample(&self.host_row, input)
                        .map_err(|e| match e {
                            SamplingError::BannedOutOfRange { token, vocab_size } => {
                                BackendError::BannedOutOfRange { token, vocab_size }
                            }
                            other => BackendError::InvalidConfig {
                                reason: other.to_string(),
                            },
                        })?
                }
                other => {
                    return Err(BackendError::Device {
                        kind: "sampling",
                        reason: format!(
                            "sample_rows returned status {other} with token {token} for row {i}"
                        ),
                    });
                }
            };
        }
        Ok(())
    }

    /// Validates the batch (and sampling rows) into the staging buffer; returns (tokens,
    /// rows wanting logits).
    fn stage(
        &mut self,
        batch: &[SeqChunk<'_>],
        sampling: Option<&[SampleInput<'_>]>,
        out_len: usize,
    ) -> Result<(usize, usize), BackendError> {
        if batch.is_empty() {
            return Err(BackendError::EmptyBatch);
        }
        let b = &mut self.builder;
        b.begin();
        for ch in batch {
            b.push_chunk(ch.tokens, ch.start_pos, ch.block_table, ch.want_logits)
                .map_err(step_error)?;
        }
        let wanting = batch.iter().filter(|c| c.want_logits).count();
        if let Some(sampling) = sampling {
            check_sampling_sizes(wanting, sampling.len(), out_len)?;
            for s in sampling {
                let p = s.params;
                b.push_sampling(
                    SampleRow {
                        temperature: p.temperature(),
                        top_k: p.top_k(),
                        top_p: p.top_p(),
                        uniform: s.uniform,
                    },
                    s.banned,
                )
                .map_err(step_error)?;
            }
        }
        let n_tok = b.finish().map_err(step_error)?.n_tokens;
        Ok((n_tok, wanting))
    }

    /// Grows the step buffers to `tokens` tokens and `rows` logits rows.
    fn ensure_capacity(&mut self, tokens: usize, rows: usize) -> Result<(), CudaError> {
        let (gpu, s, c) = (&self.gpu, &mut self.scratch, &self.config);
        let dt = self.dtype.dtype();
        if tokens > s.tokens {
            let t = tokens.next_power_of_two().max(MIN_TOKEN_CAPACITY);
            let (d, h) = (c.dim, c.hidden_dim);
            // Free before allocating, so growth never needs both sizes at once.
            s.tokens = 0;
            s.x = gpu.alloc(0, "step buffers")?;
            s.qkv = gpu.alloc(0, "step buffers")?;
            s.h13 = gpu.alloc(0, "step buffers")?;
            s.xb = gpu.alloc_float(dt, 0, "step buffers")?;
            s.att = gpu.alloc_float(dt, 0, "step buffers")?;
            s.hb = gpu.alloc_float(dt, 0, "step buffers")?;
            s.x = gpu.alloc(t * d, "step buffers")?;
            s.qkv = gpu.alloc(t * (d + 2 * c.kv_dim()), "step buffers")?;
            s.h13 = gpu.alloc(t * 2 * h, "step buffers")?;
            s.xb = gpu.alloc_float(dt, t * d, "step buffers")?;
            s.att = gpu.alloc_float(dt, t * d, "step buffers")?;
            s.hb = gpu.alloc_float(dt, t * h, "step buffers")?;
            s.tokens = t;
        }
        if rows > s.rows {
            let r = rows.next_power_of_two();
            let v = c.vocab_size;
            s.rows = 0;
            s.logits = gpu.alloc(0, "logits")?;
            s.probs = gpu.alloc(0, "logits")?;
            s.logits = gpu.alloc(r * v, "logits")?;
            s.probs = gpu.alloc(r * v, "sampling probabilities")?;
            s.fin = gpu.alloc_float(dt, r * c.dim, "logits")?;
            s.result = gpu.alloc(2 * r, "sampling results")?;
            s.rows = r;
        }
        Ok(())
    }

    /// Runs the staged step on the device: the forward pass up to the logits of the rows
    /// wanting them (left in `scratch.logits`).
    fn run(&mut self, n_tok: usize, wanting: usize) -> Result<(), CudaError> {
        self.ensure_capacity(n_tok, wanting)?;
        let gpu = &self.gpu;
        gpu.upload_step(&self.builder, &mut self.step)?;
        let (step, dims, s, w) = (&self.step, &self.dims, &mut self.scratch, &self.weights);
        let eps = self.config.norm_eps;
        gpu.embed(step, &w.embedding, &mut s.x)?;
        for (l, lw) in w.layers.iter().enumerate() {
            gpu.rmsnorm(&s.x, Rows::All(n_tok), &lw.rms_att, eps, &mut s.xb)?;
            gpu.matmul(&s.xb, n_tok, &lw.wqkv, &mut s.qkv, false)?;
            gpu.rope_append(step, dims, &mut s.qkv, &self.rope, &mut self.pool, l)?;
            gpu.attention(
                step,
                dims,
                &s.qkv,
                &self.pool,
                l,
                &mut s.att,
                &mut s.partial,
            )?;
            gpu.matmul(&s.att, n_tok, &lw.wo, &mut s.x, true)?;
            gpu.rmsnorm(&s.x, Rows::All(n_tok), &lw.rms_ffn, eps, &mut s.xb)?;
            gpu.matmul(&s.xb, n_tok, &lw.w13, &mut s.h13, false)?;
            gpu.swiglu(&s.h13, n_tok, dims.hidden_dim, &mut s.hb)?;
            gpu.matmul(&s.hb, n_tok, &lw.w2, &mut s.x, true)?;
        }
        if wanting > 0 {
            gpu.rmsnorm(&s.x, Rows::Logits(step), &w.rms_final, eps, &mut s.fin)?;
            gpu.matmul(&s.fin, wanting, w.classifier(), &mut s.logits, false)?;
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_config(&self) -> KvCacheConfig {
        self.kv
    }

    fn forward(&mut self, batch: &[SeqChunk<'_>], logits: &mut [f32]) -> Result<(), BackendError> {
        let (n_tok, wanting) = self.stage(batch, None, 0)?;
        let expected = wanting * self.config.vocab_size;
        if logits.len() != expected {
            return Err(BackendError::BufferSize {
                what: "logits",
                expected,
                actual: logits.len(),
            });
        }
        self.run(n_tok, wanting).map_err(device_error)?;
        self.gpu
            .download(&self.scratch.logits, 0, logits)
            .map_err(device_error)
    }

    fn forward_sample(
        &mut self,
        batch: &[SeqChunk<'_>],
        sampling: &[SampleInput<'_>],
        out: &mut [SampleOutcome],
    ) -> Result<(), BackendError> {
        let (n_tok, wanting) = self.stage(batch, Some(sampling), out.len())?;
        self.run(n_tok, wanting).map_err(device_error)?;
        if wanting == 0 {
            return self.synchronize();
        }
        self.sample_uploaded(sampling, out)
    }

    fn copy_kv(&mut self, src: &[u32], dst: &[u32], len: usize) -> Result<(), BackendError> {
        let kv = self.kv;
        kv.check_table(0, src, len)?;
        kv.check_table(1, dst, len)?;
        if len > self.config.max_seq_len {
            return Err(BackendError::ContextOverflow {
                chunk: 0,
                end: len,
                max_seq_len: self.config.max_seq_len,
            });
        }
        self.gpu
            .kv_copy(&mut self.pool, src, dst, len, &mut self.scratch.kv_tables)
            .map_err(device_error)
    }
}

/// A model loaded for the CUDA backend: the backend, its tokenizer and display name.
#[derive(Debug)]
pub struct CudaModel {
    /// The spec it was loaded from.
    pub name: String,
    /// The backend (weights on the device).
    pub backend: CudaBackend,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
}

/// How large the KV pool of [`load_cuda_model`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSize {
    /// Exactly this many blocks.
    Blocks(usize),
    /// As many blocks as fit in this many MiB (see [`kv_blocks_for_mib`]).
    Mib(usize),
}

/// Loads `spec` for the GPU: `dummy:NAME[@SEED]` is generated on the device (never in host
/// memory; byte-level tokenizer unless `tokenizer` is given), a llama2.c checkpoint is read on
/// the host and uploaded.
pub fn load_cuda_model(
    spec: &str,
    tokenizer: Option<&Path>,
    dtype: CudaDType,
    block_size: usize,
    kv: KvSize,
    ordinal: usize,
) -> Result<CudaModel, CudaLoadError> {
    let kv_config = |c: &ModelConfig| KvCacheConfig {
        block_size,
        num_blocks: match kv {
            KvSize::Blocks(n) => n,
            KvSize::Mib(mib) => kv_blocks_for_mib(c, block_size, dtype, mib),
        },
    };
    let (backend, vocab) = match parse_dummy_spec(spec)? {
        Some((config, seed)) => {
            let b = CudaBackend::from_dummy(&config, seed, dtype, kv_config(&config), ordinal)?;
            (b, config.vocab_size)
        }
        None => {
            let weights = load_checkpoint(Path::new(spec))?;
            let b = CudaBackend::new(&weights, kv_config(weights.config()), dtype, ordinal)?;
            (b, weights.config().vocab_size)
        }
    };
    let tok = tokenizer_for(spec, tokenizer, vocab)?;
    Ok(CudaModel {
        name: spec.to_string(),
        backend,
        tokenizer: Arc::new(tok),
    })
}

/// Loading a model onto the GPU failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaLoadError {
    /// The spec, checkpoint or tokenizer is invalid.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The device or backend could not be set up.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names_parse_and_print() {
        assert_eq!("bf16".parse::<CudaDType>(), Ok(CudaDType::Bf16));
        assert_eq!("f32".parse::<CudaDType>(), Ok(CudaDType::F32));
        assert!("fp8".parse::<CudaDType>().is_err());
        assert_eq!((CudaDType::Bf16.size(), CudaDType::F32.name()), (2, "f32"));
    }

    #[test]
    fn kv_blocks_fill_the_requested_memory_at_the_mode_width() {
        let c = ModelConfig::dummy("8b").unwrap();
        // 32 layers × 16 positions × 1024 × 2 (K, V) × 2 bytes = 2 MiB per block in bf16.
        assert_eq!(kv_blocks_for_mib(&c, 16, CudaDType::Bf16, 4096), 2048);
        assert_eq!(kv_blocks_for_mib(&c, 16, CudaDType::F32, 4096), 1024);
        assert_eq!(kv_blocks_for_mib(&c, 16, CudaDType::F32, 0), 1);
    }

    #[test]
    fn rope_table_has_a_cos_sin_pair_per_position_and_pair() {
        let c = ModelConfig::dummy("tiny").unwrap();
        let t = rope_table(&c);
        assert_eq!(t.len(), c.max_seq_len * c.head_dim());
        assert_eq!((t[0], t[1]), (1.0, 0.0));
        let hd = c.head_dim();
        let freq = 1.0f32 / c.rope_theta.powf(2.0 / hd as f32);
        assert_eq!(t[3 * hd + 2], (3.0 * freq).cos());
        assert_eq!(t[3 * hd + 3], (3.0 * freq).sin());
    }

    #[test]
    fn rejected_steps_map_to_the_cpu_backends_errors() {
        assert_eq!(step_error(StepError::EmptyBatch), BackendError::EmptyBatch);
        assert_eq!(
            step_error(StepError::BlockOutOfRange {
                chunk: 2,
                block: 9,
                num_blocks: 4
            }),
            BackendError::BlockOutOfRange {
                chunk: 2,
                block: 9,
                num_blocks: 4
            }
        );
        assert_eq!(
            step_error(StepError::SamplingRows {
                expected: 1,
                actual: 2
            }),
            BackendError::BufferSize {
                what: "sampling",
                expected: 1,
                actual: 2
            }
        );
        let e = device_error(CudaError::OutOfMemory {
            what: "KV pool (keys)",
            bytes: 7,
            message: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        });
        assert_eq!(
            e,
            BackendError::OutOfMemory {
                what: "KV pool (keys)",
                bytes: 7
            }
        );
        let e = device_error(CudaError::Launch {
            kernel: "attention_fast_bf16",
            message: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
        });
        assert_eq!(e.error_type(), "device");
        assert!(e.to_string().contains("attention_fast_bf16"), "{e}");
    }

    #[test]
    fn without_a_usable_gpu_construction_is_a_typed_device_error() {
        let c = ModelConfig::dummy("tiny").unwrap();
        let kv = KvCacheConfig {
            block_size: 16,
            num_blocks: 8,
        };
        match CudaBackend::from_dummy(&c, 0, CudaDType::Bf16, kv, 0) {
            Ok(b) => eprintln!("a GPU is present ({}); nothing to check", b.device().name),
            Err(e) => {
                assert!(
                    matches!(
                        e,
                        BackendError::Device {
                            kind: "library_missing" | "no_device",
                            ..
                        }
                    ),
                    "{e:?}"
                );
                eprintln!("as expected without a GPU: {e}");
            }
        }
        // Invalid pool geometry is reported before touching the device.
        let bad = KvCacheConfig {
            block_size: 0,
            num_blocks: 8,
        };
        assert!(matches!(
            CudaBackend::from_dummy(&c, 0, CudaDType::F32, bad, 0),
            Err(BackendError::InvalidConfig { .. })
        ));
    }
}
