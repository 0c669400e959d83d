//! Schedules (`[[schedules]]` in `idem.toml`): periodic jobs, one per tick
//! however many nodes run, without leader election.
//!
//! ```toml
//! [[schedules]]
//! name = "nightly-report"           # unique; part of each job's key
//! cron = "0 30 2 * * *"             # 5 fields, or 6 with seconds first
//! timezone = "Europe/Paris"         # IANA name (default "UTC")
//! plugin = "report"
//! payload = '{"kind": "daily"}'     # JSON (default {})
//! queue = "default"
//! missed = "one"                    # skip | one (default) | all
//! catch_up_limit = 100              # with missed = "all"
//! ```
//!
//! Each tick is a UTC instant and is enqueued under the key
//! `schedule:NAME:TICK` (`schedule:nightly-report:2026-12-07T01:30:00Z`) by
//! whichever node sees it due first ([`crate::store::Store::schedule_tick`]).
//! The store keeps each schedule's last tick, so a pruned job's tick never
//! comes back, and a schedule seen for the first time starts from now.
//!
//! # Layout
//! - `spec`: one schedule, checked when the configuration is read.
//! - `zone`: time zones by IANA name from the system's tz database.
//! - [`plan`]: which ticks are due and what the missed-tick policy does.
//! - [`ticker`]: the loop every worker runs.

pub mod plan;
mod spec;
pub mod ticker;
mod zone;

pub(crate) use spec::unique_schedules;
pub use spec::{Missed, Schedule, ScheduleError};
pub use zone::{UnknownZone, Zone, ZoneOffset};
