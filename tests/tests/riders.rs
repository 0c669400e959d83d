//! Windows of the effect path's merged commits (issue 23: an effect's
//! success rides with the next write), found in review and reproduced
//! first: each test failed on 4880c38 and passes since the fix. A success
//! is never held in memory behind a provider's limit (shutdown, takeover);
//! a done key spends no provider capacity and is found while the circuit is
//! open (also under an older release's key); a refused outcome still marks
//! the effect carried out.

use idem::effects::{Action, Effect};
use idem::failure::ErrorClass;
use idem::queue::executor::{Executor, PlanOutcome, Riders};
use idem::queue::stats::WorkerStats;
use idem::queue::{Worker, WorkerSettings};
use idem::store::{ClaimParams, EffectStatus, Job, JobState, NewJob, SavePlanParams};
use idem_tests::{Backend, Harness, both_backends};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn invoice(id: u64) -> NewJob {
    NewJob::new(
        "send_invoice_email",
        format!(r#"{{"invoice_id": {id}, "recipient": "x@example.com"}}"#).into_bytes(),
    )
}

/// An email effect under a scoped key (as this release plans it).
fn email(key: &str) -> Effect {
    Effect {
        provider: "email".into(),
        idempotency_key: format!("send_invoice_email/{key}"),
        action: Action::Email {
            to: vec!["ana@example.com".into()],
            subject: format!("mail {key}"),
            text: Some("hi".into()),
            html: None,
            template: None,
        },
    }
}

/// A webhook to `partner` under a scoped key.
fn webhook(key: &str) -> Effect {
    Effect {
        provider: "partner".into(),
        idempotency_key: format!("send_invoice_email/{key}"),
        action: Action::Http {
            method: "POST".into(),
            path: format!("/partners/acme/{key}"),
            headers: vec![],
            body: Some(br#"{"x":1}"#.to_vec()),
        },
    }
}

/// A job whose stored plan is `plan`, waiting to run.
async fn ghost_plan_of(h: &Harness, invoice_id: u64, plan: &[Effect]) -> idem::store::JobId {
    let id = h.store.job_insert(invoice(invoice_id)).await.unwrap().id;
    let job = claim(h, "setup", 60).await;
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

async fn claim(h: &Harness, worker: &str, lease_s: u64) -> Job {
    h.store
        .job_claim(ClaimParams {
            queue: "default".into(),
            worker: worker.into(),
            limit: 1,
            lease: Duration::from_secs(lease_s),
            queue_concurrency: None,
            max_attempts: Default::default(),
        })
        .await
        .unwrap()
        .remove(0)
}

/// A job of its own on the `blockers` queue, held by `worker` (a job
/// other than the one under test, to carry a key out first).
async fn held_blocker(h: &Harness, id: u64, worker: &str) -> Job {
    h.store
        .job_insert(NewJob {
            queue: "blockers".into(),
            ..invoice(id)
        })
        .await
        .unwrap();
    h.store
        .job_claim(ClaimParams {
            queue: "blockers".into(),
            worker: worker.into(),
            limit: 1,
            lease: Duration::from_secs(60),
            queue_concurrency: None,
            max_attempts: Default::default(),
        })
        .await
        .unwrap()
        .remove(0)
}

fn executor(h: &Harness, worker: &str, providers: idem::providers::Providers) -> Executor {
    Executor {
        store: h.store.clone(),
        providers,
        worker: worker.into(),
        effect_lease: Duration::from_secs(5),
        child_max_attempts: 5,
        registry: None,
        stats: Arc::new(WorkerStats::default()),
    }
}

/// Waits (polling, bounded) until `key`'s ledger row says succeeded: the
/// state a holder reaches before it waits for provider capacity (what
/// rides is written first), or once a refused outcome's riders went alone.
async fn wait_succeeded(h: &Harness, key: &str) {
    let started = Instant::now();
    loop {
        let row = h.store.effect_get(key).await.unwrap();
        if row.is_some_and(|r| r.status == EffectStatus::Succeeded) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{key} never marked succeeded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_applied(h: &Harness, key: &str) {
    let started = Instant::now();
    while h.provider.applied(key) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{key} never applied"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// R1. A graceful shutdown while a job waits for the next effect's provider
/// (a rate limit) drops the previous effect's success, which now rides in
/// the handler's memory: the handler is aborted after the in-flight bound,
/// the lease is given back, and the sent effect is left `processing`. The
/// next delivery finds it in doubt and, at a provider that cannot dedupe,
/// dead-letters the job `may_not_resend` although the request was applied
/// once and answered. Before 4880c38 the success was committed right after
/// the provider call, before the next effect waited for its permit.
async fn a_graceful_shutdown_during_the_next_effects_rate_wait_loses_a_recorded_success(
    backend: Backend,
) {
    let h = Harness::new(backend).await;
    // One token per 50 s per provider; neither provider dedupes.
    let extra = "breaker_failures = 1000\ndedupes = false\nrate_per_second = 0.02";
    let providers = h.providers_with(extra);
    let (first, sent, next) = (webhook("r1:a"), email("r1:mail"), webhook("r1:b"));
    let id = ghost_plan_of(&h, 11, &[first.clone(), sent.clone(), next.clone()]).await;
    let worker = Worker::new(
        h.store.clone(),
        h.registry.clone(),
        providers,
        WorkerSettings {
            exit_when_drained: false,
            shutdown_grace: Duration::from_millis(200),
            ..h.settings("shutting-down")
        },
    );
    let shutdown = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(shutdown.clone()));
    wait_applied(&h, &sent.idempotency_key).await;
    // The job now waits ~50 s for the partner's next token.
    wait_succeeded(&h, &sent.idempotency_key).await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("shutdown ends")
        .unwrap()
        .unwrap();
    let row = h
        .store
        .effect_get(&sent.idempotency_key)
        .await
        .unwrap()
        .unwrap();
    let job = h.store.job_get(id).await.unwrap().unwrap();
    eprintln!(
        "after graceful shutdown: sent key {:?} (applied {} time(s) by the provider), job {:?}",
        row.status,
        h.provider.applied(&sent.idempotency_key),
        job.state
    );
    // The next delivery (another process, after the key's lease).
    h.store
        .clock_advance(Duration::from_secs(600))
        .await
        .unwrap();
    h.store.job_rescue_expired(10).await.unwrap();
    h.drain_with(h.providers_with("breaker_failures = 1000\ndedupes = false"))
        .await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    let row_after = h
        .store
        .effect_get(&sent.idempotency_key)
        .await
        .unwrap()
        .unwrap();
    eprintln!(
        "next delivery: job {:?} ({:?}); sent key {:?} in_doubt={}",
        job.state, job.last_error_code, row_after.status, row_after.in_doubt
    );
    assert_eq!(
        row.status,
        EffectStatus::Succeeded,
        "the provider applied and answered the effect before the shutdown: its success must be recorded"
    );
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.last_error_code);
}

/// R2. While a holder waits for the next effect's permit (concurrency or
/// rate limit) longer than the previous key's lease, a duplicate job for the
/// same business operation takes that key over: the row says `processing`,
/// so it is in doubt, and at a provider that cannot dedupe that job is
/// dead-lettered and the key marked failed/in doubt; the holder's success,
/// committed only with its next claim, is then fenced out. Before 4880c38
/// the success was durable before the permit wait; the duplicate found it
/// done (an idempotency hit).
async fn a_takeover_while_the_holder_waits_for_its_next_permit_finds_a_sent_key_in_doubt(
    backend: Backend,
) {
    let h = Harness::new(backend).await;
    let providers = h.providers_with("breaker_failures = 1000\ndedupes = false\nconcurrency = 1");
    let (sent, next) = (email("r2:mail"), webhook("r2:hook"));
    h.store.job_insert(invoice(21)).await.unwrap();
    h.store.job_insert(invoice(21)).await.unwrap();
    let job_a = claim(&h, "a", 3600).await;
    let job_b = claim(&h, "b", 3600).await;
    let (a, b) = (
        executor(&h, "a", providers.clone()),
        executor(&h, "b", providers.clone()),
    );
    let never = tokio_util::sync::CancellationToken::new();
    let partner = providers.get("partner").unwrap();
    // Someone else's slow partner call holds its only slot.
    let slot = partner.guard.enter().await.expect("slot");
    let plan_a = vec![sent.clone(), next.clone()];
    let plan_b = vec![sent.clone()];
    let mut riders_a = Riders::default();
    let (ra, rb) = tokio::join!(a.execute(&job_a, &plan_a, &never, &mut riders_a), async {
        wait_applied(&h, &sent.idempotency_key).await;
        wait_succeeded(&h, &sent.idempotency_key).await;
        // A has waited past the email key's lease (7 s) for the slot.
        h.store
            .clock_advance(Duration::from_secs(60))
            .await
            .unwrap();
        let rb = b
            .execute(&job_b, &plan_b, &never, &mut Riders::default())
            .await;
        drop(slot);
        rb
    });
    a.write_riders(riders_a).await.unwrap();
    let row = h
        .store
        .effect_get(&sent.idempotency_key)
        .await
        .unwrap()
        .unwrap();
    eprintln!(
        "A: {ra:?}\nB: {rb:?}\nrow: status {:?} in_doubt {} reached {}; provider applied {}; A fenced_out {}",
        row.status,
        row.in_doubt,
        row.reached,
        h.provider.applied(&sent.idempotency_key),
        a.stats.snapshot().fenced_out
    );
    assert!(matches!(ra, PlanOutcome::Done), "{ra:?}");
    assert!(
        matches!(rb, PlanOutcome::Done),
        "B should find the key done (applied once, answered): {rb:?}"
    );
    assert_eq!(row.status, EffectStatus::Succeeded);
}

/// R3. A redelivered stored plan whose first effect is done no longer
/// reads the ledger first: it waits for (and spends) a provider permit and
/// rate token only to learn from the claim that the key is done. With one
/// token per 10 s, skipping a done key then costs the next, real call 10 s.
/// Before 4880c38 a done key was skipped without provider capacity.
async fn a_done_key_spends_a_rate_token_before_it_is_skipped(backend: Backend) {
    let h = Harness::new(backend).await;
    let (done, fresh) = (webhook("r3:done"), webhook("r3:fresh"));
    // An earlier job carried out `done` (no rate limit then).
    let earlier = held_blocker(&h, 31, "earlier").await;
    let ex = executor(&h, "earlier", h.providers());
    let mut riders = Riders::default();
    let outcome = ex
        .execute(
            &earlier,
            std::slice::from_ref(&done),
            &Default::default(),
            &mut riders,
        )
        .await;
    assert!(matches!(outcome, PlanOutcome::Done), "{outcome:?}");
    // The success rides; write it as the worker would.
    ex.write_riders(riders).await.unwrap();
    assert_eq!(
        h.store
            .effect_get(&done.idempotency_key)
            .await
            .unwrap()
            .unwrap()
            .status,
        EffectStatus::Succeeded
    );
    let id = ghost_plan_of(&h, 32, &[done.clone(), fresh.clone()]).await;
    let limited = h.providers_with("breaker_failures = 1000\nrate_per_second = 0.1");
    let started = Instant::now();
    let stats = h.drain_with(limited).await;
    let took = started.elapsed();
    let job = h.store.job_get(id).await.unwrap().unwrap();
    eprintln!("drain took {took:?}; stats {stats:?}; job {:?}", job.state);
    assert_eq!(job.state, JobState::Succeeded);
    assert!(
        took < Duration::from_secs(5),
        "skipping a done key should not wait for a rate token: took {took:?}"
    );
}

/// R4. While a provider's circuit is open, a key an older release carried
/// out under its unscoped form is no longer found: the circuit-open read
/// looks up the scoped key only, so the job is deferred (and, past
/// `max_deferral`, dead-lettered) instead of skipping the done effect.
/// Before 4880c38 `key_of_an_older_release` found the older row first.
async fn an_older_release_success_is_not_skipped_while_the_circuit_is_open(backend: Backend) {
    let h = Harness::new(backend).await;
    let effect = email("r4:mail");
    let bare = effect
        .idempotency_key
        .strip_prefix("send_invoice_email/")
        .unwrap()
        .to_string();
    // An older release claimed and carried out the bare key.
    let old = held_blocker(&h, 41, "old-release").await;
    let fence = match h
        .store
        .effect_claim(idem::store::EffectClaimParams {
            key: bare.clone(),
            job_id: old.id,
            plugin: old.plugin.clone(),
            provider: "email".into(),
            fingerprint: idem::effects::fingerprint(&effect),
            worker: "old-release".into(),
            job_attempt: old.attempt,
            lease: Duration::from_secs(60),
            older_key: None,
        })
        .await
        .unwrap()
    {
        idem::store::EffectClaim::Claimed { fence } => fence,
        other => panic!("{other:?}"),
    };
    h.store
        .effect_set_succeeded(idem::store::EffectSucceedParams {
            fence,
            result_ref: Some("old".into()),
        })
        .await
        .unwrap();
    // The email circuit is open.
    let providers = h.providers_with("breaker_failures = 1\nbreaker_cool_down = \"1h\"");
    let email_guard = providers.get("email").unwrap();
    email_guard
        .guard
        .enter()
        .await
        .expect("slot")
        .record(Err(ErrorClass::Retryable));
    assert!(email_guard.guard.is_open());
    h.store.job_insert(invoice(42)).await.unwrap();
    let job = claim(&h, "w", 60).await;
    let outcome = executor(&h, "w", providers)
        .execute(
            &job,
            std::slice::from_ref(&effect),
            &Default::default(),
            &mut Riders::default(),
        )
        .await;
    assert!(
        matches!(outcome, PlanOutcome::Done),
        "the request was carried out by the older release: {outcome:?}"
    );
}

/// A trigger that refuses to mark jobs of `plugin` succeeded (a database
/// refusal of the outcome write: nothing of its transaction commits).
async fn refuse_successes_of(h: &Harness, backend: Backend, plugin: &str) {
    use sqlx::Connection;
    match backend {
        Backend::Sqlite => {
            let mut conn = sqlx::SqliteConnection::connect(&h.url).await.unwrap();
            sqlx::query(&format!(
                "CREATE TRIGGER refuse_success BEFORE UPDATE OF state ON jobs \
                 WHEN NEW.plugin = '{plugin}' AND NEW.state = 'succeeded' \
                 BEGIN SELECT RAISE(ABORT, 'boom'); END"
            ))
            .execute(&mut conn)
            .await
            .unwrap();
        }
        Backend::Postgres => {
            let mut conn = sqlx::PgConnection::connect(&h.url).await.unwrap();
            sqlx::query(
                "CREATE FUNCTION refuse_success() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN RAISE EXCEPTION 'boom'; END $$",
            )
            .execute(&mut conn)
            .await
            .unwrap();
            sqlx::query(&format!(
                "CREATE TRIGGER refuse_success BEFORE UPDATE OF state ON jobs FOR EACH ROW \
                 WHEN (NEW.plugin = '{plugin}' AND NEW.state = 'succeeded') \
                 EXECUTE FUNCTION refuse_success()"
            ))
            .execute(&mut conn)
            .await
            .unwrap();
        }
    }
}

/// R5. The last effect's success rides in one unit with the job's outcome;
/// when the database refuses that unit (not transiently: here a trigger on
/// the job's success), the worker logs "cannot record the outcome" and lets
/// the attempt go, and the effect's success, valid on its own, is dropped
/// with it (the `Riders` doc: "Whatever way the attempt ends, they are
/// written"). The sent key stays `processing` and is in doubt for the next
/// delivery. Before 4880c38 the success was its own write and committed.
async fn a_refused_outcome_drops_the_effect_success_riding_with_it(backend: Backend) {
    let h = Harness::new(backend).await;
    refuse_successes_of(&h, backend, "send_invoice_email").await;
    let key = "send_invoice_email/invoice:51:email:v1";
    h.store.job_insert(invoice(51)).await.unwrap();
    let worker = Worker::new(
        h.store.clone(),
        h.registry.clone(),
        h.providers(),
        WorkerSettings {
            exit_when_drained: false,
            shutdown_grace: Duration::from_millis(200),
            ..h.settings("refused")
        },
    );
    let shutdown = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(shutdown.clone()));
    wait_applied(&h, key).await;
    wait_succeeded(&h, key).await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("shutdown ends")
        .unwrap()
        .unwrap();
    let row = h.store.effect_get(key).await.unwrap().unwrap();
    eprintln!(
        "provider applied {}; ledger row {:?}",
        h.provider.applied(key),
        row.status
    );
    assert_eq!(row.status, EffectStatus::Succeeded);
}

both_backends!(
    a_graceful_shutdown_during_the_next_effects_rate_wait_loses_a_recorded_success,
    a_takeover_while_the_holder_waits_for_its_next_permit_finds_a_sent_key_in_doubt,
    a_done_key_spends_a_rate_token_before_it_is_skipped,
    an_older_release_success_is_not_skipped_while_the_circuit_is_open,
    a_refused_outcome_drops_the_effect_success_riding_with_it,
);
