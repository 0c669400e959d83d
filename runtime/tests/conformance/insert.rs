//! Enqueue: fields, uniqueness under races, batches, listing.

use super::*;
use idem::store::{Enqueued, JobFilter, JobState, StoreError};
use std::collections::HashSet;

pub async fn insert_roundtrip(store: Arc<dyn Store>) {
    let new = NewJob {
        queue: "mail".into(),
        plugin: "send_invoice_email".into(),
        payload: br#"{"invoice_id":42}"#.to_vec(),
        idempotency_key: Some("invoice:42:email:v1".into()),
        priority: 7,
        delay: Duration::ZERO,
        max_attempts: 5,
        correlation_id: Some("corr-42".into()),
        group: None,
    };
    let enqueued = store.job_insert(new.clone()).await.unwrap();
    assert!(enqueued.inserted);
    let job = get(&store, enqueued.id).await;
    assert_eq!(job.id, enqueued.id);
    assert_eq!(job.queue, "mail");
    assert_eq!(job.plugin, "send_invoice_email");
    assert_eq!(job.payload, new.payload);
    assert_eq!(job.idempotency_key.as_deref(), Some("invoice:42:email:v1"));
    assert_eq!(job.priority, 7);
    assert_eq!(job.state, JobState::Available);
    assert_eq!(job.attempt, 0);
    assert_eq!(job.max_attempts, Some(5));
    assert_eq!(job.correlation_id, "corr-42");
    assert_eq!(job.lease_owner, None);
    assert_eq!(job.lease_until_ms, None);
    assert!(job.errors.is_empty());
    assert_eq!(job.plan, None);
    assert_eq!(job.rescues, 0);
    assert_eq!(job.finished_at_ms, None);
    assert!(job.created_at_ms > 1_600_000_000_000, "ms since the epoch");
    assert!(job.run_at_ms >= job.created_at_ms);
    assert!(job.run_at_ms - job.created_at_ms < 1_000);

    // A generated correlation id: 16 random bytes in hex.
    let other = store
        .job_insert(job_for_delay(Duration::from_secs(3600)))
        .await
        .unwrap();
    let other = get(&store, other.id).await;
    assert_eq!(other.correlation_id.len(), 32);
    assert!(other.correlation_id.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_ne!(other.correlation_id, job.correlation_id);
    // Scheduled an hour ahead, by the database clock.
    let ahead = other.run_at_ms - other.created_at_ms;
    assert!(
        (3_599_000..3_601_000).contains(&ahead),
        "run_at is now + delay, got +{ahead} ms"
    );
}

fn job_for_delay(delay: Duration) -> NewJob {
    NewJob {
        delay,
        ..job("noop")
    }
}

pub async fn insert_duplicate_key_returns_existing(store: Arc<dyn Store>) {
    let first = store
        .job_insert(keyed("a", "order:1:invoice"))
        .await
        .unwrap();
    assert!(first.inserted);
    let again = store
        .job_insert(NewJob {
            payload: b"different".to_vec(),
            ..keyed("a", "order:1:invoice")
        })
        .await
        .unwrap();
    assert_eq!(
        again,
        Enqueued {
            id: first.id,
            inserted: false
        }
    );
    assert_ne!(
        get(&store, first.id).await.payload,
        b"different",
        "the first job is kept"
    );

    // The key is unique per plugin only.
    let other_plugin = store
        .job_insert(keyed("b", "order:1:invoice"))
        .await
        .unwrap();
    assert!(other_plugin.inserted);
    assert_ne!(other_plugin.id, first.id);

    // Jobs without a key are never deduplicated.
    let x = store.job_insert(job("a")).await.unwrap();
    let y = store.job_insert(job("a")).await.unwrap();
    assert!(x.inserted && y.inserted);
    assert_ne!(x.id, y.id);

    // The key stays taken after the job finished.
    let claimed = claim_one(&store, "w", LONG).await;
    assert_eq!(claimed.id, first.id);
    succeed(&store, &claimed.fence()).await.unwrap();
    let after = store
        .job_insert(keyed("a", "order:1:invoice"))
        .await
        .unwrap();
    assert_eq!(
        after,
        Enqueued {
            id: first.id,
            inserted: false
        }
    );
}

pub async fn insert_rejects_invalid_input(store: Arc<dyn Store>) {
    let cases = [
        NewJob {
            plugin: String::new(),
            ..job("x")
        },
        NewJob {
            queue: String::new(),
            ..job("x")
        },
        NewJob {
            max_attempts: 0,
            ..job("x")
        },
        NewJob {
            payload: vec![b' '; idem::store::MAX_PAYLOAD_BYTES + 1],
            ..job("x")
        },
        keyed("x", ""),
        keyed("x", &"k".repeat(256)),
        keyed("x", "line\nbreak"),
        keyed("x", "caf\u{e9}"),
    ];
    for case in cases {
        let err = store.job_insert(case.clone()).await.unwrap_err();
        assert!(
            matches!(err, StoreError::Invalid(_)),
            "{case:?} gave {err:?}"
        );
        assert!(!err.is_transient());
    }
    // A bad job anywhere in a batch rejects the batch.
    let err = store
        .job_insert_many(vec![job("x"), keyed("x", "")])
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)));
    assert!(
        store
            .job_list(JobFilter::default())
            .await
            .unwrap()
            .is_empty()
    );
}

