//! The segment file: creation by the server (race-free replacement of a stale segment) and
//! opening plus validation by the client.
//!
//! Creation, step by step:
//! 1. If a file exists at the path, take a non-blocking exclusive `flock` on it. A live server
//!    holds that lock for its whole life, so failure means `SegmentError::InUse`; the kernel
//!    drops the lock when a server dies, even by `kill -9`. Its generation (if its header is
//!    valid) is remembered.
//! 2. Create a hidden temporary file next to it (`O_EXCL`), set its mode, `fallocate` the full
//!    size (a too-small tmpfs fails *here* with `SegmentError::NoSpace`, not with SIGBUS
//!    later), lock it, map it, and write the header — the magic last.
//! 3. Publish it under the real name atomically: `rename` over the old file (after checking
//!    the path still names the inode we locked), or `link` when there was none (which fails if
//!    someone else created one meanwhile; then start over). A client therefore only ever
//!    opens a complete segment: the old one (whose heartbeat has stopped) or the new one.
//!
//! Two servers racing for one path serialize on the old file's lock (or on `link`), so
//! exactly one wins and the other gets `InUse`. Locks, `rename` and futexes all work on a
//! tmpfs shared between containers; nothing depends on PIDs.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rustix::fs::{FallocateFlags, FileType, FlockOperation, Mode, OFlags};
use rustix::io::Errno;

use crate::channel::RingRef;
use crate::config::ShmConfig;
use crate::error::{HeaderError, SegmentError};
use crate::layout::{
    HEADER_BYTES, HeaderSource, LAYOUT_VERSION, Layout, MAGIC, MAX_SEGMENT_BYTES, SERVER_SERVING,
    offsets, validate_header,
};
use crate::region::Region;

/// Attempts at publishing a new segment before giving up (each retry means another server
/// changed the path under us at that very moment).
const CREATE_ATTEMPTS: usize = 8;

/// A mapped, validated segment.
#[derive(Debug)]
pub(crate) struct Segment {
    /// The mapping.
    region: Arc<Region>,
    /// The open file: for the server it holds the `flock` that marks the segment as served.
    _file: File,
    /// Where the segment lives.
    path: PathBuf,
    /// The validated layout.
    layout: Layout,
    /// (device, inode) of the file, to recognise it at the path later.
    identity: (u64, u64),
}

impl HeaderSource for Region {
    fn u64_at(&self, offset: usize) -> u64 {
        // Acquire pairs with the server's release store of the magic, written last.
        self.u64_at(offset).load(Ordering::Acquire)
    }

    fn u32_at(&self, offset: usize) -> u32 {
        self.u32_at(offset).load(Ordering::Acquire)
    }
}

fn io_error<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(Errno) -> SegmentError + 'a {
    move |errno| SegmentError::Io {
        op,
        path: path.to_path_buf(),
        source: errno.into(),
    }
}

/// Maps a `fallocate` failure: `ENOSPC` becomes the typed `NoSpace`.
pub(crate) fn fallocate_error(errno: Errno, path: &Path, bytes: u64) -> SegmentError {
    if errno == Errno::NOSPC {
        SegmentError::NoSpace {
            path: path.to_path_buf(),
            bytes,
        }
    } else {
        SegmentError::Io {
            op: "fallocate",
            path: path.to_path_buf(),
            source: errno.into(),
        }
    }
}

fn identity(file: &File, path: &Path) -> Result<(u64, u64), SegmentError> {
    let st = rustix::fs::fstat(file).map_err(io_error("fstat", path))?;
    Ok((st.st_dev, st.st_ino))
}

impl Segment {
    /// Creates (or replaces a stale) segment for a server.
    pub(crate) fn create(cfg: &ShmConfig) -> Result<Segment, SegmentError> {
        cfg.validate()?;
        let path = cfg.path.as_path();
        for _ in 0..CREATE_ATTEMPTS {
            if let Some(segment) = Self::try_create(cfg)? {
                return Ok(segment);
            }
        }
        Err(SegmentError::InUse {
            path: path.to_path_buf(),
        })
    }

