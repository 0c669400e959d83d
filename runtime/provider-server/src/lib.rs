//! The local provider server: a real HTTP server that behaves like an idempotent
//! provider (Stripe / Resend style `Idempotency-Key` semantics) and counts how often each
//! business effect was *applied*, so tests, the demo and benchmarks can check
//! exactly-once effects while the runtime retries.
//!
//! # Endpoints
//! - `POST /emails`: Resend-like email API, answers 200 `{"id": "msg_<hex>"}`; a missing
//!   or empty `to`, or a recipient without `@`, answers 422 `invalid_recipient`.
//! - `GET /by-key/{key}` (the key percent-encoded): a lookup, answering the key's
//!   stored first 2xx response (same status and body, so `/id` reads its id) or 404
//!   `not_found`. It applies nothing and is not a request with the key: it is
//!   counted by [`ProviderServerHandle::lookups`] and recorded in `GET /_calls`
//!   (without a key). Faults reach it by header, by path script (the path as
//!   sent, percent-encoded) and by the random rates, never by key script.
//!   [`ProviderServerHandle::set_lookup_lies`] makes it answer 404 for every key.
//! - any other method and path: a generic webhook/API, answers 200
//!   `{"id": "req_<hex>", "received": true}`.
//! - `GET /_calls`, `GET /_effects`, `POST /_reset`, `POST /_faults`, `GET /_health`:
//!   control paths (other `/_...` paths are 404).
//!
//! # Idempotency
//! The first 2xx response for a key is stored for `key_ttl` with the sha256 fingerprint
//! of the request body (JSON canonicalised) and replayed unchanged, with
//! `Idempotent-Replayed: true`, for every repeat with the same method, path and body;
//! the effect is not applied again. A different request with the same key gets 409
//! `idempotency_key_conflict`; a repeat while the first is still processing gets 409
//! `request_in_progress` with `Retry-After: 1`. Non-2xx answers are never stored, so a
//! failed attempt does not consume its key. Requests without a key are applied every
//! time and counted together under the key `""`.
//!
//! With `dedupe: false` the server is a provider that cannot dedupe: every request
//! it accepts is applied (and counted) again, repeats of a key included, so a test
//! sees a repeat as a second application; the first 2xx per key is still kept for
//! the lookup.
//!
//! # Faults
//! A request gets at most one fault, chosen in this order: the `X-Idem-Fault` header, the
//! next scripted fault for its key, the next scripted fault for its path (`/_faults` or
//! [`ProviderServerHandle::script_faults`]), then a random draw from
//! [`FaultConfig`] rates (random only when the key has no stored response).
//! `429`, `500` and `400` reject the request before the idempotency layer: nothing is
//! applied, the key is not consumed. `late` and `drop` disturb only the delivery: the
//! request is processed normally (applied, or replayed if the key is already stored) and
//! the answer comes `late_by` late, or the connection is closed without an answer.
//! Independently, a body containing one of [`FaultConfig::reject_matching`] gets 400.
//!
//! # Layout
//! - this crate's root: [`ProviderServerConfig`], [`serve`] and [`ProviderServerHandle`].
//! - `fault`: fault kinds and the random / rule based fault configuration.
//! - `state`: in-memory provider state and the request decision logic (no I/O).
//! - `http`: the axum application and a listener whose connections can be killed.
//!
//! It is a dev tool: it depends on no part of the `idem` runtime, and the runtime
//! library depends on it only through its optional `provider-server` feature (the
//! `idem provider-server` command).

mod fault;
mod http;
mod state;

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};

pub use fault::{Fault, FaultConfig, FaultConfigError, FaultSource, UnknownFault};
pub use state::{AppliedEffect, RecordedCall, UNKEYED};

use state::Shared;

