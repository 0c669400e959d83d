//! The API's tokens and what a request presents: the token itself as a
//! bearer header (programs), or the dashboard's session cookie (browsers,
//! see [`super::session`]). Tokens are read from `IDEM_API_TOKEN` (and
//! `IDEM_API_TOKEN_PREVIOUS` during a rotation) or a file, checked against
//! the rules below at start-up, kept only as SHA-256 digests and compared
//! in constant time.

use super::session::{self, SessionId};
use super::throttle::{Throttle, ThrottleSettings};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::time::Duration;

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
/// Fewest distinct characters in a token: `aaaaaaaaaaaaaaaa` or
/// `abababababababab` is long enough and still guessed at once.
pub const MIN_DISTINCT_CHARS: usize = 8;

/// Checks a token against the rules: at least [`MIN_TOKEN_LEN`] characters,
/// printable ASCII without spaces (it travels in a header and a form), at
/// least [`MIN_DISTINCT_CHARS`] distinct characters. The refusal names the
/// rule broken; `what` names the token (`IDEM_API_TOKEN`, ...).
///
/// ```
/// use idem::ops::auth::check_strength;
/// assert!(check_strength("IDEM_API_TOKEN", "3f9a1c07be52d846e1aa0f7d").is_ok());
/// assert!(check_strength("IDEM_API_TOKEN", &"a".repeat(16)).is_err());
/// ```
pub fn check_strength(what: &str, token: &str) -> Result<(), String> {
    const ADVICE: &str = "use e.g. `openssl rand -hex 32`";
    if token.chars().count() < MIN_TOKEN_LEN {
        return Err(format!(
            "{what} is refused: a token must be at least {MIN_TOKEN_LEN} characters ({ADVICE})"
        ));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "{what} is refused: a token must be printable ASCII without spaces or control characters ({ADVICE})"
        ));
    }
    let mut seen = [false; 128];
    for b in token.bytes() {
        seen[usize::from(b)] = true;
    }
    let distinct = seen.iter().filter(|s| **s).count();
    if distinct < MIN_DISTINCT_CHARS {
        return Err(format!(
            "{what} is refused: a token must have at least {MIN_DISTINCT_CHARS} distinct characters, this one has {distinct}: a repeated pattern is guessed at once ({ADVICE})"
        ));
    }
    Ok(())
}

impl Token {
    /// A token from its text, without the strength rules (those are
    /// checked where tokens come in, [`Tokens::from_config`]; tests may use
    /// short ones). Refused only when empty.
    pub fn new(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("the API token is empty".into());
        }
        Ok(Token {
            digest: Sha256::digest(text.as_bytes()).into(),
        })
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

    /// What a session made with this token records of it: an HMAC keyed by
    /// the token's digest, in hex. It tells whether the token is still
    /// configured and nothing about the token itself.
    ///
    /// ```
    /// let a = idem::ops::auth::Token::new("first-token-0123456789").unwrap();
    /// let b = idem::ops::auth::Token::new("other-token-0123456789").unwrap();
    /// assert_eq!(a.fingerprint().len(), 64);
    /// assert_ne!(a.fingerprint(), b.fingerprint());
    /// ```
    pub fn fingerprint(&self) -> String {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.digest)
            .expect("HMAC takes a key of any length");
        mac.update(b"idem dashboard session token fingerprint v1");
        hex::encode(mac.finalize().into_bytes())
    }
}

/// The tokens a host accepts: the current one and, during a rotation, the
/// previous one. Both open the API and the dashboard; a session lives as
/// long as the token it was made with is one of them.
///
/// ```
/// use idem::ops::auth::Tokens;
/// let tokens = Tokens::new("new-token-0123456789").unwrap()
///     .with_previous("old-token-0123456789").unwrap();
/// assert!(tokens.matching("old-token-0123456789").is_some());
/// assert!(tokens.matching("another-token-01234").is_none());
/// ```
#[derive(Debug, Clone)]
pub struct Tokens {
    current: Token,
    previous: Option<Token>,
}

impl Tokens {
    /// One token (no strength rules: see [`Tokens::from_config`]).
    pub fn new(current: &str) -> Result<Self, String> {
        Ok(Tokens {
            current: Token::new(current)?,
            previous: None,
        })
    }

    /// These tokens, with `previous` accepted too.
    pub fn with_previous(self, previous: &str) -> Result<Self, String> {
        Ok(Tokens {
            previous: Some(Token::new(previous)?),
            ..self
        })
    }

