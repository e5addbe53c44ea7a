//! Host-side logic of the CUDA backend that needs no GPU (and is unit-tested on CPU): bf16
//! conversions matching the device's, the per-step metadata staging buffer (validated, so that
//! every index a kernel derives from it is in bounds), and the attention work plan.
//!
//! # The staging layout
//! One `Vec<u32>` per step, copied to the device with a single transfer; sections, in order
//! (`T` tokens, `W` chunks wanting logits, `S` sampling rows, either 0 or `W`):
//!
//! | section      | words        | content                                                      |
//! |--------------|--------------|--------------------------------------------------------------|
//! | `tokens`     | `T`          | token id (< vocab)                                           |
//! | `pos`        | `T`          | position of the token in its sequence (< max_seq_len)        |
//! | `tbl`        | `T`          | offset in `tables` of the token's sequence's block table     |
//! | `tiles`      | `4 × tiles`  | attention tiles: first token, tokens, first position, table  |
//! | `logit_rows` | `W`          | token index of the last token of each chunk wanting logits   |
//! | `tables`     | Σ blocks     | each chunk's block ids covering `0..start_pos + len` (< num_blocks) |
//! | `params`     | `6 × S`      | temperature bits, top_k, top_p bits, uniform bits, banned offset, banned count |
//! | `banned`     | Σ banned     | banned ids (< vocab)                                         |
//!
//! followed by one padding word (so every section, even an empty one, has a valid address).

use std::ops::Range;

use super::source::consts::{FA_KT, FA_MAX_ROWS};

/// Largest number of tokens in one step: token indices, positions and table offsets travel as
/// u32 and tile/grid sizes as i32; 2²⁴ is far above any step that fits in device memory.
pub const MAX_STEP_TOKENS: usize = 1 << 24;
/// Largest number of words in one step's staging buffer (u32 offsets, i32 kernel arguments).
pub const MAX_STAGING_WORDS: usize = (1 << 31) - 1;
/// Most KV splits of one attention launch (`grid.z`): enough to spread one long sequence over
/// 2 × 132 H200 multiprocessors with 8 KV heads; the partial buffer scales with it.
pub const MAX_SPLITS: usize = 32;
/// Shortest KV split worth a block: two 32-key tiles.
pub const MIN_SPLIT_LEN: usize = 2 * FA_KT;

/// f32 → bf16 bits, round to nearest with ties to even; NaN stays a quiet NaN with its sign.
/// Identical to the device's `f32_to_bf16` and to `half::bf16::from_f32`.
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x0040) as u16;
    }
    let rounding = 0x7fff + ((u >> 16) & 1);
    (u.wrapping_add(rounding) >> 16) as u16
}

/// bf16 bits → f32 (exact).
pub fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// What a step's indices are checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepGeometry {
    /// Token ids are `0..vocab_size`.
    pub vocab_size: usize,
    /// Positions are `0..max_seq_len` (the RoPE table's rows).
    pub max_seq_len: usize,
    /// Token positions per KV block.
    pub block_size: usize,
    /// Block ids are `0..num_blocks`.
    pub num_blocks: usize,
    /// Tokens per attention tile: `FA_MAX_ROWS / (n_heads / n_kv_heads)`, at least 1.
    pub tile_tokens: usize,
}

impl StepGeometry {
    /// Tokens per attention tile for a query-head group of `group` heads per KV head.
    pub fn tile_tokens_for_group(group: usize) -> usize {
        (FA_MAX_ROWS / group.max(1)).max(1)
    }
}

