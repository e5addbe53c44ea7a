//! Output text of one request: releases decoded bytes to the client while holding back what
//! could still become a stop sequence or a forbidden string (and incomplete UTF-8), and finds
//! the first match.

/// What a pushed piece completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TextMatch {
    /// A stop sequence: the text ends before it.
    Stop,
    /// A forbidden string: the text ends before it and the stream ends with `safety`.
    Forbidden,
}

/// Incremental output text with hold-back.
#[derive(Debug, Default)]
pub(crate) struct OutputText {
    /// Decoded bytes not yet released.
    pending: Vec<u8>,
    /// Raw decoded bytes released so far.
    released_bytes: usize,
    /// Everything released, as sent to the client.
    released: String,
    /// Some released bytes were not valid UTF-8 and went out as U+FFFD.
    lossy: bool,
}

impl OutputText {
    /// Appends `piece` and returns the text now safe to release, plus the match it completed,
    /// if any (then the released text ends just before the match, and nothing more is
    /// released). At equal start positions a forbidden string wins over a stop sequence.
    pub(crate) fn push(
        &mut self,
        piece: &[u8],
        stops: &[String],
        forbidden: &[String],
    ) -> (String, Option<TextMatch>) {
        self.pending.extend_from_slice(piece);
        let mut first: Option<(usize, TextMatch)> = None;
        for (patterns, kind) in [(forbidden, TextMatch::Forbidden), (stops, TextMatch::Stop)] {
            for p in patterns {
                if let Some(at) = find(&self.pending, p.as_bytes())
                    && first.is_none_or(|(f, _)| at < f)
                {
                    first = Some((at, kind));
                }
            }
        }
        if let Some((at, kind)) = first {
            let out = self.release(at);
            self.pending.clear();
            return (out, Some(kind));
        }
        let hold = stops
            .iter()
            .chain(forbidden)
            .map(|p| longest_suffix_prefix(&self.pending, p.as_bytes()))
            .max()
            .unwrap_or(0);
        let mut upto = self.pending.len() - hold;
        // Hold an incomplete UTF-8 sequence at the end of what would be released.
        if let Err(e) = std::str::from_utf8(&self.pending[..upto])
            && e.error_len().is_none()
        {
            upto = e.valid_up_to();
        }
        (self.release(upto), None)
    }

    /// Releases everything pending (end of generation without a match).
    pub(crate) fn flush(&mut self) -> String {
        let n = self.pending.len();
        self.release(n)
    }

    /// Releases `pending[..n]` (invalid UTF-8 becomes U+FFFD).
    fn release(&mut self, n: usize) -> String {
        let bytes: Vec<u8> = self.pending.drain(..n).collect();
        self.released_bytes += bytes.len();
        let text = match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => {
                self.lossy = true;
                String::from_utf8_lossy(e.as_bytes()).into_owned()
            }
        };
        self.released.push_str(&text);
        text
    }

    /// Raw decoded bytes released so far.
    pub(crate) fn released_bytes(&self) -> usize {
        self.released_bytes
    }

    /// Everything released so far.
    pub(crate) fn released(&self) -> &str {
        &self.released
    }

    /// Whether the released text is exactly the released decoded bytes (no U+FFFD
    /// substitution), i.e. re-decoding the delivered tokens gives the delivered text.
    pub(crate) fn is_exact(&self) -> bool {
        !self.lossy
    }
}

/// First occurrence of `needle` (non-empty) in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || needle.len() > hay.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Length of the longest suffix of `hay` that is a proper prefix of `pattern`.
fn longest_suffix_prefix(hay: &[u8], pattern: &[u8]) -> usize {
    let max = pattern.len().saturating_sub(1).min(hay.len());
    (1..=max)
        .rev()
        .find(|&k| hay[hay.len() - k..] == pattern[..k])
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn text_that_could_start_a_stop_sequence_is_held_until_resolved() {
        let mut t = OutputText::default();
        let stops = s(&["The end"]);
        assert_eq!(t.push(b"Hello. Th", &stops, &[]), ("Hello. ".into(), None));
        assert_eq!(t.push(b"ere", &stops, &[]), ("There".into(), None));
        assert_eq!(t.push(b" The e", &stops, &[]), (" ".into(), None));
        assert_eq!(
            t.push(b"nd!", &stops, &[]),
            ("".into(), Some(TextMatch::Stop))
        );
        assert_eq!(t.released(), "Hello. There ");
    }

    #[test]
    fn a_match_inside_one_piece_releases_the_text_before_it() {
        let mut t = OutputText::default();
        assert_eq!(
            t.push(b"ab.cd", &s(&["."]), &[]),
            ("ab".into(), Some(TextMatch::Stop))
        );
        assert_eq!(t.released_bytes(), 2);
    }

    #[test]
    fn forbidden_strings_win_over_stop_sequences_at_the_same_position() {
        let mut t = OutputText::default();
        let (out, m) = t.push(b"x dragon", &s(&["drag"]), &s(&["dragon"]));
        // "drag" is held first (a prefix of both), then "dragon" matches at the same start.
        assert_eq!((out.as_str(), m), ("x ", Some(TextMatch::Forbidden)));
    }

    #[test]
    fn incomplete_utf8_is_held_and_invalid_bytes_become_replacement_characters() {
        let mut t = OutputText::default();
        let e_acute = "é".as_bytes();
        assert_eq!(t.push(&e_acute[..1], &[], &[]).0, "");
        assert_eq!(t.push(&e_acute[1..], &[], &[]).0, "é");
        assert!(t.is_exact());
        assert_eq!(t.push(&[0xff, b'a'], &[], &[]).0, "\u{fffd}a");
        assert!(!t.is_exact());
        assert_eq!(t.push(&[0xc3], &[], &[]).0, "");
        assert_eq!(t.flush(), "\u{fffd}");
    }
}
