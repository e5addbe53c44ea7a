//! Value types of the handle format: tenant tag, prompt hash, claims and the wire bytes.

use std::fmt;

use crate::keys::EntropyError;
use crate::layout::{self, FORMAT_VERSION, HANDLE_LEN};
use crate::verify::HandleError;

/// Default lifetime of a handle: 24 hours (design §3).
pub const DEFAULT_TTL_SECS: u64 = 24 * 60 * 60;

/// BLAKE3 derive-key context of the tenant tag. Changing it changes every tag: it is part of
/// the format (see `docs/handle.md`).
const TENANT_TAG_CONTEXT: &str = "zerolayer 2026-11 tenant tag v1";

/// BLAKE3 derive-key context of the prompt hash. Part of the format, like
/// [`TENANT_TAG_CONTEXT`].
const PROMPT_HASH_CONTEXT: &str = "zerolayer 2026-11 prompt hash v1";

/// A short, stable tag for a tenant, derived from the *authenticated* tenant name (never from
/// anything the client sends). A handle carries it so a handle of one tenant is rejected for
/// every other tenant before any slot is looked up.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TenantTag([u8; 8]);

impl TenantTag {
    /// The tag of `tenant`: the first 8 bytes of BLAKE3 in derive-key mode with the context
    /// `"zerolayer 2026-11 tenant tag v1"` over the tenant name's UTF-8 bytes.
    pub fn for_tenant(tenant: &str) -> Self {
        let full = blake3::derive_key(TENANT_TAG_CONTEXT, tenant.as_bytes());
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&full[..8]);
        Self(tag)
    }

    /// A tag from its stored bytes (for example a slot map entry). Request handling should use
    /// [`TenantTag::for_tenant`] on the authenticated tenant instead.
    pub const fn from_bytes(bytes: [u8; 8]) -> Self {
        Self(bytes)
    }

    /// The tag's bytes as they appear in a handle.
    pub const fn as_bytes(&self) -> &[u8; 8] {
        &self.0
    }
}

impl fmt::Debug for TenantTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TenantTag({})", hex::encode(self.0))
    }
}

impl fmt::Display for TenantTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// A 128-bit hash of a conversation's opening: tenant, system prompt and first user message.
/// The engine recomputes it from a request's transcript and compares it with the slot's, so a
/// handle can never attach one conversation's KV cache to another conversation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PromptHash([u8; 16]);

impl PromptHash {
    /// BLAKE3 in derive-key mode, context `"zerolayer 2026-11 prompt hash v1"`, over
    /// `len(tenant) ‖ tenant ‖ len(system) ‖ system ‖ len(first_user) ‖ first_user`, each
    /// length a u64 little-endian byte count; the first 16 bytes of the output. The length
    /// prefixes make the encoding injective: `("ab", "c")` and `("a", "bc")` hash differently.
    pub fn compute(tenant: &str, system: &str, first_user: &str) -> Self {
        let mut hasher = blake3::Hasher::new_derive_key(PROMPT_HASH_CONTEXT);
        for part in [tenant, system, first_user] {
            // usize → u64 is lossless on every platform Rust supports (pointer width ≤ 64).
            hasher.update(&(part.len() as u64).to_le_bytes());
            hasher.update(part.as_bytes());
        }
        let full = hasher.finalize();
        let mut hash = [0u8; 16];
        hash.copy_from_slice(&full.as_bytes()[..16]);
        Self(hash)
    }

    /// A hash from its stored bytes (for example a slot map entry).
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The hash's bytes as they appear in a handle.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Debug for PromptHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PromptHash({})", hex::encode(self.0))
    }
}

