//! KV reuse across turns: results never change, cached counts are exact, branches and delta
//! mode follow design §4.

mod common;

use common::*;
use zerolayer_engine::api::{Message, ReuseOutcome, Role};
use zerolayer_engine::{EngineConfig, EngineMetrics, ErrorReason};
use zerolayer_handle::TenantTag;
use zerolayer_model::{CpuBackend, GenerateOptions, KvCacheConfig, SamplingParams, generate};

/// The conversation of the reuse tests.
const TURNS: [&str; 3] = [
    "Once upon a time, there was a little girl named Lily.",
    "She went to the park with her mom.",
    "Then she saw a big dog.",
];

#[test]
fn reuse_never_changes_results_on_stories260k() {
    let Some(model) = stories() else { return };
    let with = converse(&start(&model, config()), &TURNS, 24);
    let without = converse(
        &start(
            &model,
            EngineConfig {
                reuse: false,
                ..config()
            },
        ),
        &TURNS,
        24,
    );
    for (k, (a, b)) in with.iter().zip(&without).enumerate() {
        assert_eq!(a.text, b.text, "turn {k}");
        assert_eq!(a.ids, b.ids, "turn {k}");
        assert_eq!(
            a.info.usage.prompt_tokens, b.info.usage.prompt_tokens,
            "turn {k}: same prompt length"
        );
        assert_eq!(b.info.reuse, ReuseOutcome::Disabled);
        assert!(b.info.handle.is_none());
        assert_eq!(b.info.usage.cached_prompt_tokens, 0);
    }
    assert_eq!(with[0].info.reuse, ReuseOutcome::New);
    for k in 1..with.len() {
        let prev = &with[k - 1].info.usage;
        assert_eq!(with[k].info.reuse, ReuseOutcome::Hit);
        assert_eq!(
            with[k].info.usage.cached_prompt_tokens,
            prev.prompt_tokens + prev.generated_tokens,
            "turn {k}"
        );
        assert_eq!(with[k].info.session_id, with[0].info.session_id);
    }
}

#[test]
fn reused_kv_gives_the_same_tokens_as_a_fresh_prefill_of_the_same_ids_on_dummy_tiny() {
    // The byte-level tokenizer never re-tokenises generated pseudo-words to the same ids, so
    // every reply is carried over through the slot's tracked message ids; the prompt the
    // engine continues is BOS + user ids + reply ids + ….
    let model = tiny();
    let turns = ["hello there", "and then?", "tell me more"];
    let out = converse(&start(&model, config()), &turns, 12);
    let tok = &model.tokenizer;
    let mut prompt = vec![tok.bos_id()];
    for (k, o) in out.iter().enumerate() {
        prompt.extend(tok.encode_message(turns[k]));
        assert_eq!(
            o.info.usage.prompt_tokens as usize,
            prompt.len(),
            "turn {k}"
        );
        if k > 0 {
            assert_eq!(o.info.reuse, ReuseOutcome::Hit);
            assert_eq!(
                o.info.usage.cached_prompt_tokens,
                out[k - 1].info.context.kv_offset,
                "turn {k}"
            );
        }
        assert_eq!(
            o.ids,
            fresh_generate(&model, &prompt, 12),
            "turn {k}: reused KV must equal a fresh prefill"
        );
        prompt.extend(&o.ids);
    }
}

#[test]
fn delta_mode_continues_the_slot_exactly_like_the_full_transcript() {
    let Some(model) = stories() else { return };
    let full = converse(&start(&model, config()), &TURNS[..2], 16);
    let engine = start(&model, config());
    let first = run(
        &engine,
        &caller(),
        request(vec![Message::new(Role::User, TURNS[0])], None, 16),
    )
    .unwrap();
    let mut req = request(
        vec![Message::new(Role::User, TURNS[1])],
        first.info.handle.clone(),
        16,
    );
    req.delta = true;
    let second = run(&engine, &caller(), req).unwrap();
    assert_eq!(first.ids, full[0].ids);
    assert_eq!(second.ids, full[1].ids);
    assert_eq!(
        second.info.usage.prompt_tokens,
        full[1].info.usage.prompt_tokens
    );
    assert_eq!(
        second.info.usage.cached_prompt_tokens,
        first.info.context.kv_offset
    );
    assert_eq!(second.info.reuse, ReuseOutcome::Hit);
}

#[test]
fn delta_mode_appends_to_the_slots_own_ids_on_dummy_tiny() {
    // dummy:tiny often generates bytes that are not UTF-8: the delivered text then differs
    // from the ids, the reply is not tracked for full transcripts, but delta mode continues
    // the slot's ids as they are.
    let model = tiny();
    let engine = start(&model, config());
    let first = run(
        &engine,
        &caller(),
        request(vec![Message::new(Role::User, "first turn")], None, 10),
    )
    .unwrap();
    let mut req = request(
        vec![Message::new(Role::User, "second turn")],
        first.info.handle.clone(),
        10,
    );
    req.delta = true;
    let second = run(&engine, &caller(), req).unwrap();
    let tok = &model.tokenizer;
    let mut prompt = vec![tok.bos_id()];
    prompt.extend(tok.encode_message("first turn"));
    prompt.extend(&first.ids);
    prompt.extend(tok.encode_message("second turn"));
    assert_eq!(second.info.usage.prompt_tokens as usize, prompt.len());
    assert_eq!(
        second.info.usage.cached_prompt_tokens,
        first.info.context.kv_offset
    );
    assert_eq!(second.ids, fresh_generate(&model, &prompt, 10));
}

