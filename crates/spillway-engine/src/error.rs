//! Gateway errors and the one place they become HTTP responses in the caller's format
//! (A3), with `x-should-retry: false` where retrying cannot help and `retry-after` on 429,
//! 502 and 503 (A8). No message carries text the client sent: each names the field or the
//! rule, and what was expected.

use axum::body::Body;
use axum::response::Response;
use http::{HeaderValue, StatusCode, header};
use spillway_ledger::GatewayClass;
use spillway_wire::{ErrorKind, Format, RequestError, error_body};

/// A method or path as an error names it: at most 120 characters, anything but
/// printable ASCII shown as `?` (a path may carry raw UTF-8, bidi controls included).
fn shown(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(120)
        .map(|c| if c.is_ascii_graphic() { c } else { '?' })
        .collect();
    if text.chars().nth(120).is_some() {
        out.push_str("...");
    }
    out
}

/// A wait as `retry-after` says it: whole seconds, rounded up, never 0 (A8).
pub fn retry_after_secs(wait: std::time::Duration) -> u64 {
    (wait.as_millis().div_ceil(1000) as u64).max(1)
}

/// What the gateway serves, for the answer to an unknown path.
const ENDPOINTS: &str = "POST /v1/chat/completions, /v1/responses and /v1/embeddings (OpenAI); \
    POST /v1/messages and /v1/messages/count_tokens (Anthropic); POST /v1beta/models/{model}:generateContent, \
    :streamGenerateContent, :embedContent, :batchEmbedContents and :countTokens (Gemini); \
    GET /v1/models, /v1/models/{model}, /v1beta/models and /v1beta/models/{model}; GET and DELETE \
    /v1/responses/{id} (with /input_items and /cancel) for responses stored through this gateway";

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("Missing API key. Send it as {0}.")]
    MissingKey(&'static str),
    #[error("Invalid API key.")]
    InvalidKey,
    /// P1: a Host name the listener does not answer (DNS rebinding).
    #[error(
        "This gateway does not answer requests for this host name. Use a loopback address (127.0.0.1 or localhost), or add the name to `allowed_hosts` in the gateway's config."
    )]
    ForbiddenHost,
    #[error("`content-type`: expected application/json.")]
    UnsupportedMediaType,
    #[error("Request body is larger than the gateway's limit of {limit} bytes.")]
    PayloadTooLarge { limit: u64 },
    #[error("The request body did not arrive within {ms} ms.")]
    BodyTimeout { ms: u64 },
    #[error("{0}")]
    InvalidRequest(#[from] RequestError),
    #[error("The request body could not be read: the connection failed while it was being sent.")]
    BodyRead,
    #[error(
        "No channel serves the requested model for the {format} format (`model`); GET /v1/models lists the models this gateway serves."
    )]
    NoChannel { format: Format },
    #[error("All upstream capacity for this model is busy. Retry shortly.")]
    CapacityBusy { retry_after_s: u64 },
    /// C2 with the queue at its maximum length: the same answer, at once.
    #[error("All upstream capacity for this model is busy. Retry shortly.")]
    CapacityQueueFull { retry_after_s: u64 },
    /// B2.
    #[error("This API key has reached its rate or concurrency limit.")]
    KeyLimited { retry_after_s: u64 },
    /// B3: the owner's balance is at or below zero.
    #[error("Insufficient balance. Top up at the dashboard.")]
    InsufficientBalance,
    /// B3: the key has spent its limit.
    #[error("This API key has reached its spend limit.")]
    SpendLimit,
    /// The owner has spent its daily budget; it starts again at the next day boundary.
    #[error("This API key's owner has spent its daily budget of ${budget:.2}; it resets at {resets}.")]
    DailyBudget { budget: f64, resets: String },
    /// E2: every channel of the group is out of rotation until an operator restores it.
    #[error("No channel serving this model is in rotation ({detail}). An operator must restore a channel.")]
    NoChannelInRotation { detail: String },
    /// G2: the route's breaker is open (or on probation with its probe running): nothing
    /// is sent upstream.
    #[error(
        "The circuit breaker for route `{route}` is open ({reason}); the request was not sent upstream. Retry after the indicated delay."
    )]
    BreakerOpen {
        route: String,
        reason: String,
        retry_after_s: u64,
    },
    /// O1: a recovery run holds the route: isolated (nothing is sent), or resuming at a
    /// share of its concurrency that is in use.
    #[error(
        "Route `{route}` is held by recovery run {run} ({reason}); the request was not sent upstream. Retry after the indicated delay."
    )]
    RecoveryHold {
        route: String,
        run: String,
        reason: String,
        retry_after_s: u64,
    },
    /// D5: every channel of the group is cooling down after repeated failures.
    #[error(
        "Every channel serving this model is cooling down after repeated failures ({detail}). Retry after the indicated delay."
    )]
    ChannelsCoolingDown { detail: String, retry_after_s: u64 },
    /// The client hung up while its request waited (C4); nobody reads this answer.
    #[error("The client disconnected while the request waited; nothing more was sent upstream.")]
    ClientGone,
    #[error(
        "The request ledger cannot record requests right now, so the request was not sent upstream. Retry shortly."
    )]
    LedgerUnavailable,
    #[error("The gateway is shutting down; the request was not sent upstream. Retry shortly.")]
    ShuttingDown,
    /// The shutdown cut an upstream call in flight: nobody knows whether the provider
    /// finished it, so a blind retry could do the work twice.
    #[error(
        "The gateway shut down while this request was calling the provider; whether the provider completed it is unknown. The request is recorded as unknown under its x-request-id."
    )]
    Interrupted,
    /// A panic: a bug, answered and recorded, never a dropped connection.
    #[error(
        "The gateway failed while handling this request; it was recorded. This is a bug in the gateway, not in the request."
    )]
    Internal,
    /// A path no route serves: named, so the caller sees which call its SDK made.
    #[error("No such endpoint: {} {}. This gateway serves {ENDPOINTS}.", shown(.method), shown(.path))]
    NotFound { method: String, path: String },
    #[error("This endpoint does not accept this method.")]
    MethodNotAllowed,
    /// `GET /v1/models/{id}` of a model no channel of the format serves.
    #[error(
        "No channel of the {format} format serves this model; the model list (GET /v1/models, /v1beta/models) names those it serves."
    )]
    UnknownModel { format: Format },
    /// A follow-up to a stored response (or a turn naming it in `previous_response_id`)
    /// the ledger has no record of for this key.
    #[error("No stored response with that id was created through this gateway with this API key.")]
    UnknownResponse,
    /// I2: a malformed `Idempotency-Key` header.
    #[error("`Idempotency-Key`: expected 1-255 printable ASCII characters.")]
    InvalidIdempotencyKey,
    /// I2: the key was used before with another request.
    #[error(
        "`Idempotency-Key` conflict: this key was already used with a different request body, model or endpoint (request {original}). Use a new key for a new request."
    )]
    IdempotencyKeyReused { original: String },
    /// I2: the request under the key is still running.
    #[error(
        "A request with this `Idempotency-Key` is still in progress (request {original}, state `{state}`); nothing was sent again. Retry later to get its result."
    )]
    IdempotencyInProgress { original: String, state: &'static str },
    /// I2, L3: the request under the key has an unknown outcome.
    #[error(
        "The request with this `Idempotency-Key` (request {original}) is in state `unknown`: the gateway stopped while it was calling the provider, so whether it ran is not known. Nothing is sent again until an owner reconciles it in the console."
    )]
    IdempotencyUnknown { original: String },
    /// I2: the request under the key completed but its response copy is not kept.
    #[error(
        "The request with this `Idempotency-Key` (request {original}) completed{}, but its response is not kept (too large to store, or confirmed by an owner); it is not sent again.",
        result_id.as_deref().map(|r| format!(" with result id {r}")).unwrap_or_default()
    )]
    IdempotencyNotKept {
        original: String,
        result_id: Option<String>,
    },
    /// J2: no job with that id was submitted with this key.
    #[error("No background job with that id was submitted with this API key.")]
    NoSuchJob,
    /// J2: the job has no result (yet).
    #[error("Job {id} has no result: it is `{state}`. Its status is at /spillway/v1/jobs/{id}.")]
    JobNotDone { id: String, state: String },
    /// J8: `x-spillway-workflow` names no workflow policy in force.
    #[error("`x-spillway-workflow`: no workflow policy is called `{}`; the gateway runs {known}.", shown(.name))]
    UnknownWorkflow { name: String, known: String },
    /// J2: the workflow's policy only takes background jobs that carry an
    /// `Idempotency-Key` (`require_idempotency_key`).
    #[error(
        "`Idempotency-Key`: the workflow `{workflow}` requires one on every background job (`Prefer: respond-async`), so that a job is never run twice."
    )]
    JobNeedsIdempotencyKey { workflow: String },
    /// J7: the lane the job would enter is full.
    #[error(
        "The `{lane}` lane of workflow `{workflow}` is full ({length} of {max}); this work was not accepted. {advice}"
    )]
    LaneFull {
        lane: &'static str,
        workflow: String,
        length: usize,
        max: u32,
        advice: &'static str,
        retry_after_s: u64,
    },
    /// The upstream failed; `kind` is what the client should see. `futile` says that a
    /// client retry cannot help either (an unknown signal held for a person, E2), so the
    /// answer carries `x-should-retry: false` even though its status is retryable.
    #[error("{message}")]
    Upstream {
        kind: ErrorKind,
        message: String,
        retry_after_ms: Option<u64>,
        futile: bool,
    },
}

