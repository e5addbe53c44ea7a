//! The blocking low-level channel: one ring, a [`Producer`] that writes frames in place and a
//! [`Consumer`] that borrows them. The server and the client build sessions on top of it;
//! it is public for callers that want the rings without sessions (and for benchmarks).
//!
//! - Many threads may send through one `Producer`: a process-local writer lock serializes
//!   them (never a lock in shared memory). The lock is acquired with the send's deadline, so a
//!   send's *total* wait — for the lock and for room — is bounded by its timeout.
//! - One `Consumer` reads (`&mut self`); a [`Frame`] borrows the payload in place until it is
//!   dropped, which advances the read index and so frees the room.
//! - Waiting: spin, then park on a futex word in the segment after raising a "sleeping" flag;
//!   the other side only makes the wake-up system call when it sees the flag (a Dekker-style
//!   handshake with `SeqCst` fences on both sides, so a wake-up is never lost). Every sleep is
//!   bounded by a tick, so a peer that never wakes us (dead or hostile) costs latency, never a
//!   hang.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::config::{DEFAULT_HEARTBEAT_INTERVAL, WaitStrategy, check_ring_bytes};
use crate::error::{RecvError, SegmentError, SendError};
use crate::frame::{FLAG_LAST, FRAME_HEADER_BYTES, FrameHeader, KIND_PAD, RESERVED_KIND_MIN};
use crate::layout::offsets::control;
use crate::region::{Region, futex_wait, futex_wake};
use crate::ring::{PlanError, RingGeometry, Step, next_step, plan_write};

/// Locks a process-local mutex, ignoring poisoning: every critical section in this crate
/// leaves its state consistent at every point a user closure can panic (indices are only
/// published after the closure returns).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One ring inside a region: its control block and its data.
#[derive(Debug, Clone)]
pub(crate) struct RingRef {
    /// The memory (shared mapping or heap block).
    region: Arc<Region>,
    /// Offset of the ring's control block (see `layout::offsets::control`).
    control: usize,
    /// Offset of the ring's first data byte.
    data: usize,
    /// Capacity; the data range `data..data + capacity` lies inside the region (checked by
    /// the constructor).
    geom: RingGeometry,
}

impl RingRef {
    /// A ring at the given offsets. Checks that the control block and data lie inside the
    /// region (so every later access is in bounds by construction).
    pub(crate) fn new(region: Arc<Region>, control: usize, data: usize, capacity: u64) -> Self {
        let geom = RingGeometry::new(capacity);
        assert!(
            control.is_multiple_of(8)
                && control + control::BYTES <= region.len()
                && data.is_multiple_of(16)
                && (data as u64)
                    .checked_add(capacity)
                    .is_some_and(|end| end <= region.len() as u64),
            "ring outside its region (layout was validated, so this is a bug)"
        );
        RingRef {
            region,
            control,
            data,
            geom,
        }
    }

    pub(crate) fn head(&self) -> &AtomicU64 {
        self.region.u64_at(self.control + control::HEAD)
    }

    pub(crate) fn tail(&self) -> &AtomicU64 {
        self.region.u64_at(self.control + control::TAIL)
    }

    pub(crate) fn data_seq(&self) -> &AtomicU32 {
        self.region.u32_at(self.control + control::DATA_SEQ)
    }

    fn writer_sleeping(&self) -> &AtomicU32 {
        self.region.u32_at(self.control + control::WRITER_SLEEPING)
    }

    pub(crate) fn space_seq(&self) -> &AtomicU32 {
        self.region.u32_at(self.control + control::SPACE_SEQ)
    }

    fn reader_sleeping(&self) -> &AtomicU32 {
        self.region.u32_at(self.control + control::READER_SLEEPING)
    }

    /// Loads a header word at a ring offset (8-aligned and below the capacity by
    /// construction in `ring`).
    fn read_word(&self, ring_offset: u64) -> u64 {
        self.region
            .u64_at(self.data + ring_offset as usize)
            .load(Ordering::Relaxed)
    }

    fn write_header(&self, ring_offset: u64, header: FrameHeader) {
        let [w0, w1] = header.encode();
        let at = self.data + ring_offset as usize;
        self.region.u64_at(at).store(w0, Ordering::Relaxed);
        self.region.u64_at(at + 8).store(w1, Ordering::Relaxed);
    }

