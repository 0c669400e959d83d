//! The queue side of the runtime: the worker loop, job state decisions,
//! backoff, and the background services (rescuer, pruner, queue gauges).
//!
//! # Layout
//! - [`backoff`]: full-jitter delays.
//! - [`fetcher`]: claim ahead, in batches, into a bounded buffer.
//! - [`lease`]: the lease keeper (batched heartbeats for every held job).
//! - [`worker`]: claim → run the plugin (or reuse the stored plan) → execute
//!   effects → record the outcome; heartbeats; graceful shutdown.
//! - [`executor`]: carrying a plan out, effect by effect, through the
//!   ledger and the providers.
//! - [`outcome`]: the one place where a job attempt's result becomes a state
//!   transition (succeeded, retrying, dead, deferred).
//! - [`maintenance`]: rescuer of expired leases, retention pruner, gauges.
//! - [`reconcile`]: the sweep that settles keys left in doubt by asking
//!   their providers, and replays the dead jobs they held back.
//! - [`stats`]: in-process counters and the run summary.

pub mod backoff;
pub mod executor;
pub mod fetcher;
pub mod lease;
pub mod maintenance;
pub mod outcome;
pub mod reconcile;
pub mod stats;
pub mod worker;

pub use worker::{Worker, WorkerSettings};
