//! Shared helpers of the engine's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use zerolayer_engine::api::{
    Caller, Event, FinalInfo, GenerateRequest, Message, Role, SamplingOptions, Truncation,
};
use zerolayer_engine::{Engine, EngineConfig, EngineError, SafetyConfig};
use zerolayer_handle::{KeyRing, SigningKey};
use zerolayer_model::{Model, load_model};

/// Where the test models live: `ZEROLAYER_MODELS_DIR`, else `../shared/models` beside the
/// workspace root.
pub fn models_dir() -> PathBuf {
    match std::env::var_os("ZEROLAYER_MODELS_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/models"),
    }
}

/// stories260K, or `None` with a visible skip message.
pub fn stories() -> Option<Model> {
    let path = models_dir().join("stories260K/stories260K.bin");
    if !path.is_file() {
        eprintln!(
            "SKIPPED: {} not found (set ZEROLAYER_MODELS_DIR)",
            path.display()
        );
        return None;
    }
    Some(load_model(path.to_str().expect("utf-8 path"), None).expect("stories260K loads"))
}

/// The `dummy:tiny` model.
pub fn tiny() -> Model {
    load_model("dummy:tiny", None).expect("dummy:tiny loads")
}

/// A key ring with a fixed key (id 1).
pub fn keys() -> Arc<KeyRing> {
    Arc::new(KeyRing::new(SigningKey::from_seed(1, &[7; 32])))
}

/// A small engine configuration for tests (2 worker threads, small map and pool).
pub fn config() -> EngineConfig {
    EngineConfig {
        slot_capacity: 64,
        kv_blocks: 256,
        max_batch: 16,
        threads: 2,
        ..EngineConfig::default()
    }
}

/// Starts an engine.
pub fn start(model: &Model, config: EngineConfig) -> Engine {
    Engine::start_cpu(model, keys(), SafetyConfig::none(), config).expect("engine starts")
}

/// Starts an engine with safety rules.
pub fn start_with_safety(model: &Model, config: EngineConfig, safety: SafetyConfig) -> Engine {
    Engine::start_cpu(model, keys(), safety, config).expect("engine starts")
}

/// The test tenant.
pub fn caller() -> Caller {
    Caller::new("acme")
}

/// A greedy full-transcript request.
pub fn request(
    messages: Vec<Message>,
    handle: Option<Vec<u8>>,
    max_tokens: u32,
) -> GenerateRequest {
    GenerateRequest {
        messages,
        handle,
        delta: false,
        sampling: SamplingOptions {
            max_tokens: Some(max_tokens),
            seed: Some(1),
            ..SamplingOptions::default()
        },
        truncation: Truncation::Reject,
        request_id: "test".into(),
    }
}

/// What one request produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Concatenated text.
    pub text: String,
    /// Token ids of the `Tokens` events.
    pub ids: Vec<u32>,
    /// The final event.
    pub info: FinalInfo,
}

/// Runs a request to its end.
pub fn run(engine: &Engine, caller: &Caller, req: GenerateRequest) -> Result<Outcome, EngineError> {
    let events = engine.generate(caller, req).collect_blocking()?;
    let mut text = String::new();
    let mut ids = Vec::new();
    for e in events {
        match e {
            Event::Tokens {
                text: t, token_ids, ..
            } => {
                text.push_str(&t);
                ids.extend(token_ids);
            }
            Event::Finished(info) => return Ok(Outcome { text, ids, info }),
        }
    }
    panic!("the stream ended without a final event");
}

/// Runs a conversation: each turn appends a user message to the transcript (which holds the
/// previous replies as returned) and sends it with the last handle.
pub fn converse(engine: &Engine, turns: &[&str], max_tokens: u32) -> Vec<Outcome> {
    let mut transcript: Vec<Message> = Vec::new();
    let mut handle = None;
    let mut out = Vec::new();
    for turn in turns {
        transcript.push(Message::new(Role::User, *turn));
        let o = run(
            engine,
            &caller(),
            request(transcript.clone(), handle.clone(), max_tokens),
        )
        .expect("turn succeeds");
        transcript.push(Message::new(Role::Assistant, o.text.clone()));
        handle = o.info.handle.clone();
        out.push(o);
    }
    out
}

