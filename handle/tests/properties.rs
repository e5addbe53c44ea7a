//! Property tests of the public API: untrusted bytes never panic, every corruption is
//! refused, and issue → verify round-trips for any claims.

use proptest::prelude::*;
use zerolayer_handle::layout::{self, Field};
use zerolayer_handle::{
    Claims, HANDLE_LEN, Handle, HandleError, KeyRing, PromptHash, SigningKey, TenantTag, VerifyPath,
};

/// "Now" for tests: a fixed time, so expiry is deterministic.
const NOW: u64 = 1_800_000_000;

fn ring() -> KeyRing {
    KeyRing::new(SigningKey::from_seed(1, &[0x42; 32]))
}

fn tenant() -> TenantTag {
    TenantTag::for_tenant("acme")
}

fn sample_claims() -> Claims {
    Claims {
        session_id: 0x1122_3344_5566_7788,
        tenant: tenant(),
        prompt_hash: PromptHash::compute("acme", "system", "hello"),
        kv_offset: 300,
        epoch: 2,
        expires_at: NOW + 3600,
    }
}

fn arb_claims() -> impl Strategy<Value = Claims> {
    (
        any::<u64>(),
        any::<[u8; 8]>(),
        any::<[u8; 16]>(),
        any::<u32>(),
        any::<u32>(),
        1..=u64::MAX,
    )
        .prop_map(
            |(session_id, tag, hash, kv_offset, epoch, expires_at)| Claims {
                session_id,
                tenant: TenantTag::from_bytes(tag),
                prompt_hash: PromptHash::from_bytes(hash),
                kv_offset,
                epoch,
                expires_at,
            },
        )
}

/// The field a byte index falls in.
fn field_of(index: usize) -> Field {
    *layout::FIELDS
        .iter()
        .find(|f| (f.offset..f.end()).contains(&index))
        .expect("index < 116")
}

/// Checks that `bytes`, a corruption of `original`, is refused by precheck + authenticate with
/// and without `original` as the slot's last issued handle (and by the one-shot verify), and
/// returns the error.
fn assert_refused(ring: &KeyRing, bytes: &[u8], original: &Handle) -> HandleError {
    let split = |last| {
        ring.precheck(bytes, &tenant(), NOW)
            .and_then(|unverified| unverified.authenticate(ring, last))
    };
    let full = split(None).expect_err("corrupted handle accepted");
    let fast = split(Some(original)).expect_err("corrupted handle accepted through the fast path");
    assert_eq!(full, fast, "the fast path changes no verdict");
    let one_shot = ring
        .verify(bytes, &tenant(), NOW, None)
        .expect_err("corrupted handle accepted");
    assert_eq!(full, one_shot, "verify is precheck + authenticate");
    full
}

/// Flips every bit of `handle` in turn and checks each is refused, with the error its field
/// implies: the cheap checks catch header changes, the signature catches everything else.
fn check_every_bit_flip(ring: &KeyRing, handle: &Handle) {
    let claims = handle.claims();
    for bit in 0..HANDLE_LEN * 8 {
        let mut bytes = *handle.as_bytes();
        bytes[bit / 8] ^= 1 << (bit % 8);
        let err = assert_refused(ring, &bytes, handle);
        let field = field_of(bit / 8);
        let expected_ok = match field.name {
            "version" => matches!(err, HandleError::UnknownVersion(_)),
            "flags" => matches!(err, HandleError::ReservedFlags(_)),
            // The ring holds only key 1, so any other id is unknown.
            "key_id" => matches!(err, HandleError::UnknownKey(_)),
            "tenant_tag" => err == HandleError::TenantMismatch,
            // Lowering the expiry below NOW makes it expired; raising it breaks the signature.
            "expires_at" => matches!(err, HandleError::Expired { .. } | HandleError::BadSignature),
            _ => err == HandleError::BadSignature,
        };
        assert!(
            expected_ok,
            "bit {bit} in {} gave {err:?} (claims {claims:?})",
            field.name
        );
    }
}

#[test]
fn every_single_bit_flip_of_a_valid_handle_is_rejected() {
    let ring = ring();
    let handle = ring.issue(sample_claims());
    // Sanity: the unflipped handle is accepted both ways.
    assert!(ring.verify(handle.as_bytes(), &tenant(), NOW, None).is_ok());
    assert!(
        ring.verify(handle.as_bytes(), &tenant(), NOW, Some(&handle))
            .is_ok()
    );
    check_every_bit_flip(&ring, &handle);
}

#[test]
fn a_flipped_handle_never_passes_the_fast_path_even_when_prechecks_pass() {
    // Flip signature bits: the precheck passes, the fast-path compare must fail and the
    // signature check must refuse.
    let ring = ring();
    let handle = ring.issue(sample_claims());
    for bit in layout::SIGNATURE.offset * 8..HANDLE_LEN * 8 {
        let mut bytes = *handle.as_bytes();
        bytes[bit / 8] ^= 1 << (bit % 8);
        let unverified = ring
            .precheck(&bytes, &tenant(), NOW)
            .expect("header untouched");
        assert_eq!(
            unverified.authenticate(&ring, Some(&handle)).unwrap_err(),
            HandleError::BadSignature
        );
    }
}

