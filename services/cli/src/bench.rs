//! `zerolayer bench …`: benchmarks.
//!
//! - `bench model`: CPU backend speed (read bandwidth, prefill, decode) — see `bench_model`.
//! - `bench run`: a workload against one running endpoint (any mode, also inside compose).
//! - `bench compare`: starts collapsed, split and layered on this machine with the same model
//!   (or uses `--endpoints`), runs the same workload against each interleaved in rounds, and
//!   writes `report.json`, `report.md` and SVG charts (see `zerolayer_bench::compare`).
//!
//! Further groups (e.g. `bench gpu`) go into [`BenchCommand`].

use std::path::PathBuf;

use anyhow::Context as _;
use zerolayer_bench::{
    compare::{self, CompareOptions, RunOptions, Target},
    launch::{Launcher, Mode},
    report::Report,
    workload::{
        ArrivalProcess, DEFAULT_MAX_TOKENS, DEFAULT_NEW_TOKENS, Workload, WorkloadKind,
        parse_concurrency_list, parse_rate_list, parse_stages,
    },
};

/// Arguments of `zerolayer bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// What to benchmark.
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// The benchmarks.
#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// CPU backend speed: read bandwidth, then prefill and decode of a model.
    Model(Box<crate::bench_model::Args>),
    /// CUDA backend speed on one GPU: copy bandwidth, decode vs its floor, prefill, batched
    /// decode, turn-N time to first token with and without KV reuse.
    Gpu(Box<crate::bench_gpu::Args>),
    /// Run a workload against one running endpoint.
    Run(Box<RunArgs>),
    /// Start collapsed, split and layered with the same model and compare them side by side.
    Compare(Box<CompareArgs>),
}

/// The workload (shared by `run` and `compare`).
#[derive(Debug, Clone, clap::Args)]
pub struct WorkloadArgs {
    /// Workload: multi-turn, single-shot or staged.
    #[arg(long, env = "ZEROLAYER_BENCH_WORKLOAD", default_value = "multi-turn")]
    pub workload: WorkloadKind,
    /// Conversations per load level (single-shot: prompts per level).
    #[arg(long, env = "ZEROLAYER_BENCH_CONVERSATIONS", default_value_t = 8)]
    pub conversations: usize,
    /// User turns per conversation (ignored by single-shot).
    #[arg(long, env = "ZEROLAYER_BENCH_TURNS", default_value_t = 4)]
    pub turns: usize,
    /// Tokens of each user turn (ASCII bytes: exact for the dummy models' byte-level tokenizer).
    #[arg(long, env = "ZEROLAYER_BENCH_NEW_TOKENS", default_value_t = DEFAULT_NEW_TOKENS)]
    pub new_tokens: usize,
    /// Tokens generated per turn (max_tokens, greedy).
    #[arg(long, alias = "generated-tokens", env = "ZEROLAYER_BENCH_MAX_TOKENS", default_value_t = DEFAULT_MAX_TOKENS)]
    pub max_tokens: u32,
    /// Closed-loop concurrency levels, comma-separated (one pass per level; the list makes
    /// the throughput-against-concurrency chart).
    #[arg(long, env = "ZEROLAYER_BENCH_CONCURRENCY", default_value = "1")]
    pub concurrency: String,
    /// Open-loop arrival rates per second, comma-separated (conversations or prompts arrive
    /// at this rate whatever the server does); replaces --concurrency.
    #[arg(long, env = "ZEROLAYER_BENCH_RATE")]
    pub rate: Option<String>,
    /// Spacing of open-loop arrivals: poisson or fixed.
    #[arg(long, env = "ZEROLAYER_BENCH_ARRIVAL", default_value = "poisson")]
    pub arrival: ArrivalProcess,
    /// Stages of --workload staged, k6-style: DURATION:USERS,… (e.g. 10s:8,20s:8,5s:32,10s:0).
    #[arg(long, env = "ZEROLAYER_BENCH_STAGES")]
    pub stages: Option<String>,
    /// Send only new messages (delta mode) instead of full transcripts.
    #[arg(long, env = "ZEROLAYER_BENCH_DELTA")]
    pub delta: bool,
    /// Seed of prompts, sampling and arrivals.
    #[arg(long, env = "ZEROLAYER_BENCH_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Seconds one request may take before it counts as CLIENT_TIMEOUT.
    #[arg(long, env = "ZEROLAYER_BENCH_REQUEST_TIMEOUT_S", default_value_t = 300)]
    pub request_timeout_s: u64,
    /// Skip the unrecorded warm-up conversation per endpoint.
    #[arg(long, env = "ZEROLAYER_BENCH_NO_WARMUP")]
    pub no_warmup: bool,
    /// No progress bar (it is drawn only on a terminal anyway).
    #[arg(long, env = "ZEROLAYER_BENCH_NO_PROGRESS")]
    pub no_progress: bool,
}

