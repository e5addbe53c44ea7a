// A small CPU emulator of the CUDA features our kernels use, to test their logic without a GPU
// (scripts/cuda-emulate.sh). One block runs at a time; its threads are cooperative fibers
// (ucontext) scheduled round-robin on one OS thread, so:
// - `__shared__` locals become `static` (one copy, shared by the block's threads);
// - `__syncthreads()` is a barrier (each waiting fiber yields until all arrived);
// - warp shuffles and ballots exchange values through per-warp slots in two scheduler rounds
//   (write, yield, read, yield): every lane of a warp advances one yield per round, which
//   holds because our kernels only shuffle with all 32 lanes on warp-uniform paths.
// Float arithmetic is the host's IEEE single precision (compile with -ffp-contract=off), with
// fmaf/sqrtf/rintf correctly rounded like the device's.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>
#include <vector>

struct EmuDim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace emu {
struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    EmuDim3 tid;
    unsigned linear = 0;
    bool done = false;
};
inline std::vector<Fiber>* g_fibers = nullptr;
inline Fiber* g_cur = nullptr;
inline ucontext_t g_sched;
inline EmuDim3 g_block_idx, g_block_dim, g_grid_dim;
inline std::vector<char> g_dyn_smem;
inline unsigned g_bar_count = 0, g_bar_gen = 0;
inline std::vector<uint64_t> g_slots;  // [warps][32]
inline const std::function<void()>* g_body = nullptr;
inline unsigned long long g_yields = 0;

inline void yield() {
    g_yields++;
    swapcontext(&g_cur->ctx, &g_sched);
}

inline void entry() {
    (*g_body)();
    g_cur->done = true;
    swapcontext(&g_cur->ctx, &g_sched);
}

inline void syncthreads() {
    unsigned gen = g_bar_gen;
    unsigned n = g_block_dim.x * g_block_dim.y * g_block_dim.z;
    if (++g_bar_count == n) {
        g_bar_count = 0;
        g_bar_gen++;
    } else {
        while (g_bar_gen == gen) yield();
    }
}

inline uint64_t exchange(uint64_t v, unsigned src_lane) {
    unsigned warp = g_cur->linear / 32, lane = g_cur->linear % 32;
    g_slots[warp * 32 + lane] = v;
    yield();
    uint64_t r = g_slots[warp * 32 + src_lane];
    yield();
    return r;
}

inline void run_grid(EmuDim3 grid, EmuDim3 block, size_t dyn_smem, const std::function<void()>& body) {
    unsigned n = block.x * block.y * block.z;
    if (n % 32 != 0) {
        fprintf(stderr, "emu: block size %u is not a multiple of 32\n", n);
        abort();
    }
    g_grid_dim = grid;
    g_block_dim = block;
    g_dyn_smem.assign(dyn_smem + 16, 0x7f);  // poisoned: kernels must write before reading
    g_slots.assign(n, 0);
    g_body = &body;
    std::vector<Fiber> fibers(n);
    g_fibers = &fibers;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                g_block_idx = {bx, by, bz};
                g_bar_count = 0;
                for (unsigned i = 0; i < n; i++) {
                    Fiber& f = fibers[i];
                    f.done = false;
                    f.linear = i;
                    f.tid = {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
                    f.stack.resize(256 * 1024);
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, entry, 0);
                }
                bool any = true;
                while (any) {
                    any = false;
                    for (unsigned i = 0; i < n; i++) {
                        if (fibers[i].done) continue;
                        any = true;
                        g_cur = &fibers[i];
                        swapcontext(&g_sched, &fibers[i].ctx);
                    }
                }
            }
    g_fibers = nullptr;
}
}  // namespace emu

#define threadIdx (emu::g_cur->tid)
#define blockIdx (emu::g_block_idx)
#define blockDim (emu::g_block_dim)
#define gridDim (emu::g_grid_dim)
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

inline void __syncthreads() { emu::syncthreads(); }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline float __expf(float x) { return expf(x); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
using std::max;
using std::min;

inline float __shfl_down_sync(unsigned, float v, int delta, int width = 32) {
    unsigned lane = emu::g_cur->linear % 32, seg = lane - lane % width;
    unsigned src = lane + delta;
    if (src >= seg + width) src = lane;
    return __uint_as_float((unsigned)emu::exchange(__float_as_uint(v), src));
}
inline float __shfl_xor_sync(unsigned, float v, int mask, int width = 32) {
    unsigned lane = emu::g_cur->linear % 32;
    unsigned src = lane ^ mask;
    if (src / width != lane / width) src = lane;
    return __uint_as_float((unsigned)emu::exchange(__float_as_uint(v), src));
}
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int mask, int width = 32) {
    unsigned lane = emu::g_cur->linear % 32;
    unsigned src = lane ^ mask;
    if (src / width != lane / width) src = lane;
    return (unsigned)emu::exchange(v, src);
}
inline float __shfl_sync(unsigned, float v, int src_lane, int width = 32) {
    unsigned lane = emu::g_cur->linear % 32, seg = lane - lane % width;
    return __uint_as_float((unsigned)emu::exchange(__float_as_uint(v), seg + src_lane % width));
}
inline unsigned __ballot_sync(unsigned, bool pred) {
    unsigned warp = emu::g_cur->linear / 32, lane = emu::g_cur->linear % 32;
    emu::g_slots[warp * 32 + lane] = pred ? 1 : 0;
    emu::yield();
    unsigned r = 0;
    for (unsigned l = 0; l < 32; l++) r |= (unsigned)(emu::g_slots[warp * 32 + l] & 1) << l;
    emu::yield();
    return r;
}

template <typename... A>
void emu_launch(void (*k)(A...), EmuDim3 grid, EmuDim3 block, size_t smem, A... args) {
    std::function<void()> body = [=]() { k(args...); };
    emu::run_grid(grid, block, smem, body);
}
