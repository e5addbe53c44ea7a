//! The benchmark report: per-mode figures computed from the raw samples, the comparison
//! between modes, and its renderings (JSON, Markdown, a terminal table).
//!
//! `report.json` contract (other tools read it): top-level `modes` maps each mode label to an
//! object with `ttft_ms` and `e2e_ms` (objects with `p50`, `p95`, `p99`, …; `null` when the
//! mode had no successful request), `requests_per_s` and `cached_token_ratio`. Everything else
//! (`setup`, `comparison`, `runs`, every raw sample in `samples`) is additional.

use std::{collections::BTreeMap, fmt::Write as _};

use crate::{
    load::LevelRun,
    sample::Sample,
    stats::{Percentiles, median},
    workload::{Level, Workload},
};

/// Format tag of `report.json`; bumped when a field changes meaning.
pub const SCHEMA: &str = "zerolayer-bench-report/1";

/// The whole report.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Report {
    /// [`SCHEMA`].
    pub schema: String,
    /// How the run was set up.
    pub setup: Setup,
    /// Figures per mode label.
    pub modes: BTreeMap<String, ModeReport>,
    /// Ratios between modes (when the modes involved ran).
    pub comparison: Comparison,
    /// Every level run, in execution order.
    pub runs: Vec<LevelRun>,
    /// Every request.
    pub samples: Vec<Sample>,
}

/// The machine.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Machine {
    /// Logical CPUs available to this process.
    pub cpus: usize,
    /// `model name` from /proc/cpuinfo.
    pub cpu_model: String,
    /// `MemTotal` from /proc/meminfo, bytes.
    pub mem_total_bytes: u64,
    /// Kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel: String,
    /// 1/5/15-minute load averages when the run started.
    pub load_avg_start: Vec<f64>,
    /// 1/5/15-minute load averages when the run ended.
    pub load_avg_end: Vec<f64>,
}

impl Machine {
    /// Reads /proc (fields stay empty where it is unreadable).
    pub fn probe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .and_then(|r| r.split_once(':'))
                    .map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_total_bytes = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024);
        Self {
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            cpu_model,
            mem_total_bytes,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_owned(),
            load_avg_start: load_avg(),
            load_avg_end: Vec::new(),
        }
    }
}

/// The 1/5/15-minute load averages (empty when /proc/loadavg is unreadable).
pub fn load_avg() -> Vec<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .filter_map(|v| v.parse().ok())
        .collect()
}

/// How the run was set up.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Setup {
    /// The command line.
    pub command: String,
    /// Unix time of the start, seconds.
    pub started_unix_s: u64,
    /// Wall time of the whole run (start-up and warm-up included), seconds.
    pub duration_s: f64,
    /// Model served (when the bench started the servers).
    pub model: Option<String>,
    /// Mode labels in report order.
    pub modes: Vec<String>,
    /// The workload every mode received.
    pub workload: Workload,
    /// The workload in words.
    pub workload_description: String,
    /// Rounds.
    pub rounds: usize,
    /// How deployments were run (all up together, or endpoints given).
    pub deployment: String,
    /// How prompt sizes relate to tokens.
    pub token_note: String,
    /// The machine.
    pub machine: Machine,
    /// Per round and level, the order in which the modes ran.
    pub order: Vec<OrderEntry>,
}

/// The order of the modes in one round and level.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct OrderEntry {
    /// Round number.
    pub round: usize,
    /// Level.
    pub level: Level,
    /// Mode labels in execution order.
    pub modes: Vec<String>,
}

/// CPU and memory of one server process.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ProcessReport {
    /// Role (`collapsed`, `engine`, `front`, `redis`, `layered-engine`, `orchestrator`).
    pub name: String,
    /// Process id.
    pub pid: u32,
    /// CPU seconds (user + system) over the process's whole life, read before stopping it.
    pub cpu_seconds_total: f64,
    /// CPU seconds while this mode's workload ran (after warm-up).
    pub cpu_seconds_own: f64,
    /// CPU seconds while other modes' workloads ran: the cost of leaving it up and idle.
    pub cpu_seconds_idle: f64,
    /// Peak resident set size (VmHWM), bytes.
    pub peak_rss_bytes: u64,
}

