//! Rust client library for the `zerolayer.v1` API.
//!
//! # Layout
//! - [`Client`]: a cloneable connection (lazy, so a server that is still starting is
//!   retried), API-key metadata, retries of `UNAVAILABLE` with exponential backoff and
//!   jitter before the first chunk of a call.
//! - [`Conversation`]: keeps a conversation's messages and its context handle, renews the
//!   handle from each final chunk, and in delta mode resends the full transcript after
//!   `CONTEXT_EVICTED`.
//! - [`TurnResult`]: what one turn produced, with the server's usage/timings and the
//!   client-side TTFT and chunk arrival times (the benchmark's raw samples).

use std::time::{Duration, Instant};

use futures::StreamExt;
use tonic::{
    Code, Status,
    metadata::{AsciiMetadataValue, MetadataValue},
    transport::{Channel, Endpoint},
};
use zerolayer_proto::{ERROR_REASON_METADATA, RETRY_AFTER_METADATA, v1};

pub use zerolayer_proto::v1::{ErrorReason, FinishReason, ReuseOutcome};

/// Retry policy for `UNAVAILABLE` (engine restarting, server starting, load shedding).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in total (1 = no retry).
    pub max_attempts: u32,
    /// Backoff before the first retry.
    pub initial_backoff: Duration,
    /// Backoff cap.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
        }
    }
}

impl RetryPolicy {
    /// No retries at all (tests that must observe the first error).
    pub fn none() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// Backoff before retry number `attempt` (1-based): exponential, capped, with "equal
    /// jitter" (half fixed, half random) so that clients that failed together spread out.
    /// A server's `retry-after-ms` hint raises it.
    pub fn backoff(&self, attempt: u32, hint: Option<Duration>) -> Duration {
        let exp = self
            .initial_backoff
            .saturating_mul(1 << attempt.saturating_sub(1).min(16));
        let base = exp.min(self.max_backoff);
        let jitter = base.mul_f64(0.5 * random_unit());
        (base / 2 + jitter).max(hint.unwrap_or_default())
    }
}

/// A random number in [0, 1) for jitter (OS randomness; quality is irrelevant here).
fn random_unit() -> f64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        return 0.5;
    }
    (u64::from_le_bytes(b) >> 11) as f64 / (1u64 << 53) as f64
}

/// Client configuration.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Server URI, e.g. `http://127.0.0.1:50051`.
    pub endpoint: String,
    /// API key sent as `authorization: Bearer <key>`; `None` for dev-mode servers.
    pub api_key: Option<String>,
    /// Retries of `UNAVAILABLE`.
    pub retry: RetryPolicy,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
}

impl ClientConfig {
    /// Defaults for `endpoint`.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            api_key: None,
            retry: RetryPolicy::default(),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// Sets the API key.
    #[must_use]
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// Sets the retry policy.
    #[must_use]
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }
}

/// An error of a call: the gRPC status and the zerolayer reason it carries.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{reason}: {message} (gRPC {code:?})", reason = reason.short_name())]
pub struct ClientError {
    /// Machine-readable reason (from `zerolayer-error-reason`, else derived from the code).
    pub reason: ErrorReason,
    /// gRPC code.
    pub code: Code,
    /// Server's message.
    pub message: String,
    /// Retry hint from the server.
    pub retry_after: Option<Duration>,
}

impl ClientError {
    /// Reads the reason and hints from a status.
    pub fn from_status(status: &Status) -> Self {
        let reason = status
            .metadata()
            .get(ERROR_REASON_METADATA)
            .and_then(|v| v.to_str().ok())
            .and_then(ErrorReason::from_short_name)
            .unwrap_or(match status.code() {
                Code::Unauthenticated => ErrorReason::Unauthenticated,
                Code::InvalidArgument => ErrorReason::InvalidRequest,
                Code::Unavailable | Code::Cancelled => ErrorReason::EngineUnavailable,
                Code::ResourceExhausted => ErrorReason::Overloaded,
                _ => ErrorReason::Internal,
            });
        let retry_after = status
            .metadata()
            .get(RETRY_AFTER_METADATA)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis);
        Self {
            reason,
            code: status.code(),
            message: status.message().to_owned(),
            retry_after,
        }
    }

    fn local(reason: ErrorReason, message: impl Into<String>) -> Self {
        Self {
            reason,
            code: Code::Internal,
            message: message.into(),
            retry_after: None,
        }
    }

    /// True for errors worth retrying with backoff (`UNAVAILABLE`).
    pub fn is_retryable(&self) -> bool {
        self.code == Code::Unavailable
    }
}

impl From<Status> for ClientError {
    fn from(status: Status) -> Self {
        Self::from_status(&status)
    }
}

