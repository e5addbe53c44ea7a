//! Prometheus metrics of a serving process and the `/metrics` HTTP endpoint.
//!
//! Names follow `zerolayer_<thing>_<unit>`; histograms are in seconds. Every process
//! registers [`ServiceMetrics`] (what its gRPC edge sees) under a constant `service` label;
//! the engine process adds the engine's own counters through a collector.

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::{Router, http::StatusCode, response::IntoResponse, routing::get};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

/// Labels of per-RPC counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    /// `generate`, `generate_buffered`, `probe` or `validate`.
    pub rpc: &'static str,
    /// `ok` or the error reason (`CONTEXT_EVICTED`, …).
    pub outcome: &'static str,
}

/// Labels of prompt-token counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    /// `cached` (served from a slot) or `prefilled` (computed).
    pub source: &'static str,
}

/// Labels of per-RPC duration histograms.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcOnly {
    /// RPC name.
    pub rpc: &'static str,
}

/// What a serving process's gRPC edge measures.
#[derive(Debug)]
pub struct ServiceMetrics {
    /// Finished RPCs by name and outcome.
    pub requests: Family<RpcLabels, Counter>,
    /// Requests in flight.
    pub in_flight: Gauge,
    /// Time from request arrival to the first chunk with text, seconds.
    pub ttft: Histogram,
    /// Time between consecutive chunks of a stream, seconds.
    pub inter_token: Histogram,
    /// Whole RPC duration, seconds.
    pub duration: Family<RpcOnly, Histogram>,
    /// Prompt tokens by source.
    pub prompt_tokens: Family<TokenLabels, Counter>,
    /// Generated tokens.
    pub generated_tokens: Counter,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    // 100 µs … ~105 s in ×2 steps: covers a 1-token probe on dummy:tiny and a long
    // generation on a big model.
    exponential_buckets(1e-4, 2.0, 21)
}

impl ServiceMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Arc<Self> {
        let m = Self {
            requests: Family::default(),
            in_flight: Gauge::default(),
            ttft: Histogram::new(latency_buckets()),
            inter_token: Histogram::new(latency_buckets()),
            duration: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            prompt_tokens: Family::default(),
            generated_tokens: Counter::default(),
        };
        registry.register(
            "requests",
            "Finished RPCs by name and outcome",
            m.requests.clone(),
        );
        registry.register("requests_in_flight", "RPCs in flight", m.in_flight.clone());
        registry.register(
            "time_to_first_token_seconds",
            "Request arrival to first text chunk",
            m.ttft.clone(),
        );
        registry.register(
            "inter_token_seconds",
            "Spacing between consecutive chunks of a stream",
            m.inter_token.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Whole RPC duration",
            m.duration.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens by source",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "generated_tokens",
            "Generated tokens",
            m.generated_tokens.clone(),
        );
        Arc::new(m)
    }

    /// Counts one finished RPC.
    pub fn finished(&self, rpc: &'static str, outcome: &'static str, elapsed: Duration) {
        self.requests
            .get_or_create(&RpcLabels { rpc, outcome })
            .inc();
        self.duration
            .get_or_create(&RpcOnly { rpc })
            .observe(elapsed.as_secs_f64());
    }

    /// Counts the token usage of a finished generation.
    pub fn usage(&self, cached: u32, prefilled: u32, generated: u32) {
        self.prompt_tokens
            .get_or_create(&TokenLabels { source: "cached" })
            .inc_by(cached.into());
        self.prompt_tokens
            .get_or_create(&TokenLabels {
                source: "prefilled",
            })
            .inc_by(prefilled.into());
        self.generated_tokens.inc_by(generated.into());
    }
}

/// A registry with the `zerolayer_` prefix and a constant `service` label.
pub fn new_registry(service: &'static str) -> Registry {
    Registry::with_prefix_and_labels(
        "zerolayer",
        [(
            std::borrow::Cow::Borrowed("service"),
            std::borrow::Cow::Borrowed(service),
        )]
        .into_iter(),
    )
}

/// Renders a registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail; an encoding error would be a bug in a collector,
    // and an empty page is the honest answer then.
    if prometheus_client::encoding::text::encode(&mut out, registry).is_err() {
        out.clear();
    }
    out
}

/// Serves `GET /metrics` (Prometheus text) and `GET /healthz` (200 while `ready` is true,
/// 503 otherwise) until `shutdown` resolves.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    ready: Arc<AtomicBool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        render(&registry),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let ready = ready.load(Ordering::Relaxed);
                async move {
                    if ready {
                        (StatusCode::OK, "serving").into_response()
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "not serving").into_response()
                    }
                }
            }),
        );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendered_metrics_carry_prefix_units_and_service_label() {
        let mut registry = new_registry("front");
        let m = ServiceMetrics::register(&mut registry);
        m.finished("generate", "ok", Duration::from_millis(5));
        m.finished("generate", "RATE_LIMIT_EXCEEDED", Duration::from_millis(1));
        m.usage(10, 3, 7);
        m.ttft.observe(0.01);
        let text = render(&registry);
        assert!(
            text.contains(
                r#"zerolayer_requests_total{service="front",rpc="generate",outcome="ok"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains(r#"outcome="RATE_LIMIT_EXCEEDED""#), "{text}");
        assert!(
            text.contains(r#"zerolayer_prompt_tokens_total{service="front",source="cached"} 10"#)
        );
        assert!(text.contains("zerolayer_time_to_first_token_seconds_bucket"));
        assert!(text.contains("zerolayer_generated_tokens_total{service=\"front\"} 7"));
    }

    #[tokio::test]
    async fn the_http_endpoint_serves_metrics_and_readiness() {
        let mut registry = new_registry("test");
        let m = ServiceMetrics::register(&mut registry);
        m.generated_tokens.inc();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let ready = Arc::new(AtomicBool::new(false));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_metrics(
            listener,
            Arc::new(registry),
            ready.clone(),
            async {
                let _ = rx.await;
            },
        ));
        let get = |path: &'static str| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            s.write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .expect("write");
            let mut out = String::new();
            s.read_to_string(&mut out).await.expect("read");
            out
        };
        assert!(get("/healthz").await.starts_with("HTTP/1.1 503"));
        ready.store(true, Ordering::Relaxed);
        assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(
            get("/metrics")
                .await
                .contains("zerolayer_generated_tokens_total")
        );
        tx.send(()).expect("server alive");
        server.await.expect("join").expect("serve");
    }
}