/// A step's chunks or sampling rows are not acceptable. Fields mirror the model's
/// `BackendError` so the backend maps them one to one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// No chunks.
    #[error("empty batch")]
    EmptyBatch,
    /// A chunk has no tokens.
    #[error("chunk {chunk} has no tokens")]
    EmptyChunk {
        /// Chunk index.
        chunk: usize,
    },
    /// A token id is not in the vocabulary.
    #[error("chunk {chunk}: token {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange {
        /// Chunk index.
        chunk: usize,
        /// The id.
        token: u32,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// Positions past the model's context.
    #[error("chunk {chunk}: positions up to {end} exceed the context of {max_seq_len}")]
    ContextOverflow {
        /// Chunk index.
        chunk: usize,
        /// `start_pos + len`.
        end: usize,
        /// Context length.
        max_seq_len: usize,
    },
    /// The block table does not cover the positions.
    #[error("chunk {chunk}: block table has {actual} blocks, positions need {needed}")]
    BlockTableTooShort {
        /// Chunk index.
        chunk: usize,
        /// Blocks needed.
        needed: usize,
        /// Blocks given.
        actual: usize,
    },
    /// A block id outside the pool.
    #[error("chunk {chunk}: block {block} is outside the pool of {num_blocks} blocks")]
    BlockOutOfRange {
        /// Chunk index.
        chunk: usize,
        /// The id.
        block: u32,
        /// Pool size.
        num_blocks: usize,
    },
    /// A banned id outside the vocabulary.
    #[error("banned token {token} is outside the vocabulary (size {vocab_size})")]
    BannedOutOfRange {
        /// The id.
        token: u32,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// Sampling rows were given, but not one per chunk wanting logits.
    #[error("{actual} sampling rows for {expected} chunks wanting logits")]
    SamplingRows {
        /// Chunks wanting logits.
        expected: usize,
        /// Rows given.
        actual: usize,
    },
    /// The step exceeds a representable size.
    #[error("{what} {value} exceeds the limit of {limit}")]
    TooLarge {
        /// What overflowed.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The limit.
        limit: usize,
    },
}

/// Sampling parameters of one row, already validated by the model's `SamplingParams`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleRow {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = no top-k cut.
    pub top_k: u32,
    /// 1 = no top-p cut.
    pub top_p: f32,
    /// The draw in `[0, 1)`.
    pub uniform: f32,
}

/// Word ranges of the sections in the staging buffer, and the step's counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepLayout {
    /// Token ids.
    pub tokens: Range<usize>,
    /// Positions.
    pub pos: Range<usize>,
    /// Table offset per token.
    pub tbl: Range<usize>,
    /// Attention tiles (4 words each).
    pub tiles: Range<usize>,
    /// Rows wanting logits.
    pub logit_rows: Range<usize>,
    /// Concatenated block tables.
    pub tables: Range<usize>,
    /// Sampling parameters (6 words per row).
    pub params: Range<usize>,
    /// Banned ids.
    pub banned: Range<usize>,
    /// Tokens in the step.
    pub n_tokens: usize,
    /// Chunks wanting logits.
    pub n_logit_rows: usize,
    /// Sampling rows (0 or `n_logit_rows`).
    pub n_sample_rows: usize,
    /// Attention tiles.
    pub n_tiles: usize,
    /// Largest `start_pos + len` of the step.
    pub max_end: usize,
    /// Total words including the padding word.
    pub words: usize,
}

/// Builds and validates one step's staging buffer; reused across steps (no allocation once the
/// largest step has been seen).
#[derive(Clone, Debug)]
pub struct StepBuilder {
    /// Limits every index is checked against.
    geometry: StepGeometry,
    /// Token ids.
    tokens: Vec<u32>,
    /// Positions.
    pos: Vec<u32>,
    /// Table offset of each token's sequence.
    tbl: Vec<u32>,
    /// Tiles, 4 words each.
    tiles: Vec<u32>,
    /// Token index of each logits row.
    logit_rows: Vec<u32>,
    /// Concatenated tables.
    tables: Vec<u32>,
    /// Sampling rows, 6 words each.
    params: Vec<u32>,
    /// Banned ids of all rows.
    banned: Vec<u32>,
    /// Chunks pushed.
    chunks: usize,
    /// Largest `start_pos + len`.
    max_end: usize,
    /// The assembled buffer.
    staging: Vec<u32>,
    /// Its layout (valid after [`StepBuilder::finish`]).
    layout: StepLayout,
}

impl StepBuilder {
    /// An empty builder for `geometry`.
    pub fn new(geometry: StepGeometry) -> Self {
        StepBuilder {
            geometry,
            tokens: Vec::new(),
            pos: Vec::new(),
            tbl: Vec::new(),
            tiles: Vec::new(),
            logit_rows: Vec::new(),
            tables: Vec::new(),
            params: Vec::new(),
            banned: Vec::new(),
            chunks: 0,
            max_end: 0,
            staging: Vec::new(),
            layout: StepLayout::default(),
        }
    }

    /// The limits in force.
    pub fn geometry(&self) -> StepGeometry {
        self.geometry
    }