/// A connection to a zerolayer server (any mode). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    inner: v1::inference_client::InferenceClient<Channel>,
    channel: Channel,
    auth: Option<AsciiMetadataValue>,
    retry: RetryPolicy,
}

impl Client {
    /// Creates a client. The connection is made lazily on the first call (and remade after
    /// failures), so a server that is still starting is simply retried. Must be called inside
    /// a tokio runtime (the channel spawns its connection task there).
    pub fn new(config: ClientConfig) -> Result<Self, ClientError> {
        let endpoint = Endpoint::from_shared(config.endpoint.clone())
            .map_err(|e| ClientError::local(ErrorReason::InvalidRequest, e.to_string()))?
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true);
        let channel = endpoint.connect_lazy();
        let auth = config
            .api_key
            .map(|k| MetadataValue::try_from(format!("Bearer {k}")))
            .transpose()
            .map_err(|_| ClientError::local(ErrorReason::InvalidRequest, "API key is not ASCII"))?;
        let inner = v1::inference_client::InferenceClient::new(channel.clone())
            .max_decoding_message_size(64 << 20);
        Ok(Self {
            inner,
            channel,
            auth,
            retry: config.retry,
        })
    }

    /// Same connection sending `authorization` as given (a gateway forwarding its caller's
    /// credentials); `None` sends none.
    #[must_use]
    pub fn with_authorization(mut self, authorization: Option<AsciiMetadataValue>) -> Self {
        self.auth = authorization;
        self
    }

    /// Same connection with another retry policy.
    #[must_use]
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        if let Some(auth) = &self.auth {
            req.metadata_mut().insert("authorization", auth.clone());
        }
        req
    }

    async fn with_retries<T, F, Fut>(&self, mut call: F) -> Result<T, ClientError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let mut attempt = 1;
        loop {
            match call().await {
                Ok(v) => return Ok(v),
                Err(status) => {
                    let err = ClientError::from_status(&status);
                    if !err.is_retryable() || attempt >= self.retry.max_attempts {
                        return Err(err);
                    }
                    let wait = self.retry.backoff(attempt, err.retry_after);
                    tracing::debug!(attempt, wait_ms = wait.as_millis() as u64, %err, "retrying");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
            }
        }
    }

    /// Starts a `Generate` stream. `UNAVAILABLE` before the stream starts is retried; an
    /// error after it started is returned by [`ChunkStream::next`].
    pub async fn generate(&self, req: v1::GenerateRequest) -> Result<ChunkStream, ClientError> {
        let started = Instant::now();
        let stream = self
            .with_retries(|| {
                let mut client = self.inner.clone();
                let request = self.request(req.clone());
                async move {
                    client
                        .generate(request)
                        .await
                        .map(tonic::Response::into_inner)
                }
            })
            .await?;
        Ok(ChunkStream {
            inner: stream,
            started,
        })
    }

    /// `GenerateBuffered` (retried on `UNAVAILABLE`).
    pub async fn generate_buffered(
        &self,
        req: v1::GenerateRequest,
    ) -> Result<v1::GenerateBufferedResponse, ClientError> {
        self.with_retries(|| {
            let mut client = self.inner.clone();
            let request = self.request(req.clone());
            async move {
                client
                    .generate_buffered(request)
                    .await
                    .map(tonic::Response::into_inner)
            }
        })
        .await
    }

    /// `Probe` (retried on `UNAVAILABLE`).
    pub async fn probe(&self) -> Result<v1::ProbeResponse, ClientError> {
        self.with_retries(|| {
            let mut client = self.inner.clone();
            let request = self.request(v1::ProbeRequest {});
            async move { client.probe(request).await.map(tonic::Response::into_inner) }
        })
        .await
    }

    /// `Validate` (retried on `UNAVAILABLE`).
    pub async fn validate(
        &self,
        req: v1::GenerateRequest,
    ) -> Result<v1::ValidateResponse, ClientError> {
        self.with_retries(|| {
            let mut client = self.inner.clone();
            let request = self.request(req.clone());
            async move {
                client
                    .validate(request)
                    .await
                    .map(tonic::Response::into_inner)
            }
        })
        .await
    }

    /// gRPC health of the inference service: `Ok(true)` when SERVING.
    pub async fn health(&self) -> Result<bool, ClientError> {
        let mut client = tonic_health::pb::health_client::HealthClient::new(self.channel.clone());
        let resp = client
            .check(tonic_health::pb::HealthCheckRequest {
                service: "zerolayer.v1.Inference".into(),
            })
            .await
            .map_err(|s| ClientError::from_status(&s))?;
        Ok(resp.into_inner().status
            == tonic_health::pb::health_check_response::ServingStatus::Serving as i32)
    }

    /// A new conversation on this connection.
    pub fn conversation(&self) -> Conversation {
        Conversation::new(self.clone())
    }
}

