//! A peer process for the multi-process tests (and manual experiments, e.g. between two
//! containers): plays the engine (`server`), the front (`client`), or a hostile front
//! (`hostile-client`) over the test protocol in `tests/common/proto.rs`.
//!
//! ```text
//! zerolayer-shm-peer server <path> [--ring BYTES] [--heartbeat-ms N] [--liveness-ms N]
//!                                  [--hostile-response bad-len|bad-head] [--corrupt-header FIELD]
//! zerolayer-shm-peer client <path> [--streams N] [--chunks N] [--chunk-len N] [--hold] [--liveness-ms N]
//! zerolayer-shm-peer hostile-client <path> --mode bad-len|bad-head|bad-kind
//! ```
//! Every mode prints one line per milestone on stdout (`READY`, `ATTACHED`, `GONE`, ...),
//! which the tests wait for instead of sleeping. It exits when its stdin closes (the test
//! dropped it), when its parent dies (`PR_SET_PDEATHSIG`), or after `--max-secs` (default 120)
//! — so a failing test never leaves it behind.

#[path = "../../tests/common/proto.rs"]
mod proto;
#[path = "../../tests/common/serve.rs"]
mod serve;
#[path = "../../tests/common/verify.rs"]
mod verify;

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use proto::{KIND_CHUNK, KIND_HANG};
use serve::Observation;
use zerolayer_shm::raw::{RawSegment, offsets};
use zerolayer_shm::{ShmClient, ShmConfig, ShmServer};

