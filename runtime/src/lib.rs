//! idem's host runtime: claims jobs from a durable store, runs each in a fresh
//! sandboxed WebAssembly component and carries out the effects it returns,
//! each once, under its idempotency key.
//!
//! # Layout
//! - [`failure`]: classified failures (retryable, permanent, ambiguous + code).
//! - [`effects`]: effects as the host sees them, and plan checks.
//! - [`sandbox`]: the wasmtime engine, plugin compilation and per-job instances.
//! - [`plugins`]: the plugins folder, manifests and hot reload.
//! - [`queue`]: the worker loop, outcomes, backoff, rescuer and pruner.
//! - [`metrics`]: metric names and the Prometheus exporter.
//! - [`store`]: the store contract with SQLite and PostgreSQL implementations.
//! - [`providers`]: where effects are carried out (http, email), with retry-storm guards.
//! - [`config`]: `idem.toml` and environment overrides.
//! - [`provider_server`]: a local idempotent provider for demos and tests.
//! - [`cli`]: the `idem` command line.
pub mod cli;
pub mod config;
pub mod effects;
pub mod failure;
pub mod metrics;
pub mod plugins;
pub mod provider_server;
pub mod providers;
pub mod queue;
pub mod sandbox;
pub mod store;
