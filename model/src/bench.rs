//! Model benchmarks behind `zerolayer bench model`: the machine's read bandwidth, then prefill and
//! decode speed of the CPU backend, measured in one run so the numbers can be compared.
//!
//! Decode at batch 1 is memory-bound: its quality measure is the fraction of read bandwidth it
//! achieves, `weight bytes per token × tokens/s ÷ bandwidth` (KV-cache reads not counted, as in
//! llama.cpp's figure, whose `tg` test also decodes from an empty context).

use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;
use zerolayer_kernels::cpu::CpuKernels;

use crate::backend::{Backend, KvCacheConfig, SeqChunk};
use crate::cpu::CpuBackend;
use crate::error::{BackendError, ModelError};
use crate::load::load_model;
use crate::weights::Weights;

/// KV block size used by the benchmark.
const BENCH_BLOCK_SIZE: usize = 16;

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Model spec (`dummy:small`, a checkpoint path, …).
    pub model: String,
    /// Worker threads (also used for the bandwidth probe).
    pub threads: usize,
    /// Prompt length of the prefill measurement.
    pub prompt_tokens: usize,
    /// Decode steps per decode measurement.
    pub decode_tokens: usize,
    /// Extra decode batch sizes to measure (besides 1).
    pub decode_batches: Vec<usize>,
    /// Bytes read per bandwidth run (≥ 1 GiB to defeat caches).
    pub bandwidth_bytes: usize,
    /// Runs of each measurement; medians are reported.
    pub runs: usize,
}

/// One throughput figure.
#[derive(Clone, Debug, Serialize)]
pub struct Throughput {
    /// Sequences per step.
    pub batch: usize,
    /// Tokens processed per run (all sequences).
    pub tokens: usize,
    /// Median seconds per run.
    pub seconds: f64,
    /// Tokens per second (all sequences).
    pub tokens_per_s: f64,
    /// Achieved GFLOP/s of the projections (prefill) or fraction of read bandwidth (decode).
    pub efficiency: f64,
    /// Median CPU seconds (user + system, all threads of the process) per run; 0 where unknown.
    /// On a shared machine `work / cpu_seconds` shows what the code does per core it actually
    /// got, independent of how much CPU other tenants took.
    pub cpu_seconds: f64,
}

/// CPU seconds (user + system) this process has used, from `/proc/self/stat` (Linux, in
/// `USER_HZ` = 100 ticks per second); `None` elsewhere.
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// Everything one benchmark run measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Model spec.
    pub model: String,
    /// Parameters.
    pub n_params: u64,
    /// f32 weight bytes read per decoded token.
    pub weight_bytes_per_token: u64,
    /// Worker threads.
    pub threads: usize,
    /// Kernel instruction set.
    pub isa: String,
    /// Seconds to load (generate) the weights.
    pub load_s: f64,
    /// Read bandwidth of every probe run (before the model loads, then one right before each
    /// decode run), GB/s.
    pub bandwidth_runs_gbps: Vec<f64>,
    /// Median read bandwidth, GB/s.
    pub bandwidth_gbps: f64,
    /// Prefill of one prompt (efficiency: GFLOP/s).
    pub prefill: Throughput,
    /// Batch-1 decode from an empty context (efficiency: median over runs of the fraction of the
    /// read bandwidth measured right before each run).
    pub decode: Throughput,
    /// Batch-1 decode right after the prompt (efficiency: fraction of read bandwidth, KV reads
    /// not counted).
    pub decode_after_prompt: Throughput,
    /// Batched decode from an empty context (efficiency: fraction of read bandwidth per step).
    pub decode_batched: Vec<Throughput>,
    /// `/proc/loadavg` when the run started (noisy shared machines).
    pub load_average: String,
}

/// Benchmark failures.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Loading the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A forward step failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// Options out of range.
    #[error("invalid benchmark options: {0}")]
    Options(String),
}

/// Median of `v` (sorted copy).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() { 0.0 } else { s[s.len() / 2] }
}

/// A streaming-read bandwidth probe: a buffer of at least 1 GiB (larger than the caches) read by
/// `threads` threads, each summing its contiguous share with SIMD loads.
pub struct BandwidthProbe {
    /// Threads of the probe (the backend's thread count).
    pool: rayon::ThreadPool,
    /// The buffer read by every measurement.
    buf: Vec<f32>,
    /// Kernels providing the SIMD sum.
    kern: CpuKernels,
}

