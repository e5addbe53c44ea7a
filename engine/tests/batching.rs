//! Batching never changes results: requests run together in one batch produce exactly what
//! they produce alone.

mod common;

use common::*;
use zerolayer_engine::api::{Message, Role, SamplingOptions};
use zerolayer_engine::{EngineConfig, EngineMetrics, GenerateRequest};
use zerolayer_model::Model;

/// Eight different requests: different prompts, lengths and samplers (greedy and seeded).
fn requests() -> Vec<GenerateRequest> {
    let prompts = [
        "Once upon a time",
        "The little dog ran to the park because it wanted to play with the ball.",
        "Tom",
        "She said, \"Let's go!\"",
        "In a big forest there lived a small bird who loved to sing every morning.",
        "The sun",
        "Lily had a red ball. She",
        "One day, a boy named Ben found a box.",
    ];
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut req = request(vec![Message::new(Role::User, *p)], None, 12 + 3 * i as u32);
            if i % 3 == 2 {
                req.sampling = SamplingOptions {
                    temperature: 0.8,
                    top_k: 40,
                    top_p: 0.9,
                    seed: Some(100 + i as u64),
                    ..req.sampling
                };
            }
            req
        })
        .collect()
}

/// Runs the requests one at a time, then all at once (held at the gate until all are queued),
/// and compares.
fn check(model: &Model) {
    let config = EngineConfig {
        step_token_budget: 64,
        ..config()
    };
    let sequential: Vec<Outcome> = {
        let engine = start(model, config.clone());
        requests()
            .into_iter()
            .map(|r| run(&engine, &caller(), r).unwrap())
            .collect()
    };
    let (engine, gate) = start_gated(model, config);
    gate.set_paused(true);
    let mut streams: Vec<_> = Vec::new();
    let mut reqs = requests().into_iter();
    // The first request enters a step and is held there; the other seven queue meanwhile and
    // are admitted together.
    streams.push(engine.generate(&caller(), reqs.next().unwrap()));
    gate.wait_until_held();
    streams.extend(reqs.map(|r| engine.generate(&caller(), r)));
    wait_for("all requests to be queued", || engine.queue_depth() == 7);
    gate.set_paused(false);
    let concurrent: Vec<Outcome> = streams
        .into_iter()
        .map(|s| {
            let events = s.collect_blocking().unwrap();
            outcome_of(events)
        })
        .collect();
    for (i, (a, b)) in sequential.iter().zip(&concurrent).enumerate() {
        assert_eq!(a.ids, b.ids, "request {i}");
        assert_eq!(a.text, b.text, "request {i}");
        assert_eq!(a.info.finish_reason, b.info.finish_reason, "request {i}");
    }
    let m = engine.metrics();
    let batched_steps: u64 = m.batch_size_buckets[3..]
        .iter()
        .map(EngineMetrics::get)
        .sum();
    assert!(
        batched_steps > 0,
        "some step ran at least 5 sequences together"
    );
}

/// Folds events into an [`Outcome`].
fn outcome_of(events: Vec<zerolayer_engine::Event>) -> Outcome {
    let mut text = String::new();
    let mut ids = Vec::new();
    for e in events {
        match e {
            zerolayer_engine::Event::Tokens {
                text: t, token_ids, ..
            } => {
                text.push_str(&t);
                ids.extend(token_ids);
            }
            zerolayer_engine::Event::Finished(info) => return Outcome { text, ids, info },
        }
    }
    panic!("no final event");
}

#[test]
fn eight_concurrent_requests_equal_eight_sequential_ones_on_stories260k() {
    let Some(model) = stories() else { return };
    check(&model);
}

#[test]
fn eight_concurrent_requests_equal_eight_sequential_ones_on_dummy_tiny() {
    check(&tiny());
}
