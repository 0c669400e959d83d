//! [`SqlStore`]: the store's logic, written once for every database.
//!
//! Each method's body runs inside [`with_db!`], which binds the backend's
//! concrete pools and compiles the same body once per database: no trait
//! object or generic executor stands between the logic and sqlx, and the
//! SQL comes from the store's [`Queries`], expanded for its dialect.

use super::dialect::{BackendKind, BindRows, Dialect, DialectConn, RowSet, WritePool};
use super::input::{self, Insertable, Slot};
use super::queries::{Clock, Queries};
use super::rows;
use super::*;
use sqlx::Row;
use sqlx::postgres::PgPool;
use sqlx::sqlite::SqlitePool;
use std::collections::{BTreeSet, HashMap, HashSet};
use tokio::sync::Notify;

/// The pools of one store. SQLite reads from a pool and writes through one
/// connection; PostgreSQL does both through one pool.
pub(crate) enum Pools {
    /// SQLite.
    Sqlite {
        /// Readers.
        read: SqlitePool,
        /// The one writer connection.
        write: SqlitePool,
    },
    /// PostgreSQL.
    Postgres(PgPool),
}

/// Runs `$body` with `$read` and `$write` bound to the store's concrete
/// pools. The body is inlined once per backend (it is not a closure:
/// `?` returns from the enclosing method).
macro_rules! with_db {
    ($store:expr, |$read:ident, $write:ident| $body:expr) => {
        match &$store.pools {
            Pools::Sqlite {
                read: $read,
                write: $write,
            } => $body,
            Pools::Postgres(pool) => {
                let ($read, $write) = (pool, pool);
                $body
            }
        }
    };
}

/// Times a claim runs again after meeting another claim of the same group.
const CLAIM_TRIES: u32 = 5;

/// Whether a claim failed because another claim marked a job of the same
/// group running first (`jobs_group_running`), or deadlocked with one
/// (two claims, each waiting on the other's group entry): nothing was
/// claimed, and the next snapshot sees the other claim.
fn group_contention(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = error else {
        return false;
    };
    match db.code().as_deref() {
        Some("23505") => db.constraint() == Some("jobs_group_running"),
        Some("40P01") => true,
        // SQLITE_CONSTRAINT_UNIQUE names the index's columns.
        Some("2067") => db.message().contains("jobs.group_key"),
        _ => false,
    }
}

/// Inserts one checked job on a connection; returns the existing job for a
/// duplicate (plugin, key). Expands in place so it works on every
/// backend's connection type.
macro_rules! insert_one {
    ($conn:expr, $queries:expr, $job:expr, $heads:expr) => {{
        let (conn, queries, job, heads): (_, &Queries, _, bool) = ($conn, $queries, $job, $heads);
        async move {
            // The conflicting job can be pruned between the insert and the
            // read: try again then (pruning only removes old finished jobs).
            for _ in 0..3 {
                let id: Option<i64> = sqlx::query_scalar(&queries.job_insert)
                    .bind(&job.queue)
                    .bind(&job.plugin)
                    .bind(&job.payload)
                    .bind(&job.idempotency_key)
                    .bind(job.priority)
                    .bind(job.delay_ms)
                    .bind(job.max_attempts)
                    .bind(&job.correlation_id)
                    .bind(&job.group)
                    .bind(i64::from(heads))
                    .fetch_optional(&mut *conn)
                    .await?;
                if let Some(id) = id {
                    if heads && job.group.is_some() {
                        sqlx::query(&queries.group_open)
                            .bind(format!("[{id}]"))
                            .execute(&mut *conn)
                            .await?;
                    }
                    return Ok($crate::store::Enqueued {
                        id: $crate::store::JobId(id),
                        inserted: true,
                    });
                }
                let existing: Option<i64> = sqlx::query_scalar(&queries.job_by_key)
                    .bind(&job.plugin)
                    .bind(&job.idempotency_key)
                    .fetch_optional(&mut *conn)
                    .await?;
                if let Some(id) = existing {
                    return Ok($crate::store::Enqueued {
                        id: $crate::store::JobId(id),
                        inserted: false,
                    });
                }
            }
            Err($crate::store::StoreError::Corrupt(format!(
                "job key {:?} of plugin {:?} conflicts on insert but cannot be read",
                job.idempotency_key, job.plugin
            )))
        }
        .await
    }};
}
pub(crate) use insert_one;

/// Inserts a chunk of checked jobs (no (plugin, key) repeated within it) as
/// one row set; evaluates to their ids in input order, each with whether it
/// was inserted.
macro_rules! insert_rows {
    ($conn:expr, $queries:expr, $jobs:expr) => {{
        let (conn, queries, jobs): (_, &Queries, &[&Insertable]) = ($conn, $queries, $jobs);
        async move {
            let results = if jobs.iter().all(|job| job.idempotency_key.is_none()) {
                let ids: Vec<i64> = sqlx::query_scalar(&queries.job_insert_rows_unkeyed)
                    .bind_rows(insert_row_set(jobs))
                    .fetch_all(&mut *conn)
                    .await?;
                let inserted = Inserted {
                    unkeyed: ids,
                    ..Inserted::default()
                };
                inserted.in_order(jobs)?
            } else {
                insert_keyed_rows!(&mut *conn, queries, jobs)?
            };
            // Grouped jobs went in blocked: each group's oldest new job
            // becomes its head unless an older open job is there.
            let grouped: Vec<JobId> = results
                .iter()
                .zip(jobs)
                .filter(|(enqueued, job)| enqueued.inserted && job.group.is_some())
                .map(|(enqueued, _)| enqueued.id)
                .collect();
            if !grouped.is_empty() {
                sqlx::query(&queries.group_open)
                    .bind(ids_json(&grouped))
                    .execute(&mut *conn)
                    .await?;
            }
            Ok::<_, StoreError>(results)
        }
        .await
    }};
}

/// The keyed half of [`insert_rows!`]: a conflicting key inserts nothing
/// and reads the job that holds it.
macro_rules! insert_keyed_rows {
    ($conn:expr, $queries:expr, $jobs:expr) => {{
        let (conn, queries, jobs): (_, &Queries, &[&Insertable]) = ($conn, $queries, $jobs);
        async move {
            let rows = sqlx::query(&queries.job_insert_rows)
                .bind_rows(insert_row_set(jobs))
                .fetch_all(&mut *conn)
                .await?;
            let mut found = Inserted::default();
            for row in &rows {
                found.add(
                    row.try_get("id")?,
                    row.try_get("plugin")?,
                    row.try_get("idempotency_key")?,
                    true,
                );
            }
            let missing = found.missing(jobs);
            if !missing.is_empty() {
                let rows = sqlx::query(&queries.jobs_by_keys)
                    .bind_rows(
                        RowSet::new()
                            .texts(missing.iter().map(|(plugin, _)| plugin.clone()))
                            .texts(missing.iter().map(|(_, key)| key.clone())),
                    )
                    .fetch_all(&mut *conn)
                    .await?;
                for row in &rows {
                    found.add(
                        row.try_get("id")?,
                        row.try_get("plugin")?,
                        row.try_get("idempotency_key")?,
                        false,
                    );
                }
            }
            found.in_order(jobs)
        }
        .await
    }};
}

/// The groups of jobs this transaction ended (succeeded, dead,
/// cancelled): each one's oldest blocked job becomes its head
/// (`Queries::group_next`). On PostgreSQL the job it picks may change
/// under it (cancelled by another transaction, which it waited for): the
/// statement runs again, on a fresh snapshot, for the groups that still
/// have a blocked job and got no head, so none is left without one.
/// Nothing to do for jobs without a group.
macro_rules! group_next {
    ($conn:expr, $queries:expr, $groups:expr) => {{
        let (conn, queries, groups): (_, &Queries, &BTreeSet<String>) =
            ($conn, $queries, $groups);
        async move {
            let mut waiting: Vec<String> = groups.iter().cloned().collect();
            for _ in 0..GROUP_NEXT_TRIES {
                if waiting.is_empty() {
                    break;
                }
                let promoted: HashSet<String> = sqlx::query_scalar(&queries.group_next)
                    .bind(strings_json(&waiting))
                    .fetch_all(&mut *conn)
                    .await?
                    .into_iter()
                    .collect();
                waiting.retain(|g| !promoted.contains(g));
                if waiting.is_empty() {
                    break;
                }
                waiting = sqlx::query_scalar(&queries.groups_blocked)
                    .bind(strings_json(&waiting))
                    .fetch_all(&mut *conn)
                    .await?;
            }
            if !waiting.is_empty() {
                tracing::warn!(groups = ?waiting, "groups kept changing while their next job was promoted");
            }
            Ok::<_, StoreError>(())
        }
        .await
    }};
}

/// Times `group_next!` picks a group's next job again after the one it
/// picked changed under it.
const GROUP_NEXT_TRIES: usize = 4;

/// Wakes in-process waiters of [`Store::wait_for_jobs`]: everyone waiting
/// now, plus one permit for a waiter about to wait (so a job inserted
/// between its empty claim and its wait is not missed).
pub(crate) fn wake(notify: &Notify) {
    notify.notify_waiters();
    notify.notify_one();
}

/// The store, on SQLite or PostgreSQL.
///
/// ```no_run
/// # async fn demo() -> idem::store::Result<()> {
/// use idem::store::{Clock, NewJob, Store};
/// let store = idem::store::open("sqlite://idem.db", Clock::Database).await?;
/// store.job_insert(NewJob::new("noop", b"{}".to_vec())).await?;
/// # Ok(()) }
/// ```
pub struct SqlStore {
    pools: Pools,
    q: Queries,
    kind: BackendKind,
    clock: Clock,
    notify: Arc<Notify>,
    background: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for SqlStore {
    fn drop(&mut self) {
        if let Some(task) = &self.background {
            task.abort();
        }
    }
}

impl SqlStore {
    pub(crate) fn new(pools: Pools, dialect: &Dialect, clock: Clock) -> Self {
        SqlStore {
            pools,
            q: Queries::new(dialect, clock),
            kind: dialect.kind,
            clock,
            notify: Arc::new(Notify::new()),
            background: None,
        }
    }

    /// Keeps a background task (the `LISTEN` loop) alive as long as the store.
    pub(crate) fn with_background(mut self, task: tokio::task::JoinHandle<()>) -> Self {
        self.background = Some(task);
        self
    }

    /// The waiters' wake-up, for a notification source.
    pub(crate) fn notifier(&self) -> Arc<Notify> {
        self.notify.clone()
    }

    /// Wakes this process's waiting workers, e.g. after committing a
    /// transaction that enqueued with `job_insert_in`.
    ///
    /// ```no_run
    /// # fn demo(store: &idem::store::SqlStore) {
    /// store.notify_jobs();
    /// # }
    /// ```
    pub fn notify_jobs(&self) {
        wake(&self.notify);
    }

    /// The writer pool of a SQLite store, for callers that enqueue inside
    /// their own transaction with [`sqlite::job_insert_in`].
    ///
    /// ```no_run
    /// # async fn demo(store: &idem::store::SqlStore) -> idem::store::Result<()> {
    /// let mut tx = store.sqlite_pool().expect("a SQLite store").begin().await?;
    /// # Ok(()) }
    /// ```
    pub fn sqlite_pool(&self) -> Option<&SqlitePool> {
        match &self.pools {
            Pools::Sqlite { write, .. } => Some(write),
            Pools::Postgres(_) => None,
        }
    }

