//! The ledger's vocabulary: a request's life (I3), each upstream attempt, why a request
//! ended and what the gateway decided after each attempt. Every protocol word is an enum
//! here, generated into the console's TypeScript (ts-rs), so the UI switches on the same
//! values the ledger stores.

use serde::{Deserialize, Serialize};
use spillway_wire::{ErrorClass, Format, UnixMs, Visibility};
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
    /// Outcome not known (an upstream call was cut by a crash or a shutdown); an owner
    /// reconciles it.
    Unknown,
}

impl RequestState {
    pub const ALL: [RequestState; 7] = [
        RequestState::Received,
        RequestState::CallingApi,
        RequestState::ApiCompleted,
        RequestState::SideEffectPending,
        RequestState::Done,
        RequestState::Failed,
        RequestState::Unknown,
    ];

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
        RequestState::ALL.into_iter().find(|v| v.as_str() == s)
    }

    /// Order along the I3 path. A request only moves forward: a write whose rank is lower
    /// than the stored one is refused, and a finished request (rank 4) never changes
    /// through the write path again.
    pub fn rank(self) -> u8 {
        match self {
            RequestState::Received => 0,
            RequestState::CallingApi => 1,
            RequestState::ApiCompleted => 2,
            RequestState::SideEffectPending => 3,
            RequestState::Done | RequestState::Failed | RequestState::Unknown => 4,
        }
    }

    pub fn is_final(self) -> bool {
        self.rank() == 4
    }
}

/// Why a request ended on the gateway's side, before or around the upstream call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum GatewayClass {
    /// Missing or unknown gateway key (counted, not recorded per request).
    ClientAuth,
    /// The body is not one valid UTF-8 JSON value of the endpoint's shape.
    InvalidBody,
    /// The body is not `application/json`.
    UnsupportedMediaType,
    /// The body is over `max_body_bytes`.
    PayloadTooLarge,
    /// The client did not send its body within the body deadline.
    BodyTimeout,
    /// No channel speaks the format and serves the model.
    NoChannel,
    /// Every channel of the group was busy for the whole capacity wait (C2).
    CapacityBusy,
    /// The capacity queue was at its maximum length: refused at once (C2).
    CapacityQueueFull,
    /// The key's rate or concurrency limit (B2).
    KeyLimited,
    /// Every channel of the group is out of rotation (E2).
    NoChannelInRotation,
    /// The route's circuit breaker was open: nothing was sent (G2).
    BreakerOpen,
    /// Every channel of the group was cooling down after repeated failures (D5).
    ChannelsCoolingDown,
    /// The ledger could not record the request, so nothing was sent upstream.
    LedgerUnavailable,
    /// The client hung up before the answer was complete.
    ClientDisconnected,
    /// The client stopped reading its answer past the write deadline; its connection was
    /// closed to free the channel and key slots.
    ClientStalled,
    /// The gateway was stopping; nothing was sent upstream.
    Shutdown,
    /// The gateway stopped (crash or shutdown) while the provider was being called: the
    /// outcome is unknown.
    Interrupted,
    /// A bug: the gateway failed while handling the request (a panic). Answered 500.
    InternalError,
    /// I2: the `Idempotency-Key` was used before with another body (422).
    IdempotencyKeyReused,
    /// I2: the request under the same `Idempotency-Key` is still running (409).
    IdempotencyInProgress,
    /// I2, L3: the request under the same `Idempotency-Key` has an unknown outcome; nothing
    /// is sent until an owner reconciles it (409).
    IdempotencyUnknown,
    /// I2: the request under the same `Idempotency-Key` completed, but its response copy
    /// is not kept (too large, or confirmed by an owner); nothing is sent again (409).
    IdempotencyCompleted,
    /// B3: the owner's balance was at or below zero (402).
    InsufficientBalance,
    /// B3: the key had spent its spend limit (402).
    SpendLimit,
    /// The owner had spent its daily budget (402).
    DailyBudget,
    /// J7: the lane a job would enter was at its maximum length (429).
    LaneFull,
    /// O1: a recovery run holds the route (isolated, or resuming below full concurrency).
    RecoveryHold,
}

