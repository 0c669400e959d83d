//! Metric names in one place, recorded through the `metrics` facade and
//! exported for Prometheus by `idem run --metrics-listen ADDR`.
//!
//! Counters: `idem_jobs_claimed_total{queue,plugin}`,
//! `idem_jobs_finished_total{plugin,outcome}` (succeeded, retried, dead, deferred),
//! `idem_job_errors_total{plugin,code,class}`, `idem_jobs_deferred_total{plugin,reason}`, `idem_lease_expiries_total`,
//! `idem_fenced_out_total`, `idem_schedule_ticks_total{schedule,outcome}` (enqueued, skipped),
//! `idem_effects_total{provider,outcome}`
//! (executed, idempotency_hit, failed, deferred), `idem_provider_errors_total{provider,code}`,
//! `idem_effects_reconciled_total{provider,outcome}` (a lookup's answer for a key in
//! doubt: applied, not_applied, too_recent, unavailable, unanswerable).
//! Histograms: `idem_job_wait_seconds` (enqueue to claim), `idem_job_duration_seconds{plugin}`,
//! `idem_provider_call_seconds{provider}`, `idem_job_attempts{plugin}` (at success),
//! `idem_store_batch_writes` (writes per group commit).
//! `idem_job_attempt_outcomes_total{plugin,attempt,outcome}` (attempt 1, 2, 3, 4+;
//! succeeded or failed: the success rate by attempt number).
//! Gauges: `idem_queue_jobs{queue,state}`, `idem_queue_oldest_ready_seconds{queue}`,
//! `idem_idempotency_hit_ratio` (hits over effects settled, since start),
//! `idem_provider_circuit_state{provider}` (0 closed, 1 half open, 2 open),
//! `idem_effect_lease_seconds{provider}` (the key lease a call runs under,
//! next to `idem_provider_call_seconds`).
//! Sources: `idem_source_messages_total{source,outcome}` (received, inserted,
//! duplicate, dead_on_arrival, acked), `idem_source_lag_messages{source}`,
//! `idem_source_reconnects_total{source}`.

use std::time::Duration;

/// A job was claimed.
pub fn job_claimed(queue: &str, plugin: &str, waited: Duration) {
    metrics::counter!("idem_jobs_claimed_total", "queue" => queue.to_string(), "plugin" => plugin.to_string())
        .increment(1);
    metrics::histogram!("idem_job_wait_seconds").record(waited.as_secs_f64());
}

/// A job attempt ended.
pub fn job_finished(plugin: &str, outcome: &'static str, took: Duration) {
    metrics::counter!("idem_jobs_finished_total", "plugin" => plugin.to_string(), "outcome" => outcome)
        .increment(1);
    metrics::histogram!("idem_job_duration_seconds", "plugin" => plugin.to_string())
        .record(took.as_secs_f64());
}

/// A job succeeded after `attempt` attempts.
pub fn job_attempts(plugin: &str, attempt: u32) {
    metrics::histogram!("idem_job_attempts", "plugin" => plugin.to_string()).record(attempt as f64);
}

/// An attempt ended; `attempt` is bucketed 1, 2, 3, 4+.
pub fn attempt_outcome(plugin: &str, attempt: u32, outcome: &'static str) {
    let bucket = match attempt {
        0 | 1 => "1",
        2 => "2",
        3 => "3",
        _ => "4+",
    };
    metrics::counter!("idem_job_attempt_outcomes_total", "plugin" => plugin.to_string(), "attempt" => bucket, "outcome" => outcome)
        .increment(1);
}

/// Idempotency hits over every effect settled so far by this process.
pub fn idempotency_hit_ratio(hits: u64, executed: u64) {
    let settled = hits + executed;
    if settled > 0 {
        metrics::gauge!("idem_idempotency_hit_ratio").set(hits as f64 / settled as f64);
    }
}

/// A provider's circuit: `closed`, `half_open` or `open`.
pub fn circuit_state(provider: &str, state: &str) {
    let value = match state {
        "open" => 2.0,
        "half_open" => 1.0,
        _ => 0.0,
    };
    metrics::gauge!("idem_provider_circuit_state", "provider" => provider.to_string()).set(value);
}

/// The key lease an effect's provider call runs under.
pub fn effect_lease(provider: &str, lease: Duration) {
    metrics::gauge!("idem_effect_lease_seconds", "provider" => provider.to_string())
        .set(lease.as_secs_f64());
}

/// Messages of a source by outcome: received, inserted, duplicate,
/// dead_on_arrival, acked.
pub fn source_messages(source: &str, outcome: &'static str, count: usize) {
    if count > 0 {
        metrics::counter!("idem_source_messages_total", "source" => source.to_string(), "outcome" => outcome)
            .increment(count as u64);
    }
}

/// Messages waiting at the broker for a source.
pub fn source_lag(source: &str, messages: u64) {
    metrics::gauge!("idem_source_lag_messages", "source" => source.to_string())
        .set(messages as f64);
}

