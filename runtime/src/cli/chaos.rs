//! `idem chaos`: proves exactly-once effects on the user's own setup. Starts
//! K `idem run` processes on the configured store, enqueues N jobs of the
//! example plugins (duplicate deliveries and poison payloads among them),
//! SIGKILLs and SIGSTOPs random workers and restarts them, injects provider
//! faults (ambiguous timeouts, dropped connections, 5xx, 429) at a local
//! provider server, terminates the workers' PostgreSQL connections, then
//! waits for the drain and checks: no job lost, no effect applied twice,
//! every dead job classified, no lease left behind.
//!
//! Lives beside the provider server (a dev tool), outside the hot path.

use super::CliError;
use crate::config::Config;
use crate::store::{JobFilter, JobState, NewJob, Store};
use idem_provider_server::{ProviderServerConfig, ProviderServerHandle};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Arguments of `idem chaos`.
#[derive(Debug, clap::Args)]
pub struct ChaosArgs {
    /// Jobs enqueued by producers (children come on top).
    #[arg(long, default_value_t = 10_000)]
    pub jobs: u32,
    /// `idem run` processes.
    #[arg(long, default_value_t = 3)]
    pub workers: u32,
    /// Disruptions (SIGKILL or SIGSTOP of a worker) at least.
    #[arg(long, default_value_t = 20)]
    pub kills: u32,
    /// Provider faults per request (see `idem provider-server --fault-rates`).
    #[arg(long, default_value = "500=0.03,429=0.03,late=0.02,drop=0.02")]
    pub fault_rates: String,
    /// Give up after this long, e.g. `10m`.
    #[arg(long, default_value = "15m")]
    pub timeout: String,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// A shell command that restarts the database server, run once in the
    /// middle of the run (e.g. `pg_ctlcluster 15 main restart`); only where
    /// restarting it is allowed.
    #[arg(long)]
    pub restart_db: Option<String>,
    /// The providers cannot dedupe (`dedupes = false`) and offer a lookup
    /// (the provider server's `/by-key/{key}`): every effect in doubt must
    /// be settled by asking, none left for a person.
    #[arg(long)]
    pub lookup: bool,
}

/// The workers' lease: short, so a killed worker's jobs come back quickly.
const LEASE: Duration = Duration::from_secs(2);
/// Tag of the workers' PostgreSQL sessions, so only they are terminated.
const APPLICATION: &str = "idem-chaos";

/// What a chaos run found.
#[derive(Debug, Default, serde::Serialize)]
pub struct ChaosReport {
    /// Backend.
    pub backend: String,
    /// Jobs in the store at the end (producers' and children).
    pub jobs: usize,
    /// Duplicate deliveries enqueued.
    pub duplicate_deliveries: u32,
    /// Poison payloads enqueued.
    pub poison: u32,
    /// Workers SIGKILLed (and restarted).
    pub kills: u32,
    /// Workers SIGSTOPped past their lease (and continued).
    pub stops: u32,
    /// Database connection terminations.
    pub connection_kills: u32,
    /// Database server restarts.
    pub db_restarts: u32,
    /// Lease expiries rescued (redeliveries).
    pub redeliveries: u64,
    /// Idempotency hits reported by the workers that stopped cleanly.
    pub idempotency_hits: u64,
    /// Distinct effect keys applied at the provider.
    pub effects_applied: usize,
    /// Keys applied more than once.
    pub duplicates: usize,
    /// Jobs not finished, or finished without their effects.
    pub lost: usize,
    /// Dead jobs by error code.
    pub dead_by_code: BTreeMap<String, usize>,
    /// Dead jobs without a code.
    pub unclassified_dead: usize,
    /// Jobs still holding a lease.
    pub leases_left: usize,
    /// Whether the providers could not dedupe and offered a lookup.
    pub lookup: bool,
    /// Dead jobs held back by an effect in doubt, and keys waiting for
    /// `idem effects resolve`: what a person would have to settle.
    pub left_for_a_person: usize,
    /// Lookups the provider server answered (effects in doubt asked about).
    pub lookups: u64,
    /// Wall time, seconds.
    pub duration_s: f64,
}

