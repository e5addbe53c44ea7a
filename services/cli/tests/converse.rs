//! `zerolayer converse` through the real binary: reuse gives the same replies as the layered
//! baseline with most of each prompt cached, the JSON contract, flags from the environment,
//! and clear errors.

use std::path::PathBuf;
use std::process::{Command, Output};

/// `ZEROLAYER_MODELS_DIR`, else `../shared/models` relative to the workspace root.
fn models_dir() -> PathBuf {
    match std::env::var_os("ZEROLAYER_MODELS_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models"),
    }
}

/// The stories260K checkpoint, or `None` with a visible skip message.
fn stories(test: &str) -> Option<String> {
    let p = models_dir().join("stories260K/stories260K.bin");
    if p.is_file() {
        Some(p.to_string_lossy().into_owned())
    } else {
        eprintln!(
            "SKIPPED {test}: {} not found (set ZEROLAYER_MODELS_DIR)",
            p.display()
        );
        None
    }
}

/// The binary with a clean `ZEROLAYER_*` environment and two worker threads.
fn zerolayer() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerolayer"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("ZEROLAYER_") {
            c.env_remove(k);
        }
    }
    c.env("RUST_LOG", "warn")
        .env("ZEROLAYER_THREADS", "2")
        .env("ZEROLAYER_KV_BLOCKS", "256");
    c
}

/// One `--json` line.
#[derive(Debug, Clone, PartialEq)]
struct Line {
    turn: u64,
    text: String,
    prompt_tokens: u64,
    cached_tokens: u64,
    ttft_ms: f64,
}

/// Parses `--json` output, checking every line has exactly the contract's keys.
fn parse(out: &Output) -> Vec<Line> {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let obj = v.as_object().unwrap();
            let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
            keys.sort_unstable();
            assert_eq!(
                keys,
                ["cached_tokens", "prompt_tokens", "text", "ttft_ms", "turn"]
            );
            Line {
                turn: v["turn"].as_u64().unwrap(),
                text: v["text"].as_str().unwrap().to_string(),
                prompt_tokens: v["prompt_tokens"].as_u64().unwrap(),
                cached_tokens: v["cached_tokens"].as_u64().unwrap(),
                ttft_ms: v["ttft_ms"].as_f64().unwrap(),
            }
        })
        .collect()
}

const TURNS: [&str; 3] = [
    "Once upon a time, there was a little girl named Lily.",
    "She went to the park with her mom.",
    "Then she saw a big dog.",
];

fn converse(model: &str, extra: &[&str]) -> Output {
    let mut c = zerolayer();
    c.args(["converse", "--model", model, "--max-tokens", "24", "--json"]);
    for t in TURNS {
        c.args(["--turn", t]);
    }
    c.args(extra).output().expect("binary runs")
}

#[test]
fn reuse_gives_the_baselines_replies_with_each_previous_turn_cached() {
    let Some(model) = stories("reuse_gives_the_baselines_replies_with_each_previous_turn_cached")
    else {
        return;
    };
    let with = parse(&converse(&model, &[]));
    let without = parse(&converse(&model, &["--no-reuse"]));
    assert_eq!(with.len(), 3);
    for (k, (a, b)) in with.iter().zip(&without).enumerate() {
        assert_eq!(a.turn, k as u64 + 1);
        assert_eq!(
            (&a.text, a.prompt_tokens),
            (&b.text, b.prompt_tokens),
            "turn {}",
            k + 1
        );
        assert_eq!(b.cached_tokens, 0);
        assert!(a.ttft_ms > 0.0 && b.ttft_ms > 0.0);
    }
    assert_eq!(with[0].cached_tokens, 0);
    for k in 1..3 {
        // Everything before this turn's user message: the previous prompt and its reply.
        assert!(
            with[k].cached_tokens > with[k - 1].prompt_tokens,
            "{:?}",
            with[k]
        );
        assert!(with[k].cached_tokens < with[k].prompt_tokens);
    }
}

#[test]
fn flags_are_read_from_the_environment_and_text_mode_prints_a_header_per_turn() {
    let out = zerolayer()
        .arg("converse")
        .env("ZEROLAYER_MODEL", "dummy:tiny")
        .env("ZEROLAYER_TURN", "hello")
        .env("ZEROLAYER_MAX_TOKENS", "4")
        .output()
        .expect("binary runs");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("[turn 1] prompt_tokens=7 cached_tokens=0 ttft_ms="),
        "{stdout}"
    );
}

#[test]
fn dummy_models_cache_every_previous_turn() {
    let mut c = zerolayer();
    c.args([
        "converse",
        "--model",
        "dummy:tiny",
        "--max-tokens",
        "5",
        "--json",
    ]);
    for t in ["one", "two", "three", "four"] {
        c.args(["--turn", t]);
    }
    let lines = parse(&c.output().unwrap());
    assert_eq!(
        lines.iter().map(|l| l.turn).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
    for k in 1..4 {
        assert!(
            lines[k].cached_tokens >= lines[k - 1].prompt_tokens,
            "{lines:?}"
        );
    }
}

#[test]
fn bad_arguments_fail_with_a_message_and_no_output() {
    for args in [
        vec!["converse", "--model", "dummy:tiny"],
        vec![
            "converse",
            "--model",
            "dummy:tiny",
            "--turn",
            "x",
            "--max-tokens",
            "0",
        ],
        vec!["converse", "--model", "dummy:nope", "--turn", "x"],
    ] {
        let out = zerolayer().args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert!(!out.stderr.is_empty(), "{args:?}");
    }
}
