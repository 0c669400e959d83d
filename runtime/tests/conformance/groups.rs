//! Groups (concurrency keys): at most one job of a group runs at a time,
//! in enqueue order; the others wait without using attempts.

use super::*;
use idem::store::{JobState, Replayed};
use std::collections::{HashMap, HashSet};
use tokio::sync::Mutex;

/// A job of `group` for plugin `g`.
fn grouped(group: &str) -> NewJob {
    NewJob {
        group: Some(group.into()),
        ..job("g")
    }
}

async fn insert(store: &Arc<dyn Store>, job: NewJob) -> JobId {
    store.job_insert(job).await.unwrap().id
}

/// Claims up to `limit` jobs; their ids, sorted.
async fn claim_ids(store: &Arc<dyn Store>, worker: &str, limit: u32) -> Vec<JobId> {
    let mut ids: Vec<JobId> = store
        .job_claim(claim_params(worker, limit, LONG))
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.id)
        .collect();
    ids.sort();
    ids
}

pub async fn groups_run_one_at_a_time_in_enqueue_order(store: Arc<dyn Store>) {
    let a1 = insert(&store, grouped("order:1")).await;
    let a2 = insert(&store, grouped("order:1")).await;
    let b1 = insert(&store, grouped("order:2")).await;
    let a3 = insert(&store, grouped("order:1")).await;
    let plain = insert(&store, job("g")).await;
    assert_eq!(
        get(&store, a2).await.group.as_deref(),
        Some("order:1"),
        "the group is stored"
    );
    assert_eq!(get(&store, plain).await.group, None);

    // One of each group, and the plain job: groups do not block each other.
    assert_eq!(claim_ids(&store, "w", 10).await, vec![a1, b1, plain]);
    assert!(
        claim_ids(&store, "w", 10).await.is_empty(),
        "the rest of order:1 waits while a1 runs"
    );
    let waiting = get(&store, a2).await;
    assert_eq!(
        waiting.state,
        JobState::Blocked,
        "behind its group's head, out of the claim's way"
    );
    assert_eq!(waiting.attempt, 0, "a waiting job uses no attempt");

    let a1_job = get(&store, a1).await;
    assert_eq!(
        succeed(&store, &a1_job.fence()).await.unwrap(),
        Fence::Applied
    );
    assert_eq!(get(&store, a2).await.state, JobState::Available);
    assert_eq!(get(&store, a3).await.state, JobState::Blocked);
    assert_eq!(
        claim_ids(&store, "w", 10).await,
        vec![a2],
        "then a2, not a3"
    );
    let a2_job = get(&store, a2).await;
    assert_eq!(
        succeed(&store, &a2_job.fence()).await.unwrap(),
        Fence::Applied
    );
    assert_eq!(claim_ids(&store, "w", 10).await, vec![a3]);
}

