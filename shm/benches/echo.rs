//! Echo round-trip latency, side by side in one run: the shared-memory rings (spin and
//! blocking/futex), the full shared-memory stack (`ShmServer` + async `ShmClient`, i.e. with
//! the reader thread and the tokio hand-off), a Unix domain socket, and loopback TCP. The
//! echo peer is a *thread* of this process in every mode (the rings are the same code and
//! memory layout whether the peer is a thread or a process; the multi-process tests cover
//! correctness across processes).
//!
//! A second table compares the two ways of waking a tokio task from a foreign thread that the
//! async adapter could use: a `tokio::sync::mpsc` send (what the client does) and an eventfd
//! write awaited through `AsyncFd`.
//!
//! Run: `cargo bench -p zerolayer-shm --bench echo -- [--quick] [--only TEXT]
//! [--pin none|same|separate]`. `--pin` places the measuring thread and the echo thread on
//! the same CPU or on CPUs 0 and 1 (the client's reader thread in the "stack" modes is not
//! pinned). Prints Markdown tables (p50/p99/mean in microseconds).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use zerolayer_shm::channel::{Consumer, Producer, ring_in_memory};
use zerolayer_shm::{Incoming, ShmClient, ShmConfig, ShmServer, WaitStrategy};

const SIZES: [usize; 3] = [64, 1024, 64 * 1024];

/// CPU placement: (the measuring thread's CPU, the echo peer thread's CPU); `None` = let the
/// scheduler decide. Set once from `--pin`.
static PLACEMENT: std::sync::OnceLock<(Option<usize>, Option<usize>)> = std::sync::OnceLock::new();

/// Pins the calling thread to `cpu` (no-op for `None`).
fn pin(cpu: Option<usize>) {
    if let Some(cpu) = cpu {
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu);
        rustix::thread::sched_setaffinity(None, &set).expect("sched_setaffinity");
    }
}

/// Pins the calling thread as the echo peer.
fn pin_peer() {
    pin(PLACEMENT.get().and_then(|p| p.1));
}
const RING: usize = 1 << 20;

struct Stats {
    p50: f64,
    p99: f64,
    mean: f64,
}

fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let pick = |q: f64| us(samples[((samples.len() as f64 - 1.0) * q).round() as usize]);
    let mean = samples.iter().map(|d| us(*d)).sum::<f64>() / samples.len() as f64;
    Stats {
        p50: pick(0.50),
        p99: pick(0.99),
        mean,
    }
}

fn iterations(size: usize, quick: bool) -> usize {
    let base = if size >= 64 * 1024 { 3_000 } else { 20_000 };
    if quick { base / 10 } else { base }
}

fn payload(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 7 % 251) as u8).collect()
}

/// The rings between two threads, through the low-level blocking API.
fn bench_rings(wait: WaitStrategy, size: usize, n: usize) -> Vec<Duration> {
    let (req_tx, mut req_rx): (Producer, Consumer) = ring_in_memory(RING, wait).unwrap();
    let (resp_tx, mut resp_rx) = ring_in_memory(RING, wait).unwrap();
    let data = payload(size);
    let long = Duration::from_secs(30);
    std::thread::scope(|s| {
        s.spawn(move || {
            pin_peer();
            loop {
                let frame = req_rx.recv(long).unwrap().expect("request within 30 s");
                if frame.kind() == 2 {
                    return;
                }
                let len = frame.payload().len();
                resp_tx
                    .send(
                        frame.id(),
                        1,
                        true,
                        len,
                        |b| b.copy_from_slice(frame.payload()),
                        long,
                    )
                    .unwrap();
            }
        });
        let mut samples = Vec::with_capacity(n);
        for i in 0..(n + n / 10) {
            let start = Instant::now();
            req_tx
                .send(i as u64, 1, false, size, |b| b.copy_from_slice(&data), long)
                .unwrap();
            let frame = resp_rx.recv(long).unwrap().expect("response within 30 s");
            assert_eq!(frame.payload().len(), size);
            drop(frame);
            if i >= n / 10 {
                samples.push(start.elapsed());
            }
        }
        req_tx.send(0, 2, false, 0, |_| {}, long).unwrap();
        samples
    })
}

