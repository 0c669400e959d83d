//! In-memory provider state and the request decision logic (no I/O, no awaits).

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use axum::body::Bytes;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{
    ProviderServerConfig,
    fault::{Fault, FaultSource},
};

/// The key under which requests without an `Idempotency-Key` are counted.
pub const UNKEYED: &str = "";

/// The lookup endpoint: `GET /by-key/{key}`, the key percent-encoded.
pub(crate) const LOOKUP_PREFIX: &str = "/by-key/";

/// Expired idempotency records are swept every this many requests.
const SWEEP_EVERY: u64 = 4096;

/// One request as the provider saw it, in arrival order (`GET /_calls`).
///
/// `let calls = handle.calls().await; assert_eq!(calls[0].status, 200);`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecordedCall {
    /// Arrival number, starting at 1.
    pub seq: u64,
    /// HTTP method.
    pub method: String,
    /// Request path (without query).
    pub path: String,
    /// The `Idempotency-Key`, if any.
    pub key: Option<String>,
    /// The body: a JSON value when it parses as JSON, else the (lossy UTF-8) text;
    /// `null` when empty.
    pub body: Value,
    /// The status the server produced. For a [`Fault::Drop`] this response was never
    /// sent; 499 means the client went away while the request was being processed.
    pub status: u16,
    /// The injected fault, if any.
    pub fault: Option<Fault>,
    /// Where the fault came from.
    pub fault_source: Option<FaultSource>,
    /// Whether the stored response of an earlier request was returned.
    pub replayed: bool,
    /// The error code of a non-2xx answer (`idempotency_key_conflict`, ...).
    pub error_code: Option<String>,
    /// Arrival time.
    pub at: DateTime<Utc>,
}

/// How often one business effect (one idempotency key) really took place
/// (`GET /_effects`).
///
/// `assert_eq!(handle.effects().await[0].applied, 1);`
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AppliedEffect {
    /// The idempotency key; `""` aggregates all requests without a key.
    pub key: String,
    /// Times the effect was processed for real (replays and faults excluded).
    pub applied: u32,
    /// Requests that carried the key, whatever their outcome.
    pub requests: u32,
    /// Path of the first request with this key.
    pub path: String,
    /// Id returned by the latest application (`msg_...` or `req_...`).
    pub result_id: Option<String>,
}

/// How the response reaches the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    Now,
    Late(Duration),
    Drop,
}

#[derive(Debug, Clone)]
pub(crate) struct Reply {
    pub status: u16,
    pub body: Bytes,
    pub headers: Vec<(&'static str, String)>,
    pub delivery: Delivery,
}

/// The request fields the decision logic needs, taken from the HTTP layer.
pub(crate) struct IncomingRequest {
    pub method: String,
    pub path: String,
    pub key_header: Option<Vec<u8>>,
    pub fault_header: Option<Vec<u8>>,
    pub body: Bytes,
}

/// Either a finished reply, or a request that must wait `processing_delay` before it is
/// applied (the window in which a concurrent duplicate sees `request_in_progress`).
pub(crate) enum Begin {
    Reply(Reply),
    Process(InFlight),
}

#[derive(Debug, Clone)]
struct StoredResponse {
    status: u16,
    body: Bytes,
    fingerprint: String,
    method: String,
    path: String,
    stored_at: Instant,
}

#[derive(Debug, Clone)]
enum Slot {
    InProgress {
        fingerprint: String,
        method: String,
        path: String,
        token: u64,
    },
    Done(StoredResponse),
}

#[derive(Debug, Default)]
struct EffectStats {
    applied: u32,
    requests: u32,
    path: String,
    result_id: Option<String>,
}

#[derive(Debug, Default)]
struct Inner {
    seq: u64,
    generation: u64,
    slots: HashMap<String, Slot>,
    effects: BTreeMap<String, EffectStats>,
    calls: VecDeque<RecordedCall>,
    key_scripts: HashMap<String, VecDeque<Fault>>,
    path_scripts: HashMap<String, VecDeque<Fault>>,
    /// Lookups (`GET /by-key/{key}`) per key, whatever their answer.
    lookups: HashMap<String, u32>,
}

/// Everything a request needs to be finished after an await.
struct Ctx {
    seq: u64,
    at: DateTime<Utc>,
    method: String,
    path: String,
    key: Option<String>,
    body: Bytes,
    fingerprint: String,
    fault: Option<Fault>,
    fault_source: Option<FaultSource>,
}

pub(crate) struct Shared {
    pub config: ProviderServerConfig,
    inner: Mutex<Inner>,
    /// Lookups answer 404 even for applied keys (a provider whose lookup
    /// lies, for the documented-risk tests).
    lookup_lies: AtomicBool,
}

impl Shared {
    pub fn new(config: ProviderServerConfig) -> Arc<Self> {
        Arc::new(Self {
            lookup_lies: AtomicBool::new(config.lookup_lies),
            config,
            inner: Mutex::new(Inner::default()),
        })
    }

