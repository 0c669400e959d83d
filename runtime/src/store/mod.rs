//! The store contract: one interface, a SQLite and a PostgreSQL
//! implementation, one conformance suite (`tests/conformance/`, run for each
//! backend by `tests/store_sqlite.rs` and `tests/store_postgres.rs`).
//!
//! Methods read noun-verb-qualifier and take one params struct each (as
//! River's driver interface does). Every write that finishes or reschedules a
//! job or an effect is fenced by lease owner **and** attempt and returns
//! [`Fence::FencedOut`] when a stale worker tries it. Times are milliseconds
//! since the Unix epoch, taken from the database clock, so many nodes agree.
//!
//! # Layout
//! - this module: the [`Store`] trait, its params and rows.
//! - [`sqlite`]: the embedded default (one file, WAL).
//! - [`postgres`]: many nodes (`FOR UPDATE SKIP LOCKED`, LISTEN/NOTIFY).
//! - `shared` (private): input checks and row decoding both backends use.
//!
//! Schemas live in `migrations/sqlite` and `migrations/postgres` and are
//! applied on connect.

pub mod postgres;
mod shared;
pub mod sqlite;

use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// A job's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub i64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting to be claimed (possibly scheduled for later by its producer).
    Available,
    /// Claimed by a worker holding a lease.
    Running,
    /// Failed or deferred, waiting for its next attempt at `run_at`.
    Retrying,
    /// Done.
    Succeeded,
    /// In the dead-letter queue.
    Dead,
    /// Cancelled by an operator.
    Cancelled,
}

impl JobState {
    /// Every state.
    pub const ALL: [JobState; 6] = [
        JobState::Available,
        JobState::Running,
        JobState::Retrying,
        JobState::Succeeded,
        JobState::Dead,
        JobState::Cancelled,
    ];

    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Available => "available",
            JobState::Running => "running",
            JobState::Retrying => "retrying",
            JobState::Succeeded => "succeeded",
            JobState::Dead => "dead",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Parses a stored name.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

/// A job to enqueue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewJob {
    /// Queue name.
    pub queue: String,
    /// Plugin that handles it.
    pub plugin: String,
    /// Payload bytes (JSON by convention).
    pub payload: Vec<u8>,
    /// Unique per plugin: enqueuing the same key again returns the existing job.
    pub idempotency_key: Option<String>,
    /// Higher runs first.
    pub priority: i32,
    /// Not before this delay from now.
    pub delay: Duration,
    /// Attempts before the job is dead-lettered.
    pub max_attempts: u32,
    /// Correlation id (generated when absent).
    pub correlation_id: Option<String>,
}

impl NewJob {
    /// A job for `plugin` on the `default` queue with default settings.
    ///
    /// ```
    /// let job = idem::store::NewJob::new("send_invoice_email", br#"{"invoice_id":1}"#.to_vec());
    /// assert_eq!(job.queue, "default");
    /// ```
    pub fn new(plugin: impl Into<String>, payload: Vec<u8>) -> Self {
        NewJob {
            queue: "default".into(),
            plugin: plugin.into(),
            payload,
            idempotency_key: None,
            priority: 0,
            delay: Duration::ZERO,
            max_attempts: 10,
            correlation_id: None,
        }
    }
}

/// What an enqueue did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// The job's id (the existing job's for a duplicate key).
    pub id: JobId,
    /// False when the key already existed and nothing was inserted.
    pub inserted: bool,
}

/// One classified failure of one attempt, kept in the job's error history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorRecord {
    /// The attempt that failed.
    pub attempt: u32,
    /// `retryable`, `permanent` or `ambiguous`.
    pub class: String,
    /// Machine-readable code.
    pub code: String,
    /// Human message (bounded).
    pub message: String,
    /// When, ms since the epoch.
    pub at_ms: i64,
}

