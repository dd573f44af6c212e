//! R1: what several gateway instances sharing one ledger need from it: who is alive (an
//! instance row with its heartbeat), taking over a dead one's in-flight work (its
//! `calling_api` requests become `unknown`, never re-run), and job leases so no two
//! instances run one job.

use serde::{Deserialize, Serialize};
use spillway_wire::UnixMs;
use ts_rs::TS;

/// One gateway instance as the shared ledger knows it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, TS)]
pub struct InstanceRow {
    /// The instance's name (`--instance`, else `host:port`): stable across its restarts,
    /// so a restarted instance finds its own interrupted requests.
    pub id: String,
    /// A fresh id per start: tells a restart from a second process using the same name.
    pub boot: String,
    /// Where its gateway listens.
    pub listen: String,
    pub version: String,
    pub started_at: UnixMs,
    pub heartbeat_at: UnixMs,
    /// Set when it stopped cleanly or a survivor took it over.
    pub stopped_at: Option<UnixMs>,
    /// The survivor that took its work over, when it died.
    pub taken_over_by: Option<String>,
    /// Requests of its that the take-over left `unknown`.
    pub unknowns: u64,
    /// JSON object: its load at its last heartbeat (in flight, requests per second, ...).
    pub load: String,
}

/// What taking over one dead instance did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TakeOver {
    pub instance: String,
    /// Its requests left in `calling_api`, now `unknown` for an owner.
    pub unknowns: u64,
    /// Jobs it held a lease on, their leases now released (the jobs runner decides what
    /// becomes of each: a job whose run may have reached the provider is not re-run).
    pub jobs: Vec<String>,
}
