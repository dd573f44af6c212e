//! The gateway's wall clock: every instant the ledger stores, the admin API sends and the
//! console shows is a [`UnixMs`] read here. Deadlines and timers use tokio's monotonic
//! clock instead. In unit tests the wall clock follows tokio's (paused) clock, so a test
//! that advances time sees timestamps move with it.

use spillway_wire::UnixMs;

/// Now, as the ledger records it.
#[cfg(not(test))]
pub fn now() -> UnixMs {
    UnixMs::from_system(std::time::SystemTime::now())
}

/// Now, following tokio's clock from the first reading on (see the module docs).
#[cfg(test)]
pub fn now() -> UnixMs {
    use std::sync::OnceLock;
    static ANCHOR: OnceLock<(std::time::Instant, UnixMs)> = OnceLock::new();
    let (at, wall) = *ANCHOR.get_or_init(|| {
        (
            tokio::time::Instant::now().into_std(),
            UnixMs::from_system(std::time::SystemTime::now()),
        )
    });
    wall.plus(tokio::time::Instant::now().into_std().saturating_duration_since(at))
}

/// Milliseconds of a duration, as the ledger counts them.
pub fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
