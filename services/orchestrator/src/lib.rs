//! The layered baseline: the orchestrator tier zerolayer removes, built honestly so that
//! benchmarks compare like with like.
//!
//! Per request it authenticates and rate-limits (the same [`Edge`] as every mode), verifies
//! the conversation handle, **fetches the transcript from Redis and deserialises it**,
//! appends the new turn, **sends the whole prompt over gRPC/TCP** to an engine running with
//! reuse disabled (which prefills everything again), relays the stream, and **writes the
//! updated transcript back to Redis** before the final chunk leaves. Connections are pooled
//! (multiplexed Redis connections, one HTTP/2 channel to the engine); there are no
//! artificial delays.
//!
//! Handles: the orchestrator issues the same signed handles as the engine (session id =
//! conversation id, KV offset and epoch 0) so the client contract and its error cases are
//! identical across modes. It has no slot, so every handle takes the full Ed25519 verify.
//!
//! # Layout
//! - [`OrchestratorConfig`], [`run`]: start-up and serving.
//! - `Orchestrator`: the `zerolayer.v1.Inference` implementation.
//! - `RedisPool`: round-robin over multiplexed connections; transcripts as JSON.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use futures::Stream;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status};
use zerolayer_client::{Client, ClientConfig, ClientError};
use zerolayer_engine::api::ErrorReason;
use zerolayer_handle::{Claims, KeyRing, PromptHash, TenantTag, random_session_id};
use zerolayer_proto::v1::{self, inference_server::Inference};
use zerolayer_service::{
    ApiError, convert,
    edge::Edge,
    error::parse_reason,
    limits::Limiter,
    metrics::{ServiceMetrics, new_registry},
    server::{self, ServeConfig},
    tenants::{TenantPolicy, Tenants},
};

/// Default number of multiplexed Redis connections (enough to keep one slow reply from
/// stalling the others on a 2-core machine).
pub const DEFAULT_REDIS_CONNECTIONS: usize = 4;

/// Configuration of the orchestrator process.
#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    /// Listen addresses and drain timeout.
    pub serve: ServeConfig,
    /// Redis URL, e.g. `redis://127.0.0.1:6379`.
    pub redis_url: String,
    /// Multiplexed Redis connections.
    pub redis_connections: usize,
    /// Engine gRPC URL (an engine started with reuse disabled).
    pub engine_url: String,
    /// API key for the engine, if it requires one.
    pub engine_api_key: Option<String>,
    /// Keys signing the conversation handles.
    pub keys: Arc<KeyRing>,
    /// Tenants and their limits.
    pub tenants: Arc<Tenants>,
    /// How long transcripts and handles live.
    pub ttl: Duration,
    /// Requests in flight before shedding load.
    pub max_in_flight: usize,
}

/// One stored message (the transcript in Redis is a JSON array of these).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct StoredMessage {
    role: i32,
    content: String,
}

impl From<&v1::Message> for StoredMessage {
    fn from(m: &v1::Message) -> Self {
        Self {
            role: m.role,
            content: m.content.clone(),
        }
    }
}

impl From<StoredMessage> for v1::Message {
    fn from(m: StoredMessage) -> Self {
        Self {
            role: m.role,
            content: m.content,
        }
    }
}

/// Round-robin over multiplexed Redis connections.
#[derive(Clone)]
struct RedisPool {
    connections: Arc<Vec<redis::aio::ConnectionManager>>,
    next: Arc<AtomicUsize>,
}

impl RedisPool {
    async fn connect(url: &str, n: usize) -> redis::RedisResult<Self> {
        let client = redis::Client::open(url)?;
        let mut connections = Vec::with_capacity(n.max(1));
        for _ in 0..n.max(1) {
            connections.push(client.get_connection_manager().await?);
        }
        Ok(Self {
            connections: Arc::new(connections),
            next: Arc::new(AtomicUsize::new(0)),
        })
    }

    fn conn(&self) -> redis::aio::ConnectionManager {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        self.connections[i].clone()
    }
}

/// Labels of Redis latency.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

/// Labels of handle verification outcomes.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerifyLabels {
    outcome: &'static str,
}

/// Metrics only the orchestrator has.
#[derive(Debug, Clone)]
struct OrchestratorMetrics {
    redis_seconds: Family<OpLabels, Histogram>,
    handle_verify: Family<VerifyLabels, Counter>,
}

impl OrchestratorMetrics {
    fn register(registry: &mut Registry) -> Self {
        let m = Self {
            redis_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(2e-5, 2.0, 18))
            }),
            handle_verify: Family::default(),
        };
        registry.register(
            "redis_seconds",
            "Redis round trips by operation",
            m.redis_seconds.clone(),
        );
        registry.register(
            "handle_verify",
            "Handle verifications by outcome (full_verify or the rejection reason)",
            m.handle_verify.clone(),
        );
        m
    }
}

