//! One `[[schedules]]` table, checked when the configuration is read: a
//! bad cron, an unknown time zone, a bad name or a payload that is not JSON
//! is an error naming the schedule, before anything runs.

use super::zone::Zone;
use crate::store::NewJob;
use chrono::TimeZone as _;
use serde::Deserialize;

/// What to do with ticks missed while no node ran (all down for an hour).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Missed {
    /// Enqueue none of them.
    Skip,
    /// Enqueue one job for all of them: the latest due tick (default).
    #[default]
    One,
    /// Enqueue each, oldest first, at most `catch_up_limit`; past the
    /// limit, the rest collapse as with `one`.
    All,
}

impl Missed {
    /// The name used in `idem.toml`.
    ///
    /// `assert_eq!(idem::schedule::Missed::One.as_str(), "one");`
    pub fn as_str(self) -> &'static str {
        match self {
            Missed::Skip => "skip",
            Missed::One => "one",
            Missed::All => "all",
        }
    }
}

/// A schedule, checked: enqueues a job for `plugin` at each tick of `cron`
/// in `timezone`.
///
/// ```
/// let s: idem::schedule::Schedule = toml::from_str(
///     "name = \"nightly\"\ncron = \"0 0 3 * * *\"\nplugin = \"report\"",
/// ).unwrap();
/// assert_eq!(s.next_after(0), Some(3 * 3600 * 1000));
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "ScheduleToml")]
pub struct Schedule {
    /// Unique name; part of each tick's key, `schedule:NAME:TICK`.
    pub name: String,
    /// The cron expression as written (5 fields, or 6 with seconds first).
    pub cron: String,
    /// The IANA time zone the expression is read in.
    pub timezone: String,
    /// The plugin that handles the jobs.
    pub plugin: String,
    /// The queue the jobs go to.
    pub queue: String,
    /// The jobs' payload (JSON).
    pub payload: Vec<u8>,
    /// The policy for missed ticks.
    pub missed: Missed,
    /// With `missed = "all"`: most missed ticks enqueued one by one.
    pub catch_up_limit: u32,
    /// The jobs' group, if any: with one, a tick's job waits for the one
    /// before it to finish (a long run never overlaps the next).
    pub group: Option<String>,
    /// Attempts of each tick's job; `None`: the plugin's operator file
    /// (`max_attempts` in `<plugin>.toml`), else the worker's setting, as
    /// for any enqueue.
    pub max_attempts: Option<u32>,
    parsed: croner::Cron,
    zone: Zone,
}

/// A `[[schedules]]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScheduleToml {
    name: String,
    cron: String,
    #[serde(default = "utc")]
    timezone: String,
    plugin: String,
    #[serde(default = "default_queue")]
    queue: String,
    /// A JSON string, or a TOML table taken as JSON.
    #[serde(default)]
    payload: Option<toml::Value>,
    #[serde(default)]
    missed: Missed,
    #[serde(default = "default_catch_up_limit")]
    catch_up_limit: u32,
    #[serde(default)]
    group: Option<String>,
    #[serde(default)]
    max_attempts: Option<u32>,
}

fn utc() -> String {
    "UTC".into()
}

fn default_queue() -> String {
    "default".into()
}

/// Enough to cover a day of a per-15-minutes schedule, bounded so a long
/// outage of a per-second one does not flood the queue.
fn default_catch_up_limit() -> u32 {
    100
}

/// The largest `catch_up_limit`: a catch-up of this many ticks takes
/// seconds of transactions, not minutes.
pub const MAX_CATCH_UP_LIMIT: u32 = 10_000;

/// Why a `[[schedules]]` table was refused.
#[derive(Debug, thiserror::Error)]
#[error("schedule {name:?}: {why}")]
pub struct ScheduleError {
    /// The schedule's name as written.
    pub name: String,
    /// What is wrong.
    pub why: String,
}

impl TryFrom<ScheduleToml> for Schedule {
    type Error = ScheduleError;

