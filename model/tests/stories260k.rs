//! The real stories260K model: greedy output reproduces the README reference token for token,
//! the backend's logits match a naive llama2.c transcription, and the tokenizer matches
//! llama2.c's O(n²) merge loop and round-trips text.

mod common;

use proptest::prelude::*;
use zerolayer_model::{
    Backend, CpuBackend, FinishReason, GenerateOptions, KvCacheConfig, SamplingParams, SeqChunk,
    Tokenizer, generate,
};

/// The prompt of the README's reference output.
const PROMPT: &str = "Once upon a time";

/// Prints the prompt and continuation as `run.c` does (decoded pieces, unprintable single bytes
/// skipped).
fn greedy_text(
    model: &zerolayer_model::Model,
    prompt: &str,
    max_tokens: usize,
) -> (String, GenerateOutcomeLite) {
    let tok = &model.tokenizer;
    let ids = tok.encode(prompt, true, false);
    let mut backend = CpuBackend::new(
        model.weights.clone(),
        KvCacheConfig {
            block_size: 16,
            num_blocks: 64,
        },
        2,
    )
    .unwrap();
    let mut out = Vec::new();
    for pair in ids.windows(2) {
        out.extend_from_slice(tok.decode_piece(pair[0], pair[1]));
    }
    let options = GenerateOptions {
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_sequences: vec![],
    };
    let outcome = generate(&mut backend, tok, &ids, &options, &mut |_, piece| {
        out.extend_from_slice(piece)
    })
    .unwrap();
    (
        String::from_utf8(out).unwrap(),
        GenerateOutcomeLite {
            tokens: outcome.tokens,
            finish: outcome.finish,
        },
    )
}

/// The parts of `GenerateOutcome` the tests compare (timings differ between runs).
#[derive(Debug, PartialEq)]
struct GenerateOutcomeLite {
    tokens: Vec<u32>,
    finish: FinishReason,
}

#[test]
fn greedy_generation_reproduces_the_readme_reference() {
    let Some(model) = common::stories260k("greedy_generation_reproduces_the_readme_reference")
    else {
        return;
    };
    let reference = common::stories260k_reference();
    let (text, outcome) = greedy_text(&model, PROMPT, 256);
    assert!(
        text.starts_with(&reference),
        "output:\n{text}\n--- expected prefix:\n{reference}"
    );
    assert_eq!(outcome.tokens.len(), 256);
    assert_eq!(outcome.finish, FinishReason::Length);
}

#[test]
fn prompt_encodes_to_the_reference_token_ids() {
    let Some(model) = common::stories260k("prompt_encodes_to_the_reference_token_ids") else {
        return;
    };
    // BOS, " Once", " upon", " a", " time" in tok512 (ids checked against llama2.c's encode).
    let ids = model.tokenizer.encode(PROMPT, true, false);
    assert_eq!(ids, vec![1, 403, 407, 261, 378]);
}

#[test]
fn backend_logits_match_a_naive_llama2c_forward() {
    let Some(model) = common::stories260k("backend_logits_match_a_naive_llama2c_forward") else {
        return;
    };
    let tokens = model.tokenizer.encode(
        "Lily and Tom found a big red ball in the garden.",
        true,
        false,
    );
    let want = common::reference_logits(&model.weights, &tokens);
    let mut backend = CpuBackend::new(
        model.weights.clone(),
        KvCacheConfig {
            block_size: 4,
            num_blocks: 32,
        },
        2,
    )
    .unwrap();
    let vocab = model.weights.config().vocab_size;
    let table: Vec<u32> = (0..32).rev().collect(); // non-contiguous, reversed blocks
    let mut logits = vec![0.0; vocab];
    for (pos, &t) in tokens.iter().enumerate() {
        let chunk = SeqChunk {
            tokens: &[t],
            start_pos: pos,
            block_table: &table,
            want_logits: true,
        };
        backend.forward(&[chunk], &mut logits).unwrap();
        let max_err = logits
            .iter()
            .zip(&want[pos])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(max_err < 1e-4, "position {pos}: max logit error {max_err}");
    }
}

/// llama2.c's tokenizer, transcribed (O(n²) merge loop) as the oracle.
struct Oracle {
    pieces: Vec<Vec<u8>>,
    scores: Vec<f32>,
}

impl Oracle {
    fn load() -> Option<Oracle> {
        let bytes = std::fs::read(common::models_dir().join("stories260K/tok512.bin")).ok()?;
        let mut pos = 4;
        let (mut pieces, mut scores) = (Vec::new(), Vec::new());
        let word = |p: usize| [bytes[p], bytes[p + 1], bytes[p + 2], bytes[p + 3]];
        for _ in 0..512 {
            scores.push(f32::from_le_bytes(word(pos)));
            let len = i32::from_le_bytes(word(pos + 4)) as usize;
            pieces.push(bytes[pos + 8..pos + 8 + len].to_vec());
            pos += 8 + len;
        }
        Some(Oracle { pieces, scores })
    }

