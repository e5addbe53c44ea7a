//! The CPU backend: f32 Llama forward over a paged KV pool, on a dedicated rayon pool.
//!
//! **Every per-token result is independent of the rest of the step**: projections go through
//! [`CpuKernels::matmul`] (one fixed accumulation order per output element whatever the number of
//! rows), norms/RoPE/SwiGLU work per row, and attention for a token reads its own sequence's
//! positions in order. A sequence's logits are therefore bit-identical alone, batched with others,
//! or prefilled in chunks of any size (tested).
//!
//! KV layout: per layer, K and V arrays `[num_blocks][block_size][n_kv_heads][head_dim]` f32,
//! allocated in [`CpuBackend::new`]. Scratch buffers grow only when a step has more tokens than
//! any before (no allocation per token).

use std::sync::{Arc, Mutex};

use rayon::prelude::*;
use zerolayer_kernels::cpu::{
    AttentionQueries, CpuKernels, MAX_ATTENTION_QUERIES, MatmulTarget, PagedKv,
};

use crate::backend::{Backend, KvCacheConfig, SeqChunk, check_sampling_sizes, sample_rows};
use crate::config::ModelConfig;
use crate::error::BackendError;
use crate::sampling::{SampleInput, SampleOutcome, Sampler};
use crate::weights::Weights;

/// Steps with fewer rows than this run element-wise work (norms, RoPE, SwiGLU) on the calling
/// thread: below it rayon's fork/join costs more than the work (a 768-wide row is ~0.2 µs).
const PAR_ROWS_MIN: usize = 8;

/// Per-step buffers, grown to the largest step seen.
#[derive(Debug, Default)]
struct Scratch {
    /// Residual stream `[T][dim]`.
    x: Vec<f32>,
    /// Normalised input of a projection `[T][dim]`.
    xb: Vec<f32>,
    /// Queries `[T][dim]`.
    q: Vec<f32>,
    /// Keys of the new tokens `[T][kv_dim]`.
    k: Vec<f32>,
    /// Values of the new tokens `[T][kv_dim]`.
    v: Vec<f32>,
    /// Attention output `[T][dim]`.
    att: Vec<f32>,
    /// Projection output before the residual add `[T][dim]`.
    tmp: Vec<f32>,
    /// SwiGLU gate `[T][hidden]`.
    hb: Vec<f32>,
    /// SwiGLU up `[T][hidden]`.
    hb2: Vec<f32>,
    /// Normalised last rows of the chunks wanting logits `[W][dim]`.
    fin: Vec<f32>,
    /// Position of each token of the step.
    pos: Vec<usize>,
    /// Chunk index of each token of the step.
    chunk: Vec<usize>,
    /// Attention groups of the step: (first token, count) — up to [`MAX_ATTENTION_QUERIES`]
    /// consecutive tokens of one chunk, which read the same keys and values.
    groups: Vec<(usize, usize)>,
    /// Attention output per (head, group) `[H][G][MAX_ATTENTION_QUERIES][head_dim]`.
    grouped: Vec<f32>,
    /// Logits for `forward_sample` `[W][vocab]`.
    logits: Vec<f32>,
}

/// Grows `v` to at least `len` elements (zero-filled), reporting allocation failure.
fn grow(v: &mut Vec<f32>, len: usize, what: &'static str) -> Result<(), BackendError> {
    if v.len() < len {
        v.try_reserve_exact(len - v.len())
            .map_err(|_| BackendError::OutOfMemory {
                what,
                bytes: len as u64 * 4,
            })?;
        v.resize(len, 0.0);
    }
    Ok(())
}

/// The CPU backend.
pub struct CpuBackend {
    /// Shared, validated weights.
    weights: Arc<Weights>,
    /// Pool geometry.
    kv: KvCacheConfig,
    /// SIMD kernels (detected ISA).
    kernels: CpuKernels,
    /// Dedicated worker threads: all parallel work of a step runs here.
    pool: rayon::ThreadPool,
    /// Per layer K pool `[num_blocks][block_size][kv_dim]`.
    k_cache: Vec<Vec<f32>>,
    /// Per layer V pool, same layout.
    v_cache: Vec<Vec<f32>>,
    /// RoPE `(cos, sin)` per position and pair: `[max_seq_len][head_dim/2][2]`.
    rope: Vec<f32>,
    /// Per-thread attention score rows (`max_seq_len` each), indexed by rayon thread index.
    scores: Vec<Mutex<Vec<f32>>>,
    /// Step buffers.
    scratch: Scratch,
    /// Sampling scratch for `forward_sample`.
    sampler: Sampler,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("config", self.weights.config())
            .field("kv", &self.kv)
            .field("isa", &self.kernels.isa())
            .field("threads", &self.pool.current_num_threads())
            .finish()
    }
}

