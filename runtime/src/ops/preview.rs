//! Replay preview: the *current* plugin runs on each dead job's payload in
//! the sandbox, and its plan is shown next to the stored one, key by key,
//! with what the ledger says already happened. Nothing is stored, claimed
//! or sent: the safe way to check a fix before replaying thousands of jobs.
//!
//! Served over HTTP, previews share the process with a worker: a
//! [`PreviewGate`] paces them (like replays) and lets at most
//! [`PREVIEW_SLOTS`] run a plugin at once, and `idem run --listen` sizes the
//! sandbox pool that many instances above the worker's, so a token holder
//! asking for previews never takes an instance a job needs.

use super::OpsError;
use super::replay::Pacer;
use crate::effects::{Effect, fingerprint, scope_plan};
use crate::plugins::PluginRegistry;
use crate::sandbox::{JobInput, RunError};
use crate::store::{Job, Store};
use serde::Serialize;
use std::collections::BTreeMap;

/// One key of either plan.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct KeyDiff {
    /// The (scoped) idempotency key.
    pub key: String,
    /// Provider.
    pub provider: String,
    /// Action kind (`email`, `http`, `enqueue`, `custom`).
    pub action: &'static str,
    /// `same` (in both plans, same request), `changed` (same key, a
    /// different request: the ledger would refuse it as a conflict once the
    /// old one ran), `new` (only in the new plan), `dropped` (only in the
    /// stored plan).
    pub change: &'static str,
    /// The ledger's status of the key (`not_started` when it has none).
    pub ledger: String,
    /// The provider's reference, when the effect happened.
    pub result_ref: Option<String>,
}

/// The preview of one dead job.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct JobPreview {
    /// The job.
    pub id: i64,
    /// Its plugin.
    pub plugin: String,
    /// The code it died with.
    pub code: Option<String>,
    /// The plugin version that made the stored plan.
    pub stored_plugin_hash: Option<String>,
    /// The plugin version loaded now.
    pub current_plugin_hash: Option<String>,
    /// Whether the job has a stored plan (a plain replay carries it out).
    pub has_stored_plan: bool,
    /// The current plugin's failure on this payload, if it fails.
    pub error: Option<PreviewError>,
    /// Every key of either plan.
    pub keys: Vec<KeyDiff>,
    /// Keys that already happened (the ledger says succeeded).
    pub already_done: usize,
    /// One line for people.
    pub verdict: String,
}

/// A failure of the current plugin on the payload.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PreviewError {
    /// Code.
    pub code: String,
    /// Class.
    pub class: &'static str,
    /// Message.
    pub message: String,
}

/// Plugin runs of previews at once in one process, and the sandbox
/// instances kept for them beside a worker's.
pub const PREVIEW_SLOTS: u32 = 2;

/// Paces the previews of every HTTP request of a process and bounds how
/// many run a plugin at once: one job per turn of the pacer, and a run
/// holds one of [`PREVIEW_SLOTS`] slots.
///
/// ```
/// let gate = idem::ops::preview::PreviewGate::per_second(10.0).unwrap();
/// ```
#[derive(Debug)]
pub struct PreviewGate {
    pacer: Pacer,
    slots: tokio::sync::Semaphore,
}

impl PreviewGate {
    /// A gate for `per_second` previewed jobs a second (1/h to 10,000/s).
    pub fn per_second(per_second: f64) -> Result<Self, String> {
        Ok(PreviewGate {
            pacer: Pacer::per_second(per_second)?,
            slots: tokio::sync::Semaphore::new(PREVIEW_SLOTS as usize),
        })
    }

    /// Waits for this job's turn.
    async fn turn(&self) {
        self.pacer.wait().await;
    }

    /// Waits for a free slot; the run holds it until the permit drops.
    async fn slot(&self) -> Result<tokio::sync::SemaphorePermit<'_>, OpsError> {
        self.slots
            .acquire()
            .await
            .map_err(|_| OpsError::Plugin("the preview slots are closed".into()))
    }
}

