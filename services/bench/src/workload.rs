//! What the load generator sends: the workload kind (multi-turn chat, single-shot prompts,
//! staged load), its sizes, the load levels (closed-loop concurrency or open-loop arrival
//! rates) and the prompt text.
//!
//! Everything here comes from the command line, so every parser returns a typed
//! [`WorkloadError`] instead of panicking, and every count is bounded by a named limit.

use std::{fmt, str::FromStr, time::Duration};

/// Largest count accepted for conversations, turns, requests, concurrency or a stage target:
/// far above what one machine can drive (the seed system's 2,100 QPS for a minute is 126,000
/// requests), low enough that a typo cannot make the generator allocate gigabytes of samples.
pub const MAX_COUNT: usize = 1_000_000;

/// Largest user turn in tokens: the largest context window of the built-in models
/// (`dummy:1b` and `dummy:8b`: 8,192 tokens).
pub const MAX_NEW_TOKENS: usize = 8_192;

/// Largest open-loop arrival rate, per second: 50× the seed system's claimed 2,100 QPS; above
/// it the tokio timer (1 ms resolution) could not space arrivals anyway.
pub const MAX_RATE_PER_S: f64 = 100_000.0;

/// Longest stage of a staged workload: one day is far beyond any benchmark run.
pub const MAX_STAGE: Duration = Duration::from_secs(86_400);

/// Most load levels (concurrencies or rates) in one run: each is a full pass of the workload
/// per mode and round, so more than this is a mistake rather than a plan.
pub const MAX_LEVELS: usize = 64;

/// Most stages of a staged workload (k6 scripts rarely have more than a handful).
pub const MAX_STAGES: usize = 64;

/// A malformed workload description.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WorkloadError {
    /// The workload kind is not one of `multi-turn`, `single-shot`, `staged`.
    #[error("unknown workload kind {0:?} (expected multi-turn, single-shot or staged)")]
    UnknownKind(String),
    /// The arrival process is not one of `poisson`, `fixed`.
    #[error("unknown arrival process {0:?} (expected poisson or fixed)")]
    UnknownArrival(String),
    /// A number could not be parsed.
    #[error("{what}: {text:?} is not a valid number")]
    BadNumber {
        /// Which value.
        what: &'static str,
        /// The text given.
        text: String,
    },
    /// A number is outside its allowed range.
    #[error("{what}: {value} is out of range ({min}..={max})")]
    OutOfRange {
        /// Which value.
        what: &'static str,
        /// The value given.
        value: f64,
        /// Smallest allowed value.
        min: f64,
        /// Largest allowed value.
        max: f64,
    },
    /// A duration is not `<number><unit>` with unit `ms`, `s`, `m` or `h`.
    #[error("{0:?} is not a duration (e.g. 500ms, 30s, 2m, 1h)")]
    BadDuration(String),
    /// A stage is not `DURATION:TARGET`.
    #[error("stage {0:?} is not DURATION:TARGET (e.g. 30s:16)")]
    BadStage(String),
    /// A list is empty or too long.
    #[error("{what}: {len} entries (expected 1..={max})")]
    BadListLength {
        /// Which list.
        what: &'static str,
        /// Its length.
        len: usize,
        /// Most entries allowed.
        max: usize,
    },
    /// Options that contradict each other.
    #[error("{0}")]
    Conflict(String),
}

/// The shape of the traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Conversations of several turns; each turn sends the whole transcript (or the delta)
    /// with the conversation's context handle, so the engine can reuse its slot.
    MultiTurn,
    /// Independent one-message prompts without a handle.
    SingleShot,
    /// Closed-loop virtual users ramping between targets over stages (k6 `ramping-vus`);
    /// each user runs multi-turn conversations back to back.
    Staged,
}

impl WorkloadKind {
    /// The command-line name.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::MultiTurn => "multi-turn",
            WorkloadKind::SingleShot => "single-shot",
            WorkloadKind::Staged => "staged",
        }
    }
}

