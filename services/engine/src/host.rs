//! The engine side of every request, whatever carried it (collapsed gRPC or split shared
//! memory): protobuf in, validated domain request to the engine, shaped protobuf chunks out.

use std::sync::Arc;

use futures::{Stream, StreamExt};
use zerolayer_engine::{Engine, EngineError, api::Caller};
use zerolayer_proto::v1;
use zerolayer_service::{
    ApiError, convert,
    shaping::{ShapeOptions, shape},
};

/// A boxed stream of shaped chunks.
pub type ChunkStream =
    std::pin::Pin<Box<dyn Stream<Item = Result<v1::GenerateChunk, ApiError>> + Send + 'static>>;

/// Converts an engine error into the wire error (reason, message, retry hint).
pub fn api_error(e: &EngineError) -> ApiError {
    ApiError {
        reason: e.reason(),
        message: e.to_string(),
        retry_after: e.retry_after(),
    }
}

/// Runs requests against one engine.
#[derive(Clone)]
pub struct EngineHost {
    engine: Engine,
    model: Arc<str>,
    mode: &'static str,
}

impl EngineHost {
    /// A host for `engine`, answering probes as `mode` (`collapsed` or `split`).
    pub fn new(engine: Engine, model: impl Into<Arc<str>>, mode: &'static str) -> Self {
        Self {
            engine,
            model: model.into(),
            mode,
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Starts a generation for `tenant`. Validation errors return at once; engine errors
    /// found before generation arrive as the stream's first item (see
    /// `zerolayer_service::edge::first_or_error`).
    pub fn generate(
        &self,
        tenant: &str,
        req: v1::GenerateRequest,
    ) -> Result<ChunkStream, ApiError> {
        let opts = ShapeOptions::from_proto(req.stream_options.as_ref());
        let domain = convert::generate_request(req)?;
        let caller = Caller::new(tenant);
        let events = self.engine.generate(&caller, domain);
        let events = futures::stream::unfold(events, |mut s| async move {
            s.next()
                .await
                .map(|item| (item.map_err(|e| api_error(&e)), s))
        });
        let events = Box::pin(events);
        if opts.is_passthrough() {
            Ok(Box::pin(events.map(|item| {
                item.map(|event| convert::chunk_of_event(&event))
            })))
        } else {
            Ok(Box::pin(shape(events, opts)))
        }
    }

    /// Validates a request for `tenant`.
    pub async fn validate(
        &self,
        tenant: &str,
        req: v1::GenerateRequest,
    ) -> Result<v1::ValidateResponse, ApiError> {
        let domain = convert::generate_request(req)?;
        let report = self
            .engine
            .validate(&Caller::new(tenant), domain)
            .await
            .map_err(|e| api_error(&e))?;
        Ok(convert::validate_response(&report))
    }

    /// Generates one token from the probe prompt.
    pub async fn probe(&self) -> Result<v1::ProbeResponse, ApiError> {
        let report = self.engine.probe().await.map_err(|e| api_error(&e))?;
        let mut resp = convert::probe_response(&report, self.mode);
        if resp.model.is_empty() {
            resp.model = self.model.to_string();
        }
        Ok(resp)
    }
}
