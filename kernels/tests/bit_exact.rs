//! The kernels' arithmetic contract: every instruction set returns bit-identical results, and a
//! matmul row does not depend on the batch size or the tiling.

use proptest::prelude::*;
use zerolayer_kernels::cpu::{
    AttentionQueries, CpuKernels, Isa, MAX_ATTENTION_QUERIES, MatmulTarget, PagedKv, Tiling,
};

fn kernels() -> Vec<CpuKernels> {
    Isa::available()
        .into_iter()
        .filter_map(CpuKernels::new)
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Vectors of `len` values in [-2, 2] with a sprinkling of larger magnitudes.
fn values(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(prop_oneof![8 => -2.0f32..2.0, 1 => -300.0f32..300.0], len)
}

fn naive_matmul(x: &[f32], w: &[f32], k: usize) -> Vec<f64> {
    let (m, n) = (x.len() / k, w.len() / k);
    let mut y = vec![0.0; m * n];
    for r in 0..m {
        for c in 0..n {
            y[r * n + c] = (0..k)
                .map(|i| x[r * k + i] as f64 * w[c * k + i] as f64)
                .sum();
        }
    }
    y
}

/// Deterministic values in [-2, 2) with one in 16 scaled by 40 (sharp softmax peaks), from a
/// splitmix64 stream: pools of 10⁵ floats per case are too many for proptest to shrink.
fn seeded(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let v = (z >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
            if z & 15 == 0 { v * 40.0 } else { v }
        })
        .collect()
}

/// One query alone, the way the CPU backend computed attention before the multi-query kernel:
/// one `dots_strided` and one `weighted_sum_strided` call per block, the division, and the
/// softmax. Returns (probabilities, output).
fn attention_alone(
    kern: CpuKernels,
    q: &[f32],
    kv: &PagedKv<'_>,
    len: usize,
    divisor: f32,
) -> (Vec<f32>, Vec<f32>) {
    let bs = kv.block_size;
    let base = |b: usize| kv.table[b] as usize * bs * kv.stride + kv.offset;
    let mut sc = vec![0.0; len];
    for (b, run) in sc.chunks_mut(bs).enumerate() {
        kern.dots_strided(q, &kv.k[base(b)..], kv.stride, run);
    }
    for v in sc.iter_mut() {
        *v /= divisor;
    }
    kern.softmax(&mut sc);
    let mut out = vec![0.0; q.len()];
    for (b, run) in sc.chunks(bs).enumerate() {
        kern.weighted_sum_strided(&mut out, run, &kv.v[base(b)..], kv.stride);
    }
    (sc, out)
}

/// A paged pool for attention tests: `blocks` blocks of `block_size` positions × `stride` floats,
/// and a block table visiting them in a scrambled order.
struct Pool {
    k: Vec<f32>,
    v: Vec<f32>,
    table: Vec<u32>,
    block_size: usize,
    stride: usize,
}

impl Pool {
    fn new(blocks: usize, block_size: usize, stride: usize, seed: u64) -> Pool {
        let len = blocks * block_size * stride;
        // Table entry b is block (b · 7 + 3) mod blocks when 7 is coprime to blocks, else b
        // reversed: either way a permutation that is not the identity.
        let table = (0..blocks)
            .map(|b| {
                if !blocks.is_multiple_of(7) {
                    ((b * 7 + 3) % blocks) as u32
                } else {
                    (blocks - 1 - b) as u32
                }
            })
            .collect();
        Pool {
            k: seeded(len, seed),
            v: seeded(len, seed ^ 0xA5A5),
            table,
            block_size,
            stride,
        }
    }

    fn head(&self, offset: usize) -> PagedKv<'_> {
        PagedKv {
            k: &self.k,
            v: &self.v,
            table: &self.table,
            block_size: self.block_size,
            stride: self.stride,
            offset,
        }
    }
}

/// Runs `attention_paged` for the queries `q[i * q_stride..]` with `lens` and checks every
/// query's output and probabilities against [`attention_alone`] on the scalar kernels.
fn check_group_matches_alone(
    pool: &Pool,
    offset: usize,
    q: &[f32],
    q_stride: usize,
    head_dim: usize,
    lens: &[usize],
) -> Result<(), TestCaseError> {
    let divisor = (head_dim as f32).sqrt();
    let kv = pool.head(offset);
    let reference = CpuKernels::new(Isa::Scalar).unwrap();
    let want: Vec<_> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            attention_alone(reference, &q[i * q_stride..][..head_dim], &kv, len, divisor)
        })
        .collect();
    let max_len = lens.iter().copied().max().unwrap_or(0);
    for kern in kernels() {
        let mut scores = vec![f32::NAN; lens.len() * max_len];
        let mut out = vec![f32::NAN; lens.len() * head_dim];
        let queries = AttentionQueries {
            q,
            stride: q_stride,
            head_dim,
            lens,
            score_divisor: divisor,
        };
        kern.attention_paged(queries, kv, &mut scores, &mut out);
        for (i, (p, o)) in want.iter().enumerate() {
            prop_assert_eq!(
                bits(&out[i * head_dim..][..head_dim]),
                bits(o),
                "output of query {} of {:?} (head_dim {}) on {:?}",
                i,
                lens,
                head_dim,
                kern.isa()
            );
            prop_assert_eq!(
                bits(&scores[i * max_len..][..lens[i]]),
                bits(p),
                "probabilities of query {} of {:?} on {:?}",
                i,
                lens,
                kern.isa()
            );
        }
    }
    Ok(())
}

