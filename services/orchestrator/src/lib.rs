//! The layered baseline: an orchestrator keeping transcripts in Redis.
