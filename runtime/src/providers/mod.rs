//! Providers: where effects are carried out. Each declares whether it
//! dedupes on the idempotency key natively, and classifies every failure.
//!
//! # Layout
//! - [`config`]: `[providers.NAME]` tables of `idem.toml`.
//! - [`http`]: the `http` and `email` providers (an HTTP API honouring `Idempotency-Key`).
//! - `lookup`: how an `http` or `email` provider is asked whether it applied a key.
//! - [`sql`]: the `sql` provider (declared statements, exactly once per database).
//! - [`guard`]: retry-storm protection per provider (concurrency, rate, circuit breaker).
//! - this module: the [`Provider`] trait and the [`Providers`] set built from config.
//!
//! The `jobs` provider is not here: a child job is enqueued in the same store
//! transaction that marks its effect done (see `effects::executor`).

pub mod config;
pub mod guard;
pub mod http;
mod lookup;
pub mod sql;

pub use config::ProviderConfig;

use crate::effects::Effect;
use crate::failure::Failure;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Name of the built-in provider that enqueues child jobs.
pub const JOBS_PROVIDER: &str = "jobs";

/// How a provider treats a repeated idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dedupe {
    /// Returns the original result for a repeated key within `window`.
    Native {
        /// How long the provider remembers a key.
        window: Duration,
    },
    /// Cannot dedupe: a retry after an ambiguous failure may repeat the effect.
    None,
}

/// What a successful call returned.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Delivered {
    /// The provider's reference (message id, request id ...).
    pub result_ref: Option<String>,
}

/// What a provider answered when asked whether it applied a key
/// ([`Provider::look_up`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// It carried the key's request out, with this reference (checked by
    /// the boundary's rule, as any provider answer).
    Applied {
        /// The provider's reference, if it gave one.
        result_ref: Option<String>,
    },
    /// It has no record of the key. Trusted only for a try older than the
    /// provider's timeout plus [`LookupPolicy::settle`] (a request still in
    /// flight, or a search index that lags, answers so too).
    NotApplied,
}

/// How a provider that can be asked about a key is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupPolicy {
    /// How long after a try's timeout a "not applied" becomes trustworthy
    /// (search-style lookups lag behind writes).
    pub settle: Duration,
    /// The longest one lookup may take.
    pub timeout: Duration,
}

impl LookupPolicy {
    /// How old a try must be (counted from its claim) before a "not
    /// applied" answer about it is trusted: the claim may be followed by a
    /// lookup (up to its timeout) before the call, the call may take up to
    /// `call_timeout`, and the provider's records may lag by `settle`.
    ///
    /// ```
    /// use idem::providers::LookupPolicy;
    /// use std::time::Duration;
    /// let policy = LookupPolicy { settle: Duration::from_secs(30), timeout: Duration::from_secs(5) };
    /// assert_eq!(policy.trusted_after(Duration::from_secs(10)), Duration::from_secs(45));
    /// ```
    pub fn trusted_after(&self, call_timeout: Duration) -> Duration {
        self.timeout + call_timeout + self.settle
    }
}

/// Asks `provider` whether it applied `key` ([`Provider::look_up`]),
/// bounded by `policy.timeout` whatever the provider does: past it, the
/// answer is `lookup_unavailable` (ask again later). The one way the
/// executor and the reconcile sweep ask.
///
/// `let answer = look_up_within(&*guarded.provider, policy, key, fingerprint).await;`
pub async fn look_up_within(
    provider: &dyn Provider,
    policy: LookupPolicy,
    key: &str,
    fingerprint: &str,
) -> Result<Lookup, Failure> {
    match tokio::time::timeout(policy.timeout, provider.look_up(key, fingerprint)).await {
        Ok(answer) => answer,
        Err(_) => Err(Failure::host(
            crate::failure::Code::LookupUnavailable,
            format!(
                "the lookup took longer than {}",
                humantime::format_duration(policy.timeout)
            ),
        )),
    }
}