    fn try_from(t: ScheduleToml) -> Result<Self, ScheduleError> {
        let fail = |why: String| ScheduleError {
            name: t.name.clone(),
            why,
        };
        crate::boundary::name(&t.name).map_err(|r| fail(format!("name {} {}", r.shown, r.why)))?;
        let parsed = croner::Cron::new(&t.cron)
            .with_seconds_optional()
            .parse()
            .map_err(|e| fail(format!("cron {:?}: {e}", t.cron)))?;
        let zone = Zone::named(&t.timezone).map_err(|e| fail(e.to_string()))?;
        let payload = match &t.payload {
            None => b"{}".to_vec(),
            Some(toml::Value::String(text)) => {
                let json: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| fail(format!("payload is not JSON: {e}")))?;
                json.to_string().into_bytes()
            }
            Some(other) => serde_json::to_vec(other)
                .map_err(|e| fail(format!("payload cannot be JSON: {e}")))?,
        };
        if t.missed == Missed::All && t.catch_up_limit == 0 {
            return Err(fail(
                "catch_up_limit must be at least 1 with missed = \"all\"".into(),
            ));
        }
        if t.max_attempts == Some(0) {
            return Err(fail("max_attempts must be at least 1".into()));
        }
        if t.catch_up_limit > MAX_CATCH_UP_LIMIT {
            return Err(fail(format!(
                "catch_up_limit is at most {MAX_CATCH_UP_LIMIT} (each missed tick is a job and a transaction)"
            )));
        }
        let schedule = Schedule {
            name: t.name.clone(),
            cron: t.cron.clone(),
            timezone: t.timezone.clone(),
            plugin: t.plugin.clone(),
            queue: t.queue.clone(),
            payload,
            missed: t.missed,
            catch_up_limit: t.catch_up_limit,
            group: t.group.clone(),
            max_attempts: t.max_attempts,
            parsed,
            zone,
        };
        // The job is checked as an enqueue checks it (plugin and queue
        // names, payload size), so no tick can be refused later.
        crate::store::check_new_job(&schedule.job(0, 1)).map_err(|e| fail(e.to_string()))?;
        if schedule.next_after(0).is_none() {
            return Err(fail(format!("cron {:?} never fires", t.cron)));
        }
        Ok(schedule)
    }
}

/// DST folds send croner's search back to the first instant of a repeated
/// local time; each retry starts an hour later, past the repeated hour.
const FOLD_RETRIES: i64 = 3;

impl Schedule {
    /// The first tick strictly after `after_ms` (ms since the epoch), as a
    /// UTC instant in ms; `None` if the expression never fires again.
    ///
    /// Ticks are whole seconds. Local times are the zone's: a local time
    /// the clocks skip (a DST gap) fires at the first instant after the
    /// gap, as croner does (a daily 02:30 in Europe/Paris fires at 03:00
    /// CEST on the spring-forward day); a local time the clocks repeat (a
    /// fold) fires once, at its first instant. Every tick is later than the
    /// one before, so no instant is ever two ticks.
    ///
    /// `let next = schedule.next_after(now_ms);`
    pub fn next_after(&self, after_ms: i64) -> Option<i64> {
        // From the whole second at or before `after_ms`: croner's search
        // adds one second and keeps any fraction.
        let mut from = after_ms.div_euclid(1000);
        for _ in 0..=FOLD_RETRIES {
            let start = self.zone.timestamp_opt(from, 0).single()?;
            let next = self.parsed.find_next_occurrence(&start, false).ok()?;
            let next_ms = next.timestamp_millis();
            if next_ms > after_ms {
                return Some(next_ms);
            }
            from += 3600;
        }
        None
    }

    /// The job of one tick (its key is set when the tick is recorded), with
    /// the schedule's own `max_attempts`, else `max_attempts`.
    ///
    /// `let job = schedule.job(tick_ms, 10);`
    pub fn job(&self, tick_ms: i64, max_attempts: u32) -> NewJob {
        NewJob {
            queue: self.queue.clone(),
            max_attempts: self.max_attempts.unwrap_or(max_attempts),
            idempotency_key: Some(crate::store::schedule_key(&self.name, tick_ms)),
            group: self.group.clone(),
            ..NewJob::new(self.plugin.clone(), self.payload.clone())
        }
    }
}

