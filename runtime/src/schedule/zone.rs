//! A time zone by IANA name, as a [`chrono::TimeZone`] so croner can walk a
//! cron expression in local time.
//!
//! The rules come from jiff, which reads the system's tz database
//! (`/usr/share/zoneinfo`) at run time, POSIX footer included: compiling the
//! database in (chrono-tz) would cost the build more than the rest of the
//! scheduler.

use chrono::{FixedOffset, MappedLocalTime, NaiveDate, NaiveDateTime, Timelike};
use std::fmt;

/// A time zone: UTC, or a zone of the system's tz database.
///
/// `let paris = Zone::named("Europe/Paris")?;`
#[derive(Clone, Debug)]
pub struct Zone(jiff::tz::TimeZone);

/// The offset a [`Zone`] has at one instant (it keeps its zone, as chrono
/// wants to recover the zone from a date's offset).
#[derive(Clone, Debug)]
pub struct ZoneOffset {
    zone: Zone,
    fixed: FixedOffset,
}

/// A time zone name the system does not know.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown time zone {name:?} (names are IANA's, e.g. \"Europe/Paris\"; read from the system's tz database): {why}"
)]
pub struct UnknownZone {
    /// The name asked for.
    pub name: String,
    /// What the lookup said.
    pub why: String,
}

impl Zone {
    /// UTC (needs no tz database).
    pub const UTC: Zone = Zone(jiff::tz::TimeZone::UTC);

    /// The zone of this IANA name ("UTC" needs no tz database).
    ///
    /// `let zone = idem::schedule::Zone::named("UTC")?;`
    pub fn named(name: &str) -> Result<Zone, UnknownZone> {
        if name == "UTC" {
            return Ok(Zone::UTC);
        }
        // Names that mean a different zone on each machine (its own
        // setting) or none at all: two nodes would reckon different ticks.
        if matches!(name, "localtime" | "Factory" | "posixrules") || name.starts_with("right/") {
            return Err(UnknownZone {
                name: name.to_string(),
                why:
                    "not an IANA zone every node reads the same: name one, such as \"Europe/Paris\""
                        .into(),
            });
        }
        jiff::tz::TimeZone::get(name)
            .map(Zone)
            .map_err(|e| UnknownZone {
                name: name.to_string(),
                why: e.to_string(),
            })
    }

    fn offset(&self, seconds: i32) -> ZoneOffset {
        ZoneOffset {
            zone: self.clone(),
            // jiff offsets are within ±25:59:59, chrono's within ±23:59:59;
            // no real zone is past ±14 h.
            fixed: FixedOffset::east_opt(seconds).unwrap_or(chrono::Offset::fix(&chrono::Utc)),
        }
    }
}

impl chrono::Offset for ZoneOffset {
    fn fix(&self) -> FixedOffset {
        self.fixed
    }
}

impl fmt::Display for ZoneOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.fixed, f)
    }
}

impl chrono::TimeZone for Zone {
    type Offset = ZoneOffset;

    fn from_offset(offset: &ZoneOffset) -> Self {
        offset.zone.clone()
    }

    fn offset_from_local_date(&self, local: &NaiveDate) -> MappedLocalTime<ZoneOffset> {
        match local.and_hms_opt(0, 0, 0) {
            Some(midnight) => self.offset_from_local_datetime(&midnight),
            None => MappedLocalTime::None,
        }
    }

    fn offset_from_local_datetime(&self, local: &NaiveDateTime) -> MappedLocalTime<ZoneOffset> {
        use chrono::Datelike;
        let Ok(year) = i16::try_from(local.year()) else {
            return MappedLocalTime::None;
        };
        // Every field is in range: they come from a valid NaiveDateTime.
        let civil = jiff::civil::DateTime::new(
            year,
            local.month() as i8,
            local.day() as i8,
            local.hour() as i8,
            local.minute() as i8,
            local.second() as i8,
            0,
        );
        let Ok(civil) = civil else {
            return MappedLocalTime::None;
        };
        match self.0.to_ambiguous_timestamp(civil).offset() {
            jiff::tz::AmbiguousOffset::Unambiguous { offset } => {
                MappedLocalTime::Single(self.offset(offset.seconds()))
            }
            // A local time the clocks skip (spring forward).
            jiff::tz::AmbiguousOffset::Gap { .. } => MappedLocalTime::None,
            // A local time the clocks repeat: the earlier instant first.
            jiff::tz::AmbiguousOffset::Fold { before, after } => MappedLocalTime::Ambiguous(
                self.offset(before.seconds()),
                self.offset(after.seconds()),
            ),
        }
    }

    fn offset_from_utc_date(&self, utc: &NaiveDate) -> ZoneOffset {
        match utc.and_hms_opt(0, 0, 0) {
            Some(midnight) => self.offset_from_utc_datetime(&midnight),
            None => self.offset(0),
        }
    }

    fn offset_from_utc_datetime(&self, utc: &NaiveDateTime) -> ZoneOffset {
        match jiff::Timestamp::from_second(utc.and_utc().timestamp()) {
            Ok(instant) => self.offset(self.0.to_offset(instant).seconds()),
            Err(_) => self.offset(0),
        }
    }
}
