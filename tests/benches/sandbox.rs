//! Per-job sandbox cost: a fresh Store + instance + one `handle` call of the
//! `noop` plugin + drop, with the pooling allocator and on demand.
//!
//! Run: `cargo bench -p idem-tests --bench sandbox`.

use criterion::{Criterion, criterion_group, criterion_main};
use idem::sandbox::{JobInput, Sandbox, SandboxConfig};
use idem_tests::plugins;
use std::hint::black_box;

fn job() -> JobInput {
    JobInput {
        id: 1,
        queue: "default".into(),
        payload: vec![b' '; 254].into_iter().chain(*b"{}").collect(),
        attempt: 1,
        max_attempts: 10,
        idempotency_key: None,
        correlation_id: "bench".into(),
        enqueued_at_ms: 0,
    }
}

fn fresh_instance_per_job(c: &mut Criterion) {
    let mut group = c.benchmark_group("sandbox/fresh_instance_per_job");
    let wasm = std::fs::read(plugins::NOOP).expect("noop plugin");
    for (label, pooling) in [("pooling", true), ("on_demand", false)] {
        let sandbox = Sandbox::new(SandboxConfig {
            pooling,
            ..SandboxConfig::default()
        })
        .expect("sandbox");
        let plugin = sandbox
            .load("noop", &wasm, Default::default())
            .expect("load");
        let job = job();
        group.bench_function(label, |b| {
            b.iter(|| black_box(sandbox.run(&plugin, &job).expect("noop succeeds")))
        });
    }
    group.finish();
}

fn example_plugin(c: &mut Criterion) {
    let sandbox = Sandbox::new(SandboxConfig::default()).expect("sandbox");
    let wasm = std::fs::read(plugins::SEND_INVOICE_EMAIL).expect("plugin");
    let plugin = sandbox
        .load("send_invoice_email", &wasm, Default::default())
        .expect("load");
    let job = JobInput {
        payload: br#"{"invoice_id": 42, "recipient": "ana@example.com"}"#.to_vec(),
        ..job()
    };
    c.bench_function("sandbox/send_invoice_email", |b| {
        b.iter(|| black_box(sandbox.run(&plugin, &job).expect("succeeds")))
    });
}

criterion_group!(benches, fresh_instance_per_job, example_plugin);
criterion_main!(benches);
