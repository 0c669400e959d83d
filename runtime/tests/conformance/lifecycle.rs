//! Leases, fencing, retries, release, plans, cancel, pruning, stats, wake-ups.

use super::*;
use idem::store::{Fence, JobChange, JobState, PruneParams, SavePlanParams, Write, Written};

pub async fn lease_expiry_rescue_fences_stale_worker(store: Arc<dyn Store>) {
    let id = store.job_insert(job("slow")).await.unwrap().id;
    let a = claim_one(&store, "worker-a", SHORT).await;
    assert!(
        store.job_rescue_expired(100).await.unwrap().is_empty(),
        "lease still running"
    );
    advance(&store, PAST_SHORT).await;

    assert_eq!(store.job_rescue_expired(100).await.unwrap(), vec![id]);
    let rescued = get(&store, id).await;
    assert_eq!(rescued.state, JobState::Available);
    assert_eq!(rescued.rescues, 1);
    assert_eq!(rescued.attempt, 1, "the expired attempt counts");
    assert_eq!(rescued.lease_owner, None);
    assert_eq!(rescued.lease_until_ms, None);
    assert!(
        store.job_rescue_expired(100).await.unwrap().is_empty(),
        "rescued once"
    );

    let b = claim_one(&store, "worker-b", LONG).await;
    assert_eq!(b.id, id);
    assert_eq!(b.attempt, 2);
    let before = get(&store, id).await;

    // Worker A is still alive and tries every finishing write: all fenced.
    let stale = a.fence();
    assert_eq!(succeed(&store, &stale).await.unwrap(), Fence::FencedOut);
    assert_eq!(
        heartbeat(
            &store,
            HeartbeatParams {
                fence: stale.clone(),
                lease: LONG
            }
        )
        .await
        .unwrap(),
        Fence::FencedOut
    );
    assert_eq!(
        store
            .job_save_plan(SavePlanParams {
                fence: stale.clone(),
                plan: ("[]").to_string(),
                plugin_hash: "h".into()
            })
            .await
            .unwrap(),
        Fence::FencedOut
    );
    // Every kind of job write at once, as one batch: all fenced out.
    let batch = store
        .write_batch(
            [
                JobChange::Heartbeat {
                    lease: LONG,
                    started: true,
                },
                JobChange::Succeed {
                    plugin_hash: Some("h".into()),
                    plan: Some("[]".into()),
                },
                JobChange::Release,
            ]
            .into_iter()
            .map(|change| Write::Job {
                fence: stale.clone(),
                change,
            })
            .collect(),
        )
        .await
        .unwrap();
    assert_eq!(batch, vec![Written::Job(Fence::FencedOut); 3]);
    assert_eq!(
        retry(
            &store,
            RetryParams {
                fence: stale.clone(),
                delay: Duration::ZERO,
                error: Some(error(1, "retryable", "timeout")),
                refund_attempt: true,
            }
        )
        .await
        .unwrap(),
        Fence::FencedOut
    );
    assert_eq!(
        dead_letter(
            &store,
            DeadParams {
                fence: stale.clone(),
                error: error(1, "permanent", "bad"),
                redact_payload: true,
            }
        )
        .await
        .unwrap(),
        Fence::FencedOut
    );
    assert_eq!(store.job_release(&stale).await.unwrap(), Fence::FencedOut);
    // Same worker name but the old attempt, or the new attempt under A's name.
    assert_eq!(
        succeed(&store, &other_worker(&b.fence(), "worker-a"))
            .await
            .unwrap(),
        Fence::FencedOut
    );
    assert_eq!(get(&store, id).await, before, "the row is unchanged");

    assert_eq!(succeed(&store, &b.fence()).await.unwrap(), Fence::Applied);
    let done = get(&store, id).await;
    assert_eq!(done.state, JobState::Succeeded);
    assert!(done.finished_at_ms.is_some());
    assert_eq!(done.lease_owner, None);
    assert_eq!(
        succeed(&store, &b.fence()).await.unwrap(),
        Fence::FencedOut,
        "once"
    );
}