/// A provider of effects.
///
/// ```no_run
/// # use idem::providers::{Provider, Delivered, Dedupe};
/// # use idem::{effects::Effect, failure::Failure};
/// struct Audit;
/// #[async_trait::async_trait]
/// impl Provider for Audit {
///     fn dedupe(&self) -> Dedupe { Dedupe::None }
///     async fn execute(&self, effect: &Effect) -> Result<Delivered, Failure> { Ok(Delivered::default()) }
/// }
/// ```
#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    /// Whether repeated keys are deduplicated by the provider itself.
    fn dedupe(&self) -> Dedupe;

    /// Carries one effect out, sending its idempotency key.
    async fn execute(&self, effect: &Effect) -> Result<Delivered, Failure>;

    /// Checks an effect of a fresh plan before the plan is stored; a
    /// failure (permanent) refuses the plan before anything runs.
    fn check(&self, _effect: &Effect) -> Result<(), Failure> {
        Ok(())
    }

    /// For a provider that writes to the store's own database: the
    /// statement to run in the transaction that marks the effect succeeded
    /// (see `Store::effect_succeed_with_statement`), instead of
    /// [`Provider::execute`]. `None` for every other provider.
    fn in_store_transaction(
        &self,
        _effect: &Effect,
    ) -> Option<Result<crate::store::StatementCall, Failure>> {
        None
    }

    /// The longest one call may take (the key's lease is sized from it).
    fn timeout(&self) -> Duration {
        Duration::from_secs(30)
    }

    /// How this provider is asked whether it applied a key; `None` when it
    /// cannot be asked (an effect in doubt then waits for an operator).
    fn lookup_policy(&self) -> Option<LookupPolicy> {
        None
    }

    /// Asks the provider whether it applied the request sent under `key`
    /// (the host's `PLUGIN/KEY`) with `fingerprint`. A failure of class
    /// retryable or ambiguous means it could not be asked now (ask again
    /// later); a permanent one that the answer fits neither outcome (the
    /// message says what was answered). Bounded by
    /// [`LookupPolicy::timeout`] and the provider's own lookup budget.
    ///
    /// `let answer = provider.look_up("billing/invoice-42", &fingerprint).await?;`
    async fn look_up(&self, key: &str, fingerprint: &str) -> Result<Lookup, Failure> {
        let _ = (key, fingerprint);
        Err(Failure::host(
            crate::failure::Code::LookupUnanswerable,
            "this provider offers no lookup",
        ))
    }
}

/// A configured provider with its retry-storm guard.
pub struct GuardedProvider {
    /// Provider name.
    pub name: String,
    /// The provider.
    pub provider: Arc<dyn Provider>,
    /// Its guard.
    pub guard: guard::Guard,
}

/// The providers of one runtime, by name.
#[derive(Default, Clone)]
pub struct Providers {
    by_name: BTreeMap<String, Arc<GuardedProvider>>,
}

/// A provider configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("provider {name:?}: {why}")]
pub struct ProviderConfigError {
    /// The provider.
    pub name: String,
    /// Why.
    pub why: String,
}

impl Providers {
    /// Builds every configured provider (secrets are read now, never passed
    /// to plugins); a `sql` provider with a `url` is another database.
    pub fn from_config(
        configs: &BTreeMap<String, ProviderConfig>,
    ) -> Result<Self, ProviderConfigError> {
        Self::for_store(configs, "")
    }

    /// As [`Providers::from_config`], for a runtime whose store is at
    /// `store_url`: a `sql` provider whose `url` is the same runs in the
    /// store's own transactions.
    pub fn for_store(
        configs: &BTreeMap<String, ProviderConfig>,
        store_url: &str,
    ) -> Result<Self, ProviderConfigError> {
        let mut providers = Providers::default();
        for (name, config) in configs {
            if name == JOBS_PROVIDER {
                return Err(ProviderConfigError {
                    name: name.clone(),
                    why: "`jobs` is built in and cannot be configured".into(),
                });
            }
            let why = |why| ProviderConfigError {
                name: name.clone(),
                why,
            };
            let provider: Arc<dyn Provider> = match config.kind {
                config::ProviderKind::Sql => {
                    Arc::new(sql::SqlProvider::from_config(name, config, store_url).map_err(why)?)
                }
                config::ProviderKind::Http | config::ProviderKind::Email => {
                    Arc::new(http::HttpProvider::from_config(name, config).map_err(why)?)
                }
            };
            providers.insert(name, provider, guard::Guard::new(&config.guard));
        }
        Ok(providers)
    }

    /// Adds (or replaces) a provider.
    pub fn insert(&mut self, name: &str, provider: Arc<dyn Provider>, guard: guard::Guard) {
        self.by_name.insert(
            name.to_string(),
            Arc::new(GuardedProvider {
                name: name.to_string(),
                provider,
                guard,
            }),
        );
    }

    /// A provider by name.
    pub fn get(&self, name: &str) -> Option<Arc<GuardedProvider>> {
        self.by_name.get(name).cloned()
    }

    /// The longest request timeout of any provider (zero when none).
    pub fn max_timeout(&self) -> Duration {
        self.by_name
            .values()
            .map(|p| p.provider.timeout())
            .max()
            .unwrap_or_default()
    }

    /// Every configured provider with its guard, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<GuardedProvider>> {
        self.by_name.values()
    }

    /// Names of the configured providers.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }
}
