//! Split mode, engine side: serves the engine over the shared-memory channel to a front.
//!
//! One OS thread receives request frames (decoding each while it is borrowed in the ring,
//! then releasing it); every request runs as a tokio task that drives the engine's stream and
//! writes each shaped chunk, protobuf-encoded in place, into the response ring. A cancel
//! frame or the front's death aborts the task, which drops the engine stream and so cancels
//! the generation at the engine's next step. The engine keeps its slots across fronts.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures::StreamExt;
use prost::Message;
use zerolayer_proto::v1;
use zerolayer_service::{ApiError, wire};
use zerolayer_shm::{Incoming, RecvError, RequestKey, SendError, ShmConfig, ShmServer};

use crate::host::EngineHost;

/// How often the receiver thread checks for shutdown while idle.
const RECV_TICK: Duration = Duration::from_millis(100);

/// Requests in flight, by key, so cancels and a dead front can abort them.
type Tasks = Arc<Mutex<HashMap<RequestKey, tokio::task::AbortHandle>>>;

fn lock(tasks: &Tasks) -> std::sync::MutexGuard<'_, HashMap<RequestKey, tokio::task::AbortHandle>> {
    // The map holds plain handles; a panic elsewhere cannot leave it half-updated.
    tasks.lock().unwrap_or_else(|p| p.into_inner())
}

/// A decoded request frame.
enum Job {
    Generate {
        tenant: String,
        request: v1::GenerateRequest,
    },
    Validate {
        tenant: String,
        request: v1::GenerateRequest,
    },
    Probe,
}

/// Decodes a request frame's payload (untrusted bytes: typed errors only).
fn decode_job(kind: u16, payload: &[u8]) -> Result<Job, ApiError> {
    let (tenant, body) = wire::read_envelope(payload)
        .map_err(|e| ApiError::invalid(format!("bad envelope: {e}")))?;
    let request = || {
        v1::GenerateRequest::decode(body)
            .map_err(|e| ApiError::invalid(format!("malformed request: {e}")))
    };
    match kind {
        wire::KIND_GENERATE => Ok(Job::Generate {
            tenant: tenant.to_owned(),
            request: request()?,
        }),
        wire::KIND_VALIDATE => Ok(Job::Validate {
            tenant: tenant.to_owned(),
            request: request()?,
        }),
        wire::KIND_PROBE => Ok(Job::Probe),
        other => Err(ApiError::invalid(format!("unknown request kind {other}"))),
    }
}

/// Sends one response frame, blocking this worker thread for ring space if needed.
fn send(
    server: &ShmServer,
    key: RequestKey,
    kind: u16,
    last: bool,
    payload: &[u8],
) -> Result<(), SendError> {
    tokio::task::block_in_place(|| {
        server.send(key, kind, last, payload.len(), |buf| {
            buf.copy_from_slice(payload)
        })
    })
}

/// Sends a protobuf message encoded in place in the ring.
fn send_message<M: Message>(
    server: &ShmServer,
    key: RequestKey,
    kind: u16,
    last: bool,
    message: &M,
) -> Result<(), SendError> {
    let len = message.encoded_len();
    tokio::task::block_in_place(|| {
        server.send(key, kind, last, len, |mut buf| {
            // `buf` is exactly `encoded_len` bytes: encoding cannot run out of room.
            let _ = message.encode(&mut buf);
        })
    })
}

fn send_error(server: &ShmServer, key: RequestKey, err: &ApiError) {
    if let Err(e) = send(
        server,
        key,
        wire::KIND_ERROR,
        true,
        &wire::encode_error(err),
    ) {
        tracing::debug!(cause = %e, "error frame not delivered");
    }
}

