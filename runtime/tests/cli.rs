//! The `idem` binary: plugins check/list and `invoke`, with every hostile
//! plugin classified within its limit.

use idem_tests::plugins;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--plugins-dir", plugins::PLUGINS_DIR])
        .args(args)
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-cli-test-cache"),
        )
        .output()
        .expect("run idem")
}

fn json(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

#[test]
fn invoke_prints_the_invoice_email_effect() {
    let out = idem(&[
        "invoke",
        "send_invoice_email",
        "--payload",
        r#"{"invoice_id":42,"recipient":"ana@example.com"}"#,
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    let effects = v["effects"].as_array().unwrap();
    assert_eq!(effects.len(), 1);
    assert_eq!(effects[0]["idempotency_key"], "invoice:42:email:v1");
    assert_eq!(effects[0]["provider"], "email");
    assert_eq!(effects[0]["action"]["type"], "email");
}

#[test]
fn every_hostile_plugin_gets_its_classified_code_within_its_limit() {
    for (plugin, code, class, limit) in [
        (
            "hostile_loop",
            "plugin_timeout",
            "retryable",
            Duration::from_secs(10),
        ),
        (
            "hostile_memory_bomb",
            "plugin_out_of_memory",
            "retryable",
            Duration::from_secs(10),
        ),
        (
            "hostile_recursion",
            "plugin_stack_overflow",
            "retryable",
            Duration::from_secs(10),
        ),
        (
            "hostile_effect_flood",
            "plugin_output_too_large",
            "permanent",
            Duration::from_secs(20),
        ),
        (
            "hostile_huge_string",
            "plugin_output_too_large",
            "permanent",
            Duration::from_secs(20),
        ),
        (
            "hostile_panic",
            "plugin_panic",
            "retryable",
            Duration::from_secs(10),
        ),
        (
            "send_invoice_email",
            "payload_invalid",
            "permanent",
            Duration::from_secs(10),
        ),
    ] {
        let started = Instant::now();
        let out = idem(&["invoke", plugin, "--payload", "{}"]);
        let took = started.elapsed();
        assert_eq!(
            out.status.code(),
            Some(1),
            "{plugin}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v = json(&out);
        assert_eq!(v["error"]["code"], code, "{plugin}: {v}");
        assert_eq!(v["error"]["class"], class, "{plugin}: {v}");
        assert!(took < limit, "{plugin} took {took:?}");
    }
}

#[test]
fn an_unknown_plugin_is_a_usage_error_naming_the_loaded_ones() {
    let out = idem(&["invoke", "nope", "--payload", "{}"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no plugin named \"nope\""), "{stderr}");
    assert!(stderr.contains("send_invoice_email"), "{stderr}");
}

#[test]
fn check_accepts_examples_and_rejects_the_forbidden_import() {
    for ok in [
        plugins::SEND_INVOICE_EMAIL,
        plugins::ORDER_SYNC,
        plugins::NOOP,
    ] {
        let out = idem(&["plugins", "check", ok]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{ok}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let out = idem(&["plugins", "check", plugins::HOSTILE_FORBIDDEN_IMPORT]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("evil:plugin/exfiltrate"), "{stdout}");
    let missing = idem(&["plugins", "check", "/nonexistent/x.wasm"]);
    assert_eq!(missing.status.code(), Some(1));
}

#[test]
fn list_shows_names_hashes_and_limits_and_reports_the_bad_file() {
    let out = idem(&["plugins", "list"]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("send_invoice_email"), "{stdout}");
    assert!(
        stdout.contains("300ms"),
        "hostile_loop's manifest deadline: {stdout}"
    );
    assert!(!stdout.contains("hostile_forbidden_import"));
    assert!(
        stderr.contains("hostile_forbidden_import.wasm not loaded"),
        "{stderr}"
    );
}
