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
    /// How the provider is asked whether it applied a key whose outcome is
    /// unknown (`http` and `email`; a `sql` provider on another database
    /// answers from its guard table without one).
    #[serde(default)]
    pub lookup: Option<LookupConfig>,
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

/// `[providers.NAME] lookup`: how an `http` or `email` provider is asked
/// whether it applied a key whose outcome is unknown (a timeout, a lost
/// connection, a worker that vanished mid-call). Checked at start by
/// [`LookupConfig::validate`].
///
/// ```
/// let c: idem::providers::ProviderConfig = toml::from_str(r#"
///     kind = "email"
///     base_url = "https://api.example.com"
///     lookup = { path = "/emails/by-key/{key}", not_applied = [404], settle = "30s" }
/// "#).unwrap();
/// let lookup = c.lookup.unwrap();
/// assert_eq!(lookup.method, "GET");
/// assert!(lookup.applied.contains(204));
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupConfig {
    /// `GET` (default) or `HEAD`: a lookup asks, it never writes.
    #[serde(default = "get")]
    pub method: String,
    /// Below `base_url`, holding `{key}` (replaced by the key,
    /// percent-encoded); may end in `?query`.
    pub path: String,
    /// The statuses that mean "applied": `"2xx"` (default) or a list.
    #[serde(default)]
    pub applied: Statuses,
    /// The statuses that mean "not applied" (default `[404]`).
    #[serde(default = "not_found")]
    pub not_applied: Vec<u16>,
    /// Where the reference is read from an "applied" answer (default: the
    /// provider's own `result`).
    #[serde(default)]
    pub result: Option<ResultRef>,
    /// What an "applied" answer whose `result` finds nothing means.
    #[serde(default)]
    pub when_no_result: WhenNoResult,
    /// How long after a try's timeout a "not applied" is trusted (default
    /// 30 s: a request still in flight, or a search index that lags behind
    /// writes, answers "not applied" too).
    #[serde(default = "default_settle", with = "humantime_serde")]
    pub settle: Duration,
    /// The longest one lookup may take, waiting for its budget included
    /// (default: the provider's `timeout`).
    #[serde(default, with = "humantime_serde")]
    pub timeout: Option<Duration>,
    /// Most lookups in flight at once (default 4), beside the effects'
    /// own `concurrency`.
    #[serde(default = "default_lookups_in_flight")]
    pub max_in_flight: usize,
    /// Most lookups per second (default 10; 0: unlimited).
    #[serde(default = "default_lookup_rate")]
    pub rate_per_second: f64,
}

fn get() -> String {
    "GET".into()
}

fn not_found() -> Vec<u16> {
    vec![404]
}

fn default_settle() -> Duration {
    Duration::from_secs(30)
}

fn default_lookups_in_flight() -> usize {
    4
}

fn default_lookup_rate() -> f64 {
    10.0
}

impl ResultRef {
    /// Refuses a `json_pointer` that is not one (RFC 6901: empty, or
    /// starting with `/`): a typo such as `data/0/id` would find nothing in
    /// every answer, and a lookup with `when_no_result = "not_applied"`
    /// would read every request it found as not applied.
    ///
    /// `config.result.validate()?;`
    pub fn validate(&self) -> Result<(), String> {
        if self.header.is_none()
            && !self.json_pointer.is_empty()
            && !self.json_pointer.starts_with('/')
        {
            return Err(format!(
                "result json_pointer {:?} must start with '/' (e.g. \"/data/0/id\")",
                self.json_pointer
            ));
        }
        Ok(())
    }
}

impl LookupConfig {
    /// Refuses a lookup that cannot be asked safely, naming the problem:
    /// a method that may write, a path without `{key}`, a status in both
    /// lists, or one that means the provider could not answer (408, 429,
    /// 5xx are always "ask again later").
    ///
    /// `config.lookup.as_ref().map(|l| l.validate()).transpose()?;`
    pub fn validate(&self) -> Result<(), String> {
        if !matches!(self.method.as_str(), "GET" | "HEAD") {
            return Err(format!(
                "lookup method {:?}: a lookup only asks, so it is GET or HEAD",
                self.method
            ));
        }
        if !self.path.starts_with('/') || !self.path.contains("{key}") {
            return Err(format!(
                "lookup path {:?} must start with '/' and hold {{key}}",
                self.path
            ));
        }
        let codes = match &self.applied {
            Statuses::Success => Vec::new(),
            Statuses::Codes(codes) if codes.is_empty() => {
                return Err("lookup `applied` lists no status".into());
            }
            Statuses::Codes(codes) => codes.clone(),
        };
        for (list, status) in codes
            .iter()
            .map(|s| ("applied", *s))
            .chain(self.not_applied.iter().map(|s| ("not_applied", *s)))
        {
            if !(200..=499).contains(&status) || matches!(status, 408 | 429) {
                return Err(format!(
                    "lookup `{list}` holds {status}: a status from 200 to 499 \
                     (408, 429 and 5xx always mean \"ask again later\")"
                ));
            }
        }
        if let Some(both) = self.not_applied.iter().find(|s| self.applied.contains(**s)) {
            return Err(format!(
                "lookup status {both} is in both `applied` and `not_applied`"
            ));
        }
        if self.timeout.is_some_and(|t| t.is_zero()) {
            return Err("lookup `timeout` must be above zero".into());
        }
        if self.max_in_flight == 0 {
            return Err("lookup `max_in_flight` must be at least 1".into());
        }
        if !self.rate_per_second.is_finite() || self.rate_per_second < 0.0 {
            return Err(format!(
                "lookup `rate_per_second` {} must be 0 (unlimited) or more",
                self.rate_per_second
            ));
        }
        Ok(())
    }
}

