//! Statements of `sql` effects on the store's own database: the statement
//! and the ledger's `succeeded` commit together or not at all.

use super::*;
use idem::store::{
    BackendKind, EffectClaim, EffectFence, EffectStatus, Fence, Job, JobChange, JobFence,
    StatementCall, StatementOutcome, StatementParams, Write, Written,
};
use idem_sdk::SqlValue;

/// A fresh key claimed by a worker holding a job.
async fn fence(store: &Arc<dyn Store>, key: &str, worker: &str) -> EffectFence {
    let params = claim_by(&hold(store, worker).await, key, LONG);
    match store.effect_claim(params).await.unwrap() {
        EffectClaim::Claimed { fence } => fence,
        other => panic!("expected a claim, got {other:?}"),
    }
}

async fn run(
    store: &Arc<dyn Store>,
    fence: EffectFence,
    sql: &str,
    params: Vec<SqlValue>,
) -> StatementOutcome {
    store
        .effect_succeed_with_statement(StatementParams {
            fence,
            call: StatementCall::new("s", sql, params),
            finish: None,
        })
        .await
        .unwrap()
}

/// Runs `sql` under a fresh key and expects it applied; returns its ref.
async fn applied(
    store: &Arc<dyn Store>,
    key: &str,
    sql: &str,
    params: Vec<SqlValue>,
) -> Option<String> {
    let fence = fence(store, key, "setup").await;
    match run(store, fence, sql, params).await {
        StatementOutcome::Applied {
            result_ref,
            finish: None,
        } => result_ref,
        other => panic!("{sql}: {other:?}"),
    }
}

/// The business table, created through the store's own statement path.
async fn invoices(store: &Arc<dyn Store>) {
    let id = match store.backend() {
        BackendKind::Postgres => "id BIGSERIAL PRIMARY KEY",
        BackendKind::Sqlite => "id INTEGER PRIMARY KEY",
    };
    let ddl = format!(
        "CREATE TABLE invoices ({id}, order_id TEXT NOT NULL UNIQUE, \
         amount_cents BIGINT NOT NULL, paid BOOLEAN, note TEXT)"
    );
    applied(store, "setup:ddl", &ddl, vec![]).await;
}

/// How many invoice rows there are (read through a statement as well).
async fn count(store: &Arc<dyn Store>, key: &str) -> String {
    applied(
        store,
        key,
        "SELECT CAST(count(*) AS TEXT) FROM invoices",
        vec![],
    )
    .await
    .unwrap_or_default()
}

const CREATE: &str = "INSERT INTO invoices (order_id, amount_cents, paid) VALUES ($1, $2, $3) \
                      ON CONFLICT (order_id) DO NOTHING RETURNING id";

pub async fn statement_commits_with_its_ledger_row(store: Arc<dyn Store>) {
    invoices(&store).await;
    let fence = fence(&store, "order:1:invoice", "w").await;
    let outcome = run(
        &store,
        fence.clone(),
        CREATE,
        vec!["o-1".into(), 1250.into(), true.into()],
    )
    .await;
    let StatementOutcome::Applied {
        result_ref: Some(id),
        finish: None,
    } = outcome
    else {
        panic!("expected an invoice id, got {outcome:?}");
    };
    let row = store.effect_get("order:1:invoice").await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Succeeded);
    assert_eq!(
        row.result_ref.as_deref(),
        Some(id.as_str()),
        "the id from RETURNING"
    );
    assert_eq!(count(&store, "read:1").await, "1");

    // Done: the same claim again is fenced out and runs nothing.
    assert_eq!(
        run(
            &store,
            fence,
            CREATE,
            vec!["o-1b".into(), 1.into(), true.into()]
        )
        .await,
        StatementOutcome::FencedOut
    );
    assert_eq!(
        count(&store, "read:2").await,
        "1",
        "the stale run inserted nothing"
    );
    // A statement that changes nothing is a success without a reference.
    let again = applied(
        &store,
        "order:1:again",
        CREATE,
        vec!["o-1".into(), 1250.into(), true.into()],
    )
    .await;
    assert_eq!(again, None);
    assert_eq!(count(&store, "read:3").await, "1");
}

