//! The reconcile sweep: keys left in doubt (a try may have reached a
//! provider and nothing settled it since: every node crashed mid-call, a
//! job was dead-lettered `may_not_resend`) are settled by asking their
//! provider, where it offers a lookup, and the dead jobs whose only cause
//! was such a key are replayed, paced as `idem dlq replay` is.
//!
//! The executor asks the same question for the keys of live jobs (see
//! `Executor::ask_provider`); this sweep covers what no live job will ask
//! again. It runs periodically beside every worker (`[worker]
//! reconcile_interval`) and on demand (`idem effects reconcile`). Every
//! write is fenced by the key's attempt as read, so a key claimed by a
//! worker meanwhile is left to that worker.

use crate::failure::Code;
use crate::metrics;
use crate::ops::replay::{Pacer, ReplayRequest};
use crate::providers::{GuardedProvider, Lookup, Providers};
use crate::store::{EffectStatus, Job, JobFilter, JobId, JobState, Resolution, Store, StoreError};
use serde::Serialize;
use std::time::Duration;

/// Codes a job is dead-lettered with when an effect of its plan is in
/// doubt and nothing else went wrong.
pub const IN_DOUBT_CODES: [Code; 3] = [
    Code::MayNotResend,
    Code::DedupeWindowPassed,
    Code::AmbiguousNotRetried,
];

/// Keys asked about per sweep, and dead jobs looked at per code.
pub const SWEEP_BATCH: u32 = 200;

/// What one sweep is asked to do.
///
/// ```
/// let request = idem::queue::reconcile::ReconcileRequest { plugin: None, dry_run: true, limit: 100 };
/// ```
#[derive(Debug, Clone)]
pub struct ReconcileRequest {
    /// Only keys and jobs of this plugin.
    pub plugin: Option<String>,
    /// Ask, and report what would be settled and replayed, but write nothing.
    pub dry_run: bool,
    /// Most keys asked about, and most dead jobs looked at.
    pub limit: u32,
}

/// A key the sweep asked about, and what it found.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Asked {
    /// The key.
    pub key: String,
    /// Its provider.
    pub provider: String,
    /// `applied`, `not_applied`, `too_recent`, `unavailable`, `unanswerable`.
    pub outcome: &'static str,
    /// The provider's reference (applied), or what it answered (the rest).
    pub detail: Option<String>,
    /// Whether the ledger took the answer (false in a dry run, or when the
    /// key was claimed or settled meanwhile).
    pub settled: bool,
}

/// A dead job the sweep left dead, and why.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LeftDead {
    /// The job.
    pub id: JobId,
    /// The key still in doubt, when that is the reason.
    pub key: Option<String>,
    /// Why.
    pub reason: String,
}

/// What a sweep did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Whether nothing was written.
    pub dry_run: bool,
    /// Keys asked about.
    pub asked: Vec<Asked>,
    /// Dead jobs replayed (in a dry run: that would be replayed).
    pub replayed: Vec<JobId>,
    /// Dead jobs left dead.
    pub left_dead: Vec<LeftDead>,
}

impl ReconcileReport {
    /// Keys whose answer the ledger took.
    pub fn settled(&self) -> usize {
        self.asked.iter().filter(|a| a.settled).count()
    }
}

/// One sweep: asks about the keys in doubt of the providers that offer a
/// lookup, settles each one the answer allows, then replays the dead jobs
/// whose only cause was a key in doubt and whose keys are all settled now.
///
/// `let report = reconcile_once(&*store, &providers, &request, &pacer).await?;`
pub async fn reconcile_once(
    store: &dyn Store,
    providers: &Providers,
    request: &ReconcileRequest,
    pacer: &Pacer,
) -> Result<ReconcileReport, StoreError> {
    let mut report = ReconcileReport {
        dry_run: request.dry_run,
        ..ReconcileReport::default()
    };
    let askable: Vec<String> = providers
        .iter()
        .filter(|p| p.provider.lookup_policy().is_some())
        .map(|p| p.name.clone())
        .collect();
    let rows = store
        .effects_to_reconcile(&askable, request.plugin.as_deref(), request.limit)
        .await?;
    for row in rows {
        let Some(provider) = providers.get(&row.provider) else {
            continue;
        };
        let answer = ask(&provider, &row.key, &row.fingerprint, row.tried_ago).await;
        let (outcome, detail) = (answer.outcome, answer.detail);
        metrics::effect_reconciled(&row.provider, outcome);
        let settled = match answer.settle {
            Settle::Now(resolution) if !request.dry_run => {
                store
                    .effect_reconcile(&row.key, row.attempt, resolution)
                    .await?
            }
            // Left out of the next sweeps for a while, so keys that stay
            // unknown do not crowd out the rest.
            Settle::AskAgainIn(after) if !request.dry_run => {
                store.effect_ask_later(&row.key, row.attempt, after).await?;
                false
            }
            _ => false,
        };
        tracing::info!(key = %row.key, provider = %row.provider, outcome, settled, "reconcile: asked the provider about a key in doubt");
        report.asked.push(Asked {
            key: row.key,
            provider: row.provider,
            outcome,
            detail,
            settled,
        });
    }
    let would_settle: std::collections::HashSet<String> = report
        .asked
        .iter()
        .filter(|a| request.dry_run && matches!(a.outcome, "applied" | "not_applied"))
        .map(|a| a.key.clone())
        .collect();
    replay_settled(store, &askable, request, pacer, &would_settle, &mut report).await?;
    Ok(report)
}

