//! Batched writes: many jobs finishing in one transaction, each answered on
//! its own; the group commit's buffer lost in a crash.

use super::*;
use idem::store::group_commit::{GroupCommit, GroupCommitSettings};
use idem::store::{
    EffectChange, EffectClaim, EffectFence, Fence, JobChange, JobState, StoreError, Write, Written,
};

pub async fn batch_answers_each_write_in_order_some_fenced_out(store: Arc<dyn Store>) {
    let ids: Vec<_> = store
        .job_insert_many((0..6).map(|_| job("batch")).collect())
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    let claimed = store.job_claim(claim_params("w", 6, LONG)).await.unwrap();
    assert_eq!(claimed.len(), 6);
    // Jobs 1 and 4 are written by a stale holder (another owner).
    let fence = |i: usize| {
        let f = claimed[i].fence();
        if i == 1 || i == 4 {
            other_worker(&f, "stale")
        } else {
            f
        }
    };
    let writes = vec![
        Write::Job {
            fence: fence(0),
            change: JobChange::Succeed {
                plugin_hash: Some("h0".into()),
                plan: Some("[]".into()),
            },
        },
        Write::Job {
            fence: fence(1),
            change: JobChange::Succeed {
                plugin_hash: None,
                plan: None,
            },
        },
        Write::Job {
            fence: fence(2),
            change: JobChange::Retry {
                delay: Duration::from_secs(60),
                error: Some(error(1, "retryable", "provider_timeout")),
                refund_attempt: false,
                plugin_hash: None,
            },
        },
        Write::EffectClaim(idem::store::EffectClaimParams {
            key: "batch:k".into(),
            job_id: claimed[3].id,
            plugin: "batch".into(),
            provider: "email".into(),
            fingerprint: "fp".into(),
            worker: "w".into(),
            job_attempt: claimed[3].attempt,
            lease: LONG,
            older_key: None,
        }),
        Write::Job {
            fence: fence(4),
            change: JobChange::Dead {
                error: error(1, "permanent", "x"),
                redact_payload: true,
                plugin_hash: None,
            },
        },
        Write::Job {
            fence: fence(5),
            change: JobChange::Release,
        },
        Write::Job {
            fence: fence(3),
            change: JobChange::SavePlan {
                plan: "[]".into(),
                plugin_hash: "h3".into(),
            },
        },
    ];
    let answers = store.write_batch(writes).await.unwrap();
    assert_eq!(answers.len(), 7);
    assert_eq!(answers[0], Written::Job(Fence::Applied));
    assert_eq!(answers[1], Written::Job(Fence::FencedOut));
    assert_eq!(answers[2], Written::Job(Fence::Applied));
    let claim_fence = match &answers[3] {
        Written::EffectClaim(EffectClaim::Claimed { fence }) => fence.clone(),
        other => panic!("expected a claim, got {other:?}"),
    };
    assert_eq!(claim_fence.attempt, 1);
    assert_eq!(answers[4], Written::Job(Fence::FencedOut));
    assert_eq!(answers[5], Written::Job(Fence::Applied));
    assert_eq!(answers[6], Written::Job(Fence::Applied));

    let states: Vec<JobState> = {
        let mut states = Vec::new();
        for id in &ids {
            states.push(get(&store, *id).await.state);
        }
        states
    };
    assert_eq!(
        states,
        [
            JobState::Succeeded,
            JobState::Running,
            JobState::Retrying,
            JobState::Running,
            JobState::Running,
            JobState::Available,
        ]
    );
    let done = get(&store, ids[0]).await;
    assert_eq!(done.plan.as_deref(), Some("[]"));
    assert_eq!(done.plugin_hash.as_deref(), Some("h0"));
    assert_eq!(
        get(&store, ids[4]).await.payload,
        claimed[4].payload,
        "a fenced-out dead-lettering redacts nothing"
    );

    // The same key twice in one batch: one claim wins, the other waits.
    let (holder_a, holder_b) = (hold(&store, "a").await, hold(&store, "b").await);
    let key_writes = |holder: &Job| {
        Write::EffectClaim(idem::store::EffectClaimParams {
            plugin: "batch".into(),
            fingerprint: "fp".into(),
            ..claim_by(holder, "batch:twice", LONG)
        })
    };
    let answers = store
        .write_batch(vec![key_writes(&holder_a), key_writes(&holder_b)])
        .await
        .unwrap();
    let claimed_by: Vec<bool> = answers
        .iter()
        .map(|a| matches!(a, Written::EffectClaim(EffectClaim::Claimed { .. })))
        .collect();
    assert_eq!(claimed_by, [true, false], "{answers:?}");
    assert!(matches!(
        answers[1],
        Written::EffectClaim(EffectClaim::LeasedByOther { .. })
    ));

    // Effect writes of one batch: one applied, one stale.
    let stale = EffectFence {
        worker: "someone-else".into(),
        ..claim_fence.clone()
    };
    let answers = store
        .write_batch(vec![
            Write::Effect {
                fence: stale,
                change: EffectChange::Succeed {
                    result_ref: Some("late".into()),
                },
            },
            Write::Effect {
                fence: claim_fence,
                change: EffectChange::Succeed {
                    result_ref: Some("ref".into()),
                },
            },
        ])
        .await
        .unwrap();
    assert_eq!(
        answers,
        [
            Written::Effect {
                fence: Fence::FencedOut,
                child: None
            },
            Written::Effect {
                fence: Fence::Applied,
                child: None
            },
        ]
    );
    let row = store.effect_get("batch:k").await.unwrap().unwrap();
    assert_eq!(row.result_ref.as_deref(), Some("ref"));

    // One invalid write refuses the batch before anything is written.
    let before = get(&store, ids[3]).await;
    let invalid = store
        .write_batch(vec![
            Write::Job {
                fence: claimed[3].fence(),
                change: JobChange::Release,
            },
            Write::Job {
                fence: other_worker(&claimed[3].fence(), ""),
                change: JobChange::Release,
            },
        ])
        .await
        .unwrap_err();
    assert!(matches!(invalid, StoreError::Invalid(_)), "{invalid:?}");
    assert_eq!(get(&store, ids[3]).await, before);
}

