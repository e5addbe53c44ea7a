//! Presented handles: every bad handle gets its own typed error, never a panic.

mod common;

use common::*;
use proptest::prelude::*;
use zerolayer_engine::api::{Caller, Message, ReuseOutcome, Role};
use zerolayer_engine::{Engine, EngineError, ErrorReason};
use zerolayer_handle::{Claims, HandleError, PromptHash, TenantTag};

/// An engine and one finished turn's handle.
fn engine_with_handle() -> (Engine, Vec<u8>, Vec<Message>) {
    let model = tiny();
    let engine = start(&model, config());
    let messages = vec![Message::new(Role::User, "hello")];
    let out = run(&engine, &caller(), request(messages.clone(), None, 3)).unwrap();
    (engine, out.info.handle.unwrap(), messages)
}

/// The error of a request presenting `handle`.
fn error_of(
    engine: &Engine,
    caller: &Caller,
    messages: &[Message],
    handle: Vec<u8>,
) -> EngineError {
    run(engine, caller, request(messages.to_vec(), Some(handle), 3))
        .expect_err("the handle is refused")
}

#[test]
fn forged_handles_are_invalid_with_a_bad_signature() {
    let (engine, handle, messages) = engine_with_handle();
    // A flipped signature bit, and a raised kv_offset (claims are signed).
    let mut sig = handle.clone();
    *sig.last_mut().unwrap() ^= 1;
    let mut offset = handle.clone();
    offset[zerolayer_handle::layout::KV_OFFSET.offset] ^= 0x10;
    for forged in [sig, offset] {
        let e = error_of(&engine, &caller(), &messages, forged);
        assert_eq!(e, EngineError::InvalidHandle(HandleError::BadSignature));
        assert_eq!(e.reason(), ErrorReason::InvalidHandle);
    }
    assert_eq!(engine.metrics().handle_rejected_count("bad_signature"), 2);
}

#[test]
fn expired_handles_get_handle_expired() {
    let (engine, _, messages) = engine_with_handle();
    let claims = Claims {
        session_id: 5,
        tenant: TenantTag::for_tenant("acme"),
        prompt_hash: PromptHash::compute("acme", "", "hello"),
        kv_offset: 3,
        epoch: 0,
        expires_at: 1_000,
    };
    let expired = keys().issue(claims).as_bytes().to_vec();
    let e = error_of(&engine, &caller(), &messages, expired);
    assert!(
        matches!(
            e,
            EngineError::InvalidHandle(HandleError::Expired {
                expires_at: 1_000,
                ..
            })
        ),
        "{e:?}"
    );
    assert_eq!(e.reason(), ErrorReason::HandleExpired);
}

#[test]
fn another_tenants_handle_gets_tenant_mismatch() {
    let (engine, handle, messages) = engine_with_handle();
    let e = error_of(&engine, &Caller::new("globex"), &messages, handle);
    assert_eq!(e, EngineError::InvalidHandle(HandleError::TenantMismatch));
    assert_eq!(e.reason(), ErrorReason::TenantMismatch);
}

#[test]
fn malformed_handles_get_invalid_handle() {
    let (engine, handle, messages) = engine_with_handle();
    let cases = [
        (handle[..10].to_vec(), HandleError::Truncated { len: 10 }),
        (
            [handle.clone(), vec![0]].concat(),
            HandleError::TooLong {
                len: handle.len() + 1,
            },
        ),
        (
            {
                let mut h = handle.clone();
                h[0] = 9;
                h
            },
            HandleError::UnknownVersion(9),
        ),
    ];
    for (bytes, expected) in cases {
        assert_eq!(
            error_of(&engine, &caller(), &messages, bytes),
            EngineError::InvalidHandle(expected)
        );
    }
}

#[test]
fn a_valid_handle_for_an_evicted_slot_is_verified_in_full_and_misses() {
    let model = tiny();
    let engine = start(&model, config());
    let messages = vec![Message::new(Role::User, "hello")];
    // A handle this engine's keys signed for a session it never had.
    let claims = Claims {
        session_id: 77,
        tenant: TenantTag::for_tenant("acme"),
        prompt_hash: PromptHash::compute("acme", "", "hello"),
        kv_offset: 3,
        epoch: 4,
        expires_at: u64::MAX,
    };
    let handle = keys().issue(claims).as_bytes().to_vec();
    let out = run(&engine, &caller(), request(messages, Some(handle), 3)).unwrap();
    assert_eq!(out.info.reuse, ReuseOutcome::Miss);
    assert_eq!(
        out.info.session_id, 77,
        "the conversation continues under its session id"
    );
    assert_eq!(
        zerolayer_engine::EngineMetrics::get(&engine.metrics().handle_full_verify),
        1
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_as_a_handle_get_a_typed_error_never_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let (engine, _, messages) = ENGINE.with(|e| e.clone());
        let e = error_of(&engine, &caller(), &messages, bytes);
        prop_assert!(matches!(e.reason(), ErrorReason::InvalidHandle | ErrorReason::HandleExpired | ErrorReason::TenantMismatch), "{e:?}");
    }

    #[test]
    fn mutated_handles_get_a_typed_error_never_a_panic(pos in 0usize..116, bit in 0u8..8) {
        let (engine, handle, messages) = ENGINE.with(|e| e.clone());
        let mut bytes = handle.clone();
        bytes[pos] ^= 1 << bit;
        let e = error_of(&engine, &caller(), &messages, bytes);
        prop_assert!(matches!(e.reason(), ErrorReason::InvalidHandle | ErrorReason::HandleExpired | ErrorReason::TenantMismatch), "{e:?}");
        prop_assert!(engine.is_healthy());
    }
}

thread_local! {
    /// One engine per test thread for the property tests.
    static ENGINE: (Engine, Vec<u8>, Vec<Message>) = engine_with_handle();
}
