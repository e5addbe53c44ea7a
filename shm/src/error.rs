//! Typed errors of every layer, from the segment file up to the async client.
//!
//! Every enum has `error_type()`: a stable, low-cardinality string for metric labels and logs.

use std::path::PathBuf;
use std::time::Duration;

/// A problem with the segment file or its header: creating, opening or validating it.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    /// The configuration is unusable (a ring size that is not a power of two, a bad name, ...).
    #[error("invalid shared-memory configuration: {reason}")]
    InvalidConfig {
        /// What is wrong, in words.
        reason: String,
    },
    /// The file system that holds the segment has no room for it (tmpfs too small).
    #[error(
        "no space for a {bytes}-byte shared-memory segment at {path} (is the tmpfs large enough?)"
    )]
    NoSpace {
        /// The segment path.
        path: PathBuf,
        /// The size that was asked for.
        bytes: u64,
    },
    /// Another live server already owns the segment at this path (it holds the file lock).
    #[error("the shared-memory segment {path} is owned by another live server")]
    InUse {
        /// The segment path.
        path: PathBuf,
    },
    /// No segment exists at this path (the server has not started yet).
    #[error("no shared-memory segment at {path}")]
    NotFound {
        /// The segment path.
        path: PathBuf,
    },
    /// The segment exists but its header is not one this build can use.
    #[error("invalid shared-memory segment header at {path}: {source}")]
    Header {
        /// The segment path.
        path: PathBuf,
        /// What is wrong with the header.
        source: HeaderError,
    },
    /// A system call failed.
    #[error("{op} failed for {path}: {source}")]
    Io {
        /// Which operation failed (`open`, `fallocate`, `mmap`, ...).
        op: &'static str,
        /// The segment path.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
}

impl SegmentError {
    /// A stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            SegmentError::InvalidConfig { .. } => "invalid_config",
            SegmentError::NoSpace { .. } => "no_space",
            SegmentError::InUse { .. } => "in_use",
            SegmentError::NotFound { .. } => "not_found",
            SegmentError::Header { .. } => "bad_header",
            SegmentError::Io { .. } => "io",
        }
    }
}

/// Why a segment header was rejected. Produced by the client (and by offline inspection) when
/// it validates what the server wrote; nothing in a header is trusted before this check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// The file is too small to hold a header, or too large to be a segment.
    #[error("segment file size {size} is outside {min}..={max}")]
    BadFileSize {
        /// The file size.
        size: u64,
        /// The smallest acceptable size.
        min: u64,
        /// The largest acceptable size.
        max: u64,
    },
    /// The magic number is wrong: not a zerolayer segment, or not initialised yet.
    #[error("bad magic {found:#018x}")]
    BadMagic {
        /// The value found.
        found: u64,
    },
    /// The segment uses a layout version this build does not speak.
    #[error("unsupported layout version {found} (this build speaks {expected})")]
    UnsupportedVersion {
        /// The version found.
        found: u32,
        /// The version this build speaks.
        expected: u32,
    },
    /// The header size field differs from this layout's header size.
    #[error("header size {found} differs from {expected}")]
    BadHeaderSize {
        /// The value found.
        found: u32,
        /// The expected value.
        expected: u32,
    },
    /// The segment size in the header differs from the file size.
    #[error("header says the segment has {header} bytes but the file has {file}")]
    SizeMismatch {
        /// The size recorded in the header.
        header: u64,
        /// The size of the file.
        file: u64,
    },
    /// The generation number is zero (reserved for "no segment").
    #[error("generation number is zero")]
    ZeroGeneration,
    /// A ring's offset or capacity is out of bounds, misaligned, or not a power of two.
    #[error("{ring} ring at offset {offset} with capacity {capacity} is invalid: {reason}")]
    BadRing {
        /// Which ring ("request" or "response").
        ring: &'static str,
        /// The offset found.
        offset: u64,
        /// The capacity found.
        capacity: u64,
        /// What is wrong.
        reason: &'static str,
    },
}

impl HeaderError {
    /// A stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            HeaderError::BadFileSize { .. } => "bad_file_size",
            HeaderError::BadMagic { .. } => "bad_magic",
            HeaderError::UnsupportedVersion { .. } => "unsupported_version",
            HeaderError::BadHeaderSize { .. } => "bad_header_size",
            HeaderError::SizeMismatch { .. } => "size_mismatch",
            HeaderError::ZeroGeneration => "zero_generation",
            HeaderError::BadRing { .. } => "bad_ring",
        }
    }
}

