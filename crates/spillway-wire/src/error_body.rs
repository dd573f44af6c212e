//! Error bodies in each caller's format (A3). Every gateway error reaches the client
//! through [`error_body`], so the mapping of kind to status and provider vocabulary lives
//! in this one table.

use crate::{Api, Format};
use serde_json::json;

/// What went wrong, as the client should understand it. Each kind has one HTTP status and
/// one name per wire format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400: malformed JSON, a wrong type, a missing field.
    InvalidRequest,
    /// 401: missing or unknown gateway key.
    Authentication,
    /// 403: the request may not be served here (a Host name the gateway does not answer).
    Forbidden,
    /// 402: the owner's balance or the key's spend limit.
    InsufficientQuota,
    /// 404: no such endpoint, or no channel serves the model.
    NotFound,
    /// 405: the endpoint exists but not for this method.
    MethodNotAllowed,
    /// 408: the client did not send its body in time.
    RequestTimeout,
    /// 409: the request's `Idempotency-Key` names work still in progress, or whose outcome
    /// is unknown (I2).
    Conflict,
    /// 413: body over the configured limit.
    PayloadTooLarge,
    /// 415: the body is not `application/json`.
    UnsupportedMediaType,
    /// 422: the request's `Idempotency-Key` was used with another body (I2).
    Unprocessable,
    /// 429: a key's limits, or upstream capacity.
    RateLimited,
    /// 500: the gateway itself failed (a bug); the request is closed and recorded.
    Internal,
    /// 502: the upstream failed and the gateway could not get an answer.
    Upstream,
    /// 503: the gateway is shutting down, or its ledger cannot record the request.
    Unavailable,
}

impl ErrorKind {
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest => 400,
            ErrorKind::Authentication => 401,
            ErrorKind::InsufficientQuota => 402,
            ErrorKind::Forbidden => 403,
            ErrorKind::NotFound => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::RequestTimeout => 408,
            ErrorKind::Conflict => 409,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::UnsupportedMediaType => 415,
            ErrorKind::Unprocessable => 422,
            ErrorKind::RateLimited => 429,
            ErrorKind::Internal => 500,
            ErrorKind::Upstream => 502,
            ErrorKind::Unavailable => 503,
        }
    }

    /// Whether a client retry could help; when not, responses carry `x-should-retry: false`
    /// so the official SDKs stop (A8).
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::RateLimited
                | ErrorKind::Upstream
                | ErrorKind::Unavailable
                | ErrorKind::Internal
                | ErrorKind::RequestTimeout
                // Work still in progress under the same `Idempotency-Key`: a retry later
                // gets its stored result (an unknown outcome is marked futile instead).
                | ErrorKind::Conflict
        )
    }

    /// `(type, code)` in an OpenAI error object.
    fn openai(self) -> (&'static str, Option<&'static str>) {
        match self {
            ErrorKind::InvalidRequest => ("invalid_request_error", None),
            ErrorKind::Authentication => ("invalid_request_error", Some("invalid_api_key")),
            ErrorKind::InsufficientQuota => ("insufficient_quota", Some("insufficient_quota")),
            ErrorKind::Forbidden => ("invalid_request_error", Some("permission_denied")),
            ErrorKind::NotFound => ("invalid_request_error", Some("not_found")),
            ErrorKind::MethodNotAllowed => ("invalid_request_error", Some("method_not_allowed")),
            ErrorKind::RequestTimeout => ("invalid_request_error", Some("request_timeout")),
            ErrorKind::PayloadTooLarge => ("invalid_request_error", Some("request_too_large")),
            ErrorKind::UnsupportedMediaType => ("invalid_request_error", Some("unsupported_media_type")),
            ErrorKind::Conflict => ("idempotency_error", Some("conflict")),
            ErrorKind::Unprocessable => ("idempotency_error", Some("idempotency_key_reused")),
            ErrorKind::RateLimited => ("rate_limit_exceeded", Some("rate_limit_exceeded")),
            ErrorKind::Internal => ("api_error", Some("internal_error")),
            ErrorKind::Upstream => ("api_error", Some("api_error")),
            ErrorKind::Unavailable => ("api_error", Some("service_unavailable")),
        }
    }

    fn anthropic(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::MethodNotAllowed
            | ErrorKind::RequestTimeout
            | ErrorKind::UnsupportedMediaType
            | ErrorKind::Conflict
            | ErrorKind::Unprocessable => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::InsufficientQuota => "billing_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::PayloadTooLarge => "request_too_large",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Upstream | ErrorKind::Internal => "api_error",
            ErrorKind::Unavailable => "overloaded_error",
        }
    }

    fn gemini(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::PayloadTooLarge
            | ErrorKind::MethodNotAllowed
            | ErrorKind::UnsupportedMediaType
            | ErrorKind::Unprocessable => "INVALID_ARGUMENT",
            ErrorKind::Conflict => "ABORTED",
            ErrorKind::Authentication => "UNAUTHENTICATED",
            ErrorKind::Forbidden => "PERMISSION_DENIED",
            ErrorKind::RequestTimeout => "DEADLINE_EXCEEDED",
            ErrorKind::Internal => "INTERNAL",
            ErrorKind::InsufficientQuota | ErrorKind::RateLimited => "RESOURCE_EXHAUSTED",
            ErrorKind::NotFound => "NOT_FOUND",
            ErrorKind::Upstream | ErrorKind::Unavailable => "UNAVAILABLE",
        }
    }
}

