//! The store's hot path, per job, on each backend: one claim statement for a
//! batch of jobs, then their successes as one group-committed batch of
//! fenced writes — what a busy worker does for jobs without effects. The
//! jobs are inserted outside the timed part.
//!
//! `store/effect_path` times a job with one provider effect the two ways:
//! `separate`, four awaited commits per job as before issue 23 (plan, ledger
//! claim, ledger success, job success), and `merged`, two (the plan with
//! the claim, the ledger success with the job's success), `batch` jobs at
//! once through the group commit; the provider call itself is left out.
//!
//! A second group finishes each job with one child job in the same write
//! (a plan made only of `jobs` effects: ledger row, child, success); a
//! third does the same through two group-commit lanes (PostgreSQL only:
//! SQLite has one writer). A last group times bulk enqueue, 1,000 jobs per
//! call, without keys (a plain insert) and with keys (checked against the
//! key index).
//!
//! Run: `cargo bench -p idem-tests --bench store` (PostgreSQL from
//! `DATABASE_URL`, default the local `test` database). Compare the
//! batch sizes: the per-job cost should fall as the batch grows.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idem::store::group_commit::{GroupCommit, GroupCommitSettings};
use idem::store::{ChildEffect, ClaimParams, JobChange, NewJob, Store, Write};
use idem_tests::Backend;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How each claimed job is finished.
#[derive(Debug, Clone, Copy)]
enum Finish {
    /// A success with an empty plan.
    Plain,
    /// A success that enqueues one child job (one write).
    WithChild,
}

fn claim_and_finish(c: &mut Criterion) {
    let both = [Backend::Sqlite, Backend::Postgres];
    bench_group(c, "store/claim_and_finish", Finish::Plain, &both, 1);
    bench_group(
        c,
        "store/claim_and_finish_with_a_child",
        Finish::WithChild,
        &both,
        1,
    );
    bench_group(
        c,
        "store/claim_and_finish_with_a_child_two_lanes",
        Finish::WithChild,
        &[Backend::Postgres],
        2,
    );
}

fn bench_group(c: &mut Criterion, name: &str, finish: Finish, backends: &[Backend], lanes: usize) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group(name);
    group.sample_size(20);
    for &backend in backends {
        let (inner, _guard) = runtime.block_on(idem_tests::store(backend));
        let settings = GroupCommitSettings {
            lanes,
            ..GroupCommitSettings::default()
        };
        let store: Arc<dyn Store> =
            runtime.block_on(async { GroupCommit::new(inner.clone(), settings) });
        for batch in [1u32, 10, 100] {
            group.throughput(Throughput::Elements(u64::from(batch)));
            let id = BenchmarkId::new(format!("{backend:?}"), batch);
            group.bench_with_input(id, &batch, |b, &batch| {
                b.iter_custom(|rounds| runtime.block_on(round_trips(&store, batch, rounds, finish)))
            });
        }
    }
    group.finish();
}

/// `rounds` times: insert `batch` jobs (untimed), claim them in one
/// statement and finish them in one batch (timed).
async fn round_trips(store: &Arc<dyn Store>, batch: u32, rounds: u64, finish: Finish) -> Duration {
    static CHILDREN: AtomicU64 = AtomicU64::new(0);
    let mut timed = Duration::ZERO;
    for _ in 0..rounds {
        let jobs = (0..batch)
            .map(|_| NewJob::new("noop", b"{}".to_vec()))
            .collect();
        store.job_insert_many(jobs).await.expect("enqueue");
        let started = Instant::now();
        let claimed = store
            .job_claim(ClaimParams {
                queue: "default".into(),
                worker: "bench".into(),
                limit: batch,
                lease: Duration::from_secs(30),
                queue_concurrency: None,
                max_attempts: Default::default(),
            })
            .await
            .expect("claim");
        assert_eq!(
            claimed.len(),
            batch as usize,
            "every inserted job is claimed"
        );
        let writes = claimed
            .iter()
            .map(|job| Write::Job {
                fence: job.fence(),
                change: match finish {
                    Finish::Plain => JobChange::Succeed {
                        plugin_hash: None,
                        plan: Some("[]".into()),
                    },
                    Finish::WithChild => {
                        let key =
                            format!("noop/child:{}", CHILDREN.fetch_add(1, Ordering::Relaxed));
                        JobChange::SucceedWithChildren {
                            plugin: "noop".into(),
                            plan: "[]".into(),
                            plugin_hash: "bench".into(),
                            children: vec![ChildEffect {
                                fingerprint: format!("fp-{key}"),
                                older_key: None,
                                child: NewJob {
                                    queue: "children".into(),
                                    idempotency_key: Some(key.clone()),
                                    ..NewJob::new("noop", b"{}".to_vec())
                                },
                                key,
                            }],
                        }
                    }
                },
            })
            .collect();
        store.write_batch(writes).await.expect("finish");
        timed += started.elapsed();
    }
    timed
}

