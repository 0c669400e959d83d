//! Carrying out a stored plan, effect by effect, each at most once per key.
//!
//! For every effect: claim its key in the ledger (atomic); skip it when it
//! already succeeded (an idempotency hit); defer the job when another worker
//! holds the key; refuse a key reused for a different action
//! (`idempotency_key_conflict`); otherwise call the provider with the key
//! and record the result, fenced by the claim. A child job is enqueued in
//! the same transaction that marks its effect succeeded.

use super::{Action, Effect};
use crate::failure::{ErrorClass, Failure};
use crate::metrics;
use crate::providers::guard::Permit;
use crate::providers::{Dedupe, GuardedProvider, JOBS_PROVIDER, Providers};
use crate::queue::stats::WorkerStats;
use crate::store::{
    EffectClaim, EffectClaimParams, EffectFailParams, EffectFence, EffectStatus, Fence, Job,
    NewJob, Store, StoreError, retry_transient,
};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

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
        /// Why (a code for logs).
        reason: &'static str,
    },
    /// The store failed; the job's lease will expire and it will be redelivered.
    Store(StoreError),
    /// Stopped (shutdown or lease lost) between effects; nothing is in flight.
    Aborted,
    /// This effect was done before (internal: the plan goes on).
    Skipped,
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
    /// Defaults for child jobs.
    pub child_max_attempts: u32,
    /// Counters.
    pub stats: Arc<WorkerStats>,
}

/// SHA-256 of the provider and action: the identity of a request, so one key
/// reused for a different request is detected.
///
/// ```
/// use idem::effects::{Action, Effect, executor::fingerprint};
/// let e = Effect { provider: "p".into(), idempotency_key: "k".into(), action: Action::Custom { body: vec![] } };
/// assert_eq!(fingerprint(&e).len(), 64);
/// ```
pub fn fingerprint(effect: &Effect) -> String {
    let mut hasher = Sha256::new();
    hasher.update(effect.provider.as_bytes());
    hasher.update([0]);
    // serde_json writes struct fields in declaration order: stable across runs.
    hasher.update(serde_json::to_vec(&effect.action).unwrap_or_default());
    hex::encode(hasher.finalize())
}

fn conflict(effect: &Effect) -> PlanOutcome {
    PlanOutcome::Failed(Failure::permanent(
        "idempotency_key_conflict",
        format!(
            "the key {:?} was used before for a different request",
            effect.idempotency_key
        ),
    ))
}

fn failed_before(effect: &Effect, code: &str) -> PlanOutcome {
    PlanOutcome::Failed(Failure::permanent(
        code.to_string(),
        format!(
            "the effect {:?} failed permanently before ({code}); replay its job once the cause is fixed",
            effect.idempotency_key
        ),
    ))
}

