//! The worker loop on both backends: hostile plugins are classified and the
//! worker keeps serving, shutdown gives leases back, dead jobs replay once the
//! cause is fixed, expired leases are rescued and the stale holder is fenced out.

use idem::plugins::PluginRegistry;
use idem::providers::Providers;
use idem::queue::Worker;
use idem::sandbox::{Sandbox, SandboxConfig};
use idem::store::{ClaimParams, Fence, JobChange, JobFilter, JobState, NewJob, Write, Written};
use idem_provider_server::ProviderServerConfig;
use idem_tests::{Backend, Harness, both_backends};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn invoice(id: u64) -> NewJob {
    NewJob::new(
        "send_invoice_email",
        format!(r#"{{"invoice_id": {id}, "recipient": "ana@example.com"}}"#).into_bytes(),
    )
}

async fn hostile_plugins_are_recorded_with_their_codes_and_the_worker_keeps_serving(
    backend: Backend,
) {
    let h = Harness::new(backend).await;
    let mut hostile = Vec::new();
    for plugin in [
        "hostile_loop",
        "hostile_memory_bomb",
        "hostile_recursion",
        "hostile_panic",
        "hostile_effect_flood",
        "no_such_plugin",
    ] {
        let mut job = NewJob::new(plugin, b"{}".to_vec());
        job.max_attempts = 1;
        hostile.push((plugin, h.store.job_insert(job).await.unwrap().id));
    }
    let good: Vec<_> = futures_ids(&h, 5).await;
    let stats = h.drain().await;
    for (plugin, id) in hostile {
        let job = h.store.job_get(id).await.unwrap().unwrap();
        let expected = match plugin {
            "hostile_loop" => "plugin_timeout",
            "hostile_memory_bomb" => "plugin_out_of_memory",
            "hostile_recursion" => "plugin_stack_overflow",
            "hostile_panic" => "plugin_panic",
            "hostile_effect_flood" => "plugin_output_too_large",
            _ => "plugin_not_found",
        };
        assert_eq!(job.state, JobState::Dead, "{plugin}");
        assert_eq!(job.last_error_code.as_deref(), Some(expected), "{plugin}");
        assert_eq!(job.errors.len(), 1, "{plugin}");
        if plugin != "no_such_plugin" {
            assert!(
                job.plugin_hash.is_some(),
                "{plugin}: the plugin version is recorded"
            );
        }
    }
    for id in good {
        assert_eq!(
            h.store.job_get(id).await.unwrap().unwrap().state,
            JobState::Succeeded
        );
    }
    assert_eq!(stats.dead, 6);
    assert_eq!(stats.succeeded, 5);
}

async fn futures_ids(h: &Harness, n: u64) -> Vec<idem::store::JobId> {
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(h.store.job_insert(invoice(100 + i)).await.unwrap().id);
    }
    ids
}

async fn retryable_faults_are_retried_with_backoff_until_attempts_run_out(backend: Backend) {
    let h = Harness::new(backend).await;
    let mut job = NewJob::new("hostile_panic", b"{}".to_vec());
    job.max_attempts = 3;
    let id = h.store.job_insert(job).await.unwrap().id;
    let stats = h.drain().await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.attempt, 3);
    assert_eq!(job.errors.len(), 3);
    assert!(job.errors.iter().all(|e| e.code == "plugin_panic"));
    assert!(job.first_failed_at_ms.unwrap() <= job.last_failed_at_ms.unwrap());
    assert_eq!(stats.retried, 2);
    assert_eq!(stats.dead, 1);
}

async fn shutdown_records_the_call_in_flight_and_gives_the_lease_back(backend: Backend) {
    let mut h = Harness::with_provider(
        backend,
        ProviderServerConfig {
            processing_delay: Duration::from_secs(2),
            ..ProviderServerConfig::default()
        },
    )
    .await;
    h.provider_timeout = Duration::from_secs(10);
    // order_sync's plan: a (slow) webhook, then the child invoice job.
    let order = NewJob::new(
        "order_sync",
        br#"{"order_id": 3, "event_id": "evt_3", "destination": "acme"}"#.to_vec(),
    );
    let id = h.store.job_insert(order).await.unwrap().id;
    let mut settings = h.settings("stopping");
    settings.exit_when_drained = false;
    settings.shutdown_grace = Duration::from_millis(100);
    let worker = Worker::new(h.store.clone(), h.registry.clone(), h.providers(), settings);
    let stop = CancellationToken::new();
    let run = tokio::spawn(worker.run(stop.clone()));
    while h.provider.requests("order_sync/webhook:evt_3:acme") == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(8), run)
        .await
        .expect("stops once the call in flight has answered")
        .unwrap()
        .unwrap();
    // The webhook sent before the stop was answered and recorded ...
    let webhook = h
        .store
        .effect_get("order_sync/webhook:evt_3:acme")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(webhook.status, idem::store::EffectStatus::Succeeded);
    assert_eq!(webhook.lease_owner, None);
    // ... the next effect was not started, and the job's lease was given back.
    assert!(
        h.store
            .effect_get("order_sync/order:3:invoice")
            .await
            .unwrap()
            .is_none()
    );
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Available, "the lease was given back");
    assert_eq!(job.lease_owner, None);
    assert_eq!(job.attempt, 0, "the interrupted attempt is given back");
    assert_eq!(job.interruptions, 1, "and counted as an interruption");
    // Another worker finishes the stored plan; the webhook is not sent again.
    let stats = h.drain().await;
    assert_eq!(
        h.store.job_get(id).await.unwrap().unwrap().state,
        JobState::Succeeded
    );
    assert_eq!(h.provider.requests("order_sync/webhook:evt_3:acme"), 1);
    assert_eq!(h.provider.applied("order_sync/webhook:evt_3:acme"), 1);
    assert!(stats.idempotency_hits >= 1);
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:3:email:v1"),
        1
    );
}

