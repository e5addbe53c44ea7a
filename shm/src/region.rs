//! The memory under a channel: a shared file mapping, or a heap block for in-process rings
//! (tests, Miri). Almost all of the crate's `unsafe` is here, behind four accessors.
//!
//! # Memory model at the process boundary
//! The peer process writes the same memory concurrently and may be hostile. Everything the
//! peer writes *and this side acts on* (indices, frame headers, flags, heartbeats) is read
//! with atomic loads, once, into locals, and validated before use. Payload bytes are handed
//! out as plain `&[u8]` / `&mut [u8]` (the zero-copy contract): the ring protocol makes the
//! ranges exclusive — a writer only touches bytes the reader has released, a reader only
//! bytes the writer has published — so an honest peer never races with them. A hostile peer
//! can still scribble on them; that is outside what the Rust abstract machine models (as for
//! any `mmap` of a shared file, e.g. memmap2's `Mmap`), and the crate never derives an index,
//! a length or any other memory-safety decision from payload bytes, so the effect is garbage
//! payload for the reader (which a prost decode rejects or accepts as data), never an
//! out-of-bounds access.
//!
//! A peer that *truncates* the segment file makes later accesses raise SIGBUS; the segment is
//! fully allocated at creation and file permissions are the guard (see the crate docs).

use std::fs::File;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};
use rustix::thread::futex;

/// Who owns the bytes.
enum Owner {
    /// A `MAP_SHARED` mapping of the segment file; unmapped on drop.
    Map(#[allow(dead_code, reason = "held for its Drop (munmap)")] MmapRaw),
    /// A heap block from `Box<[u64]>` (8-byte aligned), freed on drop.
    Heap(NonNull<[u64]>),
}

/// A block of memory shared with a peer (another process, or another thread for heap rings).
pub(crate) struct Region {
    /// Start of the block; 8-byte aligned (page aligned for mappings).
    base: NonNull<u8>,
    /// Length in bytes; every access is checked against it.
    len: usize,
    /// Keeps the memory alive.
    owner: Owner,
}

// SAFETY: the region is plain memory with no thread affinity; all shared mutation goes through
// atomics or through byte ranges made exclusive by the ring protocol (see the module docs).
unsafe impl Send for Region {}
// SAFETY: as above; `&Region` only hands out atomics and protocol-exclusive byte ranges.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.owner {
            Owner::Map(_) => "map",
            Owner::Heap(_) => "heap",
        };
        f.debug_struct("Region")
            .field("kind", &kind)
            .field("len", &self.len)
            .finish()
    }
}

impl Region {
    /// A zeroed heap block of `len` bytes (rounded up to 8).
    pub(crate) fn heap(len: usize) -> Region {
        let words = len.div_ceil(8);
        let boxed: Box<[u64]> = vec![0u64; words].into_boxed_slice();
        let raw = NonNull::from(Box::leak(boxed));
        Region {
            base: raw.cast::<u8>(),
            len: words * 8,
            owner: Owner::Heap(raw),
        }
    }

    /// Maps `len` bytes of `file` shared and read-write; `populate` pre-faults the pages so
    /// the hot path takes no page faults (the server does this once at creation; a client
    /// probing possibly stale or hostile segments does not).
    pub(crate) fn map(file: &File, len: usize, populate: bool) -> std::io::Result<Region> {
        let mut options = MmapOptions::new();
        options.len(len);
        if populate {
            options.populate();
        }
        let map = options.map_raw(file)?;
        let base = NonNull::new(map.as_mut_ptr())
            .ok_or_else(|| std::io::Error::other("mmap returned a null pointer"))?;
        Ok(Region {
            base,
            len: map.len(),
            owner: Owner::Map(map),
        })
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The `u64` at `offset`. Panics on a misaligned or out-of-bounds offset: offsets come
    /// from the validated layout and masked ring offsets, never from the peer, so a panic here
    /// is a bug in this crate (and the check is what keeps such a bug from being UB).
    pub(crate) fn u64_at(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset.checked_add(8).is_some_and(|end| end <= self.len),
            "u64 access at {offset} outside a {}-byte region",
            self.len
        );
        // SAFETY: the pointer is in bounds and 8-byte aligned (checked above; `base` is 8-byte
        // aligned), valid for the lifetime of `&self` (the owner keeps it mapped/allocated),
        // and every access to these 8 bytes by this crate is atomic.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().wrapping_add(offset).cast::<u64>()) }
    }

