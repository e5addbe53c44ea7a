//! Ring index arithmetic: pure functions, no memory access of their own (they read frame
//! headers through a closure), so they are property-tested against a model, run under Miri,
//! and fuzzed.
//!
//! A ring of capacity `C` (a power of two) has two monotonic `u64` byte counters: `head` (the
//! writer's next position) and `tail` (the reader's next position). A counter's ring offset is
//! `counter & (C - 1)`. Counters only grow (wrapping at 2⁶⁴, which `C` divides, so offsets stay
//! right). Invariants of an honest pair: both are multiples of [`FRAME_ALIGN`] and
//! `0 <= head - tail <= C`.
//!
//! Frames are contiguous. When a frame does not fit before the ring's end, the writer puts a
//! padding marker there and the frame at offset 0 (**a frame never straddles the end**, so a
//! reader can hand out one `&[u8]`). A payload is at most half the ring
//! ([`crate::config::max_payload_for_ring`]), which guarantees it fits into an empty ring.
//!
//! Nothing here trusts the peer: `next_step` validates the write index and every header
//! field it reads, each read exactly once into a local.

use crate::error::FrameError;
use crate::frame::{
    FRAME_ALIGN, FRAME_HEADER_BYTES, FrameHeader, KIND_CANCEL, KIND_PAD, KNOWN_FLAGS,
    RESERVED_KIND_MIN, frame_bytes,
};

/// The shape of one ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingGeometry {
    /// Capacity in bytes; a power of two, at least 4 KiB (checked by the constructor's callers
    /// through `config::check_ring_bytes`).
    capacity: u64,
}

impl RingGeometry {
    /// A geometry for `capacity` bytes. Panics unless the capacity is a power of two of at
    /// least two frame headers (callers validate sizes first; this is an internal invariant).
    pub fn new(capacity: u64) -> Self {
        assert!(
            capacity.is_power_of_two() && capacity >= 2 * FRAME_HEADER_BYTES as u64,
            "ring capacity {capacity} must be a validated power of two"
        );
        RingGeometry { capacity }
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The largest payload a frame in this ring may carry.
    pub fn max_payload(&self) -> u64 {
        self.capacity / 2 - FRAME_HEADER_BYTES as u64
    }

    /// The ring offset of a counter.
    pub fn offset(&self, counter: u64) -> u64 {
        counter & (self.capacity - 1)
    }
}

/// Where the writer puts a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WritePlan {
    /// A padding marker first: its ring offset and its `len` (bytes after its header up to the
    /// ring's end).
    pub pad: Option<(u64, u32)>,
    /// Ring offset of the frame header (the payload follows it).
    pub frame_offset: u64,
    /// The write index after the frame.
    pub new_head: u64,
}

/// Why a write cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// The payload exceeds [`RingGeometry::max_payload`]; it can never fit.
    TooLarge,
    /// Not enough room now; the reader must free some first.
    Full,
    /// The reader's index (read from shared memory) is impossible.
    Corrupt(FrameError),
}

/// Plans writing a frame with a `len`-byte payload at the local write index `head`, given the
/// reader's index `tail` as read (once) from shared memory.
pub fn plan_write(
    geom: RingGeometry,
    head: u64,
    tail: u64,
    len: u64,
) -> Result<WritePlan, PlanError> {
    if len > geom.max_payload() {
        return Err(PlanError::TooLarge);
    }
    let used = head.wrapping_sub(tail);
    if used > geom.capacity || !tail.is_multiple_of(FRAME_ALIGN as u64) {
        return Err(PlanError::Corrupt(FrameError::TailOutOfRange {
            head,
            tail,
            capacity: geom.capacity,
        }));
    }
    let free = geom.capacity - used;
    let total = frame_bytes(len);
    let offset = geom.offset(head);
    let to_end = geom.capacity - offset;
    if total <= to_end {
        if total > free {
            return Err(PlanError::Full);
        }
        return Ok(WritePlan {
            pad: None,
            frame_offset: offset,
            new_head: head.wrapping_add(total),
        });
    }
    // The frame does not fit before the end: pad to the end, then write at offset 0.
    // `to_end >= FRAME_ALIGN` here because `offset` is aligned and `total <= capacity / 2`.
    if to_end + total > free {
        return Err(PlanError::Full);
    }
    let pad_len = to_end - FRAME_HEADER_BYTES as u64;
    Ok(WritePlan {
        // `pad_len < capacity <= 1 GiB` (validated ring sizes), so it fits a u32.
        pad: Some((offset, pad_len as u32)),
        frame_offset: 0,
        new_head: head.wrapping_add(to_end).wrapping_add(total),
    })
}

