//! The store conformance suite: every case runs against every backend.
//!
//! A case is `pub async fn case(store: Arc<dyn Store>)` in the submodule of
//! its area; [`conformance_suite!`] turns each into a test for one backend
//! given a factory (`async fn() -> Fixture`). A case missing from the macro's
//! list is dead code, which `clippy -D warnings` rejects; a listed case that
//! does not exist does not compile.
//!
//! # Layout
//! - [`insert`]: enqueue, uniqueness, batches, listing.
//! - [`claim`]: atomic claims, ordering, scheduling, queue limits.
//! - [`lifecycle`]: leases, fencing, retries, release, plans, pruning, stats.
//! - [`dlq`]: the dead-letter queue and replay.
//! - [`effects`]: the effect ledger.
//! - [`batch`]: batched writes and the group commit's buffer.
//! - [`statements`]: `sql` effects on the store's own database.
//! - [`sessions`]: dashboard sessions (expiry, sign-out, token change).
//! - [`schedules`]: schedule ticks, once each across callers.
//! - [`groups`]: one job of a group at a time, in enqueue order.
//! - [`model`]: random interleavings of the job state machine against a
//!   reference model.

pub mod batch;
pub mod claim;
pub mod dlq;
pub mod effects;
pub mod groups;
pub mod insert;
pub mod lifecycle;
pub mod model;
pub mod schedules;
pub mod sessions;
pub mod statements;

use futures::future::BoxFuture;
use idem::failure::ErrorClass;
use idem::store::{
    ClaimParams, EffectClaimParams, ErrorRecord, Fence, Job, JobChange, JobFence, JobId,
    MAX_UNSTARTED_RESCUES, NewJob, Result, Store, Write, Written,
};
use std::any::Any;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// A store for one test, and whatever must outlive it (a temp dir) or run
/// after it (dropping a schema).
pub struct Fixture {
    /// The store under test.
    pub store: Arc<dyn Store>,
    /// Kept alive until the case is done.
    pub keep: Box<dyn Any + Send>,
    /// Runs after the case, even when it panicked.
    pub teardown: Option<BoxFuture<'static, ()>>,
}

/// Runs one case on a fresh store, tears the store down, then re-raises the
/// case's panic if it had one.
pub async fn run<F, Fut, C, CFut>(factory: F, case: C)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Fixture>,
    C: FnOnce(Arc<dyn Store>) -> CFut,
    CFut: Future<Output = ()> + Send + 'static,
{
    let fixture = factory().await;
    let outcome = tokio::spawn(case(fixture.store.clone())).await;
    let Fixture {
        store,
        keep,
        teardown,
    } = fixture;
    drop(store);
    if let Some(teardown) = teardown {
        teardown.await;
    }
    drop(keep);
    if let Err(e) = outcome {
        match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("case did not finish: {e}"),
        }
    }
}

