//! Portable scalar kernels. They are also **the definition** of every kernel's arithmetic: the
//! SIMD paths perform exactly the same IEEE-754 operations (fused multiply-adds included) in the
//! same order, lane by lane, so all paths return bit-identical results.

use super::LANES;

/// Reduces 16 lane partial sums to one with the fixed pairwise tree every path uses:
/// `t[i] = s[i] + s[i+8]`, `u[i] = t[i] + t[i+4]`, `v[i] = u[i] + u[i+2]`, `r = v[0] + v[1]`.
#[inline]
pub fn reduce16(s: &[f32; LANES]) -> f32 {
    let mut t = [0.0f32; 8];
    for i in 0..8 {
        t[i] = s[i] + s[i + 8];
    }
    let mut u = [0.0f32; 4];
    for i in 0..4 {
        u[i] = t[i] + t[i + 4];
    }
    let v0 = u[0] + u[2];
    let v1 = u[1] + u[3];
    v0 + v1
}

/// Dot product: lane `l` accumulates `a[i]*b[i]` for `i ≡ l (mod 16)` in increasing `i` with a
/// fused multiply-add (starting from +0), then [`reduce16`]. Lanes past the end of a ragged tail
/// are left untouched (the SIMD paths add `fma(0, 0, acc) = acc`, which is the same value).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    for (ca, cb) in a.chunks(LANES).zip(b.chunks(LANES)) {
        for l in 0..ca.len() {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    reduce16(&acc)
}

/// Sum with the same lane scheme as [`dot`] (lane `l` adds `x[i]`, `i ≡ l mod 16`), then [`reduce16`].
#[inline]
pub fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for c in x.chunks(LANES) {
        for l in 0..c.len() {
            acc[l] += c[l];
        }
    }
    reduce16(&acc)
}

/// Upper clamp of [`exp`]'s argument: `exp(88) ≈ 1.65e38` is still a finite f32 and
/// `round(88·log2 e) = 127` keeps the power-of-two scale a normal number.
pub const EXP_HI: f32 = 88.0;
/// Below this (≈ ln 2⁻¹²⁶) [`exp`] returns exactly 0: the result would be subnormal. Also maps
/// `-inf` (masked logits) to an exact 0.
pub const EXP_LO: f32 = -87.336_55;
/// log2(e), rounded to f32.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in a high part exact in few bits and a low correction (Cephes `expf`).
const LN2_HI: f32 = 0.693_359_4;
/// Low part of ln 2 (Cephes `expf`).
const LN2_LO: f32 = -2.121_944_4e-4;
/// Minimax polynomial coefficients of `(e^r - 1 - r) / r²` on [-ln2/2, ln2/2] (Cephes `expf`),
/// written as published; each literal rounds to the f32 the kernels use.
#[allow(clippy::excessive_precision)]
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    5.000_000_1e-1,
];