    fn lookup(&self, s: &[u8]) -> Option<u32> {
        self.pieces.iter().position(|p| p == s).map(|i| i as u32)
    }

    fn encode(&self, text: &str, bos: bool) -> Vec<u32> {
        self.encode_with(text, bos, true)
    }

    fn encode_with(&self, text: &str, bos: bool, dummy_prefix: bool) -> Vec<u32> {
        let mut t = Vec::new();
        if bos {
            t.push(1);
        }
        if dummy_prefix && !text.is_empty() {
            t.push(self.lookup(b" ").unwrap());
        }
        for ch in text.chars() {
            let mut buf = [0u8; 4];
            let s = ch.encode_utf8(&mut buf).as_bytes();
            match self.lookup(s) {
                Some(id) => t.push(id),
                None => t.extend(s.iter().map(|&b| b as u32 + 3)),
            }
        }
        loop {
            let (mut best, mut best_id, mut best_idx) = (-1e10f32, 0, None);
            for i in 0..t.len().saturating_sub(1) {
                let merged = [
                    &self.pieces[t[i] as usize][..],
                    &self.pieces[t[i + 1] as usize][..],
                ]
                .concat();
                if let Some(id) = self.lookup(&merged)
                    && self.scores[id as usize] > best
                {
                    (best, best_id, best_idx) = (self.scores[id as usize], id, Some(i));
                }
            }
            let Some(i) = best_idx else { break };
            t[i] = best_id;
            t.remove(i + 1);
        }
        t
    }
}

fn stories_tokenizer() -> Option<(Tokenizer, Oracle)> {
    let model = common::stories260k("tokenizer tests")?;
    Some(((*model.tokenizer).clone(), Oracle::load()?))
}

#[test]
fn tokenizer_round_trips_ascii_unicode_and_byte_fallback_text() {
    let Some((tok, oracle)) = stories_tokenizer() else {
        return;
    };
    for text in [
        "Once upon a time, there was a little girl named Lily.",
        "  leading spaces and trailing  ",
        "Ünïcödé — 日本語 テキスト 🎉 emoji",
        "control\tbytes\n\r\u{1}\u{7f} and \u{0} NUL",
        "",
    ] {
        let ids = tok.encode(text, true, false);
        assert_eq!(ids, oracle.encode(text, true), "encoding of {text:?}");
        assert_eq!(tok.decode(&ids), text.as_bytes(), "round trip of {text:?}");
    }
    // Byte fallback really happens for characters outside the 512-token vocabulary.
    let ids = tok.encode("日", false, false);
    assert!(ids.iter().any(|&i| (3..259).contains(&i)), "{ids:?}");
}

#[test]
fn chat_rendering_only_grows_at_the_end() {
    let Some((tok, _)) = stories_tokenizer() else {
        return;
    };
    let a = tok.render_messages(&[("system", "Be kind."), ("user", "Hello there")]);
    let b = tok.render_messages(&[
        ("system", "Be kind."),
        ("user", "Hello there"),
        ("assistant", "Hi! How are you?"),
    ]);
    assert_eq!(a[0], 1);
    assert!(b.starts_with(&a));
    assert_eq!(&b[a.len()..], &tok.encode_message("Hi! How are you?")[..]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn tokenizer_matches_llama2c_and_round_trips_arbitrary_text(text in "(\\PC|[ \\n\\t]){0,40}") {
        let Some((tok, oracle)) = stories_tokenizer() else { return Ok(()) };
        let ids = tok.encode(&text, true, false);
        prop_assert_eq!(&ids, &oracle.encode(&text, true));
        prop_assert_eq!(tok.decode(&ids), text.as_bytes().to_vec());
    }

    #[test]
    fn continuation_encoding_merges_without_a_dummy_prefix_and_round_trips(text in "(\\PC|[ \\n]){0,30}") {
        let Some((tok, oracle)) = stories_tokenizer() else { return Ok(()) };
        let ids = tok.encode_continuation(&text);
        prop_assert_eq!(&ids, &oracle.encode_with(&text, false, false));
        prop_assert_eq!(tok.decode(&ids), text.as_bytes().to_vec());
    }

    #[test]
    fn tokenizer_matches_llama2c_on_story_like_text(words in prop::collection::vec("[a-zA-Z]{1,8}[,.!?]?", 1..30)) {
        let Some((tok, oracle)) = stories_tokenizer() else { return Ok(()) };
        let text = words.join(" ");
        prop_assert_eq!(tok.encode(&text, true, false), oracle.encode(&text, true));
    }
}
