//! f32 CPU kernels with a **bit-exact, batch-invariant** arithmetic contract.
//!
//! # Why our own matmul
//! The engine requires that a sequence's greedy output be bit-identical whether it runs alone or
//! batched with others, and whether its prompt was prefilled at once or in chunks. General GEMM
//! libraries (the `gemm` crate included) pick blocking and reduction splits from the matrix shape,
//! so the same output element is summed in a different order for 1 row than for 512 rows. Here
//! every output element of a projection, `y[r][n] = Σ_k x[r][k]·w[n][k]`, is computed with one
//! fixed order no matter the number of rows, the tiling, the thread count or the instruction set:
//!
//! - **lane scheme**: lane `l ∈ 0..16` accumulates `x[k]·w[k]` for `k ≡ l (mod 16)` in increasing
//!   `k` with a fused multiply-add starting from +0 (a ragged tail adds nothing to lanes past the
//!   end), then the 16 lanes are reduced with the fixed tree of [`reduce16`];
//! - parallel work is split over output rows of the weight matrix only, never over `k`;
//! - the decode path (one input row, [`CpuKernels::matmul`] with `m = 1`) uses a 1×16 tile and the
//!   batched path a 4×4 tile, with the same per-element order.
//!
//! The scalar module is the definition; the AVX-512 path (one `__m512` per accumulator) and the
//! AVX2 path (two `__m256`) perform the same IEEE operations lane by lane, so all three paths are
//! bit-identical (tested). Element-wise kernels (exp, softmax, SwiGLU, attention sums) follow the
//! same rule: one documented operation sequence per element, see [`exp_f32`].
//!
//! # Safety
//! All `unsafe` code (intrinsics behind runtime feature detection, raw-pointer loops and the
//! disjoint parallel writes of the matmul) is inside this module; the API is safe and slice-based,
//! with shapes checked at the edge (a shape mismatch is a caller bug and panics with a message).

mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use std::sync::OnceLock;

use rayon::prelude::*;

pub use scalar::exp as exp_f32;
pub use scalar::reduce16;

/// Lanes of the reduction scheme: 16 f32 = one AVX-512 register (two AVX2 registers).
pub const LANES: usize = 16;

/// Most weight matrices one [`CpuKernels::matmul`] call may fuse (q/k/v is three).
pub const MAX_MATMUL_TARGETS: usize = 4;

/// Most query rows one [`CpuKernels::attention_paged`] call serves. Four queries × four key rows
/// are the AVX-512 path's 16 accumulators (one transposed [`reduce16`] per tile) and four queries
/// × four 16-lane output chunks its 16 weighted-sum accumulators: each key or value row loaded
/// from L2 then serves four queries, and the weighted sum has 16 independent FMA chains instead
/// of 4 (one query's chains are latency-bound).
pub const MAX_ATTENTION_QUERIES: usize = 4;

/// An instruction set the kernels can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust (`f32::mul_add`); the reference definition, compiled everywhere.
    Scalar,
    /// x86-64 AVX2 + FMA.
    Avx2,
    /// x86-64 AVX-512F (+ FMA).
    Avx512,
}

impl Isa {
    /// Every variant, fastest last.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// Whether this CPU can run the instruction set.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma"),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }

    /// The instruction sets this CPU supports, slowest first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// The fastest available instruction set, detected once and cached.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            Isa::ALL
                .into_iter()
                .rev()
                .find(|i| i.is_available())
                .unwrap_or(Isa::Scalar)
        })
    }

    /// Lower-case name (`scalar`, `avx2`, `avx512`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// How [`CpuKernels::matmul_with`] splits its work. Results do not depend on it (tested); it only
/// changes speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiling {
    /// Weight rows per parallel task (rounded up to a multiple of 16). Small enough that a task's
    /// weight block stays in L2 while every input row passes over it; large enough that rayon's
    /// per-task cost is negligible.
    pub rows_per_task: usize,
    /// Run tasks on the current rayon pool (`false`: on the calling thread, in order).
    pub parallel: bool,
}