impl GatewayClass {
    pub const ALL: [GatewayClass; 27] = [
        GatewayClass::ClientAuth,
        GatewayClass::InvalidBody,
        GatewayClass::UnsupportedMediaType,
        GatewayClass::PayloadTooLarge,
        GatewayClass::BodyTimeout,
        GatewayClass::NoChannel,
        GatewayClass::CapacityBusy,
        GatewayClass::CapacityQueueFull,
        GatewayClass::KeyLimited,
        GatewayClass::NoChannelInRotation,
        GatewayClass::BreakerOpen,
        GatewayClass::ChannelsCoolingDown,
        GatewayClass::LedgerUnavailable,
        GatewayClass::ClientDisconnected,
        GatewayClass::ClientStalled,
        GatewayClass::Shutdown,
        GatewayClass::Interrupted,
        GatewayClass::InternalError,
        GatewayClass::IdempotencyKeyReused,
        GatewayClass::IdempotencyInProgress,
        GatewayClass::IdempotencyUnknown,
        GatewayClass::IdempotencyCompleted,
        GatewayClass::InsufficientBalance,
        GatewayClass::SpendLimit,
        GatewayClass::DailyBudget,
        GatewayClass::LaneFull,
        GatewayClass::RecoveryHold,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            GatewayClass::ClientAuth => "client_auth",
            GatewayClass::InvalidBody => "invalid_body",
            GatewayClass::UnsupportedMediaType => "unsupported_media_type",
            GatewayClass::PayloadTooLarge => "payload_too_large",
            GatewayClass::BodyTimeout => "body_timeout",
            GatewayClass::NoChannel => "no_channel",
            GatewayClass::CapacityBusy => "capacity_busy",
            GatewayClass::CapacityQueueFull => "capacity_queue_full",
            GatewayClass::KeyLimited => "key_limited",
            GatewayClass::NoChannelInRotation => "no_channel_in_rotation",
            GatewayClass::BreakerOpen => "breaker_open",
            GatewayClass::ChannelsCoolingDown => "channels_cooling_down",
            GatewayClass::LedgerUnavailable => "ledger_unavailable",
            GatewayClass::ClientDisconnected => "client_disconnected",
            GatewayClass::ClientStalled => "client_stalled",
            GatewayClass::Shutdown => "shutdown",
            GatewayClass::Interrupted => "interrupted",
            GatewayClass::InternalError => "internal_error",
            GatewayClass::IdempotencyKeyReused => "idempotency_key_reused",
            GatewayClass::IdempotencyInProgress => "idempotency_in_progress",
            GatewayClass::IdempotencyUnknown => "idempotency_unknown",
            GatewayClass::IdempotencyCompleted => "idempotency_completed",
            GatewayClass::InsufficientBalance => "insufficient_balance",
            GatewayClass::SpendLimit => "spend_limit",
            GatewayClass::DailyBudget => "daily_budget",
            GatewayClass::LaneFull => "lane_full",
            GatewayClass::RecoveryHold => "recovery_hold",
        }
    }

    pub fn parse(s: &str) -> Option<GatewayClass> {
        GatewayClass::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

/// A request's `error_class`: the last attempt's upstream class (E2), or the gateway's own
/// reason. The two vocabularies share no word, so one string names either.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, TS)]
#[serde(untagged)]
pub enum FailureClass {
    Upstream(ErrorClass),
    Gateway(GatewayClass),
}

impl FailureClass {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::Upstream(c) => c.as_str(),
            FailureClass::Gateway(c) => c.as_str(),
        }
    }

    /// Reads a stored class; a word this version does not know (a row from another
    /// version) reads as an unknown upstream outcome rather than failing the query.
    pub fn parse(s: &str) -> FailureClass {
        ErrorClass::parse(s)
            .map(FailureClass::Upstream)
            .or_else(|| GatewayClass::parse(s).map(FailureClass::Gateway))
            .unwrap_or(FailureClass::Upstream(ErrorClass::Unknown))
    }
}

