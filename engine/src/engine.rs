//! [`Engine`]: the cloneable handle the services hold (a command sender to the scheduler
//! thread plus shared metrics), and [`GenerationStream`].

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::{mpsc as tmpsc, oneshot};
use zerolayer_handle::{KeyRing, TenantTag};
use zerolayer_model::{Backend, CpuBackend, Model, SamplingParams, Tokenizer};

use crate::api::{Caller, Event, GenerateRequest, ProbeReport, Truncation, ValidateReport};
use crate::config::{EngineConfig, SafetyConfig};
use crate::error::EngineError;
use crate::metrics::EngineMetrics;
use crate::request::{MessageHasher, PrepareContext, Prepared, prepare};
use crate::safety::TenantSafety;
use crate::scheduler::{Command, Job, Output, PROBE_PROMPT, Scheduler, SchedulerParts, Shared};

/// What every clone of an [`Engine`] shares.
struct Inner {
    /// Commands to the scheduler thread.
    tx: mpsc::Sender<Command>,
    /// Tokenisation on the caller's thread.
    tokenizer: Arc<Tokenizer>,
    /// Handle keys (precheck on the caller's thread).
    keys: Arc<KeyRing>,
    /// Compiled safety rules per tenant.
    safety: HashMap<String, Arc<TenantSafety>>,
    /// Message identities (same key as the scheduler's).
    hasher: MessageHasher,
    /// Settings.
    config: EngineConfig,
    /// Metrics (shared with the scheduler).
    metrics: Arc<EngineMetrics>,
    /// Queue depth and the accepting flag.
    shared: Arc<Shared>,
    /// The probe prompt's ids.
    probe_ids: Vec<u32>,
    /// The scheduler thread, until joined.
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The engine: a cloneable handle to the scheduler thread. Dropping every clone lets the
/// thread finish the running requests and exit.
#[derive(Clone)]
pub struct Engine {
    /// Shared state.
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Starts the scheduler thread over `backend` (whose KV pool must match
    /// `config.kv_cache_config()`). Forbidden strings are tokenised here.
    pub fn start(
        backend: Box<dyn Backend>,
        tokenizer: Arc<Tokenizer>,
        model_name: String,
        keys: Arc<KeyRing>,
        safety: SafetyConfig,
        config: EngineConfig,
    ) -> Result<Engine, EngineError> {
        config.validate(backend.kv_config())?;
        let vocab = backend.config().vocab_size;
        if tokenizer.vocab_size() != vocab {
            return Err(EngineError::config(format!(
                "the tokenizer has {} tokens, the model {vocab}",
                tokenizer.vocab_size()
            )));
        }
        let compiled = safety
            .per_tenant
            .iter()
            .map(|(tenant, strings)| {
                Ok((
                    tenant.clone(),
                    Arc::new(TenantSafety::compile(tenant, strings, &tokenizer)?),
                ))
            })
            .collect::<Result<HashMap<_, _>, EngineError>>()?;
        let hasher = MessageHasher::random()?;
        let metrics = Arc::new(EngineMetrics::default());
        let shared = Arc::new(Shared::default());
        shared.accepting.store(true, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        let probe_ids = tokenizer.render_messages(&[("user", PROBE_PROMPT)]);
        let scheduler = Scheduler::new(SchedulerParts {
            backend,
            tokenizer: Arc::clone(&tokenizer),
            keys: Arc::clone(&keys),
            hasher: hasher.clone(),
            config: config.clone(),
            model_name,
            metrics: Arc::clone(&metrics),
            shared: Arc::clone(&shared),
            rx,
        });
        let thread = std::thread::Builder::new()
            .name("zerolayer-scheduler".into())
            .spawn(move || scheduler.run_thread())
            .map_err(|e| EngineError::Internal {
                reason: format!("cannot start the scheduler thread: {e}"),
            })?;
        Ok(Engine {
            inner: Arc::new(Inner {
                tx,
                tokenizer,
                keys,
                safety: compiled,
                hasher,
                config,
                metrics,
                shared,
                probe_ids,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// [`Engine::start`] with a [`CpuBackend`] of `config.threads` workers and
    /// `config.kv_cache_config()`.
    pub fn start_cpu(
        model: &Model,
        keys: Arc<KeyRing>,
        safety: SafetyConfig,
        config: EngineConfig,
    ) -> Result<Engine, EngineError> {
        let backend = CpuBackend::new(
            Arc::clone(&model.weights),
            config.kv_cache_config(),
            config.threads,
        )?;
        Engine::start(
            Box::new(backend),
            Arc::clone(&model.tokenizer),
            model.name.clone(),
            keys,
            safety,
            config,
        )
    }

    /// The settings the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Submits a request. Errors found before generation (handle, preflight, overflow,
    /// busy, …) arrive as the first item of the stream. Tokenisation runs on the calling thread
    /// (microseconds per kilobyte of text). Dropping the stream cancels the request; its
    /// resources are freed at the scheduler's next step.
    pub fn generate(&self, caller: &Caller, req: GenerateRequest) -> GenerationStream {
        let (tx, rx) = tmpsc::unbounded_channel();
        let stream = GenerationStream { rx };
        let result = self
            .check_available()
            .and_then(|()| prepare(self.prepare_context(caller), caller, req));
        let prep = match result {
            Ok(prep) => prep,
            Err(e) => {
                self.count_refused(&e);
                let _ = tx.send(Err(e));
                return stream;
            }
        };
        let job = Box::new(Job {
            prep,
            out: Output::Stream(tx),
            verified: None,
            busy_since: None,
            probe: false,
        });
        if let Err((mut job, e)) = self.enqueue(job) {
            self.count_refused(&e);
            job.out.fail(e);
        }
        stream
    }

    /// Checks a request as [`Engine::generate`] would (tokenisation, handle, slot lookup,
    /// preflight) and estimates its cost, without generating. A conversation whose previous
    /// request still runs is reported without cached tokens.
    pub async fn validate(
        &self,
        caller: &Caller,
        req: GenerateRequest,
    ) -> Result<ValidateReport, EngineError> {
        let rx = self.send_validate(caller, req)?;
        rx.await.unwrap_or(Err(EngineError::Unavailable {
            reason: "the scheduler stopped",
        }))
    }

    /// Blocking [`Engine::validate`] for non-async callers (panics inside an async runtime, as
    /// tokio's blocking receive does).
    pub fn validate_blocking(
        &self,
        caller: &Caller,
        req: GenerateRequest,
    ) -> Result<ValidateReport, EngineError> {
        let rx = self.send_validate(caller, req)?;
        rx.blocking_recv().unwrap_or(Err(EngineError::Unavailable {
            reason: "the scheduler stopped",
        }))
    }

    /// Generates one token from a fixed prompt on a throwaway sequence (no slot, no handle)
    /// through the whole scheduler path: the health check.
    pub async fn probe(&self) -> Result<ProbeReport, EngineError> {
        let rx = self.send_probe()?;
        rx.await.unwrap_or(Err(EngineError::Unavailable {
            reason: "the scheduler stopped",
        }))
    }

    /// Blocking [`Engine::probe`].
    pub fn probe_blocking(&self) -> Result<ProbeReport, EngineError> {
        let rx = self.send_probe()?;
        rx.blocking_recv().unwrap_or(Err(EngineError::Unavailable {
            reason: "the scheduler stopped",
        }))
    }

    /// The engine's metrics (lock-free reads).
    pub fn metrics(&self) -> Arc<EngineMetrics> {
        Arc::clone(&self.inner.metrics)
    }

    /// Requests waiting for admission.
    pub fn queue_depth(&self) -> usize {
        self.inner.shared.queue_depth.load(Ordering::Relaxed)
    }

    /// Whether the scheduler thread is alive and accepting requests.
    pub fn is_healthy(&self) -> bool {
        self.inner.metrics.is_healthy() && self.inner.shared.accepting.load(Ordering::Relaxed)
    }

    /// Stops accepting requests (new ones get `ENGINE_UNAVAILABLE`); queued and running
    /// requests finish, then the scheduler thread exits. See [`Engine::join`].
    pub fn shutdown(&self) {
        self.inner.shared.accepting.store(false, Ordering::Relaxed);
        let _ = self.inner.tx.send(Command::Shutdown);
    }

    /// Waits for the scheduler thread to exit (after [`Engine::shutdown`]); returns at once if
    /// another clone already joined it.
    pub fn join(&self) {
        let handle = self
            .inner
            .thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }

    /// The per-request inputs of [`prepare`].
    fn prepare_context(&self, caller: &Caller) -> PrepareContext<'_> {
        let inner = &self.inner;
        PrepareContext {
            tokenizer: &inner.tokenizer,
            keys: &inner.keys,
            hasher: &inner.hasher,
            safety: inner.safety.get(&*caller.tenant).cloned(),
            reuse: inner.config.reuse,
        }
    }

    /// `Unavailable` once shut down or failed.
    fn check_available(&self) -> Result<(), EngineError> {
        if !self.inner.shared.accepting.load(Ordering::Relaxed) {
            return Err(EngineError::Unavailable {
                reason: "the engine is shutting down",
            });
        }
        if !self.inner.metrics.is_healthy() {
            return Err(EngineError::Unavailable {
                reason: "the scheduler failed",
            });
        }
        Ok(())
    }

    /// Counts an error found on the caller's thread.
    fn count_refused(&self, e: &EngineError) {
        self.inner.metrics.count_error(e.reason());
        if let EngineError::InvalidHandle(h) = e {
            self.inner.metrics.count_handle_rejected(h);
        }
    }

    /// Queues a job unless the queue is full (`Overloaded`) or the scheduler is gone
    /// (`Unavailable`); then the job comes back with the error.
    fn enqueue(&self, job: Box<Job>) -> Result<(), (Box<Job>, EngineError)> {
        let shared = &self.inner.shared;
        let max_queue = self.inner.config.max_queue;
        let depth = shared.queue_depth.fetch_add(1, Ordering::Relaxed);
        if depth >= max_queue {
            shared.queue_depth.fetch_sub(1, Ordering::Relaxed);
            let e = EngineError::Overloaded {
                queue_depth: depth as u32,
                max_queue: max_queue as u32,
            };
            return Err((job, e));
        }
        match self.inner.tx.send(Command::Generate(job)) {
            Ok(()) => Ok(()),
            Err(mpsc::SendError(cmd)) => {
                shared.queue_depth.fetch_sub(1, Ordering::Relaxed);
                shared.accepting.store(false, Ordering::Relaxed);
                let e = EngineError::Unavailable {
                    reason: "the scheduler stopped",
                };
                match cmd {
                    Command::Generate(job) => Err((job, e)),
                    _ => unreachable!("the command returned is the one sent"),
                }
            }
        }
    }

    /// Prepares and sends a validation.
    fn send_validate(
        &self,
        caller: &Caller,
        req: GenerateRequest,
    ) -> Result<oneshot::Receiver<Result<ValidateReport, EngineError>>, EngineError> {
        let result = self
            .check_available()
            .and_then(|()| prepare(self.prepare_context(caller), caller, req));
        let prep = result.inspect_err(|e| self.count_refused(e))?;
        let (reply, rx) = oneshot::channel();
        self.inner
            .tx
            .send(Command::Validate(Box::new(prep), reply))
            .map_err(|_| EngineError::Unavailable {
                reason: "the scheduler stopped",
            })?;
        Ok(rx)
    }

    /// Queues a probe.
    fn send_probe(
        &self,
    ) -> Result<oneshot::Receiver<Result<ProbeReport, EngineError>>, EngineError> {
        self.check_available()?;
        let (reply, rx) = oneshot::channel();
        let prep = Prepared {
            tenant: TenantTag::for_tenant(""),
            request_id: "probe".into(),
            delta: false,
            ids: self.inner.probe_ids.clone(),
            ends: Vec::new(),
            hashes: Vec::new(),
            keep_prefix: 1,
            prompt_hash: None,
            handle: None,
            max_tokens: Some(1),
            sampling: SamplingParams::greedy(),
            stop: Vec::new(),
            truncation: Truncation::Reject,
            safety: None,
            submitted: Instant::now(),
        };
        let job = Box::new(Job {
            prep,
            out: Output::Probe(Some(reply)),
            verified: None,
            busy_since: None,
            probe: true,
        });
        if let Err((mut job, e)) = self.enqueue(job) {
            self.count_refused(&e);
            job.out.fail(e);
        }
        Ok(rx)
    }
}

/// The events of one request: `Tokens` events, then `Finished`, or a single error. Dropping it
/// cancels the request.
#[derive(Debug)]
pub struct GenerationStream {
    /// Events from the scheduler.
    rx: tmpsc::UnboundedReceiver<Result<Event, EngineError>>,
}

impl GenerationStream {
    /// The next event; `None` after the last one.
    pub async fn next(&mut self) -> Option<Result<Event, EngineError>> {
        self.rx.recv().await
    }

    /// Blocking [`GenerationStream::next`] for non-async callers (panics inside an async
    /// runtime, as tokio's blocking receive does).
    pub fn blocking_next(&mut self) -> Option<Result<Event, EngineError>> {
        self.rx.blocking_recv()
    }

    /// Cancels the request now (same as dropping the stream); events already sent can still
    /// be read.
    pub fn cancel(&mut self) {
        self.rx.close();
    }

    /// Reads the whole stream (blocking): every event up to the final one, or the error.
    pub fn collect_blocking(mut self) -> Result<Vec<Event>, EngineError> {
        let mut events = Vec::new();
        while let Some(item) = self.blocking_next() {
            let done = matches!(item, Ok(Event::Finished(_)));
            events.push(item?);
            if done {
                break;
            }
        }
        Ok(events)
    }
}
