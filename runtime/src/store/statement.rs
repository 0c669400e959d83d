//! Operator-declared statements of `sql` effects: binding typed parameters,
//! reading the result reference, and classifying what the database said.
//!
//! Written once for both databases and used twice: by the store, which runs
//! a statement in the transaction that marks its effect succeeded (the
//! provider's database is the store's own), and by the `sql` provider, which
//! runs it next to a guard row in another database. The statement text comes
//! from the operator's configuration; a plugin only picks it by name and
//! supplies values, always bound, never spliced into the text.

use crate::failure::{Code, Failure};
use idem_sdk::SqlValue;
use sqlx::postgres::{PgArguments, PgConnection, PgRow, PgTypeInfo};
use sqlx::query::Query;
use sqlx::sqlite::{SqliteArguments, SqliteConnection, SqliteRow};
use sqlx::{Either, Executor, Row, Statement, TypeInfo, ValueRef};
use std::time::Duration;

/// One declared statement with the values a plugin chose for it.
///
/// ```
/// use idem::store::StatementCall;
/// let call = StatementCall::new("create_invoice", "INSERT INTO invoices (order_id) VALUES ($1)", vec![idem_sdk::SqlValue::from("o-7")]);
/// assert_eq!(call.params.len(), 1);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct StatementCall {
    /// The name the operator declared it under (for messages).
    pub name: String,
    /// The operator's SQL, with `$1`, `$2`, ... placeholders.
    pub sql: String,
    /// Values for the placeholders, in order.
    pub params: Vec<SqlValue>,
    /// Longest the statement may run.
    pub timeout: Duration,
}

impl StatementCall {
    /// A call with the default timeout (5 s).
    pub fn new(name: &str, sql: &str, params: Vec<SqlValue>) -> Self {
        StatementCall {
            name: name.to_string(),
            sql: sql.to_string(),
            params,
            timeout: Duration::from_secs(5),
        }
    }
}

/// What running a statement for a claimed effect came to.
#[derive(Debug, Clone, PartialEq)]
pub enum StatementOutcome {
    /// The statement ran and the effect is marked succeeded, in one commit
    /// (with the job's success, when one was given).
    Applied {
        /// The reference read from `RETURNING`: the first column of the
        /// first returned row, if any.
        result_ref: Option<String>,
        /// `Some(Written::Job(Fence::Applied))` when the job's success
        /// ([`super::StatementParams::finish`]) committed with it; `None`
        /// when none was given or it was not written (the job fenced out,
        /// or its row locked by another writer, never waited for): the
        /// caller then writes the success the usual way, which answers
        /// which. The statement and its ledger row commit either way.
        finish: Option<super::Written>,
    },
    /// The effect's claim was taken over: nothing ran, nothing changed.
    FencedOut,
    /// The database refused the statement (rolled back, so nothing
    /// changed), classified.
    Refused(Failure),
}

/// Runs the statement on an open connection (inside the caller's
/// transaction) and reads its result reference. `Ok(Err(_))` is the
/// database refusing the statement or its values; `Err(_)` is the
/// connection failing, as any other store error.
pub(crate) trait RunStatement {
    /// See the trait.
    async fn run_statement(
        &mut self,
        call: &StatementCall,
    ) -> Result<Result<Option<String>, Failure>, sqlx::Error>;
}

impl RunStatement for PgConnection {
    async fn run_statement(
        &mut self,
        call: &StatementCall,
    ) -> Result<Result<Option<String>, Failure>, sqlx::Error> {
        let timeout = format!("SET LOCAL statement_timeout = {}", call.timeout.as_millis());
        sqlx::query(&timeout).execute(&mut *self).await?;
        let types: Vec<PgTypeInfo> = match (&mut *self).prepare(&call.sql).await {
            Ok(statement) => match statement.parameters() {
                Some(Either::Left(types)) => types.to_vec(),
                _ => Vec::new(),
            },
            Err(error) => return refused_or(error, call),
        };
        if let Err(failure) = check_count(call, types.len()) {
            return Ok(Err(failure));
        }
        let mut query = sqlx::query(&call.sql);
        for (i, (value, ty)) in call.params.iter().zip(&types).enumerate() {
            query = match bind_pg(query, value, ty) {
                Ok(query) => query,
                Err(why) => return Ok(Err(params_invalid(call, i, &why))),
            };
        }
        match query.fetch_optional(&mut *self).await {
            Ok(row) => Ok(row
                .map(|row| pg_result_ref(&row, call))
                .transpose()
                .map(Option::flatten)),
            Err(error) => refused_or(error, call),
        }
    }
}

