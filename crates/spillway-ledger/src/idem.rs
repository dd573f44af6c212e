//! What the idempotency ledger adds to the request rows (I2–I6): the payload copies kept
//! for replays, the side-effect step, an owner's reconciliation of an unknown outcome, the
//! figures the console shows (unknowns and duplicates per route, the ledger's size) and
//! pruning.

use crate::{AuditEntry, Reconciliation, RequestRecord};
use serde::{Deserialize, Serialize};
use spillway_wire::UnixMs;
use ts_rs::TS;

/// A completed response, kept so a repeat of its `Idempotency-Key` gets it back byte for
/// byte (a stream's events included) without a second upstream call.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredResponse {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

/// Body copies of one request, written with its final record and gone at `expires_at`.
#[derive(Clone, Debug, PartialEq)]
pub struct Payload {
    pub request_id: String,
    pub expires_at: UnixMs,
    /// The request body, only when the config keeps prompts (I6).
    pub request_body: Option<Vec<u8>>,
    pub response: Option<StoredResponse>,
}

/// The newest request under a key's `Idempotency-Key`, with its stored response if one is
/// kept and not expired.
#[derive(Clone, Debug)]
pub struct KeyedRequest {
    pub request: RequestRecord,
    pub response: Option<StoredResponse>,
}

/// The side-effect step a client marks after the answer (I3):
/// `api_completed`/`done` → `side_effect_pending` → `done` with its result id.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
#[serde(deny_unknown_fields)]
pub enum SideEffect {
    /// The downstream action (an email, a payment) is about to run.
    Pending,
    /// It ran; `result_id` names what it produced. A repeat is never run again.
    Done { result_id: String },
}

/// An owner's reconciliation of one unknown request (I4), as the admin API takes it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, TS)]
#[serde(deny_unknown_fields)]
pub struct Reconcile {
    pub outcome: Reconciliation,
    /// Required with `confirmed_done`: the result the owner found (a provider response
    /// id, a message id).
    #[serde(default)]
    pub result_id: Option<String>,
    /// The owner's name, as the audit log shows it.
    pub actor: String,
    pub reason: String,
}

/// A count per route (`format/model`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, TS)]
pub struct RouteCount {
    pub route: String,
    pub count: u64,
}

/// What the console shows of the ledger itself (N1's duplicates and unknowns, I6's size).
#[derive(Clone, Debug, Default, PartialEq, Serialize, TS)]
pub struct LedgerFigures {
    /// Requests whose outcome is unknown and not reconciled yet.
    pub unknown: u64,
    pub unknown_by_route: Vec<RouteCount>,
    /// `Idempotency-Key`s that completed upstream more than once. Must be 0.
    pub duplicates: u64,
    pub duplicates_by_route: Vec<RouteCount>,
    /// The ledger's files on disk (database and write-ahead log).
    pub bytes: u64,
    /// Kept body copies (replays, prompts when configured), and how many.
    pub payload_bytes: u64,
    pub payloads: u64,
}

/// What a prune removed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, TS)]
pub struct PruneReport {
    /// Expired body copies.
    pub payloads: u64,
    /// Finished requests older than the cut-off (with their attempts); unknown and
    /// in-flight ones are always kept.
    pub requests: u64,
    pub attempts: u64,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

impl PruneReport {
    /// The audit entry a prune leaves, whoever ran it (the console or the CLI).
    pub fn audit_entry(&self, at: UnixMs, actor: String, reason: String, older_than_days: Option<u32>) -> AuditEntry {
        AuditEntry {
            id: 0,
            at,
            kind: "ledger".into(),
            subject: "prune".into(),
            actor,
            action: "pruned".into(),
            trigger: older_than_days.map(|d| format!("finished requests older than {d} day(s)")),
            reason,
            figures: Some(format!(
                r#"[{{"name":"payloads","value":{}}},{{"name":"requests","value":{}}},{{"name":"attempts","value":{}}}]"#,
                self.payloads, self.requests, self.attempts
            )),
        }
    }
}
