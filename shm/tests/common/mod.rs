//! Test helpers: watchdogs, unique segment names, and child peer processes.

#![allow(dead_code, reason = "each test binary uses a different subset")]

pub mod proto;
pub mod serve;
pub mod verify;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use zerolayer_shm::{ShmConfig, WaitStrategy};

/// Generous bound for anything a test waits for: far above what the operation needs on an
/// idle machine, so a loaded 2-core CI box never trips it, yet a hang fails the test.
pub const WAIT: Duration = Duration::from_secs(30);

/// Aborts the whole test process if the test is still running after `limit` (a hang must
/// fail loudly, not stall the suite). Disarmed on drop.
pub struct Watchdog {
    done: Arc<AtomicBool>,
}

impl Watchdog {
    pub fn new(test: &'static str, limit: Duration) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + limit;
            while Instant::now() < deadline {
                if flag.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            eprintln!("WATCHDOG: test `{test}` still running after {limit:?}; aborting");
            std::process::abort();
        });
        Watchdog { done }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
    }
}

/// A segment path unique to this test run (pid, counter, random), removed on drop along with
/// any temporary files a killed server left next to it.
pub struct SegmentPath {
    pub path: PathBuf,
}

impl SegmentPath {
    pub fn new(tag: &str) -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let random = std::collections::hash_map::RandomState::new();
        let salt = std::hash::BuildHasher::hash_one(&random, (n, std::process::id()));
        let name = format!(
            "zl-test-{tag}-{}-{n}-{:08x}",
            std::process::id(),
            salt as u32
        );
        SegmentPath {
            path: PathBuf::from("/dev/shm").join(name),
        }
    }

    pub fn as_str(&self) -> String {
        self.path.to_string_lossy().into_owned()
    }

    /// A configuration for this path with small rings (so tests wrap them often) and the
    /// given liveness timeout.
    pub fn config(&self, liveness: Duration) -> ShmConfig {
        let mut cfg = ShmConfig::new(&self.as_str()).expect("valid test path");
        cfg.request_ring_bytes = 64 << 10;
        cfg.response_ring_bytes = 64 << 10;
        cfg.liveness_timeout = liveness;
        cfg.wait = WaitStrategy::default();
        cfg
    }
}

impl Drop for SegmentPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Ok(entries) = std::fs::read_dir("/dev/shm") {
            for entry in entries.flatten() {
                let file = entry.file_name().to_string_lossy().into_owned();
                if file.starts_with(&format!(".{name}.")) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }
}

/// A `zerolayer-shm-peer` child process. Killed (SIGKILL) and reaped on drop; its stdout
/// lines arrive on a channel so tests wait for milestones instead of sleeping.
pub struct Peer {
    child: Child,
    /// Held open: the peer exits when it closes.
    _stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    /// Every line seen so far (for failure messages).
    seen: Vec<String>,
}

impl Peer {
    pub fn spawn(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_zerolayer-shm-peer"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn zerolayer-shm-peer");
        let stdout = child.stdout.take().expect("piped stdout");
        let stdin = child.stdin.take().expect("piped stdin");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Peer {
            child,
            _stdin: stdin,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for a line starting with `prefix` (other lines are kept in `seen`).
    pub fn expect_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.starts_with("FAILED") {
                        panic!("peer failed: {line} (lines so far: {:?})", self.seen);
                    }
                    if line.starts_with(prefix) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no `{prefix}` line from the peer within {WAIT:?}; lines: {:?}",
                    self.seen
                ),
            }
        }
    }

    /// Kills the peer with SIGKILL (no clean-up of any kind runs in it) and reaps it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the peer to exit by itself; returns whether it succeeded.
    pub fn wait_success(&mut self) -> bool {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.success();
            }
            if Instant::now() > deadline {
                panic!("peer did not exit within {WAIT:?}; lines: {:?}", self.seen);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