/// Previews these dead jobs (any state is accepted; dead is the point),
/// paced and bounded by `gate` when one is given (the HTTP surface); the
/// command line passes none: its sandbox is its own.
pub async fn preview_jobs(
    store: &dyn Store,
    registry: &PluginRegistry,
    jobs: &[Job],
    gate: Option<&PreviewGate>,
) -> Result<Vec<JobPreview>, OpsError> {
    let mut out = Vec::with_capacity(jobs.len());
    for job in jobs {
        if let Some(gate) = gate {
            gate.turn().await;
        }
        out.push(preview_one(store, registry, job, gate).await?);
    }
    Ok(out)
}

async fn preview_one(
    store: &dyn Store,
    registry: &PluginRegistry,
    job: &Job,
    gate: Option<&PreviewGate>,
) -> Result<JobPreview, OpsError> {
    let stored: Vec<Effect> = job
        .plan
        .as_deref()
        .and_then(|p| serde_json::from_str(p).ok())
        .unwrap_or_default();
    let mut preview = JobPreview {
        id: job.id.0,
        plugin: job.plugin.clone(),
        code: job.last_error_code.clone(),
        stored_plugin_hash: job.plugin_hash.clone(),
        current_plugin_hash: None,
        has_stored_plan: job.plan.is_some(),
        error: None,
        keys: Vec::new(),
        already_done: 0,
        verdict: String::new(),
    };
    let fresh = match registry.get(&job.plugin) {
        None => {
            preview.error = Some(PreviewError {
                code: "plugin_not_found".into(),
                class: "retryable",
                message: format!("no plugin {:?} is loaded", job.plugin),
            });
            None
        }
        Some(plugin) => {
            preview.current_plugin_hash = Some(plugin.hash().to_string());
            let input = JobInput {
                id: job.id.0,
                queue: job.queue.clone(),
                payload: job.payload.clone(),
                attempt: 1,
                max_attempts: job.attempts_allowed(),
                idempotency_key: job.idempotency_key.clone(),
                correlation_id: job.correlation_id.clone(),
                enqueued_at_ms: job.created_at_ms,
            };
            let slot = match gate {
                Some(gate) => Some(gate.slot().await?),
                None => None,
            };
            let ran = registry.sandbox().call(&plugin.compiled, &input).await;
            drop(slot);
            match ran {
                Ok(plan) => match plugin.grants.refusals(&plan).first() {
                    Some(refusal) => {
                        preview.error = Some(PreviewError {
                            code: "effect_not_allowed".into(),
                            class: "permanent",
                            message: refusal.to_string(),
                        });
                        None
                    }
                    None => Some(scope_plan(&job.plugin, plan)),
                },
                Err(RunError::Plugin(failure)) => {
                    preview.error = Some(PreviewError {
                        code: failure.code.clone(),
                        class: failure.class.as_str(),
                        message: failure.message.clone(),
                    });
                    None
                }
                Err(RunError::Unavailable(why)) => return Err(OpsError::Plugin(why)),
            }
        }
    };
    let new_plan = fresh.unwrap_or_default();
    if preview.error.is_none()
        && let Some(bad) = new_plan
            .iter()
            .find(|e| crate::store::check_key(&e.idempotency_key).is_err())
    {
        preview.error = Some(PreviewError {
            code: "invalid_idempotency_key".into(),
            class: "permanent",
            message: format!("the key {:?} is not usable", bad.idempotency_key),
        });
    }
    // Plans stored before keys were scoped hold the plugin's bare keys; they
    // ran under those, and a new plan's `PLUGIN/KEY` is the same operation.
    let scoped = |key: &str| {
        if key.starts_with(&format!("{}/", job.plugin)) {
            key.to_string()
        } else {
            crate::effects::scoped_key(&job.plugin, key)
        }
    };
    let mut keys: BTreeMap<String, KeyDiff> = BTreeMap::new();
    let old: BTreeMap<String, &Effect> = stored
        .iter()
        .map(|e| (scoped(&e.idempotency_key), e))
        .collect();
    for effect in &new_plan {
        let (change, ran_as) = match old.get(&effect.idempotency_key) {
            Some(before) if fingerprint(before) == fingerprint(effect) => {
                ("same", before.idempotency_key.clone())
            }
            Some(before) => ("changed", before.idempotency_key.clone()),
            None => ("new", effect.idempotency_key.clone()),
        };
        let mut entry = diff(effect, change);
        entry.key = ran_as;
        keys.insert(effect.idempotency_key.clone(), entry);
    }
    for (matching, effect) in &old {
        keys.entry(matching.clone())
            .or_insert_with(|| diff(effect, "dropped"));
    }
    let mut in_doubt = Vec::new();
    for entry in keys.values_mut() {
        let mut record = store.effect_get(&entry.key).await?;
        if record.is_none()
            && let Some(bare) = entry.key.strip_prefix(&format!("{}/", job.plugin))
        {
            // As the executor does: a key an older release carried out bare.
            record = store
                .effect_get(bare)
                .await?
                .filter(|r| r.plugin == job.plugin);
        }
        if let Some(record) = record {
            entry.ledger = record.status.as_str().to_string();
            entry.result_ref = record.result_ref.clone();
            if record.in_doubt {
                entry.ledger.push_str(" (in doubt)");
                in_doubt.push(record.key.clone());
            }
        }
    }
    preview.already_done = keys.values().filter(|k| k.ledger == "succeeded").count();
    preview.keys = keys.into_values().collect();
    preview.verdict = if crate::store::is_redacted_payload(&job.payload) && job.plan.is_none() {
        "its payload was redacted and it has no plan: a replay skips it; enqueue it again from the source".into()
    } else if let Some(key) = in_doubt.first() {
        format!(
            "a replay is refused until {key:?} is resolved: it may have happened and idem will not send it again (`idem effects resolve {key} --applied` or `--not-applied`)"
        )
    } else {
        verdict(&preview)
    };
    Ok(preview)
}

