//! Issue 25: effects in doubt at a provider that cannot dedupe are settled
//! by asking it (its lookup), not left for a person. Workers die mid-call
//! at the failpoints (`idem run` processes built with `failpoints`), the
//! store's clock is moved for the takeovers, and the provider server runs
//! without deduplication, so a repeat would be applied (and counted) twice.

use idem::queue::reconcile::{ReconcileRequest, reconcile_once};
use idem::store::{EffectStatus, JobFilter, JobId, JobState, NewJob};
use idem_provider_server::{Fault, ProviderServerConfig};
use idem_tests::{Backend, Harness, both_backends};
use std::time::Duration;

/// The providers cannot dedupe and answer lookups by key.
const LOOKUP: &str = "dedupes = false\nlookup = { path = \"/by-key/{key}\", settle = \"0s\" }";
/// The providers cannot dedupe and cannot be asked.
const NO_LOOKUP: &str = "dedupes = false";

fn key(id: u64) -> String {
    format!("send_invoice_email/invoice:{id}:email:v1")
}

fn invoice(id: u64) -> NewJob {
    NewJob::new(
        "send_invoice_email",
        format!(r#"{{"invoice_id": {id}, "recipient": "ana@example.com"}}"#).into_bytes(),
    )
}

/// A provider server that applies every request it accepts, repeats
/// included, as a provider without deduplication does.
async fn harness(backend: Backend) -> Harness {
    Harness::with_provider(
        backend,
        ProviderServerConfig {
            dedupe: false,
            late_by: Duration::from_millis(1500),
            ..ProviderServerConfig::default()
        },
    )
    .await
}

/// Runs `idem run --exit-when-drained` with `failpoint=abort` until it
/// exits (at the failpoint, or drained), then lets another worker take over
/// what it held: the store's clock is moved past every lease.
async fn run_until_killed(h: &Harness, extra: &str, failpoint: &str) {
    let config = h.config_file_with(Duration::from_secs(5), extra);
    let mut child = idem_tests::spawn_drain(
        env!("CARGO_BIN_EXE_idem-test"),
        config.path(),
        &format!("{failpoint}=abort"),
    );
    tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("the process exits within 60 s")
        .expect("wait for idem run");
    h.store
        .clock_advance(Duration::from_secs(600))
        .await
        .unwrap();
    h.store.job_rescue_expired(100).await.unwrap();
}

async fn jobs(h: &Harness, state: JobState) -> Vec<idem::store::Job> {
    h.store
        .job_list(JobFilter {
            states: vec![state],
            ..JobFilter::default()
        })
        .await
        .unwrap()
}

/// Workers killed right after the provider answered and right after the
/// key was claimed, round after round: every effect is applied exactly
/// once, every job succeeds, nothing waits in the DLQ.
async fn killed_mid_call_many_times(backend: Backend) {
    let h = harness(backend).await;
    let ids: Vec<u64> = (1..=6).collect();
    for id in &ids {
        h.store.job_insert(invoice(*id)).await.unwrap();
    }
    for round in 0..8 {
        let failpoint = if round % 2 == 0 {
            "after_provider_call"
        } else {
            "after_key_claimed"
        };
        run_until_killed(&h, LOOKUP, failpoint).await;
    }
    h.drain_with(h.providers_with(LOOKUP)).await;
    for id in &ids {
        assert_eq!(h.provider.applied(&key(*id)), 1, "{}", key(*id));
    }
    assert_eq!(jobs(&h, JobState::Succeeded).await.len(), ids.len());
    assert!(
        jobs(&h, JobState::Dead).await.is_empty(),
        "nothing in the DLQ"
    );
    let asked: u32 = ids.iter().map(|id| h.provider.lookups(&key(*id))).sum();
    assert!(asked >= 4, "the provider was asked ({asked} lookups)");
}

/// Without a lookup, as before: the key waits for a person, the job in the
/// DLQ `may_not_resend`, and the effect is not sent again.
async fn without_a_lookup_the_key_waits_for_a_person(backend: Backend) {
    let h = harness(backend).await;
    let id = h.store.job_insert(invoice(7)).await.unwrap().id;
    run_until_killed(&h, NO_LOOKUP, "after_provider_call").await;
    h.drain_with(h.providers_with(NO_LOOKUP)).await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.last_error_code.as_deref(), Some("may_not_resend"));
    let row = h.store.effect_get(&key(7)).await.unwrap().unwrap();
    assert!(row.in_doubt, "{row:?}");
    assert_eq!(h.provider.applied(&key(7)), 1);
    assert_eq!(h.provider.lookups(&key(7)), 0);
}

/// A lookup that lies (says "not applied" of a key it applied) makes idem
/// send the effect again: the operator's risk, documented, and what the
/// provider's own count shows.
async fn a_lookup_that_lies_repeats_the_effect(backend: Backend) {
    let h = harness(backend).await;
    let id = h.store.job_insert(invoice(8)).await.unwrap().id;
    run_until_killed(&h, LOOKUP, "after_provider_call").await;
    h.provider.set_lookup_lies(true);
    h.drain_with(h.providers_with(LOOKUP)).await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(
        h.provider.applied(&key(8)),
        2,
        "the lie made idem send it again: applied twice at the provider"
    );
}