/// Bulk enqueue of 1,000 jobs per call, without and with keys.
fn insert_many(c: &mut Criterion) {
    const JOBS: u64 = 1000;
    static KEYS: AtomicU64 = AtomicU64::new(0);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("store/insert_many");
    group.sample_size(20);
    group.throughput(Throughput::Elements(JOBS));
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let (store, _guard) = runtime.block_on(idem_tests::store(backend));
        for keyed in [false, true] {
            let id = BenchmarkId::new(
                format!("{backend:?}"),
                if keyed { "keyed" } else { "unkeyed" },
            );
            group.bench_function(id, |b| {
                b.iter_custom(|rounds| {
                    runtime.block_on(async {
                        let mut timed = Duration::ZERO;
                        for _ in 0..rounds {
                            let jobs = (0..JOBS)
                                .map(|_| NewJob {
                                    idempotency_key: keyed.then(|| {
                                        format!("bench:{}", KEYS.fetch_add(1, Ordering::Relaxed))
                                    }),
                                    ..NewJob::new("noop", b"{}".to_vec())
                                })
                                .collect();
                            let started = Instant::now();
                            store.job_insert_many(jobs).await.expect("enqueue");
                            timed += started.elapsed();
                        }
                        timed
                    })
                })
            });
        }
    }
    group.finish();
}

/// How a job with one provider effect writes its way through.
#[derive(Debug, Clone, Copy)]
enum EffectPath {
    /// Plan, claim, ledger success, job success: four awaited commits.
    Separate,
    /// Plan with claim, then ledger success with job success: two units.
    Merged,
}

fn effect_path(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("store/effect_path");
    group.sample_size(20);
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let (inner, _guard) = runtime.block_on(idem_tests::store(backend));
        let store: Arc<dyn Store> = runtime
            .block_on(async { GroupCommit::new(inner.clone(), GroupCommitSettings::default()) });
        for path in [EffectPath::Separate, EffectPath::Merged] {
            for batch in [1u32, 10, 100] {
                group.throughput(Throughput::Elements(u64::from(batch)));
                let id = BenchmarkId::new(format!("{backend:?}/{path:?}"), batch);
                group.bench_with_input(id, &batch, |b, &batch| {
                    b.iter_custom(|rounds| {
                        runtime.block_on(effect_round_trips(&store, batch, rounds, path))
                    })
                });
            }
        }
    }
    group.finish();
}

/// `rounds` times: insert and claim `batch` jobs (untimed), then each job,
/// concurrently, stores its plan, claims its key, marks it done and
/// succeeds (timed).
async fn effect_round_trips(
    store: &Arc<dyn Store>,
    batch: u32,
    rounds: u64,
    path: EffectPath,
) -> Duration {
    use idem::store::{EffectChange, EffectClaim, EffectClaimParams, Written};
    static KEYS: AtomicU64 = AtomicU64::new(0);
    let mut timed = Duration::ZERO;
    for _ in 0..rounds {
        let jobs = (0..batch)
            .map(|_| NewJob::new("noop", b"{}".to_vec()))
            .collect();
        store.job_insert_many(jobs).await.expect("enqueue");
        let claimed = store
            .job_claim(ClaimParams {
                queue: "default".into(),
                worker: "bench".into(),
                limit: batch,
                lease: Duration::from_secs(30),
                queue_concurrency: None,
                max_attempts: Default::default(),
            })
            .await
            .expect("claim");
        assert_eq!(claimed.len(), batch as usize);
        let started = Instant::now();
        let one_job = |job: idem::store::Job| {
            let store = store.clone();
            async move {
                let key = format!("noop/k{}", KEYS.fetch_add(1, Ordering::Relaxed));
                let plan = Write::Job {
                    fence: job.fence(),
                    change: JobChange::SavePlan {
                        plan: "[]".into(),
                        plugin_hash: "bench".into(),
                    },
                };
                let claim = Write::EffectClaim(EffectClaimParams {
                    key: key.clone(),
                    job_id: job.id,
                    plugin: "noop".into(),
                    provider: "bench_http".into(),
                    fingerprint: "fp".into(),
                    worker: "bench".into(),
                    job_attempt: job.attempt,
                    lease: Duration::from_secs(30),
                    older_key: None,
                });
                let fence = |written: &Written| match written {
                    Written::EffectClaim(EffectClaim::Claimed { fence }) => fence.clone(),
                    other => panic!("expected a claim, got {other:?}"),
                };
                let claimed = match path {
                    EffectPath::Separate => {
                        store.write(plan).await.expect("plan");
                        store.write(claim).await.expect("claim")
                    }
                    EffectPath::Merged => {
                        let mut answers = store.write_batch(vec![plan, claim]).await.expect("unit");
                        answers.pop().expect("the claim's answer")
                    }
                };
                let ledger = Write::Effect {
                    fence: fence(&claimed),
                    change: EffectChange::Succeed {
                        result_ref: Some("ref".into()),
                    },
                };
                let succeed = Write::Job {
                    fence: job.fence(),
                    change: JobChange::Succeed {
                        plugin_hash: None,
                        plan: None,
                    },
                };
                match path {
                    EffectPath::Separate => {
                        store.write(ledger).await.expect("ledger success");
                        store.write(succeed).await.expect("success");
                    }
                    EffectPath::Merged => {
                        store
                            .write_batch(vec![ledger, succeed])
                            .await
                            .expect("unit");
                    }
                }
            }
        };
        futures::future::join_all(claimed.into_iter().map(one_job)).await;
        timed += started.elapsed();
    }
    timed
}

criterion_group!(benches, claim_and_finish, effect_path, insert_many);
criterion_main!(benches);
