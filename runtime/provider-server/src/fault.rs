//! Fault kinds and the random/rule based fault configuration.

use std::{fmt, str::FromStr, time::Duration};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A failure the provider server injects into one request.
///
/// On the wire (`/_faults`, `X-Idem-Fault`, `/_calls`) a fault is named `late`, `drop`,
/// `429`, `500` or `400`.
///
/// ```
/// use idem_provider_server::Fault;
/// assert_eq!("429".parse::<Fault>(), Ok(Fault::TooManyRequests));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Process and apply the request, but answer only after `late_by`: the ambiguous
    /// timeout where the client gives up although the work was done.
    Late,
    /// Process and apply the request, then close the connection without any response.
    Drop,
    /// Answer 429 with `Retry-After`; nothing is applied.
    TooManyRequests,
    /// Answer 500; nothing is applied.
    ServerError,
    /// Answer 400 `bad_request`; nothing is applied.
    BadRequest,
}

impl Fault {
    /// Every fault kind, in the order random faults are drawn.
    ///
    /// `for f in Fault::ALL { println!("{f}"); }`
    pub const ALL: [Fault; 5] = [
        Fault::Late,
        Fault::Drop,
        Fault::TooManyRequests,
        Fault::ServerError,
        Fault::BadRequest,
    ];

    /// The wire name of the fault (`late`, `drop`, `429`, `500`, `400`).
    ///
    /// `assert_eq!(Fault::ServerError.as_str(), "500");`
    pub fn as_str(self) -> &'static str {
        match self {
            Fault::Late => "late",
            Fault::Drop => "drop",
            Fault::TooManyRequests => "429",
            Fault::ServerError => "500",
            Fault::BadRequest => "400",
        }
    }

    /// Whether the request is rejected before any processing (nothing applied, key not
    /// consumed), as opposed to `Late`/`Drop` which only disturb the delivery.
    pub(crate) fn rejects(self) -> bool {
        matches!(
            self,
            Fault::TooManyRequests | Fault::ServerError | Fault::BadRequest
        )
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The name is not one of the known fault kinds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fault `{0}` (expected late, drop, 429, 500 or 400)")]
pub struct UnknownFault(pub String);

impl FromStr for Fault {
    type Err = UnknownFault;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "late" | "timeout" => Ok(Fault::Late),
            "drop" => Ok(Fault::Drop),
            "429" | "too_many_requests" | "rate_limit" => Ok(Fault::TooManyRequests),
            "500" | "server_error" => Ok(Fault::ServerError),
            "400" | "bad_request" => Ok(Fault::BadRequest),
            _ => Err(UnknownFault(s.to_owned())),
        }
    }
}

impl Serialize for Fault {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Fault {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// Where the fault of a recorded call came from.
///
/// `assert_eq!(serde_json::to_string(&FaultSource::Script).unwrap(), "\"script\"");`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultSource {
    /// The `X-Idem-Fault` request header.
    Header,
    /// A fault scripted with `POST /_faults` or [`super::ProviderServerHandle::script_faults`].
    Script,
    /// Drawn from the [`FaultConfig`] rates.
    Random,
    /// The body matched one of [`FaultConfig::reject_matching`].
    RejectRule,
}

/// Faults injected by configuration: random rates and the "400 for chosen inputs" rule.
///
/// Rates are probabilities drawn once per request, and only for requests whose key has
/// no stored response yet (a replay is never turned into a random fault).
///
/// ```
/// use idem_provider_server::FaultConfig;
/// let faults = FaultConfig::parse_rates("500=0.1,429=0.05,late=0.02,drop=0.01").unwrap();
/// assert_eq!(faults.server_error, 0.1);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct FaultConfig {
    /// Probability of [`Fault::Late`].
    pub late: f64,
    /// Probability of [`Fault::Drop`].
    pub drop: f64,
    /// Probability of [`Fault::TooManyRequests`].
    pub too_many_requests: f64,
    /// Probability of [`Fault::ServerError`].
    pub server_error: f64,
    /// Probability of [`Fault::BadRequest`].
    pub bad_request: f64,
    /// A request whose body contains one of these substrings is answered 400.
    pub reject_matching: Vec<String>,
    /// The `Retry-After` sent with 429 answers (rounded up to whole seconds).
    pub retry_after: Duration,
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            late: 0.0,
            drop: 0.0,
            too_many_requests: 0.0,
            server_error: 0.0,
            bad_request: 0.0,
            reject_matching: Vec::new(),
            retry_after: Duration::from_secs(1),
        }
    }
}

