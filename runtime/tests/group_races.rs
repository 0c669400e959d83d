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
    let (store, url, schema) = pg_store().await;
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
    drop_schema(&schema).await;
}

/// The other order: a producer's insert behind a running head has not
/// committed when the head ends. The writer ending the head waits for the
/// insert (the insert share-locks the head), then sees and promotes it.
#[tokio::test]
async fn pg_a_head_that_ends_while_a_job_is_enqueued_behind_it_promotes_it() {
    let (store, url, schema) = pg_store().await;
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
    drop_schema(&schema).await;
}

// ---------------------------------------------------------------------
// Review of the `blocked` change (group heads): each test below fails on
// 6eeecdc. They name the statements of `runtime/src/store/queries.rs`
// (`job_cancel`, `group_open`, `group_next`) where a raw connection plays
// one side of a race.

/// A PostgreSQL store in a fresh schema, and a URL into that schema.
async fn pg_store() -> (Arc<dyn Store>, String, String) {
    let schema = format!("idem_rv_{}", hex::encode(rand::random::<[u8; 6]>()));
    let store: Arc<dyn Store> = Arc::new(
        connect_with_schema(&database_url(), &schema, Clock::Database)
            .await
            .expect("store"),
    );
    let url = format!("{}?options=-csearch_path%3D{schema}", database_url());
    (store, url, schema)
}

async fn drop_schema(schema: &str) {
    if let Ok(mut conn) = sqlx::PgConnection::connect(&database_url()).await {
        let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .execute(&mut conn)
            .await;
    }
}

/// Group G with its head claimed (running) and `n` jobs blocked behind
/// it: the head's claimed job and the backlog's ids.
async fn running_head_and_backlog(store: &dyn Store, n: usize) -> (idem::store::Job, Vec<JobId>) {
    let head = store.job_insert(grouped("G")).await.expect("head").id;
    let mut running = store.job_claim(params("w", 10)).await.expect("claim");
    assert_eq!(running.iter().map(|j| j.id).collect::<Vec<_>>(), vec![head]);
    let backlog = store
        .job_insert_many((0..n).map(|_| grouped("G")).collect())
        .await
        .expect("backlog")
        .into_iter()
        .map(|e| e.id)
        .collect();
    (running.remove(0), backlog)
}

/// Waits until the database shows a backend blocked by `pid`.
async fn until_blocked_by(watcher: &mut sqlx::PgConnection, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let blocked: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)))",
        )
        .bind(pid)
        .fetch_one(&mut *watcher)
        .await
        .expect("blocking pids");
        if blocked {
            return;
        }
        assert!(Instant::now() < deadline, "nothing waited on {pid}");
        tokio::task::yield_now().await;
    }
}

/// Operators cancelling a group's backlog (the API's cancel, several at
/// once). A `job_cancel` of a blocked job used to lock its row, then
/// promote the group's oldest *other* blocked job: two cancels of B1 and B2
/// each held their own row and waited for the other's, a deadlock, and
/// PostgreSQL aborted one cancel with an error. A blocked job's cancel now
/// promotes nothing.
#[tokio::test]
async fn pg_concurrent_cancels_of_a_groups_blocked_jobs_do_not_deadlock() {
    let (store, _url, schema) = pg_store().await;
    let (_head, backlog) = running_head_and_backlog(&*store, 64).await;
    let tasks: Vec<_> = backlog
        .iter()
        .map(|id| {
            let (store, id) = (store.clone(), *id);
            tokio::spawn(async move { store.job_cancel(id).await })
        })
        .collect();
    let mut failed = Vec::new();
    for task in tasks {
        match task.await.expect("task") {
            Ok(true) => {}
            other => failed.push(format!("{other:?}")),
        }
    }
    drop_schema(&schema).await;
    assert!(
        failed.is_empty(),
        "{} of 64 cancels failed, first: {:?}",
        failed.len(),
        failed.first()
    );
}