    /// Zeroes the indices and sleeping flags (a new session starts with an empty ring).
    pub(crate) fn reset_shared(&self) {
        self.head().store(0, Ordering::Relaxed);
        self.tail().store(0, Ordering::Relaxed);
        self.writer_sleeping().store(0, Ordering::Relaxed);
        self.reader_sleeping().store(0, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Wakes the reader if it announced it is sleeping.
    fn wake_reader(&self) {
        fence(Ordering::SeqCst);
        let sleeping = self.reader_sleeping();
        if sleeping.load(Ordering::Relaxed) != 0 && sleeping.swap(0, Ordering::AcqRel) != 0 {
            self.data_seq().fetch_add(1, Ordering::Release);
            futex_wake(self.data_seq());
        }
    }

    /// Wakes the writer if it announced it is sleeping.
    fn wake_writer(&self) {
        fence(Ordering::SeqCst);
        let sleeping = self.writer_sleeping();
        if sleeping.load(Ordering::Relaxed) != 0 && sleeping.swap(0, Ordering::AcqRel) != 0 {
            self.space_seq().fetch_add(1, Ordering::Release);
            futex_wake(self.space_seq());
        }
    }

    /// Wakes whoever sleeps on this ring, unconditionally (session changes, shutdown, local
    /// events for the reader).
    pub(crate) fn wake_all(&self) {
        self.data_seq().fetch_add(1, Ordering::Release);
        futex_wake(self.data_seq());
        self.space_seq().fetch_add(1, Ordering::Release);
        futex_wake(self.space_seq());
    }
}

/// How long a waiter spins on the CPU before it starts yielding the core between checks:
/// about one round trip of a busy peer on another core. Past it, a peer that shares this core
/// (an oversubscribed machine) gets to run at every check, instead of after a time slice.
const PURE_SPIN: Duration = Duration::from_micros(2);

/// How a side waits: the strategy, plus the longest single sleep.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Waiter {
    /// Spin or spin-then-park.
    pub(crate) strategy: WaitStrategy,
    /// Upper bound of one futex sleep, so conditions nobody signals (a dead peer) are
    /// re-checked at least this often.
    pub(crate) tick: Duration,
}

impl Waiter {
    /// Waits until `ready()` or `deadline`; returns `ready()`'s last value. `seq` is the futex
    /// word the other side bumps, `sleeping` the flag announcing that this side sleeps.
    pub(crate) fn wait(
        &self,
        seq: &AtomicU32,
        sleeping: &AtomicU32,
        ready: impl Fn() -> bool,
        deadline: Instant,
    ) -> bool {
        let started = Instant::now();
        let spin_until = match self.strategy {
            WaitStrategy::Spin => deadline,
            // Saturates instead of overflowing the clock for a spin nobody validated.
            WaitStrategy::SpinThenPark { spin } => started.checked_add(spin).unwrap_or(deadline),
        };
        let yield_from = started + PURE_SPIN;
        let mut yielding = false;
        let mut spins = 0u32;
        loop {
            if ready() {
                return true;
            }
            // Read the clock every 16 spins (and at once, so a zero spin parks immediately).
            if spins.is_multiple_of(16) {
                let now = Instant::now();
                if now >= deadline {
                    return false;
                }
                if now >= spin_until {
                    break;
                }
                yielding = now >= yield_from;
            }
            spins = spins.wrapping_add(1);
            if yielding {
                // On an oversubscribed machine the peer may be waiting for this very core:
                // let it run (a cheap system call when nothing else is runnable).
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        loop {
            let expected = seq.load(Ordering::Acquire);
            sleeping.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if ready() {
                sleeping.store(0, Ordering::Relaxed);
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                sleeping.store(0, Ordering::Relaxed);
                return false;
            }
            futex_wait(seq, expected, (deadline - now).min(self.tick));
            sleeping.store(0, Ordering::Relaxed);
            if ready() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
        }
    }
}

/// A process-local writer lock that can be acquired with a deadline. The fast path is one
/// `try_lock` of the state mutex; contended writers register in `waiters` and sleep on a
/// condition variable in short slices, and a releasing writer notifies only when someone
/// waits (an unconditional `notify_one` would cost a system call per frame).
#[derive(Debug)]
pub(crate) struct WriterLock<T> {
    /// The writer state; holding its guard is holding the lock.
    state: Mutex<T>,
    /// Writers waiting for the lock.
    waiters: AtomicU32,
    /// Pairs with `freed`.
    gate: Mutex<()>,
    /// Signalled when the lock is released while `waiters > 0`.
    freed: Condvar,
}

/// Holds the writer lock; wakes a waiting writer on drop.
pub(crate) struct WriterGuard<'a, T> {
    /// The lock to notify waiters of on release.
    lock: &'a WriterLock<T>,
    /// The state guard; `None` only inside `drop`.
    state: Option<MutexGuard<'a, T>>,
}

/// Longest single sleep of a contended writer: bounds the cost of a (theoretically
/// impossible) lost notification.
const LOCK_SLICE: Duration = Duration::from_millis(1);

impl<T> WriterLock<T> {
    pub(crate) fn new(state: T) -> Self {
        WriterLock {
            state: Mutex::new(state),
            waiters: AtomicU32::new(0),
            gate: Mutex::new(()),
            freed: Condvar::new(),
        }
    }

