//! The effect ledger: atomic claims, leases, fingerprints, fenced finishes,
//! child jobs in the same transaction.

use super::*;
use idem::store::{
    ChildParams, EffectClaim, EffectClaimParams, EffectFailParams, EffectFence, EffectPruneParams,
    EffectStatus, EffectSucceedParams, Enqueued, Fence, JobFilter, JobState, Resolution,
    SavePlanParams, Sent, StoreError,
};

/// Claim params for `key` by `worker`, which first claims a job of its own.
async fn claim(
    store: &Arc<dyn Store>,
    key: &str,
    worker: &str,
    lease: Duration,
) -> EffectClaimParams {
    if worker.is_empty() {
        return EffectClaimParams {
            worker: String::new(),
            ..claim_by(&hold(store, "w").await, key, lease)
        };
    }
    claim_by(&hold(store, worker).await, key, lease)
}

async fn claimed(store: &Arc<dyn Store>, params: EffectClaimParams) -> EffectFence {
    match store.effect_claim(params).await.unwrap() {
        EffectClaim::Claimed { fence } => fence,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// A claim that took over a key whose earlier try may have been carried out.
async fn claimed_in_doubt(
    store: &Arc<dyn Store>,
    params: EffectClaimParams,
) -> (EffectFence, Duration) {
    match store.effect_claim(params).await.unwrap() {
        EffectClaim::InDoubt {
            fence, sent_ago, ..
        } => (fence, sent_ago),
        other => panic!("expected a claim in doubt, got {other:?}"),
    }
}

pub async fn effect_claim_then_already_succeeded(store: Arc<dyn Store>) {
    let fence = claimed(
        &store,
        claim(&store, "invoice:1:email:v1", "w1", LONG).await,
    )
    .await;
    assert_eq!(
        fence,
        EffectFence {
            key: "invoice:1:email:v1".into(),
            worker: "w1".into(),
            attempt: 1
        }
    );
    let row = store
        .effect_get("invoice:1:email:v1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.status, EffectStatus::Processing);
    assert_eq!(row.attempt, 1);
    assert_eq!(row.job_id, JobId(1));
    assert_eq!(row.plugin, "send_invoice_email");
    assert_eq!(row.provider, "email");
    assert_eq!(row.fingerprint, "fp-1");
    assert_eq!(row.lease_owner.as_deref(), Some("w1"));
    let lease = row.lease_until_ms.unwrap() - row.created_at_ms;
    let asked = LONG.as_millis() as i64;
    assert!(
        (asked - 1_000..=asked + 1_000).contains(&lease),
        "lease {lease} ms"
    );

    assert_eq!(
        store
            .effect_set_succeeded(EffectSucceedParams {
                fence: fence.clone(),
                result_ref: Some("msg-1".into())
            })
            .await
            .unwrap(),
        Fence::Applied
    );
    let row = store
        .effect_get("invoice:1:email:v1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.status, EffectStatus::Succeeded);
    assert_eq!(row.result_ref.as_deref(), Some("msg-1"));
    assert_eq!(row.lease_until_ms, None);
    assert!(row.updated_at_ms >= row.created_at_ms);

    // Any later claim, by anyone, is an idempotency hit.
    for worker in ["w1", "w2"] {
        assert_eq!(
            store
                .effect_claim(claim(&store, "invoice:1:email:v1", worker, LONG).await)
                .await
                .unwrap(),
            EffectClaim::AlreadySucceeded {
                result_ref: Some("msg-1".into())
            }
        );
    }
    assert_eq!(
        store
            .effect_set_succeeded(EffectSucceedParams {
                fence: fence.clone(),
                result_ref: Some("msg-2".into())
            })
            .await
            .unwrap(),
        Fence::FencedOut
    );
    assert_eq!(
        store
            .effect_get("invoice:1:email:v1")
            .await
            .unwrap()
            .unwrap()
            .result_ref
            .as_deref(),
        Some("msg-1")
    );
    assert!(store.effect_get("never").await.unwrap().is_none());

    let invalid = store
        .effect_claim(claim(&store, "bad\nkey", "w", LONG).await)
        .await
        .unwrap_err();
    assert!(matches!(invalid, StoreError::Invalid(_)));
    let no_worker = store
        .effect_claim(claim(&store, "k", "", LONG).await)
        .await
        .unwrap_err();
    assert!(matches!(no_worker, StoreError::Invalid(_)));
}

pub async fn effect_lease_blocks_until_expiry(store: Arc<dyn Store>) {
    let a = claimed(&store, claim(&store, "k", "a", SHORT).await).await;
    advance(&store, Duration::from_secs(10)).await;
    match store
        .effect_claim(claim(&store, "k", "b", LONG).await)
        .await
        .unwrap()
    {
        EffectClaim::LeasedByOther { remaining } => assert!(
            remaining > Duration::from_secs(19) && remaining <= Duration::from_secs(20),
            "20 s of the lease are left by the store's clock, got {remaining:?}"
        ),
        other => panic!("expected leased by other, got {other:?}"),
    }
    advance(&store, PAST_SHORT - Duration::from_secs(10)).await;
    // A's try may have reached the provider: B holds the key, in doubt.
    let (b, sent_ago) = claimed_in_doubt(&store, claim(&store, "k", "b", LONG).await).await;
    assert!(
        sent_ago >= PAST_SHORT && sent_ago < PAST_SHORT + Duration::from_secs(5),
        "first sent {sent_ago:?} ago by the store's clock"
    );
    assert_eq!(b.attempt, 2);
    let row = store.effect_get("k").await.unwrap().unwrap();
    assert_eq!(row.lease_owner.as_deref(), Some("b"));
    assert_eq!(row.attempt, 2);
    assert!(
        row.reached,
        "a takeover of a key in flight marks it reached"
    );

    // A is still alive: its finishing writes are fenced out.
    assert_eq!(
        store
            .effect_set_succeeded(EffectSucceedParams {
                fence: a.clone(),
                result_ref: Some("late".into())
            })
            .await
            .unwrap(),
        Fence::FencedOut
    );
    assert_eq!(
        store
            .effect_set_failed(EffectFailParams {
                fence: a.clone(),
                status: EffectStatus::Failed,
                error_code: "x".into(),
                sent: Sent::NotApplied,
            })
            .await
            .unwrap(),
        Fence::FencedOut
    );
    assert_eq!(
        store.effect_get("k").await.unwrap().unwrap(),
        row,
        "unchanged"
    );
    assert_eq!(
        store
            .effect_set_succeeded(EffectSucceedParams {
                fence: b.clone(),
                result_ref: Some("ref-b".into())
            })
            .await
            .unwrap(),
        Fence::Applied
    );
    assert_eq!(
        store
            .effect_claim(claim(&store, "k", "a", LONG).await)
            .await
            .unwrap(),
        EffectClaim::AlreadySucceeded {
            result_ref: Some("ref-b".into())
        }
    );
}

pub async fn effect_fingerprint_conflict(store: Arc<dyn Store>) {
    let fence = claimed(&store, claim(&store, "k", "a", LONG).await).await;
    let other = EffectClaimParams {
        fingerprint: "fp-2".into(),
        ..claim(&store, "k", "b", LONG).await
    };
    let conflict = EffectClaim::Conflict {
        existing_fingerprint: "fp-1".into(),
    };
    assert_eq!(
        store.effect_claim(other.clone()).await.unwrap(),
        conflict,
        "while processing"
    );
    store
        .effect_set_failed(EffectFailParams {
            fence: fence.clone(),
            status: EffectStatus::Retrying,
            error_code: "provider_5xx".into(),
            sent: Sent::NotApplied,
        })
        .await
        .unwrap();
    assert_eq!(
        store.effect_claim(other.clone()).await.unwrap(),
        conflict,
        "while retrying"
    );
    let fence = claimed(&store, claim(&store, "k", "a", LONG).await).await;
    store
        .effect_set_succeeded(EffectSucceedParams {
            fence: fence.clone(),
            result_ref: None,
        })
        .await
        .unwrap();
    assert_eq!(
        store.effect_claim(other).await.unwrap(),
        conflict,
        "after success"
    );
    assert_eq!(
        store
            .effect_claim(claim(&store, "k", "b", LONG).await)
            .await
            .unwrap(),
        EffectClaim::AlreadySucceeded { result_ref: None }
    );
}

pub async fn effect_claim_race(store: Arc<dyn Store>) {
    for round in 0..5 {
        let key = format!("race:{round}");
        // Each racer first holds a job of its own, one after another: eight
        // concurrent claims of the holders' queue can each skip the rows the
        // others have locked and find none, and a racer that failed before
        // the barrier would leave the others waiting for ever.
        let mut params = Vec::new();
        for w in 0..8 {
            params.push(claim(&store, &key, &format!("w{w}"), LONG).await);
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(8));
        let tasks: Vec<_> = params
            .into_iter()
            .map(|params| {
                let store = store.clone();
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    store.effect_claim(params).await.unwrap()
                })
            })
            .collect();
        let outcomes: Vec<EffectClaim> =
            tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(tasks))
                .await
                .expect("every racer answers")
                .into_iter()
                .map(|r| r.unwrap())
                .collect();
        let winners = outcomes
            .iter()
            .filter(|o| matches!(o, EffectClaim::Claimed { .. }))
            .count();
        assert_eq!(winners, 1, "{outcomes:?}");
        assert!(
            outcomes.iter().all(|o| matches!(
                o,
                EffectClaim::Claimed { .. } | EffectClaim::LeasedByOther { .. }
            )),
            "{outcomes:?}"
        );
    }
}

pub async fn effect_failure_allows_reclaim(store: Arc<dyn Store>) {
    let first = claimed(&store, claim(&store, "k", "a", LONG).await).await;
    let invalid = store
        .effect_set_failed(EffectFailParams {
            fence: first.clone(),
            status: EffectStatus::Succeeded,
            error_code: "x".into(),
            sent: Sent::NotApplied,
        })
        .await
        .unwrap_err();
    assert!(matches!(invalid, StoreError::Invalid(_)));
    assert_eq!(
        store
            .effect_set_failed(EffectFailParams {
                fence: first.clone(),
                status: EffectStatus::Retrying,
                error_code: "provider_timeout".into(),
                sent: Sent::NotApplied,
            })
            .await
            .unwrap(),
        Fence::Applied
    );
    let row = store.effect_get("k").await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Retrying);
    assert_eq!(row.last_error_code.as_deref(), Some("provider_timeout"));
    assert!(row.last_error_at_ms.is_some());
    assert_eq!(row.lease_owner, None);
    assert_eq!(row.lease_until_ms, None);

    // Retrying: claimable at once, by anyone, as the next attempt.
    let second = claimed(&store, claim(&store, "k", "b", LONG).await).await;
    assert_eq!(second.attempt, 2);
    store
        .effect_set_failed(EffectFailParams {
            fence: second.clone(),
            status: EffectStatus::Failed,
            error_code: "invalid_recipient".into(),
            sent: Sent::NotApplied,
        })
        .await
        .unwrap();
    assert_eq!(
        store.effect_get("k").await.unwrap().unwrap().status,
        EffectStatus::Failed
    );
    // Failed: no job claims it again (a second job with the same key fails
    // the same way) until the dead job carrying it is replayed.
    assert_eq!(
        store
            .effect_claim(claim(&store, "k", "c", LONG).await)
            .await
            .unwrap(),
        EffectClaim::Failed {
            code: "invalid_recipient".into()
        }
    );
    let id = store.job_insert(job("p")).await.unwrap().id;
    let carrier = claim_one(&store, "w", LONG).await;
    assert_eq!(carrier.id, id);
    let plan =
        r#"[{"provider":"email","idempotency_key":"k","action":{"type":"custom","body":""}}]"#;
    store
        .job_save_plan(SavePlanParams {
            fence: carrier.fence(),
            plan: plan.to_string(),
            plugin_hash: "h".into(),
        })
        .await
        .unwrap();
    dead_letter(
        &store,
        DeadParams {
            fence: carrier.fence(),
            error: error(1, "permanent", "invalid_recipient"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    assert_eq!(store.job_replay(&[id]).await.unwrap().replayed, [id]);
    assert_eq!(
        store.effect_get("k").await.unwrap().unwrap().status,
        EffectStatus::Retrying
    );
    let third = claimed(&store, claim(&store, "k", "c", LONG).await).await;
    assert_eq!(third.attempt, 3);
    assert_eq!(
        store
            .effect_set_failed(EffectFailParams {
                fence: second,
                status: EffectStatus::Retrying,
                error_code: "late".into(),
                sent: Sent::NotApplied,
            })
            .await
            .unwrap(),
        Fence::FencedOut
    );
}

fn child(key: &str) -> NewJob {
    NewJob {
        queue: "billing".into(),
        ..keyed("create_invoice", key)
    }
}

async fn children(store: &Arc<dyn Store>) -> Vec<idem::store::Job> {
    store
        .job_list(JobFilter {
            plugin: Some("create_invoice".into()),
            ..Default::default()
        })
        .await
        .unwrap()
}

pub async fn effect_child_in_transaction(store: Arc<dyn Store>) {
    let fence = claimed(&store, claim(&store, "order:7:invoice", "w", LONG).await).await;
    let (outcome, enqueued) = store
        .effect_succeed_with_child(ChildParams {
            fence: fence.clone(),
            child: child("order:7:invoice"),
        })
        .await
        .unwrap();
    assert_eq!(outcome, Fence::Applied);
    assert!(enqueued.inserted);
    let row = store.effect_get("order:7:invoice").await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Succeeded);
    assert_eq!(row.result_ref, Some(enqueued.id.to_string()));
    let child_job = get(&store, enqueued.id).await;
    assert_eq!(child_job.state, JobState::Available);
    assert_eq!(child_job.queue, "billing");
    assert_eq!(
        child_job.idempotency_key.as_deref(),
        Some("order:7:invoice")
    );

    // Done: a second attempt is fenced out and inserts nothing.
    let (again, _) = store
        .effect_succeed_with_child(ChildParams {
            fence: fence.clone(),
            child: child("order:7:invoice"),
        })
        .await
        .unwrap();
    assert_eq!(again, Fence::FencedOut);
    assert_eq!(children(&store).await.len(), 1);
    assert_eq!(
        store
            .effect_claim(claim(&store, "order:7:invoice", "w2", LONG).await)
            .await
            .unwrap(),
        EffectClaim::AlreadySucceeded {
            result_ref: Some(enqueued.id.to_string())
        }
    );
}

pub async fn effect_child_fenced_out(store: Arc<dyn Store>) {
    let stale = claimed(&store, claim(&store, "order:8:invoice", "a", SHORT).await).await;
    advance(&store, PAST_SHORT).await;
    let (current, _) =
        claimed_in_doubt(&store, claim(&store, "order:8:invoice", "b", LONG).await).await;

    let (outcome, enqueued) = store
        .effect_succeed_with_child(ChildParams {
            fence: stale.clone(),
            child: child("order:8:invoice"),
        })
        .await
        .unwrap();
    assert_eq!(outcome, Fence::FencedOut);
    assert!(!enqueued.inserted);
    assert!(
        children(&store).await.is_empty(),
        "the child insert was rolled back"
    );
    assert_eq!(
        store
            .effect_get("order:8:invoice")
            .await
            .unwrap()
            .unwrap()
            .status,
        EffectStatus::Processing
    );

    let (outcome, enqueued) = store
        .effect_succeed_with_child(ChildParams {
            fence: current.clone(),
            child: child("order:8:invoice"),
        })
        .await
        .unwrap();
    assert_eq!(outcome, Fence::Applied);
    assert!(enqueued.inserted);
    assert_eq!(children(&store).await.len(), 1);

    // After the fact the stale worker learns the existing child's id.
    let (outcome, late) = store
        .effect_succeed_with_child(ChildParams {
            fence: stale.clone(),
            child: child("order:8:invoice"),
        })
        .await
        .unwrap();
    assert_eq!(outcome, Fence::FencedOut);
    assert_eq!(
        late,
        Enqueued {
            id: enqueued.id,
            inserted: false
        }
    );
    assert_eq!(children(&store).await.len(), 1);
}

pub async fn effect_child_existing_key(store: Arc<dyn Store>) {
    let existing = store.job_insert(child("order:9:invoice")).await.unwrap();
    let fence = claimed(&store, claim(&store, "order:9:invoice", "w", LONG).await).await;
    let (outcome, enqueued) = store
        .effect_succeed_with_child(ChildParams {
            fence: fence.clone(),
            child: child("order:9:invoice"),
        })
        .await
        .unwrap();
    assert_eq!(outcome, Fence::Applied);
    assert_eq!(
        enqueued,
        Enqueued {
            id: existing.id,
            inserted: false
        }
    );
    assert_eq!(
        store
            .effect_get("order:9:invoice")
            .await
            .unwrap()
            .unwrap()
            .result_ref,
        Some(existing.id.to_string())
    );
    assert_eq!(children(&store).await.len(), 1);
}

pub async fn effect_list_by_job(store: Arc<dyn Store>) {
    let first = hold(&store, "w").await;
    let second = hold(&store, "w").await;
    claimed(&store, claim_by(&first, "a:1", LONG)).await;
    claimed(&store, claim_by(&first, "a:2", LONG)).await;
    claimed(&store, claim_by(&second, "b:1", LONG)).await;
    let keys: Vec<String> = store
        .effect_list(first.id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.key)
        .collect();
    assert_eq!(keys, ["a:1", "a:2"]);
    assert_eq!(store.effect_list(second.id).await.unwrap().len(), 1);
    assert!(store.effect_list(JobId(i64::MAX)).await.unwrap().is_empty());
}

pub async fn effect_prune_keeps_recent_and_in_flight_rows(store: Arc<dyn Store>) {
    // The keys' jobs succeed: only keys of unfinished jobs are kept.
    let holder = hold(&store, "a").await;
    let done = claimed(&store, claim_by(&holder, "old-done", LONG)).await;
    store
        .effect_set_succeeded(EffectSucceedParams {
            fence: done.clone(),
            result_ref: Some("r".into()),
        })
        .await
        .unwrap();
    claimed(&store, claim_by(&holder, "old-in-flight", LONG)).await;
    advance(&store, Duration::from_secs(50)).await;
    let recent = claimed(&store, claim_by(&holder, "recent", LONG)).await;
    assert_eq!(
        succeed(&store, &holder.fence()).await.unwrap(),
        Fence::Applied
    );
    store
        .effect_set_succeeded(EffectSucceedParams {
            fence: recent.clone(),
            result_ref: None,
        })
        .await
        .unwrap();
    // Older than 40 s: only the finished old row goes.
    let cutoff = |limit| EffectPruneParams {
        older_than: Duration::from_secs(40),
        limit,
    };
    assert_eq!(store.effect_delete_finished(cutoff(100)).await.unwrap(), 1);
    assert!(store.effect_get("old-done").await.unwrap().is_none());
    assert!(
        store.effect_get("old-in-flight").await.unwrap().is_some(),
        "in flight: never pruned"
    );
    assert!(store.effect_get("recent").await.unwrap().is_some());
    assert_eq!(
        store.effect_delete_finished(cutoff(0)).await.unwrap(),
        0,
        "limit respected"
    );
    // A key of a job that is not done (here: dead, waiting for a replay) is kept.
    let id = store.job_insert(job("p")).await.unwrap().id;
    let held = claim_one(&store, "w", LONG).await;
    assert_eq!(held.id, id);
    let f = claimed(&store, claim_by(&held, "dead-job-key", LONG)).await;
    store
        .effect_set_succeeded(EffectSucceedParams {
            fence: f.clone(),
            result_ref: None,
        })
        .await
        .unwrap();
    dead_letter(
        &store,
        DeadParams {
            fence: held.fence(),
            error: error(1, "permanent", "x"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    advance(&store, Duration::from_secs(50)).await;
    store.effect_delete_finished(cutoff(100)).await.unwrap();
    assert!(store.effect_get("dead-job-key").await.unwrap().is_some());
}

/// Window 2: a key whose earlier try ended ambiguously is claimed in doubt,
/// with the time since it was first sent (so the executor can hold it
/// against the provider's dedupe window); a try that reached nothing is not.
pub async fn effect_in_doubt_after_an_ambiguous_try(store: Arc<dyn Store>) {
    let fail = |fence: EffectFence, sent: Sent| EffectFailParams {
        fence,
        status: EffectStatus::Retrying,
        error_code: "provider_timeout".into(),
        sent,
    };
    let first = claimed(&store, claim(&store, "k", "a", LONG).await).await;
    store
        .effect_set_failed(fail(first, Sent::NotApplied))
        .await
        .unwrap();
    let second = claimed(&store, claim(&store, "k", "b", LONG).await).await;
    assert!(!store.effect_get("k").await.unwrap().unwrap().reached);
    store
        .effect_set_failed(fail(second, Sent::MaybeApplied))
        .await
        .unwrap();
    let row = store.effect_get("k").await.unwrap().unwrap();
    assert!(row.reached && !row.in_doubt, "{row:?}");

    advance(&store, Duration::from_secs(3600)).await;
    let (third, sent_ago) = claimed_in_doubt(&store, claim(&store, "k", "c", LONG).await).await;
    assert!(
        sent_ago >= Duration::from_secs(3600) && sent_ago < Duration::from_secs(3660),
        "counted from the first try: {sent_ago:?}"
    );
    // A later try that reached nothing does not clear the mark.
    store
        .effect_set_failed(fail(third, Sent::NotApplied))
        .await
        .unwrap();
    assert!(
        store.effect_get("k").await.unwrap().unwrap().reached,
        "sticky"
    );
    claimed_in_doubt(&store, claim(&store, "k", "d", LONG).await).await;
}

/// A claim in doubt says how long ago the latest try that may have reached
/// the provider was claimed; a claim that ends without a call (it only
/// asked the provider, or deferred) does not make that try younger.
async fn claimed_in_doubt_tried(
    store: &Arc<dyn Store>,
    params: EffectClaimParams,
) -> (EffectFence, Duration) {
    match store.effect_claim(params).await.unwrap() {
        EffectClaim::InDoubt {
            fence, tried_ago, ..
        } => (fence, tried_ago),
        other => panic!("expected a claim in doubt, got {other:?}"),
    }
}

fn about(got: Duration, want: Duration) -> bool {
    got >= want && got < want + Duration::from_secs(5)
}

/// Issue 25: the age of the latest try, for a lookup's "not applied".
pub async fn effect_in_doubt_says_how_old_the_latest_try_is(store: Arc<dyn Store>) {
    let give_back = |fence: EffectFence, sent: Sent| EffectFailParams {
        fence,
        status: EffectStatus::Retrying,
        error_code: "lookup_unavailable".into(),
        sent,
    };
    // A holder vanished mid-call: its try is the latest.
    claimed(&store, claim(&store, "k", "a", SHORT).await).await;
    advance(&store, PAST_SHORT).await;
    let (b, tried_ago) = claimed_in_doubt_tried(&store, claim(&store, "k", "b", LONG).await).await;
    assert!(about(tried_ago, PAST_SHORT), "{tried_ago:?}");
    // B only asked (not applied, too recent): given back without a call.
    store
        .effect_set_failed(give_back(b, Sent::NotApplied))
        .await
        .unwrap();
    advance(&store, Duration::from_secs(10)).await;
    let (c, tried_ago) = claimed_in_doubt_tried(&store, claim(&store, "k", "c", LONG).await).await;
    assert!(
        about(tried_ago, PAST_SHORT + Duration::from_secs(10)),
        "B's claim did not count as a try: {tried_ago:?}"
    );
    // C sent it again and its answer was ambiguous: C's try is the latest.
    store
        .effect_set_failed(give_back(c, Sent::MaybeApplied))
        .await
        .unwrap();
    advance(&store, Duration::from_secs(20)).await;
    let (d, tried_ago) = claimed_in_doubt_tried(&store, claim(&store, "k", "d", LONG).await).await;
    assert!(about(tried_ago, Duration::from_secs(20)), "{tried_ago:?}");
    // D does not send it (the provider cannot dedupe, no lookup): left for
    // an operator, the age still C's try's.
    store
        .effect_set_failed(EffectFailParams {
            fence: d,
            status: EffectStatus::Failed,
            error_code: "may_not_resend".into(),
            sent: Sent::HeldInDoubt,
        })
        .await
        .unwrap();
    advance(&store, Duration::from_secs(5)).await;
    let rows = store
        .effects_to_reconcile(&["email".to_string()], None, 10)
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert!(
        about(rows[0].tried_ago, Duration::from_secs(25)),
        "D's claim did not count as a try: {:?}",
        rows[0]
    );
    let row = store.effect_get("k").await.unwrap().unwrap();
    assert!(row.in_doubt && row.reached, "{row:?}");
}

/// Issue 25: the keys the reconcile sweep asks about, and its fenced
/// answers.
pub async fn effects_to_reconcile_and_their_fenced_answers(store: Arc<dyn Store>) {
    let email = ["email".to_string()];
    let listed = |store: Arc<dyn Store>, providers: Vec<String>, plugin: Option<&'static str>| async move {
        store
            .effects_to_reconcile(&providers, plugin, 10)
            .await
            .unwrap()
            .into_iter()
            .map(|row| row.key)
            .collect::<Vec<_>>()
    };
    // Never sent, or done: nothing to ask.
    let fresh = claimed(&store, claim(&store, "fresh", "a", LONG).await).await;
    let done = claimed(&store, claim(&store, "done", "a", LONG).await).await;
    store
        .effect_set_succeeded(EffectSucceedParams {
            fence: done,
            result_ref: None,
        })
        .await
        .unwrap();
    // A holder that vanished mid-call, and one whose answer was ambiguous.
    claimed(&store, claim(&store, "vanished", "a", SHORT).await).await;
    let ambiguous = claimed(&store, claim(&store, "ambiguous", "a", LONG).await).await;
    store
        .effect_set_failed(EffectFailParams {
            fence: ambiguous,
            status: EffectStatus::Failed,
            error_code: "ambiguous_not_retried".into(),
            sent: Sent::Unresolved,
        })
        .await
        .unwrap();
    assert_eq!(
        listed(store.clone(), email.to_vec(), None).await,
        ["ambiguous"],
        "a live lease is its holder's business"
    );
    advance(&store, PAST_SHORT).await;
    let mut keys = listed(store.clone(), email.to_vec(), None).await;
    keys.sort();
    assert_eq!(
        keys,
        ["ambiguous", "vanished"],
        "a live lease is still its holder's"
    );
    assert!(
        listed(store.clone(), vec!["sms".into()], None)
            .await
            .is_empty()
    );
    assert!(
        listed(store.clone(), email.to_vec(), Some("other_plugin"))
            .await
            .is_empty()
    );
    assert_eq!(
        listed(store.clone(), email.to_vec(), Some("send_invoice_email"))
            .await
            .len(),
        2
    );
    let rows = store.effects_to_reconcile(&email, None, 10).await.unwrap();
    let vanished = rows.iter().find(|r| r.key == "vanished").unwrap().clone();
    assert_eq!(
        (
            vanished.provider.as_str(),
            vanished.plugin.as_str(),
            vanished.fingerprint.as_str()
        ),
        ("email", "send_invoice_email", "fp-1")
    );
    assert!(about(vanished.tried_ago, PAST_SHORT), "{vanished:?}");

    // A worker takes the key over between the sweep's read and its answer:
    // the answer is fenced out.
    let (taker, _) = claimed_in_doubt(&store, claim(&store, "vanished", "b", LONG).await).await;
    assert!(
        !store
            .effect_reconcile("vanished", vanished.attempt, Resolution::NotApplied)
            .await
            .unwrap()
    );
    let row = store.effect_get("vanished").await.unwrap().unwrap();
    assert_eq!((row.status, row.reached), (EffectStatus::Processing, true));
    // That worker's lease runs out too; the sweep reads it again and settles.
    advance(&store, LONG + Duration::from_secs(1)).await;
    let again = store.effects_to_reconcile(&email, None, 10).await.unwrap();
    let vanished = again.iter().find(|r| r.key == "vanished").unwrap().clone();
    assert_eq!(vanished.attempt, taker.attempt);
    assert!(
        store
            .effect_reconcile(
                "vanished",
                vanished.attempt,
                Resolution::Applied {
                    result_ref: Some("msg-7".into())
                }
            )
            .await
            .unwrap()
    );
    let row = store.effect_get("vanished").await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Succeeded);
    assert_eq!(row.result_ref.as_deref(), Some("msg-7"));
    assert_eq!(
        store
            .effect_set_succeeded(EffectSucceedParams {
                fence: taker,
                result_ref: Some("late".into())
            })
            .await
            .unwrap(),
        Fence::FencedOut,
        "the vanished holder's late write is fenced out"
    );
    assert!(
        !store
            .effect_reconcile("vanished", vanished.attempt, Resolution::NotApplied)
            .await
            .unwrap(),
        "a settled key is not settled again"
    );

    // Not applied: the key is no longer in doubt; the next claim is a
    // first try, not a repeat.
    let ambiguous = again.iter().find(|r| r.key == "ambiguous").unwrap().clone();
    assert!(
        store
            .effect_reconcile("ambiguous", ambiguous.attempt, Resolution::NotApplied)
            .await
            .unwrap()
    );
    let row = store.effect_get("ambiguous").await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.reached, row.in_doubt),
        (EffectStatus::Retrying, false, false)
    );
    claimed(&store, claim(&store, "ambiguous", "c", LONG).await).await;
    // The first holder of `fresh` vanished too (its lease ran out while it
    // was `processing`): in doubt although never marked reached.
    assert_eq!(listed(store.clone(), email.to_vec(), None).await, ["fresh"]);
    let row = again.iter().find(|r| r.key == "fresh").unwrap().clone();
    assert_eq!(row.attempt, fresh.attempt);
    assert!(
        store
            .effect_reconcile("fresh", row.attempt, Resolution::NotApplied)
            .await
            .unwrap()
    );
    assert!(listed(store.clone(), email.to_vec(), None).await.is_empty());
}

/// Window 5: a worker claims a key only while it holds the key's job at its
/// attempt; one that woke up after its job was rescued claims nothing.
pub async fn effect_claim_fenced_by_the_job_lease(store: Arc<dyn Store>) {
    let id = store.job_insert(job("p")).await.unwrap().id;
    let stale = claim_one(&store, "a", SHORT).await;
    advance(&store, PAST_SHORT).await;
    assert_eq!(store.job_rescue_expired(10).await.unwrap(), vec![id]);
    assert_eq!(
        store
            .effect_claim(claim_by(&stale, "k", LONG))
            .await
            .unwrap(),
        EffectClaim::JobLost,
        "rescued: the old holder claims nothing"
    );
    assert!(store.effect_get("k").await.unwrap().is_none());

    // The same worker at a later attempt: the old attempt is still fenced out.
    let current = claim_one(&store, "a", LONG).await;
    assert_eq!((current.id, current.attempt), (id, 2));
    assert_eq!(
        store
            .effect_claim(claim_by(&stale, "k", LONG))
            .await
            .unwrap(),
        EffectClaim::JobLost
    );
    claimed(&store, claim_by(&current, "k", LONG)).await;

    // Dead-lettered: no claim either, not even for a key that is free.
    dead_letter(
        &store,
        DeadParams {
            fence: current.fence(),
            error: error(2, "permanent", "x"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    assert_eq!(
        store
            .effect_claim(claim_by(&current, "k2", LONG))
            .await
            .unwrap(),
        EffectClaim::JobLost
    );
    assert!(store.effect_get("k2").await.unwrap().is_none());
}

/// A `jobs` effect of a one-write finish.
fn child_effect(key: &str, older_key: Option<&str>) -> idem::store::ChildEffect {
    idem::store::ChildEffect {
        key: key.into(),
        older_key: older_key.map(str::to_string),
        fingerprint: format!("fp-{key}"),
        child: child(key),
    }
}

fn finish_with(children: Vec<idem::store::ChildEffect>) -> JobChange {
    JobChange::SucceedWithChildren {
        plugin: "order_sync".into(),
        plan: r#"[{"children":true}]"#.into(),
        plugin_hash: "h-children".into(),
        children,
    }
}

fn finished(written: &Written) -> Vec<Enqueued> {
    match written {
        Written::Children(idem::store::ChildrenWritten::Applied(children)) => children.clone(),
        other => panic!("expected the job finished with its children, got {other:?}"),
    }
}

pub async fn children_finish_with_their_job_in_one_write(store: Arc<dyn Store>) {
    use idem::store::ChildrenWritten::{FencedOut, KeysTaken};
    let inserted = store
        .job_insert_many((0..6).map(|_| job("order_sync")).collect())
        .await
        .unwrap();
    assert_eq!(inserted.len(), 6);
    let jobs = store.job_claim(claim_params("w", 6, LONG)).await.unwrap();
    assert_eq!(jobs.len(), 6);
    // Keys in the ledger already: one under its scoped key, one under the
    // key a release before scoping used.
    claimed(&store, claim(&store, "order_sync/taken", "h", LONG).await).await;
    claimed(&store, claim(&store, "legacy", "h", LONG).await).await;

    let writes = vec![
        // Two children: both ledger rows and both jobs, with the success.
        Write::Job {
            fence: jobs[0].fence(),
            change: finish_with(vec![
                child_effect("order_sync/a1", Some("a1")),
                child_effect("order_sync/a2", Some("a2")),
            ]),
        },
        // A stale holder: nothing.
        Write::Job {
            fence: other_worker(&jobs[1].fence(), "stale"),
            change: finish_with(vec![child_effect("order_sync/b1", None)]),
        },
        // A key in the ledger already: nothing (the plan goes the long way).
        Write::Job {
            fence: jobs[2].fence(),
            change: finish_with(vec![
                child_effect("order_sync/c1", None),
                child_effect("order_sync/taken", None),
            ]),
        },
        // Its older, unscoped key is in the ledger: nothing.
        Write::Job {
            fence: jobs[5].fence(),
            change: finish_with(vec![child_effect("order_sync/legacy", Some("legacy"))]),
        },
    ];
    let answers = store.write_batch(writes).await.unwrap();
    assert_eq!(answers.len(), 4);
    let enqueued = finished(&answers[0]);
    assert_eq!(enqueued.len(), 2);
    assert!(enqueued.iter().all(|e| e.inserted));
    assert_eq!(answers[1], Written::Children(FencedOut));
    for taken in &answers[2..] {
        assert_eq!(*taken, Written::Children(KeysTaken), "{answers:?}");
    }

    let done = get(&store, jobs[0].id).await;
    assert_eq!(done.state, JobState::Succeeded);
    assert_eq!(done.plan.as_deref(), Some(r#"[{"children":true}]"#));
    assert_eq!(done.plugin_hash.as_deref(), Some("h-children"));
    for (key, child) in ["order_sync/a1", "order_sync/a2"].iter().zip(&enqueued) {
        let row = store.effect_get(key).await.unwrap().expect("ledger row");
        assert_eq!(row.status, EffectStatus::Succeeded);
        assert_eq!(row.job_id, jobs[0].id);
        assert_eq!(row.plugin, "order_sync");
        assert_eq!(row.provider, "jobs");
        assert_eq!(row.fingerprint, format!("fp-{key}"));
        assert_eq!(row.result_ref, Some(child.id.to_string()));
        let child_job = get(&store, child.id).await;
        assert_eq!(child_job.idempotency_key.as_deref(), Some(*key));
        assert_eq!(child_job.queue, "billing");
        assert_eq!(child_job.state, JobState::Available);
    }
    // Nothing of the refused writes stayed behind: no rows, no children,
    // the jobs still running without a plan.
    for key in ["order_sync/b1", "order_sync/c1", "order_sync/legacy"] {
        assert!(store.effect_get(key).await.unwrap().is_none(), "{key}");
    }
    assert_eq!(
        store
            .effect_get("order_sync/taken")
            .await
            .unwrap()
            .unwrap()
            .status,
        EffectStatus::Processing
    );
    assert_eq!(children(&store).await.len(), 2);
    for job in [&jobs[1], &jobs[2], &jobs[5]] {
        let job = get(&store, job.id).await;
        assert_eq!(job.state, JobState::Running);
        assert_eq!(job.plan, None);
    }

    // The same key in two writes: never both. In one batch neither is
    // written; a group commit may put them in two flushes, and then the
    // first wins and the second finds the key taken.
    let answers = store
        .write_batch(
            [&jobs[3], &jobs[4]]
                .map(|job| Write::Job {
                    fence: job.fence(),
                    change: finish_with(vec![child_effect("order_sync/twice", None)]),
                })
                .to_vec(),
        )
        .await
        .unwrap();
    assert_eq!(answers[1], Written::Children(KeysTaken), "{answers:?}");
    let first_won = answers[0] != Written::Children(KeysTaken);
    if first_won {
        assert_eq!(finished(&answers[0]).len(), 1);
    }
    assert_eq!(children(&store).await.len(), 2 + usize::from(first_won));
    assert_eq!(
        get(&store, jobs[4].id).await.state,
        JobState::Running,
        "the second write never finishes its job"
    );
    let twice = store.effect_get("order_sync/twice").await.unwrap();
    assert_eq!(twice.is_some(), first_won);

    // The same write again (a duplicate delivery of the answer): its keys
    // are in the ledger now, so it writes nothing.
    let again = store
        .write(Write::Job {
            fence: jobs[0].fence(),
            change: finish_with(vec![child_effect("order_sync/a1", None)]),
        })
        .await
        .unwrap();
    assert_eq!(again, Written::Children(KeysTaken));
    assert_eq!(children(&store).await.len(), 2 + usize::from(first_won));

    // A child the store would refuse refuses the write before anything runs.
    let refused = store
        .write(Write::Job {
            fence: jobs[2].fence(),
            change: finish_with(vec![idem::store::ChildEffect {
                child: NewJob {
                    idempotency_key: Some("order_sync/other".into()),
                    ..child("order_sync/bad")
                },
                ..child_effect("order_sync/bad", None)
            }]),
        })
        .await
        .unwrap_err();
    assert!(matches!(refused, StoreError::Invalid(_)), "{refused:?}");
}

/// Issue 22, item 5: a claimer that asks again for a key its own claim
/// holds (the batch with its claim committed, but answered an error) gets
/// the same claim back, not `LeasedByOther` until its own lease runs out;
/// nothing was sent, so the row is not marked reached. Another job's claim,
/// even under the same lease owner and attempt, is still refused.
pub async fn effect_reclaim_by_the_same_claim_is_the_same_claim(store: Arc<dyn Store>) {
    let holder = hold(&store, "w").await;
    let params = claim_by(&holder, "k", LONG);
    let first = claimed(&store, params.clone()).await;
    let again = claimed(&store, params.clone()).await;
    assert_eq!(again.attempt, first.attempt + 1);
    let row = store.effect_get("k").await.unwrap().unwrap();
    assert!(!row.reached, "the first claim was never sent");
    assert_eq!(
        store
            .effect_set_succeeded(EffectSucceedParams {
                fence: first,
                result_ref: None
            })
            .await
            .unwrap(),
        Fence::FencedOut,
        "the claim's first fence is replaced"
    );
    // Another job held by the same owner at the same attempt.
    let other = hold(&store, "w").await;
    assert_ne!(other.id, holder.id);
    assert_eq!(other.attempt, holder.attempt);
    assert!(
        matches!(
            store
                .effect_claim(claim_by(&other, "k", LONG))
                .await
                .unwrap(),
            EffectClaim::LeasedByOther { .. }
        ),
        "another job's claim is another claim"
    );
    assert_eq!(
        store
            .effect_set_succeeded(EffectSucceedParams {
                fence: again,
                result_ref: Some("ref".into())
            })
            .await
            .unwrap(),
        Fence::Applied
    );
}

/// A fresh plan's claim reads nothing first: it names the key's older,
/// unscoped form, and the claim's own transaction answers
/// `OlderRelease` when an older release claimed this very request under
/// it (same plugin, one of the request's fingerprints) and the scoped key
/// has no row; otherwise it claims the scoped key as usual.
pub async fn effect_claim_finds_the_request_an_older_release_claimed(store: Arc<dyn Store>) {
    let job = hold(&store, "w").await;
    // An older release claimed `inv:1` (unscoped) and carried it out.
    let fence = claimed(&store, claim_by(&job, "inv:1", LONG)).await;
    store
        .effect_set_succeeded(EffectSucceedParams {
            fence,
            result_ref: Some("old".into()),
        })
        .await
        .unwrap();
    let probing = |key: &str, fingerprints: &[&str]| EffectClaimParams {
        older_key: Some(idem::store::OlderKey {
            key: "inv:1".into(),
            fingerprints: fingerprints.iter().map(|f| f.to_string()).collect(),
        }),
        ..claim_by(&job, key, LONG)
    };
    assert_eq!(
        store
            .effect_claim(probing("send_invoice_email/inv:1", &["fp-0", "fp-1"]))
            .await
            .unwrap(),
        EffectClaim::OlderRelease {
            key: "inv:1".into()
        }
    );
    assert!(
        store
            .effect_get("send_invoice_email/inv:1")
            .await
            .unwrap()
            .is_none(),
        "nothing claimed under the scoped key"
    );
    // Another request (fingerprints that do not match): the scoped key.
    assert!(matches!(
        store
            .effect_claim(probing("send_invoice_email/inv:1", &["fp-9"]))
            .await
            .unwrap(),
        EffectClaim::Claimed { .. }
    ));
    // Now the scoped key has a row: it wins, whatever the older key holds.
    let again = store
        .effect_claim(probing("send_invoice_email/inv:1", &["fp-1"]))
        .await
        .unwrap();
    assert!(
        !matches!(again, EffectClaim::OlderRelease { .. }),
        "{again:?}"
    );
    // Another plugin's row under the older key is not this request.
    let other_plugin = EffectClaimParams {
        plugin: "another_plugin".into(),
        ..probing("another_plugin/inv:1", &["fp-1"])
    };
    assert!(matches!(
        store.effect_claim(other_plugin).await.unwrap(),
        EffectClaim::Claimed { .. }
    ));
}