pub async fn heartbeat_extends_lease(store: Arc<dyn Store>) {
    let id = store.job_insert(job("hb")).await.unwrap().id;
    let claimed = claim_one(&store, "w", SHORT).await;
    advance(&store, Duration::from_secs(10)).await;
    let fence = claimed.fence();
    assert_eq!(
        heartbeat(
            &store,
            HeartbeatParams {
                fence: fence.clone(),
                lease: Duration::from_secs(50)
            }
        )
        .await
        .unwrap(),
        Fence::Applied
    );
    let beaten = get(&store, id).await;
    // Claimed with 30 s at t, beaten 10 s later with 50 s: 30 s more.
    let extended = beaten.lease_until_ms.unwrap() - claimed.lease_until_ms.unwrap();
    assert!((29_900..=30_500).contains(&extended), "{extended} ms");
    assert!(beaten.heartbeat_at_ms.unwrap() >= claimed.heartbeat_at_ms.unwrap() + 10_000);
    advance(&store, PAST_SHORT).await;
    assert!(
        store.job_rescue_expired(100).await.unwrap().is_empty(),
        "a heartbeated job is not rescued"
    );
    let job = get(&store, id).await;
    assert_eq!(job.state, JobState::Running);
    assert_eq!(job.rescues, 0);
    assert_eq!(
        heartbeat(
            &store,
            HeartbeatParams {
                fence: other_worker(&fence, "intruder"),
                lease: LONG
            }
        )
        .await
        .unwrap(),
        Fence::FencedOut
    );
}

pub async fn rescue_without_attempts_left_is_dead(store: Arc<dyn Store>) {
    let id = store
        .job_insert(NewJob {
            max_attempts: 1,
            ..job("once")
        })
        .await
        .unwrap()
        .id;
    let other = store
        .job_insert(NewJob {
            max_attempts: 2,
            ..job("twice")
        })
        .await
        .unwrap()
        .id;
    claim_one(&store, "w", SHORT).await;
    claim_one(&store, "w", SHORT).await;
    advance(&store, PAST_SHORT).await;
    assert_eq!(
        store.job_rescue_expired(1).await.unwrap().len(),
        1,
        "limit respected"
    );
    assert_eq!(store.job_rescue_expired(10).await.unwrap().len(), 1);

    let dead = get(&store, id).await;
    assert_eq!(dead.state, JobState::Dead);
    assert_eq!(dead.last_error_code.as_deref(), Some("lease_expired"));
    assert!(dead.last_error_message.is_some());
    assert_eq!(dead.rescues, 1);
    assert_eq!(dead.attempt, 1);
    assert!(dead.finished_at_ms.is_some());
    assert!(dead.first_failed_at_ms.unwrap() <= dead.last_failed_at_ms.unwrap());
    let record = dead.errors.last().expect("history");
    assert_eq!(record.code, "lease_expired");
    assert_eq!(record.attempt, 1);
    assert!(record.at_ms >= dead.created_at_ms);

    let again = get(&store, other).await;
    assert_eq!(again.state, JobState::Available, "an attempt is left");
    assert!(again.errors.is_empty());

    // Redaction after the fact: only dead jobs, only once.
    let original = dead.payload.clone();
    assert_eq!(store.job_redact_payloads(&[id, other]).await.unwrap(), 1);
    let redacted = get(&store, id).await.payload;
    assert_ne!(redacted, original);
    assert!(
        String::from_utf8(redacted.clone())
            .unwrap()
            .contains("\"redacted\":true")
    );
    assert_eq!(
        get(&store, other).await.payload,
        again.payload,
        "a live job keeps its payload"
    );
    assert_eq!(
        store.job_redact_payloads(&[id]).await.unwrap(),
        0,
        "already redacted"
    );
    assert_eq!(get(&store, id).await.payload, redacted);
}

