//! The store conformance suite on PostgreSQL (a fresh schema per test on
//! `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`), plus
//! what only PostgreSQL has.

mod conformance;

use conformance::{Fixture, LONG, claim_params, job, keyed};
use idem::store::group_commit::{GroupCommit, GroupCommitSettings};
use idem::store::postgres::{connect_with_schema, job_insert_in};
use idem::store::{Clock, JobFilter, JobState, SqlStore, Store, StoreError};
use sqlx::Connection;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

fn fresh_schema() -> String {
    format!("idem_t_{}", hex::encode(rand::random::<[u8; 8]>()))
}

async fn drop_schema(schema: String) {
    if let Ok(mut conn) = sqlx::PgConnection::connect(&database_url()).await {
        let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .execute(&mut conn)
            .await;
        let _ = conn.close().await;
    }
}

async fn postgres_fixture() -> Fixture {
    let schema = fresh_schema();
    let store = connect_with_schema(&database_url(), &schema, Clock::Adjustable)
        .await
        .unwrap();
    Fixture {
        store: Arc::new(store),
        keep: Box::new(()),
        teardown: Some(Box::pin(drop_schema(schema))),
    }
}

async fn grouped_postgres_fixture() -> Fixture {
    let fixture = postgres_fixture().await;
    Fixture {
        store: GroupCommit::new(fixture.store, GroupCommitSettings::default()),
        ..fixture
    }
}

/// The suite on the store itself.
mod direct {
    use super::*;
    conformance::conformance_suite!(postgres_fixture);
}

/// The suite through the group commit: every write goes through batches.
mod grouped {
    use super::*;
    conformance::conformance_suite!(grouped_postgres_fixture);
}