impl fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for WorkloadKind {
    type Err = WorkloadError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "multi-turn" | "multiturn" | "chat" => Ok(WorkloadKind::MultiTurn),
            "single-shot" | "singleshot" | "single" => Ok(WorkloadKind::SingleShot),
            "staged" | "stages" => Ok(WorkloadKind::Staged),
            other => Err(WorkloadError::UnknownKind(other.to_owned())),
        }
    }
}

/// How open-loop arrivals are spaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ArrivalProcess {
    /// Exponentially distributed gaps (a Poisson process): bursts happen, as in real traffic.
    Poisson,
    /// Evenly spaced arrivals.
    Fixed,
}

impl FromStr for ArrivalProcess {
    type Err = WorkloadError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "poisson" => Ok(ArrivalProcess::Poisson),
            "fixed" | "constant" => Ok(ArrivalProcess::Fixed),
            other => Err(WorkloadError::UnknownArrival(other.to_owned())),
        }
    }
}

/// One load level of a run.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// Closed loop: this many workers, each starting its next unit (conversation or request)
    /// when the previous one finished.
    Concurrency(usize),
    /// Open loop: units (conversations or requests) arrive at this rate per second whatever
    /// the server does, so queueing shows in the latencies.
    Rate(f64),
    /// The stages of a staged workload.
    Staged,
}

impl Level {
    /// Short label for tables (`c=4`, `20/s`, `staged`).
    pub fn label(&self) -> String {
        match self {
            Level::Concurrency(c) => format!("c={c}"),
            Level::Rate(r) => format!("{r}/s"),
            Level::Staged => "staged".to_owned(),
        }
    }

    /// The x value of the throughput chart: concurrency or offered rate.
    pub fn x(&self) -> f64 {
        match self {
            Level::Concurrency(c) => *c as f64,
            Level::Rate(r) => *r,
            Level::Staged => 0.0,
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// A stage of a staged workload: ramp linearly from the previous target to `target` virtual
/// users over `duration` (the first stage ramps from 0), as in k6.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Stage {
    /// How long the stage lasts.
    #[serde(with = "duration_s")]
    pub duration: Duration,
    /// Virtual users at the end of the stage.
    pub target: usize,
}

impl FromStr for Stage {
    type Err = WorkloadError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (d, t) = s
            .trim()
            .split_once(':')
            .ok_or_else(|| WorkloadError::BadStage(s.to_owned()))?;
        let duration = parse_duration(d)?;
        let target = parse_count("stage target", t, 0)?;
        Ok(Stage { duration, target })
    }
}

/// Parses a list of stages: `30s:8,1m:8,10s:32,30s:0`.
pub fn parse_stages(s: &str) -> Result<Vec<Stage>, WorkloadError> {
    let stages = s
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(Stage::from_str)
        .collect::<Result<Vec<_>, _>>()?;
    check_len("stages", stages.len(), MAX_STAGES)?;
    Ok(stages)
}

/// Parses `500ms`, `30s`, `2m`, `1h` (a bare number is seconds), at most [`MAX_STAGE`].
pub fn parse_duration(s: &str) -> Result<Duration, WorkloadError> {
    let s = s.trim();
    let bad = || WorkloadError::BadDuration(s.to_owned());
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num.parse().map_err(|_| bad())?;
    let scale = match unit {
        "ms" => 1e-3,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(bad()),
    };
    let secs = value * scale;
    if !secs.is_finite() || secs < 0.0 {
        return Err(bad());
    }
    if secs > MAX_STAGE.as_secs_f64() {
        return Err(WorkloadError::OutOfRange {
            what: "duration (s)",
            value: secs,
            min: 0.0,
            max: MAX_STAGE.as_secs_f64(),
        });
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Parses a count in `min..=MAX_COUNT`.
pub fn parse_count(what: &'static str, s: &str, min: usize) -> Result<usize, WorkloadError> {
    let v: usize = s.trim().parse().map_err(|_| WorkloadError::BadNumber {
        what,
        text: s.to_owned(),
    })?;
    check_range(what, v, min, MAX_COUNT)?;
    Ok(v)
}

/// Parses a comma-separated list of concurrencies (each ≥ 1).
pub fn parse_concurrency_list(s: &str) -> Result<Vec<usize>, WorkloadError> {
    let v = s
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| parse_count("concurrency", p, 1))
        .collect::<Result<Vec<_>, _>>()?;
    check_len("concurrency", v.len(), MAX_LEVELS)?;
    Ok(v)
}

/// Parses a comma-separated list of arrival rates per second (each in (0, MAX_RATE_PER_S]).
pub fn parse_rate_list(s: &str) -> Result<Vec<f64>, WorkloadError> {
    let v = s
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let r: f64 = p.trim().parse().map_err(|_| WorkloadError::BadNumber {
                what: "rate",
                text: p.to_owned(),
            })?;
            if !(r > 0.0 && r <= MAX_RATE_PER_S) {
                return Err(WorkloadError::OutOfRange {
                    what: "rate",
                    value: r,
                    min: 0.0,
                    max: MAX_RATE_PER_S,
                });
            }
            Ok(r)
        })
        .collect::<Result<Vec<_>, _>>()?;
    check_len("rate", v.len(), MAX_LEVELS)?;
    Ok(v)
}

