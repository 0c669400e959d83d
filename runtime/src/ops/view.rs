//! The read model operators look at: queues, jobs with their timeline,
//! dead letters by code. One set of functions over the store, so `idem
//! stats`, `idem jobs`, the HTTP API and the dashboard show the same numbers.

use super::OpsError;
use crate::schedule::Schedule;
use crate::store::{
    EffectRecord, Job, JobFilter, JobId, JobState, QueueStats, ScheduleState, Store,
};
use serde::Serialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// One queue's numbers.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct QueueView {
    /// Queue name (`*` for all queues together).
    pub queue: String,
    /// Jobs per state.
    pub jobs: BTreeMap<&'static str, i64>,
    /// Jobs runnable now.
    pub ready: i64,
    /// Age of the oldest runnable job, ms.
    pub oldest_ready_age_ms: Option<i64>,
    /// Jobs that succeeded in the last minute.
    pub succeeded_last_minute: i64,
    /// Jobs dead-lettered in the last minute.
    pub dead_last_minute: i64,
}

impl QueueView {
    fn of(queue: &str, stats: &QueueStats) -> Self {
        QueueView {
            queue: queue.to_string(),
            jobs: stats
                .by_state
                .iter()
                .map(|(state, n)| (state.as_str(), *n))
                .collect(),
            ready: stats.ready,
            oldest_ready_age_ms: stats.oldest_ready_age_ms,
            succeeded_last_minute: stats.succeeded_last_minute,
            dead_last_minute: stats.dead_last_minute,
        }
    }
}

/// Every queue, the totals, and the dead-letter queue by error code: what
/// `idem stats` prints and `GET /api/queues` answers.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Overview {
    /// All queues together.
    pub total: QueueView,
    /// Each queue with jobs.
    pub queues: Vec<QueueView>,
    /// Dead jobs per last error code, most first.
    pub dead_by_code: Vec<CodeCount>,
}

/// A count of dead jobs with one code.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct CodeCount {
    /// The error code.
    pub code: String,
    /// Dead jobs with it.
    pub jobs: i64,
}

/// The overview, read now.
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn idem::store::Store>) -> Result<(), idem::ops::OpsError> {
/// let overview = idem::ops::view::overview(&*store).await?;
/// println!("{} ready", overview.total.ready);
/// # Ok(()) }
/// ```
pub async fn overview(store: &dyn Store) -> Result<Overview, OpsError> {
    let per_queue = store.queue_overview().await?;
    let mut total = QueueStats {
        by_state: JobState::ALL.iter().map(|s| (*s, 0)).collect(),
        ..QueueStats::default()
    };
    let mut codes: BTreeMap<String, i64> = BTreeMap::new();
    for (_, stats) in &per_queue {
        for (state, n) in &stats.by_state {
            if let Some(slot) = total.by_state.iter_mut().find(|(s, _)| s == state) {
                slot.1 += n;
            }
        }
        total.ready += stats.ready;
        total.oldest_ready_age_ms = total.oldest_ready_age_ms.max(stats.oldest_ready_age_ms);
        total.succeeded_last_minute += stats.succeeded_last_minute;
        total.dead_last_minute += stats.dead_last_minute;
        for (code, n) in &stats.dead_by_code {
            *codes.entry(code.clone()).or_default() += n;
        }
    }
    let mut dead_by_code: Vec<CodeCount> = codes
        .into_iter()
        .map(|(code, jobs)| CodeCount { code, jobs })
        .collect();
    dead_by_code.sort_by(|a, b| b.jobs.cmp(&a.jobs).then(a.code.cmp(&b.code)));
    Ok(Overview {
        total: QueueView::of("*", &total),
        queues: per_queue
            .iter()
            .map(|(name, stats)| QueueView::of(name, stats))
            .collect(),
        dead_by_code,
    })
}

/// One schedule as operators see it: its configuration (when this node's
/// `idem.toml` has it) and what the store recorded.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ScheduleView {
    /// The schedule's name.
    pub name: String,
    /// False for a schedule the store knows but this configuration no
    /// longer has (removed or renamed: its row is kept, harmless).
    pub configured: bool,
    /// The cron expression.
    pub cron: Option<String>,
    /// Its IANA time zone.
    pub timezone: Option<String>,
    /// The plugin its jobs run.
    pub plugin: Option<String>,
    /// The missed-tick policy (`skip`, `one`, `all`).
    pub missed: Option<&'static str>,
    /// The next tick to come, after now and after the last one recorded.
    pub next_run: Option<String>,
    /// The latest tick recorded (enqueued, skipped, or when first seen).
    pub last_tick: Option<String>,
    /// The job of the latest enqueued tick.
    pub last_job_id: Option<JobId>,
    /// That job's state: the last run's outcome (none once pruned).
    pub last_outcome: Option<&'static str>,
}