impl Default for Tiling {
    fn default() -> Self {
        // 64 rows × 768..8192 floats = 192 KiB..2 MiB: an L2-sized weight block on this VM
        // (2 MiB L2 per core); decode of a 768-row matrix still yields 12 tasks for 2 threads.
        Tiling {
            rows_per_task: 64,
            parallel: true,
        }
    }
}

/// One weight matrix of a (possibly fused) matmul and where its output goes.
#[derive(Debug)]
pub struct MatmulTarget<'a> {
    /// Weights, row-major `[n][k]` (`n` output rows of the reduction length `k`).
    pub w: &'a [f32],
    /// Output, row-major `[m][n]`; fully overwritten.
    pub y: &'a mut [f32],
}

/// The keys and values of one KV head of one sequence in a paged pool (the CPU backend's layout:
/// per layer `[num_blocks][block_size][stride]` floats for K and the same for V).
///
/// Position `j` is row `j % block_size` of block `table[j / block_size]`; its head's
/// `head_dim` floats start at `(table[j / block_size] · block_size + j % block_size) · stride +
/// offset`.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    /// Key pool of one layer.
    pub k: &'a [f32],
    /// Value pool of the same layer, same layout as `k`.
    pub v: &'a [f32],
    /// The sequence's block table (block ids into the pools).
    pub table: &'a [u32],
    /// Positions per block.
    pub block_size: usize,
    /// Floats per position in the pools (all KV heads of a position: `kv_dim`).
    pub stride: usize,
    /// Where this KV head starts inside a position's row (`kv_head × head_dim`).
    pub offset: usize,
}

/// Query rows of one attention head that read the same keys and values (consecutive tokens of
/// one sequence, or a single decode token).
#[derive(Clone, Copy, Debug)]
pub struct AttentionQueries<'a> {
    /// Query `i` is `q[i * stride..][..head_dim]` (RoPE already applied).
    pub q: &'a [f32],
    /// Distance between consecutive query rows in `q` (the model dimension for rows of a
    /// `[tokens][dim]` buffer).
    pub stride: usize,
    /// Floats per head.
    pub head_dim: usize,
    /// Query `i` attends to positions `0..lens[i]` (causal: its own position + 1). At most
    /// [`MAX_ATTENTION_QUERIES`] entries; any order, but reads go up to the largest, so keep them
    /// close (consecutive tokens differ by one).
    pub lens: &'a [usize],
    /// Every score is divided by this (`sqrt(head_dim)` for Llama, like llama2.c).
    pub score_divisor: f32,
}

/// An attention call whose indices [`CpuKernels::attention_paged`] checked: every query row,
/// every pool row of positions `0..max_len` of `kv` (both pools) and the score rows lie inside
/// their slices. The instruction-set modules read through raw pointers on the strength of it,
/// without further checks; it can only be built by [`PagedAttention::new`].
struct PagedAttention<'a> {
    /// The query rows (checked: `(n - 1) · q_stride + head_dim <= q.len()`).
    q: &'a [f32],
    /// Distance between query rows.
    q_stride: usize,
    /// Floats per head (positive).
    head_dim: usize,
    /// Number of queries, `1..=MAX_ATTENTION_QUERIES`.
    n: usize,
    /// Positions per query (entries past `n` are 0).
    lens: [usize; MAX_ATTENTION_QUERIES],
    /// The largest of `lens`: positions `0..max_len` are readable, and query `i`'s scores live at
    /// `scores[i · max_len..][..lens[i]]`.
    max_len: usize,
    /// The score divisor.
    divisor: f32,
    /// `1 / divisor` when that is a power of two, so that `x · recip` equals `x / divisor` for
    /// every `x` (both are the correctly rounded value of the same real number): the SIMD paths
    /// then multiply instead of dividing. `None` otherwise.
    recip: Option<f32>,
    /// Keys and values (checked as described above).
    kv: PagedKv<'a>,
}

