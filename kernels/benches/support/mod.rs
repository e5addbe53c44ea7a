//! Helpers shared by the kernels' benchmark and the `probe` example.

/// Deterministic pseudo-random data in [-1, 1].
pub fn data(len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 2654435761 + salt * 97) % 2001) as f32 - 1000.0) / 1000.0)
        .collect()
}

/// `y[m][n] = x[m][k] · w[n][k]ᵀ` with the gemm crate (w read as a column-major `[k][n]` matrix).
pub fn gemm_matmul(
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the pointers and strides describe the three slices exactly (row-major x and y,
    // w as its transpose) and the slices outlive the call.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        )
    }
}
