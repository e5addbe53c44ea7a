//! The scheduler: one OS thread that owns the backend, the [`KvCache`] and every running
//! sequence; everything else talks to it through [`Command`]s (TGI's actor shape).
//!
//! # A step
//! 1. Take commands (block on the channel when there is nothing to do: no busy loop).
//! 2. Drop cancelled requests (stream receiver dropped): their resources are freed here.
//! 3. Admit queued requests in FIFO order while fewer than `max_batch` run: authenticate the
//!    handle (fast path first), resolve the slot and plan the prompt (reuse, branch, preflight),
//!    reserve every block the request can need (prompt + `max_tokens`), evicting idle slots
//!    first; a request whose blocks are not free waits at the head of the queue while others
//!    run, and fails with `KV_CACHE_OVERFLOW` only when nothing runs that could free blocks.
//! 4. Run one forward step: every decoding sequence contributes one token, prefilling sequences
//!    contribute chunks until `step_token_budget`; sample one token per sequence that reached
//!    the end of its prompt, with `sample_uniform(seed, n)` for its `n`-th token, so batching
//!    never changes results (the CPU kernels are batch-invariant bit for bit).
//! 5. Stream the tokens; finish sequences (stop token, `max_tokens`, stop sequence, safety),
//!    store the conversation in its slot and renew its handle.
//!
//! # Slot contents after a request (what the next turn can reuse)
//! - Finished normally: the prompt plus the generated tokens whose text was delivered (a stop
//!   token and tokens of a stop sequence or forbidden string are not part of the reply). After
//!   `max_tokens` the last token has not been through the model yet: it is fed in one more step
//!   (without sampling) before the final event, so the slot holds exactly prompt + reply and
//!   turn k+1's cached tokens equal turn k's prompt + generated tokens.
//! - Cancelled (stream dropped) or failed: the slot keeps only the prefix that was reused from
//!   it (the positions this request did not overwrite); nothing the request computed is kept
//!   (no handle covers it). A failed backend step removes the slot altogether.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use tokio::sync::{mpsc as tmpsc, oneshot};
use zerolayer_handle::{Claims, KeyRing, PromptHash, TenantTag, Verified};
use zerolayer_model::{
    Backend, SampleInput, SampleOutcome, SamplingParams, SeqChunk, Tokenizer, sample_uniform,
};

use crate::api::{
    ContextState, Event, FinalInfo, FinishReason, ProbeReport, ReuseOutcome, Role, Timings,
    Truncation, Usage, ValidateReport,
};
use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::kv::{
    ConversationUpdate, KvCache, KvError, MAX_TRACKED_MESSAGES, SlotId, SlotState, UNKNOWN_MESSAGES,
};
use crate::metrics::{EngineMetrics, add, set};
use crate::request::{MessageHasher, Prepared, unix_now};
use crate::safety::TenantSafety;
use crate::text::{OutputText, TextMatch};

/// Sender half of a generation stream.
pub(crate) type EventSender = tmpsc::UnboundedSender<Result<Event, EngineError>>;
/// Reply channel of a probe.
pub(crate) type ProbeReply = oneshot::Sender<Result<ProbeReport, EngineError>>;
/// Reply channel of a validation.
pub(crate) type ValidateReply = oneshot::Sender<Result<ValidateReport, EngineError>>;

/// What callers send to the scheduler.
pub(crate) enum Command {
    /// Queue a request (or a probe).
    Generate(Box<Job>),
    /// Dry-run admission of a request and reply with the plan's numbers.
    Validate(Box<Prepared>, ValidateReply),
    /// Stop accepting; finish what is queued and running, then exit.
    Shutdown,
}

/// Where a request's results go.
pub(crate) enum Output {
    /// A generation stream.
    Stream(EventSender),
    /// A probe's single reply.
    Probe(Option<ProbeReply>),
}

impl Output {
    /// Whether the receiver is gone (the request is cancelled).
    fn is_closed(&self) -> bool {
        match self {
            Output::Stream(tx) => tx.is_closed(),
            Output::Probe(Some(r)) => r.is_closed(),
            Output::Probe(None) => true,
        }
    }

    /// Sends an error (ignored if the receiver is gone).
    pub(crate) fn fail(&mut self, e: EngineError) {
        match self {
            Output::Stream(tx) => {
                let _ = tx.send(Err(e));
            }
            Output::Probe(r) => {
                if let Some(r) = r.take() {
                    let _ = r.send(Err(e));
                }
            }
        }
    }
}

/// A queued request.
pub(crate) struct Job {
    /// The prepared request.
    pub prep: Prepared,
    /// Result channel.
    pub out: Output,
    /// The authenticated handle (after the first admission attempt).
    pub verified: Option<Verified>,
    /// When the request first found its conversation busy.
    pub busy_since: Option<Instant>,
    /// A health probe: no slot, no handle, one token.
    pub probe: bool,
}

/// State shared between the engine handle and the scheduler.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// Requests submitted and not yet admitted or refused.
    pub queue_depth: AtomicUsize,
    /// `generate` accepts new requests.
    pub accepting: AtomicBool,
}

/// Where the prompt's KV goes.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// No slot: blocks are freed when the request ends (reuse disabled, probe).
    Throwaway,
    /// An existing idle slot, reused up to the plan's `cached` positions.
    Existing(SlotId),
    /// A new slot under `session_id` (0: a fresh random id).
    New(u64),
}

/// The admission plan of a request.
#[derive(Debug)]
struct Plan {
    /// Slot to use.
    target: Target,
    /// Epoch of the slot once admitted.
    epoch: u32,
    /// Conversation opening hash (the slot's and the handle's).
    prompt_hash: PromptHash,
    /// Prompt ids from position 0.
    prompt: Vec<u32>,
    /// `(hash, end)` of the prompt's messages, for the slot.
    tracked: Vec<(u64, u32)>,
    /// Messages in the prompt, or [`UNKNOWN_MESSAGES`].
    messages: u32,
    /// Positions left truncation keeps.
    keep_prefix: u32,
    /// Positions served from the slot.
    cached: usize,
    /// Prompt tokens dropped by left truncation.
    truncated: usize,
    /// Tokens to generate at most.
    max_tokens: usize,
    /// Cache outcome.
    reuse: ReuseOutcome,
}