    /// The pool of a PostgreSQL store, for callers that enqueue inside their
    /// own transaction with [`postgres::job_insert_in`].
    ///
    /// ```no_run
    /// # async fn demo(store: &idem::store::SqlStore) -> idem::store::Result<()> {
    /// let mut tx = store.postgres_pool().expect("a PostgreSQL store").begin().await?;
    /// # Ok(()) }
    /// ```
    pub fn postgres_pool(&self) -> Option<&PgPool> {
        match &self.pools {
            Pools::Postgres(pool) => Some(pool),
            Pools::Sqlite { .. } => None,
        }
    }

    /// Closes every connection; later calls fail with a closed pool.
    ///
    /// ```no_run
    /// # async fn demo(store: &idem::store::SqlStore) {
    /// store.close().await;
    /// # }
    /// ```
    pub async fn close(&self) {
        match &self.pools {
            Pools::Sqlite { read, write } => {
                read.close().await;
                write.close().await;
            }
            Pools::Postgres(pool) => pool.close().await,
        }
    }

    async fn existing_child(&self, child: &NewJob) -> Result<Enqueued> {
        let id = match &child.idempotency_key {
            Some(key) => with_db!(self, |read, _write| {
                sqlx::query_scalar::<_, i64>(&self.q.job_by_key)
                    .bind(&child.plugin)
                    .bind(key)
                    .fetch_optional(read)
                    .await?
            }),
            None => None,
        };
        Ok(Enqueued {
            id: JobId(id.unwrap_or(0)),
            inserted: false,
        })
    }

    /// One claim in one transaction (see [`Store::job_claim`]).
    /// `attempts_by_plugin`: the claim's [`ClaimParams::max_attempts`]
    /// by plugin, as the JSON object the statement reads.
    async fn job_claim_once(
        &self,
        params: &ClaimParams,
        attempts_by_plugin: &str,
    ) -> Result<Vec<Job>> {
        let jobs: Vec<Job> = with_db!(self, |_read, write| {
            let mut tx = write.begin_claim().await?;
            let mut limit = i64::from(params.limit);
            if let Some(max) = params.queue_concurrency {
                // Claimers of this queue take turns here, so the count sees
                // every committed claim before this one.
                tx.lock_queue(&params.queue).await?;
                let running: i64 = sqlx::query_scalar(&self.q.running_in_queue)
                    .bind(&params.queue)
                    .fetch_one(&mut *tx)
                    .await?;
                limit = limit.min(i64::from(max) - running);
            }
            if limit <= 0 {
                tx.rollback().await?;
                Vec::new()
            } else {
                let rows = sqlx::query(&self.q.job_claim)
                    .bind(&params.worker)
                    .bind(input::millis(params.lease))
                    .bind(&params.queue)
                    .bind(limit)
                    .bind(attempts_by_plugin)
                    .bind(i64::from(params.max_attempts.default))
                    .fetch_all(&mut *tx)
                    .await?;
                // Decoded before the commit: an unreadable row rolls the
                // claim back instead of leaving jobs running that nobody
                // works on.
                let jobs = rows
                    .iter()
                    .map(rows::job_from_row)
                    .collect::<Result<Vec<_>>>()?;
                if let Some(job) = jobs.iter().find(|job| job.max_attempts.is_none()) {
                    return Err(StoreError::Corrupt(format!(
                        "job {} was claimed without resolving its max_attempts",
                        job.id
                    )));
                }
                tx.commit().await?;
                jobs
            }
        });
        Ok(jobs)
    }
}

#[async_trait::async_trait]
impl Store for SqlStore {
    fn backend(&self) -> BackendKind {
        self.kind
    }

    async fn job_insert(&self, job: NewJob) -> Result<Enqueued> {
        let job = input::insertable(job)?;
        let enqueued: Enqueued = with_db!(self, |_read, write| {
            if job.group.is_some() {
                // The insert and its group's head check commit together.
                let mut tx = write.begin_write().await?;
                let enqueued = insert_one!(&mut *tx, &self.q, &job, true)?;
                tx.commit().await?;
                enqueued
            } else {
                let mut conn = write.acquire().await?;
                insert_one!(&mut *conn, &self.q, &job, true)?
            }
        });
        if enqueued.inserted {
            wake(&self.notify);
        }
        Ok(enqueued)
    }

