//! Generation rules: stop sequences, the safety mask, context-length preflight, validation.

mod common;

use common::*;
use zerolayer_engine::api::{Message, Role, SamplingOptions, Truncation};
use zerolayer_engine::{EngineError, ErrorReason, FinishReason, SafetyConfig};

/// The opening of the stories260K tests; greedy, the model continues it with
/// "She loved to play outside in the park. One day, she saw a big,".
const OPENING: &str = "Once upon a time, there was a little girl named Lily.";

fn opening() -> Vec<Message> {
    vec![Message::new(Role::User, OPENING)]
}

#[test]
fn stop_sequences_end_the_text_just_before_the_match() {
    let Some(model) = stories() else { return };
    let engine = start(&model, config());
    let plain = run(&engine, &caller(), request(opening(), None, 24)).unwrap();
    assert!(plain.text.contains(" the park."), "{:?}", plain.text);
    for stop in [".", "the park", "park. One"] {
        let mut req = request(opening(), None, 24);
        req.sampling.stop = vec![stop.to_string(), "never appears".to_string()];
        let out = run(&engine, &caller(), req).unwrap();
        let cut = plain.text.find(stop).unwrap();
        assert_eq!(out.text, plain.text[..cut], "stop {stop:?}");
        assert_eq!(out.info.finish_reason, FinishReason::StopSequence);
        // The slot keeps only the delivered reply: the next turn caches prompt + kept tokens.
        assert!(
            out.info.context.kv_offset
                < out.info.usage.prompt_tokens + out.info.usage.generated_tokens
        );
    }
}

#[test]
fn a_forbidden_string_is_never_generated_and_changes_the_output() {
    let Some(model) = stories() else { return };
    let safety = SafetyConfig::none().forbid("acme", &["park"]);
    let engine = start_with_safety(&model, config(), safety);
    let plain = run(
        &start(&model, config()),
        &caller(),
        request(opening(), None, 48),
    )
    .unwrap();
    assert!(
        plain.text.contains("park"),
        "the model says it without the mask: {:?}",
        plain.text
    );
    let masked = run(&engine, &caller(), request(opening(), None, 48)).unwrap();
    assert!(!masked.text.contains("park"), "{:?}", masked.text);
    assert_ne!(masked.text, plain.text);
    // Another tenant is not restricted.
    let other = run(
        &engine,
        &zerolayer_engine::Caller::new("globex"),
        request(opening(), None, 48),
    )
    .unwrap();
    assert_eq!(other.text, plain.text);
}

#[test]
fn a_forbidden_string_in_the_prompt_is_a_safety_violation() {
    let model = tiny();
    let safety = SafetyConfig::none().forbid("acme", &["secret"]);
    let engine = start_with_safety(&model, config(), safety);
    let messages = vec![
        Message::new(Role::User, "hello"),
        Message::new(Role::Assistant, "the secret is out"),
    ];
    let e = run(&engine, &caller(), request(messages, None, 3)).unwrap_err();
    assert_eq!(e, EngineError::SafetyViolation { message_index: 1 });
    assert_eq!(e.reason(), ErrorReason::SafetyViolation);
}

#[test]
fn text_spelling_a_forbidden_string_with_other_tokens_ends_the_stream_with_safety() {
    // dummy:tiny generates pseudo-word tokens (" kel", …). Forbid two letters from inside the
    // first one: neither token form of the string (" el", "el" as bytes) is that token, so the
    // mask cannot stop it; the text check must, before the letters are delivered.
    let model = tiny();
    let tok = &model.tokenizer;
    let prompt = vec![Message::new(Role::User, "hello there")];
    let plain = run(
        &start(&model, config()),
        &caller(),
        request(prompt.clone(), None, 16),
    )
    .unwrap();
    let word = plain
        .ids
        .iter()
        .map(|&id| tok.piece(id))
        .find(|p| p.len() >= 4)
        .expect("a pseudo-word");
    let target = std::str::from_utf8(&word[2..4]).unwrap().to_string();
    let at = plain.text.find(&target).unwrap();
    let safety = SafetyConfig::none().forbid("acme", &[&target]);
    let engine = start_with_safety(&model, config(), safety);
    let out = run(&engine, &caller(), request(prompt, None, 16)).unwrap();
    assert_eq!(
        out.info.finish_reason,
        FinishReason::Safety,
        "{:?} / {:?} / {target:?}",
        out.text,
        plain.text
    );
    assert_eq!(out.text, plain.text[..at]);
}

