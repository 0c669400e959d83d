//! The one place where an attempt's result becomes a job state transition.
//! Every write is fenced by lease owner and attempt; a fenced-out write is
//! logged and counted, never applied.

use super::backoff::Backoff;
use super::stats::WorkerStats;
use crate::failure::{Code, Failure};
use crate::metrics;
use crate::store::{
    ChildEffect, ChildrenWritten, ErrorRecord, Fence, Job, JobChange, Store, StoreError, Write,
    Written,
};
use std::time::Duration;

/// How an attempt ended.
#[derive(Debug)]
pub enum Attempt {
    /// Plan executed (or, with [`Version::children`], to be carried out
    /// by the write that records the success).
    Succeeded,
    /// Plan executed, and its last effect (a statement on the store's own
    /// database) committed [`success_after_plan`] in its transaction: this
    /// is that write's answer, nothing is left to write.
    SucceededAndRecorded(Written),
    /// A classified failure.
    Failed(Failure),
    /// Try again later without using an attempt.
    Deferred {
        /// Delay.
        delay: Duration,
        /// Why.
        reason: DeferReason,
    },
    /// Shutdown interrupted it: give the lease back, attempt kept.
    Interrupted,
    /// The lease was lost to another attempt: nothing to record.
    LeaseLost,
}

impl Attempt {
    /// The name in metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Attempt::Succeeded | Attempt::SucceededAndRecorded(_) => "succeeded",
            Attempt::Failed(_) => "failed",
            Attempt::Deferred { .. } => "deferred",
            Attempt::Interrupted => "interrupted",
            Attempt::LeaseLost => "lease_lost",
        }
    }
}

/// Why a job waits without using an attempt: none of these is the job's
/// fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeferReason {
    /// Another worker holds the lease of one of its effect keys.
    EffectLeasedByOther,
    /// A provider's circuit is open.
    CircuitOpen,
    /// No sandbox instance was free.
    SandboxUnavailable,
    /// An effect's outcome is unknown and its provider is being asked (it
    /// could not answer yet, or its "not applied" is too recent to trust).
    EffectInDoubt,
}

impl DeferReason {
    /// The name in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            DeferReason::EffectLeasedByOther => "effect_leased_by_other",
            DeferReason::CircuitOpen => "circuit_open",
            DeferReason::SandboxUnavailable => "sandbox_unavailable",
            DeferReason::EffectInDoubt => "effect_in_doubt",
        }
    }
}

/// Settings for the decisions.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Backoff of the plugin (or the default).
    pub backoff: Backoff,
    /// Replace dead payloads by a reference.
    pub redact_dead_payloads: bool,
    /// Longest run of deferrals before the job is dead-lettered.
    pub max_deferral: Duration,
}

/// What recording an attempt wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The job succeeded.
    Succeeded,
    /// Retried after a failure.
    Retried,
    /// Deferred without using an attempt.
    Deferred,
    /// Dead-lettered.
    Dead,
    /// Lease given back.
    Released,
    /// Nothing (the lease was lost before).
    Nothing,
    /// Nothing: a key of the plan of child jobs was used before, so the
    /// plan must be carried out effect by effect.
    KeysTaken,
}

/// The write that records `attempt` for `job`: succeeded; retrying with
/// full-jitter backoff (a larger retry-after wins); dead when permanent or
/// out of attempts; deferred with the attempt refunded; interrupted → lease
/// given back. `version` is what the attempt ran with, when no plan write
/// recorded it. `None` when there is nothing to write.
pub fn decide(
    job: &Job,
    attempt: Attempt,
    policy: Policy,
    version: Version,
) -> Option<(Write, Recorded)> {
    let Version {
        plugin_hash,
        plan,
        children,
    } = version;
    let (change, recorded) = match attempt {
        // Written already, by the last effect's commit (see `record`).
        Attempt::LeaseLost | Attempt::SucceededAndRecorded(_) => return None,
        Attempt::Succeeded => {
            // Counted once the write answers: a plan of child jobs whose
            // keys were used before is not done yet.
            let change = match (children, plan, plugin_hash) {
                (Some(children), Some(plan), Some(plugin_hash)) => JobChange::SucceedWithChildren {
                    plugin: job.plugin.clone(),
                    plan,
                    plugin_hash,
                    children,
                },
                (_, plan, plugin_hash) => JobChange::Succeed { plugin_hash, plan },
            };
            (change, Recorded::Succeeded)
        }
        Attempt::Interrupted => {
            tracing::info!("lease given back at shutdown");
            (JobChange::Release, Recorded::Released)
        }
        Attempt::Deferred { reason, .. } if deferred_too_long(job, policy.max_deferral) => {
            let failure = if reason == DeferReason::EffectInDoubt {
                // Still unknown: dead-lettered as an effect in doubt, which
                // the reconcile sweep asks about again and replays.
                Failure::host(
                    Code::MayNotResend,
                    format!(
                        "an effect's provider could not settle whether it applied the \
                         effect within max_deferral ({}): not sent again; the reconcile \
                         sweep keeps asking",
                        humantime::format_duration(policy.max_deferral)
                    ),
                )
            } else {
                Failure::host(
                    Code::DeferredTooLong,
                    format!(
                        "deferred ({}) for longer than max_deferral ({})",
                        reason.as_str(),
                        humantime::format_duration(policy.max_deferral)
                    ),
                )
            };
            return decide(
                job,
                Attempt::Failed(failure),
                policy,
                Version {
                    plugin_hash,
                    plan,
                    children: None,
                },
            );
        }
        Attempt::Deferred { delay, reason } => {
            tracing::info!(?delay, reason = reason.as_str(), "job deferred");
            metrics::job_deferred(&job.plugin, reason.as_str());
            (
                JobChange::Retry {
                    delay,
                    error: None,
                    refund_attempt: true,
                    plugin_hash,
                },
                Recorded::Deferred,
            )
        }
        Attempt::Failed(failure) => {
            metrics::job_error(&job.plugin, &failure.code, failure.class.as_str());
            metrics::attempt_outcome(&job.plugin, job.attempt, "failed");
            let error = ErrorRecord {
                attempt: job.attempt,
                class: failure.class,
                code: failure.code.clone(),
                message: failure.message.clone(),
                at_ms: chrono::Utc::now().timestamp_millis(),
            };
            if !failure.class.is_retried() || job.is_last_attempt() {
                tracing::warn!(code = %failure.code, message = %failure.message, attempt = job.attempt,
                    "job dead-lettered");
                (
                    JobChange::Dead {
                        error,
                        redact_payload: policy.redact_dead_payloads,
                        plugin_hash,
                    },
                    Recorded::Dead,
                )
            } else {
                let delay =
                    policy
                        .backoff
                        .delay(job.attempt, failure.retry_after, &mut rand::rng());
                tracing::info!(code = %failure.code, message = %failure.message, attempt = job.attempt, ?delay,
                    "job will be retried");
                (
                    JobChange::Retry {
                        delay,
                        error: Some(error),
                        refund_attempt: false,
                        plugin_hash,
                    },
                    Recorded::Retried,
                )
            }
        }
    };
    Some((
        Write::Job {
            fence: job.fence(),
            change,
        },
        recorded,
    ))
}

