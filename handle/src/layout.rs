//! The wire layout of a context handle (format version 1).
//!
//! All integers are little-endian. Bytes `0..SIGNED_LEN` are the signed body; the last 64 bytes
//! are an Ed25519 signature over [`SIGNING_DOMAIN`] ‖ body. `docs/handle.md` carries the same
//! table; a test compares the two.

/// One field of the handle: where it sits in the wire bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// The field's name as used in `docs/handle.md` (snake_case).
    pub name: &'static str,
    /// Byte offset of the field's first byte.
    pub offset: usize,
    /// Length of the field in bytes.
    pub len: usize,
}

impl Field {
    /// The offset one past the field's last byte.
    pub const fn end(self) -> usize {
        self.offset + self.len
    }
}

/// Format version: lets a future layout coexist with this one during an upgrade.
pub const VERSION: Field = Field {
    name: "version",
    offset: 0,
    len: 1,
};
/// Reserved flags: must be zero in version 1 (room for options without a version bump).
pub const FLAGS: Field = Field {
    name: "flags",
    offset: 1,
    len: 1,
};
/// Signing key id (u16): selects the verifying key, so keys can rotate.
pub const KEY_ID: Field = Field {
    name: "key_id",
    offset: 2,
    len: 2,
};
/// Session id (u64): the slot map's key, chosen at random by the server.
pub const SESSION_ID: Field = Field {
    name: "session_id",
    offset: 4,
    len: 8,
};
/// Tenant tag: binds the handle to the authenticated tenant.
pub const TENANT_TAG: Field = Field {
    name: "tenant_tag",
    offset: 12,
    len: 8,
};
/// Prompt hash: binds the handle to the conversation's opening.
pub const PROMPT_HASH: Field = Field {
    name: "prompt_hash",
    offset: 20,
    len: 16,
};
/// KV offset (u32 tokens): how much of the conversation the slot held at issue time.
pub const KV_OFFSET: Field = Field {
    name: "kv_offset",
    offset: 36,
    len: 4,
};
/// Slot epoch (u32): bumped when the slot is truncated or replaced.
pub const EPOCH: Field = Field {
    name: "epoch",
    offset: 40,
    len: 4,
};
/// Expiry (u64 unix seconds): the handle is valid while `now < expires_at`.
pub const EXPIRES_AT: Field = Field {
    name: "expires_at",
    offset: 44,
    len: 8,
};
/// Ed25519 signature over [`SIGNING_DOMAIN`] ‖ bytes `0..SIGNED_LEN`.
pub const SIGNATURE: Field = Field {
    name: "signature",
    offset: 52,
    len: 64,
};

/// Every field in wire order.
pub const FIELDS: [Field; 10] = [
    VERSION,
    FLAGS,
    KEY_ID,
    SESSION_ID,
    TENANT_TAG,
    PROMPT_HASH,
    KV_OFFSET,
    EPOCH,
    EXPIRES_AT,
    SIGNATURE,
];

/// The format version this crate issues and accepts.
pub const FORMAT_VERSION: u8 = 1;

/// Length of the signed body (everything before the signature).
pub const SIGNED_LEN: usize = SIGNATURE.offset;

/// Length of a handle on the wire, in bytes. Design §3 asks for at most 128.
pub const HANDLE_LEN: usize = SIGNATURE.end();

/// Domain-separation prefix of the signing input, so a handle signature can never be confused
/// with a signature the same key makes over anything else. NUL-terminated so no other
/// prefix-free domain string can be a prefix of it.
pub const SIGNING_DOMAIN: &[u8; 20] = b"zerolayer-handle-v1\0";

/// Length of the signing input: [`SIGNING_DOMAIN`] ‖ signed body.
pub const SIGNING_INPUT_LEN: usize = SIGNING_DOMAIN.len() + SIGNED_LEN;

// The fields tile the handle exactly: no gap, no overlap, within the design's 128-byte limit.
const _: () = {
    let mut next = 0;
    let mut i = 0;
    while i < FIELDS.len() {
        assert!(FIELDS[i].offset == next);
        next = FIELDS[i].end();
        i += 1;
    }
    assert!(next == HANDLE_LEN);
    assert!(HANDLE_LEN <= 128);
    assert!(SIGNATURE.len == ed25519_dalek::SIGNATURE_LENGTH);
};

/// The signing input for handle bytes: [`SIGNING_DOMAIN`] ‖ `bytes[..SIGNED_LEN]`.
pub(crate) fn signing_input(bytes: &[u8; HANDLE_LEN]) -> [u8; SIGNING_INPUT_LEN] {
    let mut input = [0u8; SIGNING_INPUT_LEN];
    input[..SIGNING_DOMAIN.len()].copy_from_slice(SIGNING_DOMAIN);
    input[SIGNING_DOMAIN.len()..].copy_from_slice(&bytes[..SIGNED_LEN]);
    input
}

/// Copies field `f` out of handle bytes. `N` must equal `f.len`; every call site passes a
/// constant field with its matching length, and the unit tests exercise each one.
pub(crate) fn read<const N: usize>(bytes: &[u8; HANDLE_LEN], f: Field) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[f.offset..f.end()]);
    out
}

/// Writes `value` into field `f` of handle bytes (`value.len()` must equal `f.len`, as for
/// [`read`]).
pub(crate) fn write(bytes: &mut [u8; HANDLE_LEN], f: Field, value: &[u8]) {
    bytes[f.offset..f.end()].copy_from_slice(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_is_116_bytes_with_a_52_byte_signed_body() {
        assert_eq!(HANDLE_LEN, 116);
        assert_eq!(SIGNED_LEN, 52);
        assert_eq!(SIGNING_INPUT_LEN, 72);
    }

    #[test]
    fn field_names_are_unique() {
        for (i, a) in FIELDS.iter().enumerate() {
            for b in &FIELDS[i + 1..] {
                assert_ne!(a.name, b.name);
            }
        }
    }

    #[test]
    fn signing_input_is_domain_then_body_without_signature() {
        let mut bytes = [0u8; HANDLE_LEN];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = i as u8;
        }
        let input = signing_input(&bytes);
        assert_eq!(&input[..20], SIGNING_DOMAIN);
        assert_eq!(&input[20..], &bytes[..52]);
    }

    #[test]
    fn read_returns_what_write_stored() {
        let mut bytes = [0u8; HANDLE_LEN];
        write(
            &mut bytes,
            EXPIRES_AT,
            &0x0102_0304_0506_0708u64.to_le_bytes(),
        );
        assert_eq!(
            read::<8>(&bytes, EXPIRES_AT),
            0x0102_0304_0506_0708u64.to_le_bytes()
        );
        assert_eq!(
            bytes[EXPIRES_AT.offset], 0x08,
            "little-endian: low byte first"
        );
        assert!(bytes[..EXPIRES_AT.offset].iter().all(|&b| b == 0));
        assert!(bytes[EXPIRES_AT.end()..].iter().all(|&b| b == 0));
    }
}
