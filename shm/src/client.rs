//! The client side (the front): attaches to the server's segment, sends requests from any
//! number of tokio tasks, and demultiplexes response frames into per-request streams.
//!
//! # Async adapter: a reader thread and per-request channels
//! One dedicated thread per session reads the response ring (spinning briefly, then parking
//! on the segment's futex) and hands each frame to its request's
//! `tokio::sync::mpsc::UnboundedSender`, copying the payload once into `bytes::Bytes`. The
//! copy is not a loss: tonic needs an owned buffer per message anyway, and the copy lets the
//! ring slot be released at once, so one slow gRPC consumer can never hold up the ring for
//! the others. The channels are unbounded so the reader thread never blocks on a slow
//! consumer (head-of-line blocking across streams); the engine's stream lengths bound the
//! memory. The alternative — an eventfd per direction awaited with `AsyncFd` — needs the
//! file descriptor passed between the processes over a Unix socket, costs a `write` system
//! call per wake-up even when the reader is busy, and the crate's benchmark (`benches/echo.rs`,
//! numbers in BENCHMARKS.md) measures the hand-off both ways.
//!
//! Sending never blocks a tokio worker: `start_request` tries to reserve room, and when the
//! ring is full it yields and then sleeps (1 ms steps, tokio's timer granularity) until room
//! appears or the send timeout passes. A full request ring means the engine is overloaded,
//! so this slow path is rare.
//!
//! # Liveness and reattachment
//! A keeper thread publishes the client heartbeat, watches the server's, and runs the attach
//! handshake (see `layout`). When the session is lost — server heartbeat stopped, server
//! closed, session revoked, corrupt response ring — every request in flight gets
//! `Err(ClientError::PeerGone { reason })` at once, new requests get `NotAttached`, and the
//! keeper keeps looking for a live server at the same path: a restarted engine (new
//! generation, new file) is attached by itself, with a new mapping.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc as tokio_mpsc, watch};

use crate::channel::{ConsumerCore, FrameInfo, Producer, Waiter, lock};
use crate::config::ShmConfig;
use crate::error::{AttachError, ClientError, GoneReason, RecvError, SegmentError, SendError};
use crate::frame::{FLAG_LAST, KIND_CANCEL, RESERVED_KIND_MIN};
use crate::layout::{SERVER_CLOSED, offsets};
use crate::segment::{Segment, random_nonzero};
use crate::server::SessionId;

/// A request id, unique for the life of the client (across sessions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId(u64);

impl RequestId {
    /// The raw id as written into frames.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// One response frame, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseChunk {
    /// The frame kind (opaque to this crate).
    pub kind: u16,
    /// The last frame of the stream.
    pub last: bool,
    /// The payload, copied once out of the ring.
    pub payload: Bytes,
}

/// Whether the client has a session right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionState {
    /// No session (not attached yet, or reattaching).
    Detached,
    /// Attached to the server of this generation.
    Attached {
        /// The segment's generation.
        generation: u64,
        /// The session.
        session: SessionId,
    },
}

/// Items of a response stream.
type Item = Result<ResponseChunk, ClientError>;

/// A request waiting for responses.
#[derive(Debug)]
struct Pending {
    /// Where the reader thread delivers its frames.
    tx: tokio_mpsc::UnboundedSender<Item>,
    /// The session it was sent in (frames of other sessions are not its).
    session: u64,
}

/// One attached session: its own mapping of the segment and its request-ring writer.
#[derive(Debug)]
struct ClientSession {
    /// The mapping (kept while any sender holds the session).
    segment: Segment,
    /// Our nonce, granted by the server.
    nonce: u64,
    /// Writes the request ring.
    producer: Producer,
    /// False once the keeper abandons the session; checked by writers under the writer lock.
    alive: AtomicBool,
    /// Set by the reader thread or a writer when they find the server's side corrupt.
    lost: Mutex<Option<GoneReason>>,
}

impl ClientSession {
    fn alive(&self) -> Result<(), SendError> {
        if self.alive.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(SendError::SessionGone)
        }
    }
}

