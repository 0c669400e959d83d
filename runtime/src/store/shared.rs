//! What both backends share: input checks, row decoding, small conversions.

use super::{
    EffectRecord, EffectStatus, ErrorRecord, Job, JobId, JobState, MAX_PAYLOAD_BYTES, NewJob,
    Result, StoreError,
};
use crate::failure::{Failure, truncate};
use sha2::{Digest, Sha256};
use sqlx::{ColumnIndex, Decode, Row, Type};
use std::time::Duration;

/// Longest delay or lease accepted (about 100 years), so `now + delay` can
/// never overflow a 64-bit millisecond timestamp.
const MAX_DURATION_MS: i64 = 100 * 365 * 24 * 3600 * 1000;

/// Rows per batch-insert statement. SQLite binds 8 variables a row, so 1,000
/// rows stay far below its 32,766; PostgreSQL binds 8 arrays whatever the
/// count, and the chunk only bounds one statement's size.
pub(crate) const INSERT_CHUNK: usize = 1000;

/// A job checked and normalised for insertion.
pub(crate) struct Insertable {
    pub queue: String,
    pub plugin: String,
    pub payload: Vec<u8>,
    pub idempotency_key: Option<String>,
    pub priority: i32,
    pub delay_ms: i64,
    pub max_attempts: i64,
    pub correlation_id: String,
}

/// Validates a job and fills in the generated fields.
pub(crate) fn insertable(job: NewJob) -> Result<Insertable> {
    if job.queue.is_empty() {
        return Err(StoreError::Invalid("queue name is empty".into()));
    }
    if job.plugin.is_empty() {
        return Err(StoreError::Invalid("plugin name is empty".into()));
    }
    if job.payload.len() > MAX_PAYLOAD_BYTES {
        return Err(StoreError::Invalid(format!(
            "payload is {} bytes, at most {MAX_PAYLOAD_BYTES} allowed: store large data elsewhere and enqueue a reference",
            job.payload.len()
        )));
    }
    if job.queue.len() > 128 || job.plugin.len() > 128 {
        return Err(StoreError::Invalid(
            "queue and plugin names are at most 128 bytes".into(),
        ));
    }
    if job.max_attempts == 0 {
        return Err(StoreError::Invalid(
            "max_attempts must be at least 1".into(),
        ));
    }
    if let Some(key) = &job.idempotency_key {
        idem_sdk::key::validate(key).map_err(|e| StoreError::Invalid(e.to_string()))?;
    }
    let correlation_id = match job.correlation_id {
        Some(id) if id.is_empty() => {
            return Err(StoreError::Invalid("correlation id is empty".into()));
        }
        Some(id) => id,
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
    })
}

/// A duration in milliseconds, capped at [`MAX_DURATION_MS`].
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).map_or(MAX_DURATION_MS, |ms| ms.min(MAX_DURATION_MS))
}

/// The JSON stored for one error record (its `at_ms` is replaced by the
/// database clock when written), with the message bounded.
pub(crate) fn error_json(error: &ErrorRecord) -> Result<(String, String, String)> {
    let mut record = error.clone();
    record.message = truncate(record.message, Failure::MAX_MESSAGE);
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

fn get<'r, R, T>(row: &'r R, column: &'static str) -> Result<T>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    T: Decode<'r, R::Database> + Type<R::Database>,
{
    row.try_get(column)
        .map_err(|e| StoreError::Corrupt(format!("column {column}: {e}")))
}

fn count<'r, R>(row: &'r R, column: &'static str) -> Result<u32>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let value: i64 = get(row, column)?;
    u32::try_from(value)
        .map_err(|_| StoreError::Corrupt(format!("{column} = {value} is out of range")))
}

/// Decodes a job row (columns named as in the schema, `errors` as text).
pub(crate) fn job_from_row<'r, R>(row: &'r R) -> Result<Job>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    i32: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    let id = JobId(get(row, "id")?);
    let state: String = get(row, "state")?;
    let state = JobState::parse(&state)
        .ok_or_else(|| StoreError::Corrupt(format!("job {id}: unknown state {state:?}")))?;
    let errors: String = get(row, "errors")?;
    let errors: Vec<ErrorRecord> = serde_json::from_str(&errors)
        .map_err(|e| StoreError::Corrupt(format!("job {id}: error history: {e}")))?;
    Ok(Job {
        id,
        queue: get(row, "queue")?,
        plugin: get(row, "plugin")?,
        payload: get(row, "payload")?,
        idempotency_key: get(row, "idempotency_key")?,
        priority: get(row, "priority")?,
        run_at_ms: get(row, "run_at")?,
        state,
        attempt: count(row, "attempt")?,
        max_attempts: count(row, "max_attempts")?,
        lease_owner: get(row, "lease_owner")?,
        lease_until_ms: get(row, "lease_until")?,
        heartbeat_at_ms: get(row, "heartbeat_at")?,
        last_error_code: get(row, "last_error_code")?,
        last_error_message: get(row, "last_error_message")?,
        errors,
        correlation_id: get(row, "correlation_id")?,
        plugin_hash: get(row, "plugin_hash")?,
        plan: get(row, "plan")?,
        plan_hash: get(row, "plan_hash")?,
        rescues: count(row, "rescues")?,
        created_at_ms: get(row, "created_at")?,
        updated_at_ms: get(row, "updated_at")?,
        finished_at_ms: get(row, "finished_at")?,
        first_failed_at_ms: get(row, "first_failed_at")?,
        last_failed_at_ms: get(row, "last_failed_at")?,
    })
}

