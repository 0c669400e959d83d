//! Errors of the store, and the one retry rule for transient ones.

use std::sync::Arc;
use std::time::Duration;

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
    /// The batch this write was committed with failed as a whole; every
    /// write of the batch sees the same error.
    #[error("{0}")]
    Batch(Arc<StoreError>),
    /// The group-commit writer stopped before the write was committed: it
    /// may not have happened.
    #[error("the store's writer has stopped; the write was not committed")]
    WriterStopped,
    /// A failpoint failed this call on purpose (tests, `idem chaos`).
    #[error("failpoint {0} failed the database call")]
    Injected(&'static str),
}

impl StoreError {
    /// Whether retrying the same call later may succeed (connection lost,
    /// pool timeout, serialization failure, SQLITE_BUSY).
    ///
    /// ```
    /// use idem::store::StoreError;
    /// assert!(StoreError::Database(sqlx::Error::PoolTimedOut).is_transient());
    /// assert!(!StoreError::Invalid("x".into()).is_transient());
    /// ```
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
            StoreError::Batch(inner) => inner.is_transient(),
            StoreError::Injected(_) => true,
            _ => false,
        }
    }
}

/// Database error codes worth retrying. PostgreSQL SQLSTATEs: serialization
/// failure, deadlock, shutdown or not yet accepting connections, too many
/// connections, connection exceptions, statement timeout (a half-open
/// connection). SQLite extended result codes: BUSY (plain, RECOVERY,
/// SNAPSHOT, TIMEOUT) and LOCKED (plain, SHAREDCACHE).
const TRANSIENT_CODES: &[&str] = &[
    "40001", "40P01", "57P01", "57P02", "57P03", "53300", "08000", "08001", "08003", "08004",
    "08006", "57014", "5", "261", "517", "773", "6", "262",
];

/// Result alias of the store.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

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