    async fn job_insert_many(&self, jobs: Vec<NewJob>) -> Result<Vec<Enqueued>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let jobs = jobs
            .into_iter()
            .map(input::insertable)
            .collect::<Result<Vec<_>>>()?;
        let slots = input::batch_slots(&jobs);
        let fresh: Vec<&Insertable> = jobs
            .iter()
            .zip(&slots)
            .filter(|(_, slot)| matches!(slot, Slot::Fresh))
            .map(|(job, _)| job)
            .collect();
        let fresh_results: Vec<Enqueued> = with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            let mut results = Vec::with_capacity(fresh.len());
            for chunk in fresh.chunks(input::INSERT_CHUNK) {
                results.extend(insert_rows!(&mut *tx, &self.q, chunk)?);
            }
            tx.commit().await?;
            results
        });
        let mut fresh_results = fresh_results.into_iter();
        let mut results: Vec<Enqueued> = Vec::with_capacity(jobs.len());
        for slot in &slots {
            let enqueued = match slot {
                Slot::Fresh => fresh_results.next(),
                Slot::SameAs(first) => results.get(*first).map(|e| Enqueued {
                    id: e.id,
                    inserted: false,
                }),
            };
            results.push(enqueued.ok_or_else(|| {
                StoreError::Corrupt("batch insert returned fewer rows than it was given".into())
            })?);
        }
        if results.iter().any(|e| e.inserted) {
            wake(&self.notify);
        }
        Ok(results)
    }

    async fn job_insert_dead(&self, job: NewJob, error: ErrorRecord) -> Result<JobId> {
        let job = input::insertable(job)?;
        let (record, code, message) = input::error_json(&error)?;
        let id = with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            let inserted: Option<i64> = sqlx::query_scalar(&self.q.job_insert_dead)
                .bind(&job.queue)
                .bind(&job.plugin)
                .bind(&job.payload)
                .bind(job.max_attempts)
                .bind(&job.correlation_id)
                .bind(&job.idempotency_key)
                .bind(&job.group)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(id) = inserted else {
                // Kept before (a redelivery): the job that holds the key.
                let existing: Option<i64> = sqlx::query_scalar(&self.q.job_by_key)
                    .bind(&job.plugin)
                    .bind(&job.idempotency_key)
                    .fetch_optional(&mut *tx)
                    .await?;
                tx.commit().await?;
                return existing.map(JobId).ok_or_else(|| {
                    StoreError::Corrupt("a dead job's key conflicts but cannot be read".into())
                });
            };
            sqlx::query(&self.q.job_dead_error)
                .bind(id)
                .bind(&record)
                .bind(&code)
                .bind(&message)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            id
        });
        Ok(JobId(id))
    }

    async fn job_get(&self, id: JobId) -> Result<Option<Job>> {
        with_db!(self, |read, _write| {
            let row = sqlx::query(&self.q.job_get)
                .bind(id.0)
                .fetch_optional(read)
                .await?;
            row.as_ref().map(rows::job_from_row).transpose()
        })
    }

    async fn job_list(&self, filter: JobFilter) -> Result<Vec<Job>> {
        // State names are our own constants: inlined, so the database can
        // match the partial indexes.
        let states = if filter.states.is_empty() {
            "true".to_string()
        } else {
            let names: Vec<String> = filter
                .states
                .iter()
                .map(|s| format!("'{}'", s.as_str()))
                .collect();
            format!("state IN ({})", names.join(", "))
        };
        let sql = self.q.job_list.replace("{states}", &states);
        let ids = (!filter.ids.is_empty()).then(|| ids_json(&filter.ids));
        let limit = if filter.limit == 0 {
            i64::MAX
        } else {
            i64::from(filter.limit)
        };
        with_db!(self, |read, _write| {
            let rows = sqlx::query(&sql)
                .bind(&filter.plugin)
                .bind(&filter.error_code)
                .bind(&ids)
                .bind(limit)
                .bind(&filter.queue)
                .bind(filter.before.map(|id| id.0))
                .fetch_all(read)
                .await?;
            rows.iter().map(rows::job_from_row).collect()
        })
    }

    async fn job_claim(&self, params: ClaimParams) -> Result<Vec<Job>> {
        input::check_worker(&params.worker)?;
        let attempts_by_plugin = input::attempt_defaults(&params.max_attempts)?;
        if params.limit == 0 {
            return Ok(Vec::new());
        }
        // A claim refused because another claim marked a job of the same
        // group running meanwhile (see `GROUP_HEAD_FREE`) claimed nothing:
        // it runs again on a fresh snapshot, which sees that job running.
        let mut tries = 0;
        let mut jobs = loop {
            match self.job_claim_once(&params, &attempts_by_plugin).await {
                Err(StoreError::Database(e)) if tries < CLAIM_TRIES && group_contention(&e) => {
                    tries += 1;
                    tracing::debug!(error = %e, tries, "claim met another claim of a group; claiming again");
                }
                other => break other?,
            }
        };
        // RETURNING has no defined order.
        jobs.sort_by(|a, b| {
            b.priority
                .cmp(&a.priority)
                .then(a.run_at_ms.cmp(&b.run_at_ms))
                .then(a.id.cmp(&b.id))
        });
        Ok(jobs)
    }

    async fn write_batch(&self, writes: Vec<Write>) -> Result<Vec<Written>> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let plan = BatchPlan::new(writes)?;
        let (answers, wake_workers) = with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            let mut batch = Answers::new(plan.len());
            let mut children_inserted = false;
            let mut ended_groups: BTreeSet<String> = BTreeSet::new();
            for (kind, sql) in [
                (JobKind::Heartbeat, &self.q.job_heartbeat),
                (JobKind::SavePlan, &self.q.job_save_plan),
                (JobKind::Succeed, &self.q.job_succeed),
                (JobKind::Retry, &self.q.job_retry),
                (JobKind::Dead, &self.q.job_dead),
                (JobKind::Release, &self.q.job_release),
            ] {
                let mut writes = plan.jobs_of(kind);
                if kind == JobKind::Dead {
                    let ids = redacted_ids(&writes);
                    if !ids.is_empty() {
                        let rows = sqlx::query(&self.q.payloads_of)
                            .bind(ids_json(&ids))
                            .fetch_all(&mut *tx)
                            .await?;
                        let mut payloads = HashMap::new();
                        for row in &rows {
                            let id: i64 = row.try_get("id")?;
                            let payload: Vec<u8> = row.try_get("payload")?;
                            payloads.insert(id, payload);
                        }
                        redact(&mut writes, &payloads);
                    }
                }
                for round in rounds(&writes, |w| w.fence.id.0) {
                    let applied: Vec<i64> = if matches!(kind, JobKind::Succeed | JobKind::Dead) {
                        let ended = sqlx::query_as(sql)
                            .bind_rows(job_row_set(kind, &round)?)
                            .fetch_all(&mut *tx)
                            .await?;
                        ended_ids(ended, &mut ended_groups)
                    } else {
                        sqlx::query_scalar(sql)
                            .bind_rows(job_row_set(kind, &round)?)
                            .fetch_all(&mut *tx)
                            .await?
                    };
                    batch.fences(&round, &applied);
                }
            }

            // Promotions before any child is inserted: an insert share-locks
            // an open job of its group (skipping locked rows, never waiting),
            // so taking the promotions' row locks after one could deadlock
            // with another batch doing the same the other way round.
            group_next!(&mut *tx, &self.q, &ended_groups)?;
            let mut groups_moved = !ended_groups.is_empty();
            ended_groups.clear();

            // Plans made only of `jobs` effects: ledger rows, children and
            // the job's success in this one transaction.
            let finishing = plan.jobs_of(JobKind::SucceedWithChildren);
            if !finishing.is_empty() {
                let (mut fresh, taken) = keys_used_once(finishing);
                for write in taken {
                    batch.answer(write.index, Written::Children(ChildrenWritten::KeysTaken));
                }
                if !fresh.is_empty() {
                    let probe: Vec<String> =
                        fresh.iter().flat_map(|w| ledger_keys(w, true)).collect();
                    let present: HashSet<String> = sqlx::query_scalar(&self.q.effect_keys_present)
                        .bind_rows(RowSet::new().texts(probe))
                        .fetch_all(&mut *tx)
                        .await?
                        .into_iter()
                        .collect();
                    let (free, taken): (Vec<_>, Vec<_>) = fresh
                        .into_iter()
                        .partition(|w| !ledger_keys(w, true).any(|k| present.contains(&k)));
                    for write in taken {
                        batch.answer(write.index, Written::Children(ChildrenWritten::KeysTaken));
                    }
                    fresh = free;
                }
                let mut ours: HashSet<String> = HashSet::new();
                if !fresh.is_empty() {
                    ours = sqlx::query_scalar(&self.q.effect_insert_done)
                        .bind_rows(done_row_set(&fresh))
                        .fetch_all(&mut *tx)
                        .await?
                        .into_iter()
                        .collect();
                }
                // A key inserted by someone else since the probe: this job
                // goes the long way, and the rows it did insert go again.
                let (whole, raced): (Vec<_>, Vec<_>) = fresh
                    .into_iter()
                    .partition(|w| ledger_keys(w, false).all(|k| ours.contains(&k)));
                let mut undo: Vec<String> = raced
                    .iter()
                    .flat_map(|w| ledger_keys(w, false))
                    .filter(|k| ours.contains(k))
                    .collect();
                for write in &raced {
                    batch.answer(write.index, Written::Children(ChildrenWritten::KeysTaken));
                }
                // One statement per round of distinct jobs: two attempts of
                // one job in one statement would both read as applied.
                let (mut done, mut fenced) = (Vec::new(), Vec::new());
                for round in rounds(&whole, |w| w.fence.id.0) {
                    let ended = sqlx::query_as(&self.q.job_succeed)
                        .bind_rows(job_row_set(JobKind::Succeed, &round)?)
                        .fetch_all(&mut *tx)
                        .await?;
                    let applied: HashSet<i64> =
                        ended_ids(ended, &mut ended_groups).into_iter().collect();
                    for write in round {
                        if applied.contains(&write.fence.id.0) {
                            done.push(write);
                        } else {
                            fenced.push(write);
                        }
                    }
                }
                group_next!(&mut *tx, &self.q, &ended_groups)?;
                groups_moved |= !ended_groups.is_empty();
                for write in &fenced {
                    undo.extend(ledger_keys(write, false));
                    batch.answer(write.index, Written::Children(ChildrenWritten::FencedOut));
                }
                if !undo.is_empty() {
                    sqlx::query(&self.q.effect_delete_keys)
                        .bind_rows(RowSet::new().texts(undo))
                        .execute(&mut *tx)
                        .await?;
                }
                let children: Vec<(usize, String, Insertable)> = done
                    .iter()
                    .flat_map(|w| children_of(w).map(move |c| (w.index, c)))
                    .map(|(index, c)| {
                        Ok((index, c.key.clone(), input::insertable(c.child.clone())?))
                    })
                    .collect::<Result<_>>()?;
                let mut enqueued_by_write: HashMap<usize, Vec<Enqueued>> = HashMap::new();
                for chunk in children.chunks(input::INSERT_CHUNK) {
                    let rows: Vec<&Insertable> = chunk.iter().map(|(_, _, c)| c).collect();
                    let enqueued = insert_rows!(&mut *tx, &self.q, &rows)?;
                    children_inserted |= enqueued.iter().any(|e| e.inserted);
                    sqlx::query(&self.q.effect_set_ref)
                        .bind_rows(
                            RowSet::new()
                                .texts(chunk.iter().map(|(_, key, _)| key.clone()))
                                .texts(enqueued.iter().map(|e| e.id.0.to_string())),
                        )
                        .execute(&mut *tx)
                        .await?;
                    for ((index, _, _), child) in chunk.iter().zip(enqueued) {
                        enqueued_by_write.entry(*index).or_default().push(child);
                    }
                }
                for write in &done {
                    let children = enqueued_by_write.remove(&write.index).unwrap_or_default();
                    batch.answer(
                        write.index,
                        Written::Children(ChildrenWritten::Applied(children)),
                    );
                }
            }

            let mut claims = plan.claims();
            // Most claims are fresh keys of jobs still held: one statement
            // inserts those; the rest (and a second claim of a key in this
            // batch) take the full path below, which finds out why.
            if !claims.is_empty() {
                let (round, later) = split_unique(claims, |c| c.params.key.clone());
                let inserted: Vec<(String, i64)> = sqlx::query_as(&self.q.effect_claim_fresh)
                    .bind_rows(fresh_claim_row_set(&round))
                    .fetch_all(&mut *tx)
                    .await?;
                let inserted: HashMap<String, i64> = inserted.into_iter().collect();
                let mut rest = Vec::new();
                for claim in round {
                    match inserted.get(&claim.params.key) {
                        Some(attempt) => batch.claimed(&claim, *attempt, None)?,
                        None => rest.push(claim),
                    }
                }
                rest.extend(later);
                claims = rest;
            }
            if !claims.is_empty() {
                // A key is claimed only while its claimer still holds the job
                // at its attempt: a worker that woke up after its job was
                // rescued (or replayed with a new plan) claims nothing.
                let held: Vec<(i64, String, i64)> = sqlx::query_as(&self.q.effect_claim_fence)
                    .bind_rows(
                        RowSet::new()
                            .ints(claims.iter().map(|c| c.params.job_id.0))
                            .texts(claims.iter().map(|c| c.params.worker.clone()))
                            .ints(claims.iter().map(|c| i64::from(c.params.job_attempt))),
                    )
                    .fetch_all(&mut *tx)
                    .await?;
                let held: HashSet<(i64, String, i64)> = held.into_iter().collect();
                let (kept, lost): (Vec<_>, Vec<_>) = claims.into_iter().partition(|c| {
                    held.contains(&(
                        c.params.job_id.0,
                        c.params.worker.clone(),
                        i64::from(c.params.job_attempt),
                    ))
                });
                for claim in lost {
                    batch.answer(claim.index, Written::EffectClaim(EffectClaim::JobLost));
                }
                claims = kept;
            }
            // A request an older release claimed under its unscoped key is
            // carried out under that key (when the scoped key has no row):
            // probed here, so a fresh plan reads nothing before its claim.
            if claims.iter().any(|c| c.params.older_key.is_some()) {
                let keys: Vec<String> = claims
                    .iter()
                    .filter_map(|c| {
                        let older = c.params.older_key.as_ref()?;
                        Some([c.params.key.clone(), older.key.clone()])
                    })
                    .flatten()
                    .collect();
                let owners: Vec<(String, String, String)> = sqlx::query_as(&self.q.effect_owners)
                    .bind_rows(RowSet::new().texts(keys))
                    .fetch_all(&mut *tx)
                    .await?;
                let owners: HashMap<String, (String, String)> = owners
                    .into_iter()
                    .map(|(key, plugin, fingerprint)| (key, (plugin, fingerprint)))
                    .collect();
                let (older, kept): (Vec<_>, Vec<_>) = claims.into_iter().partition(|c| {
                    c.params.older_key.as_ref().is_some_and(|older| {
                        !owners.contains_key(&c.params.key)
                            && owners.get(&older.key).is_some_and(|(plugin, fingerprint)| {
                                *plugin == c.params.plugin
                                    && older.fingerprints.contains(fingerprint)
                            })
                    })
                });
                for claim in older {
                    if let Some(older) = claim.params.older_key {
                        batch.answer(
                            claim.index,
                            Written::EffectClaim(EffectClaim::OlderRelease { key: older.key }),
                        );
                    }
                }
                claims = kept;
            }
            for _ in 0..CLAIM_ROUNDS {
                if claims.is_empty() {
                    break;
                }
                let (round, later) = split_unique(claims, |c| c.params.key.clone());
                let mut unclaimed = Vec::new();
                let inserted: Vec<(String, i64)> = sqlx::query_as(&self.q.effect_insert)
                    .bind_rows(claim_row_set(&round))
                    .fetch_all(&mut *tx)
                    .await?;
                let inserted: HashMap<String, i64> = inserted.into_iter().collect();
                let mut rest = Vec::new();
                for claim in round {
                    match inserted.get(&claim.params.key) {
                        Some(attempt) => batch.claimed(&claim, *attempt, None)?,
                        None => rest.push(claim),
                    }
                }
                if !rest.is_empty() {
                    let taken: Vec<(String, i64, i64, Option<i64>, Option<i64>)> =
                        sqlx::query_as(&self.q.effect_take_over)
                            .bind_rows(claim_row_set(&rest))
                            .fetch_all(&mut *tx)
                            .await?;
                    let taken: HashMap<String, (i64, Option<Doubt>)> = taken
                        .into_iter()
                        .map(|(key, attempt, reached, sent_ago, tried_ago)| {
                            let doubt = (reached != 0).then(|| Doubt {
                                sent_ago: millis(sent_ago),
                                tried_ago: millis(tried_ago),
                            });
                            (key, (attempt, doubt))
                        })
                        .collect();
                    let mut unread = Vec::new();
                    for claim in rest {
                        match taken.get(&claim.params.key) {
                            Some((attempt, doubt)) => batch.claimed(&claim, *attempt, *doubt)?,
                            None => unread.push(claim),
                        }
                    }
                    if !unread.is_empty() {
                        let rows = sqlx::query(&self.q.effect_read)
                            .bind_rows(
                                RowSet::new().texts(unread.iter().map(|c| c.params.key.clone())),
                            )
                            .fetch_all(&mut *tx)
                            .await?;
                        let mut found = HashMap::new();
                        for row in &rows {
                            let key: String = row.try_get("key")?;
                            found.insert(key, row);
                        }
                        for claim in unread {
                            let outcome = match found.get(&claim.params.key) {
                                Some(row) => rows::effect_outcome(*row, &claim.params.fingerprint)?,
                                // Pruned meanwhile: insert again next round.
                                None => None,
                            };
                            match outcome {
                                Some(outcome) => {
                                    batch.answer(claim.index, Written::EffectClaim(outcome))
                                }
                                None => unclaimed.push(claim),
                            }
                        }
                    }
                }
                unclaimed.extend(later);
                claims = unclaimed;
            }
            // The rows kept changing under us: another worker is busy with them.
            for claim in claims {
                batch.answer(
                    claim.index,
                    Written::EffectClaim(EffectClaim::LeasedByOther {
                        remaining: Duration::ZERO,
                    }),
                );
            }

            for round in rounds(&plan.effects_of(EffectKind::Succeed), |w| {
                w.fence.key.clone()
            }) {
                let applied: Vec<String> = sqlx::query_scalar(&self.q.effect_succeed)
                    .bind_rows(effect_row_set(EffectKind::Succeed, &round))
                    .fetch_all(&mut *tx)
                    .await?;
                batch.effect_fences(&round, &applied);
            }
            for round in rounds(&plan.effects_of(EffectKind::Fail), |w| w.fence.key.clone()) {
                let applied: Vec<String> = sqlx::query_scalar(&self.q.effect_fail)
                    .bind_rows(effect_row_set(EffectKind::Fail, &round))
                    .fetch_all(&mut *tx)
                    .await?;
                batch.effect_fences(&round, &applied);
            }
            for round in rounds(&plan.effects_of(EffectKind::Child), |w| w.fence.key.clone()) {
                let applied: Vec<String> = sqlx::query_scalar(&self.q.effect_succeed)
                    .bind_rows(effect_row_set(EffectKind::Child, &round))
                    .fetch_all(&mut *tx)
                    .await?;
                let applied: HashSet<String> = applied.into_iter().collect();
                let (done, fenced): (Vec<_>, Vec<_>) = round
                    .into_iter()
                    .partition(|w| applied.contains(&w.fence.key));
                for write in fenced {
                    batch.answer(
                        write.index,
                        Written::Effect {
                            fence: Fence::FencedOut,
                            child: None,
                        },
                    );
                }
                let with_child: Vec<&EffectItem> =
                    done.iter().filter(|w| w.child.is_some()).collect();
                for chunk in with_child.chunks(input::INSERT_CHUNK) {
                    let children: Vec<&Insertable> =
                        chunk.iter().filter_map(|w| w.child.as_ref()).collect();
                    let enqueued = insert_rows!(&mut *tx, &self.q, &children)?;
                    children_inserted |= enqueued.iter().any(|e| e.inserted);
                    sqlx::query(&self.q.effect_set_ref)
                        .bind_rows(
                            RowSet::new()
                                .texts(chunk.iter().map(|w| w.fence.key.clone()))
                                .texts(enqueued.iter().map(|e| e.id.0.to_string())),
                        )
                        .execute(&mut *tx)
                        .await?;
                    for (write, child) in chunk.iter().zip(enqueued) {
                        batch.answer(
                            write.index,
                            Written::Effect {
                                fence: Fence::Applied,
                                child: Some(child),
                            },
                        );
                    }
                }
            }
            tx.commit().await?;
            let woken = children_inserted || batch.made_runnable || groups_moved;
            (batch, woken)
        });
        if wake_workers {
            wake(&self.notify);
        }
        let mut answers = answers.finish()?;
        // A fenced-out child effect answers with the child that holds its key.
        for (index, child) in plan.children() {
            if let Some(Written::Effect {
                fence: Fence::FencedOut,
                child: answered,
            }) = answers.get_mut(index)
            {
                // After the commit: a failure here must not read as the
                // batch's data being refused (see `StoreError::is_refusal`).
                let existing = self
                    .existing_child(child)
                    .await
                    .map_err(|e| StoreError::Batch(std::sync::Arc::new(e)))?;
                *answered = Some(existing);
            }
        }
        Ok(answers)
    }

    async fn effect_succeed_with_statement(
        &self,
        params: StatementParams,
    ) -> Result<StatementOutcome> {
        let key = params.fence.key.clone();
        // The job's success, checked as any batch's write is, before the
        // transaction opens.
        let finish = match params.finish {
            None => None,
            Some(
                write @ Write::Job {
                    change: JobChange::Succeed { .. },
                    ..
                },
            ) => Some(BatchPlan::new(vec![write])?.jobs_of(JobKind::Succeed)),
            Some(other) => {
                return Err(StoreError::Invalid(format!(
                    "only a job's success commits with a statement, not {other:?}"
                )));
            }
        };
        let item = EffectItem {
            index: 0,
            fence: params.fence,
            kind: EffectKind::Succeed,
            result_ref: None,
            status: None,
            code: None,
            sent: None,
            child: None,
        };
        let outcome = with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            // Marked first: a stale claim finds no row and runs nothing.
            let applied: Vec<String> = sqlx::query_scalar(&self.q.effect_succeed)
                .bind_rows(effect_row_set(EffectKind::Succeed, &[item]))
                .fetch_all(&mut *tx)
                .await?;
            if applied.is_empty() {
                tx.rollback().await?;
                StatementOutcome::FencedOut
            } else {
                match tx.run_statement(&params.call).await? {
                    Err(refused) => {
                        // SQLite rolls an interrupted statement's transaction
                        // back itself; a rollback then finds none, which is
                        // the state wanted.
                        if let Err(error) = tx.rollback().await {
                            tracing::debug!(%error, "rollback after a refused statement");
                        }
                        StatementOutcome::Refused(refused)
                    }
                    Ok(result_ref) => {
                        if let Some(result_ref) = &result_ref {
                            sqlx::query(&self.q.effect_set_ref)
                                .bind_rows(
                                    RowSet::new()
                                        .texts([key.clone()])
                                        .texts([result_ref.clone()]),
                                )
                                .execute(&mut *tx)
                                .await?;
                        }
                        // Not applied (fenced out, or its row locked by
                        // another writer): the caller writes the success
                        // the usual way, which tells which.
                        let finished = match &finish {
                            Some(job) => {
                                let ended = sqlx::query_as(&self.q.job_succeed_unless_locked)
                                    .bind_rows(job_row_set(JobKind::Succeed, job)?)
                                    .fetch_all(&mut *tx)
                                    .await?;
                                let mut groups = BTreeSet::new();
                                let ended = ended_ids(ended, &mut groups);
                                group_next!(&mut *tx, &self.q, &groups)?;
                                (!ended.is_empty()).then_some(Written::Job(Fence::Applied))
                            }
                            None => None,
                        };
                        crate::failpoint::hit(crate::failpoint::Failpoint::AfterStatement).await?;
                        tx.commit().await?;
                        StatementOutcome::Applied {
                            result_ref,
                            finish: finished,
                        }
                    }
                }
            }
        });
        Ok(outcome)
    }

    async fn job_rescue_expired(&self, limit: u32) -> Result<Vec<JobId>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let ids: Vec<i64> = with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            let rescued: Vec<(i64, String, Option<String>)> = sqlx::query_as(&self.q.job_rescue)
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?;
            // A job rescued into the dead-letter queue lets its group's
            // next job go.
            let groups: BTreeSet<String> = rescued
                .iter()
                .filter(|(_, state, _)| state == JobState::Dead.as_str())
                .filter_map(|(_, _, group)| group.clone())
                .collect();
            group_next!(&mut *tx, &self.q, &groups)?;
            tx.commit().await?;
            rescued.into_iter().map(|(id, _, _)| id).collect()
        });
        if !ids.is_empty() {
            wake(&self.notify);
        }
        let mut ids: Vec<JobId> = ids.into_iter().map(JobId).collect();
        ids.sort_unstable();
        Ok(ids)
    }

    async fn job_replay(&self, ids: &[JobId]) -> Result<Replayed> {
        if ids.is_empty() {
            return Ok(Replayed::default());
        }
        let replayed = with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            let plans: Vec<(i64, Option<String>)> = sqlx::query_as(&self.q.plans_of_dead)
                .bind(ids_json(ids))
                .fetch_all(&mut *tx)
                .await?;
            let mut report = Replayed::default();
            let mut keys = Vec::new();
            for (id, plan) in &plans {
                let plan_keys = input::plan_keys(plan.iter());
                let unresolved: Vec<String> = if plan_keys.is_empty() {
                    Vec::new()
                } else {
                    sqlx::query_scalar(&self.q.effects_unresolved)
                        .bind(strings_json(&plan_keys))
                        .fetch_all(&mut *tx)
                        .await?
                };
                match unresolved.into_iter().next() {
                    // Sending it again could repeat it: the operator must
                    // say first what happened.
                    Some(key) => report.refused.push((JobId(*id), key)),
                    None => {
                        report.replayed.push(JobId(*id));
                        keys.extend(plan_keys);
                    }
                }
            }
            if !keys.is_empty() {
                sqlx::query(&self.q.effects_reset_failed)
                    .bind(strings_json(&keys))
                    .execute(&mut *tx)
                    .await?;
            }
            if !report.replayed.is_empty() {
                sqlx::query(&self.q.jobs_replay)
                    .bind(ids_json(&report.replayed))
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            report
        });
        if !replayed.replayed.is_empty() {
            wake(&self.notify);
        }
        let mut replayed = replayed;
        replayed.replayed.sort_unstable();
        replayed.refused.sort_unstable();
        Ok(replayed)
    }

    async fn effects_to_reconcile(
        &self,
        providers: &[String],
        plugin: Option<&str>,
        limit: u32,
    ) -> Result<Vec<UnsettledEffect>> {
        if providers.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<(String, i64, String, String, String, i64, Option<i64>)> =
            with_db!(self, |read, _write| {
                sqlx::query_as(&self.q.effects_to_reconcile)
                    .bind(strings_json(providers))
                    .bind(plugin.unwrap_or(""))
                    .bind(i64::from(limit))
                    .fetch_all(read)
                    .await?
            });
        rows.into_iter()
            .map(
                |(key, attempt, provider, plugin, fingerprint, job_id, tried_ago)| {
                    Ok(UnsettledEffect {
                        attempt: u32::try_from(attempt).map_err(|_| {
                            StoreError::Corrupt(format!("effect {key:?}: attempt {attempt}"))
                        })?,
                        key,
                        provider,
                        plugin,
                        fingerprint,
                        job_id: JobId(job_id),
                        tried_ago: millis(tried_ago),
                    })
                },
            )
            .collect()
    }

    async fn effect_reconcile(
        &self,
        key: &str,
        attempt: u32,
        resolution: Resolution,
    ) -> Result<bool> {
        with_db!(self, |_read, write| {
            let result = match &resolution {
                Resolution::Applied { result_ref } => {
                    sqlx::query(&self.q.effect_reconcile_applied)
                        .bind(key)
                        .bind(i64::from(attempt))
                        .bind(result_ref)
                        .execute(write)
                        .await?
                }
                Resolution::NotApplied => {
                    sqlx::query(&self.q.effect_reconcile_not_applied)
                        .bind(key)
                        .bind(i64::from(attempt))
                        .execute(write)
                        .await?
                }
            };
            Ok(result.rows_affected() > 0)
        })
    }

    async fn dead_jobs_settled(
        &self,
        codes: &[String],
        providers: &[String],
        plugin: Option<&str>,
        after: JobId,
        limit: u32,
    ) -> Result<Vec<JobId>> {
        if codes.is_empty() || providers.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<i64> = with_db!(self, |read, _write| {
            sqlx::query_scalar(&self.q.dead_jobs_settled)
                .bind(strings_json(codes))
                .bind(strings_json(providers))
                .bind(plugin.unwrap_or(""))
                .bind(after.0)
                .bind(i64::from(limit))
                .fetch_all(read)
                .await?
        });
        Ok(ids.into_iter().map(JobId).collect())
    }

    async fn effect_ask_later(&self, key: &str, attempt: u32, after: Duration) -> Result<bool> {
        let after = i64::try_from(after.as_millis()).unwrap_or(i64::MAX / 2);
        with_db!(self, |_read, write| {
            let result = sqlx::query(&self.q.effect_ask_later)
                .bind(key)
                .bind(i64::from(attempt))
                .bind(after)
                .execute(write)
                .await?;
            Ok(result.rows_affected() > 0)
        })
    }

    async fn effect_resolve(&self, key: &str, resolution: Resolution) -> Result<bool> {
        with_db!(self, |_read, write| {
            let result = match &resolution {
                Resolution::Applied { result_ref } => {
                    sqlx::query(&self.q.effect_resolve_applied)
                        .bind(key)
                        .bind(result_ref)
                        .execute(write)
                        .await?
                }
                Resolution::NotApplied => {
                    sqlx::query(&self.q.effect_resolve_not_applied)
                        .bind(key)
                        .execute(write)
                        .await?
                }
            };
            Ok(result.rows_affected() > 0)
        })
    }

    async fn job_discard_plan(&self, id: JobId) -> Result<bool> {
        with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            let row = sqlx::query(&self.q.dead_plan)
                .bind(id.0)
                .fetch_optional(&mut *tx)
                .await?;
            let plan = match &row {
                Some(row) => {
                    let plan: Option<String> = row.try_get("plan")?;
                    let payload: Vec<u8> = row.try_get("payload")?;
                    // A redacted job cannot make a new plan: its plugin
                    // would be handed the redaction reference.
                    plan.filter(|_| !input::is_redacted(&payload))
                }
                None => None,
            };
            let Some(plan) = plan else {
                tx.rollback().await?;
                return Ok(false);
            };
            let keys = input::plan_keys(std::iter::once(&plan));
            if !keys.is_empty() {
                let in_doubt: i64 = sqlx::query_scalar(&self.q.effects_in_doubt)
                    .bind(strings_json(&keys))
                    .fetch_one(&mut *tx)
                    .await?;
                if in_doubt > 0 {
                    tx.rollback().await?;
                    return Ok(false);
                }
                // This job's permanently failed keys go with the plan: the
                // new plan may use the same keys for corrected requests.
                sqlx::query(&self.q.effects_drop_failed)
                    .bind(strings_json(&keys))
                    .bind(id.0)
                    .execute(&mut *tx)
                    .await?;
            }
            sqlx::query(&self.q.plan_discard)
                .bind(id.0)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(true)
        })
    }

    async fn job_cancel(&self, id: JobId) -> Result<bool> {
        with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            // Read first, locked: only a live job's cancel moves its group
            // on. A blocked job's cancel promotes nothing (its group's head
            // is still there), and must not: two such cancels would each
            // lock their own job, then the other's to promote it.
            let before: Option<(String, Option<String>)> = sqlx::query_as(&self.q.job_state_locked)
                .bind(id.0)
                .fetch_optional(&mut *tx)
                .await?;
            let result = sqlx::query(&self.q.job_cancel)
                .bind(id.0)
                .execute(&mut *tx)
                .await?;
            let cancelled = result.rows_affected() > 0;
            let groups: BTreeSet<String> = match before {
                Some((state, Some(group))) if cancelled && state != JobState::Blocked.as_str() => {
                    BTreeSet::from([group])
                }
                _ => BTreeSet::new(),
            };
            group_next!(&mut *tx, &self.q, &groups)?;
            tx.commit().await?;
            if cancelled {
                // A cancelled group head lets the next job of its group go,
                // and no insert announces it.
                wake(&self.notify);
            }
            Ok(cancelled)
        })
    }

    async fn job_delete_finished(&self, params: PruneParams) -> Result<u64> {
        if params.limit == 0 {
            return Ok(0);
        }
        let succeeded = input::millis(params.succeeded_older_than);
        let dead = input::millis(params.dead_older_than);
        with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            if !tx.try_lock_pruning().await? {
                // Another node is pruning right now.
                tx.rollback().await?;
                return Ok(0);
            }
            let result = sqlx::query(&self.q.jobs_prune)
                .bind(succeeded)
                .bind(dead)
                .bind(succeeded.min(dead))
                .bind(i64::from(params.limit))
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(result.rows_affected())
        })
    }

    async fn job_redact_payloads(&self, ids: &[JobId]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            let rows = sqlx::query(&self.q.dead_payloads)
                .bind(ids_json(ids))
                .fetch_all(&mut *tx)
                .await?;
            let mut redacted = 0;
            for row in rows {
                let id: i64 = row.try_get("id")?;
                let payload: Vec<u8> = row.try_get("payload")?;
                if input::is_redacted(&payload) {
                    continue;
                }
                redacted += sqlx::query(&self.q.job_set_payload)
                    .bind(id)
                    .bind(input::redacted_payload(&payload))
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
            }
            tx.commit().await?;
            Ok(redacted)
        })
    }

    async fn effect_delete_finished(&self, params: EffectPruneParams) -> Result<u64> {
        if params.limit == 0 {
            return Ok(0);
        }
        with_db!(self, |_read, write| {
            let result = sqlx::query(&self.q.effects_prune)
                .bind(input::millis(params.older_than))
                .bind(i64::from(params.limit))
                .execute(write)
                .await?;
            Ok(result.rows_affected())
        })
    }

    async fn effect_get(&self, key: &str) -> Result<Option<EffectRecord>> {
        with_db!(self, |read, _write| {
            let row = sqlx::query(&self.q.effect_get)
                .bind(key)
                .fetch_optional(read)
                .await?;
            row.as_ref().map(rows::effect_from_row).transpose()
        })
    }

    async fn effect_list(&self, job_id: JobId) -> Result<Vec<EffectRecord>> {
        with_db!(self, |read, _write| {
            let rows = sqlx::query(&self.q.effect_list)
                .bind(job_id.0)
                .fetch_all(read)
                .await?;
            rows.iter().map(rows::effect_from_row).collect()
        })
    }

    async fn queue_stats(&self, queue: Option<&str>) -> Result<QueueStats> {
        type Counts = Vec<(String, i64)>;
        let (counts, (ready, age), recent, dead_codes): (
            Counts,
            (i64, Option<i64>),
            Counts,
            Counts,
        ) = with_db!(self, |read, _write| {
            // One snapshot for every count: read in two statements, a job
            // claimed in between would count neither ready (the second
            // read) nor running (the first), and `exit_when_drained` would
            // stop with jobs left.
            let mut tx = read.begin().await?;
            if self.kind == BackendKind::Postgres {
                sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                    .execute(&mut *tx)
                    .await?;
            }
            let (counts, ready) = match queue {
                Some(queue) => (
                    sqlx::query_as(&self.q.stats_counts_queue)
                        .bind(queue)
                        .fetch_all(&mut *tx)
                        .await?,
                    sqlx::query_as(&self.q.stats_ready_queue)
                        .bind(queue)
                        .fetch_one(&mut *tx)
                        .await?,
                ),
                None => (
                    sqlx::query_as(&self.q.stats_counts)
                        .fetch_all(&mut *tx)
                        .await?,
                    sqlx::query_as(&self.q.stats_ready)
                        .fetch_one(&mut *tx)
                        .await?,
                ),
            };
            let recent = sqlx::query_as(&self.q.stats_recent)
                .bind(queue)
                .fetch_all(&mut *tx)
                .await?;
            let dead_codes = sqlx::query_as(&self.q.stats_dead_codes)
                .bind(queue)
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            (counts, ready, recent, dead_codes)
        });
        let mut by_state: Vec<(JobState, i64)> = JobState::ALL.iter().map(|s| (*s, 0)).collect();
        for (state, n) in counts {
            let state = rows::parse_state(&state)?;
            if let Some(slot) = by_state.iter_mut().find(|(s, _)| *s == state) {
                slot.1 = n;
            }
        }
        let recent_of = |state: JobState| {
            recent
                .iter()
                .find(|(s, _)| s == state.as_str())
                .map_or(0, |(_, n)| *n)
        };
        Ok(QueueStats {
            by_state,
            ready,
            oldest_ready_age_ms: age,
            succeeded_last_minute: recent_of(JobState::Succeeded),
            dead_last_minute: recent_of(JobState::Dead),
            dead_by_code: dead_codes,
        })
    }

    async fn queue_overview(&self) -> Result<Vec<(String, QueueStats)>> {
        type Pairs = Vec<(String, String, i64)>;
        let (counts, ready, recent, dead): (Pairs, Vec<(String, i64, Option<i64>)>, Pairs, Pairs) =
            with_db!(self, |read, _write| {
                (
                    sqlx::query_as(&self.q.overview_counts)
                        .fetch_all(read)
                        .await?,
                    sqlx::query_as(&self.q.overview_ready)
                        .fetch_all(read)
                        .await?,
                    sqlx::query_as(&self.q.overview_recent)
                        .fetch_all(read)
                        .await?,
                    sqlx::query_as(&self.q.overview_dead_codes)
                        .fetch_all(read)
                        .await?,
                )
            });
        let mut queues: std::collections::BTreeMap<String, QueueStats> =
            std::collections::BTreeMap::new();
        let blank = || QueueStats {
            by_state: JobState::ALL.iter().map(|s| (*s, 0)).collect(),
            ..QueueStats::default()
        };
        for (queue, state, n) in counts {
            let state = rows::parse_state(&state)?;
            let stats = queues.entry(queue).or_insert_with(blank);
            if let Some(slot) = stats.by_state.iter_mut().find(|(s, _)| *s == state) {
                slot.1 = n;
            }
        }
        for (queue, n, age) in ready {
            let stats = queues.entry(queue).or_insert_with(blank);
            stats.ready = n;
            stats.oldest_ready_age_ms = age;
        }
        for (queue, state, n) in recent {
            let stats = queues.entry(queue).or_insert_with(blank);
            match state.as_str() {
                "succeeded" => stats.succeeded_last_minute = n,
                "dead" => stats.dead_last_minute = n,
                _ => {}
            }
        }
        for (queue, code, n) in dead {
            queues
                .entry(queue)
                .or_insert_with(blank)
                .dead_by_code
                .push((code, n));
        }
        Ok(queues.into_iter().collect())
    }

    async fn wait_for_jobs(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.notify.notified()).await;
    }

    fn wake_claimers(&self) {
        wake(&self.notify);
    }

    async fn session_create(&self, session: NewSession) -> Result<Session> {
        input::check_session(&session)?;
        with_db!(self, |_read, write| {
            let row = sqlx::query(&self.q.session_insert)
                .bind(&session.id_digest)
                .bind(&session.token_fingerprint)
                .bind(input::millis(session.ttl))
                .fetch_one(write)
                .await?;
            rows::session_from_row(&row)
        })
    }

    async fn session_get_live(
        &self,
        id_digest: &str,
        token_fingerprints: &[String],
    ) -> Result<Option<Session>> {
        input::check_digest("a session's id digest", id_digest)?;
        if token_fingerprints.is_empty() {
            return Ok(None);
        }
        with_db!(self, |read, _write| {
            let row = sqlx::query(&self.q.session_live)
                .bind(id_digest)
                .bind(strings_json(token_fingerprints))
                .fetch_optional(read)
                .await?;
            row.as_ref().map(rows::session_from_row).transpose()
        })
    }

    async fn session_revoke(&self, id_digest: &str) -> Result<bool> {
        input::check_digest("a session's id digest", id_digest)?;
        with_db!(self, |_read, write| {
            let result = sqlx::query(&self.q.session_revoke)
                .bind(id_digest)
                .execute(write)
                .await?;
            Ok(result.rows_affected() > 0)
        })
    }

    async fn session_delete_expired(&self, limit: u32) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        with_db!(self, |_read, write| {
            let result = sqlx::query(&self.q.sessions_prune)
                .bind(i64::from(limit))
                .execute(write)
                .await?;
            Ok(result.rows_affected())
        })
    }

    async fn clock_advance(&self, by: Duration) -> Result<()> {
        if self.clock != Clock::Adjustable {
            return Err(StoreError::Invalid(
                "the store's clock is the database's; open it with Clock::Adjustable to move it"
                    .into(),
            ));
        }
        with_db!(self, |_read, write| {
            sqlx::query(&self.q.clock_advance)
                .bind(input::millis(by))
                .execute(write)
                .await?;
        });
        wake(&self.notify);
        Ok(())
    }

    async fn clock_now(&self) -> Result<i64> {
        with_db!(self, |read, _write| {
            Ok(sqlx::query_scalar::<_, i64>(&self.q.clock_now)
                .fetch_one(read)
                .await?)
        })
    }

    async fn schedule_start(&self, name: &str, at_ms: i64) -> Result<bool> {
        input::check_schedule_name(name)?;
        with_db!(self, |_read, write| {
            let result = sqlx::query(&self.q.schedule_start)
                .bind(name)
                .bind(at_ms)
                .execute(write)
                .await?;
            Ok(result.rows_affected() > 0)
        })
    }

    async fn schedule_tick(&self, tick: ScheduleTick) -> Result<Ticked> {
        input::check_schedule_name(&tick.name)?;
        // Checked before the transaction opens, as any enqueue is.
        let job = match tick.job {
            Some(mut job) => {
                job.idempotency_key = Some(schedule_key(&tick.name, tick.tick_ms));
                Some(input::insertable(job)?)
            }
            None => None,
        };
        let ticked = with_db!(self, |_read, write| {
            let mut tx = write.begin_write().await?;
            let moved: Option<String> = sqlx::query_scalar(&self.q.schedule_advance)
                .bind(&tick.name)
                .bind(tick.tick_ms)
                .fetch_optional(&mut *tx)
                .await?;
            if moved.is_none() {
                // Another node is at this tick or past it: nothing to do.
                tx.rollback().await?;
                return Ok(Ticked::Stale);
            }
            let ticked = match &job {
                Some(job) => {
                    let enqueued = insert_one!(&mut *tx, &self.q, job, true)?;
                    sqlx::query(&self.q.schedule_set_job)
                        .bind(&tick.name)
                        .bind(enqueued.id.0)
                        .execute(&mut *tx)
                        .await?;
                    Ticked::Enqueued(enqueued)
                }
                None => Ticked::Passed,
            };
            tx.commit().await?;
            ticked
        });
        if matches!(ticked, Ticked::Enqueued(Enqueued { inserted: true, .. })) {
            wake(&self.notify);
        }
        Ok(ticked)
    }

    async fn schedule_list(&self) -> Result<Vec<ScheduleState>> {
        with_db!(self, |read, _write| {
            let found = sqlx::query(&self.q.schedule_list).fetch_all(read).await?;
            found.iter().map(rows::schedule_from_row).collect()
        })
    }
}

