//! Asking an `http` or `email` provider whether it applied a key: the
//! `[providers.NAME] lookup` request, its budget, and how its answer maps
//! to [`Lookup`]. The request itself goes out through
//! [`HttpProvider`](super::http::HttpProvider), whose path check, client and
//! auth header it shares.
//!
//! Answers: a status in `applied` is applied (with the reference `result`
//! finds; when it finds nothing, per `when_no_result`); one in
//! `not_applied` is not applied; 408, 429, 5xx, a timeout or a connection
//! error mean the provider could not be asked now (`lookup_unavailable`,
//! with its `Retry-After`); anything else fits neither
//! (`lookup_unanswerable`, naming the status).

use super::config::{LookupConfig, ResultRef, Statuses, WhenNoResult};
use super::guard::TokenBucket;
use super::{Lookup, LookupPolicy};
use crate::failure::{Code, Failure};
use reqwest::header::HeaderMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A configured lookup of one provider.
pub(super) struct HttpLookup {
    /// `GET` or `HEAD`.
    pub method: reqwest::Method,
    /// The path template, holding `{key}`.
    pub path: String,
    applied: Statuses,
    not_applied: Vec<u16>,
    result: ResultRef,
    when_no_result: WhenNoResult,
    /// Settle and timeout.
    pub policy: LookupPolicy,
    budget: Budget,
}

/// A sample key the path template is checked with at start.
pub(super) const SAMPLE_KEY: &str = "plugin/key-1";

impl HttpLookup {
    /// The lookup of `config`, validated; `result` and `timeout` default to
    /// the provider's own.
    pub fn new(
        config: &LookupConfig,
        provider_result: &ResultRef,
        provider_timeout: Duration,
    ) -> Result<Self, String> {
        config.validate()?;
        let method = reqwest::Method::from_bytes(config.method.as_bytes())
            .map_err(|_| format!("lookup method {:?} is not a method", config.method))?;
        let result = config
            .result
            .clone()
            .unwrap_or_else(|| provider_result.clone());
        result.validate().map_err(|why| format!("lookup {why}"))?;
        Ok(HttpLookup {
            method,
            path: config.path.clone(),
            applied: config.applied.clone(),
            not_applied: config.not_applied.clone(),
            result,
            when_no_result: config.when_no_result,
            policy: LookupPolicy {
                settle: config.settle,
                timeout: config.timeout.unwrap_or(provider_timeout),
            },
            budget: Budget::new(config.max_in_flight, config.rate_per_second),
        })
    }

    /// The lookup's path for `key`: `{key}` replaced by the key
    /// percent-encoded, so `/` and `?` stay inside the key's segment. The
    /// result still goes through the provider's path check.
    pub fn path_for(&self, key: &str) -> Result<String, Failure> {
        // A lookup path is often a search (`query=metadata['k']:'{key}'`):
        // percent-encoding keeps a key inside its URL segment, but the
        // provider decodes it before its search language reads it, where a
        // quote or a backslash would end the string early and could turn
        // the search into one that misses the request ("not applied", sent
        // again). Such a key is never asked.
        if let Some(c) = key.chars().find(|c| matches!(c, '\'' | '"' | '\\' | '`')) {
            return Err(unanswerable(format!(
                "the key {} holds {c:?}, which could end a quoted string in the provider's \
                 search: it is not asked",
                crate::boundary::shown(key)
            )));
        }
        let encoded = encode_key(key);
        // A key of dots is a dot segment once in the path (`/by-key/.`
        // resolves to `/by-key/`): another resource, never asked.
        if encoded.bytes().all(|b| b == b'.') {
            return Err(unanswerable(format!(
                "the key {} cannot be put in a lookup path",
                crate::boundary::shown(key)
            )));
        }
        Ok(self.path.replace("{key}", &encoded))
    }