/// The statuses of a lookup answer that mean "applied".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Statuses {
    /// Any 2xx (`"2xx"`).
    #[default]
    Success,
    /// These statuses (`[200, 202]`).
    Codes(Vec<u16>),
}

impl Statuses {
    /// Whether `status` is one of them.
    ///
    /// `assert!(idem::providers::config::Statuses::Success.contains(201));`
    pub fn contains(&self, status: u16) -> bool {
        match self {
            Statuses::Success => (200..=299).contains(&status),
            Statuses::Codes(codes) => codes.contains(&status),
        }
    }
}

impl<'de> Deserialize<'de> for Statuses {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Given {
            Class(String),
            Codes(Vec<u16>),
        }
        match Given::deserialize(deserializer)? {
            Given::Class(class) if class.eq_ignore_ascii_case("2xx") => Ok(Statuses::Success),
            Given::Class(other) => Err(serde::de::Error::custom(format!(
                "statuses are \"2xx\" or a list of codes, not {other:?}"
            ))),
            Given::Codes(codes) => Ok(Statuses::Codes(codes)),
        }
    }
}

/// What an "applied" answer means when its `result` finds nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenNoResult {
    /// Applied, without a reference (a lookup by key that answers 2xx).
    #[default]
    Applied,
    /// Not applied: a search that answers 200 with an empty list.
    NotApplied,
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

    fn lookup(table: &str) -> Result<LookupConfig, String> {
        let config: ProviderConfig = toml::from_str(&format!(
            "kind = \"http\"\nbase_url = \"http://x\"\nlookup = {{ {table} }}"
        ))
        .map_err(|e| e.to_string())?;
        let lookup = config.lookup.ok_or("no lookup")?;
        lookup.validate()?;
        Ok(lookup)
    }

    #[test]
    fn a_lookup_table_parses_with_its_defaults() {
        let l = lookup("path = \"/emails/by-key/{key}\"").unwrap();
        assert_eq!(l.method, "GET");
        assert_eq!(l.applied, Statuses::Success);
        assert_eq!(l.not_applied, vec![404]);
        assert!(l.result.is_none(), "the provider's own result");
        assert_eq!(l.when_no_result, WhenNoResult::Applied);
        assert_eq!(l.settle, Duration::from_secs(30));
        assert_eq!(l.timeout, None, "the provider's own timeout");
        assert_eq!((l.max_in_flight, l.rate_per_second), (4, 10.0));
        let l = lookup(
            "method = \"HEAD\", path = \"/search?key={key}\", applied = [200, 203], \
             not_applied = [404, 410], result = { json_pointer = \"/data/0/id\" }, \
             when_no_result = \"not_applied\", settle = \"2m\", timeout = \"3s\", \
             max_in_flight = 1, rate_per_second = 0",
        )
        .unwrap();
        assert_eq!(l.applied, Statuses::Codes(vec![200, 203]));
        assert!(l.applied.contains(203) && !l.applied.contains(201));
        assert_eq!(l.when_no_result, WhenNoResult::NotApplied);
        assert_eq!(l.settle, Duration::from_secs(120));
        assert_eq!(l.timeout, Some(Duration::from_secs(3)));
        assert_eq!(l.result.unwrap().json_pointer, "/data/0/id");
    }

    #[test]
    fn a_lookup_that_cannot_be_asked_safely_is_refused_naming_the_problem() {
        for (table, said) in [
            ("path = \"/x/{key}\", colour = 1", "unknown field"),
            ("method = \"GET\"", "missing field `path`"),
            ("path = \"/x/{id}\"", "{key}"),
            ("path = \"x/{key}\"", "start with '/'"),
            ("path = \"/x/{key}\", method = \"DELETE\"", "GET or HEAD"),
            ("path = \"/x/{key}\", method = \"get\"", "GET or HEAD"),
            ("path = \"/x/{key}\", applied = \"3xx\"", "2xx"),
            ("path = \"/x/{key}\", applied = []", "no status"),
            ("path = \"/x/{key}\", not_applied = [200]", "both"),
            ("path = \"/x/{key}\", applied = [200, 404]", "both"),
            ("path = \"/x/{key}\", not_applied = [503]", "503"),
            ("path = \"/x/{key}\", applied = [429]", "429"),
            ("path = \"/x/{key}\", timeout = \"0s\"", "timeout"),
            ("path = \"/x/{key}\", max_in_flight = 0", "max_in_flight"),
            (
                "path = \"/x/{key}\", rate_per_second = -1.0",
                "rate_per_second",
            ),
            (
                "path = \"/x/{key}\", when_no_result = \"maybe\"",
                "unknown variant",
            ),
        ] {
            let refused = lookup(table)
                .err()
                .unwrap_or_else(|| panic!("accepted: {table}"));
            assert!(refused.contains(said), "{table}: {refused}");
        }
        assert!(lookup("path = \"/x/{key}\", not_applied = []").is_ok());
    }

    /// The examples of docs/configuration.md parse and pass validation.
    #[test]
    fn the_documented_lookups_parse() {
        #[derive(Deserialize)]
        struct Doc {
            providers: BTreeMap<String, ProviderConfig>,
        }
        let doc = include_str!("../../../docs/configuration.md");
        let mut lookups = 0;
        for block in doc.split("```toml\n").skip(1) {
            let block = &block[..block.find("```").expect("end of block")];
            let parsed: Doc = toml::from_str(block).unwrap_or_else(|e| panic!("{e}\n{block}"));
            for (name, config) in parsed.providers {
                let lookup = config.lookup.expect("a lookup");
                lookup.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
                lookups += 1;
            }
        }
        assert_eq!(lookups, 4);
    }
}
