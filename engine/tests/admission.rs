//! Admission control: pool exhaustion, eviction, busy sessions, load shedding, cancellation,
//! shutdown, scheduler failure, probe and validate.

mod common;

use common::*;
use zerolayer_engine::api::{Message, ReuseOutcome, Role};
use zerolayer_engine::{EngineConfig, EngineError, EngineMetrics, ErrorReason, FinishReason};

/// A user message of about `n` byte-level tokens.
fn long_message(n: usize, salt: char) -> Message {
    let text: String = (0..n - 1)
        .map(|i| if i % 7 == 6 { ' ' } else { salt })
        .collect();
    Message::new(Role::User, text)
}

#[test]
fn a_full_pool_evicts_idle_conversations_before_refusing_and_refuses_only_what_can_never_fit() {
    let model = tiny();
    // 32 blocks of 16 positions.
    let config = EngineConfig {
        kv_blocks: 32,
        max_batch: 4,
        ..config()
    };
    let engine = start(&model, config);
    let m = engine.metrics();
    // Four idle conversations of 3 blocks each (≈40 prompt tokens + 8 generated).
    let mut first_handle = None;
    for salt in ['a', 'b', 'c', 'd'] {
        let out = run(
            &engine,
            &caller(),
            request(vec![long_message(38, salt)], None, 8),
        )
        .unwrap();
        first_handle.get_or_insert(out.info.handle.clone());
    }
    assert_eq!(EngineMetrics::get(&m.kv_blocks_used), 12);
    // Needs 30 of the 32 blocks: admitted after evicting idle conversations (LRU first).
    let big = run(
        &engine,
        &caller(),
        request(vec![long_message(200, 'x')], None, 270),
    )
    .unwrap();
    assert_eq!(big.info.finish_reason, FinishReason::Length);
    assert_eq!(EngineMetrics::get(&m.slot_evictions), 4);
    // The oldest conversation's handle now misses (its slot was evicted).
    let again = run(
        &engine,
        &caller(),
        request(vec![long_message(38, 'a')], first_handle.unwrap(), 4),
    )
    .unwrap();
    assert_eq!(again.info.reuse, ReuseOutcome::Miss);
    // Needs more than the whole pool: refused, without evicting anyone for nothing.
    let evictions = EngineMetrics::get(&m.slot_evictions);
    let e = run(
        &engine,
        &caller(),
        request(vec![long_message(200, 'y')], None, 400),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::KvCacheOverflow {
                needed_blocks: 38,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.reason(), ErrorReason::KvCacheOverflow);
    assert!(e.retry_after().is_some());
    assert_eq!(EngineMetrics::get(&m.slot_evictions), evictions);
}

#[test]
fn a_request_that_does_not_fit_next_to_running_ones_waits_for_their_blocks() {
    let model = tiny();
    let config = EngineConfig {
        kv_blocks: 32,
        max_batch: 4,
        ..config()
    };
    let (engine, gate) = start_gated(&model, config);
    gate.set_paused(true);
    let first = engine.generate(&caller(), request(vec![long_message(200, 'x')], None, 200));
    gate.wait_until_held();
    // 25 blocks are reserved by the first request; the second needs 20.
    let second = engine.generate(&caller(), request(vec![long_message(100, 'y')], None, 200));
    wait_for("the second request to queue", || engine.queue_depth() == 1);
    gate.set_paused(false);
    let a = first.collect_blocking().unwrap();
    let b = second.collect_blocking().unwrap();
    assert!(matches!(
        a.last(),
        Some(zerolayer_engine::Event::Finished(_))
    ));
    assert!(matches!(
        b.last(),
        Some(zerolayer_engine::Event::Finished(_))
    ));
    assert_eq!(
        engine.metrics().error_count(ErrorReason::KvCacheOverflow),
        0
    );
}

#[test]
fn a_delta_request_after_eviction_gets_context_evicted() {
    let model = tiny();
    let config = EngineConfig {
        slot_capacity: 17,
        max_batch: 16,
        ..config()
    };
    let engine = start(&model, config);
    let first = run(
        &engine,
        &caller(),
        request(vec![Message::new(Role::User, "keep me")], None, 4),
    )
    .unwrap();
    // 17 newer conversations fill the map: the oldest (first) is evicted.
    for i in 0..17 {
        run(
            &engine,
            &caller(),
            request(
                vec![Message::new(Role::User, format!("conversation {i}"))],
                None,
                2,
            ),
        )
        .unwrap();
    }
    assert!(EngineMetrics::get(&engine.metrics().slot_evictions) >= 1);
    let mut delta = request(
        vec![Message::new(Role::User, "and then?")],
        first.info.handle.clone(),
        4,
    );
    delta.delta = true;
    let e = run(&engine, &caller(), delta).unwrap_err();
    assert!(matches!(e, EngineError::ContextEvicted { .. }), "{e:?}");
    assert_eq!(e.reason(), ErrorReason::ContextEvicted);
    // The full transcript continues the conversation in a new slot.
    let transcript = vec![
        Message::new(Role::User, "keep me"),
        Message::new(Role::Assistant, first.text.clone()),
        Message::new(Role::User, "and then?"),
    ];
    let full = run(
        &engine,
        &caller(),
        request(transcript, first.info.handle.clone(), 4),
    )
    .unwrap();
    assert_eq!(full.info.reuse, ReuseOutcome::Miss);
    assert_eq!(full.info.session_id, first.info.session_id);
}

/// Starts turn 2 of a conversation held at the gate, and returns its stream and the handle
/// it was sent with.
fn running_turn(
    engine: &zerolayer_engine::Engine,
    gate: &Gate,
) -> (
    zerolayer_engine::GenerationStream,
    Option<Vec<u8>>,
    Vec<Message>,
) {
    let u1 = vec![Message::new(Role::User, "a story")];
    let t1 = run(engine, &caller(), request(u1.clone(), None, 3)).unwrap();
    let mut transcript = u1;
    transcript.push(Message::new(Role::Assistant, t1.text.clone()));
    transcript.push(Message::new(Role::User, "more"));
    gate.set_paused(true);
    let stream = engine.generate(
        &caller(),
        request(transcript.clone(), t1.info.handle.clone(), 50),
    );
    gate.wait_until_held();
    (stream, t1.info.handle, transcript)
}

#[test]
fn a_second_request_on_a_busy_session_gets_session_busy_after_the_bounded_wait() {
    let model = tiny();
    let config = EngineConfig {
        session_busy_wait: std::time::Duration::ZERO,
        ..config()
    };
    let (engine, gate) = start_gated(&model, config);
    let (first, handle, transcript) = running_turn(&engine, &gate);
    let second = engine.generate(&caller(), request(transcript, handle, 5));
    wait_for("the second request to queue", || engine.queue_depth() == 1);
    gate.set_paused(false);
    let e = second.collect_blocking().unwrap_err();
    assert!(matches!(e, EngineError::SessionBusy { .. }), "{e:?}");
    assert_eq!(e.reason(), ErrorReason::SessionBusy);
    let events = first.collect_blocking().unwrap();
    assert!(matches!(
        events.last(),
        Some(zerolayer_engine::Event::Finished(_))
    ));
}

#[test]
fn a_second_request_on_a_busy_session_waits_for_the_first_within_the_bound() {
    let model = tiny();
    let config = EngineConfig {
        session_busy_wait: std::time::Duration::from_secs(120),
        ..config()
    };
    let (engine, gate) = start_gated(&model, config);
    let (first, handle, transcript) = running_turn(&engine, &gate);
    let second = engine.generate(&caller(), request(transcript, handle, 5));
    wait_for("the second request to queue", || engine.queue_depth() == 1);
    gate.set_paused(false);
    let a = first.collect_blocking().unwrap();
    let b = second.collect_blocking().unwrap();
    let (Some(zerolayer_engine::Event::Finished(fa)), Some(zerolayer_engine::Event::Finished(fb))) =
        (a.last(), b.last())
    else {
        panic!("both finish");
    };
    // The second ran after the first, on the same slot (a branch back to the shared handle).
    assert_eq!(fb.session_id, fa.session_id);
    assert_eq!(fb.reuse, ReuseOutcome::Hit);
}

#[test]
fn a_full_queue_sheds_load_with_overloaded() {
    let model = tiny();
    let config = EngineConfig {
        max_queue: 1,
        ..config()
    };
    let (engine, gate) = start_gated(&model, config);
    gate.set_paused(true);
    let running = engine.generate(
        &caller(),
        request(vec![Message::new(Role::User, "one")], None, 3),
    );
    gate.wait_until_held();
    let queued = engine.generate(
        &caller(),
        request(vec![Message::new(Role::User, "two")], None, 3),
    );
    let e = run(
        &engine,
        &caller(),
        request(vec![Message::new(Role::User, "three")], None, 3),
    )
    .unwrap_err();
    assert_eq!(
        e,
        EngineError::Overloaded {
            queue_depth: 1,
            max_queue: 1
        }
    );
    assert_eq!(
        e.retry_after(),
        Some(zerolayer_engine::error::OVERLOADED_RETRY_AFTER)
    );
    gate.set_paused(false);
    running.collect_blocking().unwrap();
    queued.collect_blocking().unwrap();
    assert_eq!(engine.metrics().error_count(ErrorReason::Overloaded), 1);
}

#[test]
fn dropping_a_stream_cancels_the_request_and_frees_its_blocks() {
    let model = tiny();
    let engine = start(&model, config());
    let m = engine.metrics();
    let u1 = vec![Message::new(Role::User, "a story")];
    let t1 = run(&engine, &caller(), request(u1.clone(), None, 3)).unwrap();
    let held = EngineMetrics::get(&m.kv_blocks_used);
    let mut transcript = u1;
    transcript.push(Message::new(Role::Assistant, t1.text.clone()));
    transcript.push(Message::new(Role::User, "a long continuation please"));
    let mut stream = engine.generate(
        &caller(),
        request(transcript.clone(), t1.info.handle.clone(), 1500),
    );
    let first = stream.blocking_next().unwrap().unwrap();
    assert!(matches!(first, zerolayer_engine::Event::Tokens { .. }));
    assert!(
        EngineMetrics::get(&m.kv_blocks_used) > held,
        "the running turn reserved blocks"
    );
    drop(stream);
    wait_for("the cancellation", || {
        m.finished_count(FinishReason::Cancelled) == 1
    });
    wait_for("the blocks to return", || {
        EngineMetrics::get(&m.kv_blocks_used) == held
    });
    // The slot kept what the handle covers: the same turn again is a hit on all of it.
    let again = run(
        &engine,
        &caller(),
        request(transcript, t1.info.handle.clone(), 3),
    )
    .unwrap();
    assert_eq!(again.info.reuse, ReuseOutcome::Hit);
    assert_eq!(
        again.info.usage.cached_prompt_tokens,
        t1.info.context.kv_offset
    );
}

#[test]
fn shutdown_refuses_new_requests_and_lets_running_ones_finish() {
    let model = tiny();
    let (engine, gate) = start_gated(&model, config());
    gate.set_paused(true);
    let running = engine.generate(
        &caller(),
        request(vec![Message::new(Role::User, "one")], None, 5),
    );
    gate.wait_until_held();
    engine.shutdown();
    let e = run(
        &engine,
        &caller(),
        request(vec![Message::new(Role::User, "two")], None, 3),
    )
    .unwrap_err();
    assert_eq!(e.reason(), ErrorReason::EngineUnavailable);
    gate.set_paused(false);
    let events = running.collect_blocking().unwrap();
    assert!(matches!(
        events.last(),
        Some(zerolayer_engine::Event::Finished(_))
    ));
    engine.join();
    assert!(!engine.is_healthy());
}

#[test]
fn a_scheduler_panic_fails_the_streams_with_internal_and_marks_the_engine_unhealthy() {
    let model = tiny();
    let (engine, gate) = start_gated(&model, config());
    gate.panic.store(true, std::sync::atomic::Ordering::SeqCst);
    let e = run(
        &engine,
        &caller(),
        request(vec![Message::new(Role::User, "boom")], None, 3),
    )
    .unwrap_err();
    assert_eq!(e.reason(), ErrorReason::Internal);
    wait_for("the engine to report unhealthy", || !engine.is_healthy());
    let e = run(
        &engine,
        &caller(),
        request(vec![Message::new(Role::User, "after")], None, 3),
    )
    .unwrap_err();
    assert_eq!(e.reason(), ErrorReason::EngineUnavailable);
    assert!(engine.probe_blocking().is_err());
}

#[test]
fn probe_generates_one_token_without_a_slot() {
    let model = tiny();
    let engine = start(&model, config());
    let report = engine.probe_blocking().unwrap();
    assert!((report.token_id as usize) < 512);
    assert!(report.total_ns >= report.prefill_ns);
    assert_eq!(report.model, "dummy:tiny");
    assert_eq!(EngineMetrics::get(&engine.metrics().slots_live), 0);
    assert_eq!(EngineMetrics::get(&engine.metrics().kv_blocks_used), 0);
}

#[test]
fn validate_reports_what_generate_then_does() {
    let model = tiny();
    let engine = start(&model, config());
    let u1 = vec![Message::new(Role::User, "hello there")];
    let v1 = engine
        .validate_blocking(&caller(), request(u1.clone(), None, 7))
        .unwrap();
    let t1 = run(&engine, &caller(), request(u1.clone(), None, 7)).unwrap();
    assert_eq!(v1.prompt_tokens, t1.info.usage.prompt_tokens);
    assert_eq!(
        (v1.cached_prompt_tokens, v1.max_tokens, v1.context_window),
        (0, 7, 2048)
    );
    let mut transcript = u1;
    transcript.push(Message::new(Role::Assistant, t1.text.clone()));
    transcript.push(Message::new(Role::User, "more"));
    let v2 = engine
        .validate_blocking(
            &caller(),
            request(transcript.clone(), t1.info.handle.clone(), 7),
        )
        .unwrap();
    let t2 = run(
        &engine,
        &caller(),
        request(transcript, t1.info.handle.clone(), 7),
    )
    .unwrap();
    assert_eq!(v2.prompt_tokens, t2.info.usage.prompt_tokens);
    assert_eq!(v2.cached_prompt_tokens, t2.info.usage.cached_prompt_tokens);
    assert_eq!(v2.prefill_tokens, t2.info.usage.prefilled_prompt_tokens);
    assert!(v2.estimated_flops > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_async_api_streams_validates_and_probes_without_blocking_the_runtime() {
    let model = tiny();
    let engine = start(&model, config());
    let messages = vec![Message::new(Role::User, "async")];
    let report = engine
        .validate(&caller(), request(messages.clone(), None, 4))
        .await
        .unwrap();
    let mut stream = engine.generate(&caller(), request(messages, None, 4));
    let mut tokens = 0;
    let info = loop {
        match stream.next().await.expect("a final event").unwrap() {
            zerolayer_engine::Event::Tokens { token_ids, .. } => tokens += token_ids.len(),
            zerolayer_engine::Event::Finished(info) => break info,
        }
    };
    assert_eq!(info.usage.prompt_tokens, report.prompt_tokens);
    assert_eq!(tokens as u32, info.usage.generated_tokens);
    assert!(
        stream.next().await.is_none(),
        "nothing after the final event"
    );
    let probe = engine.probe().await.unwrap();
    assert_eq!(probe.model, "dummy:tiny");
}
