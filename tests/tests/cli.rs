//! The `idem` binary: plugins check/list and `invoke`, with every hostile
//! plugin classified within its limit.

use idem_tests::plugins;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem-test"))
        .args(["--plugins-dir", plugins::PLUGINS_DIR])
        .args(args)
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-cli-test-cache"),
        )
        .output()
        .expect("run idem")
}

fn json(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

#[test]
fn invoke_prints_the_invoice_email_effect() {
    let out = idem(&[
        "invoke",
        "send_invoice_email",
        "--payload",
        r#"{"invoice_id":42,"recipient":"ana@example.com"}"#,
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    let effects = v["effects"].as_array().unwrap();
    assert_eq!(effects.len(), 1);
    assert_eq!(effects[0]["idempotency_key"], "invoice:42:email:v1");
    assert_eq!(effects[0]["provider"], "email");
    assert_eq!(effects[0]["action"]["type"], "email");
}

#[test]
fn every_hostile_plugin_gets_its_classified_code_within_its_limit() {
    for (plugin, code, class, limit) in [
        (
            "hostile_loop",
            "plugin_timeout",
            "retryable",
            Duration::from_secs(10),
        ),
        (
            "hostile_memory_bomb",
            "plugin_out_of_memory",
            "retryable",
            Duration::from_secs(10),
        ),
        (
            "hostile_recursion",
            "plugin_stack_overflow",
            "retryable",
            Duration::from_secs(10),
        ),
        (
            "hostile_effect_flood",
            "plugin_output_too_large",
            "permanent",
            Duration::from_secs(20),
        ),
        (
            "hostile_huge_string",
            "plugin_output_too_large",
            "permanent",
            Duration::from_secs(20),
        ),
        (
            "hostile_panic",
            "plugin_panic",
            "retryable",
            Duration::from_secs(10),
        ),
        (
            "hostile_sleep",
            "plugin_forbidden_call",
            "permanent",
            Duration::from_secs(10),
        ),
        (
            "send_invoice_email",
            "payload_invalid",
            "permanent",
            Duration::from_secs(10),
        ),
    ] {
        let started = Instant::now();
        let out = idem(&["invoke", plugin, "--payload", "{}"]);
        let took = started.elapsed();
        assert_eq!(
            out.status.code(),
            Some(1),
            "{plugin}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v = json(&out);
        assert_eq!(v["error"]["code"], code, "{plugin}: {v}");
        assert_eq!(v["error"]["class"], class, "{plugin}: {v}");
        assert!(took < limit, "{plugin} took {took:?}");
    }
}

/// The provider server is its own crate now; the `idem` binary still runs it.
#[test]
fn the_provider_server_command_is_wired_and_checks_its_flags() {
    let out = idem(&["provider-server", "--fault-rates", "500=2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--fault-rates"), "{stderr}");
}

#[test]
fn an_unknown_plugin_is_a_usage_error_naming_the_loaded_ones() {
    let out = idem(&["invoke", "nope", "--payload", "{}"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no plugin named \"nope\""), "{stderr}");
    assert!(stderr.contains("send_invoice_email"), "{stderr}");
}

#[test]
fn check_accepts_examples_and_rejects_the_forbidden_import() {
    for ok in [
        plugins::SEND_INVOICE_EMAIL,
        plugins::ORDER_SYNC,
        plugins::NOOP,
    ] {
        let out = idem(&["plugins", "check", ok]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{ok}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let out = idem(&["plugins", "check", plugins::HOSTILE_FORBIDDEN_IMPORT]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("evil:plugin/exfiltrate"), "{stdout}");
    let missing = idem(&["plugins", "check", "/nonexistent/x.wasm"]);
    assert_eq!(missing.status.code(), Some(1));
}

#[test]
fn check_prints_the_declared_and_the_granted_providers() {
    let out = idem(&["plugins", "check", plugins::ORDER_SYNC]);
    let stdout = ok(&out);
    assert!(
        stdout.contains(
            "declared: providers = [\"partner\", \"jobs\"], enqueues = [\"send_invoice_email\"]"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "granted:  providers = [\"partner\", \"jobs\"], enqueues = [\"send_invoice_email\"] (all it declares; order_sync.toml narrows nothing)"
        ),
        "{stdout}"
    );
    let out = idem(&["plugins", "check", plugins::NOOP]);
    let stdout = ok(&out);
    assert!(
        stdout.contains("granted:  providers = [], enqueues = [] (all it declares; no noop.toml)"),
        "{stdout}"
    );
}

/// A plugins folder holding `send_invoice_email.wasm` and this operator file.
fn folder_with_operator_file(text: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(
        plugins::SEND_INVOICE_EMAIL,
        dir.path().join("send_invoice_email.wasm"),
    )
    .expect("copy plugin");
    std::fs::write(dir.path().join("send_invoice_email.toml"), text).expect("operator file");
    dir
}

#[test]
fn invoke_fails_naming_what_to_add_when_an_effect_is_not_granted() {
    let dir = folder_with_operator_file("providers = []\n");
    let out = Command::new(env!("CARGO_BIN_EXE_idem-test"))
        .args(["--plugins-dir", dir.path().to_str().expect("utf-8")])
        .args([
            "invoke",
            "send_invoice_email",
            "--payload",
            r#"{"invoice_id":42,"recipient":"ana@example.com"}"#,
        ])
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-cli-test-cache"),
        )
        .output()
        .expect("run idem");
    assert_eq!(out.status.code(), Some(1));
    let v = json(&out);
    assert_eq!(v["error"]["code"], "effect_not_allowed", "{v}");
    assert_eq!(v["effects"][0]["provider"], "email", "{v}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("\"invoice:42:email:v1\""), "{stderr}");
    assert!(
        stderr.contains("send_invoice_email.toml leaves it out: add it to `providers` there"),
        "{stderr}"
    );
    // Widening what the plugin declares is refused when the folder loads.
    let dir = folder_with_operator_file("providers = [\"email\", \"partner\"]\n");
    let out = Command::new(env!("CARGO_BIN_EXE_idem-test"))
        .args(["--plugins-dir", dir.path().to_str().expect("utf-8")])
        .args(["plugins", "list"])
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-cli-test-cache"),
        )
        .output()
        .expect("run idem");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("send_invoice_email.wasm not loaded"),
        "{stderr}"
    );
    assert!(stderr.contains("can only narrow"), "{stderr}");
}

#[test]
fn list_shows_names_hashes_and_limits_and_reports_the_bad_file() {
    let out = idem(&["plugins", "list"]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("send_invoice_email"), "{stdout}");
    assert!(
        stdout.contains("300ms"),
        "hostile_loop's manifest deadline: {stdout}"
    );
    assert!(
        stdout.contains("partner,jobs[send_invoice_email]"),
        "order_sync's declared grants: {stdout}"
    );
    assert!(!stdout.contains("hostile_forbidden_import"));
    assert!(
        stderr.contains("hostile_forbidden_import.wasm not loaded"),
        "{stderr}"
    );
}

/// `idem` in a working directory, with extra environment.
fn idem_in(dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem-test"));
    command
        .current_dir(dir)
        .args(["--plugins-dir", plugins::PLUGINS_DIR])
        .args(args)
        .env_remove("IDEM_DATABASE_URL")
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-cli-test-cache"),
        );
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("run idem")
}

fn ok(out: &Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// enqueue → run → dlq list/show/replay → run, on one store.
fn drain_and_replay(dir: &std::path::Path, db: &[&str], provider_url: &str) {
    let args =
        |rest: &[&str]| -> Vec<String> { db.iter().chain(rest).map(|s| s.to_string()).collect() };
    let run = |rest: &[&str]| {
        let all = args(rest);
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        idem_in(
            dir,
            &refs,
            &[
                ("IDEM_BACKOFF_BASE", "50ms"),
                ("IDEM_POLL_INTERVAL", "100ms"),
            ],
        )
    };
    ok(&run(&["migrate"]));
    let first = ok(&run(&["enqueue", "noop", "--payload", "{}", "--key", "k1"]));
    let again = ok(&run(&["enqueue", "noop", "--payload", "{}", "--key", "k1"]));
    assert_eq!(
        first.trim(),
        again.trim(),
        "a duplicate key returns the existing job"
    );
    ok(&run(&[
        "enqueue",
        "noop",
        "--payload",
        "{}",
        "--priority",
        "5",
    ]));
    let scheduled = ok(&run(&[
        "enqueue",
        "noop",
        "--payload",
        "{}",
        "--delay",
        "1h",
    ]));
    // No email provider is configured yet: a permanent, fixable failure.
    let invoice = ok(&run(&[
        "enqueue",
        "send_invoice_email",
        "--payload",
        r#"{"invoice_id":42,"recipient":"ana@example.com"}"#,
    ]));
    let bad = run(&["enqueue", "noop", "--payload", "{not json"]);
    assert_eq!(bad.status.code(), Some(2), "malformed payloads are refused");
    let huge = dir.join("huge.json");
    std::fs::write(
        &huge,
        format!("\"{}\"", "x".repeat(idem::store::MAX_PAYLOAD_BYTES)),
    )
    .unwrap();
    let too_big = run(&["enqueue", "noop", "--payload-file", huge.to_str().unwrap()]);
    assert_eq!(
        too_big.status.code(),
        Some(2),
        "oversized payloads are refused"
    );
    assert!(String::from_utf8_lossy(&too_big.stderr).contains("at most"));
    let bad_key = run(&["enqueue", "noop", "--payload", "{}", "--key", "tab\there"]);
    assert_eq!(bad_key.status.code(), Some(2), "invalid keys are refused");
    // Two jobs of one group: both run, one after the other.
    for _ in 0..2 {
        ok(&run(&[
            "enqueue",
            "noop",
            "--payload",
            "{}",
            "--group",
            "order:9",
        ]));
    }
    let bad_group = run(&["enqueue", "noop", "--payload", "{}", "--group", "tab\there"]);
    assert_eq!(
        bad_group.status.code(),
        Some(2),
        "invalid groups are refused"
    );
    assert!(
        String::from_utf8_lossy(&bad_group.stderr).contains("group"),
        "the refusal names the group"
    );

    let summary: serde_json::Value =
        serde_json::from_str(&ok(&run(&["run", "--exit-when-drained"]))).unwrap();
    assert_eq!(summary["worker"]["succeeded"], 4, "{summary}");
    assert_eq!(summary["worker"]["dead"], 1, "{summary}");
    assert_eq!(
        summary["jobs"]["available"], 1,
        "the job scheduled for later does not hold the drain"
    );

    let list = ok(&run(&["dlq", "list"]));
    assert!(list.contains("provider_not_configured"), "{list}");
    let show: serde_json::Value =
        serde_json::from_str(&ok(&run(&["dlq", "show", invoice.trim()]))).unwrap();
    assert_eq!(show["state"], "dead");
    assert_eq!(show["last_error"]["code"], "provider_not_configured");
    assert_eq!(show["attempt"], 1);
    assert_eq!(
        show["payload"],
        r#"{"invoice_id":42,"recipient":"ana@example.com"}"#
    );
    assert!(show["first_failed_at"].is_string());

    // Fix the cause, replay, run again.
    std::fs::write(
        dir.join("idem.toml"),
        format!("[providers.email]\nkind = \"email\"\nbase_url = \"{provider_url}\"\n"),
    )
    .unwrap();
    let replayed = ok(&run(&[
        "dlq",
        "replay",
        "--code",
        "provider_not_configured",
        "--rate",
        "100/s",
    ]));
    assert!(replayed.contains("\"replayed\":1"), "{replayed}");
    let summary: serde_json::Value =
        serde_json::from_str(&ok(&run(&["run", "--exit-when-drained"]))).unwrap();
    assert_eq!(summary["worker"]["succeeded"], 1, "{summary}");
    assert_eq!(summary["jobs"]["dead"], 0, "{summary}");
    let stats: serde_json::Value = serde_json::from_str(&ok(&run(&["stats"]))).unwrap();
    assert_eq!(stats["succeeded"], 5);
    assert!(!scheduled.trim().is_empty());
}

fn provider_server() -> (
    tokio::runtime::Runtime,
    idem_provider_server::ProviderServerHandle,
) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let handle = runtime
        .block_on(idem_provider_server::ProviderServerHandle::start(
            Default::default(),
        ))
        .unwrap();
    (runtime, handle)
}

#[test]
fn enqueue_run_and_dlq_on_sqlite_with_no_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let (_runtime, provider) = provider_server();
    drain_and_replay(dir.path(), &[], &provider.base_url);
    assert!(
        dir.path().join("idem.db").exists(),
        "the default store is ./idem.db"
    );
    assert_eq!(
        provider.applied("send_invoice_email/invoice:42:email:v1"),
        1
    );
}

