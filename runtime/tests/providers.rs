//! The http and email providers against real servers: every outcome is
//! classified, the key, auth and signature headers are sent.

use idem::effects::{Action, Effect};
use idem::failure::ErrorClass;
use idem::providers::http::{HttpProvider, sign};
use idem::providers::{Provider, ProviderConfig};
use idem_provider_server::{Fault, ProviderServerConfig, ProviderServerHandle};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn config(kind: &str, base_url: &str, extra: &str) -> ProviderConfig {
    toml::from_str(&format!(
        "kind = \"{kind}\"\nbase_url = \"{base_url}\"\ntimeout = \"300ms\"\n{extra}"
    ))
    .unwrap()
}

fn email(key: &str, to: &str) -> Effect {
    Effect {
        provider: "email".into(),
        idempotency_key: key.into(),
        action: Action::Email {
            to: vec![to.into()],
            subject: "s".into(),
            text: Some("t".into()),
            html: None,
            template: None,
        },
    }
}

fn http(key: &str, path: &str) -> Effect {
    Effect {
        provider: "partner".into(),
        idempotency_key: key.into(),
        action: Action::Http {
            method: "POST".into(),
            path: path.into(),
            headers: vec![("x-event".into(), "paid".into())],
            body: Some(b"{\"a\":1}".to_vec()),
        },
    }
}

#[tokio::test]
async fn every_outcome_is_classified() {
    let server = ProviderServerHandle::start(ProviderServerConfig {
        late_by: Duration::from_millis(800),
        ..ProviderServerConfig::default()
    })
    .await
    .unwrap();
    let provider =
        HttpProvider::from_config("email", &config("email", &server.base_url, "")).unwrap();
    let ok = provider
        .execute(&email("k:ok", "a@example.com"))
        .await
        .unwrap();
    assert!(ok.result_ref.unwrap().starts_with("msg_"));
    for (fault, class, code) in [
        (Fault::ServerError, ErrorClass::Ambiguous, "provider_error"),
        (
            Fault::TooManyRequests,
            ErrorClass::Retryable,
            "provider_rate_limited",
        ),
        (Fault::BadRequest, ErrorClass::Permanent, "bad_request"),
        (Fault::Late, ErrorClass::Ambiguous, "provider_timeout"),
        (
            Fault::Drop,
            ErrorClass::Ambiguous,
            "provider_connection_lost",
        ),
    ] {
        let key = format!("k:{fault}");
        server.script_faults(&key, vec![fault]);
        let err = provider
            .execute(&email(&key, "a@example.com"))
            .await
            .unwrap_err();
        assert_eq!(
            (err.class, err.code.as_str()),
            (class, code),
            "{fault}: {err}"
        );
        if fault == Fault::TooManyRequests {
            assert_eq!(err.retry_after, Some(Duration::from_secs(1)));
        }
    }
    // The provider's own code for a permanent rejection.
    let err = provider
        .execute(&email("k:bad-recipient", "nobody"))
        .await
        .unwrap_err();
    assert_eq!(
        (err.class, err.code.as_str()),
        (ErrorClass::Permanent, "invalid_recipient")
    );
    // Same key, different request.
    let err = provider
        .execute(&email("k:ok", "other@example.com"))
        .await
        .unwrap_err();
    assert_eq!(
        (err.class, err.code.as_str()),
        (ErrorClass::Permanent, "idempotency_key_conflict")
    );
    // Nothing listening: never sent, plainly retryable.
    let closed =
        HttpProvider::from_config("email", &config("email", "http://127.0.0.1:1", "")).unwrap();
    let err = closed
        .execute(&email("k:x", "a@example.com"))
        .await
        .unwrap_err();
    assert_eq!(
        (err.class, err.code.as_str()),
        (ErrorClass::Retryable, "provider_unreachable")
    );
}

#[tokio::test]
async fn actions_the_provider_cannot_carry_out_are_permanent() {
    let provider =
        HttpProvider::from_config("partner", &config("http", "http://127.0.0.1:1", "")).unwrap();
    let err = provider
        .execute(&email("k", "a@example.com"))
        .await
        .unwrap_err();
    assert_eq!(err.code, "unsupported_action");
    let mut reserved = http("k", "/x");
    if let Action::Http { headers, .. } = &mut reserved.action {
        headers.push(("Authorization".into(), "Bearer stolen".into()));
    }
    assert_eq!(
        provider.execute(&reserved).await.unwrap_err().code,
        "invalid_effect"
    );
    assert_eq!(
        provider
            .execute(&http("k", "https://evil.example"))
            .await
            .unwrap_err()
            .code,
        "invalid_effect"
    );
    assert_eq!(
        provider
            .execute(&http("k", "/../admin"))
            .await
            .unwrap_err()
            .code,
        "invalid_effect"
    );
}

#[tokio::test]
async fn the_key_auth_and_signature_headers_are_sent_and_secrets_come_from_the_host() {
    let seen: Arc<Mutex<Vec<axum::http::HeaderMap>>> = Arc::default();
    let captured = seen.clone();
    let app = axum::Router::new().fallback(move |headers: axum::http::HeaderMap| {
        let captured = captured.clone();
        async move {
            captured.lock().unwrap().push(headers);
            axum::Json(serde_json::json!({"id": "req_1"}))
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), "s3cret\n").unwrap();
    std::fs::write(dir.path().join("signing"), "k3y").unwrap();
    let extra = format!(
        "auth = {{ file = \"{}\" }}\nhmac = {{ file = \"{}\" }}",
        dir.path().join("token").display(),
        dir.path().join("signing").display()
    );
    let provider = HttpProvider::from_config(
        "partner",
        &config("http", &format!("http://{addr}"), &extra),
    )
    .unwrap();
    let delivered = provider
        .execute(&http("webhook:e1:acme", "/hooks"))
        .await
        .unwrap();
    assert_eq!(delivered.result_ref.as_deref(), Some("req_1"));
    let headers = seen.lock().unwrap().remove(0);
    assert_eq!(headers["idempotency-key"], "webhook:e1:acme");
    assert_eq!(headers["authorization"], "Bearer s3cret");
    assert_eq!(headers["x-event"], "paid");
    assert_eq!(
        headers["x-idem-signature"].to_str().unwrap(),
        sign(b"k3y", "webhook:e1:acme", b"{\"a\":1}")
    );
    // A missing secret is a configuration error naming the variable.
    let missing = config(
        "http",
        "http://x",
        "auth = { env = \"IDEM_TEST_NO_SUCH_VAR\" }",
    );
    let err = HttpProvider::from_config("partner", &missing)
        .err()
        .unwrap();
    assert!(err.contains("IDEM_TEST_NO_SUCH_VAR"), "{err}");
}
