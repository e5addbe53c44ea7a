//! AVX-512F kernels: one 16-lane `__m512` accumulator per output element, exactly the lane scheme
//! of [`super::scalar`] (which defines the arithmetic).
//!
//! Every function here is `#[target_feature(enable = "avx512f,fma")]`; callers must have checked
//! that the CPU supports both (the dispatcher does, through [`super::Isa::is_available`]).

use std::arch::x86_64::*;

use super::scalar::{EXP_HI, EXP_LO, EXP_POLY};
use super::{LANES, MAX_ATTENTION_QUERIES, PagedAttention};

/// Mask selecting the first `n` (< 16) lanes.
#[inline(always)]
fn tail_mask(n: usize) -> __mmask16 {
    debug_assert!(n < LANES);
    ((1u32 << n) - 1) as __mmask16
}

/// Loads 16 floats at `p` (unaligned).
///
/// # Safety
/// `p..p+16` must be readable.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn load(p: *const f32) -> __m512 {
    // SAFETY: the caller guarantees 16 readable floats at `p`.
    unsafe { _mm512_loadu_ps(p) }
}

/// Loads the lanes of `mask` at `p`, zero elsewhere (masked-off lanes are not accessed).
///
/// # Safety
/// The masked lanes of `p` must be readable.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn load_masked(mask: __mmask16, p: *const f32) -> __m512 {
    // SAFETY: the caller guarantees the masked lanes are readable; others are not touched.
    unsafe { _mm512_maskz_loadu_ps(mask, p) }
}

/// Reduces one accumulator with the tree of [`super::scalar::reduce16`].
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn reduce1(a: __m512) -> f32 {
    // t[i] = s[i] + s[i+8]
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    let t = _mm256_add_ps(_mm512_castps512_ps256(a), hi);
    // u[i] = t[i] + t[i+4]
    let u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
    // v[0] = u0 + u2, v[1] = u1 + u3
    let v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    // r = v0 + v1
    let r = _mm_add_ss(v, _mm_shuffle_ps::<0b01>(v, v));
    _mm_cvtss_f32(r)
}

/// Reduces 16 accumulators at once with the same per-lane tree as [`reduce1`]; lane `4k + j` of the
/// result holds the sum of accumulator `4j + k`.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn reduce16(a: &[__m512; 16]) -> __m512 {
    // Level 1: pair lanes i and i+8 of two accumulators at once.
    let mut c = [_mm512_setzero_ps(); 8];
    for j in 0..8 {
        let lo = _mm512_shuffle_f32x4::<0x44>(a[2 * j], a[2 * j + 1]);
        let hi = _mm512_shuffle_f32x4::<0xEE>(a[2 * j], a[2 * j + 1]);
        c[j] = _mm512_add_ps(lo, hi);
    }
    // Level 2: lanes i and i+4.
    let mut e = [_mm512_setzero_ps(); 4];
    for j in 0..4 {
        let lo = _mm512_shuffle_f32x4::<0x88>(c[2 * j], c[2 * j + 1]);
        let hi = _mm512_shuffle_f32x4::<0xDD>(c[2 * j], c[2 * j + 1]);
        e[j] = _mm512_add_ps(lo, hi);
    }
    // Level 3: lanes i and i+2 (within 128-bit blocks).
    let mut g = [_mm512_setzero_ps(); 2];
    for j in 0..2 {
        let lo = _mm512_shuffle_ps::<0x44>(e[2 * j], e[2 * j + 1]);
        let hi = _mm512_shuffle_ps::<0xEE>(e[2 * j], e[2 * j + 1]);
        g[j] = _mm512_add_ps(lo, hi);
    }
    // Level 4: lanes 0 and 1.
    let lo = _mm512_shuffle_ps::<0x88>(g[0], g[1]);
    let hi = _mm512_shuffle_ps::<0xDD>(g[0], g[1]);
    _mm512_add_ps(lo, hi)
}

