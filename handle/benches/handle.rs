//! Handle costs: full verify, fast-path verify, parse/precheck, issue, renew.
//!
//! Run: `cargo bench -p zerolayer-handle --bench handle`. Expected on the project's machines
//! (issue 2): full verify 30–40 µs, fast path ≤ 0.5 µs, parse ≤ 0.1 µs.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use zerolayer_handle::{Claims, KeyRing, PromptHash, SigningKey, TenantTag};

const NOW: u64 = 1_800_000_000;

fn setup() -> (KeyRing, Claims) {
    let ring = KeyRing::new(SigningKey::from_seed(1, &[7; 32]));
    let claims = Claims {
        session_id: 0x1234_5678_9abc_def0,
        tenant: TenantTag::for_tenant("acme"),
        prompt_hash: PromptHash::compute("acme", "You are a helpful assistant.", "Hello!"),
        kv_offset: 512,
        epoch: 1,
        expires_at: NOW + 86_400,
    };
    (ring, claims)
}

fn benches(c: &mut Criterion) {
    let (ring, claims) = setup();
    let tenant = claims.tenant;
    let handle = ring.issue(claims);
    let bytes = handle.as_bytes().to_vec();
    let (verified, _) = ring.verify(&bytes, &tenant, NOW, None).expect("valid");

    c.bench_function("precheck (parse, key, expiry, tenant)", |b| {
        b.iter(|| {
            ring.precheck(black_box(&bytes), black_box(&tenant), NOW)
                .expect("valid")
        })
    });
    c.bench_function("verify full (precheck + verify_strict)", |b| {
        b.iter(|| {
            ring.verify(black_box(&bytes), black_box(&tenant), NOW, None)
                .expect("valid")
        })
    });
    c.bench_function("verify fast path (precheck + constant-time compare)", |b| {
        b.iter(|| {
            ring.verify(black_box(&bytes), black_box(&tenant), NOW, Some(&handle))
                .expect("valid")
        })
    });
    c.bench_function("issue (sign)", |b| b.iter(|| ring.issue(black_box(claims))));
    c.bench_function("renew (sign)", |b| {
        b.iter(|| ring.renew(black_box(&verified), 600, 1, NOW + 86_400))
    });
    c.bench_function("prompt hash (short strings)", |b| {
        b.iter(|| {
            PromptHash::compute(
                black_box("acme"),
                black_box("You are a helpful assistant."),
                black_box("Hello!"),
            )
        })
    });
}

criterion_group!(handle, benches);
criterion_main!(handle);