    pub fn lookups(&self, key: &str) -> u32 {
        self.lock().lookups.get(key).copied().unwrap_or(0)
    }

    pub fn lookups_total(&self) -> u64 {
        self.lock().lookups.values().map(|n| u64::from(*n)).sum()
    }

    pub fn set_lookup_lies(&self, lies: bool) {
        self.lookup_lies.store(lies, Ordering::Relaxed);
    }

    /// Answers a lookup (`GET /by-key/{key}`): the stored first 2xx
    /// response of the key, as it was sent, or 404 `not_found` (also while
    /// the key's request is still processing, and always when lookups lie).
    /// Never applies anything and never counts as a request with the key;
    /// it is recorded in the calls and in [`Shared::lookups`]. Faults come
    /// from the `X-Idem-Fault` header, then the script of the request's
    /// path as received (percent-encoded), then the random rates.
    pub fn look_up(&self, req: IncomingRequest) -> Reply {
        let config = &self.config;
        let mut inner = self.lock();
        inner.seq += 1;
        let mut ctx = Ctx {
            seq: inner.seq,
            at: Utc::now(),
            method: req.method,
            path: req.path,
            key: None,
            fingerprint: String::new(),
            body: Bytes::new(),
            fault: None,
            fault_source: None,
        };
        let encoded = ctx.path.strip_prefix(LOOKUP_PREFIX).unwrap_or_default();
        let key = match percent_decode(encoded) {
            Ok(key) if !key.is_empty() => key,
            Ok(_) => {
                let reply = error_reply(400, "invalid_lookup_key", "the key is empty", &[]);
                return inner.record(&ctx, reply, false);
            }
            Err(message) => {
                let reply = error_reply(400, "invalid_lookup_key", &message, &[]);
                return inner.record(&ctx, reply, false);
            }
        };
        *inner.lookups.entry(key.clone()).or_default() += 1;
        match parse_fault_header(req.fault_header.as_deref()) {
            Ok(Some(fault)) => {
                ctx.fault = Some(fault);
                ctx.fault_source = Some(FaultSource::Header);
            }
            Ok(None) => {
                if let Some(fault) = inner.pop_script(None, &ctx.path) {
                    ctx.fault = Some(fault);
                    ctx.fault_source = Some(FaultSource::Script);
                } else if let Some(fault) = config.faults.draw() {
                    ctx.fault = Some(fault);
                    ctx.fault_source = Some(FaultSource::Random);
                }
            }
            Err(message) => {
                let reply = error_reply(400, "invalid_fault_header", &message, &[]);
                return inner.record(&ctx, reply, false);
            }
        }
        if let Some(fault) = ctx.fault.filter(|f| f.rejects()) {
            let reply = fault_reply(fault, config);
            return inner.record(&ctx, reply, false);
        }
        let stored = match inner.slots.get(&key) {
            Some(Slot::Done(stored)) if stored.stored_at.elapsed() < config.key_ttl => Some(stored),
            _ => None,
        };
        let reply = match stored {
            Some(stored) if !self.lookup_lies.load(Ordering::Relaxed) => Reply {
                status: stored.status,
                body: stored.body.clone(),
                headers: vec![("idempotency-key", key)],
                delivery: Delivery::Now,
            },
            _ => error_reply(
                404,
                "not_found",
                "no request was applied under this key",
                &[],
            ),
        };
        let reply = with_delivery(reply, ctx.fault, config);
        inner.record(&ctx, reply, false)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().expect("provider state mutex poisoned")
    }

    pub fn calls(&self) -> Vec<RecordedCall> {
        let mut calls: Vec<RecordedCall> = self.lock().calls.iter().cloned().collect();
        // Calls are recorded when answered; delayed ones can finish out of order.
        calls.sort_by_key(|c| c.seq);
        calls
    }

    pub fn effects(&self) -> Vec<AppliedEffect> {
        self.lock()
            .effects
            .iter()
            .map(|(key, stats)| AppliedEffect {
                key: key.clone(),
                applied: stats.applied,
                requests: stats.requests,
                path: stats.path.clone(),
                result_id: stats.result_id.clone(),
            })
            .collect()
    }

