//! What the store holds and what its methods take: ids, rows, params and
//! the fenced writes that change a job or an effect.

use crate::failure::ErrorClass;
use serde::{Deserialize, Serialize};
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
    /// Waiting behind an earlier job of its group (a concurrency key): not
    /// claimable, and outside the claim's index, until the job ahead of it
    /// ends and the transaction that ends it makes this one `Available`.
    Blocked,
}

impl JobState {
    /// Every state.
    pub const ALL: [JobState; 7] = [
        JobState::Available,
        JobState::Blocked,
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
            JobState::Blocked => "blocked",
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
    /// Concurrency key (e.g. an order id): at most one job of a group runs
    /// at a time, in enqueue order; `None` runs whenever a worker is free.
    pub group: Option<String>,
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
            group: None,
        }
    }
}

/// What an enqueue did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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
    /// Retryable, permanent or ambiguous.
    pub class: ErrorClass,
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
    /// Attempts allowed. `None` only while a job enqueued without them (a
    /// SQL producer's `max_attempts => NULL`) waits for its first claim,
    /// which resolves it ([`ClaimParams::max_attempts`]): a claimed job
    /// always has a number.
    pub max_attempts: Option<u32>,
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
    /// Concurrency key: at most one job of the group runs at a time.
    pub group: Option<String>,
    /// Content hash of the plugin version of the last attempt.
    pub plugin_hash: Option<String>,
    /// The persisted effect plan (JSON), once the plugin returned one.
    pub plan: Option<String>,
    /// Content hash of the plugin version that produced the plan.
    pub plan_hash: Option<String>,
    /// Times the lease expired and the job was rescued.
    pub rescues: u32,
    /// Whether this attempt's plugin call is known to have begun (recorded
    /// with a heartbeat, or implied by a stored plan); `false` from the
    /// claim until then. A rescue of an attempt that never started gives
    /// the attempt back.
    pub started: bool,
    /// Rescues of attempts that never started (see
    /// [`MAX_UNSTARTED_RESCUES`]).
    pub unstarted_rescues: u32,
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
    /// When the current run of deferrals began, ms (`None` when the last
    /// outcome was not a deferral).
    pub deferred_since_ms: Option<i64>,
    /// Leases given back at shutdown (they use up no attempt).
    pub interruptions: u32,
}

/// Whether a payload is a redaction reference (the original is gone).
///
/// ```
/// assert!(!idem::store::is_redacted_payload(b"{}"));
/// ```
pub fn is_redacted_payload(payload: &[u8]) -> bool {
    super::input::is_redacted(payload)
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

    /// Whether this attempt is the last one allowed: the attempts are used
    /// up, or not known (never so for a claimed job: its claim resolved
    /// them), which counts as the last rather than as unbounded.
    pub fn is_last_attempt(&self) -> bool {
        self.max_attempts.is_none_or(|max| self.attempt >= max)
    }

    /// The attempts allowed, as a plugin is told them: a claimed job's
    /// number, else this attempt (see [`Job::is_last_attempt`]).
    pub fn attempts_allowed(&self) -> u32 {
        self.max_attempts.unwrap_or(self.attempt)
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

/// Params of [`Store::job_claim`](super::Store::job_claim).
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
    /// The attempts written into claimed jobs enqueued without them.
    pub max_attempts: AttemptDefaults,
}

/// What a claim writes into the jobs it takes that were enqueued without
/// `max_attempts` (a SQL producer's `max_attempts => NULL`): the plugin's
/// own number (its operator file's `max_attempts`), else `default` (the
/// worker's `max_attempts`). Resolved once, at the first claim, and kept:
/// retries, rescues and the dead-letter decision read it from the row.
///
/// ```
/// let defaults = idem::store::AttemptDefaults::default();
/// assert_eq!(defaults.default, 10);
/// assert!(defaults.by_plugin.is_empty());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptDefaults {
    /// Plugins whose operator file sets `max_attempts`.
    pub by_plugin: std::collections::BTreeMap<String, u32>,
    /// Every other plugin's (the worker's configured `max_attempts`).
    pub default: u32,
}

impl Default for AttemptDefaults {
    /// No plugin of its own, 10 attempts (the configuration's default).
    fn default() -> Self {
        AttemptDefaults {
            by_plugin: std::collections::BTreeMap::new(),
            default: 10,
        }
    }
}