impl From<ErrorClass> for FailureClass {
    fn from(c: ErrorClass) -> Self {
        FailureClass::Upstream(c)
    }
}

impl From<GatewayClass> for FailureClass {
    fn from(c: GatewayClass) -> Self {
        FailureClass::Gateway(c)
    }
}

/// What the gateway did after an attempt (F2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// The attempt answered; the request is done.
    Done,
    /// Tried the same channel again (after a short delay, or at once).
    Retry,
    /// Moved to another channel of the group at once (D1).
    Failover,
    /// Waited past F2's 2 s threshold with a durable `ready_at`, then retried.
    Wait,
    /// Stopped: the request ended with this attempt's failure (the reason says why).
    FailClosed,
    /// The provider's own 4xx went back to the client as it came (D3).
    PassedThrough,
}

impl Decision {
    pub const ALL: [Decision; 6] = [
        Decision::Done,
        Decision::Retry,
        Decision::Failover,
        Decision::Wait,
        Decision::FailClosed,
        Decision::PassedThrough,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Done => "done",
            Decision::Retry => "retry",
            Decision::Failover => "failover",
            Decision::Wait => "wait",
            Decision::FailClosed => "fail_closed",
            Decision::PassedThrough => "passed_through",
        }
    }

    pub fn parse(s: &str) -> Option<Decision> {
        Decision::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

/// Why a request stopped being retried (F2's fail-closed reasons and the class rules).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// Output already reached the client (H2): nothing is replayed.
    PartialOutputCommitted,
    /// `max_attempts` used up and no fallback contract applies.
    AttemptBudgetExhausted,
    /// The next attempt could not start before the request's deadline.
    RetryAfterExceedsDeadline,
    /// The outcome's class is never retried (D3, E2).
    NotRetryable,
    /// Every channel of the group is out of rotation (ejected or paced past the deadline).
    NoChannelLeft,
    /// The client went away or stopped reading; nobody was left to answer.
    ClientGone,
    /// The gateway stopped during the attempt; the provider's outcome is unknown.
    Interrupted,
    /// F4: the route's retries were at their share of new requests.
    RetryBudgetExhausted,
    /// G2: the route's breaker opened (or was open): nothing more is sent.
    BreakerOpen,
    /// The provider may have acted on the request's behalf (a hosted tool, a background
    /// run) before the attempt failed: running it again could act twice.
    ProviderMayHaveActed,
    /// J1, J7: the stream-recovery lane was full: a stream did not wait to retry.
    LaneFull,
    /// O1: a recovery run isolates the route: automatic retries are off until its drain.
    RecoveryHold,
}