    pub fn applied(&self, key: &str) -> u32 {
        self.lock().effects.get(key).map_or(0, |s| s.applied)
    }

    pub fn requests(&self, key: &str) -> u32 {
        self.lock().effects.get(key).map_or(0, |s| s.requests)
    }

    pub fn reset(&self) {
        let mut inner = self.lock();
        let generation = inner.generation + 1;
        *inner = Inner {
            generation,
            ..Inner::default()
        };
    }

    pub fn script_key(&self, key: &str, faults: Vec<Fault>) -> usize {
        let mut inner = self.lock();
        let queue = inner.key_scripts.entry(key.to_owned()).or_default();
        queue.extend(faults);
        queue.len()
    }

    pub fn script_path(&self, path: &str, faults: Vec<Fault>) -> usize {
        let mut inner = self.lock();
        let queue = inner.path_scripts.entry(path.to_owned()).or_default();
        queue.extend(faults);
        queue.len()
    }

    /// Decides what happens to a request: everything up to the point where the effect is
    /// applied happens under one lock, so two requests can never both apply one key.
    pub fn begin(self: &Arc<Self>, req: IncomingRequest) -> Begin {
        let config = &self.config;
        let mut inner = self.lock();
        inner.seq += 1;
        if inner.seq.is_multiple_of(SWEEP_EVERY) {
            let ttl = config.key_ttl;
            inner.slots.retain(|_, slot| match slot {
                Slot::Done(stored) => stored.stored_at.elapsed() < ttl,
                Slot::InProgress { .. } => true,
            });
        }
        let mut ctx = Ctx {
            seq: inner.seq,
            at: Utc::now(),
            method: req.method,
            path: req.path,
            key: None,
            fingerprint: fingerprint(&req.body),
            body: req.body,
            fault: None,
            fault_source: None,
        };

        let key = match parse_key(req.key_header.as_deref(), config.max_key_len) {
            Ok(key) => key,
            Err(message) => {
                let reply = error_reply(400, "invalid_idempotency_key", &message, &[]);
                return Begin::Reply(inner.record(&ctx, reply, false));
            }
        };
        ctx.key = key;
        let stats_key = ctx.key.clone().unwrap_or_else(|| UNKEYED.to_owned());
        let stats = inner.effects.entry(stats_key).or_default();
        stats.requests += 1;
        if stats.path.is_empty() {
            stats.path.clone_from(&ctx.path);
        }

        match parse_fault_header(req.fault_header.as_deref()) {
            Ok(Some(fault)) => {
                ctx.fault = Some(fault);
                ctx.fault_source = Some(FaultSource::Header);
            }
            Ok(None) => {
                if let Some(fault) = inner.pop_script(ctx.key.as_deref(), &ctx.path) {
                    ctx.fault = Some(fault);
                    ctx.fault_source = Some(FaultSource::Script);
                }
            }
            Err(message) => {
                let reply = error_reply(400, "invalid_fault_header", &message, &[]);
                return Begin::Reply(inner.record(&ctx, reply, false));
            }
        }

        // A rejecting fault stands for the provider's front door failing: it happens
        // before the idempotency layer, so it neither applies nor consumes the key.
        if let Some(fault) = ctx.fault.filter(|f| f.rejects()) {
            let reply = fault_reply(fault, config);
            return Begin::Reply(inner.record(&ctx, reply, false));
        }

        if config.dedupe
            && let Some(key) = ctx.key.as_deref()
            && let Some(reply) = inner.lookup(key, &ctx, config)
        {
            return Begin::Reply(reply);
        }

        if ctx.fault.is_none()
            && let Some(fault) = config.faults.draw()
        {
            ctx.fault = Some(fault);
            ctx.fault_source = Some(FaultSource::Random);
            if fault.rejects() {
                let reply = fault_reply(fault, config);
                return Begin::Reply(inner.record(&ctx, reply, false));
            }
        }

        if config.faults.rejects_body(&ctx.body) {
            ctx.fault = Some(Fault::BadRequest);
            ctx.fault_source = Some(FaultSource::RejectRule);
            let reply = error_reply(
                400,
                "bad_request",
                "the request body matches a reject rule",
                &[],
            );
            return Begin::Reply(inner.record(&ctx, reply, false));
        }

        if let Err(message) = validate(&ctx.method, &ctx.path, &ctx.body) {
            let reply = error_reply(422, "invalid_recipient", &message, &[]);
            let reply = with_delivery(reply, ctx.fault, config);
            return Begin::Reply(inner.record(&ctx, reply, false));
        }

        if config.processing_delay.is_zero() {
            return Begin::Reply(inner.apply(&ctx, config));
        }
        let token = ctx.seq;
        // Without dedupe nothing waits on a key in progress (a repeat is
        // processed on its own), and the first answer a lookup finds stays.
        if config.dedupe
            && let Some(key) = &ctx.key
        {
            inner.slots.insert(
                key.clone(),
                Slot::InProgress {
                    fingerprint: ctx.fingerprint.clone(),
                    method: ctx.method.clone(),
                    path: ctx.path.clone(),
                    token,
                },
            );
        }
        Begin::Process(InFlight {
            shared: Arc::clone(self),
            generation: inner.generation,
            token,
            ctx: Some(ctx),
        })
    }
}

impl Inner {
    fn pop_script(&mut self, key: Option<&str>, path: &str) -> Option<Fault> {
        if let Some(key) = key
            && let Some(fault) = self.key_scripts.get_mut(key).and_then(VecDeque::pop_front)
        {
            return Some(fault);
        }
        self.path_scripts
            .get_mut(path)
            .and_then(VecDeque::pop_front)
    }