/// Messages to the keeper.
#[derive(Debug)]
enum KeeperMsg {
    /// Look at the session now (the reader found corruption).
    Wake,
    /// Stop.
    Shutdown,
}

/// State shared by the client handles, the keeper and the reader threads.
#[derive(Debug)]
struct ClientCore {
    /// The configuration.
    cfg: ShmConfig,
    /// The attached session, if any.
    current: RwLock<Option<Arc<ClientSession>>>,
    /// Requests waiting for responses, by id.
    pending: Mutex<HashMap<u64, Pending>>,
    /// The next request id.
    next_id: AtomicU64,
    /// Cancellations that found the request ring full: (session, id), retried every tick.
    cancels: Mutex<Vec<(u64, u64)>>,
    /// Connection state for async waiters.
    state_tx: watch::Sender<ConnectionState>,
    /// Connection state for blocking waiters.
    state: Mutex<ConnectionState>,
    /// Signalled on every state change.
    state_changed: Condvar,
    /// The last problem seen with the segment while looking for a server.
    last_error: Mutex<Option<SegmentError>>,
    /// Wakes the keeper early.
    keeper_tx: Mutex<mpsc::Sender<KeeperMsg>>,
    /// Set once at shutdown.
    shutdown: AtomicBool,
}

impl ClientCore {
    fn set_state(&self, state: ConnectionState) {
        *lock(&self.state) = state;
        self.state_changed.notify_all();
        self.state_tx.send_replace(state);
    }

    fn current(&self) -> Option<Arc<ClientSession>> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_current(&self, session: Option<Arc<ClientSession>>) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = session;
    }

    fn wake_keeper(&self) {
        let _ = lock(&self.keeper_tx).send(KeeperMsg::Wake);
    }

    /// Sends a cancel control frame, or queues it when the ring is full right now.
    fn send_cancel(&self, session: u64, id: u64) {
        let Some(current) = self.current().filter(|s| s.nonce == session) else {
            return; // The session is gone; the server dropped the request with it.
        };
        match try_write_cancel(&current, id) {
            Ok(()) => {}
            Err(SendError::Full) => lock(&self.cancels).push((session, id)),
            Err(e) => tracing::debug!(id, cause = %e, "cancel not sent"),
        }
    }

    /// Retries queued cancellations of the current session.
    fn flush_cancels(&self, current: &ClientSession) {
        let mut queue = lock(&self.cancels);
        queue.retain(|&(session, _)| session == current.nonce);
        while let Some(&(_, id)) = queue.first() {
            match try_write_cancel(current, id) {
                Ok(()) => {
                    queue.remove(0);
                }
                Err(SendError::Full) => break,
                Err(_) => {
                    queue.clear();
                    break;
                }
            }
        }
    }

    /// Fails every request of `session` with `error`.
    fn fail_pending(&self, session: u64, error: &ClientError) {
        let mut pending = lock(&self.pending);
        let ids: Vec<u64> = pending
            .iter()
            .filter(|(_, p)| p.session == session)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(p) = pending.remove(&id) {
                let _ = p.tx.send(Err(error.clone()));
            }
        }
    }
}

fn try_write_cancel(session: &ClientSession, id: u64) -> Result<(), SendError> {
    let lock_deadline = Some(Instant::now() + LOCK_WAIT);
    let alive = || session.alive();
    let reservation =
        session
            .producer
            .reserve_with(id, KIND_CANCEL, 0, 0, lock_deadline, None, &alive)?;
    reservation.commit();
    Ok(())
}

/// How long an async sender waits for the process-local writer lock (held only while
/// another sender encodes a frame, i.e. microseconds): long enough to never fail under
/// contention, short enough to bound a tokio worker's block.
const LOCK_WAIT: Duration = Duration::from_millis(100);

/// Tries before a sender facing a full ring starts sleeping instead of yielding.
const YIELDS_BEFORE_SLEEP: u32 = 16;

/// Sleep between attempts when the request ring is full (tokio's timer granularity).
const FULL_RING_SLEEP: Duration = Duration::from_millis(1);

