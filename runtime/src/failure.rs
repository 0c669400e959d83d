//! Classified failures: every way a job or an effect can fail, as data.
//!
//! A failure is retryable, permanent or ambiguous (sent, but no answer: retry
//! only because the idempotency key makes it safe), with a machine-readable
//! code. Queue decisions (retry with backoff or dead-letter) read the class,
//! never the message.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How the host reacts to a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// Retry with backoff (timeouts, 429, 5xx, plugin faults).
    Retryable,
    /// Never succeeds as it is: dead-letter at once.
    Permanent,
    /// The request may have taken effect: retry with the same key.
    Ambiguous,
}

impl ErrorClass {
    /// Whether the host tries again (retryable and ambiguous do).
    pub fn is_retried(self) -> bool {
        !matches!(self, ErrorClass::Permanent)
    }

    /// The name stored and printed (`retryable`, `permanent`, `ambiguous`).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Retryable => "retryable",
            ErrorClass::Permanent => "permanent",
            ErrorClass::Ambiguous => "ambiguous",
        }
    }
}

/// A classified failure with a machine-readable code.
///
/// ```
/// use idem::failure::{Failure, ErrorClass};
/// let f = Failure::permanent("invalid_recipient", "no @ in address");
/// assert_eq!(f.class, ErrorClass::Permanent);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// Retryable, permanent or ambiguous.
    pub class: ErrorClass,
    /// Machine-readable code, e.g. `plugin_timeout`.
    pub code: String,
    /// Human message (bounded by [`Failure::MAX_MESSAGE`]).
    pub message: String,
    /// Earliest retry asked for by the plugin or provider.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "optional_millis"
    )]
    pub retry_after: Option<Duration>,
}

impl Failure {
    /// Longest message kept, in bytes; longer ones are cut at a char boundary.
    pub const MAX_MESSAGE: usize = 2048;

    /// A failure of the given class.
    pub fn new(class: ErrorClass, code: impl Into<String>, message: impl Into<String>) -> Self {
        Failure {
            class,
            code: code.into(),
            message: truncate(message.into(), Self::MAX_MESSAGE),
            retry_after: None,
        }
    }

    /// A retryable failure.
    pub fn retryable(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Retryable, code, message)
    }

    /// A permanent failure.
    pub fn permanent(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Permanent, code, message)
    }

    /// An ambiguous failure (the request may have taken effect).
    pub fn ambiguous(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Ambiguous, code, message)
    }

    /// Sets the earliest retry.
    pub fn with_retry_after(mut self, after: Option<Duration>) -> Self {
        self.retry_after = after;
        self
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.class.as_str(), self.code, self.message)
    }
}

impl std::error::Error for Failure {}

/// Cuts `text` to at most `max` bytes on a char boundary, marking the cut.
pub fn truncate(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max.saturating_sub(3);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    text
}

mod optional_millis {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(value: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => s.serialize_some(&(d.as_millis() as u64)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        let f = Failure::permanent("x", "é".repeat(5000));
        assert!(f.message.len() <= Failure::MAX_MESSAGE);
        assert!(f.message.ends_with("..."));
    }

    #[test]
    fn only_permanent_failures_are_not_retried() {
        assert!(ErrorClass::Retryable.is_retried());
        assert!(ErrorClass::Ambiguous.is_retried());
        assert!(!ErrorClass::Permanent.is_retried());
    }
}
