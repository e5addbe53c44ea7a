// The exact f32 projection (the F32 "upcast" mode): y[r][c] = dot(x[r], w[c]) with the CPU
// oracle's lane scheme (lane l accumulates k = l (mod 16) with fmaf from +0, then reduce16),
// so every output element is bit-identical to zerolayer_kernels::cpu::CpuKernels::matmul
// whatever the number of rows. With `accumulate`, y[r][c] = y[r][c] + dot(..) (one rounding),
// which is the oracle's residual add `x += matmul(..)`.
//
// One half-warp per output element; blockDim.x is a multiple of 32; grid.x covers the output
// columns in groups of blockDim.x / 16, grid.y strides over rows.
extern "C" __global__ void matmul_exact_f32(const float* x, const float* w, float* y, int m, int n,
                                            int k, int accumulate) {
    int col = blockIdx.x * (blockDim.x >> 4) + (threadIdx.x >> 4);
    // Columns past the end compute a duplicate of the last column (every lane of a warp must
    // take part in the shuffles) and store nothing.
    int c = col < n ? col : n - 1;
    for (int r = blockIdx.y; r < m; r += gridDim.y) {
        float d = dot16(x + (u64)r * (u64)k, w + (u64)c * (u64)k, k);
        if ((threadIdx.x & 15) == 0 && col < n) {
            u64 o = (u64)r * (u64)n + (u64)col;
            y[o] = accumulate ? y[o] + d : d;
        }
    }
}
