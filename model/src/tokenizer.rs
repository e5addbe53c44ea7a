//! Tokenizers with llama2.c semantics: the llama2.c file format (score-ordered pair merges) and a
//! byte-level tokenizer for dummy models.
//!
//! Encoding (llama2.c `encode`): optional BOS; if the text is non-empty, a dummy-prefix `" "`
//! token; then each UTF-8 code point becomes its vocabulary token, or its bytes as byte-fallback
//! tokens (`byte + 3`); then, repeatedly, the adjacent pair whose concatenated piece is in the
//! vocabulary with the highest score is merged (ties: leftmost pair; scores must beat `-1e10`,
//! NaN never merges), until no pair merges; optional EOS. Our merge loop uses a priority queue
//! over adjacent pairs (O(n log n)) instead of llama2.c's O(n²) rescans, with the same result.
//!
//! Decoding (llama2.c `decode`): a piece following BOS loses one leading space; a piece of the
//! exact form `<0xHH>` is the raw byte `0xHH`. Pieces are C strings in llama2.c, so a stored piece
//! is cut at its first NUL byte.
//!
//! Chat: base models have no chat template. [`Tokenizer::render_messages`] renders BOS followed by
//! each message's text encoded on its own (dummy prefix, no BOS), concatenated; **roles are not
//! rendered as tokens** (the engine still hashes them). A conversation's ids therefore only grow at
//! the end when a message is appended, which prefix reuse relies on.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::error::ModelError;

/// Unknown token id.
pub const UNK_ID: u32 = 0;
/// Beginning-of-sequence id (llama2.c).
pub const BOS_ID: u32 = 1;
/// End-of-sequence id (llama2.c).
pub const EOS_ID: u32 = 2;
/// Byte `b` falls back to token `b + BYTE_OFFSET` (llama2.c's `+3`).
pub const BYTE_OFFSET: u32 = 3;
/// Longest accepted piece in a tokenizer file; real files use ≤ 64 (`max_token_length`).
pub const MAX_PIECE_BYTES: usize = 4096;
/// llama2.c only merges pairs whose score beats this initial "best score".
const MIN_MERGE_SCORE: f32 = -1e10;

/// How text becomes ids.
#[derive(Clone, Debug)]
enum Kind {
    /// llama2.c vocabulary with merges.
    Llama2c {
        /// Merge score per id.
        scores: Vec<f32>,
        /// Piece bytes → lowest id with that piece.
        lookup: HashMap<Box<[u8]>, u32>,
    },
    /// Raw bytes only (dummy models): no merges.
    Bytes,
}

/// A tokenizer with llama2.c semantics.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    /// Piece bytes per id (cut at the first NUL, as C strings).
    pieces: Vec<Box<[u8]>>,
    /// Encoding rules.
    kind: Kind,
}

/// Order of merge candidates: highest score first, then leftmost.
#[derive(Debug, PartialEq)]
struct Candidate {
    /// Score of the merged piece (never NaN, -0 normalised to +0).
    score: f32,
    /// Node index of the left token (node order = text order).
    left: usize,
    /// Versions of the two nodes when the candidate was made; stale if either changed.
    versions: (u32, u32),
    /// Right node index.
    right: usize,
    /// Merged id.
    id: u32,
}

impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl Tokenizer {
    /// Parses a llama2.c tokenizer file for a model of `vocab_size` tokens: i32
    /// `max_token_length`, then per token f32 score, i32 length, bytes. Trailing bytes are an
    /// error (the file belongs to another vocabulary).
    pub fn from_llama2c_bytes(bytes: &[u8], vocab_size: usize) -> Result<Tokenizer, ModelError> {
        let bad = |reason: String| ModelError::InvalidTokenizer { reason };
        if vocab_size < BYTE_OFFSET as usize + 256 {
            return Err(bad(format!(
                "vocabulary of {vocab_size} cannot hold the 256 byte-fallback tokens"
            )));
        }
        let mut pos = 0usize;
        let mut take = |n: usize, what: &str| -> Result<&[u8], ModelError> {
            let end = pos
                .checked_add(n)
                .filter(|&e| e <= bytes.len())
                .ok_or_else(|| ModelError::Truncated {
                    what: "tokenizer file",
                    needed: (pos + n) as u64,
                    actual: bytes.len() as u64,
                })?;
            let s = &bytes[pos..end];
            pos = end;
            let _ = what;
            Ok(s)
        };
        let word = |b: &[u8]| [b[0], b[1], b[2], b[3]];
        let max_len = i32::from_le_bytes(word(take(4, "max_token_length")?));
        if max_len < 0 {
            return Err(bad(format!("max_token_length {max_len} is negative")));
        }
        let mut pieces = Vec::with_capacity(vocab_size.min(bytes.len() / 8));
        let mut scores = Vec::with_capacity(vocab_size.min(bytes.len() / 8));
        for id in 0..vocab_size {
            let score = f32::from_le_bytes(word(take(4, "score")?));
            if score.is_nan() {
                return Err(bad(format!("token {id} has a NaN score")));
            }
            let len = i32::from_le_bytes(word(take(4, "length")?));
            if !(0..=MAX_PIECE_BYTES as i32).contains(&len) {
                return Err(bad(format!(
                    "token {id} has length {len}, outside 0..={MAX_PIECE_BYTES}"
                )));
            }
            let raw = take(len as usize, "piece")?;
            let cut = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
            pieces.push(raw[..cut].to_vec().into_boxed_slice());
            scores.push(score);
        }
        if pos != bytes.len() {
            return Err(ModelError::SizeMismatch {
                what: "tokenizer file",
                expected: pos as u64,
                actual: bytes.len() as u64,
            });
        }
        let mut lookup = HashMap::with_capacity(vocab_size);
        for (id, p) in pieces.iter().enumerate() {
            lookup.entry(p.clone()).or_insert(id as u32);
        }
        Ok(Tokenizer {
            pieces,
            kind: Kind::Llama2c { scores, lookup },
        })
    }

    /// The byte-level tokenizer of dummy models: ids 0 `<unk>`, 1 `<s>`, 2 `</s>`, 3..=258 the
    /// bytes 0..=255 (printable ASCII as itself, others as `<0xHH>` raw-byte pieces), and every id from 259 on a printable pseudo-word (" ab", " kel", …) so
    /// random models print readable gibberish. Encoding uses bytes only.
    pub fn byte_level(vocab_size: usize) -> Result<Tokenizer, ModelError> {
        if vocab_size < BYTE_OFFSET as usize + 256 {
            return Err(ModelError::InvalidTokenizer {
                reason: format!("vocabulary of {vocab_size} cannot hold the 256 byte tokens"),
            });
        }
        let mut pieces: Vec<Box<[u8]>> = Vec::with_capacity(vocab_size);
        for p in ["<unk>", "\n<s>\n", "\n</s>\n"] {
            pieces.push(p.as_bytes().into());
        }
        for b in 0..=255u8 {
            // Printable ASCII pieces are the character itself (so the dummy-prefix space is a
            // " " piece that decoding strips after BOS, as with llama2.c vocabularies); every
            // other byte is a `<0xHH>` raw-byte piece.
            let piece = if (0x20..0x7f).contains(&b) {
                vec![b]
            } else {
                format!("<0x{b:02X}>").into_bytes()
            };
            pieces.push(piece.into_boxed_slice());
        }
        for id in pieces.len()..vocab_size {
            pieces.push(pseudo_word(id as u64 - 259).into_bytes().into_boxed_slice());
        }
        Ok(Tokenizer {
            pieces,
            kind: Kind::Bytes,
        })
    }

    /// Number of ids.
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// Beginning-of-sequence id.
    pub fn bos_id(&self) -> u32 {
        BOS_ID
    }

    /// End-of-sequence id.
    pub fn eos_id(&self) -> u32 {
        EOS_ID
    }

    /// The stored piece of `id` (empty for an out-of-range id).
    pub fn piece(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], |p| p)
    }

    /// Encodes `text` with llama2.c's rules (see the module docs).
    pub fn encode(&self, text: &str, bos: bool, eos: bool) -> Vec<u32> {
        let mut tokens = Vec::with_capacity(text.len() + 3);
        if bos {
            tokens.push(BOS_ID);
        }
        match &self.kind {
            Kind::Bytes => {
                if !text.is_empty() {
                    tokens.push(b' ' as u32 + BYTE_OFFSET);
                }
                tokens.extend(text.bytes().map(|b| b as u32 + BYTE_OFFSET));
            }
            Kind::Llama2c { scores, lookup } => {
                if !text.is_empty() {
                    match lookup.get(&b" "[..]) {
                        Some(&id) => tokens.push(id),
                        None => tokens.push(b' ' as u32 + BYTE_OFFSET),
                    }
                }
                let mut buf = [0u8; 4];
                for ch in text.chars() {
                    let s = ch.encode_utf8(&mut buf).as_bytes();
                    match lookup.get(s) {
                        Some(&id) => tokens.push(id),
                        None => tokens.extend(s.iter().map(|&b| b as u32 + BYTE_OFFSET)),
                    }
                }
                self.merge(&mut tokens, scores, lookup);
            }
        }
        if eos {
            tokens.push(EOS_ID);
        }
        tokens
    }

    /// One message of a conversation: its text with the dummy prefix, no BOS, no EOS.
    pub fn encode_message(&self, text: &str) -> Vec<u32> {
        self.encode(text, false, false)
    }

    /// `text` as it tokenises in the middle of other text: no BOS, no EOS and no dummy-prefix
    /// space, merged with the same rules (the engine's safety mask bans both this and the
    /// [`Tokenizer::encode_message`] form of a forbidden string).
    pub fn encode_continuation(&self, text: &str) -> Vec<u32> {
        match &self.kind {
            Kind::Bytes => text.bytes().map(|b| b as u32 + BYTE_OFFSET).collect(),
            Kind::Llama2c { scores, lookup } => {
                let mut tokens = Vec::with_capacity(text.len());
                let mut buf = [0u8; 4];
                for ch in text.chars() {
                    let s = ch.encode_utf8(&mut buf).as_bytes();
                    match lookup.get(s) {
                        Some(&id) => tokens.push(id),
                        None => tokens.extend(s.iter().map(|&b| b as u32 + BYTE_OFFSET)),
                    }
                }
                self.merge(&mut tokens, scores, lookup);
                tokens
            }
        }
    }

    /// BOS, then each message's text encoded with [`Tokenizer::encode_message`], concatenated.
    /// Roles are not rendered (base models have no chat template).
    pub fn render_messages<R: AsRef<str>, T: AsRef<str>>(&self, messages: &[(R, T)]) -> Vec<u32> {
        let mut out = vec![BOS_ID];
        for (_role, text) in messages {
            out.extend(self.encode_message(text.as_ref()));
        }
        out
    }

    /// The bytes printed for `token` after `prev` (llama2.c `decode`): strips one leading space
    /// after BOS and maps `<0xHH>` pieces to the raw byte.
    pub fn decode_piece(&self, prev: u32, token: u32) -> &[u8] {
        let mut piece = self.piece(token);
        if prev == BOS_ID && piece.first() == Some(&b' ') {
            piece = &piece[1..];
        }
        if let Some(b) = raw_byte(piece) {
            return &BYTES[b as usize..b as usize + 1];
        }
        piece
    }

    /// Decodes a whole id sequence (each piece after its predecessor; the first after `BOS` if
    /// `tokens[0]` is BOS, which itself decodes to nothing).
    pub fn decode(&self, tokens: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut prev = None;
        for &t in tokens {
            match prev {
                None if t == BOS_ID => {}
                None => out.extend_from_slice(self.decode_piece(u32::MAX, t)),
                Some(p) => out.extend_from_slice(self.decode_piece(p, t)),
            }
            prev = Some(t);
        }
        out
    }

    /// Score-ordered pair merges with a priority queue; see the module docs for the rule.
    fn merge(&self, tokens: &mut Vec<u32>, scores: &[f32], lookup: &HashMap<Box<[u8]>, u32>) {
        let n = tokens.len();
        if n < 2 {
            return;
        }
        // Doubly linked list over node indices; `usize::MAX` = none.
        let mut next: Vec<usize> = (1..=n)
            .map(|i| if i == n { usize::MAX } else { i })
            .collect();
        let mut prev: Vec<usize> = (0..n)
            .map(|i| if i == 0 { usize::MAX } else { i - 1 })
            .collect();
        let mut version = vec![0u32; n];
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::with_capacity(n);
        let mut buf = Vec::with_capacity(64);
        let mut push = |heap: &mut BinaryHeap<Candidate>,
                        tokens: &[u32],
                        version: &[u32],
                        l: usize,
                        r: usize| {
            buf.clear();
            buf.extend_from_slice(self.piece(tokens[l]));
            buf.extend_from_slice(self.piece(tokens[r]));
            if let Some(&id) = lookup.get(&buf[..]) {
                let score = scores[id as usize];
                if score > MIN_MERGE_SCORE {
                    // -0 and +0 compare equal in llama2.c: normalise so total_cmp agrees.
                    let score = if score == 0.0 { 0.0 } else { score };
                    heap.push(Candidate {
                        score,
                        left: l,
                        versions: (version[l], version[r]),
                        right: r,
                        id,
                    });
                }
            }
        };
        for i in 0..n - 1 {
            push(&mut heap, tokens, &version, i, i + 1);
        }
        while let Some(c) = heap.pop() {
            let (l, r) = (c.left, c.right);
            if !alive[l] || !alive[r] || next[l] != r || (version[l], version[r]) != c.versions {
                continue;
            }
            tokens[l] = c.id;
            version[l] += 1;
            alive[r] = false;
            let nr = next[r];
            next[l] = nr;
            if nr != usize::MAX {
                prev[nr] = l;
            }
            if prev[l] != usize::MAX {
                push(&mut heap, tokens, &version, prev[l], l);
            }
            if nr != usize::MAX {
                push(&mut heap, tokens, &version, l, nr);
            }
        }
        let mut out = Vec::with_capacity(n);
        let mut i = 0;
        while i != usize::MAX {
            out.push(tokens[i]);
            i = next[i];
        }
        *tokens = out;
    }
}

