//! `idem bench`: throughput and pickup latency on a clean schema, measured
//! the way `../shared/peers/` measures graphile-worker and pg-boss, so the
//! figures compare in one run.
//!
//! Burn-down: one batched insert of N jobs (bulk enqueue jobs/s), then a
//! worker drains them (the timer starts just before the worker is built and
//! stops when the store shows nothing runnable, running or retrying; jobs/s
//! = N / elapsed). Latency: a worker runs, jobs are added one at a time in a
//! closed loop (the next only after the previous started), enqueue → handler
//! start, 20 warm-up jobs then the samples, nearest-rank p50/p99.
//! Continuous: jobs arrive at a steady rate while a worker runs; every
//! job's enqueue → start latency is kept. The sandbox's own time per job is
//! measured by running the plugin alone.

use super::CliError;
use crate::config::Config;
use crate::plugins::{LoadedPlugin, PluginRegistry};
use crate::providers::{ProviderConfig, Providers};
use crate::queue::{Worker, WorkerSettings};
use crate::sandbox::JobInput;
use crate::store::{Clock, JobState, NewJob, SqlStore, Store};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Which plugin the jobs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BenchPlugin {
    /// No effects: the queue and the sandbox only.
    Noop,
    /// One child job through the effect ledger (`bench_child`).
    Child,
    /// One HTTP request to the local provider server (`bench_http`).
    Http,
    /// One `sql` statement on the store's own database (`bench_sql`): a
    /// row, its ledger entry and the job's success in one commit.
    Sql,
}

impl BenchPlugin {
    fn name(self) -> &'static str {
        match self {
            BenchPlugin::Noop => "noop",
            BenchPlugin::Child => "bench_child",
            BenchPlugin::Http => "bench_http",
            BenchPlugin::Sql => "bench_sql",
        }
    }
}

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchMode {
    /// Bulk enqueue, drain, then closed-loop pickup latency.
    BurnDown,
    /// A steady arrival rate while a worker runs: latency of every job.
    Continuous,
}

/// Arguments of `idem bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(long, value_enum, default_value = "burn-down")]
    pub mode: BenchMode,
    /// The plugin every job runs.
    #[arg(long, value_enum, default_value = "noop")]
    pub plugin: BenchPlugin,
    /// Jobs to drain (burn-down).
    #[arg(short = 'n', long, default_value_t = 20_000)]
    pub jobs: u32,
    /// Handlers per worker process.
    #[arg(long, default_value_t = 10)]
    pub concurrency: u32,
    /// Jobs waiting in all (burn-down): at least `-n`; the drain is timed
    /// until `-n` of them succeeded (the rest stay queued).
    #[arg(long)]
    pub backlog: Option<u32>,
    /// Worker processes for the drain (more than one: PostgreSQL only).
    #[arg(long, default_value_t = 1)]
    pub workers: u32,
    /// Closed-loop latency samples after 20 warm-up jobs (0: skip).
    #[arg(long, default_value_t = 200)]
    pub latency_samples: u32,
    /// Arrival rate of the continuous mode, jobs per second.
    #[arg(long, default_value_t = 1_000)]
    pub rate: u32,
    /// Length of the continuous mode.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub duration: Duration,
    /// Most jobs per claim statement (default: the configuration's).
    #[arg(long)]
    pub claim_batch: Option<usize>,
    /// Most writes per transaction (default: the configuration's).
    #[arg(long)]
    pub commit_batch: Option<usize>,
    /// PostgreSQL: transactions committing at once (default: the
    /// configuration's; SQLite always has one).
    #[arg(long)]
    pub commit_lanes: Option<usize>,
    /// Jobs claimed ahead per queue (default: the configuration's).
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// Burn-down: every Nth job is a `hostile_text` job (its plugin must
    /// be in the plugins folder) whose output puts NUL, control characters
    /// and long messages where the store and the log meet them: the drain
    /// of the others should not notice (issue 22). 0: none.
    #[arg(long, default_value_t = 0)]
    pub hostile_every: u32,
    /// Burn-down: spread the jobs over this many groups (concurrency keys,
    /// one job of a group running at a time), each job's group drawn by a
    /// fixed hash of its number: the claim path with groups against the
    /// plain one. 0: no groups.
    #[arg(long, default_value_t = 0)]
    pub groups: u32,
    /// `--plugin http`: call this provider (an `idem provider-server`
    /// another process runs, e.g. the one a peer's benchmark calls too)
    /// instead of a server inside this process.
    #[arg(long, value_name = "URL")]
    pub provider_url: Option<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Latency percentiles, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Samples.
    pub n: usize,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Fastest.
    pub min_ms: f64,
    /// Slowest.
    pub max_ms: f64,
}