fn check_range(what: &'static str, v: usize, min: usize, max: usize) -> Result<(), WorkloadError> {
    if v < min || v > max {
        return Err(WorkloadError::OutOfRange {
            what,
            value: v as f64,
            min: min as f64,
            max: max as f64,
        });
    }
    Ok(())
}

fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), WorkloadError> {
    if len == 0 || len > max {
        return Err(WorkloadError::BadListLength { what, len, max });
    }
    Ok(())
}

/// Default tokens of each user turn.
pub const DEFAULT_NEW_TOKENS: usize = 64;
/// Default tokens generated per turn.
pub const DEFAULT_MAX_TOKENS: u32 = 16;
/// How long one request may take before the generator gives up on it (reported as error
/// `CLIENT_TIMEOUT`): generous, because a 2,000-token prefill of `dummy:small` on a loaded
/// 2-core machine takes tens of seconds.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// A complete workload: what every mode receives, identically.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Workload {
    /// The traffic shape.
    pub kind: WorkloadKind,
    /// Multi-turn: conversations per level; single-shot: requests per level; staged: unused
    /// (virtual users run until the last stage ends).
    pub conversations: usize,
    /// User turns per conversation (1 for single-shot).
    pub turns: usize,
    /// Tokens of each user turn (ASCII bytes; exact for byte-level tokenizers).
    pub new_tokens: usize,
    /// Tokens generated per turn (`max_tokens`; a model may stop earlier at end-of-sequence).
    pub max_tokens: u32,
    /// The load levels, run one after the other.
    pub levels: Vec<Level>,
    /// Spacing of open-loop arrivals.
    pub arrival: ArrivalProcess,
    /// Stages of a staged workload.
    pub stages: Vec<Stage>,
    /// Send only the new messages (the engine's slot supplies the history).
    pub delta: bool,
    /// Seed of prompt texts, sampling and arrival times: same seed, same requests.
    pub seed: u64,
    /// Per-request time limit.
    #[serde(with = "duration_s")]
    pub request_timeout: Duration,
}

