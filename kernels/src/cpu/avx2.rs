//! AVX2+FMA kernels. Each 16-lane accumulator of the scalar definition is a pair of `__m256`
//! (lanes 0..8 and 8..16), so results are bit-identical to [`super::scalar`] and [`super::avx512`].
//!
//! Every function here is `#[target_feature(enable = "avx2,fma")]`; callers must have checked
//! support (the dispatcher does, through [`super::Isa::is_available`]).

use std::arch::x86_64::*;

use super::scalar::{EXP_HI, EXP_LO, EXP_POLY};
use super::{LANES, MAX_ATTENTION_QUERIES, PagedAttention};

/// Lanes of one `__m256`.
const HALF: usize = 8;

/// Integer mask with the first `n` (≤ 8) lanes set, for `_mm256_maskload_ps`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn mask8(n: usize) -> __m256i {
    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx)
}

/// Loads `n` (≤ 8) floats at `p`, zero in the other lanes.
///
/// # Safety
/// `p..p+n` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_n(p: *const f32, n: usize) -> __m256 {
    if n >= HALF {
        // SAFETY: the caller guarantees 8 readable floats.
        unsafe { _mm256_loadu_ps(p) }
    } else {
        let mask = mask8(n);
        // SAFETY: masked-off lanes are not accessed; the first `n` are readable.
        unsafe { _mm256_maskload_ps(p, mask) }
    }
}

/// Loads the 16-lane chunk at `p` with `n` (≤ 16) valid floats as `(lanes 0..8, lanes 8..16)`.
///
/// # Safety
/// `p..p+n` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load16(p: *const f32, n: usize) -> (__m256, __m256) {
    // SAFETY: reads min(n, 8) floats from p, within the caller's guarantee.
    let lo = unsafe { load_n(p, n.min(HALF)) };
    // SAFETY: reads n - 8 floats from p + 8 when n > 8, within the caller's guarantee.
    let hi = unsafe { load_n(p.wrapping_add(HALF), n.saturating_sub(HALF)) };
    (lo, hi)
}

/// Stores the first `n` (≤ 8) lanes of `v` at `p`.
///
/// # Safety
/// `p..p+n` must be writable.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store_n(p: *mut f32, n: usize, v: __m256) {
    if n >= HALF {
        // SAFETY: the caller guarantees 8 writable floats.
        unsafe { _mm256_storeu_ps(p, v) }
    } else {
        let mask = mask8(n);
        // SAFETY: masked-off lanes are not accessed; the first `n` are writable.
        unsafe { _mm256_maskstore_ps(p, mask, v) }
    }
}

/// Reduces one 16-lane accumulator `(lo, hi)` with the tree of [`super::scalar::reduce16`].
#[inline]
#[target_feature(enable = "avx2,fma")]
fn reduce1(lo: __m256, hi: __m256) -> f32 {
    let t = _mm256_add_ps(lo, hi);
    let u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
    let v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    let r = _mm_add_ss(v, _mm_shuffle_ps::<0b01>(v, v));
    _mm_cvtss_f32(r)
}

/// See [`super::scalar::dot`].
#[target_feature(enable = "avx2,fma")]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i < n {
        let m = (n - i).min(LANES);
        // SAFETY: i + m <= n = a.len().
        let (alo, ahi) = unsafe { load16(pa.wrapping_add(i), m) };
        // SAFETY: i + m <= n = b.len().
        let (blo, bhi) = unsafe { load16(pb.wrapping_add(i), m) };
        lo = _mm256_fmadd_ps(alo, blo, lo);
        hi = _mm256_fmadd_ps(ahi, bhi, hi);
        i += LANES;
    }
    reduce1(lo, hi)
}

/// See [`super::scalar::sum`].
#[target_feature(enable = "avx2,fma")]
pub fn sum(x: &[f32]) -> f32 {
    let n = x.len();
    let p = x.as_ptr();
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i < n {
        // SAFETY: i + min(16, n - i) <= n = x.len().
        let (a, b) = unsafe { load16(p.wrapping_add(i), (n - i).min(LANES)) };
        lo = _mm256_add_ps(lo, a);
        hi = _mm256_add_ps(hi, b);
        i += LANES;
    }
    reduce1(lo, hi)
}