/// A job row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// Id.
    pub id: JobId,
    /// Queue.
    pub queue: String,
    /// Plugin.
    pub plugin: String,
    /// Payload (replaced by a reference when redacted).
    pub payload: Vec<u8>,
    /// The producer's idempotency key.
    pub idempotency_key: Option<String>,
    /// Priority, higher first.
    pub priority: i32,
    /// Earliest next run, ms.
    pub run_at_ms: i64,
    /// State.
    pub state: JobState,
    /// Attempts started so far (1 during the first run).
    pub attempt: u32,
    /// Attempts allowed.
    pub max_attempts: u32,
    /// Worker holding the lease.
    pub lease_owner: Option<String>,
    /// Lease end, ms.
    pub lease_until_ms: Option<i64>,
    /// Last heartbeat, ms.
    pub heartbeat_at_ms: Option<i64>,
    /// Last error's code.
    pub last_error_code: Option<String>,
    /// Last error's message.
    pub last_error_message: Option<String>,
    /// The most recent errors, oldest first (at most [`ERROR_HISTORY`]).
    pub errors: Vec<ErrorRecord>,
    /// Correlation id.
    pub correlation_id: String,
    /// Content hash of the plugin version of the last attempt.
    pub plugin_hash: Option<String>,
    /// The persisted effect plan (JSON), once the plugin returned one.
    pub plan: Option<String>,
    /// Content hash of the plugin version that produced the plan.
    pub plan_hash: Option<String>,
    /// Times the lease expired and the job was rescued.
    pub rescues: u32,
    /// Created, ms.
    pub created_at_ms: i64,
    /// Updated, ms.
    pub updated_at_ms: i64,
    /// Finished (succeeded, dead, cancelled), ms.
    pub finished_at_ms: Option<i64>,
    /// First failure, ms.
    pub first_failed_at_ms: Option<i64>,
    /// Last failure, ms.
    pub last_failed_at_ms: Option<i64>,
}

/// Whether a payload is a redaction reference (the original is gone).
///
/// ```
/// assert!(!idem::store::is_redacted_payload(b"{}"));
/// ```
pub fn is_redacted_payload(payload: &[u8]) -> bool {
    shared::is_redacted(payload)
}

/// Largest payload accepted at enqueue (1 MiB): a job carries a reference
/// to large data, not the data.
pub const MAX_PAYLOAD_BYTES: usize = 1 << 20;

/// Errors kept per job.
pub const ERROR_HISTORY: usize = 10;

/// Identifies one attempt of one job by one worker: the fence of every write
/// that finishes or reschedules it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFence {
    /// The job.
    pub id: JobId,
    /// The worker that claimed it.
    pub worker: String,
    /// The attempt it claimed.
    pub attempt: u32,
}

impl Job {
    /// The fence for this claimed job (panics never; an unclaimed job gets an
    /// empty owner, which fences nothing in).
    pub fn fence(&self) -> JobFence {
        JobFence {
            id: self.id,
            worker: self.lease_owner.clone().unwrap_or_default(),
            attempt: self.attempt,
        }
    }
}

/// Whether a fenced write took effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// The row was still ours and was written.
    Applied,
    /// The lease was lost (expired and rescued, or taken by another attempt):
    /// nothing was written.
    FencedOut,
}

/// Params of [`Store::job_claim`].
#[derive(Debug, Clone)]
pub struct ClaimParams {
    /// Queue to claim from.
    pub queue: String,
    /// The claiming worker's id.
    pub worker: String,
    /// Most jobs to claim.
    pub limit: u32,
    /// Lease length for each claimed job (unless the plugin has its own).
    pub lease: Duration,
    /// Most jobs of this queue running at once across all workers.
    pub queue_concurrency: Option<u32>,
}

/// Params of [`Store::job_heartbeat`].
#[derive(Debug, Clone)]
pub struct HeartbeatParams {
    /// The attempt.
    pub fence: JobFence,
    /// New lease length from now.
    pub lease: Duration,
}

/// Params of [`Store::job_set_retrying`].
#[derive(Debug, Clone)]
pub struct RetryParams {
    /// The attempt.
    pub fence: JobFence,
    /// Delay before the next attempt.
    pub delay: Duration,
    /// The failure (None for a deferral that is not a failure).
    pub error: Option<ErrorRecord>,
    /// Give the attempt back (a deferral such as "effect leased by another
    /// worker" or "circuit open" must not use up an attempt).
    pub refund_attempt: bool,
}

/// Params of [`Store::job_set_dead`].
#[derive(Debug, Clone)]
pub struct DeadParams {
    /// The attempt.
    pub fence: JobFence,
    /// The failure that killed it.
    pub error: ErrorRecord,
    /// Replace the payload by a reference (`{"redacted":true,"sha256":..}`).
    pub redact_payload: bool,
}

