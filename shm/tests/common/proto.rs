//! The test protocol spoken by `zerolayer-shm-peer` and the integration tests (included by
//! both with `#[path]`): request kinds, the stream request body, deterministic chunk
//! contents, and a checksum.

#![allow(dead_code, reason = "each includer uses a different subset")]

/// Request: answer with one frame carrying the same payload (kind `KIND_ECHO`, last).
pub const KIND_ECHO: u16 = 1;
/// Request: a `StreamSpec`; answered with `chunks` frames of kind `KIND_CHUNK`, then one
/// `KIND_END` frame (last) carrying the checksum of all chunk payloads and their count.
pub const KIND_STREAM: u16 = 2;
/// Request: never answered (stays in flight until cancelled or the session ends).
pub const KIND_HANG: u16 = 3;
/// Response: one stream chunk.
pub const KIND_CHUNK: u16 = 10;
/// Response: the end of a stream.
pub const KIND_END: u16 = 11;

/// Body of a `KIND_STREAM` request (20 bytes, little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamSpec {
    /// Number of chunks.
    pub chunks: u32,
    /// Base chunk length; chunk `i` has `chunk_len(spec, i)` bytes.
    pub chunk_len: u32,
    /// Seed of the chunk contents.
    pub seed: u64,
    /// Pause between chunks, in microseconds.
    pub delay_us: u32,
}

impl StreamSpec {
    pub const BYTES: usize = 20;

    pub fn encode(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.chunks.to_le_bytes());
        out[4..8].copy_from_slice(&self.chunk_len.to_le_bytes());
        out[8..16].copy_from_slice(&self.seed.to_le_bytes());
        out[16..20].copy_from_slice(&self.delay_us.to_le_bytes());
    }

    pub fn decode(bytes: &[u8]) -> Option<StreamSpec> {
        if bytes.len() != Self::BYTES {
            return None;
        }
        Some(StreamSpec {
            chunks: u32::from_le_bytes(bytes[0..4].try_into().ok()?),
            chunk_len: u32::from_le_bytes(bytes[4..8].try_into().ok()?),
            seed: u64::from_le_bytes(bytes[8..16].try_into().ok()?),
            delay_us: u32::from_le_bytes(bytes[16..20].try_into().ok()?),
        })
    }

    /// Length of chunk `index`: varies around `chunk_len` so frames wrap the ring at every
    /// possible offset.
    pub fn chunk_len(&self, index: u32) -> usize {
        let base = self.chunk_len as usize;
        base / 2 + (splitmix(self.seed ^ u64::from(index)) as usize % (base + 1))
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Fills a chunk with its deterministic contents.
pub fn fill_chunk(seed: u64, index: u32, out: &mut [u8]) {
    let mut state = splitmix(seed.rotate_left(17) ^ u64::from(index));
    for chunk in out.chunks_mut(8) {
        state = splitmix(state);
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
}

/// FNV-1a over some bytes, continuing from `hash` (start with `CHECKSUM_START`).
pub fn checksum(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01B3);
    }
    hash
}

/// Initial value of `checksum`.
pub const CHECKSUM_START: u64 = 0xCBF2_9CE4_8422_2325;

/// Body of the `KIND_END` frame: checksum (u64) and chunk count (u32), little-endian.
pub fn encode_end(sum: u64, count: u32, out: &mut [u8]) {
    out[0..8].copy_from_slice(&sum.to_le_bytes());
    out[8..12].copy_from_slice(&count.to_le_bytes());
}

pub const END_BYTES: usize = 12;

pub fn decode_end(bytes: &[u8]) -> Option<(u64, u32)> {
    if bytes.len() != END_BYTES {
        return None;
    }
    Some((
        u64::from_le_bytes(bytes[0..8].try_into().ok()?),
        u32::from_le_bytes(bytes[8..12].try_into().ok()?),
    ))
}