/// Stores a vector into a 16-float array.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn to_array(v: __m512) -> [f32; 16] {
    let mut out = [0.0f32; 16];
    // SAFETY: `out` holds exactly 16 writable floats.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) };
    out
}

/// See [`super::scalar::dot`].
#[target_feature(enable = "avx512f,fma")]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i + LANES <= n {
        // SAFETY: i + 16 <= n = a.len().
        let va = unsafe { load(pa.wrapping_add(i)) };
        // SAFETY: i + 16 <= n = b.len().
        let vb = unsafe { load(pb.wrapping_add(i)) };
        acc = _mm512_fmadd_ps(va, vb, acc);
        i += LANES;
    }
    if i < n {
        let m = tail_mask(n - i);
        // SAFETY: the mask covers lanes i..n of `a` only.
        let va = unsafe { load_masked(m, pa.wrapping_add(i)) };
        // SAFETY: the mask covers lanes i..n of `b` only.
        let vb = unsafe { load_masked(m, pb.wrapping_add(i)) };
        acc = _mm512_fmadd_ps(va, vb, acc);
    }
    reduce1(acc)
}

/// See [`super::scalar::sum`].
#[target_feature(enable = "avx512f,fma")]
pub fn sum(x: &[f32]) -> f32 {
    let n = x.len();
    let p = x.as_ptr();
    // Four independent chains for throughput would change the per-lane order; keep one per lane
    // but let consecutive iterations overlap through the out-of-order core.
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i + LANES <= n {
        // SAFETY: i + 16 <= n = x.len().
        let v = unsafe { load(p.wrapping_add(i)) };
        acc = _mm512_add_ps(acc, v);
        i += LANES;
    }
    if i < n {
        // SAFETY: the mask covers lanes i..n of `x` only.
        let v = unsafe { load_masked(tail_mask(n - i), p.wrapping_add(i)) };
        acc = _mm512_add_ps(acc, v);
    }
    reduce1(acc)
}

/// Vector version of [`super::scalar::exp`], lane by lane the same operations.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn exp_v(x: __m512) -> __m512 {
    // min(x, 88): like f32::min, a NaN `x` yields 88 (the second operand).
    let x = _mm512_min_ps(x, _mm512_set1_ps(EXP_HI));
    let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(EXP_LO));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693_359_4), x);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    let y = _mm512_add_ps(y, _mm512_set1_ps(1.0));
    let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(e)))
}

/// Applies `f` to every lane of `x` in place (masked tail).
#[inline(always)]
fn map_inplace(x: &mut [f32], f: impl Fn(__m512) -> __m512) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let mut i = 0;
    while i < n {
        let m = if n - i >= LANES {
            0xFFFF
        } else {
            tail_mask(n - i)
        };
        // SAFETY: the mask covers lanes i..min(i+16, n) of `x` only; AVX-512F is enabled in every
        // caller (this helper is only inlined into `#[target_feature]` functions).
        let v = unsafe { _mm512_maskz_loadu_ps(m, p.wrapping_add(i)) };
        let r = f(v);
        // SAFETY: as above, the store touches lanes i..min(i+16, n) only.
        unsafe { _mm512_mask_storeu_ps(p.wrapping_add(i), m, r) };
        i += LANES;
    }
}

/// See [`super::scalar::exp_inplace`].
#[target_feature(enable = "avx512f,fma")]
pub fn exp_inplace(x: &mut [f32]) {
    map_inplace(x, |v| exp_v(v));
}

/// See [`super::scalar::softmax`].
#[target_feature(enable = "avx512f,fma")]
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let vmax = _mm512_set1_ps(max);
    map_inplace(x, |v| exp_v(_mm512_sub_ps(v, vmax)));
    let s = sum(x);
    let vs = _mm512_set1_ps(s);
    map_inplace(x, |v| _mm512_div_ps(v, vs));
}