pub async fn insert_unique_key_race(store: Arc<dyn Store>) {
    for round in 0..5 {
        let key = format!("race:{round}");
        let barrier = Arc::new(tokio::sync::Barrier::new(8));
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let store = store.clone();
                let barrier = barrier.clone();
                let key = key.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    store.job_insert(keyed("race", &key)).await.unwrap()
                })
            })
            .collect();
        let results: Vec<Enqueued> = futures::future::join_all(tasks)
            .await
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(
            results.iter().filter(|e| e.inserted).count(),
            1,
            "{results:?}"
        );
        assert!(results.iter().all(|e| e.id == results[0].id), "{results:?}");
    }
    let all = store
        .job_list(JobFilter {
            plugin: Some("race".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), 5);
}

/// A batch without keys (the plain insert, chunk after chunk): every id
/// comes back in input order and holds its own input, and none repeats.
pub async fn insert_many_without_keys_maps_each_id_to_its_input(store: Arc<dyn Store>) {
    let inputs: Vec<NewJob> = (0..2_500)
        .map(|i| NewJob {
            payload: format!("unkeyed {i}").into_bytes(),
            priority: i % 5,
            ..job("unkeyed")
        })
        .collect();
    let results = store.job_insert_many(inputs.clone()).await.unwrap();
    assert_eq!(results.len(), inputs.len());
    let mut ids = HashSet::new();
    for (input, result) in inputs.iter().zip(&results) {
        assert!(result.inserted);
        assert!(ids.insert(result.id), "id {} twice", result.id);
        let stored = get(&store, result.id).await;
        assert_eq!(stored.payload, input.payload, "job {}", result.id);
        assert_eq!(stored.priority, input.priority, "job {}", result.id);
        assert_eq!(stored.idempotency_key, None);
    }
}

pub async fn insert_many_batch_with_duplicates(store: Arc<dyn Store>) {
    assert!(store.job_insert_many(Vec::new()).await.unwrap().is_empty());
    let existing = store.job_insert(keyed("batch", "k:7")).await.unwrap();

    // 5,000 inputs: every third keyed, keys repeating within the batch, one
    // key already in the store.
    let inputs: Vec<NewJob> = (0..5_000)
        .map(|i| {
            let base = NewJob {
                payload: format!("{i}").into_bytes(),
                priority: i % 3,
                ..job("batch")
            };
            if i % 3 == 0 {
                NewJob {
                    idempotency_key: Some(format!("k:{}", i % 1_000)),
                    ..base
                }
            } else {
                base
            }
        })
        .collect();
    let results = store.job_insert_many(inputs.clone()).await.unwrap();
    assert_eq!(results.len(), inputs.len());

    let mut first_by_key = std::collections::HashMap::new();
    let mut ids = HashSet::new();
    for (i, (input, result)) in inputs.iter().zip(&results).enumerate() {
        match &input.idempotency_key {
            Some(key) if key == "k:7" => {
                assert_eq!(
                    *result,
                    Enqueued {
                        id: existing.id,
                        inserted: false
                    },
                    "input {i}"
                )
            }
            Some(key) => match first_by_key.get(key) {
                None => {
                    assert!(result.inserted, "first use of {key} at {i}");
                    first_by_key.insert(key.clone(), result.id);
                    assert!(ids.insert(result.id));
                }
                Some(id) => assert_eq!(
                    *result,
                    Enqueued {
                        id: *id,
                        inserted: false
                    },
                    "input {i}"
                ),
            },
            None => {
                assert!(result.inserted);
                assert!(ids.insert(result.id), "id {} twice", result.id);
            }
        }
    }
    // 3,333 unkeyed + 1,000 distinct keys, of which one existed.
    let unkeyed = inputs
        .iter()
        .filter(|j| j.idempotency_key.is_none())
        .count();
    assert_eq!(ids.len(), unkeyed + 999);
    let stored = store
        .job_list(JobFilter {
            plugin: Some("batch".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(stored.len(), unkeyed + 1_000);

    // Results are in input order: each id holds its input's payload.
    for i in [1usize, 2, 3, 4_997, 4_998, 4_999] {
        let job = get(&store, results[i].id).await;
        if inputs[i].idempotency_key.as_deref() != Some("k:7") {
            let first = inputs
                .iter()
                .position(|j| {
                    j.idempotency_key.is_some() && j.idempotency_key == inputs[i].idempotency_key
                })
                .unwrap_or(i);
            assert_eq!(job.payload, inputs[first].payload, "input {i}");
        }
    }
}

pub async fn insert_many_is_all_or_nothing(store: Arc<dyn Store>) {
    let results = store
        .job_insert_many(vec![
            keyed("p", "a"),
            job("p"),
            keyed("p", "a"),
            keyed("q", "a"),
        ])
        .await
        .unwrap();
    assert!(results[0].inserted && results[1].inserted && results[3].inserted);
    assert_eq!(
        results[2],
        Enqueued {
            id: results[0].id,
            inserted: false
        }
    );
    assert_ne!(results[3].id, results[0].id);
    let before = store.job_list(JobFilter::default()).await.unwrap().len();
    assert_eq!(before, 3);
    // An invalid job rejects the whole batch before anything is written.
    let err = store
        .job_insert_many(vec![
            job("p"),
            NewJob {
                max_attempts: 0,
                ..job("p")
            },
        ])
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)));
    assert_eq!(
        store.job_list(JobFilter::default()).await.unwrap().len(),
        before
    );
}

