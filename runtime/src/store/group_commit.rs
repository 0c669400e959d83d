//! Group commit: the writes of many concurrent callers become one
//! transaction.
//!
//! [`GroupCommit`] sits in front of a store and implements the same
//! [`Store`] contract. Its writes ([`Store::write_batch`] and every
//! one-write method built on it) queue for a flusher task, which commits
//! whatever is queued as one batch as soon as the previous batch is done:
//! an idle store flushes a lone write at once; a busy one commits many
//! writes per transaction (one WAL flush on SQLite, one round trip per
//! statement kind on PostgreSQL). On PostgreSQL the writes can go to
//! several *lanes* ([`GroupCommitSettings::lanes`]), each a flusher with its
//! own connection, chosen by job so one job's writes stay in one lane: a
//! flush runs on one server backend, one core, and a second lane can use
//! another (SQLite has one writer, so one lane). Each caller still learns its own answer
//! (`Applied` or `FencedOut`) and is answered only after its batch committed,
//! so a write that must be durable before the next step (a plan before its
//! first effect, a ledger claim before the provider call) is. Reads, claims
//! and enqueues pass straight through.
//!
//! Two more rules keep one caller's trouble from reaching the others:
//! - **Heartbeats go first.** Each lane has an urgent queue for lease
//!   extensions, flushed before the next batch of other writes, so a
//!   backlog of outcomes never delays the heartbeats that keep their jobs'
//!   leases (an extension after a job's finish is fenced out, so they need
//!   no order with outcomes). Ledger claims go there too: a handler waits
//!   for its claim, nobody waits for an outcome (a job's outcome is made
//!   after its last claim answered, so they need no order either).
//! - **A bad write fails only itself.** A batch whose data the database
//!   refuses (a value it cannot store, a trigger that raises: nothing
//!   committed) is split in halves and committed again until the
//!   offending write stands alone; it alone gets the error, classified, and
//!   every other write its own answer. A flush that panics, or fails after
//!   its commit, answers its writes with the error, is never committed
//!   again, and the flusher goes on.
//!
//! The writes of one [`Store::write_batch`] call (or one
//! [`GroupCommit::write_all_then`]) stay together: they commit in the same
//! transaction or not at all, as the contract says, and a split never
//! separates them. How a job's plan and its first ledger claim become one
//! durable commit, and a ledger success rides with the job's own success.

use super::{
    BackendKind, ClaimParams, EffectPruneParams, EffectRecord, Enqueued, Job, JobFilter, JobId,
    NewJob, PruneParams, QueueStats, Replayed, Resolution, Result, StatementOutcome,
    StatementParams, Store, StoreError, UnsettledEffect, Write, Written,
};
use futures::FutureExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Mutex, Notify, mpsc, oneshot};

/// Settings of the flusher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupCommitSettings {
    /// Most units in one transaction (a unit is one caller's writes that
    /// commit together: usually one write, at most a few).
    pub max_batch: usize,
    /// How long a flush waits for more writes when fewer than `max_batch`
    /// are queued (zero: never wait; a busy store batches on its own while
    /// the previous flush runs).
    pub max_wait: Duration,
    /// Flushers committing at once, each its own transaction (PostgreSQL;
    /// SQLite, with its one writer, always has one), at most [`MAX_LANES`].
    /// A job's writes always go to the same lane. Two lanes drain plans of
    /// child jobs ~1.2x faster (their flushes are long: five statements);
    /// plans without effects ~0.9x (not batch size: lanes that took turns
    /// while lightly loaded lost as much), so one is the
    /// default (docs/benchmarks.md).
    pub lanes: usize,
}

impl Default for GroupCommitSettings {
    fn default() -> Self {
        GroupCommitSettings {
            max_batch: 512,
            max_wait: Duration::ZERO,
            lanes: 1,
        }
    }
}

/// Most lanes: each holds a pooled connection while it commits, and claims,
/// reads and `LISTEN` need theirs (the PostgreSQL pool has 16).
pub const MAX_LANES: usize = 4;

/// `lanes` when it is between 1 and [`MAX_LANES`], or why not.
///
/// ```
/// use idem::store::group_commit::check_lanes;
/// assert_eq!(check_lanes(2), Ok(2));
/// assert!(check_lanes(0).is_err());
/// ```
pub fn check_lanes(lanes: usize) -> std::result::Result<usize, String> {
    if (1..=MAX_LANES).contains(&lanes) {
        Ok(lanes)
    } else {
        Err(format!(
            "commit_lanes must be between 1 and {MAX_LANES} (each lane holds a database connection while it commits), not {lanes}"
        ))
    }
}

