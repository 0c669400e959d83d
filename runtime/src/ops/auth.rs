//! The API's bearer token: read from `IDEM_API_TOKEN` or a file, kept only
//! as a SHA-256 digest, compared in constant time.

use sha2::{Digest, Sha256};

/// Name of the dashboard's session cookie (it holds the token itself).
pub const COOKIE: &str = "idem_token";

/// A configured token.
///
/// ```
/// let token = idem::ops::auth::Token::new("s3cret").unwrap();
/// assert!(token.matches("s3cret"));
/// assert!(!token.matches("s3cre"));
/// ```
#[derive(Clone)]
pub struct Token {
    digest: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

/// Shortest token accepted: a guessable token is no protection.
pub const MIN_TOKEN_LEN: usize = 16;

impl Token {
    /// A token from its text; refused when shorter than [`MIN_TOKEN_LEN`]
    /// bytes (the length check is in [`Token::from_config`]; tests may use
    /// short ones).
    pub fn new(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("the API token is empty".into());
        }
        Ok(Token {
            digest: Sha256::digest(text.as_bytes()).into(),
        })
    }

    /// The token from `IDEM_API_TOKEN`, or else from `file`; `None` when
    /// neither is set.
    pub fn from_config(file: Option<&std::path::Path>) -> Result<Option<Self>, String> {
        let text = match (std::env::var("IDEM_API_TOKEN"), file) {
            (Ok(text), _) if !text.trim().is_empty() => text,
            (_, Some(path)) => std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read the API token file {}: {e}", path.display()))?,
            _ => return Ok(None),
        };
        if text.trim().len() < MIN_TOKEN_LEN {
            return Err(format!(
                "the API token must be at least {MIN_TOKEN_LEN} characters (use e.g. `openssl rand -hex 32`)"
            ));
        }
        Self::new(&text).map(Some)
    }

    /// Whether `candidate` is the token. Digests of equal length are
    /// compared without an early exit, so the time taken says nothing
    /// about how much of a guess was right.
    pub fn matches(&self, candidate: &str) -> bool {
        let other: [u8; 32] = Sha256::digest(candidate.trim().as_bytes()).into();
        let diff = self
            .digest
            .iter()
            .zip(other.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }
}

/// Where a request's token came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `Authorization: Bearer T` (a program).
    Header,
    /// The dashboard's cookie (a browser, which also sends it on requests
    /// other pages make: see [`same_origin`]).
    Cookie,
}

/// The token a request carries: `Authorization: Bearer T`, or the
/// dashboard's cookie.
pub fn presented(headers: &axum::http::HeaderMap) -> Option<(String, Source)> {
    if let Some(value) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let (scheme, token) = value.split_once(' ')?;
        return scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| (token.trim().to_string(), Source::Header));
    }
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| (value.to_string(), Source::Cookie))
}

/// Whether a browser request comes from the dashboard's own origin: its
/// `Sec-Fetch-Site` says `same-origin`, or its `Origin` names the host it
/// was sent to. A cookie alone does not tell: a page on another port of the
/// same host, or a sibling subdomain, is "same site" and gets the cookie
/// sent along with a form it submits here.
pub fn same_origin(headers: &axum::http::HeaderMap) -> bool {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = header("sec-fetch-site") {
        return site == "same-origin";
    }
    match (header("origin"), header("host")) {
        (Some(origin), Some(host)) => origin
            .split_once("://")
            .is_some_and(|(_, rest)| rest.trim_end_matches('/') == host),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue};

    #[test]
    fn bearer_header_or_cookie() {
        let mut headers = HeaderMap::new();
        assert_eq!(presented(&headers), None);
        headers.insert("cookie", HeaderValue::from_static("a=b; idem_token=t1"));
        assert_eq!(presented(&headers), Some(("t1".into(), Source::Cookie)));
        headers.insert("authorization", HeaderValue::from_static("Bearer t2"));
        assert_eq!(presented(&headers), Some(("t2".into(), Source::Header)));
        headers.insert("authorization", HeaderValue::from_static("Basic t2"));
        assert_eq!(presented(&headers), None);
    }

    #[test]
    fn only_the_dashboards_own_origin_counts_as_same_origin() {
        let mut headers = HeaderMap::new();
        assert!(!same_origin(&headers), "nothing says so");
        headers.insert("host", HeaderValue::from_static("idem.example:9090"));
        headers.insert(
            "origin",
            HeaderValue::from_static("http://idem.example:9090"),
        );
        assert!(same_origin(&headers));
        headers.insert(
            "origin",
            HeaderValue::from_static("http://idem.example:8080"),
        );
        assert!(!same_origin(&headers), "another port is another origin");
        headers.insert("sec-fetch-site", HeaderValue::from_static("same-site"));
        assert!(!same_origin(&headers));
        headers.insert("sec-fetch-site", HeaderValue::from_static("same-origin"));
        assert!(same_origin(&headers));
    }

    #[test]
    fn only_the_token_matches() {
        let token = Token::new("0123456789abcdef").unwrap();
        assert!(token.matches("0123456789abcdef"));
        assert!(!token.matches("0123456789abcdeF"));
        assert!(!token.matches(""));
        assert!(Token::new("  ").is_err());
        assert_eq!(format!("{token:?}"), "Token(***)");
    }
}
