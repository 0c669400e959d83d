//! Claim ahead: one fetcher per queue keeps a small buffer of claimed jobs
//! and refills it in batches, so handlers never wait for a claim and a claim
//! is one statement for many jobs.
//!
//! The buffer is bounded by slots: a job holds a slot from its claim until
//! it is finished, so at most `concurrency + prefetch` jobs are held at once
//! and a job waits in the buffer for at most about one job's run time. The
//! lease keeper holds every claimed job from the moment of its claim, so a
//! buffered job's lease is extended like a running one's.

use super::lease::LeaseKeeper;
use crate::store::{ClaimParams, Job, Store};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

/// A claimed job with the slot it holds until it is finished.
pub struct Claimed {
    /// The job.
    pub job: Job,
    /// Its slot in the fetcher's buffer.
    pub slot: OwnedSemaphorePermit,
    /// Stops the job between steps: cancelled when the lease keeper finds
    /// the lease lost, or at shutdown once the grace period is over.
    pub stop: CancellationToken,
}

/// Settings of one queue's fetcher.
#[derive(Debug, Clone)]
pub struct FetchSettings {
    /// The queue.
    pub queue: String,
    /// This worker's id; each claim's lease owner is `id#n`.
    pub worker: String,
    /// Jobs held at once: running plus buffered.
    pub slots: usize,
    /// Jobs run at once (the handlers); `slots - concurrency` is the
    /// prefetch.
    pub concurrency: usize,
    /// Most jobs per claim statement.
    pub max_claim: usize,
    /// Lease of a claim.
    pub lease: Duration,
    /// Queue-wide concurrency limit across nodes.
    pub queue_limit: Option<u32>,
    /// Look for jobs at least this often without a notification.
    pub poll_interval: Duration,
}

/// Claims jobs into `buffer` until `stop`; returns when stopped (the
/// buffer's sender is dropped then, so handlers see the end). Each job's
/// stop token is a child of `abort`.
pub async fn run(
    store: Arc<dyn Store>,
    settings: FetchSettings,
    keeper: Arc<LeaseKeeper>,
    buffer: mpsc::Sender<Claimed>,
    stop: CancellationToken,
    abort: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(settings.slots.max(1)));
    let worth = claim_threshold(&settings);
    let mut claims = 0u64;
    let mut errors = 0u32;
    loop {
        // Wait until a claim is worth a statement: as many slots free as
        // the prefetch (the handlers are then still busy, so none waits),
        // and a busy queue claims many jobs per statement instead of one
        // per finished job.
        let mut batch = tokio::select! {
            _ = stop.cancelled() => return,
            permits = slots.clone().acquire_many_owned(worth) => match permits {
                Ok(permits) => permits,
                Err(_) => return,
            },
        };
        let mut permits = Vec::with_capacity(settings.max_claim.max(1));
        while batch.num_permits() > 1 {
            if let Some(one) = batch.split(1) {
                permits.push(one);
            }
        }
        permits.push(batch);
        claims += 1;
        let asked = permits.len();
        let claimed = store
            .job_claim(ClaimParams {
                queue: settings.queue.clone(),
                worker: format!("{}#{claims}", settings.worker),
                limit: u32::try_from(asked).unwrap_or(u32::MAX),
                lease: settings.lease,
                queue_concurrency: settings.queue_limit,
            })
            .await;
        let jobs = match claimed {
            Ok(jobs) => {
                errors = 0;
                jobs
            }
            Err(error) => {
                errors += 1;
                tracing::error!(%error, queue = %settings.queue, "claim failed; retrying after a pause");
                drop(permits);
                let pause = settings.poll_interval * errors.min(10);
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
                continue;
            }
        };
        let got = jobs.len();
        for (job, slot) in jobs.into_iter().zip(permits.drain(..)) {
            let job_stop = abort.child_token();
            keeper.hold(&job, settings.lease, job_stop.clone());
            if buffer
                .send(Claimed {
                    job,
                    slot,
                    stop: job_stop,
                })
                .await
                .is_err()
            {
                // The handlers are gone (shutdown): the rest of this claim is
                // released by the worker from the keeper.
                return;
            }
        }
        drop(permits);
        if got < asked {
            // The queue is empty for now: wait for a wake-up or the poll.
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = store.wait_for_jobs(settings.poll_interval) => {}
            }
        }
    }
}

/// Free slots that make a claim worth its statement: the prefetch (at least
/// one, at most a claim's size). Claiming only then never starves a
/// handler, since the jobs still held keep every handler busy.
fn claim_threshold(settings: &FetchSettings) -> u32 {
    let prefetch = settings.slots.saturating_sub(settings.concurrency);
    let worth = prefetch.clamp(1, settings.max_claim.max(1));
    u32::try_from(worth).unwrap_or(1)
}