#[test]
fn rotation_old_key_verifies_and_new_handles_use_the_new_key() {
    let old_ring = KeyRing::new(SigningKey::from_seed(1, &[1; 32]));
    let old_handle = old_ring.issue(sample_claims());

    let mut new_ring = KeyRing::new(SigningKey::from_seed(2, &[2; 32]));
    new_ring
        .add_verifying_key(SigningKey::from_seed(1, &[1; 32]).verifying_key())
        .expect("no conflict");
    assert_eq!(new_ring.active_key_id(), 2);
    assert_eq!(new_ring.verifying_key_ids().collect::<Vec<_>>(), vec![1, 2]);

    let (verified, path) = new_ring
        .verify(old_handle.as_bytes(), &tenant(), NOW, None)
        .expect("old key verifies");
    assert_eq!((verified.key_id(), path), (1, VerifyPath::FullVerify));

    let renewed = new_ring.renew(&verified, 400, 2, NOW + 7200);
    assert_eq!(
        renewed.key_id(),
        2,
        "renewal moves the handle to the active key"
    );
    assert_eq!(new_ring.issue(sample_claims()).key_id(), 2);
    let (verified, _) = new_ring
        .verify(renewed.as_bytes(), &tenant(), NOW, None)
        .expect("new key verifies");
    assert_eq!(verified.claims().session_id, sample_claims().session_id);

    // The old ring does not know key 2; a ring without key 1 refuses old handles.
    assert_eq!(
        old_ring
            .verify(renewed.as_bytes(), &tenant(), NOW, None)
            .unwrap_err(),
        HandleError::UnknownKey(2)
    );
    let retired = KeyRing::new(SigningKey::from_seed(2, &[2; 32]));
    assert_eq!(
        retired
            .verify(old_handle.as_bytes(), &tenant(), NOW, None)
            .unwrap_err(),
        HandleError::UnknownKey(1)
    );
}

#[test]
fn expired_and_other_tenant_handles_are_refused_with_their_own_errors() {
    let ring = ring();
    let claims = sample_claims();
    let handle = ring.issue(claims);
    assert_eq!(
        ring.verify(
            handle.as_bytes(),
            &tenant(),
            claims.expires_at + 5,
            Some(&handle)
        )
        .unwrap_err(),
        HandleError::Expired {
            expires_at: claims.expires_at,
            now: claims.expires_at + 5
        }
    );
    assert_eq!(
        ring.verify(
            handle.as_bytes(),
            &TenantTag::for_tenant("globex"),
            NOW,
            Some(&handle)
        )
        .unwrap_err(),
        HandleError::TenantMismatch
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn any_byte_string_up_to_4_kib_gives_a_typed_error_never_a_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..=4096),
        now in any::<u64>(),
    ) {
        let ring = ring();
        let result = ring.verify(&bytes, &tenant(), now, None);
        match result {
            Err(HandleError::Truncated { len }) => prop_assert!(len == bytes.len() && len < HANDLE_LEN),
            Err(HandleError::TooLong { len }) => prop_assert!(len == bytes.len() && len > HANDLE_LEN),
            Err(e) => prop_assert_eq!(bytes.len(), HANDLE_LEN, "{:?}", e),
            Ok(_) => prop_assert!(false, "random bytes verified"),
        }
        // The split API agrees with the one-shot call.
        let split = ring.precheck(&bytes, &tenant(), now).and_then(|u| u.authenticate(&ring, None));
        prop_assert_eq!(split.map(|_| ()), result.map(|_| ()));
    }

    #[test]
    fn well_formed_but_unsigned_bytes_reach_the_signature_check_and_fail(
        session in any::<[u8; 8]>(),
        hash in any::<[u8; 16]>(),
        rest in any::<[u8; 8]>(),
        signature in proptest::collection::vec(any::<u8>(), 64),
    ) {
        // A header that passes every cheap check: only the signature can refuse it.
        let mut bytes = Vec::with_capacity(HANDLE_LEN);
        bytes.extend_from_slice(&[1, 0]);
        bytes.extend_from_slice(&1u16.to_le_bytes());
        bytes.extend_from_slice(&session);
        bytes.extend_from_slice(tenant().as_bytes());
        bytes.extend_from_slice(&hash);
        bytes.extend_from_slice(&rest);
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        bytes.extend_from_slice(&signature);
        prop_assert_eq!(bytes.len(), HANDLE_LEN);
        let last = ring().issue(sample_claims());
        prop_assert_eq!(ring().verify(&bytes, &tenant(), NOW, Some(&last)).unwrap_err(), HandleError::BadSignature);
    }

    #[test]
    fn issue_then_verify_round_trips_any_claims(claims in arb_claims()) {
        let ring = ring();
        let handle = ring.issue(claims);
        prop_assert_eq!(handle.claims(), claims);
        prop_assert_eq!(handle.key_id(), 1);
        let now = claims.expires_at - 1;
        let (verified, path) = ring.verify(handle.as_bytes(), &claims.tenant, now, None).expect("valid");
        prop_assert_eq!((verified.claims(), path), (&claims, VerifyPath::FullVerify));
        let (verified, path) = ring.verify(handle.as_bytes(), &claims.tenant, now, Some(&handle)).expect("valid");
        prop_assert_eq!((verified.claims(), path), (&claims, VerifyPath::FastPath));

        let renewed = ring.renew(&verified, claims.kv_offset.wrapping_add(1), claims.epoch, claims.expires_at);
        let (again, path) = ring.verify(renewed.as_bytes(), &claims.tenant, now, Some(&handle)).expect("valid");
        prop_assert_eq!(path, VerifyPath::FullVerify, "the old handle is not the renewed one");
        prop_assert_eq!(again.claims(), &Claims { kv_offset: claims.kv_offset.wrapping_add(1), ..claims });
    }
}

proptest! {
    // Each case runs 2 × 928 verifications; a few cases cover varied field values.
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn every_bit_flip_is_rejected_for_arbitrary_claims(claims in arb_claims()) {
        // Fixed tenant and a future expiry, so the precheck passes on the original.
        let claims = Claims { tenant: tenant(), expires_at: claims.expires_at.max(NOW + 1), ..claims };
        let ring = ring();
        check_every_bit_flip(&ring, &ring.issue(claims));
    }
}