impl<'a> PagedAttention<'a> {
    /// Checks every index of an [`CpuKernels::attention_paged`] call (panicking with a message
    /// on a caller bug, like the other kernels).
    fn new(queries: AttentionQueries<'a>, kv: PagedKv<'a>, scores: usize, out: usize) -> Self {
        let AttentionQueries {
            q,
            stride: q_stride,
            head_dim,
            lens: lens_in,
            score_divisor: divisor,
        } = queries;
        let n = lens_in.len();
        assert!(
            (1..=MAX_ATTENTION_QUERIES).contains(&n),
            "attention_paged: 1 to {MAX_ATTENTION_QUERIES} queries, got {n}"
        );
        assert!(head_dim > 0, "attention_paged: head_dim must be positive");
        assert!(
            (n - 1)
                .checked_mul(q_stride)
                .and_then(|s| s.checked_add(head_dim))
                .is_some_and(|e| e <= q.len()),
            "attention_paged: query rows past the end of q"
        );
        let mut lens = [0; MAX_ATTENTION_QUERIES];
        lens[..n].copy_from_slice(lens_in);
        let max_len = lens.iter().copied().max().unwrap_or(0);
        assert_eq!(
            out,
            n * head_dim,
            "attention_paged: out must hold n × head_dim"
        );
        assert!(
            n.checked_mul(max_len).is_some_and(|s| s <= scores),
            "attention_paged: scores must hold n × max(lens)"
        );
        assert!(
            kv.block_size > 0 && kv.stride > 0,
            "attention_paged: block_size and stride must be positive"
        );
        assert!(
            kv.offset
                .checked_add(head_dim)
                .is_some_and(|e| e <= kv.stride),
            "attention_paged: head past the end of a pool row"
        );
        let block_len = kv
            .block_size
            .checked_mul(kv.stride)
            .expect("attention_paged: block size overflows");
        let blocks_k = kv.k.len() / block_len;
        let blocks_v = kv.v.len() / block_len;
        let needed = max_len.div_ceil(kv.block_size);
        assert!(
            kv.table.len() >= needed,
            "attention_paged: block table shorter than the positions"
        );
        // Block b's rows end at (b + 1) · block_len <= pool length, so every row of positions
        // 0..max_len (block < needed) with the head's floats (offset + head_dim <= stride) is
        // inside both pools.
        assert!(
            kv.table[..needed]
                .iter()
                .all(|&b| (b as usize) < blocks_k && (b as usize) < blocks_v),
            "attention_paged: block id past the end of a pool"
        );
        let bits = divisor.to_bits();
        let pow2 = divisor.is_normal() && divisor > 0.0 && bits & 0x007F_FFFF == 0;
        // A normal power of two up to 2^126 has an exact normal reciprocal.
        let recip = (pow2 && divisor <= 2f32.powi(126)).then(|| 1.0 / divisor);
        PagedAttention {
            q,
            q_stride,
            head_dim,
            n,
            lens,
            max_len,
            divisor,
            recip,
            kv,
        }
    }

    /// Query `i` (`i < n`).
    fn query(&self, i: usize) -> &'a [f32] {
        &self.q[i * self.q_stride..][..self.head_dim]
    }

    /// The pool offset of position `j`'s head row.
    fn row_offset(&self, j: usize) -> usize {
        let kv = &self.kv;
        (kv.table[j / kv.block_size] as usize * kv.block_size + j % kv.block_size) * kv.stride
            + kv.offset
    }

    /// The position segments of a weighted sum over the queries: consecutive ranges
    /// `start..end` between the distinct query lengths, each with the queries still active in it
    /// (those whose length exceeds `start`) and their count.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn segments(&self) -> Segments<'_, 'a> {
        Segments { a: self, start: 0 }
    }

    /// A cursor over `pool`'s head rows of positions `start..` (one table lookup per block).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn rows(&self, pool: &'a [f32], start: usize) -> RowCursor<'a> {
        let kv = &self.kv;
        let mut c = RowCursor {
            pool,
            table: kv.table,
            block_size: kv.block_size,
            stride: kv.stride,
            offset: kv.offset,
            block: start / kv.block_size,
            in_block: start % kv.block_size,
            row: std::ptr::null(),
        };
        if start < self.max_len {
            c.row = c.block_start().wrapping_add(c.in_block * c.stride);
        }
        c
    }
}

