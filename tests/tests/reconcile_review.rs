//! Review of issue 25 (1649cb5: effects in doubt settled by asking the
//! provider): windows found in review, each reproduced by a test that
//! fails on 1649cb5.
//!
//! - The sweep replays only dead jobs that hold a key *this* sweep settled,
//!   looked for among the newest `limit` dead jobs of each code: an older
//!   dead job beyond that page, or one whose key an earlier sweep settled
//!   before it was killed, stays dead for good.
//! - Keys asked about go oldest first, `limit` a sweep, and a key whose
//!   lookup is unanswerable stays in the selection: once `limit` of them
//!   pile up, no newer key is ever asked about.
//! - The age of "the latest try" is counted from its key's claim, but the
//!   call is made only after the lookup: a slow lookup eats into the settle
//!   delay, and the sweep trusts a lagging "not applied" for a request the
//!   provider applied moments ago: the effect is sent twice.

use idem::effects::{Action, Effect};
use idem::failure::{Code, Failure};
use idem::ops::replay::Pacer;
use idem::providers::config::GuardConfig;
use idem::providers::guard::Guard;
use idem::providers::{Dedupe, Delivered, Lookup, LookupPolicy, Provider, Providers};
use idem::queue::executor::{Executor, PlanOutcome, Riders};
use idem::queue::reconcile::{ReconcileRequest, SWEEP_BATCH, reconcile_once};
use idem::queue::stats::WorkerStats;
use idem::store::{
    ClaimParams, EffectClaim, EffectClaimParams, EffectFailParams, EffectFence, EffectStatus,
    ErrorRecord, Job, JobChange, JobId, JobState, NewJob, Resolution, SavePlanParams, Sent, Store,
    Write,
};
use idem_tests::{Backend, both_backends};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const PLUGIN: &str = "send_invoice_email";

/// A provider that cannot dedupe and answers lookups as a search index
/// that lags: a request it applied is found `settle` after it was applied
/// (the contract [`Lookup::NotApplied`] documents), on a clock the test
/// moves together with the store's.
struct Lagging {
    store: Arc<dyn Store>,
    /// The test's clock, in ms (moved with the store's).
    clock: Arc<AtomicU64>,
    settle: Duration,
    /// Keys applied, with when.
    applied: Mutex<Vec<(String, u64)>>,
    /// The next call times out before reaching the provider.
    lose_next_call: AtomicBool,
    /// Every call is applied, but its answer is lost (a timeout).
    answers_lost: AtomicBool,
    /// The next lookup takes this long (ms), well inside its timeout.
    slow_next_lookup: AtomicU64,
}

impl Lagging {
    fn new(store: Arc<dyn Store>, clock: Arc<AtomicU64>, settle: Duration) -> Self {
        Lagging {
            store,
            clock,
            settle,
            applied: Mutex::new(Vec::new()),
            lose_next_call: AtomicBool::new(false),
            answers_lost: AtomicBool::new(false),
            slow_next_lookup: AtomicU64::new(0),
        }
    }

    fn times_applied(&self, key: &str) -> usize {
        self.applied
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| k == key)
            .count()
    }
}

