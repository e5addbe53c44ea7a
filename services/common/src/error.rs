//! The one mapping between zerolayer error reasons and gRPC statuses.
//!
//! Every error leaves a zerolayer process through [`ApiError::into_status`], which sets the
//! gRPC code of the reason, the ASCII metadata `zerolayer-error-reason`, the rich-error
//! `google.rpc.ErrorInfo` detail and, where known, `retry-after-ms` (see the `.proto` file
//! comment). Clients read it back with [`ApiError::from_status`].

use std::time::Duration;

use tonic::{Code, Status, metadata::MetadataValue};
use tonic_types::{ErrorDetails, StatusExt};
use zerolayer_engine::api::ErrorReason;
use zerolayer_proto::{ERROR_DOMAIN, ERROR_REASON_METADATA, RETRY_AFTER_METADATA, v1};

/// An error on its way to (or back from) the wire: a reason, a human-readable message and an
/// optional retry hint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct ApiError {
    /// Machine-readable reason (also the metric label).
    pub reason: ErrorReason,
    /// Human-readable explanation; never contains prompt text or handle bytes.
    pub message: String,
    /// When the client may retry (rate limits, overload).
    pub retry_after: Option<Duration>,
}

impl ApiError {
    /// An error with no retry hint.
    pub fn new(reason: ErrorReason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            retry_after: None,
        }
    }

    /// Shorthand for [`ErrorReason::InvalidRequest`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorReason::InvalidRequest, message)
    }

    /// Shorthand for [`ErrorReason::Internal`].
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorReason::Internal, message)
    }

    /// Adds a retry hint.
    #[must_use]
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The gRPC status carrying this error (code, message, reason metadata, ErrorInfo detail).
    pub fn into_status(self) -> Status {
        let details = ErrorDetails::with_error_info(
            self.reason.as_str(),
            ERROR_DOMAIN,
            std::collections::HashMap::<String, String>::new(),
        );
        let mut status = Status::with_error_details(grpc_code(self.reason), self.message, details);
        let metadata = status.metadata_mut();
        metadata.insert(
            ERROR_REASON_METADATA,
            MetadataValue::from_static(self.reason.as_str()),
        );
        if let Some(after) = self.retry_after {
            let millis = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
            metadata.insert(RETRY_AFTER_METADATA, MetadataValue::from(millis));
        }
        status
    }

    /// Reads an error back from a status. Statuses without a zerolayer reason (transport
    /// failures, other servers) get a reason derived from their code.
    pub fn from_status(status: &Status) -> Self {
        let reason = reason_of(status);
        let retry_after = status
            .metadata()
            .get(RETRY_AFTER_METADATA)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis);
        Self {
            reason,
            message: status.message().to_owned(),
            retry_after,
        }
    }
}

impl From<ApiError> for Status {
    fn from(err: ApiError) -> Self {
        err.into_status()
    }
}

/// The reason carried by a status: the `zerolayer-error-reason` metadata, else the rich
/// `ErrorInfo` detail, else a reason derived from the gRPC code.
pub fn reason_of(status: &Status) -> ErrorReason {
    let from_metadata = status
        .metadata()
        .get(ERROR_REASON_METADATA)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_reason);
    let from_details = || {
        status
            .get_details_error_info()
            .filter(|info| info.domain == ERROR_DOMAIN)
            .and_then(|info| parse_reason(&info.reason))
    };
    from_metadata
        .or_else(from_details)
        .unwrap_or_else(|| match status.code() {
            Code::Unauthenticated => ErrorReason::Unauthenticated,
            Code::InvalidArgument | Code::OutOfRange => ErrorReason::InvalidRequest,
            Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded => {
                ErrorReason::EngineUnavailable
            }
            Code::ResourceExhausted => ErrorReason::Overloaded,
            _ => ErrorReason::Internal,
        })
}

/// Parses a wire name such as `CONTEXT_EVICTED`.
pub fn parse_reason(name: &str) -> Option<ErrorReason> {
    ErrorReason::ALL.into_iter().find(|r| r.as_str() == name)
}

/// The gRPC code of each reason. docs/api.md documents this table; change both together.
pub fn grpc_code(reason: ErrorReason) -> Code {
    match reason {
        ErrorReason::InvalidHandle => Code::InvalidArgument,
        ErrorReason::HandleExpired => Code::FailedPrecondition,
        ErrorReason::TenantMismatch => Code::PermissionDenied,
        ErrorReason::ContextEvicted => Code::FailedPrecondition,
        ErrorReason::SessionBusy => Code::Aborted,
        ErrorReason::ContextLengthExceeded => Code::InvalidArgument,
        ErrorReason::KvCacheOverflow => Code::ResourceExhausted,
        ErrorReason::RateLimitExceeded => Code::ResourceExhausted,
        ErrorReason::Overloaded => Code::Unavailable,
        ErrorReason::SafetyViolation => Code::PermissionDenied,
        ErrorReason::Unauthenticated => Code::Unauthenticated,
        ErrorReason::InvalidRequest => Code::InvalidArgument,
        ErrorReason::Internal => Code::Internal,
        ErrorReason::EngineUnavailable => Code::Unavailable,
    }
}

/// The protobuf enum value of a reason (for payloads that carry it as a field).
pub fn to_proto_reason(reason: ErrorReason) -> v1::ErrorReason {
    v1::ErrorReason::from_short_name(reason.as_str()).unwrap_or(v1::ErrorReason::Internal)
}

/// The domain reason of a protobuf enum value; `Unspecified` maps to `Internal`.
pub fn from_proto_reason(reason: v1::ErrorReason) -> ErrorReason {
    parse_reason(reason.short_name()).unwrap_or(ErrorReason::Internal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_survives_a_round_trip_through_a_status() {
        for reason in ErrorReason::ALL {
            let err =
                ApiError::new(reason, "explanation").with_retry_after(Duration::from_millis(1500));
            let status = err.clone().into_status();
            assert_eq!(status.code(), grpc_code(reason));
            assert_eq!(ApiError::from_status(&status), err);
        }
    }

    #[test]
    fn reason_is_read_from_error_info_when_metadata_is_missing() {
        let details = ErrorDetails::with_error_info(
            "SESSION_BUSY",
            ERROR_DOMAIN,
            std::collections::HashMap::<String, String>::new(),
        );
        let status = Status::with_error_details(Code::Aborted, "busy", details);
        assert_eq!(reason_of(&status), ErrorReason::SessionBusy);
    }

    #[test]
    fn foreign_statuses_get_a_reason_from_their_code() {
        assert_eq!(
            reason_of(&Status::unavailable("down")),
            ErrorReason::EngineUnavailable
        );
        assert_eq!(
            reason_of(&Status::unauthenticated("who")),
            ErrorReason::Unauthenticated
        );
        assert_eq!(reason_of(&Status::unknown("?")), ErrorReason::Internal);
    }

    #[test]
    fn every_domain_reason_has_a_proto_twin() {
        for reason in ErrorReason::ALL {
            let proto = to_proto_reason(reason);
            assert_ne!(proto, v1::ErrorReason::Unspecified);
            assert_eq!(from_proto_reason(proto), reason);
        }
    }
}