/// A source lost its broker and reconnects.
pub fn source_reconnect(source: &str) {
    metrics::counter!("idem_source_reconnects_total", "source" => source.to_string()).increment(1);
}

/// A job was deferred without using an attempt.
pub fn job_deferred(plugin: &str, reason: &'static str) {
    metrics::counter!("idem_jobs_deferred_total", "plugin" => plugin.to_string(), "reason" => reason)
        .increment(1);
}

/// A job attempt failed with a classified error.
pub fn job_error(plugin: &str, code: &str, class: &'static str) {
    metrics::counter!("idem_job_errors_total", "plugin" => plugin.to_string(), "code" => code.to_string(), "class" => class)
        .increment(1);
}

/// Expired leases were rescued.
pub fn lease_expiries(count: u64) {
    metrics::counter!("idem_lease_expiries_total").increment(count);
}

/// This node recorded a schedule's tick: `enqueued` (its job) or `skipped`
/// (a missed tick passed over by policy). Summed over nodes, each tick
/// counts once.
pub fn schedule_tick(schedule: &str, outcome: &'static str) {
    metrics::counter!("idem_schedule_ticks_total", "schedule" => schedule.to_string(), "outcome" => outcome)
        .increment(1);
}

/// A stale write was rejected by the fence.
pub fn fenced_out() {
    metrics::counter!("idem_fenced_out_total").increment(1);
}

/// An effect ended with an outcome.
pub fn effect(provider: &str, outcome: &'static str) {
    metrics::counter!("idem_effects_total", "provider" => provider.to_string(), "outcome" => outcome).increment(1);
}

/// A provider answered (or failed to answer) a lookup for a key in doubt;
/// `outcome` is `applied`, `not_applied`, `too_recent` (not applied, but the
/// try is too young to trust it), `unavailable` or `unanswerable`.
pub fn effect_reconciled(provider: &str, outcome: &'static str) {
    metrics::counter!("idem_effects_reconciled_total", "provider" => provider.to_string(), "outcome" => outcome)
        .increment(1);
}

/// A provider call finished.
pub fn provider_call(provider: &str, took: Duration, error_code: Option<&str>) {
    metrics::histogram!("idem_provider_call_seconds", "provider" => provider.to_string())
        .record(took.as_secs_f64());
    if let Some(code) = error_code {
        metrics::counter!("idem_provider_errors_total", "provider" => provider.to_string(), "code" => code.to_string())
            .increment(1);
    }
}

/// How long a claimed job waited in the claim-ahead buffer before a
/// handler started it: near the lease, jobs expire before they run.
///
/// `idem::metrics::buffer_wait("default", std::time::Duration::from_millis(3));`
pub fn buffer_wait(queue: &str, waited: Duration) {
    metrics::histogram!("idem_job_buffer_wait_seconds", "queue" => queue.to_string())
        .record(waited.as_secs_f64());
}

/// How long an attempt's outcome took from the attempt's end to its commit
/// (queued in the group commit, then written): near the lease, finished
/// jobs are rescued and run again.
///
/// `idem::metrics::outcome_commit(std::time::Duration::from_millis(2));`
pub fn outcome_commit(took: Duration) {
    metrics::histogram!("idem_outcome_commit_seconds").record(took.as_secs_f64());
}

/// The lease a worker claims jobs with: what buffer waits and outcome
/// commits are compared with.
///
/// `idem::metrics::worker_lease(std::time::Duration::from_secs(30));`
pub fn worker_lease(lease: Duration) {
    metrics::gauge!("idem_worker_lease_seconds").set(lease.as_secs_f64());
}

/// Writes queued in the group commit and not yet answered.
///
/// `idem::metrics::store_writes_queued(0);`
pub fn store_writes_queued(writes: usize) {
    metrics::gauge!("idem_store_writes_queued").set(writes as f64);
}

/// The group commit flushed a batch of `writes`.
pub fn store_batch(writes: usize) {
    metrics::histogram!("idem_store_batch_writes").record(writes as f64);
}

/// Queue depth by state.
pub fn queue_depth(queue: &str, state: &'static str, count: i64) {
    metrics::gauge!("idem_queue_jobs", "queue" => queue.to_string(), "state" => state)
        .set(count as f64);
}

/// Age of the oldest runnable job.
pub fn oldest_ready(queue: &str, age: Duration) {
    metrics::gauge!("idem_queue_oldest_ready_seconds", "queue" => queue.to_string())
        .set(age.as_secs_f64());
}

/// Installs the Prometheus recorder for this process and returns its
/// handle (rendered at `/metrics` by the HTTP surface); a task keeps its
/// histograms trimmed. Call once, inside a Tokio runtime.
pub fn install_prometheus() -> Result<metrics_exporter_prometheus::PrometheusHandle, String> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| e.to_string())?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}
