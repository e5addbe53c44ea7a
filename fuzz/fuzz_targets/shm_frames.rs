//! Fuzzes what a hostile shared-memory peer controls: the bytes of a ring plus its write
//! index (decoded frame by frame exactly as the live reader does), and the segment header
//! (validated against a file size). Neither may panic; every frame yielded must lie inside
//! the published data.
//!
//! Input: 8 bytes write index, 2 bytes read-index slot, 1 byte ring size selector, 8 bytes
//! file size, then the ring image / header bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zerolayer_shm::layout::validate_header;
use zerolayer_shm::ring::image::RingImage;

/// Frames decoded per input at most (a hostile image of zero-length frames could otherwise
/// yield capacity / 16 of them; this bound keeps an execution short).
const MAX_FRAMES: usize = 1024;

fuzz_target!(|data: &[u8]| {
    if data.len() < 19 {
        return;
    }
    let head = u64::from_le_bytes(data[0..8].try_into().unwrap());
    let tail_slot = u64::from(u16::from_le_bytes(data[8..10].try_into().unwrap()));
    let capacity = 4096u64 << (data[10] % 4);
    let file_size = u64::from_le_bytes(data[11..19].try_into().unwrap());
    let image = &data[19..];

    // A reader whose read index is anywhere in the first laps, facing any write index.
    let tail = (tail_slot * 16) % (capacity * 4);
    let mut ring = RingImage::from_bytes(capacity, image, head, tail);
    for _ in 0..MAX_FRAMES {
        let before = ring.tail;
        match ring.read() {
            Ok(Some((header, payload))) => {
                assert_eq!(payload.len(), header.len as usize);
                assert!(ring.tail.wrapping_sub(before) <= capacity);
                assert!(ring.head.wrapping_sub(ring.tail) <= capacity);
            }
            Ok(None) | Err(_) => break,
        }
    }

    // The same bytes as a segment header, against the claimed file size.
    if let Ok(layout) = validate_header(image, file_size) {
        assert_eq!(layout.segment_bytes, file_size);
        assert!(layout.request_offset + layout.request_capacity <= file_size);
        assert!(layout.response_offset + layout.response_capacity <= file_size);
    }
});
