//! The thin front of split mode: a gRPC server that authenticates, validates and
//! rate-limits requests, then forwards their protobuf bytes over shared memory to the
//! co-located engine and streams the engine's encoded chunks back unchanged.
//!
//! The front never parses context handles and never sees slots: the engine owns both. It
//! keeps serving while the engine restarts: in-flight streams end with `UNAVAILABLE`
//! (`ENGINE_UNAVAILABLE`) as soon as the shared-memory channel notices the engine is gone
//! (bounded by the channel's liveness timeout), health turns NOT_SERVING, and once a new
//! engine creates its segment the channel reattaches, a probe passes and health turns
//! SERVING again.
//!
//! # Layout
//! - [`codec`]: the pass-through gRPC codec (`Raw<T>` requests, `PreEncoded` chunks).
//! - [`FrontService`]: `zerolayer.v1.Inference` over the channel (a hand-written tonic
//!   service so it can use that codec).
//! - [`FrontConfig`], [`run`]: start-up, readiness and serving.

pub mod codec;

use std::{
    convert::Infallible,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use prost::Message;
use tonic::{
    Status,
    body::Body,
    codegen::{BoxFuture, http},
    server::{Grpc, NamedService, ServerStreamingService, UnaryService},
};
use zerolayer_engine::api::ErrorReason;
use zerolayer_proto::v1;
use zerolayer_service::{
    ApiError,
    convert::{self, BufferedCollector},
    edge::{ChunkInfo, Edge, first_or_error},
    limits::Limiter,
    metrics::{ServiceMetrics, new_registry},
    server::{self, INFERENCE_SERVICE, Lifecycle, ServeConfig},
    tenants::Tenants,
    wire,
};
use zerolayer_shm::{
    ClientError as ShmError, ConnectionState, ResponseStream, ShmClient, ShmConfig,
};

use crate::codec::{PreEncoded, Proto, Raw, RawCodec};

/// Largest gRPC request the front decodes: 4 × the content limit leaves room for protobuf
/// overhead; the shared-memory ring bounds what can be forwarded anyway.
pub const MAX_REQUEST_BYTES: usize = convert::MAX_CONTENT_BYTES * 4;

/// Configuration of the front process.
#[derive(Debug, Clone)]
pub struct FrontConfig {
    /// Listen addresses and drain timeout.
    pub serve: ServeConfig,
    /// The engine's shared-memory segment.
    pub shm: ShmConfig,
    /// Tenants and their limits.
    pub tenants: Arc<Tenants>,
    /// Requests in flight before shedding load.
    pub max_in_flight: usize,
}

/// One chunk frame on its way to the client.
#[derive(Debug)]
struct FrontChunk {
    bytes: Bytes,
    carries_tokens: bool,
    final_usage: Option<v1::Usage>,
}

impl ChunkInfo for FrontChunk {
    fn carries_tokens(&self) -> bool {
        self.carries_tokens
    }

    fn final_usage(&self) -> Option<v1::Usage> {
        self.final_usage
    }
}

fn shm_error(e: ShmError) -> ApiError {
    match e {
        ShmError::NotAttached | ShmError::Closed | ShmError::AttachTimeout { .. } => {
            ApiError::new(ErrorReason::EngineUnavailable, "the engine is not attached")
                .with_retry_after(Duration::from_millis(200))
        }
        ShmError::PeerGone { reason } => ApiError::new(
            ErrorReason::EngineUnavailable,
            format!("the engine went away: {reason}"),
        )
        .with_retry_after(Duration::from_millis(200)),
        ShmError::Send(zerolayer_shm::SendError::FrameTooLarge { len, max }) => ApiError::invalid(
            format!("request of {len} bytes exceeds the {max}-byte shared-memory frame limit"),
        ),
        ShmError::Send(zerolayer_shm::SendError::Timeout { waited }) => ApiError::new(
            ErrorReason::Overloaded,
            format!("the engine's request ring stayed full for {waited:?}"),
        )
        .with_retry_after(Duration::from_millis(100)),
        ShmError::Send(other) => ApiError::internal(format!("shared-memory send failed: {other}")),
    }
}

/// Shared state of the front service.
#[derive(Debug)]
struct Inner {
    edge: Edge,
    shm: ShmClient,
}

/// `zerolayer.v1.Inference` served by forwarding over shared memory.
#[derive(Debug, Clone)]
pub struct FrontService {
    inner: Arc<Inner>,
}

type ChunkResult = Result<FrontChunk, ApiError>;

impl Inner {
    /// Sends one request frame: envelope (tenant) + the client's protobuf bytes.
    async fn forward(
        &self,
        kind: u16,
        tenant: &str,
        body: &[u8],
    ) -> Result<ResponseStream, ApiError> {
        if tenant.len() > wire::MAX_TENANT_BYTES {
            return Err(ApiError::internal(
                "tenant name too long for the wire envelope",
            ));
        }
        let len = wire::envelope_len(tenant) + body.len();
        let (_, stream) = self
            .shm
            .start_request(kind, len, |buf| {
                // Cannot fail: `buf` is exactly `len` bytes and the tenant length was checked.
                if let Ok(rest) = wire::write_envelope(buf, tenant) {
                    rest.copy_from_slice(body);
                }
            })
            .await
            .map_err(shm_error)?;
        Ok(stream)
    }

    /// The chunk frames of a generation as a stream.
    fn chunks(stream: ResponseStream) -> impl Stream<Item = ChunkResult> + Send + Unpin + 'static {
        Box::pin(futures::stream::unfold(stream, |mut s| async move {
            let item = match s.next().await? {
                Err(e) => Err(shm_error(e)),
                Ok(frame) => match frame.kind {
                    wire::KIND_CHUNK => Ok(FrontChunk {
                        bytes: frame.payload,
                        carries_tokens: true,
                        final_usage: None,
                    }),
                    wire::KIND_FINAL_CHUNK => {
                        match v1::GenerateChunk::decode(frame.payload.clone()) {
                            // Only the last chunk is decoded: its usage settles the rate limit.
                            Ok(last) => Ok(FrontChunk {
                                carries_tokens: !last.token_ids.is_empty(),
                                final_usage: Some(
                                    last.r#final.and_then(|f| f.usage).unwrap_or_default(),
                                ),
                                bytes: frame.payload,
                            }),
                            Err(e) => {
                                Err(ApiError::internal(format!("malformed final chunk: {e}")))
                            }
                        }
                    }
                    wire::KIND_ERROR => {
                        Err(wire::decode_error(&frame.payload).unwrap_or_else(|e| {
                            ApiError::internal(format!("malformed error frame: {e}"))
                        }))
                    }
                    other => Err(ApiError::internal(format!(
                        "unexpected response frame kind {other}"
                    ))),
                },
            };
            Some((item, s))
        }))
    }

    /// The single response of a unary request.
    async fn unary<T: Message + Default>(
        mut stream: ResponseStream,
        kind: u16,
    ) -> Result<T, ApiError> {
        let frame = match stream.next().await {
            None => {
                return Err(ApiError::internal(
                    "the engine closed the request without answering",
                ));
            }
            Some(Err(e)) => return Err(shm_error(e)),
            Some(Ok(frame)) => frame,
        };
        if frame.kind == wire::KIND_ERROR {
            return Err(wire::decode_error(&frame.payload)
                .unwrap_or_else(|e| ApiError::internal(format!("malformed error frame: {e}"))));
        }
        if frame.kind != kind {
            return Err(ApiError::internal(format!(
                "unexpected response frame kind {}",
                frame.kind
            )));
        }
        T::decode(frame.payload).map_err(|e| ApiError::internal(format!("malformed response: {e}")))
    }

    /// Starts a generation: authenticate, validate, admit, forward, wait for the first chunk.
    async fn start(
        &self,
        rpc: &'static str,
        request: tonic::Request<Raw<v1::GenerateRequest>>,
    ) -> Result<impl Stream<Item = Result<FrontChunk, Status>> + Send + 'static, Status> {
        let started = Instant::now();
        let tenant = self.edge.authenticate(rpc, started, request.metadata())?;
        let raw = request.into_inner();
        let valid =
            convert::generate_request(raw.message).map_err(|e| self.edge.fail(rpc, started, e))?;
        let admission = self
            .edge
            .admit(rpc, started, &tenant, valid.sampling.max_tokens)?;
        let stream = self
            .forward(wire::KIND_GENERATE, &tenant.name, &raw.bytes)
            .await
            .map_err(|e| self.edge.fail(rpc, started, e))?;
        let stream = first_or_error(Self::chunks(stream))
            .await
            .map_err(|e| self.edge.fail(rpc, started, e))?;
        Ok(self.edge.instrument(rpc, started, admission, stream))
    }

    async fn probe(
        &self,
        request: tonic::Request<Raw<v1::ProbeRequest>>,
    ) -> Result<v1::ProbeResponse, Status> {
        let started = Instant::now();
        let tenant = self
            .edge
            .authenticate("probe", started, request.metadata())?;
        let result = async {
            let stream = self.forward(wire::KIND_PROBE, &tenant.name, &[]).await?;
            Self::unary::<v1::ProbeResponse>(stream, wire::KIND_PROBE_RESPONSE).await
        }
        .await
        .map_err(|e| self.edge.fail("probe", started, e))?;
        self.edge.succeed("probe", started);
        Ok(result)
    }

    async fn validate(
        &self,
        request: tonic::Request<Raw<v1::GenerateRequest>>,
    ) -> Result<v1::ValidateResponse, Status> {
        let started = Instant::now();
        let tenant = self
            .edge
            .authenticate("validate", started, request.metadata())?;
        let raw = request.into_inner();
        let result = async {
            convert::generate_request(raw.message)?;
            self.edge.limiter.check_only(&tenant)?;
            let stream = self
                .forward(wire::KIND_VALIDATE, &tenant.name, &raw.bytes)
                .await?;
            Self::unary::<v1::ValidateResponse>(stream, wire::KIND_VALIDATE_RESPONSE).await
        }
        .await
        .map_err(|e| self.edge.fail("validate", started, e))?;
        self.edge.succeed("validate", started);
        Ok(result)
    }

    /// Probes the engine through the channel without authentication (readiness).
    async fn self_probe(&self) -> Result<v1::ProbeResponse, ApiError> {
        let stream = self
            .forward(
                wire::KIND_PROBE,
                zerolayer_service::tenants::DEV_TENANT,
                &[],
            )
            .await?;
        Self::unary(stream, wire::KIND_PROBE_RESPONSE).await
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

struct GenerateSvc(Arc<Inner>);

impl ServerStreamingService<Raw<v1::GenerateRequest>> for GenerateSvc {
    type Response = PreEncoded;
    type ResponseStream = BoxStream<PreEncoded>;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: tonic::Request<Raw<v1::GenerateRequest>>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move {
            let stream = inner.start("generate", request).await?;
            let stream: BoxStream<PreEncoded> =
                Box::pin(stream.map(|item| item.map(|c| PreEncoded(c.bytes))));
            Ok(tonic::Response::new(stream))
        })
    }
}

