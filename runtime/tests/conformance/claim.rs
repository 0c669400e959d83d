//! Claims: exactly once under concurrency, in order, on time, within limits.

use super::*;
use idem::store::JobState;
use std::collections::HashSet;

pub async fn claim_race_exactly_once(store: Arc<dyn Store>) {
    let jobs: Vec<NewJob> = (0..1_000).map(|_| job("race")).collect();
    let inserted: HashSet<JobId> = store
        .job_insert_many(jobs)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(inserted.len(), 1_000);

    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let store = store.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let worker = format!("worker-{w}");
                let mut mine = Vec::new();
                loop {
                    let claimed = store
                        .job_claim(claim_params(&worker, 7, LONG))
                        .await
                        .unwrap();
                    if claimed.is_empty() {
                        break;
                    }
                    for job in claimed {
                        assert_eq!(job.state, JobState::Running);
                        assert_eq!(job.attempt, 1);
                        assert_eq!(job.lease_owner.as_deref(), Some(worker.as_str()));
                        mine.push(job.id);
                    }
                }
                mine
            })
        })
        .collect();
    let mut seen = HashSet::new();
    let mut total = 0;
    for worker in workers {
        for id in worker.await.unwrap() {
            total += 1;
            assert!(seen.insert(id), "job {id} claimed twice");
        }
    }
    assert_eq!(total, 1_000);
    assert_eq!(seen, inserted);
    let stats = store.queue_stats(Some("default")).await.unwrap();
    assert_eq!(stats.count(JobState::Running), 1_000);
    assert_eq!(stats.count(JobState::Available), 0);
}

pub async fn claim_orders_by_priority_run_at_id(store: Arc<dyn Store>) {
    let low = store.job_insert(job("p")).await.unwrap().id;
    let high = store
        .job_insert(NewJob {
            priority: 5,
            ..job("p")
        })
        .await
        .unwrap()
        .id;
    let high_next = store
        .job_insert(NewJob {
            priority: 5,
            ..job("p")
        })
        .await
        .unwrap()
        .id;
    let mid = store
        .job_insert(NewJob {
            priority: 1,
            ..job("p")
        })
        .await
        .unwrap()
        .id;
    let negative = store
        .job_insert(NewJob {
            priority: -3,
            ..job("p")
        })
        .await
        .unwrap()
        .id;

    let first = store.job_claim(claim_params("w", 2, LONG)).await.unwrap();
    assert_eq!(
        first.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![high, high_next]
    );
    let rest = store.job_claim(claim_params("w", 10, LONG)).await.unwrap();
    assert_eq!(
        rest.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![mid, low, negative]
    );

    // An older run_at wins over a lower id at equal priority: a job whose
    // retry is due sooner runs first.
    let a = store
        .job_insert(NewJob {
            priority: 9,
            ..job("q")
        })
        .await
        .unwrap()
        .id;
    let b = store
        .job_insert(NewJob {
            priority: 9,
            ..job("q")
        })
        .await
        .unwrap()
        .id;
    let claimed_a = claim_one(&store, "w", LONG).await;
    assert_eq!(claimed_a.id, a);
    advance(&store, Duration::from_millis(20)).await;
    // a is retried with no delay: its run_at is now later than b's.
    retry(
        &store,
        RetryParams {
            fence: claimed_a.fence(),
            delay: Duration::ZERO,
            error: None,
            refund_attempt: false,
        },
    )
    .await
    .unwrap();
    let next = store.job_claim(claim_params("w", 2, LONG)).await.unwrap();
    assert_eq!(next.iter().map(|j| j.id).collect::<Vec<_>>(), vec![b, a]);
}

pub async fn claim_skips_scheduled_jobs(store: Arc<dyn Store>) {
    let later = store
        .job_insert(NewJob {
            delay: Duration::from_secs(500),
            ..job("s")
        })
        .await
        .unwrap()
        .id;
    let far = store
        .job_insert(NewJob {
            delay: Duration::from_secs(3600),
            ..job("s")
        })
        .await
        .unwrap()
        .id;
    assert!(
        store
            .job_claim(claim_params("w", 10, LONG))
            .await
            .unwrap()
            .is_empty()
    );
    advance(&store, Duration::from_secs(490)).await;
    assert!(
        store
            .job_claim(claim_params("w", 10, LONG))
            .await
            .unwrap()
            .is_empty(),
        "not due before its delay"
    );
    advance(&store, Duration::from_secs(11)).await;
    let claimed = store.job_claim(claim_params("w", 10, LONG)).await.unwrap();
    assert_eq!(
        claimed.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![later]
    );
    assert_eq!(get(&store, far).await.state, JobState::Available);
}