    /// The tokens of this host: `IDEM_API_TOKEN` or else the first line of
    /// `file`; the previous one from `IDEM_API_TOKEN_PREVIOUS` or else the
    /// file's second line. `None` when no token is set. Each must pass
    /// [`check_strength`].
    pub fn from_config(file: Option<&std::path::Path>) -> Result<Option<Self>, String> {
        let env = |name: &str| {
            std::env::var(name)
                .ok()
                .filter(|value| !value.trim().is_empty())
        };
        let file_text =
            match (env("IDEM_API_TOKEN"), file) {
                (None, Some(path)) => Some(std::fs::read_to_string(path).map_err(|e| {
                    format!("cannot read the API token file {}: {e}", path.display())
                })?),
                _ => None,
            };
        Self::from_sources(
            env("IDEM_API_TOKEN"),
            env("IDEM_API_TOKEN_PREVIOUS"),
            file_text.as_deref(),
        )
    }

    /// [`Tokens::from_config`] from what it read: the two variables and
    /// the token file's text (read only when `IDEM_API_TOKEN` is unset).
    pub fn from_sources(
        current: Option<String>,
        previous: Option<String>,
        file_text: Option<&str>,
    ) -> Result<Option<Self>, String> {
        let (current, from_file_previous, source) = match (current, file_text) {
            (Some(current), _) => (current, None, "IDEM_API_TOKEN"),
            (None, Some(text)) => {
                let lines: Vec<&str> = text
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .collect();
                match lines.as_slice() {
                    [] => return Err("the API token file is empty".into()),
                    [current] => (current.to_string(), None, "the API token file's token"),
                    [current, previous] => (
                        current.to_string(),
                        Some(previous.to_string()),
                        "the API token file's first line",
                    ),
                    _ => {
                        return Err("the API token file holds more than two lines: the current token, then the previous one during a rotation".into());
                    }
                }
            }
            (None, None) => return Ok(None),
        };
        let current = current.trim();
        check_strength(source, current)?;
        let mut tokens = Tokens::new(current)?;
        let previous = match (previous, from_file_previous) {
            (Some(previous), _) => Some((previous, "IDEM_API_TOKEN_PREVIOUS")),
            (None, Some(previous)) => Some((previous, "the API token file's second line")),
            (None, None) => None,
        };
        if let Some((previous, source)) = previous {
            let previous = previous.trim();
            check_strength(source, previous)?;
            if previous == current {
                return Err(format!(
                    "{source} is the current token: a rotation needs a new one"
                ));
            }
            tokens = tokens.with_previous(previous)?;
        }
        Ok(Some(tokens))
    }

    /// The token `candidate` is, if any (every token is compared, so the
    /// time taken does not say which one matched).
    pub fn matching(&self, candidate: &str) -> Option<&Token> {
        let current = self.current.matches(candidate);
        let previous = self.previous.as_ref().filter(|p| p.matches(candidate));
        if current {
            Some(&self.current)
        } else {
            previous
        }
    }

    /// The fingerprints of every accepted token (see [`Token::fingerprint`]).
    pub fn fingerprints(&self) -> Vec<String> {
        std::iter::once(&self.current)
            .chain(self.previous.as_ref())
            .map(Token::fingerprint)
            .collect()
    }
}

/// Lifetime of a dashboard session unless `--session-ttl` says otherwise.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(12 * 3600);

/// What the token check needs: the tokens, the session lifetime, whether
/// a proxy's forwarded headers are believed, and the failure throttle.
///
/// ```
/// let access = idem::ops::auth::Access::new(Some(idem::ops::auth::Tokens::new("t").unwrap()));
/// assert_eq!(access.session_ttl, idem::ops::auth::DEFAULT_SESSION_TTL);
/// assert!(!access.trust_proxy);
/// ```
#[derive(Debug)]
pub struct Access {
    /// The accepted tokens; without any, the API and the dashboard refuse
    /// every request.
    pub tokens: Option<Tokens>,
    /// How long a dashboard session lives.
    pub session_ttl: Duration,
    /// Believe `X-Forwarded-For` and `X-Forwarded-Proto` (`--trust-proxy`).
    pub trust_proxy: bool,
    /// Failed sign-ins and wrong credentials per client address.
    pub throttle: Throttle,
}

impl Access {
    /// These tokens with the defaults: 12-hour sessions, no trusted proxy,
    /// the default throttle.
    pub fn new(tokens: Option<Tokens>) -> Self {
        Access {
            tokens,
            session_ttl: DEFAULT_SESSION_TTL,
            trust_proxy: false,
            throttle: Throttle::new(ThrottleSettings::default()),
        }
    }
}

/// What a request presents to prove it may ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// `Authorization: Bearer T` (a program): the token itself.
    Bearer(String),
    /// The dashboard's session cookie (a browser, which also sends it on
    /// requests other pages make: see [`same_origin`]); `None` when its
    /// value is not a session id at all.
    Session(Option<SessionId>),
}

