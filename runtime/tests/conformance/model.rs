//! A model-based test of the job state machine.
//!
//! Random interleavings of claims, heartbeats, plans, outcomes (succeed,
//! retry, deferral, dead), releases, lease expiries, rescues, replays and
//! cancels by several workers run against the store and, step by step,
//! against a reference model of the contract: a plain struct per job. After
//! every step each job's row is compared with the model and the invariants
//! are checked:
//! - a succeeded job never changes again, not even by a replay (which takes
//!   only dead jobs); nor does a cancelled one; a dead one changes only by a
//!   replay;
//! - at most one holder at a time, the one the model says: `lease_owner` is
//!   set exactly while the job runs, a claim never hands out a held job,
//!   and only the holder's fence (owner **and** attempt) is applied;
//! - attempts never exceed `max_attempts`;
//! - every write by a stale holder (or by a worker that never held the job,
//!   or with an attempt off by one) is `FencedOut` and leaves the row as it
//!   was, byte for byte; so does every step the model says leaves a job alone.
//!
//! Workers keep the fence of every claim they made and keep using them
//! after they lost the lease, as a worker whose execution stalls past its
//! lease does, also once it claimed the job again. Worker names are reused
//! across claims (the runtime makes each claim's owner unique), so a fence
//! that is stale only by its attempt must be told apart by the attempt.
//!
//! Sequences come from a `proptest` strategy drawn with a fixed seed, so
//! every backend runs the same ones and a failure is reproducible; a failing
//! sequence is shrunk (re-run on fresh jobs) before it is reported.
//!
//! # Time
//! The store's clock moves only by whole [`UNIT_MS`] steps
//! ([`Store::clock_advance`]), while every lease and retry delay ends half
//! a unit off the grid: real time passing during a sequence (well under
//! half a unit) can never decide whether a lease ran out or a delay passed,
//! so the model's clock is exact.
//!
//! # Ordering
//! Each job of a sequence has its own priority, so which jobs a claim with
//! a limit takes does not depend on `run_at` ties in the same millisecond.
//!
//! Every write is awaited before the next step, so the group commit cannot
//! reorder them; a batch holds at most one write per job, and writes to
//! distinct jobs commute whichever flush carries them.

use super::*;
use idem::store::{JobFilter, JobState};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::subsequence;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use std::collections::BTreeSet;

/// Sequences per fixture (override with `IDEM_MODEL_CASES` for a soak).
const CASES: u32 = 32;
/// The default seed (override with `IDEM_MODEL_SEED`).
const SEED: u64 = 0x1de5_7a7e;
/// Re-runs spent shrinking a failing sequence.
const SHRINK_RUNS: u32 = 150;
/// Workers taking part.
const WORKERS: usize = 3;
/// The step of the store's clock.
const UNIT_MS: i64 = 60_000;
/// Tolerance of the lengths read from one statement's two timestamps.
const SLACK_MS: i64 = 50;
/// Rescues take every expired lease of the store (earlier sequences' jobs
/// included; they are filtered out), so the limit never picks among them.
const RESCUE_LIMIT: u32 = 100_000;

/// A lease or delay of `units` and a half.
fn half_past(units: u8) -> i64 {
    i64::from(units) * UNIT_MS + UNIT_MS / 2
}

fn millis(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

fn worker_name(worker: usize) -> String {
    format!("w{worker}")
}

/// What a worker does with a job it (thinks it) holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    /// Extends the lease by `lease` units and a half; `started` marks the
    /// plugin call as begun.
    Heartbeat { lease: u8, started: bool },
    /// Stores an (empty) plan, which implies the start.
    SavePlan,
    /// Finishes the job.
    Succeed,
    /// A failure to try again (`refund`: a deferral, which gives the attempt
    /// back and records no error) after `delay` units and a half, or at once.
    /// On its last attempt the worker dead-letters a failure instead, as
    /// the runtime's outcome does: the store does not bound retries itself.
    Retry { delay: Option<u8>, refund: bool },
    /// A permanent failure.
    Dead,
    /// Gives the lease back at shutdown.
    Release,
}

/// One step of a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    /// `worker` claims up to `limit` jobs with a lease of `lease` units and
    /// a half, under an optional queue concurrency limit.
    Claim {
        worker: usize,
        limit: u32,
        lease: u8,
        concurrency: Option<u32>,
    },
    /// A worker (`by`) writes `action` for a job (`job`) with the fence of
    /// one of its claims of it: the last one (`age` 0) or an earlier one,
    /// whose execution may still be running (its attempt then moved by
    /// `skew`); or, when it never claimed the job, with the job's current
    /// attempt under its own name.
    Write {
        job: Target,
        by: By,
        action: Action,
        age: u8,
        skew: i8,
    },
    /// One `write_batch`, at most one write per job (indexed by job).
    Batch(Vec<Option<(By, Action)>>),
    /// The store's clock moves `units` forward.
    Advance { units: u8 },
    /// Expired leases are rescued.
    Rescue,
    /// An operator replays these jobs.
    Replay { jobs: Vec<usize> },
    /// An operator cancels a job.
    Cancel { job: usize },
}

