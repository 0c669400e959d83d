//! The store for many nodes: PostgreSQL.
//!
//! Claims lock their rows with `FOR UPDATE SKIP LOCKED` in one statement, so
//! concurrent claimers on many machines never wait on each other nor take the
//! same job. A per-queue concurrency limit is counted under a transaction
//! advisory lock on the queue (a count without it would let two claimers both
//! see room for the last slot). Wake-ups: a trigger sends
//! `pg_notify('idem_jobs', queue)` in the writing transaction whenever a job
//! becomes runnable; each store runs one `LISTEN` task that wakes
//! [`Store::wait_for_jobs`]; the poll interval remains the fallback.

use super::shared::{self, Insertable, Slot, wake};
use super::*;
use sqlx::migrate::Migrator;
use sqlx::postgres::{
    PgArguments, PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgQueryResult,
    PgRow,
};
use sqlx::{Connection, Row};
use std::str::FromStr;
use tokio::sync::Notify;

static MIGRATOR: Migrator = sqlx::migrate!("../migrations/postgres");

/// Pooled connections (one of them is held by the `LISTEN` task).
pub const POOL_SIZE: u32 = 16;
/// How long a call waits for a pooled connection.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);
/// The notification channel; the payload is the queue name.
pub const CHANNEL: &str = "idem_jobs";

/// Advisory lock class of the per-queue claim lock (two-key form, so it
/// cannot collide with an application's single-key locks).
const CLAIM_LOCK_CLASS: i32 = 0x1de_0001;
/// Advisory lock class of pruning: one node at a time.
const PRUNE_LOCK_CLASS: i32 = 0x1de_0002;

/// Milliseconds since the epoch from the database clock (`clock_timestamp`,
/// not `now()`: inside a transaction `now()` is the transaction's start).
const NOW: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

const JOB_COLS: &str = "id, queue, plugin, payload, idempotency_key, priority, run_at, state, \
    attempt, max_attempts, lease_owner, lease_until, heartbeat_at, last_error_code, \
    last_error_message, errors::text AS errors, correlation_id, plugin_hash, plan, plan_hash, \
    rescues, created_at, updated_at, finished_at, first_failed_at, last_failed_at";

const EFFECT_COLS: &str = "key, job_id, plugin, provider, fingerprint, status, attempt, \
    lease_owner, lease_until, result_ref, last_error_code, last_error_at, created_at, updated_at";

/// The fence of every write that finishes or reschedules a job: `$1` id,
/// `$2` worker, `$3` attempt.
const FENCE: &str = "id = $1 AND state = 'running' AND lease_owner = $2 AND attempt = $3";

/// The fence of an effect: `$1` key, `$2` worker, `$3` attempt.
const EFFECT_FENCE: &str =
    "key = $1 AND lease_owner = $2 AND attempt = $3 AND status = 'processing'";

/// SET clauses recording one failure when `cond` holds: the record is
/// appended to the history (its `at_ms` set from the database clock, only the
/// newest [`ERROR_HISTORY`] kept) and the last-error columns follow.
fn record_error(cond: &str, record: &str, code: &str, message: &str) -> String {
    format!(
        "errors = CASE WHEN {cond} THEN (\
             SELECT COALESCE(jsonb_agg(t.e ORDER BY t.i), '[]'::jsonb) \
             FROM jsonb_array_elements(errors || jsonb_build_array(\
                 jsonb_set({record}, '{{at_ms}}', to_jsonb({{now}})))) WITH ORDINALITY AS t(e, i) \
             WHERE t.i > jsonb_array_length(errors) + 1 - {{history}}) \
         ELSE errors END, \
         last_error_code = CASE WHEN {cond} THEN {code} ELSE last_error_code END, \
         last_error_message = CASE WHEN {cond} THEN {message} ELSE last_error_message END, \
         first_failed_at = CASE WHEN {cond} THEN COALESCE(first_failed_at, {{now}}) ELSE first_failed_at END, \
         last_failed_at = CASE WHEN {cond} THEN {{now}} ELSE last_failed_at END"
    )
}

fn expand(text: &str) -> String {
    text.replace(
        "{record_error}",
        &record_error("$4::text IS NOT NULL", "$4::jsonb", "$5", "$6"),
    )
    .replace(
        "{record_lease_expired}",
        &record_error(
            "attempt >= max_attempts",
            "jsonb_build_object('attempt', attempt, 'class', 'ambiguous', 'code', 'lease_expired', \
             'message', 'the lease expired before the attempt finished', 'at_ms', 0)",
            "'lease_expired'",
            "'the lease expired before the attempt finished'",
        ),
    )
    .replace("{fence}", FENCE)
    .replace("{effect_fence}", EFFECT_FENCE)
    .replace("{job_cols}", JOB_COLS)
    .replace("{effect_cols}", EFFECT_COLS)
    .replace("{history}", &ERROR_HISTORY.to_string())
    .replace("{now}", NOW)
}

/// A statement with its placeholders expanded once.
macro_rules! sql {
    ($text:expr) => {{
        static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| expand($text));
        SQL.as_str()
    }};
}

type Query<'q> = sqlx::query::Query<'q, sqlx::Postgres, PgArguments>;