/// The orchestrator service.
#[derive(Clone)]
struct Orchestrator {
    edge: Edge,
    redis: RedisPool,
    engine: Client,
    /// Credentials for calls without a caller (readiness probes): the configured engine key.
    engine_auth: Option<tonic::metadata::AsciiMetadataValue>,
    keys: Arc<KeyRing>,
    ttl: Duration,
    metrics: OrchestratorMetrics,
}

/// A request made ready for the engine.
struct Prepared {
    /// Redis key of the conversation.
    key: String,
    /// Session id (in the handle).
    session_id: u64,
    /// Prompt hash bound into the handle.
    prompt_hash: PromptHash,
    /// Tenant tag bound into the handle.
    tenant: TenantTag,
    /// The full transcript sent to the engine (the new turn included).
    transcript: Vec<v1::Message>,
    /// What goes to the engine.
    engine_request: v1::GenerateRequest,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn from_client_error(e: ClientError) -> ApiError {
    ApiError {
        reason: parse_reason(e.reason.short_name()).unwrap_or(ErrorReason::Internal),
        message: e.message,
        retry_after: e.retry_after,
    }
}

fn redis_error(op: &str, e: &redis::RedisError) -> ApiError {
    tracing::error!(op, cause = %e, "redis failed");
    ApiError::new(
        ErrorReason::Internal,
        format!("transcript store unavailable ({op})"),
    )
}

fn conversation_key(tenant: &str, session_id: u64) -> String {
    format!("zerolayer:conv:{tenant}:{session_id:016x}")
}

fn system_and_first_user(messages: &[v1::Message]) -> (&str, &str) {
    let system = messages
        .first()
        .filter(|m| m.role == v1::Role::System as i32)
        .map_or("", |m| m.content.as_str());
    let first_user = messages
        .iter()
        .find(|m| m.role == v1::Role::User as i32)
        .map_or("", |m| m.content.as_str());
    (system, first_user)
}

impl Orchestrator {
    /// Verifies the handle, loads the transcript and builds the engine's request.
    async fn prepare(
        &self,
        tenant: &TenantPolicy,
        req: &v1::GenerateRequest,
    ) -> Result<Prepared, ApiError> {
        let tag = TenantTag::for_tenant(&tenant.name);
        let session = if req.context_handle.is_empty() {
            None
        } else {
            let verified = self
                .keys
                .precheck(&req.context_handle, &tag, now_unix())
                .and_then(|u| u.authenticate(&self.keys, None));
            match verified {
                Ok((v, _)) => {
                    self.metrics
                        .handle_verify
                        .get_or_create(&VerifyLabels {
                            outcome: "full_verify",
                        })
                        .inc();
                    Some(v.claims().session_id)
                }
                Err(e) => {
                    self.metrics
                        .handle_verify
                        .get_or_create(&VerifyLabels {
                            outcome: e.reason(),
                        })
                        .inc();
                    let reason = match e {
                        zerolayer_handle::HandleError::Expired { .. } => ErrorReason::HandleExpired,
                        zerolayer_handle::HandleError::TenantMismatch => {
                            ErrorReason::TenantMismatch
                        }
                        _ => ErrorReason::InvalidHandle,
                    };
                    return Err(ApiError::new(reason, e.to_string()));
                }
            }
        };
        let session_id = match session {
            Some(id) => id,
            None => random_session_id().map_err(|e| ApiError::internal(e.to_string()))?,
        };
        let key = conversation_key(&tenant.name, session_id);

        // The old architecture's per-request cost: fetch and deserialise the transcript.
        let stored: Option<Vec<StoredMessage>> = if session.is_some() {
            let t = Instant::now();
            let raw: Option<String> = redis::AsyncCommands::get(&mut self.redis.conn(), &key)
                .await
                .map_err(|e| redis_error("get", &e))?;
            self.metrics
                .redis_seconds
                .get_or_create(&OpLabels { op: "get" })
                .observe(t.elapsed().as_secs_f64());
            raw.map(|s| serde_json::from_str(&s))
                .transpose()
                .map_err(|e| ApiError::internal(format!("corrupt transcript in store: {e}")))?
        } else {
            None
        };

        let transcript: Vec<v1::Message> = match (stored, req.delta) {
            (Some(stored), true) => {
                let mut t: Vec<v1::Message> = stored.into_iter().map(Into::into).collect();
                t.extend(req.messages.iter().cloned());
                t
            }
            (None, true) => {
                return Err(ApiError::new(
                    ErrorReason::ContextEvicted,
                    "conversation not found in the transcript store; resend the full transcript",
                ));
            }
            (Some(stored), false) => {
                let extends = stored.len() <= req.messages.len()
                    && stored
                        .iter()
                        .zip(&req.messages)
                        .all(|(s, m)| *s == StoredMessage::from(m));
                if extends {
                    let mut t: Vec<v1::Message> = stored.into_iter().map(Into::into).collect();
                    let known = t.len();
                    t.extend(req.messages[known..].iter().cloned());
                    t
                } else {
                    // A branch or an edited history: the client's transcript wins.
                    req.messages.clone()
                }
            }
            (None, false) => req.messages.clone(),
        };
        let (system, first_user) = system_and_first_user(&transcript);
        let prompt_hash = PromptHash::compute(&tenant.name, system, first_user);
        let engine_request = v1::GenerateRequest {
            messages: transcript.clone(),
            context_handle: Vec::new(),
            delta: false,
            sampling: req.sampling.clone(),
            stream_options: req.stream_options,
            truncation: req.truncation,
            request_id: req.request_id.clone(),
        };
        Ok(Prepared {
            key,
            session_id,
            prompt_hash,
            tenant: tag,
            transcript,
            engine_request,
        })
    }

