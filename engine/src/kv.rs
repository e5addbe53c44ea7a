//! Where conversations live between turns (design §5): the paged [`BlockPool`] and the
//! [`SlotMap`], combined in [`KvCache`]. Only the scheduler thread owns a `KvCache`; everything
//! else sends it commands.
//!
//! This module is public for the allocation tests and benchmarks; services never see slot ids.
//!
//! # Ownership of blocks
//! Every block of the pool is, at any time, in exactly one of three places: the free stack, the
//! chain of one idle slot (linked through [`BlockPool`]'s `next` array, so a slot stores only
//! its head), or the block table of one running sequence (the scheduler's preallocated
//! buffer). A slot taken for a request ([`KvCache::acquire`]) hands its chain over as a table
//! and gets it back when the request ends ([`KvCache::release`]); eviction only touches idle
//! slots. Release is explicit rather than RAII (TGI's `BlockAllocation` returns blocks in
//! `Drop`): blocks go back to a slot, not only to the pool, and the single owner makes the
//! explicit calls easy to audit (tests check that no block is lost).
//!
//! # Allocation
//! Everything is allocated in [`KvCache::new`]. Lookup, insert (with eviction), acquire,
//! release, truncate and eviction never call the global allocator (`tests/slot_map_alloc.rs`
//! proves it with a counting allocator).
//!
//! # The slot map
//! Open addressing with double hashing over a power-of-two index table at least twice the
//! capacity (load ≤ 0.5). Removed keys leave tombstones; when they exceed a quarter of the
//! table the index is rebuilt in place from the entries (so live + tombstones ≤ 0.75 of the
//! table and probe sequences stay short: see [`PROBE_LENGTH_BOUND`]). When no entry is free,
//! the least recently used 5% of idle slots are evicted ([`KvCache::evict_lru`]).

use zerolayer_handle::{Handle, PromptHash, TenantTag};
use zerolayer_model::{KvCacheConfig, splitmix64};

/// Marks the end of a block chain (and "no chain").
pub const NO_BLOCK: u32 = u32::MAX;
/// Messages per slot whose (role, content) hash and end position are remembered, so the next
/// turn can take their token ids from the slot (the generated ids of assistant messages do not
/// always survive re-tokenisation). 32 covers 16 exchanges; later messages are re-tokenised and
/// still reused through the token prefix check whenever their tokenisation agrees.
pub const MAX_TRACKED_MESSAGES: usize = 32;
/// Share of idle slots evicted at once when the map or the pool is full: 1/20 = 5% (design §5),
/// rounded up (so 65,536 idle slots lose 3,277), at least one.
pub const EVICTION_DIVISOR: usize = 20;
/// Upper bound on the probe length of any lookup or insert, asserted by the capacity tests. With
/// live + tombstones ≤ 0.75 of the table, double hashing needs more than `k` probes with
/// probability about 0.75^k per operation; 64 probes happen with probability ≈ 1e-8 per
/// operation (≈ 7e-4 over a full map of 65,536 inserts). Measured at 65,536 entries
/// (`tests/slot_map_capacity.rs`): 14 after filling the map, 36 after 4 × 65,536 more inserts
/// with evictions, tombstones and rebuilds.
pub const PROBE_LENGTH_BOUND: usize = 64;
/// `messages` value of a slot whose message count is no longer known (after a left truncation
/// or a branch inside untracked messages): later messages are not tracked.
pub const UNKNOWN_MESSAGES: u32 = u32::MAX;

/// Index cell value: never used.
const EMPTY: u32 = u32::MAX;
/// Index cell value: removed key (probing continues past it).
const TOMBSTONE: u32 = u32::MAX - 1;

/// The paged KV pool's bookkeeping: which blocks are free, the chains of idle slots, and the
/// token id held at every pool position (so slots need no per-slot id buffer).
#[derive(Debug)]
pub struct BlockPool {
    /// Token positions per block.
    block_size: usize,
    /// Stack of free block ids (capacity = all blocks).
    free: Vec<u32>,
    /// Next block of a chain, [`NO_BLOCK`] at the end; meaningful only for chained blocks.
    next: Vec<u32>,
    /// Token id at each pool position (`block × block_size + offset`).
    tokens: Vec<u32>,
}

