//! The `sql` provider: writes to the application's own database, exactly
//! once, through statements the operator declared by name.
//!
//! Two cases, one rule each:
//! - **the store's own database** (`url` absent or `"store"`, or equal to the
//!   store's URL): the statement runs in the transaction that marks its
//!   ledger row `succeeded` ([`Store::effect_succeed_with_statement`]), so a
//!   crash leaves both or neither;
//! - **another database**: a guard row `idem_effects(key, fingerprint,
//!   result_ref, at)` is written in the statement's own transaction there. A
//!   redelivery after a crash between that commit and the ledger's finds the
//!   key in the guard and completes the ledger without running the statement
//!   again.
//!
//! A plugin sends a statement name and typed values ([`SqlCall`]), never SQL
//! text; the values are always bound as parameters.
//!
//! [`Store::effect_succeed_with_statement`]: crate::store::Store::effect_succeed_with_statement

use super::config::ProviderConfig;
use super::{Dedupe, Delivered, Lookup, LookupPolicy, Provider};
use crate::effects::{Action, Effect, fingerprint};
use crate::failpoint::{self, Failpoint};
use crate::failure::{Code, Failure};
use crate::store::{RunStatement, StatementCall, classify_sql_error, declared_statement};
use idem_sdk::sql::SqlCall;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;
use tokio::sync::OnceCell;

/// The guard table a `sql` provider keeps in another database.
pub const GUARD_TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_effects (\
     key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, result_ref TEXT, at BIGINT NOT NULL)";

/// Guard rows are never pruned by idem, so the provider remembers a key for
/// as long as the target database keeps the row.
const GUARD_WINDOW: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A declared statement.
#[derive(Debug, Clone)]
struct Declared {
    sql: String,
    params: usize,
}

/// Where the statements run.
enum Target {
    /// The store's own database, in the ledger's transaction.
    Store,
    /// Another database, with a guard table there.
    Other {
        pool: OtherPool,
        guard_ready: OnceCell<()>,
    },
}

enum OtherPool {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

/// A `sql` provider.
///
/// ```no_run
/// # async fn demo() {
/// let config: idem::providers::ProviderConfig = toml::from_str(r#"
///     kind = "sql"
///     url = "postgres://app@127.0.0.1:5432/billing"
///     statements.create_invoice = "INSERT INTO invoices (order_id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING id"
/// "#).unwrap();
/// let provider = idem::providers::sql::SqlProvider::from_config("billing_db", &config, "sqlite://idem.db").unwrap();
/// # }
/// ```
pub struct SqlProvider {
    name: String,
    postgres: bool,
    statements: BTreeMap<String, Declared>,
    target: Target,
    timeout: Duration,
}

impl SqlProvider {
    /// Builds the provider; a pool to another database is opened lazily.
    /// `store_url` is the store's URL: a provider `url` equal to it (or
    /// absent, or `"store"`) runs in the store's transactions.
    pub fn from_config(
        name: &str,
        config: &ProviderConfig,
        store_url: &str,
    ) -> Result<Self, String> {
        if !config.base_url.is_empty() || config.from.is_some() || config.auth.is_some() {
            return Err(
                "a sql provider takes `url` and `statements`, not `base_url`, `from` or `auth`"
                    .into(),
            );
        }
        if config.lookup.is_some() {
            return Err(
                "a sql provider takes no `lookup`: on another database it answers from its \
                 guard table idem_effects, and on the store's own database an outcome is never \
                 in doubt"
                    .into(),
            );
        }
        if config.statements.is_empty() {
            return Err(
                "a sql provider declares at least one statement (`statements.NAME = \"...\"`)"
                    .into(),
            );
        }
        let mut statements = BTreeMap::new();
        for (statement, sql) in &config.statements {
            if sql.trim().is_empty() {
                return Err(format!("statement {statement:?} is empty"));
            }
            let params =
                declared_statement(sql).map_err(|why| format!("statement {statement:?}: {why}"))?;
            statements.insert(
                statement.clone(),
                Declared {
                    sql: sql.clone(),
                    params,
                },
            );
        }
        let target = match config.url.as_deref() {
            None | Some("store") => Target::Store,
            Some(url) if url == store_url => Target::Store,
            Some(url) => Target::Other {
                pool: open_pool(url, config)?,
                guard_ready: OnceCell::new(),
            },
        };
        let postgres = matches!(
            &target,
            Target::Other {
                pool: OtherPool::Postgres(_),
                ..
            }
        );
        Ok(SqlProvider {
            name: name.to_string(),
            postgres,
            statements,
            target,
            timeout: config.timeout,
        })
    }

