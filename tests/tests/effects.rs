//! Effects carried out exactly once, on both backends, asserting on what the
//! local provider server really applied.

use idem::effects::{Action, Effect, fingerprint, legacy_fingerprint};
use idem::failure::ErrorClass;
use idem::queue::executor::{Executor, PlanOutcome, Riders};
use idem::queue::outcome::DeferReason;
use idem::queue::stats::WorkerStats;
use idem::queue::{Worker, WorkerSettings};
use idem::store::{
    ClaimParams, EffectClaim, EffectClaimParams, EffectFailParams, EffectStatus, Job, JobFilter,
    JobState, NewJob, Resolution, SavePlanParams, Sent,
};
use idem_provider_server::{Fault, ProviderServerConfig};
use idem_tests::{Backend, Harness, both_backends, plugins};
use std::sync::Arc;
use std::time::Duration;

fn invoice(id: u64, recipient: &str) -> NewJob {
    NewJob::new(
        "send_invoice_email",
        format!(r#"{{"invoice_id": {id}, "recipient": "{recipient}"}}"#).into_bytes(),
    )
}

fn order(order_id: u64, event: &str) -> NewJob {
    NewJob::new(
        "order_sync",
        format!(r#"{{"order_id": {order_id}, "event_id": "{event}", "destination": "acme"}}"#)
            .into_bytes(),
    )
}

async fn jobs(h: &Harness, state: JobState) -> Vec<idem::store::Job> {
    h.store
        .job_list(JobFilter {
            states: vec![state],
            limit: 1000,
            ..JobFilter::default()
        })
        .await
        .unwrap()
}

async fn the_same_invoice_event_delivered_three_times_sends_one_email(backend: Backend) {
    let h = Harness::new(backend).await;
    for _ in 0..3 {
        h.store
            .job_insert(invoice(42, "ana@example.com"))
            .await
            .unwrap();
    }
    let stats = h.drain().await;
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:42:email:v1"),
        1
    );
    assert_eq!(stats.succeeded, 3);
    assert_eq!(stats.idempotency_hits, 2, "{stats:?}");
    let effect = h
        .store
        .effect_get("send_invoice_email/invoice:42:email:v1")
        .await
        .unwrap()
        .unwrap();
    assert!(effect.result_ref.unwrap().starts_with("msg_"));
}

async fn an_ambiguous_timeout_is_retried_with_the_same_key_and_sends_one_email(backend: Backend) {
    let h = Harness::with_provider(
        backend,
        ProviderServerConfig {
            late_by: Duration::from_millis(1500),
            ..ProviderServerConfig::default()
        },
    )
    .await;
    h.provider
        .script_faults("send_invoice_email/invoice:42:email:v1", vec![Fault::Late]);
    let id = h
        .store
        .job_insert(invoice(42, "ana@example.com"))
        .await
        .unwrap()
        .id;
    let stats = h.drain().await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.attempt, 2, "one ambiguous attempt, then success");
    assert_eq!(job.errors[0].code, "provider_timeout");
    assert_eq!(job.errors[0].class, ErrorClass::Ambiguous);
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:42:email:v1"),
        1,
        "the provider applied it once"
    );
    assert!(
        h.provider
            .requests("send_invoice_email/invoice:42:email:v1")
            >= 2
    );
    assert_eq!(stats.effects_failed, 1);
}

async fn a_429_is_retried_after_its_retry_after_and_then_succeeds(backend: Backend) {
    let h = Harness::new(backend).await;
    h.provider.script_faults(
        "send_invoice_email/invoice:42:email:v1",
        vec![Fault::TooManyRequests],
    );
    let id = h
        .store
        .job_insert(invoice(42, "ana@example.com"))
        .await
        .unwrap()
        .id;
    let started = std::time::Instant::now();
    h.drain().await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.errors[0].code, "provider_rate_limited");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After: 1 was honoured"
    );
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:42:email:v1"),
        1
    );
}

async fn a_permanent_provider_error_dead_letters_with_its_code_and_sends_nothing(backend: Backend) {
    let h = Harness::new(backend).await;
    h.provider.script_faults(
        "send_invoice_email/invoice:42:email:v1",
        vec![Fault::BadRequest],
    );
    let id = h
        .store
        .job_insert(invoice(42, "ana@example.com"))
        .await
        .unwrap()
        .id;
    let stats = h.drain().await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.attempt, 1, "permanent: no retry");
    assert_eq!(job.last_error_code.as_deref(), Some("bad_request"));
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:42:email:v1"),
        0
    );
    assert_eq!(stats.dead, 1);
    let effect = h
        .store
        .effect_get("send_invoice_email/invoice:42:email:v1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(effect.status, idem::store::EffectStatus::Failed);
}

async fn a_plugin_rejection_dead_letters_at_once(backend: Backend) {
    let h = Harness::new(backend).await;
    let id = h.store.job_insert(invoice(43, "nobody")).await.unwrap().id;
    h.drain().await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.last_error_code.as_deref(), Some("invalid_recipient"));
    assert!(h.provider.calls().await.is_empty());
}

async fn a_key_reused_for_a_different_request_is_an_idempotency_key_conflict(backend: Backend) {
    let h = Harness::new(backend).await;
    let first = h
        .store
        .job_insert(invoice(42, "ana@example.com"))
        .await
        .unwrap()
        .id;
    h.drain().await;
    // Same invoice, other recipient: same key, different request.
    let second = h
        .store
        .job_insert(invoice(42, "bob@example.com"))
        .await
        .unwrap()
        .id;
    h.drain().await;
    assert_eq!(
        h.store.job_get(first).await.unwrap().unwrap().state,
        JobState::Succeeded
    );
    let job = h.store.job_get(second).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(
        job.last_error_code.as_deref(),
        Some("idempotency_key_conflict")
    );
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:42:email:v1"),
        1
    );
    assert_eq!(
        h.provider
            .requests("send_invoice_email/invoice:42:email:v1"),
        1,
        "the conflicting request never left the host"
    );
}

