//! idem's host runtime: claims jobs from a durable store, runs each in a fresh
//! sandboxed WebAssembly component and carries out the effects it returns,
//! each once, under its idempotency key.
//!
//! # Layout
//! - [`boundary`]: the one rule set for text from outside (refused or cleaned), with its test vectors.
//! - [`failpoint`]: failures injected on purpose (feature `failpoints`).
//! - [`failure`]: classified failures (retryable, permanent, ambiguous + code).
//! - [`effects`]: effects as the host sees them, and plan checks.
//! - [`sandbox`]: the wasmtime engine, plugin compilation and per-job instances.
//! - [`plugins`]: the plugins folder, manifests, grants (declared, narrowed) and hot reload.
//! - [`queue`]: the worker loop, outcomes, backoff, rescuer and pruner.
//! - [`metrics`]: metric names and the Prometheus exporter.
//! - [`store`]: the store contract with SQLite and PostgreSQL implementations.
//! - [`providers`]: where effects are carried out (http, email, sql), with retry-storm guards.
//! - [`ops`]: the operator surface: read model, replay and its preview, HTTP API, dashboard.
//! - [`schedule`]: `[[schedules]]`: cron ticks in a time zone, enqueued once each across nodes.
//! - [`sources`]: brokers (RabbitMQ, NATS JetStream) whose messages become jobs, exactly once.
//! - [`config`]: `idem.toml` and environment overrides.
//! - [`cli`]: the `idem` command line.
//!
//! The local provider server used by the demo and the tests is a dev tool in its
//! own crate, `idem-provider-server` (`runtime/provider-server/`); the `idem`
//! binary runs it as `idem provider-server` when the default `provider-server`
//! feature is on. This library never depends on it otherwise.
pub mod boundary;
pub mod cli;
pub mod config;
pub mod effects;
pub mod failpoint;
pub mod failure;
pub mod metrics;
pub mod ops;
pub mod plugins;
pub mod providers;
pub mod queue;
pub mod sandbox;
pub mod schedule;
pub mod sources;
pub mod store;
