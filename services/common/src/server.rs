//! Serving lifecycle shared by every gRPC process: bind (port 0 friendly), health and
//! reflection, a machine-readable ready line, Prometheus endpoint, graceful shutdown.
//!
//! Lines printed on stdout (tests and scripts wait for them instead of sleeping):
//! - `zerolayer listening service=<name> grpc=<addr> metrics=<addr|none>` once bound;
//! - `zerolayer ready service=<name>` once the process reports SERVING (model loaded and a
//!   probe passed);
//! - `zerolayer stopped service=<name>` after draining.

use std::{
    future::Future,
    io::Write as _,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tonic::service::Routes;
use tonic_health::{ServingStatus, server::HealthReporter};

/// gRPC name of the inference service (health status key).
pub const INFERENCE_SERVICE: &str = "zerolayer.v1.Inference";
/// Default time in-flight streams get to finish after SIGTERM.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Serving status of a process: gRPC health (overall and per service) and the `/healthz`
/// flag, changed together.
#[derive(Debug, Clone)]
pub struct Lifecycle {
    service: &'static str,
    health: HealthReporter,
    ready: Arc<AtomicBool>,
}

impl Lifecycle {
    /// Whether the process serves now.
    pub fn is_serving(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Reports SERVING (prints the ready line the first time) or NOT_SERVING.
    pub async fn set_serving(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.health.set_service_status("", status).await;
        self.health
            .set_service_status(INFERENCE_SERVICE, status)
            .await;
        let was = self.ready.swap(serving, Ordering::Relaxed);
        if serving && !was {
            print_line(&format!("zerolayer ready service={}", self.service));
            tracing::info!(service = self.service, "serving");
        } else if !serving && was {
            tracing::info!(service = self.service, "not serving");
        }
    }
}

fn print_line(line: &str) {
    let mut out = std::io::stdout().lock();
    // Losing stdout (a closed pipe) must not stop the server; the line is informational
    // for whoever watches.
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Where a process listens.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Service name for logs, metrics and the ready line (`collapsed`, `front`, …).
    pub service: &'static str,
    /// gRPC listen address (port 0 picks a free port).
    pub grpc_addr: SocketAddr,
    /// Prometheus listen address; `None` disables the endpoint.
    pub metrics_addr: Option<SocketAddr>,
    /// Time in-flight streams get after SIGTERM.
    pub drain_timeout: Duration,
}

/// A process that has bound its listeners but does not serve yet.
#[derive(Debug)]
pub struct Bound {
    config: ServeConfig,
    grpc: TcpListener,
    metrics: Option<TcpListener>,
    /// Actual gRPC address.
    pub grpc_addr: SocketAddr,
    /// Actual metrics address.
    pub metrics_addr: Option<SocketAddr>,
    lifecycle: Lifecycle,
    /// Health service, ready to be merged with the caller's services.
    base_routes: Routes,
}

/// Binds the listeners, prints the `listening` line and starts as NOT_SERVING.
pub async fn bind(config: ServeConfig) -> std::io::Result<Bound> {
    let grpc = TcpListener::bind(config.grpc_addr).await?;
    let grpc_addr = grpc.local_addr()?;
    let metrics = match config.metrics_addr {
        Some(addr) => Some(TcpListener::bind(addr).await?),
        None => None,
    };
    let metrics_addr = metrics.as_ref().map(TcpListener::local_addr).transpose()?;
    let (health, health_service) = tonic_health::server::health_reporter();
    let lifecycle = Lifecycle {
        service: config.service,
        health,
        ready: Arc::new(AtomicBool::new(false)),
    };
    lifecycle
        .health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    lifecycle
        .health
        .set_service_status(INFERENCE_SERVICE, ServingStatus::NotServing)
        .await;
    print_line(&format!(
        "zerolayer listening service={} grpc={grpc_addr} metrics={}",
        config.service,
        metrics_addr.map_or_else(|| "none".to_owned(), |a| a.to_string())
    ));
    tracing::info!(service = config.service, %grpc_addr, ?metrics_addr, "listening");
    let base_routes = Routes::new(health_service);
    Ok(Bound {
        config,
        grpc,
        metrics,
        grpc_addr,
        metrics_addr,
        lifecycle,
        base_routes,
    })
}

impl Bound {
    /// The lifecycle handle (to report SERVING once ready).
    pub fn lifecycle(&self) -> Lifecycle {
        self.lifecycle.clone()
    }

    /// Serves the services `add_services` adds, plus health and reflection, until
    /// `shutdown` resolves (typically [`termination_signal`]); then reports NOT_SERVING,
    /// stops accepting and drains in-flight streams for up to the drain timeout.
    pub async fn serve(
        self,
        add_services: impl FnOnce(Routes) -> Routes,
        registry: Registry,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), tonic::transport::Error> {
        let reflection_v1 = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(zerolayer_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .map_err(|e| tracing::error!(cause = %e, "reflection disabled"))
            .ok();
        let reflection_v1alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(zerolayer_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1alpha()
            .map_err(|e| tracing::error!(cause = %e, "reflection disabled"))
            .ok();
        let mut routes = add_services(self.base_routes);
        if let Some(r) = reflection_v1 {
            routes = routes.add_service(r);
        }
        if let Some(r) = reflection_v1alpha {
            routes = routes.add_service(r);
        }

        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let metrics_task = self.metrics.map(|listener| {
            let mut rx = stop_rx.clone();
            tokio::spawn(crate::metrics::serve_metrics(
                listener,
                Arc::new(registry),
                self.lifecycle.ready.clone(),
                async move {
                    let _ = rx.wait_for(|stop| *stop).await;
                },
            ))
        });
        let mut grpc_stop = stop_rx.clone();
        // TCP_NODELAY on every accepted connection: gRPC streams write one small frame per
        // chunk, and Nagle's algorithm would hold each one back for the peer's delayed ACK
        // (~40 ms on Linux) — every stream stalled after its first chunk before this.
        let incoming =
            tonic::transport::server::TcpIncoming::from(self.grpc).with_nodelay(Some(true));
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_routes(routes)
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = grpc_stop.wait_for(|stop| *stop).await;
                }),
        );

        shutdown.await;
        tracing::info!(
            service = self.config.service,
            "shutting down: draining in-flight streams"
        );
        self.lifecycle.set_serving(false).await;
        let _ = stop_tx.send(true);
        let result = match tokio::time::timeout(self.config.drain_timeout, server).await {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => {
                tracing::error!(cause = %join, "gRPC server task failed");
                Ok(())
            }
            Err(_) => {
                tracing::warn!(
                    timeout_s = self.config.drain_timeout.as_secs_f64(),
                    "drain timeout: remaining streams are cut"
                );
                Ok(())
            }
        };
        if let Some(task) = metrics_task {
            task.abort();
        }
        print_line(&format!(
            "zerolayer stopped service={}",
            self.config.service
        ));
        result
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C).
pub async fn termination_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM received"),
                    _ = int.recv() => tracing::info!("SIGINT received"),
                }
            }
            _ => {
                tracing::error!("cannot install signal handlers; Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
