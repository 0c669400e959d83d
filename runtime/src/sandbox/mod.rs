//! The plugin sandbox: one wasmtime [`Engine`], plugins compiled once, and a
//! fresh `Store` and instance for every job.
//!
//! Each job runs with a wall-clock deadline (epoch interruption), an optional
//! fuel budget, a memory cap, the engine's stack limit and a deny-by-default
//! WASI context. Every way a call can fail becomes a classified [`Failure`];
//! nothing a plugin does can crash the host.
//!
//! # Layout
//! - [`engine`]: engine configuration (pooling allocator, keep-resident
//!   memory, epoch ticker).
//! - [`cache`]: the on-disk cache of precompiled components.
//! - [`guest`]: per-job store data (WASI context, captured output, limiter, `log`).
//! - [`classify`]: turning traps and plugin errors into [`Failure`]s.
//! - [`bindings`]: generated from `wit/`.

pub mod bindings;
pub mod cache;
pub mod classify;
pub mod engine;
pub mod guest;

use crate::effects::{Effect, OutputLimits};
use crate::failure::{Code, Failure};
use bindings::{JobPlugin, JobPluginPre};
use guest::GuestState;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Engine, Store, UpdateDeadline};

pub use engine::SandboxConfig;

/// Errors building the sandbox or loading a plugin.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The engine could not be configured.
    #[error("cannot configure the wasm engine: {0}")]
    Engine(String),
    /// The file is not a valid component (or not WebAssembly at all).
    #[error("not a valid WebAssembly component: {0}")]
    NotAComponent(String),
    /// The component imports something the host does not provide.
    #[error("imports something idem does not provide: {0}")]
    ForbiddenImport(String),
    /// The component does not export the `idem:plugin/job-plugin` world.
    #[error("does not implement the idem:plugin/job-plugin world: {0}")]
    WrongWorld(String),
    /// Reading the file failed.
    #[error("cannot read: {0}")]
    Io(#[from] std::io::Error),
    /// The plugin's limits exceed what this host allows.
    #[error("limits not allowed: {0}")]
    Limits(String),
}

/// Result alias of this module.
pub type Result<T, E = SandboxError> = std::result::Result<T, E>;

/// Per-plugin limits for one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginLimits {
    /// Wall-clock deadline of one call.
    #[serde(with = "humantime_serde")]
    pub deadline: Duration,
    /// Optional fuel budget (roughly, wasm instructions).
    pub fuel: Option<u64>,
    /// Linear memory cap in bytes.
    pub memory: usize,
    /// Caps on the returned plan.
    pub output: OutputLimits,
}

impl Default for PluginLimits {
    fn default() -> Self {
        PluginLimits {
            deadline: Duration::from_secs(10),
            fuel: None,
            memory: 64 << 20,
            output: OutputLimits::default(),
        }
    }
}

/// A content hash (SHA-256, hex) identifying one version of a plugin.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ContentHash(pub String);

impl ContentHash {
    /// Hashes `bytes`.
    ///
    /// ```
    /// let h = idem::sandbox::ContentHash::of(b"");
    /// assert!(h.0.starts_with("e3b0c442"));
    /// ```
    pub fn of(bytes: &[u8]) -> Self {
        ContentHash(hex::encode(Sha256::digest(bytes)))
    }

    /// The first 12 hex digits, for display.
    pub fn short(&self) -> &str {
        &self.0[..self.0.len().min(12)]
    }
}

impl std::fmt::Display for ContentHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A plugin compiled and linked, ready to instantiate once per job.
#[derive(Clone)]
pub struct CompiledPlugin {
    /// Plugin name (the `.wasm` file stem).
    pub name: Arc<str>,
    /// Content hash of the `.wasm` file.
    pub hash: ContentHash,
    /// Size of the `.wasm` file in bytes.
    pub size: u64,
    /// Limits applied to each job.
    pub limits: PluginLimits,
    pre: JobPluginPre<GuestState>,
}

impl std::fmt::Debug for CompiledPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledPlugin")
            .field("name", &self.name)
            .field("hash", &self.hash)
            .field("size", &self.size)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// What the sandbox hands a plugin: one delivery of a job.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobInput {
    /// Job id.
    pub id: i64,
    /// Queue.
    pub queue: String,
    /// Payload bytes.
    pub payload: Vec<u8>,
    /// 1 for the first delivery.
    pub attempt: u32,
    /// Attempts before dead-lettering.
    pub max_attempts: u32,
    /// The job's own key.
    pub idempotency_key: Option<String>,
    /// Correlation id.
    pub correlation_id: String,
    /// Enqueue time, ms since the epoch.
    pub enqueued_at_ms: i64,
}

