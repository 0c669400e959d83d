//! The sandbox against real guest plugins: examples return exactly their
//! effects, hostile plugins get their classified codes within their limits,
//! and the host keeps serving afterwards.

use idem::effects::Action;
use idem::failure::{ErrorClass, Failure};
use idem::sandbox::{JobInput, RunError, Sandbox, SandboxConfig};
use idem_tests::{load, plugins, sandbox};
use std::time::{Duration, Instant};

fn job(payload: &str) -> JobInput {
    JobInput {
        id: 7,
        queue: "default".into(),
        payload: payload.as_bytes().to_vec(),
        attempt: 1,
        max_attempts: 10,
        idempotency_key: None,
        correlation_id: "corr-1".into(),
        enqueued_at_ms: 0,
    }
}

fn run(
    sandbox: &Sandbox,
    path: &str,
    payload: &str,
) -> Result<Vec<idem::effects::Effect>, Failure> {
    let plugin = load(sandbox, path);
    sandbox
        .run(&plugin.compiled, &job(payload))
        .map_err(plugin_failure)
}

/// The plugin's failure (a full instance pool is not one).
fn plugin_failure(error: RunError) -> Failure {
    match error {
        RunError::Plugin(failure) => failure,
        other => panic!("expected a plugin failure, got {other}"),
    }
}

fn failure(sandbox: &Sandbox, path: &str) -> (Failure, Duration) {
    let started = Instant::now();
    let failure = run(sandbox, path, "{}").expect_err("the plugin must fail");
    (failure, started.elapsed())
}

/// After a hostile plugin, the same engine still runs a good job.
fn assert_still_serving(sandbox: &Sandbox) {
    let effects = run(
        sandbox,
        plugins::SEND_INVOICE_EMAIL,
        r#"{"invoice_id": 1, "recipient": "ana@example.com"}"#,
    )
    .expect("a good job after a hostile one");
    assert_eq!(effects.len(), 1);
}

#[test]
fn send_invoice_email_returns_one_email_keyed_by_invoice() {
    let sandbox = sandbox();
    let effects = run(
        &sandbox,
        plugins::SEND_INVOICE_EMAIL,
        r#"{"invoice_id": 42, "recipient": "ana@example.com"}"#,
    )
    .unwrap();
    assert_eq!(effects.len(), 1);
    assert_eq!(effects[0].provider, "email");
    assert_eq!(effects[0].idempotency_key, "invoice:42:email:v1");
    match &effects[0].action {
        Action::Email {
            to, subject, text, ..
        } => {
            assert_eq!(to, &vec!["ana@example.com".to_string()]);
            assert_eq!(subject, "Invoice 42");
            assert!(text.as_deref().unwrap_or_default().contains("42"));
        }
        other => panic!("expected an email, got {other:?}"),
    }
}

#[test]
fn send_invoice_email_refuses_an_invalid_recipient_permanently() {
    let sandbox = sandbox();
    let err = run(
        &sandbox,
        plugins::SEND_INVOICE_EMAIL,
        r#"{"invoice_id": 42, "recipient": "not-an-address"}"#,
    )
    .unwrap_err();
    assert_eq!(err.class, ErrorClass::Permanent);
    assert_eq!(err.code, "invalid_recipient");
}

#[test]
fn a_malformed_payload_is_permanent_payload_invalid() {
    let sandbox = sandbox();
    for payload in ["not json", r#"{"invoice_id": "x"}"#, "{}"] {
        let err = run(&sandbox, plugins::SEND_INVOICE_EMAIL, payload).unwrap_err();
        assert_eq!(err.class, ErrorClass::Permanent, "{payload}");
        assert_eq!(err.code, "payload_invalid", "{payload}");
    }
}