    /// Returns the reply when the key already has a stored or in-progress request.
    fn lookup(&mut self, key: &str, ctx: &Ctx, config: &ProviderServerConfig) -> Option<Reply> {
        let slot = self.slots.get(key)?;
        let reply = match slot {
            Slot::Done(stored) if stored.stored_at.elapsed() >= config.key_ttl => {
                self.slots.remove(key);
                return None;
            }
            Slot::Done(stored) => {
                if let Some(reply) =
                    conflict(ctx, &stored.fingerprint, &stored.method, &stored.path)
                {
                    reply
                } else {
                    let reply = Reply {
                        status: stored.status,
                        body: stored.body.clone(),
                        headers: vec![
                            ("idempotency-key", key.to_owned()),
                            ("idempotent-replayed", "true".to_owned()),
                        ],
                        delivery: Delivery::Now,
                    };
                    let reply = with_delivery(reply, ctx.fault, config);
                    return Some(self.record(ctx, reply, true));
                }
            }
            Slot::InProgress {
                fingerprint,
                method,
                path,
                ..
            } => conflict(ctx, fingerprint, method, path).unwrap_or_else(|| {
                error_reply(
                    409,
                    "request_in_progress",
                    "a request with this idempotency key is still being processed",
                    &[("retry-after", "1".to_owned())],
                )
            }),
        };
        Some(self.record(ctx, reply, false))
    }

    fn apply(&mut self, ctx: &Ctx, config: &ProviderServerConfig) -> Reply {
        let random_hex = hex::encode(rand::random::<[u8; 12]>());
        let (id, body) = if is_email_api(&ctx.method, &ctx.path) {
            let id = format!("msg_{random_hex}");
            let body = json!({ "id": id });
            (id, body)
        } else {
            let id = format!("req_{random_hex}");
            let body = json!({ "id": id, "received": true });
            (id, body)
        };
        let body = Bytes::from(body.to_string());
        let stats_key = ctx.key.as_deref().unwrap_or(UNKEYED);
        let stats = self.effects.entry(stats_key.to_owned()).or_default();
        stats.applied += 1;
        stats.result_id = Some(id);
        let mut headers = Vec::new();
        // Without dedupe the first answer stays the one a lookup finds.
        let first = !matches!(
            ctx.key.as_ref().and_then(|key| self.slots.get(key)),
            Some(Slot::Done(_))
        );
        if let Some(key) = ctx.key.as_ref().filter(|_| config.dedupe || first) {
            self.slots.insert(
                key.clone(),
                Slot::Done(StoredResponse {
                    status: 200,
                    body: body.clone(),
                    fingerprint: ctx.fingerprint.clone(),
                    method: ctx.method.clone(),
                    path: ctx.path.clone(),
                    stored_at: Instant::now(),
                }),
            );
        }
        if let Some(key) = &ctx.key {
            headers.push(("idempotency-key", key.clone()));
        }
        let reply = Reply {
            status: 200,
            body,
            headers,
            delivery: Delivery::Now,
        };
        let reply = with_delivery(reply, ctx.fault, config);
        self.record(ctx, reply, false)
    }

