//! Job errors: retryable or permanent, each with a machine-readable code.

use crate::__private::bindings::idem::plugin::types as wit;
use crate::key::InvalidKey;
use std::time::Duration;

/// Why a plugin could not turn a job into effects.
///
/// The class decides what the host does: a retryable error is retried with
/// backoff, a permanent one sends the job to the dead-letter queue at once.
/// The `code` is machine-readable (`snake_case` by convention); the message
/// is for humans.
///
/// ```
/// use idem_sdk::JobError;
/// use std::time::Duration;
/// let busy = JobError::retryable("upstream_busy", "try later").retry_after(Duration::from_secs(30));
/// let bad = JobError::permanent("invalid_recipient", "no @ in address");
/// assert!(busy.is_retryable() && !bad.is_retryable());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobError {
    /// Try again later.
    Retryable {
        /// Machine-readable code.
        code: String,
        /// Human message.
        message: String,
        /// Earliest retry the plugin asks for.
        retry_after: Option<Duration>,
    },
    /// Never succeeds as it is.
    Permanent {
        /// Machine-readable code.
        code: String,
        /// Human message.
        message: String,
    },
}

impl JobError {
    /// A failure worth retrying (with backoff).
    pub fn retryable(code: impl Into<String>, message: impl Into<String>) -> Self {
        JobError::Retryable {
            code: code.into(),
            message: message.into(),
            retry_after: None,
        }
    }

    /// A failure that no retry can fix.
    pub fn permanent(code: impl Into<String>, message: impl Into<String>) -> Self {
        JobError::Permanent {
            code: code.into(),
            message: message.into(),
        }
    }

    /// Asks for the next attempt no earlier than `after` (retryable errors only).
    pub fn retry_after(mut self, after: Duration) -> Self {
        if let JobError::Retryable { retry_after, .. } = &mut self {
            *retry_after = Some(after);
        }
        self
    }

    /// Whether the host will retry.
    pub fn is_retryable(&self) -> bool {
        matches!(self, JobError::Retryable { .. })
    }

    /// The machine-readable code.
    pub fn code(&self) -> &str {
        match self {
            JobError::Retryable { code, .. } | JobError::Permanent { code, .. } => code,
        }
    }

    pub(crate) fn into_wit(self) -> wit::JobError {
        match self {
            JobError::Retryable {
                code,
                message,
                retry_after,
            } => wit::JobError::Retryable(wit::RetryableError {
                code,
                message,
                retry_after_ms: retry_after.map(|d| d.as_millis().min(u64::MAX as u128) as u64),
            }),
            JobError::Permanent { code, message } => {
                wit::JobError::Permanent(wit::ErrorDetail { code, message })
            }
        }
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobError::Retryable { code, message, .. } => write!(f, "retryable {code}: {message}"),
            JobError::Permanent { code, message } => write!(f, "permanent {code}: {message}"),
        }
    }
}

impl std::error::Error for JobError {}

impl From<InvalidKey> for JobError {
    fn from(error: InvalidKey) -> Self {
        JobError::permanent("invalid_idempotency_key", error.to_string())
    }
}

impl From<serde_json::Error> for JobError {
    /// Encoding a payload failed: a plugin bug that no retry fixes.
    fn from(error: serde_json::Error) -> Self {
        JobError::permanent("encoding_failed", error.to_string())
    }
}
