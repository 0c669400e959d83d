//! Hostile: sleeps for an hour. Waiting happens inside the host, where epoch
//! deadlines cannot interrupt it, so the host must refuse the wait.
use idem_sdk::{Effect, Job, JobError, plugin};

#[plugin]
pub fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    std::thread::sleep(std::time::Duration::from_secs(3600));
    Ok(Vec::new())
}