fn fenced<'q>(sql: &'q str, fence: &'q JobFence) -> Query<'q> {
    sqlx::query(sql)
        .bind(fence.id.0)
        .bind(&fence.worker)
        .bind(i64::from(fence.attempt))
}

fn effect_fenced<'q>(sql: &'q str, fence: &'q EffectFence) -> Query<'q> {
    sqlx::query(sql)
        .bind(&fence.key)
        .bind(&fence.worker)
        .bind(i64::from(fence.attempt))
}

fn fence_of(result: PgQueryResult) -> Fence {
    if result.rows_affected() > 0 {
        Fence::Applied
    } else {
        Fence::FencedOut
    }
}

fn jobs_from_rows(rows: &[PgRow]) -> Result<Vec<Job>> {
    rows.iter().map(shared::job_from_row).collect()
}

fn check_worker(worker: &str) -> Result<()> {
    if worker.is_empty() {
        return Err(StoreError::Invalid("worker id is empty".into()));
    }
    Ok(())
}

/// A schema name safe to splice into SQL unquoted-equivalent: lower case
/// ASCII letters, digits and `_`, not starting with a digit, at most 63 bytes.
fn check_schema(schema: &str) -> Result<()> {
    let mut bytes = schema.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b == b'_');
    let rest_ok = bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if first_ok && rest_ok && schema.len() <= 63 {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "schema name {schema:?}: use lower case letters, digits and _ (at most 63)"
        )))
    }
}

/// The PostgreSQL store.
///
/// ```no_run
/// # async fn demo() -> idem::store::Result<()> {
/// use idem::store::{NewJob, Store, postgres::PostgresStore};
/// let store = PostgresStore::connect("postgres://idem@db/idem").await?;
/// store.job_insert(NewJob::new("noop", b"{}".to_vec())).await?;
/// # Ok(()) }
/// ```
pub struct PostgresStore {
    pool: PgPool,
    notify: std::sync::Arc<Notify>,
    listener: tokio::task::JoinHandle<()>,
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl PostgresStore {
    /// Connects with the URL's own `search_path` (normally `public`) and
    /// applies migrations.
    ///
    /// ```no_run
    /// # async fn demo() -> idem::store::Result<()> {
    /// let store = idem::store::postgres::PostgresStore::connect("postgres://idem@db/idem").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self> {
        let options = PgConnectOptions::from_str(url)?;
        // One direct attempt first: an unreachable server fails at once with
        // its own error instead of after the pool's acquire timeout.
        PgConnection::connect_with(&options).await?.close().await?;
        Self::open(options).await
    }

    /// Connects to `schema` (created if missing; every pooled connection gets
    /// it as its `search_path`) and applies migrations there. Lets several
    /// idem deployments, or tests, share one database.
    ///
    /// ```no_run
    /// # async fn demo() -> idem::store::Result<()> {
    /// use idem::store::postgres::PostgresStore;
    /// let store = PostgresStore::connect_with_schema("postgres://idem@db/idem", "billing").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with_schema(url: &str, schema: &str) -> Result<Self> {
        check_schema(schema)?;
        let options = PgConnectOptions::from_str(url)?;
        let mut conn = PgConnection::connect_with(&options).await?;
        let created = sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
            .execute(&mut conn)
            .await;
        match created {
            Ok(_) => {}
            // Two nodes creating the schema at once: the loser's IF NOT
            // EXISTS can still trip over the winner's catalog row.
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some("23505" | "42P06")) => {}
            Err(e) => return Err(e.into()),
        }
        conn.close().await?;
        Self::open(options.options([("search_path", schema)])).await
    }

    async fn open(options: PgConnectOptions) -> Result<Self> {
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options)
            .await?;
        MIGRATOR.run(&pool).await?;
        let mut listener = PgListener::connect_with(&pool).await?;
        listener.listen(CHANNEL).await?;
        let notify = std::sync::Arc::new(Notify::new());
        let listener = tokio::spawn(listen(listener, notify.clone()));
        Ok(PostgresStore {
            pool,
            notify,
            listener,
        })
    }

    /// The connection pool, for callers that enqueue inside their own
    /// transaction with [`job_insert_in`].
    ///
    /// ```no_run
    /// # async fn demo(store: &idem::store::postgres::PostgresStore) -> idem::store::Result<()> {
    /// let mut tx = store.pool().begin().await?;
    /// # Ok(()) }
    /// ```
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn existing_child(&self, child: &NewJob) -> Result<Enqueued> {
        let id = match &child.idempotency_key {
            Some(key) => {
                sqlx::query_scalar::<_, i64>(
                    "SELECT id FROM jobs WHERE plugin = $1 AND idempotency_key = $2",
                )
                .bind(&child.plugin)
                .bind(key)
                .fetch_optional(&self.pool)
                .await?
            }
            None => None,
        };
        Ok(Enqueued {
            id: JobId(id.unwrap_or(0)),
            inserted: false,
        })
    }
}

