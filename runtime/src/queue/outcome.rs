//! The one place where an attempt's result becomes a job state transition.
//! Every write is fenced by lease owner and attempt; a fenced-out write is
//! logged and counted, never applied.

use super::backoff::Backoff;
use super::stats::WorkerStats;
use crate::failure::Failure;
use crate::metrics;
use crate::store::{DeadParams, ErrorRecord, Fence, Job, RetryParams, Store, StoreError};
use std::time::Duration;

/// How an attempt ended.
#[derive(Debug)]
pub enum Attempt {
    /// Plan executed.
    Succeeded,
    /// A classified failure.
    Failed(Failure),
    /// Try again later without using an attempt.
    Deferred {
        /// Delay.
        delay: Duration,
        /// Why.
        reason: &'static str,
    },
    /// Shutdown interrupted it: give the lease back, attempt kept.
    Interrupted,
}

/// Settings for the decisions.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Backoff of the plugin (or the default).
    pub backoff: Backoff,
    /// Replace dead payloads by a reference.
    pub redact_dead_payloads: bool,
}

/// Records `attempt` for `job`: succeeded; retrying with full-jitter backoff
/// (a larger retry-after wins); dead when permanent or out of attempts;
/// deferred with the attempt refunded; interrupted → lease given back.
pub async fn record(
    store: &dyn Store,
    stats: &WorkerStats,
    job: &Job,
    attempt: Attempt,
    policy: Policy,
) -> Result<Fence, StoreError> {
    let fence = job.fence();
    let (written, outcome) = match attempt {
        Attempt::Succeeded => {
            metrics::job_attempts(&job.plugin, job.attempt);
            (store.job_set_succeeded(&fence).await?, "succeeded")
        }
        Attempt::Interrupted => {
            tracing::info!("lease given back at shutdown");
            (store.job_release(&fence).await?, "released")
        }
        Attempt::Deferred { delay, reason } => {
            tracing::info!(?delay, reason, "job deferred");
            let written = store
                .job_set_retrying(RetryParams {
                    fence: fence.clone(),
                    delay,
                    error: None,
                    refund_attempt: true,
                })
                .await?;
            (written, "deferred")
        }
        Attempt::Failed(failure) => {
            metrics::job_error(&job.plugin, &failure.code, failure.class.as_str());
            let error = ErrorRecord {
                attempt: job.attempt,
                class: failure.class.as_str().to_string(),
                code: failure.code.clone(),
                message: failure.message.clone(),
                at_ms: chrono::Utc::now().timestamp_millis(),
            };
            if !failure.class.is_retried() || job.attempt >= job.max_attempts {
                tracing::warn!(code = %failure.code, message = %failure.message, attempt = job.attempt,
                    "job dead-lettered");
                let written = store
                    .job_set_dead(DeadParams {
                        fence: fence.clone(),
                        error,
                        redact_payload: policy.redact_dead_payloads,
                    })
                    .await?;
                (written, "dead")
            } else {
                let delay =
                    policy
                        .backoff
                        .delay(job.attempt, failure.retry_after, &mut rand::rng());
                tracing::info!(code = %failure.code, message = %failure.message, attempt = job.attempt, ?delay,
                    "job will be retried");
                let written = store
                    .job_set_retrying(RetryParams {
                        fence: fence.clone(),
                        delay,
                        error: Some(error),
                        refund_attempt: false,
                    })
                    .await?;
                (written, "retried")
            }
        }
    };
    match written {
        Fence::Applied => {
            let counter = match outcome {
                "succeeded" => &stats.succeeded,
                "deferred" => &stats.deferred,
                "dead" => &stats.dead,
                "retried" => &stats.retried,
                _ => return Ok(written),
            };
            WorkerStats::bump(counter);
        }
        Fence::FencedOut => {
            tracing::warn!(
                outcome,
                "stale completion rejected: the job's lease was lost to another attempt"
            );
            WorkerStats::bump(&stats.fenced_out);
            metrics::fenced_out();
        }
    }
    Ok(written)
}
