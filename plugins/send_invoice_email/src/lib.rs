//! Emails an invoice: one email effect keyed `invoice:{invoice_id}:email:v1`.
use idem_sdk::{Effect, Email, Job, JobError, key, plugin};
use serde::Deserialize;

/// The payload producers enqueue.
#[derive(Debug, Deserialize)]
pub struct InvoiceEmail {
    pub invoice_id: u64,
    pub recipient: String,
}

#[plugin(providers = ["email"])]
pub fn handle(job: Job<InvoiceEmail>) -> Result<Vec<Effect>, JobError> {
    let invoice = job.payload;
    idem_sdk::info!(
        "emailing invoice {} to {}",
        invoice.invoice_id,
        invoice.recipient
    );
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

#[cfg(test)]
mod tests {
    use super::*;
    use idem_sdk::Email;

    fn invoice(recipient: &str) -> Job<InvoiceEmail> {
        Job::for_test(InvoiceEmail {
            invoice_id: 42,
            recipient: recipient.to_string(),
        })
    }

    #[test]
    fn one_email_keyed_by_the_invoice() {
        let effects = handle(invoice("ana@example.com")).unwrap();
        let email = Email::to("ana@example.com")
            .unwrap()
            .subject("Invoice 42")
            .text("Hello,\n\nyour invoice 42 is ready.\n");
        assert_eq!(
            effects,
            [Effect::email(key!("invoice:42:email:v1").unwrap(), email)]
        );
    }

    #[test]
    fn a_redelivery_describes_the_same_email() {
        let retried = Job {
            attempt: 3,
            ..invoice("ana@example.com")
        };
        assert_eq!(
            handle(retried).unwrap(),
            handle(invoice("ana@example.com")).unwrap()
        );
    }

    #[test]
    fn an_invalid_recipient_is_permanent() {
        let error = handle(invoice("not-an-address")).unwrap_err();
        assert_eq!(error.code(), "invalid_recipient");
        assert!(!error.is_retryable());
    }
}