/// What the reader finds at its read index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A frame: its validated header, the ring offset of its payload, and the read index
    /// after it.
    Frame {
        /// The validated header.
        header: FrameHeader,
        /// Ring offset of the payload (`header.len` bytes, not crossing the ring's end).
        payload_offset: u64,
        /// The read index once this frame is released.
        new_tail: u64,
    },
    /// A padding marker: advance the read index to `new_tail` (the start of the next lap).
    Skip {
        /// The read index after the marker.
        new_tail: u64,
    },
}

/// Examines the ring at the local read index `tail`, given the writer's index `head` as read
/// (once) from shared memory. `read_word(offset)` loads the header word at a ring offset
/// (always 8-byte aligned and in bounds). Returns `None` when the ring is empty.
pub fn next_step(
    geom: RingGeometry,
    tail: u64,
    head: u64,
    read_word: impl Fn(u64) -> u64,
) -> Result<Option<Step>, FrameError> {
    let avail = head.wrapping_sub(tail);
    if avail > geom.capacity || !head.is_multiple_of(FRAME_ALIGN as u64) {
        return Err(FrameError::HeadOutOfRange {
            head,
            tail,
            capacity: geom.capacity,
        });
    }
    if avail == 0 {
        return Ok(None);
    }
    // `tail` is ours and aligned, and `head` is aligned, so `avail >= FRAME_ALIGN`.
    let offset = geom.offset(tail);
    let to_end = geom.capacity - offset;
    let header = FrameHeader::decode([read_word(offset), read_word(offset + 8)]);
    if header.kind == KIND_PAD {
        let expected = to_end - FRAME_HEADER_BYTES as u64;
        if u64::from(header.len) != expected || header.flags != 0 || to_end > avail {
            return Err(FrameError::BadPadding {
                offset,
                len: header.len,
                expected,
            });
        }
        return Ok(Some(Step::Skip {
            new_tail: tail.wrapping_add(to_end),
        }));
    }
    let total = frame_bytes(u64::from(header.len));
    let room = avail.min(to_end);
    if total > room {
        return Err(FrameError::LengthOutOfBounds {
            len: header.len,
            offset,
            available: room,
        });
    }
    if header.flags & !KNOWN_FLAGS != 0 {
        return Err(FrameError::UnknownFlags {
            flags: header.flags,
        });
    }
    if header.kind >= RESERVED_KIND_MIN && !(header.kind == KIND_CANCEL && header.len == 0) {
        return Err(FrameError::BadControlFrame {
            kind: header.kind,
            len: header.len,
        });
    }
    Ok(Some(Step::Frame {
        header,
        payload_offset: offset + FRAME_HEADER_BYTES as u64,
        new_tail: tail.wrapping_add(total),
    }))
}

/// Offline decoding of a ring image: a simulated writer and reader over plain memory, used by
/// the unit tests, the property tests, Miri and the fuzz target. Not used by the live channel
/// (which does the same steps through atomics on the mapping).
pub mod image {
    use super::*;

    /// A ring held in a `Vec<u64>` (so header words are aligned), with both indices.
    #[derive(Debug, Clone)]
    pub struct RingImage {
        /// The ring's bytes as words.
        words: Vec<u64>,
        /// Its geometry.
        geom: RingGeometry,
        /// The writer's index.
        pub head: u64,
        /// The reader's index.
        pub tail: u64,
    }