/// An ambiguous answer (the provider applied it but answered after the
/// timeout): the job waits (no attempt used) until the provider's timeout
/// has passed, then the lookup finds it applied; it is not sent again.
async fn an_ambiguous_answer_is_settled_by_asking(backend: Backend) {
    let h = harness(backend).await;
    h.provider.script_faults(&key(9), vec![Fault::Late]);
    let id = h.store.job_insert(invoice(9)).await.unwrap().id;
    h.drain_with(h.providers_with(LOOKUP)).await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    assert_eq!(job.attempt, 1, "the wait used no attempt");
    assert_eq!(h.provider.applied(&key(9)), 1);
    assert!(h.provider.lookups(&key(9)) >= 1);
    let row = h.store.effect_get(&key(9)).await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Succeeded);
    assert!(
        row.result_ref
            .as_deref()
            .is_some_and(|r| r.starts_with("msg_")),
        "the looked-up reference: {row:?}"
    );
}

/// The sweep: jobs dead-lettered in doubt by a host without lookups are
/// settled once a lookup is configured (a dry run first writes nothing),
/// then replayed; one whose effect was not applied is sent once.
async fn the_sweep_settles_keys_and_replays_their_jobs(backend: Backend) {
    let h = harness(backend).await;
    let applied = h.store.job_insert(invoice(10)).await.unwrap().id;
    run_until_killed(&h, NO_LOOKUP, "after_provider_call").await;
    let unsent = h.store.job_insert(invoice(11)).await.unwrap().id;
    run_until_killed(&h, NO_LOOKUP, "after_key_claimed").await;
    h.drain_with(h.providers_with(NO_LOOKUP)).await;
    for id in [applied, unsent] {
        let job = h.store.job_get(id).await.unwrap().unwrap();
        assert_eq!(
            (job.state, job.last_error_code.as_deref()),
            (JobState::Dead, Some("may_not_resend")),
            "{job:?}"
        );
    }
    let providers = h.providers_with(LOOKUP);
    let pacer = idem::ops::replay::Pacer::per_second(1000.0).unwrap();
    let dry = ReconcileRequest {
        plugin: None,
        dry_run: true,
        limit: 100,
    };
    let report = reconcile_once(&*h.store, &providers, &dry, &pacer)
        .await
        .unwrap();
    let mut outcomes: Vec<(String, &str)> = report
        .asked
        .iter()
        .map(|a| (a.key.clone(), a.outcome))
        .collect();
    outcomes.sort();
    assert_eq!(
        outcomes,
        [(key(10), "applied"), (key(11), "not_applied")],
        "{report:?}"
    );
    let mut would: Vec<JobId> = report.replayed.clone();
    would.sort();
    assert_eq!(would, [applied, unsent]);
    assert_eq!(report.settled(), 0, "a dry run writes nothing");
    assert!(
        h.store
            .effect_get(&key(10))
            .await
            .unwrap()
            .unwrap()
            .in_doubt
    );
    assert_eq!(jobs(&h, JobState::Dead).await.len(), 2);

    let run = ReconcileRequest {
        dry_run: false,
        ..dry
    };
    let report = reconcile_once(&*h.store, &providers, &run, &pacer)
        .await
        .unwrap();
    assert_eq!(report.settled(), 2, "{report:?}");
    assert_eq!(report.replayed.len(), 2, "{report:?}");
    let row = h.store.effect_get(&key(10)).await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Succeeded);
    h.drain_with(h.providers_with(LOOKUP)).await;
    for id in [applied, unsent] {
        let job = h.store.job_get(id).await.unwrap().unwrap();
        assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    }
    assert_eq!(
        h.provider.applied(&key(10)),
        1,
        "found applied: not sent again"
    );
    assert_eq!(
        h.provider.applied(&key(11)),
        1,
        "found not applied: sent once"
    );
    let again = reconcile_once(&*h.store, &providers, &run, &pacer)
        .await
        .unwrap();
    assert!(
        again.asked.is_empty() && again.replayed.is_empty(),
        "{again:?}"
    );
}

/// A provider that cannot be asked now (503): the job waits, deferred (no
/// attempt used), and the key is settled once the provider answers.
async fn a_lookup_that_fails_is_asked_again(backend: Backend) {
    let h = harness(backend).await;
    let id = h.store.job_insert(invoice(12)).await.unwrap().id;
    run_until_killed(&h, LOOKUP, "after_provider_call").await;
    h.provider.script_path_faults(
        &format!("/by-key/{}", urlencoding(&key(12))),
        vec![Fault::ServerError, Fault::ServerError],
    );
    h.drain_with(h.providers_with(LOOKUP)).await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    assert_eq!(
        job.attempt, 2,
        "one attempt lost to the kill, none to the lookups"
    );
    assert_eq!(h.provider.applied(&key(12)), 1);
    assert!(h.provider.lookups(&key(12)) >= 3, "asked until it answered");
}

/// `{key}` as the host sends it: every byte outside the unreserved set
/// percent-encoded.
fn urlencoding(key: &str) -> String {
    key.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

both_backends!(
    killed_mid_call_many_times,
    without_a_lookup_the_key_waits_for_a_person,
    a_lookup_that_lies_repeats_the_effect,
    an_ambiguous_answer_is_settled_by_asking,
    the_sweep_settles_keys_and_replays_their_jobs,
    a_lookup_that_fails_is_asked_again,
);