impl fmt::Display for PromptHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// What a handle asserts, signed by the engine. Everything except the key id and the
/// signature; the key id is chosen by the [`crate::KeyRing`] that signs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Claims {
    /// The slot map key: a random u64 chosen by the server on the first turn (see
    /// [`random_session_id`]), so clients cannot guess other sessions' ids.
    pub session_id: u64,
    /// The tenant the handle was issued to; checked against the authenticated tenant.
    pub tenant: TenantTag,
    /// Hash of the conversation's opening; the engine compares it with the slot's.
    pub prompt_hash: PromptHash,
    /// Tokens of this conversation held in the slot when the handle was issued. A handle
    /// behind the slot means an older branch: the engine truncates the slot to it.
    pub kv_offset: u32,
    /// The slot's epoch at issue time; a stale epoch means the slot's contents changed.
    pub epoch: u32,
    /// Unix seconds after which the handle is refused (valid while `now < expires_at`).
    pub expires_at: u64,
}

/// A random session id from the operating system's random number generator.
pub fn random_session_id() -> Result<u64, EntropyError> {
    getrandom::u64().map_err(EntropyError)
}

/// The wire bytes of a well-formed handle (right length, known version, no flags).
///
/// Values of this type come only from [`crate::KeyRing::issue`], [`crate::KeyRing::renew`]
/// and [`crate::Verified::handle`], so a `Handle` in hand is one this process signed or
/// verified; that is what makes it safe to use as the fast path's `last_issued`. Untrusted
/// bytes go through [`crate::KeyRing::precheck`].
#[derive(Clone, PartialEq, Eq)]
pub struct Handle(pub(crate) [u8; HANDLE_LEN]);

impl Handle {
    /// Builds and returns the unsigned body of a handle for `claims` under `key_id` (the
    /// signature bytes are zero; the caller signs).
    pub(crate) fn unsigned(key_id: u16, claims: &Claims) -> [u8; HANDLE_LEN] {
        let mut b = [0u8; HANDLE_LEN];
        layout::write(&mut b, layout::VERSION, &[FORMAT_VERSION]);
        layout::write(&mut b, layout::FLAGS, &[0]);
        layout::write(&mut b, layout::KEY_ID, &key_id.to_le_bytes());
        layout::write(&mut b, layout::SESSION_ID, &claims.session_id.to_le_bytes());
        layout::write(&mut b, layout::TENANT_TAG, claims.tenant.as_bytes());
        layout::write(&mut b, layout::PROMPT_HASH, claims.prompt_hash.as_bytes());
        layout::write(&mut b, layout::KV_OFFSET, &claims.kv_offset.to_le_bytes());
        layout::write(&mut b, layout::EPOCH, &claims.epoch.to_le_bytes());
        layout::write(&mut b, layout::EXPIRES_AT, &claims.expires_at.to_le_bytes());
        b
    }

    /// Checks length, version and flags of untrusted bytes (the first step of design §3's
    /// order) and copies them into a `Handle`. The signature is not checked here.
    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, HandleError> {
        let len = bytes.len();
        let bytes: &[u8; HANDLE_LEN] = match bytes.try_into() {
            Ok(b) => b,
            Err(_) if len < HANDLE_LEN => return Err(HandleError::Truncated { len }),
            Err(_) => return Err(HandleError::TooLong { len }),
        };
        let [version] = layout::read::<1>(bytes, layout::VERSION);
        if version != FORMAT_VERSION {
            return Err(HandleError::UnknownVersion(version));
        }
        let [flags] = layout::read::<1>(bytes, layout::FLAGS);
        if flags != 0 {
            return Err(HandleError::ReservedFlags(flags));
        }
        Ok(Self(*bytes))
    }

    /// The wire bytes, to send to the client.
    pub fn as_bytes(&self) -> &[u8; HANDLE_LEN] {
        &self.0
    }

    /// The id of the key that signed this handle.
    pub fn key_id(&self) -> u16 {
        u16::from_le_bytes(layout::read(&self.0, layout::KEY_ID))
    }