async fn the_provider_reports_a_key_conflict_as_permanent(backend: Backend) {
    // The ledger lost its row (e.g. a restore): the provider still protects the key.
    let h = Harness::new(backend).await;
    let client = reqwest_free_post(
        &h.provider.base_url,
        "send_invoice_email/invoice:42:email:v1",
    )
    .await;
    assert!(client);
    let id = h
        .store
        .job_insert(invoice(42, "ana@example.com"))
        .await
        .unwrap()
        .id;
    h.drain().await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(
        job.last_error_code.as_deref(),
        Some("idempotency_key_conflict")
    );
    assert_eq!(job.state, JobState::Dead);
}

/// Sends a different request with `key` to the provider server directly.
async fn reqwest_free_post(base_url: &str, key: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base_url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = r#"{"to":["someone@else.com"],"subject":"other"}"#;
    let request = format!(
        "POST /emails HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response.starts_with("HTTP/1.1 200")
}

async fn an_effect_for_an_ungranted_provider_is_refused_and_nothing_is_sent(backend: Backend) {
    let h = Harness::new(backend).await;
    // The plugin declares `email`; the operator file narrows it to nothing.
    h.set_manifest("send_invoice_email", "providers = []");
    let plugin = h.registry.get("send_invoice_email").unwrap();
    assert!(
        !plugin.grants.allows_provider("email"),
        "the narrowing applied"
    );
    let id = h
        .store
        .job_insert(invoice(42, "ana@example.com"))
        .await
        .unwrap()
        .id;
    h.drain().await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.last_error_code.as_deref(), Some("effect_not_allowed"));
    assert!(job.plan.is_none(), "a refused plan is not stored");
    assert!(h.provider.calls().await.is_empty());
}

async fn a_child_job_for_an_ungranted_plugin_is_refused_and_nothing_is_executed(backend: Backend) {
    let h = Harness::new(backend).await;
    // order_sync declares `enqueues = ["send_invoice_email"]`; the operator
    // file keeps its providers and narrows its child plugins to none.
    h.set_manifest("order_sync", "enqueues = []");
    let plugin = h.registry.get("order_sync").unwrap();
    assert!(
        plugin.grants.allows_provider("jobs") && !plugin.grants.allows_child("send_invoice_email")
    );
    let id = h.store.job_insert(order(7, "evt_1")).await.unwrap().id;
    h.drain().await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.last_error_code.as_deref(), Some("effect_not_allowed"));
    assert!(job.plan.is_none(), "a refused plan is not stored");
    assert!(
        h.provider.calls().await.is_empty(),
        "not even the granted webhook is sent"
    );
    let all = h
        .store
        .job_list(JobFilter {
            limit: 1000,
            ..JobFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), 1, "no child job was enqueued");
}

async fn the_order_flow_delivered_twice_sends_one_webhook_and_enqueues_one_invoice_job(
    backend: Backend,
) {
    let h = Harness::new(backend).await;
    h.store.job_insert(order(7, "evt_1")).await.unwrap();
    h.store.job_insert(order(7, "evt_1")).await.unwrap();
    let stats = h.drain().await;
    assert_eq!(h.provider.applied("order_sync/webhook:evt_1:acme"), 1);
    let invoices: Vec<_> = jobs(&h, JobState::Succeeded)
        .await
        .into_iter()
        .filter(|j| j.plugin == "send_invoice_email")
        .collect();
    assert_eq!(invoices.len(), 1, "exactly one child invoice job");
    assert_eq!(
        invoices[0].idempotency_key.as_deref(),
        Some("order_sync/order:7:invoice")
    );
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:7:email:v1"),
        1,
        "and its email, once"
    );
    assert_eq!(stats.succeeded, 3);
}

async fn a_plugin_upgrade_between_attempts_still_executes_the_stored_plan(backend: Backend) {
    let h = Harness::new(backend).await;
    // The first attempt stores the plan, then the webhook is refused: the job
    // is dead-lettered with its plan (and the effect marked failed).
    h.provider
        .script_faults("order_sync/webhook:evt_9:acme", vec![Fault::BadRequest]);
    let id = h.store.job_insert(order(9, "evt_9")).await.unwrap().id;
    h.drain().await;
    let stored = h.store.job_get(id).await.unwrap().unwrap();
    assert!(stored.plan.is_some());
    // Upgrade: order_sync now returns nothing at all.
    std::fs::copy(plugins::NOOP, h.plugins_dir.path().join("order_sync.wasm")).unwrap();
    h.registry.refresh();
    assert_ne!(
        h.registry.get("order_sync").unwrap().hash().0,
        stored.plan_hash.clone().unwrap()
    );
    assert_eq!(stored.state, JobState::Dead);
    assert_eq!(h.store.job_replay(&[id]).await.unwrap().replayed, [id]);
    let stats = h.drain().await;
    assert_eq!(
        stats.plugin_calls, 1,
        "only the child invoice job called a plugin"
    );
    assert_eq!(stats.plans_reused, 1);
    assert_eq!(h.provider.applied("order_sync/webhook:evt_9:acme"), 1);
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.plan, stored.plan);
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:9:email:v1"),
        1
    );
}