    impl RingImage {
        /// An empty ring of `capacity` bytes with both indices at `start` (rounded down to
        /// [`FRAME_ALIGN`]); a start near `u64::MAX` exercises counter wrap-around.
        pub fn new(capacity: u64, start: u64) -> Self {
            let geom = RingGeometry::new(capacity);
            let start = start & !(FRAME_ALIGN as u64 - 1);
            RingImage {
                words: vec![0; (capacity / 8) as usize],
                geom,
                head: start,
                tail: start,
            }
        }

        /// A ring whose bytes come from `bytes` (truncated or zero-padded to `capacity`), with
        /// an arbitrary write index: what a reader faces when the peer is hostile. The read
        /// index is the reader's own and so always aligned: `tail` is rounded down to
        /// [`FRAME_ALIGN`].
        pub fn from_bytes(capacity: u64, bytes: &[u8], head: u64, tail: u64) -> Self {
            let mut image = RingImage::new(capacity, 0);
            for (i, chunk) in bytes.chunks(8).take(image.words.len()).enumerate() {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                image.words[i] = u64::from_ne_bytes(word);
            }
            image.head = head;
            image.tail = tail & !(FRAME_ALIGN as u64 - 1);
            image
        }

        /// The geometry.
        pub fn geometry(&self) -> RingGeometry {
            self.geom
        }

        fn word(&self, offset: u64) -> u64 {
            self.words[(offset / 8) as usize]
        }

        fn set_word(&mut self, offset: u64, value: u64) {
            self.words[(offset / 8) as usize] = value;
        }

        fn set_header(&mut self, offset: u64, header: FrameHeader) {
            let [w0, w1] = header.encode();
            self.set_word(offset, w0);
            self.set_word(offset + 8, w1);
        }

        /// Writes a frame as the live writer does; the payload bytes are `payload`.
        pub fn write(
            &mut self,
            id: u64,
            kind: u16,
            flags: u16,
            payload: &[u8],
        ) -> Result<(), PlanError> {
            let plan = plan_write(self.geom, self.head, self.tail, payload.len() as u64)?;
            if let Some((offset, len)) = plan.pad {
                self.set_header(
                    offset,
                    FrameHeader {
                        id: 0,
                        kind: KIND_PAD,
                        flags: 0,
                        len,
                    },
                );
            }
            // `payload.len() <= max_payload < u32::MAX` after a successful plan.
            let len = payload.len() as u32;
            self.set_header(
                plan.frame_offset,
                FrameHeader {
                    id,
                    kind,
                    flags,
                    len,
                },
            );
            let start = plan.frame_offset + FRAME_HEADER_BYTES as u64;
            for (chunk_index, chunk) in payload.chunks(8).enumerate() {
                let offset = start + 8 * chunk_index as u64;
                let mut word = self.word(offset).to_ne_bytes();
                word[..chunk.len()].copy_from_slice(chunk);
                self.set_word(offset, u64::from_ne_bytes(word));
            }
            self.head = plan.new_head;
            Ok(())
        }

        /// Reads and releases the next frame (skipping padding), as the live reader does.
        pub fn read(&mut self) -> Result<Option<(FrameHeader, Vec<u8>)>, FrameError> {
            loop {
                let step = next_step(self.geom, self.tail, self.head, |offset| self.word(offset))?;
                match step {
                    None => return Ok(None),
                    Some(Step::Skip { new_tail }) => self.tail = new_tail,
                    Some(Step::Frame {
                        header,
                        payload_offset,
                        new_tail,
                    }) => {
                        let mut payload = Vec::with_capacity(header.len as usize);
                        let mut offset = payload_offset;
                        while payload.len() < header.len as usize {
                            let word = self.word(offset & !7).to_ne_bytes();
                            let skip = (offset & 7) as usize;
                            let take = (8 - skip).min(header.len as usize - payload.len());
                            payload.extend_from_slice(&word[skip..skip + take]);
                            offset += take as u64;
                        }
                        self.tail = new_tail;
                        return Ok(Some((header, payload)));
                    }
                }
            }
        }

