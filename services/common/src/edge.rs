//! The gRPC edge of a serving process: authentication, admission, and the instrumentation
//! of every RPC (outcome counters, TTFT and inter-token histograms, token usage, rate-limit
//! settlement). Collapsed, front and orchestrator all use it, so the three modes measure
//! and limit identically.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use futures::{Stream, StreamExt};
use tonic::{Status, metadata::MetadataMap};
use zerolayer_proto::v1;

use crate::{
    error::ApiError,
    limits::{Admission, Limiter},
    metrics::ServiceMetrics,
    tenants::{TenantPolicy, Tenants},
};

/// Tokens reserved against the rate limit when a request does not set `max_tokens`.
pub const DEFAULT_RESERVE_TOKENS: u32 = zerolayer_engine::DEFAULT_MAX_TOKENS;

/// What the instrumentation needs to know about a stream item.
pub trait ChunkInfo {
    /// True when the item carries generated tokens (TTFT / inter-token are measured on these).
    fn carries_tokens(&self) -> bool;
    /// The usage of the final chunk; `None` for other chunks.
    fn final_usage(&self) -> Option<v1::Usage>;
}

impl ChunkInfo for v1::GenerateChunk {
    fn carries_tokens(&self) -> bool {
        !self.token_ids.is_empty()
    }

    fn final_usage(&self) -> Option<v1::Usage> {
        self.r#final.as_ref().map(|f| f.usage.unwrap_or_default())
    }
}

/// Authentication, limits and metrics of one serving process.
#[derive(Debug, Clone)]
pub struct Edge {
    /// API keys → tenants.
    pub tenants: Arc<Tenants>,
    /// Admission control.
    pub limiter: Arc<Limiter>,
    /// Metrics of this edge.
    pub metrics: Arc<ServiceMetrics>,
}

/// Counts one RPC in flight and records its outcome exactly once.
#[derive(Debug)]
struct RpcGuard {
    metrics: Arc<ServiceMetrics>,
    rpc: &'static str,
    started: Instant,
    done: bool,
}

impl RpcGuard {
    fn new(metrics: Arc<ServiceMetrics>, rpc: &'static str, started: Instant) -> Self {
        metrics.in_flight.inc();
        Self {
            metrics,
            rpc,
            started,
            done: false,
        }
    }

    fn finish(&mut self, outcome: &'static str) {
        if !self.done {
            self.done = true;
            self.metrics
                .finished(self.rpc, outcome, self.started.elapsed());
        }
    }
}

impl Drop for RpcGuard {
    fn drop(&mut self) {
        // Dropped before an outcome: the client went away (or the server is stopping).
        self.finish("CANCELLED");
        self.metrics.in_flight.dec();
    }
}

impl Edge {
    /// Authenticates a call: the tenant policy or an `UNAUTHENTICATED` status (counted).
    pub fn authenticate(
        &self,
        rpc: &'static str,
        started: Instant,
        metadata: &MetadataMap,
    ) -> Result<Arc<TenantPolicy>, Status> {
        self.tenants
            .authenticate(metadata)
            .map_err(|e| self.fail(rpc, started, e))
    }

    /// Admits a generation of `tenant` reserving its `max_tokens` (or the default).
    pub fn admit(
        &self,
        rpc: &'static str,
        started: Instant,
        tenant: &Arc<TenantPolicy>,
        max_tokens: Option<u32>,
    ) -> Result<Admission, Status> {
        self.limiter
            .admit(tenant, max_tokens.unwrap_or(DEFAULT_RESERVE_TOKENS))
            .map_err(|e| self.fail(rpc, started, e))
    }

    /// Records a failed RPC and converts the error into its status.
    pub fn fail(&self, rpc: &'static str, started: Instant, err: ApiError) -> Status {
        tracing::debug!(rpc, reason = %err.reason, message = %err.message, "request failed");
        self.metrics
            .finished(rpc, err.reason.as_str(), started.elapsed());
        err.into_status()
    }

    /// Records a successful unary RPC.
    pub fn succeed(&self, rpc: &'static str, started: Instant) {
        self.metrics.finished(rpc, "ok", started.elapsed());
    }

    /// Wraps a generation stream: measures TTFT and inter-token spacing, counts usage,
    /// settles the rate limit with the real cost at the final chunk, records the outcome,
    /// converts errors to statuses, and turns a stream that ends without its final chunk
    /// into an `INTERNAL` error (never a silently truncated stream).
    pub fn instrument<S, C>(
        &self,
        rpc: &'static str,
        started: Instant,
        admission: Admission,
        stream: S,
    ) -> impl Stream<Item = Result<C, Status>> + Send + 'static
    where
        S: Stream<Item = Result<C, ApiError>> + Send + Unpin + 'static,
        C: ChunkInfo + Send + 'static,
    {
        struct State<S> {
            stream: S,
            guard: RpcGuard,
            admission: Option<Admission>,
            last_token_at: Option<Instant>,
            finished: bool,
        }
        let state = State {
            stream,
            guard: RpcGuard::new(self.metrics.clone(), rpc, started),
            admission: Some(admission),
            last_token_at: None,
            finished: false,
        };
        let metrics = self.metrics.clone();
        futures::stream::unfold(state, move |mut st| {
            let metrics = metrics.clone();
            async move {
                if st.finished {
                    return None;
                }
                match st.stream.next().await {
                    Some(Ok(chunk)) => {
                        let now = Instant::now();
                        if chunk.carries_tokens() {
                            match st.last_token_at {
                                None => metrics.ttft.observe(secs(now - st.guard.started)),
                                Some(prev) => metrics.inter_token.observe(secs(now - prev)),
                            }
                            st.last_token_at = Some(now);
                        }
                        if let Some(usage) = chunk.final_usage() {
                            metrics.usage(
                                usage.cached_prompt_tokens,
                                usage.prefilled_prompt_tokens,
                                usage.generated_tokens,
                            );
                            if let Some(a) = st.admission.take() {
                                a.settle(
                                    usage
                                        .prefilled_prompt_tokens
                                        .saturating_add(usage.generated_tokens),
                                );
                            }
                            st.guard.finish("ok");
                            st.finished = true;
                        }
                        Some((Ok(chunk), st))
                    }
                    Some(Err(err)) => {
                        tracing::debug!(rpc = st.guard.rpc, reason = %err.reason, message = %err.message, "stream failed");
                        st.guard.finish(err.reason.as_str());
                        st.finished = true;
                        Some((Err(err.into_status()), st))
                    }
                    None => {
                        let err = ApiError::internal("stream ended without a final chunk");
                        st.guard.finish(err.reason.as_str());
                        st.finished = true;
                        Some((Err(err.into_status()), st))
                    }
                }
            }
        })
    }
}