/// Params of [`Store::job_save_plan`](super::Store::job_save_plan).
#[derive(Debug, Clone)]
pub struct SavePlanParams {
    /// The attempt.
    pub fence: JobFence,
    /// The effect plan (JSON).
    pub plan: String,
    /// Content hash of the plugin version that produced it.
    pub plugin_hash: String,
}

/// Filter of [`Store::job_list`](super::Store::job_list).
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
    /// Only this queue.
    pub queue: Option<String>,
    /// Only ids below this one (the next page of a listing).
    pub before: Option<JobId>,
    /// Most rows (newest first by id); 0 means no limit.
    pub limit: u32,
}

/// Params of [`Store::job_delete_finished`](super::Store::job_delete_finished).
#[derive(Debug, Clone)]
pub struct PruneParams {
    /// Delete succeeded and cancelled jobs finished longer ago than this.
    pub succeeded_older_than: Duration,
    /// Delete dead jobs finished longer ago than this.
    pub dead_older_than: Duration,
    /// Most rows per call.
    pub limit: u32,
}

/// Params of [`Store::effect_delete_finished`](super::Store::effect_delete_finished).
#[derive(Debug, Clone)]
pub struct EffectPruneParams {
    /// Delete ledger rows that finished longer ago than this.
    pub older_than: Duration,
    /// Most rows per call.
    pub limit: u32,
}

/// A dashboard session to store ([`Store::session_create`](super::Store::session_create)).
/// The store keeps digests only: the random id the cookie carries and the
/// token the session was made with never reach it.
#[derive(Debug, Clone)]
pub struct NewSession {
    /// SHA-256 of the session id, 64 lowercase hex digits.
    pub id_digest: String,
    /// Fingerprint of the token that signed in, 64 lowercase hex digits.
    pub token_fingerprint: String,
    /// How long the session lives from now (by the store's clock).
    pub ttl: Duration,
}

/// A stored dashboard session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// SHA-256 of the session id.
    pub id_digest: String,
    /// Fingerprint of the token that signed in.
    pub token_fingerprint: String,
    /// When it was made (ms, store clock).
    pub created_at: i64,
    /// When it ends (ms, store clock).
    pub expires_at: i64,
    /// When it was signed out, if it was.
    pub revoked_at: Option<i64>,
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
    /// Jobs that succeeded in the last minute.
    pub succeeded_last_minute: i64,
    /// Jobs dead-lettered in the last minute.
    pub dead_last_minute: i64,
    /// Dead jobs per last error code (`-` for none).
    pub dead_by_code: Vec<(String, i64)>,
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

/// A ledger row whose outcome is unknown and that no live lease holds
/// ([`Store::effects_to_reconcile`](super::Store::effects_to_reconcile)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsettledEffect {
    /// Its key.
    pub key: String,
    /// Its attempt as read: the fence of [`Store::effect_reconcile`](super::Store::effect_reconcile).
    pub attempt: u32,
    /// Its provider.
    pub provider: String,
    /// The plugin whose plan holds it.
    pub plugin: String,
    /// The request's fingerprint.
    pub fingerprint: String,
    /// The job that created it.
    pub job_id: JobId,
    /// How long ago its latest try that may have reached the provider was claimed.
    pub tried_ago: Duration,
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
    /// Sticky: some try may have carried the effect out (it succeeded, failed
    /// ambiguously, or its holder vanished mid-call).
    pub reached: bool,
    /// The outcome is unknown and idem will not send it again: an operator
    /// must resolve it ([`Store::effect_resolve`](super::Store::effect_resolve)).
    pub in_doubt: bool,
    /// When the first try was claimed for sending, ms.
    pub first_sent_at_ms: Option<i64>,
}

/// Params of [`Store::effect_claim`](super::Store::effect_claim).
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
    /// The claiming worker (the job's lease owner).
    pub worker: String,
    /// The job's attempt the worker holds: the claim is refused
    /// ([`EffectClaim::JobLost`]) unless the worker still holds the job at
    /// this attempt.
    pub job_attempt: u32,
    /// Lease length.
    pub lease: Duration,
    /// The key an older release may have claimed this same request under
    /// (see [`OlderKey`]); `None` for a key that has no older form.
    pub older_key: Option<OlderKey>,
}