/// The client end of a shared-memory channel (used by the front). Cheap to clone; use it from
/// any number of tokio tasks. It runs (and reattaches by itself) until [`ShmClient::shutdown`]
/// or until every clone is dropped.
#[derive(Debug, Clone)]
pub struct ShmClient {
    /// Shared with every clone; the last one shuts the client down.
    shared: Arc<ClientShared>,
}

/// Owns the keeper thread; shuts the client down when the last handle goes.
#[derive(Debug)]
struct ClientShared {
    /// The state shared with the keeper and reader threads.
    core: Arc<ClientCore>,
    /// The keeper thread, joined at shutdown.
    keeper: Mutex<Option<JoinHandle<()>>>,
}

impl ClientShared {
    fn shutdown(&self) {
        let keeper = lock(&self.keeper).take();
        if let Some(handle) = keeper {
            self.core.shutdown.store(true, Ordering::Release);
            let _ = lock(&self.core.keeper_tx).send(KeeperMsg::Shutdown);
            let _ = handle.join();
        }
    }
}

impl Drop for ClientShared {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl ShmClient {
    /// Starts a client for the segment in `cfg` and returns at once; a keeper thread attaches
    /// in the background (and again after every loss). Fails only on an invalid configuration.
    pub fn connect(cfg: ShmConfig) -> Result<ShmClient, SegmentError> {
        cfg.validate()?;
        let (keeper_tx, keeper_rx) = mpsc::channel();
        let (state_tx, _) = watch::channel(ConnectionState::Detached);
        let core = Arc::new(ClientCore {
            cfg,
            current: RwLock::new(None),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            cancels: Mutex::new(Vec::new()),
            state_tx,
            state: Mutex::new(ConnectionState::Detached),
            state_changed: Condvar::new(),
            last_error: Mutex::new(None),
            keeper_tx: Mutex::new(keeper_tx),
            shutdown: AtomicBool::new(false),
        });
        let keeper_core = core.clone();
        let handle = std::thread::Builder::new()
            .name("zerolayer-shm-client-keeper".into())
            .spawn(move || Keeper::new(keeper_core).run(keeper_rx))
            .map_err(|source| SegmentError::Io {
                op: "spawn keeper thread",
                path: core.cfg.path.clone(),
                source,
            })?;
        Ok(ShmClient {
            shared: Arc::new(ClientShared {
                core,
                keeper: Mutex::new(Some(handle)),
            }),
        })
    }