/// See [`super::scalar::swiglu`].
#[target_feature(enable = "avx512f,fma")]
pub fn swiglu(h1: &mut [f32], h3: &[f32]) {
    assert_eq!(h1.len(), h3.len());
    let n = h1.len();
    let (p1, p3) = (h1.as_mut_ptr(), h3.as_ptr());
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    while i < n {
        let m = if n - i >= LANES {
            0xFFFF
        } else {
            tail_mask(n - i)
        };
        // SAFETY: the mask covers lanes i..min(i+16, n) of `h1` only.
        let a = unsafe { load_masked(m, p1.wrapping_add(i)) };
        // SAFETY: the mask covers lanes i..min(i+16, n) of `h3` (same length) only.
        let b = unsafe { load_masked(m, p3.wrapping_add(i)) };
        // -a as a sign flip, exactly like the scalar negation (0 - a would map -0 to +0).
        let neg = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(a),
            _mm512_set1_epi32(i32::MIN),
        ));
        let s = _mm512_div_ps(one, _mm512_add_ps(one, exp_v(neg)));
        let r = _mm512_mul_ps(_mm512_mul_ps(a, s), b);
        // SAFETY: the store touches lanes i..min(i+16, n) of `h1` only.
        unsafe { _mm512_mask_storeu_ps(p1.wrapping_add(i), m, r) };
        i += LANES;
    }
}

/// See [`super::scalar::dots_strided`]. Sixteen rows at a time share one transposed reduction
/// ([`reduce16`]), each row keeping its own lane accumulator (same per-row order as [`dot`]).
#[target_feature(enable = "avx512f,fma")]
pub fn dots_strided(q: &[f32], base: &[f32], stride: usize, out: &mut [f32]) {
    let hd = q.len();
    if let Some(last) = out.len().checked_sub(1) {
        assert!(
            last * stride + hd <= base.len(),
            "dots_strided reads past the end"
        );
    }
    // SAFETY: TRANSPOSE4X4 holds exactly 16 readable i32 values.
    let idx = unsafe { _mm512_loadu_si512(TRANSPOSE4X4.as_ptr().cast()) };
    let qp = q.as_ptr();
    let bp = base.as_ptr();
    let mut j0 = 0;
    while j0 + 16 <= out.len() {
        let mut acc = [_mm512_setzero_ps(); 16];
        let mut i = 0;
        while i < hd {
            let m = if hd - i >= LANES {
                0xFFFF
            } else {
                tail_mask(hd - i)
            };
            // SAFETY: the mask covers lanes i..min(i+16, hd) of q only.
            let qv = unsafe { load_masked(m, qp.wrapping_add(i)) };
            for (r, a) in acc.iter_mut().enumerate() {
                // SAFETY: row j0 + r < out.len(), so its lanes lie inside base (asserted above).
                let kv = unsafe { load_masked(m, bp.wrapping_add((j0 + r) * stride + i)) };
                *a = _mm512_fmadd_ps(qv, kv, *a);
            }
            i += LANES;
        }
        let sums = _mm512_permutexvar_ps(idx, reduce16(&acc));
        // SAFETY: j0 + 16 <= out.len().
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().wrapping_add(j0), sums) };
        j0 += 16;
    }
    for (j, o) in out.iter_mut().enumerate().skip(j0) {
        let s = j * stride;
        *o = dot(q, &base[s..s + hd]);
    }
}

