//! The load generator: runs one level of a workload (closed loop, open loop or staged)
//! against one endpoint and returns a raw [`Sample`] per request.
//!
//! Closed loop: `c` workers each take the next conversation (or prompt) when their previous
//! one finished. Open loop: conversations (or prompts) start at scheduled arrival times
//! whatever the server does, and latencies count from the scheduled time, so a generator that
//! falls behind cannot hide queueing (no coordinated omission). Staged: virtual users are
//! switched on and off following the stages and run conversations back to back.
//!
//! A failed turn ends its conversation (the conversation is unchanged on error, and resending
//! a different next turn would measure something else); the turns it did not send are counted
//! as `abandoned_turns`.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use indicatif::ProgressBar;
use zerolayer_client::Client;
use zerolayer_proto::v1;

use crate::{
    chat::{Chat, ChatError, Reply, single_shot},
    sample::{CLIENT_TIMEOUT, Sample, SampleKey},
    workload::{Level, Workload, WorkloadKind, arrival_offsets, prompt_text},
};

/// How often an idle virtual user of a staged workload checks whether it is switched on:
/// small against stage lengths (seconds), large enough to cost nothing.
pub const STAGE_POLL: Duration = Duration::from_millis(20);

/// One level of the workload run against one endpoint.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LevelRun {
    /// Mode or endpoint label.
    pub mode: String,
    /// Round number (0-based).
    pub round: usize,
    /// The level.
    pub level: Level,
    /// Start since the beginning of the benchmark, in seconds.
    pub started_s: f64,
    /// Wall time from the level's start to its last response, in seconds.
    pub wall_s: f64,
    /// Turns not sent because an earlier turn of their conversation failed.
    pub abandoned_turns: u64,
}

/// Everything one level produced.
#[derive(Debug, Clone)]
pub struct LevelOutput {
    /// Its bookkeeping.
    pub run: LevelRun,
    /// One sample per request sent.
    pub samples: Vec<Sample>,
}

/// What every request of a level shares.
struct LevelContext {
    /// Mode or endpoint label.
    label: String,
    /// The connection.
    client: Client,
    /// The workload.
    workload: Arc<Workload>,
    /// The level.
    level: Level,
    /// Round number.
    round: usize,
    /// Added to conversation numbers so that rounds and levels never repeat a prompt.
    conversation_base: u64,
    /// Beginning of the whole benchmark (sample start times count from here).
    origin: Instant,
    /// Requests in flight now.
    in_flight: AtomicUsize,
    /// Sampling of every request.
    sampling: v1::SamplingParams,
    /// Progress (one tick per request sent or abandoned).
    progress: ProgressBar,
}

impl LevelContext {
    fn key(&self, conversation: u64, turn: u32, start: Duration, in_flight: usize) -> SampleKey {
        SampleKey {
            mode: self.label.clone(),
            workload: self.workload.kind.as_str(),
            round: self.round,
            level: self.level,
            in_flight,
            conversation,
            turn,
            start,
        }
    }

    /// Sends one request through `send`, bounded by the request timeout, and records it.
    /// `scheduled` is when it should have started (open loop) — the dispatch delay counts.
    async fn timed<F>(
        &self,
        conversation: u64,
        turn: u32,
        scheduled: Option<Instant>,
        send: F,
    ) -> (Sample, bool)
    where
        F: Future<Output = Result<Reply, ChatError>>,
    {
        let now = Instant::now();
        let scheduled = scheduled.unwrap_or(now).min(now);
        let delay = now - scheduled;
        let start = scheduled.saturating_duration_since(self.origin);
        let in_flight = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        let result = tokio::time::timeout(self.workload.request_timeout, send).await;
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.progress.inc(1);
        let key = self.key(conversation, turn, start, in_flight);
        match result {
            Ok(Ok(reply)) => (Sample::ok(key, &reply, delay), true),
            Ok(Err(e)) => (
                Sample::failed(key, now.elapsed() + delay, e.reason(), &e.message()),
                false,
            ),
            Err(_) => (
                Sample::failed(
                    key,
                    now.elapsed() + delay,
                    CLIENT_TIMEOUT,
                    &format!("no reply within {:?}", self.workload.request_timeout),
                ),
                false,
            ),
        }
    }

    /// Runs unit `unit` (a conversation or a prompt); returns its samples and abandoned turns.
    async fn unit(&self, unit: u64, scheduled: Option<Instant>, out: &mut Vec<Sample>) -> u64 {
        let conversation = self.conversation_base + unit;
        let w = &self.workload;
        if w.kind == WorkloadKind::SingleShot {
            let text = prompt_text(w.seed, conversation, 1, w.new_tokens);
            let (s, _) = self
                .timed(
                    conversation,
                    1,
                    scheduled,
                    single_shot(&self.client, text, &self.sampling),
                )
                .await;
            out.push(s);
            return 0;
        }
        let mut chat = Chat::new(self.client.clone(), self.sampling.clone(), w.delta);
        let mut scheduled = scheduled;
        for turn in 1..=w.turns as u32 {
            let text = prompt_text(w.seed, conversation, turn as u64, w.new_tokens);
            let (s, ok) = self
                .timed(conversation, turn, scheduled.take(), chat.turn(text))
                .await;
            out.push(s);
            if !ok {
                let left = w.turns as u64 - turn as u64;
                self.progress.inc(left);
                return left;
            }
        }
        0
    }
}