impl StopReason {
    pub const ALL: [StopReason; 12] = [
        StopReason::PartialOutputCommitted,
        StopReason::AttemptBudgetExhausted,
        StopReason::RetryAfterExceedsDeadline,
        StopReason::NotRetryable,
        StopReason::NoChannelLeft,
        StopReason::ClientGone,
        StopReason::Interrupted,
        StopReason::RetryBudgetExhausted,
        StopReason::BreakerOpen,
        StopReason::ProviderMayHaveActed,
        StopReason::LaneFull,
        StopReason::RecoveryHold,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::PartialOutputCommitted => "partial_output_committed",
            StopReason::AttemptBudgetExhausted => "attempt_budget_exhausted",
            StopReason::RetryAfterExceedsDeadline => "retry_after_exceeds_deadline",
            StopReason::NotRetryable => "not_retryable",
            StopReason::NoChannelLeft => "no_channel_left",
            StopReason::ClientGone => "client_gone",
            StopReason::Interrupted => "interrupted",
            StopReason::RetryBudgetExhausted => "retry_budget_exhausted",
            StopReason::BreakerOpen => "breaker_open",
            StopReason::ProviderMayHaveActed => "provider_may_have_acted",
            StopReason::LaneFull => "lane_full",
            StopReason::RecoveryHold => "recovery_hold",
        }
    }

    pub fn parse(s: &str) -> Option<StopReason> {
        StopReason::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

/// One logical request, with the I1 fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, TS)]
pub struct RequestRecord {
    pub id: String,
    pub trace_id: String,
    pub client_request_id: Option<String>,
    pub upstream_request_id: Option<String>,
    pub key_name: Option<String>,
    pub owner: Option<String>,
    pub workflow: Option<String>,
    pub format: Format,
    pub endpoint: String,
    pub route: Option<String>,
    pub channel: Option<String>,
    pub requested_model: Option<String>,
    pub served_model: Option<String>,
    pub stream: bool,
    pub state: RequestState,
    pub http_status: Option<u16>,
    pub error_class: Option<FailureClass>,
    pub error_message: Option<String>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cached_input_tokens: Option<u64>,
    pub reasoning_tokens: Option<u64>,
    /// Anthropic: prompt tokens written to the cache (priced above input).
    pub cache_write_tokens: Option<u64>,
    /// M1, M3: what the request cost, failed attempts included; None when unknown (an
    /// unpriced model, or no usage reported), never a made-up zero.
    pub cost_usd: Option<f64>,
    /// M3: the input tokens counted before the call.
    pub estimated_input_tokens: Option<u64>,
    /// M3: the cost expected before the call (input estimate plus output cap, priced).
    pub estimated_cost_usd: Option<f64>,
    /// The part of `cost_usd` spent on attempts that did not give the answer.
    pub failed_cost_usd: Option<f64>,
    /// The pricing catalog's version the costs were computed with.
    pub pricing_version: Option<String>,
    /// J8: the version (content hash) of the workflow policy the request ran under.
    pub policy_version: Option<String>,
    /// J2: the background job this request is a run of.
    pub job_id: Option<String>,
    pub received_at: UnixMs,
    pub admitted_at: Option<UnixMs>,
    pub first_token_at: Option<UnixMs>,
    pub finished_at: Option<UnixMs>,
    pub queued_ms: Option<u64>,
    pub attempts: u32,
    pub body_sha256: Option<String>,
    pub partial_output_committed: bool,
    /// While waiting to retry: the next attempt starts no earlier (F1, I5).
    pub next_ready_at: Option<UnixMs>,
    /// I2: the client's `Idempotency-Key`, scoped by `key_name`; set only on the request
    /// that runs under it (never on a repeat that was answered or refused).
    pub idempotency_key: Option<String>,
    /// A repeat answered from the ledger: the request whose stored response it replayed.
    pub replay_of: Option<String>,
    /// The provider's id of the response it stores (OpenAI Responses, `resp_...`), so a
    /// follow-up reaches the channel that holds it.
    pub response_id: Option<String>,
    /// What was recorded after the answer, outside the request path (the side-effect
    /// step, an owner's reconciliation). Out of line: rare, and every request's record
    /// is cloned and queued several times on the request path.
    pub resolution: Option<Box<Resolution>>,
}

/// The side-effect step and an owner's reconciliation of a request (I3, I4).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, TS)]
pub struct Resolution {
    /// The downstream result: the side effect's id, or the id an owner attached when
    /// confirming an unknown request as done.
    pub result_id: Option<String>,
    /// When the side-effect step was last marked (pending or done).
    pub side_effect_at: Option<UnixMs>,
    /// I4: how an owner reconciled this request's unknown outcome.
    pub reconciliation: Option<Reconciliation>,
    pub reconciled_by: Option<String>,
    pub reconciled_reason: Option<String>,
    pub reconciled_at: Option<UnixMs>,
}

impl RequestRecord {
    /// The result id recorded for the request, if any (see [`Resolution`]).
    pub fn result_id(&self) -> Option<&str> {
        self.resolution.as_ref().and_then(|r| r.result_id.as_deref())
    }

    /// Who reconciled the request's unknown outcome, if anyone.
    pub fn reconciled_by(&self) -> Option<&str> {
        self.resolution.as_ref().and_then(|r| r.reconciled_by.as_deref())
    }
}

/// I4: an owner's verdict on a request whose outcome was unknown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum Reconciliation {
    /// The provider did the work (the owner attaches its result id): the request is
    /// `done`, and a repeat of its key is never sent again.
    ConfirmedDone,
    /// The provider did not do it: the request is `failed`, and its key may run again.
    ConfirmedNotExecuted,
}

