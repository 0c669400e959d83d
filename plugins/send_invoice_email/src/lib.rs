//! Emails an invoice: one email effect keyed `invoice:{invoice_id}:email:v1`.
use idem_sdk::{Effect, Email, Job, JobError, key, plugin};
use serde::Deserialize;

/// The payload producers enqueue.
#[derive(Debug, Deserialize)]
pub struct InvoiceEmail {
    pub invoice_id: u64,
    pub recipient: String,
}

#[plugin]
pub fn handle(job: Job<InvoiceEmail>) -> Result<Vec<Effect>, JobError> {
    let invoice = job.payload;
    idem_sdk::info!("emailing invoice {} to {}", invoice.invoice_id, invoice.recipient);
    let email = Email::to(&invoice.recipient)?
        .subject(format!("Invoice {}", invoice.invoice_id))
        .text(format!(
            "Hello,\n\nyour invoice {} is ready.\n",
            invoice.invoice_id
        ));
    Ok(vec![Effect::email(
        key!("invoice:{}:email:v1", invoice.invoice_id)?,
        email,
    )])
}
