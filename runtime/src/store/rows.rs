//! Decoding rows, the same for every backend.

use super::{
    EffectClaim, EffectRecord, EffectStatus, ErrorRecord, Job, JobId, JobState, Result,
    ScheduleState, Session, StoreError,
};
use crate::failure::Code;
use sqlx::{ColumnIndex, Decode, Row, Type};
use std::time::Duration;

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

fn optional_count<'r, R>(row: &'r R, column: &'static str) -> Result<Option<u32>>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let value: Option<i64> = get(row, column)?;
    value
        .map(|value| {
            u32::try_from(value)
                .map_err(|_| StoreError::Corrupt(format!("{column} = {value} is out of range")))
        })
        .transpose()
}

fn flag<'r, R>(row: &'r R, column: &'static str) -> Result<bool>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let value: i64 = get(row, column)?;
    Ok(value != 0)
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
        max_attempts: optional_count(row, "max_attempts")?,
        lease_owner: get(row, "lease_owner")?,
        lease_until_ms: get(row, "lease_until")?,
        heartbeat_at_ms: get(row, "heartbeat_at")?,
        last_error_code: get(row, "last_error_code")?,
        last_error_message: get(row, "last_error_message")?,
        errors,
        correlation_id: get(row, "correlation_id")?,
        group: get(row, "group_key")?,
        plugin_hash: get(row, "plugin_hash")?,
        plan: get(row, "plan")?,
        plan_hash: get(row, "plan_hash")?,
        rescues: count(row, "rescues")?,
        started: count(row, "started")? != 0,
        unstarted_rescues: count(row, "unstarted_rescues")?,
        created_at_ms: get(row, "created_at")?,
        updated_at_ms: get(row, "updated_at")?,
        finished_at_ms: get(row, "finished_at")?,
        first_failed_at_ms: get(row, "first_failed_at")?,
        last_failed_at_ms: get(row, "last_failed_at")?,
        deferred_since_ms: get(row, "deferred_since")?,
        interruptions: count(row, "interruptions")?,
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
        reached: flag(row, "reached")?,
        in_doubt: flag(row, "in_doubt")?,
        first_sent_at_ms: get(row, "first_sent_at")?,
        key,
    })
}

/// Decodes a state name read by a count query.
/// A `sessions` row.
pub(crate) fn session_from_row<'r, R>(row: &'r R) -> Result<Session>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(Session {
        id_digest: get(row, "id_digest")?,
        token_fingerprint: get(row, "token_fingerprint")?,
        created_at: get(row, "created_at")?,
        expires_at: get(row, "expires_at")?,
        revoked_at: get(row, "revoked_at")?,
    })
}

pub(crate) fn schedule_from_row<'r, R>(row: &'r R) -> Result<ScheduleState>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Option<String>: Decode<'r, R::Database> + Type<R::Database>,
{
    let state: Option<String> = get(row, "last_job_state")?;
    Ok(ScheduleState {
        name: get(row, "name")?,
        last_tick_ms: get(row, "last_tick_ms")?,
        last_job_id: get::<R, Option<i64>>(row, "last_job_id")?.map(JobId),
        last_job_state: state.as_deref().map(parse_state).transpose()?,
        updated_at: get(row, "updated_at")?,
    })
}

pub(crate) fn parse_state(text: &str) -> Result<JobState> {
    JobState::parse(text).ok_or_else(|| StoreError::Corrupt(format!("unknown job state {text:?}")))
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
                code: code.unwrap_or_else(|| Code::EffectFailed.as_str().into()),
            })
        }
        (EffectStatus::Processing, Some(until)) if until >= now => {
            Some(EffectClaim::LeasedByOther {
                remaining: Duration::from_millis(u64::try_from(until - now).unwrap_or(0)),
            })
        }
        _ => None,
    })
}
