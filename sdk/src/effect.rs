//! Effects: what a plugin asks the host to do, each under an idempotency key.

use crate::__private::bindings::idem::plugin::types as wit;
use crate::{IdempotencyKey, JobError};
use serde::Serialize;
use std::time::Duration;

/// Provider that [`Effect::email`] uses unless [`Effect::via`] says otherwise.
pub const DEFAULT_EMAIL_PROVIDER: &str = "email";
pub use crate::declaration::JOBS_PROVIDER;

/// One business effect. The host carries it out at most once per key.
///
/// ```
/// use idem_sdk::{key, Effect, Email, HttpRequest, ChildJob};
/// # fn main() -> Result<(), idem_sdk::JobError> {
/// let email = Effect::email(key!("invoice:{}:email:v1", 42)?, Email::to("ana@example.com")?.subject("Invoice 42").text("Thanks"));
/// let hook = Effect::http("partner", key!("webhook:{}:{}", "evt_1", "partner")?, HttpRequest::post("/events").json(&serde_json::json!({"id": 1}))?);
/// let child = Effect::enqueue(key!("order:{}:invoice", 7)?, ChildJob::new("create_invoice", &serde_json::json!({"order_id": 7}))?);
/// assert_eq!(email.provider(), "email");
/// assert_eq!(child.provider(), "jobs");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    provider: String,
    key: IdempotencyKey,
    action: Action,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    Http(HttpRequest),
    Email(Email),
    Enqueue(ChildJob),
    Custom(Vec<u8>),
}

impl Effect {
    /// An email through the `email` provider.
    pub fn email(key: IdempotencyKey, email: Email) -> Self {
        Self::new(DEFAULT_EMAIL_PROVIDER, key, Action::Email(email))
    }

    /// An HTTP request through the named provider (its base URL, auth and
    /// signing are host configuration the plugin never sees).
    pub fn http(provider: impl Into<String>, key: IdempotencyKey, request: HttpRequest) -> Self {
        Self::new(provider, key, Action::Http(request))
    }

    /// A child job; the key also makes the child job unique.
    pub fn enqueue(key: IdempotencyKey, job: ChildJob) -> Self {
        Self::new(JOBS_PROVIDER, key, Action::Enqueue(job))
    }

    /// Provider-defined bytes for a custom provider.
    pub fn custom(provider: impl Into<String>, key: IdempotencyKey, body: Vec<u8>) -> Self {
        Self::new(provider, key, Action::Custom(body))
    }

    /// A database write: the statement the operator declared under
    /// `statement` for `provider` (a `sql` provider), with typed parameters.
    /// The plugin never sends SQL text.
    ///
    /// ```
    /// use idem_sdk::{key, params, Effect};
    /// let e = Effect::sql("billing_db", key!("order:{}:invoice", 7).unwrap(), "create_invoice", params!["order-7", 1250]);
    /// assert_eq!(e.provider(), "billing_db");
    /// ```
    pub fn sql(
        provider: impl Into<String>,
        key: IdempotencyKey,
        statement: impl Into<String>,
        params: Vec<crate::SqlValue>,
    ) -> Self {
        let call = crate::sql::SqlCall {
            statement: statement.into(),
            params,
        };
        Self::new(provider, key, Action::Custom(call.to_body()))
    }

    /// Sends the effect through another provider of the same kind.
    ///
    /// ```
    /// # use idem_sdk::{key, Effect, Email};
    /// let e = Effect::email(key!("k").unwrap(), Email::to("a@b.c").unwrap()).via("transactional_email");
    /// assert_eq!(e.provider(), "transactional_email");
    /// ```
    pub fn via(mut self, provider: impl Into<String>) -> Self {
        self.provider = provider.into();
        self
    }

    /// The provider's name.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The idempotency key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    fn new(provider: impl Into<String>, key: IdempotencyKey, action: Action) -> Self {
        Effect {
            provider: provider.into(),
            key,
            action,
        }
    }

    pub(crate) fn into_wit(self) -> wit::Effect {
        let action = match self.action {
            Action::Http(r) => wit::Action::Http(wit::HttpRequest {
                method: r.method,
                path: r.path,
                headers: pairs(r.headers),
                body: r.body,
            }),
            Action::Email(e) => wit::Action::Email(wit::Email {
                to: e.to,
                subject: e.subject,
                text: e.text,
                html: e.html,
                template: e.template.map(|(name, variables)| wit::EmailTemplate {
                    name,
                    variables: pairs(variables),
                }),
            }),
            Action::Enqueue(j) => wit::Action::Enqueue(wit::ChildJob {
                plugin: j.plugin,
                queue: j.queue,
                payload: j.payload,
                delay_ms: j.delay.as_millis().min(u64::MAX as u128) as u64,
                priority: j.priority,
            }),
            Action::Custom(body) => wit::Action::Custom(body),
        };
        wit::Effect {
            provider: self.provider,
            idempotency_key: self.key.into_string(),
            action,
        }
    }
}

fn pairs(list: Vec<(String, String)>) -> Vec<wit::Pair> {
    list.into_iter()
        .map(|(name, value)| wit::Pair { name, value })
        .collect()
}