async fn two_workers_on_the_same_job_at_once_carry_the_effect_out_once(backend: Backend) {
    let h = Harness::with_provider(
        backend,
        ProviderServerConfig {
            processing_delay: Duration::from_millis(400),
            ..ProviderServerConfig::default()
        },
    )
    .await;
    h.store
        .job_insert(invoice(42, "ana@example.com"))
        .await
        .unwrap();
    let claim = |worker: &str| ClaimParams {
        queue: "default".into(),
        worker: worker.into(),
        limit: 1,
        lease: Duration::from_secs(10),
        queue_concurrency: None,
        max_attempts: Default::default(),
    };
    let job = h.store.job_claim(claim("a")).await.unwrap().remove(0);
    let plan = vec![Effect {
        provider: "email".into(),
        // Scoped to its plugin, as a plan of this release is.
        idempotency_key: "send_invoice_email/invoice:42:email:v1".into(),
        action: Action::Email {
            to: vec!["ana@example.com".into()],
            subject: "Invoice 42".into(),
            text: Some("hi".into()),
            html: None,
            template: None,
        },
    }];
    let executor = |worker: &str| Executor {
        store: h.store.clone(),
        providers: h.providers(),
        worker: worker.into(),
        effect_lease: Duration::from_secs(30),
        child_max_attempts: 5,
        registry: None,
        stats: Arc::new(WorkerStats::default()),
    };
    let (a, b) = (executor("a"), executor("b"));
    let never = tokio_util::sync::CancellationToken::new();
    // While A's call is in flight, A's job lease runs out and B takes the
    // job over: the key's own lease (sized from the provider timeout) still
    // protects A's call.
    let (mut riders_a, mut riders_b) = (Riders::default(), Riders::default());
    let (ra, (rb, job_b)) = tokio::join!(a.execute(&job, &plan, &never, &mut riders_a), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        h.store
            .clock_advance(Duration::from_secs(11))
            .await
            .unwrap();
        assert_eq!(h.store.job_rescue_expired(10).await.unwrap(), [job.id]);
        let job_b = h.store.job_claim(claim("b")).await.unwrap().remove(0);
        (b.execute(&job_b, &plan, &never, &mut riders_b).await, job_b)
    });
    match (&ra, &rb) {
        (PlanOutcome::Done, PlanOutcome::Deferred { reason, .. }) => {
            assert_eq!(*reason, DeferReason::EffectLeasedByOther);
        }
        other => panic!("expected A's success and B's deferral, got {other:?}"),
    }
    assert_eq!(a.stats.snapshot().effects_executed, 1);
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:42:email:v1"),
        1
    );
    // A's ledger success rides with A's outcome (written here as the
    // worker would, though A's job write itself is fenced out).
    assert_eq!(riders_a.writes().len(), 1, "the success rides");
    assert!(riders_b.is_empty(), "B deferred before any write");
    a.write_riders(riders_a).await.unwrap();
    // B's retry finds the effect done.
    assert!(matches!(
        b.execute(&job_b, &plan, &never, &mut Riders::default())
            .await,
        PlanOutcome::Done
    ));
    assert_eq!(b.stats.snapshot().idempotency_hits, 1);
    // A, fenced out of the job, claims nothing: its claim (no read before
    // it) learns the job is no longer A's.
    assert!(
        matches!(
            a.execute(&job, &plan, &never, &mut Riders::default()).await,
            PlanOutcome::LeaseLost
        ),
        "A no longer holds the job"
    );
    assert_eq!(
        h.provider
            .requests("send_invoice_email/invoice:42:email:v1"),
        1
    );
}

async fn an_open_circuit_defers_jobs_instead_of_calling_a_failing_provider(backend: Backend) {
    let h = Harness::new(backend).await;
    h.provider.script_faults(
        "send_invoice_email/invoice:1:email:v1",
        vec![Fault::ServerError, Fault::ServerError, Fault::ServerError],
    );
    let mut job = invoice(1, "ana@example.com");
    job.max_attempts = 4;
    let id = h.store.job_insert(job).await.unwrap().id;
    let stats = h
        .drain_with(h.providers_with("breaker_failures = 2\nbreaker_cool_down = \"300ms\""))
        .await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.errors);
    assert!(
        stats.deferred >= 1,
        "the open circuit deferred the job: {stats:?}"
    );
    assert_eq!(
        h.provider.requests("send_invoice_email/invoice:1:email:v1"),
        4,
        "three failures and the success, no more"
    );
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:1:email:v1"),
        1
    );
}

async fn a_replay_with_a_discarded_plan_asks_the_fixed_plugin_again(backend: Backend) {
    let h = Harness::new(backend).await;
    h.provider
        .script_faults("order_sync/webhook:evt_5:acme", vec![Fault::BadRequest]);
    let id = h.store.job_insert(order(5, "evt_5")).await.unwrap().id;
    h.drain().await;
    assert_eq!(
        h.store.job_get(id).await.unwrap().unwrap().state,
        JobState::Dead
    );
    // "Fixed" plugin: this order needs no effects after all.
    std::fs::copy(plugins::NOOP, h.plugins_dir.path().join("order_sync.wasm")).unwrap();
    h.registry.refresh();
    assert!(h.store.job_discard_plan(id).await.unwrap());
    h.store.job_replay(&[id]).await.unwrap();
    let stats = h.drain().await;
    assert_eq!(
        stats.plugin_calls, 1,
        "the new plugin version made a new plan"
    );
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.plan.as_deref(), Some("[]"));
    assert_eq!(h.provider.applied("order_sync/webhook:evt_5:acme"), 0);
}

