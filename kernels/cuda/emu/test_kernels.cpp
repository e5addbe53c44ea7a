// Tests of the CUDA kernels on the CPU emulator (emu.h), against straightforward references:
// the exact kernels bit for bit against C++ transcriptions of the CPU oracle
// (zerolayer_kernels::cpu: 16-lane dot, reduce16 tree, exp_f32, softmax), the fast attention
// against a float64 reference, and the device sampler against a full-sort transcription of
// zerolayer_model::sampling. Built and run by scripts/cuda-emulate.sh; the kernel sources are
// included after a sed pass that turns `extern __shared__ float x[];` into the emulator's
// dynamic shared memory.
#include "emu.h"

#include "kernels_all.inc"

#include <map>
#include <string>

static int g_failures = 0;
static int g_checks = 0;
#define CHECK(cond, ...)                                              \
    do {                                                              \
        g_checks++;                                                   \
        if (!(cond)) {                                                \
            g_failures++;                                             \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);      \
            fprintf(stderr, __VA_ARGS__);                             \
            fprintf(stderr, "\n");                                    \
            if (g_failures > 20) exit(1);                             \
        }                                                             \
    } while (0)

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t next_u64() {
    g_rng += 0x9E3779B97F4A7C15ull;
    uint64_t z = g_rng;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float uni() { return (float)(next_u64() >> 40) * (1.0f / 16777216.0f); }
static float sym() { return uni() * 2.0f - 1.0f; }
static std::vector<float> randv(size_t n, float scale = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = sym() * scale;
    return v;
}
static unsigned bits(float f) { return __float_as_uint(f); }
static float bf(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// ---- references (the CPU oracle's documented operation order) ----

static float ref_reduce16(const float s[16]) {
    float t[8], u[4];
    for (int i = 0; i < 8; i++) t[i] = s[i] + s[i + 8];
    for (int i = 0; i < 4; i++) u[i] = t[i] + t[i + 4];
    float v0 = u[0] + u[2], v1 = u[1] + u[3];
    return v0 + v1;
}
static float ref_dot(const float* a, const float* b, int n) {
    float acc[16] = {0};
    for (int k = 0; k < n; k++) acc[k % 16] = fmaf(a[k], b[k], acc[k % 16]);
    return ref_reduce16(acc);
}
static float ref_sum(const float* x, int n) {
    float acc[16] = {0};
    for (int k = 0; k < n; k++) acc[k % 16] = acc[k % 16] + x[k];
    return ref_reduce16(acc);
}

// ---- tests ----

static void test_matmul_exact() {
    for (int m : {1, 3, 17})
        for (int n : {1, 5, 33})
            for (int k : {1, 7, 16, 64, 100})
                for (int accumulate : {0, 1}) {
                    auto x = randv((size_t)m * k), w = randv((size_t)n * k), y0 = randv((size_t)m * n);
                    auto y = y0;
                    emu_launch(matmul_exact_f32, {(unsigned)((n + 15) / 16), (unsigned)m, 1}, {256, 1, 1}, 0,
                               (const float*)x.data(), (const float*)w.data(), y.data(), m, n, k, accumulate);
                    for (int r = 0; r < m; r++)
                        for (int c = 0; c < n; c++) {
                            float d = ref_dot(&x[(size_t)r * k], &w[(size_t)c * k], k);
                            float want = accumulate ? y0[(size_t)r * n + c] + d : d;
                            CHECK(bits(y[(size_t)r * n + c]) == bits(want), "matmul m%d n%d k%d acc%d [%d][%d]: %g vs %g",
                                  m, n, k, accumulate, r, c, y[(size_t)r * n + c], want);
                        }
                }
}

static void test_rmsnorm_embed_swiglu_casts() {
    for (int dim : {8, 64, 100}) {
        int rows = 5;
        auto x = randv((size_t)rows * dim, 3.0f), w = randv(dim);
        std::vector<float> out((size_t)rows * dim, -7.0f);
        std::vector<unsigned> sel = {4, 0, 2};
        float eps = 1e-5f;
        emu_launch(rmsnorm_to_f32, {(unsigned)rows, 1, 1}, {256, 1, 1}, 0, (const float*)x.data(), (const float*)w.data(),
                   (const u32*)sel.data(), 0, dim, eps, out.data());
        for (int r = 0; r < rows; r++) {
            const float* xr = &x[(size_t)r * dim];
            float ss = ref_dot(xr, xr, dim);
            float inv = 1.0f / sqrtf(ss / (float)dim + eps);
            for (int i = 0; i < dim; i++)
                CHECK(bits(out[(size_t)r * dim + i]) == bits(w[i] * (inv * xr[i])), "rmsnorm dim %d row %d [%d]", dim, r, i);
        }
        std::vector<bf16_t> outb((size_t)3 * dim);
        emu_launch(rmsnorm_to_bf16, {3, 1, 1}, {256, 1, 1}, 0, (const float*)x.data(), (const float*)w.data(),
                   (const u32*)sel.data(), 1, dim, eps, outb.data());
        for (int r = 0; r < 3; r++) {
            const float* xr = &x[(size_t)sel[r] * dim];
            float ss = ref_dot(xr, xr, dim);
            float inv = 1.0f / sqrtf(ss / (float)dim + eps);
            for (int i = 0; i < dim; i++)
                CHECK(outb[(size_t)r * dim + i] == f32_to_bf16(w[i] * (inv * xr[i])), "rmsnorm bf16 rows dim %d", dim);
        }
    }
    // embedding gather from a bf16 table
    {
        int vocab = 50, dim = 12;
        auto tabf = randv((size_t)vocab * dim);
        std::vector<bf16_t> tab(tabf.size());
        for (size_t i = 0; i < tab.size(); i++) tab[i] = f32_to_bf16(tabf[i]);
        std::vector<unsigned> toks = {3, 49, 0, 3};
        std::vector<float> x(toks.size() * dim);
        emu_launch(embed_bf16, {(unsigned)toks.size(), 1, 1}, {256, 1, 1}, 0, (const bf16_t*)tab.data(),
                   (const u32*)toks.data(), dim, x.data());
        for (size_t t = 0; t < toks.size(); t++)
            for (int i = 0; i < dim; i++)
                CHECK(x[t * dim + i] == bf16_to_f32(tab[(size_t)toks[t] * dim + i]), "embed");
    }
    // SwiGLU
    {
        int rows = 3, hidden = 37;
        auto h13 = randv((size_t)rows * 2 * hidden, 6.0f);
        std::vector<float> out((size_t)rows * hidden);
        emu_launch(swiglu_to_f32, {2, 1, 1}, {256, 1, 1}, 0, (const float*)h13.data(), (u64)rows, hidden, out.data());
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < hidden; i++) {
                float a = h13[(size_t)r * 2 * hidden + i], b = h13[(size_t)r * 2 * hidden + hidden + i];
                float s = 1.0f / (1.0f + exp_f32(-a));
                CHECK(bits(out[(size_t)r * hidden + i]) == bits((a * s) * b), "swiglu");
            }
    }
    // casts and dummy weights
    {
        auto src = randv(1000, 100.0f);
        std::vector<bf16_t> b(src.size());
        emu_launch(cast_f32_to_bf16, {2, 1, 1}, {256, 1, 1}, 0, (const float*)src.data(), (u64)src.size(), b.data());
        std::vector<float> back(src.size());
        emu_launch(cast_bf16_to_f32, {1, 1, 1}, {256, 1, 1}, 0, (const bf16_t*)b.data(), (u64)b.size(), back.data());
        for (size_t i = 0; i < src.size(); i++) {
            float err = fabsf(back[i] - src[i]);
            CHECK(err <= fabsf(src[i]) * (1.0f / 256.0f), "bf16 round trip %g -> %g", src[i], back[i]);
        }
        std::vector<float> d(777);
        emu_launch(dummy_fill_f32, {3, 1, 1}, {256, 1, 1}, 0, d.data(), (u64)d.size(), (u64)42, (u32)7, (u64)1000, 0.125f);
        // The documented formula of zerolayer_model::dummy_weight(42, 7, e) * 0.125.
        for (size_t i = 0; i < d.size(); i++) {
            uint64_t e = 1000 + i;
            uint64_t inner = ((uint64_t)7 << 48) ^ e;
            uint64_t h = splitmix64(42ull ^ splitmix64(inner));
            float u = (float)(h >> 40) * (1.0f / 16777216.0f);
            CHECK(bits(d[i]) == bits((u * 2.0f - 1.0f) * 0.125f), "dummy");
            CHECK(d[i] >= -0.125f && d[i] < 0.125f, "dummy range");
        }
    }
}

/// A paged pool and sequences for the KV / attention tests.
struct Paged {
    int block_size, num_blocks, kv_dim;
    std::vector<unsigned> tables;        // concatenated
    std::vector<unsigned> table_off;     // per sequence
    size_t row(int seq, int p) const {
        unsigned b = tables[table_off[seq] + p / block_size];
        return ((size_t)b * block_size + p % block_size) * kv_dim;
    }
};

static Paged make_paged(int block_size, int num_blocks, int kv_dim, const std::vector<int>& seq_lens) {
    Paged pg{block_size, num_blocks, kv_dim, {}, {}};
    std::vector<unsigned> free_blocks;
    for (int b = 0; b < num_blocks; b++) free_blocks.push_back(b);
    // shuffle so tables are scattered
    for (int i = num_blocks - 1; i > 0; i--) std::swap(free_blocks[i], free_blocks[next_u64() % (i + 1)]);
    size_t next = 0;
    for (int len : seq_lens) {
        pg.table_off.push_back(pg.tables.size());
        for (int b = 0; b < (len + block_size - 1) / block_size; b++) pg.tables.push_back(free_blocks.at(next++));
    }
    return pg;
}

static void test_rope_append_and_exact_attention() {
    // stories260K-like: dim 64, 8 heads, 4 KV heads (hd 8); and a GQA 4 case with hd 32.
    struct Cfg { int dim, n_heads, n_kv; };
    for (Cfg c : {Cfg{64, 8, 4}, Cfg{128, 4, 1}}) {
        int hd = c.dim / c.n_heads, kvd = c.n_kv * hd, stride = c.dim + 2 * kvd, bs = 4, max_seq = 64;
        std::vector<float> rope((size_t)max_seq * hd);
        for (int p = 0; p < max_seq; p++)
            for (int j = 0; j < hd; j += 2) {
                float freq = 1.0f / powf(10000.0f, (float)j / hd);
                rope[(size_t)p * hd + j] = cosf(p * freq);
                rope[(size_t)p * hd + j + 1] = sinf(p * freq);
            }
        // Two sequences; this step: seq 0 positions 0..9 (prefill), seq 1 positions 0..13.
        std::vector<int> lens = {10, 14};
        Paged pg = make_paged(bs, 16, kvd, lens);
        std::vector<unsigned> pos, tbl;
        for (int s = 0; s < 2; s++)
            for (int p = 0; p < lens[s]; p++) {
                pos.push_back(p);
                tbl.push_back(pg.table_off[s]);
            }
        int T = pos.size();
        auto qkv0 = randv((size_t)T * stride);
        auto qkv = qkv0;
        std::vector<float> kpool((size_t)16 * bs * kvd, NAN), vpool((size_t)16 * bs * kvd, NAN);
        emu_launch(rope_append_f32, {(unsigned)T, 1, 1}, {256, 1, 1}, 0, qkv.data(), stride, (const float*)rope.data(),
                   (const u32*)pos.data(), (const u32*)tbl.data(), (const u32*)pg.tables.data(), c.dim, kvd, hd, bs,
                   kpool.data(), vpool.data());
        int t = 0;
        for (int s = 0; s < 2; s++)
            for (int p = 0; p < lens[s]; p++, t++) {
                const float* cs = &rope[(size_t)p * hd];
                for (int e = 0; e < c.dim; e += 2) {
                    int j = e % hd;
                    float v0 = qkv0[(size_t)t * stride + e], v1 = qkv0[(size_t)t * stride + e + 1];
                    CHECK(bits(qkv[(size_t)t * stride + e]) == bits(v0 * cs[j] - v1 * cs[j + 1]), "rope q");
                    CHECK(bits(qkv[(size_t)t * stride + e + 1]) == bits(v0 * cs[j + 1] + v1 * cs[j]), "rope q1");
                }
                size_t r = pg.row(s, p);
                for (int e = 0; e < kvd; e += 2) {
                    int j = e % hd;
                    float v0 = qkv0[(size_t)t * stride + c.dim + e], v1 = qkv0[(size_t)t * stride + c.dim + e + 1];
                    CHECK(bits(kpool[r + e]) == bits(v0 * cs[j] - v1 * cs[j + 1]), "rope k");
                    CHECK(bits(kpool[r + e + 1]) == bits(v0 * cs[j + 1] + v1 * cs[j]), "rope k1");
                }
                for (int e = 0; e < kvd; e++) CHECK(bits(vpool[r + e]) == bits(qkv0[(size_t)t * stride + c.dim + kvd + e]), "v");
            }
        // Exact attention over the pool just written.
        int max_end = 14;
        float sqrt_hd = sqrtf((float)hd);
        std::vector<float> out((size_t)T * c.dim, -9.0f);
        emu_launch(attention_exact_f32, {(unsigned)T, (unsigned)c.n_heads, 1}, {128, 1, 1}, (size_t)max_end * 4,
                   (const float*)qkv.data(), stride, (const float*)kpool.data(), (const float*)vpool.data(),
                   (const u32*)pos.data(), (const u32*)tbl.data(), (const u32*)pg.tables.data(), c.n_heads, c.n_kv, hd, kvd, bs,
                   sqrt_hd, out.data(), c.dim);
        t = 0;
        for (int s = 0; s < 2; s++)
            for (int p = 0; p < lens[s]; p++, t++)
                for (int h = 0; h < c.n_heads; h++) {
                    int kvh = h / (c.n_heads / c.n_kv);
                    const float* q = &qkv[(size_t)t * stride + h * hd];
                    std::vector<float> sc(p + 1);
                    for (int j = 0; j <= p; j++) sc[j] = ref_dot(q, &kpool[pg.row(s, j) + kvh * hd], hd) / sqrt_hd;
                    float mx = -INFINITY;
                    for (float v : sc) mx = fmaxf(mx, v);
                    for (float& v : sc) v = exp_f32(v - mx);
                    float sum = ref_sum(sc.data(), p + 1);
                    for (float& v : sc) v = v / sum;
                    for (int d = 0; d < hd; d++) {
                        float o = 0.0f;
                        for (int j = 0; j <= p; j++) o = fmaf(sc[j], vpool[pg.row(s, j) + kvh * hd + d], o);
                        CHECK(bits(out[(size_t)t * c.dim + h * hd + d]) == bits(o), "exact attention t%d h%d d%d: %g vs %g", t, h,
                              d, out[(size_t)t * c.dim + h * hd + d], o);
                    }
                }
    }
}

static void test_fast_attention() {
    struct Cfg { int n_heads, n_kv, hd; std::vector<int> starts, lens; int n_splits, split_len; };
    // (GQA 4, hd 128: decode tokens of long contexts, split), (GQA 2, hd 8: prefill chunks),
    // (MHA, hd 32: mixed, unsplit).
    std::vector<Cfg> cfgs = {
        {8, 2, 128, {0, 40, 299}, {1, 1, 1}, 5, 64},
        {8, 2, 128, {0, 17}, {20, 9}, 1, 1024},
        {8, 4, 8, {0, 30, 5}, {37, 1, 16}, 3, 32},
        {4, 4, 32, {0, 63}, {70, 1}, 1, 2048},
    };
    for (auto& c : cfgs) {
        int hd = c.hd, kvd = c.n_kv * hd, dim = c.n_heads * hd, stride = dim + 2 * kvd, bs = 16;
        int G = c.n_heads / c.n_kv, tile_tokens = std::max(1, 32 / G);
        std::vector<int> ends;
        for (size_t s = 0; s < c.starts.size(); s++) ends.push_back(c.starts[s] + c.lens[s]);
        Paged pg = make_paged(bs, 64, kvd, ends);
        std::vector<bf16_t> kpool((size_t)64 * bs * kvd), vpool((size_t)64 * bs * kvd);
        for (auto& x : kpool) x = f32_to_bf16(sym());
        for (auto& x : vpool) x = f32_to_bf16(sym());
        std::vector<unsigned> tiles, pos, seq_of;
        int T = 0, max_end = 0;
        for (size_t s = 0; s < c.starts.size(); s++) {
            for (int t = 0; t < c.lens[s]; t += tile_tokens) {
                int n = std::min(tile_tokens, c.lens[s] - t);
                tiles.insert(tiles.end(), {(unsigned)(T + t), (unsigned)n, (unsigned)(c.starts[s] + t), pg.table_off[s]});
            }
            for (int t = 0; t < c.lens[s]; t++) {
                pos.push_back(c.starts[s] + t);
                seq_of.push_back(s);
            }
            T += c.lens[s];
            max_end = std::max(max_end, ends[s]);
        }
        auto qkv = randv((size_t)T * stride, 2.0f);
        int n_tiles = tiles.size() / 4;
        std::vector<bf16_t> out((size_t)T * dim, 0xffff);
        std::vector<float> partial((size_t)T * c.n_heads * c.n_splits * (hd + 2), NAN);
        size_t smem = (32 * hd + 32 * (2 * hd + 1)) * 4;
        float scale = 1.0f / sqrtf((float)hd);
        emu_launch(attention_fast_bf16, {(unsigned)n_tiles, (unsigned)c.n_kv, (unsigned)c.n_splits}, {128, 1, 1}, smem,
                   (const float*)qkv.data(), stride, (const bf16_t*)kpool.data(), (const bf16_t*)vpool.data(),
                   (const u32*)tiles.data(), (const u32*)pg.tables.data(), c.n_heads, c.n_kv, hd, kvd, bs, scale, c.split_len,
                   c.n_splits, out.data(), dim, partial.data());
        if (c.n_splits > 1)
            emu_launch(attention_combine_bf16, {(unsigned)T, (unsigned)c.n_heads, 1}, {128, 1, 1}, 0,
                       (const float*)partial.data(), c.n_heads, hd, c.n_splits, out.data(), dim);
        double num = 0, den = 0;
        for (int t = 0; t < T; t++)
            for (int h = 0; h < c.n_heads; h++) {
                int s = seq_of[t], kvh = h / G, p = pos[t];
                std::vector<double> sc(p + 1);
                double mx = -1e300;
                for (int j = 0; j <= p; j++) {
                    double d = 0;
                    for (int e = 0; e < hd; e++)
                        d += (double)qkv[(size_t)t * stride + h * hd + e] * bf16_to_f32(kpool[pg.row(s, j) + kvh * hd + e]);
                    sc[j] = d * scale;
                    mx = std::max(mx, sc[j]);
                }
                double sum = 0;
                for (auto& v : sc) sum += (v = exp(v - mx));
                for (int e = 0; e < hd; e++) {
                    double o = 0;
                    for (int j = 0; j <= p; j++) o += sc[j] / sum * bf16_to_f32(vpool[pg.row(s, j) + kvh * hd + e]);
                    double got = bf16_to_f32(out[(size_t)t * dim + h * hd + e]);
                    CHECK(std::isfinite(got), "fast attention: output t%d h%d e%d not written", t, h, e);
                    CHECK(fabs(got - o) <= 1e-2 * fabs(o) + 2e-3, "fast attention t%d h%d e%d: %g vs %g", t, h, e, got, o);
                    num += (got - o) * (got - o);
                    den += o * o;
                }
            }
        double rel = sqrt(num / den);
        CHECK(rel < 5e-3, "fast attention relative error %g", rel);
        printf("  fast attention G%d hd%d splits %d: relative error %.2e\n", G, hd, c.n_splits, rel);
    }
}

// ---- the sampler ----

struct Params { float temperature; unsigned top_k; float top_p; };

// zerolayer_model::sampling::Sampler::sample, the full-order form (returns -1 for
// NothingAllowed).
static long ref_sample(const std::vector<float>& logits, const Params& prm, float uniform, const std::vector<unsigned>& banned) {
    size_t V = logits.size();
    std::vector<char> ban(V, 0);
    for (unsigned b : banned) ban[b] = 1;
    auto allowed = [&](size_t i) { return !ban[i] && logits[i] > -INFINITY; };
    if (prm.temperature == 0.0f) {
        long best = -1;
        for (size_t i = 0; i < V; i++)
            if (allowed(i) && (best < 0 || logits[i] > logits[best])) best = i;
        return best;
    }
    float t = prm.temperature, mx = -INFINITY;
    size_t n = 0;
    for (size_t i = 0; i < V; i++)
        if (allowed(i)) {
            mx = fmaxf(mx, logits[i] / t);
            n++;
        }
    if (n == 0) return -1;
    std::vector<float> p(V);
    for (size_t i = 0; i < V; i++) p[i] = allowed(i) ? exp_f32(logits[i] / t - mx) : 0.0f;
    float s = ref_sum(p.data(), V);
    for (auto& x : p) x = x / s;
    std::vector<unsigned> order;
    for (size_t i = 0; i < V; i++)
        if (allowed(i)) order.push_back(i);
    std::sort(order.begin(), order.end(), [&](unsigned a, unsigned b) { return p[a] != p[b] ? p[a] > p[b] : a < b; });
    if (prm.top_k > 0 && prm.top_k < order.size()) order.resize(prm.top_k);
    size_t kept = order.size();
    if (prm.top_p < 1.0f) {
        float c = 0;
        for (size_t j = 0; j < order.size(); j++) {
            c += p[order[j]];
            if (c >= prm.top_p) {
                kept = j + 1;
                break;
            }
        }
    }
    float total = 0;
    for (size_t j = 0; j < kept; j++) total += p[order[j]];
    float r = uniform * total, c = 0;
    for (size_t j = 0; j < kept; j++) {
        c += p[order[j]];
        if (r < c) return order[j];
    }
    for (size_t j = kept; j > 0; j--)
        if (p[order[j - 1]] > 0) return order[j - 1];
    return order[0];
}

static void test_sampling() {
    std::vector<Params> params = {{0, 0, 1}, {1, 0, 1}, {0.7f, 40, 1}, {0.8f, 0, 0.9f}, {1.3f, 100, 0.95f},
                                  {1.0f, 5000, 1}, {2.0f, 0, 0.5f}, {0.05f, 0, 1}};
    std::map<std::string, int> host_counts;
    for (int V : {512, 20000}) {
        std::vector<std::vector<float>> rows;
        std::vector<float> r(V);
        for (int i = 0; i < V; i++) r[i] = uni() * 4.0f + (i % 997 == 3 ? 12.0f : 0.0f);  // peaked
        rows.push_back(r);
        for (int i = 0; i < V; i++) r[i] = uni() * 1e-3f;  // near-uniform
        rows.push_back(r);
        for (int i = 0; i < V; i++) r[i] = (uni() + uni() + uni() - 1.5f) * 6.0f;  // LM-like
        rows.push_back(r);
        for (int i = 0; i < V; i++) r[i] = i % 5 == 0 ? -INFINITY : i % 5 == 1 ? NAN : (float)(i % 3);  // ties, masks
        rows.push_back(r);
        for (int i = 0; i < V; i++) r[i] = (float)(i % 7);  // massive ties at every level
        rows.push_back(r);
        std::vector<unsigned> banned_some, banned_all;
        for (int i = 0; i < V; i++) {
            if (i % 7 == 0) banned_some.push_back(i);
            banned_all.push_back(i);
        }
        std::vector<std::vector<unsigned>> bans = {{}, banned_some, banned_all};
        for (size_t ri = 0; ri < rows.size(); ri++)
            for (size_t pi = 0; pi < params.size(); pi++)
                for (size_t bi = 0; bi < bans.size(); bi++)
                    for (float u : {0.0f, 0.37f, 0.99999994f}) {
                        // One launch per case: a single row (the kernel is per-row independent).
                        std::vector<float> lg = rows[ri];
                        const auto& ban = bans[bi];
                        std::vector<unsigned> prm = {bits(params[pi].temperature), params[pi].top_k, bits(params[pi].top_p), bits(u), 0,
                                                     (unsigned)ban.size()};
                        std::vector<float> probs(V, NAN);
                        std::vector<unsigned> result = {99, 99};
                        long want = ref_sample(rows[ri], params[pi], u, ban);
                        emu_launch(sample_rows, {1, 1, 1}, {1024, 1, 1}, 0, lg.data(), V, (const u32*)prm.data(),
                                   (const u32*)(ban.empty() ? prm.data() : ban.data()), probs.data(), result.data());
                        if (result[0] == SAMPLE_HOST) {
                            host_counts["V" + std::to_string(V) + " row" + std::to_string(ri) + " params" + std::to_string(pi)]++;
                            continue;
                        }
                        long got = result[0] == SAMPLE_NOTHING_ALLOWED ? -1 : (long)result[1];
                        CHECK(result[0] == SAMPLE_TOKEN || result[0] == SAMPLE_NOTHING_ALLOWED, "status %u", result[0]);
                        CHECK(got == want, "sampling V%d row %zu params %zu banned %zu u %g: got %ld want %ld", V, ri, pi, bi, u, got,
                              want);
                    }
    }
    for (auto& kv : host_counts) printf("  sampled on the host: %s x%d\n", kv.first.c_str(), kv.second);
}

static void test_kv_copy() {
    int bs = 4, nb = 12, kvd = 6, layers = 2, len = 9;
    size_t layer_len = (size_t)nb * bs * kvd;
    auto k = randv(layers * layer_len), v = randv(layers * layer_len);
    auto k0 = k, v0 = v;
    std::vector<unsigned> src = {5, 0, 7}, dst = {2, 9, 11};
    emu_launch(kv_copy_f32, {(unsigned)len, (unsigned)layers, 1}, {256, 1, 1}, 0, k.data(), v.data(), (const u32*)src.data(),
               (const u32*)dst.data(), (u64)layer_len, bs, kvd);
    for (int l = 0; l < layers; l++)
        for (int p = 0; p < len; p++)
            for (int e = 0; e < kvd; e++) {
                size_t s = l * layer_len + ((size_t)src[p / bs] * bs + p % bs) * kvd + e;
                size_t d = l * layer_len + ((size_t)dst[p / bs] * bs + p % bs) * kvd + e;
                CHECK(k[d] == k0[s] && v[d] == v0[s], "kv_copy");
            }
}

int main(int argc, char** argv) {
    std::string only = argc > 1 ? argv[1] : "";
    struct T { const char* name; void (*f)(); };
    T tests[] = {{"matmul_exact", test_matmul_exact},
                 {"rowwise", test_rmsnorm_embed_swiglu_casts},
                 {"rope_attention_exact", test_rope_append_and_exact_attention},
                 {"fast_attention", test_fast_attention},
                 {"kv_copy", test_kv_copy},
                 {"sampling", test_sampling}};
    for (auto& t : tests) {
        if (!only.empty() && only != t.name) continue;
        int before = g_failures;
        t.f();
        printf("%s %s\n", g_failures == before ? "ok  " : "FAIL", t.name);
    }
    printf("%d checks, %d failures, %llu fiber switches\n", g_checks, g_failures, emu::g_yields);
    return g_failures ? 1 : 0;
}
