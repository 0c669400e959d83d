//! Input checks and small conversions shared by every backend.

use super::{
    AttemptDefaults, EffectChange, EffectClaimParams, EffectStatus, ErrorRecord, JobChange,
    MAX_PAYLOAD_BYTES, NewJob, NewSession, Result, StoreError, Write,
};
use sha2::{Digest, Sha256};
use std::time::Duration;

/// Longest delay or lease accepted (about 100 years), so `now + delay` can
/// never overflow a 64-bit millisecond timestamp.
const MAX_DURATION_MS: i64 = 100 * 365 * 24 * 3600 * 1000;

/// Rows per batch-insert statement. SQLite binds 8 variables a row, so 1,000
/// rows stay far below its 32,766; PostgreSQL binds 8 arrays whatever the
/// count, and the chunk only bounds one statement's size.
pub(crate) const INSERT_CHUNK: usize = 1000;

/// A job checked and normalised for insertion.
#[derive(Debug, Clone)]
pub(crate) struct Insertable {
    pub queue: String,
    pub plugin: String,
    pub payload: Vec<u8>,
    pub idempotency_key: Option<String>,
    pub priority: i32,
    pub delay_ms: i64,
    pub max_attempts: i64,
    pub correlation_id: String,
    pub group: Option<String>,
}

/// Validates a job and fills in the generated fields.
pub(crate) fn insertable(job: NewJob) -> Result<Insertable> {
    let refused = |what: &str, r: crate::boundary::Refused| {
        StoreError::Invalid(format!("{what}: {} {}", r.shown, r.why))
    };
    crate::boundary::name(&job.queue).map_err(|r| refused("queue name", r))?;
    crate::boundary::name(&job.plugin).map_err(|r| refused("plugin name", r))?;
    if job.payload.len() > MAX_PAYLOAD_BYTES {
        return Err(StoreError::Invalid(format!(
            "payload is {} bytes, at most {MAX_PAYLOAD_BYTES} allowed: store large data elsewhere and enqueue a reference",
            job.payload.len()
        )));
    }
    if job.max_attempts == 0 {
        return Err(StoreError::Invalid(
            "max_attempts must be at least 1".into(),
        ));
    }
    if let Some(key) = &job.idempotency_key {
        check_key(key)?;
    }
    if let Some(group) = &job.group {
        crate::boundary::group_key(group).map_err(|r| refused("group", r))?;
    }
    let correlation_id = match job.correlation_id {
        Some(id) => {
            crate::boundary::correlation_id(&id).map_err(|r| refused("correlation id", r))?;
            id
        }
        None => hex::encode(rand::random::<[u8; 16]>()),
    };
    Ok(Insertable {
        queue: job.queue,
        plugin: job.plugin,
        payload: job.payload,
        idempotency_key: job.idempotency_key,
        priority: job.priority,
        delay_ms: millis(job.delay),
        max_attempts: i64::from(job.max_attempts),
        correlation_id,
        group: job.group,
    })
}

/// A duration in milliseconds, capped at [`MAX_DURATION_MS`].
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).map_or(MAX_DURATION_MS, |ms| ms.min(MAX_DURATION_MS))
}

/// A SHA-256 digest as the `sessions` table keeps it: 64 lowercase hex
/// digits (`what` names it in the refusal).
pub(crate) fn check_digest(what: &str, digest: &str) -> Result<()> {
    if digest.len() == 64
        && digest
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "{what} must be a SHA-256 digest in 64 lowercase hex digits"
        )))
    }
}

/// Checks a schedule's name: the rule of queue and plugin names, so the key
/// `schedule:NAME:TICK` stays printable and bounded.
pub(crate) fn check_schedule_name(name: &str) -> Result<()> {
    crate::boundary::name(name)
        .map_err(|r| StoreError::Invalid(format!("schedule name: {} {}", r.shown, r.why)))
}

/// Checks a session before it is stored.
pub(crate) fn check_session(session: &NewSession) -> Result<()> {
    check_digest("a session's id digest", &session.id_digest)?;
    check_digest("a session's token fingerprint", &session.token_fingerprint)?;
    if session.ttl < Duration::from_secs(1) {
        return Err(StoreError::Invalid(
            "a session must live at least a second".into(),
        ));
    }
    Ok(())
}

/// The JSON stored for one error record (its `at_ms` is replaced by the
/// database clock when written), with the message bounded.
pub(crate) fn error_json(error: &ErrorRecord) -> Result<(String, String, String)> {
    let mut record = error.clone();
    // Codes reach the store from the host's catalog or through the
    // boundary's checks; one that did not is refused here, alone (it would
    // otherwise fail its whole batch on PostgreSQL).
    crate::boundary::error_code(&record.code)
        .map_err(|r| StoreError::Invalid(format!("error code {} {}", r.shown, r.why)))?;
    record.message = crate::boundary::message(&record.message);
    let json = serde_json::to_string(&record)
        .map_err(|e| StoreError::Invalid(format!("error record does not serialise: {e}")))?;
    Ok((json, record.code, record.message))
}