    /// Acquires the lock if it is free.
    pub(crate) fn try_lock(&self) -> Option<WriterGuard<'_, T>> {
        let state = match self.state.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(WriterGuard {
            lock: self,
            state: Some(state),
        })
    }

    /// Acquires the lock, waiting at most until `deadline`.
    pub(crate) fn lock_until(&self, deadline: Instant) -> Option<WriterGuard<'_, T>> {
        if let Some(guard) = self.try_lock() {
            return Some(guard);
        }
        loop {
            let gate = lock(&self.gate);
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let acquired = self.try_lock();
            if acquired.is_none() {
                let now = Instant::now();
                if now < deadline {
                    let slice = (deadline - now).min(LOCK_SLICE);
                    drop(
                        self.freed
                            .wait_timeout(gate, slice)
                            .unwrap_or_else(|p| p.into_inner()),
                    );
                }
            }
            self.waiters.fetch_sub(1, Ordering::SeqCst);
            if let Some(guard) = acquired.or_else(|| self.try_lock()) {
                return Some(guard);
            }
            if Instant::now() >= deadline {
                return None;
            }
        }
    }
}

impl<T> std::ops::Deref for WriterGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // The option is `Some` until `drop` (invariant of the type).
        self.state.as_ref().expect("writer state held until drop")
    }
}

impl<T> std::ops::DerefMut for WriterGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // The option is `Some` until `drop` (invariant of the type).
        self.state.as_mut().expect("writer state held until drop")
    }
}

impl<T> Drop for WriterGuard<'_, T> {
    fn drop(&mut self) {
        drop(self.state.take());
        // Pairs with the waiter's SeqCst increment before its `try_lock`: either it sees the
        // lock free, or we see it waiting.
        fence(Ordering::SeqCst);
        if self.lock.waiters.load(Ordering::SeqCst) > 0 {
            let _gate = lock(&self.lock.gate);
            self.lock.freed.notify_one();
        }
    }
}

/// The writer's local state.
#[derive(Debug)]
pub(crate) struct ProducerState {
    /// The write index. Authoritative copy: the shared `head` is only ever stored to, never
    /// read back (the peer could have overwritten it).
    head: u64,
}

/// The writing end of a ring. `Sync`: share it (e.g. in an `Arc`) between writer threads.
#[derive(Debug)]
pub struct Producer {
    /// The ring.
    ring: RingRef,
    /// Serializes writers; holds the write index.
    lock: WriterLock<ProducerState>,
    /// How to wait for room.
    waiter: Waiter,
}

/// Room reserved in the ring for one frame; [`Reservation::commit`] publishes it, dropping it
/// abandons it (nothing is published, so a panicking encoder leaves the ring intact).
pub(crate) struct Reservation<'a> {
    /// The producer whose ring is written.
    producer: &'a Producer,
    /// Holds the writer lock (and the write index) until commit or drop.
    guard: WriterGuard<'a, ProducerState>,
    /// The frame header to publish.
    header: FrameHeader,
    /// A padding marker to write first (ring offset, length).
    pad: Option<(u64, u32)>,
    /// Ring offset of the frame header.
    frame_offset: u64,
    /// The write index after the frame.
    new_head: u64,
}

