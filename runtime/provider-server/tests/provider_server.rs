//! The local provider server over real HTTP.

use std::time::Duration;

use idem_provider_server::{
    Fault, FaultConfig, FaultConfigError, ProviderServerConfig, ProviderServerHandle, UNKEYED,
};
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};

const LATE_BY: Duration = Duration::from_millis(300);
const CLIENT_TIMEOUT: Duration = Duration::from_millis(100);

fn test_config() -> ProviderServerConfig {
    ProviderServerConfig {
        late_by: LATE_BY,
        ..ProviderServerConfig::default()
    }
}

async fn start(config: ProviderServerConfig) -> ProviderServerHandle {
    ProviderServerHandle::start(config)
        .await
        .expect("provider server starts")
}

fn client() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client")
}

fn email(to: &str) -> Value {
    json!({ "from": "billing@example.com", "to": [to], "subject": "Invoice 42", "text": "hi" })
}

async fn send(
    client: &Client,
    url: &str,
    key: Option<&str>,
    body: &Value,
) -> (StatusCode, reqwest::header::HeaderMap, Value) {
    let mut request = client.post(url).json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    let response = request.send().await.expect("response");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.json().await.expect("json body");
    (status, headers, body)
}

fn error_code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or_default()
}

#[tokio::test]
async fn same_key_three_times_applies_once_and_replays_the_same_body() {
    let provider = start(test_config()).await;
    let client = client();
    let url = provider.url("/emails");
    let body = email("ada@example.com");

    let (status, headers, first) = send(&client, &url, Some("invoice:42:email:v1"), &body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("idempotent-replayed").is_none());
    let id = first["id"].as_str().expect("id");
    assert!(id.starts_with("msg_"), "{id}");

    for _ in 0..2 {
        let (status, headers, again) =
            send(&client, &url, Some("invoice:42:email:v1"), &body).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(again, first);
        assert_eq!(
            headers
                .get("idempotent-replayed")
                .and_then(|v| v.to_str().ok()),
            Some("true")
        );
    }

    assert_eq!(provider.applied("invoice:42:email:v1"), 1);
    assert_eq!(provider.requests("invoice:42:email:v1"), 3);
    let replayed: Vec<bool> = provider.calls().await.iter().map(|c| c.replayed).collect();
    assert_eq!(replayed, [false, true, true]);
}

/// `dedupe: false`: a provider that cannot dedupe applies every repeat (and
/// the counts show it), while its lookup still finds the first answer.
#[tokio::test]
async fn without_dedupe_every_repeat_is_applied_and_the_lookup_finds_the_first() {
    let provider = start(ProviderServerConfig {
        dedupe: false,
        ..test_config()
    })
    .await;
    let client = client();
    let url = provider.url("/emails");
    let body = email("ada@example.com");
    let (_, _, first) = send(&client, &url, Some("billing/k1"), &body).await;
    let (status, headers, second) = send(&client, &url, Some("billing/k1"), &body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("idempotent-replayed").is_none(), "not a replay");
    assert_ne!(first["id"], second["id"], "applied again");
    assert_eq!(provider.applied("billing/k1"), 2);
    let found: Value = client
        .get(provider.url("/by-key/billing%2Fk1"))
        .send()
        .await
        .expect("lookup")
        .json()
        .await
        .expect("json");
    assert_eq!(
        found["id"], first["id"],
        "the lookup finds the first answer"
    );
}

