// Paged attention reading the engine's block tables. Query rows come from the qkv buffer
// ([q (dim) | k | v] per token, RoPE applied); keys and values from one layer's pool
// [num_blocks][block_size][kv_dim]. The new tokens' K/V rows are already in the pool
// (rope_append runs first), so one kernel serves decode tokens and prefill chunks: a query at
// position p attends to positions 0..=p of its own sequence (causal within the chunk).

// ---- exact f32 attention (the F32 mode): the CPU oracle's operation sequence ----
//
// One block per (token, query head); dynamic shared memory holds the token's pos+1 scores.
// scores[j] = dot(q, k_j) (lane scheme) / sqrt(head_dim); softmax: max (order-free),
// e = exp_f32(s - max), sum with the lane scheme, divide; out[d] = fmaf(p_j, v_j[d], out[d])
// for j increasing, from +0.
extern "C" __global__ void attention_exact_f32(const float* qkv, int qkv_stride, const float* kpool,
                                               const float* vpool, const u32* pos, const u32* tbl,
                                               const u32* tables, int n_heads, int n_kv_heads,
                                               int head_dim, int kv_dim, int block_size,
                                               float sqrt_hd, float* out, int out_stride) {
    extern __shared__ float sc[];
    __shared__ float red[32];
    __shared__ float sum_s;
    int t = blockIdx.x, h = blockIdx.y;
    int kvh = h / (n_heads / n_kv_heads);
    int n_pos = (int)pos[t] + 1;
    const u32* table = tables + tbl[t];
    const float* q = qkv + (u64)t * (u64)qkv_stride + (u64)h * (u64)head_dim;
    int hw = threadIdx.x >> 4, n_hw = blockDim.x >> 4;
    for (int j0 = 0; j0 < n_pos; j0 += n_hw) {
        int j = j0 + hw;
        int jj = j < n_pos ? j : n_pos - 1;
        const float* k = kpool + kv_row(table, jj, block_size, kv_dim) + (u64)kvh * (u64)head_dim;
        float s = dot16(q, k, head_dim);
        if ((threadIdx.x & 15) == 0 && j < n_pos) {
            sc[j] = s / sqrt_hd;
        }
    }
    __syncthreads();
    float mx = ZL_NEG_INF;
    for (int j = threadIdx.x; j < n_pos; j += blockDim.x) mx = fmaxf(mx, sc[j]);
    mx = block_max(mx, red);
    for (int j = threadIdx.x; j < n_pos; j += blockDim.x) sc[j] = exp_f32(sc[j] - mx);
    __syncthreads();
    if (threadIdx.x < 32) {
        float acc = 0.0f;
        for (int j = threadIdx.x & 15; j < n_pos; j += 16) acc = acc + sc[j];
        acc = reduce16(acc);
        if (threadIdx.x == 0) sum_s = acc;
    }
    __syncthreads();
    float s = sum_s;
    for (int j = threadIdx.x; j < n_pos; j += blockDim.x) sc[j] = sc[j] / s;
    __syncthreads();
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int j = 0; j < n_pos; j++) {
            const float* v = vpool + kv_row(table, j, block_size, kv_dim) + (u64)kvh * (u64)head_dim;
            o = fmaf(sc[j], v[d], o);
        }
        out[(u64)t * (u64)out_stride + (u64)h * (u64)head_dim + d] = o;
    }
}

// ---- fast attention over a bf16 pool (the Bf16 mode): tiled, online softmax, split-KV ----
//
// Grid (tiles, kv heads, splits). A tile is up to FA_MAX_ROWS / group consecutive tokens of one
// sequence ([token_start, n_tokens, pos0, table_offset] in `tiles`); the block computes all
// query heads of its KV head for those tokens (rows r = token * group + g), so each K/V row
// read from the pool serves every row of the tile. Split z covers positions
// [z * split_len, (z + 1) * split_len). With one split the block writes the normalised bf16
// output; otherwise it writes (m, l, acc[head_dim]) partials that attention_combine_bf16 merges.
// Requires head_dim <= FA_MAX_HD and rows <= FA_MAX_ROWS (checked by the host).