/// The lanes a store of `backend` gets for `lanes` asked: SQLite has one
/// writer, so one; PostgreSQL between 1 and [`MAX_LANES`].
///
/// ```
/// use idem::store::{BackendKind, group_commit::lanes_for};
/// assert_eq!(lanes_for(BackendKind::Sqlite, 2), 1);
/// assert_eq!(lanes_for(BackendKind::Postgres, 2), 2);
/// ```
pub fn lanes_for(backend: BackendKind, lanes: usize) -> usize {
    match backend {
        BackendKind::Sqlite => 1,
        BackendKind::Postgres => lanes.clamp(1, MAX_LANES),
    }
}

/// The lane of `write` among `lanes`: by its job, or, for the end of an
/// effect (whose fence names no job), by its key. Every write of one job
/// (its plan, its outcome, its heartbeats, its effect claims) takes the
/// job's lane, so they commit in the order they were made. An effect's
/// ledger row is written from its claimer's lane (the claim) and from its
/// key's lane (the end); those writes are awaited one after the other and
/// fenced, like two nodes writing one key, so their lanes need not match.
fn lane_of(write: &Write, lanes: usize) -> usize {
    use std::hash::{Hash, Hasher};
    if lanes <= 1 {
        return 0;
    }
    let spread = match write {
        Write::Job { fence, .. } => fence.id.0.unsigned_abs(),
        Write::EffectClaim(params) => params.job_id.0.unsigned_abs(),
        Write::Effect { fence, .. } => {
            let mut hasher = std::hash::DefaultHasher::new();
            fence.key.hash(&mut hasher);
            hasher.finish()
        }
    };
    (spread % lanes as u64) as usize
}

/// Writes that commit together (one caller's unit), and who learns their
/// answers.
struct Pending {
    writes: Vec<Write>,
    reply: Reply,
    /// Counts the write as queued until it is answered (or dropped).
    queued: Queued,
}

/// Writes queued and not yet answered, shared by every lane, with a wake-up
/// for [`GroupCommit::flushed`] when the count falls to zero.
#[derive(Default)]
struct Backlog {
    writes: AtomicUsize,
    empty: Notify,
}

/// One queued unit's share of the [`Backlog`] (its writes), given back
/// when dropped.
struct Queued(Arc<Backlog>, usize);

impl Queued {
    fn new(backlog: &Arc<Backlog>, writes: usize) -> Self {
        backlog.writes.fetch_add(writes, Ordering::SeqCst);
        Queued(backlog.clone(), writes)
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if self.0.writes.fetch_sub(self.1, Ordering::SeqCst) == self.1 {
            self.0.empty.notify_waiters();
        }
    }
}

/// A lane's two queues (see the module's documentation).
struct Lane {
    /// Lease extensions.
    urgent: mpsc::UnboundedSender<Pending>,
    /// Everything else.
    normal: mpsc::UnboundedSender<Pending>,
}

/// Whether a unit goes to its lane's urgent queue: lease extensions, and
/// ledger claims (a handler waits for its claim before the provider call,
/// while nobody waits for an outcome: a claim must not queue behind a
/// flush of outcomes, nor share its statements).
fn is_urgent(writes: &[Write]) -> bool {
    let heartbeat = |write: &Write| {
        matches!(
            write,
            Write::Job {
                change: super::JobChange::Heartbeat { .. },
                ..
            }
        )
    };
    !writes.is_empty()
        && (writes.iter().all(heartbeat)
            || writes.iter().any(|w| matches!(w, Write::EffectClaim(_))))
}

/// Who learns a write's answer.
enum Reply {
    /// A caller awaiting it.
    Wait(oneshot::Sender<Result<Vec<Written>>>),
    /// A callback run by the flusher (see [`GroupCommit::write_then`]).
    Then(Then),
}

impl Reply {
    fn send(self, answer: Result<Vec<Written>>) {
        match self {
            // A caller that stopped waiting no longer needs the answer.
            Reply::Wait(sender) => {
                let _ = sender.send(answer);
            }
            Reply::Then(mut then) => then.call(answer),
        }
    }
}

