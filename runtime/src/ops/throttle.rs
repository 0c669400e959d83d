//! Throttling of failed sign-ins and wrong credentials, by client address:
//! after `failures` failures within `window`, an address is refused (429,
//! `Retry-After`) for `lockout`, even with the right token, so guessing the
//! token costs time. Successes are not counted. IPv6 addresses count by
//! their /64 (one host usually holds a whole /64).
//!
//! Memory is bounded: at most `capacity` addresses are tracked; a new one
//! beyond that evicts the address whose last failure is the oldest.
//!
//! Time is tokio's clock, so tests pause and advance it.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// How failures are counted and punished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThrottleSettings {
    /// Failures within `window` that block an address.
    pub failures: u32,
    /// How far back failures are counted (from the first of a series).
    pub window: Duration,
    /// How long a blocked address is refused, from the failure that
    /// blocked it.
    pub lockout: Duration,
    /// Most addresses tracked at once.
    pub capacity: usize,
}

impl Default for ThrottleSettings {
    /// 5 failures in a minute block an address for a minute; 10,000
    /// addresses tracked.
    fn default() -> Self {
        ThrottleSettings {
            failures: 5,
            window: Duration::from_secs(60),
            lockout: Duration::from_secs(60),
            capacity: 10_000,
        }
    }
}

/// Failures per client address.
///
/// ```
/// use idem::ops::throttle::{Throttle, ThrottleSettings};
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let throttle = Throttle::new(ThrottleSettings { failures: 2, ..ThrottleSettings::default() });
/// let client = Some("203.0.113.9".parse().unwrap());
/// throttle.failed(client);
/// assert!(throttle.check(client).is_ok());
/// throttle.failed(client);
/// assert!(throttle.check(client).is_err(), "blocked");
/// # });
/// ```
#[derive(Debug)]
pub struct Throttle {
    settings: ThrottleSettings,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<IpAddr, Entry>,
    /// Entries by the sequence number of their last failure, oldest first.
    order: BTreeMap<u64, IpAddr>,
    next: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    failures: u32,
    since: Instant,
    blocked_until: Option<Instant>,
    seq: u64,
}

impl Throttle {
    /// A throttle with these settings (a `failures` of 0 counts as 1).
    pub fn new(settings: ThrottleSettings) -> Self {
        Throttle {
            settings: ThrottleSettings {
                failures: settings.failures.max(1),
                capacity: settings.capacity.max(1),
                ..settings
            },
            state: Mutex::new(State::default()),
        }
    }

    /// The settings.
    pub fn settings(&self) -> ThrottleSettings {
        self.settings
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is consistent after every statement: a panic elsewhere
        // while holding the lock leaves nothing half-done.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `Err(wait)` while `address` is blocked: how long until it may try
    /// again. An unknown address (no peer recorded) is one client.
    pub fn check(&self, address: Option<IpAddr>) -> Result<(), Duration> {
        let key = key(address);
        let now = Instant::now();
        let state = self.state();
        match state.entries.get(&key).and_then(|e| e.blocked_until) {
            Some(until) if until > now => Err(until - now),
            _ => Ok(()),
        }
    }

    /// Counts a failure of `address`.
    pub fn failed(&self, address: Option<IpAddr>) {
        let key = key(address);
        let now = Instant::now();
        let settings = self.settings;
        let mut state = self.state();
        let seq = state.next;
        state.next += 1;
        let fresh = Entry {
            failures: 0,
            since: now,
            blocked_until: None,
            seq,
        };
        let mut entry = match state.entries.get(&key).copied() {
            Some(old) => {
                state.order.remove(&old.seq);
                let series_over = now >= old.since + settings.window
                    || old.blocked_until.is_some_and(|until| until <= now);
                if series_over {
                    fresh
                } else {
                    Entry { seq, ..old }
                }
            }
            None => {
                if state.entries.len() >= settings.capacity {
                    state.evict_oldest();
                }
                fresh
            }
        };
        if entry.blocked_until.is_none() {
            entry.failures += 1;
            if entry.failures >= settings.failures {
                entry.blocked_until = Some(now + settings.lockout);
            }
        }
        state.order.insert(seq, key);
        state.entries.insert(key, entry);
    }

    /// How many addresses are tracked.
    pub fn tracked(&self) -> usize {
        self.state().entries.len()
    }
}

impl State {
    fn evict_oldest(&mut self) {
        if let Some((_, key)) = self.order.pop_first() {
            self.entries.remove(&key);
        }
    }
}

/// The address failures are counted under: IPv4 as is (an IPv4-mapped
/// IPv6 address too), IPv6 by its /64.
fn key(address: Option<IpAddr>) -> IpAddr {
    match address {
        None => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Some(IpAddr::V4(v4)) => IpAddr::V4(v4),
        Some(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(
                u128::from(v6) & 0xffff_ffff_ffff_ffff_0000_0000_0000_0000,
            )),
        },
    }
}

