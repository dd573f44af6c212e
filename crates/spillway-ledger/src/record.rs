use serde::{Deserialize, Serialize};
use ts_rs::TS;

/// The I3 life of a logical request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum RequestState {
    /// Accepted at ingress, not yet sent anywhere.
    Received,
    /// An upstream call may be in progress. Durable before the call starts, so a crash
    /// leaves evidence that a provider may have done work.
    CallingApi,
    /// The provider answered and the answer is being delivered.
    ApiCompleted,
    /// A side effect tied to the answer is running (jobs; not used by plain proxying).
    SideEffectPending,
    /// Finished successfully.
    Done,
    /// Finished without a usable answer.
    Failed,
    /// Outcome not known (found in `calling_api` after a restart); an owner reconciles it.
    Unknown,
}

impl RequestState {
    pub fn as_str(self) -> &'static str {
        match self {
            RequestState::Received => "received",
            RequestState::CallingApi => "calling_api",
            RequestState::ApiCompleted => "api_completed",
            RequestState::SideEffectPending => "side_effect_pending",
            RequestState::Done => "done",
            RequestState::Failed => "failed",
            RequestState::Unknown => "unknown",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "received" => RequestState::Received,
            "calling_api" => RequestState::CallingApi,
            "api_completed" => RequestState::ApiCompleted,
            "side_effect_pending" => RequestState::SideEffectPending,
            "done" => RequestState::Done,
            "failed" => RequestState::Failed,
            "unknown" => RequestState::Unknown,
            _ => return None,
        })
    }
}

/// One logical request, with the I1 fields. Times are unix milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, TS)]
pub struct RequestRecord {
    pub id: String,
    pub trace_id: String,
    pub client_request_id: Option<String>,
    pub upstream_request_id: Option<String>,
    pub key_name: Option<String>,
    pub owner: Option<String>,
    pub workflow: Option<String>,
    pub format: String,
    pub endpoint: String,
    pub route: Option<String>,
    pub channel: Option<String>,
    pub requested_model: Option<String>,
    pub served_model: Option<String>,
    pub stream: bool,
    pub state: RequestState,
    pub http_status: Option<u16>,
    pub error_class: Option<String>,
    pub error_message: Option<String>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cached_input_tokens: Option<u64>,
    pub reasoning_tokens: Option<u64>,
    pub cost_usd: Option<f64>,
    pub received_at: i64,
    pub admitted_at: Option<i64>,
    pub first_token_at: Option<i64>,
    pub finished_at: Option<i64>,
    pub queued_ms: Option<u64>,
    pub attempts: u32,
    pub body_sha256: Option<String>,
    pub partial_output_committed: bool,
    /// While waiting to retry: the next attempt starts no earlier (F1, I5). Unix ms.
    pub next_ready_at: Option<i64>,
}

impl RequestRecord {
    /// A request just received: everything not known yet is empty.
    pub fn received(id: String, trace_id: String, format: &str, endpoint: &str, received_at: i64) -> RequestRecord {
        RequestRecord {
            id,
            trace_id,
            client_request_id: None,
            upstream_request_id: None,
            key_name: None,
            owner: None,
            workflow: None,
            format: format.to_owned(),
            endpoint: endpoint.to_owned(),
            route: None,
            channel: None,
            requested_model: None,
            served_model: None,
            stream: false,
            state: RequestState::Received,
            http_status: None,
            error_class: None,
            error_message: None,
            input_tokens: None,
            output_tokens: None,
            cached_input_tokens: None,
            reasoning_tokens: None,
            cost_usd: None,
            received_at,
            admitted_at: None,
            first_token_at: None,
            finished_at: None,
            queued_ms: None,
            attempts: 0,
            body_sha256: None,
            partial_output_committed: false,
            next_ready_at: None,
        }
    }
}

impl RequestRecord {
    /// Closes the request as failed at `at_ms`: every failure path (refused at ingress,
    /// abandoned, out of attempts, passed-through provider 4xx, broken stream) ends here.
    /// `http_status` is what the client was answered, if anyone was.
    pub fn fail(&mut self, http_status: Option<u16>, class: impl Into<String>, message: impl Into<String>, at_ms: i64) {
        self.state = RequestState::Failed;
        self.http_status = http_status;
        self.error_class = Some(class.into());
        self.error_message = Some(message.into());
        self.finished_at = Some(at_ms);
        self.next_ready_at = None;
    }
}

/// One upstream attempt of a request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, TS)]
pub struct AttemptRecord {
    pub request_id: String,
    pub attempt_no: u32,
    pub channel: String,
    pub upstream_request_id: Option<String>,
    pub http_status: Option<u16>,
    pub error_class: String,
    pub provider_error_type: Option<String>,
    pub retry_after_ms: Option<u64>,
    pub message: Option<String>,
    pub started_at: i64,
    pub first_byte_at: Option<i64>,
    pub finished_at: Option<i64>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    /// What the gateway did after this attempt (F2): `done`, `retry`, `failover`, `wait`,
    /// `fail_closed` or `passed_through` (the provider's own 4xx, D3).
    pub decision: Option<String>,
    /// Why, for `fail_closed` and waits: `partial_output_committed`,
    /// `attempt_budget_exhausted`, `retry_after_exceeds_deadline`, `not_retryable`, …
    pub decision_reason: Option<String>,
    /// The pause before the next attempt.
    pub delay_ms: Option<u64>,
    /// Unix ms: the next attempt starts no earlier (F1).
    pub ready_at: Option<i64>,
    /// E1, for a failed attempt: whether the client had seen output (`before_first_token`,
    /// `after_partial_output`).
    pub visibility: Option<String>,
}

/// A ledger search (the console's explorer). Every filter is optional; results come
/// newest first, `limit` at a time, and `before` (the last id of a page) continues.
#[derive(Clone, Debug, Default, Serialize, Deserialize, TS)]
#[serde(default, deny_unknown_fields)]
pub struct Search {
    /// A request id, client request id or trace id.
    pub q: Option<String>,
    /// `provider/model`, as in `x-spillway-route`.
    pub route: Option<String>,
    pub state: Option<RequestState>,
    /// Unix milliseconds, inclusive.
    pub from_ms: Option<i64>,
    /// Unix milliseconds, exclusive.
    pub to_ms: Option<i64>,
    pub before: Option<String>,
    pub limit: Option<u32>,
}

/// One page of results.
#[derive(Clone, Debug, Serialize, Deserialize, TS)]
pub struct Page {
    pub items: Vec<RequestRecord>,
    /// Pass as `before` for the next page; absent on the last page.
    pub next: Option<String>,
}
