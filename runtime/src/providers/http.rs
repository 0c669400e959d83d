//! The `http` and `email` providers: an HTTP API that honours
//! `Idempotency-Key`. Every outcome is classified: 2xx success; 408, 429 and
//! 5xx retryable (with `Retry-After`); a timeout or a connection lost after
//! sending ambiguous; other 4xx permanent; 409 key conflict permanent
//! `idempotency_key_conflict`.

use super::config::{ProviderConfig, ProviderKind, ResultRef};
use super::lookup::{Found, HttpLookup, find_result};
use super::{Dedupe, Delivered, Lookup, LookupPolicy, Provider};
use crate::effects::{Action, Effect};
use crate::failure::{Code, Failure};
use hmac::{Hmac, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::Sha256;
use std::time::Duration;

/// Most bytes of a response body read (for the result reference and error code).
const MAX_RESPONSE: usize = 64 << 10;

/// Headers a plugin may not set, beside the provider's own auth and
/// signature headers: the host sets these (the key, the credentials, the
/// framing), or they are hop-by-hop (meant for the next hop, never the
/// API), or a proxy or framework in front of the API routes, authenticates
/// or rewrites by them (`X-Original-URL` reaches a path the base URL does
/// not allow; `X-Forwarded-For` forges the client address an allow-list
/// trusts; a method override turns the POST into a DELETE).
pub const DENIED_HEADERS: [&str; 24] = [
    "authorization",
    "idempotency-key",
    "x-idem-signature",
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "forwarded",
    "x-original-url",
    "x-rewrite-url",
    "x-real-ip",
    "x-http-method-override",
    "x-method-override",
    "x-http-method",
    "x-forwarded",
    "client-ip",
    "true-client-ip",
    "x-client-ip",
    "x-cluster-client-ip",
    "cf-connecting-ip",
];

/// Prefixes of header names a plugin may not set (`Proxy-Authorization`,
/// `Proxy-Connection`; `X-Forwarded-For`, `-Host`, `-Proto`, `-Prefix` ...).
pub const DENIED_HEADER_PREFIXES: [&str; 2] = ["proxy-", "x-forwarded-"];

/// An HTTP API provider.
///
/// ```no_run
/// let config: idem::providers::ProviderConfig = toml::from_str("kind = \"email\"\nbase_url = \"http://127.0.0.1:8025\"").unwrap();
/// let provider = idem::providers::http::HttpProvider::from_config("email", &config).unwrap();
/// ```
pub struct HttpProvider {
    kind: ProviderKind,
    client: reqwest::Client,
    base: Base,
    from: Option<String>,
    auth: Option<(HeaderName, HeaderValue)>,
    hmac: Option<(HeaderName, Vec<u8>)>,
    result: ResultRef,
    dedupe: Dedupe,
    timeout: Duration,
    lookup: Option<HttpLookup>,
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
        config.result.validate()?;
        let base = Base::parse(&config.base_url)?;
        let lookup = config
            .lookup
            .as_ref()
            .map(|lookup| HttpLookup::new(lookup, &config.result, config.timeout))
            .transpose()?;
        tracing::debug!(
            provider = name,
            base_url = %crate::boundary::redact_urls(&config.base_url),
            "provider configured"
        );
        let provider = HttpProvider {
            kind: config.kind,
            client,
            base,
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
            lookup,
        };
        if let Some(lookup) = &provider.lookup {
            // The template, filled with a sample key, must pass the check
            // every effect's path passes: a lookup that leaves the base URL
            // (`/../admin/{key}`) is refused now, not at its first use.
            let path = lookup
                .path_for(super::lookup::SAMPLE_KEY)
                .map_err(|refused| refused.message)?;
            provider
                .url_for(&path)
                .map_err(|refused| format!("lookup path: {}", refused.message))?;
        }
        Ok(provider)
    }

    /// Whether a plugin may set the header `name` (lower case): not one of
    /// [`DENIED_HEADERS`] or [`DENIED_HEADER_PREFIXES`], nor this provider's
    /// auth or signature header.
    fn refuse_denied_header(&self, name: &str) -> Result<(), Failure> {
        // `_` compared as `-`: CGI-style servers (WSGI, PHP) map both to
        // the same variable, so `X_Forwarded_For` is `X-Forwarded-For` there.
        let lowered = name.to_ascii_lowercase().replace('_', "-");
        let own = [
            self.auth.as_ref().map(|a| &a.0),
            self.hmac.as_ref().map(|h| &h.0),
        ]
        .into_iter()
        .flatten()
        .any(|header| header.as_str().replace('_', "-") == lowered);
        let denied = own
            || DENIED_HEADERS.contains(&lowered.as_str())
            || DENIED_HEADER_PREFIXES
                .iter()
                .any(|prefix| lowered.starts_with(prefix));
        if denied {
            return Err(Failure::host(
                Code::InvalidEffect,
                format!(
                    "the header {} is set by the host or routes the request, not set by plugins",
                    crate::boundary::shown(name)
                ),
            ));
        }
        Ok(())
    }

    fn request(
        &self,
        effect: &Effect,
    ) -> Result<(reqwest::Method, reqwest::Url, HeaderMap, Vec<u8>), Failure> {
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
                    refuse_control_characters("header name", name)?;
                    self.refuse_denied_header(name)?;
                    let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                        Failure::host(
                            Code::InvalidEffect,
                            format!("bad header name {}", crate::boundary::shown(name)),
                        )
                    })?;
                    // Tab and bytes above 0x7f pass `HeaderValue`; a value
                    // may be a credential, so it is not quoted.
                    if value.chars().any(char::is_control) {
                        return Err(Failure::host(
                            Code::InvalidEffect,
                            format!("the value of header {name} holds a control character"),
                        ));
                    }
                    let value = HeaderValue::from_str(value)
                        .map_err(|_| Failure::host(Code::InvalidEffect, "bad header value"))?;
                    headers.append(name, value);
                }
                refuse_control_characters("method", method)?;
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
        let url = self.url_for(&path)?;
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
        Ok((method, url, headers, body))
    }

    /// The URL of `path` (an effect's, or a lookup's with its key in it),
    /// checked twice: on the text, then on the URL as it is sent
    /// ([`Base::join`]). Refused `invalid_effect` when it could leave the
    /// base URL.
    fn url_for(&self, path: &str) -> Result<reqwest::Url, Failure> {
        // Before the checks below: a URL parser drops tabs and newlines
        // (and encodes other control characters), so `/.<TAB>./admin`
        // passes a `..` check and still leaves the base URL's path.
        refuse_control_characters("path", path)?;
        if !path.is_empty() && !path.starts_with('/') {
            return Err(Failure::host(
                Code::InvalidEffect,
                format!("path {path:?} must start with '/'"),
            ));
        }
        // The first line, on the text: no dot segment in any spelling
        // (`%2e`, and `%252e` for a server that decodes twice).
        let lowered = path.to_ascii_lowercase();
        if path.contains("://")
            || path.contains("..")
            || lowered.contains("%2e")
            || lowered.contains("%252e")
            || path.contains('\\')
        {
            return Err(Failure::host(
                Code::InvalidEffect,
                format!("path {path:?} leaves the provider's base URL"),
            ));
        }
        // The second, on the URL as it is sent.
        self.base.join(path)
    }

    /// The provider's reference for what it did, cleaned by the boundary's
    /// rule (a provider's answer is text from outside: the effect happened,
    /// so a bad reference is cut or dropped, never a failure).
    fn result_ref(&self, headers: &HeaderMap, body: &[u8]) -> Option<String> {
        match find_result(&self.result, headers, body) {
            Found::Value(found) => crate::boundary::result_ref(&found),
            // As it always was: a JSON null is the reference "null".
            Found::Null => crate::boundary::result_ref("null"),
            Found::Nothing | Found::Unreadable => None,
        }
    }
}

