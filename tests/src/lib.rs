//! Shared helpers for idem's whole-system tests: the built guest plugins and
//! ready-made sandboxes.

/// Paths of the guest plugins, built by `build.rs` from `plugins/`.
pub mod plugins {
    include!(concat!(env!("OUT_DIR"), "/gen.rs"));
}

use idem::plugins::{PluginRegistry, registry::load_file};
use idem::sandbox::{Sandbox, SandboxConfig};
use std::sync::Arc;

/// A sandbox with the default configuration (no disk cache).
pub fn sandbox() -> Arc<Sandbox> {
    Arc::new(Sandbox::new(SandboxConfig::default()).expect("sandbox"))
}

/// A sandbox with the default configuration and the on-disk cache of
/// compiled components that `idem run` has, in one folder for every test
/// process. Compiling the plugins folder anew for each test took about
/// 3.5 CPU-seconds a harness, most of the suite's time (effects.rs: 102 s
/// without it, 9 s with it); what the cache does to a load (a miss, a
/// broken entry) is tested in sandbox.rs with caches of its own.
pub fn cached_sandbox() -> Arc<Sandbox> {
    Arc::new(
        Sandbox::new(SandboxConfig {
            cache_dir: Some(std::env::temp_dir().join("idem-test-component-cache")),
            ..SandboxConfig::default()
        })
        .expect("sandbox"),
    )
}

/// A registry over a temporary copy of the built plugins folder, so tests can
/// add, replace and remove files; its sandbox is a [`cached_sandbox`].
pub fn registry_copy() -> (tempfile::TempDir, Arc<PluginRegistry>) {
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(plugins::PLUGINS_DIR).expect("plugins dir") {
        let path = entry.expect("entry").path();
        let dest = dir.path().join(path.file_name().expect("file name"));
        std::fs::copy(&path, dest).expect("copy plugin");
    }
    let registry = Arc::new(PluginRegistry::new(cached_sandbox(), dir.path()));
    (dir, registry)
}

/// Loads one built plugin (with its manifest) into `sandbox`.
pub fn load(sandbox: &Sandbox, path: &str) -> idem::plugins::LoadedPlugin {
    load_file(sandbox, std::path::Path::new(path)).expect("load plugin")
}

use idem::config::RetentionConfig;
use idem::providers::{ProviderConfig, Providers};
use idem::queue::backoff::Backoff;
use idem::queue::stats::StatsSnapshot;
use idem::queue::{Worker, WorkerSettings};
use idem::store::{Clock, Store};
use idem_provider_server::{ProviderServerConfig, ProviderServerHandle};
use std::collections::BTreeMap;
use std::time::Duration;

/// The two store backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A fresh SQLite file.
    Sqlite,
    /// A fresh schema on the local PostgreSQL (`DATABASE_URL` overrides).
    Postgres,
}

/// PostgreSQL for tests.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

/// A fresh, empty store; the guard keeps its file (SQLite) alive.
pub async fn store(backend: Backend) -> (Arc<dyn Store>, Box<dyn std::any::Any + Send>) {
    let (store, guard, _) = store_with_url(backend).await;
    (store, guard)
}

/// A fresh, empty store, with the URL another process opens it by.
pub async fn store_with_url(
    backend: Backend,
) -> (Arc<dyn Store>, Box<dyn std::any::Any + Send>, String) {
    match backend {
        Backend::Sqlite => {
            let dir = tempfile::tempdir().expect("tempdir");
            let url = format!("sqlite://{}", dir.path().join("idem.db").display());
            let store = idem::store::open(&url, Clock::Adjustable)
                .await
                .expect("sqlite store");
            (Arc::new(store), Box::new(dir), url)
        }
        Backend::Postgres => {
            let schema = format!("idem_e2e_{}", hex::encode(rand::random::<[u8; 8]>()));
            let store = idem::store::postgres::connect_with_schema(
                &database_url(),
                &schema,
                Clock::Adjustable,
            )
            .await
            .expect("postgres store (is PostgreSQL running on 127.0.0.1:5432?)");
            let url = format!("{}?options=-c%20search_path%3D{schema}", database_url());
            (Arc::new(store), Box::new(schema), url)
        }
    }
}

