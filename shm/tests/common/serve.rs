//! The engine side of the test protocol, shared by `zerolayer-shm-peer server` and the
//! in-process servers of the tests (included with `#[path]`).

#![allow(dead_code, reason = "each includer uses a different subset")]

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::proto::{
    CHECKSUM_START, END_BYTES, KIND_CHUNK, KIND_ECHO, KIND_END, KIND_HANG, KIND_STREAM, StreamSpec,
    checksum, encode_end, fill_chunk,
};
use zerolayer_shm::{GoneReason, Incoming, RequestKey, RequestReceiver, SessionId, ShmServer};

/// What the serving loop saw, reported to its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    Attached(SessionId),
    Gone {
        session: SessionId,
        reason: GoneReason,
        in_flight: Vec<RequestKey>,
    },
    Cancel(RequestKey),
    Hanging(RequestKey),
    SendError(String),
}

/// Serves requests until `stop`: echoes, streams (one thread per stream, so many threads
/// send at once), and holds `KIND_HANG` requests. `hostile(id)`, when given, is called
/// instead of answering a request.
pub fn serve(
    server: &ShmServer,
    rx: &mut RequestReceiver,
    stop: &AtomicBool,
    observe: &(dyn Fn(Observation) + Sync),
    hostile: Option<&dyn Fn(u64)>,
) -> Result<(), String> {
    let cancelled: Arc<Mutex<HashSet<RequestKey>>> = Arc::default();
    std::thread::scope(|scope| {
        while !stop.load(Ordering::Acquire) {
            let incoming = match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(incoming) => incoming,
                Err(e) => return Err(e.to_string()),
            };
            match incoming {
                None => {}
                Some(Incoming::ClientAttached(session)) => observe(Observation::Attached(session)),
                Some(Incoming::ClientGone {
                    session,
                    reason,
                    in_flight,
                }) => observe(Observation::Gone {
                    session,
                    reason,
                    in_flight,
                }),
                Some(Incoming::Cancel(key)) => {
                    cancelled
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(key);
                    observe(Observation::Cancel(key));
                }
                Some(Incoming::Request(frame)) => {
                    let key = frame.key();
                    if let Some(hostile) = hostile {
                        drop(frame);
                        hostile(key.id);
                        continue;
                    }
                    match frame.kind() {
                        KIND_ECHO => {
                            let payload = frame.payload().to_vec();
                            drop(frame);
                            if let Err(e) = server.send(key, KIND_ECHO, true, payload.len(), |b| {
                                b.copy_from_slice(&payload)
                            }) {
                                observe(Observation::SendError(e.error_type().to_string()));
                            }
                        }
                        KIND_STREAM => {
                            let spec = StreamSpec::decode(frame.payload());
                            drop(frame);
                            let Some(spec) = spec else {
                                return Err("malformed stream request".to_string());
                            };
                            let cancelled = cancelled.clone();
                            scope.spawn(move || stream(server, key, spec, &cancelled, observe));
                        }
                        KIND_HANG => {
                            drop(frame);
                            observe(Observation::Hanging(key));
                        }
                        other => return Err(format!("unknown request kind {other}")),
                    }
                }
            }
        }
        Ok(())
    })
}

/// Sends one stream's chunks and its end frame; stops early when cancelled or when sending
/// fails (the session ended).
fn stream(
    server: &ShmServer,
    key: RequestKey,
    spec: StreamSpec,
    cancelled: &Mutex<HashSet<RequestKey>>,
    observe: &(dyn Fn(Observation) + Sync),
) {
    let mut sum = CHECKSUM_START;
    for index in 0..spec.chunks {
        if cancelled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&key)
        {
            return;
        }
        let len = spec.chunk_len(index);
        let sent = server.send(key, KIND_CHUNK, false, len, |buf| {
            fill_chunk(spec.seed, index, buf);
            sum = checksum(sum, buf);
        });
        if let Err(e) = sent {
            observe(Observation::SendError(e.error_type().to_string()));
            return;
        }
        if spec.delay_us > 0 {
            std::thread::sleep(Duration::from_micros(u64::from(spec.delay_us)));
        }
    }
    if let Err(e) = server.send(key, KIND_END, true, END_BYTES, |buf| {
        encode_end(sum, spec.chunks, buf)
    }) {
        observe(Observation::SendError(e.error_type().to_string()));
    }
}
