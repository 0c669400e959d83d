//! Hostile: returns a 100 MiB error message. The host's output cap must refuse it.
use idem_sdk::{Effect, Job, JobError, plugin};

#[plugin]
pub fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    Err(JobError::permanent("huge", "x".repeat(100 << 20)))
}
