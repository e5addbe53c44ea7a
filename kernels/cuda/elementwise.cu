// Element-wise and row-wise kernels: embedding gather, RMSNorm, SiLU x mul (SwiGLU), casts,
// fills and the on-device dummy-weight generator. Every kernel follows the CPU oracle's
// documented operation sequence (zerolayer_kernels::cpu), so with f32 data the results are
// bit-identical to the CPU backend.

// x[t][i] = table[tokens[t]][i].
template <typename T>
__device__ void embed_impl(const T* table, const u32* tokens, int dim, float* x) {
    int t = blockIdx.x;
    u64 src = (u64)tokens[t] * (u64)dim;
    u64 dst = (u64)t * (u64)dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        x[dst + i] = ld(table, src + i);
    }
}

extern "C" __global__ void embed_f32(const float* table, const u32* tokens, int dim, float* x) {
    embed_impl(table, tokens, dim, x);
}

extern "C" __global__ void embed_bf16(const bf16_t* table, const u32* tokens, int dim, float* x) {
    embed_impl(table, tokens, dim, x);
}

// RMSNorm like llama2.c and the CPU oracle: ss = dot(x, x) (lane scheme), inv = 1 / sqrt(ss / n
// + eps), out[i] = w[i] * (inv * x[i]). One block per output row; input row `rows[r]` when
// `use_rows` (the final norm of the rows that want logits), else row r.
template <typename TO>
__device__ void rmsnorm_impl(const float* x, const float* w, const u32* rows, int use_rows,
                             int dim, float eps, TO* out) {
    __shared__ float inv_s;
    int r = blockIdx.x;
    u64 src = (u64)(use_rows ? rows[r] : (u32)r) * (u64)dim;
    const float* xr = x + src;
    if (threadIdx.x < 32) {
        float ss = dot16(xr, xr, dim);
        if (threadIdx.x == 0) {
            float m = ss / (float)dim + eps;
            inv_s = 1.0f / sqrtf(m);
        }
    }
    __syncthreads();
    float inv = inv_s;
    u64 dst = (u64)r * (u64)dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        st(out, dst + i, w[i] * (inv * xr[i]));
    }
}

extern "C" __global__ void rmsnorm_to_f32(const float* x, const float* w, const u32* rows,
                                          int use_rows, int dim, float eps, float* out) {
    rmsnorm_impl(x, w, rows, use_rows, dim, eps, out);
}

extern "C" __global__ void rmsnorm_to_bf16(const float* x, const float* w, const u32* rows,
                                           int use_rows, int dim, float eps, bf16_t* out) {
    rmsnorm_impl(x, w, rows, use_rows, dim, eps, out);
}

// SwiGLU like the oracle: h13 rows are [gate (hidden) | up (hidden)];
// out[r][i] = (a * (1 / (1 + exp(-a)))) * b with a = gate, b = up.
template <typename TO>
__device__ void swiglu_impl(const float* h13, u64 n_rows, int hidden, TO* out) {
    u64 total = n_rows * (u64)hidden;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (u64)gridDim.x * blockDim.x) {
        u64 r = idx / (u64)hidden;
        u64 i = idx % (u64)hidden;
        float a = h13[r * 2 * (u64)hidden + i];
        float b = h13[r * 2 * (u64)hidden + (u64)hidden + i];
        float s = 1.0f / (1.0f + exp_f32(-a));
        st(out, idx, (a * s) * b);
    }
}

extern "C" __global__ void swiglu_to_f32(const float* h13, u64 n_rows, int hidden, float* out) {
    swiglu_impl(h13, n_rows, hidden, out);
}

extern "C" __global__ void swiglu_to_bf16(const float* h13, u64 n_rows, int hidden, bf16_t* out) {
    swiglu_impl(h13, n_rows, hidden, out);
}

extern "C" __global__ void cast_f32_to_bf16(const float* src, u64 n, bf16_t* dst) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dst[i] = f32_to_bf16(src[i]);
    }
}

extern "C" __global__ void cast_bf16_to_f32(const bf16_t* src, u64 n, float* dst) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dst[i] = bf16_to_f32(src[i]);
    }
}

extern "C" __global__ void fill_f32(float* dst, u64 n, float value) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dst[i] = value;
    }
}

// SplitMix64's output function (zerolayer_model::splitmix64).
__device__ __forceinline__ u64 splitmix64(u64 x) {
    u64 z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// zerolayer_model::dummy_weight: h = splitmix64(seed ^ splitmix64((tensor << 48) ^ element)),
// u = (h >> 40) * 2^-24, result u * 2 - 1 (all exact), then one multiply by `scale`.
__device__ __forceinline__ float dummy_value(u64 seed, u32 tensor, u64 element, float scale) {
    u64 h = splitmix64(seed ^ splitmix64((((u64)tensor) << 48) ^ element));
    float u = (float)(h >> 40) * ZL_TWO_M24;
    float w = u * 2.0f - 1.0f;
    return w * scale;
}

// dst[i] = dummy_weight(seed, tensor, element0 + i) * scale for i < n.
extern "C" __global__ void dummy_fill_f32(float* dst, u64 n, u64 seed, u32 tensor, u64 element0,
                                          float scale) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dst[i] = dummy_value(seed, tensor, element0 + i, scale);
    }
}

extern "C" __global__ void dummy_fill_bf16(bf16_t* dst, u64 n, u64 seed, u32 tensor, u64 element0,
                                           float scale) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dst[i] = f32_to_bf16(dummy_value(seed, tensor, element0 + i, scale));
    }
}
