//! Runs a workload against one or several endpoints, interleaved in rounds, and assembles the
//! report: `zerolayer bench run` (one endpoint) and `zerolayer bench compare` (the three
//! modes, started here or already running).
//!
//! **Every mode is up for the whole run and the modes take turns**: round r runs each level
//! for every mode, in an order rotated by one per round and level, so a burst of load from
//! elsewhere on the machine falls on all modes alike. Idle deployments are not free, so the
//! CPU each process burns while *other* modes run is measured and reported
//! (`cpu_seconds_idle`); on the development machine it is a small fraction of the own-workload
//! CPU (see BENCHMARKS.md), which is why starting everything once beats restarting every
//! deployment per round (start-up costs seconds and empties caches the workload then refills).

use std::{
    io::IsTerminal as _,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use zerolayer_client::{Client, ClientConfig};

use crate::{
    charts,
    chat::Chat,
    launch::{Deployment, Launcher, Mode, resources},
    load::{LevelSpec, run_level, sampling},
    prom,
    report::{
        Comparison, Machine, ModeReport, OrderEntry, ProcessReport, Report, SCHEMA, Setup,
        compare_modes, load_avg,
    },
    workload::{Level, Workload, WorkloadKind, prompt_text},
};

/// Conversation numbers reserved per round and level when the count is open-ended (staged
/// load): more conversations than any staged run on one machine starts.
pub const STAGED_CONVERSATION_SPAN: u64 = 1 << 32;

/// Turns of the warm-up conversation each endpoint gets before measuring: two, so both the
/// first-turn path (new slot) and the reuse path (handle verify, slot hit) are exercised once.
pub const WARMUP_TURNS: u32 = 2;

/// One endpoint under test.
#[derive(Debug)]
pub struct Target {
    /// Mode or endpoint label in the report.
    pub label: String,
    /// gRPC URL.
    pub endpoint: String,
    /// API key (none for dev-auth servers).
    pub api_key: Option<String>,
    /// The deployment, when the bench started it (resources are then read from /proc).
    pub deployment: Option<Deployment>,
    /// `/metrics` addresses as (process name, `host:port`); filled from the deployment when
    /// the bench started it.
    pub metrics: Vec<(String, String)>,
}

impl Target {
    /// A target for a deployment the bench started.
    pub fn started(deployment: Deployment, api_key: Option<String>) -> Self {
        let metrics = deployment
            .processes
            .iter()
            .filter_map(|p| p.metrics_addr.clone().map(|a| (p.name.clone(), a)))
            .collect();
        Self {
            label: deployment.mode.as_str().to_owned(),
            endpoint: deployment.endpoint.clone(),
            api_key,
            deployment: Some(deployment),
            metrics,
        }
    }
}

/// How a run is set up.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The workload.
    pub workload: Workload,
    /// Rounds (≥ 1).
    pub rounds: usize,
    /// Send one unrecorded warm-up conversation to each endpoint first.
    pub warmup: bool,
    /// Show a progress bar on stderr (only when stderr is a terminal).
    pub progress: bool,
    /// Where to write `report.json`, `report.md` and the charts (`None`: nowhere).
    pub out: Option<PathBuf>,
    /// The command line, for the report.
    pub command: String,
    /// Model, for the report (when known).
    pub model: Option<String>,
    /// How the deployments run, for the report.
    pub deployment_note: String,
}

/// Per process: CPU seconds at the last snapshot and what was attributed since.
#[derive(Debug, Default, Clone)]
struct CpuLedger {
    /// (target index, process index, pid); the last entry per target may be absent.
    procs: Vec<(usize, usize, u32)>,
    /// CPU during the owning target's segments.
    own: Vec<f64>,
    /// CPU during other targets' segments.
    idle: Vec<f64>,
    /// The bench process's CPU during each target's segments.
    client: Vec<f64>,
}

impl CpuLedger {
    fn new(targets: &[Target]) -> Self {
        let mut procs = Vec::new();
        for (t, target) in targets.iter().enumerate() {
            if let Some(d) = &target.deployment {
                for (i, p) in d.processes.iter().enumerate() {
                    procs.push((t, i, p.pid()));
                }
            }
        }
        let n = procs.len();
        Self {
            procs,
            own: vec![0.0; n],
            idle: vec![0.0; n],
            client: vec![0.0; targets.len()],
        }
    }

    /// CPU seconds of every process, then of the bench process itself.
    fn snapshot(&self) -> (Vec<f64>, f64) {
        let procs = self
            .procs
            .iter()
            .map(|&(_, _, pid)| resources(pid).map_or(f64::NAN, |r| r.cpu_seconds))
            .collect();
        let me = resources(std::process::id()).map_or(f64::NAN, |r| r.cpu_seconds);
        (procs, me)
    }

