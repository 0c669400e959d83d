//! `idem migrate`, `idem enqueue`, `idem run` and `idem stats`.

use super::CliError;
use crate::config::Config;
use crate::plugins::Manifest;
use crate::providers::Providers;
use crate::queue::{Worker, WorkerSettings};
use crate::store::{JobState, NewJob, Store};
use serde_json::json;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Connects to the configured store (applying migrations).
pub async fn store(config: &Config) -> Result<Arc<dyn Store>, CliError> {
    let opened = crate::store::open(&config.database_url, clock())
        .await
        .map(|store| Arc::new(store) as Arc<dyn Store>);
    opened.map_err(|e| match e {
        crate::store::StoreError::UnsupportedUrl(_) => CliError::Usage(e.to_string()),
        other => CliError::Runtime(anyhow::Error::new(other).context(format!(
            "cannot open the store at {} (check --database-url / IDEM_DATABASE_URL and that the database is reachable)",
            redact_url(&config.database_url)
        ))),
    })
}

/// The store's clock: the database's. A build with failpoints (the
/// fault-injection tests' `idem`) reads the clock the tests move instead when
/// `IDEM_ADJUSTABLE_CLOCK` is set, so a worker process started after a test
/// moved the clock sees the jobs as the test does.
fn clock() -> crate::store::Clock {
    #[cfg(feature = "failpoints")]
    if std::env::var_os("IDEM_ADJUSTABLE_CLOCK").is_some() {
        return crate::store::Clock::Adjustable;
    }
    crate::store::Clock::Database
}

/// Hides the password of a database URL for messages; a URL without one is
/// shown as given.
fn redact_url(text: &str) -> String {
    match url::Url::parse(text) {
        Ok(mut parsed) if parsed.password().is_some() => match parsed.set_password(Some("***")) {
            Ok(()) => parsed.to_string(),
            Err(()) => hide_all_but_scheme(text),
        },
        Ok(_) => text.to_string(),
        // sqlx may still make sense of a URL the parser refuses: show nothing of
        // it that could be a password.
        Err(_) if text.contains('@') => hide_all_but_scheme(text),
        Err(_) => text.to_string(),
    }
}

fn hide_all_but_scheme(text: &str) -> String {
    match text.split_once("://") {
        Some((scheme, _)) => format!("{scheme}://***"),
        None => "***".to_string(),
    }
}

/// `idem migrate [--provider NAME]`: the store's schema, or a `sql`
/// provider's guard table in its own database.
pub async fn migrate(config: &Config, provider: Option<&str>) -> Result<(), CliError> {
    let Some(name) = provider else {
        let store = store(config).await?;
        println!(
            "migrated: {} store at {}",
            store.backend(),
            redact_url(&config.database_url)
        );
        return Ok(());
    };
    let provider_config = config
        .providers
        .get(name)
        .filter(|p| p.kind == crate::providers::config::ProviderKind::Sql)
        .ok_or_else(|| CliError::Usage(format!("no sql provider {name:?} in the configuration")))?;
    let provider = crate::providers::sql::SqlProvider::from_config(
        name,
        provider_config,
        &config.database_url,
    )
    .map_err(|why| CliError::Usage(format!("provider {name:?}: {why}")))?;
    match provider.migrate().await {
        Ok(true) => println!("migrated: the guard table idem_effects of provider {name:?}"),
        Ok(false) => println!(
            "provider {name:?} writes to the store's own database: its statements commit with the ledger, no guard table is needed"
        ),
        Err(failure) => {
            return Err(CliError::Usage(format!(
                "provider {name:?}: {} ({})",
                failure.message, failure.code
            )));
        }
    }
    Ok(())
}

