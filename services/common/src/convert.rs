//! Protobuf ↔ domain conversions at the service edge.
//!
//! Requests become validated [`zerolayer_engine::api::GenerateRequest`]s here (nothing
//! downstream sees a raw protobuf request); engine events become `GenerateChunk`s.

use zerolayer_engine::api::{
    ContextState, Event, FinalInfo, FinishReason, GenerateRequest, Message, ProbeReport,
    ReuseOutcome, Role, SamplingOptions, Timings, Truncation, Usage, ValidateReport,
};
use zerolayer_proto::v1;

use crate::error::ApiError;

/// Most messages one request may carry (a conversation longer than this is a client bug or
/// an attack; real chats stay far below).
pub const MAX_MESSAGES: usize = 1024;
/// Most UTF-8 bytes of message content per request: 1 MiB (well above any context window
/// of the supported models; the gRPC decoding limit is 4 MiB).
pub const MAX_CONTENT_BYTES: usize = 1 << 20;
/// Most stop sequences per request (OpenAI's API allows 4; TGI 4; we allow 8).
pub const MAX_STOP_SEQUENCES: usize = 8;
/// Longest stop sequence in bytes.
pub const MAX_STOP_BYTES: usize = 64;
/// Longest client-chosen request id in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 64;
/// Largest context handle accepted at the edge; real handles are smaller (docs/handle.md),
/// the engine checks the exact length.
pub const MAX_HANDLE_BYTES: usize = 128;

/// Converts and validates a protobuf request. `request_id` is replaced by a fresh random id
/// when the client sent none.
pub fn generate_request(req: v1::GenerateRequest) -> Result<GenerateRequest, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages: at least one message is required",
        ));
    }
    if req.messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid(format!(
            "messages: {} messages exceed the limit of {MAX_MESSAGES}",
            req.messages.len()
        )));
    }
    let total: usize = req.messages.iter().map(|m| m.content.len()).sum();
    if total > MAX_CONTENT_BYTES {
        return Err(ApiError::invalid(format!(
            "messages: {total} bytes of content exceed the limit of {MAX_CONTENT_BYTES}"
        )));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.into_iter().enumerate() {
        let role = match v1::Role::try_from(m.role) {
            Ok(v1::Role::System) => Role::System,
            Ok(v1::Role::User) => Role::User,
            Ok(v1::Role::Assistant) => Role::Assistant,
            Ok(v1::Role::Unspecified) | Err(_) => {
                return Err(ApiError::invalid(format!(
                    "messages[{i}].role: missing or unknown"
                )));
            }
        };
        if role == Role::System && (i > 0 || req.delta) {
            return Err(ApiError::invalid(format!(
                "messages[{i}]: a system message may only open a full transcript"
            )));
        }
        messages.push(Message {
            role,
            content: m.content,
        });
    }
    if req.context_handle.len() > MAX_HANDLE_BYTES {
        return Err(ApiError::new(
            zerolayer_engine::api::ErrorReason::InvalidHandle,
            format!(
                "context_handle: {} bytes exceed {MAX_HANDLE_BYTES}",
                req.context_handle.len()
            ),
        ));
    }
    if req.delta && req.context_handle.is_empty() {
        return Err(ApiError::invalid(
            "delta: delta mode requires a context_handle",
        ));
    }
    let truncation = match v1::TruncationPolicy::try_from(req.truncation) {
        Ok(v1::TruncationPolicy::Reject) => Truncation::Reject,
        Ok(v1::TruncationPolicy::Left) => Truncation::Left,
        Err(_) => return Err(ApiError::invalid("truncation: unknown policy")),
    };
    let sampling = sampling_options(req.sampling.unwrap_or_default())?;
    let request_id = request_id(req.request_id)?;
    let handle = (!req.context_handle.is_empty()).then(|| req.context_handle.to_vec());
    Ok(GenerateRequest {
        messages,
        handle,
        delta: req.delta,
        sampling,
        truncation,
        request_id,
    })
}