/// Which job a write is for: sequences are drawn before they run, so most
/// writes name a running job, whichever it turns out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// This job.
    Job(usize),
    /// The running job of this rank (by job number, wrapping), or job 0
    /// when none runs.
    Running(usize),
    /// The job of the previous single write, or the first job of the
    /// previous claim that took one, whichever came later (job 0 at first).
    Last,
}

/// Which worker writes: sequences are drawn before they run, so most
/// writes name the job's holder, whoever it turns out to be, and the rest a
/// worker by number (most often one without the lease).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum By {
    /// The job's holder, or when none, the worker that claimed it last
    /// (whose fence is then stale), or worker 0 if nobody did.
    Holder,
    /// This worker.
    Worker(usize),
}

/// A job of a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Spec {
    max_attempts: u32,
    priority: i32,
}

/// A generated case: its jobs and its steps.
#[derive(Debug, Clone)]
struct Sequence {
    jobs: Vec<Spec>,
    ops: Vec<Op>,
}

impl std::fmt::Display for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "jobs: {:?}", self.jobs)?;
        for (step, op) in self.ops.iter().enumerate() {
            writeln!(f, "  {step:>3}: {op:?}")?;
        }
        Ok(())
    }
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => (0..=3u8, prop::bool::weighted(0.7))
            .prop_map(|(lease, started)| Action::Heartbeat { lease, started }),
        1 => Just(Action::SavePlan),
        3 => Just(Action::Succeed),
        4 => (proptest::option::of(0..=2u8), prop::bool::weighted(0.3))
            .prop_map(|(delay, refund)| Action::Retry { delay, refund }),
        1 => Just(Action::Dead),
        2 => Just(Action::Release),
    ]
}

/// One step, or a few that single steps would rarely chain: a run of
/// crashes (a claim ahead that is never started, its lease running out, a
/// rescue) long enough to reach [`MAX_UNSTARTED_RESCUES`]; a stall (a
/// worker claims and starts a job, its lease runs out, the job is rescued,
/// maybe claimed again by the same worker, and the stalled execution
/// writes its outcome anyway).
fn chunk(jobs: usize) -> impl Strategy<Value = Vec<Op>> {
    let worker = 0..WORKERS;
    // A claim of nothing returns early: rare.
    let limit = prop_oneof![1 => Just(0u32), 6 => 1..=3u32];
    let skew = prop_oneof![8 => Just(0i8), 1 => Just(-1i8), 1 => Just(1i8)];
    let age = prop_oneof![4 => Just(0u8), 1 => 1..=2u8];
    let crashes = usize::try_from(MAX_UNSTARTED_RESCUES).unwrap_or(10);
    let target = prop_oneof![
        3 => (0..jobs).prop_map(Target::Running),
        1 => (0..jobs).prop_map(Target::Job),
    ];
    let by = prop_oneof![4 => Just(By::Holder), 1 => (0..WORKERS).prop_map(By::Worker)];
    prop_oneof![
        8 => (worker.clone(), limit, 1..=3u8, proptest::option::of(1..=3u32)).prop_map(
            |(worker, limit, lease, concurrency)| {
                vec![Op::Claim { worker, limit, lease, concurrency }]
            }
        ),
        10 => (target.clone(), by.clone(), action(), age, skew.clone()).prop_map(
            |(job, by, action, age, skew)| vec![Op::Write { job, by, action, age, skew }]
        ),
        1 => vec(proptest::option::of((by, action())), jobs)
            .prop_map(|writes| vec![Op::Batch(writes)]),
        2 => (1..=4u8).prop_map(|units| vec![Op::Advance { units }]),
        2 => Just(vec![Op::Rescue]),
        2 => subsequence((0..jobs).collect::<Vec<_>>(), 1..=jobs)
            .prop_map(|jobs| vec![Op::Replay { jobs }]),
        1 => (0..jobs).prop_map(|job| vec![Op::Cancel { job }]),
        2 => (worker.clone(), action(), any::<bool>()).prop_map(|(worker, action, again)| {
            let claim = Op::Claim { worker, limit: 1, lease: 1, concurrency: None };
            let by = By::Worker(worker);
            let beat = Action::Heartbeat { lease: 0, started: true };
            let mut ops = vec![
                claim.clone(),
                Op::Write { job: Target::Last, by, action: beat, age: 0, skew: 0 },
                Op::Advance { units: 2 },
                Op::Rescue,
            ];
            // The same worker may claim the job again before its stalled
            // execution writes: only the attempt then tells the two apart.
            if again {
                ops.push(claim);
            }
            let age = u8::from(again);
            ops.push(Op::Write { job: Target::Last, by, action, age, skew: 0 });
            ops
        }),
        1 => (worker, prop_oneof![1 => Just(crashes), 2 => 1..crashes]).prop_map(
            |(worker, times)| {
                let round = [
                    Op::Claim { worker, limit: 1, lease: 1, concurrency: None },
                    Op::Advance { units: 2 },
                    Op::Rescue,
                ];
                round.iter().cycle().take(3 * times).cloned().collect()
            }
        ),
    ]
}

