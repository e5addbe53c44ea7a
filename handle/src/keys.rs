//! Signing and verifying keys, their text formats, and the key ring that issues and verifies.
//!
//! Key file formats (also in `docs/handle.md`):
//! - signing key file: exactly one line `zerolayer-signing-key-v1 <key id> <64 hex seed>`;
//! - verifying key file: any number of lines `zerolayer-verifying-key-v1 <key id> <64 hex
//!   public key>`.
//!
//! In both, fields are separated by ASCII whitespace, the key id is a decimal number
//! `0..=65535`, hex is case-insensitive (written lowercase), and blank lines and lines whose
//! first non-blank character is `#` are ignored. Errors name the 1-based line and never echo
//! the line's content (it may hold a secret).

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use ed25519_dalek::Signer;
use zeroize::Zeroizing;

use crate::format::{Claims, Handle};
use crate::layout::{self, signing_input};
use crate::verify::Verified;

/// First field of a signing key line; the `v1` names this text format, not the handle format.
pub const SIGNING_KEY_TAG: &str = "zerolayer-signing-key-v1";

/// First field of a verifying key line.
pub const VERIFYING_KEY_TAG: &str = "zerolayer-verifying-key-v1";

/// Largest key file [`KeyRing::from_files`] reads, in bytes. A verifying key line is at most
/// 97 bytes, so 1 MiB holds over 10,000 keys where deployments rotate through a handful; the
/// limit keeps a wrong path (a log file, a device) from being read into memory whole.
pub const MAX_KEY_FILE_BYTES: u64 = 1 << 20;

/// The operating system's random number generator failed (key or session id generation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the operating system's random number generator failed: {0}")]
pub struct EntropyError(pub(crate) getrandom::Error);

/// A malformed key text. Line numbers are 1-based; no variant carries the line's content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyParseError {
    /// The text is larger than [`MAX_KEY_FILE_BYTES`].
    #[error("key file is {len} bytes; the limit is {MAX_KEY_FILE_BYTES}")]
    TooLarge {
        /// Bytes read (at least the limit plus one).
        len: u64,
    },
    /// The text is not UTF-8.
    #[error("key file is not UTF-8 text")]
    NotUtf8,
    /// The text holds no key line (only blanks and comments).
    #[error("no key line found")]
    NoKey,
    /// A line does not start with the expected tag (for example a verifying key line in the
    /// signing key file).
    #[error("line {line}: expected the tag `{expected}` as the first field")]
    WrongTag {
        /// 1-based line number.
        line: usize,
        /// The tag this file type requires.
        expected: &'static str,
    },
    /// A key line does not have exactly three fields.
    #[error("line {line}: expected 3 fields (tag, key id, hex key), found {found}")]
    FieldCount {
        /// 1-based line number.
        line: usize,
        /// Number of whitespace-separated fields found.
        found: usize,
    },
    /// The key id is not a decimal number in `0..=65535`.
    #[error("line {line}: the key id must be a decimal number from 0 to 65535")]
    BadKeyId {
        /// 1-based line number.
        line: usize,
    },
    /// The key is not exactly 64 hex characters.
    #[error("line {line}: the key must be exactly 64 hex characters")]
    BadKeyHex {
        /// 1-based line number.
        line: usize,
    },
    /// The public key is not a valid Ed25519 point, or is a weak (small-order) one that
    /// `verify_strict` would reject anyway.
    #[error("line {line}: not a usable Ed25519 public key (invalid or small-order point)")]
    BadPublicKey {
        /// 1-based line number.
        line: usize,
    },
    /// A signing key file holds more than one key line.
    #[error(
        "line {line}: a signing key file holds exactly one key (the first is on line {first_line})"
    )]
    ExtraKey {
        /// 1-based line number of the second key line.
        line: usize,
        /// 1-based line number of the first key line.
        first_line: usize,
    },
    /// A verifying key file binds one key id to two different keys.
    #[error("line {line}: key id {id} is already bound to a different key on line {first_line}")]
    ConflictingKeyId {
        /// 1-based line number of the second binding.
        line: usize,
        /// 1-based line number of the first binding.
        first_line: usize,
        /// The key id bound twice.
        id: u16,
    },
}

