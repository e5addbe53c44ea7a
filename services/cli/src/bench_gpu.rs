//! `zerolayer bench gpu`: the CUDA backend on one device, in one run so the numbers compare:
//!
//! 1. device-to-device copy bandwidth (bytes read + written per second), the ceiling of
//!    memory-bound work;
//! 2. batch-1 decode ms/token against its floor, weight bytes read per token ÷ that bandwidth;
//! 3. prefill tokens/s of one `--prefill-tokens` prompt (one chunk);
//! 4. decode throughput at batch `--batch`;
//! 5. time to first token of turn `--turns` of a conversation, with the history in the KV cache
//!    (reuse: only the new user turn is prefilled) and without (the whole transcript is
//!    prefilled in chunks of `--step-budget` tokens, like the engine's scheduler). This runs
//!    **through the backend**, not the engine: the engine adds queueing and tokenisation that
//!    are the same in both cases.
//!
//! Every step samples greedily on the device (sampling is part of the measured time). Medians
//! of `--runs` runs. Prints a table; `--json PATH` also writes the report.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use zerolayer_model::cuda::{CudaBackend, CudaDType, KvSize, load_cuda_model};
use zerolayer_model::{Backend, SampleInput, SampleOutcome, SamplingParams, SeqChunk};

/// Arguments of `zerolayer bench gpu`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model: `dummy:NAME[@SEED]` (generated on the device) or a llama2.c checkpoint.
    #[arg(long, env = "ZEROLAYER_BENCH_MODEL", default_value = "dummy:8b")]
    pub model: String,
    /// Device: `cuda:N`.
    #[arg(long, env = "ZEROLAYER_DEVICE", default_value = "cuda:0")]
    pub device: String,
    /// Storage mode: bf16 (serving) or f32 (exact).
    #[arg(long, env = "ZEROLAYER_CUDA_DTYPE", default_value = "bf16")]
    pub dtype: CudaDType,
    /// KV block size (positions).
    #[arg(long, env = "ZEROLAYER_BENCH_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Prompt length of the prefill measurement.
    #[arg(long, env = "ZEROLAYER_BENCH_PREFILL_TOKENS", default_value_t = 2048)]
    pub prefill_tokens: usize,
    /// Decode steps per decode measurement.
    #[arg(long, env = "ZEROLAYER_BENCH_DECODE_TOKENS", default_value_t = 64)]
    pub decode_tokens: usize,
    /// Sequences of the batched decode measurement.
    #[arg(long, env = "ZEROLAYER_BENCH_BATCH", default_value_t = 64)]
    pub batch: usize,
    /// Turn whose time to first token is measured.
    #[arg(long, env = "ZEROLAYER_BENCH_TURNS", default_value_t = 10)]
    pub turns: usize,
    /// Tokens of each user turn.
    #[arg(long, env = "ZEROLAYER_BENCH_USER_TOKENS", default_value_t = 64)]
    pub user_tokens: usize,
    /// Tokens of each assistant reply in the history.
    #[arg(long, env = "ZEROLAYER_BENCH_REPLY_TOKENS", default_value_t = 128)]
    pub reply_tokens: usize,
    /// Tokens per prefill step when the whole transcript is prefilled (the engine's step
    /// token budget).
    #[arg(long, env = "ZEROLAYER_BENCH_STEP_BUDGET", default_value_t = 512)]
    pub step_budget: usize,
    /// Runs per measurement (medians are reported).
    #[arg(long, env = "ZEROLAYER_BENCH_RUNS", default_value_t = 3)]
    pub runs: usize,
    /// MiB per copy of the bandwidth measurement.
    #[arg(long, env = "ZEROLAYER_BENCH_BANDWIDTH_MIB", default_value_t = 2048)]
    pub bandwidth_mib: usize,
    /// KV pool size in MiB.
    #[arg(long, env = "ZEROLAYER_KV_CACHE_MB", default_value_t = 8192)]
    pub kv_cache_mb: usize,
    /// Also write the report as JSON here.
    #[arg(long, env = "ZEROLAYER_BENCH_JSON")]
    pub json: Option<PathBuf>,
}