fn matmul(kern: CpuKernels, tiling: Tiling, x: &[f32], w: &[f32], k: usize) -> Vec<f32> {
    let n = w.len() / k;
    let mut y = vec![f32::NAN; x.len() / k * n];
    kern.matmul_with(tiling, x, k, &mut [MatmulTarget { w, y: &mut y }]);
    y
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn vector_kernels_are_bit_identical_on_every_isa(a in values(0..200), seed in any::<u64>()) {
        let b: Vec<f32> = a.iter().enumerate().map(|(i, v)| v * 0.5 + ((seed >> (i % 64)) & 1) as f32).collect();
        let reference = CpuKernels::new(Isa::Scalar).unwrap();
        for kern in kernels() {
            prop_assert_eq!(kern.dot(&a, &b).to_bits(), reference.dot(&a, &b).to_bits(), "dot on {:?}", kern.isa());
            prop_assert_eq!(kern.sum(&a).to_bits(), reference.sum(&a).to_bits(), "sum on {:?}", kern.isa());
            let (mut e1, mut e2) = (a.clone(), a.clone());
            kern.exp_inplace(&mut e1);
            reference.exp_inplace(&mut e2);
            prop_assert_eq!(bits(&e1), bits(&e2), "exp on {:?}", kern.isa());
            let (mut s1, mut s2) = (a.clone(), a.clone());
            kern.softmax(&mut s1);
            reference.softmax(&mut s2);
            prop_assert_eq!(bits(&s1), bits(&s2), "softmax on {:?}", kern.isa());
            let (mut g1, mut g2) = (a.clone(), a.clone());
            kern.swiglu(&mut g1, &b);
            reference.swiglu(&mut g2, &b);
            prop_assert_eq!(bits(&g1), bits(&g2), "swiglu on {:?}", kern.isa());
            let (mut n1, mut n2) = (vec![0.0; a.len()], vec![0.0; a.len()]);
            kern.rmsnorm(&mut n1, &a, &b, 1e-5);
            reference.rmsnorm(&mut n2, &a, &b, 1e-5);
            prop_assert_eq!(bits(&n1), bits(&n2), "rmsnorm on {:?}", kern.isa());
        }
    }

    #[test]
    fn attention_kernels_are_bit_identical_on_every_isa(
        hd in 1usize..80, rows in 1usize..20, extra in 0usize..20, base in values(2000..2001),
    ) {
        let stride = hd + extra;
        prop_assume!((rows - 1) * stride + hd <= base.len());
        let q = &base[1500..1500 + hd];
        let reference = CpuKernels::new(Isa::Scalar).unwrap();
        let mut want = vec![0.0; rows];
        reference.dots_strided(q, &base, stride, &mut want);
        let p: Vec<f32> = base[1000..1000 + rows].to_vec();
        let mut want_v = base[1800..1800 + hd].to_vec();
        reference.weighted_sum_strided(&mut want_v, &p, &base, stride);
        for kern in kernels() {
            let mut got = vec![0.0; rows];
            kern.dots_strided(q, &base, stride, &mut got);
            prop_assert_eq!(bits(&got), bits(&want), "dots on {:?}", kern.isa());
            let mut got_v = base[1800..1800 + hd].to_vec();
            kern.weighted_sum_strided(&mut got_v, &p, &base, stride);
            prop_assert_eq!(bits(&got_v), bits(&want_v), "weighted sum on {:?}", kern.isa());
        }
    }

    /// The multi-query paged kernel against each query alone through the per-block path, for
    /// random head sizes (ragged 16-lane tails), KV-head offsets, block sizes, group sizes and
    /// lengths: consecutive (a prefill group's causal mask) or arbitrary.
    #[test]
    fn paged_attention_of_a_group_equals_each_query_alone_on_every_isa(
        head_dim in 1usize..80,
        kv_heads in 1usize..4,
        kv_head in 0usize..4,
        block_size in 1usize..20,
        first_len in 1usize..70,
        n in 1usize..=MAX_ATTENTION_QUERIES,
        consecutive in any::<bool>(),
        jitter in prop::collection::vec(0usize..70, MAX_ATTENTION_QUERIES),
        seed in any::<u64>(),
    ) {
        let kv_head = kv_head % kv_heads;
        let stride = head_dim * kv_heads + (seed % 3) as usize;
        let lens: Vec<usize> = (0..n)
            .map(|i| if consecutive { first_len + i } else { jitter[i] })
            .collect();
        let max_len = lens.iter().copied().max().unwrap();
        let blocks = max_len.div_ceil(block_size) + 2;
        let pool = Pool::new(blocks, block_size, stride, seed);
        let q_stride = head_dim + 5;
        let q = seeded(n * q_stride, seed ^ 0x5151);
        check_group_matches_alone(&pool, kv_head * head_dim, &q, q_stride, head_dim, &lens)?;
    }

    #[test]
    fn matmul_rows_are_bit_identical_for_batch_sizes_1_to_9_tilings_and_isas(
        k in 1usize..300, n in 1usize..70, data in values(9 * 300 + 70 * 300..9 * 300 + 70 * 300 + 1),
    ) {
        let x_all = &data[..9 * k];
        let w = &data[9 * 300..9 * 300 + n * k];
        let reference = CpuKernels::new(Isa::Scalar).unwrap();
        // Row i computed alone is the reference for row i in every batch.
        let alone: Vec<Vec<f32>> = (0..9)
            .map(|i| matmul(reference, Tiling::default(), &x_all[i * k..(i + 1) * k], w, k))
            .collect();
        let tilings = [
            Tiling::default(),
            Tiling { rows_per_task: 16, parallel: true },
            Tiling { rows_per_task: 1000, parallel: false },
        ];
        for kern in kernels() {
            for tiling in tilings {
                for m in 1..=9 {
                    let y = matmul(kern, tiling, &x_all[..m * k], w, k);
                    for (i, want) in alone.iter().enumerate().take(m) {
                        prop_assert_eq!(
                            bits(&y[i * n..(i + 1) * n]), bits(want),
                            "row {} of a batch of {} on {:?} with {:?}", i, m, kern.isa(), tiling
                        );
                    }
                }
            }
        }
        // And it is the right product.
        let exact = naive_matmul(x_all, w, k);
        let y = matmul(CpuKernels::best(), Tiling::default(), x_all, w, k);
        for (got, want) in y.iter().zip(&exact) {
            let scale = 1e-5 * (k as f64) * 300.0 * 300.0;
            prop_assert!((*got as f64 - want).abs() <= scale.max(1e-3), "{} vs {}", got, want);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    /// Rows longer than an L1-resident tile (k > 512) must still match the scalar definition and
    /// the single-row decode path.
    #[test]
    fn long_reductions_are_bit_identical_across_batch_sizes_and_isas(
        k in 513usize..1400, n in 1usize..40, data in values(9 * 1400 + 40 * 1400..9 * 1400 + 40 * 1400 + 1),
    ) {
        let x_all = &data[..9 * k];
        let w = &data[9 * 1400..9 * 1400 + n * k];
        let reference = CpuKernels::new(Isa::Scalar).unwrap();
        let want = matmul(reference, Tiling::default(), x_all, w, k);
        for kern in kernels() {
            for m in [1, 2, 5, 9] {
                let y = matmul(kern, Tiling { rows_per_task: 16, parallel: true }, &x_all[..m * k], w, k);
                prop_assert_eq!(bits(&y), bits(&want[..m * n]), "batch {} on {:?}", m, kern.isa());
            }
        }
    }
}

/// `dummy:small`'s attention shape (head_dim 64, 12 KV heads, blocks of 16) over a long cached
/// context: every group of a 23-token chunk (groups of 4, 4, …, 3) equals its queries alone.
#[test]
fn paged_attention_at_the_dummy_small_shape_equals_each_query_alone() {
    let (head_dim, heads, block_size) = (64, 12, 16);
    let pool = Pool::new(40, block_size, heads * head_dim, 7);
    let q = seeded(23 * heads * head_dim, 11);
    let start = 571;
    for head in [0, 5, 11] {
        for t0 in (0..23).step_by(MAX_ATTENTION_QUERIES) {
            let n = (23 - t0).min(MAX_ATTENTION_QUERIES);
            let lens: Vec<usize> = (0..n).map(|i| start + t0 + i + 1).collect();
            let rows = &q[t0 * heads * head_dim + head * head_dim..];
            check_group_matches_alone(
                &pool,
                head * head_dim,
                rows,
                heads * head_dim,
                head_dim,
                &lens,
            )
            .unwrap();
        }
    }
}

#[test]
fn paged_attention_of_empty_queries_writes_zeros() {
    let pool = Pool::new(2, 4, 8, 3);
    let q = seeded(16, 4);
    let mut out = vec![f32::NAN; 16];
    let queries = AttentionQueries {
        q: &q,
        stride: 8,
        head_dim: 8,
        lens: &[0, 0],
        score_divisor: 8f32.sqrt(),
    };
    for kern in kernels() {
        kern.attention_paged(queries, pool.head(0), &mut [], &mut out);
        assert!(out.iter().all(|&v| v.to_bits() == 0), "{:?}", kern.isa());
    }
}

fn paged_call(lens: &[usize], table: &[u32], offset: usize, scores: usize) {
    let pool = Pool::new(3, 4, 16, 1);
    let q = seeded(64, 2);
    let kv = PagedKv {
        table,
        offset,
        ..pool.head(0)
    };
    let queries = AttentionQueries {
        q: &q,
        stride: 8,
        head_dim: 8,
        lens,
        score_divisor: 8f32.sqrt(),
    };
    let mut scores = vec![0.0; scores];
    let mut out = vec![0.0; lens.len() * 8];
    CpuKernels::best().attention_paged(queries, kv, &mut scores, &mut out);
}

#[test]
fn paged_attention_accepts_a_call_at_the_edges_of_its_buffers() {
    // 3 blocks × 4 positions; the last head (offset 8) of the last block; scores exactly n × 12.
    paged_call(&[9, 12, 10, 11], &[2, 0, 1], 8, 4 * 12);
}

#[test]
#[should_panic(expected = "block id past the end of a pool")]
fn paged_attention_rejects_a_block_id_past_the_pool() {
    paged_call(&[9], &[0, 1, 3], 0, 12);
}

#[test]
#[should_panic(expected = "block table shorter than the positions")]
fn paged_attention_rejects_positions_past_the_block_table() {
    paged_call(&[13], &[0, 1, 2], 0, 13);
}

#[test]
#[should_panic(expected = "head past the end of a pool row")]
fn paged_attention_rejects_a_head_past_the_row() {
    paged_call(&[4], &[0], 9, 4);
}

#[test]
#[should_panic(expected = "scores must hold n × max(lens)")]
fn paged_attention_rejects_short_score_scratch() {
    paged_call(&[4, 5], &[0, 1], 0, 9);
}

#[test]
#[should_panic(expected = "1 to 4 queries")]
fn paged_attention_rejects_more_than_four_queries() {
    paged_call(&[1, 2, 3, 4, 5], &[0, 1], 0, 25);
}

#[test]
fn fused_matmul_targets_equal_separate_matmuls() {
    let k = 96;
    let x: Vec<f32> = (0..5 * k)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
        .collect();
    let w1: Vec<f32> = (0..40 * k)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) / 31.0)
        .collect();
    let w2: Vec<f32> = (0..24 * k)
        .map(|i| ((i * 29 % 89) as f32 - 44.0) / 23.0)
        .collect();
    let kern = CpuKernels::best();
    let (mut y1, mut y2) = (vec![0.0; 5 * 40], vec![0.0; 5 * 24]);
    kern.matmul(
        &x,
        k,
        &mut [
            MatmulTarget { w: &w1, y: &mut y1 },
            MatmulTarget { w: &w2, y: &mut y2 },
        ],
    );
    assert_eq!(
        bits(&y1),
        bits(&matmul(kern, Tiling::default(), &x, &w1, k))
    );
    assert_eq!(
        bits(&y2),
        bits(&matmul(kern, Tiling::default(), &x, &w2, k))
    );
}

#[test]
fn matmul_runs_on_the_callers_rayon_pool() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let k = 64;
    let x = vec![1.0f32; 2 * k];
    let w = vec![0.5f32; 300 * k];
    let mut y = vec![0.0; 2 * 300];
    pool.install(|| CpuKernels::best().matmul(&x, k, &mut [MatmulTarget { w: &w, y: &mut y }]));
    assert!(y.iter().all(|&v| v == 32.0));
}

#[test]
#[should_panic(expected = "y has the wrong size")]
fn matmul_rejects_a_mis_sized_output() {
    let mut y = vec![0.0; 3];
    CpuKernels::best().matmul(
        &[1.0; 8],
        4,
        &mut [MatmulTarget {
            w: &[1.0; 8],
            y: &mut y,
        }],
    );
}

#[test]
fn best_isa_is_available_and_listed() {
    let best = Isa::best();
    assert!(best.is_available());
    assert!(Isa::available().contains(&best));
    println!("best ISA on this machine: {}", best.name());
}
