//! `idem dlq list|show|replay`: the dead-letter queue is a quarantine, not a bin.

use super::queue::store;
use super::{CliError, printable};
use crate::config::Config;
use crate::store::{Job, JobFilter, JobId, JobState};
use serde_json::json;

/// `idem dlq ...`
#[derive(Debug, clap::Subcommand)]
pub enum DlqCommand {
    /// List dead jobs, newest first.
    List {
        /// Only this plugin.
        #[arg(long)]
        plugin: Option<String>,
        /// Only this error code.
        #[arg(long)]
        code: Option<String>,
        /// Most rows.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Show one dead job with its error history, as JSON.
    Show {
        /// Job id.
        id: i64,
    },
    /// Bring dead jobs back (attempts reset, keys kept), rate-limited.
    Replay {
        /// Job ids.
        ids: Vec<i64>,
        /// Every dead job of this plugin.
        #[arg(long)]
        plugin: Option<String>,
        /// Every dead job with this error code.
        #[arg(long)]
        code: Option<String>,
        /// Every dead job.
        #[arg(long)]
        all: bool,
        /// Most jobs replayed per second, e.g. `10/s`.
        #[arg(long, default_value = "10/s")]
        rate: String,
        /// Drop each job's stored plan so the (fixed) plugin makes a new one;
        /// refused (an error) for a job any of whose effects may have reached
        /// its provider.
        #[arg(long)]
        discard_plan: bool,
        /// Change nothing: run the current plugin on each job's payload in
        /// the sandbox and show its plan next to the stored one, key by key,
        /// with what already happened.
        #[arg(long)]
        dry_run: bool,
        /// With --dry-run: print JSON.
        #[arg(long)]
        json: bool,
        /// With --dry-run: most jobs previewed (the plugin runs once for each).
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
}

/// Runs a DLQ command.
pub async fn run(
    config: &Config,
    plugins_dir: &std::path::Path,
    command: DlqCommand,
) -> Result<(), CliError> {
    match command {
        DlqCommand::List {
            plugin,
            code,
            limit,
        } => list(config, plugin, code, limit).await,
        DlqCommand::Show { id } => show(config, JobId(id)).await,
        DlqCommand::Replay {
            ids,
            plugin,
            code,
            all,
            rate,
            discard_plan,
            dry_run,
            json,
            limit,
        } => {
            let filter = ReplayFilter {
                ids,
                plugin,
                code,
                all,
            };
            if dry_run {
                return preview(config, plugins_dir, filter, json, limit).await;
            }
            replay(config, filter, &rate, discard_plan).await
        }
    }
}

async fn list(
    config: &Config,
    plugin: Option<String>,
    code: Option<String>,
    limit: u32,
) -> Result<(), CliError> {
    let store = store(config).await?;
    let dead = store
        .job_list(dead_jobs(plugin, code, vec![], limit))
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    println!(
        "{:>8} {:<22} {:<28} {:>8} {:<36} {:<20}",
        "ID", "PLUGIN", "CODE", "ATTEMPTS", "KEY", "LAST FAILURE"
    );
    for job in &dead {
        println!(
            "{:>8} {:<22} {:<28} {:>8} {:<36} {:<20}",
            job.id,
            printable(&job.plugin),
            printable(job.last_error_code.as_deref().unwrap_or("-")),
            format!(
                "{}/{}",
                job.attempt,
                job.max_attempts.map_or("-".into(), |n| n.to_string())
            ),
            printable(job.idempotency_key.as_deref().unwrap_or("-")),
            job.last_failed_at_ms
                .map(time)
                .unwrap_or_else(|| "-".into()),
        );
    }
    if dead.is_empty() {
        eprintln!("the dead-letter queue is empty");
    }
    Ok(())
}

/// The filter for dead jobs (`limit` 0: all of them).
fn dead_jobs(plugin: Option<String>, code: Option<String>, ids: Vec<i64>, limit: u32) -> JobFilter {
    JobFilter {
        states: vec![JobState::Dead],
        plugin,
        error_code: code,
        ids: ids.into_iter().map(JobId).collect(),
        limit,
        ..JobFilter::default()
    }
}

fn time(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_default()
}

/// A dead job as JSON (payload shown as text when it is UTF-8).
pub fn job_json(job: &Job) -> serde_json::Value {
    json!({
        "id": job.id,
        "state": job.state.as_str(),
        "plugin": job.plugin,
        "queue": job.queue,
        "idempotency_key": job.idempotency_key,
        "correlation_id": job.correlation_id,
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "plugin_hash": job.plugin_hash,
        "plan_hash": job.plan_hash,
        "last_error": {"code": job.last_error_code, "message": job.last_error_message},
        "first_failed_at": job.first_failed_at_ms.map(time),
        "last_failed_at": job.last_failed_at_ms.map(time),
        "finished_at": job.finished_at_ms.map(time),
        "errors": job.errors,
        "payload": String::from_utf8(job.payload.clone()).map(serde_json::Value::from)
            .unwrap_or_else(|e| json!({"bytes": e.into_bytes().len()})),
        "plan": job.plan.as_deref().and_then(|p| serde_json::from_str::<serde_json::Value>(p).ok()),
    })
}

async fn show(config: &Config, id: JobId) -> Result<(), CliError> {
    let store = store(config).await?;
    match store
        .job_get(id)
        .await
        .map_err(|e| CliError::Runtime(e.into()))?
    {
        Some(job) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&job_json(&job)).unwrap_or_default()
            );
            if job.state != JobState::Dead {
                eprintln!("note: job {id} is {}, not dead", job.state.as_str());
            }
            Ok(())
        }
        None => Err(CliError::Failed(format!("no job {id}"))),
    }
}

