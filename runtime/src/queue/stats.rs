//! In-process counters of one worker (also exported as metrics), printed as
//! the run summary.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};

/// What one worker process did.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Jobs claimed.
    pub claimed: AtomicU64,
    /// Jobs finished successfully.
    pub succeeded: AtomicU64,
    /// Attempts that failed and were scheduled again.
    pub retried: AtomicU64,
    /// Jobs moved to the dead-letter queue.
    pub dead: AtomicU64,
    /// Jobs deferred without using an attempt (effect leased elsewhere, circuit open).
    pub deferred: AtomicU64,
    /// Plugin calls made.
    pub plugin_calls: AtomicU64,
    /// Redeliveries that reused a stored plan instead of calling the plugin.
    pub plans_reused: AtomicU64,
    /// Effects carried out by a provider call (or child enqueue).
    pub effects_executed: AtomicU64,
    /// Effects skipped because their key had already succeeded.
    pub idempotency_hits: AtomicU64,
    /// Effect calls that failed.
    pub effects_failed: AtomicU64,
    /// Writes rejected because the lease was lost.
    pub fenced_out: AtomicU64,
    /// Expired leases rescued by this process.
    pub rescued: AtomicU64,
    /// Plans of child jobs finished in one write with their job.
    pub finished_in_one_write: AtomicU64,
    /// Time in attempts (a handler's time per job, its outcome's commit
    /// not included: the handler does not wait for it), µs.
    pub attempt_us: AtomicU64,
    /// Of it, in the plugin call (fresh instance and call), µs.
    pub plugin_call_us: AtomicU64,
    /// Of it, waiting for the store (plans, ledger claims, start marks,
    /// effect failures, children enqueued one by one), µs.
    pub store_wait_us: AtomicU64,
    /// Of it, in provider calls, µs.
    pub provider_call_us: AtomicU64,
}

/// A snapshot of [`WorkerStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StatsSnapshot {
    /// Jobs claimed.
    pub claimed: u64,
    /// Jobs finished successfully.
    pub succeeded: u64,
    /// Attempts scheduled again.
    pub retried: u64,
    /// Jobs dead-lettered.
    pub dead: u64,
    /// Jobs deferred.
    pub deferred: u64,
    /// Plugin calls.
    pub plugin_calls: u64,
    /// Stored plans reused.
    pub plans_reused: u64,
    /// Effects carried out.
    pub effects_executed: u64,
    /// Idempotency hits.
    pub idempotency_hits: u64,
    /// Effect calls failed.
    pub effects_failed: u64,
    /// Fenced-out writes.
    pub fenced_out: u64,
    /// Leases rescued.
    pub rescued: u64,
    /// Plans of child jobs finished in one write with their job.
    pub finished_in_one_write: u64,
    /// Time in attempts, µs (see [`WorkerStats::attempt_us`]).
    pub attempt_us: u64,
    /// Of it, in plugin calls, µs.
    pub plugin_call_us: u64,
    /// Of it, waiting for the store, µs.
    pub store_wait_us: u64,
    /// Of it, in provider calls, µs.
    pub provider_call_us: u64,
}

impl WorkerStats {
    /// Adds one to a counter.
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds the time since `since` to a µs counter.
    ///
    /// `WorkerStats::timed(&stats.store_wait_us, started);`
    pub fn timed(counter: &AtomicU64, since: std::time::Instant) {
        let us = u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX);
        counter.fetch_add(us, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            claimed: get(&self.claimed),
            succeeded: get(&self.succeeded),
            retried: get(&self.retried),
            dead: get(&self.dead),
            deferred: get(&self.deferred),
            plugin_calls: get(&self.plugin_calls),
            plans_reused: get(&self.plans_reused),
            effects_executed: get(&self.effects_executed),
            idempotency_hits: get(&self.idempotency_hits),
            effects_failed: get(&self.effects_failed),
            fenced_out: get(&self.fenced_out),
            rescued: get(&self.rescued),
            finished_in_one_write: get(&self.finished_in_one_write),
            attempt_us: get(&self.attempt_us),
            plugin_call_us: get(&self.plugin_call_us),
            store_wait_us: get(&self.store_wait_us),
            provider_call_us: get(&self.provider_call_us),
        }
    }
}
