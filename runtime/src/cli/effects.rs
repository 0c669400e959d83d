//! `idem effects show|resolve|reconcile`: look at one ledger row, say what
//! happened to an effect whose outcome idem cannot know, or have idem ask
//! the providers that offer a lookup.

use super::CliError;
use super::queue::store;
use crate::config::Config;
use crate::store::{EffectRecord, Resolution};
use serde_json::json;

/// `idem effects ...`
#[derive(Debug, clap::Subcommand)]
pub enum EffectsCommand {
    /// Show one ledger row (by idempotency key) as JSON.
    Show {
        /// The effect's idempotency key.
        key: String,
    },
    /// Say what happened to an effect in doubt (it may have reached a
    /// provider that cannot dedupe, or its dedupe window passed), so the
    /// jobs that carry it can be replayed.
    Resolve {
        /// The effect's idempotency key.
        key: String,
        /// The provider carried it out: a replay skips it.
        #[arg(
            long,
            conflicts_with = "not_applied",
            required_unless_present = "not_applied"
        )]
        applied: bool,
        /// The provider's reference (message id ...), with `--applied`.
        #[arg(long, requires = "applied")]
        result_ref: Option<String>,
        /// The provider did not carry it out: a replay sends it again.
        #[arg(long)]
        not_applied: bool,
    },
    /// Ask the providers that offer a lookup about every key in doubt,
    /// settle each one they answer, and replay the dead jobs those keys
    /// held back (what the periodic sweep of `idem run` does), once.
    Reconcile {
        /// Only keys and dead jobs of this plugin.
        #[arg(long)]
        plugin: Option<String>,
        /// Ask, and print what would be settled and replayed, writing nothing.
        #[arg(long)]
        dry_run: bool,
        /// Most keys asked about (and dead jobs looked at per code).
        #[arg(long, default_value_t = crate::queue::reconcile::SWEEP_BATCH)]
        limit: u32,
        /// Dead jobs replayed per second, at most (e.g. `10/s`, `600/m`).
        #[arg(long, default_value = "10/s")]
        rate: String,
    },
}

/// Runs an effects command.
pub async fn run(config: &Config, command: EffectsCommand) -> Result<(), CliError> {
    let store = store(config).await?;
    match command {
        EffectsCommand::Reconcile {
            plugin,
            dry_run,
            limit,
            rate,
        } => {
            let providers =
                crate::providers::Providers::for_store(&config.providers, &config.database_url)
                    .map_err(|e| CliError::Usage(e.to_string()))?;
            if !providers
                .iter()
                .any(|p| p.provider.lookup_policy().is_some())
            {
                return Err(CliError::Usage(
                    "no configured provider offers a lookup (`lookup = { ... }` in \
                     [providers.NAME]): keys in doubt wait for `idem effects resolve`"
                        .into(),
                ));
            }
            let pacer = crate::ops::replay::parse_rate(&rate)
                .and_then(crate::ops::replay::Pacer::per_second)
                .map_err(CliError::Usage)?;
            let request = crate::queue::reconcile::ReconcileRequest {
                plugin,
                dry_run,
                limit,
            };
            let report =
                crate::queue::reconcile::reconcile_once(&*store, &providers, &request, &pacer)
                    .await
                    .map_err(|e| CliError::Runtime(e.into()))?;
            println!(
                "{}",
                serde_json::to_string_pretty(&report).unwrap_or_default()
            );
            eprintln!(
                "{} key(s) asked, {} settled{}, {} dead job(s) replayed{}, {} left dead",
                report.asked.len(),
                report.settled(),
                if dry_run {
                    " (dry run: none written)"
                } else {
                    ""
                },
                report.replayed.len(),
                if dry_run { " (would be)" } else { "" },
                report.left_dead.len()
            );
            Ok(())
        }
        EffectsCommand::Show { key } => {
            let row = store
                .effect_get(&key)
                .await
                .map_err(|e| CliError::Runtime(e.into()))?
                .ok_or_else(|| no_such_key(&key))?;
            println!(
                "{}",
                serde_json::to_string_pretty(&effect_json(&row)).unwrap_or_default()
            );
            if row.in_doubt {
                eprintln!(
                    "effect {key:?} is in doubt: check with provider {:?}, then run \
                     `idem effects resolve {key} --applied` or `--not-applied`",
                    row.provider
                );
            }
            Ok(())
        }
        EffectsCommand::Resolve {
            key,
            applied,
            result_ref,
            not_applied: _,
        } => {
            let resolution = if applied {
                Resolution::Applied { result_ref }
            } else {
                Resolution::NotApplied
            };
            let resolved = store
                .effect_resolve(&key, resolution)
                .await
                .map_err(|e| CliError::Runtime(e.into()))?;
            if !resolved {
                let known = store
                    .effect_get(&key)
                    .await
                    .map_err(|e| CliError::Runtime(e.into()))?;
                if known.is_none() {
                    return Err(no_such_key(&key));
                }
                return Err(CliError::Failed(format!(
                    "effect {key:?} is not in doubt (see `idem effects show {key}`); nothing to resolve"
                )));
            }
            println!("{}", json!({"resolved": key, "applied": applied}));
            eprintln!("resolved; replay its job with `idem dlq replay JOB_ID`");
            Ok(())
        }
    }
}

/// A ledger row as JSON.
pub fn effect_json(row: &EffectRecord) -> serde_json::Value {
    json!({
        "key": row.key,
        "job_id": row.job_id,
        "plugin": row.plugin,
        "provider": row.provider,
        "status": row.status.as_str(),
        "attempt": row.attempt,
        "reached": row.reached,
        "in_doubt": row.in_doubt,
        "first_sent_at_ms": row.first_sent_at_ms,
        "result_ref": row.result_ref,
        "last_error_code": row.last_error_code,
        "lease_owner": row.lease_owner,
        "lease_until_ms": row.lease_until_ms,
        "fingerprint": row.fingerprint,
    })
}

/// An unknown key; keys are stored under their plugin (`PLUGIN/KEY`), which
/// a user typing the plugin's own key easily forgets.
fn no_such_key(key: &str) -> CliError {
    let hint = if key.contains('/') {
        ""
    } else {
        " (keys are stored under their plugin: PLUGIN/KEY, e.g. send_invoice_email/invoice:42:email:v1)"
    };
    CliError::Failed(format!("no effect with key {key:?}{hint}"))
}
