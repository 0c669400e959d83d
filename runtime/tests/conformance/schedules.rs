//! Schedules: one store operation records a tick (moves the schedule's last
//! tick forward only to a newer tick, and only its winner enqueues the job
//! under `schedule:NAME:TICK`), so many nodes seeing one tick make one job,
//! and a tick never comes back, even after its job is pruned.

use super::{LONG, advance, claim_one, job, keyed, succeed};
use idem::store::{
    Enqueued, JobFilter, JobState, NewJob, PruneParams, ScheduleState, ScheduleTick, Store,
    StoreError, Ticked, schedule_key,
};
use std::sync::Arc;
use std::time::Duration;

const SECOND: i64 = 1000;

fn tick(name: &str, tick_ms: i64, job: Option<NewJob>) -> ScheduleTick {
    ScheduleTick {
        name: name.into(),
        tick_ms,
        job,
    }
}

async fn state(store: &Arc<dyn Store>, name: &str) -> Option<ScheduleState> {
    store
        .schedule_list()
        .await
        .unwrap()
        .into_iter()
        .find(|s| s.name == name)
}

async fn jobs_of(store: &Arc<dyn Store>, plugin: &str) -> usize {
    store
        .job_list(JobFilter {
            plugin: Some(plugin.into()),
            limit: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .len()
}

fn enqueued(ticked: Ticked) -> Enqueued {
    match ticked {
        Ticked::Enqueued(e) => e,
        other => panic!("expected a job, got {other:?}"),
    }
}

pub async fn schedule_tick_moves_forward_only(store: Arc<dyn Store>) {
    let now = store.clock_now().await.unwrap();
    assert!(store.schedule_start("report", now).await.unwrap());
    assert!(
        !store
            .schedule_start("report", now + 5 * SECOND)
            .await
            .unwrap()
    );
    let started = state(&store, "report").await.expect("known");
    assert_eq!(started.last_tick_ms, now, "a second start changes nothing");
    assert_eq!(started.last_job_id, None);

    // The first tick after the start: the job, under the tick's key.
    let t1 = (now / SECOND + 1) * SECOND;
    let first = enqueued(
        store
            .schedule_tick(tick("report", t1, Some(job("report"))))
            .await
            .unwrap(),
    );
    assert!(first.inserted);
    let stored = store.job_get(first.id).await.unwrap().expect("the job");
    assert_eq!(
        stored.idempotency_key.as_deref(),
        Some(schedule_key("report", t1).as_str())
    );
    let s = state(&store, "report").await.unwrap();
    assert_eq!(
        (s.last_tick_ms, s.last_job_id, s.last_job_state),
        (t1, Some(first.id), Some(JobState::Available))
    );

    // The same tick again, or an older one: refused, nothing written.
    for old in [t1, t1 - SECOND, now] {
        assert_eq!(
            store
                .schedule_tick(tick("report", old, Some(job("report"))))
                .await
                .unwrap(),
            Ticked::Stale,
            "tick {old}"
        );
    }
    assert_eq!(jobs_of(&store, "report").await, 1);

    // A tick passed over by policy: the schedule moves, no job, the last
    // job stays the one of the last enqueued tick.
    let t2 = t1 + SECOND;
    assert_eq!(
        store.schedule_tick(tick("report", t2, None)).await.unwrap(),
        Ticked::Passed
    );
    let s = state(&store, "report").await.unwrap();
    assert_eq!((s.last_tick_ms, s.last_job_id), (t2, Some(first.id)));
    assert_eq!(
        store
            .schedule_tick(tick("report", t1 + 500, Some(job("report"))))
            .await
            .unwrap(),
        Ticked::Stale,
        "a tick between the last enqueued and the passed one"
    );
    assert_eq!(jobs_of(&store, "report").await, 1);

    // A job already holding a newer tick's key (a producer's, say) is that
    // tick's job: the schedule records it and inserts nothing.
    let t3 = t2 + SECOND;
    let held = store
        .job_insert(keyed("report", &schedule_key("report", t3)))
        .await
        .unwrap();
    let again = enqueued(
        store
            .schedule_tick(tick("report", t3, Some(job("report"))))
            .await
            .unwrap(),
    );
    assert_eq!(
        again,
        Enqueued {
            id: held.id,
            inserted: false
        }
    );
    assert_eq!(
        state(&store, "report").await.unwrap().last_job_id,
        Some(held.id)
    );

    // A schedule never started is inserted by its first tick.
    let fresh = enqueued(
        store
            .schedule_tick(tick("other", t1, Some(job("other"))))
            .await
            .unwrap(),
    );
    assert!(fresh.inserted);
    let names: Vec<String> = store
        .schedule_list()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["other", "report"]);
}

pub async fn schedule_tick_checks_its_input_before_writing(store: Arc<dyn Store>) {
    let now = store.clock_now().await.unwrap();
    assert!(store.schedule_start("checked", now).await.unwrap());
    for name in ["", "a b", "a/b"] {
        let refused = store
            .schedule_tick(tick(name, now + SECOND, Some(job("p"))))
            .await;
        assert!(
            matches!(refused, Err(StoreError::Invalid(_))),
            "{name:?}: {refused:?}"
        );
        assert!(matches!(
            store.schedule_start(name, now).await,
            Err(StoreError::Invalid(_))
        ));
    }
    let bad_queue = NewJob {
        queue: "no queue".into(),
        ..job("p")
    };
    let refused = store
        .schedule_tick(tick("checked", now + SECOND, Some(bad_queue)))
        .await;
    assert!(
        matches!(refused, Err(StoreError::Invalid(_))),
        "{refused:?}"
    );
    assert_eq!(
        state(&store, "checked").await.unwrap().last_tick_ms,
        now,
        "a refused job does not move the schedule"
    );
    assert_eq!(jobs_of(&store, "p").await, 0);
}

pub async fn schedule_tick_race_enqueues_one_job(store: Arc<dyn Store>) {
    let base = store.clock_now().await.unwrap() / SECOND * SECOND;
    // Round 0 races on the schedule's first row, the others on its update.
    for round in 0..5 {
        let tick_ms = base + round * SECOND;
        let barrier = Arc::new(tokio::sync::Barrier::new(8));
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (store, barrier) = (store.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    store
                        .schedule_tick(tick("race", tick_ms, Some(job("race"))))
                        .await
                        .unwrap()
                })
            })
            .collect();
        let results: Vec<Ticked> = futures::future::join_all(tasks)
            .await
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        let winners: Vec<&Ticked> = results
            .iter()
            .filter(|t| matches!(t, Ticked::Enqueued(e) if e.inserted))
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        assert!(
            results
                .iter()
                .all(|t| matches!(t, Ticked::Stale | Ticked::Enqueued(_))),
            "{results:?}"
        );
        assert_eq!(
            results.iter().filter(|t| **t == Ticked::Stale).count(),
            7,
            "round {round}: the losers do nothing: {results:?}"
        );
        assert_eq!(jobs_of(&store, "race").await, round as usize + 1);
    }
}

