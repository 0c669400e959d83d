//! Creates an order's invoice: one row through the `billing_db` provider's
//! declared `create_invoice` statement, and one email to the customer.
use idem_sdk::{Effect, Email, Job, JobError, key, params, plugin};
use serde::Deserialize;

/// The payload producers enqueue.
#[derive(Debug, Deserialize)]
pub struct InvoiceOrder {
    pub order_id: String,
    pub amount_cents: i64,
    pub customer: String,
}

#[plugin(providers = ["billing_db", "email"])]
pub fn handle(job: Job<InvoiceOrder>) -> Result<Vec<Effect>, JobError> {
    let order = job.payload;
    if order.amount_cents < 0 {
        return Err(JobError::permanent(
            "invalid_amount",
            format!(
                "order {}: amount_cents is {}, an invoice cannot be negative",
                order.order_id, order.amount_cents
            ),
        ));
    }
    let email = Email::to(&order.customer)?
        .subject(format!("Invoice for order {}", order.order_id))
        .text(format!(
            "Hello,\n\nyour invoice for order {} ({}.{:02}) is ready.\n",
            order.order_id,
            order.amount_cents / 100,
            order.amount_cents % 100
        ));
    Ok(vec![
        Effect::sql(
            "billing_db",
            key!("order:{}:invoice", order.order_id)?,
            "create_invoice",
            params![&order.order_id, order.amount_cents, &order.customer],
        ),
        Effect::email(key!("order:{}:invoice-email", order.order_id)?, email),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(amount_cents: i64, customer: &str) -> Job<InvoiceOrder> {
        Job::for_test(InvoiceOrder {
            order_id: "ord-7".to_string(),
            amount_cents,
            customer: customer.to_string(),
        })
    }

    #[test]
    fn an_order_inserts_its_invoice_row_and_emails_the_customer() {
        let effects = handle(order(1250, "ana@example.com")).unwrap();
        let email = Email::to("ana@example.com")
            .unwrap()
            .subject("Invoice for order ord-7")
            .text("Hello,\n\nyour invoice for order ord-7 (12.50) is ready.\n");
        assert_eq!(
            effects,
            [
                Effect::sql(
                    "billing_db",
                    key!("order:ord-7:invoice").unwrap(),
                    "create_invoice",
                    params!["ord-7", 1250, "ana@example.com"],
                ),
                Effect::email(key!("order:ord-7:invoice-email").unwrap(), email),
            ]
        );
        assert_eq!(effects[0].provider(), "billing_db");
        assert_eq!(effects[1].provider(), "email");
    }

    #[test]
    fn a_redelivery_describes_the_same_effects() {
        let retried = Job {
            attempt: 3,
            ..order(1250, "ana@example.com")
        };
        assert_eq!(
            handle(retried).unwrap(),
            handle(order(1250, "ana@example.com")).unwrap()
        );
    }

    #[test]
    fn a_negative_amount_is_permanent() {
        let error = handle(order(-1, "ana@example.com")).unwrap_err();
        assert_eq!(error.code(), "invalid_amount");
        assert!(!error.is_retryable());
    }

    #[test]
    fn a_zero_amount_is_an_invoice() {
        assert_eq!(handle(order(0, "ana@example.com")).unwrap().len(), 2);
    }

    #[test]
    fn an_invalid_customer_address_is_permanent() {
        let error = handle(order(1250, "not-an-address")).unwrap_err();
        assert_eq!(error.code(), "invalid_recipient");
        assert!(!error.is_retryable());
    }
}