#[test]
fn enqueue_run_and_dlq_on_postgres_with_database_url() {
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("idem_cli_{}", hex::encode(rand::random::<[u8; 6]>()));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&base).await.unwrap();
        sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
            .execute(&mut conn)
            .await
            .unwrap();
    });
    let separator = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{separator}options=-c%20search_path%3D{schema}");
    let dir = tempfile::tempdir().unwrap();
    let (_server_runtime, provider) = provider_server();
    drain_and_replay(dir.path(), &["--database-url", &url], &provider.base_url);
    assert!(
        !dir.path().join("idem.db").exists(),
        "no SQLite file when PostgreSQL is used"
    );
    assert_eq!(
        provider.applied("send_invoice_email/invoice:42:email:v1"),
        1
    );
    runtime.block_on(async {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&base).await.unwrap();
        let _ = sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .execute(&mut conn)
            .await;
    });
}

#[test]
fn a_dead_database_is_a_clear_runtime_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = idem_in(
        dir.path(),
        &[
            "--database-url",
            "postgres://postgres@127.0.0.1:1/none",
            "stats",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot open the store"), "{stderr}");
    let out = idem_in(dir.path(), &["--database-url", "mysql://x", "stats"], &[]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_worker_killed_mid_run_loses_nothing_and_duplicates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let plugins_dir = dir.path().join("plugins");
    std::fs::create_dir(&plugins_dir).unwrap();
    for name in ["send_invoice_email.wasm", "noop.wasm"] {
        std::fs::copy(
            std::path::Path::new(plugins::PLUGINS_DIR).join(name),
            plugins_dir.join(name),
        )
        .unwrap();
    }
    // A short lease, so the killed worker's jobs are rescued quickly.
    std::fs::write(
        plugins_dir.join("send_invoice_email.toml"),
        "providers = [\"email\"]\ndeadline = \"500ms\"\nlease = \"1s\"\n",
    )
    .unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let provider = runtime
        .block_on(idem_provider_server::ProviderServerHandle::start(
            idem_provider_server::ProviderServerConfig {
                processing_delay: Duration::from_millis(300),
                ..Default::default()
            },
        ))
        .unwrap();
    std::fs::write(
        dir.path().join("idem.toml"),
        format!(
            "plugins_dir = \"plugins\"\n[worker]\nlease = \"1s\"\nbackoff_base = \"50ms\"\nbackoff_max = \"200ms\"\npoll_interval = \"100ms\"\nqueues = {{ default = 4 }}\n[providers.email]\nkind = \"email\"\nbase_url = \"{}\"\ntimeout = \"500ms\"\n",
            provider.base_url
        ),
    )
    .unwrap();
    let url = format!("sqlite://{}", dir.path().join("idem.db").display());
    runtime.block_on(async {
        let store = idem::store::connect(&url).await.unwrap();
        let jobs = (0..30)
            .map(|i| {
                idem::store::NewJob::new(
                    "send_invoice_email",
                    format!(r#"{{"invoice_id": {i}, "recipient": "c{i}@example.com"}}"#)
                        .into_bytes(),
                )
            })
            .collect();
        store.job_insert_many(jobs).await.unwrap();
    });
    let mut first = Command::new(env!("CARGO_BIN_EXE_idem-test"))
        .current_dir(dir.path())
        .args(["run", "--summary", "false"])
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-cli-test-cache"),
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while runtime.block_on(provider.calls()).len() < 6 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the first worker never called the provider"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SIGKILL: no shutdown, no lease given back, calls in flight cut off.
    first.kill().unwrap();
    first.wait().unwrap();
    let second = Command::new(env!("CARGO_BIN_EXE_idem-test"))
        .current_dir(dir.path())
        .args(["run", "--exit-when-drained"])
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-cli-test-cache"),
        )
        .output()
        .unwrap();
    let summary: serde_json::Value = serde_json::from_str(&ok(&second)).unwrap();
    assert_eq!(summary["jobs"]["succeeded"], 30, "{summary}");
    assert_eq!(summary["jobs"]["dead"], 0, "{summary}");
    assert!(
        summary["worker"]["rescued"].as_u64().unwrap() >= 1,
        "the killed worker's jobs were rescued: {summary}"
    );
    for i in 0..30 {
        assert_eq!(
            provider.applied(&format!("send_invoice_email/invoice:{i}:email:v1")),
            1,
            "invoice {i}"
        );
    }
}

#[test]
fn enqueue_batch_reads_ndjson_prints_ids_in_order_and_refuses_a_bad_line_whole() {
    let dir = tempfile::tempdir().unwrap();
    let batch = dir.path().join("jobs.ndjson");
    std::fs::write(
        &batch,
        concat!(
            "{\"payload\": {\"n\": 1}, \"key\": \"batch:1\"}\n",
            "\n",
            "{\"plugin\": \"send_invoice_email\", \"payload\": {\"invoice_id\": 2, \"recipient\": \"b@example.com\"}, \"queue\": \"mail\", \"delay\": \"1h\", \"priority\": 5}\n",
            "{\"payload\": {\"n\": 3}, \"key\": \"batch:1\"}\n",
        ),
    )
    .unwrap();
    let path = batch.to_str().unwrap();
    let out = ok(&idem_in(
        dir.path(),
        &["enqueue", "noop", "--batch", path],
        &[],
    ));
    let ids: Vec<i64> = out.lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(ids.len(), 3, "one id per job line: {out}");
    assert_ne!(ids[0], ids[1]);
    assert_eq!(ids[0], ids[2], "a repeated key resolves to the first job");
    let stats: serde_json::Value =
        serde_json::from_str(&ok(&idem_in(dir.path(), &["stats"], &[]))).unwrap();
    assert_eq!(stats["available"], 2);
    let mail: serde_json::Value = serde_json::from_str(&ok(&idem_in(
        dir.path(),
        &["stats", "--queue", "mail"],
        &[],
    )))
    .unwrap();
    assert_eq!(mail["available"], 1);
    assert_eq!(mail["ready"], 0, "delayed by an hour");

    // Standard input, and a bad line: nothing of the batch is inserted.
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem-test"))
        .current_dir(dir.path())
        .args(["--plugins-dir", plugins::PLUGINS_DIR])
        .args(["enqueue", "noop", "--batch", "-"])
        .env_remove("IDEM_DATABASE_URL")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all(b"{\"payload\": {\"n\": 4}}\n{\"payload\": {}, \"key\": \"bad\\nkey\"}\n")
            .unwrap();
    }
    let refused = child.wait_with_output().unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--batch line 2"), "{stderr}");
    let stats: serde_json::Value =
        serde_json::from_str(&ok(&idem_in(dir.path(), &["stats"], &[]))).unwrap();
    assert_eq!(stats["available"], 2, "the refused batch inserted nothing");
}

/// Window 3 from the command line: `dlq replay` refuses (exit 1, naming the
/// key and the command that settles it) a job holding an effect in doubt;
/// `effects show` shows it, `effects resolve` settles it once, and the replay
/// then goes through.
/// `idem --database-url DB ARGS..` run in `dir`, with no configuration
/// from the environment.
fn idem_at(dir: &std::path::Path, db: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem-test"))
        .args(["--database-url", db])
        .args(args)
        .env_remove("IDEM_CONFIG")
        .current_dir(dir)
        .output()
        .expect("run idem")
}

/// A dead job (`may_not_resend`) whose effect `k1` (provider `email`) is in
/// doubt, in a fresh SQLite store: its folder, URL and id.
fn dead_in_doubt() -> (tempfile::TempDir, String, idem::store::JobId) {
    use idem::failure::ErrorClass;
    use idem::store::{
        ClaimParams, EffectClaim, EffectClaimParams, EffectFailParams, EffectStatus, ErrorRecord,
        JobChange, NewJob, SavePlanParams, Sent, Write,
    };
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("idem.db").display());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let id = runtime.block_on(async {
        let store = idem::store::connect(&db).await.unwrap();
        let id = store
            .job_insert(NewJob::new("send_invoice_email", b"{}".to_vec()))
            .await
            .unwrap()
            .id;
        let job = store
            .job_claim(ClaimParams {
                queue: "default".into(),
                worker: "w".into(),
                limit: 1,
                lease: Duration::from_secs(60),
                queue_concurrency: None,
                max_attempts: Default::default(),
            })
            .await
            .unwrap()
            .remove(0);
        let plan =
            r#"[{"provider":"email","idempotency_key":"k1","action":{"type":"custom","body":""}}]"#;
        store
            .job_save_plan(SavePlanParams {
                fence: job.fence(),
                plan: plan.into(),
                plugin_hash: "h".into(),
            })
            .await
            .unwrap();
        let claim = store
            .effect_claim(EffectClaimParams {
                key: "k1".into(),
                job_id: id,
                plugin: "send_invoice_email".into(),
                provider: "email".into(),
                fingerprint: "f".into(),
                worker: "w".into(),
                job_attempt: job.attempt,
                lease: Duration::from_secs(60),
                older_key: None,
            })
            .await
            .unwrap();
        let EffectClaim::Claimed { fence } = claim else {
            panic!("{claim:?}")
        };
        store
            .effect_set_failed(EffectFailParams {
                fence,
                status: EffectStatus::Failed,
                error_code: "may_not_resend".into(),
                sent: Sent::Unresolved,
            })
            .await
            .unwrap();
        store
            .write(Write::Job {
                fence: job.fence(),
                change: JobChange::Dead {
                    error: ErrorRecord {
                        attempt: 1,
                        class: ErrorClass::Permanent,
                        code: "may_not_resend".into(),
                        message: "in doubt".into(),
                        at_ms: 0,
                    },
                    redact_payload: false,
                    plugin_hash: None,
                },
            })
            .await
            .unwrap();
        id
    });
    (dir, db, id)
}

