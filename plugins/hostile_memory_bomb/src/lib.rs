//! Hostile: allocates 1 GiB. The host's memory cap must refuse it.
use idem_sdk::{Effect, Job, JobError, plugin};

#[plugin]
pub fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    let bomb = std::hint::black_box(vec![1u8; 1 << 30]);
    Ok(Vec::with_capacity(bomb.len() % 2))
}