/// The head ends while an operator cancels the job behind it: the
/// writer's promotion picks B1, waits for the cancel, finds B1 cancelled
/// on its re-check and promotes nothing, unless it looks again. It must:
/// B2 is then the group's head, not a job left blocked with no head.
#[tokio::test]
async fn pg_a_head_ending_while_the_next_job_is_cancelled_promotes_the_one_after() {
    let (store, url, schema) = pg_store().await;
    let (job, b) = running_head_and_backlog(&*store, 2).await;
    let mut other = sqlx::PgConnection::connect(&url).await.expect("other");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut other)
        .await
        .expect("pid");
    let mut watcher = sqlx::PgConnection::connect(&url).await.expect("watcher");
    // The operator's cancel of B1, not committed yet.
    let mut otx = other.begin().await.expect("begin");
    sqlx::query("UPDATE jobs SET state = 'cancelled', finished_at = 1 WHERE id = $1")
        .bind(b[0].0)
        .execute(&mut *otx)
        .await
        .expect("cancel B1");
    // The head's success: its promotion picks B1 and waits.
    let s2 = store.clone();
    let finish = tokio::spawn(async move {
        s2.write_batch(vec![idem::store::Write::Job {
            fence: job.fence(),
            change: idem::store::JobChange::Succeed {
                plugin_hash: None,
                plan: None,
            },
        }])
        .await
    });
    until_blocked_by(&mut watcher, pid).await;
    otx.commit().await.expect("the cancel commits");
    finish.await.expect("task").expect("the success");
    let b2 = store.job_get(b[1]).await.expect("get").expect("B2").state;
    let claimed: Vec<JobId> = store
        .job_claim(params("w", 10))
        .await
        .expect("claim")
        .into_iter()
        .map(|j| j.id)
        .collect();
    drop_schema(&schema).await;
    assert_eq!(b2, JobState::Available, "B2 is G's head");
    assert_eq!(claimed, vec![b[1]]);
}

/// Two write batches (two nodes, or two commit lanes), each ending the head
/// of one group and enqueueing a child into the other's group: each child's
/// `group_open` share-locks the other group's tail (its blocked job), then
/// each `group_next` updates its own group's blocked job, which the other
/// holds. The raw connection plays batch X at the same points as the store
/// plays batch A.
#[tokio::test]
async fn pg_write_batches_with_children_into_each_others_groups_do_not_deadlock() {
    use idem::store::{ChildEffect, JobChange, Write};
    let (store, url, schema) = pg_store().await;
    let h1 = store.job_insert(grouped("G1")).await.expect("h1").id;
    let h2 = store.job_insert(grouped("G2")).await.expect("h2").id;
    let b1 = store.job_insert(grouped("G1")).await.expect("b1").id;
    let b2 = store.job_insert(grouped("G2")).await.expect("b2").id;
    let running = store.job_claim(params("w", 10)).await.expect("claim");
    assert_eq!(
        running.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![h1, h2]
    );
    for id in [b1, b2] {
        let job = store.job_get(id).await.expect("get").expect("job");
        assert_eq!(job.state, JobState::Blocked);
    }
    let mut x = sqlx::PgConnection::connect(&url).await.expect("x");
    let x_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut x)
        .await
        .expect("pid");
    let mut watcher = sqlx::PgConnection::connect(&url).await.expect("watcher");
    // Batch X: H2 succeeds, its child goes into G1 behind B1 (group_open
    // share-locks G1's tail, B1).
    let mut xtx = x.begin().await.expect("begin");
    sqlx::query("UPDATE jobs SET state = 'succeeded', lease_owner = NULL WHERE id = $1")
        .bind(h2.0)
        .execute(&mut *xtx)
        .await
        .expect("h2 ends");
    let tail: i64 = sqlx::query_scalar(
        "SELECT id FROM jobs WHERE group_key = 'G1' \
           AND state IN ('available', 'retrying', 'running', 'blocked') \
         ORDER BY group_key DESC, id DESC LIMIT 1 FOR SHARE SKIP LOCKED",
    )
    .fetch_one(&mut *xtx)
    .await
    .expect("G1's tail");
    assert_eq!(tail, b1.0);
    // Batch A (the store): H1 succeeds with a child into G2 (its group_open
    // share-locks B2), then its group_next waits for B1.
    let h1_job = running.into_iter().next().expect("h1");
    let child = ChildEffect {
        key: "g/child-g2".into(),
        older_key: None,
        fingerprint: "f".into(),
        child: NewJob {
            idempotency_key: Some("g/child-g2".into()),
            ..grouped("G2")
        },
    };
    let s2 = store.clone();
    let a = tokio::spawn(async move {
        s2.write_batch(vec![Write::Job {
            fence: h1_job.fence(),
            change: JobChange::SucceedWithChildren {
                plugin: "g".into(),
                plan: "[]".into(),
                plugin_hash: "h".into(),
                children: vec![child],
            },
        }])
        .await
    });
    until_blocked_by(&mut watcher, x_pid).await;
    // Batch X's group_next: G2's oldest blocked job, B2.
    let x_next =
        sqlx::query("UPDATE jobs SET state = 'available' WHERE state = 'blocked' AND id = $1")
            .bind(b2.0)
            .execute(&mut *xtx)
            .await;
    let x_ok = match x_next {
        Ok(_) => xtx.commit().await.is_ok(),
        Err(e) => {
            eprintln!("batch X: {e}");
            false
        }
    };
    let a = a.await.expect("task");
    drop_schema(&schema).await;
    assert!(
        x_ok && a.is_ok(),
        "a deadlock: batch X ok = {x_ok}, the store's batch = {a:?}"
    );
}