        /// Bytes in use between the indices.
        pub fn used(&self) -> u64 {
            self.head.wrapping_sub(self.tail)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::image::RingImage;
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    const CAP: u64 = 4096;

    #[test]
    fn an_empty_ring_reads_nothing() {
        let mut ring = RingImage::new(CAP, 0);
        assert_eq!(ring.read().unwrap(), None);
    }

    #[test]
    fn a_frame_round_trips_with_its_header_and_payload() {
        let mut ring = RingImage::new(CAP, 0);
        ring.write(7, 3, FLAG_LAST_FOR_TESTS, b"hello").unwrap();
        let (h, p) = ring.read().unwrap().unwrap();
        assert_eq!(
            (h.id, h.kind, h.flags, h.len),
            (7, 3, FLAG_LAST_FOR_TESTS, 5)
        );
        assert_eq!(p, b"hello");
        assert_eq!(ring.used(), 0);
    }

    const FLAG_LAST_FOR_TESTS: u16 = crate::frame::FLAG_LAST;

    #[test]
    fn the_ring_fills_to_exactly_its_capacity_and_then_reports_full() {
        let mut ring = RingImage::new(CAP, 0);
        // 16 B header + 240 B payload = 256 B per frame: 16 frames fill 4096 B exactly.
        for i in 0..16 {
            ring.write(i, 1, 0, &[i as u8; 240]).unwrap();
        }
        assert_eq!(ring.used(), CAP);
        assert_eq!(ring.write(99, 1, 0, &[]), Err(PlanError::Full));
        ring.read().unwrap().unwrap();
        ring.write(16, 1, 0, &[16; 240]).unwrap();
        assert_eq!(ring.used(), CAP);
    }

    #[test]
    fn a_frame_that_does_not_fit_before_the_end_is_padded_to_the_next_lap() {
        let mut ring = RingImage::new(CAP, 0);
        ring.write(1, 1, 0, &[1; 1500]).unwrap(); // 0..1520
        ring.write(2, 1, 0, &[2; 1000]).unwrap(); // 1520..2536
        ring.read().unwrap().unwrap();
        ring.read().unwrap().unwrap();
        ring.write(3, 1, 0, &[3; 1900]).unwrap(); // 1920 bytes, 1560 left before the end: pad
        assert_eq!(ring.head, 2536 + 1560 + 1920);
        let (h, p) = ring.read().unwrap().unwrap();
        assert_eq!((h.id, p.len()), (3, 1900));
        assert!(p.iter().all(|&b| b == 3));
        assert_eq!(ring.used(), 0);
    }

    #[test]
    fn a_frame_that_exactly_reaches_the_end_needs_no_padding() {
        let mut ring = RingImage::new(CAP, 0);
        ring.write(1, 1, 0, &[0; 2048 - 16]).unwrap();
        ring.read().unwrap().unwrap();
        let plan = plan_write(ring.geometry(), ring.head, ring.tail, 2048 - 16).unwrap();
        assert_eq!(plan.pad, None);
        assert_eq!(plan.frame_offset, 2048);
    }

    #[test]
    fn a_payload_over_half_the_ring_is_too_large_even_when_empty() {
        let ring = RingImage::new(CAP, 0);
        let geom = ring.geometry();
        assert_eq!(
            plan_write(geom, 0, 0, geom.max_payload() + 1),
            Err(PlanError::TooLarge)
        );
        assert!(plan_write(geom, 0, 0, geom.max_payload()).is_ok());
    }

    #[test]
    fn indices_wrap_around_u64_max() {
        let mut ring = RingImage::new(CAP, u64::MAX - 100);
        for round in 0..50u64 {
            ring.write(round, 1, 0, &vec![round as u8; (round * 37 % 700) as usize])
                .unwrap();
            let (h, p) = ring.read().unwrap().unwrap();
            assert_eq!(h.id, round);
            assert!(p.iter().all(|&b| b == round as u8));
        }
        assert!(ring.head < 1 << 20, "the counters wrapped");
    }

    #[test]
    fn a_write_index_behind_the_read_index_is_corruption() {
        let mut ring = RingImage::new(CAP, 1024);
        ring.head = 512;
        assert!(matches!(
            ring.read(),
            Err(FrameError::HeadOutOfRange { .. })
        ));
    }

    #[test]
    fn a_write_index_more_than_a_ring_ahead_is_corruption() {
        let mut ring = RingImage::new(CAP, 0);
        ring.head = CAP + 16;
        assert!(matches!(
            ring.read(),
            Err(FrameError::HeadOutOfRange { .. })
        ));
    }

    #[test]
    fn a_misaligned_write_index_is_corruption() {
        let mut ring = RingImage::new(CAP, 0);
        ring.head = 24;
        assert!(matches!(
            ring.read(),
            Err(FrameError::HeadOutOfRange { .. })
        ));
    }

    #[test]
    fn a_frame_length_beyond_the_published_data_is_corruption() {
        let mut ring = RingImage::new(CAP, 0);
        ring.write(1, 1, 0, &[0; 100]).unwrap();
        // Patch the length to 200: the header claims more than was published.
        let mut hostile = RingImage::from_bytes(CAP, &header_bytes(1, 1, 0, 200), ring.head, 0);
        assert_eq!(
            hostile.read(),
            Err(FrameError::LengthOutOfBounds {
                len: 200,
                offset: 0,
                available: ring.head
            })
        );
    }

    #[test]
    fn a_frame_length_past_the_ring_end_is_corruption_even_if_published() {
        // Read index at 4064 (32 bytes before the end), 64 bytes published, frame claims 40.
        let mut bytes = vec![0u8; CAP as usize];
        bytes[4064..4080].copy_from_slice(&header_bytes(1, 1, 0, 40));
        let mut hostile = RingImage::from_bytes(CAP, &bytes, 4064 + 64, 4064);
        assert!(matches!(
            hostile.read(),
            Err(FrameError::LengthOutOfBounds { available: 32, .. })
        ));
    }

    #[test]
    fn a_huge_frame_length_is_corruption_not_an_overflow() {
        let mut hostile = RingImage::from_bytes(CAP, &header_bytes(1, 1, 0, u32::MAX), 64, 0);
        assert!(matches!(
            hostile.read(),
            Err(FrameError::LengthOutOfBounds { .. })
        ));
    }

    #[test]
    fn a_padding_marker_that_does_not_reach_the_end_is_corruption() {
        let mut hostile = RingImage::from_bytes(CAP, &header_bytes(0, KIND_PAD, 0, 16), 64, 0);
        assert!(matches!(hostile.read(), Err(FrameError::BadPadding { .. })));
    }

    #[test]
    fn unknown_control_kinds_and_flags_are_corruption() {
        let mut hostile = RingImage::from_bytes(CAP, &header_bytes(1, 0xFF42, 0, 0), 16, 0);
        assert!(matches!(
            hostile.read(),
            Err(FrameError::BadControlFrame { kind: 0xFF42, .. })
        ));
        let mut hostile = RingImage::from_bytes(CAP, &header_bytes(1, KIND_CANCEL, 0, 8), 32, 0);
        assert!(matches!(
            hostile.read(),
            Err(FrameError::BadControlFrame { .. })
        ));
        let mut hostile = RingImage::from_bytes(CAP, &header_bytes(1, 1, 0x8000, 0), 16, 0);
        assert!(matches!(
            hostile.read(),
            Err(FrameError::UnknownFlags { flags: 0x8000 })
        ));
    }

    #[test]
    fn a_read_index_ahead_of_the_write_index_is_reported_to_the_writer() {
        let geom = RingGeometry::new(CAP);
        assert!(matches!(
            plan_write(geom, 0, 16, 0),
            Err(PlanError::Corrupt(FrameError::TailOutOfRange { .. }))
        ));
        assert!(matches!(
            plan_write(geom, 64, 8, 0),
            Err(PlanError::Corrupt(FrameError::TailOutOfRange { .. }))
        ));
        assert!(matches!(
            plan_write(geom, CAP + 16, 0, 0),
            Err(PlanError::Corrupt(_))
        ));
    }

    fn header_bytes(id: u64, kind: u16, flags: u16, len: u32) -> [u8; 16] {
        let [w0, w1] = FrameHeader {
            id,
            kind,
            flags,
            len,
        }
        .encode();
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&w0.to_ne_bytes());
        out[8..].copy_from_slice(&w1.to_ne_bytes());
        out
    }

