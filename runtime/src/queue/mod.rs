//! The queue side of the runtime: the worker loop, job state decisions,
//! backoff, and the background services (rescuer, pruner, queue gauges).
//!
//! # Layout
//! - [`backoff`]: full-jitter delays.
//! - [`worker`]: claim → run the plugin (or reuse the stored plan) → execute
//!   effects → record the outcome; heartbeats; graceful shutdown.
//! - [`outcome`]: the one place where a job attempt's result becomes a state
//!   transition (succeeded, retrying, dead, deferred).
//! - [`maintenance`]: rescuer of expired leases, retention pruner, gauges.
//! - [`stats`]: in-process counters and the run summary.

pub mod backoff;
pub mod maintenance;
pub mod outcome;
pub mod stats;
pub mod worker;

pub use worker::{Worker, WorkerSettings};