impl Workload {
    /// A closed-loop multi-turn workload at concurrency 1.
    pub fn multi_turn(conversations: usize, turns: usize) -> Self {
        Self {
            kind: WorkloadKind::MultiTurn,
            conversations,
            turns,
            new_tokens: DEFAULT_NEW_TOKENS,
            max_tokens: DEFAULT_MAX_TOKENS,
            levels: vec![Level::Concurrency(1)],
            arrival: ArrivalProcess::Poisson,
            stages: Vec::new(),
            delta: false,
            seed: 0,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// Checks sizes and consistency.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        check_range("new tokens", self.new_tokens, 1, MAX_NEW_TOKENS)?;
        check_range("max tokens", self.max_tokens as usize, 1, MAX_NEW_TOKENS)?;
        check_range("turns", self.turns, 1, MAX_COUNT)?;
        check_len("levels", self.levels.len(), MAX_LEVELS)?;
        match self.kind {
            WorkloadKind::Staged => {
                check_len("stages", self.stages.len(), MAX_STAGES)?;
                if self.stages.iter().all(|s| s.target == 0) {
                    return Err(WorkloadError::Conflict(
                        "staged workload: every stage targets 0 users".into(),
                    ));
                }
                if self.levels != [Level::Staged] {
                    return Err(WorkloadError::Conflict(
                        "staged workload: levels come from the stages".into(),
                    ));
                }
            }
            WorkloadKind::MultiTurn | WorkloadKind::SingleShot => {
                check_range("conversations", self.conversations, 1, MAX_COUNT)?;
                if self.levels.contains(&Level::Staged) {
                    return Err(WorkloadError::Conflict(
                        "stages need --workload staged".into(),
                    ));
                }
                if self.kind == WorkloadKind::SingleShot && self.turns != 1 {
                    return Err(WorkloadError::Conflict(
                        "single-shot prompts have one turn".into(),
                    ));
                }
            }
        }
        for l in &self.levels {
            match *l {
                Level::Concurrency(c) => check_range("concurrency", c, 1, MAX_COUNT)?,
                Level::Rate(r) if !(r > 0.0 && r <= MAX_RATE_PER_S) => {
                    return Err(WorkloadError::OutOfRange {
                        what: "rate",
                        value: r,
                        min: 0.0,
                        max: MAX_RATE_PER_S,
                    });
                }
                Level::Rate(_) | Level::Staged => {}
            }
        }
        Ok(())
    }

    /// Requests one level sends when every turn is attempted (`None` for staged load, whose
    /// count depends on the server's speed).
    pub fn requests_per_level(&self) -> Option<u64> {
        match self.kind {
            WorkloadKind::Staged => None,
            _ => Some(self.conversations as u64 * self.turns as u64),
        }
    }

    /// Total duration of the stages.
    pub fn staged_duration(&self) -> Duration {
        self.stages.iter().map(|s| s.duration).sum()
    }

    /// Target virtual users `at` into a staged run (linear ramps; 0 after the last stage).
    pub fn staged_target(&self, at: Duration) -> usize {
        let mut from = 0usize;
        let mut start = Duration::ZERO;
        for s in &self.stages {
            let end = start + s.duration;
            if at < end {
                let frac = if s.duration.is_zero() {
                    1.0
                } else {
                    (at - start).as_secs_f64() / s.duration.as_secs_f64()
                };
                let v = from as f64 + (s.target as f64 - from as f64) * frac;
                return v.round() as usize;
            }
            from = s.target;
            start = end;
        }
        0
    }

    /// Most virtual users any stage asks for.
    pub fn staged_peak(&self) -> usize {
        self.stages.iter().map(|s| s.target).max().unwrap_or(0)
    }

    /// One-line description for reports.
    pub fn describe(&self) -> String {
        let levels: Vec<String> = self.levels.iter().map(Level::label).collect();
        match self.kind {
            WorkloadKind::MultiTurn => format!(
                "multi-turn: {} conversations × {} turns, {} new tokens and {} generated tokens per turn, {}{}, levels {}",
                self.conversations,
                self.turns,
                self.new_tokens,
                self.max_tokens,
                if self.delta {
                    "delta requests"
                } else {
                    "full transcripts"
                },
                self.arrival_note(),
                levels.join(" ")
            ),
            WorkloadKind::SingleShot => format!(
                "single-shot: {} prompts of {} tokens, {} generated tokens each{}, levels {}",
                self.conversations,
                self.new_tokens,
                self.max_tokens,
                self.arrival_note(),
                levels.join(" ")
            ),
            WorkloadKind::Staged => {
                let st: Vec<String> = self
                    .stages
                    .iter()
                    .map(|s| format!("{}s:{}", s.duration.as_secs_f64(), s.target))
                    .collect();
                format!(
                    "staged: virtual users over stages {} running {}-turn conversations, {} new and {} generated tokens per turn",
                    st.join(","),
                    self.turns,
                    self.new_tokens,
                    self.max_tokens
                )
            }
        }
    }

    fn arrival_note(&self) -> String {
        if self.levels.iter().any(|l| matches!(l, Level::Rate(_))) {
            format!(", open loop ({:?} arrivals)", self.arrival).to_lowercase()
        } else {
            ", closed loop".to_owned()
        }
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny, seedable generator. Prompt texts and arrival
/// times only need to be reproducible and well spread, not cryptographic.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Arrival offsets (from the level's start) of `n` open-loop arrivals at `rate` per second.
pub fn arrival_offsets(n: usize, rate: f64, process: ArrivalProcess, seed: u64) -> Vec<Duration> {
    let mut rng = SplitMix64::new(seed ^ 0xA11_1BA1);
    let mut t = 0.0f64;
    (0..n)
        .map(|_| {
            let at = t;
            t += match process {
                ArrivalProcess::Fixed => 1.0 / rate,
                // Inverse transform sampling of Exp(rate); 1 - u is in (0, 1], so ln is finite.
                ArrivalProcess::Poisson => -(1.0 - rng.next_f64()).ln() / rate,
            };
            Duration::from_secs_f64(at)
        })
        .collect()
}

/// Words the prompt text is made of: lower-case ASCII so that byte-level tokenizers see
/// exactly one token per byte, and readable enough for log excerpts.
const WORDS: [&str; 16] = [
    "the", "little", "robot", "counted", "stars", "over", "a", "quiet", "garden", "and", "found",
    "one", "falling", "light", "near", "home",
];

/// The user text of `turn` of `conversation`: exactly `bytes` ASCII bytes (words separated by
/// single spaces), a pure function of its arguments so every mode receives the same prompts.
pub fn prompt_text(seed: u64, conversation: u64, turn: u64, bytes: usize) -> String {
    let mut rng =
        SplitMix64::new(seed ^ conversation.wrapping_mul(0x9E37_79B9) ^ turn.rotate_left(40));
    let mut s = String::with_capacity(bytes + 16);
    // A per-conversation tag up front keeps conversations distinct even for short turns.
    s.push_str(&format!("c{conversation}t{turn} "));
    while s.len() < bytes {
        let w = WORDS[(rng.next_u64() % WORDS.len() as u64) as usize];
        s.push_str(w);
        s.push(' ');
    }
    s.truncate(bytes);
    // Never end on a space: some tokenizers treat a trailing space specially.
    if s.ends_with(' ') {
        s.pop();
        s.push('.');
    }
    s
}

/// Serde helper: durations as fractional seconds.
mod duration_s {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn prompt_text_has_exactly_the_requested_ascii_length() {
        for n in [1, 2, 7, 64, 200, 1000] {
            let t = prompt_text(1, 3, 2, n);
            assert_eq!(t.len(), n, "{t:?}");
            assert!(t.is_ascii());
            assert!(!t.ends_with(' '));
        }
    }

    #[test]
    fn prompt_text_differs_between_conversations_and_turns_but_not_between_calls() {
        assert_eq!(prompt_text(0, 1, 1, 100), prompt_text(0, 1, 1, 100));
        assert_ne!(prompt_text(0, 1, 1, 100), prompt_text(0, 2, 1, 100));
        assert_ne!(prompt_text(0, 1, 1, 100), prompt_text(0, 1, 2, 100));
    }

    #[test]
    fn durations_parse_with_units_and_reject_garbage() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(matches!(
            parse_duration("5 parsecs"),
            Err(WorkloadError::BadDuration(_))
        ));
        assert!(matches!(
            parse_duration(""),
            Err(WorkloadError::BadDuration(_))
        ));
        assert!(matches!(
            parse_duration("2d"),
            Err(WorkloadError::BadDuration(_))
        ));
        assert!(matches!(
            parse_duration("1000h"),
            Err(WorkloadError::OutOfRange { .. })
        ));
    }

    #[test]
    fn stages_ramp_linearly_like_k6() {
        let mut w = Workload::multi_turn(1, 1);
        w.kind = WorkloadKind::Staged;
        w.levels = vec![Level::Staged];
        w.stages = parse_stages("10s:10,10s:10,5s:40").unwrap();
        assert_eq!(w.staged_target(Duration::ZERO), 0);
        assert_eq!(w.staged_target(Duration::from_secs(5)), 5);
        assert_eq!(w.staged_target(Duration::from_secs(15)), 10);
        assert_eq!(w.staged_target(Duration::from_millis(22_500)), 25);
        assert_eq!(w.staged_target(Duration::from_secs(30)), 0);
        assert_eq!(w.staged_peak(), 40);
        assert_eq!(w.staged_duration(), Duration::from_secs(25));
        w.validate().unwrap();
    }

    #[test]
    fn bad_stages_and_lists_get_typed_errors() {
        assert!(matches!(
            parse_stages("30s"),
            Err(WorkloadError::BadStage(_))
        ));
        assert!(matches!(
            parse_stages("30s:x"),
            Err(WorkloadError::BadNumber { .. })
        ));
        assert!(matches!(
            parse_stages(""),
            Err(WorkloadError::BadListLength { .. })
        ));
        assert!(matches!(
            parse_concurrency_list("1,0"),
            Err(WorkloadError::OutOfRange { .. })
        ));
        assert!(matches!(parse_concurrency_list("1,,4"), Ok(v) if v == vec![1, 4]));
        assert!(matches!(
            parse_rate_list("-3"),
            Err(WorkloadError::OutOfRange { .. })
        ));
        assert!(matches!(
            parse_rate_list("NaN"),
            Err(WorkloadError::OutOfRange { .. })
        ));
        assert!(matches!(
            "multi".parse::<WorkloadKind>(),
            Err(WorkloadError::UnknownKind(_))
        ));
    }

    #[test]
    fn validation_rejects_contradictions() {
        let mut w = Workload::multi_turn(2, 3);
        w.validate().unwrap();
        w.kind = WorkloadKind::SingleShot;
        assert!(matches!(w.validate(), Err(WorkloadError::Conflict(_))));
        w.turns = 1;
        w.validate().unwrap();
        w.new_tokens = 0;
        assert!(matches!(
            w.validate(),
            Err(WorkloadError::OutOfRange { .. })
        ));
    }

    #[test]
    fn fixed_arrivals_are_evenly_spaced_and_poisson_ones_average_the_rate() {
        let fixed = arrival_offsets(5, 10.0, ArrivalProcess::Fixed, 1);
        assert_eq!(fixed[4], Duration::from_millis(400));
        let n = 20_000;
        let poisson = arrival_offsets(n, 100.0, ArrivalProcess::Poisson, 7);
        let mean_gap = poisson[n - 1].as_secs_f64() / (n - 1) as f64;
        assert!((mean_gap - 0.01).abs() < 0.0005, "mean gap {mean_gap}");
        assert!(poisson.windows(2).all(|w| w[0] <= w[1]));
    }

    proptest! {
        #[test]
        fn workload_parsers_never_panic(s in "\\PC{0,40}") {
            let _ = parse_stages(&s);
            let _ = parse_duration(&s);
            let _ = parse_concurrency_list(&s);
            let _ = parse_rate_list(&s);
            let _ = s.parse::<WorkloadKind>();
            let _ = s.parse::<ArrivalProcess>();
        }

        #[test]
        fn prompt_text_length_is_exact_for_any_size(n in 1usize..4096, c in any::<u64>(), t in any::<u64>()) {
            let text = prompt_text(9, c, t, n);
            prop_assert_eq!(text.len(), n);
            prop_assert!(text.is_ascii());
        }
    }
}
