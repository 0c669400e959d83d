//! Runtime configuration: `idem.toml` (or `--config`), then environment
//! overrides, then command-line flags.
//!
//! ```toml
//! database_url = "sqlite://idem.db"     # or postgres://...
//! plugins_dir = "plugins"              # relative to this file
//!
//! [worker]
//! queues = { default = 10 }            # queue -> jobs run at once by this process
//! poll_interval = "1s"
//! lease = "30s"
//! shutdown_grace = "10s"
//! max_attempts = 10
//! max_deferral = "1h"                 # a job deferred longer is dead-lettered
//! reconcile_interval = "1m"           # settle keys in doubt by asking providers with a lookup ("0s": never)
//! reconcile_replay_rate = 10.0        # dead jobs the sweep replays per second, at most
//! backoff_base = "5s"
//! backoff_max = "15m"
//! prefetch = 16                       # jobs claimed ahead while a queue runs slowly (≤ its concurrency)
//! claim_batch = 512                   # most jobs per claim; a fast queue claims ~50 ms of work ahead, up to this
//! commit_batch = 512                  # most writes per transaction
//! commit_lanes = 1                    # PostgreSQL: transactions committing at once (SQLite: always 1)
//!
//! [retention]
//! succeeded = "24h"
//! dead = "30d"
//!
//! [providers.email]
//! kind = "email"
//! base_url = "http://127.0.0.1:8025"
//!
//! [[schedules]]                       # periodic jobs (see crate::schedule)
//! name = "nightly-report"
//! cron = "0 30 2 * * *"
//! timezone = "Europe/Paris"
//! plugin = "report"
//! ```

use crate::providers::ProviderConfig;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Errors reading the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid.
    #[error("invalid configuration in {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        source: toml::de::Error,
    },
    /// An environment variable holds an invalid value.
    #[error("invalid value for {var}: {why}")]
    Env {
        /// The variable.
        var: &'static str,
        /// Why.
        why: String,
    },
}

/// A queue served with no handler would hold its claimed jobs for ever.
fn queues_of_at_least_one<'de, D>(deserializer: D) -> Result<BTreeMap<String, u32>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::de::Error as _;
    let queues = BTreeMap::<String, u32>::deserialize(deserializer)?;
    if let Some((name, _)) = queues.iter().find(|(_, n)| **n == 0) {
        return Err(D::Error::custom(format!(
            "queue {name:?}: concurrency must be at least 1"
        )));
    }
    for name in queues.keys() {
        crate::boundary::name(name)
            .map_err(|refused| D::Error::custom(format!("queue {refused}")))?;
    }
    Ok(queues)
}

/// Each lane holds a pooled connection while it commits: more than
/// [`MAX_LANES`](crate::store::group_commit::MAX_LANES) would starve claims
/// and reads of the pool.
fn commit_lanes_in_range<'de, D>(deserializer: D) -> Result<usize, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::de::Error as _;
    let lanes = usize::deserialize(deserializer)?;
    crate::store::group_commit::check_lanes(lanes).map_err(D::Error::custom)
}

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `sqlite://PATH` or `postgres://...`.
    pub database_url: String,
    /// Folder of `*.wasm` plugins.
    pub plugins_dir: PathBuf,
    /// Folder of precompiled components (default: the user cache dir).
    pub cache_dir: Option<PathBuf>,
    /// Worker settings.
    pub worker: WorkerConfig,
    /// Engine-wide sandbox settings.
    pub sandbox: SandboxSettings,
    /// Retention of finished jobs.
    pub retention: RetentionConfig,
    /// Providers by name.
    pub providers: BTreeMap<String, ProviderConfig>,
    /// Brokers whose messages become jobs (`[[sources]]`), run by `idem run`.
    pub sources: Vec<crate::sources::SourceConfig>,
    /// Periodic jobs (`[[schedules]]`), checked as the file is read, run by
    /// every `idem run`.
    #[serde(deserialize_with = "crate::schedule::unique_schedules")]
    pub schedules: Vec<crate::schedule::Schedule>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            database_url: "sqlite://idem.db".into(),
            plugins_dir: PathBuf::from("plugins"),
            cache_dir: None,
            worker: WorkerConfig::default(),
            sandbox: SandboxSettings::default(),
            retention: RetentionConfig::default(),
            providers: BTreeMap::new(),
            sources: Vec::new(),
            schedules: Vec::new(),
        }
    }
}