impl BlockPool {
    /// A pool of `kv.num_blocks` free blocks.
    pub fn new(kv: KvCacheConfig) -> Self {
        let n = kv.num_blocks;
        Self {
            block_size: kv.block_size.max(1),
            // Popped from the end: block 0 first.
            free: (0..n as u32).rev().collect(),
            next: vec![NO_BLOCK; n],
            tokens: vec![0; n * kv.block_size.max(1)],
        }
    }

    /// Token positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.next.len()
    }

    /// Blocks on the free stack.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks held by slots or sequences.
    pub fn used_blocks(&self) -> usize {
        self.total_blocks() - self.free_blocks()
    }

    /// Blocks covering `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Moves `n` free blocks onto the end of `table`; all or nothing (`false` when fewer than
    /// `n` are free). `table` must have room (its capacity is never grown here).
    pub fn alloc_into(&mut self, n: usize, table: &mut Vec<u32>) -> bool {
        if n > self.free.len() || table.len() + n > table.capacity() {
            return false;
        }
        for _ in 0..n {
            // Invariant: checked above that `n` blocks are free.
            let b = self.free.pop().expect("enough free blocks");
            table.push(b);
        }
        true
    }

    /// Returns `blocks` to the free stack.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            debug_assert!(
                self.free.len() < self.free.capacity(),
                "double free of block {b}"
            );
            self.next[b as usize] = NO_BLOCK;
            self.free.push(b);
        }
    }

    /// Links `table` into a chain and returns its head ([`NO_BLOCK`] for an empty table).
    fn link(&mut self, table: &[u32]) -> u32 {
        for w in table.windows(2) {
            self.next[w[0] as usize] = w[1];
        }
        if let Some(&last) = table.last() {
            self.next[last as usize] = NO_BLOCK;
        }
        table.first().copied().unwrap_or(NO_BLOCK)
    }

    /// Appends the `n` blocks of the chain at `head` to `table` (whose capacity must suffice).
    fn unlink_into(&mut self, head: u32, n: usize, table: &mut Vec<u32>) {
        let mut b = head;
        for _ in 0..n {
            debug_assert_ne!(b, NO_BLOCK, "chain shorter than recorded");
            table.push(b);
            let next = self.next[b as usize];
            self.next[b as usize] = NO_BLOCK;
            b = next;
        }
    }

    /// Releases the chain at `head` from its `keep`-th block on; returns the new head (or
    /// [`NO_BLOCK`] when `keep == 0`) and the number of blocks released.
    fn truncate_chain(&mut self, head: u32, keep: usize) -> (u32, usize) {
        let mut released = 0;
        let mut b = head;
        let mut prev = NO_BLOCK;
        for _ in 0..keep {
            if b == NO_BLOCK {
                return (head, 0);
            }
            prev = b;
            b = self.next[b as usize];
        }
        if prev != NO_BLOCK {
            self.next[prev as usize] = NO_BLOCK;
        }
        while b != NO_BLOCK {
            let next = self.next[b as usize];
            self.next[b as usize] = NO_BLOCK;
            self.free.push(b);
            released += 1;
            b = next;
        }
        (if keep == 0 { NO_BLOCK } else { head }, released)
    }

    /// Records `ids` as the tokens of positions `start..start + ids.len()` of the sequence whose
    /// blocks are `table`.
    pub fn write_tokens(&mut self, table: &[u32], start: usize, ids: &[u32]) {
        for (i, &id) in ids.iter().enumerate() {
            let p = start + i;
            let block = table[p / self.block_size] as usize;
            self.tokens[block * self.block_size + p % self.block_size] = id;
        }
    }

    /// The token id at position `pos` of the sequence whose blocks are `table`.
    pub fn token_at(&self, table: &[u32], pos: usize) -> u32 {
        let block = table[pos / self.block_size] as usize;
        self.tokens[block * self.block_size + pos % self.block_size]
    }

    /// Calls `f` with the token ids of the first `len` positions of the chain at `head`, one
    /// block-sized run at a time, until `f` returns `false`.
    fn for_each_run(&self, head: u32, len: usize, mut f: impl FnMut(usize, &[u32]) -> bool) {
        let mut b = head;
        let mut pos = 0;
        while pos < len && b != NO_BLOCK {
            let n = (len - pos).min(self.block_size);
            let start = b as usize * self.block_size;
            if !f(pos, &self.tokens[start..start + n]) {
                return;
            }
            pos += n;
            b = self.next[b as usize];
        }
    }
}

/// Lifecycle of a slot map entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Never used.
    Free,
    /// Holds a conversation between turns; evictable.
    Idle,
    /// A request of the conversation is running; its blocks are in the request's table.
    InUse,
    /// Evicted or removed; available for a new conversation.
    Reusable,
}

