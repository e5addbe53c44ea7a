//! Configuration shared by the server and the client, with every limit named.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::SegmentError;
use crate::frame::FRAME_HEADER_BYTES;

/// Where segments named by a bare name live: the POSIX shared-memory tmpfs on Linux.
pub const DEFAULT_SHM_DIR: &str = "/dev/shm";

/// Longest bare segment name: `NAME_MAX` of Linux file systems (255 bytes).
pub const MAX_NAME_BYTES: usize = 255;

/// Default request-ring size: 8 MiB, so the largest request frame (half a ring, see
/// [`max_payload_for_ring`]) is 4 MiB minus the frame header — tonic's default maximum
/// decoded message size, so any request the gRPC edge accepts by default fits.
pub const DEFAULT_REQUEST_RING_BYTES: usize = 8 << 20;

/// Default response-ring size: 4 MiB. Response frames are stream chunks (a few tokens and
/// some counters, well under 1 KiB each), so this holds thousands of chunks in flight.
pub const DEFAULT_RESPONSE_RING_BYTES: usize = 4 << 20;

/// Smallest ring: one 4 KiB page, so the largest frame is still 2 KiB.
pub const MIN_RING_BYTES: usize = 4096;

/// Largest ring: 1 GiB. Bounds the segment (and a hostile header) to sizes that can be
/// mapped on every 64-bit target, and keeps frame lengths well inside `u32`.
pub const MAX_RING_BYTES: usize = 1 << 30;

/// Default heartbeat period (both sides): 50 ms, so the default liveness timeout sees
/// eight missed beats before it declares the peer dead.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(50);

/// Default liveness timeout: 400 ms of heartbeat silence. A dead peer is noticed after the
/// timeout plus at most one heartbeat interval of the watcher: ≤ 450 ms by default, within
/// the 500 ms the design asks for.
pub const DEFAULT_LIVENESS_TIMEOUT: Duration = Duration::from_millis(400);

/// Default time a writer waits for room in a full ring before `SendError::Timeout`: 5 s,
/// long enough to ride out a GC-like stall of the reader, short enough that a stuck peer
/// turns into an error the caller can report.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// Default time a client waits for the server to grant a session after asking, before it
/// re-opens the segment and asks again: 2 s, above the server's liveness timeout so a
/// previous client's dead session is cleared within it.
pub const DEFAULT_ATTACH_TIMEOUT: Duration = Duration::from_secs(2);

/// Default spin before a waiter parks on the futex: 20 µs. Longer than the round trip of a
/// busy peer (≈1 µs), so a streaming peer costs no syscalls, and short enough that an idle
/// waiter gives the CPU back quickly on a 2-core machine.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(20);

/// Default cap on requests in flight per client session: the engine's default slot-map
/// capacity (65,536 sessions), so a client can never make the server track more ids than
/// it could have conversations.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 65_536;

/// Default file mode of the segment: owner read/write. Containers running under different
/// uids need `0o666` (or a shared group) — set [`ShmConfig::file_mode`].
pub const DEFAULT_FILE_MODE: u32 = 0o600;

/// Longest spin a [`WaitStrategy::SpinThenPark`] may ask for: past this, spinning only burns a
/// core (and deadlines computed from it could overflow the clock).
pub const MAX_SPIN: Duration = Duration::from_secs(1);

/// How a waiting reader or writer waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStrategy {
    /// Busy-poll without ever sleeping: the lowest latency, one core burnt per waiter. Still
    /// checks deadlines and the peer's liveness, and yields the core now and then after the
    /// first microsecond (so a peer scheduled on the same core can run). Only for machines
    /// with a core per spinning thread: on an oversubscribed machine it is slower than
    /// parking (see BENCHMARKS.md).
    Spin,
    /// Busy-poll for `spin`, then sleep on a futex. The waiter raises a "sleeping" flag before
    /// it sleeps, so a peer that finds the flag down skips the wake-up system call.
    SpinThenPark {
        /// How long to spin before sleeping (zero: sleep at once).
        spin: Duration,
    },
}

impl Default for WaitStrategy {
    fn default() -> Self {
        WaitStrategy::SpinThenPark { spin: DEFAULT_SPIN }
    }
}

