//! Returns no effects: measures the sandbox's own cost.
use idem_sdk::{Effect, Job, JobError, plugin};

#[plugin]
pub fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    Ok(Vec::new())
}