#define FA_KT 32
#define FA_WARPS 4
#define FA_MAX_ROWS 32
#define FA_ROWS_PER_WARP 8
#define FA_MAX_HD 128
#define FA_HD_CHUNKS 4

extern "C" __global__ void __launch_bounds__(128)
attention_fast_bf16(const float* qkv, int qkv_stride, const bf16_t* kpool, const bf16_t* vpool,
                    const u32* tiles, const u32* tables, int n_heads, int n_kv_heads, int head_dim,
                    int kv_dim, int block_size, float scale, int split_len, int n_splits,
                    bf16_t* out, int out_stride, float* partial) {
    extern __shared__ float smem[];
    int G = n_heads / n_kv_heads;
    const u32* tile = tiles + 4 * (u64)blockIdx.x;
    int tok0 = (int)tile[0], n_tok = (int)tile[1], pos0 = (int)tile[2];
    const u32* table = tables + tile[3];
    int kvh = blockIdx.y, z = blockIdx.z;
    int R = n_tok * G;
    int hd = head_dim;
    float* q_s = smem;                         // [R][hd]
    float* k_s = q_s + FA_MAX_ROWS * hd;       // [FA_KT][hd + 1] (padded: no bank conflicts)
    float* v_s = k_s + FA_KT * (hd + 1);       // [FA_KT][hd]
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int pos_end = pos0 + n_tok;
    int s0 = z * split_len;
    int s1 = min(s0 + split_len, pos_end);
    for (int idx = threadIdx.x; idx < R * hd; idx += blockDim.x) {
        int r = idx / hd, dd = idx % hd;
        int tl = r / G, g = r % G;
        q_s[idx] = qkv[(u64)(tok0 + tl) * (u64)qkv_stride + (u64)(kvh * G + g) * (u64)hd + dd];
    }
    float m[FA_ROWS_PER_WARP], l[FA_ROWS_PER_WARP], acc[FA_ROWS_PER_WARP][FA_HD_CHUNKS];
#pragma unroll
    for (int i = 0; i < FA_ROWS_PER_WARP; i++) {
        m[i] = ZL_NEG_INF;
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < FA_HD_CHUNKS; c++) acc[i][c] = 0.0f;
    }
    for (int kt0 = s0; kt0 < s1; kt0 += FA_KT) {
        int nk = min(FA_KT, s1 - kt0);
        __syncthreads();
        for (int idx = threadIdx.x; idx < nk * hd; idx += blockDim.x) {
            int j = idx / hd, dd = idx % hd;
            u64 a = kv_row(table, kt0 + j, block_size, kv_dim) + (u64)kvh * (u64)hd + dd;
            k_s[j * (hd + 1) + dd] = bf16_to_f32(kpool[a]);
            v_s[j * hd + dd] = bf16_to_f32(vpool[a]);
        }
        __syncthreads();
        // Scores: lane j holds key kt0 + j against every row of this warp (one K load per
        // dimension serves all of the warp's rows).
        float sc[FA_ROWS_PER_WARP];
#pragma unroll
        for (int i = 0; i < FA_ROWS_PER_WARP; i++) sc[i] = 0.0f;
        if (lane < nk) {
            const float* kr = k_s + lane * (hd + 1);
            for (int dd = 0; dd < hd; dd++) {
                float kv = kr[dd];
#pragma unroll
                for (int i = 0; i < FA_ROWS_PER_WARP; i++) {
                    int r = warp + FA_WARPS * i;
                    if (r < R) sc[i] = fmaf(q_s[r * hd + dd], kv, sc[i]);
                }
            }
        }
        // Online softmax per row (r < R is warp-uniform, so the shuffles see all lanes).
        float pe[FA_ROWS_PER_WARP];
#pragma unroll
        for (int i = 0; i < FA_ROWS_PER_WARP; i++) {
            pe[i] = 0.0f;
            int r = warp + FA_WARPS * i;
            if (r < R) {
                int pos_r = pos0 + r / G;
                float s = (lane < nk && kt0 + lane <= pos_r) ? sc[i] * scale : ZL_NEG_INF;
                float m_new = fmaxf(m[i], warp_max(s));
                if (m_new != ZL_NEG_INF) {
                    pe[i] = (s == ZL_NEG_INF) ? 0.0f : __expf(s - m_new);
                    float corr = (m[i] == ZL_NEG_INF) ? 0.0f : __expf(m[i] - m_new);
                    l[i] = l[i] * corr + warp_sum(pe[i]);
#pragma unroll
                    for (int c = 0; c < FA_HD_CHUNKS; c++) acc[i][c] *= corr;
                    m[i] = m_new;
                }
            }
        }
        // acc += p · V: one V load per key and dimension serves all of the warp's rows.
        for (int jj = 0; jj < nk; jj++) {
            float vv[FA_HD_CHUNKS];
#pragma unroll
            for (int c = 0; c < FA_HD_CHUNKS; c++) {
                int dd = lane + 32 * c;
                vv[c] = dd < hd ? v_s[jj * hd + dd] : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < FA_ROWS_PER_WARP; i++) {
                int r = warp + FA_WARPS * i;
                if (r < R) {
                    float pj = __shfl_sync(0xffffffffu, pe[i], jj);
#pragma unroll
                    for (int c = 0; c < FA_HD_CHUNKS; c++) acc[i][c] = fmaf(pj, vv[c], acc[i][c]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < FA_ROWS_PER_WARP; i++) {
        int r = warp + FA_WARPS * i;
        if (r < R) {
            int t = tok0 + r / G;
            int qh = kvh * G + r % G;
            if (n_splits == 1) {
                float inv = 1.0f / l[i];
#pragma unroll
                for (int c = 0; c < FA_HD_CHUNKS; c++) {
                    int dd = lane + 32 * c;
                    if (dd < hd) {
                        out[(u64)t * (u64)out_stride + (u64)qh * (u64)hd + dd] =
                            f32_to_bf16(acc[i][c] * inv);
                    }
                }
            } else {
                float* pp = partial + (((u64)t * (u64)n_heads + qh) * (u64)n_splits + z) * (u64)(hd + 2);
                if (lane == 0) {
                    pp[0] = m[i];
                    pp[1] = l[i];
                }
#pragma unroll
                for (int c = 0; c < FA_HD_CHUNKS; c++) {
                    int dd = lane + 32 * c;
                    if (dd < hd) pp[2 + dd] = acc[i][c];
                }
            }
        }
    }
}

// Merges the split partials of attention_fast_bf16: grid (tokens, query heads).
extern "C" __global__ void attention_combine_bf16(const float* partial, int n_heads, int head_dim,
                                                  int n_splits, bf16_t* out, int out_stride) {
    int t = blockIdx.x, h = blockIdx.y;
    u64 stride = (u64)(head_dim + 2);
    const float* base = partial + ((u64)t * (u64)n_heads + h) * (u64)n_splits * stride;
    float mx = ZL_NEG_INF;
    for (int z = 0; z < n_splits; z++) mx = fmaxf(mx, base[z * stride]);
    float l = 0.0f;
    for (int z = 0; z < n_splits; z++) {
        float mz = base[z * stride];
        if (mz != ZL_NEG_INF) l += base[z * stride + 1] * __expf(mz - mx);
    }
    for (int dd = threadIdx.x; dd < head_dim; dd += blockDim.x) {
        float o = 0.0f;
        for (int z = 0; z < n_splits; z++) {
            float mz = base[z * stride];
            if (mz != ZL_NEG_INF) o += base[z * stride + 2 + dd] * __expf(mz - mx);
        }
        out[(u64)t * (u64)out_stride + (u64)h * (u64)head_dim + dd] = f32_to_bf16(o / l);
    }
}