/// Expands to one `#[tokio::test]` per conformance case, each on a fresh
/// store from `$factory` (an `async fn() -> Fixture`).
macro_rules! conformance_suite {
    ($factory:expr) => {
        $crate::conformance::conformance_suite!(@cases $factory;
            insert::insert_roundtrip,
            insert::insert_duplicate_key_returns_existing,
            insert::insert_rejects_invalid_input,
            insert::insert_checks_text_by_the_shared_vectors,
            insert::insert_unique_key_race,
            insert::insert_many_batch_with_duplicates,
            insert::insert_many_without_keys_maps_each_id_to_its_input,
            insert::insert_many_is_all_or_nothing,
            insert::job_list_filters,
            claim::claim_race_exactly_once,
            claim::claim_orders_by_priority_run_at_id,
            claim::claim_skips_scheduled_jobs,
            claim::claim_sets_lease_and_stays_in_queue,
            claim::claim_respects_queue_concurrency,
            claim::claim_queue_concurrency_race,
            lifecycle::lease_expiry_rescue_fences_stale_worker,
            lifecycle::stale_attempt_of_same_worker_is_fenced,
            lifecycle::heartbeat_extends_lease,
            lifecycle::rescue_without_attempts_left_is_dead,
            lifecycle::retrying_not_claimable_before_run_at,
            lifecycle::retrying_refunds_attempt,
            lifecycle::release_at_shutdown,
            lifecycle::give_backs_never_exceed_max_attempts,
            lifecycle::rescue_of_an_unstarted_claim_gives_the_attempt_back,
            lifecycle::a_start_mark_is_fenced_and_implied_by_a_plan,
            lifecycle::plan_saved_once,
            lifecycle::error_history_is_bounded,
            lifecycle::cancel_only_waiting_jobs,
            lifecycle::prune_deletes_finished_past_retention,
            lifecycle::stats_and_drained,
            lifecycle::queue_overview_matches_queue_stats,
            lifecycle::wait_for_jobs_wakes_on_insert,
            dlq::dead_keeps_metadata,
            dlq::dead_redacts_payload,
            dlq::replay_resets_attempts_keeps_key,
            dlq::dead_jobs_filter_by_plugin_and_code,
            dlq::discard_plan_only_when_no_effect_happened,
            dlq::replay_refuses_effects_in_doubt_until_resolved,
            dlq::discard_plan_refused_once_any_try_reached,
            dlq::dead_on_arrival_keeps_the_payload_and_the_code,
            effects::effect_claim_then_already_succeeded,
            effects::effect_lease_blocks_until_expiry,
            effects::effect_fingerprint_conflict,
            effects::effect_claim_race,
            effects::effect_failure_allows_reclaim,
            effects::effect_child_in_transaction,
            effects::effect_child_fenced_out,
            effects::effect_child_existing_key,
            effects::effect_list_by_job,
            effects::effect_prune_keeps_recent_and_in_flight_rows,
            effects::effect_in_doubt_after_an_ambiguous_try,
            effects::effect_in_doubt_says_how_old_the_latest_try_is,
            effects::effects_to_reconcile_and_their_fenced_answers,
            effects::effect_claim_fenced_by_the_job_lease,
            effects::effect_reclaim_by_the_same_claim_is_the_same_claim,
            effects::children_finish_with_their_job_in_one_write,
            effects::effect_claim_finds_the_request_an_older_release_claimed,
            batch::batch_answers_each_write_in_order_some_fenced_out,
            batch::group_commit_buffer_lost_in_a_crash_writes_nothing,
            batch::lanes_answer_each_write_and_keep_each_jobs_order,
            batch::a_plan_and_its_claim_commit_together_some_fenced_out,
            batch::one_fresh_key_claimed_twice_in_one_batch_goes_to_one,
            batch::a_lost_success_leaves_the_key_in_doubt_for_the_next_attempt,
            statements::statement_commits_with_its_ledger_row,
            statements::statement_of_a_stale_claim_runs_nothing,
            statements::refused_statement_rolls_back_the_ledger_mark,
            statements::statement_parameters_are_checked_and_bound,
            statements::statement_the_database_cannot_run_is_permanent,
            statements::statement_past_its_timeout_is_rolled_back_and_retryable,
            statements::statement_commits_the_jobs_success_with_it,
            statements::statement_commits_without_a_job_success_fenced_out,
            statements::statement_refused_leaves_the_job_running,
            statements::statement_finishing_a_job_does_not_deadlock_with_a_heartbeat,
            model::job_state_machine_follows_the_model,
            sessions::session_lives_until_its_expiry_by_the_store_clock,
            sessions::session_revoked_is_not_live,
            sessions::session_needs_a_configured_token,
            sessions::session_input_is_checked,
            schedules::schedule_tick_moves_forward_only,
            schedules::schedule_tick_checks_its_input_before_writing,
            schedules::schedule_tick_race_enqueues_one_job,
            schedules::schedule_tick_never_comes_back_after_pruning,
            schedules::clock_now_is_the_store_clock,
            groups::groups_run_one_at_a_time_in_enqueue_order,
            groups::group_head_retrying_keeps_its_place_and_a_dead_one_lets_the_next_go,
            groups::group_head_rescued_keeps_its_place_and_a_cancelled_one_lets_the_next_go,
            groups::group_priority_orders_groups_not_the_jobs_inside,
            groups::group_replayed_job_waits_for_the_running_one,
            groups::group_is_checked_at_insert,
            groups::group_claim_race_never_runs_two_of_a_group,
            groups::group_jobs_behind_the_head_are_blocked_until_it_ends,
            groups::group_hot_backlog_stays_out_of_the_claim,
        );
    };
    (@cases $factory:expr; $($area:ident :: $case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                $crate::conformance::run($factory, $crate::conformance::$area::$case).await;
            }
        )*
    };
}
pub(crate) use conformance_suite;