/// Number of a slot map entry. Valid until the slot is evicted or removed; only the scheduler
/// holds them, never longer than the request that looked the slot up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId(u32);

/// One conversation's slot (design §5's entry).
#[derive(Debug, Clone)]
pub struct SlotEntry {
    /// The key: the handle's session id.
    session_id: u64,
    /// The tenant the conversation belongs to (a request of another tenant never uses it).
    tenant: TenantTag,
    /// Hash of the conversation's opening (handles of another conversation never use it).
    prompt_hash: PromptHash,
    /// Bumped whenever the contents are truncated or replaced; handles carry it.
    epoch: u32,
    /// Token positions held (ids in the pool, KV rows computed).
    tokens: u32,
    /// First block of the chain holding the tokens ([`NO_BLOCK`] when none or in use).
    head: u32,
    /// Blocks in the chain (= `blocks_for(tokens)` while idle; 0 while in use).
    n_blocks: u32,
    /// Positions left truncation keeps: BOS plus the system message.
    keep_prefix: u32,
    /// Messages of the conversation whose tokens the slot holds, or [`UNKNOWN_MESSAGES`].
    messages: u32,
    /// Tracked messages (≤ [`MAX_TRACKED_MESSAGES`]).
    tracked_len: u8,
    /// Keyed hash of (role, content) of message `i`.
    tracked_hash: [u64; MAX_TRACKED_MESSAGES],
    /// Position just past message `i`'s last token.
    tracked_end: [u32; MAX_TRACKED_MESSAGES],
    /// The handle the slot issued last: the fast path of verification (design §3).
    last_issued: Option<Handle>,
}

/// The part of an entry that eviction scans, kept in its own compact array (16 bytes per
/// slot instead of ~600) so that an LRU scan of 65,536 slots reads 1 MiB, not 40 MB.
#[derive(Debug, Clone, Copy)]
struct Meta {
    /// Logical time of the last access (the map's clock), for LRU eviction.
    last_access: u64,
    /// Lifecycle state.
    state: SlotState,
}

impl SlotEntry {
    /// An unused entry.
    fn free() -> Self {
        Self {
            session_id: 0,
            tenant: TenantTag::from_bytes([0; 8]),
            prompt_hash: PromptHash::from_bytes([0; 16]),
            epoch: 0,
            tokens: 0,
            head: NO_BLOCK,
            n_blocks: 0,
            keep_prefix: 0,
            messages: 0,
            tracked_len: 0,
            tracked_hash: [0; MAX_TRACKED_MESSAGES],
            tracked_end: [0; MAX_TRACKED_MESSAGES],
            last_issued: None,
        }
    }

    /// The session id (key).
    pub fn session_id(&self) -> u64 {
        self.session_id
    }

    /// The owning tenant's tag.
    pub fn tenant(&self) -> TenantTag {
        self.tenant
    }

    /// The conversation's prompt hash.
    pub fn prompt_hash(&self) -> PromptHash {
        self.prompt_hash
    }

    /// Current epoch.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Token positions held.
    pub fn tokens(&self) -> usize {
        self.tokens as usize
    }

    /// Positions left truncation keeps (BOS + system message).
    pub fn keep_prefix(&self) -> usize {
        self.keep_prefix as usize
    }

    /// Messages of the conversation held, or [`UNKNOWN_MESSAGES`].
    pub fn messages(&self) -> u32 {
        self.messages
    }

    /// `(hash, end)` of the tracked messages, in order.
    pub fn tracked(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        let n = self.tracked_len as usize;
        self.tracked_hash[..n]
            .iter()
            .copied()
            .zip(self.tracked_end[..n].iter().copied())
    }

    /// The handle issued last, if any.
    pub fn last_issued(&self) -> Option<&Handle> {
        self.last_issued.as_ref()
    }

    /// Drops tracked messages ending after `len` and fixes the message count.
    fn cut_tracked(&mut self, len: u32) {
        let keep = self.tracked().take_while(|&(_, end)| end <= len).count();
        self.tracked_len = keep as u8;
        // The count stays known only when the cut falls on a tracked message boundary (or
        // leaves nothing but BOS).
        let exact = keep == 0 && len <= 1 || keep > 0 && self.tracked_end[keep - 1] == len;
        self.messages = if exact { keep as u32 } else { UNKNOWN_MESSAGES };
        if len < self.keep_prefix {
            self.keep_prefix = len;
        }
    }
}