/// Figures of one level of one mode, over all rounds.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LevelReport {
    /// The level.
    pub level: Level,
    /// Successful requests.
    pub requests: usize,
    /// Failed requests.
    pub errors: usize,
    /// Wall time over all rounds, seconds.
    pub wall_s: f64,
    /// Successful requests per second of wall time.
    pub requests_per_s: f64,
    /// Generated tokens per second of wall time.
    pub tokens_per_s: f64,
    /// Mean requests in flight at request start.
    pub mean_in_flight: f64,
    /// Time to first token, ms.
    pub ttft_ms: Option<Percentiles>,
    /// End-to-end latency, ms.
    pub e2e_ms: Option<Percentiles>,
    /// Inter-token gaps, ms.
    pub itl_ms: Option<Percentiles>,
}

/// Figures of one turn number of one mode.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TurnReport {
    /// Turn number from 1.
    pub turn: u32,
    /// Successful requests.
    pub requests: usize,
    /// Time to first token, ms.
    pub ttft_ms: Option<Percentiles>,
    /// End-to-end latency, ms.
    pub e2e_ms: Option<Percentiles>,
    /// Mean prompt tokens.
    pub prompt_tokens_mean: f64,
    /// Mean cached prompt tokens.
    pub cached_tokens_mean: f64,
    /// Mean prefilled prompt tokens.
    pub prefilled_tokens_mean: f64,
}

/// Figures of one round of one mode (spread between rounds shows the noise).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RoundReport {
    /// Round number.
    pub round: usize,
    /// Successful requests.
    pub requests: usize,
    /// Successful requests per second of this round's wall time.
    pub requests_per_s: f64,
    /// Median TTFT, ms.
    pub ttft_p50_ms: Option<f64>,
    /// Median e2e, ms.
    pub e2e_p50_ms: Option<f64>,
}

/// Everything measured for one mode.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ModeReport {
    /// Mode label.
    pub label: String,
    /// gRPC endpoint used.
    pub endpoint: String,
    /// Requests sent.
    pub attempted: usize,
    /// Successful requests.
    pub requests: usize,
    /// Failed requests.
    pub errors: usize,
    /// Failed requests by reason.
    pub errors_by_reason: BTreeMap<String, usize>,
    /// Turns not sent because their conversation failed earlier.
    pub abandoned_turns: u64,
    /// Time to first token, ms (successful requests).
    pub ttft_ms: Option<Percentiles>,
    /// Inter-token gaps, ms (all gaps of successful requests).
    pub itl_ms: Option<Percentiles>,
    /// End-to-end latency, ms (successful requests).
    pub e2e_ms: Option<Percentiles>,
    /// Engine-reported queue time, ms.
    pub server_queue_ms: Option<Percentiles>,
    /// Engine-reported prefill time, ms.
    pub server_prefill_ms: Option<Percentiles>,
    /// Successful requests per second of this mode's wall time (all levels and rounds).
    pub requests_per_s: f64,
    /// Generated tokens per second of wall time.
    pub tokens_per_s: f64,
    /// Prompt tokens (whole histories) per second of wall time.
    pub prompt_tokens_per_s: f64,
    /// Cached prompt tokens ÷ prompt tokens (0 when no prompt token was sent).
    pub cached_token_ratio: f64,
    /// Sum of prompt tokens.
    pub prompt_tokens: u64,
    /// Sum of cached prompt tokens.
    pub cached_tokens: u64,
    /// Sum of prefilled prompt tokens.
    pub prefilled_tokens: u64,
    /// Sum of generated tokens.
    pub generated_tokens: u64,
    /// Requests by reuse outcome.
    pub reuse: BTreeMap<String, usize>,
    /// Delta requests resent in full after `CONTEXT_EVICTED`.
    pub resent_full: usize,
    /// Wall time of this mode's levels, seconds.
    pub wall_s: f64,
    /// Per level.
    pub by_level: Vec<LevelReport>,
    /// Per turn number.
    pub by_turn: Vec<TurnReport>,
    /// Per round.
    pub by_round: Vec<RoundReport>,
    /// Server processes (empty when the endpoint was not started by the bench).
    pub processes: Vec<ProcessReport>,
    /// CPU seconds of the bench process itself while this mode ran (the load generator
    /// shares the machine).
    pub client_cpu_seconds: Option<f64>,
    /// Handle verifications by path (`fast_path`, `full_verify`, `rejected`), summed over
    /// the mode's processes, during the measured workload.
    pub handle_verify: BTreeMap<String, f64>,
    /// Counter deltas per process during the measured workload (`/metrics`).
    pub metrics: BTreeMap<String, BTreeMap<String, f64>>,
    /// Scrape failures (metrics then missing, visibly).
    pub metrics_errors: Vec<String>,
}