/// Result of planning.
enum Planned {
    /// The conversation's slot is in use by another request.
    Busy,
    /// Ready to admit.
    Ready(Plan),
}

/// Result of an admission attempt.
enum Admission {
    /// Running.
    Admitted(Box<Sequence>),
    /// Stays queued (busy session); others may be admitted.
    Wait,
    /// Stays queued at the head (KV blocks); admission stops for this step.
    Defer,
    /// Refused; the error was sent.
    Done,
}

/// Where a running sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Prompt positions remain to be computed.
    Prefill,
    /// Generating: the last sampled token is fed next.
    Decode,
    /// Finished; the last kept token is fed (no sampling) so the slot holds it.
    Tail,
    /// Ready to be finalised.
    Done,
}

/// How a sequence ended.
#[derive(Debug, Clone, PartialEq)]
enum End {
    /// Normally.
    Finished(FinishReason),
    /// The receiver went away.
    Cancelled,
    /// Failed.
    Failed(EngineError),
}

/// A running request.
struct Sequence {
    /// Result channel.
    out: Output,
    /// Correlation id.
    request_id: String,
    /// Its slot, if any.
    slot: Option<SlotId>,
    /// Conversation id (0 without a slot).
    session_id: u64,
    /// The caller's tenant tag.
    tenant: TenantTag,
    /// Conversation opening hash.
    prompt_hash: PromptHash,
    /// Slot epoch.
    epoch: u32,
    /// Block table (positions `0..` in order), a preallocated buffer.
    table: Vec<u32>,
    /// Prompt ids from position 0.
    prompt: Vec<u32>,
    /// Tracked messages of the prompt.
    tracked: Vec<(u64, u32)>,
    /// Messages in the prompt, or unknown.
    messages: u32,
    /// Positions left truncation keeps.
    keep_prefix: u32,
    /// Positions with KV computed (and ids recorded in the pool).
    pos: usize,
    /// Positions served from the cache.
    cached: usize,
    /// Prompt tokens dropped by truncation.
    truncated: usize,
    /// Sampled tokens (a stop token excluded).
    generated: Vec<u32>,
    /// Raw decoded byte offset at the end of each generated token.
    byte_ends: Vec<usize>,
    /// Tokens to generate at most.
    max_tokens: usize,
    /// Sampling parameters.
    sampling: SamplingParams,
    /// Stop sequences.
    stop: Vec<String>,
    /// Tenant safety rules.
    safety: Option<Arc<TenantSafety>>,
    /// Tokens banned at the next sampling.
    banned: Vec<u32>,
    /// Output text with hold-back.
    text: OutputText,
    /// Where it is.
    phase: Phase,
    /// How it ended (set when `phase` becomes `Tail` or `Done`).
    end: Option<End>,
    /// Cache outcome.
    reuse: ReuseOutcome,
    /// A health probe.
    probe: bool,
    /// `generate` called.
    submitted: Instant,
    /// First included in a step.
    first_step: Option<Instant>,
    /// First token sampled.
    first_token: Option<Instant>,
    /// Last token sampled.
    last_token: Option<Instant>,
}

impl Sequence {
    /// Context numbers for events.
    fn context(&self, kv_offset: usize) -> ContextState {
        ContextState {
            tokens_consumed: (self.prompt.len() + self.generated.len()) as u32,
            kv_offset: kv_offset as u32,
            cached_prompt_tokens: self.cached as u32,
            prefilled_prompt_tokens: (self.prompt.len() - self.cached) as u32,
            generated_tokens: self.generated.len() as u32,
        }
    }

    /// Generated tokens whose text was entirely delivered.
    fn kept_tokens(&self) -> usize {
        let delivered = self.text.released_bytes();
        self.byte_ends
            .iter()
            .take_while(|&&e| e <= delivered)
            .count()
    }

    /// Ends the sequence: `Tail` if the slot must still take the last kept token, else `Done`.
    fn finish(&mut self, end: End) {
        if matches!(end, End::Finished(_)) && !self.probe {
            let flushed = self.text.flush();
            if !flushed.is_empty()
                && let Output::Stream(tx) = &self.out
            {
                let event = Event::Tokens {
                    text: flushed,
                    token_ids: Vec::new(),
                    context: self.context(self.pos),
                };
                let _ = tx.send(Ok(event));
            }
        }
        let needs_tail = matches!(end, End::Finished(_))
            && self.slot.is_some()
            && self.pos < self.prompt.len() + self.kept_tokens();
        self.end = Some(end);
        self.phase = if needs_tail { Phase::Tail } else { Phase::Done };
    }
}

/// Fixed prompt of [`crate::Engine::probe`].
pub(crate) const PROBE_PROMPT: &str = "Once upon a time";

/// The scheduler thread's state.
pub(crate) struct Scheduler {
    /// The model executor.
    backend: Box<dyn Backend>,
    /// The model tokenizer (decoding).
    tokenizer: Arc<Tokenizer>,
    /// Handle keys.
    keys: Arc<KeyRing>,
    /// Message identities (assistant replies).
    hasher: MessageHasher,
    /// Settings.
    config: EngineConfig,
    /// Model name for probe reports.
    model_name: String,
    /// Context window (positions).
    window: usize,
    /// Model parameters (cost estimates).
    n_params: u64,
    /// Slots and blocks.
    kv: KvCache,
    /// Metrics.
    metrics: Arc<EngineMetrics>,
    /// Shared counters and flags.
    shared: Arc<Shared>,
    /// Commands.
    rx: mpsc::Receiver<Command>,
    /// Admission queue.
    queue: VecDeque<Box<Job>>,
    /// Running sequences in admission order (prefill order).
    running: Vec<Sequence>,
    /// Free block-table buffers (`max_batch` of them, `blocks_for(window)` entries each).
    tables: Vec<Vec<u32>>,
    /// Shutdown requested or every engine handle dropped.
    draining: bool,
}

/// Everything [`Scheduler::new`] takes.
pub(crate) struct SchedulerParts {
    /// The backend.
    pub backend: Box<dyn Backend>,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Handle keys.
    pub keys: Arc<KeyRing>,
    /// Message hasher (same key as the request path).
    pub hasher: MessageHasher,
    /// Settings (validated).
    pub config: EngineConfig,
    /// Model name.
    pub model_name: String,
    /// Metrics.
    pub metrics: Arc<EngineMetrics>,
    /// Shared state.
    pub shared: Arc<Shared>,
    /// Command receiver.
    pub rx: mpsc::Receiver<Command>,
}

