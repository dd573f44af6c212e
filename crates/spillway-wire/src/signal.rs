//! The normalised signal an upstream outcome becomes (E1), and its class (E2). Pure
//! functions over status, headers and body: the engine's retry and health decisions read
//! only this, never a provider's raw shapes.

use crate::Format;
use crate::time::UnixMs;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

/// The E2 class of an outcome, which decides what happens next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// 2xx: nothing went wrong.
    Success,
    /// 429 pacing: requests or tokens per minute.
    RateLimit,
    /// Quota, billing, spend or daily limit: not transient on this channel.
    Quota,
    /// 503, Anthropic 529 `overloaded_error`.
    Overload,
    /// 500, 502, 504 and other 5xx.
    ServerError,
    /// 408, 409, 425: the provider asks to try again.
    Transient,
    /// The attempt ran out of time.
    Timeout,
    /// Connection refused, reset, DNS: no answer from the channel.
    Unreachable,
    /// 401/403 on a channel: its credential is wrong.
    Auth,
    /// 400, 404, 413, 422: the request itself is wrong.
    InvalidRequest,
    /// The stream broke off (before or after its first token).
    StreamInterrupted,
    /// A 2xx whose body is not the provider's shape.
    MalformedResponse,
    /// Anything else: never retried blindly.
    Unknown,
}

impl ErrorClass {
    pub const ALL: [ErrorClass; 13] = [
        ErrorClass::Success,
        ErrorClass::RateLimit,
        ErrorClass::Quota,
        ErrorClass::Overload,
        ErrorClass::ServerError,
        ErrorClass::Transient,
        ErrorClass::Timeout,
        ErrorClass::Unreachable,
        ErrorClass::Auth,
        ErrorClass::InvalidRequest,
        ErrorClass::StreamInterrupted,
        ErrorClass::MalformedResponse,
        ErrorClass::Unknown,
    ];

    /// The class [`ErrorClass::as_str`] spells `s`.
    pub fn parse(s: &str) -> Option<ErrorClass> {
        ErrorClass::ALL.into_iter().find(|c| c.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Success => "success",
            ErrorClass::RateLimit => "rate_limit",
            ErrorClass::Quota => "quota",
            ErrorClass::Overload => "overload",
            ErrorClass::ServerError => "server_error",
            ErrorClass::Transient => "transient",
            ErrorClass::Timeout => "timeout",
            ErrorClass::Unreachable => "unreachable",
            ErrorClass::Auth => "auth",
            ErrorClass::InvalidRequest => "invalid_request",
            ErrorClass::StreamInterrupted => "stream_interrupted",
            ErrorClass::MalformedResponse => "malformed_response",
            ErrorClass::Unknown => "unknown",
        }
    }
}

/// Which limit a rate or quota signal is about (E1 `limit_dimension`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitDimension {
    Requests,
    InputTokens,
    OutputTokens,
    Tokens,
    RequestsPerDay,
    Spend,
}

/// Where the failure sits relative to what the client has already seen (E1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(rename_all = "snake_case")]
pub enum Visibility {
    /// The client has seen nothing of this attempt: it may be retried unseen.
    BeforeFirstToken,
    /// The client has seen output: the request is bound to its channel (H2).
    AfterPartialOutput,
    /// Background work: nobody is watching the output as it comes.
    BackgroundOnly,
}

impl Visibility {
    pub fn parse(s: &str) -> Option<Visibility> {
        [
            Visibility::BeforeFirstToken,
            Visibility::AfterPartialOutput,
            Visibility::BackgroundOnly,
        ]
        .into_iter()
        .find(|v| v.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Visibility::BeforeFirstToken => "before_first_token",
            Visibility::AfterPartialOutput => "after_partial_output",
            Visibility::BackgroundOnly => "background_only",
        }
    }
}

/// One upstream outcome, normalised (E1). `route_key` is added by the engine, which knows
/// the route; everything here comes from the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signal {
    pub class: ErrorClass,
    pub http_status: Option<u16>,
    pub provider_error_type: Option<String>,
    pub message: Option<String>,
    pub retry_after_ms: Option<u64>,
    pub limit_dimension: Option<LimitDimension>,
    pub visibility: Visibility,
}

impl Signal {
    pub fn transport(class: ErrorClass, message: impl Into<String>) -> Signal {
        Signal {
            class,
            http_status: None,
            provider_error_type: None,
            message: Some(message.into()),
            retry_after_ms: None,
            limit_dimension: None,
            visibility: Visibility::BeforeFirstToken,
        }
    }
}