    /// Waits for a place in the budget (most `max_in_flight` lookups at
    /// once, `rate_per_second`); the caller bounds the wait.
    pub async fn enter(&self) -> OwnedSemaphorePermit {
        self.budget.enter().await
    }

    /// The budget, as text for a message.
    pub fn budget_text(&self) -> String {
        self.budget.text()
    }

    /// What an answer of `status` with `headers` and (bounded) `body` says.
    pub fn answer(&self, status: u16, headers: &HeaderMap, body: &[u8]) -> Result<Lookup, Failure> {
        if self.applied.contains(status) {
            let none = |why: &str| match self.when_no_result {
                WhenNoResult::Applied => Ok(Lookup::Applied { result_ref: None }),
                WhenNoResult::NotApplied if why.is_empty() => Ok(Lookup::NotApplied),
                // An empty search cannot be told from a body that was not
                // read: that is no answer, never "not applied".
                WhenNoResult::NotApplied => Err(unanswerable(format!(
                    "the provider answered {} to the lookup {why}",
                    shown_status(status)
                ))),
            };
            return match find_result(&self.result, headers, body) {
                Found::Value(value) => Ok(Lookup::Applied {
                    result_ref: crate::boundary::result_ref(&value),
                }),
                Found::Null | Found::Nothing => none(""),
                Found::Unreadable => none(
                    "with a body that is not JSON (or over 64 KiB) or a header that is not text, \
                     so its `result` cannot be read",
                ),
            };
        }
        if self.not_applied.contains(&status) {
            return Ok(Lookup::NotApplied);
        }
        if matches!(status, 408 | 429 | 500..=599) {
            return Err(Failure::host(
                Code::LookupUnavailable,
                format!(
                    "the provider answered {} to the lookup",
                    shown_status(status)
                ),
            )
            .with_retry_after(super::http::retry_after(headers)));
        }
        let redirect = if (300..=399).contains(&status) {
            " (redirects are not followed)"
        } else {
            ""
        };
        Err(unanswerable(format!(
            "the provider answered {}{redirect} to the lookup{}, which is in neither \
             `applied` nor `not_applied`",
            shown_status(status),
            excerpt(body)
        )))
    }
}

/// A lookup whose answer fits neither outcome.
pub(super) fn unanswerable(message: String) -> Failure {
    Failure::host(Code::LookupUnanswerable, message)
}

/// `404 Not Found`, or the bare number for a status without a reason.
fn shown_status(status: u16) -> String {
    match reqwest::StatusCode::from_u16(status)
        .ok()
        .and_then(|code| code.canonical_reason())
    {
        Some(reason) => format!("{status} {reason}"),
        None => status.to_string(),
    }
}

/// The provider's error code in a body, when it is a sane token: never
/// the body itself, which may echo a credential (a gateway repeating the
/// `Authorization` header), as an effect's error record keeps only the code.
fn excerpt(body: &[u8]) -> String {
    match super::http::provider_code(body) {
        Some(code) => format!(" ({code})"),
        None => String::new(),
    }
}

/// What a response holds where a [`ResultRef`] points.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Found {
    /// A value (a JSON string as it is, other JSON as its text).
    Value(String),
    /// JSON `null` there.
    Null,
    /// Nothing there: no such header, or the pointer finds nothing.
    Nothing,
    /// The body is not JSON, or the header is not text.
    Unreadable,
}

/// Reads `result` from a response (the effect's answer and the lookup's
/// alike); the caller cleans a value by the boundary's rule.
pub(super) fn find_result(result: &ResultRef, headers: &HeaderMap, body: &[u8]) -> Found {
    if let Some(header) = &result.header {
        return match headers.get(header) {
            None => Found::Nothing,
            Some(value) => match value.to_str() {
                Ok(text) => Found::Value(text.to_string()),
                Err(_) => Found::Unreadable,
            },
        };
    }
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Found::Unreadable;
    };
    match json.pointer(&result.json_pointer) {
        None => Found::Nothing,
        Some(serde_json::Value::Null) => Found::Null,
        Some(serde_json::Value::String(s)) => Found::Value(s.clone()),
        Some(other) => Found::Value(other.to_string()),
    }
}

