//! Criterion benchmarks of the CPU kernels: our batch-invariant matmul against the `gemm` crate
//! (shape-dependent blocking, not batch-invariant) on the model's shapes, and the decode mat-vec
//! against a plain streaming read of the same bytes.
//!
//! Run: `cargo bench -p zerolayer-kernels --bench cpu_kernels` (uses rayon's global pool, i.e. all
//! cores; set `RAYON_NUM_THREADS=2` to pin the thread count).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use zerolayer_kernels::cpu::{CpuKernels, MatmulTarget};

/// Deterministic pseudo-random data in [-1, 1].
fn data(len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 2654435761 + salt * 97) % 2001) as f32 - 1000.0) / 1000.0)
        .collect()
}

/// `y[m][n] = x[m][k] · w[n][k]ᵀ` with the gemm crate (w read as a column-major `[k][n]` matrix).
fn gemm_matmul(x: &[f32], w: &[f32], y: &mut [f32], m: usize, n: usize, k: usize, threads: usize) {
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the pointers and strides describe the three slices exactly (row-major x and y,
    // w as its transpose) and the slices outlive the call.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        )
    }
}

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
