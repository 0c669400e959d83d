//! Benchmark plugin: one HTTP request per job to the `bench_http` provider
//! (the local provider server during `idem bench`).
use idem_sdk::{Effect, HttpRequest, Job, JobError, key, plugin};
use serde::Deserialize;
use serde_json::json;

/// The benchmark's payload.
#[derive(Debug, Deserialize)]
pub struct Numbered {
    /// The job's number in the run.
    pub i: u64,
}

#[plugin(providers = ["bench_http"])]
pub fn handle(job: Job<Numbered>) -> Result<Vec<Effect>, JobError> {
    let request = HttpRequest::post("/bench/events").json(&json!({ "i": job.payload.i }))?;
    Ok(vec![Effect::http(
        "bench_http",
        key!("bench:{}:http", job.payload.i)?,
        request,
    )])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_request_per_job_keyed_by_its_number() {
        let effects = handle(Job::for_test(Numbered { i: 3 })).unwrap();
        assert_eq!(effects.len(), 1);
        assert_eq!(effects[0].key().as_str(), "bench:3:http");
        assert_eq!(effects[0].provider(), "bench_http");
    }
}
