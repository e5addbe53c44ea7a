//! Compute kernels: CPU SIMD primitives (`cpu`) and CUDA kernels compiled with NVRTC (`cuda`).
//!
//! # Layout
//! - [`cpu`]: f32 kernels for the CPU backend (matmul, mat-vec, attention pieces, norms) with
//!   AVX-512, AVX2+FMA and portable scalar paths that produce **bit-identical** results.
//! - [`cuda`]: CUDA C kernels (`kernels/cuda/*.cu`) compiled at run time for the device, cuBLAS
//!   GEMMs and safe launch wrappers; loads the CUDA libraries dynamically, so it builds and
//!   fails cleanly (typed errors) on machines without CUDA.

pub mod cpu;
pub mod cuda;
