//! Effects as the host sees them: what a plugin asked for, validated and
//! serialisable, so a plan can be stored before the first effect runs. The
//! vocabulary only (effect, plan checks, fingerprint): the sandbox, the
//! providers and the queue use it; it uses none of them. The plan is carried
//! out by `queue::executor`.

use crate::failure::{Code, Failure};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One business effect: a provider, an idempotency key and an action.
///
/// ```
/// use idem::effects::{Action, Effect};
/// let e = Effect { provider: "report".into(), idempotency_key: "k:1".into(), action: Action::Custom { body: vec![1] } };
/// assert_eq!(e.action.kind(), "custom");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Effect {
    /// Name of a provider configured on the host.
    pub provider: String,
    /// Identity of the business operation.
    pub idempotency_key: String,
    /// What to do.
    pub action: Action,
}

/// What an effect does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Action {
    /// An HTTP request relative to the provider's base URL.
    Http {
        /// HTTP method.
        method: String,
        /// Path relative to the provider's base URL.
        path: String,
        /// Extra headers.
        #[serde(default)]
        headers: Vec<(String, String)>,
        /// Raw body.
        #[serde(default, with = "body_text")]
        body: Option<Vec<u8>>,
    },
    /// An email.
    Email {
        /// Recipients.
        to: Vec<String>,
        /// Subject line.
        subject: String,
        /// Plain-text body.
        #[serde(default)]
        text: Option<String>,
        /// HTML body.
        #[serde(default)]
        html: Option<String>,
        /// Provider-side template and variables.
        #[serde(default)]
        template: Option<EmailTemplate>,
    },
    /// A child job.
    Enqueue {
        /// Plugin of the child job.
        plugin: String,
        /// Queue (the parent's when absent).
        #[serde(default)]
        queue: Option<String>,
        /// Payload (JSON by convention).
        #[serde(with = "body_text_required")]
        payload: Vec<u8>,
        /// Delay before the child may run, in milliseconds.
        #[serde(default)]
        delay_ms: u64,
        /// Higher runs first.
        #[serde(default)]
        priority: i32,
    },
    /// Provider-defined bytes.
    Custom {
        /// The bytes.
        #[serde(with = "body_text_required")]
        body: Vec<u8>,
    },
}

/// A provider-side email template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmailTemplate {
    /// Template name.
    pub name: String,
    /// Variables.
    pub variables: Vec<(String, String)>,
}

impl Action {
    /// `http`, `email`, `enqueue` or `custom`.
    pub fn kind(&self) -> &'static str {
        match self {
            Action::Http { .. } => "http",
            Action::Email { .. } => "email",
            Action::Enqueue { .. } => "enqueue",
            Action::Custom { .. } => "custom",
        }
    }

    /// Bytes of text and data the action carries (for output caps).
    pub fn size(&self) -> usize {
        let pairs =
            |p: &[(String, String)]| p.iter().map(|(a, b)| a.len() + b.len()).sum::<usize>();
        match self {
            Action::Http {
                method,
                path,
                headers,
                body,
            } => method.len() + path.len() + pairs(headers) + body.as_ref().map_or(0, Vec::len),
            Action::Email {
                to,
                subject,
                text,
                html,
                template,
            } => {
                to.iter().map(String::len).sum::<usize>()
                    + subject.len()
                    + text.as_ref().map_or(0, String::len)
                    + html.as_ref().map_or(0, String::len)
                    + template
                        .as_ref()
                        .map_or(0, |t| t.name.len() + pairs(&t.variables))
            }
            Action::Enqueue {
                plugin,
                queue,
                payload,
                ..
            } => plugin.len() + queue.as_ref().map_or(0, String::len) + payload.len(),
            Action::Custom { body } => body.len(),
        }
    }
}

impl Effect {
    /// Bytes the effect carries (for output caps).
    pub fn size(&self) -> usize {
        self.provider.len() + self.idempotency_key.len() + self.action.size()
    }
}

/// SHA-256 of the provider and action: the identity of a request, so one key
/// reused for a different request is detected.
///
/// ```
/// use idem::effects::{Action, Effect, fingerprint};
/// let e = Effect { provider: "p".into(), idempotency_key: "k".into(), action: Action::Custom { body: vec![] } };
/// assert_eq!(fingerprint(&e).len(), 64);
/// ```
pub fn fingerprint(effect: &Effect) -> String {
    let mut hasher = Sha256::new();
    hasher.update(effect.provider.as_bytes());
    hasher.update([0]);
    // serde_json writes struct fields in declaration order: stable across runs.
    hasher.update(serde_json::to_vec(&effect.action).unwrap_or_default());
    hex::encode(hasher.finalize())
}

/// Caps on what one plugin call may return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputLimits {
    /// Most effects in one plan.
    pub max_effects: usize,
    /// Most bytes over all effects (text and data).
    pub max_bytes: usize,
}

impl Default for OutputLimits {
    fn default() -> Self {
        OutputLimits {
            max_effects: 100,
            max_bytes: 1 << 20,
        }
    }
}