/// The form a key had before keys were scoped to their plugin: when the
/// claimed key has no ledger row and this one has a row of the same
/// plugin whose fingerprint is one of `fingerprints`, an older release
/// claimed this very request under it, and the claim answers
/// [`EffectClaim::OlderRelease`] instead of claiming a second key for it.
/// Checked in the claim's own transaction, so a fresh plan reads nothing
/// before its claim.
///
/// ```
/// let older = idem::store::OlderKey { key: "invoice:1".into(), fingerprints: vec!["fp".into()] };
/// assert_eq!(older.key, "invoice:1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OlderKey {
    /// The key as an older release stored it.
    pub key: String,
    /// The request's fingerprints (current and legacy).
    pub fingerprints: Vec<String>,
}

/// What claiming an effect key found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EffectClaim {
    /// The caller holds the key now and must call the provider.
    Claimed {
        /// Fence for the writes that finish it.
        fence: EffectFence,
    },
    /// The caller holds the key now, but an earlier try may have carried the
    /// effect out (its holder vanished mid-call, or its call ended
    /// ambiguously): send it again only to a provider that dedupes, and only
    /// inside its dedupe window.
    InDoubt {
        /// Fence for the writes that finish it.
        fence: EffectFence,
        /// How long ago the first try was claimed for sending.
        sent_ago: Duration,
        /// How long ago the latest try that may have reached the provider
        /// was claimed (a lookup's "not applied" is trusted only once it is
        /// older than the provider's timeout plus its settle delay).
        tried_ago: Duration,
    },
    /// The caller no longer holds the job at its attempt (rescued,
    /// dead-lettered, replayed): nothing was claimed; stop the attempt.
    JobLost,
    /// Done before: skip the effect (an idempotency hit).
    AlreadySucceeded {
        /// The stored reference.
        result_ref: Option<String>,
    },
    /// Another worker holds an unexpired lease on the key: defer the job.
    LeasedByOther {
        /// How long that lease still runs, by the database clock.
        remaining: Duration,
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
    /// Nothing was claimed: an older release claimed this request under
    /// `key` (see [`OlderKey`]); carry it out under that key.
    OlderRelease {
        /// The older key.
        key: String,
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

/// Params of [`Store::effect_succeed_with_statement`](super::Store::effect_succeed_with_statement).
#[derive(Debug, Clone)]
pub struct StatementParams {
    /// The claim.
    pub fence: EffectFence,
    /// The statement and its values.
    pub call: super::StatementCall,
    /// The job's success, committed in the statement's transaction when
    /// the statement is the plan's last effect: a [`Write::Job`] with
    /// [`JobChange::Succeed`], as `queue::outcome::decide` makes it
    /// (anything else is refused). `None`: the job has more to do, or its
    /// outcome is written apart.
    pub finish: Option<Write>,
}

/// Params of [`Store::effect_set_failed`](super::Store::effect_set_failed).
#[derive(Debug, Clone)]
pub struct EffectFailParams {
    /// The claim.
    pub fence: EffectFence,
    /// `Retrying` or `Failed`.
    pub status: EffectStatus,
    /// Classified code.
    pub error_code: String,
    /// What the failed try tells about the provider.
    pub sent: Sent,
}

/// What a failed try of an effect tells about the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// Nothing was carried out: not sent, or refused by the provider.
    NotApplied,
    /// It may have been carried out (ambiguous): the row is marked reached.
    MaybeApplied,
    /// It may have been carried out and idem will not send it again: marked
    /// reached and in doubt until an operator resolves it.
    Unresolved,
    /// Not sent by this claim, but an earlier try may have been carried out
    /// and idem will not send it again: in doubt as [`Sent::Unresolved`],
    /// with the latest try's time kept (this claim's does not count).
    HeldInDoubt,
}

/// An operator's answer for an effect in doubt
/// ([`Store::effect_resolve`](super::Store::effect_resolve)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// The provider carried it out: the effect succeeded, with this reference.
    Applied {
        /// The provider's reference, if known.
        result_ref: Option<String>,
    },
    /// The provider did not carry it out: it may be sent again.
    NotApplied,
}

/// What a replay did, job by job.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Jobs brought back.
    pub replayed: Vec<JobId>,
    /// Jobs left dead, each with a key in doubt that must be resolved first.
    pub refused: Vec<(JobId, String)>,
}

/// Params of [`Store::effect_set_succeeded`](super::Store::effect_set_succeeded).
#[derive(Debug, Clone)]
pub struct EffectSucceedParams {
    /// The claim.
    pub fence: EffectFence,
    /// The provider's reference.
    pub result_ref: Option<String>,
}

/// Params of [`Store::effect_succeed_with_child`](super::Store::effect_succeed_with_child).
#[derive(Debug, Clone)]
pub struct ChildParams {
    /// The claim of the `jobs` effect.
    pub fence: EffectFence,
    /// The child job, keyed by the effect's key.
    pub child: NewJob,
}

