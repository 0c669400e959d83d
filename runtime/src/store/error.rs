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

    /// Whether the database (or the input check) refused the data of a
    /// batch, so nothing of it committed and a part of it may: a value it
    /// cannot store, a constraint or a trigger that raised. How the group
    /// commit knows a failed batch may be split to find the write at fault;
    /// any other failure (transient, or after the commit, like a corrupt
    /// answer) fails the batch as a whole, which is never committed twice.
    ///
    /// ```
    /// use idem::store::StoreError;
    /// assert!(StoreError::Invalid("x".into()).is_refusal());
    /// assert!(!StoreError::Corrupt("x".into()).is_refusal());
    /// ```
    pub fn is_refusal(&self) -> bool {
        match self {
            StoreError::Database(sqlx::Error::Database(_) | sqlx::Error::Encode(_)) => {
                !self.is_transient()
            }
            StoreError::Invalid(_) => true,
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

/// Runs a store call again while it fails transiently, until `deadline`
/// (pauses from 50 ms, doubling, at most 1 s): how the answer of a provider
/// call is recorded. The request was carried out, so its success must
/// outlast a database restart, not only a blip ([`retry_transient`] gives up
/// after ~350 ms): a provider that does not dedupe would otherwise end the
/// effect in doubt. The key's lease is the natural deadline: after it,
/// another holder may take the key over and the write is fenced out anyway.
///
/// ```no_run
/// # async fn demo(store: &dyn idem::store::Store, id: idem::store::JobId) -> idem::store::Result<()> {
/// let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
/// let job = idem::store::retry_transient_until(deadline, || store.job_get(id)).await?;
/// # Ok(()) }
/// ```
pub async fn retry_transient_until<T, F, Fut>(
    deadline: tokio::time::Instant,
    mut call: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut pause = Duration::from_millis(50);
    loop {
        match call().await {
            Err(error) if error.is_transient() => {
                let now = tokio::time::Instant::now();
                if now + pause > deadline {
                    return Err(error);
                }
                tracing::warn!(%error, ?pause, "transient store error; trying again until the key's lease ends");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transient failure is tried again until the deadline, then given
    /// up (the clock is paused: no real waiting).
    #[tokio::test(start_paused = true)]
    async fn retries_until_the_deadline() {
        let calls = std::sync::atomic::AtomicU32::new(0);
        let start = tokio::time::Instant::now();
        let deadline = start + Duration::from_secs(20);
        let failing = retry_transient_until(deadline, || async {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Err::<(), _>(StoreError::Database(sqlx::Error::PoolTimedOut))
        })
        .await;
        assert!(failing.unwrap_err().is_transient());
        let waited = start.elapsed();
        assert!(
            waited > Duration::from_secs(18) && waited <= Duration::from_secs(20),
            "{waited:?}"
        );
        assert!(calls.load(std::sync::atomic::Ordering::SeqCst) > 5);

        // It succeeds once the database is back, long after 350 ms.
        let calls = std::sync::atomic::AtomicU32::new(0);
        let back = tokio::time::Instant::now() + Duration::from_secs(5);
        let answer = retry_transient_until(
            tokio::time::Instant::now() + Duration::from_secs(30),
            || async {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if tokio::time::Instant::now() < back {
                    Err(StoreError::Database(sqlx::Error::PoolTimedOut))
                } else {
                    Ok(7)
                }
            },
        )
        .await;
        assert_eq!(answer.unwrap(), 7);

        // A permanent error is not tried again.
        let calls = std::sync::atomic::AtomicU32::new(0);
        let refused = retry_transient_until(deadline, || async {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Err::<(), _>(StoreError::Invalid("no".into()))
        })
        .await;
        assert!(refused.is_err());
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
