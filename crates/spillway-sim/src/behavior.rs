//! The simulator's counters; the scenario shapes live in `spillway_policy::sim`.

use serde::{Deserialize, Serialize};

/// Counters a test reads back through `/_control/channels/{name}`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChannelStats {
    /// Provider calls received (control calls excluded).
    pub calls: u64,
    pub in_flight: u64,
    pub max_in_flight: u64,
    /// Calls that got a fault other than `ok`.
    pub faults: u64,
    /// Path and query of the last provider call, as received.
    pub last_path: Option<String>,
    /// A few headers of the last provider call (trace context, credentials, versions), so
    /// tests can check what the gateway forwards and what it keeps back.
    pub last_headers: std::collections::BTreeMap<String, String>,
}