/// What a lookup said, for the sweep.
struct Answer {
    /// The metric outcome.
    outcome: &'static str,
    /// The reference (applied), or what was answered.
    detail: Option<String>,
    /// What to do with the key.
    settle: Settle,
}

/// What the sweep does with a key it asked about.
enum Settle {
    /// Record the answer.
    Now(Resolution),
    /// Ask again no sooner than this.
    AskAgainIn(Duration),
}

/// Longest a key whose provider could not answer waits for the next ask.
const UNAVAILABLE_PAUSE: Duration = Duration::from_secs(300);
/// How long a key whose provider's answer fits neither outcome waits.
const UNANSWERABLE_PAUSE: Duration = Duration::from_secs(3600);

/// Asks `provider` about `key`: the outcome, a detail, and what the
/// ledger may take (an answer, or a pause before the next ask while the
/// answer is unknown or "not applied" is too recent to trust).
async fn ask(
    provider: &GuardedProvider,
    key: &str,
    fingerprint: &str,
    tried_ago: Duration,
) -> Answer {
    let answer = |outcome, detail, settle| Answer {
        outcome,
        detail,
        settle,
    };
    let Some(policy) = provider.provider.lookup_policy() else {
        return answer(
            "unanswerable",
            Some("the provider offers no lookup".into()),
            Settle::AskAgainIn(UNANSWERABLE_PAUSE),
        );
    };
    // Through the provider's guards, as any call: a slot, a rate token, and
    // nothing while its circuit is open.
    let permit = match provider.guard.enter().await {
        Ok(permit) => permit,
        Err(open) => {
            return answer(
                "unavailable",
                Some(format!(
                    "the provider's circuit is open (for {})",
                    humantime::format_duration(Duration::from_secs(open.retry_after.as_secs()))
                )),
                Settle::AskAgainIn(open.retry_after.min(UNAVAILABLE_PAUSE)),
            );
        }
    };
    let looked_up =
        crate::providers::look_up_within(&*provider.provider, policy, key, fingerprint).await;
    match looked_up {
        Ok(Lookup::Applied { result_ref }) => {
            permit.record(Ok(()));
            answer(
                "applied",
                result_ref.clone(),
                Settle::Now(Resolution::Applied { result_ref }),
            )
        }
        Ok(Lookup::NotApplied) => {
            permit.record(Ok(()));
            let trusted_after = policy.trusted_after(provider.provider.timeout());
            if tried_ago >= trusted_after {
                answer("not_applied", None, Settle::Now(Resolution::NotApplied))
            } else {
                answer(
                    "too_recent",
                    Some(format!(
                        "not applied so far; trusted once the last try is {} old",
                        humantime::format_duration(Duration::from_secs(trusted_after.as_secs()))
                    )),
                    Settle::AskAgainIn(trusted_after - tried_ago),
                )
            }
        }
        Err(failure) if failure.class.is_retried() => {
            permit.record(Err(failure.class));
            let pause = failure
                .retry_after
                .unwrap_or(UNAVAILABLE_PAUSE)
                .min(UNAVAILABLE_PAUSE);
            answer(
                "unavailable",
                Some(failure.message),
                Settle::AskAgainIn(pause),
            )
        }
        Err(failure) => {
            permit.release();
            answer(
                "unanswerable",
                Some(failure.message),
                Settle::AskAgainIn(UNANSWERABLE_PAUSE),
            )
        }
    }
}

/// Most pages of dead jobs one sweep looks at.
const REPLAY_PAGES: u32 = 10;