/// Vector version of [`super::scalar::exp`], lane by lane the same operations.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp_v(x: __m256) -> __m256 {
    // min(x, 88): like f32::min, a NaN `x` yields 88 (the second operand).
    let x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    let keep = _mm256_cmp_ps::<_CMP_NLT_UQ>(x, _mm256_set1_ps(EXP_LO));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693_359_4), x);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    let y = _mm256_add_ps(y, _mm256_set1_ps(1.0));
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_and_ps(keep, _mm256_mul_ps(y, _mm256_castsi256_ps(e)))
}

/// Applies `f` to every lane of `x` in place.
#[inline(always)]
fn map_inplace(x: &mut [f32], f: impl Fn(__m256) -> __m256) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let mut i = 0;
    while i < n {
        let m = (n - i).min(HALF);
        // SAFETY: i + m <= n = x.len(); AVX2 is enabled in every caller (this helper is only
        // inlined into `#[target_feature]` functions).
        let v = unsafe { load_n(p.wrapping_add(i), m) };
        // SAFETY: as above, writes lanes i..i+m of `x` only.
        unsafe { store_n(p.wrapping_add(i), m, f(v)) };
        i += HALF;
    }
}

/// See [`super::scalar::exp_inplace`].
#[target_feature(enable = "avx2,fma")]
pub fn exp_inplace(x: &mut [f32]) {
    map_inplace(x, |v| exp_v(v));
}

/// See [`super::scalar::softmax`].
#[target_feature(enable = "avx2,fma")]
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let vmax = _mm256_set1_ps(max);
    map_inplace(x, |v| exp_v(_mm256_sub_ps(v, vmax)));
    let s = sum(x);
    let vs = _mm256_set1_ps(s);
    map_inplace(x, |v| _mm256_div_ps(v, vs));
}

/// See [`super::scalar::swiglu`].
#[target_feature(enable = "avx2,fma")]
pub fn swiglu(h1: &mut [f32], h3: &[f32]) {
    assert_eq!(h1.len(), h3.len());
    let n = h1.len();
    let (p1, p3) = (h1.as_mut_ptr(), h3.as_ptr());
    let one = _mm256_set1_ps(1.0);
    let sign = _mm256_set1_ps(-0.0);
    let mut i = 0;
    while i < n {
        let m = (n - i).min(HALF);
        // SAFETY: i + m <= n = h1.len().
        let a = unsafe { load_n(p1.wrapping_add(i), m) };
        // SAFETY: i + m <= n = h3.len().
        let b = unsafe { load_n(p3.wrapping_add(i), m) };
        // -a as a sign flip, exactly like the scalar negation.
        let neg = _mm256_xor_ps(a, sign);
        let s = _mm256_div_ps(one, _mm256_add_ps(one, exp_v(neg)));
        let r = _mm256_mul_ps(_mm256_mul_ps(a, s), b);
        // SAFETY: writes lanes i..i+m of `h1` only.
        unsafe { store_n(p1.wrapping_add(i), m, r) };
        i += HALF;
    }
}

/// See [`super::scalar::dots_strided`].
#[target_feature(enable = "avx2,fma")]
pub fn dots_strided(q: &[f32], base: &[f32], stride: usize, out: &mut [f32]) {
    let hd = q.len();
    for (j, o) in out.iter_mut().enumerate() {
        let s = j * stride;
        *o = dot(q, &base[s..s + hd]);
    }
}