impl ChaosReport {
    /// Whether the run proves the claim: nothing lost, nothing twice, every
    /// dead job classified, no lease left.
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.duplicates == 0
            && self.unclassified_dead == 0
            && self.leases_left == 0
            && self.left_for_a_person == 0
    }
}

/// Runs `idem chaos`.
pub async fn run(config: &Config, plugins_dir: &Path, args: ChaosArgs) -> Result<(), CliError> {
    let timeout = humantime::parse_duration(&args.timeout)
        .map_err(|e| CliError::Usage(format!("--timeout {}: {e}", args.timeout)))?;
    if args.workers == 0 || args.jobs == 0 {
        return Err(CliError::Usage(
            "--workers and --jobs must be above zero".into(),
        ));
    }
    let faults = idem_provider_server::FaultConfig::parse_rates(&args.fault_rates)
        .map_err(|e| CliError::Usage(format!("--fault-rates: {e}")))?;
    let store = super::queue::store(config).await?;
    let existing = store
        .job_list(JobFilter {
            limit: 1,
            ..JobFilter::default()
        })
        .await
        .map_err(runtime)?;
    if !existing.is_empty() {
        return Err(CliError::Usage(
            "idem chaos needs an empty store: pass --database-url of a fresh database".into(),
        ));
    }
    let provider = ProviderServerHandle::start(ProviderServerConfig {
        faults,
        late_by: Duration::from_millis(1500),
        // With lookups the providers cannot dedupe: a repeat is applied
        // (and counted as a duplicate) again.
        dedupe: !args.lookup,
        ..ProviderServerConfig::default()
    })
    .await
    .map_err(|e| CliError::Runtime(e.into()))?;
    let dir = tempfile::tempdir().map_err(|e| CliError::Runtime(e.into()))?;
    let config_path = write_config(
        dir.path(),
        config,
        plugins_dir,
        &provider.base_url,
        args.lookup,
    )?;
    let started = Instant::now();
    let mut report = ChaosReport {
        backend: store.backend().as_str().to_string(),
        lookup: args.lookup,
        ..ChaosReport::default()
    };
    let mut workers: Vec<Child> = (0..args.workers)
        .map(|_| spawn_worker(&config_path))
        .collect::<Result<_, _>>()?;

    let workload = Workload::new(args.jobs);
    report.duplicate_deliveries = workload.duplicates;
    report.poison = workload.poison;
    let steps = args.kills.max(20) as usize;
    let batches = workload.batches(steps);
    let mut step = 0usize;
    loop {
        if let Some(batch) = batches.get(step) {
            store
                .job_insert_many(batch.clone())
                .await
                .map_err(runtime)?;
        }
        if started.elapsed() > timeout {
            stop_all(&mut workers);
            return Err(CliError::Failed(format!(
                "the queue did not drain within {}",
                args.timeout
            )));
        }
        let all_in = step + 1 >= batches.len();
        // With lookups, a job dead-lettered in doubt comes back once the
        // reconcile sweep settles its key: wait for that too.
        if all_in
            && report.kills + report.stops >= args.kills
            && drained(&*store).await?
            && (!args.lookup || left_for_a_person(&*store).await? == 0)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(rand::random_range(200..900))).await;
        if report.kills + report.stops < args.kills || !all_in {
            let victim = rand::random_range(0..workers.len());
            if rand::random_bool(0.7) {
                signal(&workers[victim], "KILL");
                let _ = workers[victim].wait();
                workers[victim] = spawn_worker(&config_path)?;
                report.kills += 1;
            } else {
                signal(&workers[victim], "STOP");
                tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
                signal(&workers[victim], "CONT");
                report.stops += 1;
            }
        }
        if step % 7 == 3 && terminate_connections(&config.database_url).await {
            report.connection_kills += 1;
        }
        if let Some(command) = args.restart_db.as_deref()
            && step == batches.len() / 2
        {
            restart_db(command)?;
            report.db_restarts += 1;
        }
        step += 1;
    }
    report.idempotency_hits = stop_all(&mut workers);
    verify(&*store, &provider, &mut report).await?;
    report.duration_s = started.elapsed().as_secs_f64();
    print(&report, args.json);
    if report.passed() {
        Ok(())
    } else {
        Err(CliError::Failed(
            "chaos run FAILED: see lost / duplicates / unclassified / leases above".into(),
        ))
    }
}