struct BufferedSvc(Arc<Inner>);

impl UnaryService<Raw<v1::GenerateRequest>> for BufferedSvc {
    type Response = Proto<v1::GenerateBufferedResponse>;
    type Future = BoxFuture<tonic::Response<Self::Response>, Status>;

    fn call(&mut self, mut request: tonic::Request<Raw<v1::GenerateRequest>>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move {
            // The bridge ignores stream_options: forward a copy without them.
            let raw = request.get_mut();
            if raw.message.stream_options.is_some() {
                raw.message.stream_options = None;
                raw.bytes = raw.message.encode_to_vec().into();
            }
            let mut stream = Box::pin(inner.start("generate_buffered", request).await?);
            let mut collector = BufferedCollector::default();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk?;
                let decoded = v1::GenerateChunk::decode(chunk.bytes).map_err(|e| {
                    ApiError::internal(format!("malformed chunk: {e}")).into_status()
                })?;
                collector.push(decoded);
            }
            let response = collector.finish().map_err(ApiError::into_status)?;
            Ok(tonic::Response::new(Proto(response)))
        })
    }
}

struct ProbeSvc(Arc<Inner>);

impl UnaryService<Raw<v1::ProbeRequest>> for ProbeSvc {
    type Response = Proto<v1::ProbeResponse>;
    type Future = BoxFuture<tonic::Response<Self::Response>, Status>;

