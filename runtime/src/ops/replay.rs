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
    /// Jobs left dead because replaying them could repeat or contradict an
    /// effect (an effect in doubt, a plan that cannot be discarded).
    pub refused: Vec<Refusal>,
    /// Jobs left dead because there is nothing to replay them with (a
    /// redacted payload and no plan): enqueue them again from the source.
    pub skipped: Vec<Refusal>,
    /// More jobs matched than `limit` allowed.
    pub more: bool,
}

/// Spaces replays out: at most one job per `gap`, across every caller that
/// shares the pacer (all API and dashboard requests of a process).
///
/// ```
/// let pacer = idem::ops::replay::Pacer::per_second(10.0).unwrap();
/// ```
#[derive(Debug)]
pub struct Pacer {
    gap: Duration,
    next: tokio::sync::Mutex<Option<tokio::time::Instant>>,
}

/// Slowest and fastest replay rates accepted.
pub const RATE_BOUNDS: (f64, f64) = (1.0 / 3600.0, 10_000.0);

impl Pacer {
    /// A pacer for `per_second` jobs a second (1/h to 10,000/s).
    pub fn per_second(per_second: f64) -> Result<Self, String> {
        if !(RATE_BOUNDS.0..=RATE_BOUNDS.1).contains(&per_second) {
            return Err(format!(
                "the replay rate must be between 1/h and 10000/s, not {per_second}/s"
            ));
        }
        let gap = Duration::try_from_secs_f64(1.0 / per_second).map_err(|e| e.to_string())?;
        Ok(Pacer {
            gap,
            next: tokio::sync::Mutex::new(None),
        })
    }

    /// Waits for this caller's turn.
    pub async fn wait(&self) {
        let mut next = self.next.lock().await;
        let now = tokio::time::Instant::now();
        let turn = next.map_or(now, |at| at.max(now));
        *next = Some(turn + self.gap);
        tokio::time::sleep_until(turn).await;
    }
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
    let rate = n / seconds;
    if !(RATE_BOUNDS.0..=RATE_BOUNDS.1).contains(&rate) {
        return Err(format!("bad rate {text:?}: between 1/h and 10000/s"));
    }
    Ok(rate)
}

impl ReplayRequest {
    /// Refuses a request that selects nothing by name (replaying everything
    /// takes `all`).
    pub fn check(&self) -> Result<(), OpsError> {
        if self.ids.is_empty() && self.plugin.is_none() && self.code.is_none() && !self.all {
            return Err(OpsError::Invalid(
                "say what to replay: job ids, --plugin P, --code C or --all".into(),
            ));
        }
        Ok(())
    }
}

/// The dead jobs a request selects, newest first.
pub async fn selected(
    store: &dyn Store,
    request: &ReplayRequest,
) -> Result<Vec<crate::store::Job>, OpsError> {
    request.check()?;
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

/// Replays the selected dead jobs as `pacer` allows, each refused when an
/// effect of its plan is in doubt (until an operator resolves it) or when
/// its plan cannot be discarded as asked, and skipped when its payload was
/// redacted and there is no plan to carry out.
pub async fn replay(
    store: &dyn Store,
    request: ReplayRequest,
    pacer: &Pacer,
) -> Result<ReplayReport, OpsError> {
    let mut dead = selected(store, &request).await?;
    let mut report = ReplayReport::default();
    if request.limit > 0 && dead.len() > request.limit as usize {
        dead.truncate(request.limit as usize);
        report.more = true;
    }
    for job in &dead {
        if is_redacted_payload(&job.payload) && (job.plan.is_none() || request.discard_plan) {
            report.skipped.push(Refusal {
                id: job.id,
                reason: "payload_redacted",
                message: "its payload was redacted and it has no plan to carry out: enqueue it again from the source".into(),
                key: None,
            });
            continue;
        }
        pacer.wait().await;
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
        assert!(
            super::parse_rate("1e-300/s").is_err(),
            "too slow to wait for"
        );
        assert!(super::parse_rate("inf").is_err());
        assert!(super::Pacer::per_second(1e-300).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_shared_pacer_spaces_every_caller() {
        let pacer = std::sync::Arc::new(super::Pacer::per_second(2.0).unwrap());
        let start = tokio::time::Instant::now();
        let (a, b) = (pacer.clone(), pacer.clone());
        let waits = futures::future::join_all((0..4).map(|i| {
            let p = if i % 2 == 0 { a.clone() } else { b.clone() };
            async move {
                p.wait().await;
                tokio::time::Instant::now() - start
            }
        }))
        .await;
        let mut ms: Vec<u128> = waits.iter().map(|d| d.as_millis()).collect();
        ms.sort();
        assert_eq!(ms, [0, 500, 1000, 1500]);
    }
}