impl Reservation<'_> {
    /// The payload bytes, in place in the ring.
    pub(crate) fn payload_mut(&mut self) -> &mut [u8] {
        let ring = &self.producer.ring;
        let start = ring.data + self.frame_offset as usize + FRAME_HEADER_BYTES;
        // SAFETY: the plan placed `header + len` bytes inside the ring's free space (room the
        // reader has released), and the writer lock we hold makes this the only writer in this
        // process; the reader never looks past the published head. See `region` for the peer.
        unsafe { ring.region.bytes_mut(start, self.header.len as usize) }
    }

    /// Publishes the frame and wakes the reader if it sleeps.
    pub(crate) fn commit(mut self) {
        let ring = &self.producer.ring;
        if let Some((offset, len)) = self.pad {
            ring.write_header(
                offset,
                FrameHeader {
                    id: 0,
                    kind: KIND_PAD,
                    flags: 0,
                    len,
                },
            );
        }
        ring.write_header(self.frame_offset, self.header);
        ring.head().store(self.new_head, Ordering::Release);
        self.guard.head = self.new_head;
        ring.wake_reader();
    }
}

impl Producer {
    pub(crate) fn new(ring: RingRef, waiter: Waiter) -> Self {
        Producer {
            ring,
            lock: WriterLock::new(ProducerState { head: 0 }),
            waiter,
        }
    }

    /// The largest payload one frame can carry (half the ring minus the frame header).
    pub fn max_payload(&self) -> usize {
        self.ring.geom.max_payload() as usize
    }

    /// Sends one frame, waiting up to `timeout` (for the writer lock and for room). `write`
    /// fills the `len` payload bytes in place. Kinds at or above
    /// [`RESERVED_KIND_MIN`] are refused.
    pub fn send(
        &self,
        id: u64,
        kind: u16,
        last: bool,
        len: usize,
        write: impl FnOnce(&mut [u8]),
        timeout: Duration,
    ) -> Result<(), SendError> {
        check_kind(kind)?;
        let deadline = Instant::now() + timeout;
        let mut reservation =
            self.reserve(id, kind, flags(last), len, Some(deadline), &|| Ok(()))?;
        write(reservation.payload_mut());
        reservation.commit();
        Ok(())
    }

    /// Sends one frame if the lock is free and there is room now; `SendError::Full` otherwise
    /// (`write` is then not called).
    pub fn try_send(
        &self,
        id: u64,
        kind: u16,
        last: bool,
        len: usize,
        write: impl FnOnce(&mut [u8]),
    ) -> Result<(), SendError> {
        check_kind(kind)?;
        let mut reservation = self.reserve(id, kind, flags(last), len, None, &|| Ok(()))?;
        write(reservation.payload_mut());
        reservation.commit();
        Ok(())
    }

    /// Reserves room for a frame. With `wait: None` it tries once (`Full` if the ring is
    /// full, or the lock busy and `lock_deadline` is `None`); with a deadline it waits for the
    /// lock and for room until then. `alive` is checked before each attempt and while
    /// waiting; its error (e.g. `SessionGone`) ends the wait.
    pub(crate) fn reserve(
        &self,
        id: u64,
        kind: u16,
        flags: u16,
        len: usize,
        wait: Option<Instant>,
        alive: &dyn Fn() -> Result<(), SendError>,
    ) -> Result<Reservation<'_>, SendError> {
        self.reserve_with(id, kind, flags, len, wait, wait, alive)
    }

    /// [`Producer::reserve`] with separate deadlines for the writer lock and for room (the
    /// async client waits briefly for the lock, which is only held while a frame is encoded,
    /// but never blocks its thread waiting for room).
    #[allow(
        clippy::too_many_arguments,
        reason = "internal; the public sends take fewer"
    )]
    pub(crate) fn reserve_with(
        &self,
        id: u64,
        kind: u16,
        flags: u16,
        len: usize,
        lock_deadline: Option<Instant>,
        deadline: Option<Instant>,
        alive: &dyn Fn() -> Result<(), SendError>,
    ) -> Result<Reservation<'_>, SendError> {
        let started = Instant::now();
        let max = self.max_payload();
        if len > max {
            return Err(SendError::FrameTooLarge { len, max });
        }
        let guard = match lock_deadline {
            Some(lock_deadline) => {
                self.lock
                    .lock_until(lock_deadline)
                    .ok_or(SendError::Timeout {
                        waited: started.elapsed(),
                    })?
            }
            None => self.lock.try_lock().ok_or(SendError::Full)?,
        };
        loop {
            alive()?;
            let tail = self.ring.tail().load(Ordering::Acquire);
            match plan_write(self.ring.geom, guard.head, tail, len as u64) {
                Ok(plan) => {
                    return Ok(Reservation {
                        producer: self,
                        guard,
                        // `len <= max_payload < 2^30` was checked above.
                        header: FrameHeader {
                            id,
                            kind,
                            flags,
                            len: len as u32,
                        },
                        pad: plan.pad,
                        frame_offset: plan.frame_offset,
                        new_head: plan.new_head,
                    });
                }
                Err(PlanError::TooLarge) => return Err(SendError::FrameTooLarge { len, max }),
                Err(PlanError::Corrupt(e)) => return Err(SendError::Corrupt(e)),
                Err(PlanError::Full) => {
                    let Some(deadline) = deadline else {
                        return Err(SendError::Full);
                    };
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(SendError::Timeout {
                            waited: now - started,
                        });
                    }
                    let ring = &self.ring;
                    self.waiter.wait(
                        ring.space_seq(),
                        ring.writer_sleeping(),
                        || ring.tail().load(Ordering::Acquire) != tail || alive().is_err(),
                        deadline,
                    );
                }
            }
        }
    }

    /// Resets the write index for a new session, if no writer holds the lock right now.
    pub(crate) fn try_reset(&self) -> bool {
        match self.lock.try_lock() {
            Some(mut guard) => {
                guard.head = 0;
                self.ring.reset_shared();
                true
            }
            None => false,
        }
    }

    /// Waits until no writer is inside a send (writers notice a dead session and bail out
    /// promptly, so this is short), then keeps writers out while `f` runs.
    pub(crate) fn quiesce<R>(&self, f: impl FnOnce() -> R) -> R {
        loop {
            if let Some(_guard) = self
                .lock
                .lock_until(Instant::now() + Duration::from_secs(1))
            {
                return f();
            }
            self.ring.wake_all();
        }
    }

    pub(crate) fn ring(&self) -> &RingRef {
        &self.ring
    }
}