    /// The longest one call may take: the statement, the guard row's lock
    /// wait and the commit.
    fn call_bound(&self) -> Duration {
        self.timeout * 2 + Duration::from_secs(5)
    }

    /// Whether the statements run in the store's own transactions.
    pub fn in_store(&self) -> bool {
        matches!(self.target, Target::Store)
    }

    /// The declared statement an effect names, with its values; refused
    /// (permanently) unless the effect is a statement call naming a
    /// declared statement with as many values as it has placeholders.
    pub fn call(&self, effect: &Effect) -> Result<StatementCall, Failure> {
        let Action::Custom { body } = &effect.action else {
            return Err(Failure::host(
                Code::UnsupportedAction,
                format!(
                    "the sql provider {:?} runs declared statements, not {} effects",
                    self.name,
                    effect.action.kind()
                ),
            ));
        };
        let call = SqlCall::from_body(body).map_err(|e| {
            Failure::host(
                Code::SqlStatementUnknown,
                format!(
                    "a sql effect carries a declared statement's name and typed parameters \
                     (Effect::sql), nothing else: {e}"
                ),
            )
        })?;
        let Some(declared) = self.statements.get(&call.statement) else {
            return Err(Failure::host(
                Code::SqlStatementUnknown,
                format!(
                    "the sql provider {:?} declares no statement {:?} (it declares {})",
                    self.name,
                    crate::failure::truncate(call.statement.clone(), 80),
                    self.statements
                        .keys()
                        .map(|k| format!("{k:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        };
        if call.params.len() != declared.params {
            return Err(Failure::host(
                Code::SqlParamsInvalid,
                format!(
                    "statement {:?} takes {} parameters, the effect gave {}",
                    call.statement,
                    declared.params,
                    call.params.len()
                ),
            ));
        }
        for (i, value) in call.params.iter().enumerate() {
            if let idem_sdk::SqlValue::Numeric(text) = value
                && !idem_sdk::sql::is_decimal(text)
            {
                return Err(Failure::host(
                    Code::SqlParamsInvalid,
                    format!(
                        "parameter ${} of statement {:?} is not a decimal number: {:?}",
                        i + 1,
                        call.statement,
                        crate::failure::truncate(text.clone(), 40)
                    ),
                ));
            }
        }
        Ok(StatementCall {
            name: call.statement,
            sql: declared.sql.clone(),
            params: call.params,
            timeout: self.timeout,
        })
    }

    /// Creates the guard table in another database (`idem migrate
    /// --provider NAME`); `false` when the provider writes to the store's
    /// own database, which needs none.
    pub async fn migrate(&self) -> Result<bool, Failure> {
        match &self.target {
            Target::Store => Ok(false),
            Target::Other { pool, guard_ready } => {
                ensure_guard(pool, guard_ready).await?;
                Ok(true)
            }
        }
    }
}

fn open_pool(url: &str, config: &ProviderConfig) -> Result<OtherPool, String> {
    let size = config.pool_size.max(1);
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(config.timeout)
            .connect_lazy(url)
            .map_err(|e| url_error(&e))?;
        Ok(OtherPool::Postgres(pool))
    } else if url.starts_with("sqlite:") {
        // The application's file as it is: not created when missing (a
        // typo would write invoices to a new empty file), its journal mode
        // left alone.
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| url_error(&e))?
            .busy_timeout(config.timeout);
        let pool = SqlitePoolOptions::new()
            .max_connections(size)
            .acquire_timeout(config.timeout)
            .connect_lazy_with(options);
        Ok(OtherPool::Sqlite(pool))
    } else {
        Err(format!(
            "url must be postgres://, sqlite: or \"store\", not {:?}",
            url.split("://").next().unwrap_or("")
        ))
    }
}

/// A URL the driver refuses, as text without its password (sqlx quotes
/// the URL in some of its configuration errors; this text is printed at
/// start-up).
fn url_error(error: &sqlx::Error) -> String {
    format!("url: {}", crate::boundary::redact_urls(&error.to_string()))
}

/// A database error of the provider (its message passes the boundary's
/// [`crate::boundary::message`] as every failure's does, so a URL in a
/// driver's text is redacted).
fn unavailable(provider: &str, error: &sqlx::Error) -> Failure {
    Failure::host(
        Code::SqlUnavailable,
        format!("the database of sql provider {provider:?} cannot be used: {error}"),
    )
}

/// Whether the guard table exists, read from the catalog: creating it needs
/// a right the application's role may lack (CREATE on the schema), and
/// several nodes starting at once would race for it.
const GUARD_EXISTS_PG: &str = "SELECT to_regclass('idem_effects') IS NOT NULL";
const GUARD_EXISTS_SQLITE: &str =
    "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'idem_effects')";

async fn ensure_guard(pool: &OtherPool, ready: &OnceCell<()>) -> Result<(), Failure> {
    ready
        .get_or_try_init(|| async {
            let result = match pool {
                OtherPool::Postgres(pool) => guard_table_pg(pool).await,
                OtherPool::Sqlite(pool) => guard_table_sqlite(pool).await,
            };
            // A guard that cannot be set up now may be set up later (by an
            // operator's `idem migrate --provider`): retryable, never a
            // statement's fault.
            result.map_err(|e| {
                Failure::host(
                    Code::SqlUnavailable,
                    format!(
                        "the guard table idem_effects cannot be read or created ({e}); \
                         create it with `idem migrate --provider NAME` as a role that may"
                    ),
                )
            })
        })
        .await
        .map(|_| ())
}

async fn guard_table_pg(pool: &PgPool) -> Result<(), sqlx::Error> {
    let present: bool = sqlx::query_scalar(GUARD_EXISTS_PG).fetch_one(pool).await?;
    if !present {
        sqlx::query(GUARD_TABLE_DDL).execute(pool).await?;
    }
    Ok(())
}

async fn guard_table_sqlite(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    let present: bool = sqlx::query_scalar(GUARD_EXISTS_SQLITE)
        .fetch_one(pool)
        .await?;
    if !present {
        sqlx::query(GUARD_TABLE_DDL).execute(pool).await?;
    }
    Ok(())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The guarded run on one pool type (inlined per database, as the store's
/// `with_db!`): guard row and statement in one transaction; a key found in
/// the guard is answered from it.
macro_rules! guarded {
    ($self:expr, $pool:expr, $call:expr, $key:expr, $fingerprint:expr) => {{
        let (provider, pool, call, key, fingerprint) = ($self, $pool, $call, $key, $fingerprint);
        let name = provider.name.as_str();
        let mut tx = pool.begin().await.map_err(|e| unavailable(name, &e))?;
        if provider.postgres {
            // Waiting for another holder's uncommitted guard row (a stale or
            // paused worker) is bounded as the statement is.
            let ms = call.timeout.as_millis();
            for limit in [
                format!("SET LOCAL statement_timeout = {ms}"),
                format!("SET LOCAL lock_timeout = {ms}"),
            ] {
                sqlx::query(&limit)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| unavailable(name, &e))?;
            }
        }
        let inserted = sqlx::query(
            "INSERT INTO idem_effects (key, fingerprint, at) VALUES ($1, $2, $3) \
             ON CONFLICT (key) DO NOTHING",
        )
        .bind(key)
        .bind(fingerprint)
        .bind(now_ms())
        .execute(&mut *tx)
        .await
        .map_err(|e| classify_sql_error(&e, "guard").unwrap_or_else(|| unavailable(name, &e)))?
        .rows_affected();
        if inserted == 0 {
            drop(tx);
            let row: Option<(String, Option<String>)> =
                sqlx::query_as("SELECT fingerprint, result_ref FROM idem_effects WHERE key = $1")
                    .bind(key)
                    .fetch_optional(pool)
                    .await
                    .map_err(|e| unavailable(name, &e))?;
            return match row {
                Some((stored, result_ref)) if stored == *fingerprint => {
                    tracing::info!(
                        result_ref = result_ref.as_deref().unwrap_or(""),
                        "the guard row says this statement ran before: not run again"
                    );
                    // Read back from a database outside idem: checked as
                    // any provider's answer.
                    Ok(Delivered {
                        result_ref: result_ref.as_deref().and_then(crate::boundary::result_ref),
                    })
                }
                Some(_) => Err(Failure::host(
                    Code::IdempotencyKeyConflict,
                    format!(
                        "the guard of {name:?} holds the key {key:?} for a different statement"
                    ),
                )),
                None => Err(Failure::host(
                    Code::SqlConflict,
                    format!("the guard row of {key:?} was removed while it was read"),
                )),
            };
        }
        let result_ref = match tx.run_statement(call).await {
            Ok(Ok(result_ref)) => result_ref,
            Ok(Err(refused)) => return Err(refused),
            Err(error) => return Err(unavailable(name, &error)),
        };
        if let Some(result_ref) = &result_ref {
            sqlx::query("UPDATE idem_effects SET result_ref = $2 WHERE key = $1")
                .bind(key)
                .bind(result_ref)
                .execute(&mut *tx)
                .await
                .map_err(|e| unavailable(name, &e))?;
        }
        failpoint::hit(Failpoint::AfterStatement)
            .await
            .map_err(|e| Failure::host(Code::SqlUnavailable, e.to_string()))?;
        // Past this point the commit may have happened even when it reports
        // an error: ambiguous, retried under the guard.
        tx.commit()
            .await
            .map_err(|e| match classify_sql_error(&e, &call.name) {
                // The server answered: it rolled back (a deferred constraint, a
                // serialization failure), so the outcome is known.
                Some(refused) if matches!(e, sqlx::Error::Database(_)) => refused,
                _ => Failure::host(
                    Code::SqlCommitUnknown,
                    format!("committing statement {:?}: {e}", call.name),
                ),
            })?;
        Ok(Delivered { result_ref })
    }};
}

/// The guard row of a key on one pool type: its fingerprint and reference.
macro_rules! guard_row {
    ($pool:expr, $key:expr) => {
        sqlx::query_as::<_, (String, Option<String>)>(
            "SELECT fingerprint, result_ref FROM idem_effects WHERE key = $1",
        )
        .bind($key)
        .fetch_optional($pool)
        .await
    };
}

impl SqlProvider {
    /// The guard's answer for `key`: its row decides (the guard row commits
    /// with the statement, so a row means it ran, and no row that it did
    /// not, or not yet: a statement still in flight commits later, and a
    /// second run then finds the row and does not run again).
    async fn guard_answer(
        &self,
        pool: &OtherPool,
        key: &str,
        fingerprint: &str,
    ) -> Result<Lookup, Failure> {
        let row = match pool {
            OtherPool::Postgres(pool) => guard_row!(pool, key),
            OtherPool::Sqlite(pool) => guard_row!(pool, key),
        }
        .map_err(|e| {
            Failure::host(
                Code::LookupUnavailable,
                format!(
                    "the guard table of sql provider {:?} cannot be read: {e}",
                    self.name
                ),
            )
        })?;
        match row {
            Some((stored, result_ref)) if stored == fingerprint => Ok(Lookup::Applied {
                // Read back from a database outside idem: checked as any
                // provider's answer.
                result_ref: result_ref.as_deref().and_then(crate::boundary::result_ref),
            }),
            Some(_) => Err(Failure::host(
                Code::LookupUnanswerable,
                format!(
                    "the guard of {:?} holds the key {} for a different statement \
                     (a key conflict): neither this request applied nor not",
                    self.name,
                    crate::boundary::shown(key)
                ),
            )),
            None => Ok(Lookup::NotApplied),
        }
    }

    async fn run_guarded(
        &self,
        pool: &OtherPool,
        call: &StatementCall,
        key: &str,
        fingerprint: &String,
    ) -> Result<Delivered, Failure> {
        match pool {
            OtherPool::Postgres(pool) => guarded!(self, pool, call, key, fingerprint),
            OtherPool::Sqlite(pool) => guarded!(self, pool, call, key, fingerprint),
        }
    }
}

#[async_trait::async_trait]
impl Provider for SqlProvider {
    fn dedupe(&self) -> Dedupe {
        // The ledger's own transaction, or the guard table, makes a second
        // run of the same key a no-op.
        Dedupe::Native {
            window: GUARD_WINDOW,
        }
    }

    fn timeout(&self) -> Duration {
        self.call_bound()
    }

    fn check(&self, effect: &Effect) -> Result<(), Failure> {
        self.call(effect).map(|_| ())
    }

    /// Another database is asked through its guard table, at once (a row
    /// commits with its statement: nothing lags); the store's own database
    /// is never in doubt (the statement commits with the ledger).
    fn lookup_policy(&self) -> Option<LookupPolicy> {
        match self.target {
            Target::Store => None,
            Target::Other { .. } => Some(LookupPolicy {
                settle: Duration::ZERO,
                timeout: self.call_bound(),
            }),
        }
    }

    /// The guard row of `key`: with `fingerprint`, applied (with its
    /// reference); with another, a key conflict (`lookup_unanswerable`);
    /// none, not applied. A database that cannot be reached, or a guard
    /// table that cannot be read, is `lookup_unavailable`.
    async fn look_up(&self, key: &str, fingerprint: &str) -> Result<Lookup, Failure> {
        let Target::Other { pool, guard_ready } = &self.target else {
            return Err(Failure::host(
                Code::LookupUnanswerable,
                "a statement on the store's own database commits with its ledger row: \
                 its outcome is never in doubt",
            ));
        };
        let bound = self.call_bound();
        let ask = async {
            ensure_guard(pool, guard_ready)
                .await
                .map_err(|failure| Failure::host(Code::LookupUnavailable, failure.message))?;
            self.guard_answer(pool, key, fingerprint).await
        };
        match tokio::time::timeout(bound, ask).await {
            Ok(answer) => answer,
            Err(_) => Err(Failure::host(
                Code::LookupUnavailable,
                format!(
                    "the guard table of sql provider {:?} did not answer within {}",
                    self.name,
                    humantime::format_duration(bound)
                ),
            )),
        }
    }

    fn in_store_transaction(&self, effect: &Effect) -> Option<Result<StatementCall, Failure>> {
        self.in_store().then(|| self.call(effect))
    }

    async fn execute(&self, effect: &Effect) -> Result<Delivered, Failure> {
        let call = self.call(effect)?;
        let Target::Other { pool, guard_ready } = &self.target else {
            return Err(Failure::host(
                Code::UnsupportedAction,
                "a statement on the store's own database runs in the store's transaction",
            ));
        };
        ensure_guard(pool, guard_ready).await?;
        let key = effect.idempotency_key.as_str();
        let fingerprint = fingerprint(effect);
        // The whole call is bounded (a commit that hangs on a dead
        // connection included); past the bound the outcome is unknown, and
        // the guard makes the retry safe.
        let bound = self.call_bound();
        let run = self.run_guarded(pool, &call, key, &fingerprint);
        match tokio::time::timeout(bound, run).await {
            Ok(result) => result,
            Err(_) => Err(Failure::host(
                Code::SqlCommitUnknown,
                format!(
                    "statement {:?} did not finish within {}: it may have committed",
                    call.name,
                    humantime::format_duration(bound)
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_sdk::SqlValue;

    fn config(text: &str) -> ProviderConfig {
        toml::from_str(text).expect("config")
    }

    fn provider() -> SqlProvider {
        SqlProvider::from_config(
            "billing_db",
            &config(
                "kind = \"sql\"\nstatements.create_invoice = \"INSERT INTO invoices VALUES ($1, $2)\"",
            ),
            "sqlite://idem.db",
        )
        .expect("provider")
    }

    fn effect(body: Vec<u8>) -> Effect {
        Effect {
            provider: "billing_db".into(),
            idempotency_key: "p/order:1".into(),
            action: Action::Custom { body },
        }
    }

    fn call(statement: &str, params: Vec<SqlValue>) -> Vec<u8> {
        SqlCall {
            statement: statement.into(),
            params,
        }
        .to_body()
    }

    #[test]
    fn configurations_that_cannot_work_are_refused_at_start() {
        let refused = |text: &str| {
            SqlProvider::from_config("db", &config(text), "sqlite://idem.db")
                .err()
                .unwrap_or_else(|| panic!("accepted: {text}"))
        };
        assert!(refused("kind = \"sql\"").contains("at least one statement"));
        assert!(refused("kind = \"sql\"\nstatements.a = \"  \"").contains("empty"));
        assert!(
            refused("kind = \"sql\"\nbase_url = \"http://x\"\nstatements.a = \"SELECT 1\"")
                .contains("base_url")
        );
        assert!(
            refused("kind = \"sql\"\nurl = \"mysql://x\"\nstatements.a = \"SELECT 1\"")
                .contains("postgres://")
        );
        assert!(
            refused(
                "kind = \"sql\"\nurl = \"sqlite://b.db\"\nstatements.a = \"SELECT 1\"\n\
                 lookup = { path = \"/x/{key}\" }"
            )
            .contains("answers from its guard table")
        );
    }

    #[test]
    fn the_stores_own_database_is_recognised() {
        assert!(provider().in_store(), "no url");
        assert_eq!(provider().lookup_policy(), None, "never in doubt there");
        let same = SqlProvider::from_config(
            "db",
            &config("kind = \"sql\"\nurl = \"store\"\nstatements.a = \"SELECT 1\""),
            "sqlite://idem.db",
        )
        .unwrap();
        assert!(same.in_store(), "url = \"store\"");
    }

    #[test]
    fn only_a_declared_statement_with_its_parameters_is_accepted() {
        let p = provider();
        let ok = p
            .call(&effect(call(
                "create_invoice",
                vec!["o-1".into(), 5.into()],
            )))
            .unwrap();
        assert_eq!(ok.sql, "INSERT INTO invoices VALUES ($1, $2)");
        assert_eq!(ok.params.len(), 2);
        let code = |body: Vec<u8>| p.call(&effect(body)).unwrap_err().code;
        assert_eq!(code(call("drop_all", vec![])), "sql_statement_unknown");
        assert_eq!(
            code(b"DROP TABLE invoices".to_vec()),
            "sql_statement_unknown"
        );
        assert_eq!(
            code(br#"{"statement":"create_invoice","sql":"DROP TABLE invoices"}"#.to_vec()),
            "sql_statement_unknown"
        );
        assert_eq!(
            code(call("create_invoice", vec!["o-1".into()])),
            "sql_params_invalid"
        );
        assert_eq!(
            code(call(
                "create_invoice",
                vec!["o-1".into(), SqlValue::Numeric("1e9".into())]
            )),
            "sql_params_invalid"
        );
        let email = Effect {
            action: Action::Email {
                to: vec!["a@b.c".into()],
                subject: String::new(),
                text: None,
                html: None,
                template: None,
            },
            ..effect(vec![])
        };
        assert_eq!(p.call(&email).unwrap_err().code, "unsupported_action");
        assert!(p.in_store_transaction(&email).is_some_and(|c| c.is_err()));
    }
}