    fn call(&mut self, request: tonic::Request<Raw<v1::ProbeRequest>>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move {
            inner
                .probe(request)
                .await
                .map(|r| tonic::Response::new(Proto(r)))
        })
    }
}

struct ValidateSvc(Arc<Inner>);

impl UnaryService<Raw<v1::GenerateRequest>> for ValidateSvc {
    type Response = Proto<v1::ValidateResponse>;
    type Future = BoxFuture<tonic::Response<Self::Response>, Status>;

    fn call(&mut self, request: tonic::Request<Raw<v1::GenerateRequest>>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move {
            inner
                .validate(request)
                .await
                .map(|r| tonic::Response::new(Proto(r)))
        })
    }
}

fn grpc<E: codec::WireEncode, D: codec::WireDecode>() -> Grpc<RawCodec<E, D>> {
    Grpc::new(RawCodec::default()).apply_max_message_size_config(Some(MAX_REQUEST_BYTES), None)
}

impl<B> tower::Service<http::Request<B>> for FrontService
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        match req.uri().path() {
            "/zerolayer.v1.Inference/Generate" => Box::pin(async move {
                Ok(grpc::<PreEncoded, Raw<v1::GenerateRequest>>()
                    .server_streaming(GenerateSvc(inner), req)
                    .await)
            }),
            "/zerolayer.v1.Inference/GenerateBuffered" => Box::pin(async move {
                Ok(
                    grpc::<Proto<v1::GenerateBufferedResponse>, Raw<v1::GenerateRequest>>()
                        .unary(BufferedSvc(inner), req)
                        .await,
                )
            }),
            "/zerolayer.v1.Inference/Probe" => Box::pin(async move {
                Ok(grpc::<Proto<v1::ProbeResponse>, Raw<v1::ProbeRequest>>()
                    .unary(ProbeSvc(inner), req)
                    .await)
            }),
            "/zerolayer.v1.Inference/Validate" => Box::pin(async move {
                Ok(
                    grpc::<Proto<v1::ValidateResponse>, Raw<v1::GenerateRequest>>()
                        .unary(ValidateSvc(inner), req)
                        .await,
                )
            }),
            _ => Box::pin(async move { Ok(Status::unimplemented("unknown method").into_http()) }),
        }
    }
}

