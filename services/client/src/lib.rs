//! Rust client library for the zerolayer.v1 API.