/// Greedy generation of `prompt` on a fresh backend (the oracle: no reuse, no batching).
fn fresh_generate(model: &zerolayer_model::Model, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let kv = KvCacheConfig {
        block_size: 16,
        num_blocks: 64,
    };
    let mut fresh = CpuBackend::new(model.weights.clone(), kv, 1).unwrap();
    let options = GenerateOptions {
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_sequences: vec![],
    };
    generate(
        &mut fresh,
        &model.tokenizer,
        prompt,
        &options,
        &mut |_, _| {},
    )
    .unwrap()
    .tokens
}

#[test]
fn the_next_turn_authenticates_on_the_fast_path() {
    let model = tiny();
    let engine = start(&model, config());
    converse(&engine, &["a", "b", "c"], 4);
    let m = engine.metrics();
    assert_eq!(EngineMetrics::get(&m.handle_fast_path), 2);
    assert_eq!(EngineMetrics::get(&m.handle_full_verify), 0);
}

#[test]
fn branch_truncation_bumps_the_epoch_and_the_abandoned_branch_misses() {
    let model = tiny();
    let engine = start(&model, config());
    let keys = keys();
    let tenant = TenantTag::for_tenant("acme");
    let claims = |h: &Option<Vec<u8>>| {
        *keys
            .verify(h.as_ref().unwrap(), &tenant, 0, None)
            .unwrap()
            .0
            .claims()
    };
    let u1 = Message::new(Role::User, "the first question");
    let t1 = run(&engine, &caller(), request(vec![u1.clone()], None, 6)).unwrap();
    let a1 = Message::new(Role::Assistant, t1.text.clone());
    let h1 = t1.info.handle.clone();
    // Branch A: turn 2 from h1.
    let branch_a = vec![u1.clone(), a1.clone(), Message::new(Role::User, "branch A")];
    let t2a = run(&engine, &caller(), request(branch_a.clone(), h1.clone(), 6)).unwrap();
    assert_eq!(t2a.info.reuse, ReuseOutcome::Hit);
    let h2a = t2a.info.handle.clone();
    assert_eq!(claims(&h2a).epoch, claims(&h1).epoch);
    // Branch B: also from h1 (behind the slot): the slot is truncated to h1's offset.
    let branch_b = vec![u1.clone(), a1.clone(), Message::new(Role::User, "branch B")];
    let t2b = run(&engine, &caller(), request(branch_b, h1.clone(), 6)).unwrap();
    assert_eq!(t2b.info.reuse, ReuseOutcome::Hit);
    assert_eq!(t2b.info.usage.cached_prompt_tokens, claims(&h1).kv_offset);
    assert_eq!(
        claims(&t2b.info.handle).epoch,
        claims(&h1).epoch + 1,
        "truncation bumps the epoch"
    );
    // Branch A's handle now belongs to an abandoned branch: a miss, with the same result as a
    // fresh prefill (and the slot continues under the same session id).
    let mut turn3 = branch_a.clone();
    turn3.push(Message::new(Role::Assistant, t2a.text.clone()));
    turn3.push(Message::new(Role::User, "go on"));
    let t3 = run(&engine, &caller(), request(turn3.clone(), h2a, 6)).unwrap();
    assert_eq!(t3.info.reuse, ReuseOutcome::Miss);
    assert_eq!(t3.info.usage.cached_prompt_tokens, 0);
    assert_eq!(t3.info.session_id, t1.info.session_id);
    let fresh = run(
        &start(
            &model,
            EngineConfig {
                reuse: false,
                ..config()
            },
        ),
        &caller(),
        request(turn3, None, 6),
    )
    .unwrap();
    assert_eq!(t3.ids, fresh.ids);
}

#[test]
fn a_handle_of_another_conversation_starts_a_new_one() {
    let model = tiny();
    let engine = start(&model, config());
    let t1 = run(
        &engine,
        &caller(),
        request(vec![Message::new(Role::User, "conversation one")], None, 4),
    )
    .unwrap();
    let other = vec![Message::new(Role::User, "conversation two")];
    let t2 = run(
        &engine,
        &caller(),
        request(other, t1.info.handle.clone(), 4),
    )
    .unwrap();
    assert_eq!(t2.info.reuse, ReuseOutcome::New);
    assert_ne!(t2.info.session_id, t1.info.session_id);
    assert_eq!(engine.metrics().error_count(ErrorReason::InvalidHandle), 0);
}

#[test]
fn an_edited_reply_reuses_the_common_prefix_only() {
    let model = tiny();
    let engine = start(&model, config());
    let u1 = Message::new(Role::User, "question");
    let t1 = run(&engine, &caller(), request(vec![u1.clone()], None, 6)).unwrap();
    let edited = vec![
        u1,
        Message::new(Role::Assistant, "an edited reply"),
        Message::new(Role::User, "next"),
    ];
    let t2 = run(
        &engine,
        &caller(),
        request(edited.clone(), t1.info.handle.clone(), 6),
    )
    .unwrap();
    // BOS + " question" are shared; the edited reply is not.
    let shared = 1 + model.tokenizer.encode_message("question").len() as u32;
    assert_eq!(t2.info.usage.cached_prompt_tokens, shared);
    assert_eq!(t2.info.reuse, ReuseOutcome::Hit);
    let fresh = run(
        &start(
            &model,
            EngineConfig {
                reuse: false,
                ..config()
            },
        ),
        &caller(),
        request(edited, None, 6),
    )
    .unwrap();
    assert_eq!(t2.ids, fresh.ids);
}
