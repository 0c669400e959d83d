//! Issue 24, item 5: a provider's URL (a secret path, an `?api_key=`, a
//! password) never reaches a job's error record, the API, the dashboard or
//! the worker's log, and the records stored before the redaction are
//! redacted once when the store opens.

use idem::store::{Clock, JobState, NewJob};
use idem_provider_server::Fault;
use idem_tests::{Backend, Harness, both_backends};
use std::time::Duration;

const TOKEN: &str = "redaction-test-token-0123456789";

/// The credential in the provider's URL, in its path and in its query.
const SECRET_PATH: &str = "SECRETPATH7f3a";
const SECRET_KEY: &str = "SECRETKEY91c2";

fn assert_no_secret(what: &str, text: &str) {
    for secret in [SECRET_PATH, SECRET_KEY] {
        assert!(!text.contains(secret), "{what} holds {secret}: {text}");
    }
}

/// A real `idem run --listen` whose `email` provider's `base_url` has a
/// secret path and `?api_key=`; the provider server drops the connection
/// after the request (reqwest's error names the URL). The dead job's
/// record, its JSON, its dashboard page and the worker's log (at debug
/// level for idem) hold neither secret.
async fn a_failing_providers_secret_url_is_shown_nowhere(backend: Backend) {
    let h = Harness::new(backend).await;
    let key = "send_invoice_email/invoice:42:email:v1";
    h.provider.script_faults(key, vec![Fault::Drop; 5]);
    let mut job = NewJob::new(
        "send_invoice_email",
        br#"{"invoice_id": 42, "recipient": "ana@example.com"}"#.to_vec(),
    );
    job.max_attempts = 1;
    let id = h.store.job_insert(job).await.unwrap().id;

    let config = h.config_file(Duration::from_secs(5));
    let base = &h.provider.base_url;
    let text = std::fs::read_to_string(config.path()).unwrap().replace(
        &format!("base_url = \"{base}\""),
        &format!("base_url = \"{base}/hooks/T0/{SECRET_PATH}?api_key={SECRET_KEY}\""),
    );
    assert!(text.contains(SECRET_KEY), "the config names the secret URL");
    std::fs::write(config.path(), text).unwrap();
    let log = tempfile::NamedTempFile::new().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem-test"))
        .arg("--config")
        .arg(config.path())
        .args(["run", "--listen", &format!("127.0.0.1:{port}")])
        .env("IDEM_API_TOKEN", TOKEN)
        .env("IDEM_LOG", "info,idem=debug")
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-redaction-test-cache"),
        )
        .env_remove("IDEM_DATABASE_URL")
        .env_remove("IDEM_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(log.reopen().unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    let client = reqwest::Client::new();
    let api = format!("http://127.0.0.1:{port}");
    let mut json = serde_json::Value::Null;
    for _ in 0..600 {
        if let Ok(response) = client
            .get(format!("{api}/api/jobs/{}", id.0))
            .bearer_auth(TOKEN)
            .send()
            .await
            && response.status() == 200
        {
            json = response.json().await.unwrap();
            if json["state"] == "dead" {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(json["state"], "dead", "{json}");
    let page = client
        .get(format!("{api}/ui/jobs/{}", id.0))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let page = page.text().await.unwrap();
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let logged = std::fs::read_to_string(log.path()).unwrap();

    let stored = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(stored.state, JobState::Dead);
    let code = stored.last_error_code.clone().unwrap();
    assert!(code.starts_with("provider_"), "{code}");
    assert!(
        h.provider.requests(key) >= 1,
        "the request reached the provider"
    );
    assert_no_secret("the stored message", &format!("{stored:?}"));
    assert_no_secret("GET /api/jobs/{id}", &json.to_string());
    assert!(json.to_string().contains(&code), "{json}");
    assert_no_secret("/ui/jobs/{id}", &page);
    assert!(page.contains(&code), "{page}");
    assert_no_secret("the worker's log", &logged);
    assert!(logged.contains(&code), "the failure was logged: {logged}");
}

/// A row written before URLs were redacted (its message and its error
/// record quote a URL with a secret path, a query and a password) is
/// redacted when the store opens with the upgrade task pending, and the
/// task is done once.
async fn error_records_stored_before_the_redaction_are_redacted_at_open(backend: Backend) {
    let h = Harness::new(backend).await;
    let id = h
        .store
        .job_insert(NewJob::new("noop", b"{}".to_vec()))
        .await
        .unwrap()
        .id;
    let message = format!(
        "cannot connect: error sending request for url \
         (https://hooks.example/T0/{SECRET_PATH}?api_key={SECRET_KEY})"
    );
    let errors = serde_json::json!([
        {"attempt": 1, "class": "retryable", "code": "provider_unreachable",
         "message": message, "at_ms": 1},
        {"attempt": 2, "class": "permanent", "code": "sql_unavailable",
         "message": format!("postgres://app:{SECRET_KEY}@db:5432/billing refused"), "at_ms": 2},
    ])
    .to_string();
    let write = [
        "UPDATE jobs SET state = 'dead', last_error_code = 'provider_unreachable', \
         last_error_message = $1, errors = $2 WHERE id = $3",
        "INSERT INTO idem_upgrade_tasks (name) VALUES ('redact_error_urls') \
         ON CONFLICT DO NOTHING",
    ];
    match backend {
        Backend::Sqlite => {
            use sqlx::Connection;
            let mut conn = sqlx::SqliteConnection::connect(&h.url).await.unwrap();
            sqlx::query(write[0])
                .bind(&message)
                .bind(&errors)
                .bind(id.0)
                .execute(&mut conn)
                .await
                .unwrap();
            sqlx::query(write[1]).execute(&mut conn).await.unwrap();
        }
        Backend::Postgres => {
            use sqlx::Connection;
            let mut conn = sqlx::PgConnection::connect(&h.url).await.unwrap();
            sqlx::query(&write[0].replace("errors = $2", "errors = $2::jsonb"))
                .bind(&message)
                .bind(&errors)
                .bind(id.0)
                .execute(&mut conn)
                .await
                .unwrap();
            sqlx::query(write[1]).execute(&mut conn).await.unwrap();
        }
    }
    let before = h.store.job_get(id).await.unwrap().unwrap();
    assert!(
        before
            .last_error_message
            .as_deref()
            .unwrap()
            .contains(SECRET_KEY),
        "written raw"
    );

    let reopened = idem::store::open(&h.url, Clock::Adjustable).await.unwrap();
    let after = idem::store::Store::job_get(&reopened, id)
        .await
        .unwrap()
        .unwrap();
    assert_no_secret("the redacted row", &format!("{after:?}"));
    assert_eq!(
        after.last_error_message.as_deref(),
        Some("cannot connect: error sending request for url (https://hooks.example/\u{2026})")
    );
    assert_eq!(
        after.errors[1].message,
        "postgres://\u{2026}@db:5432/\u{2026} refused"
    );
    assert_eq!(
        (after.errors[0].at_ms, after.errors[1].code.as_str()),
        (1, "sql_unavailable"),
        "the rest of each record is kept"
    );
    let pending: i64 = match backend {
        Backend::Sqlite => {
            let pool = reopened.sqlite_pool().unwrap();
            sqlx::query_scalar("SELECT COUNT(*) FROM idem_upgrade_tasks")
                .fetch_one(pool)
                .await
                .unwrap()
        }
        Backend::Postgres => {
            let pool = reopened.postgres_pool().unwrap();
            sqlx::query_scalar("SELECT COUNT(*) FROM idem_upgrade_tasks")
                .fetch_one(pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(pending, 0, "the task is done once");
}

/// A node opens a SQLite file with the redaction pending while another node
/// is in the middle of a write: the pass waits for the write lock and the
/// node opens. (A deferred transaction read first, its snapshot went stale
/// when the other node committed, and its write failed at once with
/// `database is locked`: the node did not start.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_opening_a_sqlite_file_while_another_writes_still_redacts_and_opens() {
    use sqlx::Connection;
    let h = Harness::new(Backend::Sqlite).await;
    let jobs = (0..100)
        .map(|i| NewJob::new("noop", format!("{{\"i\":{i}}}").into_bytes()))
        .collect();
    h.store.job_insert_many(jobs).await.unwrap();
    let mut other_node = sqlx::SqliteConnection::connect(&h.url).await.unwrap();
    sqlx::query(
        "UPDATE jobs SET state = 'dead', last_error_code = 'provider_unreachable', \
         last_error_message = $1",
    )
    .bind(format!(
        "for url (https://hooks.example/T0/{SECRET_PATH}?api_key={SECRET_KEY})"
    ))
    .execute(&mut other_node)
    .await
    .unwrap();
    sqlx::query("INSERT INTO idem_upgrade_tasks (name) VALUES ('redact_error_urls')")
        .execute(&mut other_node)
        .await
        .unwrap();
    // The other node's write is under way when this node opens ...
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut other_node)
        .await
        .unwrap();
    sqlx::query("UPDATE jobs SET priority = 1 WHERE id = 1")
        .execute(&mut other_node)
        .await
        .unwrap();
    let url = h.url.clone();
    let opening =
        tokio::spawn(async move { idem::store::open(&url, Clock::Adjustable).await.map(|_| ()) });
    // ... and commits while the pass waits for the lock (real time: two
    // connections to one file, no clock to move).
    tokio::time::sleep(Duration::from_millis(500)).await;
    sqlx::query("COMMIT")
        .execute(&mut other_node)
        .await
        .unwrap();
    opening.await.unwrap().expect("the node opens the store");
    let left: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM jobs WHERE last_error_message LIKE '%' || $1 || '%'",
    )
    .bind(SECRET_KEY)
    .fetch_one(&mut other_node)
    .await
    .unwrap();
    assert_eq!(left, 0, "every row redacted");
}

both_backends!(
    a_failing_providers_secret_url_is_shown_nowhere,
    error_records_stored_before_the_redaction_are_redacted_at_open,
);