fn sum_u64(samples: &[&Sample], f: impl Fn(&Sample) -> u32) -> u64 {
    samples.iter().map(|s| f(s) as u64).sum()
}

fn rate(n: f64, wall: f64) -> f64 {
    if wall > 0.0 { n / wall } else { 0.0 }
}

fn mean(values: impl IntoIterator<Item = f64>) -> f64 {
    let (s, n) = values
        .into_iter()
        .fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}

impl ModeReport {
    /// Figures of `label` from its samples and level runs (processes and metrics are added
    /// by the caller).
    pub fn from_samples(
        label: &str,
        endpoint: &str,
        samples: &[&Sample],
        runs: &[&LevelRun],
    ) -> Self {
        let ok: Vec<&Sample> = samples.iter().copied().filter(|s| s.is_ok()).collect();
        let wall_s: f64 = runs.iter().map(|r| r.wall_s).sum();
        let mut errors_by_reason = BTreeMap::new();
        for s in samples {
            if let Some(e) = &s.error {
                *errors_by_reason.entry(e.clone()).or_insert(0) += 1;
            }
        }
        let mut reuse = BTreeMap::new();
        for s in &ok {
            *reuse.entry(s.reuse.clone()).or_insert(0) += 1;
        }
        let prompt_tokens = sum_u64(&ok, |s| s.prompt_tokens);
        let cached_tokens = sum_u64(&ok, |s| s.cached_tokens);
        let generated_tokens = sum_u64(&ok, |s| s.generated_tokens);

        let mut levels: Vec<Level> = Vec::new();
        for r in runs {
            if !levels.contains(&r.level) {
                levels.push(r.level);
            }
        }
        let by_level = levels
            .iter()
            .map(|level| {
                let lvl: Vec<&Sample> = samples
                    .iter()
                    .copied()
                    .filter(|s| s.level == *level)
                    .collect();
                let lok: Vec<&Sample> = lvl.iter().copied().filter(|s| s.is_ok()).collect();
                let wall: f64 = runs
                    .iter()
                    .filter(|r| r.level == *level)
                    .map(|r| r.wall_s)
                    .sum();
                LevelReport {
                    level: *level,
                    requests: lok.len(),
                    errors: lvl.len() - lok.len(),
                    wall_s: wall,
                    requests_per_s: rate(lok.len() as f64, wall),
                    tokens_per_s: rate(sum_u64(&lok, |s| s.generated_tokens) as f64, wall),
                    mean_in_flight: mean(lvl.iter().map(|s| s.in_flight as f64)),
                    ttft_ms: Percentiles::of(lok.iter().filter_map(|s| s.ttft_ms)),
                    e2e_ms: Percentiles::of(lok.iter().map(|s| s.e2e_ms)),
                    itl_ms: Percentiles::of(lok.iter().flat_map(|s| s.itl_ms.iter().copied())),
                }
            })
            .collect();

        let max_turn = samples.iter().map(|s| s.turn).max().unwrap_or(0);
        let by_turn = (1..=max_turn)
            .map(|turn| {
                let t: Vec<&Sample> = ok.iter().copied().filter(|s| s.turn == turn).collect();
                TurnReport {
                    turn,
                    requests: t.len(),
                    ttft_ms: Percentiles::of(t.iter().filter_map(|s| s.ttft_ms)),
                    e2e_ms: Percentiles::of(t.iter().map(|s| s.e2e_ms)),
                    prompt_tokens_mean: mean(t.iter().map(|s| s.prompt_tokens as f64)),
                    cached_tokens_mean: mean(t.iter().map(|s| s.cached_tokens as f64)),
                    prefilled_tokens_mean: mean(t.iter().map(|s| s.prefilled_tokens as f64)),
                }
            })
            .collect();

        let mut rounds: Vec<usize> = runs.iter().map(|r| r.round).collect();
        rounds.dedup();
        rounds.sort_unstable();
        rounds.dedup();
        let by_round = rounds
            .iter()
            .map(|round| {
                let r: Vec<&Sample> = ok.iter().copied().filter(|s| s.round == *round).collect();
                let wall: f64 = runs
                    .iter()
                    .filter(|x| x.round == *round)
                    .map(|x| x.wall_s)
                    .sum();
                RoundReport {
                    round: *round,
                    requests: r.len(),
                    requests_per_s: rate(r.len() as f64, wall),
                    ttft_p50_ms: median(r.iter().filter_map(|s| s.ttft_ms)),
                    e2e_p50_ms: median(r.iter().map(|s| s.e2e_ms)),
                }
            })
            .collect();

        Self {
            label: label.to_owned(),
            endpoint: endpoint.to_owned(),
            attempted: samples.len(),
            requests: ok.len(),
            errors: samples.len() - ok.len(),
            errors_by_reason,
            abandoned_turns: runs.iter().map(|r| r.abandoned_turns).sum(),
            ttft_ms: Percentiles::of(ok.iter().filter_map(|s| s.ttft_ms)),
            itl_ms: Percentiles::of(ok.iter().flat_map(|s| s.itl_ms.iter().copied())),
            e2e_ms: Percentiles::of(ok.iter().map(|s| s.e2e_ms)),
            server_queue_ms: Percentiles::of(ok.iter().map(|s| s.server_queue_ms)),
            server_prefill_ms: Percentiles::of(ok.iter().map(|s| s.server_prefill_ms)),
            requests_per_s: rate(ok.len() as f64, wall_s),
            tokens_per_s: rate(generated_tokens as f64, wall_s),
            prompt_tokens_per_s: rate(prompt_tokens as f64, wall_s),
            cached_token_ratio: if prompt_tokens == 0 {
                0.0
            } else {
                cached_tokens as f64 / prompt_tokens as f64
            },
            prompt_tokens,
            cached_tokens,
            prefilled_tokens: sum_u64(&ok, |s| s.prefilled_tokens),
            generated_tokens,
            reuse,
            resent_full: ok.iter().filter(|s| s.resent_full).count(),
            wall_s,
            by_level,
            by_turn,
            by_round,
            processes: Vec::new(),
            client_cpu_seconds: None,
            handle_verify: BTreeMap::new(),
            metrics: BTreeMap::new(),
            metrics_errors: Vec::new(),
        }
    }
}