#[test]
fn order_sync_returns_a_webhook_and_a_child_invoice_job() {
    let sandbox = sandbox();
    let effects = run(
        &sandbox,
        plugins::ORDER_SYNC,
        r#"{"order_id": 7, "event_id": "evt_1", "destination": "acme"}"#,
    )
    .unwrap();
    let keys: Vec<_> = effects
        .iter()
        .map(|e| (e.provider.as_str(), e.idempotency_key.as_str()))
        .collect();
    assert_eq!(
        keys,
        [
            ("partner", "webhook:evt_1:acme"),
            ("jobs", "order:7:invoice")
        ]
    );
    match &effects[0].action {
        Action::Http {
            method, path, body, ..
        } => {
            assert_eq!(method, "POST");
            assert_eq!(path, "/partners/acme/orders");
            let body: serde_json::Value = serde_json::from_slice(body.as_deref().unwrap()).unwrap();
            assert_eq!(
                body,
                serde_json::json!({"order_id": 7, "event_id": "evt_1"})
            );
        }
        other => panic!("expected http, got {other:?}"),
    }
    match &effects[1].action {
        Action::Enqueue {
            plugin, payload, ..
        } => {
            assert_eq!(plugin, "send_invoice_email");
            let payload: serde_json::Value = serde_json::from_slice(payload).unwrap();
            assert_eq!(payload["invoice_id"], 7);
        }
        other => panic!("expected enqueue, got {other:?}"),
    }
}

#[test]
fn noop_returns_nothing() {
    assert!(run(&sandbox(), plugins::NOOP, "{}").unwrap().is_empty());
}

#[test]
fn an_endless_loop_stops_at_its_deadline() {
    let sandbox = sandbox();
    let (err, took) = failure(&sandbox, plugins::HOSTILE_LOOP);
    assert_eq!(err.code, "plugin_timeout", "{err}");
    assert_eq!(err.class, ErrorClass::Retryable);
    // The manifest sets 300 ms; allow for a slow shared machine.
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(took >= Duration::from_millis(300), "took {took:?}");
    assert_still_serving(&sandbox);
}

#[test]
fn looping_plugins_sharing_one_thread_each_stop_at_their_wall_clock_deadline() {
    // A deadline is wall-clock time: a loop that is polled one tick in
    // sixteen still stops 300 ms after it began, not after 300 ticks of its own.
    let sandbox = sandbox();
    let looping = load(&sandbox, plugins::HOSTILE_LOOP);
    assert_eq!(looping.compiled.limits.deadline, Duration::from_millis(300));
    let one_thread = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let failures = one_thread.block_on(async {
        let input = job("{}");
        let calls = (0..16).map(|_| sandbox.call(&looping.compiled, &input));
        futures::future::join_all(calls).await
    });
    let took = started.elapsed();
    for failure in failures {
        assert_eq!(plugin_failure(failure.unwrap_err()).code, "plugin_timeout");
    }
    // Counted in each loop's own ticks, sixteen loops would take 16 × 300 ms.
    assert!(took < Duration::from_millis(2_500), "took {took:?}");
    assert_still_serving(&sandbox);
}

#[test]
fn a_blocking_run_on_a_runtime_thread_still_stops_a_loop_at_its_deadline() {
    // `Sandbox::run` blocks its thread; on a tokio worker thread a yield to
    // tokio would never be polled again, and the loop would never stop.
    let sandbox = sandbox();
    let looping = load(&sandbox, plugins::HOSTILE_LOOP);
    let (done, finished) = std::sync::mpsc::channel();
    let runner = std::thread::spawn(move || {
        let one_thread = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ran = one_thread.block_on(async { sandbox.run(&looping.compiled, &job("{}")) });
        let _ = done.send(ran);
    });
    let ran = finished
        .recv_timeout(Duration::from_secs(30))
        .expect("the blocking run never returned");
    assert_eq!(plugin_failure(ran.unwrap_err()).code, "plugin_timeout");
    runner.join().unwrap();
}

#[test]
fn fuel_budgets_stop_a_loop_too() {
    let sandbox = Sandbox::new(SandboxConfig {
        fuel: true,
        ..SandboxConfig::default()
    })
    .unwrap();
    let mut plugin = load(&sandbox, plugins::HOSTILE_LOOP);
    plugin.compiled.limits.fuel = Some(1_000_000);
    plugin.compiled.limits.deadline = Duration::from_secs(30);
    let err = plugin_failure(sandbox.run(&plugin.compiled, &job("{}")).unwrap_err());
    assert_eq!(err.code, "plugin_timeout");
    assert!(err.message.contains("fuel"), "{err}");
}

