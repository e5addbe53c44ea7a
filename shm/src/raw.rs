//! Unvalidated access to a segment's words, for tests that play a hostile or crashed peer
//! and for debugging tools. Writing through it can break the *peer's* channel — that is its
//! purpose — but never this process's memory safety: every access is bounds- and
//! alignment-checked and atomic.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::Ordering;

pub use crate::layout::offsets;
use crate::region::{Region, futex_wake};

/// A segment file mapped without looking at its header.
#[derive(Debug)]
pub struct RawSegment {
    /// The whole file, mapped shared.
    region: Region,
    /// Keeps the file open for the mapping's life.
    _file: File,
}

impl RawSegment {
    /// Maps the whole file at `path` (size from `fstat`).
    pub fn open(path: &Path) -> std::io::Result<RawSegment> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let len = usize::try_from(file.metadata()?.len()).map_err(std::io::Error::other)?;
        if len == 0 {
            return Err(std::io::Error::other("empty segment file"));
        }
        let region = Region::map(&file, len, false)?;
        Ok(RawSegment {
            region,
            _file: file,
        })
    }

    /// The mapped length.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Always false: an empty file is refused by `open`.
    pub fn is_empty(&self) -> bool {
        self.region.len() == 0
    }

    fn fits(&self, offset: usize, size: usize) -> bool {
        offset.is_multiple_of(size)
            && offset
                .checked_add(size)
                .is_some_and(|end| end <= self.region.len())
    }

    /// The u64 at `offset`; `None` when misaligned or out of bounds.
    pub fn load_u64(&self, offset: usize) -> Option<u64> {
        self.fits(offset, 8)
            .then(|| self.region.u64_at(offset).load(Ordering::Acquire))
    }

    /// Stores a u64 at `offset`; false when misaligned or out of bounds.
    pub fn store_u64(&self, offset: usize, value: u64) -> bool {
        let fits = self.fits(offset, 8);
        if fits {
            self.region.u64_at(offset).store(value, Ordering::Release);
        }
        fits
    }

    /// The u32 at `offset`; `None` when misaligned or out of bounds.
    pub fn load_u32(&self, offset: usize) -> Option<u32> {
        self.fits(offset, 4)
            .then(|| self.region.u32_at(offset).load(Ordering::Acquire))
    }

    /// Stores a u32 at `offset`; false when misaligned or out of bounds.
    pub fn store_u32(&self, offset: usize, value: u32) -> bool {
        let fits = self.fits(offset, 4);
        if fits {
            self.region.u32_at(offset).store(value, Ordering::Release);
        }
        fits
    }

    /// Bumps the futex word at `offset` and wakes its waiters (to make a sleeping peer look at
    /// what was just written); false when misaligned or out of bounds.
    pub fn wake(&self, offset: usize) -> bool {
        let fits = self.fits(offset, 4);
        if fits {
            let word = self.region.u32_at(offset);
            word.fetch_add(1, Ordering::Release);
            futex_wake(word);
        }
        fits
    }
}