impl Reconciliation {
    pub fn as_str(self) -> &'static str {
        match self {
            Reconciliation::ConfirmedDone => "confirmed_done",
            Reconciliation::ConfirmedNotExecuted => "confirmed_not_executed",
        }
    }

    pub fn parse(s: &str) -> Option<Reconciliation> {
        [Reconciliation::ConfirmedDone, Reconciliation::ConfirmedNotExecuted]
            .into_iter()
            .find(|v| v.as_str() == s)
    }
}

impl RequestRecord {
    /// A request just received: everything not known yet is empty.
    pub fn received(
        id: String,
        trace_id: String,
        format: Format,
        endpoint: &str,
        received_at: UnixMs,
    ) -> RequestRecord {
        RequestRecord {
            id,
            trace_id,
            client_request_id: None,
            upstream_request_id: None,
            key_name: None,
            owner: None,
            workflow: None,
            format,
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
            cache_write_tokens: None,
            cost_usd: None,
            estimated_input_tokens: None,
            estimated_cost_usd: None,
            failed_cost_usd: None,
            pricing_version: None,
            policy_version: None,
            job_id: None,
            received_at,
            admitted_at: None,
            first_token_at: None,
            finished_at: None,
            queued_ms: None,
            attempts: 0,
            body_sha256: None,
            partial_output_committed: false,
            next_ready_at: None,
            idempotency_key: None,
            replay_of: None,
            response_id: None,
            resolution: None,
        }
    }

    /// Closes the request as failed at `at`: every failure path ends here. `http_status`
    /// is what the client was answered, if anyone was.
    pub fn fail(
        &mut self,
        http_status: Option<u16>,
        class: impl Into<FailureClass>,
        message: impl Into<String>,
        at: UnixMs,
    ) {
        self.end(RequestState::Failed, http_status, class, message, at);
    }

    /// Closes the request in `state` (`failed` or `unknown`) with its reason.
    pub fn end(
        &mut self,
        state: RequestState,
        http_status: Option<u16>,
        class: impl Into<FailureClass>,
        message: impl Into<String>,
        at: UnixMs,
    ) {
        self.state = state;
        self.http_status = http_status;
        self.error_class = Some(class.into());
        self.error_message = Some(message.into());
        self.finished_at = Some(at);
        self.next_ready_at = None;
    }

    /// Every text field within its stored bound, so that nothing a client or a provider
    /// sends can grow a row without limit. The writer applies it to every row.
    pub fn cap_fields(&mut self) {
        cap(&mut self.id, 64);
        cap(&mut self.trace_id, 64);
        cap_opt(&mut self.client_request_id, 256);
        cap_opt(&mut self.upstream_request_id, 256);
        cap_opt(&mut self.key_name, 128);
        cap_opt(&mut self.owner, 128);
        cap_opt(&mut self.workflow, 128);
        cap(&mut self.endpoint, 320);
        cap_opt(&mut self.route, 300);
        cap_opt(&mut self.channel, 128);
        cap_opt(&mut self.requested_model, 256);
        cap_opt(&mut self.served_model, 256);
        cap_opt(&mut self.error_message, MAX_MESSAGE);
        cap_opt(&mut self.body_sha256, 64);
        cap_opt(&mut self.idempotency_key, 255);
        cap_opt(&mut self.replay_of, 64);
        cap_opt(&mut self.response_id, 256);
    }
}

/// Longest message kept for a request or an attempt.
pub const MAX_MESSAGE: usize = 512;

/// Cuts `s` to at most `max` bytes, on a character boundary.
pub fn truncate(mut s: String, max: usize) -> String {
    cap(&mut s, max);
    s
}

