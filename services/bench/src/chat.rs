//! The requests the generator sends, timed chunk by chunk.
//!
//! [`Chat`] keeps a conversation the way `zerolayer_client::Conversation` does (messages,
//! context handle renewed from each final chunk, delta mode with a full resend after
//! `CONTEXT_EVICTED`) but reads the stream itself, so that it knows which chunks carry tokens:
//! TTFT is the arrival of the first chunk with token ids and inter-token gaps are measured
//! between chunks with token ids only (the engine may send a text-only flush chunk and always
//! sends a token-less final chunk; counting those would invent near-zero gaps).

use std::time::{Duration, Instant};

use zerolayer_client::{ChunkStream, Client, ClientError, ErrorReason};
use zerolayer_proto::v1;

/// A finished, timed generation.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The generated text.
    pub text: String,
    /// Arrival of each chunk carrying token ids, since the request started (the first is the
    /// TTFT).
    pub token_times: Vec<Duration>,
    /// Time to the end of the stream.
    pub e2e: Duration,
    /// The final chunk's information.
    pub final_info: v1::FinalInfo,
    /// Delta mode met `CONTEXT_EVICTED` and the full transcript was resent (times count from
    /// the first attempt).
    pub resent_full: bool,
}

impl Reply {
    /// Time to the first token, if any token came.
    pub fn ttft(&self) -> Option<Duration> {
        self.token_times.first().copied()
    }
}

/// Why a request produced no [`Reply`].
#[derive(Debug, Clone, thiserror::Error)]
pub enum ChatError {
    /// The server (or the connection) returned an error.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The stream ended without a final chunk: a protocol violation by the server.
    #[error("the stream ended without a final chunk")]
    NoFinalChunk,
}

impl ChatError {
    /// The stable reason used in samples and reports (the API's reason names, plus
    /// `NO_FINAL_CHUNK`).
    pub fn reason(&self) -> &'static str {
        match self {
            ChatError::Client(e) => e.reason.short_name(),
            ChatError::NoFinalChunk => "NO_FINAL_CHUNK",
        }
    }

    /// Human-readable detail.
    pub fn message(&self) -> String {
        match self {
            ChatError::Client(e) => e.message.clone(),
            ChatError::NoFinalChunk => self.to_string(),
        }
    }
}

/// Reads a stream to its end, timing token chunks from `started`.
async fn collect(
    mut stream: ChunkStream,
    started: Instant,
    resent_full: bool,
) -> Result<Reply, ChatError> {
    let mut text = String::new();
    let mut token_times = Vec::new();
    let mut final_info = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if !chunk.token_ids.is_empty() {
            token_times.push(started.elapsed());
        }
        text.push_str(&chunk.text);
        if let Some(f) = chunk.r#final {
            final_info = Some(f);
        }
    }
    let e2e = started.elapsed();
    let final_info = final_info.ok_or(ChatError::NoFinalChunk)?;
    Ok(Reply {
        text,
        token_times,
        e2e,
        final_info,
        resent_full,
    })
}

fn message(role: v1::Role, content: String) -> v1::Message {
    v1::Message {
        role: role as i32,
        content,
    }
}

fn request(
    messages: Vec<v1::Message>,
    handle: Vec<u8>,
    delta: bool,
    sampling: &v1::SamplingParams,
) -> v1::GenerateRequest {
    v1::GenerateRequest {
        messages,
        context_handle: handle,
        delta,
        sampling: Some(sampling.clone()),
        stream_options: None,
        truncation: v1::TruncationPolicy::Reject as i32,
        request_id: String::new(),
    }
}

/// One independent prompt without a handle.
pub async fn single_shot(
    client: &Client,
    user: String,
    sampling: &v1::SamplingParams,
) -> Result<Reply, ChatError> {
    let started = Instant::now();
    let stream = client
        .generate(request(
            vec![message(v1::Role::User, user)],
            Vec::new(),
            false,
            sampling,
        ))
        .await?;
    collect(stream, started, false).await
}

/// A conversation driven by the generator.
#[derive(Debug, Clone)]
pub struct Chat {
    /// The connection.
    client: Client,
    /// Every message so far.
    messages: Vec<v1::Message>,
    /// The handle from the last final chunk (empty before the first turn).
    handle: Vec<u8>,
    /// Messages the server's slot already holds (delta mode sends the rest).
    synced: usize,
    /// Send only new messages.
    delta: bool,
    /// Sampling of every turn.
    sampling: v1::SamplingParams,
}

impl Chat {
    /// A new conversation.
    pub fn new(client: Client, sampling: v1::SamplingParams, delta: bool) -> Self {
        Self {
            client,
            messages: Vec::new(),
            handle: Vec::new(),
            synced: 0,
            delta,
            sampling,
        }
    }

    fn request(&self, pending: &v1::Message, delta: bool) -> v1::GenerateRequest {
        let mut messages: Vec<v1::Message> = if delta {
            self.messages[self.synced..].to_vec()
        } else {
            self.messages.clone()
        };
        messages.push(pending.clone());
        request(messages, self.handle.clone(), delta, &self.sampling)
    }

    /// Sends a user turn and reads the reply. On success the turn and the reply join the
    /// conversation and the handle is renewed; on error the conversation is unchanged.
    pub async fn turn(&mut self, user: String) -> Result<Reply, ChatError> {
        let pending = message(v1::Role::User, user);
        let use_delta = self.delta && !self.handle.is_empty();
        let started = Instant::now();
        let (stream, resent_full) = match self
            .client
            .generate(self.request(&pending, use_delta))
            .await
        {
            Err(e) if use_delta && e.reason == ErrorReason::ContextEvicted => (
                self.client.generate(self.request(&pending, false)).await?,
                true,
            ),
            other => (other?, false),
        };
        let reply = collect(stream, started, resent_full).await?;
        self.messages.push(pending);
        self.messages
            .push(message(v1::Role::Assistant, reply.text.clone()));
        self.handle = reply.final_info.context_handle.clone();
        self.synced = self.messages.len();
        Ok(reply)
    }
}