/// Arguments of `idem enqueue`.
#[derive(Debug, clap::Args)]
pub struct EnqueueArgs {
    /// Plugin that handles the job (with --batch: for lines that name none).
    #[arg(required_unless_present = "batch")]
    pub plugin: Option<String>,
    /// Payload (JSON).
    #[arg(long, required_unless_present_any = ["payload_file", "batch"])]
    pub payload: Option<String>,
    /// Enqueue many jobs from NDJSON (one job per line, `-` for stdin) in
    /// batched transactions; prints one job id per line, in input order.
    /// Each line: {"plugin": .., "payload": {..}, "key": .., "queue": ..,
    /// "delay": "30s", "priority": 0, "max_attempts": 5, "correlation_id": ..,
    /// "group": ..};
    /// flags give the defaults. Every line is checked before anything is
    /// inserted.
    #[arg(long, conflicts_with_all = ["payload", "payload_file", "key"])]
    pub batch: Option<std::path::PathBuf>,
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
    /// Group (concurrency key, e.g. `order:42`): at most one job of a group
    /// runs at a time, in enqueue order; others of it wait.
    #[arg(long)]
    pub group: Option<String>,
}

/// `idem enqueue`: prints the job id (the existing one for a duplicate key).
pub async fn enqueue(
    config: &Config,
    plugins_dir: &Path,
    args: EnqueueArgs,
) -> Result<(), CliError> {
    if args.batch.is_some() {
        return enqueue_batch(config, plugins_dir, args).await;
    }
    let plugin = args
        .plugin
        .clone()
        .ok_or_else(|| CliError::Usage("name the plugin".into()))?;
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
    // The plugin's name becomes a file name below: checked first.
    crate::boundary::name(&plugin)
        .map_err(|r| CliError::Usage(format!("plugin name: {} {}", r.shown, r.why)))?;
    let manifest_attempts = manifest_attempts(plugins_dir, &plugin);
    let job = NewJob {
        queue: args.queue,
        plugin,
        payload: payload.into_bytes(),
        idempotency_key: args.key,
        priority: args.priority,
        delay: args.delay.unwrap_or_default(),
        max_attempts: args
            .max_attempts
            .or(manifest_attempts)
            .unwrap_or(config.worker.max_attempts),
        correlation_id: args.correlation_id,
        group: args.group,
    };
    // Refused before anything connects (or creates a database file).
    crate::store::check_new_job(&job).map_err(|e| CliError::Usage(e.to_string()))?;
    let store = store(config).await?;
    let enqueued = store.job_insert(job).await.map_err(|e| match e {
        crate::store::StoreError::Invalid(why) => CliError::Usage(why),
        other => CliError::Runtime(other.into()),
    })?;
    if !enqueued.inserted {
        eprintln!("a job with this key exists already: job {}", enqueued.id);
    }
    println!("{}", enqueued.id);
    Ok(())
}

/// The operator file's `max_attempts` for a plugin, if it sets one.
fn manifest_attempts(plugins_dir: &Path, plugin: &str) -> Option<u32> {
    let path = plugins_dir.join(format!("{plugin}.toml"));
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| Manifest::parse(&text).ok())
        .and_then(|m| m.max_attempts)
}