fn check_kind(kind: u16) -> Result<(), SendError> {
    if kind >= RESERVED_KIND_MIN {
        return Err(SendError::ReservedKind { kind });
    }
    Ok(())
}

fn flags(last: bool) -> u16 {
    if last { FLAG_LAST } else { 0 }
}

/// The reader's local state.
#[derive(Debug)]
struct ConsumerState {
    /// The read index. Authoritative copy: the shared `tail` is only stored to.
    tail: u64,
    /// Bumped by every reset; a frame borrowed before a reset is not committed after it.
    epoch: u64,
    /// A `Frame` is borrowed (a reset must wait: the frame's bytes must stay put).
    frame_out: bool,
    /// A corruption was found; nothing is read until a reset.
    broken: bool,
}

/// A frame found by `poll`, not yet released.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FrameInfo {
    /// The validated header.
    pub(crate) header: FrameHeader,
    /// Ring offset of the payload.
    payload_offset: u64,
    /// The read index once the frame is released.
    new_tail: u64,
    /// The reset epoch it was read in (a release after a reset must not move the new session's index).
    epoch: u64,
}

/// The reading state of a ring, shared between the consumer handle and the keeper (which
/// resets it between sessions).
#[derive(Debug)]
pub(crate) struct ConsumerCore {
    /// The ring.
    ring: RingRef,
    /// Local read state; locked only briefly (never across a wait or a borrowed frame).
    state: Mutex<ConsumerState>,
    /// How to wait for data.
    waiter: Waiter,
}

impl ConsumerCore {
    pub(crate) fn new(ring: RingRef, waiter: Waiter) -> Self {
        ConsumerCore {
            ring,
            state: Mutex::new(ConsumerState {
                tail: 0,
                epoch: 0,
                frame_out: false,
                broken: false,
            }),
            waiter,
        }
    }

    /// Looks for the next frame (skipping padding); validates everything it reads.
    pub(crate) fn poll(&self) -> Result<Option<FrameInfo>, RecvError> {
        let mut st = lock(&self.state);
        if st.broken {
            return Err(RecvError::Broken);
        }
        debug_assert!(
            !st.frame_out,
            "one frame at a time (guaranteed by &mut borrows)"
        );
        loop {
            let head = self.ring.head().load(Ordering::Acquire);
            match next_step(self.ring.geom, st.tail, head, |offset| {
                self.ring.read_word(offset)
            }) {
                Ok(None) => return Ok(None),
                Ok(Some(Step::Skip { new_tail })) => {
                    st.tail = new_tail;
                    self.ring.tail().store(new_tail, Ordering::Release);
                    self.ring.wake_writer();
                }
                Ok(Some(Step::Frame {
                    header,
                    payload_offset,
                    new_tail,
                })) => {
                    st.frame_out = true;
                    return Ok(Some(FrameInfo {
                        header,
                        payload_offset,
                        new_tail,
                        epoch: st.epoch,
                    }));
                }
                Err(e) => {
                    st.broken = true;
                    return Err(RecvError::Corrupt(e));
                }
            }
        }
    }

