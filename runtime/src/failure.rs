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

/// Every error code the host itself writes, in one catalog: the executor,
/// the sandbox, the providers and the store's SQL take their codes from here,
/// and `docs/alerts.yml` and the README name only these (a test checks).
/// Plugins and providers may return codes of their own as well.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    /// The plugin ran past its deadline or fuel.
    PluginTimeout,
    /// The plugin hit its memory cap.
    PluginOutOfMemory,
    /// The plugin overflowed its stack.
    PluginStackOverflow,
    /// The plugin panicked.
    PluginPanic,
    /// The plugin trapped otherwise.
    PluginTrap,
    /// The plugin tried to sleep or wait on a clock.
    PluginForbiddenCall,
    /// The plugin returned more than its output caps allow.
    PluginOutputTooLarge,
    /// No plugin of the job's name is loaded.
    PluginNotFound,
    /// The plugin returned an error code that is empty or too long.
    InvalidErrorCode,
    /// An effect key is empty, too long or not printable.
    InvalidIdempotencyKey,
    /// Two effects of one plan share a key.
    DuplicateIdempotencyKey,
    /// An effect is malformed (no provider, bad header or method).
    InvalidEffect,
    /// The stored plan cannot be read back.
    PlanCorrupt,
    /// The plugin used a provider (or enqueued a plugin) it was not granted.
    EffectNotAllowed,
    /// The effect names a provider this host does not configure.
    ProviderNotConfigured,
    /// The provider cannot carry out this kind of action.
    UnsupportedAction,
    /// A key was used before for a different request.
    IdempotencyKeyConflict,
    /// A permanently failed effect without a stored code.
    EffectFailed,
    /// An ambiguous failure at a provider that cannot dedupe: not retried.
    AmbiguousNotRetried,
    /// An earlier try may have reached a provider that cannot dedupe: not sent again.
    MayNotResend,
    /// A provider could not be asked whether it applied a key now (down,
    /// rate limited, timed out): asked again later.
    LookupUnavailable,
    /// A provider's answer to a lookup fits neither "applied" nor "not
    /// applied" (or it offers no lookup).
    LookupUnanswerable,
    /// An earlier try may have reached the provider longer ago than its dedupe window.
    DedupeWindowPassed,
    /// The job was deferred for longer than `max_deferral`.
    DeferredTooLong,
    /// A lease expired with no attempt left.
    LeaseExpired,
    /// Claims of the job were rescued too often before its start was recorded.
    RescuedUnstarted,
    /// The provider did not answer in time after the request was sent.
    ProviderTimeout,
    /// The connection dropped after the request was sent.
    ProviderConnectionLost,
    /// The provider answered 500, 502 or 504.
    ProviderError,
    /// The provider answered 408: it did not receive the whole request.
    ProviderRequestTimeout,
    /// The provider answered 503.
    ProviderUnavailable,
    /// The provider answered 429.
    ProviderRateLimited,
    /// The provider answered 409: the same key is in flight there.
    ProviderRequestInProgress,
    /// The provider refused the request (4xx).
    ProviderRejected,
    /// The provider answered with a redirect (never followed).
    ProviderRedirected,
    /// The provider could not be reached (nothing was sent).
    ProviderUnreachable,
    /// The effect names a statement its sql provider does not declare, or is not a statement call.
    SqlStatementUnknown,
    /// A statement's parameters do not match it in number or type.
    SqlParamsInvalid,
    /// The database refused a declared statement itself (syntax, unknown table).
    SqlStatementInvalid,
    /// A statement violated a constraint it does not handle (named in the message).
    SqlConstraintViolation,
    /// A statement's first returned column is neither an integer nor text.
    SqlResultUnreadable,
    /// A statement hit a deadlock, a serialization failure or a lock (rolled back).
    SqlConflict,
    /// A statement ran past its timeout (rolled back).
    SqlTimeout,
    /// The statement's database could not be reached (nothing ran).
    SqlUnavailable,
    /// The database refused a statement for another reason (rolled back).
    SqlFailed,
    /// The connection dropped while another database committed a statement.
    SqlCommitUnknown,
    /// A broker message carried no usable key under the source's key rule; kept dead on arrival.
    MessageKeyMissing,
    /// A broker message's key is not a valid idempotency key; kept dead on arrival.
    MessageKeyInvalid,
    /// A broker message carried no group under the source's group rule; kept dead on arrival.
    MessageGroupMissing,
    /// A broker message's group is not a valid group (the key's rule); kept dead on arrival.
    MessageGroupInvalid,
    /// A broker message's payload exceeds the job payload limit; kept dead on arrival without it.
    MessageTooLarge,
}

