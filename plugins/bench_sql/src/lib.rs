//! Benchmark plugin: one `sql` statement per job, a row in the store's own
//! database (the `bench_db` provider during `idem bench --plugin sql`). Its
//! only effect is the plan's last, so the row, its ledger entry and the
//! job's success commit together.
use idem_sdk::{Effect, Job, JobError, key, params, plugin};
use serde::Deserialize;

/// The benchmark's payload.
#[derive(Debug, Deserialize)]
pub struct Numbered {
    /// The job's number in the run.
    pub i: u64,
}

#[plugin(providers = ["bench_db"])]
pub fn handle(job: Job<Numbered>) -> Result<Vec<Effect>, JobError> {
    let i = i64::try_from(job.payload.i)
        .map_err(|_| JobError::permanent("invalid_payload", "i is out of range"))?;
    Ok(vec![Effect::sql(
        "bench_db",
        key!("bench:{}:row", job.payload.i)?,
        "insert_row",
        params![i],
    )])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_row_per_job_keyed_by_its_number() {
        let effects = handle(Job::for_test(Numbered { i: 3 })).unwrap();
        assert_eq!(effects.len(), 1);
        assert_eq!(effects[0].key().as_str(), "bench:3:row");
        assert_eq!(effects[0].provider(), "bench_db");
    }
}
