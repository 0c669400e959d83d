//! Turning what a plugin call produced into effects or a classified failure.
//!
//! Plugin faults (timeout, out of memory, stack overflow, panic, other traps)
//! are retryable: the same input may succeed once a fixed plugin version is
//! deployed, and attempts are bounded. Contract violations (output too large,
//! invalid keys) are permanent: the same plugin version returns the same plan.

use super::PluginLimits;
use super::bindings::idem::plugin::types as wit;
use super::guest::{ForbiddenCall, MemoryCapExceeded};
use crate::effects::{self, Action, Effect, EmailTemplate, OutputLimits};
use crate::failure::{Code, ErrorClass, Failure, truncate};
use std::time::Duration;
use wasmtime::Trap;

/// Longest plugin error message accepted; longer is `plugin_output_too_large`.
pub const MAX_ERROR_MESSAGE: usize = 64 << 10;

/// wasmtime's (private) error when a guest hands the host more data than the
/// store's hostcall fuel allows; its type is not exported, its text is stable.
const HOSTCALL_FUEL_EXHAUSTED: &str = "fuel allocated for hostcalls has been exhausted";

/// Hostcall fuel (bytes a guest may hand the host in one call) for these
/// caps: the lifted plan can never be much larger than what the caps allow.
pub fn hostcall_fuel(output: &OutputLimits) -> usize {
    output
        .max_bytes
        .saturating_mul(4)
        .saturating_add(output.max_effects.saturating_mul(1024))
        .saturating_add(MAX_ERROR_MESSAGE * 2)
}

/// The failure of a call stopped at its deadline.
pub fn timeout(limits: &PluginLimits) -> Failure {
    Failure::host(
        Code::PluginTimeout,
        format!(
            "the plugin ran past its {:?} deadline and was stopped",
            limits.deadline
        ),
    )
}

/// Classifies an error raised while instantiating or calling the plugin.
pub fn trap(error: &wasmtime::Error, limits: &PluginLimits, stderr: &str) -> Failure {
    if let Some(call) = error.downcast_ref::<ForbiddenCall>() {
        // Deterministic: the same plugin version waits again on every attempt.
        return Failure::host(Code::PluginForbiddenCall, call.to_string());
    }
    if let Some(cap) = error.downcast_ref::<MemoryCapExceeded>() {
        return Failure::host(Code::PluginOutOfMemory, cap.to_string());
    }
    if format!("{error:#}").contains(HOSTCALL_FUEL_EXHAUSTED) {
        return Failure::host(
            Code::PluginOutputTooLarge,
            format!(
                "the plugin tried to hand the host more data than its output caps allow ({} effects, {} bytes)",
                limits.output.max_effects, limits.output.max_bytes
            ),
        );
    }
    match error.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => timeout(limits),
        Some(Trap::OutOfFuel) => Failure::host(
            Code::PluginTimeout,
            format!(
                "the plugin used up its fuel budget of {}",
                limits.fuel.unwrap_or_default()
            ),
        ),
        Some(Trap::StackOverflow) => {
            Failure::host(Code::PluginStackOverflow, "the plugin overflowed its stack")
        }
        Some(Trap::UnreachableCodeReached) => {
            let reason =
                panic_message(stderr).unwrap_or_else(|| "no panic message was printed".into());
            Failure::host(Code::PluginPanic, format!("the plugin panicked: {reason}"))
        }
        Some(other) => Failure::host(Code::PluginTrap, format!("the plugin trapped: {other}")),
        None => Failure::host(
            Code::PluginTrap,
            truncate(format!("{error:#}"), Failure::MAX_MESSAGE),
        ),
    }
}

/// The guest's last panic report on stderr (`panicked at FILE:` plus the
/// message on the next line), if any.
fn panic_message(stderr: &str) -> Option<String> {
    let lines: Vec<&str> = stderr.lines().collect();
    let at = lines
        .iter()
        .rposition(|line| line.contains("panicked at"))?;
    let location = lines[at]
        .split("panicked at ")
        .nth(1)
        .unwrap_or("")
        .trim_end_matches(':');
    let message = lines.get(at + 1).map(|l| l.trim()).unwrap_or("");
    Some(format!("{message} (at {location})"))
}

/// Converts and checks a returned plan.
pub fn effects(returned: Vec<wit::Effect>, limits: &OutputLimits) -> Result<Vec<Effect>, Failure> {
    if returned.len() > limits.max_effects {
        // Refuse before converting: a flood must not cost a second copy.
        return Err(Failure::host(
            Code::PluginOutputTooLarge,
            format!(
                "the plugin returned {} effects, at most {} allowed",
                returned.len(),
                limits.max_effects
            ),
        ));
    }
    let effects: Vec<Effect> = returned.into_iter().map(convert).collect();
    effects::check_plan(&effects, limits)?;
    Ok(effects)
}

