//! Hostile: panics. The host must classify it as a plugin panic.
use idem_sdk::{Effect, Job, JobError, plugin};

#[plugin]
pub fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    panic!("the plugin gave up on purpose");
}