/// The sandbox: one engine, one linker, an epoch ticker.
///
/// ```no_run
/// use idem::sandbox::{Sandbox, SandboxConfig, PluginLimits, JobInput};
/// let sandbox = Sandbox::new(SandboxConfig::default())?;
/// let plugin = sandbox.load("noop", &std::fs::read("noop.wasm")?, PluginLimits::default())?;
/// let effects = sandbox.run(&plugin, &JobInput { payload: b"{}".to_vec(), ..Default::default() });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Sandbox {
    engine: Engine,
    linker: Linker<GuestState>,
    config: SandboxConfig,
    ticker: engine::EpochTicker,
}

impl Sandbox {
    /// Builds the engine and the linker (WASI with an empty context, plus `log`).
    pub fn new(config: SandboxConfig) -> Result<Self> {
        let engine = engine::build(&config)?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(|e| SandboxError::Engine(format!("{e:#}")))?;
        guest::forbid_sleeping(&mut linker).map_err(|e| SandboxError::Engine(format!("{e:#}")))?;
        JobPlugin::add_to_linker::<GuestState, HasSelf<GuestState>>(&mut linker, |s| s)
            .map_err(|e| SandboxError::Engine(format!("{e:#}")))?;
        let ticker = engine::EpochTicker::start(engine.clone(), config.epoch_tick)?;
        Ok(Sandbox {
            engine,
            linker,
            config,
            ticker,
        })
    }

    /// The engine's configuration.
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// Compiles (or loads from the cache) and links a plugin, checking it
    /// against the contract without running it.
    pub fn load(&self, name: &str, wasm: &[u8], limits: PluginLimits) -> Result<CompiledPlugin> {
        if limits.memory > self.config.max_memory {
            return Err(SandboxError::Limits(format!(
                "the plugin asks for {} MiB of memory; this host allows at most {} MiB ([sandbox] max_memory_mib)",
                limits.memory >> 20,
                self.config.max_memory >> 20
            )));
        }
        if limits.fuel.is_some() && !self.config.fuel {
            return Err(SandboxError::Limits(
                "the plugin sets a fuel budget but fuel metering is off: set `fuel = true` under [sandbox] in idem.toml"
                    .into(),
            ));
        }
        let hash = ContentHash::of(wasm);
        let component = self.component(&hash, wasm)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| SandboxError::ForbiddenImport(format!("{e:#}")))?;
        let pre = JobPluginPre::new(pre).map_err(|e| SandboxError::WrongWorld(format!("{e:#}")))?;
        Ok(CompiledPlugin {
            name: Arc::from(name),
            hash,
            size: wasm.len() as u64,
            limits,
            pre,
        })
    }

    fn component(&self, hash: &ContentHash, wasm: &[u8]) -> Result<Component> {
        match &self.config.cache_dir {
            Some(dir) => cache::load_or_compile(&self.engine, dir, hash, wasm),
            None => Component::new(&self.engine, wasm)
                .map_err(|e| SandboxError::NotAComponent(format!("{e:#}"))),
        }
    }

    /// Runs one job in a fresh instance and returns its checked effect plan,
    /// or why not: a classified plugin failure, or no instance free (not the
    /// plugin's doing). The call runs on the task that awaits it; the guest
    /// yields to the executor at every epoch tick, so a looping plugin
    /// shares its worker thread, and it ends at the plugin's (wall-clock)
    /// deadline. Instantiation and tear-down do not yield (a few µs).
    /// Dropping the future stops the call at once.
    ///
    /// `let effects = sandbox.call(&plugin, &job).await?;`
    pub async fn call(
        &self,
        plugin: &CompiledPlugin,
        job: &JobInput,
    ) -> Result<Vec<Effect>, RunError> {
        self.call_yielding(plugin, job, Yield::ToTokio).await
    }

    /// A panic in host code during the call (WASI, an import, the plan's
    /// checks) fails this call as a plugin trap instead of unwinding into
    /// the caller: a queue's handler, an API request. The store, its fiber
    /// and its pooled slot are dropped on the way out; what the call shares
    /// (engine, linker, ticker) holds no state a panic could leave broken.
    async fn call_yielding(
        &self,
        plugin: &CompiledPlugin,
        job: &JobInput,
        yielding: Yield,
    ) -> Result<Vec<Effect>, RunError> {
        let call = self.call_unguarded(plugin, job, yielding);
        futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(call))
            .await
            .unwrap_or_else(|panic| {
                let message = panic
                    .downcast_ref::<&str>()
                    .copied()
                    .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                    .unwrap_or("no message");
                Err(RunError::Plugin(Failure::host(
                    Code::PluginTrap,
                    format!("the sandbox panicked: {message}"),
                )))
            })
    }

    async fn call_unguarded(
        &self,
        plugin: &CompiledPlugin,
        job: &JobInput,
        yielding: Yield,
    ) -> Result<Vec<Effect>, RunError> {
        let limits = &plugin.limits;
        let _running = self.ticker.enter();
        let state = GuestState::new(job.id, plugin.name.clone(), limits.memory);
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.set_hostcall_fuel(classify::hostcall_fuel(&limits.output));
        // Every tick the call yields, until its deadline: wall-clock time
        // since the call began, however long it waited to be polled again.
        let deadline = std::time::Instant::now() + limits.deadline;
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |_| {
            Ok(if std::time::Instant::now() >= deadline {
                UpdateDeadline::Interrupt
            } else {
                UpdateDeadline::YieldCustom(1, yielding.now())
            })
        });
        if self.config.fuel {
            let fuel = limits.fuel.unwrap_or(u64::MAX);
            store.set_fuel(fuel).map_err(|e| {
                RunError::Plugin(Failure::host(
                    Code::PluginTrap,
                    format!("cannot set fuel: {e:#}"),
                ))
            })?;
        }
        let input = bindings::idem::plugin::types::Job {
            id: job.id,
            plugin: plugin.name.to_string(),
            queue: job.queue.clone(),
            payload: job.payload.clone(),
            attempt: job.attempt,
            max_attempts: job.max_attempts,
            idempotency_key: job.idempotency_key.clone(),
            correlation_id: job.correlation_id.clone(),
            enqueued_at_ms: job.enqueued_at_ms,
        };
        let instance = match plugin.pre.instantiate_async(&mut store).await {
            Ok(instance) => instance,
            Err(error)
                if error
                    .downcast_ref::<wasmtime::PoolConcurrencyLimitError>()
                    .is_some() =>
            {
                // Not the plugin's doing (every pooled instance is in use):
                // the job is deferred, not charged.
                return Err(RunError::Unavailable(format!("{error:#}")));
            }
            Err(error) => {
                return Err(RunError::Plugin(classify::trap(
                    &error,
                    limits,
                    &store.data().stderr.text(),
                )));
            }
        };
        let outcome = instance.call_handle(&mut store, &input).await;
        let state = store.data();
        state.flush_output();
        let returned = match outcome {
            Ok(returned) => returned,
            Err(error) => {
                return Err(RunError::Plugin(classify::trap(
                    &error,
                    limits,
                    &state.stderr.text(),
                )));
            }
        };
        drop(store);
        match returned {
            Ok(effects) => Ok(classify::effects(effects, &limits.output)?),
            Err(error) => Err(RunError::Plugin(classify::plugin_error(
                error,
                &limits.output,
            ))),
        }
    }

    /// [`Sandbox::call`] on the calling thread, blocking it for at most the
    /// plugin's deadline: for tools and tests outside an async context.
    ///
    /// `let effects = sandbox.run(&plugin, &job)?;`
    pub fn run(&self, plugin: &CompiledPlugin, job: &JobInput) -> Result<Vec<Effect>, RunError> {
        futures::executor::block_on(self.call_yielding(plugin, job, Yield::ToCaller))
    }
}