/// Replays the dead jobs whose only cause was a key in doubt, one of whose
/// ledger rows is at a provider that can be asked (`askable`), once every
/// key of their plan is settled (by a lookup, now or in an earlier sweep,
/// or by a person). A dry run counts the keys it would have settled
/// (`would_settle`) as settled.
async fn replay_settled(
    store: &dyn Store,
    askable: &[String],
    request: &ReconcileRequest,
    pacer: &Pacer,
    would_settle: &std::collections::HashSet<String>,
    report: &mut ReconcileReport,
) -> Result<(), StoreError> {
    let codes: Vec<String> = IN_DOUBT_CODES
        .iter()
        .map(|code| code.as_str().to_string())
        .collect();
    let mut candidates: Vec<JobId> = Vec::new();
    let mut after = JobId(0);
    for _ in 0..REPLAY_PAGES {
        let page = store
            .dead_jobs_settled(
                &codes,
                askable,
                request.plugin.as_deref(),
                after,
                request.limit,
            )
            .await?;
        let full = page.len() >= request.limit as usize;
        if let Some(last) = page.last() {
            after = *last;
        }
        candidates.extend(page);
        if !full {
            break;
        }
    }
    if request.dry_run && !would_settle.is_empty() {
        // Jobs a key of which the dry run would have settled are not
        // settled in the ledger: find them among the dead of these codes.
        for code in &codes {
            let dead = store
                .job_list(JobFilter {
                    states: vec![JobState::Dead],
                    plugin: request.plugin.clone(),
                    error_code: Some(code.clone()),
                    ..JobFilter::default()
                })
                .await?;
            for job in dead {
                let keys = plan_keys(&job);
                if keys.iter().any(|key| would_settle.contains(key))
                    && !candidates.contains(&job.id)
                {
                    candidates.push(job.id);
                }
            }
        }
    }
    for id in candidates {
        let Some(job) = store.job_get(id).await? else {
            continue;
        };
        let keys = plan_keys(&job);
        match unsettled_key(store, &job, &keys, request.dry_run.then_some(would_settle)).await? {
            Some(reason) => report.left_dead.push(reason),
            None if request.dry_run => report.replayed.push(job.id),
            None => {
                let outcome = crate::ops::replay::replay(
                    store,
                    ReplayRequest {
                        ids: vec![job.id],
                        ..ReplayRequest::default()
                    },
                    pacer,
                )
                .await
                .map_err(|e| match e {
                    crate::ops::OpsError::Store(e) => e,
                    other => StoreError::Corrupt(other.to_string()),
                })?;
                report
                    .replayed
                    .extend(outcome.replayed.iter().map(|r| r.id));
                report
                    .left_dead
                    .extend(
                        outcome
                            .refused
                            .into_iter()
                            .chain(outcome.skipped)
                            .map(|r| LeftDead {
                                id: r.id,
                                key: r.key,
                                reason: r.message,
                            }),
                    );
            }
        }
    }
    if !report.replayed.is_empty() {
        tracing::info!(jobs = ?report.replayed, dry_run = request.dry_run, "reconcile: dead jobs whose effects in doubt are settled replayed");
    }
    Ok(())
}

/// The keys of a job's stored plan (none without one).
fn plan_keys(job: &Job) -> Vec<String> {
    job.plan
        .as_ref()
        .map(|plan| crate::store::plan_keys(std::iter::once(plan)))
        .unwrap_or_default()
}

/// Why `job` cannot be replayed yet: a key of its plan (`keys`) still in
/// doubt; `None` when every key is settled. A dry run counts the keys it
/// would have settled (`would_settle`) as settled.
async fn unsettled_key(
    store: &dyn Store,
    job: &Job,
    keys: &[String],
    would_settle: Option<&std::collections::HashSet<String>>,
) -> Result<Option<LeftDead>, StoreError> {
    for key in keys {
        if would_settle.is_some_and(|keys| keys.contains(key)) {
            continue;
        }
        let Some(row) = store.effect_get(key).await? else {
            continue;
        };
        // Held (a holder may be calling), marked reached and not settled,
        // or left for an operator.
        let in_doubt = row.in_doubt
            || row.status == EffectStatus::Processing
            || (row.reached && row.status == EffectStatus::Retrying);
        if in_doubt {
            return Ok(Some(LeftDead {
                id: job.id,
                key: Some(key.clone()),
                reason: format!(
                    "its effect is still in doubt: provider {:?} could not settle it yet",
                    row.provider
                ),
            }));
        }
    }
    Ok(None)
}
