//! Dashboard sessions: digests only, expiry by the store's clock, sign-out
//! seen by every node (it is a row), and a session that dies with the token
//! it was made with.

use super::advance;
use idem::store::{NewSession, Store, StoreError};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::Duration;

const HOUR: Duration = Duration::from_secs(3600);

/// A digest as the store keeps them (64 lowercase hex digits).
fn digest(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

fn session(id: &str, token: &str, ttl: Duration) -> NewSession {
    NewSession {
        id_digest: digest(id),
        token_fingerprint: digest(token),
        ttl,
    }
}

async fn live(store: &Arc<dyn Store>, id: &str, tokens: &[&str]) -> bool {
    let fingerprints: Vec<String> = tokens.iter().map(|t| digest(t)).collect();
    store
        .session_get_live(&digest(id), &fingerprints)
        .await
        .unwrap()
        .is_some()
}

pub async fn session_lives_until_its_expiry_by_the_store_clock(store: Arc<dyn Store>) {
    let made = store
        .session_create(session("s1", "t1", HOUR))
        .await
        .unwrap();
    assert_eq!(made.id_digest, digest("s1"));
    assert_eq!(made.token_fingerprint, digest("t1"));
    assert_eq!(made.expires_at - made.created_at, 3_600_000);
    assert_eq!(made.revoked_at, None);
    store
        .session_create(session("s2", "t1", 3 * HOUR))
        .await
        .unwrap();
    assert!(live(&store, "s1", &["t1"]).await);
    assert!(!live(&store, "unknown", &["t1"]).await);
    assert_eq!(store.session_delete_expired(100).await.unwrap(), 0);

    advance(&store, HOUR - Duration::from_secs(60)).await;
    assert!(live(&store, "s1", &["t1"]).await, "a minute left");
    advance(&store, Duration::from_secs(61)).await;
    assert!(!live(&store, "s1", &["t1"]).await, "expired");
    assert!(live(&store, "s2", &["t1"]).await, "the longer one lives on");

    assert_eq!(store.session_delete_expired(100).await.unwrap(), 1);
    assert_eq!(store.session_delete_expired(100).await.unwrap(), 0);
    assert!(live(&store, "s2", &["t1"]).await);
    advance(&store, 2 * HOUR).await;
    assert_eq!(store.session_delete_expired(0).await.unwrap(), 0);
    assert_eq!(store.session_delete_expired(100).await.unwrap(), 1);
}

pub async fn session_revoked_is_not_live(store: Arc<dyn Store>) {
    store
        .session_create(session("s1", "t1", HOUR))
        .await
        .unwrap();
    store
        .session_create(session("s2", "t1", HOUR))
        .await
        .unwrap();
    assert!(store.session_revoke(&digest("s1")).await.unwrap());
    assert!(
        !store.session_revoke(&digest("s1")).await.unwrap(),
        "already revoked"
    );
    assert!(!store.session_revoke(&digest("nothing")).await.unwrap());
    assert!(!live(&store, "s1", &["t1"]).await);
    assert!(live(&store, "s2", &["t1"]).await, "another session is kept");
    // A revoked row stays until its expiry, then goes with the others.
    assert_eq!(store.session_delete_expired(100).await.unwrap(), 0);
    advance(&store, HOUR + Duration::from_secs(1)).await;
    assert_eq!(store.session_delete_expired(100).await.unwrap(), 2);
}

pub async fn session_needs_a_configured_token(store: Arc<dyn Store>) {
    store
        .session_create(session("old", "t-old", HOUR))
        .await
        .unwrap();
    store
        .session_create(session("new", "t-new", HOUR))
        .await
        .unwrap();
    assert!(live(&store, "old", &["t-old"]).await);
    assert!(
        !live(&store, "old", &["t-new"]).await,
        "the token was changed"
    );
    assert!(
        live(&store, "old", &["t-new", "t-old"]).await,
        "a rotation: both tokens configured"
    );
    assert!(live(&store, "new", &["t-new", "t-old"]).await);
    assert!(!live(&store, "old", &[]).await, "no token configured");
}

pub async fn session_input_is_checked(store: Arc<dyn Store>) {
    fn invalid<T>(result: Result<T, StoreError>) -> bool {
        matches!(result, Err(StoreError::Invalid(_)))
    }
    let mut raw = session("s1", "t1", HOUR);
    raw.id_digest = "the-session-id-itself".into();
    assert!(invalid(store.session_create(raw).await));
    let mut upper = session("s1", "t1", HOUR);
    upper.token_fingerprint = upper.token_fingerprint.to_uppercase();
    assert!(invalid(store.session_create(upper).await));
    assert!(invalid(
        store
            .session_create(session("s1", "t1", Duration::from_millis(10)))
            .await
    ));
    assert!(invalid(
        store.session_get_live("x';--", &[digest("t1")]).await
    ));
    assert!(invalid(store.session_revoke("").await));
    assert!(!live(&store, "s1", &["t1"]).await, "nothing was stored");
}