/// Filter of [`Store::job_list`].
#[derive(Debug, Clone, Default)]
pub struct JobFilter {
    /// Only these states (all when empty).
    pub states: Vec<JobState>,
    /// Only this plugin.
    pub plugin: Option<String>,
    /// Only this last error code.
    pub error_code: Option<String>,
    /// Only these ids (all when empty).
    pub ids: Vec<JobId>,
    /// Most rows (newest first by id); 0 means no limit.
    pub limit: u32,
}

/// Params of [`Store::job_delete_finished`].
#[derive(Debug, Clone)]
pub struct PruneParams {
    /// Delete succeeded and cancelled jobs finished longer ago than this.
    pub succeeded_older_than: Duration,
    /// Delete dead jobs finished longer ago than this.
    pub dead_older_than: Duration,
    /// Most rows per call.
    pub limit: u32,
}

/// Counts for metrics and `--exit-when-drained`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Jobs per state.
    pub by_state: Vec<(JobState, i64)>,
    /// Jobs runnable now (available or retrying, `run_at` passed).
    pub ready: i64,
    /// Age in ms of the oldest runnable job.
    pub oldest_ready_age_ms: Option<i64>,
}

impl QueueStats {
    /// Jobs in a state.
    pub fn count(&self, state: JobState) -> i64 {
        self.by_state
            .iter()
            .find(|(s, _)| *s == state)
            .map_or(0, |(_, n)| *n)
    }
}

/// Effect ledger status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EffectStatus {
    /// A worker holds the key's lease and is calling the provider.
    Processing,
    /// Done; `result_ref` holds the provider's reference.
    Succeeded,
    /// Failed retryably; may be claimed again.
    Retrying,
    /// Failed permanently; may be claimed again only after a replay.
    Failed,
}

impl EffectStatus {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            EffectStatus::Processing => "processing",
            EffectStatus::Succeeded => "succeeded",
            EffectStatus::Retrying => "retrying",
            EffectStatus::Failed => "failed",
        }
    }

    /// Parses a stored name.
    pub fn parse(text: &str) -> Option<Self> {
        [
            EffectStatus::Processing,
            EffectStatus::Succeeded,
            EffectStatus::Retrying,
            EffectStatus::Failed,
        ]
        .into_iter()
        .find(|s| s.as_str() == text)
    }
}

/// An effect ledger row (one per idempotency key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectRecord {
    /// The idempotency key (unique).
    pub key: String,
    /// The job that first claimed it.
    pub job_id: JobId,
    /// Plugin of that job.
    pub plugin: String,
    /// Provider name.
    pub provider: String,
    /// SHA-256 of the action.
    pub fingerprint: String,
    /// Status.
    pub status: EffectStatus,
    /// Claims so far.
    pub attempt: u32,
    /// Worker holding the lease.
    pub lease_owner: Option<String>,
    /// Lease end, ms.
    pub lease_until_ms: Option<i64>,
    /// Provider's reference (message id, child job id, ...).
    pub result_ref: Option<String>,
    /// Last error code.
    pub last_error_code: Option<String>,
    /// Last error time, ms.
    pub last_error_at_ms: Option<i64>,
    /// Created, ms.
    pub created_at_ms: i64,
    /// Updated, ms.
    pub updated_at_ms: i64,
}

/// Params of [`Store::effect_claim`].
#[derive(Debug, Clone)]
pub struct EffectClaimParams {
    /// The idempotency key.
    pub key: String,
    /// The job carrying the effect.
    pub job_id: JobId,
    /// Its plugin.
    pub plugin: String,
    /// Provider name.
    pub provider: String,
    /// SHA-256 of the action.
    pub fingerprint: String,
    /// The claiming worker.
    pub worker: String,
    /// Lease length.
    pub lease: Duration,
}

/// What claiming an effect key found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EffectClaim {
    /// The caller holds the key now and must call the provider.
    Claimed {
        /// Fence for the writes that finish it.
        fence: EffectFence,
    },
    /// Done before: skip the effect (an idempotency hit).
    AlreadySucceeded {
        /// The stored reference.
        result_ref: Option<String>,
    },
    /// Another worker holds an unexpired lease on the key: defer the job.
    LeasedByOther {
        /// When that lease ends, ms.
        lease_until_ms: i64,
    },
    /// The effect failed permanently before: not tried again until a replay
    /// of a job carrying it resets it.
    Failed {
        /// The stored error code.
        code: String,
    },
    /// The key was used before for a different action.
    Conflict {
        /// The stored fingerprint.
        existing_fingerprint: String,
    },
}