fn sequence() -> impl Strategy<Value = Sequence> {
    (2..=4usize)
        .prop_flat_map(|jobs| {
            (
                vec(1..=3u32, jobs),
                Just((0..i32::try_from(jobs).unwrap_or(4)).collect::<Vec<_>>()).prop_shuffle(),
                vec(chunk(jobs), 1..=40),
            )
        })
        .prop_map(|(max_attempts, priorities, chunks)| Sequence {
            jobs: max_attempts
                .into_iter()
                .zip(priorities)
                .map(|(max_attempts, priority)| Spec {
                    max_attempts,
                    priority,
                })
                .collect(),
            ops: chunks.into_iter().flatten().collect(),
        })
}

/// What the model knows of one job.
#[derive(Debug, Clone)]
struct ModelJob {
    id: JobId,
    priority: i32,
    max_attempts: u32,
    state: JobState,
    attempt: u32,
    /// The holding worker, at `attempt`, while running.
    holder: Option<usize>,
    /// The worker that claimed it last.
    last_holder: Option<usize>,
    /// Lease end and length, model ms, while running.
    lease_until: i64,
    lease_len: i64,
    /// When it may be claimed, model ms (waiting states).
    run_at: i64,
    /// The last retry's delay (to check `run_at`).
    delay: i64,
    started: bool,
    unstarted_rescues: u32,
    rescues: u32,
    interruptions: u32,
    errors: usize,
    last_error_code: Option<String>,
    failed: bool,
    deferred: bool,
    planned: bool,
    /// The row as it finished (succeeded, dead, cancelled): it may change
    /// again only by a replay of a dead job.
    frozen: Option<Job>,
}

/// The fields of a row the model predicts, compared as one value.
#[derive(Debug, Clone, PartialEq, Eq)]
struct View {
    state: JobState,
    attempt: u32,
    max_attempts: Option<u32>,
    priority: i32,
    lease_owner: Option<String>,
    leased: bool,
    started: bool,
    unstarted_rescues: u32,
    rescues: u32,
    interruptions: u32,
    errors: usize,
    last_error_code: Option<String>,
    failed: bool,
    deferred: bool,
    planned: bool,
    finished: bool,
}

impl View {
    fn of_row(row: &Job) -> View {
        View {
            state: row.state,
            attempt: row.attempt,
            max_attempts: row.max_attempts,
            priority: row.priority,
            lease_owner: row.lease_owner.clone(),
            leased: row.lease_until_ms.is_some(),
            started: row.started,
            unstarted_rescues: row.unstarted_rescues,
            rescues: row.rescues,
            interruptions: row.interruptions,
            errors: row.errors.len(),
            last_error_code: row.last_error_code.clone(),
            failed: row.first_failed_at_ms.is_some() && row.last_failed_at_ms.is_some(),
            deferred: row.deferred_since_ms.is_some(),
            planned: row.plan.is_some(),
            finished: row.finished_at_ms.is_some(),
        }
    }

    fn of_model(job: &ModelJob) -> View {
        View {
            state: job.state,
            attempt: job.attempt,
            max_attempts: Some(job.max_attempts),
            priority: job.priority,
            lease_owner: job.holder.map(worker_name),
            leased: job.state == JobState::Running,
            started: job.started,
            unstarted_rescues: job.unstarted_rescues,
            rescues: job.rescues,
            interruptions: job.interruptions,
            errors: job.errors.min(idem::store::ERROR_HISTORY),
            last_error_code: job.last_error_code.clone(),
            failed: job.failed,
            deferred: job.deferred,
            planned: job.planned,
            finished: matches!(
                job.state,
                JobState::Succeeded | JobState::Dead | JobState::Cancelled
            ),
        }
    }
}

/// Events the generator must reach for the run to mean something.
#[derive(Debug, Default, Clone)]
struct Coverage {
    steps: u64,
    applied: u64,
    /// Writes with a fence of an earlier claim (or a skewed one) by a
    /// worker that claimed the job before, fenced out.
    stale_fenced_out: u64,
    /// Writes by a worker that never claimed the job, fenced out.
    foreign_fenced_out: u64,
    /// Writes with an earlier claim's fence by the job's holder itself,
    /// fenced out by the attempt alone.
    stale_attempt_fenced_out: u64,
    claims: u64,
    concurrency_capped: u64,
    retry_on_last_attempt: u64,
    dead_lease_expired: u64,
    dead_rescued_unstarted: u64,
    rescued: u64,
    replayed: u64,
    succeeded: u64,
    cancelled: u64,
    batches: u64,
}

const RETRY_CODE: &str = "model_retryable";
const DEAD_CODE: &str = "model_permanent";

/// The reference model of one sequence.
struct Model {
    jobs: Vec<ModelJob>,
    /// Model ms since the sequence began.
    now: i64,
    /// Per worker and job, the attempts of the worker's claims of it, in
    /// order.
    fences: Vec<Vec<Vec<u32>>>,
}