/// `ShmServer` in a thread + `ShmClient` on a current-thread tokio runtime, over a real
/// segment in /dev/shm.
fn bench_stack(wait: WaitStrategy, size: usize, n: usize) -> Vec<Duration> {
    let name = format!("zl-bench-echo-{}-{}", std::process::id(), size);
    let mut cfg = ShmConfig::new(&name).unwrap();
    cfg.wait = wait;
    cfg.request_ring_bytes = RING;
    cfg.response_ring_bytes = RING;
    let (server, mut rx) = ShmServer::create(cfg.clone()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let engine = {
        let (server, stop) = (server.clone(), stop.clone());
        std::thread::spawn(move || {
            pin_peer();
            while !stop.load(Ordering::Acquire) {
                if let Some(Incoming::Request(frame)) =
                    rx.recv_timeout(Duration::from_millis(50)).unwrap()
                {
                    let len = frame.payload().len();
                    server
                        .send(frame.key(), 1, true, len, |b| {
                            b.copy_from_slice(frame.payload())
                        })
                        .unwrap();
                }
            }
        })
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let data = payload(size);
    let samples = runtime.block_on(async {
        let client = ShmClient::connect(cfg).unwrap();
        client.wait_attached(Duration::from_secs(30)).await.unwrap();
        let mut samples = Vec::with_capacity(n);
        for i in 0..(n + n / 10) {
            let start = Instant::now();
            let (_, mut stream) = client
                .start_request(1, size, |b| b.copy_from_slice(&data))
                .await
                .unwrap();
            let chunk = stream.next().await.unwrap().unwrap();
            assert_eq!(chunk.payload.len(), size);
            if i >= n / 10 {
                samples.push(start.elapsed());
            }
        }
        client.shutdown();
        samples
    });
    stop.store(true, Ordering::Release);
    engine.join().unwrap();
    server.shutdown();
    samples
}

/// Length-prefixed echo over a byte stream.
fn echo_stream<S: Read + Write>(mut stream: S) {
    let mut len = [0u8; 4];
    let mut buf = Vec::new();
    while stream.read_exact(&mut len).is_ok() {
        let n = u32::from_le_bytes(len) as usize;
        if n == 0 {
            return;
        }
        buf.resize(n, 0);
        stream.read_exact(&mut buf).unwrap();
        let mut out = Vec::with_capacity(4 + n);
        out.extend_from_slice(&len);
        out.extend_from_slice(&buf);
        stream.write_all(&out).unwrap();
    }
}

fn ping_stream<S: Read + Write>(stream: &mut S, size: usize, n: usize) -> Vec<Duration> {
    let mut message = (size as u32).to_le_bytes().to_vec();
    message.extend_from_slice(&payload(size));
    let mut reply = vec![0u8; 4 + size];
    let mut samples = Vec::with_capacity(n);
    for i in 0..(n + n / 10) {
        let start = Instant::now();
        stream.write_all(&message).unwrap();
        stream.read_exact(&mut reply).unwrap();
        if i >= n / 10 {
            samples.push(start.elapsed());
        }
    }
    stream.write_all(&0u32.to_le_bytes()).unwrap();
    samples
}

fn bench_uds(size: usize, n: usize) -> Vec<Duration> {
    let (mut a, b) = UnixStream::pair().unwrap();
    let peer = std::thread::spawn(move || {
        pin_peer();
        echo_stream(b)
    });
    let samples = ping_stream(&mut a, size, n);
    peer.join().unwrap();
    samples
}

fn bench_tcp(size: usize, n: usize) -> Vec<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        pin_peer();
        let (stream, _) = listener.accept().unwrap();
        stream.set_nodelay(true).unwrap();
        echo_stream(stream);
    });
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_nodelay(true).unwrap();
    let samples = ping_stream(&mut stream, size, n);
    peer.join().unwrap();
    samples
}

