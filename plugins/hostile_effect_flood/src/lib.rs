//! Hostile: returns a million effects. The host's output cap must refuse them.
use idem_sdk::{Effect, IdempotencyKey, Job, JobError, plugin};

#[plugin]
pub fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    let key = IdempotencyKey::new("flood")?;
    Ok((0..1_000_000)
        .map(|_| Effect::custom("x", key.clone(), Vec::new()))
        .collect())
}
