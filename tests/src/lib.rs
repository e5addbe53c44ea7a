//! Helpers of the workspace integration tests: the `zerolayer` binary, test data, and a test
//! environment (keys, tenants, a launcher) per test.
//!
//! The suites (`tests/tests/*.rs`) start real processes on 127.0.0.1 port 0, wait for their
//! ready lines, and talk to them over real gRPC with the client library.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

pub use zerolayer_bench::launch::{Auth, Deployment, Launcher, Mode, Process};
use zerolayer_client::{Client, ClientConfig, RetryPolicy};
use zerolayer_handle::KeyRing;

/// API key of tenant `acme` (no limits).
pub const ACME_KEY: &str = "acme-key-0123456789abcdef";
/// API key of tenant `beta` (no limits).
pub const BETA_KEY: &str = "beta-key-0123456789abcdef";
/// API key of tenant `slow` (tiny token rate).
pub const SLOW_KEY: &str = "slow-key-0123456789abcdef";
/// API key of tenant `single` (one request at a time).
pub const SINGLE_KEY: &str = "single-key-0123456789abcdef";
/// A string tenant `acme` may never send or receive.
pub const ACME_FORBIDDEN: &str = "launch code";

/// The `zerolayer` binary: `$ZEROLAYER_BIN`, else beside the test executable's `deps/`
/// directory (cargo and nextest build it there for the CLI crate's own tests).
pub fn zerolayer_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ZEROLAYER_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let bin = dir.join("zerolayer");
    assert!(
        bin.exists(),
        "{} not found: build it first (`cargo build -p zerolayer-cli`; `cargo nextest run --workspace` does)",
        bin.display()
    );
    bin
}

/// The test models directory: `$ZEROLAYER_MODELS_DIR`, else `../shared/models` beside the
/// workspace root. `None` (with a visible skip message) when absent.
pub fn models_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("ZEROLAYER_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models"));
    if dir.join("stories260K/stories260K.bin").exists() {
        Some(dir)
    } else {
        eprintln!(
            "SKIP: test models not found at {} (set ZEROLAYER_MODELS_DIR)",
            dir.display()
        );
        None
    }
}

/// Whether `redis-server` is installed (the layered baseline needs it).
pub fn have_redis() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A test's private world: a work dir, handle keys, a tenants file, and a launcher using them.
#[derive(Debug)]
pub struct TestEnv {
    /// Work directory (logs, sockets, keys), removed at the end.
    pub dir: tempfile::TempDir,
    /// Launcher configured with the keys and tenants.
    pub launcher: Launcher,
}

impl TestEnv {
    /// A fresh environment serving `dummy:tiny`.
    pub fn new() -> Self {
        Self::with_model("dummy:tiny")
    }

    /// A fresh environment serving `model`.
    pub fn with_model(model: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("zl-test-")
            .tempdir()
            .expect("temp dir");
        let keys = dir.path().join("keys");
        let status = Command::new(zerolayer_bin())
            .args(["keygen", "--out-dir"])
            .arg(&keys)
            .output()
            .expect("run keygen");
        assert!(status.status.success(), "keygen failed: {status:?}");
        let tenants = dir.path().join("tenants.toml");
        std::fs::write(
            &tenants,
            format!(
                r#"
[[tenants]]
name = "acme"
api_keys = ["{ACME_KEY}"]
forbidden = ["{ACME_FORBIDDEN}"]

[[tenants]]
name = "beta"
api_keys = ["{BETA_KEY}"]

[[tenants]]
name = "slow"
api_keys = ["{SLOW_KEY}"]
rate_limit_tokens_per_s = 1.0
burst_tokens = 40

[[tenants]]
name = "single"
api_keys = ["{SINGLE_KEY}"]
max_concurrency = 1
"#
            ),
        )
        .expect("write tenants");
        let mut launcher = Launcher::new(zerolayer_bin(), model, dir.path().join("work"));
        launcher.auth = Auth::TenantsFile(tenants);
        launcher.key_dir = Some(keys);
        Self { dir, launcher }
    }

    /// The key ring the servers use (to forge expired handles).
    pub fn keys(&self) -> KeyRing {
        let dir = self.launcher.key_dir.as_ref().expect("key dir");
        KeyRing::from_files(&dir.join("signing.key"), &[dir.join("verifying.keys")]).expect("keys")
    }

    /// Starts a deployment of `mode`, panicking with the logs on failure.
    pub fn start(&self, mode: Mode) -> Deployment {
        self.launcher
            .start(mode)
            .unwrap_or_else(|e| panic!("starting {mode}: {e:#}"))
    }
}

impl Default for TestEnv {
    fn default() -> Self {
        Self::new()
    }
}

/// A client of `endpoint` with API key `key` and no retries (tests observe first errors).
pub fn client(endpoint: &str, key: Option<&str>) -> Client {
    let mut config = ClientConfig::new(endpoint).retry(RetryPolicy::none());
    config.api_key = key.map(str::to_owned);
    Client::new(config).expect("valid endpoint")
}

/// A client with the default retry policy.
pub fn retrying_client(endpoint: &str, key: Option<&str>) -> Client {
    let mut config = ClientConfig::new(endpoint);
    config.api_key = key.map(str::to_owned);
    Client::new(config).expect("valid endpoint")
}

/// Reads a Prometheus endpoint.
pub async fn scrape(metrics_addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(metrics_addr)
        .await
        .expect("connect to metrics");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    out
}

/// The value of the first sample line starting with `prefix` (a metric name with labels).
pub fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Polls `f` every 50 ms until it returns `Some`, up to `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