    /// Connects and waits (blocking the calling thread) up to `timeout` for a session. For
    /// start-up code; in async code use [`ShmClient::connect`] and
    /// [`ShmClient::wait_attached`].
    pub fn attach(cfg: ShmConfig, timeout: Duration) -> Result<ShmClient, AttachError> {
        let client = ShmClient::connect(cfg).map_err(AttachError::Config)?;
        let deadline = Instant::now() + timeout;
        let core = client.core();
        let mut state = lock(&core.state);
        loop {
            if matches!(*state, ConnectionState::Attached { .. }) {
                return Ok(client.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                drop(state);
                client.shutdown();
                let last_error = lock(&core.last_error).take();
                return Err(AttachError::TimedOut {
                    waited: timeout,
                    last_error,
                });
            }
            state = core
                .state_changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn core(&self) -> &ClientCore {
        &self.shared.core
    }

    /// Waits up to `timeout` for a session; returns the server's generation and the session.
    pub async fn wait_attached(&self, timeout: Duration) -> Result<(u64, SessionId), ClientError> {
        let mut rx = self.core().state_tx.subscribe();
        let wait = rx.wait_for(|s| matches!(s, ConnectionState::Attached { .. }));
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(state)) => match *state {
                ConnectionState::Attached {
                    generation,
                    session,
                } => Ok((generation, session)),
                ConnectionState::Detached => Err(ClientError::NotAttached),
            },
            Ok(Err(_)) => Err(ClientError::Closed),
            Err(_) => Err(ClientError::AttachTimeout { waited: timeout }),
        }
    }

    /// The connection state now.
    pub fn state(&self) -> ConnectionState {
        *lock(&self.core().state)
    }

    /// A receiver of connection-state changes (for health reporting).
    pub fn subscribe(&self) -> watch::Receiver<ConnectionState> {
        self.core().state_tx.subscribe()
    }

    /// Takes the last problem seen with the segment while looking for a server (for logs and
    /// health checks: e.g. a header this build cannot use).
    pub fn take_last_error(&self) -> Option<SegmentError> {
        lock(&self.core().last_error).take()
    }

    /// The largest request payload one frame can carry, when attached.
    pub fn max_payload(&self) -> Option<usize> {
        self.core().current().map(|s| s.producer.max_payload())
    }

    /// Sends a request: `write` fills `len` payload bytes in place in the request ring.
    /// Returns its id and the stream of its responses. Fails at once with `NotAttached` when
    /// there is no session, `Send(FrameTooLarge)` when the payload can never fit, and
    /// `Send(Timeout)` when the ring stays full for the configured send timeout. Dropping the
    /// returned stream before its last chunk cancels the request.
    pub async fn start_request<F>(
        &self,
        kind: u16,
        len: usize,
        write: F,
    ) -> Result<(RequestId, ResponseStream), ClientError>
    where
        F: FnOnce(&mut [u8]) + Send,
    {
        let core = &self.shared.core;
        if core.shutdown.load(Ordering::Acquire) {
            return Err(ClientError::Closed);
        }
        if kind >= RESERVED_KIND_MIN {
            return Err(ClientError::Send(SendError::ReservedKind { kind }));
        }
        let session = core.current().ok_or(ClientError::NotAttached)?;
        let max = session.producer.max_payload();
        if len > max {
            return Err(ClientError::Send(SendError::FrameTooLarge { len, max }));
        }
        core.flush_cancels(&session);
        let id = core.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio_mpsc::unbounded_channel();
        lock(&core.pending).insert(
            id,
            Pending {
                tx,
                session: session.nonce,
            },
        );
        // From here on, dropping the stream (also when this future is dropped) cleans up.
        let mut stream = ResponseStream {
            id: RequestId(id),
            rx,
            core: Arc::downgrade(core),
            session: session.nonce,
            finished: false,
        };
        let started = Instant::now();
        let deadline = started + core.cfg.send_timeout;
        let mut write = Some(write);
        let mut attempts = 0u32;
        loop {
            match try_write_request(&session, id, kind, len, &mut write) {
                Ok(()) => return Ok((RequestId(id), stream)),
                Err(SendError::Full) => {
                    let now = Instant::now();
                    if now >= deadline {
                        stream.forget();
                        return Err(ClientError::Send(SendError::Timeout {
                            waited: now - started,
                        }));
                    }
                    attempts += 1;
                    if attempts <= YIELDS_BEFORE_SLEEP {
                        tokio::task::yield_now().await;
                    } else {
                        tokio::time::sleep(FULL_RING_SLEEP).await;
                    }
                }
                Err(SendError::SessionGone) => {
                    stream.forget();
                    return Err(ClientError::NotAttached);
                }
                Err(SendError::Corrupt(e)) => {
                    stream.forget();
                    let reason = GoneReason::Corrupt(e);
                    *lock(&session.lost) = Some(reason.clone());
                    core.wake_keeper();
                    return Err(ClientError::PeerGone { reason });
                }
                Err(e) => {
                    stream.forget();
                    return Err(ClientError::Send(e));
                }
            }
        }
    }

    /// Cancels a request (its caller went away): its stream ends, and a cancel frame tells the
    /// server to stop (sent now, or on the next tick if the request ring is full). Responses
    /// already on their way are dropped. A no-op for finished or unknown ids.
    pub fn cancel(&self, id: RequestId) {
        cancel(self.core(), id.0);
    }

    /// Stops the client: detaches from the server, fails every request in flight with
    /// `ClientError::Closed`. Idempotent.
    pub fn shutdown(&self) {
        self.shared.shutdown();
    }
}

fn cancel(core: &ClientCore, id: u64) {
    let removed = lock(&core.pending).remove(&id);
    if let Some(pending) = removed {
        core.send_cancel(pending.session, id);
    }
}

/// Reserves, encodes and publishes one request frame without waiting for room. Not async:
/// the writer lock guard must not live across an await.
fn try_write_request<F: FnOnce(&mut [u8])>(
    session: &ClientSession,
    id: u64,
    kind: u16,
    len: usize,
    write: &mut Option<F>,
) -> Result<(), SendError> {
    let lock_deadline = Some(Instant::now() + LOCK_WAIT);
    let alive = || session.alive();
    let mut reservation =
        session
            .producer
            .reserve_with(id, kind, 0, len, lock_deadline, None, &alive)?;
    // `reserve_with` succeeded, so this is the one and only call of the closure: every earlier
    // attempt returned before taking it.
    let write = write
        .take()
        .expect("the encoder runs once, on the first successful reservation");
    write(reservation.payload_mut());
    reservation.commit();
    Ok(())
}

/// The responses to one request, in order. Ends (`None`) after the chunk marked `last`, or
/// after an error. Dropping it early cancels the request.
#[derive(Debug)]
pub struct ResponseStream {
    /// The request.
    id: RequestId,
    /// Chunks from the reader thread.
    rx: tokio_mpsc::UnboundedReceiver<Item>,
    /// For cancelling on drop.
    core: Weak<ClientCore>,
    /// The session the request was sent in.
    session: u64,
    /// The stream ended (last chunk, error, or cancel): nothing to cancel on drop.
    finished: bool,
}

impl ResponseStream {
    /// The request id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next chunk; `None` after the last one (or after an error, or a cancel).
    pub async fn next(&mut self) -> Option<Result<ResponseChunk, ClientError>> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// Polls for the next chunk (to implement `Stream` wrappers).
    pub fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<ResponseChunk, ClientError>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                self.finished = chunk.last;
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => {
                self.finished = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                self.finished = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Drops the bookkeeping without sending a cancel (the request never reached the ring).
    fn forget(&mut self) {
        if let Some(core) = self.core.upgrade() {
            lock(&core.pending).remove(&self.id.0);
        }
        self.finished = true;
    }
}

impl Drop for ResponseStream {
    fn drop(&mut self) {
        if !self.finished
            && let Some(core) = self.core.upgrade()
        {
            let removed = lock(&core.pending).remove(&self.id.0);
            if removed.is_some() {
                core.send_cancel(self.session, self.id.0);
            }
        }
    }
}

/// The reader thread of one session: response frames → per-request channels.
fn reader(core: Arc<ClientCore>, session: Arc<ClientSession>, consumer: ConsumerCore) {
    let tick = core.cfg.heartbeat_interval;
    while session.alive.load(Ordering::Acquire) {
        match consumer.poll() {
            Ok(Some(info)) => dispatch(&core, &session, &consumer, info),
            Ok(None) => {
                consumer.wait(
                    &|| !session.alive.load(Ordering::Acquire),
                    Instant::now() + tick,
                );
            }
            Err(RecvError::Corrupt(e)) => {
                tracing::warn!(cause = %e, "shm response ring corrupt");
                *lock(&session.lost) = Some(GoneReason::Corrupt(e));
                core.wake_keeper();
                return;
            }
            Err(_) => return,
        }
    }
}

fn dispatch(core: &ClientCore, session: &ClientSession, consumer: &ConsumerCore, info: FrameInfo) {
    let header = info.header;
    if header.kind == KIND_CANCEL {
        // The server has no business sending control frames; ignore it.
        consumer.release(&info);
        return;
    }
    let payload = Bytes::copy_from_slice(consumer.payload(&info));
    consumer.release(&info);
    let last = header.flags & FLAG_LAST != 0;
    let mut pending = lock(&core.pending);
    match pending.get(&header.id) {
        Some(p) if p.session == session.nonce => {
            // A dropped receiver is a stream being dropped right now; its Drop cleans up.
            let _ = p.tx.send(Ok(ResponseChunk {
                kind: header.kind,
                last,
                payload,
            }));
            if last {
                pending.remove(&header.id);
            }
        }
        _ => tracing::trace!(
            id = header.id,
            "response for a finished or cancelled request dropped"
        ),
    }
}

/// The phases of the keeper's state machine.
#[derive(Debug)]
enum Phase {
    /// No segment: open the path each tick.
    Searching,
    /// A valid segment: wait for its heartbeat to move (a dead server's never does).
    Probing {
        /// The mapped segment.
        segment: Segment,
        /// The server heartbeat last seen.
        beat: u64,
        /// When this phase started.
        since: Instant,
    },
    /// Asking for a session with `nonce`.
    Requesting {
        /// The mapped segment.
        segment: Segment,
        /// The nonce asked with.
        nonce: u64,
        /// Whether the nonce was written to the header yet (only when no session is active).
        written: bool,
        /// When this phase started.
        since: Instant,
        /// The server heartbeat last seen.
        beat: u64,
        /// When the server heartbeat last moved.
        beat_at: Instant,
    },
    /// Attached.
    Attached {
        /// The session.
        session: Arc<ClientSession>,
        /// Its reader thread.
        reader: JoinHandle<()>,
        /// The server heartbeat last seen.
        beat: u64,
        /// When the server heartbeat last moved.
        beat_at: Instant,
    },
}

/// The client keeper: heartbeat, handshake, server liveness, reattachment.
struct Keeper {
    /// The state shared with the keeper and reader threads.
    core: Arc<ClientCore>,
    /// Where the state machine is.
    phase: Phase,
    /// When the previous tick ran (to notice that this thread itself was stalled).
    last_tick: Instant,
}

impl Keeper {
    fn new(core: Arc<ClientCore>) -> Self {
        Keeper {
            core,
            phase: Phase::Searching,
            last_tick: Instant::now(),
        }
    }