impl Model {
    fn new(ids: &[JobId], specs: &[Spec]) -> Model {
        let jobs = ids
            .iter()
            .zip(specs)
            .map(|(id, spec)| ModelJob {
                id: *id,
                priority: spec.priority,
                max_attempts: spec.max_attempts,
                state: JobState::Available,
                attempt: 0,
                holder: None,
                last_holder: None,
                lease_until: 0,
                lease_len: 0,
                run_at: 0,
                delay: 0,
                // The column's default (rows older than it count as
                // started); only a claim clears it, and it means nothing
                // until then.
                started: true,
                unstarted_rescues: 0,
                rescues: 0,
                interruptions: 0,
                errors: 0,
                last_error_code: None,
                failed: false,
                deferred: false,
                planned: false,
                frozen: None,
            })
            .collect();
        Model {
            jobs,
            now: 0,
            fences: vec![vec![Vec::new(); specs.len()]; WORKERS],
        }
    }

    /// The job `target` names (`last`: see [`Target::Last`]).
    fn job(&self, target: Target, last: usize) -> usize {
        match target {
            Target::Job(job) => job,
            Target::Running(rank) => {
                let running: Vec<usize> = (0..self.jobs.len())
                    .filter(|&i| self.jobs[i].state == JobState::Running)
                    .collect();
                running
                    .get(rank % running.len().max(1))
                    .copied()
                    .unwrap_or(0)
            }
            Target::Last => last,
        }
    }

    /// The worker `by` names for a write of job `job`.
    fn worker(&self, job: usize, by: By) -> usize {
        let j = &self.jobs[job];
        match by {
            By::Holder => j.holder.or(j.last_holder).unwrap_or(0),
            By::Worker(worker) => worker,
        }
    }

    /// The fence `worker` writes job `job` with.
    fn fence(&self, worker: usize, job: usize, age: u8, skew: i8) -> JobFence {
        let held = &self.fences[worker][job];
        let back = usize::from(age).min(held.len().saturating_sub(1));
        let attempt = held
            .iter()
            .rev()
            .nth(back)
            .copied()
            .unwrap_or(self.jobs[job].attempt);
        JobFence {
            id: self.jobs[job].id,
            worker: worker_name(worker),
            attempt: attempt.saturating_add_signed(i32::from(skew)),
        }
    }

    /// The change a worker sends for `action` on the attempt it holds.
    fn change(&self, job: usize, attempt: u32, action: Action) -> JobChange {
        match action {
            Action::Heartbeat { lease, started } => JobChange::Heartbeat {
                lease: millis(half_past(lease)),
                started,
            },
            Action::SavePlan => JobChange::SavePlan {
                plan: "[]".into(),
                plugin_hash: "model-plugin".into(),
            },
            Action::Succeed => JobChange::Succeed {
                plugin_hash: None,
                plan: None,
            },
            Action::Retry { refund: false, .. } if attempt >= self.jobs[job].max_attempts => {
                JobChange::Dead {
                    error: error(attempt, "retryable", RETRY_CODE),
                    redact_payload: false,
                    plugin_hash: None,
                }
            }
            Action::Retry { delay, refund } => JobChange::Retry {
                delay: millis(delay.map_or(0, half_past)),
                error: (!refund).then(|| error(attempt, "retryable", RETRY_CODE)),
                refund_attempt: refund,
                plugin_hash: None,
            },
            Action::Dead => JobChange::Dead {
                error: error(attempt, "permanent", DEAD_CODE),
                redact_payload: false,
                plugin_hash: None,
            },
            Action::Release => JobChange::Release,
        }
    }

    /// Applies `change` written with `fence` by `worker`, when the fence
    /// holds: the job runs, held by this worker at this attempt.
    fn write(&mut self, job: usize, worker: usize, fence: &JobFence, change: &JobChange) -> Fence {
        let now = self.now;
        let j = &mut self.jobs[job];
        if j.state != JobState::Running || j.holder != Some(worker) || j.attempt != fence.attempt {
            return Fence::FencedOut;
        }
        match change {
            JobChange::Heartbeat { lease, started } => {
                j.lease_len = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
                j.lease_until = now + j.lease_len;
                j.started |= *started;
            }
            JobChange::SavePlan { .. } => {
                j.planned = true;
                j.started = true;
            }
            JobChange::Succeed { .. } => {
                j.state = JobState::Succeeded;
                j.holder = None;
            }
            JobChange::Retry {
                delay,
                error,
                refund_attempt,
                ..
            } => {
                j.state = JobState::Retrying;
                j.holder = None;
                j.delay = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
                j.run_at = now + j.delay;
                if *refund_attempt {
                    j.attempt = j.attempt.saturating_sub(1);
                }
                j.deferred = *refund_attempt;
                if let Some(error) = error {
                    j.errors += 1;
                    j.last_error_code = Some(error.code.clone());
                    j.failed = true;
                }
            }
            JobChange::Dead { error, .. } => {
                j.state = JobState::Dead;
                j.holder = None;
                j.errors += 1;
                j.last_error_code = Some(error.code.clone());
                j.failed = true;
            }
            JobChange::Release => {
                j.state = JobState::Available;
                j.holder = None;
                j.run_at = now;
                j.attempt = j.attempt.saturating_sub(1);
                j.interruptions += 1;
            }
            other => panic!("the model does not send {other:?}"),
        }
        Fence::Applied
    }

