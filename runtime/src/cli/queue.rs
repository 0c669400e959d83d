//! `idem migrate`, `idem enqueue`, `idem run` and `idem stats`.

use super::CliError;
use crate::config::Config;
use crate::plugins::Manifest;
use crate::providers::Providers;
use crate::queue::{Worker, WorkerSettings};
use crate::store::{JobState, NewJob, Store};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Connects to the configured store (applying migrations).
pub async fn store(config: &Config) -> Result<Arc<dyn Store>, CliError> {
    crate::store::connect(&config.database_url).await.map_err(|e| match e {
        crate::store::StoreError::UnsupportedUrl(_) => CliError::Usage(e.to_string()),
        other => CliError::Runtime(anyhow::Error::new(other).context(format!(
            "cannot open the store at {} (check --database-url / IDEM_DATABASE_URL and that the database is reachable)",
            redact_url(&config.database_url)
        ))),
    })
}

/// Hides a password in a database URL.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => match url[scheme + 3..at].split_once(':') {
            Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
            None => url.to_string(),
        },
        _ => url.to_string(),
    }
}

/// `idem migrate`
pub async fn migrate(config: &Config) -> Result<(), CliError> {
    let store = store(config).await?;
    println!(
        "migrated: {} store at {}",
        store.backend(),
        redact_url(&config.database_url)
    );
    Ok(())
}

/// Arguments of `idem enqueue`.
#[derive(Debug, clap::Args)]
pub struct EnqueueArgs {
    /// Plugin that handles the job.
    pub plugin: String,
    /// Payload (JSON).
    #[arg(long, required_unless_present = "payload_file")]
    pub payload: Option<String>,
    /// Read the payload (JSON) from a file instead.
    #[arg(long, conflicts_with = "payload")]
    pub payload_file: Option<std::path::PathBuf>,
    /// The job's idempotency key, unique per plugin (a duplicate returns the existing job).
    #[arg(long)]
    pub key: Option<String>,
    /// Queue.
    #[arg(long, default_value = "default")]
    pub queue: String,
    /// Run no earlier than this from now, e.g. `30s`, `5m`.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub delay: Option<Duration>,
    /// Higher runs first.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub priority: i32,
    /// Attempts before dead-lettering (default: the plugin's manifest, else the config).
    #[arg(long)]
    pub max_attempts: Option<u32>,
    /// Correlation id for tracing across systems.
    #[arg(long)]
    pub correlation_id: Option<String>,
}

/// `idem enqueue`: prints the job id (the existing one for a duplicate key).
pub async fn enqueue(
    config: &Config,
    plugins_dir: &Path,
    args: EnqueueArgs,
) -> Result<(), CliError> {
    let payload = match (&args.payload, &args.payload_file) {
        (Some(payload), _) => payload.clone(),
        (None, Some(path)) => std::fs::read_to_string(path).map_err(|e| {
            CliError::Usage(format!(
                "cannot read --payload-file {}: {e}",
                path.display()
            ))
        })?,
        (None, None) => {
            return Err(CliError::Usage(
                "give --payload JSON or --payload-file PATH".into(),
            ));
        }
    };
    if let Err(e) = serde_json::from_str::<serde_json::Value>(&payload) {
        return Err(CliError::Usage(format!(
            "the payload is not valid JSON: {e}"
        )));
    }
    if let Some(key) = &args.key {
        idem_sdk::key::validate(key).map_err(|e| CliError::Usage(format!("--key: {e}")))?;
    }
    let manifest_path = plugins_dir.join(format!("{}.toml", args.plugin));
    let manifest_attempts = std::fs::read_to_string(&manifest_path)
        .ok()
        .and_then(|text| Manifest::parse(&text).ok())
        .and_then(|m| m.max_attempts);
    let store = store(config).await?;
    let enqueued = store
        .job_insert(NewJob {
            queue: args.queue,
            plugin: args.plugin,
            payload: payload.into_bytes(),
            idempotency_key: args.key,
            priority: args.priority,
            delay: args.delay.unwrap_or_default(),
            max_attempts: args
                .max_attempts
                .or(manifest_attempts)
                .unwrap_or(config.worker.max_attempts),
            correlation_id: args.correlation_id,
        })
        .await
        .map_err(|e| match e {
            crate::store::StoreError::Invalid(why) => CliError::Usage(why),
            other => CliError::Runtime(other.into()),
        })?;
    if !enqueued.inserted {
        eprintln!("a job with this key exists already: job {}", enqueued.id);
    }
    println!("{}", enqueued.id);
    Ok(())
}

