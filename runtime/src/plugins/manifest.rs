//! The optional operator file (sidecar manifest) `<plugin>.toml` beside
//! `<plugin>.wasm`: limits, attempts, lease and backoff, and grants that
//! narrow what the plugin declares (see [`super::grants`]).
//!
//! ```toml
//! deadline = "10s"        # wall-clock limit of one call
//! fuel = 50_000_000       # optional instruction budget (needs fuel metering)
//! memory_mib = 64         # linear memory cap
//! max_effects = 100       # caps on the returned plan
//! max_output_bytes = 1048576
//! max_attempts = 10
//! lease = "5m"            # how long a claim lasts without a heartbeat
//! backoff_base = "5s"
//! backoff_max = "15m"
//! providers = ["email"]   # narrows the providers the plugin declares
//! enqueues = []           # narrows the child plugins it declares
//! ```

use crate::effects::OutputLimits;
use crate::sandbox::PluginLimits;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// A plugin's manifest. Every field is optional; unknown fields are errors,
/// so a typo never silently falls back to a default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Wall-clock deadline of one call (humantime, e.g. `"10s"`).
    #[serde(default, with = "humantime_serde::option")]
    pub deadline: Option<Duration>,
    /// Fuel budget of one call.
    pub fuel: Option<u64>,
    /// Linear memory cap in MiB.
    pub memory_mib: Option<u64>,
    /// Most effects in one plan.
    pub max_effects: Option<usize>,
    /// Most bytes in one plan.
    pub max_output_bytes: Option<usize>,
    /// Attempts before the job is dead-lettered.
    pub max_attempts: Option<u32>,
    /// Lease length of a claim.
    #[serde(default, with = "humantime_serde::option")]
    pub lease: Option<Duration>,
    /// Backoff base delay.
    #[serde(default, with = "humantime_serde::option")]
    pub backoff_base: Option<Duration>,
    /// Backoff cap.
    #[serde(default, with = "humantime_serde::option")]
    pub backoff_max: Option<Duration>,
    /// Narrows the providers the plugin declares (`None`: all it declares).
    /// For a component that declares nothing, the providers it may use.
    pub providers: Option<Vec<String>>,
    /// Narrows the child plugins the plugin declares (`None`: all it declares).
    /// For a component that declares nothing, the plugins it may enqueue.
    pub enqueues: Option<Vec<String>>,
}

/// A manifest that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not valid TOML or unknown/mistyped fields.
    #[error("invalid manifest: {0}")]
    Parse(#[from] toml::de::Error),
    /// A value out of range.
    #[error("invalid manifest: {0}")]
    Invalid(String),
}

impl Manifest {
    /// Parses and validates a manifest.
    ///
    /// ```
    /// let m = idem::plugins::Manifest::parse("deadline = \"2s\"\nproviders = [\"email\"]").unwrap();
    /// assert_eq!(m.deadline, Some(std::time::Duration::from_secs(2)));
    /// assert!(idem::plugins::Manifest::parse("deadlin = \"2s\"").is_err());
    /// ```
    pub fn parse(text: &str) -> Result<Self, ManifestError> {
        let manifest: Manifest = toml::from_str(text)?;
        if manifest.deadline == Some(Duration::ZERO) {
            return Err(ManifestError::Invalid("deadline must be above zero".into()));
        }
        if manifest.memory_mib == Some(0) {
            return Err(ManifestError::Invalid(
                "memory_mib must be above zero".into(),
            ));
        }
        if manifest.max_attempts == Some(0) {
            return Err(ManifestError::Invalid(
                "max_attempts must be at least 1".into(),
            ));
        }
        for (list, names) in [
            ("providers", &manifest.providers),
            ("enqueues", &manifest.enqueues),
        ] {
            for name in names.iter().flatten() {
                idem_sdk::declaration::validate_name(name).map_err(|why| {
                    ManifestError::Invalid(format!("{list}: invalid name {name:?}: {why}"))
                })?;
            }
        }
        Ok(manifest)
    }

    /// The sandbox limits this manifest asks for, over the defaults.
    pub fn limits(&self) -> PluginLimits {
        let defaults = PluginLimits::default();
        let output = OutputLimits::default();
        PluginLimits {
            deadline: self.deadline.unwrap_or(defaults.deadline),
            fuel: self.fuel,
            memory: self
                .memory_mib
                .map(|m| (m as usize).saturating_mul(1 << 20))
                .unwrap_or(defaults.memory),
            output: OutputLimits {
                max_effects: self.max_effects.unwrap_or(output.max_effects),
                max_bytes: self.max_output_bytes.unwrap_or(output.max_bytes),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_fall_back_to_defaults() {
        let m = Manifest::parse("memory_mib = 8\nmax_effects = 3").unwrap();
        let limits = m.limits();
        assert_eq!(limits.memory, 8 << 20);
        assert_eq!(limits.output.max_effects, 3);
        assert_eq!(limits.deadline, PluginLimits::default().deadline);
    }

    #[test]
    fn bad_values_are_refused_with_a_reason() {
        assert!(
            Manifest::parse("deadline = \"soon\"")
                .unwrap_err()
                .to_string()
                .contains("soon")
        );
        assert!(Manifest::parse("max_attempts = 0").is_err());
        assert!(Manifest::parse("memory_mib = -1").is_err());
    }

    #[test]
    fn grant_lists_hold_valid_names() {
        let m = Manifest::parse("providers = [\"email\"]\nenqueues = []").unwrap();
        assert_eq!(m.providers.as_deref(), Some(&["email".to_string()][..]));
        assert_eq!(m.enqueues.as_deref(), Some(&[][..]));
        let error = Manifest::parse("enqueues = [\"a b\"]")
            .unwrap_err()
            .to_string();
        assert!(error.contains("enqueues"), "{error}");
    }
}
