//! Verification in design §3's order, split in two steps so the engine can look the slot up
//! between the cheap checks and the signature:
//!
//! 1. [`KeyRing::precheck`]: length, version, flags → key id known → expiry → tenant tag.
//! 2. [`Unverified::authenticate`]: the fast path (constant-time equality with the handle the
//!    slot issued last) or else an Ed25519 `verify_strict`.

use ed25519_dalek::Signature;
use subtle::{Choice, ConstantTimeEq};

use crate::format::{Claims, Handle, TenantTag};
use crate::keys::KeyRing;
use crate::layout::{HANDLE_LEN, signing_input};

/// Why a presented handle was refused. Each failure of design §3 has its own variant;
/// [`HandleError::reason`] gives a stable label for metrics. API mapping (design §4):
/// [`HandleError::Expired`] → `HANDLE_EXPIRED`, [`HandleError::TenantMismatch`] →
/// `TENANT_MISMATCH`, every other variant → `INVALID_HANDLE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    /// Fewer bytes than a handle.
    #[error("handle is {len} bytes, shorter than the {HANDLE_LEN}-byte format")]
    Truncated {
        /// Bytes presented.
        len: usize,
    },
    /// More bytes than a handle.
    #[error("handle is {len} bytes, longer than the {HANDLE_LEN}-byte format")]
    TooLong {
        /// Bytes presented.
        len: usize,
    },
    /// A format version this build does not know.
    #[error("unknown handle format version {0}")]
    UnknownVersion(u8),
    /// Reserved flag bits set (version 1 defines none).
    #[error("reserved handle flags set: {0:#04x}")]
    ReservedFlags(u8),
    /// Signed by a key id this ring does not accept (never known, or rotated out).
    #[error("handle signed with unknown key id {0}")]
    UnknownKey(u16),
    /// Past its expiry.
    #[error("handle expired at {expires_at} (now {now}, unix seconds)")]
    Expired {
        /// The handle's expiry, unix seconds.
        expires_at: u64,
        /// The time of the check, unix seconds.
        now: u64,
    },
    /// Issued to another tenant. Carries nothing about that tenant.
    #[error("handle belongs to a different tenant")]
    TenantMismatch,
    /// The signature does not verify (forged or corrupted handle).
    #[error("handle signature is invalid")]
    BadSignature,
}

impl HandleError {
    /// Every value [`HandleError::reason`] returns, for pre-registering metric labels.
    pub const REASONS: [&'static str; 8] = [
        "truncated",
        "too_long",
        "unknown_version",
        "reserved_flags",
        "unknown_key",
        "expired",
        "tenant_mismatch",
        "bad_signature",
    ];

    /// A stable snake_case label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Truncated { .. } => "truncated",
            Self::TooLong { .. } => "too_long",
            Self::UnknownVersion(_) => "unknown_version",
            Self::ReservedFlags(_) => "reserved_flags",
            Self::UnknownKey(_) => "unknown_key",
            Self::Expired { .. } => "expired",
            Self::TenantMismatch => "tenant_mismatch",
            Self::BadSignature => "bad_signature",
        }
    }
}

/// How a handle was authenticated; a metric label (design §7: fast path vs full verify).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VerifyPath {
    /// Byte-equal to the handle the slot issued last: no signature check needed.
    FastPath,
    /// Checked with Ed25519 `verify_strict`.
    FullVerify,
}

impl VerifyPath {
    /// A stable snake_case label for metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::FastPath => "fast_path",
            Self::FullVerify => "full_verify",
        }
    }
}

/// A handle that passed [`KeyRing::precheck`] (well-formed, known key, not expired, this
/// tenant's) but whose signature has not been checked. Only [`Unverified::session_id`] is
/// exposed: enough to find the slot, nothing to act on.
#[derive(Debug)]
#[must_use = "an unverified handle proves nothing until authenticated"]
pub struct Unverified {
    /// The presented bytes, already parsed.
    handle: Handle,
}

impl Unverified {
    /// The session id the handle claims, to look up the slot (and its last issued handle).
    pub fn session_id(&self) -> u64 {
        self.handle.claims().session_id
    }

    /// Authenticates the handle: if it is byte-equal (constant-time) to `last_issued`, the
    /// handle the slot issued last, it is authentic without a signature check
    /// ([`VerifyPath::FastPath`]); otherwise its signature must pass `verify_strict` under its
    /// key id ([`VerifyPath::FullVerify`]).
    ///
    /// `last_issued` must be a handle this engine issued for the session the slot holds (the
    /// type guarantees it came from this crate's issue or verify); pass `None` when there is no
    /// slot or it holds no handle.
    pub fn authenticate(
        self,
        ring: &KeyRing,
        last_issued: Option<&Handle>,
    ) -> Result<(Verified, VerifyPath), HandleError> {
        if let Some(last) = last_issued
            && bool::from(handles_equal(self.handle.as_bytes(), last.as_bytes()))
        {
            return Ok((Verified::new(self.handle), VerifyPath::FastPath));
        }
        let key_id = self.handle.key_id();
        // Checked in precheck; repeated because `ring` may differ from the precheck's ring.
        let key = ring
            .verifying_key(key_id)
            .ok_or(HandleError::UnknownKey(key_id))?;
        let signature = Signature::from_bytes(&self.handle.signature());
        key.verify_strict(&signing_input(self.handle.as_bytes()), &signature)
            .map_err(|_| HandleError::BadSignature)?;
        Ok((Verified::new(self.handle), VerifyPath::FullVerify))
    }
}

