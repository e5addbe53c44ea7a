//! The kernels' arithmetic contract: every instruction set returns bit-identical results, and a
//! matmul row does not depend on the batch size or the tiling.

use proptest::prelude::*;
use zerolayer_kernels::cpu::{CpuKernels, Isa, MatmulTarget, Tiling};

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
