//! Compute kernels: CPU SIMD primitives (`cpu`) and, later, CUDA kernels compiled with NVRTC.
//!
//! # Layout
//! - [`cpu`]: f32 kernels for the CPU backend (matmul, mat-vec, attention pieces, norms) with
//!   AVX-512, AVX2+FMA and portable scalar paths that produce **bit-identical** results.

pub mod cpu;