/// How a long call yields at each epoch tick.
#[derive(Clone, Copy)]
enum Yield {
    /// To the tokio scheduler, which polls its other tasks first.
    ToTokio,
    /// Straight back to whoever polls the call (a blocking caller, which
    /// may even be a tokio worker thread: tokio's own yield would wait for
    /// that thread to park, which it never does while it blocks).
    ToCaller,
}

impl Yield {
    fn now(self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        match self {
            Yield::ToTokio => Box::pin(tokio::task::yield_now()),
            Yield::ToCaller => {
                let mut yielded = false;
                Box::pin(std::future::poll_fn(move |cx| {
                    if yielded {
                        std::task::Poll::Ready(())
                    } else {
                        yielded = true;
                        cx.waker().wake_by_ref();
                        std::task::Poll::Pending
                    }
                }))
            }
        }
    }
}

/// Why a run produced no plan.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The plugin failed (a trap, a limit, its own error, a bad plan).
    #[error("{0}")]
    Plugin(#[from] Failure),
    /// Every pooled instance is in use: not the plugin's doing, so the job
    /// is deferred without using an attempt.
    #[error("no sandbox instance is free: {0}")]
    Unavailable(String),
}

impl RunError {
    /// The plugin's failure, if it was one.
    ///
    /// ```
    /// use idem::{failure::Failure, sandbox::RunError};
    /// assert!(RunError::Unavailable("pool full".into()).plugin_failure().is_none());
    /// ```
    pub fn plugin_failure(&self) -> Option<&Failure> {
        match self {
            RunError::Plugin(failure) => Some(failure),
            RunError::Unavailable(_) => None,
        }
    }
}

/// Where precompiled components are cached by default.
pub fn default_cache_dir() -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|base| base.join("idem").join("components"))
}
