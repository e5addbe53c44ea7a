//! Collapsed mode: the engine process serves `zerolayer.v1.Inference` itself — no front, no
//! shared-memory hop. Authentication, limits and metrics are the same [`Edge`] the front uses.

use std::{pin::Pin, time::Instant};

use futures::Stream;
use tonic::{Request, Response, Status};
use zerolayer_proto::v1::{self, inference_server::Inference};
use zerolayer_service::{
    convert,
    edge::{Edge, first_or_error},
};

use crate::host::EngineHost;

/// The gRPC service of collapsed mode.
#[derive(Clone)]
pub struct CollapsedService {
    /// Runs requests on the in-process engine.
    pub host: EngineHost,
    /// Authentication, limits, metrics.
    pub edge: Edge,
}

type GrpcStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateChunk, Status>> + Send + 'static>>;

impl CollapsedService {
    async fn start(
        &self,
        rpc: &'static str,
        request: Request<v1::GenerateRequest>,
    ) -> Result<GrpcStream, Status> {
        let started = Instant::now();
        let tenant = self.edge.authenticate(rpc, started, request.metadata())?;
        let mut req = request.into_inner();
        if rpc == "generate_buffered" {
            req.stream_options = None;
        }
        let max_tokens = req.sampling.as_ref().and_then(|s| s.max_tokens);
        let admission = self.edge.admit(rpc, started, &tenant, max_tokens)?;
        let stream = self
            .host
            .generate(&tenant.name, req)
            .map_err(|e| self.edge.fail(rpc, started, e))?;
        let stream = first_or_error(stream)
            .await
            .map_err(|e| self.edge.fail(rpc, started, e))?;
        Ok(Box::pin(
            self.edge.instrument(rpc, started, admission, stream),
        ))
    }
}

#[tonic::async_trait]
impl Inference for CollapsedService {
    type GenerateStream = GrpcStream;

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
        let started = Instant::now();
        self.edge
            .authenticate("probe", started, request.metadata())?;
        let resp = self
            .host
            .probe()
            .await
            .map_err(|e| self.edge.fail("probe", started, e))?;
        self.edge.succeed("probe", started);
        Ok(Response::new(resp))
    }

    async fn validate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<v1::ValidateResponse>, Status> {
        let started = Instant::now();
        let tenant = self
            .edge
            .authenticate("validate", started, request.metadata())?;
        self.edge
            .limiter
            .check_only(&tenant)
            .map_err(|e| self.edge.fail("validate", started, e))?;
        let req = request.into_inner();
        // Validation errors of the request itself come first, as in `generate`.
        convert::generate_request(req.clone())
            .map_err(|e| self.edge.fail("validate", started, e))?;
        let resp = self
            .host
            .validate(&tenant.name, req)
            .await
            .map_err(|e| self.edge.fail("validate", started, e))?;
        self.edge.succeed("validate", started);
        Ok(Response::new(resp))
    }
}