#[test]
fn a_one_gib_allocation_is_refused_as_out_of_memory() {
    let sandbox = sandbox();
    let (err, _) = failure(&sandbox, plugins::HOSTILE_MEMORY_BOMB);
    assert_eq!(err.code, "plugin_out_of_memory", "{err}");
    assert!(err.message.contains("cap"), "{err}");
    assert_still_serving(&sandbox);
}

#[test]
fn unbounded_recursion_is_a_stack_overflow() {
    let sandbox = sandbox();
    let (err, _) = failure(&sandbox, plugins::HOSTILE_RECURSION);
    assert_eq!(err.code, "plugin_stack_overflow", "{err}");
    assert_still_serving(&sandbox);
}

#[test]
fn a_million_effects_are_refused_as_output_too_large() {
    let sandbox = sandbox();
    let (err, _) = failure(&sandbox, plugins::HOSTILE_EFFECT_FLOOD);
    assert_eq!(err.code, "plugin_output_too_large", "{err}");
    assert_eq!(err.class, ErrorClass::Permanent);
    assert!(err.message.contains("output caps"), "{err}");
    assert_still_serving(&sandbox);
}

#[test]
fn a_100_mib_string_is_refused_as_output_too_large() {
    let sandbox = sandbox();
    let (err, _) = failure(&sandbox, plugins::HOSTILE_HUGE_STRING);
    assert_eq!(err.code, "plugin_output_too_large", "{err}");
    assert!(err.message.len() < 1000);
    assert_still_serving(&sandbox);
}