/// All 256 byte values, for returning one raw byte as a slice.
static BYTES: [u8; 256] = {
    let mut b = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        b[i] = i as u8;
        i += 1;
    }
    b
};

/// `Some(0xHH)` for a piece of the exact form `<0xHH>` (hex digits in either case).
fn raw_byte(piece: &[u8]) -> Option<u8> {
    if piece.len() != 6 || &piece[..3] != b"<0x" || piece[5] != b'>' {
        return None;
    }
    let hex = |c: u8| (c as char).to_digit(16);
    Some((hex(piece[3])? * 16 + hex(piece[4])?) as u8)
}

/// Pseudo-word number `n`: a space and 1–3 consonant-vowel syllables, deterministic in `n`.
fn pseudo_word(n: u64) -> String {
    const CONSONANTS: &[u8] = b"bdfgklmnprstvz";
    const VOWELS: &[u8] = b"aeiou";
    let mut h = crate::dummy::splitmix64(n);
    let syllables = 1 + (h % 3) as usize;
    h /= 3;
    let mut s = String::from(" ");
    for _ in 0..syllables {
        s.push(CONSONANTS[(h % CONSONANTS.len() as u64) as usize] as char);
        h /= CONSONANTS.len() as u64;
        s.push(VOWELS[(h % VOWELS.len() as u64) as usize] as char);
        h /= VOWELS.len() as u64;
    }
    if h.is_multiple_of(2) {
        s.push(CONSONANTS[(h / 2 % CONSONANTS.len() as u64) as usize] as char);
    }
    s
}