/// Natural exponential with a fixed sequence of IEEE operations that the SIMD paths (and a GPU
/// kernel without fast-math) reproduce bit for bit; accurate to about 1 ulp.
///
/// 1. `x = min(x, 88)`; if `x < EXP_LO` (including `-inf`) return `0`.
/// 2. `n = round_ties_even(x * log2e)`; `r = fma(n, -LN2_HI, x)`; `r = fma(n, -LN2_LO, r)`.
/// 3. `p = EXP_POLY[0]`; `p = fma(p, r, EXP_POLY[i])` for i = 1..6; `y = fma(p, r*r, r) + 1`.
/// 4. return `y * 2^n` (2^n built from the exponent bits).
#[inline]
pub fn exp(x: f32) -> f32 {
    let x = x.min(EXP_HI);
    if x < EXP_LO {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // n ∈ [-126, 127] here, so the biased exponent is in 1..=254: a normal power of two.
    let pow2n = f32::from_bits((((n as i32) + 127) as u32) << 23);
    y * pow2n
}

/// `x[i] = exp(x[i])` with [`exp`].
pub fn exp_inplace(x: &mut [f32]) {
    for v in x {
        *v = exp(*v);
    }
}

/// Softmax in place: `max` (order-free), `e[i] = exp(x[i] - max)`, `s = sum(e)` ([`sum`]'s
/// order), `x[i] = e[i] / s`.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
    let s = sum(x);
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// RMSNorm's factor like llama2.c: `ss = ss / n + eps`, `1 / sqrt(ss)`, where `ss = dot(x, x)`
/// (the caller computes it with its ISA's [`dot`], which is bit-identical to the scalar one).
#[inline]
pub(crate) fn rms_inv_from_ss(ss: f32, n: usize, eps: f32) -> f32 {
    let ss = ss / n as f32 + eps;
    1.0 / ss.sqrt()
}

/// SwiGLU like llama2.c: `h1[i] = (h1[i] * (1 / (1 + exp(-h1[i])))) * h3[i]`.
pub fn swiglu(h1: &mut [f32], h3: &[f32]) {
    for (a, &b) in h1.iter_mut().zip(h3) {
        let s = 1.0 / (1.0 + exp(-*a));
        *a = (*a * s) * b;
    }
}

/// `out[j] = dot(q, base[j*stride ..][..q.len()])` for `j < out.len()`.
pub fn dots_strided(q: &[f32], base: &[f32], stride: usize, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        let s = j * stride;
        *o = dot(q, &base[s..s + q.len()]);
    }
}

/// `out[d] = fma(p[j], base[j*stride + d], out[d])` for `j` in increasing order.
pub fn weighted_sum_strided(out: &mut [f32], p: &[f32], base: &[f32], stride: usize) {
    for (j, &pj) in p.iter().enumerate() {
        let row = &base[j * stride..j * stride + out.len()];
        for (o, &v) in out.iter_mut().zip(row) {
            *o = pj.mul_add(v, *o);
        }
    }
}

/// A 4×4 matmul tile: `out[4*r + c] = dot(x[r], w[c])`.
pub fn tile_4x4(x: [&[f32]; 4], w: [&[f32]; 4]) -> [f32; 16] {
    let mut out = [0.0f32; 16];
    for r in 0..4 {
        for c in 0..4 {
            out[4 * r + c] = dot(x[r], w[c]);
        }
    }
    out
}

/// A 1×16 mat-vec tile: `out[c] = dot(x, w[c])`.
pub fn tile_1x16(x: &[f32], w: [&[f32]; 16]) -> [f32; 16] {
    let mut out = [0.0f32; 16];
    for c in 0..16 {
        out[c] = dot(x, w[c]);
    }
    out
}

/// See [`super::CpuKernels::attention_paged`], step 1: `scores[i · max_len + j] = dot(q_i, k_j) /
/// divisor` for `j < lens[i]`.
pub(super) fn dots_paged(a: &super::PagedAttention<'_>, scores: &mut [f32]) {
    for i in 0..a.n {
        let q = a.query(i);
        let row = &mut scores[i * a.max_len..][..a.lens[i]];
        for (j, s) in row.iter_mut().enumerate() {
            let k = &a.kv.k[a.row_offset(j)..][..a.head_dim];
            *s = dot(q, k) / a.divisor;
        }
    }
}

/// See [`super::CpuKernels::attention_paged`], step 3: `o_i[d] = +0`, then
/// `o_i[d] = fma(p_i[j], v_j[d], o_i[d])` for `j < lens[i]` in increasing order.
pub(super) fn weighted_sum_paged(a: &super::PagedAttention<'_>, scores: &[f32], out: &mut [f32]) {
    for i in 0..a.n {
        let o = &mut out[i * a.head_dim..][..a.head_dim];
        o.fill(0.0);
        for (j, &p) in scores[i * a.max_len..][..a.lens[i]].iter().enumerate() {
            let v = &a.kv.v[a.row_offset(j)..][..a.head_dim];
            for (od, &vd) in o.iter_mut().zip(v) {
                *od = p.mul_add(vd, *od);
            }
        }
    }
}