/// See [`super::scalar::weighted_sum_strided`].
#[target_feature(enable = "avx512f,fma")]
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
    // Up to four 16-lane column chunks stay in registers while the positions stream by.
    while d < hd {
        let mut masks = [0 as __mmask16; 4];
        let mut acc = [_mm512_setzero_ps(); 4];
        for c in 0..4 {
            let start = d + c * LANES;
            if start < hd {
                masks[c] = if hd - start >= LANES {
                    0xFFFF
                } else {
                    tail_mask(hd - start)
                };
                // SAFETY: the mask covers lanes start..min(start+16, hd) of `out` only.
                acc[c] = unsafe { load_masked(masks[c], po.wrapping_add(start)) };
            }
        }
        for (j, &pj) in p.iter().enumerate() {
            let vp = _mm512_set1_ps(pj);
            let row = pb.wrapping_add(j * stride);
            for c in 0..4 {
                if masks[c] != 0 {
                    // SAFETY: j*stride + start + lanes <= base.len() by the assertion above.
                    let v = unsafe { load_masked(masks[c], row.wrapping_add(d + c * LANES)) };
                    acc[c] = _mm512_fmadd_ps(vp, v, acc[c]);
                }
            }
        }
        for c in 0..4 {
            if masks[c] != 0 {
                // SAFETY: the mask covers lanes of `out` inside its length only.
                unsafe { _mm512_mask_storeu_ps(po.wrapping_add(d + c * LANES), masks[c], acc[c]) };
            }
        }
        d += 4 * LANES;
    }
}

/// Accumulator of a `G × R` attention tile (`G · R = 16`) whose sum [`reduce16`] leaves in lane
/// `lane` (lane `4k + j` holds accumulator `4j + k`). Query `g`, key row `r` uses lane `g · R + r`,
/// so each query's `R` scores come out contiguous.
const fn tile_acc(lane: usize) -> usize {
    4 * (lane % 4) + lane / 4
}

/// See [`super::scalar::dots_paged`]: `G` queries × `R` key rows per tile, `G · R = 16`.
#[target_feature(enable = "avx512f,fma")]
pub(super) fn dots_paged(a: &PagedAttention<'_>, scores: &mut [f32]) {
    match a.n {
        1 => dots_group::<1, 16>(a, scores),
        2 => dots_group::<2, 8>(a, scores),
        // Three queries run as four with the last one repeated (its results are not stored).
        _ => dots_group::<4, 4>(a, scores),
    }
}

/// Scores of `G` queries (rows past `a.n` repeat the last query and are not stored) over every
/// position below `a.max_len`, `R` key rows at a time; each score follows [`dot`]'s lane scheme
/// in its own accumulator, then one [`reduce16`] for the tile's 16 sums.
// Register tiles indexed by query and row read most clearly as index loops.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn dots_group<const G: usize, const R: usize>(a: &PagedAttention<'_>, scores: &mut [f32]) {
    debug_assert!(G * R == LANES && a.n <= G);
    let hd = a.head_dim;
    let full = hd - hd % LANES;
    let tail = tail_mask(hd - full);
    let qp: [*const f32; G] = std::array::from_fn(|g| a.query(g.min(a.n - 1)).as_ptr());
    let sp = scores.as_mut_ptr();
    let recip = _mm512_set1_ps(a.recip.unwrap_or(1.0));
    let divisor = _mm512_set1_ps(a.divisor);
    let mut keys = a.rows(a.kv.k, 0);
    let mut rows = [std::ptr::null::<f32>(); R];
    let mut j0 = 0;
    while j0 < a.max_len {
        // Positions past the end repeat the last row (their scores are not stored).
        for r in 0..R {
            rows[r] = if j0 + r < a.max_len {
                keys.next_row()
            } else {
                rows[r - 1]
            };
        }
        let mut acc = [_mm512_setzero_ps(); LANES];
        let mut i = 0;
        while i < full {
            let mut qv = [_mm512_setzero_ps(); G];
            for g in 0..G {
                // SAFETY: i + 16 <= head_dim, and every query row is checked by PagedAttention.
                qv[g] = unsafe { load(qp[g].wrapping_add(i)) };
            }
            for r in 0..R {
                // SAFETY: rows[r] is the head row of a position below max_len (checked by
                // PagedAttention), and i + 16 <= head_dim.
                let kv = unsafe { load(rows[r].wrapping_add(i)) };
                for g in 0..G {
                    let x = tile_acc(g * R + r);
                    acc[x] = _mm512_fmadd_ps(qv[g], kv, acc[x]);
                }
            }
            i += LANES;
        }
        if full < hd {
            let mut qv = [_mm512_setzero_ps(); G];
            for g in 0..G {
                // SAFETY: the mask covers lanes full..head_dim of a checked query row only.
                qv[g] = unsafe { load_masked(tail, qp[g].wrapping_add(full)) };
            }
            for r in 0..R {
                // SAFETY: the mask covers lanes full..head_dim of a checked head row only.
                let kv = unsafe { load_masked(tail, rows[r].wrapping_add(full)) };
                for g in 0..G {
                    let x = tile_acc(g * R + r);
                    acc[x] = _mm512_fmadd_ps(qv[g], kv, acc[x]);
                }
            }
        }
        let sums = reduce16(&acc);
        // x · recip equals x / divisor when recip is set (see PagedAttention::recip).
        let sums = if a.recip.is_some() {
            _mm512_mul_ps(sums, recip)
        } else {
            _mm512_div_ps(sums, divisor)
        };
        for g in 0..a.n {
            let valid = a.lens[g].saturating_sub(j0).min(R);
            if valid > 0 {
                let dst = sp.wrapping_add(g * a.max_len + j0);
                // SAFETY: query g's scores are scores[g · max_len..][..lens[g]] (inside `scores`,
                // checked n × max_len long) and j0 + valid <= lens[g].
                unsafe { store_query_lanes::<G, R>(sums, g, dst, valid) };
            }
        }
        j0 += R;
    }
}

