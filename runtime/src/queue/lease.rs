//! The lease keeper: one task extends the leases of every job this worker
//! holds (running or waiting in the claim-ahead buffer), in one batched
//! write per round, and stops a job whose lease was lost.
//!
//! A job that finishes before a third of its lease has passed costs no
//! heartbeat at all. A held job is extended once a third of its lease has
//! passed since the claim or the last extension; the keeper looks every
//! sixth of the shortest lease, so the first extension always comes between
//! a third and a half of the claim-time lease, well before it can lapse,
//! whatever the plugin's own lease.

use crate::store::{Fence, JobChange, JobFence, JobId, Store, StoreError, Write, Written};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Shortest pause between rounds.
const MIN_TICK: Duration = Duration::from_millis(10);

struct Held {
    fence: JobFence,
    /// The lease the next extension asks for (the plugin's).
    lease: Duration,
    /// The lease the job holds now (the claim's, then the plugin's).
    current: Duration,
    extended_at: Instant,
    lost: CancellationToken,
    /// The attempt's outcome is being committed: at shutdown it is left to
    /// its lease instead of given back (a release first would fence the
    /// outcome out and run the job again).
    recording: bool,
    /// A handler started the attempt: its heartbeats record the start, so
    /// a rescue charges the attempt (one never started gets it back).
    started: bool,
}

