//! Runs the model benchmark without the CLI (same code as `zerolayer bench model`):
//! `cargo run --release -p zerolayer-model --example bench_model -- --model dummy:small --threads 2
//! --prompt-tokens 512 --decode-tokens 64 --batches 8,32 --runs 3 [--json PATH]`.

use zerolayer_model::bench::{BenchOptions, run_bench};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut opts = BenchOptions {
        model: "dummy:small".into(),
        threads: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        prompt_tokens: 512,
        decode_tokens: 64,
        decode_batches: vec![],
        bandwidth_bytes: 1 << 30,
        runs: 3,
    };
    let mut json = None;
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let [flag, value] = pair else {
            return Err(format!("flag {pair:?} needs a value").into());
        };
        match flag.as_str() {
            "--model" => opts.model = value.clone(),
            "--threads" => opts.threads = value.parse()?,
            "--prompt-tokens" => opts.prompt_tokens = value.parse()?,
            "--decode-tokens" => opts.decode_tokens = value.parse()?,
            "--runs" => opts.runs = value.parse()?,
            "--batches" => {
                opts.decode_batches = value.split(',').map(str::parse).collect::<Result<_, _>>()?
            }
            "--bandwidth-mib" => opts.bandwidth_bytes = value.parse::<usize>()? << 20,
            "--json" => json = Some(value.clone()),
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    if std::env::var_os("BANDWIDTH_ONLY").is_some() {
        let runs = zerolayer_model::bench::measure_read_bandwidth(
            opts.threads,
            opts.bandwidth_bytes,
            opts.runs,
        );
        println!("{} MiB: {runs:.1?} GB/s", opts.bandwidth_bytes >> 20);
        return Ok(());
    }
    let report = run_bench(&opts)?;
    print!("{}", report.table());
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
