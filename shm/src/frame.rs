//! Frame header encoding: 16 bytes in front of every payload, written and read as two `u64`
//! words (so both sides access them with atomics, never with torn or racy plain reads).
//!
//! ```text
//! word 0 (bytes 0..8):  len: u32 (payload bytes) | kind: u16 << 32 | flags: u16 << 48
//! word 1 (bytes 8..16): request id: u64
//! ```
//! The payload follows the header; the next frame starts at the next multiple of
//! [`FRAME_ALIGN`]. Words are in the machine's native byte order (both peers share one machine).

/// Bytes of a frame header.
pub const FRAME_HEADER_BYTES: usize = 16;

/// Every frame (and so every ring index) is a multiple of 16 bytes: the header's two words
/// are always 8-byte aligned, and the room left before the ring's end is always either zero
/// or large enough for a padding marker's header.
pub const FRAME_ALIGN: usize = 16;

/// Kinds from here up are reserved for the crate's own control frames; services use
/// `0..RESERVED_KIND_MIN` freely and opaquely. Defined control kinds: [`KIND_CANCEL`]; the
/// padding marker `0xFFFF` never leaves the ring layer. Any other reserved kind read from a
/// ring is corruption.
pub const RESERVED_KIND_MIN: u16 = 0xFF00;

/// Control frame (client → server): cancel the request whose id is in the header. No payload.
pub const KIND_CANCEL: u16 = 0xFF01;

/// Padding marker: skip to the end of the ring. Its `len` is the bytes after its header up
/// to the ring's end. Internal to the ring layer.
pub(crate) const KIND_PAD: u16 = 0xFFFF;

/// Flag: the last frame of a request's response stream. A header flag rather than a kind so
/// that kinds stay opaque to the crate.
pub const FLAG_LAST: u16 = 1;

/// All flags this build defines; any other bit read from a ring is corruption.
pub(crate) const KNOWN_FLAGS: u16 = FLAG_LAST;

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The request this frame belongs to.
    pub id: u64,
    /// The frame kind (opaque to the crate below [`RESERVED_KIND_MIN`]).
    pub kind: u16,
    /// Flag bits ([`FLAG_LAST`]).
    pub flags: u16,
    /// Payload length in bytes.
    pub len: u32,
}

impl FrameHeader {
    /// The two header words as stored in the ring.
    pub fn encode(&self) -> [u64; 2] {
        let w0 = u64::from(self.len) | (u64::from(self.kind) << 32) | (u64::from(self.flags) << 48);
        [w0, self.id]
    }

    /// Decodes two header words; every bit pattern decodes (validation is the ring layer's job).
    pub fn decode(words: [u64; 2]) -> Self {
        let [w0, id] = words;
        FrameHeader {
            id,
            // Truncating casts pick the documented bit fields.
            len: w0 as u32,
            kind: (w0 >> 32) as u16,
            flags: (w0 >> 48) as u16,
        }
    }
}

/// Bytes a frame with a `len`-byte payload occupies in the ring (header plus payload, rounded
/// up to [`FRAME_ALIGN`]). Computed in `u64` so no `u32` length overflows.
pub fn frame_bytes(len: u64) -> u64 {
    (FRAME_HEADER_BYTES as u64 + len).next_multiple_of(FRAME_ALIGN as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 8 } else { 256 }, ..ProptestConfig::default() })]

        #[test]
        fn headers_round_trip_through_their_two_words(id: u64, kind: u16, flags: u16, len: u32) {
            let h = FrameHeader { id, kind, flags, len };
            prop_assert_eq!(FrameHeader::decode(h.encode()), h);
        }

        #[test]
        fn every_word_pair_decodes_and_re_encodes_to_itself(w0: u64, w1: u64) {
            prop_assert_eq!(FrameHeader::decode([w0, w1]).encode(), [w0, w1]);
        }
    }

    #[test]
    fn frame_sizes_round_up_to_sixteen_bytes() {
        assert_eq!(frame_bytes(0), 16);
        assert_eq!(frame_bytes(1), 32);
        assert_eq!(frame_bytes(16), 32);
        assert_eq!(frame_bytes(17), 48);
        assert_eq!(
            frame_bytes(u64::from(u32::MAX)),
            (16 + u64::from(u32::MAX)).next_multiple_of(16)
        );
    }
}
