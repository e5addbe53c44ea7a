//! Service plumbing shared by every zerolayer process that speaks gRPC.
//!
//! # Layout
//! - [`error`]: the one mapping between error reasons and gRPC statuses.
//! - [`convert`]: protobuf ↔ engine domain types, with request validation.
//! - [`tenants`]: API keys → tenants and their policies (limits, forbidden strings).
//! - [`limits`]: per-tenant token bucket and concurrency limit, load shedding.
//! - [`shaping`]: per-request stream shaping (`stream_options`).
//! - [`metrics`]: Prometheus metrics and the `/metrics` endpoint.
//! - [`server`]: bind, health, reflection, ready line, graceful shutdown.

pub mod convert;
pub mod error;
pub mod limits;
pub mod metrics;
pub mod server;
pub mod shaping;
pub mod tenants;

pub use error::ApiError;
