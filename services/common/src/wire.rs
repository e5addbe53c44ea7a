//! Frames between the front and the engine in split mode (carried by `zerolayer-shm`).
//!
//! The shared-memory channel moves `(request id, kind, payload)` frames; this module fixes
//! the kinds and the payload layouts. Protobuf bytes are forwarded as they are: the front
//! copies the client's encoded `GenerateRequest` into the request frame behind a small
//! envelope, and the engine's encoded `GenerateChunk`s go to the client unchanged.
//!
//! Request frames (front → engine):
//!
//! | kind | payload |
//! |---|---|
//! | [`KIND_GENERATE`], [`KIND_VALIDATE`] | envelope: `u16` LE tenant length, tenant (UTF-8), then the encoded `GenerateRequest` |
//! | [`KIND_PROBE`] | envelope with an empty request |
//!
//! Response frames (engine → front):
//!
//! | kind | payload |
//! |---|---|
//! | [`KIND_CHUNK`] | encoded `GenerateChunk` (not the last) |
//! | [`KIND_FINAL_CHUNK`] | encoded last `GenerateChunk` (with `final`): ends the request |
//! | [`KIND_ERROR`] | `u16` LE reason (`zerolayer.v1.ErrorReason` value), `u32` LE retry-after ms (0 = none), message (UTF-8): ends the request |
//! | [`KIND_VALIDATE_RESPONSE`] | encoded `ValidateResponse`: ends the request |
//! | [`KIND_PROBE_RESPONSE`] | encoded `ProbeResponse`: ends the request |
//!
//! Everything read from a frame is untrusted: parsers return [`WireError`], never panic.

use std::time::Duration;

use zerolayer_proto::v1;

use crate::error::{ApiError, from_proto_reason, to_proto_reason};

/// Request: generate (streamed response).
pub const KIND_GENERATE: u16 = 1;
/// Request: validate.
pub const KIND_VALIDATE: u16 = 2;
/// Request: probe.
pub const KIND_PROBE: u16 = 3;
/// Response: a chunk that is not the last.
pub const KIND_CHUNK: u16 = 16;
/// Response: the last chunk.
pub const KIND_FINAL_CHUNK: u16 = 17;
/// Response: an error that ends the request.
pub const KIND_ERROR: u16 = 18;
/// Response: validation result.
pub const KIND_VALIDATE_RESPONSE: u16 = 19;
/// Response: probe result.
pub const KIND_PROBE_RESPONSE: u16 = 20;

/// Longest tenant name in an envelope (tenant names are short ASCII identifiers).
pub const MAX_TENANT_BYTES: usize = 256;
/// Longest error message carried in an error frame.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4096;

/// A malformed frame payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the fixed part needs.
    #[error("frame payload truncated: {len} bytes, need at least {need}")]
    Truncated {
        /// Bytes present.
        len: usize,
        /// Bytes needed.
        need: usize,
    },
    /// Tenant name longer than [`MAX_TENANT_BYTES`] or beyond the payload.
    #[error("tenant name of {0} bytes is out of bounds")]
    TenantLength(usize),
    /// Tenant or message is not UTF-8.
    #[error("frame text is not UTF-8")]
    NotUtf8,
}

/// Length of the envelope before the request bytes.
pub fn envelope_len(tenant: &str) -> usize {
    2 + tenant.len()
}

/// Writes the envelope into the start of `buf` (which must be `envelope_len` long or
/// longer) and returns the rest of the buffer for the request bytes.
pub fn write_envelope<'a>(buf: &'a mut [u8], tenant: &str) -> Result<&'a mut [u8], WireError> {
    let len = tenant.len();
    if len > MAX_TENANT_BYTES {
        return Err(WireError::TenantLength(len));
    }
    if buf.len() < 2 + len {
        return Err(WireError::Truncated {
            len: buf.len(),
            need: 2 + len,
        });
    }
    let (head, rest) = buf.split_at_mut(2 + len);
    // `len` <= MAX_TENANT_BYTES (256) fits in u16.
    head[..2].copy_from_slice(&(len as u16).to_le_bytes());
    head[2..].copy_from_slice(tenant.as_bytes());
    Ok(rest)
}

