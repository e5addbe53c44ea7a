//! `zerolayer keygen`: writes a signing key for context handles and publishes its verifying key.
//!
//! Writes `DIR/signing.key` (mode 0600, one line, see `docs/handle.md`) and adds the public key
//! to `DIR/verifying.keys`, keeping the keys already listed there so that handles signed by
//! them keep verifying after a rotation. An existing signing key, or an existing entry for the
//! same key id, is replaced only with `--force`. Both files are written to a temporary file
//! in the same directory and renamed into place, so a crash never leaves half a key.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use zerolayer_handle::{SigningKey, VerifyingKey};

/// Name of the signing key file inside `--out-dir`.
pub const SIGNING_KEY_FILE: &str = "signing.key";

/// Name of the verifying key file inside `--out-dir`.
pub const VERIFYING_KEYS_FILE: &str = "verifying.keys";

/// First lines of a new `verifying.keys`.
const VERIFYING_KEYS_HEADER: &str = "\
# zerolayer verifying keys for context handles (format: docs/handle.md).
# Keep a rotated-out key here until the handles it signed have expired (24 h by default).
";

/// Arguments of `zerolayer keygen`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory to write `signing.key` and `verifying.keys` into (created if missing).
    #[arg(long, env = "ZEROLAYER_KEY_DIR")]
    pub out_dir: PathBuf,
    /// Key id of the new key, carried by every handle it signs; use a new id when rotating.
    #[arg(long, env = "ZEROLAYER_KEY_ID", default_value_t = 1)]
    pub key_id: u16,
    /// Replace an existing signing key, and an existing verifying key with the same id.
    /// Deliberately not readable from the environment: a variable left set in a deployment
    /// would replace the key on every start and invalidate every handle.
    #[arg(long)]
    pub force: bool,
}

/// Runs `zerolayer keygen`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let dir = &args.out_dir;
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let signing_path = dir.join(SIGNING_KEY_FILE);
    let verifying_path = dir.join(VERIFYING_KEYS_FILE);

    if !args.force && exists(&signing_path)? {
        bail!(
            "{} already exists; pass --force to replace it (to rotate, also pick a new --key-id \
             so handles signed by the old key keep verifying)",
            signing_path.display()
        );
    }
    let verifying_text = updated_verifying_keys(&verifying_path, args.key_id, args.force)?;

    let key = SigningKey::generate(args.key_id).context("cannot generate a key")?;
    let verifying = key.verifying_key();
    let verifying_text = format!("{verifying_text}{}\n", verifying.to_line());

    // Publish the public key first: a signing key must never be in place without it.
    write_atomically(&verifying_path, verifying_text.as_bytes(), 0o644)?;
    write_atomically(&signing_path, key.to_text().as_bytes(), 0o600)?;

    println!(
        "signing key {} written to {} (mode 0600: keep it secret)",
        key.id(),
        signing_path.display()
    );
    println!(
        "verifying key {} added to {}: {}",
        verifying.id(),
        verifying_path.display(),
        verifying.to_line()
    );
    Ok(())
}

/// Whether `path` exists (a dangling symlink counts: it would be overwritten).
fn exists(path: &Path) -> anyhow::Result<bool> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("cannot inspect {}", path.display())),
    }
}

/// The current `verifying.keys` text without the entry for `key_id` (only with `force`), or
/// the header of a new file. The existing file must parse: keygen never rewrites a file it
/// does not understand.
fn updated_verifying_keys(path: &Path, key_id: u16, force: bool) -> anyhow::Result<String> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(VERIFYING_KEYS_HEADER.to_owned());
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let keys = VerifyingKey::parse_list(&text).with_context(|| format!("{}", path.display()))?;
    if keys.iter().any(|k| k.id() == key_id) && !force {
        bail!(
            "{} already lists key id {key_id}; pick a new --key-id, or pass --force to replace \
             it (handles signed by the old key {key_id} then stop verifying)",
            path.display()
        );
    }
    let mut kept = String::with_capacity(text.len());
    for line in text.lines() {
        // Every line parsed above, so a line on its own parses too; drop the replaced key.
        let replaced =
            VerifyingKey::parse_list(line).is_ok_and(|k| k.iter().any(|k| k.id() == key_id));
        if !replaced {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    Ok(kept)
}

/// Writes `contents` to a new temporary file beside `path` with permissions `mode`, flushes
/// it to disk and renames it over `path`.
fn write_atomically(path: &Path, contents: &[u8], mode: u32) -> anyhow::Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, mode);
    #[cfg(not(unix))]
    let _ = mode;
    let mut file = options
        .open(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    let result = file
        .write_all(contents)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))
        .and_then(|()| {
            fs::rename(&tmp, path)
                .with_context(|| format!("cannot move {} to {}", tmp.display(), path.display()))
        });
    if result.is_err() {
        // Only this run created `tmp` (create_new), so it is ours to remove.
        let _ = fs::remove_file(&tmp);
    }
    result
}