fn diff(effect: &Effect, change: &'static str) -> KeyDiff {
    KeyDiff {
        key: effect.idempotency_key.clone(),
        provider: effect.provider.clone(),
        action: effect.action.kind(),
        change,
        ledger: "not_started".into(),
        result_ref: None,
    }
}

fn verdict(p: &JobPreview) -> String {
    if let Some(error) = &p.error {
        return format!(
            "the current plugin still fails on this payload ({}): a replay would fail again",
            error.code
        );
    }
    let count = |c: &str| p.keys.iter().filter(|k| k.change == c).count();
    let (same, changed, new, dropped) = (
        count("same"),
        count("changed"),
        count("new"),
        count("dropped"),
    );
    if !p.has_stored_plan {
        return format!(
            "no stored plan: a replay runs the current plugin, which plans {new} effect(s)"
        );
    }
    if changed > 0 {
        return format!(
            "{changed} key(s) now carry a different request: a replay keeps the stored plan; \
             discarding it would meet idempotency_key_conflict for any key already used"
        );
    }
    if new == 0 && dropped == 0 {
        return format!(
            "the same {same} key(s) and requests as the stored plan ({} already done): a replay is safe",
            p.already_done
        );
    }
    format!(
        "{same} key(s) unchanged, {new} new, {dropped} dropped: a plain replay carries out the \
         stored plan; `--discard-plan` would carry out the new one"
    )
}

#[cfg(test)]
mod tests {
    use super::{PREVIEW_SLOTS, PreviewGate};

    #[tokio::test(start_paused = true)]
    async fn a_gate_paces_every_job() {
        let gate = PreviewGate::per_second(10.0).unwrap();
        let start = tokio::time::Instant::now();
        for _ in 0..20 {
            gate.turn().await;
        }
        // The first turn is at once, the 20th 19 gaps of 100 ms later.
        assert_eq!(start.elapsed().as_millis(), 1900);
    }

    #[tokio::test(start_paused = true)]
    async fn a_gate_lets_two_runs_at_once() {
        let gate = PreviewGate::per_second(10_000.0).unwrap();
        let held: Vec<_> = futures::future::join_all((0..PREVIEW_SLOTS).map(|_| gate.slot()))
            .await
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap();
        let third = tokio::time::timeout(std::time::Duration::from_secs(3600), gate.slot()).await;
        assert!(third.is_err(), "a third run waits while two hold a slot");
        drop(held);
        let third = tokio::time::timeout(std::time::Duration::from_secs(1), gate.slot()).await;
        assert!(third.is_ok(), "a slot freed is taken");
    }
}