    /// Stores the transcript with the reply and issues the conversation's handle.
    async fn commit(&self, prepared: &Prepared, reply: &str) -> Result<Vec<u8>, ApiError> {
        let mut stored: Vec<StoredMessage> = prepared.transcript.iter().map(Into::into).collect();
        stored.push(StoredMessage {
            role: v1::Role::Assistant as i32,
            content: reply.to_owned(),
        });
        let json = serde_json::to_string(&stored).map_err(|e| ApiError::internal(e.to_string()))?;
        let t = Instant::now();
        let _: () = redis::AsyncCommands::set_ex(
            &mut self.redis.conn(),
            &prepared.key,
            json,
            self.ttl.as_secs().max(1),
        )
        .await
        .map_err(|e| redis_error("set", &e))?;
        self.metrics
            .redis_seconds
            .get_or_create(&OpLabels { op: "set" })
            .observe(t.elapsed().as_secs_f64());
        let handle = self.keys.issue(Claims {
            session_id: prepared.session_id,
            tenant: prepared.tenant,
            prompt_hash: prepared.prompt_hash,
            kv_offset: 0,
            epoch: 0,
            expires_at: now_unix() + self.ttl.as_secs(),
        });
        Ok(handle.as_bytes().to_vec())
    }

    /// The engine client for a caller: the caller's own credentials are forwarded, so the
    /// engine applies that tenant's policy (safety strings, limits) too.
    fn engine_for(&self, metadata: &tonic::metadata::MetadataMap) -> Client {
        let auth = metadata
            .get("authorization")
            .cloned()
            .or_else(|| self.engine_auth.clone());
        self.engine.clone().with_authorization(auth)
    }

    /// Runs one generation: prepare, call the engine, relay, commit at the final chunk.
    async fn stream(
        &self,
        engine: &Client,
        tenant: &TenantPolicy,
        req: v1::GenerateRequest,
    ) -> Result<
        impl Stream<Item = Result<v1::GenerateChunk, ApiError>> + Send + Unpin + 'static,
        ApiError,
    > {
        let prepared = self.prepare(tenant, &req).await?;
        let upstream = engine
            .generate(prepared.engine_request.clone())
            .await
            .map_err(from_client_error)?;
        let this = self.clone();
        let state = (upstream, prepared, String::new(), this, false);
        Ok(Box::pin(futures::stream::unfold(
            state,
            |(mut up, prepared, mut text, this, done)| async move {
                if done {
                    return None;
                }
                match up.next().await? {
                    Err(e) => Some((Err(from_client_error(e)), (up, prepared, text, this, true))),
                    Ok(mut chunk) => {
                        text.push_str(&chunk.text);
                        if let Some(f) = chunk.r#final.as_mut() {
                            match this.commit(&prepared, &text).await {
                                Ok(handle) => {
                                    f.context_handle = handle;
                                    f.session_id = prepared.session_id;
                                    f.reuse = v1::ReuseOutcome::Disabled as i32;
                                }
                                Err(e) => return Some((Err(e), (up, prepared, text, this, true))),
                            }
                            let done = true;
                            return Some((Ok(chunk), (up, prepared, text, this, done)));
                        }
                        Some((Ok(chunk), (up, prepared, text, this, false)))
                    }
                }
            },
        )))
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateChunk, Status>> + Send + 'static>>;

impl Orchestrator {
    /// Authenticates, validates and admits a generation, then starts it.
    async fn start(
        &self,
        rpc: &'static str,
        request: Request<v1::GenerateRequest>,
    ) -> Result<ChunkStream, Status> {
        let started = Instant::now();
        let tenant = self.edge.authenticate(rpc, started, request.metadata())?;
        let engine = self.engine_for(request.metadata());
        let mut req = request.into_inner();
        if rpc == "generate_buffered" {
            req.stream_options = None;
        }
        let max_tokens = convert::generate_request(req.clone())
            .map_err(|e| self.edge.fail(rpc, started, e))?
            .sampling
            .max_tokens;
        let admission = self.edge.admit(rpc, started, &tenant, max_tokens)?;
        let stream = self
            .stream(&engine, &tenant, req)
            .await
            .map_err(|e| self.edge.fail(rpc, started, e))?;
        Ok(Box::pin(
            self.edge.instrument(rpc, started, admission, stream),
        ))
    }
}

#[tonic::async_trait]
impl Inference for Orchestrator {
    type GenerateStream = ChunkStream;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        self.start("generate", request).await.map(Response::new)
    }

