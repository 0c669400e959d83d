//! Hostile: hands the host text it must never store or print as it is (NUL
//! bytes, control characters, ANSI escapes, invalid code shapes, oversized
//! messages) in every field of the contract a plugin can reach: its error's
//! code and message, an effect's provider and key, a child job's plugin and
//! queue, an HTTP request's method, path and headers, an email's recipients
//! and subject, and the `log` import. The payload's `case` picks the field
//! (`{"case": "nul_code"}`; see [`CASES`]), so one plugin covers them all
//! (issue 22).
//!
//! Built straight against `wit/plugin.wit` with wit-bindgen, not with the
//! SDK, whose builders refuse most of these values: a plugin in another
//! language, or one that skips the SDK, can hand the host anything the
//! contract's types allow.
// The generated bindings take every field of a job as an argument.
#![allow(clippy::too_many_arguments)]
wit_bindgen::generate!({ world: "job-plugin", path: "../../wit" });

use idem::plugin::log::{self, Level};
use idem::plugin::types::{
    Action, ChildJob, Email, ErrorDetail, HttpRequest, Pair, RetryableError,
};

/// Every case the payload may name.
pub const CASES: &[&str] = &[
    "nul_code",
    "code_spaces",
    "code_unicode",
    "code_empty",
    "code_long",
    "code_escapes",
    "message_escapes",
    "message_large",
    "message_huge",
    "key_nul",
    "key_escapes",
    "key_long",
    "provider_nul",
    "child_plugin_nul",
    "child_queue_escapes",
    "http_method_nul",
    "http_path_nul",
    "http_path_escapes",
    "http_path_tab_dots",
    "http_header_name_nul",
    "http_header_value_nul",
    "http_header_value_crlf",
    "http_header_transfer_encoding",
    "http_header_x_forwarded_for",
    "http_header_x_original_url",
    "http_path_encoded_dots",
    "email_to_nul",
    "email_to_crlf",
    "email_subject_nul",
    "log_escapes",
];

/// Text no store or terminal should get raw: a NUL, an ANSI "clear the
/// screen", a carriage return, a bell and an OSC "set the window title".
const HOSTILE: &str = "nul\0 clear\u{1b}[2J cr\r bell\u{7} title\u{1b}]0;pwned\u{7} end";

/// Below the host's 64 KiB cap on a plugin's error message, so it is taken,
/// cleaned and cut (it reaches the store's path).
const LARGE: usize = 60 << 10;

/// Far above that cap (and within the 1 MiB output cap): refused whole.
const HUGE: usize = 1 << 20;

struct Hostile;

impl Guest for Hostile {
    fn handle(job: Job) -> Result<Vec<Effect>, JobError> {
        let case = serde_json::from_slice::<serde_json::Value>(&job.payload)
            .ok()
            .and_then(|p| p.get("case")?.as_str().map(str::to_string))
            .unwrap_or_default();
        run(&case, &job.correlation_id)
    }
}

fn retryable(code: &str, message: &str) -> Result<Vec<Effect>, JobError> {
    Err(JobError::Retryable(RetryableError {
        code: code.into(),
        message: message.into(),
        retry_after_ms: None,
    }))
}

fn permanent(code: &str, message: String) -> Result<Vec<Effect>, JobError> {
    Err(JobError::Permanent(ErrorDetail {
        code: code.into(),
        message,
    }))
}

/// `HOSTILE` repeated to `len` bytes (whole repeats, then plain filler).
fn filled(len: usize) -> String {
    let mut text = HOSTILE.repeat(len / HOSTILE.len());
    text.push_str(&"x".repeat(len - text.len()));
    text
}

/// A valid email effect, so only the field a case changes is hostile.
fn email(case: &str) -> Effect {
    Effect {
        provider: "email".into(),
        idempotency_key: format!("hostile:{case}:v1"),
        action: Action::Email(Email {
            to: vec!["ana@example.com".into()],
            subject: "Invoice".into(),
            text: Some(format!("body {HOSTILE}")),
            html: None,
            template: None,
        }),
    }
}

/// A valid HTTP effect on the `partner` provider.
fn http(case: &str, method: &str, path: &str, headers: Vec<(&str, &str)>) -> Effect {
    Effect {
        provider: "partner".into(),
        idempotency_key: format!("hostile:{case}:v1"),
        action: Action::Http(HttpRequest {
            method: method.into(),
            path: path.into(),
            headers: headers
                .into_iter()
                .map(|(name, value)| Pair {
                    name: name.into(),
                    value: value.into(),
                })
                .collect(),
            body: Some(b"{}".to_vec()),
        }),
    }
}

/// A valid child job of `noop`.
fn child(case: &str, plugin: &str, queue: Option<&str>) -> Effect {
    Effect {
        provider: "jobs".into(),
        idempotency_key: format!("hostile:{case}:v1"),
        action: Action::Enqueue(ChildJob {
            plugin: plugin.into(),
            queue: queue.map(str::to_string),
            payload: b"{}".to_vec(),
            delay_ms: 0,
            priority: 0,
        }),
    }
}