/// A fault rate specification is invalid.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FaultConfigError {
    /// An entry is not `NAME=RATE`.
    #[error("fault rate entry `{0}` is not of the form NAME=RATE")]
    MalformedEntry(String),
    /// The fault name is unknown.
    #[error(transparent)]
    UnknownFault(#[from] UnknownFault),
    /// The rate is not a number.
    #[error("rate `{value}` for fault `{fault}` is not a number")]
    InvalidRate {
        /// The fault.
        fault: Fault,
        /// The text that failed to parse.
        value: String,
    },
    /// The rate is not within 0..=1.
    #[error("rate {rate} for fault `{fault}` is outside 0..=1")]
    OutOfRange {
        /// The fault.
        fault: Fault,
        /// The rejected rate.
        rate: f64,
    },
    /// The same fault appears twice.
    #[error("fault `{0}` is given more than once")]
    Duplicate(Fault),
    /// The rates add up to more than 1.
    #[error("fault rates add up to {0}, more than 1")]
    SumAboveOne(f64),
}

impl FaultConfig {
    /// Parses comma separated `NAME=RATE` pairs (names `late`, `drop`, `429`, `500`, `400`;
    /// rates 0..=1, summing to at most 1). An empty string means no random faults.
    ///
    /// `let faults = FaultConfig::parse_rates("500=0.1,drop=0.01")?;`
    pub fn parse_rates(spec: &str) -> Result<Self, FaultConfigError> {
        let mut config = Self::default();
        let mut seen = Vec::new();
        for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (name, value) = entry
                .split_once('=')
                .ok_or_else(|| FaultConfigError::MalformedEntry(entry.to_owned()))?;
            let fault: Fault = name.trim().parse()?;
            if seen.contains(&fault) {
                return Err(FaultConfigError::Duplicate(fault));
            }
            seen.push(fault);
            let value = value.trim();
            let rate: f64 = value.parse().map_err(|_| FaultConfigError::InvalidRate {
                fault,
                value: value.to_owned(),
            })?;
            *config.rate_mut(fault) = rate;
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks that every rate is within 0..=1 and that they sum to at most 1.
    ///
    /// `FaultConfig { drop: 2.0, ..Default::default() }.validate().unwrap_err();`
    pub fn validate(&self) -> Result<(), FaultConfigError> {
        let mut sum = 0.0;
        for fault in Fault::ALL {
            let rate = self.rate(fault);
            if !(0.0..=1.0).contains(&rate) {
                return Err(FaultConfigError::OutOfRange { fault, rate });
            }
            sum += rate;
        }
        // A little slack so that e.g. 0.7 + 0.2 + 0.1 is not rejected for rounding.
        if sum > 1.0 + 1e-9 {
            return Err(FaultConfigError::SumAboveOne(sum));
        }
        Ok(())
    }

    /// The configured probability of one fault kind.
    ///
    /// `assert_eq!(FaultConfig::default().rate(Fault::Drop), 0.0);`
    pub fn rate(&self, fault: Fault) -> f64 {
        match fault {
            Fault::Late => self.late,
            Fault::Drop => self.drop,
            Fault::TooManyRequests => self.too_many_requests,
            Fault::ServerError => self.server_error,
            Fault::BadRequest => self.bad_request,
        }
    }

    fn rate_mut(&mut self, fault: Fault) -> &mut f64 {
        match fault {
            Fault::Late => &mut self.late,
            Fault::Drop => &mut self.drop,
            Fault::TooManyRequests => &mut self.too_many_requests,
            Fault::ServerError => &mut self.server_error,
            Fault::BadRequest => &mut self.bad_request,
        }
    }

    /// Draws at most one fault with a single uniform sample, so the rates are exclusive.
    pub(crate) fn draw(&self) -> Option<Fault> {
        let sample: f64 = rand::random();
        let mut upper = 0.0;
        for fault in Fault::ALL {
            upper += self.rate(fault);
            if sample < upper {
                return Some(fault);
            }
        }
        None
    }

    pub(crate) fn rejects_body(&self, body: &[u8]) -> bool {
        self.reject_matching
            .iter()
            .filter(|needle| !needle.is_empty())
            .any(|needle| {
                body.windows(needle.len())
                    .any(|window| window == needle.as_bytes())
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_rates_accepts_the_cli_example() {
        let faults = FaultConfig::parse_rates(" 500=0.1, 429=0.05,late=0.02,drop=0.01 ,")
            .expect("valid spec");
        assert_eq!(faults.server_error, 0.1);
        assert_eq!(faults.too_many_requests, 0.05);
        assert_eq!(faults.late, 0.02);
        assert_eq!(faults.drop, 0.01);
        assert_eq!(faults.bad_request, 0.0);
        assert_eq!(FaultConfig::parse_rates(""), Ok(FaultConfig::default()));
    }

    #[test]
    fn draw_honours_certain_and_zero_rates() {
        let always = FaultConfig {
            drop: 1.0,
            ..FaultConfig::default()
        };
        assert!((0..100).all(|_| always.draw() == Some(Fault::Drop)));
        assert!((0..100).all(|_| FaultConfig::default().draw().is_none()));
    }

    #[test]
    fn reject_rule_matches_substrings() {
        let faults = FaultConfig {
            reject_matching: vec!["poison".into(), String::new()],
            ..FaultConfig::default()
        };
        assert!(faults.rejects_body(br#"{"to":["poison@example.com"]}"#));
        assert!(!faults.rejects_body(br#"{"to":["ok@example.com"]}"#));
    }
}
