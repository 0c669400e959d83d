//! The store contract: one interface, one implementation written once
//! ([`SqlStore`]) over two dialects (SQLite, PostgreSQL), one conformance
//! suite (`tests/conformance/`, run for each backend by `tests/store_sqlite.rs`
//! and `tests/store_postgres.rs`).
//!
//! Methods read noun-verb-qualifier and take one params struct each (as
//! River's driver interface does). Every write that finishes or reschedules a
//! job or an effect is fenced by lease owner **and** attempt and answers
//! [`Fence::FencedOut`] when a stale worker tries it. Writes travel as
//! [`Write`] values; [`Store::write_batch`] commits many in one transaction,
//! which is how the group commit ([`group_commit`]) makes the hot path cheap.
//! Times are milliseconds since the Unix epoch, taken from the database
//! clock, so many nodes agree.
//!
//! # Layout
//! - this module: the [`Store`] trait and `connect`.
//! - `model`: ids, rows, params and writes.
//! - `queries`: every statement, written once.
//! - `sql`: [`SqlStore`], the logic, written once.
//! - `dialect`: what differs per database; [`sqlite`] and [`postgres`] hold
//!   one dialect each, with connecting and wake-ups.
//! - [`group_commit`]: the batching writer in front of a store.
//! - `statement`: operator-declared statements of `sql` effects (binding,
//!   result reference, error classes).
//! - `input`, `rows`: input checks and row decoding.
//! - `upgrade`: one-time rewrites of stored rows a migration asks for.
//!
//! Schemas live in `migrations/sqlite` and `migrations/postgres` and are
//! applied on connect.

mod dialect;
mod error;
pub mod group_commit;
mod input;
pub(crate) use input::check_key;
mod migrations;
mod model;
mod queries;
mod rows;
mod sql;
mod statement;
mod upgrade;

pub mod postgres;
pub mod sqlite;

pub use dialect::BackendKind;
pub use error::{Result, StoreError, retry_transient, retry_transient_until};
pub(crate) use input::plan_keys;
pub use model::*;
pub use queries::Clock;
pub use sql::SqlStore;
pub(crate) use statement::RunStatement;
pub use statement::{
    StatementCall, StatementOutcome, classify_sql_error, declared_statement, placeholder_count,
};

use std::sync::Arc;
use std::time::Duration;

