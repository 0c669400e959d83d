//! Idempotency keys: the identity of a business operation, never of one delivery.
//!
//! Good keys name the operation and carry a version, e.g. `invoice:42:email:v1`,
//! `order:7:invoice`, `webhook:evt_1:partner-a`. A fresh UUID per attempt
//! defeats the purpose.

use std::fmt;

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: non-empty, at most [`MAX_KEY_LEN`] bytes,
/// printable ASCII (`' '..='~'`).
///
/// ```
/// use idem_sdk::IdempotencyKey;
/// let key = IdempotencyKey::new("invoice:42:email:v1").unwrap();
/// assert_eq!(key.as_str(), "invoice:42:email:v1");
/// assert!(IdempotencyKey::new("").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a string is not a valid idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InvalidKey {
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes (the length is given).
    TooLong(usize),
    /// The key holds a character outside printable ASCII, at this byte offset.
    NotPrintable(usize),
}

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidKey::Empty => write!(f, "idempotency key is empty"),
            InvalidKey::TooLong(len) => {
                write!(
                    f,
                    "idempotency key is {len} bytes long, at most {MAX_KEY_LEN} allowed"
                )
            }
            InvalidKey::NotPrintable(at) => write!(
                f,
                "idempotency key has a character outside printable ASCII at byte {at}"
            ),
        }
    }
}

impl std::error::Error for InvalidKey {}

impl IdempotencyKey {
    /// Validates `key`.
    ///
    /// ```
    /// # use idem_sdk::{IdempotencyKey, InvalidKey};
    /// assert_eq!(IdempotencyKey::new("a\u{7f}"), Err(InvalidKey::NotPrintable(1)));
    /// ```
    pub fn new(key: impl Into<String>) -> Result<Self, InvalidKey> {
        let key = key.into();
        validate(&key)?;
        Ok(IdempotencyKey(key))
    }

    /// Joins parts with `:`, e.g. `["order", "7", "invoice"]` → `order:7:invoice`.
    ///
    /// ```
    /// # use idem_sdk::IdempotencyKey;
    /// let key = IdempotencyKey::from_parts(["order", "7", "invoice"]).unwrap();
    /// assert_eq!(key.as_str(), "order:7:invoice");
    /// ```
    pub fn from_parts<I, S>(parts: I) -> Result<Self, InvalidKey>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut key = String::new();
        for (i, part) in parts.into_iter().enumerate() {
            if i > 0 {
                key.push(':');
            }
            key.push_str(part.as_ref());
        }
        Self::new(key)
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks the key rules shared by the SDK and the host.
///
/// ```
/// assert!(idem_sdk::key::validate("order:1:invoice").is_ok());
/// ```
pub fn validate(key: &str) -> Result<(), InvalidKey> {
    if key.is_empty() {
        return Err(InvalidKey::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(InvalidKey::TooLong(key.len()));
    }
    if let Some(at) = key.bytes().position(|b| !(b' '..=b'~').contains(&b)) {
        return Err(InvalidKey::NotPrintable(at));
    }
    Ok(())
}

/// Formats and validates an idempotency key, like `format!`.
///
/// Returns `Result<IdempotencyKey, InvalidKey>`; `?` turns the error into a
/// permanent [`JobError`](crate::JobError) with code `invalid_idempotency_key`.
///
/// ```
/// let key = idem_sdk::key!("invoice:{}:email:v1", 42).unwrap();
/// assert_eq!(key.as_str(), "invoice:42:email:v1");
/// ```
#[macro_export]
macro_rules! key {
    ($($arg:tt)*) => {
        $crate::IdempotencyKey::new(::std::format!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_printable_ascii_up_to_the_limit() {
        assert!(IdempotencyKey::new("x".repeat(MAX_KEY_LEN)).is_ok());
        assert!(IdempotencyKey::new(" ~!").is_ok());
    }

    #[test]
    fn rejects_empty_long_and_unprintable_keys() {
        assert_eq!(IdempotencyKey::new(""), Err(InvalidKey::Empty));
        assert_eq!(
            IdempotencyKey::new("x".repeat(MAX_KEY_LEN + 1)),
            Err(InvalidKey::TooLong(MAX_KEY_LEN + 1))
        );
        assert_eq!(
            IdempotencyKey::new("ab\ncd"),
            Err(InvalidKey::NotPrintable(2))
        );
        assert_eq!(IdempotencyKey::new("é"), Err(InvalidKey::NotPrintable(0)));
        assert_eq!(
            IdempotencyKey::new("a\tb"),
            Err(InvalidKey::NotPrintable(1))
        );
    }

    #[test]
    fn key_macro_formats_and_validates() {
        assert_eq!(
            crate::key!("order:{}:invoice", 7).unwrap().as_str(),
            "order:7:invoice"
        );
        assert!(crate::key!("{}", "").is_err());
    }
}