/// See [`super::scalar::weighted_sum_strided`].
#[target_feature(enable = "avx2,fma")]
pub fn weighted_sum_strided(out: &mut [f32], p: &[f32], base: &[f32], stride: usize) {
    let hd = out.len();
    if let Some(last) = p.len().checked_sub(1) {
        assert!(
            last * stride + hd <= base.len(),
            "weighted_sum_strided reads past the end"
        );
    }
    let po = out.as_mut_ptr();
    let pb = base.as_ptr();
    let mut d = 0;
    while d < hd {
        let mut counts = [0usize; 4];
        let mut acc = [_mm256_setzero_ps(); 4];
        for c in 0..4 {
            let start = d + c * HALF;
            if start < hd {
                counts[c] = (hd - start).min(HALF);
                // SAFETY: start + counts[c] <= hd = out.len().
                acc[c] = unsafe { load_n(po.wrapping_add(start), counts[c]) };
            }
        }
        for (j, &pj) in p.iter().enumerate() {
            let vp = _mm256_set1_ps(pj);
            let row = pb.wrapping_add(j * stride + d);
            for c in 0..4 {
                if counts[c] != 0 {
                    // SAFETY: j*stride + d + c*8 + counts[c] <= base.len() by the assertion.
                    let v = unsafe { load_n(row.wrapping_add(c * HALF), counts[c]) };
                    acc[c] = _mm256_fmadd_ps(vp, v, acc[c]);
                }
            }
        }
        for c in 0..4 {
            if counts[c] != 0 {
                // SAFETY: writes lanes inside `out` only.
                unsafe { store_n(po.wrapping_add(d + c * HALF), counts[c], acc[c]) };
            }
        }
        d += 4 * HALF;
    }
}

/// See [`super::scalar::dots_paged`].
#[target_feature(enable = "avx2,fma")]
pub(super) fn dots_paged(a: &PagedAttention<'_>, scores: &mut [f32]) {
    match a.n {
        1 => dots_group::<1>(a, scores),
        2 => dots_group::<2>(a, scores),
        3 => dots_group::<3>(a, scores),
        _ => dots_group::<4>(a, scores),
    }
}

/// Scores of the `G` queries over every position below `a.max_len`: each key row is loaded once
/// for all queries; each score has its own 16-lane accumulator (two `__m256`), as in [`dot`].
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dots_group<const G: usize>(a: &PagedAttention<'_>, scores: &mut [f32]) {
    let hd = a.head_dim;
    let qp: [*const f32; G] = std::array::from_fn(|g| a.query(g).as_ptr());
    let mut keys = a.rows(a.kv.k, 0);
    for j in 0..a.max_len {
        let row = keys.next_row();
        let mut lo = [_mm256_setzero_ps(); G];
        let mut hi = [_mm256_setzero_ps(); G];
        let mut i = 0;
        while i < hd {
            let m = (hd - i).min(LANES);
            // SAFETY: position j < max_len, so its head row is inside the key pool (checked by
            // PagedAttention), and i + m <= head_dim.
            let (kl, kh) = unsafe { load16(row.wrapping_add(i), m) };
            for g in 0..G {
                // SAFETY: query rows are checked by PagedAttention, and i + m <= head_dim.
                let (ql, qh) = unsafe { load16(qp[g].wrapping_add(i), m) };
                lo[g] = _mm256_fmadd_ps(ql, kl, lo[g]);
                hi[g] = _mm256_fmadd_ps(qh, kh, hi[g]);
            }
            i += LANES;
        }
        for g in 0..G {
            if j < a.lens[g] {
                let s = reduce1(lo[g], hi[g]);
                // x · recip equals x / divisor when recip is set (see PagedAttention::recip).
                scores[g * a.max_len + j] = match a.recip {
                    Some(r) => s * r,
                    None => s / a.divisor,
                };
            }
        }
    }
}