/// Rounds of effect claims before a key that keeps changing is deferred.
const CLAIM_ROUNDS: usize = 5;

/// The ids a statement that ends jobs returned (`RETURNING id, group_key`),
/// their groups added to `groups` for `group_next!`.
fn ended_ids(ended: Vec<(i64, Option<String>)>, groups: &mut BTreeSet<String>) -> Vec<i64> {
    ended
        .into_iter()
        .map(|(id, group)| {
            groups.extend(group);
            id
        })
        .collect()
}

fn ids_json(ids: &[JobId]) -> String {
    let ids: Vec<i64> = ids.iter().map(|id| id.0).collect();
    serde_json::Value::from(ids).to_string()
}

fn strings_json(values: &[String]) -> String {
    serde_json::Value::from(values.to_vec()).to_string()
}

/// The row set of jobs to insert.
fn insert_row_set(jobs: &[&Insertable]) -> RowSet {
    RowSet::new()
        .texts(jobs.iter().map(|j| j.queue.clone()))
        .texts(jobs.iter().map(|j| j.plugin.clone()))
        .opt_bytes(jobs.iter().map(|j| Some(j.payload.clone())))
        .opt_texts(jobs.iter().map(|j| j.idempotency_key.clone()))
        .ints(jobs.iter().map(|j| i64::from(j.priority)))
        .ints(jobs.iter().map(|j| j.delay_ms))
        .ints(jobs.iter().map(|j| j.max_attempts))
        .texts(jobs.iter().map(|j| j.correlation_id.clone()))
        .opt_texts(jobs.iter().map(|j| j.group.clone()))
}

