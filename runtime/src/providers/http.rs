//! The `http` and `email` providers: an HTTP API that honours
//! `Idempotency-Key`. Every outcome is classified: 2xx success; 408, 429 and
//! 5xx retryable (with `Retry-After`); a timeout or a connection lost after
//! sending ambiguous; other 4xx permanent; 409 key conflict permanent
//! `idempotency_key_conflict`.

use super::config::{ProviderConfig, ProviderKind, ResultRef};
use super::{Dedupe, Delivered, Provider};
use crate::effects::{Action, Effect};
use crate::failure::{Code, Failure};
use hmac::{Hmac, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::Sha256;
use std::time::Duration;

/// Most bytes of a response body read (for the result reference and error code).
const MAX_RESPONSE: usize = 64 << 10;

/// Headers a plugin may not set: the host owns them.
const RESERVED_HEADERS: [&str; 5] = [
    "authorization",
    "idempotency-key",
    "host",
    "content-length",
    "x-idem-signature",
];

/// An HTTP API provider.
///
/// ```no_run
/// let config: idem::providers::ProviderConfig = toml::from_str("kind = \"email\"\nbase_url = \"http://127.0.0.1:8025\"").unwrap();
/// let provider = idem::providers::http::HttpProvider::from_config("email", &config).unwrap();
/// ```
pub struct HttpProvider {
    kind: ProviderKind,
    client: reqwest::Client,
    base_url: String,
    from: Option<String>,
    auth: Option<(HeaderName, HeaderValue)>,
    hmac: Option<(HeaderName, Vec<u8>)>,
    result: ResultRef,
    dedupe: Dedupe,
    timeout: Duration,
}

impl HttpProvider {
    /// Builds the provider, reading its secrets.
    pub fn from_config(name: &str, config: &ProviderConfig) -> Result<Self, String> {
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout.min(Duration::from_secs(5)))
            .user_agent(concat!("idem/", env!("CARGO_PKG_VERSION")))
            // A redirect would carry the key, auth and signature elsewhere
            // and turn a POST into a GET: refuse it instead.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
        let auth = match &config.auth {
            Some(auth) => {
                let secret = auth.secret.read()?;
                let name = HeaderName::from_bytes(auth.header.as_bytes())
                    .map_err(|e| format!("auth header: {e}"))?;
                let mut value = HeaderValue::from_str(&format!("{}{secret}", auth.prefix))
                    .map_err(|_| "the auth secret is not a valid header value".to_string())?;
                value.set_sensitive(true);
                Some((name, value))
            }
            None => None,
        };
        let hmac = match &config.hmac {
            Some(hmac) => Some((
                HeaderName::from_bytes(hmac.header.as_bytes())
                    .map_err(|e| format!("hmac header: {e}"))?,
                hmac.secret.read()?.into_bytes(),
            )),
            None => None,
        };
        if !(config.base_url.starts_with("http://") || config.base_url.starts_with("https://")) {
            return Err(format!(
                "base_url {:?} must start with http:// or https://",
                config.base_url
            ));
        }
        tracing::debug!(provider = name, base_url = %config.base_url, "provider configured");
        Ok(HttpProvider {
            kind: config.kind,
            client,
            base_url: config.base_url.trim_end_matches('/').to_string(),
            from: config.from.clone(),
            auth,
            hmac,
            result: config.result.clone(),
            timeout: config.timeout,
            dedupe: if config.dedupes {
                Dedupe::Native {
                    window: config.dedupe_window,
                }
            } else {
                Dedupe::None
            },
        })
    }

    fn request(
        &self,
        effect: &Effect,
    ) -> Result<(reqwest::Method, String, HeaderMap, Vec<u8>), Failure> {
        let mut headers = HeaderMap::new();
        let (method, path, body) = match (&effect.action, self.kind) {
            (
                Action::Http {
                    method,
                    path,
                    headers: extra,
                    body,
                },
                ProviderKind::Http,
            ) => {
                for (name, value) in extra {
                    if RESERVED_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
                        return Err(Failure::host(
                            Code::InvalidEffect,
                            format!("the header {name:?} is set by the host, not by plugins"),
                        ));
                    }
                    let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                        Failure::host(Code::InvalidEffect, format!("bad header name {name:?}"))
                    })?;
                    let value = HeaderValue::from_str(value)
                        .map_err(|_| Failure::host(Code::InvalidEffect, "bad header value"))?;
                    headers.append(name, value);
                }
                let method = reqwest::Method::from_bytes(method.to_ascii_uppercase().as_bytes())
                    .map_err(|_| {
                        Failure::host(Code::InvalidEffect, format!("bad method {method:?}"))
                    })?;
                (method, path.clone(), body.clone().unwrap_or_default())
            }
            (Action::Custom { body }, ProviderKind::Http) => {
                (reqwest::Method::POST, String::new(), body.clone())
            }
            (
                Action::Email {
                    to,
                    subject,
                    text,
                    html,
                    template,
                },
                ProviderKind::Email,
            ) => {
                // Header fields at the provider (a CR/LF in one is header
                // injection where a provider writes them into a message
                // as they are); the bodies are prose and stay as they are.
                for (what, text) in to
                    .iter()
                    .map(|r| ("recipient", r.as_str()))
                    .chain([("subject", subject.as_str())])
                    .chain(
                        template
                            .as_ref()
                            .map(|t| ("template name", t.name.as_str())),
                    )
                {
                    refuse_control_characters(what, text)?;
                }
                let mut email = serde_json::json!({ "to": to, "subject": subject });
                if let Some(from) = &self.from {
                    email["from"] = from.clone().into();
                }
                if let Some(text) = text {
                    email["text"] = text.clone().into();
                }
                if let Some(html) = html {
                    email["html"] = html.clone().into();
                }
                if let Some(t) = template {
                    let variables: serde_json::Map<_, _> = t
                        .variables
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone().into()))
                        .collect();
                    email["template"] =
                        serde_json::json!({ "name": t.name, "variables": variables });
                }
                headers.insert(
                    reqwest::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                let body = serde_json::to_vec(&email)
                    .map_err(|e| Failure::host(Code::InvalidEffect, e.to_string()))?;
                (reqwest::Method::POST, "/emails".to_string(), body)
            }
            (action, kind) => {
                return Err(Failure::host(
                    Code::UnsupportedAction,
                    format!(
                        "a {kind:?} provider cannot carry out a {} effect",
                        action.kind()
                    ),
                ));
            }
        };
        // Before the checks below: a URL parser drops tabs and newlines
        // (and encodes other control characters), so `/.<TAB>./admin`
        // passes a `..` check and still leaves the base URL's path.
        refuse_control_characters("path", &path)?;
        if !path.is_empty() && !path.starts_with('/') {
            return Err(Failure::host(
                Code::InvalidEffect,
                format!("path {path:?} must start with '/'"),
            ));
        }
        let lowered = path.to_ascii_lowercase();
        if path.contains("://")
            || path.contains("..")
            || lowered.contains("%2e")
            || path.contains('\\')
        {
            return Err(Failure::host(
                Code::InvalidEffect,
                format!("path {path:?} leaves the provider's base URL"),
            ));
        }
        let key = HeaderValue::from_str(&effect.idempotency_key).map_err(|_| {
            Failure::host(
                Code::InvalidIdempotencyKey,
                "the key is not a valid header value",
            )
        })?;
        headers.insert(HeaderName::from_static("idempotency-key"), key);
        if let Some((name, value)) = &self.auth {
            headers.insert(name.clone(), value.clone());
        }
        if let Some((name, secret)) = &self.hmac {
            let signature = sign(secret, &effect.idempotency_key, &body);
            if let Ok(value) = HeaderValue::from_str(&signature) {
                headers.insert(name.clone(), value);
            }
        }
        Ok((method, format!("{}{path}", self.base_url), headers, body))
    }

    /// The provider's reference for what it did, cleaned by the boundary's
    /// rule (a provider's answer is text from outside: the effect happened,
    /// so a bad reference is cut or dropped, never a failure).
    fn result_ref(&self, headers: &HeaderMap, body: &[u8]) -> Option<String> {
        let found = if let Some(header) = &self.result.header {
            headers
                .get(header)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        } else {
            let json: serde_json::Value = serde_json::from_slice(body).ok()?;
            match json.pointer(&self.result.json_pointer)? {
                serde_json::Value::String(s) => Some(s.clone()),
                other => Some(other.to_string()),
            }
        };
        found.and_then(|r| crate::boundary::result_ref(&r))
    }
}