/// Constant-time equality of two handles: the OR of the XOR of every byte pair, compared with
/// zero through `subtle`. No branch depends on the bytes, so the time does not reveal where
/// two handles differ. (`subtle`'s slice `ct_eq` is equally constant-time but puts an
/// optimisation barrier on every byte: about 10× slower for 116 bytes; the fold here
/// vectorises.)
fn handles_equal(a: &[u8; HANDLE_LEN], b: &[u8; HANDLE_LEN]) -> Choice {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    diff.ct_eq(&0)
}

/// An authentic handle and its claims.
#[derive(Debug, Clone)]
pub struct Verified {
    /// The authenticated wire bytes.
    handle: Handle,
    /// The claims, decoded once.
    claims: Claims,
}

impl Verified {
    /// Wraps an authenticated handle.
    fn new(handle: Handle) -> Self {
        let claims = handle.claims();
        Self { handle, claims }
    }

    /// The authenticated claims.
    pub fn claims(&self) -> &Claims {
        &self.claims
    }

    /// The authenticated handle.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// The id of the key that signed the handle.
    pub fn key_id(&self) -> u16 {
        self.handle.key_id()
    }
}

impl KeyRing {
    /// The cheap checks of design §3, in order: length, version and flags → key id known →
    /// expiry (`now_unix_s < expires_at`) → tenant tag equals `tenant` (the authenticated
    /// tenant's, compared in constant time). No signature check: call
    /// [`Unverified::authenticate`] next.
    pub fn precheck(
        &self,
        bytes: &[u8],
        tenant: &TenantTag,
        now_unix_s: u64,
    ) -> Result<Unverified, HandleError> {
        let handle = Handle::parse(bytes)?;
        let key_id = handle.key_id();
        if self.verifying_key(key_id).is_none() {
            return Err(HandleError::UnknownKey(key_id));
        }
        let claims = handle.claims();
        if now_unix_s >= claims.expires_at {
            return Err(HandleError::Expired {
                expires_at: claims.expires_at,
                now: now_unix_s,
            });
        }
        if !bool::from(claims.tenant.as_bytes().ct_eq(tenant.as_bytes())) {
            return Err(HandleError::TenantMismatch);
        }
        Ok(Unverified { handle })
    }