/// Runs one request to completion.
async fn run_job(host: EngineHost, server: Arc<ShmServer>, key: RequestKey, job: Job) {
    match job {
        Job::Generate { tenant, request } => {
            let mut stream = match host.generate(&tenant, request) {
                Ok(s) => s,
                Err(e) => return send_error(&server, key, &e),
            };
            while let Some(item) = stream.next().await {
                let chunk = match item {
                    Ok(chunk) => chunk,
                    Err(e) => return send_error(&server, key, &e),
                };
                let last = chunk.r#final.is_some();
                let kind = if last {
                    wire::KIND_FINAL_CHUNK
                } else {
                    wire::KIND_CHUNK
                };
                if let Err(e) = send_message(&server, key, kind, last, &chunk) {
                    // The front is gone or the ring stayed full: dropping the stream cancels
                    // the generation.
                    tracing::debug!(cause = %e, session = %key.session, id = key.id, "stream abandoned");
                    return;
                }
                if last {
                    return;
                }
            }
            send_error(
                &server,
                key,
                &ApiError::internal("stream ended without a final chunk"),
            );
        }
        Job::Validate { tenant, request } => match host.validate(&tenant, request).await {
            Ok(r) => {
                let _ = send_message(&server, key, wire::KIND_VALIDATE_RESPONSE, true, &r);
            }
            Err(e) => send_error(&server, key, &e),
        },
        Job::Probe => match host.probe().await {
            Ok(r) => {
                let _ = send_message(&server, key, wire::KIND_PROBE_RESPONSE, true, &r);
            }
            Err(e) => send_error(&server, key, &e),
        },
    }
}

/// The shared-memory side of an engine process.
#[derive(Debug)]
pub struct SplitServer {
    server: Arc<ShmServer>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SplitServer {
    /// Creates the segment and starts receiving requests; request tasks run on `runtime`.
    pub fn start(
        host: EngineHost,
        config: ShmConfig,
        runtime: tokio::runtime::Handle,
    ) -> anyhow::Result<Self> {
        let (server, mut receiver) = ShmServer::create(config.clone())
            .map_err(|e| anyhow::anyhow!("cannot create the shared-memory segment: {e}"))?;
        let server = Arc::new(server);
        tracing::info!(path = %server.path().display(), generation = server.generation(), "shared-memory segment created");
        let stop = Arc::new(AtomicBool::new(false));
        let tasks: Tasks = Arc::default();
        let thread = {
            let server = server.clone();
            let stop = stop.clone();
            std::thread::Builder::new().name("zerolayer-shm-recv".into()).spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let incoming = match receiver.recv_timeout(RECV_TICK) {
                        Ok(Some(incoming)) => incoming,
                        Ok(None) => continue,
                        Err(RecvError::Shutdown) => break,
                        Err(RecvError::Corrupt(e)) => {
                            tracing::error!(cause = %e, "the front corrupted the request ring; waiting for a new session");
                            continue;
                        }
                        Err(RecvError::Broken) => {
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        }
                    };
                    match incoming {
                        Incoming::Request(frame) => {
                            let key = frame.key();
                            let job = decode_job(frame.kind(), frame.payload());
                            drop(frame);
                            match job {
                                Err(e) => send_error(&server, key, &e),
                                Ok(job) => {
                                    let (host, server2, tasks2) = (host.clone(), server.clone(), tasks.clone());
                                    let handle = runtime.spawn(async move {
                                        run_job(host, server2, key, job).await;
                                        lock(&tasks2).remove(&key);
                                    });
                                    lock(&tasks).insert(key, handle.abort_handle());
                                }
                            }
                        }
                        Incoming::Cancel(key) => {
                            if let Some(task) = lock(&tasks).remove(&key) {
                                tracing::debug!(session = %key.session, id = key.id, "request cancelled by the front");
                                task.abort();
                            }
                        }
                        Incoming::ClientAttached(session) => {
                            tracing::info!(%session, "front attached");
                        }
                        Incoming::ClientGone { session, reason, in_flight } => {
                            tracing::warn!(%session, %reason, dropped = in_flight.len(), "front gone; its requests are dropped, slots kept");
                            let mut tasks = lock(&tasks);
                            for key in in_flight {
                                if let Some(task) = tasks.remove(&key) {
                                    task.abort();
                                }
                            }
                        }
                    }
                }
            })?
        };
        Ok(Self {
            server,
            stop,
            thread: Some(thread),
        })
    }

    /// Stops receiving and closes the segment (the front sees the server close).
    pub fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.server.shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for SplitServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_request_frames_are_typed_errors() {
        assert!(decode_job(wire::KIND_GENERATE, &[]).is_err());
        assert!(decode_job(wire::KIND_GENERATE, &[0, 0, 0xff, 0xff, 0xff]).is_err());
        assert!(decode_job(999, &[0, 0]).is_err());
        let mut ok = vec![0u8; wire::envelope_len("t")];
        wire::write_envelope(&mut ok, "t").expect("fits");
        assert!(matches!(decode_job(wire::KIND_PROBE, &ok), Ok(Job::Probe)));
        assert!(matches!(
            decode_job(wire::KIND_GENERATE, &ok),
            Ok(Job::Generate { .. })
        ));
    }
}
