//! One conformance suite over every deployment mode: the same tests run against collapsed,
//! split (front + engine over shared memory) and layered (orchestrator + Redis + engine
//! without reuse). Each test starts its own deployment of real processes.

use std::time::Duration;

use futures::FutureExt as _;
use zerolayer_client::{Client, ClientError, ErrorReason, ReuseOutcome};
use zerolayer_handle::{Claims, PromptHash, TenantTag};
use zerolayer_proto::v1;
use zerolayer_tests::*;

fn sampling(max_tokens: u32) -> v1::SamplingParams {
    v1::SamplingParams {
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

fn user(text: &str) -> v1::Message {
    v1::Message {
        role: v1::Role::User as i32,
        content: text.into(),
    }
}

fn request(text: &str, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        messages: vec![user(text)],
        sampling: Some(sampling(max_tokens)),
        ..Default::default()
    }
}

/// A request whose stream lasts seconds: one byte per chunk, 20 ms apart.
fn slow_request() -> v1::GenerateRequest {
    v1::GenerateRequest {
        stream_options: Some(v1::StreamOptions {
            max_buffer_size: 1,
            min_delay_ms: 20,
            network_rtt_ms: 0,
        }),
        ..request("tell me a long story", 200)
    }
}

async fn expect_error(client: &Client, req: v1::GenerateRequest) -> ClientError {
    match client.generate(req).await {
        Err(e) => e,
        Ok(stream) => match stream.collect().await {
            Err(e) => e,
            Ok(turn) => panic!(
                "expected an error, got a reply of {} tokens",
                turn.token_ids.len()
            ),
        },
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn skip_without_redis(mode: Mode) -> bool {
    if mode == Mode::Layered && !have_redis() {
        eprintln!("SKIP: redis-server not installed (the layered baseline needs it)");
        return true;
    }
    false
}

/// The process whose /metrics carries the engine's counters.
fn engine_process(d: &Deployment) -> &Process {
    d.process("engine")
        .or_else(|| d.process("layered-engine"))
        .or_else(|| d.process("collapsed"))
        .expect("an engine process")
}

fn multi_turn_conversation_reports_reuse(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let env = TestEnv::new();
    let d = env.start(mode);
    runtime().block_on(async {
        let client = client(&d.endpoint, Some(ACME_KEY));
        let mut conv = client.conversation().sampling(sampling(8));
        let t1 = conv.turn("Once upon a time").await.expect("turn 1");
        let t2 = conv.turn("and then").await.expect("turn 2");
        let t3 = conv.turn("the end").await.expect("turn 3");
        for t in [&t1, &t2, &t3] {
            assert!(
                !t.final_info
                    .as_ref()
                    .expect("final")
                    .context_handle
                    .is_empty(),
                "handle renewed"
            );
            assert_eq!(t.usage().generated_tokens as usize, t.token_ids.len());
        }
        assert!(t2.usage().prompt_tokens > t1.usage().prompt_tokens);
        match mode {
            Mode::Layered => {
                for t in [&t1, &t2, &t3] {
                    assert_eq!(
                        t.usage().cached_prompt_tokens,
                        0,
                        "the baseline never reuses"
                    );
                    assert_eq!(t.reuse(), ReuseOutcome::Disabled);
                }
            }
            Mode::Collapsed | Mode::Split => {
                assert_eq!(t1.reuse(), ReuseOutcome::New);
                assert_eq!(t2.reuse(), ReuseOutcome::Hit);
                assert_eq!(t3.reuse(), ReuseOutcome::Hit);
                // Turn k reuses at least turn k-1's whole prompt. Its reply is reused too when
                // re-tokenising the reply's text gives back the generated ids (in practice with
                // real tokenizers; rarely with dummy:tiny's byte-level one), because reuse must
                // never change what the model sees (the engine's tests check the exact identity
                // on stories260K).
                let (u1, u2, u3) = (t1.usage(), t2.usage(), t3.usage());
                assert!(
                    u2.cached_prompt_tokens >= u1.prompt_tokens,
                    "{u1:?} then {u2:?}"
                );
                assert!(u2.cached_prompt_tokens <= u1.prompt_tokens + u1.generated_tokens);
                assert!(
                    u3.cached_prompt_tokens >= u2.prompt_tokens,
                    "{u2:?} then {u3:?}"
                );
                assert_eq!(
                    u2.prefilled_prompt_tokens,
                    u2.prompt_tokens - u2.cached_prompt_tokens
                );
            }
        }
    });
}

fn delta_mode_recovers_from_eviction_through_the_client(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let mut env = TestEnv::new();
    // A tiny slot map: a handful of other conversations evict the first one.
    env.launcher.engine_flags = ["--slots", "4", "--max-batch", "2"]
        .map(String::from)
        .to_vec();
    let d = env.start(mode);
    runtime().block_on(async {
        let client = client(&d.endpoint, Some(ACME_KEY));
        let mut conv = client.conversation().delta(true).sampling(sampling(4));
        conv.turn("first conversation").await.expect("turn 1");
        let direct = conv.turn("second turn, delta").await.expect("delta turn");
        assert!(!direct.resent_full, "the slot is still there");
        if mode != Mode::Layered {
            assert!(direct.usage().cached_prompt_tokens > 0);
        }
        for i in 0..8 {
            let mut other = client.conversation().sampling(sampling(2));
            other
                .turn(format!("other conversation {i}"))
                .await
                .expect("other conversation");
        }
        let after = conv
            .turn("third turn after eviction")
            .await
            .expect("recovered turn");
        match mode {
            Mode::Layered => assert!(!after.resent_full, "Redis keeps transcripts"),
            Mode::Collapsed | Mode::Split => {
                assert!(
                    after.resent_full,
                    "CONTEXT_EVICTED made the client resend the transcript"
                );
                assert_eq!(after.usage().cached_prompt_tokens, 0);
            }
        }
        // The conversation continues normally after the recovery.
        let next = conv.turn("fourth turn").await.expect("turn after recovery");
        assert!(!next.resent_full);
    });
}

fn forged_expired_and_foreign_handles_get_typed_errors(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let env = TestEnv::new();
    let d = env.start(mode);
    runtime().block_on(async {
        let acme = client(&d.endpoint, Some(ACME_KEY));
        let beta = client(&d.endpoint, Some(BETA_KEY));
        let mut conv = acme.conversation().sampling(sampling(4));
        conv.turn("hello").await.expect("turn 1");
        let good = conv.handle().to_vec();
        let with_handle = |handle: Vec<u8>| v1::GenerateRequest {
            messages: conv
                .messages()
                .iter()
                .cloned()
                .chain([user("next")])
                .collect(),
            context_handle: handle,
            sampling: Some(sampling(4)),
            ..Default::default()
        };

        let forged: Vec<u8> = (0..good.len()).map(|i| (i * 7 + 3) as u8).collect();
        assert_eq!(
            expect_error(&acme, with_handle(forged)).await.reason,
            ErrorReason::InvalidHandle
        );
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x01;
        assert_eq!(
            expect_error(&acme, with_handle(flipped)).await.reason,
            ErrorReason::InvalidHandle
        );
        assert_eq!(
            expect_error(&acme, with_handle(good[..10].to_vec()))
                .await
                .reason,
            ErrorReason::InvalidHandle
        );

        let expired = env.keys().issue(Claims {
            session_id: 42,
            tenant: TenantTag::for_tenant("acme"),
            prompt_hash: PromptHash::compute("acme", "", "hello"),
            kv_offset: 0,
            epoch: 0,
            expires_at: 1,
        });
        let err = expect_error(&acme, with_handle(expired.as_bytes().to_vec())).await;
        assert_eq!(err.reason, ErrorReason::HandleExpired, "{err}");

        let err = expect_error(&beta, with_handle(good.clone())).await;
        assert_eq!(err.reason, ErrorReason::TenantMismatch, "{err}");

        // The genuine handle still works for its tenant.
        conv.turn("next").await.expect("valid handle");
    });
}

fn unauthenticated_calls_are_rejected(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let env = TestEnv::new();
    let d = env.start(mode);
    runtime().block_on(async {
        for key in [None, Some("not-a-configured-key-at-all")] {
            let c = client(&d.endpoint, key);
            assert_eq!(
                expect_error(&c, request("hi", 2)).await.reason,
                ErrorReason::Unauthenticated
            );
            assert_eq!(
                c.probe().await.expect_err("probe").reason,
                ErrorReason::Unauthenticated
            );
            assert_eq!(
                c.validate(request("hi", 2))
                    .await
                    .expect_err("validate")
                    .reason,
                ErrorReason::Unauthenticated
            );
        }
    });
}

fn rate_and_concurrency_limits_are_enforced_per_tenant(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let env = TestEnv::new();
    let d = env.start(mode);
    runtime().block_on(async {
        // `slow`: 1 token/s, bucket of 40. A 200-byte prompt costs ~200 prefilled tokens,
        // settled after the first request: the next one finds the tenant in debt.
        let slow = client(&d.endpoint, Some(SLOW_KEY));
        let prompt = "x".repeat(200);
        slow.generate(request(&prompt, 2))
            .await
            .expect("first request")
            .collect()
            .await
            .expect("reply");
        let err = expect_error(&slow, request(&prompt, 2)).await;
        assert_eq!(err.reason, ErrorReason::RateLimitExceeded, "{err}");
        assert!(
            err.retry_after.is_some_and(|d| d > Duration::from_secs(10)),
            "{err:?}"
        );
        // Other tenants are not affected.
        let acme = client(&d.endpoint, Some(ACME_KEY));
        acme.generate(request(&prompt, 2))
            .await
            .expect("acme")
            .collect()
            .await
            .expect("acme reply");

        // `single`: one request at a time.
        let single = client(&d.endpoint, Some(SINGLE_KEY));
        let mut running = single.generate(slow_request()).await.expect("first stream");
        running.next().await.expect("a chunk").expect("chunk ok");
        let err = expect_error(&single, request("second", 2)).await;
        assert_eq!(err.reason, ErrorReason::RateLimitExceeded, "{err}");
        drop(running);
    });
}

fn overload_is_shed_with_overloaded(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let mut env = TestEnv::new();
    env.launcher.edge_flags = vec!["--max-in-flight".into(), "1".into()];
    let d = env.start(mode);
    runtime().block_on(async {
        let c = client(&d.endpoint, Some(ACME_KEY));
        let mut running = c.generate(slow_request()).await.expect("first stream");
        running.next().await.expect("a chunk").expect("chunk ok");
        let err = expect_error(&c, request("one more", 2)).await;
        assert_eq!(err.reason, ErrorReason::Overloaded, "{err}");
        assert_eq!(err.code, tonic::Code::Unavailable);
        drop(running);
    });
}

fn oversized_and_garbage_requests_are_rejected(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let env = TestEnv::new();
    let d = env.start(mode);
    runtime().block_on(async {
        let c = client(&d.endpoint, Some(ACME_KEY));
        let huge = "y".repeat((1 << 20) + 16);
        assert_eq!(
            expect_error(&c, request(&huge, 2)).await.reason,
            ErrorReason::InvalidRequest
        );
        let no_messages = v1::GenerateRequest {
            sampling: Some(sampling(2)),
            ..Default::default()
        };
        assert_eq!(
            expect_error(&c, no_messages).await.reason,
            ErrorReason::InvalidRequest
        );
        let bad_top_p = v1::GenerateRequest {
            sampling: Some(v1::SamplingParams {
                top_p: Some(2.0),
                ..sampling(2)
            }),
            ..request("hi", 2)
        };
        assert_eq!(
            expect_error(&c, bad_top_p).await.reason,
            ErrorReason::InvalidRequest
        );
        // Bytes that are not a protobuf message at all.
        for path in [
            "/zerolayer.v1.Inference/GenerateBuffered",
            "/zerolayer.v1.Inference/Validate",
        ] {
            let status = raw_call(&d.endpoint, ACME_KEY, path, vec![0xff; 64])
                .await
                .expect_err("garbage");
            let err = ClientError::from_status(&status);
            assert_eq!(
                err.reason,
                ErrorReason::InvalidRequest,
                "{path}: {status:?}"
            );
        }
        // The server is still fine.
        c.generate(request("still alive", 2))
            .await
            .expect("alive")
            .collect()
            .await
            .expect("reply");
    });
}

/// Sends raw bytes as a unary gRPC request.
async fn raw_call(
    endpoint: &str,
    key: &str,
    path: &'static str,
    body: Vec<u8>,
) -> Result<bytes::Bytes, tonic::Status> {
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
    #[derive(Default)]
    struct RawCodec;
    struct RawEnc;
    struct RawDec;
    impl Encoder for RawEnc {
        type Item = Vec<u8>;
        type Error = tonic::Status;
        fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
            bytes::BufMut::put_slice(dst, &item);
            Ok(())
        }
    }
    impl Decoder for RawDec {
        type Item = bytes::Bytes;
        type Error = tonic::Status;
        fn decode(
            &mut self,
            src: &mut DecodeBuf<'_>,
        ) -> Result<Option<bytes::Bytes>, tonic::Status> {
            let n = bytes::Buf::remaining(src);
            Ok(Some(bytes::Buf::copy_to_bytes(src, n)))
        }
    }
    impl Codec for RawCodec {
        type Encode = Vec<u8>;
        type Decode = bytes::Bytes;
        type Encoder = RawEnc;
        type Decoder = RawDec;
        fn encoder(&mut self) -> RawEnc {
            RawEnc
        }
        fn decoder(&mut self) -> RawDec {
            RawDec
        }
    }
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let mut req = tonic::Request::new(body);
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {key}").parse().expect("ascii"),
    );
    grpc.unary(
        req,
        tonic::codegen::http::uri::PathAndQuery::from_static(path),
        RawCodec,
    )
    .await
    .map(tonic::Response::into_inner)
}

fn stream_options_shape_the_stream(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let env = TestEnv::new();
    let d = env.start(mode);
    runtime().block_on(async {
        let c = client(&d.endpoint, Some(ACME_KEY));
        let plain = c
            .generate(request("shape me", 48))
            .await
            .expect("plain")
            .collect()
            .await
            .expect("plain reply");
        assert!(
            plain.chunk_times.len() >= 48,
            "one chunk per token unshaped: {}",
            plain.chunk_times.len()
        );

        let small = v1::GenerateRequest {
            stream_options: Some(v1::StreamOptions {
                max_buffer_size: 3,
                min_delay_ms: 0,
                network_rtt_ms: 0,
            }),
            ..request("shape me", 48)
        };
        let small = c
            .generate(small)
            .await
            .expect("small")
            .collect()
            .await
            .expect("small reply");
        assert!(
            small.chunk_text_bytes.iter().all(|&b| b <= 3),
            "{:?}",
            small.chunk_text_bytes
        );
        assert_eq!(small.text, plain.text, "shaping never changes the text");
        assert_eq!(small.token_ids, plain.token_ids);

        let far = v1::GenerateRequest {
            stream_options: Some(v1::StreamOptions {
                max_buffer_size: 0,
                min_delay_ms: 0,
                network_rtt_ms: 600,
            }),
            ..request("shape me", 48)
        };
        let far = c
            .generate(far)
            .await
            .expect("far")
            .collect()
            .await
            .expect("far reply");
        assert_eq!(far.text, plain.text);
        assert!(
            far.chunk_times.len() * 4 <= plain.chunk_times.len(),
            "a 600 ms RTT coalesces chunks: {} vs {}",
            far.chunk_times.len(),
            plain.chunk_times.len()
        );

        let spaced = v1::GenerateRequest {
            stream_options: Some(v1::StreamOptions {
                max_buffer_size: 2,
                min_delay_ms: 25,
                network_rtt_ms: 0,
            }),
            ..request("shape me", 12)
        };
        let spaced = c
            .generate(spaced)
            .await
            .expect("spaced")
            .collect()
            .await
            .expect("spaced reply");
        let n = spaced.chunk_times.len();
        assert!(n >= 4, "{n} chunks");
        // The server spaces chunks >= 25 ms apart; the arrival span can only shrink by the
        // first chunk's network delay, so half the nominal span is a safe lower bound.
        let span = spaced.chunk_times[n - 1] - spaced.chunk_times[0];
        assert!(
            span >= Duration::from_millis(25 * (n as u64 - 1) / 2),
            "{n} chunks in {span:?}"
        );
    });
}

fn a_client_that_disconnects_cancels_its_generation(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let env = TestEnv::new();
    let d = env.start(mode);
    let metrics = engine_process(&d)
        .metrics_addr
        .clone()
        .expect("engine metrics");
    runtime().block_on(async {
        let c = client(&d.endpoint, Some(ACME_KEY));
        let mut stream = c.generate(slow_request()).await.expect("stream");
        stream.next().await.expect("a chunk").expect("chunk ok");
        drop(stream);
        let cancelled = eventually(Duration::from_secs(20), || {
            let metrics = metrics.clone();
            async move {
                let text = scrape(&metrics).await;
                let line = text
                    .lines()
                    .find(|l| {
                        l.starts_with("zerolayer_engine_finished_total{")
                            && l.contains("reason=\"cancelled\"")
                    })?
                    .to_owned();
                let v: f64 = line.rsplit(' ').next()?.parse().ok()?;
                let running = metric(&text, "zerolayer_running_sequences{")?;
                (v >= 1.0 && running == 0.0).then_some(v)
            }
            .boxed()
        })
        .await;
        assert!(
            cancelled.is_some(),
            "the engine did not record the cancellation"
        );
    });
}

fn the_buffered_bridge_returns_the_collected_stream(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let env = TestEnv::new();
    let d = env.start(mode);
    runtime().block_on(async {
        let c = client(&d.endpoint, Some(ACME_KEY));
        let streamed = c
            .generate(request("bridge", 16))
            .await
            .expect("stream")
            .collect()
            .await
            .expect("reply");
        let buffered = c
            .generate_buffered(request("bridge", 16))
            .await
            .expect("buffered");
        assert_eq!(buffered.text, streamed.text);
        assert_eq!(buffered.token_ids, streamed.token_ids);
        let f = buffered.r#final.expect("final info");
        assert!(!f.context_handle.is_empty());
        assert_eq!(f.usage.expect("usage").generated_tokens, 16);
    });
}

fn probe_and_validate_answer_without_generating(mode: Mode) {
    if skip_without_redis(mode) {
        return;
    }
    let env = TestEnv::new();
    let d = env.start(mode);
    runtime().block_on(async {
        let c = client(&d.endpoint, Some(ACME_KEY));
        let probe = c.probe().await.expect("probe");
        assert_eq!(probe.mode, mode.as_str());
        assert!(probe.total_ns > 0);
        assert!(!probe.model.is_empty());
        let v = c
            .validate(request("how much will this cost", 10))
            .await
            .expect("validate");
        assert!(v.prompt_tokens > 0);
        assert_eq!(v.max_tokens, 10);
        assert!(v.context_window > v.prompt_tokens);
        assert!(v.estimated_flops > 0);
        let err = c
            .validate(request("too long", 1_000_000))
            .await
            .expect_err("too long");
        assert_eq!(err.reason, ErrorReason::ContextLengthExceeded, "{err}");
        let err = c
            .validate(request(&format!("the {ACME_FORBIDDEN} is"), 4))
            .await
            .expect_err("forbidden");
        assert_eq!(err.reason, ErrorReason::SafetyViolation, "{err}");
        let err = expect_error(&c, request(&format!("the {ACME_FORBIDDEN} is"), 4)).await;
        assert_eq!(err.reason, ErrorReason::SafetyViolation, "{err}");
    });
}

macro_rules! conformance {
    ($module:ident, $mode:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn multi_turn_conversation_reports_reuse() {
                super::multi_turn_conversation_reports_reuse($mode);
            }

            #[test]
            fn delta_mode_recovers_from_eviction_through_the_client() {
                super::delta_mode_recovers_from_eviction_through_the_client($mode);
            }

            #[test]
            fn forged_expired_and_foreign_handles_get_typed_errors() {
                super::forged_expired_and_foreign_handles_get_typed_errors($mode);
            }

            #[test]
            fn unauthenticated_calls_are_rejected() {
                super::unauthenticated_calls_are_rejected($mode);
            }

            #[test]
            fn rate_and_concurrency_limits_are_enforced_per_tenant() {
                super::rate_and_concurrency_limits_are_enforced_per_tenant($mode);
            }

            #[test]
            fn overload_is_shed_with_overloaded() {
                super::overload_is_shed_with_overloaded($mode);
            }

            #[test]
            fn oversized_and_garbage_requests_are_rejected() {
                super::oversized_and_garbage_requests_are_rejected($mode);
            }

            #[test]
            fn stream_options_shape_the_stream() {
                super::stream_options_shape_the_stream($mode);
            }

            #[test]
            fn a_client_that_disconnects_cancels_its_generation() {
                super::a_client_that_disconnects_cancels_its_generation($mode);
            }

            #[test]
            fn the_buffered_bridge_returns_the_collected_stream() {
                super::the_buffered_bridge_returns_the_collected_stream($mode);
            }

            #[test]
            fn probe_and_validate_answer_without_generating() {
                super::probe_and_validate_answer_without_generating($mode);
            }
        }
    };
}

conformance!(collapsed, Mode::Collapsed);
conformance!(split, Mode::Split);
conformance!(layered, Mode::Layered);
