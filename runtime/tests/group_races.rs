//! Groups where claims, nodes and producers meet (found by the review of
//! the groups change, each reproduced before it was fixed): against the
//! real PostgreSQL (`DATABASE_URL`, default
//! postgres://postgres@127.0.0.1:5432/test) and SQLite.

use idem::sources::{Incoming, Source, SourceConfig, ingest};
use idem::store::postgres::{connect_with_schema, job_insert_in};
use idem::store::{ClaimParams, Clock, JobId, JobState, NewJob, Store};
use sqlx::Connection;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

fn grouped(group: &str) -> NewJob {
    NewJob {
        group: Some(group.into()),
        ..NewJob::new("g", b"{}".to_vec())
    }
}

fn params(worker: &str, limit: u32) -> ClaimParams {
    ClaimParams {
        queue: "default".into(),
        worker: worker.into(),
        limit,
        lease: Duration::from_secs(600),
        queue_concurrency: None,
        max_attempts: Default::default(),
    }
}

async fn sqlite_store() -> (tempfile::TempDir, Arc<dyn Store>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("idem.db").display());
    let store = idem::store::sqlite::connect(&url, Clock::Adjustable)
        .await
        .expect("a SQLite store");
    (dir, Arc::new(store))
}

/// A producer's transaction commits a job of group G with a lower id after
/// a later job of G was claimed: a second claim sees the late one as the
/// head while the first claim has not committed yet, and meets the first
/// on `jobs_group_running`. The claim must wait, recognise the refusal and
/// claim again (nothing, since G runs). Nothing in the suite reaches this
/// path (`CLAIM_TRIES = 0` passes every existing test).
#[tokio::test]
async fn pg_late_commit_makes_a_claim_meet_the_unique_index_and_claim_again() {
    let schema = format!("idem_rv_{}", hex::encode(rand::random::<[u8; 6]>()));
    let store: Arc<dyn Store> = Arc::new(
        connect_with_schema(&database_url(), &schema, Clock::Database)
            .await
            .expect("store"),
    );
    let url = format!("{}?options=-csearch_path%3D{schema}", database_url());
    // P1: a producer whose transaction holds a job of G (the lower id).
    let mut producer = sqlx::PgConnection::connect(&url).await.expect("producer");
    let mut ptx = producer.begin().await.expect("begin");
    let late = job_insert_in(&mut ptx, grouped("G"))
        .await
        .expect("late")
        .id;
    // A later job of G, committed at once.
    let early = store.job_insert(grouped("G")).await.expect("early").id;
    assert!(late < early);
    // C1: a claim of the committed one, not committed yet.
    let mut claimer = sqlx::PgConnection::connect(&url).await.expect("claimer");
    let c1: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut claimer)
        .await
        .expect("c1's pid");
    let mut watcher = sqlx::PgConnection::connect(&url).await.expect("watcher");
    let mut ctx = claimer.begin().await.expect("begin");
    sqlx::query(
        "UPDATE jobs SET state = 'running', attempt = 1, lease_owner = 'c1', \
         lease_until = 9000000000000, started = 0 WHERE id = $1",
    )
    .bind(early.0)
    .execute(&mut *ctx)
    .await
    .expect("c1 marks early running");
    ptx.commit().await.expect("producer commits");
    // C2: the store's claim sees `late` as the head (early is locked and
    // not running in its snapshot) and waits on C1's index entry.
    let s2 = store.clone();
    let second = tokio::spawn(async move { s2.job_claim(params("c2", 10)).await });
    // Until the database shows the store's claim blocked by C1.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let blocked: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)))",
        )
        .bind(c1)
        .fetch_one(&mut watcher)
        .await
        .expect("blocking pids");
        if blocked {
            break;
        }
        assert!(!second.is_finished(), "the claim waits on C1's index entry");
        assert!(Instant::now() < deadline, "the claim never waited on C1");
        tokio::task::yield_now().await;
    }
    assert!(!second.is_finished(), "the claim waits on C1's index entry");
    ctx.commit().await.expect("c1 commits");
    let claimed = second.await.expect("task").expect("the claim claims again");
    assert!(
        claimed.is_empty(),
        "G runs `early`: nothing else of G may run: {:?}",
        claimed.iter().map(|j| j.id).collect::<Vec<_>>()
    );
    let running: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE group_key = 'G' AND state = 'running'")
            .fetch_one(&mut claimer)
            .await
            .expect("count");
    assert_eq!(running, 1);
    drop(store);
    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .execute(&mut claimer)
        .await;
}