pub async fn group_commit_buffer_lost_in_a_crash_writes_nothing(store: Arc<dyn Store>) {
    store
        .job_insert_many((0..3).map(|_| job("crash")).collect())
        .await
        .unwrap();
    let claimed = store.job_claim(claim_params("w", 3, SHORT)).await.unwrap();
    // A writer that waits long for more writes: these three sit in its buffer.
    let grouped = GroupCommit::new(
        store.clone(),
        GroupCommitSettings {
            max_batch: 100,
            max_wait: Duration::from_secs(3600),
            lanes: 1,
        },
    );
    let pending: Vec<_> = claimed
        .iter()
        .map(|job| {
            let (grouped, fence) = (grouped.clone(), job.fence());
            tokio::spawn(async move {
                grouped
                    .write(Write::Job {
                        fence,
                        change: JobChange::Succeed {
                            plugin_hash: None,
                            plan: None,
                        },
                    })
                    .await
            })
        })
        .collect();
    // The writes queue (the flusher waits for more), then the process "dies".
    // A write that arrives after the crash is refused the same way.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    grouped.stop_now().await;
    for task in pending {
        let answer = task.await.unwrap();
        assert!(
            matches!(answer, Err(StoreError::WriterStopped)),
            "{answer:?}"
        );
    }
    for job in &claimed {
        assert_eq!(
            get(&store, job.id).await.state,
            JobState::Running,
            "nothing of the lost buffer was committed"
        );
    }
    // The leases run out and the jobs come back for another worker.
    advance(&store, PAST_SHORT).await;
    assert_eq!(store.job_rescue_expired(10).await.unwrap().len(), 3);
    let again = store.job_claim(claim_params("w2", 3, LONG)).await.unwrap();
    assert_eq!(again.len(), 3);
    // No start of theirs was recorded (no heartbeat came): the crashed
    // attempt is given back, the bound on such rescues still holds.
    assert!(
        again
            .iter()
            .all(|j| j.attempt == 1 && j.unstarted_rescues == 1)
    );
}

