//! Criterion benchmarks of the CPU kernels: our batch-invariant matmul against the `gemm` crate
//! (shape-dependent blocking, not batch-invariant) on the model's shapes, and the decode mat-vec
//! against a plain streaming read of the same bytes.
//!
//! Run: `cargo bench -p zerolayer-kernels --bench cpu_kernels` (uses rayon's global pool, i.e. all
//! cores; set `RAYON_NUM_THREADS=2` to pin the thread count).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use zerolayer_kernels::cpu::{CpuKernels, MatmulTarget};

mod support;

use support::{data, gemm_matmul};

fn matmul(c: &mut Criterion) {
    let threads = rayon::current_num_threads();
    let kern = CpuKernels::best();
    let mut group = c.benchmark_group("matmul");
    group.sample_size(10);
    // (m, n, k): decode, batched decode and prefill shapes of dummy:small and dummy:1b.
    for &(m, n, k) in &[
        (1, 768, 768),
        (1, 2048, 768),
        (32, 768, 768),
        (512, 768, 768),
        (512, 2048, 768),
        (512, 768, 2048),
        (128, 2048, 2048),
    ] {
        let x = data(m * k, 1);
        let w = data(n * k, 2);
        let mut y = vec![0.0; m * n];
        group.throughput(Throughput::Elements((2 * m * n * k) as u64));
        let id = format!("{m}x{n}x{k}");
        group.bench_function(BenchmarkId::new("zerolayer", &id), |b| {
            b.iter(|| kern.matmul(&x, k, &mut [MatmulTarget { w: &w, y: &mut y }]))
        });
        group.bench_function(BenchmarkId::new("gemm", &id), |b| {
            b.iter(|| gemm_matmul(&x, &w, &mut y, m, n, k, threads))
        });
    }
    group.finish();
}

fn matvec_vs_bandwidth(c: &mut Criterion) {
    let kern = CpuKernels::best();
    let mut group = c.benchmark_group("decode_bytes");
    group.sample_size(10);
    // 32000 × 768 f32 = 98 MB: the dummy:small classifier, far larger than the caches.
    let (n, k) = (32_000, 768);
    let w = data(n * k, 3);
    let x = data(k, 4);
    let mut y = vec![0.0; n];
    group.throughput(Throughput::Bytes((n * k * 4) as u64));
    group.bench_function("matvec_32000x768", |b| {
        b.iter(|| kern.matmul(&x, k, &mut [MatmulTarget { w: &w, y: &mut y }]))
    });
    group.bench_function("read_sum_98MB", |b| {
        b.iter(|| {
            use rayon::prelude::*;
            let part = w.len().div_ceil(rayon::current_num_threads());
            w.par_chunks(part).map(|c| kern.read_sum(c)).sum::<f32>()
        })
    });
    group.finish();
}

criterion_group!(benches, matmul, matvec_vs_bandwidth);
criterion_main!(benches);