impl Latency {
    fn of(mut samples: Vec<Duration>) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let rank = |p: f64| {
            let i = ((p / 100.0) * samples.len() as f64).ceil() as usize;
            samples[i.clamp(1, samples.len()) - 1]
        };
        let ms = |d: Duration| (d.as_secs_f64() * 100_000.0).round() / 100.0;
        Some(Latency {
            n: samples.len(),
            p50_ms: ms(rank(50.0)),
            p99_ms: ms(rank(99.0)),
            min_ms: ms(samples[0]),
            max_ms: ms(samples[samples.len() - 1]),
        })
    }
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `idem` version.
    pub idem: &'static str,
    /// `sqlite` or `postgres`.
    pub backend: String,
    /// The database's own version.
    pub backend_version: String,
    /// The machine.
    pub machine: Machine,
    /// Mode.
    pub mode: &'static str,
    /// Plugin.
    pub plugin: BenchPlugin,
    /// Jobs drained.
    pub jobs: u32,
    /// Jobs waiting when the drain started.
    pub backlog: u32,
    /// Handlers per worker.
    pub concurrency: u32,
    /// Worker processes.
    pub workers: u32,
    /// Claim, commit and prefetch settings.
    pub claim_batch: usize,
    /// Writes per transaction.
    pub commit_batch: usize,
    /// Group-commit lanes (transactions committing at once).
    pub commit_lanes: usize,
    /// Jobs claimed ahead.
    pub prefetch: usize,
    /// Bulk enqueue, jobs per second.
    pub enqueue_jobs_per_s: Option<u64>,
    /// Drain, jobs per second (worker start-up included).
    pub drain_jobs_per_s: Option<u64>,
    /// Drain time.
    pub drain_ms: Option<u64>,
    /// Enqueue → handler start.
    pub latency: Option<Latency>,
    /// Continuous mode: jobs started per second.
    pub continuous_jobs_per_s: Option<u64>,
    /// The plugin alone in the sandbox: fresh instance + call, µs per job.
    pub sandbox_us_per_job: f64,
    /// Where a drained job's handler time went (one worker process).
    pub breakdown: Option<Breakdown>,
    /// Peak resident memory of this process, MiB.
    pub peak_rss_mib: f64,
}

/// A handler's time per job in a drain, µs: the plugin call, the waits
/// for the store the attempt could not go on without (plans, ledger
/// claims), the provider calls, and the rest (scheduling, parsing). The
/// outcome's commit is not part of it: the handler does not wait for it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Breakdown {
    /// Attempt, in all.
    pub attempt_us: f64,
    /// Plugin call (fresh instance + call).
    pub plugin_call_us: f64,
    /// Store waits.
    pub store_wait_us: f64,
    /// Provider calls.
    pub provider_call_us: f64,
    /// The rest.
    pub other_us: f64,
}

impl Breakdown {
    fn of(stats: &crate::queue::stats::StatsSnapshot) -> Option<Self> {
        let jobs = stats.plugin_calls.max(1) as f64;
        let per_job = |us: u64| us as f64 / jobs;
        (stats.plugin_calls > 0).then(|| Breakdown {
            attempt_us: per_job(stats.attempt_us),
            plugin_call_us: per_job(stats.plugin_call_us),
            store_wait_us: per_job(stats.store_wait_us),
            provider_call_us: per_job(stats.provider_call_us),
            other_us: per_job(stats.attempt_us.saturating_sub(
                stats.plugin_call_us + stats.store_wait_us + stats.provider_call_us,
            )),
        })
    }
}

/// The machine a run was measured on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// CPU model.
    pub cpu: String,
    /// Logical cores.
    pub cores: usize,
    /// Kernel release.
    pub kernel: String,
}

impl Machine {
    fn read() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "unknown".into()),
        }
    }
}

/// Peak resident set of this process (`VmHWM`), MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| (kb / 1024.0 * 10.0).round() / 10.0)
}

/// A clean store for one run: a fresh SQLite file, or a fresh schema on the
/// given PostgreSQL database (dropped afterwards).
pub(super) struct Scratch {
    pub(super) store: Arc<SqlStore>,
    url: String,
    schema: Option<(String, String)>,
    _dir: Option<tempfile::TempDir>,
}

