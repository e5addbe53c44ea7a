//! Load generation and side-by-side comparison of the deployment modes.
//!
//! # Layout
//! - [`launch`]: starts real deployments (collapsed, split, layered) as child processes.
//! - [`workload`]: what is sent — multi-turn chat, single-shot prompts, staged load — at which
//!   levels (closed-loop concurrency, open-loop arrival rates), and the prompt texts.
//! - [`chat`]: the requests, read chunk by chunk (TTFT, inter-token gaps).
//! - [`load`]: runs one level against one endpoint; one [`sample::Sample`] per request.
//! - [`compare`]: runs a workload against several endpoints interleaved in rounds, reads CPU
//!   and memory from /proc and counters from `/metrics`, and writes the report.
//! - [`report`], [`stats`], [`charts`]: figures per mode, ratios, Markdown, terminal table,
//!   SVG charts.
//! - [`prom`]: a minimal Prometheus text-format reader.

pub mod charts;
pub mod chat;
pub mod compare;
pub mod launch;
pub mod load;
pub mod prom;
pub mod report;
pub mod sample;
pub mod stats;
pub mod workload;
