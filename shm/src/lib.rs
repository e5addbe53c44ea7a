//! Shared-memory channel between the front and the engine.