/// The JSON error body for `kind` in `format`. `param` names the offending field where
/// there is one (OpenAI carries it in `param`; the others only in the message).
pub fn error_body(format: Format, kind: ErrorKind, message: &str, param: Option<&str>) -> Vec<u8> {
    let value = match format {
        Format::OpenAi => {
            let (ty, code) = kind.openai();
            json!({"error": {"message": message, "type": ty, "param": param, "code": code}})
        }
        Format::Anthropic => {
            json!({"type": "error", "error": {"type": kind.anthropic(), "message": message}})
        }
        Format::Gemini => {
            json!({"error": {"code": kind.status(), "message": message, "status": kind.gemini()}})
        }
    };
    serde_json::to_vec(&value).unwrap_or_default()
}

/// The in-stream error event that ends a stream which already delivered output (H2): an
/// SSE frame the caller's SDK raises as an API error, carrying the gateway request id.
/// A Responses API stream gets that API's own `error` event (`type`, `code`, `message`).
pub fn stream_error_event(format: Format, api: Api, kind: ErrorKind, message: &str, request_id: &str) -> Vec<u8> {
    let message = format!("{message} (request id {request_id})");
    match format {
        Format::OpenAi if api == Api::Responses => {
            let (kind_type, code) = kind.openai();
            let body = json!({"type": "error", "code": code.unwrap_or(kind_type), "message": message, "param": null});
            format!("event: error\ndata: {body}\n\n").into_bytes()
        }
        Format::Anthropic => {
            let body = json!({"type": "error", "error": {"type": kind.anthropic(), "message": message}});
            format!("event: error\ndata: {body}\n\n").into_bytes()
        }
        Format::OpenAi | Format::Gemini => {
            let body: serde_json::Value =
                serde_json::from_slice(&error_body(format, kind, &message, None)).unwrap_or_default();
            format!("data: {body}\n\n").into_bytes()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn parse(b: Vec<u8>) -> Value {
        serde_json::from_slice(&b).unwrap()
    }

    #[test]
    fn a3_error_vocabulary_per_format() {
        // spec: A3
        let cases = [
            (
                ErrorKind::RateLimited,
                429,
                "rate_limit_exceeded",
                "rate_limit_error",
                "RESOURCE_EXHAUSTED",
            ),
            (
                ErrorKind::InsufficientQuota,
                402,
                "insufficient_quota",
                "billing_error",
                "RESOURCE_EXHAUSTED",
            ),
            (ErrorKind::Upstream, 502, "api_error", "api_error", "UNAVAILABLE"),
            (
                ErrorKind::InvalidRequest,
                400,
                "invalid_request_error",
                "invalid_request_error",
                "INVALID_ARGUMENT",
            ),
            (
                ErrorKind::Authentication,
                401,
                "invalid_api_key",
                "authentication_error",
                "UNAUTHENTICATED",
            ),
        ];
        for (kind, status, oa, an, ge) in cases {
            assert_eq!(kind.status(), status);
            let o = parse(error_body(Format::OpenAi, kind, "m", None));
            // OpenAI puts the A3 name in `code` when it has one, else in `type`.
            let code = o["error"]["code"].as_str().or(o["error"]["type"].as_str());
            assert_eq!(code, Some(oa), "{kind:?}");
            assert_eq!(o["error"]["message"], "m");
            let a = parse(error_body(Format::Anthropic, kind, "m", None));
            assert_eq!(a["type"], "error");
            assert_eq!(a["error"]["type"], an);
            let g = parse(error_body(Format::Gemini, kind, "m", None));
            assert_eq!(g["error"]["status"], ge);
            assert_eq!(g["error"]["code"], status);
        }
    }

    #[test]
    fn openai_param_names_the_field() {
        let o = parse(error_body(
            Format::OpenAi,
            ErrorKind::InvalidRequest,
            "bad",
            Some("messages"),
        ));
        assert_eq!(o["error"]["param"], "messages");
    }

    #[test]
    fn a8_retryable_only_for_capacity_and_upstream() {
        // spec: A8
        for k in [
            ErrorKind::InvalidRequest,
            ErrorKind::Authentication,
            ErrorKind::InsufficientQuota,
            ErrorKind::PayloadTooLarge,
            ErrorKind::NotFound,
        ] {
            assert!(!k.retryable(), "{k:?}");
        }
        for k in [ErrorKind::RateLimited, ErrorKind::Upstream] {
            assert!(k.retryable(), "{k:?}");
        }
    }

    #[test]
    fn stream_error_event_is_one_sse_frame_with_request_id() {
        let e = String::from_utf8(stream_error_event(
            Format::Anthropic,
            Api::Generate,
            ErrorKind::Upstream,
            "cut",
            "req-1",
        ))
        .unwrap();
        assert!(e.starts_with("event: error\ndata: {"));
        assert!(e.ends_with("\n\n"));
        assert!(e.contains("req-1"));
        let o = String::from_utf8(stream_error_event(
            Format::OpenAi,
            Api::Generate,
            ErrorKind::Upstream,
            "cut",
            "req-2",
        ))
        .unwrap();
        assert!(o.starts_with("data: {\"error\""));
        assert!(o.contains("req-2"));
        // spec: H2
        // The Responses API's own `error` event, which its SDKs hand over as a typed event.
        let r = stream_error_event(Format::OpenAi, Api::Responses, ErrorKind::Upstream, "cut", "req-3");
        let r = String::from_utf8(r).unwrap();
        let data: serde_json::Value =
            serde_json::from_str(r.strip_prefix("event: error\ndata: ").unwrap().trim()).unwrap();
        assert_eq!(data["type"], "error");
        assert!(
            data["code"].is_string() && data["message"].as_str().unwrap().contains("req-3"),
            "{data}"
        );
    }
}
