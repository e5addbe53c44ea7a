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
