//! Syncs a paid order: notifies the partner by webhook and enqueues the job
//! that creates the invoice.
use idem_sdk::{ChildJob, Effect, HttpRequest, Job, JobError, key, plugin};
use serde::Deserialize;
use serde_json::json;

/// The payload producers enqueue.
#[derive(Debug, Deserialize)]
pub struct OrderEvent {
    pub order_id: u64,
    pub event_id: String,
    pub destination: String,
}

#[plugin(providers = ["partner", "jobs"], enqueues = ["send_invoice_email"])]
pub fn handle(job: Job<OrderEvent>) -> Result<Vec<Effect>, JobError> {
    let order = job.payload;
    let webhook =
        HttpRequest::post(format!("/partners/{}/orders", order.destination)).json(&json!({
            "order_id": order.order_id,
            "event_id": order.event_id,
        }))?;
    let invoice = ChildJob::new(
        "send_invoice_email",
        &json!({"invoice_id": order.order_id, "recipient": format!("billing+{}@example.com", order.order_id)}),
    )?;
    Ok(vec![
        Effect::http(
            "partner",
            key!("webhook:{}:{}", order.event_id, order.destination)?,
            webhook,
        ),
        Effect::enqueue(key!("order:{}:invoice", order.order_id)?, invoice),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_paid_order_notifies_the_partner_and_enqueues_its_invoice() {
        let effects = handle(Job::for_test(OrderEvent {
            order_id: 7,
            event_id: "evt_1".to_string(),
            destination: "acme".to_string(),
        }))
        .unwrap();
        let webhook = HttpRequest::post("/partners/acme/orders")
            .json(&json!({"order_id": 7, "event_id": "evt_1"}))
            .unwrap();
        let invoice = ChildJob::new(
            "send_invoice_email",
            &json!({"invoice_id": 7, "recipient": "billing+7@example.com"}),
        )
        .unwrap();
        assert_eq!(
            effects,
            [
                Effect::http("partner", key!("webhook:evt_1:acme").unwrap(), webhook),
                Effect::enqueue(key!("order:7:invoice").unwrap(), invoice),
            ]
        );
        assert_eq!(effects[1].provider(), "jobs");
    }
}
