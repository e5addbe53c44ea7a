//! Single-thread throughput probe measured in on-CPU time (robust on a loaded machine):
//! `cargo run --release -p zerolayer-kernels --example probe` (`ROWS=N` sets the weight rows per
//! task of the matmul shapes, default 64).

use zerolayer_kernels::cpu::{CpuKernels, MatmulTarget, Tiling};

#[path = "../benches/support/mod.rs"]
mod support;

use support::{data, gemm_matmul};

/// Nanoseconds this thread has spent on a CPU (Linux `/proc/thread-self/schedstat`).
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn measure(name: &str, flops: f64, reps: usize, mut f: impl FnMut()) {
    f();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = cpu_ns();
        for _ in 0..reps {
            f();
        }
        best = best.min((cpu_ns() - t) as f64);
    }
    println!(
        "{name:<40} {:>7.1} GFLOP per CPU-second",
        flops * reps as f64 / best
    );
}

fn main() {
    if zerolayer_kernels::cpu::Isa::Avx512.is_available() {
        peak();
    }
    let kern = CpuKernels::best();
    let serial = Tiling {
        rows_per_task: 64,
        parallel: false,
    };
    for &(m, n, k) in &[
        (4usize, 4usize, 256usize),
        (4, 4, 1024),
        (4, 4, 2048),
        (4, 64, 1024),
        (4, 64, 2048),
        (512, 768, 2048),
    ] {
        let x = data(m * k, 1);
        let w = data(n * k, 2);
        let mut y = vec![0.0; m * n];
        let flops = 2.0 * (m * n * k) as f64;
        let reps = (3e10 / flops).ceil() as usize;
        measure(&format!("zerolayer {m}x{n}x{k}"), flops, reps, || {
            kern.matmul_with(serial, &x, k, &mut [MatmulTarget { w: &w, y: &mut y }])
        });
        measure(&format!("gemm      {m}x{n}x{k}"), flops, reps, || {
            gemm_matmul(&x, &w, &mut y, m, n, k, 1);
        });
    }
}

/// 24 independent FMA chains on registers: the core's FMA peak.
#[target_feature(enable = "avx512f")]
fn fma_peak(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(0.0); 24];
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, a, b);
        }
    }
    let mut s = 0.0;
    for v in acc {
        s += _mm512_reduce_add_ps(v);
    }
    s
}

#[allow(dead_code)]
pub fn peak() {
    let iters = 20_000_000usize;
    let t = cpu_ns();
    // SAFETY: the probe only runs on AVX-512 machines (checked by the caller).
    let s = unsafe { fma_peak(iters) };
    let ns = (cpu_ns() - t) as f64;
    println!(
        "FMA peak: {:.1} GFLOP per CPU-second (checksum {s})",
        (iters * 24 * 32) as f64 / ns
    );
}
