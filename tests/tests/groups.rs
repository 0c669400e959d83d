//! One at a time per entity, end to end on both backends: 50 orders × 20
//! events, each event numbered within its order and enqueued in that order,
//! the orders interleaved at random, each event a job of its order's group.
//! Three workers (each running four jobs at once and claiming ahead) drain
//! them; a provider that every job calls sees each order's events strictly
//! one at a time and in their enqueue order.

use idem::providers::{ProviderConfig, Providers};
use idem::queue::Worker;
use idem::store::{JobState, NewJob};
use idem_tests::{Backend, Harness, both_backends};
use rand::seq::IndexedRandom;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const ORDERS: u64 = 50;
const EVENTS: u64 = 20;

/// What the provider saw.
#[derive(Default)]
struct Seen {
    /// Order -> the event being handled now.
    in_flight: HashMap<u64, u64>,
    /// Order -> events handled, in arrival order.
    handled: HashMap<u64, Vec<u64>>,
    /// Every overlap or out-of-order arrival, described.
    violations: Vec<String>,
}

/// The `bench_http` provider: `POST /bench/events {"i": order * 100 + event}`,
/// held a little so that two jobs of one order running at once would meet.
async fn start_provider(seen: Arc<Mutex<Seen>>) -> String {
    let app = axum::Router::new().route(
        "/bench/events",
        axum::routing::post(move |body: axum::Json<serde_json::Value>| {
            let seen = seen.clone();
            async move {
                let i = body["i"].as_u64().unwrap_or(u64::MAX);
                let (order, event) = (i / 100, i % 100);
                {
                    let mut seen = seen.lock().expect("lock");
                    if let Some(other) = seen.in_flight.insert(order, event) {
                        seen.violations
                            .push(format!("order {order}: event {event} while {other} runs"));
                    }
                    let expected = seen.handled.get(&order).map_or(0, |h| h.len() as u64);
                    if event != expected {
                        seen.violations
                            .push(format!("order {order}: event {event}, expected {expected}"));
                    }
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                let mut seen = seen.lock().expect("lock");
                seen.in_flight.remove(&order);
                seen.handled.entry(order).or_default().push(event);
                axum::Json(serde_json::json!({"ok": true}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    format!("http://{addr}")
}

fn providers(base_url: &str) -> Providers {
    let config: ProviderConfig = toml::from_str(&format!(
        "kind = \"http\"\nbase_url = \"{base_url}\"\ntimeout = \"10s\"\nconcurrency = 64\n\
         breaker_failures = 1000000\n"
    ))
    .expect("provider config");
    Providers::from_config(&BTreeMap::from([("bench_http".to_string(), config)]))
        .expect("providers")
}

/// The events in enqueue order: each order's numbered 0.., the orders
/// interleaved at random.
fn interleaved() -> Vec<(u64, u64)> {
    let mut next: Vec<u64> = vec![0; ORDERS as usize];
    let mut out = Vec::new();
    let mut rng = rand::rng();
    loop {
        let open: Vec<u64> = (0..ORDERS).filter(|o| next[*o as usize] < EVENTS).collect();
        let Some(&order) = open.choose(&mut rng) else {
            return out;
        };
        out.push((order, next[order as usize]));
        next[order as usize] += 1;
    }
}

async fn each_orders_events_run_one_at_a_time_in_order(backend: Backend) {
    let h = Harness::new(backend).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let base_url = start_provider(seen.clone()).await;
    let events = interleaved();
    assert_eq!(events.len() as u64, ORDERS * EVENTS);
    // Enqueued in several transactions, in event order.
    for chunk in events.chunks(137) {
        let jobs = chunk
            .iter()
            .map(|(order, event)| NewJob {
                group: Some(format!("order:{order}")),
                ..NewJob::new(
                    "bench_http",
                    format!(r#"{{"i":{}}}"#, order * 100 + event).into_bytes(),
                )
            })
            .collect();
        h.store.job_insert_many(jobs).await.expect("enqueue");
    }
    let workers: Vec<_> = (0..3)
        .map(|w| {
            let worker = Worker::new(
                h.store.clone(),
                h.registry.clone(),
                providers(&base_url),
                h.settings(&format!("worker-{w}")),
            );
            tokio::spawn(async move {
                tokio::time::timeout(
                    Duration::from_secs(120),
                    worker.run(tokio_util::sync::CancellationToken::new()),
                )
                .await
                .expect("the workers drain within 120 s")
                .expect("worker")
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("worker task");
    }
    let stats = h.store.queue_stats(None).await.expect("stats");
    assert_eq!(
        stats.count(JobState::Succeeded),
        (ORDERS * EVENTS) as i64,
        "every event's job succeeded"
    );
    let seen = seen.lock().expect("lock");
    assert!(
        seen.violations.is_empty(),
        "{} violations, first: {:?}",
        seen.violations.len(),
        seen.violations.iter().take(5).collect::<Vec<_>>()
    );
    for order in 0..ORDERS {
        assert_eq!(
            seen.handled.get(&order).cloned().unwrap_or_default(),
            (0..EVENTS).collect::<Vec<_>>(),
            "order {order}'s events, once each, in order"
        );
    }
}

both_backends!(each_orders_events_run_one_at_a_time_in_order);
