// Logits processing and sampling on the device, reproducing zerolayer_model::sampling's exactly
// specified procedure so that the GPU picks the token the CPU Sampler would pick from the same
// logits and uniform draw. One block of SAMPLE_THREADS threads per row.
//
// 1. Safety mask: logits of the row's banned ids become -inf (a token is allowed iff its logit
//    is > -inf, which also excludes NaN).
// 2. temperature == 0: the allowed token with the largest logit, ties -> lowest id.
// 3. Otherwise s = logit / T, m = max s, e = exp_f32(s - m) (0 if not allowed), S = lane-scheme
//    sum of e over the vocabulary in id order, p = e / S (written to `probs`).
// 4. The order (p descending, id ascending) is known exactly for the first n_cand <= SAMPLE_CAP
//    allowed tokens: all of them when they fit, else the SAMPLE_CAP first found by a radix
//    select on the order key, then sorted in shared memory (bitonic).
// 5. One thread runs the top-k cut, the top-p walk, T = sum of the kept p in order and the pick
//    walk exactly like the CPU. When the kept set reaches past the known prefix, the prefix sum
//    c is final only if it is frozen: fl(c + p_out) == c for the largest p outside the prefix
//    (rounding is monotone, so every later addition leaves c unchanged too). Otherwise, and in
//    the 2^-24-rare case where the pick walk falls through past the prefix, the row's status is
//    SAMPLE_HOST and the host samples that row from the (masked) logits with the CPU Sampler.
//
// result[2 * row] = status (SAMPLE_TOKEN, SAMPLE_NOTHING_ALLOWED, SAMPLE_HOST),
// result[2 * row + 1] = token. params: 6 words per row: temperature bits, top_k, top_p bits,
// uniform bits, banned offset, banned count.

#define SAMPLE_CAP 4096
#define SAMPLE_THREADS 1024
#define SAMPLE_TOKEN 0u
#define SAMPLE_NOTHING_ALLOWED 1u
#define SAMPLE_HOST 2u
#define P_KEY_BASE 0x7f800000u

__device__ __forceinline__ u32 desc_key(float p) { return P_KEY_BASE - __float_as_uint(p); }
__device__ __forceinline__ float key_p(u64 key) { return __uint_as_float(P_KEY_BASE - (u32)(key >> 32)); }