/// Stores lanes `g · R .. g · R + valid` of `v` at `dst`.
///
/// # Safety
/// `dst..dst + valid` must be writable; `valid <= R`, `g < G`, `G · R = 16`.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn store_query_lanes<const G: usize, const R: usize>(
    v: __m512,
    g: usize,
    dst: *mut f32,
    valid: usize,
) {
    if valid == R && G == 4 {
        let part = match g {
            0 => _mm512_extractf32x4_ps::<0>(v),
            1 => _mm512_extractf32x4_ps::<1>(v),
            2 => _mm512_extractf32x4_ps::<2>(v),
            _ => _mm512_extractf32x4_ps::<3>(v),
        };
        // SAFETY: valid = R = 4 floats at dst are writable (caller).
        unsafe { _mm_storeu_ps(dst, part) };
    } else {
        let v = if g == 0 {
            v
        } else {
            // Move lanes g·R.. down to 0.. (the index wraps modulo 16; lanes past `valid` are
            // not stored).
            let idx = _mm512_add_epi32(
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                _mm512_set1_epi32((g * R) as i32),
            );
            _mm512_permutexvar_ps(idx, v)
        };
        let m = if valid >= LANES {
            0xFFFF
        } else {
            tail_mask(valid)
        };
        // SAFETY: the mask covers dst..dst + valid only, writable (caller).
        unsafe { _mm512_mask_storeu_ps(dst, m, v) };
    }
}

/// See [`super::scalar::weighted_sum_paged`]. Positions run in segments between the distinct
/// query lengths; inside a segment every query still active shares each value row load, and
/// each output element keeps its own FMA chain over increasing positions (the accumulators go
/// through `out` between segments, which does not round).
#[target_feature(enable = "avx512f,fma")]
pub(super) fn weighted_sum_paged(a: &PagedAttention<'_>, scores: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (start, end, active, n) in a.segments() {
        match n {
            1 => weighted_rows::<1>(a, scores, out, active, start, end),
            2 => weighted_rows::<2>(a, scores, out, active, start, end),
            3 => weighted_rows::<3>(a, scores, out, active, start, end),
            _ => weighted_rows::<4>(a, scores, out, active, start, end),
        }
    }
}