    /// One attempt; `Ok(None)` means "the path changed under us, try again".
    fn try_create(cfg: &ShmConfig) -> Result<Option<Segment>, SegmentError> {
        let path = cfg.path.as_path();
        // 1. A predecessor?
        let predecessor =
            match rustix::fs::open(path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
                Ok(fd) => Some(File::from(fd)),
                Err(Errno::NOENT) => None,
                Err(errno) => return Err(io_error("open", path)(errno)),
            };
        let mut previous_generation = None;
        if let Some(old) = &predecessor {
            match rustix::fs::flock(old, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => {}
                Err(Errno::WOULDBLOCK) => {
                    return Err(SegmentError::InUse {
                        path: path.to_path_buf(),
                    });
                }
                Err(errno) => return Err(io_error("flock", path)(errno)),
            }
            previous_generation = read_generation(old);
        }
        // 2. The new file, complete, under a temporary name.
        let dir = path.parent().unwrap_or(Path::new("/"));
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let nonce = random_nonzero().map_err(|source| SegmentError::Io {
            op: "getrandom",
            path: path.to_path_buf(),
            source,
        })?;
        let tmp = dir.join(format!(".{name}.{}.{nonce:016x}.tmp", std::process::id()));
        let result = Self::build(cfg, &tmp, previous_generation);
        let segment = match result {
            Ok(segment) => segment,
            Err(e) => {
                let _ = rustix::fs::unlink(&tmp);
                return Err(e);
            }
        };
        // 3. Publish it.
        let published = match &predecessor {
            Some(old) => {
                let still_there = rustix::fs::stat(path)
                    .map(|st| (st.st_dev, st.st_ino))
                    .ok()
                    .zip(identity(old, path).ok())
                    .is_some_and(|(at_path, locked)| at_path == locked);
                if still_there {
                    rustix::fs::rename(&tmp, path).map_err(io_error("rename", path))?;
                    true
                } else {
                    false
                }
            }
            None => match rustix::fs::link(&tmp, path) {
                Ok(()) => {
                    let _ = rustix::fs::unlink(&tmp);
                    true
                }
                Err(Errno::EXIST) => false,
                Err(errno) => {
                    let _ = rustix::fs::unlink(&tmp);
                    return Err(io_error("link", path)(errno));
                }
            },
        };
        if !published {
            let _ = rustix::fs::unlink(&tmp);
            return Ok(None);
        }
        Ok(Some(Segment {
            path: path.to_path_buf(),
            ..segment
        }))
    }

    /// Creates, sizes, locks, maps and initialises the file at `tmp`.
    fn build(
        cfg: &ShmConfig,
        tmp: &Path,
        previous_generation: Option<u64>,
    ) -> Result<Segment, SegmentError> {
        let mode = Mode::from_raw_mode(cfg.file_mode);
        let fd = rustix::fs::open(
            tmp,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
            mode,
        )
        .map_err(io_error("create", tmp))?;
        let file = File::from(fd);
        // The umask may have cleared bits of the requested mode; set it exactly.
        rustix::fs::fchmod(&file, mode).map_err(io_error("fchmod", tmp))?;
        let generation = match previous_generation {
            Some(g) if g.wrapping_add(1) != 0 => g + 1,
            _ => random_nonzero().map_err(|source| SegmentError::Io {
                op: "getrandom",
                path: tmp.to_path_buf(),
                source,
            })?,
        };
        let layout = Layout::new(
            cfg.request_ring_bytes as u64,
            cfg.response_ring_bytes as u64,
            generation,
        );
        rustix::fs::fallocate(&file, FallocateFlags::empty(), 0, layout.segment_bytes)
            .map_err(|errno| fallocate_error(errno, &cfg.path, layout.segment_bytes))?;
        rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive)
            .map_err(io_error("flock", tmp))?;
        let region = Region::map(&file, layout.segment_bytes as usize, true).map_err(|source| {
            SegmentError::Io {
                op: "mmap",
                path: tmp.to_path_buf(),
                source,
            }
        })?;
        write_header(&region, &layout);
        let identity = identity(&file, tmp)?;
        Ok(Segment {
            region: Arc::new(region),
            _file: file,
            path: tmp.to_path_buf(),
            layout,
            identity,
        })
    }

    /// Opens and validates the segment at `path` (client side). Nothing in the header is
    /// trusted before validation; the file size comes from `fstat`, not from the header.
    pub(crate) fn open(path: &Path) -> Result<Segment, SegmentError> {
        let fd = match rustix::fs::open(path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                return Err(SegmentError::NotFound {
                    path: path.to_path_buf(),
                });
            }
            Err(errno) => return Err(io_error("open", path)(errno)),
        };
        let file = File::from(fd);
        let st = rustix::fs::fstat(&file).map_err(io_error("fstat", path))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(SegmentError::Io {
                op: "open",
                path: path.to_path_buf(),
                source: std::io::Error::other("not a regular file"),
            });
        }
        let size = u64::try_from(st.st_size).unwrap_or(0);
        if !(HEADER_BYTES as u64..=MAX_SEGMENT_BYTES).contains(&size) {
            return Err(SegmentError::Header {
                path: path.to_path_buf(),
                source: HeaderError::BadFileSize {
                    size,
                    min: HEADER_BYTES as u64,
                    max: MAX_SEGMENT_BYTES,
                },
            });
        }
        let region =
            Region::map(&file, size as usize, false).map_err(|source| SegmentError::Io {
                op: "mmap",
                path: path.to_path_buf(),
                source,
            })?;
        let layout = validate_header(&region, size).map_err(|source| SegmentError::Header {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Segment {
            region: Arc::new(region),
            _file: file,
            path: path.to_path_buf(),
            layout,
            identity: (st.st_dev, st.st_ino),
        })
    }

    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// A u64 header field.
    pub(crate) fn field(&self, offset: usize) -> &AtomicU64 {
        self.region.u64_at(offset)
    }

    /// A u32 header field.
    pub(crate) fn field32(&self, offset: usize) -> &AtomicU32 {
        self.region.u32_at(offset)
    }

    /// The request ring (client writes, server reads).
    pub(crate) fn request_ring(&self) -> RingRef {
        RingRef::new(
            self.region.clone(),
            offsets::REQUEST_CONTROL,
            self.layout.request_offset as usize,
            self.layout.request_capacity,
        )
    }

    /// The response ring (server writes, client reads).
    pub(crate) fn response_ring(&self) -> RingRef {
        RingRef::new(
            self.region.clone(),
            offsets::RESPONSE_CONTROL,
            self.layout.response_offset as usize,
            self.layout.response_capacity,
        )
    }

    /// Removes the file if the path still names this segment (a successor's file stays).
    pub(crate) fn unlink_if_ours(&self) {
        let ours =
            rustix::fs::stat(&self.path).is_ok_and(|st| (st.st_dev, st.st_ino) == self.identity);
        if ours {
            if let Err(errno) = rustix::fs::unlink(&self.path) {
                tracing::debug!(path = %self.path.display(), cause = %errno, "could not remove segment");
            } else {
                tracing::trace!(path = %self.path.display(), "segment removed");
            }
        }
    }
}