/// Iterator of [`PagedAttention::segments`]: `(start, end, active, n)` with `active[..n]` the
/// queries whose length exceeds `start` (every one of them reaches at least `end`).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Segments<'s, 'a> {
    /// The checked call.
    a: &'s PagedAttention<'a>,
    /// Where the next segment starts.
    start: usize,
}

impl Iterator for Segments<'_, '_> {
    type Item = (usize, usize, [usize; MAX_ATTENTION_QUERIES], usize);

    fn next(&mut self) -> Option<Self::Item> {
        let lens = &self.a.lens[..self.a.n];
        let start = self.start;
        let end = lens.iter().copied().filter(|&l| l > start).min()?;
        let mut active = [0; MAX_ATTENTION_QUERIES];
        let mut n = 0;
        for (i, &len) in lens.iter().enumerate() {
            if len > start {
                active[n] = i;
                n += 1;
            }
        }
        self.start = end;
        Some((start, end, active, n))
    }
}

/// Pointers to the head rows of consecutive positions of a pool, for the SIMD paths. Building
/// the pointers is safe; reading through them is sound only for positions below the
/// [`PagedAttention`]'s `max_len`, which its callers guarantee.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct RowCursor<'a> {
    /// The pool (K or V of one layer).
    pool: &'a [f32],
    /// The block table.
    table: &'a [u32],
    /// Positions per block.
    block_size: usize,
    /// Floats per position.
    stride: usize,
    /// The head's offset inside a row.
    offset: usize,
    /// Block index (into `table`) of the next position.
    block: usize,
    /// Row of the next position inside its block.
    in_block: usize,
    /// Pointer to the next position's head row (valid once the block was entered).
    row: *const f32,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl RowCursor<'_> {
    /// Pointer to the head row of row 0 of the current block.
    #[inline(always)]
    fn block_start(&self) -> *const f32 {
        let b = self.table[self.block] as usize;
        self.pool
            .as_ptr()
            .wrapping_add(b * self.block_size * self.stride + self.offset)
    }

    /// The next position's head row; advances by one position.
    #[inline(always)]
    fn next_row(&mut self) -> *const f32 {
        if self.in_block == self.block_size {
            self.block += 1;
            self.in_block = 0;
            self.row = self.block_start();
        }
        let r = self.row;
        self.in_block += 1;
        self.row = self.row.wrapping_add(self.stride);
        r
    }
}

/// Handle to the kernels of one instruction set; cheap to copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuKernels {
    /// Checked available at construction, which makes the `unsafe` dispatch below sound.
    isa: Isa,
}

impl Default for CpuKernels {
    fn default() -> Self {
        Self::best()
    }
}