/// One fenced write. A batch of them commits in one transaction
/// ([`Store::write_batch`](super::Store::write_batch)); each keeps its own answer ([`Written`]).
///
/// ```
/// use idem::store::{JobChange, JobFence, JobId, Write};
/// let fence = JobFence { id: JobId(1), worker: "w#1".into(), attempt: 1 };
/// let write = Write::Job { fence, change: JobChange::Succeed { plugin_hash: None, plan: None } };
/// ```
#[derive(Debug, Clone)]
pub enum Write {
    /// A job's state change, fenced by owner and attempt.
    Job {
        /// The attempt.
        fence: JobFence,
        /// The change.
        change: JobChange,
    },
    /// Claims an effect key (see [`EffectClaim`]).
    EffectClaim(EffectClaimParams),
    /// Finishes a claimed effect, fenced by its claim.
    Effect {
        /// The claim.
        fence: EffectFence,
        /// How it ended.
        change: EffectChange,
    },
}

/// Rescues of claims that never started a job may take before the job is
/// dead with `rescued_unstarted`: each such rescue gives the attempt back
/// (a crash must not charge the jobs a worker had claimed ahead), and the
/// bound still ends a job whose start kills its host every time before
/// the start is recorded.
pub const MAX_UNSTARTED_RESCUES: u32 = 10;

/// The state changes of a running job: the only ways a worker moves a job.
#[derive(Debug, Clone)]
pub enum JobChange {
    /// Extends the lease to `lease` from now.
    Heartbeat {
        /// New lease length.
        lease: Duration,
        /// The attempt's plugin call has begun: from now on a rescue of
        /// this attempt charges it (see [`Job::started`]).
        started: bool,
    },
    /// Stores the plan (unless one is stored already) and the plugin version.
    SavePlan {
        /// The plan (JSON).
        plan: String,
        /// Plugin content hash.
        plugin_hash: String,
    },
    /// Done.
    Succeed {
        /// The plugin version of this attempt, when not recorded with a plan.
        plugin_hash: Option<String>,
        /// The plan, kept when none is stored yet (a plan without effects
        /// is stored with the success, in the same write).
        plan: Option<String>,
    },
    /// Next attempt after `delay` (a deferral when `error` is `None`).
    Retry {
        /// Delay.
        delay: Duration,
        /// The failure, appended to the history: its `at_ms` is set by the
        /// database clock, its message cut to
        /// [`crate::failure::Failure::MAX_MESSAGE`], and only the newest
        /// [`ERROR_HISTORY`] records are kept.
        error: Option<ErrorRecord>,
        /// Give the attempt back (deferrals).
        refund_attempt: bool,
        /// The plugin version of this attempt, when not recorded with a plan.
        plugin_hash: Option<String>,
    },
    /// To the dead-letter queue.
    Dead {
        /// The failure.
        error: ErrorRecord,
        /// Replace the payload by a reference.
        redact_payload: bool,
        /// The plugin version of this attempt, when not recorded with a plan.
        plugin_hash: Option<String>,
    },
    /// Lease given back at shutdown: available at once.
    Release,
    /// Done, for a plan made only of `jobs` effects, in **one** write: the
    /// plan is stored, each effect's ledger row is written as succeeded and
    /// its child job enqueued, and the job succeeds. When a key is in the
    /// ledger already (an earlier attempt, another job, a release before
    /// keys were scoped), nothing is written and the answer says so
    /// ([`ChildrenWritten::KeysTaken`]): the plan is then carried out effect
    /// by effect, as any other.
    SucceedWithChildren {
        /// The job's plugin (the ledger rows' plugin).
        plugin: String,
        /// The plan (JSON).
        plan: String,
        /// Plugin content hash.
        plugin_hash: String,
        /// The plan's effects, in order.
        children: Vec<ChildEffect>,
    },
}

/// One `jobs` effect of [`JobChange::SucceedWithChildren`].
///
/// ```
/// use idem::store::{ChildEffect, NewJob};
/// let child = ChildEffect {
///     key: "parent/child:1".into(),
///     older_key: Some("child:1".into()),
///     fingerprint: "f".into(),
///     child: NewJob {
///         idempotency_key: Some("parent/child:1".into()),
///         ..NewJob::new("noop", b"{}".to_vec())
///     },
/// };
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildEffect {
    /// The effect's key: its ledger key and the child's key.
    pub key: String,
    /// The key a release before keys were scoped used for it: a ledger row
    /// under it sends the plan the long way, which knows how to reuse it.
    pub older_key: Option<String>,
    /// The effect's fingerprint.
    pub fingerprint: String,
    /// The child job.
    pub child: NewJob,
}