/// A bad write fails only itself (issue 22, item 2): the fixture makes
/// marking a job of plugin `explode` succeeded fail (a trigger raises, as
/// PostgreSQL refuses a NUL byte). Ten writes flushed as one batch, three
/// of them bad: each bad one gets its own error (not transient, so it is
/// not tried again in a loop), every other one is `Applied` and committed.
pub async fn a_bad_write_fails_only_itself(store: Arc<dyn Store>) {
    const JOBS: usize = 10;
    let plugins: Vec<&str> = (0..JOBS)
        .map(|i| if i % 3 == 1 { "explode" } else { "fine" })
        .collect();
    store
        .job_insert_many(plugins.iter().map(|p| job(p)).collect())
        .await
        .unwrap();
    let claimed = store
        .job_claim(claim_params("w", JOBS as u32, LONG))
        .await
        .unwrap();
    assert_eq!(claimed.len(), JOBS);
    let grouped = GroupCommit::new(
        store.clone(),
        GroupCommitSettings {
            max_batch: JOBS,
            // One batch: the flush waits until all ten are queued.
            max_wait: Duration::from_secs(3600),
            lanes: 1,
        },
    );
    let succeed_write = |fence| Write::Job {
        fence,
        change: JobChange::Succeed {
            plugin_hash: None,
            plan: None,
        },
    };
    let tasks: Vec<_> = claimed
        .iter()
        .map(|job| {
            let (grouped, write) = (grouped.clone(), succeed_write(job.fence()));
            tokio::spawn(async move { grouped.write(write).await })
        })
        .collect();
    for (job, task) in claimed.iter().zip(tasks) {
        let answer = task.await.unwrap();
        if job.plugin == "explode" {
            assert!(
                matches!(&answer, Err(StoreError::Batch(inner)) if matches!(**inner, StoreError::Database(_))),
                "job {}: {answer:?}",
                job.id
            );
            assert!(!answer.unwrap_err().is_transient());
            assert_eq!(get(&store, job.id).await.state, JobState::Running);
        } else {
            assert_eq!(
                answer.unwrap(),
                Written::Job(Fence::Applied),
                "job {}",
                job.id
            );
            assert_eq!(get(&store, job.id).await.state, JobState::Succeeded);
        }
    }
    assert_eq!(grouped.queued(), 0, "every write answered");

    // Writes that must commit together (one caller's `write_batch`) are
    // never separated by the split: a unit with a bad write fails whole,
    // alone; the unit next to it commits.
    store
        .job_insert_many(vec![job("fine"), job("explode")])
        .await
        .unwrap();
    let pair = store.job_claim(claim_params("w", 2, LONG)).await.unwrap();
    let (fine, bad) = match pair.as_slice() {
        [a, b] if a.plugin == "fine" => (a.clone(), b.clone()),
        [a, b] => (b.clone(), a.clone()),
        other => panic!("expected two jobs, got {other:?}"),
    };
    let grouped = GroupCommit::new(
        store.clone(),
        GroupCommitSettings {
            max_batch: 2,
            max_wait: Duration::from_secs(3600),
            lanes: 1,
        },
    );
    let unit = |writes: Vec<Write>| {
        let grouped = grouped.clone();
        tokio::spawn(async move { grouped.write_batch(writes).await })
    };
    let doomed = unit(vec![
        Write::EffectClaim(claim_by(&fine, "unit:k1", LONG)),
        succeed_write(bad.fence()),
    ]);
    let kept = unit(vec![Write::EffectClaim(claim_by(&fine, "unit:k2", LONG))]);
    let doomed = doomed.await.unwrap();
    assert!(
        matches!(&doomed, Err(StoreError::Batch(inner)) if matches!(**inner, StoreError::Database(_))),
        "{doomed:?}"
    );
    assert!(
        store.effect_get("unit:k1").await.unwrap().is_none(),
        "the unit's good write was not committed without its bad one"
    );
    assert_eq!(get(&store, bad.id).await.state, JobState::Running);
    assert!(matches!(
        kept.await.unwrap().unwrap().as_slice(),
        [Written::EffectClaim(EffectClaim::Claimed { .. })]
    ));
}