#[test]
fn an_effect_in_doubt_blocks_replay_until_resolved_from_the_command_line() {
    let (dir, db, id) = dead_in_doubt();
    let run = |args: &[&str]| idem_at(dir.path(), &db, args);
    let id = id.to_string();
    let refused = run(&["dlq", "replay", &id, "--rate", "100/s"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("idem effects resolve k1 --applied"),
        "{stderr}"
    );
    let shown = run(&["effects", "show", "k1"]);
    assert_eq!(shown.status.code(), Some(0));
    let row = json(&shown);
    assert_eq!(row["in_doubt"], true, "{row}");
    assert_eq!(row["reached"], true, "{row}");
    let resolved = run(&["effects", "resolve", "k1", "--not-applied"]);
    assert_eq!(
        resolved.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&resolved.stderr)
    );
    let twice = run(&["effects", "resolve", "k1", "--applied"]);
    assert_eq!(twice.status.code(), Some(1), "resolved once");
    let replayed = run(&["dlq", "replay", &id, "--rate", "100/s"]);
    assert_eq!(
        replayed.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&replayed.stderr)
    );
    assert!(String::from_utf8_lossy(&replayed.stdout).contains("\"replayed\":1"));
}

/// `idem effects reconcile`: refused without a provider that offers a
/// lookup; with one, a dry run asks and writes nothing, then a run settles
/// the key from the provider's answer and replays the job.
#[test]
fn effects_reconcile_asks_the_provider_then_settles_and_replays() {
    let (dir, db, id) = dead_in_doubt();
    let (runtime, provider) = provider_server();
    // The provider applied k1 before the worker vanished.
    runtime.block_on(async {
        let answer = reqwest::Client::new()
            .post(provider.url("/emails"))
            .header("Idempotency-Key", "k1")
            .json(&serde_json::json!({"to": ["ana@example.com"], "subject": "s"}))
            .send()
            .await
            .unwrap();
        assert!(answer.status().is_success());
    });
    let config = dir.path().join("idem.toml");
    let run = |args: &[&str]| idem_at(dir.path(), &db, args);
    let refused = run(&["effects", "reconcile"]);
    assert_eq!(refused.status.code(), Some(2), "a usage error");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("no configured provider offers a lookup"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    std::fs::write(
        &config,
        format!(
            "[providers.email]\nkind = \"email\"\nbase_url = \"{}\"\ndedupes = false\n\
             lookup = {{ path = \"/by-key/{{key}}\", settle = \"0s\", timeout = \"2s\" }}\n",
            provider.base_url
        ),
    )
    .unwrap();
    let config_arg = config.display().to_string();
    let dry = run(&["--config", &config_arg, "effects", "reconcile", "--dry-run"]);
    assert_eq!(
        dry.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&dry.stderr)
    );
    let report = json(&dry);
    assert_eq!(report["asked"][0]["key"], "k1", "{report}");
    assert_eq!(report["asked"][0]["outcome"], "applied", "{report}");
    assert_eq!(report["asked"][0]["settled"], false, "{report}");
    assert_eq!(report["replayed"], serde_json::json!([id.0]), "{report}");
    assert_eq!(
        json(&run(&["effects", "show", "k1"]))["in_doubt"],
        true,
        "a dry run writes nothing"
    );
    let done = run(&["--config", &config_arg, "effects", "reconcile"]);
    assert_eq!(
        done.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let report = json(&done);
    assert_eq!(report["asked"][0]["settled"], true, "{report}");
    assert_eq!(report["replayed"], serde_json::json!([id.0]), "{report}");
    let row = json(&run(&["effects", "show", "k1"]));
    assert_eq!(row["status"], "succeeded", "{row}");
    assert!(
        row["result_ref"]
            .as_str()
            .is_some_and(|r| r.starts_with("msg_")),
        "{row}"
    );
    assert_eq!(provider.applied("k1"), 1, "settled by asking, not sent");
    assert_eq!(provider.lookups("k1"), 2);
}

#[test]
fn resolving_an_unknown_key_says_so_and_names_the_plugin_form() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("idem.db").display());
    let out = idem(&[
        "--database-url",
        &db,
        "effects",
        "resolve",
        "invoice:42:email:v1",
        "--applied",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no effect with key"), "{stderr}");
    assert!(stderr.contains("PLUGIN/KEY"), "{stderr}");
}

/// `idem run --listen`: the API answers 401 without the token, the metrics
/// and the queues with it, and `idem stats` shows the API's numbers.
#[test]
fn run_listen_serves_the_api_behind_the_token_and_the_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let token = "cli-test-token-0123456789";
    let db = format!("sqlite://{}", dir.path().join("idem.db").display());
    for _ in 0..3 {
        ok(&idem_in(
            dir.path(),
            &["--database-url", &db, "enqueue", "noop", "--payload", "{}"],
            &[],
        ));
    }
    ok(&idem_in(
        dir.path(),
        &[
            "--database-url",
            &db,
            "enqueue",
            "noop",
            "--payload",
            "{}",
            "--delay",
            "1h",
        ],
        &[],
    ));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem-test"))
        .current_dir(dir.path())
        .args(["--plugins-dir", plugins::PLUGINS_DIR, "--database-url", &db])
        .args(["run", "--listen", &format!("127.0.0.1:{port}")])
        .env("IDEM_API_TOKEN", token)
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-cli-test-cache"),
        )
        .env_remove("IDEM_DATABASE_URL")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let outcome = runtime.block_on(async {
        let client = reqwest::Client::new();
        let mut up = false;
        for _ in 0..300 {
            if client
                .get(format!("{base}/healthz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
            {
                up = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(up, "idem run --listen answers /healthz");
        let anonymous = client
            .get(format!("{base}/api/queues"))
            .send()
            .await
            .unwrap();
        assert_eq!(anonymous.status(), 401);
        let anonymous_metrics = client.get(format!("{base}/metrics")).send().await.unwrap();
        assert_eq!(
            anonymous_metrics.status(),
            401,
            "metrics ask for the token unless --metrics-open"
        );
        // The three runnable jobs drain; the delayed one stays.
        let mut queues = serde_json::Value::Null;
        for _ in 0..300 {
            queues = client
                .get(format!("{base}/api/queues"))
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if queues["total"]["jobs"]["succeeded"] == 3 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let metrics = client
            .get(format!("{base}/metrics"))
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        (queues, metrics)
    });
    let (queues, metrics) = outcome;
    let stats: serde_json::Value = serde_json::from_str(&ok(&idem_in(
        dir.path(),
        &["--database-url", &db, "stats"],
        &[],
    )))
    .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(queues["total"]["jobs"]["succeeded"], 3, "{queues}");
    assert!(metrics.contains("idem_jobs_claimed_total"), "{metrics}");
    for state in ["available", "succeeded", "dead"] {
        assert_eq!(
            stats[state], queues["total"]["jobs"][state],
            "{state}: {stats} vs {queues}"
        );
    }
    assert_eq!(
        stats["succeeded_last_minute"],
        queues["total"]["succeeded_last_minute"]
    );
    assert_eq!(stats["queues"], queues["queues"]);
}

/// A plugin that panicked is fixed (a new `.wasm` under its name): the dry
/// run shows the fixed plugin's plan next to the stored one (none) without
/// changing anything, and the replay then carries it out.
#[test]
fn dlq_replay_dry_run_shows_the_fixed_plugins_plan() {
    let dir = tempfile::tempdir().unwrap();
    let plugins_dir = dir.path().join("plugins");
    std::fs::create_dir(&plugins_dir).unwrap();
    let built = std::path::Path::new(plugins::PLUGINS_DIR);
    std::fs::copy(
        built.join("hostile_panic.wasm"),
        plugins_dir.join("billing.wasm"),
    )
    .unwrap();
    let db = format!("sqlite://{}", dir.path().join("idem.db").display());
    let idem = |args: &[&str]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem-test"));
        command
            .current_dir(dir.path())
            .arg("--plugins-dir")
            .arg(&plugins_dir)
            .args(["--database-url", &db])
            .args(args)
            .env_remove("IDEM_DATABASE_URL")
            .env(
                "IDEM_CACHE_DIR",
                std::env::temp_dir().join("idem-cli-test-cache"),
            );
        command.output().unwrap()
    };
    let id = ok(&idem(&[
        "enqueue",
        "billing",
        "--payload",
        r#"{"invoice_id": 42, "recipient": "ana@example.com"}"#,
        "--max-attempts",
        "1",
    ]))
    .trim()
    .to_string();
    ok(&idem(&["run", "--exit-when-drained"]));
    let dead: serde_json::Value =
        serde_json::from_str(&ok(&idem(&["jobs", "show", &id, "--json"]))).unwrap();
    assert_eq!(dead["state"], "dead");
    assert_eq!(dead["last_error"]["code"], "plugin_panic");

    // The fix: a plugin under the same name that plans an email.
    std::fs::copy(
        built.join("send_invoice_email.wasm"),
        plugins_dir.join("billing.wasm"),
    )
    .unwrap();
    let preview: serde_json::Value =
        serde_json::from_str(&ok(&idem(&["dlq", "replay", &id, "--dry-run", "--json"]))).unwrap();
    let job = &preview["jobs"][0];
    assert_eq!(job["has_stored_plan"], false);
    assert_eq!(job["keys"][0]["key"], "billing/invoice:42:email:v1");
    assert_eq!(job["keys"][0]["change"], "new");
    assert_eq!(job["keys"][0]["ledger"], "not_started");
    assert_ne!(job["current_plugin_hash"], job["stored_plugin_hash"]);
    let text = ok(&idem(&["dlq", "replay", &id, "--dry-run"]));
    assert!(
        text.contains("new") && text.contains("billing/invoice:42:email:v1"),
        "{text}"
    );
    assert!(text.contains("nothing was replayed"), "{text}");
    let still: serde_json::Value =
        serde_json::from_str(&ok(&idem(&["jobs", "show", &id, "--json"]))).unwrap();
    assert_eq!(still["state"], "dead", "the dry run changed nothing");
    let timeline = ok(&idem(&["jobs", "show", &id]));
    assert!(
        timeline.contains("attempt_failed") && timeline.contains("plugin_panic"),
        "{timeline}"
    );
    let listed = ok(&idem(&["jobs", "list", "--state", "dead"]));
    assert!(listed.contains("plugin_panic"), "{listed}");
}

/// Issue 24, item 6: a correlation id over 255 bytes, a queue holding a
/// newline and a plugin holding an ANSI escape are each refused by `idem
/// enqueue` (exit 2, naming the field) before anything connects, on the
/// single and the batch path.
#[test]
fn enqueue_refuses_control_characters_and_oversized_ids_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "enqueue",
                "noop",
                "--payload",
                "{}",
                "--correlation-id",
                "a\nb",
            ],
            "correlation id",
        ),
        (
            &["enqueue", "noop", "--payload", "{}", "--queue", "a\nb"],
            "queue name",
        ),
        (&["enqueue", "\u{1b}[2J", "--payload", "{}"], "plugin name"),
        (
            &[
                "enqueue",
                "noop",
                "--payload",
                "{}",
                "--correlation-id",
                &"c".repeat(256),
            ],
            "correlation id",
        ),
    ];
    for (args, field) in cases {
        let out = idem_in(dir.path(), args, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(field), "{args:?} names {field}: {stderr}");
        assert!(
            !stderr.contains('\u{1b}'),
            "the refusal is printed escaped: {stderr:?}"
        );
    }
    assert!(
        !dir.path().join("idem.db").exists(),
        "refused before the store was opened"
    );
    // Three megabytes in a batch line (an argument cannot be that long).
    let batch = dir.path().join("jobs.ndjson");
    let line = serde_json::json!({"payload": {}, "correlation_id": "x".repeat(3 << 20)});
    std::fs::write(&batch, format!("{{\"payload\": {{}}}}\n{line}\n")).unwrap();
    let out = idem_in(
        dir.path(),
        &["enqueue", "noop", "--batch", batch.to_str().unwrap()],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--batch line 2") && stderr.contains("correlation id"),
        "{stderr}"
    );
    assert!(
        stderr.len() < 4096,
        "the id is not echoed whole: {} bytes",
        stderr.len()
    );
}

