//! The in-decode safety mask (design §4): per tenant, forbidden strings compiled at start into
//! token sequences.
//!
//! Three layers, from cheapest to strictest:
//! 1. **Prompt check**: a request whose messages contain a forbidden string is refused with
//!    `SAFETY_VIOLATION` before any work. (Choice: refusing is simpler to reason about than
//!    generating around a prompt that already says it, and it stops a client from echoing the
//!    string back through an assistant message it wrote itself.)
//! 2. **Token mask**: each string is tokenised twice — as a message ([`Tokenizer::encode_message`],
//!    with the dummy-prefix space, the form a word takes after a space) and as a continuation
//!    ([`Tokenizer::encode_continuation`], no prefix, the form inside a word). At every step, a
//!    token that would complete one of those sequences given the last prompt/generated tokens is
//!    banned from sampling. When every token is banned the stream ends with reason `safety`.
//! 3. **Text check**: the model can spell a string with other tokens; the decoded output is
//!    searched for every forbidden string (text that could still become one is held back), and a
//!    match ends the stream with `safety` without delivering the offending text.

use zerolayer_model::Tokenizer;

use crate::config::{MAX_FORBIDDEN_BYTES, MAX_FORBIDDEN_STRINGS};
use crate::error::EngineError;

/// One tenant's compiled forbidden strings.
#[derive(Debug, Clone, Default)]
pub(crate) struct TenantSafety {
    /// The strings (text check and prompt check).
    strings: Vec<String>,
    /// Token sequences whose last token is banned after the others (deduplicated).
    sequences: Vec<Vec<u32>>,
    /// Longest sequence, in tokens.
    max_len: usize,
}

impl TenantSafety {
    /// Compiles `strings` with `tokenizer`.
    pub(crate) fn compile(
        tenant: &str,
        strings: &[String],
        tokenizer: &Tokenizer,
    ) -> Result<Self, EngineError> {
        if strings.len() > MAX_FORBIDDEN_STRINGS {
            return Err(EngineError::config(format!(
                "tenant {tenant:?} has {} forbidden strings, above the limit of {MAX_FORBIDDEN_STRINGS}",
                strings.len()
            )));
        }
        let mut sequences: Vec<Vec<u32>> = Vec::with_capacity(strings.len() * 2);
        for s in strings {
            if s.is_empty() || s.len() > MAX_FORBIDDEN_BYTES {
                return Err(EngineError::config(format!(
                    "tenant {tenant:?}: forbidden strings must be 1..={MAX_FORBIDDEN_BYTES} bytes (got {})",
                    s.len()
                )));
            }
            for seq in [
                tokenizer.encode_message(s),
                tokenizer.encode_continuation(s),
            ] {
                if !seq.is_empty() && !sequences.contains(&seq) {
                    sequences.push(seq);
                }
            }
        }
        let max_len = sequences.iter().map(Vec::len).max().unwrap_or(0);
        Ok(Self {
            strings: strings.to_vec(),
            sequences,
            max_len,
        })
    }

    /// The forbidden strings.
    pub(crate) fn strings(&self) -> &[String] {
        &self.strings
    }

    /// Index of the first text containing a forbidden string.
    pub(crate) fn first_violation<'a>(
        &self,
        texts: impl Iterator<Item = &'a str>,
    ) -> Option<usize> {
        let mut texts = texts;
        texts.position(|t| self.strings.iter().any(|s| t.contains(s.as_str())))
    }

    /// Writes into `banned` every token that would complete a forbidden sequence after the
    /// context `prompt ++ generated`.
    pub(crate) fn banned(&self, prompt: &[u32], generated: &[u32], banned: &mut Vec<u32>) {
        banned.clear();
        if self.sequences.is_empty() {
            return;
        }
        // The context's tail, newest last: at most max_len - 1 tokens matter.
        let need = self.max_len.saturating_sub(1);
        let from_gen = generated.len().min(need);
        let from_prompt = (need - from_gen).min(prompt.len());
        let tail = |k: usize| -> Option<u32> {
            // k-th token from the end (1 = newest).
            if k <= from_gen {
                Some(generated[generated.len() - k])
            } else if k <= from_gen + from_prompt {
                Some(prompt[prompt.len() - (k - from_gen)])
            } else {
                None
            }
        };
        for seq in &self.sequences {
            // Invariant: `compile` keeps only non-empty sequences.
            let (last, before) = seq.split_last().expect("sequences are non-empty");
            let matches = before
                .iter()
                .rev()
                .enumerate()
                .all(|(i, &t)| tail(i + 1) == Some(t));
            if matches && !banned.contains(last) {
                banned.push(*last);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Tokenizer {
        Tokenizer::byte_level(512).unwrap()
    }

    #[test]
    fn both_tokenisations_are_compiled_and_banned_after_their_prefix() {
        let t = tok();
        let s = TenantSafety::compile("acme", &["ab".to_string()], &t).unwrap();
        // Byte-level ids: ' ' = 35, 'a' = 100, 'b' = 101.
        assert_eq!(s.sequences, vec![vec![35, 100, 101], vec![100, 101]]);
        let mut banned = Vec::new();
        s.banned(&[1, 35], &[100], &mut banned);
        assert_eq!(banned, vec![101]);
        s.banned(&[1, 100], &[], &mut banned);
        assert_eq!(
            banned,
            vec![101],
            "the continuation form, matched across the prompt"
        );
        s.banned(&[1], &[102], &mut banned);
        assert!(banned.is_empty());
    }

    #[test]
    fn single_token_sequences_are_always_banned() {
        let t = tok();
        let s = TenantSafety::compile("acme", &["a".to_string()], &t).unwrap();
        let mut banned = Vec::new();
        s.banned(&[], &[], &mut banned);
        assert_eq!(banned, vec![100]);
    }

    #[test]
    fn empty_or_oversized_strings_are_configuration_errors() {
        let t = tok();
        assert!(TenantSafety::compile("acme", &[String::new()], &t).is_err());
        assert!(TenantSafety::compile("acme", &["x".repeat(MAX_FORBIDDEN_BYTES + 1)], &t).is_err());
    }

    #[test]
    fn prompt_violations_report_the_first_offending_text() {
        let t = tok();
        let s = TenantSafety::compile("acme", &["secret".to_string()], &t).unwrap();
        assert_eq!(
            s.first_violation(["hello", "a secret!", "secret"].into_iter()),
            Some(1)
        );
        assert_eq!(s.first_violation(["hello"].into_iter()), None);
    }
}