/// Converts the plugin's own error, refusing oversized messages.
pub fn plugin_error(error: wit::JobError, limits: &OutputLimits) -> Failure {
    let (code, message) = match &error {
        wit::JobError::Retryable(e) => (&e.code, &e.message),
        wit::JobError::Permanent(e) => (&e.code, &e.message),
    };
    let size = code.len() + message.len();
    if size > MAX_ERROR_MESSAGE.min(limits.max_bytes) {
        return Failure::host(
            Code::PluginOutputTooLarge,
            format!("the plugin returned a {size}-byte error, at most {MAX_ERROR_MESSAGE} allowed"),
        );
    }
    if let Err(refused) = crate::boundary::error_code(code) {
        // The plugin still said whether to try again: its class stands,
        // its code is replaced by the catalog's, its message is kept
        // (cleaned by `Failure::new`).
        let (class, retry_after) = match &error {
            wit::JobError::Retryable(e) => (ErrorClass::Retryable, e.retry_after_ms),
            wit::JobError::Permanent(_) => (ErrorClass::Permanent, None),
        };
        return Failure::new(
            class,
            Code::InvalidErrorCode.as_str(),
            format!("the plugin's {refused}; its message: {message}"),
        )
        .with_retry_after(retry_after.map(Duration::from_millis));
    }
    match error {
        wit::JobError::Retryable(e) => Failure::retryable(e.code, e.message)
            .with_retry_after(e.retry_after_ms.map(Duration::from_millis)),
        wit::JobError::Permanent(e) => Failure::permanent(e.code, e.message),
    }
}

fn pairs(list: Vec<wit::Pair>) -> Vec<(String, String)> {
    list.into_iter().map(|p| (p.name, p.value)).collect()
}

fn convert(effect: wit::Effect) -> Effect {
    let action = match effect.action {
        wit::Action::Http(r) => Action::Http {
            method: r.method,
            path: r.path,
            headers: pairs(r.headers),
            body: r.body,
        },
        wit::Action::Email(e) => Action::Email {
            to: e.to,
            subject: e.subject,
            text: e.text,
            html: e.html,
            template: e.template.map(|t| EmailTemplate {
                name: t.name,
                variables: pairs(t.variables),
            }),
        },
        wit::Action::Enqueue(j) => Action::Enqueue {
            plugin: j.plugin,
            queue: j.queue,
            payload: j.payload,
            delay_ms: j.delay_ms,
            priority: j.priority,
        },
        wit::Action::Custom(body) => Action::Custom { body },
    };
    Effect {
        provider: effect.provider,
        idempotency_key: effect.idempotency_key,
        action,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boundary::vectors::{self, Expected};

    fn retryable(code: &str, message: &str) -> wit::JobError {
        wit::JobError::Retryable(wit::RetryableError {
            code: code.into(),
            message: message.into(),
            retry_after_ms: Some(1500),
        })
    }

    fn permanent(code: &str, message: &str) -> wit::JobError {
        wit::JobError::Permanent(wit::ErrorDetail {
            code: code.into(),
            message: message.into(),
        })
    }

    /// Issue 22, item 2: a plugin's error code is checked by the
    /// boundary's rule; an invalid one keeps the plugin's class (and its
    /// retry hint) and becomes `invalid_error_code`, shown escaped.
    #[test]
    fn plugin_error_codes_follow_the_vectors() {
        let limits = OutputLimits::default();
        for case in vectors::of("error_code") {
            for (error, class) in [
                (retryable(&case.input, "m"), ErrorClass::Retryable),
                (permanent(&case.input, "m"), ErrorClass::Permanent),
            ] {
                let failure = plugin_error(error, &limits);
                assert_eq!(failure.class, class, "{}", case.note);
                match case.expected {
                    Expected::Accepted => assert_eq!(failure.code, case.input, "{}", case.note),
                    Expected::Refused => {
                        assert_eq!(failure.code, "invalid_error_code", "{}", case.note);
                        assert!(!failure.message.contains('\0'), "{}", case.note);
                        assert!(
                            failure
                                .message
                                .chars()
                                .all(|c| !c.is_control() || c == '\n'),
                            "{}: {:?}",
                            case.note,
                            failure.message
                        );
                    }
                    Expected::Cleaned(_) => unreachable!("codes are never cleaned"),
                }
                if class == ErrorClass::Retryable {
                    assert_eq!(failure.retry_after, Some(Duration::from_millis(1500)));
                }
            }
        }
    }

    /// A plugin's message is cleaned by the boundary's rule (kept when it
    /// is too long for the error caps: then the output is too large).
    #[test]
    fn plugin_error_messages_follow_the_vectors() {
        let limits = OutputLimits::default();
        for case in vectors::of("error_message") {
            let failure = plugin_error(retryable("code", &case.input), &limits);
            if case.input.len() > MAX_ERROR_MESSAGE {
                assert_eq!(failure.code, "plugin_output_too_large", "{}", case.note);
                continue;
            }
            let want = match &case.expected {
                Expected::Accepted => case.input.clone(),
                Expected::Cleaned(Some(out)) => out.clone(),
                other => panic!("a message is never {other:?}"),
            };
            assert_eq!(failure.message, want, "{}", case.note);
        }
    }

    /// A panic message from the guest's stderr is cleaned like any other.
    #[test]
    fn a_panic_message_is_cleaned() {
        let failure = Failure::host(
            Code::PluginPanic,
            format!(
                "the plugin panicked: {}",
                panic_message("thread panicked at src/lib.rs:1:1:\nboom\0\u{1b}[2J").unwrap()
            ),
        );
        assert!(
            failure.message.contains("boom\u{fffd}\u{fffd}[2J"),
            "{}",
            failure.message
        );
    }
}
