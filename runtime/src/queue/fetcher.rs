//! Claim ahead: one fetcher per queue keeps a buffer of claimed jobs and
//! refills it in batches, so handlers never wait for a claim and a claim
//! is one statement for many jobs.
//!
//! How far ahead follows the queue's pace: about [`AHEAD`] of the jobs its
//! handlers finish, at least `prefetch` (at most the concurrency: a slow
//! queue holds no more than one round of jobs ahead, as other nodes could
//! run them) and at most `max_prefetch`. The buffer is refilled when half of
//! it is used, so the handlers still have work while the claim is in flight.
//! A job holds a slot from its claim until its handler takes it, so at most
//! `concurrency + max_prefetch` jobs wait or run at once; claims also wait
//! while more than two claims' worth of writes are queued for the group
//! commit (back-pressure: outcomes cannot pile up past their leases behind
//! a store that falls behind). The lease keeper
//! holds every claimed job from the moment of its claim, so a buffered
//! job's lease is extended like a running one's.

use super::lease::LeaseKeeper;
use crate::plugins::PluginRegistry;
use crate::store::{AttemptDefaults, ClaimParams, Job, Store};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// How much of a fast queue's work is claimed ahead of its handlers.
pub const AHEAD: Duration = Duration::from_millis(50);

/// A claimed job with the slot it holds until it is finished.
pub struct Claimed {
    /// The job.
    pub job: Job,
    /// Its slot in the fetcher's buffer, given back when a handler takes
    /// the job.
    pub slot: OwnedSemaphorePermit,
    /// When it was claimed (its wait in the buffer is a metric).
    pub claimed_at: Instant,
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
    /// Jobs run at once (the handlers).
    pub concurrency: usize,
    /// Jobs held ahead of the handlers while the queue runs slowly.
    pub prefetch: usize,
    /// Most jobs held ahead of the handlers when it runs fast.
    pub max_prefetch: usize,
    /// Most jobs per claim statement.
    pub max_claim: usize,
    /// Lease of a claim.
    pub lease: Duration,
    /// Queue-wide concurrency limit across nodes.
    pub queue_limit: Option<u32>,
    /// Look for jobs at least this often without a notification.
    pub poll_interval: Duration,
    /// Attempts of jobs enqueued without them, resolved at their claim.
    pub attempts: Attempts,
}

/// Where a claim learns the attempts of jobs enqueued without them (a SQL
/// producer's `max_attempts => NULL`): the plugin's operator file, as loaded
/// now (the registry reloads), else the worker's `max_attempts`.
#[derive(Clone)]
pub struct Attempts {
    /// The loaded plugins (`None`: the default for every plugin).
    pub registry: Option<Arc<PluginRegistry>>,
    /// The worker's `max_attempts`.
    pub default: u32,
}

impl Attempts {
    /// The numbers for a claim now.
    ///
    /// ```
    /// let attempts = idem::queue::fetcher::Attempts { registry: None, default: 5 };
    /// assert_eq!(attempts.defaults().default, 5);
    /// ```
    pub fn defaults(&self) -> AttemptDefaults {
        AttemptDefaults {
            by_plugin: self
                .registry
                .iter()
                .flat_map(|registry| registry.list())
                .filter_map(|plugin| {
                    plugin
                        .manifest
                        .max_attempts
                        .map(|n| (plugin.name().to_string(), n))
                })
                .collect(),
            default: self.default,
        }
    }
}

impl std::fmt::Debug for Attempts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attempts")
            .field("registry", &self.registry.as_ref().map(|r| r.dir()))
            .field("default", &self.default)
            .finish()
    }
}

/// The queue's pace: jobs its handlers finish per second, smoothed, and
/// the buffer it calls for. The buffer grows at most twofold per claim
/// and shrinks at once, so a burst of fast claims cannot hoard a backlog.
///
/// ```
/// use idem::queue::fetcher::Pace;
/// use std::time::Duration;
/// let mut pace = Pace::new(8, 512);
/// assert_eq!(pace.ahead(), 8);
/// for _ in 0..20 {
///     pace.finished(200, Duration::from_millis(10)); // 20,000 jobs/s
///     pace.ahead();
/// }
/// assert_eq!(pace.ahead(), 512);
/// // The jobs turn slow: one sample over a long span is enough.
/// pace.finished(4, Duration::from_secs(10));
/// assert_eq!(pace.ahead(), 8);
/// ```
#[derive(Debug, Clone)]
pub struct Pace {
    per_second: f64,
    current: usize,
    floor: usize,
    ceiling: usize,
    window_jobs: usize,
    window: Duration,
}

/// The shortest span a pace sample is taken over.
const SAMPLE_SPAN: Duration = Duration::from_millis(10);