/// A job for `plugin` on the `default` queue.
pub fn job(plugin: &str) -> NewJob {
    NewJob::new(plugin, format!(r#"{{"plugin":"{plugin}"}}"#).into_bytes())
}

/// A job with an idempotency key.
pub fn keyed(plugin: &str, key: &str) -> NewJob {
    NewJob {
        idempotency_key: Some(key.to_string()),
        ..job(plugin)
    }
}

/// Claim params for the `default` queue.
pub fn claim_params(worker: &str, limit: u32, lease: Duration) -> ClaimParams {
    ClaimParams {
        queue: "default".into(),
        worker: worker.into(),
        limit,
        lease,
        queue_concurrency: None,
        max_attempts: Default::default(),
    }
}

/// Claims exactly one job (panics otherwise) and records that its attempt
/// started, as a worker's first heartbeat after the plugin call began does:
/// a rescue of it charges the attempt.
pub async fn claim_one(store: &Arc<dyn Store>, worker: &str, lease: Duration) -> Job {
    let job = claim_one_unstarted(store, worker, lease).await;
    start(store, &job, lease).await;
    get(store, job.id).await
}

/// Claims exactly one job (panics otherwise) without starting it, as a
/// worker's claim ahead does: a rescue of it gives the attempt back.
pub async fn claim_one_unstarted(store: &Arc<dyn Store>, worker: &str, lease: Duration) -> Job {
    let mut jobs = store
        .job_claim(claim_params(worker, 1, lease))
        .await
        .unwrap();
    assert_eq!(jobs.len(), 1, "expected one claimable job");
    assert!(!jobs[0].started, "a claim is not a start");
    jobs.remove(0)
}

/// Records that a claimed job's attempt started (a heartbeat carrying the
/// start, its lease extended by `lease` from now).
pub async fn start(store: &Arc<dyn Store>, job: &Job, lease: Duration) {
    let change = JobChange::Heartbeat {
        lease,
        started: true,
    };
    assert_eq!(
        job_write(store, job.fence(), change).await.unwrap(),
        Fence::Applied,
        "the start of job {} is recorded",
        job.id
    );
}

/// A job of queue `holders` claimed by `worker`: effect keys are claimed
/// only by a worker that holds the job carrying them.
pub async fn hold(store: &Arc<dyn Store>, worker: &str) -> Job {
    store
        .job_insert(NewJob {
            queue: "holders".into(),
            ..job("holder")
        })
        .await
        .unwrap();
    let mut jobs = store
        .job_claim(ClaimParams {
            queue: "holders".into(),
            ..claim_params(worker, 1, LONG)
        })
        .await
        .unwrap();
    assert_eq!(jobs.len(), 1, "expected one holder job");
    jobs.remove(0)
}

/// Claim params for an effect key carried by `job`, claimed by the job's
/// lease owner at its attempt.
pub fn claim_by(job: &Job, key: &str, lease: Duration) -> EffectClaimParams {
    EffectClaimParams {
        key: key.into(),
        job_id: job.id,
        plugin: "send_invoice_email".into(),
        provider: "email".into(),
        fingerprint: "fp-1".into(),
        worker: job.lease_owner.clone().unwrap_or_default(),
        job_attempt: job.attempt,
        lease,
        older_key: None,
    }
}

/// Reads a job that must exist.
pub async fn get(store: &Arc<dyn Store>, id: JobId) -> Job {
    store.job_get(id).await.unwrap().expect("job exists")
}

/// A classified error record (`class`: retryable, permanent or ambiguous).
pub fn error(attempt: u32, class: &str, code: &str) -> ErrorRecord {
    let class = match class {
        "retryable" => ErrorClass::Retryable,
        "permanent" => ErrorClass::Permanent,
        "ambiguous" => ErrorClass::Ambiguous,
        other => panic!("no error class {other:?}"),
    };
    ErrorRecord {
        attempt,
        class,
        code: code.into(),
        message: format!("{code} happened"),
        at_ms: 0,
    }
}

/// A fence for the same job and attempt held by another worker.
pub fn other_worker(fence: &JobFence, worker: &str) -> JobFence {
    JobFence {
        worker: worker.into(),
        ..fence.clone()
    }
}

/// Long enough that no lease in a test runs out by accident.
pub const LONG: Duration = Duration::from_secs(600);
/// A lease meant to run out during the test (by moving the store's clock).
pub const SHORT: Duration = Duration::from_secs(30);
/// Move the store's clock this far for a [`SHORT`] lease to have run out.
pub const PAST_SHORT: Duration = Duration::from_secs(31);

/// Moves the store's clock forward (every fixture opens its store with an
/// adjustable clock): leases run out and delays pass without sleeping.
pub async fn advance(store: &Arc<dyn Store>, by: Duration) {
    store
        .clock_advance(by)
        .await
        .expect("the fixture's clock moves");
}

/// True when no job is runnable now, running or retrying (jobs a producer
/// scheduled for later do not count), from the queue statistics.
pub async fn drained(store: &Arc<dyn Store>) -> bool {
    let stats = store.queue_stats(None).await.unwrap();
    stats.ready == 0
        && stats.count(idem::store::JobState::Running) == 0
        && stats.count(idem::store::JobState::Retrying) == 0
}

/// A retry (or deferral) of a claimed job, as the worker records it.
#[derive(Debug, Clone)]
pub struct RetryParams {
    pub fence: JobFence,
    pub delay: Duration,
    pub error: Option<ErrorRecord>,
    pub refund_attempt: bool,
}

/// A dead-lettering of a claimed job.
#[derive(Debug, Clone)]
pub struct DeadParams {
    pub fence: JobFence,
    pub error: ErrorRecord,
    pub redact_payload: bool,
}

/// A lease extension.
#[derive(Debug, Clone)]
pub struct HeartbeatParams {
    pub fence: JobFence,
    pub lease: Duration,
}

async fn job_write(store: &Arc<dyn Store>, fence: JobFence, change: JobChange) -> Result<Fence> {
    match store.write(Write::Job { fence, change }).await? {
        Written::Job(fence) => Ok(fence),
        other => panic!("a job change answered {other:?}"),
    }
}

/// Finishes a job.
pub async fn succeed(store: &Arc<dyn Store>, fence: &JobFence) -> Result<Fence> {
    let change = JobChange::Succeed {
        plugin_hash: None,
        plan: None,
    };
    job_write(store, fence.clone(), change).await
}

/// Schedules a job's next attempt.
pub async fn retry(store: &Arc<dyn Store>, params: RetryParams) -> Result<Fence> {
    let change = JobChange::Retry {
        delay: params.delay,
        error: params.error,
        refund_attempt: params.refund_attempt,
        plugin_hash: None,
    };
    job_write(store, params.fence, change).await
}

/// Dead-letters a job.
pub async fn dead_letter(store: &Arc<dyn Store>, params: DeadParams) -> Result<Fence> {
    let change = JobChange::Dead {
        error: params.error,
        redact_payload: params.redact_payload,
        plugin_hash: None,
    };
    job_write(store, params.fence, change).await
}

/// Extends a job's lease.
pub async fn heartbeat(store: &Arc<dyn Store>, params: HeartbeatParams) -> Result<Fence> {
    let change = JobChange::Heartbeat {
        lease: params.lease,
        started: true,
    };
    job_write(store, params.fence, change).await
}

/// Commits a job change and returns whether it was applied.
pub async fn change(
    store: &Arc<dyn Store>,
    fence: &JobFence,
    change: JobChange,
) -> idem::store::Fence {
    match store
        .write(Write::Job {
            fence: fence.clone(),
            change,
        })
        .await
        .unwrap()
    {
        Written::Job(fence) => fence,
        other => panic!("a job change answered {other:?}"),
    }
}
