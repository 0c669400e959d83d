//! The store conformance suite on SQLite (a fresh file per test), plus what
//! only SQLite has.

mod conformance;

use conformance::{Fixture, LONG, claim_params, job, keyed};
use idem::store::group_commit::{GroupCommit, GroupCommitSettings};
use idem::store::sqlite::job_insert_in;
use idem::store::{BackendKind, Clock, JobFilter, JobId, JobState, SqlStore, Store, StoreError};
use std::collections::HashSet;
use std::sync::Arc;

async fn open(dir: &tempfile::TempDir) -> SqlStore {
    let url = format!("sqlite://{}", dir.path().join("idem.db").display());
    idem::store::sqlite::connect(&url, Clock::Adjustable)
        .await
        .unwrap()
}

async fn sqlite_fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    Fixture {
        store: Arc::new(store),
        keep: Box::new(dir),
        teardown: None,
    }
}

async fn grouped_sqlite_fixture() -> Fixture {
    let fixture = sqlite_fixture().await;
    Fixture {
        store: GroupCommit::new(fixture.store, GroupCommitSettings::default()),
        ..fixture
    }
}

/// The suite on the store itself.
mod direct {
    use super::*;
    conformance::conformance_suite!(sqlite_fixture);
}

/// The suite through the group commit: every write goes through batches.
mod grouped {
    use super::*;
    conformance::conformance_suite!(grouped_sqlite_fixture);
}

#[tokio::test]
async fn transactional_enqueue_commits_or_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;

    let mut tx = store.sqlite_pool().unwrap().begin().await.unwrap();
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

    let mut tx = store.sqlite_pool().unwrap().begin().await.unwrap();
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
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
    store.notify_jobs();
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

    let invalid = {
        let mut conn = store.sqlite_pool().unwrap().acquire().await.unwrap();
        job_insert_in(&mut conn, keyed("outbox", ""))
            .await
            .unwrap_err()
    };
    assert!(matches!(invalid, StoreError::Invalid(_)));
}

#[tokio::test]
async fn closed_pool_gives_transient_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    store.job_insert(job("x")).await.unwrap();
    store.close().await;
    let err = store.job_get(JobId(1)).await.unwrap_err();
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
}

#[tokio::test]
async fn corrupt_row_is_reported_and_claim_rolled_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let id = store.job_insert(job("x")).await.unwrap().id;
    sqlx::query("UPDATE jobs SET errors = 'not json' WHERE id = ?1")
        .bind(id.0)
        .execute(store.sqlite_pool().unwrap())
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
    let state: String = sqlx::query_scalar("SELECT state FROM jobs WHERE id = ?1")
        .bind(id.0)
        .fetch_one(store.sqlite_pool().unwrap())
        .await
        .unwrap();
    assert_eq!(state, "available", "the claim was rolled back");
}

#[tokio::test]
async fn connect_creates_the_file_with_wal_and_pragmas() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fresh.db");
    assert!(!path.exists());
    let store = idem::store::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    assert_eq!(store.backend(), BackendKind::Sqlite);
    assert!(path.exists());
    drop(store);

    let store =
        idem::store::sqlite::connect(&format!("sqlite://{}", path.display()), Clock::Database)
            .await
            .unwrap();
    let mut conn = store.sqlite_pool().unwrap().acquire().await.unwrap();
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    let fk: i64 = sqlx::query_scalar("PRAGMA foreign_keys")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(fk, 1);
    let busy: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(busy, 5_000);
    let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(sync, 2, "FULL: a committed write survives power loss");
    // Reopening an existing file applies no migration twice.
    drop(conn);
    drop(store);
    idem::store::sqlite::connect(&format!("sqlite://{}", path.display()), Clock::Database)
        .await
        .unwrap();

    let err = idem::store::connect("mysql://nope")
        .await
        .err()
        .expect("unsupported");
    assert!(matches!(err, StoreError::UnsupportedUrl(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_memory_database_works() {
    let store = idem::store::connect("sqlite::memory:").await.unwrap();
    let id = store.job_insert(job("m")).await.unwrap().id;
    let claimed = store.job_claim(claim_params("w", 10, LONG)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].id, id);
    let jobs = store.job_list(JobFilter::default()).await.unwrap();
    assert_eq!(jobs.len(), 1, "one database shared by the pool");
}

/// Two stores on one file stand for two processes: the write lock, not the
/// pool, keeps claims exclusive.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_stores_on_one_file_claim_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let first: Arc<dyn Store> = Arc::new(open(&dir).await);
    let second: Arc<dyn Store> = Arc::new(open(&dir).await);
    first
        .job_insert_many((0..500).map(|_| job("x")).collect())
        .await
        .unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|w| {
            let store = if w % 2 == 0 {
                first.clone()
            } else {
                second.clone()
            };
            tokio::spawn(async move {
                let mut mine = Vec::new();
                loop {
                    let claimed = store
                        .job_claim(claim_params(&format!("w{w}"), 5, LONG))
                        .await
                        .unwrap();
                    if claimed.is_empty() {
                        return mine;
                    }
                    mine.extend(claimed.into_iter().map(|j| j.id));
                }
            })
        })
        .collect();
    let mut seen = HashSet::new();
    for task in tasks {
        for id in task.await.unwrap() {
            assert!(seen.insert(id), "job {id} claimed twice");
        }
    }
    assert_eq!(seen.len(), 500);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_write_fails_only_itself() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    sqlx::query(
        "CREATE TRIGGER explode BEFORE UPDATE OF state ON jobs \
         WHEN NEW.plugin = 'explode' AND NEW.state = 'succeeded' \
         BEGIN SELECT RAISE(ABORT, 'boom'); END",
    )
    .execute(store.sqlite_pool().unwrap())
    .await
    .unwrap();
    conformance::batch::a_bad_write_fails_only_itself(Arc::new(store)).await;
}

/// Two processes (here: two independent stores) opening a brand-new file
/// at the same instant both migrate it: SQLite has no migration lock, and
/// the later one finds the other's work instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_openers_of_a_new_file_both_succeed() {
    for _ in 0..10 {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("new.db").display());
        let (a, b, c) = tokio::join!(
            idem::store::open(&url, Clock::Database),
            idem::store::open(&url, Clock::Database),
            idem::store::open(&url, Clock::Database),
        );
        for store in [a, b, c] {
            let store = store.expect("every opener succeeds");
            store
                .job_insert(idem::store::NewJob::new("p", b"{}".to_vec()))
                .await
                .expect("the schema is there");
            store.close().await;
        }
    }
}

/// The worker's pruner deletes expired dashboard sessions with the rest
/// (`idem serve` also deletes them on each sign-in).
#[tokio::test]
async fn the_pruner_deletes_expired_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(open(&dir).await);
    let session = |id: &str, ttl: u64| idem::store::NewSession {
        id_digest: id.repeat(64),
        token_fingerprint: "f".repeat(64),
        ttl: std::time::Duration::from_secs(ttl),
    };
    store.session_create(session("a", 60)).await.unwrap();
    store.session_create(session("b", 3600)).await.unwrap();
    store
        .clock_advance(std::time::Duration::from_secs(61))
        .await
        .unwrap();
    let retention = idem::config::RetentionConfig::default();
    let deleted = idem::queue::maintenance::prune_once(&*store, &retention)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    let fingerprints = ["f".repeat(64)];
    assert!(
        store
            .session_get_live(&"b".repeat(64), &fingerprints)
            .await
            .unwrap()
            .is_some()
    );
}