/// Configuration of one side of a channel. Both sides name the same segment; the server's
/// ring sizes are written into the header and the client reads them from there.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// The segment file: `/dev/shm/<name>` for a bare name, or an absolute path (a tmpfs
    /// mount shared between containers, e.g. `/run/zerolayer/seg`).
    pub path: PathBuf,
    /// Request ring size in bytes (server only; a power of two in
    /// [`MIN_RING_BYTES`]..=[`MAX_RING_BYTES`]).
    pub request_ring_bytes: usize,
    /// Response ring size in bytes (server only; same rules).
    pub response_ring_bytes: usize,
    /// How often this side publishes its heartbeat and checks the peer's.
    pub heartbeat_interval: Duration,
    /// Heartbeat silence after which the peer is declared dead. Must exceed the *peer's*
    /// heartbeat interval by a wide margin (the default is 8×).
    pub liveness_timeout: Duration,
    /// How long a blocking send waits for room in a full ring.
    pub send_timeout: Duration,
    /// Client: how long to wait for the server to grant a session before retrying.
    pub attach_timeout: Duration,
    /// How readers and writers wait.
    pub wait: WaitStrategy,
    /// Server: file mode of the segment file (before the umask is reapplied by `fchmod`, i.e.
    /// exactly this mode).
    pub file_mode: u32,
    /// Server: the most requests one client session may have in flight.
    pub max_in_flight: usize,
    /// Server: remove the segment file when the server shuts down (if it is still ours).
    pub unlink_on_drop: bool,
}

impl ShmConfig {
    /// A configuration with the defaults for a segment given by a bare name (placed under
    /// [`DEFAULT_SHM_DIR`]) or an absolute path.
    pub fn new(name_or_path: &str) -> Result<Self, SegmentError> {
        Ok(ShmConfig {
            path: resolve_path(name_or_path)?,
            request_ring_bytes: DEFAULT_REQUEST_RING_BYTES,
            response_ring_bytes: DEFAULT_RESPONSE_RING_BYTES,
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            liveness_timeout: DEFAULT_LIVENESS_TIMEOUT,
            send_timeout: DEFAULT_SEND_TIMEOUT,
            attach_timeout: DEFAULT_ATTACH_TIMEOUT,
            wait: WaitStrategy::default(),
            file_mode: DEFAULT_FILE_MODE,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            unlink_on_drop: true,
        })
    }

    /// Checks every field; called by `create` and `attach`.
    pub fn validate(&self) -> Result<(), SegmentError> {
        let bad = |reason: String| Err(SegmentError::InvalidConfig { reason });
        for (which, bytes) in [
            ("request", self.request_ring_bytes),
            ("response", self.response_ring_bytes),
        ] {
            if let Err(reason) = check_ring_bytes(bytes as u64) {
                return bad(format!("{which} ring of {bytes} bytes: {reason}"));
            }
        }
        if !self.path.is_absolute() {
            return bad(format!(
                "segment path {} is not absolute",
                self.path.display()
            ));
        }
        if self.path.file_name().is_none() {
            return bad(format!(
                "segment path {} has no file name",
                self.path.display()
            ));
        }
        if self.heartbeat_interval.is_zero() {
            return bad("heartbeat_interval must be positive".into());
        }
        if self.liveness_timeout < self.heartbeat_interval * 2 {
            return bad(format!(
                "liveness_timeout {:?} must be at least twice heartbeat_interval {:?}",
                self.liveness_timeout, self.heartbeat_interval
            ));
        }
        if self.send_timeout.is_zero() || self.attach_timeout.is_zero() {
            return bad("send_timeout and attach_timeout must be positive".into());
        }
        if self.max_in_flight == 0 {
            return bad("max_in_flight must be positive".into());
        }
        if let WaitStrategy::SpinThenPark { spin } = self.wait
            && spin > MAX_SPIN
        {
            return bad(format!("spin {spin:?} exceeds {MAX_SPIN:?}"));
        }
        if self.file_mode & !0o777 != 0 {
            return bad(format!(
                "file_mode {:#o} has bits outside 0o777",
                self.file_mode
            ));
        }
        Ok(())
    }
}

