//! Zero allocations on the slot map's request path, proved with a counting global allocator
//! (this test binary's own; it holds a single test so nothing else allocates meanwhile).

use std::alloc::System;

use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use zerolayer_engine::config::DEFAULT_SLOT_CAPACITY;
use zerolayer_engine::kv::KvCache;
use zerolayer_handle::{PromptHash, TenantTag};
use zerolayer_model::{KvCacheConfig, splitmix64};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[test]
fn lookup_insert_and_insert_with_eviction_at_capacity_never_allocate() {
    let cap = DEFAULT_SLOT_CAPACITY;
    let mut kv = KvCache::new(
        cap,
        KvCacheConfig {
            block_size: 16,
            num_blocks: 4096,
        },
    );
    let mut table: Vec<u32> = Vec::with_capacity(64);
    let (tenant, hash) = (TenantTag::for_tenant("t"), PromptHash::from_bytes([3; 16]));
    // The allocator is really counting (a test that cannot fail proves nothing).
    let probe = Region::new(GLOBAL);
    let v: Vec<u8> = Vec::with_capacity(10);
    assert!(probe.change().allocations >= 1);
    drop(v);

    let region = Region::new(GLOBAL);
    // Fill to capacity, some sessions holding blocks.
    for i in 0..cap as u64 {
        let id = kv.insert(splitmix64(i), tenant, hash, 0).unwrap();
        if i % 64 == 0 {
            kv.acquire(id, &mut table).unwrap();
            assert!(kv.pool_mut().alloc_into(2, &mut table));
            kv.release(id, &mut table, 20);
        }
    }
    // Lookups (hits and misses).
    for i in 0..cap as u64 {
        assert!(kv.lookup(splitmix64(i)).is_some());
        assert!(kv.lookup(splitmix64(i) ^ 1).is_none());
    }
    // Inserts at capacity: each full map evicts the LRU 5% first (blocks return to the pool).
    for i in cap as u64..3 * cap as u64 {
        let id = kv.insert(splitmix64(i), tenant, hash, 0).unwrap();
        kv.touch(id);
    }
    // A request's slot work: acquire, grow, truncate, release.
    let id = kv.lookup(splitmix64(3 * cap as u64 - 1)).unwrap();
    kv.acquire(id, &mut table).unwrap();
    assert!(kv.pool_mut().alloc_into(4, &mut table));
    kv.release(id, &mut table, 60);
    kv.truncate(id, 10, true);
    let stats = region.change();
    assert!(kv.stats().evictions > 0);
    assert_eq!(
        (stats.allocations, stats.reallocations),
        (0, 0),
        "{stats:?}"
    );
}