/// Parsed command line.
#[derive(Debug, Default)]
struct Args {
    /// The role: `server`, `client` or `hostile-client`.
    mode: String,
    /// The segment path.
    path: PathBuf,
    /// Server: both ring sizes in bytes.
    ring: Option<usize>,
    /// Heartbeat interval override.
    heartbeat_ms: Option<u64>,
    /// Liveness timeout override.
    liveness_ms: Option<u64>,
    /// Server: answer requests with a corrupt response frame (`bad-len`, `bad-head`).
    hostile_response: Option<String>,
    /// Server: corrupt this header field right after creation.
    corrupt_header: Option<String>,
    /// Client: concurrent streams to run and check.
    streams: usize,
    /// Client: chunks per stream.
    chunks: u32,
    /// Client: base chunk length.
    chunk_len: u32,
    /// Client: afterwards, keep one request in flight until killed.
    hold: bool,
    /// Hostile client: which corruption to write.
    hostile_mode: Option<String>,
    /// Exit after this many seconds whatever happens (no orphans).
    max_secs: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut args = Args {
        mode: it.next().ok_or("missing mode")?,
        path: PathBuf::from(it.next().ok_or("missing segment path")?),
        streams: 4,
        chunks: 100,
        chunk_len: 512,
        max_secs: 120,
        ..Args::default()
    };
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |s: String| s.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--ring" => args.ring = Some(number(value()?)? as usize),
            "--heartbeat-ms" => args.heartbeat_ms = Some(number(value()?)?),
            "--liveness-ms" => args.liveness_ms = Some(number(value()?)?),
            "--hostile-response" => args.hostile_response = Some(value()?),
            "--corrupt-header" => args.corrupt_header = Some(value()?),
            "--streams" => args.streams = number(value()?)? as usize,
            "--chunks" => args.chunks = number(value()?)? as u32,
            "--chunk-len" => args.chunk_len = number(value()?)? as u32,
            "--hold" => args.hold = true,
            "--mode" => args.hostile_mode = Some(value()?),
            "--max-secs" => args.max_secs = number(value()?)?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(args)
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn config(args: &Args) -> Result<ShmConfig, String> {
    let mut cfg = ShmConfig::new(&args.path.to_string_lossy()).map_err(|e| e.to_string())?;
    if let Some(ring) = args.ring {
        cfg.request_ring_bytes = ring;
        cfg.response_ring_bytes = ring;
    }
    if let Some(ms) = args.heartbeat_ms {
        cfg.heartbeat_interval = Duration::from_millis(ms);
    }
    if let Some(ms) = args.liveness_ms {
        cfg.liveness_timeout = Duration::from_millis(ms);
    }
    Ok(cfg)
}

/// Exits the process when stdin closes, the parent dies, or the lifetime runs out.
fn install_exit_conditions(max_secs: u64) -> Arc<AtomicBool> {
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let stop = Arc::new(AtomicBool::new(false));
    let stop_stdin = stop.clone();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        let mut line = String::new();
        while stdin.lock().read_line(&mut line).is_ok_and(|n| n > 0) {
            line.clear();
        }
        stop_stdin.store(true, Ordering::Release);
    });
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(max_secs));
        eprintln!("zerolayer-shm-peer: lifetime of {max_secs} s exceeded, exiting");
        std::process::exit(3);
    });
    stop
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("zerolayer-shm-peer: {e}");
            return ExitCode::from(2);
        }
    };
    let stop = install_exit_conditions(args.max_secs);
    let result = match args.mode.as_str() {
        "server" => run_server(&args, &stop),
        "client" => run_client(&args, &stop),
        "hostile-client" => run_hostile_client(&args, &stop),
        other => Err(format!("unknown mode {other}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say(&format!("FAILED {e}"));
            eprintln!("zerolayer-shm-peer: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The engine role.
fn run_server(args: &Args, stop: &AtomicBool) -> Result<(), String> {
    let cfg = config(args)?;
    let (server, mut rx) = ShmServer::create(cfg).map_err(|e| e.to_string())?;
    if let Some(field) = &args.corrupt_header {
        corrupt_header(server.path(), field)?;
    }
    say(&format!("READY generation={}", server.generation()));
    let path = server.path().to_path_buf();
    let hostile_mode = args.hostile_response.clone();
    let hostile = move |id: u64| {
        if let Some(mode) = &hostile_mode {
            match hostile_response(&path, mode, id) {
                Ok(()) => say("CORRUPTED"),
                Err(e) => say(&format!("FAILED {e}")),
            }
        }
    };
    let observe = |observation: Observation| match observation {
        Observation::Attached(session) => say(&format!("ATTACHED session={session}")),
        Observation::Gone {
            session,
            reason,
            in_flight,
        } => say(&format!(
            "GONE session={session} reason={} in_flight={}",
            reason.error_type(),
            in_flight.len()
        )),
        Observation::Cancel(key) => say(&format!("CANCEL id={}", key.id)),
        Observation::Hanging(key) => say(&format!("HANGING id={}", key.id)),
        Observation::SendError(e) => say(&format!("SEND_ERROR {e}")),
    };
    let hostile: Option<&dyn Fn(u64)> = if args.hostile_response.is_some() {
        Some(&hostile)
    } else {
        None
    };
    serve::serve(&server, &mut rx, stop, &observe, hostile)?;
    server.shutdown();
    Ok(())
}

/// Corrupts one header field the way a buggy or hostile server would.
fn corrupt_header(path: &Path, field: &str) -> Result<(), String> {
    let raw = RawSegment::open(path).map_err(|e| e.to_string())?;
    let ok = match field {
        "magic" => raw.store_u64(offsets::MAGIC, 0x0BAD_0BAD),
        "version" => raw.store_u32(offsets::VERSION, 99),
        "ring-capacity" => raw.store_u64(offsets::RESPONSE_CAPACITY, 12_345),
        "segment-size" => raw.store_u64(offsets::SEGMENT_SIZE, 1 << 40),
        other => return Err(format!("unknown header field {other}")),
    };
    if ok {
        Ok(())
    } else {
        Err("header write out of bounds".into())
    }
}

/// Instead of answering, writes a corrupt frame into the response ring.
fn hostile_response(path: &Path, mode: &str, id: u64) -> Result<(), String> {
    let raw = RawSegment::open(path).map_err(|e| e.to_string())?;
    let data = raw
        .load_u64(offsets::RESPONSE_OFFSET)
        .ok_or("no response offset")? as usize;
    let control = offsets::RESPONSE_CONTROL;
    let head = raw
        .load_u64(control + offsets::control::HEAD)
        .ok_or("no head")?;
    let capacity = raw
        .load_u64(offsets::RESPONSE_CAPACITY)
        .ok_or("no capacity")?;
    let at = data + (head % capacity) as usize;
    let ok = match mode {
        "bad-len" => {
            // A chunk claiming 2 GiB of payload, published as 16 bytes.
            let w0 = 0x7FFF_FFF0u64 | (u64::from(KIND_CHUNK) << 32);
            raw.store_u64(at, w0)
                && raw.store_u64(at + 8, id)
                && raw.store_u64(control + offsets::control::HEAD, head + 16)
        }
        "bad-head" => raw.store_u64(control + offsets::control::HEAD, head + 8),
        other => return Err(format!("unknown hostile response mode {other}")),
    };
    if !ok {
        return Err("ring write out of bounds".into());
    }
    raw.wake(control + offsets::control::DATA_SEQ);
    Ok(())
}

/// The front role: attach, run checked streams, optionally hold a request in flight.
fn run_client(args: &Args, stop: &AtomicBool) -> Result<(), String> {
    let cfg = config(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let client = ShmClient::connect(cfg).map_err(|e| e.to_string())?;
        let (generation, session) = client
            .wait_attached(Duration::from_secs(30))
            .await
            .map_err(|e| e.to_string())?;
        say(&format!(
            "ATTACHED generation={generation} session={session}"
        ));
        verify::run_streams(&client, args.streams, args.chunks, args.chunk_len, 0x5EED).await?;
        say(&format!("STREAMS_OK n={}", args.streams));
        if args.hold {
            let (id, _stream) = client
                .start_request(KIND_HANG, 0, |_| {})
                .await
                .map_err(|e| e.to_string())?;
            say(&format!("HOLDING id={}", id.get()));
            while !stop.load(Ordering::Acquire) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        client.shutdown();
        Ok(())
    })
}

/// A front that attaches by the book, then writes a corrupt request frame.
fn run_hostile_client(args: &Args, stop: &AtomicBool) -> Result<(), String> {
    let mode = args.hostile_mode.as_deref().ok_or("--mode is required")?;
    let raw = Arc::new(RawSegment::open(&args.path).map_err(|e| e.to_string())?);
    let deadline = Instant::now() + Duration::from_secs(30);
    // Keep a heartbeat going from the start, like an honest client.
    let beating = raw.clone();
    std::thread::spawn(move || {
        loop {
            let beat = beating.load_u64(offsets::CLIENT_HEARTBEAT).unwrap_or(0);
            beating.store_u64(offsets::CLIENT_HEARTBEAT, beat.wrapping_add(1));
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    while raw.load_u64(offsets::SESSION) != Some(0) {
        if Instant::now() > deadline {
            return Err("server never idle".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let nonce = 0x0BAD_C0DE_0000_0001u64 ^ u64::from(std::process::id());
    raw.store_u64(offsets::CLIENT_NONCE, nonce);
    while raw.load_u64(offsets::SESSION) != Some(nonce) {
        if Instant::now() > deadline {
            return Err("session never granted".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    say("ATTACHED");
    let data = raw
        .load_u64(offsets::REQUEST_OFFSET)
        .ok_or("no request offset")? as usize;
    let control = offsets::REQUEST_CONTROL;
    let ok = match mode {
        // A request claiming 2 GiB of payload, published as 16 bytes.
        "bad-len" => {
            raw.store_u64(data, 0x7FFF_FFF0u64 | (1u64 << 32))
                && raw.store_u64(data + 8, 1)
                && raw.store_u64(control + offsets::control::HEAD, 16)
        }
        // A write index that is not a multiple of 16.
        "bad-head" => raw.store_u64(control + offsets::control::HEAD, 8),
        // A reserved control kind that does not exist.
        "bad-kind" => {
            raw.store_u64(data, u64::from(0xFF77u16) << 32)
                && raw.store_u64(data + 8, 1)
                && raw.store_u64(control + offsets::control::HEAD, 16)
        }
        other => return Err(format!("unknown mode {other}")),
    };
    if !ok {
        return Err("ring write out of bounds".into());
    }
    raw.wake(control + offsets::control::DATA_SEQ);
    say("CORRUPTED");
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