/// Feeds notifications to the in-process waiters until the pool closes.
async fn listen(mut listener: PgListener, notify: std::sync::Arc<Notify>) {
    let mut backoff = Duration::from_millis(250);
    loop {
        match listener.try_recv().await {
            Ok(Some(_)) => {
                backoff = Duration::from_millis(250);
                wake(&notify);
            }
            // Reconnected: notifications sent meanwhile are lost, so look.
            Ok(None) => wake(&notify),
            Err(sqlx::Error::PoolClosed) => {
                wake(&notify);
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "job notifications lost; polling until LISTEN is back");
                wake(&notify);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// Enqueues one job on the caller's connection, typically inside the
/// caller's own transaction (outbox pattern): the job, and its wake-up
/// notification, exist only if that transaction commits.
///
/// ```no_run
/// # async fn demo(store: &idem::store::postgres::PostgresStore) -> idem::store::Result<()> {
/// use idem::store::{NewJob, postgres::job_insert_in};
/// let mut tx = store.pool().begin().await?;
/// // ... the caller's own writes on &mut *tx ...
/// job_insert_in(&mut tx, NewJob::new("send_invoice_email", b"{}".to_vec())).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn job_insert_in(conn: &mut PgConnection, job: NewJob) -> Result<Enqueued> {
    let job = shared::insertable(job)?;
    insert_one(conn, &job).await
}

async fn insert_one(conn: &mut PgConnection, job: &Insertable) -> Result<Enqueued> {
    // The conflicting job can be pruned between the insert and the read: try
    // again then (a few times; pruning only removes old finished jobs).
    for _ in 0..3 {
        let id: Option<i64> = sqlx::query_scalar(sql!(
            "INSERT INTO jobs (queue, plugin, payload, idempotency_key, priority, run_at, state, \
                 max_attempts, correlation_id, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, {now} + $6, 'available', $7, $8, {now}, {now}) \
             ON CONFLICT (plugin, idempotency_key) DO NOTHING \
             RETURNING id"
        ))
        .bind(&job.queue)
        .bind(&job.plugin)
        .bind(&job.payload)
        .bind(&job.idempotency_key)
        .bind(job.priority)
        .bind(job.delay_ms)
        .bind(job.max_attempts)
        .bind(&job.correlation_id)
        .fetch_optional(&mut *conn)
        .await?;
        if let Some(id) = id {
            return Ok(Enqueued {
                id: JobId(id),
                inserted: true,
            });
        }
        let existing: Option<i64> =
            sqlx::query_scalar("SELECT id FROM jobs WHERE plugin = $1 AND idempotency_key = $2")
                .bind(&job.plugin)
                .bind(&job.idempotency_key)
                .fetch_optional(&mut *conn)
                .await?;
        if let Some(id) = existing {
            return Ok(Enqueued {
                id: JobId(id),
                inserted: false,
            });
        }
    }
    Err(StoreError::Corrupt(format!(
        "job key {:?} of plugin {:?} conflicts on insert but cannot be read",
        job.idempotency_key, job.plugin
    )))
}

/// Inserts one chunk of fresh (not repeated within the batch) jobs as
/// arrays; returns their ids in input order with whether each was inserted.
async fn insert_chunk(conn: &mut PgConnection, jobs: &[&Insertable]) -> Result<Vec<Enqueued>> {
    let rows = sqlx::query(sql!(
        "INSERT INTO jobs (queue, plugin, payload, idempotency_key, priority, run_at, state, \
             max_attempts, correlation_id, created_at, updated_at) \
         SELECT t.queue, t.plugin, t.payload, t.idempotency_key, t.priority, {now} + t.delay_ms, \
             'available', t.max_attempts, t.correlation_id, {now}, {now} \
         FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::int4[], $6::int8[], \
                     $7::int8[], $8::text[]) \
             WITH ORDINALITY AS t(queue, plugin, payload, idempotency_key, priority, delay_ms, \
                                  max_attempts, correlation_id, ord) \
         ORDER BY t.ord \
         ON CONFLICT (plugin, idempotency_key) DO NOTHING \
         RETURNING id, plugin, idempotency_key"
    ))
    .bind(jobs.iter().map(|j| j.queue.clone()).collect::<Vec<_>>())
    .bind(jobs.iter().map(|j| j.plugin.clone()).collect::<Vec<_>>())
    .bind(jobs.iter().map(|j| j.payload.clone()).collect::<Vec<_>>())
    .bind(
        jobs.iter()
            .map(|j| j.idempotency_key.clone())
            .collect::<Vec<_>>(),
    )
    .bind(jobs.iter().map(|j| j.priority).collect::<Vec<_>>())
    .bind(jobs.iter().map(|j| j.delay_ms).collect::<Vec<_>>())
    .bind(jobs.iter().map(|j| j.max_attempts).collect::<Vec<_>>())
    .bind(
        jobs.iter()
            .map(|j| j.correlation_id.clone())
            .collect::<Vec<_>>(),
    )
    .fetch_all(&mut *conn)
    .await?;

    let mut keyed = std::collections::HashMap::new();
    let mut unkeyed = Vec::new();
    for row in &rows {
        let id: i64 = row.try_get("id")?;
        match row.try_get::<Option<String>, _>("idempotency_key")? {
            Some(key) => {
                keyed.insert((row.try_get::<String, _>("plugin")?, key), (id, true));
            }
            None => unkeyed.push(id),
        }
    }
    // Unkeyed rows cannot conflict; identity values are drawn in the SELECT's
    // order (ORDER BY ord), so sorted ids match the unkeyed inputs in order.
    unkeyed.sort_unstable();

    let missing: Vec<&&Insertable> = jobs
        .iter()
        .filter(|job| {
            job.idempotency_key
                .as_ref()
                .is_some_and(|key| !keyed.contains_key(&(job.plugin.clone(), key.clone())))
        })
        .collect();
    if !missing.is_empty() {
        let rows = sqlx::query(
            "SELECT id, plugin, idempotency_key FROM jobs \
             WHERE (plugin, idempotency_key) IN (SELECT * FROM unnest($1::text[], $2::text[]))",
        )
        .bind(missing.iter().map(|j| j.plugin.clone()).collect::<Vec<_>>())
        .bind(
            missing
                .iter()
                .map(|j| j.idempotency_key.clone())
                .collect::<Vec<_>>(),
        )
        .fetch_all(&mut *conn)
        .await?;
        for row in rows {
            let key: String = row.try_get("idempotency_key")?;
            keyed.insert((row.try_get("plugin")?, key), (row.try_get("id")?, false));
        }
    }

    let mut unkeyed = unkeyed.into_iter();
    jobs.iter()
        .map(|job| {
            let found = match &job.idempotency_key {
                Some(key) => keyed.get(&(job.plugin.clone(), key.clone())).copied(),
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

#[async_trait::async_trait]
impl Store for PostgresStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    async fn job_insert(&self, job: NewJob) -> Result<Enqueued> {
        let job = shared::insertable(job)?;
        let mut conn = self.pool.acquire().await?;
        insert_one(&mut conn, &job).await
    }

    async fn job_insert_many(&self, jobs: Vec<NewJob>) -> Result<Vec<Enqueued>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let jobs = jobs
            .into_iter()
            .map(shared::insertable)
            .collect::<Result<Vec<_>>>()?;
        let slots = shared::batch_slots(&jobs);
        let fresh: Vec<&Insertable> = jobs
            .iter()
            .zip(&slots)
            .filter(|(_, slot)| matches!(slot, Slot::Fresh))
            .map(|(job, _)| job)
            .collect();

        let mut tx = self.pool.begin().await?;
        let mut fresh_results = Vec::with_capacity(fresh.len());
        for chunk in fresh.chunks(shared::INSERT_CHUNK) {
            fresh_results.extend(insert_chunk(&mut tx, chunk).await?);
        }
        tx.commit().await?;

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
        Ok(results)
    }

    async fn job_get(&self, id: JobId) -> Result<Option<Job>> {
        let row = sqlx::query(sql!("SELECT {job_cols} FROM jobs WHERE id = $1"))
            .bind(id.0)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(shared::job_from_row).transpose()
    }

    async fn job_list(&self, filter: JobFilter) -> Result<Vec<Job>> {
        let mut sql = format!("SELECT {JOB_COLS} FROM jobs WHERE true");
        let mut n = 0;
        let mut param = || {
            n += 1;
            format!("${n}")
        };
        if !filter.states.is_empty() {
            // State names are our own constants: inlined, so the planner can
            // match the partial indexes.
            let names: Vec<String> = filter
                .states
                .iter()
                .map(|s| format!("'{}'", s.as_str()))
                .collect();
            sql.push_str(&format!(" AND state IN ({})", names.join(", ")));
        }
        if filter.plugin.is_some() {
            sql.push_str(&format!(" AND plugin = {}", param()));
        }
        if filter.error_code.is_some() {
            sql.push_str(&format!(" AND last_error_code = {}", param()));
        }
        if !filter.ids.is_empty() {
            sql.push_str(&format!(" AND id = ANY({})", param()));
        }
        sql.push_str(" ORDER BY id DESC");
        if filter.limit > 0 {
            sql.push_str(&format!(" LIMIT {}", param()));
        }
        let mut query = sqlx::query(&sql);
        if let Some(plugin) = &filter.plugin {
            query = query.bind(plugin);
        }
        if let Some(code) = &filter.error_code {
            query = query.bind(code);
        }
        if !filter.ids.is_empty() {
            query = query.bind(filter.ids.iter().map(|id| id.0).collect::<Vec<_>>());
        }
        if filter.limit > 0 {
            query = query.bind(i64::from(filter.limit));
        }
        jobs_from_rows(&query.fetch_all(&self.pool).await?)
    }

    async fn job_claim(&self, params: ClaimParams) -> Result<Vec<Job>> {
        check_worker(&params.worker)?;
        if params.limit == 0 {
            return Ok(Vec::new());
        }
        let claim = sql!(
            "WITH picked AS (\
                 SELECT id AS pid FROM jobs \
                 WHERE queue = $3 AND state IN ('available', 'retrying') AND run_at <= {now} \
                 ORDER BY priority DESC, run_at, id \
                 LIMIT $4 \
                 FOR UPDATE SKIP LOCKED) \
             UPDATE jobs SET state = 'running', attempt = attempt + 1, lease_owner = $1, \
                 lease_until = {now} + $2, heartbeat_at = {now}, updated_at = {now} \
             FROM picked WHERE jobs.id = picked.pid \
             RETURNING {job_cols}"
        );
        let mut tx = self.pool.begin().await?;
        let mut limit = i64::from(params.limit);
        if let Some(max) = params.queue_concurrency {
            // Claimers of this queue take turns here, so the count below sees
            // every committed claim before this one.
            sqlx::query(
                "SELECT pg_advisory_xact_lock($1, hashtext(current_schema() || ':' || $2))",
            )
            .bind(CLAIM_LOCK_CLASS)
            .bind(&params.queue)
            .execute(&mut *tx)
            .await?;
            let running: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM jobs WHERE state = 'running' AND queue = $1",
            )
            .bind(&params.queue)
            .fetch_one(&mut *tx)
            .await?;
            limit = limit.min(i64::from(max) - running);
            if limit <= 0 {
                tx.rollback().await?;
                return Ok(Vec::new());
            }
        }
        let rows = sqlx::query(claim)
            .bind(&params.worker)
            .bind(shared::millis(params.lease))
            .bind(&params.queue)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        // Decoded before the commit: an unreadable row rolls the claim back
        // instead of leaving jobs running that nobody works on.
        let mut jobs = jobs_from_rows(&rows)?;
        tx.commit().await?;
        // RETURNING has no defined order.
        jobs.sort_by(|a, b| {
            b.priority
                .cmp(&a.priority)
                .then(a.run_at_ms.cmp(&b.run_at_ms))
                .then(a.id.cmp(&b.id))
        });
        Ok(jobs)
    }

    async fn job_heartbeat(&self, params: HeartbeatParams) -> Result<Fence> {
        let result = fenced(
            sql!(
                "UPDATE jobs SET lease_until = {now} + $4, heartbeat_at = {now}, updated_at = {now} \
                 WHERE {fence}"
            ),
            &params.fence,
        )
        .bind(shared::millis(params.lease))
        .execute(&self.pool)
        .await?;
        Ok(fence_of(result))
    }

    async fn job_save_plan(
        &self,
        fence: &JobFence,
        plan: &str,
        plugin_hash: &str,
    ) -> Result<Fence> {
        // A redelivered job keeps its first plan: an existing plan is left as
        // it is, and the call still reports Applied when the fence holds.
        let result = fenced(
            sql!(
                "UPDATE jobs SET plan = COALESCE(plan, $4), \
                     plan_hash = CASE WHEN plan IS NULL THEN $5 ELSE plan_hash END, \
                     plugin_hash = $5, \
                     updated_at = {now} \
                 WHERE {fence}"
            ),
            fence,
        )
        .bind(plan)
        .bind(plugin_hash)
        .execute(&self.pool)
        .await?;
        Ok(fence_of(result))
    }

    async fn job_set_plugin_hash(&self, fence: &JobFence, plugin_hash: &str) -> Result<Fence> {
        let result = fenced(
            sql!("UPDATE jobs SET plugin_hash = $4, updated_at = {now} WHERE {fence}"),
            fence,
        )
        .bind(plugin_hash)
        .execute(&self.pool)
        .await?;
        Ok(fence_of(result))
    }

    async fn job_set_succeeded(&self, fence: &JobFence) -> Result<Fence> {
        let result = fenced(
            sql!(
                "UPDATE jobs SET state = 'succeeded', finished_at = {now}, lease_owner = NULL, \
                     lease_until = NULL, updated_at = {now} \
                 WHERE {fence}"
            ),
            fence,
        )
        .execute(&self.pool)
        .await?;
        Ok(fence_of(result))
    }

    async fn job_set_retrying(&self, params: RetryParams) -> Result<Fence> {
        let error = params.error.as_ref().map(shared::error_json).transpose()?;
        let (record, code, message) = match error {
            Some((record, code, message)) => (Some(record), Some(code), Some(message)),
            None => (None, None, None),
        };
        let result = fenced(
            sql!(
                "UPDATE jobs SET state = 'retrying', run_at = {now} + $7, \
                     attempt = GREATEST(attempt - $8, 0), lease_owner = NULL, lease_until = NULL, \
                     {record_error}, updated_at = {now} \
                 WHERE {fence}"
            ),
            &params.fence,
        )
        .bind(record)
        .bind(code)
        .bind(message)
        .bind(shared::millis(params.delay))
        .bind(i64::from(params.refund_attempt))
        .execute(&self.pool)
        .await?;
        Ok(fence_of(result))
    }

    async fn job_set_dead(&self, params: DeadParams) -> Result<Fence> {
        let (record, code, message) = shared::error_json(&params.error)?;
        let redacted = if params.redact_payload {
            // Read under the same fence; the update below re-checks it, and no
            // other writer changes the payload while the fence holds.
            let payload: Option<Vec<u8>> =
                sqlx::query_scalar(sql!("SELECT payload FROM jobs WHERE {fence}"))
                    .bind(params.fence.id.0)
                    .bind(&params.fence.worker)
                    .bind(i64::from(params.fence.attempt))
                    .fetch_optional(&self.pool)
                    .await?;
            match payload {
                Some(payload) => Some(shared::redacted_payload(&payload)),
                None => return Ok(Fence::FencedOut),
            }
        } else {
            None
        };
        let result = fenced(
            sql!(
                "UPDATE jobs SET state = 'dead', finished_at = {now}, lease_owner = NULL, \
                     lease_until = NULL, payload = COALESCE($7, payload), {record_error}, \
                     updated_at = {now} \
                 WHERE {fence}"
            ),
            &params.fence,
        )
        .bind(Some(record))
        .bind(code)
        .bind(message)
        .bind(redacted)
        .execute(&self.pool)
        .await?;
        Ok(fence_of(result))
    }

    async fn job_release(&self, fence: &JobFence) -> Result<Fence> {
        let result = fenced(
            sql!(
                "UPDATE jobs SET state = 'available', run_at = {now}, lease_owner = NULL, \
                     lease_until = NULL, updated_at = {now} \
                 WHERE {fence}"
            ),
            fence,
        )
        .execute(&self.pool)
        .await?;
        Ok(fence_of(result))
    }

    async fn job_rescue_expired(&self, limit: u32) -> Result<Vec<JobId>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let ids: Vec<i64> = sqlx::query_scalar(sql!(
            "WITH expired AS (\
                 SELECT id AS eid FROM jobs WHERE state = 'running' AND lease_until < {now} \
                 ORDER BY lease_until LIMIT $1 \
                 FOR UPDATE SKIP LOCKED) \
             UPDATE jobs SET \
                 state = CASE WHEN attempt >= max_attempts THEN 'dead' ELSE 'available' END, \
                 run_at = CASE WHEN attempt >= max_attempts THEN run_at ELSE {now} END, \
                 finished_at = CASE WHEN attempt >= max_attempts THEN {now} ELSE NULL END, \
                 rescues = rescues + 1, lease_owner = NULL, lease_until = NULL, \
                 {record_lease_expired}, updated_at = {now} \
             FROM expired WHERE jobs.id = expired.eid \
             RETURNING id"
        ))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut ids: Vec<JobId> = ids.into_iter().map(JobId).collect();
        ids.sort_unstable();
        Ok(ids)
    }

    async fn job_replay(&self, ids: &[JobId]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        // Effects of the replayed plans that failed permanently may be tried
        // again: the operator fixed the cause. Their keys stay the same.
        let ids: Vec<i64> = ids.iter().map(|id| id.0).collect();
        let mut tx = self.pool.begin().await?;
        let plans: Vec<Option<String>> = sqlx::query_scalar(
            "SELECT plan FROM jobs WHERE state = 'dead' AND id = ANY($1) FOR UPDATE",
        )
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
        let keys = shared::plan_keys(plans.iter().flatten());
        if !keys.is_empty() {
            sqlx::query(sql!(
                "UPDATE effects SET status = 'retrying', updated_at = {now} \
                 WHERE status = 'failed' AND key = ANY($1)"
            ))
            .bind(&keys)
            .execute(&mut *tx)
            .await?;
        }
        let result = sqlx::query(sql!(
            "UPDATE jobs SET state = 'available', attempt = 0, run_at = {now}, finished_at = NULL, \
                 lease_owner = NULL, lease_until = NULL, updated_at = {now} \
             WHERE state = 'dead' AND id = ANY($1)"
        ))
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(result.rows_affected())
    }

    async fn job_discard_plan(&self, id: JobId) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(
            "SELECT plan, payload FROM jobs WHERE id = $1 AND state = 'dead' FOR UPDATE",
        )
        .bind(id.0)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Ok(false);
        };
        let plan: Option<String> = row.try_get("plan")?;
        let payload: Vec<u8> = row.try_get("payload")?;
        // A redacted job cannot make a new plan: its plugin would be handed
        // the redaction reference instead of the payload.
        let (Some(plan), false) = (plan, shared::is_redacted(&payload)) else {
            return Ok(false);
        };
        let keys = shared::plan_keys(std::iter::once(&plan));
        if !keys.is_empty() {
            let done: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM effects WHERE (status <> 'failed' OR last_error_code = 'ambiguous_not_retried') AND key = ANY($1)",
            )
            .bind(&keys)
            .fetch_one(&mut *tx)
            .await?;
            if done > 0 {
                return Ok(false);
            }
            // This job's permanently failed keys go with the plan: the new
            // plan may use the same keys for corrected requests.
            sqlx::query(
                "DELETE FROM effects WHERE status = 'failed' AND job_id = $2 AND key = ANY($1)",
            )
            .bind(&keys)
            .bind(id.0)
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(sql!(
            "UPDATE jobs SET plan = NULL, plan_hash = NULL, updated_at = {now} \
             WHERE id = $1 AND state = 'dead'"
        ))
        .bind(id.0)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn job_cancel(&self, id: JobId) -> Result<bool> {
        let result = sqlx::query(sql!(
            "UPDATE jobs SET state = 'cancelled', finished_at = {now}, updated_at = {now} \
             WHERE id = $1 AND state IN ('available', 'retrying')"
        ))
        .bind(id.0)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() > 0)
    }

    async fn job_delete_finished(&self, params: PruneParams) -> Result<u64> {
        if params.limit == 0 {
            return Ok(0);
        }
        let mut tx = self.pool.begin().await?;
        let ours: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1, hashtext(current_schema()))")
                .bind(PRUNE_LOCK_CLASS)
                .fetch_one(&mut *tx)
                .await?;
        if !ours {
            // Another node is pruning right now.
            tx.rollback().await?;
            return Ok(0);
        }
        let result = sqlx::query(sql!(
            "DELETE FROM jobs WHERE id IN (\
                 SELECT id FROM jobs \
                 WHERE state IN ('succeeded', 'dead', 'cancelled') \
                   AND finished_at < {now} - LEAST($1, $2) \
                   AND ((state IN ('succeeded', 'cancelled') AND finished_at < {now} - $1) \
                        OR (state = 'dead' AND finished_at < {now} - $2)) \
                 ORDER BY finished_at LIMIT $3 \
                 FOR UPDATE SKIP LOCKED)"
        ))
        .bind(shared::millis(params.succeeded_older_than))
        .bind(shared::millis(params.dead_older_than))
        .bind(i64::from(params.limit))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(result.rows_affected())
    }

    async fn job_redact_payloads(&self, ids: &[JobId]) -> Result<u64> {
        let ids: Vec<i64> = ids.iter().map(|id| id.0).collect();
        let rows =
            sqlx::query("SELECT id, payload FROM jobs WHERE state = 'dead' AND id = ANY($1)")
                .bind(&ids)
                .fetch_all(&self.pool)
                .await?;
        let mut redacted = 0;
        for row in rows {
            let id: i64 = row.try_get("id")?;
            let payload: Vec<u8> = row.try_get("payload")?;
            if shared::is_redacted(&payload) {
                continue;
            }
            redacted += sqlx::query(sql!(
                "UPDATE jobs SET payload = $2, updated_at = {now} WHERE id = $1 AND state = 'dead'"
            ))
            .bind(id)
            .bind(shared::redacted_payload(&payload))
            .execute(&self.pool)
            .await?
            .rows_affected();
        }
        Ok(redacted)
    }

    async fn effect_delete_finished(&self, older_than: Duration, limit: u32) -> Result<u64> {
        let result = sqlx::query(sql!(
            "DELETE FROM effects WHERE key IN (\
                 SELECT key FROM effects \
                 WHERE status <> 'processing' AND updated_at < {now} - $1 \
                   AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.id = effects.job_id \
                                   AND jobs.state <> 'succeeded') \
                 ORDER BY updated_at LIMIT $2 \
                 FOR UPDATE SKIP LOCKED)"
        ))
        .bind(shared::millis(older_than))
        .bind(i64::from(limit))
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected())
    }

    async fn queue_stats(&self, queue: Option<&str>) -> Result<QueueStats> {
        let (counts, ready) = match queue {
            Some(queue) => {
                let counts = sqlx::query(
                    "SELECT state, count(*) AS n FROM jobs \
                     WHERE state IN ('available', 'running', 'retrying', 'succeeded', 'dead', 'cancelled') \
                       AND queue = $1 \
                     GROUP BY state",
                )
                .bind(queue)
                .fetch_all(&self.pool)
                .await?;
                let ready = sqlx::query(sql!(
                    "SELECT count(*) AS n, {now} - min(run_at) AS age FROM jobs \
                     WHERE queue = $1 AND state IN ('available', 'retrying') AND run_at <= {now}"
                ))
                .bind(queue)
                .fetch_one(&self.pool)
                .await?;
                (counts, ready)
            }
            None => {
                let counts = sqlx::query(
                    "SELECT state, count(*) AS n FROM jobs \
                     WHERE state IN ('available', 'running', 'retrying', 'succeeded', 'dead', 'cancelled') \
                     GROUP BY state",
                )
                .fetch_all(&self.pool)
                .await?;
                let ready = sqlx::query(sql!(
                    "SELECT count(*) AS n, {now} - min(run_at) AS age FROM jobs \
                     WHERE state IN ('available', 'retrying') AND run_at <= {now}"
                ))
                .fetch_one(&self.pool)
                .await?;
                (counts, ready)
            }
        };
        let mut by_state: Vec<(JobState, i64)> = JobState::ALL.iter().map(|s| (*s, 0)).collect();
        for row in &counts {
            let state = shared::parse_state(&row.try_get::<String, _>("state")?)?;
            let n: i64 = row.try_get("n")?;
            if let Some(slot) = by_state.iter_mut().find(|(s, _)| *s == state) {
                slot.1 = n;
            }
        }
        Ok(QueueStats {
            by_state,
            ready: ready.try_get("n")?,
            oldest_ready_age_ms: ready.try_get("age")?,
        })
    }

    async fn queue_is_drained(&self) -> Result<bool> {
        let drained: bool = sqlx::query_scalar(sql!(
            "SELECT NOT EXISTS (SELECT 1 FROM jobs WHERE state IN ('running', 'retrying')) \
                AND NOT EXISTS (SELECT 1 FROM jobs WHERE state = 'available' AND run_at <= {now})"
        ))
        .fetch_one(&self.pool)
        .await?;
        Ok(drained)
    }

    async fn wait_for_jobs(&self, timeout: Duration) {
        shared::wait(&self.notify, timeout).await;
    }

    async fn effect_claim(&self, params: EffectClaimParams) -> Result<EffectClaim> {
        shared::check_effect_claim(&params)?;
        let lease = shared::millis(params.lease);
        let claimed = |attempt: i64| -> Result<EffectClaim> {
            Ok(EffectClaim::Claimed {
                fence: EffectFence {
                    key: params.key.clone(),
                    worker: params.worker.clone(),
                    attempt: u32::try_from(attempt).map_err(|_| {
                        StoreError::Corrupt(format!("effect {:?}: attempt {attempt}", params.key))
                    })?,
                },
            })
        };
        let mut last_lease = None;
        // Each step is one atomic statement; a row that changes between the
        // failed update and the read (a lease expiring, a failure recorded)
        // is simply tried again.
        for _ in 0..5 {
            let inserted: Option<i64> = sqlx::query_scalar(sql!(
                "INSERT INTO effects (key, job_id, plugin, provider, fingerprint, status, attempt, \
                     lease_owner, lease_until, created_at, updated_at) \
                 VALUES ($1, $2, $3, $4, $5, 'processing', 1, $6, {now} + $7, {now}, {now}) \
                 ON CONFLICT (key) DO NOTHING RETURNING attempt"
            ))
            .bind(&params.key)
            .bind(params.job_id.0)
            .bind(&params.plugin)
            .bind(&params.provider)
            .bind(&params.fingerprint)
            .bind(&params.worker)
            .bind(lease)
            .fetch_optional(&self.pool)
            .await?;
            if let Some(attempt) = inserted {
                return claimed(attempt);
            }
            let updated: Option<i64> = sqlx::query_scalar(sql!(
                "UPDATE effects SET status = 'processing', attempt = attempt + 1, lease_owner = $2, \
                     lease_until = {now} + $3, updated_at = {now} \
                 WHERE key = $1 AND fingerprint = $4 AND status NOT IN ('succeeded', 'failed') \
                   AND (status <> 'processing' OR COALESCE(lease_until, 0) < {now}) \
                 RETURNING attempt"
            ))
            .bind(&params.key)
            .bind(&params.worker)
            .bind(lease)
            .bind(&params.fingerprint)
            .fetch_optional(&self.pool)
            .await?;
            if let Some(attempt) = updated {
                return claimed(attempt);
            }
            let row = sqlx::query(sql!(
                "SELECT fingerprint, status, lease_until, result_ref, last_error_code, {now} AS now \
                 FROM effects WHERE key = $1"
            ))
            .bind(&params.key)
            .fetch_optional(&self.pool)
            .await?;
            let Some(row) = row else { continue };
            if let Some(found) = shared::effect_outcome(&row, &params.fingerprint)? {
                return Ok(found);
            }
            last_lease = row.try_get::<Option<i64>, _>("lease_until")?;
        }
        // The row kept changing under us: another worker is busy with it.
        Ok(EffectClaim::LeasedByOther {
            lease_until_ms: last_lease.unwrap_or_default(),
        })
    }

    async fn effect_set_succeeded(
        &self,
        fence: &EffectFence,
        result_ref: Option<&str>,
    ) -> Result<Fence> {
        let result = effect_fenced(
            sql!(
                "UPDATE effects SET status = 'succeeded', result_ref = $4, lease_owner = NULL, \
                     lease_until = NULL, updated_at = {now} \
                 WHERE {effect_fence}"
            ),
            fence,
        )
        .bind(result_ref)
        .execute(&self.pool)
        .await?;
        Ok(fence_of(result))
    }

    async fn effect_set_failed(&self, params: EffectFailParams) -> Result<Fence> {
        shared::check_effect_failure(&params)?;
        let result = effect_fenced(
            sql!(
                "UPDATE effects SET status = $4, last_error_code = $5, last_error_at = {now}, \
                     lease_owner = NULL, lease_until = NULL, updated_at = {now} \
                 WHERE {effect_fence}"
            ),
            &params.fence,
        )
        .bind(params.status.as_str())
        .bind(&params.error_code)
        .execute(&self.pool)
        .await?;
        Ok(fence_of(result))
    }

    async fn effect_succeed_with_child(
        &self,
        fence: &EffectFence,
        child: NewJob,
    ) -> Result<(Fence, Enqueued)> {
        let job = shared::insertable(child.clone())?;
        let mut tx = self.pool.begin().await?;
        let enqueued = insert_one(&mut tx, &job).await?;
        let result = effect_fenced(
            sql!(
                "UPDATE effects SET status = 'succeeded', result_ref = $4, lease_owner = NULL, \
                     lease_until = NULL, updated_at = {now} \
                 WHERE {effect_fence}"
            ),
            fence,
        )
        .bind(enqueued.id.0.to_string())
        .execute(&mut *tx)
        .await?;
        if result.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok((Fence::FencedOut, self.existing_child(&child).await?));
        }
        tx.commit().await?;
        Ok((Fence::Applied, enqueued))
    }

    async fn effect_get(&self, key: &str) -> Result<Option<EffectRecord>> {
        let row = sqlx::query(sql!("SELECT {effect_cols} FROM effects WHERE key = $1"))
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(shared::effect_from_row).transpose()
    }

    async fn effect_list(&self, job_id: JobId) -> Result<Vec<EffectRecord>> {
        let rows = sqlx::query(sql!(
            "SELECT {effect_cols} FROM effects WHERE job_id = $1 ORDER BY created_at, key"
        ))
        .bind(job_id.0)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(shared::effect_from_row).collect()
    }
}