/// One cell of the index table.
#[derive(Debug, Clone, Copy)]
struct IndexCell {
    /// Session id stored here (valid when `entry` is an entry number).
    key: u64,
    /// Entry number, [`EMPTY`] or [`TOMBSTONE`].
    entry: u32,
}

/// Why a slot map operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// Every entry is in use by a running request: nothing is evictable.
    #[error("every slot is in use by a running request")]
    SlotMapFull,
    /// The session id is already present.
    #[error("session id already present")]
    DuplicateSession,
    /// The sequence's table has no room for the blocks (capacity is fixed up front).
    #[error("block table full")]
    TableFull,
}

/// Counters of the slot map, read by the scheduler into the engine metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotStats {
    /// Slots holding a conversation (idle or in use).
    pub live: usize,
    /// Idle slots.
    pub idle: usize,
    /// Slots evicted since start.
    pub evictions: u64,
    /// Index rebuilds since start.
    pub rebuilds: u64,
    /// Longest probe sequence seen since start (or the last [`KvCache::reset_probe_stats`]).
    pub max_probe: usize,
    /// Tombstones in the index now.
    pub tombstones: usize,
}

/// The slot map and the block pool together: the engine's KV state.
#[derive(Debug)]
pub struct KvCache {
    /// Block bookkeeping.
    pool: BlockPool,
    /// Entries; `SlotId` indexes them.
    entries: Vec<SlotEntry>,
    /// State and access time per entry (same index).
    meta: Vec<Meta>,
    /// Open-addressing index over session ids; length a power of two ≥ 2 × capacity.
    index: Vec<IndexCell>,
    /// `index.len() - 1`.
    mask: usize,
    /// Stack of free or reusable entry numbers.
    free_entries: Vec<u32>,
    /// Tombstones in `index`.
    tombstones: usize,
    /// Idle or in-use entries.
    live: usize,
    /// Idle entries.
    idle: usize,
    /// Logical clock for `last_access`.
    clock: u64,
    /// Preallocated eviction candidates `(last_access, entry)`.
    scratch: Vec<(u64, u32)>,
    /// Statistics.
    stats: SlotStats,
}

impl KvCache {
    /// Allocates a map of `capacity` slots over a pool of `kv` geometry.
    pub fn new(capacity: usize, kv: KvCacheConfig) -> Self {
        let capacity = capacity.max(1);
        let size = (capacity * 2).next_power_of_two();
        Self {
            pool: BlockPool::new(kv),
            entries: vec![SlotEntry::free(); capacity],
            meta: vec![
                Meta {
                    last_access: 0,
                    state: SlotState::Free
                };
                capacity
            ],
            index: vec![
                IndexCell {
                    key: 0,
                    entry: EMPTY
                };
                size
            ],
            mask: size - 1,
            free_entries: (0..capacity as u32).rev().collect(),
            tombstones: 0,
            live: 0,
            idle: 0,
            clock: 0,
            scratch: Vec::with_capacity(capacity),
            stats: SlotStats::default(),
        }
    }

    /// The block pool.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The block pool, for sequences that hold blocks without a slot.
    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    /// Slot capacity.
    pub fn capacity(&self) -> usize {
        self.entries.len()
    }

    /// Counters.
    pub fn stats(&self) -> SlotStats {
        SlotStats {
            live: self.live,
            idle: self.idle,
            tombstones: self.tombstones,
            ..self.stats
        }
    }

    /// Forgets the longest probe seen.
    pub fn reset_probe_stats(&mut self) {
        self.stats.max_probe = 0;
    }

    /// The entry of `id`.
    pub fn entry(&self, id: SlotId) -> &SlotEntry {
        &self.entries[id.0 as usize]
    }

    /// The lifecycle state of `id`.
    pub fn state(&self, id: SlotId) -> SlotState {
        self.meta[id.0 as usize].state
    }

    /// Logical time of the last access of `id` (larger = more recent).
    pub fn last_access(&self, id: SlotId) -> u64 {
        self.meta[id.0 as usize].last_access
    }

    /// Probe sequence start and step of `key`.
    fn probe(&self, key: u64) -> (usize, usize) {
        let h = splitmix64(key);
        (h as usize & self.mask, ((h >> 32) as usize & self.mask) | 1)
    }