/// Cancelling the head of a group makes the next job claimable, but on
/// SQLite nothing wakes this process's claimers (no trigger; `job_cancel`
/// does not call `wake`): the next job waits a whole poll interval.
#[tokio::test]
async fn sqlite_cancelling_a_group_head_wakes_the_claimers() {
    let (_dir, store) = sqlite_store().await;
    // The head is delayed (a retrying head behaves the same): it holds a2.
    let a1 = store
        .job_insert(NewJob {
            delay: Duration::from_secs(3600),
            ..grouped("order:1")
        })
        .await
        .expect("a1")
        .id;
    let a2 = store.job_insert(grouped("order:1")).await.expect("a2").id;
    assert!(
        store
            .job_claim(params("w", 10))
            .await
            .expect("claim")
            .is_empty()
    );
    // Use up the wake-up permits the inserts left.
    store.wait_for_jobs(Duration::from_millis(10)).await;
    store.wait_for_jobs(Duration::from_millis(10)).await;
    let waiter = store.clone();
    let woken = tokio::spawn(async move {
        let started = Instant::now();
        waiter.wait_for_jobs(Duration::from_secs(3)).await;
        started.elapsed()
    });
    // No pause needed: a wake-up that comes before the waiter waits is kept
    // for it (`wait_for_jobs` returns at once), and none comes without it.
    assert!(store.job_cancel(a1).await.expect("cancel"));
    let waited = woken.await.expect("waiter");
    let claimed: Vec<JobId> = store
        .job_claim(params("w", 10))
        .await
        .expect("claim")
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(claimed, vec![a2], "a2 is claimable once a1 is cancelled");
    assert!(
        waited < Duration::from_secs(1),
        "the claimer slept {waited:?} (its whole poll interval) though a2 became claimable"
    );
}

