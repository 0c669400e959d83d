//! Hostile: tries to make the `billing_db` sql provider run SQL of its own
//! choosing. The payload picks the trick; the host must refuse each one
//! before anything runs.
use idem_sdk::{Effect, Job, JobError, key, params, plugin};
use serde::Deserialize;

/// Which trick to try.
#[derive(Debug, Deserialize)]
pub struct Trick {
    pub mode: String,
}

#[plugin(providers = ["billing_db"])]
pub fn handle(job: Job<Trick>) -> Result<Vec<Effect>, JobError> {
    let key = key!("hostile:{}", job.payload.mode)?;
    let effect = match job.payload.mode.as_str() {
        // SQL text instead of a statement name.
        "sql_text" => Effect::custom(
            "billing_db",
            key,
            br#"{"statement":"create_invoice","sql":"DROP TABLE invoices","params":[]}"#.to_vec(),
        ),
        // Raw SQL as the whole body.
        "raw_sql" => Effect::custom("billing_db", key, b"DROP TABLE invoices".to_vec()),
        // A statement the operator never declared.
        "undeclared" => Effect::sql("billing_db", key, "drop_invoices", params![]),
        // The declared statement with a parameter missing.
        "wrong_count" => Effect::sql("billing_db", key, "create_invoice", params!["o-1"]),
        // An injection attempt inside a value: bound, so stored as text.
        _ => Effect::sql(
            "billing_db",
            key,
            "create_invoice",
            params!["o-x'); DROP TABLE invoices; --", 1, "eve@example.com"],
        ),
    };
    Ok(vec![effect])
}
