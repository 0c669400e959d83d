//! What differs between the databases, and nothing else: a handful of SQL
//! expressions (the clock, JSON, lists, row sets, locking) and a few hooks
//! (how a write transaction begins, queue and pruning locks). Each backend
//! file defines one [`Dialect`] value and implements the hooks; the queries
//! themselves are written once in [`super::queries`].

use super::Result;

/// Which database a store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// One SQLite file (the embedded default).
    Sqlite,
    /// PostgreSQL (many nodes).
    Postgres,
}

impl BackendKind {
    /// `sqlite` or `postgres`.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Sqlite => "sqlite",
            BackendKind::Postgres => "postgres",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The type of a row-set column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ColType {
    /// 64-bit integer.
    Int,
    /// Text.
    Text,
    /// Bytes.
    Bytes,
}

/// The SQL that differs per database.
pub(crate) struct Dialect {
    /// Which database.
    pub kind: BackendKind,
    /// Milliseconds since the Unix epoch by the database clock.
    pub now: &'static str,
    /// The `errors` column read as JSON text.
    pub errors_col: &'static str,
    /// Appended to the claim's row picker (`FOR UPDATE SKIP LOCKED`).
    pub skip_locked: &'static str,
    /// Share-locks the rows a subquery reads, skipping rows locked by a
    /// writer (nothing on SQLite, which has one writer).
    pub share_skip_locked: &'static str,
    /// Locks the rows a select reads until the transaction ends (nothing
    /// on SQLite, whose write transaction holds the database).
    pub for_update: &'static str,
    /// Appended to a select of job rows that must not change until the
    /// transaction commits (`FOR SHARE OF jobs`).
    pub lock_jobs: &'static str,
    /// The larger of two integers (`max` / `GREATEST`).
    pub greatest: &'static str,
    /// `column = 'value'` in a batched write's fence against the row set
    /// `t` (whose column `key` is never NULL), written so that it neither
    /// picks an index nor narrows the database's estimate of the rows found
    /// by key: an index on `state`/`status` (partial indexes are keyed by
    /// them) would scan every running job, stale entries included, once
    /// per batch (PostgreSQL) or once per row of the batch (SQLite); and a
    /// PostgreSQL estimate of one row found makes it re-read the whole row
    /// set for every row (a nested loop over the row set).
    pub fence_eq: fn(column: &str, value: &str, key: &str) -> String,
    /// `column` (a primary key) is one of the values a subquery selects,
    /// written so the database runs the subquery once and looks each value
    /// up by its key (PostgreSQL plans `IN` as a join: a hash join reads
    /// the whole table on every claim, and a join may re-run a `LIMIT`ed
    /// subquery and so change more rows than the limit).
    ///
    /// Under READ COMMITTED, PostgreSQL re-checks only the target row's
    /// own conditions when a row changed while the statement waited for
    /// its lock, never the subquery's: a statement that picks rows by a
    /// condition repeats that condition outside the subquery.
    pub ids_in: fn(column: &str, subquery: &str) -> String,
    /// A condition (with a trailing `AND`, or nothing) that the first
    /// column of a row set bound at `$1` holds `column`, so the database
    /// finds the rows to change by their key instead of joining the whole
    /// table to the row set (PostgreSQL's planner picks a hash join over a
    /// sequential scan when its statistics of a churning queue are stale).
    pub row_keys: fn(column: &str, ty: ColType) -> String,
    /// A JSON text parameter as a JSON value.
    pub json_param: fn(param: &str) -> String,
    /// A JSON object built from `'key', value` pairs.
    pub json_object: fn(pairs: &str) -> String,
    /// The error history `errors` with `record` appended (its `at_ms` set to
    /// `now`), only the newest `keep` kept, as a column value.
    pub append_error: fn(record: &str, now: &str, keep: usize) -> String,
    /// The integer at key `key` (a text expression) of a JSON object
    /// parameter, NULL when absent.
    pub json_int_at: fn(param: &str, key: &str) -> String,
    /// The integers of a JSON array parameter, as a one-column subquery.
    pub int_list: fn(param: &str) -> String,
    /// The strings of a JSON array parameter, as a one-column subquery.
    pub text_list: fn(param: &str) -> String,
    /// A row set bound from parameters `$1..` as a FROM item named `t` with
    /// the given columns plus `ord` (input order, from 0 or 1).
    pub rows: fn(cols: &[(&str, ColType)]) -> String,
}

/// A batch of rows bound as one row set: each statement of a batch is one
/// round trip whatever the number of rows.
#[derive(Debug, Default)]
pub(crate) struct RowSet {
    pub columns: Vec<Column>,
}

/// One column of a [`RowSet`].
#[derive(Debug)]
pub(crate) enum Column {
    /// Integers.
    Int(Vec<Option<i64>>),
    /// Text.
    Text(Vec<Option<String>>),
    /// Bytes.
    Bytes(Vec<Option<Vec<u8>>>),
}

impl RowSet {
    /// An empty row set.
    pub fn new() -> Self {
        RowSet::default()
    }

