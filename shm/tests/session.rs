//! Server and client in one process over a real segment: the session protocol, cancellation,
//! shutdown, segment ownership and creation errors.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use common::proto::{KIND_ECHO, KIND_HANG, StreamSpec};
use common::serve::{Observation, serve};
use common::verify::{start_stream, verify_stream};
use common::{SegmentPath, WAIT, Watchdog};
use zerolayer_shm::raw::{RawSegment, offsets};
use zerolayer_shm::{
    AttachError, ClientError, GoneReason, Incoming, SegmentError, SendError, ShmClient, ShmConfig,
    ShmServer,
};

const LIVENESS: Duration = Duration::from_secs(3);

/// Receives the next request or event, within the wait bound.
fn next_incoming(rx: &mut zerolayer_shm::RequestReceiver) -> Incoming<'_> {
    rx.recv_timeout(WAIT)
        .unwrap()
        .unwrap_or_else(|| panic!("nothing received within {WAIT:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_and_its_response_travel_through_a_real_segment() {
    let _watchdog = Watchdog::new("a_request_and_its_response", Duration::from_secs(60));
    let path = SegmentPath::new("basic");
    let (server, mut rx) = ShmServer::create(path.config(LIVENESS)).unwrap();
    let client = ShmClient::connect(path.config(LIVENESS)).unwrap();
    let (generation, session) = client.wait_attached(WAIT).await.unwrap();
    assert_eq!(generation, server.generation());

    let engine = std::thread::spawn(move || {
        // The blocking `recv` (the watchdog bounds it).
        let Incoming::ClientAttached(attached) = rx.recv().unwrap() else {
            panic!("attach first")
        };
        let Incoming::Request(frame) = rx.recv().unwrap() else {
            panic!("then the request")
        };
        assert_eq!((frame.kind(), frame.payload()), (7, &b"question"[..]));
        let key = frame.key();
        assert_eq!(key.session, attached);
        drop(frame);
        server
            .send(key, 8, false, 3, |b| b.copy_from_slice(b"ans"))
            .unwrap();
        server
            .send(key, 9, true, 4, |b| b.copy_from_slice(b"wer!"))
            .unwrap();
        (server, rx, attached)
    });
    let (id, mut stream) = client
        .start_request(7, 8, |b| b.copy_from_slice(b"question"))
        .await
        .unwrap();
    assert_eq!(stream.id(), id);
    let first = stream.next().await.unwrap().unwrap();
    assert_eq!(
        (first.kind, first.last, &first.payload[..]),
        (8, false, &b"ans"[..])
    );
    let second = stream.next().await.unwrap().unwrap();
    assert_eq!(
        (second.kind, second.last, &second.payload[..]),
        (9, true, &b"wer!"[..])
    );
    assert!(stream.next().await.is_none());
    let (server, _rx, attached) = engine.join().unwrap();
    assert_eq!(attached, session);
    assert_eq!(server.session(), Some(session));
    client.shutdown();
    server.shutdown();
    assert!(
        !path.path.exists(),
        "the server removes its segment on shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_or_dropping_a_stream_tells_the_engine() {
    let _watchdog = Watchdog::new("cancelling_or_dropping_a_stream", Duration::from_secs(60));
    let path = SegmentPath::new("cancel");
    let (server, mut rx) = ShmServer::create(path.config(LIVENESS)).unwrap();
    let (tx, observations) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let engine = {
        let (server, stop) = (server.clone(), stop.clone());
        std::thread::spawn(move || serve(&server, &mut rx, &stop, &move |o| drop(tx.send(o)), None))
    };
    let expect = |want: &dyn Fn(&Observation) -> bool| loop {
        let o = observations
            .recv_timeout(WAIT)
            .expect("observation within the wait bound");
        if want(&o) {
            return o;
        }
    };
    let client = ShmClient::connect(path.config(LIVENESS)).unwrap();
    client.wait_attached(WAIT).await.unwrap();

    let (id, mut stream) = client.start_request(KIND_HANG, 0, |_| {}).await.unwrap();
    let Observation::Hanging(key) = expect(&|o| matches!(o, Observation::Hanging(_))) else {
        unreachable!()
    };
    assert_eq!(key.id, id.get());
    client.cancel(id);
    assert_eq!(
        expect(&|o| matches!(o, Observation::Cancel(_))),
        Observation::Cancel(key)
    );
    assert!(stream.next().await.is_none(), "a cancelled stream ends");

    let (id, stream) = client.start_request(KIND_HANG, 0, |_| {}).await.unwrap();
    expect(&|o| matches!(o, Observation::Hanging(_)));
    drop(stream);
    let Observation::Cancel(key) = expect(&|o| matches!(o, Observation::Cancel(_))) else {
        unreachable!()
    };
    assert_eq!(
        key.id,
        id.get(),
        "dropping an unfinished stream cancels its request"
    );

    // A finished stream sends no cancel: the next cancel seen is the one after it.
    let spec = StreamSpec {
        chunks: 3,
        chunk_len: 10,
        seed: 1,
        delay_us: 0,
    };
    let (_, finished) = start_stream(&client, spec).await.unwrap();
    verify_stream(spec, finished).await.unwrap();
    let (id, stream) = client.start_request(KIND_HANG, 0, |_| {}).await.unwrap();
    expect(&|o| matches!(o, Observation::Hanging(_)));
    drop(stream);
    let Observation::Cancel(key) = expect(&|o| matches!(o, Observation::Cancel(_))) else {
        unreachable!()
    };
    assert_eq!(key.id, id.get());

    client.shutdown();
    stop.store(true, Ordering::Release);
    engine.join().unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closing_server_fails_in_flight_requests_at_once_and_late_sends_get_session_gone() {
    let _watchdog = Watchdog::new("a_closing_server", Duration::from_secs(60));
    let path = SegmentPath::new("close");
    let (server, mut rx) = ShmServer::create(path.config(LIVENESS)).unwrap();
    let client = ShmClient::connect(path.config(LIVENESS)).unwrap();
    client.wait_attached(WAIT).await.unwrap();
    let (_, mut stream) = client.start_request(KIND_HANG, 0, |_| {}).await.unwrap();
    let key = {
        let Incoming::ClientAttached(_) = next_incoming(&mut rx) else {
            panic!("attach first")
        };
        let Incoming::Request(frame) = next_incoming(&mut rx) else {
            panic!("then the request")
        };
        frame.key()
    };
    let closed_at = Instant::now();
    server.shutdown();
    let got = tokio::time::timeout(WAIT, stream.next()).await.unwrap();
    assert_eq!(
        got,
        Some(Err(ClientError::PeerGone {
            reason: GoneReason::ServerClosed
        }))
    );
    println!(
        "graceful close noticed by the client after {:?}",
        closed_at.elapsed()
    );
    assert_eq!(
        server.send(key, 1, true, 0, |_| {}),
        Err(SendError::Shutdown)
    );
    assert!(matches!(
        rx.recv_timeout(Duration::ZERO),
        Err(zerolayer_shm::RecvError::Shutdown)
    ));
    client.shutdown();
}

#[test]
fn responses_to_an_ended_session_are_refused_with_session_gone() {
    let _watchdog = Watchdog::new("responses_to_an_ended_session", Duration::from_secs(60));
    let path = SegmentPath::new("stale-key");
    let (server, mut rx) = ShmServer::create(path.config(LIVENESS)).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let client = ShmClient::attach(path.config(LIVENESS), WAIT).unwrap();
    let _stream = runtime
        .block_on(client.start_request(KIND_ECHO, 1, |b| b[0] = 1))
        .unwrap();
    let Incoming::ClientAttached(session) = next_incoming(&mut rx) else {
        panic!("attach first")
    };
    let key = {
        let Incoming::Request(frame) = next_incoming(&mut rx) else {
            panic!("then the request")
        };
        frame.key()
    };
    client.shutdown();
    match next_incoming(&mut rx) {
        Incoming::ClientGone {
            session: gone,
            reason,
            in_flight,
        } => {
            assert_eq!(
                (gone, reason, in_flight),
                (session, GoneReason::Detached, vec![key])
            );
        }
        other => panic!("expected the session end, got {other:?}"),
    }
    assert_eq!(
        server.send(key, KIND_ECHO, true, 1, |_| unreachable!()),
        Err(SendError::SessionGone)
    );
    // A new client gets a new session; the old key still cannot reach it.
    let client = ShmClient::attach(path.config(LIVENESS), WAIT).unwrap();
    let Incoming::ClientAttached(new_session) = next_incoming(&mut rx) else {
        panic!("second attach")
    };
    assert_ne!(new_session, session);
    assert_eq!(
        server.send(key, KIND_ECHO, true, 1, |_| unreachable!()),
        Err(SendError::SessionGone)
    );
    client.shutdown();
}

#[test]
fn a_second_front_cannot_take_over_a_live_session() {
    let _watchdog = Watchdog::new("a_second_front_cannot_take_over", Duration::from_secs(60));
    let path = SegmentPath::new("busy");
    let (server, _rx) = ShmServer::create(path.config(LIVENESS)).unwrap();
    let first = ShmClient::attach(path.config(LIVENESS), WAIT).unwrap();
    let session = server.session().expect("first front attached");
    let mut cfg = path.config(LIVENESS);
    cfg.attach_timeout = Duration::from_millis(300);
    let err = ShmClient::attach(cfg, Duration::from_secs(1)).unwrap_err();
    assert!(
        matches!(
            err,
            AttachError::TimedOut {
                last_error: None,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        server.session(),
        Some(session),
        "the first front keeps its session"
    );
    first.shutdown();
}

#[test]
fn a_second_server_on_a_live_segment_is_refused_and_a_stale_one_is_replaced_with_the_next_generation()
 {
    let _watchdog = Watchdog::new("a_second_server_on_a_live_segment", Duration::from_secs(60));
    let path = SegmentPath::new("owner");
    let mut cfg = path.config(LIVENESS);
    cfg.unlink_on_drop = false; // leave a stale segment behind, as a crash would
    let (first, _rx) = ShmServer::create(cfg.clone()).unwrap();
    match ShmServer::create(cfg.clone()) {
        Err(SegmentError::InUse { path: p }) => assert_eq!(p, path.path),
        other => panic!("expected InUse, got {other:?}"),
    }
    let generation = first.generation();
    drop(first);
    drop(_rx);
    assert!(path.path.exists(), "the stale segment stays");
    let (second, _rx2) = ShmServer::create(cfg).unwrap();
    assert_eq!(second.generation(), generation + 1);
}

#[test]
fn a_client_started_before_the_server_attaches_once_it_appears() {
    let _watchdog = Watchdog::new(
        "a_client_started_before_the_server",
        Duration::from_secs(60),
    );
    let path = SegmentPath::new("early-client");
    let client = ShmClient::connect(path.config(LIVENESS)).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = runtime
        .block_on(client.wait_attached(Duration::from_millis(100)))
        .unwrap_err();
    assert!(matches!(err, ClientError::AttachTimeout { .. }));
    assert!(matches!(
        client.take_last_error(),
        Some(SegmentError::NotFound { .. })
    ));
    let (server, _rx) = ShmServer::create(path.config(LIVENESS)).unwrap();
    let (generation, _) = runtime.block_on(client.wait_attached(WAIT)).unwrap();
    assert_eq!(generation, server.generation());
}

#[test]
fn a_header_corrupted_in_place_is_rejected_by_a_new_client() {
    let _watchdog = Watchdog::new("a_header_corrupted_in_place", Duration::from_secs(60));
    let path = SegmentPath::new("bad-magic");
    let (server, _rx) = ShmServer::create(path.config(LIVENESS)).unwrap();
    let raw = RawSegment::open(&path.path).unwrap();
    assert!(raw.store_u32(offsets::VERSION, 2));
    let mut cfg = path.config(LIVENESS);
    cfg.attach_timeout = Duration::from_millis(200);
    match ShmClient::attach(cfg, Duration::from_millis(500)) {
        Err(AttachError::TimedOut {
            last_error: Some(SegmentError::Header { source, .. }),
            ..
        }) => {
            assert_eq!(source.error_type(), "unsupported_version");
        }
        other => panic!("expected a header error, got {other:?}"),
    }
    server.shutdown();
}

#[test]
fn a_tmpfs_too_small_for_the_segment_fails_at_creation_with_no_space() {
    let _watchdog = Watchdog::new("a_tmpfs_too_small", Duration::from_secs(60));
    let dir = std::env::temp_dir().join(format!("zl-shm-nospace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(&dir)
        .output()
        .is_ok_and(|out| out.status.success());
    if !mounted {
        let _ = std::fs::remove_dir(&dir);
        eprintln!(
            "SKIPPED: cannot mount a small tmpfs here (needs root); NoSpace mapping is unit-tested"
        );
        return;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _unmount = Unmount(dir.clone());
    let mut cfg = ShmConfig::new(&dir.join("seg").to_string_lossy()).unwrap();
    cfg.request_ring_bytes = 1 << 20;
    match ShmServer::create(cfg) {
        Err(SegmentError::NoSpace { bytes, .. }) => assert_eq!(bytes, 4096 + (1 << 20) + (4 << 20)),
        other => panic!("expected NoSpace, got {other:?}"),
    }
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(
        leftovers.is_empty(),
        "no temporary file left behind: {leftovers:?}"
    );
}
