//! The embedded store's dialect: one SQLite file in WAL mode.
//!
//! SQLite has one writer at a time, so a store opens **one writer
//! connection** beside a pool of readers: every write of this process queues
//! for that connection instead of spinning in SQLite's busy handler, and the
//! group commit in front of the store turns many writes into one
//! transaction. Write transactions open with `BEGIN IMMEDIATE`, so they take
//! the lock up front and wait for it (`busy_timeout`) when another process
//! (the CLI) writes, instead of failing when a read transaction upgrades.
//! `synchronous = FULL`: a committed write survives power loss. Wake-ups are
//! in-process only: other processes are found by the poll interval.

use super::dialect::{BackendKind, BindRows, ColType, Dialect, DialectConn, RowSet, WritePool};
use super::queries::{Clock, Queries};
use super::sql::{Pools, SqlStore};
use super::{Enqueued, NewJob, Result, StoreError, input};
use sqlx::sqlite::{
    SqliteArguments, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool,
    SqlitePoolOptions, SqliteSynchronous,
};
use std::str::FromStr;
use std::sync::LazyLock;
use std::time::Duration;

/// How long a statement waits for another process's write lock.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Pooled reader connections to a file database.
pub const READERS: u32 = 8;
/// How long a call waits for a pooled connection.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// SQLite's SQL: JSON1 functions, `unixepoch('subsec')` (3.42+), row sets
/// as one JSON array parameter.
pub(crate) const DIALECT: Dialect = Dialect {
    kind: BackendKind::Sqlite,
    // SQLite keeps `now` fixed within one statement step, so every row of
    // one `UPDATE ... RETURNING` sees the same time.
    now: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    errors_col: "errors",
    skip_locked: "",
    for_update: "",
    share_skip_locked: "",
    lock_jobs: "",
    greatest: "max",
    fence_eq: |column, value, _| format!("+{column} = '{value}'"),
    ids_in: |column, subquery| format!("{column} IN ({subquery})"),
    // SQLite drives a row-set join from the row set already.
    row_keys: |_, _| String::new(),
    json_param: |param| param.to_string(),
    json_object: |pairs| format!("json_object({pairs})"),
    append_error: |record, now, keep| {
        format!(
            "(SELECT json_group_array(json(value) ORDER BY key) \
              FROM json_each(json_insert(errors, '$[#]', json_set({record}, '$.at_ms', {now}))) \
              WHERE key > json_array_length(errors) - {keep})"
        )
    },
    // A label as a path (`$.a.b`) would read a name with a dot as two.
    json_int_at: |param, key| format!("(SELECT value FROM json_each({param}) WHERE key = {key})"),
    int_list: |param| format!("SELECT value FROM json_each({param})"),
    text_list: |param| format!("SELECT value FROM json_each({param})"),
    rows: |cols| {
        let mut select = String::from("(SELECT j.key AS ord");
        for (i, (name, ty)) in cols.iter().enumerate() {
            let value = format!("j.value ->> {i}");
            match ty {
                ColType::Bytes => select.push_str(&format!(", unhex({value}) AS {name}")),
                ColType::Int | ColType::Text => select.push_str(&format!(", {value} AS {name}")),
            }
        }
        select.push_str(" FROM json_each($1) AS j) AS t");
        select
    },
};

/// The statements with the database clock, for functions that run on a
/// caller's connection ([`job_insert_in`]).
static QUERIES: LazyLock<Queries> = LazyLock::new(|| Queries::new(&DIALECT, Clock::Database));

/// Opens (creating if missing) the database at `url` (`sqlite://PATH` or
/// `sqlite::memory:`) and applies migrations.
///
/// ```no_run
/// # async fn demo() -> idem::store::Result<()> {
/// let store = idem::store::sqlite::connect("sqlite://idem.db", idem::store::Clock::Database).await?;
/// # Ok(()) }
/// ```
pub async fn connect(url: &str, clock: Clock) -> Result<SqlStore> {
    // Several processes opening a brand-new file at the same instant race:
    // switching it to WAL can answer "database is locked" at once, and
    // SQLite has no migration lock, so the later migrator finds the first
    // table there. A fresh look a moment later sees the other's finished
    // work and has nothing left to do.
    let mut tries = 0u64;
    loop {
        match connect_once(url, clock).await {
            Ok(store) => return Ok(store),
            Err(error)
                if tries < 5
                    && (error.is_transient() || matches!(error, StoreError::Migrate(_))) =>
            {
                tries += 1;
                tracing::debug!(%error, tries, "opening the SQLite store again");
                tokio::time::sleep(std::time::Duration::from_millis(25 * tries)).await;
            }
            Err(error) => return Err(error),
        }
    }
}