/// Ids found for a chunk of inserted jobs.
#[derive(Default)]
struct Inserted {
    keyed: HashMap<(String, String), (i64, bool)>,
    unkeyed: Vec<i64>,
}

impl Inserted {
    fn add(&mut self, id: i64, plugin: String, key: Option<String>, inserted: bool) {
        match key {
            Some(key) => {
                self.keyed.insert((plugin, key), (id, inserted));
            }
            None => self.unkeyed.push(id),
        }
    }

    /// Keyed inputs not inserted (their key exists): (plugin, key).
    fn missing(&self, jobs: &[&Insertable]) -> Vec<(String, String)> {
        jobs.iter()
            .filter_map(|job| {
                let key = job.idempotency_key.as_ref()?;
                let pair = (job.plugin.clone(), key.clone());
                (!self.keyed.contains_key(&pair)).then_some(pair)
            })
            .collect()
    }

    /// Unkeyed rows cannot conflict, and ids are drawn in the insert's
    /// order (one writer on SQLite, `ORDER BY ord` on PostgreSQL), so sorted
    /// ids match the unkeyed inputs in order.
    fn in_order(mut self, jobs: &[&Insertable]) -> Result<Vec<Enqueued>> {
        self.unkeyed.sort_unstable();
        let mut unkeyed = self.unkeyed.into_iter();
        jobs.iter()
            .map(|job| {
                let found = match &job.idempotency_key {
                    Some(key) => self.keyed.get(&(job.plugin.clone(), key.clone())).copied(),
                    None => unkeyed.next().map(|id| (id, true)),
                };
                found
                    .map(|(id, inserted)| Enqueued {
                        id: JobId(id),
                        inserted,
                    })
                    .ok_or_else(|| {
                        StoreError::Corrupt(format!(
                            "batch insert lost a job of plugin {:?} (key {:?})",
                            job.plugin, job.idempotency_key
                        ))
                    })
            })
            .collect()
    }
}

