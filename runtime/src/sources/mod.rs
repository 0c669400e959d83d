//! Sources: brokers whose messages become jobs, at least once in, exactly
//! once as jobs.
//!
//! Each message becomes a job keyed by its message identity (the unique
//! plugin + key rule dedupes it at insert), inserted **before** the message
//! is acknowledged; the ack is sent only after the insert committed. A crash
//! between the two redelivers the message, and the insert returns the same
//! job. A message without a usable key is kept as a dead job (its payload
//! with it) and then acknowledged: never silently dropped.
//!
//! # Layout
//! - this module: `[[sources]]` configuration, key rules, the batch insert
//!   shared by every broker, and running the sources.
//! - [`amqp`]: RabbitMQ (lapin): prefetch, multiple-ack after the commit.
//! - [`nats`]: NATS JetStream (async-nats): a durable pull consumer, per-message acks.

pub mod amqp;
pub mod nats;

use crate::failpoint::{self, Failpoint};
use crate::failure::Code;
use crate::store::{ErrorRecord, NewJob, Store, StoreError};
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Which broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceKind {
    /// RabbitMQ (AMQP 0.9.1).
    Amqp,
    /// NATS JetStream.
    Nats,
}

/// One `[[sources]]` table of `idem.toml`.
///
/// ```
/// let c: idem::sources::SourceConfig = toml::from_str(r#"
///     kind = "amqp"
///     url = "amqp://guest:guest@127.0.0.1:5672/%2f"
///     queue = "invoices"
///     plugin = "send_invoice_email"
///     key = "message_id"
/// "#).unwrap();
/// assert_eq!(c.name(), "amqp:invoices");
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// `amqp` or `nats`.
    pub kind: SourceKind,
    /// Name in metrics and logs (default `KIND:QUEUE` or `KIND:STREAM`).
    #[serde(default)]
    pub name: Option<String>,
    /// Broker URL.
    pub url: String,
    /// AMQP: the queue to consume (it must exist).
    #[serde(default)]
    pub queue: Option<String>,
    /// NATS: the stream (it must exist).
    #[serde(default)]
    pub stream: Option<String>,
    /// NATS: the durable pull consumer (created when missing; default `idem`).
    #[serde(default)]
    pub consumer: Option<String>,
    /// NATS: only subjects matching this filter (when the consumer is created).
    #[serde(default)]
    pub subject: Option<String>,
    /// NATS: how long a fetched, unacknowledged message waits before the
    /// server redelivers it (when the consumer is created; default 30 s).
    #[serde(default = "default_ack_wait", with = "humantime_serde")]
    pub ack_wait: Duration,
    /// Plugin of the jobs.
    pub plugin: String,
    /// Where a message's key is read: `message_id` (AMQP message-id, NATS
    /// `Nats-Msg-Id`), `header:NAME`, or `json:/pointer` into the body.
    pub key: String,
    /// Put before every key (e.g. `billing:`): two sources feeding one
    /// plugin whose message ids may coincide keep apart.
    #[serde(default)]
    pub key_prefix: Option<String>,
    /// Where a message's group (concurrency key) is read, as `key`:
    /// `header:NAME` or `json:/pointer`; jobs of one group run one at a
    /// time, in the order their messages arrived. A message without one is
    /// kept dead on arrival (`message_group_missing`): running it outside
    /// its group would break the promise.
    #[serde(default)]
    pub group: Option<String>,
    /// The idem queue of the jobs (default `default`).
    #[serde(default)]
    pub job_queue: Option<String>,
    /// Attempts of each job (default: the worker's `max_attempts`).
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Messages held unacknowledged at most (flow control: a slow store
    /// never pulls the broker's backlog into memory).
    #[serde(default = "default_prefetch")]
    pub prefetch: u16,
    /// Most messages per insert transaction.
    #[serde(default = "default_batch")]
    pub batch: usize,
    /// How long a batch waits for more messages after its first.
    #[serde(default = "default_batch_wait", with = "humantime_serde")]
    pub batch_wait: Duration,
}

fn default_ack_wait() -> Duration {
    Duration::from_secs(30)
}

fn default_prefetch() -> u16 {
    1000
}

fn default_batch() -> usize {
    500
}

fn default_batch_wait() -> Duration {
    Duration::from_millis(20)
}

