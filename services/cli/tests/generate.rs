//! `zerolayer generate` through the real binary: llama2.c-identical output for stories260K, flags
//! from the environment, and a clear error (non-zero exit, nothing on stdout) for every bad input.

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
fn stories(test: &str) -> Option<PathBuf> {
    let p = models_dir().join("stories260K/stories260K.bin");
    if p.is_file() {
        Some(p)
    } else {
        eprintln!(
            "SKIPPED {test}: {} not found (set ZEROLAYER_MODELS_DIR)",
            p.display()
        );
        None
    }
}

/// The README's reference output block.
fn reference() -> String {
    let readme = std::fs::read_to_string(models_dir().join("stories260K/README.md")).unwrap();
    let after = &readme[readme.find("Reference output").unwrap()..];
    let start = after.find("```\n").unwrap() + 4;
    let end = after[start..].find("```").unwrap() + start;
    after[start..end].trim_end_matches('\n').to_string()
}

/// The binary with a clean `ZEROLAYER_*` environment.
fn zerolayer() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerolayer"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("ZEROLAYER_") {
            c.env_remove(k);
        }
    }
    c.env("RUST_LOG", "warn");
    c
}

fn generate(args: &[&str]) -> Output {
    zerolayer()
        .arg("generate")
        .args(args)
        .output()
        .expect("binary runs")
}

#[test]
fn greedy_stories260k_output_starts_with_the_readme_reference() {
    let Some(model) = stories("greedy_stories260k_output_starts_with_the_readme_reference") else {
        return;
    };
    let out = generate(&[
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "256",
    ]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with(&reference()), "stdout:\n{text}");
    assert!(text.ends_with('\n'));
}

#[test]
fn every_flag_can_come_from_the_environment() {
    let Some(model) = stories("every_flag_can_come_from_the_environment") else {
        return;
    };
    let tok = model.with_file_name("tok512.bin");
    let out = zerolayer()
        .arg("generate")
        .env("ZEROLAYER_MODEL", &model)
        .env("ZEROLAYER_TOKENIZER", &tok)
        .env("ZEROLAYER_PROMPT", "Once upon a time")
        .env("ZEROLAYER_MAX_TOKENS", "40")
        .env("ZEROLAYER_TEMPERATURE", "0")
        .env("ZEROLAYER_TOP_K", "0")
        .env("ZEROLAYER_TOP_P", "1")
        .env("ZEROLAYER_SEED", "3")
        .env("ZEROLAYER_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(reference().starts_with(text.trim_end()), "stdout:\n{text}");
}

#[test]
fn seeded_sampling_is_reproducible_through_the_binary() {
    let args = [
        "--model",
        "dummy:tiny@9",
        "--prompt",
        "Hello",
        "--max-tokens",
        "30",
        "--temperature",
        "0.8",
        "--top-k",
        "50",
        "--top-p",
        "0.9",
        "--seed",
        "17",
    ];
    let a = generate(&args);
    let b = generate(&args);
    assert!(
        a.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&a.stderr)
    );
    assert_eq!(a.stdout, b.stdout);
    assert!(a.stdout.starts_with(b"Hello"));
}

fn assert_fails(args: &[&str], message: &str) {
    let out = generate(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(
        out.stdout.is_empty(),
        "{args:?} printed {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stderr.contains(message),
        "{args:?}: stderr {stderr:?} lacks {message:?}"
    );
}

#[test]
fn bad_inputs_fail_with_a_clear_message_and_no_output() {
    let base = |extra: &[&'static str]| {
        let mut v = vec![
            "--model",
            "dummy:tiny",
            "--prompt",
            "Hi",
            "--max-tokens",
            "5",
        ];
        v.extend_from_slice(extra);
        v
    };
    assert_fails(
        &["--model", "dummy:tiny", "--prompt", "", "--max-tokens", "5"],
        "prompt is empty",
    );
    assert_fails(
        &[
            "--model",
            "dummy:tiny",
            "--prompt",
            "Hi",
            "--max-tokens",
            "0",
        ],
        "max_tokens must be at least 1",
    );
    assert_fails(
        &[
            "--model",
            "dummy:tiny",
            "--prompt",
            "Hi",
            "--max-tokens",
            "5000",
        ],
        "exceeds the context",
    );
    assert_fails(&base(&["--temperature", "NaN"]), "temperature NaN");
    assert_fails(&base(&["--temperature", "-1"]), "temperature -1");
    assert_fails(&base(&["--top-p", "0"]), "top_p 0");
    assert_fails(&base(&["--top-p", "1.5"]), "top_p 1.5");
    assert_fails(
        &[
            "--model",
            "dummy:enormous",
            "--prompt",
            "Hi",
            "--max-tokens",
            "5",
        ],
        "unknown dummy model",
    );
    assert_fails(
        &[
            "--model",
            "/nonexistent/model.bin",
            "--prompt",
            "Hi",
            "--max-tokens",
            "5",
        ],
        "cannot read",
    );
}

#[test]
fn corrupt_checkpoint_files_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.bin");
    std::fs::write(&bad, [7u8; 100]).unwrap();
    std::fs::write(dir.path().join("tokenizer.bin"), [0u8; 8]).unwrap();
    assert_fails(
        &[
            "--model",
            bad.to_str().unwrap(),
            "--prompt",
            "Hi",
            "--max-tokens",
            "5",
        ],
        "invalid model configuration",
    );
    let Some(model) = stories("corrupt_checkpoint_files_are_reported") else {
        return;
    };
    let bytes = std::fs::read(&model).unwrap();
    let truncated = dir.path().join("truncated.bin");
    std::fs::write(&truncated, &bytes[..bytes.len() - 1000]).unwrap();
    assert_fails(
        &[
            "--model",
            truncated.to_str().unwrap(),
            "--prompt",
            "Hi",
            "--max-tokens",
            "5",
        ],
        "truncated",
    );
    let tok = model.with_file_name("tok512.bin");
    let bad_tok = dir.path().join("bad_tok.bin");
    std::fs::write(&bad_tok, &std::fs::read(&tok).unwrap()[..500]).unwrap();
    assert_fails(
        &[
            "--model",
            model.to_str().unwrap(),
            "--tokenizer",
            bad_tok.to_str().unwrap(),
            "--prompt",
            "Hi",
            "--max-tokens",
            "5",
        ],
        "tokenizer file is truncated",
    );
}
