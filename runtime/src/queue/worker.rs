//! The worker loop: claim → run the plugin (or reuse the stored plan) →
//! execute the effects → record the outcome, with heartbeats while a job
//! runs and a graceful shutdown that gives leases back.

use super::backoff::Backoff;
use super::maintenance;
use super::outcome::{self, Attempt, Policy};
use super::stats::{StatsSnapshot, WorkerStats};
use crate::config::{Config, RetentionConfig};
use crate::effects::Effect;
use crate::effects::executor::{Executor, PlanOutcome};
use crate::failure::Failure;
use crate::metrics;
use crate::plugins::{LoadedPlugin, PluginRegistry};
use crate::providers::Providers;
use crate::sandbox::JobInput;
use crate::store::{ClaimParams, Fence, HeartbeatParams, Job, Store, StoreError};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Settings of one worker process.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    /// This worker's id (lease owner).
    pub id: String,
    /// Queues served, with jobs run at once per queue by this process.
    pub queues: BTreeMap<String, u32>,
    /// Global per-queue limits across nodes.
    pub queue_limits: BTreeMap<String, u32>,
    /// Poll interval when no notification arrives.
    pub poll_interval: Duration,
    /// Default lease.
    pub lease: Duration,
    /// Grace period at shutdown.
    pub shutdown_grace: Duration,
    /// Default attempts.
    pub max_attempts: u32,
    /// Default backoff.
    pub backoff: Backoff,
    /// Redact dead payloads.
    pub redact_dead_payloads: bool,
    /// Retention.
    pub retention: RetentionConfig,
    /// Exit once nothing is runnable, running or retrying.
    pub exit_when_drained: bool,
}

impl WorkerSettings {
    /// Settings from the configuration, with a fresh worker id.
    pub fn from_config(config: &Config) -> Self {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "idem".into());
        WorkerSettings {
            id: format!(
                "{host}-{}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ),
            queues: config.worker.queues.clone(),
            queue_limits: config.worker.queue_limits.clone(),
            poll_interval: config.worker.poll_interval,
            lease: config.worker.lease,
            shutdown_grace: config.worker.shutdown_grace,
            max_attempts: config.worker.max_attempts,
            backoff: Backoff {
                base: config.worker.backoff_base,
                max: config.worker.backoff_max,
            },
            redact_dead_payloads: config.worker.redact_dead_payloads,
            retention: config.retention.clone(),
            exit_when_drained: false,
        }
    }
}