    fn record(&mut self, ctx: &Ctx, reply: Reply, replayed: bool) -> Reply {
        let error_code = if (200..300).contains(&reply.status) {
            None
        } else {
            error_code(&reply.body)
        };
        self.push_call(RecordedCall {
            seq: ctx.seq,
            method: ctx.method.clone(),
            path: ctx.path.clone(),
            key: ctx.key.clone(),
            body: body_value(&ctx.body),
            status: reply.status,
            fault: ctx.fault,
            fault_source: ctx.fault_source,
            replayed,
            error_code,
            at: ctx.at,
        });
        reply
    }

    fn push_call(&mut self, call: RecordedCall) {
        self.calls.push_back(call);
        // Keeps a long benchmark run from growing memory without bound.
        while self.calls.len() > MAX_RECORDED_CALLS {
            self.calls.pop_front();
        }
    }
}

/// Only the newest calls are kept for `/_calls`.
pub(crate) const MAX_RECORDED_CALLS: usize = 200_000;

/// A request that passed every check and waits `processing_delay` before being applied.
/// Dropping it unfinished (the client went away) frees its key again.
pub(crate) struct InFlight {
    shared: Arc<Shared>,
    generation: u64,
    token: u64,
    ctx: Option<Ctx>,
}

impl InFlight {
    pub fn finish(mut self) -> Reply {
        let shared = Arc::clone(&self.shared);
        let Some(ctx) = self.ctx.take() else {
            return error_reply(500, "internal", "request finished twice", &[]);
        };
        let mut inner = shared.lock();
        if inner.generation != self.generation {
            // State was reset meanwhile: answer, but leave no trace in the new state.
            return error_reply(503, "reset", "provider state was reset", &[]);
        }
        inner.apply(&ctx, &shared.config)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(ctx) = self.ctx.take() else { return };
        let mut inner = self.shared.lock();
        if inner.generation != self.generation {
            return;
        }
        if let Some(key) = &ctx.key
            && matches!(inner.slots.get(key), Some(Slot::InProgress { token, .. }) if *token == self.token)
        {
            inner.slots.remove(key);
        }
        let reply = error_reply(499, "client_closed_request", "client went away", &[]);
        inner.record(&ctx, reply, false);
    }
}

fn conflict(ctx: &Ctx, fingerprint: &str, method: &str, path: &str) -> Option<Reply> {
    if ctx.fingerprint == fingerprint && ctx.method == method && ctx.path == path {
        return None;
    }
    Some(error_reply(
        409,
        "idempotency_key_conflict",
        "this idempotency key was already used with a different request",
        &[],
    ))
}

fn with_delivery(mut reply: Reply, fault: Option<Fault>, config: &ProviderServerConfig) -> Reply {
    reply.delivery = match fault {
        Some(Fault::Late) => Delivery::Late(config.late_by),
        Some(Fault::Drop) => Delivery::Drop,
        _ => Delivery::Now,
    };
    reply
}

fn fault_reply(fault: Fault, config: &ProviderServerConfig) -> Reply {
    match fault {
        Fault::TooManyRequests => {
            let retry_after = config.faults.retry_after;
            let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
            error_reply(
                429,
                "rate_limit_exceeded",
                "too many requests",
                &[("retry-after", secs.to_string())],
            )
        }
        Fault::ServerError => error_reply(500, "internal_server_error", "injected fault", &[]),
        Fault::BadRequest | Fault::Late | Fault::Drop => {
            error_reply(400, "bad_request", "injected fault", &[])
        }
    }
}

pub(crate) fn error_reply(
    status: u16,
    code: &str,
    message: &str,
    headers: &[(&'static str, String)],
) -> Reply {
    let body = json!({ "error": { "code": code, "message": message } });
    Reply {
        status,
        body: Bytes::from(body.to_string()),
        headers: headers.to_vec(),
        delivery: Delivery::Now,
    }
}

fn error_code(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    value
        .pointer("/error/code")
        .and_then(Value::as_str)
        .map(str::to_owned)
}

fn is_email_api(method: &str, path: &str) -> bool {
    method.eq_ignore_ascii_case("POST") && path.trim_end_matches('/') == "/emails"
}

fn parse_key(header: Option<&[u8]>, max_len: usize) -> Result<Option<String>, String> {
    let Some(raw) = header else { return Ok(None) };
    let key = std::str::from_utf8(raw).map_err(|_| "idempotency key is not UTF-8".to_owned())?;
    if key.is_empty() {
        return Err("idempotency key is empty".to_owned());
    }
    if key.len() > max_len {
        return Err(format!("idempotency key is longer than {max_len} bytes"));
    }
    if key.chars().any(char::is_control) {
        return Err("idempotency key contains control characters".to_owned());
    }
    Ok(Some(key.to_owned()))
}

/// `%XX` escapes decoded (both hex digits required; `+` stays `+`); the
/// result must be UTF-8.
fn percent_decode(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent escape at byte {i} of the key"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "the key is not UTF-8".to_owned())
}

fn parse_fault_header(header: Option<&[u8]>) -> Result<Option<Fault>, String> {
    let Some(raw) = header else { return Ok(None) };
    let name = String::from_utf8_lossy(raw);
    name.parse::<Fault>().map(Some).map_err(|e| e.to_string())
}

/// Minimal Resend-like check: the email API needs at least one recipient and every
/// recipient must look like an address.
fn validate(method: &str, path: &str, body: &[u8]) -> Result<(), String> {
    if !is_email_api(method, path) {
        return Ok(());
    }
    let value: Value =
        serde_json::from_slice(body).map_err(|_| "the body is not a JSON object".to_owned())?;
    let recipients: Vec<&Value> = match value.get("to") {
        Some(to @ Value::String(_)) => vec![to],
        Some(Value::Array(items)) => items.iter().collect(),
        _ => return Err("`to` is missing".to_owned()),
    };
    if recipients.is_empty() {
        return Err("`to` is empty".to_owned());
    }
    for recipient in recipients {
        let valid = recipient.as_str().is_some_and(|address| {
            address
                .split_once('@')
                .is_some_and(|(local, domain)| !local.trim().is_empty() && !domain.is_empty())
        });
        if !valid {
            return Err(format!("invalid recipient {recipient}"));
        }
    }
    Ok(())
}

/// JSON bodies are fingerprinted in canonical form (sorted keys, no whitespace), so a
/// retry that re-serialises the same payload in another key order is not a conflict.
fn fingerprint(body: &[u8]) -> String {
    let mut hasher = Sha256::new();
    match serde_json::from_slice::<Value>(body) {
        Ok(value) => {
            let mut canonical = String::new();
            write_canonical(&value, &mut canonical);
            hasher.update(b"json:");
            hasher.update(canonical.as_bytes());
        }
        Err(_) => {
            hasher.update(b"raw:");
            hasher.update(body);
        }
    }
    hex::encode(hasher.finalize())
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(item, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

fn body_value(body: &[u8]) -> Value {
    if body.is_empty() {
        return Value::Null;
    }
    serde_json::from_slice(body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_ignores_json_key_order_and_whitespace() {
        assert_eq!(
            fingerprint(br#"{"a":1,"b":[1,{"y":2,"x":1}]}"#),
            fingerprint(br#"{ "b": [1, {"x":1, "y":2}], "a": 1 }"#)
        );
        assert_ne!(fingerprint(br#"{"a":1}"#), fingerprint(br#"{"a":2}"#));
        assert_ne!(fingerprint(b"plain"), fingerprint(b"plain "));
    }

    #[test]
    fn email_validation() {
        let ok = br#"{"to":["a@example.com"],"subject":"hi"}"#;
        assert!(validate("POST", "/emails", ok).is_ok());
        assert!(validate("POST", "/emails", br#"{"to":"a@example.com"}"#).is_ok());
        assert!(validate("POST", "/emails", br#"{"to":[]}"#).is_err());
        assert!(validate("POST", "/emails", br#"{"subject":"x"}"#).is_err());
        assert!(validate("POST", "/emails", br#"{"to":["nobody"]}"#).is_err());
        assert!(validate("POST", "/emails", b"not json").is_err());
        assert!(validate("POST", "/hooks", br#"{"to":[]}"#).is_ok());
    }

    #[test]
    fn lookup_keys_are_percent_decoded() {
        assert_eq!(percent_decode("p%2Fk%20a+b").as_deref(), Ok("p/k a+b"));
        assert_eq!(percent_decode("%C3%A9").as_deref(), Ok("é"));
        assert!(percent_decode("%2").is_err());
        assert!(percent_decode("%+F").is_err());
        assert!(percent_decode("%FF").is_err(), "not UTF-8");
    }

    #[test]
    fn key_validation() {
        assert_eq!(parse_key(None, 8), Ok(None));
        assert_eq!(parse_key(Some(b"k1"), 8), Ok(Some("k1".to_owned())));
        assert!(parse_key(Some(b""), 8).is_err());
        assert!(parse_key(Some(b"123456789"), 8).is_err());
    }
}