impl Pace {
    /// A pace that starts slow: `floor` ahead, at most `ceiling`.
    pub fn new(floor: usize, ceiling: usize) -> Self {
        Pace {
            per_second: 0.0,
            current: floor,
            floor,
            ceiling: ceiling.max(floor),
            window_jobs: 0,
            window: Duration::ZERO,
        }
    }

    /// The handlers finished `jobs` (gave their slots back) `over` this span.
    pub fn finished(&mut self, jobs: usize, over: Duration) {
        self.window_jobs += jobs;
        self.window += over;
        if self.window >= SAMPLE_SPAN {
            let sample = self.window_jobs as f64 / self.window.as_secs_f64();
            // Weighted by the span: a sample over minutes (a queue whose
            // jobs turned slow) replaces a rate learnt over milliseconds.
            let spans = self.window.as_secs_f64() / SAMPLE_SPAN.as_secs_f64();
            let weight = 1.0 - 0.7f64.powf(spans);
            self.per_second += weight * (sample - self.per_second);
            self.window_jobs = 0;
            self.window = Duration::ZERO;
        }
    }

    /// Jobs to hold ahead of the handlers for the next claim.
    pub fn ahead(&mut self) -> usize {
        let wanted = (self.per_second * AHEAD.as_secs_f64()) as usize;
        self.current = wanted
            .min(self.current.max(1).saturating_mul(2))
            .clamp(self.floor, self.ceiling);
        self.current
    }
}

/// Claims jobs into `buffer` until `stop`; returns when stopped (the
/// buffer's sender is dropped then, so handlers see the end). Each job's
/// stop token is a child of `abort`.
pub async fn run(
    store: Arc<dyn Store>,
    settings: FetchSettings,
    outcomes: Arc<crate::store::group_commit::GroupCommit>,
    keeper: Arc<LeaseKeeper>,
    buffer: async_channel::Sender<Claimed>,
    stop: CancellationToken,
    abort: CancellationToken,
) {
    let floor = settings.prefetch;
    let ceiling = settings.max_prefetch.max(floor);
    let total = settings.concurrency + ceiling;
    let slots = Arc::new(Semaphore::new(total));
    let max_claim = settings.max_claim.max(1);
    let mut pace = Pace::new(floor, ceiling);
    // Jobs held once the last claim's jobs joined, and when that claim
    // began: the slots given back since are the jobs the handlers finished
    // (during the claim's round trip too).
    let (mut held_expected, mut cycle_start) = (0usize, Instant::now());
    let mut claims = 0u64;
    let mut errors = 0u32;
    // Back-pressure: while more writes wait for the group commit than a
    // few claims bring, claims wait, so finished jobs' outcomes (and the
    // leases they hold) cannot pile up behind a store that falls behind.
    let bound = 2 * max_claim;
    loop {
        while outcomes.queued() > bound {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(1)) => {}
            }
        }
        // Claim once half of the wanted buffer is used: the other half keeps
        // the handlers busy while the claim runs, and a busy queue claims
        // many jobs per statement instead of one per finished job.
        let ahead = pace.ahead();
        let half = ahead.div_ceil(2).max(1);
        let need = total - (settings.concurrency + ahead - half);
        let mut batch = tokio::select! {
            _ = stop.cancelled() => return,
            permits = slots.clone().acquire_many_owned(u32::try_from(need).unwrap_or(u32::MAX)) => match permits {
                Ok(permits) => permits,
                Err(_) => return,
            },
        };
        // Held now: at most `concurrency + ahead - half`; fill up to
        // `concurrency + ahead`.
        let free = need + slots.available_permits();
        let held = total - free;
        pace.finished(held_expected.saturating_sub(held), cycle_start.elapsed());
        cycle_start = Instant::now();
        held_expected = held;
        let want = (free + ahead).saturating_sub(ceiling).clamp(1, max_claim);
        if want > need {
            if let Ok(more) = slots
                .clone()
                .try_acquire_many_owned(u32::try_from(want - need).unwrap_or(0))
            {
                batch.merge(more);
            }
        } else if let Some(kept) = batch.split(want) {
            // The slots not claimed for go back at once.
            batch = kept;
        }
        let mut permits = Vec::with_capacity(batch.num_permits());
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
                max_attempts: settings.attempts.defaults(),
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
        let claimed_at = Instant::now();
        tracing::debug!(queue = %settings.queue, ahead, asked, got, "claimed");
        for (job, slot) in jobs.into_iter().zip(permits.drain(..)) {
            let job_stop = abort.child_token();
            keeper.hold(&job, settings.lease, job_stop.clone());
            if buffer
                .send(Claimed {
                    job,
                    slot,
                    claimed_at,
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
        held_expected += got;
        if got < asked {
            // The queue is empty for now: wait for a wake-up or the poll.
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = store.wait_for_jobs(settings.poll_interval) => {}
            }
        }
    }
}