/// A worker process: serves its queues until stopped (or drained).
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn idem::store::Store>, registry: std::sync::Arc<idem::plugins::PluginRegistry>) {
/// use idem::queue::{Worker, WorkerSettings};
/// let settings = WorkerSettings::from_config(&idem::config::Config::default());
/// let worker = Worker::new(store, registry, idem::providers::Providers::default(), settings);
/// let summary = worker.run(tokio_util::sync::CancellationToken::new()).await;
/// # }
/// ```
pub struct Worker {
    store: Arc<dyn Store>,
    registry: Arc<PluginRegistry>,
    settings: WorkerSettings,
    executor: Arc<Executor>,
    stats: Arc<WorkerStats>,
}

impl Worker {
    /// A worker over a store, a plugin registry and providers.
    pub fn new(
        store: Arc<dyn Store>,
        registry: Arc<PluginRegistry>,
        providers: Providers,
        settings: WorkerSettings,
    ) -> Arc<Self> {
        let stats = Arc::new(WorkerStats::default());
        let executor = Arc::new(Executor {
            store: store.clone(),
            providers,
            worker: settings.id.clone(),
            effect_lease: settings.lease,
            child_max_attempts: settings.max_attempts,
            stats: stats.clone(),
        });
        Arc::new(Worker {
            store,
            registry,
            settings,
            executor,
            stats,
        })
    }

    /// The worker's counters.
    pub fn stats(&self) -> &Arc<WorkerStats> {
        &self.stats
    }

    /// Serves until `shutdown` is cancelled (or, with `exit_when_drained`,
    /// until no job is runnable, running or retrying). On shutdown it stops
    /// claiming, lets running jobs finish for `shutdown_grace`, then gives
    /// the remaining leases back.
    pub async fn run(
        self: Arc<Self>,
        shutdown: CancellationToken,
    ) -> Result<StatsSnapshot, StoreError> {
        let background = CancellationToken::new();
        let services = maintenance::spawn_all(
            self.store.clone(),
            self.stats.clone(),
            (self.settings.lease / 2).clamp(Duration::from_millis(50), Duration::from_secs(30)),
            self.settings.retention.clone(),
            self.settings.queues.keys().cloned().collect(),
            self.settings.redact_dead_payloads,
            background.clone(),
        );
        let slots: Vec<(String, Arc<Semaphore>)> = self
            .settings
            .queues
            .iter()
            .map(|(q, n)| (q.clone(), Arc::new(Semaphore::new(*n as usize))))
            .collect();
        let abort_jobs = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let mut store_errors = 0u32;
        let mut claims = 0u64;
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            let mut claimed = 0usize;
            for (queue, slots) in &slots {
                let free = slots.available_permits();
                if free == 0 {
                    continue;
                }
                let jobs = match self
                    .store
                    .job_claim(ClaimParams {
                        queue: queue.clone(),
                        worker: claim_owner(&self.settings.id, &mut claims),
                        limit: free as u32,
                        lease: self.settings.lease,
                        queue_concurrency: self.settings.queue_limits.get(queue).copied(),
                    })
                    .await
                {
                    Ok(jobs) => {
                        store_errors = 0;
                        jobs
                    }
                    Err(error) => {
                        store_errors += 1;
                        tracing::error!(%error, queue, "claim failed; retrying after a pause");
                        let pause = self.settings.poll_interval * store_errors.min(10);
                        tokio::select! {
                            _ = shutdown.cancelled() => {}
                            _ = tokio::time::sleep(pause) => {}
                        }
                        continue;
                    }
                };
                for job in jobs {
                    let Ok(permit) = slots.clone().try_acquire_owned() else {
                        // Cannot happen (we claimed at most `free`); give it back.
                        let _ = self.store.job_release(&job.fence()).await;
                        continue;
                    };
                    claimed += 1;
                    WorkerStats::bump(&self.stats.claimed);
                    let worker = self.clone();
                    let abort = abort_jobs.clone();
                    tasks.spawn(async move {
                        worker.process(job, abort).await;
                        drop(permit);
                    });
                }
            }
            while tasks.try_join_next().is_some() {}
            if claimed > 0 {
                continue;
            }
            if self.settings.exit_when_drained && tasks.is_empty() {
                match self.served_queues_drained().await {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(error) => {
                        tracing::error!(%error, "cannot check whether the queue is drained")
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = self.store.wait_for_jobs(self.settings.poll_interval) => {}
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
        if !tasks.is_empty() {
            tracing::info!(running = tasks.len(), grace = ?self.settings.shutdown_grace, "stopping: letting running jobs finish");
            let finished = tokio::time::timeout(self.settings.shutdown_grace, async {
                while tasks.join_next().await.is_some() {}
            })
            .await;
            if finished.is_err() {
                tracing::warn!(
                    running = tasks.len(),
                    "grace period over: giving leases back"
                );
                abort_jobs.cancel();
                // Jobs now stop between effects; a provider call in flight
                // must still be able to answer and be recorded.
                let in_flight_bound =
                    self.executor.providers.max_timeout() + Duration::from_secs(5);
                let _ = tokio::time::timeout(Duration::from_secs(10).max(in_flight_bound), async {
                    while tasks.join_next().await.is_some() {}
                })
                .await;
                tasks.abort_all();
            }
        }
        background.cancel();
        for service in services {
            let _ = service.await;
        }
        Ok(self.stats.snapshot())
    }

    /// True when none of the queues this worker serves has a job runnable
    /// now, running or retrying (other queues cannot hold it; jobs a producer
    /// scheduled for later do not either).
    async fn served_queues_drained(&self) -> Result<bool, StoreError> {
        for queue in self.settings.queues.keys() {
            let stats = self.store.queue_stats(Some(queue)).await?;
            if stats.ready > 0
                || stats.count(crate::store::JobState::Running) > 0
                || stats.count(crate::store::JobState::Retrying) > 0
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Runs one claimed job to a recorded outcome; every log line inside
    /// carries the job id, its key and its correlation id.
    async fn process(self: Arc<Self>, job: Job, abort: CancellationToken) {
        let span = tracing::info_span!("job", job_id = %job.id, plugin = %job.plugin, correlation_id = %job.correlation_id,
            key = job.idempotency_key.as_deref().unwrap_or(""), attempt = job.attempt);
        self.process_in_span(job, abort).instrument(span).await
    }

    async fn process_in_span(self: Arc<Self>, job: Job, abort: CancellationToken) {
        let started = Instant::now();
        let waited = Duration::from_millis(
            (chrono::Utc::now().timestamp_millis() - job.run_at_ms).max(0) as u64,
        );
        metrics::job_claimed(&job.queue, &job.plugin, waited);
        let plugin = self.registry.get(&job.plugin);
        let lease = self.lease_for(plugin.as_deref());
        let backoff = self.backoff_for(plugin.as_deref());
        // One token stops the attempt between steps: shutdown (via `abort`)
        // or a lost lease (cancelled by the heartbeat). A provider call in
        // flight always finishes, so its answer is recorded under the key.
        let stop = abort.child_token();
        let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat(
            self.store.clone(),
            job.clone(),
            lease,
            self.settings.lease,
            stop.clone(),
        )));
        let attempt = self.attempt(&job, plugin, &stop).await;
        let attempt = match attempt {
            Ok(attempt) => attempt,
            Err(error) => {
                tracing::error!(%error, "store failed during the job; its lease will expire and it will be redelivered");
                return;
            }
        };
        let label = match &attempt {
            Attempt::Succeeded => "succeeded",
            Attempt::Failed(_) => "failed",
            Attempt::Deferred { .. } => "deferred",
            Attempt::Interrupted => "interrupted",
        };
        let policy = Policy {
            backoff,
            redact_dead_payloads: self.settings.redact_dead_payloads,
        };
        if let Err(error) = outcome::record(&*self.store, &self.stats, &job, attempt, policy).await
        {
            tracing::error!(%error, "cannot record the outcome; the lease will expire and the job will be redelivered");
        }
        metrics::job_finished(&job.plugin, label, started.elapsed());
    }

    /// The plugin's lease, never shorter than twice its deadline, so a
    /// deadline always ends an attempt before its lease can expire.
    fn lease_for(&self, plugin: Option<&LoadedPlugin>) -> Duration {
        let Some(plugin) = plugin else {
            return self.settings.lease;
        };
        let lease = plugin.manifest.lease.unwrap_or(self.settings.lease);
        lease.max(plugin.compiled.limits.deadline * 2)
    }

    /// The plugin's backoff (from the same version the attempt runs with).
    fn backoff_for(&self, plugin: Option<&LoadedPlugin>) -> Backoff {
        let manifest = plugin.map(|p| &p.manifest);
        Backoff {
            base: manifest
                .and_then(|m| m.backoff_base)
                .unwrap_or(self.settings.backoff.base),
            max: manifest
                .and_then(|m| m.backoff_max)
                .unwrap_or(self.settings.backoff.max),
        }
    }

    /// One attempt: the stored plan if there is one, else a plugin call
    /// whose checked plan is stored before the first effect runs. Shutdown
    /// (`abort`) interrupts it between steps or during a call.
    async fn attempt(
        &self,
        job: &Job,
        plugin: Option<Arc<LoadedPlugin>>,
        abort: &CancellationToken,
    ) -> Result<Attempt, StoreError> {
        let fence = job.fence();
        let plan: Vec<Effect> = match &job.plan {
            Some(stored) => match serde_json::from_str(stored) {
                Ok(plan) => {
                    tracing::info!(
                        plan_hash = job.plan_hash.as_deref().unwrap_or(""),
                        "redelivery: executing the stored plan"
                    );
                    WorkerStats::bump(&self.stats.plans_reused);
                    plan
                }
                Err(error) => {
                    return Ok(Attempt::Failed(Failure::permanent(
                        "plan_corrupt",
                        format!("the stored plan cannot be read: {error}"),
                    )));
                }
            },
            None => {
                let Some(plugin) = plugin else {
                    return Ok(Attempt::Failed(Failure::retryable(
                        "plugin_not_found",
                        format!("no plugin named {:?} is loaded", job.plugin),
                    )));
                };
                let call = tokio::select! {
                    call = self.call_plugin(job, &plugin) => call,
                    // The call stops at its deadline on its own; its result is dropped.
                    _ = abort.cancelled() => return Ok(Attempt::Interrupted),
                };
                // On success the plan write records the plugin version; a
                // failed call records it on its own for the dead-letter queue.
                if let Err(failure) = &call
                    && failure.code == crate::sandbox::SANDBOX_UNAVAILABLE
                {
                    tracing::warn!(message = %failure.message, "no sandbox instance available: deferring");
                    return Ok(Attempt::Deferred {
                        delay: self.settings.poll_interval,
                        reason: "sandbox_unavailable",
                    });
                }
                let checked = call.and_then(|plan| {
                    self.executor
                        .check_grants(&plan, |p| plugin.manifest.allows(p))
                        .map(|()| plan)
                });
                let plan = match checked {
                    Ok(plan) => plan,
                    Err(failure) => {
                        self.store
                            .job_set_plugin_hash(&fence, &plugin.hash().0)
                            .await?;
                        return Ok(Attempt::Failed(failure));
                    }
                };
                let json = serde_json::to_string(&plan)
                    .map_err(|e| StoreError::Invalid(format!("cannot encode the plan: {e}")))?;
                if self
                    .store
                    .job_save_plan(&fence, &json, &plugin.hash().0)
                    .await?
                    == Fence::FencedOut
                {
                    return Ok(Attempt::Deferred {
                        delay: Duration::ZERO,
                        reason: "fenced_out",
                    });
                }
                // No re-read needed: the job had no plan when we claimed it, and
                // only the holder of this fence can store one.
                plan
            }
        };
        Ok(match self.executor.execute(job, &plan, abort).await {
            PlanOutcome::Done | PlanOutcome::Skipped => Attempt::Succeeded,
            PlanOutcome::Failed(failure) => Attempt::Failed(failure),
            PlanOutcome::Deferred { delay, reason } => Attempt::Deferred { delay, reason },
            PlanOutcome::Store(error) => return Err(error),
            PlanOutcome::Aborted => Attempt::Interrupted,
        })
    }

    async fn call_plugin(
        &self,
        job: &Job,
        plugin: &Arc<LoadedPlugin>,
    ) -> Result<Vec<Effect>, Failure> {
        let input = JobInput {
            id: job.id.0,
            queue: job.queue.clone(),
            payload: job.payload.clone(),
            attempt: job.attempt,
            max_attempts: job.max_attempts,
            idempotency_key: job.idempotency_key.clone(),
            correlation_id: job.correlation_id.clone(),
            enqueued_at_ms: job.created_at_ms,
        };
        WorkerStats::bump(&self.stats.plugin_calls);
        let sandbox = self.registry.sandbox().clone();
        let plugin = plugin.clone();
        tokio::task::spawn_blocking(move || sandbox.run(&plugin.compiled, &input))
            .await
            .unwrap_or_else(|e| {
                Err(Failure::retryable(
                    "plugin_trap",
                    format!("the sandbox thread failed: {e}"),
                ))
            })
    }
}

/// Aborts a spawned task when dropped, so a heartbeat never outlives its
/// job (an aborted or panicked job task would otherwise keep its lease alive).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The lease owner of one claim: the worker id plus a per-claim sequence
/// number. The fence is (job, owner, attempt) and a replay resets attempts, so
/// a task of this very process stuck since before a job died and was replayed
/// must not match the new claim.
fn claim_owner(worker: &str, claims: &mut u64) -> String {
    *claims += 1;
    format!("{worker}#{claims}")
}

/// Extends the lease every third of its length; cancels `lost` when the
/// fence no longer holds.
async fn heartbeat(
    store: Arc<dyn Store>,
    job: Job,
    lease: Duration,
    claimed_with: Duration,
    lost: CancellationToken,
) {
    let fence = job.fence();
    let every = (lease / 3).max(Duration::from_millis(20));
    // The claim set the default lease; a plugin with its own lease gets it at once.
    let mut first = lease != claimed_with;
    loop {
        if !first {
            tokio::time::sleep(every).await;
        }
        first = false;
        match store
            .job_heartbeat(HeartbeatParams {
                fence: fence.clone(),
                lease,
            })
            .await
        {
            Ok(Fence::Applied) => {}
            Ok(Fence::FencedOut) => {
                tracing::warn!("lease lost while running: stopping after the current step");
                lost.cancel();
                return;
            }
            Err(error) => tracing::warn!(%error, "heartbeat failed; will try again"),
        }
    }
}
