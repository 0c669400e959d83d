//! Which ticks a node records in one round: the pure part of the ticker,
//! from the schedule, its last recorded tick and the store's clock.
//!
//! A due tick is one in `(last, now]`. It is **on time** while it is at
//! most `grace` old, and **missed** once older (every node was down, or too
//! busy, when it came due). On-time ticks are always enqueued, each in
//! order; the schedule's [`Missed`] policy says what becomes of missed ones:
//! - `skip`: none is enqueued; the schedule moves past them.
//! - `one` (default): one job stands for all of them, at the latest due
//!   tick; when an on-time tick is due, it is that job.
//! - `all`: each is enqueued, oldest first, up to `catch_up_limit`; past the
//!   limit the rest collapse as with `one`.

use super::spec::{Missed, Schedule};

/// One tick to record, in increasing order of `tick_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// The tick (ms since the epoch, UTC).
    pub tick_ms: i64,
    /// Enqueue its job (`false`: move the schedule past it, no job).
    pub enqueue: bool,
}

/// Most ticks read in one search: bounds a round whatever the expression
/// and the outage (a per-second schedule down for a month).
const MAX_SCAN: usize = 100_000;

/// The ticks to record now, oldest first (empty when none is due).
///
/// ```
/// # use idem::schedule::{plan, Schedule};
/// let s: Schedule = toml::from_str("name = \"s\"\ncron = \"* * * * * *\"\nplugin = \"p\"").unwrap();
/// let steps = plan::steps(&s, 10_000, 12_000, 1_000);
/// assert_eq!(steps.iter().map(|s| s.tick_ms).collect::<Vec<_>>(), [11_000, 12_000]);
/// ```
pub fn steps(schedule: &Schedule, last_ms: i64, now_ms: i64, grace_ms: i64) -> Vec<Step> {
    let Some(first) = schedule.next_after(last_ms) else {
        return Vec::new();
    };
    if first > now_ms {
        return Vec::new();
    }
    // A tick before `cutoff` is missed.
    let cutoff = now_ms - grace_ms;
    let on_time = ticks_in(schedule, last_ms.max(cutoff - 1), now_ms, MAX_SCAN);
    let mut steps = Vec::new();
    if first < cutoff {
        let latest_missed = || latest_before(schedule, last_ms, cutoff);
        match schedule.missed {
            Missed::Skip => {
                // An on-time tick moves the schedule past the missed ones.
                if on_time.is_empty() {
                    steps.extend(latest_missed().map(|tick_ms| Step {
                        tick_ms,
                        enqueue: false,
                    }));
                }
            }
            Missed::One => {
                if on_time.is_empty() {
                    steps.extend(latest_missed().map(enqueue));
                }
            }
            Missed::All => {
                let limit = schedule.catch_up_limit as usize;
                // One more than the limit tells whether some were left out.
                let missed = ticks_in(schedule, last_ms, cutoff - 1, limit + 1);
                steps.extend(missed.iter().take(limit).copied().map(enqueue));
                if missed.len() > limit && on_time.is_empty() {
                    steps.extend(latest_missed().map(enqueue));
                }
            }
        }
    }
    steps.extend(on_time.into_iter().map(enqueue));
    steps
}

fn enqueue(tick_ms: i64) -> Step {
    Step {
        tick_ms,
        enqueue: true,
    }
}

/// Ticks in `(after, until]`, oldest first, at most `limit`.
fn ticks_in(schedule: &Schedule, after: i64, until: i64, limit: usize) -> Vec<i64> {
    let mut ticks = Vec::new();
    let mut cursor = after;
    while ticks.len() < limit {
        match schedule.next_after(cursor) {
            Some(tick) if tick <= until => {
                ticks.push(tick);
                cursor = tick;
            }
            _ => break,
        }
    }
    ticks
}

