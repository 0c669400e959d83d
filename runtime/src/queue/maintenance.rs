//! Background services: the rescuer returns jobs whose lease expired, the
//! pruner deletes finished jobs past retention, the gauge loop publishes
//! queue depth. Each has a batched `run_once` that tests call directly.

use super::stats::WorkerStats;
use crate::metrics;
use crate::store::{EffectPruneParams, JobState, PruneParams, Store, StoreError};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Rows handled per round.
pub const BATCH: u32 = 500;

/// Rescues expired leases once; returns how many jobs were rescued. Jobs
/// that had no attempt left are dead-lettered by the rescue; with
/// `redact_dead` their payloads are redacted as the worker's would be.
pub async fn rescue_once(
    store: &dyn Store,
    stats: &WorkerStats,
    redact_dead: bool,
) -> Result<u64, StoreError> {
    let mut total = 0;
    loop {
        let rescued = store.job_rescue_expired(BATCH).await?;
        if !rescued.is_empty() {
            tracing::warn!(jobs = ?rescued, "leases expired: jobs returned for redelivery");
            if redact_dead {
                store.job_redact_payloads(&rescued).await?;
            }
        }
        total += rescued.len() as u64;
        if (rescued.len() as u32) < BATCH {
            break;
        }
    }
    if total > 0 {
        stats
            .rescued
            .fetch_add(total, std::sync::atomic::Ordering::Relaxed);
        metrics::lease_expiries(total);
    }
    Ok(total)
}

/// Prunes finished jobs, old effect-ledger rows and expired dashboard
/// sessions once; returns rows deleted.
pub async fn prune_once(
    store: &dyn Store,
    retention: &crate::config::RetentionConfig,
) -> Result<u64, StoreError> {
    let mut total = 0;
    loop {
        let deleted = store
            .job_delete_finished(PruneParams {
                succeeded_older_than: retention.succeeded,
                dead_older_than: retention.dead,
                limit: BATCH,
            })
            .await?;
        total += deleted;
        if deleted < BATCH as u64 {
            break;
        }
    }
    loop {
        let deleted = store
            .effect_delete_finished(EffectPruneParams {
                older_than: retention.effects,
                limit: BATCH,
            })
            .await?;
        total += deleted;
        if deleted < BATCH as u64 {
            break;
        }
    }
    loop {
        let deleted = store.session_delete_expired(BATCH).await?;
        total += deleted;
        if deleted < BATCH as u64 {
            break;
        }
    }
    Ok(total)
}

/// Publishes queue gauges once.
pub async fn gauges_once(store: &dyn Store, queues: &[String]) -> Result<(), StoreError> {
    for queue in queues {
        let stats = store.queue_stats(Some(queue)).await?;
        for state in JobState::ALL {
            metrics::queue_depth(queue, state.as_str(), stats.count(state));
        }
        metrics::oldest_ready(
            queue,
            Duration::from_millis(stats.oldest_ready_age_ms.unwrap_or(0).max(0) as u64),
        );
    }
    Ok(())
}

/// Runs `round` every `every` until cancelled; errors are logged, never fatal.
pub async fn every<F, Fut>(
    name: &'static str,
    every: Duration,
    stop: CancellationToken,
    mut round: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    loop {
        if let Err(error) = round().await {
            tracing::warn!(service = name, %error, "background round failed; will try again");
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// Spawns rescuer, pruner and gauges.
pub fn spawn_all(
    store: Arc<dyn Store>,
    stats: Arc<WorkerStats>,
    rescue_every: Duration,
    retention: crate::config::RetentionConfig,
    queues: Vec<String>,
    redact_dead: bool,
    stop: CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    let (s1, s2, s3) = (store.clone(), store.clone(), store);
    vec![
        tokio::spawn(every("rescuer", rescue_every, stop.clone(), move || {
            let (store, stats) = (s1.clone(), stats.clone());
            async move { rescue_once(&*store, &stats, redact_dead).await.map(|_| ()) }
        })),
        tokio::spawn(every(
            "pruner",
            retention.interval,
            stop.clone(),
            move || {
                let store = s2.clone();
                let retention = retention.clone();
                async move {
                    let deleted = prune_once(&*store, &retention).await?;
                    if deleted > 0 {
                        tracing::info!(deleted, "pruned finished jobs past retention");
                    }
                    Ok(())
                }
            },
        )),
        tokio::spawn(every("gauges", Duration::from_secs(5), stop, move || {
            let store = s3.clone();
            let queues = queues.clone();
            async move { gauges_once(&*store, &queues).await }
        })),
    ]
}
