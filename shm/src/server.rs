//! The server side (the engine): creates the segment, grants sessions to one client at a
//! time, receives request frames and sends response frames.
//!
//! A keeper thread publishes the heartbeat, grants sessions, and watches the client: when
//! the client's heartbeat stops, it detaches, or a ring it writes is corrupt, the session ends
//! — the receiver gets [`Incoming::ClientGone`] with every request still in flight — and the
//! server keeps running, ready for the next client.

use std::collections::{HashSet, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::channel::{ConsumerCore, FrameInfo, Producer, Waiter, lock};
use crate::config::ShmConfig;
use crate::error::{GoneReason, ProtocolError, RecvError, SegmentError, SendError};
use crate::frame::{FLAG_LAST, KIND_CANCEL, RESERVED_KIND_MIN};
use crate::layout::{SERVER_CLOSED, offsets};
use crate::segment::Segment;

/// A client session: the non-zero nonce the client asked with and the server granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionId(pub(crate) u64);

impl SessionId {
    /// The raw value (for logs).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A request as the server sees it: the client's request id within a session. Responses are
/// addressed by key, so a response for a session that has ended can never reach a later
/// client (which may reuse ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestKey {
    /// The session the request arrived in.
    pub session: SessionId,
    /// The client's request id (unique within the session).
    pub id: u64,
}

/// What the server's receiver yields.
#[derive(Debug)]
pub enum Incoming<'a> {
    /// A request frame, borrowed in place (release it by dropping it).
    Request(RequestFrame<'a>),
    /// The client cancelled a request that is in flight (its gRPC caller went away). Stop
    /// working on it; further responses to it are dropped by the client.
    Cancel(RequestKey),
    /// A client attached: a new session starts, with empty rings.
    ClientAttached(SessionId),
    /// A session ended; `in_flight` lists its requests that had not been finished (sent with
    /// `last`) or cancelled: drop them all. The server keeps running.
    ClientGone {
        /// The session that ended.
        session: SessionId,
        /// Why it ended.
        reason: GoneReason,
        /// Its unfinished requests.
        in_flight: Vec<RequestKey>,
    },
}

/// A request frame borrowed from the request ring. Hold it only while decoding (copy out what
/// must outlive that): its room in the ring is released on drop, and a new client session
/// cannot start while a frame of the previous one is still borrowed.
#[derive(Debug)]
pub struct RequestFrame<'a> {
    /// The request ring it is borrowed from.
    consumer: &'a ConsumerCore,
    /// Where the frame is and how to release it.
    info: FrameInfo,
    /// The session it arrived in.
    session: SessionId,
}

impl RequestFrame<'_> {
    /// The key to address responses with.
    pub fn key(&self) -> RequestKey {
        RequestKey {
            session: self.session,
            id: self.info.header.id,
        }
    }

    /// The request kind (opaque to this crate).
    pub fn kind(&self) -> u16 {
        self.info.header.kind
    }

    /// The payload, in place in the ring.
    pub fn payload(&self) -> &[u8] {
        self.consumer.payload(&self.info)
    }
}

impl Drop for RequestFrame<'_> {
    fn drop(&mut self) {
        self.consumer.release(&self.info);
    }
}

/// Session bookkeeping (process-local).
#[derive(Debug)]
enum SessionState {
    /// No client. `last_ended` is the nonce of the session that ended last: a dead client's
    /// nonce stays in the header, and must not be granted again.
    Idle { last_ended: u64 },
    /// A client is attached.
    Active {
        /// Its nonce.
        session: u64,
        /// Requests received and neither finished nor cancelled.
        in_flight: HashSet<u64>,
    },
}

/// Events produced outside the request ring (by the keeper or by session ends).
#[derive(Debug)]
enum Event {
    /// A client was granted this session.
    Attached(u64),
    /// A session ended.
    Gone {
        /// The session that ended.
        session: u64,
        /// Why.
        reason: GoneReason,
        /// Its unfinished requests.
        in_flight: Vec<u64>,
    },
}