#[tokio::test]
async fn json_key_order_does_not_change_the_fingerprint() {
    let provider = start(test_config()).await;
    let client = client();
    let send_raw = |raw: &'static str| {
        client
            .post(provider.url("/hooks/order"))
            .header("Idempotency-Key", "order:7:hook")
            .header("content-type", "application/json")
            .body(raw)
            .send()
    };
    let first = send_raw(r#"{"a":1,"b":2}"#).await.expect("first");
    assert_eq!(first.status(), StatusCode::OK);
    let second = send_raw(r#"{ "b": 2, "a": 1 }"#).await.expect("second");
    assert_eq!(second.status(), StatusCode::OK);
    assert!(second.headers().contains_key("idempotent-replayed"));
    assert_eq!(provider.applied("order:7:hook"), 1);
}

#[tokio::test]
async fn same_key_with_another_body_is_a_conflict() {
    let provider = start(test_config()).await;
    let client = client();
    let url = provider.url("/emails");
    let (status, _, _) = send(&client, &url, Some("k"), &email("a@example.com")).await;
    assert_eq!(status, StatusCode::OK);

    let (status, _, body) = send(&client, &url, Some("k"), &email("b@example.com")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(error_code(&body), "idempotency_key_conflict");

    let (status, _, body) = send(
        &client,
        &provider.url("/webhooks"),
        Some("k"),
        &email("a@example.com"),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "same key on another path");
    assert_eq!(error_code(&body), "idempotency_key_conflict");
    assert_eq!(provider.applied("k"), 1);
    assert_eq!(provider.requests("k"), 3);
}

#[tokio::test]
async fn concurrent_duplicate_gets_request_in_progress() {
    let provider = start(ProviderServerConfig {
        processing_delay: Duration::from_millis(300),
        ..test_config()
    })
    .await;
    let client = client();
    let url = provider.url("/emails");
    let body = email("a@example.com");

    let first = send(&client, &url, Some("dup"), &body);
    let second = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        send(&client, &url, Some("dup"), &body).await
    };
    let ((status1, _, body1), (status2, headers2, body2)) = tokio::join!(first, second);
    assert_eq!(status1, StatusCode::OK);
    assert_eq!(status2, StatusCode::CONFLICT);
    assert_eq!(error_code(&body2), "request_in_progress");
    assert_eq!(
        headers2.get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );

    let (status3, _, body3) = send(&client, &url, Some("dup"), &body).await;
    assert_eq!(status3, StatusCode::OK);
    assert_eq!(body3, body1);
    assert_eq!(provider.applied("dup"), 1);
}

#[tokio::test]
async fn client_gone_during_processing_frees_the_key() {
    let provider = start(ProviderServerConfig {
        processing_delay: Duration::from_millis(300),
        ..test_config()
    })
    .await;
    let impatient = Client::builder()
        .timeout(CLIENT_TIMEOUT)
        .build()
        .expect("client");
    let url = provider.url("/emails");
    let body = email("a@example.com");
    let err = impatient
        .post(&url)
        .header("Idempotency-Key", "gone")
        .json(&body)
        .send()
        .await
        .expect_err("times out");
    assert!(err.is_timeout(), "{err}");
    tokio::time::sleep(Duration::from_millis(50)).await;

    let (status, _, _) = send(&client(), &url, Some("gone"), &body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(provider.applied("gone"), 1);
}

#[tokio::test]
async fn late_fault_times_out_the_client_but_applies_once() {
    let provider = start(test_config()).await;
    provider.script_faults("late-key", vec![Fault::Late]);
    let impatient = Client::builder()
        .timeout(CLIENT_TIMEOUT)
        .build()
        .expect("client");
    let url = provider.url("/emails");
    let body = email("a@example.com");

    let err = impatient
        .post(&url)
        .header("Idempotency-Key", "late-key")
        .json(&body)
        .send()
        .await
        .expect_err("the late answer must time out");
    assert!(err.is_timeout(), "{err}");
    assert_eq!(provider.applied("late-key"), 1, "the work was done");

    let (status, headers, retry) = send(&client(), &url, Some("late-key"), &body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.contains_key("idempotent-replayed"));
    let effects = provider.effects().await;
    assert_eq!(effects.len(), 1);
    assert_eq!(retry["id"].as_str(), effects[0].result_id.as_deref());
    assert_eq!(provider.applied("late-key"), 1);

    let calls = provider.calls().await;
    assert_eq!(calls[0].fault, Some(Fault::Late));
    assert!(!calls[0].replayed);
    assert!(calls[1].replayed);
}

#[tokio::test]
async fn drop_fault_gives_a_connection_error_but_applies_once() {
    let provider = start(test_config()).await;
    provider.script_faults("drop-key", vec![Fault::Drop]);
    let client = client();
    let url = provider.url("/emails");
    let body = email("a@example.com");

    let err = client
        .post(&url)
        .header("Idempotency-Key", "drop-key")
        .json(&body)
        .send()
        .await
        .expect_err("the connection must be dropped without a response");
    assert!(!err.is_timeout(), "{err:?}");
    assert!(err.status().is_none() && err.is_request(), "{err:?}");
    assert_eq!(provider.applied("drop-key"), 1);

    let (status, headers, retry) = send(&client, &url, Some("drop-key"), &body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.contains_key("idempotent-replayed"));
    assert_eq!(
        retry["id"].as_str(),
        provider.effects().await[0].result_id.as_deref()
    );
    assert_eq!(provider.applied("drop-key"), 1);
    assert_eq!(provider.requests("drop-key"), 2);
}

#[tokio::test]
async fn too_many_requests_applies_nothing_then_success_applies_once() {
    let provider = start(test_config()).await;
    provider.script_faults("rl", vec![Fault::TooManyRequests]);
    let client = client();
    let url = provider.url("/emails");
    let body = email("a@example.com");

    let (status, headers, error) = send(&client, &url, Some("rl"), &body).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        headers.get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    assert_eq!(error_code(&error), "rate_limit_exceeded");
    assert_eq!(provider.applied("rl"), 0);

    let (status, headers, _) = send(&client, &url, Some("rl"), &body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!headers.contains_key("idempotent-replayed"));
    let (status, _, _) = send(&client, &url, Some("rl"), &body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(provider.applied("rl"), 1);
    assert_eq!(provider.requests("rl"), 3);
}

#[tokio::test]
async fn server_error_and_bad_request_faults_apply_nothing() {
    let provider = start(test_config()).await;
    provider.script_faults("f", vec![Fault::ServerError, Fault::BadRequest]);
    let client = client();
    let url = provider.url("/emails");
    let body = email("a@example.com");

    let (status, _, _) = send(&client, &url, Some("f"), &body).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let (status, _, error) = send(&client, &url, Some("f"), &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&error), "bad_request");
    assert_eq!(provider.applied("f"), 0);

    let (status, _, _) = send(&client, &url, Some("f"), &body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(provider.applied("f"), 1);
}

#[tokio::test]
async fn fault_header_forces_a_fault() {
    let provider = start(test_config()).await;
    let client = client();
    let response = client
        .post(provider.url("/webhooks/x"))
        .header("Idempotency-Key", "hdr")
        .header("X-Idem-Fault", "500")
        .json(&json!({ "event": 1 }))
        .send()
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let response = client
        .post(provider.url("/webhooks/x"))
        .header("X-Idem-Fault", "nonsense")
        .send()
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(provider.applied("hdr"), 0);
}

#[tokio::test]
async fn random_rates_fault_fresh_requests() {
    let provider = start(ProviderServerConfig {
        faults: FaultConfig::parse_rates("500=1").expect("rates"),
        ..test_config()
    })
    .await;
    let client = client();
    for _ in 0..3 {
        let (status, _, _) = send(&client, &provider.url("/hooks"), None, &json!({})).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(provider.applied(UNKEYED), 0);
    assert_eq!(provider.requests(UNKEYED), 3);
}

#[tokio::test]
async fn reject_matching_answers_400_and_applies_nothing() {
    let provider = start(ProviderServerConfig {
        faults: FaultConfig {
            reject_matching: vec!["poison".into()],
            ..FaultConfig::default()
        },
        ..test_config()
    })
    .await;
    let client = client();
    let url = provider.url("/emails");
    let (status, _, body) = send(&client, &url, Some("p"), &email("poison@example.com")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&body), "bad_request");
    assert_eq!(provider.applied("p"), 0);
    let (status, _, _) = send(&client, &url, Some("ok"), &email("fine@example.com")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(provider.applied("ok"), 1);
}

#[tokio::test]
async fn invalid_recipient_is_422_and_not_applied() {
    let provider = start(test_config()).await;
    let client = client();
    let url = provider.url("/emails");
    for (key, body) in [
        ("no-at", email("not-an-address")),
        ("empty", json!({ "to": [], "subject": "x" })),
        ("missing", json!({ "subject": "x" })),
    ] {
        let (status, _, error) = send(&client, &url, Some(key), &body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{key}");
        assert_eq!(error_code(&error), "invalid_recipient");
        assert_eq!(provider.applied(key), 0);
    }
    // A 422 is not stored: the key can still be used once the input is fixed.
    let (status, _, _) = send(&client, &url, Some("no-at"), &email("a@example.com")).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn unkeyed_requests_apply_every_time() {
    let provider = start(test_config()).await;
    let client = client();
    for _ in 0..2 {
        let (status, _, body) =
            send(&client, &provider.url("/hooks"), None, &json!({"a": 1})).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["received"], json!(true));
        assert!(body["id"].as_str().is_some_and(|id| id.starts_with("req_")));
    }
    let response = client
        .get(provider.url("/anything/else?x=1"))
        .send()
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(provider.applied(UNKEYED), 3);
}

#[tokio::test]
async fn expired_key_is_processed_again() {
    let provider = start(ProviderServerConfig {
        key_ttl: Duration::from_millis(100),
        ..test_config()
    })
    .await;
    let client = client();
    let url = provider.url("/emails");
    let body = email("a@example.com");
    let (_, _, first) = send(&client, &url, Some("ttl"), &body).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (status, headers, second) = send(&client, &url, Some("ttl"), &body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_ne!(first, second);
    assert_eq!(provider.applied("ttl"), 2);
}

#[tokio::test]
async fn control_endpoints_have_the_documented_shapes() {
    let provider = start(test_config()).await;
    let client = client();

    let scripted: Value = client
        .post(provider.url("/_faults"))
        .json(&json!({ "key": "ctl", "faults": ["429"] }))
        .send()
        .await
        .expect("script")
        .json()
        .await
        .expect("json");
    assert_eq!(scripted, json!({ "key": "ctl", "queued": 1 }));
    let response = client
        .post(provider.url("/_faults"))
        .json(&json!({ "path": "/hooks", "faults": ["500"] }))
        .send()
        .await
        .expect("script path");
    assert_eq!(response.status(), StatusCode::OK);
    let response = client
        .post(provider.url("/_faults"))
        .json(&json!({ "key": "ctl", "faults": ["explode"] }))
        .send()
        .await
        .expect("bad script");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);

    let url = provider.url("/emails");
    let body = email("a@example.com");
    let (status, _, _) = send(&client, &url, Some("ctl"), &body).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let (status, _, sent) = send(&client, &url, Some("ctl"), &body).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = send(&client, &provider.url("/hooks"), None, &json!({})).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let response = client
        .post(provider.url("/hooks"))
        .body("plain text")
        .send()
        .await
        .expect("plain");
    assert_eq!(response.status(), StatusCode::OK);

    let calls: Value = client
        .get(provider.url("/_calls"))
        .send()
        .await
        .expect("calls")
        .json()
        .await
        .expect("json");
    let calls = calls["calls"].as_array().expect("calls array");
    assert_eq!(calls.len(), 4);
    let first = &calls[0];
    assert_eq!(first["seq"], json!(1));
    assert_eq!(first["method"], json!("POST"));
    assert_eq!(first["path"], json!("/emails"));
    assert_eq!(first["key"], json!("ctl"));
    assert_eq!(first["body"], body);
    assert_eq!(first["status"], json!(429));
    assert_eq!(first["fault"], json!("429"));
    assert_eq!(first["replayed"], json!(false));
    assert!(first["at"].as_str().is_some());
    assert_eq!(calls[1]["fault"], Value::Null);
    assert_eq!(calls[2]["key"], Value::Null);
    assert_eq!(calls[2]["fault"], json!("500"));
    assert_eq!(calls[3]["body"], json!("plain text"));

    let effects: Value = client
        .get(provider.url("/_effects"))
        .send()
        .await
        .expect("effects")
        .json()
        .await
        .expect("json");
    assert_eq!(
        effects,
        json!({ "effects": [
            { "key": "", "applied": 1, "requests": 2, "path": "/hooks",
              "result_id": provider.effects().await[0].result_id },
            { "key": "ctl", "applied": 1, "requests": 2, "path": "/emails",
              "result_id": sent["id"] },
        ]})
    );

    let response = client
        .get(provider.url("/_nope"))
        .send()
        .await
        .expect("404");
    assert_eq!(response.status(), StatusCode::NOT_FOUND);

    let response = client
        .post(provider.url("/_reset"))
        .send()
        .await
        .expect("reset");
    assert_eq!(response.status(), StatusCode::OK);
    assert!(provider.effects().await.is_empty());
    assert!(provider.calls().await.is_empty());
}

#[tokio::test]
async fn shutdown_stops_the_server() {
    let provider = start(test_config()).await;
    let url = provider.url("/hooks");
    provider.shutdown().await.expect("clean shutdown");
    let err = Client::new()
        .post(&url)
        .send()
        .await
        .expect_err("server is gone");
    assert!(err.is_connect(), "{err:?}");
}

#[test]
fn parse_rates_reports_typed_errors() {
    assert!(matches!(
        FaultConfig::parse_rates("500"),
        Err(FaultConfigError::MalformedEntry(_))
    ));
    assert!(matches!(
        FaultConfig::parse_rates("503=0.1"),
        Err(FaultConfigError::UnknownFault(_))
    ));
    assert!(matches!(
        FaultConfig::parse_rates("late=often"),
        Err(FaultConfigError::InvalidRate {
            fault: Fault::Late,
            ..
        })
    ));
    assert!(matches!(
        FaultConfig::parse_rates("drop=1.5"),
        Err(FaultConfigError::OutOfRange {
            fault: Fault::Drop,
            ..
        })
    ));
    assert!(matches!(
        FaultConfig::parse_rates("drop=0.1,drop=0.2"),
        Err(FaultConfigError::Duplicate(Fault::Drop))
    ));
    assert!(matches!(
        FaultConfig::parse_rates("500=0.6,429=0.6"),
        Err(FaultConfigError::SumAboveOne(_))
    ));
    assert!(matches!(
        FaultConfig::parse_rates("500=NaN"),
        Err(FaultConfigError::OutOfRange { .. })
    ));
}

#[test]
fn cli_constructor_fits_the_flags() {
    let config = ProviderServerConfig::from_cli(
        Some("500=0.1,429=0.05,late=0.02,drop=0.01"),
        Some("300ms"),
        vec!["poison".into()],
    )
    .expect("valid flags");
    assert_eq!(config.late_by, Duration::from_millis(300));
    assert_eq!(config.faults.too_many_requests, 0.05);
    assert_eq!(config.faults.reject_matching, ["poison"]);
    assert!(ProviderServerConfig::from_cli(None, Some("soon"), vec![]).is_err());
    assert_eq!(
        ProviderServerConfig::from_cli(None, None, vec![]).expect("defaults"),
        ProviderServerConfig::default()
    );
}

async fn look_up(
    client: &Client,
    provider: &ProviderServerHandle,
    encoded: &str,
) -> (StatusCode, Value) {
    let response = client
        .get(provider.url(&format!("/by-key/{encoded}")))
        .send()
        .await
        .expect("response");
    let status = response.status();
    (status, response.json().await.expect("json body"))
}

/// `GET /by-key/{key}` answers the stored first response of the key (its
/// id at `/id`) or 404, is counted apart from requests and applications,
/// takes path-scripted faults, and lies when told to.
#[tokio::test]
async fn a_lookup_answers_the_stored_response_without_applying_anything() {
    let provider = start(test_config()).await;
    let client = client();
    let key = "billing/invoice 42";
    let encoded = "billing%2Finvoice%2042";
    let (status, body) = look_up(&client, &provider, encoded).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&body), "not_found");
    let (status, _, sent) = send(
        &client,
        &provider.url("/emails"),
        Some(key),
        &email("ada@example.com"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, found) = look_up(&client, &provider, encoded).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(found, sent, "the stored body, so /id reads the same id");
    assert_eq!(provider.applied(key), 1, "a lookup applies nothing");
    assert_eq!(
        provider.requests(key),
        1,
        "nor is it a request with the key"
    );
    assert_eq!(provider.lookups(key), 2);
    let calls = provider.calls().await;
    let lookups: Vec<_> = calls.iter().filter(|c| c.method == "GET").collect();
    assert_eq!(lookups.len(), 2);
    assert_eq!(lookups[1].path, format!("/by-key/{encoded}"));
    assert_eq!(lookups[1].key, None);

    // Faults scripted for the lookup's path (as sent) reach it, once.
    let path = format!("/by-key/{encoded}");
    provider.script_path_faults(&path, vec![Fault::ServerError, Fault::TooManyRequests]);
    assert_eq!(
        look_up(&client, &provider, encoded).await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        look_up(&client, &provider, encoded).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(look_up(&client, &provider, encoded).await.0, StatusCode::OK);
    // A key script is for requests carrying the key, not for lookups.
    provider.script_faults(key, vec![Fault::BadRequest]);
    assert_eq!(look_up(&client, &provider, encoded).await.0, StatusCode::OK);

    provider.set_lookup_lies(true);
    assert_eq!(
        look_up(&client, &provider, encoded).await.0,
        StatusCode::NOT_FOUND
    );
    provider.set_lookup_lies(false);
    assert_eq!(look_up(&client, &provider, encoded).await.0, StatusCode::OK);
    assert_eq!(provider.applied(key), 1);

    // A POST to the same path is an ordinary request, not a lookup.
    let (status, _, _) = send(
        &client,
        &provider.url("/by-key/x"),
        Some("k:post"),
        &json!({}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(provider.applied("k:post"), 1);
    assert_eq!(provider.lookups("x"), 0);
    let (status, body) = look_up(&client, &provider, "%zz").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&body), "invalid_lookup_key");
}

/// Review of issue 25 (`dedupe: false` with a `processing_delay`): while a
/// repeat of an applied key is processing, the lookup must still find the
/// first answer, and the first answer must stay the one it finds after the
/// repeat is applied. `begin` overwrites the key's `Slot::Done` with the
/// repeat's `Slot::InProgress`, so the lookup answers 404 meanwhile (a false
/// "not applied": idem sends a third time), and `apply` then finds no
/// `Done` slot and stores the repeat's answer as if it were the first.
#[tokio::test]
async fn review_without_dedupe_a_repeat_in_progress_keeps_the_first_answer_for_the_lookup() {
    let provider = start(ProviderServerConfig {
        dedupe: false,
        processing_delay: Duration::from_millis(400),
        ..test_config()
    })
    .await;
    let client = client();
    let url = provider.url("/emails");
    let body = email("ada@example.com");
    let (status, _, first) = send(&client, &url, Some("billing/k2"), &body).await;
    assert_eq!(status, StatusCode::OK);
    let repeat = send(&client, &url, Some("billing/k2"), &body);
    let during = async {
        // Once the repeat is in (counted, still in its processing delay).
        while provider.requests("billing/k2") < 2 {
            tokio::task::yield_now().await;
        }
        look_up(&client, &provider, "billing%2Fk2").await
    };
    let ((status, _, second), (during_status, during_body)) = tokio::join!(repeat, during);
    assert_eq!(status, StatusCode::OK);
    assert_ne!(first["id"], second["id"], "applied again (no dedupe)");
    assert_eq!(provider.applied("billing/k2"), 2);
    let (after_status, after_body) = look_up(&client, &provider, "billing%2Fk2").await;
    let found = [
        (during_status, during_body["id"].clone()),
        (after_status, after_body["id"].clone()),
    ];
    assert_eq!(
        found,
        [
            (StatusCode::OK, first["id"].clone()),
            (StatusCode::OK, first["id"].clone())
        ],
        "the lookup finds the first answer ({}) while the repeat ({}) is processing, and after",
        first["id"],
        second["id"]
    );
}

/// Review of issue 25: with `dedupe: false`, a repeat whose client goes
/// away while it is processing frees "its" key by removing the slot, which
/// is the first request's stored answer: the lookup then says 404 forever
/// for a key that was applied.
#[tokio::test]
async fn review_without_dedupe_an_abandoned_repeat_does_not_erase_the_first_answer() {
    let provider = start(ProviderServerConfig {
        dedupe: false,
        processing_delay: Duration::from_millis(300),
        ..test_config()
    })
    .await;
    let client = client();
    let url = provider.url("/emails");
    let body = email("ada@example.com");
    let (status, _, first) = send(&client, &url, Some("billing/k3"), &body).await;
    assert_eq!(status, StatusCode::OK);
    let impatient = Client::builder()
        .timeout(CLIENT_TIMEOUT)
        .build()
        .expect("client");
    let gone = impatient
        .post(&url)
        .header("Idempotency-Key", "billing/k3")
        .json(&body)
        .send()
        .await
        .expect_err("times out");
    assert!(gone.is_timeout(), "{gone}");
    // Poll until the server has seen the client go (its 499 is recorded).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !provider.calls().await.iter().any(|c| c.status == 499) {
        assert!(tokio::time::Instant::now() < deadline, "499 recorded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(provider.applied("billing/k3"), 1);
    let (status, found) = look_up(&client, &provider, "billing%2Fk3").await;
    assert_eq!(
        (status, found["id"].clone()),
        (StatusCode::OK, first["id"].clone()),
        "the key was applied once: the lookup finds that answer"
    );
}
