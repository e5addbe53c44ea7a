//! The segment layout: a 4 KiB header page, then the request ring, then the response ring.
//!
//! ```text
//! offset  size  field                 written by  notes
//! ------  ----  --------------------  ----------  -----------------------------------------
//!      0     8  magic                 server      "ZLSHMSEG"; stored last at creation
//!      8     4  layout version        server      LAYOUT_VERSION
//!     12     4  header size           server      HEADER_BYTES
//!     16     8  segment size          server      must equal the file size
//!     24     8  generation            server      new for every server start (never 0)
//!     32     8  request ring offset   server      page aligned, after the header
//!     40     8  request ring capacity server      power of two
//!     48     8  response ring offset  server
//!     56     8  response ring cap.    server
//!     64     8  server heartbeat      server      +1 every heartbeat interval
//!     72     8  session               server      granted client nonce; 0 = no session
//!     80     4  server state          server      1 = serving, 2 = closed
//!    128     8  client heartbeat      client      +1 every heartbeat interval
//!    136     8  client nonce          client      asks for a session; 0 = detached
//!    256   256  request ring control  both        see RingControl offsets below
//!    512   256  response ring control both
//!   4096     …  request ring data, then response ring data
//! ```
//! Ring control block (offsets from its start; the two halves sit 128 bytes apart so the
//! writer's and the reader's words never share a cache line or an adjacent-line prefetch pair):
//! `+0` head u64 (writer), `+8` data futex word u32 (bumped by the writer to wake the reader),
//! `+12` writer-sleeping flag u32, `+128` tail u64 (reader), `+136` space futex word u32
//! (bumped by the reader to wake the writer), `+140` reader-sleeping flag u32.
//!
//! All fields are native-endian and accessed only through atomics.
//!
//! Session handshake (no locks in shared memory; the server alone grants):
//! 1. the client maps the segment, validates the header, and watches the server heartbeat
//!    move (a stale segment of a dead server never does);
//! 2. when `session` is 0 it writes a random non-zero nonce to `client nonce`, and keeps its
//!    heartbeat going;
//! 3. the server's keeper sees the new nonce, resets both rings, and publishes
//!    `session = nonce`: the session is live;
//! 4. the session ends when the client writes another value (0 = detach), its heartbeat
//!    stops, or a ring it writes is corrupt; the server then sets `session = 0`. A nonce is
//!    never granted twice in a row, so a dead client's nonce left behind is not re-granted.

use crate::config::{MAX_RING_BYTES, check_ring_bytes};
use crate::error::HeaderError;

/// "ZLSHMSEG" as a native-endian u64.
pub const MAGIC: u64 = u64::from_ne_bytes(*b"ZLSHMSEG");
/// The layout version this build speaks; bumped on any incompatible change.
pub const LAYOUT_VERSION: u32 = 1;
/// Bytes of the header page; ring data starts here.
pub const HEADER_BYTES: usize = 4096;
/// The largest segment: a header and two maximal rings.
pub const MAX_SEGMENT_BYTES: u64 = HEADER_BYTES as u64 + 2 * MAX_RING_BYTES as u64;

/// Field offsets in the header (see the module docs).
pub mod offsets {
    /// Magic number (u64).
    pub const MAGIC: usize = 0;
    /// Layout version (u32).
    pub const VERSION: usize = 8;
    /// Header size (u32).
    pub const HEADER_SIZE: usize = 12;
    /// Segment size (u64).
    pub const SEGMENT_SIZE: usize = 16;
    /// Generation (u64).
    pub const GENERATION: usize = 24;
    /// Request ring data offset (u64).
    pub const REQUEST_OFFSET: usize = 32;
    /// Request ring capacity (u64).
    pub const REQUEST_CAPACITY: usize = 40;
    /// Response ring data offset (u64).
    pub const RESPONSE_OFFSET: usize = 48;
    /// Response ring capacity (u64).
    pub const RESPONSE_CAPACITY: usize = 56;
    /// Server heartbeat counter (u64).
    pub const SERVER_HEARTBEAT: usize = 64;
    /// Granted session (u64).
    pub const SESSION: usize = 72;
    /// Server state (u32).
    pub const SERVER_STATE: usize = 80;
    /// Client heartbeat counter (u64).
    pub const CLIENT_HEARTBEAT: usize = 128;
    /// Client nonce (u64).
    pub const CLIENT_NONCE: usize = 136;
    /// Request ring control block.
    pub const REQUEST_CONTROL: usize = 256;
    /// Response ring control block.
    pub const RESPONSE_CONTROL: usize = 512;