/// Writes spread over the group commit's lanes (two on PostgreSQL, one on
/// SQLite): each caller gets its own answer, stale holders are fenced out
/// whichever lane their write took, one job's writes (plan, then success,
/// queued together) land in the order they were made, and an effect's
/// claim and end (awaited one after the other) both apply.
pub async fn lanes_answer_each_write_and_keep_each_jobs_order(store: Arc<dyn Store>) {
    const JOBS: usize = 12;
    store
        .job_insert_many((0..JOBS).map(|_| job("lanes")).collect())
        .await
        .unwrap();
    let claimed = store
        .job_claim(claim_params("w", JOBS as u32, LONG))
        .await
        .unwrap();
    assert_eq!(claimed.len(), JOBS);
    let grouped = GroupCommit::new(
        store.clone(),
        GroupCommitSettings {
            lanes: 2,
            ..GroupCommitSettings::default()
        },
    );
    let expected_lanes = match store.backend() {
        idem::store::BackendKind::Postgres => 2,
        idem::store::BackendKind::Sqlite => 1,
    };
    assert_eq!(grouped.lanes(), expected_lanes);
    // Every third job is written by a stale holder.
    let stale = |i: usize| i % 3 == 1;
    let tasks: Vec<_> = claimed
        .iter()
        .enumerate()
        .map(|(i, held)| {
            let grouped = grouped.clone();
            let fence = if stale(i) {
                other_worker(&held.fence(), "stale")
            } else {
                held.fence()
            };
            tokio::spawn(async move {
                // Both queued before either is answered: in one lane they
                // commit in this order; were they split over two, the
                // success could commit first and fence the plan out.
                let answers = grouped
                    .write_batch(vec![
                        Write::Job {
                            fence: fence.clone(),
                            change: JobChange::SavePlan {
                                plan: format!("[{i}]"),
                                plugin_hash: "h".into(),
                            },
                        },
                        Write::Job {
                            fence,
                            change: JobChange::Succeed {
                                plugin_hash: None,
                                plan: None,
                            },
                        },
                    ])
                    .await
                    .unwrap();
                (answers[0].clone(), answers[1].clone())
            })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let (plan, done) = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("every lane answers")
            .unwrap();
        let want = if stale(i) {
            Fence::FencedOut
        } else {
            Fence::Applied
        };
        assert_eq!(
            (plan, done),
            (Written::Job(want), Written::Job(want)),
            "job {i}"
        );
        let row = get(&store, claimed[i].id).await;
        if stale(i) {
            assert_eq!(row.state, JobState::Running, "job {i}");
            assert_eq!(row.plan, None, "job {i}");
        } else {
            assert_eq!(row.state, JobState::Succeeded, "job {i}");
            assert_eq!(
                row.plan,
                Some(format!("[{i}]")),
                "job {i}: the plan, then the success"
            );
        }
    }
    // A key's claim and its finish, through whichever lanes they take.
    let holder = hold(&store, "k").await;
    let fence = match grouped
        .write(Write::EffectClaim(claim_by(&holder, "lanes:k", LONG)))
        .await
        .unwrap()
    {
        Written::EffectClaim(EffectClaim::Claimed { fence }) => fence,
        other => panic!("expected a claim, got {other:?}"),
    };
    let finished = grouped
        .write(Write::Effect {
            fence,
            change: EffectChange::Succeed {
                result_ref: Some("r".into()),
            },
        })
        .await
        .unwrap();
    assert_eq!(
        finished,
        Written::Effect {
            fence: Fence::Applied,
            child: None
        }
    );
    let row = store.effect_get("lanes:k").await.unwrap().unwrap();
    assert_eq!(row.result_ref.as_deref(), Some("r"));
}

fn save_plan(fence: idem::store::JobFence) -> Write {
    Write::Job {
        fence,
        change: JobChange::SavePlan {
            plan: "[]".into(),
            plugin_hash: "h".into(),
        },
    }
}

fn claimed_fence(written: &Written) -> EffectFence {
    match written {
        Written::EffectClaim(EffectClaim::Claimed { fence }) => fence.clone(),
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// The effect path's merged commits (issue 23): a fresh plan commits with
/// its first ledger claim, and the last effect's success with the job's
/// own, each pair in one transaction shared with other jobs' pairs by the
/// group commit. In one flush: two holders' plan-and-claim pairs commit; a
/// stale holder's pair changes nothing (its plan fenced out, its claim
/// refused as `JobLost`, no ledger row); then each held job's success and
/// its key's success commit together.
pub async fn a_plan_and_its_claim_commit_together_some_fenced_out(store: Arc<dyn Store>) {
    store
        .job_insert_many((0..3).map(|_| job("merged")).collect())
        .await
        .unwrap();
    let claimed = store.job_claim(claim_params("w", 3, LONG)).await.unwrap();
    assert_eq!(claimed.len(), 3);
    let grouped = GroupCommit::new(
        store.clone(),
        GroupCommitSettings {
            max_batch: 3,
            // One flush: it waits until all three pairs are queued.
            max_wait: Duration::from_secs(3600),
            lanes: 1,
        },
    );
    let stale = other_worker(&claimed[2].fence(), "stale");
    let pairs: Vec<Vec<Write>> = claimed
        .iter()
        .enumerate()
        .map(|(i, job)| {
            let mut claim = claim_by(job, &format!("merged:k{i}"), LONG);
            let fence = if i == 2 {
                claim.worker = "stale".into();
                stale.clone()
            } else {
                job.fence()
            };
            vec![save_plan(fence), Write::EffectClaim(claim)]
        })
        .collect();
    let tasks: Vec<_> = pairs
        .into_iter()
        .map(|pair| {
            let grouped = grouped.clone();
            tokio::spawn(async move { grouped.write_batch(pair).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap().unwrap());
    }
    let mut fences = Vec::new();
    for (i, answer) in answers.iter().enumerate().take(2) {
        assert_eq!(answer[0], Written::Job(Fence::Applied), "pair {i}");
        fences.push(claimed_fence(&answer[1]));
        assert!(get(&store, claimed[i].id).await.plan.is_some());
        let row = store
            .effect_get(&format!("merged:k{i}"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.status, idem::store::EffectStatus::Processing);
    }
    assert_eq!(
        answers[2],
        vec![
            Written::Job(Fence::FencedOut),
            Written::EffectClaim(EffectClaim::JobLost)
        ]
    );
    assert_eq!(get(&store, claimed[2].id).await.plan, None);
    assert!(store.effect_get("merged:k2").await.unwrap().is_none());

    // Each held job's success rides with its key's success, not awaited by
    // its caller; both commit (a writer that flushes at once).
    let grouped = GroupCommit::new(store.clone(), GroupCommitSettings::default());
    let (done, mut all_done) = tokio::sync::mpsc::unbounded_channel();
    for (i, fence) in fences.into_iter().enumerate() {
        let done = done.clone();
        grouped.write_all_then(
            vec![
                Write::Effect {
                    fence,
                    change: EffectChange::Succeed {
                        result_ref: Some(format!("ref{i}")),
                    },
                },
                Write::Job {
                    fence: claimed[i].fence(),
                    change: JobChange::Succeed {
                        plugin_hash: None,
                        plan: None,
                    },
                },
            ],
            move |answers| {
                let _ = done.send((i, answers));
            },
        );
    }
    drop(done);
    grouped.flushed().await;
    let mut seen = 0;
    while let Some((i, answers)) = all_done.recv().await {
        let answers = answers.unwrap();
        assert!(
            matches!(
                answers[0],
                Written::Effect {
                    fence: Fence::Applied,
                    ..
                }
            ),
            "{answers:?}"
        );
        assert_eq!(answers[1], Written::Job(Fence::Applied));
        assert_eq!(get(&store, claimed[i].id).await.state, JobState::Succeeded);
        let row = store
            .effect_get(&format!("merged:k{i}"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.status, idem::store::EffectStatus::Succeeded);
        assert_eq!(row.result_ref, Some(format!("ref{i}")));
        seen += 1;
    }
    assert_eq!(seen, 2);
}

/// Two jobs claim one fresh key in one statement set (a flush): one holds
/// it, the other learns the key is leased by another, never both claimed.
pub async fn one_fresh_key_claimed_twice_in_one_batch_goes_to_one(store: Arc<dyn Store>) {
    store
        .job_insert_many((0..2).map(|_| job("twice")).collect())
        .await
        .unwrap();
    let claimed = store.job_claim(claim_params("w", 2, LONG)).await.unwrap();
    assert_eq!(claimed.len(), 2);
    let answers = store
        .write_batch(vec![
            Write::EffectClaim(claim_by(&claimed[0], "twice:k", LONG)),
            Write::EffectClaim(claim_by(&claimed[1], "twice:k", LONG)),
        ])
        .await
        .unwrap();
    let holders: Vec<usize> = answers
        .iter()
        .enumerate()
        .filter(|(_, a)| matches!(a, Written::EffectClaim(EffectClaim::Claimed { .. })))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(holders, vec![0], "{answers:?}");
    assert!(
        matches!(
            answers[1],
            Written::EffectClaim(EffectClaim::LeasedByOther { .. })
        ),
        "{answers:?}"
    );
    let row = store.effect_get("twice:k").await.unwrap().unwrap();
    assert_eq!(row.job_id, claimed[0].id);
}

/// A job's success and its last key's success lost together in a crash
/// (the group commit's buffer, after the provider answered): neither is
/// committed, and the job's next attempt finds the key in doubt (it may
/// have reached the provider), never done and never free: sent again only
/// to a provider that dedupes, within its window.
pub async fn a_lost_success_leaves_the_key_in_doubt_for_the_next_attempt(store: Arc<dyn Store>) {
    store.job_insert(job("lost")).await.unwrap();
    let held = claim_one(&store, "w", SHORT).await;
    let fence = match store
        .write_batch(vec![
            save_plan(held.fence()),
            Write::EffectClaim(claim_by(&held, "lost:k", SHORT)),
        ])
        .await
        .unwrap()
        .as_slice()
    {
        [Written::Job(Fence::Applied), claim] => claimed_fence(claim),
        other => panic!("expected the plan and the claim, got {other:?}"),
    };
    let grouped = GroupCommit::new(
        store.clone(),
        GroupCommitSettings {
            max_batch: 100,
            max_wait: Duration::from_secs(3600),
            lanes: 1,
        },
    );
    let (answered, answer) = tokio::sync::oneshot::channel();
    grouped.write_all_then(
        vec![
            Write::Effect {
                fence,
                change: EffectChange::Succeed { result_ref: None },
            },
            Write::Job {
                fence: held.fence(),
                change: JobChange::Succeed {
                    plugin_hash: None,
                    plan: None,
                },
            },
        ],
        move |answers| {
            let _ = answered.send(answers);
        },
    );
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    grouped.stop_now().await;
    assert!(matches!(answer.await, Ok(Err(StoreError::WriterStopped))));
    assert_eq!(get(&store, held.id).await.state, JobState::Running);
    let row = store.effect_get("lost:k").await.unwrap().unwrap();
    assert_eq!(row.status, idem::store::EffectStatus::Processing);
    // The lease runs out; the next attempt re-runs the plan and claims the
    // key again: in doubt.
    advance(&store, PAST_SHORT).await;
    assert_eq!(store.job_rescue_expired(10).await.unwrap(), [held.id]);
    let again = claim_one(&store, "w2", LONG).await;
    assert_eq!(again.attempt, 2, "the lost attempt is charged (it started)");
    match store
        .effect_claim(claim_by(&again, "lost:k", LONG))
        .await
        .unwrap()
    {
        EffectClaim::InDoubt { .. } => {}
        other => panic!("expected the key in doubt, got {other:?}"),
    }
}