fn cap(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

fn cap_opt(s: &mut Option<String>, max: usize) {
    if let Some(s) = s {
        cap(s, max);
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
    pub error_class: ErrorClass,
    pub provider_error_type: Option<String>,
    pub retry_after_ms: Option<u64>,
    pub message: Option<String>,
    pub started_at: UnixMs,
    pub first_byte_at: Option<UnixMs>,
    pub finished_at: Option<UnixMs>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    /// M3: what this attempt cost (a failed attempt that consumed tokens costs too).
    pub cost_usd: Option<f64>,
    /// What the gateway did after this attempt (F2).
    pub decision: Option<Decision>,
    /// Why, when the decision is to stop.
    pub decision_reason: Option<StopReason>,
    /// The pause before the next attempt.
    pub delay_ms: Option<u64>,
    /// The next attempt starts no earlier (F1).
    pub ready_at: Option<UnixMs>,
    /// E1, for a failed attempt: whether the client had seen output.
    pub visibility: Option<Visibility>,
}

impl AttemptRecord {
    /// Attempt `attempt_no` of `request_id` on `channel`, started at `started_at`; its
    /// outcome is filled in as it ends.
    pub fn started(request_id: &str, attempt_no: u32, channel: &str, started_at: UnixMs) -> AttemptRecord {
        AttemptRecord {
            request_id: request_id.to_owned(),
            attempt_no,
            channel: channel.to_owned(),
            upstream_request_id: None,
            http_status: None,
            error_class: ErrorClass::Unknown,
            provider_error_type: None,
            retry_after_ms: None,
            message: None,
            started_at,
            first_byte_at: None,
            finished_at: None,
            input_tokens: None,
            output_tokens: None,
            cost_usd: None,
            decision: None,
            decision_reason: None,
            delay_ms: None,
            ready_at: None,
            visibility: None,
        }
    }

    pub fn cap_fields(&mut self) {
        cap(&mut self.request_id, 64);
        cap(&mut self.channel, 128);
        cap_opt(&mut self.upstream_request_id, 256);
        cap_opt(&mut self.provider_error_type, 128);
        cap_opt(&mut self.message, MAX_MESSAGE);
    }
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
    /// What the requests asked of the provider (chat, Responses, embeddings, counting).
    pub api: Option<spillway_wire::Api>,
    /// Inclusive.
    pub from_ms: Option<UnixMs>,
    /// Exclusive.
    pub to_ms: Option<UnixMs>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_classes_read_back_from_their_words() {
        for c in ErrorClass::ALL {
            assert_eq!(FailureClass::parse(c.as_str()), FailureClass::Upstream(c));
        }
        for c in GatewayClass::ALL {
            assert_eq!(FailureClass::parse(c.as_str()), FailureClass::Gateway(c));
            assert!(ErrorClass::parse(c.as_str()).is_none(), "{} names both", c.as_str());
        }
        assert_eq!(
            FailureClass::parse("a-word-from-the-future"),
            FailureClass::Upstream(ErrorClass::Unknown)
        );
        let json = serde_json::to_string(&FailureClass::Gateway(GatewayClass::ClientStalled)).unwrap();
        assert_eq!(json, "\"client_stalled\"");
        let back: FailureClass = serde_json::from_str("\"rate_limit\"").unwrap();
        assert_eq!(back, FailureClass::Upstream(ErrorClass::RateLimit));
    }

    #[test]
    fn states_only_move_forward() {
        use RequestState::*;
        assert!(Received.rank() < CallingApi.rank());
        assert!(CallingApi.rank() < Done.rank());
        assert!(Done.is_final() && Failed.is_final() && Unknown.is_final());
        for s in RequestState::ALL {
            assert_eq!(RequestState::parse(s.as_str()), Some(s));
        }
    }

    #[test]
    fn fields_are_capped_on_char_boundaries() {
        let mut r = RequestRecord::received("id".into(), "t".into(), Format::OpenAi, "/e", UnixMs(1));
        r.client_request_id = Some("é".repeat(200));
        r.error_message = Some("x".repeat(10_000));
        r.cap_fields();
        assert!(r.client_request_id.as_ref().unwrap().len() <= 256);
        assert_eq!(r.error_message.as_ref().unwrap().len(), MAX_MESSAGE);
    }
}
