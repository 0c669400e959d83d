//! The worker loop: claim → run the plugin (or reuse the stored plan) →
//! execute the effects → record the outcome, with heartbeats while a job
//! runs and a graceful shutdown that gives leases back.

use super::backoff::Backoff;
use super::executor::{Executor, PlanOutcome, Riders};
use super::fetcher::{self, Claimed, FetchSettings};
use super::lease::{Hold, LeaseKeeper};
use super::maintenance;
use super::outcome::{self, Attempt, DeferReason, Policy, Recorded, Version};
use super::stats::{StatsSnapshot, WorkerStats};
use crate::config::{Config, RetentionConfig};
use crate::effects::Effect;
use crate::failpoint::{self, Failpoint};
use crate::failure::{Code, Failure};
use crate::metrics;
use crate::plugins::{LoadedPlugin, PluginRegistry};
use crate::providers::Providers;
use crate::sandbox::{JobInput, RunError};
use crate::store::group_commit::{GroupCommit, GroupCommitSettings};
use crate::store::{Fence, Job, JobChange, SavePlanParams, Store, StoreError, Write, Written};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
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
    /// Longest run of deferrals before a job is dead-lettered.
    pub max_deferral: Duration,
    /// How often the reconcile sweep runs (zero: never).
    pub reconcile_interval: Duration,
    /// Most dead jobs the sweep replays a second.
    pub reconcile_replay_rate: f64,
    /// Default backoff.
    pub backoff: Backoff,
    /// Redact dead payloads.
    pub redact_dead_payloads: bool,
    /// Retention.
    pub retention: RetentionConfig,
    /// Exit once nothing is runnable, running or retrying.
    pub exit_when_drained: bool,
    /// Jobs claimed ahead per queue, beyond its concurrency, when the queue
    /// runs slowly (at most the concurrency); a fast queue claims further
    /// ahead, up to `max_claim` (see [`fetcher`]).
    pub prefetch: usize,
    /// Most jobs per claim statement, and most jobs claimed ahead.
    pub max_claim: usize,
    /// How writes are grouped into transactions.
    pub group_commit: GroupCommitSettings,
    /// Periodic jobs this worker enqueues when due (every worker runs the
    /// ticker; the store lets one of them enqueue each tick).
    pub schedules: Vec<crate::schedule::Schedule>,
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
            max_deferral: config.worker.max_deferral,
            reconcile_interval: config.worker.reconcile_interval,
            reconcile_replay_rate: config.worker.reconcile_replay_rate,
            backoff: Backoff {
                base: config.worker.backoff_base,
                max: config.worker.backoff_max,
            },
            redact_dead_payloads: config.worker.redact_dead_payloads,
            retention: config.retention.clone(),
            exit_when_drained: false,
            prefetch: config.worker.prefetch,
            max_claim: config.worker.claim_batch,
            group_commit: GroupCommitSettings {
                max_batch: config.worker.commit_batch,
                max_wait: config.worker.commit_wait,
                lanes: config.worker.commit_lanes,
            },
            schedules: config.schedules.clone(),
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
    keeper: Arc<LeaseKeeper>,
    on_start: std::sync::OnceLock<JobHook>,
    /// The store's group commit (also behind `store`): outcomes are handed
    /// to it without a task per job.
    group: Arc<GroupCommit>,
}

/// Called with each job as a handler starts it.
type JobHook = Box<dyn Fn(&Job) + Send + Sync>;

impl Worker {
    /// A worker over a store (its writes grouped into transactions), a
    /// plugin registry and providers.
    pub fn new(
        store: Arc<dyn Store>,
        registry: Arc<PluginRegistry>,
        providers: Providers,
        settings: WorkerSettings,
    ) -> Arc<Self> {
        let group = GroupCommit::new(store, settings.group_commit);
        let store: Arc<dyn Store> = group.clone();
        let stats = Arc::new(WorkerStats::default());
        let executor = Arc::new(Executor {
            store: store.clone(),
            providers,
            worker: settings.id.clone(),
            effect_lease: settings.lease,
            child_max_attempts: settings.max_attempts,
            registry: Some(registry.clone()),
            stats: stats.clone(),
        });
        Arc::new(Worker {
            store,
            registry,
            keeper: Arc::new(LeaseKeeper::new(settings.lease)),
            on_start: std::sync::OnceLock::new(),
            group,
            settings,
            executor,
            stats,
        })
    }