impl RunStatement for SqliteConnection {
    async fn run_statement(
        &mut self,
        call: &StatementCall,
    ) -> Result<Result<Option<String>, Failure>, sqlx::Error> {
        let count = match (&mut *self).prepare(&call.sql).await {
            Ok(statement) => match statement.parameters() {
                Some(Either::Right(count)) => count,
                Some(Either::Left(types)) => types.len(),
                None => 0,
            },
            Err(error) => return refused_or(error, call),
        };
        if let Err(failure) = check_count(call, count) {
            return Ok(Err(failure));
        }
        let mut query = sqlx::query(&call.sql);
        for value in &call.params {
            query = bind_sqlite(query, value);
        }
        // SQLite has no statement timeout of its own: a progress handler
        // interrupts the statement at the deadline (SQLITE_INTERRUPT), so a
        // runaway statement gives the one writer connection back at once.
        // The deadline lives in a shared cell that a drop guard clears: if
        // this future is dropped before the handler is removed, the handler
        // left on the connection never interrupts anything again.
        let deadline = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(
            u64::try_from(call.timeout.as_millis()).unwrap_or(u64::MAX),
        ));
        let started = std::time::Instant::now();
        let cell = deadline.clone();
        self.lock_handle()
            .await?
            .set_progress_handler(1_000, move || {
                let limit = cell.load(std::sync::atomic::Ordering::Relaxed);
                u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX) < limit
            });
        let _disarm = Disarm(deadline);
        let result = query.fetch_optional(&mut *self).await;
        self.lock_handle().await?.remove_progress_handler();
        match result {
            Ok(row) => Ok(row
                .map(|row| sqlite_result_ref(&row, call))
                .transpose()
                .map(Option::flatten)),
            Err(error) => {
                let interrupted = matches!(&error, sqlx::Error::Database(db)
                    if db.code().is_some_and(|c| c.parse::<u32>().unwrap_or(0) & 0xff == 9));
                if interrupted {
                    // An interrupted write rolls its whole transaction back
                    // in SQLite, behind sqlx's back: open an empty one again
                    // so the caller's rollback finds it (when the transaction
                    // survived, this BEGIN fails and changes nothing).
                    if let Err(error) = sqlx::query("BEGIN").execute(&mut *self).await {
                        tracing::debug!(%error, "the interrupted transaction is still open");
                    }
                    return Ok(Err(Failure::host(
                        Code::SqlTimeout,
                        format!(
                            "statement {:?} ran longer than {} and was interrupted",
                            call.name,
                            humantime::format_duration(call.timeout)
                        ),
                    )));
                }
                refused_or(error, call)
            }
        }
    }
}