    /// The jobs a claim takes, in the order the store answers them.
    fn claim(
        &mut self,
        worker: usize,
        limit: u32,
        lease: u8,
        concurrency: Option<u32>,
    ) -> Vec<usize> {
        let running = self
            .jobs
            .iter()
            .filter(|j| j.state == JobState::Running)
            .count();
        let mut limit = usize::try_from(limit).unwrap_or(usize::MAX);
        if let Some(max) = concurrency {
            limit = limit.min(usize::try_from(max).unwrap_or(0).saturating_sub(running));
        }
        let mut due: Vec<usize> = (0..self.jobs.len())
            .filter(|&i| {
                let j = &self.jobs[i];
                matches!(j.state, JobState::Available | JobState::Retrying) && j.run_at <= self.now
            })
            .collect();
        due.sort_by_key(|&i| std::cmp::Reverse(self.jobs[i].priority));
        due.truncate(limit);
        for &i in &due {
            let j = &mut self.jobs[i];
            j.state = JobState::Running;
            j.attempt += 1;
            j.holder = Some(worker);
            j.last_holder = Some(worker);
            j.lease_len = half_past(lease);
            j.lease_until = self.now + j.lease_len;
            j.started = false;
            self.fences[worker][i].push(j.attempt);
        }
        due
    }

    /// The jobs a rescue takes back: running, lease ended.
    fn rescue(&mut self, seen: &mut Coverage) -> Vec<usize> {
        let now = self.now;
        let mut rescued = Vec::new();
        for (i, j) in self.jobs.iter_mut().enumerate() {
            if j.state != JobState::Running || j.lease_until >= now {
                continue;
            }
            rescued.push(i);
            j.rescues += 1;
            j.holder = None;
            let dead = if j.started {
                j.attempt >= j.max_attempts
            } else {
                j.unstarted_rescues + 1 >= MAX_UNSTARTED_RESCUES
            };
            let code = if j.started {
                "lease_expired"
            } else {
                "rescued_unstarted"
            };
            if !j.started {
                j.unstarted_rescues += 1;
            }
            if dead {
                j.state = JobState::Dead;
                j.errors += 1;
                j.last_error_code = Some(code.into());
                j.failed = true;
                if j.started {
                    seen.dead_lease_expired += 1;
                } else {
                    seen.dead_rescued_unstarted += 1;
                }
            } else {
                j.state = JobState::Available;
                j.run_at = now;
                if !j.started {
                    j.attempt = j.attempt.saturating_sub(1);
                }
            }
        }
        rescued
    }

    /// The jobs a replay brings back: the dead ones.
    fn replay(&mut self, jobs: &[usize]) -> Vec<usize> {
        let now = self.now;
        let mut replayed = Vec::new();
        for &i in jobs {
            let j = &mut self.jobs[i];
            if j.state != JobState::Dead {
                continue;
            }
            replayed.push(i);
            j.state = JobState::Available;
            j.attempt = 0;
            j.unstarted_rescues = 0;
            j.run_at = now;
            j.deferred = false;
            j.frozen = None;
        }
        replayed
    }

    /// Whether a cancel takes the job: only a waiting one.
    fn cancel(&mut self, job: usize) -> bool {
        let j = &mut self.jobs[job];
        let waiting = matches!(j.state, JobState::Available | JobState::Retrying);
        if waiting {
            j.state = JobState::Cancelled;
        }
        waiting
    }
}

/// Fails the sequence with a message (the caller adds the step).
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

/// One sequence against the store, checked after every step.
struct Run<'a> {
    store: &'a Arc<dyn Store>,
    queue: String,
    model: Model,
    /// The rows after the previous step, by job.
    rows: Vec<Job>,
    /// The job [`Target::Last`] names.
    last: usize,
}