/// Generates one `#[tokio::test]` per backend for an `async fn(Backend)`.
#[macro_export]
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() { super::$name($crate::Backend::Sqlite).await }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() { super::$name($crate::Backend::Postgres).await }
            )*
        }
    };
}

/// A store, a provider server, a copy of the plugins folder and helpers to
/// run workers over them.
pub struct Harness {
    /// The store.
    pub store: Arc<dyn Store>,
    /// The local provider server.
    pub provider: ProviderServerHandle,
    /// Registry over `plugins_dir`.
    pub registry: Arc<PluginRegistry>,
    /// A temporary copy of the built plugins.
    pub plugins_dir: tempfile::TempDir,
    /// Provider request timeout.
    pub provider_timeout: Duration,
    /// The store's URL, for another process.
    pub url: String,
    _guard: Box<dyn std::any::Any + Send>,
}

impl Harness {
    /// A fresh harness on `backend`.
    pub async fn new(backend: Backend) -> Self {
        Self::with_provider(backend, ProviderServerConfig::default()).await
    }

    /// A fresh harness with a configured provider server.
    pub async fn with_provider(backend: Backend, config: ProviderServerConfig) -> Self {
        let (store, guard, url) = store_with_url(backend).await;
        let provider = ProviderServerHandle::start(config)
            .await
            .expect("provider server");
        let (plugins_dir, registry) = registry_copy();
        let report = registry.refresh();
        assert_eq!(
            report.errors.len(),
            1,
            "only the forbidden-import plugin fails: {:?}",
            report.errors
        );
        Harness {
            store,
            provider,
            registry,
            plugins_dir,
            // Well above a loopback call on a loaded 2-core CI machine (at
            // 500 ms, calls timed out under a parallel test run), well below
            // the 1.5 s of the provider server's `late` fault.
            provider_timeout: Duration::from_millis(1000),
            url,
            _guard: guard,
        }
    }

    /// Providers `email` and `partner`, both on the provider server (circuit
    /// breaker effectively off, so tests see every failure).
    pub fn providers(&self) -> Providers {
        self.providers_with("breaker_failures = 1000")
    }

    /// The same providers with extra settings (TOML lines) for each.
    pub fn providers_with(&self, extra: &str) -> Providers {
        let mut configs = BTreeMap::new();
        for (name, kind) in [("email", "email"), ("partner", "http")] {
            let config: ProviderConfig = toml_config(&format!(
                "kind = \"{kind}\"\nbase_url = \"{}\"\ntimeout = \"{}ms\"\n{extra}",
                self.provider.base_url,
                self.provider_timeout.as_millis()
            ));
            configs.insert(name.to_string(), config);
        }
        Providers::from_config(&configs).expect("providers")
    }

    /// Worker settings for tests: fast backoff and polling, drains and exits.
    pub fn settings(&self, id: &str) -> WorkerSettings {
        WorkerSettings {
            id: id.to_string(),
            queues: BTreeMap::from([("default".to_string(), 4)]),
            queue_limits: BTreeMap::new(),
            poll_interval: Duration::from_millis(50),
            lease: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(5),
            max_attempts: 5,
            backoff: Backoff {
                base: Duration::from_millis(20),
                max: Duration::from_millis(200),
            },
            redact_dead_payloads: false,
            retention: RetentionConfig::default(),
            exit_when_drained: true,
            ..WorkerSettings::from_config(&idem::config::Config::default())
        }
    }

    /// Runs a worker until the queue drains (panics after 60 s).
    pub async fn drain(&self) -> StatsSnapshot {
        self.drain_with(self.providers()).await
    }

    /// Runs a worker with these providers until the queue drains.
    pub async fn drain_with(&self, providers: Providers) -> StatsSnapshot {
        let worker = Worker::new(
            self.store.clone(),
            self.registry.clone(),
            providers,
            self.settings("test-worker"),
        );
        tokio::time::timeout(
            Duration::from_secs(60),
            worker.run(tokio_util::sync::CancellationToken::new()),
        )
        .await
        .expect("the queue drains within 60 s")
        .expect("worker")
    }

