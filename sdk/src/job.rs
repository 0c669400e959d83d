//! The job a plugin receives.

use crate::__private::bindings::idem::plugin::types as wit;
use crate::JobError;
use serde::de::DeserializeOwned;

/// One delivery of a job, with its payload decoded from JSON into `P`.
///
/// The same job may be delivered more than once (`attempt` grows); the
/// effects a plugin returns must not depend on the attempt, so that every
/// delivery describes the same business operations with the same keys.
///
/// ```
/// use idem_sdk::Job;
/// fn describe(job: &Job<serde_json::Value>) -> String {
///     format!("job {} attempt {}/{}", job.id, job.attempt, job.max_attempts)
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Job<P> {
    /// The job's id in the store.
    pub id: i64,
    /// Name of the plugin the job is addressed to.
    pub plugin: String,
    /// Queue the job was enqueued on.
    pub queue: String,
    /// The decoded payload.
    pub payload: P,
    /// 1 for the first delivery.
    pub attempt: u32,
    /// Attempts made before the job is dead-lettered.
    pub max_attempts: u32,
    /// The job's own idempotency key, when the producer gave one.
    pub idempotency_key: Option<String>,
    /// Correlation id for tracing across systems.
    pub correlation_id: String,
    /// When the job was enqueued, milliseconds since the Unix epoch.
    pub enqueued_at_ms: i64,
}

impl<P> Job<P> {
    /// A job carrying `payload`, for unit-testing a plugin function natively
    /// (`cargo test` on the host): id 1, plugin `"test"`, queue `"default"`,
    /// first of 10 attempts, no job key, correlation id `"test"`. Change any
    /// field with struct update syntax.
    ///
    /// ```
    /// use idem_sdk::Job;
    /// let job = Job::for_test(serde_json::json!({"invoice_id": 42}));
    /// assert_eq!(job.attempt, 1);
    /// let retried = Job { attempt: 3, ..Job::for_test(()) };
    /// assert_eq!(retried.attempt, 3);
    /// ```
    pub fn for_test(payload: P) -> Self {
        Job {
            id: 1,
            plugin: "test".to_string(),
            queue: "default".to_string(),
            payload,
            attempt: 1,
            max_attempts: 10,
            idempotency_key: None,
            correlation_id: "test".to_string(),
            enqueued_at_ms: 0,
        }
    }
}

impl<P: DeserializeOwned> Job<P> {
    /// Decodes the payload; a payload that does not fit `P` is a permanent
    /// `payload_invalid` error carrying serde's message.
    pub(crate) fn decode(job: wit::Job) -> Result<Self, JobError> {
        let payload = serde_json::from_slice(&job.payload)
            .map_err(|e| JobError::permanent("payload_invalid", e.to_string()))?;
        Ok(Job {
            id: job.id,
            plugin: job.plugin,
            queue: job.queue,
            payload,
            attempt: job.attempt,
            max_attempts: job.max_attempts,
            idempotency_key: job.idempotency_key,
            correlation_id: job.correlation_id,
            enqueued_at_ms: job.enqueued_at_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(payload: &str) -> wit::Job {
        wit::Job {
            id: 1,
            plugin: "p".into(),
            queue: "default".into(),
            payload: payload.as_bytes().to_vec(),
            attempt: 1,
            max_attempts: 10,
            idempotency_key: None,
            correlation_id: "c".into(),
            enqueued_at_ms: 0,
        }
    }

    #[derive(serde::Deserialize, Debug)]
    struct Invoice {
        #[allow(dead_code)]
        invoice_id: u64,
    }

    #[test]
    fn a_payload_that_does_not_fit_is_permanent_payload_invalid() {
        let err = Job::<Invoice>::decode(raw("{\"invoice_id\": \"x\"}")).unwrap_err();
        assert_eq!(err.code(), "payload_invalid");
        assert!(!err.is_retryable());
        let err = Job::<Invoice>::decode(raw("not json")).unwrap_err();
        assert_eq!(err.code(), "payload_invalid");
    }

    #[test]
    fn a_valid_payload_decodes() {
        let job = Job::<Invoice>::decode(raw("{\"invoice_id\": 4}")).unwrap();
        assert_eq!(job.payload.invoice_id, 4);
    }
}
