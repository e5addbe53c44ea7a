//! `KeyRing::from_files`: loading, rotation through files, and typed errors for bad files.

use std::path::{Path, PathBuf};

use zerolayer_handle::{
    Claims, HandleError, KeyFileError, KeyParseError, KeyRing, MAX_KEY_FILE_BYTES, PromptHash,
    SigningKey, TenantTag, VerifyPath,
};

const NOW: u64 = 1_800_000_000;

fn claims() -> Claims {
    Claims {
        session_id: 9,
        tenant: TenantTag::for_tenant("acme"),
        prompt_hash: PromptHash::compute("acme", "", "hi"),
        kv_offset: 1,
        epoch: 0,
        expires_at: NOW + 60,
    }
}

fn write(dir: &Path, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).expect("write test file");
    path
}

#[test]
fn keys_written_as_text_load_back_and_verify_each_others_handles() {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = SigningKey::generate(3).expect("OS RNG");
    let signing = write(dir.path(), "signing.key", key.to_text().as_bytes());
    let verifying = write(
        dir.path(),
        "verifying.keys",
        format!("{}\n", key.verifying_key().to_line()),
    );

    let ring = KeyRing::from_files(&signing, &[verifying]).expect("loads");
    assert_eq!(ring.active_key_id(), 3);
    let handle = KeyRing::new(key).issue(claims());
    let (verified, path) = ring
        .verify(handle.as_bytes(), &claims().tenant, NOW, None)
        .expect("verifies");
    assert_eq!(
        (verified.claims(), path),
        (&claims(), VerifyPath::FullVerify)
    );
}

#[test]
fn a_ring_needs_no_verifying_files_for_its_own_handles() {
    let dir = tempfile::tempdir().expect("temp dir");
    let signing = write(
        dir.path(),
        "signing.key",
        SigningKey::from_seed(1, &[1; 32]).to_text().as_bytes(),
    );
    let ring = KeyRing::from_files(&signing, &[]).expect("loads");
    let handle = ring.issue(claims());
    assert!(
        ring.verify(handle.as_bytes(), &claims().tenant, NOW, None)
            .is_ok()
    );
}

#[test]
fn rotation_through_files_keeps_old_handles_valid_until_the_old_key_is_removed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let old = SigningKey::from_seed(1, &[1; 32]);
    let new = SigningKey::from_seed(2, &[2; 32]);
    let old_handle = KeyRing::new(SigningKey::from_seed(1, &[1; 32])).issue(claims());

    let signing = write(dir.path(), "signing.key", new.to_text().as_bytes());
    let both = write(
        dir.path(),
        "verifying.keys",
        format!(
            "# rotated\n{}\n{}\n",
            old.verifying_key().to_line(),
            new.verifying_key().to_line()
        ),
    );
    let ring = KeyRing::from_files(&signing, &[both]).expect("loads");
    let (verified, _) = ring
        .verify(old_handle.as_bytes(), &claims().tenant, NOW, None)
        .expect("old verifies");
    assert_eq!(verified.key_id(), 1);
    assert_eq!(ring.renew(&verified, 2, 0, NOW + 60).key_id(), 2);

    let only_new = write(
        dir.path(),
        "verifying.keys",
        format!("{}\n", new.verifying_key().to_line()),
    );
    let ring = KeyRing::from_files(&signing, &[only_new]).expect("loads");
    assert_eq!(
        ring.verify(old_handle.as_bytes(), &claims().tenant, NOW, None)
            .unwrap_err(),
        HandleError::UnknownKey(1)
    );
}

#[test]
fn a_missing_file_is_an_io_error_naming_the_path() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("nope.key");
    match KeyRing::from_files(&missing, &[]) {
        Err(KeyFileError::Io { path, source }) => {
            assert_eq!(path, missing);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected an Io error, got {other:?}"),
    }
}

#[test]
fn a_verifying_key_file_given_as_the_signing_key_is_a_wrong_tag_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let line = SigningKey::from_seed(1, &[1; 32]).verifying_key().to_line();
    let path = write(dir.path(), "verifying.keys", format!("# public\n{line}\n"));
    match KeyRing::from_files(&path, &[]) {
        Err(KeyFileError::Parse {
            path: p,
            source: KeyParseError::WrongTag { line: 2, .. },
        }) => assert_eq!(p, path),
        other => panic!("expected WrongTag on line 2, got {other:?}"),
    }
}

#[test]
fn oversized_and_non_utf8_files_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let signing = write(
        dir.path(),
        "signing.key",
        SigningKey::from_seed(1, &[1; 32]).to_text().as_bytes(),
    );
    let huge = write(
        dir.path(),
        "huge.keys",
        vec![b'#'; MAX_KEY_FILE_BYTES as usize + 1],
    );
    match KeyRing::from_files(&signing, &[huge]) {
        Err(KeyFileError::Parse {
            source: KeyParseError::TooLarge { len },
            ..
        }) => {
            assert_eq!(len, MAX_KEY_FILE_BYTES + 1);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let binary = write(dir.path(), "binary.keys", [0xff, 0xfe, b'\n']);
    assert!(matches!(
        KeyRing::from_files(&signing, &[binary]),
        Err(KeyFileError::Parse {
            source: KeyParseError::NotUtf8,
            ..
        })
    ));
}

#[test]
fn a_file_rebinding_the_active_key_id_is_a_conflict_naming_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let signing = write(
        dir.path(),
        "signing.key",
        SigningKey::from_seed(1, &[1; 32]).to_text().as_bytes(),
    );
    let impostor = SigningKey::from_seed(1, &[9; 32]).verifying_key().to_line();
    let verifying = write(dir.path(), "verifying.keys", impostor);
    match KeyRing::from_files(&signing, std::slice::from_ref(&verifying)) {
        Err(KeyFileError::Conflict { path, source }) => {
            assert_eq!((path, source.id), (verifying, 1));
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
}

#[test]
fn conflicting_bindings_across_two_files_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let signing = write(
        dir.path(),
        "signing.key",
        SigningKey::from_seed(1, &[1; 32]).to_text().as_bytes(),
    );
    let a = write(
        dir.path(),
        "a.keys",
        SigningKey::from_seed(5, &[5; 32]).verifying_key().to_line(),
    );
    let b = write(
        dir.path(),
        "b.keys",
        SigningKey::from_seed(5, &[6; 32]).verifying_key().to_line(),
    );
    assert!(matches!(
        KeyRing::from_files(&signing, &[a, b.clone()]),
        Err(KeyFileError::Conflict { path, .. }) if path == b
    ));
}
