//! Checks the layout table and the test vectors in `docs/handle.md` against the code, so the
//! documentation and the implementation cannot drift apart.

use std::collections::BTreeMap;

use zerolayer_handle::layout::{self, FIELDS, SIGNING_DOMAIN};
use zerolayer_handle::{
    Claims, HANDLE_LEN, KeyRing, PromptHash, SigningKey, TenantTag, VerifyPath, VerifyingKey,
};

/// Reads `docs/handle.md`.
fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/handle.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
}

/// The lines strictly between the line starting with `<!-- {name}:begin` and the one starting
/// with `<!-- {name}:end`.
fn block(doc: &str, name: &str) -> Vec<String> {
    let begin = format!("<!-- {name}:begin");
    let end = format!("<!-- {name}:end");
    let mut lines = doc.lines().skip_while(|l| !l.starts_with(&begin));
    assert!(
        lines.next().is_some(),
        "docs/handle.md has no `{begin}` marker"
    );
    let body: Vec<String> = lines
        .by_ref()
        .take_while(|l| !l.starts_with(&end))
        .map(String::from)
        .collect();
    assert!(doc.contains(&end), "docs/handle.md has no `{end}` marker");
    body
}

/// One `[section]` of the vector block: its name and `name = value` pairs.
type Vector = (String, BTreeMap<String, String>);

fn vectors(doc: &str) -> Vec<Vector> {
    let mut out: Vec<Vector> = Vec::new();
    for line in block(doc, "handle-vectors") {
        let line = line.trim();
        if line.is_empty() || line.starts_with("```") {
            continue;
        }
        if let Some(section) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            out.push((section.to_owned(), BTreeMap::new()));
            continue;
        }
        let (name, value) = line
            .split_once(" = ")
            .unwrap_or_else(|| panic!("bad line {line:?}"));
        let (_, fields) = out
            .last_mut()
            .unwrap_or_else(|| panic!("{line:?} before a section"));
        let previous = fields.insert(name.to_owned(), value.to_owned());
        assert!(previous.is_none(), "{name} given twice in one vector");
    }
    out
}

/// Typed access to one vector's fields; panics (failing the test) with the field's name.
struct Fields<'a>(&'a BTreeMap<String, String>);

impl Fields<'_> {
    fn raw(&self, name: &str) -> &str {
        self.0
            .get(name)
            .unwrap_or_else(|| panic!("vector lacks `{name}`"))
    }
    fn string(&self, name: &str) -> &str {
        let raw = self.raw(name);
        raw.strip_prefix('"')
            .and_then(|s| s.strip_suffix('"'))
            .unwrap_or_else(|| panic!("`{name}` must be a double-quoted string, got {raw}"))
    }
    fn bytes(&self, name: &str) -> Vec<u8> {
        hex::decode(self.raw(name)).unwrap_or_else(|e| panic!("`{name}` is not hex: {e}"))
    }
    fn array<const N: usize>(&self, name: &str) -> [u8; N] {
        let bytes = self.bytes(name);
        bytes
            .try_into()
            .unwrap_or_else(|b: Vec<u8>| panic!("`{name}` is {} bytes, not {N}", b.len()))
    }
    fn int<T: std::str::FromStr>(&self, name: &str) -> T {
        self.raw(name)
            .parse()
            .unwrap_or_else(|_| panic!("`{name}` is not a decimal integer"))
    }
}

#[test]
fn layout_table_in_docs_matches_the_code() {
    let doc = doc();
    let rows: Vec<(usize, usize, String)> = block(&doc, "handle-layout")
        .iter()
        .filter_map(|line| {
            let cells: Vec<&str> = line
                .trim()
                .trim_matches('|')
                .split('|')
                .map(str::trim)
                .collect();
            let offset = cells.first()?.parse().ok()?;
            let len = cells.get(1)?.parse().ok()?;
            Some((offset, len, cells.get(2)?.trim_matches('`').to_owned()))
        })
        .collect();
    let code: Vec<(usize, usize, String)> = FIELDS
        .iter()
        .map(|f| (f.offset, f.len, f.name.to_owned()))
        .collect();
    assert_eq!(rows, code);
    assert!(doc.contains(&format!("Total: {HANDLE_LEN} bytes")));
    assert!(doc.contains(&format!(
        "Bytes `0..{}` are the **signed body**",
        layout::SIGNED_LEN
    )));
    assert!(
        doc.contains(&hex::encode(SIGNING_DOMAIN)),
        "the domain's hex is in the docs"
    );
}

#[test]
fn docs_carry_vectors_of_every_kind() {
    let vectors = vectors(&doc());
    for kind in ["handle", "tenant_tag", "prompt_hash"] {
        assert!(vectors.iter().any(|(k, _)| k == kind), "no [{kind}] vector");
    }
    for (kind, _) in &vectors {
        assert!(
            ["handle", "tenant_tag", "prompt_hash"].contains(&kind.as_str()),
            "unknown [{kind}]"
        );
    }
}

