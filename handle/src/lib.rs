//! Signed context handles: fixed-size binary format, issue, verify, renew, keys.
//!
//! A context handle is a 116-byte token that the engine issues on a conversation's first turn
//! and renews on every turn. Clients carry it as opaque bytes; the engine uses it to find the
//! conversation's slot (and its KV cache) again without any server-side session store. The
//! byte layout, signing input, hash derivations, key file formats and test vectors are in
//! `docs/handle.md`; a test checks that page against this code.
//!
//! # Layout
//! - [`layout`]: the wire format: one [`layout::Field`] per field, [`HANDLE_LEN`], the
//!   signing domain.
//! - `format`: the value types: [`TenantTag`], [`PromptHash`], [`Claims`], [`Handle`].
//! - `keys`: [`SigningKey`], [`VerifyingKey`], [`KeyRing`] and the key file formats.
//! - `verify`: the two-step check ([`KeyRing::precheck`] → [`Unverified::authenticate`]),
//!   [`Verified`], [`VerifyPath`] and [`HandleError`].
//!
//! # Use
//! ```
//! use zerolayer_handle::{Claims, KeyRing, PromptHash, TenantTag, VerifyPath};
//!
//! let ring = KeyRing::ephemeral().expect("the OS random number generator works");
//! let tenant = TenantTag::for_tenant("acme");
//! let claims = Claims {
//!     session_id: 7,
//!     tenant,
//!     prompt_hash: PromptHash::compute("acme", "You are terse.", "Hi"),
//!     kv_offset: 12,
//!     epoch: 0,
//!     expires_at: 2_000_000_000,
//! };
//! let handle = ring.issue(claims);
//!
//! // Later: a request presents `handle.as_bytes()`; the engine checks the cheap parts first,
//! // looks the slot up by session id, then authenticates against the slot's last handle.
//! let unverified = ring.precheck(handle.as_bytes(), &tenant, 1_900_000_000)?;
//! assert_eq!(unverified.session_id(), 7);
//! let (verified, path) = unverified.authenticate(&ring, Some(&handle))?;
//! assert_eq!(path, VerifyPath::FastPath);
//! assert_eq!(verified.claims(), &claims);
//! # Ok::<(), zerolayer_handle::HandleError>(())
//! ```
//!
//! This crate does no I/O except reading key files in [`KeyRing::from_files`].

mod format;
mod keys;
pub mod layout;
mod verify;

pub use format::{Claims, DEFAULT_TTL_SECS, Handle, PromptHash, TenantTag, random_session_id};
pub use keys::{
    EntropyError, KeyFileError, KeyIdConflict, KeyParseError, KeyRing, MAX_KEY_FILE_BYTES,
    SIGNING_KEY_TAG, SigningKey, VERIFYING_KEY_TAG, VerifyingKey,
};
pub use layout::HANDLE_LEN;
pub use verify::{HandleError, Unverified, Verified, VerifyPath};
