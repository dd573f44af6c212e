//! Background jobs (J2-J7) and the workflow policy versions they ran under (J8): rows
//! written on each change of a job's lane or state, durably and outside the request
//! path's batches (a job changes a few times in its life; a request's batch must not wait
//! for it).

use serde::{Deserialize, Serialize};
use spillway_wire::UnixMs;

/// One background job, as the ledger keeps it. `body` and `result` are loaded only by
/// [`crate::LedgerBackend::job`]; the listings leave them out, and a save without them
/// keeps what is stored.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: String,
    pub key_name: String,
    pub owner: String,
    /// The client's `Idempotency-Key`, or one derived from the job's id: every run of the
    /// job carries it, so a run that completed is never sent again (I2).
    pub idempotency_key: String,
    pub workflow: String,
    pub policy_version: String,
    pub format: String,
    pub api: String,
    /// The path (and query) it was submitted to.
    pub path: String,
    /// The endpoint as requests record it.
    pub endpoint: String,
    /// JSON object of the headers a run forwards (versions, betas); never a credential.
    pub headers: String,
    pub body: Option<Vec<u8>>,
    pub body_sha256: String,
    /// `format/model` as submitted.
    pub route: String,
    pub requested_model: String,
    pub served_model: Option<String>,
    /// The route the next run goes to when it is not `route` (an approved fallback or an
    /// owner's choice), `format/model`.
    pub route_override: Option<String>,
    pub priority: String,
    /// `background_retry`, `owner_review`, `dead_letter`; None once it has ended.
    pub lane: Option<String>,
    /// `queued`, `running`, `owner_review`, `dead_letter`, `succeeded`, `failed`,
    /// `rejected`, `replayed`.
    pub state: String,
    pub attempt: u32,
    pub max_attempts: u32,
    pub created_at: UnixMs,
    pub ready_at: UnixMs,
    pub expires_at: UnixMs,
    pub updated_at: UnixMs,
    pub retry_after_ms: Option<u64>,
    pub partial_output_committed: bool,
    pub last_error_type: Option<String>,
    pub last_error: Option<String>,
    pub last_status: Option<u16>,
    pub estimated_cost_usd: Option<f64>,
    /// M3: the input counted at submission and the output cap (or the assumed output), so
    /// a replay on another route can be priced before it is approved.
    pub estimated_input_tokens: Option<u64>,
    pub estimated_output_tokens: Option<u64>,
    pub cost_usd: Option<f64>,
    /// Tokens, input and output, of its runs (or the estimate before any).
    pub usage_units: Option<u64>,
    /// The fallback the workflow allows from its route: `none`, or the approved routes.
    pub fallback_policy: Option<String>,
    /// The requests that were its runs, oldest first.
    pub request_ids: Vec<String>,
    /// Why it is in its lane: the trigger (`max_attempts_exhausted`, `quota_or_spend_exhausted`, ...).
    pub reason: Option<String>,
    pub result_status: Option<u16>,
    pub result_content_type: Option<String>,
    pub result: Option<Vec<u8>>,
    /// JSON: the owner's decision (K3).
    pub review: Option<String>,
    /// The dead letter this job replays (L1).
    pub replay_of: Option<String>,
    /// The job that replayed this one.
    pub replayed_by: Option<String>,
    /// JSON: the reviewed replay form (L1).
    pub replay: Option<String>,
    /// The bulk replay this job belongs to (L2's stop condition counts its failures).
    pub batch_id: Option<String>,
}

/// One version of a workflow policy (J8).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyVersion {
    pub workflow: String,
    pub version: String,
    /// The file it was read from, or `built-in`.
    pub source: String,
    pub text: String,
    /// When this gateway first ran it.
    pub loaded_at: UnixMs,
}

pub(crate) const JOB_COLUMNS: &str = "id, key_name, owner, idempotency_key, workflow, policy_version, format, api, path, \
    endpoint, headers, body, body_sha256, route, requested_model, served_model, route_override, priority, lane, state, \
    attempt, max_attempts, created_at, ready_at, expires_at, updated_at, retry_after_ms, partial_output_committed, \
    last_error_type, last_error, last_status, estimated_cost_usd, estimated_input_tokens, estimated_output_tokens, cost_usd, usage_units, fallback_policy, request_ids, \
    reason, result_status, result_content_type, result, review, replay_of, replayed_by, replay, batch_id";
