//! The engine process: serves the in-process engine over gRPC itself (collapsed mode) or over
//! shared memory to a front (split mode, the engine half).
//!
//! # Layout
//! - [`runtime`]: model + backend + engine start-up, KV sizing, Prometheus rendering of the
//!   engine's counters.
//! - [`host`]: the engine side of a request whatever carried it: protobuf → validated domain
//!   request → engine → shaped protobuf chunks.
//! - [`collapsed`]: `zerolayer.v1.Inference` served by the engine process.
//! - [`split`]: the shared-memory server of split mode.
//! - [`run_collapsed`], [`run_engine`]: the two process entry points.

pub mod collapsed;
pub mod host;
pub mod runtime;
pub mod split;

use std::{future::Future, time::Duration};

use zerolayer_service::{
    edge::Edge,
    limits::Limiter,
    metrics::{ServiceMetrics, new_registry},
    server::{self, Lifecycle, ServeConfig},
};
use zerolayer_shm::ShmConfig;

use crate::{collapsed::CollapsedService, host::EngineHost, runtime::EngineSetup};

/// Configuration of an engine process.
#[derive(Debug, Clone)]
pub struct EngineProcessConfig {
    /// Model, backend, engine settings, keys, tenants.
    pub setup: EngineSetup,
    /// gRPC (inference in collapsed mode; health only in split mode) and metrics addresses.
    pub serve: ServeConfig,
    /// Requests in flight before shedding load (collapsed mode's edge).
    pub max_in_flight: usize,
}

/// Probes the engine until it answers, then reports SERVING.
async fn become_ready(host: EngineHost, lifecycle: Lifecycle) {
    loop {
        match host.probe().await {
            Ok(_) => {
                lifecycle.set_serving(true).await;
                return;
            }
            Err(e) => {
                tracing::warn!(cause = %e, "probe failed; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Collapsed mode: one process, the engine serves gRPC itself.
pub async fn run_collapsed(
    config: EngineProcessConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut registry = new_registry("collapsed");
    let metrics = ServiceMetrics::register(&mut registry);
    let bound = server::bind(config.serve.clone()).await?;
    let setup = config.setup.clone();
    let (engine, model) =
        tokio::task::spawn_blocking(move || runtime::start_engine(&setup)).await??;
    runtime::register_engine_metrics(&mut registry, engine.metrics());
    let host = EngineHost::new(engine.clone(), model, "collapsed");
    let service = CollapsedService {
        host: host.clone(),
        edge: Edge {
            tenants: config.setup.tenants.clone(),
            limiter: Limiter::new(config.max_in_flight),
            metrics,
        },
    };
    let ready = tokio::spawn(become_ready(host, bound.lifecycle()));
    let result = bound
        .serve(
            |routes| {
                routes.add_service(
                    zerolayer_proto::v1::inference_server::InferenceServer::new(service)
                        .max_decoding_message_size(
                            zerolayer_service::convert::MAX_CONTENT_BYTES * 4,
                        ),
                )
            },
            registry,
            shutdown,
        )
        .await;
    ready.abort();
    engine.shutdown();
    result.map_err(Into::into)
}

/// Split mode, engine half: serves the engine over shared memory; its gRPC port carries health
/// and reflection only (for orchestration health checks).
pub async fn run_engine(
    config: EngineProcessConfig,
    shm: ShmConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut registry = new_registry("engine");
    let bound = server::bind(config.serve.clone()).await?;
    let setup = config.setup.clone();
    let (engine, model) =
        tokio::task::spawn_blocking(move || runtime::start_engine(&setup)).await??;
    runtime::register_engine_metrics(&mut registry, engine.metrics());
    let host = EngineHost::new(engine.clone(), model, "split");
    let mut split =
        split::SplitServer::start(host.clone(), shm, tokio::runtime::Handle::current())?;
    let ready = tokio::spawn(become_ready(host, bound.lifecycle()));
    let result = bound.serve(|routes| routes, registry, shutdown).await;
    ready.abort();
    split.shutdown();
    engine.shutdown();
    result.map_err(Into::into)
}