async fn an_effect_done_before_is_skipped_even_while_its_provider_circuit_is_open(
    backend: Backend,
) {
    let h = Harness::new(backend).await;
    h.store
        .job_insert(invoice(1, "ana@example.com"))
        .await
        .unwrap();
    h.drain().await;
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:1:email:v1"),
        1
    );
    // Open the email circuit with one failure.
    let providers = h.providers_with("breaker_failures = 1\nbreaker_cool_down = \"1h\"");
    h.provider.script_faults(
        "send_invoice_email/invoice:2:email:v1",
        vec![Fault::ServerError],
    );
    let mut failing = invoice(2, "bob@example.com");
    failing.max_attempts = 1;
    h.store.job_insert(failing).await.unwrap();
    h.drain_with(providers.clone()).await;
    assert!(providers.get("email").unwrap().guard.is_open());
    // A redelivery of the first invoice: its only effect is done, so the
    // job finishes without waiting for the provider to recover.
    let id = h
        .store
        .job_insert(invoice(1, "ana@example.com"))
        .await
        .unwrap()
        .id;
    let stats = h.drain_with(providers).await;
    assert_eq!(
        h.store.job_get(id).await.unwrap().unwrap().state,
        JobState::Succeeded
    );
    assert_eq!(stats.deferred, 0, "{stats:?}");
    assert_eq!(stats.idempotency_hits, 1);
}

/// The email effect of invoice `id`, as a ghost worker stores and sends it.
fn invoice_email(id: u64) -> Effect {
    Effect {
        provider: "email".into(),
        idempotency_key: format!("invoice:{id}:email:v1"),
        action: Action::Email {
            to: vec!["ana@example.com".into()],
            subject: format!("Invoice {id}"),
            text: Some("hi".into()),
            html: None,
            template: None,
        },
    }
}

/// A worker that vanished mid-call: it claimed the job (lease `lease`),
/// stored `effect` as its plan, claimed its key and sent the request, then
/// never marked anything. Returns the job.
async fn ghost_sent(h: &Harness, effect: &Effect, lease: Duration) -> Job {
    let id = h
        .store
        .job_insert(invoice(1, "x@example.com"))
        .await
        .unwrap()
        .id;
    let job = h
        .store
        .job_claim(ClaimParams {
            queue: "default".into(),
            worker: "ghost".into(),
            limit: 1,
            lease,
            queue_concurrency: None,
            max_attempts: Default::default(),
        })
        .await
        .unwrap()
        .remove(0);
    assert_eq!(job.id, id);
    h.store
        .job_save_plan(SavePlanParams {
            fence: job.fence(),
            plan: serde_json::to_string(&vec![effect.clone()]).unwrap(),
            plugin_hash: "ghost".into(),
        })
        .await
        .unwrap();
    let claim = h
        .store
        .effect_claim(EffectClaimParams {
            key: effect.idempotency_key.clone(),
            job_id: id,
            plugin: job.plugin.clone(),
            provider: effect.provider.clone(),
            fingerprint: fingerprint(effect),
            worker: "ghost".into(),
            job_attempt: job.attempt,
            lease,
            older_key: None,
        })
        .await
        .unwrap();
    assert!(matches!(claim, EffectClaim::Claimed { .. }), "{claim:?}");
    let provider = h.providers().get(&effect.provider).unwrap();
    provider
        .provider
        .execute(effect)
        .await
        .expect("the ghost's request reached the provider");
    job
}