/// Checks a plan against the caps and the key rules: too many effects or
/// bytes → `plugin_output_too_large`; a bad key → `invalid_idempotency_key`;
/// the same key twice → `duplicate_idempotency_key`; an empty provider name →
/// `invalid_effect`. All permanent: the same plugin version returns the same plan.
///
/// ```
/// use idem::effects::{check_plan, OutputLimits};
/// assert!(check_plan(&[], &OutputLimits::default()).is_ok());
/// ```
pub fn check_plan(effects: &[Effect], limits: &OutputLimits) -> Result<(), Failure> {
    if effects.len() > limits.max_effects {
        return Err(Failure::host(
            Code::PluginOutputTooLarge,
            format!(
                "the plugin returned {} effects, at most {} allowed",
                effects.len(),
                limits.max_effects
            ),
        ));
    }
    let bytes: usize = effects.iter().map(Effect::size).sum();
    if bytes > limits.max_bytes {
        return Err(Failure::host(
            Code::PluginOutputTooLarge,
            format!(
                "the plugin returned {bytes} bytes of effects, at most {} allowed",
                limits.max_bytes
            ),
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(effects.len());
    for effect in effects {
        if let Err(why) = idem_sdk::key::validate(&effect.idempotency_key) {
            return Err(Failure::host(
                Code::InvalidIdempotencyKey,
                format!(
                    "{why}: {:?}",
                    crate::failure::truncate(effect.idempotency_key.clone(), 80)
                ),
            ));
        }
        if !seen.insert(effect.idempotency_key.as_str()) {
            return Err(Failure::host(
                Code::DuplicateIdempotencyKey,
                format!(
                    "two effects in one plan share the key {:?}",
                    effect.idempotency_key
                ),
            ));
        }
        if effect.provider.is_empty() {
            return Err(Failure::host(
                Code::InvalidEffect,
                format!("effect {:?} names no provider", effect.idempotency_key),
            ));
        }
    }
    Ok(())
}

/// Bodies are shown as text when they are UTF-8 (JSON by convention) and as
/// byte arrays otherwise, so stored plans stay readable.
mod body_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            None => s.serialize_none(),
            Some(bytes) => super::body_text_required::serialize(bytes, s),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        Ok(Option::<super::body_text_required::Body>::deserialize(d)?.map(|b| b.0))
    }
}

mod body_text_required {
    use serde::{Deserialize, Deserializer, Serializer};

    pub struct Body(pub Vec<u8>);

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Text(String),
        Bytes(Vec<u8>),
    }

    impl<'de> Deserialize<'de> for Body {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            Ok(Body(match Repr::deserialize(d)? {
                Repr::Text(t) => t.into_bytes(),
                Repr::Bytes(b) => b,
            }))
        }
    }

    pub fn serialize<S: Serializer>(value: &[u8], s: S) -> Result<S::Ok, S::Error> {
        match std::str::from_utf8(value) {
            Ok(text) => s.serialize_str(text),
            Err(_) => s.collect_seq(value),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        Ok(Body::deserialize(d)?.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn custom(key: &str) -> Effect {
        Effect {
            provider: "p".into(),
            idempotency_key: key.into(),
            action: Action::Custom { body: vec![] },
        }
    }

    #[test]
    fn plans_over_the_caps_are_too_large() {
        let limits = OutputLimits {
            max_effects: 2,
            max_bytes: 100,
        };
        let err = check_plan(&[custom("a"), custom("b"), custom("c")], &limits).unwrap_err();
        assert_eq!(err.code, "plugin_output_too_large");
        let big = Effect {
            action: Action::Custom { body: vec![0; 200] },
            ..custom("a")
        };
        assert_eq!(
            check_plan(&[big], &limits).unwrap_err().code,
            "plugin_output_too_large"
        );
    }

    #[test]
    fn bad_and_duplicate_keys_are_refused() {
        let limits = OutputLimits::default();
        assert_eq!(
            check_plan(&[custom("")], &limits).unwrap_err().code,
            "invalid_idempotency_key"
        );
        assert_eq!(
            check_plan(&[custom("a\nb")], &limits).unwrap_err().code,
            "invalid_idempotency_key"
        );
        assert_eq!(
            check_plan(&[custom("a"), custom("a")], &limits)
                .unwrap_err()
                .code,
            "duplicate_idempotency_key"
        );
    }

    #[test]
    fn plans_round_trip_through_json_with_readable_bodies() {
        let effect = Effect {
            provider: "partner".into(),
            idempotency_key: "webhook:e:d".into(),
            action: Action::Http {
                method: "POST".into(),
                path: "/x".into(),
                headers: vec![("a".into(), "b".into())],
                body: Some(b"{\"x\":1}".to_vec()),
            },
        };
        let json = serde_json::to_value(&effect).unwrap();
        assert_eq!(json["action"]["body"], "{\"x\":1}");
        assert_eq!(json["action"]["type"], "http");
        let back: Effect = serde_json::from_value(json).unwrap();
        assert_eq!(back, effect);
        let binary = Effect {
            action: Action::Custom {
                body: vec![0xff, 0],
            },
            ..effect
        };
        let back: Effect = serde_json::from_str(&serde_json::to_string(&binary).unwrap()).unwrap();
        assert_eq!(back, binary);
    }
}