/// Which dead jobs to replay.
struct ReplayFilter {
    ids: Vec<i64>,
    plugin: Option<String>,
    code: Option<String>,
    all: bool,
}

impl ReplayFilter {
    fn request(self, discard_plan: bool, limit: u32) -> crate::ops::replay::ReplayRequest {
        crate::ops::replay::ReplayRequest {
            ids: self.ids.into_iter().map(JobId).collect(),
            plugin: self.plugin,
            code: self.code,
            all: self.all,
            discard_plan,
            limit,
        }
    }
}

fn ops_error(error: crate::ops::OpsError) -> CliError {
    match error {
        crate::ops::OpsError::Invalid(m) => CliError::Usage(m),
        crate::ops::OpsError::NotFound(m) => CliError::Failed(m),
        other => CliError::Runtime(other.into()),
    }
}

async fn replay(
    config: &Config,
    filter: ReplayFilter,
    rate: &str,
    discard_plan: bool,
) -> Result<(), CliError> {
    let pacer = crate::ops::replay::parse_rate(rate)
        .and_then(crate::ops::replay::Pacer::per_second)
        .map_err(CliError::Usage)?;
    let request = filter.request(discard_plan, 0);
    request.check().map_err(ops_error)?;
    let store = store(config).await?;
    let report = crate::ops::replay::replay(&*store, request, &pacer)
        .await
        .map_err(ops_error)?;
    for job in &report.replayed {
        eprintln!(
            "replayed job {} ({}, {})",
            job.id,
            job.plugin,
            job.code.as_deref().unwrap_or("-")
        );
    }
    for refusal in &report.refused {
        eprintln!(
            "job {}: refused ({}): {}",
            refusal.id, refusal.reason, refusal.message
        );
    }
    let refused: Vec<JobId> = report.refused.iter().map(|r| r.id).collect();
    println!(
        "{}",
        json!({"replayed": report.replayed.len(), "refused": refused})
    );
    if refused.is_empty() {
        Ok(())
    } else {
        Err(CliError::Failed(format!(
            "{} job(s) refused (see above); {} replayed",
            refused.len(),
            report.replayed.len()
        )))
    }
}

/// `idem dlq replay --dry-run`: the current plugin's plan beside the stored one.
async fn preview(
    config: &Config,
    plugins_dir: &std::path::Path,
    filter: ReplayFilter,
    as_json: bool,
    limit: u32,
) -> Result<(), CliError> {
    let request = filter.request(false, limit.max(1));
    request.check().map_err(ops_error)?;
    let registry = super::plugins::registry(config, plugins_dir)?;
    let store = store(config).await?;
    let mut jobs = crate::ops::replay::selected(&*store, &request)
        .await
        .map_err(ops_error)?;
    let more = jobs.len() > request.limit as usize;
    jobs.truncate(request.limit as usize);
    let previews = crate::ops::preview::preview_jobs(&*store, &registry, &jobs, None)
        .await
        .map_err(ops_error)?;
    if as_json {
        println!(
            "{}",
            json!({"dry_run": true, "jobs": previews, "more": more})
        );
        return Ok(());
    }
    if more {
        eprintln!(
            "(more dead jobs match: showing the newest {}; raise --limit)",
            request.limit
        );
    }
    if previews.is_empty() {
        eprintln!("no dead job matches");
    }
    for p in &previews {
        println!(
            "job {} ({}, died {}): {}",
            p.id,
            printable(&p.plugin),
            printable(p.code.as_deref().unwrap_or("-")),
            printable(&p.verdict)
        );
        println!(
            "  plugin then {}  now {}",
            p.stored_plugin_hash.as_deref().map(short).unwrap_or("-"),
            p.current_plugin_hash.as_deref().map(short).unwrap_or("-")
        );
        if let Some(error) = &p.error {
            println!(
                "  the current plugin fails: {} ({}) {}",
                printable(&error.code),
                error.class,
                printable(&error.message)
            );
        }
        for k in &p.keys {
            println!(
                "  {:<8} {:<48} {:<12} {:<8} ledger {}{}",
                k.change,
                printable(&k.key),
                printable(&k.provider),
                k.action,
                printable(&k.ledger),
                k.result_ref
                    .as_deref()
                    .map(|r| format!(" ({})", printable(r)))
                    .unwrap_or_default()
            );
        }
    }
    println!("dry run: nothing was replayed, stored or sent");
    Ok(())
}

fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}