/// The credential a request carries: `Authorization: Bearer T`, or the
/// dashboard's session cookie of the request's scheme
/// ([`session::cookie_name`]).
pub fn presented(headers: &axum::http::HeaderMap, https: bool) -> Option<Credential> {
    if let Some(value) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let (scheme, token) = value.split_once(' ')?;
        return scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| Credential::Bearer(token.trim().to_string()));
    }
    let name = session::cookie_name(https);
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(cookie, _)| *cookie == name)
        .map(|(_, value)| Credential::Session(SessionId::parse(value)))
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
    fn bearer_header_or_the_session_cookie_of_the_scheme() {
        let id = "ab".repeat(32);
        let mut headers = HeaderMap::new();
        assert_eq!(presented(&headers, false), None);
        headers.insert(
            "cookie",
            HeaderValue::from_str(&format!("a=b; idem_session={id}")).unwrap(),
        );
        assert_eq!(
            presented(&headers, false),
            Some(Credential::Session(SessionId::parse(&id)))
        );
        assert!(SessionId::parse(&id).is_some());
        assert_eq!(
            presented(&headers, true),
            None,
            "over HTTPS only the __Host- cookie counts"
        );
        headers.insert(
            "cookie",
            HeaderValue::from_str(&format!("__Host-idem_session={id}")).unwrap(),
        );
        assert!(matches!(
            presented(&headers, true),
            Some(Credential::Session(Some(_)))
        ));
        headers.insert("cookie", HeaderValue::from_static("idem_session=the-token"));
        assert_eq!(presented(&headers, false), Some(Credential::Session(None)));
        headers.insert("authorization", HeaderValue::from_static("Bearer t2"));
        assert_eq!(
            presented(&headers, false),
            Some(Credential::Bearer("t2".into()))
        );
        headers.insert("authorization", HeaderValue::from_static("Basic t2"));
        assert_eq!(presented(&headers, false), None);
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

    #[test]
    fn weak_tokens_are_refused_naming_the_rule() {
        let refused = |t: &str| check_strength("IDEM_API_TOKEN", t).unwrap_err();
        assert!(refused("short-token").contains("at least 16 characters"));
        let one_char = refused("aaaaaaaaaaaaaaaa");
        assert!(
            one_char.contains("at least 8 distinct characters"),
            "{one_char}"
        );
        assert!(one_char.contains("has 1"), "{one_char}");
        assert!(refused("abababababababababab").contains("distinct"));
        assert!(refused("0123456789 abcdef").contains("printable ASCII"));
        assert!(refused("0123456789\u{7}abcdef").contains("printable ASCII"));
        assert!(refused("0123456789abcdé").contains("16 characters"));
        assert!(check_strength("x", "0123456789abcdef").is_ok());
        assert!(check_strength("x", "9f86d081884c7d659a2feaa0c55ad015").is_ok());
    }

    #[test]
    fn tokens_come_from_the_variables_or_a_file_of_one_or_two_lines() {
        let strong = "9f86d081884c7d659a2feaa0";
        let older = "2c26b46b68ffc68ff99b453c";
        assert!(Tokens::from_sources(None, None, None).unwrap().is_none());
        let one = Tokens::from_sources(Some(strong.into()), None, None)
            .unwrap()
            .unwrap();
        assert!(one.matching(strong).is_some());
        assert_eq!(one.fingerprints().len(), 1);
        let both = Tokens::from_sources(Some(strong.into()), Some(older.into()), None)
            .unwrap()
            .unwrap();
        assert!(both.matching(strong).is_some() && both.matching(older).is_some());
        assert_eq!(both.fingerprints().len(), 2);
        let file = Tokens::from_sources(None, None, Some(&format!("{strong}\n{older}\n")))
            .unwrap()
            .unwrap();
        assert_eq!(file.fingerprints(), both.fingerprints());
        let weak =
            Tokens::from_sources(None, None, Some(&format!("{strong}\naaaaaaaaaaaaaaaaaaaa")));
        assert!(weak.unwrap_err().contains("second line"));
        let three = Tokens::from_sources(None, None, Some("a\nb\nc"));
        assert!(three.unwrap_err().contains("more than two lines"));
        let same = Tokens::from_sources(Some(strong.into()), Some(strong.into()), None);
        assert!(same.unwrap_err().contains("rotation"));
        let weak_env = Tokens::from_sources(Some("x".repeat(20)), None, None);
        assert!(
            weak_env
                .unwrap_err()
                .starts_with("IDEM_API_TOKEN is refused")
        );
    }

    #[test]
    fn a_fingerprint_is_not_the_token_nor_its_digest() {
        let token = Token::new("0123456789abcdef").unwrap();
        let fingerprint = token.fingerprint();
        assert_ne!(
            fingerprint,
            hex::encode(Sha256::digest(b"0123456789abcdef"))
        );
        assert!(!fingerprint.contains("0123456789abcdef"));
        assert_eq!(
            fingerprint,
            Token::new(" 0123456789abcdef ").unwrap().fingerprint()
        );
    }
}
