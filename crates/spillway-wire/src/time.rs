//! The one representation of a wall-clock instant the gateway keeps: milliseconds since
//! the Unix epoch, UTC. The ledger stores it, the admin API sends it and the console reads
//! it as a plain number. Calendar work (RFC 3339 in and out) goes through `chrono` here, at
//! the edge; deadlines and timers use tokio's monotonic clock, which is not an instant of
//! this kind.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// An instant: milliseconds since 1970-01-01T00:00:00Z. A newtype, so it travels as the
/// bare number in JSON.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct UnixMs(pub i64);

impl UnixMs {
    /// The wall clock now. The engine reads time through its own clock (which tests can
    /// pause); this is for the edges that have no such clock.
    pub fn from_system(t: SystemTime) -> UnixMs {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => UnixMs(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            Err(e) => UnixMs(-i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX)),
        }
    }

    pub fn to_system(self) -> SystemTime {
        if self.0 >= 0 {
            UNIX_EPOCH + Duration::from_millis(self.0 as u64)
        } else {
            UNIX_EPOCH - Duration::from_millis(self.0.unsigned_abs())
        }
    }

    pub fn plus(self, d: Duration) -> UnixMs {
        UnixMs(self.0.saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)))
    }

    /// How long until `later`; zero when it has passed.
    pub fn until(self, later: UnixMs) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0).max(0) as u64)
    }

    /// Whole milliseconds from `earlier` to `self`, never negative.
    pub fn since(self, earlier: UnixMs) -> u64 {
        self.0.saturating_sub(earlier.0).max(0) as u64
    }

    /// Parses an RFC 3339 timestamp (`2026-05-28T20:26:40Z`, offsets and fractions too).
    pub fn parse_rfc3339(s: &str) -> Option<UnixMs> {
        DateTime::parse_from_rfc3339(s.trim())
            .ok()
            .map(|t| UnixMs(t.with_timezone(&Utc).timestamp_millis()))
    }

    /// RFC 3339 in UTC with milliseconds, for people and logs.
    pub fn to_rfc3339(self) -> String {
        DateTime::<Utc>::from_timestamp_millis(self.0)
            .map(|t| t.to_rfc3339_opts(SecondsFormat::Millis, true))
            .unwrap_or_else(|| format!("{} ms since the epoch", self.0))
    }
}

impl std::fmt::Display for UnixMs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trip_and_offsets() {
        let t = UnixMs::parse_rfc3339("2026-05-28T20:26:40Z").unwrap();
        assert_eq!(t, UnixMs(1_780_000_000_000));
        assert_eq!(t.to_rfc3339(), "2026-05-28T20:26:40.000Z");
        let t2 = UnixMs::parse_rfc3339("2026-05-28T22:26:40.5+02:00").unwrap();
        assert_eq!(t2.0 - t.0, 500);
        assert!(UnixMs::parse_rfc3339("yesterday").is_none());
        assert!(UnixMs::parse_rfc3339("2026-13-01T00:00:00Z").is_none());
    }

    #[test]
    fn arithmetic_saturates() {
        let t = UnixMs(1_000);
        assert_eq!(t.plus(Duration::from_millis(500)), UnixMs(1_500));
        assert_eq!(t.until(UnixMs(400)), Duration::ZERO);
        assert_eq!(UnixMs(400).since(t), 0);
        assert_eq!(t.since(UnixMs(400)), 600);
        assert_eq!(UnixMs(i64::MAX).plus(Duration::from_secs(1)), UnixMs(i64::MAX));
        assert_eq!(UnixMs::from_system(UnixMs(1_234).to_system()), UnixMs(1_234));
    }
}