/// The leases this worker holds.
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn idem::store::Store>, job: idem::store::Job) {
/// use idem::queue::lease::LeaseKeeper;
/// use std::time::Duration;
/// let keeper = LeaseKeeper::new(Duration::from_secs(30));
/// let lost = tokio_util::sync::CancellationToken::new();
/// keeper.hold(&job, Duration::from_secs(30), lost.clone());
/// // ... run the job; `lost` is cancelled if another worker took it ...
/// keeper.release(job.id);
/// # }
/// ```
pub struct LeaseKeeper {
    held: Mutex<HashMap<JobId, Held>>,
    tick: Mutex<Duration>,
}

impl LeaseKeeper {
    /// A keeper for jobs claimed with `claim_lease`.
    pub fn new(claim_lease: Duration) -> Self {
        LeaseKeeper {
            held: Mutex::new(HashMap::new()),
            tick: Mutex::new((claim_lease / 6).max(MIN_TICK)),
        }
    }

    /// Holds `job` (claimed with `claimed_with`, extended to the same until
    /// [`LeaseKeeper::set_lease`] says otherwise); `lost` is cancelled when
    /// the lease is lost.
    pub fn hold(&self, job: &crate::store::Job, claimed_with: Duration, lost: CancellationToken) {
        let lease = claimed_with;
        let mut tick = self.tick.lock().unwrap_or_else(|p| p.into_inner());
        *tick = (*tick).min((claimed_with.min(lease) / 6).max(MIN_TICK));
        drop(tick);
        self.held.lock().unwrap_or_else(|p| p.into_inner()).insert(
            job.id,
            Held {
                fence: job.fence(),
                lease,
                current: claimed_with,
                extended_at: Instant::now(),
                lost,
                recording: false,
                started: false,
            },
        );
    }

    /// Changes the lease a held job is extended to (its plugin is known).
    pub fn set_lease(&self, id: JobId, lease: Duration) {
        if let Some(held) = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&id)
        {
            held.lease = lease;
        }
    }

    /// Marks this attempt's outcome as being committed (see
    /// [`LeaseKeeper::drain`]); it stays held, its lease extended.
    pub fn recording(&self, fence: &JobFence) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = held.get_mut(&fence.id).filter(|h| h.fence == *fence) {
            h.recording = true;
        }
    }

    /// Marks this attempt as started (its plugin call begins): the job's
    /// next heartbeat records the start with the lease extension, so a
    /// job that ends before its first heartbeat costs no write for it.
    pub fn started(&self, fence: &JobFence) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = held.get_mut(&fence.id).filter(|h| h.fence == *fence) {
            h.started = true;
        }
    }

    /// Stops holding a job (finished, or its lease given back).
    pub fn release(&self, id: JobId) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }

    /// Stops holding this attempt of a job; a newer claim of the same job
    /// (the job was retried and claimed again meanwhile) stays held.
    pub fn release_fence(&self, fence: &JobFence) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.get(&fence.id).is_some_and(|h| h.fence == *fence) {
            held.remove(&fence.id);
        }
    }

    /// This attempt's hold on its job, let go when dropped (see [`Hold`]).
    ///
    /// `let hold = keeper.hold_until_dropped(job.fence(), idle.clone());`
    pub fn hold_until_dropped(
        self: &Arc<Self>,
        fence: JobFence,
        idle: Arc<tokio::sync::Notify>,
    ) -> Hold {
        Hold {
            keeper: self.clone(),
            fence,
            idle,
        }
    }

    /// Stops holding every job; returns the fences of those whose outcome
    /// is not being committed, to give them back (the others are left to
    /// their lease).
    pub fn drain(&self) -> Vec<JobFence> {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .filter(|(_, held)| !held.recording)
            .map(|(_, held)| held.fence)
            .collect()
    }

    /// Jobs held now.
    pub fn len(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no job is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Extends every lease that is a third used; cancels the tokens of
    /// jobs whose lease was lost. Returns how many were extended. Each
    /// extension is its own write (the group commit still flushes them
    /// together), so one the database refuses keeps no other lease from
    /// being extended.
    pub async fn round(&self, store: &dyn Store) -> Result<usize, StoreError> {
        let now = Instant::now();
        let due: Vec<(JobFence, Duration, bool)> = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|h| now.duration_since(h.extended_at) >= h.current / 3)
            .map(|h| (h.fence.clone(), h.lease, h.started))
            .collect();
        if due.is_empty() {
            return Ok(0);
        }
        crate::failpoint::hit(crate::failpoint::Failpoint::InHeartbeat).await?;
        let writes = due
            .iter()
            .map(|(fence, lease, started)| Write::Job {
                fence: fence.clone(),
                change: JobChange::Heartbeat {
                    lease: *lease,
                    started: *started,
                },
            })
            .collect();
        let writes: Vec<Write> = writes;
        let answers = futures::future::join_all(writes.into_iter().map(|w| store.write(w))).await;
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let mut extended = 0;
        let mut failed = None;
        for ((fence, lease, _), answer) in due.into_iter().zip(answers) {
            let Some(h) = held.get_mut(&fence.id) else {
                continue;
            };
            if h.fence != fence {
                continue;
            }
            let answer = match answer {
                Ok(answer) => answer,
                Err(error) => {
                    // Unknown: the lease is tried again next round.
                    tracing::warn!(job_id = %fence.id, %error, "cannot extend a lease this round");
                    failed.get_or_insert(error);
                    continue;
                }
            };
            match answer {
                Written::Job(Fence::Applied) => {
                    h.extended_at = now;
                    h.current = lease;
                    extended += 1;
                }
                _ => {
                    tracing::warn!(job_id = %fence.id, "lease lost while held: stopping the job after its current step");
                    h.lost.cancel();
                    held.remove(&fence.id);
                }
            }
        }
        match failed {
            Some(error) if extended == 0 => Err(error),
            _ => Ok(extended),
        }
    }

    /// Runs rounds until `stop`; a failed round is logged and tried again at
    /// the next tick.
    pub async fn run(&self, store: Arc<dyn Store>, stop: CancellationToken) {
        loop {
            let tick = *self.tick.lock().unwrap_or_else(|p| p.into_inner());
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(tick) => {}
            }
            if let Err(error) = self.round(&*store).await {
                tracing::warn!(%error, "heartbeat round failed; will try again");
            }
        }
    }
}

/// An attempt's hold on its claimed job: the keeper extends the job's lease
/// until the hold is dropped, however the attempt ends (recorded, failed in
/// the store, or a panic), and `idle` is woken once nothing is held.
pub struct Hold {
    keeper: Arc<LeaseKeeper>,
    fence: JobFence,
    idle: Arc<tokio::sync::Notify>,
}

impl Hold {
    /// The attempt starts (see [`LeaseKeeper::started`]).
    pub fn started(&self) {
        self.keeper.started(&self.fence);
    }

    /// The attempt's outcome is being committed (see [`LeaseKeeper::recording`]).
    pub fn recording(&self) {
        self.keeper.recording(&self.fence);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        // Only this attempt: the job may be claimed again already.
        self.keeper.release_fence(&self.fence);
        if self.keeper.is_empty() {
            self.idle.notify_one();
        }
    }
}