fn sampling_options(s: v1::SamplingParams) -> Result<SamplingOptions, ApiError> {
    if s.max_tokens == Some(0) {
        return Err(ApiError::invalid("sampling.max_tokens: must be at least 1"));
    }
    let temperature = s.temperature.unwrap_or(0.0);
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(ApiError::invalid(format!(
            "sampling.temperature: {temperature} is not a finite number >= 0"
        )));
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(format!(
            "sampling.top_p: {top_p} is outside (0, 1]"
        )));
    }
    if s.stop.len() > MAX_STOP_SEQUENCES {
        return Err(ApiError::invalid(format!(
            "sampling.stop: {} sequences exceed the limit of {MAX_STOP_SEQUENCES}",
            s.stop.len()
        )));
    }
    if let Some(bad) = s
        .stop
        .iter()
        .find(|x| x.is_empty() || x.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::invalid(format!(
            "sampling.stop: each sequence must be 1..={MAX_STOP_BYTES} bytes (got {})",
            bad.len()
        )));
    }
    Ok(SamplingOptions {
        max_tokens: s.max_tokens,
        temperature,
        top_k: s.top_k,
        top_p,
        seed: s.seed,
        stop: s.stop,
    })
}

fn request_id(id: String) -> Result<String, ApiError> {
    if id.is_empty() {
        return Ok(new_request_id());
    }
    if id.len() > MAX_REQUEST_ID_BYTES || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiError::invalid(format!(
            "request_id: must be 1..={MAX_REQUEST_ID_BYTES} printable ASCII characters"
        )));
    }
    Ok(id)
}

/// A fresh random request id (16 hex characters).
pub fn new_request_id() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut bytes = [0u8; 8];
    // getrandom only fails when the OS has no entropy source at all; a process-unique
    // counter then still keeps ids distinct (they only correlate logs).
    if getrandom::fill(&mut bytes).is_err() {
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        bytes = (n ^ (u64::from(std::process::id()) << 32)).to_le_bytes();
    }
    hex::encode(bytes)
}

/// Protobuf form of a context state.
pub fn context_update(c: &ContextState) -> v1::ContextUpdate {
    v1::ContextUpdate {
        tokens_consumed: c.tokens_consumed,
        kv_offset: c.kv_offset,
        cached_prompt_tokens: c.cached_prompt_tokens,
        prefilled_prompt_tokens: c.prefilled_prompt_tokens,
        generated_tokens: c.generated_tokens,
    }
}

/// Protobuf form of a final event.
pub fn final_info(f: &FinalInfo) -> v1::FinalInfo {
    v1::FinalInfo {
        context_handle: f.handle.clone().unwrap_or_default(),
        finish_reason: finish_reason(f.finish_reason) as i32,
        usage: Some(usage(&f.usage)),
        timings: Some(timings(&f.timings)),
        reuse: reuse_outcome(f.reuse) as i32,
        session_id: f.session_id,
    }
}

fn finish_reason(r: FinishReason) -> v1::FinishReason {
    match r {
        FinishReason::Stop => v1::FinishReason::Stop,
        FinishReason::Length => v1::FinishReason::Length,
        FinishReason::StopSequence => v1::FinishReason::StopSequence,
        FinishReason::Safety => v1::FinishReason::Safety,
        FinishReason::Cancelled => v1::FinishReason::Cancelled,
    }
}

fn reuse_outcome(r: ReuseOutcome) -> v1::ReuseOutcome {
    match r {
        ReuseOutcome::New => v1::ReuseOutcome::New,
        ReuseOutcome::Hit => v1::ReuseOutcome::Hit,
        ReuseOutcome::Miss => v1::ReuseOutcome::Miss,
        ReuseOutcome::Disabled => v1::ReuseOutcome::Disabled,
    }
}

fn usage(u: &Usage) -> v1::Usage {
    v1::Usage {
        prompt_tokens: u.prompt_tokens,
        cached_prompt_tokens: u.cached_prompt_tokens,
        prefilled_prompt_tokens: u.prefilled_prompt_tokens,
        generated_tokens: u.generated_tokens,
        truncated_prompt_tokens: u.truncated_prompt_tokens,
    }
}

