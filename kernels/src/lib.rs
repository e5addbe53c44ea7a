//! Compute kernels: CPU SIMD primitives and CUDA kernels compiled with NVRTC.