/// A key id bound to two different verifying keys (possibly the active signing key's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("key id {id} is already bound to a different verifying key")]
pub struct KeyIdConflict {
    /// The key id bound twice.
    pub id: u16,
}

/// Failure to build a [`KeyRing`] from key files.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// The file could not be read.
    #[error("cannot read key file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file's contents are malformed.
    #[error("key file {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the line number.
        source: KeyParseError,
    },
    /// The file binds a key id that an earlier file (or the signing key) bound to another key.
    #[error("key file {path}: {source}")]
    Conflict {
        /// The file with the second binding.
        path: PathBuf,
        /// The conflicting key id.
        source: KeyIdConflict,
    },
}

/// An Ed25519 signing key with its key id. The secret is zeroized on drop (by
/// `ed25519_dalek::SigningKey`), and `Debug` prints only the id and the public key.
pub struct SigningKey {
    /// The id written into every handle this key signs; selects the verifying key.
    id: u16,
    /// The secret key.
    key: ed25519_dalek::SigningKey,
}

impl SigningKey {
    /// A fresh key from the operating system's random number generator.
    pub fn generate(id: u16) -> Result<Self, EntropyError> {
        let mut seed = Zeroizing::new([0u8; 32]);
        getrandom::fill(seed.as_mut()).map_err(EntropyError)?;
        Ok(Self::from_seed(id, &seed))
    }

    /// The key with the given 32-byte Ed25519 seed (RFC 8032 secret key).
    pub fn from_seed(id: u16, seed: &[u8; 32]) -> Self {
        Self {
            id,
            key: ed25519_dalek::SigningKey::from_bytes(seed),
        }
    }

    /// The key id.
    pub fn id(&self) -> u16 {
        self.id
    }

    /// The matching verifying key, with the same id.
    pub fn verifying_key(&self) -> VerifyingKey {
        VerifyingKey {
            id: self.id,
            key: self.key.verifying_key(),
        }
    }

    /// The signing key file text: one line `zerolayer-signing-key-v1 <id> <hex seed>` and a
    /// newline. Zeroized on drop.
    pub fn to_text(&self) -> Zeroizing<String> {
        let seed = Zeroizing::new(self.key.to_bytes());
        let hex = Zeroizing::new(hex::encode(seed.as_ref()));
        Zeroizing::new(format!("{SIGNING_KEY_TAG} {} {}\n", self.id, hex.as_str()))
    }

    /// Parses signing key file text: exactly one key line, plus blank and `#` comment lines.
    pub fn from_text(text: &str) -> Result<Self, KeyParseError> {
        let mut found: Option<(usize, Self)> = None;
        for key_line in key_lines(text, SIGNING_KEY_TAG) {
            let (line, id, key_hex) = key_line?;
            if let Some((first_line, _)) = &found {
                return Err(KeyParseError::ExtraKey {
                    line,
                    first_line: *first_line,
                });
            }
            let seed = decode_key_hex(key_hex, line)?;
            found = Some((line, Self::from_seed(id, &seed)));
        }
        found.map(|(_, key)| key).ok_or(KeyParseError::NoKey)
    }
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SigningKey")
            .field("id", &self.id)
            .field("public", &hex::encode(self.key.verifying_key().as_bytes()))
            .finish_non_exhaustive()
    }
}

/// An Ed25519 verifying (public) key with its key id.
#[derive(Clone, PartialEq, Eq)]
pub struct VerifyingKey {
    /// The key id handles signed by the matching signing key carry.
    id: u16,
    /// The public key.
    key: ed25519_dalek::VerifyingKey,
}