/// Whether a payload is already a redaction reference.
pub(crate) fn is_redacted(payload: &[u8]) -> bool {
    payload.starts_with(br#"{"redacted":true"#)
}

/// The reference that replaces a redacted payload.
pub(crate) fn redacted_payload(original: &[u8]) -> Vec<u8> {
    let digest = hex::encode(Sha256::digest(original));
    serde_json::json!({ "redacted": true, "sha256": digest })
        .to_string()
        .into_bytes()
}

/// Where a multi-row insert left each input: a new row, or the index of an
/// earlier input with the same (plugin, key).
pub(crate) enum Slot {
    /// First occurrence: part of the insert.
    Fresh,
    /// Same (plugin, key) as this earlier input.
    SameAs(usize),
}

/// Marks inputs that repeat an earlier input's (plugin, key).
pub(crate) fn batch_slots(jobs: &[Insertable]) -> Vec<Slot> {
    let mut first = std::collections::HashMap::new();
    jobs.iter()
        .enumerate()
        .map(|(i, job)| match &job.idempotency_key {
            Some(key) => match first.entry((job.plugin.as_str(), key.as_str())) {
                std::collections::hash_map::Entry::Occupied(e) => Slot::SameAs(*e.get()),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(i);
                    Slot::Fresh
                }
            },
            None => Slot::Fresh,
        })
        .collect()
}

/// Checks a stored key: a key as the SDK validates it, or one scoped by the
/// host, `PLUGIN/KEY` (a plugin name of at most 128 bytes, then a valid key).
pub(crate) fn check_key(key: &str) -> Result<()> {
    let invalid = |e: idem_sdk::key::InvalidKey| StoreError::Invalid(e.to_string());
    match idem_sdk::key::validate(key) {
        Ok(()) => Ok(()),
        Err(whole) => match key.split_once('/') {
            Some((plugin, rest)) if !plugin.is_empty() && plugin.len() <= 128 => {
                idem_sdk::key::validate(plugin).map_err(invalid)?;
                idem_sdk::key::validate(rest).map_err(invalid)
            }
            _ => Err(invalid(whole)),
        },
    }
}

/// Checks the caller's part of an effect claim.
pub(crate) fn check_effect_claim(params: &EffectClaimParams) -> Result<()> {
    check_key(&params.key)?;
    if let Some(older) = &params.older_key {
        check_key(&older.key)?;
    }
    if params.worker.is_empty() {
        return Err(StoreError::Invalid("worker id is empty".into()));
    }
    if params.fingerprint.is_empty() {
        return Err(StoreError::Invalid("effect fingerprint is empty".into()));
    }
    Ok(())
}

/// Only `Retrying` and `Failed` end a claim as a failure.
pub(crate) fn check_effect_failure(status: EffectStatus) -> Result<()> {
    match status {
        EffectStatus::Retrying | EffectStatus::Failed => Ok(()),
        other => Err(StoreError::Invalid(format!(
            "an effect fails as retrying or failed, not {}",
            other.as_str()
        ))),
    }
}

/// Checks a write before it joins a batch, so one invalid write is refused
/// on its own instead of failing the batch it would have joined.
pub(crate) fn check_write(write: &Write) -> Result<()> {
    match write {
        Write::Job { fence, change } => {
            check_worker(&fence.worker)?;
            match change {
                JobChange::Retry {
                    error: Some(error), ..
                }
                | JobChange::Dead { error, .. } => error_json(error).map(|_| ()),
                JobChange::SucceedWithChildren { children, .. } => {
                    for effect in children {
                        check_key(&effect.key)?;
                        if effect.fingerprint.is_empty() {
                            return Err(StoreError::Invalid("effect fingerprint is empty".into()));
                        }
                        if effect.child.idempotency_key.as_deref() != Some(effect.key.as_str()) {
                            return Err(StoreError::Invalid(format!(
                                "the child of effect {:?} must carry the effect's key",
                                effect.key
                            )));
                        }
                        insertable(effect.child.clone())?;
                    }
                    Ok(())
                }
                _ => Ok(()),
            }
        }
        Write::EffectClaim(params) => check_effect_claim(params),
        Write::Effect { fence, change } => {
            check_worker(&fence.worker)?;
            match change {
                EffectChange::Fail { status, .. } => check_effect_failure(*status),
                EffectChange::SucceedWithChild { child } => insertable(child.clone()).map(|_| ()),
                EffectChange::Succeed { .. } => Ok(()),
            }
        }
    }
}

/// Checks a claim's attempt defaults (every number at least 1) and returns
/// the plugins' numbers as the JSON object the claim statement reads.
pub(crate) fn attempt_defaults(defaults: &AttemptDefaults) -> Result<String> {
    if defaults.default == 0 || defaults.by_plugin.values().any(|&n| n == 0) {
        return Err(StoreError::Invalid(
            "max_attempts must be at least 1".into(),
        ));
    }
    serde_json::to_string(&defaults.by_plugin)
        .map_err(|e| StoreError::Invalid(format!("attempt defaults do not serialise: {e}")))
}

/// A lease owner must name someone.
pub(crate) fn check_worker(worker: &str) -> Result<()> {
    if worker.is_empty() {
        return Err(StoreError::Invalid("worker id is empty".into()));
    }
    Ok(())
}

/// The idempotency keys of stored plans (unreadable plans are skipped: they
/// name no effect that could have run).
pub(crate) fn plan_keys<'a>(plans: impl Iterator<Item = &'a String>) -> Vec<String> {
    #[derive(serde::Deserialize)]
    struct Keyed {
        idempotency_key: String,
    }
    plans
        .filter_map(|plan| serde_json::from_str::<Vec<Keyed>>(plan).ok())
        .flatten()
        .map(|effect| effect.idempotency_key)
        .collect()
}