/// Every schedule, configured or known to the store, by name: what `idem
/// schedules list`, `idem stats` and `GET /api/schedules` show. Next runs
/// are reckoned from the store's clock.
///
/// `let schedules = idem::ops::view::schedules(&*store, &config.schedules).await?;`
pub async fn schedules(
    store: &dyn Store,
    configured: &[Schedule],
) -> Result<Vec<ScheduleView>, OpsError> {
    let now = store.clock_now().await?;
    let mut known: BTreeMap<String, ScheduleState> = store
        .schedule_list()
        .await?
        .into_iter()
        .map(|s| (s.name.clone(), s))
        .collect();
    let mut views: Vec<ScheduleView> = configured
        .iter()
        .map(|schedule| {
            let state = known.remove(&schedule.name);
            let from = state.as_ref().map_or(now, |s| s.last_tick_ms.max(now));
            ScheduleView {
                name: schedule.name.clone(),
                configured: true,
                cron: Some(schedule.cron.clone()),
                timezone: Some(schedule.timezone.clone()),
                plugin: Some(schedule.plugin.clone()),
                missed: Some(schedule.missed.as_str()),
                next_run: schedule.next_after(from).map(crate::store::rfc3339),
                ..recorded(state)
            }
        })
        .collect();
    views.extend(known.into_values().map(|state| ScheduleView {
        name: state.name.clone(),
        ..recorded(Some(state))
    }));
    views.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(views)
}

/// What the store recorded of a schedule (nothing configured).
fn recorded(state: Option<ScheduleState>) -> ScheduleView {
    ScheduleView {
        name: String::new(),
        configured: false,
        cron: None,
        timezone: None,
        plugin: None,
        missed: None,
        next_run: None,
        last_tick: state
            .as_ref()
            .map(|s| crate::store::rfc3339(s.last_tick_ms)),
        last_job_id: state.as_ref().and_then(|s| s.last_job_id),
        last_outcome: state
            .as_ref()
            .and_then(|s| s.last_job_state)
            .map(JobState::as_str),
    }
}

/// Milliseconds since the epoch as an RFC 3339 UTC time.
pub fn time(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string())
        .unwrap_or_default()
}

fn payload_json(payload: &[u8]) -> Value {
    match std::str::from_utf8(payload) {
        Ok(text) => serde_json::from_str(text).unwrap_or_else(|_| Value::from(text)),
        Err(_) => json!({"bytes": payload.len()}),
    }
}

/// A count shown to a person: the number, or `-` when it is null (a
/// job's `max_attempts` before its first claim resolves it).
///
/// `assert_eq!(idem::ops::view::count_or_dash(&serde_json::json!(null)), "-");`
pub fn count_or_dash(value: &Value) -> String {
    value.as_u64().map_or_else(|| "-".into(), |n| n.to_string())
}

/// A job in a list: no payload, no plan.
pub fn job_summary(job: &Job) -> Value {
    json!({
        "id": job.id,
        "state": job.state.as_str(),
        "queue": job.queue,
        "plugin": job.plugin,
        "idempotency_key": job.idempotency_key,
        "correlation_id": job.correlation_id,
        "group": job.group,
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "priority": job.priority,
        "run_at": time(job.run_at_ms),
        "created_at": time(job.created_at_ms),
        "finished_at": job.finished_at_ms.map(time),
        "last_error": job.last_error_code.as_ref().map(|code| json!({
            "code": code,
            "message": job.last_error_message,
        })),
    })
}