impl SourceConfig {
    /// The source's name.
    pub fn name(&self) -> String {
        self.name.clone().unwrap_or_else(|| match self.kind {
            SourceKind::Amqp => format!("amqp:{}", self.queue.as_deref().unwrap_or("")),
            SourceKind::Nats => format!("nats:{}", self.stream.as_deref().unwrap_or("")),
        })
    }

    /// The group rule, if the table sets one.
    pub fn group_rule(&self) -> Result<Option<KeyRule>, String> {
        self.group
            .as_deref()
            .map(|text| {
                KeyRule::parse(text).map_err(|e| format!("source {:?}: group: {e}", self.name()))
            })
            .transpose()
    }

    /// Checks the table before anything connects.
    pub fn check(&self) -> Result<KeyRule, String> {
        let name = self.name();
        let missing = |what: &str| format!("source {name:?}: {what} is required");
        match self.kind {
            SourceKind::Amqp if self.queue.as_deref().is_none_or(str::is_empty) => {
                return Err(missing("`queue`"));
            }
            SourceKind::Nats if self.stream.as_deref().is_none_or(str::is_empty) => {
                return Err(missing("`stream`"));
            }
            _ => {}
        }
        if self.plugin.is_empty() {
            return Err(missing("`plugin`"));
        }
        let job_queue = self.job_queue.as_deref().unwrap_or("default");
        // The store's name rule, checked here: a name it refuses would fail
        // every batch of the source, and the broker would redeliver it for ever.
        for (field, value) in [("plugin", self.plugin.as_str()), ("job_queue", job_queue)] {
            crate::boundary::name(value)
                .map_err(|refused| format!("source {name:?}: `{field}`: {refused}"))?;
        }
        if self.batch == 0 || self.prefetch == 0 || self.batch > usize::from(self.prefetch) {
            return Err(format!(
                "source {name:?}: batch ({}) must be between 1 and prefetch ({})",
                self.batch, self.prefetch
            ));
        }
        self.group_rule()?;
        KeyRule::parse(&self.key).map_err(|e| format!("source {name:?}: key: {e}"))
    }
}

/// Where a message's key is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyRule {
    /// The broker's message id (AMQP `message-id`, NATS `Nats-Msg-Id`).
    MessageId,
    /// A header.
    Header(String),
    /// A JSON pointer into the body (a string or a number).
    Json(String),
}

impl KeyRule {
    /// Parses `message_id`, `header:NAME` or `json:/pointer`.
    ///
    /// ```
    /// use idem::sources::KeyRule;
    /// assert_eq!(KeyRule::parse("json:/order/id").unwrap(), KeyRule::Json("/order/id".into()));
    /// assert!(KeyRule::parse("body").is_err());
    /// ```
    pub fn parse(text: &str) -> Result<Self, String> {
        if text == "message_id" {
            return Ok(KeyRule::MessageId);
        }
        if let Some(name) = text.strip_prefix("header:")
            && !name.is_empty()
        {
            return Ok(KeyRule::Header(name.to_string()));
        }
        if let Some(pointer) = text.strip_prefix("json:")
            && (pointer.is_empty() || pointer.starts_with('/'))
        {
            return Ok(KeyRule::Json(pointer.to_string()));
        }
        Err(format!(
            "{text:?}: use message_id, header:NAME or json:/pointer"
        ))
    }

    /// The group of a message, or the code and reason it has none usable
    /// (a group follows the key's rule).
    pub fn group_of(&self, message: &Incoming) -> Result<String, (Code, String)> {
        let Some(group) = self.found(message).filter(|g| !g.is_empty()) else {
            return Err((
                Code::MessageGroupMissing,
                format!("the message has no group under the rule {self}"),
            ));
        };
        crate::boundary::group_key(&group).map_err(|refused| {
            (
                Code::MessageGroupInvalid,
                format!("the message's group is not usable: {refused}"),
            )
        })?;
        Ok(group)
    }