async fn a_dead_job_replays_and_succeeds_once_the_cause_is_fixed(backend: Backend) {
    let h = Harness::new(backend).await;
    let id = h.store.job_insert(invoice(5)).await.unwrap().id;
    // Misconfigured host: no email provider.
    h.drain_with(Providers::default()).await;
    let dead = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(dead.state, JobState::Dead);
    assert_eq!(dead.attempt, 1, "permanent: dead at once");
    assert_eq!(
        dead.last_error_code.as_deref(),
        Some("provider_not_configured")
    );
    let listed = h
        .store
        .job_list(JobFilter {
            states: vec![JobState::Dead],
            error_code: Some("provider_not_configured".into()),
            limit: 10,
            ..JobFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    // Fixed: replay with the provider configured.
    assert_eq!(h.store.job_replay(&[id]).await.unwrap().replayed, [id]);
    h.drain().await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.attempt, 1, "attempts were reset");
    assert_eq!(job.errors.len(), 1, "the history is kept");
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:5:email:v1"),
        1
    );
}

async fn an_expired_lease_is_rescued_and_the_stale_holder_is_fenced_out(backend: Backend) {
    let h = Harness::new(backend).await;
    let id = h.store.job_insert(invoice(8)).await.unwrap().id;
    let ghost = h
        .store
        .job_claim(ClaimParams {
            queue: "default".into(),
            worker: "ghost".into(),
            limit: 1,
            lease: Duration::from_secs(30),
            queue_concurrency: None,
            max_attempts: Default::default(),
        })
        .await
        .unwrap()
        .remove(0);
    // The ghost started the attempt (its first heartbeat said so) ...
    assert_eq!(
        h.store
            .write(Write::Job {
                fence: ghost.fence(),
                change: JobChange::Heartbeat {
                    lease: Duration::from_secs(30),
                    started: true,
                },
            })
            .await
            .unwrap(),
        Written::Job(Fence::Applied)
    );
    // ... then stalls past its lease: the store's clock moves on.
    h.store
        .clock_advance(Duration::from_secs(31))
        .await
        .unwrap();
    let stats = h.drain().await;
    assert_eq!(stats.rescued, 1);
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.rescues, 1);
    assert_eq!(job.attempt, 2);
    // The ghost wakes up and tries to finish: rejected, nothing changes.
    assert_eq!(
        h.store
            .write(Write::Job {
                fence: ghost.fence(),
                change: JobChange::Succeed {
                    plugin_hash: None,
                    plan: None
                },
            })
            .await
            .unwrap(),
        Written::Job(Fence::FencedOut)
    );
    assert_eq!(h.store.job_get(id).await.unwrap().unwrap(), job);
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:8:email:v1"),
        1
    );
}

async fn exit_when_drained_looks_only_at_the_served_queues(backend: Backend) {
    let h = Harness::new(backend).await;
    let mut elsewhere = invoice(9);
    elsewhere.queue = "billing".into();
    let waiting = h.store.job_insert(elsewhere).await.unwrap().id;
    let mut later = invoice(10);
    later.delay = Duration::from_secs(3600);
    h.store.job_insert(later).await.unwrap();
    let done = h.store.job_insert(invoice(11)).await.unwrap().id;
    // Serves only `default`: the billing job and the job scheduled for later do not hold it.
    let stats = h.drain().await;
    assert_eq!(stats.succeeded, 1);
    assert_eq!(
        h.store.job_get(done).await.unwrap().unwrap().state,
        JobState::Succeeded
    );
    assert_eq!(
        h.store.job_get(waiting).await.unwrap().unwrap().state,
        JobState::Available
    );
}

