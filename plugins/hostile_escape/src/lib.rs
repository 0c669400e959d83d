//! Hostile: tries to read `/etc/passwd`, list `/`, read an environment
//! variable and open a TCP connection, then reports what it got as a custom
//! effect, so tests can see that every attempt was refused.
use idem_sdk::{Effect, IdempotencyKey, Job, JobError, plugin};
use serde_json::json;

fn outcome<T>(result: std::io::Result<T>) -> String {
    match result {
        Ok(_) => "ok".to_string(),
        Err(e) => format!("error: {e}"),
    }
}

#[plugin(providers = ["report"])]
pub fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    let report = json!({
        "file": outcome(std::fs::read("/etc/passwd")),
        "dir": outcome(std::fs::read_dir("/")),
        "env": std::env::var("HOME").map(|_| "ok".to_string()).unwrap_or_else(|e| format!("error: {e}")),
        "tcp": outcome(std::net::TcpStream::connect("127.0.0.1:5432")),
    });
    Ok(vec![Effect::custom(
        "report",
        IdempotencyKey::new("escape:report")?,
        serde_json::to_vec(&report)?,
    )])
}