/// The schedules a worker runs, each checked against the loaded plugins
/// (a schedule of a plugin not loaded is refused at start, not at its
/// first tick) and given its jobs' attempts: its own `max_attempts`, else
/// the plugin's operator file's, else the worker's `default`.
///
/// `settings.schedules = schedules_for(&registry, &settings.schedules, 10)?;`
fn schedules_for(
    registry: &crate::plugins::PluginRegistry,
    schedules: &[crate::schedule::Schedule],
    default: u32,
) -> Result<Vec<crate::schedule::Schedule>, CliError> {
    schedules
        .iter()
        .map(|schedule| {
            let plugin = registry.get(&schedule.plugin).ok_or_else(|| {
                CliError::Usage(format!(
                    "schedule {:?}: plugin {:?} is not loaded (plugins: {})",
                    schedule.name,
                    schedule.plugin,
                    registry
                        .list()
                        .iter()
                        .map(|p| p.name().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            let mut schedule = schedule.clone();
            schedule.max_attempts = Some(
                schedule
                    .max_attempts
                    .or(plugin.manifest.max_attempts)
                    .unwrap_or(default),
            );
            Ok(schedule)
        })
        .collect()
}

/// One line of `idem enqueue --batch`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchLine {
    plugin: Option<String>,
    payload: serde_json::Value,
    key: Option<String>,
    queue: Option<String>,
    #[serde(default, with = "humantime_serde::option")]
    delay: Option<Duration>,
    priority: Option<i32>,
    max_attempts: Option<u32>,
    correlation_id: Option<String>,
    group: Option<String>,
}

/// Jobs per transaction of `idem enqueue --batch`.
const BATCH_CHUNK: usize = 10_000;

/// `idem enqueue --batch FILE`
async fn enqueue_batch(
    config: &Config,
    plugins_dir: &Path,
    args: EnqueueArgs,
) -> Result<(), CliError> {
    let source = args.batch.clone().unwrap_or_default();
    let text = if source.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
            .map_err(|e| CliError::Usage(format!("cannot read the batch from stdin: {e}")))?
    } else {
        std::fs::read_to_string(&source).map_err(|e| {
            CliError::Usage(format!("cannot read --batch {}: {e}", source.display()))
        })?
    };
    let mut attempts = std::collections::HashMap::new();
    let mut jobs = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = |why: String| CliError::Usage(format!("--batch line {}: {why}", n + 1));
        let parsed: BatchLine =
            serde_json::from_str(line).map_err(|e| at(format!("not a job: {e}")))?;
        let plugin = parsed
            .plugin
            .or_else(|| args.plugin.clone())
            .ok_or_else(|| at("no plugin (name one in the line or on the command line)".into()))?;
        if let Some(key) = &parsed.key {
            idem_sdk::key::validate(key).map_err(|e| at(format!("key: {e}")))?;
        }
        crate::boundary::name(&plugin)
            .map_err(|r| at(format!("plugin name: {} {}", r.shown, r.why)))?;
        let manifest = *attempts
            .entry(plugin.clone())
            .or_insert_with(|| manifest_attempts(plugins_dir, &plugin));
        let job = NewJob {
            queue: parsed.queue.unwrap_or_else(|| args.queue.clone()),
            plugin,
            payload: serde_json::to_vec(&parsed.payload).map_err(|e| at(e.to_string()))?,
            idempotency_key: parsed.key,
            priority: parsed.priority.unwrap_or(args.priority),
            delay: parsed.delay.or(args.delay).unwrap_or_default(),
            max_attempts: parsed
                .max_attempts
                .or(args.max_attempts)
                .or(manifest)
                .unwrap_or(config.worker.max_attempts),
            correlation_id: parsed
                .correlation_id
                .or_else(|| args.correlation_id.clone()),
            group: parsed.group.or_else(|| args.group.clone()),
        };
        crate::store::check_new_job(&job).map_err(|e| at(e.to_string()))?;
        jobs.push(job);
    }
    let store = store(config).await?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut existing = 0usize;
    let total = jobs.len();
    let mut jobs = jobs.into_iter();
    loop {
        let chunk: Vec<NewJob> = jobs.by_ref().take(BATCH_CHUNK).collect();
        if chunk.is_empty() {
            break;
        }
        let enqueued = store
            .job_insert_many(chunk)
            .await
            .map_err(|e| CliError::Runtime(e.into()))?;
        for job in enqueued {
            existing += usize::from(!job.inserted);
            writeln!(out, "{}", job.id).map_err(|e| CliError::Runtime(e.into()))?;
        }
    }
    out.flush().map_err(|e| CliError::Runtime(e.into()))?;
    if existing > 0 {
        eprintln!("{existing} of {total} jobs existed already (same plugin and key)");
    }
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
    /// Serve the HTTP surface on this address: the API under `/api/`, the
    /// dashboard at `/ui`, `/metrics` and `/healthz`.
    #[arg(long, conflicts_with = "metrics_listen")]
    pub listen: Option<std::net::SocketAddr>,
    /// Serve only `/metrics` (without a token) and `/healthz` on this
    /// address, as before `--listen` existed.
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    #[command(flatten)]
    pub http: super::ops::HttpArgs,
    /// Print the run summary as JSON on stdout when the worker stops.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub summary: bool,
}

/// `idem run`
pub async fn run(config: &Config, plugins_dir: &Path, args: RunArgs) -> Result<(), CliError> {
    let (listener, metrics_only) = match (args.listen, args.metrics_listen) {
        (Some(addr), _) => (Some(super::ops::bind(addr).await?), false),
        (None, Some(addr)) => (Some(super::ops::bind(addr).await?), true),
        (None, None) => (None, false),
    };
    let providers = Providers::for_store(&config.providers, &config.database_url)
        .map_err(|e| CliError::Usage(e.to_string()))?;
    // Previews served beside the worker run in instances of their own, so
    // the worker keeps its `max_instances` whatever the API is asked.
    let preview_room = if listener.is_some() && !metrics_only {
        crate::ops::preview::PREVIEW_SLOTS
    } else {
        0
    };
    let registry = super::plugins::registry_with(config, plugins_dir, preview_room)?;
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
    settings.schedules = schedules_for(&registry, &settings.schedules, settings.max_attempts)?;
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
    tracing::info!(worker = %settings.id, backend = %store.backend(), queues = ?settings.queues, "worker starting");
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        super::signal::shutdown_signal().await;
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
    let http = match listener {
        Some(listener) => Some(super::ops::start(
            listener,
            &if metrics_only {
                args.http.metrics_only()
            } else {
                args.http.clone()
            },
            config,
            store.clone(),
            Some(registry.clone()),
            providers.clone(),
            true,
            shutdown.clone(),
        )?),
        None => None,
    };
    let sources: Vec<crate::sources::Source> = config
        .sources
        .iter()
        .map(|c| crate::sources::Source::new(c.clone(), config.worker.max_attempts))
        .collect::<Result<_, _>>()
        .map_err(CliError::Usage)?;
    let sources_stop = shutdown.child_token();
    let source_tasks = crate::sources::spawn_all(store.clone(), sources, sources_stop.clone());
    let worker = Worker::new(store.clone(), registry, providers, settings);
    let summary = worker
        .run(shutdown.clone())
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    shutdown.cancel();
    sources_stop.cancel();
    for task in source_tasks {
        // Unacknowledged messages are redelivered: a source stuck on its
        // broker does not hold the exit.
        let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
    }
    let _ = rescan.await;
    if let Some(http) = http {
        // A client that never finishes its request must not hold the exit.
        let _ = tokio::time::timeout(Duration::from_secs(5), http).await;
    }
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

/// `idem stats`: job counts per state, readiness, the last minute's
/// finished jobs and the dead jobs by code, as JSON; the same numbers as
/// `GET /api/queues` (`total`, `queues`, `dead_by_code`).
pub async fn stats(config: &Config, queue: Option<&str>) -> Result<(), CliError> {
    let store = store(config).await?;
    let stats = store
        .queue_stats(queue)
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    let mut out = states_json(&stats);
    out["oldest_ready_age_ms"] = stats.oldest_ready_age_ms.into();
    out["succeeded_last_minute"] = stats.succeeded_last_minute.into();
    out["dead_last_minute"] = stats.dead_last_minute.into();
    let overview = crate::ops::view::overview(&*store)
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    if queue.is_none() {
        out["queues"] = serde_json::to_value(&overview.queues).unwrap_or_default();
        out["dead_by_code"] = serde_json::to_value(&overview.dead_by_code).unwrap_or_default();
        let schedules = crate::ops::view::schedules(&*store, &config.schedules)
            .await
            .map_err(|e| CliError::Runtime(e.into()))?;
        out["schedules"] = serde_json::to_value(&schedules).unwrap_or_default();
    } else {
        let mut codes: Vec<_> = stats.dead_by_code.clone();
        codes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        out["dead_by_code"] = codes
            .into_iter()
            .map(|(code, jobs)| json!({"code": code, "jobs": jobs}))
            .collect::<Vec<_>>()
            .into();
    }
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
        // The last `@` ends the user info, so a password may contain one.
        assert_eq!(
            super::redact_url("postgres://u:p@ss@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        for plain in [
            "postgres://u@h/db",
            "postgres://h/db?sslmode=disable",
            "sqlite:idem.db",
        ] {
            assert_eq!(super::redact_url(plain), plain);
        }
        let unparsable = super::redact_url("postgres://u:secret@h:port/db");
        assert!(!unparsable.contains("secret"), "{unparsable}");
    }
}