/// State shared by the server handles, the receiver and the keeper.
#[derive(Debug)]
struct ServerCore {
    /// The configuration (timeouts, limits).
    cfg: ShmConfig,
    /// The mapped segment (holds the file lock that marks it as served).
    segment: Segment,
    /// Writes the response ring.
    producer: Producer,
    /// Reads the request ring (shared with the keeper, which resets it for a new session).
    consumer: Arc<ConsumerCore>,
    /// Session bookkeeping.
    state: Mutex<SessionState>,
    /// The active session's nonce, 0 for none: the lock-free check senders make.
    active: AtomicU64,
    /// Events for the receiver, in order.
    events: Mutex<VecDeque<Event>>,
    /// True while `events` is non-empty (checked in the receiver's spin loop without locking).
    has_events: AtomicBool,
    /// Set once at shutdown.
    shutdown: AtomicBool,
}

impl ServerCore {
    fn push_event(&self, event: Event) {
        let mut events = lock(&self.events);
        events.push_back(event);
        self.has_events.store(true, Ordering::Release);
        drop(events);
        self.consumer.ring().wake_all();
    }

    fn pop_event(&self) -> Option<Event> {
        let mut events = lock(&self.events);
        let event = events.pop_front();
        if events.is_empty() {
            self.has_events.store(false, Ordering::Release);
        }
        event
    }

    /// Ends `session` if it is still the active one.
    fn end_session(&self, session: u64, reason: GoneReason) {
        let in_flight = {
            let mut st = lock(&self.state);
            match &mut *st {
                SessionState::Active {
                    session: s,
                    in_flight,
                } if *s == session => {
                    let in_flight: Vec<u64> = in_flight.drain().collect();
                    *st = SessionState::Idle {
                        last_ended: session,
                    };
                    in_flight
                }
                _ => return,
            }
        };
        self.active.store(0, Ordering::Release);
        self.segment
            .field(offsets::SESSION)
            .store(0, Ordering::Release);
        match &reason {
            GoneReason::Corrupt(_) | GoneReason::Protocol(_) => tracing::warn!(
                session = %SessionId(session), cause = %reason, in_flight = in_flight.len(),
                "shm client session ended"
            ),
            _ => tracing::info!(
                session = %SessionId(session), cause = %reason, in_flight = in_flight.len(),
                "shm client session ended"
            ),
        }
        self.push_event(Event::Gone {
            session,
            reason,
            in_flight,
        });
        // Senders blocked on a full response ring notice the session change.
        self.producer.ring().wake_all();
    }

    /// Grants `nonce` a session if the server is idle and both rings can be reset now (no
    /// send in progress, no request frame borrowed); otherwise the keeper retries next tick.
    fn try_grant(&self, nonce: u64) -> bool {
        let mut st = lock(&self.state);
        let SessionState::Idle { last_ended } = *st else {
            return false;
        };
        if nonce == 0 || nonce == last_ended {
            return false;
        }
        if !self.producer.try_reset() || !self.consumer.try_reset() {
            return false;
        }
        *st = SessionState::Active {
            session: nonce,
            in_flight: HashSet::new(),
        };
        self.active.store(nonce, Ordering::Release);
        drop(st);
        self.push_event(Event::Attached(nonce));
        self.segment
            .field(offsets::SESSION)
            .store(nonce, Ordering::Release);
        tracing::info!(session = %SessionId(nonce), path = %self.segment.path().display(), "shm client attached");
        true
    }
}

/// The server end of a shared-memory channel (used by the engine). Cheap to clone; any
/// number of threads may send responses. The server runs until [`ShmServer::shutdown`] or
/// until every clone and the [`RequestReceiver`] are dropped.
#[derive(Debug, Clone)]
pub struct ShmServer {
    /// Shared with every clone and the receiver; the last one shuts the server down.
    shared: Arc<ServerShared>,
}

/// Owns the keeper; shuts the server down when the last handle goes.
#[derive(Debug)]
struct ServerShared {
    /// The state shared with the keeper.
    core: Arc<ServerCore>,
    /// Dropping the sender stops the keeper; the handle joins it.
    keeper: Mutex<Option<(mpsc::Sender<()>, JoinHandle<()>)>>,
}

impl ServerShared {
    fn shutdown(&self) {
        let keeper = lock(&self.keeper).take();
        if let Some((stop, handle)) = keeper {
            self.core.shutdown.store(true, Ordering::Release);
            drop(stop);
            // The keeper only sleeps for one heartbeat interval at a time.
            let _ = handle.join();
        }
    }
}

