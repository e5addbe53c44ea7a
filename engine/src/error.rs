//! [`EngineError`]: every way a request (or the engine's start) can fail, with context fields,
//! a machine-readable [`ErrorReason`] and, where waiting helps, a retry hint.

use std::time::Duration;

use zerolayer_handle::HandleError;
use zerolayer_model::{BackendError, SamplingError};

use crate::api::ErrorReason;

/// Retry hint of [`EngineError::Overloaded`]: about one decode step of a full batch of a small
/// model on a few cores; long enough that a retry storm does not refill the queue at once.
pub const OVERLOADED_RETRY_AFTER: Duration = Duration::from_millis(100);
/// Retry hint of [`EngineError::SessionBusy`]: a conversation's previous turn usually ends
/// within a few hundred milliseconds of decode.
pub const SESSION_BUSY_RETRY_AFTER: Duration = Duration::from_millis(250);
/// Retry hint of [`EngineError::KvCacheOverflow`]: running sequences release their blocks as
/// they finish; a second is a typical turn length.
pub const KV_OVERFLOW_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Retry hint of [`EngineError::Unavailable`]: a restarted engine takes about a second to load
/// a small model.
pub const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Why the engine refused or failed a request (or could not start).
///
/// Messages never contain prompt text, handle bytes or anything about other tenants' slots.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The presented context handle was refused. [`HandleError::Expired`] maps to
    /// `HANDLE_EXPIRED`, [`HandleError::TenantMismatch`] to `TENANT_MISMATCH`, the rest to
    /// `INVALID_HANDLE`.
    #[error("context handle refused: {0}")]
    InvalidHandle(#[from] HandleError),
    /// Delta mode needs the conversation's slot, and it is gone or changed.
    #[error("the conversation's context is no longer cached ({why}); resend the full transcript")]
    ContextEvicted {
        /// Which condition failed (`slot evicted`, `epoch changed`, …).
        why: &'static str,
    },
    /// Another request of the same conversation is running and did not finish in time.
    #[error("another request of this conversation is running (waited {waited_ms} ms)")]
    SessionBusy {
        /// How long this request waited for the slot, in milliseconds.
        waited_ms: u64,
    },
    /// Prompt plus `max_tokens` do not fit the context window (and truncation was not asked
    /// for, or cannot help).
    #[error(
        "prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context window of {window} tokens"
    )]
    ContextLengthExceeded {
        /// Prompt tokens (after KV reuse substitutions and truncation, if any).
        prompt_tokens: u32,
        /// Requested (or default) generated tokens.
        max_tokens: u32,
        /// The model's context window.
        window: u32,
    },
    /// The KV pool cannot hold the request even after every idle slot was evicted.
    #[error(
        "KV cache overflow: the request needs {needed_blocks} more blocks, {free_blocks} are free after evicting idle conversations"
    )]
    KvCacheOverflow {
        /// Blocks the request still needs.
        needed_blocks: u32,
        /// Blocks free after eviction.
        free_blocks: u32,
    },
    /// The admission queue is full (load shedding).
    #[error("engine overloaded: {queue_depth} requests queued (limit {max_queue})")]
    Overloaded {
        /// Requests waiting for admission when this one arrived.
        queue_depth: u32,
        /// The configured limit.
        max_queue: u32,
    },
    /// A message of the prompt contains a string the tenant forbids.
    #[error("message {message_index} contains a string this tenant may not send")]
    SafetyViolation {
        /// Index of the first offending message in the request.
        message_index: u32,
    },
    /// The request is malformed (checked again here although the service edge validates).
    #[error("invalid request: {reason}")]
    InvalidRequest {
        /// What is wrong.
        reason: String,
    },
    /// Engine configuration rejected at start.
    #[error("invalid engine configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
    /// The backend failed a step (a bug: the scheduler only sends valid steps).
    #[error("backend failure: {reason}")]
    Backend {
        /// The backend's error, rendered.
        reason: String,
    },
    /// A bug or an environment failure (no entropy, a scheduler panic).
    #[error("internal engine error: {reason}")]
    Internal {
        /// What happened.
        reason: String,
    },
    /// The engine is shutting down, stopped, or failed and no longer serves.
    #[error("engine unavailable: {reason}")]
    Unavailable {
        /// Why.
        reason: &'static str,
    },
}