extern "C" __global__ void __launch_bounds__(1024)
sample_rows(float* logits, int vocab_i, const u32* params, const u32* banned, float* probs,
            u32* result) {
    __shared__ u64 keys[SAMPLE_CAP];
    __shared__ u32 hist[256];
    __shared__ u32 red_u[32];
    __shared__ float red_f[32];
    __shared__ u32 bc[8];
    __shared__ float bcf[2];
    u32 vocab = (u32)vocab_i;
    u32 row = blockIdx.x;
    u32 tid = threadIdx.x;
    u32 lane = tid & 31, warp = tid >> 5, n_warps = blockDim.x >> 5;
    float* lg = logits + (u64)row * vocab;
    float* pr = probs + (u64)row * vocab;
    const u32* prm = params + 6 * (u64)row;
    float temp = __uint_as_float(prm[0]);
    u32 top_k = prm[1];
    float top_p = __uint_as_float(prm[2]);
    float uni = __uint_as_float(prm[3]);
    u32 boff = prm[4], blen = prm[5];

    for (u32 j = tid; j < blen; j += blockDim.x) lg[banned[boff + j]] = ZL_NEG_INF;
    __syncthreads();

    if (temp == 0.0f) {
        float bv = ZL_NEG_INF;
        u32 bi = 0xffffffffu;
        for (u32 i = tid; i < vocab; i += blockDim.x) {
            float v = lg[i];
            if (v > ZL_NEG_INF && v > bv) {
                bv = v;
                bi = i;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            u32 oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            red_f[warp] = bv;
            red_u[warp] = bi;
        }
        __syncthreads();
        if (tid == 0) {
            for (u32 w = 1; w < n_warps; w++) {
                if (red_f[w] > bv || (red_f[w] == bv && red_u[w] < bi)) {
                    bv = red_f[w];
                    bi = red_u[w];
                }
            }
            result[2 * row] = bi == 0xffffffffu ? SAMPLE_NOTHING_ALLOWED : SAMPLE_TOKEN;
            result[2 * row + 1] = bi == 0xffffffffu ? 0u : bi;
        }
        return;
    }

    // 3. probabilities.
    float mx = ZL_NEG_INF;
    u32 cnt = 0;
    for (u32 i = tid; i < vocab; i += blockDim.x) {
        float v = lg[i];
        if (v > ZL_NEG_INF) {
            mx = fmaxf(mx, v / temp);
            cnt++;
        }
    }
    mx = block_max(mx, red_f);
    u32 n_allowed = block_count(cnt, red_u);
    if (n_allowed == 0) {
        if (tid == 0) {
            result[2 * row] = SAMPLE_NOTHING_ALLOWED;
            result[2 * row + 1] = 0u;
        }
        return;
    }
    for (u32 i = tid; i < vocab; i += blockDim.x) {
        float v = lg[i];
        pr[i] = v > ZL_NEG_INF ? exp_f32(v / temp - mx) : 0.0f;
    }
    __syncthreads();
    if (tid < 32) {
        float acc = 0.0f;
        for (u32 i = tid & 15; i < vocab; i += 16) acc = acc + pr[i];
        acc = reduce16(acc);
        if (tid == 0) bcf[0] = acc;
    }
    __syncthreads();
    float total = bcf[0];
    for (u32 i = tid; i < vocab; i += blockDim.x) pr[i] = pr[i] / total;
    __syncthreads();

    // 4. the known prefix of the order.
    u32 n_cand;
    float p_out = -1.0f;
    if (tid == 0) bc[0] = 0;
    __syncthreads();
    if (n_allowed <= SAMPLE_CAP) {
        for (u32 i = tid; i < vocab; i += blockDim.x) {
            if (lg[i] > ZL_NEG_INF) {
                u32 slot = atomicAdd(&bc[0], 1u);
                keys[slot] = ((u64)desc_key(pr[i]) << 32) | i;
            }
        }
        n_cand = n_allowed;
    } else {
        // Radix select of the SAMPLE_CAP-th smallest 32-bit key d (p descending).
        u32 prefix = 0, mask = 0, need = SAMPLE_CAP, less = 0, eq_total = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (u32 b = tid; b < 256; b += blockDim.x) hist[b] = 0;
            __syncthreads();
            for (u32 i = tid; i < vocab; i += blockDim.x) {
                if (lg[i] > ZL_NEG_INF) {
                    u32 d = desc_key(pr[i]);
                    if ((d & mask) == prefix) atomicAdd(&hist[(d >> shift) & 255u], 1u);
                }
            }
            __syncthreads();
            if (tid == 0) {
                u32 cum = 0, b = 0;
                for (; b < 255; b++) {
                    if (cum + hist[b] >= need) break;
                    cum += hist[b];
                }
                bc[1] = b;
                bc[2] = cum;
                bc[3] = hist[b];
            }
            __syncthreads();
            u32 b = bc[1], cum = bc[2];
            eq_total = bc[3];
            need -= cum;
            less += cum;
            prefix |= b << shift;
            mask |= 0xffu << shift;
            __syncthreads();
        }
        u32 dstar = prefix;
        // Everything strictly before d* (fewer than SAMPLE_CAP), in any order.
        for (u32 i = tid; i < vocab; i += blockDim.x) {
            if (lg[i] > ZL_NEG_INF) {
                u32 d = desc_key(pr[i]);
                if (d < dstar) {
                    u32 slot = atomicAdd(&bc[0], 1u);
                    keys[slot] = ((u64)d << 32) | i;
                }
            }
        }
        __syncthreads();
        // Then the `need` lowest ids with key d*, scanning in id order.
        u32 taken = 0;
        for (u32 base = 0; base < vocab && taken < need; base += blockDim.x) {
            u32 i = base + tid;
            bool f = i < vocab && lg[i] > ZL_NEG_INF && desc_key(pr[i]) == dstar;
            u32 ballot = __ballot_sync(0xffffffffu, f);
            u32 rank_in_warp = __popc(ballot & ((1u << lane) - 1u));
            if (lane == 0) red_u[warp] = __popc(ballot);
            __syncthreads();
            u32 before = 0, all = 0;
            for (u32 w = 0; w < n_warps; w++) {
                if (w < warp) before += red_u[w];
                all += red_u[w];
            }
            u32 rank = taken + before + rank_in_warp;
            if (f && rank < need) keys[less + rank] = ((u64)dstar << 32) | i;
            taken += all;
            __syncthreads();
        }
        n_cand = SAMPLE_CAP;
        if (eq_total > need) {
            p_out = __uint_as_float(P_KEY_BASE - dstar);
        } else {
            float po = -1.0f;
            for (u32 i = tid; i < vocab; i += blockDim.x) {
                if (lg[i] > ZL_NEG_INF && desc_key(pr[i]) > dstar) po = fmaxf(po, pr[i]);
            }
            p_out = block_max(po, red_f);
        }
    }
    __syncthreads();

    // Bitonic sort of the prefix (ascending key = p descending, id ascending).
    u32 n_sort = 1;
    while (n_sort < n_cand) n_sort <<= 1;
    for (u32 i = n_cand + tid; i < n_sort; i += blockDim.x) keys[i] = 0xffffffffffffffffull;
    __syncthreads();
    for (u32 k = 2; k <= n_sort; k <<= 1) {
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = tid; i < n_sort; i += blockDim.x) {
                u32 ixj = i ^ j;
                if (ixj > i) {
                    u64 a = keys[i], b = keys[ixj];
                    bool up = (i & k) == 0;
                    if ((a > b) == up) {
                        keys[i] = b;
                        keys[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }

    // 5. cuts and pick (one thread, the CPU's sequential f32 accumulations).
    if (tid != 0) return;
    u32 kept_k = (top_k > 0 && top_k < n_allowed) ? top_k : n_allowed;
    u32 lim = kept_k < n_cand ? kept_k : n_cand;
    u32 status = SAMPLE_TOKEN;
    u32 kept = kept_k;
    if (top_p < 1.0f) {
        float c = 0.0f;
        bool cut = false;
        for (u32 j = 0; j < lim; j++) {
            c += key_p(keys[j]);
            if (c >= top_p) {
                kept = j + 1;
                cut = true;
                break;
            }
        }
        if (!cut && kept_k > n_cand && !(c + p_out == c)) status = SAMPLE_HOST;
    }
    float t_sum = 0.0f;
    u32 known = kept < n_cand ? kept : n_cand;
    for (u32 j = 0; j < known; j++) t_sum += key_p(keys[j]);
    if (kept > n_cand && !(t_sum + p_out == t_sum)) status = SAMPLE_HOST;
    u32 token = 0;
    if (status == SAMPLE_TOKEN) {
        float r = uni * t_sum;
        float c = 0.0f;
        bool found = false;
        for (u32 j = 0; j < known; j++) {
            c += key_p(keys[j]);
            if (r < c) {
                token = (u32)keys[j];
                found = true;
                break;
            }
        }
        if (!found) {
            if (kept > n_cand) {
                status = SAMPLE_HOST;
            } else {
                token = (u32)keys[0];
                for (u32 j = known; j > 0; j--) {
                    if (key_p(keys[j - 1]) > 0.0f) {
                        token = (u32)keys[j - 1];
                        break;
                    }
                }
            }
        }
    }
    result[2 * row] = status;
    result[2 * row + 1] = token;
}