/// Waits for a stream's first item so that an error found before generation starts ends
/// the call with an error status (a trailers-only response) instead of a stream whose first
/// message is an error. Returns the stream with the first item put back.
pub async fn first_or_error<S, C>(
    mut stream: S,
) -> Result<impl Stream<Item = Result<C, ApiError>> + Send + Unpin + 'static, ApiError>
where
    S: Stream<Item = Result<C, ApiError>> + Send + Unpin + 'static,
    C: Send + 'static,
{
    let first = match stream.next().await {
        Some(Ok(chunk)) => Some(Ok(chunk)),
        Some(Err(e)) => return Err(e),
        None => None,
    };
    Ok(futures::stream::iter(first).chain(stream))
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{new_registry, render};
    use zerolayer_engine::api::ErrorReason;

    fn edge() -> (Edge, prometheus_client::registry::Registry) {
        let mut registry = new_registry("test");
        let metrics = ServiceMetrics::register(&mut registry);
        let edge = Edge {
            tenants: Arc::new(Tenants::dev_mode()),
            limiter: Limiter::new(10),
            metrics,
        };
        (edge, registry)
    }

    fn chunk(tokens: &[u32], final_: bool) -> v1::GenerateChunk {
        v1::GenerateChunk {
            token_ids: tokens.to_vec(),
            r#final: final_.then(|| v1::FinalInfo {
                usage: Some(v1::Usage {
                    prefilled_prompt_tokens: 3,
                    cached_prompt_tokens: 5,
                    generated_tokens: 2,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_complete_stream_is_counted_ok_with_usage_and_ttft() {
        let (edge, registry) = edge();
        let tenant = edge
            .authenticate("generate", Instant::now(), &MetadataMap::new())
            .expect("dev");
        let admission = edge
            .admit("generate", Instant::now(), &tenant, Some(4))
            .expect("admit");
        let items: Vec<Result<v1::GenerateChunk, ApiError>> = vec![
            Ok(chunk(&[1], false)),
            Ok(chunk(&[2], false)),
            Ok(chunk(&[], true)),
        ];
        let out: Vec<_> = edge
            .instrument(
                "generate",
                Instant::now(),
                admission,
                futures::stream::iter(items),
            )
            .collect()
            .await;
        assert_eq!(out.len(), 3);
        assert!(out.iter().all(Result::is_ok));
        let text = render(&registry);
        assert!(text.contains(r#"rpc="generate",outcome="ok"} 1"#), "{text}");
        assert!(text.contains(r#"source="cached"} 5"#), "{text}");
        assert!(text.contains("zerolayer_time_to_first_token_seconds_count{service=\"test\"} 1"));
        assert!(text.contains("zerolayer_inter_token_seconds_count{service=\"test\"} 1"));
        assert_eq!(edge.limiter.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_stream_without_final_chunk_ends_with_internal() {
        let (edge, registry) = edge();
        let tenant = edge
            .authenticate("generate", Instant::now(), &MetadataMap::new())
            .expect("dev");
        let admission = edge
            .admit("generate", Instant::now(), &tenant, None)
            .expect("admit");
        let items: Vec<Result<v1::GenerateChunk, ApiError>> = vec![Ok(chunk(&[1], false))];
        let out: Vec<_> = edge
            .instrument(
                "generate",
                Instant::now(),
                admission,
                futures::stream::iter(items),
            )
            .collect()
            .await;
        let status = out.last().expect("two items").as_ref().expect_err("error");
        assert_eq!(crate::error::reason_of(status), ErrorReason::Internal);
        assert!(render(&registry).contains(r#"outcome="INTERNAL"} 1"#));
    }

    #[tokio::test]
    async fn a_dropped_stream_counts_as_cancelled_and_frees_its_admission() {
        let (edge, registry) = edge();
        let tenant = edge
            .authenticate("generate", Instant::now(), &MetadataMap::new())
            .expect("dev");
        let admission = edge
            .admit("generate", Instant::now(), &tenant, None)
            .expect("admit");
        let stream = edge.instrument(
            "generate",
            Instant::now(),
            admission,
            futures::stream::pending::<Result<v1::GenerateChunk, ApiError>>(),
        );
        drop(stream);
        assert!(render(&registry).contains(r#"outcome="CANCELLED"} 1"#));
        assert_eq!(edge.limiter.in_flight(), 0);
    }
}