    /// Starts a new step (keeps the allocations).
    pub fn begin(&mut self) {
        for v in [
            &mut self.tokens,
            &mut self.pos,
            &mut self.tbl,
            &mut self.tiles,
            &mut self.logit_rows,
            &mut self.tables,
            &mut self.params,
            &mut self.banned,
            &mut self.staging,
        ] {
            v.clear();
        }
        self.chunks = 0;
        self.max_end = 0;
        self.layout = StepLayout::default();
    }

    /// Adds one sequence's chunk after checking every index it implies (the same checks, in
    /// the same order, as the CPU backend). On error the builder must be restarted with
    /// [`StepBuilder::begin`].
    pub fn push_chunk(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        block_table: &[u32],
        want_logits: bool,
    ) -> Result<(), StepError> {
        let g = self.geometry;
        let chunk = self.chunks;
        if tokens.is_empty() {
            return Err(StepError::EmptyChunk { chunk });
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= g.vocab_size) {
            return Err(StepError::TokenOutOfRange {
                chunk,
                token: t,
                vocab_size: g.vocab_size,
            });
        }
        let end = start_pos.saturating_add(tokens.len());
        if end > g.max_seq_len {
            return Err(StepError::ContextOverflow {
                chunk,
                end,
                max_seq_len: g.max_seq_len,
            });
        }
        let needed = end.div_ceil(g.block_size.max(1));
        if block_table.len() < needed {
            return Err(StepError::BlockTableTooShort {
                chunk,
                needed,
                actual: block_table.len(),
            });
        }
        let table = &block_table[..needed];
        if let Some(&b) = table.iter().find(|&&b| b as usize >= g.num_blocks) {
            return Err(StepError::BlockOutOfRange {
                chunk,
                block: b,
                num_blocks: g.num_blocks,
            });
        }
        let first_token = self.tokens.len();
        let n_tokens = first_token + tokens.len();
        if n_tokens > MAX_STEP_TOKENS {
            return Err(StepError::TooLarge {
                what: "tokens in one step",
                value: n_tokens,
                limit: MAX_STEP_TOKENS,
            });
        }
        let table_words = self.tables.len() + needed;
        if table_words > MAX_STAGING_WORDS / 2 {
            return Err(StepError::TooLarge {
                what: "block table words in one step",
                value: table_words,
                limit: MAX_STAGING_WORDS / 2,
            });
        }
        // Every value below fits in u32: positions < max_seq_len ≤ 2^20 (model limit, and
        // `end` was checked), token counts ≤ MAX_STEP_TOKENS, table offsets < 2^30.
        let table_off = self.tables.len() as u32;
        self.tables.extend_from_slice(table);
        self.tokens.extend_from_slice(tokens);
        self.pos.extend((start_pos..end).map(|p| p as u32));
        self.tbl
            .extend(std::iter::repeat_n(table_off, tokens.len()));
        let tile = g.tile_tokens.max(1);
        let mut t = 0;
        while t < tokens.len() {
            let n = tile.min(tokens.len() - t);
            self.tiles.extend_from_slice(&[
                (first_token + t) as u32,
                n as u32,
                (start_pos + t) as u32,
                table_off,
            ]);
            t += n;
        }
        if want_logits {
            self.logit_rows.push((n_tokens - 1) as u32);
        }
        self.max_end = self.max_end.max(end);
        self.chunks += 1;
        Ok(())
    }

    /// Adds the sampling row of the next chunk wanting logits.
    pub fn push_sampling(&mut self, row: SampleRow, banned: &[u32]) -> Result<(), StepError> {
        let vocab = self.geometry.vocab_size;
        if let Some(&token) = banned.iter().find(|&&b| b as usize >= vocab) {
            return Err(StepError::BannedOutOfRange {
                token,
                vocab_size: vocab,
            });
        }
        let total = self.banned.len() + banned.len();
        if total > MAX_STAGING_WORDS / 4 {
            return Err(StepError::TooLarge {
                what: "banned ids in one step",
                value: total,
                limit: MAX_STAGING_WORDS / 4,
            });
        }
        self.params.extend_from_slice(&[
            row.temperature.to_bits(),
            row.top_k,
            row.top_p.to_bits(),
            row.uniform.to_bits(),
            self.banned.len() as u32,
            banned.len() as u32,
        ]);
        self.banned.extend_from_slice(banned);
        Ok(())
    }