    /// Adds an integer column.
    pub fn ints(mut self, values: impl IntoIterator<Item = i64>) -> Self {
        self.columns
            .push(Column::Int(values.into_iter().map(Some).collect()));
        self
    }

    /// Adds a text column.
    pub fn texts<S: Into<String>>(mut self, values: impl IntoIterator<Item = S>) -> Self {
        self.columns.push(Column::Text(
            values.into_iter().map(|v| Some(v.into())).collect(),
        ));
        self
    }

    /// Adds a text column with NULLs.
    pub fn opt_texts(mut self, values: impl IntoIterator<Item = Option<String>>) -> Self {
        self.columns
            .push(Column::Text(values.into_iter().collect()));
        self
    }

    /// Adds a bytes column with NULLs.
    pub fn opt_bytes(mut self, values: impl IntoIterator<Item = Option<Vec<u8>>>) -> Self {
        self.columns
            .push(Column::Bytes(values.into_iter().collect()));
        self
    }

    /// The row set as one JSON array of row arrays (bytes as hex), for
    /// databases without array parameters.
    pub fn to_json(&self) -> String {
        let len = self.columns.first().map_or(0, Column::len);
        let mut out = String::with_capacity(len * 32 + 2);
        out.push('[');
        for row in 0..len {
            if row > 0 {
                out.push(',');
            }
            out.push('[');
            for (i, column) in self.columns.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                column.write_json(row, &mut out);
            }
            out.push(']');
        }
        out.push(']');
        out
    }
}

impl Column {
    fn len(&self) -> usize {
        match self {
            Column::Int(v) => v.len(),
            Column::Text(v) => v.len(),
            Column::Bytes(v) => v.len(),
        }
    }

    fn write_json(&self, row: usize, out: &mut String) {
        use std::fmt::Write as _;
        match self {
            Column::Int(v) => match v.get(row).copied().flatten() {
                Some(n) => {
                    let _ = write!(out, "{n}");
                }
                None => out.push_str("null"),
            },
            Column::Text(v) => match v.get(row).and_then(Option::as_deref) {
                // serde_json escapes; a String always serialises.
                Some(text) => out.push_str(&serde_json::Value::from(text).to_string()),
                None => out.push_str("null"),
            },
            Column::Bytes(v) => match v.get(row).and_then(Option::as_deref) {
                Some(bytes) => {
                    out.push('"');
                    out.push_str(&hex::encode(bytes));
                    out.push('"');
                }
                None => out.push_str("null"),
            },
        }
    }
}

/// Binds a [`RowSet`] to a query the way its dialect's `rows` expects.
pub(crate) trait BindRows: Sized {
    /// The query with the row set bound from `$1`.
    fn bind_rows(self, rows: RowSet) -> Self;
}

/// How a write transaction begins, implemented on each pool type.
pub(crate) trait WritePool {
    /// The database.
    type Db: sqlx::Database;
    /// Begins a write transaction.
    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, Self::Db>>;
    /// Begins a write transaction whose commit need not wait until it is
    /// durable: for claims only. A claim lost in a database crash is an
    /// attempt lost, which every step after it already survives, and any
    /// later durable commit (a plan, a ledger claim, a finish) makes it
    /// durable first.
    async fn begin_claim(&self) -> Result<sqlx::Transaction<'static, Self::Db>>;
}

/// The hooks of one database, implemented on its connection type.
pub(crate) trait DialectConn {
    /// Serialises claimers of one queue until the transaction ends, so a
    /// queue-wide concurrency limit counts every committed claim.
    async fn lock_queue(&mut self, queue: &str) -> Result<()>;
    /// Takes the pruning lock for this transaction if no other node holds
    /// it; `false` means another node is pruning.
    async fn try_lock_pruning(&mut self) -> Result<bool>;
}
