//! The store conformance suite on PostgreSQL (a fresh schema per test on
//! `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`), plus
//! what only PostgreSQL has.

mod conformance;

use conformance::{Fixture, LONG, claim_params, job, keyed};
use idem::store::postgres::{PostgresStore, job_insert_in};
use idem::store::{JobFilter, JobState, Store, StoreError};
use sqlx::Connection;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    let store = PostgresStore::connect_with_schema(&database_url(), &schema)
        .await
        .unwrap();
    Fixture {
        store: Arc::new(store),
        keep: Box::new(()),
        teardown: Some(Box::pin(drop_schema(schema))),
    }
}

conformance::conformance_suite!(postgres_fixture);

/// Runs a backend-specific test on its own schema, dropped afterwards.
async fn with_store<F, Fut>(body: F)
where
    F: FnOnce(Arc<PostgresStore>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let schema = fresh_schema();
    let store = Arc::new(
        PostgresStore::connect_with_schema(&database_url(), &schema)
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
        let mut tx = store.pool().begin().await.unwrap();
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
            tokio::spawn(async move {
                let started = Instant::now();
                store.wait_for_jobs(Duration::from_secs(20)).await;
                started.elapsed()
            })
        };
        let mut tx = store.pool().begin().await.unwrap();
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
        let waited = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .unwrap()
            .unwrap();
        assert!(waited < Duration::from_secs(10));

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
        tokio::time::timeout(Duration::from_secs(10), store.pool().close())
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
            let mut conn = store.pool().acquire().await.unwrap();
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
            .execute(store.pool())
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
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert_eq!(state, "available", "the claim was rolled back");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schemas_are_isolated() {
    let (a, b) = (fresh_schema(), fresh_schema());
    let first = PostgresStore::connect_with_schema(&database_url(), &a)
        .await
        .unwrap();
    let second = PostgresStore::connect_with_schema(&database_url(), &b)
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
    PostgresStore::connect_with_schema(&database_url(), &a)
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
        let err = PostgresStore::connect_with_schema(&database_url(), bad)
            .await
            .err()
            .expect("rejected");
        assert!(matches!(err, StoreError::Invalid(_)), "{bad:?}: {err:?}");
    }
}