impl Run<'_> {
    async fn rows(&self) -> std::result::Result<Vec<Job>, String> {
        let mut listed = self
            .store
            .job_list(JobFilter {
                queue: Some(self.queue.clone()),
                ..JobFilter::default()
            })
            .await
            .map_err(|e| format!("job_list: {e}"))?;
        listed.sort_by_key(|j| j.id);
        let ids: Vec<JobId> = listed.iter().map(|j| j.id).collect();
        let expected: Vec<JobId> = self.model.jobs.iter().map(|j| j.id).collect();
        ensure!(
            ids == expected,
            "the queue holds jobs {ids:?}, the model {expected:?}"
        );
        Ok(listed)
    }

    /// Reads every row and checks it against the model and the invariants;
    /// `touched` names the jobs the step may have changed.
    async fn check(&mut self, touched: &BTreeSet<usize>) -> std::result::Result<(), String> {
        let rows = self.rows().await?;
        for (i, (row, model)) in rows.iter().zip(&mut self.model.jobs).enumerate() {
            // The invariants, each on its own so its message names it.
            ensure!(
                row.max_attempts.is_some_and(|max| row.attempt <= max),
                "job {i}: attempt {} exceeds max_attempts {:?}",
                row.attempt,
                row.max_attempts
            );
            ensure!(
                (row.state == JobState::Running) == row.lease_owner.is_some()
                    && row.lease_owner.is_some() == row.lease_until_ms.is_some(),
                "job {i}: a lease owner ({:?}, until {:?}) while {:?}: exactly one holder while \
                 running, none otherwise",
                row.lease_owner,
                row.lease_until_ms,
                row.state
            );
            if let Some(frozen) = &model.frozen {
                ensure!(
                    row == frozen,
                    "job {i}: a finished ({:?}) job changed:\n  was {frozen:?}\n  now {row:?}",
                    frozen.state
                );
            }
            if !touched.contains(&i) {
                ensure!(
                    *row == self.rows[i],
                    "job {i}: changed by a step that leaves it alone (a fenced-out write \
                     or an op on other jobs):\n  was {:?}\n  now {row:?}",
                    self.rows[i]
                );
            }
            // The model, field by field.
            let (found, expected) = (View::of_row(row), View::of_model(model));
            ensure!(
                found == expected,
                "job {i}: the store and the model differ:\n  store {found:?}\n  model {expected:?}"
            );
            if let (Some(until), Some(beat)) = (row.lease_until_ms, row.heartbeat_at_ms) {
                let lease = until - beat;
                ensure!(
                    (lease - model.lease_len).abs() <= SLACK_MS,
                    "job {i}: a lease of {lease} ms from the last claim or heartbeat, the \
                     model's is {} ms",
                    model.lease_len
                );
            }
            if row.state == JobState::Retrying {
                let delay = row.run_at_ms - row.updated_at_ms;
                ensure!(
                    (delay - model.delay).abs() <= SLACK_MS,
                    "job {i}: retrying after {delay} ms, the model's delay is {} ms",
                    model.delay
                );
            }
            let finished = matches!(
                row.state,
                JobState::Succeeded | JobState::Dead | JobState::Cancelled
            );
            if finished && model.frozen.is_none() {
                model.frozen = Some(row.clone());
            }
        }
        self.rows = rows;
        Ok(())
    }

    /// Runs `(worker, job, action, age, skew)` writes as one batch and
    /// checks each answer.
    async fn writes(
        &mut self,
        planned: Vec<(usize, usize, Action, u8, i8)>,
        seen: &mut Coverage,
    ) -> std::result::Result<BTreeSet<usize>, String> {
        let mut writes = Vec::new();
        let mut expected = Vec::new();
        let mut touched = BTreeSet::new();
        for (worker, job, action, age, skew) in planned {
            let fence = self.model.fence(worker, job, age, skew);
            let change = self.model.change(job, fence.attempt, action);
            let held = !self.model.fences[worker][job].is_empty();
            let holder = self.model.jobs[job].holder == Some(worker);
            let answer = self.model.write(job, worker, &fence, &change);
            match answer {
                Fence::Applied => {
                    seen.applied += 1;
                    touched.insert(job);
                    match (action, &change) {
                        (Action::Succeed, _) => seen.succeeded += 1,
                        (Action::Retry { .. }, JobChange::Dead { .. }) => {
                            seen.retry_on_last_attempt += 1;
                        }
                        _ => {}
                    }
                }
                Fence::FencedOut if holder && skew == 0 => {
                    seen.stale_fenced_out += 1;
                    seen.stale_attempt_fenced_out += 1;
                }
                Fence::FencedOut if held => seen.stale_fenced_out += 1,
                Fence::FencedOut => seen.foreign_fenced_out += 1,
            }
            writes.push((worker, job, fence, change));
            expected.push(answer);
        }
        let batch: Vec<Write> = writes
            .iter()
            .map(|(_, _, fence, change)| Write::Job {
                fence: fence.clone(),
                change: change.clone(),
            })
            .collect();
        let found = self
            .store
            .write_batch(batch)
            .await
            .map_err(|e| format!("write_batch: {e}"))?;
        let expected: Vec<Written> = expected.into_iter().map(Written::Job).collect();
        for ((worker, job, fence, change), (found, expected)) in
            writes.iter().zip(found.iter().zip(&expected))
        {
            ensure!(
                found == expected,
                "job {job}: worker {worker}'s {change:?} with {fence:?} answered {found:?}, the \
                 model says {expected:?} (the model's job: {:?})",
                self.model.jobs[*job]
            );
        }
        ensure!(
            found.len() == expected.len(),
            "{} writes answered {} times",
            expected.len(),
            found.len()
        );
        Ok(touched)
    }

    async fn step(&mut self, op: &Op, seen: &mut Coverage) -> std::result::Result<(), String> {
        seen.steps += 1;
        let touched: BTreeSet<usize> = match op {
            Op::Claim {
                worker,
                limit,
                lease,
                concurrency,
            } => {
                let running = self
                    .model
                    .jobs
                    .iter()
                    .filter(|j| j.state == JobState::Running)
                    .count();
                if concurrency.is_some_and(|max| usize::try_from(max).unwrap_or(0) <= running) {
                    seen.concurrency_capped += 1;
                }
                let expected = self.model.claim(*worker, *limit, *lease, *concurrency);
                let claimed = self
                    .store
                    .job_claim(ClaimParams {
                        queue: self.queue.clone(),
                        worker: worker_name(*worker),
                        limit: *limit,
                        lease: millis(half_past(*lease)),
                        queue_concurrency: *concurrency,
                        max_attempts: Default::default(),
                    })
                    .await
                    .map_err(|e| format!("job_claim: {e}"))?;
                let found: Vec<JobId> = claimed.iter().map(|j| j.id).collect();
                let ids: Vec<JobId> = expected.iter().map(|&i| self.model.jobs[i].id).collect();
                ensure!(
                    found == ids,
                    "worker {worker} claimed {found:?}, the model says {ids:?}"
                );
                seen.claims += u64::try_from(found.len()).unwrap_or(0);
                if let Some(&first) = expected.first() {
                    self.last = first;
                }
                self.check(&expected.iter().copied().collect()).await?;
                for job in &claimed {
                    ensure!(
                        self.rows.iter().any(|row| row == job),
                        "a claim returned {job:?}, which is not the stored row"
                    );
                }
                return Ok(());
            }
            Op::Write {
                job,
                by,
                action,
                age,
                skew,
            } => {
                let job = self.model.job(*job, self.last);
                self.last = job;
                let worker = self.model.worker(job, *by);
                self.writes(vec![(worker, job, *action, *age, *skew)], seen)
                    .await?
            }
            Op::Batch(writes) => {
                seen.batches += 1;
                let writes = writes
                    .iter()
                    .enumerate()
                    .filter_map(|(job, write)| write.map(|w| (job, w)))
                    .map(|(job, (by, action))| (self.model.worker(job, by), job, action, 0, 0))
                    .collect();
                self.writes(writes, seen).await?
            }
            Op::Advance { units } => {
                self.model.now += i64::from(*units) * UNIT_MS;
                self.store
                    .clock_advance(millis(i64::from(*units) * UNIT_MS))
                    .await
                    .map_err(|e| format!("clock_advance: {e}"))?;
                BTreeSet::new()
            }
            Op::Rescue => {
                let expected = self.model.rescue(seen);
                seen.rescued += u64::try_from(expected.len()).unwrap_or(0);
                let ours: BTreeSet<JobId> = self.model.jobs.iter().map(|j| j.id).collect();
                let found: Vec<JobId> = self
                    .store
                    .job_rescue_expired(RESCUE_LIMIT)
                    .await
                    .map_err(|e| format!("job_rescue_expired: {e}"))?
                    .into_iter()
                    .filter(|id| ours.contains(id))
                    .collect();
                let mut ids: Vec<JobId> = expected.iter().map(|&i| self.model.jobs[i].id).collect();
                ids.sort_unstable();
                ensure!(found == ids, "rescued {found:?}, the model says {ids:?}");
                expected.into_iter().collect()
            }
            Op::Replay { jobs } => {
                let expected = self.model.replay(jobs);
                seen.replayed += u64::try_from(expected.len()).unwrap_or(0);
                let asked: Vec<JobId> = jobs.iter().map(|&i| self.model.jobs[i].id).collect();
                let replayed = self
                    .store
                    .job_replay(&asked)
                    .await
                    .map_err(|e| format!("job_replay: {e}"))?;
                let mut ids: Vec<JobId> = expected.iter().map(|&i| self.model.jobs[i].id).collect();
                ids.sort_unstable();
                ensure!(
                    replayed.replayed == ids && replayed.refused.is_empty(),
                    "replaying {asked:?} answered {replayed:?}, the model replays {ids:?}"
                );
                expected.into_iter().collect()
            }
            Op::Cancel { job } => {
                let expected = self.model.cancel(*job);
                let found = self
                    .store
                    .job_cancel(self.model.jobs[*job].id)
                    .await
                    .map_err(|e| format!("job_cancel: {e}"))?;
                ensure!(
                    found == expected,
                    "cancelling job {job} answered {found}, the model says {expected}"
                );
                if expected {
                    seen.cancelled += 1;
                    BTreeSet::from([*job])
                } else {
                    BTreeSet::new()
                }
            }
        };
        self.check(&touched).await
    }
}