/// `Retry-After` as delta-seconds or an HTTP date (RFC 9110), in milliseconds from `now`.
/// A date in the past means "now" (0).
pub fn parse_retry_after(value: &str, now: UnixMs) -> Option<u64> {
    let v = value.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(secs.saturating_mul(1000));
    }
    if let Ok(secs) = v.parse::<f64>()
        && secs.is_finite()
        && secs >= 0.0
    {
        return Some((secs * 1000.0) as u64);
    }
    let at = UnixMs::from_system(httpdate::parse_http_date(v).ok()?);
    Some(at.since(now))
}

/// A Go-style duration as OpenAI sends in `x-ratelimit-reset-*` (`12ms`, `6s`, `6m0s`,
/// `1h2m3.5s`), in milliseconds.
pub fn parse_go_duration(s: &str) -> Option<u64> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        if num_end == 0 {
            return None;
        }
        let n: f64 = rest[..num_end].parse().ok()?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let factor = match &rest[..unit_end] {
            "ms" => 1.0,
            "s" => 1000.0,
            "m" => 60_000.0,
            "h" => 3_600_000.0,
            "us" | "µs" => 0.001,
            "ns" => 0.000_001,
            _ => return None,
        };
        total += n * factor;
        rest = &rest[unit_end..];
    }
    Some(total.ceil() as u64)
}

fn reset_in_ms(format: Format, value: &str, now: UnixMs) -> Option<u64> {
    match format {
        Format::OpenAi => parse_go_duration(value),
        Format::Anthropic => UnixMs::parse_rfc3339(value).map(|t| t.since(now)),
        Format::Gemini => None,
    }
}

fn header_num(h: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<u64> {
    h(name)?.trim().parse().ok()
}

/// Classifies an HTTP answer from a channel. `header` looks a response header up by its
/// lower-case name.
pub fn classify_response(
    format: Format,
    status: u16,
    header: &dyn Fn(&str) -> Option<String>,
    body: &[u8],
    now: UnixMs,
) -> Signal {
    let json = answer_json(body);
    classify_parsed(format, status, header, json.as_ref(), body.is_empty(), now)
}

/// The top-level members of a provider's JSON answer that the gateway reads: the error
/// ([`classify_parsed`]), the usage ([`Usage::from_json`]: `usage`, `usageMetadata`, and
/// the `response` and `message` that stream events nest it in) and the Responses API's
/// `id`. The rest is checked but never built.
///
/// [`Usage::from_json`]: crate::Usage::from_json
#[derive(Deserialize)]
struct Skim<'a> {
    #[serde(borrow, default, deserialize_with = "member")]
    error: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "member")]
    usage: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "member", rename = "usageMetadata")]
    usage_metadata: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "member")]
    response: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "member")]
    message: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "member")]
    id: Option<&'a RawValue>,
}

/// A member as written, `null` included (an `Option` alone would read `null` as absent,
/// where the whole parse keeps it).
fn member<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// A whole answer's body as [`classify_parsed`] and [`Usage::from_json`] read it: `None`
/// when it is not JSON, else an object holding only the members they read (see
/// `Skim`). Parsing the whole body into a [`Value`] built every choice, message and
/// string of the answer only to drop it: about 3 % of the gateway's CPU per request, more
/// for long answers.
///
/// Whatever the skim cannot vouch for as the full parse would (a body that is not an
/// object, a repeated member, bytes that are not UTF-8) is parsed in full instead, so
/// the two agree on every body but one kind: JSON whose unread members hold a number
/// past `f64`, a lone UTF-16 surrogate escape or nesting deeper than serde_json builds
/// (128; skipping is a loop, not recursion). The full parse refused those; they are
/// valid JSON (RFC 8259), and an answer is not malformed for a member the gateway never
/// reads.
///
/// [`Usage::from_json`]: crate::Usage::from_json
pub fn answer_json(body: &[u8]) -> Option<Value> {
    let object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    if object
        && let Ok(text) = std::str::from_utf8(body)
        && let Ok(skim) = serde_json::from_str::<Skim<'_>>(text)
    {
        let mut out = serde_json::Map::new();
        for (name, raw) in [
            ("error", skim.error),
            ("usage", skim.usage),
            ("usageMetadata", skim.usage_metadata),
            ("response", skim.response),
            ("message", skim.message),
            ("id", skim.id),
        ] {
            if let Some(raw) = raw {
                out.insert(name.to_owned(), serde_json::from_str(raw.get()).ok()?);
            }
        }
        return Some(Value::Object(out));
    }
    serde_json::from_slice(body).ok()
}