impl Code {
    /// Every code.
    pub const ALL: [Code; 51] = [
        Code::PluginTimeout,
        Code::PluginOutOfMemory,
        Code::PluginStackOverflow,
        Code::PluginPanic,
        Code::PluginTrap,
        Code::PluginForbiddenCall,
        Code::PluginOutputTooLarge,
        Code::PluginNotFound,
        Code::InvalidErrorCode,
        Code::InvalidIdempotencyKey,
        Code::DuplicateIdempotencyKey,
        Code::InvalidEffect,
        Code::PlanCorrupt,
        Code::EffectNotAllowed,
        Code::ProviderNotConfigured,
        Code::UnsupportedAction,
        Code::IdempotencyKeyConflict,
        Code::EffectFailed,
        Code::AmbiguousNotRetried,
        Code::MayNotResend,
        Code::LookupUnavailable,
        Code::LookupUnanswerable,
        Code::DedupeWindowPassed,
        Code::DeferredTooLong,
        Code::LeaseExpired,
        Code::RescuedUnstarted,
        Code::ProviderTimeout,
        Code::ProviderConnectionLost,
        Code::ProviderError,
        Code::ProviderRequestTimeout,
        Code::ProviderUnavailable,
        Code::ProviderRateLimited,
        Code::ProviderRequestInProgress,
        Code::ProviderRejected,
        Code::ProviderRedirected,
        Code::ProviderUnreachable,
        Code::SqlStatementUnknown,
        Code::SqlParamsInvalid,
        Code::SqlStatementInvalid,
        Code::SqlConstraintViolation,
        Code::SqlResultUnreadable,
        Code::SqlConflict,
        Code::SqlTimeout,
        Code::SqlUnavailable,
        Code::SqlFailed,
        Code::SqlCommitUnknown,
        Code::MessageKeyMissing,
        Code::MessageKeyInvalid,
        Code::MessageGroupMissing,
        Code::MessageGroupInvalid,
        Code::MessageTooLarge,
    ];