/// Clears a progress handler's deadline when dropped (see above).
struct Disarm(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl Drop for Disarm {
    fn drop(&mut self) {
        self.0.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
    }
}

fn check_count(call: &StatementCall, expected: usize) -> Result<(), Failure> {
    if call.params.len() == expected {
        return Ok(());
    }
    Err(Failure::host(
        Code::SqlParamsInvalid,
        format!(
            "statement {:?} takes {expected} parameters, the effect gave {}",
            call.name,
            call.params.len()
        ),
    ))
}

fn params_invalid(call: &StatementCall, index: usize, why: &str) -> Failure {
    Failure::host(
        Code::SqlParamsInvalid,
        format!(
            "parameter ${} of statement {:?}: {why}",
            index + 1,
            call.name
        ),
    )
}

/// A database's refusal becomes a classified failure; a connection failure
/// stays an error.
fn refused_or(
    error: sqlx::Error,
    call: &StatementCall,
) -> Result<Result<Option<String>, Failure>, sqlx::Error> {
    match classify(&error, &call.name) {
        Some(failure) => Ok(Err(failure)),
        None => Err(error),
    }
}

/// The class of what the database answered to a statement: a constraint
/// the statement does not handle is permanent (named); a statement or value
/// the database cannot take is permanent; conflicts, timeouts and an
/// unavailable database are retryable. `None` for failures that are not
/// the database's answer (I/O, pool, protocol).
///
/// ```
/// let failure = idem::store::classify_sql_error(&sqlx::Error::RowNotFound, "s");
/// assert!(failure.is_some());
/// ```
pub fn classify_sql_error(error: &sqlx::Error, statement: &str) -> Option<Failure> {
    classify(error, statement)
}

fn classify(error: &sqlx::Error, statement: &str) -> Option<Failure> {
    use sqlx::error::ErrorKind;
    let db = match error {
        sqlx::Error::Database(db) => db,
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) | sqlx::Error::RowNotFound => {
            return Some(Failure::host(
                Code::SqlResultUnreadable,
                format!("the result of statement {statement:?} cannot be read: {error}"),
            ));
        }
        sqlx::Error::Encode(_) | sqlx::Error::TypeNotFound { .. } => {
            return Some(Failure::host(
                Code::SqlParamsInvalid,
                format!("the values of statement {statement:?} cannot be sent: {error}"),
            ));
        }
        _ => return None,
    };
    let message = db.message();
    if matches!(
        db.kind(),
        ErrorKind::UniqueViolation
            | ErrorKind::ForeignKeyViolation
            | ErrorKind::NotNullViolation
            | ErrorKind::CheckViolation
    ) {
        let constraint = db.constraint().unwrap_or("");
        let named = if constraint.is_empty() {
            String::new()
        } else {
            format!(" {constraint:?}")
        };
        return Some(Failure::host(
            Code::SqlConstraintViolation,
            format!("statement {statement:?} violated the constraint{named}: {message}"),
        ));
    }
    let sqlstate = db.code().map(|c| c.into_owned()).unwrap_or_default();
    let code = if db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .is_some()
    {
        match sqlstate.as_str() {
            "40001" | "40P01" | "55P03" => Code::SqlConflict,
            "57014" => Code::SqlTimeout,
            // A read-only standby during failover, an idle-in-transaction
            // timeout: the database, not the statement.
            s if s.starts_with("08")
                || s.starts_with("53")
                || s.starts_with("57P")
                || s.starts_with("25") =>
            {
                Code::SqlUnavailable
            }
            s if s.starts_with("23") => Code::SqlConstraintViolation,
            s if s.starts_with("22") || s == "54000" => Code::SqlParamsInvalid,
            // "cached plan must not change result type" after an ALTER TABLE.
            "0A000" if message.contains("cached plan") => Code::SqlFailed,
            s if s.starts_with("42") || s.starts_with("0A") => Code::SqlStatementInvalid,
            _ => Code::SqlFailed,
        }
    } else {
        // SQLite's (extended) result codes.
        match sqlstate.parse::<u32>().unwrap_or(0) & 0xff {
            5 | 6 => Code::SqlConflict,
            8 | 10 | 13 | 14 => Code::SqlUnavailable,
            19 => Code::SqlConstraintViolation,
            18 | 20 | 25 => Code::SqlParamsInvalid,
            1 => Code::SqlStatementInvalid,
            _ => Code::SqlFailed,
        }
    };
    Some(Failure::host(
        code,
        format!("statement {statement:?}: {message} (code {sqlstate})"),
    ))
}

type PgQuery<'q> = Query<'q, sqlx::Postgres, PgArguments>;
type SqliteQuery<'q> = Query<'q, sqlx::Sqlite, SqliteArguments<'q>>;

