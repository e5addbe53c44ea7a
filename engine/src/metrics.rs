//! [`EngineMetrics`]: plain atomics written by the scheduler (and the request path) and read
//! lock-free by the services, which render them as Prometheus text.
//!
//! Counters only grow; gauges are set. Every read is `Relaxed`: values are independent and a
//! scrape needs no consistency between them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use zerolayer_handle::HandleError;

use crate::api::{ErrorReason, FinishReason, ReuseOutcome};

/// Upper bounds (inclusive) of the batch-size histogram buckets, in sequences per step; the
/// last bucket ([`EngineMetrics::batch_size_buckets`]`[BATCH_SIZE_BUCKETS.len()]`) counts
/// larger steps. Powers of two up to the largest useful CPU batch.
pub const BATCH_SIZE_BUCKETS: [u64; 8] = [1, 2, 4, 8, 16, 32, 64, 128];
/// Upper bounds (inclusive) of the time-to-first-token histogram, in nanoseconds: 1 ms to
/// 30 s, roughly ×2.5 apart (cached turns land in the low buckets, cold long prompts high).
pub const TTFT_BUCKETS_NS: [u64; 12] = [
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    5_000_000_000,
    30_000_000_000,
];

/// Finish reasons, in the order of [`EngineMetrics::finished`].
pub const FINISH_REASONS: [FinishReason; 5] = [
    FinishReason::Stop,
    FinishReason::Length,
    FinishReason::StopSequence,
    FinishReason::Safety,
    FinishReason::Cancelled,
];

/// Stable label of a finish reason (metric label, wire name in lower case).
pub fn finish_reason_label(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::StopSequence => "stop_sequence",
        FinishReason::Safety => "safety",
        FinishReason::Cancelled => "cancelled",
    }
}

/// Reuse outcomes, in the order of [`EngineMetrics::reuse`].
pub const REUSE_OUTCOMES: [ReuseOutcome; 4] = [
    ReuseOutcome::New,
    ReuseOutcome::Hit,
    ReuseOutcome::Miss,
    ReuseOutcome::Disabled,
];

/// Stable label of a reuse outcome.
pub fn reuse_label(r: ReuseOutcome) -> &'static str {
    match r {
        ReuseOutcome::New => "new",
        ReuseOutcome::Hit => "hit",
        ReuseOutcome::Miss => "miss",
        ReuseOutcome::Disabled => "disabled",
    }
}

/// Engine counters and gauges. Shared as `Arc<EngineMetrics>`; all fields are public atomics
/// so a renderer reads them without locks.
#[derive(Debug, Default)]
pub struct EngineMetrics {
    /// Requests that finished normally, by finish reason (index: [`FINISH_REASONS`]).
    pub finished: [AtomicU64; 5],
    /// Requests that ended with an error, by reason (index: position in [`ErrorReason::ALL`]).
    pub errors: [AtomicU64; 14],
    /// Requests by cache outcome (index: [`REUSE_OUTCOMES`]).
    pub reuse: [AtomicU64; 4],
    /// Handles authenticated by byte equality with the slot's last issued handle.
    pub handle_fast_path: AtomicU64,
    /// Handles authenticated by a full Ed25519 verify.
    pub handle_full_verify: AtomicU64,
    /// Handles refused, by [`HandleError::reason`] (index: position in [`HandleError::REASONS`]).
    pub handle_rejected: [AtomicU64; 8],
    /// Slots evicted (LRU, map or pool pressure), total.
    pub slot_evictions: AtomicU64,
    /// Slots holding a conversation now (idle + in use), gauge.
    pub slots_live: AtomicU64,
    /// Slot capacity, gauge.
    pub slots_capacity: AtomicU64,
    /// KV blocks in the pool, gauge.
    pub kv_blocks_total: AtomicU64,
    /// KV blocks held by slots or running sequences, gauge.
    pub kv_blocks_used: AtomicU64,
    /// Token positions per KV block, gauge.
    pub kv_block_size: AtomicU64,
    /// Requests waiting for admission, gauge.
    pub queue_depth: AtomicU64,
    /// Sequences running (admitted, not finished), gauge.
    pub running: AtomicU64,
    /// Forward steps run, total.
    pub steps: AtomicU64,
    /// Sequences in the last step, gauge.
    pub last_batch_size: AtomicU64,
    /// Sum of sequences over all steps (mean batch = this / `steps`).
    pub batch_size_sum: AtomicU64,
    /// Steps by batch size (buckets: [`BATCH_SIZE_BUCKETS`], then one for larger).
    pub batch_size_buckets: [AtomicU64; 9],
    /// Tokens in all steps (decode + prefill), total.
    pub step_tokens: AtomicU64,
    /// Prompt tokens computed (prefilled), total.
    pub prefill_tokens: AtomicU64,
    /// Prompt tokens served from the KV cache, total.
    pub cached_prompt_tokens: AtomicU64,
    /// Tokens generated (sampled), total.
    pub decode_tokens: AtomicU64,
    /// Time-to-first-token histogram (buckets: [`TTFT_BUCKETS_NS`], then one for larger).
    pub ttft_buckets: [AtomicU64; 13],
    /// Sum of time-to-first-token, nanoseconds.
    pub ttft_ns_sum: AtomicU64,
    /// Requests that produced a first token (the histogram's count).
    pub ttft_count: AtomicU64,
    /// Wall time spent in forward steps, nanoseconds.
    pub step_ns_sum: AtomicU64,
    /// Whether the scheduler is alive (false after a panic or once it stopped).
    pub healthy: AtomicBool,
}