    /// The key of a message, or the code and reason it has none usable.
    pub fn key_of(&self, message: &Incoming) -> Result<String, (Code, String)> {
        let Some(key) = self.found(message).filter(|k| !k.is_empty()) else {
            return Err((
                Code::MessageKeyMissing,
                format!("the message has no key under the rule {self}"),
            ));
        };
        if key.contains('/') {
            return Err((
                Code::MessageKeyInvalid,
                format!(
                    "the key {:?} contains '/', which the host keeps for the keys of child jobs",
                    crate::failure::truncate(key, 80)
                ),
            ));
        }
        idem_sdk::key::validate(&key).map_err(|why| {
            (
                Code::MessageKeyInvalid,
                format!(
                    "the key {:?} is not usable: {why}",
                    crate::failure::truncate(key.clone(), 80)
                ),
            )
        })?;
        Ok(key)
    }

    /// What the rule finds in a message, unchecked.
    fn found(&self, message: &Incoming) -> Option<String> {
        match self {
            KeyRule::MessageId => message.message_id.clone(),
            // The exact spelling first, so a message carrying two spellings
            // gets the same key in every process.
            KeyRule::Header(name) => message
                .headers
                .iter()
                .find(|(h, _)| h == name)
                .or_else(|| {
                    message
                        .headers
                        .iter()
                        .find(|(h, _)| h.eq_ignore_ascii_case(name))
                })
                .map(|(_, v)| v.clone()),
            KeyRule::Json(pointer) => serde_json::from_slice::<serde_json::Value>(&message.payload)
                .ok()
                .and_then(|body| match body.pointer(pointer) {
                    Some(serde_json::Value::String(s)) => Some(s.clone()),
                    // Integers only: a float renders ambiguously (7 and 7.0).
                    Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => {
                        Some(n.to_string())
                    }
                    _ => None,
                }),
        }
    }
}

impl std::fmt::Display for KeyRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyRule::MessageId => f.write_str("message_id"),
            KeyRule::Header(name) => write!(f, "header:{name}"),
            KeyRule::Json(pointer) => write!(f, "json:{pointer}"),
        }
    }
}

/// A message as a source received it.
#[derive(Debug, Clone, Default)]
pub struct Incoming {
    /// The body.
    pub payload: Vec<u8>,
    /// The broker's message id, if any.
    pub message_id: Option<String>,
    /// Headers, as text.
    pub headers: Vec<(String, String)>,
}

/// What one batch came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ingested {
    /// New jobs.
    pub inserted: usize,
    /// Messages whose key already had a job (redeliveries, duplicate publishes).
    pub duplicates: usize,
    /// Messages kept as dead jobs (no usable key, too large).
    pub dead_on_arrival: usize,
}

/// A running source's fixed settings.
#[derive(Debug, Clone)]
pub struct Source {
    /// The configuration.
    pub config: SourceConfig,
    /// Its key rule.
    pub rule: KeyRule,
    /// Its group rule, if its jobs are grouped.
    pub group_rule: Option<KeyRule>,
    /// Its name.
    pub name: String,
    /// Attempts of its jobs.
    pub max_attempts: u32,
}

impl Source {
    /// A source from its table (checked).
    pub fn new(config: SourceConfig, default_attempts: u32) -> Result<Self, String> {
        let rule = config.check()?;
        Ok(Source {
            name: config.name(),
            max_attempts: config.max_attempts.unwrap_or(default_attempts),
            rule,
            group_rule: config.group_rule()?,
            config,
        })
    }

    fn job(&self, payload: Vec<u8>, key: Option<String>) -> NewJob {
        NewJob {
            queue: self
                .config
                .job_queue
                .clone()
                .unwrap_or_else(|| "default".into()),
            plugin: self.config.plugin.clone(),
            correlation_id: key.clone(),
            idempotency_key: key,
            payload,
            priority: 0,
            delay: Duration::ZERO,
            max_attempts: self.max_attempts.max(1),
            group: None,
        }
    }
}