    /// The HTTP surface's state over this harness: its store, plugins and
    /// providers, behind `token`, replays paced at 1000/s; `worker` says
    /// whether a worker runs beside it.
    pub fn api_state(&self, token: &str, worker: bool) -> idem::ops::api::ApiState {
        idem::ops::api::ApiState {
            store: self.store.clone(),
            registry: Some(self.registry.clone()),
            providers: self.providers(),
            access: Arc::new(idem::ops::auth::Access::new(Some(
                idem::ops::auth::Tokens::new(token).expect("token"),
            ))),
            metrics: None,
            metrics_open: false,
            replay: Arc::new(idem::ops::replay::Pacer::per_second(1000.0).expect("rate")),
            default_max_attempts: 5,
            worker,
            preview: Arc::new(idem::ops::preview::PreviewGate::per_second(1000.0).expect("rate")),
            schedules: Arc::from(Vec::new()),
        }
    }

    /// Writes a manifest for a plugin in the copied folder and reloads.
    pub fn set_manifest(&self, plugin: &str, manifest: &str) {
        std::fs::write(
            self.plugins_dir.path().join(format!("{plugin}.toml")),
            manifest,
        )
        .expect("manifest");
        self.registry.refresh();
    }

    /// An `idem.toml` for an `idem run` process on this harness: its store,
    /// its plugins, providers `email` and `partner` on its provider server,
    /// with `lease` as the worker's lease.
    pub fn config_file(&self, lease: Duration) -> tempfile::NamedTempFile {
        self.config_file_with(lease, "")
    }

    /// As [`Harness::config_file`], with `extra` lines in each provider's
    /// table (e.g. `dedupes = false`).
    pub fn config_file_with(&self, lease: Duration, extra: &str) -> tempfile::NamedTempFile {
        let mut text = format!(
            "database_url = \"{}\"\nplugins_dir = \"{}\"\n\n[worker]\nqueues = {{ default = 2 }}\n\
             poll_interval = \"50ms\"\nlease = \"{}ms\"\nshutdown_grace = \"200ms\"\n\
             backoff_base = \"20ms\"\nbackoff_max = \"200ms\"\n",
            self.url,
            self.plugins_dir.path().display(),
            lease.as_millis()
        );
        for (name, kind) in [("email", "email"), ("partner", "http")] {
            text.push_str(&format!(
                "\n[providers.{name}]\nkind = \"{kind}\"\nbase_url = \"{}\"\ntimeout = \"{}ms\"\nbreaker_failures = 1000\n{extra}\n",
                self.provider.base_url,
                self.provider_timeout.as_millis()
            ));
        }
        let file = tempfile::Builder::new()
            .suffix(".toml")
            .tempfile()
            .expect("config file");
        std::fs::write(file.path(), text).expect("write the config");
        file
    }
}

fn toml_config(text: &str) -> ProviderConfig {
    toml::from_str(text).expect("provider config")
}

/// Starts `idem` (the test binary `exe`, built with failpoints) as
/// `idem --config CONFIG run ARGS..` with `failpoints` armed
/// (`IDEM_FAILPOINTS`): the process the fault-injection tests kill at a
/// failpoint. Killed when dropped.
pub fn spawn_run(
    exe: &str,
    config: &std::path::Path,
    args: &[&str],
    failpoints: &str,
) -> tokio::process::Child {
    tokio::process::Command::new(exe)
        .args(["--config"])
        .arg(config)
        .arg("run")
        .args(args)
        .env("IDEM_FAILPOINTS", failpoints)
        // The clock the tests move (`Store::clock_advance`).
        .env("IDEM_ADJUSTABLE_CLOCK", "1")
        .env("IDEM_LOG", "warn")
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-failpoint-test-cache"),
        )
        .env_remove("IDEM_DATABASE_URL")
        .env_remove("IDEM_CONFIG")
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("start {exe} run: {e}"))
}

/// [`spawn_run`] with `--exit-when-drained` and no summary: a worker that
/// stops once its queues are drained, unless a failpoint ends it first.
pub fn spawn_drain(exe: &str, config: &std::path::Path, failpoints: &str) -> tokio::process::Child {
    spawn_run(
        exe,
        config,
        &["--exit-when-drained", "--summary", "false"],
        failpoints,
    )
}