/// See [`super::scalar::weighted_sum_paged`]. Positions run in segments between the distinct
/// query lengths; inside a segment the queries still active share each value row load, each
/// output element keeping its own FMA chain over increasing positions (through `out` between
/// segments, which does not round).
#[target_feature(enable = "avx2,fma")]
pub(super) fn weighted_sum_paged(a: &PagedAttention<'_>, scores: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (start, end, active, n) in a.segments() {
        // 16 ymm registers: G × C accumulators stay at most 8.
        match n {
            1 => weighted_rows::<1, 4>(a, scores, out, active, start, end),
            2 => weighted_rows::<2, 4>(a, scores, out, active, start, end),
            3 => weighted_rows::<3, 2>(a, scores, out, active, start, end),
            _ => weighted_rows::<4, 2>(a, scores, out, active, start, end),
        }
    }
}

/// `o_g[d] = fma(p_g[j], v_j[d], o_g[d])` for positions `start..end` and the `G` queries
/// `active[..G]`, in passes of `C` 8-lane column chunks.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn weighted_rows<const G: usize, const C: usize>(
    a: &PagedAttention<'_>,
    scores: &[f32],
    out: &mut [f32],
    active: [usize; MAX_ATTENTION_QUERIES],
    start: usize,
    end: usize,
) {
    let hd = a.head_dim;
    let pp: [*const f32; G] =
        std::array::from_fn(|g| scores.as_ptr().wrapping_add(active[g] * a.max_len));
    let mut d = 0;
    while d < hd {
        let op: [*mut f32; G] =
            std::array::from_fn(|g| out.as_mut_ptr().wrapping_add(active[g] * hd + d));
        let counts: [usize; C] =
            std::array::from_fn(|c| (hd - d).saturating_sub(c * HALF).min(HALF));
        let mut acc = [[_mm256_setzero_ps(); C]; G];
        for g in 0..G {
            for c in 0..C {
                if counts[c] != 0 {
                    // SAFETY: columns d + 8c.. + counts[c] <= head_dim of query active[g]'s
                    // output, inside `out` (checked n × head_dim long).
                    acc[g][c] = unsafe { load_n(op[g].wrapping_add(c * HALF), counts[c]) };
                }
            }
        }
        let mut rows = a.rows(a.kv.v, start);
        for j in start..end {
            let row = rows.next_row().wrapping_add(d);
            let mut v = [_mm256_setzero_ps(); C];
            for c in 0..C {
                if counts[c] != 0 {
                    // SAFETY: position j < max_len, so its head row is inside the value pool
                    // (checked by PagedAttention); columns stay below head_dim.
                    v[c] = unsafe { load_n(row.wrapping_add(c * HALF), counts[c]) };
                }
            }
            for g in 0..G {
                // SAFETY: j < lens[active[g]] <= max_len: inside query active[g]'s score row.
                let p = _mm256_set1_ps(unsafe { pp[g].wrapping_add(j).read() });
                for c in 0..C {
                    if counts[c] != 0 {
                        acc[g][c] = _mm256_fmadd_ps(p, v[c], acc[g][c]);
                    }
                }
            }
        }
        for g in 0..G {
            for c in 0..C {
                if counts[c] != 0 {
                    // SAFETY: as for the loads above.
                    unsafe { store_n(op[g].wrapping_add(c * HALF), counts[c], acc[g][c]) };
                }
            }
        }
        d += C * HALF;
    }
}

