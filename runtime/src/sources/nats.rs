//! NATS JetStream through async-nats: a durable pull consumer with explicit
//! acks (created when missing); each fetched batch is inserted in one
//! transaction, then every message of it is acknowledged. `max_ack_pending`
//! is the source's prefetch, so a slow store holds the stream back instead
//! of buffering it.

use super::{Backoff, Incoming, Source};
use crate::store::Store;
use async_nats::jetstream::{self, consumer::AckPolicy, consumer::pull};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("broker: {0}")]
    Broker(String),
}

fn broker(error: impl std::fmt::Display) -> SessionError {
    SessionError::Broker(error.to_string())
}

/// The header NATS deduplicates publishes by: a source's `message_id`.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

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

fn incoming(message: &jetstream::Message) -> Incoming {
    let headers: Vec<(String, String)> = message
        .headers
        .as_ref()
        .map(|h| {
            h.iter()
                .flat_map(|(name, values)| {
                    values
                        .iter()
                        .map(move |v| (name.to_string(), v.as_str().to_string()))
                })
                .collect()
        })
        .unwrap_or_default();
    let message_id = headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(MSG_ID_HEADER))
        .map(|(_, v)| v.clone());
    Incoming {
        payload: message.payload.to_vec(),
        message_id,
        headers,
    }
}

async fn session(
    store: &dyn Store,
    source: &Source,
    stop: &CancellationToken,
    backoff: &mut Backoff,
) -> Result<(), SessionError> {
    let connect = async_nats::ConnectOptions::new()
        .max_reconnects(Some(5))
        .connect(&source.config.url);
    let client = tokio::select! {
        _ = stop.cancelled() => return Ok(()),
        client = tokio::time::timeout(Duration::from_secs(30), connect) => match client {
            Ok(client) => client.map_err(broker)?,
            Err(_) => return Err(broker("no connection within 30 s")),
        },
    };
    let context = jetstream::new(client.clone());
    let stream_name = source.config.stream.clone().unwrap_or_default();
    let stream = context.get_stream(&stream_name).await.map_err(broker)?;
    let durable = source
        .config
        .consumer
        .clone()
        .unwrap_or_else(|| format!("idem-{}", source.config.plugin));
    let consumer = stream
        .get_or_create_consumer(
            &durable,
            pull::Config {
                durable_name: Some(durable.clone()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: source.config.ack_wait,
                filter_subject: source.config.subject.clone().unwrap_or_default(),
                max_ack_pending: i64::from(source.config.prefetch),
                ..Default::default()
            },
        )
        .await
        .map_err(broker)?;
    // A consumer made elsewhere is used as it is: it must acknowledge
    // explicitly, or a crash after delivery would lose messages.
    let mut consumer = consumer;
    let policy = consumer.info().await.map_err(broker)?.config.ack_policy;
    if policy != AckPolicy::Explicit {
        return Err(broker(format!(
            "the consumer {durable:?} acknowledges with {policy:?}; idem needs explicit acks (delete it or name another)"
        )));
    }
    tracing::info!(source = %source.name, stream = %stream_name, consumer = %durable, "source connected");
    // A pull request lives this long; its messages are handed over in
    // chunks as they come (a chunk closes `batch_wait` after its first
    // message), so a quiet stream's message waits `batch_wait`, not the
    // request's whole life.
    let expires = source.config.batch_wait.max(Duration::from_secs(1));
    loop {
        if stop.is_cancelled() {
            return Ok(());
        }
        let fetch = consumer
            .batch()
            .max_messages(source.config.batch)
            .expires(expires)
            .messages();
        let mut batch = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            batch = fetch => batch.map_err(broker)?,
        };
        let mut ended = false;
        while !ended {
            let first = tokio::select! {
                // Fetched but unacknowledged messages are redelivered after ack_wait.
                _ = stop.cancelled() => return Ok(()),
                next = batch.next() => next,
            };
            let Some(first) = first else { break };
            let mut messages = vec![first.map_err(broker)?];
            let deadline = tokio::time::Instant::now() + source.config.batch_wait;
            while messages.len() < source.config.batch {
                let next = tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    next = tokio::time::timeout_at(deadline, batch.next()) => next,
                };
                match next {
                    Ok(Some(message)) => messages.push(message.map_err(broker)?),
                    Ok(None) => {
                        ended = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            chunk(store, source, &client, &messages, stop).await?;
            backoff.reset();
        }
    }
}

/// Inserts a chunk of messages, then acknowledges each and flushes the acks.
async fn chunk(
    store: &dyn Store,
    source: &Source,
    client: &async_nats::Client,
    messages: &[jetstream::Message],
    stop: &CancellationToken,
) -> Result<(), SessionError> {
    crate::metrics::source_messages(&source.name, "received", messages.len());
    let incoming: Vec<Incoming> = messages.iter().map(incoming).collect();
    if super::ingest_until_stored(store, source, &incoming, stop)
        .await
        .is_none()
    {
        // Stopped: nothing is acknowledged; the messages come back.
        return Ok(());
    }
    for message in messages {
        message.ack().await.map_err(broker)?;
    }
    // Acks are publishes: out before the next chunk (or the exit); a flush
    // that cannot finish (the server is gone) leaves them to redelivery,
    // which the jobs' keys absorb.
    tokio::select! {
        _ = stop.cancelled() => return Ok(()),
        flushed = tokio::time::timeout(Duration::from_secs(10), client.flush()) => {
            flushed.map_err(|_| broker("acks not flushed within 10 s"))?.map_err(broker)?;
        }
    }
    crate::metrics::source_messages(&source.name, "acked", messages.len());
    if let Some(info) = messages.last().and_then(|m| m.info().ok()) {
        crate::metrics::source_lag(&source.name, info.pending);
    }
    Ok(())
}