#[test]
fn tenant_tag_vectors_match() {
    for (_, fields) in vectors(&doc()).iter().filter(|(k, _)| k == "tenant_tag") {
        let f = Fields(fields);
        let tenant = f.string("tenant");
        assert_eq!(
            TenantTag::for_tenant(tenant).as_bytes(),
            &f.array::<8>("tenant_tag"),
            "{tenant:?}"
        );
        // The documented derivation, computed directly.
        let full = blake3::derive_key("zerolayer 2026-11 tenant tag v1", tenant.as_bytes());
        assert_eq!(full[..8], f.array::<8>("tenant_tag"));
    }
}

/// The documented prompt-hash encoding, built by hand: u64-LE length ‖ bytes, three times.
fn prompt_hash_by_hand(parts: [&str; 3]) -> [u8; 16] {
    let mut input = Vec::new();
    for part in parts {
        input.extend_from_slice(&(part.len() as u64).to_le_bytes());
        input.extend_from_slice(part.as_bytes());
    }
    let full = blake3::derive_key("zerolayer 2026-11 prompt hash v1", &input);
    full[..16].try_into().expect("16 of 32 bytes")
}

#[test]
fn prompt_hash_vectors_match() {
    for (kind, fields) in vectors(&doc())
        .iter()
        .filter(|(k, _)| k == "prompt_hash" || k == "handle")
    {
        let f = Fields(fields);
        let parts = [
            f.string("tenant"),
            f.string("system"),
            f.string("first_user"),
        ];
        let want = f.array::<16>("prompt_hash");
        assert_eq!(
            PromptHash::compute(parts[0], parts[1], parts[2]).as_bytes(),
            &want,
            "[{kind}] {parts:?}"
        );
        assert_eq!(prompt_hash_by_hand(parts), want, "[{kind}] {parts:?}");
    }
}

#[test]
fn handle_vector_matches_byte_for_byte_and_verifies() {
    let vectors = vectors(&doc());
    let handle_vectors: Vec<_> = vectors.iter().filter(|(k, _)| k == "handle").collect();
    assert!(!handle_vectors.is_empty());
    for (_, fields) in handle_vectors {
        let f = Fields(fields);
        let key_id: u16 = f.int("key_id");
        let key = SigningKey::from_seed(key_id, &f.array::<32>("signing_key_seed"));

        // Keys and their file lines.
        assert_eq!(key.verifying_key().to_bytes(), f.array::<32>("public_key"));
        assert_eq!(key.to_text().trim_end(), f.raw("signing_key_line"));
        assert_eq!(key.verifying_key().to_line(), f.raw("verifying_key_line"));
        let parsed =
            SigningKey::from_text(f.raw("signing_key_line")).expect("documented line parses");
        assert_eq!(parsed.verifying_key(), key.verifying_key());
        let listed =
            VerifyingKey::parse_list(f.raw("verifying_key_line")).expect("documented line parses");
        assert_eq!(listed, vec![key.verifying_key()]);

        // Claims → exact bytes.
        let tenant = f.string("tenant");
        let claims = Claims {
            session_id: f.int("session_id"),
            tenant: TenantTag::for_tenant(tenant),
            prompt_hash: PromptHash::compute(tenant, f.string("system"), f.string("first_user")),
            kv_offset: f.int("kv_offset"),
            epoch: f.int("epoch"),
            expires_at: f.int("expires_at"),
        };
        assert_eq!(claims.tenant.as_bytes(), &f.array::<8>("tenant_tag"));
        let ring = KeyRing::new(key);
        let handle = ring.issue(claims);
        assert_eq!(hex::encode(handle.as_bytes()), f.raw("handle"));

        // The documented signing input is the domain and the body.
        let input = f.bytes("signing_input");
        assert_eq!(input[..SIGNING_DOMAIN.len()], SIGNING_DOMAIN[..]);
        assert_eq!(
            input[SIGNING_DOMAIN.len()..],
            handle.as_bytes()[..layout::SIGNED_LEN]
        );
        // ... and the documented signature is an Ed25519 signature over exactly that input.
        let public =
            ed25519_dalek::VerifyingKey::from_bytes(&f.array::<32>("public_key")).expect("point");
        let signature: [u8; 64] = handle.as_bytes()[layout::SIGNATURE.offset..]
            .try_into()
            .expect("64");
        public
            .verify_strict(&input, &ed25519_dalek::Signature::from_bytes(&signature))
            .expect("signature over the documented signing input");

        // The documented bytes verify (full path) and decode to the documented claims.
        let bytes = f.bytes("handle");
        let (verified, path) = ring
            .verify(&bytes, &claims.tenant, claims.expires_at - 1, None)
            .expect("vector verifies");
        assert_eq!(path, VerifyPath::FullVerify);
        assert_eq!(verified.claims(), &claims);
        assert_eq!(verified.key_id(), key_id);
    }
}
