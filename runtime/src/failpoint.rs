//! Failpoints: named places in the runtime where a test (or `idem chaos`)
//! makes the process fail on purpose, to open a failure window and check
//! that the end state is still right.
//!
//! Compiled in only with the cargo feature `failpoints`; without it
//! [`hit`] is an empty inline function and costs nothing. With it, a
//! failpoint does nothing until configured, from the environment
//! (`IDEM_FAILPOINTS="after_provider_call=abort;in_heartbeat=error"`, read
//! once) or from a test ([`set`]). Actions:
//! - `panic`: the task panics (the worker records nothing for the job);
//! - `abort`: the process dies at once, as with SIGKILL;
//! - `pause(MS)`: the task stops for MS milliseconds (to let a lease lapse);
//! - `error`: the database call at this point fails (a transient error);
//! - `off`: nothing.
//!
//! An action can be limited to its first hits with a count prefix,
//! `2*abort`.

use crate::store::StoreError;

/// The places a failure can be injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failpoint {
    /// After the plugin returned its plan, before the plan is stored.
    AfterPluginCall,
    /// After the plan is stored, before the first effect.
    AfterPlanStored,
    /// After an effect's key is claimed, before the provider is called.
    AfterKeyClaimed,
    /// After the provider answered, before the key is marked.
    AfterProviderCall,
    /// After a key is marked, before the job finishes: a `jobs` or `sql`
    /// effect's own write, or a provider effect's success once it has
    /// committed with the next effect's claim (the last effect's success
    /// commits with the job's, so there is no such window for it).
    AfterKeyMarked,
    /// A `sql` effect: after its statement ran, before its transaction
    /// (the statement with the ledger, or with the guard row) commits.
    AfterStatement,
    /// In the lease keeper's round.
    InHeartbeat,
    /// At shutdown, before leases are given back.
    BeforeRelease,
    /// A broker source: after the jobs were inserted, before the messages
    /// are acknowledged.
    AfterInsertBeforeAck,
    /// The group commit: a batch about to be written (`panic` here is a
    /// flush that panics; `pause` a slow flush).
    InFlush,
}

impl Failpoint {
    /// Every failpoint.
    pub const ALL: [Failpoint; 10] = [
        Failpoint::AfterPluginCall,
        Failpoint::AfterPlanStored,
        Failpoint::AfterKeyClaimed,
        Failpoint::AfterProviderCall,
        Failpoint::AfterKeyMarked,
        Failpoint::AfterStatement,
        Failpoint::InHeartbeat,
        Failpoint::BeforeRelease,
        Failpoint::AfterInsertBeforeAck,
        Failpoint::InFlush,
    ];

    /// The name used in `IDEM_FAILPOINTS`.
    ///
    /// ```
    /// assert_eq!(idem::failpoint::Failpoint::AfterProviderCall.name(), "after_provider_call");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Failpoint::AfterPluginCall => "after_plugin_call",
            Failpoint::AfterPlanStored => "after_plan_stored",
            Failpoint::AfterKeyClaimed => "after_key_claimed",
            Failpoint::AfterProviderCall => "after_provider_call",
            Failpoint::AfterKeyMarked => "after_key_marked",
            Failpoint::AfterStatement => "after_statement",
            Failpoint::InHeartbeat => "in_heartbeat",
            Failpoint::BeforeRelease => "before_release",
            Failpoint::AfterInsertBeforeAck => "after_insert_before_ack",
            Failpoint::InFlush => "in_flush",
        }
    }

    /// The failpoint of this name.
    pub fn parse(name: &str) -> Option<Failpoint> {
        Failpoint::ALL.into_iter().find(|f| f.name() == name)
    }
}

/// What a configured failpoint does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing.
    Off,
    /// Panic the task.
    Panic,
    /// Abort the process.
    Abort,
    /// Pause the task.
    Pause(std::time::Duration),
    /// Fail the database call here.
    Error,
}