/// `o_g[d] = fma(p_g[j], v_j[d], o_g[d])` for positions `start..end` (all below every active
/// query's length) and the `G` queries `active[..G]`, in passes of up to 64 output columns.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn weighted_rows<const G: usize>(
    a: &PagedAttention<'_>,
    scores: &[f32],
    out: &mut [f32],
    active: [usize; MAX_ATTENTION_QUERIES],
    start: usize,
    end: usize,
) {
    let hd = a.head_dim;
    let mut d = 0;
    while d < hd {
        let left = hd - d;
        let last = if left.is_multiple_of(LANES) {
            0xFFFF
        } else {
            tail_mask(left % LANES)
        };
        match left {
            0..=16 => weighted_pass::<G, 1>(a, scores, out, active, start, end, d, last),
            17..=32 => weighted_pass::<G, 2>(a, scores, out, active, start, end, d, last),
            33..=48 => weighted_pass::<G, 3>(a, scores, out, active, start, end, d, last),
            49..=64 => weighted_pass::<G, 4>(a, scores, out, active, start, end, d, last),
            _ => weighted_pass::<G, 4>(a, scores, out, active, start, end, d, 0xFFFF),
        }
        d += 4 * LANES;
    }
}

/// One pass of [`weighted_rows`] over columns `d..d + 16·C` (the last chunk masked by `last`),
/// with `G × C` accumulators in registers.
// Register tiles indexed by query and column chunk read most clearly as index loops.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn weighted_pass<const G: usize, const C: usize>(
    a: &PagedAttention<'_>,
    scores: &[f32],
    out: &mut [f32],
    active: [usize; MAX_ATTENTION_QUERIES],
    start: usize,
    end: usize,
    d: usize,
    last: __mmask16,
) {
    let mask = |c: usize| if c + 1 == C { last } else { 0xFFFF };
    let op: [*mut f32; G] =
        std::array::from_fn(|g| out.as_mut_ptr().wrapping_add(active[g] * a.head_dim + d));
    let pp: [*const f32; G] =
        std::array::from_fn(|g| scores.as_ptr().wrapping_add(active[g] * a.max_len));
    let mut acc = [[_mm512_setzero_ps(); C]; G];
    for g in 0..G {
        for c in 0..C {
            // SAFETY: the mask covers columns d + 16c.. of query active[g]'s output, inside its
            // head_dim floats of `out` (checked n × head_dim long).
            acc[g][c] = unsafe { load_masked(mask(c), op[g].wrapping_add(c * LANES)) };
        }
    }
    let mut rows = a.rows(a.kv.v, start);
    for j in start..end {
        let row = rows.next_row().wrapping_add(d);
        let mut v = [_mm512_setzero_ps(); C];
        for c in 0..C {
            // SAFETY: position j < max_len, so its head row is inside the value pool (checked by
            // PagedAttention); the mask keeps columns below head_dim.
            v[c] = unsafe { load_masked(mask(c), row.wrapping_add(c * LANES)) };
        }
        for g in 0..G {
            // SAFETY: j < lens[active[g]] <= max_len: inside query active[g]'s score row.
            let p = _mm512_set1_ps(unsafe { pp[g].wrapping_add(j).read() });
            for c in 0..C {
                acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
            }
        }
    }
    for g in 0..G {
        for c in 0..C {
            // SAFETY: as for the loads above.
            unsafe { _mm512_mask_storeu_ps(op[g].wrapping_add(c * LANES), mask(c), acc[g][c]) };
        }
    }
}