/// Whole seconds to announce in `Retry-After` (rounded up, at least 1).
///
/// ```
/// use std::time::Duration;
/// assert_eq!(idem::ops::throttle::retry_after_secs(Duration::from_millis(1500)), 2);
/// assert_eq!(idem::ops::throttle::retry_after_secs(Duration::ZERO), 1);
/// ```
pub fn retry_after_secs(wait: Duration) -> u64 {
    (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> Option<IpAddr> {
        Some(text.parse().expect("an address"))
    }

    fn throttle() -> Throttle {
        Throttle::new(ThrottleSettings {
            failures: 3,
            window: Duration::from_secs(60),
            lockout: Duration::from_secs(30),
            capacity: 4,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn the_limit_blocks_for_the_lockout_then_lifts() {
        let t = throttle();
        let a = ip("203.0.113.9");
        t.failed(a);
        t.failed(a);
        assert!(t.check(a).is_ok(), "two failures are allowed");
        t.failed(a);
        assert_eq!(t.check(a), Err(Duration::from_secs(30)));
        assert!(t.check(ip("203.0.113.10")).is_ok(), "another address");
        tokio::time::advance(Duration::from_secs(20)).await;
        assert_eq!(t.check(a), Err(Duration::from_secs(10)));
        // A failure reported during the block (a request that raced the
        // check) neither extends it nor counts toward the next one.
        t.failed(a);
        assert_eq!(t.check(a), Err(Duration::from_secs(10)));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(t.check(a).is_ok(), "the lockout is over");
        t.failed(a);
        assert!(t.check(a).is_ok(), "a new series starts from one");
    }

    #[tokio::test(start_paused = true)]
    async fn failures_older_than_the_window_are_forgotten() {
        let t = throttle();
        let a = ip("203.0.113.9");
        t.failed(a);
        t.failed(a);
        tokio::time::advance(Duration::from_secs(61)).await;
        t.failed(a);
        t.failed(a);
        assert!(t.check(a).is_ok(), "two in this window");
        t.failed(a);
        assert!(t.check(a).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn ipv6_counts_by_its_64_and_mapped_ipv4_as_ipv4() {
        let t = throttle();
        t.failed(ip("2001:db8:1:2::1"));
        t.failed(ip("2001:db8:1:2::2"));
        t.failed(ip("2001:db8:1:2:ffff::3"));
        assert!(t.check(ip("2001:db8:1:2::99")).is_err(), "the same /64");
        assert!(t.check(ip("2001:db8:1:3::1")).is_ok(), "another /64");
        t.failed(ip("::ffff:198.51.100.1"));
        t.failed(ip("198.51.100.1"));
        t.failed(ip("::ffff:198.51.100.1"));
        assert!(t.check(ip("198.51.100.1")).is_err());
        t.failed(None);
        assert!(t.check(None).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn memory_is_bounded_by_evicting_the_oldest() {
        let t = throttle();
        let blocked = ip("203.0.113.1");
        for _ in 0..3 {
            t.failed(blocked);
        }
        for n in 2..=4 {
            tokio::time::advance(Duration::from_millis(10)).await;
            t.failed(ip(&format!("203.0.113.{n}")));
        }
        assert_eq!(t.tracked(), 4);
        assert!(t.check(blocked).is_err());
        // A fifth address evicts the one whose last failure is oldest.
        t.failed(ip("203.0.113.5"));
        assert_eq!(t.tracked(), 4);
        assert!(t.check(blocked).is_ok(), "evicted");
        // Touching an address makes it the newest.
        t.failed(ip("203.0.113.2"));
        t.failed(ip("203.0.113.6"));
        t.failed(ip("203.0.113.2"));
        assert_eq!(t.tracked(), 4);
        assert!(t.check(ip("203.0.113.2")).is_err(), "kept: three failures");
        for n in 0..1000 {
            t.failed(ip(&format!("10.0.{}.{}", n / 256, n % 256)));
        }
        assert_eq!(t.tracked(), 4);
    }
}
