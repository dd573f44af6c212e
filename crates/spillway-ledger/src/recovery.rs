//! What the ledger keeps for guided recovery (O1–O5) and computes for the scorecard
//! (N1–N3): the runs themselves, and per-route figures over a time window, read from the
//! request rows (the ledger is the one source of truth for what happened).

use serde::{Deserialize, Serialize};
use spillway_wire::UnixMs;
use ts_rs::TS;

/// A recovery run as stored: the engine owns `body`'s shape.
#[derive(Clone, Debug, PartialEq)]
pub struct RecoveryRow {
    pub id: String,
    pub route: String,
    pub drill: Option<String>,
    pub step: String,
    pub opened_at: UnixMs,
    pub closed_at: Option<UnixMs>,
    pub body: String,
}

/// One error class's count among failed requests.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, TS)]
pub struct ErrorCount {
    pub class: String,
    pub count: u64,
}

/// N1: one route's figures over a window (`route` is `overall` for the whole gateway).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, TS)]
pub struct ScoreRow {
    pub route: String,
    /// Logical requests (one per client call, whatever its retries).
    pub requests: u64,
    /// Upstream attempts they made.
    pub attempts: u64,
    /// Attempts beyond each request's first.
    pub retries: u64,
    /// Attempts per request that reached a provider (F5); None without any.
    pub amplification: Option<f64>,
    /// Answered, of all requests.
    pub success_rate: Option<f64>,
    /// Answered in the end, of the requests that were retried (F5); None without any.
    pub post_retry_success_rate: Option<f64>,
    pub succeeded: u64,
    pub failed: u64,
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub wait_p50_ms: Option<f64>,
    pub wait_p95_ms: Option<f64>,
    pub error_mix: Vec<ErrorCount>,
    /// What the requests cost, failed attempts included (M3).
    pub cost_usd: f64,
    /// Requests that reached a provider whose cost is unknown (unpriced): not in `cost_usd`.
    pub unpriced: u64,
    /// Idempotency keys that completed upstream more than once.
    pub duplicates: u64,
    pub unknowns: u64,
}

/// One route's day (UTC), for N3's trends.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DayFigures {
    pub route: String,
    /// The day's first millisecond.
    pub day: UnixMs,
    pub requests: u64,
    pub attempted: u64,
    pub attempts: u64,
    pub cost_usd: f64,
    pub priced: u64,
    /// Requests that ended on a 429.
    pub rate_limited: u64,
    /// Answered requests the provider's request id is missing from.
    pub untied: u64,
}

/// Nearest-rank percentile `p` of `n` sorted values: the rank to read (1-based).
pub fn rank(p: f64, n: u64) -> u64 {
    ((p * n as f64).ceil() as u64).clamp(1, n.max(1))
}
