// Paged KV cache kernels. A layer's pool is [num_blocks][block_size][kv_dim]; position p of a
// sequence lives in block table[p / block_size] at offset p % block_size (the CPU backend's
// layout and block ids).

// RoPE on the query and key parts of each qkv row ([q (dim) | k (kv_dim) | v (kv_dim)]), like
// the oracle (no fused multiply-add: v0' = v0*cos - v1*sin, v1' = v0*sin + v1*cos, with the
// host-computed (cos, sin) table [max_seq_len][head_dim/2][2]); then the rotated key and the
// value are stored in the pool at the token's position. The query is rotated in place.
template <typename TP>
__device__ void rope_append_impl(float* qkv, int qkv_stride, const float* rope, const u32* pos,
                                 const u32* tbl, const u32* tables, int dim, int kv_dim,
                                 int head_dim, int block_size, TP* kpool, TP* vpool) {
    int t = blockIdx.x;
    int p = (int)pos[t];
    float* row = qkv + (u64)t * (u64)qkv_stride;
    const float* cs = rope + (u64)p * (u64)head_dim;
    for (int i = threadIdx.x; i < dim / 2; i += blockDim.x) {
        int e = 2 * i;
        int j = e % head_dim;
        float fcr = cs[j], fci = cs[j + 1];
        float v0 = row[e], v1 = row[e + 1];
        row[e] = v0 * fcr - v1 * fci;
        row[e + 1] = v0 * fci + v1 * fcr;
    }
    u64 dst = kv_row(tables + tbl[t], p, block_size, kv_dim);
    const float* k = row + dim;
    const float* v = row + dim + kv_dim;
    for (int i = threadIdx.x; i < kv_dim / 2; i += blockDim.x) {
        int e = 2 * i;
        int j = e % head_dim;
        float fcr = cs[j], fci = cs[j + 1];
        float v0 = k[e], v1 = k[e + 1];
        st(kpool, dst + e, v0 * fcr - v1 * fci);
        st(kpool, dst + e + 1, v0 * fci + v1 * fcr);
    }
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        st(vpool, dst + i, v[i]);
    }
}

extern "C" __global__ void rope_append_f32(float* qkv, int qkv_stride, const float* rope,
                                           const u32* pos, const u32* tbl, const u32* tables,
                                           int dim, int kv_dim, int head_dim, int block_size,
                                           float* kpool, float* vpool) {
    rope_append_impl(qkv, qkv_stride, rope, pos, tbl, tables, dim, kv_dim, head_dim, block_size,
                     kpool, vpool);
}

extern "C" __global__ void rope_append_bf16(float* qkv, int qkv_stride, const float* rope,
                                            const u32* pos, const u32* tbl, const u32* tables,
                                            int dim, int kv_dim, int head_dim, int block_size,
                                            bf16_t* kpool, bf16_t* vpool) {
    rope_append_impl(qkv, qkv_stride, rope, pos, tbl, tables, dim, kv_dim, head_dim, block_size,
                     kpool, vpool);
}

// Copies positions 0..len of every layer's K and V rows from the blocks of `src` to those of
// `dst` (forking a sequence). Grid: (len, n_layers). `layer_stride` = elements per layer.
template <typename T>
__device__ void kv_copy_impl(T* kpool, T* vpool, const u32* src, const u32* dst,
                             u64 layer_stride, int block_size, int kv_dim) {
    int p = blockIdx.x;
    u64 base = (u64)blockIdx.y * layer_stride;
    u64 s = base + kv_row(src, p, block_size, kv_dim);
    u64 d = base + kv_row(dst, p, block_size, kv_dim);
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        kpool[d + i] = kpool[s + i];
        vpool[d + i] = vpool[s + i];
    }
}

extern "C" __global__ void kv_copy_f32(float* kpool, float* vpool, const u32* src, const u32* dst,
                                       u64 layer_stride, int block_size, int kv_dim) {
    kv_copy_impl(kpool, vpool, src, dst, layer_stride, block_size, kv_dim);
}

extern "C" __global__ void kv_copy_bf16(bf16_t* kpool, bf16_t* vpool, const u32* src,
                                        const u32* dst, u64 layer_stride, int block_size,
                                        int kv_dim) {
    kv_copy_impl(kpool, vpool, src, dst, layer_stride, block_size, kv_dim);
}
