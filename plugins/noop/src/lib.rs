//! Returns no effects: measures the sandbox's own cost.
use idem_sdk::{Effect, Job, JobError, plugin};

#[plugin]
pub fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    Ok(Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_payload_gives_no_effects() {
        let job = Job::for_test(serde::de::IgnoredAny);
        assert!(handle(job).unwrap().is_empty());
    }
}