/// Ratios between modes.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Comparison {
    /// Named ratios (`split_over_collapsed_e2e_p50`, …); absent when a mode or figure is
    /// missing.
    pub ratios: BTreeMap<String, f64>,
    /// Throughput at equal tail latency, against the layered baseline.
    pub equal_p99: Option<EqualP99>,
}

/// Requests/s each mode sustains while its e2e p99 stays within the baseline's p99 at the
/// baseline's best throughput.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EqualP99 {
    /// The baseline mode.
    pub baseline: String,
    /// The baseline's e2e p99 at its highest-throughput level, ms: the latency bound.
    pub bound_ms: f64,
    /// The baseline's requests/s at that level.
    pub baseline_requests_per_s: f64,
    /// Best requests/s of each mode over the levels whose e2e p99 ≤ the bound (`None`: no
    /// level met it).
    pub requests_per_s: BTreeMap<String, Option<f64>>,
    /// Each mode's best requests/s ÷ the baseline's.
    pub ratio: BTreeMap<String, Option<f64>>,
    /// Per mode: whether its best level is the highest one tried (then the figure is a lower
    /// bound: more concurrency might have sustained more).
    pub at_highest_level: BTreeMap<String, bool>,
}

/// Computes the comparison of whichever of `collapsed`, `split`, `layered` are present.
pub fn compare_modes(modes: &BTreeMap<String, ModeReport>) -> Comparison {
    let mut ratios = BTreeMap::new();
    let get = |m: &str| modes.get(m);
    let mut put = |name: String, num: Option<f64>, den: Option<f64>| {
        if let (Some(n), Some(d)) = (num, den)
            && d > 0.0
        {
            ratios.insert(name, n / d);
        }
    };
    let p50 =
        |m: &str, f: fn(&ModeReport) -> Option<Percentiles>| get(m).and_then(f).map(|p| p.p50);
    for (a, b) in [
        ("split", "collapsed"),
        ("layered", "split"),
        ("layered", "collapsed"),
    ] {
        put(
            format!("{a}_over_{b}_e2e_p50"),
            p50(a, |m| m.e2e_ms),
            p50(b, |m| m.e2e_ms),
        );
        put(
            format!("{a}_over_{b}_ttft_p50"),
            p50(a, |m| m.ttft_ms),
            p50(b, |m| m.ttft_ms),
        );
        // TTFT at the last turn number that both modes completed.
        if let (Some(ma), Some(mb)) = (get(a), get(b)) {
            let last = ma.by_turn.iter().rev().find(|t| {
                t.ttft_ms.is_some()
                    && mb
                        .by_turn
                        .iter()
                        .any(|u| u.turn == t.turn && u.ttft_ms.is_some())
            });
            if let Some(ta) = last
                && ta.turn > 1
                && let Some(tb) = mb.by_turn.iter().find(|u| u.turn == ta.turn)
            {
                put(
                    format!("{a}_over_{b}_ttft_p50_turn_{}", ta.turn),
                    ta.ttft_ms.map(|p| p.p50),
                    tb.ttft_ms.map(|p| p.p50),
                );
            }
        }
    }
    for m in ["collapsed", "split"] {
        put(
            format!("{m}_over_layered_requests_per_s"),
            get(m).map(|r| r.requests_per_s),
            get("layered").map(|r| r.requests_per_s),
        );
    }
    Comparison {
        ratios,
        equal_p99: equal_p99(modes, "layered"),
    }
}