    async fn generate_buffered(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<v1::GenerateBufferedResponse>, Status> {
        let stream = self.start("generate_buffered", request).await?;
        convert::collect_buffered(stream).await.map(Response::new)
    }

    async fn probe(
        &self,
        request: Request<v1::ProbeRequest>,
    ) -> Result<Response<v1::ProbeResponse>, Status> {
        const RPC: &str = "probe";
        let started = Instant::now();
        self.edge.authenticate(RPC, started, request.metadata())?;
        let engine = self.engine_for(request.metadata());
        let ping: Result<String, _> = redis::cmd("PING").query_async(&mut self.redis.conn()).await;
        ping.map_err(|e| self.edge.fail(RPC, started, redis_error("ping", &e)))?;
        let mut resp = engine
            .probe()
            .await
            .map_err(|e| self.edge.fail(RPC, started, from_client_error(e)))?;
        resp.mode = "layered".into();
        resp.total_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.edge.succeed(RPC, started);
        Ok(Response::new(resp))
    }

    async fn validate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<v1::ValidateResponse>, Status> {
        const RPC: &str = "validate";
        let started = Instant::now();
        let tenant = self.edge.authenticate(RPC, started, request.metadata())?;
        let engine = self.engine_for(request.metadata());
        let req = request.into_inner();
        convert::generate_request(req.clone()).map_err(|e| self.edge.fail(RPC, started, e))?;
        self.edge
            .limiter
            .check_only(&tenant)
            .map_err(|e| self.edge.fail(RPC, started, e))?;
        let prepared = self
            .prepare(&tenant, &req)
            .await
            .map_err(|e| self.edge.fail(RPC, started, e))?;
        let resp = engine
            .validate(prepared.engine_request)
            .await
            .map_err(|e| self.edge.fail(RPC, started, from_client_error(e)))?;
        self.edge.succeed(RPC, started);
        Ok(Response::new(resp))
    }
}

/// Starts the orchestrator and serves until `shutdown` resolves. Reports SERVING once a
/// probe through Redis and the engine succeeds (retried until then).
pub async fn run(
    config: OrchestratorConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut registry = new_registry("orchestrator");
    let metrics = ServiceMetrics::register(&mut registry);
    let orchestrator_metrics = OrchestratorMetrics::register(&mut registry);
    let bound = server::bind(config.serve.clone()).await?;
    let redis = RedisPool::connect(&config.redis_url, config.redis_connections)
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to Redis at {}: {e}", config.redis_url))?;
    let mut client_config = ClientConfig::new(config.engine_url.clone());
    client_config.api_key = config.engine_api_key.clone();
    let engine_auth = config
        .engine_api_key
        .as_ref()
        .map(|k| tonic::metadata::AsciiMetadataValue::try_from(format!("Bearer {k}")))
        .transpose()
        .map_err(|_| anyhow::anyhow!("engine API key is not ASCII"))?;
    let engine = Client::new(client_config).map_err(|e| anyhow::anyhow!("engine URL: {e}"))?;
    let service = Orchestrator {
        edge: Edge {
            tenants: config.tenants.clone(),
            limiter: Limiter::new(config.max_in_flight),
            metrics,
        },
        redis,
        engine: engine.clone(),
        engine_auth,
        keys: config.keys.clone(),
        ttl: config.ttl,
        metrics: orchestrator_metrics,
    };
    let lifecycle = bound.lifecycle();
    // Ready once Redis answered (above) and the engine reports SERVING on its health service
    // (which needs no credentials).
    let readiness = tokio::spawn(async move {
        loop {
            match engine.health().await {
                Ok(true) => {
                    lifecycle.set_serving(true).await;
                    return;
                }
                Ok(false) => tracing::info!("engine not serving yet"),
                Err(e) => tracing::info!(cause = %e, "engine not reachable yet"),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let result = bound
        .serve(
            |routes| {
                routes.add_service(
                    v1::inference_server::InferenceServer::new(service).max_decoding_message_size(
                        zerolayer_service::convert::MAX_CONTENT_BYTES * 4,
                    ),
                )
            },
            registry,
            shutdown,
        )
        .await;
    readiness.abort();
    result.map_err(Into::into)
}