/// Every byte outside RFC 3986's unreserved set (`A-Z a-z 0-9 - . _ ~`)
/// as `%XX`: `/` becomes `%2F`, a space `%20`.
///
/// `assert_eq!(encode_key("billing/a b"), "billing%2Fa%20b");`
pub(super) fn encode_key(key: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(key.len());
    for byte in key.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

/// How many lookups of one provider run at once, and how often: lookups
/// run while the provider may be struggling, so they are kept apart from
/// (and below) the effects' own guard.
struct Budget {
    slots: Arc<Semaphore>,
    max_in_flight: usize,
    rate: Option<Mutex<TokenBucket>>,
    per_second: f64,
}

impl Budget {
    fn new(max_in_flight: usize, per_second: f64) -> Self {
        Budget {
            slots: Arc::new(Semaphore::new(max_in_flight.max(1))),
            max_in_flight: max_in_flight.max(1),
            rate: TokenBucket::new(per_second).map(Mutex::new),
            per_second,
        }
    }

    async fn enter(&self) -> OwnedSemaphorePermit {
        let slot = loop {
            // Never closed: the semaphore lives as long as the provider.
            if let Ok(slot) = self.slots.clone().acquire_owned().await {
                break slot;
            }
        };
        while let Some(wait) = self
            .rate
            .as_ref()
            .and_then(|r| r.lock().unwrap_or_else(|p| p.into_inner()).take())
        {
            tokio::time::sleep(wait).await;
        }
        slot
    }

    fn text(&self) -> String {
        if self.rate.is_some() {
            format!(
                "max_in_flight {}, rate_per_second {}",
                self.max_in_flight, self.per_second
            )
        } else {
            format!("max_in_flight {}", self.max_in_flight)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::failure::ErrorClass;
    use reqwest::header::HeaderValue;

    fn lookup(extra: &str) -> HttpLookup {
        let config: LookupConfig =
            toml::from_str(&format!("path = \"/by-key/{{key}}\"\n{extra}")).unwrap();
        HttpLookup::new(&config, &ResultRef::default(), Duration::from_secs(7)).unwrap()
    }

    fn answer(l: &HttpLookup, status: u16, body: &str) -> Result<Lookup, Failure> {
        l.answer(status, &HeaderMap::new(), body.as_bytes())
    }

    #[test]
    fn keys_are_encoded_byte_by_byte_outside_the_unreserved_set() {
        assert_eq!(encode_key("billing/invoice-42"), "billing%2Finvoice-42");
        assert_eq!(
            encode_key("a b?c#d%e&f=g+h"),
            "a%20b%3Fc%23d%25e%26f%3Dg%2Bh"
        );
        assert_eq!(encode_key("A.z_0~9"), "A.z_0~9");
        assert_eq!(encode_key("é"), "%C3%A9");
        let l = lookup("");
        assert_eq!(l.path_for("p/k 1").unwrap(), "/by-key/p%2Fk%201");
        for dots in [".", ".."] {
            let refused = l.path_for(dots).unwrap_err();
            assert_eq!(refused.code, "lookup_unanswerable", "{dots}");
        }
    }

    #[test]
    fn defaults_come_from_the_provider() {
        let l = lookup("");
        assert_eq!(l.method, reqwest::Method::GET);
        assert_eq!(l.policy.timeout, Duration::from_secs(7));
        assert_eq!(l.policy.settle, Duration::from_secs(30));
        assert_eq!(l.result.json_pointer, "/id");
        let own = lookup("timeout = \"2s\"\nsettle = \"0s\"\nresult = { header = \"X-Id\" }");
        assert_eq!(own.policy.timeout, Duration::from_secs(2));
        assert_eq!(own.policy.settle, Duration::ZERO);
        assert_eq!(own.result.header.as_deref(), Some("X-Id"));
    }

    #[test]
    fn applied_statuses_read_the_result_by_the_boundary_rule() {
        let l = lookup("");
        assert_eq!(
            answer(&l, 200, r#"{"id":"msg_1\u0000"}"#),
            Ok(Lookup::Applied {
                result_ref: Some("msg_1".into())
            })
        );
        assert_eq!(
            answer(&l, 201, r#"{"id":42}"#),
            Ok(Lookup::Applied {
                result_ref: Some("42".into())
            })
        );
        // No reference: still applied (when_no_result defaults to applied).
        for body in ["{}", r#"{"id":null}"#, "<html>", ""] {
            assert_eq!(
                answer(&l, 200, body),
                Ok(Lookup::Applied { result_ref: None }),
                "{body}"
            );
        }
        let mut headers = HeaderMap::new();
        headers.insert("x-id", HeaderValue::from_static("req_9"));
        let by_header = lookup("result = { header = \"X-Id\" }");
        assert_eq!(
            by_header.answer(200, &headers, b""),
            Ok(Lookup::Applied {
                result_ref: Some("req_9".into())
            })
        );
    }

    #[test]
    fn a_search_that_finds_nothing_is_not_applied_but_an_unreadable_body_is_no_answer() {
        let l =
            lookup("result = { json_pointer = \"/data/0/id\" }\nwhen_no_result = \"not_applied\"");
        assert_eq!(answer(&l, 200, r#"{"data":[]}"#), Ok(Lookup::NotApplied));
        assert_eq!(answer(&l, 200, r#"{"data":null}"#), Ok(Lookup::NotApplied));
        assert_eq!(
            answer(&l, 200, r#"{"data":[{"id":"em_1"}]}"#),
            Ok(Lookup::Applied {
                result_ref: Some("em_1".into())
            })
        );
        for body in ["<html>ok</html>", "", r#"{"data":["#] {
            let refused = answer(&l, 200, body).unwrap_err();
            assert_eq!(
                (refused.class, refused.code.as_str()),
                (ErrorClass::Permanent, "lookup_unanswerable"),
                "{body}"
            );
            assert!(refused.message.contains("200 OK"), "{}", refused.message);
        }
    }

    #[test]
    fn statuses_map_to_outcomes_or_classified_failures() {
        let l = lookup("applied = [200]\nnot_applied = [404, 410]");
        assert_eq!(answer(&l, 404, ""), Ok(Lookup::NotApplied));
        assert_eq!(answer(&l, 410, ""), Ok(Lookup::NotApplied));
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", HeaderValue::from_static("7"));
        for status in [408, 429, 500, 502, 503, 504] {
            let failed = l.answer(status, &headers, b"").unwrap_err();
            assert_eq!(
                (failed.class, failed.code.as_str()),
                (ErrorClass::Retryable, "lookup_unavailable"),
                "{status}"
            );
            assert_eq!(failed.retry_after, Some(Duration::from_secs(7)));
            assert!(failed.message.contains(&status.to_string()));
        }
        for (status, body, said) in [
            (400, r#"{"error":{"code":"invalid_key"}}"#, "(invalid_key)"),
            (401, "", "401 Unauthorized"),
            // The body is never quoted (it may echo a credential).
            (
                403,
                "forbidden by http://u:pw@proxy.example/x",
                "403 Forbidden",
            ),
            (301, "", "redirects are not followed"),
            (204, "", "204 No Content"),
            (299, "", "299"),
        ] {
            let refused = answer(&l, status, body).unwrap_err();
            assert_eq!(
                (refused.class, refused.code.as_str()),
                (ErrorClass::Permanent, "lookup_unanswerable"),
                "{status}"
            );
            assert!(
                refused.message.contains(&status.to_string()),
                "{}",
                refused.message
            );
            assert!(refused.message.contains(said), "{}", refused.message);
            assert!(!refused.message.contains("pw"), "{}", refused.message);
        }
    }

    #[test]
    fn an_excerpt_is_only_the_providers_error_code() {
        assert_eq!(
            excerpt(br#"{"error":{"code":"invalid_key"}}"#),
            " (invalid_key)"
        );
        let body = format!("\u{1b}[2J Bearer sk_live_x {}", "x".repeat(500));
        assert_eq!(excerpt(body.as_bytes()), "", "no text of the body");
        assert_eq!(excerpt(b"  "), "");
    }

    #[tokio::test(start_paused = true)]
    async fn the_budget_holds_lookups_beyond_it() {
        let budget = Budget::new(1, 0.0);
        let first = budget.enter().await;
        let waiting = tokio::time::timeout(Duration::from_secs(1), budget.enter()).await;
        assert!(waiting.is_err(), "the only slot is taken");
        drop(first);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), budget.enter())
                .await
                .is_ok()
        );
        // Rate: 2 a second, a bucket of 2; the third waits half a second.
        let rated = Budget::new(8, 2.0);
        let start = tokio::time::Instant::now();
        for _ in 0..3 {
            drop(rated.enter().await);
        }
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(500) && waited < Duration::from_millis(510),
            "{waited:?}"
        );
    }

    /// Review of issue 25: a `json_pointer` that is not a JSON pointer (no
    /// leading `/`, a typo of `/data/0/id`) is accepted at start and then
    /// finds nothing in every answer, so with `when_no_result =
    /// "not_applied"` a search that found the request reads as "not
    /// applied" and idem sends it again.
    #[test]
    fn review_a_json_pointer_without_a_leading_slash_never_reads_a_found_request_as_not_applied() {
        let config: LookupConfig = toml::from_str(
            "path = \"/search?key={key}\"\nresult = { json_pointer = \"data/0/id\" }\n\
             when_no_result = \"not_applied\"",
        )
        .unwrap();
        let Ok(l) = HttpLookup::new(&config, &ResultRef::default(), Duration::from_secs(7)) else {
            return; // refused at start: what the review asks for
        };
        assert_ne!(
            answer(&l, 200, r#"{"data":[{"id":"em_1"}]}"#),
            Ok(Lookup::NotApplied),
            "the search found em_1: never \"not applied\""
        );
    }

    /// Review of issue 25: a tiny positive `rate_per_second` passes
    /// validation, and the second lookup then panics in
    /// `Duration::from_secs_f64` (the wait, 1e30 s, overflows a Duration).
    #[tokio::test(start_paused = true)]
    async fn review_a_tiny_lookup_rate_is_refused_or_waits_without_panicking() {
        let config: LookupConfig =
            toml::from_str("path = \"/by-key/{key}\"\nrate_per_second = 1e-30").unwrap();
        let Ok(l) = HttpLookup::new(&config, &ResultRef::default(), Duration::from_secs(7)) else {
            return; // refused at start: fine
        };
        drop(l.enter().await);
        let second = tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(1), l.enter())
                .await
                .is_err()
        })
        .await;
        assert!(
            matches!(second, Ok(true)),
            "the second lookup waits (and its caller's timeout ends the wait): {second:?}"
        );
    }

    /// Review of issue 25: the excerpt of an unanswerable lookup's body
    /// goes into the job's error record; a provider (or a gateway in front
    /// of it) that echoes the request's `Authorization` in its error body
    /// puts idem's own secret there. The effects' path stores only a
    /// provider's error code ("raw bodies are never stored").
    #[test]
    fn review_an_unanswerable_lookup_keeps_no_credential_from_the_body() {
        let l = lookup("");
        let refused = answer(
            &l,
            401,
            "invalid credentials: Authorization: Bearer sk_live_9f8e7d6c5b4a",
        )
        .unwrap_err();
        assert!(
            !refused.message.contains("sk_live_9f8e7d6c5b4a"),
            "{}",
            refused.message
        );
    }
}