fn equal_p99(modes: &BTreeMap<String, ModeReport>, baseline: &str) -> Option<EqualP99> {
    let base = modes.get(baseline)?;
    let best = base
        .by_level
        .iter()
        .filter(|l| l.e2e_ms.is_some() && l.requests_per_s > 0.0)
        .max_by(|a, b| a.requests_per_s.total_cmp(&b.requests_per_s))?;
    let bound_ms = best.e2e_ms?.p99;
    let mut requests_per_s = BTreeMap::new();
    let mut ratio = BTreeMap::new();
    let mut at_highest_level = BTreeMap::new();
    for (label, m) in modes {
        let top = m
            .by_level
            .iter()
            .map(|l| l.level.x())
            .fold(f64::NEG_INFINITY, f64::max);
        let within = m
            .by_level
            .iter()
            .filter(|l| l.e2e_ms.is_some_and(|p| p.p99 <= bound_ms))
            .max_by(|a, b| a.requests_per_s.total_cmp(&b.requests_per_s));
        requests_per_s.insert(label.clone(), within.map(|l| l.requests_per_s));
        ratio.insert(
            label.clone(),
            within.map(|l| l.requests_per_s / best.requests_per_s),
        );
        at_highest_level.insert(label.clone(), within.is_some_and(|l| l.level.x() >= top));
    }
    Some(EqualP99 {
        baseline: baseline.to_owned(),
        bound_ms,
        baseline_requests_per_s: best.requests_per_s,
        requests_per_s,
        ratio,
        at_highest_level,
    })
}

impl Report {
    /// Mode reports in the run's order.
    pub fn ordered_modes(&self) -> Vec<&ModeReport> {
        self.setup
            .modes
            .iter()
            .filter_map(|m| self.modes.get(m))
            .collect()
    }