impl BandwidthProbe {
    /// Allocates and touches `bytes` bytes.
    pub fn new(threads: usize, bytes: usize) -> Result<Self, BenchError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .build()
            .map_err(|e| BenchError::Options(format!("cannot start probe threads: {e}")))?;
        let n = bytes / 4;
        let mut buf = Vec::new();
        buf.try_reserve_exact(n)
            .map_err(|_| BenchError::Options(format!("cannot allocate {bytes} bytes")))?;
        pool.install(|| buf.par_extend((0..n).into_par_iter().map(|i| (i % 7) as f32)));
        Ok(BandwidthProbe {
            pool,
            buf,
            kern: CpuKernels::best(),
        })
    }

    /// One measurement, in GB/s (1e9 bytes per second).
    pub fn measure(&self) -> f64 {
        let threads = self.pool.current_num_threads();
        let part = self.buf.len().div_ceil(threads).max(1);
        let t = Instant::now();
        let s: f32 = self.pool.install(|| {
            self.buf
                .par_chunks(part)
                .map(|c| self.kern.read_sum(c))
                .sum()
        });
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        self.buf.len() as f64 * 4.0 / secs / 1e9
    }
}

/// Measures streaming read bandwidth `runs` times (GB/s each); see [`BandwidthProbe`].
pub fn measure_read_bandwidth(threads: usize, bytes: usize, runs: usize) -> Vec<f64> {
    match BandwidthProbe::new(threads, bytes) {
        Ok(p) => (0..runs).map(|_| p.measure()).collect(),
        Err(_) => Vec::new(),
    }
}

/// Deterministic token ids for benchmark prompts.
fn bench_tokens(n: usize, vocab: usize, salt: u64) -> Vec<u32> {
    (0..n as u64)
        .map(|i| 3 + (crate::dummy::splitmix64(i ^ (salt << 32)) % (vocab as u64 - 3)) as u32)
        .collect()
}

/// Decodes `steps` tokens for `batch` sequences starting at `start` (after a prefill of `start`
/// tokens each when `start > 0`, not timed); returns wall and process CPU seconds of the steps.
fn time_decode(
    be: &mut CpuBackend,
    batch: usize,
    start: usize,
    steps: usize,
    max_blocks: usize,
) -> Result<(f64, f64), BenchError> {
    let vocab = be.config().vocab_size;
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|b| ((b * max_blocks) as u32..((b + 1) * max_blocks) as u32).collect())
        .collect();
    let mut logits = vec![0.0; batch * vocab];
    if start > 0 {
        for (b, table) in tables.iter().enumerate() {
            let toks = bench_tokens(start, vocab, b as u64);
            be.forward(
                &[SeqChunk {
                    tokens: &toks,
                    start_pos: 0,
                    block_table: table,
                    want_logits: true,
                }],
                &mut logits[..vocab],
            )?;
        }
    }
    let toks: Vec<u32> = bench_tokens(batch * steps, vocab, 99);
    let (t, cpu) = (Instant::now(), process_cpu_seconds());
    for s in 0..steps {
        let chunks: Vec<SeqChunk<'_>> = (0..batch)
            .map(|b| SeqChunk {
                tokens: &toks[s * batch + b..s * batch + b + 1],
                start_pos: start + s,
                block_table: &tables[b],
                want_logits: true,
            })
            .collect();
        be.forward(&chunks, &mut logits)?;
    }
    let secs = t.elapsed().as_secs_f64();
    Ok((
        secs,
        process_cpu_seconds().zip(cpu).map_or(0.0, |(b, a)| b - a),
    ))
}

