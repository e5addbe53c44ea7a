//! Multi-process tests: the engine or the front runs as a real child process
//! (`zerolayer-shm-peer`), killed with SIGKILL where the test is about crashes, or
//! deliberately corrupting the segment where it is about hostile peers. Every test has a
//! watchdog; every wait has a generous timeout; every segment name is unique.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::proto::{KIND_ECHO, KIND_HANG, StreamSpec};
use common::serve::{Observation, serve};
use common::verify::{run_streams, start_stream};
use common::{Peer, SegmentPath, WAIT, Watchdog};
use zerolayer_shm::{
    AttachError, ClientError, ConnectionState, FrameError, GoneReason, HeaderError, SegmentError,
    ShmClient, ShmConfig, ShmServer,
};

/// Liveness timeout for tests that are not about crashes: far above any scheduling stall
/// of a loaded 2-core machine, so no session is lost by accident.
const RELAXED_LIVENESS: Duration = Duration::from_secs(3);

/// Liveness timeout for the crash tests (the detection latency printed is compared to it).
const CRASH_LIVENESS: Duration = Duration::from_millis(400);

fn server_args(path: &SegmentPath, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "server".to_string(),
        path.as_str(),
        "--ring".into(),
        (64 << 10).to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn spawn(args: &[String]) -> Peer {
    Peer::spawn(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

async fn echo(client: &ShmClient, payload: &[u8]) -> Result<Vec<u8>, ClientError> {
    let (_, mut stream) = client
        .start_request(KIND_ECHO, payload.len(), |b| b.copy_from_slice(payload))
        .await?;
    match stream.next().await {
        Some(Ok(chunk)) => {
            assert!(chunk.last, "an echo is one frame");
            Ok(chunk.payload.to_vec())
        }
        Some(Err(e)) => Err(e),
        None => panic!("echo stream ended without a frame"),
    }
}

async fn wait_detached(client: &ShmClient) {
    let mut states = client.subscribe();
    tokio::time::timeout(WAIT, states.wait_for(|s| *s == ConnectionState::Detached))
        .await
        .expect("client notices the loss within the wait bound")
        .expect("client alive");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_to_sixteen_concurrent_streams_arrive_intact_from_an_engine_process() {
    let _watchdog = Watchdog::new(
        "one_to_sixteen_concurrent_streams",
        Duration::from_secs(120),
    );
    let path = SegmentPath::new("streams");
    let mut engine = spawn(&server_args(&path, &["--liveness-ms", "3000"]));
    engine.expect_line("READY");
    let client = ShmClient::connect(path.config(RELAXED_LIVENESS)).unwrap();
    client.wait_attached(WAIT).await.unwrap();
    for streams in 1..=16usize {
        // 64 chunks of 350..1050 bytes per stream through a 64 KiB ring: many laps, padding at
        // every offset, and backpressure when 16 streams share it.
        tokio::time::timeout(WAIT, run_streams(&client, streams, 64, 700, streams as u64))
            .await
            .unwrap_or_else(|_| panic!("{streams} streams finished within {WAIT:?}"))
            .unwrap_or_else(|e| panic!("{streams} streams: {e}"));
    }
    // Payloads of every size up to the largest frame echo back intact.
    let max = client.max_payload().unwrap();
    for len in [0, 1, 15, 16, 17, 4095, 4096, max] {
        let payload: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        assert_eq!(
            echo(&client, &payload).await.unwrap(),
            payload,
            "echo of {len} bytes"
        );
    }
    let too_large = client
        .start_request(KIND_ECHO, max + 1, |_| unreachable!())
        .await
        .unwrap_err();
    assert_eq!(
        too_large,
        ClientError::Send(zerolayer_shm::SendError::FrameTooLarge { len: max + 1, max })
    );
    client.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_engine_fails_every_in_flight_stream_with_peer_gone() {
    let _watchdog = Watchdog::new("killing_the_engine", Duration::from_secs(120));
    let path = SegmentPath::new("kill-engine");
    let mut engine = spawn(&server_args(&path, &[]));
    engine.expect_line("READY");
    let client = ShmClient::connect(path.config(CRASH_LIVENESS)).unwrap();
    client.wait_attached(WAIT).await.unwrap();
    // Four slow streams (a chunk every 20 ms: they would run for 20 s) and two requests the
    // engine never answers.
    let mut streams = Vec::new();
    for i in 0..4u64 {
        let spec = StreamSpec {
            chunks: 1000,
            chunk_len: 256,
            seed: i,
            delay_us: 20_000,
        };
        let (_, mut stream) = start_stream(&client, spec).await.unwrap();
        let first = tokio::time::timeout(WAIT, stream.next())
            .await
            .expect("first chunk in time");
        assert!(
            matches!(first, Some(Ok(_))),
            "stream {i} is mid-flight: {first:?}"
        );
        streams.push(stream);
    }
    for _ in 0..2 {
        let (_, stream) = client.start_request(KIND_HANG, 0, |_| {}).await.unwrap();
        engine.expect_line("HANGING");
        streams.push(stream);
    }
    let killed_at = Instant::now();
    engine.kill9();
    for (i, mut stream) in streams.into_iter().enumerate() {
        let error = tokio::time::timeout(WAIT, async {
            loop {
                match stream.next().await {
                    Some(Ok(_)) => continue, // chunks already in the ring
                    Some(Err(e)) => return e,
                    None => panic!("stream {i} ended without an error"),
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("stream {i} got its error within {WAIT:?}"));
        assert_eq!(
            error,
            ClientError::PeerGone {
                reason: GoneReason::HeartbeatTimeout
            },
            "stream {i}"
        );
    }
    let detected = killed_at.elapsed();
    println!(
        "engine death noticed and every in-flight request failed {detected:?} after the kill \
         (liveness timeout {CRASH_LIVENESS:?}, heartbeat {:?})",
        ShmConfig::new("x").unwrap().heartbeat_interval
    );
    assert_eq!(client.state(), ConnectionState::Detached);
    assert_eq!(echo(&client, b"x").await, Err(ClientError::NotAttached));
    client.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_is_reattached_by_the_running_front() {
    let _watchdog = Watchdog::new("a_restarted_engine_is_reattached", Duration::from_secs(120));
    let path = SegmentPath::new("restart-engine");
    let mut first = spawn(&server_args(&path, &[]));
    let ready = first.expect_line("READY");
    let client = ShmClient::connect(path.config(CRASH_LIVENESS)).unwrap();
    let (generation, session) = client.wait_attached(WAIT).await.unwrap();
    assert_eq!(ready, format!("READY generation={generation}"));
    assert_eq!(echo(&client, b"before").await.unwrap(), b"before");

    first.kill9();
    wait_detached(&client).await;
    let mut second = spawn(&server_args(&path, &[]));
    let ready = second.expect_line("READY");
    // The new engine found the dead one's segment, and took the next generation.
    assert_eq!(ready, format!("READY generation={}", generation + 1));
    let (new_generation, new_session) = client.wait_attached(WAIT).await.unwrap();
    assert_eq!(new_generation, generation + 1);
    assert_ne!(new_session, session);
    assert_eq!(echo(&client, b"after").await.unwrap(), b"after");
    run_streams(&client, 4, 32, 500, 9).await.unwrap();
    client.shutdown();
}

/// Runs the test-protocol engine in this process; observations arrive on the channel.
struct InProcessEngine {
    server: ShmServer,
    observations: mpsc::Receiver<Observation>,
    stop: std::sync::Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl InProcessEngine {
    fn start(cfg: ShmConfig) -> Self {
        let (server, mut rx) = ShmServer::create(cfg).unwrap();
        let (tx, observations) = mpsc::channel();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (thread_server, thread_stop) = (server.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let observe = move |o: Observation| {
                let _ = tx.send(o);
            };
            serve(&thread_server, &mut rx, &thread_stop, &observe, None)
        });
        InProcessEngine {
            server,
            observations,
            stop,
            thread: Some(thread),
        }
    }

    /// Waits for an observation matching `want`, skipping others.
    fn expect(&self, what: &str, want: impl Fn(&Observation) -> bool) -> Observation {
        let deadline = Instant::now() + WAIT;
        let mut seen = Vec::new();
        loop {
            match self
                .observations
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(o) if want(&o) => return o,
                Ok(o) => seen.push(o),
                Err(_) => panic!("no {what} within {WAIT:?}; saw {seen:?}"),
            }
        }
    }
}

impl Drop for InProcessEngine {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let result = thread.join();
            if !std::thread::panicking() {
                result.expect("engine thread").expect("engine loop");
            }
        }
        self.server.shutdown();
    }
}

#[test]
fn the_engine_survives_a_killed_front_and_serves_the_next_one() {
    let _watchdog = Watchdog::new(
        "the_engine_survives_a_killed_front",
        Duration::from_secs(120),
    );
    let path = SegmentPath::new("kill-front");
    let engine = InProcessEngine::start(path.config(CRASH_LIVENESS));
    let client_args = |hold: bool| {
        let mut args = vec![
            "client".to_string(),
            path.as_str(),
            "--streams".into(),
            "4".into(),
        ];
        args.extend(["--liveness-ms".to_string(), "3000".to_string()]);
        if hold {
            args.push("--hold".into());
        }
        args
    };
    let mut front = spawn(&client_args(true));
    let Observation::Attached(first_session) =
        engine.expect("attach", |o| matches!(o, Observation::Attached(_)))
    else {
        unreachable!()
    };
    front.expect_line("STREAMS_OK");
    front.expect_line("HOLDING");
    let Observation::Hanging(held) =
        engine.expect("held request", |o| matches!(o, Observation::Hanging(_)))
    else {
        unreachable!()
    };
    let killed_at = Instant::now();
    front.kill9();
    let gone = engine.expect("the dead front's session end", |o| {
        matches!(o, Observation::Gone { .. })
    });
    println!(
        "front death noticed by the engine {:?} after the kill (liveness timeout {CRASH_LIVENESS:?})",
        killed_at.elapsed()
    );
    assert_eq!(
        gone,
        Observation::Gone {
            session: first_session,
            reason: GoneReason::HeartbeatTimeout,
            in_flight: vec![held]
        }
    );
    assert_eq!(engine.server.session(), None);

    // A new front process attaches to the same, still running engine and works.
    let mut next = spawn(&client_args(false));
    let Observation::Attached(second_session) =
        engine.expect("second attach", |o| matches!(o, Observation::Attached(_)))
    else {
        unreachable!()
    };
    assert_ne!(second_session, first_session);
    next.expect_line("STREAMS_OK");
    assert!(next.wait_success(), "the second front exits cleanly");
    let gone = engine.expect("the second front's detach", |o| {
        matches!(o, Observation::Gone { .. })
    });
    assert_eq!(
        gone,
        Observation::Gone {
            session: second_session,
            reason: GoneReason::Detached,
            in_flight: vec![]
        }
    );
}

#[test]
fn corrupt_headers_from_a_hostile_engine_are_rejected_with_typed_errors() {
    let _watchdog = Watchdog::new("corrupt_headers", Duration::from_secs(120));
    type Check = fn(&HeaderError) -> bool;
    let cases: [(&str, Check); 4] = [
        ("magic", |e| {
            matches!(e, HeaderError::BadMagic { found: 0x0BAD_0BAD })
        }),
        ("version", |e| {
            matches!(e, HeaderError::UnsupportedVersion { found: 99, .. })
        }),
        ("ring-capacity", |e| {
            matches!(
                e,
                HeaderError::BadRing {
                    ring: "response",
                    capacity: 12_345,
                    ..
                }
            )
        }),
        ("segment-size", |e| {
            matches!(
                e,
                HeaderError::SizeMismatch {
                    header: 0x100_0000_0000,
                    ..
                }
            )
        }),
    ];
    for (field, expected) in cases {
        let path = SegmentPath::new("bad-header");
        let mut engine = spawn(&server_args(&path, &["--corrupt-header", field]));
        engine.expect_line("READY");
        let mut cfg = path.config(RELAXED_LIVENESS);
        cfg.attach_timeout = Duration::from_millis(500);
        let err = ShmClient::attach(cfg, Duration::from_secs(1)).unwrap_err();
        match err {
            AttachError::TimedOut {
                last_error: Some(SegmentError::Header { source, .. }),
                ..
            } => {
                assert!(expected(&source), "{field}: got {source:?}");
            }
            other => panic!("{field}: expected a header error, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_response_frame_fails_the_request_and_the_front_reattaches() {
    let _watchdog = Watchdog::new("a_corrupt_response_frame", Duration::from_secs(120));
    type Check = fn(&FrameError) -> bool;
    let cases: [(&str, Check); 2] = [
        ("bad-len", |e| {
            matches!(
                e,
                FrameError::LengthOutOfBounds {
                    len: 0x7FFF_FFF0,
                    ..
                }
            )
        }),
        ("bad-head", |e| {
            matches!(e, FrameError::HeadOutOfRange { .. })
        }),
    ];
    for (mode, expected) in cases {
        let path = SegmentPath::new("bad-response");
        let mut engine = spawn(&server_args(
            &path,
            &["--liveness-ms", "3000", "--hostile-response", mode],
        ));
        engine.expect_line("READY");
        let client = ShmClient::connect(path.config(RELAXED_LIVENESS)).unwrap();
        let (_, session) = client.wait_attached(WAIT).await.unwrap();
        let (_, mut stream) = client
            .start_request(KIND_ECHO, 4, |b| b.copy_from_slice(b"ping"))
            .await
            .unwrap();
        engine.expect_line("CORRUPTED");
        let got = tokio::time::timeout(WAIT, stream.next())
            .await
            .expect("error within the wait bound");
        match got {
            Some(Err(ClientError::PeerGone {
                reason: GoneReason::Corrupt(e),
            })) => {
                assert!(expected(&e), "{mode}: got {e:?}")
            }
            other => panic!("{mode}: expected a corrupt-ring error, got {other:?}"),
        }
        // The engine process is alive: the front detaches and gets a fresh session.
        let gone = engine.expect_line("GONE");
        assert!(gone.contains("reason=detached"), "{mode}: {gone}");
        let (_, new_session) = client.wait_attached(WAIT).await.unwrap();
        assert_ne!(new_session, session, "{mode}");
        client.shutdown();
    }
}

#[test]
fn a_corrupt_request_frame_ends_that_front_session_but_not_the_engine() {
    let _watchdog = Watchdog::new("a_corrupt_request_frame", Duration::from_secs(120));
    type Check = fn(&FrameError) -> bool;
    let cases: [(&str, Check); 3] = [
        ("bad-len", |e| {
            matches!(
                e,
                FrameError::LengthOutOfBounds {
                    len: 0x7FFF_FFF0,
                    ..
                }
            )
        }),
        ("bad-head", |e| {
            matches!(e, FrameError::HeadOutOfRange { head: 8, .. })
        }),
        ("bad-kind", |e| {
            matches!(e, FrameError::BadControlFrame { kind: 0xFF77, .. })
        }),
    ];
    let path = SegmentPath::new("bad-request");
    let engine = InProcessEngine::start(path.config(RELAXED_LIVENESS));
    for (mode, expected) in cases {
        let mut hostile = spawn(&[
            "hostile-client".to_string(),
            path.as_str(),
            "--mode".into(),
            mode.into(),
        ]);
        engine.expect("hostile attach", |o| matches!(o, Observation::Attached(_)));
        hostile.expect_line("CORRUPTED");
        match engine.expect("the hostile session's end", |o| {
            matches!(o, Observation::Gone { .. })
        }) {
            Observation::Gone {
                reason: GoneReason::Corrupt(e),
                in_flight,
                ..
            } => {
                assert!(expected(&e), "{mode}: got {e:?}");
                assert!(in_flight.is_empty());
            }
            other => panic!("{mode}: expected a corrupt-ring session end, got {other:?}"),
        }
        hostile.kill9();
    }
    // The engine kept running: an honest front attaches and works.
    let mut front = spawn(&[
        "client".to_string(),
        path.as_str(),
        "--streams".into(),
        "8".into(),
    ]);
    front.expect_line("STREAMS_OK");
    assert!(front.wait_success());
}