    /// Circuit states, key leases and the idempotency hit ratio, as gauges
    /// (off the hot path: each is a function of configuration or a counter).
    fn publish_gauges(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        for provider in self.executor.providers.iter() {
            metrics::circuit_state(&provider.name, provider.guard.circuit());
            metrics::effect_lease(&provider.name, self.executor.key_lease(provider));
        }
        metrics::idempotency_hit_ratio(
            self.stats.idempotency_hits.load(Relaxed),
            self.stats.effects_executed.load(Relaxed),
        );
        metrics::store_writes_queued(self.group.queued());
        metrics::worker_lease(self.settings.lease);
    }

    /// The worker's counters.
    pub fn stats(&self) -> &Arc<WorkerStats> {
        &self.stats
    }

    /// Calls `hook` with each job as a handler starts it (before the plugin
    /// runs): how `idem bench` measures pickup latency. Set once; `false`
    /// if a hook was set before.
    pub fn on_job_start(&self, hook: impl Fn(&Job) + Send + Sync + 'static) -> bool {
        self.on_start.set(Box::new(hook)).is_ok()
    }

    /// Serves until `shutdown` is cancelled (or, with `exit_when_drained`,
    /// until no job is runnable, running or retrying). On shutdown it stops
    /// claiming, gives buffered jobs back at once, lets running jobs finish
    /// for `shutdown_grace`, then stops them between effects and gives their
    /// leases back.
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
        let reconciling = self.spawn_reconcile(background.clone());
        let ticking = (!self.settings.schedules.is_empty()).then(|| {
            tokio::spawn(crate::schedule::ticker::run(
                self.store.clone(),
                self.settings.schedules.clone(),
                self.settings.poll_interval,
                self.settings.max_attempts,
                background.clone(),
            ))
        });
        let keeping = {
            let (keeper, store, stop) =
                (self.keeper.clone(), self.store.clone(), background.clone());
            tokio::spawn(async move { keeper.run(store, stop).await })
        };
        let gauges = {
            let (me, stop) = (self.clone(), background.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(5));
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tick.tick() => me.publish_gauges(),
                    }
                }
            })
        };
        // `stop_claiming` ends the fetchers; `abort_jobs` stops running jobs
        // between effects once the grace period is over.
        let stop_claiming = CancellationToken::new();
        let abort_jobs = CancellationToken::new();
        let idle = Arc::new(tokio::sync::Notify::new());
        // Outcomes being committed: a handler goes on to its next job while
        // the group commit writes the last one's outcome.
        let recording = TaskTracker::new();
        let mut fetchers = JoinSet::new();
        let mut handlers = JoinSet::new();
        for (queue, concurrency) in &self.settings.queues {
            let concurrency = *concurrency as usize;
            // A slow queue holds at most its concurrency ahead; a fast one
            // up to a claim's size (the fetcher follows the queue's pace).
            let prefetch = self.settings.prefetch.min(concurrency.max(1));
            let max_prefetch = if prefetch == 0 {
                0
            } else {
                self.settings.max_claim.max(prefetch)
            };
            let (sender, buffer) = async_channel::bounded(concurrency + max_prefetch);
            fetchers.spawn(fetcher::run(
                self.store.clone(),
                FetchSettings {
                    queue: queue.clone(),
                    worker: self.settings.id.clone(),
                    concurrency,
                    prefetch,
                    max_prefetch,
                    max_claim: self.settings.max_claim,
                    lease: self.settings.lease,
                    queue_limit: self.settings.queue_limits.get(queue).copied(),
                    poll_interval: self.settings.poll_interval,
                    attempts: fetcher::Attempts {
                        registry: Some(self.registry.clone()),
                        default: self.settings.max_attempts,
                    },
                },
                self.group.clone(),
                self.keeper.clone(),
                sender,
                stop_claiming.clone(),
                abort_jobs.clone(),
            ));
            for _ in 0..concurrency {
                handlers.spawn(self.clone().handle(
                    buffer.clone(),
                    stop_claiming.clone(),
                    idle.clone(),
                    recording.clone(),
                ));
            }
        }
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = idle.notified() => {}
                _ = tokio::time::sleep(self.settings.poll_interval) => {}
            }
            if self.settings.exit_when_drained && self.keeper.is_empty() {
                match self.served_queues_drained().await {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(error) => {
                        tracing::error!(%error, "cannot check whether the queue is drained")
                    }
                }
            }
        }
        stop_claiming.cancel();
        while fetchers.join_next().await.is_some() {}
        let running = self.keeper.len();
        if running > 0 {
            tracing::info!(running, grace = ?self.settings.shutdown_grace, "stopping: letting running jobs finish");
        }
        let finished = tokio::time::timeout(self.settings.shutdown_grace, async {
            while handlers.join_next().await.is_some() {}
        })
        .await;
        if finished.is_err() {
            tracing::warn!(
                running = self.keeper.len(),
                "grace period over: giving leases back"
            );
            abort_jobs.cancel();
            // Jobs now stop between effects; a provider call in flight must
            // still be able to answer and be recorded.
            let in_flight_bound = self.executor.providers.max_timeout() + Duration::from_secs(5);
            let _ = tokio::time::timeout(Duration::from_secs(10).max(in_flight_bound), async {
                while handlers.join_next().await.is_some() {}
            })
            .await;
            handlers.abort_all();
            // An aborted handler may still be finishing a poll that starts
            // a recording: wait until none can.
            while handlers.join_next().await.is_some() {}
        }
        // Outcomes still being committed land before any lease is given back
        // (a release first would fence the outcome out and run the job again).
        recording.close();
        if tokio::time::timeout(Duration::from_secs(30), async {
            recording.wait().await;
            // Every write queued so far (an aborted handler's plan, a last
            // heartbeat) is answered before any lease is given back.
            self.group.flushed().await;
        })
        .await
        .is_err()
        {
            tracing::warn!("outcomes still not committed after 30 s: their leases will expire");
        }
        // Whatever is still held (a claim the handlers never saw, a job
        // stopped between effects) goes back; a job whose outcome is still
        // being written is left to its lease, so the release cannot fence
        // the outcome out.
        let _ = failpoint::hit(Failpoint::BeforeRelease).await;
        for fence in self.keeper.drain() {
            let _ = self.store.job_release(&fence).await;
        }
        background.cancel();
        let _ = keeping.await;
        let _ = gauges.await;
        for service in services.into_iter().chain(reconciling).chain(ticking) {
            let _ = service.await;
        }
        Ok(self.stats.snapshot())
    }

    /// The periodic reconcile sweep, when some provider offers a lookup
    /// and the interval is not zero.
    fn spawn_reconcile(&self, stop: CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        let interval = self.settings.reconcile_interval;
        let askable = self
            .executor
            .providers
            .iter()
            .any(|p| p.provider.lookup_policy().is_some());
        if interval.is_zero() || !askable {
            return None;
        }
        let pacer = match crate::ops::replay::Pacer::per_second(self.settings.reconcile_replay_rate)
        {
            Ok(pacer) => Arc::new(pacer),
            Err(why) => {
                tracing::warn!(%why, "reconcile_replay_rate: the reconcile sweep does not run");
                return None;
            }
        };
        let (store, providers) = (self.store.clone(), self.executor.providers.clone());
        let request = super::reconcile::ReconcileRequest {
            plugin: None,
            dry_run: false,
            limit: super::reconcile::SWEEP_BATCH,
        };
        Some(tokio::spawn(maintenance::every(
            "reconcile",
            interval,
            stop,
            move || {
                let (store, providers, pacer, request) = (
                    store.clone(),
                    providers.clone(),
                    pacer.clone(),
                    request.clone(),
                );
                async move {
                    super::reconcile::reconcile_once(&*store, &providers, &request, &pacer)
                        .await
                        .map(|_| ())
                }
            },
        )))
    }

    /// One handler: runs jobs from its queue's buffer one after the other.
    /// After `stop_claiming`, buffered jobs are given back unstarted.
    async fn handle(
        self: Arc<Self>,
        buffer: async_channel::Receiver<Claimed>,
        stop_claiming: CancellationToken,
        idle: Arc<tokio::sync::Notify>,
        recording: TaskTracker,
    ) {
        while let Ok(claimed) = buffer.recv().await {
            let id = claimed.job.id;
            if stop_claiming.is_cancelled() {
                let fence = claimed.job.fence();
                let _ = failpoint::hit(Failpoint::BeforeRelease).await;
                self.keeper.release_fence(&fence);
                if let Err(error) = self.store.job_release(&fence).await {
                    tracing::warn!(%error, job_id = %id, "cannot give a buffered job back; its lease will expire");
                }
                if self.keeper.is_empty() {
                    idle.notify_one();
                }
            } else {
                WorkerStats::bump(&self.stats.claimed);
                let Claimed {
                    job,
                    slot,
                    stop,
                    claimed_at,
                } = claimed;
                metrics::buffer_wait(&job.queue, claimed_at.elapsed());
                // The slot goes back as the job starts: holding it until the
                // outcome committed made the commit's latency part of every
                // job's time in the buffer (0.62x drain, docs/benchmarks.md).
                // The back-pressure is the fetcher's bound on queued writes.
                drop(slot);
                let span = job_span(&job);
                let hold = self.keeper.hold_until_dropped(job.fence(), idle.clone());
                let outcome = self.process(job, stop, hold).instrument(span.clone()).await;
                // The job stays held (its lease extended) until its outcome
                // committed; claims wait while too many writes are queued
                // (see `fetcher::run`). Without an outcome (the store
                // failed) the hold is gone: the lease expires and the job
                // is delivered again.
                if let Some(outcome) = outcome {
                    let _entered = span.enter();
                    self.record_later(outcome, span.clone(), &recording);
                }
            }
            // A job held until its outcome committed wakes `idle` when its
            // hold is dropped.
        }
    }

    /// Hands the outcome's write to the group commit and goes on; its
    /// answer is counted, and the job let go, by [`Worker::recorded`].
    fn record_later(
        self: &Arc<Self>,
        outcome: Outcome,
        span: tracing::Span,
        recording: &TaskTracker,
    ) {
        let Some((write, recorded)) = outcome.write.clone() else {
            // Nothing to record for the job (the lease was lost, or the
            // store failed); an effect carried out is still marked.
            return self.clone().riders_alone(outcome, recording, span);
        };
        outcome.hold.recording();
        let (me, recording, token) = (self.clone(), recording.clone(), recording.token());
        let ended = Instant::now();
        let mut writes = outcome.riders.writes().to_vec();
        writes.push(write);
        self.group.write_all_then(writes, move |answers| {
            metrics::outcome_commit(ended.elapsed());
            let _entered = span.enter();
            let answer = me.job_answer(&outcome, answers);
            me.recorded(outcome, recorded, answer, &recording, span.clone());
            drop(token);
        });
    }

    /// The job's own answer among an outcome's unit (its last write), once
    /// the riders' answers before it are counted.
    fn job_answer(
        &self,
        outcome: &Outcome,
        answers: Result<Vec<crate::store::Written>, StoreError>,
    ) -> Result<crate::store::Written, StoreError> {
        let mut answers = answers?;
        let answer = answers
            .pop()
            .ok_or_else(|| StoreError::Corrupt("an outcome was not answered".into()))?;
        self.executor
            .settle_riders(outcome.riders.writes(), &answers);
        Ok(answer)
    }

    /// An outcome's write answered: counted, then the job is let go; a
    /// plan of child jobs whose keys were used before goes the long way,
    /// and a write that failed transiently is tried again, in a task of
    /// their own.
    fn recorded(
        self: Arc<Self>,
        outcome: Outcome,
        recorded: Recorded,
        answer: Result<crate::store::Written, StoreError>,
        recording: &TaskTracker,
        span: tracing::Span,
    ) {
        match answer {
            Ok(written) => {
                if let Some(outcome) = self.settled(outcome, recorded, written) {
                    recording.spawn(self.go_the_long_way(outcome).instrument(span));
                }
            }
            Err(error) if error.is_transient() => {
                recording.spawn(self.record_again(outcome, recorded, error).instrument(span));
            }
            Err(error) => {
                tracing::error!(%error, "cannot record the outcome; the lease will expire and the job will be redelivered");
                self.riders_alone(outcome, recording, span);
            }
        }
    }

    /// No job write carries the riders (none was decided, or the outcome's
    /// unit was refused): the job is left to its lease, but an effect
    /// carried out is still marked, on its own, in a recording task.
    fn riders_alone(
        self: Arc<Self>,
        mut outcome: Outcome,
        recording: &TaskTracker,
        span: tracing::Span,
    ) {
        if outcome.riders.is_empty() {
            return self.let_go(outcome);
        }
        outcome.hold.recording();
        recording.spawn(
            async move {
                self.write_riders_of(&mut outcome).await;
                self.let_go(outcome);
            }
            .instrument(span),
        );
    }

    /// Writes an outcome's riders on their own (see [`Worker::riders_alone`]).
    async fn write_riders_of(&self, outcome: &mut Outcome) {
        let riders = std::mem::take(&mut outcome.riders);
        if let Err(error) = self.executor.write_riders(riders).await {
            tracing::error!(%error, "cannot mark an effect carried out; its key will be in doubt when its lease ends");
        }
    }

    /// Writes an outcome again after a transient failure (as
    /// [`outcome::record`] does), then goes on as [`Worker::recorded`].
    async fn record_again(
        self: Arc<Self>,
        mut outcome: Outcome,
        recorded: Recorded,
        error: StoreError,
    ) {
        tracing::warn!(%error, "transient store error recording the outcome; trying again");
        let Some((write, _)) = &outcome.write else {
            return self.let_go(outcome);
        };
        let mut writes = outcome.riders.writes().to_vec();
        writes.push(write.clone());
        let answers = outcome
            .riders
            .retry(|| self.store.write_batch(writes.clone()))
            .await;
        let written = self.job_answer(&outcome, answers);
        match written {
            Ok(written) => {
                if let Some(outcome) = self.settled(outcome, recorded, written) {
                    self.go_the_long_way(outcome).await;
                }
            }
            Err(error) => {
                tracing::error!(%error, "cannot record the outcome; the lease will expire and the job will be redelivered");
                self.write_riders_of(&mut outcome).await;
                self.let_go(outcome);
            }
        }
    }

    /// Counts what an outcome's write did, then lets the job go; returns
    /// the outcome instead when its plan of child jobs found a key used
    /// before and must go the long way.
    fn settled(
        &self,
        outcome: Outcome,
        recorded: Recorded,
        written: crate::store::Written,
    ) -> Option<Outcome> {
        let recorded = outcome::settle(&self.stats, &outcome.job, recorded, written);
        if recorded == Recorded::KeysTaken && outcome.long_way.is_some() {
            return Some(outcome);
        }
        self.let_go(outcome);
        None
    }

    /// Carries out a plan of child jobs whose one-write finish found a key
    /// used before, effect by effect (see [`Worker::the_long_way`]).
    async fn go_the_long_way(self: Arc<Self>, mut outcome: Outcome) {
        if let Some((plan, hash)) = outcome.long_way.take() {
            outcome.label = self
                .the_long_way(&outcome.job, plan, hash, outcome.policy, &outcome.stop)
                .await;
        }
        self.let_go(outcome);
    }

    /// The attempt is over: counted, and its hold on the job let go.
    fn let_go(&self, outcome: Outcome) {
        if outcome.job.group.is_some() {
            // The next job of its group may be claimable now, and no
            // insert announces it.
            self.store.wake_claimers();
        }
        metrics::job_finished(
            &outcome.job.plugin,
            outcome.label,
            outcome.started.elapsed(),
        );
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

    /// Runs one claimed job's attempt and returns its outcome, to be
    /// recorded while the handler goes on (`None`: the store failed, the
    /// lease will expire).
    async fn process(
        self: &Arc<Self>,
        job: Job,
        stop: CancellationToken,
        hold: Hold,
    ) -> Option<Outcome> {
        if let Some(hook) = self.on_start.get() {
            hook(&job);
        }
        hold.started();
        let started = Instant::now();
        let waited = Duration::from_millis(
            (chrono::Utc::now().timestamp_millis() - job.run_at_ms).max(0) as u64,
        );
        metrics::job_claimed(&job.queue, &job.plugin, waited);
        let plugin = self.registry.get(&job.plugin);
        let lease = self.lease_for(plugin.as_deref());
        let backoff = self.backoff_for(plugin.as_deref());
        // `stop` ends the attempt between steps: shutdown after the grace
        // period, or a lost lease (the lease keeper cancels it). A provider
        // call in flight always finishes, so its answer is recorded.
        if lease != self.settings.lease {
            self.keeper.set_lease(job.id, lease);
        }
        let mut riders = Riders::default();
        let attempt = self.attempt(&job, plugin, &stop, &mut riders).await;
        WorkerStats::timed(&self.stats.attempt_us, started);
        let policy = Policy {
            backoff,
            redact_dead_payloads: self.settings.redact_dead_payloads,
            max_deferral: self.settings.max_deferral,
        };
        let (attempt, version) = match attempt {
            Ok(attempt) => attempt,
            Err(error) => {
                tracing::error!(%error, "store failed during the job; its lease will expire and it will be redelivered");
                if riders.is_empty() {
                    return None;
                }
                // Nothing to record for the job, but an effect carried out
                // must still be marked: the riders go on their own.
                return Some(Outcome {
                    job,
                    write: None,
                    riders,
                    label: "store_failed",
                    started,
                    policy,
                    long_way: None,
                    stop,
                    hold,
                });
            }
        };
        let label = attempt.label();
        // A plan of child jobs whose keys were used before is carried out
        // effect by effect after all.
        let long_way = match (&version.children, &version.plan, &version.plugin_hash) {
            (Some(_), Some(plan), Some(hash)) => Some((plan.clone(), hash.clone())),
            _ => None,
        };
        let write = match attempt {
            Attempt::SucceededAndRecorded(written) => {
                outcome::recorded_with_last_effect(&self.stats, &job, written);
                None
            }
            attempt => outcome::decide(&job, attempt, policy, version),
        };
        Some(Outcome {
            job,
            write,
            riders,
            label,
            started,
            policy,
            long_way,
            stop,
            hold,
        })
    }

    /// Carries out a fresh plan of child jobs effect by effect, once its
    /// one-write finish found a key used before: the plan is stored, each
    /// effect goes through the ledger (a key done before is skipped), and
    /// the outcome is recorded. Returns the outcome's label.
    async fn the_long_way(
        &self,
        job: &Job,
        plan: String,
        plugin_hash: String,
        policy: Policy,
        stop: &CancellationToken,
    ) -> &'static str {
        let attempt = async {
            let effects: Vec<Effect> = serde_json::from_str(&plan)
                .map_err(|e| StoreError::Invalid(format!("cannot read the plan back: {e}")))?;
            if !self.store_plan(job, plan, plugin_hash).await? {
                return Ok(Attempt::LeaseLost);
            }
            let mut riders = Riders::default();
            let outcome = self
                .executor
                .execute(job, &effects, stop, &mut riders)
                .await;
            // The slow path: what rides is written before the outcome.
            self.executor.write_riders(riders).await?;
            attempt_of(outcome)
        }
        .await;
        let attempt = match attempt {
            Ok(attempt) => attempt,
            Err(error) => {
                tracing::error!(%error, "store failed during the job; its lease will expire and it will be redelivered");
                return "store_failed";
            }
        };
        let label = attempt.label();
        if let Err(error) = outcome::record(
            &*self.store,
            &self.stats,
            job,
            attempt,
            policy,
            Version::default(),
        )
        .await
        {
            tracing::error!(%error, "cannot record the outcome; the lease will expire and the job will be redelivered");
        }
        label
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
    /// (`abort`) interrupts it between steps or during a call. Returns the
    /// plugin version to record with the outcome when no plan write recorded
    /// it.
    async fn attempt(
        &self,
        job: &Job,
        plugin: Option<Arc<LoadedPlugin>>,
        abort: &CancellationToken,
        riders: &mut Riders,
    ) -> Result<(Attempt, Version), StoreError> {
        let plan: Vec<Effect> = match &job.plan {
            Some(stored) => match serde_json::from_str(stored) {
                Ok(plan) => {
                    tracing::info!(
                        plan_hash = job.plan_hash.as_deref().unwrap_or(""),
                        "redelivery: executing the stored plan"
                    );
                    WorkerStats::bump(&self.stats.plans_reused);
                    // Effects run only on an attempt recorded as started,
                    // as a fresh plan's save records it: a crash during a
                    // stored plan's provider call charges its attempt.
                    let lease = self.lease_for(plugin.as_deref());
                    if !self.record_start(job, lease).await? {
                        return Ok((Attempt::LeaseLost, Version::default()));
                    }
                    plan
                }
                Err(error) => {
                    return Ok((
                        Attempt::Failed(Failure::host(
                            Code::PlanCorrupt,
                            format!("the stored plan cannot be read: {error}"),
                        )),
                        Version::default(),
                    ));
                }
            },
            None => {
                let Some(plugin) = plugin else {
                    return Ok((
                        Attempt::Failed(Failure::host(
                            Code::PluginNotFound,
                            format!("no plugin named {:?} is loaded", job.plugin),
                        )),
                        Version::default(),
                    ));
                };
                let ran = Version {
                    plugin_hash: Some(plugin.hash().0.clone()),
                    ..Version::default()
                };
                let call = tokio::select! {
                    call = self.call_plugin(job, &plugin) => call,
                    // The call stops at its deadline on its own; its result is dropped.
                    _ = abort.cancelled() => return Ok((Attempt::Interrupted, Version::default())),
                };
                let plan = match call {
                    Ok(plan) => plan,
                    Err(RunError::Unavailable(why)) => {
                        tracing::warn!(%why, "no sandbox instance available: deferring");
                        return Ok((
                            Attempt::Deferred {
                                delay: self.settings.poll_interval,
                                reason: DeferReason::SandboxUnavailable,
                            },
                            Version::default(),
                        ));
                    }
                    // The outcome records the plugin version for the dead-letter queue.
                    Err(RunError::Plugin(failure)) => return Ok((Attempt::Failed(failure), ran)),
                };
                if let Err(failure) = self
                    .executor
                    .check_grants(&plan, |e| plugin.grants.check(e).map_err(Failure::from))
                {
                    return Ok((Attempt::Failed(failure), ran));
                }
                // Keys live in the emitting plugin's namespace from here on:
                // in the ledger, at the provider and as child-job keys.
                let plan = crate::effects::scope_plan(&job.plugin, plan);
                // The plugin's name is part of every key now: a name the
                // key rules refuse fails the job here, classified, instead
                // of failing every ledger claim after the plan is stored.
                if let Some(bad) = plan
                    .iter()
                    .find(|e| crate::store::check_key(&e.idempotency_key).is_err())
                {
                    return Ok((
                        Attempt::Failed(Failure::host(
                            Code::InvalidIdempotencyKey,
                            format!(
                                "the key {:?} (the plugin's name and its key) is not a valid idempotency key: at most 128 + 255 printable ASCII bytes",
                                bad.idempotency_key
                            ),
                        )),
                        ran,
                    ));
                }
                failpoint::hit(Failpoint::AfterPluginCall).await?;
                if plan.is_empty() {
                    // Nothing to carry out: the success is the only write,
                    // and it keeps the (empty) plan.
                    return Ok((
                        Attempt::Succeeded,
                        Version {
                            plan: Some("[]".into()),
                            ..ran
                        },
                    ));
                }
                let json = serde_json::to_string(&plan)
                    .map_err(|e| StoreError::Invalid(format!("cannot encode the plan: {e}")))?;
                if let Some(children) = self.executor.children_only(job, &plan) {
                    // No provider to call: the success write carries the
                    // plan out (or says it must go the long way).
                    return Ok((
                        Attempt::Succeeded,
                        Version {
                            plan: Some(json),
                            children: Some(children),
                            ..ran
                        },
                    ));
                }
                // The plan is stored in the transaction of its first
                // ledger claim (one durable commit before the first call),
                // or with the outcome when no effect claims a key. No
                // re-read needed: the job had no plan when we claimed it,
                // and only the holder of this fence can store one.
                *riders = Riders::plan(job.fence(), json, plugin.hash().0.clone());
                plan
            }
        };
        // A last statement on the store's own database commits the job's
        // success with it: the job is done in that one commit.
        riders.finish_with(outcome::success_after_plan(job));
        let attempt = attempt_of(self.executor.execute(job, &plan, abort, riders).await)?;
        Ok((attempt, Version::default()))
    }

    /// Stores a fresh plan, durable before its first effect runs; `false`
    /// when the attempt no longer holds the job.
    /// Records that this attempt started, before a stored plan's first
    /// effect (a fresh plan's save records it with the plan). Cheap where
    /// it happens: only redeliveries run stored plans. `false`: the lease
    /// was lost.
    async fn record_start(&self, job: &Job, lease: Duration) -> Result<bool, StoreError> {
        let start = || {
            self.store.write(Write::Job {
                fence: job.fence(),
                change: JobChange::Heartbeat {
                    lease,
                    started: true,
                },
            })
        };
        let waited = Instant::now();
        let written = crate::store::retry_transient(start).await;
        WorkerStats::timed(&self.stats.store_wait_us, waited);
        Ok(written? == Written::Job(Fence::Applied))
    }

    async fn store_plan(
        &self,
        job: &Job,
        plan: String,
        plugin_hash: String,
    ) -> Result<bool, StoreError> {
        // Saving a plan again after a transient failure (a deadlock with
        // another transaction, a dropped connection) keeps the first plan.
        let params = SavePlanParams {
            fence: job.fence(),
            plan,
            plugin_hash,
        };
        let waited = Instant::now();
        let saved =
            crate::store::retry_transient(|| self.store.job_save_plan(params.clone())).await;
        WorkerStats::timed(&self.stats.store_wait_us, waited);
        let saved = saved?;
        if saved == Fence::FencedOut {
            return Ok(false);
        }
        failpoint::hit(Failpoint::AfterPlanStored).await?;
        Ok(true)
    }

    async fn call_plugin(
        &self,
        job: &Job,
        plugin: &Arc<LoadedPlugin>,
    ) -> Result<Vec<Effect>, RunError> {
        let input = JobInput {
            id: job.id.0,
            queue: job.queue.clone(),
            payload: job.payload.clone(),
            attempt: job.attempt,
            max_attempts: job.attempts_allowed(),
            idempotency_key: job.idempotency_key.clone(),
            correlation_id: job.correlation_id.clone(),
            enqueued_at_ms: job.created_at_ms,
        };
        WorkerStats::bump(&self.stats.plugin_calls);
        let started = Instant::now();
        // On this task: the call yields to the worker at every epoch tick.
        let plan = self.registry.sandbox().call(&plugin.compiled, &input).await;
        WorkerStats::timed(&self.stats.plugin_call_us, started);
        plan
    }
}