async fn two_workers_share_a_queue_and_every_effect_happens_once(backend: Backend) {
    let h = Harness::new(backend).await;
    let mut batch = Vec::new();
    for i in 0..60 {
        // Every invoice event arrives twice.
        batch.push(invoice(1000 + i));
        batch.push(invoice(1000 + i));
    }
    h.store.job_insert_many(batch).await.unwrap();
    let a = Worker::new(
        h.store.clone(),
        h.registry.clone(),
        h.providers(),
        h.settings("node-a"),
    );
    let b = Worker::new(
        h.store.clone(),
        h.registry.clone(),
        h.providers(),
        h.settings("node-b"),
    );
    let never = CancellationToken::new();
    let (ra, rb) = tokio::join!(a.run(never.clone()), b.run(never.clone()));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.succeeded + rb.succeeded, 120, "{ra:?} {rb:?}");
    assert!(
        ra.claimed > 0 && rb.claimed > 0,
        "both nodes worked: {ra:?} {rb:?}"
    );
    for i in 0..60 {
        assert_eq!(
            h.provider
                .applied(&format!("send_invoice_email/invoice:{}:email:v1", 1000 + i)),
            1
        );
    }
    assert_eq!(ra.effects_executed + rb.effects_executed, 60);
}

async fn a_full_instance_pool_defers_jobs_instead_of_failing_them(backend: Backend) {
    let h = Harness::new(backend).await;
    // One sandbox instance for two handlers: while the looping plugin holds
    // it (up to its 300 ms deadline), the other handler cannot instantiate.
    let sandbox = Arc::new(
        Sandbox::new(SandboxConfig {
            max_instances: 1,
            ..SandboxConfig::default()
        })
        .unwrap(),
    );
    let registry = Arc::new(PluginRegistry::new(sandbox, h.plugins_dir.path()));
    registry.refresh();
    let mut looping = NewJob::new("hostile_loop", b"{}".to_vec());
    looping.max_attempts = 1;
    let looping = h.store.job_insert(looping).await.unwrap().id;
    let mut noops = Vec::new();
    for _ in 0..20 {
        // One attempt each: a failure would dead-letter at once.
        let mut job = NewJob::new("noop", b"{}".to_vec());
        job.max_attempts = 1;
        noops.push(h.store.job_insert(job).await.unwrap().id);
    }
    let mut settings = h.settings("pool-worker");
    settings.queues = BTreeMap::from([("default".to_string(), 2)]);
    let worker = Worker::new(h.store.clone(), registry, h.providers(), settings);
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        worker.run(CancellationToken::new()),
    )
    .await
    .expect("drains")
    .unwrap();
    assert!(
        stats.deferred >= 1,
        "a job that found no instance was deferred: {stats:?}"
    );
    for id in noops {
        let job = h.store.job_get(id).await.unwrap().unwrap();
        assert_eq!(job.state, JobState::Succeeded, "job {id}");
        assert_eq!(job.attempt, 1, "a deferral uses no attempt");
        assert!(job.errors.is_empty(), "job {id}: {:?}", job.errors);
    }
    let looped = h.store.job_get(looping).await.unwrap().unwrap();
    assert_eq!(looped.last_error_code.as_deref(), Some("plugin_timeout"));
}

/// Window 7: the first heartbeat comes at a third of the claim-time lease,
/// whatever the plugin's own (longer) lease. Here the claim-time lease is
/// 3 s and the provider takes 6 s: had the keeper waited for a third of
/// the plugin's lease, the job would have been rescued mid-call.
async fn the_first_heartbeat_comes_before_the_claim_time_lease_lapses(backend: Backend) {
    let mut h = Harness::with_provider(
        backend,
        ProviderServerConfig {
            processing_delay: Duration::from_millis(6000),
            ..ProviderServerConfig::default()
        },
    )
    .await;
    h.provider_timeout = Duration::from_secs(10);
    let id = h.store.job_insert(invoice(61)).await.unwrap().id;
    let mut settings = h.settings("short-claims");
    settings.lease = Duration::from_secs(3);
    let worker = Worker::new(h.store.clone(), h.registry.clone(), h.providers(), settings);
    tokio::time::timeout(
        Duration::from_secs(60),
        worker.run(CancellationToken::new()),
    )
    .await
    .expect("drains")
    .unwrap();
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!((job.attempt, job.rescues), (1, 0), "never rescued: {job:?}");
    // The claim alone sets heartbeat_at within a moment of the insert; only
    // extensions during the 6 s call move it seconds later.
    assert!(
        job.heartbeat_at_ms >= Some(job.created_at_ms + 2_000),
        "extended while running: {job:?}"
    );
    assert_eq!(
        h.provider
            .requests("send_invoice_email/invoice:61:email:v1"),
        1
    );
}

both_backends!(
    the_first_heartbeat_comes_before_the_claim_time_lease_lapses,
    a_full_instance_pool_defers_jobs_instead_of_failing_them,
    two_workers_share_a_queue_and_every_effect_happens_once,
    exit_when_drained_looks_only_at_the_served_queues,
    hostile_plugins_are_recorded_with_their_codes_and_the_worker_keeps_serving,
    retryable_faults_are_retried_with_backoff_until_attempts_run_out,
    shutdown_records_the_call_in_flight_and_gives_the_lease_back,
    a_dead_job_replays_and_succeeds_once_the_cause_is_fixed,
    an_expired_lease_is_rescued_and_the_stale_holder_is_fenced_out,
);
