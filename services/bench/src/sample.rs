//! One raw sample per request: what was sent, when, how long it took, what the engine reused,
//! or why it failed. Reports keep every sample so that any figure can be recomputed.

use std::time::Duration;

use zerolayer_client::ReuseOutcome;

use crate::{chat::Reply, workload::Level};

/// Error reason recorded when the generator's own per-request time limit expired (not a
/// server reason: the server never answered in time).
pub const CLIENT_TIMEOUT: &str = "CLIENT_TIMEOUT";

/// One request.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    /// Mode or endpoint label (`collapsed`, `split`, `layered`, …).
    pub mode: String,
    /// Workload kind (`multi-turn`, `single-shot`, `staged`).
    pub workload: String,
    /// Round number (0-based) of an interleaved comparison.
    pub round: usize,
    /// The configured load level.
    pub level: Level,
    /// Requests of this level in flight when this one started, itself included (the
    /// concurrency the server actually saw).
    pub in_flight: usize,
    /// Conversation number within the level (single-shot: the request number).
    pub conversation: u64,
    /// Turn number within the conversation, from 1.
    pub turn: u32,
    /// Start time since the beginning of the benchmark, in milliseconds (open loop: the
    /// scheduled arrival time, so a late dispatch counts as latency).
    pub start_ms: f64,
    /// Time to the first chunk carrying tokens, in milliseconds (`None` on error).
    pub ttft_ms: Option<f64>,
    /// Gaps between consecutive token-carrying chunks, in milliseconds (one chunk per
    /// generated token with default stream options).
    pub itl_ms: Vec<f64>,
    /// Time to the end of the stream, in milliseconds (on error: time to the error).
    pub e2e_ms: f64,
    /// Prompt tokens (whole history).
    pub prompt_tokens: u32,
    /// Prompt tokens served from the engine's slot.
    pub cached_tokens: u32,
    /// Prompt tokens the engine computed.
    pub prefilled_tokens: u32,
    /// Generated tokens.
    pub generated_tokens: u32,
    /// Cache outcome (`new`, `hit`, `miss`, `disabled`; empty on error).
    pub reuse: String,
    /// Delta mode met `CONTEXT_EVICTED` and the client resent the full transcript.
    pub resent_full: bool,
    /// Engine-side queue time, in milliseconds.
    pub server_queue_ms: f64,
    /// Engine-side prefill time, in milliseconds.
    pub server_prefill_ms: f64,
    /// Engine-side decode time, in milliseconds.
    pub server_decode_ms: f64,
    /// Error reason (`CONTEXT_EVICTED`, `OVERLOADED`, [`CLIENT_TIMEOUT`], …); `None` on success.
    pub error: Option<String>,
    /// The error's message, cut to [`MAX_ERROR_MESSAGE`] bytes.
    pub error_message: Option<String>,
}

/// Longest error message kept per sample: enough to tell causes apart, bounded so that a
/// flood of failures cannot bloat the report.
pub const MAX_ERROR_MESSAGE: usize = 200;

/// Where a request sits in the workload.
#[derive(Debug, Clone)]
pub struct SampleKey {
    /// Mode or endpoint label.
    pub mode: String,
    /// Workload kind name.
    pub workload: &'static str,
    /// Round number.
    pub round: usize,
    /// Configured level.
    pub level: Level,
    /// Requests in flight at start, itself included.
    pub in_flight: usize,
    /// Conversation number.
    pub conversation: u64,
    /// Turn number from 1.
    pub turn: u32,
    /// Start since the benchmark began.
    pub start: Duration,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ns_ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn reuse_name(r: ReuseOutcome) -> &'static str {
    match r {
        ReuseOutcome::New => "new",
        ReuseOutcome::Hit => "hit",
        ReuseOutcome::Miss => "miss",
        ReuseOutcome::Disabled => "disabled",
        ReuseOutcome::Unspecified => "unspecified",
    }
}

impl Sample {
    /// A successful request. `delay` is the time between the scheduled start and the actual
    /// call (open loop), added to TTFT and e2e.
    pub fn ok(key: SampleKey, reply: &Reply, delay: Duration) -> Self {
        let usage = reply.final_info.usage.unwrap_or_default();
        let timings = reply.final_info.timings.unwrap_or_default();
        let reuse =
            ReuseOutcome::try_from(reply.final_info.reuse).unwrap_or(ReuseOutcome::Unspecified);
        Self {
            itl_ms: reply
                .token_times
                .windows(2)
                .map(|w| ms(w[1].saturating_sub(w[0])))
                .collect(),
            ttft_ms: reply.ttft().map(|t| ms(t + delay)),
            e2e_ms: ms(reply.e2e + delay),
            prompt_tokens: usage.prompt_tokens,
            cached_tokens: usage.cached_prompt_tokens,
            prefilled_tokens: usage.prefilled_prompt_tokens,
            generated_tokens: usage.generated_tokens,
            reuse: reuse_name(reuse).to_owned(),
            resent_full: reply.resent_full,
            server_queue_ms: ns_ms(timings.queue_ns),
            server_prefill_ms: ns_ms(timings.prefill_ns),
            server_decode_ms: ns_ms(timings.decode_ns),
            error: None,
            error_message: None,
            ..Self::blank(key)
        }
    }