impl Drop for ServerShared {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Receives requests, cancellations and session events. There is one per server
/// (`&mut self`: one reader).
#[derive(Debug)]
pub struct RequestReceiver {
    /// Shared with every clone and the receiver; the last one shuts the server down.
    shared: Arc<ServerShared>,
}

impl ShmServer {
    /// Creates the segment (replacing a stale one left by a dead server; `InUse` if a live
    /// server owns it) and starts serving. Returns the sending handle and the receiver.
    pub fn create(cfg: ShmConfig) -> Result<(ShmServer, RequestReceiver), SegmentError> {
        let segment = Segment::create(&cfg)?;
        let waiter = Waiter {
            strategy: cfg.wait,
            tick: cfg.heartbeat_interval,
        };
        let producer = Producer::new(segment.response_ring(), waiter);
        let consumer = Arc::new(ConsumerCore::new(segment.request_ring(), waiter));
        let generation = segment.layout().generation;
        let core = Arc::new(ServerCore {
            cfg,
            segment,
            producer,
            consumer,
            state: Mutex::new(SessionState::Idle { last_ended: 0 }),
            active: AtomicU64::new(0),
            events: Mutex::new(VecDeque::new()),
            has_events: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
        });
        let (stop, stopped) = mpsc::channel();
        let keeper_core = core.clone();
        let handle = std::thread::Builder::new()
            .name("zerolayer-shm-server-keeper".into())
            .spawn(move || keeper(keeper_core, stopped))
            .map_err(|source| SegmentError::Io {
                op: "spawn keeper thread",
                path: core.segment.path().to_path_buf(),
                source,
            })?;
        tracing::info!(path = %core.segment.path().display(), generation, "shm segment created");
        let shared = Arc::new(ServerShared {
            core,
            keeper: Mutex::new(Some((stop, handle))),
        });
        Ok((
            ShmServer {
                shared: shared.clone(),
            },
            RequestReceiver { shared },
        ))
    }

    fn core(&self) -> &ServerCore {
        &self.shared.core
    }

    /// The segment's generation (new for every server start).
    pub fn generation(&self) -> u64 {
        self.core().segment.layout().generation
    }

    /// The segment path.
    pub fn path(&self) -> &Path {
        self.core().segment.path()
    }

    /// The attached client's session, if any.
    pub fn session(&self) -> Option<SessionId> {
        match self.core().active.load(Ordering::Acquire) {
            0 => None,
            s => Some(SessionId(s)),
        }
    }

    /// The largest response payload one frame can carry.
    pub fn max_payload(&self) -> usize {
        self.core().producer.max_payload()
    }

    /// Sends a response frame for `key`, waiting up to the configured `send_timeout` for room.
    /// `write` fills `len` bytes in place. `last` ends the request's stream (and its
    /// in-flight bookkeeping). Fails with `SessionGone` once the request's session has ended.
    pub fn send(
        &self,
        key: RequestKey,
        kind: u16,
        last: bool,
        len: usize,
        write: impl FnOnce(&mut [u8]),
    ) -> Result<(), SendError> {
        self.send_timeout(key, kind, last, len, write, self.core().cfg.send_timeout)
    }

    /// [`ShmServer::send`] with an explicit timeout.
    pub fn send_timeout(
        &self,
        key: RequestKey,
        kind: u16,
        last: bool,
        len: usize,
        write: impl FnOnce(&mut [u8]),
        timeout: Duration,
    ) -> Result<(), SendError> {
        self.send_inner(key, kind, last, len, write, Some(Instant::now() + timeout))
    }

    /// Sends only if there is room right now (`SendError::Full` otherwise; `write` is then
    /// not called).
    pub fn try_send(
        &self,
        key: RequestKey,
        kind: u16,
        last: bool,
        len: usize,
        write: impl FnOnce(&mut [u8]),
    ) -> Result<(), SendError> {
        self.send_inner(key, kind, last, len, write, None)
    }