/// Parses `IDEM_FAILPOINTS`-style text: `name=[N*]action;...`.
///
/// ```
/// use idem::failpoint::{Action, Failpoint, parse};
/// let set = parse("after_provider_call=abort; in_heartbeat=2*pause(500)").unwrap();
/// assert_eq!(set[0], (Failpoint::AfterProviderCall, Action::Abort, None));
/// assert_eq!(set[1].2, Some(2));
/// ```
pub fn parse(text: &str) -> Result<Vec<(Failpoint, Action, Option<u32>)>, String> {
    let mut out = Vec::new();
    for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, action) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?}: expected NAME=ACTION"))?;
        let point =
            Failpoint::parse(name.trim()).ok_or_else(|| format!("{name:?} is not a failpoint"))?;
        let action = action.trim();
        let (count, action) = match action.split_once('*') {
            Some((n, rest)) => (
                Some(
                    n.trim()
                        .parse::<u32>()
                        .map_err(|e| format!("{part:?}: count: {e}"))?,
                ),
                rest.trim(),
            ),
            None => (None, action),
        };
        let action = match action {
            "off" => Action::Off,
            "panic" => Action::Panic,
            "abort" => Action::Abort,
            "error" => Action::Error,
            other => match other
                .strip_prefix("pause(")
                .and_then(|rest| rest.strip_suffix(')'))
            {
                Some(ms) => Action::Pause(std::time::Duration::from_millis(
                    ms.trim()
                        .parse()
                        .map_err(|e| format!("{part:?}: pause: {e}"))?,
                )),
                None => return Err(format!("{part:?}: unknown action {other:?}")),
            },
        };
        out.push((point, action, count));
    }
    Ok(out)
}

#[cfg(feature = "failpoints")]
mod active {
    use super::{Action, Failpoint};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Mutex, OnceLock};

    struct Armed {
        action: Action,
        remaining: Option<u32>,
    }

    static ANY: AtomicBool = AtomicBool::new(false);
    static TABLE: OnceLock<Mutex<HashMap<Failpoint, Armed>>> = OnceLock::new();

    fn table() -> &'static Mutex<HashMap<Failpoint, Armed>> {
        TABLE.get_or_init(|| {
            let mut map = HashMap::new();
            if let Ok(text) = std::env::var("IDEM_FAILPOINTS") {
                match super::parse(&text) {
                    Ok(points) => {
                        for (point, action, remaining) in points {
                            map.insert(point, Armed { action, remaining });
                        }
                    }
                    Err(why) => eprintln!("IDEM_FAILPOINTS ignored: {why}"),
                }
            }
            ANY.store(!map.is_empty(), Ordering::Relaxed);
            Mutex::new(map)
        })
    }

    pub fn set(point: Failpoint, action: Action, count: Option<u32>) {
        let mut table = table().lock().unwrap_or_else(|p| p.into_inner());
        table.insert(
            point,
            Armed {
                action,
                remaining: count,
            },
        );
        ANY.store(true, Ordering::Relaxed);
    }

    pub fn clear() {
        table().lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    pub fn take(point: Failpoint) -> Action {
        let table = table();
        if !ANY.load(Ordering::Relaxed) {
            return Action::Off;
        }
        let mut table = table.lock().unwrap_or_else(|p| p.into_inner());
        let Some(armed) = table.get_mut(&point) else {
            return Action::Off;
        };
        match &mut armed.remaining {
            Some(0) => Action::Off,
            Some(n) => {
                *n -= 1;
                armed.action
            }
            None => armed.action,
        }
    }
}

/// Arms a failpoint in this process (tests); `count` limits it to its
/// first hits. Needs the `failpoints` feature; without it nothing happens.
pub fn set(point: Failpoint, action: Action, count: Option<u32>) {
    #[cfg(feature = "failpoints")]
    active::set(point, action, count);
    #[cfg(not(feature = "failpoints"))]
    let _ = (point, action, count);
}

/// Disarms every failpoint of this process.
pub fn clear() {
    #[cfg(feature = "failpoints")]
    active::clear();
}

/// Passes a failpoint: does what it is armed to do. `Err` only for the
/// `error` action (the caller's database call fails).
#[inline(always)]
pub async fn hit(point: Failpoint) -> Result<(), StoreError> {
    #[cfg(feature = "failpoints")]
    {
        match active::take(point) {
            Action::Off => {}
            Action::Panic => panic!("failpoint {} fired", point.name()),
            Action::Abort => {
                eprintln!("failpoint {} fired: aborting", point.name());
                std::process::abort()
            }
            Action::Pause(d) => tokio::time::sleep(d).await,
            Action::Error => return Err(StoreError::Injected(point.name())),
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = point;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_and_bad_text_is_refused() {
        for point in Failpoint::ALL {
            assert_eq!(Failpoint::parse(point.name()), Some(point));
        }
        assert!(parse("nowhere=abort").is_err());
        assert!(parse("after_plan_stored=explode").is_err());
        assert!(parse("after_plan_stored").is_err());
        assert_eq!(
            parse("after_plan_stored=pause(250)").unwrap()[0].1,
            Action::Pause(std::time::Duration::from_millis(250))
        );
    }
}
