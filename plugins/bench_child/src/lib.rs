//! Benchmark plugin: one child job through the effect ledger per job (the
//! child is a `noop` on the `bench_children` queue, which the benchmark does
//! not drain).
use idem_sdk::{ChildJob, Effect, Job, JobError, key, plugin};
use serde::Deserialize;
use serde_json::json;

/// The benchmark's payload.
#[derive(Debug, Deserialize)]
pub struct Numbered {
    /// The job's number in the run.
    pub i: u64,
}

#[plugin(providers = ["jobs"], enqueues = ["noop"])]
pub fn handle(job: Job<Numbered>) -> Result<Vec<Effect>, JobError> {
    let child = ChildJob::new("noop", &json!({ "parent": job.payload.i }))?.queue("bench_children");
    Ok(vec![Effect::enqueue(
        key!("bench:{}:child", job.payload.i)?,
        child,
    )])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_child_per_job_keyed_by_its_number() {
        let effects = handle(Job::for_test(Numbered { i: 7 })).unwrap();
        assert_eq!(effects.len(), 1);
        assert_eq!(effects[0].key().as_str(), "bench:7:child");
        assert_eq!(effects[0].provider(), "jobs");
    }
}
