//! The `zerolayer.v1` gRPC API shared by every zerolayer service and client.
//!
//! The schema lives in `proto/zerolayer/v1/inference.proto`; this crate only holds the
//! generated code, the descriptor set for server reflection and small helpers for the
//! error-reason convention (see the `.proto` file comment). Protobuf types stay at the
//! edges: services convert them into domain types at the boundary.

#![allow(clippy::doc_markdown, clippy::large_enum_variant, missing_docs)]

pub mod codec;

/// Generated protobuf types and gRPC stubs of package `zerolayer.v1`.
pub mod v1 {
    tonic::include_proto!("zerolayer.v1");
}

/// Encoded `FileDescriptorSet` of the API, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/zerolayer_descriptor.bin"));

/// ASCII metadata key holding the error reason of a failed call (e.g. `CONTEXT_EVICTED`).
pub const ERROR_REASON_METADATA: &str = "zerolayer-error-reason";

/// ASCII metadata key holding a retry hint in milliseconds (rate limits, overload).
pub const RETRY_AFTER_METADATA: &str = "retry-after-ms";

/// `google.rpc.ErrorInfo.domain` of every zerolayer error.
pub const ERROR_DOMAIN: &str = "zerolayer.v1";

impl v1::ErrorReason {
    /// The reason's wire name without the `ERROR_REASON_` prefix, as carried in the
    /// `zerolayer-error-reason` metadata and in `ErrorInfo.reason`.
    pub fn short_name(self) -> &'static str {
        let full = self.as_str_name();
        full.strip_prefix("ERROR_REASON_").unwrap_or(full)
    }

    /// Parses a short name (as produced by [`Self::short_name`]).
    pub fn from_short_name(name: &str) -> Option<Self> {
        Self::from_str_name(&format!("ERROR_REASON_{name}"))
    }
}

#[cfg(test)]
mod tests {
    use super::v1::ErrorReason;

    #[test]
    fn every_error_reason_round_trips_through_its_short_name() {
        for value in 0..=64 {
            let Ok(reason) = ErrorReason::try_from(value) else {
                continue;
            };
            assert_eq!(
                ErrorReason::from_short_name(reason.short_name()),
                Some(reason)
            );
            assert!(!reason.short_name().starts_with("ERROR_REASON_"));
        }
        assert_eq!(ErrorReason::ContextEvicted.short_name(), "CONTEXT_EVICTED");
    }
}
