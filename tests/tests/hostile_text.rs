//! Issue 22, the whole system: a hostile plugin (`plugins/hostile_text`)
//! hands the host NUL bytes, control characters, ANSI escapes, invalid code
//! shapes and oversized messages in every field it can reach, one job of
//! it in about twelve among 300 good jobs that send a real email, on both
//! backends (PostgreSQL refuses a NUL in text, and one refused value used
//! to fail the whole group-commit batch it rode in).
//!
//! Every good job succeeds with its email applied once; every hostile job
//! ends with its own classified code, refused before any plan, ledger row
//! or provider request; nothing stored or logged holds a raw control
//! character; and no job was rescued, so no batch failed and left its jobs
//! to their leases.

use idem::failure::ErrorClass;
use idem::queue::Worker;
use idem::store::{EffectStatus, Job, JobFilter, JobState, NewJob};
use idem_tests::{Backend, Harness, both_backends};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Good jobs, each sending one invoice email.
const GOOD: u64 = 300;

/// Attempts a hostile job gets (the retryable case uses them all).
const HOSTILE_ATTEMPTS: u32 = 3;

/// How a hostile job must end.
#[derive(Debug, Clone, Copy)]
enum Ends {
    /// Dead with this code, every recorded error of this class.
    Dead(&'static str, ErrorClass),
    /// Succeeded (its hostile text went only to the log).
    Succeeded,
}

use ErrorClass::{Permanent, Retryable};

/// Every case of `plugins/hostile_text` and how its job ends.
const CASES: &[(&str, Ends)] = &[
    // The plugin's own error: an invalid code keeps the plugin's class.
    ("nul_code", Ends::Dead("invalid_error_code", Retryable)),
    ("code_spaces", Ends::Dead("invalid_error_code", Permanent)),
    ("code_unicode", Ends::Dead("invalid_error_code", Permanent)),
    ("code_empty", Ends::Dead("invalid_error_code", Permanent)),
    ("code_long", Ends::Dead("invalid_error_code", Permanent)),
    ("code_escapes", Ends::Dead("invalid_error_code", Permanent)),
    // A valid code: the message is cleaned (and cut), the code kept.
    ("message_escapes", Ends::Dead("hostile_message", Permanent)),
    ("message_large", Ends::Dead("hostile_large", Permanent)),
    // 1 MiB: above the 64 KiB cap on an error, refused whole.
    (
        "message_huge",
        Ends::Dead("plugin_output_too_large", Permanent),
    ),
    // Effects: refused by the plan checks before anything is stored.
    ("key_nul", Ends::Dead("invalid_idempotency_key", Permanent)),
    (
        "key_escapes",
        Ends::Dead("invalid_idempotency_key", Permanent),
    ),
    ("key_long", Ends::Dead("invalid_idempotency_key", Permanent)),
    ("provider_nul", Ends::Dead("invalid_effect", Permanent)),
    ("child_plugin_nul", Ends::Dead("invalid_effect", Permanent)),
    (
        "child_queue_escapes",
        Ends::Dead("invalid_effect", Permanent),
    ),
    // Effects: refused by their provider's check before the plan is stored.
    ("http_method_nul", Ends::Dead("invalid_effect", Permanent)),
    ("http_path_nul", Ends::Dead("invalid_effect", Permanent)),
    ("http_path_escapes", Ends::Dead("invalid_effect", Permanent)),
    (
        "http_path_tab_dots",
        Ends::Dead("invalid_effect", Permanent),
    ),
    (
        "http_header_name_nul",
        Ends::Dead("invalid_effect", Permanent),
    ),
    (
        "http_header_value_nul",
        Ends::Dead("invalid_effect", Permanent),
    ),
    (
        "http_header_value_crlf",
        Ends::Dead("invalid_effect", Permanent),
    ),
    // Hop-by-hop and routing headers, encoded dots (issue 24).
    (
        "http_header_transfer_encoding",
        Ends::Dead("invalid_effect", Permanent),
    ),
    (
        "http_header_x_forwarded_for",
        Ends::Dead("invalid_effect", Permanent),
    ),
    (
        "http_header_x_original_url",
        Ends::Dead("invalid_effect", Permanent),
    ),
    (
        "http_path_encoded_dots",
        Ends::Dead("invalid_effect", Permanent),
    ),
    ("email_to_nul", Ends::Dead("invalid_effect", Permanent)),
    ("email_to_crlf", Ends::Dead("invalid_effect", Permanent)),
    ("email_subject_nul", Ends::Dead("invalid_effect", Permanent)),
    // Logged, not returned: the job asks for nothing and succeeds.
    ("log_escapes", Ends::Succeeded),
];

/// The plugin's message in `message_escapes` (its `HOSTILE` text, then a
/// second line) as the store must keep it: every control character but
/// newline and tab replaced.
const CLEANED_MESSAGE: &str = "nul\u{fffd} clear\u{fffd}[2J cr\u{fffd} bell\u{fffd} \
     title\u{fffd}]0;pwned\u{fffd} end\nline two\ttab";

fn invoice(id: u64) -> NewJob {
    NewJob::new(
        "send_invoice_email",
        format!(r#"{{"invoice_id": {id}, "recipient": "ana@example.com"}}"#).into_bytes(),
    )
}

fn invoice_key(id: u64) -> String {
    format!("send_invoice_email/invoice:{id}:email:v1")
}

fn hostile(case: &str, correlation_id: &str) -> NewJob {
    let mut job = NewJob::new(
        "hostile_text",
        serde_json::json!({ "case": case }).to_string().into_bytes(),
    );
    job.max_attempts = HOSTILE_ATTEMPTS;
    job.correlation_id = Some(correlation_id.to_string());
    job
}

/// Fails when `text` holds a control character other than newline and tab
/// (a NUL, an escape, a carriage return, a bell ...).
fn assert_clean(what: &str, text: &str) {
    assert!(
        !text
            .chars()
            .any(|c| c.is_control() && c != '\n' && c != '\t'),
        "{what} holds a control character: {text:?}"
    );
}

/// Every text field of a stored job is clean.
fn assert_job_clean(job: &Job) {
    let what = |field: &str| format!("job {} ({}) {field}", job.id, job.plugin);
    assert_clean(&what("queue"), &job.queue);
    assert_clean(&what("plugin"), &job.plugin);
    assert_clean(&what("correlation id"), &job.correlation_id);
    for (field, text) in [
        ("key", &job.idempotency_key),
        ("last error code", &job.last_error_code),
        ("last error message", &job.last_error_message),
        ("plan", &job.plan),
    ] {
        if let Some(text) = text {
            assert_clean(&what(field), text);
        }
    }
    for error in &job.errors {
        assert_clean(&what("error code"), &error.code);
        assert_clean(&what("error message"), &error.message);
        assert!(
            error.message.len() <= idem::boundary::MAX_MESSAGE,
            "{}: a {}-byte message",
            what("error message"),
            error.message.len()
        );
    }
}

/// What the plugins log (the host's `idem::sandbox::guest` target), as the
/// text formatter prints it, for every run in this test process.
fn plugin_logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = logs.clone();
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "idem::sandbox::guest=trace",
            ))
            .with_ansi(false)
            .with_writer(move || LogSink(sink.clone()))
            .init();
        logs
    })
    .clone()
}

