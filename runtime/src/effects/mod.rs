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

/// The key an effect is carried out under: the plugin's own key in the
/// emitting plugin's namespace, `PLUGIN/KEY`. The host derives it, so one
/// plugin can neither take a key another plugin (or a producer, for child
/// jobs) will use, nor poison it with a different request.
///
/// ```
/// assert_eq!(idem::effects::scoped_key("order_sync", "order:7:invoice"), "order_sync/order:7:invoice");
/// ```
pub fn scoped_key(plugin: &str, key: &str) -> String {
    format!("{plugin}/{key}")
}

/// A fresh plan with every key scoped to `plugin` (see [`scoped_key`]).
/// Plans stored before keys were scoped keep their keys as they are.
///
/// ```
/// use idem::effects::{Action, Effect, scope_plan};
/// let plan = vec![Effect { provider: "p".into(), idempotency_key: "k".into(), action: Action::Custom { body: vec![] } }];
/// assert_eq!(scope_plan("mailer", plan)[0].idempotency_key, "mailer/k");
/// ```
pub fn scope_plan(plugin: &str, plan: Vec<Effect>) -> Vec<Effect> {
    plan.into_iter()
        .map(|effect| Effect {
            idempotency_key: scoped_key(plugin, &effect.idempotency_key),
            ..effect
        })
        .collect()
}

/// Version tag of the fingerprint's canonical form. Bump it only with a
/// migration path: every key in flight would otherwise turn into a conflict.
pub const FINGERPRINT_VERSION: &str = "idem-fp/2";

/// SHA-256 of an effect's provider and action in a canonical, versioned
/// form, stored with its key: the same key with another fingerprint is a
/// key reused for a different request. The form does not follow the Rust
/// type's layout: object keys are sorted, and null values, empty lists and
/// empty objects are left out, so a field added later with such a default
/// keeps every key in flight valid.
///
/// ```
/// use idem::effects::{Action, Effect, fingerprint};
/// let e = Effect { provider: "p".into(), idempotency_key: "k".into(), action: Action::Custom { body: b"x".to_vec() } };
/// assert_eq!(fingerprint(&e).len(), 64);
/// ```
pub fn fingerprint(effect: &Effect) -> String {
    let action = serde_json::to_value(&effect.action).unwrap_or_default();
    fingerprint_of(&effect.provider, &action)
}

/// The fingerprint of a provider and an action given as JSON (the
/// canonical form is applied here).
pub fn fingerprint_of(provider: &str, action: &serde_json::Value) -> String {
    let mut hasher = Sha256::new();
    hasher.update(FINGERPRINT_VERSION.as_bytes());
    hasher.update([0]);
    hasher.update(provider.as_bytes());
    hasher.update([0]);
    let canonical = canonical(action).unwrap_or(serde_json::Value::Null);
    hasher.update(canonical.to_string().as_bytes());
    hex::encode(hasher.finalize())
}

/// The fingerprint of releases before the canonical form (serde's field
/// order): how keys claimed by an older release are still recognised.
pub fn legacy_fingerprint(effect: &Effect) -> String {
    let mut hasher = Sha256::new();
    hasher.update(effect.provider.as_bytes());
    hasher.update([0]);
    hasher.update(serde_json::to_vec(&effect.action).unwrap_or_default());
    hex::encode(hasher.finalize())
}

/// Sorted keys, without nulls and empty containers (`None` when the value
/// itself is one of those).
fn canonical(value: &serde_json::Value) -> Option<serde_json::Value> {
    use serde_json::Value;
    match value {
        Value::Null => None,
        Value::Array(items) if items.is_empty() => None,
        Value::Array(items) => Some(Value::Array(
            items
                .iter()
                .map(|v| canonical(v).unwrap_or(Value::Null))
                .collect(),
        )),
        Value::Object(map) => {
            let sorted: std::collections::BTreeMap<&String, Value> = map
                .iter()
                .filter_map(|(k, v)| canonical(v).map(|v| (k, v)))
                .collect();
            if sorted.is_empty() {
                return None;
            }
            let mut out = serde_json::Map::new();
            for (k, v) in sorted {
                out.insert(k.clone(), v);
            }
            Some(Value::Object(out))
        }
        other => Some(other.clone()),
    }
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
        // Names are stored (the ledger's provider, a child's plugin and
        // queue) and logged: checked by the boundary's rule here, so a bad
        // one fails this job, classified, and never a batch of others.
        let names = std::iter::once(("provider", Some(effect.provider.as_str()))).chain(
            match &effect.action {
                Action::Enqueue { plugin, queue, .. } => {
                    vec![
                        ("child plugin", Some(plugin.as_str())),
                        ("child queue", queue.as_deref()),
                    ]
                }
                _ => Vec::new(),
            },
        );
        for (what, name) in names {
            let Some(name) = name else { continue };
            if let Err(refused) = crate::boundary::name(name) {
                return Err(Failure::host(
                    Code::InvalidEffect,
                    format!(
                        "effect {:?}: the {what} {} {}",
                        effect.idempotency_key, refused.shown, refused.why
                    ),
                ));
            }
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
    fn fingerprints_ignore_layout_and_added_defaults_but_not_content() {
        let email: serde_json::Value = serde_json::json!({
            "type": "email", "to": ["ana@example.com"], "subject": "Invoice 42",
            "text": "hi", "html": null, "template": null
        });
        let reordered_with_new_field = serde_json::json!({
            "subject": "Invoice 42", "type": "email", "text": "hi",
            "to": ["ana@example.com"], "reply_to": null, "tags": [], "meta": {}
        });
        assert_eq!(
            fingerprint_of("email", &email),
            fingerprint_of("email", &reordered_with_new_field)
        );
        let other = serde_json::json!({"type": "email", "to": ["ana@example.com"], "subject": "Invoice 43", "text": "hi"});
        assert_ne!(
            fingerprint_of("email", &email),
            fingerprint_of("email", &other)
        );
        assert_ne!(
            fingerprint_of("email", &email),
            fingerprint_of("mail", &email)
        );
        // The typed action hashes as its JSON does.
        let typed = Effect {
            provider: "email".into(),
            idempotency_key: "k".into(),
            action: Action::Email {
                to: vec!["ana@example.com".into()],
                subject: "Invoice 42".into(),
                text: Some("hi".into()),
                html: None,
                template: None,
            },
        };
        assert_eq!(fingerprint(&typed), fingerprint_of("email", &email));
        // Pinned: a change of the canonical form must bump FINGERPRINT_VERSION.
        assert_eq!(fingerprint(&typed), PINNED_EMAIL_FINGERPRINT);
        assert_ne!(fingerprint(&typed), legacy_fingerprint(&typed));
    }

    /// sha256("idem-fp/2\0email\0" + the canonical JSON of the email above).
    const PINNED_EMAIL_FINGERPRINT: &str =
        "f71aa93121487b6598e04e660b9ecf88dc26f64a450396083c5d8f1a9d047d59";

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