/// A CPU backend whose steps can be paused (to hold the scheduler inside a step
/// deterministically while a test submits more requests) or made to panic.
pub struct GatedBackend {
    /// The real backend.
    pub inner: zerolayer_model::CpuBackend,
    /// Pause flag and its condition variable.
    pub gate: Arc<Gate>,
}

/// Shared control of a [`GatedBackend`].
#[derive(Default)]
pub struct Gate {
    /// `true`: the next step waits.
    paused: std::sync::Mutex<bool>,
    /// Signalled when `paused` changes.
    cv: std::sync::Condvar,
    /// Steps currently waiting at the gate.
    pub waiting: std::sync::atomic::AtomicUsize,
    /// Steps started.
    pub steps: std::sync::atomic::AtomicUsize,
    /// Panic in the next step.
    pub panic: std::sync::atomic::AtomicBool,
}

impl Gate {
    /// Pauses or resumes steps.
    pub fn set_paused(&self, p: bool) {
        *self.paused.lock().unwrap() = p;
        self.cv.notify_all();
    }

    /// Waits (bounded) until a step is held at the gate.
    pub fn wait_until_held(&self) {
        wait_for("a step to reach the gate", || {
            self.waiting.load(std::sync::atomic::Ordering::SeqCst) > 0
        });
    }
}

impl zerolayer_model::Backend for GatedBackend {
    fn config(&self) -> &zerolayer_model::ModelConfig {
        self.inner.config()
    }

    fn kv_config(&self) -> zerolayer_model::KvCacheConfig {
        self.inner.kv_config()
    }

    fn forward(
        &mut self,
        batch: &[zerolayer_model::SeqChunk<'_>],
        logits: &mut [f32],
    ) -> Result<(), zerolayer_model::BackendError> {
        self.enter();
        self.inner.forward(batch, logits)
    }

    fn forward_sample(
        &mut self,
        batch: &[zerolayer_model::SeqChunk<'_>],
        sampling: &[zerolayer_model::SampleInput<'_>],
        out: &mut [zerolayer_model::SampleOutcome],
    ) -> Result<(), zerolayer_model::BackendError> {
        self.enter();
        self.inner.forward_sample(batch, sampling, out)
    }
}

impl GatedBackend {
    /// Waits while paused; panics when asked to.
    fn enter(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        self.gate.steps.fetch_add(1, SeqCst);
        assert!(!self.gate.panic.load(SeqCst), "injected backend panic");
        let mut paused = self.gate.paused.lock().unwrap();
        if *paused {
            self.gate.waiting.fetch_add(1, SeqCst);
            while *paused {
                paused = self.gate.cv.wait(paused).unwrap();
            }
            self.gate.waiting.fetch_sub(1, SeqCst);
        }
    }
}

/// Starts an engine over a gated CPU backend.
pub fn start_gated(model: &Model, config: EngineConfig) -> (Engine, Arc<Gate>) {
    let gate = Arc::new(Gate::default());
    let inner = zerolayer_model::CpuBackend::new(
        Arc::clone(&model.weights),
        config.kv_cache_config(),
        config.threads,
    )
    .expect("backend");
    let backend = GatedBackend {
        inner,
        gate: Arc::clone(&gate),
    };
    let engine = Engine::start(
        Box::new(backend),
        Arc::clone(&model.tokenizer),
        model.name.clone(),
        keys(),
        SafetyConfig::none(),
        config,
    )
    .expect("engine starts");
    (engine, gate)
}

/// Polls `cond` every millisecond until it holds; panics after a generous timeout (60 s) so a
/// loaded machine never fails the test, but a hang does.
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