impl Scratch {
    pub(super) async fn open(database_url: Option<&str>) -> Result<Self, CliError> {
        let runtime = |e: crate::store::StoreError| CliError::Runtime(e.into());
        match database_url {
            Some(url) if url.starts_with("postgres") => {
                let schema = format!("idem_bench_{}", hex::encode(rand::random::<[u8; 6]>()));
                let store =
                    crate::store::postgres::connect_with_schema(url, &schema, Clock::Database)
                        .await
                        .map_err(runtime)?;
                let separator = if url.contains('?') { '&' } else { '?' };
                Ok(Scratch {
                    store: Arc::new(store),
                    url: format!("{url}{separator}options=-c%20search_path%3D{schema}"),
                    schema: Some((url.to_string(), schema)),
                    _dir: None,
                })
            }
            Some(url) => Err(CliError::Usage(format!(
                "idem bench measures on a clean store: give no --database-url (a fresh SQLite file) or a postgres:// URL (a fresh schema), not {url}"
            ))),
            None => {
                let dir = tempfile::tempdir().map_err(|e| CliError::Runtime(e.into()))?;
                let url = format!("sqlite://{}", dir.path().join("bench.db").display());
                let store = crate::store::open(&url, Clock::Database)
                    .await
                    .map_err(runtime)?;
                Ok(Scratch {
                    store: Arc::new(store),
                    url,
                    schema: None,
                    _dir: Some(dir),
                })
            }
        }
    }

    /// The table `bench_sql` writes its rows to.
    async fn create_bench_rows(&self) -> Result<(), CliError> {
        const DDL: &str = "CREATE TABLE IF NOT EXISTS idem_bench_rows (i BIGINT PRIMARY KEY)";
        let created = if let Some(pool) = self.store.sqlite_pool() {
            sqlx::query(DDL).execute(pool).await.map(|_| ())
        } else if let Some(pool) = self.store.postgres_pool() {
            sqlx::query(DDL).execute(pool).await.map(|_| ())
        } else {
            Ok(())
        };
        created
            .map_err(|e| CliError::Runtime(anyhow::anyhow!("cannot create idem_bench_rows: {e}")))
    }

    async fn version(&self) -> String {
        let version = if let Some(pool) = self.store.sqlite_pool() {
            sqlx::query_scalar::<_, String>("SELECT 'SQLite ' || sqlite_version()")
                .fetch_one(pool)
                .await
        } else if let Some(pool) = self.store.postgres_pool() {
            sqlx::query_scalar::<_, String>("SELECT version()")
                .fetch_one(pool)
                .await
        } else {
            Ok("unknown".into())
        };
        version.unwrap_or_else(|e| format!("unknown ({e})"))
    }

    pub(super) async fn drop_schema(self) {
        let Some((url, schema)) = &self.schema else {
            return;
        };
        self.store.close().await;
        if let Ok(store) =
            crate::store::postgres::connect_with_schema(url, schema, Clock::Database).await
            && let Some(pool) = store.postgres_pool()
        {
            let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
                .execute(pool)
                .await;
        }
    }
}

