//! Hostile: never returns. The host must stop it at its deadline.
use idem_sdk::{Effect, Job, JobError, plugin};

#[plugin]
pub fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    let mut n: u64 = 0;
    loop {
        n = std::hint::black_box(n.wrapping_add(1));
    }
}