type Callback = Box<dyn FnOnce(Result<Vec<Written>>) + Send>;

/// A callback that is called exactly once: with the answer, or, if the
/// flusher is stopped before it answers, with [`StoreError::WriterStopped`]
/// (as an awaiting caller would learn).
struct Then(Option<Callback>);

impl Then {
    fn call(&mut self, answer: Result<Vec<Written>>) {
        if let Some(then) = self.0.take() {
            // A panicking callback must not stop the flusher every other
            // write of the process goes through.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| then(answer)));
            if ran.is_err() {
                tracing::error!("a write's callback panicked; the flusher goes on");
            }
        }
    }
}

impl Drop for Then {
    fn drop(&mut self) {
        self.call(Err(StoreError::WriterStopped));
    }
}

/// A store whose writes are committed in groups.
///
/// ```no_run
/// # async fn demo() -> idem::store::Result<()> {
/// use idem::store::group_commit::{GroupCommit, GroupCommitSettings};
/// let store = idem::store::connect("sqlite://idem.db").await?;
/// let store = GroupCommit::new(store, GroupCommitSettings::default());
/// # Ok(()) }
/// ```
pub struct GroupCommit {
    inner: Arc<dyn Store>,
    /// One pair of queues per lane.
    queues: Vec<Lane>,
    backlog: Arc<Backlog>,
    flushers: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Drop for GroupCommit {
    fn drop(&mut self) {
        // The queues' senders go with `self`: each flusher commits what is
        // queued and ends on its own.
        if let Ok(mut flushers) = self.flushers.try_lock() {
            flushers.clear();
        }
    }
}

impl GroupCommit {
    /// Starts the flushers (one per lane) in front of `inner`.
    pub fn new(inner: Arc<dyn Store>, settings: GroupCommitSettings) -> Arc<Self> {
        let lanes = lanes_for(inner.backend(), settings.lanes);
        let (queues, flushers) = (0..lanes)
            .map(|_| {
                let (urgent, urgent_pending) = mpsc::unbounded_channel();
                let (normal, pending) = mpsc::unbounded_channel();
                let flusher = tokio::spawn(flush_forever(
                    inner.clone(),
                    urgent_pending,
                    pending,
                    settings,
                ));
                (Lane { urgent, normal }, flusher)
            })
            .unzip();
        Arc::new(GroupCommit {
            inner,
            queues,
            backlog: Arc::default(),
            flushers: Mutex::new(flushers),
        })
    }

    /// Writes queued and not yet answered, over every lane: the group
    /// commit's backlog (the `idem_store_writes_queued` gauge).
    ///
    /// `assert_eq!(group.queued(), 0);`
    pub fn queued(&self) -> usize {
        self.backlog.writes.load(Ordering::SeqCst)
    }

    /// Waits until every write queued so far is answered: how shutdown
    /// lets queued outcomes land before leases are given back.
    ///
    /// `group.flushed().await;`
    pub async fn flushed(&self) {
        loop {
            let empty = self.backlog.empty.notified();
            tokio::pin!(empty);
            empty.as_mut().enable();
            if self.queued() == 0 {
                return;
            }
            empty.await;
        }
    }

    /// Lanes committing at once (see [`GroupCommitSettings::lanes`]).
    ///
    /// `assert!(group.lanes() >= 1);`
    pub fn lanes(&self) -> usize {
        self.queues.len()
    }

    /// Queues a unit of writes in its lane (its job's, so one job's writes
    /// keep their order: the lane of its first job write or key claim,
    /// else of its first write); a stopped flusher answers it with
    /// [`StoreError::WriterStopped`] at once.
    fn queue(&self, writes: Vec<Write>, reply: Reply) {
        let lane = writes
            .iter()
            .find(|w| matches!(w, Write::Job { .. } | Write::EffectClaim(_)))
            .or(writes.first())
            .map_or(0, |write| lane_of(write, self.queues.len()));
        let urgent = is_urgent(&writes);
        let pending = Pending {
            queued: Queued::new(&self.backlog, writes.len()),
            writes,
            reply,
        };
        let refused = match self.queues.get(lane) {
            Some(lane) => {
                let queue = if urgent { &lane.urgent } else { &lane.normal };
                match queue.send(pending) {
                    Ok(()) => None,
                    Err(mpsc::error::SendError(pending)) => Some(pending),
                }
            }
            None => Some(pending),
        };
        if let Some(pending) = refused {
            pending.reply.send(Err(StoreError::WriterStopped));
        }
    }