/// Inserts a batch of messages as jobs in one transaction (dead-on-arrival
/// ones each in their own), and answers once every write committed: only
/// then may the messages be acknowledged.
pub async fn ingest(
    store: &dyn Store,
    source: &Source,
    batch: &[Incoming],
) -> Result<Ingested, StoreError> {
    let mut jobs = Vec::with_capacity(batch.len());
    let mut dead = Vec::new();
    for message in batch {
        let key = source
            .rule
            .key_of(message)
            .map(|key| match &source.config.key_prefix {
                Some(prefix) => format!("{prefix}{key}"),
                None => key,
            })
            .and_then(checked_key);
        // A grouped source's message must name its group.
        let key_and_group = key.and_then(|key| match &source.group_rule {
            Some(rule) => rule.group_of(message).map(|group| (key, Some(group))),
            None => Ok((key, None)),
        });
        match key_and_group {
            Ok((key, group)) => {
                let job = NewJob {
                    group: group.clone(),
                    ..source.job(message.payload.clone(), Some(key.clone()))
                };
                if message.payload.len() > crate::store::MAX_PAYLOAD_BYTES {
                    dead.push((
                        oversized(
                            &NewJob {
                                correlation_id: Some(key.clone()),
                                idempotency_key: Some(dead_key(source, message)),
                                group,
                                ..source.job(Vec::new(), None)
                            },
                            &message.payload,
                        ),
                        Code::MessageTooLarge,
                        format!(
                            "the message is {} bytes, over the payload limit; its payload is not kept",
                            message.payload.len()
                        ),
                    ));
                } else {
                    jobs.push(job);
                }
            }
            Err((code, why)) => {
                // Kept with its group when it has a usable one: replayed, it
                // must still wait its turn in the group.
                let group = source
                    .group_rule
                    .as_ref()
                    .and_then(|rule| rule.group_of(message).ok());
                let kept = NewJob {
                    idempotency_key: Some(dead_key(source, message)),
                    group,
                    ..source.job(Vec::new(), None)
                };
                let job = if message.payload.len() > crate::store::MAX_PAYLOAD_BYTES {
                    oversized(&kept, &message.payload)
                } else {
                    NewJob {
                        payload: message.payload.clone(),
                        ..kept
                    }
                };
                dead.push((job, code, why));
            }
        }
    }
    let mut report = Ingested::default();
    if !jobs.is_empty() {
        for enqueued in store.job_insert_many(jobs).await? {
            if enqueued.inserted {
                report.inserted += 1;
            } else {
                report.duplicates += 1;
            }
        }
    }
    for (job, code, why) in dead {
        tracing::warn!(source = %source.name, code = code.as_str(), "message kept as a dead job: {why}");
        store
            .job_insert_dead(
                job,
                ErrorRecord {
                    attempt: 0,
                    class: code.class(),
                    code: code.as_str().into(),
                    message: why,
                    at_ms: 0,
                },
            )
            .await?;
        report.dead_on_arrival += 1;
    }
    crate::metrics::source_messages(&source.name, "inserted", report.inserted);
    crate::metrics::source_messages(&source.name, "duplicate", report.duplicates);
    crate::metrics::source_messages(&source.name, "dead_on_arrival", report.dead_on_arrival);
    failpoint::hit(Failpoint::AfterInsertBeforeAck).await?;
    Ok(report)
}

/// The job key a message gets, as stored (its prefix included), checked by
/// the boundary's key rule: a key that passed the rule before its prefix
/// was added can be too long after, and a job the store refuses would fail
/// its whole batch, and the broker would deliver the batch again, for ever.
fn checked_key(key: String) -> Result<String, (Code, String)> {
    match crate::boundary::idempotency_key(&key) {
        Ok(()) => Ok(key),
        Err(refused) => Err((
            Code::MessageKeyInvalid,
            format!(
                "the job key (the source's key_prefix and the message's key) {} {}",
                refused.shown, refused.why
            ),
        )),
    }
}

/// The identity of a message kept dead on arrival: a redelivery of it
/// (after a crash before the ack) finds the same dead job.
fn dead_key(source: &Source, message: &Incoming) -> String {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    hash.update(source.name.as_bytes());
    hash.update([0]);
    hash.update(message.message_id.as_deref().unwrap_or("").as_bytes());
    hash.update([0]);
    hash.update(&message.payload);
    format!("dead-on-arrival:{}", hex::encode(&hash.finalize()[..16]))
}

/// A too-large payload is replaced by its size and digest.
fn oversized(job: &NewJob, payload: &[u8]) -> NewJob {
    use sha2::Digest;
    NewJob {
        payload: serde_json::json!({
            "dropped_bytes": payload.len(),
            "sha256": hex::encode(sha2::Sha256::digest(payload)),
        })
        .to_string()
        .into_bytes(),
        ..job.clone()
    }
}