    /// The payload of a polled frame.
    ///
    /// Callers hold the frame (`frame_out`) for as long as the slice lives.
    pub(crate) fn payload(&self, info: &FrameInfo) -> &[u8] {
        let start = self.ring.data + info.payload_offset as usize;
        // SAFETY: `next_step` checked that the frame lies inside the published data and does
        // not cross the ring's end; until it is released (`frame_out`, which also blocks
        // resets) this process's writer cannot reach these bytes. See `region` for the peer.
        unsafe { self.ring.region.bytes(start, info.header.len as usize) }
    }

    /// Releases a polled frame: advances the read index (unless a reset happened meanwhile)
    /// and wakes a sleeping writer.
    pub(crate) fn release(&self, info: &FrameInfo) {
        let mut st = lock(&self.state);
        st.frame_out = false;
        if st.epoch == info.epoch && !st.broken {
            st.tail = info.new_tail;
            self.ring.tail().store(info.new_tail, Ordering::Release);
            self.ring.wake_writer();
        }
    }

    /// Waits until the shared write index differs from the local read index, `extra()` holds,
    /// or `deadline`.
    pub(crate) fn wait(&self, extra: &dyn Fn() -> bool, deadline: Instant) {
        let tail = lock(&self.state).tail;
        let ring = &self.ring;
        self.waiter.wait(
            ring.data_seq(),
            ring.reader_sleeping(),
            || ring.head().load(Ordering::Acquire) != tail || extra(),
            deadline,
        );
    }

    /// Resets for a new session unless a frame is borrowed.
    pub(crate) fn try_reset(&self) -> bool {
        let mut st = lock(&self.state);
        if st.frame_out {
            return false;
        }
        st.tail = 0;
        st.epoch += 1;
        st.broken = false;
        self.ring.reset_shared();
        true
    }

    pub(crate) fn ring(&self) -> &RingRef {
        &self.ring
    }
}

/// The reading end of a ring: one reader (`&mut self`), frames borrowed in place.
#[derive(Debug)]
pub struct Consumer {
    /// The reading state (shared with a keeper that resets it).
    core: Arc<ConsumerCore>,
}

impl Consumer {
    pub(crate) fn new(core: Arc<ConsumerCore>) -> Self {
        Consumer { core }
    }

    /// Waits up to `timeout` for a frame. `Ok(None)`: nothing arrived in time. A corrupt ring
    /// gives `RecvError::Corrupt` once and `RecvError::Broken` afterwards.
    pub fn recv(&mut self, timeout: Duration) -> Result<Option<Frame<'_>>, RecvError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(info) = self.core.poll()? {
                return Ok(Some(Frame {
                    core: &self.core,
                    info,
                }));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            self.core.wait(&|| false, deadline);
        }
    }

    /// Returns a frame if one is ready now.
    pub fn try_recv(&mut self) -> Result<Option<Frame<'_>>, RecvError> {
        Ok(self.core.poll()?.map(|info| Frame {
            core: &self.core,
            info,
        }))
    }
}

/// A received frame, borrowed in place from the ring. Dropping it releases its room to the
/// writer; hold it only as long as you read it.
#[derive(Debug)]
pub struct Frame<'a> {
    /// The ring it is borrowed from.
    core: &'a ConsumerCore,
    /// Where the frame is and how to release it.
    info: FrameInfo,
}

impl Frame<'_> {
    /// The request id.
    pub fn id(&self) -> u64 {
        self.info.header.id
    }

    /// The frame kind.
    pub fn kind(&self) -> u16 {
        self.info.header.kind
    }

    /// Whether the writer marked this the last frame of its request.
    pub fn is_last(&self) -> bool {
        self.info.header.flags & FLAG_LAST != 0
    }

    /// The payload, in place in the ring.
    pub fn payload(&self) -> &[u8] {
        self.core.payload(&self.info)
    }
}

impl Drop for Frame<'_> {
    fn drop(&mut self) {
        self.core.release(&self.info);
    }
}

/// Bytes of the in-memory block before the ring data (one control block, rounded to 16).
const IN_MEMORY_DATA_OFFSET: usize = control::BYTES;