pub async fn claim_sets_lease_and_stays_in_queue(store: Arc<dyn Store>) {
    let mail = store
        .job_insert(NewJob {
            queue: "mail".into(),
            ..job("m")
        })
        .await
        .unwrap()
        .id;
    let other = store
        .job_insert(NewJob {
            queue: "other".into(),
            ..job("m")
        })
        .await
        .unwrap()
        .id;
    assert!(
        store
            .job_claim(claim_params("w", 10, LONG))
            .await
            .unwrap()
            .is_empty(),
        "default is empty"
    );
    assert!(
        store
            .job_claim(claim_params("w", 0, LONG))
            .await
            .unwrap()
            .is_empty()
    );

    let params = ClaimParams {
        queue: "mail".into(),
        ..claim_params("worker-1", 10, Duration::from_secs(30))
    };
    let claimed = store.job_claim(params.clone()).await.unwrap();
    assert_eq!(claimed.len(), 1);
    let job = &claimed[0];
    assert_eq!(job.id, mail);
    assert_eq!(job.state, JobState::Running);
    assert_eq!(job.attempt, 1);
    assert_eq!(job.lease_owner.as_deref(), Some("worker-1"));
    let heartbeat = job.heartbeat_at_ms.expect("heartbeat set");
    let lease = job.lease_until_ms.expect("lease set") - heartbeat;
    assert!(
        (29_900..=30_100).contains(&lease),
        "lease of 30 s, got {lease} ms"
    );
    assert_eq!(
        get(&store, mail).await,
        *job,
        "the claim returns the stored row"
    );
    assert!(
        store.job_claim(params).await.unwrap().is_empty(),
        "claimed once"
    );
    assert_eq!(get(&store, other).await.state, JobState::Available);

    let empty_worker = store
        .job_claim(claim_params("", 1, LONG))
        .await
        .unwrap_err();
    assert!(matches!(empty_worker, idem::store::StoreError::Invalid(_)));
}

pub async fn claim_respects_queue_concurrency(store: Arc<dyn Store>) {
    store
        .job_insert_many((0..10).map(|_| job("c")).collect())
        .await
        .unwrap();
    let limited = |worker: &str, limit: u32| ClaimParams {
        queue_concurrency: Some(3),
        ..claim_params(worker, limit, LONG)
    };
    let a = store.job_claim(limited("a", 10)).await.unwrap();
    assert_eq!(a.len(), 3);
    assert!(
        store.job_claim(limited("b", 10)).await.unwrap().is_empty(),
        "queue is full"
    );
    succeed(&store, &a[0].fence()).await.unwrap();
    let b = store.job_claim(limited("b", 10)).await.unwrap();
    assert_eq!(b.len(), 1);
    assert!(store.job_claim(limited("b", 10)).await.unwrap().is_empty());
    // Without a limit the rest can be claimed.
    assert_eq!(
        store
            .job_claim(claim_params("c", 10, LONG))
            .await
            .unwrap()
            .len(),
        6
    );
}

pub async fn claim_queue_concurrency_race(store: Arc<dyn Store>) {
    store
        .job_insert_many((0..40).map(|_| job("c")).collect())
        .await
        .unwrap();
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|w| {
            let store = store.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let params = ClaimParams {
                    queue_concurrency: Some(3),
                    ..claim_params(&format!("w{w}"), 2, LONG)
                };
                store.job_claim(params).await.unwrap().len()
            })
        })
        .collect();
    let total: usize = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .sum();
    assert_eq!(total, 3, "exactly the queue limit is running");
    let stats = store.queue_stats(Some("default")).await.unwrap();
    assert_eq!(stats.count(JobState::Running), 3);
}