    /// The terminal table printed at the end of a run.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<10} {:>6} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>8} {:>8} {:>8} {:>7}",
            "mode",
            "req",
            "err",
            "req/s",
            "tok/s",
            "ttft50",
            "ttft95",
            "ttft99",
            "itl50",
            "e2e50",
            "e2e95",
            "e2e99",
            "cached"
        );
        for m in self.ordered_modes() {
            let p = |x: Option<Percentiles>, f: fn(&Percentiles) -> f64| {
                x.map_or("-".to_owned(), |p| fmt_ms(f(&p)))
            };
            let _ = writeln!(
                out,
                "{:<10} {:>6} {:>5} {:>8.1} {:>8.1} {:>8} {:>8} {:>8} {:>7} {:>8} {:>8} {:>8} {:>6.1}%",
                m.label,
                m.requests,
                m.errors,
                m.requests_per_s,
                m.tokens_per_s,
                p(m.ttft_ms, |p| p.p50),
                p(m.ttft_ms, |p| p.p95),
                p(m.ttft_ms, |p| p.p99),
                p(m.itl_ms, |p| p.p50),
                p(m.e2e_ms, |p| p.p50),
                p(m.e2e_ms, |p| p.p95),
                p(m.e2e_ms, |p| p.p99),
                m.cached_token_ratio * 100.0
            );
        }
        let _ = writeln!(
            out,
            "(latencies in ms; cached = cached prompt tokens ÷ prompt tokens)"
        );
        if !self.comparison.ratios.is_empty() {
            let _ = writeln!(out);
            for (k, v) in &self.comparison.ratios {
                let _ = writeln!(out, "{k:<48} {v:>8.3}");
            }
        }
        out
    }

    /// The Markdown report.
    pub fn markdown(&self, charts: &[(&str, &str)]) -> String {
        let mut o = String::new();
        let s = &self.setup;
        let _ = writeln!(o, "# zerolayer bench report\n");
        let _ = writeln!(o, "## Setup\n");
        let _ = writeln!(o, "- command: `{}`", s.command);
        if let Some(model) = &s.model {
            let _ = writeln!(o, "- model: `{model}`");
        }
        let _ = writeln!(o, "- workload: {}", s.workload_description);
        let _ = writeln!(
            o,
            "- rounds: {} (modes interleaved, order rotated every round and level)",
            s.rounds
        );
        let _ = writeln!(o, "- deployment: {}", s.deployment);
        let _ = writeln!(o, "- prompt sizes: {}", s.token_note);
        let m = &s.machine;
        let _ = writeln!(
            o,
            "- machine: {} CPUs ({}), {:.1} GiB RAM, kernel {}; load average at start {:?}, at end {:?}",
            m.cpus,
            m.cpu_model,
            m.mem_total_bytes as f64 / (1u64 << 30) as f64,
            m.kernel,
            m.load_avg_start,
            m.load_avg_end
        );
        let _ = writeln!(o, "- duration: {:.1} s\n", s.duration_s);

        let _ = writeln!(o, "## Latency and throughput per mode\n");
        let _ = writeln!(
            o,
            "| mode | requests | errors | req/s | tok/s | TTFT p50 / p95 / p99 ms | ITL p50 / p95 / p99 ms | e2e p50 / p95 / p99 ms | cached tokens |"
        );
        let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for m in self.ordered_modes() {
            let _ = writeln!(
                o,
                "| {} | {} | {} | {:.1} | {:.1} | {} | {} | {} | {:.1} % |",
                m.label,
                m.requests,
                m.errors,
                m.requests_per_s,
                m.tokens_per_s,
                triple(m.ttft_ms),
                triple(m.itl_ms),
                triple(m.e2e_ms),
                m.cached_token_ratio * 100.0
            );
        }
        if !self.comparison.ratios.is_empty() {
            let _ = writeln!(o, "\n## Ratios\n\n| ratio | value |\n|---|---:|");
            for (k, v) in &self.comparison.ratios {
                let _ = writeln!(o, "| {k} | {v:.3} |");
            }
        }
        if let Some(e) = &self.comparison.equal_p99 {
            let _ = writeln!(
                o,
                "\nAt equal p99 (e2e p99 ≤ {:.1} ms, {}'s p99 at its best level, {:.1} req/s):\n",
                e.bound_ms, e.baseline, e.baseline_requests_per_s
            );
            let _ = writeln!(
                o,
                "| mode | best req/s within the bound | × {} | at the highest level tried |\n|---|---:|---:|---|",
                e.baseline
            );
            for m in self.ordered_modes() {
                let r = e.requests_per_s.get(&m.label).copied().flatten();
                let x = e.ratio.get(&m.label).copied().flatten();
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} |",
                    m.label,
                    r.map_or("none".into(), |v| format!("{v:.1}")),
                    x.map_or("-".into(), |v| format!("{v:.2}")),
                    if e.at_highest_level.get(&m.label).copied().unwrap_or(false) {
                        "yes (lower bound)"
                    } else {
                        "no"
                    }
                );
            }
        }

        let _ = writeln!(o, "\n## Per load level\n");
        let _ = writeln!(
            o,
            "| mode | level | requests | errors | mean in flight | req/s | tok/s | TTFT p50 / p99 ms | e2e p50 / p99 ms |"
        );
        let _ = writeln!(o, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
        for m in self.ordered_modes() {
            for l in &m.by_level {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {} | {} |",
                    m.label,
                    l.level,
                    l.requests,
                    l.errors,
                    l.mean_in_flight,
                    l.requests_per_s,
                    l.tokens_per_s,
                    pair(l.ttft_ms),
                    pair(l.e2e_ms)
                );
            }
        }

        let turns = self
            .ordered_modes()
            .iter()
            .map(|m| m.by_turn.len())
            .max()
            .unwrap_or(0);
        if turns > 1 {
            let _ = writeln!(
                o,
                "\n## TTFT by turn (p50 ms; mean prompt / cached tokens)\n"
            );
            let mut head = "| turn |".to_owned();
            let mut rule = "|---:|".to_owned();
            for m in self.ordered_modes() {
                let _ = write!(head, " {} |", m.label);
                rule.push_str("---:|");
            }
            let _ = writeln!(o, "{head}\n{rule}");
            for t in 0..turns {
                let _ = write!(o, "| {} |", t + 1);
                for m in self.ordered_modes() {
                    match m.by_turn.get(t) {
                        Some(tr) => {
                            let _ = write!(
                                o,
                                " {} ({:.0} / {:.0}) |",
                                tr.ttft_ms.map_or("-".into(), |p| fmt_ms(p.p50)),
                                tr.prompt_tokens_mean,
                                tr.cached_tokens_mean
                            );
                        }
                        None => o.push_str(" - |"),
                    }
                }
                o.push('\n');
            }
        }

        let _ = writeln!(
            o,
            "\n## Rounds (spread = noise)\n\n| mode | round | requests | req/s | TTFT p50 ms | e2e p50 ms |\n|---|---:|---:|---:|---:|---:|"
        );
        for m in self.ordered_modes() {
            for r in &m.by_round {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {:.1} | {} | {} |",
                    m.label,
                    r.round,
                    r.requests,
                    r.requests_per_s,
                    r.ttft_p50_ms.map_or("-".into(), fmt_ms),
                    r.e2e_p50_ms.map_or("-".into(), fmt_ms)
                );
            }
        }

        let _ = writeln!(o, "\n## Processes\n");
        let _ = writeln!(
            o,
            "| mode | process | CPU s (own workload) | CPU s (idle, other modes running) | CPU s (lifetime) | peak RSS MiB |\n|---|---|---:|---:|---:|---:|"
        );
        for m in self.ordered_modes() {
            for p in &m.processes {
                let _ = writeln!(
                    o,
                    "| {} | {} | {:.2} | {:.2} | {:.2} | {:.1} |",
                    m.label,
                    p.name,
                    p.cpu_seconds_own,
                    p.cpu_seconds_idle,
                    p.cpu_seconds_total,
                    p.peak_rss_bytes as f64 / (1u64 << 20) as f64
                );
            }
            if let Some(c) = m.client_cpu_seconds {
                let _ = writeln!(
                    o,
                    "| {} | bench client (this process) | {c:.2} | - | - | - |",
                    m.label
                );
            }
        }

        let _ = writeln!(o, "\n## Handle verification, reuse and errors\n");
        let _ = writeln!(
            o,
            "| mode | fast path | full verify | rejected | reuse outcomes | errors by reason |\n|---|---:|---:|---:|---|---|"
        );
        for m in self.ordered_modes() {
            let v = |k: &str| {
                m.handle_verify
                    .get(k)
                    .map_or("-".into(), |v| format!("{v:.0}"))
            };
            let reuse: Vec<String> = m.reuse.iter().map(|(k, v)| format!("{k} {v}")).collect();
            let errors: Vec<String> = m
                .errors_by_reason
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} |",
                m.label,
                v("fast_path"),
                v("full_verify"),
                v("rejected"),
                reuse.join(", "),
                if errors.is_empty() {
                    "none".to_owned()
                } else {
                    errors.join(", ")
                }
            );
        }
        for m in self.ordered_modes() {
            for e in &m.metrics_errors {
                let _ = writeln!(o, "\n- {}: metrics unavailable: {e}", m.label);
            }
        }

        if !charts.is_empty() {
            let _ = writeln!(o, "\n## Charts\n");
            for (file, title) in charts {
                let _ = writeln!(o, "![{title}]({file})\n");
            }
        }
        let _ = writeln!(
            o,
            "Raw samples: `report.json` (`samples`, one per request)."
        );
        o
    }
}

