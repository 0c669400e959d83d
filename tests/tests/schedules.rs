//! Schedules end to end, on both backends, with the store's clock moved
//! forward instead of waiting: two workers sharing a store enqueue each tick
//! of a per-second schedule once, and a restart after an outage follows
//! each schedule's missed-tick policy.

use idem::queue::{Worker, WorkerSettings};
use idem::schedule::Schedule;
use idem::store::{JobFilter, Store};
use idem_tests::{Backend, Harness, both_backends};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const SECOND: i64 = 1000;
const MINUTE: i64 = 60 * SECOND;

fn schedule(name: &str, cron: &str, extra: &str) -> Schedule {
    toml::from_str(&format!(
        "name = \"{name}\"\ncron = \"{cron}\"\nplugin = \"noop\"\n{extra}"
    ))
    .expect("schedule")
}

/// A worker that serves until stopped, running these schedules.
fn start(
    h: &Harness,
    id: &str,
    schedules: &[Schedule],
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let worker = Worker::new(
        h.store.clone(),
        h.registry.clone(),
        h.providers(),
        WorkerSettings {
            exit_when_drained: false,
            schedules: schedules.to_vec(),
            ..h.settings(id)
        },
    );
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move {
            worker.run(stop).await.expect("worker");
        }
    });
    (stop, run)
}

async fn stop(worker: (CancellationToken, tokio::task::JoinHandle<()>)) {
    worker.0.cancel();
    tokio::time::timeout(Duration::from_secs(30), worker.1)
        .await
        .expect("the worker stops")
        .expect("the worker ran");
}

/// Waits for the workers to act until `done` holds: woken by each job the
/// store inserts (a tick), and every 20 ms for what inserts none (a
/// schedule's start).
async fn until<F, Fut>(store: &Arc<dyn Store>, what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        store.wait_for_jobs(Duration::from_millis(20)).await;
    }
}

/// The ticks (ms) of the jobs of schedule `name`, sorted.
async fn ticks(store: &Arc<dyn Store>, name: &str) -> Vec<i64> {
    let prefix = format!("schedule:{name}:");
    let mut ticks: Vec<i64> = store
        .job_list(JobFilter {
            plugin: Some("noop".into()),
            limit: 10_000,
            ..Default::default()
        })
        .await
        .expect("jobs")
        .into_iter()
        .filter_map(|job| {
            let key = job.idempotency_key?;
            let tick = key.strip_prefix(&prefix)?.to_string();
            Some(
                chrono::DateTime::parse_from_rfc3339(&tick)
                    .expect("an RFC 3339 tick")
                    .timestamp_millis(),
            )
        })
        .collect();
    ticks.sort_unstable();
    ticks
}

async fn last_tick(store: &Arc<dyn Store>, name: &str) -> Option<i64> {
    store
        .schedule_list()
        .await
        .expect("schedules")
        .into_iter()
        .find(|s| s.name == name)
        .map(|s| s.last_tick_ms)
}

async fn advance_ms(store: &Arc<dyn Store>, ms: i64) {
    store
        .clock_advance(Duration::from_millis(ms.max(0) as u64))
        .await
        .expect("the clock moves");
}

async fn two_workers_enqueue_each_tick_of_a_per_second_schedule_once(backend: Backend) {
    let h = Harness::new(backend).await;
    let every_second = [schedule("every-second", "* * * * * *", "")];
    let a = start(&h, "node-a", &every_second);
    let b = start(&h, "node-b", &every_second);
    until(&h.store, "the schedule to start", || async {
        last_tick(&h.store, "every-second").await.is_some()
    })
    .await;
    let started = last_tick(&h.store, "every-second").await.expect("started");
    assert!(
        ticks(&h.store, "every-second").await.is_empty(),
        "a new schedule does not backfill"
    );
    // 60 simulated seconds, one at a time; each step waits until its tick
    // is recorded (the real time the test takes may have recorded more).
    let first = (started / SECOND + 1) * SECOND;
    for step in 0..60 {
        advance_ms(&h.store, SECOND).await;
        let tick = first + step * SECOND;
        until(&h.store, &format!("tick {step}"), || async {
            last_tick(&h.store, "every-second").await >= Some(tick)
        })
        .await;
    }
    stop(a).await;
    stop(b).await;
    let enqueued = ticks(&h.store, "every-second").await;
    let in_the_minute: Vec<i64> = enqueued
        .iter()
        .copied()
        .filter(|t| *t <= started + 60 * SECOND)
        .collect();
    let expected: Vec<i64> = (0..60).map(|i| first + i * SECOND).collect();
    assert_eq!(
        in_the_minute, expected,
        "60 simulated seconds: 60 jobs, each second once, none missed"
    );
    // The real time the test took moves the store's clock too: any tick
    // after the minute follows on, each second once.
    let last = *enqueued.last().expect("jobs");
    let all: Vec<i64> = (first..=last).step_by(SECOND as usize).collect();
    assert_eq!(enqueued, all, "no tick twice, none missed");
    assert_eq!(last_tick(&h.store, "every-second").await, Some(last));
}

async fn a_restart_after_an_outage_follows_each_policy(backend: Backend) {
    let h = Harness::new(backend).await;
    let cron = "* * * * *";
    let schedules = [
        schedule("skip", cron, "missed = \"skip\""),
        schedule("one", cron, ""),
        schedule("all", cron, "missed = \"all\""),
        schedule("all-3", cron, "missed = \"all\"\ncatch_up_limit = 3"),
    ];
    let names = ["skip", "one", "all", "all-3"];
    let before = start(&h, "before", &schedules);
    until(&h.store, "the schedules to start", || async {
        for name in names {
            if last_tick(&h.store, name).await.is_none() {
                return false;
            }
        }
        true
    })
    .await;
    // Just past the next minute: each schedule enqueues that tick on time.
    let now = h.store.clock_now().await.expect("now");
    let tick = (now / MINUTE + 1) * MINUTE;
    advance_ms(&h.store, tick + 200 - now).await;
    for name in names {
        until(&h.store, &format!("{name}'s first tick"), || async {
            ticks(&h.store, name).await == [tick]
        })
        .await;
    }
    stop(before).await;

    // Every node down for an hour: 60 ticks missed. The restart lands half
    // a minute after the last of them, so the test's own real time cannot
    // bring another tick due.
    let now = h.store.clock_now().await.expect("now");
    let latest = tick + 60 * MINUTE;
    advance_ms(&h.store, latest + 30 * SECOND - now).await;
    let after = start(&h, "after", &schedules);
    for name in names {
        until(&h.store, &format!("{name} to catch up"), || async {
            last_tick(&h.store, name).await == Some(latest)
        })
        .await;
    }
    stop(after).await;

    let minutes = |range: std::ops::RangeInclusive<i64>| -> Vec<i64> {
        std::iter::once(tick)
            .chain(range.map(|m| tick + m * MINUTE))
            .collect()
    };
    assert_eq!(
        ticks(&h.store, "skip").await,
        [tick],
        "skip: no catch-up job"
    );
    assert_eq!(
        ticks(&h.store, "one").await,
        [tick, latest],
        "one: one job, at the latest missed tick"
    );
    assert_eq!(
        ticks(&h.store, "all").await,
        minutes(1..=60),
        "all: every missed tick, in order"
    );
    let mut bounded = minutes(1..=3);
    bounded.push(latest);
    assert_eq!(
        ticks(&h.store, "all-3").await,
        bounded,
        "all up to 3, then the rest as one"
    );
}

both_backends!(
    two_workers_enqueue_each_tick_of_a_per_second_schedule_once,
    a_restart_after_an_outage_follows_each_policy,
);