/// Builds the RoPE table exactly like llama2.c: `freq = 1 / powf(theta, j / head_dim)` for the
/// even offset `j` inside a head, `val = pos * freq`, `(cosf(val), sinf(val))`.
fn rope_table(c: &ModelConfig) -> Vec<f32> {
    let hd = c.head_dim();
    let mut t = Vec::with_capacity(c.max_seq_len * hd);
    for pos in 0..c.max_seq_len {
        for j in (0..hd).step_by(2) {
            let freq = 1.0f32 / c.rope_theta.powf(j as f32 / hd as f32);
            let val = pos as f32 * freq;
            t.push(val.cos());
            t.push(val.sin());
        }
    }
    t
}

/// Rotates the pairs of every head of one row at position `pos` (llama2.c's formula, no fused
/// multiply-add: `v0' = v0·cos − v1·sin`, `v1' = v0·sin + v1·cos`).
fn apply_rope(row: &mut [f32], table_row: &[f32]) {
    let hd = table_row.len();
    for head in row.chunks_exact_mut(hd) {
        for (pair, cs) in head.chunks_exact_mut(2).zip(table_row.chunks_exact(2)) {
            let (v0, v1) = (pair[0], pair[1]);
            let (fcr, fci) = (cs[0], cs[1]);
            pair[0] = v0 * fcr - v1 * fci;
            pair[1] = v0 * fci + v1 * fcr;
        }
    }
}