/// Milliseconds with a precision that suits the magnitude.
pub fn fmt_ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn triple(p: Option<Percentiles>) -> String {
    p.map_or("-".into(), |p| {
        format!("{} / {} / {}", fmt_ms(p.p50), fmt_ms(p.p95), fmt_ms(p.p99))
    })
}

fn pair(p: Option<Percentiles>) -> String {
    p.map_or("-".into(), |p| {
        format!("{} / {}", fmt_ms(p.p50), fmt_ms(p.p99))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(
        mode: &str,
        level: Level,
        round: usize,
        turn: u32,
        e2e: f64,
        error: Option<&str>,
    ) -> Sample {
        Sample {
            mode: mode.into(),
            workload: "multi-turn".into(),
            round,
            level,
            in_flight: 1,
            conversation: 0,
            turn,
            start_ms: 0.0,
            ttft_ms: error.is_none().then_some(e2e / 2.0),
            itl_ms: vec![1.0, 2.0],
            e2e_ms: e2e,
            prompt_tokens: 100,
            cached_tokens: if turn > 1 { 80 } else { 0 },
            prefilled_tokens: 20,
            generated_tokens: 4,
            reuse: if turn > 1 { "hit".into() } else { "new".into() },
            resent_full: false,
            server_queue_ms: 0.1,
            server_prefill_ms: 1.0,
            server_decode_ms: 2.0,
            error: error.map(str::to_owned),
            error_message: error.map(str::to_owned),
        }
    }

    fn run(mode: &str, level: Level, round: usize, wall_s: f64) -> LevelRun {
        LevelRun {
            mode: mode.into(),
            round,
            level,
            started_s: 0.0,
            wall_s,
            abandoned_turns: 0,
        }
    }

    #[test]
    fn mode_figures_count_successes_errors_tokens_and_rates() {
        let c1 = Level::Concurrency(1);
        let samples = [
            sample("split", c1, 0, 1, 10.0, None),
            sample("split", c1, 0, 2, 20.0, None),
            sample("split", c1, 1, 1, 30.0, Some("OVERLOADED")),
        ];
        let refs: Vec<&Sample> = samples.iter().collect();
        let runs = [run("split", c1, 0, 1.0), run("split", c1, 1, 1.0)];
        let run_refs: Vec<&LevelRun> = runs.iter().collect();
        let m = ModeReport::from_samples("split", "http://x", &refs, &run_refs);
        assert_eq!((m.attempted, m.requests, m.errors), (3, 2, 1));
        assert_eq!(m.errors_by_reason["OVERLOADED"], 1);
        assert_eq!(m.requests_per_s, 1.0);
        assert_eq!(m.tokens_per_s, 4.0);
        assert!((m.cached_token_ratio - 0.4).abs() < 1e-12);
        assert_eq!(m.e2e_ms.unwrap().p50, 10.0);
        assert_eq!(m.itl_ms.unwrap().count, 4);
        assert_eq!(m.by_turn.len(), 2);
        assert_eq!(m.by_turn[1].cached_tokens_mean, 80.0);
        assert_eq!(m.by_round.len(), 2);
        assert_eq!(m.reuse["hit"], 1);
    }

    #[test]
    fn a_mode_without_successes_reports_null_latencies_not_zeros() {
        let samples = [sample(
            "layered",
            Level::Concurrency(1),
            0,
            1,
            5.0,
            Some("INTERNAL"),
        )];
        let refs: Vec<&Sample> = samples.iter().collect();
        let m = ModeReport::from_samples("layered", "", &refs, &[]);
        assert!(m.ttft_ms.is_none() && m.e2e_ms.is_none());
        let json = serde_json::to_value(&m).unwrap();
        assert!(json["ttft_ms"].is_null());
    }

    #[test]
    fn equal_p99_compares_throughput_within_the_baselines_tail_latency() {
        let mut modes = BTreeMap::new();
        let mk = |label: &str, levels: &[(usize, f64, f64)]| {
            let mut samples = Vec::new();
            let mut runs = Vec::new();
            for &(c, p99, rps) in levels {
                for i in 0..100 {
                    // Nearest rank: p99 of 100 values is the 99th, so the two largest carry it.
                    samples.push(sample(
                        label,
                        Level::Concurrency(c),
                        0,
                        1,
                        if i >= 98 { p99 } else { 1.0 },
                        None,
                    ));
                }
                runs.push(run(label, Level::Concurrency(c), 0, 100.0 / rps));
            }
            let refs: Vec<&Sample> = samples.iter().collect();
            let rr: Vec<&LevelRun> = runs.iter().collect();
            ModeReport::from_samples(label, "", &refs, &rr)
        };
        modes.insert(
            "layered".into(),
            mk("layered", &[(1, 50.0, 10.0), (4, 80.0, 20.0)]),
        );
        modes.insert(
            "split".into(),
            mk(
                "split",
                &[(1, 5.0, 100.0), (4, 60.0, 150.0), (16, 500.0, 160.0)],
            ),
        );
        let c = compare_modes(&modes);
        let e = c.equal_p99.unwrap();
        assert_eq!(e.bound_ms, 80.0);
        assert_eq!(e.baseline_requests_per_s, 20.0);
        assert_eq!(e.requests_per_s["split"], Some(150.0));
        assert_eq!(e.ratio["split"], Some(7.5));
        assert!(!e.at_highest_level["split"]);
        // Overall: split 300 requests in 1 + 2/3 + 5/8 s; layered 200 in 10 + 5 s.
        let expected = (300.0 / (1.0 + 2.0 / 3.0 + 0.625)) / (200.0 / 15.0);
        assert!((c.ratios["split_over_layered_requests_per_s"] - expected).abs() < 1e-9);
        assert!(
            !c.ratios
                .contains_key("collapsed_over_layered_requests_per_s")
        );
    }
}