/// Reads the generation of a predecessor segment, if its header is valid.
fn read_generation(file: &File) -> Option<u64> {
    let size = u64::try_from(rustix::fs::fstat(file).ok()?.st_size).ok()?;
    if !(HEADER_BYTES as u64..=MAX_SEGMENT_BYTES).contains(&size) {
        return None;
    }
    let region = Region::map(file, HEADER_BYTES, false).ok()?;
    // Validate against the real size (the rings lie beyond the mapped header page).
    struct Header<'a>(&'a Region);
    impl HeaderSource for Header<'_> {
        fn u64_at(&self, offset: usize) -> u64 {
            self.0.u64_at(offset).load(Ordering::Acquire)
        }
        fn u32_at(&self, offset: usize) -> u32 {
            self.0.u32_at(offset).load(Ordering::Acquire)
        }
    }
    validate_header(&Header(&region), size)
        .ok()
        .map(|layout| layout.generation)
}

/// Writes a fresh header; the magic goes last, with release ordering, so a reader that sees
/// the magic sees every other field.
fn write_header(region: &Region, layout: &Layout) {
    let put = |offset: usize, value: u64| region.u64_at(offset).store(value, Ordering::Relaxed);
    region
        .u32_at(offsets::VERSION)
        .store(LAYOUT_VERSION, Ordering::Relaxed);
    region
        .u32_at(offsets::HEADER_SIZE)
        .store(HEADER_BYTES as u32, Ordering::Relaxed);
    put(offsets::SEGMENT_SIZE, layout.segment_bytes);
    put(offsets::GENERATION, layout.generation);
    put(offsets::REQUEST_OFFSET, layout.request_offset);
    put(offsets::REQUEST_CAPACITY, layout.request_capacity);
    put(offsets::RESPONSE_OFFSET, layout.response_offset);
    put(offsets::RESPONSE_CAPACITY, layout.response_capacity);
    region
        .u32_at(offsets::SERVER_STATE)
        .store(SERVER_SERVING, Ordering::Relaxed);
    region
        .u64_at(offsets::MAGIC)
        .store(MAGIC, Ordering::Release);
}

/// A random non-zero u64 from the OS (nonces, first generations, temporary names).
pub(crate) fn random_nonzero() -> std::io::Result<u64> {
    loop {
        match getrandom::u64() {
            Ok(0) => continue,
            Ok(value) => return Ok(value),
            Err(e) => return Err(std::io::Error::other(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enospc_from_fallocate_becomes_no_space() {
        let err = fallocate_error(Errno::NOSPC, Path::new("/dev/shm/x"), 10);
        assert!(matches!(err, SegmentError::NoSpace { bytes: 10, .. }));
        let err = fallocate_error(Errno::OPNOTSUPP, Path::new("/dev/shm/x"), 10);
        assert!(matches!(
            err,
            SegmentError::Io {
                op: "fallocate",
                ..
            }
        ));
    }
}