/// The peer left a ring in a state an honest peer never produces. The channel is broken
/// from then on: nothing further is read from that ring until a new session resets it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The peer's write index is misaligned, behind the read index, or more than a ring ahead.
    #[error("write index {head} is invalid for read index {tail} and capacity {capacity}")]
    HeadOutOfRange {
        /// The write index read from the segment.
        head: u64,
        /// The local read index.
        tail: u64,
        /// The ring capacity.
        capacity: u64,
    },
    /// The peer's read index is misaligned, ahead of the write index, or more than a ring behind.
    #[error("read index {tail} is invalid for write index {head} and capacity {capacity}")]
    TailOutOfRange {
        /// The local write index.
        head: u64,
        /// The read index read from the segment.
        tail: u64,
        /// The ring capacity.
        capacity: u64,
    },
    /// A frame's length runs past the published data or past the end of the ring.
    #[error("frame length {len} at ring offset {offset} exceeds the {available} bytes available")]
    LengthOutOfBounds {
        /// The payload length read from the frame header.
        len: u32,
        /// The frame's offset in the ring.
        offset: u64,
        /// The bytes that could hold the frame (the smaller of published data and room to the ring's end).
        available: u64,
    },
    /// A padding marker does not run exactly to the end of the ring, or is not published.
    #[error("padding marker at ring offset {offset} claims {len} bytes; expected {expected}")]
    BadPadding {
        /// The marker's offset in the ring.
        offset: u64,
        /// The length it claims.
        len: u32,
        /// The length it must have.
        expected: u64,
    },
    /// A kind in the reserved control range that this build does not know, or a control
    /// frame with a malformed body.
    #[error("unknown or malformed control frame kind {kind:#06x} (length {len})")]
    BadControlFrame {
        /// The kind found.
        kind: u16,
        /// The payload length found.
        len: u32,
    },
    /// Flag bits this build does not define.
    #[error("unknown frame flags {flags:#06x}")]
    UnknownFlags {
        /// The flags found.
        flags: u16,
    },
}

impl FrameError {
    /// A stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            FrameError::HeadOutOfRange { .. } => "head_out_of_range",
            FrameError::TailOutOfRange { .. } => "tail_out_of_range",
            FrameError::LengthOutOfBounds { .. } => "length_out_of_bounds",
            FrameError::BadPadding { .. } => "bad_padding",
            FrameError::BadControlFrame { .. } => "bad_control_frame",
            FrameError::UnknownFlags { .. } => "unknown_flags",
        }
    }
}

/// Why a frame could not be sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The frame can never fit: its payload exceeds the ring's largest frame.
    #[error("frame payload of {len} bytes exceeds the largest frame of {max} bytes")]
    FrameTooLarge {
        /// The requested payload length.
        len: usize,
        /// The largest payload this ring accepts.
        max: usize,
    },
    /// The kind is in the range reserved for the crate's control frames.
    #[error("frame kind {kind:#06x} is reserved for control frames")]
    ReservedKind {
        /// The kind asked for.
        kind: u16,
    },
    /// The ring stayed full (the reader is not keeping up) for the whole timeout.
    #[error("ring full for {waited:?}")]
    Timeout {
        /// How long the writer waited.
        waited: Duration,
    },
    /// The ring is full right now (only from `try_send`).
    #[error("ring full")]
    Full,
    /// The session the frame belongs to has ended (peer gone, detached or replaced).
    #[error("the session has ended")]
    SessionGone,
    /// The peer corrupted the ring's read index; the channel is broken.
    #[error("corrupt ring: {0}")]
    Corrupt(FrameError),
    /// This side is shutting down.
    #[error("channel shut down")]
    Shutdown,
}

impl SendError {
    /// A stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            SendError::FrameTooLarge { .. } => "frame_too_large",
            SendError::ReservedKind { .. } => "reserved_kind",
            SendError::Timeout { .. } => "timeout",
            SendError::Full => "full",
            SendError::SessionGone => "session_gone",
            SendError::Corrupt(_) => "corrupt",
            SendError::Shutdown => "shutdown",
        }
    }
}

