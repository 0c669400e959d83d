//! Retry-storm protection per provider: a concurrency limit, a rate limit
//! (token bucket) and a circuit breaker that opens on sustained failures so
//! jobs are deferred instead of hammering a failing upstream.

use super::config::GuardConfig;
use crate::failure::ErrorClass;
use std::sync::{Arc, Mutex};
use std::time::Duration;
// tokio's clock, so tests move time with `tokio::time::pause` instead of sleeping.
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// The guard of one provider.
///
/// ```
/// use idem::providers::{config::GuardConfig, guard::Guard};
/// let guard = Guard::new(&GuardConfig { breaker_failures: 3, ..Default::default() });
/// assert!(!guard.is_open());
/// ```
pub struct Guard {
    slots: Arc<Semaphore>,
    rate: Option<Mutex<TokenBucket>>,
    breaker: Mutex<Breaker>,
    trials: std::sync::atomic::AtomicU64,
    config: GuardConfig,
}

/// Longest wait for a rate token ever answered.
const MAX_TOKEN_WAIT: Duration = Duration::from_secs(24 * 3600);

/// Permission to make one call; report its outcome with [`Permit::record`].
pub struct Permit<'a> {
    guard: &'a Guard,
    _slot: OwnedSemaphorePermit,
    /// The half-open trial this permit holds, by generation.
    trial: Option<u64>,
    settled: bool,
}

impl Permit<'_> {
    /// Feeds the breaker: success closes it; retryable or ambiguous failures
    /// count towards opening it; permanent ones (the upstream answered) do not.
    pub fn record(mut self, outcome: Result<(), ErrorClass>) {
        self.settled = true;
        self.guard.record(outcome, self.trial);
    }

    /// Gives the permit back unused (the provider was never called): the
    /// breaker learns nothing, a half-open trial goes to the next caller,
    /// and the rate token goes back (a key found done spends nothing).
    pub fn release(mut self) {
        self.settled = true;
        if let Some(trial) = self.trial {
            self.guard.release_trial(trial);
        }
        if let Some(rate) = &self.guard.rate {
            rate.lock().expect("rate poisoned").give_back();
        }
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if !self.settled {
            // Dropped mid-call: the upstream's answer is unknown.
            self.guard.record(Err(ErrorClass::Retryable), self.trial);
        }
    }
}

#[derive(Debug)]
enum Breaker {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// The generation of the trial call in flight, if any. Generations tell
    /// a stale permit (from before a re-open) from the current trial.
    HalfOpen {
        trial: Option<u64>,
    },
}

/// A token bucket of `per_second` tokens a second, holding at most one
/// second's worth (at least one token); the lookup budget uses it too.
pub(super) struct TokenBucket {
    tokens: f64,
    capacity: f64,
    per_second: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket; `None` for a rate of 0 (unlimited).
    pub(super) fn new(per_second: f64) -> Option<Self> {
        (per_second > 0.0).then(|| TokenBucket {
            tokens: per_second.max(1.0),
            capacity: per_second.max(1.0),
            per_second,
            last: Instant::now(),
        })
    }

    /// Returns a token taken for a call that was not made.
    fn give_back(&mut self) {
        self.tokens = (self.tokens + 1.0).min(self.capacity);
    }

    /// Takes a token, or says how long until one is there.
    pub(super) fn take(&mut self) -> Option<Duration> {
        let now = Instant::now();
        let elapsed = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.per_second).min(self.capacity);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            None
        } else {
            // A tiny rate would overflow a Duration: a day is as good as
            // forever for a caller that bounds its wait anyway.
            Some(
                Duration::try_from_secs_f64((1.0 - self.tokens) / self.per_second)
                    .unwrap_or(MAX_TOKEN_WAIT)
                    .min(MAX_TOKEN_WAIT),
            )
        }
    }
}

