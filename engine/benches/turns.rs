//! Turn-k time to first token with KV reuse vs the layered baseline (`reuse: false`): a
//! conversation of `ZEROLAYER_BENCH_TURNS` (10) turns of ≈200 tokens each (a 160-byte user
//! message on a byte-level dummy model plus a 4-token reply, which the baseline re-tokenises
//! from its text into up to 33 byte tokens, so the baseline's turns are ≈195 tokens), on `dummy:small` unless
//! `ZEROLAYER_BENCH_MODEL` says otherwise. The same flow as `zerolayer converse --json`.
//! Prints one line per turn and mode, then the turn-k ratios. Run: `cargo bench -p
//! zerolayer-engine --bench turns`.

use std::sync::Arc;

use zerolayer_engine::api::{
    Caller, Event, GenerateRequest, Message, Role, SamplingOptions, Truncation,
};
use zerolayer_engine::{Engine, EngineConfig, SafetyConfig};
use zerolayer_handle::{KeyRing, SigningKey};
use zerolayer_model::load_model;

/// Per turn: (prompt tokens, cached tokens, ttft ns).
fn conversation(engine: &Engine, turns: usize) -> Vec<(u32, u32, u64)> {
    let caller = Caller::new("bench");
    let mut transcript = Vec::new();
    let mut handle = None;
    let mut out = Vec::new();
    for k in 0..turns {
        // 160 bytes: 161 tokens with the dummy prefix.
        let text: String = format!("turn {k:02} ")
            + &"the quick brown fox jumps over the lazy dog ".repeat(5)[..152];
        transcript.push(Message::new(Role::User, text));
        let req = GenerateRequest {
            messages: transcript.clone(),
            handle: handle.take(),
            delta: false,
            sampling: SamplingOptions {
                max_tokens: Some(4),
                seed: Some(0),
                ..SamplingOptions::default()
            },
            truncation: Truncation::Reject,
            request_id: String::new(),
        };
        let events = engine
            .generate(&caller, req)
            .collect_blocking()
            .expect("turn succeeds");
        let mut reply = String::new();
        for e in events {
            match e {
                Event::Tokens { text, .. } => reply.push_str(&text),
                Event::Finished(info) => {
                    handle = info.handle;
                    out.push((
                        info.usage.prompt_tokens,
                        info.usage.cached_prompt_tokens,
                        info.timings.ttft_ns,
                    ));
                }
            }
        }
        transcript.push(Message::new(Role::Assistant, reply));
    }
    out
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let spec = std::env::var("ZEROLAYER_BENCH_MODEL").unwrap_or_else(|_| "dummy:small".into());
    let turns: usize = std::env::var("ZEROLAYER_BENCH_TURNS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(10);
    let model = load_model(&spec, None).expect("model loads");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut results = Vec::new();
    for reuse in [true, false] {
        let config = EngineConfig {
            reuse,
            threads,
            slot_capacity: 1024,
            kv_blocks: 256,
            ..EngineConfig::default()
        };
        let keys = Arc::new(KeyRing::new(SigningKey::from_seed(1, &[7; 32])));
        let engine =
            Engine::start_cpu(&model, keys, SafetyConfig::none(), config).expect("engine starts");
        let r = conversation(&engine, turns);
        for (k, (prompt, cached, ttft)) in r.iter().enumerate() {
            println!(
                "{spec} reuse={reuse} turn={} prompt_tokens={prompt} cached_tokens={cached} ttft_ms={:.1}",
                k + 1,
                *ttft as f64 / 1e6
            );
        }
        results.push(r);
    }
    for (k, (with, without)) in results[0].iter().zip(&results[1]).enumerate() {
        println!(
            "turn {}: ttft reuse / no-reuse = {:.3}",
            k + 1,
            with.2 as f64 / without.2 as f64
        );
    }
}