impl EngineError {
    /// The machine-readable reason (metric label, wire reason).
    pub fn reason(&self) -> ErrorReason {
        match self {
            Self::InvalidHandle(HandleError::Expired { .. }) => ErrorReason::HandleExpired,
            Self::InvalidHandle(HandleError::TenantMismatch) => ErrorReason::TenantMismatch,
            Self::InvalidHandle(_) => ErrorReason::InvalidHandle,
            Self::ContextEvicted { .. } => ErrorReason::ContextEvicted,
            Self::SessionBusy { .. } => ErrorReason::SessionBusy,
            Self::ContextLengthExceeded { .. } => ErrorReason::ContextLengthExceeded,
            Self::KvCacheOverflow { .. } => ErrorReason::KvCacheOverflow,
            Self::Overloaded { .. } => ErrorReason::Overloaded,
            Self::SafetyViolation { .. } => ErrorReason::SafetyViolation,
            Self::InvalidRequest { .. } => ErrorReason::InvalidRequest,
            Self::InvalidConfig { .. } | Self::Backend { .. } | Self::Internal { .. } => {
                ErrorReason::Internal
            }
            Self::Unavailable { .. } => ErrorReason::EngineUnavailable,
        }
    }

    /// When a retry may succeed: `Some` for overload, a busy session, a full KV pool and an
    /// unavailable engine; `None` where retrying the same request cannot help.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Overloaded { .. } => Some(OVERLOADED_RETRY_AFTER),
            Self::SessionBusy { .. } => Some(SESSION_BUSY_RETRY_AFTER),
            Self::KvCacheOverflow { .. } => Some(KV_OVERFLOW_RETRY_AFTER),
            Self::Unavailable { .. } => Some(UNAVAILABLE_RETRY_AFTER),
            _ => None,
        }
    }

    /// Shorthand for [`EngineError::InvalidRequest`].
    pub(crate) fn invalid(reason: impl Into<String>) -> Self {
        Self::InvalidRequest {
            reason: reason.into(),
        }
    }

    /// Shorthand for [`EngineError::InvalidConfig`].
    pub(crate) fn config(reason: impl Into<String>) -> Self {
        Self::InvalidConfig {
            reason: reason.into(),
        }
    }
}

impl From<BackendError> for EngineError {
    fn from(e: BackendError) -> Self {
        Self::Backend {
            reason: e.to_string(),
        }
    }
}

impl From<SamplingError> for EngineError {
    fn from(e: SamplingError) -> Self {
        Self::invalid(format!("sampling: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_errors_map_to_their_own_reasons() {
        let expired = EngineError::from(HandleError::Expired {
            expires_at: 1,
            now: 2,
        });
        assert_eq!(expired.reason(), ErrorReason::HandleExpired);
        assert_eq!(
            EngineError::from(HandleError::TenantMismatch).reason(),
            ErrorReason::TenantMismatch
        );
        for e in [
            HandleError::Truncated { len: 3 },
            HandleError::TooLong { len: 300 },
            HandleError::UnknownVersion(9),
            HandleError::ReservedFlags(1),
            HandleError::UnknownKey(4),
            HandleError::BadSignature,
        ] {
            assert_eq!(
                EngineError::from(e).reason(),
                ErrorReason::InvalidHandle,
                "{e:?}"
            );
        }
    }

    #[test]
    fn only_transient_failures_carry_a_retry_hint() {
        assert_eq!(
            EngineError::Overloaded {
                queue_depth: 1,
                max_queue: 1
            }
            .retry_after(),
            Some(OVERLOADED_RETRY_AFTER)
        );
        assert_eq!(
            EngineError::SessionBusy { waited_ms: 5 }.retry_after(),
            Some(SESSION_BUSY_RETRY_AFTER)
        );
        assert!(EngineError::invalid("x").retry_after().is_none());
        assert!(
            EngineError::ContextEvicted {
                why: "slot evicted"
            }
            .retry_after()
            .is_none()
        );
    }
}
