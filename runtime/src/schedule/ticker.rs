//! The schedule ticker: a background loop every worker process runs. Each
//! round reads the store's clock and each schedule's last tick, and records
//! the due ticks ([`plan::steps`]) through [`Store::schedule_tick`]. Many
//! nodes may see the same tick: the store lets one of them enqueue it, so
//! there is no leader to elect.

use super::plan;
use super::spec::Schedule;
use crate::metrics;
use crate::store::{Store, StoreError, Ticked};
use std::collections::HashMap;
use std::time::Duration;

/// How often a worker looks for due ticks: `min(1 s, poll_interval)`.
///
/// `let every = idem::schedule::ticker::interval(std::time::Duration::from_millis(50));`
pub fn interval(poll_interval: Duration) -> Duration {
    poll_interval
        .min(Duration::from_secs(1))
        .max(Duration::from_millis(10))
}

/// How old a due tick may be and still count as on time, not missed:
/// `max(2 × interval, 5 s)`. A stall of a few seconds (a slow store, a
/// failover, a pause) must never drop a tick of a running cluster: with
/// `one`, a late tick followed by an on-time one would otherwise collapse
/// into it. The cost: after an outage, the ticks of its last 5 s count as
/// on time and are enqueued whatever the policy (a per-second schedule with
/// `skip` gets up to 5 jobs, a per-minute one at most 1).
///
/// `let grace = idem::schedule::ticker::grace(std::time::Duration::from_secs(1));`
pub fn grace(interval: Duration) -> Duration {
    (interval * 2).max(GRACE)
}

/// The least [`grace`].
const GRACE: Duration = Duration::from_secs(5);

/// Records every due tick of `schedules` once; returns the jobs this call
/// enqueued, as (schedule, tick, job id). A schedule the store does not
/// know yet starts now: its first job is at its next tick. One schedule's
/// failure is logged and does not hold the others back.
///
/// `let enqueued = tick_once(&*store, &schedules, grace, 10).await?;`
pub async fn tick_once(
    store: &dyn Store,
    schedules: &[Schedule],
    grace: Duration,
    max_attempts: u32,
) -> Result<Vec<(String, i64, crate::store::JobId)>, StoreError> {
    if schedules.is_empty() {
        return Ok(Vec::new());
    }
    let now = store.clock_now().await?;
    let known: HashMap<String, i64> = store
        .schedule_list()
        .await?
        .into_iter()
        .map(|s| (s.name, s.last_tick_ms))
        .collect();
    let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
    // Side by side: one schedule's long catch-up (thousands of ticks, a
    // transaction each) does not hold the others' ticks back.
    let rounds = schedules.iter().map(|schedule| {
        let last = known.get(&schedule.name).copied();
        async move {
            let mut enqueued = Vec::new();
            let result = match last {
                None => start(store, schedule, now).await,
                Some(last) => {
                    record(
                        store,
                        schedule,
                        plan::steps(schedule, last, now, grace_ms),
                        max_attempts,
                        &mut enqueued,
                    )
                    .await
                }
            };
            if let Err(error) = result {
                tracing::warn!(schedule = %schedule.name, %error, "schedule round failed; will try again");
            }
            enqueued
        }
    });
    Ok(futures::future::join_all(rounds)
        .await
        .into_iter()
        .flatten()
        .collect())
}

async fn start(store: &dyn Store, schedule: &Schedule, now: i64) -> Result<(), StoreError> {
    if store.schedule_start(&schedule.name, now).await? {
        tracing::info!(
            schedule = %schedule.name,
            next = %schedule.next_after(now).map(crate::store::rfc3339).unwrap_or_default(),
            "new schedule: its first job is at its next tick"
        );
    }
    Ok(())
}

async fn record(
    store: &dyn Store,
    schedule: &Schedule,
    steps: Vec<plan::Step>,
    max_attempts: u32,
    enqueued: &mut Vec<(String, i64, crate::store::JobId)>,
) -> Result<(), StoreError> {
    for step in steps {
        let job = step
            .enqueue
            .then(|| schedule.job(step.tick_ms, max_attempts));
        let tick = crate::store::rfc3339(step.tick_ms);
        match store
            .schedule_tick(crate::store::ScheduleTick {
                name: schedule.name.clone(),
                tick_ms: step.tick_ms,
                job,
            })
            .await?
        {
            Ticked::Enqueued(job) => {
                tracing::info!(schedule = %schedule.name, %tick, job = job.id.0, "schedule tick enqueued");
                metrics::schedule_tick(&schedule.name, "enqueued");
                enqueued.push((schedule.name.clone(), step.tick_ms, job.id));
            }
            Ticked::Passed => {
                tracing::info!(schedule = %schedule.name, %tick, policy = schedule.missed.as_str(), "missed schedule ticks skipped");
                metrics::schedule_tick(&schedule.name, "skipped");
            }
            // Another node is at this tick or past it; it records the
            // rest of this round's ticks too (or the next round does).
            Ticked::Stale => break,
        }
    }
    Ok(())
}

/// Runs [`tick_once`] every [`interval`]`(poll_interval)` until `stop`.
///
/// `tokio::spawn(run(store, schedules, poll_interval, 10, stop));`
pub async fn run(
    store: std::sync::Arc<dyn Store>,
    schedules: Vec<Schedule>,
    poll_interval: Duration,
    max_attempts: u32,
    stop: tokio_util::sync::CancellationToken,
) {
    let every = interval(poll_interval);
    let grace = grace(every);
    // A loop per schedule: one schedule's long catch-up (up to
    // `catch_up_limit` transactions) never delays another's next tick.
    let loops = schedules.into_iter().map(|schedule| {
        let (store, stop) = (store.clone(), stop.clone());
        async move {
            crate::queue::maintenance::every("schedules", every, stop, || {
                let (store, schedule) = (store.clone(), schedule.clone());
                async move {
                    tick_once(
                        &*store,
                        std::slice::from_ref(&schedule),
                        grace,
                        max_attempts,
                    )
                    .await
                    .map(|_| ())
                }
            })
            .await
        }
    });
    futures::future::join_all(loops).await;
}