/// An attempt that ran, with the write that records it.
struct Outcome {
    job: Job,
    /// What to write, and what it records (`None`: nothing, the lease was
    /// lost).
    write: Option<(crate::store::Write, Recorded)>,
    /// Written in the same transaction, before `write` (or on their own
    /// when there is none): a plan never stored by a claim, the last
    /// effect's ledger success.
    riders: Riders,
    /// The outcome's name in metrics.
    label: &'static str,
    started: Instant,
    policy: Policy,
    /// A fresh plan of child jobs and its plugin hash, carried out effect
    /// by effect if its one-write finish finds a key used before.
    long_way: Option<(String, String)>,
    stop: CancellationToken,
    /// The job is held, its lease extended, until the outcome is dropped.
    hold: Hold,
}

/// The span of one job: every log line of its attempt and of its recording
/// carries its id, its key and its correlation id.
fn job_span(job: &Job) -> tracing::Span {
    tracing::info_span!("job", job_id = %job.id, plugin = %job.plugin, correlation_id = %job.correlation_id,
        key = job.idempotency_key.as_deref().unwrap_or(""), attempt = job.attempt)
}

/// The attempt a plan's execution makes.
fn attempt_of(outcome: PlanOutcome) -> Result<Attempt, StoreError> {
    Ok(match outcome {
        PlanOutcome::Done | PlanOutcome::Skipped => Attempt::Succeeded,
        PlanOutcome::Recorded(written) => Attempt::SucceededAndRecorded(written),
        PlanOutcome::Failed(failure) => Attempt::Failed(failure),
        PlanOutcome::Deferred { delay, reason } => Attempt::Deferred { delay, reason },
        PlanOutcome::Store(error) => return Err(error),
        PlanOutcome::Aborted => Attempt::Interrupted,
        PlanOutcome::LeaseLost => Attempt::LeaseLost,
        PlanOutcome::OlderRelease(key) => {
            return Err(StoreError::Corrupt(format!(
                "an older release's key {key:?} was not followed"
            )));
        }
    })
}