/// `invalid_effect` when `text` (a field of an effect that becomes part of
/// a request line or a header) holds a control character.
fn refuse_control_characters(what: &str, text: &str) -> Result<(), Failure> {
    match text.chars().find(|c| c.is_control()) {
        Some(c) => Err(Failure::host(
            Code::InvalidEffect,
            format!(
                "the {what} {} holds the control character {c:?}",
                crate::boundary::shown(text)
            ),
        )),
        None => Ok(()),
    }
}

/// `sha256=<hex>` of HMAC-SHA256 over `key "." body`, so the key is signed too.
pub fn sign(secret: &[u8], key: &str, body: &[u8]) -> String {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(key.as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

#[async_trait::async_trait]
impl Provider for HttpProvider {
    fn dedupe(&self) -> Dedupe {
        self.dedupe
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The request is built as [`Provider::execute`] would build it, so an
    /// effect it would refuse (a bad method, path, header or recipient) is
    /// refused before the plan is stored, not after its key is claimed.
    fn check(&self, effect: &Effect) -> Result<(), Failure> {
        self.request(effect).map(|_| ())
    }

    async fn execute(&self, effect: &Effect) -> Result<Delivered, Failure> {
        let (method, url, headers, body) = self.request(effect)?;
        let response = self
            .client
            .request(method, &url)
            .headers(headers)
            .body(body)
            .send()
            .await
            .map_err(classify_send_error)?;
        let status = response.status();
        let headers = response.headers().clone();
        let retry_after = retry_after(&headers);
        let body = read_bounded(response).await;
        if status.is_success() {
            return Ok(Delivered {
                result_ref: self.result_ref(&headers, &body),
            });
        }
        let code = provider_code(&body);
        let failure = match status.as_u16() {
            409 if code.as_deref() == Some("idempotency_key_conflict") => Failure::host(
                Code::IdempotencyKeyConflict,
                "the provider saw this idempotency key before with a different request",
            ),
            409 => Failure::host(
                Code::ProviderRequestInProgress,
                "the provider is still processing this key",
            ),
            408 => Failure::host(Code::ProviderRequestTimeout, "the provider answered 408"),
            429 => Failure::host(Code::ProviderRateLimited, "the provider answered 429"),
            503 => Failure::host(
                Code::ProviderUnavailable,
                format!("the provider answered {status}"),
            ),
            // 500, 502 and 504 may come after the upstream did the work.
            500..=599 => Failure::host(
                Code::ProviderError,
                format!("the provider answered {status}; the request may have taken effect"),
            ),
            300..=399 => Failure::host(
                Code::ProviderRedirected,
                format!("the provider answered {status}; redirects are not followed"),
            ),
            _ => Failure::permanent(
                code.clone()
                    .unwrap_or_else(|| Code::ProviderRejected.as_str().into()),
                format!(
                    "the provider answered {status}{}",
                    code.map(|c| format!(" ({c})")).unwrap_or_default()
                ),
            ),
        };
        Err(failure.with_retry_after(retry_after))
    }
}

fn classify_send_error(error: reqwest::Error) -> Failure {
    if error.is_connect() {
        // Never reached the provider: safe to retry, nothing was sent.
        Failure::host(
            Code::ProviderUnreachable,
            format!("cannot connect: {error}"),
        )
    } else if error.is_timeout() {
        Failure::host(
            Code::ProviderTimeout,
            "no answer before the timeout; the request may have taken effect",
        )
    } else {
        Failure::host(
            Code::ProviderConnectionLost,
            format!(
                "the connection failed after sending; the request may have taken effect: {error}"
            ),
        )
    }
}

fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?;
    text.trim().parse::<u64>().ok().map(Duration::from_secs)
}

async fn read_bounded(mut response: reqwest::Response) -> Vec<u8> {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        body.extend_from_slice(&chunk[..chunk.len().min(MAX_RESPONSE - body.len())]);
        if body.len() >= MAX_RESPONSE {
            break;
        }
    }
    body
}

/// The provider's machine-readable error code (`{"error":{"code":..}}` or
/// `{"code":..}`), when it is a sane token; raw bodies are never stored.
fn provider_code(body: &[u8]) -> Option<String> {
    let json: serde_json::Value = serde_json::from_slice(body).ok()?;
    let code = json
        .pointer("/error/code")
        .or_else(|| json.pointer("/code"))
        .and_then(|c| c.as_str())?;
    crate::boundary::error_code(code)
        .is_ok()
        .then(|| code.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_codes_are_only_sane_tokens() {
        assert_eq!(
            provider_code(br#"{"error":{"code":"invalid_recipient"}}"#).as_deref(),
            Some("invalid_recipient")
        );
        assert_eq!(provider_code(br#"{"code":"drop table; --"}"#), None);
        assert_eq!(provider_code(b"<html>"), None);
        for case in crate::boundary::vectors::of("error_code") {
            let body = serde_json::json!({ "error": { "code": case.input } }).to_string();
            let want = (case.expected == crate::boundary::vectors::Expected::Accepted)
                .then(|| case.input.clone());
            assert_eq!(provider_code(body.as_bytes()), want, "{}", case.note);
        }
    }

    #[test]
    fn result_refs_are_cleaned_by_the_boundary_rule() {
        use crate::boundary::vectors::{self, Expected};
        let config: ProviderConfig =
            toml::from_str("kind = \"http\"\nbase_url = \"http://127.0.0.1:9\"").unwrap();
        let provider = HttpProvider::from_config("http", &config).unwrap();
        for case in vectors::of("result_ref") {
            let want = match case.expected {
                Expected::Accepted => Some(case.input.clone()),
                Expected::Cleaned(out) => out,
                Expected::Refused => unreachable!("never refused"),
            };
            let body = serde_json::json!({ "id": case.input }).to_string();
            let found = provider.result_ref(&HeaderMap::new(), body.as_bytes());
            assert_eq!(found, want, "{}", case.note);
        }
    }

    fn provider(kind: &str, base_url: &str) -> HttpProvider {
        let config: ProviderConfig =
            toml::from_str(&format!("kind = \"{kind}\"\nbase_url = \"{base_url}\"")).unwrap();
        HttpProvider::from_config(kind, &config).unwrap()
    }

    fn http(path: &str, headers: &[(&str, &str)]) -> Effect {
        Effect {
            provider: "partner".into(),
            idempotency_key: "k:1".into(),
            action: Action::Http {
                method: "POST".into(),
                path: path.into(),
                headers: headers
                    .iter()
                    .map(|(n, v)| (n.to_string(), v.to_string()))
                    .collect(),
                body: None,
            },
        }
    }

    fn email(to: &str, subject: &str) -> Effect {
        Effect {
            provider: "email".into(),
            idempotency_key: "k:1".into(),
            action: Action::Email {
                to: vec![to.into()],
                subject: subject.into(),
                text: Some("prose may hold anything: \u{1b}[2J\0".into()),
                html: None,
                template: None,
            },
        }
    }

    /// Issue 22: a tab or newline inside `..` passed the path check, and
    /// the URL parser dropped it and resolved the `..` above the base
    /// URL's path. Control characters in a path are refused first.
    #[test]
    fn a_control_character_in_a_path_is_refused_before_a_url_parser_drops_it() {
        // What the parser does with the text the check used to let through.
        let parsed = reqwest::Url::parse("http://127.0.0.1:9/api/orders/.\t./admin").unwrap();
        assert_eq!(parsed.path(), "/api/admin");
        let partner = provider("http", "http://127.0.0.1:9/api");
        for path in [
            "/orders/.\t./admin",
            "/.\n./.\r./admin",
            "/orders/\0/events",
            "/orders/\u{1b}[2J\u{7}",
            "/orders/\u{85}",
        ] {
            let refused = partner.check(&http(path, &[])).unwrap_err();
            assert_eq!(refused.code, "invalid_effect", "{path:?}");
            assert!(!refused.message.contains('\0'), "{:?}", refused.message);
        }
        assert!(partner.check(&http("/orders/7/events", &[])).is_ok());
    }

    /// What `execute` refuses, `check` refuses before the plan is stored:
    /// headers, recipients and subjects with control characters.
    #[test]
    fn check_refuses_what_execute_would() {
        let partner = provider("http", "http://127.0.0.1:9");
        for headers in [
            [("x-a\0", "v")],
            [("x-a", "v\0")],
            [("x-a", "v\r\nx-injected: 1")],
        ] {
            let refused = partner.check(&http("/x", &headers)).unwrap_err();
            assert_eq!(refused.code, "invalid_effect", "{headers:?}");
        }
        let mailer = provider("email", "http://127.0.0.1:9");
        for (to, subject) in [
            ("ana\0@example.com", "Invoice"),
            ("ana@example.com\r\nbcc: eve@example.com", "Invoice"),
            ("ana@example.com", "Invoice\r\nbcc: eve@example.com"),
            ("ana@example.com", "Invoice \u{1b}[2J"),
        ] {
            let refused = mailer.check(&email(to, subject)).unwrap_err();
            assert_eq!(refused.code, "invalid_effect", "{to:?} {subject:?}");
        }
        assert!(
            mailer
                .check(&email("ana@example.com", "Invoice 42"))
                .is_ok()
        );
        assert_eq!(
            mailer.check(&http("/x", &[])).unwrap_err().code,
            "unsupported_action"
        );
    }

    #[test]
    fn signatures_cover_key_and_body() {
        let a = sign(b"s", "k1", b"{}");
        assert!(a.starts_with("sha256="));
        assert_ne!(a, sign(b"s", "k2", b"{}"));
        assert_ne!(a, sign(b"s", "k1", b"{ }"));
    }
}
