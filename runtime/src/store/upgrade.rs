//! One-time upgrades of stored rows that a migration asks for and Rust
//! carries out, when the work needs a function SQL does not have.
//!
//! A migration inserts a task's name into `idem_upgrade_tasks`; the store
//! runs every task it finds there right after the migrations, at open, and
//! deletes the task's row when done. A task is idempotent, so two nodes
//! opening the store at once both running it do no harm.
//!
//! - `redact_error_urls` (issue 24, migrations postgres 0009 / sqlite
//!   0008): error messages stored before URLs were redacted held provider
//!   URLs with their credentials (a webhook's secret path, `?api_key=`, a
//!   password). Every job's `last_error_message` and the `message` of each
//!   record in its `errors` are passed through
//!   [`crate::boundary::redact_urls`], the very function that redacts new
//!   messages, so old and new rows read alike. (A regular expression in
//!   the migration would be a second definition of the rule, and SQLite
//!   has none.)

use super::dialect::WritePool;
use super::error::Result;
use sqlx::{PgPool, SqlitePool};

/// The task of migrations postgres 0009 and sqlite 0008.
const REDACT_ERROR_URLS: &str = "redact_error_urls";

/// Rows read and rewritten per transaction.
const BATCH: i64 = 500;

/// The redacted `(last_error_message, errors)` of a job, `None` when
/// nothing changes. `errors` is the stored JSON array of error records;
/// text that is not such an array is redacted as text.
fn redacted(message: Option<&str>, errors: &str) -> Option<(Option<String>, String)> {
    let new_message = message.map(|m| crate::boundary::redact_urls(m).into_owned());
    let mut changed = new_message.as_deref() != message;
    let new_errors = match serde_json::from_str::<Vec<serde_json::Value>>(errors) {
        Ok(mut records) => {
            for record in &mut records {
                if let Some(serde_json::Value::String(text)) = record.get_mut("message") {
                    let redacted = crate::boundary::redact_urls(text).into_owned();
                    if redacted != *text {
                        *text = redacted;
                        changed = true;
                    }
                }
            }
            serde_json::to_string(&records).unwrap_or_else(|_| errors.to_string())
        }
        Err(_) => {
            let redacted = crate::boundary::redact_urls(errors).into_owned();
            changed |= redacted != errors;
            redacted
        }
    };
    changed.then_some((new_message, new_errors))
}

/// The statements of the redaction pass in one dialect.
struct RedactSql {
    /// Jobs after `$1` whose messages may hold a URL, `$2` at most, locked
    /// where the dialect can (SQLite's one writer needs no lock).
    select: &'static str,
    /// Sets `last_error_message = $2, errors = $3` of job `$1`.
    update: &'static str,
}

const POSTGRES_SQL: RedactSql = RedactSql {
    select: "SELECT id, last_error_message, errors::text FROM jobs \
             WHERE id > $1 AND (last_error_message LIKE '%://%' OR errors::text LIKE '%://%') \
             ORDER BY id LIMIT $2 FOR UPDATE",
    update: "UPDATE jobs SET last_error_message = $2, errors = $3::jsonb WHERE id = $1",
};

const SQLITE_SQL: RedactSql = RedactSql {
    select: "SELECT id, last_error_message, errors FROM jobs \
             WHERE id > $1 AND (last_error_message LIKE '%://%' OR errors LIKE '%://%') \
             ORDER BY id LIMIT $2",
    update: "UPDATE jobs SET last_error_message = $2, errors = $3 WHERE id = $1",
};

/// The task, written once for both pools (their types differ, the steps
/// do not): batches of [`BATCH`] jobs in their own transactions, then the
/// task's row deleted.
macro_rules! redact_error_urls {
    ($pool:expr, $sql:expr) => {{
        let pending: Option<String> =
            sqlx::query_scalar("SELECT name FROM idem_upgrade_tasks WHERE name = $1")
                .bind(REDACT_ERROR_URLS)
                .fetch_optional($pool)
                .await?;
        if pending.is_none() {
            return Ok(());
        }
        let mut after = 0_i64;
        loop {
            // A write transaction from its first statement (SQLite's
            // `BEGIN IMMEDIATE`): a deferred one that reads, then writes,
            // fails at once with SQLITE_BUSY when another node writes,
            // instead of waiting its turn, and the store would not open.
            let mut tx = $pool.begin_write().await?;
            let rows: Vec<(i64, Option<String>, String)> = sqlx::query_as($sql.select)
                .bind(after)
                .bind(BATCH)
                .fetch_all(&mut *tx)
                .await?;
            for (id, message, errors) in &rows {
                if let Some((message, errors)) = redacted(message.as_deref(), errors) {
                    sqlx::query($sql.update)
                        .bind(id)
                        .bind(message)
                        .bind(errors)
                        .execute(&mut *tx)
                        .await?;
                }
            }
            tx.commit().await?;
            match rows.last() {
                Some((id, ..)) if rows.len() as i64 == BATCH => after = *id,
                _ => break,
            }
        }
        sqlx::query("DELETE FROM idem_upgrade_tasks WHERE name = $1")
            .bind(REDACT_ERROR_URLS)
            .execute($pool)
            .await?;
        tracing::info!("stored error messages: provider URLs redacted");
        Ok(())
    }};
}

/// Runs the pending tasks on a PostgreSQL store.
pub(crate) async fn run_postgres(pool: &PgPool) -> Result<()> {
    redact_error_urls!(pool, POSTGRES_SQL)
}

/// Runs the pending tasks on a SQLite store (on its one writer).
pub(crate) async fn run_sqlite(pool: &SqlitePool) -> Result<()> {
    redact_error_urls!(pool, SQLITE_SQL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_error_records_are_redacted_and_others_left_alone() {
        let errors = r#"[{"attempt":1,"class":"retryable","code":"provider_unreachable","message":"cannot connect: error sending request for url (https://h/T0/SECRET?api_key=SECRET)","at_ms":5},{"attempt":2,"class":"permanent","code":"x","message":"plain","at_ms":6}]"#;
        let (message, new_errors) =
            redacted(Some("for url (https://h/T0/SECRET?api_key=SECRET)"), errors)
                .expect("changed");
        assert_eq!(message.as_deref(), Some("for url (https://h/\u{2026})"));
        assert!(!new_errors.contains("SECRET"), "{new_errors}");
        let records: Vec<serde_json::Value> = serde_json::from_str(&new_errors).unwrap();
        assert_eq!(records[0]["at_ms"], 5);
        assert_eq!(records[1]["message"], "plain");
        assert!(
            records[0]["message"]
                .as_str()
                .unwrap()
                .ends_with("(https://h/\u{2026})")
        );
        assert_eq!(redacted(Some("no url"), "[]"), None);
        assert_eq!(redacted(None, r#"[{"message":"see https://h/"}]"#), None);
        assert_eq!(
            redacted(message.as_deref(), &new_errors),
            None,
            "twice changes nothing"
        );
    }
}