/// A `Generate` stream with client-side timing.
#[derive(Debug)]
pub struct ChunkStream {
    inner: tonic::Streaming<v1::GenerateChunk>,
    started: Instant,
}

impl ChunkStream {
    /// The next chunk; `None` after the last one.
    pub async fn next(&mut self) -> Option<Result<v1::GenerateChunk, ClientError>> {
        self.inner
            .next()
            .await
            .map(|r| r.map_err(|s| ClientError::from_status(&s)))
    }

    /// When the call started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Reads the whole stream into a [`TurnResult`].
    pub async fn collect(mut self) -> Result<TurnResult, ClientError> {
        let mut turn = TurnResult::default();
        while let Some(chunk) = self.next().await {
            let chunk = chunk?;
            let at = self.started.elapsed();
            if turn.ttft.is_none() && !chunk.token_ids.is_empty() {
                turn.ttft = Some(at);
            }
            turn.chunk_times.push(at);
            turn.text.push_str(&chunk.text);
            turn.token_ids.extend_from_slice(&chunk.token_ids);
            turn.chunk_text_bytes.push(chunk.text.len());
            if let Some(f) = chunk.r#final {
                turn.final_info = Some(f);
            }
        }
        turn.e2e = self.started.elapsed();
        if turn.final_info.is_none() {
            return Err(ClientError::local(
                ErrorReason::Internal,
                "stream ended without a final chunk",
            ));
        }
        Ok(turn)
    }
}

/// What one generation produced.
#[derive(Debug, Clone, Default)]
pub struct TurnResult {
    /// Generated text.
    pub text: String,
    /// Generated token ids.
    pub token_ids: Vec<u32>,
    /// The final chunk's information (handle, finish reason, usage, timings, reuse).
    pub final_info: Option<v1::FinalInfo>,
    /// Client-measured time to the first chunk carrying tokens.
    pub ttft: Option<Duration>,
    /// Client-measured time to the end of the stream.
    pub e2e: Duration,
    /// Arrival time of each chunk since the call started.
    pub chunk_times: Vec<Duration>,
    /// Text bytes of each chunk.
    pub chunk_text_bytes: Vec<usize>,
    /// True when delta mode hit `CONTEXT_EVICTED` and the full transcript was resent.
    pub resent_full: bool,
}

impl TurnResult {
    /// Usage from the final chunk (zeros if absent).
    pub fn usage(&self) -> v1::Usage {
        self.final_info
            .as_ref()
            .and_then(|f| f.usage)
            .unwrap_or_default()
    }

    /// Server timings from the final chunk (zeros if absent).
    pub fn timings(&self) -> v1::Timings {
        self.final_info
            .as_ref()
            .and_then(|f| f.timings)
            .unwrap_or_default()
    }

    /// Cache outcome.
    pub fn reuse(&self) -> ReuseOutcome {
        self.final_info
            .as_ref()
            .and_then(|f| ReuseOutcome::try_from(f.reuse).ok())
            .unwrap_or(ReuseOutcome::Unspecified)
    }

    /// Finish reason.
    pub fn finish_reason(&self) -> FinishReason {
        self.final_info
            .as_ref()
            .and_then(|f| FinishReason::try_from(f.finish_reason).ok())
            .unwrap_or(FinishReason::Unspecified)
    }
}

/// A conversation: its messages, its context handle and how turns are sent.
#[derive(Debug, Clone)]
pub struct Conversation {
    client: Client,
    messages: Vec<v1::Message>,
    handle: Vec<u8>,
    /// Messages already known to the server's slot (delta mode sends the rest).
    synced: usize,
    delta: bool,
    sampling: v1::SamplingParams,
    stream_options: Option<v1::StreamOptions>,
}

impl Conversation {
    fn new(client: Client) -> Self {
        Self {
            client,
            messages: Vec::new(),
            handle: Vec::new(),
            synced: 0,
            delta: false,
            sampling: v1::SamplingParams::default(),
            stream_options: None,
        }
    }

    /// Continues the conversation through another connection (e.g. a new front).
    pub fn rebind(&mut self, client: Client) {
        self.client = client;
    }

    /// Opens with a system prompt.
    #[must_use]
    pub fn with_system(mut self, text: impl Into<String>) -> Self {
        self.messages
            .insert(0, message(v1::Role::System, text.into()));
        self
    }

    /// Sends only new messages (the server's slot supplies the history).
    #[must_use]
    pub fn delta(mut self, delta: bool) -> Self {
        self.delta = delta;
        self
    }