/// The kinds of job writes, one statement each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobKind {
    Heartbeat,
    SavePlan,
    Succeed,
    Retry,
    Dead,
    Release,
    SucceedWithChildren,
}

/// The kinds of effect writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EffectKind {
    Succeed,
    Fail,
    Child,
}

/// A job write of a batch, checked, with its position.
#[derive(Debug, Clone)]
struct JobItem {
    index: usize,
    fence: JobFence,
    change: JobChange,
    /// The error record as stored JSON, with code and message.
    error: Option<(String, String, String)>,
    /// The payload's replacement when the job is dead-lettered with redaction.
    redacted: Option<Vec<u8>>,
}

/// An effect claim of a batch.
#[derive(Debug, Clone)]
struct ClaimItem {
    index: usize,
    params: EffectClaimParams,
}

/// An effect write of a batch.
#[derive(Debug, Clone)]
struct EffectItem {
    index: usize,
    fence: EffectFence,
    kind: EffectKind,
    result_ref: Option<String>,
    status: Option<EffectStatus>,
    code: Option<String>,
    sent: Option<Sent>,
    child: Option<Insertable>,
}

/// A batch, checked and sorted by kind before the transaction opens (so an
/// invalid write fails the call without touching the database).
struct BatchPlan {
    len: usize,
    jobs: Vec<JobItem>,
    claims: Vec<ClaimItem>,
    effects: Vec<EffectItem>,
    children: Vec<(usize, NewJob)>,
}

impl BatchPlan {
    fn new(writes: Vec<Write>) -> Result<Self> {
        let mut plan = BatchPlan {
            len: writes.len(),
            jobs: Vec::new(),
            claims: Vec::new(),
            effects: Vec::new(),
            children: Vec::new(),
        };
        for (index, write) in writes.into_iter().enumerate() {
            input::check_write(&write)?;
            match write {
                Write::Job { fence, change } => {
                    let error = match &change {
                        JobChange::Retry { error, .. } => {
                            error.as_ref().map(input::error_json).transpose()?
                        }
                        JobChange::Dead { error, .. } => Some(input::error_json(error)?),
                        _ => None,
                    };
                    plan.jobs.push(JobItem {
                        index,
                        fence,
                        change,
                        error,
                        redacted: None,
                    });
                }
                Write::EffectClaim(params) => {
                    plan.claims.push(ClaimItem { index, params });
                }
                Write::Effect { fence, change } => {
                    let mut item = EffectItem {
                        index,
                        fence,
                        kind: EffectKind::Succeed,
                        result_ref: None,
                        status: None,
                        code: None,
                        sent: None,
                        child: None,
                    };
                    match change {
                        EffectChange::Succeed { result_ref } => item.result_ref = result_ref,
                        EffectChange::Fail {
                            status,
                            error_code,
                            sent,
                        } => {
                            item.kind = EffectKind::Fail;
                            item.status = Some(status);
                            item.code = Some(error_code);
                            item.sent = Some(sent);
                        }
                        EffectChange::SucceedWithChild { child } => {
                            item.kind = EffectKind::Child;
                            item.child = Some(input::insertable(child.clone())?);
                            plan.children.push((index, child));
                        }
                    }
                    plan.effects.push(item);
                }
            }
        }
        Ok(plan)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn jobs_of(&self, kind: JobKind) -> Vec<JobItem> {
        self.jobs
            .iter()
            .filter(|item| job_kind(&item.change) == kind)
            .cloned()
            .collect()
    }

    fn claims(&self) -> Vec<ClaimItem> {
        self.claims.clone()
    }

    fn effects_of(&self, kind: EffectKind) -> Vec<EffectItem> {
        self.effects
            .iter()
            .filter(|item| item.kind == kind)
            .cloned()
            .collect()
    }

    fn children(&self) -> impl Iterator<Item = (usize, &NewJob)> {
        self.children.iter().map(|(index, child)| (*index, child))
    }
}

fn job_kind(change: &JobChange) -> JobKind {
    match change {
        JobChange::Heartbeat { .. } => JobKind::Heartbeat,
        JobChange::SavePlan { .. } => JobKind::SavePlan,
        JobChange::Succeed { .. } => JobKind::Succeed,
        JobChange::Retry { .. } => JobKind::Retry,
        JobChange::Dead { .. } => JobKind::Dead,
        JobChange::Release => JobKind::Release,
        JobChange::SucceedWithChildren { .. } => JobKind::SucceedWithChildren,
    }
}

/// Splits items into statements whose rows have distinct keys: one
/// statement cannot tell two writes of the same row apart.
fn rounds<T: Clone, K: std::hash::Hash + Eq>(items: &[T], key: impl Fn(&T) -> K) -> Vec<Vec<T>> {
    let mut rounds = Vec::new();
    let mut rest: Vec<T> = items.to_vec();
    while !rest.is_empty() {
        let (round, later) = split_unique(rest, &key);
        rounds.push(round);
        rest = later;
    }
    rounds
}

/// The first item of each key, and the rest.
fn split_unique<T, K: std::hash::Hash + Eq>(
    items: Vec<T>,
    key: impl Fn(&T) -> K,
) -> (Vec<T>, Vec<T>) {
    let mut seen = HashSet::new();
    items.into_iter().partition(|item| seen.insert(key(item)))
}

/// The `jobs` effects of a [`JobChange::SucceedWithChildren`] write.
fn children_of(write: &JobItem) -> impl Iterator<Item = &ChildEffect> {
    match &write.change {
        JobChange::SucceedWithChildren { children, .. } => children.iter(),
        _ => [].iter(),
    }
}

/// The ledger keys a one-write finish would take (with `older`, also the
/// keys of a release before keys were scoped, which it must not meet).
fn ledger_keys(write: &JobItem, older: bool) -> impl Iterator<Item = String> + '_ {
    children_of(write).flat_map(move |c| {
        std::iter::once(c.key.clone()).chain(c.older_key.clone().filter(|_| older))
    })
}

/// One-write finishes whose keys no other write of the batch names (nor
/// they twice), and the rest: one statement cannot tell who took a key
/// named twice.
fn keys_used_once(writes: Vec<JobItem>) -> (Vec<JobItem>, Vec<JobItem>) {
    let mut uses: HashMap<String, usize> = HashMap::new();
    for write in &writes {
        for key in ledger_keys(write, true) {
            *uses.entry(key).or_default() += 1;
        }
    }
    writes
        .into_iter()
        .partition(|w| ledger_keys(w, true).all(|k| uses.get(&k) == Some(&1)))
}