/// Enqueue order is commit order (README, "Groups"): N1 gets the lower id
/// but its insert commits after N2's (its key waits for another producer's
/// uncommitted insert of the same key, which then rolls back). N2 committed
/// first into an empty group and is its head; N1, committed behind it, is
/// blocked, and runs next, before a job enqueued after both (N3).
#[tokio::test]
async fn pg_a_job_committed_late_with_a_lower_id_runs_after_the_head_and_before_later_jobs() {
    let (store, url, schema) = pg_store().await;
    let mut other = sqlx::PgConnection::connect(&url).await.expect("other");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut other)
        .await
        .expect("pid");
    let mut watcher = sqlx::PgConnection::connect(&url).await.expect("watcher");
    let mut otx = other.begin().await.expect("begin");
    let keyed = NewJob {
        idempotency_key: Some("k".into()),
        ..grouped("G")
    };
    job_insert_in(&mut otx, keyed.clone())
        .await
        .expect("the other producer's job");
    let s2 = store.clone();
    let first = tokio::spawn(async move { s2.job_insert(keyed).await });
    until_blocked_by(&mut watcher, pid).await;
    let n2 = store.job_insert(grouped("G")).await.expect("n2").id;
    otx.rollback().await.expect("rollback");
    let n1 = first.await.expect("task").expect("n1");
    assert!(n1.inserted);
    let n1 = n1.id;
    assert!(n1 < n2, "n1 was given its id first");
    let n3 = store.job_insert(grouped("G")).await.expect("n3").id;
    let mut ran = Vec::new();
    for _ in 0..3 {
        let claimed = store.job_claim(params("w", 10)).await.expect("claim");
        assert_eq!(claimed.len(), 1, "one job of G at a time: {claimed:?}");
        let job = &claimed[0];
        ran.push(job.id);
        store
            .write_batch(vec![idem::store::Write::Job {
                fence: job.fence(),
                change: idem::store::JobChange::Succeed {
                    plugin_hash: None,
                    plan: None,
                },
            }])
            .await
            .expect("success");
    }
    drop_schema(&schema).await;
    assert_eq!(ran, vec![n2, n1, n3], "commit order: n2, then n1, then n3");
}