/// Reads `[[schedules]]`, each checked, names unique.
pub(crate) fn unique_schedules<'de, D>(deserializer: D) -> Result<Vec<Schedule>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::de::Error as _;
    let schedules = Vec::<Schedule>::deserialize(deserializer)?;
    let mut seen = std::collections::HashSet::new();
    for schedule in &schedules {
        if !seen.insert(schedule.name.as_str()) {
            return Err(D::Error::custom(format!(
                "schedule {:?}: the name is used twice (names identify schedules across restarts)",
                schedule.name
            )));
        }
    }
    Ok(schedules)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(cron: &str, timezone: &str) -> Schedule {
        toml::from_str(&format!(
            "name = \"s\"\ncron = \"{cron}\"\ntimezone = \"{timezone}\"\nplugin = \"p\""
        ))
        .expect("schedule")
    }

    /// Milliseconds of a UTC time written `YYYY-MM-DDTHH:MM:SSZ`.
    fn utc(text: &str) -> i64 {
        chrono::DateTime::parse_from_rfc3339(text)
            .expect("time")
            .timestamp_millis()
    }

    fn ticks(schedule: &Schedule, after: &str, n: usize) -> Vec<String> {
        let mut at = utc(after);
        (0..n)
            .map(|_| {
                at = schedule.next_after(at).expect("a next tick");
                crate::store::rfc3339(at)
            })
            .collect()
    }

    #[test]
    fn a_schedule_may_set_its_jobs_attempts_and_zero_is_refused() {
        let own: Schedule = toml::from_str(
            "name = \"sync\"\ncron = \"* * * * *\"\nplugin = \"p\"\nmax_attempts = 1",
        )
        .expect("schedule");
        assert_eq!(own.job(0, 7).max_attempts, 1, "the schedule's own number");
        let default: Schedule =
            toml::from_str("name = \"sync\"\ncron = \"* * * * *\"\nplugin = \"p\"")
                .expect("schedule");
        assert_eq!(default.job(0, 7).max_attempts, 7, "the default given");
        let zero = toml::from_str::<Schedule>(
            "name = \"sync\"\ncron = \"* * * * *\"\nplugin = \"p\"\nmax_attempts = 0",
        )
        .expect_err("zero attempts");
        assert!(zero.to_string().contains("max_attempts"), "{zero}");
    }

    #[test]
    fn a_schedule_may_group_its_jobs_and_a_bad_group_is_refused() {
        let grouped: Schedule = toml::from_str(
            "name = \"sync\"\ncron = \"* * * * *\"\nplugin = \"p\"\ngroup = \"sync\"",
        )
        .expect("schedule");
        assert_eq!(grouped.job(0, 3).group.as_deref(), Some("sync"));
        let plain: Schedule =
            toml::from_str("name = \"sync\"\ncron = \"* * * * *\"\nplugin = \"p\"")
                .expect("schedule");
        assert_eq!(plain.job(0, 3).group, None);
        let bad = toml::from_str::<Schedule>(
            "name = \"sync\"\ncron = \"* * * * *\"\nplugin = \"p\"\ngroup = \"tab\\there\"",
        )
        .expect_err("a group with a tab is refused");
        assert!(bad.to_string().contains("group"), "{bad}");
    }

    #[test]
    fn ticks_are_utc_instants_of_local_times() {
        // 02:30 in Paris is 01:30Z in winter (CET), 00:30Z in summer (CEST).
        let daily = schedule("30 2 * * *", "Europe/Paris");
        assert_eq!(
            ticks(&daily, "2026-12-07T00:00:00Z", 1),
            ["2026-12-07T01:30:00Z"]
        );
        assert_eq!(
            ticks(&daily, "2026-07-01T00:00:00Z", 1),
            ["2026-07-01T00:30:00Z"]
        );
        // Five fields: no seconds; six: seconds first.
        let every_ten_seconds = schedule("*/10 * * * * *", "UTC");
        assert_eq!(
            ticks(&every_ten_seconds, "2026-12-07T18:00:01Z", 2),
            ["2026-12-07T18:00:10Z", "2026-12-07T18:00:20Z"]
        );
        // A fraction of a second is still before the next whole second.
        let s = schedule("* * * * * *", "UTC");
        assert_eq!(s.next_after(1_500), Some(2_000));
        assert_eq!(s.next_after(2_000), Some(3_000));
    }

    #[test]
    fn a_dst_gap_runs_after_the_gap_and_a_fold_runs_once() {
        // Spring forward in Paris on 2026-03-29: 02:00 CET becomes 03:00
        // CEST (01:00Z); 02:30 does not exist that day and runs at 03:00
        // CEST, the first instant after the gap.
        let daily = schedule("30 2 * * *", "Europe/Paris");
        assert_eq!(
            ticks(&daily, "2026-03-28T00:00:00Z", 3),
            [
                "2026-03-28T01:30:00Z",
                "2026-03-29T01:00:00Z",
                "2026-03-30T00:30:00Z"
            ]
        );
        // Fall back on 2026-10-25: 03:00 CEST becomes 02:00 CET (01:00Z);
        // 02:30 happens twice (00:30Z and 01:30Z) and runs once, at its
        // first instant.
        assert_eq!(
            ticks(&daily, "2026-10-24T12:00:00Z", 2),
            ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]
        );
        // Every 30 minutes through the fold: strictly later each time, no
        // instant twice; the repeated local hour's second pass is skipped.
        let half_hourly = schedule("*/30 * * * *", "Europe/Paris");
        let through = ticks(&half_hourly, "2026-10-24T23:45:00Z", 4);
        assert_eq!(
            through,
            [
                "2026-10-25T00:00:00Z",
                "2026-10-25T00:30:00Z",
                "2026-10-25T02:00:00Z",
                "2026-10-25T02:30:00Z"
            ]
        );
        // From inside the second pass, the search does not go back in time.
        let inside = half_hourly.next_after(utc("2026-10-25T01:10:00Z"));
        assert!(inside > Some(utc("2026-10-25T01:10:00Z")), "{inside:?}");
    }
}