/// Runs one sequence on fresh jobs of a queue of their own; a failure
/// names the step that failed (`None`: the insert).
async fn execute(
    store: &Arc<dyn Store>,
    sequence: &Sequence,
    queue: String,
    seen: &mut Coverage,
) -> std::result::Result<(), (Option<usize>, String)> {
    let mut ids = Vec::new();
    for spec in &sequence.jobs {
        let new = NewJob {
            queue: queue.clone(),
            priority: spec.priority,
            max_attempts: spec.max_attempts,
            ..job("model")
        };
        let enqueued = store
            .job_insert(new)
            .await
            .map_err(|e| (None, format!("job_insert: {e}")))?;
        ids.push(enqueued.id);
    }
    let mut run = Run {
        store,
        queue,
        model: Model::new(&ids, &sequence.jobs),
        rows: Vec::new(),
        last: 0,
    };
    run.rows = run.rows().await.map_err(|e| (None, e))?;
    run.check(&(0..ids.len()).collect())
        .await
        .map_err(|e| (None, format!("after the insert: {e}")))?;
    for (step, op) in sequence.ops.iter().enumerate() {
        run.step(op, seen)
            .await
            .map_err(|e| (Some(step), format!("step {step} ({op:?}): {e}")))?;
    }
    Ok(())
}