async fn connect_once(url: &str, clock: Clock) -> Result<SqlStore> {
    let in_memory = url.contains(":memory:") || url.contains("mode=memory");
    let options = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .busy_timeout(BUSY_TIMEOUT)
        .foreign_keys(true)
        .synchronous(SqliteSynchronous::Full)
        // A page cache and a mapping large enough for a busy queue's hot
        // pages; sort and temp tables in memory.
        .pragma("cache_size", "-65536")
        .pragma("mmap_size", "1073741824")
        .pragma("temp_store", "memory");
    let one_forever = || {
        SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(ACQUIRE_TIMEOUT)
    };
    let (read, write) = if in_memory {
        // Each connection to `:memory:` is its own database: one, forever,
        // for reads and writes.
        let pool = one_forever().connect_with(options).await?;
        (pool.clone(), pool)
    } else {
        let options = options.journal_mode(SqliteJournalMode::Wal);
        let write = one_forever().connect_with(options.clone()).await?;
        let read = SqlitePoolOptions::new()
            .max_connections(READERS)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options.read_only(false))
            .await?;
        (read, write)
    };
    super::migrations::SQLITE
        .migrator()
        .await?
        .run(&write)
        .await?;
    super::upgrade::run_sqlite(&write).await?;
    Ok(SqlStore::new(
        Pools::Sqlite { read, write },
        &DIALECT,
        clock,
    ))
}

/// Enqueues one job on the caller's connection, typically inside the
/// caller's own transaction (outbox pattern): the job exists only if that
/// transaction commits. Call [`SqlStore::notify_jobs`] after the commit to
/// wake this process's workers at once instead of at their next poll.
///
/// ```no_run
/// # async fn demo(store: &idem::store::SqlStore) -> idem::store::Result<()> {
/// use idem::store::{NewJob, sqlite::job_insert_in};
/// let pool = store.sqlite_pool().expect("a SQLite store");
/// let mut tx = pool.begin().await?;
/// // ... the caller's own writes on &mut *tx ...
/// job_insert_in(&mut tx, NewJob::new("send_invoice_email", b"{}".to_vec())).await?;
/// tx.commit().await?;
/// store.notify_jobs();
/// # Ok(()) }
/// ```
pub async fn job_insert_in(conn: &mut SqliteConnection, job: NewJob) -> Result<Enqueued> {
    let job = input::insertable(job)?;
    // SQLite has one writer: the group's head check is exact here too.
    super::sql::insert_one!(conn, &*QUERIES, &job, true)
}

impl WritePool for SqlitePool {
    type Db = sqlx::Sqlite;

    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>> {
        Ok(self.begin_with("BEGIN IMMEDIATE").await?)
    }

    async fn begin_claim(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>> {
        // Durability is the connection's setting in WAL mode, not the
        // transaction's: changing it per claim would cost two statements.
        self.begin_write().await
    }
}

impl<'q> BindRows for sqlx::query::Query<'q, sqlx::Sqlite, SqliteArguments<'q>> {
    fn bind_rows(self, rows: RowSet) -> Self {
        self.bind(rows.to_json())
    }
}

impl<'q, O> BindRows for sqlx::query::QueryAs<'q, sqlx::Sqlite, O, SqliteArguments<'q>> {
    fn bind_rows(self, rows: RowSet) -> Self {
        self.bind(rows.to_json())
    }
}

impl<'q, O> BindRows for sqlx::query::QueryScalar<'q, sqlx::Sqlite, O, SqliteArguments<'q>> {
    fn bind_rows(self, rows: RowSet) -> Self {
        self.bind(rows.to_json())
    }
}

impl DialectConn for SqliteConnection {
    async fn lock_queue(&mut self, _queue: &str) -> Result<()> {
        // `BEGIN IMMEDIATE` already made this transaction the only writer.
        Ok(())
    }

    async fn try_lock_pruning(&mut self) -> Result<bool> {
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each batched write finds its rows by key. Were SQLite to take an
    /// index on `state` or `status` for the fence, every row of a batch
    /// would scan all running jobs: a flush of B writes with R jobs running
    /// would cost B x R row visits.
    #[tokio::test]
    async fn batched_writes_look_rows_up_by_key() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("plan.db").display());
        let store = connect(&url, Clock::Database).await.expect("store");
        let pool = store.sqlite_pool().expect("a SQLite store").clone();
        let q = Queries::new(&DIALECT, Clock::Database);
        let batched = [
            ("job_heartbeat", &q.job_heartbeat),
            ("job_save_plan", &q.job_save_plan),
            ("job_succeed", &q.job_succeed),
            ("job_retry", &q.job_retry),
            ("job_dead", &q.job_dead),
            ("job_release", &q.job_release),
            ("effect_succeed", &q.effect_succeed),
            ("effect_fail", &q.effect_fail),
        ];
        for (name, statement) in batched {
            let plan: Vec<(i64, i64, i64, String)> =
                sqlx::query_as(&format!("EXPLAIN QUERY PLAN {statement}"))
                    .bind("[]")
                    .fetch_all(&pool)
                    .await
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            let lines: Vec<&str> = plan.iter().map(|row| row.3.as_str()).collect();
            let lookups: Vec<&&str> = lines
                .iter()
                .filter(|l| l.contains(" jobs") || l.contains(" effects"))
                .collect();
            assert!(!lookups.is_empty(), "{name}: no table lookup in {lines:?}");
            for line in lookups {
                assert!(
                    line.contains("INTEGER PRIMARY KEY") || line.contains("USING PRIMARY KEY"),
                    "{name} does not look its rows up by key: {lines:?}"
                );
            }
        }
    }
}