struct LogSink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn last_message(h: &Harness, id: idem::store::JobId) -> String {
    let job = h.store.job_get(id).await.unwrap().unwrap();
    job.last_error_message.unwrap_or_default()
}

async fn hostile_text_fails_only_its_own_jobs(backend: Backend) {
    let logs = plugin_logs();
    let h = Harness::new(backend).await;
    // Tags this run's log lines (both backends run in one process).
    let run = format!("hostile-{backend:?}-{:016x}", rand::random::<u64>());
    // One hostile job about every twelfth, so their writes share claims
    // and group-commit batches with the good jobs' writes.
    let every = GOOD as usize / CASES.len();
    let mut jobs = Vec::new();
    let mut cases = CASES.iter();
    for id in 1..=GOOD {
        if (id as usize - 1).is_multiple_of(every)
            && let Some((case, _)) = cases.next()
        {
            jobs.push(hostile(case, &run));
        }
        jobs.push(invoice(id));
    }
    for (case, _) in cases {
        jobs.push(hostile(case, &run));
    }
    let enqueued = h.store.job_insert_many(jobs.clone()).await.unwrap();
    let mut hostile_ids = BTreeMap::new();
    let mut good_ids = BTreeMap::new();
    for (job, enqueued) in jobs.iter().zip(&enqueued) {
        assert!(enqueued.inserted);
        let payload: serde_json::Value = serde_json::from_slice(&job.payload).unwrap();
        match payload.get("case").and_then(|c| c.as_str()) {
            Some(case) => hostile_ids.insert(case.to_string(), enqueued.id),
            None => good_ids.insert(payload["invoice_id"].as_u64().unwrap(), enqueued.id),
        };
    }
    assert_eq!(
        (hostile_ids.len(), good_ids.len()),
        (CASES.len(), GOOD as usize)
    );

    // More jobs at once than the harness default, and a flush that waits a
    // moment for company: outcomes commit in batches of several jobs.
    let mut settings = h.settings("hostile-text");
    settings.queues = BTreeMap::from([("default".to_string(), 8)]);
    settings.group_commit.max_wait = Duration::from_millis(2);
    let worker = Worker::new(h.store.clone(), h.registry.clone(), h.providers(), settings);
    let started = std::time::Instant::now();
    let stats = tokio::time::timeout(
        Duration::from_secs(120),
        worker.run(CancellationToken::new()),
    )
    .await
    .expect("the queue drains within 120 s")
    .expect("worker");
    eprintln!("{backend:?}: drained in {:?}: {stats:?}", started.elapsed());

    // Every good job succeeded at its first attempt, its email applied once.
    for (invoice_id, id) in &good_ids {
        let job = h.store.job_get(*id).await.unwrap().unwrap();
        assert_eq!(
            (job.state, job.attempt),
            (JobState::Succeeded, 1),
            "invoice {invoice_id}: {:?} {:?}",
            job.last_error_code,
            job.last_error_message
        );
        assert!(
            job.errors.is_empty(),
            "invoice {invoice_id}: {:?}",
            job.errors
        );
        let key = invoice_key(*invoice_id);
        assert_eq!(h.provider.applied(&key), 1, "{key}");
        assert_eq!(h.provider.requests(&key), 1, "{key}");
        let effects = h.store.effect_list(*id).await.unwrap();
        assert_eq!(effects.len(), 1, "{key}");
        assert_eq!(effects[0].key, key);
        assert_eq!(effects[0].status, EffectStatus::Succeeded, "{key}");
        assert!(
            effects[0]
                .result_ref
                .as_deref()
                .is_some_and(|r| r.starts_with("msg_")),
            "{key}: {:?}",
            effects[0].result_ref
        );
    }

    // Every hostile job ended with its own code, refused before any plan
    // was stored or any key claimed.
    for (case, ends) in CASES {
        let id = hostile_ids[*case];
        let job = h.store.job_get(id).await.unwrap().unwrap();
        match *ends {
            Ends::Dead(code, class) => {
                let attempts = if class == Retryable {
                    HOSTILE_ATTEMPTS
                } else {
                    1
                };
                assert_eq!(
                    (job.state, job.last_error_code.as_deref(), job.attempt),
                    (JobState::Dead, Some(code), attempts),
                    "{case}: {:?}",
                    job.last_error_message
                );
                assert_eq!(job.errors.len(), attempts as usize, "{case}");
                for error in &job.errors {
                    assert_eq!((error.code.as_str(), error.class), (code, class), "{case}");
                }
                assert_eq!(job.plan, None, "{case}: refused before its plan was stored");
            }
            Ends::Succeeded => {
                assert_eq!(job.state, JobState::Succeeded, "{case}: {:?}", job.errors);
                assert!(job.errors.is_empty(), "{case}");
                assert_eq!(job.plan.as_deref(), Some("[]"), "{case}");
            }
        }
        assert!(
            h.store.effect_list(id).await.unwrap().is_empty(),
            "{case}: no key was claimed"
        );
    }

    // What each message says, cleaned: the refused code is shown escaped
    // next to the plugin's message, a valid code's message is kept cleaned,
    // a long one is cut.
    let message = |case: &str| last_message(&h, hostile_ids[case]);
    let nul_code = message("nul_code").await;
    assert!(nul_code.contains(r#""nul\0code""#), "{nul_code:?}");
    assert!(
        nul_code.contains("message nul\u{fffd} clear"),
        "{nul_code:?}"
    );
    assert_eq!(message("message_escapes").await, CLEANED_MESSAGE);
    let large = message("message_large").await;
    assert!(
        large.len() <= idem::boundary::MAX_MESSAGE && large.ends_with("..."),
        "{} bytes: {:?}",
        large.len(),
        &large[large.len().saturating_sub(40)..]
    );
    assert!(
        large.starts_with("nul\u{fffd} clear\u{fffd}[2J"),
        "{large:?}"
    );

    // Nothing stored holds a raw control character, no job was rescued (a
    // refused batch would have left its jobs running until their leases
    // ran out), and no child job was enqueued.
    let all = h
        .store
        .job_list(JobFilter {
            limit: 0,
            ..JobFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), CASES.len() + GOOD as usize, "no child job");
    for job in &all {
        assert_job_clean(job);
        assert_eq!(
            (job.rescues, job.unstarted_rescues, job.interruptions),
            (0, 0, 0),
            "job {} ({}) was rescued",
            job.id,
            job.plugin
        );
    }
    let dead = CASES
        .iter()
        .filter(|(_, ends)| matches!(ends, Ends::Dead(..)))
        .count() as u64;
    assert_eq!(
        (stats.succeeded, stats.dead, stats.retried),
        (
            GOOD + CASES.len() as u64 - dead,
            dead,
            u64::from(HOSTILE_ATTEMPTS - 1)
        ),
        "{stats:?}"
    );
    assert_eq!((stats.rescued, stats.fenced_out), (0, 0), "{stats:?}");

    // The provider saw the good emails and nothing else.
    let calls = h.provider.calls().await;
    assert_eq!(calls.len(), GOOD as usize);
    for call in &calls {
        let key = call.key.as_deref().unwrap_or("");
        assert!(
            key.starts_with("send_invoice_email/invoice:") && call.path == "/emails",
            "an unexpected request: {} {} {key:?}",
            call.method,
            call.path
        );
    }

    // The log lines arrived, tagged with this run, with no terminal escape
    // sequence in what was printed.
    let printed = String::from_utf8_lossy(&logs.lock().expect("log buffer")).into_owned();
    assert_eq!(
        printed.matches(&format!("hostile log {run} ")).count(),
        5,
        "one line per level"
    );
    for escape in ['\u{1b}', '\u{7}', '\0', '\r'] {
        assert!(!printed.contains(escape), "{escape:?} printed: {printed:?}");
    }
    // The plugin's newline is written as an escape: it cannot forge a line
    // of its own (one that would not carry the job's fields).
    assert!(
        !printed.lines().any(|line| line.starts_with("forged line")),
        "a forged line: {printed:?}"
    );
    assert_eq!(
        printed
            .lines()
            .filter(|line| line.contains(&format!("hostile log {run} "))
                && line.contains("\\nforged line"))
            .count(),
        5,
        "{printed:?}"
    );
}

both_backends!(hostile_text_fails_only_its_own_jobs);
