//! Database effects: a named statement the operator declared, with typed
//! parameters. A plugin never sends SQL text.
//!
//! The call travels to the host as the body of a `custom` action (JSON, see
//! [`SqlCall`]), so plugins built against the 0.1 contract need no new WIT
//! type; the host's `sql` provider decodes it and refuses anything else.

use serde::{Deserialize, Serialize};

/// One typed statement parameter.
///
/// ```
/// use idem_sdk::SqlValue;
/// assert_eq!(SqlValue::from(7), SqlValue::Integer(7));
/// assert_eq!(SqlValue::from("ana"), SqlValue::Text("ana".into()));
/// assert_eq!(SqlValue::from(None::<i64>), SqlValue::Null);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SqlValue {
    /// Text.
    Text(String),
    /// A 64-bit integer.
    Integer(i64),
    /// An exact decimal, written as text (`"12.50"`), never a float.
    Numeric(String),
    /// A boolean.
    Boolean(bool),
    /// A JSON document.
    Json(serde_json::Value),
    /// SQL `NULL`.
    Null,
}

impl SqlValue {
    /// `text`, `integer`, `numeric`, `boolean`, `json` or `null`.
    ///
    /// ```
    /// assert_eq!(idem_sdk::SqlValue::Boolean(true).kind(), "boolean");
    /// ```
    pub fn kind(&self) -> &'static str {
        match self {
            SqlValue::Text(_) => "text",
            SqlValue::Integer(_) => "integer",
            SqlValue::Numeric(_) => "numeric",
            SqlValue::Boolean(_) => "boolean",
            SqlValue::Json(_) => "json",
            SqlValue::Null => "null",
        }
    }

    /// An exact decimal; `None` unless `text` is one (`-12.50`, `3`, `0.1`).
    ///
    /// ```
    /// use idem_sdk::SqlValue;
    /// assert_eq!(SqlValue::numeric("12.50"), Some(SqlValue::Numeric("12.50".into())));
    /// assert_eq!(SqlValue::numeric("1e9"), None);
    /// ```
    pub fn numeric(text: &str) -> Option<SqlValue> {
        is_decimal(text).then(|| SqlValue::Numeric(text.to_string()))
    }

    /// Bytes the value carries (for the host's output caps).
    pub fn size(&self) -> usize {
        match self {
            SqlValue::Text(t) | SqlValue::Numeric(t) => t.len(),
            SqlValue::Json(v) => v.to_string().len(),
            SqlValue::Integer(_) | SqlValue::Boolean(_) => 8,
            SqlValue::Null => 0,
        }
    }
}

/// Whether `text` is a plain decimal number: an optional sign, digits, and
/// at most one point with digits after it.
///
/// ```
/// assert!(idem_sdk::sql::is_decimal("-0.25"));
/// assert!(!idem_sdk::sql::is_decimal("NaN"));
/// ```
pub fn is_decimal(text: &str) -> bool {
    let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
    let (whole, fraction) = match digits.split_once('.') {
        Some((whole, fraction)) => (whole, Some(fraction)),
        None => (digits, None),
    };
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    all_digits(whole) && fraction.is_none_or(all_digits) && digits.len() <= 200
}

macro_rules! from_integer {
    ($($t:ty),*) => {$(
        impl From<$t> for SqlValue {
            fn from(value: $t) -> Self {
                SqlValue::Integer(i64::from(value))
            }
        }
    )*};
}
from_integer!(i8, i16, i32, i64, u8, u16, u32);

impl From<bool> for SqlValue {
    fn from(value: bool) -> Self {
        SqlValue::Boolean(value)
    }
}

impl From<&str> for SqlValue {
    fn from(value: &str) -> Self {
        SqlValue::Text(value.to_string())
    }
}

impl From<String> for SqlValue {
    fn from(value: String) -> Self {
        SqlValue::Text(value)
    }
}

impl From<&String> for SqlValue {
    fn from(value: &String) -> Self {
        SqlValue::Text(value.clone())
    }
}

impl From<serde_json::Value> for SqlValue {
    fn from(value: serde_json::Value) -> Self {
        SqlValue::Json(value)
    }
}

impl<T: Into<SqlValue>> From<Option<T>> for SqlValue {
    fn from(value: Option<T>) -> Self {
        value.map_or(SqlValue::Null, Into::into)
    }
}

/// What a `sql` effect asks for: a statement the operator declared under
/// this name for the provider, and its parameters (`$1`, `$2`, ... in order).
///
/// ```
/// use idem_sdk::{sql::SqlCall, params};
/// let call = SqlCall { statement: "create_invoice".into(), params: params!["order-7", 1250] };
/// let body = call.to_body();
/// assert_eq!(SqlCall::from_body(&body).unwrap(), call);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqlCall {
    /// Name of the declared statement.
    pub statement: String,
    /// Parameters in placeholder order.
    #[serde(default)]
    pub params: Vec<SqlValue>,
}

impl SqlCall {
    /// The call as a `custom` action body (JSON).
    pub fn to_body(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes a `custom` action body; anything but a statement name and
    /// typed parameters (SQL text above all) is refused.
    pub fn from_body(body: &[u8]) -> Result<SqlCall, serde_json::Error> {
        serde_json::from_slice(body)
    }
}

/// Typed parameters for [`Effect::sql`](crate::Effect::sql), converted with
/// `Into<SqlValue>`.
///
/// ```
/// use idem_sdk::{params, SqlValue};
/// let p = params!["order-7", 1250, true, None::<i64>];
/// assert_eq!(p, vec![SqlValue::Text("order-7".into()), SqlValue::Integer(1250), SqlValue::Boolean(true), SqlValue::Null]);
/// ```
#[macro_export]
macro_rules! params {
    ($($value:expr),* $(,)?) => {
        ::std::vec![$($crate::SqlValue::from($value)),*]
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_form_is_tagged_and_refuses_sql_text() {
        let call = SqlCall {
            statement: "s".into(),
            params: vec![
                SqlValue::Numeric("1.50".into()),
                SqlValue::Json(serde_json::json!({"a": 1})),
                SqlValue::Null,
            ],
        };
        let json: serde_json::Value = serde_json::from_slice(&call.to_body()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"statement": "s", "params": [{"numeric": "1.50"}, {"json": {"a": 1}}, "null"]})
        );
        assert!(SqlCall::from_body(br#"{"statement":"s","sql":"DROP TABLE invoices"}"#).is_err());
        assert!(SqlCall::from_body(br#"{"statement":"s","params":[{"float":1.5}]}"#).is_err());
        assert!(SqlCall::from_body(b"DROP TABLE invoices").is_err());
    }

    #[test]
    fn decimals_are_plain_numbers() {
        for ok in ["0", "-1", "+2.5", "12.50"] {
            assert!(is_decimal(ok), "{ok}");
        }
        for bad in ["", ".", "1.", ".5", "1e3", "NaN", "1.2.3", "--1", " 1"] {
            assert!(!is_decimal(bad), "{bad}");
        }
    }
}