/// Sampling of every request: greedy with a fixed seed (deterministic replies, the same work
/// for every mode) and the workload's `max_tokens`.
pub fn sampling(workload: &Workload) -> v1::SamplingParams {
    v1::SamplingParams {
        max_tokens: Some(workload.max_tokens),
        temperature: None,
        top_k: 0,
        top_p: None,
        seed: Some(workload.seed),
        stop: Vec::new(),
    }
}

/// Where one level runs.
#[derive(Debug, Clone)]
pub struct LevelSpec {
    /// Mode or endpoint label.
    pub label: String,
    /// The level.
    pub level: Level,
    /// Round number.
    pub round: usize,
    /// Added to conversation numbers (distinct per round and level, equal across modes so
    /// that every mode receives the same prompts).
    pub conversation_base: u64,
    /// Beginning of the benchmark.
    pub origin: Instant,
}

/// Runs one level of `workload` against `client`.
pub async fn run_level(
    client: &Client,
    workload: &Arc<Workload>,
    spec: LevelSpec,
    progress: &ProgressBar,
) -> anyhow::Result<LevelOutput> {
    let ctx = Arc::new(LevelContext {
        label: spec.label.clone(),
        client: client.clone(),
        workload: workload.clone(),
        level: spec.level,
        round: spec.round,
        conversation_base: spec.conversation_base,
        origin: spec.origin,
        in_flight: AtomicUsize::new(0),
        sampling: sampling(workload),
        progress: progress.clone(),
    });
    let started = Instant::now();
    let units = workload.conversations as u64;
    let mut tasks = Vec::new();
    match spec.level {
        Level::Concurrency(c) => {
            let next = Arc::new(AtomicU64::new(0));
            for _ in 0..c.min(workload.conversations) {
                let (ctx, next) = (ctx.clone(), next.clone());
                tasks.push(tokio::spawn(async move {
                    let mut samples = Vec::new();
                    let mut abandoned = 0;
                    loop {
                        let u = next.fetch_add(1, Ordering::Relaxed);
                        if u >= units {
                            break;
                        }
                        abandoned += ctx.unit(u, None, &mut samples).await;
                    }
                    (samples, abandoned)
                }));
            }
        }
        Level::Rate(rate) => {
            let seed = workload.seed ^ spec.conversation_base.rotate_left(17);
            for (u, offset) in arrival_offsets(workload.conversations, rate, workload.arrival, seed)
                .into_iter()
                .enumerate()
            {
                let at = started + offset;
                tokio::time::sleep_until(at.into()).await;
                let ctx = ctx.clone();
                tasks.push(tokio::spawn(async move {
                    let mut samples = Vec::new();
                    let abandoned = ctx.unit(u as u64, Some(at), &mut samples).await;
                    (samples, abandoned)
                }));
            }
        }
        Level::Staged => {
            let next = Arc::new(AtomicU64::new(0));
            for vu in 0..workload.staged_peak() {
                let (ctx, next) = (ctx.clone(), next.clone());
                tasks.push(tokio::spawn(async move {
                    virtual_user(&ctx, vu, started, &next).await
                }));
            }
        }
    }
    let mut samples = Vec::new();
    let mut abandoned_turns = 0;
    for t in tasks {
        let (s, a) = t.await.context("a load-generator task panicked")?;
        samples.extend(s);
        abandoned_turns += a;
    }
    let run = LevelRun {
        mode: spec.label,
        round: spec.round,
        level: spec.level,
        started_s: started.saturating_duration_since(spec.origin).as_secs_f64(),
        wall_s: started.elapsed().as_secs_f64(),
        abandoned_turns,
    };
    Ok(LevelOutput { run, samples })
}

/// Virtual user `vu` of a staged workload: runs conversations turn by turn while the stages
/// switch it on (users `0..target(t)` are on), keeps its conversation while switched off, and
/// stops after the last stage (a turn in progress finishes).
async fn virtual_user(
    ctx: &LevelContext,
    vu: usize,
    started: Instant,
    next: &AtomicU64,
) -> (Vec<Sample>, u64) {
    let w = &ctx.workload;
    let total = w.staged_duration();
    let mut samples = Vec::new();
    let mut chat: Option<(Chat, u64, u32)> = None;
    loop {
        let now = started.elapsed();
        if now >= total {
            break;
        }
        if vu >= w.staged_target(now) {
            tokio::time::sleep(STAGE_POLL).await;
            continue;
        }
        let (mut c, conv, turn) = match chat.take() {
            Some((c, conv, turn)) if turn as usize <= w.turns => (c, conv, turn),
            _ => {
                let conv = ctx.conversation_base + next.fetch_add(1, Ordering::Relaxed);
                (
                    Chat::new(ctx.client.clone(), ctx.sampling.clone(), w.delta),
                    conv,
                    1,
                )
            }
        };
        let text = prompt_text(w.seed, conv, turn as u64, w.new_tokens);
        let (s, ok) = ctx.timed(conv, turn, None, c.turn(text)).await;
        samples.push(s);
        if ok {
            chat = Some((c, conv, turn + 1));
        }
    }
    (samples, 0)
}