/// See [`super::scalar::tile_4x4`]; accumulator `4c + r` holds `x[r]·w[c]` so that [`reduce16`]
/// returns the sums in row-major `[r][c]` order.
#[target_feature(enable = "avx512f,fma")]
pub fn tile_4x4(x: [&[f32]; 4], w: [&[f32]; 4]) -> [f32; 16] {
    let mut acc = [_mm512_setzero_ps(); 16];
    let k = x[0].len();
    assert!(
        x.iter().chain(w.iter()).all(|s| s.len() == k),
        "tile rows must have equal lengths"
    );
    let xp = x.map(|s| s.as_ptr());
    let wp = w.map(|s| s.as_ptr());
    let mut i = 0;
    while i + LANES <= k {
        let mut xv = [_mm512_setzero_ps(); 4];
        for r in 0..4 {
            // SAFETY: i + 16 <= k = x[r].len().
            xv[r] = unsafe { load(xp[r].wrapping_add(i)) };
        }
        for c in 0..4 {
            // SAFETY: i + 16 <= k = w[c].len().
            let wv = unsafe { load(wp[c].wrapping_add(i)) };
            for r in 0..4 {
                acc[4 * c + r] = _mm512_fmadd_ps(xv[r], wv, acc[4 * c + r]);
            }
        }
        i += LANES;
    }
    if i < k {
        let m = tail_mask(k - i);
        let mut xv = [_mm512_setzero_ps(); 4];
        for r in 0..4 {
            // SAFETY: the mask covers lanes i..k of x[r] only.
            xv[r] = unsafe { load_masked(m, xp[r].wrapping_add(i)) };
        }
        for c in 0..4 {
            // SAFETY: the mask covers lanes i..k of w[c] only.
            let wv = unsafe { load_masked(m, wp[c].wrapping_add(i)) };
            for r in 0..4 {
                acc[4 * c + r] = _mm512_fmadd_ps(xv[r], wv, acc[4 * c + r]);
            }
        }
    }
    to_array(reduce16(&acc))
}

/// Permutation turning [`reduce16`]'s lane order (lane `4k+j` = accumulator `4j+k`) into
/// accumulator order.
const TRANSPOSE4X4: [i32; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];

/// See [`super::scalar::tile_1x16`]: one input row against 16 weight rows (the decode path).
#[target_feature(enable = "avx512f,fma")]
pub fn tile_1x16(x: &[f32], w: [&[f32]; 16]) -> [f32; 16] {
    let k = x.len();
    assert!(
        w.iter().all(|s| s.len() == k),
        "tile rows must have equal lengths"
    );
    let xp = x.as_ptr();
    let wp = w.map(|s| s.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 16];
    let mut i = 0;
    while i + LANES <= k {
        // SAFETY: i + 16 <= k = x.len().
        let xv = unsafe { load(xp.wrapping_add(i)) };
        for c in 0..16 {
            // SAFETY: i + 16 <= k = w[c].len().
            let wv = unsafe { load(wp[c].wrapping_add(i)) };
            acc[c] = _mm512_fmadd_ps(xv, wv, acc[c]);
        }
        i += LANES;
    }
    if i < k {
        let m = tail_mask(k - i);
        // SAFETY: the mask covers lanes i..k of x only.
        let xv = unsafe { load_masked(m, xp.wrapping_add(i)) };
        for c in 0..16 {
            // SAFETY: the mask covers lanes i..k of w[c] only.
            let wv = unsafe { load_masked(m, wp[c].wrapping_add(i)) };
            acc[c] = _mm512_fmadd_ps(xv, wv, acc[c]);
        }
    }
    // SAFETY: TRANSPOSE4X4 holds exactly 16 readable i32 values.
    let idx = unsafe { _mm512_loadu_si512(TRANSPOSE4X4.as_ptr().cast()) };
    to_array(_mm512_permutexvar_ps(idx, reduce16(&acc)))
}

/// Sum of `x` with four independent accumulators (for the bandwidth probe only; not part of the
/// bit-exact contract).
#[target_feature(enable = "avx512f,fma")]
pub fn read_sum(x: &[f32]) -> f32 {
    let n = x.len();
    let p = x.as_ptr();
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 4 * LANES <= n {
        for (c, a) in acc.iter_mut().enumerate() {
            // SAFETY: i + 64 <= n.
            let v = unsafe { load(p.wrapping_add(i + c * LANES)) };
            *a = _mm512_add_ps(*a, v);
        }
        i += 4 * LANES;
    }
    let mut s = reduce1(_mm512_add_ps(
        _mm512_add_ps(acc[0], acc[1]),
        _mm512_add_ps(acc[2], acc[3]),
    ));
    for &v in &x[i..] {
        s += v;
    }
    s
}