/// [`classify_response`] for a body the caller has parsed already (its usage is read from
/// the same parse): `json` is `None` when the body is not JSON, `empty` when there was none.
pub fn classify_parsed(
    format: Format,
    status: u16,
    header: &dyn Fn(&str) -> Option<String>,
    json: Option<&Value>,
    empty: bool,
    now: UnixMs,
) -> Signal {
    let err = json.and_then(|v| v.get("error"));
    let provider_error_type = err
        .and_then(|e| match format {
            // OpenAI's `code` is the precise one (`insufficient_quota`), `type` the family.
            Format::OpenAi => e
                .get("code")
                .and_then(Value::as_str)
                .or_else(|| e.get("type").and_then(Value::as_str)),
            Format::Anthropic => e.get("type").and_then(Value::as_str),
            Format::Gemini => e.get("status").and_then(Value::as_str),
        })
        .map(str::to_owned);
    let message = err
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .map(str::to_owned);

    // Wait hint: retry-after-ms, retry-after, then the provider's own reset hints.
    let mut retry_after_ms = header("retry-after-ms")
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| v as u64)
        .or_else(|| header("retry-after").and_then(|v| parse_retry_after(&v, now)));

    let mut limit_dimension = None;
    let (remaining, reset_prefix) = match format {
        Format::OpenAi => ("x-ratelimit-remaining-", "x-ratelimit-reset-"),
        Format::Anthropic => ("anthropic-ratelimit-", "anthropic-ratelimit-"),
        Format::Gemini => ("", ""),
    };
    if status == 429 && format != Format::Gemini {
        let dims: &[(&str, LimitDimension)] = match format {
            Format::OpenAi => &[
                ("requests", LimitDimension::Requests),
                ("tokens", LimitDimension::Tokens),
            ],
            _ => &[
                ("requests", LimitDimension::Requests),
                ("input-tokens", LimitDimension::InputTokens),
                ("output-tokens", LimitDimension::OutputTokens),
                ("tokens", LimitDimension::Tokens),
            ],
        };
        for (name, dim) in dims {
            let (rem, reset) = match format {
                Format::OpenAi => (format!("{remaining}{name}"), format!("{reset_prefix}{name}")),
                _ => (
                    format!("{remaining}{name}-remaining"),
                    format!("{reset_prefix}{name}-reset"),
                ),
            };
            if header_num(header, &rem) == Some(0) {
                limit_dimension.get_or_insert(*dim);
                if retry_after_ms.is_none() {
                    retry_after_ms = header(&reset).and_then(|v| reset_in_ms(format, &v, now));
                }
            }
        }
    }

    let pte = provider_error_type.as_deref();
    let mut class = match status {
        200..=299 => {
            if json.is_none() && !empty {
                ErrorClass::MalformedResponse
            } else {
                ErrorClass::Success
            }
        }
        402 => ErrorClass::Quota,
        429 => ErrorClass::RateLimit,
        503 | 529 => ErrorClass::Overload,
        500..=599 => ErrorClass::ServerError,
        401 | 403 => ErrorClass::Auth,
        400 | 404 | 413 | 422 => ErrorClass::InvalidRequest,
        408 => ErrorClass::Timeout,
        409 | 425 => ErrorClass::Transient,
        _ => ErrorClass::Unknown,
    };
    match pte {
        Some("insufficient_quota") | Some("billing_error") => class = ErrorClass::Quota,
        Some("overloaded_error") => class = ErrorClass::Overload,
        _ => {}
    }
    if class == ErrorClass::Quota {
        limit_dimension = Some(LimitDimension::Spend);
    }

    if format == Format::Gemini
        && let Some(details) = err.and_then(|e| e.get("details")).and_then(Value::as_array)
    {
        for d in details {
            let ty = d.get("@type").and_then(Value::as_str).unwrap_or_default();
            if ty.ends_with("google.rpc.RetryInfo") {
                if let Some(delay) = d.get("retryDelay").and_then(Value::as_str) {
                    retry_after_ms = retry_after_ms.or_else(|| parse_go_duration(delay));
                }
            } else if ty.ends_with("google.rpc.ErrorInfo") {
                // Gemini refuses a bad key with 400 INVALID_ARGUMENT, not 401: the reason
                // tells that it is the channel's credential, not the client's request.
                let reason = d.get("reason").and_then(Value::as_str).unwrap_or_default();
                if reason.starts_with("API_KEY_") || reason == "CONSUMER_SUSPENDED" {
                    class = ErrorClass::Auth;
                }
            } else if ty.ends_with("google.rpc.QuotaFailure") {
                for v in d.get("violations").and_then(Value::as_array).into_iter().flatten() {
                    let id = v
                        .get("quotaId")
                        .or_else(|| v.get("quotaMetric"))
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    if id.contains("PerDay") {
                        // A per-day quota clears only at the daily reset: quota, not pacing.
                        class = ErrorClass::Quota;
                        limit_dimension = Some(LimitDimension::RequestsPerDay);
                    } else if limit_dimension.is_none() {
                        limit_dimension = Some(if id.to_ascii_lowercase().contains("token") {
                            LimitDimension::Tokens
                        } else {
                            LimitDimension::Requests
                        });
                    }
                }
            }
        }
    }

    Signal {
        class,
        http_status: Some(status),
        provider_error_type,
        message,
        retry_after_ms,
        limit_dimension,
        visibility: Visibility::BeforeFirstToken,
    }
}