/// Whether llama2.c's `safe_printf` prints `piece`: everything except a single byte that is
/// neither printable ASCII nor whitespace (`isprint || isspace` in the C locale).
pub fn is_printable_piece(piece: &[u8]) -> bool {
    match piece {
        [b] => (0x20..=0x7e).contains(b) || matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r'),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_byte_pieces_are_recognised_only_in_exact_form() {
        assert_eq!(raw_byte(b"<0x0A>"), Some(10));
        assert_eq!(raw_byte(b"<0xff>"), Some(255));
        assert_eq!(raw_byte(b"<0x0A"), None);
        assert_eq!(raw_byte(b"<0xG1>"), None);
        assert_eq!(raw_byte(b"hello!"), None);
    }

    #[test]
    fn byte_level_tokenizer_round_trips_and_prints_pseudo_words() {
        let t = Tokenizer::byte_level(512).unwrap();
        let ids = t.encode("héllo\n", true, false);
        assert_eq!(ids[0], BOS_ID);
        assert_eq!(t.decode(&ids), "héllo\n".as_bytes());
        for id in 259..512 {
            let p = t.piece(id);
            assert!(p.len() >= 3 && p[0] == b' ' && p[1..].iter().all(|c| c.is_ascii_lowercase()));
        }
    }

    #[test]
    fn safe_printing_skips_single_control_bytes_only() {
        assert!(is_printable_piece(b"a"));
        assert!(is_printable_piece(b"\n"));
        assert!(!is_printable_piece(&[0x07]));
        assert!(!is_printable_piece(&[0xe4]));
        assert!(is_printable_piece(&[0xe4, 0xb8]));
    }
}