/// The store contract. Implementation: [`SqlStore`] (SQLite or PostgreSQL);
/// [`group_commit::GroupCommit`] wraps one to batch its writes.
///
/// ```no_run
/// # async fn demo() -> idem::store::Result<()> {
/// let store = idem::store::connect("sqlite://idem.db").await?;
/// let job = store.job_insert(idem::store::NewJob::new("noop", b"{}".to_vec())).await?;
/// # Ok(()) }
/// ```
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Which database.
    fn backend(&self) -> BackendKind;

    /// Enqueues one job; a duplicate (plugin, key) returns the existing job.
    async fn job_insert(&self, job: NewJob) -> Result<Enqueued>;

    /// Enqueues many jobs in one transaction (chunked statements); results
    /// are in input order. A key repeated within the batch or already stored
    /// resolves to the existing job (`inserted: false`). One invalid job
    /// rejects the whole batch.
    async fn job_insert_many(&self, jobs: Vec<NewJob>) -> Result<Vec<Enqueued>>;

    /// Keeps a job that can never run (a broker message without a usable
    /// key, say) as dead on arrival, with `error` as its failure, so an
    /// operator finds it in the dead-letter queue with its payload. A key
    /// already held returns that job and writes nothing (a redelivery).
    async fn job_insert_dead(&self, job: NewJob, error: ErrorRecord) -> Result<JobId>;

    /// Reads one job.
    async fn job_get(&self, id: JobId) -> Result<Option<Job>>;

    /// Lists jobs matching a filter, newest first.
    async fn job_list(&self, filter: JobFilter) -> Result<Vec<Job>>;

    /// Atomically claims up to `limit` runnable jobs of a queue (priority
    /// first, then `run_at`, then id): state `running`, attempt + 1, lease set.
    async fn job_claim(&self, params: ClaimParams) -> Result<Vec<Job>>;

    /// Commits `writes` in one transaction and answers each in order. A
    /// write that is fenced out changes nothing and answers so; the others
    /// still commit. An error (the database failed) means nothing of the
    /// batch was committed.
    async fn write_batch(&self, writes: Vec<Write>) -> Result<Vec<Written>>;

    /// Returns running jobs whose lease expired to `available` (or to `dead`
    /// with code `lease_expired` when no attempt is left); counts a rescue.
    async fn job_rescue_expired(&self, limit: u32) -> Result<Vec<JobId>>;

    /// Brings dead jobs back: `available`, attempts reset, keys and plan kept;
    /// effects of their plans that failed permanently become claimable again.
    /// A job whose plan holds an effect in doubt (it may have happened and
    /// idem will not send it again) is refused, with that key, until an
    /// operator resolves it ([`Store::effect_resolve`]).
    async fn job_replay(&self, ids: &[JobId]) -> Result<Replayed>;

    /// Drops a dead job's stored plan, so a replay asks the (fixed) plugin
    /// for a new one. Refused (`false`) unless every effect of the plan that
    /// was tried failed permanently without reaching the outside world: an
    /// effect that succeeded, is in flight or failed ambiguously may have
    /// happened, and a new plan could repeat or contradict it. The job's own
    /// failed ledger rows go with the plan.
    async fn job_discard_plan(&self, id: JobId) -> Result<bool>;

    /// Cancels a job that is not running or finished.
    async fn job_cancel(&self, id: JobId) -> Result<bool>;

    /// Deletes finished jobs past their retention. On PostgreSQL only one
    /// node prunes at a time (advisory lock); returns rows deleted.
    async fn job_delete_finished(&self, params: PruneParams) -> Result<u64>;

    /// Replaces the payloads of these jobs that are dead by a reference
    /// (`{"redacted":true,"sha256":..}`), unless already redacted; for jobs
    /// dead-lettered outside the worker (a rescue with no attempt left).
    async fn job_redact_payloads(&self, ids: &[JobId]) -> Result<u64>;

    /// Deletes ledger rows that finished (not `processing`) longer ago than
    /// `older_than`, at most `limit`. Keep them longer than any duplicate
    /// delivery can arrive: a pruned key can be carried out again.
    async fn effect_delete_finished(&self, params: EffectPruneParams) -> Result<u64>;

    /// Records what an operator found out about an effect in doubt:
    /// applied (succeeded, with the provider's reference) or not applied
    /// (may be sent again). `false` when the key is not in doubt.
    async fn effect_resolve(&self, key: &str, resolution: Resolution) -> Result<bool>;

    /// Keys whose outcome is unknown (a try may have reached the provider
    /// and nothing settled it since) and that no live lease holds, of the
    /// `providers` named, optionally of one plugin; oldest try first.
    ///
    /// `let keys = store.effects_to_reconcile(&["email".into()], None, 100).await?;`
    async fn effects_to_reconcile(
        &self,
        providers: &[String],
        plugin: Option<&str>,
        limit: u32,
    ) -> Result<Vec<UnsettledEffect>>;

    /// Records a provider's answer to a lookup for a key read by
    /// [`Store::effects_to_reconcile`], fenced by the attempt read: `false`
    /// when the key was claimed or settled meanwhile.
    ///
    /// `store.effect_reconcile(&row.key, row.attempt, Resolution::NotApplied).await?;`
    async fn effect_reconcile(
        &self,
        key: &str,
        attempt: u32,
        resolution: Resolution,
    ) -> Result<bool>;

    /// Leaves a key read by [`Store::effects_to_reconcile`] out of it for
    /// `after` (its provider could not settle it now), fenced by the
    /// attempt read: `false` when the key was claimed meanwhile.
    ///
    /// `store.effect_ask_later(&row.key, row.attempt, Duration::from_secs(300)).await?;`
    async fn effect_ask_later(&self, key: &str, attempt: u32, after: Duration) -> Result<bool>;

    /// Dead jobs that died of one of `codes` and whose ledger rows are all
    /// settled now, one of them at a provider of `providers`: the jobs the
    /// reconcile sweep replays (it checks every key of each plan again). A
    /// page of at most `limit` after `after`, by id, optionally of one plugin.
    ///
    /// `let ids = store.dead_jobs_settled(&codes, &providers, None, JobId(0), 100).await?;`
    async fn dead_jobs_settled(
        &self,
        codes: &[String],
        providers: &[String],
        plugin: Option<&str>,
        after: JobId,
        limit: u32,
    ) -> Result<Vec<JobId>>;

    /// Reads one ledger row.
    async fn effect_get(&self, key: &str) -> Result<Option<EffectRecord>>;

    /// Ledger rows of a job's plan.
    async fn effect_list(&self, job_id: JobId) -> Result<Vec<EffectRecord>>;

    /// Counts per state and readiness, the last minute's finished jobs and
    /// the dead jobs by code, optionally for one queue.
    async fn queue_stats(&self, queue: Option<&str>) -> Result<QueueStats>;

    /// Every queue that holds jobs, by name, with its stats (as
    /// [`Store::queue_stats`] gives for one queue), read with one grouped
    /// query per figure whatever the number of queues.
    async fn queue_overview(&self) -> Result<Vec<(String, QueueStats)>>;

    /// Waits until a job may be available (a notification) or `timeout`.
    async fn wait_for_jobs(&self, timeout: Duration);

    /// Wakes this process's waiters in [`Store::wait_for_jobs`]: a job may
    /// have become claimable without an insert (the next job of a group,
    /// once its head finished). Other processes learn it from the
    /// database (PostgreSQL: the `groups` migration's trigger) or their poll.
    ///
    /// `store.wake_claimers();`
    fn wake_claimers(&self);

    /// Moves the store's clock forward: leases expire and scheduled jobs
    /// come due as if `by` had passed. For tests; refused
    /// ([`StoreError::Invalid`]) unless the store was opened with
    /// [`Clock::Adjustable`].
    async fn clock_advance(&self, by: Duration) -> Result<()>;

    /// The store's clock now, in ms since the epoch: what every
    /// time-dependent statement reads, moved by [`Store::clock_advance`]
    /// under [`Clock::Adjustable`]. The scheduler asks it which ticks are due.
    ///
    /// `let now_ms = store.clock_now().await?;`
    async fn clock_now(&self) -> Result<i64>;

    /// Records that a schedule is first seen at `at_ms` (no earlier tick
    /// will be enqueued: a new schedule does not backfill); `false` when it
    /// was already known, which changes nothing.
    ///
    /// `store.schedule_start("nightly", now_ms).await?;`
    async fn schedule_start(&self, name: &str, at_ms: i64) -> Result<bool>;

    /// Records one tick of a schedule, in **one** transaction: moves the
    /// schedule's last tick to `tick.tick_ms` only if that is newer (a
    /// schedule not known yet is inserted) and, only for the caller that
    /// moved it, enqueues `tick.job` under the key
    /// [`schedule_key`]`(name, tick)` with the checks of any enqueue, and
    /// records its id. A tick at or before the last one answers
    /// [`Ticked::Stale`] and writes nothing, so many nodes seeing the same
    /// tick enqueue one job, and pruning old jobs never brings a tick back.
    ///
    /// `let ticked = store.schedule_tick(ScheduleTick { name, tick_ms, job: Some(job) }).await?;`
    async fn schedule_tick(&self, tick: ScheduleTick) -> Result<Ticked>;

    /// Every schedule the store knows (configured now or before), by name,
    /// with its last job's state.
    ///
    /// `let schedules = store.schedule_list().await?;`
    async fn schedule_list(&self) -> Result<Vec<ScheduleState>>;

    /// Stores a dashboard session; it expires `ttl` after now by the
    /// store's clock. Refused ([`StoreError::Invalid`]) unless both digests
    /// are 64 lowercase hex digits and `ttl` is at least a second.
    async fn session_create(&self, session: NewSession) -> Result<Session>;

    /// The session with this id digest if it is live: not revoked, not
    /// expired by the store's clock, and made with a token whose
    /// fingerprint is one of `token_fingerprints` (the tokens configured
    /// now, so a changed token ends its sessions).
    async fn session_get_live(
        &self,
        id_digest: &str,
        token_fingerprints: &[String],
    ) -> Result<Option<Session>>;

    /// Signs a session out (for every node sharing the store); `false` when
    /// there is no such session or it was already revoked.
    async fn session_revoke(&self, id_digest: &str) -> Result<bool>;

    /// Deletes sessions past their expiry (revoked or not), at most
    /// `limit`; returns rows deleted.
    async fn session_delete_expired(&self, limit: u32) -> Result<u64>;

    /// Runs an operator-declared statement and marks the claimed effect
    /// succeeded, with the statement's first returned column as its
    /// `result_ref`, in **one** transaction of the store's own database: a
    /// crash leaves both or neither. Fenced as
    /// [`Store::effect_set_succeeded`]: a stale claim runs nothing. When the
    /// database refuses the statement, nothing is changed and the refusal
    /// comes back classified. Not batched with other writes: a statement's
    /// failure must not roll back anyone else's.
    async fn effect_succeed_with_statement(
        &self,
        params: StatementParams,
    ) -> Result<StatementOutcome>;

    /// Commits one write (see [`Store::write_batch`]).
    async fn write(&self, write: Write) -> Result<Written> {
        self.write_batch(vec![write])
            .await?
            .pop()
            .ok_or_else(|| StoreError::Corrupt("a write was not answered".into()))
    }

    /// Stores the effect plan (JSON) and the plugin hash that produced it,
    /// only if the job has none yet and the fence holds; records the hash as
    /// the attempt's plugin version either way. When a plan already exists
    /// (a redelivery) it is kept unchanged and the answer is still
    /// [`Fence::Applied`] if the fence holds: read the plan back from the
    /// claimed job.
    async fn job_save_plan(&self, params: SavePlanParams) -> Result<Fence> {
        job_fence(
            self.write(Write::Job {
                fence: params.fence,
                change: JobChange::SavePlan {
                    plan: params.plan,
                    plugin_hash: params.plugin_hash,
                },
            })
            .await?,
        )
    }

    /// Gives a lease back at shutdown: `available` at once; the attempt is
    /// given back too and counted as an interruption instead.
    async fn job_release(&self, fence: &JobFence) -> Result<Fence> {
        job_fence(
            self.write(Write::Job {
                fence: fence.clone(),
                change: JobChange::Release,
            })
            .await?,
        )
    }

    /// Claims an effect key for a worker (see [`EffectClaim`]).
    async fn effect_claim(&self, params: EffectClaimParams) -> Result<EffectClaim> {
        match self.write(Write::EffectClaim(params)).await? {
            Written::EffectClaim(claim) => Ok(claim),
            other => Err(unexpected(&other)),
        }
    }

    /// Marks a claimed effect done with the provider's reference.
    async fn effect_set_succeeded(&self, params: EffectSucceedParams) -> Result<Fence> {
        let written = self
            .write(Write::Effect {
                fence: params.fence,
                change: EffectChange::Succeed {
                    result_ref: params.result_ref,
                },
            })
            .await?;
        Ok(effect_written(written)?.0)
    }

    /// Marks a claimed effect failed (retrying or failed) and drops the lease.
    async fn effect_set_failed(&self, params: EffectFailParams) -> Result<Fence> {
        let written = self
            .write(Write::Effect {
                fence: params.fence,
                change: EffectChange::Fail {
                    status: params.status,
                    error_code: params.error_code,
                    sent: params.sent,
                },
            })
            .await?;
        Ok(effect_written(written)?.0)
    }

    /// Enqueues a child job (unique on its plugin and key) and marks the
    /// effect succeeded with the child's id, in one transaction. When fenced
    /// out, nothing is written; the returned [`Enqueued`] is then the child
    /// that already holds the key (`inserted: false`), or `JobId(0)` when
    /// there is none.
    async fn effect_succeed_with_child(&self, params: ChildParams) -> Result<(Fence, Enqueued)> {
        let written = self
            .write(Write::Effect {
                fence: params.fence,
                change: EffectChange::SucceedWithChild {
                    child: params.child,
                },
            })
            .await?;
        let (fence, child) = effect_written(written)?;
        let child =
            child.ok_or_else(|| StoreError::Corrupt("a child job was not answered".into()))?;
        Ok((fence, child))
    }
}