/// What a channel's rate-limit headers say is left (E3). Read from every answer, success
/// or not; each field is absent when the provider did not send it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLimitState {
    pub remaining_requests: Option<u64>,
    /// Milliseconds until the request window resets.
    pub reset_requests_ms: Option<u64>,
    pub remaining_tokens: Option<u64>,
    /// Milliseconds until the token window resets.
    pub reset_tokens_ms: Option<u64>,
}

impl RateLimitState {
    pub fn is_empty(&self) -> bool {
        *self == RateLimitState::default()
    }
}

/// Reads OpenAI's `x-ratelimit-{remaining,reset}-{requests,tokens}` (Go durations) or
/// Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{remaining,reset}`
/// (RFC 3339). Gemini sends none. For Anthropic the tightest token dimension counts: the
/// request needs room in all of them.
pub fn rate_limit_state(format: Format, header: &dyn Fn(&str) -> Option<String>, now: UnixMs) -> RateLimitState {
    match format {
        Format::OpenAi => RateLimitState {
            remaining_requests: header_num(header, "x-ratelimit-remaining-requests"),
            reset_requests_ms: header("x-ratelimit-reset-requests").and_then(|v| parse_go_duration(&v)),
            remaining_tokens: header_num(header, "x-ratelimit-remaining-tokens"),
            reset_tokens_ms: header("x-ratelimit-reset-tokens").and_then(|v| parse_go_duration(&v)),
        },
        Format::Anthropic => {
            let reset = |name: &str| header(name).and_then(|v| reset_in_ms(format, &v, now));
            let mut tokens: Option<(u64, Option<u64>)> = None;
            for dim in ["tokens", "input-tokens", "output-tokens"] {
                if let Some(rem) = header_num(header, &format!("anthropic-ratelimit-{dim}-remaining"))
                    && tokens.is_none_or(|(r, _)| rem < r)
                {
                    tokens = Some((rem, reset(&format!("anthropic-ratelimit-{dim}-reset"))));
                }
            }
            RateLimitState {
                remaining_requests: header_num(header, "anthropic-ratelimit-requests-remaining"),
                reset_requests_ms: reset("anthropic-ratelimit-requests-reset"),
                remaining_tokens: tokens.map(|t| t.0),
                reset_tokens_ms: tokens.and_then(|t| t.1),
            }
        }
        Format::Gemini => RateLimitState::default(),
    }
}

