//! Producers in any language enqueue inside their own transaction (issue
//! 27, part 1): on PostgreSQL through `idem_enqueue()` and
//! `idem_enqueue_many()` (migration 0013), on SQLite by inserting into the
//! view `idem_enqueue` (migration 0012).
//!
//! The producers are real clients nobody here wrote: Python's psycopg and
//! Node's node-postgres on PostgreSQL, Python's standard `sqlite3` on
//! SQLite (`tests/producers/`, installed by `scripts/setup`). Each saves a
//! business row and enqueues its job in one transaction: a rollback leaves
//! neither, a commit leaves both and the job runs through a real worker.
//! The checks of the SQL path are those of every other producer path: the
//! shared vectors (`tests/vectors/strings.json`) run through it here, so
//! the SQL rules and the Rust rules cannot drift apart.

use idem::boundary::vectors::{self, Expected};
use idem::store::{JobFilter, JobId, JobState, NewJob, Store};
use idem_tests::{Backend, Harness, both_backends};
use sqlx::{Connection, PgConnection, SqliteConnection};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The producer scripts.
fn producers() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("producers")
}

/// Runs a producer program; its stdout (the job id it printed).
async fn run_producer(program: &str, args: &[String], database_url: Option<&str>) -> i64 {
    let mut command = tokio::process::Command::new(program);
    command.args(args).current_dir(producers());
    if let Some(url) = database_url {
        command.env("DATABASE_URL", url);
    }
    let output = command
        .output()
        .await
        .unwrap_or_else(|e| panic!("start {program} (is it installed? scripts/setup): {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{program} {args:?} failed ({}); scripts/setup installs psycopg and node-postgres\nstdout: {stdout}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{program} printed {stdout:?}, not a job id: {e}"))
}

/// A database connection of another "process": what a producer holds.
enum Db {
    Pg(PgConnection),
    Lite(SqliteConnection),
}

async fn connect(h: &Harness) -> Db {
    if h.url.starts_with("postgres") {
        Db::Pg(
            PgConnection::connect(&h.url)
                .await
                .expect("a producer's PostgreSQL connection"),
        )
    } else {
        Db::Lite(
            SqliteConnection::connect(&h.url)
                .await
                .expect("a producer's SQLite connection"),
        )
    }
}