/// Round trip task → thread (the thread spins on an atomic) → task (through the mechanism
/// under test). The spin leg is the same for both, so the difference is the hand-off.
fn bench_handoff(eventfd: bool, n: usize) -> Vec<Duration> {
    use tokio::io::unix::AsyncFd;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ping = Arc::new(AtomicU64::new(0));
    let fd = rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
    )
    .unwrap();
    let fd = Arc::new(fd);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
    let thread = {
        let (ping, fd) = (ping.clone(), fd.clone());
        std::thread::spawn(move || {
            pin_peer();
            let mut seen = 0;
            loop {
                let v = ping.load(Ordering::Acquire);
                if v == u64::MAX {
                    return;
                }
                if v != seen {
                    seen = v;
                    if eventfd {
                        rustix::io::write(&*fd, &1u64.to_ne_bytes()).unwrap();
                    } else {
                        tx.send(v).unwrap();
                    }
                }
                std::hint::spin_loop();
            }
        })
    };
    let samples = runtime.block_on(async {
        // SAFETY: the `Arc<OwnedFd>` keeps the eventfd open, unchanged, for as long as the
        // `AsyncFd` (a local of this block) lives.
        let async_fd =
            unsafe { AsyncFd::register_with_interest(fd.clone(), tokio::io::Interest::READABLE) }
                .map_err(|e| e.to_string())
                .unwrap();
        let mut samples = Vec::with_capacity(n);
        for i in 1..=(n + n / 10) as u64 {
            let start = Instant::now();
            ping.store(i, Ordering::Release);
            if eventfd {
                loop {
                    let mut guard = async_fd.readable().await.unwrap();
                    let mut buf = [0u8; 8];
                    match rustix::io::read(&**guard.get_inner(), &mut buf) {
                        Ok(_) => break,
                        Err(rustix::io::Errno::AGAIN) => guard.clear_ready(),
                        Err(e) => panic!("{e}"),
                    }
                }
            } else {
                rx.recv().await.unwrap();
            }
            if i as usize > n / 10 {
                samples.push(start.elapsed());
            }
        }
        samples
    });
    ping.store(u64::MAX, Ordering::Release);
    thread.join().unwrap();
    samples
}

/// Rounds per mode: the modes take turns, so a burst of load from elsewhere spreads over
/// all of them instead of spoiling one.
const ROUNDS: usize = 5;

type Bench = Box<dyn Fn(usize, usize) -> Vec<Duration>>;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    if args.iter().any(|a| a == "--list") {
        return; // `cargo bench -- --list` compatibility
    }
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let park = WaitStrategy::SpinThenPark {
        spin: Duration::ZERO,
    };
    let default = WaitStrategy::default();
    let modes: Vec<(&str, Bench)> = vec![
        (
            "shm rings, spin",
            Box::new(|size, n| bench_rings(WaitStrategy::Spin, size, n)),
        ),
        (
            "shm rings, blocking (futex at once)",
            Box::new(move |size, n| bench_rings(park, size, n)),
        ),
        (
            "shm rings, default (20 µs spin, then futex)",
            Box::new(move |size, n| bench_rings(default, size, n)),
        ),
        (
            "shm stack (server + async client), spin",
            Box::new(|size, n| bench_stack(WaitStrategy::Spin, size, n)),
        ),
        (
            "shm stack (server + async client), blocking",
            Box::new(move |size, n| bench_stack(park, size, n)),
        ),
        (
            "shm stack (server + async client), default",
            Box::new(move |size, n| bench_stack(default, size, n)),
        ),
        ("unix domain socket", Box::new(bench_uds)),
        ("loopback TCP", Box::new(bench_tcp)),
    ];
    let modes: Vec<_> = modes
        .into_iter()
        .filter(|(name, _)| only.as_ref().is_none_or(|o| name.contains(o.as_str())))
        .collect();
    println!(
        "| mode | payload | p50 µs | p99 µs | mean µs | p50 of the {ROUNDS} rounds, min–max µs | samples |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for size in SIZES {
        let n = iterations(size, quick) / ROUNDS;
        let mut all: Vec<Vec<Duration>> = vec![Vec::new(); modes.len()];
        let mut round_p50: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
        for _ in 0..ROUNDS {
            for (i, (_, bench)) in modes.iter().enumerate() {
                let samples = bench(size, n);
                round_p50[i].push(stats(samples.clone()).p50);
                all[i].extend(samples);
            }
        }
        for (i, (name, _)) in modes.iter().enumerate() {
            let count = all[i].len();
            let s = stats(std::mem::take(&mut all[i]));
            let lo = round_p50[i].iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = round_p50[i].iter().cloned().fold(0.0, f64::max);
            println!(
                "| {name} | {size} B | {:.2} | {:.2} | {:.2} | {lo:.2}–{hi:.2} | {count} |",
                s.p50, s.p99, s.mean
            );
        }
    }
    if only
        .as_ref()
        .is_some_and(|o| !"hand-off".contains(o.as_str()))
    {
        return;
    }
    println!();
    println!(
        "| thread → tokio task hand-off (round trip incl. a spin leg) | p50 µs | p99 µs | mean µs | samples |"
    );
    println!("|---|---:|---:|---:|---:|");
    let n = if quick { 2_000 } else { 20_000 };
    for (mode, eventfd) in [("tokio mpsc (chosen)", false), ("eventfd + AsyncFd", true)] {
        let samples = bench_handoff(eventfd, n);
        let count = samples.len();
        let s = stats(samples);
        println!(
            "| {mode} | {:.2} | {:.2} | {:.2} | {count} |",
            s.p50, s.p99, s.mean
        );
    }
}