/// Settings of the provider server.
///
/// ```
/// use std::time::Duration;
/// use idem_provider_server::ProviderServerConfig;
/// let config = ProviderServerConfig { late_by: Duration::from_millis(300), ..Default::default() };
/// assert_eq!(config.key_ttl, Duration::from_secs(24 * 3600));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderServerConfig {
    /// Random faults and reject rules.
    pub faults: FaultConfig,
    /// How long a stored response is replayed for its key (default 24 h).
    pub key_ttl: Duration,
    /// How late a [`Fault::Late`] answer comes (default 3 s).
    pub late_by: Duration,
    /// Time between accepting a request and applying it (default 0). During this window
    /// a concurrent duplicate gets 409 `request_in_progress`.
    pub processing_delay: Duration,
    /// Longest accepted `Idempotency-Key`, in bytes (default 256); longer keys get 400.
    pub max_key_len: usize,
    /// Lookups answer 404 even for applied keys (default false): a provider whose
    /// lookup lies, for tests of the documented risk.
    pub lookup_lies: bool,
    /// Whether a repeated key gets the stored first answer (default true). When
    /// false, every accepted request is applied again: a provider without
    /// deduplication, whose repeats the counts show.
    pub dedupe: bool,
}

impl Default for ProviderServerConfig {
    fn default() -> Self {
        Self {
            faults: FaultConfig::default(),
            key_ttl: Duration::from_secs(24 * 60 * 60),
            late_by: Duration::from_secs(3),
            processing_delay: Duration::ZERO,
            max_key_len: 256,
            lookup_lies: false,
            dedupe: true,
        }
    }
}