/// One effect of a job's plan as the ledger knows it.
pub fn effect_json(record: &EffectRecord) -> Value {
    json!({
        "key": record.key,
        "provider": record.provider,
        "status": record.status.as_str(),
        "attempt": record.attempt,
        "result_ref": record.result_ref,
        "last_error_code": record.last_error_code,
        "reached": record.reached,
        "in_doubt": record.in_doubt,
        "first_sent_at": record.first_sent_at_ms.map(time),
        "updated_at": time(record.updated_at_ms),
    })
}

/// A job with everything an operator asks about: state, attempts, error
/// history, payload, its plan and each planned effect as the ledger has it
/// (`status: "not_started"` for an effect not yet claimed), and a timeline.
pub async fn job_detail(store: &dyn Store, id: JobId) -> Result<Value, OpsError> {
    let job = store
        .job_get(id)
        .await?
        .ok_or_else(|| OpsError::NotFound(format!("no job {id}")))?;
    let plan: Vec<crate::effects::Effect> = job
        .plan
        .as_deref()
        .and_then(|p| serde_json::from_str(p).ok())
        .unwrap_or_default();
    let mut effects = Vec::new();
    for effect in &plan {
        let record = store.effect_get(&effect.idempotency_key).await?;
        let mut value = match &record {
            Some(record) => effect_json(record),
            None => {
                json!({"key": effect.idempotency_key, "provider": effect.provider, "status": "not_started"})
            }
        };
        value["action"] = Value::from(effect.action.kind());
        effects.push(value);
    }
    let mut timeline =
        vec![json!({"at": time(job.created_at_ms), "event": "enqueued", "queue": job.queue})];
    for error in &job.errors {
        timeline.push(json!({
            "at": time(error.at_ms),
            "event": "attempt_failed",
            "attempt": error.attempt,
            "class": error.class.as_str(),
            "code": error.code,
            "message": error.message,
        }));
    }
    if let Some(finished) = job.finished_at_ms {
        timeline.push(json!({"at": time(finished), "event": job.state.as_str()}));
    }
    let mut out = job_summary(&job);
    out["payload"] = payload_json(&job.payload);
    out["rescues"] = job.rescues.into();
    out["plugin_hash"] = job.plugin_hash.clone().into();
    out["errors"] = serde_json::to_value(&job.errors).unwrap_or_default();
    out["plan"] = job
        .plan
        .as_deref()
        .and_then(|p| serde_json::from_str::<Value>(p).ok())
        .unwrap_or(Value::Null);
    out["effects"] = effects.into();
    out["timeline"] = timeline.into();
    Ok(out)
}

/// A page of jobs, newest first.
#[derive(Debug, Clone, Default)]
pub struct JobQuery {
    /// Only this state.
    pub state: Option<JobState>,
    /// Only this queue.
    pub queue: Option<String>,
    /// Only this plugin.
    pub plugin: Option<String>,
    /// Only this last error code.
    pub code: Option<String>,
    /// Only ids below this one (the next page).
    pub before: Option<i64>,
    /// Most rows (1..=500).
    pub limit: u32,
}

/// Lists jobs; `next_before` continues the listing.
pub async fn job_page(store: &dyn Store, query: JobQuery) -> Result<Value, OpsError> {
    let limit = query.limit.clamp(1, 500);
    let jobs = store
        .job_list(JobFilter {
            states: query.state.into_iter().collect(),
            plugin: query.plugin,
            error_code: query.code,
            queue: query.queue,
            before: query.before.map(JobId),
            limit,
            ..JobFilter::default()
        })
        .await?;
    let next = (jobs.len() == limit as usize)
        .then(|| jobs.last().map(|j| j.id.0))
        .flatten();
    Ok(json!({
        "jobs": jobs.iter().map(job_summary).collect::<Vec<_>>(),
        "next_before": next,
    }))
}