impl Db {
    async fn execute(&mut self, sql: &str) {
        match self {
            Db::Pg(conn) => sqlx::raw_sql(sql).execute(conn).await.map(|_| ()),
            Db::Lite(conn) => sqlx::raw_sql(sql).execute(conn).await.map(|_| ()),
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn count(&mut self, sql: &str) -> i64 {
        match self {
            Db::Pg(conn) => sqlx::query_scalar(sql).fetch_one(conn).await,
            Db::Lite(conn) => sqlx::query_scalar(sql).fetch_one(conn).await,
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Enqueues `job` in a transaction of its own, committed when it was
    /// accepted: the job's id, or the database's refusal.
    async fn enqueue(&mut self, job: &Enqueue) -> Result<i64, Refusal> {
        self.execute(match self {
            Db::Pg(_) => "BEGIN",
            Db::Lite(_) => "BEGIN IMMEDIATE",
        })
        .await;
        let got = match self {
            Db::Pg(conn) => sqlx::query_scalar(
                "SELECT idem_enqueue(plugin => $1, payload => $2::jsonb, key => $3, \
                     queue => $4, run_at => to_timestamp($5::bigint / 1000.0), \
                     priority => $6::integer, max_attempts => $7::integer, group_key => $8, \
                     correlation_id => $9)",
            )
            .bind(&job.plugin)
            .bind(&job.payload)
            .bind(&job.key)
            .bind(&job.queue)
            .bind(job.run_at_ms)
            .bind(job.priority)
            .bind(job.max_attempts)
            .bind(&job.group_key)
            .bind(&job.correlation_id)
            .fetch_one(&mut *conn)
            .await
            .map_err(refusal),
            Db::Lite(conn) => {
                let inserted = sqlx::query(
                    "INSERT INTO idem_enqueue (plugin, payload, key, queue, run_at, priority, \
                         max_attempts, group_key, correlation_id) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                )
                .bind(&job.plugin)
                .bind(&job.payload)
                .bind(&job.key)
                .bind(&job.queue)
                .bind(job.run_at_ms)
                .bind(job.priority)
                .bind(job.max_attempts)
                .bind(&job.group_key)
                .bind(&job.correlation_id)
                .execute(&mut *conn)
                .await;
                match inserted {
                    Ok(_) => Ok(sqlx::query_scalar("SELECT job_id FROM idem_enqueue_last")
                        .fetch_one(&mut *conn)
                        .await
                        .expect("the id of the job just enqueued")),
                    Err(e) => Err(refusal(e)),
                }
            }
        };
        self.execute(if got.is_ok() { "COMMIT" } else { "ROLLBACK" })
            .await;
        got
    }
}

/// The fields of `idem_enqueue` (NULL: the default).
#[derive(Debug, Clone, Default)]
struct Enqueue {
    plugin: Option<String>,
    /// JSON text.
    payload: Option<String>,
    key: Option<String>,
    queue: Option<String>,
    run_at_ms: Option<i64>,
    priority: Option<i64>,
    max_attempts: Option<i64>,
    group_key: Option<String>,
    correlation_id: Option<String>,
}

fn enqueue(plugin: &str) -> Enqueue {
    Enqueue {
        plugin: Some(plugin.into()),
        payload: Some("{}".into()),
        ..Enqueue::default()
    }
}

/// A refusal: the SQLSTATE (PostgreSQL) and the message.
#[derive(Debug)]
struct Refusal {
    code: Option<String>,
    message: String,
}

fn refusal(error: sqlx::Error) -> Refusal {
    match error {
        sqlx::Error::Database(e) => Refusal {
            code: e.code().map(|c| c.into_owned()),
            message: e.message().to_string(),
        },
        other => panic!("not a refusal by the database: {other}"),
    }
}

impl Refusal {
    /// Asserts this is idem's refusal of `field` (SQLSTATE 22023 on
    /// PostgreSQL; SQLite's RAISE has no code of its own).
    fn of(&self, backend: Backend, field: &str, case: &str) {
        assert!(
            self.message.starts_with(&format!("idem_enqueue: {field} ")),
            "{case}: {self:?} does not name {field}"
        );
        assert!(
            self.message.contains("refused") || self.message.contains("required"),
            "{case}: {self:?}"
        );
        if backend == Backend::Postgres {
            assert_eq!(self.code.as_deref(), Some("22023"), "{case}: {self:?}");
        }
        assert!(!self.message.contains('\0'), "the message prints safely");
    }
}

async fn job(store: &Arc<dyn Store>, id: i64) -> idem::store::Job {
    store
        .job_get(JobId(id))
        .await
        .expect("read a job")
        .unwrap_or_else(|| panic!("job {id} exists"))
}

async fn all_jobs(store: &Arc<dyn Store>) -> Vec<idem::store::Job> {
    store
        .job_list(JobFilter {
            limit: 10_000,
            ..JobFilter::default()
        })
        .await
        .expect("jobs")
}

const INVOICES: &str =
    "CREATE TABLE invoices (invoice_id BIGINT PRIMARY KEY, recipient TEXT NOT NULL)";

/// The email the send_invoice_email plugin sends for an invoice, as keyed
/// at the provider.
fn email_key(invoice_id: i64) -> String {
    format!("send_invoice_email/invoice:{invoice_id}:email:v1")
}

/// Checks the job a producer committed for `invoice_id`, before it runs.
async fn check_committed(h: &Harness, id: i64, invoice_id: i64, recipient: &str) {
    let job = job(&h.store, id).await;
    assert_eq!(job.plugin, "send_invoice_email");
    assert_eq!(job.queue, "default");
    assert_eq!(job.state, JobState::Available);
    assert_eq!(
        job.idempotency_key.as_deref(),
        Some(format!("invoice:{invoice_id}:email").as_str())
    );
    let payload: serde_json::Value =
        serde_json::from_slice(&job.payload).expect("the payload is JSON");
    assert_eq!(
        payload,
        serde_json::json!({"invoice_id": invoice_id, "recipient": recipient})
    );
    assert_eq!(job.max_attempts, None, "resolved when it is claimed");
}

/// Python (psycopg) and Node (node-postgres) producers on PostgreSQL: a
/// rollback leaves neither the invoice nor its job, a commit leaves both and
/// the job runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_producers_in_python_and_node_commit_or_roll_back_with_their_row() {
    let h = Harness::new(Backend::Postgres).await;
    let mut db = connect(&h).await;
    db.execute(INVOICES).await;
    let producers: [(&str, &str); 2] = [
        ("python3", "postgres_enqueue.py"),
        ("node", "node/enqueue.mjs"),
    ];
    let mut committed = Vec::new();
    for (n, (program, script)) in producers.into_iter().enumerate() {
        let base = 100 * (n as i64 + 1);
        let recipient = format!("{program}@example.com");
        let args = |mode: &str, invoice: i64| {
            vec![
                script.to_string(),
                mode.to_string(),
                invoice.to_string(),
                recipient.clone(),
            ]
        };
        let rolled_back = run_producer(program, &args("rollback", base + 1), Some(&h.url)).await;
        assert!(
            h.store.job_get(JobId(rolled_back)).await.unwrap().is_none(),
            "{program}: the rolled-back job {rolled_back} does not exist"
        );
        assert_eq!(
            db.count(&format!(
                "SELECT count(*) FROM invoices WHERE invoice_id = {}",
                base + 1
            ))
            .await,
            0,
            "{program}: nor does its invoice"
        );
        let id = run_producer(program, &args("commit", base + 2), Some(&h.url)).await;
        check_committed(&h, id, base + 2, &recipient).await;
        assert_eq!(
            db.count(&format!(
                "SELECT count(*) FROM invoices WHERE invoice_id = {}",
                base + 2
            ))
            .await,
            1,
            "{program}: the invoice committed with its job"
        );
        committed.push((id, base + 2));
    }
    assert_eq!(all_jobs(&h.store).await.len(), 2, "only the committed jobs");

    let stats = h.drain().await;
    assert_eq!(stats.succeeded, 2, "{stats:?}");
    for (id, invoice) in committed {
        let job = job(&h.store, id).await;
        assert_eq!(job.state, JobState::Succeeded);
        assert_eq!(job.max_attempts, Some(5), "the worker's max_attempts");
        assert_eq!(h.provider.applied(&email_key(invoice)), 1, "one email");
    }
}

/// Python's `sqlite3` on the store's own file, through the view: a
/// rollback leaves neither the invoice nor its job, a commit leaves both
/// and the job runs (the worker finds it at its next poll: SQLite wakes
/// only the process that wrote).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_producer_in_python_commits_or_rolls_back_with_its_row() {
    let h = Harness::new(Backend::Sqlite).await;
    let path = h
        .url
        .strip_prefix("sqlite://")
        .expect("a SQLite file URL")
        .to_string();
    let mut db = connect(&h).await;
    db.execute(INVOICES).await;
    let args = |mode: &str, invoice: i64| {
        vec![
            "sqlite_enqueue.py".to_string(),
            path.clone(),
            mode.to_string(),
            invoice.to_string(),
            "ana@example.com".to_string(),
        ]
    };
    // A job enqueued the Rust way first, so the rolled-back one cannot
    // take an id nobody ever had.
    let earlier = h
        .store
        .job_insert(NewJob::new("noop", b"{}".to_vec()))
        .await
        .unwrap()
        .id;
    let rolled_back = run_producer("python3", &args("rollback", 1), None).await;
    assert!(
        rolled_back > earlier.0,
        "the id the job had in its transaction"
    );
    assert!(
        h.store.job_get(JobId(rolled_back)).await.unwrap().is_none(),
        "the rolled-back job does not exist"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM invoices").await,
        0,
        "nor does its invoice"
    );
    let id = run_producer("python3", &args("commit", 2), None).await;
    check_committed(&h, id, 2, "ana@example.com").await;
    assert_eq!(
        db.count("SELECT count(*) FROM invoices WHERE invoice_id = 2")
            .await,
        1
    );
    let again = run_producer("python3", &args("commit", 3), None).await;
    assert_ne!(again, id, "invoice 3 is another job");
    assert_eq!(all_jobs(&h.store).await.len(), 3, "the Rust job and two");

    let stats = h.drain().await;
    assert_eq!(stats.succeeded, 3, "{stats:?}");
    for (id, invoice) in [(id, 2), (again, 3)] {
        assert_eq!(job(&h.store, id).await.state, JobState::Succeeded);
        assert_eq!(job(&h.store, id).await.max_attempts, Some(5));
        assert_eq!(h.provider.applied(&email_key(invoice)), 1, "one email");
    }
}

/// `max_attempts => NULL`: the claim resolves it, from the plugin's
/// operator file, else the worker's `max_attempts`, and the dead-letter
/// decision reads that number. A number the producer gave is kept.
async fn max_attempts_null_is_resolved_when_the_job_is_claimed(backend: Backend) {
    let h = Harness::new(backend).await;
    h.set_manifest("hostile_panic", "max_attempts = 2\n");
    let mut db = connect(&h).await;
    let default = db.enqueue(&enqueue("noop")).await.unwrap();
    let own = db.enqueue(&enqueue("hostile_panic")).await.unwrap();
    let given = db
        .enqueue(&Enqueue {
            max_attempts: Some(3),
            ..enqueue("hostile_panic")
        })
        .await
        .unwrap();
    for id in [default, own] {
        assert_eq!(job(&h.store, id).await.max_attempts, None);
    }
    assert_eq!(job(&h.store, given).await.max_attempts, Some(3));
    h.drain().await;
    let default = job(&h.store, default).await;
    assert_eq!(default.state, JobState::Succeeded);
    assert_eq!(default.max_attempts, Some(5), "the worker's max_attempts");
    let own = job(&h.store, own).await;
    assert_eq!(own.state, JobState::Dead);
    assert_eq!(own.max_attempts, Some(2), "the plugin's file");
    assert_eq!(own.attempt, 2, "dead after the plugin's attempts");
    assert_eq!(own.last_error_code.as_deref(), Some("plugin_panic"));
    let given = job(&h.store, given).await;
    assert_eq!(given.state, JobState::Dead);
    assert_eq!((given.attempt, given.max_attempts), (3, Some(3)));
}

/// The shared vectors of names, keys and correlation ids, through the SQL
/// path: what the Rust rule accepts is stored as it is, what it refuses is
/// refused naming the field, and stores nothing.
async fn the_sql_path_follows_the_shared_vectors(backend: Backend) {
    let h = Harness::new(backend).await;
    let mut db = connect(&h).await;
    type Set = fn(&mut Enqueue, String);
    let fields: [(&str, &str, Set); 5] = [
        ("name", "queue", |e, v| e.queue = Some(v)),
        ("name", "plugin", |e, v| e.plugin = Some(v)),
        ("idempotency_key", "key", |e, v| e.key = Some(v)),
        ("idempotency_key", "group_key", |e, v| e.group_key = Some(v)),
        ("correlation_id", "correlation_id", |e, v| {
            e.correlation_id = Some(v)
        }),
    ];
    let mut stored = BTreeSet::new();
    for (rule, field, set) in fields {
        for case in vectors::of(rule) {
            let mut job = enqueue("noop");
            set(&mut job, case.input.clone());
            let note = format!("{field} {}", case.note);
            let got = db.enqueue(&job).await;
            match case.expected {
                Expected::Accepted => {
                    let id = got.unwrap_or_else(|e| panic!("{note}: {e:?}"));
                    let row = self::job(&h.store, id).await;
                    let kept = match field {
                        "queue" => row.queue,
                        "plugin" => row.plugin,
                        "key" => row.idempotency_key.unwrap_or_default(),
                        "group_key" => row.group.unwrap_or_default(),
                        _ => row.correlation_id,
                    };
                    assert_eq!(kept, case.input, "{note}");
                    stored.insert(id);
                }
                Expected::Refused => {
                    let refused = got.expect_err(&note);
                    if backend == Backend::Postgres && case.input.contains('\0') {
                        // PostgreSQL text cannot hold a NUL: the server
                        // refuses the value before the function sees it.
                        assert_eq!(refused.code.as_deref(), Some("22021"), "{note}");
                    } else {
                        refused.of(backend, field, &note);
                    }
                }
                Expected::Cleaned(_) => panic!("{note}: never cleaned"),
            }
        }
    }
    let all = all_jobs(&h.store).await;
    assert_eq!(
        all.iter().map(|j| j.id.0).collect::<BTreeSet<_>>(),
        stored,
        "refused inputs stored nothing"
    );

    // The payload limit, to the byte (a JSON string's text).
    let string_of = |bytes: usize| format!("\"{}\"", "x".repeat(bytes - 2));
    let limit = idem::store::MAX_PAYLOAD_BYTES;
    let at = db
        .enqueue(&Enqueue {
            payload: Some(string_of(limit)),
            ..enqueue("noop")
        })
        .await
        .expect("a payload of exactly the limit");
    assert_eq!(job(&h.store, at).await.payload.len(), limit);
    db.enqueue(&Enqueue {
        payload: Some(string_of(limit + 1)),
        ..enqueue("noop")
    })
    .await
    .expect_err("one byte over")
    .of(backend, "payload", "one byte over");
}

/// Every kind of bad input is refused, classified and naming its field,
/// inserts nothing, and leaves the other jobs as they were.
async fn bad_input_is_refused_and_changes_nothing(backend: Backend) {
    let h = Harness::new(backend).await;
    let mut db = connect(&h).await;
    let good = db
        .enqueue(&Enqueue {
            key: Some("good".into()),
            ..enqueue("noop")
        })
        .await
        .unwrap();
    let before = job(&h.store, good).await;
    let century_ms = 100 * 365 * 24 * 3600 * 1000_i64;
    let far = h.store.clock_now().await.unwrap() + century_ms + 60_000;
    let pg = backend == Backend::Postgres;
    // (case, input, the field named, or on PostgreSQL the SQLSTATE of the
    // type that refuses it before the function runs)
    let cases: Vec<(&str, Enqueue, &str)> = vec![
        (
            "no plugin",
            Enqueue {
                plugin: None,
                ..enqueue("noop")
            },
            "plugin",
        ),
        ("a plugin with a slash", enqueue("no/slash"), "plugin"),
        (
            "an empty queue",
            Enqueue {
                queue: Some(String::new()),
                ..enqueue("noop")
            },
            "queue",
        ),
        (
            "no payload",
            Enqueue {
                payload: None,
                ..enqueue("noop")
            },
            "payload",
        ),
        (
            "a payload that is not JSON",
            Enqueue {
                payload: Some("{nope".into()),
                ..enqueue("noop")
            },
            if pg { "22P02" } else { "payload" },
        ),
        (
            "a payload over the limit",
            Enqueue {
                payload: Some(format!(
                    "[\"{}\"]",
                    "x".repeat(idem::store::MAX_PAYLOAD_BYTES)
                )),
                ..enqueue("noop")
            },
            "payload",
        ),
        (
            "an empty key",
            Enqueue {
                key: Some(String::new()),
                ..enqueue("noop")
            },
            "key",
        ),
        (
            "a key of 256 bytes",
            Enqueue {
                key: Some("k".repeat(256)),
                ..enqueue("noop")
            },
            "key",
        ),
        (
            "a key with an escape sequence",
            Enqueue {
                key: Some("\u{1b}[2J".into()),
                ..enqueue("noop")
            },
            "key",
        ),
        (
            "a group with a bell",
            Enqueue {
                group_key: Some("order\u{7}".into()),
                ..enqueue("noop")
            },
            "group_key",
        ),
        (
            "an empty correlation id",
            Enqueue {
                correlation_id: Some(String::new()),
                ..enqueue("noop")
            },
            "correlation_id",
        ),
        (
            "no attempts",
            Enqueue {
                max_attempts: Some(0),
                ..enqueue("noop")
            },
            "max_attempts",
        ),
        (
            "a priority out of range",
            Enqueue {
                priority: Some(1 << 40),
                ..enqueue("noop")
            },
            if pg { "22003" } else { "priority" },
        ),
        (
            "a run_at more than 100 years ahead",
            Enqueue {
                run_at_ms: Some(far),
                ..enqueue("noop")
            },
            "run_at",
        ),
    ];
    for (case, input, field) in cases {
        let refused = db.enqueue(&input).await.expect_err(case);
        if field.starts_with('2') {
            assert_eq!(refused.code.as_deref(), Some(field), "{case}: {refused:?}");
        } else {
            refused.of(backend, field, case);
        }
    }
    assert_eq!(
        all_jobs(&h.store).await,
        vec![before],
        "nothing else changed"
    );
}

/// The bulk form: `idem_enqueue_many(jsonb)` on PostgreSQL returns the ids
/// in input order (a key repeated in the batch or already held resolves to
/// that job); one bad element refuses the call naming its index. On SQLite
/// a multi-row insert into the view does the same, all or nothing.
async fn bulk_enqueue_keeps_input_order_and_is_all_or_nothing(backend: Backend) {
    let h = Harness::new(backend).await;
    let mut db = connect(&h).await;
    let existing = h
        .store
        .job_insert(NewJob {
            idempotency_key: Some("held".into()),
            ..NewJob::new("noop", b"{}".to_vec())
        })
        .await
        .unwrap()
        .id
        .0;
    let run_at_ms = 1_900_000_000_000_i64; // 2030-03-17T17:46:40Z
    let bad_batch_refused = match &mut db {
        Db::Pg(conn) => {
            let batch = serde_json::json!([
                {"plugin": "noop", "payload": {"n": 0}, "key": "a"},
                {"plugin": "noop", "payload": {"n": 1}, "queue": "billing", "priority": 3,
                 "run_at": "2030-03-17T17:46:40Z", "max_attempts": 2, "group_key": "order-7",
                 "correlation_id": "corr-1"},
                {"plugin": "noop", "payload": {"n": 2}, "key": "a"},
                {"plugin": "noop", "payload": {"n": 3}, "key": "held"},
                {"plugin": "noop", "payload": null}
            ]);
            let ids: Vec<i64> = sqlx::query_scalar("SELECT idem_enqueue_many($1::jsonb)")
                .bind(batch.to_string())
                .fetch_one(&mut *conn)
                .await
                .expect("a batch");
            assert_eq!(ids.len(), 5);
            assert_eq!(ids[0], ids[2], "a key repeated in the batch");
            assert_eq!(ids[3], existing, "a key already held");
            assert!(
                ids[0] < ids[1] && ids[1] < ids[4],
                "new jobs in input order"
            );
            let second = job(&h.store, ids[1]).await;
            assert_eq!(
                (
                    second.queue.as_str(),
                    second.priority,
                    second.run_at_ms,
                    second.max_attempts,
                    second.group.as_deref(),
                    second.correlation_id.as_str()
                ),
                ("billing", 3, run_at_ms, Some(2), Some("order-7"), "corr-1")
            );
            assert_eq!(job(&h.store, ids[4]).await.payload, b"null");
            let bad = serde_json::json!([
                {"plugin": "noop", "payload": {}, "key": "b"},
                {"plugin": "noop", "payload": {}},
                {"plugin": "noop", "payload": {}, "key": ""}
            ]);
            let refused = sqlx::query_scalar::<_, Vec<i64>>("SELECT idem_enqueue_many($1::jsonb)")
                .bind(bad.to_string())
                .fetch_one(&mut *conn)
                .await
                .map_err(refusal)
                .expect_err("an empty key in element 2");
            assert_eq!(refused.code.as_deref(), Some("22023"), "{refused:?}");
            assert!(
                refused
                    .message
                    .starts_with("idem_enqueue_many: element 2: key \"\" refused: it is empty"),
                "{refused:?}"
            );
            for (bad, why) in [
                (serde_json::json!({"plugin": "noop"}), "not an array"),
                (
                    serde_json::json!([{"plugin": "noop", "payload": {}, "kye": "x"}]),
                    "unknown field \"kye\"",
                ),
                (
                    serde_json::json!([{"plugin": "noop", "payload": {}, "priority": "high"}]),
                    "priority must be a JSON number",
                ),
                (
                    serde_json::json!([{"plugin": "noop", "payload": {}, "run_at": "soon"}]),
                    "run_at \"soon\" refused",
                ),
            ] {
                let refused =
                    sqlx::query_scalar::<_, Vec<i64>>("SELECT idem_enqueue_many($1::jsonb)")
                        .bind(bad.to_string())
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(refusal)
                        .expect_err(why);
                assert_eq!(refused.code.as_deref(), Some("22023"), "{refused:?}");
                assert!(
                    refused.message.contains(why)
                        || (why == "not an array" && refused.message.contains("JSON array")),
                    "{why}: {refused:?}"
                );
            }
            // The held job, and the new jobs of elements 0, 1 and 4.
            4
        }
        Db::Lite(conn) => {
            let many = "INSERT INTO idem_enqueue (plugin, payload, key, queue, run_at, priority, \
                            max_attempts, group_key) VALUES \
                        ('noop', '{\"n\":0}', 'a', NULL, NULL, NULL, NULL, NULL), \
                        ('noop', '{\"n\":1}', NULL, 'billing', $1, 3, 2, 'order-7'), \
                        ('noop', '{\"n\":2}', 'held', NULL, NULL, NULL, NULL, NULL)";
            sqlx::raw_sql("BEGIN IMMEDIATE")
                .execute(&mut *conn)
                .await
                .unwrap();
            sqlx::query(many)
                .bind(run_at_ms)
                .execute(&mut *conn)
                .await
                .expect("three rows");
            let last: i64 = sqlx::query_scalar("SELECT job_id FROM idem_enqueue_last")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            sqlx::raw_sql("COMMIT").execute(&mut *conn).await.unwrap();
            assert_eq!(last, existing, "the last row named the held key's job");
            let jobs = all_jobs(&h.store).await;
            assert_eq!(jobs.len(), 3, "the held key added nothing");
            let second = jobs
                .iter()
                .find(|j| j.queue == "billing")
                .expect("the second row");
            assert_eq!(
                (
                    second.priority,
                    second.run_at_ms,
                    second.max_attempts,
                    second.group.as_deref()
                ),
                (3, run_at_ms, Some(2), Some("order-7"))
            );
            let refused = sqlx::query(
                "INSERT INTO idem_enqueue (plugin, payload, key) VALUES \
                 ('noop', '{}', 'b'), ('noop', '{}', NULL), ('noop', '{}', '')",
            )
            .execute(&mut *conn)
            .await
            .map_err(refusal)
            .expect_err("an empty key in the third row");
            refused.of(backend, "key", "the third row");
            3
        }
    };
    assert_eq!(
        all_jobs(&h.store).await.len(),
        bad_batch_refused,
        "a refused batch inserted nothing"
    );
}

both_backends!(
    max_attempts_null_is_resolved_when_the_job_is_claimed,
    the_sql_path_follows_the_shared_vectors,
    bad_input_is_refused_and_changes_nothing,
    bulk_enqueue_keeps_input_order_and_is_all_or_nothing,
);

/// Two transactions enqueue the same key: the second waits for the first's
/// uncommitted row, then gets its id (first committed) or inserts the job
/// itself (first rolled back). One job either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_the_same_key_from_two_transactions_is_one_job() {
    let h = Harness::new(Backend::Postgres).await;
    for first_commits in [true, false] {
        let key = format!("race-{first_commits}");
        let sql = "SELECT idem_enqueue(plugin => 'noop', payload => '{}', key => $1)";
        let mut first = PgConnection::connect(&h.url).await.unwrap();
        let mut second = PgConnection::connect(&h.url).await.unwrap();
        let mut watcher = PgConnection::connect(&h.url).await.unwrap();
        let second_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut second)
            .await
            .unwrap();
        sqlx::raw_sql("BEGIN").execute(&mut first).await.unwrap();
        let first_id: i64 = sqlx::query_scalar(sql)
            .bind(&key)
            .fetch_one(&mut first)
            .await
            .unwrap();
        let waiting = {
            let key = key.clone();
            tokio::spawn(async move {
                let mut tx = second.begin().await.unwrap();
                let id: i64 = sqlx::query_scalar(sql)
                    .bind(&key)
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                id
            })
        };
        // The second transaction waits on the first one's row.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let blocked: Option<String> =
                sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                    .bind(second_pid)
                    .fetch_one(&mut watcher)
                    .await
                    .unwrap();
            if blocked.as_deref() == Some("Lock") {
                break;
            }
            assert!(!waiting.is_finished(), "the second enqueue did not wait");
            assert!(tokio::time::Instant::now() < deadline, "never blocked");
            h.store.wait_for_jobs(Duration::from_millis(10)).await;
        }
        let end = if first_commits { "COMMIT" } else { "ROLLBACK" };
        sqlx::raw_sql(end).execute(&mut first).await.unwrap();
        let second_id = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("the second enqueue ends")
            .unwrap();
        let keyed: Vec<i64> = all_jobs(&h.store)
            .await
            .into_iter()
            .filter(|j| j.idempotency_key.as_deref() == Some(key.as_str()))
            .map(|j| j.id.0)
            .collect();
        assert_eq!(keyed, vec![second_id], "one job holds {key}");
        if first_commits {
            assert_eq!(second_id, first_id, "the first one's job");
        } else {
            assert_ne!(second_id, first_id, "the first one's job never existed");
        }
    }
}