/// An in-process ring of `capacity` bytes (a power of two in
/// [`MIN_RING_BYTES`](crate::config::MIN_RING_BYTES)..=[`MAX_RING_BYTES`](crate::config::MAX_RING_BYTES))
/// on the heap: the same code as the shared-memory rings, for tests and benchmarks between
/// threads.
pub fn ring_in_memory(
    capacity: usize,
    wait: WaitStrategy,
) -> Result<(Producer, Consumer), SegmentError> {
    check_ring_bytes(capacity as u64).map_err(|reason| SegmentError::InvalidConfig {
        reason: format!("ring of {capacity} bytes: {reason}"),
    })?;
    let region = Arc::new(Region::heap(IN_MEMORY_DATA_OFFSET + capacity));
    let ring = RingRef::new(region, 0, IN_MEMORY_DATA_OFFSET, capacity as u64);
    let waiter = Waiter {
        strategy: wait,
        tick: DEFAULT_HEARTBEAT_INTERVAL,
    };
    let producer = Producer::new(ring.clone(), waiter);
    let consumer = Consumer::new(Arc::new(ConsumerCore::new(ring, waiter)));
    Ok((producer, consumer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::FrameError;

    fn spin_ring(capacity: usize) -> (Producer, Consumer) {
        ring_in_memory(capacity, WaitStrategy::Spin).unwrap()
    }

    #[test]
    fn the_writer_lock_times_out_while_held_and_is_acquired_once_released() {
        let lock = WriterLock::new(0u32);
        let guard = lock.try_lock().unwrap();
        assert!(lock.try_lock().is_none());
        assert!(
            lock.lock_until(Instant::now() + Duration::from_millis(20))
                .is_none()
        );
        drop(guard);
        assert!(
            lock.lock_until(Instant::now() + Duration::from_millis(20))
                .is_some()
        );
    }

    #[test]
    fn contended_writers_each_get_the_lock() {
        let lock = WriterLock::new(0u64);
        let rounds = if cfg!(miri) { 10 } else { 10_000 };
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..rounds {
                        let mut guard = lock
                            .lock_until(Instant::now() + Duration::from_secs(30))
                            .unwrap();
                        *guard += 1;
                    }
                });
            }
        });
        assert_eq!(*lock.try_lock().unwrap(), 4 * rounds);
    }

    #[test]
    fn a_frame_written_in_place_is_read_in_place() {
        let (tx, mut rx) = spin_ring(4096);
        tx.try_send(5, 9, true, 4, |buf| buf.copy_from_slice(b"abcd"))
            .unwrap();
        let frame = rx.try_recv().unwrap().unwrap();
        assert_eq!(
            (frame.id(), frame.kind(), frame.is_last(), frame.payload()),
            (5, 9, true, &b"abcd"[..])
        );
        drop(frame);
        assert!(rx.try_recv().unwrap().is_none());
    }

    #[test]
    fn a_frame_larger_than_half_the_ring_is_frame_too_large() {
        let (tx, _rx) = spin_ring(4096);
        let err = tx
            .try_send(1, 1, false, 4096, |_| unreachable!())
            .unwrap_err();
        assert_eq!(
            err,
            SendError::FrameTooLarge {
                len: 4096,
                max: 2048 - 16
            }
        );
    }

    #[test]
    fn reserved_kinds_are_refused_to_callers() {
        let (tx, _rx) = spin_ring(4096);
        assert_eq!(
            tx.try_send(1, 0xFF01, false, 0, |_| {}),
            Err(SendError::ReservedKind { kind: 0xFF01 })
        );
    }

    #[test]
    fn a_full_ring_makes_try_send_report_full_and_send_time_out() {
        let (tx, mut rx) = spin_ring(4096);
        while tx.try_send(1, 1, false, 1000, |_| {}).is_ok() {}
        assert_eq!(
            tx.try_send(1, 1, false, 1000, |_| unreachable!()),
            Err(SendError::Full)
        );
        let err = tx
            .send(
                1,
                1,
                false,
                1000,
                |_| unreachable!(),
                Duration::from_millis(20),
            )
            .unwrap_err();
        assert!(matches!(err, SendError::Timeout { .. }), "{err:?}");
        // Releasing one frame makes room again.
        drop(rx.try_recv().unwrap().unwrap());
        tx.try_send(1, 1, false, 1000, |_| {}).unwrap();
    }

    #[test]
    fn a_parked_writer_is_woken_when_the_reader_frees_room() {
        let (tx, mut rx) = ring_in_memory(
            4096,
            WaitStrategy::SpinThenPark {
                spin: Duration::ZERO,
            },
        )
        .unwrap();
        while tx.try_send(1, 1, false, 1000, |_| {}).is_ok() {}
        std::thread::scope(|s| {
            let writer =
                s.spawn(|| tx.send(2, 1, false, 1000, |b| b.fill(7), Duration::from_secs(30)));
            // Reading everything eventually lets the blocked writer in.
            let mut seen = 0;
            while seen < 4 {
                if let Some(frame) = rx.recv(Duration::from_secs(30)).unwrap() {
                    if frame.id() == 2 {
                        assert!(frame.payload().iter().all(|&b| b == 7));
                    }
                    seen += 1;
                }
            }
            writer.join().unwrap().unwrap();
        });
    }

    #[test]
    fn a_panicking_encoder_publishes_nothing_and_leaves_the_ring_usable() {
        let (tx, mut rx) = spin_ring(4096);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = tx.try_send(1, 1, false, 8, |_| panic!("encoder bug"));
        }));
        assert!(result.is_err());
        assert!(rx.try_recv().unwrap().is_none());
        tx.try_send(2, 1, false, 1, |b| b[0] = 1).unwrap();
        assert_eq!(rx.try_recv().unwrap().unwrap().id(), 2);
    }

    #[test]
    fn a_corrupt_write_index_is_reported_once_then_the_ring_is_broken() {
        let (tx, mut rx) = spin_ring(4096);
        tx.ring().head().store(24, Ordering::Release);
        assert!(matches!(
            rx.try_recv(),
            Err(RecvError::Corrupt(FrameError::HeadOutOfRange { .. }))
        ));
        assert!(matches!(rx.try_recv(), Err(RecvError::Broken)));
    }

    #[test]
    fn a_corrupt_read_index_is_reported_to_the_writer() {
        let (tx, rx) = spin_ring(4096);
        rx.core.ring().tail().store(1 << 40, Ordering::Release);
        assert!(matches!(
            tx.try_send(1, 1, false, 0, |_| {}),
            Err(SendError::Corrupt(FrameError::TailOutOfRange { .. }))
        ));
    }

    #[test]
    fn frames_stream_between_threads_in_order_across_many_laps() {
        let (tx, mut rx) = spin_ring(4096);
        let count: u64 = if cfg!(miri) { 200 } else { 20_000 };
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..count {
                    let len = (i * 131 % 1500) as usize;
                    tx.send(
                        i,
                        1,
                        i + 1 == count,
                        len,
                        |b| b.fill(i as u8),
                        Duration::from_secs(30),
                    )
                    .unwrap();
                }
            });
            let mut next = 0;
            while next < count {
                let frame = rx
                    .recv(Duration::from_secs(30))
                    .unwrap()
                    .expect("frame within 30 s");
                assert_eq!(frame.id(), next);
                assert_eq!(frame.payload().len(), (next * 131 % 1500) as usize);
                assert!(frame.payload().iter().all(|&b| b == next as u8));
                assert_eq!(frame.is_last(), next + 1 == count);
                next += 1;
            }
        });
    }

    #[test]
    fn many_writer_threads_are_serialized_without_losing_frames() {
        let (tx, mut rx) = spin_ring(8192);
        let per_thread: u64 = if cfg!(miri) { 20 } else { 2_000 };
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let tx = &tx;
                s.spawn(move || {
                    for i in 0..per_thread {
                        let id = t << 32 | i;
                        tx.send(
                            id,
                            1,
                            false,
                            24,
                            |b| b.copy_from_slice(&[id.to_le_bytes(); 3].concat()),
                            Duration::from_secs(30),
                        )
                        .unwrap();
                    }
                });
            }
            let mut next = [0u64; 4];
            for _ in 0..4 * per_thread {
                let frame = rx
                    .recv(Duration::from_secs(30))
                    .unwrap()
                    .expect("frame within 30 s");
                let (t, i) = ((frame.id() >> 32) as usize, frame.id() & 0xFFFF_FFFF);
                assert_eq!(i, next[t], "per-thread order kept");
                next[t] += 1;
                assert_eq!(frame.payload(), &[frame.id().to_le_bytes(); 3].concat()[..]);
            }
        });
    }
}
