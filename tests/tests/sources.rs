//! Brokers in, against the real RabbitMQ (127.0.0.1:5672) and NATS
//! JetStream (127.0.0.1:4222) on this machine: every message becomes one
//! job, duplicates and redeliveries return the same job, messages without a
//! usable key are kept dead, a broker connection cut mid-stream loses and
//! doubles nothing, and a crash between insert and ack (a failpoint in an
//! `idem run` process) redelivers into the same jobs.

use idem::sources::{Source, SourceConfig};
use idem::store::{JobFilter, JobState, Store};
use idem_tests::{Backend, Harness};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const NATS: &str = "nats://127.0.0.1:4222";

fn unique(prefix: &str) -> String {
    format!("{prefix}_{}", hex::encode(rand::random::<[u8; 5]>()))
}

/// A message to publish: body, message id, headers.
struct Out {
    body: Vec<u8>,
    id: Option<String>,
    headers: Vec<(&'static str, String)>,
}

fn order(i: u32) -> Out {
    Out {
        body: format!(r#"{{"order_id": {i}, "event_id": "evt_{i}", "destination": "acme"}}"#)
            .into_bytes(),
        id: Some(format!("order-{i}")),
        headers: vec![("Order-Id", format!("order-{i}"))],
    }
}

/// Declares a queue and publishes `messages` with publisher confirms.
async fn amqp_publish(queue: &str, messages: &[Out]) {
    let connection = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("RabbitMQ on 127.0.0.1:5672 (scripts/setup starts it)");
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for m in messages {
        let mut properties = BasicProperties::default();
        if let Some(id) = &m.id {
            properties = properties.with_message_id(id.as_str().into());
        }
        let mut headers = FieldTable::default();
        for (name, value) in &m.headers {
            headers.insert(
                (*name).into(),
                lapin::types::AMQPValue::LongString(value.as_str().into()),
            );
        }
        properties = properties.with_headers(headers);
        let confirmation = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &m.body,
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirmation.is_ack(), "the broker stored the message");
    }
    connection.close(200, "done".into()).await.unwrap();
}

/// Messages still in the queue (ready, not delivered).
async fn amqp_depth(queue: &str) -> u32 {
    let connection = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let q = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    connection.close(200, "done".into()).await.unwrap();
    q.message_count()
}

async fn amqp_delete(queue: &str) {
    if let Ok(connection) = Connection::connect(AMQP, ConnectionProperties::default()).await {
        if let Ok(channel) = connection.create_channel().await {
            let _ = channel
                .queue_delete(queue.into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = connection.close(200, "done".into()).await;
    }
}

/// Creates a stream on `subject` and publishes `messages`.
async fn nats_publish(stream: &str, subject: &str, messages: &[Out]) {
    let client = async_nats::connect(NATS)
        .await
        .expect("NATS on 127.0.0.1:4222 (scripts/setup starts it)");
    let js = async_nats::jetstream::new(client);
    js.get_or_create_stream(async_nats::jetstream::stream::Config {
        name: stream.to_string(),
        subjects: vec![subject.to_string()],
        ..Default::default()
    })
    .await
    .unwrap();
    for m in messages {
        let mut headers = async_nats::HeaderMap::new();
        for (name, value) in &m.headers {
            headers.insert(*name, value.as_str());
        }
        js.publish_with_headers(subject.to_string(), headers, m.body.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

async fn nats_delete(stream: &str) {
    if let Ok(client) = async_nats::connect(NATS).await {
        let _ = async_nats::jetstream::new(client)
            .delete_stream(stream)
            .await;
    }
}

fn amqp_source(url: &str, queue: &str) -> SourceConfig {
    toml::from_str(&format!(
        "kind = \"amqp\"\nurl = \"{url}\"\nqueue = \"{queue}\"\nplugin = \"order_sync\"\nkey = \"message_id\"\nbatch = 64\nprefetch = 256"
    ))
    .unwrap()
}

fn nats_source(url: &str, stream: &str) -> SourceConfig {
    toml::from_str(&format!(
        "kind = \"nats\"\nurl = \"{url}\"\nstream = \"{stream}\"\nconsumer = \"idem\"\nplugin = \"order_sync\"\nkey = \"header:Order-Id\"\nbatch = 64\nprefetch = 256\nack_wait = \"2s\""
    ))
    .unwrap()
}

async fn jobs(store: &Arc<dyn Store>, state: JobState) -> Vec<idem::store::Job> {
    store
        .job_list(JobFilter {
            states: vec![state],
            ..JobFilter::default()
        })
        .await
        .unwrap()
}

/// Runs `config` until `done` says so (at most 60 s), then stops it.
async fn consume_until<F, Fut>(store: &Arc<dyn Store>, config: SourceConfig, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let stop = CancellationToken::new();
    let tasks = idem::sources::spawn_all(
        store.clone(),
        vec![Source::new(config, 5).unwrap()],
        stop.clone(),
    );
    let reached = tokio::time::timeout(Duration::from_secs(60), async {
        // Woken by each committed insert; the bound covers what inserts
        // nothing (dead on arrival, the broker's own state).
        loop {
            if done().await {
                break;
            }
            store.wait_for_jobs(Duration::from_millis(50)).await;
        }
    })
    .await;
    stop.cancel();
    for task in tasks {
        task.await.unwrap();
    }
    assert!(reached.is_ok(), "the source did not get there within 60 s");
}

/// Messages without a usable key (and, on AMQP, one over the payload
/// limit: a NATS server refuses those at publish).
fn malformed(kind: &str) -> Vec<Out> {
    let mut out = malformed_keys();
    if kind == "amqp" {
        out.push(Out {
            body: vec![b'x'; 1_100_000],
            id: Some("order-big".into()),
            headers: vec![("Order-Id", "order-big".into())],
        });
    }
    out
}

fn malformed_keys() -> Vec<Out> {
    vec![
        Out {
            body: b"{\"no\": \"id\"}".to_vec(),
            id: None,
            headers: vec![],
        },
        // Not printable ASCII.
        Out {
            body: b"bad key".to_vec(),
            id: Some("order-é".into()),
            headers: vec![("Order-Id", "order-é".into())],
        },
    ]
}

async fn check_jobs(store: &Arc<dyn Store>, orders: u32, kind: &str) {
    let available = jobs(store, JobState::Available).await;
    assert_eq!(
        available.len(),
        orders as usize,
        "one job per message identity"
    );
    let mut keys: Vec<String> = available
        .iter()
        .filter_map(|j| j.idempotency_key.clone())
        .collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), orders as usize);
    let mut codes: Vec<String> = jobs(store, JobState::Dead)
        .await
        .into_iter()
        .filter_map(|j| j.last_error_code)
        .collect();
    codes.sort();
    let mut expected = vec!["message_key_invalid", "message_key_missing"];
    if kind == "amqp" {
        expected.push("message_too_large");
    }
    assert_eq!(codes, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_messages_published_twice_become_one_job_each() {
    let h = Harness::new(Backend::Sqlite).await;
    let queue = unique("idem_test");
    let mut out: Vec<Out> = (0..40).flat_map(|i| [order(i), order(i)]).collect();
    out.extend(malformed("amqp"));
    amqp_publish(&queue, &out).await;
    let store = h.store.clone();
    consume_until(&h.store, amqp_source(AMQP, &queue), || {
        let store = store.clone();
        let queue = queue.clone();
        async move {
            jobs(&store, JobState::Available).await.len() == 40
                && jobs(&store, JobState::Dead).await.len() == 3
                && amqp_depth(&queue).await == 0
        }
    })
    .await;
    check_jobs(&h.store, 40, "amqp").await;
    assert_eq!(
        amqp_depth(&queue).await,
        0,
        "every message was acknowledged"
    );
    amqp_delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_messages_published_twice_become_one_job_each() {
    let h = Harness::new(Backend::Postgres).await;
    let stream = unique("IDEM_TEST");
    let subject = format!("{}.orders", stream.to_lowercase());
    let mut out: Vec<Out> = (0..40).flat_map(|i| [order(i), order(i)]).collect();
    out.extend(malformed("nats"));
    nats_publish(&stream, &subject, &out).await;
    let store = h.store.clone();
    consume_until(&h.store, nats_source(NATS, &stream), || {
        let store = store.clone();
        async move {
            jobs(&store, JobState::Available).await.len() == 40
                && jobs(&store, JobState::Dead).await.len() == 2
        }
    })
    .await;
    check_jobs(&h.store, 40, "nats").await;
    // Nothing is pending or unacknowledged on the consumer (acks are
    // asynchronous on the server: give them a moment).
    let client = async_nats::connect(NATS).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream(&stream)
        .await
        .unwrap()
        .get_consumer("idem")
        .await
        .unwrap();
    let mut seen = (u64::MAX, usize::MAX);
    for _ in 0..40 {
        let info = consumer.info().await.unwrap();
        seen = (info.num_pending, info.num_ack_pending);
        if seen == (0, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(seen, (0, 0), "every message was acknowledged");
    nats_delete(&stream).await;
}

/// Whether the broker holds nothing more for the source: an AMQP queue
/// with no ready message, a JetStream consumer with nothing pending or
/// awaiting an ack.
async fn broker_settled(kind: &str, name: &str) -> bool {
    match kind {
        "amqp" => amqp_depth(name).await == 0,
        _ => {
            let client = async_nats::connect(NATS).await.unwrap();
            let js = async_nats::jetstream::new(client);
            let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
                .get_stream(name)
                .await
                .unwrap()
                .get_consumer("idem")
                .await
                .unwrap();
            let info = consumer.info().await.unwrap();
            info.num_pending == 0 && info.num_ack_pending == 0
        }
    }
}

/// A TCP proxy whose connections the test can cut, standing in for a
/// broker that goes away mid-stream.
struct Proxy {
    port: u16,
    cut: tokio::sync::watch::Sender<u32>,
    accepted: Arc<std::sync::atomic::AtomicU32>,
}

impl Proxy {
    async fn start(target: u16) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, watch) = tokio::sync::watch::channel(0u32);
        let accepted = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut watch = watch.clone();
                let generation = *watch.borrow();
                tokio::spawn(async move {
                    let Ok(mut outbound) =
                        tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = watch.wait_for(|g| *g != generation) => {}
                    }
                });
            }
        });
        Proxy {
            port,
            cut,
            accepted,
        }
    }

    /// Drops every connection open now.
    fn cut(&self) {
        self.cut.send_modify(|g| *g += 1);
    }
}

async fn broker_goes_away(kind: &str) {
    let h = Harness::new(Backend::Sqlite).await;
    let name = unique("idem_cut");
    let subject = format!("{}.orders", name.to_lowercase());
    let (target, config_of): (u16, fn(&str, &str) -> SourceConfig) = match kind {
        "amqp" => (5672, amqp_source),
        _ => (4222, nats_source),
    };
    let proxy = Proxy::start(target).await;
    let url = match kind {
        "amqp" => format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port),
        _ => format!("nats://127.0.0.1:{}", proxy.port),
    };
    let publish = |range: std::ops::Range<u32>| {
        let out: Vec<Out> = range.flat_map(|i| [order(i), order(i)]).collect();
        let (name, subject) = (name.clone(), subject.clone());
        async move {
            match kind {
                "amqp" => amqp_publish(&name, &out).await,
                _ => nats_publish(&name, &subject, &out).await,
            }
        }
    };
    publish(0..100).await;
    let stop = CancellationToken::new();
    let mut config = config_of(&url, &name);
    config.batch = 16;
    let tasks = idem::sources::spawn_all(
        h.store.clone(),
        vec![Source::new(config, 5).unwrap()],
        stop.clone(),
    );
    // Cut the connection while messages flow, twice, publishing more between.
    for round in 0..2u32 {
        tokio::time::timeout(Duration::from_secs(30), async {
            while jobs(&h.store, JobState::Available).await.len() < 20 * (round as usize + 1) {
                h.store.wait_for_jobs(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("jobs arrive");
        let before = proxy.accepted.load(std::sync::atomic::Ordering::SeqCst);
        proxy.cut();
        publish(100 + round * 50..150 + round * 50).await;
        // The source comes back through the proxy before the next cut (a
        // reconnection to a real broker: only polling can watch it).
        tokio::time::timeout(Duration::from_secs(30), async {
            while proxy.accepted.load(std::sync::atomic::Ordering::SeqCst) == before {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the source reconnects");
    }
    let reached = tokio::time::timeout(Duration::from_secs(60), async {
        while jobs(&h.store, JobState::Available).await.len() < 200 {
            h.store.wait_for_jobs(Duration::from_millis(50)).await;
        }
    })
    .await;
    // Redeliveries of what the cuts left unacknowledged come back until
    // the broker has nothing left for the source; then stop.
    tokio::time::timeout(Duration::from_secs(30), async {
        while !broker_settled(kind, &name).await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the broker settles");
    stop.cancel();
    for task in tasks {
        task.await.unwrap();
    }
    assert!(
        reached.is_ok(),
        "every message arrives after the reconnects"
    );
    assert!(
        proxy.accepted.load(std::sync::atomic::Ordering::SeqCst) >= 3,
        "the source reconnected after each cut"
    );
    let available = jobs(&h.store, JobState::Available).await;
    assert_eq!(available.len(), 200, "nothing lost, nothing doubled");
    match kind {
        "amqp" => {
            assert_eq!(amqp_depth(&name).await, 0);
            amqp_delete(&name).await;
        }
        _ => nats_delete(&name).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_connection_cut_mid_stream_loses_and_doubles_nothing() {
    broker_goes_away("amqp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_connection_cut_mid_stream_loses_and_doubles_nothing() {
    broker_goes_away("nats").await;
}

/// `idem run` dies after inserting a batch and before acknowledging it:
/// the broker redelivers, the next run returns the same jobs, and each
/// order's effects happen once.
async fn crash_between_insert_and_ack(kind: &str) {
    let h = Harness::new(Backend::Sqlite).await;
    let name = unique("idem_crash");
    let subject = format!("{}.orders", name.to_lowercase());
    let out: Vec<Out> = (0..10).map(order).collect();
    let source = match kind {
        "amqp" => {
            amqp_publish(&name, &out).await;
            amqp_source(AMQP, &name)
        }
        _ => {
            nats_publish(&name, &subject, &out).await;
            nats_source(NATS, &name)
        }
    };
    let config = h.config_file(Duration::from_secs(5));
    let mut text = std::fs::read_to_string(config.path()).unwrap();
    text.push_str(&format!(
        "\n[[sources]]\nkind = \"{kind}\"\nurl = \"{}\"\n{}plugin = \"order_sync\"\nkey = \"{}\"\nbatch = 64\nprefetch = 256\nbatch_wait = \"1s\"\n{}",
        source.url,
        match kind {
            "amqp" => format!("queue = \"{name}\"\n"),
            _ => format!("stream = \"{name}\"\nconsumer = \"idem\"\n"),
        },
        source.key,
        if kind == "nats" { "ack_wait = \"2s\"\n" } else { "" },
    ));
    std::fs::write(config.path(), text).unwrap();
    let mut child = idem_tests::spawn_run(
        env!("CARGO_BIN_EXE_idem-test"),
        config.path(),
        &["--summary", "false", "--queues", "nothing=1"],
        "after_insert_before_ack=abort",
    );
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("the process reaches the failpoint")
        .unwrap();
    assert!(!status.success(), "it died between insert and ack");
    assert_eq!(
        jobs(&h.store, JobState::Available).await.len(),
        10,
        "inserted before the crash"
    );
    // The next run: the broker redelivers what was never acknowledged.
    let store = h.store.clone();
    let depth_name = name.clone();
    consume_until(&h.store, source, || {
        let (store, name) = (store.clone(), depth_name.clone());
        async move {
            // Delivered to the dead process and never acknowledged: pending
            // until redelivered here and acknowledged.
            let settled = broker_settled(kind, &name).await;
            settled && jobs(&store, JobState::Available).await.len() == 10
        }
    })
    .await;
    assert_eq!(
        jobs(&h.store, JobState::Available).await.len(),
        10,
        "the same jobs, not new ones"
    );
    let stats = h.drain().await;
    assert_eq!(
        stats.succeeded, 20,
        "10 orders and their 10 invoice jobs: {stats:?}"
    );
    for i in 0..10 {
        assert_eq!(
            h.provider
                .applied(&format!("order_sync/webhook:evt_{i}:acme")),
            1
        );
    }
    match kind {
        "amqp" => amqp_delete(&name).await,
        _ => nats_delete(&name).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_crash_between_insert_and_ack_redelivers_into_the_same_jobs() {
    crash_between_insert_and_ack("amqp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_crash_between_insert_and_ack_redelivers_into_the_same_jobs() {
    crash_between_insert_and_ack("nats").await;
}

/// Issue 22, item 7: the key check runs on the job key as stored, the
/// source's `key_prefix` included. A message id that is a valid key alone
/// but too long once prefixed is kept dead on arrival, classified, and the
/// messages of its batch become their jobs (before, the store refused the
/// whole batch, and the broker delivered it again, for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_too_long_once_prefixed_is_dead_on_arrival_and_its_batch_goes_in() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let h = Harness::new(backend).await;
        let mut config = amqp_source(AMQP, "unused");
        config.key_prefix = Some("tenant-a:".into());
        let source = Source::new(config, 5).unwrap();
        let message = |id: String| idem::sources::Incoming {
            payload: br#"{"order_id": 1}"#.to_vec(),
            message_id: Some(id),
            headers: Vec::new(),
        };
        let long = "k".repeat(250);
        assert!(
            idem::boundary::idempotency_key(&long).is_ok(),
            "valid alone"
        );
        let batch = vec![
            message("order-1".into()),
            message(long),
            message("order-2".into()),
        ];
        let store: Arc<dyn Store> = h.store.clone();
        let ingested = idem::sources::ingest(&*store, &source, &batch)
            .await
            .expect("the batch goes in");
        assert_eq!((ingested.inserted, ingested.dead_on_arrival), (2, 1));
        let mut keys: Vec<String> = jobs(&store, JobState::Available)
            .await
            .into_iter()
            .filter_map(|j| j.idempotency_key)
            .collect();
        keys.sort();
        assert_eq!(keys, ["tenant-a:order-1", "tenant-a:order-2"]);
        let dead = jobs(&store, JobState::Dead).await;
        assert_eq!(dead.len(), 1);
        assert_eq!(
            dead[0].last_error_code.as_deref(),
            Some("message_key_invalid")
        );
        // A redelivery of the same batch changes nothing.
        let again = idem::sources::ingest(&*store, &source, &batch)
            .await
            .unwrap();
        assert_eq!((again.inserted, again.duplicates), (0, 2));
        assert_eq!(jobs(&store, JobState::Dead).await.len(), 1);
    }
}

/// Issue 24, item 6: a message whose key (the job's key and its
/// correlation id) is 3 MB long, or holds a newline or an ANSI escape, is
/// kept dead on arrival, classified, on either source's key rule (AMQP's
/// message id, NATS's header); its batch goes in, and nothing stored holds
/// the raw text.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_with_control_characters_or_megabytes_is_dead_on_arrival() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let h = Harness::new(backend).await;
        let store: Arc<dyn Store> = h.store.clone();
        let bad_keys = ["k".repeat(3 << 20), "a\nb".into(), "\u{1b}[2J".into()];
        for config in [amqp_source(AMQP, "unused"), nats_source(NATS, "unused")] {
            let source = Source::new(config, 5).unwrap();
            let message = |key: &str| idem::sources::Incoming {
                payload: format!(r#"{{"order_id": {}}}"#, key.len()).into_bytes(),
                message_id: Some(key.to_string()),
                headers: vec![("Order-Id".into(), key.to_string())],
            };
            let good = format!("order-{}", source.name);
            let mut batch: Vec<_> = bad_keys.iter().map(|k| message(k)).collect();
            batch.push(message(&good));
            let ingested = idem::sources::ingest(&*store, &source, &batch)
                .await
                .expect("the batch goes in");
            assert_eq!(
                (ingested.inserted, ingested.dead_on_arrival),
                (1, bad_keys.len()),
                "{}",
                source.name
            );
        }
        let dead = jobs(&store, JobState::Dead).await;
        assert_eq!(dead.len(), 2 * bad_keys.len());
        for job in &dead {
            assert_eq!(job.last_error_code.as_deref(), Some("message_key_invalid"));
            let message = job.last_error_message.as_deref().unwrap_or("");
            for text in [message, &job.correlation_id] {
                assert!(
                    text.len() <= 2048 && !text.chars().any(|c| c == '\u{1b}'),
                    "stored raw: {text:?}"
                );
            }
            assert!(idem::boundary::correlation_id(&job.correlation_id).is_ok());
        }
        assert_eq!(jobs(&store, JobState::Available).await.len(), 2);
    }
}