impl Guard {
    /// The circuit breaker's state: `closed`, `open` or `half_open`.
    pub fn circuit(&self) -> &'static str {
        match &*self.breaker.lock().unwrap_or_else(|p| p.into_inner()) {
            Breaker::Closed { .. } => "closed",
            Breaker::Open { until } if *until > Instant::now() => "open",
            Breaker::Open { .. } | Breaker::HalfOpen { .. } => "half_open",
        }
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> usize {
        self.config
            .concurrency
            .max(1)
            .saturating_sub(self.slots.available_permits())
    }

    /// A guard with this configuration.
    pub fn new(config: &GuardConfig) -> Self {
        let rate = TokenBucket::new(config.rate_per_second).map(Mutex::new);
        Guard {
            slots: Arc::new(Semaphore::new(config.concurrency.max(1))),
            rate,
            breaker: Mutex::new(Breaker::Closed { failures: 0 }),
            trials: std::sync::atomic::AtomicU64::new(0),
            config: config.clone(),
        }
    }

    /// Waits for a concurrency slot and a rate token, then asks the circuit:
    /// when it is open, [`CircuitOpen`] with the time left.
    /// The breaker is consulted last, with no await between its answer and
    /// the permit, so a dropped waiter can never leave a half-open trial taken.
    pub async fn enter(&self) -> Result<Permit<'_>, CircuitOpen> {
        if let Some(open) = self.open_for() {
            return Err(open);
        }
        // The semaphore is never closed; a closed one would mean "not now".
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| open(Duration::from_secs(1)))?;
        while let Some(wait) = self
            .rate
            .as_ref()
            .and_then(|r| r.lock().expect("rate poisoned").take())
        {
            tokio::time::sleep(wait).await;
        }
        let trial = self.admit()?;
        Ok(Permit {
            guard: self,
            _slot: slot,
            trial,
            settled: false,
        })
    }

    /// [`Guard::enter`] without waiting: `None` when a slot or a rate token
    /// is not free now (the caller may do what must not wait behind a
    /// limit first, then [`Guard::enter`]).
    ///
    /// ```
    /// use idem::providers::{config::GuardConfig, guard::Guard};
    /// let guard = Guard::new(&GuardConfig { concurrency: 1, ..Default::default() });
    /// let first = guard.try_enter().unwrap().unwrap();
    /// assert!(guard.try_enter().is_none(), "the only slot is taken");
    /// first.release();
    /// ```
    pub fn try_enter(&self) -> Option<Result<Permit<'_>, CircuitOpen>> {
        if let Some(open) = self.open_for() {
            return Some(Err(open));
        }
        let slot = self.slots.clone().try_acquire_owned().ok()?;
        if let Some(rate) = &self.rate
            && rate.lock().expect("rate poisoned").take().is_some()
        {
            return None;
        }
        Some(self.admit().map(|trial| Permit {
            guard: self,
            _slot: slot,
            trial,
            settled: false,
        }))
    }

    /// A cheap look before queueing for a slot: refuse at once while open.
    fn open_for(&self) -> Option<CircuitOpen> {
        match *self.breaker.lock().expect("breaker poisoned") {
            Breaker::Open { until } if Instant::now() < until => Some(open(until - Instant::now())),
            _ => None,
        }
    }

    /// Lets a caller through; `Ok(Some(generation))` when it takes the
    /// half-open trial.
    fn admit(&self) -> Result<Option<u64>, CircuitOpen> {
        let mut breaker = self.breaker.lock().expect("breaker poisoned");
        match *breaker {
            Breaker::Closed { .. } => return Ok(None),
            Breaker::Open { until } if Instant::now() < until => {
                return Err(open(until - Instant::now()));
            }
            Breaker::HalfOpen { trial: Some(_) } => return Err(open(Duration::from_secs(1))),
            Breaker::Open { .. } | Breaker::HalfOpen { trial: None } => {}
        }
        let generation = self
            .trials
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        *breaker = Breaker::HalfOpen {
            trial: Some(generation),
        };
        Ok(Some(generation))
    }

    fn release_trial(&self, generation: u64) {
        let mut breaker = self.breaker.lock().expect("breaker poisoned");
        if let Breaker::HalfOpen {
            trial: Some(current),
        } = *breaker
            && current == generation
        {
            *breaker = Breaker::HalfOpen { trial: None };
        }
    }

    fn record(&self, outcome: Result<(), ErrorClass>, trial: Option<u64>) {
        let mut breaker = self.breaker.lock().expect("breaker poisoned");
        if let Breaker::HalfOpen { trial: current } = *breaker
            && (trial.is_none() || current != trial)
        {
            // A call admitted before the circuit opened (or an older trial):
            // only the current trial decides a half-open circuit.
            return;
        }
        let failed = matches!(outcome, Err(ErrorClass::Retryable | ErrorClass::Ambiguous));
        let answered = outcome.is_ok();
        *breaker = match (&*breaker, failed) {
            (_, false) if answered => Breaker::Closed { failures: 0 },
            // A permanent failure says nothing about the upstream's health: it
            // keeps the failure count as it is, but it ends a half-open trial.
            (Breaker::HalfOpen { .. }, false) => Breaker::Closed { failures: 0 },
            (Breaker::Closed { failures }, false) => Breaker::Closed {
                failures: *failures,
            },
            (Breaker::Open { until }, false) => Breaker::Open { until: *until },
            (Breaker::Closed { failures }, true) if failures + 1 < self.config.breaker_failures => {
                Breaker::Closed {
                    failures: failures + 1,
                }
            }
            (Breaker::Open { until }, true) => Breaker::Open { until: *until },
            (_, true) => {
                tracing::warn!(cool_down = ?self.config.breaker_cool_down, "circuit opened after sustained failures");
                Breaker::Open {
                    until: Instant::now() + self.config.breaker_cool_down,
                }
            }
        };
    }

    /// Whether the circuit is open now.
    pub fn is_open(&self) -> bool {
        matches!(*self.breaker.lock().expect("breaker poisoned"), Breaker::Open { until } if Instant::now() < until)
    }
}

