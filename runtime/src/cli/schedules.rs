//! `idem schedules list`: each schedule with its next run and its last tick,
//! job and outcome, from the configuration and the store.

use super::{CliError, printable};
use crate::config::Config;

/// `idem schedules ...`
#[derive(Debug, clap::Subcommand)]
pub enum SchedulesCommand {
    /// Each `[[schedules]]` (and any the store knows that the configuration
    /// no longer has): cron, time zone, next run, last tick, last job and
    /// its state. Times are UTC, by the store's clock.
    List {
        /// One JSON object per schedule, one per line, instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Runs an `idem schedules` command.
///
/// `schedules::run(&config, SchedulesCommand::List { json: false }).await?;`
pub async fn run(config: &Config, command: SchedulesCommand) -> Result<(), CliError> {
    match command {
        SchedulesCommand::List { json } => list(config, json).await,
    }
}

async fn list(config: &Config, json: bool) -> Result<(), CliError> {
    let store = super::queue::store(config).await?;
    let views = crate::ops::view::schedules(&*store, &config.schedules)
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    if views.is_empty() {
        eprintln!("no [[schedules]] in the configuration, none in the store");
    }
    if json {
        for view in &views {
            println!("{}", serde_json::to_value(view).unwrap_or_default());
        }
        return Ok(());
    }
    if !views.is_empty() {
        println!(
            "{:<24} {:<18} {:<16} {:<21} {:<21} {:>8} STATE",
            "NAME", "CRON", "TIMEZONE", "NEXT RUN", "LAST TICK", "LAST JOB"
        );
    }
    let dash = || "-".to_string();
    for view in views {
        let cron = match &view.cron {
            Some(cron) => cron.clone(),
            None => "(not configured)".into(),
        };
        println!(
            "{:<24} {:<18} {:<16} {:<21} {:<21} {:>8} {}",
            printable(&view.name),
            cron,
            view.timezone.clone().unwrap_or_else(dash),
            view.next_run.unwrap_or_else(dash),
            view.last_tick.unwrap_or_else(dash),
            view.last_job_id
                .map(|id| id.0.to_string())
                .unwrap_or_else(dash),
            view.last_outcome.unwrap_or("-"),
        );
    }
    Ok(())
}