/// A setting from the environment, or its default.
fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(text) => text
            .parse()
            .unwrap_or_else(|_| panic!("{name}={text:?} is not a number")),
        Err(_) => default,
    }
}

/// The model test: [`CASES`] sequences drawn with a fixed seed, each run on
/// fresh jobs and checked after every step; a failing one is shrunk and
/// printed step by step.
pub async fn job_state_machine_follows_the_model(store: Arc<dyn Store>) {
    // proptest's value trees are not `Send`, so the drawing and shrinking
    // run on a blocking thread, which runs each sequence on this runtime
    // (whose workers keep driving the group commit's flusher meanwhile).
    let handle = tokio::runtime::Handle::current();
    let driver = tokio::task::spawn_blocking(move || drive(&store, &handle));
    if let Err(e) = driver.await {
        match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("the model test did not finish: {e}"),
        }
    }
}

fn drive(store: &Arc<dyn Store>, handle: &tokio::runtime::Handle) {
    let cases: u32 = setting("IDEM_MODEL_CASES", CASES);
    let seed: u64 = setting("IDEM_MODEL_SEED", SEED);
    let mut config = Config::with_cases(cases);
    config.failure_persistence = None;
    let mut runner = TestRunner::new_with_rng(
        config,
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed.to_le_bytes().repeat(4)),
    );
    let strategy = sequence();
    let began = std::time::Instant::now();
    let mut seen = Coverage::default();
    let mut queues = 0u32;
    let mut run = |sequence: &Sequence, seen: &mut Coverage| {
        queues += 1;
        handle.block_on(execute(store, sequence, format!("model-{queues}"), seen))
    };
    for case in 0..cases {
        let mut tree = strategy
            .new_tree(&mut runner)
            .expect("the strategy draws a sequence");
        let drawn = tree.current();
        let Err(failure) = run(&drawn, &mut seen) else {
            continue;
        };
        // Shrinking as proptest does: simplify while it still fails, step
        // back (complicate) when a simpler one passes.
        let mut smallest = (drawn, failure);
        let mut budget = SHRINK_RUNS;
        if tree.simplify() {
            while budget > 0 {
                budget -= 1;
                let candidate = tree.current();
                match run(&candidate, &mut Coverage::default()) {
                    Err(failure) => {
                        smallest = (candidate, failure);
                        if !tree.simplify() {
                            break;
                        }
                    }
                    Ok(()) => {
                        if !tree.complicate() {
                            break;
                        }
                    }
                }
            }
        }
        // The steps after the failing one play no part.
        let (mut sequence, (step, failure)) = smallest;
        sequence.ops.truncate(step.map_or(0, |step| step + 1));
        panic!(
            "{:?}: sequence {case} of seed {seed} breaks the model.\n{failure}\n\
             shrunk sequence (IDEM_MODEL_SEED={seed} draws it again):\n{sequence}",
            store.backend()
        );
    }
    println!(
        "{:?}: {cases} sequences, {} steps in {:?}: {seen:?}",
        store.backend(),
        seen.steps,
        began.elapsed()
    );
    // The generator must reach what the invariants are about; a change of
    // seed or weights that stops reaching one of these fails here.
    if cases >= CASES {
        for (event, count) in [
            ("claims", seen.claims),
            ("applied writes", seen.applied),
            ("stale fences fenced out", seen.stale_fenced_out),
            ("foreign fences fenced out", seen.foreign_fenced_out),
            (
                "stale attempts of the holder fenced out",
                seen.stale_attempt_fenced_out,
            ),
            (
                "claims capped by queue concurrency",
                seen.concurrency_capped,
            ),
            ("retries on the last attempt", seen.retry_on_last_attempt),
            ("rescues", seen.rescued),
            ("dead by lease_expired", seen.dead_lease_expired),
            ("dead by rescued_unstarted", seen.dead_rescued_unstarted),
            ("replays", seen.replayed),
            ("successes", seen.succeeded),
            ("cancels", seen.cancelled),
            ("batches", seen.batches),
        ] {
            assert!(count > 0, "no {event} in {cases} sequences: {seen:?}");
        }
    }
}
