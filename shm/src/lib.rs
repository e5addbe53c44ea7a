//! Shared-memory channel between the front and the engine.
//!
//! The engine creates one segment (a file under `/dev/shm`, or any path on a tmpfs shared
//! between containers) and serves it with [`ShmServer`]; the front maps it with
//! [`ShmClient`]. Requests travel in one ring, responses in another, as variable-size frames
//! `(request id, kind, payload)` written in place by the sender and borrowed in place by the
//! receiver. Both sides publish heartbeats; a dead peer is noticed within the liveness bound
//! (≤ 450 ms by default), the front fails its in-flight requests and reattaches to a
//! restarted engine by itself, and the engine drops a dead front's requests and waits for the
//! next one.
//!
//! # Use
//! ```no_run
//! use std::time::Duration;
//! use zerolayer_shm::{Incoming, ShmClient, ShmConfig, ShmServer};
//!
//! /// The engine: one thread receives; any thread may send.
//! fn engine() -> Result<(), Box<dyn std::error::Error>> {
//!     let (server, mut requests) = ShmServer::create(ShmConfig::new("zerolayer")?)?;
//!     loop {
//!         match requests.recv()? {
//!             Incoming::Request(frame) => {
//!                 let key = frame.key();
//!                 let body = frame.payload().to_vec(); // or decode in place, then drop
//!                 drop(frame); // releases its room in the ring
//!                 // ... later, from the thread that produces tokens:
//!                 server.send(key, 2, true, body.len(), |buf| buf.copy_from_slice(&body))?;
//!             }
//!             Incoming::Cancel(_key) => { /* stop generating for it */ }
//!             Incoming::ClientAttached(_session) => {}
//!             Incoming::ClientGone { in_flight: _, .. } => { /* drop all of them */ }
//!         }
//!     }
//! }
//!
//! /// The front, inside tokio.
//! async fn front() -> Result<(), Box<dyn std::error::Error>> {
//!     let client = ShmClient::connect(ShmConfig::new("zerolayer")?)?;
//!     client.wait_attached(Duration::from_secs(5)).await?;
//!     let (_id, mut stream) = client.start_request(1, 5, |buf| buf.copy_from_slice(b"hello")).await?;
//!     while let Some(chunk) = stream.next().await {
//!         let chunk = chunk?; // Err(PeerGone) when the engine dies: map to UNAVAILABLE
//!         if chunk.last {
//!             break;
//!         }
//!     }
//!     Ok(())
//! }
//! # fn main() {}
//! ```
//!
//! # Layout
//! - `config`: [`ShmConfig`], [`WaitStrategy`], every default and limit as a named constant.
//! - `error`: the typed errors of each layer.
//! - `frame`: the 16-byte frame header; reserved kinds ([`KIND_CANCEL`]); [`FLAG_LAST`].
//! - `ring`: pure index arithmetic (plan a write, validate a read) and an offline ring image;
//!   property-tested against a model, run under Miri, fuzzed.
//! - `layout`: the segment header (offsets table and handshake in its docs) and its validation.
//! - `region` (private): the only `unsafe` — a mapping or heap block handing out atomics and
//!   protocol-exclusive byte slices; futex wrappers.
//! - `channel`: the blocking low-level ring ends [`channel::Producer`] / [`channel::Consumer`].
//! - `segment` (private): race-free creation, opening and validation of the segment file.
//! - `server`: [`ShmServer`] (cloneable sender of responses) + [`RequestReceiver`] (the one
//!   reader of requests and session events) — engine side.
//! - `client`: [`ShmClient`] + [`ResponseStream`] (front side, async).
//! - `raw`: unvalidated word access, for tests that play a hostile peer.
//!
//! # Frames and kinds
//! Kinds `0..0xFF00` belong to the services and are opaque here; `0xFF00..=0xFFFF` are
//! reserved for the crate's control frames ([`KIND_CANCEL`], and an internal padding
//! marker). Senders get `SendError::ReservedKind` for them; a reserved kind other than a
//! well-formed cancel read from a ring is corruption. The last response of a request carries
//! [`FLAG_LAST`] (a header flag, so kinds stay opaque). A frame never straddles the ring's
//! end (a padding marker skips it), so a payload is one contiguous slice; the price is that a
//! payload may be at most half a ring ([`max_payload_for_ring`]); larger is
//! `SendError::FrameTooLarge`.
//!
//! # Invariants
//! - **Nothing read from the segment is trusted**: every index, length, id, kind and flag the
//!   peer can write is read once (atomically) into a local and validated; a violation is a
//!   typed error that breaks that session, never a panic or undefined behaviour.
//! - **Each side's own indices are authoritative locally**: the shared copy is only stored to.
//! - **No pointers and no locks in shared memory**: offsets only; writers of one process are
//!   serialized by a process-local lock; futex words are plain `AtomicU32`s in the segment.
//! - **Every wait is bounded** (by its timeout, and each sleep by one heartbeat interval), so
//!   a dead or hostile peer costs latency, never a hang.
//! - **A response can only reach the session its request came from**: the server addresses
//!   responses by [`RequestKey`] (session + id) and resets both rings for each new session.
//!
//! # Limits of the trust model
//! A peer with write access to the file can also truncate it, which makes this process take
//! SIGBUS on its next access; that is outside what a mapping can defend against. Restrict the
//! file's permissions ([`ShmConfig::file_mode`]) to the two services. A hostile peer can also
//! rewrite payload bytes while they are borrowed; the crate never derives a memory access from
//! payload bytes, so that yields garbage payloads, not unsafety (see the `region` module docs).
//!
//! # Containers
//! Works between two containers sharing an IPC namespace (`/dev/shm`) or a tmpfs mount (use an
//! absolute path): futexes on a shared file mapping, `flock` and `rename` all work across
//! PID namespaces, and nothing relies on PIDs or clocks being comparable between the peers
//! (heartbeats are counters observed with the watcher's own clock).

pub mod channel;
mod client;
pub mod config;
pub mod error;
pub mod frame;
pub mod layout;
pub mod raw;
mod region;
pub mod ring;
mod segment;
mod server;

pub use client::{ConnectionState, RequestId, ResponseChunk, ResponseStream, ShmClient};
pub use config::{ShmConfig, WaitStrategy, max_payload_for_ring};
pub use error::{
    AttachError, ClientError, FrameError, GoneReason, HeaderError, ProtocolError, RecvError,
    SegmentError, SendError,
};
pub use frame::{FLAG_LAST, KIND_CANCEL, RESERVED_KIND_MIN};
pub use server::{Incoming, RequestFrame, RequestKey, RequestReceiver, SessionId, ShmServer};