fn runtime(e: crate::store::StoreError) -> CliError {
    CliError::Runtime(e.into())
}

/// The jobs of a run: invoices, orders (a webhook and a child invoice job
/// each), duplicate deliveries and poison payloads.
struct Workload {
    jobs: Vec<NewJob>,
    duplicates: u32,
    poison: u32,
}

impl Workload {
    fn new(n: u32) -> Self {
        let mut out = Workload {
            jobs: Vec::new(),
            duplicates: 0,
            poison: 0,
        };
        for i in 0..u64::from(n) {
            let job = if i % 100 == 99 {
                out.poison += 1;
                NewJob::new("send_invoice_email", b"{}".to_vec())
            } else if i % 3 == 2 {
                let order = 1_000_000 + i;
                let payload = format!(
                    r#"{{"order_id": {order}, "event_id": "evt_{order}", "destination": "acme"}}"#
                );
                NewJob::new("order_sync", payload.into_bytes())
            } else {
                let payload =
                    format!(r#"{{"invoice_id": {i}, "recipient": "customer{i}@example.com"}}"#);
                NewJob::new("send_invoice_email", payload.into_bytes())
            };
            let job = NewJob {
                max_attempts: 25,
                ..job
            };
            if i % 7 == 0 {
                // The same event delivered twice, as a broker would.
                out.duplicates += 1;
                out.jobs.push(job.clone());
            }
            out.jobs.push(job);
        }
        out
    }

    fn batches(&self, steps: usize) -> Vec<Vec<NewJob>> {
        let size = self.jobs.len().div_ceil(steps.max(1)).max(1);
        self.jobs.chunks(size).map(<[NewJob]>::to_vec).collect()
    }
}

/// Dead jobs held back by an effect in doubt, plus keys left for
/// `idem effects resolve`.
async fn left_for_a_person(store: &dyn Store) -> Result<usize, CliError> {
    let mut left = 0;
    for code in crate::queue::reconcile::IN_DOUBT_CODES {
        left += store
            .job_list(JobFilter {
                states: vec![JobState::Dead],
                error_code: Some(code.as_str().to_string()),
                ..JobFilter::default()
            })
            .await
            .map_err(runtime)?
            .len();
    }
    Ok(left)
}

fn write_config(
    dir: &Path,
    config: &Config,
    plugins_dir: &Path,
    provider_url: &str,
    lookup: bool,
) -> Result<PathBuf, CliError> {
    let url = if config.database_url.starts_with("postgres") {
        let sep = if config.database_url.contains('?') {
            '&'
        } else {
            '?'
        };
        format!("{}{sep}application_name={APPLICATION}", config.database_url)
    } else {
        config.database_url.clone()
    };
    let plugins = std::fs::canonicalize(plugins_dir).unwrap_or_else(|_| plugins_dir.to_path_buf());
    let mut text = format!(
        "database_url = {url:?}\nplugins_dir = {:?}\n\n[worker]\nqueues = {{ default = 8 }}\n\
         poll_interval = \"100ms\"\nlease = \"{}ms\"\nshutdown_grace = \"1s\"\nmax_attempts = 25\n\
         backoff_base = \"50ms\"\nbackoff_max = \"1s\"\nreconcile_interval = \"2s\"\n",
        plugins.display().to_string(),
        LEASE.as_millis()
    );
    for (name, kind) in [("email", "email"), ("partner", "http")] {
        text.push_str(&format!(
            "\n[providers.{name}]\nkind = \"{kind}\"\nbase_url = \"{provider_url}\"\n\
             timeout = \"1s\"\nbreaker_cool_down = \"1s\"\n"
        ));
        if lookup {
            // The provider server keeps the first answer per key and finds
            // it by key; its lookup has no lag, so a short settle delay.
            text.push_str(
                "dedupes = false\n\
                 lookup = { path = \"/by-key/{key}\", settle = \"500ms\", timeout = \"1s\" }\n",
            );
        }
    }
    let path = dir.join("idem-chaos.toml");
    std::fs::write(&path, text).map_err(|e| CliError::Runtime(e.into()))?;
    Ok(path)
}

fn spawn_worker(config: &Path) -> Result<Child, CliError> {
    let exe = std::env::current_exe().map_err(|e| CliError::Runtime(e.into()))?;
    Command::new(exe)
        .arg("--config")
        .arg(config)
        .args(["run", "--summary", "true"])
        .env("IDEM_LOG", "error")
        .env_remove("IDEM_DATABASE_URL")
        .env_remove("IDEM_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| CliError::Runtime(anyhow::anyhow!("cannot start a worker: {e}")))
}

fn signal(child: &Child, name: &str) {
    let _ = Command::new("kill")
        .args([format!("-{name}"), child.id().to_string()])
        .status();
}

/// Stops every worker (SIGTERM, then waits); returns the idempotency hits
/// their summaries report.
fn stop_all(workers: &mut [Child]) -> u64 {
    for worker in workers.iter() {
        signal(worker, "CONT");
        signal(worker, "TERM");
    }
    let mut hits = 0;
    for worker in workers.iter_mut() {
        let mut out = String::new();
        if let Some(stdout) = worker.stdout.as_mut() {
            let _ = std::io::Read::read_to_string(stdout, &mut out);
        }
        let _ = worker.wait();
        if let Ok(summary) = serde_json::from_str::<serde_json::Value>(out.trim()) {
            hits += summary["worker"]["idempotency_hits"].as_u64().unwrap_or(0);
        }
    }
    hits
}

async fn drained(store: &dyn Store) -> Result<bool, CliError> {
    let stats = store.queue_stats(None).await.map_err(runtime)?;
    Ok(stats.count(JobState::Available) == 0
        && stats.count(JobState::Running) == 0
        && stats.count(JobState::Retrying) == 0)
}

/// Runs the operator's restart command for the database server.
fn restart_db(command: &str) -> Result<(), CliError> {
    let status = Command::new("sh")
        .args(["-c", command])
        .status()
        .map_err(|e| CliError::Runtime(anyhow::anyhow!("--restart-db {command:?}: {e}")))?;
    if status.success() {
        Ok(())
    } else {
        Err(CliError::Failed(format!(
            "--restart-db {command:?} failed ({status})"
        )))
    }
}

/// Terminates the workers' PostgreSQL sessions (`false` on SQLite, or when
/// none was found).
async fn terminate_connections(database_url: &str) -> bool {
    use sqlx::Connection;
    if !database_url.starts_with("postgres") {
        return false;
    }
    let Ok(mut conn) = sqlx::PgConnection::connect(database_url).await else {
        return false;
    };
    let terminated: Result<i64, _> = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND pid <> pg_backend_pid()) AS t",
    )
    .bind(APPLICATION)
    .fetch_one(&mut conn)
    .await;
    let _ = conn.close().await;
    matches!(terminated, Ok(n) if n > 0)
}