fn unexpected(written: &Written) -> StoreError {
    StoreError::Corrupt(format!("a write was answered with {written:?}"))
}

fn job_fence(written: Written) -> Result<Fence> {
    match written {
        Written::Job(fence) => Ok(fence),
        other => Err(unexpected(&other)),
    }
}

fn effect_written(written: Written) -> Result<(Fence, Option<Enqueued>)> {
    match written {
        Written::Effect { fence, child } => Ok((fence, child)),
        other => Err(unexpected(&other)),
    }
}

/// Checks a job as an enqueue would (names, payload size, key, attempts),
/// without a database: how a batch is checked before anything is inserted.
///
/// ```
/// let job = idem::store::NewJob::new("noop", b"{}".to_vec());
/// assert!(idem::store::check_new_job(&job).is_ok());
/// ```
pub fn check_new_job(job: &NewJob) -> Result<()> {
    input::insertable(job.clone()).map(|_| ())
}

/// Connects to a store by URL and applies migrations: `sqlite://PATH`
/// (created if missing), `sqlite::memory:`, or `postgres://...`; the
/// database clock.
///
/// ```no_run
/// # async fn demo() -> idem::store::Result<()> {
/// let store = idem::store::connect("postgres://idem@db/idem").await?;
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<Arc<dyn Store>> {
    Ok(Arc::new(open(url, Clock::Database).await?))
}

/// Opens the store at `url` with the given clock.
///
/// ```no_run
/// # async fn demo() -> idem::store::Result<()> {
/// let store = idem::store::open("sqlite::memory:", idem::store::Clock::Adjustable).await?;
/// # Ok(()) }
/// ```
pub async fn open(url: &str, clock: Clock) -> Result<SqlStore> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        postgres::connect(url, clock).await
    } else if url.starts_with("sqlite:") {
        sqlite::connect(url, clock).await
    } else {
        Err(StoreError::UnsupportedUrl(url.to_string()))
    }
}