/// Fence of the writes that finish an effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectFence {
    /// The key.
    pub key: String,
    /// The worker holding it.
    pub worker: String,
    /// The claim number.
    pub attempt: u32,
}

/// Params of [`Store::effect_set_failed`].
#[derive(Debug, Clone)]
pub struct EffectFailParams {
    /// The claim.
    pub fence: EffectFence,
    /// `Retrying` or `Failed`.
    pub status: EffectStatus,
    /// Classified code.
    pub error_code: String,
}

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or failed the query.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Applying migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A stored value could not be read back.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// The caller passed something invalid.
    #[error("invalid input: {0}")]
    Invalid(String),
    /// The URL names no supported database.
    #[error("unsupported database URL {0:?}: use sqlite://PATH or postgres://...")]
    UnsupportedUrl(String),
}

impl StoreError {
    /// Whether retrying the same call later may succeed (connection lost,
    /// pool timeout, serialization failure, SQLITE_BUSY).
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Database(e) => match e {
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed
                | sqlx::Error::Protocol(_) => true,
                sqlx::Error::Database(db) => db
                    .code()
                    .is_some_and(|code| TRANSIENT_CODES.contains(&code.as_ref())),
                _ => false,
            },
            _ => false,
        }
    }
}

/// Database error codes worth retrying. PostgreSQL SQLSTATEs: serialization
/// failure, deadlock, shutdown or not yet accepting connections, too many
/// connections, connection exceptions. SQLite extended result codes: BUSY
/// (plain, RECOVERY, SNAPSHOT, TIMEOUT) and LOCKED (plain, SHAREDCACHE).
const TRANSIENT_CODES: &[&str] = &[
    "40001", "40P01", "57P01", "57P02", "57P03", "53300", "08000", "08001", "08003", "08004",
    "08006", "5", "261", "517", "773", "6", "262",
];