    fn send_inner(
        &self,
        key: RequestKey,
        kind: u16,
        last: bool,
        len: usize,
        write: impl FnOnce(&mut [u8]),
        deadline: Option<Instant>,
    ) -> Result<(), SendError> {
        let core = self.core();
        if kind >= RESERVED_KIND_MIN {
            return Err(SendError::ReservedKind { kind });
        }
        let alive = || {
            if core.shutdown.load(Ordering::Acquire) {
                Err(SendError::Shutdown)
            } else if core.active.load(Ordering::Acquire) != key.session.0 {
                Err(SendError::SessionGone)
            } else {
                Ok(())
            }
        };
        let flags = if last { FLAG_LAST } else { 0 };
        match core
            .producer
            .reserve(key.id, kind, flags, len, deadline, &alive)
        {
            Ok(mut reservation) => {
                write(reservation.payload_mut());
                reservation.commit();
            }
            Err(SendError::Corrupt(e)) => {
                core.end_session(key.session.0, GoneReason::Corrupt(e.clone()));
                return Err(SendError::Corrupt(e));
            }
            Err(e) => return Err(e),
        }
        if last {
            let mut st = lock(&core.state);
            if let SessionState::Active { session, in_flight } = &mut *st
                && *session == key.session.0
            {
                in_flight.remove(&key.id);
            }
        }
        Ok(())
    }

    /// Stops serving: marks the segment closed (the client notices at once), ends the
    /// session, and removes the segment file if configured. Idempotent.
    pub fn shutdown(&self) {
        self.shared.shutdown();
    }
}

impl RequestReceiver {
    /// Waits for the next request, cancellation or session event; `Err(RecvError::Shutdown)`
    /// once the server shut down. For an engine loop that has nothing else to do.
    pub fn recv(&mut self) -> Result<Incoming<'_>, RecvError> {
        match self.recv_until(None)? {
            Some(incoming) => Ok(incoming),
            // `recv_until(None)` only returns with something or an error.
            None => Err(RecvError::Shutdown),
        }
    }

    /// Waits up to `timeout` for the next request, cancellation or session event. `Ok(None)`:
    /// nothing within the timeout. `Err(RecvError::Shutdown)` once the server shut down.
    /// Problems caused by the client (a corrupt ring, a protocol violation) end its session and
    /// arrive as [`Incoming::ClientGone`] with the typed reason; they are not errors of the
    /// server.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Incoming<'_>>, RecvError> {
        let deadline = Instant::now().checked_add(timeout);
        match deadline {
            Some(deadline) => self.recv_until(Some(deadline)),
            None => self.recv_until(None),
        }
    }

    /// Returns the next request, cancellation or event if one is ready now.
    pub fn try_recv(&mut self) -> Result<Option<Incoming<'_>>, RecvError> {
        self.recv_timeout(Duration::ZERO)
    }

    /// The receive loop; `deadline: None` waits until something arrives.
    fn recv_until(&mut self, deadline: Option<Instant>) -> Result<Option<Incoming<'_>>, RecvError> {
        let core = &*self.shared.core;
        let tick = core.cfg.heartbeat_interval;
        loop {
            if core.shutdown.load(Ordering::Acquire) {
                return Err(RecvError::Shutdown);
            }
            if let Some(event) = core.pop_event() {
                return Ok(Some(match event {
                    Event::Attached(s) => Incoming::ClientAttached(SessionId(s)),
                    Event::Gone {
                        session,
                        reason,
                        in_flight,
                    } => Incoming::ClientGone {
                        session: SessionId(session),
                        reason,
                        in_flight: in_flight
                            .into_iter()
                            .map(|id| RequestKey {
                                session: SessionId(session),
                                id,
                            })
                            .collect(),
                    },
                }));
            }
            let session = core.active.load(Ordering::Acquire);
            if session != 0 {
                match core.consumer.poll() {
                    Ok(Some(info)) => {
                        if let Some(incoming) = self.admit(session, info) {
                            return Ok(Some(incoming));
                        }
                        continue;
                    }
                    Ok(None) | Err(RecvError::Broken) => {}
                    Err(RecvError::Corrupt(e)) => {
                        core.end_session(session, GoneReason::Corrupt(e));
                        continue;
                    }
                    Err(RecvError::Shutdown) => return Err(RecvError::Shutdown),
                }
            }
            let now = Instant::now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Ok(None);
            }
            core.consumer.wait(
                &|| {
                    core.has_events.load(Ordering::Acquire)
                        || core.shutdown.load(Ordering::Acquire)
                        || core.active.load(Ordering::Acquire) != session
                },
                deadline.unwrap_or(now + tick),
            );
        }
    }

    /// Books a polled frame of `session`; `None` when it was consumed here (a cancellation of
    /// a request no longer in flight, a frame of a session that just ended, a protocol
    /// violation that ended the session).
    fn admit(&self, session: u64, info: FrameInfo) -> Option<Incoming<'_>> {
        let core = &*self.shared.core;
        let id = info.header.id;
        let key = RequestKey {
            session: SessionId(session),
            id,
        };
        if info.header.kind == KIND_CANCEL {
            core.consumer.release(&info);
            let mut st = lock(&core.state);
            return match &mut *st {
                SessionState::Active {
                    session: s,
                    in_flight,
                } if *s == session => in_flight.remove(&id).then_some(Incoming::Cancel(key)),
                _ => None,
            };
        }
        let verdict = {
            let mut st = lock(&core.state);
            match &mut *st {
                SessionState::Active {
                    session: s,
                    in_flight,
                } if *s == session => {
                    if in_flight.len() >= core.cfg.max_in_flight {
                        Err(Some(ProtocolError::TooManyInFlight {
                            limit: core.cfg.max_in_flight,
                        }))
                    } else if !in_flight.insert(id) {
                        Err(Some(ProtocolError::DuplicateRequestId { id }))
                    } else {
                        Ok(())
                    }
                }
                _ => Err(None),
            }
        };
        match verdict {
            Ok(()) => Some(Incoming::Request(RequestFrame {
                consumer: &core.consumer,
                info,
                session: key.session,
            })),
            Err(violation) => {
                core.consumer.release(&info);
                if let Some(violation) = violation {
                    core.end_session(session, GoneReason::Protocol(violation));
                }
                None
            }
        }
    }
}