/// Issue 24, item 6: rows stored before the input checks existed are
/// printed with their control characters escaped by `idem jobs list`,
/// `idem jobs show` and `idem dlq list`: no ANSI escape reaches the
/// terminal and no newline forges a row.
#[test]
fn stored_control_characters_are_printed_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let id = ok(&idem_in(
        dir.path(),
        &["enqueue", "noop", "--payload", "{}"],
        &[],
    ));
    let id = id.trim().to_string();
    let hostile = "x\u{1b}[2J\nforged";
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        use sqlx::Connection;
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let mut conn = sqlx::SqliteConnection::connect(&url).await.unwrap();
        sqlx::query(
            "UPDATE jobs SET state = 'dead', queue = ?1, plugin = ?1, correlation_id = ?1, \
             idempotency_key = ?1, last_error_code = ?1, last_error_message = ?1, \
             finished_at = updated_at, last_failed_at = updated_at",
        )
        .bind(hostile)
        .execute(&mut conn)
        .await
        .unwrap();
    });
    for args in [
        vec!["jobs", "list"],
        vec!["jobs", "show", id.as_str()],
        vec!["dlq", "list"],
    ] {
        let out = ok(&idem_in(dir.path(), &args, &[]));
        assert!(
            !out.contains('\u{1b}'),
            "{args:?} prints a raw escape: {out:?}"
        );
        assert!(
            !out.lines().any(|l| l.starts_with("forged")),
            "{args:?} lets a stored newline start a line: {out}"
        );
        assert!(
            out.contains("x\\u{1b}[2J\\nforged"),
            "{args:?} shows the value escaped: {out}"
        );
    }
}