fn timings(t: &Timings) -> v1::Timings {
    v1::Timings {
        queue_ns: t.queue_ns,
        prefill_ns: t.prefill_ns,
        decode_ns: t.decode_ns,
        ttft_ns: t.ttft_ns,
    }
}

/// One chunk per engine event, unshaped (see [`crate::shaping`] for per-request shaping).
pub fn chunk_of_event(event: &Event) -> v1::GenerateChunk {
    match event {
        Event::Tokens {
            text,
            token_ids,
            context,
        } => v1::GenerateChunk {
            text: text.clone(),
            token_ids: token_ids.clone(),
            context: Some(context_update(context)),
            r#final: None,
        },
        Event::Finished(f) => v1::GenerateChunk {
            text: String::new(),
            token_ids: Vec::new(),
            context: Some(context_update(&f.context)),
            r#final: Some(final_info(f)),
        },
    }
}

/// Protobuf form of a validation report.
pub fn validate_response(r: &ValidateReport) -> v1::ValidateResponse {
    v1::ValidateResponse {
        prompt_tokens: r.prompt_tokens,
        cached_prompt_tokens: r.cached_prompt_tokens,
        prefill_tokens: r.prefill_tokens,
        max_tokens: r.max_tokens,
        context_window: r.context_window,
        truncated_prompt_tokens: r.truncated_prompt_tokens,
        estimated_flops: r.estimated_flops,
        estimated_cost_tokens: r.prefill_tokens.saturating_add(r.max_tokens),
    }
}

/// Protobuf form of a probe report.
pub fn probe_response(r: &ProbeReport, mode: &str) -> v1::ProbeResponse {
    v1::ProbeResponse {
        token_id: r.token_id,
        queue_ns: r.queue_ns,
        prefill_ns: r.prefill_ns,
        total_ns: r.total_ns,
        model: r.model.clone(),
        mode: mode.to_owned(),
    }
}

/// Collects a whole stream of chunks into the `GenerateBuffered` response.
#[derive(Debug, Default)]
pub struct BufferedCollector {
    response: v1::GenerateBufferedResponse,
}

impl BufferedCollector {
    /// Adds one chunk.
    pub fn push(&mut self, chunk: v1::GenerateChunk) {
        self.response.text.push_str(&chunk.text);
        self.response.token_ids.extend_from_slice(&chunk.token_ids);
        if chunk.context.is_some() {
            self.response.context = chunk.context;
        }
        if chunk.r#final.is_some() {
            self.response.r#final = chunk.r#final;
        }
    }

    /// The collected response; an error if the stream never delivered its final chunk.
    pub fn finish(self) -> Result<v1::GenerateBufferedResponse, ApiError> {
        if self.response.r#final.is_none() {
            return Err(ApiError::internal("stream ended without a final chunk"));
        }
        Ok(self.response)
    }
}