/// The row set of ledger rows born succeeded (as `queries::DONE_COLS`).
fn done_row_set(writes: &[JobItem]) -> RowSet {
    let rows: Vec<(&JobItem, &ChildEffect)> = writes
        .iter()
        .flat_map(|w| children_of(w).map(move |c| (w, c)))
        .collect();
    let plugin = |w: &JobItem| match &w.change {
        JobChange::SucceedWithChildren { plugin, .. } => plugin.clone(),
        _ => String::new(),
    };
    RowSet::new()
        .texts(rows.iter().map(|(_, c)| c.key.clone()))
        .ints(rows.iter().map(|(w, _)| w.fence.id.0))
        .texts(rows.iter().map(|(w, _)| plugin(w)))
        .texts(
            rows.iter()
                .map(|_| crate::providers::JOBS_PROVIDER.to_string()),
        )
        .texts(rows.iter().map(|(_, c)| c.fingerprint.clone()))
}

/// Ids of dead-letter writes that redact their payload.
fn redacted_ids(writes: &[JobItem]) -> Vec<JobId> {
    writes
        .iter()
        .filter(|w| {
            matches!(
                w.change,
                JobChange::Dead {
                    redact_payload: true,
                    ..
                }
            )
        })
        .map(|w| w.fence.id)
        .collect()
}

/// Sets the replacement payloads of redacting dead-letter writes. The
/// payload was read in this transaction and no other writer changes it
/// while the fence holds; the update re-checks the fence.
fn redact(writes: &mut [JobItem], payloads: &HashMap<i64, Vec<u8>>) {
    for write in writes {
        if let JobChange::Dead {
            redact_payload: true,
            ..
        } = write.change
        {
            write.redacted = payloads
                .get(&write.fence.id.0)
                .filter(|p| !input::is_redacted(p))
                .map(|p| input::redacted_payload(p));
        }
    }
}

/// The row set of one statement of job writes: the fence, then the
/// columns of the kind (as `queries` declares them).
fn job_row_set(kind: JobKind, writes: &[JobItem]) -> Result<RowSet> {
    let rows = RowSet::new()
        .ints(writes.iter().map(|w| w.fence.id.0))
        .texts(writes.iter().map(|w| w.fence.worker.clone()))
        .ints(writes.iter().map(|w| i64::from(w.fence.attempt)));
    let hash = |w: &JobItem| match &w.change {
        JobChange::SavePlan { plugin_hash, .. }
        | JobChange::SucceedWithChildren { plugin_hash, .. } => Some(plugin_hash.clone()),
        JobChange::Succeed { plugin_hash, .. }
        | JobChange::Retry { plugin_hash, .. }
        | JobChange::Dead { plugin_hash, .. } => plugin_hash.clone(),
        _ => None,
    };
    let part = |w: &JobItem, i: usize| w.error.as_ref().map(|e| [&e.0, &e.1, &e.2][i].clone());
    Ok(match kind {
        JobKind::Heartbeat => rows
            .ints(writes.iter().map(|w| match &w.change {
                JobChange::Heartbeat { lease, .. } => input::millis(*lease),
                _ => 0,
            }))
            .ints(writes.iter().map(|w| match &w.change {
                JobChange::Heartbeat { started, .. } => i64::from(*started),
                _ => 0,
            })),
        JobKind::SavePlan => rows
            .opt_texts(writes.iter().map(|w| match &w.change {
                JobChange::SavePlan { plan, .. } => Some(plan.clone()),
                _ => None,
            }))
            .opt_texts(writes.iter().map(hash)),
        JobKind::Succeed => rows
            .opt_texts(writes.iter().map(hash))
            .opt_texts(writes.iter().map(|w| match &w.change {
                JobChange::Succeed { plan, .. } => plan.clone(),
                JobChange::SucceedWithChildren { plan, .. } => Some(plan.clone()),
                _ => None,
            })),
        JobKind::Retry => rows
            .ints(writes.iter().map(|w| match &w.change {
                JobChange::Retry { delay, .. } => input::millis(*delay),
                _ => 0,
            }))
            .ints(writes.iter().map(|w| match &w.change {
                JobChange::Retry {
                    refund_attempt: true,
                    ..
                } => 1,
                _ => 0,
            }))
            .opt_texts(writes.iter().map(hash))
            .opt_texts(writes.iter().map(|w| part(w, 0)))
            .opt_texts(writes.iter().map(|w| part(w, 1)))
            .opt_texts(writes.iter().map(|w| part(w, 2))),
        JobKind::Dead => rows
            .opt_bytes(writes.iter().map(|w| w.redacted.clone()))
            .opt_texts(writes.iter().map(hash))
            .opt_texts(writes.iter().map(|w| part(w, 0)))
            .opt_texts(writes.iter().map(|w| part(w, 1)))
            .opt_texts(writes.iter().map(|w| part(w, 2))),
        JobKind::Release | JobKind::SucceedWithChildren => rows,
    })
}

/// The row set of effect claims (as `queries::CLAIM_COLS`).
fn claim_row_set(claims: &[ClaimItem]) -> RowSet {
    RowSet::new()
        .texts(claims.iter().map(|c| c.params.key.clone()))
        .ints(claims.iter().map(|c| c.params.job_id.0))
        .texts(claims.iter().map(|c| c.params.plugin.clone()))
        .texts(claims.iter().map(|c| c.params.provider.clone()))
        .texts(claims.iter().map(|c| c.params.fingerprint.clone()))
        .texts(claims.iter().map(|c| c.params.worker.clone()))
        .ints(claims.iter().map(|c| input::millis(c.params.lease)))
        .ints(claims.iter().map(|c| i64::from(c.params.job_attempt)))
}

/// The row set of claims on the one-statement path (as
/// `queries::FRESH_CLAIM_COLS`).
fn fresh_claim_row_set(claims: &[ClaimItem]) -> RowSet {
    claim_row_set(claims).opt_texts(
        claims
            .iter()
            .map(|c| c.params.older_key.as_ref().map(|o| o.key.clone())),
    )
}

/// What a takeover found of a key whose earlier try may have reached the
/// provider.
#[derive(Debug, Clone, Copy)]
struct Doubt {
    /// Since the first try was claimed.
    sent_ago: Duration,
    /// Since the latest try that may have reached the provider was claimed.
    tried_ago: Duration,
}

/// A span of milliseconds as read from the database (none or negative: zero).
fn millis(ms: Option<i64>) -> Duration {
    Duration::from_millis(u64::try_from(ms.unwrap_or(0)).unwrap_or(0))
}

/// The row set of one statement of effect writes.
fn effect_row_set(kind: EffectKind, writes: &[EffectItem]) -> RowSet {
    let rows = RowSet::new()
        .texts(writes.iter().map(|w| w.fence.key.clone()))
        .texts(writes.iter().map(|w| w.fence.worker.clone()))
        .ints(writes.iter().map(|w| i64::from(w.fence.attempt)));
    match kind {
        EffectKind::Succeed => rows.opt_texts(writes.iter().map(|w| w.result_ref.clone())),
        // The child's id is set once it is inserted.
        EffectKind::Child => rows.opt_texts(writes.iter().map(|_| None)),
        EffectKind::Fail => rows
            .opt_texts(
                writes
                    .iter()
                    .map(|w| w.status.map(|s| s.as_str().to_string())),
            )
            .opt_texts(writes.iter().map(|w| w.code.clone()))
            .ints(writes.iter().map(|w| {
                i64::from(matches!(
                    w.sent,
                    Some(Sent::MaybeApplied | Sent::Unresolved | Sent::HeldInDoubt)
                ))
            }))
            .ints(
                writes.iter().map(|w| {
                    i64::from(matches!(w.sent, Some(Sent::Unresolved | Sent::HeldInDoubt)))
                }),
            )
            // Whether this claim called the provider: one that did not puts
            // the latest try's time back.
            .ints(writes.iter().map(|w| {
                i64::from(matches!(
                    w.sent,
                    Some(Sent::MaybeApplied | Sent::Unresolved)
                ))
            })),
    }
}

/// The answers of a batch as they are found.
struct Answers {
    answers: Vec<Option<Written>>,
    /// A write made a job runnable at once (retry without delay, release).
    made_runnable: bool,
}

impl Answers {
    fn new(len: usize) -> Self {
        Answers {
            answers: vec![None; len],
            made_runnable: false,
        }
    }

    fn answer(&mut self, index: usize, written: Written) {
        if let Some(slot) = self.answers.get_mut(index) {
            *slot = Some(written);
        }
    }

    fn fences(&mut self, round: &[JobItem], applied: &[i64]) {
        let applied: HashSet<i64> = applied.iter().copied().collect();
        for write in round {
            let fence = if applied.contains(&write.fence.id.0) {
                if matches!(
                    write.change,
                    JobChange::Release
                        | JobChange::Retry {
                            delay: Duration::ZERO,
                            ..
                        }
                ) {
                    self.made_runnable = true;
                }
                Fence::Applied
            } else {
                Fence::FencedOut
            };
            self.answer(write.index, Written::Job(fence));
        }
    }

    fn effect_fences(&mut self, round: &[EffectItem], applied: &[String]) {
        let applied: HashSet<&String> = applied.iter().collect();
        for write in round {
            let fence = if applied.contains(&write.fence.key) {
                Fence::Applied
            } else {
                Fence::FencedOut
            };
            self.answer(write.index, Written::Effect { fence, child: None });
        }
    }

    /// Answers a claim that took the key; `doubt` (how long ago the first
    /// try was sent) when an earlier try may have been carried out.
    fn claimed(&mut self, claim: &ClaimItem, attempt: i64, doubt: Option<Doubt>) -> Result<()> {
        let attempt = u32::try_from(attempt).map_err(|_| {
            StoreError::Corrupt(format!("effect {:?}: attempt {attempt}", claim.params.key))
        })?;
        let fence = EffectFence {
            key: claim.params.key.clone(),
            worker: claim.params.worker.clone(),
            attempt,
        };
        let claimed = match doubt {
            None => EffectClaim::Claimed { fence },
            Some(Doubt {
                sent_ago,
                tried_ago,
            }) => EffectClaim::InDoubt {
                fence,
                sent_ago,
                tried_ago,
            },
        };
        self.answer(claim.index, Written::EffectClaim(claimed));
        Ok(())
    }

    fn finish(self) -> Result<Vec<Written>> {
        self.answers
            .into_iter()
            .map(|a| {
                a.ok_or_else(|| StoreError::Corrupt("a write of a batch was not answered".into()))
            })
            .collect()
    }
}

#[cfg(test)]
mod postgres_plans {
    //! How PostgreSQL plans the batched writes on a queue table whose
    //! statistics are stale (the last ANALYZE saw no running job): each
    //! must find its rows by key, without reading the table, and join them
    //! to the row set once. Both went wrong before: a hash join over a
    //! sequential scan of `jobs`, and a nested loop that read the whole row
    //! set again for every row (256 × 256 rows for a flush of 256).
    use super::*;
    use serde_json::Value;

    fn database_url() -> String {
        std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
    }

    /// Every node of a JSON plan, depth first.
    fn nodes(plan: &Value) -> Vec<&Value> {
        let mut out = vec![plan];
        if let Some(children) = plan.get("Plans").and_then(Value::as_array) {
            for child in children {
                out.extend(nodes(child));
            }
        }
        out
    }