/// `idem schedules list` and `idem stats` show each schedule's next run and
/// its last tick, job and outcome; a bad `[[schedules]]` table stops the
/// command at start, naming the schedule.
#[tokio::test]
async fn schedules_list_shows_next_and_last_runs() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("idem.toml"),
        concat!(
            "[[schedules]]\nname = \"nightly\"\ncron = \"30 2 * * *\"\n",
            "timezone = \"Europe/Paris\"\nplugin = \"noop\"\n\n",
            "[[schedules]]\nname = \"every-minute\"\ncron = \"* * * * *\"\nplugin = \"noop\"\n",
        ),
    )
    .unwrap();
    let lines = |out: String| -> Vec<serde_json::Value> {
        out.lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    };
    let before = lines(ok(&idem_in(
        dir.path(),
        &["schedules", "list", "--json"],
        &[],
    )));
    assert_eq!(before.len(), 2, "{before:?}");
    assert_eq!(before[0]["name"], "every-minute");
    assert_eq!(before[1]["name"], "nightly");
    assert_eq!(before[1]["timezone"], "Europe/Paris");
    assert!(
        before[1]["next_run"].as_str().unwrap().ends_with(":30:00Z"),
        "02:30 in Paris is :30 past a UTC hour: {}",
        before[1]
    );
    assert!(before[0]["last_tick"].is_null(), "{}", before[0]);

    // A node recorded one tick of `nightly`, and a schedule since removed.
    let url = format!("sqlite://{}", dir.path().join("idem.db").display());
    let store = idem::store::connect(&url).await.unwrap();
    let tick = 1_796_607_000_000; // 2026-12-07T01:30:00Z, 02:30 in Paris
    let job = idem::store::NewJob::new("noop", b"{}".to_vec());
    let ticked = store
        .schedule_tick(idem::store::ScheduleTick {
            name: "nightly".into(),
            tick_ms: tick,
            job: Some(job),
        })
        .await
        .unwrap();
    let idem::store::Ticked::Enqueued(enqueued) = ticked else {
        panic!("{ticked:?}")
    };
    assert!(store.schedule_start("removed", tick).await.unwrap());
    drop(store);

    let after = lines(ok(&idem_in(
        dir.path(),
        &["schedules", "list", "--json"],
        &[],
    )));
    let nightly = after.iter().find(|s| s["name"] == "nightly").unwrap();
    assert_eq!(nightly["last_tick"], "2026-12-07T01:30:00Z");
    assert_eq!(nightly["last_job_id"], enqueued.id.0);
    assert_eq!(nightly["last_outcome"], "available");
    let removed = after.iter().find(|s| s["name"] == "removed").unwrap();
    assert_eq!(removed["configured"], false);
    assert!(removed["next_run"].is_null());
    let table = ok(&idem_in(dir.path(), &["schedules", "list"], &[]));
    let row = table
        .lines()
        .find(|l| l.starts_with("nightly "))
        .unwrap_or_else(|| panic!("{table}"));
    for part in [
        "30 2 * * *",
        "Europe/Paris",
        "2026-12-07T01:30:00Z",
        &enqueued.id.0.to_string(),
        "available",
    ] {
        assert!(row.contains(part), "{part:?} in {row:?}");
    }
    assert!(table.contains("(not configured)"), "{table}");
    let stats: serde_json::Value =
        serde_json::from_str(&ok(&idem_in(dir.path(), &["stats"], &[]))).unwrap();
    let in_stats = stats["schedules"].as_array().expect("schedules in stats");
    assert_eq!(in_stats.len(), 3, "{stats}");
    assert_eq!(in_stats[1], *nightly, "the list's numbers");

    std::fs::write(
        dir.path().join("idem.toml"),
        "[[schedules]]\nname = \"typo\"\ncron = \"* * * * *\"\ntimezone = \"Europe/Pariss\"\nplugin = \"noop\"\n",
    )
    .unwrap();
    let refused = idem_in(dir.path(), &["schedules", "list"], &[]);
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("schedule \"typo\"") && stderr.contains("Europe/Pariss"),
        "{stderr}"
    );

    // A schedule of a plugin the worker does not load stops it at start,
    // not at the first tick.
    std::fs::write(
        dir.path().join("idem.toml"),
        "[[schedules]]\nname = \"ghost\"\ncron = \"* * * * *\"\nplugin = \"nope\"\n",
    )
    .unwrap();
    let refused = idem_in(dir.path(), &["run", "--exit-when-drained"], &[]);
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("schedule \"ghost\": plugin \"nope\" is not loaded"),
        "{stderr}"
    );
}
