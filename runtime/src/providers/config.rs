//! `[providers.NAME]` configuration.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// Which built-in provider a table configures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// Generic HTTP API: method and path from the effect.
    Http,
    /// Email API in the style of Resend: `POST {base_url}/emails`.
    Email,
    /// Declared statements against a database (`url`, `statements`).
    Sql,
}

/// One provider's configuration.
///
/// ```
/// let c: idem::providers::ProviderConfig = toml::from_str(r#"
///     kind = "email"
///     base_url = "http://127.0.0.1:8025"
///     from = "billing@example.com"
///     auth = { env = "EMAIL_API_KEY" }
/// "#).unwrap();
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// `http`, `email` or `sql`.
    pub kind: ProviderKind,
    /// Base URL the effect's path is relative to (`http`, `email`).
    #[serde(default)]
    pub base_url: String,
    /// The database of a `sql` provider: `postgres://..` or `sqlite:..`;
    /// absent or `"store"` for the store's own database (the statement then
    /// commits with the ledger, in one transaction).
    #[serde(default)]
    pub url: Option<String>,
    /// The statements a `sql` provider runs, by name (`$1`, `$2`, ...
    /// placeholders). Plugins name them; they never send SQL.
    #[serde(default)]
    pub statements: BTreeMap<String, String>,
    /// Connections to a `sql` provider's other database (default 4).
    #[serde(default = "default_pool_size")]
    pub pool_size: u32,
    /// Timeout of one request.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Sender address (email).
    #[serde(default)]
    pub from: Option<String>,
    /// Authentication header from a secret.
    #[serde(default)]
    pub auth: Option<AuthConfig>,
    /// HMAC-SHA256 signature of the body in a header.
    #[serde(default)]
    pub hmac: Option<HmacConfig>,
    /// Where the result reference is read from a 2xx response.
    #[serde(default)]
    pub result: ResultRef,
    /// Whether the provider honours `Idempotency-Key` (default true). When it
    /// does not, an effect whose outcome is unknown is never sent again.
    #[serde(default = "yes")]
    pub dedupes: bool,
    /// How long the provider remembers a key (default 24 h). An effect whose
    /// earlier try may have reached the provider is sent again only inside
    /// this window (counted from its first try); past it, the job is
    /// dead-lettered `dedupe_window_passed` for an operator to resolve.
    #[serde(default = "default_window", with = "humantime_serde")]
    pub dedupe_window: Duration,
    /// Retry-storm protection.
    #[serde(default, flatten)]
    pub guard: GuardConfig,
}

fn default_pool_size() -> u32 {
    4
}

fn yes() -> bool {
    true
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_window() -> Duration {
    Duration::from_secs(24 * 3600)
}

/// A secret: an environment variable or a file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretRef {
    /// Read from this environment variable.
    #[serde(default)]
    pub env: Option<String>,
    /// Read from this file (trailing newline trimmed).
    #[serde(default)]
    pub file: Option<std::path::PathBuf>,
}

impl SecretRef {
    /// Reads the secret.
    pub fn read(&self) -> Result<String, String> {
        if let Some(var) = &self.env {
            return std::env::var(var)
                .map_err(|_| format!("environment variable {var} is not set"));
        }
        if let Some(path) = &self.file {
            return std::fs::read_to_string(path)
                .map(|s| s.trim_end().to_string())
                .map_err(|e| format!("cannot read secret file {}: {e}", path.display()));
        }
        Err("a secret needs `env` or `file`".into())
    }
}

/// `Authorization`-style header from a secret.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Header name (default `Authorization`).
    #[serde(default = "authorization")]
    pub header: String,
    /// Prefix before the secret (default `Bearer `).
    #[serde(default = "bearer")]
    pub prefix: String,
    /// The secret.
    #[serde(flatten)]
    pub secret: SecretRef,
}

fn authorization() -> String {
    "Authorization".into()
}

fn bearer() -> String {
    "Bearer ".into()
}

/// HMAC-SHA256 signature header.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HmacConfig {
    /// Header name (default `X-Idem-Signature`).
    #[serde(default = "signature")]
    pub header: String,
    /// The key.
    #[serde(flatten)]
    pub secret: SecretRef,
}

fn signature() -> String {
    "X-Idem-Signature".into()
}

/// Where a 2xx response's reference is read.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResultRef {
    /// JSON pointer into the body (default `/id`).
    #[serde(default = "id_pointer")]
    pub json_pointer: String,
    /// Or a response header.
    #[serde(default)]
    pub header: Option<String>,
}

impl Default for ResultRef {
    fn default() -> Self {
        ResultRef {
            json_pointer: id_pointer(),
            header: None,
        }
    }
}

fn id_pointer() -> String {
    "/id".into()
}

/// Retry-storm protection of one provider.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GuardConfig {
    /// Most calls in flight at once.
    pub concurrency: usize,
    /// Most calls per second (0: unlimited).
    pub rate_per_second: f64,
    /// Consecutive failures that open the circuit.
    pub breaker_failures: u32,
    /// How long the circuit stays open before one trial call.
    #[serde(with = "humantime_serde")]
    pub breaker_cool_down: Duration,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            concurrency: 16,
            rate_per_second: 0.0,
            breaker_failures: 5,
            breaker_cool_down: Duration::from_secs(30),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_settings_sit_beside_the_provider_settings() {
        let config: ProviderConfig = toml::from_str(
            "kind = \"http\"\nbase_url = \"http://x\"\nconcurrency = 3\nrate_per_second = 5.0\nbreaker_failures = 2\nbreaker_cool_down = \"1s\"\nhmac = { env = \"K\" }\nresult = { header = \"X-Request-Id\" }",
        )
        .unwrap();
        assert_eq!(config.guard.concurrency, 3);
        assert_eq!(config.guard.breaker_cool_down, Duration::from_secs(1));
        assert_eq!(config.result.header.as_deref(), Some("X-Request-Id"));
        let typo = toml::from_str::<ProviderConfig>(
            "kind = \"http\"\nbase_url = \"http://x\"\nconcurency = 3",
        );
        assert!(typo.is_err(), "unknown keys are refused");
        let sql: ProviderConfig = toml::from_str(
            "kind = \"sql\"\nstatements.create_invoice = \"INSERT INTO invoices VALUES ($1)\"",
        )
        .unwrap();
        assert_eq!(sql.kind, ProviderKind::Sql);
        assert_eq!(sql.url, None, "the store's own database");
        assert_eq!(sql.statements.len(), 1);
    }
}
