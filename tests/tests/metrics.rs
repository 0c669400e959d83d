//! The metrics a worker records, rendered as Prometheus text. One test per
//! binary: the recorder is process-global.

use idem::store::NewJob;
use idem_tests::{Backend, Harness};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_records_jobs_effects_hits_providers_and_queue_depth() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).expect("the only recorder in this binary");

    let h = Harness::new(Backend::Sqlite).await;
    let invoice = || {
        NewJob::new(
            "send_invoice_email",
            br#"{"invoice_id": 1, "recipient": "ana@example.com"}"#.to_vec(),
        )
    };
    let mut poison = NewJob::new("send_invoice_email", b"{}".to_vec());
    poison.max_attempts = 1;
    h.store.job_insert(invoice()).await.unwrap();
    h.store.job_insert(poison).await.unwrap();
    h.drain().await;
    // The same invoice again, after the first was done: an idempotency hit.
    h.store.job_insert(invoice()).await.unwrap();
    h.drain().await;

    let text = handle.render();
    for expected in [
        r#"idem_jobs_claimed_total{queue="default",plugin="send_invoice_email"} 3"#,
        r#"idem_jobs_finished_total{plugin="send_invoice_email",outcome="succeeded"} 2"#,
        r#"idem_job_errors_total{plugin="send_invoice_email",code="payload_invalid",class="permanent"} 1"#,
        r#"idem_effects_total{provider="email",outcome="executed"} 1"#,
        r#"idem_effects_total{provider="email",outcome="idempotency_hit"} 1"#,
        "idem_provider_call_seconds",
        "idem_job_wait_seconds",
        r#"idem_queue_jobs{queue="default",state="available"}"#,
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    // An answer lost to a timeout at a provider that cannot dedupe but
    // offers a lookup: the key is settled by asking it.
    h.provider.script_faults(
        "send_invoice_email/invoice:2:email:v1",
        vec![idem_provider_server::Fault::Late],
    );
    h.store
        .job_insert(NewJob::new(
            "send_invoice_email",
            br#"{"invoice_id": 2, "recipient": "ana@example.com"}"#.to_vec(),
        ))
        .await
        .unwrap();
    h.drain_with(h.providers_with(
        "breaker_failures = 1000\ndedupes = false\n\
         lookup = { path = \"/by-key/{key}\", settle = \"0s\" }",
    ))
    .await;

    let text = handle.render();
    for expected in [
        r#"idem_effects_reconciled_total{provider="email",outcome="applied"}"#,
        r#"idem_jobs_deferred_total{plugin="send_invoice_email",reason="effect_in_doubt"} 1"#,
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}
