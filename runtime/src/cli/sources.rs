//! `idem sources list|bench`: the configured brokers, and how fast one
//! turns messages into jobs on this machine.

use super::CliError;
use crate::config::Config;
use crate::sources::{Source, SourceConfig, SourceKind};
use crate::store::{JobState, Store};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// `idem sources ...`
#[derive(Debug, clap::Subcommand)]
pub enum SourcesCommand {
    /// The `[[sources]]` of the configuration, checked.
    List,
    /// Publish N messages to a fresh queue (AMQP) or stream (NATS), then
    /// measure how fast a source turns them into jobs in a fresh store.
    Bench(SourcesBenchArgs),
    /// Publish each line of NDJSON on stdin as a message (a dev tool for
    /// demos): the key, read from the line with `--key-from`, goes into the
    /// AMQP message id or the NATS header `Idem-Key`.
    Publish(PublishArgs),
}

/// Arguments of `idem sources publish`.
#[derive(Debug, clap::Args)]
pub struct PublishArgs {
    /// `amqp` or `nats`.
    #[arg(long)]
    pub kind: String,
    /// Broker URL (default: the local RabbitMQ or NATS).
    #[arg(long)]
    pub url: Option<String>,
    /// AMQP queue (declared when missing) or NATS stream (created when
    /// missing, on the subject `STREAM.messages`).
    #[arg(long)]
    pub to: String,
    /// JSON pointer of the key in each line, e.g. `/event_id`.
    #[arg(long)]
    pub key_from: String,
    /// Publish every line this many times (an at-least-once producer).
    #[arg(long, default_value_t = 1)]
    pub times: u32,
}

/// Arguments of `idem sources bench`.
#[derive(Debug, clap::Args)]
pub struct SourcesBenchArgs {
    /// `amqp` or `nats`.
    #[arg(long)]
    pub kind: String,
    /// Broker URL (default: the local RabbitMQ or NATS).
    #[arg(long)]
    pub url: Option<String>,
    /// Messages.
    #[arg(short = 'n', long, default_value_t = 100_000)]
    pub messages: u32,
    /// Messages per insert transaction.
    #[arg(long, default_value_t = 1000)]
    pub batch: usize,
    /// Messages unacknowledged at most.
    #[arg(long, default_value_t = 5000)]
    pub prefetch: u16,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs a sources command.
pub async fn run(
    config: &Config,
    database_url: Option<&str>,
    command: SourcesCommand,
) -> Result<(), CliError> {
    match command {
        SourcesCommand::List => {
            if config.sources.is_empty() {
                eprintln!("no [[sources]] in the configuration");
            }
            for source in &config.sources {
                let checked = source.check().map(|rule| rule.to_string());
                println!(
                    "{:<28} {:<5} plugin {:<22} key {:<24} {}",
                    source.name(),
                    format!("{:?}", source.kind).to_lowercase(),
                    source.plugin,
                    source.key,
                    match checked {
                        Ok(_) => "ok".to_string(),
                        Err(e) => format!("ERROR {e}"),
                    }
                );
            }
            Ok(())
        }
        SourcesCommand::Bench(args) => bench(database_url, args).await,
        SourcesCommand::Publish(args) => publish(args).await,
    }
}

/// The NATS header `idem sources publish` puts the key in.
pub const KEY_HEADER: &str = "Idem-Key";

fn default_url(kind: &str) -> String {
    match kind {
        "nats" => "nats://127.0.0.1:4222".into(),
        _ => "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
    }
}

async fn publish(args: PublishArgs) -> Result<(), CliError> {
    let url = args.url.clone().unwrap_or_else(|| default_url(&args.kind));
    let text = std::io::read_to_string(std::io::stdin())
        .map_err(|e| CliError::Usage(format!("cannot read stdin: {e}")))?;
    let mut messages = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| CliError::Usage(format!("line {}: {e}", n + 1)))?;
        let key = match value.pointer(&args.key_from) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Number(v)) => Some(v.to_string()),
            _ => None,
        };
        for _ in 0..args.times {
            messages.push((line.as_bytes().to_vec(), key.clone()));
        }
    }
    match args.kind.as_str() {
        "amqp" => amqp_send(&url, &args.to, &messages).await?,
        "nats" => {
            nats_send(
                &url,
                &args.to,
                &format!("{}.messages", args.to),
                &messages,
                KEY_HEADER,
            )
            .await?
        }
        other => return Err(CliError::Usage(format!("--kind {other:?}: amqp or nats"))),
    }
    eprintln!(
        "published {} messages to {} {}",
        messages.len(),
        args.kind,
        args.to
    );
    Ok(())
}