    /// The slot of `session_id`, if present (idle or in use). Does not touch its access time.
    pub fn lookup(&mut self, session_id: u64) -> Option<SlotId> {
        let (mut i, step) = self.probe(session_id);
        for n in 1..=self.index.len() {
            let cell = self.index[i];
            if cell.entry == EMPTY {
                self.note_probe(n);
                return None;
            }
            if cell.entry != TOMBSTONE && cell.key == session_id {
                self.note_probe(n);
                return Some(SlotId(cell.entry));
            }
            i = (i + step) & self.mask;
        }
        None
    }

    /// Records a probe length.
    fn note_probe(&mut self, n: usize) {
        self.stats.max_probe = self.stats.max_probe.max(n);
    }

    /// Marks `id` as used now (LRU order).
    pub fn touch(&mut self, id: SlotId) {
        self.clock += 1;
        self.meta[id.0 as usize].last_access = self.clock;
    }

    /// Inserts an idle, empty slot for a new conversation (or a conversation whose slot was
    /// evicted). Evicts the least recently used 5% of idle slots when no entry is free.
    pub fn insert(
        &mut self,
        session_id: u64,
        tenant: TenantTag,
        prompt_hash: PromptHash,
        epoch: u32,
    ) -> Result<SlotId, KvError> {
        if self.free_entries.is_empty() && self.evict_lru() == 0 {
            return Err(KvError::SlotMapFull);
        }
        // Find the key's place: the first tombstone on its probe path, else the empty cell
        // that ends it; a live cell with the key is a duplicate.
        let (mut i, step) = self.probe(session_id);
        let mut place = None;
        let mut n = 0;
        while n < self.index.len() {
            n += 1;
            let cell = self.index[i];
            if cell.entry == EMPTY {
                place.get_or_insert(i);
                break;
            }
            if cell.entry == TOMBSTONE {
                place.get_or_insert(i);
            } else if cell.key == session_id {
                return Err(KvError::DuplicateSession);
            }
            i = (i + step) & self.mask;
        }
        self.note_probe(n);
        // Invariant: live + tombstones < table size (rebuilds keep it ≤ 0.75), so an empty
        // cell always ends the probe path.
        let place = place.expect("the index always has an empty cell");
        // Invariant: checked above (free entry or successful eviction).
        let e = self.free_entries.pop().expect("a free entry");
        if self.index[place].entry == TOMBSTONE {
            self.tombstones -= 1;
        }
        self.index[place] = IndexCell {
            key: session_id,
            entry: e,
        };
        self.clock += 1;
        self.entries[e as usize] = SlotEntry {
            session_id,
            tenant,
            prompt_hash,
            epoch,
            ..SlotEntry::free()
        };
        self.meta[e as usize] = Meta {
            last_access: self.clock,
            state: SlotState::Idle,
        };
        self.live += 1;
        self.idle += 1;
        Ok(SlotId(e))
    }

    /// Removes `id` (idle or in use) from the map: its chain returns to the pool, its index
    /// cell becomes a tombstone and the entry becomes reusable.
    pub fn remove(&mut self, id: SlotId) {
        let meta = &mut self.meta[id.0 as usize];
        match meta.state {
            SlotState::Idle => self.idle -= 1,
            SlotState::InUse => {}
            SlotState::Free | SlotState::Reusable => return,
        }
        meta.state = SlotState::Reusable;
        let e = &mut self.entries[id.0 as usize];
        let (head, key) = (e.head, e.session_id);
        e.head = NO_BLOCK;
        e.n_blocks = 0;
        e.tokens = 0;
        e.last_issued = None;
        self.pool.truncate_chain(head, 0);
        self.live -= 1;
        self.free_entries.push(id.0);
        let (mut i, step) = self.probe(key);
        for _ in 0..self.index.len() {
            let cell = self.index[i];
            if cell.entry == id.0 {
                self.index[i].entry = TOMBSTONE;
                self.tombstones += 1;
                break;
            }
            if cell.entry == EMPTY {
                break;
            }
            i = (i + step) & self.mask;
        }
        if self.tombstones > self.index.len() / 4 {
            self.rebuild_index();
        }
    }

    /// Rebuilds the index in place from the live entries (drops every tombstone).
    fn rebuild_index(&mut self) {
        self.index.fill(IndexCell {
            key: 0,
            entry: EMPTY,
        });
        self.tombstones = 0;
        for e in 0..self.entries.len() {
            let entry = &self.entries[e];
            if matches!(self.meta[e].state, SlotState::Idle | SlotState::InUse) {
                let (mut i, step) = self.probe(entry.session_id);
                while self.index[i].entry != EMPTY {
                    i = (i + step) & self.mask;
                }
                self.index[i] = IndexCell {
                    key: entry.session_id,
                    entry: e as u32,
                };
            }
        }
        self.stats.rebuilds += 1;
    }