/// Dispatches `$f($args)` to the module of `$isa`.
macro_rules! dispatch {
    ($isa:expr, $f:ident($($arg:expr),*)) => {
        match $isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `CpuKernels` is only built for an ISA whose features were detected.
            Isa::Avx512 => unsafe { avx512::$f($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `CpuKernels` is only built for an ISA whose features were detected.
            Isa::Avx2 => unsafe { avx2::$f($($arg),*) },
            _ => scalar::$f($($arg),*),
        }
    };
}

/// A raw output pointer shared by the tasks of one matmul; each task writes a disjoint set of
/// elements (its own output columns), so sharing it across threads is sound.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements through the pointer while the owning `&mut [f32]` is
// borrowed by the matmul call for its whole duration.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl CpuKernels {
    /// Kernels for the fastest instruction set of this CPU.
    pub fn best() -> Self {
        CpuKernels { isa: Isa::best() }
    }

    /// Kernels for `isa`, or `None` if this CPU lacks it.
    pub fn new(isa: Isa) -> Option<Self> {
        isa.is_available().then_some(CpuKernels { isa })
    }

    /// The instruction set in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Dot product with the lane scheme (see the module docs). Panics if lengths differ.
    pub fn dot(&self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len(), "dot: length mismatch");
        dispatch!(self.isa, dot(a, b))
    }

    /// Sum with the lane scheme.
    pub fn sum(&self, x: &[f32]) -> f32 {
        dispatch!(self.isa, sum(x))
    }

    /// `x[i] = exp(x[i])` with [`exp_f32`]'s exact operation sequence.
    pub fn exp_inplace(&self, x: &mut [f32]) {
        dispatch!(self.isa, exp_inplace(x))
    }

    /// Softmax in place: `max`, `e = exp(x - max)`, `s = sum(e)` (lane scheme), `x = e / s`.
    pub fn softmax(&self, x: &mut [f32]) {
        dispatch!(self.isa, softmax(x))
    }

    /// RMSNorm like llama2.c: `out[i] = w[i] * (x[i] / sqrt(dot(x,x)/n + eps))` with
    /// `inv = 1/sqrt(..)` computed once. Panics if lengths differ.
    pub fn rmsnorm(&self, out: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
        assert!(
            out.len() == x.len() && x.len() == weight.len(),
            "rmsnorm: length mismatch"
        );
        let inv = scalar::rms_inv_from_ss(self.dot(x, x), x.len(), eps);
        for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(weight) {
            *o = wi * (inv * xi);
        }
    }

    /// SwiGLU like llama2.c: `h1[i] = (h1[i] * (1 / (1 + exp(-h1[i])))) * h3[i]`.
    pub fn swiglu(&self, h1: &mut [f32], h3: &[f32]) {
        assert_eq!(h1.len(), h3.len(), "swiglu: length mismatch");
        dispatch!(self.isa, swiglu(h1, h3))
    }

    /// Attention scores: `out[j] = dot(q, base[j*stride ..][..q.len()])`. Panics if the last
    /// row would read past `base`.
    pub fn dots_strided(&self, q: &[f32], base: &[f32], stride: usize, out: &mut [f32]) {
        if let Some(last) = out.len().checked_sub(1) {
            assert!(
                last.checked_mul(stride)
                    .and_then(|s| s.checked_add(q.len()))
                    .is_some_and(|e| e <= base.len()),
                "dots_strided: rows past the end of base"
            );
        }
        dispatch!(self.isa, dots_strided(q, base, stride, out))
    }

    /// Attention values: `out[d] = fma(p[j], base[j*stride + d], out[d])` for `j` in increasing
    /// order (accumulates into `out`). Panics if the last row would read past `base`.
    pub fn weighted_sum_strided(&self, out: &mut [f32], p: &[f32], base: &[f32], stride: usize) {
        if let Some(last) = p.len().checked_sub(1) {
            assert!(
                last.checked_mul(stride)
                    .and_then(|s| s.checked_add(out.len()))
                    .is_some_and(|e| e <= base.len()),
                "weighted_sum_strided: rows past the end of base"
            );
        }
        dispatch!(self.isa, weighted_sum_strided(out, p, base, stride))
    }

    /// Attention of up to [`MAX_ATTENTION_QUERIES`] queries of one head over a paged KV cache,
    /// each with exactly the operation sequence of a query computed alone:
    ///
    /// 1. `s[j] = dot(q_i, k_j) / score_divisor` for `j < lens[i]` ([`CpuKernels::dot`]'s lane
    ///    scheme);
    /// 2. [`CpuKernels::softmax`] of `s[..lens[i]]`;
    /// 3. `o[d] = +0`, then `o[d] = fma(s[j], v_j[d], o[d])` for `j` increasing.
    ///
    /// Query `i`'s output is `out[i · head_dim..][..head_dim]` (fully overwritten). `scores` is
    /// scratch of at least `lens.len() × max(lens)` floats (query `i`'s probabilities are left at
    /// `scores[i · max(lens)..][..lens[i]]`). The queries share every key and value row they load,
    /// and the block table is walked once per call. Panics (a caller bug) if any row, block id or
    /// buffer is out of range; everything is checked here, before any arithmetic.
    pub fn attention_paged(
        &self,
        queries: AttentionQueries<'_>,
        kv: PagedKv<'_>,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let a = PagedAttention::new(queries, kv, scores.len(), out.len());
        dispatch!(self.isa, dots_paged(&a, scores));
        for i in 0..a.n {
            let s = &mut scores[i * a.max_len..][..a.lens[i]];
            dispatch!(self.isa, softmax(s));
        }
        dispatch!(self.isa, weighted_sum_paged(&a, scores, out));
    }

    /// Sum of `x` as fast as possible (independent accumulators; **not** the lane scheme). Used to
    /// measure read bandwidth.
    pub fn read_sum(&self, x: &[f32]) -> f32 {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `CpuKernels` is only built for an ISA whose features were detected.
            Isa::Avx512 => unsafe { avx512::read_sum(x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `CpuKernels` is only built for an ISA whose features were detected.
            Isa::Avx2 => unsafe { avx2::read_sum(x) },
            _ => x.iter().sum(),
        }
    }

    /// `y = x · wᵀ` for every target: `x` is `[m][k]`, each `w` is `[n][k]`, each `y` is `[m][n]`.
    /// Runs on the current rayon pool (call inside `ThreadPool::install` to pick the pool),
    /// split over weight rows with [`Tiling::default`]. Every output element follows the lane
    /// scheme, so row `r` of `y` does not depend on `m`, on the other rows, or on the tiling.
    ///
    /// Panics if shapes disagree or more than [`MAX_MATMUL_TARGETS`] targets are given.
    pub fn matmul(&self, x: &[f32], k: usize, targets: &mut [MatmulTarget<'_>]) {
        self.matmul_with(Tiling::default(), x, k, targets)
    }

    /// [`CpuKernels::matmul`] with an explicit work split (for tests and benchmarks).
    pub fn matmul_with(
        &self,
        tiling: Tiling,
        x: &[f32],
        k: usize,
        targets: &mut [MatmulTarget<'_>],
    ) {
        assert!(k > 0, "matmul: k must be positive");
        assert_eq!(x.len() % k, 0, "matmul: x is not a whole number of rows");
        assert!(
            targets.len() <= MAX_MATMUL_TARGETS,
            "matmul: too many fused targets"
        );
        let m = x.len() / k;
        let rows_per_task = tiling.rows_per_task.max(1).div_ceil(16) * 16;
        // Per target: (weights, n, output pointer, first task index).
        let mut plan: [(&[f32], usize, OutPtr, usize); MAX_MATMUL_TARGETS] =
            [(&[], 0, OutPtr(std::ptr::null_mut()), 0); MAX_MATMUL_TARGETS];
        let mut tasks = 0;
        for (slot, t) in plan.iter_mut().zip(targets.iter_mut()) {
            assert_eq!(t.w.len() % k, 0, "matmul: w is not a whole number of rows");
            let n = t.w.len() / k;
            assert_eq!(t.y.len(), m * n, "matmul: y has the wrong size");
            *slot = (t.w, n, OutPtr(t.y.as_mut_ptr()), tasks);
            tasks += n.div_ceil(rows_per_task);
        }
        if m == 0 || tasks == 0 {
            return;
        }
        let plan = &plan[..targets.len()];
        let isa = self.isa;
        let run = |task: usize| {
            // The target owning this task: the last one whose first task is <= task.
            let (w, n, out, first) = *plan
                .iter()
                .rev()
                .find(|p| p.3 <= task && p.1 > 0)
                // Invariant: task < total tasks, and target 0 starts at 0.
                .expect("every task index belongs to a target");
            let c0 = (task - first) * rows_per_task;
            let c1 = (c0 + rows_per_task).min(n);
            matmul_block(isa, x, m, k, w, n, c0, c1, out);
        };
        if tiling.parallel {
            (0..tasks).into_par_iter().for_each(run);
        } else {
            (0..tasks).for_each(run);
        }
    }
}

/// Computes columns `c0..c1` of `y = x · wᵀ` (`x: [m][k]`, `w: [n][k]`, `y: [m][n]` at `out`).
#[allow(clippy::too_many_arguments)]
fn matmul_block(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    n: usize,
    c0: usize,
    c1: usize,
    out: OutPtr,
) {
    debug_assert!(c0 < c1 && c1 <= n && x.len() == m * k && w.len() == n * k);
    let xrow = |r: usize| &x[r * k..(r + 1) * k];
    let wrow = |c: usize| &w[c * k..(c + 1) * k];
    let store = |r: usize, c: usize, v: f32| {
        debug_assert!(r < m && c0 <= c && c < c1);
        // SAFETY: r < m and c < n, so r*n + c is inside the y slice that `out` points to; this
        // task is the only writer of columns c0..c1 (tasks own disjoint column ranges).
        unsafe { out.0.wrapping_add(r * n + c).write(v) };
    };
    if m == 1 {
        // Decode: one input row against 16 weight rows at a time; a ragged end repeats the last
        // row (its extra results are discarded, the kept ones are unaffected).
        let mut c = c0;
        while c < c1 {
            let rows: [&[f32]; 16] = std::array::from_fn(|i| wrow((c + i).min(c1 - 1)));
            let res = dispatch!(isa, tile_1x16(xrow(0), rows));
            for (i, &v) in res.iter().enumerate().take(c1 - c) {
                store(0, c + i, v);
            }
            c += 16;
        }
        return;
    }
    let mut r = 0;
    while r < m {
        let xs: [&[f32]; 4] = std::array::from_fn(|i| xrow((r + i).min(m - 1)));
        let mut c = c0;
        while c < c1 {
            let ws: [&[f32]; 4] = std::array::from_fn(|i| wrow((c + i).min(c1 - 1)));
            let res = dispatch!(isa, tile_4x4(xs, ws));
            for i in 0..(m - r).min(4) {
                for j in 0..(c1 - c).min(4) {
                    store(r + i, c + j, res[4 * i + j]);
                }
            }
            c += 4;
        }
        r += 4;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce16_pairs_lanes_in_the_documented_tree() {
        // Values chosen so that any other pairing rounds differently.
        let mut s = [0.0f32; 16];
        for (i, v) in s.iter_mut().enumerate() {
            *v = 1.0 + (i as f32) * 1e-7 * if i % 3 == 0 { 1e7 } else { 1.0 };
        }
        let t: Vec<f32> = (0..8).map(|i| s[i] + s[i + 8]).collect();
        let u: Vec<f32> = (0..4).map(|i| t[i] + t[i + 4]).collect();
        assert_eq!(
            reduce16(&s).to_bits(),
            ((u[0] + u[2]) + (u[1] + u[3])).to_bits()
        );
    }

    #[test]
    fn scalar_exp_is_close_to_std_exp() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp_f32(x), x.exp());
            assert!(((a - b) / b).abs() < 3e-7, "exp({x}) = {a}, std {b}");
            x += 0.0137;
        }
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
    }
}