    /// [`KeyRing::precheck`] then [`Unverified::authenticate`], for callers that need no slot
    /// lookup in between.
    pub fn verify(
        &self,
        bytes: &[u8],
        tenant: &TenantTag,
        now_unix_s: u64,
        last_issued: Option<&Handle>,
    ) -> Result<(Verified, VerifyPath), HandleError> {
        self.precheck(bytes, tenant, now_unix_s)?
            .authenticate(self, last_issued)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::PromptHash;
    use crate::keys::SigningKey;

    const NOW: u64 = 1_800_000_000;

    fn ring(id: u16, seed: u8) -> KeyRing {
        KeyRing::new(SigningKey::from_seed(id, &[seed; 32]))
    }

    fn claims(tenant: &str) -> Claims {
        Claims {
            session_id: 42,
            tenant: TenantTag::for_tenant(tenant),
            prompt_hash: PromptHash::compute(tenant, "s", "u"),
            kv_offset: 10,
            epoch: 1,
            expires_at: NOW + 60,
        }
    }

    #[test]
    fn issued_handle_verifies_fully_without_last_issued_and_fast_with_it() {
        let ring = ring(1, 1);
        let c = claims("acme");
        let h = ring.issue(c);
        let (v, path) = ring
            .verify(h.as_bytes(), &c.tenant, NOW, None)
            .expect("valid");
        assert_eq!((v.claims(), path), (&c, VerifyPath::FullVerify));
        let (v, path) = ring
            .verify(h.as_bytes(), &c.tenant, NOW, Some(&h))
            .expect("valid");
        assert_eq!((v.claims(), path), (&c, VerifyPath::FastPath));
        assert_eq!(v.handle(), &h);
        assert_eq!(v.key_id(), 1);
    }

    #[test]
    fn a_different_last_issued_handle_falls_back_to_full_verify() {
        let ring = ring(1, 1);
        let c = claims("acme");
        let older = ring.issue(c);
        let newer = ring.issue(Claims { kv_offset: 20, ..c });
        let (_, path) = ring
            .verify(older.as_bytes(), &c.tenant, NOW, Some(&newer))
            .expect("ok");
        assert_eq!(path, VerifyPath::FullVerify);
    }

    #[test]
    fn handle_is_valid_until_the_second_before_expiry() {
        let ring = ring(1, 1);
        let c = claims("acme");
        let h = ring.issue(c);
        assert!(
            ring.verify(h.as_bytes(), &c.tenant, c.expires_at - 1, None)
                .is_ok()
        );
        assert_eq!(
            ring.verify(h.as_bytes(), &c.tenant, c.expires_at, Some(&h))
                .unwrap_err(),
            HandleError::Expired {
                expires_at: c.expires_at,
                now: c.expires_at
            }
        );
    }

    #[test]
    fn other_tenants_handle_is_a_tenant_mismatch_even_on_the_fast_path() {
        let ring = ring(1, 1);
        let h = ring.issue(claims("acme"));
        let other = TenantTag::for_tenant("globex");
        assert_eq!(
            ring.verify(h.as_bytes(), &other, NOW, Some(&h))
                .unwrap_err(),
            HandleError::TenantMismatch
        );
    }

    #[test]
    fn handle_from_a_key_outside_the_ring_is_unknown_key_or_bad_signature() {
        let c = claims("acme");
        let h = ring(5, 9).issue(c);
        assert_eq!(
            ring(1, 1)
                .verify(h.as_bytes(), &c.tenant, NOW, None)
                .unwrap_err(),
            { HandleError::UnknownKey(5) }
        );
        // Same id, different key: the signature gives it away.
        assert_eq!(
            ring(5, 1)
                .verify(h.as_bytes(), &c.tenant, NOW, None)
                .unwrap_err(),
            HandleError::BadSignature
        );
    }

    #[test]
    fn checks_run_in_design_order() {
        // A handle that is expired, of another tenant and under an unknown key reports the
        // unknown key first, then expiry, then the tenant.
        let c = Claims {
            expires_at: NOW - 1,
            ..claims("acme")
        };
        let h = ring(5, 9).issue(c);
        let other = TenantTag::for_tenant("globex");
        assert_eq!(
            ring(1, 1).precheck(h.as_bytes(), &other, NOW).unwrap_err(),
            { HandleError::UnknownKey(5) }
        );
        assert_eq!(
            ring(5, 9).precheck(h.as_bytes(), &other, NOW).unwrap_err(),
            HandleError::Expired {
                expires_at: NOW - 1,
                now: NOW
            }
        );
        assert_eq!(
            ring(5, 9)
                .precheck(h.as_bytes(), &other, NOW - 2)
                .unwrap_err(),
            HandleError::TenantMismatch
        );
    }

    #[test]
    fn authenticate_rechecks_the_key_against_the_ring_it_is_given() {
        let c = claims("acme");
        let ring_a = ring(1, 1);
        let h = ring_a.issue(c);
        let unverified = ring_a
            .precheck(h.as_bytes(), &c.tenant, NOW)
            .expect("prechecks");
        assert_eq!(
            unverified.authenticate(&ring(2, 2), None).unwrap_err(),
            HandleError::UnknownKey(1)
        );
    }

    #[test]
    fn renew_keeps_identity_and_updates_position() {
        let ring = ring(1, 1);
        let c = claims("acme");
        let h = ring.issue(c);
        let (v, _) = ring
            .verify(h.as_bytes(), &c.tenant, NOW, None)
            .expect("valid");
        let renewed = ring.renew(&v, 99, 3, NOW + 500);
        let (v2, _) = ring
            .verify(renewed.as_bytes(), &c.tenant, NOW, None)
            .expect("valid");
        assert_eq!(
            v2.claims(),
            &Claims {
                kv_offset: 99,
                epoch: 3,
                expires_at: NOW + 500,
                ..c
            }
        );
    }

    #[test]
    fn handles_equal_only_when_every_byte_is() {
        let a = [0x5a; HANDLE_LEN];
        assert!(bool::from(handles_equal(&a, &a)));
        for i in 0..HANDLE_LEN {
            for bit in 0..8 {
                let mut b = a;
                b[i] ^= 1 << bit;
                assert!(!bool::from(handles_equal(&a, &b)), "byte {i} bit {bit}");
            }
        }
    }

    #[test]
    fn reasons_are_distinct_and_listed() {
        let all = [
            HandleError::Truncated { len: 0 },
            HandleError::TooLong { len: 200 },
            HandleError::UnknownVersion(2),
            HandleError::ReservedFlags(1),
            HandleError::UnknownKey(3),
            HandleError::Expired {
                expires_at: 1,
                now: 2,
            },
            HandleError::TenantMismatch,
            HandleError::BadSignature,
        ];
        let reasons: Vec<_> = all.iter().map(HandleError::reason).collect();
        assert_eq!(reasons, HandleError::REASONS);
    }
}