    /// Offsets inside a ring control block.
    pub mod control {
        /// Write index (u64), written by the ring's writer.
        pub const HEAD: usize = 0;
        /// Futex word the writer bumps to wake a sleeping reader (u32).
        pub const DATA_SEQ: usize = 8;
        /// Set by a writer about to sleep for room (u32).
        pub const WRITER_SLEEPING: usize = 12;
        /// Read index (u64), written by the ring's reader.
        pub const TAIL: usize = 128;
        /// Futex word the reader bumps to wake a sleeping writer (u32).
        pub const SPACE_SEQ: usize = 136;
        /// Set by a reader about to sleep for data (u32).
        pub const READER_SLEEPING: usize = 140;
        /// Bytes of a control block.
        pub const BYTES: usize = 256;
    }
}

/// `server state`: the server is running.
pub const SERVER_SERVING: u32 = 1;
/// `server state`: the server shut down; clients stop at once instead of waiting for the
/// heartbeat to time out.
pub const SERVER_CLOSED: u32 = 2;

/// Where the two rings live, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Total segment bytes.
    pub segment_bytes: u64,
    /// Server generation.
    pub generation: u64,
    /// Request ring data offset.
    pub request_offset: u64,
    /// Request ring capacity.
    pub request_capacity: u64,
    /// Response ring data offset.
    pub response_offset: u64,
    /// Response ring capacity.
    pub response_capacity: u64,
}

impl Layout {
    /// The layout a server creates for the given (validated) ring sizes.
    pub fn new(request_capacity: u64, response_capacity: u64, generation: u64) -> Self {
        let request_offset = HEADER_BYTES as u64;
        let response_offset = request_offset + request_capacity;
        Layout {
            segment_bytes: response_offset + response_capacity,
            generation,
            request_offset,
            request_capacity,
            response_offset,
            response_capacity,
        }
    }
}

/// Reads header fields; implemented over the live mapping (atomics) and over byte images.
pub trait HeaderSource {
    /// The u64 at a header offset.
    fn u64_at(&self, offset: usize) -> u64;
    /// The u32 at a header offset.
    fn u32_at(&self, offset: usize) -> u32;
}

/// A header held in bytes (offline inspection, tests, fuzzing); missing bytes read as zero.
impl HeaderSource for [u8] {
    fn u64_at(&self, offset: usize) -> u64 {
        let mut word = [0u8; 8];
        if let Some(bytes) = self.get(offset..offset + 8) {
            word.copy_from_slice(bytes);
        }
        u64::from_ne_bytes(word)
    }

    fn u32_at(&self, offset: usize) -> u32 {
        let mut word = [0u8; 4];
        if let Some(bytes) = self.get(offset..offset + 4) {
            word.copy_from_slice(bytes);
        }
        u32::from_ne_bytes(word)
    }
}

