//! Carrying out a stored plan, effect by effect, each at most once per key.
//!
//! For every effect: claim its key in the ledger (atomic); skip it when it
//! already succeeded (an idempotency hit); defer the job when another worker
//! holds the key; refuse a key reused for a different action
//! (`idempotency_key_conflict`); otherwise call the provider with the key
//! and record the result, fenced by the claim. A child job is enqueued in
//! the same transaction that marks its effect succeeded.

use super::outcome::DeferReason;
use super::stats::WorkerStats;
use crate::effects::{Action, Effect, fingerprint, legacy_fingerprint};
use crate::failpoint::{self, Failpoint};
use crate::failure::{Code, ErrorClass, Failure};
use crate::metrics;
use crate::providers::guard::Permit;
use crate::providers::{Dedupe, GuardedProvider, JOBS_PROVIDER, Lookup, LookupPolicy, Providers};
use crate::store::{
    ChildEffect, ChildParams, EffectChange, EffectClaim, EffectClaimParams, EffectFailParams,
    EffectFence, EffectRecord, EffectStatus, Enqueued, Fence, Job, JobChange, NewJob, OlderKey,
    Sent, StatementCall, StatementOutcome, StatementParams, Store, StoreError, Write, Written,
    retry_transient, retry_transient_until,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Counts a child job a `jobs` effect enqueued (effect by effect, or with
/// its parent's success in one write).
pub(crate) fn child_enqueued(stats: &WorkerStats, child: &Enqueued) {
    tracing::info!(child_job = %child.id, inserted = child.inserted, "child job enqueued");
    WorkerStats::bump(&stats.effects_executed);
    metrics::effect(JOBS_PROVIDER, "executed");
}

/// What a claim in doubt found.
#[derive(Debug, Clone, Copy)]
struct Doubt {
    /// Since the first try was claimed (the dedupe window counts from it).
    sent_ago: Duration,
    /// Since the latest try that may have reached the provider was claimed.
    tried_ago: Duration,
}

/// An effect in doubt whose provider is asked ([`Executor::ask_provider`]).
struct AskedFor<'a> {
    job: &'a Job,
    effect: &'a Effect,
    fence: &'a EffectFence,
    provider: &'a GuardedProvider,
    policy: LookupPolicy,
    tried_ago: Duration,
    /// Why it would not be sent again without an answer.
    refusal: Failure,
}

/// The deferral of a job while the provider of an effect in doubt is
/// asked, with a little jitter so jobs in doubt together spread out.
fn in_doubt_deferral(wait: Duration) -> PlanOutcome {
    let jitter = Duration::from_millis(rand::random_range(0..250));
    PlanOutcome::Deferred {
        delay: wait + jitter,
        reason: DeferReason::EffectInDoubt,
    }
}

/// How long to wait before asking a provider that could not answer again:
/// as long as the job has been deferring so far (doubling each time),
/// between 1 s and 5 min, with full jitter above half; longer when the
/// provider said so (`Retry-After`).
fn lookup_backoff(job: &Job, retry_after: Option<Duration>) -> Duration {
    let claimed_at = job.heartbeat_at_ms.unwrap_or(job.updated_at_ms);
    let deferring = job
        .deferred_since_ms
        .map(|since| claimed_at.saturating_sub(since))
        .and_then(|ms| u64::try_from(ms).ok())
        .map_or(Duration::ZERO, Duration::from_millis);
    let base = deferring.clamp(Duration::from_secs(1), Duration::from_secs(300));
    let half = base / 2;
    let jittered = half + half.mul_f64(rand::random::<f64>());
    // A provider's `Retry-After` is capped as an effect's is.
    let asked = retry_after
        .unwrap_or_default()
        .min(super::backoff::MAX_RETRY_AFTER);
    jittered.max(asked)
}

/// Longest deferral when another worker holds an effect's key.
pub const DEFER_LEASED: Duration = Duration::from_millis(500);

/// How a plan's execution ended.
#[derive(Debug)]
pub enum PlanOutcome {
    /// Every effect succeeded now or before.
    Done,
    /// An effect failed: retry or dead-letter the job.
    Failed(Failure),
    /// Not a failure: try the job again after this delay without using an attempt.
    Deferred {
        /// Delay before the next try.
        delay: Duration,
        /// Why.
        reason: DeferReason,
    },
    /// The store failed; the job's lease will expire and it will be redelivered.
    Store(StoreError),
    /// Stopped (shutdown or lease lost) between effects; nothing is in flight.
    Aborted,
    /// The job's lease was lost (a key claim found another attempt holding
    /// the job): nothing was claimed, nothing is recorded.
    LeaseLost,
    /// Every effect succeeded, and the last one, a statement on the store's
    /// own database, committed the job's success ([`Riders::finish_with`])
    /// in its transaction: this is that write's answer, nothing is left to
    /// record.
    Recorded(Written),
    /// This effect was done before (internal: the plan goes on).
    Skipped,
    /// An older release claimed this request under this key (internal:
    /// the effect is carried out under it).
    OlderRelease(String),
}

/// Writes that ride with an attempt's next durable write, so a job pays
/// one awaited commit before each provider call and none after it: a fresh
/// plan (stored in the same transaction as its first ledger claim) and the
/// ledger successes of effects carried out (committed with the next
/// claim, or with the job's own outcome, which the handler does not wait
/// for). Whatever way the attempt ends, they are written: with its
/// outcome, or on their own ([`Executor::write_riders`]).
///
/// ```
/// let riders = idem::queue::executor::Riders::default();
/// assert!(riders.is_empty());
/// ```
#[derive(Debug, Default)]
pub struct Riders {
    writes: Vec<Write>,
    /// An effect success must be committed by then (its key's lease
    /// ends; after it the write is fenced out anyway).
    deadline: Option<tokio::time::Instant>,
    /// The job's success, for a last effect that is a statement on the
    /// store's own database to commit with it; never written otherwise
    /// (the outcome is then written as usual).
    finish: Option<Write>,
}

impl Riders {
    /// A fresh plan to store with the first claim.
    ///
    /// `let riders = Riders::plan(job.fence(), plan_json, plugin_hash);`
    pub fn plan(fence: crate::store::JobFence, plan: String, plugin_hash: String) -> Riders {
        Riders {
            writes: vec![Write::Job {
                fence,
                change: JobChange::SavePlan { plan, plugin_hash },
            }],
            deadline: None,
            finish: None,
        }
    }

    /// Offers the job's success (`outcome::success_after_plan`) to the
    /// plan's last effect: a statement on the store's own database commits
    /// it in its own transaction, so the job is done in that one commit
    /// ([`PlanOutcome::Recorded`]). Any other last effect leaves it unused.
    ///
    /// `riders.finish_with(idem::queue::outcome::success_after_plan(&job));`
    pub fn finish_with(&mut self, success: Write) {
        self.finish = Some(success);
    }

    /// The writes to commit now, leaving the job's success offered.
    fn take_writes(&mut self) -> Riders {
        Riders {
            writes: std::mem::take(&mut self.writes),
            deadline: self.deadline.take(),
            finish: None,
        }
    }

    /// Nothing rides.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// The writes, in order.
    pub fn writes(&self) -> &[Write] {
        &self.writes
    }

    /// The deadline of the effect successes among them, if any.
    pub fn deadline(&self) -> Option<tokio::time::Instant> {
        self.deadline
    }

    fn has_plan(&self) -> bool {
        self.writes.iter().any(|w| {
            matches!(
                w,
                Write::Job {
                    change: JobChange::SavePlan { .. },
                    ..
                }
            )
        })
    }

    fn push_success(
        &mut self,
        fence: EffectFence,
        result_ref: Option<String>,
        deadline: tokio::time::Instant,
    ) {
        self.push(
            Write::Effect {
                fence,
                change: EffectChange::Succeed { result_ref },
            },
            deadline,
        );
    }

    /// An effect's finishing write, to commit by `deadline`.
    fn push(&mut self, write: Write, deadline: tokio::time::Instant) {
        self.writes.push(write);
        self.deadline = Some(self.deadline.map_or(deadline, |d| d.min(deadline)));
    }

    /// Runs `write` again while it fails transiently: until the riders'
    /// deadline when an effect success rides, else as [`retry_transient`].
    pub async fn retry<T, F, Fut>(&self, write: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        match self.deadline {
            Some(deadline) => retry_transient_until(deadline, write).await,
            None => retry_transient(write).await,
        }
    }
}

/// What the executor needs.
pub struct Executor {
    /// The store.
    pub store: Arc<dyn Store>,
    /// Configured providers.
    pub providers: Providers,
    /// This worker's id.
    pub worker: String,
    /// Lease on an effect key while its provider is called.
    pub effect_lease: Duration,
    /// Attempts of a child job whose plugin's manifest names none.
    pub child_max_attempts: u32,
    /// Where a child's plugin is looked up: its manifest's `max_attempts`
    /// is what the child gets, as an enqueue through the API would.
    pub registry: Option<Arc<crate::plugins::PluginRegistry>>,
    /// Counters.
    pub stats: Arc<WorkerStats>,
}

fn conflict(effect: &Effect) -> PlanOutcome {
    PlanOutcome::Failed(Failure::host(
        Code::IdempotencyKeyConflict,
        format!(
            "the key {:?} was used before for a different request",
            effect.idempotency_key
        ),
    ))
}

fn failed_before(effect: &Effect, code: &str) -> PlanOutcome {
    PlanOutcome::Failed(Failure::permanent(
        code,
        format!(
            "the effect {:?} failed permanently before ({code}); replay its job once the cause is fixed",
            effect.idempotency_key
        ),
    ))
}

/// Whether an effect whose earlier try may have been carried out
/// (`sent_ago` since the first try) may be sent again: only to a provider
/// that dedupes, and only inside its window; otherwise the failure that
/// dead-letters the job until an operator resolves the key.
///
/// ```
/// use idem::providers::Dedupe;
/// use std::time::Duration;
/// let window = Dedupe::Native { window: Duration::from_secs(3600) };
/// assert!(idem::queue::executor::may_resend(window, Duration::from_secs(60), "k").is_ok());
/// assert!(idem::queue::executor::may_resend(Dedupe::None, Duration::ZERO, "k").is_err());
/// ```
pub fn may_resend(dedupe: Dedupe, sent_ago: Duration, key: &str) -> Result<(), Failure> {
    match dedupe {
        Dedupe::None => Err(Failure::host(
            Code::MayNotResend,
            format!(
                "an earlier try of {key:?} may have reached the provider, which cannot \
                 dedupe: idem will not send it again; check with the provider, then run \
                 `idem effects resolve {key} --applied` or `--not-applied`"
            ),
        )),
        Dedupe::Native { window } if sent_ago > window => Err(Failure::host(
            Code::DedupeWindowPassed,
            format!(
                "an earlier try of {key:?} may have reached the provider {} ago, longer \
                 than its dedupe window of {}: idem will not send it again; check with the \
                 provider, then run `idem effects resolve {key} --applied` or `--not-applied`",
                humantime::format_duration(Duration::from_secs(sent_ago.as_secs())),
                humantime::format_duration(window)
            ),
        )),
        Dedupe::Native { .. } => Ok(()),
    }
}

impl Executor {
    /// Checks a fresh plan against the plugin's grants and the configured
    /// providers, before anything is stored or executed.
    pub fn check_grants(
        &self,
        plan: &[Effect],
        allowed: impl Fn(&Effect) -> Result<(), Failure>,
    ) -> Result<(), Failure> {
        for effect in plan {
            allowed(effect)?;
            if effect.provider != JOBS_PROVIDER {
                let Some(provider) = self.providers.get(&effect.provider) else {
                    return Err(Failure::host(
                        Code::ProviderNotConfigured,
                        format!(
                            "no provider named {:?} is configured on this host",
                            effect.provider
                        ),
                    ));
                };
                provider.provider.check(effect)?;
            }
            if effect.provider == JOBS_PROVIDER && !matches!(effect.action, Action::Enqueue { .. })
            {
                return Err(Failure::host(
                    Code::UnsupportedAction,
                    format!(
                        "the jobs provider only enqueues jobs, not {} effects",
                        effect.action.kind()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Executes a plan for a claimed job, effect by effect. When `abort`
    /// fires (shutdown or a lost lease), the plan stops before the next
    /// effect; a provider call in flight is never cancelled, so its answer
    /// is always recorded under its key.
    ///
    /// `riders` come in with a fresh plan to store and go out with what is
    /// still to be written with the job's outcome (see [`Riders`]).
    pub async fn execute(
        &self,
        job: &Job,
        plan: &[Effect],
        abort: &CancellationToken,
        riders: &mut Riders,
    ) -> PlanOutcome {
        // Only the last effect may commit the job's success.
        let mut finish = riders.finish.take();
        for (index, effect) in plan.iter().enumerate() {
            if abort.is_cancelled() {
                return PlanOutcome::Aborted;
            }
            if index + 1 == plan.len() {
                riders.finish = finish.take();
            }
            let span = tracing::info_span!("effect", key = %effect.idempotency_key, provider = %effect.provider);
            match self
                .execute_one(job, effect, abort, riders)
                .instrument(span)
                .await
            {
                Ok(()) | Err(PlanOutcome::Skipped) => {}
                Err(outcome) => return outcome,
            }
        }
        PlanOutcome::Done
    }

    async fn execute_one(
        &self,
        job: &Job,
        effect: &Effect,
        abort: &CancellationToken,
        riders: &mut Riders,
    ) -> Result<(), PlanOutcome> {
        let rekeyed;
        let (key, row, older) = match self.older_key_to_probe(job, effect) {
            // A scoped key (a plan of this release): no read; the claim
            // itself finds a row an older release left for this request.
            Some(older) => (None, None, Some(older)),
            None => {
                let (key, row) = self.key_of_an_older_release(job, effect).await?;
                (key, row, None)
            }
        };
        let effect = match key {
            Some(key) => {
                rekeyed = Effect {
                    idempotency_key: key,
                    ..effect.clone()
                };
                &rekeyed
            }
            None => effect,
        };
        match self.carry_out(job, effect, row, older, abort, riders).await {
            Err(PlanOutcome::OlderRelease(key)) => {
                tracing::info!(older_key = %key, "an older release claimed this request: carrying it out under its key");
                let row = retry_transient(|| self.store.effect_get(&key))
                    .await
                    .map_err(PlanOutcome::Store)?;
                let effect = Effect {
                    idempotency_key: key,
                    ..effect.clone()
                };
                self.carry_out(job, &effect, row, None, abort, riders).await
            }
            other => other,
        }
    }

    /// What the ledger settled for this effect, read (the rare path: its
    /// provider has no capacity free now, or its circuit is open). A scoped
    /// key (`probe`) is looked up by the older-release rule, and a request
    /// an older release holds under its older key, not settled yet, is
    /// carried out under that key ([`PlanOutcome::OlderRelease`]).
    async fn look_up(
        &self,
        job: &Job,
        effect: &Effect,
        probe: bool,
    ) -> Result<Option<PlanOutcome>, PlanOutcome> {
        if probe {
            let (key, row) = self.key_of_an_older_release(job, effect).await?;
            if let Some(key) = key {
                let rekeyed = Effect {
                    idempotency_key: key.clone(),
                    ..effect.clone()
                };
                return Ok(Some(
                    self.settled(&rekeyed, row)
                        .unwrap_or(PlanOutcome::OlderRelease(key)),
                ));
            }
            return Ok(self.settled(effect, row));
        }
        let row = retry_transient(|| self.store.effect_get(&effect.idempotency_key))
            .await
            .map_err(PlanOutcome::Store)?;
        Ok(self.settled(effect, row))
    }

    /// The older form of a scoped key (this release's plans), for the claim
    /// to probe (see [`OlderKey`]); `None` for a key of an older release's
    /// stored plan, or one too long to scope, which go by
    /// [`Executor::key_of_an_older_release`].
    fn older_key_to_probe(&self, job: &Job, effect: &Effect) -> Option<OlderKey> {
        let bare = effect
            .idempotency_key
            .strip_prefix(job.plugin.as_str())?
            .strip_prefix('/')?;
        crate::store::check_key(bare).ok()?;
        Some(OlderKey {
            key: bare.to_string(),
            fingerprints: vec![fingerprint(effect), legacy_fingerprint(effect)],
        })
    }

    /// Carries out one effect under its key; `row` is its ledger row when
    /// it was read before (an older release's key), `older` the key the
    /// claim probes.
    async fn carry_out(
        &self,
        job: &Job,
        effect: &Effect,
        row: Option<EffectRecord>,
        older: Option<OlderKey>,
        abort: &CancellationToken,
        riders: &mut Riders,
    ) -> Result<(), PlanOutcome> {
        if effect.provider == JOBS_PROVIDER {
            // A child job is unique on its plugin and key: enqueuing it again
            // is always safe, so a claim in doubt goes on as any other.
            let (fence, _) = self
                .claim(job, effect, self.effect_lease, older, riders)
                .await?;
            failpoint::hit(Failpoint::AfterKeyClaimed)
                .await
                .map_err(PlanOutcome::Store)?;
            // The child is born with its ledger row's success, and rides
            // with the next write as a provider's success does (nothing
            // leaves the store, so nothing needs awaiting). A child the
            // store would refuse goes the awaited way and fails there.
            if let Some(child) = self
                .child_job(job, effect)
                .filter(|child| crate::store::check_new_job(child).is_ok())
            {
                let deadline = tokio::time::Instant::now() + self.effect_lease;
                riders.push(
                    Write::Effect {
                        fence,
                        change: EffectChange::SucceedWithChild { child },
                    },
                    deadline,
                );
                return Ok(());
            }
            self.enqueue_child(job, effect, &fence).await?;
            return failpoint::hit(Failpoint::AfterKeyMarked)
                .await
                .map_err(PlanOutcome::Store);
        }
        let Some(provider) = self.providers.get(&effect.provider) else {
            // A stored plan can outlive the host configuration it was
            // checked against; nothing is claimed, so a fixed host can replay it.
            return Err(PlanOutcome::Failed(Failure::host(
                Code::ProviderNotConfigured,
                format!(
                    "no provider named {:?} is configured on this host",
                    effect.provider
                ),
            )));
        };
        // A key done (or refused) before needs no provider capacity: a row
        // read before says so at once.
        if let Some(settled) = self.settled(effect, row) {
            return Err(settled);
        }
        // A statement on the store's own database commits with its ledger
        // row; one the host cannot run is refused before anything is claimed.
        let in_store = match provider.provider.in_store_transaction(effect) {
            Some(Err(refused)) => return Err(PlanOutcome::Failed(refused)),
            Some(Ok(call)) => Some(call),
            None => None,
        };
        // The permit comes before the key's lease: waiting for a slot or a
        // rate token must not eat into the lease that protects the call.
        // Free capacity now (the common case): no read, nothing to flush.
        // Otherwise, before waiting or deferring, the (rare) read: a key done
        // before is skipped without spending the provider's capacity, also
        // while its circuit is open; and what rides is written before any
        // wait, so no success is held in memory behind a limit (a shutdown
        // or a takeover during the wait would find its key in doubt).
        let permit = match provider.guard.try_enter() {
            Some(Ok(permit)) => permit,
            waits_or_open => {
                if let Some(settled) = self.look_up(job, effect, older.is_some()).await? {
                    return Err(settled);
                }
                let entered = match waits_or_open {
                    Some(open) => open,
                    None => {
                        self.write_riders(riders.take_writes())
                            .await
                            .map_err(PlanOutcome::Store)?;
                        provider.guard.enter().await
                    }
                };
                match entered {
                    Ok(permit) => permit,
                    Err(open) => {
                        metrics::effect(&effect.provider, "deferred");
                        return Err(PlanOutcome::Deferred {
                            delay: open.retry_after,
                            reason: DeferReason::CircuitOpen,
                        });
                    }
                }
            }
        };
        if abort.is_cancelled() {
            permit.release();
            return Err(PlanOutcome::Aborted);
        }
        let lease = self.key_lease(&provider);
        let (fence, permit) = match self.claim(job, effect, lease, older, riders).await {
            Ok((fence, None)) => (fence, permit),
            Ok((fence, Some(doubt))) => match may_resend(
                provider.provider.dedupe(),
                doubt.sent_ago,
                &effect.idempotency_key,
            ) {
                Ok(()) => {
                    tracing::info!(
                        sent_ago = ?doubt.sent_ago,
                        "an earlier try may have been carried out: sending again with the same key, inside the provider's dedupe window"
                    );
                    (fence, permit)
                }
                Err(failure) => match provider.provider.lookup_policy() {
                    // The provider can be asked whether it applied the key.
                    Some(policy) => {
                        let asked = AskedFor {
                            job,
                            effect,
                            fence: &fence,
                            provider: &provider,
                            policy,
                            tried_ago: doubt.tried_ago,
                            refusal: failure,
                        };
                        match self.ask_provider(asked, permit, riders).await? {
                            // Known not applied: sending it is not a repeat.
                            Some(permit) => (fence, permit),
                            // Known applied: done without a call.
                            None => return Ok(()),
                        }
                    }
                    None => {
                        permit.release();
                        tracing::warn!(code = %failure.code, "outcome unknown: not sent again");
                        WorkerStats::bump(&self.stats.effects_failed);
                        metrics::effect(&effect.provider, "failed");
                        self.fail(&fence, &failure, Sent::HeldInDoubt).await?;
                        return Err(PlanOutcome::Failed(failure));
                    }
                },
            },
            Err(outcome) => {
                // Skipped, deferred or refused: the provider was not called.
                permit.release();
                return Err(outcome);
            }
        };
        if let Err(error) = failpoint::hit(Failpoint::AfterKeyClaimed).await {
            permit.release();
            return Err(PlanOutcome::Store(error));
        }
        match in_store {
            Some(call) => {
                // Nothing else rides here (the claim took the riders): the
                // job's success, if offered, can commit with the statement.
                let finish = if riders.is_empty() {
                    riders.finish.take()
                } else {
                    None
                };
                let finished = self
                    .run_in_store(effect, &fence, call, permit, finish)
                    .await?;
                failpoint::hit(Failpoint::AfterKeyMarked)
                    .await
                    .map_err(PlanOutcome::Store)?;
                match finished {
                    Some(written) => Err(PlanOutcome::Recorded(written)),
                    None => Ok(()),
                }
            }
            // The success rides with the next write: `AfterKeyMarked` is
            // passed once that commits (see `claim_with_riders`).
            None => {
                self.call_provider(effect, &fence, &provider, permit, riders)
                    .await
            }
        }
    }

    /// Asks the provider of an effect in doubt whether it applied the key
    /// (the claim holds the key, `permit` the provider's capacity):
    /// - applied: the key succeeds with the looked-up reference (riding
    ///   with the next write, as a call's success does), and `None` says
    ///   the effect is done without a call;
    /// - not applied, for a try older than the provider's timeout plus its
    ///   settle delay: `Some(permit)`, to send it (it is known not to be a
    ///   repeat), under the same permit;
    /// - not applied too soon, or the provider could not be asked now: the
    ///   key is given back still in doubt and the job deferred (no attempt
    ///   used) until it can be asked again;
    /// - an answer that fits neither: as without a lookup (the key waits in
    ///   doubt, the job is dead-lettered), with the answer in its error.
    async fn ask_provider<'p>(
        &self,
        asked: AskedFor<'_>,
        permit: Permit<'p>,
        riders: &mut Riders,
    ) -> Result<Option<Permit<'p>>, PlanOutcome> {
        let AskedFor {
            job,
            effect,
            fence,
            provider,
            policy,
            tried_ago,
            refusal,
        } = asked;
        let name = effect.provider.as_str();
        let started = Instant::now();
        let answer = crate::providers::look_up_within(
            &*provider.provider,
            policy,
            &effect.idempotency_key,
            &fingerprint(effect),
        )
        .await;
        WorkerStats::timed(&self.stats.provider_call_us, started);
        match answer {
            Ok(Lookup::Applied { result_ref }) => {
                permit.record(Ok(()));
                metrics::effect_reconciled(name, "applied");
                tracing::info!(
                    result_ref = result_ref.as_deref().unwrap_or(""),
                    "the provider says an earlier try applied this effect: not sent again"
                );
                let deadline = tokio::time::Instant::now() + self.key_lease(provider);
                riders.push_success(fence.clone(), result_ref, deadline);
                WorkerStats::bump(&self.stats.idempotency_hits);
                metrics::effect(name, "idempotency_hit");
                Ok(None)
            }
            Ok(Lookup::NotApplied) => {
                let trusted_after = policy.trusted_after(provider.provider.timeout());
                if tried_ago >= trusted_after {
                    metrics::effect_reconciled(name, "not_applied");
                    tracing::info!(
                        ?tried_ago,
                        "the provider says no earlier try applied this effect: sending it"
                    );
                    return Ok(Some(permit));
                }
                permit.record(Ok(()));
                metrics::effect_reconciled(name, "too_recent");
                let wait = trusted_after - tried_ago;
                tracing::info!(
                    ?tried_ago,
                    ?wait,
                    "the provider has no record of this effect yet, but the last try is too recent to trust that: asking again later"
                );
                self.give_back_in_doubt(fence, Code::LookupUnavailable)
                    .await?;
                Err(in_doubt_deferral(wait))
            }
            Err(failure) if failure.class.is_retried() => {
                permit.record(Err(failure.class));
                metrics::effect_reconciled(name, "unavailable");
                let wait = lookup_backoff(job, failure.retry_after);
                tracing::warn!(
                    code = %failure.code,
                    message = %failure.message,
                    ?wait,
                    "the provider could not be asked whether it applied this effect: asking again later"
                );
                self.give_back_in_doubt(fence, Code::LookupUnavailable)
                    .await?;
                Err(in_doubt_deferral(wait))
            }
            Err(answer) => {
                permit.release();
                metrics::effect_reconciled(name, "unanswerable");
                let failure = Failure::new(
                    refusal.class,
                    refusal.code.clone(),
                    format!(
                        "{}; the provider's lookup answered: {}",
                        refusal.message, answer.message
                    ),
                );
                tracing::warn!(code = %failure.code, message = %failure.message, "outcome unknown: not sent again");
                WorkerStats::bump(&self.stats.effects_failed);
                metrics::effect(name, "failed");
                self.fail(fence, &failure, Sent::HeldInDoubt).await?;
                Err(PlanOutcome::Failed(failure))
            }
        }
    }

    /// Gives a key in doubt back without a call: still marked reached (a
    /// later claim is in doubt again), its latest try's time kept.
    async fn give_back_in_doubt(&self, fence: &EffectFence, code: Code) -> Result<(), PlanOutcome> {
        let params = EffectFailParams {
            fence: fence.clone(),
            status: EffectStatus::Retrying,
            error_code: code.as_str().to_string(),
            sent: Sent::NotApplied,
        };
        let written = retry_transient(|| self.store.effect_set_failed(params.clone()))
            .await
            .map_err(PlanOutcome::Store)?;
        if written == Fence::FencedOut {
            self.fenced_out("effect given back in doubt");
        }
        Ok(())
    }

    /// The lease a provider's calls run under: it must outlast the call, or
    /// a second holder could call the provider while this one still waits
    /// for the answer.
    pub fn key_lease(&self, provider: &GuardedProvider) -> Duration {
        // A claim in doubt may ask the provider (up to its lookup timeout)
        // before it calls.
        let lookup = provider
            .provider
            .lookup_policy()
            .map_or(Duration::ZERO, |policy| policy.timeout);
        self.effect_lease
            .max(provider.provider.timeout() * 2 + lookup + Duration::from_secs(5))
    }

    /// Releases before keys were scoped to their plugin stored the plugin's
    /// key as it was (`KEY`, not `PLUGIN/KEY`), and the provider saw it so.
    /// One request of one plugin may so have a row under either key; which
    /// key it is carried out under must not depend on which delivery runs
    /// first, or a plan stored by an older release and a duplicate delivery
    /// after the upgrade could send the same request under both.
    ///
    /// The rule, the same for a fresh plan (scoped keys) and a stored one
    /// (keys as they were): the scoped key when it has a row; else the older
    /// key when it has a row of this plugin for this very request (an
    /// older release claimed it); else the scoped key. So every new claim
    /// goes under the scoped key, and two deliveries that race for a key no
    /// one claimed yet meet on one ledger row, whose UNIQUE key decides.
    /// (A stored key too long to scope keeps its own key: a fresh plan's
    /// scoped form of it would be refused by the key check, so no delivery
    /// can send it under another key.) Returns the key to use when it is
    /// not the effect's own, and that key's ledger row as read now.
    async fn key_of_an_older_release(
        &self,
        job: &Job,
        effect: &Effect,
    ) -> Result<(Option<String>, Option<EffectRecord>), PlanOutcome> {
        let key = effect.idempotency_key.as_str();
        let (scoped, older) = match key
            .strip_prefix(job.plugin.as_str())
            .and_then(|rest| rest.strip_prefix('/'))
        {
            Some(bare) => (key.to_string(), bare.to_string()),
            None => (
                crate::effects::scoped_key(&job.plugin, key),
                key.to_string(),
            ),
        };
        let other_than_own = |chosen: String| (chosen != key).then_some(chosen);
        if crate::store::check_key(&scoped).is_err() {
            let own = retry_transient(|| self.store.effect_get(key))
                .await
                .map_err(PlanOutcome::Store)?;
            return Ok((None, own));
        }
        let row = retry_transient(|| self.store.effect_get(&scoped))
            .await
            .map_err(PlanOutcome::Store)?;
        if row.is_some() {
            return Ok((other_than_own(scoped), row));
        }
        let row = retry_transient(|| self.store.effect_get(&older))
            .await
            .map_err(PlanOutcome::Store)?
            .filter(|row| {
                row.plugin == job.plugin
                    && (row.fingerprint == fingerprint(effect)
                        || row.fingerprint == legacy_fingerprint(effect))
            });
        Ok(match row {
            Some(row) => (other_than_own(older), Some(row)),
            None => (other_than_own(scoped), None),
        })
    }

    /// What the ledger already settled for this key (done, failed, or used
    /// for another request), from its row as read before claiming.
    fn settled(&self, effect: &Effect, row: Option<EffectRecord>) -> Option<PlanOutcome> {
        let row = row?;
        if row.fingerprint != fingerprint(effect) && row.fingerprint != legacy_fingerprint(effect) {
            return Some(conflict(effect));
        }
        match row.status {
            EffectStatus::Succeeded => {
                self.hit(effect, row.result_ref.as_deref());
                Some(PlanOutcome::Skipped)
            }
            EffectStatus::Failed => Some(failed_before(
                effect,
                row.last_error_code
                    .as_deref()
                    .unwrap_or(Code::EffectFailed.as_str()),
            )),
            EffectStatus::Processing | EffectStatus::Retrying => None,
        }
    }

    fn hit(&self, effect: &Effect, result_ref: Option<&str>) {
        tracing::info!(
            result_ref = result_ref.unwrap_or(""),
            "effect already done: skipped"
        );
        WorkerStats::bump(&self.stats.idempotency_hits);
        metrics::effect(&effect.provider, "idempotency_hit");
    }

    /// Claims the effect's key; every outcome but a claim ends this effect.
    /// A claim in doubt comes with how long ago the first and the latest
    /// tries were claimed.
    async fn claim(
        &self,
        job: &Job,
        effect: &Effect,
        lease: Duration,
        older_key: Option<OlderKey>,
        riders: &mut Riders,
    ) -> Result<(EffectFence, Option<Doubt>), PlanOutcome> {
        let params = EffectClaimParams {
            key: effect.idempotency_key.clone(),
            job_id: job.id,
            plugin: job.plugin.clone(),
            provider: effect.provider.clone(),
            fingerprint: fingerprint(effect),
            // The job's lease owner (this worker's claim): the key is claimed
            // only while that claim still holds the job.
            worker: job
                .lease_owner
                .clone()
                .unwrap_or_else(|| self.worker.clone()),
            job_attempt: job.attempt,
            lease,
            older_key,
        };
        let waited = Instant::now();
        let claim = self.claim_with_riders(params.clone(), riders).await;
        WorkerStats::timed(&self.stats.store_wait_us, waited);
        let mut claim = claim?;
        if let EffectClaim::Conflict {
            existing_fingerprint,
        } = &claim
        {
            // Claimed by a release before the canonical fingerprint: the
            // same request under its old fingerprint.
            let legacy = legacy_fingerprint(effect);
            if *existing_fingerprint == legacy {
                let params = EffectClaimParams {
                    fingerprint: legacy,
                    older_key: None,
                    ..params
                };
                claim = retry_transient(|| self.store.effect_claim(params.clone()))
                    .await
                    .map_err(PlanOutcome::Store)?;
            }
        }
        match claim {
            EffectClaim::Claimed { fence } => Ok((fence, None)),
            EffectClaim::InDoubt {
                fence,
                sent_ago,
                tried_ago,
            } => Ok((
                fence,
                Some(Doubt {
                    sent_ago,
                    tried_ago,
                }),
            )),
            EffectClaim::JobLost => {
                tracing::warn!("the job was taken over by another attempt: stopping this one");
                Err(PlanOutcome::LeaseLost)
            }
            EffectClaim::AlreadySucceeded { result_ref } => {
                self.hit(effect, result_ref.as_deref());
                Err(PlanOutcome::Skipped)
            }
            EffectClaim::LeasedByOther { remaining } => {
                // The holder usually finishes in milliseconds; look again
                // soon (the deferral costs no attempt) rather than waiting
                // out a lease that is only there for crashed holders.
                let wait =
                    remaining.min(DEFER_LEASED) + Duration::from_millis(rand::random_range(0..200));
                tracing::info!(?wait, "another worker holds this effect: deferring the job");
                metrics::effect(&effect.provider, "deferred");
                Err(PlanOutcome::Deferred {
                    delay: wait,
                    reason: DeferReason::EffectLeasedByOther,
                })
            }
            EffectClaim::Conflict { .. } => Err(conflict(effect)),
            EffectClaim::Failed { code } => Err(failed_before(effect, &code)),
            EffectClaim::OlderRelease { key } => Err(PlanOutcome::OlderRelease(key)),
        }
    }

    /// Claims a key in one transaction with the riders (a fresh plan, the
    /// last effect's success): the one durable commit before a provider
    /// call. The riders are gone once it committed; on an error they stay,
    /// to be written with the outcome or on their own.
    async fn claim_with_riders(
        &self,
        params: EffectClaimParams,
        riders: &mut Riders,
    ) -> Result<EffectClaim, PlanOutcome> {
        if riders.is_empty() {
            return retry_transient(|| self.store.effect_claim(params.clone()))
                .await
                .map_err(PlanOutcome::Store);
        }
        let mut writes = riders.writes.clone();
        writes.push(Write::EffectClaim(params));
        let mut answers = riders
            .retry(|| self.store.write_batch(writes.clone()))
            .await
            .map_err(PlanOutcome::Store)?;
        let claim = answers.pop();
        let stored_plan = riders.has_plan();
        let rode = riders.take_writes();
        self.settle_riders(rode.writes(), &answers);
        if rode
            .writes()
            .iter()
            .any(|w| matches!(w, Write::Effect { .. }))
        {
            // An earlier effect's success is durable; the job is not done.
            failpoint::hit(Failpoint::AfterKeyMarked)
                .await
                .map_err(PlanOutcome::Store)?;
        }
        let claim = match claim {
            Some(Written::EffectClaim(claim)) => claim,
            other => {
                return Err(PlanOutcome::Store(StoreError::Corrupt(format!(
                    "an effect claim was answered {other:?}"
                ))));
            }
        };
        if stored_plan && !matches!(claim, EffectClaim::JobLost) {
            failpoint::hit(Failpoint::AfterPlanStored)
                .await
                .map_err(PlanOutcome::Store)?;
        }
        Ok(claim)
    }

    /// Counts what the riders' writes did once they committed: an effect
    /// success fenced out (its key was taken over) is logged and counted.
    /// A plan fenced out needs nothing: the write it rode with is fenced
    /// by the same attempt.
    pub fn settle_riders(&self, writes: &[Write], answers: &[Written]) {
        for (write, answer) in writes.iter().zip(answers) {
            match (write, answer) {
                (
                    Write::Effect { .. },
                    Written::Effect {
                        fence: Fence::FencedOut,
                        ..
                    },
                ) => self.fenced_out("effect success"),
                (
                    Write::Effect { .. },
                    Written::Effect {
                        fence: Fence::Applied,
                        child: Some(child),
                    },
                ) => child_enqueued(&self.stats, child),
                _ => {}
            }
        }
    }

    /// Writes the riders on their own, when the attempt ends without an
    /// outcome to carry them (the store failed, or the lease was lost).
    ///
    /// `executor.write_riders(std::mem::take(&mut riders)).await?;`
    pub async fn write_riders(&self, riders: Riders) -> Result<(), StoreError> {
        if riders.is_empty() {
            return Ok(());
        }
        let answers = riders
            .retry(|| self.store.write_batch(riders.writes.clone()))
            .await?;
        self.settle_riders(riders.writes(), &answers);
        Ok(())
    }

    /// The child job a `jobs` effect of `job` enqueues (`None` for any
    /// other effect).
    fn child_job(&self, job: &Job, effect: &Effect) -> Option<NewJob> {
        let Action::Enqueue {
            plugin,
            queue,
            payload,
            delay_ms,
            priority,
        } = &effect.action
        else {
            return None;
        };
        (effect.provider == JOBS_PROVIDER).then(|| NewJob {
            queue: queue.clone().unwrap_or_else(|| job.queue.clone()),
            plugin: plugin.clone(),
            payload: payload.clone(),
            idempotency_key: Some(effect.idempotency_key.clone()),
            priority: *priority,
            delay: Duration::from_millis(*delay_ms),
            max_attempts: self
                .registry
                .as_ref()
                .and_then(|r| r.get(plugin))
                .and_then(|p| p.manifest.max_attempts)
                .unwrap_or(self.child_max_attempts),
            correlation_id: Some(job.correlation_id.clone()),
            group: None,
        })
    }

    /// A fresh plan made only of child jobs, as the one write that finishes
    /// it ([`JobChange::SucceedWithChildren`](crate::store::JobChange::SucceedWithChildren)):
    /// no provider is called, so nothing needs the ledger's claim first.
    /// `None` when any effect goes to a provider.
    pub fn children_only(&self, job: &Job, plan: &[Effect]) -> Option<Vec<ChildEffect>> {
        plan.iter()
            .map(|effect| {
                let child = self.child_job(job, effect)?;
                // A child the store would refuse fails the long way, as before.
                crate::store::check_new_job(&child).ok()?;
                let older_key = effect
                    .idempotency_key
                    .strip_prefix(job.plugin.as_str())
                    .and_then(|rest| rest.strip_prefix('/'))
                    .map(str::to_string);
                Some(ChildEffect {
                    key: effect.idempotency_key.clone(),
                    older_key,
                    fingerprint: fingerprint(effect),
                    child,
                })
            })
            .collect()
    }

    async fn enqueue_child(
        &self,
        job: &Job,
        effect: &Effect,
        fence: &EffectFence,
    ) -> Result<(), PlanOutcome> {
        let Some(child) = self.child_job(job, effect) else {
            let failure = Failure::host(
                Code::UnsupportedAction,
                "the jobs provider only enqueues jobs",
            );
            self.fail(fence, &failure, Sent::NotApplied).await?;
            return Err(PlanOutcome::Failed(failure));
        };
        let params = ChildParams {
            fence: fence.clone(),
            child,
        };
        let waited = Instant::now();
        let answer = retry_transient(|| self.store.effect_succeed_with_child(params.clone())).await;
        WorkerStats::timed(&self.stats.store_wait_us, waited);
        let (written, enqueued) = answer.map_err(PlanOutcome::Store)?;
        if written == Fence::FencedOut {
            self.fenced_out("child job effect");
        } else {
            child_enqueued(&self.stats, &enqueued);
        }
        Ok(())
    }

    async fn call_provider(
        &self,
        effect: &Effect,
        fence: &EffectFence,
        provider: &GuardedProvider,
        permit: Permit<'_>,
        riders: &mut Riders,
    ) -> Result<(), PlanOutcome> {
        // Never cancelled once sent: the provider timeout bounds it, and
        // dropping it would lose an answer that can still be recorded.
        let started = Instant::now();
        let result = provider.provider.execute(effect).await;
        let took = started.elapsed();
        WorkerStats::timed(&self.stats.provider_call_us, started);
        metrics::provider_call(
            &effect.provider,
            took,
            result.as_ref().err().map(|f| f.code.as_str()),
        );
        permit.record(result.as_ref().map(|_| ()).map_err(|f| f.class));
        failpoint::hit(Failpoint::AfterProviderCall)
            .await
            .map_err(PlanOutcome::Store)?;
        match result {
            Ok(delivered) => {
                tracing::info!(
                    result_ref = delivered.result_ref.as_deref().unwrap_or(""),
                    ?took,
                    "effect carried out"
                );
                // Carried out: the success rides with the next durable
                // write (the next claim, or the job's outcome), and must
                // outlast a database restart (see `retry_transient_until`)
                // as long as the key is ours.
                let deadline = tokio::time::Instant::from_std(started) + self.key_lease(provider);
                riders.push_success(fence.clone(), delivered.result_ref, deadline);
                WorkerStats::bump(&self.stats.effects_executed);
                metrics::effect(&effect.provider, "executed");
                Ok(())
            }
            Err(mut failure) => {
                let mut sent = if failure.class == ErrorClass::Ambiguous {
                    Sent::MaybeApplied
                } else {
                    Sent::NotApplied
                };
                let lookup = provider.provider.lookup_policy();
                if failure.class == ErrorClass::Ambiguous
                    && provider.provider.dedupe() == Dedupe::None
                    && let Some(policy) = lookup
                {
                    // The provider will be asked: once its timeout and
                    // settle delay have passed, its "not applied" is
                    // trustworthy. Until then the job waits (no attempt
                    // used) and the key stays in doubt.
                    tracing::warn!(code = %failure.code, "outcome unknown: the provider will be asked whether it applied the effect");
                    metrics::effect(&effect.provider, "deferred");
                    self.fail(fence, &failure, Sent::MaybeApplied).await?;
                    return Err(in_doubt_deferral(
                        policy.trusted_after(provider.provider.timeout()),
                    ));
                }
                if failure.class == ErrorClass::Ambiguous
                    && provider.provider.dedupe() == Dedupe::None
                {
                    sent = Sent::Unresolved;
                    // Without provider-side dedupe a retry could repeat the
                    // effect: stop and let a human decide from the DLQ.
                    failure = Failure::host(
                        Code::AmbiguousNotRetried,
                        format!(
                            "{} (the provider cannot dedupe, so idem will not retry)",
                            failure.message
                        ),
                    );
                }
                tracing::warn!(code = %failure.code, class = failure.class.as_str(), "effect failed");
                WorkerStats::bump(&self.stats.effects_failed);
                metrics::effect(&effect.provider, "failed");
                self.fail(fence, &failure, sent).await?;
                Err(PlanOutcome::Failed(failure))
            }
        }
    }

    /// Runs a statement on the store's own database in the transaction that
    /// marks its effect succeeded: there is no moment at which one is
    /// committed and the other is not. `finish`, the job's success, commits
    /// in the same transaction; its answer is returned when it did.
    async fn run_in_store(
        &self,
        effect: &Effect,
        fence: &EffectFence,
        call: StatementCall,
        permit: Permit<'_>,
        finish: Option<Write>,
    ) -> Result<Option<Written>, PlanOutcome> {
        let params = StatementParams {
            fence: fence.clone(),
            call,
            finish,
        };
        let started = Instant::now();
        let outcome =
            retry_transient(|| self.store.effect_succeed_with_statement(params.clone())).await;
        let took = started.elapsed();
        WorkerStats::timed(&self.stats.store_wait_us, started);
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(error) => {
                // Committed or not, the ledger row says which: the job's
                // next delivery reads it.
                permit.record(Err(ErrorClass::Retryable));
                return Err(PlanOutcome::Store(error));
            }
        };
        let refused = match &outcome {
            StatementOutcome::Refused(failure) => Some(failure.code.as_str()),
            _ => None,
        };
        metrics::provider_call(&effect.provider, took, refused);
        match outcome {
            StatementOutcome::Applied { result_ref, finish } => {
                permit.record(Ok(()));
                tracing::info!(
                    result_ref = result_ref.as_deref().unwrap_or(""),
                    ?took,
                    job_finished = finish.is_some(),
                    "statement committed with its ledger row"
                );
                WorkerStats::bump(&self.stats.effects_executed);
                metrics::effect(&effect.provider, "executed");
                Ok(finish)
            }
            StatementOutcome::FencedOut => {
                permit.record(Ok(()));
                self.fenced_out("statement");
                Ok(None)
            }
            StatementOutcome::Refused(failure) => {
                permit.record(Err(failure.class));
                tracing::warn!(code = %failure.code, class = failure.class.as_str(), "statement refused");
                WorkerStats::bump(&self.stats.effects_failed);
                metrics::effect(&effect.provider, "failed");
                // Rolled back with the ledger's mark: nothing happened.
                self.fail(fence, &failure, Sent::NotApplied).await?;
                Err(PlanOutcome::Failed(failure))
            }
        }
    }

    async fn fail(
        &self,
        fence: &EffectFence,
        failure: &Failure,
        sent: Sent,
    ) -> Result<(), PlanOutcome> {
        let status = if failure.class == ErrorClass::Permanent {
            EffectStatus::Failed
        } else {
            EffectStatus::Retrying
        };
        let params = EffectFailParams {
            fence: fence.clone(),
            status,
            error_code: failure.code.clone(),
            sent,
        };
        let waited = Instant::now();
        let written = retry_transient(|| self.store.effect_set_failed(params.clone())).await;
        WorkerStats::timed(&self.stats.store_wait_us, waited);
        let written = written.map_err(PlanOutcome::Store)?;
        if written == Fence::FencedOut {
            self.fenced_out("effect failure");
        }
        Ok(())
    }

    fn fenced_out(&self, what: &str) {
        tracing::warn!(
            what,
            "stale write rejected: the effect's lease was taken over"
        );
        WorkerStats::bump(&self.stats.fenced_out);
        metrics::fenced_out();
    }
}

#[cfg(test)]
mod review_tests {
    use super::*;
    use crate::store::{JobId, JobState};

    fn deferred_job() -> Job {
        Job {
            id: JobId(1),
            queue: "default".into(),
            plugin: "billing".into(),
            payload: Vec::new(),
            idempotency_key: None,
            priority: 0,
            run_at_ms: 0,
            state: JobState::Running,
            attempt: 1,
            max_attempts: Some(5),
            lease_owner: Some("w".into()),
            lease_until_ms: Some(60_000),
            heartbeat_at_ms: Some(10_000),
            last_error_code: None,
            last_error_message: None,
            errors: Vec::new(),
            correlation_id: "c".into(),
            group: None,
            plugin_hash: None,
            plan: None,
            plan_hash: None,
            rescues: 0,
            started: true,
            unstarted_rescues: 0,
            created_at_ms: 0,
            updated_at_ms: 10_000,
            finished_at_ms: None,
            first_failed_at_ms: None,
            last_failed_at_ms: None,
            deferred_since_ms: Some(5_000),
            interruptions: 0,
        }
    }

    /// Review of issue 25: a lookup answered 429/503 with an absurd
    /// `Retry-After` (the provider's `retry_after` takes any u64 seconds)
    /// parks the job for as long as the provider says: here ~127 years,
    /// capped only by the store at 100 years. The effects' own retries cap
    /// a provider's Retry-After at `MAX_RETRY_AFTER` (1 h), and the sweep
    /// caps it at its pause; a job parked for years is neither in the DLQ
    /// nor past `max_deferral` until it wakes.
    #[test]
    fn review_a_lookups_retry_after_is_capped_like_an_effects() {
        let absurd = Some(Duration::from_secs(4_000_000_000));
        let wait = lookup_backoff(&deferred_job(), absurd);
        assert!(
            wait <= crate::queue::backoff::MAX_RETRY_AFTER,
            "a lookup deferral of {wait:?}"
        );
    }
}