    /// Queues `write` and returns at once; `then` is called with its answer
    /// once its batch committed (or failed), on the flusher task, so it must
    /// be short and must not block: anything that waits is spawned. How a
    /// busy worker records outcomes without a task per job. An invalid
    /// write, or a stopped writer, is answered at once.
    ///
    /// ```no_run
    /// # fn demo(group: &idem::store::group_commit::GroupCommit, write: idem::store::Write) {
    /// group.write_then(write, |answer| println!("{answer:?}"));
    /// # }
    /// ```
    pub fn write_then(&self, write: Write, then: impl FnOnce(Result<Written>) + Send + 'static) {
        self.write_all_then(vec![write], move |answers| {
            then(answers.and_then(|mut answers| {
                answers
                    .pop()
                    .ok_or_else(|| StoreError::Corrupt("a write was not answered".into()))
            }))
        });
    }

    /// As [`GroupCommit::write_then`] for writes that commit together, in
    /// one transaction, or not at all (as [`Store::write_batch`]); `then`
    /// gets one answer per write, in order. How a job's success carries
    /// the ledger success of its last effect without the handler waiting.
    ///
    /// ```no_run
    /// # fn demo(group: &idem::store::group_commit::GroupCommit, a: idem::store::Write, b: idem::store::Write) {
    /// group.write_all_then(vec![a, b], |answers| println!("{answers:?}"));
    /// # }
    /// ```
    pub fn write_all_then(
        &self,
        writes: Vec<Write>,
        then: impl FnOnce(Result<Vec<Written>>) + Send + 'static,
    ) {
        let mut then = Then(Some(Box::new(then)));
        if let Err(error) = writes.iter().try_for_each(super::input::check_write) {
            return then.call(Err(error));
        }
        if writes.is_empty() {
            return then.call(Ok(Vec::new()));
        }
        self.queue(writes, Reply::Then(then));
    }