fn payload(i: u64) -> Vec<u8> {
    format!(r#"{{"i":{i}}}"#).into_bytes()
}

fn job(plugin: BenchPlugin, i: u64) -> NewJob {
    NewJob::new(plugin.name(), payload(i))
}

/// The cases of `hostile_text` a bench mixes in: each ends where the store,
/// the ledger or the log meets the plugin's text.
const HOSTILE_CASES: [&str; 7] = [
    "nul_code",
    "message_escapes",
    "message_large",
    "code_unicode",
    "key_nul",
    "child_queue_escapes",
    "log_escapes",
];

/// Job `i` of a burn-down: every `hostile_every`th one a hostile job.
fn bench_job(plugin: BenchPlugin, hostile_every: u32, i: u64) -> NewJob {
    let every = u64::from(hostile_every);
    let new = if every > 0 && i % every == every - 1 {
        let case = HOSTILE_CASES[((i / every) as usize) % HOSTILE_CASES.len()];
        NewJob::new(
            "hostile_text",
            format!(r#"{{"case":"{case}"}}"#).into_bytes(),
        )
    } else {
        job(plugin, i)
    };
    NewJob {
        max_attempts: 1,
        ..new
    }
}

/// The group of job `i` among `groups` (none when 0): a fixed hash of `i`
/// (splitmix64), so every run interleaves the groups alike.
fn bench_group(groups: u32, i: u64) -> Option<String> {
    if groups == 0 {
        return None;
    }
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    Some(format!("g{}", z % u64::from(groups)))
}

/// How many of the first `jobs` jobs [`bench_job`] makes hostile.
fn hostile_count(jobs: u32, hostile_every: u32) -> u32 {
    jobs.checked_div(hostile_every).unwrap_or(0)
}

/// The plugin alone: fresh instance and call, mean µs per job.
async fn sandbox_time(registry: &PluginRegistry, plugin: &LoadedPlugin) -> f64 {
    let input = |i: u64| JobInput {
        id: i as i64,
        queue: "default".into(),
        payload: payload(i),
        attempt: 1,
        max_attempts: 1,
        idempotency_key: None,
        correlation_id: "bench".into(),
        enqueued_at_ms: 0,
    };
    let sandbox = registry.sandbox();
    for i in 0..200 {
        let _ = sandbox.call(&plugin.compiled, &input(i)).await;
    }
    let rounds = 5_000u64;
    let started = Instant::now();
    for i in 0..rounds {
        let _ = sandbox.call(&plugin.compiled, &input(i)).await;
    }
    (started.elapsed().as_secs_f64() * 1e6 / rounds as f64 * 100.0).round() / 100.0
}

/// `idem bench`
pub async fn run(
    config: &Config,
    plugins_dir: &Path,
    database_url: Option<&str>,
    args: BenchArgs,
) -> Result<(), CliError> {
    let registry = super::plugins::registry(config, plugins_dir)?;
    let plugin = registry.get(args.plugin.name()).ok_or_else(|| {
        CliError::Usage(format!(
            "the benchmark plugin {} is not in {}: build it with `cargo build --release --target wasm32-wasip2 --manifest-path plugins/Cargo.toml -p noop -p bench_child -p bench_http -p bench_sql` and pass --plugins-dir",
            args.plugin.name(),
            plugins_dir.display()
        ))
    })?;
    if args.plugin == BenchPlugin::Child && registry.get("noop").is_none() {
        return Err(CliError::Usage(format!(
            "the child plugin noop is not in {}",
            plugins_dir.display()
        )));
    }
    if args.workers > 1 && database_url.is_none_or(|u| !u.starts_with("postgres")) {
        return Err(CliError::Usage(
            "more than one worker process needs PostgreSQL: pass --database-url postgres://..."
                .into(),
        ));
    }
    let scratch = Scratch::open(database_url).await?;
    let outcome = measure(config, plugins_dir, &registry, &plugin, &scratch, &args).await;
    scratch.drop_schema().await;
    let report = outcome?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| CliError::Runtime(e.into()))?
        );
    } else {
        print_table(&report);
    }
    Ok(())
}