/// Token id of the synthetic prompts (`3 + i mod 200`: ordinary byte-level tokens).
fn token(i: usize) -> u32 {
    3 + (i % 200) as u32
}

/// Hands out disjoint block tables from the pool.
struct Blocks {
    /// Next free block.
    next: usize,
    /// Pool size.
    total: usize,
    /// Positions per block.
    block_size: usize,
}

impl Blocks {
    /// A table covering `positions`.
    fn table(&mut self, positions: usize) -> anyhow::Result<Vec<u32>> {
        let n = positions.div_ceil(self.block_size);
        anyhow::ensure!(
            self.next + n <= self.total,
            "the KV pool ({} blocks) is too small for this benchmark: raise --kv-cache-mb",
            self.total
        );
        let t = (self.next..self.next + n).map(|b| b as u32).collect();
        self.next += n;
        Ok(t)
    }

    /// Frees everything (the next measurement reuses the pool).
    fn reset(&mut self) {
        self.next = 0;
    }
}

/// Median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One greedy step: every chunk wants a token.
fn step(
    b: &mut CudaBackend,
    chunks: &[SeqChunk<'_>],
    out: &mut Vec<SampleOutcome>,
) -> anyhow::Result<()> {
    let greedy = SamplingParams::greedy();
    let inputs: Vec<SampleInput<'_>> = chunks
        .iter()
        .filter(|c| c.want_logits)
        .map(|_| SampleInput {
            params: &greedy,
            uniform: 0.0,
            banned: &[],
        })
        .collect();
    out.clear();
    out.resize(inputs.len(), SampleOutcome::NothingAllowed);
    b.forward_sample(chunks, &inputs, out)?;
    Ok(())
}

/// Prefills `tokens` into `table` from position `start` in chunks of `budget`, sampling after
/// the last chunk; returns the seconds taken.
fn prefill(
    b: &mut CudaBackend,
    tokens: &[u32],
    start: usize,
    table: &[u32],
    budget: usize,
) -> anyhow::Result<f64> {
    let mut out = Vec::new();
    let t0 = Instant::now();
    let mut pos = 0;
    while pos < tokens.len() {
        let n = budget.max(1).min(tokens.len() - pos);
        let last = pos + n == tokens.len();
        let chunk = SeqChunk {
            tokens: &tokens[pos..pos + n],
            start_pos: start + pos,
            block_table: table,
            want_logits: last,
        };
        if last {
            step(b, &[chunk], &mut out)?;
        } else {
            b.forward(&[chunk], &mut [])?;
        }
        pos += n;
    }
    b.synchronize()?;
    Ok(t0.elapsed().as_secs_f64())
}

/// Decodes `steps` greedy tokens for each of the sequences (`start` positions, tables);
/// returns seconds per step (median over steps).
fn decode(
    b: &mut CudaBackend,
    starts: &[usize],
    tables: &[Vec<u32>],
    steps: usize,
) -> anyhow::Result<Vec<f64>> {
    let mut next: Vec<u32> = vec![token(7); starts.len()];
    let mut out = Vec::new();
    let mut times = Vec::with_capacity(steps);
    for s in 0..steps {
        let chunks: Vec<SeqChunk<'_>> = starts
            .iter()
            .zip(tables)
            .zip(&next)
            .map(|((&p, t), tok)| SeqChunk {
                tokens: std::slice::from_ref(tok),
                start_pos: p + s,
                block_table: t,
                want_logits: true,
            })
            .collect();
        let t0 = Instant::now();
        step(b, &chunks, &mut out)?;
        times.push(t0.elapsed().as_secs_f64());
        for (n, o) in next.iter_mut().zip(&out) {
            if let SampleOutcome::Token(t) = o {
                *n = *t;
            }
        }
    }
    Ok(times)
}

/// Runs `zerolayer bench gpu`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let ordinal: usize = args
        .device
        .strip_prefix("cuda:")
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("--device {}: expected cuda:N", args.device))?;
    let runs = args.runs.max(1);
    let t0 = Instant::now();
    let model = load_cuda_model(
        &args.model,
        None,
        args.dtype,
        args.block_size,
        KvSize::Mib(args.kv_cache_mb),
        ordinal,
    )
    .with_context(|| format!("loading {} on cuda:{ordinal}", args.model))?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut b = model.backend;
    let config = b.config().clone();
    let device = b.device().clone();
    let kv = b.kv_config();
    let mut blocks = Blocks {
        next: 0,
        total: kv.num_blocks,
        block_size: kv.block_size,
    };
    eprintln!(
        "{}: {} ({}), loaded in {load_s:.1} s",
        args.model,
        device.name,
        args.dtype.name()
    );

    // 1. Bandwidth.
    let bandwidth = b.copy_bandwidth(args.bandwidth_mib << 20, 10)?;

    // 2. Batch-1 decode (after a 16-token prompt; 8 warm-up steps not counted).
    let prompt: Vec<u32> = (0..16).map(token).collect();
    let table = blocks.table(16 + 8 + args.decode_tokens)?;
    prefill(&mut b, &prompt, 0, &table, usize::MAX)?;
    decode(&mut b, &[16], std::slice::from_ref(&table), 8)?;
    let launches0 = b.launches();
    let mut d1 = decode(
        &mut b,
        &[24],
        std::slice::from_ref(&table),
        args.decode_tokens,
    )?;
    let launches_per_token = (b.launches() - launches0) as f64 / args.decode_tokens.max(1) as f64;
    let decode1_s = median(&mut d1);
    let bytes_per_token = b.weight_bytes_per_token();
    let floor_s = bytes_per_token as f64 / bandwidth;
    blocks.reset();

    // 3. Prefill.
    let long: Vec<u32> = (0..args.prefill_tokens).map(token).collect();
    let mut pf = Vec::with_capacity(runs);
    for _ in 0..=runs {
        blocks.reset();
        let t = blocks.table(long.len())?;
        pf.push(prefill(&mut b, &long, 0, &t, usize::MAX)?);
    }
    pf.remove(0); // warm-up (first use of the large step buffers)
    let prefill_s = median(&mut pf);
    blocks.reset();

    // 4. Batched decode.
    let tables: Vec<Vec<u32>> = (0..args.batch)
        .map(|_| blocks.table(16 + 8 + args.decode_tokens))
        .collect::<anyhow::Result<_>>()?;
    let chunks: Vec<SeqChunk<'_>> = tables
        .iter()
        .map(|t| SeqChunk {
            tokens: &prompt,
            start_pos: 0,
            block_table: t,
            want_logits: true,
        })
        .collect();
    let mut out = Vec::new();
    step(&mut b, &chunks, &mut out)?;
    let starts16 = vec![16; args.batch];
    decode(&mut b, &starts16, &tables, 8)?;
    let starts24 = vec![24; args.batch];
    let mut db = decode(&mut b, &starts24, &tables, args.decode_tokens)?;
    let decode_batch_s = median(&mut db);
    blocks.reset();

    // 5. Turn-N time to first token, with and without reuse.
    let per_turn = args.user_tokens + args.reply_tokens;
    let history = per_turn * args.turns.saturating_sub(1);
    let transcript: Vec<u32> = (0..history + args.user_tokens).map(token).collect();
    anyhow::ensure!(
        transcript.len() < config.max_seq_len,
        "turn {} needs {} positions, the model has {}",
        args.turns,
        transcript.len(),
        config.max_seq_len
    );
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..=runs {
        blocks.reset();
        let t = blocks.table(transcript.len() + 1)?;
        prefill(&mut b, &transcript[..history], 0, &t, args.step_budget)?;
        with.push(prefill(
            &mut b,
            &transcript[history..],
            history,
            &t,
            args.step_budget,
        )?);
        let t2 = blocks.table(transcript.len() + 1)?;
        without.push(prefill(&mut b, &transcript, 0, &t2, args.step_budget)?);
    }
    with.remove(0);
    without.remove(0);
    let (ttft_with, ttft_without) = (median(&mut with), median(&mut without));

    let report = serde_json::json!({
        "model": args.model,
        "dtype": args.dtype.name(),
        "device": {
            "name": device.name,
            "compute_capability": format!("{}.{}", device.compute_capability.0, device.compute_capability.1),
            "arch": device.arch,
            "multiprocessors": device.multiprocessors,
            "total_memory_bytes": device.total_memory,
            "nvrtc": format!("{}.{}", device.nvrtc_version.0, device.nvrtc_version.1),
        },
        "load_seconds": load_s,
        "params": config.n_params(),
        "weight_bytes": b.weight_bytes(),
        "kv_pool_bytes": b.kv_bytes(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "decode_batch1": {
            "ms_per_token": decode1_s * 1e3,
            "weight_bytes_per_token": bytes_per_token,
            "floor_ms_per_token": floor_s * 1e3,
            "fraction_of_floor": floor_s / decode1_s,
            "launches_per_token": launches_per_token,
            "context_positions": 24 + args.decode_tokens,
        },
        "prefill": {
            "tokens": args.prefill_tokens,
            "seconds": prefill_s,
            "tokens_per_s": args.prefill_tokens as f64 / prefill_s,
            "projection_tflops": config.matmul_flops_per_token() as f64 * args.prefill_tokens as f64 / prefill_s / 1e12,
        },
        "decode_batched": {
            "batch": args.batch,
            "ms_per_step": decode_batch_s * 1e3,
            "tokens_per_s": args.batch as f64 / decode_batch_s,
        },
        "ttft": {
            "through": "backend",
            "turn": args.turns,
            "history_tokens": history,
            "new_tokens": args.user_tokens,
            "step_budget": args.step_budget,
            "with_reuse_ms": ttft_with * 1e3,
            "without_reuse_ms": ttft_without * 1e3,
            "speedup": ttft_without / ttft_with,
        },
        "host_sampled_rows": b.host_sampled_rows(),
        "runs": runs,
    });
    println!(
        "zerolayer bench gpu — {} on {} ({}), {}",
        args.model,
        device.name,
        device.arch,
        args.dtype.name()
    );
    println!(
        "  copy bandwidth            {:>10.0} GB/s (read + write)",
        bandwidth / 1e9
    );
    println!(
        "  decode batch 1            {:>10.3} ms/token  (floor {:.3} ms = {:.2} GB / bandwidth; {:.0}% of floor; {:.0} launches/token)",
        decode1_s * 1e3,
        floor_s * 1e3,
        bytes_per_token as f64 / 1e9,
        100.0 * floor_s / decode1_s,
        launches_per_token
    );
    println!(
        "  prefill {:>5} tokens      {:>10.0} tokens/s ({:.1} ms, {:.0} TFLOP/s projections)",
        args.prefill_tokens,
        args.prefill_tokens as f64 / prefill_s,
        prefill_s * 1e3,
        config.matmul_flops_per_token() as f64 * args.prefill_tokens as f64 / prefill_s / 1e12
    );
    println!(
        "  decode batch {:>3}          {:>10.0} tokens/s ({:.2} ms/step)",
        args.batch,
        args.batch as f64 / decode_batch_s,
        decode_batch_s * 1e3
    );
    println!(
        "  turn-{} TTFT (backend)     {:>10.1} ms with reuse, {:.1} ms without ({:.1}×; {} history tokens)",
        args.turns,
        ttft_with * 1e3,
        ttft_without * 1e3,
        ttft_without / ttft_with,
        history
    );
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