pub async fn statement_of_a_stale_claim_runs_nothing(store: Arc<dyn Store>) {
    invoices(&store).await;
    let stale = fence(&store, "order:2:invoice", "a").await;
    let taken_over = EffectFence {
        attempt: stale.attempt + 1,
        ..stale.clone()
    };
    assert_eq!(
        run(
            &store,
            taken_over,
            CREATE,
            vec!["o-2".into(), 5.into(), false.into()]
        )
        .await,
        StatementOutcome::FencedOut,
        "a fence that does not match the row runs nothing"
    );
    assert_eq!(count(&store, "read").await, "0");
    let row = store.effect_get("order:2:invoice").await.unwrap().unwrap();
    assert_eq!(
        row.status,
        EffectStatus::Processing,
        "the real claim is untouched"
    );
}

pub async fn refused_statement_rolls_back_the_ledger_mark(store: Arc<dyn Store>) {
    invoices(&store).await;
    applied(
        &store,
        "setup:o-3",
        CREATE,
        vec!["o-3".into(), 1.into(), true.into()],
    )
    .await;
    // No ON CONFLICT: the business constraint refuses a second row.
    let fence = fence(&store, "order:3:invoice", "w").await;
    let outcome = run(
        &store,
        fence,
        "INSERT INTO invoices (order_id, amount_cents) VALUES ($1, $2)",
        vec!["o-3".into(), 2.into()],
    )
    .await;
    let StatementOutcome::Refused(failure) = outcome else {
        panic!("expected a refusal, got {outcome:?}");
    };
    assert_eq!(failure.code, "sql_constraint_violation", "{failure:?}");
    assert_eq!(failure.class, ErrorClass::Permanent);
    let row = store.effect_get("order:3:invoice").await.unwrap().unwrap();
    assert_eq!(
        row.status,
        EffectStatus::Processing,
        "the succeeded mark was rolled back with the statement"
    );
    assert_eq!(count(&store, "read").await, "1");
}

pub async fn statement_parameters_are_checked_and_bound(store: Arc<dyn Store>) {
    invoices(&store).await;
    // Too few values: refused before anything runs.
    let fence_a = fence(&store, "order:4:a", "w").await;
    let StatementOutcome::Refused(failure) = run(&store, fence_a, CREATE, vec!["o-4".into()]).await
    else {
        panic!("a missing parameter is refused");
    };
    assert_eq!(failure.code, "sql_params_invalid", "{failure:?}");

    // A hostile value stays a value.
    let hostile = "o-5'); DROP TABLE invoices; --";
    applied(
        &store,
        "order:5:invoice",
        "INSERT INTO invoices (order_id, amount_cents, note) VALUES ($1, $2, $3) RETURNING order_id",
        vec![hostile.into(), 3.into(), SqlValue::Null],
    )
    .await
    .filter(|stored| stored == hostile)
    .expect("the text is stored as it was sent");
    assert_eq!(
        count(&store, "read:1").await,
        "1",
        "the table is still there"
    );

    if store.backend() == BackendKind::Postgres {
        // PostgreSQL knows each placeholder's type: text for a bigint is refused.
        let fence_b = fence(&store, "order:6:a", "w").await;
        let StatementOutcome::Refused(failure) = run(
            &store,
            fence_b,
            CREATE,
            vec!["o-6".into(), "twelve".into(), true.into()],
        )
        .await
        else {
            panic!("a text for a bigint is refused");
        };
        assert_eq!(failure.code, "sql_params_invalid", "{failure:?}");
        assert!(failure.message.contains("$2"), "{}", failure.message);
        // A numeric and a JSON value go as their own types.
        applied(
            &store,
            "setup:typed",
            "CREATE TABLE typed (amount NUMERIC(12, 2), doc JSONB)",
            vec![],
        )
        .await;
        let amount = applied(
            &store,
            "order:7:typed",
            "INSERT INTO typed (amount, doc) VALUES ($1, $2) RETURNING amount",
            vec![
                SqlValue::Numeric("12.50".into()),
                SqlValue::Json(serde_json::json!({"a": 1})),
            ],
        )
        .await;
        assert_eq!(amount.as_deref(), Some("12.50"));
    }
    assert_eq!(count(&store, "read:2").await, "1");
}