/// Splits an envelope into tenant and request bytes.
pub fn read_envelope(payload: &[u8]) -> Result<(&str, &[u8]), WireError> {
    let Some(len_bytes) = payload.get(..2) else {
        return Err(WireError::Truncated {
            len: payload.len(),
            need: 2,
        });
    };
    let len = usize::from(u16::from_le_bytes([len_bytes[0], len_bytes[1]]));
    if len > MAX_TENANT_BYTES {
        return Err(WireError::TenantLength(len));
    }
    let tenant = payload
        .get(2..2 + len)
        .ok_or(WireError::TenantLength(len))?;
    let tenant = std::str::from_utf8(tenant).map_err(|_| WireError::NotUtf8)?;
    Ok((tenant, &payload[2 + len..]))
}

/// Encodes an error frame payload.
pub fn encode_error(err: &ApiError) -> Vec<u8> {
    let message = truncate_utf8(&err.message, MAX_ERROR_MESSAGE_BYTES);
    let mut out = Vec::with_capacity(6 + message.len());
    out.extend_from_slice(&(to_proto_reason(err.reason) as u16).to_le_bytes());
    let retry = err
        .retry_after
        .map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX));
    out.extend_from_slice(&retry.to_le_bytes());
    out.extend_from_slice(message.as_bytes());
    out
}

/// Decodes an error frame payload.
pub fn decode_error(payload: &[u8]) -> Result<ApiError, WireError> {
    if payload.len() < 6 {
        return Err(WireError::Truncated {
            len: payload.len(),
            need: 6,
        });
    }
    let reason = u16::from_le_bytes([payload[0], payload[1]]);
    let retry = u32::from_le_bytes([payload[2], payload[3], payload[4], payload[5]]);
    let message = std::str::from_utf8(&payload[6..]).map_err(|_| WireError::NotUtf8)?;
    let reason = v1::ErrorReason::try_from(i32::from(reason)).unwrap_or(v1::ErrorReason::Internal);
    Ok(ApiError {
        reason: from_proto_reason(reason),
        message: message.to_owned(),
        retry_after: (retry > 0).then(|| Duration::from_millis(u64::from(retry))),
    })
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use zerolayer_engine::api::ErrorReason;

    #[test]
    fn envelopes_round_trip() {
        let request = b"\x0a\x05hello";
        let mut buf = vec![0u8; envelope_len("acme") + request.len()];
        write_envelope(&mut buf, "acme")
            .expect("fits")
            .copy_from_slice(request);
        assert_eq!(read_envelope(&buf).expect("valid"), ("acme", &request[..]));
    }

    #[test]
    fn error_frames_round_trip_for_every_reason() {
        for reason in ErrorReason::ALL {
            let err = ApiError::new(reason, "why").with_retry_after(Duration::from_millis(70));
            assert_eq!(decode_error(&encode_error(&err)).expect("valid"), err);
        }
        let long = ApiError::internal("é".repeat(MAX_ERROR_MESSAGE_BYTES));
        assert!(
            decode_error(&encode_error(&long))
                .expect("valid")
                .message
                .len()
                <= MAX_ERROR_MESSAGE_BYTES
        );
    }

    #[test]
    fn malformed_payloads_are_typed_errors() {
        assert!(matches!(
            read_envelope(&[1]),
            Err(WireError::Truncated { .. })
        ));
        assert!(matches!(
            read_envelope(&[5, 0, b'a']),
            Err(WireError::TenantLength(5))
        ));
        assert!(matches!(
            read_envelope(&[0xff, 0xff]),
            Err(WireError::TenantLength(_))
        ));
        assert!(matches!(
            read_envelope(&[1, 0, 0xff]),
            Err(WireError::NotUtf8)
        ));
        assert!(matches!(
            decode_error(&[1, 0, 0]),
            Err(WireError::Truncated { .. })
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_payloads_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = read_envelope(&bytes);
            let _ = decode_error(&bytes);
        }
    }
}