async fn verify(
    store: &dyn Store,
    provider: &ProviderServerHandle,
    report: &mut ChaosReport,
) -> Result<(), CliError> {
    let jobs = store
        .job_list(JobFilter::default())
        .await
        .map_err(runtime)?;
    report.jobs = jobs.len();
    let applied: HashMap<String, u32> = provider
        .effects()
        .await
        .into_iter()
        .filter(|e| !e.key.is_empty())
        .map(|e| (e.key, e.applied))
        .collect();
    report.effects_applied = applied.values().filter(|n| **n > 0).count();
    report.duplicates = applied.values().filter(|n| **n > 1).count();
    for job in &jobs {
        report.redeliveries += u64::from(job.rescues);
        match job.state {
            JobState::Succeeded => {}
            JobState::Dead => match &job.last_error_code {
                Some(code) => *report.dead_by_code.entry(code.clone()).or_default() += 1,
                None => report.unclassified_dead += 1,
            },
            _ => report.lost += 1,
        }
        if job.lease_owner.is_some() {
            report.leases_left += 1;
        }
    }
    report.left_for_a_person = left_for_a_person(store).await?;
    report.lookups = provider.lookups_total();
    // Nothing acknowledged without its effects: every effect of a succeeded
    // job's stored plan was applied at the provider (or, for a child job,
    // the child exists).
    let keyed: std::collections::HashSet<&str> = jobs
        .iter()
        .filter_map(|j| j.idempotency_key.as_deref())
        .collect();
    for job in jobs.iter().filter(|j| j.state == JobState::Succeeded) {
        let plan: Vec<crate::effects::Effect> = job
            .plan
            .as_deref()
            .and_then(|p| serde_json::from_str(p).ok())
            .unwrap_or_default();
        let missing = plan.iter().any(|effect| {
            if effect.provider == crate::providers::JOBS_PROVIDER {
                !keyed.contains(effect.idempotency_key.as_str())
            } else {
                applied.get(&effect.idempotency_key).copied().unwrap_or(0) == 0
            }
        });
        if missing {
            report.lost += 1;
        }
    }
    Ok(())
}