impl VerifyingKey {
    /// A verifying key from its 32-byte compressed Edwards form. Fails for invalid points and
    /// for weak (small-order) keys.
    pub fn from_bytes(id: u16, bytes: &[u8; 32]) -> Option<Self> {
        let key = ed25519_dalek::VerifyingKey::from_bytes(bytes).ok()?;
        (!key.is_weak()).then_some(Self { id, key })
    }

    /// The key id.
    pub fn id(&self) -> u16 {
        self.id
    }

    /// The 32-byte public key.
    pub fn to_bytes(&self) -> [u8; 32] {
        self.key.to_bytes()
    }

    /// The verifying key file line for this key, without a newline.
    pub fn to_line(&self) -> String {
        format!(
            "{VERIFYING_KEY_TAG} {} {}",
            self.id,
            hex::encode(self.key.as_bytes())
        )
    }

    /// Parses verifying key file text: any number of key lines (none is allowed: a file may be
    /// emptied of old keys), plus blank and `#` comment lines. A key id listed twice with the
    /// same key is kept once; with different keys it is an error.
    pub fn parse_list(text: &str) -> Result<Vec<Self>, KeyParseError> {
        let mut keys: Vec<(usize, Self)> = Vec::new();
        for key_line in key_lines(text, VERIFYING_KEY_TAG) {
            let (line, id, key_hex) = key_line?;
            let bytes = decode_key_hex(key_hex, line)?;
            let key = Self::from_bytes(id, &bytes).ok_or(KeyParseError::BadPublicKey { line })?;
            match keys.iter().find(|(_, k)| k.id == id) {
                Some((_, k)) if *k == key => {}
                Some((first_line, _)) => {
                    return Err(KeyParseError::ConflictingKeyId {
                        line,
                        first_line: *first_line,
                        id,
                    });
                }
                None => keys.push((line, key)),
            }
        }
        Ok(keys.into_iter().map(|(_, k)| k).collect())
    }
}

impl fmt::Debug for VerifyingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerifyingKey")
            .field("id", &self.id)
            .field("public", &hex::encode(self.key.as_bytes()))
            .finish()
    }
}

/// The key lines of `text` that must start with `tag`, as (1-based line number, key id, key
/// hex); blank and comment lines are skipped.
fn key_lines<'a>(
    text: &'a str,
    tag: &'static str,
) -> impl Iterator<Item = Result<(usize, u16, &'a str), KeyParseError>> {
    text.lines().enumerate().filter_map(move |(index, raw)| {
        let line = index + 1;
        let trimmed = raw.trim_ascii();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            return None;
        }
        let fields: Vec<&str> = trimmed.split_ascii_whitespace().collect();
        Some(match fields[..] {
            [first, ..] if first != tag => Err(KeyParseError::WrongTag {
                line,
                expected: tag,
            }),
            [_, id, key_hex] => parse_key_id(id, line).map(|id| (line, id, key_hex)),
            _ => Err(KeyParseError::FieldCount {
                line,
                found: fields.len(),
            }),
        })
    })
}

/// A decimal key id: ASCII digits only (no sign, no spaces), value `0..=65535`.
fn parse_key_id(field: &str, line: usize) -> Result<u16, KeyParseError> {
    if field.is_empty() || !field.bytes().all(|b| b.is_ascii_digit()) {
        return Err(KeyParseError::BadKeyId { line });
    }
    field.parse().map_err(|_| KeyParseError::BadKeyId { line })
}

/// 64 hex characters → 32 bytes, zeroized on drop (it may be a secret seed).
fn decode_key_hex(field: &str, line: usize) -> Result<Zeroizing<[u8; 32]>, KeyParseError> {
    let mut out = Zeroizing::new([0u8; 32]);
    hex::decode_to_slice(field, out.as_mut()).map_err(|_| KeyParseError::BadKeyHex { line })?;
    Ok(out)
}

