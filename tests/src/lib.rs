//! Workspace integration tests: one conformance suite over every deployment mode.