    #[derive(Debug, Clone)]
    enum Op {
        Write(u16),
        Read,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u16..2100).prop_map(Op::Write),
            2 => Just(Op::Read),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 4 } else { 256 }, ..ProptestConfig::default() })]

        /// Random writes and reads agree with a `VecDeque` model: frames come out in order and
        /// intact, the ring never holds more than its capacity, an empty ring always accepts a
        /// frame, and `Full` only happens when the queued bytes plus the new frame plus the
        /// padding that can be in the way (less than one queued frame at the end of the
        /// previous lap and less than the new frame at the end of this one) exceed the capacity.
        #[test]
        fn random_writes_and_reads_match_a_vecdeque_model(
            start in prop_oneof![Just(0u64), Just(u64::MAX - 4000), any::<u64>()],
            ops in proptest::collection::vec(op(), 1..300),
        ) {
            let mut ring = RingImage::new(CAP, start);
            let mut model: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
            let mut queued_bytes = 0u64;
            let mut next_id = 0u64;
            for op in ops {
                match op {
                    Op::Write(len) => {
                        let len = u64::from(len).min(ring.geometry().max_payload());
                        let payload: Vec<u8> = (0..len).map(|i| (i as u8) ^ (next_id as u8)).collect();
                        match ring.write(next_id, 1, 0, &payload) {
                            Ok(()) => {
                                queued_bytes += frame_bytes(len);
                                model.push_back((next_id, payload));
                                next_id += 1;
                            }
                            Err(PlanError::Full) => {
                                prop_assert!(!model.is_empty(), "an empty ring refused a frame");
                                let total = frame_bytes(len);
                                let largest_queued = model.iter().map(|(_, p)| frame_bytes(p.len() as u64)).max().unwrap_or(16);
                                let padding_bound = (largest_queued - 16) + (total - 16);
                                prop_assert!(queued_bytes + total + padding_bound > CAP,
                                    "full with {} queued for a {}-byte frame", queued_bytes, total);
                            }
                            Err(e) => prop_assert!(false, "unexpected {:?}", e),
                        }
                    }
                    Op::Read => {
                        let got = ring.read().unwrap();
                        match model.pop_front() {
                            None => prop_assert_eq!(got, None),
                            Some((id, payload)) => {
                                let (h, p) = got.unwrap();
                                prop_assert_eq!(h.id, id);
                                prop_assert_eq!(p.len(), payload.len());
                                prop_assert_eq!(p, payload.clone());
                                queued_bytes -= frame_bytes(payload.len() as u64);
                            }
                        }
                    }
                }
                prop_assert!(ring.used() <= CAP);
                prop_assert_eq!(ring.head % 16, 0);
            }
            // Drain: everything written comes out.
            while let Some((id, payload)) = model.pop_front() {
                let (h, p) = ring.read().unwrap().unwrap();
                prop_assert_eq!((h.id, p), (id, payload));
            }
            prop_assert_eq!(ring.read().unwrap(), None);
        }

        /// Whatever bytes and indices a hostile peer leaves, reading never panics and every
        /// frame it yields lies inside the published data and the ring.
        #[test]
        fn arbitrary_ring_images_never_panic_and_yield_frames_in_bounds(
            bytes in proptest::collection::vec(any::<u8>(), 0..4096),
            head: u64,
            tail_slot in 0u64..256,
        ) {
            let tail = tail_slot * 16;
            let mut ring = RingImage::from_bytes(CAP, &bytes, head, tail);
            for _ in 0..64 {
                let before = ring.tail;
                match ring.read() {
                    Ok(Some((h, p))) => {
                        prop_assert_eq!(p.len(), h.len as usize);
                        prop_assert!(ring.tail.wrapping_sub(before) <= CAP);
                    }
                    Ok(None) | Err(_) => break,
                }
            }
        }
    }
}