/// Runs a backend-specific test on its own schema, dropped afterwards.
async fn with_store<F, Fut>(body: F)
where
    F: FnOnce(Arc<SqlStore>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let schema = fresh_schema();
    let store = Arc::new(
        connect_with_schema(&database_url(), &schema, Clock::Adjustable)
            .await
            .unwrap(),
    );
    let outcome = tokio::spawn(body(store)).await;
    drop_schema(schema).await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_enqueue_commits_or_rolls_back() {
    with_store(|store| async move {
        let mut tx = store.postgres_pool().unwrap().begin().await.unwrap();
        let enqueued = job_insert_in(&mut tx, keyed("outbox", "order:1:created"))
            .await
            .unwrap();
        assert!(enqueued.inserted);
        tx.rollback().await.unwrap();
        assert!(
            store.job_get(enqueued.id).await.unwrap().is_none(),
            "rolled back: no job"
        );
        assert!(
            store
                .job_list(JobFilter::default())
                .await
                .unwrap()
                .is_empty()
        );

        // The wake-up travels with the commit.
        let waiter = {
            let store = store.clone();
            // An hour: only the notification can end this wait in time.
            tokio::spawn(async move { store.wait_for_jobs(Duration::from_secs(3600)).await })
        };
        let mut tx = store.postgres_pool().unwrap().begin().await.unwrap();
        sqlx::query("CREATE TABLE orders (id BIGINT PRIMARY KEY)")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("INSERT INTO orders (id) VALUES (1)")
            .execute(&mut *tx)
            .await
            .unwrap();
        let enqueued = job_insert_in(&mut tx, keyed("outbox", "order:1:created"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("woken by the commit's notification")
            .unwrap();

        let job = store
            .job_get(enqueued.id)
            .await
            .unwrap()
            .expect("committed: visible");
        assert_eq!(job.state, JobState::Available);
        let again = store
            .job_insert(keyed("outbox", "order:1:created"))
            .await
            .unwrap();
        assert_eq!(again.id, enqueued.id);
        assert!(!again.inserted);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn closed_pool_gives_transient_error() {
    with_store(|store| async move {
        store.job_insert(job("x")).await.unwrap();
        tokio::time::timeout(
            Duration::from_secs(10),
            store.postgres_pool().unwrap().close(),
        )
        .await
        .expect("the LISTEN task lets the pool close");
        let err = store.job_get(idem::store::JobId(1)).await.unwrap_err();
        assert!(matches!(err, StoreError::Database(_)), "{err:?}");
        assert!(err.is_transient(), "{err:?}");
        assert!(
            store
                .job_claim(claim_params("w", 1, LONG))
                .await
                .unwrap_err()
                .is_transient()
        );
        assert!(store.job_insert(job("x")).await.unwrap_err().is_transient());
        // Waiting still returns (by timeout) instead of hanging or panicking.
        store.wait_for_jobs(Duration::from_millis(50)).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_connections_are_replaced() {
    with_store(|store| async move {
        store.job_insert(job("x")).await.unwrap();
        // Kill this store's pooled connections (and only them).
        let mut held = Vec::new();
        let mut pids = Vec::new();
        for _ in 0..3 {
            let mut conn = store.postgres_pool().unwrap().acquire().await.unwrap();
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            pids.push(pid);
            held.push(conn);
        }
        drop(held);
        let mut admin = sqlx::PgConnection::connect(&database_url()).await.unwrap();
        sqlx::query("SELECT pg_terminate_backend(pid) FROM unnest($1::int4[]) AS pid")
            .bind(&pids)
            .execute(&mut admin)
            .await
            .unwrap();
        admin.close().await.unwrap();
        // A dead pooled connection either surfaces as a transient error once
        // or is replaced by the pool's liveness check.
        let mut ok = false;
        for _ in 0..3 {
            match store.job_list(JobFilter::default()).await {
                Ok(jobs) => {
                    assert_eq!(jobs.len(), 1);
                    ok = true;
                    break;
                }
                Err(e) => assert!(e.is_transient(), "{e:?}"),
            }
        }
        assert!(ok, "the pool recovers");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corrupt_row_is_reported_and_claim_rolled_back() {
    with_store(|store| async move {
        let id = store.job_insert(job("x")).await.unwrap().id;
        sqlx::query("UPDATE jobs SET errors = '{\"not\":\"a list\"}' WHERE id = $1")
            .bind(id.0)
            .execute(store.postgres_pool().unwrap())
            .await
            .unwrap();
        let err = store.job_get(id).await.unwrap_err();
        assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
        assert!(!err.is_transient());
        let err = store
            .job_claim(claim_params("w", 1, LONG))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
        let state: String = sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1")
            .bind(id.0)
            .fetch_one(store.postgres_pool().unwrap())
            .await
            .unwrap();
        assert_eq!(state, "available", "the claim was rolled back");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schemas_are_isolated() {
    let (a, b) = (fresh_schema(), fresh_schema());
    let first = connect_with_schema(&database_url(), &a, Clock::Database)
        .await
        .unwrap();
    let second = connect_with_schema(&database_url(), &b, Clock::Database)
        .await
        .unwrap();
    let id = first.job_insert(keyed("iso", "k")).await.unwrap();
    assert!(
        second
            .job_list(JobFilter::default())
            .await
            .unwrap()
            .is_empty()
    );
    let other = second.job_insert(keyed("iso", "k")).await.unwrap();
    assert!(other.inserted, "keys are per schema");
    assert_eq!(
        first.job_list(JobFilter::default()).await.unwrap()[0].id,
        id.id
    );
    // Connecting again to an existing schema migrates nothing twice.
    connect_with_schema(&database_url(), &a, Clock::Database)
        .await
        .unwrap();
    drop((first, second));
    drop_schema(a).await;
    drop_schema(b).await;

    for bad in [
        "",
        "Upper",
        "1st",
        "semi;colon",
        "quote\"d",
        &"x".repeat(64),
    ] {
        let err = connect_with_schema(&database_url(), bad, Clock::Database)
            .await
            .err()
            .expect("rejected");
        assert!(matches!(err, StoreError::Invalid(_)), "{bad:?}: {err:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_write_fails_only_itself() {
    with_store(|store| async move {
        let pool = store.postgres_pool().unwrap();
        sqlx::query(
            "CREATE FUNCTION explode() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'boom'; END $$",
        )
        .execute(pool)
        .await
        .unwrap();
        sqlx::query(
            "CREATE TRIGGER explode BEFORE UPDATE OF state ON jobs FOR EACH ROW \
             WHEN (NEW.plugin = 'explode' AND NEW.state = 'succeeded') \
             EXECUTE FUNCTION explode()",
        )
        .execute(pool)
        .await
        .unwrap();
        conformance::batch::a_bad_write_fails_only_itself(store).await;
    })
    .await;
}

/// Window 7: every pooled session carries a statement timeout, an idle
/// transaction timeout and server-side TCP keepalives, so a hung statement
/// or a vanished client cannot hold a job's rows for minutes.
#[tokio::test]
async fn sessions_time_out_hung_statements_and_probe_dead_clients() {
    with_store(|store| async move {
        let pool = store.postgres_pool().unwrap();
        for (name, _) in idem::store::postgres::SESSION_SETTINGS {
            let shown: String = sqlx::query_scalar(&format!("SHOW {name}"))
                .fetch_one(pool)
                .await
                .unwrap();
            assert_ne!(shown, "0", "{name} is set");
        }
        let timeout: String = sqlx::query_scalar("SHOW statement_timeout")
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(timeout, "30s");
    })
    .await;
}

/// Runs `change` in a transaction on its own connection, starts `racer`
/// while that transaction holds its row locks, waits until `racer` is
/// either blocked by it or done, then commits `change` and returns what
/// `racer` answered. A statement that waited for the lock sees the row as
/// `change` left it; one that skipped the locked row answers without it.
async fn race_with_uncommitted<T, Fut>(store: &Arc<SqlStore>, change: &str, racer: Fut) -> T
where
    T: Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let pool = store.postgres_pool().unwrap();
    let mut tx = pool.begin().await.unwrap();
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let changed = sqlx::query(change).execute(&mut *tx).await.unwrap();
    assert_eq!(changed.rows_affected(), 1, "{change}");
    let racer = tokio::spawn(racer);
    blocked_by(holder, || racer.is_finished()).await;
    tx.commit().await.unwrap();
    racer.await.unwrap()
}

/// Waits (up to 5 s) until some session waits for a lock held by the
/// backend `holder`, or `done` says there is nothing to wait for; whether
/// one was blocked.
async fn blocked_by(holder: i32, done: impl Fn() -> bool) -> bool {
    let mut admin = sqlx::PgConnection::connect(&database_url()).await.unwrap();
    let mut blocked = false;
    for _ in 0..500 {
        blocked = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
             WHERE $1 = ANY(pg_blocking_pids(pid)))",
        )
        .bind(holder)
        .fetch_one(&mut admin)
        .await
        .unwrap();
        if blocked || done() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    admin.close().await.unwrap();
    blocked
}

/// Window (issue 22, item 1): a rescue picks running jobs whose lease ran
/// out, and a job that finished (or was claimed again) while the rescue
/// waited for its row is left as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rescue_never_overwrites_a_row_changed_while_it_waited() {
    with_store(|store| async move {
        let id = store.job_insert(job("x")).await.unwrap().id;
        let dyn_store: Arc<dyn Store> = store.clone();
        conformance::claim_one(&dyn_store, "w", conformance::SHORT).await;
        conformance::advance(&dyn_store, conformance::PAST_SHORT).await;
        let rescuer = store.clone();
        let rescued = race_with_uncommitted(
            &store,
            &format!(
                "UPDATE jobs SET state = 'succeeded', lease_owner = NULL, lease_until = NULL, \
                 finished_at = 1 WHERE id = {}",
                id.0
            ),
            async move { rescuer.job_rescue_expired(100).await.unwrap() },
        )
        .await;
        assert!(rescued.is_empty(), "rescued {rescued:?}");
        let finished = conformance::get(&dyn_store, id).await;
        assert_eq!(finished.state, JobState::Succeeded);
        assert_eq!(finished.rescues, 0);

        // A fresh claim by another worker, committed while the rescue
        // waited, is not taken from it.
        let id = store.job_insert(job("y")).await.unwrap().id;
        conformance::claim_one(&dyn_store, "w", conformance::SHORT).await;
        conformance::advance(&dyn_store, conformance::PAST_SHORT).await;
        let rescuer = store.clone();
        let rescued = race_with_uncommitted(
            &store,
            &format!(
                "UPDATE jobs SET lease_owner = 'other', attempt = attempt + 1, \
                 lease_until = 9000000000000000 WHERE id = {}",
                id.0
            ),
            async move { rescuer.job_rescue_expired(100).await.unwrap() },
        )
        .await;
        assert!(rescued.is_empty(), "rescued {rescued:?}");
        let taken = conformance::get(&dyn_store, id).await;
        assert_eq!(taken.state, JobState::Running);
        assert_eq!(taken.lease_owner.as_deref(), Some("other"));
    })
    .await;
}

/// Window (issue 22, item 1): the effect prune deletes finished ledger rows
/// of finished jobs; a row taken over while the prune waited for it stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_effect_prune_never_deletes_a_row_taken_over_while_it_waited() {
    with_store(|store| async move {
        let dyn_store: Arc<dyn Store> = store.clone();
        let holder = conformance::hold(&dyn_store, "w").await;
        for key in ["k1", "k2"] {
            let claim = dyn_store
                .effect_claim(conformance::claim_by(&holder, key, LONG))
                .await
                .unwrap();
            let idem::store::EffectClaim::Claimed { fence } = claim else {
                panic!("{key}: {claim:?}");
            };
            let failed = dyn_store
                .effect_set_failed(idem::store::EffectFailParams {
                    fence,
                    status: idem::store::EffectStatus::Retrying,
                    error_code: "provider_unavailable".into(),
                    sent: idem::store::Sent::NotApplied,
                })
                .await
                .unwrap();
            assert_eq!(failed, idem::store::Fence::Applied);
        }
        conformance::succeed(&dyn_store, &holder.fence())
            .await
            .unwrap();
        conformance::advance(&dyn_store, Duration::from_secs(3600)).await;
        let pruner = store.clone();
        let pruned = race_with_uncommitted(
            &store,
            "UPDATE effects SET status = 'processing', lease_owner = 'other', \
             updated_at = 9000000000000000 WHERE key = 'k1'",
            async move {
                pruner
                    .effect_delete_finished(idem::store::EffectPruneParams {
                        older_than: Duration::from_secs(60),
                        limit: 100,
                    })
                    .await
                    .unwrap()
            },
        )
        .await;
        assert_eq!(pruned, 1, "only k2 is pruned");
        let kept = dyn_store.effect_get("k1").await.unwrap().expect("k1 kept");
        assert_eq!(kept.lease_owner.as_deref(), Some("other"));
        assert!(dyn_store.effect_get("k2").await.unwrap().is_none());
    })
    .await;
}

/// Issue 22, item 3: heartbeats go ahead of a backlog of outcomes. A flush
/// is held up (another transaction holds its job's row), 50 outcomes queue
/// behind it, then a heartbeat: once the row is free, the heartbeat commits
/// before any of the 50, so a slow store never lets a busy job's lease run
/// out behind other jobs' outcomes. (With one queue for all writes the
/// heartbeat was answered after all 50.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeats_go_ahead_of_a_backlog_of_outcomes() {
    use idem::store::{Fence, JobChange, Write, Written};
    use std::sync::Mutex;
    with_store(|store| async move {
        for _ in 0..52 {
            store.job_insert(job("x")).await.unwrap();
        }
        let claimed = store.job_claim(claim_params("w", 52, LONG)).await.unwrap();
        assert_eq!(claimed.len(), 52);
        let group = GroupCommit::new(store.clone(), GroupCommitSettings::default());
        let answered: Arc<Mutex<Vec<String>>> = Arc::default();
        let note = |what: String| {
            let answered = answered.clone();
            move |answer: idem::store::Result<Written>| {
                assert_eq!(answer.unwrap(), Written::Job(Fence::Applied), "{what}");
                answered.lock().unwrap().push(what);
            }
        };
        let succeed = |job: &idem::store::Job| Write::Job {
            fence: job.fence(),
            change: JobChange::Succeed {
                plugin_hash: None,
                plan: None,
            },
        };
        let (first, rest) = claimed.split_first().unwrap();
        let (beating, outcomes) = rest.split_last().unwrap();
        // Another transaction holds the first job's row ...
        let pool = store.postgres_pool().unwrap();
        let mut tx = pool.begin().await.unwrap();
        let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        sqlx::query("SELECT id FROM jobs WHERE id = $1 FOR UPDATE")
            .bind(first.id.0)
            .execute(&mut *tx)
            .await
            .unwrap();
        // ... so the flush of its outcome waits for it.
        group.write_then(succeed(first), note("first".into()));
        assert!(
            blocked_by(holder, || false).await,
            "the first flush waits for the row"
        );
        for job in outcomes {
            group.write_then(succeed(job), note(format!("outcome {}", job.id.0)));
        }
        group.write_then(
            Write::Job {
                fence: beating.fence(),
                change: JobChange::Heartbeat {
                    lease: LONG,
                    started: true,
                },
            },
            note("heartbeat".into()),
        );
        tx.commit().await.unwrap();
        group.flushed().await;
        let answered = answered.lock().unwrap().clone();
        assert_eq!(answered.len(), 52, "{answered:?}");
        assert_eq!(answered[0], "first", "{answered:?}");
        assert_eq!(answered[1], "heartbeat", "{answered:?}");
    })
    .await;
}