/// Checks a ring size; the same rule validates a header written by the peer.
pub(crate) fn check_ring_bytes(bytes: u64) -> Result<(), &'static str> {
    if !bytes.is_power_of_two() {
        return Err("not a power of two");
    }
    if bytes < MIN_RING_BYTES as u64 {
        return Err("smaller than MIN_RING_BYTES");
    }
    if bytes > MAX_RING_BYTES as u64 {
        return Err("larger than MAX_RING_BYTES");
    }
    Ok(())
}

/// The largest payload a ring of `capacity` bytes accepts: half the ring minus the frame
/// header. Frames are contiguous (a padding marker skips the ring's tail end), and a frame of
/// at most half the ring always fits into an empty ring whatever the write position, so a
/// writer that waits long enough always succeeds.
pub fn max_payload_for_ring(capacity: usize) -> usize {
    capacity / 2 - FRAME_HEADER_BYTES
}

/// Resolves a bare name to `/dev/shm/<name>`; keeps an absolute path as is.
fn resolve_path(name_or_path: &str) -> Result<PathBuf, SegmentError> {
    let bad = |reason: &str| {
        Err(SegmentError::InvalidConfig {
            reason: format!("segment name {name_or_path:?}: {reason}"),
        })
    };
    if name_or_path.is_empty() {
        return bad("empty");
    }
    if name_or_path.contains('\0') {
        return bad("contains a NUL byte");
    }
    if name_or_path.starts_with('/') {
        let path = Path::new(name_or_path);
        match path.file_name() {
            Some(_) => return Ok(path.to_path_buf()),
            None => return bad("absolute path without a file name"),
        }
    }
    if name_or_path.contains('/') {
        return bad("a bare name may not contain '/' (use an absolute path)");
    }
    if name_or_path == "." || name_or_path == ".." {
        return bad("not a file name");
    }
    if name_or_path.len() > MAX_NAME_BYTES {
        return bad("longer than MAX_NAME_BYTES");
    }
    Ok(Path::new(DEFAULT_SHM_DIR).join(name_or_path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_names_live_under_dev_shm_and_absolute_paths_stay() {
        let cfg = ShmConfig::new("zerolayer-a").unwrap();
        assert_eq!(cfg.path, Path::new("/dev/shm/zerolayer-a"));
        let cfg = ShmConfig::new("/run/zerolayer/seg").unwrap();
        assert_eq!(cfg.path, Path::new("/run/zerolayer/seg"));
    }

    #[test]
    fn bad_names_are_rejected_with_invalid_config() {
        for name in ["", "a/b", ".", "..", "a\0b", "/"] {
            let err = ShmConfig::new(name).unwrap_err();
            assert!(
                matches!(err, SegmentError::InvalidConfig { .. }),
                "{name:?}: {err}"
            );
        }
        let long = "x".repeat(MAX_NAME_BYTES + 1);
        assert!(ShmConfig::new(&long).is_err());
    }

    #[test]
    fn ring_sizes_must_be_powers_of_two_within_limits() {
        let mut cfg = ShmConfig::new("zerolayer-b").unwrap();
        assert!(cfg.validate().is_ok());
        for bytes in [0, 4095, 4097, 6000, MAX_RING_BYTES * 2] {
            cfg.request_ring_bytes = bytes;
            assert!(cfg.validate().is_err(), "{bytes}");
        }
        cfg.request_ring_bytes = MIN_RING_BYTES;
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn liveness_timeout_shorter_than_two_heartbeats_is_rejected() {
        let mut cfg = ShmConfig::new("zerolayer-c").unwrap();
        cfg.liveness_timeout = cfg.heartbeat_interval;
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn a_spin_longer_than_max_spin_is_rejected() {
        let mut cfg = ShmConfig::new("zerolayer-d").unwrap();
        cfg.wait = WaitStrategy::SpinThenPark { spin: MAX_SPIN };
        assert!(cfg.validate().is_ok());
        cfg.wait = WaitStrategy::SpinThenPark {
            spin: Duration::from_micros(u64::MAX),
        };
        assert!(matches!(
            cfg.validate(),
            Err(SegmentError::InvalidConfig { .. })
        ));
    }

    #[test]
    fn largest_payload_is_half_the_ring_minus_the_header() {
        assert_eq!(max_payload_for_ring(4096), 2048 - 16);
    }
}
