//! The engine process: serves the engine over shared memory (split) or gRPC (collapsed).