pub async fn job_list_filters(store: Arc<dyn Store>) {
    let a = store.job_insert(job("alpha")).await.unwrap().id;
    let b = store.job_insert(job("beta")).await.unwrap().id;
    let c = store.job_insert(job("alpha")).await.unwrap().id;
    let running = claim_one(&store, "w", LONG).await;
    assert_eq!(running.id, a);

    let all = store.job_list(JobFilter::default()).await.unwrap();
    assert_eq!(
        all.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![c, b, a],
        "newest first"
    );

    let alpha = store
        .job_list(JobFilter {
            plugin: Some("alpha".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(alpha.iter().map(|j| j.id).collect::<Vec<_>>(), vec![c, a]);

    let available = store
        .job_list(JobFilter {
            states: vec![JobState::Available],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        available.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![c, b]
    );

    let some = store
        .job_list(JobFilter {
            ids: vec![a, c],
            states: vec![JobState::Running],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(some.iter().map(|j| j.id).collect::<Vec<_>>(), vec![a]);

    let limited = store
        .job_list(JobFilter {
            limit: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(limited.iter().map(|j| j.id).collect::<Vec<_>>(), vec![c, b]);

    assert!(store.job_get(JobId(i64::MAX)).await.unwrap().is_none());
}

/// Issue 22, item 2: an enqueue checks queue and plugin names, correlation
/// ids and keys by the boundary's rules, read from the shared vectors
/// (`tests/vectors/strings.json`): what the rule accepts is stored as it
/// is, what it refuses is an invalid input and stores nothing.
pub async fn insert_checks_text_by_the_shared_vectors(store: Arc<dyn Store>) {
    use idem::boundary::vectors::{self, Expected};
    type Make = fn(String) -> NewJob;
    let fields: [(&str, Make); 4] = [
        ("name", |v| NewJob {
            queue: v,
            ..job("x")
        }),
        ("name", |v| NewJob::new(v, b"{}".to_vec())),
        ("correlation_id", |v| NewJob {
            correlation_id: Some(v),
            ..job("x")
        }),
        ("idempotency_key", |v| keyed("x", &v)),
    ];
    let mut stored = 0;
    for (field, make) in fields {
        for case in vectors::of(field) {
            let new = make(case.input.clone());
            let got = store.job_insert(new).await;
            match case.expected {
                Expected::Accepted => {
                    let id = got
                        .unwrap_or_else(|e| panic!("{field} {}: {e:?}", case.note))
                        .id;
                    let job = get(&store, id).await;
                    let kept = match field {
                        "correlation_id" => job.correlation_id,
                        "idempotency_key" => job.idempotency_key.unwrap_or_default(),
                        _ if job.queue == case.input => job.queue,
                        _ => job.plugin,
                    };
                    assert_eq!(kept, case.input, "{field} {}", case.note);
                    stored += 1;
                }
                Expected::Refused => {
                    let err = got.expect_err(&case.note);
                    assert!(matches!(err, StoreError::Invalid(_)), "{err:?}");
                    assert!(!err.to_string().contains('\0'), "the error prints safely");
                }
                Expected::Cleaned(_) => panic!("{field} is never cleaned"),
            }
        }
    }
    let all = store
        .job_list(JobFilter {
            limit: 1000,
            ..JobFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), stored, "refused inputs stored nothing");
}
