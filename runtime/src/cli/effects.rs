//! `idem effects show|resolve`: look at one ledger row, and say what
//! happened to an effect whose outcome idem cannot know.

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
}

/// Runs an effects command.
pub async fn run(config: &Config, command: EffectsCommand) -> Result<(), CliError> {
    let store = store(config).await?;
    match command {
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