async fn measure(
    config: &Config,
    plugins_dir: &Path,
    registry: &Arc<PluginRegistry>,
    plugin: &LoadedPlugin,
    scratch: &Scratch,
    args: &BenchArgs,
) -> Result<Report, CliError> {
    let runtime = |e: crate::store::StoreError| CliError::Runtime(e.into());
    let store: Arc<dyn Store> = scratch.store.clone();
    let mut settings = WorkerSettings::from_config(config);
    settings.queues = BTreeMap::from([("default".to_string(), args.concurrency.max(1))]);
    settings.max_attempts = 1;
    // A bench measures its own jobs on a clean store: no schedule's.
    settings.schedules = Vec::new();
    if let Some(claim) = args.claim_batch {
        settings.max_claim = claim;
    }
    if let Some(commit) = args.commit_batch {
        settings.group_commit.max_batch = commit;
    }
    if let Some(lanes) = args.commit_lanes {
        settings.group_commit.lanes = crate::store::group_commit::check_lanes(lanes)
            .map_err(|why| CliError::Usage(format!("--commit-lanes: {why}")))?;
    }
    if let Some(prefetch) = args.prefetch {
        settings.prefetch = prefetch;
    }
    let provider = ProviderSetup::start(args.plugin, args.provider_url.as_deref()).await?;
    if args.plugin == BenchPlugin::Sql {
        scratch.create_bench_rows().await?;
    }
    let mut report = Report {
        idem: env!("CARGO_PKG_VERSION"),
        backend: scratch.store.backend().to_string(),
        backend_version: scratch.version().await,
        machine: Machine::read(),
        mode: match args.mode {
            BenchMode::BurnDown => "burn-down",
            BenchMode::Continuous => "continuous",
        },
        plugin: args.plugin,
        jobs: args.jobs,
        backlog: args.backlog.unwrap_or(args.jobs).max(args.jobs),
        concurrency: args.concurrency,
        workers: args.workers,
        claim_batch: settings.max_claim,
        commit_batch: settings.group_commit.max_batch,
        commit_lanes: crate::store::group_commit::lanes_for(
            scratch.store.backend(),
            settings.group_commit.lanes,
        ),
        prefetch: settings.prefetch,
        enqueue_jobs_per_s: None,
        drain_jobs_per_s: None,
        drain_ms: None,
        latency: None,
        continuous_jobs_per_s: None,
        sandbox_us_per_job: sandbox_time(registry, plugin).await,
        breakdown: None,
        peak_rss_mib: 0.0,
    };
    match args.mode {
        BenchMode::BurnDown => {
            let backlog = report.backlog;
            let jobs: Vec<NewJob> = (0..u64::from(args.jobs))
                .map(|i| NewJob {
                    group: bench_group(args.groups, i),
                    ..bench_job(args.plugin, args.hostile_every, i)
                })
                .collect();
            let started = Instant::now();
            store.job_insert_many(jobs).await.map_err(runtime)?;
            let took = started.elapsed();
            report.enqueue_jobs_per_s = Some(per_second(args.jobs, took));
            // The rest of a backlog waits behind the timed jobs (same
            // priority, later run_at and ids): inserted in chunks, untimed.
            let mut i = u64::from(args.jobs);
            while i < u64::from(backlog) {
                let end = (i + 50_000).min(u64::from(backlog));
                let more = (i..end)
                    .map(|i| NewJob {
                        max_attempts: 1,
                        ..job(args.plugin, i)
                    })
                    .collect();
                store.job_insert_many(more).await.map_err(runtime)?;
                i = end;
            }

            let started = Instant::now();
            let mut took = None;
            if args.workers > 1 {
                drain_in_processes(&scratch.url, plugins_dir, args, provider.as_ref()).await?;
            } else {
                let mut drain = settings.clone();
                drain.id = format!("bench-drain-{}", std::process::id());
                drain.exit_when_drained = backlog == args.jobs;
                let worker = Worker::new(
                    store.clone(),
                    registry.clone(),
                    providers(args.plugin, provider.as_ref())?,
                    drain,
                );
                let stop = CancellationToken::new();
                let stats = worker.stats().clone();
                let running = tokio::spawn(worker.run(stop.clone()));
                if backlog > args.jobs {
                    // Stop once the timed jobs are done.
                    while stats.snapshot().succeeded + stats.snapshot().dead < u64::from(args.jobs)
                    {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    took = Some(started.elapsed());
                    stop.cancel();
                }
                running
                    .await
                    .map_err(|e| CliError::Runtime(e.into()))?
                    .map_err(runtime)?;
                report.breakdown = Breakdown::of(&stats.snapshot());
            }
            let took = took.unwrap_or_else(|| started.elapsed());
            let stats = store.queue_stats(Some("default")).await.map_err(runtime)?;
            let done = stats.count(JobState::Succeeded);
            // A hostile job that only logs succeeds; the others end dead.
            if done < i64::from(args.jobs - hostile_count(args.jobs, args.hostile_every)) {
                return Err(CliError::Failed(format!(
                    "only {done} of {} jobs succeeded ({} dead): the benchmark's plugin or provider failed; run with --log info",
                    args.jobs,
                    stats.count(JobState::Dead)
                )));
            }
            report.drain_ms = Some(took.as_millis() as u64);
            report.drain_jobs_per_s = Some(per_second(args.jobs, took));
            if args.latency_samples > 0 {
                report.latency = closed_loop(
                    store.clone(),
                    registry.clone(),
                    providers(args.plugin, provider.as_ref())?,
                    settings.clone(),
                    args,
                )
                .await?;
            }
        }
        BenchMode::Continuous => {
            let (latency, rate) = continuous(
                store.clone(),
                registry.clone(),
                providers(args.plugin, provider.as_ref())?,
                settings.clone(),
                args,
            )
            .await?;
            report.latency = latency;
            report.continuous_jobs_per_s = Some(rate);
        }
    }
    report.peak_rss_mib = peak_rss_mib();
    Ok(report)
}

fn per_second(jobs: u32, took: Duration) -> u64 {
    (f64::from(jobs) / took.as_secs_f64().max(1e-9)).round() as u64
}

/// The provider of the `http` plugin: one at `--provider-url`, or a
/// provider server inside this process.
struct ProviderSetup {
    base_url: String,
    #[cfg(feature = "provider-server")]
    _server: Option<idem_provider_server::ProviderServerHandle>,
}

impl ProviderSetup {
    /// `--provider-url`, checked: an http(s) URL.
    fn external(url: &str) -> Result<Self, CliError> {
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| CliError::Usage(format!("--provider-url {url:?}: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(CliError::Usage(format!(
                "--provider-url {url:?}: expected http://HOST:PORT or https://..."
            )));
        }
        Ok(ProviderSetup {
            base_url: url.trim_end_matches('/').to_string(),
            #[cfg(feature = "provider-server")]
            _server: None,
        })
    }

    #[cfg(feature = "provider-server")]
    async fn start(plugin: BenchPlugin, url: Option<&str>) -> Result<Option<Self>, CliError> {
        if plugin != BenchPlugin::Http {
            return match url {
                Some(_) => Err(CliError::Usage(
                    "--provider-url is for --plugin http".into(),
                )),
                None => Ok(None),
            };
        }
        if let Some(url) = url {
            return Self::external(url).map(Some);
        }
        let server = idem_provider_server::ProviderServerHandle::start(
            idem_provider_server::ProviderServerConfig::default(),
        )
        .await
        .map_err(|e| CliError::Runtime(anyhow::anyhow!("cannot start the provider server: {e}")))?;
        Ok(Some(ProviderSetup {
            base_url: server.base_url.clone(),
            _server: Some(server),
        }))
    }

    #[cfg(not(feature = "provider-server"))]
    async fn start(plugin: BenchPlugin, url: Option<&str>) -> Result<Option<Self>, CliError> {
        match (plugin, url) {
            (BenchPlugin::Http, Some(url)) => Self::external(url).map(Some),
            (BenchPlugin::Http, None) => Err(CliError::Usage(
                "the http benchmark needs --provider-url, or the local provider server: build idem with the `provider-server` feature".into(),
            )),
            (_, Some(_)) => Err(CliError::Usage(
                "--provider-url is for --plugin http".into(),
            )),
            (_, None) => Ok(None),
        }
    }
}