/// Window 1: the holder of a key vanished after its request reached a
/// provider that cannot dedupe. The next worker does not send it again: the
/// job is dead-lettered `may_not_resend`, the key waits for an operator, and
/// once resolved as applied a replay finishes the job without a second send.
async fn a_vanished_holder_at_a_provider_without_dedupe_is_never_sent_twice(backend: Backend) {
    let h = Harness::new(backend).await;
    let effect = invoice_email(51);
    let key = effect.idempotency_key.clone();
    let job = ghost_sent(&h, &effect, Duration::from_secs(5)).await;
    assert_eq!(h.provider.applied(&key), 1);
    h.store
        .clock_advance(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(h.store.job_rescue_expired(10).await.unwrap(), [job.id]);
    let no_dedupe = h.providers_with("breaker_failures = 1000\ndedupes = false");
    h.drain_with(no_dedupe.clone()).await;

    let dead = h.store.job_get(job.id).await.unwrap().unwrap();
    assert_eq!(dead.state, JobState::Dead);
    assert_eq!(dead.last_error_code.as_deref(), Some("may_not_resend"));
    assert_eq!(h.provider.requests(&key), 1, "not sent again");
    let row = h.store.effect_get(&key).await.unwrap().unwrap();
    assert!(row.in_doubt && row.reached, "{row:?}");
    let refused = h.store.job_replay(&[job.id]).await.unwrap();
    assert_eq!(refused.refused, [(job.id, key.clone())]);

    assert!(
        h.store
            .effect_resolve(
                &key,
                Resolution::Applied {
                    result_ref: Some("msg-ghost".into())
                }
            )
            .await
            .unwrap()
    );
    assert_eq!(
        h.store.job_replay(&[job.id]).await.unwrap().replayed,
        [job.id]
    );
    h.drain_with(no_dedupe).await;
    let done = h.store.job_get(job.id).await.unwrap().unwrap();
    assert_eq!(done.state, JobState::Succeeded);
    assert_eq!(h.provider.requests(&key), 1);
    assert_eq!(h.provider.applied(&key), 1);
}

/// Window 1, the other side: a provider that dedupes gets the request again
/// with the same key, and applies it once.
async fn a_vanished_holder_at_a_deduping_provider_is_resent_with_the_same_key(backend: Backend) {
    let h = Harness::new(backend).await;
    let effect = invoice_email(52);
    let key = effect.idempotency_key.clone();
    let job = ghost_sent(&h, &effect, Duration::from_secs(5)).await;
    h.store
        .clock_advance(Duration::from_secs(60))
        .await
        .unwrap();
    h.store.job_rescue_expired(10).await.unwrap();
    h.drain().await;
    let done = h.store.job_get(job.id).await.unwrap().unwrap();
    assert_eq!(done.state, JobState::Succeeded);
    assert_eq!(done.attempt, 2);
    assert_eq!(h.provider.requests(&key), 2, "sent again, same key");
    assert_eq!(h.provider.applied(&key), 1, "applied once");
}

/// Window 2: past the provider's dedupe window a resend could apply twice:
/// the job is dead-lettered `dedupe_window_passed` instead.
async fn a_key_in_doubt_past_the_dedupe_window_is_not_sent_again(backend: Backend) {
    let h = Harness::new(backend).await;
    let effect = invoice_email(53);
    let key = effect.idempotency_key.clone();
    let job = ghost_sent(&h, &effect, Duration::from_secs(5)).await;
    h.store
        .clock_advance(Duration::from_secs(2 * 3600))
        .await
        .unwrap();
    h.store.job_rescue_expired(10).await.unwrap();
    h.drain_with(h.providers_with("breaker_failures = 1000\ndedupe_window = \"1h\""))
        .await;
    let dead = h.store.job_get(job.id).await.unwrap().unwrap();
    assert_eq!(dead.state, JobState::Dead);
    assert_eq!(
        dead.last_error_code.as_deref(),
        Some("dedupe_window_passed")
    );
    assert_eq!(h.provider.requests(&key), 1);
    assert!(h.store.effect_get(&key).await.unwrap().unwrap().in_doubt);
}

/// Window 2, deferrals: a job deferred (its key held by another worker) for
/// longer than `max_deferral` is dead-lettered `deferred_too_long` instead
/// of waiting forever.
async fn a_job_deferred_longer_than_max_deferral_is_dead_lettered(backend: Backend) {
    let h = Harness::new(backend).await;
    let effect = invoice_email(54);
    // A holder that keeps the key for ten hours (its job in another queue).
    let blocker = h
        .store
        .job_insert(NewJob {
            queue: "blockers".into(),
            ..invoice(2, "x@example.com")
        })
        .await
        .unwrap()
        .id;
    let held = h
        .store
        .job_claim(ClaimParams {
            queue: "blockers".into(),
            worker: "blocker".into(),
            limit: 1,
            lease: Duration::from_secs(36_000),
            queue_concurrency: None,
            max_attempts: Default::default(),
        })
        .await
        .unwrap()
        .remove(0);
    assert_eq!(held.id, blocker);
    let claim = h
        .store
        .effect_claim(EffectClaimParams {
            key: effect.idempotency_key.clone(),
            job_id: blocker,
            plugin: held.plugin.clone(),
            provider: "email".into(),
            fingerprint: fingerprint(&effect),
            worker: "blocker".into(),
            job_attempt: held.attempt,
            lease: Duration::from_secs(36_000),
            older_key: None,
        })
        .await
        .unwrap();
    assert!(matches!(claim, EffectClaim::Claimed { .. }));
    // The victim carries the same effect in its stored plan.
    let victim = ghost_plan(&h, &effect).await;

    let worker = Worker::new(
        h.store.clone(),
        h.registry.clone(),
        h.providers(),
        WorkerSettings {
            max_deferral: Duration::from_secs(3600),
            ..h.settings("w")
        },
    );
    let running = tokio::spawn(worker.run(tokio_util::sync::CancellationToken::new()));
    // Wait (on the store, not a timer) for the first deferral.
    let deferred = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let job = h.store.job_get(victim).await.unwrap().unwrap();
            if job.deferred_since_ms.is_some() {
                return job;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the job is deferred");
    assert_eq!(deferred.state, JobState::Retrying);
    h.store
        .clock_advance(Duration::from_secs(2 * 3600))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("drains")
        .unwrap()
        .unwrap();
    let dead = h.store.job_get(victim).await.unwrap().unwrap();
    assert_eq!(dead.state, JobState::Dead);
    assert_eq!(dead.last_error_code.as_deref(), Some("deferred_too_long"));
    assert_eq!(dead.attempt, 1, "deferrals used no attempt");
    assert_eq!(h.provider.requests(&effect.idempotency_key), 0);
}

/// A job whose stored plan is `[effect]`, waiting to run (its plan stored by
/// an attempt that gave its lease back).
async fn ghost_plan(h: &Harness, effect: &Effect) -> idem::store::JobId {
    ghost_plan_of(h, std::slice::from_ref(effect)).await
}

/// [`ghost_plan`] with a plan of several effects.
async fn ghost_plan_of(h: &Harness, plan: &[Effect]) -> idem::store::JobId {
    let id = h
        .store
        .job_insert(invoice(3, "x@example.com"))
        .await
        .unwrap()
        .id;
    let job = h
        .store
        .job_claim(ClaimParams {
            queue: "default".into(),
            worker: "setup".into(),
            limit: 1,
            lease: Duration::from_secs(60),
            queue_concurrency: None,
            max_attempts: Default::default(),
        })
        .await
        .unwrap()
        .remove(0);
    assert_eq!(job.id, id);
    h.store
        .job_save_plan(SavePlanParams {
            fence: job.fence(),
            plan: serde_json::to_string(plan).unwrap(),
            plugin_hash: "setup".into(),
        })
        .await
        .unwrap();
    h.store.job_release(&job.fence()).await.unwrap();
    id
}

/// Claims `key` for `effect` as a release before this one did: on a job of
/// its own (queue `blockers`, owner `old-release`), under the fingerprint of
/// that release.
async fn claim_as_an_older_release(
    h: &Harness,
    key: &str,
    effect: &Effect,
) -> idem::store::EffectFence {
    let old = h
        .store
        .job_insert(NewJob {
            queue: "blockers".into(),
            ..invoice(4, "x@example.com")
        })
        .await
        .unwrap()
        .id;
    let held = h
        .store
        .job_claim(ClaimParams {
            queue: "blockers".into(),
            worker: "old-release".into(),
            limit: 1,
            lease: Duration::from_secs(60),
            queue_concurrency: None,
            max_attempts: Default::default(),
        })
        .await
        .unwrap()
        .remove(0);
    assert_eq!(held.id, old);
    match h
        .store
        .effect_claim(EffectClaimParams {
            key: key.to_string(),
            job_id: old,
            plugin: held.plugin.clone(),
            provider: "email".into(),
            fingerprint: legacy_fingerprint(effect),
            worker: "old-release".into(),
            job_attempt: held.attempt,
            lease: Duration::from_secs(60),
            older_key: None,
        })
        .await
        .unwrap()
    {
        EffectClaim::Claimed { fence } => fence,
        other => panic!("{other:?}"),
    }
}

/// Window 8: a key claimed by a release that fingerprinted the serde
/// layout is still recognised as the same request after the upgrade.
async fn a_key_claimed_under_the_old_fingerprint_is_still_the_same_request(backend: Backend) {
    let h = Harness::new(backend).await;
    let effect = invoice_email(55);
    let key = effect.idempotency_key.clone();
    let fence = claim_as_an_older_release(&h, &key, &effect).await;
    h.store
        .effect_set_failed(EffectFailParams {
            fence,
            status: EffectStatus::Retrying,
            error_code: "provider_unavailable".into(),
            sent: Sent::NotApplied,
        })
        .await
        .unwrap();
    assert_ne!(legacy_fingerprint(&effect), fingerprint(&effect));
    let id = ghost_plan(&h, &effect).await;
    h.drain().await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.last_error_code);
    assert_eq!(h.provider.applied(&key), 1);
}

/// Window 6: keys live in the emitting plugin's namespace. A child job
/// enqueued by `order_sync` with key `order:7:invoice` cannot squat that key
/// for a producer of `send_invoice_email`, and the producer's job keeps its
/// own payload.
async fn a_plugin_cannot_take_a_key_a_producer_will_use(backend: Backend) {
    let h = Harness::new(backend).await;
    h.store.job_insert(order(7, "evt_1")).await.unwrap();
    h.drain().await;
    let producer = h
        .store
        .job_insert(NewJob {
            idempotency_key: Some("order:7:invoice".into()),
            ..invoice(70, "producer@example.com")
        })
        .await
        .unwrap();
    assert!(producer.inserted, "the producer's key was free");
    h.drain().await;
    let job = h.store.job_get(producer.id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert!(String::from_utf8_lossy(&job.payload).contains("producer@example.com"));
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:70:email:v1"),
        1
    );
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:7:email:v1"),
        1
    );
    // The ledger holds each key under its plugin.
    for key in [
        "order_sync/order:7:invoice",
        "order_sync/webhook:evt_1:acme",
    ] {
        assert_eq!(
            h.store.effect_get(key).await.unwrap().unwrap().plugin,
            "order_sync"
        );
    }
    assert!(
        h.store
            .effect_get("order:7:invoice")
            .await
            .unwrap()
            .is_none()
    );
}