/// Adds `n` to a counter.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Sets a gauge.
pub(crate) fn set(c: &AtomicU64, v: u64) {
    c.store(v, Ordering::Relaxed);
}

impl EngineMetrics {
    /// Counts a finished request.
    pub(crate) fn count_finished(&self, r: FinishReason) {
        let i = FINISH_REASONS.iter().position(|&x| x == r).unwrap_or(0);
        add(&self.finished[i], 1);
    }

    /// Counts a failed request.
    pub(crate) fn count_error(&self, r: ErrorReason) {
        let i = ErrorReason::ALL.iter().position(|&x| x == r).unwrap_or(0);
        add(&self.errors[i], 1);
    }

    /// Counts a request's cache outcome.
    pub(crate) fn count_reuse(&self, r: ReuseOutcome) {
        let i = REUSE_OUTCOMES.iter().position(|&x| x == r).unwrap_or(0);
        add(&self.reuse[i], 1);
    }

    /// Counts a refused handle.
    pub(crate) fn count_handle_rejected(&self, e: &HandleError) {
        let i = HandleError::REASONS
            .iter()
            .position(|&x| x == e.reason())
            .unwrap_or(0);
        add(&self.handle_rejected[i], 1);
    }

    /// Records one step of `batch` sequences and `tokens` tokens taking `ns`.
    pub(crate) fn record_step(&self, batch: usize, tokens: usize, ns: u64) {
        add(&self.steps, 1);
        set(&self.last_batch_size, batch as u64);
        add(&self.batch_size_sum, batch as u64);
        let b = BATCH_SIZE_BUCKETS
            .iter()
            .position(|&x| batch as u64 <= x)
            .unwrap_or(BATCH_SIZE_BUCKETS.len());
        add(&self.batch_size_buckets[b], 1);
        add(&self.step_tokens, tokens as u64);
        add(&self.step_ns_sum, ns);
    }

    /// Records a time to first token.
    pub(crate) fn record_ttft(&self, ns: u64) {
        let b = TTFT_BUCKETS_NS
            .iter()
            .position(|&x| ns <= x)
            .unwrap_or(TTFT_BUCKETS_NS.len());
        add(&self.ttft_buckets[b], 1);
        add(&self.ttft_ns_sum, ns);
        add(&self.ttft_count, 1);
    }

    /// Reads a counter or gauge.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    /// Finished requests with reason `r`.
    pub fn finished_count(&self, r: FinishReason) -> u64 {
        FINISH_REASONS
            .iter()
            .position(|&x| x == r)
            .map_or(0, |i| Self::get(&self.finished[i]))
    }

    /// Failed requests with reason `r`.
    pub fn error_count(&self, r: ErrorReason) -> u64 {
        ErrorReason::ALL
            .iter()
            .position(|&x| x == r)
            .map_or(0, |i| Self::get(&self.errors[i]))
    }

    /// Requests with cache outcome `r`.
    pub fn reuse_count(&self, r: ReuseOutcome) -> u64 {
        REUSE_OUTCOMES
            .iter()
            .position(|&x| x == r)
            .map_or(0, |i| Self::get(&self.reuse[i]))
    }

    /// Handles refused with the [`HandleError::reason`] label `reason`.
    pub fn handle_rejected_count(&self, reason: &str) -> u64 {
        HandleError::REASONS
            .iter()
            .position(|&x| x == reason)
            .map_or(0, |i| Self::get(&self.handle_rejected[i]))
    }

    /// Whether the scheduler is alive.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_put_values_in_the_first_bucket_that_holds_them() {
        let m = EngineMetrics::default();
        m.record_step(1, 1, 10);
        m.record_step(3, 3, 10);
        m.record_step(500, 500, 10);
        let b: Vec<u64> = m
            .batch_size_buckets
            .iter()
            .map(EngineMetrics::get)
            .collect();
        assert_eq!(b, [1, 0, 1, 0, 0, 0, 0, 0, 1]);
        assert_eq!(EngineMetrics::get(&m.batch_size_sum), 504);
        m.record_ttft(2_000_000);
        assert_eq!(EngineMetrics::get(&m.ttft_buckets[1]), 1);
    }

    #[test]
    fn labelled_counters_read_back_by_label() {
        let m = EngineMetrics::default();
        m.count_error(ErrorReason::SessionBusy);
        m.count_finished(FinishReason::Safety);
        m.count_handle_rejected(&HandleError::BadSignature);
        m.count_reuse(ReuseOutcome::Hit);
        assert_eq!(m.error_count(ErrorReason::SessionBusy), 1);
        assert_eq!(m.error_count(ErrorReason::Internal), 0);
        assert_eq!(m.finished_count(FinishReason::Safety), 1);
        assert_eq!(m.handle_rejected_count("bad_signature"), 1);
        assert_eq!(m.reuse_count(ReuseOutcome::Hit), 1);
    }
}
