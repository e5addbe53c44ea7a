//! Client-side stream checks shared by the tests and `zerolayer-shm-peer client` (included
//! with `#[path]`).

#![allow(dead_code, reason = "each includer uses a different subset")]

use super::proto::{
    CHECKSUM_START, KIND_CHUNK, KIND_END, KIND_STREAM, StreamSpec, checksum, decode_end, fill_chunk,
};
use zerolayer_shm::{ClientError, RequestId, ResponseStream, ShmClient};

/// Starts a stream request.
pub async fn start_stream(
    client: &ShmClient,
    spec: StreamSpec,
) -> Result<(RequestId, ResponseStream), ClientError> {
    client
        .start_request(KIND_STREAM, StreamSpec::BYTES, |buf| spec.encode(buf))
        .await
}

/// Reads a whole stream and checks every chunk against its expected contents and the
/// server's checksum. `Err` describes the first problem (a `ClientError` included).
pub async fn verify_stream(spec: StreamSpec, mut stream: ResponseStream) -> Result<(), String> {
    let mut sum = CHECKSUM_START;
    let mut expected = Vec::new();
    for index in 0..spec.chunks {
        let chunk = match stream.next().await {
            Some(Ok(chunk)) => chunk,
            Some(Err(e)) => return Err(format!("chunk {index}: {e}")),
            None => return Err(format!("stream ended before chunk {index}")),
        };
        if chunk.kind != KIND_CHUNK || chunk.last {
            return Err(format!(
                "chunk {index}: kind {} last {}",
                chunk.kind, chunk.last
            ));
        }
        expected.resize(spec.chunk_len(index), 0);
        fill_chunk(spec.seed, index, &mut expected);
        if chunk.payload[..] != expected[..] {
            return Err(format!(
                "chunk {index}: {} bytes differ from the expected {}",
                chunk.payload.len(),
                expected.len()
            ));
        }
        sum = checksum(sum, &chunk.payload);
    }
    match stream.next().await {
        Some(Ok(end)) if end.kind == KIND_END && end.last => match decode_end(&end.payload) {
            Some((server_sum, count)) if server_sum == sum && count == spec.chunks => {}
            other => {
                return Err(format!(
                    "end frame {other:?}, expected ({sum}, {})",
                    spec.chunks
                ));
            }
        },
        other => return Err(format!("expected the end frame, got {other:?}")),
    }
    match stream.next().await {
        None => Ok(()),
        other => Err(format!("expected the stream to end, got {other:?}")),
    }
}

/// Runs `count` concurrent streams and checks them all.
pub async fn run_streams(
    client: &ShmClient,
    count: usize,
    chunks: u32,
    chunk_len: u32,
    seed: u64,
) -> Result<(), String> {
    let mut tasks = Vec::new();
    for i in 0..count {
        let spec = StreamSpec {
            chunks,
            chunk_len,
            seed: seed.wrapping_add(i as u64 * 7919),
            delay_us: 0,
        };
        let (_, stream) = start_stream(client, spec)
            .await
            .map_err(|e| format!("start stream {i}: {e}"))?;
        tasks.push(tokio::spawn(async move {
            verify_stream(spec, stream)
                .await
                .map_err(|e| format!("stream {i}: {e}"))
        }));
    }
    for task in tasks {
        task.await.map_err(|e| format!("stream task: {e}"))??;
    }
    Ok(())
}
