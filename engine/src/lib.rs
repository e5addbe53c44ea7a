//! The zerolayer engine (work in progress: the domain API is fixed first).

pub mod api;

/// Tokens generated when a request does not say.
pub const DEFAULT_MAX_TOKENS: u32 = 128;