impl Scheduler {
    /// Allocates the slot map, the block tables and the queue.
    pub(crate) fn new(p: SchedulerParts) -> Self {
        let model = p.backend.config().clone();
        let kv_config = p.backend.kv_config();
        let kv = KvCache::new(p.config.slot_capacity, kv_config);
        let per_seq = kv.pool().blocks_for(model.max_seq_len) + 1;
        let tables = (0..p.config.max_batch)
            .map(|_| Vec::with_capacity(per_seq))
            .collect();
        let m = &p.metrics;
        set(&m.kv_blocks_total, kv_config.num_blocks as u64);
        set(&m.kv_block_size, kv_config.block_size as u64);
        set(&m.slots_capacity, p.config.slot_capacity as u64);
        m.healthy.store(true, Ordering::Relaxed);
        Self {
            window: model.max_seq_len,
            n_params: model.n_params(),
            queue: VecDeque::with_capacity(p.config.max_queue),
            running: Vec::with_capacity(p.config.max_batch),
            backend: p.backend,
            tokenizer: p.tokenizer,
            keys: p.keys,
            hasher: p.hasher,
            config: p.config,
            model_name: p.model_name,
            kv,
            metrics: p.metrics,
            shared: p.shared,
            rx: p.rx,
            tables,
            draining: false,
        }
    }