    fn run(mut self, rx: mpsc::Receiver<KeeperMsg>) {
        let interval = self.core.cfg.heartbeat_interval;
        loop {
            let phase = std::mem::replace(&mut self.phase, Phase::Searching);
            self.phase = self.step(phase);
            // Look for a server more often than the heartbeat while detached, so attaching
            // takes a few milliseconds after the server is up.
            let tick = match self.phase {
                Phase::Attached { .. } => interval,
                _ => (interval / 5).max(Duration::from_millis(1)),
            };
            match rx.recv_timeout(tick) {
                Ok(KeeperMsg::Wake) | Err(RecvTimeoutError::Timeout) => {}
                Ok(KeeperMsg::Shutdown) | Err(RecvTimeoutError::Disconnected) => break,
            }
            if self.core.shutdown.load(Ordering::Acquire) {
                break;
            }
        }
        match std::mem::replace(&mut self.phase, Phase::Searching) {
            Phase::Attached {
                session, reader, ..
            } => self.abandon(session, reader, GoneReason::Shutdown),
            Phase::Requesting {
                segment,
                nonce,
                written: true,
                ..
            } => {
                let _ = segment.field(offsets::CLIENT_NONCE).compare_exchange(
                    nonce,
                    0,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            _ => {}
        }
        // Anything registered after the last session was abandoned.
        let mut pending = lock(&self.core.pending);
        for (_, p) in pending.drain() {
            let _ = p.tx.send(Err(ClientError::Closed));
        }
    }

    fn record_error(&self, error: SegmentError) {
        let mut last = lock(&self.core.last_error);
        let changed = last
            .as_ref()
            .is_none_or(|e| e.to_string() != error.to_string());
        if changed {
            tracing::debug!(cause = %error, "shm segment not usable yet");
        }
        *last = Some(error);
    }

    fn step(&mut self, phase: Phase) -> Phase {
        let now = Instant::now();
        let liveness = self.core.cfg.liveness_timeout;
        let self_stalled =
            now.duration_since(self.last_tick) > self.core.cfg.heartbeat_interval * 3;
        self.last_tick = now;
        match phase {
            Phase::Searching => match Segment::open(&self.core.cfg.path) {
                Ok(segment) => {
                    if segment
                        .field32(offsets::SERVER_STATE)
                        .load(Ordering::Acquire)
                        == SERVER_CLOSED
                    {
                        return Phase::Searching;
                    }
                    let beat = segment
                        .field(offsets::SERVER_HEARTBEAT)
                        .load(Ordering::Acquire);
                    Phase::Probing {
                        segment,
                        beat,
                        since: now,
                    }
                }
                Err(e) => {
                    self.record_error(e);
                    Phase::Searching
                }
            },
            Phase::Probing {
                segment,
                beat,
                since,
            } => {
                if segment
                    .field32(offsets::SERVER_STATE)
                    .load(Ordering::Acquire)
                    == SERVER_CLOSED
                {
                    return Phase::Searching;
                }
                let now_beat = segment
                    .field(offsets::SERVER_HEARTBEAT)
                    .load(Ordering::Acquire);
                if now_beat != beat {
                    let nonce = match random_nonzero() {
                        Ok(nonce) => nonce,
                        Err(source) => {
                            self.record_error(SegmentError::Io {
                                op: "getrandom",
                                path: self.core.cfg.path.clone(),
                                source,
                            });
                            return Phase::Searching;
                        }
                    };
                    return Phase::Requesting {
                        segment,
                        nonce,
                        written: false,
                        since: now,
                        beat: now_beat,
                        beat_at: now,
                    };
                }
                if now.duration_since(since) > liveness && !self_stalled {
                    return Phase::Searching; // a stale segment of a dead server
                }
                Phase::Probing {
                    segment,
                    beat,
                    since: if self_stalled { now } else { since },
                }
            }
            Phase::Requesting {
                segment,
                nonce,
                mut written,
                since,
                mut beat,
                mut beat_at,
            } => {
                // Beat only once our nonce is written: while another session is still granted
                // (a front killed a moment ago), a beat from us would keep that dead session
                // alive in the server's eyes and it would never be released.
                if written {
                    segment
                        .field(offsets::CLIENT_HEARTBEAT)
                        .fetch_add(1, Ordering::Release);
                }
                let give_up = |segment: Segment, written: bool| {
                    if written {
                        let _ = segment.field(offsets::CLIENT_NONCE).compare_exchange(
                            nonce,
                            0,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        );
                    }
                    Phase::Searching
                };
                let now_beat = segment
                    .field(offsets::SERVER_HEARTBEAT)
                    .load(Ordering::Acquire);
                if now_beat != beat || self_stalled {
                    beat = now_beat;
                    beat_at = now;
                }
                if segment
                    .field32(offsets::SERVER_STATE)
                    .load(Ordering::Acquire)
                    == SERVER_CLOSED
                    || now.duration_since(beat_at) > liveness
                {
                    return give_up(segment, written);
                }
                let granted = segment.field(offsets::SESSION).load(Ordering::Acquire);
                if written && granted == nonce {
                    return self.attach(segment, nonce, beat, now);
                }
                if !written && granted == 0 {
                    segment
                        .field(offsets::CLIENT_NONCE)
                        .store(nonce, Ordering::Release);
                    segment
                        .field(offsets::CLIENT_HEARTBEAT)
                        .fetch_add(1, Ordering::Release);
                    written = true;
                }
                if now.duration_since(since) > self.core.cfg.attach_timeout {
                    tracing::debug!(path = %segment.path().display(), "shm server did not grant a session; retrying");
                    return give_up(segment, written);
                }
                Phase::Requesting {
                    segment,
                    nonce,
                    written,
                    since,
                    beat,
                    beat_at,
                }
            }
            Phase::Attached {
                session,
                reader,
                mut beat,
                mut beat_at,
            } => {
                let segment = &session.segment;
                segment
                    .field(offsets::CLIENT_HEARTBEAT)
                    .fetch_add(1, Ordering::Release);
                self.core.flush_cancels(&session);
                let now_beat = segment
                    .field(offsets::SERVER_HEARTBEAT)
                    .load(Ordering::Acquire);
                if now_beat != beat || self_stalled {
                    beat = now_beat;
                    beat_at = now;
                }
                let lost = lock(&session.lost).take();
                let reason = if let Some(reason) = lost {
                    Some(reason)
                } else if segment
                    .field32(offsets::SERVER_STATE)
                    .load(Ordering::Acquire)
                    == SERVER_CLOSED
                {
                    Some(GoneReason::ServerClosed)
                } else if segment.field(offsets::SESSION).load(Ordering::Acquire) != session.nonce {
                    Some(GoneReason::Revoked)
                } else if now.duration_since(beat_at) > liveness {
                    Some(GoneReason::HeartbeatTimeout)
                } else {
                    None
                };
                match reason {
                    Some(reason) => {
                        self.abandon(session, reader, reason);
                        Phase::Searching
                    }
                    None => Phase::Attached {
                        session,
                        reader,
                        beat,
                        beat_at,
                    },
                }
            }
        }
    }

    /// Starts a session on a granted segment.
    fn attach(&mut self, segment: Segment, nonce: u64, beat: u64, now: Instant) -> Phase {
        let cfg = &self.core.cfg;
        let waiter = Waiter {
            strategy: cfg.wait,
            tick: cfg.heartbeat_interval,
        };
        let producer = Producer::new(segment.request_ring(), waiter);
        let consumer = ConsumerCore::new(segment.response_ring(), waiter);
        let generation = segment.layout().generation;
        let session = Arc::new(ClientSession {
            segment,
            nonce,
            producer,
            alive: AtomicBool::new(true),
            lost: Mutex::new(None),
        });
        let reader_core = self.core.clone();
        let reader_session = session.clone();
        let spawned = std::thread::Builder::new()
            .name("zerolayer-shm-client-reader".into())
            .spawn(move || reader(reader_core, reader_session, consumer));
        let reader = match spawned {
            Ok(handle) => handle,
            Err(source) => {
                self.record_error(SegmentError::Io {
                    op: "spawn reader thread",
                    path: cfg.path.clone(),
                    source,
                });
                let _ = session
                    .segment
                    .field(offsets::CLIENT_NONCE)
                    .compare_exchange(nonce, 0, Ordering::AcqRel, Ordering::Acquire);
                return Phase::Searching;
            }
        };
        lock(&self.core.last_error).take();
        self.core.set_current(Some(session.clone()));
        let session_id = SessionId(nonce);
        self.core.set_state(ConnectionState::Attached {
            generation,
            session: session_id,
        });
        tracing::info!(
            path = %session.segment.path().display(), generation, session = %session_id,
            "shm client attached"
        );
        Phase::Attached {
            session,
            reader,
            beat,
            beat_at: now,
        }
    }

    /// Ends a session: no new sends, in-progress sends finished, reader stopped, the server
    /// told (detach), every request of the session failed.
    fn abandon(&mut self, session: Arc<ClientSession>, reader: JoinHandle<()>, reason: GoneReason) {
        self.core.set_current(None);
        self.core.set_state(ConnectionState::Detached);
        session.alive.store(false, Ordering::Release);
        session.segment.response_ring().wake_all();
        session.producer.quiesce(|| ());
        let _ = reader.join();
        let _ = session
            .segment
            .field(offsets::CLIENT_NONCE)
            .compare_exchange(session.nonce, 0, Ordering::AcqRel, Ordering::Acquire);
        let error = match reason {
            GoneReason::Shutdown => ClientError::Closed,
            ref reason => ClientError::PeerGone {
                reason: reason.clone(),
            },
        };
        self.core.fail_pending(session.nonce, &error);
        lock(&self.core.cancels).retain(|&(s, _)| s != session.nonce);
        match &reason {
            GoneReason::Shutdown => {
                tracing::info!(session = %SessionId(session.nonce), "shm client detached")
            }
            _ => tracing::warn!(
                session = %SessionId(session.nonce), cause = %reason,
                "shm server session lost; reattaching"
            ),
        }
    }
}

/// Compile-time checks: the handles and the request future cross threads (tonic's handlers
/// need `Send` futures and streams).
#[allow(dead_code, reason = "only type-checked")]
fn _thread_safety(client: &ShmClient) {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<ShmClient>();
    send_sync::<crate::ShmServer>();
    send_sync::<crate::channel::Producer>();
    fn send_only<T: Send>() {}
    send_only::<ResponseStream>();
    send_only::<crate::RequestReceiver>();
    send_only::<crate::channel::Consumer>();
    let future = client.start_request(1, 0, |_| {});
    send(&future);
}
