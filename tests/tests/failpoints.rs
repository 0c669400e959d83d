//! A test per failpoint: an `idem run` process (built with the `failpoints`
//! feature) dies at the failpoint, another worker takes over once the lease
//! has run out (the store's clock is moved, nothing sleeps for it), and the
//! end state is checked at the provider server: the job finished once, its
//! key applied exactly once, the lost attempt counted.

use idem::store::{JobState, NewJob};
use idem_provider_server::ProviderServerConfig;
use idem_tests::{Backend, Harness, both_backends};
use std::process::ExitStatus;
use std::time::Duration;

const KEY: &str = "send_invoice_email/invoice:42:email:v1";

fn invoice(id: u64) -> NewJob {
    NewJob::new(
        "send_invoice_email",
        format!(r#"{{"invoice_id": {id}, "recipient": "ana@example.com"}}"#).into_bytes(),
    )
}

/// Starts `idem run --exit-when-drained` on the harness with `failpoints`
/// armed (`IDEM_FAILPOINTS`).
fn start(config: &std::path::Path, failpoints: &str) -> tokio::process::Child {
    idem_tests::spawn_drain(env!("CARGO_BIN_EXE_idem-test"), config, failpoints)
}

/// Waits for the process to die at its failpoint.
async fn died(mut child: tokio::process::Child) -> ExitStatus {
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("the process reaches its failpoint within 60 s")
        .expect("wait for idem run");
    assert!(!status.success(), "it died at the failpoint: {status:?}");
    status
}

/// Another worker takes over: the lease has run out by the store's clock.
async fn take_over(h: &Harness) -> idem::queue::stats::StatsSnapshot {
    h.store
        .clock_advance(Duration::from_secs(600))
        .await
        .unwrap();
    h.store.job_rescue_expired(100).await.unwrap();
    h.drain().await
}

/// The job finished once, on its second attempt (the first was lost).
async fn finished_once(h: &Harness, id: idem::store::JobId) {
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    assert_eq!(job.attempt, 2, "the lost attempt is counted");
    assert_eq!(job.rescues, 1);
    assert_eq!(h.provider.applied(KEY), 1, "applied exactly once");
}

/// The job finished once; the attempt lost to the crash is given back: the
/// process died before anything recorded the attempt's start (no plan, no
/// heartbeat yet), so the rescue counts it among the bounded rescues of
/// claims that never started (issue 22, item 4).
async fn finished_once_unstarted(h: &Harness, id: idem::store::JobId) {
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    assert_eq!(job.attempt, 1, "the unrecorded attempt is given back");
    assert_eq!((job.rescues, job.unstarted_rescues), (1, 1));
    assert_eq!(h.provider.applied(KEY), 1, "applied exactly once");
}

async fn dies_at(h: &Harness, failpoint: &str) -> idem::store::JobId {
    let id = h.store.job_insert(invoice(42)).await.unwrap().id;
    let config = h.config_file(Duration::from_secs(5));
    died(start(config.path(), &format!("{failpoint}=abort"))).await;
    id
}

async fn after_plugin_call(backend: Backend) {
    let h = Harness::new(backend).await;
    let id = dies_at(&h, "after_plugin_call").await;
    let dead_before = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(dead_before.plan, None, "died before the plan was stored");
    assert_eq!(h.provider.requests(KEY), 0);
    let stats = take_over(&h).await;
    finished_once_unstarted(&h, id).await;
    assert_eq!(stats.plugin_calls, 1, "the plugin is asked again");
    assert_eq!(h.provider.requests(KEY), 1);
}

async fn after_plan_stored(backend: Backend) {
    let h = Harness::new(backend).await;
    let id = dies_at(&h, "after_plan_stored").await;
    assert!(h.store.job_get(id).await.unwrap().unwrap().plan.is_some());
    assert_eq!(h.provider.requests(KEY), 0);
    let stats = take_over(&h).await;
    finished_once(&h, id).await;
    assert_eq!(stats.plans_reused, 1, "the stored plan is carried out");
    assert_eq!(stats.plugin_calls, 0);
    assert_eq!(h.provider.requests(KEY), 1);
}

async fn after_key_claimed(backend: Backend) {
    let h = Harness::new(backend).await;
    let id = dies_at(&h, "after_key_claimed").await;
    let key = h.store.effect_get(KEY).await.unwrap().unwrap();
    assert_eq!(key.status, idem::store::EffectStatus::Processing);
    assert_eq!(h.provider.requests(KEY), 0, "died before sending");
    take_over(&h).await;
    finished_once(&h, id).await;
    // The takeover cannot know nothing was sent: in doubt, re-sent with the
    // same key to a provider that dedupes.
    assert_eq!(h.provider.requests(KEY), 1);
    assert!(h.store.effect_get(KEY).await.unwrap().unwrap().reached);
}

async fn after_provider_call(backend: Backend) {
    let h = Harness::new(backend).await;
    let id = dies_at(&h, "after_provider_call").await;
    assert_eq!(h.provider.applied(KEY), 1, "the provider did it");
    take_over(&h).await;
    finished_once(&h, id).await;
    assert_eq!(
        h.provider.requests(KEY),
        2,
        "sent again with the same key, deduplicated"
    );
}

async fn after_key_marked(backend: Backend) {
    // order_sync's plan: a webhook, then the child invoice job. The
    // webhook's success commits with the child effect's claim (the last
    // effect's success commits with the job's own, so a one-effect plan has
    // no such window); the process dies right after that commit.
    const WEBHOOK: &str = "order_sync/webhook:evt_3:acme";
    let h = Harness::new(backend).await;
    let order = NewJob::new(
        "order_sync",
        br#"{"order_id": 3, "event_id": "evt_3", "destination": "acme"}"#.to_vec(),
    );
    let id = h.store.job_insert(order).await.unwrap().id;
    let config = h.config_file(Duration::from_secs(5));
    died(start(config.path(), "after_key_marked=abort")).await;
    assert_eq!(
        h.store.effect_get(WEBHOOK).await.unwrap().unwrap().status,
        idem::store::EffectStatus::Succeeded
    );
    let stats = take_over(&h).await;
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    assert_eq!(
        (job.attempt, job.rescues),
        (2, 1),
        "the lost attempt is counted"
    );
    assert_eq!(stats.idempotency_hits, 1, "the webhook is found done");
    assert_eq!(h.provider.requests(WEBHOOK), 1, "and not sent again");
    assert_eq!(
        h.provider.applied("send_invoice_email/invoice:3:email:v1"),
        1,
        "the child job was enqueued once and ran"
    );
}

async fn in_heartbeat(backend: Backend) {
    // A slow provider keeps the job running past a third of its lease: the
    // first heartbeat comes while the call is in flight, and the process dies.
    let mut h = Harness::with_provider(
        backend,
        ProviderServerConfig {
            processing_delay: Duration::from_millis(2500),
            ..ProviderServerConfig::default()
        },
    )
    .await;
    h.provider_timeout = Duration::from_secs(10);
    let id = h.store.job_insert(invoice(42)).await.unwrap().id;
    let config = h.config_file(Duration::from_millis(1500));
    died(start(config.path(), "in_heartbeat=abort")).await;
    // Usually during the call; on a slow machine the heartbeat may come first.
    assert!(h.provider.requests(KEY) <= 1);
    take_over(&h).await;
    finished_once(&h, id).await;
}

async fn before_release(backend: Backend) {
    // One job in a slow call, one claimed ahead in the buffer; a shutdown
    // gives the buffered one back, and the process dies right before.
    let mut h = Harness::with_provider(
        backend,
        ProviderServerConfig {
            processing_delay: Duration::from_millis(1500),
            ..ProviderServerConfig::default()
        },
    )
    .await;
    h.provider_timeout = Duration::from_secs(10);
    let first = h.store.job_insert(invoice(42)).await.unwrap().id;
    let second = h.store.job_insert(invoice(43)).await.unwrap().id;
    let config = h.config_file(Duration::from_secs(5));
    let text = std::fs::read_to_string(config.path())
        .unwrap()
        .replace("default = 2", "default = 1");
    std::fs::write(config.path(), text).unwrap();
    let child = start(config.path(), "before_release=abort");
    let pid = child.id().expect("running");
    tokio::time::timeout(Duration::from_secs(60), async {
        while h.provider.requests(KEY)
            + h.provider
                .requests("send_invoice_email/invoice:43:email:v1")
            == 0
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("a call is in flight");
    let term = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    died(child).await;
    let held = h
        .store
        .job_list(idem::store::JobFilter {
            states: vec![JobState::Running],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(!held.is_empty(), "a lease was left behind: {held:?}");
    take_over(&h).await;
    for (id, key) in [
        (first, KEY),
        (second, "send_invoice_email/invoice:43:email:v1"),
    ] {
        let job = h.store.job_get(id).await.unwrap().unwrap();
        assert_eq!(job.state, JobState::Succeeded, "{job:?}");
        assert!(job.attempt <= 2);
        assert_eq!(h.provider.applied(key), 1, "{key} applied once");
    }
}

/// Issue 22 (review): a redelivery that runs a stored plan records its
/// start before the first effect, as a fresh plan's save does, so a crash
/// during the plan's provider call charges the attempt. (Recorded only by
/// the first heartbeat, the crash was taken for a claim that never started:
/// the attempt was given back, and a plan that kills its host ran up to ten
/// times whatever `max_attempts` said.)
async fn a_stored_plan_that_dies_in_its_effect_charges_the_attempt(backend: Backend) {
    use idem::effects::{Action, Effect};
    use idem::store::{ClaimParams, SavePlanParams};
    let h = Harness::new(backend).await;
    // A plan stored by an earlier attempt that was given back.
    let id = h.store.job_insert(invoice(42)).await.unwrap().id;
    let job = h
        .store
        .job_claim(ClaimParams {
            queue: "default".into(),
            worker: "earlier".into(),
            limit: 1,
            lease: Duration::from_secs(60),
            queue_concurrency: None,
            max_attempts: Default::default(),
        })
        .await
        .unwrap()
        .remove(0);
    let plan = vec![Effect {
        provider: "email".into(),
        idempotency_key: KEY.into(),
        action: Action::Email {
            to: vec!["ana@example.com".into()],
            subject: "Invoice 42".into(),
            text: Some("hi".into()),
            html: None,
            template: None,
        },
    }];
    h.store
        .job_save_plan(SavePlanParams {
            fence: job.fence(),
            plan: serde_json::to_string(&plan).unwrap(),
            plugin_hash: "earlier".into(),
        })
        .await
        .unwrap();
    h.store.job_release(&job.fence()).await.unwrap();
    let config = h.config_file(Duration::from_secs(5));
    died(start(config.path(), "after_key_claimed=abort")).await;
    let crashed = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(crashed.attempt, 1);
    assert!(crashed.started, "recorded before the first effect");
    let stats = take_over(&h).await;
    assert_eq!(stats.plans_reused, 1);
    let job = h.store.job_get(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    assert_eq!(job.attempt, 2, "the crashed attempt is charged");
    assert_eq!((job.rescues, job.unstarted_rescues), (1, 0));
    assert_eq!(h.provider.applied(KEY), 1, "applied exactly once");
}

both_backends!(
    after_plugin_call,
    a_stored_plan_that_dies_in_its_effect_charges_the_attempt,
    after_plan_stored,
    after_key_claimed,
    after_provider_call,
    after_key_marked,
    in_heartbeat,
    before_release,
);