/// Result alias of the store.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// The store contract. Implementations: [`sqlite::SqliteStore`],
/// [`postgres::PostgresStore`].
///
/// ```no_run
/// # async fn demo() -> idem::store::Result<()> {
/// let store = idem::store::connect("sqlite://idem.db").await?;
/// let job = store.job_insert(idem::store::NewJob::new("noop", b"{}".to_vec())).await?;
/// # Ok(()) }
/// ```
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// `sqlite` or `postgres`.
    fn backend(&self) -> &'static str;

    /// Enqueues one job; a duplicate (plugin, key) returns the existing job.
    async fn job_insert(&self, job: NewJob) -> Result<Enqueued>;

    /// Enqueues many jobs in one transaction (chunked statements); results
    /// are in input order. A key repeated within the batch or already stored
    /// resolves to the existing job (`inserted: false`). One invalid job
    /// rejects the whole batch.
    async fn job_insert_many(&self, jobs: Vec<NewJob>) -> Result<Vec<Enqueued>>;

    /// Reads one job.
    async fn job_get(&self, id: JobId) -> Result<Option<Job>>;

    /// Lists jobs matching a filter, newest first.
    async fn job_list(&self, filter: JobFilter) -> Result<Vec<Job>>;

    /// Atomically claims up to `limit` runnable jobs of a queue (priority
    /// first, then `run_at`, then id): state `running`, attempt + 1, lease set.
    async fn job_claim(&self, params: ClaimParams) -> Result<Vec<Job>>;

    /// Extends a running job's lease if the fence still holds.
    async fn job_heartbeat(&self, params: HeartbeatParams) -> Result<Fence>;

    /// Stores the effect plan (JSON) and the plugin hash that produced it,
    /// only if the job has none yet and the fence holds; records the hash as
    /// the attempt's plugin version either way. When a plan already
    /// exists (a redelivery) it is kept unchanged and the result is still
    /// [`Fence::Applied`] if the fence holds: read the plan back from the
    /// claimed job.
    async fn job_save_plan(&self, fence: &JobFence, plan: &str, plugin_hash: &str)
    -> Result<Fence>;

    /// Records the plugin version an attempt ran with.
    async fn job_set_plugin_hash(&self, fence: &JobFence, plugin_hash: &str) -> Result<Fence>;

    /// Finishes a job.
    async fn job_set_succeeded(&self, fence: &JobFence) -> Result<Fence>;

    /// Schedules the next attempt (or a deferral). A given error is appended
    /// to the history with `at_ms` from the database clock and its message
    /// cut to [`crate::failure::Failure::MAX_MESSAGE`].
    async fn job_set_retrying(&self, params: RetryParams) -> Result<Fence>;

    /// Moves a job to the dead-letter queue, recording the error as
    /// [`Store::job_set_retrying`] does.
    async fn job_set_dead(&self, params: DeadParams) -> Result<Fence>;

    /// Gives a lease back at shutdown: `available` at once, attempt kept.
    async fn job_release(&self, fence: &JobFence) -> Result<Fence>;

    /// Returns running jobs whose lease expired to `available` (or to `dead`
    /// with code `lease_expired` when no attempt is left); counts a rescue.
    async fn job_rescue_expired(&self, limit: u32) -> Result<Vec<JobId>>;

    /// Brings dead jobs back: `available`, attempts reset, keys and plan kept;
    /// effects of their plans that failed permanently become claimable again.
    async fn job_replay(&self, ids: &[JobId]) -> Result<u64>;

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
    async fn effect_delete_finished(&self, older_than: Duration, limit: u32) -> Result<u64>;

    /// Counts per state and readiness, optionally for one queue.
    async fn queue_stats(&self, queue: Option<&str>) -> Result<QueueStats>;

    /// True when no job is runnable now, running or retrying (jobs a producer
    /// scheduled for later do not count).
    async fn queue_is_drained(&self) -> Result<bool>;

    /// Waits until a job may be available (a notification) or `timeout`.
    async fn wait_for_jobs(&self, timeout: Duration);

    /// Claims an effect key for a worker (see [`EffectClaim`]).
    async fn effect_claim(&self, params: EffectClaimParams) -> Result<EffectClaim>;

    /// Marks a claimed effect done with the provider's reference.
    async fn effect_set_succeeded(
        &self,
        fence: &EffectFence,
        result_ref: Option<&str>,
    ) -> Result<Fence>;

    /// Marks a claimed effect failed (retrying or failed) and drops the lease.
    async fn effect_set_failed(&self, params: EffectFailParams) -> Result<Fence>;

    /// Enqueues a child job (unique on its plugin and key) and marks the
    /// effect succeeded with the child's id, in one transaction. When fenced
    /// out, nothing is written; the returned [`Enqueued`] is then the child
    /// that already holds the key (`inserted: false`), or `JobId(0)` when
    /// there is none.
    async fn effect_succeed_with_child(
        &self,
        fence: &EffectFence,
        child: NewJob,
    ) -> Result<(Fence, Enqueued)>;

    /// Reads one ledger row.
    async fn effect_get(&self, key: &str) -> Result<Option<EffectRecord>>;

    /// Ledger rows of a job's plan.
    async fn effect_list(&self, job_id: JobId) -> Result<Vec<EffectRecord>>;
}

/// Runs a store call again (up to 3 times, 50 ms apart and growing) while it
/// fails transiently: a lost connection or a busy SQLite file must not leave
/// a provider's answer unrecorded.
///
/// ```no_run
/// # async fn demo(store: &dyn idem::store::Store, id: idem::store::JobId) -> idem::store::Result<()> {
/// let job = idem::store::retry_transient(|| store.job_get(id)).await?;
/// # Ok(()) }
/// ```
pub async fn retry_transient<T, F, Fut>(mut call: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut pause = Duration::from_millis(50);
    for _ in 0..3 {
        match call().await {
            Err(error) if error.is_transient() => {
                tracing::warn!(%error, ?pause, "transient store error; trying again");
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            other => return other,
        }
    }
    call().await
}

/// Connects to a store by URL and applies migrations: `sqlite://PATH`
/// (created if missing), `sqlite::memory:`, or `postgres://...`.
pub async fn connect(url: &str) -> Result<Arc<dyn Store>> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(Arc::new(postgres::PostgresStore::connect(url).await?))
    } else if url.starts_with("sqlite:") {
        Ok(Arc::new(sqlite::SqliteStore::connect(url).await?))
    } else {
        Err(StoreError::UnsupportedUrl(url.to_string()))
    }
}