/// Window 6, upgrades: a release before keys were scoped stored and sent a
/// plugin's key as it was. A new job for the same business operation makes
/// the same request under the scoped key; it must find the older effect
/// (same plugin, same request) and not send it again.
async fn an_effect_done_under_an_unscoped_key_by_an_older_release_is_not_sent_again(
    backend: Backend,
) {
    let h = Harness::new(backend).await;
    // What the plugin asks for invoice 58, as an older release stored it.
    let payload = br#"{"invoice_id": 58, "recipient": "ana@example.com"}"#.to_vec();
    let effect = email_as_planned(&h, 58);
    let unscoped = effect.idempotency_key.clone();
    assert!(!unscoped.starts_with("send_invoice_email/"));
    let fence = claim_as_an_older_release(&h, &unscoped, &effect).await;
    h.store
        .effect_set_succeeded(idem::store::EffectSucceedParams {
            fence,
            result_ref: Some("sent-by-the-older-release".into()),
        })
        .await
        .unwrap();

    let fresh = h
        .store
        .job_insert(NewJob::new("send_invoice_email", payload))
        .await
        .unwrap()
        .id;
    let stats = h.drain().await;
    let job = h.store.job_get(fresh).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.last_error_code);
    assert_eq!(stats.idempotency_hits, 1, "{stats:?}");
    assert_eq!(
        h.provider
            .requests(&format!("send_invoice_email/{unscoped}")),
        0
    );
    assert_eq!(h.provider.requests(&unscoped), 0);
}

/// Issue 22, item 6: the lookup across releases goes both ways. A job of
/// a release before keys were scoped stored its plan with the key as it
/// was; a duplicate delivery after the upgrade carried the same request out
/// first, under the scoped key. When the old job runs its stored plan, it
/// finds the scoped row and does not send the request again under the key
/// as it was.
async fn an_older_release_plan_finds_an_effect_done_under_the_scoped_key(backend: Backend) {
    let h = Harness::new(backend).await;
    let payload = br#"{"invoice_id": 62, "recipient": "ana@example.com"}"#.to_vec();
    let effect = email_as_planned(&h, 62);
    let unscoped = effect.idempotency_key.clone();
    let scoped = format!("send_invoice_email/{unscoped}");
    // The duplicate delivery, on the new release, goes first.
    let fresh = h
        .store
        .job_insert(NewJob::new("send_invoice_email", payload))
        .await
        .unwrap()
        .id;
    h.drain().await;
    assert_eq!(
        h.store.job_get(fresh).await.unwrap().unwrap().state,
        JobState::Succeeded
    );
    assert_eq!(h.provider.requests(&scoped), 1);
    // The old job's stored plan, with the key as the older release kept it.
    let old = ghost_plan(&h, &effect).await;
    let stats = h.drain().await;
    let job = h.store.job_get(old).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.last_error_code);
    assert_eq!(stats.idempotency_hits, 1, "{stats:?}");
    assert_eq!(
        h.provider.requests(&unscoped),
        0,
        "not sent under a second key"
    );
    assert_eq!(h.provider.requests(&scoped), 1);
}

