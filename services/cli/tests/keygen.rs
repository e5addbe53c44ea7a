//! `zerolayer keygen` end to end: runs the real binary into a temporary directory and loads
//! the keys back with `KeyRing::from_files`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use zerolayer_handle::{Claims, HandleError, KeyRing, PromptHash, TenantTag, VerifyPath};

const NOW: u64 = 1_800_000_000;

/// Runs `zerolayer keygen` with `args` and `env`, with no `ZEROLAYER_*` variables inherited.
fn keygen(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerolayer"));
    cmd.arg("keygen").args(args);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("ZEROLAYER_") {
            cmd.env_remove(name);
        }
    }
    for (name, value) in env {
        cmd.env(name, value);
    }
    cmd.output().expect("run the zerolayer binary")
}

fn keygen_ok(args: &[&str]) -> String {
    let out = keygen(args, &[]);
    assert!(
        out.status.success(),
        "keygen {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

fn paths(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("signing.key"), dir.join("verifying.keys"))
}

fn load(dir: &Path) -> KeyRing {
    let (signing, verifying) = paths(dir);
    KeyRing::from_files(&signing, &[verifying]).expect("keygen output loads")
}

fn claims() -> Claims {
    Claims {
        session_id: 1,
        tenant: TenantTag::for_tenant("acme"),
        prompt_hash: PromptHash::compute("acme", "", "hi"),
        kv_offset: 3,
        epoch: 0,
        expires_at: NOW + 60,
    }
}

#[test]
fn keygen_writes_keys_that_load_back_and_sign_verifiable_handles() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("keys");
    let stdout = keygen_ok(&[
        "--out-dir",
        dir.to_str().expect("UTF-8 temp path"),
        "--key-id",
        "7",
    ]);

    let (signing, verifying) = paths(&dir);
    assert!(stdout.contains(&signing.display().to_string()), "{stdout}");
    assert!(
        stdout.contains(&verifying.display().to_string()),
        "{stdout}"
    );
    assert!(stdout.contains("signing key 7"), "{stdout}");

    let ring = load(&dir);
    assert_eq!(ring.active_key_id(), 7);
    assert_eq!(ring.verifying_key_ids().collect::<Vec<_>>(), vec![7]);
    let handle = ring.issue(claims());
    let (verified, path) = ring
        .verify(handle.as_bytes(), &claims().tenant, NOW, None)
        .expect("verifies");
    assert_eq!(
        (verified.claims(), path),
        (&claims(), VerifyPath::FullVerify)
    );
}

#[cfg(unix)]
#[test]
fn signing_key_file_is_readable_by_its_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("temp dir");
    keygen_ok(&["--out-dir", tmp.path().to_str().expect("UTF-8 temp path")]);
    let mode = std::fs::metadata(tmp.path().join("signing.key"))
        .expect("exists")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn keygen_refuses_to_overwrite_a_key_without_force() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().to_str().expect("UTF-8 temp path");
    keygen_ok(&["--out-dir", dir]);
    let (signing, verifying) = paths(tmp.path());
    let before = (
        std::fs::read(&signing).expect("key"),
        std::fs::read(&verifying).expect("keys"),
    );

    let out = keygen(&["--out-dir", dir, "--key-id", "2"], &[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
    let after = (
        std::fs::read(&signing).expect("key"),
        std::fs::read(&verifying).expect("keys"),
    );
    assert_eq!(before, after, "nothing was written");
}

#[test]
fn keygen_refuses_to_rebind_a_listed_key_id_without_force() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().to_str().expect("UTF-8 temp path");
    keygen_ok(&["--out-dir", dir, "--key-id", "4"]);
    std::fs::remove_file(tmp.path().join("signing.key")).expect("remove");

    let out = keygen(&["--out-dir", dir, "--key-id", "4"], &[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already lists key id 4"));
    keygen_ok(&["--out-dir", dir, "--key-id", "5"]);
}

#[test]
fn forced_rotation_keeps_old_keys_verifying_and_signs_with_the_new_one() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().to_str().expect("UTF-8 temp path");
    keygen_ok(&["--out-dir", dir, "--key-id", "1"]);
    let old_ring = load(tmp.path());
    let old_handle = old_ring.issue(claims());

    keygen_ok(&["--out-dir", dir, "--key-id", "2", "--force"]);
    let ring = load(tmp.path());
    assert_eq!(ring.active_key_id(), 2);
    assert_eq!(ring.verifying_key_ids().collect::<Vec<_>>(), vec![1, 2]);
    let (verified, _) = ring
        .verify(old_handle.as_bytes(), &claims().tenant, NOW, None)
        .expect("old key verifies");
    assert_eq!(verified.key_id(), 1);
    assert_eq!(ring.renew(&verified, 4, 0, NOW + 60).key_id(), 2);
    let text = std::fs::read_to_string(tmp.path().join("verifying.keys")).expect("keys");
    assert!(
        text.starts_with("# zerolayer verifying keys"),
        "comments are kept: {text}"
    );

    // Forcing the same id again replaces key 2: handles of the replaced key no longer verify.
    let handle_2 = ring.issue(claims());
    keygen_ok(&["--out-dir", dir, "--key-id", "2", "--force"]);
    let ring = load(tmp.path());
    assert_eq!(ring.verifying_key_ids().collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(
        ring.verify(handle_2.as_bytes(), &claims().tenant, NOW, None)
            .unwrap_err(),
        HandleError::BadSignature
    );
}

#[test]
fn keygen_reads_its_flags_from_the_environment() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let out = keygen(
        &[],
        &[
            ("ZEROLAYER_KEY_DIR", tmp.path()),
            ("ZEROLAYER_KEY_ID", Path::new("12")),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(load(tmp.path()).active_key_id(), 12);
}

#[test]
fn keygen_refuses_an_unreadable_verifying_keys_file() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let garbage = "not a key file\n";
    std::fs::write(tmp.path().join("verifying.keys"), garbage).expect("write");
    let out = keygen(
        &["--out-dir", tmp.path().to_str().expect("UTF-8 temp path")],
        &[],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 1"));
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("verifying.keys")).expect("kept"),
        garbage
    );
    assert!(!tmp.path().join("signing.key").exists());
}