#[test]
fn prompt_and_max_tokens_beyond_the_window_are_refused_or_truncated_on_the_left() {
    let Some(model) = stories() else { return };
    let engine = start(&model, config());
    let long: String = "Lily and Tom played in the garden all day long. ".repeat(60);
    let system = Message::new(Role::System, "Tell a story.");
    let messages = vec![system, Message::new(Role::User, long)];
    let e = run(&engine, &caller(), request(messages.clone(), None, 16)).unwrap_err();
    let EngineError::ContextLengthExceeded {
        prompt_tokens,
        max_tokens: 16,
        window: 512,
    } = e
    else {
        panic!("{e:?}")
    };
    assert!(prompt_tokens > 512);
    let mut req = request(messages, None, 16);
    req.truncation = Truncation::Left;
    let out = run(&engine, &caller(), req).unwrap();
    assert_eq!(out.info.usage.prompt_tokens, 512 - 16);
    assert_eq!(
        out.info.usage.truncated_prompt_tokens,
        prompt_tokens - (512 - 16)
    );
    assert_eq!(out.info.usage.cached_prompt_tokens, 0);
    assert!(out.info.usage.generated_tokens >= 1);
}

#[test]
fn without_max_tokens_generation_stops_when_the_window_is_full() {
    let Some(model) = stories() else { return };
    let engine = start(&model, config());
    // A prompt of 400..500 tokens: the default max_tokens (128) does not fit after it.
    let sentence = "Lily and Tom played in the garden all day long. ";
    let long = (1..)
        .map(|n| sentence.repeat(n))
        .find(|t| model.tokenizer.encode_message(t).len() + 1 > 400)
        .unwrap();
    assert!(model.tokenizer.encode_message(&long).len() + 1 < 500);
    let mut req = request(vec![Message::new(Role::User, long)], None, 1);
    req.sampling.max_tokens = None;
    let out = run(&engine, &caller(), req).unwrap();
    let u = out.info.usage;
    assert!(u.prompt_tokens + u.generated_tokens <= 512, "{u:?}");
    assert!(
        u.prompt_tokens > 512 - 128,
        "the default of 128 did not fit: {u:?}"
    );
    if out.info.finish_reason == FinishReason::Length {
        assert_eq!(u.prompt_tokens + u.generated_tokens, 512);
    }
}

#[test]
fn malformed_requests_are_invalid_requests() {
    let model = tiny();
    let engine = start(&model, config());
    let user = || vec![Message::new(Role::User, "hi")];
    let mut zero = request(user(), None, 1);
    zero.sampling.max_tokens = Some(0);
    let empty = request(vec![], None, 3);
    let mut delta = request(user(), None, 3);
    delta.delta = true;
    let late_system = request(
        vec![
            Message::new(Role::User, "hi"),
            Message::new(Role::System, "x"),
        ],
        None,
        3,
    );
    let mut nan = request(user(), None, 3);
    nan.sampling = SamplingOptions {
        temperature: f32::NAN,
        ..nan.sampling
    };
    let mut empty_stop = request(user(), None, 3);
    empty_stop.sampling.stop = vec![String::new()];
    for (i, req) in [zero, empty, delta, late_system, nan, empty_stop]
        .into_iter()
        .enumerate()
    {
        let e = run(&engine, &caller(), req).unwrap_err();
        assert_eq!(e.reason(), ErrorReason::InvalidRequest, "case {i}: {e:?}");
    }
    assert!(engine.is_healthy());
}