    /// Checks the step as a whole and assembles the staging buffer.
    pub fn finish(&mut self) -> Result<&StepLayout, StepError> {
        if self.chunks == 0 {
            return Err(StepError::EmptyBatch);
        }
        let rows = self.params.len() / 6;
        if rows != 0 && rows != self.logit_rows.len() {
            return Err(StepError::SamplingRows {
                expected: self.logit_rows.len(),
                actual: rows,
            });
        }
        let words = self.tokens.len() * 3
            + self.tiles.len()
            + self.logit_rows.len()
            + self.tables.len()
            + self.params.len()
            + self.banned.len()
            + 1;
        if words > MAX_STAGING_WORDS {
            return Err(StepError::TooLarge {
                what: "staging words",
                value: words,
                limit: MAX_STAGING_WORDS,
            });
        }
        self.staging.clear();
        self.staging.reserve(words);
        let push = |s: &mut Vec<u32>, v: &[u32]| {
            let start = s.len();
            s.extend_from_slice(v);
            start..s.len()
        };
        let st = &mut self.staging;
        let tokens = push(st, &self.tokens);
        let pos = push(st, &self.pos);
        let tbl = push(st, &self.tbl);
        let tiles = push(st, &self.tiles);
        let logit_rows = push(st, &self.logit_rows);
        let tables = push(st, &self.tables);
        let params = push(st, &self.params);
        let banned = push(st, &self.banned);
        st.push(0);
        self.layout = StepLayout {
            tokens,
            pos,
            tbl,
            tiles,
            logit_rows,
            tables,
            params,
            banned,
            n_tokens: self.tokens.len(),
            n_logit_rows: self.logit_rows.len(),
            n_sample_rows: rows,
            n_tiles: self.tiles.len() / 4,
            max_end: self.max_end,
            words,
        };
        Ok(&self.layout)
    }

    /// The layout of the last [`StepBuilder::finish`].
    pub fn layout(&self) -> &StepLayout {
        &self.layout
    }

    /// The assembled staging words of the last [`StepBuilder::finish`].
    pub fn staging(&self) -> &[u32] {
        &self.staging
    }
}

/// How one attention launch splits the KV positions (flash-decoding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    /// Splits (`grid.z`); 1 writes the output directly, more go through the combine kernel.
    pub n_splits: usize,
    /// Positions per split, a multiple of [`FA_KT`].
    pub split_len: usize,
}

