//! Engine benchmarks (setup and results: engine/BENCHMARKS.md).
//!
//! - `slot_map/*`: lookup (hit, miss) and insert-with-eviction at 65,536 entries.
//! - `handle_verify/*`: the engine's handle path (precheck, slot lookup, authenticate) on the
//!   fast path (bytes equal to the slot's last issued handle) and with a full Ed25519 verify.
//! - `decode/batch_{1,8,32}`: decode tokens/s through the whole engine (scheduler, sampling,
//!   streaming) on `dummy:small` (≈110M parameters) — `ZEROLAYER_BENCH_MODEL` overrides it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use zerolayer_engine::api::{
    Caller, Event, GenerateRequest, Message, Role, SamplingOptions, Truncation,
};
use zerolayer_engine::config::DEFAULT_SLOT_CAPACITY;
use zerolayer_engine::kv::{ConversationUpdate, KvCache};
use zerolayer_engine::{Engine, EngineConfig, SafetyConfig};
use zerolayer_handle::{Claims, KeyRing, PromptHash, SigningKey, TenantTag};
use zerolayer_model::{KvCacheConfig, load_model, splitmix64};

/// A full slot map (65,536 idle slots, inserted in order).
fn full_map() -> KvCache {
    let mut kv = KvCache::new(
        DEFAULT_SLOT_CAPACITY,
        KvCacheConfig {
            block_size: 16,
            num_blocks: 1024,
        },
    );
    let (t, h) = (TenantTag::for_tenant("t"), PromptHash::from_bytes([1; 16]));
    for i in 0..DEFAULT_SLOT_CAPACITY as u64 {
        kv.insert(splitmix64(i), t, h, 0).unwrap();
    }
    kv
}

fn slot_map(c: &mut Criterion) {
    let mut g = c.benchmark_group("slot_map");
    let mut kv = full_map();
    let mut i = 0u64;
    g.bench_function("lookup_hit_65536", |b| {
        b.iter(|| {
            i = (i + 7919) % DEFAULT_SLOT_CAPACITY as u64;
            std::hint::black_box(kv.lookup(splitmix64(i)))
        })
    });
    g.bench_function("lookup_miss_65536", |b| {
        b.iter(|| {
            i += 1;
            std::hint::black_box(kv.lookup(splitmix64(i) ^ 0xdead))
        })
    });
    // Every insert goes into a full map: one in 3,277 evicts the LRU 5% (a scan of all
    // entries and a selection), the others reuse the entries freed then: the amortised cost.
    let (t, h) = (TenantTag::for_tenant("t"), PromptHash::from_bytes([1; 16]));
    let mut next = DEFAULT_SLOT_CAPACITY as u64;
    g.bench_function("insert_with_eviction_65536", |b| {
        b.iter(|| {
            next += 1;
            std::hint::black_box(kv.insert(splitmix64(next), t, h, 0).unwrap())
        })
    });
    // The worst single insert: the one that triggers the eviction.
    g.bench_function("insert_that_evicts_65536", |b| {
        b.iter_batched_ref(
            full_map,
            |kv| {
                next += 1;
                kv.insert(splitmix64(next), t, h, 0).unwrap()
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn handle_verify(c: &mut Criterion) {
    let mut g = c.benchmark_group("handle_verify");
    let keys = KeyRing::new(SigningKey::from_seed(1, &[7; 32]));
    let tenant = TenantTag::for_tenant("acme");
    let mut kv = full_map();
    let session = splitmix64(12345);
    let slot = kv.lookup(session).unwrap();
    let claims = Claims {
        session_id: session,
        tenant,
        prompt_hash: PromptHash::from_bytes([1; 16]),
        kv_offset: 0,
        epoch: 0,
        expires_at: u64::MAX,
    };
    let handle = keys.issue(claims);
    let mut table = Vec::with_capacity(4);
    kv.acquire(slot, &mut table).unwrap();
    kv.set_conversation(
        slot,
        &ConversationUpdate {
            epoch: 0,
            tracked: &[],
            messages: 0,
            keep_prefix: 1,
            issued: Some(&handle),
        },
    );
    kv.release(slot, &mut table, 0);
    let bytes = handle.as_bytes().to_vec();
    let mut run = |b: &mut criterion::Bencher<'_>, fast: bool| {
        b.iter(|| {
            let u = keys.precheck(&bytes, &tenant, 1_900_000_000).unwrap();
            let s = kv.lookup(u.session_id());
            let last = if fast {
                s.and_then(|s| kv.entry(s).last_issued())
            } else {
                None
            };
            std::hint::black_box(u.authenticate(&keys, last).unwrap())
        })
    };
    g.bench_function("fast_path", |b| run(b, true));
    g.bench_function("full_verify", |b| run(b, false));
    g.finish();
}

/// Decode tokens/s at batch sizes 1, 8 and 32: `batch` requests are submitted at once (their
/// prompts prefilled together), then the clock runs from the moment every request has its
/// first token until every request has its last.
fn decode(c: &mut Criterion) {
    let spec = std::env::var("ZEROLAYER_BENCH_MODEL").unwrap_or_else(|_| "dummy:small".into());
    let model = load_model(&spec, None).expect("model loads");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let config = EngineConfig {
        kv_blocks: 512,
        slot_capacity: 1024,
        max_batch: 32,
        threads,
        ..EngineConfig::default()
    };
    let keys = Arc::new(KeyRing::new(SigningKey::from_seed(1, &[7; 32])));
    let engine = Engine::start_cpu(&model, keys, SafetyConfig::none(), config).unwrap();
    let caller = Caller::new("bench");
    const TOKENS: u32 = 24;
    let mut g = c.benchmark_group("decode");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(10));
    for batch in [1usize, 8, 32] {
        g.throughput(Throughput::Elements((batch * (TOKENS as usize - 1)) as u64));
        g.bench_function(format!("batch_{batch}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for it in 0..iters {
                    let mut streams: Vec<_> = (0..batch)
                        .map(|i| {
                            let req = GenerateRequest {
                                messages: vec![Message::new(
                                    Role::User,
                                    format!("story number {i} of run {it}"),
                                )],
                                handle: None,
                                delta: false,
                                sampling: SamplingOptions {
                                    max_tokens: Some(TOKENS),
                                    seed: Some(i as u64),
                                    ..SamplingOptions::default()
                                },
                                truncation: Truncation::Reject,
                                request_id: String::new(),
                            };
                            engine.generate(&caller, req)
                        })
                        .collect();
                    for s in &mut streams {
                        assert!(matches!(s.blocking_next(), Some(Ok(Event::Tokens { .. }))));
                    }
                    let t0 = Instant::now();
                    for s in streams {
                        let events = s.collect_blocking().unwrap();
                        let Some(Event::Finished(info)) = events.last() else {
                            panic!("no final event")
                        };
                        assert_eq!(info.usage.generated_tokens, TOKENS, "ran to max_tokens");
                    }
                    total += t0.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, slot_map, handle_verify, decode);
criterion_main!(benches);
