//! The group commit's own failure windows, on both backends, with the
//! `in_flush` failpoint armed in this process (this file is its own test
//! binary, and its cases run one after another, so no other test meets the
//! failpoint): a flush that panics fails only its own writes and the flusher
//! goes on; `flushed()`, what shutdown waits on before it gives leases back,
//! returns only once every queued write has committed.

use idem::failpoint::{self, Action, Failpoint};
use idem::store::group_commit::{GroupCommit, GroupCommitSettings};
use idem::store::{
    ClaimParams, Fence, Job, JobChange, JobState, NewJob, Store, StoreError, Write, Written,
};
use idem_tests::Backend;
use std::sync::Arc;
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(60);

/// `n` jobs inserted and claimed (running, held by `w`).
async fn running_jobs(store: &Arc<dyn Store>, n: u32) -> Vec<Job> {
    for i in 0..n {
        store
            .job_insert(NewJob::new("noop", format!("{{\"n\": {i}}}").into_bytes()))
            .await
            .unwrap();
    }
    let jobs = store
        .job_claim(ClaimParams {
            queue: "default".into(),
            worker: "w".into(),
            limit: n,
            lease: LEASE,
            queue_concurrency: None,
            max_attempts: Default::default(),
        })
        .await
        .unwrap();
    assert_eq!(jobs.len(), n as usize);
    jobs
}

fn succeed(job: &Job) -> Write {
    Write::Job {
        fence: job.fence(),
        change: JobChange::Succeed {
            plugin_hash: None,
            plan: None,
        },
    }
}

async fn state(store: &Arc<dyn Store>, job: &Job) -> JobState {
    store.job_get(job.id).await.unwrap().unwrap().state
}

async fn a_flush_that_panics_fails_its_own_writes_and_the_flusher_goes_on(backend: Backend) {
    let (store, _guard) = idem_tests::store(backend).await;
    let jobs = running_jobs(&store, 2).await;
    let group = GroupCommit::new(store.clone(), GroupCommitSettings::default());
    failpoint::set(Failpoint::InFlush, Action::Panic, Some(1));
    let first = group.write(succeed(&jobs[0])).await;
    match &first {
        Err(StoreError::Batch(why)) => assert!(
            why.to_string().contains("the flush panicked"),
            "the panic is the error: {why}"
        ),
        other => panic!("the panicking flush's write gets its error, got {other:?}"),
    }
    // Whether a panicking flush committed is unknown, so it is never retried.
    assert_eq!(state(&store, &jobs[0]).await, JobState::Running);
    // The lane's flusher is still there: the next write commits.
    let second = tokio::time::timeout(Duration::from_secs(10), group.write(succeed(&jobs[1])))
        .await
        .expect("the next write is answered");
    assert_eq!(second.unwrap(), Written::Job(Fence::Applied));
    assert_eq!(state(&store, &jobs[1]).await, JobState::Succeeded);
    // The backlog shrinks just after the answer is sent (so `flushed`
    // means answered): wait for it rather than race it.
    tokio::time::timeout(Duration::from_secs(10), group.flushed())
        .await
        .expect("nothing stays queued");
    assert_eq!(group.queued(), 0);
}

async fn flushed_returns_once_every_queued_write_has_committed(backend: Backend) {
    let (store, _guard) = idem_tests::store(backend).await;
    let jobs = running_jobs(&store, 5).await;
    let group = GroupCommit::new(store.clone(), GroupCommitSettings::default());
    // Every flush is slow: the writes are still queued or in flight when
    // `flushed` is called.
    failpoint::set(
        Failpoint::InFlush,
        Action::Pause(Duration::from_millis(300)),
        None,
    );
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for job in &jobs {
        let answered = answered.clone();
        group.write_then(succeed(job), move |answer| {
            assert_eq!(answer.unwrap(), Written::Job(Fence::Applied));
            answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
    }
    assert!(group.queued() > 0, "the writes wait behind the slow flush");
    tokio::time::timeout(Duration::from_secs(10), group.flushed())
        .await
        .expect("flushed returns once the flushes are done");
    failpoint::set(Failpoint::InFlush, Action::Off, None);
    assert_eq!(group.queued(), 0);
    assert_eq!(
        answered.load(std::sync::atomic::Ordering::SeqCst),
        jobs.len()
    );
    for job in &jobs {
        assert_eq!(state(&store, job).await, JobState::Succeeded);
    }
}

/// One test per backend, its cases in turn: the failpoint is global to the
/// process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_commit_faults() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        a_flush_that_panics_fails_its_own_writes_and_the_flusher_goes_on(backend).await;
        failpoint::clear();
        flushed_returns_once_every_queued_write_has_committed(backend).await;
        failpoint::clear();
    }
}