    /// The `u32` at `offset` (same contract as [`Region::u64_at`]).
    pub(crate) fn u32_at(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset.is_multiple_of(4) && offset.checked_add(4).is_some_and(|end| end <= self.len),
            "u32 access at {offset} outside a {}-byte region",
            self.len
        );
        // SAFETY: in bounds and 4-byte aligned (checked above), valid for `&self`, and only
        // ever accessed atomically by this crate.
        unsafe { AtomicU32::from_ptr(self.base.as_ptr().wrapping_add(offset).cast::<u32>()) }
    }

    /// Bytes `offset..offset + len` for reading.
    ///
    /// # Safety
    /// No thread of this process may write these bytes while the returned slice lives (the
    /// ring protocol: the reader only borrows published, unreleased frames, which its own
    /// process's writer never touches).
    pub(crate) unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "byte range {offset}+{len} outside a {}-byte region",
            self.len
        );
        // SAFETY: in bounds (checked above), valid for `&self`; the caller guarantees no
        // concurrent writer in this process.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().wrapping_add(offset), len) }
    }

    /// Bytes `offset..offset + len` for writing.
    ///
    /// # Safety
    /// No other reference to these bytes may exist in this process while the returned slice
    /// lives (the ring protocol: the single writer, holding the writer lock, only writes space
    /// the reader has released).
    #[allow(
        clippy::mut_from_ref,
        reason = "exclusivity is the ring protocol's, see # Safety"
    )]
    pub(crate) unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "byte range {offset}+{len} outside a {}-byte region",
            self.len
        );
        // SAFETY: in bounds (checked above), valid for `&self`; the caller guarantees
        // exclusivity within this process.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().wrapping_add(offset), len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Owner::Heap(raw) = self.owner {
            // SAFETY: `raw` came from `Box::leak` in `Region::heap` and is freed only here.
            drop(unsafe { Box::from_raw(raw.as_ptr()) });
        }
    }
}

/// Sleeps until `word` is woken or no longer holds `expected`, at most `timeout`. Returns on
/// wake-ups, timeouts, signals and value changes alike: callers re-check their condition. The
/// futex is *shared* (no `FUTEX_PRIVATE_FLAG`), so it works across processes mapping the same
/// file — including processes in other PID namespaces (containers).
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let timeout = futex::Timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    // EAGAIN (value changed), ETIMEDOUT and EINTR all mean "re-check"; nothing else can occur
    // for a valid, aligned word.
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&timeout));
}

/// Wakes every waiter on `word` (there is at most one by protocol; waking all is harmless).
pub(crate) fn futex_wake(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn heap_regions_are_zeroed_and_hand_out_aligned_atomics() {
        let region = Region::heap(100);
        assert_eq!(region.len(), 104);
        assert_eq!(region.u64_at(96).load(Ordering::Relaxed), 0);
        region.u32_at(4).store(7, Ordering::Relaxed);
        assert_eq!(region.u32_at(4).load(Ordering::Relaxed), 7);
        assert_eq!(region.u64_at(8).load(Ordering::Relaxed), 0);
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn an_out_of_bounds_offset_panics_instead_of_reading_past_the_block() {
        let region = Region::heap(64);
        region.u64_at(64);
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_misaligned_offset_panics_instead_of_misaligned_atomics() {
        let region = Region::heap(64);
        region.u64_at(4);
    }
}