/// One 2×2 block of accumulators over the whole reduction; returns `[x0·w0, x0·w1, x1·w0, x1·w1]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn block_2x2(x: [*const f32; 2], w: [*const f32; 2], k: usize) -> [f32; 4] {
    let mut lo = [_mm256_setzero_ps(); 4];
    let mut hi = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < k {
        let m = (k - i).min(LANES);
        // SAFETY: the caller passes rows of length k and i + m <= k.
        let (x0l, x0h) = unsafe { load16(x[0].wrapping_add(i), m) };
        // SAFETY: as above.
        let (x1l, x1h) = unsafe { load16(x[1].wrapping_add(i), m) };
        // SAFETY: as above.
        let (w0l, w0h) = unsafe { load16(w[0].wrapping_add(i), m) };
        // SAFETY: as above.
        let (w1l, w1h) = unsafe { load16(w[1].wrapping_add(i), m) };
        lo[0] = _mm256_fmadd_ps(x0l, w0l, lo[0]);
        hi[0] = _mm256_fmadd_ps(x0h, w0h, hi[0]);
        lo[1] = _mm256_fmadd_ps(x0l, w1l, lo[1]);
        hi[1] = _mm256_fmadd_ps(x0h, w1h, hi[1]);
        lo[2] = _mm256_fmadd_ps(x1l, w0l, lo[2]);
        hi[2] = _mm256_fmadd_ps(x1h, w0h, hi[2]);
        lo[3] = _mm256_fmadd_ps(x1l, w1l, lo[3]);
        hi[3] = _mm256_fmadd_ps(x1h, w1h, hi[3]);
        i += LANES;
    }
    [
        reduce1(lo[0], hi[0]),
        reduce1(lo[1], hi[1]),
        reduce1(lo[2], hi[2]),
        reduce1(lo[3], hi[3]),
    ]
}

/// See [`super::scalar::tile_4x4`] (computed as four 2×2 blocks).
#[target_feature(enable = "avx2,fma")]
pub fn tile_4x4(x: [&[f32]; 4], w: [&[f32]; 4]) -> [f32; 16] {
    let k = x[0].len();
    assert!(
        x.iter().chain(w.iter()).all(|s| s.len() == k),
        "tile rows must have equal lengths"
    );
    let mut out = [0.0f32; 16];
    for r0 in [0, 2] {
        for c0 in [0, 2] {
            let b = block_2x2(
                [x[r0].as_ptr(), x[r0 + 1].as_ptr()],
                [w[c0].as_ptr(), w[c0 + 1].as_ptr()],
                k,
            );
            out[4 * r0 + c0] = b[0];
            out[4 * r0 + c0 + 1] = b[1];
            out[4 * (r0 + 1) + c0] = b[2];
            out[4 * (r0 + 1) + c0 + 1] = b[3];
        }
    }
    out
}

/// See [`super::scalar::tile_1x16`] (computed as four groups of four weight rows).
#[target_feature(enable = "avx2,fma")]
pub fn tile_1x16(x: &[f32], w: [&[f32]; 16]) -> [f32; 16] {
    let k = x.len();
    assert!(
        w.iter().all(|s| s.len() == k),
        "tile rows must have equal lengths"
    );
    let xp = x.as_ptr();
    let mut out = [0.0f32; 16];
    for g in 0..4 {
        let wp = [0, 1, 2, 3].map(|c| w[4 * g + c].as_ptr());
        let mut lo = [_mm256_setzero_ps(); 4];
        let mut hi = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < k {
            let m = (k - i).min(LANES);
            // SAFETY: i + m <= k = x.len().
            let (xl, xh) = unsafe { load16(xp.wrapping_add(i), m) };
            for c in 0..4 {
                // SAFETY: i + m <= k = w[4g + c].len().
                let (wl, wh) = unsafe { load16(wp[c].wrapping_add(i), m) };
                lo[c] = _mm256_fmadd_ps(xl, wl, lo[c]);
                hi[c] = _mm256_fmadd_ps(xh, wh, hi[c]);
            }
            i += LANES;
        }
        for c in 0..4 {
            out[4 * g + c] = reduce1(lo[c], hi[c]);
        }
    }
    out
}

/// Sum of `x` with independent accumulators (bandwidth probe only; not bit-exact).
#[target_feature(enable = "avx2,fma")]
pub fn read_sum(x: &[f32]) -> f32 {
    let n = x.len();
    let p = x.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 4 * HALF <= n {
        for (c, a) in acc.iter_mut().enumerate() {
            // SAFETY: i + 32 <= n.
            let v = unsafe { _mm256_loadu_ps(p.wrapping_add(i + c * HALF)) };
            *a = _mm256_add_ps(*a, v);
        }
        i += 4 * HALF;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut total = reduce1(s, _mm256_setzero_ps());
    for &v in &x[i..] {
        total += v;
    }
    total
}