#[test]
fn sleeping_is_refused_at_once_instead_of_blocking_past_the_deadline() {
    let sandbox = sandbox();
    let (err, took) = failure(&sandbox, plugins::HOSTILE_SLEEP);
    assert_eq!(err.code, "plugin_forbidden_call", "{err}");
    assert!(err.message.contains("sleep"), "{err}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_still_serving(&sandbox);
}

#[test]
fn a_panic_is_classified_with_its_message() {
    let sandbox = sandbox();
    let (err, _) = failure(&sandbox, plugins::HOSTILE_PANIC);
    assert_eq!(err.code, "plugin_panic", "{err}");
    assert!(err.message.contains("gave up on purpose"), "{err}");
    assert_still_serving(&sandbox);
}

#[test]
fn the_escape_plugin_sees_files_env_and_network_refused() {
    let sandbox = sandbox();
    let effects = run(&sandbox, plugins::HOSTILE_ESCAPE, "{}").unwrap();
    let Action::Custom { body } = &effects[0].action else {
        panic!("expected a report");
    };
    let report: serde_json::Value = serde_json::from_slice(body).unwrap();
    for what in ["file", "dir", "env", "tcp"] {
        let outcome = report[what].as_str().unwrap();
        assert!(
            outcome.starts_with("error"),
            "{what} was not refused: {outcome}"
        );
    }
}

#[test]
fn a_forbidden_import_is_rejected_at_load_naming_the_import() {
    let sandbox = sandbox();
    let err = idem::plugins::registry::load_file(
        &sandbox,
        std::path::Path::new(plugins::HOSTILE_FORBIDDEN_IMPORT),
    )
    .unwrap_err();
    let message = err.to_string();
    assert!(message.contains("evil:plugin/exfiltrate"), "{message}");
    assert!(message.contains("does not provide"), "{message}");
}

#[test]
fn limits_beyond_the_host_are_refused_at_load() {
    let sandbox = Sandbox::new(SandboxConfig {
        max_memory: 128 << 20,
        ..SandboxConfig::default()
    })
    .unwrap();
    let wasm = std::fs::read(plugins::NOOP).unwrap();
    let greedy = idem::sandbox::PluginLimits {
        memory: 512 << 20,
        ..Default::default()
    };
    let err = sandbox.load("noop", &wasm, greedy).unwrap_err().to_string();
    assert!(err.contains("max_memory_mib"), "{err}");
    let fueled = idem::sandbox::PluginLimits {
        fuel: Some(1000),
        ..Default::default()
    };
    let err = sandbox.load("noop", &wasm, fueled).unwrap_err().to_string();
    assert!(err.contains("fuel = true"), "{err}");
}

#[test]
fn garbage_is_not_a_component() {
    let sandbox = sandbox();
    let err = sandbox
        .load("junk", b"definitely not wasm", Default::default())
        .unwrap_err();
    assert!(
        matches!(err, idem::sandbox::SandboxError::NotAComponent(_)),
        "{err}"
    );
    // A core module is WebAssembly but not a component.
    let core = b"\0asm\x01\0\0\0";
    assert!(sandbox.load("core", core, Default::default()).is_err());
}

#[test]
fn each_job_gets_a_fresh_instance() {
    // The same plugin run many times on one engine: no state survives a job,
    // and the pool does not leak slots.
    let sandbox = sandbox();
    let plugin = load(&sandbox, plugins::SEND_INVOICE_EMAIL);
    for i in 0..500 {
        let payload = format!(r#"{{"invoice_id": {i}, "recipient": "a@example.com"}}"#);
        let effects = sandbox.run(&plugin.compiled, &job(&payload)).unwrap();
        assert_eq!(effects[0].idempotency_key, format!("invoice:{i}:email:v1"));
    }
}

#[test]
fn the_component_cache_is_reused_across_engines() {
    let cache = tempfile::tempdir().unwrap();
    let config = SandboxConfig {
        cache_dir: Some(cache.path().to_path_buf()),
        ..SandboxConfig::default()
    };
    let wasm = std::fs::read(plugins::NOOP).unwrap();
    let first = Sandbox::new(config.clone()).unwrap();
    first.load("noop", &wasm, Default::default()).unwrap();
    let entries: Vec<_> = std::fs::read_dir(cache.path()).unwrap().collect();
    assert_eq!(entries.len(), 1, "one artifact cached");
    let second = Sandbox::new(config).unwrap();
    let started = Instant::now();
    let plugin = second.load("noop", &wasm, Default::default()).unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(second.run(&plugin, &job("{}")).unwrap().is_empty());
    // A corrupted entry costs a recompile, never a failure.
    let entry = std::fs::read_dir(cache.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::write(&entry, b"garbage").unwrap();
    assert!(second.load("noop", &wasm, Default::default()).is_ok());
}

#[test]
fn the_registry_loads_the_folder_and_reports_bad_files_by_name() {
    let (dir, registry) = idem_tests::registry_copy();
    std::fs::write(dir.path().join("broken.wasm"), b"nope").unwrap();
    let report = registry.refresh();
    let failed: Vec<_> = report
        .errors
        .iter()
        .map(|(p, _)| p.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    assert_eq!(failed, ["broken.wasm", "hostile_forbidden_import.wasm"]);
    assert!(registry.get("send_invoice_email").is_some());
    assert!(registry.get("noop").is_some());
    assert!(registry.get("broken").is_none());
    // The manifest is applied.
    let looping = registry.get("hostile_loop").unwrap();
    assert_eq!(looping.compiled.limits.deadline, Duration::from_millis(300));
}

#[test]
fn replacing_a_file_while_running_switches_new_jobs_to_the_new_version() {
    let (dir, registry) = idem_tests::registry_copy();
    registry.refresh();
    let _watcher = registry.watch().unwrap();
    let before = registry.get("noop").unwrap();
    let target = dir.path().join("noop.wasm");
    std::fs::copy(plugins::SEND_INVOICE_EMAIL, &target).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = registry.get("noop").unwrap();
        if now.hash() != before.hash() {
            // The new version really runs.
            let err = plugin_failure(
                registry
                    .sandbox()
                    .run(&now.compiled, &job("{}"))
                    .unwrap_err(),
            );
            assert_eq!(err.code, "payload_invalid");
            break;
        }
        assert!(Instant::now() < deadline, "the change was not picked up");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The old version keeps running for the jobs that hold it.
    assert!(
        registry
            .sandbox()
            .run(&before.compiled, &job("{}"))
            .unwrap()
            .is_empty()
    );
    // Removing a file removes the plugin (the watcher may see it first, so
    // the refresh need not be the one that reports it).
    std::fs::remove_file(&target).unwrap();
    registry.refresh();
    assert!(registry.get("noop").is_none(), "noop is gone");
    assert!(registry.list().iter().all(|p| p.name() != "noop"));
}

#[test]
fn a_full_instance_pool_is_unavailable_not_a_plugin_failure() {
    let sandbox = Sandbox::new(SandboxConfig {
        max_instances: 1,
        ..SandboxConfig::default()
    })
    .unwrap();
    let mut looping = load(&sandbox, plugins::HOSTILE_LOOP);
    looping.compiled.limits.deadline = Duration::from_secs(3);
    let noop = load(&sandbox, plugins::NOOP);
    std::thread::scope(|scope| {
        // The loop takes the only instance as soon as noop lets it go.
        let busy = scope.spawn(|| {
            loop {
                match sandbox.run(&looping.compiled, &job("{}")) {
                    Err(RunError::Unavailable(_)) => std::thread::yield_now(),
                    other => return other,
                }
            }
        });
        // Until the loop holds the only instance, noop still runs.
        let mut unavailable = None;
        while !busy.is_finished() {
            match sandbox.run(&noop.compiled, &job("{}")) {
                Ok(_) => std::thread::yield_now(),
                Err(error) => {
                    unavailable = Some(error);
                    break;
                }
            }
        }
        match unavailable {
            Some(RunError::Unavailable(_)) => {}
            other => panic!(
                "expected the pool to be full while the loop runs, got {other:?} (the loop: {:?})",
                busy.is_finished().then_some("finished")
            ),
        }
        let looped = plugin_failure(busy.join().unwrap().unwrap_err());
        assert_eq!(looped.code, "plugin_timeout");
    });
    // The instance is back: noop runs again.
    assert!(sandbox.run(&noop.compiled, &job("{}")).unwrap().is_empty());
}

/// `plugins::NOOP`'s bytes with `from` replaced by `to` inside its
/// declaration section (same length, so the component stays valid).
fn noop_with_declaration_bytes(from: &[u8], to: &[u8]) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let mut wasm = std::fs::read(plugins::NOOP).unwrap();
    let marker = b"\x14idem-plugin-manifest{\"v\":1,";
    let at = wasm
        .windows(marker.len())
        .position(|w| w == marker)
        .expect("noop carries its declaration section");
    let end = (at + marker.len() + 64).min(wasm.len());
    let offset = wasm[at..end]
        .windows(from.len())
        .position(|w| w == from)
        .expect("the text to replace");
    wasm[at + offset..at + offset + from.len()].copy_from_slice(to);
    wasm
}

/// `wasm` with a custom section appended at the component's top level.
fn with_custom_section(mut wasm: Vec<u8>, name: &str, data: &[u8]) -> Vec<u8> {
    fn leb(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            out.push(if n == 0 { byte } else { byte | 0x80 });
            if n == 0 {
                break;
            }
        }
    }
    let mut body = Vec::new();
    leb(name.len(), &mut body);
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    wasm.push(0);
    leb(body.len(), &mut wasm);
    wasm.extend_from_slice(&body);
    wasm
}

/// Loads `wasm` as `<dir>/<name>.wasm` with an optional operator file.
fn load_bytes(
    name: &str,
    wasm: &[u8],
    operator_file: Option<&str>,
) -> Result<idem::plugins::LoadedPlugin, String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{name}.wasm"));
    std::fs::write(&path, wasm).unwrap();
    if let Some(text) = operator_file {
        std::fs::write(path.with_extension("toml"), text).unwrap();
    }
    idem::plugins::registry::load_file(&sandbox(), &path).map_err(|e| e.to_string())
}

#[test]
fn the_built_plugins_carry_their_declarations_through_the_component_linker() {
    for (path, providers, enqueues) in [
        (plugins::SEND_INVOICE_EMAIL, &["email"][..], &[][..]),
        (
            plugins::ORDER_SYNC,
            &["partner", "jobs"][..],
            &["send_invoice_email"][..],
        ),
        (plugins::NOOP, &[][..], &[][..]),
        (plugins::HOSTILE_ESCAPE, &["report"][..], &[][..]),
    ] {
        let wasm = std::fs::read(path).unwrap();
        let declared = idem::plugins::grants::read_declaration(&wasm)
            .unwrap()
            .unwrap_or_else(|| panic!("{path} has no declaration"));
        assert_eq!(declared.providers, providers, "{path}");
        assert_eq!(declared.enqueues, enqueues, "{path}");
    }
    let wasm = std::fs::read(plugins::HOSTILE_FORBIDDEN_IMPORT).unwrap();
    assert_eq!(
        idem::plugins::grants::read_declaration(&wasm).unwrap(),
        None,
        "built without the SDK: nothing declared"
    );
}

#[test]
fn a_malformed_declaration_is_a_load_error_naming_the_section() {
    let bad = noop_with_declaration_bytes(b"\"enqueues\"", b"\"enqueuez\"");
    let error = load_bytes("noop", &bad, None).unwrap_err();
    assert!(error.contains("idem-plugin-manifest"), "{error}");
    assert!(error.contains("unknown field"), "{error}");
    let future = noop_with_declaration_bytes(b"\"v\":1", b"\"v\":7");
    let error = load_bytes("noop", &future, None).unwrap_err();
    assert!(error.contains("version 7"), "{error}");
    // The registry names the file.
    let (dir, registry) = idem_tests::registry_copy();
    std::fs::write(dir.path().join("noop.wasm"), &bad).unwrap();
    let report = registry.refresh();
    assert!(
        report
            .errors
            .iter()
            .any(|(path, why)| path.ends_with("noop.wasm") && why.contains("idem-plugin-manifest")),
        "{:?}",
        report.errors
    );
}

#[test]
fn an_oversized_or_repeated_declaration_is_refused() {
    let renamed = noop_with_declaration_bytes(b"manifest{", b"manifesX{");
    let huge = vec![b' '; idem_sdk::declaration::MAX_SECTION_LEN + 1];
    let oversized = with_custom_section(renamed, "idem-plugin-manifest", &huge);
    let error = load_bytes("noop", &oversized, None).unwrap_err();
    assert!(error.contains("at most"), "{error}");
    let twice = with_custom_section(
        std::fs::read(plugins::NOOP).unwrap(),
        "idem-plugin-manifest",
        br#"{"v":1,"providers":["email"],"enqueues":[]}"#,
    );
    let error = load_bytes("noop", &twice, None).unwrap_err();
    assert!(error.contains("appears 2 times"), "{error}");
}

#[test]
fn the_operator_file_narrows_and_never_widens_the_declaration() {
    let wasm = std::fs::read(plugins::SEND_INVOICE_EMAIL).unwrap();
    let narrowed = load_bytes("send_invoice_email", &wasm, Some("providers = []")).unwrap();
    assert!(!narrowed.grants.allows_provider("email"));
    assert!(narrowed.grants.is_narrowed());
    let error = load_bytes(
        "send_invoice_email",
        &wasm,
        Some("providers = [\"email\", \"partner\"]"),
    )
    .unwrap_err();
    assert!(error.contains("\"partner\""), "{error}");
    assert!(error.contains("can only narrow"), "{error}");
}

#[test]
fn a_component_without_a_declaration_takes_its_grants_from_the_operator_file() {
    let undeclared = noop_with_declaration_bytes(b"manifest{", b"manifesX{");
    let bare = load_bytes("legacy", &undeclared, None).unwrap();
    assert_eq!(bare.grants.declared(), None);
    assert!(!bare.grants.allows_provider("email"));
    let granted = load_bytes("legacy", &undeclared, Some("providers = [\"email\"]")).unwrap();
    assert!(granted.grants.allows_provider("email"));
}