/// An email. Build it with [`Email::to`].
///
/// ```
/// # use idem_sdk::Email;
/// let email = Email::to("ana@example.com").unwrap()
///     .subject("Welcome")
///     .template("welcome", [("name", "Ana")]);
/// assert!(Email::to("not-an-address").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Email {
    to: Vec<String>,
    subject: String,
    text: Option<String>,
    html: Option<String>,
    template: Option<(String, Vec<(String, String)>)>,
}

impl Email {
    /// Starts an email to one recipient; an address that cannot be valid is a
    /// permanent `invalid_recipient` error.
    pub fn to(recipient: &str) -> Result<Self, JobError> {
        check_address(recipient)?;
        Ok(Email {
            to: vec![recipient.to_string()],
            subject: String::new(),
            text: None,
            html: None,
            template: None,
        })
    }

    /// Adds a recipient (same validation as [`Email::to`]).
    pub fn and_to(mut self, recipient: &str) -> Result<Self, JobError> {
        check_address(recipient)?;
        self.to.push(recipient.to_string());
        Ok(self)
    }

    /// Sets the subject.
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = subject.into();
        self
    }

    /// Sets the plain-text body.
    pub fn text(mut self, text: impl Into<String>) -> Self {
        self.text = Some(text.into());
        self
    }

    /// Sets the HTML body.
    pub fn html(mut self, html: impl Into<String>) -> Self {
        self.html = Some(html.into());
        self
    }

    /// Uses a provider-side template with variables instead of a body.
    pub fn template<I, K, V>(mut self, name: impl Into<String>, variables: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let variables = variables
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        self.template = Some((name.into(), variables));
        self
    }
}

/// A deliberately small check: one `@` with text on both sides, a dot in the
/// domain, no spaces or control characters. Providers do the full check.
fn check_address(address: &str) -> Result<(), JobError> {
    let valid = match address.split_once('@') {
        Some((local, domain)) => {
            !local.is_empty()
                && domain.contains('.')
                && !domain.starts_with('.')
                && !domain.ends_with('.')
                && !domain.contains('@')
                && address.chars().all(|c| c.is_ascii_graphic())
        }
        None => false,
    };
    if valid {
        Ok(())
    } else {
        Err(JobError::permanent(
            "invalid_recipient",
            format!("not an email address: {address:?}"),
        ))
    }
}

/// An HTTP request relative to a provider's base URL.
///
/// ```
/// # use idem_sdk::HttpRequest;
/// let req = HttpRequest::post("/orders/7/events").header("x-event", "paid").body(b"{}".to_vec());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpRequest {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Option<Vec<u8>>,
}

impl HttpRequest {
    /// A request with any method.
    pub fn new(method: impl Into<String>, path: impl Into<String>) -> Self {
        HttpRequest {
            method: method.into(),
            path: path.into(),
            headers: Vec::new(),
            body: None,
        }
    }

    /// A POST request.
    pub fn post(path: impl Into<String>) -> Self {
        Self::new("POST", path)
    }

    /// A PUT request.
    pub fn put(path: impl Into<String>) -> Self {
        Self::new("PUT", path)
    }

    /// A DELETE request.
    pub fn delete(path: impl Into<String>) -> Self {
        Self::new("DELETE", path)
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets a raw body.
    pub fn body(mut self, body: Vec<u8>) -> Self {
        self.body = Some(body);
        self
    }

    /// Sets a JSON body and the `content-type` header.
    pub fn json<T: Serialize>(self, value: &T) -> Result<Self, JobError> {
        let body = serde_json::to_vec(value)?;
        Ok(self.header("content-type", "application/json").body(body))
    }
}

/// A child job to enqueue.
///
/// ```
/// # use idem_sdk::ChildJob;
/// # use std::time::Duration;
/// let job = ChildJob::new("create_invoice", &serde_json::json!({"order_id": 7})).unwrap()
///     .queue("billing").delay(Duration::from_secs(60)).priority(5);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildJob {
    plugin: String,
    queue: Option<String>,
    payload: Vec<u8>,
    delay: Duration,
    priority: i32,
}

impl ChildJob {
    /// A child job for `plugin` with a JSON payload.
    pub fn new<T: Serialize>(plugin: impl Into<String>, payload: &T) -> Result<Self, JobError> {
        Ok(ChildJob {
            plugin: plugin.into(),
            queue: None,
            payload: serde_json::to_vec(payload)?,
            delay: Duration::ZERO,
            priority: 0,
        })
    }

    /// Enqueues on another queue than the parent's.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// Runs no earlier than `delay` after it is enqueued.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Higher runs first.
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_checked() {
        for ok in ["ana@example.com", "a.b+c@sub.example.org"] {
            assert!(Email::to(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "ana",
            "@example.com",
            "ana@",
            "ana@example",
            "a b@example.com",
            "a@b@c.d",
        ] {
            let err = Email::to(bad).unwrap_err();
            assert_eq!(err.code(), "invalid_recipient", "{bad}");
        }
    }

    #[test]
    fn effects_convert_to_the_contract() {
        let key = IdempotencyKey::new("order:7:invoice").unwrap();
        let wit = Effect::enqueue(key, ChildJob::new("inv", &1).unwrap().priority(3)).into_wit();
        assert_eq!(wit.provider, "jobs");
        assert_eq!(wit.idempotency_key, "order:7:invoice");
        match wit.action {
            wit::Action::Enqueue(j) => {
                assert_eq!(j.plugin, "inv");
                assert_eq!(j.priority, 3);
                assert_eq!(j.payload, b"1");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
