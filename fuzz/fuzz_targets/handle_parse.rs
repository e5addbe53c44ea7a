//! Fuzzes the handle checks with arbitrary bytes: `precheck`, `authenticate` (with and without
//! a last issued handle) and the one-shot `verify`, plus the key file text parsers. Nothing may
//! panic, and nothing but the one genuine handle may be accepted.
//!
//! Input: the first 8 bytes (little-endian) are "now" in unix seconds, the rest is the
//! presented handle. Shorter inputs use now = 0 and the whole input as the handle.

#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use zerolayer_handle::{
    Claims, HANDLE_LEN, Handle, HandleError, KeyRing, PromptHash, SigningKey, TenantTag,
    VerifyPath, VerifyingKey,
};

/// A fixed ring (key id 1) and one handle it issued, shared by every run.
static FIXTURE: LazyLock<(KeyRing, TenantTag, Handle)> = LazyLock::new(|| {
    let ring = KeyRing::new(SigningKey::from_seed(1, &[0x42; 32]));
    let tenant = TenantTag::for_tenant("acme");
    let handle = ring.issue(Claims {
        session_id: 7,
        tenant,
        prompt_hash: PromptHash::compute("acme", "system", "user"),
        kv_offset: 10,
        epoch: 1,
        expires_at: u64::MAX,
    });
    (ring, tenant, handle)
});

fuzz_target!(|data: &[u8]| {
    let (ring, tenant, genuine) = &*FIXTURE;
    let (now, bytes) = match data.split_first_chunk::<8>() {
        Some((now, rest)) => (u64::from_le_bytes(*now), rest),
        None => (0, data),
    };

    let one_shot = ring.verify(bytes, tenant, now, None);
    let fast = ring.verify(bytes, tenant, now, Some(genuine));
    let split = ring
        .precheck(bytes, tenant, now)
        .and_then(|u| u.authenticate(ring, Some(genuine)));

    // Length errors report the real length.
    match one_shot {
        Err(HandleError::Truncated { len }) => assert!(len == bytes.len() && len < HANDLE_LEN),
        Err(HandleError::TooLong { len }) => assert!(len == bytes.len() && len > HANDLE_LEN),
        _ => {}
    }
    // Only the genuine handle is accepted (forging an Ed25519 signature is out of reach), and
    // the fast path changes which path is taken, never the verdict.
    let is_genuine = bytes == genuine.as_bytes() && now < u64::MAX; // expires_at = u64::MAX
    assert_eq!(one_shot.is_ok(), is_genuine);
    assert_eq!(fast.as_ref().map(|_| ()), one_shot.as_ref().map(|_| ()));
    assert_eq!(split.as_ref().map(|_| ()), fast.as_ref().map(|_| ()));
    if let Ok((verified, path)) = fast {
        assert_eq!(path, VerifyPath::FastPath);
        assert_eq!(verified.handle(), genuine);
    }

    // The key file parsers take operator input: typed errors, never a panic.
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = SigningKey::from_text(text);
        let _ = VerifyingKey::parse_list(text);
    }
});
