//! Dashboard sessions: signing in with the token makes a random session id
//! that the browser keeps in a cookie; the store keeps the id's SHA-256,
//! the fingerprint of the token used ([`super::auth::Token::fingerprint`])
//! and the expiry. The cookie never holds the token, signing out revokes
//! the row (for every node sharing the store), and a session whose token is
//! no longer configured is refused.
//!
//! The cookie is `__Host-idem_session` with `Secure` when the browser came
//! over HTTPS (through a trusted proxy, see [`super::client`]), so no
//! plain-HTTP service on the same host name can read or overwrite it;
//! `idem_session` otherwise. Both are `HttpOnly; SameSite=Strict; Path=/`.

use super::auth::{Token, Tokens};
use crate::store::{NewSession, Store, StoreError};
use rand::RngCore;
use sha2::{Digest, Sha256};
use std::time::Duration;

/// The session cookie over plain HTTP.
pub const COOKIE: &str = "idem_session";
/// The session cookie over HTTPS: the `__Host-` prefix makes the browser
/// take it only with `Secure`, `Path=/` and no `Domain`.
pub const SECURE_COOKIE: &str = "__Host-idem_session";

/// The cookie of a request's scheme.
///
/// ```
/// assert_eq!(idem::ops::session::cookie_name(true), "__Host-idem_session");
/// ```
pub fn cookie_name(https: bool) -> &'static str {
    if https { SECURE_COOKIE } else { COOKIE }
}

/// A session id: 32 random bytes in 64 lowercase hex digits. Only the
/// browser holds it; the store holds its digest.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionId(String);

impl std::fmt::Debug for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionId(***)")
    }
}

impl SessionId {
    /// A new id from the thread's CSPRNG (ChaCha, seeded from the OS).
    pub fn generate() -> Self {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        SessionId(hex::encode(bytes))
    }

    /// An id as a cookie presents it; `None` unless it has the shape of one.
    ///
    /// ```
    /// use idem::ops::session::SessionId;
    /// assert!(SessionId::parse(&"0a".repeat(32)).is_some());
    /// assert!(SessionId::parse("the-api-token").is_none());
    /// ```
    pub fn parse(text: &str) -> Option<Self> {
        (text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| SessionId(text.to_string()))
    }

    /// The id as the cookie carries it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// What the store keeps: the id's SHA-256 in hex.
    pub fn digest(&self) -> String {
        hex::encode(Sha256::digest(self.0.as_bytes()))
    }
}

/// The session a request was let in with (set by the token check, read by
/// sign-out).
#[derive(Debug, Clone)]
pub struct Current(pub SessionId);

/// Makes a session for a browser that signed in with `token`.
pub async fn start(
    store: &dyn Store,
    token: &Token,
    ttl: Duration,
) -> Result<SessionId, StoreError> {
    let id = SessionId::generate();
    store
        .session_create(NewSession {
            id_digest: id.digest(),
            token_fingerprint: token.fingerprint(),
            ttl,
        })
        .await?;
    // Expired rows go on each sign-in too: `idem serve` runs no pruner.
    if let Err(error) = store.session_delete_expired(100).await {
        tracing::warn!(%error, "expired dashboard sessions could not be deleted");
    }
    Ok(id)
}

/// Whether `id` names a live session made with one of `tokens`.
pub async fn is_live(
    store: &dyn Store,
    id: &SessionId,
    tokens: &Tokens,
) -> Result<bool, StoreError> {
    Ok(store
        .session_get_live(&id.digest(), &tokens.fingerprints())
        .await?
        .is_some())
}

/// Signs a session out everywhere; `false` when it was not live.
pub async fn end(store: &dyn Store, id: &SessionId) -> Result<bool, StoreError> {
    store.session_revoke(&id.digest()).await
}

/// The `Set-Cookie` value that gives the browser its session for `ttl`.
///
/// ```
/// use idem::ops::session::{SessionId, set_cookie};
/// let id = SessionId::parse(&"0a".repeat(32)).unwrap();
/// let plain = set_cookie(&id, false, std::time::Duration::from_secs(60));
/// assert!(plain.starts_with("idem_session=0a0a") && plain.ends_with("Max-Age=60"));
/// assert!(set_cookie(&id, true, std::time::Duration::from_secs(60)).contains("; Secure;"));
/// ```
pub fn set_cookie(id: &SessionId, https: bool, ttl: Duration) -> String {
    cookie(https, id.as_str(), ttl.as_secs())
}

/// The `Set-Cookie` value that makes the browser drop its session cookie.
pub fn clear_cookie(https: bool) -> String {
    cookie(https, "", 0)
}

fn cookie(https: bool, value: &str, max_age: u64) -> String {
    let secure = if https { " Secure;" } else { "" };
    format!(
        "{}={value}; Path=/;{secure} HttpOnly; SameSite=Strict; Max-Age={max_age}",
        cookie_name(https)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_random_hex_and_only_their_digest_is_kept() {
        let a = SessionId::generate();
        let b = SessionId::generate();
        assert_ne!(a, b);
        assert_eq!(SessionId::parse(a.as_str()), Some(a.clone()));
        assert_eq!(a.digest().len(), 64);
        assert_ne!(a.digest(), a.as_str());
        assert_eq!(format!("{a:?}"), "SessionId(***)");
        assert!(SessionId::parse(&"0A".repeat(32)).is_none(), "uppercase");
        assert!(SessionId::parse(&"0a".repeat(31)).is_none(), "short");
    }

    #[test]
    fn cookies_by_scheme() {
        let id = SessionId::parse(&"0a".repeat(32)).unwrap();
        let hour = Duration::from_secs(3600);
        assert_eq!(
            set_cookie(&id, false, hour),
            format!(
                "idem_session={}; Path=/; HttpOnly; SameSite=Strict; Max-Age=3600",
                id.as_str()
            )
        );
        assert_eq!(
            set_cookie(&id, true, hour),
            format!(
                "__Host-idem_session={}; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age=3600",
                id.as_str()
            )
        );
        assert_eq!(
            clear_cookie(true),
            "__Host-idem_session=; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age=0"
        );
    }
}
