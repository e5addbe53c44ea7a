//! CUDA kernels compiled at run time with NVRTC, cuBLAS GEMMs, and safe wrappers for every
//! launch. Builds and links on machines without CUDA (cudarc loads the libraries dynamically);
//! every entry point returns a typed [`CudaError`] when the driver, a device, NVRTC or cuBLAS
//! is missing.
//!
//! # Layout
//! - `kernels/cuda/*.cu` (embedded by [`source`]): the CUDA C sources; `common.cuh` is
//!   prepended to each module. No `#include`s.
//! - [`source`]: the module/kernel registry (a missing kernel names itself in the error).
//! - [`nvrtc`]: library checks, NVRTC compilation for the device's `sm_XX`, once per process.
//! - [`host`]: GPU-free logic: bf16 conversions, the validated per-step staging buffer, the
//!   split-KV plan.
//! - [`device`]: [`Gpu`] (context, stream, kernels, cuBLAS) and its bounds-checked launch
//!   wrappers, device buffers, the KV pool.
//!
//! # Two arithmetic modes
//! - **f32 (exact)**: f32 weights, activations and KV; projections with the oracle's 16-lane
//!   scheme (`matmul_exact_f32`), exact attention, and every element-wise kernel with the
//!   oracle's operation sequence, compiled with `--fmad=false`. Results are meant to be
//!   bit-identical to `zerolayer_kernels::cpu` (and hence batch-invariant).
//! - **bf16 (fast)**: bf16 weights, GEMM inputs and KV pool; cuBLAS GEMMs with f32
//!   accumulation and output; a tiled split-KV attention with online softmax. Close to the
//!   oracle (bf16 tolerance), not bitwise, and cuBLAS may pick a different reduction order for
//!   a different number of rows: results depend on batching at rounding level.
//!
//! Sampling is exact in both modes (it works on f32 logits).

pub mod device;
pub mod error;
pub mod host;
pub mod nvrtc;
pub mod source;

pub use device::{
    DType, DeviceBuffer, DeviceElem, DeviceInfo, DeviceStep, FloatBuffer, Gpu, KvPool, Matrix,
    ModelDims, Rows, SYNC_EACH_LAUNCH_ENV, bf16, fast_attention_smem,
};
pub use error::CudaError;
pub use host::{
    SampleRow, SplitPlan, StepBuilder, StepError, StepGeometry, StepLayout, bf16_bits_to_f32,
    f32_to_bf16_bits, plan_splits,
};
pub use nvrtc::{
    CompiledModule, CudaLibrary, NVRTC_LIB_ENV, compile_module, compiled_modules, ensure_library,
    nvrtc_version,
};
pub use source::consts;