    /// The claims this handle carries.
    pub fn claims(&self) -> Claims {
        let b = &self.0;
        Claims {
            session_id: u64::from_le_bytes(layout::read(b, layout::SESSION_ID)),
            tenant: TenantTag(layout::read(b, layout::TENANT_TAG)),
            prompt_hash: PromptHash(layout::read(b, layout::PROMPT_HASH)),
            kv_offset: u32::from_le_bytes(layout::read(b, layout::KV_OFFSET)),
            epoch: u32::from_le_bytes(layout::read(b, layout::EPOCH)),
            expires_at: u64::from_le_bytes(layout::read(b, layout::EXPIRES_AT)),
        }
    }

    /// The signature bytes.
    pub(crate) fn signature(&self) -> [u8; 64] {
        layout::read(&self.0, layout::SIGNATURE)
    }
}

/// Shows the key id and session id only: handle bytes never go into logs (design §7).
impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle")
            .field("key_id", &self.key_id())
            .field("session_id", &self.claims().session_id)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_claims() -> Claims {
        Claims {
            session_id: 0x0123_4567_89ab_cdef,
            tenant: TenantTag::for_tenant("acme"),
            prompt_hash: PromptHash::compute("acme", "sys", "hi"),
            kv_offset: 0xdead_beef,
            epoch: 0x0102_0304,
            expires_at: u64::MAX - 1,
        }
    }

    #[test]
    fn claims_written_by_unsigned_read_back_unchanged() {
        let claims = sample_claims();
        let handle = Handle::unsigned(0xbeef, &claims);
        let handle = Handle::parse(&handle).expect("an unsigned body is well-formed");
        assert_eq!(handle.claims(), claims);
        assert_eq!(handle.key_id(), 0xbeef);
    }

    #[test]
    fn parse_reports_short_input_as_truncated() {
        assert_eq!(Handle::parse(&[]), Err(HandleError::Truncated { len: 0 }));
        assert_eq!(
            Handle::parse(&[1; 115]),
            Err(HandleError::Truncated { len: 115 })
        );
    }

    #[test]
    fn parse_reports_long_input_as_too_long() {
        assert_eq!(
            Handle::parse(&[1; 117]),
            Err(HandleError::TooLong { len: 117 })
        );
    }

    #[test]
    fn parse_rejects_other_versions_and_any_flag() {
        let mut b = Handle::unsigned(1, &sample_claims());
        b[1] = 0x80;
        assert_eq!(Handle::parse(&b), Err(HandleError::ReservedFlags(0x80)));
        b[0] = 2;
        assert_eq!(
            Handle::parse(&b),
            Err(HandleError::UnknownVersion(2)),
            "version first"
        );
    }

    #[test]
    fn tenant_tags_differ_between_tenants_and_match_for_one() {
        assert_eq!(TenantTag::for_tenant("acme"), TenantTag::for_tenant("acme"));
        assert_ne!(
            TenantTag::for_tenant("acme"),
            TenantTag::for_tenant("acme2")
        );
        assert_ne!(TenantTag::for_tenant(""), TenantTag::for_tenant("\0"));
    }

    #[test]
    fn prompt_hash_length_prefixes_keep_field_boundaries_apart() {
        let a = PromptHash::compute("t", "ab", "c");
        let b = PromptHash::compute("t", "a", "bc");
        let c = PromptHash::compute("ta", "b", "c");
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_ne!(b, c);
    }

    #[test]
    fn prompt_hash_depends_on_the_tenant() {
        assert_ne!(
            PromptHash::compute("a", "s", "u"),
            PromptHash::compute("b", "s", "u")
        );
    }

    #[test]
    fn handle_debug_shows_no_hash_or_signature_bytes() {
        let handle = Handle(Handle::unsigned(3, &sample_claims()));
        let text = format!("{handle:?}");
        assert!(text.contains("key_id: 3"), "{text}");
        assert!(!text.contains(&hex::encode(sample_claims().prompt_hash.as_bytes())));
    }
}