fn print(report: &ChaosReport, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(report).unwrap_or_default()
        );
        return;
    }
    let rows: Vec<(&str, String)> = vec![
        ("backend", report.backend.clone()),
        ("jobs (with children)", report.jobs.to_string()),
        (
            "duplicate deliveries",
            report.duplicate_deliveries.to_string(),
        ),
        ("poison payloads", report.poison.to_string()),
        ("workers SIGKILLed", report.kills.to_string()),
        ("workers SIGSTOPped", report.stops.to_string()),
        (
            "connections terminated",
            report.connection_kills.to_string(),
        ),
        ("database restarts", report.db_restarts.to_string()),
        ("redeliveries (rescues)", report.redeliveries.to_string()),
        ("idempotency hits", report.idempotency_hits.to_string()),
        ("effects applied", report.effects_applied.to_string()),
        ("duplicates", report.duplicates.to_string()),
        ("lost", report.lost.to_string()),
        (
            "dead by code",
            report
                .dead_by_code
                .iter()
                .map(|(code, n)| format!("{code}={n}"))
                .collect::<Vec<_>>()
                .join(" "),
        ),
        ("unclassified dead", report.unclassified_dead.to_string()),
        ("leases left", report.leases_left.to_string()),
        ("left for a person", report.left_for_a_person.to_string()),
        ("lookups answered", report.lookups.to_string()),
        (
            "providers",
            if report.lookup {
                "no dedupe, lookup".to_string()
            } else {
                "dedupe".to_string()
            },
        ),
        ("duration", format!("{:.1} s", report.duration_s)),
    ];
    for (name, value) in rows {
        println!("{name:<24} {value}");
    }
    println!(
        "{}",
        if report.passed() {
            "PASSED: 0 lost, 0 duplicates, 0 left for a person"
        } else {
            "FAILED"
        }
    );
}
