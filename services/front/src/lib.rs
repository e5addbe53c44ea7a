//! The thin gRPC front of split mode: auth, limits, forwarding over shared memory.