/// The answer to [`JobChange::SucceedWithChildren`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildrenWritten {
    /// The job succeeded; its children, in plan order.
    Applied(Vec<Enqueued>),
    /// The fence no longer holds: nothing was written.
    FencedOut,
    /// A key of the plan is in the ledger already, or used twice in the
    /// batch: nothing was written.
    KeysTaken,
}

/// How a claimed effect ended.
#[derive(Debug, Clone)]
pub enum EffectChange {
    /// Done, with the provider's reference.
    Succeed {
        /// The reference.
        result_ref: Option<String>,
    },
    /// Done by enqueuing this child job (unique on its plugin and key),
    /// in the same transaction; the child's id becomes the reference.
    SucceedWithChild {
        /// The child.
        child: NewJob,
    },
    /// Failed: `Retrying` or `Failed`, with a code.
    Fail {
        /// `Retrying` or `Failed`.
        status: EffectStatus,
        /// Classified code.
        error_code: String,
        /// What the try tells about the provider.
        sent: Sent,
    },
}

/// The answer to one [`Write`], in the order of the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// A job change: applied or fenced out.
    Job(Fence),
    /// An effect claim's outcome.
    EffectClaim(EffectClaim),
    /// An effect change; for a child job, the child (when fenced out: the
    /// child that holds the key already, or `JobId(0)` when there is none).
    Effect {
        /// Applied or fenced out.
        fence: Fence,
        /// The child job, for [`EffectChange::SucceedWithChild`].
        child: Option<Enqueued>,
    },
    /// A [`JobChange::SucceedWithChildren`].
    Children(ChildrenWritten),
}

/// The idempotency key of a schedule's tick: `schedule:NAME:TICK`, the tick
/// as an RFC 3339 UTC instant (`2026-12-07T18:00:00Z`).
///
/// ```
/// assert_eq!(
///     idem::store::schedule_key("nightly", 1_796_666_400_000),
///     "schedule:nightly:2026-12-07T18:00:00Z"
/// );
/// ```
pub fn schedule_key(name: &str, tick_ms: i64) -> String {
    format!("schedule:{name}:{}", rfc3339(tick_ms))
}

/// A time in milliseconds since the epoch as RFC 3339 UTC, fractions only
/// when there are some (`2026-12-07T18:00:00Z`).
///
/// `assert_eq!(idem::store::rfc3339(0), "1970-01-01T00:00:00Z");`
pub fn rfc3339(ms: i64) -> String {
    match chrono::DateTime::from_timestamp_millis(ms) {
        Some(time) => time.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
        None => format!("{ms} ms"),
    }
}

/// One tick of a schedule to record ([`super::Store::schedule_tick`]).
///
/// `let tick = ScheduleTick { name: "nightly".into(), tick_ms, job: Some(NewJob::new("report", b"{}".to_vec())) };`
#[derive(Debug, Clone)]
pub struct ScheduleTick {
    /// The schedule's name.
    pub name: String,
    /// The tick, ms since the epoch (a UTC instant).
    pub tick_ms: i64,
    /// The job to enqueue for it (its key is set to
    /// [`schedule_key`]); `None` passes the tick over without a job (a
    /// missed tick skipped by policy).
    pub job: Option<NewJob>,
}

/// What recording a tick did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ticked {
    /// This caller moved the schedule to the tick and enqueued its job
    /// (`inserted: false` if a job already held the tick's key).
    Enqueued(Enqueued),
    /// This caller moved the schedule to the tick; no job was asked for.
    Passed,
    /// The schedule was at this tick or a later one already (another node
    /// got there first): nothing was written.
    Stale,
}

/// A schedule as the store knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScheduleState {
    /// The schedule's name.
    pub name: String,
    /// The latest tick covered (enqueued, skipped, or the moment the
    /// schedule was first seen), ms since the epoch.
    pub last_tick_ms: i64,
    /// The job of the latest enqueued tick, if any.
    pub last_job_id: Option<JobId>,
    /// That job's state, if it is still stored.
    pub last_job_state: Option<JobState>,
    /// When the row last changed (ms, store clock).
    pub updated_at: i64,
}
