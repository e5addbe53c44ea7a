//! System-level micro-benchmarks, in one place (crates keep their own unit benches).
//!
//! - `handle_verify/*`: a context handle's verification on the fast path (bytes equal to the
//!   slot's last issued handle: precheck + constant-time compare) and with a full Ed25519
//!   `verify_strict` (zerolayer-handle).
//! - `slot_map/*`: the engine's slot map (`zerolayer_engine::kv::KvCache`) at its default
//!   capacity of 65,536 conversations: lookup hit and miss, insert into a full map (each insert
//!   amortises one LRU eviction of 5 % every 3,277 inserts), and the single insert that
//!   evicts.
//! - `transport/*`: one request/response round trip between two threads over the
//!   shared-memory rings (`zerolayer_shm::channel::ring_in_memory`, default wait strategy =
//!   20 µs spin then futex), a Unix domain socket pair and loopback TCP (`TCP_NODELAY`), for
//!   64 B and 4 KiB payloads.
//! - `mode_overhead/*`: one `Generate` of exactly one token (`max_tokens` 1, a 32-byte prompt,
//!   no handle) through each deployment mode of `dummy:tiny`, started once as real processes
//!   (the `zerolayer` binary: `$ZEROLAYER_BIN`, else `target/<profile>/zerolayer` — build it
//!   first with `cargo build --release -p zerolayer-cli`). Skipped with a message when the
//!   binary is missing; layered is skipped when `redis-server` is missing. Criterion measures
//!   the modes one after the other; `zerolayer bench compare --workload single-shot
//!   --max-tokens 1` measures the same thing interleaved in rounds, which is the figure to
//!   quote on a shared machine.
//!
//! Run: `cargo bench -p zerolayer-bench --bench micro` (append a filter such as `transport`).