impl Executor {
    /// Checks a fresh plan against the plugin's grants and the configured
    /// providers, before anything is stored or executed.
    pub fn check_grants(
        &self,
        plan: &[Effect],
        allowed: impl Fn(&str) -> bool,
    ) -> Result<(), Failure> {
        for effect in plan {
            if !allowed(&effect.provider) {
                return Err(Failure::permanent(
                    "effect_not_allowed",
                    format!(
                        "effect {:?} uses provider {:?}, which the plugin's manifest does not grant",
                        effect.idempotency_key, effect.provider
                    ),
                ));
            }
            if effect.provider != JOBS_PROVIDER && self.providers.get(&effect.provider).is_none() {
                return Err(Failure::permanent(
                    "provider_not_configured",
                    format!(
                        "no provider named {:?} is configured on this host",
                        effect.provider
                    ),
                ));
            }
            if effect.provider == JOBS_PROVIDER && !matches!(effect.action, Action::Enqueue { .. })
            {
                return Err(Failure::permanent(
                    "unsupported_action",
                    format!(
                        "the jobs provider only enqueues jobs, not {} effects",
                        effect.action.kind()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Executes a plan for a claimed job. When `abort` fires (shutdown), the
    /// provider call in flight is abandoned and its key handed back at once
    /// (the provider's dedupe makes the next call safe).
    pub async fn execute(
        &self,
        job: &Job,
        plan: &[Effect],
        abort: &CancellationToken,
    ) -> PlanOutcome {
        for effect in plan {
            if abort.is_cancelled() {
                return PlanOutcome::Aborted;
            }
            let span = tracing::info_span!("effect", key = %effect.idempotency_key, provider = %effect.provider);
            match self.execute_one(job, effect, abort).instrument(span).await {
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
    ) -> Result<(), PlanOutcome> {
        if effect.provider == JOBS_PROVIDER {
            let fence = self.claim(job, effect, self.effect_lease).await?;
            return self.enqueue_child(job, effect, &fence).await;
        }
        let Some(provider) = self.providers.get(&effect.provider) else {
            // A stored plan can outlive the host configuration it was
            // checked against; nothing is claimed, so a fixed host can replay it.
            return Err(PlanOutcome::Failed(Failure::permanent(
                "provider_not_configured",
                format!(
                    "no provider named {:?} is configured on this host",
                    effect.provider
                ),
            )));
        };
        // A key done (or refused) before needs no provider capacity: look
        // first, so a redelivery skips it even while the provider is down.
        if let Some(settled) = self.settled(effect).await? {
            return Err(settled);
        }
        // The permit comes before the key's lease: waiting for a slot or a
        // rate token must not eat into the lease that protects the call.
        let permit = match provider.guard.enter().await {
            Ok(permit) => permit,
            Err(open) => {
                metrics::effect(&effect.provider, "deferred");
                return Err(PlanOutcome::Deferred {
                    delay: open.retry_after.unwrap_or(Duration::from_secs(1)),
                    reason: "circuit_open",
                });
            }
        };
        if abort.is_cancelled() {
            permit.release();
            return Err(PlanOutcome::Aborted);
        }
        // The key's lease must outlast the call, or a second holder could
        // call the provider while this one still waits for the answer.
        let lease = self
            .effect_lease
            .max(provider.provider.timeout() * 2 + Duration::from_secs(5));
        let fence = match self.claim(job, effect, lease).await {
            Ok(fence) => fence,
            Err(outcome) => {
                // Skipped, deferred or refused: the provider was not called.
                permit.release();
                return Err(outcome);
            }
        };
        self.call_provider(effect, &fence, &provider, permit).await
    }

    /// What the ledger already settled for this key (done, failed, or used
    /// for another request), read without claiming.
    async fn settled(&self, effect: &Effect) -> Result<Option<PlanOutcome>, PlanOutcome> {
        let row = retry_transient(|| self.store.effect_get(&effect.idempotency_key))
            .await
            .map_err(PlanOutcome::Store)?;
        let Some(row) = row else { return Ok(None) };
        if row.fingerprint != fingerprint(effect) {
            return Ok(Some(conflict(effect)));
        }
        Ok(match row.status {
            EffectStatus::Succeeded => {
                self.hit(effect, row.result_ref.as_deref());
                Some(PlanOutcome::Skipped)
            }
            EffectStatus::Failed => Some(failed_before(
                effect,
                row.last_error_code.as_deref().unwrap_or("effect_failed"),
            )),
            EffectStatus::Processing | EffectStatus::Retrying => None,
        })
    }

    fn hit(&self, effect: &Effect, result_ref: Option<&str>) {
        tracing::info!(
            result_ref = result_ref.unwrap_or(""),
            "effect already done: skipped"
        );
        WorkerStats::bump(&self.stats.idempotency_hits);
        metrics::effect(&effect.provider, "idempotency_hit");
    }

    /// Claims the effect's key; every outcome but `Claimed` ends this effect.
    async fn claim(
        &self,
        job: &Job,
        effect: &Effect,
        lease: Duration,
    ) -> Result<EffectFence, PlanOutcome> {
        let params = EffectClaimParams {
            key: effect.idempotency_key.clone(),
            job_id: job.id,
            plugin: job.plugin.clone(),
            provider: effect.provider.clone(),
            fingerprint: fingerprint(effect),
            worker: self.worker.clone(),
            lease,
        };
        let claim = retry_transient(|| self.store.effect_claim(params.clone()))
            .await
            .map_err(PlanOutcome::Store)?;
        match claim {
            EffectClaim::Claimed { fence } => Ok(fence),
            EffectClaim::AlreadySucceeded { result_ref } => {
                self.hit(effect, result_ref.as_deref());
                Err(PlanOutcome::Skipped)
            }
            EffectClaim::LeasedByOther { lease_until_ms } => {
                // The holder usually finishes in milliseconds; look again
                // soon (the deferral costs no attempt) rather than waiting
                // out a lease that is only there for crashed holders.
                let now = chrono::Utc::now().timestamp_millis();
                let remaining = Duration::from_millis((lease_until_ms - now).max(0) as u64);
                let wait =
                    remaining.min(DEFER_LEASED) + Duration::from_millis(rand::random_range(0..200));
                tracing::info!(?wait, "another worker holds this effect: deferring the job");
                metrics::effect(&effect.provider, "deferred");
                Err(PlanOutcome::Deferred {
                    delay: wait,
                    reason: "effect_leased_by_other",
                })
            }
            EffectClaim::Conflict { .. } => Err(conflict(effect)),
            EffectClaim::Failed { code } => Err(failed_before(effect, &code)),
        }
    }

    async fn enqueue_child(
        &self,
        job: &Job,
        effect: &Effect,
        fence: &EffectFence,
    ) -> Result<(), PlanOutcome> {
        let Action::Enqueue {
            plugin,
            queue,
            payload,
            delay_ms,
            priority,
        } = &effect.action
        else {
            let failure =
                Failure::permanent("unsupported_action", "the jobs provider only enqueues jobs");
            self.fail(fence, &failure).await?;
            return Err(PlanOutcome::Failed(failure));
        };
        let child = NewJob {
            queue: queue.clone().unwrap_or_else(|| job.queue.clone()),
            plugin: plugin.clone(),
            payload: payload.clone(),
            idempotency_key: Some(effect.idempotency_key.clone()),
            priority: *priority,
            delay: Duration::from_millis(*delay_ms),
            max_attempts: self.child_max_attempts,
            correlation_id: Some(job.correlation_id.clone()),
        };
        let (written, enqueued) =
            retry_transient(|| self.store.effect_succeed_with_child(fence, child.clone()))
                .await
                .map_err(PlanOutcome::Store)?;
        if written == Fence::FencedOut {
            self.fenced_out("child job effect");
        } else {
            tracing::info!(child_job = %enqueued.id, inserted = enqueued.inserted, "child job enqueued");
            WorkerStats::bump(&self.stats.effects_executed);
            metrics::effect(JOBS_PROVIDER, "executed");
        }
        Ok(())
    }

    async fn call_provider(
        &self,
        effect: &Effect,
        fence: &EffectFence,
        provider: &GuardedProvider,
        permit: Permit<'_>,
    ) -> Result<(), PlanOutcome> {
        // Never cancelled once sent: the provider timeout bounds it, and
        // dropping it would lose an answer that can still be recorded.
        let started = Instant::now();
        let result = provider.provider.execute(effect).await;
        let took = started.elapsed();
        metrics::provider_call(
            &effect.provider,
            took,
            result.as_ref().err().map(|f| f.code.as_str()),
        );
        permit.record(result.as_ref().map(|_| ()).map_err(|f| f.class));
        match result {
            Ok(delivered) => {
                tracing::info!(
                    result_ref = delivered.result_ref.as_deref().unwrap_or(""),
                    ?took,
                    "effect carried out"
                );
                let written = retry_transient(|| {
                    self.store
                        .effect_set_succeeded(fence, delivered.result_ref.as_deref())
                })
                .await
                .map_err(PlanOutcome::Store)?;
                if written == Fence::FencedOut {
                    self.fenced_out("effect success");
                }
                WorkerStats::bump(&self.stats.effects_executed);
                metrics::effect(&effect.provider, "executed");
                Ok(())
            }
            Err(mut failure) => {
                if failure.class == ErrorClass::Ambiguous
                    && provider.provider.dedupe() == Dedupe::None
                {
                    // Without provider-side dedupe a retry could repeat the
                    // effect: stop and let a human decide from the DLQ.
                    failure = Failure::permanent(
                        "ambiguous_not_retried",
                        format!(
                            "{} (the provider cannot dedupe, so idem will not retry)",
                            failure.message
                        ),
                    );
                }
                tracing::warn!(code = %failure.code, class = failure.class.as_str(), "effect failed");
                WorkerStats::bump(&self.stats.effects_failed);
                metrics::effect(&effect.provider, "failed");
                self.fail(fence, &failure).await?;
                Err(PlanOutcome::Failed(failure))
            }
        }
    }

    async fn fail(&self, fence: &EffectFence, failure: &Failure) -> Result<(), PlanOutcome> {
        let status = if failure.class == ErrorClass::Permanent {
            EffectStatus::Failed
        } else {
            EffectStatus::Retrying
        };
        let params = EffectFailParams {
            fence: fence.clone(),
            status,
            error_code: failure.code.clone(),
        };
        let written = retry_transient(|| self.store.effect_set_failed(params.clone()))
            .await
            .map_err(PlanOutcome::Store)?;
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