    /// Sampling of every turn.
    #[must_use]
    pub fn sampling(mut self, sampling: v1::SamplingParams) -> Self {
        self.sampling = sampling;
        self
    }

    /// Stream shaping of every turn.
    #[must_use]
    pub fn stream_options(mut self, options: v1::StreamOptions) -> Self {
        self.stream_options = Some(options);
        self
    }

    /// The messages so far.
    pub fn messages(&self) -> &[v1::Message] {
        &self.messages
    }

    /// The current context handle (empty before the first turn).
    pub fn handle(&self) -> &[u8] {
        &self.handle
    }

    /// Replaces the handle (tests: forged or foreign handles).
    pub fn set_handle(&mut self, handle: impl Into<Vec<u8>>) {
        self.handle = handle.into();
    }

    fn request(&self, pending: &v1::Message, delta: bool) -> v1::GenerateRequest {
        let mut messages: Vec<v1::Message> = if delta {
            self.messages[self.synced..].to_vec()
        } else {
            self.messages.clone()
        };
        messages.push(pending.clone());
        v1::GenerateRequest {
            messages,
            context_handle: self.handle.clone(),
            delta,
            sampling: Some(self.sampling.clone()),
            stream_options: self.stream_options,
            truncation: v1::TruncationPolicy::Reject as i32,
            request_id: String::new(),
        }
    }

    /// Sends a user turn and collects the reply. On success the user message and the reply
    /// join the conversation and the handle is renewed; on error the conversation is left
    /// unchanged (the turn can be retried).
    pub async fn turn(&mut self, user: impl Into<String>) -> Result<TurnResult, ClientError> {
        let pending = message(v1::Role::User, user.into());
        let use_delta = self.delta && !self.handle.is_empty();
        let mut resent_full = false;
        let started = Instant::now();
        let stream = match self
            .client
            .generate(self.request(&pending, use_delta))
            .await
        {
            Err(e) if use_delta && e.reason == ErrorReason::ContextEvicted => {
                tracing::debug!("context evicted: resending the full transcript");
                resent_full = true;
                self.client.generate(self.request(&pending, false)).await?
            }
            other => other?,
        };
        let mut turn = stream.collect().await?;
        turn.resent_full = resent_full;
        // Client-side TTFT and e2e count from the first attempt.
        let offset = started.elapsed().saturating_sub(turn.e2e);
        turn.e2e += offset;
        turn.ttft = turn.ttft.map(|t| t + offset);
        self.messages.push(pending);
        self.messages
            .push(message(v1::Role::Assistant, turn.text.clone()));
        if let Some(f) = &turn.final_info {
            self.handle = f.context_handle.clone();
        }
        self.synced = self.messages.len();
        Ok(turn)
    }
}

fn message(role: v1::Role, content: String) -> v1::Message {
    v1::Message {
        role: role as i32,
        content,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_exponentially_is_capped_and_honours_hints() {
        let p = RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
        };
        for attempt in 1..10 {
            let b = p.backoff(attempt, None);
            let base = Duration::from_millis(100 * (1 << (attempt - 1))).min(p.max_backoff);
            assert!(
                b >= base / 2 && b <= base,
                "attempt {attempt}: {b:?} vs {base:?}"
            );
        }
        assert!(p.backoff(1, Some(Duration::from_secs(3))) >= Duration::from_secs(3));
    }

    #[test]
    fn errors_read_their_reason_from_metadata_or_code() {
        let mut s = Status::failed_precondition("gone");
        s.metadata_mut().insert(
            ERROR_REASON_METADATA,
            MetadataValue::from_static("CONTEXT_EVICTED"),
        );
        s.metadata_mut()
            .insert(RETRY_AFTER_METADATA, MetadataValue::from_static("250"));
        let e = ClientError::from_status(&s);
        assert_eq!(e.reason, ErrorReason::ContextEvicted);
        assert_eq!(e.retry_after, Some(Duration::from_millis(250)));
        assert!(!e.is_retryable());
        let e = ClientError::from_status(&Status::unavailable("down"));
        assert_eq!(e.reason, ErrorReason::EngineUnavailable);
        assert!(e.is_retryable());
    }

    #[tokio::test]
    async fn unreachable_servers_fail_with_unavailable_after_the_retries() {
        // Port 1 on localhost refuses connections.
        let client = Client::new(ClientConfig::new("http://127.0.0.1:1").retry(RetryPolicy {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(2),
        }))
        .expect("valid endpoint");
        let err = client.probe().await.expect_err("refused");
        assert_eq!(err.code, Code::Unavailable);
    }
}