/// Why a frame could not be received from the low-level [`crate::channel::Consumer`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecvError {
    /// The peer corrupted the ring; this is reported once, then [`RecvError::Broken`].
    #[error("corrupt ring: {0}")]
    Corrupt(FrameError),
    /// The ring was found corrupt earlier and is no longer read.
    #[error("ring broken by an earlier corruption")]
    Broken,
    /// This side is shutting down.
    #[error("channel shut down")]
    Shutdown,
}

impl RecvError {
    /// A stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            RecvError::Corrupt(_) => "corrupt",
            RecvError::Broken => "broken",
            RecvError::Shutdown => "shutdown",
        }
    }
}

/// Why a session between a client and the server ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GoneReason {
    /// The peer's heartbeat stopped for longer than the liveness timeout (crash, `kill -9`,
    /// or a peer stalled that long).
    #[error("peer heartbeat stopped")]
    HeartbeatTimeout,
    /// The server closed the segment (graceful shutdown).
    #[error("server closed the segment")]
    ServerClosed,
    /// The client detached (graceful shutdown, or it abandoned the session to attach anew).
    #[error("client detached")]
    Detached,
    /// The server ended this client's session (the client sees its session id replaced).
    #[error("session revoked by the server")]
    Revoked,
    /// The peer corrupted a ring.
    #[error("corrupt ring: {0}")]
    Corrupt(FrameError),
    /// The client broke the protocol (a duplicate request id, too many requests in flight).
    #[error("protocol violation: {0}")]
    Protocol(ProtocolError),
    /// This side is shutting down.
    #[error("shut down locally")]
    Shutdown,
}

impl GoneReason {
    /// A stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            GoneReason::HeartbeatTimeout => "heartbeat_timeout",
            GoneReason::ServerClosed => "server_closed",
            GoneReason::Detached => "detached",
            GoneReason::Revoked => "revoked",
            GoneReason::Corrupt(_) => "corrupt",
            GoneReason::Protocol(_) => "protocol",
            GoneReason::Shutdown => "shutdown",
        }
    }
}

/// A well-formed frame that breaks the session protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// A request id that is already in flight in this session.
    #[error("request id {id} is already in flight")]
    DuplicateRequestId {
        /// The id.
        id: u64,
    },
    /// More requests in flight than the server's limit.
    #[error("more than {limit} requests in flight")]
    TooManyInFlight {
        /// The limit.
        limit: usize,
    },
}

/// Errors of the async client ([`crate::ShmClient`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// No session with a server right now (not attached yet, or reattaching).
    #[error("not attached to a server")]
    NotAttached,
    /// The session this request belonged to ended; the client reattaches by itself.
    #[error("server session lost: {reason}")]
    PeerGone {
        /// Why the session ended.
        reason: GoneReason,
    },
    /// The request could not be sent.
    #[error("send failed: {0}")]
    Send(SendError),
    /// The client was shut down.
    #[error("client shut down")]
    Closed,
    /// Waiting for a session timed out.
    #[error("no server session within {waited:?}")]
    AttachTimeout {
        /// How long the caller waited.
        waited: Duration,
    },
}

impl ClientError {
    /// A stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            ClientError::NotAttached => "not_attached",
            ClientError::PeerGone { .. } => "peer_gone",
            ClientError::Send(e) => e.error_type(),
            ClientError::Closed => "closed",
            ClientError::AttachTimeout { .. } => "attach_timeout",
        }
    }
}

/// Why [`crate::ShmClient::attach`] failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The configuration is unusable; retrying cannot help.
    #[error(transparent)]
    Config(SegmentError),
    /// No session within the timeout; `last_error` is the last problem seen with the segment
    /// (none: the segment looked fine but the server did not grant a session, e.g. because
    /// another client holds it).
    #[error("no server session within {waited:?} (last error: {})", last_error.as_ref().map_or_else(|| "none".to_string(), |e| e.to_string()))]
    TimedOut {
        /// How long the caller waited.
        waited: Duration,
        /// The last segment error seen, if any.
        last_error: Option<SegmentError>,
    },
}

impl AttachError {
    /// A stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            AttachError::Config(e) => e.error_type(),
            AttachError::TimedOut { .. } => "attach_timeout",
        }
    }
}
