//! The dead-letter queue: what a dead job keeps, redaction, replay, filters.

use super::*;
use idem::store::{
    EffectClaim, EffectFailParams, EffectStatus, EffectSucceedParams, Fence, JobChange, JobFilter,
    JobState, Replayed, Resolution, SavePlanParams, Sent,
};
use sha2::{Digest, Sha256};

pub async fn dead_keeps_metadata(store: Arc<dyn Store>) {
    let id = store
        .job_insert(NewJob {
            max_attempts: 3,
            correlation_id: Some("trace-9".into()),
            ..keyed("send_invoice_email", "invoice:9:email:v1")
        })
        .await
        .unwrap()
        .id;
    for attempt in 1..=2 {
        let claimed = claim_one(&store, &format!("w{attempt}"), LONG).await;
        assert_eq!(claimed.attempt, attempt);
        let retried = change(
            &store,
            &claimed.fence(),
            JobChange::Retry {
                delay: Duration::ZERO,
                error: Some(error(attempt, "retryable", "provider_timeout")),
                refund_attempt: false,
                plugin_hash: Some(format!("hash-{attempt}")),
            },
        )
        .await;
        assert_eq!(retried, Fence::Applied);
        advance(&store, Duration::from_millis(5)).await;
    }
    let last = claim_one(&store, "w3", LONG).await;
    let outcome = change(
        &store,
        &last.fence(),
        JobChange::Dead {
            error: idem::store::ErrorRecord {
                message: "x".repeat(10_000),
                ..error(3, "permanent", "invalid_recipient")
            },
            redact_payload: false,
            plugin_hash: Some("hash-3".into()),
        },
    )
    .await;
    assert_eq!(outcome, Fence::Applied);

    let dead = get(&store, id).await;
    assert_eq!(dead.state, JobState::Dead);
    assert_eq!(dead.attempt, 3);
    assert_eq!(dead.idempotency_key.as_deref(), Some("invoice:9:email:v1"));
    assert_eq!(dead.plugin, "send_invoice_email");
    assert_eq!(dead.correlation_id, "trace-9");
    assert_eq!(dead.plugin_hash.as_deref(), Some("hash-3"));
    assert_eq!(dead.last_error_code.as_deref(), Some("invalid_recipient"));
    let message = dead.last_error_message.as_deref().unwrap();
    assert!(
        message.len() <= idem::failure::Failure::MAX_MESSAGE,
        "messages are bounded"
    );
    let first = dead.first_failed_at_ms.unwrap();
    let last_failed = dead.last_failed_at_ms.unwrap();
    assert!(
        first + 10 <= last_failed,
        "first {first} and last {last_failed} failure"
    );
    assert!(dead.finished_at_ms.unwrap() >= last_failed);
    assert_eq!(dead.lease_owner, None);
    assert_eq!(
        dead.payload, br#"{"plugin":"send_invoice_email"}"#,
        "not redacted"
    );
    let codes: Vec<&str> = dead.errors.iter().map(|e| e.code.as_str()).collect();
    assert_eq!(
        codes,
        ["provider_timeout", "provider_timeout", "invalid_recipient"]
    );
    let classes: Vec<&str> = dead.errors.iter().map(|e| e.class.as_str()).collect();
    assert_eq!(classes, ["retryable", "retryable", "permanent"]);
    assert_eq!(
        dead.errors.iter().map(|e| e.attempt).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert!(
        (dead.errors[0].at_ms - first).abs() <= 5,
        "times come from the database clock"
    );
    assert!(dead.errors[2].at_ms >= dead.errors[1].at_ms);
    assert!(
        store
            .job_claim(claim_params("w", 10, LONG))
            .await
            .unwrap()
            .is_empty()
    );
}

pub async fn dead_redacts_payload(store: Arc<dyn Store>) {
    let original = br#"{"email":"someone@example.com","card":"4242"}"#.to_vec();
    let id = store
        .job_insert(NewJob {
            payload: original.clone(),
            ..job("pii")
        })
        .await
        .unwrap()
        .id;
    let claimed = claim_one(&store, "w", LONG).await;
    let outcome = dead_letter(
        &store,
        DeadParams {
            fence: claimed.fence(),
            error: error(1, "permanent", "schema_violation"),
            redact_payload: true,
        },
    )
    .await
    .unwrap();
    assert_eq!(outcome, Fence::Applied);
    let dead = get(&store, id).await;
    let reference: serde_json::Value = serde_json::from_slice(&dead.payload).unwrap();
    assert_eq!(
        reference,
        serde_json::json!({ "redacted": true, "sha256": hex::encode(Sha256::digest(&original)) })
    );
    assert_eq!(dead.last_error_code.as_deref(), Some("schema_violation"));
}

pub async fn replay_resets_attempts_keeps_key(store: Arc<dyn Store>) {
    let id = store
        .job_insert(NewJob {
            max_attempts: 1,
            ..keyed("order_sync", "order:5:sync")
        })
        .await
        .unwrap()
        .id;
    let bystander = store.job_insert(job("other")).await.unwrap().id;
    let claimed = claim_one(&store, "w", LONG).await;
    assert_eq!(claimed.id, id);
    store
        .job_save_plan(SavePlanParams {
            fence: claimed.fence(),
            plan: (r#"["plan"]"#).to_string(),
            plugin_hash: "hash-1".into(),
        })
        .await
        .unwrap();
    dead_letter(
        &store,
        DeadParams {
            fence: claimed.fence(),
            error: error(1, "permanent", "missing_reference"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();

    // Only dead jobs are replayed.
    assert_eq!(store.job_replay(&[]).await.unwrap(), Replayed::default());
    assert_eq!(
        store
            .job_replay(&[id, bystander, JobId(i64::MAX)])
            .await
            .unwrap(),
        Replayed {
            replayed: vec![id],
            refused: vec![]
        }
    );
    let replayed = get(&store, id).await;
    assert_eq!(replayed.state, JobState::Available);
    assert_eq!(replayed.attempt, 0);
    assert_eq!(replayed.finished_at_ms, None);
    assert_eq!(replayed.idempotency_key.as_deref(), Some("order:5:sync"));
    assert_eq!(replayed.plan.as_deref(), Some(r#"["plan"]"#), "plan kept");
    assert_eq!(replayed.errors.len(), 1, "history kept");
    assert_eq!(
        replayed.last_error_code.as_deref(),
        Some("missing_reference")
    );
    assert!(
        store.job_replay(&[id]).await.unwrap().replayed.is_empty(),
        "no longer dead"
    );

    // The key still deduplicates, and the job runs again from attempt 1.
    let again = store
        .job_insert(keyed("order_sync", "order:5:sync"))
        .await
        .unwrap();
    assert_eq!(again.id, id);
    assert!(!again.inserted);
    let rerun = store.job_claim(claim_params("w", 10, LONG)).await.unwrap();
    let rerun = rerun.iter().find(|j| j.id == id).expect("claimable again");
    assert_eq!(rerun.attempt, 1);
}

pub async fn dead_jobs_filter_by_plugin_and_code(store: Arc<dyn Store>) {
    let kill = |plugin: &'static str, code: &'static str| {
        let store = store.clone();
        async move {
            let id = store.job_insert(job(plugin)).await.unwrap().id;
            let claimed = claim_one(&store, "w", LONG).await;
            assert_eq!(claimed.id, id);
            dead_letter(
                &store,
                DeadParams {
                    fence: claimed.fence(),
                    error: error(1, "permanent", code),
                    redact_payload: false,
                },
            )
            .await
            .unwrap();
            id
        }
    };
    let a = kill("mail", "invalid_recipient").await;
    let b = kill("mail", "bad_credentials").await;
    let c = kill("webhook", "invalid_recipient").await;
    store.job_insert(job("mail")).await.unwrap();

    let dead = |plugin: Option<&str>, code: Option<&str>| JobFilter {
        states: vec![JobState::Dead],
        plugin: plugin.map(str::to_string),
        error_code: code.map(str::to_string),
        ..Default::default()
    };
    let ids = |jobs: Vec<idem::store::Job>| jobs.into_iter().map(|j| j.id).collect::<Vec<_>>();
    assert_eq!(
        ids(store.job_list(dead(None, None)).await.unwrap()),
        vec![c, b, a]
    );
    assert_eq!(
        ids(store.job_list(dead(Some("mail"), None)).await.unwrap()),
        vec![b, a]
    );
    assert_eq!(
        ids(store
            .job_list(dead(None, Some("invalid_recipient")))
            .await
            .unwrap()),
        vec![c, a]
    );
    assert_eq!(
        ids(store
            .job_list(dead(Some("mail"), Some("invalid_recipient")))
            .await
            .unwrap()),
        vec![a]
    );
    // Replay by filter: list, then replay those ids.
    let picked = ids(store
        .job_list(dead(None, Some("invalid_recipient")))
        .await
        .unwrap());
    assert_eq!(store.job_replay(&picked).await.unwrap().replayed.len(), 2);
    assert_eq!(
        ids(store.job_list(dead(None, None)).await.unwrap()),
        vec![b]
    );
}

pub async fn discard_plan_only_when_no_effect_happened(store: Arc<dyn Store>) {
    use idem::store::{EffectClaim, EffectFailParams, EffectStatus, Sent};
    let plan = |keys: &[&str]| {
        let effects: Vec<_> = keys
            .iter()
            .map(|k| serde_json::json!({"provider": "email", "idempotency_key": k, "action": {"type": "custom", "body": ""}}))
            .collect();
        serde_json::to_string(&effects).unwrap()
    };
    let fence_of = |claim: EffectClaim| match claim {
        EffectClaim::Claimed { fence } => fence,
        other => panic!("expected a claim, got {other:?}"),
    };
    // A: its only effect failed permanently; the plan can go, and the key with it.
    let a = store.job_insert(job("p")).await.unwrap().id;
    let claimed_a = claim_one(&store, "w", LONG).await;
    store
        .job_save_plan(SavePlanParams {
            fence: claimed_a.fence(),
            plan: plan(&["a1"]),
            plugin_hash: "h".into(),
        })
        .await
        .unwrap();
    let f = fence_of(
        store
            .effect_claim(claim_by(&claimed_a, "a1", LONG))
            .await
            .unwrap(),
    );
    store
        .effect_set_failed(EffectFailParams {
            fence: f,
            status: EffectStatus::Failed,
            error_code: "invalid_recipient".into(),
            sent: Sent::NotApplied,
        })
        .await
        .unwrap();
    dead_letter(
        &store,
        DeadParams {
            fence: claimed_a.fence(),
            error: error(1, "permanent", "invalid_recipient"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    // B: one of its effects happened; its plan must stay.
    let b = store.job_insert(job("p")).await.unwrap().id;
    let claimed_b = claim_one(&store, "w", LONG).await;
    store
        .job_save_plan(SavePlanParams {
            fence: claimed_b.fence(),
            plan: plan(&["b1", "b2"]),
            plugin_hash: "h".into(),
        })
        .await
        .unwrap();
    let f = fence_of(
        store
            .effect_claim(claim_by(&claimed_b, "b1", LONG))
            .await
            .unwrap(),
    );
    store
        .effect_set_succeeded(EffectSucceedParams {
            fence: f.clone(),
            result_ref: Some("r".into()),
        })
        .await
        .unwrap();
    dead_letter(
        &store,
        DeadParams {
            fence: claimed_b.fence(),
            error: error(1, "permanent", "bad_request"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    let live = store.job_insert(job("p")).await.unwrap().id;

    assert!(store.job_discard_plan(a).await.unwrap());
    let a_job = get(&store, a).await;
    assert_eq!((a_job.plan, a_job.plan_hash), (None, None));
    assert!(
        store.effect_get("a1").await.unwrap().is_none(),
        "the unfinished key went with the plan"
    );
    assert!(!store.job_discard_plan(b).await.unwrap());
    assert!(get(&store, b).await.plan.is_some());
    assert!(
        !store.job_discard_plan(live).await.unwrap(),
        "only dead jobs"
    );
}

/// A claimed job whose plan carries `keys`, dead-lettered after `tries`
/// ran on its first key (each try: status, code, what it told about the
/// provider).
async fn dead_with_plan(
    store: &Arc<dyn Store>,
    keys: &[&str],
    tries: &[(EffectStatus, &str, Sent)],
) -> JobId {
    let id = store.job_insert(job("p")).await.unwrap().id;
    let held = claim_one(store, "w", LONG).await;
    assert_eq!(held.id, id);
    let effects: Vec<_> = keys
        .iter()
        .map(|k| serde_json::json!({"provider": "email", "idempotency_key": k, "action": {"type": "custom", "body": ""}}))
        .collect();
    store
        .job_save_plan(SavePlanParams {
            fence: held.fence(),
            plan: serde_json::to_string(&effects).unwrap(),
            plugin_hash: "h".into(),
        })
        .await
        .unwrap();
    for (status, code, sent) in tries {
        let fence = match store
            .effect_claim(claim_by(&held, keys[0], LONG))
            .await
            .unwrap()
        {
            EffectClaim::Claimed { fence } | EffectClaim::InDoubt { fence, .. } => fence,
            other => panic!("expected a claim, got {other:?}"),
        };
        let failed = store
            .effect_set_failed(EffectFailParams {
                fence,
                status: *status,
                error_code: code.to_string(),
                sent: *sent,
            })
            .await
            .unwrap();
        assert_eq!(failed, Fence::Applied);
    }
    dead_letter(
        store,
        DeadParams {
            fence: held.fence(),
            error: error(1, "permanent", "x"),
            redact_payload: false,
        },
    )
    .await
    .unwrap();
    id
}

/// Claims the replayed job `id` for worker `w`, giving back whatever else
/// that claim took.
async fn hold_again(store: &Arc<dyn Store>, id: JobId) -> Job {
    let jobs = store.job_claim(claim_params("w", 10, LONG)).await.unwrap();
    let mut found = None;
    for job in jobs {
        if job.id == id {
            found = Some(job);
        } else {
            store.job_release(&job.fence()).await.unwrap();
        }
    }
    found.expect("the replayed job is claimable")
}

/// Window 3: replay refuses, per job and naming the key, a job whose plan
/// holds an effect in doubt, until an operator resolves it.
pub async fn replay_refuses_effects_in_doubt_until_resolved(store: Arc<dyn Store>) {
    let unresolved = [(EffectStatus::Failed, "may_not_resend", Sent::Unresolved)];
    let not_applied = dead_with_plan(&store, &["n1", "n2"], &unresolved).await;
    let applied = dead_with_plan(&store, &["a1"], &unresolved).await;
    let clean = dead_with_plan(
        &store,
        &["c1"],
        &[(EffectStatus::Failed, "invalid_recipient", Sent::NotApplied)],
    )
    .await;
    let row = store.effect_get("n1").await.unwrap().unwrap();
    assert!(row.in_doubt && row.reached, "{row:?}");

    let report = store
        .job_replay(&[not_applied, applied, clean])
        .await
        .unwrap();
    assert_eq!(
        report,
        Replayed {
            replayed: vec![clean],
            refused: vec![(not_applied, "n1".into()), (applied, "a1".into())],
        }
    );
    assert_eq!(get(&store, not_applied).await.state, JobState::Dead);
    assert_eq!(
        store.effect_get("n1").await.unwrap().unwrap().status,
        EffectStatus::Failed,
        "a refused job's keys are left alone"
    );
    assert!(
        !store
            .effect_resolve("c1", Resolution::NotApplied)
            .await
            .unwrap(),
        "not in doubt: nothing to resolve"
    );

    // Not applied: the replay sends it again, as a fresh try.
    assert!(
        store
            .effect_resolve("n1", Resolution::NotApplied)
            .await
            .unwrap()
    );
    let row = store.effect_get("n1").await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.in_doubt, row.reached),
        (EffectStatus::Retrying, false, false)
    );
    // Applied: the replay skips it, with the operator's reference.
    let applied_as = Resolution::Applied {
        result_ref: Some("msg-7".into()),
    };
    assert!(
        store
            .effect_resolve("a1", applied_as.clone())
            .await
            .unwrap()
    );
    assert!(
        !store.effect_resolve("a1", applied_as).await.unwrap(),
        "resolved once"
    );
    let report = store.job_replay(&[not_applied, applied]).await.unwrap();
    assert_eq!(report.replayed, [not_applied, applied]);
    assert!(report.refused.is_empty());

    let rerun = hold_again(&store, not_applied).await;
    assert!(matches!(
        store
            .effect_claim(claim_by(&rerun, "n1", LONG))
            .await
            .unwrap(),
        EffectClaim::Claimed { .. }
    ));
    let rerun = hold_again(&store, applied).await;
    assert_eq!(
        store
            .effect_claim(claim_by(&rerun, "a1", LONG))
            .await
            .unwrap(),
        EffectClaim::AlreadySucceeded {
            result_ref: Some("msg-7".into())
        }
    );
}

/// Window 4: discard is judged from every try, not the last error: a key
/// whose first try may have been carried out keeps its plan even when a
/// later try was refused outright.
pub async fn discard_plan_refused_once_any_try_reached(store: Arc<dyn Store>) {
    let reached_then_rejected = dead_with_plan(
        &store,
        &["r1"],
        &[
            (
                EffectStatus::Retrying,
                "provider_timeout",
                Sent::MaybeApplied,
            ),
            (EffectStatus::Failed, "provider_rejected", Sent::NotApplied),
        ],
    )
    .await;
    let row = store.effect_get("r1").await.unwrap().unwrap();
    assert_eq!(row.last_error_code.as_deref(), Some("provider_rejected"));
    assert!(row.reached);
    assert!(!store.job_discard_plan(reached_then_rejected).await.unwrap());
    assert!(get(&store, reached_then_rejected).await.plan.is_some());

    let only_rejected = dead_with_plan(
        &store,
        &["x1"],
        &[
            (
                EffectStatus::Retrying,
                "provider_unavailable",
                Sent::NotApplied,
            ),
            (EffectStatus::Failed, "provider_rejected", Sent::NotApplied),
        ],
    )
    .await;
    assert!(store.job_discard_plan(only_rejected).await.unwrap());
}

pub async fn dead_on_arrival_keeps_the_payload_and_the_code(store: Arc<dyn Store>) {
    let id = store
        .job_insert_dead(
            NewJob {
                idempotency_key: Some("dead-on-arrival:1".into()),
                queue: "inbox".into(),
                ..NewJob::new("order_sync", b"{\"no\":\"key\"}".to_vec())
            },
            error(0, "permanent", "message_key_missing"),
        )
        .await
        .unwrap();
    let job = store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.payload, b"{\"no\":\"key\"}");
    assert_eq!(job.idempotency_key.as_deref(), Some("dead-on-arrival:1"));
    // The same message again (a redelivery): the same dead job, one record.
    let again = store
        .job_insert_dead(
            NewJob {
                idempotency_key: Some("dead-on-arrival:1".into()),
                queue: "inbox".into(),
                ..NewJob::new("order_sync", b"{\"no\":\"key\"}".to_vec())
            },
            error(0, "permanent", "message_key_missing"),
        )
        .await
        .unwrap();
    assert_eq!(again, id);
    assert_eq!(job.queue, "inbox");
    assert_eq!(job.last_error_code.as_deref(), Some("message_key_missing"));
    assert_eq!(job.errors.len(), 1);
    assert!(job.finished_at_ms.is_some());
    let dead = store
        .job_list(JobFilter {
            states: vec![JobState::Dead],
            error_code: Some("message_key_missing".into()),
            ..JobFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    // Never claimed.
    assert!(
        store
            .job_claim(ClaimParams {
                queue: "inbox".into(),
                ..claim_params("w", 10, LONG)
            })
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .job_insert_dead(NewJob::new("", b"{}".to_vec()), error(0, "permanent", "x"))
            .await
            .is_err(),
        "checked as any job"
    );
}