/// Reads a key file of at most [`MAX_KEY_FILE_BYTES`] bytes. The buffer is zeroized on drop.
fn read_key_file(path: &Path) -> Result<Zeroizing<Vec<u8>>, KeyFileError> {
    let io_err = |source| KeyFileError::Io {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io_err)?;
    let hint = file
        .metadata()
        .map(|m| m.len())
        .unwrap_or(0)
        .min(MAX_KEY_FILE_BYTES)
        + 1;
    // Reserve up front so the secret is not left behind in a reallocated-away buffer.
    let mut buf = Zeroizing::new(Vec::with_capacity(usize::try_from(hint).unwrap_or(0)));
    file.take(MAX_KEY_FILE_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(io_err)?;
    if buf.len() as u64 > MAX_KEY_FILE_BYTES {
        let source = KeyParseError::TooLarge {
            len: buf.len() as u64,
        };
        return Err(KeyFileError::Parse {
            path: path.to_owned(),
            source,
        });
    }
    Ok(buf)
}

/// Reads and parses one key file with `parse`.
fn parse_key_file<T>(
    path: &Path,
    parse: impl FnOnce(&str) -> Result<T, KeyParseError>,
) -> Result<T, KeyFileError> {
    let buf = read_key_file(path)?;
    let parse_err = |source| KeyFileError::Parse {
        path: path.to_owned(),
        source,
    };
    let text = std::str::from_utf8(&buf).map_err(|_| parse_err(KeyParseError::NotUtf8))?;
    parse(text).map_err(parse_err)
}

/// The keys of one engine: exactly one active signing key, which signs every new handle, and
/// the verifying keys of every key id still accepted (the active key's included). Rotation:
/// make a new key active and keep the old public keys here; handles signed by the old key
/// keep verifying until they expire, renewed handles move to the new key.
pub struct KeyRing {
    /// Signs new and renewed handles.
    active: SigningKey,
    /// Verifying keys by key id; always holds the active key's.
    verifying: BTreeMap<u16, ed25519_dalek::VerifyingKey>,
}

impl KeyRing {
    /// A ring with `active` as the signing key and only its verifying key.
    pub fn new(active: SigningKey) -> Self {
        let verifying = BTreeMap::from([(active.id, active.key.verifying_key())]);
        Self { active, verifying }
    }

    /// A ring with a fresh random key (id 0): for tests and dev mode, where handles need not
    /// survive a restart.
    pub fn ephemeral() -> Result<Self, EntropyError> {
        Ok(Self::new(SigningKey::generate(0)?))
    }

    /// Accepts handles signed by `key` too. Adding a key that is already present is a no-op;
    /// binding a present key id to a different key is an error.
    pub fn add_verifying_key(&mut self, key: VerifyingKey) -> Result<(), KeyIdConflict> {
        match self.verifying.get(&key.id) {
            Some(existing) if *existing == key.key => Ok(()),
            Some(_) => Err(KeyIdConflict { id: key.id }),
            None => {
                self.verifying.insert(key.id, key.key);
                Ok(())
            }
        }
    }

    /// Loads the signing key file `signing` and every verifying key file in `verifying` (the
    /// active key's public key need not be listed).
    pub fn from_files(signing: &Path, verifying: &[PathBuf]) -> Result<Self, KeyFileError> {
        let active = parse_key_file(signing, SigningKey::from_text)?;
        let mut ring = Self::new(active);
        for path in verifying {
            for key in parse_key_file(path, VerifyingKey::parse_list)? {
                ring.add_verifying_key(key)
                    .map_err(|source| KeyFileError::Conflict {
                        path: path.clone(),
                        source,
                    })?;
            }
        }
        Ok(ring)
    }

    /// The id of the key that signs new handles.
    pub fn active_key_id(&self) -> u16 {
        self.active.id
    }

    /// The ids of every key whose handles this ring accepts, ascending.
    pub fn verifying_key_ids(&self) -> impl Iterator<Item = u16> + '_ {
        self.verifying.keys().copied()
    }

    /// The verifying key for `id`, if accepted.
    pub(crate) fn verifying_key(&self, id: u16) -> Option<&ed25519_dalek::VerifyingKey> {
        self.verifying.get(&id)
    }

    /// Signs a new handle for `claims` with the active key.
    pub fn issue(&self, claims: Claims) -> Handle {
        let mut bytes = Handle::unsigned(self.active.id, &claims);
        let signature = self.active.key.sign(&signing_input(&bytes));
        layout::write(&mut bytes, layout::SIGNATURE, &signature.to_bytes());
        Handle(bytes)
    }

    /// The next handle of a verified conversation: same session id, tenant and prompt hash,
    /// new KV offset, epoch and expiry, signed with the active key (so renewal moves handles
    /// to a rotated-in key).
    pub fn renew(
        &self,
        verified: &Verified,
        kv_offset: u32,
        epoch: u32,
        expires_at: u64,
    ) -> Handle {
        let old = verified.claims();
        self.issue(Claims {
            kv_offset,
            epoch,
            expires_at,
            ..*old
        })
    }
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyRing")
            .field("active", &self.active)
            .field(
                "verifying_key_ids",
                &self.verifying.keys().collect::<Vec<_>>(),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: [u8; 32] = [7; 32];

    #[test]
    fn signing_key_text_round_trips() {
        let key = SigningKey::from_seed(513, &SEED);
        let text = key.to_text();
        assert_eq!(
            text.as_str(),
            format!("{SIGNING_KEY_TAG} 513 {}\n", "07".repeat(32))
        );
        let back = SigningKey::from_text(&text).expect("own output parses");
        assert_eq!(back.id(), 513);
        assert_eq!(back.verifying_key(), key.verifying_key());
    }

    #[test]
    fn signing_key_text_allows_comments_blank_lines_and_crlf() {
        let text = format!(
            "# comment\r\n\r\n  {SIGNING_KEY_TAG}\t9  {}\r\n",
            "AB".repeat(32)
        );
        let key = SigningKey::from_text(&text).expect("valid");
        assert_eq!(key.id(), 9);
        assert_eq!(key.key.to_bytes(), [0xab; 32]);
    }

    #[test]
    fn signing_key_text_with_two_keys_is_rejected_with_both_lines() {
        let line = format!("{SIGNING_KEY_TAG} 1 {}\n", "00".repeat(32));
        let text = format!("{line}#\n{line}");
        assert_eq!(
            SigningKey::from_text(&text).unwrap_err(),
            KeyParseError::ExtraKey {
                line: 3,
                first_line: 1
            }
        );
    }

    #[test]
    fn signing_key_text_errors_name_the_line() {
        let hex = "00".repeat(32);
        let cases = [
            (String::new(), KeyParseError::NoKey),
            ("# only a comment\n".to_owned(), KeyParseError::NoKey),
            (
                format!("\n{VERIFYING_KEY_TAG} 1 {hex}"),
                KeyParseError::WrongTag {
                    line: 2,
                    expected: SIGNING_KEY_TAG,
                },
            ),
            (
                format!("{SIGNING_KEY_TAG} 1"),
                KeyParseError::FieldCount { line: 1, found: 2 },
            ),
            (
                format!("{SIGNING_KEY_TAG} 1 {hex} x"),
                KeyParseError::FieldCount { line: 1, found: 4 },
            ),
            (
                format!("{SIGNING_KEY_TAG} 65536 {hex}"),
                KeyParseError::BadKeyId { line: 1 },
            ),
            (
                format!("{SIGNING_KEY_TAG} +1 {hex}"),
                KeyParseError::BadKeyId { line: 1 },
            ),
            (
                format!("{SIGNING_KEY_TAG} -1 {hex}"),
                KeyParseError::BadKeyId { line: 1 },
            ),
            (
                format!("{SIGNING_KEY_TAG} 1 {}", "0".repeat(63)),
                KeyParseError::BadKeyHex { line: 1 },
            ),
            (
                format!("{SIGNING_KEY_TAG} 1 {}zz", "0".repeat(62)),
                KeyParseError::BadKeyHex { line: 1 },
            ),
        ];
        for (text, want) in cases {
            assert_eq!(
                SigningKey::from_text(&text).unwrap_err(),
                want,
                "input {text:?}"
            );
        }
    }

    #[test]
    fn parse_errors_never_echo_the_secret() {
        let secret = "5a".repeat(32);
        let text = format!("{SIGNING_KEY_TAG} 99999 {secret}");
        let err = SigningKey::from_text(&text).unwrap_err();
        assert!(!err.to_string().contains(&secret));
    }

    #[test]
    fn signing_key_debug_hides_the_seed() {
        let key = SigningKey::from_seed(1, &SEED);
        let text = format!("{key:?}");
        assert!(!text.contains(&"07".repeat(32)), "{text}");
        assert!(text.contains(&hex::encode(key.verifying_key().to_bytes())));
    }

    #[test]
    fn verifying_key_list_round_trips_and_dedupes_identical_lines() {
        let a = SigningKey::from_seed(1, &SEED).verifying_key();
        let b = SigningKey::from_seed(2, &[9; 32]).verifying_key();
        let text = format!(
            "# keys\n{}\n\n{}\n{}\n",
            a.to_line(),
            b.to_line(),
            a.to_line()
        );
        assert_eq!(VerifyingKey::parse_list(&text).expect("valid"), vec![a, b]);
        assert_eq!(VerifyingKey::parse_list("# none\n").expect("valid"), vec![]);
    }

    #[test]
    fn verifying_key_list_rejects_one_id_bound_to_two_keys() {
        let a = SigningKey::from_seed(4, &SEED).verifying_key();
        let b = SigningKey::from_seed(4, &[9; 32]).verifying_key();
        let text = format!("{}\n{}\n", a.to_line(), b.to_line());
        assert_eq!(
            VerifyingKey::parse_list(&text).unwrap_err(),
            KeyParseError::ConflictingKeyId {
                line: 2,
                first_line: 1,
                id: 4
            }
        );
    }

    #[test]
    fn verifying_key_list_rejects_small_order_and_invalid_points() {
        // The identity point (y = 1) has small order; its encoding is 0x01 then zeros.
        let mut identity = [0u8; 32];
        identity[0] = 1;
        let text = format!("{VERIFYING_KEY_TAG} 1 {}", hex::encode(identity));
        assert_eq!(
            VerifyingKey::parse_list(&text).unwrap_err(),
            KeyParseError::BadPublicKey { line: 1 }
        );
        // y = 2 is not on the curve.
        let mut off_curve = [0u8; 32];
        off_curve[0] = 2;
        let text = format!("{VERIFYING_KEY_TAG} 1 {}", hex::encode(off_curve));
        assert_eq!(
            VerifyingKey::parse_list(&text).unwrap_err(),
            KeyParseError::BadPublicKey { line: 1 }
        );
    }

    #[test]
    fn ring_refuses_to_rebind_the_active_key_id() {
        let mut ring = KeyRing::new(SigningKey::from_seed(1, &SEED));
        let same = SigningKey::from_seed(1, &SEED).verifying_key();
        let other = SigningKey::from_seed(1, &[9; 32]).verifying_key();
        assert_eq!(ring.add_verifying_key(same), Ok(()));
        assert_eq!(ring.add_verifying_key(other), Err(KeyIdConflict { id: 1 }));
        assert_eq!(ring.verifying_key_ids().collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn ephemeral_rings_get_distinct_keys() {
        let a = KeyRing::ephemeral().expect("OS RNG");
        let b = KeyRing::ephemeral().expect("OS RNG");
        assert_ne!(a.active.verifying_key(), b.active.verifying_key());
    }
}