/// Drains a stream of chunks into the `GenerateBuffered` response (the unary bridge).
pub async fn collect_buffered<S>(
    mut stream: S,
) -> Result<v1::GenerateBufferedResponse, tonic::Status>
where
    S: futures::Stream<Item = Result<v1::GenerateChunk, tonic::Status>> + Unpin,
{
    use futures::StreamExt as _;
    let mut collector = BufferedCollector::default();
    while let Some(chunk) = stream.next().await {
        collector.push(chunk?);
    }
    collector.finish().map_err(ApiError::into_status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerolayer_engine::api::ErrorReason;

    fn user(text: &str) -> v1::Message {
        v1::Message {
            role: v1::Role::User as i32,
            content: text.into(),
        }
    }

    fn request(messages: Vec<v1::Message>) -> v1::GenerateRequest {
        v1::GenerateRequest {
            messages,
            ..Default::default()
        }
    }

    #[test]
    fn a_plain_request_converts_with_defaults_and_a_fresh_request_id() {
        let req = generate_request(request(vec![user("hi")])).expect("valid");
        assert_eq!(req.messages, vec![Message::new(Role::User, "hi")]);
        assert_eq!(req.sampling, SamplingOptions::default());
        assert_eq!(req.request_id.len(), 16);
        assert!(req.handle.is_none());
        assert!(!req.delta);
    }

    #[test]
    fn invalid_fields_are_rejected_with_invalid_request_naming_the_field() {
        let cases: Vec<(v1::GenerateRequest, &str)> = vec![
            (request(vec![]), "messages"),
            (
                request(vec![v1::Message {
                    role: 0,
                    content: "x".into(),
                }]),
                "role",
            ),
            (
                request(vec![v1::Message {
                    role: 99,
                    content: "x".into(),
                }]),
                "role",
            ),
            (
                request(vec![
                    user("a"),
                    v1::Message {
                        role: 1,
                        content: "sys".into(),
                    },
                ]),
                "system",
            ),
            (
                v1::GenerateRequest {
                    sampling: Some(v1::SamplingParams {
                        temperature: Some(f32::NAN),
                        ..Default::default()
                    }),
                    ..request(vec![user("a")])
                },
                "temperature",
            ),
            (
                v1::GenerateRequest {
                    sampling: Some(v1::SamplingParams {
                        temperature: Some(-1.0),
                        ..Default::default()
                    }),
                    ..request(vec![user("a")])
                },
                "temperature",
            ),
            (
                v1::GenerateRequest {
                    sampling: Some(v1::SamplingParams {
                        top_p: Some(0.0),
                        ..Default::default()
                    }),
                    ..request(vec![user("a")])
                },
                "top_p",
            ),
            (
                v1::GenerateRequest {
                    sampling: Some(v1::SamplingParams {
                        top_p: Some(1.5),
                        ..Default::default()
                    }),
                    ..request(vec![user("a")])
                },
                "top_p",
            ),
            (
                v1::GenerateRequest {
                    sampling: Some(v1::SamplingParams {
                        max_tokens: Some(0),
                        ..Default::default()
                    }),
                    ..request(vec![user("a")])
                },
                "max_tokens",
            ),
            (
                v1::GenerateRequest {
                    sampling: Some(v1::SamplingParams {
                        stop: vec!["x".repeat(65)],
                        ..Default::default()
                    }),
                    ..request(vec![user("a")])
                },
                "stop",
            ),
            (
                v1::GenerateRequest {
                    delta: true,
                    ..request(vec![user("a")])
                },
                "delta",
            ),
            (
                v1::GenerateRequest {
                    request_id: "bad id".into(),
                    ..request(vec![user("a")])
                },
                "request_id",
            ),
            (
                v1::GenerateRequest {
                    truncation: 7,
                    ..request(vec![user("a")])
                },
                "truncation",
            ),
            (
                request(vec![user(&"x".repeat(MAX_CONTENT_BYTES + 1))]),
                "bytes",
            ),
        ];
        for (req, field) in cases {
            let err = generate_request(req).expect_err(field);
            assert_eq!(err.reason, ErrorReason::InvalidRequest, "{field}: {err}");
            assert!(err.message.contains(field), "{field}: {err}");
        }
    }

    #[test]
    fn an_oversized_handle_is_an_invalid_handle() {
        let req = v1::GenerateRequest {
            context_handle: vec![0u8; MAX_HANDLE_BYTES + 1],
            ..request(vec![user("a")])
        };
        assert_eq!(
            generate_request(req).expect_err("too long").reason,
            ErrorReason::InvalidHandle
        );
    }

    #[test]
    fn buffered_collector_concatenates_chunks_and_requires_a_final_chunk() {
        let mut c = BufferedCollector::default();
        c.push(v1::GenerateChunk {
            text: "a".into(),
            token_ids: vec![1],
            ..Default::default()
        });
        assert!(
            BufferedCollector {
                response: c.response.clone()
            }
            .finish()
            .is_err()
        );
        c.push(v1::GenerateChunk {
            text: "b".into(),
            token_ids: vec![2],
            r#final: Some(v1::FinalInfo::default()),
            ..Default::default()
        });
        let r = c.finish().expect("final present");
        assert_eq!(r.text, "ab");
        assert_eq!(r.token_ids, vec![1, 2]);
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_protobuf_bytes_never_panic_the_conversion(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            use prost::Message as _;
            if let Ok(req) = v1::GenerateRequest::decode(bytes.as_slice()) {
                let _ = generate_request(req);
            }
        }
    }
}