    /// Stops the flushers at once, as a crash would: queued writes are not
    /// committed and their callers get [`StoreError::WriterStopped`]; a
    /// batch in flight either commits or not, as the database decides.
    /// Later writes fail the same way.
    pub async fn stop_now(&self) {
        let flushers: Vec<_> = self.flushers.lock().await.drain(..).collect();
        for flusher in &flushers {
            flusher.abort();
        }
        for flusher in flushers {
            let _ = flusher.await;
        }
    }
}

async fn flush_forever(
    store: Arc<dyn Store>,
    mut urgent: mpsc::UnboundedReceiver<Pending>,
    mut pending: mpsc::UnboundedReceiver<Pending>,
    settings: GroupCommitSettings,
) {
    let max_batch = settings.max_batch.max(1);
    let mut batch: Vec<Pending> = Vec::with_capacity(max_batch);
    let mut urgent_open = true;
    loop {
        // Lease extensions first, in a batch of their own: a flush of many
        // outcomes must not hold them up.
        while batch.len() < max_batch {
            match urgent.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            commit(&*store, std::mem::take(&mut batch)).await;
            continue;
        }
        let first = tokio::select! {
            biased;
            next = urgent.recv(), if urgent_open => match next {
                Some(next) => {
                    batch.push(next);
                    continue;
                }
                None => {
                    urgent_open = false;
                    continue;
                }
            },
            next = pending.recv() => next,
        };
        let Some(first) = first else {
            // Every sender is gone: commit the urgent writes left, then end.
            while let Some(next) = urgent.recv().await {
                batch.push(next);
            }
            if !batch.is_empty() {
                commit(&*store, batch).await;
            }
            return;
        };
        batch.push(first);
        while batch.len() < max_batch {
            match pending.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        if batch.len() < max_batch && !settings.max_wait.is_zero() {
            let deadline = tokio::time::Instant::now() + settings.max_wait;
            while batch.len() < max_batch {
                tokio::select! {
                    next = pending.recv() => match next {
                        Some(next) => batch.push(next),
                        None => break,
                    },
                    _ = tokio::time::sleep_until(deadline) => break,
                }
            }
        }
        commit(&*store, std::mem::take(&mut batch)).await;
    }
}

/// Commits one batch and answers each of its units.
async fn commit(store: &dyn Store, batch: Vec<Pending>) {
    crate::metrics::store_batch(batch.iter().map(|p| p.writes.len()).sum());
    let (units, replies): (Vec<Vec<Write>>, Vec<Pending>) =
        batch.into_iter().map(|p| (p.writes.clone(), p)).unzip();
    let answers = commit_isolated(store, units).await;
    for (pending, answer) in replies.into_iter().zip(answers) {
        pending.reply.send(answer);
        drop(pending.queued);
    }
}

/// Commits `units` as one batch; when the database refuses its data
/// ([`StoreError::is_refusal`]: nothing committed), commits each half
/// again, down to the unit at fault, so only that unit gets the error (a
/// unit's writes are never separated). Any other failure (transient, a
/// panic, a failure after the commit) fails the whole batch, so no write
/// is ever committed twice. One answer per unit, in order.
fn commit_isolated<'a>(
    store: &'a dyn Store,
    units: Vec<Vec<Write>>,
) -> futures::future::BoxFuture<'a, Vec<Result<Vec<Written>>>> {
    async move {
        let sizes: Vec<usize> = units.iter().map(Vec::len).collect();
        let writes: Vec<Write> = units.iter().flatten().cloned().collect();
        let n = writes.len();
        let tried = std::panic::AssertUnwindSafe(async {
            crate::failpoint::hit(crate::failpoint::Failpoint::InFlush).await?;
            store.write_batch(writes.clone()).await
        })
        .catch_unwind()
        .await;
        let error = match tried {
            Ok(Ok(answers)) if answers.len() == n => {
                let mut answers = answers.into_iter();
                return sizes
                    .iter()
                    .map(|&size| Ok(answers.by_ref().take(size).collect()))
                    .collect();
            }
            Ok(Ok(answers)) => StoreError::Corrupt(format!(
                "the store answered {} writes of {n}",
                answers.len()
            )),
            Ok(Err(error)) => error,
            Err(panic) => {
                let why = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                tracing::error!(panic = ?why, writes = n, "a flush panicked; its writes fail and the flusher goes on");
                // Whether it committed is unknown: never split and retry.
                StoreError::Batch(Arc::new(StoreError::Invalid(format!(
                    "the flush panicked: {why}"
                ))))
            }
        };
        if units.len() <= 1 || !error.is_refusal() {
            let error = Arc::new(error);
            return units
                .iter()
                .map(|_| Err(StoreError::Batch(error.clone())))
                .collect();
        }
        tracing::warn!(%error, writes = n, "a batch was refused; committing its halves apart to find the write at fault");
        let mut first = units;
        let second = first.split_off(first.len() / 2);
        let mut answers = commit_isolated(store, first).await;
        answers.extend(commit_isolated(store, second).await);
        answers
    }
    .boxed()
}

#[async_trait::async_trait]
impl Store for GroupCommit {
    fn backend(&self) -> BackendKind {
        self.inner.backend()
    }

    async fn job_insert(&self, job: NewJob) -> Result<Enqueued> {
        self.inner.job_insert(job).await
    }

    async fn job_insert_many(&self, jobs: Vec<NewJob>) -> Result<Vec<Enqueued>> {
        self.inner.job_insert_many(jobs).await
    }

    async fn job_insert_dead(&self, job: NewJob, error: super::ErrorRecord) -> Result<JobId> {
        self.inner.job_insert_dead(job, error).await
    }

    async fn job_get(&self, id: JobId) -> Result<Option<Job>> {
        self.inner.job_get(id).await
    }

    async fn job_list(&self, filter: JobFilter) -> Result<Vec<Job>> {
        self.inner.job_list(filter).await
    }

    async fn job_claim(&self, params: ClaimParams) -> Result<Vec<Job>> {
        self.inner.job_claim(params).await
    }

