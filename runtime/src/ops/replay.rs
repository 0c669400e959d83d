//! Dead-letter replay: rate-limited, and refused for the same reasons
//! wherever it is asked for (CLI, API, dashboard).

use super::OpsError;
use crate::store::{JobFilter, JobId, JobState, Store, is_redacted_payload};
use serde::Serialize;
use std::time::Duration;

/// Which dead jobs to replay, and how.
#[derive(Debug, Clone, Default)]
pub struct ReplayRequest {
    /// These jobs.
    pub ids: Vec<JobId>,
    /// Every dead job of this plugin.
    pub plugin: Option<String>,
    /// Every dead job with this last error code.
    pub code: Option<String>,
    /// Every dead job (needed when no other selector is given).
    pub all: bool,
    /// Drop each job's stored plan so the (fixed) plugin makes a new one.
    pub discard_plan: bool,
    /// Most jobs replayed per second.
    pub per_second: f64,
    /// Most jobs handled by this request (0: all selected).
    pub limit: u32,
}

/// A job brought back.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ReplayedJob {
    /// The job.
    pub id: JobId,
    /// Its plugin.
    pub plugin: String,
    /// The code it died with.
    pub code: Option<String>,
}

/// A job left dead, and why.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Refusal {
    /// The job.
    pub id: JobId,
    /// Machine-readable reason: `effect_in_doubt`, `plan_not_discardable`,
    /// `payload_redacted`.
    pub reason: &'static str,
    /// What to do about it.
    pub message: String,
    /// The effect key in doubt, when that is the reason.
    pub key: Option<String>,
}

/// What a replay did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ReplayReport {
    /// Jobs brought back.
    pub replayed: Vec<ReplayedJob>,
    /// Jobs left dead.
    pub refused: Vec<Refusal>,
    /// More jobs matched than `limit` allowed.
    pub more: bool,
}

/// Parses `10/s`, `600/m` or a bare number (per second).
///
/// ```
/// assert_eq!(idem::ops::replay::parse_rate("60/m").unwrap(), 1.0);
/// ```
pub fn parse_rate(text: &str) -> Result<f64, String> {
    let (n, per) = text.split_once('/').unwrap_or((text, "s"));
    let n: f64 = n
        .trim()
        .parse()
        .map_err(|_| format!("bad rate {text:?}: expected e.g. 10/s"))?;
    let seconds = match per.trim() {
        "s" | "sec" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => return Err(format!("bad rate unit {other:?}: use /s, /m or /h")),
    };
    if n <= 0.0 || !n.is_finite() {
        return Err(format!("bad rate {text:?}: must be above zero"));
    }
    Ok(n / seconds)
}

/// The dead jobs a request selects, newest first.
pub async fn selected(
    store: &dyn Store,
    request: &ReplayRequest,
) -> Result<Vec<crate::store::Job>, OpsError> {
    if request.ids.is_empty() && request.plugin.is_none() && request.code.is_none() && !request.all
    {
        return Err(OpsError::Invalid(
            "say what to replay: job ids, a plugin, an error code, or all".into(),
        ));
    }
    Ok(store
        .job_list(JobFilter {
            states: vec![JobState::Dead],
            plugin: request.plugin.clone(),
            error_code: request.code.clone(),
            ids: request.ids.clone(),
            limit: if request.limit == 0 {
                0
            } else {
                request.limit + 1
            },
            ..JobFilter::default()
        })
        .await?)
}

/// Replays the selected dead jobs at most `per_second`, each refused when
/// an effect of its plan is in doubt (until an operator resolves it), when
/// its plan cannot be discarded as asked, or when its payload was redacted
/// and there is no plan to carry out.
pub async fn replay(store: &dyn Store, request: ReplayRequest) -> Result<ReplayReport, OpsError> {
    if !(request.per_second > 0.0 && request.per_second.is_finite()) {
        return Err(OpsError::Invalid(
            "the replay rate must be above zero".into(),
        ));
    }
    let mut dead = selected(store, &request).await?;
    let mut report = ReplayReport::default();
    if request.limit > 0 && dead.len() > request.limit as usize {
        dead.truncate(request.limit as usize);
        report.more = true;
    }
    let gap = Duration::from_secs_f64(1.0 / request.per_second);
    for (i, job) in dead.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(gap).await;
        }
        if is_redacted_payload(&job.payload) && (job.plan.is_none() || request.discard_plan) {
            report.refused.push(Refusal {
                id: job.id,
                reason: "payload_redacted",
                message: "its payload was redacted and it has no plan to carry out: enqueue it again from the source".into(),
                key: None,
            });
            continue;
        }
        if request.discard_plan && job.plan.is_some() && !store.job_discard_plan(job.id).await? {
            report.refused.push(Refusal {
                id: job.id,
                reason: "plan_not_discardable",
                message: "its plan cannot be discarded: an effect of it may already have reached its provider; replay it without discarding the plan to carry out the same plan".into(),
                key: None,
            });
            continue;
        }
        let outcome = store.job_replay(&[job.id]).await?;
        for (id, key) in outcome.refused {
            report.refused.push(Refusal {
                id,
                reason: "effect_in_doubt",
                message: format!(
                    "effect {key:?} may have happened and idem will not send it again: check with the provider, then `idem effects resolve {key} --applied` or `--not-applied`"
                ),
                key: Some(key),
            });
        }
        for id in outcome.replayed {
            report.replayed.push(ReplayedJob {
                id,
                plugin: job.plugin.clone(),
                code: job.last_error_code.clone(),
            });
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    #[test]
    fn rates_parse() {
        assert_eq!(super::parse_rate("10/s").unwrap(), 10.0);
        assert_eq!(super::parse_rate("60/m").unwrap(), 1.0);
        assert!(super::parse_rate("0/s").is_err());
        assert!(super::parse_rate("ten").is_err());
    }
}
