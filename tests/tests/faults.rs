//! Process faults: the engine killed under a split front, the front killed under an engine,
//! and graceful shutdown (SIGTERM drains in-flight streams).

use std::time::{Duration, Instant};

use zerolayer_client::{ErrorReason, FinishReason};
use zerolayer_proto::v1;
use zerolayer_tests::*;

fn slow_request() -> v1::GenerateRequest {
    v1::GenerateRequest {
        messages: vec![v1::Message {
            role: v1::Role::User as i32,
            content: "a long story".into(),
        }],
        sampling: Some(v1::SamplingParams {
            max_tokens: Some(200),
            ..Default::default()
        }),
        stream_options: Some(v1::StreamOptions {
            max_buffer_size: 1,
            min_delay_ms: 20,
            network_rtt_ms: 0,
        }),
        ..Default::default()
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

async fn wait_serving(endpoint: &str) {
    let c = client(endpoint, None);
    let ok = eventually(Duration::from_secs(60), || {
        let c = c.clone();
        async move { c.health().await.ok().filter(|s| *s) }
    })
    .await;
    assert!(ok.is_some(), "{endpoint} did not report SERVING");
}

#[test]
fn killing_the_engine_ends_every_stream_with_unavailable_within_a_second_and_a_new_engine_is_served()
 {
    let env = TestEnv::new();
    let mut d = env.start(Mode::Split);
    let shm = d.shm.clone().expect("segment name");
    runtime().block_on(async {
        let c = client(&d.endpoint, Some(ACME_KEY));
        let mut streams = Vec::new();
        for _ in 0..3 {
            let mut s = c.generate(slow_request()).await.expect("stream starts");
            s.next().await.expect("first chunk").expect("chunk ok");
            streams.push(s);
        }
        let killed_at = Instant::now();
        d.process_mut("engine").expect("engine").kill();
        for mut s in streams {
            let err = loop {
                match s.next().await {
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => break e,
                    None => panic!("stream ended without an error"),
                }
            };
            assert_eq!(err.code, tonic::Code::Unavailable, "{err}");
            assert_eq!(err.reason, ErrorReason::EngineUnavailable, "{err}");
            let waited = killed_at.elapsed();
            assert!(
                waited < Duration::from_secs(1),
                "stream failed {waited:?} after the kill"
            );
        }
        // While no engine runs, the front reports NOT_SERVING and refuses new work quickly.
        let down = eventually(Duration::from_secs(10), || {
            let c = c.clone();
            async move { c.health().await.ok().filter(|s| !*s) }
        })
        .await;
        assert!(
            down.is_some(),
            "front still reports SERVING without an engine"
        );
        let err = c.probe().await.expect_err("no engine");
        assert_eq!(err.reason, ErrorReason::EngineUnavailable);

        // A new engine on the same segment name: the front reattaches by itself.
        let engine = env.launcher.start_engine(&shm).expect("new engine");
        d.processes.push(engine);
        wait_serving(&d.endpoint).await;
        let mut conv = c.conversation().sampling(v1::SamplingParams {
            max_tokens: Some(4),
            ..Default::default()
        });
        conv.turn("hello again")
            .await
            .expect("served by the new engine");
        conv.turn("and again").await.expect("second turn");
    });
}

#[test]
fn killing_the_front_keeps_the_engine_slots_and_a_new_front_reuses_them() {
    let env = TestEnv::new();
    let mut d = env.start(Mode::Split);
    let shm = d.shm.clone().expect("segment name");
    runtime().block_on(async {
        let c = client(&d.endpoint, Some(ACME_KEY));
        let mut conv = c.conversation().sampling(v1::SamplingParams {
            max_tokens: Some(6),
            ..Default::default()
        });
        let t1 = conv.turn("remember this").await.expect("turn 1");
        d.process_mut("front").expect("front").kill();
        let front = env.launcher.start_front(&shm).expect("new front");
        let endpoint = front.endpoint();
        d.processes.push(front);
        wait_serving(&endpoint).await;
        conv.rebind(client(&endpoint, Some(ACME_KEY)));
        let t2 = conv
            .turn("do you remember")
            .await
            .expect("turn 2 through the new front");
        assert!(
            t2.usage().cached_prompt_tokens >= t1.usage().prompt_tokens,
            "slot survived: {:?}",
            t2.usage()
        );
    });
}

fn sigterm_drains_in_flight_streams(mode: Mode, process: &str) {
    let env = TestEnv::new();
    let mut d = env.start(mode);
    runtime().block_on(async {
        let c = client(&d.endpoint, Some(ACME_KEY));
        let mut request = slow_request();
        request.sampling = Some(v1::SamplingParams {
            max_tokens: Some(40),
            ..Default::default()
        });
        let mut stream = c.generate(request).await.expect("stream starts");
        stream.next().await.expect("first chunk").expect("chunk ok");
        d.process(process)
            .expect("process")
            .terminate()
            .expect("SIGTERM");
        let mut finish = None;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.expect("the in-flight stream completes during the drain");
            if let Some(f) = chunk.r#final {
                finish = Some(FinishReason::try_from(f.finish_reason).expect("known reason"));
            }
        }
        assert_eq!(finish, Some(FinishReason::Length), "stream ran to its end");
        // New calls are refused once the server stopped accepting.
        let refused = eventually(Duration::from_secs(10), || {
            let c = c.clone();
            async move { c.probe().await.err() }
        })
        .await;
        assert!(refused.is_some(), "server still accepting after SIGTERM");
    });
    let status = d
        .process_mut(process)
        .expect("process")
        .wait_exit(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "{process} exit: {status:?}"
    );
}

#[test]
fn sigterm_drains_in_flight_streams_in_collapsed_mode() {
    sigterm_drains_in_flight_streams(Mode::Collapsed, "collapsed");
}

#[test]
fn sigterm_drains_in_flight_streams_at_the_front() {
    sigterm_drains_in_flight_streams(Mode::Split, "front");
}
