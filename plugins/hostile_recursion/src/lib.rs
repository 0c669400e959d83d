//! Hostile: recurses without end. The host's stack limit must catch it.
#![allow(unconditional_recursion)]
use idem_sdk::{Effect, Job, JobError, plugin};

#[inline(never)]
fn deeper(n: u64) -> u64 {
    std::hint::black_box(deeper(std::hint::black_box(n + 1))) + 1
}

#[plugin]
pub fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    let depth = deeper(0);
    Err(JobError::permanent(
        "unreachable",
        format!("returned from depth {depth}"),
    ))
}