use std::{
    hint::black_box,
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    os::unix::net::UnixStream,
    path::PathBuf,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use zerolayer_bench::launch::{Launcher, Mode};
use zerolayer_client::{Client, ClientConfig};
use zerolayer_engine::{config::DEFAULT_SLOT_CAPACITY, kv::KvCache};
use zerolayer_handle::{Claims, KeyRing, PromptHash, SigningKey, TenantTag};
use zerolayer_model::{KvCacheConfig, splitmix64};
use zerolayer_proto::v1;
use zerolayer_shm::{WaitStrategy, channel::ring_in_memory};

/// Short measurements: the development machine has two shared cores, so many short samples
/// spread over time beat a few long ones.
fn config() -> Criterion {
    Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn handle_verify(c: &mut Criterion) {
    let mut g = c.benchmark_group("handle_verify");
    let ring = KeyRing::new(SigningKey::from_seed(1, &[7; 32]));
    let now = now_s();
    let claims = Claims {
        session_id: 0x1234_5678_9abc_def0,
        tenant: TenantTag::for_tenant("acme"),
        prompt_hash: PromptHash::compute("acme", "You are a helpful assistant.", "Hello!"),
        kv_offset: 512,
        epoch: 1,
        expires_at: now + 86_400,
    };
    let tenant = claims.tenant;
    let handle = ring.issue(claims);
    let bytes = handle.as_bytes().to_vec();
    g.bench_function("fast_path", |b| {
        b.iter(|| {
            ring.verify(black_box(&bytes), black_box(&tenant), now, Some(&handle))
                .expect("valid")
        })
    });
    g.bench_function("full_verify", |b| {
        b.iter(|| {
            ring.verify(black_box(&bytes), black_box(&tenant), now, None)
                .expect("valid")
        })
    });
    g.finish();
}

/// A full slot map: 65,536 idle slots inserted in order.
fn full_map() -> KvCache {
    let mut kv = KvCache::new(
        DEFAULT_SLOT_CAPACITY,
        KvCacheConfig {
            block_size: 16,
            num_blocks: 1024,
        },
    );
    let (t, h) = (TenantTag::for_tenant("t"), PromptHash::from_bytes([1; 16]));
    for i in 0..DEFAULT_SLOT_CAPACITY as u64 {
        // Invariant: distinct keys into a map with room for all of them.
        kv.insert(splitmix64(i), t, h, 0)
            .expect("room for every key");
    }
    kv
}

fn slot_map(c: &mut Criterion) {
    let mut g = c.benchmark_group("slot_map");
    let mut kv = full_map();
    let mut i = 0u64;
    g.bench_function("lookup_hit_65536", |b| {
        b.iter(|| {
            i = (i + 7919) % DEFAULT_SLOT_CAPACITY as u64;
            black_box(kv.lookup(splitmix64(i)))
        })
    });
    g.bench_function("lookup_miss_65536", |b| {
        b.iter(|| {
            i += 1;
            black_box(kv.lookup(splitmix64(i) ^ 0xdead))
        })
    });
    let (t, h) = (TenantTag::for_tenant("t"), PromptHash::from_bytes([1; 16]));
    let mut next = DEFAULT_SLOT_CAPACITY as u64;
    g.bench_function("insert_with_eviction_65536", |b| {
        b.iter(|| {
            next += 1;
            // Invariant: every slot is idle, so a full map always evicts to make room.
            black_box(
                kv.insert(splitmix64(next), t, h, 0)
                    .expect("eviction makes room"),
            )
        })
    });
    g.sample_size(10);
    g.bench_function("insert_that_evicts_65536", |b| {
        b.iter_batched_ref(
            full_map,
            |kv| {
                next += 1;
                // Invariant: as above.
                kv.insert(splitmix64(next), t, h, 0)
                    .expect("eviction makes room")
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

/// Ring size of the in-memory channel: the front's default ring (1 MiB).
const RING_BYTES: usize = 1 << 20;

/// How long a ring operation may wait before the benchmark fails instead of hanging.
const RING_TIMEOUT: Duration = Duration::from_secs(30);

/// `iters` round trips over the rings with an echo thread.
fn rings(size: usize, iters: u64) -> Duration {
    // Invariant: RING_BYTES is a valid ring size.
    let (req_tx, mut req_rx) = ring_in_memory(RING_BYTES, WaitStrategy::default()).expect("ring");
    let (resp_tx, mut resp_rx) = ring_in_memory(RING_BYTES, WaitStrategy::default()).expect("ring");
    let data = vec![7u8; size];
    std::thread::scope(|s| {
        s.spawn(move || {
            loop {
                let frame = req_rx
                    .recv(RING_TIMEOUT)
                    .expect("recv")
                    .expect("request in time");
                if frame.kind() == 2 {
                    return;
                }
                let n = frame.payload().len();
                resp_tx
                    .send(
                        frame.id(),
                        1,
                        true,
                        n,
                        |b| b.copy_from_slice(frame.payload()),
                        RING_TIMEOUT,
                    )
                    .expect("send");
            }
        });
        let start = Instant::now();
        for i in 0..iters {
            req_tx
                .send(
                    i,
                    1,
                    false,
                    size,
                    |b| b.copy_from_slice(&data),
                    RING_TIMEOUT,
                )
                .expect("send");
            let frame = resp_rx
                .recv(RING_TIMEOUT)
                .expect("recv")
                .expect("response in time");
            black_box(frame.payload().len());
        }
        let elapsed = start.elapsed();
        req_tx
            .send(0, 2, false, 0, |_| {}, RING_TIMEOUT)
            .expect("stop");
        elapsed
    })
}

/// Length-prefixed echo over a byte stream until a zero length.
fn echo<S: Read + Write>(mut s: S) {
    let mut len = [0u8; 4];
    let mut buf = Vec::new();
    while s.read_exact(&mut len).is_ok() {
        let n = u32::from_le_bytes(len) as usize;
        if n == 0 {
            return;
        }
        buf.resize(n, 0);
        if s.read_exact(&mut buf).is_err() {
            return;
        }
        let mut out = len.to_vec();
        out.extend_from_slice(&buf);
        if s.write_all(&out).is_err() {
            return;
        }
    }
}

fn ping<S: Read + Write>(s: &mut S, size: usize, iters: u64) -> Duration {
    let mut msg = (size as u32).to_le_bytes().to_vec();
    msg.extend(std::iter::repeat_n(7u8, size));
    let mut reply = vec![0u8; 4 + size];
    let start = Instant::now();
    for _ in 0..iters {
        s.write_all(&msg).expect("write");
        s.read_exact(&mut reply).expect("read");
    }
    let elapsed = start.elapsed();
    s.write_all(&0u32.to_le_bytes()).expect("stop");
    elapsed
}

fn uds(size: usize, iters: u64) -> Duration {
    let (mut a, b) = UnixStream::pair().expect("socketpair");
    let peer = std::thread::spawn(move || echo(b));
    let d = ping(&mut a, size, iters);
    peer.join().expect("echo thread");
    d
}

fn tcp(size: usize, iters: u64) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let peer = std::thread::spawn(move || {
        let (s, _) = listener.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        echo(s);
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let d = ping(&mut s, size, iters);
    peer.join().expect("echo thread");
    d
}

fn transport(c: &mut Criterion) {
    let mut g = c.benchmark_group("transport");
    for size in [64usize, 4096] {
        g.bench_function(format!("shm_rings_{size}B"), |b| {
            b.iter_custom(|n| rings(size, n))
        });
        g.bench_function(format!("unix_socket_{size}B"), |b| {
            b.iter_custom(|n| uds(size, n))
        });
        g.bench_function(format!("tcp_loopback_{size}B"), |b| {
            b.iter_custom(|n| tcp(size, n))
        });
    }
    g.finish();
}

/// The `zerolayer` binary, if built.
fn zerolayer_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ZEROLAYER_BIN") {
        return Some(PathBuf::from(p));
    }
    // target/<profile>/deps/micro-<hash> → target/<profile>/zerolayer
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("zerolayer");
    bin.exists().then_some(bin)
}

fn have_redis() -> bool {
    std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn mode_overhead(c: &mut Criterion) {
    let Some(bin) = zerolayer_bin() else {
        eprintln!(
            "SKIPPED mode_overhead: the zerolayer binary is not built (cargo build --release -p zerolayer-cli, or set ZEROLAYER_BIN)"
        );
        return;
    };
    let work = tempfile::Builder::new()
        .prefix("zl-micro-")
        .tempdir()
        .expect("tempdir");
    let mut launcher = Launcher::new(bin, "dummy:tiny", work.path());
    launcher.metrics = false;
    let mut modes = vec![Mode::Collapsed, Mode::Split];
    if have_redis() {
        modes.push(Mode::Layered);
    } else {
        eprintln!("SKIPPED mode_overhead/layered: redis-server not found");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let deployments: Vec<_> = modes
        .iter()
        .map(|&m| launcher.start(m).expect("deployment starts"))
        .collect();
    let request = v1::GenerateRequest {
        messages: vec![v1::Message {
            role: v1::Role::User as i32,
            content: "Once upon a time, a little robot".into(),
        }],
        sampling: Some(v1::SamplingParams {
            max_tokens: Some(1),
            seed: Some(0),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut g = c.benchmark_group("mode_overhead");
    for d in &deployments {
        let client = {
            let _guard = runtime.enter();
            Client::new(ClientConfig::new(d.endpoint.clone())).expect("client")
        };
        g.bench_function(format!("generate_1_token_{}", d.mode), |b| {
            b.iter_custom(|n| {
                runtime.block_on(async {
                    let start = Instant::now();
                    for _ in 0..n {
                        let reply = client
                            .generate(request.clone())
                            .await
                            .expect("generate")
                            .collect()
                            .await
                            .expect("stream");
                        black_box(reply.token_ids.len());
                    }
                    start.elapsed()
                })
            })
        });
    }
    g.finish();
    drop(deployments);
}

criterion_group! {
    name = micro;
    config = config();
    targets = handle_verify, slot_map, transport, mode_overhead
}
criterion_main!(micro);