/// The write that records `job`'s success once its stored plan's effects
/// are carried out (the plan and plugin version were stored with it): what
/// [`decide`] writes for [`Attempt::Succeeded`] then, offered to a last
/// statement on the store's own database to commit in its transaction.
///
/// `riders.finish_with(success_after_plan(&job));`
pub fn success_after_plan(job: &Job) -> Write {
    Write::Job {
        fence: job.fence(),
        change: JobChange::Succeed {
            plugin_hash: None,
            plan: None,
        },
    }
}

/// Counts a success the last effect's commit wrote ([`Attempt::SucceededAndRecorded`]).
pub fn recorded_with_last_effect(stats: &WorkerStats, job: &Job, written: Written) -> Recorded {
    settle(stats, job, Recorded::Succeeded, written)
}

/// Counts a successful attempt.
fn succeeded(job: &Job) {
    metrics::job_attempts(&job.plugin, job.attempt);
    metrics::attempt_outcome(&job.plugin, job.attempt, "succeeded");
}

/// Whether the job's current run of deferrals began longer than `limit`
/// before this attempt was claimed (both times by the database clock).
fn deferred_too_long(job: &Job, limit: Duration) -> bool {
    job.deferred_since_ms.is_some_and(|since| {
        let claimed_at = job.heartbeat_at_ms.unwrap_or(job.updated_at_ms);
        claimed_at.saturating_sub(since) > i64::try_from(limit.as_millis()).unwrap_or(i64::MAX)
    })
}

/// What an attempt ran with, recorded with its outcome when no plan write
/// recorded it before.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Version {
    /// The plugin's content hash.
    pub plugin_hash: Option<String>,
    /// A plan stored with the success: one without effects, or one made
    /// only of child jobs (with `children`).
    pub plan: Option<String>,
    /// The plan's child jobs, enqueued by the write that records the
    /// success (see [`JobChange::SucceedWithChildren`]).
    pub children: Option<Vec<ChildEffect>>,
}

/// Records `attempt` for `job` (see [`decide`]) and counts it.
pub async fn record(
    store: &dyn Store,
    stats: &WorkerStats,
    job: &Job,
    attempt: Attempt,
    policy: Policy,
    version: Version,
) -> Result<Recorded, StoreError> {
    if let Attempt::SucceededAndRecorded(written) = attempt {
        return Ok(recorded_with_last_effect(stats, job, written));
    }
    let Some((write, recorded)) = decide(job, attempt, policy, version) else {
        return Ok(Recorded::Nothing);
    };
    let written = crate::store::retry_transient(|| store.write(write.clone())).await?;
    Ok(settle(stats, job, recorded, written))
}

/// Counts what the write [`decide`] chose for `job` did, once it answered:
/// what was recorded, [`Recorded::Nothing`] when it was fenced out (the
/// lease was lost to another attempt), or [`Recorded::KeysTaken`].
pub fn settle(stats: &WorkerStats, job: &Job, recorded: Recorded, written: Written) -> Recorded {
    match written {
        Written::Children(ChildrenWritten::KeysTaken) => Recorded::KeysTaken,
        Written::Children(ChildrenWritten::Applied(children)) => {
            succeeded(job);
            WorkerStats::bump(&stats.finished_in_one_write);
            for child in &children {
                super::executor::child_enqueued(stats, child);
            }
            WorkerStats::bump(&stats.succeeded);
            recorded
        }
        Written::Job(Fence::Applied) => {
            let counter = match recorded {
                Recorded::Succeeded => {
                    succeeded(job);
                    &stats.succeeded
                }
                Recorded::Deferred => &stats.deferred,
                Recorded::Dead => &stats.dead,
                Recorded::Retried => &stats.retried,
                Recorded::Released | Recorded::Nothing | Recorded::KeysTaken => {
                    return recorded;
                }
            };
            WorkerStats::bump(counter);
            recorded
        }
        _ => {
            tracing::warn!(
                outcome = ?recorded,
                "stale completion rejected: the job's lease was lost to another attempt"
            );
            WorkerStats::bump(&stats.fenced_out);
            metrics::fenced_out();
            Recorded::Nothing
        }
    }
}