    /// A failed request.
    pub fn failed(key: SampleKey, elapsed: Duration, reason: &str, message: &str) -> Self {
        let mut message = message.to_owned();
        if message.len() > MAX_ERROR_MESSAGE {
            let mut cut = MAX_ERROR_MESSAGE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        Self {
            e2e_ms: ms(elapsed),
            error: Some(reason.to_owned()),
            error_message: Some(message),
            ..Self::blank(key)
        }
    }

    fn blank(key: SampleKey) -> Self {
        Self {
            mode: key.mode,
            workload: key.workload.to_owned(),
            round: key.round,
            level: key.level,
            in_flight: key.in_flight,
            conversation: key.conversation,
            turn: key.turn,
            start_ms: ms(key.start),
            ttft_ms: None,
            itl_ms: Vec::new(),
            e2e_ms: 0.0,
            prompt_tokens: 0,
            cached_tokens: 0,
            prefilled_tokens: 0,
            generated_tokens: 0,
            reuse: String::new(),
            resent_full: false,
            server_queue_ms: 0.0,
            server_prefill_ms: 0.0,
            server_decode_ms: 0.0,
            error: None,
            error_message: None,
        }
    }

    /// True when the request succeeded.
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
    }
}

#[cfg(test)]
mod tests {
    use zerolayer_proto::v1;

    use super::*;

    fn key() -> SampleKey {
        SampleKey {
            mode: "split".into(),
            workload: "multi-turn",
            round: 0,
            level: Level::Concurrency(1),
            in_flight: 1,
            conversation: 0,
            turn: 1,
            start: Duration::ZERO,
        }
    }

    fn reply(times_ms: &[u64], e2e_ms: u64) -> Reply {
        Reply {
            text: String::new(),
            token_times: times_ms.iter().map(|t| Duration::from_millis(*t)).collect(),
            e2e: Duration::from_millis(e2e_ms),
            final_info: v1::FinalInfo {
                usage: Some(v1::Usage {
                    prompt_tokens: 10,
                    cached_prompt_tokens: 4,
                    ..Default::default()
                }),
                reuse: v1::ReuseOutcome::Hit as i32,
                ..Default::default()
            },
            resent_full: false,
        }
    }

    #[test]
    fn samples_take_ttft_from_the_first_token_and_gaps_between_token_chunks() {
        let s = Sample::ok(key(), &reply(&[10, 12, 15], 16), Duration::ZERO);
        assert_eq!(s.ttft_ms, Some(10.0));
        assert_eq!(s.itl_ms, vec![2.0, 3.0]);
        assert_eq!(s.e2e_ms, 16.0);
        assert_eq!(s.reuse, "hit");
        assert_eq!((s.prompt_tokens, s.cached_tokens), (10, 4));
        assert!(s.is_ok());
    }

    #[test]
    fn open_loop_dispatch_delay_counts_as_latency() {
        let s = Sample::ok(key(), &reply(&[10, 12, 15], 16), Duration::from_millis(5));
        assert_eq!(s.ttft_ms, Some(15.0));
        assert_eq!(s.e2e_ms, 21.0);
        // Gaps between tokens do not include the dispatch delay.
        assert_eq!(s.itl_ms, vec![2.0, 3.0]);
    }

    #[test]
    fn a_reply_without_tokens_has_no_ttft_and_no_gaps() {
        let s = Sample::ok(key(), &reply(&[], 4), Duration::ZERO);
        assert_eq!(s.ttft_ms, None);
        assert!(s.itl_ms.is_empty());
    }

    #[test]
    fn error_messages_are_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_ERROR_MESSAGE);
        let s = Sample::failed(key(), Duration::from_millis(3), "OVERLOADED", &long);
        let m = s.error_message.unwrap();
        assert!(m.len() <= MAX_ERROR_MESSAGE && !m.is_empty());
        assert_eq!(s.error.as_deref(), Some("OVERLOADED"));
        assert!(s.ttft_ms.is_none());
    }
}