/// What `send_invoice_email` plans for `invoice_id`, with its key as the
/// plugin gives it (a release before keys were scoped stored it so).
fn email_as_planned(h: &Harness, invoice_id: u64) -> Effect {
    let plugin = h.registry.get("send_invoice_email").expect("plugin loaded");
    let payload = format!(r#"{{"invoice_id": {invoice_id}, "recipient": "ana@example.com"}}"#);
    h.registry
        .sandbox()
        .run(
            &plugin.compiled,
            &idem::sandbox::JobInput {
                id: 1,
                queue: "default".into(),
                payload: payload.into_bytes(),
                attempt: 1,
                max_attempts: 3,
                idempotency_key: None,
                correlation_id: "upgrade".into(),
                enqueued_at_ms: 0,
            },
        )
        .expect("the plugin plans one email")
        .into_iter()
        .next()
        .expect("one effect")
}

/// Issue 22, item 6: which key an older release's stored plan uses must
/// not depend on which delivery runs first. An old job's plan is [A, B]; the
/// older release claimed and sent A under its key as it was, and crashed
/// before B. B has no row under either key, so the old job claims it under
/// the **scoped** key, the one a duplicate delivery after the upgrade also
/// uses: the two deliveries meet on one ledger row whatever their timing.
/// (Claimed under the key as it was, both could read "no row" at once and
/// send B under two keys.) A, done under the older key, is found there.
async fn an_older_release_plan_claims_a_key_no_one_claimed_under_the_scoped_key(backend: Backend) {
    let h = Harness::new(backend).await;
    let (a, b) = (email_as_planned(&h, 63), email_as_planned(&h, 64));
    let fence = claim_as_an_older_release(&h, &a.idempotency_key, &a).await;
    h.store
        .effect_set_succeeded(idem::store::EffectSucceedParams {
            fence,
            result_ref: Some("sent-by-the-older-release".into()),
        })
        .await
        .unwrap();
    let old = ghost_plan_of(&h, &[a.clone(), b.clone()]).await;
    let scoped_b = format!("send_invoice_email/{}", b.idempotency_key);
    let stats = h.drain().await;
    let job = h.store.job_get(old).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.last_error_code);
    assert_eq!(stats.idempotency_hits, 1, "A found done: {stats:?}");
    assert_eq!(
        h.provider
            .requests(&format!("send_invoice_email/{}", a.idempotency_key)),
        0
    );
    assert_eq!(h.provider.requests(&b.idempotency_key), 0, "B not unscoped");
    assert_eq!(h.provider.requests(&scoped_b), 1, "B under the scoped key");
    assert!(
        h.store
            .effect_get(&b.idempotency_key)
            .await
            .unwrap()
            .is_none()
    );

    // The duplicate delivery of B's invoice on the new release finds it.
    let fresh = h
        .store
        .job_insert(NewJob::new(
            "send_invoice_email",
            br#"{"invoice_id": 64, "recipient": "ana@example.com"}"#.to_vec(),
        ))
        .await
        .unwrap()
        .id;
    let stats = h.drain().await;
    let job = h.store.job_get(fresh).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.last_error_code);
    assert_eq!(stats.idempotency_hits, 1, "{stats:?}");
    assert_eq!(h.provider.requests(&scoped_b), 1, "sent once in all");
    assert_eq!(h.provider.requests(&b.idempotency_key), 0);
}

/// Keys are scoped by the plugin's name, and a plugin's name is its file's
/// name: one the boundary's name rule refuses (`tests/vectors/strings.json`)
/// is not loaded, and its jobs cannot be enqueued at all, so no job of it
/// can fail a batch or a ledger claim later.
async fn a_plugin_name_the_key_rules_refuse_fails_its_jobs_at_once(backend: Backend) {
    let h = Harness::new(backend).await;
    let name = "rechnung-\u{fc}";
    std::fs::copy(
        h.plugins_dir.path().join("send_invoice_email.wasm"),
        h.plugins_dir.path().join(format!("{name}.wasm")),
    )
    .expect("copy plugin");
    std::fs::copy(
        h.plugins_dir.path().join("send_invoice_email.toml"),
        h.plugins_dir.path().join(format!("{name}.toml")),
    )
    .expect("copy grants");
    // Refused where it is loaded, saying why ...
    let report = h.registry.refresh();
    assert!(h.registry.get(name).is_none(), "not loaded");
    assert!(
        report
            .errors
            .iter()
            .any(|(path, why)| path.ends_with(format!("{name}.wasm")) && why.contains("name")),
        "{report:?}"
    );
    // ... and where its jobs would enter.
    let refused = h
        .store
        .job_insert(NewJob::new(
            name,
            br#"{"invoice_id": 59, "recipient": "ana@example.com"}"#.to_vec(),
        ))
        .await
        .expect_err("the name is refused at the enqueue");
    assert!(
        matches!(&refused, idem::store::StoreError::Invalid(why) if why.contains("plugin name")),
        "{refused:?}"
    );
    assert!(!refused.is_transient());
    assert!(
        h.store
            .job_list(JobFilter::default())
            .await
            .unwrap()
            .is_empty(),
        "nothing was stored"
    );
}