/// Worker settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Queues served, with how many jobs of each this process runs at once
    /// (at least one each).
    #[serde(deserialize_with = "queues_of_at_least_one")]
    pub queues: BTreeMap<String, u32>,
    /// Most jobs of a queue running at once across all nodes (optional).
    pub queue_limits: BTreeMap<String, u32>,
    /// How often to look for jobs when no notification arrives.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Default lease (plugins may set their own).
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// How long running jobs may finish at shutdown before their leases are given back.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Default attempts before dead-lettering.
    pub max_attempts: u32,
    /// Longest run of deferrals (circuit open, a key leased by another
    /// worker) before a job is dead-lettered as `deferred_too_long`.
    #[serde(with = "humantime_serde")]
    pub max_deferral: Duration,
    /// How often the reconcile sweep asks providers that offer a lookup
    /// about keys left in doubt, settles them and replays the dead jobs
    /// they held back (0: never; `idem effects reconcile` runs it once).
    #[serde(with = "humantime_serde")]
    pub reconcile_interval: Duration,
    /// Most dead jobs the sweep replays a second.
    pub reconcile_replay_rate: f64,
    /// Backoff base delay.
    #[serde(with = "humantime_serde")]
    pub backoff_base: Duration,
    /// Backoff cap.
    #[serde(with = "humantime_serde")]
    pub backoff_max: Duration,
    /// Replace dead jobs' payloads by a hash reference.
    pub redact_dead_payloads: bool,
    /// Jobs claimed ahead per queue, beyond its concurrency, while the
    /// queue runs slowly (at most the concurrency; 0: claim only for free
    /// handlers). A fast queue claims about 50 ms of its jobs ahead, up to
    /// `claim_batch`.
    pub prefetch: usize,
    /// Most jobs claimed by one statement, and most jobs one queue holds
    /// ahead of its handlers.
    pub claim_batch: usize,
    /// Most writes committed in one transaction.
    pub commit_batch: usize,
    /// How long a commit waits for more writes when few are queued (0: never
    /// wait; a busy worker batches while the previous commit runs).
    #[serde(with = "humantime_serde")]
    pub commit_wait: Duration,
    /// PostgreSQL: group-commit lanes, transactions committing at once,
    /// each with its own connection (SQLite has one writer: always 1). Two
    /// help plans with many ledger writes per job; see
    /// [`GroupCommitSettings::lanes`](crate::store::group_commit::GroupCommitSettings::lanes).
    #[serde(deserialize_with = "commit_lanes_in_range")]
    pub commit_lanes: usize,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            // I/O-bound by default: a handler spends most of a job with an
            // effect waiting on its provider (as many as a provider's
            // default `concurrency`; docs/operations.md, "Sizing").
            queues: BTreeMap::from([("default".to_string(), 16)]),
            queue_limits: BTreeMap::new(),
            poll_interval: Duration::from_secs(1),
            lease: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(10),
            max_attempts: 10,
            max_deferral: Duration::from_secs(3600),
            reconcile_interval: Duration::from_secs(60),
            reconcile_replay_rate: 10.0,
            backoff_base: Duration::from_secs(5),
            backoff_max: Duration::from_secs(15 * 60),
            redact_dead_payloads: false,
            prefetch: 16,
            claim_batch: 512,
            commit_batch: 512,
            commit_wait: Duration::ZERO,
            commit_lanes: 1,
        }
    }
}

/// Engine-wide sandbox settings (`[sandbox]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxSettings {
    /// Fuel metering, needed for plugins whose manifest sets `fuel` (costs speed).
    pub fuel: bool,
    /// Pooling allocator (fast fresh instances).
    pub pooling: bool,
    /// Instances alive at once.
    pub max_instances: u32,
    /// Largest memory cap any plugin may ask for, in MiB.
    pub max_memory_mib: u64,
}

impl Default for SandboxSettings {
    fn default() -> Self {
        let engine = crate::sandbox::SandboxConfig::default();
        SandboxSettings {
            fuel: engine.fuel,
            pooling: engine.pooling,
            max_instances: engine.max_instances,
            max_memory_mib: (engine.max_memory >> 20) as u64,
        }
    }
}

