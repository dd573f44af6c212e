//! The control plane's rows: the latest state of each breaker and channel ejection, and
//! the append-only audit log of their transitions (G4). Written rarely (on transitions),
//! durably, outside the request path's batches.

use serde::Serialize;
use spillway_wire::UnixMs;
use ts_rs::TS;

/// The latest state of one breaker or channel, as JSON the engine reads back.
#[derive(Clone, Debug, PartialEq)]
pub struct ControlState {
    pub kind: String,
    pub subject: String,
    pub state: String,
    pub updated_at: UnixMs,
}

/// One transition on the record.
#[derive(Clone, Debug, PartialEq, Serialize, TS)]
pub struct AuditEntry {
    pub id: i64,
    pub at: UnixMs,
    /// `breaker` or `channel`.
    pub kind: String,
    /// The route (`openai/gpt-4o-mini`) or the channel's name.
    pub subject: String,
    /// `gateway`, or the operator who acted.
    pub actor: String,
    /// What happened, e.g. `closed->open`, `ejected`, `back_in_rotation`.
    pub action: String,
    pub trigger: Option<String>,
    pub reason: String,
    /// The trigger figures, as JSON (`[{"name": ..., "value": ...}]`).
    pub figures: Option<String>,
}