impl WorkloadArgs {
    /// The workload these flags describe (validated).
    pub fn workload(&self) -> anyhow::Result<Workload> {
        let concurrency = parse_concurrency_list(&self.concurrency).context("--concurrency")?;
        let rates = self
            .rate
            .as_deref()
            .map(parse_rate_list)
            .transpose()
            .context("--rate")?
            .unwrap_or_default();
        let stages = self
            .stages
            .as_deref()
            .map(parse_stages)
            .transpose()
            .context("--stages")?
            .unwrap_or_default();
        anyhow::ensure!(
            self.workload == WorkloadKind::Staged || stages.is_empty(),
            "--stages needs --workload staged"
        );
        anyhow::ensure!(
            self.workload != WorkloadKind::Staged || !stages.is_empty(),
            "--workload staged needs --stages"
        );
        let w = Workload {
            kind: self.workload,
            conversations: self.conversations,
            turns: if self.workload == WorkloadKind::SingleShot {
                1
            } else {
                self.turns
            },
            new_tokens: self.new_tokens,
            max_tokens: self.max_tokens,
            levels: compare::levels(self.workload, &concurrency, &rates),
            arrival: self.arrival,
            stages,
            delta: self.delta,
            seed: self.seed,
            request_timeout: std::time::Duration::from_secs(self.request_timeout_s),
        };
        w.validate()?;
        Ok(w)
    }

    fn run_options(
        &self,
        rounds: usize,
        out: Option<PathBuf>,
        model: Option<String>,
        note: &str,
    ) -> anyhow::Result<RunOptions> {
        Ok(RunOptions {
            workload: self.workload()?,
            rounds,
            warmup: !self.no_warmup,
            progress: !self.no_progress,
            out,
            command: command_line(),
            model,
            deployment_note: note.to_owned(),
        })
    }
}

/// Arguments of `zerolayer bench run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// gRPC URL of the endpoint.
    #[arg(long, env = "ZEROLAYER_BENCH_ENDPOINT")]
    pub endpoint: String,
    /// API key (omit for --dev-auth servers).
    #[arg(long, env = "ZEROLAYER_BENCH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Label in the report (default: the mode the endpoint's probe reports).
    #[arg(long, env = "ZEROLAYER_BENCH_LABEL")]
    pub label: Option<String>,
    /// `/metrics` addresses to read counters from, as NAME=HOST:PORT, comma-separated.
    #[arg(long, env = "ZEROLAYER_BENCH_METRICS")]
    pub metrics: Option<String>,
    /// Repetitions of the workload.
    #[arg(long, env = "ZEROLAYER_BENCH_ROUNDS", default_value_t = 1)]
    pub rounds: usize,
    /// Directory for report.json, report.md and the charts.
    #[arg(long, env = "ZEROLAYER_BENCH_OUT")]
    pub out: Option<PathBuf>,
    /// The workload.
    #[command(flatten)]
    pub load: WorkloadArgs,
}

/// Arguments of `zerolayer bench compare`.
#[derive(Debug, clap::Args)]
pub struct CompareArgs {
    /// Model every mode serves: `dummy:NAME[@SEED]` or a llama2.c checkpoint path.
    #[arg(long, env = "ZEROLAYER_BENCH_MODEL", default_value = "dummy:tiny")]
    pub model: String,
    /// Tokenizer for checkpoints (default: beside the checkpoint).
    #[arg(long, env = "ZEROLAYER_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Modes to start, comma-separated, in report order.
    #[arg(
        long,
        env = "ZEROLAYER_BENCH_MODES",
        default_value = "collapsed,split,layered",
        value_delimiter = ','
    )]
    pub modes: Vec<CliMode>,
    /// Compare running deployments instead of starting them: LABEL=URL,… (e.g.
    /// collapsed=http://collapsed:50051,split=http://front:50051,layered=http://orchestrator:50051).
    #[arg(long, env = "ZEROLAYER_BENCH_ENDPOINTS")]
    pub endpoints: Option<String>,
    /// With --endpoints: `/metrics` addresses as LABEL=HOST:PORT, comma-separated (a label may
    /// repeat: one entry per process).
    #[arg(long, env = "ZEROLAYER_BENCH_METRICS_ENDPOINTS")]
    pub metrics_endpoints: Option<String>,
    /// API key for --endpoints (the started deployments use --dev-auth).
    #[arg(long, env = "ZEROLAYER_BENCH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Extra `serve` flags for every engine process, whitespace-separated (e.g. "--kv-blocks 4096").
    #[arg(long, env = "ZEROLAYER_BENCH_ENGINE_FLAGS", allow_hyphen_values = true)]
    pub engine_flags: Option<String>,
    /// Extra `serve` flags for every gRPC-facing process (front, collapsed, orchestrator).
    #[arg(long, env = "ZEROLAYER_BENCH_EDGE_FLAGS", allow_hyphen_values = true)]
    pub edge_flags: Option<String>,
    /// Rounds: each runs every level for every mode, the order rotated each time.
    #[arg(long, env = "ZEROLAYER_BENCH_ROUNDS", default_value_t = 3)]
    pub rounds: usize,
    /// Directory for report.json, report.md and the SVG charts.
    #[arg(long, env = "ZEROLAYER_BENCH_OUT")]
    pub out: PathBuf,
    /// The workload.
    #[command(flatten)]
    pub load: WorkloadArgs,
}