/// Retention of finished jobs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Keep succeeded and cancelled jobs this long.
    #[serde(with = "humantime_serde")]
    pub succeeded: Duration,
    /// Keep dead jobs this long.
    #[serde(with = "humantime_serde")]
    pub dead: Duration,
    /// Keep finished effect-ledger rows this long (longer than any duplicate
    /// delivery can arrive: a pruned key can be carried out again).
    #[serde(with = "humantime_serde")]
    pub effects: Duration,
    /// How often the pruner runs.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            succeeded: Duration::from_secs(24 * 3600),
            dead: Duration::from_secs(30 * 24 * 3600),
            effects: Duration::from_secs(30 * 24 * 3600),
            interval: Duration::from_secs(60),
        }
    }
}

impl Config {
    /// Reads `path` if given (or `./idem.toml` if it exists), then applies
    /// environment overrides. Relative `plugins_dir`/`cache_dir` are resolved
    /// against the file's folder.
    ///
    /// ```no_run
    /// let config = idem::config::Config::load(None)?;
    /// # Ok::<(), idem::config::ConfigError>(())
    /// ```
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let default_path = Path::new("idem.toml");
        let path = match path {
            Some(p) => Some(p.to_path_buf()),
            None if default_path.exists() => Some(default_path.to_path_buf()),
            None => None,
        };
        let mut config = match &path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                let mut config: Config =
                    toml::from_str(&text).map_err(|source| ConfigError::Parse {
                        path: path.clone(),
                        source,
                    })?;
                let base = path.parent().unwrap_or(Path::new("."));
                config.plugins_dir = base.join(&config.plugins_dir);
                config.cache_dir = config.cache_dir.map(|d| base.join(d));
                config
            }
            None => Config::default(),
        };
        config.apply_env(|var| std::env::var(var).ok())?;
        Ok(config)
    }

    /// Applies `IDEM_*` overrides read through `get`.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let duration = |var: &'static str, text: String| {
            humantime::parse_duration(&text).map_err(|e| ConfigError::Env {
                var,
                why: e.to_string(),
            })
        };
        if let Some(url) = get("IDEM_DATABASE_URL") {
            self.database_url = url;
        }
        if let Some(dir) = get("IDEM_PLUGINS_DIR") {
            self.plugins_dir = PathBuf::from(dir);
        }
        if let Some(dir) = get("IDEM_CACHE_DIR") {
            self.cache_dir = Some(PathBuf::from(dir));
        }
        if let Some(queues) = get("IDEM_QUEUES") {
            self.worker.queues = parse_queues(&queues).map_err(|why| ConfigError::Env {
                var: "IDEM_QUEUES",
                why,
            })?;
        }
        for (var, slot) in [
            ("IDEM_POLL_INTERVAL", &mut self.worker.poll_interval),
            ("IDEM_LEASE", &mut self.worker.lease),
            ("IDEM_BACKOFF_BASE", &mut self.worker.backoff_base),
            ("IDEM_BACKOFF_MAX", &mut self.worker.backoff_max),
            ("IDEM_SHUTDOWN_GRACE", &mut self.worker.shutdown_grace),
            ("IDEM_MAX_DEFERRAL", &mut self.worker.max_deferral),
            (
                "IDEM_RECONCILE_INTERVAL",
                &mut self.worker.reconcile_interval,
            ),
            ("IDEM_RETENTION_SUCCEEDED", &mut self.retention.succeeded),
            ("IDEM_RETENTION_DEAD", &mut self.retention.dead),
            ("IDEM_RETENTION_EFFECTS", &mut self.retention.effects),
        ] {
            if let Some(text) = get(var) {
                *slot = duration(var, text)?;
            }
        }
        if let Some(text) = get("IDEM_MAX_ATTEMPTS") {
            self.worker.max_attempts = text.parse().map_err(|e| ConfigError::Env {
                var: "IDEM_MAX_ATTEMPTS",
                why: format!("{e}"),
            })?;
        }
        Ok(())
    }
}

