//! End-to-end throughput on each backend: a batch enqueue, then one worker
//! draining it (claim → fresh sandbox instance → effects → fenced finish).
//!
//! Run: `cargo bench -p idem-tests --bench queue` (set `IDEM_BENCH_JOBS` to
//! change the job count). Prints one line per case; compare ratios within one run.

use idem::store::NewJob;
use idem_tests::{Backend, Harness};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // cargo-nextest lists a target without the test harness with `--list
    // --format terse` (and again with `--ignored`), then runs each listed
    // test as `NAME --exact ..`: one test, `quick`, the run below without
    // `--bench`. Without this `cargo nextest run --all-targets` stops at
    // listing (docs/first-run.md, 2026-12-08).
    if args.iter().any(|a| a == "--list") {
        if !args.iter().any(|a| a == "--ignored") {
            println!("quick: test");
        }
        return;
    }
    // `cargo test --all-targets` and nextest run benches with `--bench`-less
    // args: keep it quick.
    let quick = !args.iter().any(|a| a == "--bench");
    let jobs: usize = std::env::var("IDEM_BENCH_JOBS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(if quick { 50 } else { 5_000 });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "{:<10} {:<22} {:>7} {:>12} {:>12} {:>10}",
        "backend", "case", "jobs", "enqueue/s", "drain/s", "µs/job"
    );
    for backend in [Backend::Sqlite, Backend::Postgres] {
        for (case, plugin, effects) in [
            ("noop (no effects)", "noop", false),
            ("invoice email effect", "send_invoice_email", true),
        ] {
            let n = if effects { jobs / 5 } else { jobs };
            runtime.block_on(async {
                let h = Harness::new(backend).await;
                let batch: Vec<NewJob> = (0..n)
                    .map(|i| {
                        let payload = if effects {
                            format!(r#"{{"invoice_id": {i}, "recipient": "c{i}@example.com"}}"#)
                        } else {
                            "{}".to_string()
                        };
                        NewJob::new(plugin, payload.into_bytes())
                    })
                    .collect();
                let started = Instant::now();
                for chunk in batch.chunks(1000) {
                    h.store
                        .job_insert_many(chunk.to_vec())
                        .await
                        .expect("enqueue");
                }
                let enqueue = started.elapsed();
                let mut settings = h.settings("bench");
                settings.queues = std::collections::BTreeMap::from([("default".to_string(), 16)]);
                let worker = idem::queue::Worker::new(
                    h.store.clone(),
                    h.registry.clone(),
                    h.providers(),
                    settings,
                );
                let started = Instant::now();
                let stats = worker
                    .run(tokio_util::sync::CancellationToken::new())
                    .await
                    .expect("drain");
                let drain = started.elapsed();
                assert_eq!(stats.succeeded as usize, n, "{stats:?}");
                println!(
                    "{:<10} {:<22} {:>7} {:>12.0} {:>12.0} {:>10.1}",
                    format!("{backend:?}"),
                    case,
                    n,
                    n as f64 / enqueue.as_secs_f64(),
                    n as f64 / drain.as_secs_f64(),
                    drain.as_micros() as f64 / n as f64
                );
            });
        }
    }
}
