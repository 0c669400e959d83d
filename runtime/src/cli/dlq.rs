//! `idem dlq list|show|replay`: the dead-letter queue is a quarantine, not a bin.

use super::CliError;
use super::queue::store;
use crate::config::Config;
use crate::store::{Job, JobFilter, JobId, JobState};
use serde_json::json;
use std::time::Duration;

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
    },
}

/// Runs a DLQ command.
pub async fn run(config: &Config, command: DlqCommand) -> Result<(), CliError> {
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
        } => {
            replay(
                config,
                ReplayFilter {
                    ids,
                    plugin,
                    code,
                    all,
                },
                &rate,
                discard_plan,
            )
            .await
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
            job.plugin,
            job.last_error_code.as_deref().unwrap_or("-"),
            format!("{}/{}", job.attempt, job.max_attempts),
            job.idempotency_key.as_deref().unwrap_or("-"),
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

/// Parses `10/s`, `600/m` or a bare number (per second).
pub fn parse_rate(text: &str) -> Result<f64, String> {
    let (n, per) = text.split_once('/').unwrap_or((text, "s"));
    let n: f64 = n
        .trim()
        .parse()
        .map_err(|_| format!("bad rate {text:?}: expected e.g. 10/s"))?;
    let seconds = match per.trim() {
        "s" | "sec" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => return Err(format!("bad rate unit {other:?}: use /s, /m or /h")),
    };
    if n <= 0.0 || !n.is_finite() {
        return Err(format!("bad rate {text:?}: must be above zero"));
    }
    Ok(n / seconds)
}

/// Which dead jobs to replay.
struct ReplayFilter {
    ids: Vec<i64>,
    plugin: Option<String>,
    code: Option<String>,
    all: bool,
}

async fn replay(
    config: &Config,
    filter: ReplayFilter,
    rate: &str,
    discard_plan: bool,
) -> Result<(), CliError> {
    let ReplayFilter {
        ids,
        plugin,
        code,
        all,
    } = filter;
    let per_second = parse_rate(rate).map_err(CliError::Usage)?;
    if ids.is_empty() && plugin.is_none() && code.is_none() && !all {
        return Err(CliError::Usage(
            "say what to replay: job ids, --plugin P, --code C or --all".into(),
        ));
    }
    let store = store(config).await?;
    let dead = store
        .job_list(dead_jobs(plugin, code, ids, 0))
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    let gap = Duration::from_secs_f64(1.0 / per_second);
    let mut replayed = 0u64;
    let mut refused: Vec<crate::store::JobId> = Vec::new();
    for (i, job) in dead.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(gap).await;
        }
        let redacted = crate::store::is_redacted_payload(&job.payload);
        if redacted && (job.plan.is_none() || discard_plan) {
            // Its plugin would be handed the redaction reference, not the payload.
            eprintln!(
                "job {}: skipped, its payload was redacted and it has no plan to replay; enqueue it again from the source",
                job.id
            );
            continue;
        }
        if discard_plan && job.plan.is_some() {
            let discarded = store
                .job_discard_plan(job.id)
                .await
                .map_err(|e| CliError::Runtime(e.into()))?;
            if !discarded {
                // Replaying the old plan is not what was asked for.
                refused.push(job.id);
                eprintln!(
                    "job {}: refused, its plan cannot be discarded (an effect of it may already have reached its provider); replay it without --discard-plan to carry out the same plan",
                    job.id
                );
                continue;
            }
        }
        let report = store
            .job_replay(&[job.id])
            .await
            .map_err(|e| CliError::Runtime(e.into()))?;
        for (id, key) in &report.refused {
            refused.push(*id);
            eprintln!(
                "job {id}: refused, effect {key:?} may have happened and idem will not send it again; check with the provider, then `idem effects resolve {key} --applied` or `--not-applied`"
            );
        }
        for id in &report.replayed {
            replayed += 1;
            eprintln!(
                "replayed job {id} ({}, {})",
                job.plugin,
                job.last_error_code.as_deref().unwrap_or("-")
            );
        }
    }
    println!("{}", json!({"replayed": replayed, "refused": refused}));
    if refused.is_empty() {
        Ok(())
    } else {
        Err(CliError::Failed(format!(
            "{} job(s) refused (see above); {replayed} replayed",
            refused.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rates_parse() {
        assert_eq!(super::parse_rate("10/s").unwrap(), 10.0);
        assert_eq!(super::parse_rate("60/m").unwrap(), 1.0);
        assert!(super::parse_rate("0/s").is_err());
        assert!(super::parse_rate("ten").is_err());
    }
}