/// The keeper: heartbeat, session grants, client liveness.
fn keeper(core: Arc<ServerCore>, stop: mpsc::Receiver<()>) {
    let interval = core.cfg.heartbeat_interval;
    let liveness = core.cfg.liveness_timeout;
    let heartbeat = core.segment.field(offsets::SERVER_HEARTBEAT);
    let nonce_field = core.segment.field(offsets::CLIENT_NONCE);
    let client_heartbeat = core.segment.field(offsets::CLIENT_HEARTBEAT);
    let mut last_tick = Instant::now();
    // (session, last client heartbeat value seen, when it last changed)
    let mut watch: Option<(u64, u64, Instant)> = None;
    loop {
        heartbeat.fetch_add(1, Ordering::Release);
        match stop.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
        }
        let now = Instant::now();
        // If this thread itself was descheduled for several intervals, the client's silence
        // over that time proves nothing: restart the observation.
        let self_stalled = now.duration_since(last_tick) > interval * 3;
        last_tick = now;
        let requested = nonce_field.load(Ordering::Acquire);
        let beat = client_heartbeat.load(Ordering::Acquire);
        let active = core.active.load(Ordering::Acquire);
        if active != 0 {
            if requested != active {
                core.end_session(active, GoneReason::Detached);
                watch = None;
                continue;
            }
            match watch {
                Some((s, seen, since)) if s == active => {
                    if seen != beat || self_stalled {
                        watch = Some((s, beat, now));
                    } else if now.duration_since(since) > liveness {
                        core.end_session(active, GoneReason::HeartbeatTimeout);
                        watch = None;
                    }
                }
                _ => watch = Some((active, beat, now)),
            }
        } else if requested != 0 && core.try_grant(requested) {
            watch = Some((requested, beat, now));
        }
    }
    core.segment
        .field32(offsets::SERVER_STATE)
        .store(SERVER_CLOSED, Ordering::Release);
    let active = core.active.load(Ordering::Acquire);
    if active != 0 {
        core.end_session(active, GoneReason::Shutdown);
    }
    core.consumer.ring().wake_all();
    core.producer.ring().wake_all();
    if core.cfg.unlink_on_drop {
        core.segment.unlink_if_ours();
    }
    tracing::info!(path = %core.segment.path().display(), "shm segment closed");
}
