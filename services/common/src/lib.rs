//! Shared service plumbing: proto conversions, error mapping, auth, limits, metrics, stream shaping.