/// The default worker count: the cores available to this process.
pub fn available_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl CpuBackend {
    /// Allocates the KV pool and a pool of `threads` workers (see [`available_threads`]), with
    /// the fastest kernels.
    pub fn new(
        weights: Arc<Weights>,
        kv: KvCacheConfig,
        threads: usize,
    ) -> Result<Self, BackendError> {
        Self::with_kernels(weights, kv, threads, CpuKernels::best())
    }

    /// [`CpuBackend::new`] with explicit kernels (tests compare instruction sets).
    pub fn with_kernels(
        weights: Arc<Weights>,
        kv: KvCacheConfig,
        threads: usize,
        kernels: CpuKernels,
    ) -> Result<Self, BackendError> {
        let bad = |reason: String| Err(BackendError::InvalidConfig { reason });
        kv.validate()?;
        if threads == 0 {
            return bad("threads must be at least 1".into());
        }
        let c = weights.config().clone();
        let per_layer = kv
            .num_blocks
            .checked_mul(kv.block_size)
            .and_then(|n| n.checked_mul(c.kv_dim()))
            .ok_or_else(|| BackendError::InvalidConfig {
                reason: "KV pool size overflows".into(),
            })?;
        let mut k_cache = Vec::with_capacity(c.n_layers);
        let mut v_cache = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            for cache in [&mut k_cache, &mut v_cache] {
                let mut layer = Vec::new();
                grow(&mut layer, per_layer, "KV pool")?;
                cache.push(layer);
            }
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("zerolayer-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::InvalidConfig {
                reason: format!("cannot start worker threads: {e}"),
            })?;
        let scores = (0..threads)
            .map(|_| Mutex::new(vec![0.0; MAX_ATTENTION_QUERIES * c.max_seq_len]))
            .collect();
        Ok(CpuBackend {
            rope: rope_table(&c),
            weights,
            kv,
            kernels,
            pool,
            k_cache,
            v_cache,
            scores,
            scratch: Scratch::default(),
            sampler: Sampler::new(),
        })
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// The kernels in use.
    pub fn kernels(&self) -> CpuKernels {
        self.kernels
    }

    /// Checks every chunk; returns (total tokens, chunks wanting logits).
    fn validate(&self, batch: &[SeqChunk<'_>]) -> Result<(usize, usize), BackendError> {
        let c = self.weights.config();
        if batch.is_empty() {
            return Err(BackendError::EmptyBatch);
        }
        let (mut tokens, mut wanting) = (0usize, 0usize);
        for (i, ch) in batch.iter().enumerate() {
            if ch.tokens.is_empty() {
                return Err(BackendError::EmptyChunk { chunk: i });
            }
            if let Some(&t) = ch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(BackendError::TokenOutOfRange {
                    chunk: i,
                    token: t,
                    vocab_size: c.vocab_size,
                });
            }
            let end = ch.start_pos.saturating_add(ch.tokens.len());
            if end > c.max_seq_len {
                return Err(BackendError::ContextOverflow {
                    chunk: i,
                    end,
                    max_seq_len: c.max_seq_len,
                });
            }
            self.kv.check_table(i, ch.block_table, end)?;
            tokens += ch.tokens.len();
            wanting += ch.want_logits as usize;
        }
        Ok((tokens, wanting))
    }

    /// Runs a validated step, writing `wanting × vocab` logits.
    fn run(
        &mut self,
        batch: &[SeqChunk<'_>],
        n_tok: usize,
        wanting: usize,
        logits: &mut [f32],
    ) -> Result<(), BackendError> {
        let c = self.weights.config().clone();
        let (d, kvd, hd, hid) = (c.dim, c.kv_dim(), c.head_dim(), c.hidden_dim);
        let s = &mut self.scratch;
        for (buf, len) in [
            (&mut s.x, n_tok * d),
            (&mut s.xb, n_tok * d),
            (&mut s.q, n_tok * d),
            (&mut s.att, n_tok * d),
            (&mut s.tmp, n_tok * d),
            (&mut s.k, n_tok * kvd),
            (&mut s.v, n_tok * kvd),
            (&mut s.hb, n_tok * hid),
            (&mut s.hb2, n_tok * hid),
            (&mut s.fin, wanting * d),
        ] {
            grow(buf, len, "step scratch")?;
        }
        s.pos.clear();
        s.chunk.clear();
        s.groups.clear();
        for (i, ch) in batch.iter().enumerate() {
            let first = s.pos.len();
            s.pos.extend(ch.start_pos..ch.start_pos + ch.tokens.len());
            s.chunk.extend(std::iter::repeat_n(i, ch.tokens.len()));
            let n = ch.tokens.len();
            s.groups.extend(
                (0..n)
                    .step_by(MAX_ATTENTION_QUERIES)
                    .map(|g| (first + g, (n - g).min(MAX_ATTENTION_QUERIES))),
            );
        }
        let group_len = MAX_ATTENTION_QUERIES * hd;
        grow(
            &mut s.grouped,
            c.n_heads * s.groups.len() * group_len,
            "step scratch",
        )?;
        let w = &*self.weights;
        let emb = w.token_embedding();
        for (row, &tok) in
            s.x.chunks_exact_mut(d)
                .zip(batch.iter().flat_map(|ch| ch.tokens))
        {
            row.copy_from_slice(&emb[tok as usize * d..(tok as usize + 1) * d]);
        }
        let kern = self.kernels;
        let (kv, rope, scores) = (self.kv, &self.rope, &self.scores);
        let (k_cache, v_cache) = (&mut self.k_cache, &mut self.v_cache);
        let eps = c.norm_eps;
        self.pool.install(|| {
            let x = &mut s.x[..n_tok * d];
            let xb = &mut s.xb[..n_tok * d];
            let q = &mut s.q[..n_tok * d];
            let att = &mut s.att[..n_tok * d];
            let tmp = &mut s.tmp[..n_tok * d];
            let kb = &mut s.k[..n_tok * kvd];
            let vb = &mut s.v[..n_tok * kvd];
            let hb = &mut s.hb[..n_tok * hid];
            let hb2 = &mut s.hb2[..n_tok * hid];
            let (pos, chunk, groups) = (&s.pos[..], &s.chunk[..], &s.groups[..]);
            let grouped = &mut s.grouped[..];
            let par = n_tok >= PAR_ROWS_MIN;
            for (l, lw) in w.layers().iter().enumerate() {
                rmsnorm_rows(kern, xb, x, &lw.rms_att, eps, d, par);
                kern.matmul(
                    xb,
                    d,
                    &mut [
                        MatmulTarget { w: &lw.wq, y: q },
                        MatmulTarget { w: &lw.wk, y: kb },
                        MatmulTarget { w: &lw.wv, y: vb },
                    ],
                );
                let rope_rows = |t: usize, row: &mut [f32]| {
                    apply_rope(row, &rope[pos[t] * hd..(pos[t] + 1) * hd])
                };
                if par {
                    q.par_chunks_exact_mut(d)
                        .enumerate()
                        .for_each(|(t, r)| rope_rows(t, r));
                } else {
                    q.chunks_exact_mut(d)
                        .enumerate()
                        .for_each(|(t, r)| rope_rows(t, r));
                }
                kb.chunks_exact_mut(kvd)
                    .enumerate()
                    .for_each(|(t, r)| rope_rows(t, r));
                // Store the new keys and values in the pool.
                let (kc, vc) = (&mut k_cache[l], &mut v_cache[l]);
                for t in 0..n_tok {
                    let table = batch[chunk[t]].block_table;
                    let block = table[pos[t] / kv.block_size] as usize;
                    let dst = (block * kv.block_size + pos[t] % kv.block_size) * kvd;
                    kc[dst..dst + kvd].copy_from_slice(&kb[t * kvd..(t + 1) * kvd]);
                    vc[dst..dst + kvd].copy_from_slice(&vb[t * kvd..(t + 1) * kvd]);
                }
                let (kc, vc) = (&k_cache[l][..], &v_cache[l][..]);
                // One unit = one head × one group of up to MAX_ATTENTION_QUERIES consecutive
                // tokens of a chunk: each key and value row loaded serves the whole group. The
                // kernel computes every query with exactly the operations of that query alone
                // (kernels/tests/bit_exact.rs), so results do not depend on the grouping, the
                // batch or the chunking.
                let n_groups = groups.len();
                let sqrt_hd = (hd as f32).sqrt();
                let unit = |u: usize, out: &mut [f32]| {
                    let (h, gi) = (u / n_groups, u % n_groups);
                    let (t, g) = groups[gi];
                    let kvh = h / (c.n_heads / c.n_kv_heads);
                    let mut lens = [0; MAX_ATTENTION_QUERIES];
                    for (i, len) in lens[..g].iter_mut().enumerate() {
                        *len = pos[t + i] + 1;
                    }
                    let slot = rayon::current_thread_index().unwrap_or(0) % scores.len();
                    // Poisoning would need a panic inside the kernels, which check shapes upfront.
                    let mut guard = scores[slot].lock().unwrap_or_else(|e| e.into_inner());
                    kern.attention_paged(
                        AttentionQueries {
                            q: &q[t * d + h * hd..],
                            stride: d,
                            head_dim: hd,
                            lens: &lens[..g],
                            score_divisor: sqrt_hd,
                        },
                        PagedKv {
                            k: kc,
                            v: vc,
                            table: batch[chunk[t]].block_table,
                            block_size: kv.block_size,
                            stride: kvd,
                            offset: kvh * hd,
                        },
                        &mut guard,
                        &mut out[..g * hd],
                    );
                };
                let grouped = &mut grouped[..c.n_heads * n_groups * group_len];
                if c.n_heads * n_groups > 1 {
                    grouped
                        .par_chunks_exact_mut(group_len)
                        .enumerate()
                        .for_each(|(u, out)| unit(u, out));
                } else {
                    grouped
                        .chunks_exact_mut(group_len)
                        .enumerate()
                        .for_each(|(u, out)| unit(u, out));
                }
                for (u, src) in grouped.chunks_exact(group_len).enumerate() {
                    let (h, (t, g)) = (u / n_groups, groups[u % n_groups]);
                    for (i, row) in src[..g * hd].chunks_exact(hd).enumerate() {
                        att[(t + i) * d + h * hd..][..hd].copy_from_slice(row);
                    }
                }
                kern.matmul(att, d, &mut [MatmulTarget { w: &lw.wo, y: tmp }]);
                add_rows(x, tmp);
                rmsnorm_rows(kern, xb, x, &lw.rms_ffn, eps, d, par);
                kern.matmul(
                    xb,
                    d,
                    &mut [
                        MatmulTarget { w: &lw.w1, y: hb },
                        MatmulTarget { w: &lw.w3, y: hb2 },
                    ],
                );
                if par {
                    hb.par_chunks_exact_mut(hid)
                        .zip(hb2.par_chunks_exact(hid))
                        .for_each(|(a, b)| kern.swiglu(a, b));
                } else {
                    kern.swiglu(hb, hb2);
                }
                kern.matmul(hb, hid, &mut [MatmulTarget { w: &lw.w2, y: tmp }]);
                add_rows(x, tmp);
            }
            // Final norm and classifier for the last token of each chunk wanting logits.
            let mut t_end = 0;
            let mut row = 0;
            for ch in batch {
                t_end += ch.tokens.len();
                if ch.want_logits {
                    let src = &x[(t_end - 1) * d..t_end * d];
                    kern.rmsnorm(&mut s.fin[row * d..(row + 1) * d], src, w.rms_final(), eps);
                    row += 1;
                }
            }
            if wanting > 0 {
                kern.matmul(
                    &s.fin[..wanting * d],
                    d,
                    &mut [MatmulTarget {
                        w: w.classifier(),
                        y: logits,
                    }],
                );
            }
        });
        Ok(())
    }
}

/// `out[t] = rmsnorm(x[t])` for every row.
fn rmsnorm_rows(
    kern: CpuKernels,
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    eps: f32,
    d: usize,
    par: bool,
) {
    if par {
        out.par_chunks_exact_mut(d)
            .zip(x.par_chunks_exact(d))
            .for_each(|(o, r)| kern.rmsnorm(o, r, w, eps));
    } else {
        out.chunks_exact_mut(d)
            .zip(x.chunks_exact(d))
            .for_each(|(o, r)| kern.rmsnorm(o, r, w, eps));
    }
}

/// Residual add `x += y`.
fn add_rows(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

impl Backend for CpuBackend {
    fn config(&self) -> &ModelConfig {
        self.weights.config()
    }

    fn kv_config(&self) -> KvCacheConfig {
        self.kv
    }

    fn forward(&mut self, batch: &[SeqChunk<'_>], logits: &mut [f32]) -> Result<(), BackendError> {
        let (n_tok, wanting) = self.validate(batch)?;
        let expected = wanting * self.weights.config().vocab_size;
        if logits.len() != expected {
            return Err(BackendError::BufferSize {
                what: "logits",
                expected,
                actual: logits.len(),
            });
        }
        self.run(batch, n_tok, wanting, logits)
    }

    fn forward_sample(
        &mut self,
        batch: &[SeqChunk<'_>],
        sampling: &[SampleInput<'_>],
        out: &mut [SampleOutcome],
    ) -> Result<(), BackendError> {
        let (n_tok, wanting) = self.validate(batch)?;
        check_sampling_sizes(wanting, sampling.len(), out.len())?;
        let vocab = self.weights.config().vocab_size;
        for input in sampling {
            if let Some(&token) = input.banned.iter().find(|&&b| b as usize >= vocab) {
                return Err(BackendError::BannedOutOfRange {
                    token,
                    vocab_size: vocab,
                });
            }
        }
        let mut logits = std::mem::take(&mut self.scratch.logits);
        let result = grow(&mut logits, wanting * vocab, "logits")
            .and_then(|()| self.run(batch, n_tok, wanting, &mut logits[..wanting * vocab]))
            .and_then(|()| {
                sample_rows(
                    &mut self.sampler,
                    &logits[..wanting * vocab],
                    vocab,
                    sampling,
                    out,
                )
            });
        self.scratch.logits = logits;
        result
    }

    fn copy_kv(&mut self, src: &[u32], dst: &[u32], len: usize) -> Result<(), BackendError> {
        let kv = self.kv;
        kv.check_table(0, src, len)?;
        kv.check_table(1, dst, len)?;
        let kvd = self.weights.config().kv_dim();
        let offset = |table: &[u32], p: usize| {
            (table[p / kv.block_size] as usize * kv.block_size + p % kv.block_size) * kvd
        };
        for cache in self.k_cache.iter_mut().chain(self.v_cache.iter_mut()) {
            for p in 0..len {
                let (s, t) = (offset(src, p), offset(dst, p));
                cache.copy_within(s..s + kvd, t);
            }
        }
        Ok(())
    }
}