impl NamedService for FrontService {
    const NAME: &'static str = INFERENCE_SERVICE;
}

/// Reports SERVING while the channel is attached and a probe through it passes.
async fn track_readiness(inner: Arc<Inner>, lifecycle: Lifecycle) {
    let mut states = inner.shm.subscribe();
    loop {
        let attached = matches!(
            *states.borrow_and_update(),
            ConnectionState::Attached { .. }
        );
        if attached {
            match inner.self_probe().await {
                Ok(_) => lifecycle.set_serving(true).await,
                Err(e) => {
                    tracing::info!(cause = %e, "engine attached but not ready");
                    lifecycle.set_serving(false).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
        } else {
            lifecycle.set_serving(false).await;
        }
        if states.changed().await.is_err() {
            return;
        }
    }
}

/// Starts the front and serves until `shutdown` resolves.
pub async fn run(
    config: FrontConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut registry = new_registry("front");
    let metrics = ServiceMetrics::register(&mut registry);
    let bound = server::bind(config.serve.clone()).await?;
    let shm = ShmClient::connect(config.shm.clone())
        .map_err(|e| anyhow::anyhow!("shared-memory configuration: {e}"))?;
    let inner = Arc::new(Inner {
        edge: Edge {
            tenants: config.tenants.clone(),
            limiter: Limiter::new(config.max_in_flight),
            metrics,
        },
        shm: shm.clone(),
    });
    let readiness = tokio::spawn(track_readiness(inner.clone(), bound.lifecycle()));
    let service = FrontService { inner };
    let result = bound
        .serve(|routes| routes.add_service(service), registry, shutdown)
        .await;
    readiness.abort();
    shm.shutdown();
    result.map_err(Into::into)
}