impl GatewayError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            GatewayError::MissingKey(_) | GatewayError::InvalidKey => ErrorKind::Authentication,
            GatewayError::ForbiddenHost => ErrorKind::Forbidden,
            GatewayError::UnsupportedMediaType => ErrorKind::UnsupportedMediaType,
            GatewayError::PayloadTooLarge { .. } => ErrorKind::PayloadTooLarge,
            GatewayError::BodyTimeout { .. } => ErrorKind::RequestTimeout,
            GatewayError::InvalidRequest(_)
            | GatewayError::BodyRead
            | GatewayError::InvalidIdempotencyKey
            | GatewayError::UnknownWorkflow { .. }
            | GatewayError::JobNeedsIdempotencyKey { .. } => ErrorKind::InvalidRequest,
            GatewayError::IdempotencyKeyReused { .. } => ErrorKind::Unprocessable,
            GatewayError::IdempotencyInProgress { .. }
            | GatewayError::IdempotencyUnknown { .. }
            | GatewayError::IdempotencyNotKept { .. } => ErrorKind::Conflict,
            GatewayError::NoChannel { .. }
            | GatewayError::NotFound { .. }
            | GatewayError::UnknownResponse
            | GatewayError::NoSuchJob
            | GatewayError::UnknownModel { .. } => ErrorKind::NotFound,
            GatewayError::JobNotDone { .. } => ErrorKind::Conflict,
            GatewayError::MethodNotAllowed => ErrorKind::MethodNotAllowed,
            GatewayError::InsufficientBalance | GatewayError::SpendLimit | GatewayError::DailyBudget { .. } => {
                ErrorKind::InsufficientQuota
            }
            GatewayError::CapacityBusy { .. }
            | GatewayError::CapacityQueueFull { .. }
            | GatewayError::KeyLimited { .. }
            | GatewayError::LaneFull { .. } => ErrorKind::RateLimited,
            GatewayError::NoChannelInRotation { .. } => ErrorKind::Upstream,
            GatewayError::BreakerOpen { .. }
            | GatewayError::RecoveryHold { .. }
            | GatewayError::ChannelsCoolingDown { .. } => ErrorKind::Unavailable,
            GatewayError::LedgerUnavailable | GatewayError::ShuttingDown | GatewayError::Interrupted => {
                ErrorKind::Unavailable
            }
            GatewayError::Internal => ErrorKind::Internal,
            // 499 in nginx's sense has no wire name; the answer goes nowhere anyway.
            GatewayError::ClientGone => ErrorKind::InvalidRequest,
            GatewayError::Upstream { kind, .. } => *kind,
        }
    }

    /// The ledger's class for a request that ended with this error on the gateway's side;
    /// `None` for upstream failures, whose class is the last attempt's.
    pub fn class(&self) -> Option<GatewayClass> {
        Some(match self {
            GatewayError::MissingKey(_) | GatewayError::InvalidKey | GatewayError::ForbiddenHost => {
                GatewayClass::ClientAuth
            }
            GatewayError::UnsupportedMediaType => GatewayClass::UnsupportedMediaType,
            GatewayError::PayloadTooLarge { .. } => GatewayClass::PayloadTooLarge,
            GatewayError::BodyTimeout { .. } => GatewayClass::BodyTimeout,
            GatewayError::InvalidRequest(_)
            | GatewayError::BodyRead
            | GatewayError::InvalidIdempotencyKey
            | GatewayError::UnknownWorkflow { .. }
            | GatewayError::JobNeedsIdempotencyKey { .. } => GatewayClass::InvalidBody,
            GatewayError::LaneFull { .. } => GatewayClass::LaneFull,
            GatewayError::IdempotencyKeyReused { .. } => GatewayClass::IdempotencyKeyReused,
            GatewayError::IdempotencyInProgress { .. } => GatewayClass::IdempotencyInProgress,
            GatewayError::IdempotencyUnknown { .. } => GatewayClass::IdempotencyUnknown,
            GatewayError::IdempotencyNotKept { .. } => GatewayClass::IdempotencyCompleted,
            GatewayError::NoChannel { .. }
            | GatewayError::NotFound { .. }
            | GatewayError::UnknownResponse
            | GatewayError::UnknownModel { .. }
            | GatewayError::NoSuchJob
            | GatewayError::JobNotDone { .. }
            | GatewayError::MethodNotAllowed => GatewayClass::NoChannel,
            GatewayError::CapacityBusy { .. } => GatewayClass::CapacityBusy,
            GatewayError::CapacityQueueFull { .. } => GatewayClass::CapacityQueueFull,
            GatewayError::KeyLimited { .. } => GatewayClass::KeyLimited,
            GatewayError::InsufficientBalance => GatewayClass::InsufficientBalance,
            GatewayError::SpendLimit => GatewayClass::SpendLimit,
            GatewayError::DailyBudget { .. } => GatewayClass::DailyBudget,
            GatewayError::NoChannelInRotation { .. } => GatewayClass::NoChannelInRotation,
            GatewayError::BreakerOpen { .. } => GatewayClass::BreakerOpen,
            GatewayError::RecoveryHold { .. } => GatewayClass::RecoveryHold,
            GatewayError::ChannelsCoolingDown { .. } => GatewayClass::ChannelsCoolingDown,
            GatewayError::LedgerUnavailable => GatewayClass::LedgerUnavailable,
            GatewayError::ShuttingDown => GatewayClass::Shutdown,
            GatewayError::Interrupted => GatewayClass::Interrupted,
            GatewayError::Internal => GatewayClass::InternalError,
            GatewayError::ClientGone => GatewayClass::ClientDisconnected,
            GatewayError::Upstream { .. } => return None,
        })
    }

    fn param(&self) -> Option<&str> {
        match self {
            GatewayError::InvalidRequest(e) => e.field.as_deref(),
            GatewayError::NoChannel { .. } => Some("model"),
            GatewayError::UnsupportedMediaType => Some("content-type"),
            GatewayError::UnknownWorkflow { .. } => Some("x-spillway-workflow"),
            GatewayError::InvalidIdempotencyKey
            | GatewayError::JobNeedsIdempotencyKey { .. }
            | GatewayError::IdempotencyKeyReused { .. }
            | GatewayError::IdempotencyInProgress { .. }
            | GatewayError::IdempotencyUnknown { .. }
            | GatewayError::IdempotencyNotKept { .. } => Some("Idempotency-Key"),
            _ => None,
        }
    }

    /// Seconds the client should wait, for 429/502/503 (A8, D7).
    fn retry_after_s(&self) -> Option<u64> {
        match self {
            GatewayError::CapacityBusy { retry_after_s }
            | GatewayError::CapacityQueueFull { retry_after_s }
            | GatewayError::KeyLimited { retry_after_s }
            | GatewayError::LaneFull { retry_after_s, .. }
            | GatewayError::BreakerOpen { retry_after_s, .. }
            | GatewayError::RecoveryHold { retry_after_s, .. }
            | GatewayError::ChannelsCoolingDown { retry_after_s, .. } => Some(*retry_after_s),
            GatewayError::Upstream {
                retry_after_ms, kind, ..
            } if kind.retryable() => {
                Some(retry_after_ms.map_or(1, |ms| retry_after_secs(std::time::Duration::from_millis(ms))))
            }
            GatewayError::Internal
            | GatewayError::BodyTimeout { .. }
            | GatewayError::Interrupted
            | GatewayError::IdempotencyUnknown { .. }
            | GatewayError::IdempotencyNotKept { .. } => None,
            _ if self.kind().retryable() => Some(1),
            _ => None,
        }
    }

    /// The response, in `format`.
    pub fn into_response(self, format: Format) -> Response {
        let kind = self.kind();
        let body = error_body(format, kind, &self.to_string(), self.param());
        let mut resp = Response::new(Body::from(body));
        *resp.status_mut() = StatusCode::from_u16(kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let futile = matches!(
            self,
            GatewayError::Upstream { futile: true, .. }
                | GatewayError::NoChannelInRotation { .. }
                | GatewayError::Interrupted
                | GatewayError::IdempotencyUnknown { .. }
                | GatewayError::IdempotencyNotKept { .. }
        );
        if !kind.retryable() || futile {
            h.insert("x-should-retry", HeaderValue::from_static("false"));
        }
        if let Some(s) = self.retry_after_s() {
            h.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a8_headers() {
        // spec: A8
        let r = GatewayError::InvalidKey.into_response(Format::Anthropic);
        assert_eq!(r.status(), 401);
        assert_eq!(r.headers()["x-should-retry"], "false");
        assert!(r.headers().get(header::RETRY_AFTER).is_none());
        let r = GatewayError::CapacityBusy { retry_after_s: 3 }.into_response(Format::OpenAi);
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()[header::RETRY_AFTER], "3");
        assert!(r.headers().get("x-should-retry").is_none());
        let r = GatewayError::Upstream {
            kind: ErrorKind::Upstream,
            message: "x".into(),
            retry_after_ms: Some(2500),
            futile: false,
        }
        .into_response(Format::Gemini);
        assert_eq!(r.status(), 502);
        assert_eq!(r.headers()[header::RETRY_AFTER], "3");
        let r = GatewayError::Upstream {
            kind: ErrorKind::Upstream,
            message: "x".into(),
            retry_after_ms: None,
            futile: false,
        }
        .into_response(Format::Gemini);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert!(r.headers().get("x-should-retry").is_none());
        let r = GatewayError::NoChannelInRotation {
            detail: "`a`: credential rejected".into(),
        }
        .into_response(Format::OpenAi);
        assert_eq!(r.status(), 502);
        assert_eq!(r.headers()["x-should-retry"], "false");
        let r = GatewayError::KeyLimited { retry_after_s: 30 }.into_response(Format::Anthropic);
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()[header::RETRY_AFTER], "30");
        let r = GatewayError::ShuttingDown.into_response(Format::OpenAi);
        assert_eq!(
            (r.status().as_u16(), &r.headers()[header::RETRY_AFTER]),
            (503, &HeaderValue::from(1))
        );
        let r = GatewayError::UnsupportedMediaType.into_response(Format::Anthropic);
        assert_eq!(
            (r.status().as_u16(), &r.headers()["x-should-retry"]),
            (415, &HeaderValue::from_static("false"))
        );
    }
}