/// The function's insert wakes workers like any other: the trigger's
/// notification (channel `idem_jobs`, the queue as payload) is sent when
/// the producer commits, and not for a rollback. Queues of their own tell
/// these notifications from other tests' on the same database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_committed_enqueue_notifies_the_workers() {
    let h = Harness::new(Backend::Postgres).await;
    let mut listener = sqlx::postgres::PgListener::connect(&h.url).await.unwrap();
    listener
        .listen(idem::store::postgres::CHANNEL)
        .await
        .unwrap();
    let mut db = connect(&h).await;
    let tag = hex::encode(rand::random::<[u8; 6]>());
    let (rolled_back, committed) = (format!("rolled-back-{tag}"), format!("committed-{tag}"));
    if let Db::Pg(conn) = &mut db {
        sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
        sqlx::query("SELECT idem_enqueue(plugin => 'noop', payload => '{}', queue => $1)")
            .bind(&rolled_back)
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
    }
    db.enqueue(&Enqueue {
        queue: Some(committed.clone()),
        ..enqueue("noop")
    })
    .await
    .unwrap();
    // Notifications arrive in commit order: the rolled-back one would
    // come first.
    loop {
        let notification = tokio::time::timeout(Duration::from_secs(30), listener.recv())
            .await
            .expect("the commit notifies within 30 s")
            .expect("a notification");
        assert_ne!(
            notification.payload(),
            rolled_back,
            "a rolled-back enqueue wakes nobody"
        );
        if notification.payload() == committed {
            break;
        }
    }
    // And a store waiting for jobs (an hour, no polling) is woken too.
    h.store.wait_for_jobs(Duration::ZERO).await;
    let waiter = {
        let store = h.store.clone();
        tokio::spawn(async move { store.wait_for_jobs(Duration::from_secs(3600)).await })
    };
    db.enqueue(&enqueue("noop")).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("woken by the producer's commit")
        .unwrap();
}

/// The README's snippets are the tested producers' code, word for word.
#[test]
fn the_readme_snippets_are_the_tested_code() {
    let readme =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .expect("README.md");
    for script in [
        "postgres_enqueue.py",
        "node/enqueue.mjs",
        "sqlite_enqueue.py",
    ] {
        let text = std::fs::read_to_string(producers().join(script)).expect("a producer");
        let (_, rest) = text
            .split_once("readme:start\n")
            .unwrap_or_else(|| panic!("{script}: no readme:start"));
        let (snippet, _) = rest
            .rsplit_once("readme:end")
            .unwrap_or_else(|| panic!("{script}: no readme:end"));
        // Up to the marker's comment sign on its own line.
        let snippet = snippet
            .rsplit_once('\n')
            .map_or(snippet, |(body, _)| body)
            .trim_end();
        assert!(
            readme.contains(snippet),
            "README.md does not hold the snippet of tests/producers/{script}:\n{snippet}"
        );
    }
}