/// The latest tick in `(last, before)`, by bisection: a tick at or after
/// `x` (and before `before`) exists exactly while `x` is at most the latest
/// one, so about 40 searches find it, however dense the ticks and however
/// long the outage (a scan from `last` would read millions of a
/// per-second schedule's ticks, and a capped one would stop short).
fn latest_before(schedule: &Schedule, last: i64, before: i64) -> Option<i64> {
    let exists_from = |x: i64| schedule.next_after(x - 1).is_some_and(|t| t < before);
    let mut lo = schedule.next_after(last).filter(|t| *t < before)?;
    let mut hi = before;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if exists_from(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(cron: &str, missed: &str, limit: u32) -> Schedule {
        toml::from_str(&format!(
            "name = \"s\"\ncron = \"{cron}\"\nplugin = \"p\"\nmissed = \"{missed}\"\ncatch_up_limit = {limit}"
        ))
        .expect("schedule")
    }

    fn ticks(steps: &[Step]) -> Vec<(i64, bool)> {
        steps
            .iter()
            .map(|s| (s.tick_ms / 1000, s.enqueue))
            .collect()
    }

    const MIN: i64 = 60_000;

    #[test]
    fn nothing_is_due_before_the_next_tick() {
        let s = schedule("* * * * *", "one", 100);
        assert!(steps(&s, 0, MIN - 1, 1000).is_empty());
        assert_eq!(ticks(&steps(&s, 0, MIN, 1000)), [(60, true)]);
    }

    #[test]
    fn on_time_ticks_are_all_enqueued_whatever_the_policy() {
        for missed in ["skip", "one", "all"] {
            let s = schedule("* * * * * *", missed, 100);
            // Two ticks due, both within the grace of 2 s.
            assert_eq!(
                ticks(&steps(&s, 10_000, 12_000, 2000)),
                [(11, true), (12, true)],
                "{missed}"
            );
        }
    }

    #[test]
    fn missed_ticks_follow_the_policy() {
        // Per minute; last at 0; now 10 min 30 s later: ticks 1..=10 missed.
        let now = 10 * MIN + 30_000;
        let skip = schedule("* * * * *", "skip", 100);
        assert_eq!(ticks(&steps(&skip, 0, now, 1000)), [(600, false)]);
        let one = schedule("* * * * *", "one", 100);
        assert_eq!(ticks(&steps(&one, 0, now, 1000)), [(600, true)]);
        let all = schedule("* * * * *", "all", 100);
        let every: Vec<(i64, bool)> = (1..=10).map(|m| (m * 60, true)).collect();
        assert_eq!(ticks(&steps(&all, 0, now, 1000)), every);
        // Past the limit, the rest collapse into the latest tick.
        let bounded = schedule("* * * * *", "all", 3);
        assert_eq!(
            ticks(&steps(&bounded, 0, now, 1000)),
            [(60, true), (120, true), (180, true), (600, true)]
        );
    }

    #[test]
    fn an_on_time_tick_stands_for_the_missed_ones() {
        // Ticks 1..=9 missed, tick 10 on time (now is tick 10).
        let now = 10 * MIN;
        let skip = schedule("* * * * *", "skip", 100);
        assert_eq!(ticks(&steps(&skip, 0, now, 1000)), [(600, true)]);
        let one = schedule("* * * * *", "one", 100);
        assert_eq!(ticks(&steps(&one, 0, now, 1000)), [(600, true)]);
        let bounded = schedule("* * * * *", "all", 2);
        assert_eq!(
            ticks(&steps(&bounded, 0, now, 1000)),
            [(60, true), (120, true), (600, true)]
        );
    }

    #[test]
    fn a_long_outage_of_a_frequent_schedule_reads_few_ticks() {
        // A per-second schedule down for 400 days: the latest missed tick
        // is found in the first window.
        let s = schedule("* * * * * *", "one", 100);
        let now = 400 * 86_400_000 + 500;
        let started = std::time::Instant::now();
        assert_eq!(ticks(&steps(&s, 0, now, 1000)), [(400 * 86_400, true)]);
        let all = schedule("* * * * * *", "all", 5);
        assert_eq!(steps(&all, 0, now, 1000).len(), 6);
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn one_after_an_outage_of_a_dense_schedule_is_the_latest_tick() {
        // Every second of business hours on weekdays, down for a week
        // (from the review: a scan capped at 100,000 ticks stopped short
        // and `one` enqueued two catch-up jobs).
        let at = |t: &str| {
            chrono::DateTime::parse_from_rfc3339(t)
                .expect("a time")
                .timestamp_millis()
        };
        let s = schedule("* * 9-17 * * 1-5", "one", 100);
        let last = at("2026-11-30T10:00:00Z");
        let now = at("2026-12-07T08:00:00Z");
        let planned = steps(&s, last, now, 5_000);
        assert_eq!(
            planned,
            [Step {
                tick_ms: at("2026-12-04T17:59:59Z"),
                enqueue: true
            }]
        );
        // The same outage under `skip`: moved past, at the same tick.
        let skip = schedule("* * 9-17 * * 1-5", "skip", 100);
        assert_eq!(
            steps(&skip, last, now, 5_000),
            [Step {
                tick_ms: at("2026-12-04T17:59:59Z"),
                enqueue: false
            }]
        );
    }
}