fn numbered(i: u64) -> NewJob {
    NewJob::new("bench_child", format!(r#"{{"i": {i}}}"#).into_bytes())
}

/// The `noop` jobs (the children `bench_child` enqueues).
async fn noop_jobs(h: &Harness) -> Vec<Job> {
    h.store
        .job_list(JobFilter {
            plugin: Some("noop".into()),
            limit: 100,
            ..JobFilter::default()
        })
        .await
        .unwrap()
}

/// Issue 22, item 7: a child job gets the attempts its own plugin's
/// manifest names (as an enqueue through the API does), not the worker's
/// default, on the one-write path and effect by effect alike.
async fn a_child_job_gets_the_attempts_of_its_plugins_manifest(backend: Backend) {
    let h = Harness::new(backend).await;
    h.set_manifest("noop", "max_attempts = 7\n");
    h.store.job_insert(numbered(1)).await.unwrap();
    h.drain().await;
    // A duplicate delivery whose child key is taken goes effect by effect.
    h.store.job_insert(numbered(2)).await.unwrap();
    h.store.job_insert(numbered(2)).await.unwrap();
    h.drain().await;
    let children = noop_jobs(&h).await;
    assert_eq!(children.len(), 2);
    for child in children {
        assert_eq!(child.max_attempts, Some(7), "child {}", child.id);
    }
}

/// A plan made only of child jobs finishes in one write; a delivery whose
/// key is in the ledger already goes effect by effect and finds it done.
async fn a_plan_of_child_jobs_finishes_in_one_write_and_a_duplicate_finds_it_done(
    backend: Backend,
) {
    let h = Harness::new(backend).await;
    let first = h.store.job_insert(numbered(1)).await.unwrap().id;
    h.store.job_insert(numbered(2)).await.unwrap();
    let stats = h.drain().await;
    assert_eq!(stats.succeeded, 2, "{stats:?}");
    assert_eq!(stats.plugin_calls, 2);
    assert_eq!(stats.effects_executed, 2);
    assert_eq!(stats.idempotency_hits, 0);
    assert_eq!(stats.finished_in_one_write, 2, "{stats:?}");
    let parent = h.store.job_get(first).await.unwrap().unwrap();
    assert_eq!(parent.state, JobState::Succeeded);
    assert!(
        parent
            .plan
            .as_deref()
            .is_some_and(|p| p.contains("bench:1:child"))
    );
    let row = h
        .store
        .effect_get("bench_child/bench:1:child")
        .await
        .unwrap()
        .expect("a ledger row for the child");
    assert_eq!(row.status, EffectStatus::Succeeded);
    assert_eq!(row.job_id, first);
    let children = noop_jobs(&h).await;
    assert_eq!(children.len(), 2);
    let child = children
        .iter()
        .find(|c| c.idempotency_key.as_deref() == Some("bench_child/bench:1:child"))
        .expect("the first job's child");
    assert_eq!(row.result_ref, Some(child.id.to_string()));
    assert_eq!(child.queue, "bench_children");
    assert_eq!(child.correlation_id, parent.correlation_id);

    // The same business event delivered again (another job, same key).
    let again = h.store.job_insert(numbered(1)).await.unwrap().id;
    let stats = h.drain().await;
    assert_eq!(stats.succeeded, 1);
    assert_eq!(stats.idempotency_hits, 1, "{stats:?}");
    assert_eq!(stats.effects_executed, 0);
    assert_eq!(stats.finished_in_one_write, 0, "it went the long way");
    assert_eq!(
        h.store.job_get(again).await.unwrap().unwrap().state,
        JobState::Succeeded
    );
    let children = noop_jobs(&h).await;
    assert_eq!(children.len(), 2, "no second child");
}

both_backends!(
    a_plan_of_child_jobs_finishes_in_one_write_and_a_duplicate_finds_it_done,
    a_child_job_gets_the_attempts_of_its_plugins_manifest,
    a_plugin_name_the_key_rules_refuse_fails_its_jobs_at_once,
    an_effect_done_under_an_unscoped_key_by_an_older_release_is_not_sent_again,
    an_older_release_plan_finds_an_effect_done_under_the_scoped_key,
    an_older_release_plan_claims_a_key_no_one_claimed_under_the_scoped_key,
    a_plugin_cannot_take_a_key_a_producer_will_use,
    a_key_claimed_under_the_old_fingerprint_is_still_the_same_request,
    a_vanished_holder_at_a_provider_without_dedupe_is_never_sent_twice,
    a_vanished_holder_at_a_deduping_provider_is_resent_with_the_same_key,
    a_key_in_doubt_past_the_dedupe_window_is_not_sent_again,
    a_job_deferred_longer_than_max_deferral_is_dead_lettered,
    an_effect_done_before_is_skipped_even_while_its_provider_circuit_is_open,
    a_replay_with_a_discarded_plan_asks_the_fixed_plugin_again,
    an_open_circuit_defers_jobs_instead_of_calling_a_failing_provider,
    the_same_invoice_event_delivered_three_times_sends_one_email,
    an_ambiguous_timeout_is_retried_with_the_same_key_and_sends_one_email,
    a_429_is_retried_after_its_retry_after_and_then_succeeds,
    a_permanent_provider_error_dead_letters_with_its_code_and_sends_nothing,
    a_plugin_rejection_dead_letters_at_once,
    a_key_reused_for_a_different_request_is_an_idempotency_key_conflict,
    the_provider_reports_a_key_conflict_as_permanent,
    an_effect_for_an_ungranted_provider_is_refused_and_nothing_is_sent,
    a_child_job_for_an_ungranted_plugin_is_refused_and_nothing_is_executed,
    the_order_flow_delivered_twice_sends_one_webhook_and_enqueues_one_invoice_job,
    a_plugin_upgrade_between_attempts_still_executes_the_stored_plan,
    two_workers_on_the_same_job_at_once_carry_the_effect_out_once,
);
