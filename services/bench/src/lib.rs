//! Load generation and side-by-side comparison of the deployment modes.
//!
//! # Layout
//! - [`launch`]: starts real deployments (collapsed, split, layered) as child processes.

pub mod launch;
