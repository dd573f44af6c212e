//! Gateway errors and the one place they become HTTP responses in the caller's format
//! (A3), with `x-should-retry: false` where retrying cannot help and `retry-after` on 429
//! and 502 (A8).

use axum::body::Body;
use axum::response::Response;
use http::{HeaderValue, StatusCode, header};
use spillway_wire::{ErrorKind, Format, RequestError, error_body};

/// A wait as `retry-after` says it: whole seconds, rounded up, never 0 (A8).
pub fn retry_after_secs(wait: std::time::Duration) -> u64 {
    (wait.as_millis().div_ceil(1000) as u64).max(1)
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("Missing API key. Send it as {0}.")]
    MissingKey(&'static str),
    #[error("Invalid API key.")]
    InvalidKey,
    #[error("Request body is larger than the gateway's limit of {limit} bytes.")]
    PayloadTooLarge { limit: u64 },
    #[error("{0}")]
    InvalidRequest(#[from] RequestError),
    #[error("Could not read the request body: {0}")]
    BodyRead(String),
    #[error("No channel serves model `{model}` for the {format} format.")]
    NoChannel { model: String, format: Format },
    #[error("All upstream capacity for this model is busy. Retry shortly.")]
    CapacityBusy { retry_after_s: u64 },
    /// B2.
    #[error("This API key has reached its rate or concurrency limit.")]
    KeyLimited { retry_after_s: u64 },
    /// E2: every channel of the group is out of rotation until an operator restores it.
    #[error("No channel serving model `{model}` is in rotation ({detail}). An operator must restore a channel.")]
    NoChannelInRotation { model: String, detail: String },
    /// The client hung up while its request waited (C4); nobody reads this answer.
    #[error("The client disconnected while the request waited; nothing more was sent upstream.")]
    ClientGone,
    #[error("The request ledger is unavailable, so the request was not sent upstream.")]
    LedgerUnavailable,
    #[error("No such endpoint: {method} {path}")]
    NotFound { method: String, path: String },
    #[error("Method {method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
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
            GatewayError::PayloadTooLarge { .. } => ErrorKind::PayloadTooLarge,
            GatewayError::InvalidRequest(_) | GatewayError::BodyRead(_) => ErrorKind::InvalidRequest,
            GatewayError::NoChannel { .. } | GatewayError::NotFound { .. } => ErrorKind::NotFound,
            GatewayError::MethodNotAllowed { .. } => ErrorKind::MethodNotAllowed,
            GatewayError::CapacityBusy { .. } | GatewayError::KeyLimited { .. } => ErrorKind::RateLimited,
            GatewayError::NoChannelInRotation { .. } => ErrorKind::Upstream,
            GatewayError::LedgerUnavailable => ErrorKind::Unavailable,
            // 499 in nginx's sense has no wire name; the answer goes nowhere anyway.
            GatewayError::ClientGone => ErrorKind::InvalidRequest,
            GatewayError::Upstream { kind, .. } => *kind,
        }
    }

    /// The ledger's `error_class` for a request that ended with this error.
    pub fn class(&self) -> &'static str {
        match self {
            GatewayError::MissingKey(_) | GatewayError::InvalidKey => "client_auth",
            GatewayError::PayloadTooLarge { .. } => "payload_too_large",
            GatewayError::InvalidRequest(_) | GatewayError::BodyRead(_) => "invalid_request",
            GatewayError::NoChannel { .. } => "no_channel",
            GatewayError::NotFound { .. } | GatewayError::MethodNotAllowed { .. } => "not_found",
            GatewayError::CapacityBusy { .. } => "capacity_busy",
            GatewayError::KeyLimited { .. } => "key_limited",
            GatewayError::NoChannelInRotation { .. } => "no_channel_in_rotation",
            GatewayError::LedgerUnavailable => "ledger_unavailable",
            GatewayError::ClientGone => "client_disconnected",
            GatewayError::Upstream { .. } => "upstream",
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            GatewayError::InvalidRequest(e) => e.field.as_deref(),
            GatewayError::NoChannel { .. } => Some("model"),
            _ => None,
        }
    }

    /// Seconds the client should wait, for 429/502/503 (A8, D7).
    fn retry_after_s(&self) -> Option<u64> {
        match self {
            GatewayError::CapacityBusy { retry_after_s } | GatewayError::KeyLimited { retry_after_s } => {
                Some(*retry_after_s)
            }
            GatewayError::Upstream {
                retry_after_ms, kind, ..
            } if kind.retryable() => {
                Some(retry_after_ms.map_or(1, |ms| retry_after_secs(std::time::Duration::from_millis(ms))))
            }
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
            GatewayError::Upstream { futile: true, .. } | GatewayError::NoChannelInRotation { .. }
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
            model: "m".into(),
            detail: "`a`: credential rejected".into(),
        }
        .into_response(Format::OpenAi);
        assert_eq!(r.status(), 502);
        assert_eq!(r.headers()["x-should-retry"], "false");
        let r = GatewayError::KeyLimited { retry_after_s: 30 }.into_response(Format::Anthropic);
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()[header::RETRY_AFTER], "30");
    }
}