pub async fn group_head_retrying_keeps_its_place_and_a_dead_one_lets_the_next_go(
    store: Arc<dyn Store>,
) {
    let a1 = insert(
        &store,
        NewJob {
            max_attempts: 2,
            ..grouped("order:1")
        },
    )
    .await;
    let a2 = insert(&store, grouped("order:1")).await;
    let first = claim_one(&store, "w", LONG).await;
    assert_eq!(first.id, a1);
    retry(
        &store,
        RetryParams {
            fence: first.fence(),
            delay: Duration::from_secs(60),
            error: Some(error(1, "retryable", "timeout")),
            refund_attempt: false,
        },
    )
    .await
    .unwrap();
    assert!(
        claim_ids(&store, "w", 10).await.is_empty(),
        "a2 waits behind a1, which retries in a minute"
    );
    advance(&store, Duration::from_secs(61)).await;
    let second = claim_one(&store, "w", LONG).await;
    assert_eq!((second.id, second.attempt), (a1, 2), "a1 again, first");
    dead_letter(
        &store,
        DeadParams {
            fence: second.fence(),
            error: error(2, "retryable", "timeout"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    let next = claim_one(&store, "w", LONG).await;
    assert_eq!(
        (next.id, next.attempt),
        (a2, 1),
        "a dead job lets the next go"
    );
}

pub async fn group_head_rescued_keeps_its_place_and_a_cancelled_one_lets_the_next_go(
    store: Arc<dyn Store>,
) {
    let a1 = insert(&store, grouped("order:1")).await;
    let a2 = insert(&store, grouped("order:1")).await;
    let a3 = insert(&store, grouped("order:1")).await;
    let lost = claim_one(&store, "crashed", SHORT).await;
    assert_eq!(lost.id, a1);
    advance(&store, PAST_SHORT).await;
    assert_eq!(store.job_rescue_expired(100).await.unwrap(), vec![a1]);
    assert_ne!(get(&store, a1).await.state, JobState::Running);
    let again = claim_one(&store, "w", LONG).await;
    assert_eq!(again.id, a1, "the rescued head runs again before a2");

    // A waiting job of the group cancelled: the one after it moves up.
    assert!(store.job_cancel(a2).await.unwrap());
    assert_eq!(
        succeed(&store, &again.fence()).await.unwrap(),
        Fence::Applied
    );
    assert_eq!(claim_ids(&store, "w", 10).await, vec![a3]);
}

pub async fn group_priority_orders_groups_not_the_jobs_inside(store: Arc<dyn Store>) {
    let a1 = insert(&store, grouped("order:1")).await;
    let a2 = insert(
        &store,
        NewJob {
            priority: 10,
            ..grouped("order:1")
        },
    )
    .await;
    let b1 = insert(
        &store,
        NewJob {
            priority: 5,
            ..grouped("order:2")
        },
    )
    .await;
    let first = claim_one(&store, "w", LONG).await;
    assert_eq!(
        first.id, b1,
        "order:2's head outranks order:1's; a2's priority does not jump its group"
    );
    let second = claim_one(&store, "w", LONG).await;
    assert_eq!(second.id, a1);
    assert!(claim_ids(&store, "w", 10).await.is_empty());
    assert_eq!(
        succeed(&store, &second.fence()).await.unwrap(),
        Fence::Applied
    );
    assert_eq!(claim_ids(&store, "w", 10).await, vec![a2]);
}

pub async fn group_replayed_job_waits_for_the_running_one(store: Arc<dyn Store>) {
    let a1 = insert(
        &store,
        NewJob {
            max_attempts: 1,
            ..grouped("order:1")
        },
    )
    .await;
    let a2 = insert(&store, grouped("order:1")).await;
    let first = claim_one(&store, "w", LONG).await;
    dead_letter(
        &store,
        DeadParams {
            fence: first.fence(),
            error: error(1, "permanent", "missing_reference"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    let running = claim_one(&store, "w", LONG).await;
    assert_eq!(running.id, a2);
    assert_eq!(
        store.job_replay(&[a1]).await.unwrap(),
        Replayed {
            replayed: vec![a1],
            refused: vec![]
        }
    );
    assert!(
        claim_ids(&store, "w", 10).await.is_empty(),
        "the replayed a1 is the head again, but a2 runs"
    );
    assert_eq!(
        succeed(&store, &running.fence()).await.unwrap(),
        Fence::Applied
    );
    assert_eq!(claim_ids(&store, "w", 10).await, vec![a1]);
}

pub async fn group_is_checked_at_insert(store: Arc<dyn Store>) {
    for case in idem::boundary::vectors::of("idempotency_key") {
        let got = store.job_insert(grouped(&case.input)).await;
        match case.expected {
            idem::boundary::vectors::Expected::Accepted => {
                let id = got.unwrap_or_else(|e| panic!("{}: {e}", case.note)).id;
                assert_eq!(get(&store, id).await.group.as_deref(), Some(&*case.input));
            }
            _ => {
                let error = got.expect_err(&case.note);
                assert!(
                    matches!(error, idem::store::StoreError::Invalid(ref why) if why.starts_with("group")),
                    "{}: {error}",
                    case.note
                );
            }
        }
    }
    // A batch with one bad group inserts nothing.
    let before = store.queue_stats(None).await.unwrap().ready;
    let batch = vec![grouped("ok"), grouped("bad\u{0}group")];
    assert!(store.job_insert_many(batch).await.is_err());
    assert_eq!(store.queue_stats(None).await.unwrap().ready, before);
}

/// Workers claim (ahead, several at a time) and finish jobs of few groups
/// concurrently: no two jobs of a group ever run at once, and each group's
/// jobs run in enqueue order.
pub async fn group_claim_race_never_runs_two_of_a_group(store: Arc<dyn Store>) {
    const GROUPS: u64 = 12;
    const JOBS: u64 = 360;
    let jobs: Vec<NewJob> = (0..JOBS)
        .map(|i| grouped(&format!("order:{}", (i * 7 + i / 5) % GROUPS)))
        .collect();
    let ids: Vec<JobId> = store
        .job_insert_many(jobs)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(ids.len() as u64, JOBS);
    // group -> the job of it running now; group -> ids in run order.
    let running: Arc<Mutex<HashMap<String, JobId>>> = Arc::default();
    let order: Arc<Mutex<HashMap<String, Vec<JobId>>>> = Arc::default();
    let barrier = Arc::new(tokio::sync::Barrier::new(6));
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let (store, running, order, barrier) = (
                store.clone(),
                running.clone(),
                order.clone(),
                barrier.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                let worker = format!("w{w}");
                let mut idle = 0;
                while idle < 50 {
                    let claimed = store
                        .job_claim(claim_params(&worker, 3, LONG))
                        .await
                        .unwrap();
                    if claimed.is_empty() {
                        idle += 1;
                        tokio::task::yield_now().await;
                        continue;
                    }
                    idle = 0;
                    for job in &claimed {
                        let group = job.group.clone().expect("grouped");
                        if let Some(other) = running.lock().await.insert(group.clone(), job.id) {
                            panic!("{group}: job {} claimed while job {other} runs", job.id);
                        }
                        order.lock().await.entry(group).or_default().push(job.id);
                    }
                    for job in claimed {
                        // Out of the map before the success commits: the
                        // next of the group can only be claimed after it.
                        running
                            .lock()
                            .await
                            .remove(job.group.as_deref().unwrap_or(""));
                        assert_eq!(succeed(&store, &job.fence()).await.unwrap(), Fence::Applied);
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    let order = order.lock().await;
    let mut seen = HashSet::new();
    for (group, ran) in order.iter() {
        let mut sorted = ran.clone();
        sorted.sort();
        assert_eq!(ran, &sorted, "{group} ran in enqueue order");
        seen.extend(ran.iter().copied());
    }
    assert_eq!(seen.len() as u64, JOBS, "every job ran once");
    assert!(drained(&store).await);
}

/// The state of each job, in the order given.
async fn states(store: &Arc<dyn Store>, ids: &[JobId]) -> Vec<JobState> {
    let mut out = Vec::new();
    for id in ids {
        out.push(get(store, *id).await.state);
    }
    out
}

/// Only a group's head waits in the claim's index: the jobs behind it are
/// `blocked`, whichever way they were enqueued, and each way a head ends
/// (success, dead letter, cancel) makes the next one the head.
pub async fn group_jobs_behind_the_head_are_blocked_until_it_ends(store: Arc<dyn Store>) {
    use Available as A;
    use Blocked as B;
    use JobState::{Available, Blocked};
    // One at a time.
    let a: Vec<JobId> = vec![
        insert(&store, grouped("a")).await,
        insert(&store, grouped("a")).await,
        insert(&store, grouped("a")).await,
    ];
    assert_eq!(states(&store, &a).await, vec![A, B, B]);
    // A batch: its first job of a new group is the head.
    let b: Vec<JobId> = store
        .job_insert_many(vec![grouped("b"), job("g"), grouped("b"), grouped("a")])
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(
        states(&store, &b).await,
        vec![A, A, B, B],
        "b's first job heads b; the plain job is not grouped; a has a head"
    );
    // A batch whose first job of a group is a key held by a finished job:
    // the next new one is the head (nothing else would ever promote it).
    let keyed = |key: &str| NewJob {
        idempotency_key: Some(key.into()),
        ..grouped("c")
    };
    let c0 = insert(&store, keyed("c-0")).await;
    let head = claim_ids(&store, "w", 10).await;
    assert_eq!(head, vec![a[0], b[0], b[1], c0]);
    for id in &head {
        let job = get(&store, *id).await;
        assert_eq!(succeed(&store, &job.fence()).await.unwrap(), Fence::Applied);
    }
    let c: Vec<idem::store::Enqueued> = store
        .job_insert_many(vec![keyed("c-0"), keyed("c-1"), keyed("c-2")])
        .await
        .unwrap();
    assert_eq!((c[0].id, c[0].inserted), (c0, false));
    assert_eq!(
        states(&store, &[c[1].id, c[2].id]).await,
        vec![A, B],
        "c-1 heads c: c-0 is done"
    );

    // Ended by success (above): a's and b's next are heads.
    assert_eq!(
        states(&store, &[a[1], a[2], b[2], b[3]]).await,
        vec![A, B, A, B]
    );
    // Ended by the dead-letter queue.
    let a1 = claim_one(&store, "w", LONG).await;
    assert_eq!(a1.id, a[1]);
    dead_letter(
        &store,
        DeadParams {
            fence: a1.fence(),
            error: error(1, "permanent", "missing_reference"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    assert_eq!(states(&store, &[a[2], b[3]]).await, vec![A, B]);
    // Ended by a cancel of a waiting head: a[2] was a's head, and b[3]
    // (a job of group a) is next.
    assert!(store.job_cancel(a[2]).await.unwrap());
    assert_eq!(states(&store, &[b[3]]).await, vec![A]);
    // Nothing left blocked with no head: every group drains.
    let mut done = 0;
    loop {
        let claimed = store.job_claim(claim_params("w", 10, LONG)).await.unwrap();
        if claimed.is_empty() {
            break;
        }
        for job in claimed {
            assert_eq!(succeed(&store, &job.fence()).await.unwrap(), Fence::Applied);
            done += 1;
        }
    }
    assert_eq!(done, 4, "b[2], b[3], c-1 and c-2");
    let stats = store.queue_stats(None).await.unwrap();
    assert_eq!(stats.count(JobState::Blocked), 0);
}

/// A hot group's backlog is blocked, out of the claim's index: a claim
/// finds the plain jobs behind it without reading the backlog.
pub async fn group_hot_backlog_stays_out_of_the_claim(store: Arc<dyn Store>) {
    let backlog: Vec<NewJob> = (0..2_000).map(|_| grouped("hot")).collect();
    let hot = store.job_insert_many(backlog).await.unwrap();
    let plain: Vec<JobId> = store
        .job_insert_many((0..5).map(|_| job("g")).collect())
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    let stats = store.queue_stats(None).await.unwrap();
    assert_eq!(stats.count(JobState::Blocked), 1_999);
    assert_eq!(stats.ready, 6, "the hot group's head and the plain jobs");
    let mut want = vec![hot[0].id];
    want.extend(&plain);
    assert_eq!(claim_ids(&store, "w", 100).await, want);
}