/// Validates a header written by the peer against the size of the file it sits in. Each field
/// is read once; the result holds everything the client will use, so nothing static is read
/// from the segment again.
pub fn validate_header<S: HeaderSource + ?Sized>(
    source: &S,
    file_bytes: u64,
) -> Result<Layout, HeaderError> {
    if !(HEADER_BYTES as u64..=MAX_SEGMENT_BYTES).contains(&file_bytes) {
        return Err(HeaderError::BadFileSize {
            size: file_bytes,
            min: HEADER_BYTES as u64,
            max: MAX_SEGMENT_BYTES,
        });
    }
    let magic = source.u64_at(offsets::MAGIC);
    if magic != MAGIC {
        return Err(HeaderError::BadMagic { found: magic });
    }
    let version = source.u32_at(offsets::VERSION);
    if version != LAYOUT_VERSION {
        return Err(HeaderError::UnsupportedVersion {
            found: version,
            expected: LAYOUT_VERSION,
        });
    }
    let header_size = source.u32_at(offsets::HEADER_SIZE);
    if header_size != HEADER_BYTES as u32 {
        return Err(HeaderError::BadHeaderSize {
            found: header_size,
            expected: HEADER_BYTES as u32,
        });
    }
    let segment_bytes = source.u64_at(offsets::SEGMENT_SIZE);
    if segment_bytes != file_bytes {
        return Err(HeaderError::SizeMismatch {
            header: segment_bytes,
            file: file_bytes,
        });
    }
    let generation = source.u64_at(offsets::GENERATION);
    if generation == 0 {
        return Err(HeaderError::ZeroGeneration);
    }
    let request_offset = source.u64_at(offsets::REQUEST_OFFSET);
    let request_capacity = source.u64_at(offsets::REQUEST_CAPACITY);
    let response_offset = source.u64_at(offsets::RESPONSE_OFFSET);
    let response_capacity = source.u64_at(offsets::RESPONSE_CAPACITY);
    check_ring("request", request_offset, request_capacity, segment_bytes)?;
    check_ring(
        "response",
        response_offset,
        response_capacity,
        segment_bytes,
    )?;
    // Both rings are inside the segment and after the header; they must not overlap.
    let disjoint = request_offset + request_capacity <= response_offset
        || response_offset + response_capacity <= request_offset;
    if !disjoint {
        return Err(HeaderError::BadRing {
            ring: "response",
            offset: response_offset,
            capacity: response_capacity,
            reason: "overlaps the request ring",
        });
    }
    Ok(Layout {
        segment_bytes,
        generation,
        request_offset,
        request_capacity,
        response_offset,
        response_capacity,
    })
}

