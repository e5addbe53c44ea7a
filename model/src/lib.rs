//! Llama models on CPU: loaders, tokenizer, sampling and the backend trait.
//!
//! # Layout
//! - [`config`]: [`ModelConfig`] and the named dummy configurations.
//! - [`weights`]: [`Weights`] (validated f32 host tensors, row-major `[out][in]`).
//! - [`llama2c`], [`dummy`], [`load`]: checkpoint reader, deterministic dummy weights,
//!   [`load_model`] for `dummy:NAME[@SEED]` or a file path.
//! - [`tokenizer`]: llama2.c tokenizer (and the byte-level one of dummy models), chat rendering.
//! - [`sampling`]: exactly specified greedy/temperature/top-k/top-p sampling, counter-based RNG.
//! - [`backend`]: the [`Backend`] trait the engine drives, [`SeqChunk`], [`KvCacheConfig`].
//! - [`cpu`]: [`CpuBackend`], the f32 oracle, batch-invariant bit for bit.
//! - [`cuda`]: [`CudaBackend`] (NVRTC-compiled kernels, cuBLAS; bf16 or exact f32).
//! - [`generate`](mod@generate): a single-sequence generation loop for the CLI and tests.
//! - [`bench`](mod@bench): read-bandwidth probe and prefill/decode measurements (`zerolayer bench model`).

pub mod backend;
pub mod bench;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod dummy;
pub mod error;
pub mod generate;
pub mod llama2c;
pub mod load;
pub mod sampling;
pub mod tokenizer;
pub mod weights;

pub use backend::{Backend, KvCacheConfig, SeqChunk};
pub use config::ModelConfig;
pub use cpu::CpuBackend;
pub use cuda::{CudaBackend, CudaDType};
pub use dummy::{DEFAULT_DUMMY_SEED, dummy_scale, dummy_weight, dummy_weights, splitmix64};
pub use error::{BackendError, ModelError};
pub use generate::{FinishReason, GenerateError, GenerateOptions, GenerateOutcome, generate};
pub use load::{Model, load_model};
pub use sampling::{
    SampleInput, SampleOutcome, Sampler, SamplingError, SamplingParams, sample_uniform,
};
pub use tokenizer::Tokenizer;
pub use weights::{LayerWeights, Weights};
