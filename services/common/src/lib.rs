//! Service plumbing shared by every zerolayer process that speaks gRPC.
//!
//! # Layout
//! - [`error`]: the one mapping between error reasons and gRPC statuses.
//! - [`convert`]: protobuf ↔ engine domain types, with request validation.
//! - [`edge`]: authentication, admission and instrumentation of every RPC.
//! - [`tenants`]: API keys → tenants and their policies (limits, forbidden strings).
//! - [`limits`]: per-tenant token bucket and concurrency limit, load shedding.
//! - [`shaping`]: per-request stream shaping (`stream_options`).
//! - [`metrics`]: Prometheus metrics and the `/metrics` endpoint.
//! - [`server`]: bind, health, reflection, ready line, graceful shutdown.
//! - [`wire`]: frame kinds and payloads between front and engine (split mode).

pub mod convert;
pub mod edge;
pub mod error;
pub mod limits;
pub mod metrics;
pub mod server;
pub mod shaping;
pub mod tenants;
pub mod wire;

pub use error::ApiError;