pub async fn retrying_not_claimable_before_run_at(store: Arc<dyn Store>) {
    let id = store.job_insert(job("r")).await.unwrap().id;
    let claimed = claim_one(&store, "w", LONG).await;
    let fence = claimed.fence();
    let outcome = retry(
        &store,
        RetryParams {
            fence,
            delay: Duration::from_secs(400),
            error: Some(error(1, "retryable", "provider_timeout")),
            refund_attempt: false,
        },
    )
    .await
    .unwrap();
    assert_eq!(outcome, Fence::Applied);
    let waiting = get(&store, id).await;
    assert_eq!(waiting.state, JobState::Retrying);
    assert_eq!(waiting.attempt, 1);
    assert_eq!(waiting.lease_owner, None);
    assert_eq!(waiting.lease_until_ms, None);
    assert!(waiting.run_at_ms >= waiting.updated_at_ms + 399_000);
    assert_eq!(waiting.last_error_code.as_deref(), Some("provider_timeout"));
    assert_eq!(
        waiting.last_error_message.as_deref(),
        Some("provider_timeout happened")
    );
    assert_eq!(waiting.errors.len(), 1);
    assert!(waiting.first_failed_at_ms.is_some());

    assert!(
        store
            .job_claim(claim_params("w", 10, LONG))
            .await
            .unwrap()
            .is_empty()
    );
    advance(&store, Duration::from_secs(399)).await;
    assert!(
        store
            .job_claim(claim_params("w", 10, LONG))
            .await
            .unwrap()
            .is_empty(),
        "not before run_at"
    );
    advance(&store, Duration::from_secs(2)).await;
    let again = claim_one(&store, "w2", LONG).await;
    assert_eq!(again.id, id);
    assert_eq!(again.attempt, 2);
}

pub async fn retrying_refunds_attempt(store: Arc<dyn Store>) {
    let id = store.job_insert(job("defer")).await.unwrap().id;
    let first = claim_one(&store, "w", LONG).await;
    assert_eq!(first.attempt, 1);
    retry(
        &store,
        RetryParams {
            fence: first.fence(),
            delay: Duration::ZERO,
            error: None,
            refund_attempt: true,
        },
    )
    .await
    .unwrap();
    let deferred = get(&store, id).await;
    assert_eq!(deferred.state, JobState::Retrying);
    assert_eq!(deferred.attempt, 0, "a deferral gives the attempt back");
    assert!(deferred.errors.is_empty(), "no failure recorded");
    assert_eq!(deferred.last_error_code, None);
    assert_eq!(deferred.first_failed_at_ms, None);

    let second = claim_one(&store, "w", LONG).await;
    assert_eq!(second.attempt, 1);
    // A refund with an error still records it.
    retry(
        &store,
        RetryParams {
            fence: second.fence(),
            delay: Duration::ZERO,
            error: Some(error(1, "retryable", "circuit_open")),
            refund_attempt: true,
        },
    )
    .await
    .unwrap();
    let recorded = get(&store, id).await;
    assert_eq!(recorded.attempt, 0);
    assert_eq!(recorded.last_error_code.as_deref(), Some("circuit_open"));
    assert_eq!(recorded.errors.len(), 1);
    // The first claim's fence does not come back to life.
    assert_eq!(claim_one(&store, "w", LONG).await.attempt, 1);
}

pub async fn release_at_shutdown(store: Arc<dyn Store>) {
    let id = store.job_insert(job("rel")).await.unwrap().id;
    let claimed = claim_one(&store, "w", LONG).await;
    assert_eq!(
        store.job_release(&claimed.fence()).await.unwrap(),
        Fence::Applied
    );
    let released = get(&store, id).await;
    assert_eq!(released.state, JobState::Available);
    assert_eq!(released.attempt, 0, "a give-back uses up no attempt");
    assert_eq!(released.interruptions, 1, "it is counted apart");
    assert_eq!(released.lease_owner, None);
    assert_eq!(released.lease_until_ms, None);
    assert!(released.run_at_ms >= claimed.run_at_ms);
    assert_eq!(
        store.job_release(&claimed.fence()).await.unwrap(),
        Fence::FencedOut
    );
    let again = claim_one(&store, "w2", LONG).await;
    assert_eq!(again.id, id);
    assert_eq!(again.attempt, 1);
    assert_eq!(again.interruptions, 1);
}