fn broker_error(e: impl std::fmt::Display) -> CliError {
    CliError::Runtime(anyhow::anyhow!("broker: {e}"))
}

/// Measures on a clean store: a fresh SQLite file, or a fresh schema of the
/// `--database-url` PostgreSQL (dropped afterwards).
async fn bench(database_url: Option<&str>, args: SourcesBenchArgs) -> Result<(), CliError> {
    let name = format!("idem_bench_{}", hex::encode(rand::random::<[u8; 4]>()));
    let kind = match args.kind.as_str() {
        "amqp" => SourceKind::Amqp,
        "nats" => SourceKind::Nats,
        other => return Err(CliError::Usage(format!("--kind {other:?}: amqp or nats"))),
    };
    let url = args.url.clone().unwrap_or_else(|| match kind {
        SourceKind::Amqp => "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
        SourceKind::Nats => "nats://127.0.0.1:4222".into(),
    });
    let scratch = super::bench::Scratch::open(database_url).await?;
    let store: Arc<dyn Store> = scratch.store.clone();
    eprintln!("publishing {} messages to {name}", args.messages);
    let published = Instant::now();
    let subject = format!("{name}.orders");
    match kind {
        SourceKind::Amqp => amqp_publish(&url, &name, args.messages).await?,
        SourceKind::Nats => nats_publish(&url, &name, &subject, args.messages).await?,
    }
    let publish_took = published.elapsed();
    let source: SourceConfig = toml::from_str(&format!(
        "kind = \"{}\"\nurl = \"{url}\"\n{}plugin = \"noop\"\nkey = \"message_id\"\nbatch = {}\nprefetch = {}\nbatch_wait = \"5ms\"\njob_queue = \"{name}\"",
        args.kind,
        match kind {
            SourceKind::Amqp => format!("queue = \"{name}\"\n"),
            SourceKind::Nats => format!("stream = \"{name}\"\n"),
        },
        args.batch,
        args.prefetch
    ))
    .map_err(|e| CliError::Usage(e.to_string()))?;
    let source = Source::new(source, 1).map_err(CliError::Usage)?;
    let stop = CancellationToken::new();
    let started = Instant::now();
    let tasks = crate::sources::spawn_all(store.clone(), vec![source], stop.clone());
    let target = i64::from(args.messages);
    let outcome = tokio::time::timeout(Duration::from_secs(600), async {
        loop {
            let stats = store.queue_stats(Some(&name)).await?;
            if stats.count(JobState::Available) >= target {
                return Ok::<_, crate::store::StoreError>(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let took = started.elapsed();
    stop.cancel();
    for task in tasks {
        let _ = task.await;
    }
    match kind {
        SourceKind::Amqp => {
            if let Ok(c) =
                lapin::Connection::connect(&url, lapin::ConnectionProperties::default()).await
            {
                if let Ok(ch) = c.create_channel().await {
                    let _ = ch
                        .queue_delete(
                            name.as_str().into(),
                            lapin::options::QueueDeleteOptions::default(),
                        )
                        .await;
                }
                let _ = c.close(200, "done".into()).await;
            }
        }
        SourceKind::Nats => {
            if let Ok(client) = async_nats::connect(&url).await {
                let _ = async_nats::jetstream::new(client)
                    .delete_stream(&name)
                    .await;
            }
        }
    }
    let backend = store.backend();
    drop(store);
    scratch.drop_schema().await;
    match outcome {
        Err(_) => {
            return Err(CliError::Failed(
                "the source did not insert every message within 600 s".into(),
            ));
        }
        Ok(Err(e)) => return Err(CliError::Runtime(e.into())),
        Ok(Ok(())) => {}
    }
    let rate = f64::from(args.messages) / took.as_secs_f64();
    let report = serde_json::json!({
        "kind": args.kind,
        "messages": args.messages,
        "batch": args.batch,
        "prefetch": args.prefetch,
        "backend": backend.as_str(),
        "publish_seconds": publish_took.as_secs_f64(),
        "ingest_seconds": took.as_secs_f64(),
        "ingest_messages_per_second": rate.round(),
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "{} → jobs ({}): {} messages in {:.2} s = {:.0} msg/s (batch {}, prefetch {}; publishing took {:.2} s)",
            args.kind,
            backend,
            args.messages,
            took.as_secs_f64(),
            rate,
            args.batch,
            args.prefetch,
            publish_took.as_secs_f64()
        );
    }
    Ok(())
}

/// A message the broker refused to store is an error, not a publish.
fn confirmed(confirmation: lapin::Confirmation) -> Result<(), CliError> {
    if confirmation.is_ack() {
        Ok(())
    } else {
        Err(broker_error(format!(
            "the broker did not confirm a message ({confirmation:?})"
        )))
    }
}

async fn amqp_publish(url: &str, queue: &str, n: u32) -> Result<(), CliError> {
    let messages: Vec<(Vec<u8>, Option<String>)> = (0..n)
        .map(|i| {
            (
                format!("{{\"n\":{i}}}").into_bytes(),
                Some(format!("m-{i}")),
            )
        })
        .collect();
    amqp_send(url, queue, &messages).await
}

async fn amqp_send(
    url: &str,
    queue: &str,
    messages: &[(Vec<u8>, Option<String>)],
) -> Result<(), CliError> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .map_err(broker_error)?;
    let channel = connection.create_channel().await.map_err(broker_error)?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .map_err(broker_error)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker_error)?;
    let mut pending = Vec::with_capacity(1000);
    for (body, key) in messages {
        let mut properties = lapin::BasicProperties::default();
        if let Some(key) = key {
            properties = properties.with_message_id(key.as_str().into());
        }
        pending.push(
            channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    body,
                    properties,
                )
                .await
                .map_err(broker_error)?,
        );
        if pending.len() == 1000 {
            for confirm in pending.drain(..) {
                confirmed(confirm.await.map_err(broker_error)?)?;
            }
        }
    }
    for confirm in pending {
        confirmed(confirm.await.map_err(broker_error)?)?;
    }
    connection
        .close(200, "done".into())
        .await
        .map_err(broker_error)?;
    Ok(())
}

async fn nats_publish(url: &str, stream: &str, subject: &str, n: u32) -> Result<(), CliError> {
    let messages: Vec<(Vec<u8>, Option<String>)> = (0..n)
        .map(|i| {
            (
                format!("{{\"n\":{i}}}").into_bytes(),
                Some(format!("m-{i}")),
            )
        })
        .collect();
    nats_send(
        url,
        stream,
        subject,
        &messages,
        crate::sources::nats::MSG_ID_HEADER,
    )
    .await
}

async fn nats_send(
    url: &str,
    stream: &str,
    subject: &str,
    messages: &[(Vec<u8>, Option<String>)],
    header: &str,
) -> Result<(), CliError> {
    let client = async_nats::connect(url).await.map_err(broker_error)?;
    let js = async_nats::jetstream::new(client);
    js.get_or_create_stream(async_nats::jetstream::stream::Config {
        name: stream.to_string(),
        subjects: vec![subject.to_string()],
        ..Default::default()
    })
    .await
    .map_err(broker_error)?;
    let mut pending = Vec::with_capacity(1000);
    for (body, key) in messages {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(key) = key {
            headers.insert(header, key.as_str());
        }
        pending.push(
            js.publish_with_headers(subject.to_string(), headers, body.clone().into())
                .await
                .map_err(broker_error)?,
        );
        if pending.len() == 1000 {
            for ack in pending.drain(..) {
                ack.await.map_err(broker_error)?;
            }
        }
    }
    for ack in pending {
        ack.await.map_err(broker_error)?;
    }
    Ok(())
}