fn with_email(case: &str, change: impl FnOnce(&mut Email)) -> Vec<Effect> {
    let mut effect = email(case);
    if let Action::Email(e) = &mut effect.action {
        change(e);
    }
    vec![effect]
}

/// The plan (or error) of `case`; `correlation_id` tags the log lines, so a
/// test can find its own among others.
fn run(case: &str, correlation_id: &str) -> Result<Vec<Effect>, JobError> {
    match case {
        // The issue's own: a retryable error whose code and message hold NUL.
        "nul_code" => retryable("nul\0code", &format!("message {HOSTILE}")),
        "code_spaces" => permanent("card declined", format!("spaces {HOSTILE}")),
        "code_unicode" => permanent("karte_abgelehnt_\u{fc}", format!("unicode {HOSTILE}")),
        "code_empty" => permanent("", format!("empty {HOSTILE}")),
        "code_long" => permanent(&"c".repeat(300), format!("long {HOSTILE}")),
        "code_escapes" => permanent("\u{1b}[2J\r\u{7}code", format!("escapes {HOSTILE}")),
        // A valid code: the message alone is hostile.
        "message_escapes" => permanent("hostile_message", format!("{HOSTILE}\nline two\ttab")),
        "message_large" => permanent("hostile_large", filled(LARGE)),
        "message_huge" => permanent("hostile_huge", filled(HUGE)),
        "key_nul" => Ok(vec![Effect {
            idempotency_key: "hostile:\0:v1".into(),
            ..email(case)
        }]),
        "key_escapes" => Ok(vec![Effect {
            idempotency_key: "hostile:\u{1b}[2J\r:v1".into(),
            ..email(case)
        }]),
        "key_long" => Ok(vec![Effect {
            idempotency_key: "k".repeat(300),
            ..email(case)
        }]),
        "provider_nul" => Ok(vec![Effect {
            provider: "email\0".into(),
            ..email(case)
        }]),
        "child_plugin_nul" => Ok(vec![child(case, "noop\0", None)]),
        "child_queue_escapes" => Ok(vec![child(case, "noop", Some("default\r\n\u{1b}[2J"))]),
        "http_method_nul" => Ok(vec![http(case, "POST\0", "/orders/7/events", vec![])]),
        "http_path_nul" => Ok(vec![http(case, "POST", "/orders/\0/events", vec![])]),
        "http_path_escapes" => Ok(vec![http(
            case,
            "POST",
            "/orders/\u{1b}[2J\r\u{7}/events",
            vec![],
        )]),
        // `.<TAB>.` is not `..` to a substring check, but a URL parser
        // drops tabs and newlines and then resolves the `..`.
        "http_path_tab_dots" => Ok(vec![http(case, "POST", "/orders/.\t./escaped", vec![])]),
        "http_header_name_nul" => Ok(vec![http(
            case,
            "POST",
            "/orders/7/events",
            vec![("x-hostile\0", "v")],
        )]),
        "http_header_value_nul" => Ok(vec![http(
            case,
            "POST",
            "/orders/7/events",
            vec![("x-hostile", "v\0")],
        )]),
        "http_header_value_crlf" => Ok(vec![http(
            case,
            "POST",
            "/orders/7/events",
            vec![("x-hostile", "v\r\nx-injected: 1")],
        )]),
        // Hop-by-hop and routing headers (issue 24): the framing, the
        // client address an allow-list trusts, the path a proxy routes by.
        "http_header_transfer_encoding" => Ok(vec![http(
            case,
            "POST",
            "/orders/7/events",
            vec![("Transfer-Encoding", "chunked")],
        )]),
        "http_header_x_forwarded_for" => Ok(vec![http(
            case,
            "POST",
            "/orders/7/events",
            vec![("X-Forwarded-For", "127.0.0.1")],
        )]),
        "http_header_x_original_url" => Ok(vec![http(
            case,
            "POST",
            "/orders/7/events",
            vec![("X-Original-URL", "/admin")],
        )]),
        "http_path_encoded_dots" => Ok(vec![http(case, "POST", "/orders/%2e%2e/admin", vec![])]),
        "email_to_nul" => Ok(with_email(case, |e| {
            e.to = vec!["ana\0@example.com".into()]
        })),
        "email_to_crlf" => Ok(with_email(case, |e| {
            e.to = vec!["ana@example.com\r\nbcc: eve@example.com".into()]
        })),
        "email_subject_nul" => Ok(with_email(case, |e| {
            e.subject = format!("Invoice {HOSTILE}\r\nbcc: eve@example.com")
        })),
        // Logs are printed: every level gets the hostile text; the job
        // itself asks for nothing.
        "log_escapes" => {
            for level in [
                Level::Trace,
                Level::Debug,
                Level::Info,
                Level::Warn,
                Level::Error,
            ] {
                log::log(
                    level,
                    &format!("hostile log {correlation_id} {HOSTILE}\nforged line"),
                );
            }
            Ok(Vec::new())
        }
        other => permanent("unknown_case", format!("no case {other:?}")),
    }
}

export!(Hostile);