/// Binds a value as the type PostgreSQL inferred for its placeholder, or
/// says why it does not fit. The types a plugin's values map to: text
/// (also varchar, char, name), the integers, numeric, the floats, boolean,
/// json and jsonb; other column types take a text parameter cast in the
/// statement (`$1::text::uuid`).
fn bind_pg<'q>(
    query: PgQuery<'q>,
    value: &SqlValue,
    ty: &PgTypeInfo,
) -> Result<PgQuery<'q>, String> {
    let name = ty.name();
    let refuse = || {
        Err(format!(
            "a {} value does not fit the parameter's type {}",
            value.kind(),
            name.to_lowercase()
        ))
    };
    let out_of_range = |v: i64| Err(format!("{v} is out of range for {}", name.to_lowercase()));
    Ok(match (name, value) {
        ("TEXT" | "VARCHAR" | "BPCHAR" | "CHAR" | "NAME" | "UNKNOWN", SqlValue::Text(t)) => {
            query.bind(t.clone())
        }

        ("INT8", SqlValue::Integer(v)) => query.bind(*v),
        ("INT4", SqlValue::Integer(v)) => match i32::try_from(*v) {
            Ok(v) => query.bind(v),
            Err(_) => return out_of_range(*v),
        },
        ("INT2", SqlValue::Integer(v)) => match i16::try_from(*v) {
            Ok(v) => query.bind(v),
            Err(_) => return out_of_range(*v),
        },
        ("INT8", SqlValue::Null) => query.bind(None::<i64>),
        ("INT4", SqlValue::Null) => query.bind(None::<i32>),
        ("INT2", SqlValue::Null) => query.bind(None::<i16>),
        ("NUMERIC", SqlValue::Numeric(text)) => match rust_decimal::Decimal::from_str_exact(text) {
            Ok(d) => query.bind(d),
            Err(e) => return Err(format!("{text:?} is not a decimal this host can send: {e}")),
        },
        ("NUMERIC", SqlValue::Integer(v)) => query.bind(rust_decimal::Decimal::from(*v)),
        ("NUMERIC", SqlValue::Null) => query.bind(None::<rust_decimal::Decimal>),
        // An integer is exact in a double up to 2^53 (a float up to 2^24);
        // larger ones are refused.
        ("FLOAT8", SqlValue::Integer(v)) if v.unsigned_abs() <= 1 << 53 => query.bind(*v as f64),
        ("FLOAT4", SqlValue::Integer(v)) if v.unsigned_abs() <= 1 << 24 => query.bind(*v as f32),
        ("FLOAT8", SqlValue::Numeric(text)) => match text.parse::<f64>() {
            Ok(f) => query.bind(f),
            Err(e) => return Err(format!("{text:?}: {e}")),
        },
        ("FLOAT8", SqlValue::Null) => query.bind(None::<f64>),
        ("FLOAT4", SqlValue::Null) => query.bind(None::<f32>),
        ("BOOL", SqlValue::Boolean(b)) => query.bind(*b),
        ("BOOL", SqlValue::Null) => query.bind(None::<bool>),
        ("JSON" | "JSONB", SqlValue::Json(v)) => query.bind(sqlx::types::Json(v.clone())),
        ("JSON" | "JSONB", SqlValue::Null) => {
            query.bind(None::<sqlx::types::Json<serde_json::Value>>)
        }
        // NULL fits every other type; a NULL carries no bytes to misread.
        (_, SqlValue::Null) => query.bind(None::<String>),
        _ => return refuse(),
    })
}

/// SQLite is dynamically typed: each value goes as its own type (a
/// numeric as its exact text, which a NUMERIC column converts; a boolean as
/// 0 or 1; JSON as its text).
fn bind_sqlite<'q>(query: SqliteQuery<'q>, value: &SqlValue) -> SqliteQuery<'q> {
    match value {
        SqlValue::Text(t) | SqlValue::Numeric(t) => query.bind(t.clone()),
        SqlValue::Integer(v) => query.bind(*v),
        SqlValue::Boolean(b) => query.bind(*b),
        SqlValue::Json(v) => query.bind(v.to_string()),
        SqlValue::Null => query.bind(None::<String>),
    }
}

fn unreadable(call: &StatementCall, type_name: &str) -> Failure {
    Failure::host(
        Code::SqlResultUnreadable,
        format!(
            "statement {:?} returns a {} as its first column: return an integer or text \
             (for example `RETURNING id::text`)",
            call.name,
            type_name.to_lowercase()
        ),
    )
}

fn pg_result_ref(row: &PgRow, call: &StatementCall) -> Result<Option<String>, Failure> {
    if row.columns().is_empty() {
        return Ok(None);
    }
    let raw = row
        .try_get_raw(0)
        .map_err(|e| classify(&e, &call.name).unwrap_or_else(|| unreadable(call, "value")))?;
    if raw.is_null() {
        return Ok(None);
    }
    let ty = raw.type_info().name().to_string();
    let text = match ty.as_str() {
        "INT8" => row.try_get::<i64, _>(0).map(|v| v.to_string()),
        "INT4" => row.try_get::<i32, _>(0).map(|v| v.to_string()),
        "INT2" => row.try_get::<i16, _>(0).map(|v| v.to_string()),
        "NUMERIC" => row
            .try_get::<rust_decimal::Decimal, _>(0)
            .map(|v| v.to_string()),
        "BOOL" => row.try_get::<bool, _>(0).map(|v| v.to_string()),
        "TEXT" | "VARCHAR" | "BPCHAR" | "CHAR" | "NAME" => row.try_get::<String, _>(0),
        other => return Err(unreadable(call, other)),
    };
    text.map(|t| crate::boundary::result_ref(&t))
        .map_err(|_| unreadable(call, &ty))
}