/// The benchmark plugin's provider: `bench_http` pointing at the provider
/// server, or `bench_db` on the store's own database (none otherwise).
fn providers(plugin: BenchPlugin, setup: Option<&ProviderSetup>) -> Result<Providers, CliError> {
    #[derive(serde::Deserialize)]
    struct Tables {
        providers: BTreeMap<String, ProviderConfig>,
    }
    let Some(text) = providers_toml(plugin, setup) else {
        return Ok(Providers::default());
    };
    let tables: Tables = toml::from_str(&text).map_err(|e| CliError::Runtime(e.into()))?;
    Providers::from_config(&tables.providers).map_err(|e| CliError::Runtime(e.into()))
}

/// The `[providers.*]` table of [`providers`], as an `idem.toml` holds it.
fn providers_toml(plugin: BenchPlugin, setup: Option<&ProviderSetup>) -> Option<String> {
    match (plugin, setup) {
        (BenchPlugin::Sql, _) => Some(format!(
            "[providers.bench_db]\nkind = \"sql\"\ntimeout = \"10s\"\nconcurrency = 256\n\
             statements.insert_row = \"{BENCH_ROW_INSERT}\"\n"
        )),
        (_, Some(setup)) => Some(format!(
            "[providers.bench_http]\nkind = \"http\"\nbase_url = \"{}\"\ntimeout = \"10s\"\n\
             concurrency = 256\nbreaker_failures = 1000000\n",
            setup.base_url
        )),
        (_, None) => None,
    }
}

/// `bench_sql`'s statement: one row per job, a redelivery inserts nothing.
const BENCH_ROW_INSERT: &str =
    "INSERT INTO idem_bench_rows (i) VALUES ($1) ON CONFLICT (i) DO NOTHING RETURNING i";