pub async fn statement_the_database_cannot_run_is_permanent(store: Arc<dyn Store>) {
    let fence = fence(&store, "order:8:invoice", "w").await;
    let StatementOutcome::Refused(failure) = run(
        &store,
        fence,
        "INSERT INTO no_such_table (x) VALUES ($1)",
        vec![1.into()],
    )
    .await
    else {
        panic!("an unknown table is refused");
    };
    assert_eq!(failure.code, "sql_statement_invalid", "{failure:?}");
    assert_eq!(failure.class, ErrorClass::Permanent);
    let row = store.effect_get("order:8:invoice").await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Processing);
}

pub async fn statement_past_its_timeout_is_rolled_back_and_retryable(store: Arc<dyn Store>) {
    invoices(&store).await;
    let fence = fence(&store, "order:9:invoice", "w").await;
    // A statement that writes, then runs long.
    let slow = match store.backend() {
        BackendKind::Postgres => {
            "WITH ins AS (INSERT INTO invoices (order_id, amount_cents) VALUES ($1, 1) RETURNING id) \
             SELECT id FROM ins, pg_sleep(5)"
        }
        BackendKind::Sqlite => {
            "INSERT INTO invoices (order_id, amount_cents) \
             SELECT $1, (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 300000000) \
             SELECT count(*) FROM c) RETURNING id"
        }
    };
    let outcome = store
        .effect_succeed_with_statement(StatementParams {
            fence,
            call: StatementCall {
                timeout: Duration::from_millis(300),
                ..StatementCall::new("slow", slow, vec!["o-9".into()])
            },
            finish: None,
        })
        .await
        .unwrap();
    let StatementOutcome::Refused(failure) = outcome else {
        panic!("expected a timeout, got {outcome:?}");
    };
    assert_eq!(failure.code, "sql_timeout", "{failure:?}");
    assert_eq!(failure.class, ErrorClass::Retryable);
    let row = store.effect_get("order:9:invoice").await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Processing, "rolled back");
    // The store works on after the abandoned statement.
    assert_eq!(count(&store, "read").await, "0");
}

/// A job holding a fresh key, and the key's claim.
async fn job_with_key(store: &Arc<dyn Store>, key: &str) -> (Job, EffectFence) {
    let job = hold(store, "w").await;
    let fence = match store.effect_claim(claim_by(&job, key, LONG)).await.unwrap() {
        EffectClaim::Claimed { fence } => fence,
        other => panic!("expected a claim, got {other:?}"),
    };
    (job, fence)
}

fn success(fence: JobFence) -> Write {
    Write::Job {
        fence,
        change: JobChange::Succeed {
            plugin_hash: None,
            plan: None,
        },
    }
}

async fn run_finishing(
    store: &Arc<dyn Store>,
    fence: EffectFence,
    params: Vec<SqlValue>,
    finish: Write,
) -> idem::store::Result<StatementOutcome> {
    store
        .effect_succeed_with_statement(StatementParams {
            fence,
            call: StatementCall::new("s", CREATE, params),
            finish: Some(finish),
        })
        .await
}

/// The last effect of a plan: statement, ledger row and the job's success
/// in one commit.
pub async fn statement_commits_the_jobs_success_with_it(store: Arc<dyn Store>) {
    invoices(&store).await;
    let (job, fence) = job_with_key(&store, "order:7:invoice").await;
    let outcome = run_finishing(
        &store,
        fence,
        vec!["o-7".into(), 700.into(), true.into()],
        success(job.fence()),
    )
    .await
    .unwrap();
    let StatementOutcome::Applied {
        result_ref: Some(_),
        finish: Some(Written::Job(Fence::Applied)),
    } = outcome
    else {
        panic!("expected the statement and the job's success, got {outcome:?}");
    };
    assert_eq!(
        get(&store, job.id).await.state,
        idem::store::JobState::Succeeded
    );
    let row = store.effect_get("order:7:invoice").await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Succeeded);
    assert_eq!(count(&store, "read").await, "1");
}

