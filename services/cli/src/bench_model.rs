//! `zerolayer bench model`: the machine's read bandwidth, then prefill and decode speed of the CPU
//! backend, in one run (see `zerolayer_model::bench`). Prints a table; `--json PATH` also writes
//! the full report.

use std::path::PathBuf;

use anyhow::Context;
use zerolayer_model::bench::{BenchOptions, run_bench};

/// Arguments of `zerolayer bench model`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model: `dummy:NAME[@SEED]` or a llama2.c checkpoint path.
    #[arg(long, env = "ZEROLAYER_BENCH_MODEL", default_value = "dummy:small")]
    pub model: String,
    /// Worker threads (and bandwidth-probe threads); default: available cores.
    #[arg(long, env = "ZEROLAYER_BENCH_THREADS")]
    pub threads: Option<usize>,
    /// Prompt length of the prefill measurement.
    #[arg(long, env = "ZEROLAYER_BENCH_PROMPT_TOKENS", default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Decode steps per decode measurement.
    #[arg(long, env = "ZEROLAYER_BENCH_DECODE_TOKENS", default_value_t = 64)]
    pub decode_tokens: usize,
    /// Extra decode batch sizes, comma-separated (e.g. `8,32`).
    #[arg(long, env = "ZEROLAYER_BENCH_DECODE_BATCH", value_delimiter = ',')]
    pub decode_batch: Vec<usize>,
    /// Runs per measurement (medians are reported).
    #[arg(long, env = "ZEROLAYER_BENCH_RUNS", default_value_t = 3)]
    pub runs: usize,
    /// MiB read per bandwidth run (≥ 1024 to defeat caches).
    #[arg(long, env = "ZEROLAYER_BENCH_BANDWIDTH_MIB", default_value_t = 1024)]
    pub bandwidth_mib: usize,
    /// Also write the report as JSON here.
    #[arg(long, env = "ZEROLAYER_BENCH_JSON")]
    pub json: Option<PathBuf>,
}

/// Runs `zerolayer bench model`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let opts = BenchOptions {
        model: args.model,
        threads,
        prompt_tokens: args.prompt_tokens,
        decode_tokens: args.decode_tokens,
        decode_batches: args.decode_batch,
        bandwidth_bytes: args.bandwidth_mib << 20,
        runs: args.runs,
    };
    let report = run_bench(&opts)?;
    print!("{}", report.table());
    if let Some(path) = args.json {
        std::fs::write(&path, report.to_json())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