/// A provider's `base_url`, parsed once: every request goes below its path
/// on its origin.
#[derive(Debug)]
struct Base {
    /// The base URL without its query and fragment, and without a
    /// trailing `/` (`https://api.example/v1`).
    prefix: String,
    /// Its path without a trailing `/` (`/v1`; empty for the root).
    path: String,
    /// Its query (`api_key=...`), sent with every request.
    query: Option<String>,
    /// Its origin (scheme, host, port) and userinfo, which a request's
    /// URL must keep.
    origin: (url::Origin, String, Option<String>),
}

impl Base {
    /// `base_url` of the config: an `http` or `https` URL; an error names
    /// it with its path and credentials redacted.
    fn parse(base_url: &str) -> Result<Self, String> {
        let shown = crate::boundary::redact_urls(base_url);
        let url = reqwest::Url::parse(base_url)
            .map_err(|e| format!("base_url {shown:?} is not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") || url.cannot_be_a_base() {
            return Err(format!(
                "base_url {shown:?} must start with http:// or https://"
            ));
        }
        let mut bare = url.clone();
        bare.set_query(None);
        bare.set_fragment(None);
        Ok(Base {
            prefix: bare.as_str().trim_end_matches('/').to_string(),
            path: url.path().trim_end_matches('/').to_string(),
            query: url.query().map(str::to_string),
            origin: Self::origin_of(&url),
        })
    }

    fn origin_of(url: &reqwest::Url) -> (url::Origin, String, Option<String>) {
        (
            url.origin(),
            url.username().to_string(),
            url.password().map(str::to_string),
        )
    }

    /// The URL of an effect's `path` (which may end in `?query`): the
    /// path appended to the base's, then parsed as a client sends it (dot
    /// segments resolved, tabs and newlines dropped, `%2e` read as a dot),
    /// and refused unless it is still on the base's origin and below the
    /// base's path, segment by segment (`/v1` does not cover `/v10`). The
    /// base's query comes first, the path's own after it.
    fn join(&self, path: &str) -> Result<reqwest::Url, Failure> {
        let (path_part, query) = match path.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (path, None),
        };
        let leaves = || {
            Failure::host(
                Code::InvalidEffect,
                format!(
                    "path {} leaves the provider's base URL",
                    crate::boundary::shown(path)
                ),
            )
        };
        let mut url =
            reqwest::Url::parse(&format!("{}{path_part}", self.prefix)).map_err(|_| leaves())?;
        let resolved = url.path();
        let below = self.path.is_empty()
            || resolved == self.path
            || resolved
                .strip_prefix(self.path.as_str())
                .is_some_and(|rest| rest.starts_with('/'));
        if !below || Self::origin_of(&url) != self.origin || url.fragment().is_some() {
            return Err(leaves());
        }
        let query = match (self.query.as_deref(), query) {
            (Some(base), Some(own)) if !own.is_empty() => {
                // A parameter of the base (an account, a key) cannot be
                // given again: servers where the last value wins would
                // take the plugin's.
                let keys = |q: &str| -> std::collections::BTreeSet<String> {
                    url::form_urlencoded::parse(q.as_bytes())
                        .map(|(k, _)| k.into_owned())
                        .collect()
                };
                if let Some(key) = keys(base).intersection(&keys(own)).next() {
                    return Err(Failure::host(
                        Code::InvalidEffect,
                        format!(
                            "the query parameter {} is set by the provider's base URL",
                            crate::boundary::shown(key)
                        ),
                    ));
                }
                Some(format!("{base}&{own}"))
            }
            (Some(base), _) => Some(base.to_string()),
            (None, own) => own.map(str::to_string),
        };
        url.set_query(query.as_deref());
        Ok(url)
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

    fn lookup_policy(&self) -> Option<LookupPolicy> {
        self.lookup.as_ref().map(|lookup| lookup.policy)
    }

    /// Asks `{base_url}{lookup.path}` with `{key}` filled in, sending the
    /// auth header but neither `Idempotency-Key` nor a signature (the
    /// provider knows the request by its key; the fingerprint is idem's own
    /// and is not sent). Waiting for the lookup budget and the request share
    /// one deadline, the lookup's `timeout`.
    async fn look_up(&self, key: &str, _fingerprint: &str) -> Result<Lookup, Failure> {
        let Some(lookup) = &self.lookup else {
            return Err(super::lookup::unanswerable(
                "this provider has no `lookup` configured".into(),
            ));
        };
        let path = lookup.path_for(key)?;
        // The same check as every effect's path: a key cannot steer the
        // lookup out of the base URL.
        let url = self.url_for(&path).map_err(|refused| {
            super::lookup::unanswerable(format!(
                "the lookup of key {}: {}",
                crate::boundary::shown(key),
                refused.message
            ))
        })?;
        let timeout = lookup.policy.timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let budget_full = || {
            Failure::host(
                Code::LookupUnavailable,
                format!(
                    "the lookup budget ({}) did not free up within the lookup timeout ({})",
                    lookup.budget_text(),
                    humantime::format_duration(timeout)
                ),
            )
        };
        let Ok(_slot) = tokio::time::timeout_at(deadline, lookup.enter()).await else {
            return Err(budget_full());
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(budget_full());
        }
        let mut request = self
            .client
            .request(lookup.method.clone(), url)
            .timeout(left);
        if let Some((name, value)) = &self.auth {
            request = request.header(name.clone(), value.clone());
        }
        let response = request
            .send()
            .await
            .map_err(|e| classify_lookup_error(e, timeout))?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = read_bounded(response).await;
        lookup.answer(status, &headers, &body)
    }

    async fn execute(&self, effect: &Effect) -> Result<Delivered, Failure> {
        let (method, url, headers, body) = self.request(effect)?;
        let response = self
            .client
            .request(method, url)
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

/// A send error as text, without the request's URL (its path and query
/// may hold the provider's credential: reqwest prints `for url (...)`),
/// with the causes reqwest's own text leaves out (`Connection refused`).
fn describe(error: reqwest::Error) -> String {
    let error = error.without_url();
    let mut text = error.to_string();
    let mut cause = std::error::Error::source(&error);
    while let Some(inner) = cause {
        let line = inner.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        cause = inner.source();
    }
    crate::boundary::redact_urls(&text).into_owned()
}

fn classify_send_error(error: reqwest::Error) -> Failure {
    if error.is_connect() {
        // Never reached the provider: safe to retry, nothing was sent.
        Failure::host(
            Code::ProviderUnreachable,
            format!("cannot connect: {}", describe(error)),
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
                "the connection failed after sending; the request may have taken effect: {}",
                describe(error)
            ),
        )
    }
}

/// A lookup that could not be sent or answered: never an answer, so it
/// is asked again later (nothing a lookup sends changes anything).
fn classify_lookup_error(error: reqwest::Error, timeout: Duration) -> Failure {
    let message = if error.is_connect() {
        format!("cannot connect for the lookup: {}", describe(error))
    } else if error.is_timeout() {
        format!(
            "no answer to the lookup within its timeout ({})",
            humantime::format_duration(timeout)
        )
    } else {
        format!("the lookup failed: {}", describe(error))
    };
    Failure::host(Code::LookupUnavailable, message)
}

pub(super) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?;
    text.trim().parse::<u64>().ok().map(Duration::from_secs)
}

pub(super) async fn read_bounded(mut response: reqwest::Response) -> Vec<u8> {
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
pub(super) fn provider_code(body: &[u8]) -> Option<String> {
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

    /// Issue 24: a path is checked again on the URL as it is sent, so a
    /// spelling the text checks miss cannot climb out of the base URL's
    /// path. `Base::join` alone, without the text checks in front of it.
    #[test]
    fn a_resolved_path_must_stay_below_the_base_urls_path() {
        let base = Base::parse("http://127.0.0.1:9/api/v1/?api_key=SECRET").unwrap();
        for path in [
            "/.\t./.\t./admin",
            "/%2e%2e/admin",
            "/%2E%2e/%2e%2E/admin",
            "/.%2e/admin",
            "/%2e./admin",
            "/a/../../admin",
            "/a/%2e%2e/%2e%2e/admin",
            "/..\\admin",
            "/../v10",
            "/../../..",
            "/x#fragment",
            // The base's own parameter given again (last value wins on
            // many servers), plain or encoded.
            "/o?api_key=evil",
            "/o?page=2&api%5Fkey=evil",
            "/o?api_key",
        ] {
            let refused = base.join(path).unwrap_err();
            assert_eq!(refused.code, "invalid_effect", "{path:?}");
        }
        for (path, want) in [
            ("", "http://127.0.0.1:9/api/v1?api_key=SECRET"),
            ("/", "http://127.0.0.1:9/api/v1/?api_key=SECRET"),
            (
                "/orders/7",
                "http://127.0.0.1:9/api/v1/orders/7?api_key=SECRET",
            ),
            ("/a/./b", "http://127.0.0.1:9/api/v1/a/b?api_key=SECRET"),
            ("/a/../b", "http://127.0.0.1:9/api/v1/b?api_key=SECRET"),
            (
                "/orders?page=2",
                "http://127.0.0.1:9/api/v1/orders?api_key=SECRET&page=2",
            ),
            (
                "/group%2Fproject",
                "http://127.0.0.1:9/api/v1/group%2Fproject?api_key=SECRET",
            ),
        ] {
            assert_eq!(base.join(path).unwrap().as_str(), want, "{path:?}");
        }
        let root = Base::parse("https://api.example").unwrap();
        assert_eq!(
            root.join("/v1/x").unwrap().as_str(),
            "https://api.example/v1/x"
        );
        assert!(root.join("/../x").is_ok(), "nothing above the root");
        assert!(Base::parse("ftp://h/x").is_err());
        let refused = Base::parse("http://h:notaport/T0/SECRET?api_key=SECRET").unwrap_err();
        assert!(!refused.contains("SECRET"), "{refused}");
    }

    /// The same paths through `check`: refused, by one check or the other.
    #[test]
    fn paths_that_leave_the_base_are_refused_before_the_plan_is_stored() {
        let partner = provider("http", "http://127.0.0.1:9/api");
        for path in [
            "/.\t./.\t./admin",
            "/%2e%2e/admin",
            "/%252e%252e/admin",
            "/a/../../admin",
            "/.%2E/admin",
            "/a\\..\\admin",
        ] {
            let refused = partner.check(&http(path, &[])).unwrap_err();
            assert_eq!(refused.code, "invalid_effect", "{path:?}");
        }
        assert!(partner.check(&http("/orders/7/events", &[])).is_ok());
    }

    fn with_secrets(extra: &str) -> (tempfile::NamedTempFile, HttpProvider) {
        let secret = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(secret.path(), "s3cret").unwrap();
        let config: ProviderConfig = toml::from_str(&format!(
            "kind = \"http\"\nbase_url = \"http://127.0.0.1:9\"\n{}",
            extra.replace("FILE", &secret.path().display().to_string())
        ))
        .unwrap();
        let provider = HttpProvider::from_config("partner", &config).unwrap();
        (secret, provider)
    }

    /// Issue 24: hop-by-hop and routing headers, and the provider's own
    /// auth and signature headers, are refused; others pass.
    #[test]
    fn hop_by_hop_routing_and_the_providers_own_headers_are_refused() {
        let (_secret, partner) = with_secrets(
            "auth = { header = \"X-Api-Key\", prefix = \"\", file = \"FILE\" }\n\
             hmac = { header = \"X-Partner-Signature\", file = \"FILE\" }",
        );
        let denied = DENIED_HEADERS.iter().map(|h| h.to_string()).chain(
            [
                "Connection",
                "TRANSFER-ENCODING",
                "Proxy-Authorization",
                "Proxy-Connection",
                "X-Forwarded-For",
                "X-Forwarded-Host",
                "x-forwarded-proto",
                "X-Original-URL",
                "X-HTTP-Method-Override",
                "X-Api-Key",
                "x-partner-signature",
                // Underscores read as dashes by CGI-style servers.
                "X_Forwarded_For",
                "x_original_url",
                "X_Api_Key",
                "Transfer_Encoding",
                "Client-IP",
                "True-Client-IP",
            ]
            .map(str::to_string),
        );
        for name in denied {
            let refused = partner
                .check(&http("/x", &[(name.as_str(), "v")]))
                .unwrap_err();
            assert_eq!(refused.code, "invalid_effect", "{name}");
            assert!(
                refused.message.contains("set by the host"),
                "{name}: {}",
                refused.message
            );
        }
        for name in [
            "X-Request-Id",
            "Content-Type",
            "Accept",
            "X_Request_Id",
            "Proxy",
        ] {
            assert!(
                partner.check(&http("/x", &[(name, "v")])).is_ok(),
                "{name} is the plugin's to set"
            );
        }
        // Without a custom auth header, X-Api-Key is an ordinary header.
        let plain = provider("http", "http://127.0.0.1:9");
        assert!(plain.check(&http("/x", &[("X-Api-Key", "k")])).is_ok());
    }

    /// Control characters in a header name, a header value (tab and C1
    /// included, which `HeaderValue` would take) and a method.
    #[test]
    fn control_characters_in_headers_and_methods_are_refused() {
        let partner = provider("http", "http://127.0.0.1:9");
        for (name, value) in [
            ("x-a\t", "v"),
            ("x-a\u{85}", "v"),
            ("x-a", "v\tw"),
            ("x-a", "v\u{85}"),
            ("x-a", "v\u{7f}"),
        ] {
            let refused = partner.check(&http("/x", &[(name, value)])).unwrap_err();
            assert_eq!(refused.code, "invalid_effect", "{name:?} {value:?}");
        }
        for method in ["PO\tST", "POST\r\n", "POST\u{0}", "P\u{1b}OST"] {
            let mut effect = http("/x", &[]);
            if let Action::Http { method: m, .. } = &mut effect.action {
                *m = method.into();
            }
            let refused = partner.check(&effect).unwrap_err();
            assert_eq!(refused.code, "invalid_effect", "{method:?}");
            assert!(!refused.message.contains('\t'), "{}", refused.message);
        }
        assert!(partner.check(&http("/x", &[("x-a", "v w é")])).is_ok());
    }

    fn with_lookup(base_url: &str, table: &str) -> Result<HttpProvider, String> {
        let config: ProviderConfig = toml::from_str(&format!(
            "kind = \"email\"\nbase_url = \"{base_url}\"\ntimeout = \"4s\"\nlookup = {{ {table} }}"
        ))
        .map_err(|e| e.to_string())?;
        HttpProvider::from_config("email", &config)
    }

    /// A lookup path is checked at start with a sample key, and every
    /// lookup URL again, by the check every effect's path passes.
    #[test]
    fn a_lookup_path_that_leaves_the_base_is_refused_at_start() {
        for path in [
            "/../admin/{key}",
            "/%2e%2e/admin/{key}",
            "/a/{key}/../../../admin",
            "/x/{key}#frag",
            "/x/{key}?api_key=evil",
            "https://evil.example/{key}",
        ] {
            let refused = with_lookup(
                "http://127.0.0.1:9/v1?api_key=SECRET",
                &format!("path = \"{path}\""),
            )
            .err()
            .unwrap_or_else(|| panic!("accepted: {path}"));
            assert!(refused.starts_with("lookup path"), "{path}: {refused}");
        }
        let refused = with_lookup("http://127.0.0.1:9", "path = \"/x\"")
            .err()
            .unwrap();
        assert!(refused.contains("{key}"), "{refused}");
        let provider = with_lookup("http://127.0.0.1:9/v1", "path = \"/emails/{key}\"").unwrap();
        let lookup = provider.lookup.as_ref().unwrap();
        let url = provider
            .url_for(&lookup.path_for("billing/a b?c").unwrap())
            .unwrap();
        assert_eq!(
            url.as_str(),
            "http://127.0.0.1:9/v1/emails/billing%2Fa%20b%3Fc"
        );
        assert_eq!(
            provider.lookup_policy(),
            Some(LookupPolicy {
                settle: Duration::from_secs(30),
                timeout: Duration::from_secs(4),
            })
        );
        assert_eq!(
            self::provider("http", "http://127.0.0.1:9").lookup_policy(),
            None
        );
    }

    /// At lookup time a key that would climb out is refused too.
    #[tokio::test]
    async fn a_key_that_would_leave_the_base_is_not_asked() {
        let provider = with_lookup("http://127.0.0.1:9/v1", "path = \"/emails/{key}\"").unwrap();
        for key in ["a..b", "..", "."] {
            let refused = provider.look_up(key, "f").await.unwrap_err();
            assert_eq!(refused.code, "lookup_unanswerable", "{key}");
        }
        let none = self::provider("http", "http://127.0.0.1:9");
        assert_eq!(
            none.look_up("k", "f").await.unwrap_err().code,
            "lookup_unanswerable"
        );
    }

    /// A lookup that finds its budget full for its whole timeout is not
    /// sent: the provider could not be asked now.
    #[tokio::test]
    async fn a_lookup_waits_for_its_budget_no_longer_than_its_timeout() {
        let provider = with_lookup(
            "http://127.0.0.1:9",
            "path = \"/x/{key}\", timeout = \"50ms\", max_in_flight = 1",
        )
        .unwrap();
        let held = provider.lookup.as_ref().unwrap().enter().await;
        let failed = provider.look_up("p/k", "f").await.unwrap_err();
        assert_eq!(
            (failed.class, failed.code.as_str()),
            (crate::failure::ErrorClass::Retryable, "lookup_unavailable")
        );
        assert!(
            failed.message.contains("max_in_flight 1"),
            "{}",
            failed.message
        );
        drop(held);
    }

    #[test]
    fn signatures_cover_key_and_body() {
        let a = sign(b"s", "k1", b"{}");
        assert!(a.starts_with("sha256="));
        assert_ne!(a, sign(b"s", "k2", b"{}"));
        assert_ne!(a, sign(b"s", "k1", b"{ }"));
    }
}