/// Parses `default=10,billing=2` (a bare name means 1).
///
/// ```
/// let q = idem::config::parse_queues("default=10,billing").unwrap();
/// assert_eq!(q["billing"], 1);
/// ```
pub fn parse_queues(text: &str) -> Result<BTreeMap<String, u32>, String> {
    let mut queues = BTreeMap::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, n) = match part.split_once('=') {
            Some((name, n)) => (
                name.trim(),
                n.trim()
                    .parse::<u32>()
                    .map_err(|e| format!("{part:?}: {e}"))?,
            ),
            None => (part, 1),
        };
        if name.is_empty() || n == 0 {
            return Err(format!(
                "{part:?}: expected QUEUE=CONCURRENCY with CONCURRENCY >= 1"
            ));
        }
        // A queue no job can be enqueued on (the store's name rule) is a
        // typo to show now, not a worker that waits for nothing.
        crate::boundary::name(name).map_err(|refused| format!("queue {refused}"))?;
        queues.insert(name.to_string(), n);
    }
    if queues.is_empty() {
        return Err("no queue given".into());
    }
    Ok(queues)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_win_and_bad_values_name_the_variable() {
        let mut config = Config::default();
        config
            .apply_env(|v| match v {
                "IDEM_DATABASE_URL" => Some("postgres://x".into()),
                "IDEM_QUEUES" => Some("a=2,b".into()),
                "IDEM_LEASE" => Some("2m".into()),
                _ => None,
            })
            .unwrap();
        assert_eq!(config.database_url, "postgres://x");
        assert_eq!(config.worker.queues.len(), 2);
        assert_eq!(config.worker.lease, Duration::from_secs(120));
        let err = config
            .apply_env(|v| (v == "IDEM_LEASE").then(|| "soon".into()))
            .unwrap_err();
        assert!(err.to_string().contains("IDEM_LEASE"));
    }

    #[test]
    fn the_file_is_strict() {
        let err = toml::from_str::<Config>("databse_url = \"x\"").unwrap_err();
        assert!(err.to_string().contains("databse_url"));
        let config: Config =
            toml::from_str("[worker]\nqueues = { mail = 3 }\nlease = \"1m\"").unwrap();
        assert_eq!(config.worker.queues["mail"], 3);
        assert_eq!(config.worker.lease, Duration::from_secs(60));
        let slash = toml::from_str::<Config>("[worker]\nqueues = { \"orders/eu\" = 1 }")
            .unwrap_err()
            .to_string();
        assert!(slash.contains("orders/eu"), "{slash}");
        assert!(parse_queues("orders/eu=2").is_err());
        assert!(parse_queues("orders.eu=2,mail").is_ok());
        let zero = toml::from_str::<Config>("[worker]\nqueues = { mail = 0 }").unwrap_err();
        assert!(zero.to_string().contains("at least 1"), "{zero}");
        let err = toml::from_str::<Config>("[worker]\nlease = \"soon\"").unwrap_err();
        assert!(err.to_string().contains("soon"), "{err}");
        let lanes: Config = toml::from_str("[worker]\ncommit_lanes = 2").unwrap();
        assert_eq!(lanes.worker.commit_lanes, 2);
        for wrong in ["0", "5", "1000"] {
            let err =
                toml::from_str::<Config>(&format!("[worker]\ncommit_lanes = {wrong}")).unwrap_err();
            assert!(err.to_string().contains("between 1 and 4"), "{err}");
        }
    }

    #[test]
    fn schedules_are_checked_and_named_in_errors() {
        let config: Config = toml::from_str(
            "[[schedules]]\nname = \"nightly\"\ncron = \"30 2 * * *\"\n\
             timezone = \"Europe/Paris\"\nplugin = \"report\"\npayload = '{\"a\": 1}'\n\
             missed = \"all\"\ncatch_up_limit = 5\n\n\
             [[schedules]]\nname = \"tick\"\ncron = \"*/5 * * * * *\"\nplugin = \"noop\"\n\
             payload = { b = [1, 2] }\n",
        )
        .unwrap();
        let [nightly, tick] = &config.schedules[..] else {
            panic!("two schedules: {:?}", config.schedules)
        };
        assert_eq!(nightly.payload, br#"{"a":1}"#);
        assert_eq!(nightly.missed, crate::schedule::Missed::All);
        assert_eq!(nightly.catch_up_limit, 5);
        assert_eq!(tick.timezone, "UTC");
        assert_eq!(tick.queue, "default");
        assert_eq!(tick.missed, crate::schedule::Missed::One);
        assert_eq!(tick.catch_up_limit, 100);
        assert_eq!(tick.payload, br#"{"b":[1,2]}"#);
        let refused = |table: &str, expected: &[&str]| {
            let err = toml::from_str::<Config>(&format!("[[schedules]]\n{table}"))
                .unwrap_err()
                .to_string();
            for part in expected {
                assert!(err.contains(part), "{part:?} not in {err}");
            }
        };
        let base = "plugin = \"p\"\n";
        refused(
            &format!("name = \"bad-cron\"\ncron = \"61 * * * *\"\n{base}"),
            &["schedule \"bad-cron\"", "cron \"61 * * * *\""],
        );
        refused(
            &format!("name = \"short\"\ncron = \"* * *\"\n{base}"),
            &["schedule \"short\"", "cron"],
        );
        refused(
            &format!("name = \"tz\"\ncron = \"* * * * *\"\ntimezone = \"Mars/Olympus\"\n{base}"),
            &["schedule \"tz\"", "unknown time zone \"Mars/Olympus\""],
        );
        refused(
            &format!("name = \"a/b\"\ncron = \"* * * * *\"\n{base}"),
            &["schedule \"a/b\"", "name"],
        );
        refused(
            &format!("name = \"json\"\ncron = \"* * * * *\"\npayload = \"{{nope\"\n{base}"),
            &["schedule \"json\"", "payload is not JSON"],
        );
        refused(
            &format!("name = \"never\"\ncron = \"0 0 30 2 *\"\n{base}"),
            &["schedule \"never\"", "never fires"],
        );
        refused(
            &format!("name = \"q\"\ncron = \"* * * * *\"\nqueue = \"a b\"\n{base}"),
            &["schedule \"q\"", "queue name"],
        );
        refused(
            &format!("name = \"m\"\ncron = \"* * * * *\"\nmissed = \"some\"\n{base}"),
            &["some"],
        );
        // From the review: names that read differently on each node, and a
        // limit that would make one round thousands of transactions.
        for zone in ["localtime", "Factory", "right/UTC"] {
            refused(
                &format!("name = \"z\"\ncron = \"* * * * *\"\ntimezone = \"{zone}\"\n{base}"),
                &[
                    "schedule \"z\"",
                    "not an IANA zone every node reads the same",
                ],
            );
        }
        refused(
            &format!(
                "name = \"flood\"\ncron = \"* * * * * *\"\nmissed = \"all\"\ncatch_up_limit = 4294967295\n{base}"
            ),
            &["schedule \"flood\"", "catch_up_limit is at most 10000"],
        );
        let twice = "[[schedules]]\nname = \"x\"\ncron = \"* * * * *\"\nplugin = \"p\"\n";
        let err = toml::from_str::<Config>(&format!("{twice}{twice}"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("schedule \"x\"") && err.contains("twice"),
            "{err}"
        );
    }

    #[test]
    fn the_readme_schedules_parse() {
        let readme = include_str!("../../README.md");
        let start = readme
            .find("```toml\n[[schedules]]")
            .expect("schedules block in README")
            + 8;
        let end = start + readme[start..].find("```").expect("end of block");
        let config: Config = toml::from_str(&readme[start..end]).unwrap();
        let [nightly, sync] = &config.schedules[..] else {
            panic!("two schedules: {:?}", config.schedules)
        };
        assert_eq!(nightly.name, "nightly-report");
        assert_eq!(nightly.timezone, "Europe/Paris");
        assert_eq!(nightly.payload, br#"{"kind":"daily"}"#);
        // 02:30 in Paris on 2026-12-07 is 01:30 UTC.
        assert_eq!(
            nightly.next_after(1_796_601_600_000),
            Some(1_796_607_000_000)
        );
        assert_eq!(sync.missed, crate::schedule::Missed::All);
        assert_eq!(sync.catch_up_limit, 100);
    }

    #[test]
    fn the_readme_configuration_parses() {
        let readme = include_str!("../../README.md");
        let start = readme
            .find("```toml\ndatabase_url")
            .expect("config block in README")
            + 8;
        let end = start + readme[start..].find("```").expect("end of block");
        let config: Config = toml::from_str(&readme[start..end]).unwrap();
        assert_eq!(config.providers.len(), 2);
        assert_eq!(config.worker.queue_limits["billing"], 2);
    }
}