/// The provider's circuit is open after sustained failures: not a failure of
/// the job, which is deferred until `retry_after` without using an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the provider's circuit is open after sustained failures; retry in {retry_after:?}")]
pub struct CircuitOpen {
    /// When a call may be tried again.
    pub retry_after: Duration,
}

fn open(retry_after: Duration) -> CircuitOpen {
    CircuitOpen { retry_after }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(failures: u32, cool_down_ms: u64) -> GuardConfig {
        GuardConfig {
            breaker_failures: failures,
            breaker_cool_down: Duration::from_millis(cool_down_ms),
            ..GuardConfig::default()
        }
    }

    #[test]
    fn try_enter_never_waits_and_an_unused_permit_gives_its_rate_token_back() {
        let guard = Guard::new(&GuardConfig {
            rate_per_second: 0.001,
            ..GuardConfig::default()
        });
        let first = guard.try_enter().expect("a token is there").unwrap();
        first.release();
        // Given back: a key found done spent nothing.
        let second = guard.try_enter().expect("the token came back").unwrap();
        second.record(Ok(()));
        // Spent by a call: the next one would wait.
        assert!(guard.try_enter().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn the_breaker_opens_after_sustained_failures_and_half_opens_after_the_cool_down() {
        let guard = Guard::new(&config(3, 100));
        for _ in 0..2 {
            guard
                .enter()
                .await
                .unwrap()
                .record(Err(ErrorClass::Retryable));
        }
        assert!(!guard.is_open());
        guard
            .enter()
            .await
            .unwrap()
            .record(Err(ErrorClass::Ambiguous));
        let err = guard.enter().await.err().unwrap();
        assert_eq!(err.retry_after, Duration::from_millis(100));
        tokio::time::advance(Duration::from_millis(99)).await;
        assert!(
            guard.enter().await.is_err(),
            "still open before the cool-down"
        );
        tokio::time::advance(Duration::from_millis(2)).await;
        let trial = guard.enter().await.unwrap();
        // Only one trial at a time.
        assert!(guard.enter().await.is_err());
        trial.record(Ok(()));
        assert!(guard.enter().await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_dropped_while_queued_never_takes_the_half_open_trial() {
        let guard = Guard::new(&GuardConfig {
            concurrency: 1,
            ..config(1, 50)
        });
        guard
            .enter()
            .await
            .unwrap()
            .record(Err(ErrorClass::Retryable));
        tokio::time::advance(Duration::from_millis(60)).await;
        let holder = guard.enter().await.unwrap();
        let queued = tokio::time::timeout(Duration::from_millis(20), guard.enter()).await;
        assert!(
            queued.is_err(),
            "the second caller waits for the slot and is dropped"
        );
        holder.record(Err(ErrorClass::Retryable));
        tokio::time::advance(Duration::from_millis(60)).await;
        assert!(guard.enter().await.is_ok(), "the trial is still available");
    }

    #[tokio::test(start_paused = true)]
    async fn released_permits_teach_the_breaker_nothing() {
        let guard = Guard::new(&config(1, 50));
        for _ in 0..10 {
            guard.enter().await.unwrap().release();
        }
        assert!(!guard.is_open());
        guard
            .enter()
            .await
            .unwrap()
            .record(Err(ErrorClass::Retryable));
        tokio::time::advance(Duration::from_millis(60)).await;
        // An unused trial goes back: the next caller gets it.
        guard.enter().await.unwrap().release();
        assert!(guard.enter().await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_stale_permit_cannot_decide_a_half_open_circuit() {
        let guard = Guard::new(&config(1, 50));
        let stale = guard.enter().await.unwrap();
        guard
            .enter()
            .await
            .unwrap()
            .record(Err(ErrorClass::Retryable));
        tokio::time::advance(Duration::from_millis(60)).await;
        let trial = guard.enter().await.unwrap();
        stale.record(Ok(()));
        assert!(
            guard.enter().await.is_err(),
            "still half-open, the trial in flight"
        );
        trial.record(Ok(()));
        assert!(guard.enter().await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_failures_do_not_reset_the_failure_count() {
        let guard = Guard::new(&config(2, 1000));
        guard
            .enter()
            .await
            .unwrap()
            .record(Err(ErrorClass::Retryable));
        guard
            .enter()
            .await
            .unwrap()
            .record(Err(ErrorClass::Permanent));
        guard
            .enter()
            .await
            .unwrap()
            .record(Err(ErrorClass::Retryable));
        assert!(guard.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_failures_do_not_open_the_circuit() {
        let guard = Guard::new(&config(1, 1000));
        guard
            .enter()
            .await
            .unwrap()
            .record(Err(ErrorClass::Permanent));
        assert!(!guard.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_trial_reopens_the_circuit() {
        let guard = Guard::new(&config(1, 50));
        guard
            .enter()
            .await
            .unwrap()
            .record(Err(ErrorClass::Retryable));
        tokio::time::advance(Duration::from_millis(60)).await;
        guard
            .enter()
            .await
            .unwrap()
            .record(Err(ErrorClass::Retryable));
        assert!(guard.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn the_rate_limit_spaces_calls() {
        let guard = Guard::new(&GuardConfig {
            rate_per_second: 20.0,
            ..GuardConfig::default()
        });
        let started = Instant::now();
        for _ in 0..30 {
            guard.enter().await.unwrap().record(Ok(()));
        }
        // 20 tokens up front, then 10 more at 20/s (paused time advances
        // exactly by the waits).
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(490) && waited <= Duration::from_millis(510),
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_concurrency_limit_holds() {
        let guard = Arc::new(Guard::new(&GuardConfig {
            concurrency: 2,
            ..GuardConfig::default()
        }));
        let a = guard.enter().await.unwrap();
        let _b = guard.enter().await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_millis(50), guard.enter()).await;
        assert!(waiting.is_err(), "a third call must wait");
        a.record(Ok(()));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), guard.enter())
                .await
                .is_ok()
        );
    }
}