/// Starts a worker that reports each job's start, for latency runs.
fn observed_worker(
    store: Arc<dyn Store>,
    registry: Arc<PluginRegistry>,
    providers: Providers,
    mut settings: WorkerSettings,
) -> (
    Arc<Worker>,
    mpsc::UnboundedReceiver<(crate::store::JobId, Instant)>,
) {
    settings.id = format!("bench-latency-{}", std::process::id());
    settings.exit_when_drained = false;
    let worker = Worker::new(store, registry, providers, settings);
    let (started, starts) = mpsc::unbounded_channel();
    worker.on_job_start(move |job| {
        let _ = started.send((job.id, Instant::now()));
    });
    (worker, starts)
}

async fn closed_loop(
    store: Arc<dyn Store>,
    registry: Arc<PluginRegistry>,
    providers: Providers,
    settings: WorkerSettings,
    args: &BenchArgs,
) -> Result<Option<Latency>, CliError> {
    let runtime = |e: crate::store::StoreError| CliError::Runtime(e.into());
    let (worker, mut starts) = observed_worker(store.clone(), registry, providers, settings);
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    // Let the worker settle (its LISTEN connection, the first poll).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let warmup = 20u64;
    let mut samples = Vec::with_capacity(args.latency_samples as usize);
    for n in 0..warmup + u64::from(args.latency_samples) {
        let i = 10_000_000 + n;
        let sent = Instant::now();
        let id = store
            .job_insert(job(args.plugin, i))
            .await
            .map_err(runtime)?
            .id;
        let began = loop {
            match tokio::time::timeout(Duration::from_secs(30), starts.recv()).await {
                Ok(Some((started, at))) if started == id => break at,
                Ok(Some(_)) => continue,
                _ => {
                    stop.cancel();
                    return Err(CliError::Failed(format!(
                        "job {id} did not start within 30 s"
                    )));
                }
            }
        };
        if n >= warmup {
            samples.push(began.saturating_duration_since(sent));
        }
    }
    stop.cancel();
    let _ = running.await;
    Ok(Latency::of(samples))
}

async fn continuous(
    store: Arc<dyn Store>,
    registry: Arc<PluginRegistry>,
    providers: Providers,
    settings: WorkerSettings,
    args: &BenchArgs,
) -> Result<(Option<Latency>, u64), CliError> {
    let runtime = |e: crate::store::StoreError| CliError::Runtime(e.into());
    let (worker, mut starts) = observed_worker(store.clone(), registry, providers, settings);
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let every = Duration::from_secs_f64(1.0 / f64::from(args.rate.max(1)));
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sent = std::collections::HashMap::new();
    let mut started = Vec::new();
    let began = Instant::now();
    let mut i = 20_000_000u64;
    while began.elapsed() < args.duration {
        ticker.tick().await;
        let at = Instant::now();
        let id = store
            .job_insert(job(args.plugin, i))
            .await
            .map_err(runtime)?
            .id;
        sent.insert(id, at);
        i += 1;
        while let Ok(start) = starts.try_recv() {
            started.push(start);
        }
    }
    while started.len() < sent.len() {
        match tokio::time::timeout(Duration::from_secs(10), starts.recv()).await {
            Ok(Some(start)) => started.push(start),
            _ => break,
        }
    }
    stop.cancel();
    let _ = running.await;
    let samples: Vec<Duration> = started
        .iter()
        .filter_map(|(id, at)| sent.get(id).map(|t| at.saturating_duration_since(*t)))
        .collect();
    let last = started.iter().map(|(_, at)| *at).max().unwrap_or(began);
    let rate = per_second(
        u32::try_from(samples.len()).unwrap_or(u32::MAX),
        last.saturating_duration_since(began),
    );
    Ok((Latency::of(samples), rate))
}

