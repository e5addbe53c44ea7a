//! The zerolayer engine: where conversations live between turns (design §4–§5).
//!
//! # Layout
//! - [`api`]: the domain types the services convert protobuf to and from (requests, events,
//!   reasons); the contract with the service layer.
//! - [`engine`](mod@engine): [`Engine`] (a cloneable handle: a command sender to the scheduler
//!   thread plus shared metrics) and [`GenerationStream`].
//! - `request`: preparation on the caller's thread (validation, per-message tokenisation,
//!   message identities, prompt hash, handle precheck, prompt safety check).
//! - `scheduler`: the scheduler thread: admission (handle verification with the fast path,
//!   slot resolution, reuse/branch planning, preflight, block reservation with eviction),
//!   continuous batching with chunked prefill, streaming, handle renewal.
//! - [`kv`]: the paged [`kv::BlockPool`] and the slot map ([`kv::KvCache`]); allocation-free
//!   after start.
//! - `safety`, `text`: the in-decode safety mask; stop sequences and text hold-back.
//! - [`config`], [`error`], [`metrics`]: [`EngineConfig`], [`EngineError`], [`EngineMetrics`].
//!
//! # Invariants
//! - **Only the scheduler thread mutates the slot map, the block pool and the backend**; other
//!   threads send it commands.
//! - **Reuse never changes results**: KV rows of reused positions are exactly the rows a fresh
//!   prefill of the same token ids computes (the CPU kernels are batch- and chunk-invariant bit
//!   for bit), and a prefix is reused only after its token ids compared equal.
//! - **A request never waits on another request's slot indefinitely**: a busy conversation
//!   waits at most `session_busy_wait`, then gets `SESSION_BUSY`.
//! - **Memory is bounded**: the slot map and the KV pool are allocated at start; a request
//!   reserves every block it can need before it runs (no mid-generation overflow).

pub mod api;
pub mod config;
pub mod engine;
pub mod error;
pub mod kv;
pub mod metrics;
mod request;
mod safety;
mod scheduler;
mod text;

pub use api::{
    Caller, ErrorReason, Event, FinalInfo, FinishReason, GenerateRequest, Message, ReuseOutcome,
};
pub use config::{EngineConfig, SafetyConfig};
pub use engine::{Engine, GenerationStream};
pub use error::EngineError;
pub use metrics::EngineMetrics;
pub use request::{MAX_MESSAGES, MAX_STOP_BYTES, MAX_STOP_SEQUENCES};

/// Tokens generated when a request does not say.
pub const DEFAULT_MAX_TOKENS: u32 = 128;
