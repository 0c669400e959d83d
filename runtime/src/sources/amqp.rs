//! RabbitMQ (AMQP 0.9.1) through lapin: a consumer with manual acks and a
//! prefetch limit; each batch of deliveries is inserted in one transaction
//! and then acknowledged with one multiple-ack up to its last delivery tag.
//! A store error closes the connection without acknowledging, so the broker
//! redelivers the batch to the next session.

use super::{Backoff, Incoming, Source};
use crate::store::Store;
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("broker: {0}")]
    Broker(#[from] lapin::Error),
    #[error("the broker closed the consumer")]
    ConsumerEnded,
    #[error("no connection within 30 s")]
    ConnectTimeout,
    #[error("an acknowledgement was refused: the channel closed")]
    AckRefused,
    #[error("the broker did not answer the liveness probe within 10 s")]
    ProbeTimeout,
    #[error("an acknowledgement was not sent within 10 s: the connection is gone")]
    AckTimeout,
}

/// How long the periodic probe of the queue (its depth, for the lag
/// metric) may take before the session is taken for dead.
const LIVENESS_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the source until `stop`, reconnecting with backoff.
pub async fn run(store: Arc<dyn Store>, source: Source, stop: CancellationToken) {
    let mut backoff = Backoff::default();
    loop {
        match session(&*store, &source, &stop, &mut backoff).await {
            Ok(()) => return,
            Err(error) => {
                if !super::wait_to_reconnect(&source, &error, &mut backoff, &stop).await {
                    return;
                }
            }
        }
    }
}

/// Text of a header value, for key rules.
fn header_text(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        AMQPValue::ByteArray(b) => String::from_utf8_lossy(b.as_slice()).into_owned(),
        _ => return None,
    })
}

fn incoming(delivery: &lapin::message::Delivery) -> Incoming {
    let headers = delivery
        .properties
        .headers()
        .as_ref()
        .map(|table| {
            table
                .inner()
                .iter()
                .filter_map(|(k, v)| header_text(v).map(|v| (k.as_str().to_string(), v)))
                .collect()
        })
        .unwrap_or_default();
    Incoming {
        payload: delivery.data.clone(),
        message_id: delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_string()),
        headers,
    }
}

async fn session(
    store: &dyn Store,
    source: &Source,
    stop: &CancellationToken,
    backoff: &mut Backoff,
) -> Result<(), SessionError> {
    let queue = source.config.queue.clone().unwrap_or_default();
    let connect = Connection::connect(&source.config.url, ConnectionProperties::default());
    let connection = tokio::select! {
        _ = stop.cancelled() => return Ok(()),
        connection = tokio::time::timeout(Duration::from_secs(30), connect) => match connection {
            Ok(connection) => connection?,
            Err(_) => return Err(SessionError::ConnectTimeout),
        },
    };
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(source.config.prefetch, BasicQosOptions::default())
        .await?;
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            format!("idem-{}", std::process::id()).as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    tracing::info!(source = %source.name, queue = %queue, "source connected");
    let lag_channel = connection.create_channel().await?;
    let mut lag_tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        let first = tokio::select! {
            _ = stop.cancelled() => {
                // Unacknowledged deliveries go back to the queue with the channel.
                let _ = connection.close(200, "idem stops".into()).await;
                return Ok(());
            }
            _ = lag_tick.tick() => {
                // Also the session's liveness probe: a connection cut under
                // the consumer does not always end its stream, and a source
                // waiting on it would never reconnect. A probe that fails
                // or hangs ends the session (the next one reconnects).
                let probe = lag_channel.queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() },
                    FieldTable::default(),
                );
                match tokio::time::timeout(LIVENESS_TIMEOUT, probe).await {
                    Ok(Ok(q)) => crate::metrics::source_lag(&source.name, u64::from(q.message_count())),
                    Ok(Err(error)) => return Err(SessionError::Broker(error)),
                    Err(_) => return Err(SessionError::ProbeTimeout),
                }
                continue;
            }
            next = consumer.next() => match next {
                Some(delivery) => delivery?,
                None => return Err(SessionError::ConsumerEnded),
            },
        };
        let mut deliveries = vec![first];
        let deadline = tokio::time::Instant::now() + source.config.batch_wait;
        while deliveries.len() < source.config.batch {
            match tokio::time::timeout_at(deadline, consumer.next()).await {
                Ok(Some(delivery)) => deliveries.push(delivery?),
                Ok(None) => return Err(SessionError::ConsumerEnded),
                Err(_) => break,
            }
        }
        crate::metrics::source_messages(&source.name, "received", deliveries.len());
        let batch: Vec<Incoming> = deliveries.iter().map(incoming).collect();
        let Some(_) = super::ingest_until_stored(store, source, &batch, stop).await else {
            let _ = connection.close(200, "idem stops".into()).await;
            return Ok(());
        };
        // Every delivery of the batch is in the store: one ack covers them.
        // Bounded: an ack on a connection cut under it can wait forever,
        // and the session would never reconnect (the deliveries it leaves
        // unacknowledged come back, into the same jobs).
        if let Some(last) = deliveries.last() {
            let ack = last.acker.ack(BasicAckOptions { multiple: true });
            let acked = tokio::time::timeout(LIVENESS_TIMEOUT, ack)
                .await
                .map_err(|_| SessionError::AckTimeout)??;
            if !acked {
                return Err(SessionError::AckRefused);
            }
        }
        crate::metrics::source_messages(&source.name, "acked", deliveries.len());
        backoff.reset();
    }
}