    /// The thread body: runs until shut down (or every engine handle is gone) and idle. A panic
    /// fails every stream with `INTERNAL`, marks the engine unhealthy, and the thread then only
    /// refuses commands until every engine handle is gone.
    pub(crate) fn run_thread(mut self) {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run()));
        self.metrics.healthy.store(false, Ordering::Relaxed);
        self.shared.accepting.store(false, Ordering::Relaxed);
        if result.is_err() {
            tracing::error!("scheduler panicked; failing every request and refusing new ones");
            let fail = |s: &mut Scheduler| {
                let err = || EngineError::Internal {
                    reason: "the scheduler thread panicked".into(),
                };
                for seq in &mut s.running {
                    seq.out.fail(err());
                    s.metrics.count_error(crate::api::ErrorReason::Internal);
                }
                s.running.clear();
                while let Some(mut job) = s.queue.pop_front() {
                    job.out.fail(err());
                    s.metrics.count_error(crate::api::ErrorReason::Internal);
                }
                s.shared.queue_depth.store(0, Ordering::Relaxed);
                set(&s.metrics.queue_depth, 0);
                set(&s.metrics.running, 0);
            };
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fail(&mut self)));
            while let Ok(cmd) = self.rx.recv() {
                let err = EngineError::Unavailable {
                    reason: "the scheduler failed",
                };
                match cmd {
                    Command::Generate(mut job) => {
                        self.shared.queue_depth.fetch_sub(1, Ordering::Relaxed);
                        job.out.fail(err);
                    }
                    Command::Validate(_, reply) => {
                        let _ = reply.send(Err(err));
                    }
                    Command::Shutdown => {}
                }
            }
        }
    }

    /// The scheduling loop.
    fn run(&mut self) {
        loop {
            if self.running.is_empty() && self.queue.is_empty() {
                if self.draining {
                    return;
                }
                // Nothing to do: block until a command arrives.
                match self.rx.recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(_) => self.draining = true,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        self.draining = true;
                        break;
                    }
                }
            }
            self.reap_cancelled();
            self.admit_queue();
            if self.running.iter().any(|s| s.phase != Phase::Done) {
                self.step();
            }
            self.finalize_done();
            self.update_gauges();
        }
    }

    /// Handles one command.
    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Generate(job) => self.queue.push_back(job),
            Command::Validate(prep, reply) => {
                if !reply.is_closed() {
                    let result = self.validate(*prep);
                    if let Err(e) = &result {
                        self.metrics.count_error(e.reason());
                    }
                    let _ = reply.send(result);
                }
            }
            Command::Shutdown => self.draining = true,
        }
    }

    /// Publishes gauges.
    fn update_gauges(&self) {
        let m = &self.metrics;
        set(&m.kv_blocks_used, self.kv.pool().used_blocks() as u64);
        let stats = self.kv.stats();
        set(&m.slots_live, stats.live as u64);
        set(&m.slot_evictions, stats.evictions);
        set(&m.running, self.running.len() as u64);
        set(
            &m.queue_depth,
            self.shared.queue_depth.load(Ordering::Relaxed) as u64,
        );
    }

    /// A job leaves the queue.
    fn dequeued(&self) {
        self.shared.queue_depth.fetch_sub(1, Ordering::Relaxed);
    }

    /// Ends running sequences whose receiver is gone (they are freed in `finalize_done`).
    fn reap_cancelled(&mut self) {
        for seq in &mut self.running {
            if seq.phase != Phase::Done && seq.out.is_closed() {
                seq.end = Some(End::Cancelled);
                seq.phase = Phase::Done;
            }
        }
    }

    /// Admits queued jobs in FIFO order.
    fn admit_queue(&mut self) {
        let mut kept: VecDeque<Box<Job>> = VecDeque::new();
        let mut stop = false;
        while let Some(mut job) = self.queue.pop_front() {
            if stop || self.running.len() >= self.config.max_batch {
                kept.push_back(job);
                stop = true;
                continue;
            }
            if job.out.is_closed() {
                self.dequeued();
                self.metrics.count_finished(FinishReason::Cancelled);
                continue;
            }
            match self.admit(&mut job) {
                Admission::Admitted(seq) => {
                    self.dequeued();
                    self.running.push(*seq);
                }
                Admission::Wait => kept.push_back(job),
                Admission::Defer => {
                    kept.push_back(job);
                    stop = true;
                }
                Admission::Done => self.dequeued(),
            }
        }
        self.queue = kept;
    }

    /// Authenticates a job's handle once: the fast path against the slot's last issued handle,
    /// else a full signature check. Counts the outcome.
    fn authenticate(&mut self, job: &mut Job) -> Result<(), EngineError> {
        let Some(unverified) = job.prep.handle.take() else {
            return Ok(());
        };
        let slot = self.kv.lookup(unverified.session_id());
        let last = slot
            .map(|s| self.kv.entry(s))
            .filter(|e| e.tenant() == job.prep.tenant)
            .and_then(|e| e.last_issued());
        match unverified.authenticate(&self.keys, last) {
            Ok((verified, path)) => {
                let counter = match path {
                    zerolayer_handle::VerifyPath::FastPath => &self.metrics.handle_fast_path,
                    zerolayer_handle::VerifyPath::FullVerify => &self.metrics.handle_full_verify,
                };
                add(counter, 1);
                job.verified = Some(verified);
                Ok(())
            }
            Err(e) => {
                self.metrics.count_handle_rejected(&e);
                Err(e.into())
            }
        }
    }

    /// One admission attempt.
    fn admit(&mut self, job: &mut Job) -> Admission {
        if let Err(e) = self.authenticate(job) {
            return self.refuse(job, e);
        }
        let plan = match self.plan(job, false) {
            Ok(Planned::Ready(plan)) => plan,
            Ok(Planned::Busy) => {
                let since = *job.busy_since.get_or_insert_with(Instant::now);
                let waited = since.elapsed();
                if waited >= self.config.session_busy_wait {
                    let e = EngineError::SessionBusy {
                        waited_ms: waited.as_millis() as u64,
                    };
                    return self.refuse(job, e);
                }
                return Admission::Wait;
            }
            Err(e) => return self.refuse(job, e),
        };
        match self.reserve(job, plan) {
            Ok(Some(seq)) => Admission::Admitted(seq),
            Ok(None) => Admission::Defer,
            Err(e) => self.refuse(job, e),
        }
    }

    /// Sends `e` to the job and counts it.
    fn refuse(&self, job: &mut Job, e: EngineError) -> Admission {
        tracing::debug!(request = %job.prep.request_id, cause = %e, "request refused");
        self.metrics.count_error(e.reason());
        job.out.fail(e);
        Admission::Done
    }

    /// Plans the prompt of a job (no mutation of the slot map). With `dry_run`, a busy
    /// conversation is planned as a miss instead of waiting.
    fn plan(&mut self, job: &Job, dry_run: bool) -> Result<Planned, EngineError> {
        let prep = &job.prep;
        let prompt_hash_of_request = prep.prompt_hash;
        let mut plan = if job.probe || !self.config.reuse {
            Plan {
                target: Target::Throwaway,
                epoch: 0,
                prompt_hash: prompt_hash_of_request.unwrap_or(PromptHash::from_bytes([0; 16])),
                prompt: prep.ids.clone(),
                tracked: Vec::new(),
                messages: UNKNOWN_MESSAGES,
                keep_prefix: prep.keep_prefix,
                cached: 0,
                truncated: 0,
                max_tokens: 0,
                reuse: if job.probe {
                    ReuseOutcome::New
                } else {
                    ReuseOutcome::Disabled
                },
            }
        } else if prep.delta {
            match self.plan_delta(job, dry_run)? {
                Some(plan) => plan,
                None => return Ok(Planned::Busy),
            }
        } else {
            match self.plan_full(job, dry_run) {
                Some(plan) => plan,
                None => return Ok(Planned::Busy),
            }
        };
        self.preflight(job, &mut plan)?;
        Ok(Planned::Ready(plan))
    }

    /// Plans a delta request: the slot supplies the history. `None`: busy.
    fn plan_delta(&mut self, job: &Job, dry_run: bool) -> Result<Option<Plan>, EngineError> {
        let prep = &job.prep;
        let evicted = |why| Err(EngineError::ContextEvicted { why });
        // Invariant: `prepare` refuses delta requests without a handle, and `admit`
        // authenticated it before planning.
        let Some(claims) = job.verified.as_ref().map(|v| *v.claims()) else {
            return evicted("no verified handle");
        };
        let Some(slot) = self.kv.lookup(claims.session_id) else {
            return evicted("slot evicted");
        };
        let e = self.kv.entry(slot);
        if e.tenant() != prep.tenant || e.prompt_hash() != claims.prompt_hash {
            return evicted("slot evicted");
        }
        if self.kv.state(slot) == SlotState::InUse {
            if dry_run {
                return evicted("conversation busy");
            }
            return Ok(None);
        }
        if e.epoch() != claims.epoch {
            return evicted("epoch changed");
        }
        let base = claims.kv_offset as usize;
        if base > e.tokens() {
            return evicted("slot truncated");
        }
        let branch = base < e.tokens();
        let mut prompt = Vec::with_capacity(base + prep.ids.len());
        self.kv.copy_tokens(slot, 0..base, &mut prompt);
        prompt.extend_from_slice(&prep.ids);
        let mut tracked: Vec<(u64, u32)> = e
            .tracked()
            .take_while(|&(_, end)| end as usize <= base)
            .collect();
        // Messages in the history: unchanged without a branch; after a branch known only when
        // the cut falls on a tracked message boundary.
        let on_boundary = tracked
            .last()
            .map_or(base <= 1, |&(_, end)| end as usize == base);
        let mut messages = match (branch, on_boundary) {
            (false, _) => e.messages(),
            (true, true) => tracked.len() as u32,
            (true, false) => UNKNOWN_MESSAGES,
        };
        if messages != UNKNOWN_MESSAGES {
            // New messages are tracked only while every earlier one is.
            if messages as usize == tracked.len() {
                for (&h, &end) in prep.hashes.iter().zip(&prep.ends) {
                    if tracked.len() < MAX_TRACKED_MESSAGES {
                        tracked.push((h, (base + end as usize) as u32));
                    }
                }
            }
            messages += prep.ends.len() as u32;
        }
        let cached = base.min(prompt.len() - 1);
        Ok(Some(Plan {
            target: Target::Existing(slot),
            epoch: if branch || cached < base {
                e.epoch().wrapping_add(1)
            } else {
                e.epoch()
            },
            prompt_hash: claims.prompt_hash,
            prompt,
            tracked,
            messages,
            keep_prefix: e.keep_prefix() as u32,
            cached,
            truncated: 0,
            max_tokens: 0,
            reuse: if cached > 0 {
                ReuseOutcome::Hit
            } else {
                ReuseOutcome::Miss
            },
        }))
    }

    /// Plans a full-transcript request. `None`: busy.
    fn plan_full(&mut self, job: &Job, dry_run: bool) -> Option<Plan> {
        let prep = &job.prep;
        // Invariant: `prepare` computes the prompt hash of every full-transcript request.
        let request_hash = prep.prompt_hash.expect("full requests carry a prompt hash");
        let own_tracked = |base_end: usize, base_count: usize| -> Vec<(u64, u32)> {
            let own_start = if base_count == 0 {
                1
            } else {
                prep.ends[base_count - 1] as usize
            };
            prep.hashes[base_count..]
                .iter()
                .zip(&prep.ends[base_count..])
                .map(|(&h, &end)| (h, (base_end + end as usize - own_start) as u32))
                .collect()
        };
        let fresh = |target, epoch, reuse| Plan {
            target,
            epoch,
            prompt_hash: request_hash,
            prompt: prep.ids.clone(),
            tracked: own_tracked(1, 0),
            messages: prep.ends.len() as u32,
            keep_prefix: prep.keep_prefix,
            cached: 0,
            truncated: 0,
            max_tokens: 0,
            reuse,
        };
        let claims = match &job.verified {
            Some(v) if v.claims().prompt_hash == request_hash => *v.claims(),
            // No handle, or a handle of another conversation: a new conversation.
            _ => return Some(fresh(Target::New(0), 0, ReuseOutcome::New)),
        };
        let Some(slot) = self.kv.lookup(claims.session_id) else {
            // Evicted: the conversation continues in a new slot under the same session id.
            return Some(fresh(
                Target::New(claims.session_id),
                claims.epoch.wrapping_add(1),
                ReuseOutcome::Miss,
            ));
        };
        let e = self.kv.entry(slot);
        if e.tenant() != prep.tenant || e.prompt_hash() != claims.prompt_hash {
            // Another conversation holds this id (a 64-bit collision): start a new one.
            return Some(fresh(Target::New(0), 0, ReuseOutcome::New));
        }
        if self.kv.state(slot) == SlotState::InUse {
            if dry_run {
                return Some(fresh(Target::Throwaway, e.epoch(), ReuseOutcome::Miss));
            }
            return None;
        }
        if e.epoch() != claims.epoch || claims.kv_offset as usize > e.tokens() {
            // An abandoned branch (or contents the handle never saw): nothing is reusable.
            let epoch = e.epoch().max(claims.epoch).wrapping_add(1);
            return Some(fresh(Target::Existing(slot), epoch, ReuseOutcome::Miss));
        }
        let base = claims.kv_offset as usize;
        // Messages identical (role and content) to the slot's tracked ones at the same index
        // take their token ids from the slot: generated ids do not always survive
        // re-tokenisation of the reply's text.
        let slot_tracked: Vec<(u64, u32)> = e
            .tracked()
            .take_while(|&(_, end)| end as usize <= base)
            .collect();
        let matched = slot_tracked
            .iter()
            .zip(&prep.hashes)
            .take_while(|((h, _), own)| h == *own)
            .count();
        let mut prompt = Vec::with_capacity(prep.ids.len() + 16);
        let (base_end, own_start) = if matched == 0 {
            (1, 1)
        } else {
            (
                slot_tracked[matched - 1].1 as usize,
                prep.ends[matched - 1] as usize,
            )
        };
        if matched == 0 {
            prompt.push(prep.ids[0]);
        } else {
            self.kv.copy_tokens(slot, 0..base_end, &mut prompt);
        }
        prompt.extend_from_slice(&prep.ids[own_start..]);
        let mut tracked = slot_tracked[..matched].to_vec();
        tracked.extend(own_tracked(base_end, matched));
        let common = self.kv.common_prefix(slot, &prompt).min(base);
        // At least the last prompt token is computed again: its logits start generation.
        let cached = common.min(prompt.len() - 1);
        let epoch = if cached < e.tokens() {
            e.epoch().wrapping_add(1)
        } else {
            e.epoch()
        };
        let keep_prefix = if matched > 0 && prep.keep_prefix > 1 {
            tracked[0].1
        } else {
            prep.keep_prefix
        };
        Some(Plan {
            target: Target::Existing(slot),
            epoch,
            prompt_hash: request_hash,
            prompt,
            tracked,
            messages: prep.ends.len() as u32,
            keep_prefix,
            cached,
            truncated: 0,
            max_tokens: 0,
            reuse: if cached > 0 {
                ReuseOutcome::Hit
            } else {
                ReuseOutcome::Miss
            },
        })
    }

    /// Context-length preflight: sets `max_tokens`, or truncates the prompt on the left (keeping
    /// BOS and the system message, without reuse), or refuses.
    fn preflight(&self, job: &Job, plan: &mut Plan) -> Result<(), EngineError> {
        let window = self.window;
        let explicit = if job.probe {
            Some(1)
        } else {
            job.prep.max_tokens
        };
        let wanted = explicit.unwrap_or(self.config.default_max_tokens) as usize;
        let len = plan.prompt.len();
        if len < window && (explicit.is_none() || len + wanted <= window) {
            plan.max_tokens = wanted.min(window - len);
            return Ok(());
        }
        let exceeded = || EngineError::ContextLengthExceeded {
            prompt_tokens: len as u32,
            max_tokens: wanted as u32,
            window: window as u32,
        };
        if job.prep.truncation != Truncation::Left || wanted >= window {
            return Err(exceeded());
        }
        let budget = window - wanted;
        let keep = (plan.keep_prefix as usize).clamp(1, len);
        if keep + 1 > budget {
            return Err(exceeded());
        }
        let drop = len - budget;
        plan.prompt.drain(keep..keep + drop);
        plan.truncated = drop;
        plan.max_tokens = wanted;
        // Without reuse for this turn: the slot's contents are replaced.
        plan.cached = 0;
        plan.tracked.clear();
        plan.messages = UNKNOWN_MESSAGES;
        if let Target::Existing(slot) = plan.target {
            plan.epoch = self.kv.entry(slot).epoch().wrapping_add(1);
        }
        plan.reuse = match plan.reuse {
            ReuseOutcome::Hit => ReuseOutcome::Miss,
            other => other,
        };
        Ok(())
    }

    /// Takes the slot and reserves every block the request may need (evicting idle slots
    /// first). `Ok(None)`: not enough blocks now, but running sequences will free some.
    fn reserve(&mut self, job: &mut Job, plan: Plan) -> Result<Option<Box<Sequence>>, EngineError> {
        let total = self
            .kv
            .pool()
            .blocks_for(plan.prompt.len() + plan.max_tokens);
        let new_id = match plan.target {
            Target::New(0) => self.fresh_session_id()?,
            Target::New(id) => id,
            _ => 0,
        };
        // Invariant: `admit_queue` admits only while fewer than `max_batch` run, and each
        // running sequence holds one of the `max_batch` tables.
        let mut table = self
            .tables
            .pop()
            .expect("a free block table per admissible sequence");
        let taken = match plan.target {
            Target::Throwaway => Ok((None, 0, 0)),
            Target::Existing(slot) => self
                .kv
                .acquire(slot, &mut table)
                .map(|held| (Some(slot), self.kv.entry(slot).session_id(), held)),
            Target::New(_) => self
                .kv
                .insert(new_id, job.prep.tenant, plan.prompt_hash, plan.epoch)
                .and_then(|slot| {
                    self.kv
                        .acquire(slot, &mut table)
                        .map(|_| (Some(slot), new_id, 0))
                }),
        };
        let (slot, session_id, held) = match taken {
            Ok(t) => t,
            Err(e) => {
                self.tables.push(table);
                // Every slot in use by running requests: wait for one to finish.
                return if e == KvError::SlotMapFull && !self.running.is_empty() {
                    Ok(None)
                } else {
                    Err(kv_internal(e))
                };
            }
        };
        let kept = self.kv.pool().blocks_for(plan.cached).min(table.len());
        let releasable = table.len() - kept;
        let need = total.saturating_sub(kept);
        // Idle conversations are evicted (LRU, 5% at a time) before a request is refused or
        // made to wait, unless the request can never fit the pool.
        if total <= self.kv.pool().total_blocks() {
            while self.kv.pool().free_blocks() + releasable < need && self.kv.evict_lru() > 0 {}
        }
        let free = self.kv.pool().free_blocks() + releasable;
        if free < need {
            // Undo: the slot goes back untouched (a new one is removed again).
            match (plan.target, slot) {
                (Target::Existing(_), Some(s)) => self.kv.release(s, &mut table, held),
                (_, Some(s)) => {
                    self.kv.remove(s);
                    self.kv.pool_mut().release(&table);
                    table.clear();
                }
                _ => {}
            }
            self.tables.push(table);
            // Running sequences hold the missing blocks and release them within max_tokens
            // steps: wait for them (at the head of the queue, so a large request is not
            // starved). With nothing running, waiting cannot help.
            if self.running.is_empty() || total > self.kv.pool().total_blocks() {
                return Err(EngineError::KvCacheOverflow {
                    needed_blocks: need as u32,
                    free_blocks: free as u32,
                });
            }
            return Ok(None);
        }
        let pool = self.kv.pool_mut();
        pool.release(&table[kept..]);
        table.truncate(kept);
        // Invariant: `free >= need` was checked just above and the table has room for a whole
        // window.
        let ok = pool.alloc_into(need, &mut table);
        debug_assert!(ok, "blocks were reserved");
        if let Some(s) = slot {
            self.kv.set_epoch(s, plan.epoch);
        }
        self.metrics.count_reuse(plan.reuse);
        let prompt_len = plan.prompt.len();
        let prep = std::mem::replace(&mut job.prep, empty_prepared());
        Ok(Some(Box::new(Sequence {
            out: std::mem::replace(&mut job.out, Output::Probe(None)),
            request_id: prep.request_id,
            slot,
            session_id,
            tenant: prep.tenant,
            prompt_hash: plan.prompt_hash,
            epoch: plan.epoch,
            table,
            prompt: plan.prompt,
            tracked: plan.tracked,
            messages: plan.messages,
            keep_prefix: plan.keep_prefix,
            pos: plan.cached,
            cached: plan.cached,
            truncated: plan.truncated,
            generated: Vec::with_capacity(plan.max_tokens),
            byte_ends: Vec::with_capacity(plan.max_tokens),
            max_tokens: plan.max_tokens,
            sampling: prep.sampling,
            stop: prep.stop,
            safety: prep.safety,
            banned: Vec::new(),
            text: OutputText::default(),
            phase: if plan.cached < prompt_len {
                Phase::Prefill
            } else {
                Phase::Decode
            },
            end: None,
            reuse: plan.reuse,
            probe: job.probe,
            submitted: prep.submitted,
            first_step: None,
            first_token: None,
            last_token: None,
        })))
    }

    /// A random session id not in the map.
    fn fresh_session_id(&mut self) -> Result<u64, EngineError> {
        loop {
            let id = zerolayer_handle::random_session_id().map_err(|e| EngineError::Internal {
                reason: format!("no entropy: {e}"),
            })?;
            if id != 0 && self.kv.lookup(id).is_none() {
                return Ok(id);
            }
        }
    }

    /// Dry-run admission for `validate`.
    fn validate(&mut self, prep: Prepared) -> Result<ValidateReport, EngineError> {
        let mut job = Job {
            prep,
            out: Output::Probe(None),
            verified: None,
            busy_since: None,
            probe: false,
        };
        self.authenticate(&mut job)?;
        let Planned::Ready(plan) = self.plan(&job, true)? else {
            return Err(EngineError::Internal {
                reason: "dry-run planning cannot wait".into(),
            });
        };
        let prefill = plan.prompt.len() - plan.cached;
        Ok(ValidateReport {
            prompt_tokens: plan.prompt.len() as u32,
            cached_prompt_tokens: plan.cached as u32,
            prefill_tokens: prefill as u32,
            max_tokens: plan.max_tokens as u32,
            context_window: self.window as u32,
            truncated_prompt_tokens: plan.truncated as u32,
            estimated_flops: 2 * self.n_params * (prefill + plan.max_tokens) as u64,
        })
    }

    /// Runs one forward step over the running sequences and processes its results.
    fn step(&mut self) {
        let step_start = Instant::now();
        // Banned tokens for every sequence that may sample in this step.
        for seq in &mut self.running {
            if let (Some(safety), Phase::Prefill | Phase::Decode) = (&seq.safety, seq.phase) {
                safety.banned(&seq.prompt, &seq.generated, &mut seq.banned);
            }
        }
        // (sequence index, start position, tokens, wants logits)
        let mut plan: Vec<(usize, usize, usize, bool)> = Vec::with_capacity(self.running.len());
        let decoding = self
            .running
            .iter()
            .filter(|s| matches!(s.phase, Phase::Decode | Phase::Tail))
            .count();
        let mut budget = self.config.step_token_budget.saturating_sub(decoding);
        for (i, seq) in self.running.iter().enumerate() {
            match seq.phase {
                Phase::Decode => plan.push((i, seq.pos, 1, true)),
                Phase::Tail => plan.push((i, seq.pos, 1, false)),
                Phase::Prefill if budget > 0 => {
                    let n = (seq.prompt.len() - seq.pos).min(budget);
                    budget -= n;
                    plan.push((i, seq.pos, n, seq.pos + n == seq.prompt.len()));
                }
                Phase::Prefill | Phase::Done => {}
            }
        }
        if plan.is_empty() {
            return;
        }
        let tokens_of = |seq: &Sequence, start: usize, n: usize| -> std::ops::Range<usize> {
            if start < seq.prompt.len() {
                start..start + n
            } else {
                start - seq.prompt.len()..start - seq.prompt.len() + n
            }
        };
        let wanting = plan.iter().filter(|p| p.3).count();
        let mut outcomes = vec![SampleOutcome::NothingAllowed; wanting];
        let result = {
            let running = &self.running;
            let chunks: Vec<SeqChunk<'_>> = plan
                .iter()
                .map(|&(i, start, n, want)| {
                    let seq = &running[i];
                    let r = tokens_of(seq, start, n);
                    let tokens = if start < seq.prompt.len() {
                        &seq.prompt[r]
                    } else {
                        &seq.generated[r]
                    };
                    let blocks = (start + n).div_ceil(self.kv.pool().block_size());
                    SeqChunk {
                        tokens,
                        start_pos: start,
                        block_table: &seq.table[..blocks],
                        want_logits: want,
                    }
                })
                .collect();
            let inputs: Vec<SampleInput<'_>> = plan
                .iter()
                .filter(|p| p.3)
                .map(|&(i, ..)| {
                    let seq = &running[i];
                    SampleInput {
                        params: &seq.sampling,
                        uniform: sample_uniform(seq.sampling.seed(), seq.generated.len() as u64),
                        banned: &seq.banned,
                    }
                })
                .collect();
            self.backend.forward_sample(&chunks, &inputs, &mut outcomes)
        };
        let ns = step_start.elapsed().as_nanos() as u64;
        let step_tokens: usize = plan.iter().map(|p| p.2).sum();
        self.metrics.record_step(plan.len(), step_tokens, ns);
        if let Err(e) = result {
            tracing::error!(cause = %e, "forward step failed");
            let err = EngineError::from(e);
            for &(i, ..) in &plan {
                self.running[i].finish(End::Failed(err.clone()));
            }
            return;
        }
        let now = Instant::now();
        let mut out_i = 0;
        for &(i, start, n, want) in &plan {
            let seq = &mut self.running[i];
            seq.first_step.get_or_insert(step_start);
            // Record the ids of the positions just computed beside their blocks.
            let r = tokens_of(seq, start, n);
            let ids = if start < seq.prompt.len() {
                &seq.prompt[r]
            } else {
                &seq.generated[r]
            };
            self.kv.pool_mut().write_tokens(&seq.table, start, ids);
            seq.pos = start + n;
            if start < seq.prompt.len() {
                add(&self.metrics.prefill_tokens, n as u64);
            }
            if seq.phase == Phase::Tail {
                seq.phase = Phase::Done;
                continue;
            }
            if !want {
                continue;
            }
            let outcome = outcomes[out_i];
            out_i += 1;
            seq.phase = Phase::Decode;
            self.sampled(i, outcome, now);
        }
    }

    /// Processes the token sampled for running sequence `i`.
    fn sampled(&mut self, i: usize, outcome: SampleOutcome, now: Instant) {
        let tokenizer = Arc::clone(&self.tokenizer);
        let metrics = Arc::clone(&self.metrics);
        let seq = &mut self.running[i];
        if seq.first_token.is_none() {
            seq.first_token = Some(now);
            metrics.record_ttft(now.duration_since(seq.submitted).as_nanos() as u64);
        }
        seq.last_token = Some(now);
        let token = match outcome {
            SampleOutcome::Token(t) => t,
            SampleOutcome::NothingAllowed => {
                seq.finish(End::Finished(FinishReason::Safety));
                return;
            }
        };
        add(&metrics.decode_tokens, 1);
        if seq.probe {
            seq.generated.push(token);
            seq.finish(End::Finished(FinishReason::Length));
            return;
        }
        if token == tokenizer.bos_id() || token == tokenizer.eos_id() {
            seq.finish(End::Finished(FinishReason::Stop));
            return;
        }
        // The reply is a message of its own: its first token's leading space is the message's
        // dummy prefix (as after BOS), so the delivered text re-tokenises like the ids.
        let prev = seq.generated.last().copied().unwrap_or(tokenizer.bos_id());
        let piece = tokenizer.decode_piece(prev, token);
        seq.generated.push(token);
        let empty: &[String] = &[];
        let forbidden = seq.safety.as_ref().map_or(empty, |s| s.strings());
        let (text, matched) = seq.text.push(piece, &seq.stop, forbidden);
        let prior_end = seq.byte_ends.last().copied().unwrap_or(0);
        seq.byte_ends.push(prior_end + piece.len());
        if let Output::Stream(tx) = &seq.out {
            let event = Event::Tokens {
                text,
                token_ids: vec![token],
                context: seq.context(seq.pos),
            };
            if tx.send(Ok(event)).is_err() {
                seq.finish(End::Cancelled);
                return;
            }
        }
        match matched {
            Some(TextMatch::Stop) => seq.finish(End::Finished(FinishReason::StopSequence)),
            Some(TextMatch::Forbidden) => seq.finish(End::Finished(FinishReason::Safety)),
            None if seq.generated.len() >= seq.max_tokens => {
                seq.finish(End::Finished(FinishReason::Length))
            }
            None => {}
        }
    }

    /// Finalises and removes every `Done` sequence, keeping the order of the others.
    fn finalize_done(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].phase == Phase::Done {
                let seq = self.running.remove(i);
                self.finalize(seq);
            } else {
                i += 1;
            }
        }
    }

    /// Stores a finished sequence's conversation, sends its final event and frees its blocks.
    fn finalize(&mut self, mut seq: Sequence) {
        let end = seq.end.take().unwrap_or(End::Cancelled);
        let mut table = std::mem::take(&mut seq.table);
        let reason = match end {
            End::Finished(r) => r,
            End::Cancelled => {
                self.metrics.count_finished(FinishReason::Cancelled);
                match seq.slot {
                    Some(slot) => {
                        self.kv.release(slot, &mut table, seq.cached);
                        self.kv.cut_tracked(slot, seq.cached);
                    }
                    None => self.kv.pool_mut().release(&table),
                }
                return self.recycle(table);
            }
            End::Failed(e) => {
                self.metrics.count_error(e.reason());
                if let Some(slot) = seq.slot {
                    self.kv.remove(slot);
                }
                self.kv.pool_mut().release(&table);
                seq.out.fail(e);
                return self.recycle(table);
            }
        };
        let timings = self.timings(&seq);
        if seq.probe {
            self.kv.pool_mut().release(&table);
            self.metrics.count_finished(reason);
            if let Output::Probe(reply) = &mut seq.out
                && let Some(reply) = reply.take()
            {
                let report = match seq.generated.first() {
                    Some(&token_id) => Ok(ProbeReport {
                        token_id,
                        queue_ns: timings.queue_ns,
                        prefill_ns: timings.prefill_ns,
                        total_ns: seq.submitted.elapsed().as_nanos() as u64,
                        model: self.model_name.clone(),
                    }),
                    None => Err(EngineError::Internal {
                        reason: "the probe produced no token".into(),
                    }),
                };
                let _ = reply.send(report);
            }
            return self.recycle(table);
        }
        let kept = seq.kept_tokens();
        let kv_tokens = seq.prompt.len() + kept;
        let mut handle = None;
        let mut kv_offset = 0;
        if let Some(slot) = seq.slot {
            debug_assert!(seq.pos >= kv_tokens, "the tail step fed every kept token");
            let kv_tokens = kv_tokens.min(seq.pos);
            let mut tracked = std::mem::take(&mut seq.tracked);
            let mut messages = seq.messages;
            if messages != UNKNOWN_MESSAGES {
                // The reply is the conversation's next message; it is tracked (its generated
                // ids stand for its text next turn) when its text is exactly those ids' text.
                let ids_end = if kept == 0 {
                    0
                } else {
                    seq.byte_ends[kept - 1]
                };
                let exact = seq.text.is_exact() && ids_end == seq.text.released_bytes();
                if exact
                    && tracked.len() == messages as usize
                    && tracked.len() < MAX_TRACKED_MESSAGES
                {
                    tracked.push((
                        self.hasher.hash(Role::Assistant, seq.text.released()),
                        kv_tokens as u32,
                    ));
                }
                messages += 1;
            }
            let claims = Claims {
                session_id: seq.session_id,
                tenant: seq.tenant,
                prompt_hash: seq.prompt_hash,
                kv_offset: kv_tokens as u32,
                epoch: seq.epoch,
                expires_at: unix_now().saturating_add(self.config.handle_ttl.as_secs()),
            };
            let issued = self.keys.issue(claims);
            self.kv.set_conversation(
                slot,
                &ConversationUpdate {
                    epoch: seq.epoch,
                    tracked: &tracked,
                    messages,
                    keep_prefix: seq.keep_prefix,
                    issued: Some(&issued),
                },
            );
            self.kv.release(slot, &mut table, kv_tokens);
            handle = Some(issued.as_bytes().to_vec());
            kv_offset = kv_tokens;
        } else {
            self.kv.pool_mut().release(&table);
        }
        add(&self.metrics.cached_prompt_tokens, seq.cached as u64);
        self.metrics.count_finished(reason);
        let info = FinalInfo {
            handle,
            finish_reason: reason,
            usage: Usage {
                prompt_tokens: seq.prompt.len() as u32,
                cached_prompt_tokens: seq.cached as u32,
                prefilled_prompt_tokens: (seq.prompt.len() - seq.cached) as u32,
                generated_tokens: seq.generated.len() as u32,
                truncated_prompt_tokens: seq.truncated as u32,
            },
            timings,
            reuse: seq.reuse,
            session_id: seq.session_id,
            context: seq.context(kv_offset),
        };
        tracing::debug!(request = %seq.request_id, session = seq.session_id, finish = ?reason, "request finished");
        if let Output::Stream(tx) = &seq.out {
            let _ = tx.send(Ok(Event::Finished(info)));
        }
        self.recycle(table);
    }

    /// Returns a block table buffer to the free list.
    fn recycle(&mut self, mut table: Vec<u32>) {
        table.clear();
        self.tables.push(table);
    }

    /// A sequence's timings.
    fn timings(&self, seq: &Sequence) -> Timings {
        let ns = |a: Instant, b: Option<Instant>| {
            b.map_or(0, |b| b.saturating_duration_since(a).as_nanos() as u64)
        };
        let first_step = seq.first_step.unwrap_or(seq.submitted);
        Timings {
            queue_ns: ns(seq.submitted, seq.first_step),
            prefill_ns: ns(first_step, seq.first_token),
            decode_ns: seq.first_token.map_or(0, |f| ns(f, seq.last_token)),
            ttft_ns: ns(seq.submitted, seq.first_token),
        }
    }
}

/// A slot map failure that admission rules out (a bug).
fn kv_internal(e: KvError) -> EngineError {
    EngineError::Internal {
        reason: format!("slot map: {e}"),
    }
}

/// Placeholder left in a job whose request moved into a sequence.
fn empty_prepared() -> Prepared {
    Prepared {
        tenant: TenantTag::from_bytes([0; 8]),
        request_id: String::new(),
        delta: false,
        ids: Vec::new(),
        ends: Vec::new(),
        hashes: Vec::new(),
        keep_prefix: 0,
        prompt_hash: None,
        handle: None,
        max_tokens: None,
        sampling: SamplingParams::greedy(),
        stop: Vec::new(),
        truncation: Truncation::Reject,
        safety: None,
        submitted: Instant::now(),
    }
}