/// Decodes an effect ledger row.
pub(crate) fn effect_from_row<'r, R>(row: &'r R) -> Result<EffectRecord>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
{
    let key: String = get(row, "key")?;
    let status: String = get(row, "status")?;
    let status = EffectStatus::parse(&status)
        .ok_or_else(|| StoreError::Corrupt(format!("effect {key:?}: unknown status {status:?}")))?;
    Ok(EffectRecord {
        job_id: JobId(get(row, "job_id")?),
        plugin: get(row, "plugin")?,
        provider: get(row, "provider")?,
        fingerprint: get(row, "fingerprint")?,
        status,
        attempt: count(row, "attempt")?,
        lease_owner: get(row, "lease_owner")?,
        lease_until_ms: get(row, "lease_until")?,
        result_ref: get(row, "result_ref")?,
        last_error_code: get(row, "last_error_code")?,
        last_error_at_ms: get(row, "last_error_at")?,
        created_at_ms: get(row, "created_at")?,
        updated_at_ms: get(row, "updated_at")?,
        key,
    })
}

/// Decodes a state name read by a count query.
pub(crate) fn parse_state(text: &str) -> Result<JobState> {
    JobState::parse(text).ok_or_else(|| StoreError::Corrupt(format!("unknown job state {text:?}")))
}

/// Wakes in-process waiters of [`super::Store::wait_for_jobs`]: everyone
/// waiting now, plus one permit for a waiter that is just about to wait (so a
/// job inserted between its empty claim and its wait is not missed).
pub(crate) fn wake(notify: &tokio::sync::Notify) {
    notify.notify_waiters();
    notify.notify_one();
}

/// Waits for a wake-up or the timeout.
pub(crate) async fn wait(notify: &tokio::sync::Notify, timeout: Duration) {
    let _ = tokio::time::timeout(timeout, notify.notified()).await;
}

/// Checks the caller's part of an effect claim.
pub(crate) fn check_effect_claim(params: &super::EffectClaimParams) -> Result<()> {
    idem_sdk::key::validate(&params.key).map_err(|e| StoreError::Invalid(e.to_string()))?;
    if params.worker.is_empty() {
        return Err(StoreError::Invalid("worker id is empty".into()));
    }
    if params.fingerprint.is_empty() {
        return Err(StoreError::Invalid("effect fingerprint is empty".into()));
    }
    Ok(())
}

/// Only `Retrying` and `Failed` end a claim as a failure.
pub(crate) fn check_effect_failure(params: &super::EffectFailParams) -> Result<()> {
    match params.status {
        EffectStatus::Retrying | EffectStatus::Failed => Ok(()),
        other => Err(StoreError::Invalid(format!(
            "an effect fails as retrying or failed, not {}",
            other.as_str()
        ))),
    }
}

/// What a ledger row that could not be claimed means for the claimer; `None`
/// when it has become claimable since (try again). The row holds
/// `fingerprint`, `status`, `lease_until`, `result_ref` and the database's
/// `now`.
pub(crate) fn effect_outcome<'r, R>(
    row: &'r R,
    fingerprint: &str,
) -> Result<Option<super::EffectClaim>>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
{
    use super::EffectClaim;
    let existing: String = get(row, "fingerprint")?;
    if existing != fingerprint {
        return Ok(Some(EffectClaim::Conflict {
            existing_fingerprint: existing,
        }));
    }
    let status: String = get(row, "status")?;
    let status = EffectStatus::parse(&status)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown effect status {status:?}")))?;
    let lease_until: Option<i64> = get(row, "lease_until")?;
    let now: i64 = get(row, "now")?;
    Ok(match (status, lease_until) {
        (EffectStatus::Succeeded, _) => Some(EffectClaim::AlreadySucceeded {
            result_ref: get(row, "result_ref")?,
        }),
        (EffectStatus::Failed, _) => {
            let code: Option<String> = get(row, "last_error_code")?;
            Some(EffectClaim::Failed {
                code: code.unwrap_or_else(|| "effect_failed".into()),
            })
        }
        (EffectStatus::Processing, Some(until)) if until >= now => {
            Some(EffectClaim::LeasedByOther {
                lease_until_ms: until,
            })
        }
        _ => None,
    })
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