/// A deployment mode on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CliMode {
    /// The engine serves gRPC itself.
    Collapsed,
    /// Front + engine over shared memory.
    Split,
    /// Orchestrator + Redis + engine without reuse.
    Layered,
}

impl From<CliMode> for Mode {
    fn from(m: CliMode) -> Self {
        match m {
            CliMode::Collapsed => Mode::Collapsed,
            CliMode::Split => Mode::Split,
            CliMode::Layered => Mode::Layered,
        }
    }
}

fn command_line() -> String {
    let mut args = std::env::args();
    let first = args.next().map(|a| {
        std::path::Path::new(&a)
            .file_name()
            .map_or(a.clone(), |f| f.to_string_lossy().into_owned())
    });
    first.into_iter().chain(args).collect::<Vec<_>>().join(" ")
}

fn flags(s: &Option<String>) -> Vec<String> {
    s.as_deref()
        .map(|s| s.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// `NAME=ADDR,…` pairs (a name may repeat).
fn metrics_pairs(spec: &str) -> anyhow::Result<Vec<(String, String)>> {
    spec.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (n, a) = p
                .split_once('=')
                .with_context(|| format!("{p:?} is not NAME=HOST:PORT"))?;
            Ok((n.trim().to_owned(), a.trim().to_owned()))
        })
        .collect()
}

/// Prints the terminal table and where the files went.
fn finish(report: &Report, out: Option<&std::path::Path>) {
    println!("\n{}", report.table());
    if let Some(dir) = out {
        println!(
            "report: {}/report.json, {}/report.md, charts: {}/*.svg",
            dir.display(),
            dir.display(),
            dir.display()
        );
    }
}

/// Runs `zerolayer bench …`.
pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        BenchCommand::Model(a) => crate::bench_model::run(*a),
        BenchCommand::Gpu(a) => crate::bench_gpu::run(*a),
        BenchCommand::Run(a) => run_endpoint(*a),
        BenchCommand::Compare(a) => run_compare(*a),
    }
}

fn run_endpoint(a: RunArgs) -> anyhow::Result<()> {
    let opts = a.load.run_options(
        a.rounds,
        a.out.clone(),
        None,
        "one running endpoint (not started by the bench)",
    )?;
    let metrics = a
        .metrics
        .as_deref()
        .map(metrics_pairs)
        .transpose()?
        .unwrap_or_default();
    let target = Target {
        label: a.label.unwrap_or_default(),
        endpoint: a.endpoint,
        api_key: a.api_key,
        deployment: None,
        metrics,
    };
    let report = compare::run_targets(vec![target], &opts)?;
    finish(&report, a.out.as_deref());
    Ok(())
}

fn run_compare(a: CompareArgs) -> anyhow::Result<()> {
    if let Some(spec) = &a.endpoints {
        let endpoints = compare::parse_endpoints(spec)?;
        let metrics = a
            .metrics_endpoints
            .as_deref()
            .map(metrics_pairs)
            .transpose()?
            .unwrap_or_default();
        let targets = endpoints
            .into_iter()
            .map(|(label, endpoint)| Target {
                metrics: metrics
                    .iter()
                    .filter(|(l, _)| *l == label)
                    .map(|(l, m)| (l.clone(), m.clone()))
                    .collect(),
                label,
                endpoint,
                api_key: a.api_key.clone(),
                deployment: None,
            })
            .collect();
        let opts = a.load.run_options(
            a.rounds,
            Some(a.out.clone()),
            None,
            "already-running deployments (--endpoints); CPU and memory not read (not child processes)",
        )?;
        let report = compare::run_targets(targets, &opts)?;
        finish(&report, Some(&a.out));
        return Ok(());
    }
    let bin = std::env::current_exe().context("locating the zerolayer binary")?;
    // Sockets and logs go to a private directory (short path: Unix socket names are limited
    // to 107 bytes); it is kept when the run fails, for the logs.
    let work = tempfile::Builder::new()
        .prefix("zerolayer-bench-")
        .tempdir()?;
    let mut launcher = Launcher::new(bin, a.model.clone(), work.path());
    launcher.tokenizer = a.tokenizer.clone();
    launcher.engine_flags = flags(&a.engine_flags);
    launcher.edge_flags = flags(&a.edge_flags);
    let modes: Vec<Mode> = a.modes.iter().map(|&m| m.into()).collect();
    let note = format!(
        "{} started once by the bench on this machine and up together for the whole run (dev auth, ephemeral keys{})",
        modes
            .iter()
            .map(|m| m.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        if launcher.engine_flags.is_empty() {
            String::new()
        } else {
            format!(", engine flags `{}`", launcher.engine_flags.join(" "))
        }
    );
    let opts = CompareOptions {
        launcher,
        modes,
        run: a
            .load
            .run_options(a.rounds, Some(a.out.clone()), Some(a.model.clone()), &note)?,
    };
    match compare::compare(&opts) {
        Ok(report) => {
            finish(&report, Some(&a.out));
            Ok(())
        }
        Err(e) => {
            let kept = work.keep();
            Err(e.context(format!("process logs kept in {}", kept.display())))
        }
    }
}