    /// What is wrong with a plan, if anything.
    fn problems(plan: &Value) -> Vec<String> {
        let mut found = Vec::new();
        for node in nodes(plan) {
            let kind = node["Node Type"].as_str().unwrap_or("");
            let relation = node["Relation Name"].as_str().unwrap_or("");
            if kind == "Seq Scan" && (relation == "jobs" || relation == "effects") {
                found.push(format!("a sequential scan of {relation}"));
            }
            if let Some(index) = node["Index Name"].as_str()
                && relation == "jobs"
                && index != "jobs_pkey"
            {
                found.push(format!("rows found through {index}, not by key"));
            }
            if kind == "Nested Loop"
                && let Some(inner) = node["Plans"].as_array().and_then(|p| p.get(1))
                && inner["Node Type"] == "Function Scan"
            {
                found.push("the row set read again for every row".into());
            }
        }
        found
    }

    fn item(index: usize, id: i64, change: JobChange) -> JobItem {
        JobItem {
            index,
            fence: JobFence {
                id: JobId(id),
                worker: "w#1".into(),
                attempt: 1,
            },
            change,
            error: None,
            redacted: None,
        }
    }

    #[tokio::test]
    async fn batched_writes_find_their_rows_by_key_with_stale_statistics() {
        let schema = format!("idem_plans_{}", hex::encode(rand::random::<[u8; 6]>()));
        let store =
            super::super::postgres::connect_with_schema(&database_url(), &schema, Clock::Database)
                .await
                .expect("a PostgreSQL store");
        let pool = store.postgres_pool().expect("PostgreSQL").clone();
        let rows = "INSERT INTO jobs (queue, plugin, payload, run_at, state, attempt, \
                    max_attempts, lease_owner, correlation_id, created_at, updated_at) \
                    SELECT 'default', 'noop', '\\x7b7d', 1, $1, $2, 3, $3, 'c', 1, 1 \
                    FROM generate_series(1, $4)";
        sqlx::query(rows)
            .bind("succeeded")
            .bind(1i64)
            .bind(None::<String>)
            .bind(20_000i32)
            .execute(&pool)
            .await
            .expect("finished jobs");
        sqlx::query("ANALYZE jobs")
            .execute(&pool)
            .await
            .expect("analyze");
        sqlx::query(rows)
            .bind("running")
            .bind(1i64)
            .bind("w#1")
            .bind(512i32)
            .execute(&pool)
            .await
            .expect("running jobs");
        let running: Vec<i64> =
            sqlx::query_scalar("SELECT id FROM jobs WHERE state = 'running' ORDER BY id LIMIT 256")
                .fetch_all(&pool)
                .await
                .expect("running ids");
        let q = &store.q;
        let error = ErrorRecord {
            attempt: 1,
            class: crate::failure::ErrorClass::Retryable,
            code: "boom".into(),
            message: "boom".into(),
            at_ms: 0,
        };
        let statements: [(&str, &String, JobKind, JobChange); 6] = [
            (
                "heartbeat",
                &q.job_heartbeat,
                JobKind::Heartbeat,
                JobChange::Heartbeat {
                    lease: Duration::from_secs(30),
                    started: true,
                },
            ),
            (
                "save plan",
                &q.job_save_plan,
                JobKind::SavePlan,
                JobChange::SavePlan {
                    plan: "[]".into(),
                    plugin_hash: "h".into(),
                },
            ),
            (
                "succeed",
                &q.job_succeed,
                JobKind::Succeed,
                JobChange::Succeed {
                    plugin_hash: Some("h".into()),
                    plan: Some("[]".into()),
                },
            ),
            (
                "retry",
                &q.job_retry,
                JobKind::Retry,
                JobChange::Retry {
                    delay: Duration::from_secs(1),
                    error: Some(error.clone()),
                    refund_attempt: false,
                    plugin_hash: None,
                },
            ),
            (
                "dead",
                &q.job_dead,
                JobKind::Dead,
                JobChange::Dead {
                    error,
                    redact_payload: false,
                    plugin_hash: None,
                },
            ),
            (
                "release",
                &q.job_release,
                JobKind::Release,
                JobChange::Release,
            ),
        ];
        let mut wrong = Vec::new();
        for (name, statement, kind, change) in statements {
            let writes: Vec<JobItem> = running
                .iter()
                .enumerate()
                .map(|(i, id)| item(i, *id, change.clone()))
                .collect();
            let writes = match BatchPlan::new(
                writes
                    .into_iter()
                    .map(|w| Write::Job {
                        fence: w.fence,
                        change: w.change,
                    })
                    .collect(),
            ) {
                Ok(plan) => plan.jobs_of(kind),
                Err(e) => panic!("{name}: {e}"),
            };
            let row_set = job_row_set(kind, &writes).expect("a row set");
            let plan: Value = sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) {statement}"))
                .bind_rows(row_set)
                .fetch_one(&pool)
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            for problem in problems(&plan[0]["Plan"]) {
                wrong.push(format!("{name}: {problem}"));
            }
        }
        store.close().await;
        if let Ok(mut conn) =
            <sqlx::PgConnection as sqlx::Connection>::connect(&database_url()).await
        {
            let _ = sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                .execute(&mut conn)
                .await;
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
    }

    /// A hot group: 20,000 finished jobs (the last ANALYZE saw only those),
    /// then a running head, 3,000 blocked jobs behind it and 100 plain jobs.
    /// The group statements must read the group's index, never the primary
    /// key filtered by group (a claim took minutes that way in the groups
    /// review), and the claim must not read the blocked backlog at all.
    #[tokio::test]
    async fn group_statements_read_the_groups_index_with_stale_statistics() {
        let schema = format!("idem_plans_{}", hex::encode(rand::random::<[u8; 6]>()));
        let store =
            super::super::postgres::connect_with_schema(&database_url(), &schema, Clock::Database)
                .await
                .expect("a PostgreSQL store");
        let pool = store.postgres_pool().expect("PostgreSQL").clone();
        let rows = "INSERT INTO jobs (queue, plugin, payload, run_at, state, attempt, \
                    max_attempts, lease_owner, lease_until, correlation_id, created_at, \
                    updated_at, group_key) \
                    SELECT 'default', 'noop', '\\x7b7d', 1, $1, 0, 3, $2, $3, 'c', 1, 1, $4 \
                    FROM generate_series(1, $5)";
        let add = |state: &'static str,
                   owner: Option<&'static str>,
                   group: Option<&'static str>,
                   n: i32| {
            sqlx::query(rows)
                .bind(state)
                .bind(owner)
                .bind(owner.map(|_| i64::MAX / 2))
                .bind(group)
                .bind(n)
                .execute(&pool)
        };
        add("succeeded", None, Some("hot"), 20_000)
            .await
            .expect("finished");
        sqlx::query("ANALYZE jobs")
            .execute(&pool)
            .await
            .expect("analyze");
        add("running", Some("w#1"), Some("hot"), 1)
            .await
            .expect("head");
        add("blocked", None, Some("hot"), 3_000)
            .await
            .expect("backlog");
        add("available", None, None, 100).await.expect("plain");
        let blocked: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM jobs WHERE state = 'blocked' ORDER BY id DESC LIMIT 10",
        )
        .fetch_all(&pool)
        .await
        .expect("blocked ids");
        let q = &store.q;
        let mut tx = pool.begin().await.expect("begin");
        let mut wrong = Vec::new();
        let mut check = |name: &str, plan: &Value| {
            for node in nodes(&plan[0]["Plan"]) {
                let relation = node["Relation Name"].as_str().unwrap_or("");
                let kind = node["Node Type"].as_str().unwrap_or("");
                let index = node["Index Name"].as_str().unwrap_or("");
                let reads_group = [&node["Filter"], &node["Index Cond"]]
                    .iter()
                    .any(|v| v.as_str().is_some_and(|t| t.contains("group_key")));
                if relation != "jobs" {
                    continue;
                }
                if kind == "Seq Scan" {
                    wrong.push(format!("{name}: a sequential scan of jobs"));
                }
                if reads_group && index == "jobs_pkey" {
                    wrong.push(format!("{name}: a group read through the primary key"));
                }
                if index == "jobs_claim" && node["Rows Removed by Filter"].as_f64() > Some(0.0) {
                    wrong.push(format!(
                        "{name}: the claim read {} jobs it could not take",
                        node["Rows Removed by Filter"]
                    ));
                }
            }
        };
        let plan: Value =
            sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", q.job_claim))
                .bind("w#2")
                .bind(60_000i64)
                .bind("default")
                .bind(10i64)
                .bind("{}")
                .bind(3i64)
                .fetch_one(&mut *tx)
                .await
                .expect("claim plan");
        check("claim", &plan);
        let plan: Value = sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) {}", q.group_next))
            .bind(r#"["hot"]"#)
            .fetch_one(&mut *tx)
            .await
            .expect("group_next plan");
        check("group_next", &plan);
        let plan: Value = sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) {}", q.group_open))
            .bind(serde_json::to_string(&blocked).expect("ids"))
            .fetch_one(&mut *tx)
            .await
            .expect("group_open plan");
        check("group_open", &plan);
        tx.rollback().await.expect("rollback");
        store.close().await;
        if let Ok(mut conn) =
            <sqlx::PgConnection as sqlx::Connection>::connect(&database_url()).await
        {
            let _ = sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                .execute(&mut conn)
                .await;
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
    }
}

#[cfg(test)]
mod group_fence {
    //! The database itself refuses a second running job of a group (the
    //! guard for claims whose snapshots disagree on a group's head), and
    //! the claim recognises that refusal as contention to claim again.
    use super::*;

    fn grouped(group: &str) -> NewJob {
        NewJob {
            group: Some(group.into()),
            ..NewJob::new("g", b"{}".to_vec())
        }
    }

    /// Two jobs of one group, the first claimed: marking the second running
    /// by hand must fail on `jobs_group_running`.
    async fn second_running_is_refused(store: &SqlStore) -> sqlx::Error {
        let first = store.job_insert(grouped("order:1")).await.expect("insert");
        let second = store.job_insert(grouped("order:1")).await.expect("insert");
        let other = store.job_insert(grouped("order:2")).await.expect("insert");
        let claimed = store
            .job_claim(ClaimParams {
                queue: "default".into(),
                worker: "w".into(),
                limit: 10,
                lease: Duration::from_secs(60),
                queue_concurrency: None,
                max_attempts: Default::default(),
            })
            .await
            .expect("claim");
        let mut ids: Vec<JobId> = claimed.iter().map(|j| j.id).collect();
        ids.sort();
        assert_eq!(ids, vec![first.id, other.id]);
        let mark = "UPDATE jobs SET state = 'running' WHERE id = $1";
        let refused = match &store.pools {
            Pools::Sqlite { write, .. } => sqlx::query(mark)
                .bind(second.id.0)
                .execute(write)
                .await
                .map(|_| ()),
            Pools::Postgres(pool) => sqlx::query(mark)
                .bind(second.id.0)
                .execute(pool)
                .await
                .map(|_| ()),
        };
        refused.expect_err("a second running job of a group is refused")
    }

    #[tokio::test]
    async fn sqlite_refuses_a_second_running_job_of_a_group() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let store = super::super::sqlite::connect(&url, Clock::Adjustable)
            .await
            .expect("a SQLite store");
        let error = second_running_is_refused(&store).await;
        assert!(group_contention(&error), "{error}");
    }

    #[tokio::test]
    async fn postgres_refuses_a_second_running_job_of_a_group() {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string());
        let schema = format!("idem_groups_{}", hex::encode(rand::random::<[u8; 6]>()));
        let store = super::super::postgres::connect_with_schema(&url, &schema, Clock::Database)
            .await
            .expect("a PostgreSQL store");
        let error = second_running_is_refused(&store).await;
        let pool = store.postgres_pool().expect("PostgreSQL").clone();
        drop(store);
        let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .execute(&pool)
            .await;
        assert!(group_contention(&error), "{error}");
    }
}