/// Drains with `workers` `idem run` processes on the same database.
async fn drain_in_processes(
    url: &str,
    plugins_dir: &Path,
    args: &BenchArgs,
    provider: Option<&ProviderSetup>,
) -> Result<(), CliError> {
    let exe = std::env::current_exe().map_err(|e| CliError::Runtime(e.into()))?;
    let config = match providers_toml(args.plugin, provider) {
        Some(text) => {
            let dir = std::env::temp_dir().join(format!("idem-bench-{}", std::process::id()));
            std::fs::create_dir_all(&dir).map_err(|e| CliError::Runtime(e.into()))?;
            let path = dir.join("idem.toml");
            std::fs::write(&path, text).map_err(|e| CliError::Runtime(e.into()))?;
            Some(path)
        }
        None => None,
    };
    let plugins_dir: PathBuf = std::fs::canonicalize(plugins_dir).unwrap_or(plugins_dir.into());
    let mut children = Vec::new();
    for _ in 0..args.workers {
        let mut command = tokio::process::Command::new(&exe);
        command
            .args(["run", "--exit-when-drained", "--summary", "false"])
            .arg("--queues")
            .arg(format!("default={}", args.concurrency))
            .arg("--database-url")
            .arg(url)
            .arg("--plugins-dir")
            .arg(&plugins_dir)
            .env("IDEM_MAX_ATTEMPTS", "1")
            .stdout(std::process::Stdio::null());
        if let Some(config) = &config {
            command.arg("--config").arg(config);
        }
        children.push(command.spawn().map_err(|e| CliError::Runtime(e.into()))?);
    }
    for mut child in children {
        let status = child
            .wait()
            .await
            .map_err(|e| CliError::Runtime(e.into()))?;
        if !status.success() {
            return Err(CliError::Failed(format!(
                "a worker process exited with {status}"
            )));
        }
    }
    Ok(())
}

fn print_table(report: &Report) {
    let or_dash = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    println!(
        "idem {} bench, {} ({}), {} on {} × {} ({})",
        report.idem,
        report.mode,
        report.plugin.name(),
        report.backend_version,
        report.machine.cores,
        report.machine.cpu,
        report.machine.kernel
    );
    println!(
        "  jobs {} (of {} waiting)  concurrency {}  workers {}  claim batch {}  commit batch {}  commit lanes {}  prefetch {}",
        report.jobs,
        report.backlog,
        report.concurrency,
        report.workers,
        report.claim_batch,
        report.commit_batch,
        report.commit_lanes,
        report.prefetch
    );
    println!(
        "  {:<34} {}",
        "bulk enqueue (jobs/s)",
        or_dash(report.enqueue_jobs_per_s)
    );
    println!(
        "  {:<34} {}",
        "drain (jobs/s, start-up included)",
        or_dash(report.drain_jobs_per_s)
    );
    if let Some(rate) = report.continuous_jobs_per_s {
        println!("  {:<34} {rate}", "continuous (jobs/s started)");
    }
    if let Some(l) = &report.latency {
        println!(
            "  {:<34} p50 {:.2} ms  p99 {:.2} ms  (n {}, min {:.2}, max {:.2})",
            "enqueue → start", l.p50_ms, l.p99_ms, l.n, l.min_ms, l.max_ms
        );
    }
    println!(
        "  {:<34} {:.2} µs",
        "sandbox per job (fresh instance)", report.sandbox_us_per_job
    );
    if let Some(b) = &report.breakdown {
        println!(
            "  {:<34} {:.0} µs: plugin {:.0}, store waits {:.0}, provider {:.0}, other {:.0}",
            "handler time per job",
            b.attempt_us,
            b.plugin_call_us,
            b.store_wait_us,
            b.provider_call_us,
            b.other_us
        );
    }
    println!("  {:<34} {:.1} MiB", "peak RSS", report.peak_rss_mib);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nth_bench_job_is_hostile_and_counted() {
        let jobs: Vec<NewJob> = (0..62)
            .map(|i| bench_job(BenchPlugin::Noop, 31, i))
            .collect();
        let hostile: Vec<&NewJob> = jobs.iter().filter(|j| j.plugin == "hostile_text").collect();
        assert_eq!(hostile.len(), 2);
        assert_eq!(hostile.len() as u32, hostile_count(62, 31));
        assert_eq!(jobs[30].plugin, "hostile_text");
        assert_ne!(hostile[0].payload, hostile[1].payload, "the cases cycle");
        assert!(jobs.iter().all(|j| j.max_attempts == 1));
        assert_eq!(hostile_count(62, 0), 0);
        assert!((0..62).all(|i| bench_job(BenchPlugin::Noop, 0, i).plugin == "noop"));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let l = Latency::of(samples).unwrap();
        assert_eq!(
            (l.p50_ms, l.p99_ms, l.min_ms, l.max_ms),
            (50.0, 99.0, 1.0, 100.0)
        );
        assert!(Latency::of(Vec::new()).is_none());
        let one = Latency::of(vec![Duration::from_micros(1500)]).unwrap();
        assert_eq!((one.p50_ms, one.p99_ms), (1.5, 1.5));
    }
}