#[async_trait::async_trait]
impl Provider for Lagging {
    fn dedupe(&self) -> Dedupe {
        Dedupe::None
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn lookup_policy(&self) -> Option<LookupPolicy> {
        Some(LookupPolicy {
            settle: self.settle,
            timeout: Duration::from_secs(60),
        })
    }

    async fn execute(&self, effect: &Effect) -> Result<Delivered, Failure> {
        let timed_out = || Failure::host(Code::ProviderTimeout, "no answer in time");
        if self.lose_next_call.swap(false, Ordering::SeqCst) {
            return Err(timed_out());
        }
        let now = self.clock.load(Ordering::SeqCst);
        self.applied
            .lock()
            .unwrap()
            .push((effect.idempotency_key.clone(), now));
        if self.answers_lost.load(Ordering::SeqCst) {
            return Err(timed_out());
        }
        Ok(Delivered {
            result_ref: Some("msg".into()),
        })
    }

    async fn look_up(&self, key: &str, _fingerprint: &str) -> Result<Lookup, Failure> {
        if key.contains("stuck") {
            return Err(Failure::host(
                Code::LookupUnanswerable,
                "HTTP 500 with an HTML body",
            ));
        }
        let slow = self.slow_next_lookup.swap(0, Ordering::SeqCst);
        if slow > 0 {
            // The lookup takes `slow` ms (well inside its 60 s timeout).
            self.store
                .clock_advance(Duration::from_millis(slow))
                .await
                .map_err(|e| Failure::host(Code::LookupUnavailable, e.to_string()))?;
            self.clock.fetch_add(slow, Ordering::SeqCst);
        }
        let now = self.clock.load(Ordering::SeqCst);
        let settle = u64::try_from(self.settle.as_millis()).unwrap_or(u64::MAX);
        let found = self
            .applied
            .lock()
            .unwrap()
            .iter()
            .any(|(k, at)| k == key && at + settle <= now);
        Ok(if found {
            Lookup::Applied {
                result_ref: Some("msg".into()),
            }
        } else {
            Lookup::NotApplied
        })
    }
}

/// Moves the store's clock and the provider's together.
async fn advance(store: &Arc<dyn Store>, clock: &AtomicU64, by: Duration) {
    store.clock_advance(by).await.unwrap();
    clock.fetch_add(u64::try_from(by.as_millis()).unwrap(), Ordering::SeqCst);
}

fn providers(name: &str, provider: Arc<dyn Provider>) -> Providers {
    let mut providers = Providers::default();
    providers.insert(name, provider, Guard::new(&GuardConfig::default()));
    providers
}

fn effect(provider: &str, key: &str) -> Effect {
    Effect {
        provider: provider.into(),
        idempotency_key: format!("{PLUGIN}/{key}"),
        action: Action::Http {
            method: "POST".into(),
            path: format!("/partners/acme/{key}"),
            headers: vec![],
            body: Some(br#"{"x":1}"#.to_vec()),
        },
    }
}

fn invoice(id: u64) -> NewJob {
    NewJob::new(
        PLUGIN,
        format!(r#"{{"invoice_id": {id}, "recipient": "x@example.com"}}"#).into_bytes(),
    )
}

/// Claims up to `limit` jobs for `worker`.
async fn claim_jobs(store: &Arc<dyn Store>, worker: &str, limit: u32, lease: Duration) -> Vec<Job> {
    store
        .job_claim(ClaimParams {
            queue: "default".into(),
            worker: worker.into(),
            limit,
            lease,
            queue_concurrency: None,
            max_attempts: Default::default(),
        })
        .await
        .unwrap()
}

fn key_claim(job: &Job, key: &str, provider: &str, lease: Duration) -> EffectClaimParams {
    EffectClaimParams {
        key: key.into(),
        job_id: job.id,
        plugin: PLUGIN.into(),
        provider: provider.into(),
        fingerprint: "fp".into(),
        worker: job.lease_owner.clone().unwrap_or_default(),
        job_attempt: job.attempt,
        lease,
        older_key: None,
    }
}

async fn claimed(store: &Arc<dyn Store>, params: EffectClaimParams) -> EffectFence {
    match store.effect_claim(params).await.unwrap() {
        EffectClaim::Claimed { fence } => fence,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// Marks a claimed key as the executor does when the provider cannot be
/// asked and its try may have been carried out (`may_not_resend`).
async fn left_in_doubt(store: &Arc<dyn Store>, fence: EffectFence) {
    store
        .effect_set_failed(EffectFailParams {
            fence,
            status: EffectStatus::Failed,
            error_code: "may_not_resend".into(),
            sent: Sent::Unresolved,
        })
        .await
        .unwrap();
}

fn dead(job: &Job) -> Write {
    Write::Job {
        fence: job.fence(),
        change: JobChange::Dead {
            error: ErrorRecord {
                attempt: job.attempt,
                class: idem::failure::ErrorClass::Permanent,
                code: "may_not_resend".into(),
                message: "an earlier try may have reached the provider".into(),
                at_ms: 0,
            },
            redact_payload: false,
            plugin_hash: None,
        },
    }
}

/// A dead job (`may_not_resend`) whose one effect, at `provider`, is in
/// doubt: its key is returned.
async fn dead_in_doubt(store: &Arc<dyn Store>, invoice_id: u64, provider: &str) -> (JobId, String) {
    let id = store.job_insert(invoice(invoice_id)).await.unwrap().id;
    let job = claim_jobs(store, "w", 1, Duration::from_secs(60))
        .await
        .pop()
        .expect("the job just inserted");
    assert_eq!(job.id, id);
    let plan = [effect(provider, &format!("invoice-{invoice_id}"))];
    let key = plan[0].idempotency_key.clone();
    store
        .job_save_plan(SavePlanParams {
            fence: job.fence(),
            plan: serde_json::to_string(&plan).unwrap(),
            plugin_hash: "h".into(),
        })
        .await
        .unwrap();
    let job = store.job_get(id).await.unwrap().unwrap();
    let fence = claimed(
        store,
        key_claim(&job, &key, provider, Duration::from_secs(30)),
    )
    .await;
    left_in_doubt(store, fence).await;
    store.write(dead(&job)).await.unwrap();
    (id, key)
}

async fn sweep(
    store: &Arc<dyn Store>,
    providers: &Providers,
) -> idem::queue::reconcile::ReconcileReport {
    let pacer = Pacer::per_second(10_000.0).unwrap();
    let request = ReconcileRequest {
        plugin: None,
        dry_run: false,
        limit: SWEEP_BATCH,
    };
    reconcile_once(&**store, providers, &request, &pacer)
        .await
        .unwrap()
}

async fn state(store: &Arc<dyn Store>, id: JobId) -> JobState {
    store.job_get(id).await.unwrap().unwrap().state
}

/// Finding 1a: the sweep settles the key of an older dead job but looks
/// for the jobs to replay only among the newest `limit` dead jobs of each
/// code (`job_list` orders by id descending). Dead `may_not_resend` jobs of
/// a provider without a lookup (waiting for an operator, as before issue
/// 25) fill that page; the settled job is not replayed, and no later sweep
/// replays it (its key is no longer in doubt, so no sweep settles it again).
async fn sweep_replays_a_settled_job_beyond_the_first_page(backend: Backend) {
    let (store, _guard) = idem_tests::store(backend).await;
    let clock = Arc::new(AtomicU64::new(0));
    let provider = Arc::new(Lagging::new(store.clone(), clock.clone(), Duration::ZERO));
    let providers = providers("ask", provider);
    let (settled_job, key) = dead_in_doubt(&store, 1, "ask").await;
    // Newer dead jobs, at a provider that cannot be asked.
    for i in 0..SWEEP_BATCH {
        store
            .job_insert(invoice(1000 + u64::from(i)))
            .await
            .unwrap();
    }
    let held = claim_jobs(&store, "w", SWEEP_BATCH, Duration::from_secs(60)).await;
    assert_eq!(held.len(), SWEEP_BATCH as usize);
    store
        .write_batch(held.iter().map(dead).collect())
        .await
        .unwrap();
    // Past the trust window: lookup timeout + call timeout + settle.
    advance(&store, &clock, Duration::from_secs(180)).await;

    let report = sweep(&store, &providers).await;
    assert!(
        report.asked.iter().any(|a| a.key == key && a.settled),
        "the sweep settles the key: {:?}",
        report.asked
    );
    // Later sweeps, as the worker runs them every reconcile_interval.
    sweep(&store, &providers).await;
    sweep(&store, &providers).await;
    assert_ne!(
        state(&store, settled_job).await,
        JobState::Dead,
        "the job whose only key in doubt was settled is replayed (report: replayed {:?}, left dead {:?})",
        report.replayed,
        report.left_dead
    );
}

/// Finding 1b: settling a key and replaying its job are two steps; a
/// sweep killed between them (a worker restart, a deploy) leaves the job
/// dead for good: the next sweep finds no key in doubt, so nothing to
/// replay.
async fn sweep_replays_a_job_whose_key_an_interrupted_sweep_settled(backend: Backend) {
    let (store, _guard) = idem_tests::store(backend).await;
    let clock = Arc::new(AtomicU64::new(0));
    let provider = Arc::new(Lagging::new(store.clone(), clock.clone(), Duration::ZERO));
    let providers = providers("ask", provider);
    let (id, key) = dead_in_doubt(&store, 1, "ask").await;
    advance(&store, &clock, Duration::from_secs(60)).await;
    // What the sweep writes first (`effect_reconcile`), then it is killed.
    let rows = store
        .effects_to_reconcile(&["ask".to_string()], None, SWEEP_BATCH)
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert!(
        store
            .effect_reconcile(&key, rows[0].attempt, Resolution::NotApplied)
            .await
            .unwrap()
    );
    // The worker comes back; its sweeps run.
    sweep(&store, &providers).await;
    sweep(&store, &providers).await;
    assert_ne!(
        state(&store, id).await,
        JobState::Dead,
        "a job whose key was settled is replayed by a later sweep"
    );
}

/// Finding 2: keys go oldest try first, `limit` a sweep, and a key whose
/// lookup is unanswerable is left in doubt (failed, in_doubt) and selected
/// again by every sweep: once `SWEEP_BATCH` of them are there, a newer key
/// in doubt is never asked about (and the unanswerable ones are asked again
/// every interval, spending the provider's lookup budget).
async fn unanswerable_keys_do_not_starve_the_sweep(backend: Backend) {
    let (store, _guard) = idem_tests::store(backend).await;
    let clock = Arc::new(AtomicU64::new(0));
    let provider = Arc::new(Lagging::new(store.clone(), clock.clone(), Duration::ZERO));
    // The key a worker left mid-call was applied before the worker vanished.
    provider
        .applied
        .lock()
        .unwrap()
        .push((format!("{PLUGIN}/z-good"), 0));
    let providers = providers("ask", provider);
    store.job_insert(invoice(1)).await.unwrap();
    let job = claim_jobs(&store, "w", 1, Duration::from_secs(3600))
        .await
        .pop()
        .unwrap();
    for i in 0..SWEEP_BATCH {
        let key = format!("{PLUGIN}/a-stuck-{i:03}");
        let fence = claimed(
            &store,
            key_claim(&job, &key, "ask", Duration::from_secs(30)),
        )
        .await;
        left_in_doubt(&store, fence).await;
    }
    advance(&store, &clock, Duration::from_secs(1)).await;
    let good = format!("{PLUGIN}/z-good");
    claimed(
        &store,
        key_claim(&job, &good, "ask", Duration::from_secs(30)),
    )
    .await;
    // The holder of `z-good` vanished mid-call; its lease runs out.
    advance(&store, &clock, Duration::from_secs(60)).await;
    let mut asked_good = false;
    for _ in 0..3 {
        let report = sweep(&store, &providers).await;
        asked_good |= report.asked.iter().any(|a| a.key == good);
    }
    let row = store.effect_get(&good).await.unwrap().unwrap();
    assert_eq!(
        row.status,
        EffectStatus::Succeeded,
        "three sweeps settle the newer key (asked about it: {asked_good}); {} unanswerable keys come first every time",
        SWEEP_BATCH
    );
}

/// Runs `plan` for `job` as a worker's attempt does, its riders written.
async fn run(executor: &Executor, job: &Job, plan: &[Effect]) -> PlanOutcome {
    let mut riders = Riders::default();
    let outcome = executor
        .execute(job, plan, &CancellationToken::new(), &mut riders)
        .await;
    executor.write_riders(riders).await.unwrap();
    outcome
}

/// Finding 3: `try_at` is stamped when the key is claimed, but an executor
/// whose claim is in doubt asks the provider first and calls it only after
/// the lookup answered: the call happens up to `lookup.timeout` after
/// `try_at`. The settle delay is counted from the claim, so a slow lookup
/// eats into it, and a "not applied" from an index that has not caught up
/// with the call yet is trusted. Here the lookup took 20 s (timeout 60 s),
/// the provider's timeout is 1 s and its settle 10 s: right after the call
/// (applied, its answer lost) the sweep finds the try 20 s old, trusts the
/// lagging "not applied", and the next attempt sends the effect again.
async fn a_slow_lookup_does_not_make_not_applied_trusted_early(backend: Backend) {
    let (store, _guard) = idem_tests::store(backend).await;
    let clock = Arc::new(AtomicU64::new(0));
    let provider = Arc::new(Lagging::new(
        store.clone(),
        clock.clone(),
        Duration::from_secs(10),
    ));
    let providers = providers("ask", provider.clone());
    let executor = Executor {
        store: store.clone(),
        providers: providers.clone(),
        worker: "w".into(),
        effect_lease: Duration::from_secs(30),
        child_max_attempts: 1,
        registry: None,
        stats: Arc::new(WorkerStats::default()),
    };
    store.job_insert(invoice(1)).await.unwrap();
    let job = claim_jobs(&store, "w", 1, Duration::from_secs(10 * 3600))
        .await
        .pop()
        .unwrap();
    let plan = [effect("ask", "invoice-1")];
    let key = plan[0].idempotency_key.clone();
    // An hour ago, a try timed out (it never reached the provider): the
    // key is in doubt.
    provider.lose_next_call.store(true, Ordering::SeqCst);
    let outcome = run(&executor, &job, &plan).await;
    assert!(
        matches!(outcome, PlanOutcome::Deferred { .. }),
        "{outcome:?}"
    );
    advance(&store, &clock, Duration::from_secs(3600)).await;

    // The job's next attempt asks (the lookup takes 20 s): not applied, and
    // the try an hour old: it sends; the provider applies it, the answer is
    // lost.
    provider.slow_next_lookup.store(20_000, Ordering::SeqCst);
    provider.answers_lost.store(true, Ordering::SeqCst);
    let outcome = run(&executor, &job, &plan).await;
    assert!(
        matches!(outcome, PlanOutcome::Deferred { .. }),
        "{outcome:?}"
    );
    assert_eq!(provider.times_applied(&key), 1);

    // The periodic sweep runs now.
    let report = sweep(&store, &providers).await;
    // The job's deferral ends; its next attempt claims the key.
    advance(&store, &clock, Duration::from_secs(15)).await;
    provider.answers_lost.store(false, Ordering::SeqCst);
    run(&executor, &job, &plan).await;
    assert_eq!(
        provider.times_applied(&key),
        1,
        "sent twice; the sweep asked right after the call and settled: {:?}",
        report.asked
    );
}

both_backends!(
    sweep_replays_a_settled_job_beyond_the_first_page,
    sweep_replays_a_job_whose_key_an_interrupted_sweep_settled,
    unanswerable_keys_do_not_starve_the_sweep,
    a_slow_lookup_does_not_make_not_applied_trusted_early,
);
