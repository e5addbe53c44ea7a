//! The slot map at its default capacity: LRU-5% eviction and bounded probe lengths.

use zerolayer_engine::config::DEFAULT_SLOT_CAPACITY;
use zerolayer_engine::kv::{EVICTION_DIVISOR, KvCache, PROBE_LENGTH_BOUND};
use zerolayer_handle::{PromptHash, TenantTag};
use zerolayer_model::{KvCacheConfig, splitmix64};

/// Session id number `i` (random-looking, like the engine's).
fn sid(i: u64) -> u64 {
    splitmix64(i ^ 0x5eed)
}

#[test]
fn one_session_past_capacity_evicts_the_oldest_five_percent_and_probes_stay_bounded() {
    let cap = DEFAULT_SLOT_CAPACITY;
    let mut kv = KvCache::new(
        cap,
        KvCacheConfig {
            block_size: 16,
            num_blocks: 64,
        },
    );
    let (tenant, hash) = (TenantTag::for_tenant("t"), PromptHash::from_bytes([3; 16]));
    for i in 0..cap as u64 {
        kv.insert(sid(i), tenant, hash, 0).unwrap();
    }
    assert_eq!(kv.stats().live, cap);
    assert_eq!(kv.stats().evictions, 0);
    // Session 65,537: the oldest ceil(65,536 / 20) = 3,277 idle slots go.
    kv.insert(sid(cap as u64), tenant, hash, 0).unwrap();
    let evicted = cap.div_ceil(EVICTION_DIVISOR);
    assert_eq!(evicted, 3_277);
    assert_eq!(kv.stats().evictions, evicted as u64);
    assert_eq!(kv.stats().live, cap - evicted + 1);
    for i in 0..=cap as u64 {
        let present = kv.lookup(sid(i)).is_some();
        assert_eq!(present, i >= evicted as u64, "session {i}");
    }
    let first = kv.stats().max_probe;
    // Churn at capacity: 4 × capacity more sessions, each lookup'd once; tombstones pile up
    // and the index is rebuilt in place.
    for i in cap as u64 + 1..5 * cap as u64 {
        kv.insert(sid(i), tenant, hash, 0).unwrap();
        assert!(kv.lookup(sid(i)).is_some());
        assert!(kv.lookup(sid(i) ^ 1).is_none());
    }
    let stats = kv.stats();
    eprintln!(
        "max probe after filling: {first}; after churn: {}; {stats:?}",
        stats.max_probe
    );
    assert!(stats.rebuilds > 0);
    assert!(stats.max_probe <= PROBE_LENGTH_BOUND, "{stats:?}");
}
