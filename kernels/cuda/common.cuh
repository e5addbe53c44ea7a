// Shared device helpers, prepended to every module by the host (NVRTC gets no include path:
// this file and the module sources use no include directives at all).
//
// Arithmetic contract: modules are compiled with --fmad=false (and NVRTC's defaults
// --prec-div=true, --prec-sqrt=true, --ftz=false), so every `a * b + c` rounds twice exactly
// like the CPU oracle, and the only fused multiply-adds are the explicit fmaf() calls that
// mirror the CPU's mul_add. That is what lets the exact (f32) kernels reproduce
// zerolayer_kernels::cpu bit for bit.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

// ---- bf16 <-> f32 (bf16 is the upper half of an f32) ----

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest, ties to even (like half::bf16::from_f32); NaN stays a quiet NaN.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x0040u);
    }
    u32 rounding = 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)((u + rounding) >> 16);
}

__device__ __forceinline__ float ld(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, u64 i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void st(float* p, u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t* p, u64 i, float v) { p[i] = f32_to_bf16(v); }

// ---- the CPU oracle's exp (zerolayer_kernels::cpu::exp_f32), constants as f32 bit patterns ----

#define ZL_EXP_HI __uint_as_float(0x42b00000u)   /* 88.0 */
#define ZL_EXP_LO __uint_as_float(0xc2aeac50u)   /* -87.33655 */
#define ZL_LOG2E __uint_as_float(0x3fb8aa3bu)    /* log2(e) */
#define ZL_LN2_HI __uint_as_float(0x3f318000u)   /* 0.6933594 */
#define ZL_LN2_LO __uint_as_float(0xb95e8083u)   /* -2.1219444e-4 */
#define ZL_EXP_P0 __uint_as_float(0x39506967u)   /* 1.9875691e-4 */
#define ZL_EXP_P1 __uint_as_float(0x3ab743ceu)   /* 1.3981999e-3 */
#define ZL_EXP_P2 __uint_as_float(0x3c088908u)   /* 8.333452e-3 */
#define ZL_EXP_P3 __uint_as_float(0x3d2aa9c1u)   /* 4.1665796e-2 */
#define ZL_EXP_P4 __uint_as_float(0x3e2aaaaau)   /* 1.6666666e-1 */
#define ZL_EXP_P5 __uint_as_float(0x3f000000u)   /* 0.5 */
#define ZL_TWO_M24 __uint_as_float(0x33800000u)  /* 2^-24 */

__device__ __forceinline__ float exp_f32(float x) {
    x = fminf(x, ZL_EXP_HI);
    if (x < ZL_EXP_LO) {
        return 0.0f;
    }
    float n = rintf(x * ZL_LOG2E);
    float r = fmaf(n, -ZL_LN2_HI, x);
    r = fmaf(n, -ZL_LN2_LO, r);
    float p = ZL_EXP_P0;
    p = fmaf(p, r, ZL_EXP_P1);
    p = fmaf(p, r, ZL_EXP_P2);
    p = fmaf(p, r, ZL_EXP_P3);
    p = fmaf(p, r, ZL_EXP_P4);
    p = fmaf(p, r, ZL_EXP_P5);
    float y = fmaf(p, r * r, r) + 1.0f;
    return y * __int_as_float((((int)n) + 127) << 23);
}

// ---- the CPU oracle's 16-lane reduction scheme ----

// reduce16 (t[i] = s[i] + s[i+8], u[i] = t[i] + t[i+4], v = u[0]+u[2], u[1]+u[3], r = v0 + v1)
// over the 16 lanes of each half-warp; the result is valid in lane 0 of each half-warp.
// Every lane of the warp must call it.
__device__ __forceinline__ float reduce16(float s) {
    s = s + __shfl_down_sync(0xffffffffu, s, 8, 16);
    s = s + __shfl_down_sync(0xffffffffu, s, 4, 16);
    s = s + __shfl_down_sync(0xffffffffu, s, 2, 16);
    s = s + __shfl_down_sync(0xffffffffu, s, 1, 16);
    return s;
}

// The oracle's dot product computed by one half-warp: lane l = threadIdx.x & 15 accumulates
// a[k]*b[k] for k = l, l+16, ... with fmaf from +0, then reduce16. Valid in lane 0 of the
// half-warp; every lane of the warp must call it.
template <typename TA, typename TB>
__device__ __forceinline__ float dot16(const TA* a, const TB* b, int n) {
    int lane = threadIdx.x & 15;
    float acc = 0.0f;
    for (int k = lane; k < n; k += 16) {
        acc = fmaf(ld(a, k), ld(b, k), acc);
    }
    return reduce16(acc);
}

// ---- plain warp / block reductions (order-free uses only: max, counts) ----

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

// Block-wide max; `scratch` holds at least 32 floats. Every thread gets the result.
__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = -__int_as_float(0x7f800000);
    for (int i = 0; i < warps; i++) r = fmaxf(r, scratch[i]);
    __syncthreads();
    return r;
}

// Block-wide sum of unsigned counts. Every thread gets the result.
__device__ u32 block_count(u32 v, u32* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int warps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    u32 r = 0;
    for (int i = 0; i < warps; i++) r += scratch[i];
    __syncthreads();
    return r;
}

#define ZL_NEG_INF (-__int_as_float(0x7f800000))

// Position `p` of a sequence whose block table starts at `table` -> element offset of its
// K/V row in one layer's pool [num_blocks][block_size][kv_dim].
__device__ __forceinline__ u64 kv_row(const u32* table, int p, int block_size, int kv_dim) {
    u64 block = table[p / block_size];
    return (block * (u64)block_size + (u64)(p % block_size)) * (u64)kv_dim;
}