/// A grouped source's message that is dead on arrival for another reason
/// (here a key with '/') is kept without its group; replayed, it runs
/// outside its group, at the same time as the group's running job.
#[tokio::test]
async fn replayed_dead_on_arrival_message_of_a_grouped_source_keeps_its_group() {
    let (_dir, store) = sqlite_store().await;
    let config: SourceConfig = toml::from_str(
        "kind = \"amqp\"\nurl = \"amqp://127.0.0.1\"\nqueue = \"orders\"\n\
         plugin = \"g\"\nkey = \"json:/event\"\ngroup = \"json:/order_id\"\n",
    )
    .expect("config");
    let source = Source::new(config, 5).expect("source");
    let message = |body: &str| Incoming {
        payload: body.as_bytes().to_vec(),
        message_id: None,
        headers: Vec::new(),
    };
    let batch = [
        message(r#"{"order_id": 7, "event": "paid"}"#),
        message(r#"{"order_id": 7, "event": "ship/1"}"#),
    ];
    let report = ingest(store.as_ref(), &source, &batch)
        .await
        .expect("ingest");
    assert_eq!((report.inserted, report.dead_on_arrival), (1, 1));
    let running = store.job_claim(params("w", 10)).await.expect("claim");
    assert_eq!(running.len(), 1);
    assert_eq!(running[0].group.as_deref(), Some("7"));
    let dead = store
        .job_list(idem::store::JobFilter {
            states: vec![JobState::Dead],
            plugin: None,
            error_code: None,
            ids: vec![],
            queue: None,
            before: None,
            limit: 0,
        })
        .await
        .expect("list");
    assert_eq!(dead.len(), 1);
    store.job_replay(&[dead[0].id]).await.expect("replay");
    let second = store.job_claim(params("w", 10)).await.expect("claim");
    assert!(
        second.is_empty(),
        "order 7's job {} runs, yet the replayed message of order 7 was claimed too (group {:?})",
        running[0].id,
        second.first().map(|j| j.group.clone())
    );
}

/// Two nodes on one PostgreSQL schema: a waiting group head cancelled on
/// node A wakes node B's claimers through the `groups` trigger. (Not
/// covered elsewhere: the whole-system test runs its three workers on one
/// store, whose local `wake_claimers` hides a missing trigger.) With
/// `DROP_TRIGGER=1` the trigger is dropped first and this test must fail.
#[tokio::test]
async fn pg_a_finished_group_head_wakes_other_nodes() {
    let schema = format!("idem_rv_{}", hex::encode(rand::random::<[u8; 6]>()));
    let a: Arc<dyn Store> = Arc::new(
        connect_with_schema(&database_url(), &schema, Clock::Database)
            .await
            .expect("node a"),
    );
    let b: Arc<dyn Store> = Arc::new(
        connect_with_schema(&database_url(), &schema, Clock::Database)
            .await
            .expect("node b"),
    );
    let url = format!("{}?options=-csearch_path%3D{schema}", database_url());
    let mut admin = sqlx::PgConnection::connect(&url).await.expect("admin");
    if std::env::var("DROP_TRIGGER").is_ok() {
        sqlx::query("DROP TRIGGER jobs_notify_group_moved ON jobs")
            .execute(&mut admin)
            .await
            .expect("drop trigger");
    }
    let a1 = a
        .job_insert(NewJob {
            delay: Duration::from_secs(3600),
            ..grouped("order:1")
        })
        .await
        .expect("a1")
        .id;
    let a2 = a.job_insert(grouped("order:1")).await.expect("a2").id;
    // Let B's notifications of the inserts arrive and be used up.
    for _ in 0..3 {
        b.wait_for_jobs(Duration::from_millis(100)).await;
    }
    assert!(
        b.job_claim(params("b", 10))
            .await
            .expect("claim")
            .is_empty()
    );
    let waiter = b.clone();
    let woken = tokio::spawn(async move {
        let started = Instant::now();
        waiter.wait_for_jobs(Duration::from_secs(3)).await;
        started.elapsed()
    });
    // No pause needed: a wake-up that comes before the waiter waits is kept.
    assert!(a.job_cancel(a1).await.expect("cancel"));
    let waited = woken.await.expect("waiter");
    let claimed: Vec<JobId> = b
        .job_claim(params("b", 10))
        .await
        .expect("claim")
        .iter()
        .map(|j| j.id)
        .collect();
    drop((a, b));
    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .execute(&mut admin)
        .await;
    assert_eq!(claimed, vec![a2]);
    assert!(waited < Duration::from_secs(1), "node b slept {waited:?}");
}

/// A job enqueued behind a head whose end is being written (the writer's
/// transaction has marked it succeeded and looked for a blocked job to
/// promote, and has not committed): the insert must not leave the new job
/// blocked, since the writer cannot see it and nothing else would promote
/// it. The insert skips the locked head and finds the group empty, so the
/// new job is its group's head.
#[tokio::test]
async fn pg_a_job_enqueued_while_its_head_ends_is_not_left_blocked() {
    let schema = format!("idem_rv_{}", hex::encode(rand::random::<[u8; 6]>()));
    let store: Arc<dyn Store> = Arc::new(
        connect_with_schema(&database_url(), &schema, Clock::Database)
            .await
            .expect("store"),
    );
    let url = format!("{}?options=-csearch_path%3D{schema}", database_url());
    let head = store.job_insert(grouped("G")).await.expect("head").id;
    let claimed = store.job_claim(params("w", 10)).await.expect("claim");
    assert_eq!(claimed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![head]);
    // The writer: the head's end and the (empty) promotion, not committed.
    let mut writer = sqlx::PgConnection::connect(&url).await.expect("writer");
    let mut wtx = writer.begin().await.expect("begin");
    sqlx::query("UPDATE jobs SET state = 'succeeded', lease_owner = NULL WHERE id = $1")
        .bind(head.0)
        .execute(&mut *wtx)
        .await
        .expect("the head ends");
    let promoted = sqlx::query(
        "UPDATE jobs SET state = 'available' WHERE state = 'blocked' AND group_key = 'G'",
    )
    .execute(&mut *wtx)
    .await
    .expect("the promotion");
    assert_eq!(promoted.rows_affected(), 0, "nothing blocked yet");
    // Meanwhile a producer enqueues the next job of G (it must not wait for
    // the writer either: the head's row is locked).
    let next = tokio::time::timeout(Duration::from_secs(30), store.job_insert(grouped("G")))
        .await
        .expect("the insert does not wait for the writer")
        .expect("next")
        .id;
    wtx.commit().await.expect("the writer commits");
    let next_job = store.job_get(next).await.expect("get").expect("next");
    assert_eq!(
        next_job.state,
        JobState::Available,
        "the next job is its group's head, not blocked behind a finished job"
    );
    let claimed = store.job_claim(params("w", 10)).await.expect("claim");
    assert_eq!(claimed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![next]);
    drop(store);
    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .execute(&mut writer)
        .await;
}

/// The other order: a producer's insert behind a running head has not
/// committed when the head ends. The writer ending the head waits for the
/// insert (the insert share-locks the head), then sees and promotes it.
#[tokio::test]
async fn pg_a_head_that_ends_while_a_job_is_enqueued_behind_it_promotes_it() {
    let schema = format!("idem_rv_{}", hex::encode(rand::random::<[u8; 6]>()));
    let store: Arc<dyn Store> = Arc::new(
        connect_with_schema(&database_url(), &schema, Clock::Database)
            .await
            .expect("store"),
    );
    let url = format!("{}?options=-csearch_path%3D{schema}", database_url());
    let head = store.job_insert(grouped("G")).await.expect("head").id;
    let running = store.job_claim(params("w", 10)).await.expect("claim");
    assert_eq!(running.len(), 1);
    // Another insert behind the head, still open: it share-locked the head
    // as the insert's head check does. The store's insert behind it shares
    // that lock and commits blocked.
    let mut producer = sqlx::PgConnection::connect(&url).await.expect("producer");
    let mut ptx = producer.begin().await.expect("begin");
    sqlx::query("SELECT id FROM jobs WHERE id = $1 FOR SHARE")
        .bind(head.0)
        .fetch_one(&mut *ptx)
        .await
        .expect("share lock");
    let next = store.job_insert(grouped("G")).await.expect("next").id;
    assert_eq!(
        store.job_get(next).await.expect("get").expect("next").state,
        JobState::Blocked,
        "behind the running head"
    );
    // The head's success waits for the share lock, then promotes `next`.
    let job = running.into_iter().next().expect("head");
    let s2 = store.clone();
    let finish = tokio::spawn(async move {
        use idem::store::{JobChange, Write};
        s2.write_batch(vec![Write::Job {
            fence: job.fence(),
            change: JobChange::Succeed {
                plugin_hash: None,
                plan: None,
            },
        }])
        .await
    });
    tokio::task::yield_now().await;
    ptx.commit().await.expect("release");
    let written = finish.await.expect("task").expect("success");
    assert_eq!(written.len(), 1);
    assert_eq!(
        store.job_get(next).await.expect("get").expect("next").state,
        JobState::Available
    );
    drop(store);
    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .execute(&mut producer)
        .await;
}