/// Reconnect delays: 100 ms doubling to 30 s, reset once a session ran.
#[derive(Debug, Clone)]
pub struct Backoff(Duration);

impl Default for Backoff {
    fn default() -> Self {
        Backoff(Duration::from_millis(100))
    }
}

impl Backoff {
    /// The next delay (with up to 20% jitter).
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.0;
        self.0 = (self.0 * 2).min(Duration::from_secs(30));
        delay + delay.mul_f64(rand::random_range(0.0..0.2))
    }

    /// Back to the shortest delay.
    pub fn reset(&mut self) {
        *self = Backoff::default();
    }
}

/// Inserts a batch, retrying a store failure in place (with backoff) while
/// the messages stay unacknowledged at the broker: a database outage holds
/// the source back instead of cycling its broker session. `None` when
/// stopped first (the messages are then redelivered to the next session).
pub async fn ingest_until_stored(
    store: &dyn Store,
    source: &Source,
    batch: &[Incoming],
    stop: &CancellationToken,
) -> Option<Ingested> {
    let mut backoff = Backoff::default();
    loop {
        match ingest(store, source, batch).await {
            Ok(report) => return Some(report),
            Err(error) => {
                let wait = backoff.next_delay();
                tracing::warn!(source = %source.name, %error, ?wait, "cannot store the batch; its messages wait unacknowledged");
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

/// After a broker session ended with `error`: counts the reconnect and
/// waits out the backoff; `false` when `stop` fired meanwhile.
pub(crate) async fn wait_to_reconnect(
    source: &Source,
    error: &(dyn std::fmt::Display + Sync),
    backoff: &mut Backoff,
    stop: &CancellationToken,
) -> bool {
    crate::metrics::source_reconnect(&source.name);
    let wait = backoff.next_delay();
    tracing::warn!(source = %source.name, %error, ?wait, "source session ended; reconnecting");
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(wait) => true,
    }
}

/// Starts every configured source; each reconnects on its own until `stop`.
pub fn spawn_all(
    store: Arc<dyn Store>,
    sources: Vec<Source>,
    stop: CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    sources
        .into_iter()
        .map(|source| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                match source.config.kind {
                    SourceKind::Amqp => amqp::run(store, source, stop).await,
                    SourceKind::Nats => nats::run(store, source, stop).await,
                }
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: &str, id: Option<&str>, headers: &[(&str, &str)]) -> Incoming {
        Incoming {
            payload: payload.as_bytes().to_vec(),
            message_id: id.map(String::from),
            headers: headers
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        }
    }

    #[tokio::test]
    async fn a_grouped_source_gives_each_job_its_group_and_keeps_one_without_dead() {
        use crate::store::{JobFilter, JobState};
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("s.db").display());
        let store = crate::store::sqlite::connect(&url, crate::store::Clock::Adjustable)
            .await
            .expect("store");
        let config: SourceConfig = toml::from_str(
            "kind = \"amqp\"\nurl = \"amqp://127.0.0.1\"\nqueue = \"orders\"\n\
             plugin = \"order_sync\"\nkey = \"message_id\"\ngroup = \"json:/order_id\"\n",
        )
        .expect("config");
        let source = Source::new(config, 5).expect("source");
        let batch = [
            message(r#"{"order_id": 7}"#, Some("m-1"), &[]),
            message(r#"{"order_id": "bad\u0000id"}"#, Some("m-2"), &[]),
            message(r#"{"other": 1}"#, Some("m-3"), &[]),
        ];
        let report = ingest(&store, &source, &batch).await.expect("ingest");
        assert_eq!(
            report,
            Ingested {
                inserted: 1,
                duplicates: 0,
                dead_on_arrival: 2
            }
        );
        let jobs = store
            .job_list(JobFilter {
                states: vec![],
                plugin: None,
                error_code: None,
                ids: vec![],
                queue: None,
                before: None,
                limit: 0,
            })
            .await
            .expect("list");
        let of = |key: &str| {
            jobs.iter()
                .find(|j| j.correlation_id == key)
                .unwrap_or_else(|| panic!("a job for {key}"))
        };
        assert_eq!(of("m-1").group.as_deref(), Some("7"));
        assert_eq!(of("m-1").state, JobState::Available);
        for code in ["message_group_invalid", "message_group_missing"] {
            let dead: Vec<_> = jobs
                .iter()
                .filter(|j| j.last_error_code.as_deref() == Some(code))
                .collect();
            assert_eq!(dead.len(), 1, "{code}");
            assert_eq!(dead[0].state, JobState::Dead, "{code}");
        }
        // A group rule that cannot parse stops the source at start.
        let bad: SourceConfig = toml::from_str(
            "kind = \"amqp\"\nurl = \"amqp://127.0.0.1\"\nqueue = \"orders\"\n\
             plugin = \"order_sync\"\nkey = \"message_id\"\ngroup = \"body\"\n",
        )
        .expect("config");
        assert!(Source::new(bad, 5).unwrap_err().contains("group"));
    }

    #[test]
    fn keys_come_from_the_rule() {
        let m = message(r#"{"order": {"id": 7}}"#, Some("m-1"), &[("X-Key", "h-1")]);
        assert_eq!(KeyRule::MessageId.key_of(&m).unwrap(), "m-1");
        assert_eq!(
            KeyRule::parse("header:x-key").unwrap().key_of(&m).unwrap(),
            "h-1"
        );
        assert_eq!(
            KeyRule::parse("json:/order/id")
                .unwrap()
                .key_of(&m)
                .unwrap(),
            "7"
        );
        let none = message("not json", None, &[]);
        assert_eq!(
            KeyRule::MessageId.key_of(&none).unwrap_err().0,
            Code::MessageKeyMissing
        );
        assert_eq!(
            KeyRule::parse("json:/id")
                .unwrap()
                .key_of(&none)
                .unwrap_err()
                .0,
            Code::MessageKeyMissing
        );
        let bad = message("{}", Some("line\nbreak"), &[]);
        assert_eq!(
            KeyRule::MessageId.key_of(&bad).unwrap_err().0,
            Code::MessageKeyInvalid
        );
        let slash = message("{}", Some("order_sync/invoice:7"), &[]);
        assert_eq!(
            KeyRule::MessageId.key_of(&slash).unwrap_err().0,
            Code::MessageKeyInvalid,
            "PLUGIN/KEY is the host's form for child jobs"
        );
        let float = message(r#"{"id": 7.0}"#, None, &[]);
        assert_eq!(
            KeyRule::parse("json:/id")
                .unwrap()
                .key_of(&float)
                .unwrap_err()
                .0,
            Code::MessageKeyMissing
        );
        let both = message("{}", None, &[("order-id", "lower"), ("Order-Id", "exact")]);
        assert_eq!(
            KeyRule::parse("header:Order-Id")
                .unwrap()
                .key_of(&both)
                .unwrap(),
            "exact"
        );
        assert!(KeyRule::parse("header:").is_err());
        assert!(KeyRule::parse("json:id").is_err());
    }

    #[test]
    fn tables_that_cannot_work_are_refused() {
        let parse = |extra: &str| -> SourceConfig {
            toml::from_str(&format!(
                "kind = \"amqp\"\nurl = \"amqp://x\"\nplugin = \"p\"\nkey = \"message_id\"\n{extra}"
            ))
            .unwrap()
        };
        assert!(parse("").check().unwrap_err().contains("queue"));
        assert!(
            parse("queue = \"q\"\nbatch = 5000\nprefetch = 10")
                .check()
                .is_err()
        );
        assert!(parse("queue = \"q\"").check().is_ok());
        // Names the store refuses are refused here, before any message is
        // consumed (each batch would fail, and be redelivered, for ever).
        let slash = parse("queue = \"q\"\njob_queue = \"orders/eu\"")
            .check()
            .unwrap_err();
        assert!(slash.contains("job_queue"), "{slash}");
        let plugin = toml::from_str::<SourceConfig>(
            "kind = \"amqp\"\nurl = \"amqp://x\"\nplugin = \"p\\u0000\"\nkey = \"message_id\"\nqueue = \"q\"",
        )
        .unwrap()
        .check()
        .unwrap_err();
        assert!(
            plugin.contains("plugin") && !plugin.contains('\0'),
            "{plugin}"
        );
        assert!(
            toml::from_str::<SourceConfig>(
                "kind = \"kafka\"\nurl = \"x\"\nplugin = \"p\"\nkey = \"k\""
            )
            .is_err()
        );
    }
}