    /// Evicts the least recently used 5% of idle slots (rounded up, at least one when any is
    /// idle): their blocks return to the pool and their entries become reusable. Returns how
    /// many were evicted.
    pub fn evict_lru(&mut self) -> usize {
        if self.idle == 0 {
            return 0;
        }
        self.scratch.clear();
        for (i, m) in self.meta.iter().enumerate() {
            if m.state == SlotState::Idle {
                self.scratch.push((m.last_access, i as u32));
            }
        }
        let k = self.scratch.len().div_ceil(EVICTION_DIVISOR).max(1);
        if k < self.scratch.len() {
            self.scratch.select_nth_unstable(k - 1);
        }
        for j in 0..k {
            let (_, e) = self.scratch[j];
            self.remove(SlotId(e));
        }
        self.stats.evictions += k as u64;
        k
    }

    /// Takes an idle slot for a request: moves its chain into `table` (which must have room)
    /// and marks it in use. Returns the tokens it holds.
    pub fn acquire(&mut self, id: SlotId, table: &mut Vec<u32>) -> Result<usize, KvError> {
        debug_assert_eq!(self.meta[id.0 as usize].state, SlotState::Idle);
        let e = &mut self.entries[id.0 as usize];
        if table.len() + e.n_blocks as usize > table.capacity() {
            return Err(KvError::TableFull);
        }
        let (head, n) = (e.head, e.n_blocks as usize);
        e.head = NO_BLOCK;
        e.n_blocks = 0;
        let tokens = e.tokens as usize;
        self.meta[id.0 as usize].state = SlotState::InUse;
        self.idle -= 1;
        self.pool.unlink_into(head, n, table);
        self.touch(id);
        Ok(tokens)
    }

    /// Returns an in-use slot to idle with the first `tokens` positions of `table` (blocks past
    /// them go back to the pool). `table` is left empty.
    pub fn release(&mut self, id: SlotId, table: &mut Vec<u32>, tokens: usize) {
        let keep = self.pool.blocks_for(tokens).min(table.len());
        self.pool.release(&table[keep..]);
        let head = self.pool.link(&table[..keep]);
        table.clear();
        debug_assert_eq!(self.meta[id.0 as usize].state, SlotState::InUse);
        self.meta[id.0 as usize].state = SlotState::Idle;
        let e = &mut self.entries[id.0 as usize];
        e.head = head;
        e.n_blocks = keep as u32;
        e.tokens = tokens.min(keep * self.pool.block_size) as u32;
        self.idle += 1;
        self.touch(id);
    }

    /// Truncates an idle slot to `tokens` positions (blocks past them are released). When
    /// `bump_epoch`, the epoch is incremented (design §4: contents changed).
    pub fn truncate(&mut self, id: SlotId, tokens: usize, bump_epoch: bool) {
        let bs = self.pool.block_size;
        let e = &mut self.entries[id.0 as usize];
        if tokens < e.tokens as usize {
            let keep = tokens.div_ceil(bs);
            let (head, released) = self.pool.truncate_chain(e.head, keep);
            e.head = head;
            e.n_blocks -= released as u32;
            e.tokens = tokens as u32;
            e.cut_tracked(tokens as u32);
        }
        if bump_epoch {
            e.epoch = e.epoch.wrapping_add(1);
        }
    }

    /// Length of the longest common prefix of the slot's token ids and `ids`.
    pub fn common_prefix(&self, id: SlotId, ids: &[u32]) -> usize {
        let e = &self.entries[id.0 as usize];
        let len = (e.tokens as usize).min(ids.len());
        let mut common = 0;
        self.pool.for_each_run(e.head, len, |pos, run| {
            let same = run
                .iter()
                .zip(&ids[pos..])
                .take_while(|(a, b)| a == b)
                .count();
            common = pos + same;
            same == run.len()
        });
        common
    }

    /// Appends the slot's token ids of positions `range` to `out`.
    pub fn copy_tokens(&self, id: SlotId, range: std::ops::Range<usize>, out: &mut Vec<u32>) {
        let e = &self.entries[id.0 as usize];
        let end = range.end.min(e.tokens as usize);
        self.pool.for_each_run(e.head, end, |pos, run| {
            let from = range.start.saturating_sub(pos).min(run.len());
            out.extend_from_slice(&run[from..]);
            true
        });
    }

