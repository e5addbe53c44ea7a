//! The engine: paged KV pool, slot map, continuous-batching scheduler, context handles.