/// A command line flag of `idem provider-server` is invalid.
#[derive(Debug, thiserror::Error)]
pub enum ProviderServerConfigError {
    /// `--fault-rates` is invalid.
    #[error("invalid --fault-rates: {0}")]
    FaultRates(#[from] FaultConfigError),
    /// `--late-by` is not a duration such as `3s` or `300ms`.
    #[error("invalid --late-by: {0}")]
    LateBy(#[from] humantime::DurationError),
}

impl ProviderServerConfig {
    /// Builds the configuration from the `idem provider-server` flags
    /// (`--fault-rates 500=0.1,drop=0.01`, `--late-by 3s`, repeated `--reject-matching S`);
    /// `None` keeps the default.
    ///
    /// `let config = ProviderServerConfig::from_cli(Some("500=0.1"), Some("3s"), vec![])?;`
    pub fn from_cli(
        fault_rates: Option<&str>,
        late_by: Option<&str>,
        reject_matching: Vec<String>,
    ) -> Result<Self, ProviderServerConfigError> {
        let mut config = Self::default();
        if let Some(spec) = fault_rates {
            config.faults = FaultConfig::parse_rates(spec)?;
        }
        if let Some(late_by) = late_by {
            config.late_by = humantime::parse_duration(late_by.trim())?;
        }
        config.faults.reject_matching = reject_matching;
        Ok(config)
    }
}

/// Serves the provider on `listener` until `shutdown` completes, then finishes the
/// requests in flight (a `late` answer may take up to `late_by`).
///
/// Fails with `InvalidInput` when the fault rates are invalid.
///
/// `serve(TcpListener::bind("127.0.0.1:8025").await?, config, ctrl_c_future).await?;`
pub async fn serve(
    listener: TcpListener,
    config: ProviderServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    config
        .faults
        .validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    serve_shared(listener, Shared::new(config), shutdown).await
}

async fn serve_shared(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "provider server listening");
    }
    let app = http::router(shared).into_make_service_with_connect_info::<http::ConnHandle>();
    axum::serve(http::KillableListener(listener), app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// A provider server running in the background on `127.0.0.1`, with direct access to its
/// state. It stops when dropped or on [`ProviderServerHandle::shutdown`].
///
/// `let provider = ProviderServerHandle::start(ProviderServerConfig::default()).await?;`
pub struct ProviderServerHandle {
    /// The bound address.
    pub addr: SocketAddr,
    /// `http://127.0.0.1:PORT`, without trailing slash.
    pub base_url: String,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl ProviderServerHandle {
    /// Binds `127.0.0.1:0` and serves in a spawned task.
    ///
    /// `let provider = ProviderServerHandle::start(ProviderServerConfig::default()).await?;`
    pub async fn start(config: ProviderServerConfig) -> std::io::Result<Self> {
        config
            .faults
            .validate()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Shared::new(config);
        let (stop, stopped) = oneshot::channel::<()>();
        // A dropped sender also resolves the receiver, so dropping the handle stops it.
        let shutdown = async move {
            let _ = stopped.await;
        };
        let task = tokio::spawn(serve_shared(listener, Arc::clone(&shared), shutdown));
        Ok(Self {
            addr,
            base_url: format!("http://{addr}"),
            shared,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// `base_url` joined with `path` (which should start with `/`).
    ///
    /// `client.post(provider.url("/emails"))`
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url)
    }

    /// All recorded calls in arrival order (same data as `GET /_calls`).
    ///
    /// `let calls = provider.calls().await;`
    pub async fn calls(&self) -> Vec<RecordedCall> {
        self.shared.calls()
    }

    /// Applied-effect counters sorted by key (same data as `GET /_effects`).
    ///
    /// `let effects = provider.effects().await;`
    pub async fn effects(&self) -> Vec<AppliedEffect> {
        self.shared.effects()
    }

    /// How many times the effect for `key` was really applied (0 if never seen).
    /// Use [`UNKEYED`] for requests without a key.
    ///
    /// `assert_eq!(provider.applied("invoice:42:email:v1"), 1);`
    pub fn applied(&self, key: &str) -> u32 {
        self.shared.applied(key)
    }

    /// How many requests carried `key`, whatever their outcome.
    ///
    /// `assert_eq!(provider.requests("invoice:42:email:v1"), 3);`
    pub fn requests(&self, key: &str) -> u32 {
        self.shared.requests(key)
    }

    /// How many lookups (`GET /by-key/{key}`) asked about `key`, whatever their
    /// answer (lookups count neither as requests nor as applications).
    ///
    /// `assert_eq!(provider.lookups("billing/invoice-42"), 1);`
    pub fn lookups(&self, key: &str) -> u32 {
        self.shared.lookups(key)
    }

    /// Lookups answered, all keys together.
    ///
    /// `let asked = provider.lookups_total();`
    pub fn lookups_total(&self) -> u64 {
        self.shared.lookups_total()
    }

    /// Makes lookups answer 404 for every key (`true`), or tell the truth again.
    ///
    /// `provider.set_lookup_lies(true);`
    pub fn set_lookup_lies(&self, lies: bool) {
        self.shared.set_lookup_lies(lies);
    }

    /// Queues faults for the next requests carrying `key`, consumed in order.
    ///
    /// `provider.script_faults("invoice:42:email:v1", vec![Fault::Late]);`
    pub fn script_faults(&self, key: &str, faults: Vec<Fault>) {
        self.shared.script_key(key, faults);
    }

    /// Queues faults for the next requests to `path` that have no scripted key fault.
    ///
    /// `provider.script_path_faults("/emails", vec![Fault::ServerError]);`
    pub fn script_path_faults(&self, path: &str, faults: Vec<Fault>) {
        self.shared.script_path(path, faults);
    }

    /// Forgets every call, effect, stored response and scripted fault.
    ///
    /// `provider.reset();`
    pub fn reset(&self) {
        self.shared.reset();
    }

    /// Stops accepting connections and waits (at most `late_by` + 1 s) for the requests
    /// in flight.
    ///
    /// `provider.shutdown().await?;`
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let Some(mut task) = self.task.take() else {
            return Ok(());
        };
        let grace = self.shared.config.late_by + Duration::from_secs(1);
        match tokio::time::timeout(grace, &mut task).await {
            Ok(Ok(result)) => result,
            Ok(Err(join_error)) => Err(std::io::Error::other(join_error)),
            Err(_elapsed) => {
                task.abort();
                Ok(())
            }
        }
    }
}

impl Drop for ProviderServerHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl std::fmt::Debug for ProviderServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderServerHandle")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}