    /// Sets the conversation metadata of an in-use slot at the end of a request: epoch,
    /// tracked messages, message count, kept prefix and the handle issued.
    pub fn set_conversation(&mut self, id: SlotId, update: &ConversationUpdate<'_>) {
        let e = &mut self.entries[id.0 as usize];
        e.epoch = update.epoch;
        let n = update.tracked.len().min(MAX_TRACKED_MESSAGES);
        for (i, &(h, end)) in update.tracked[..n].iter().enumerate() {
            e.tracked_hash[i] = h;
            e.tracked_end[i] = end;
        }
        e.tracked_len = n as u8;
        e.messages = update.messages;
        e.keep_prefix = update.keep_prefix;
        e.last_issued = update.issued.cloned();
    }

    /// Drops the tracked messages of `id` that end after `len` (a request that did not finish
    /// leaves the slot at a prefix).
    pub fn cut_tracked(&mut self, id: SlotId, len: usize) {
        self.entries[id.0 as usize].cut_tracked(len as u32);
    }

    /// Sets the epoch of a slot (a miss that reuses an existing entry starts a new epoch).
    pub fn set_epoch(&mut self, id: SlotId, epoch: u32) {
        self.entries[id.0 as usize].epoch = epoch;
    }
}

/// What [`KvCache::set_conversation`] records.
#[derive(Debug, Clone, Copy)]
pub struct ConversationUpdate<'a> {
    /// The slot's epoch after the request.
    pub epoch: u32,
    /// `(hash, end)` of the conversation's messages, oldest first (only the first
    /// [`MAX_TRACKED_MESSAGES`] are kept).
    pub tracked: &'a [(u64, u32)],
    /// Messages of the conversation, or [`UNKNOWN_MESSAGES`].
    pub messages: u32,
    /// Positions left truncation keeps.
    pub keep_prefix: u32,
    /// The handle just issued.
    pub issued: Option<&'a Handle>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(blocks: usize) -> KvCacheConfig {
        KvCacheConfig {
            block_size: 4,
            num_blocks: blocks,
        }
    }

    fn tag() -> TenantTag {
        TenantTag::for_tenant("t")
    }

    fn ph() -> PromptHash {
        PromptHash::from_bytes([1; 16])
    }

    /// Gives slot `id` the tokens `ids` through a request's table.
    fn fill(c: &mut KvCache, id: SlotId, ids: &[u32]) {
        let mut table = Vec::with_capacity(64);
        let held = c.acquire(id, &mut table).unwrap();
        let need = c.pool().blocks_for(ids.len()) - table.len();
        assert!(c.pool_mut().alloc_into(need, &mut table));
        c.pool_mut().write_tokens(&table, held, &ids[held..]);
        c.release(id, &mut table, ids.len());
    }

    #[test]
    fn slot_tokens_round_trip_through_acquire_and_release() {
        let mut c = KvCache::new(8, kv(16));
        let id = c.insert(7, tag(), ph(), 0).unwrap();
        let ids: Vec<u32> = (100..110).collect();
        fill(&mut c, id, &ids);
        assert_eq!(c.entry(id).tokens(), 10);
        assert_eq!(c.pool().used_blocks(), 3);
        let mut out = Vec::new();
        c.copy_tokens(id, 0..10, &mut out);
        assert_eq!(out, ids);
        out.clear();
        c.copy_tokens(id, 5..8, &mut out);
        assert_eq!(out, &ids[5..8]);
        assert_eq!(c.common_prefix(id, &[100, 101, 102, 999]), 3);
        assert_eq!(c.common_prefix(id, &ids), 10);
        let longer: Vec<u32> = (100..120).collect();
        assert_eq!(c.common_prefix(id, &longer), 10);
    }

    #[test]
    fn truncation_returns_blocks_and_bumps_the_epoch_only_when_asked() {
        let mut c = KvCache::new(8, kv(16));
        let id = c.insert(7, tag(), ph(), 3).unwrap();
        fill(&mut c, id, &(0..12).collect::<Vec<_>>());
        assert_eq!(c.pool().used_blocks(), 3);
        c.truncate(id, 5, true);
        assert_eq!((c.entry(id).tokens(), c.entry(id).epoch()), (5, 4));
        assert_eq!(c.pool().used_blocks(), 2);
        c.truncate(id, 5, false);
        assert_eq!(c.entry(id).epoch(), 4);
        c.truncate(id, 0, false);
        assert_eq!(c.pool().used_blocks(), 0);
        let mut out = Vec::new();
        c.copy_tokens(id, 0..10, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn eviction_takes_the_least_recently_used_idle_slots_and_frees_their_blocks() {
        let mut c = KvCache::new(40, kv(200));
        let ids: Vec<SlotId> = (0..40)
            .map(|s| c.insert(s, tag(), ph(), 0).unwrap())
            .collect();
        for &id in &ids {
            fill(&mut c, id, &[1, 2, 3, 4, 5]);
        }
        // Refresh all but slots 3 and 9, which become the two oldest.
        for (i, &id) in ids.iter().enumerate() {
            if i != 3 && i != 9 {
                c.touch(id);
            }
        }
        assert_eq!(c.pool().used_blocks(), 80);
        assert_eq!(c.evict_lru(), 2, "ceil(40 / 20)");
        assert_eq!(c.lookup(3), None);
        assert_eq!(c.lookup(9), None);
        assert!(c.lookup(4).is_some());
        assert_eq!(c.pool().used_blocks(), 76);
        assert_eq!(c.stats().evictions, 2);
    }

    #[test]
    fn in_use_slots_are_never_evicted() {
        let mut c = KvCache::new(4, kv(16));
        let ids: Vec<SlotId> = (0..4)
            .map(|s| c.insert(s, tag(), ph(), 0).unwrap())
            .collect();
        let mut tables: Vec<Vec<u32>> = (0..4).map(|_| Vec::with_capacity(4)).collect();
        for (id, t) in ids.iter().zip(&mut tables) {
            c.acquire(*id, t).unwrap();
        }
        assert_eq!(c.insert(99, tag(), ph(), 0), Err(KvError::SlotMapFull));
        c.release(ids[2], &mut tables[2], 0);
        let new = c.insert(99, tag(), ph(), 0).unwrap();
        assert_eq!(c.lookup(2), None, "the only idle slot was evicted");
        assert_eq!(c.lookup(99), Some(new));
    }

    #[test]
    fn duplicate_session_ids_are_refused() {
        let mut c = KvCache::new(4, kv(16));
        c.insert(5, tag(), ph(), 0).unwrap();
        assert_eq!(c.insert(5, tag(), ph(), 0), Err(KvError::DuplicateSession));
    }

    #[test]
    fn tombstones_are_reused_and_rebuilds_keep_every_key_reachable() {
        let mut c = KvCache::new(64, kv(16));
        for round in 0..50u64 {
            for s in 0..40 {
                c.insert(round * 1000 + s, tag(), ph(), 0).unwrap();
            }
            for s in 0..40 {
                let id = c.lookup(round * 1000 + s).expect("present");
                c.remove(id);
            }
        }
        assert!(c.stats().rebuilds > 0, "{:?}", c.stats());
        for s in 0..64 {
            c.insert(77_000 + s, tag(), ph(), 0).unwrap();
        }
        for s in 0..64 {
            assert!(c.lookup(77_000 + s).is_some());
        }
        assert!(c.stats().max_probe <= PROBE_LENGTH_BOUND);
    }

    #[test]
    fn truncation_drops_tracked_messages_past_the_cut() {
        let mut c = KvCache::new(4, kv(16));
        let id = c.insert(1, tag(), ph(), 0).unwrap();
        fill(&mut c, id, &(0..20).collect::<Vec<_>>());
        let mut table = Vec::with_capacity(8);
        c.acquire(id, &mut table).unwrap();
        c.set_conversation(
            id,
            &ConversationUpdate {
                epoch: 0,
                tracked: &[(11, 5), (22, 12), (33, 20)],
                messages: 3,
                keep_prefix: 5,
                issued: None,
            },
        );
        c.release(id, &mut table, 20);
        c.truncate(id, 12, true);
        assert_eq!(
            c.entry(id).tracked().collect::<Vec<_>>(),
            vec![(11, 5), (22, 12)]
        );
        assert_eq!(c.entry(id).messages(), 2);
        c.truncate(id, 8, true);
        assert_eq!(c.entry(id).tracked().collect::<Vec<_>>(), vec![(11, 5)]);
        assert_eq!(
            c.entry(id).messages(),
            UNKNOWN_MESSAGES,
            "cut inside a message"
        );
    }
}