/// Chooses the KV split of an attention launch with `blocks` = tiles × KV heads blocks per
/// split: enough splits to give every multiprocessor two blocks, but at most [`MAX_SPLITS`],
/// splits of at least [`MIN_SPLIT_LEN`] positions, and no more than the partial buffer holds
/// (`partial_token_splits` = (token, split) pairs it has room for).
pub fn plan_splits(
    blocks: usize,
    max_end: usize,
    n_tokens: usize,
    multiprocessors: usize,
    partial_token_splits: usize,
) -> SplitPlan {
    let target = 2 * multiprocessors.max(1);
    let blocks = blocks.max(1);
    let wanted = if blocks >= target {
        1
    } else {
        target.div_ceil(blocks)
    };
    let n = wanted
        .min(MAX_SPLITS)
        .min(max_end.div_ceil(MIN_SPLIT_LEN))
        .min(partial_token_splits / n_tokens.max(1))
        .max(1);
    let split_len = max_end.max(1).div_ceil(n).next_multiple_of(FA_KT);
    SplitPlan {
        n_splits: max_end.max(1).div_ceil(split_len),
        split_len,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn geometry() -> StepGeometry {
        StepGeometry {
            vocab_size: 100,
            max_seq_len: 64,
            block_size: 4,
            num_blocks: 32,
            tile_tokens: 3,
        }
    }

    #[test]
    fn bf16_conversion_matches_the_half_crate_on_special_and_random_values() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x3f80_8000), // exact tie, even below → stays
            f32::from_bits(0x3f81_8000), // exact tie, odd below → rounds up
            f32::from_bits(0x7f7f_ffff), // rounds to infinity
        ];
        let mut state = 0x1234_5678_9abc_def0u64;
        let randoms = (0..200_000).map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            f32::from_bits((state >> 32) as u32)
        });
        for x in specials.into_iter().chain(randoms) {
            let ours = f32_to_bf16_bits(x);
            let theirs = half::bf16::from_f32(x).to_bits();
            if x.is_nan() {
                assert!(bf16_bits_to_f32(ours).is_nan());
                assert_eq!(ours >> 15, theirs >> 15, "sign of NaN {:#x}", x.to_bits());
            } else {
                assert_eq!(ours, theirs, "x = {x:e} ({:#x})", x.to_bits());
                assert_eq!(bf16_bits_to_f32(ours), half::bf16::from_bits(ours).to_f32());
            }
        }
    }

    #[test]
    fn staging_holds_every_section_at_its_documented_offset() {
        let mut b = StepBuilder::new(geometry());
        b.begin();
        // A 7-token prefill chunk at position 2 and a decode token at position 9.
        b.push_chunk(&[5, 6, 7, 8, 9, 10, 11], 2, &[3, 4, 5, 31], true)
            .unwrap();
        b.push_chunk(&[42], 9, &[7, 8, 9], false).unwrap();
        b.push_chunk(&[1], 0, &[0], true).unwrap();
        b.push_sampling(
            SampleRow {
                temperature: 0.5,
                top_k: 3,
                top_p: 0.9,
                uniform: 0.25,
            },
            &[1, 2],
        )
        .unwrap();
        b.push_sampling(
            SampleRow {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                uniform: 0.0,
            },
            &[],
        )
        .unwrap();
        let l = b.finish().unwrap().clone();
        let s = b.staging();
        assert_eq!(l.n_tokens, 9);
        assert_eq!(&s[l.tokens.clone()], &[5, 6, 7, 8, 9, 10, 11, 42, 1]);
        assert_eq!(&s[l.pos.clone()], &[2, 3, 4, 5, 6, 7, 8, 9, 0]);
        // Tables: chunk 0 needs ceil(9/4)=3 blocks (offset 0), chunk 1 needs 3 (offset 3),
        // chunk 2 needs 1 (offset 6); unused table entries are not copied.
        assert_eq!(&s[l.tables.clone()], &[3, 4, 5, 7, 8, 9, 0]);
        assert_eq!(&s[l.tbl.clone()], &[0, 0, 0, 0, 0, 0, 0, 3, 6]);
        // Tiles of at most 3 tokens.
        assert_eq!(
            &s[l.tiles.clone()],
            &[0, 3, 2, 0, 3, 3, 5, 0, 6, 1, 8, 0, 7, 1, 9, 3, 8, 1, 0, 6]
        );
        assert_eq!(l.n_tiles, 5);
        assert_eq!(&s[l.logit_rows.clone()], &[6, 8]);
        assert_eq!(
            &s[l.params.clone()],
            &[
                0.5f32.to_bits(),
                3,
                0.9f32.to_bits(),
                0.25f32.to_bits(),
                0,
                2,
                0,
                0,
                1.0f32.to_bits(),
                0,
                2,
                0
            ]
        );
        assert_eq!(&s[l.banned.clone()], &[1, 2]);
        assert_eq!(l.max_end, 10);
        assert_eq!(l.words, s.len());
        assert_eq!(l.banned.end + 1, s.len(), "one padding word");
    }

    #[test]
    fn invalid_chunks_are_rejected_with_the_backend_error_fields() {
        let mut b = StepBuilder::new(geometry());
        let cases: [(&[u32], usize, &[u32], StepError); 5] = [
            (&[], 0, &[0], StepError::EmptyChunk { chunk: 0 }),
            (
                &[100],
                0,
                &[0],
                StepError::TokenOutOfRange {
                    chunk: 0,
                    token: 100,
                    vocab_size: 100,
                },
            ),
            (
                &[1, 2],
                63,
                &[0; 16],
                StepError::ContextOverflow {
                    chunk: 0,
                    end: 65,
                    max_seq_len: 64,
                },
            ),
            (
                &[1, 2],
                3,
                &[0],
                StepError::BlockTableTooShort {
                    chunk: 0,
                    needed: 2,
                    actual: 1,
                },
            ),
            (
                &[1],
                4,
                &[0, 32, 99],
                StepError::BlockOutOfRange {
                    chunk: 0,
                    block: 32,
                    num_blocks: 32,
                },
            ),
        ];
        for (tokens, start, table, want) in cases {
            b.begin();
            assert_eq!(b.push_chunk(tokens, start, table, true), Err(want));
        }
        b.begin();
        assert_eq!(b.finish().err(), Some(StepError::EmptyBatch));
        b.begin();
        b.push_chunk(&[1], 0, &[0], true).unwrap();
        assert_eq!(
            b.push_sampling(
                SampleRow {
                    temperature: 0.0,
                    top_k: 0,
                    top_p: 1.0,
                    uniform: 0.0
                },
                &[3, 100]
            ),
            Err(StepError::BannedOutOfRange {
                token: 100,
                vocab_size: 100
            })
        );
        b.begin();
        b.push_chunk(&[1], 0, &[0], false).unwrap();
        b.push_sampling(
            SampleRow {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                uniform: 0.0,
            },
            &[],
        )
        .unwrap();
        assert_eq!(
            b.finish().err(),
            Some(StepError::SamplingRows {
                expected: 0,
                actual: 1
            })
        );
    }

    proptest! {
        /// Whatever valid chunks are pushed, every index a kernel derives from the staging
        /// buffer is in bounds: tokens < vocab, positions < max_seq_len, every position's block
        /// table entry exists and names a pool block, tiles cover each token exactly once.
        #[test]
        fn every_index_derived_from_a_valid_step_is_in_bounds(
            chunks in proptest::collection::vec(
                (1usize..20, 0usize..50, proptest::collection::vec(0u32..32, 16), any::<bool>()),
                1..8,
            ),
            tile_tokens in 1usize..9,
        ) {
            let g = StepGeometry { tile_tokens, ..geometry() };
            let mut b = StepBuilder::new(g);
            b.begin();
            let mut pushed = 0;
            for (len, start, table, want) in &chunks {
                let tokens: Vec<u32> = (0..*len as u32).map(|t| (t * 7) % 100).collect();
                if b.push_chunk(&tokens, *start, table, *want).is_ok() {
                    pushed += 1;
                } else {
                    // A rejected chunk leaves the builder unusable for this step: start over.
                    b.begin();
                    pushed = 0;
                }
            }
            prop_assume!(pushed > 0);
            let l = b.finish().unwrap().clone();
            let s = b.staging();
            let mut covered = vec![0u32; l.n_tokens];
            for tile in s[l.tiles.clone()].chunks_exact(4) {
                let (t0, n, p0, off) = (tile[0] as usize, tile[1] as usize, tile[2], tile[3]);
                prop_assert!(n >= 1 && n <= tile_tokens);
                for i in 0..n {
                    covered[t0 + i] += 1;
                    prop_assert_eq!(s[l.pos.start + t0 + i], p0 + i as u32);
                    prop_assert_eq!(s[l.tbl.start + t0 + i], off);
                }
            }
            prop_assert!(covered.iter().all(|&c| c == 1));
            for t in 0..l.n_tokens {
                prop_assert!((s[l.tokens.start + t] as usize) < g.vocab_size);
                let p = s[l.pos.start + t] as usize;
                prop_assert!(p < g.max_seq_len && p < l.max_end);
                let entry = l.tables.start + s[l.tbl.start + t] as usize + p / g.block_size;
                prop_assert!(entry < l.tables.end);
                prop_assert!((s[entry] as usize) < g.num_blocks);
            }
            for &r in &s[l.logit_rows.clone()] {
                prop_assert!((r as usize) < l.n_tokens);
            }
        }

        /// The split plan never exceeds its limits and always covers every position.
        #[test]
        fn split_plans_cover_all_positions_within_limits(
            blocks in 1usize..2000,
            max_end in 1usize..20_000,
            n_tokens in 1usize..4096,
            sms in 1usize..200,
            cap in 0usize..100_000,
        ) {
            let p = plan_splits(blocks, max_end, n_tokens, sms, cap);
            prop_assert!(p.n_splits >= 1 && p.n_splits <= MAX_SPLITS);
            prop_assert_eq!(p.split_len % FA_KT, 0);
            prop_assert!(p.n_splits * p.split_len >= max_end);
            prop_assert!((p.n_splits - 1) * p.split_len < max_end, "no empty trailing split");
            if p.n_splits > 1 {
                prop_assert!(p.n_splits * n_tokens <= cap);
            }
        }
    }

    #[test]
    fn batch_one_decode_on_a_long_context_is_split_over_the_multiprocessors() {
        // dummy:8b, one decode token at position 4095: 8 KV heads → 8 blocks per split.
        let p = plan_splits(8, 4096, 1, 132, 4096);
        assert_eq!(p.n_splits, 32);
        assert_eq!(p.split_len, 128);
        // A 2k-token prefill already fills the machine: one split.
        let p = plan_splits(256 * 8, 2048, 2048, 132, 4096);
        assert_eq!(p.n_splits, 1);
    }
}