    /// The code as stored, logged and shown.
    ///
    /// ```
    /// assert_eq!(idem::failure::Code::LeaseExpired.as_str(), "lease_expired");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Code::PluginTimeout => "plugin_timeout",
            Code::PluginOutOfMemory => "plugin_out_of_memory",
            Code::PluginStackOverflow => "plugin_stack_overflow",
            Code::PluginPanic => "plugin_panic",
            Code::PluginTrap => "plugin_trap",
            Code::PluginForbiddenCall => "plugin_forbidden_call",
            Code::PluginOutputTooLarge => "plugin_output_too_large",
            Code::PluginNotFound => "plugin_not_found",
            Code::InvalidErrorCode => "invalid_error_code",
            Code::InvalidIdempotencyKey => "invalid_idempotency_key",
            Code::DuplicateIdempotencyKey => "duplicate_idempotency_key",
            Code::InvalidEffect => "invalid_effect",
            Code::PlanCorrupt => "plan_corrupt",
            Code::EffectNotAllowed => "effect_not_allowed",
            Code::ProviderNotConfigured => "provider_not_configured",
            Code::UnsupportedAction => "unsupported_action",
            Code::IdempotencyKeyConflict => "idempotency_key_conflict",
            Code::EffectFailed => "effect_failed",
            Code::AmbiguousNotRetried => "ambiguous_not_retried",
            Code::MayNotResend => "may_not_resend",
            Code::LookupUnavailable => "lookup_unavailable",
            Code::LookupUnanswerable => "lookup_unanswerable",
            Code::DedupeWindowPassed => "dedupe_window_passed",
            Code::DeferredTooLong => "deferred_too_long",
            Code::LeaseExpired => "lease_expired",
            Code::RescuedUnstarted => "rescued_unstarted",
            Code::ProviderTimeout => "provider_timeout",
            Code::ProviderConnectionLost => "provider_connection_lost",
            Code::ProviderError => "provider_error",
            Code::ProviderRequestTimeout => "provider_request_timeout",
            Code::ProviderUnavailable => "provider_unavailable",
            Code::ProviderRateLimited => "provider_rate_limited",
            Code::ProviderRequestInProgress => "provider_request_in_progress",
            Code::ProviderRejected => "provider_rejected",
            Code::ProviderRedirected => "provider_redirected",
            Code::ProviderUnreachable => "provider_unreachable",
            Code::SqlStatementUnknown => "sql_statement_unknown",
            Code::SqlParamsInvalid => "sql_params_invalid",
            Code::SqlStatementInvalid => "sql_statement_invalid",
            Code::SqlConstraintViolation => "sql_constraint_violation",
            Code::SqlResultUnreadable => "sql_result_unreadable",
            Code::SqlConflict => "sql_conflict",
            Code::SqlTimeout => "sql_timeout",
            Code::SqlUnavailable => "sql_unavailable",
            Code::SqlFailed => "sql_failed",
            Code::SqlCommitUnknown => "sql_commit_unknown",
            Code::MessageKeyMissing => "message_key_missing",
            Code::MessageKeyInvalid => "message_key_invalid",
            Code::MessageGroupMissing => "message_group_missing",
            Code::MessageGroupInvalid => "message_group_invalid",
            Code::MessageTooLarge => "message_too_large",
        }
    }

    /// The class a failure with this code has.
    pub fn class(self) -> ErrorClass {
        match self {
            Code::PluginTimeout
            | Code::PluginOutOfMemory
            | Code::PluginStackOverflow
            | Code::PluginPanic
            | Code::PluginTrap
            | Code::PluginNotFound
            | Code::ProviderRequestTimeout
            | Code::ProviderUnavailable
            | Code::ProviderRateLimited
            | Code::ProviderRequestInProgress
            | Code::ProviderUnreachable
            | Code::SqlConflict
            | Code::SqlTimeout
            | Code::SqlUnavailable
            | Code::SqlFailed
            | Code::LookupUnavailable => ErrorClass::Retryable,
            Code::ProviderTimeout
            | Code::ProviderConnectionLost
            | Code::ProviderError
            | Code::LeaseExpired
            | Code::RescuedUnstarted
            | Code::SqlCommitUnknown => ErrorClass::Ambiguous,
            Code::PluginForbiddenCall
            | Code::PluginOutputTooLarge
            | Code::InvalidErrorCode
            | Code::InvalidIdempotencyKey
            | Code::DuplicateIdempotencyKey
            | Code::InvalidEffect
            | Code::PlanCorrupt
            | Code::EffectNotAllowed
            | Code::ProviderNotConfigured
            | Code::UnsupportedAction
            | Code::IdempotencyKeyConflict
            | Code::EffectFailed
            | Code::AmbiguousNotRetried
            | Code::MayNotResend
            | Code::LookupUnanswerable
            | Code::DedupeWindowPassed
            | Code::DeferredTooLong
            | Code::ProviderRejected
            | Code::ProviderRedirected
            | Code::SqlStatementUnknown
            | Code::SqlParamsInvalid
            | Code::SqlStatementInvalid
            | Code::SqlConstraintViolation
            | Code::SqlResultUnreadable
            | Code::MessageKeyMissing
            | Code::MessageKeyInvalid
            | Code::MessageGroupMissing
            | Code::MessageGroupInvalid
            | Code::MessageTooLarge => ErrorClass::Permanent,
        }
    }

    /// What the code means, for people (the README's table of codes).
    pub fn meaning(self) -> &'static str {
        match self {
            Code::PluginTimeout => "The plugin ran past its deadline or fuel.",
            Code::PluginOutOfMemory => "The plugin hit its memory cap.",
            Code::PluginStackOverflow => "The plugin overflowed its stack.",
            Code::PluginPanic => "The plugin panicked.",
            Code::PluginTrap => "The plugin trapped otherwise.",
            Code::PluginForbiddenCall => "The plugin tried to sleep or wait on a clock.",
            Code::PluginOutputTooLarge => "The plugin returned more than its output caps allow.",
            Code::PluginNotFound => "No plugin of the job's name is loaded.",
            Code::InvalidErrorCode => {
                "The plugin returned an error code that is empty, too long or holds characters other than ASCII letters, digits and _ . : - (the error keeps its class)."
            }
            Code::InvalidIdempotencyKey => "An effect key is empty, too long or not printable.",
            Code::DuplicateIdempotencyKey => "Two effects of one plan share a key.",
            Code::InvalidEffect => "An effect is malformed (no provider, bad header or method).",
            Code::PlanCorrupt => "The stored plan cannot be read back.",
            Code::EffectNotAllowed => {
                "The plugin used a provider (or enqueued a plugin) it was not granted."
            }
            Code::ProviderNotConfigured => {
                "The effect names a provider this host does not configure."
            }
            Code::UnsupportedAction => "The provider cannot carry out this kind of action.",
            Code::IdempotencyKeyConflict => "A key was used before for a different request.",
            Code::EffectFailed => "A permanently failed effect without a stored code.",
            Code::AmbiguousNotRetried => {
                "An ambiguous failure at a provider that cannot dedupe: not retried."
            }
            Code::MayNotResend => {
                "An earlier try may have reached a provider that cannot dedupe: not sent again."
            }
            Code::LookupUnavailable => {
                "The provider could not be asked now whether it applied a key (asked again later)."
            }
            Code::LookupUnanswerable => {
                "The provider's answer to a lookup fits neither applied nor not applied."
            }
            Code::DedupeWindowPassed => {
                "An earlier try may have reached the provider longer ago than its dedupe window."
            }
            Code::DeferredTooLong => "The job was deferred for longer than `max_deferral`.",
            Code::LeaseExpired => "A lease expired with no attempt left.",
            Code::RescuedUnstarted => {
                "Claims of the job were rescued 10 times before its start was recorded: the host stops before or just after it starts (a crash, an out-of-memory kill)."
            }
            Code::ProviderTimeout => {
                "The provider did not answer in time after the request was sent."
            }
            Code::ProviderConnectionLost => "The connection dropped after the request was sent.",
            Code::ProviderError => "The provider answered 500, 502 or 504.",
            Code::ProviderRequestTimeout => {
                "The provider answered 408: it did not receive the whole request."
            }
            Code::ProviderUnavailable => "The provider answered 503.",
            Code::ProviderRateLimited => "The provider answered 429.",
            Code::ProviderRequestInProgress => {
                "The provider answered 409: the same key is in flight there."
            }
            Code::ProviderRejected => "The provider refused the request (4xx).",
            Code::ProviderRedirected => "The provider answered with a redirect (never followed).",
            Code::ProviderUnreachable => "The provider could not be reached (nothing was sent).",
            Code::SqlStatementUnknown => {
                "The effect names a statement its sql provider does not declare, or is not a statement call."
            }
            Code::SqlParamsInvalid => "A statement's parameters do not match it in number or type.",
            Code::SqlStatementInvalid => {
                "The database refused a declared statement itself (syntax, unknown table)."
            }
            Code::SqlConstraintViolation => {
                "A statement violated a constraint it does not handle (named in the message)."
            }
            Code::SqlResultUnreadable => {
                "A statement's first returned column is neither an integer nor text."
            }
            Code::SqlConflict => {
                "A statement hit a deadlock, a serialization failure or a lock (rolled back)."
            }
            Code::SqlTimeout => "A statement ran past its timeout (rolled back).",
            Code::SqlUnavailable => "The statement's database could not be reached (nothing ran).",
            Code::SqlFailed => "The database refused a statement for another reason (rolled back).",
            Code::SqlCommitUnknown => {
                "The connection dropped while another database committed a statement."
            }
            Code::MessageKeyMissing => {
                "A broker message carried no usable key under the source's key rule; kept dead on arrival."
            }
            Code::MessageKeyInvalid => {
                "A broker message's key is not a valid idempotency key; kept dead on arrival."
            }
            Code::MessageGroupMissing => {
                "A broker message carried no group under the source's group rule; kept dead on arrival."
            }
            Code::MessageGroupInvalid => {
                "A broker message's group is not a valid group (the key's rule); kept dead on arrival."
            }
            Code::MessageTooLarge => {
                "A broker message's payload exceeds the job payload limit; kept dead on arrival without it."
            }
        }
    }

    /// The code of this name, if it is the host's.
    ///
    /// ```
    /// use idem::failure::Code;
    /// assert_eq!(Code::parse("plugin_panic"), Some(Code::PluginPanic));
    /// assert_eq!(Code::parse("invalid_recipient"), None);
    /// ```
    pub fn parse(text: &str) -> Option<Code> {
        Code::ALL.into_iter().find(|c| c.as_str() == text)
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
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
    pub const MAX_MESSAGE: usize = crate::boundary::MAX_MESSAGE;

    /// A failure of the given class. Its message is cleaned by the
    /// boundary's rule (control characters replaced, length bounded): a
    /// failure's message often quotes text from outside (a plugin's, a
    /// provider's, a panic's), and it is stored and logged as it is here.
    pub fn new(class: ErrorClass, code: impl Into<String>, message: impl Into<String>) -> Self {
        Failure {
            class,
            code: code.into(),
            message: crate::boundary::message(&message.into()),
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

    /// A failure with one of the host's own codes, in the code's class.
    ///
    /// ```
    /// use idem::failure::{Code, ErrorClass, Failure};
    /// let f = Failure::host(Code::PluginPanic, "the plugin panicked");
    /// assert_eq!((f.class, f.code.as_str()), (ErrorClass::Retryable, "plugin_panic"));
    /// ```
    pub fn host(code: Code, message: impl Into<String>) -> Self {
        Self::new(code.class(), code.as_str(), message)
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
    fn catalog_codes_are_unique_snake_case_and_parse_back() {
        let mut seen = std::collections::HashSet::new();
        for code in Code::ALL {
            assert!(seen.insert(code.as_str()), "{code} twice");
            assert!(
                code.as_str()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{code}"
            );
            assert_eq!(Code::parse(code.as_str()), Some(code));
        }
    }

    #[test]
    fn the_readme_table_lists_every_code_as_the_catalog_says() {
        let readme = include_str!("../../README.md");
        for code in Code::ALL {
            let row = format!(
                "| `{code}` | {} | {} |",
                code.class().as_str(),
                code.meaning()
            );
            assert!(readme.contains(&row), "README lacks the row {row}");
        }
    }

    #[test]
    fn the_alert_rules_name_only_catalog_codes() {
        let alerts = include_str!("../../docs/alerts.yml");
        let mut named = 0;
        for (i, _) in alerts.match_indices("code=~\"") {
            let rest = &alerts[i + "code=~\"".len()..];
            let list = &rest[..rest.find('"').unwrap_or(0)];
            for code in list.split('|') {
                assert!(
                    Code::parse(code).is_some(),
                    "docs/alerts.yml names {code:?}, which is not a host code"
                );
                named += 1;
            }
        }
        assert!(named > 0, "the timeout alert names its codes");
    }

    #[test]
    fn only_permanent_failures_are_not_retried() {
        assert!(ErrorClass::Retryable.is_retried());
        assert!(ErrorClass::Ambiguous.is_retried());
        assert!(!ErrorClass::Permanent.is_retried());
    }
}