fn check_ring(
    ring: &'static str,
    offset: u64,
    capacity: u64,
    segment_bytes: u64,
) -> Result<(), HeaderError> {
    let bad = |reason| {
        Err(HeaderError::BadRing {
            ring,
            offset,
            capacity,
            reason,
        })
    };
    if let Err(reason) = check_ring_bytes(capacity) {
        return bad(reason);
    }
    if !offset.is_multiple_of(HEADER_BYTES as u64) {
        return bad("offset not page aligned");
    }
    if offset < HEADER_BYTES as u64 {
        return bad("overlaps the header");
    }
    // `capacity <= 1 GiB` was checked, so the sum cannot overflow unless `offset` is huge.
    match offset.checked_add(capacity) {
        Some(end) if end <= segment_bytes => Ok(()),
        _ => bad("extends past the segment"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn image(layout: &Layout) -> Vec<u8> {
        let mut bytes = vec![0u8; HEADER_BYTES];
        let mut put64 = |off: usize, v: u64| bytes[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        put64(offsets::MAGIC, MAGIC);
        put64(offsets::SEGMENT_SIZE, layout.segment_bytes);
        put64(offsets::GENERATION, layout.generation);
        put64(offsets::REQUEST_OFFSET, layout.request_offset);
        put64(offsets::REQUEST_CAPACITY, layout.request_capacity);
        put64(offsets::RESPONSE_OFFSET, layout.response_offset);
        put64(offsets::RESPONSE_CAPACITY, layout.response_capacity);
        bytes[offsets::VERSION..offsets::VERSION + 4]
            .copy_from_slice(&LAYOUT_VERSION.to_ne_bytes());
        bytes[offsets::HEADER_SIZE..offsets::HEADER_SIZE + 4]
            .copy_from_slice(&(HEADER_BYTES as u32).to_ne_bytes());
        bytes
    }

    fn good() -> Layout {
        Layout::new(8192, 4096, 42)
    }

    fn patch64(bytes: &mut [u8], off: usize, v: u64) {
        bytes[off..off + 8].copy_from_slice(&v.to_ne_bytes());
    }

    #[test]
    fn a_header_written_by_the_server_validates_to_the_same_layout() {
        let layout = good();
        assert_eq!(
            validate_header(image(&layout).as_slice(), layout.segment_bytes),
            Ok(layout)
        );
    }

    #[test]
    fn each_corrupt_header_field_gets_its_own_typed_error() {
        let layout = good();
        let size = layout.segment_bytes;
        let check = |patch: &dyn Fn(&mut Vec<u8>), file: u64| {
            let mut bytes = image(&layout);
            patch(&mut bytes);
            validate_header(bytes.as_slice(), file).unwrap_err()
        };
        assert!(matches!(
            check(&|_| {}, 100),
            HeaderError::BadFileSize { size: 100, .. }
        ));
        assert!(matches!(
            check(&|_| {}, u64::MAX),
            HeaderError::BadFileSize { .. }
        ));
        assert_eq!(
            check(&|b| patch64(b, offsets::MAGIC, 0xdead), size),
            HeaderError::BadMagic { found: 0xdead }
        );
        assert_eq!(
            check(
                &|b| b[offsets::VERSION..offsets::VERSION + 4].copy_from_slice(&7u32.to_ne_bytes()),
                size
            ),
            HeaderError::UnsupportedVersion {
                found: 7,
                expected: LAYOUT_VERSION
            }
        );
        assert!(matches!(
            check(&|b| b[offsets::HEADER_SIZE] ^= 1, size),
            HeaderError::BadHeaderSize { .. }
        ));
        assert_eq!(
            check(&|_| {}, size + 4096),
            HeaderError::SizeMismatch {
                header: size,
                file: size + 4096
            }
        );
        assert_eq!(
            check(&|b| patch64(b, offsets::GENERATION, 0), size),
            HeaderError::ZeroGeneration
        );
        let ring_reason = |patch: &dyn Fn(&mut Vec<u8>)| match check(patch, size) {
            HeaderError::BadRing { reason, .. } => reason,
            other => panic!("expected BadRing, got {other:?}"),
        };
        assert_eq!(
            ring_reason(&|b| patch64(b, offsets::REQUEST_CAPACITY, 5000)),
            "not a power of two"
        );
        assert_eq!(
            ring_reason(&|b| patch64(b, offsets::REQUEST_CAPACITY, 1 << 40)),
            "larger than MAX_RING_BYTES"
        );
        assert_eq!(
            ring_reason(&|b| patch64(b, offsets::REQUEST_OFFSET, 4096 + 8)),
            "offset not page aligned"
        );
        assert_eq!(
            ring_reason(&|b| patch64(b, offsets::REQUEST_OFFSET, 0)),
            "overlaps the header"
        );
        assert_eq!(
            ring_reason(&|b| patch64(b, offsets::RESPONSE_OFFSET, size)),
            "extends past the segment"
        );
        assert_eq!(
            ring_reason(&|b| patch64(b, offsets::RESPONSE_OFFSET, !4095)),
            "extends past the segment"
        );
        assert_eq!(
            ring_reason(&|b| patch64(b, offsets::RESPONSE_OFFSET, 8192)),
            "overlaps the request ring"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 8 } else { 256 }, ..ProptestConfig::default() })]

        /// Any header bytes and file size either validate to rings that lie inside the file,
        /// after the header and apart from each other, or give a typed error; never a panic.
        #[test]
        fn arbitrary_headers_validate_only_to_layouts_inside_the_file(
            mut bytes in proptest::collection::vec(any::<u8>(), 0..200),
            file in prop_oneof![any::<u64>(), 4096u64..(1 << 22)],
            seed_good: bool,
        ) {
            if seed_good {
                let mut good = image(&good());
                for (i, b) in bytes.iter().enumerate().take(64) {
                    // Keep the magic, version and sizes; scramble some later fields.
                    if i >= 24 { good[i] = *b; }
                }
                bytes = good;
            }
            if let Ok(l) = validate_header(bytes.as_slice(), file) {
                prop_assert_eq!(l.segment_bytes, file);
                for (off, cap) in [(l.request_offset, l.request_capacity), (l.response_offset, l.response_capacity)] {
                    prop_assert!(off >= HEADER_BYTES as u64 && off + cap <= file && cap.is_power_of_two());
                }
            }
        }
    }
}