    fn attribute(&mut self, before: &(Vec<f64>, f64), after: &(Vec<f64>, f64), running: usize) {
        for (i, &(t, _, _)) in self.procs.iter().enumerate() {
            let d = after.0[i] - before.0[i];
            if d.is_finite() {
                if t == running {
                    self.own[i] += d;
                } else {
                    self.idle[i] += d;
                }
            }
        }
        let d = after.1 - before.1;
        if d.is_finite() {
            self.client[running] += d;
        }
    }
}

/// Counter values per process name (`prom::counters`).
type ProcessCounters = Vec<(String, std::collections::BTreeMap<String, f64>)>;

/// Scrapes every metrics address of `target`: counters per process, and the failures.
fn scrape_target(target: &Target) -> (ProcessCounters, Vec<String>) {
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for (name, addr) in &target.metrics {
        match prom::scrape(addr) {
            Ok(samples) => ok.push((name.clone(), prom::counters(&samples))),
            Err(e) => errors.push(format!("{name}: {e}")),
        }
    }
    (ok, errors)
}

/// The progress bar: a bar when the request count is known, a counter otherwise; hidden
/// unless asked for and stderr is a terminal.
fn progress_bar(show: bool, total: Option<u64>) -> ProgressBar {
    if !(show && std::io::stderr().is_terminal()) {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
    let template = if total.is_some() {
        "{elapsed_precise} [{bar:32}] {pos}/{len} requests ({per_sec}, eta {eta}) {msg}"
    } else {
        "{elapsed_precise} {spinner} {pos} requests ({per_sec}) {msg}"
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// The order of targets in round `round`, level `level`: rotated by one each time.
pub fn rotation(n: usize, round: usize, level: usize) -> Vec<usize> {
    (0..n).map(|i| (i + round + level) % n.max(1)).collect()
}

/// Runs `opts.workload` against every target, interleaved in rounds, and writes the report.
pub fn run_targets(mut targets: Vec<Target>, opts: &RunOptions) -> anyhow::Result<Report> {
    opts.workload.validate()?;
    anyhow::ensure!(!targets.is_empty(), "no endpoint to benchmark");
    anyhow::ensure!(opts.rounds >= 1, "--rounds must be at least 1");
    let started_unix_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let t0 = Instant::now();
    let mut machine = Machine::probe();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let workload = Arc::new(opts.workload.clone());

    // Clients (the channel spawns its connection task on the runtime).
    let clients: Vec<Client> = {
        let _guard = runtime.enter();
        targets
            .iter()
            .map(|t| {
                let mut cfg = ClientConfig::new(t.endpoint.clone());
                if let Some(k) = &t.api_key {
                    cfg = cfg.api_key(k.clone());
                }
                Client::new(cfg).with_context(|| format!("client for {} ({})", t.label, t.endpoint))
            })
            .collect::<anyhow::Result<_>>()?
    };

    // Probe every endpoint (the health check; an empty label becomes the mode the endpoint
    // reports) and warm it up.
    runtime.block_on(async {
        for (t, c) in targets.iter_mut().zip(&clients) {
            let probe = probe_until_ready(c)
                .await
                .with_context(|| format!("probing {} at {}", t.label, t.endpoint))?;
            if t.label.is_empty() {
                t.label = if probe.mode.is_empty() {
                    "endpoint".to_owned()
                } else {
                    probe.mode
                };
            }
            if opts.warmup {
                warm_up(c, &workload)
                    .await
                    .with_context(|| format!("warming up {}", t.label))?;
            }
        }
        anyhow::Ok(())
    })?;

    let before: Vec<_> = targets.iter().map(scrape_target).collect();
    let mut ledger = CpuLedger::new(&targets);
    let total = workload
        .requests_per_level()
        .map(|r| r * (opts.rounds * workload.levels.len() * targets.len()) as u64);
    let pb = progress_bar(opts.progress, total);
    let origin = Instant::now();
    let mut runs = Vec::new();
    let mut samples = Vec::new();
    let mut order = Vec::new();
    let span = match workload.kind {
        WorkloadKind::Staged => STAGED_CONVERSATION_SPAN,
        _ => workload.conversations as u64,
    };
    for round in 0..opts.rounds {
        for (li, level) in workload.levels.iter().enumerate() {
            let rot = rotation(targets.len(), round, li);
            order.push(OrderEntry {
                round,
                level: *level,
                modes: rot.iter().map(|&i| targets[i].label.clone()).collect(),
            });
            for &ti in &rot {
                pb.set_message(format!(
                    "round {}/{} · {} · {}",
                    round + 1,
                    opts.rounds,
                    targets[ti].label,
                    level
                ));
                let spec = LevelSpec {
                    label: targets[ti].label.clone(),
                    level: *level,
                    round,
                    conversation_base: (round * workload.levels.len() + li) as u64 * span,
                    origin,
                };
                let cpu0 = ledger.snapshot();
                let out = runtime.block_on(run_level(&clients[ti], &workload, spec, &pb))?;
                let cpu1 = ledger.snapshot();
                ledger.attribute(&cpu0, &cpu1, ti);
                runs.push(out.run);
                samples.extend(out.samples);
            }
        }
    }
    pb.finish_and_clear();
    let after: Vec<_> = targets.iter().map(scrape_target).collect();
    machine.load_avg_end = load_avg();

    // Per-mode figures; processes are read before the deployments stop.
    let mut modes = std::collections::BTreeMap::new();
    for (ti, t) in targets.iter().enumerate() {
        let s: Vec<_> = samples.iter().filter(|s| s.mode == t.label).collect();
        let r: Vec<_> = runs.iter().filter(|r| r.mode == t.label).collect();
        let mut m = ModeReport::from_samples(&t.label, &t.endpoint, &s, &r);
        if let Some(d) = &t.deployment {
            m.processes = d
                .processes
                .iter()
                .enumerate()
                .map(|(pi, p)| {
                    let li = ledger
                        .procs
                        .iter()
                        .position(|&(a, b, _)| a == ti && b == pi);
                    let res = p.resources().unwrap_or_default();
                    ProcessReport {
                        name: p.name.clone(),
                        pid: p.pid(),
                        cpu_seconds_total: res.cpu_seconds,
                        cpu_seconds_own: li.map_or(0.0, |i| ledger.own[i]),
                        cpu_seconds_idle: li.map_or(0.0, |i| ledger.idle[i]),
                        peak_rss_bytes: res.peak_rss_bytes,
                    }
                })
                .collect();
        }
        m.client_cpu_seconds = Some(ledger.client[ti]);
        let (b, be) = &before[ti];
        let (a, ae) = &after[ti];
        m.metrics_errors = be.iter().chain(ae).cloned().collect();
        for (name, after_counters) in a {
            let empty = Default::default();
            let before_counters = b.iter().find(|(n, _)| n == name).map_or(&empty, |(_, c)| c);
            let d = prom::delta(before_counters, after_counters);
            for (series, v) in &d {
                if let Some(path) = verify_path(series) {
                    *m.handle_verify.entry(path.to_owned()).or_insert(0.0) += v;
                }
            }
            m.metrics.insert(name.clone(), d);
        }
        modes.insert(t.label.clone(), m);
    }
    // Stop the servers now that /proc and /metrics have been read.
    for t in &mut targets {
        t.deployment = None;
    }

    let comparison: Comparison = compare_modes(&modes);
    let report = Report {
        schema: SCHEMA.to_owned(),
        setup: Setup {
            command: opts.command.clone(),
            started_unix_s,
            duration_s: t0.elapsed().as_secs_f64(),
            model: opts.model.clone(),
            modes: targets.iter().map(|t| t.label.clone()).collect(),
            workload: (*workload).clone(),
            workload_description: workload.describe(),
            rounds: opts.rounds,
            deployment: opts.deployment_note.clone(),
            token_note: "each user turn is N ASCII bytes; byte-level tokenizers (dummy models) make that exactly N \
                         tokens, other tokenizers fewer — the samples hold the token counts the engine reported"
                .to_owned(),
            machine,
            order,
        },
        modes,
        comparison,
        runs,
        samples,
    };
    if let Some(dir) = &opts.out {
        write_outputs(&report, dir)?;
    }
    Ok(report)
}

/// The verify path of a `zerolayer_handle_verify_total{…="PATH"}` series: engines label it
/// `path`, the orchestrator `outcome`; either way the single label's value is the path.
pub fn verify_path(series: &str) -> Option<&str> {
    let labels = series
        .strip_prefix("zerolayer_handle_verify_total{")?
        .strip_suffix("\"}")?;
    let (_, value) = labels.split_once("=\"")?;
    (!value.contains('"')).then_some(value)
}

/// Probes until the endpoint answers (retrying `UNAVAILABLE` for up to [`PROBE_TIMEOUT`]).
async fn probe_until_ready(client: &Client) -> anyhow::Result<zerolayer_proto::v1::ProbeResponse> {
    let deadline = Instant::now() + PROBE_TIMEOUT;
    loop {
        match client.probe().await {
            Ok(p) => return Ok(p),
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// One unrecorded conversation of the workload's sizes.
async fn warm_up(client: &Client, workload: &Workload) -> anyhow::Result<()> {
    let mut chat = Chat::new(client.clone(), sampling(workload), workload.delta);
    for turn in 1..=WARMUP_TURNS {
        chat.turn(prompt_text(
            workload.seed,
            u64::MAX,
            turn as u64,
            workload.new_tokens,
        ))
        .await?;
    }
    Ok(())
}

/// Writes `report.json`, `report.md` and the SVG charts into `dir`.
pub fn write_outputs(report: &Report, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = serde_json::to_vec_pretty(report)?;
    std::fs::write(dir.join("report.json"), json).context("writing report.json")?;
    charts::write_all(report, dir)?;
    std::fs::write(dir.join("report.md"), report.markdown(&charts::CHARTS))
        .context("writing report.md")?;
    Ok(())
}

/// What `zerolayer bench compare` starts, when it starts the deployments itself.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    /// Starts the processes (binary, model, flags, work directory).
    pub launcher: Launcher,
    /// Modes, in report order.
    pub modes: Vec<Mode>,
    /// The run.
    pub run: RunOptions,
}

/// Starts every mode (all up together for the whole run), runs the workload against each in
/// interleaved rounds, stops them and returns the report.
pub fn compare(opts: &CompareOptions) -> anyhow::Result<Report> {
    anyhow::ensure!(!opts.modes.is_empty(), "no mode to compare");
    let mut targets = Vec::new();
    for &mode in &opts.modes {
        eprintln!("starting {mode} ({}) …", opts.launcher.model);
        let d = opts
            .launcher
            .start(mode)
            .with_context(|| format!("starting {mode}"))?;
        targets.push(Target::started(d, None));
    }
    run_targets(targets, &opts.run)
}

/// Parses `mode=URL,mode=URL` (each label once) into (label, URL) pairs.
pub fn parse_endpoints(spec: &str) -> anyhow::Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (label, url) = part
            .split_once('=')
            .with_context(|| format!("{part:?} is not LABEL=URL"))?;
        let (label, url) = (label.trim(), url.trim());
        anyhow::ensure!(
            !label.is_empty() && !url.is_empty(),
            "{part:?} is not LABEL=URL"
        );
        anyhow::ensure!(!out.iter().any(|(l, _)| l == label), "{label} given twice");
        out.push((label.to_owned(), url.to_owned()));
    }
    anyhow::ensure!(!out.is_empty(), "no endpoints given");
    Ok(out)
}

/// How long an endpoint may take to answer its first probe: generous for containers that
/// are still loading a model.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(120);

/// Levels from `--concurrency` and `--rate` lists (rates win: open loop).
pub fn levels(kind: WorkloadKind, concurrency: &[usize], rates: &[f64]) -> Vec<Level> {
    if kind == WorkloadKind::Staged {
        vec![Level::Staged]
    } else if !rates.is_empty() {
        rates.iter().map(|&r| Level::Rate(r)).collect()
    } else {
        concurrency.iter().map(|&c| Level::Concurrency(c)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_paths_are_read_from_either_label_name() {
        assert_eq!(
            verify_path(r#"zerolayer_handle_verify_total{path="fast_path"}"#),
            Some("fast_path")
        );
        assert_eq!(
            verify_path(r#"zerolayer_handle_verify_total{outcome="full_verify"}"#),
            Some("full_verify")
        );
        assert_eq!(
            verify_path(r#"zerolayer_handle_verify_total{a="x",b="y"}"#),
            None
        );
        assert_eq!(verify_path(r#"zerolayer_requests_total{path="x"}"#), None);
    }

    #[test]
    fn rotation_gives_every_mode_every_position() {
        assert_eq!(rotation(3, 0, 0), vec![0, 1, 2]);
        assert_eq!(rotation(3, 1, 0), vec![1, 2, 0]);
        assert_eq!(rotation(3, 0, 2), vec![2, 0, 1]);
        let firsts: Vec<usize> = (0..3).map(|r| rotation(3, r, 0)[0]).collect();
        assert_eq!(firsts, vec![0, 1, 2]);
    }

    #[test]
    fn endpoints_parse_as_label_url_pairs() {
        let e = parse_endpoints("collapsed=http://a:1, split=http://b:2").unwrap();
        assert_eq!(
            e,
            vec![
                ("collapsed".into(), "http://a:1".into()),
                ("split".into(), "http://b:2".into())
            ]
        );
        assert!(parse_endpoints("split").is_err());
        assert!(parse_endpoints("split=a,split=b").is_err());
        assert!(parse_endpoints("").is_err());
    }

    #[test]
    fn rates_make_an_open_loop_and_stages_a_single_level() {
        assert_eq!(
            levels(WorkloadKind::MultiTurn, &[1, 4], &[]),
            vec![Level::Concurrency(1), Level::Concurrency(4)]
        );
        assert_eq!(
            levels(WorkloadKind::SingleShot, &[1], &[5.0]),
            vec![Level::Rate(5.0)]
        );
        assert_eq!(levels(WorkloadKind::Staged, &[1], &[]), vec![Level::Staged]);
    }
}
