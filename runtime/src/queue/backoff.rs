//! Retry delays with full jitter: `cap = min(max, base * 2^attempt)`,
//! `delay = random(0, cap)`; a larger `Retry-After` from the plugin or the
//! provider wins.

use rand::Rng;
use std::time::Duration;

/// The longest `Retry-After` honoured (unless `max` is longer).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// Backoff settings (defaults: base 5 s, max 15 min).
///
/// ```
/// use idem::queue::backoff::Backoff;
/// use std::time::Duration;
/// let b = Backoff::default();
/// assert_eq!(b.cap(1), Duration::from_secs(10));
/// assert!(b.delay(3, None, &mut rand::rng()) <= b.cap(3));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Base delay.
    pub base: Duration,
    /// Cap of every delay.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(5),
            max: Duration::from_secs(15 * 60),
        }
    }
}

impl Backoff {
    /// `min(max, base * 2^attempt)`, saturating.
    pub fn cap(&self, attempt: u32) -> Duration {
        let factor = 2u32.checked_pow(attempt).unwrap_or(u32::MAX);
        self.base
            .checked_mul(factor)
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// A full-jitter delay for the retry after `attempt`: at least
    /// `retry_after` (when given, up to [`MAX_RETRY_AFTER`]), otherwise never above `max`.
    pub fn delay(
        &self,
        attempt: u32,
        retry_after: Option<Duration>,
        rng: &mut impl Rng,
    ) -> Duration {
        let cap = self.cap(attempt);
        let jittered = if cap.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_nanos(rng.random_range(0..=cap.as_nanos().min(u64::MAX as u128) as u64))
        };
        // A larger retry-after wins, up to an hour: a provider or plugin
        // asking for a year must not park a job beyond every alert.
        match retry_after {
            Some(after) if after > jittered => after.min(MAX_RETRY_AFTER.max(self.max)),
            _ => jittered,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_double_from_the_base_and_stop_at_max() {
        let b = Backoff::default();
        assert_eq!(b.cap(0), Duration::from_secs(5));
        assert_eq!(b.cap(1), Duration::from_secs(10));
        assert_eq!(b.cap(4), Duration::from_secs(80));
        assert_eq!(b.cap(8), Duration::from_secs(900));
        assert_eq!(b.cap(40), Duration::from_secs(900));
        assert_eq!(b.cap(u32::MAX), Duration::from_secs(900));
        for a in 0..20 {
            assert!(b.cap(a) <= b.cap(a + 1));
        }
    }

    #[test]
    fn delays_stay_within_zero_and_the_cap_and_spread_out() {
        let b = Backoff::default();
        let mut rng = rand::rng();
        for attempt in 0..15 {
            let delays: Vec<_> = (0..500).map(|_| b.delay(attempt, None, &mut rng)).collect();
            assert!(delays.iter().all(|d| *d <= b.cap(attempt)));
            let below_half = delays.iter().filter(|d| **d < b.cap(attempt) / 2).count();
            // Full jitter: about half the delays fall in the lower half.
            assert!(
                (150..=350).contains(&below_half),
                "attempt {attempt}: {below_half}"
            );
        }
    }

    #[test]
    fn a_larger_retry_after_wins() {
        let b = Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(100),
        };
        let mut rng = rand::rng();
        assert_eq!(
            b.delay(2, Some(Duration::from_secs(30)), &mut rng),
            Duration::from_secs(30)
        );
        assert_eq!(
            b.delay(2, Some(Duration::from_secs(365 * 86400)), &mut rng),
            MAX_RETRY_AFTER,
            "a year is capped"
        );
        assert!(b.delay(2, Some(Duration::ZERO), &mut rng) <= b.cap(2));
    }
}