pub async fn schedule_tick_never_comes_back_after_pruning(store: Arc<dyn Store>) {
    let now = store.clock_now().await.unwrap();
    let t1 = (now / SECOND + 1) * SECOND;
    let first = enqueued(
        store
            .schedule_tick(tick("pruned", t1, Some(job("pruned"))))
            .await
            .unwrap(),
    );
    let claimed = claim_one(&store, "w", LONG).await;
    assert_eq!(claimed.id, first.id);
    succeed(&store, &claimed.fence()).await.unwrap();
    assert_eq!(
        state(&store, "pruned").await.unwrap().last_job_state,
        Some(JobState::Succeeded)
    );
    advance(&store, Duration::from_secs(3600)).await;
    let deleted = store
        .job_delete_finished(PruneParams {
            succeeded_older_than: Duration::from_secs(60),
            dead_older_than: Duration::from_secs(60),
            limit: 100,
        })
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    assert!(store.job_get(first.id).await.unwrap().is_none());
    assert_eq!(
        store
            .schedule_tick(tick("pruned", t1, Some(job("pruned"))))
            .await
            .unwrap(),
        Ticked::Stale,
        "the key is free again, the schedule still remembers the tick"
    );
    assert_eq!(jobs_of(&store, "pruned").await, 0);
    let s = state(&store, "pruned").await.unwrap();
    assert_eq!((s.last_job_id, s.last_job_state), (Some(first.id), None));
}

pub async fn clock_now_is_the_store_clock(store: Arc<dyn Store>) {
    let before = store.clock_now().await.unwrap();
    advance(&store, Duration::from_secs(3600)).await;
    let after = store.clock_now().await.unwrap();
    assert!(
        (3_600_000..3_660_000).contains(&(after - before)),
        "{before} → {after}"
    );
}