    /// The writes commit together, in one transaction shared with other
    /// callers' writes, or not at all.
    async fn write_batch(&self, writes: Vec<Write>) -> Result<Vec<Written>> {
        for write in &writes {
            super::input::check_write(write)?;
        }
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, answer) = oneshot::channel();
        self.queue(writes, Reply::Wait(reply));
        answer.await.map_err(|_| StoreError::WriterStopped)?
    }

    async fn job_rescue_expired(&self, limit: u32) -> Result<Vec<JobId>> {
        self.inner.job_rescue_expired(limit).await
    }

    async fn job_replay(&self, ids: &[JobId]) -> Result<Replayed> {
        self.inner.job_replay(ids).await
    }

    async fn effect_resolve(&self, key: &str, resolution: Resolution) -> Result<bool> {
        self.inner.effect_resolve(key, resolution).await
    }

    async fn effects_to_reconcile(
        &self,
        providers: &[String],
        plugin: Option<&str>,
        limit: u32,
    ) -> Result<Vec<UnsettledEffect>> {
        self.inner
            .effects_to_reconcile(providers, plugin, limit)
            .await
    }

    async fn effect_reconcile(
        &self,
        key: &str,
        attempt: u32,
        resolution: Resolution,
    ) -> Result<bool> {
        self.inner.effect_reconcile(key, attempt, resolution).await
    }

    async fn effect_ask_later(&self, key: &str, attempt: u32, after: Duration) -> Result<bool> {
        self.inner.effect_ask_later(key, attempt, after).await
    }

    async fn dead_jobs_settled(
        &self,
        codes: &[String],
        providers: &[String],
        plugin: Option<&str>,
        after: JobId,
        limit: u32,
    ) -> Result<Vec<JobId>> {
        self.inner
            .dead_jobs_settled(codes, providers, plugin, after, limit)
            .await
    }

    async fn job_discard_plan(&self, id: JobId) -> Result<bool> {
        self.inner.job_discard_plan(id).await
    }

    async fn job_cancel(&self, id: JobId) -> Result<bool> {
        self.inner.job_cancel(id).await
    }

    async fn job_delete_finished(&self, params: PruneParams) -> Result<u64> {
        self.inner.job_delete_finished(params).await
    }

    async fn job_redact_payloads(&self, ids: &[JobId]) -> Result<u64> {
        self.inner.job_redact_payloads(ids).await
    }

    async fn effect_delete_finished(&self, params: EffectPruneParams) -> Result<u64> {
        self.inner.effect_delete_finished(params).await
    }

    async fn effect_succeed_with_statement(
        &self,
        params: StatementParams,
    ) -> Result<StatementOutcome> {
        self.inner.effect_succeed_with_statement(params).await
    }

    async fn effect_get(&self, key: &str) -> Result<Option<EffectRecord>> {
        self.inner.effect_get(key).await
    }

    async fn effect_list(&self, job_id: JobId) -> Result<Vec<EffectRecord>> {
        self.inner.effect_list(job_id).await
    }

    async fn queue_stats(&self, queue: Option<&str>) -> Result<QueueStats> {
        self.inner.queue_stats(queue).await
    }

    async fn queue_overview(&self) -> Result<Vec<(String, QueueStats)>> {
        self.inner.queue_overview().await
    }

    async fn wait_for_jobs(&self, timeout: Duration) {
        self.inner.wait_for_jobs(timeout).await
    }

    fn wake_claimers(&self) {
        self.inner.wake_claimers();
    }

    async fn clock_advance(&self, by: Duration) -> Result<()> {
        self.inner.clock_advance(by).await
    }

    async fn clock_now(&self) -> Result<i64> {
        self.inner.clock_now().await
    }

    async fn schedule_start(&self, name: &str, at_ms: i64) -> Result<bool> {
        self.inner.schedule_start(name, at_ms).await
    }

    async fn schedule_tick(&self, tick: super::ScheduleTick) -> Result<super::Ticked> {
        self.inner.schedule_tick(tick).await
    }

    async fn schedule_list(&self) -> Result<Vec<super::ScheduleState>> {
        self.inner.schedule_list().await
    }

    async fn session_create(&self, session: super::NewSession) -> Result<super::Session> {
        self.inner.session_create(session).await
    }

    async fn session_get_live(
        &self,
        id_digest: &str,
        token_fingerprints: &[String],
    ) -> Result<Option<super::Session>> {
        self.inner
            .session_get_live(id_digest, token_fingerprints)
            .await
    }

    async fn session_revoke(&self, id_digest: &str) -> Result<bool> {
        self.inner.session_revoke(id_digest).await
    }

    async fn session_delete_expired(&self, limit: u32) -> Result<u64> {
        self.inner.session_delete_expired(limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{EffectChange, EffectFence, JobChange, JobFence};

    fn job_write(id: i64, change: JobChange) -> Write {
        Write::Job {
            fence: JobFence {
                id: JobId(id),
                worker: "w".into(),
                attempt: 1,
            },
            change,
        }
    }

    fn effect_write(key: &str) -> Write {
        Write::Effect {
            fence: EffectFence {
                key: key.into(),
                worker: "w".into(),
                attempt: 1,
            },
            change: EffectChange::Succeed { result_ref: None },
        }
    }

    #[test]
    fn every_write_of_one_job_takes_the_same_lane() {
        for id in 1..50 {
            let heartbeat = job_write(
                id,
                JobChange::Heartbeat {
                    lease: Duration::from_secs(30),
                    started: false,
                },
            );
            let release = job_write(id, JobChange::Release);
            let effect_claim = Write::EffectClaim(crate::store::EffectClaimParams {
                key: format!("k{id}"),
                job_id: JobId(id),
                plugin: "p".into(),
                provider: "email".into(),
                fingerprint: "fp".into(),
                worker: "w".into(),
                job_attempt: 1,
                lease: Duration::from_secs(30),
                older_key: None,
            });
            assert_eq!(lane_of(&heartbeat, 3), lane_of(&release, 3), "job {id}");
            assert_eq!(
                lane_of(&heartbeat, 3),
                lane_of(&effect_claim, 3),
                "job {id}"
            );
            assert!(lane_of(&heartbeat, 3) < 3);
        }
    }

    #[test]
    fn heartbeats_and_claims_are_urgent_outcomes_are_not() {
        let heartbeat = job_write(
            1,
            JobChange::Heartbeat {
                lease: Duration::from_secs(30),
                started: true,
            },
        );
        let claim = Write::EffectClaim(crate::store::EffectClaimParams {
            key: "p/k".into(),
            job_id: JobId(1),
            plugin: "p".into(),
            provider: "email".into(),
            fingerprint: "fp".into(),
            worker: "w".into(),
            job_attempt: 1,
            lease: Duration::from_secs(30),
            older_key: None,
        });
        let plan = job_write(
            1,
            JobChange::SavePlan {
                plan: "[]".into(),
                plugin_hash: "h".into(),
            },
        );
        let success = job_write(
            1,
            JobChange::Succeed {
                plugin_hash: None,
                plan: None,
            },
        );
        assert!(is_urgent(std::slice::from_ref(&heartbeat)));
        assert!(
            is_urgent(&[plan.clone(), claim.clone()]),
            "a plan with its claim"
        );
        assert!(
            is_urgent(&[effect_write("p/k0"), claim]),
            "a success with the next claim"
        );
        assert!(
            !is_urgent(&[effect_write("p/k"), success.clone()]),
            "an outcome"
        );
        assert!(!is_urgent(&[heartbeat, success]));
        assert!(!is_urgent(&[plan]));
        assert!(!is_urgent(&[]));
    }

    #[test]
    fn lanes_out_of_range_are_refused() {
        assert_eq!(check_lanes(1), Ok(1));
        assert_eq!(check_lanes(MAX_LANES), Ok(MAX_LANES));
        for wrong in [0, MAX_LANES + 1, usize::MAX] {
            let why = check_lanes(wrong).unwrap_err();
            assert!(why.contains("between 1 and"), "{why}");
        }
    }

    #[test]
    fn jobs_and_keys_spread_over_the_lanes() {
        let jobs: std::collections::HashSet<usize> = (1..20)
            .map(|id| lane_of(&job_write(id, JobChange::Release), 2))
            .collect();
        assert_eq!(jobs.len(), 2, "consecutive jobs use both lanes");
        let keys: std::collections::HashSet<usize> = (0..64)
            .map(|k| lane_of(&effect_write(&format!("key:{k}")), 2))
            .collect();
        assert_eq!(keys.len(), 2, "effect keys use both lanes");
        assert_eq!(
            lane_of(&effect_write("same"), 2),
            lane_of(&effect_write("same"), 2),
            "one key, one lane"
        );
    }

    #[test]
    fn one_lane_takes_everything() {
        assert_eq!(lane_of(&job_write(7, JobChange::Release), 1), 0);
        assert_eq!(lane_of(&effect_write("k"), 1), 0);
        assert_eq!(lane_of(&effect_write("k"), 0), 0);
    }
}