/// Runs the whole benchmark.
pub fn run_bench(opts: &BenchOptions) -> Result<BenchReport, BenchError> {
    if opts.threads == 0 || opts.prompt_tokens == 0 || opts.decode_tokens == 0 || opts.runs == 0 {
        return Err(BenchError::Options(
            "threads, prompt tokens, decode tokens and runs must be positive".into(),
        ));
    }
    let load_average = std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string();
    let probe = BandwidthProbe::new(opts.threads, opts.bandwidth_bytes)?;
    let mut bw: Vec<f64> = (0..opts.runs.max(3)).map(|_| probe.measure()).collect();
    let t = Instant::now();
    let model = load_model(&opts.model, None)?;
    let load_s = t.elapsed().as_secs_f64();
    let weights: Arc<Weights> = model.weights.clone();
    let c = weights.config().clone();
    let max_batch = opts
        .decode_batches
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .max(1);
    let per_seq = opts.prompt_tokens + opts.decode_tokens;
    if per_seq > c.max_seq_len {
        return Err(BenchError::Options(format!(
            "{per_seq} tokens exceed the context of {}",
            c.max_seq_len
        )));
    }
    let max_blocks = per_seq.div_ceil(BENCH_BLOCK_SIZE);
    let kv = KvCacheConfig {
        block_size: BENCH_BLOCK_SIZE,
        num_blocks: max_blocks * max_batch,
    };
    let mut be = CpuBackend::new(weights, kv, opts.threads)?;
    let bytes = c.weight_bytes_per_token() as f64;

    // Prefill: one prompt in one step.
    let prompt = bench_tokens(opts.prompt_tokens, c.vocab_size, 7);
    let table: Vec<u32> = (0..max_blocks as u32).collect();
    let mut logits = vec![0.0; c.vocab_size];
    let (mut times, mut cpu_times) = (Vec::new(), Vec::new());
    for _ in 0..opts.runs {
        let chunk = SeqChunk {
            tokens: &prompt,
            start_pos: 0,
            block_table: &table,
            want_logits: true,
        };
        let (t, cpu) = (Instant::now(), process_cpu_seconds());
        be.forward(&[chunk], &mut logits)?;
        times.push(t.elapsed().as_secs_f64());
        cpu_times.push(process_cpu_seconds().zip(cpu).map_or(0.0, |(b, a)| b - a));
    }
    let secs = median(&times);
    let flops = c.matmul_flops_per_token() as f64 * opts.prompt_tokens as f64;
    let prefill = Throughput {
        batch: 1,
        tokens: opts.prompt_tokens,
        seconds: secs,
        tokens_per_s: opts.prompt_tokens as f64 / secs,
        efficiency: flops / secs / 1e9,
        cpu_seconds: median(&cpu_times),
    };

    // Each decode run is preceded by its own bandwidth measurement and compared with it, so a
    // change of background load between runs does not skew the ratio.
    let mut decode_at = |be: &mut CpuBackend, batch: usize, start: usize| {
        let (mut times, mut ratios, mut cpu_times) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..opts.runs {
            let gbps = probe.measure();
            bw.push(gbps);
            let (secs, cpu) = time_decode(be, batch, start, opts.decode_tokens, max_blocks)?;
            cpu_times.push(cpu);
            times.push(secs);
            ratios.push(bytes * opts.decode_tokens as f64 / secs / (gbps * 1e9));
        }
        let secs = median(&times);
        let tokens = batch * opts.decode_tokens;
        Ok::<_, BenchError>(Throughput {
            batch,
            tokens,
            seconds: secs,
            tokens_per_s: tokens as f64 / secs,
            efficiency: median(&ratios),
            cpu_seconds: median(&cpu_times),
        })
    };
    let decode = decode_at(&mut be, 1, 0)?;
    let decode_after_prompt = decode_at(&mut be, 1, opts.prompt_tokens)?;
    let mut decode_batched = Vec::new();
    for &b in opts.decode_batches.iter().filter(|&&b| b > 1) {
        decode_batched.push(decode_at(&mut be, b, 0)?);
    }
    Ok(BenchReport {
        model: opts.model.clone(),
        n_params: c.n_params(),
        weight_bytes_per_token: c.weight_bytes_per_token(),
        threads: opts.threads,
        isa: be.kernels().isa().name().to_string(),
        load_s,
        bandwidth_gbps: median(&bw),
        bandwidth_runs_gbps: bw,
        prefill,
        decode,
        decode_after_prompt,
        decode_batched,
        load_average,
    })
}

impl BenchReport {
    /// The report as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        // Invariant: the report holds only numbers and strings, which always serialise.
        serde_json::to_string_pretty(self).expect("report serialises")
    }

    /// A plain-text table of the results.
    pub fn table(&self) -> String {
        let mut s = String::new();
        s.push_str(&format!(
            "model {} ({:.1}M params, {:.1} MB f32 weights read per token), {} threads, {} kernels, load {:.2} s\n",
            self.model,
            self.n_params as f64 / 1e6,
            self.weight_bytes_per_token as f64 / 1e6,
            self.threads,
            self.isa,
            self.load_s
        ));
        s.push_str(&format!(
            "read bandwidth: {:.1} GB/s median of {:?} GB/s; load average at start: {}\n",
            self.bandwidth_gbps,
            self.bandwidth_runs_gbps
                .iter()
                .map(|v| (v * 10.0).round() / 10.0)
                .collect::<Vec<_>>(),
            self.load_average
        ));
        s.push_str(&format!(
            "{:<34} {:>6} {:>8} {:>10} {:>12}\n",
            "measurement", "batch", "tokens", "tok/s", "efficiency"
        ));
        let p = &self.prefill;
        let per_cpu = if p.cpu_seconds > 0.0 {
            p.efficiency * p.seconds / p.cpu_seconds
        } else {
            0.0
        };
        s.push_str(&format!(
            "{:<34} {:>6} {:>8} {:>10.1} {:>8.1} GFLOP/s ({per_cpu:.1} GFLOP per CPU-second)\n",
            "prefill (one prompt)", 1, p.tokens, p.tokens_per_s, p.efficiency
        ));
        let mut row = |name: &str, t: &Throughput| {
            s.push_str(&format!(
                "{:<34} {:>6} {:>8} {:>10.1} {:>8.1} % of read bw (CPU {:.2} s of {:.2} s)\n",
                name,
                t.batch,
                t.tokens,
                t.tokens_per_s,
                t.efficiency * 100.0,
                t.cpu_seconds,
                t.seconds
            ));
        };
        row("decode (empty context)", &self.decode);
        row("decode (after the prompt)", &self.decode_after_prompt);
        for t in &self.decode_batched {
            row("decode batched (empty context)", t);
        }
        s
    }
}