/// A job taken over meanwhile is not marked by the stale attempt (no
/// answer: the caller writes the success the usual way, which is fenced
/// out), but the statement its claim still covered commits with its ledger
/// row: the next attempt finds the key done.
pub async fn statement_commits_without_a_job_success_fenced_out(store: Arc<dyn Store>) {
    invoices(&store).await;
    let (job, fence) = job_with_key(&store, "order:8:invoice").await;
    let stale = JobFence {
        attempt: job.attempt + 1,
        ..job.fence()
    };
    let outcome = run_finishing(
        &store,
        fence,
        vec!["o-8".into(), 800.into(), true.into()],
        success(stale),
    )
    .await
    .unwrap();
    assert!(
        matches!(
            outcome,
            StatementOutcome::Applied {
                result_ref: Some(_),
                finish: None,
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(
        get(&store, job.id).await.state,
        idem::store::JobState::Running
    );
    let row = store.effect_get("order:8:invoice").await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Succeeded);
    assert_eq!(count(&store, "read").await, "1");
}

/// A refused statement rolls the job's success back with the ledger mark;
/// a write other than a job's success is refused before anything runs.
pub async fn statement_refused_leaves_the_job_running(store: Arc<dyn Store>) {
    invoices(&store).await;
    let (job, fence) = job_with_key(&store, "order:9:invoice").await;
    // amount_cents is NOT NULL: the database refuses the row.
    let outcome = run_finishing(
        &store,
        fence.clone(),
        vec!["o-9".into(), SqlValue::Null, true.into()],
        success(job.fence()),
    )
    .await
    .unwrap();
    assert!(
        matches!(outcome, StatementOutcome::Refused(_)),
        "{outcome:?}"
    );
    assert_eq!(
        get(&store, job.id).await.state,
        idem::store::JobState::Running
    );
    let row = store.effect_get("order:9:invoice").await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Processing);

    let release = Write::Job {
        fence: job.fence(),
        change: JobChange::Release,
    };
    let refused = run_finishing(
        &store,
        fence,
        vec!["o-9".into(), 900.into(), true.into()],
        release,
    )
    .await;
    assert!(
        matches!(refused, Err(idem::store::StoreError::Invalid(_))),
        "{refused:?}"
    );
    assert_eq!(
        get(&store, job.id).await.state,
        idem::store::JobState::Running
    );
    assert_eq!(count(&store, "read").await, "0");
}

/// PostgreSQL: a group-commit batch locks job rows (a heartbeat) before
/// ledger rows (a claim of the same key by another job), while the
/// statement holds its ledger row when it marks its job. The statement
/// never waits for the job's row: it commits without the job's success
/// (left to the usual write), and neither side deadlocks.
pub async fn statement_finishing_a_job_does_not_deadlock_with_a_heartbeat(store: Arc<dyn Store>) {
    if store.backend() != BackendKind::Postgres {
        return;
    }
    invoices(&store).await;
    let key = "order:10:invoice";
    let (a, fence) = job_with_key(&store, key).await;
    let b = hold(&store, "w2").await;
    // Holds the ledger row for a second before it marks the job.
    let slow = "INSERT INTO invoices (order_id, amount_cents, paid, note) \
                VALUES ($1, $2, $3, (SELECT 'slow' FROM pg_sleep(1))) RETURNING id";
    let statement = {
        let store = store.clone();
        let finish = success(a.fence());
        tokio::spawn(async move {
            store
                .effect_succeed_with_statement(StatementParams {
                    fence,
                    call: StatementCall::new(
                        "slow",
                        slow,
                        vec!["o-10".into(), 1000.into(), true.into()],
                    ),
                    finish: Some(finish),
                })
                .await
        })
    };
    // Ordering only: the statement is inside its pg_sleep by then.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let batch = store
        .write_batch(vec![
            Write::Job {
                fence: a.fence(),
                change: JobChange::Heartbeat {
                    lease: LONG,
                    started: true,
                },
            },
            Write::EffectClaim(claim_by(&b, key, LONG)),
        ])
        .await;
    let statement = statement.await.unwrap();
    let (Ok(batch), Ok(statement)) = (&batch, &statement) else {
        panic!("a deadlock or an error: batch {batch:?}, statement {statement:?}");
    };
    assert!(
        matches!(
            statement,
            StatementOutcome::Applied {
                result_ref: Some(_),
                finish: None,
            }
        ),
        "the job's row was locked by the batch: not waited for, {statement:?}"
    );
    assert_eq!(batch[0], Written::Job(Fence::Applied), "{batch:?}");
    assert!(
        matches!(
            batch[1],
            Written::EffectClaim(EffectClaim::AlreadySucceeded { .. })
        ),
        "{batch:?}"
    );
    assert_eq!(
        get(&store, a.id).await.state,
        idem::store::JobState::Running
    );
}