fn sqlite_result_ref(row: &SqliteRow, call: &StatementCall) -> Result<Option<String>, Failure> {
    if row.columns().is_empty() {
        return Ok(None);
    }
    let raw = row
        .try_get_raw(0)
        .map_err(|e| classify(&e, &call.name).unwrap_or_else(|| unreadable(call, "value")))?;
    if raw.is_null() {
        return Ok(None);
    }
    let ty = raw.type_info().name().to_string();
    let text = match ty.as_str() {
        "INTEGER" | "BOOLEAN" | "INT8" => row.try_get::<i64, _>(0).map(|v| v.to_string()),
        "REAL" => row.try_get::<f64, _>(0).map(|v| v.to_string()),
        "TEXT" => row.try_get::<String, _>(0),
        other => return Err(unreadable(call, other)),
    };
    text.map(|t| crate::boundary::result_ref(&t))
        .map_err(|_| unreadable(call, &ty))
}

/// The highest `$N` placeholder in `sql`, outside quoted text and comments:
/// how many parameters a declared statement takes, known at start-up.
///
/// ```
/// assert_eq!(idem::store::placeholder_count("SELECT $2, '$9', $1 -- $7"), 2);
/// ```
pub fn placeholder_count(sql: &str) -> usize {
    declared_statement(sql).unwrap_or(0)
}

/// Checks a declared statement's shape at start-up and counts its
/// placeholders: one statement, `$1`, `$2`, ... placeholders (not `?`), no
/// dollar-quoted text (its `$` would be miscounted).
///
/// ```
/// assert_eq!(idem::store::declared_statement("INSERT INTO t VALUES ($1, $2)"), Ok(2));
/// assert!(idem::store::declared_statement("INSERT INTO t VALUES (?)").is_err());
/// assert!(idem::store::declared_statement("DELETE FROM t; DROP TABLE t").is_err());
/// ```
pub fn declared_statement(sql: &str) -> Result<usize, String> {
    let bytes = sql.as_bytes();
    let (mut i, mut highest) = (0, 0);
    while i < bytes.len() {
        match bytes[i] {
            quote @ (b'\'' | b'"') => {
                i += 1;
                while i < bytes.len() && bytes[i] != quote {
                    i += 1;
                }
            }
            b'-' if bytes.get(i + 1) == Some(&b'-') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < bytes.len() && !(bytes[i] == b'*' && bytes[i + 1] == b'/') {
                    i += 1;
                }
                i += 1;
            }
            b'?' => return Err("write placeholders as $1, $2, ..., not ?".into()),
            b';' if !sql[i + 1..].trim().is_empty() => {
                return Err("declare one statement, not several".into());
            }
            b'$' => {
                let start = i + 1;
                let mut end = start;
                while end < bytes.len() && bytes[end].is_ascii_digit() {
                    end += 1;
                }
                if end > start {
                    let n: usize = sql[start..end].parse().unwrap_or(0);
                    highest = highest.max(n);
                } else if i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_')
                {
                    return Err(
                        "dollar-quoted text is not supported in a declared statement".into(),
                    );
                }
                i = end.max(i + 1) - 1;
            }
            _ => {}
        }
        i += 1;
    }
    Ok(highest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_counted_outside_text_and_comments() {
        assert_eq!(placeholder_count("INSERT INTO t VALUES ($1, $2)"), 2);
        assert_eq!(
            placeholder_count("SELECT '$3', \"$4\", $1 /* $5 */ -- $6\n"),
            1
        );
        assert_eq!(placeholder_count("SELECT 1"), 0);
        assert_eq!(placeholder_count("SELECT $10"), 10);
        assert_eq!(placeholder_count("SELECT col$x FROM t"), 0);
        assert!(declared_statement("SELECT $$ text $$").is_err());
        assert!(declared_statement("SELECT ?1").is_err());
        assert_eq!(declared_statement("SELECT '?', $1;  "), Ok(1));
    }
}