/// Arguments of `idem run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Exit 0 once no job is runnable, running or retrying (jobs scheduled for later do not hold it).
    #[arg(long)]
    pub exit_when_drained: bool,
    /// Queues and concurrency, e.g. `default=8,billing=2` (overrides the config).
    #[arg(long)]
    pub queues: Option<String>,
    /// Serve Prometheus metrics on this address (`/metrics`).
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Print the run summary as JSON on stdout when the worker stops.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub summary: bool,
}

/// `idem run`
pub async fn run(config: &Config, plugins_dir: &Path, args: RunArgs) -> Result<(), CliError> {
    if let Some(addr) = args.metrics_listen {
        crate::metrics::install_prometheus(addr)
            .map_err(|e| CliError::Usage(format!("--metrics-listen {addr}: {e}")))?;
    }
    let providers =
        Providers::from_config(&config.providers).map_err(|e| CliError::Usage(e.to_string()))?;
    let registry = super::plugins::registry(config, plugins_dir)?;
    if registry.list().is_empty() {
        eprintln!(
            "warning: no plugins loaded from {}; jobs will wait for them",
            plugins_dir.display()
        );
    }
    let _watcher = match registry.watch() {
        Ok(watcher) => Some(watcher),
        Err(error) => {
            tracing::warn!(%error, "cannot watch the plugins folder; changes are picked up by a periodic rescan");
            None
        }
    };
    let store = store(config).await?;
    let mut settings = WorkerSettings::from_config(config);
    settings.exit_when_drained = args.exit_when_drained;
    if let Some(queues) = &args.queues {
        settings.queues = crate::config::parse_queues(queues)
            .map_err(|e| CliError::Usage(format!("--queues: {e}")))?;
    }
    let concurrency: u64 = settings.queues.values().map(|n| u64::from(*n)).sum();
    if concurrency > u64::from(config.sandbox.max_instances) {
        return Err(CliError::Usage(format!(
            "the queues run {concurrency} jobs at once but the sandbox holds {} instances: lower the queue concurrency or raise [sandbox] max_instances",
            config.sandbox.max_instances
        )));
    }
    tracing::info!(worker = %settings.id, backend = store.backend(), queues = ?settings.queues, "worker starting");
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        super::server::shutdown_signal().await;
        tracing::info!("shutdown requested");
        signal.cancel();
    });
    let rescan = {
        let (registry, stop) = (registry.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_secs(30)) => {
                        let registry = registry.clone();
                        let _ = tokio::task::spawn_blocking(move || registry.refresh()).await;
                    }
                }
            }
        })
    };
    let worker = Worker::new(store.clone(), registry, providers, settings);
    let summary = worker
        .run(shutdown.clone())
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    shutdown.cancel();
    let _ = rescan.await;
    if args.summary {
        let stats = store
            .queue_stats(None)
            .await
            .map_err(|e| CliError::Runtime(e.into()))?;
        println!(
            "{}",
            json!({ "worker": summary, "jobs": states_json(&stats) })
        );
    }
    Ok(())
}

fn states_json(stats: &crate::store::QueueStats) -> serde_json::Value {
    let mut by_state = serde_json::Map::new();
    for state in JobState::ALL {
        by_state.insert(state.as_str().into(), stats.count(state).into());
    }
    by_state.insert("ready".into(), stats.ready.into());
    serde_json::Value::Object(by_state)
}

/// `idem stats`: job counts per state as JSON.
pub async fn stats(config: &Config, queue: Option<&str>) -> Result<(), CliError> {
    let store = store(config).await?;
    let stats = store
        .queue_stats(queue)
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    let mut out = states_json(&stats);
    out["oldest_ready_age_ms"] = stats.oldest_ready_age_ms.into();
    println!("{out}");
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            super::redact_url("postgres://u:secret@h/db"),
            "postgres://u:***@h/db"
        );
        assert_eq!(super::redact_url("sqlite://idem.db"), "sqlite://idem.db");
    }
}