/// Classifies an error the provider sent inside a stream (Anthropic `event: error`, an
/// OpenAI or Gemini data line with an `error` object) by its type, as if it had come as
/// the HTTP status that type stands for.
pub fn classify_stream_error(format: Format, error: &Value) -> Signal {
    let ty = match format {
        Format::OpenAi => error
            .get("code")
            .and_then(Value::as_str)
            .or_else(|| error.get("type").and_then(Value::as_str)),
        Format::Anthropic => error.get("type").and_then(Value::as_str),
        Format::Gemini => error.get("status").and_then(Value::as_str),
    };
    let class = match ty {
        Some("overloaded_error") | Some("UNAVAILABLE") => ErrorClass::Overload,
        Some("rate_limit_error") | Some("rate_limit_exceeded") => ErrorClass::RateLimit,
        Some("insufficient_quota") | Some("billing_error") => ErrorClass::Quota,
        Some("api_error") | Some("server_error") | Some("INTERNAL") => ErrorClass::ServerError,
        Some("RESOURCE_EXHAUSTED") => ErrorClass::RateLimit,
        Some("DEADLINE_EXCEEDED") | Some("timeout") => ErrorClass::Timeout,
        Some("invalid_request_error") | Some("INVALID_ARGUMENT") => ErrorClass::InvalidRequest,
        Some("authentication_error") | Some("permission_error") | Some("UNAUTHENTICATED") => ErrorClass::Auth,
        _ => ErrorClass::Unknown,
    };
    Signal {
        class,
        http_status: None,
        provider_error_type: ty.map(str::to_owned),
        message: error.get("message").and_then(Value::as_str).map(str::to_owned),
        retry_after_ms: None,
        limit_dimension: None,
        visibility: Visibility::BeforeFirstToken,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e1_the_skimmed_answer_reads_as_the_whole_parse() {
        // spec: E1
        let bodies: Vec<&[u8]> = vec![
            br#"{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Hi \u00e9 \ud83d\ude00"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":4},"completion_tokens_details":{"reasoning_tokens":1}}}"#,
            br#"{"id":"resp_1","object":"response","output":[{"type":"message","content":[{"type":"output_text","text":"x"}]}],"usage":{"input_tokens":9,"output_tokens":2,"input_tokens_details":{"cached_tokens":0}}}"#,
            br#"{"type":"response.completed","response":{"id":"resp_2","usage":{"input_tokens":5,"output_tokens":6}}}"#,
            br#"{"object":"list","data":[{"embedding":[0.1,-2e-3,3]}],"usage":{"prompt_tokens":4,"total_tokens":4}}"#,
            br#"{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"hello"}],"stop_reason":"end_turn","usage":{"input_tokens":20,"output_tokens":4,"cache_read_input_tokens":10,"cache_creation_input_tokens":2}}"#,
            br#"{"type":"message_start","message":{"id":"msg_2","usage":{"input_tokens":7,"output_tokens":1}}}"#,
            br#"{"candidates":[{"content":{"parts":[{"text":"hi"}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":3,"thoughtsTokenCount":2,"cachedContentTokenCount":1}}"#,
            br#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#,
            br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#,
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
            br#"{"error":{"code":429,"message":"Quota exceeded","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"7s"}]}}"#,
            br#"{"error":null,"usage":null,"id":null}"#,
            br#"{"usage":"12","id":7,"error":"boom"}"#,
            br#"  {"usage":{"prompt_tokens":1}} "#,
            br#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}"#,
            br#"{"id":"a","ID":"b","Usage":{"prompt_tokens":3}}"#,
            br#"{}"#,
            br#"[{"usage":{"prompt_tokens":1}}]"#,
            br#"null"#,
            br#"42"#,
            br#""text""#,
            b"",
            b"   ",
            br#"{"usage":{"prompt_tokens":1}"#,
            br#"{"usage":{"prompt_tokens":1}} trailing"#,
            br#"{"choices":[1,2,]}"#,
            br#"{"choices":"unterminated}"#,
            br#"<html><body>502 Bad Gateway</body></html>"#,
            b"{\"choices\":\"\xff\xfe\",\"usage\":{\"prompt_tokens\":1}}",
            b"\xef\xbb\xbf{\"usage\":{\"prompt_tokens\":1}}",
            br#"{"choices":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],"usage":{"prompt_tokens":1}}"#,
        ];
        let look = headers(&[("retry-after", "3")]);
        for body in bodies {
            let whole: Option<Value> = serde_json::from_slice(body).ok();
            let skimmed = answer_json(body);
            let shown = String::from_utf8_lossy(body);
            assert_eq!(skimmed.is_some(), whole.is_some(), "{shown}");
            for format in [Format::OpenAi, Format::Anthropic, Format::Gemini] {
                for status in [200, 400, 402, 429, 500, 503, 529] {
                    assert_eq!(
                        classify_parsed(format, status, &look, skimmed.as_ref(), body.is_empty(), now()),
                        classify_parsed(format, status, &look, whole.as_ref(), body.is_empty(), now()),
                        "{shown} {format:?} {status}"
                    );
                }
                if let (Some(s), Some(w)) = (&skimmed, &whole) {
                    assert_eq!(
                        crate::Usage::from_json(format, s),
                        crate::Usage::from_json(format, w),
                        "{shown}"
                    );
                    assert_eq!(s.get("id"), w.get("id"), "{shown}");
                }
            }
        }
        // The one leniency: members the gateway never reads may hold what serde_json
        // will not build, and the answer is still an answer.
        let deep = format!(
            r#"{{"choices":{}1{},"usage":{{"prompt_tokens":5}}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        for body in [
            br#"{"choices":[{"logprob":1e400}],"usage":{"prompt_tokens":5}}"#.as_slice(),
            br#"{"choices":[{"content":"\ud800"}],"usage":{"prompt_tokens":5}}"#.as_slice(),
            deep.as_bytes(),
        ] {
            assert!(serde_json::from_slice::<Value>(body).is_err());
            let v = answer_json(body).expect("valid JSON");
            assert_eq!(crate::Usage::from_json(Format::OpenAi, &v).input_tokens, Some(5));
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let v: Vec<(String, String)> = pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        move |n: &str| v.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone())
    }

    fn now() -> UnixMs {
        UnixMs(1_780_000_000_000)
    }

    fn http_date(t: UnixMs) -> String {
        httpdate::fmt_http_date(t.to_system())
    }

    #[test]
    fn e1_retry_after_seconds_and_http_date() {
        // spec: E1
        assert_eq!(parse_retry_after("7", now()), Some(7000));
        assert_eq!(parse_retry_after("1.5", now()), Some(1500));
        let date = http_date(UnixMs(now().0 + 30_000));
        assert_eq!(parse_retry_after(&date, now()), Some(30_000));
        let past = http_date(UnixMs(now().0 - 30_000));
        assert_eq!(parse_retry_after(&past, now()), Some(0));
        assert_eq!(parse_retry_after("soon", now()), None);
        assert_eq!(parse_retry_after("-3", now()), None);
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("12ms"), Some(12));
        assert_eq!(parse_go_duration("6s"), Some(6000));
        assert_eq!(parse_go_duration("6m0s"), Some(360_000));
        assert_eq!(parse_go_duration("1h2m3.5s"), Some(3_723_500));
        assert_eq!(parse_go_duration("30s"), Some(30_000));
        assert_eq!(parse_go_duration("x"), None);
        assert_eq!(parse_go_duration(""), None);
    }

    #[test]
    fn e2_classes_per_provider() {
        // spec: E2
        let none = headers(&[]);
        let c = |f, s, b: &str| classify_response(f, s, &none, b.as_bytes(), now()).class;
        assert_eq!(c(Format::OpenAi, 200, r#"{"id":"x"}"#), ErrorClass::Success);
        assert_eq!(c(Format::OpenAi, 200, "{oops"), ErrorClass::MalformedResponse);
        assert_eq!(
            c(
                Format::OpenAi,
                429,
                r#"{"error":{"code":"rate_limit_exceeded","type":"requests"}}"#
            ),
            ErrorClass::RateLimit
        );
        assert_eq!(
            c(
                Format::OpenAi,
                429,
                r#"{"error":{"code":"insufficient_quota","type":"insufficient_quota"}}"#
            ),
            ErrorClass::Quota
        );
        assert_eq!(
            c(
                Format::Anthropic,
                529,
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
            ),
            ErrorClass::Overload
        );
        assert_eq!(
            c(
                Format::Anthropic,
                400,
                r#"{"type":"error","error":{"type":"billing_error","message":"b"}}"#
            ),
            ErrorClass::Quota
        );
        assert_eq!(c(Format::Anthropic, 401, "{}"), ErrorClass::Auth);
        assert_eq!(c(Format::Gemini, 403, "{}"), ErrorClass::Auth);
        for s in [500, 502, 504] {
            assert_eq!(c(Format::OpenAi, s, ""), ErrorClass::ServerError);
        }
        assert_eq!(c(Format::OpenAi, 503, ""), ErrorClass::Overload);
        for s in [400, 404, 413, 422] {
            assert_eq!(c(Format::Gemini, s, ""), ErrorClass::InvalidRequest);
        }
        assert_eq!(c(Format::OpenAi, 408, ""), ErrorClass::Timeout);
        assert_eq!(c(Format::OpenAi, 409, ""), ErrorClass::Transient);
        assert_eq!(c(Format::OpenAi, 418, ""), ErrorClass::Unknown);
    }

    #[test]
    fn e1_gemini_quota_vs_pacing() {
        // spec: E1
        let none = headers(&[]);
        let pacing = r#"{"error":{"code":429,"message":"slow down","status":"RESOURCE_EXHAUSTED","details":[
            {"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaId":"GenerateRequestsPerMinutePerProjectPerModel"}]},
            {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"30s"}]}}"#;
        let s = classify_response(Format::Gemini, 429, &none, pacing.as_bytes(), now());
        assert_eq!(s.class, ErrorClass::RateLimit);
        assert_eq!(s.retry_after_ms, Some(30_000));
        assert_eq!(s.limit_dimension, Some(LimitDimension::Requests));
        assert_eq!(s.provider_error_type.as_deref(), Some("RESOURCE_EXHAUSTED"));
        let daily = r#"{"error":{"code":429,"message":"quota","status":"RESOURCE_EXHAUSTED","details":[
            {"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier"}]}]}}"#;
        let s = classify_response(Format::Gemini, 429, &none, daily.as_bytes(), now());
        assert_eq!(s.class, ErrorClass::Quota);
        assert_eq!(s.limit_dimension, Some(LimitDimension::RequestsPerDay));
    }

    #[test]
    fn e2_gemini_bad_key_is_auth_not_invalid_request() {
        // spec: E2
        let body = r#"{"error":{"code":400,"message":"API key not valid. Please pass a valid API key.","status":"INVALID_ARGUMENT",
            "details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"API_KEY_INVALID","domain":"googleapis.com"}]}}"#;
        let s = classify_response(Format::Gemini, 400, &headers(&[]), body.as_bytes(), now());
        assert_eq!(s.class, ErrorClass::Auth);
        let other = r#"{"error":{"code":400,"message":"bad field","status":"INVALID_ARGUMENT",
            "details":[{"@type":"type.googleapis.com/google.rpc.BadRequest"}]}}"#;
        let s = classify_response(Format::Gemini, 400, &headers(&[]), other.as_bytes(), now());
        assert_eq!(s.class, ErrorClass::InvalidRequest);
    }

    #[test]
    fn e1_wait_hints_from_headers() {
        // spec: E1
        let h = headers(&[
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "6m0s"),
            ("x-ratelimit-remaining-requests", "10"),
        ]);
        let s = classify_response(
            Format::OpenAi,
            429,
            &h,
            br#"{"error":{"code":"rate_limit_exceeded"}}"#,
            now(),
        );
        assert_eq!(s.limit_dimension, Some(LimitDimension::Tokens));
        assert_eq!(s.retry_after_ms, Some(360_000));
        let h = headers(&[
            ("retry-after", "3"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "20s"),
        ]);
        let s = classify_response(Format::OpenAi, 429, &h, b"{}", now());
        assert_eq!(s.retry_after_ms, Some(3000), "retry-after wins over reset hints");
        let reset = "2026-05-28T20:27:10Z"; // now + 30 s
        let h = headers(&[
            ("anthropic-ratelimit-output-tokens-remaining", "0"),
            ("anthropic-ratelimit-output-tokens-reset", reset),
        ]);
        let s = classify_response(Format::Anthropic, 429, &h, b"{}", now());
        assert_eq!(s.limit_dimension, Some(LimitDimension::OutputTokens));
        assert_eq!(s.retry_after_ms, Some(30_000));
        let h = headers(&[("retry-after-ms", "250")]);
        assert_eq!(
            classify_response(Format::Anthropic, 529, &h, b"", now()).retry_after_ms,
            Some(250)
        );
    }

    #[test]
    fn classification_never_panics() {
        let h = headers(&[
            ("retry-after", "\u{0}\u{ffff}"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "9999999999999999999h"),
        ]);
        for f in Format::ALL {
            for status in [0u16, 100, 200, 299, 402, 429, 503, 529, 999] {
                for body in [
                    "",
                    "{",
                    "null",
                    r#"{"error":5}"#,
                    r#"{"error":{"details":[1,{"@type":5}]}}"#,
                ] {
                    let _ = classify_response(f, status, &h, body.as_bytes(), now());
                }
            }
        }
    }

    #[test]
    fn e3_rate_limit_state_per_provider() {
        // spec: E3
        let h = headers(&[
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-remaining-tokens", "1200"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        assert_eq!(
            rate_limit_state(Format::OpenAi, &h, now()),
            RateLimitState {
                remaining_requests: Some(59),
                reset_requests_ms: Some(1000),
                remaining_tokens: Some(1200),
                reset_tokens_ms: Some(360_000),
            }
        );
        let h = headers(&[
            ("anthropic-ratelimit-requests-remaining", "4"),
            ("anthropic-ratelimit-requests-reset", "2026-05-28T20:26:50Z"),
            ("anthropic-ratelimit-tokens-remaining", "900"),
            ("anthropic-ratelimit-tokens-reset", "2026-05-28T20:27:40Z"),
            ("anthropic-ratelimit-output-tokens-remaining", "300"),
            ("anthropic-ratelimit-output-tokens-reset", "2026-05-28T20:27:10Z"),
        ]);
        let s = rate_limit_state(Format::Anthropic, &h, now());
        assert_eq!(s.remaining_requests, Some(4));
        assert_eq!(s.reset_requests_ms, Some(10_000));
        assert_eq!(
            (s.remaining_tokens, s.reset_tokens_ms),
            (Some(300), Some(30_000)),
            "tightest dimension"
        );
        assert!(rate_limit_state(Format::Gemini, &h, now()).is_empty());
        assert!(rate_limit_state(Format::OpenAi, &headers(&[]), now()).is_empty());
    }

    #[test]
    fn e2_in_stream_errors_by_type() {
        // spec: E2, H2
        let c = |f, v: &str| classify_stream_error(f, &serde_json::from_str(v).unwrap()).class;
        assert_eq!(
            c(
                Format::Anthropic,
                r#"{"type":"overloaded_error","message":"Overloaded"}"#
            ),
            ErrorClass::Overload
        );
        assert_eq!(c(Format::Anthropic, r#"{"type":"api_error"}"#), ErrorClass::ServerError);
        assert_eq!(
            c(Format::OpenAi, r#"{"code":"rate_limit_exceeded"}"#),
            ErrorClass::RateLimit
        );
        assert_eq!(c(Format::OpenAi, r#"{"type":"server_error"}"#), ErrorClass::ServerError);
        assert_eq!(c(Format::Gemini, r#"{"status":"UNAVAILABLE"}"#), ErrorClass::Overload);
        assert_eq!(c(Format::Gemini, r#"{"status":"SOMETHING_NEW"}"#), ErrorClass::Unknown);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            // E1: no status, header value or body may panic the classifier, and what comes
            // out is internally consistent.
            #[test]
            fn classify_never_panics(
                fi in 0usize..3,
                status in any::<u16>(),
                retry_after in proptest::option::of(".{0,40}"),
                remaining in proptest::option::of("[0-9a-z]{0,25}"),
                reset in proptest::option::of(".{0,30}"),
                body in proptest::collection::vec(any::<u8>(), 0..300),
            ) {
                let f = Format::ALL[fi];
                let h = move |n: &str| match n {
                    "retry-after" => retry_after.clone(),
                    n if n.contains("remaining") => remaining.clone(),
                    n if n.contains("reset") => reset.clone(),
                    _ => None,
                };
                let s = classify_response(f, status, &h, &body, now());
                prop_assert_eq!(s.http_status, Some(status));
                if (200..300).contains(&status) {
                    prop_assert!(matches!(s.class, ErrorClass::Success | ErrorClass::MalformedResponse));
                }
                let _ = rate_limit_state(f, &h, now());
            }

            #[test]
            fn error_shaped_bodies_never_panic(
                fi in 0usize..3,
                status in 400u16..600,
                ty in "[a-zA-Z_]{0,24}",
                quota in "[A-Za-z-]{0,40}",
                delay in "[0-9a-z.]{0,8}",
            ) {
                let f = Format::ALL[fi];
                let body = serde_json::json!({"type": "error", "error": {"type": ty, "code": ty, "status": ty,
                    "message": "m", "details": [
                        {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [{"quotaId": quota}]},
                        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}]}});
                let s = classify_response(f, status, &|_| None, body.to_string().as_bytes(), now());
                prop_assert!(s.class != ErrorClass::Success);
                let _ = classify_stream_error(f, &body["error"]);
            }

            #[test]
            fn retry_after_never_panics(v in ".{0,64}") {
                let _ = parse_retry_after(&v, now());
                let _ = parse_go_duration(&v);
                let _ = UnixMs::parse_rfc3339(&v);
            }
        }
    }
}