/// Shutdowns can give a job back any number of times: the claim never hands
/// out an attempt beyond `max_attempts`.
pub async fn give_backs_never_exceed_max_attempts(store: Arc<dyn Store>) {
    let id = store
        .job_insert(NewJob {
            max_attempts: 2,
            ..job("rel")
        })
        .await
        .unwrap()
        .id;
    for round in 1..=5 {
        let claimed = claim_one(&store, "w", LONG).await;
        assert_eq!(claimed.id, id);
        assert!(
            claimed
                .max_attempts
                .is_some_and(|max| claimed.attempt <= max),
            "round {round}: {claimed:?}"
        );
        assert_eq!(claimed.interruptions, round - 1);
        assert_eq!(
            store.job_release(&claimed.fence()).await.unwrap(),
            Fence::Applied
        );
    }
}

pub async fn plan_saved_once(store: Arc<dyn Store>) {
    let id = store.job_insert(job("plan")).await.unwrap().id;
    let a = claim_one(&store, "a", SHORT).await;
    assert_eq!(
        store
            .job_save_plan(SavePlanParams {
                fence: a.fence(),
                plan: (r#"[{"k":"one"}]"#).to_string(),
                plugin_hash: "hash-1".into()
            })
            .await
            .unwrap(),
        Fence::Applied
    );
    let saved = get(&store, id).await;
    assert_eq!(saved.plan.as_deref(), Some(r#"[{"k":"one"}]"#));
    assert_eq!(saved.plan_hash.as_deref(), Some("hash-1"));
    assert_eq!(saved.plugin_hash.as_deref(), Some("hash-1"));

    // A second save keeps the first plan (and still reports the fence held).
    assert_eq!(
        store
            .job_save_plan(SavePlanParams {
                fence: a.fence(),
                plan: (r#"[{"k":"two"}]"#).to_string(),
                plugin_hash: "hash-2".into()
            })
            .await
            .unwrap(),
        Fence::Applied
    );
    assert_eq!(
        get(&store, id).await.plan.as_deref(),
        Some(r#"[{"k":"one"}]"#)
    );

    // Redelivered after a plugin upgrade: the first plan stays.
    advance(&store, PAST_SHORT).await;
    assert_eq!(store.job_rescue_expired(10).await.unwrap(), vec![id]);
    let b = claim_one(&store, "b", LONG).await;
    assert_eq!(
        b.plan.as_deref(),
        Some(r#"[{"k":"one"}]"#),
        "the claim carries the plan"
    );
    assert_eq!(
        store
            .job_save_plan(SavePlanParams {
                fence: b.fence(),
                plan: (r#"[{"k":"two"}]"#).to_string(),
                plugin_hash: "hash-2".into()
            })
            .await
            .unwrap(),
        Fence::Applied
    );
    let kept = get(&store, id).await;
    assert_eq!(kept.plan.as_deref(), Some(r#"[{"k":"one"}]"#));
    assert_eq!(kept.plan_hash.as_deref(), Some("hash-1"));
    assert_eq!(kept.plugin_hash.as_deref(), Some("hash-2"));
    assert_eq!(
        store
            .job_save_plan(SavePlanParams {
                fence: a.fence(),
                plan: ("[]").to_string(),
                plugin_hash: "x".into()
            })
            .await
            .unwrap(),
        Fence::FencedOut
    );
}

pub async fn error_history_is_bounded(store: Arc<dyn Store>) {
    let id = store
        .job_insert(NewJob {
            max_attempts: 50,
            ..job("flaky")
        })
        .await
        .unwrap()
        .id;
    let total = idem::store::ERROR_HISTORY + 3;
    for i in 0..total {
        let claimed = claim_one(&store, "w", LONG).await;
        retry(
            &store,
            RetryParams {
                fence: claimed.fence(),
                delay: Duration::ZERO,
                error: Some(error(claimed.attempt, "retryable", &format!("e{i}"))),
                refund_attempt: false,
            },
        )
        .await
        .unwrap();
    }
    let job = get(&store, id).await;
    assert_eq!(job.errors.len(), idem::store::ERROR_HISTORY);
    let codes: Vec<String> = job.errors.iter().map(|e| e.code.clone()).collect();
    let expected: Vec<String> = (3..total).map(|i| format!("e{i}")).collect();
    assert_eq!(codes, expected, "oldest dropped, order kept");
    let attempts: Vec<u32> = job.errors.iter().map(|e| e.attempt).collect();
    assert!(attempts.windows(2).all(|w| w[0] < w[1]));
    assert!(job.errors.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
    assert_eq!(job.attempt as usize, total);
    assert_eq!(
        job.last_error_code.as_deref(),
        Some(format!("e{}", total - 1).as_str())
    );
}

pub async fn cancel_only_waiting_jobs(store: Arc<dyn Store>) {
    let waiting = store.job_insert(job("c")).await.unwrap().id;
    assert!(store.job_cancel(waiting).await.unwrap());
    let cancelled = get(&store, waiting).await;
    assert_eq!(cancelled.state, JobState::Cancelled);
    assert!(cancelled.finished_at_ms.is_some());
    assert!(
        !store.job_cancel(waiting).await.unwrap(),
        "already cancelled"
    );

    let running = store.job_insert(job("c")).await.unwrap().id;
    let claimed = claim_one(&store, "w", LONG).await;
    assert_eq!(claimed.id, running, "the cancelled job is not claimable");
    assert!(
        !store.job_cancel(running).await.unwrap(),
        "a running job is not cancelled"
    );

    retry(
        &store,
        RetryParams {
            fence: claimed.fence(),
            delay: Duration::from_secs(3600),
            error: None,
            refund_attempt: false,
        },
    )
    .await
    .unwrap();
    assert!(
        store.job_cancel(running).await.unwrap(),
        "a retrying job is"
    );
    assert!(!store.job_cancel(JobId(i64::MAX)).await.unwrap());
}

pub async fn prune_deletes_finished_past_retention(store: Arc<dyn Store>) {
    let prune = |succeeded_ms: u64, dead_ms: u64, limit: u32| PruneParams {
        succeeded_older_than: Duration::from_millis(succeeded_ms),
        dead_older_than: Duration::from_millis(dead_ms),
        limit,
    };
    let done = store.job_insert(job("p")).await.unwrap().id;
    let dead = store.job_insert(job("p")).await.unwrap().id;
    let cancelled = store.job_insert(job("p")).await.unwrap().id;
    let running = store.job_insert(job("p")).await.unwrap().id;
    let a = claim_one(&store, "w", LONG).await;
    succeed(&store, &a.fence()).await.unwrap();
    let b = claim_one(&store, "w", LONG).await;
    dead_letter(
        &store,
        DeadParams {
            fence: b.fence(),
            error: error(1, "permanent", "x"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    assert!(store.job_cancel(cancelled).await.unwrap());
    claim_one(&store, "w", LONG).await;
    let waiting = store.job_insert(job("p")).await.unwrap().id;

    assert_eq!(
        store
            .job_delete_finished(prune(3_600_000, 3_600_000, 100))
            .await
            .unwrap(),
        0,
        "too young"
    );
    advance(&store, Duration::from_secs(60)).await;
    assert_eq!(
        store
            .job_delete_finished(prune(20_000, 3_600_000, 100))
            .await
            .unwrap(),
        2
    );
    assert!(store.job_get(done).await.unwrap().is_none());
    assert!(store.job_get(cancelled).await.unwrap().is_none());
    assert!(
        store.job_get(dead).await.unwrap().is_some(),
        "dead jobs have their own retention"
    );
    assert_eq!(
        store
            .job_delete_finished(prune(20_000, 20_000, 100))
            .await
            .unwrap(),
        1
    );
    assert!(store.job_get(dead).await.unwrap().is_none());
    assert!(
        store.job_get(running).await.unwrap().is_some(),
        "unfinished jobs stay"
    );
    assert!(store.job_get(waiting).await.unwrap().is_some());

    // The limit bounds one call.
    for _ in 0..3 {
        store.job_insert(job("q")).await.unwrap();
        let c = claim_one(&store, "w", LONG).await;
        succeed(&store, &c.fence()).await.unwrap();
    }
    advance(&store, Duration::from_secs(60)).await;
    assert_eq!(
        store.job_delete_finished(prune(20, 20, 2)).await.unwrap(),
        2
    );
    assert_eq!(
        store.job_delete_finished(prune(20, 20, 2)).await.unwrap(),
        1
    );
    assert_eq!(
        store.job_delete_finished(prune(20, 20, 2)).await.unwrap(),
        0
    );
}

pub async fn stats_and_drained(store: Arc<dyn Store>) {
    assert!(drained(&store).await, "empty store is drained");
    let stats = store.queue_stats(None).await.unwrap();
    assert_eq!(stats.ready, 0);
    assert_eq!(stats.oldest_ready_age_ms, None);
    assert!(
        idem::store::JobState::ALL
            .iter()
            .all(|s| stats.count(*s) == 0)
    );

    // A job a producer scheduled for later does not block draining.
    store
        .job_insert(NewJob {
            delay: Duration::from_secs(3600),
            ..job("s")
        })
        .await
        .unwrap();
    assert!(drained(&store).await);

    let ready = store.job_insert(job("s")).await.unwrap().id;
    store
        .job_insert(NewJob {
            queue: "other".into(),
            ..job("s")
        })
        .await
        .unwrap();
    assert!(!drained(&store).await);
    advance(&store, Duration::from_secs(30)).await;
    let stats = store.queue_stats(Some("default")).await.unwrap();
    assert_eq!(stats.count(JobState::Available), 2);
    assert_eq!(stats.ready, 1);
    let age = stats.oldest_ready_age_ms.unwrap();
    assert!((30_000..35_000).contains(&age), "{age} ms");
    let all = store.queue_stats(None).await.unwrap();
    assert_eq!(all.count(JobState::Available), 3);
    assert_eq!(all.ready, 2);

    let claimed = claim_one(&store, "w", LONG).await;
    assert_eq!(claimed.id, ready);
    assert!(!drained(&store).await);
    let stats = store.queue_stats(Some("default")).await.unwrap();
    assert_eq!(stats.count(JobState::Running), 1);
    assert_eq!(stats.ready, 0);

    // Retrying counts as not drained even while it waits.
    retry(
        &store,
        RetryParams {
            fence: claimed.fence(),
            delay: Duration::from_secs(3600),
            error: Some(error(1, "retryable", "x")),
            refund_attempt: false,
        },
    )
    .await
    .unwrap();
    assert!(!drained(&store).await);
    assert_eq!(
        store
            .queue_stats(Some("default"))
            .await
            .unwrap()
            .count(JobState::Retrying),
        1
    );
    assert!(store.job_cancel(ready).await.unwrap());

    let other = store
        .job_claim(ClaimParams {
            queue: "other".into(),
            ..claim_params("w", 1, LONG)
        })
        .await
        .unwrap();
    succeed(&store, &other[0].fence()).await.unwrap();
    assert!(drained(&store).await);
    let all = store.queue_stats(None).await.unwrap();
    assert_eq!(all.count(JobState::Succeeded), 1);
    assert_eq!(all.count(JobState::Cancelled), 1);
    assert_eq!(all.count(JobState::Available), 1);
}

pub async fn wait_for_jobs_wakes_on_insert(store: Arc<dyn Store>) {
    // The timeout is honoured: the wait ends on its own.
    tokio::time::timeout(
        Duration::from_secs(10),
        store.wait_for_jobs(Duration::from_millis(100)),
    )
    .await
    .expect("the wait ends at its timeout");

    // A waiter is woken by an insert long before its own timeout of an hour.
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait_for_jobs(Duration::from_secs(3600)).await })
    };
    tokio::task::yield_now().await;
    store.job_insert(job("wake")).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("woken by the insert")
        .unwrap();
}

pub async fn stale_attempt_of_same_worker_is_fenced(store: Arc<dyn Store>) {
    let id = store.job_insert(job("again")).await.unwrap().id;
    let first = claim_one(&store, "worker-a", SHORT).await;
    advance(&store, PAST_SHORT).await;
    assert_eq!(store.job_rescue_expired(10).await.unwrap(), vec![id]);
    // The same worker takes the job again: a new attempt, a new fence.
    let second = claim_one(&store, "worker-a", LONG).await;
    assert_eq!(second.attempt, first.attempt + 1);
    let before = get(&store, id).await;
    assert_eq!(
        succeed(&store, &first.fence()).await.unwrap(),
        Fence::FencedOut
    );
    assert_eq!(
        heartbeat(
            &store,
            HeartbeatParams {
                fence: first.fence(),
                lease: LONG
            }
        )
        .await
        .unwrap(),
        Fence::FencedOut
    );
    assert_eq!(get(&store, id).await, before);
    assert_eq!(
        succeed(&store, &second.fence()).await.unwrap(),
        Fence::Applied
    );
}

pub async fn queue_overview_matches_queue_stats(store: Arc<dyn Store>) {
    assert!(store.queue_overview().await.unwrap().is_empty());
    for queue in ["mail", "billing", "billing"] {
        store
            .job_insert(NewJob {
                queue: queue.into(),
                ..job("s")
            })
            .await
            .unwrap();
    }
    store.job_insert(job("s")).await.unwrap();
    let mut claims = store
        .job_claim(ClaimParams {
            queue: "billing".into(),
            ..claim_params("w", 2, LONG)
        })
        .await
        .unwrap();
    let done = claims.pop().unwrap();
    let dies = claims.pop().unwrap();
    succeed(&store, &done.fence()).await.unwrap();
    dead_letter(
        &store,
        DeadParams {
            fence: dies.fence(),
            error: error(1, "permanent", "invalid_amount"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    advance(&store, Duration::from_secs(5)).await;
    let overview = store.queue_overview().await.unwrap();
    let names: Vec<&str> = overview.iter().map(|(q, _)| q.as_str()).collect();
    assert_eq!(names, ["billing", "default", "mail"]);
    for (queue, stats) in &overview {
        let one = store.queue_stats(Some(queue)).await.unwrap();
        assert_eq!(stats.by_state, one.by_state, "{queue}");
        assert_eq!(stats.ready, one.ready, "{queue}");
        // The clock runs on between the two reads.
        match (stats.oldest_ready_age_ms, one.oldest_ready_age_ms) {
            (Some(a), Some(b)) => assert!((a - b).abs() < 1000, "{queue}: {a} vs {b}"),
            (a, b) => assert_eq!(a, b, "{queue}"),
        }
        assert_eq!(
            stats.succeeded_last_minute, one.succeeded_last_minute,
            "{queue}"
        );
        assert_eq!(stats.dead_last_minute, one.dead_last_minute, "{queue}");
        assert_eq!(stats.dead_by_code, one.dead_by_code, "{queue}");
    }
    let billing = &overview[0].1;
    assert_eq!(billing.count(JobState::Succeeded), 1);
    assert_eq!(billing.succeeded_last_minute, 1);
    assert_eq!(billing.dead_last_minute, 1);
    assert_eq!(billing.dead_by_code, [("invalid_amount".to_string(), 1)]);
    assert_eq!(overview[1].1.ready, 1);
    // A minute later the rates are back to zero; the counts stay.
    advance(&store, Duration::from_secs(61)).await;
    let later = store.queue_stats(Some("billing")).await.unwrap();
    assert_eq!(
        (later.succeeded_last_minute, later.dead_last_minute),
        (0, 0)
    );
    assert_eq!(later.count(JobState::Dead), 1);
}

/// Issue 22, item 4: a crash must not charge an attempt to jobs a worker
/// claimed ahead and never started. A rescue of a claim whose start was
/// never recorded gives the attempt back (a job with one attempt stays
/// runnable); the bound still ends a job whose start kills its host every
/// time, dead with `rescued_unstarted`, and a started attempt is charged.
pub async fn rescue_of_an_unstarted_claim_gives_the_attempt_back(store: Arc<dyn Store>) {
    let id = store
        .job_insert(NewJob {
            max_attempts: 1,
            ..job("once")
        })
        .await
        .unwrap()
        .id;
    for round in 1..MAX_UNSTARTED_RESCUES {
        let claimed = claim_one_unstarted(&store, "w", SHORT).await;
        assert_eq!(claimed.attempt, 1);
        advance(&store, PAST_SHORT).await;
        assert_eq!(store.job_rescue_expired(10).await.unwrap(), vec![id]);
        let rescued = get(&store, id).await;
        assert_eq!(rescued.state, JobState::Available, "round {round}");
        assert_eq!(
            rescued.attempt, 0,
            "round {round}: the attempt is given back"
        );
        assert_eq!(rescued.unstarted_rescues, round);
        assert_eq!(rescued.rescues, round);
    }
    claim_one_unstarted(&store, "w", SHORT).await;
    advance(&store, PAST_SHORT).await;
    assert_eq!(store.job_rescue_expired(10).await.unwrap(), vec![id]);
    let dead = get(&store, id).await;
    assert_eq!(dead.state, JobState::Dead);
    assert_eq!(dead.last_error_code.as_deref(), Some("rescued_unstarted"));
    assert_eq!(dead.unstarted_rescues, MAX_UNSTARTED_RESCUES);
    assert!(dead.finished_at_ms.is_some());
    assert_eq!(
        dead.errors.last().map(|e| e.code.as_str()),
        Some("rescued_unstarted")
    );

    // A replay starts the count again.
    assert_eq!(store.job_replay(&[id]).await.unwrap().replayed, vec![id]);
    assert_eq!(get(&store, id).await.unstarted_rescues, 0);

    // Started, the same rescue charges the attempt: dead, `lease_expired`.
    let started = claim_one(&store, "w", SHORT).await;
    assert!(started.started);
    advance(&store, PAST_SHORT).await;
    assert_eq!(store.job_rescue_expired(10).await.unwrap(), vec![id]);
    let dead = get(&store, id).await;
    assert_eq!(dead.state, JobState::Dead);
    assert_eq!(dead.last_error_code.as_deref(), Some("lease_expired"));
}

/// Issue 22, item 4: the start travels with a heartbeat and is fenced like
/// one (a stale holder cannot mark a newer claim started); a heartbeat of
/// a job not yet started leaves it unstarted; a stored plan implies the
/// start.
pub async fn a_start_mark_is_fenced_and_implied_by_a_plan(store: Arc<dyn Store>) {
    let id = store.job_insert(job("p")).await.unwrap().id;
    let stale = claim_one_unstarted(&store, "a", SHORT).await;
    advance(&store, PAST_SHORT).await;
    assert_eq!(store.job_rescue_expired(10).await.unwrap(), vec![id]);
    let fresh = claim_one_unstarted(&store, "b", LONG).await;
    let beat = |started| JobChange::Heartbeat {
        lease: LONG,
        started,
    };
    assert_eq!(
        change(&store, &stale.fence(), beat(true)).await,
        Fence::FencedOut
    );
    assert!(
        !get(&store, id).await.started,
        "a stale start is fenced out"
    );
    assert_eq!(
        change(&store, &fresh.fence(), beat(false)).await,
        Fence::Applied
    );
    assert!(!get(&store, id).await.started, "a buffered job's heartbeat");
    assert_eq!(
        change(&store, &fresh.fence(), beat(true)).await,
        Fence::Applied
    );
    assert!(get(&store, id).await.started);
    assert_eq!(
        change(&store, &fresh.fence(), beat(false)).await,
        Fence::Applied
    );
    assert!(get(&store, id).await.started, "a start is never taken back");

    let other = store.job_insert(job("q")).await.unwrap().id;
    let claimed = claim_one_unstarted(&store, "c", LONG).await;
    assert_eq!(claimed.id, other);
    assert_eq!(
        store
            .job_save_plan(SavePlanParams {
                fence: claimed.fence(),
                plan: "[]".into(),
                plugin_hash: "h".into(),
            })
            .await
            .unwrap(),
        Fence::Applied
    );
    assert!(
        get(&store, other).await.started,
        "a stored plan implies the start"
    );
}
