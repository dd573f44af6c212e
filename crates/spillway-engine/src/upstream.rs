//! The upstream call: one HTTP request to the chosen channel and what it brought back
//! ([`Attempt`]), classified (E1) and contained: no redirects followed, bounded bodies and
//! stream prefixes, separate first-byte and stream-idle timeouts. It records nothing and
//! decides nothing; the attempt loop does.

use crate::clock;
use crate::failover::{Attempt, Caller, Ctx};
use crate::life::{Answer, ProviderRefusal};
use crate::routing::Admitted;
use crate::state::AppState;
use crate::stream::{ByteStream, Primed};
use bytes::{Bytes, BytesMut};
use futures_util::TryStreamExt;
use http::{HeaderValue, header};
use serde_json::Value;
use spillway_ledger::AttemptRecord;
use spillway_wire::signal::{ErrorClass, Signal, classify_parsed};
use spillway_wire::{Api, Format, RateLimitState, Usage, rate_limit_state};
use std::time::Duration;
use tokio::time::Instant;

/// Request headers a provider needs from its client; everything else stays at the gateway
/// (the client's own credentials above all).
pub(crate) const FORWARDED_HEADERS: &[&str] = &[
    "anthropic-version",
    "anthropic-beta",
    "openai-beta",
    "tracestate",
    "accept",
];

/// The query the provider gets: the client's, without empty pairs and without a Gemini
/// client's `key=` (the gateway's, not the provider's); `None` when nothing is left.
fn upstream_query(format: Format, uri: &http::Uri) -> Option<std::borrow::Cow<'_, str>> {
    let query = uri.query().unwrap_or_default();
    let dropped = |kv: &str| kv.is_empty() || (format == Format::Gemini && kv.starts_with("key="));
    if !query.split('&').any(dropped) {
        return Some(query.into());
    }
    let kept: Vec<&str> = query.split('&').filter(|kv| !dropped(kv)).collect();
    (!kept.is_empty()).then(|| kept.join("&").into())
}

fn upstream_url(base: &str, format: Format, uri: &http::Uri) -> String {
    match upstream_query(format, uri) {
        Some(query) => format!("{base}{}?{query}", uri.path()),
        None => format!("{base}{}", uri.path()),
    }
}

/// A call to `channel`: its URL built on the base parsed once when there is one
/// ([`upstream_url_on`]), else from the configured text.
pub(crate) fn request_to(
    client: &reqwest::Client,
    method: http::Method,
    channel: &crate::state::ChannelRt,
    format: Format,
    uri: &http::Uri,
) -> reqwest::RequestBuilder {
    match &channel.base {
        Some(base) => client.request(method, upstream_url_on(base, format, uri)),
        None => client.request(method, upstream_url(&channel.cfg.base_url, format, uri)),
    }
}

/// A channel's base URL parsed once, for [`upstream_url_on`]; `None` where the parsed
/// path ends in a slash past the root (`http://h/a//.` parses to `/a//`), which trimming
/// would change: such a base takes [`upstream_url`]'s way.
pub(crate) fn parsed_base(text: &str) -> Option<reqwest::Url> {
    reqwest::Url::parse(text)
        .ok()
        .filter(|u| u.path() == "/" || !u.path().ends_with('/'))
}

/// [`upstream_url`] on the channel's parsed base ([`parsed_base`]): a copy takes the
/// request's path and query, so that the scheme, host and port are not parsed again for
/// every call. The same URL as [`upstream_url`] (see the tests).
fn upstream_url_on(base: &reqwest::Url, format: Format, uri: &http::Uri) -> reqwest::Url {
    let mut url = base.clone();
    let prefix = base.path().strip_suffix('/').unwrap_or(base.path());
    let mut path = String::with_capacity(prefix.len() + uri.path().len());
    path.push_str(prefix);
    path.push_str(uri.path());
    url.set_path(&path);
    url.set_query(upstream_query(format, uri).as_deref());
    url
}

/// What a failed attempt's record says about its signal.
pub(crate) fn apply_signal(att: &mut AttemptRecord, s: &Signal) {
    att.http_status = s.http_status;
    att.error_class = s.class;
    att.provider_error_type = s.provider_error_type.clone();
    att.retry_after_ms = s.retry_after_ms;
    if s.class != ErrorClass::Success {
        att.visibility = Some(s.visibility);
    }
    // P3: a provider's auth error may quote part of the channel's key; keep none of it.
    att.message = if s.class == ErrorClass::Auth {
        None
    } else {
        // The ledger's writer bounds every stored field.
        s.message.clone()
    };
}

fn failed(mut att: AttemptRecord, signal: Signal) -> Attempt {
    apply_signal(&mut att, &signal);
    att.finished_at = Some(clock::now());
    Attempt::Failed { att, signal }
}

/// E3 windows the provider reports, no longer than the gateway believes any wait hint.
fn contain_room(mut room: RateLimitState, max_ms: u64) -> RateLimitState {
    room.reset_requests_ms = room.reset_requests_ms.map(|v| v.min(max_ms));
    room.reset_tokens_ms = room.reset_tokens_ms.map(|v| v.min(max_ms));
    room
}

/// Reads a whole body, refusing one over `max` bytes.
async fn read_capped(resp: reqwest::Response, max: u64) -> Result<Bytes, Signal> {
    if resp.content_length().is_some_and(|n| n > max) {
        return Err(too_large(max));
    }
    let mut body = BytesMut::new();
    let mut stream = resp.bytes_stream();
    loop {
        match stream.try_next().await {
            Ok(Some(chunk)) => {
                if body.len() as u64 + chunk.len() as u64 > max {
                    return Err(too_large(max));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body.freeze()),
            Err(e) => {
                return Err(Signal::transport(
                    ErrorClass::StreamInterrupted,
                    spillway_ledger::truncate(format!("reading the response body: {}", e.without_url()), 512),
                ));
            }
        }
    }
}

fn too_large(max: u64) -> Signal {
    Signal::transport(
        ErrorClass::MalformedResponse,
        format!("the answer is larger than the gateway's limit of {max} bytes (upstream.max_response_bytes)"),
    )
}

/// The real upstream: HTTP through the gateway's client.
pub struct HttpCaller;

impl Caller for HttpCaller {
    async fn call(&self, st: &AppState, ctx: &Ctx, mut att: AttemptRecord, admitted: Admitted) -> Attempt {
        let format = ctx.format;
        let channel = admitted.channel.clone();
        let ch = &channel.cfg;
        let up = &st.config.upstream;
        let started = Instant::now();
        let left = ctx.deadline.saturating_duration_since(started);
        // F3: an attempt gets its own timeout, never more than the request has left; the
        // response headers must come sooner still.
        // A job's run takes its workflow's attempt timeout, and waits for the response
        // headers as long (a whole answer comes with its headers).
        let (timeout, first_byte) = match ctx.attempt_timeout {
            Some(t) => (t.min(left), t.min(left)),
            None => {
                let t = Duration::from_millis(ch.timeout_ms.unwrap_or(st.config.attempt_timeout_ms)).min(left);
                (t, Duration::from_millis(up.first_byte_timeout_ms).min(t))
            }
        };
        let attempt_deadline = started + timeout;

        let mut rb = request_to(&st.client, http::Method::POST, &channel, format, &ctx.uri)
            .header(header::CONTENT_TYPE, "application/json")
            .header("traceparent", ctx.trace.traceparent())
            .body(ctx.body.clone());
        for name in FORWARDED_HEADERS {
            if let Some(v) = ctx.headers.get(*name) {
                rb = rb.header(*name, v.clone());
            }
        }
        if format == Format::Anthropic && !ctx.headers.contains_key("anthropic-version") {
            rb = rb.header("anthropic-version", "2023-06-01");
        }
        if let Some(key) = &ch.api_key {
            rb = match format {
                Format::OpenAi => rb.bearer_auth(key),
                Format::Anthropic => rb.header("x-api-key", key),
                Format::Gemini => rb.header("x-goog-api-key", key),
            };
        }

        let resp = match tokio::time::timeout(first_byte, rb.send()).await {
            Err(_) => {
                let s = Signal::transport(
                    ErrorClass::Timeout,
                    format!("no response headers within {} ms", first_byte.as_millis()),
                );
                return failed(att, s);
            }
            Ok(Err(e)) => {
                let class = if e.is_timeout() {
                    ErrorClass::Timeout
                } else {
                    ErrorClass::Unreachable
                };
                // Without the URL: its query is the client's own text.
                let s = Signal::transport(class, spillway_ledger::truncate(format!("{}", e.without_url()), 512));
                return failed(att, s);
            }
            Ok(Ok(r)) => r,
        };
        att.first_byte_at = Some(clock::now());
        let status = resp.status();
        let up_headers = resp.headers().clone();
        att.upstream_request_id = up_headers
            .get(format.upstream_request_id_header())
            .and_then(|v| v.to_str().ok())
            .filter(|v| v.len() <= 256)
            .map(str::to_owned);
        let lookup = |name: &str| up_headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        // E3: every answer says how much room the channel has left.
        channel.health.observe_room(
            contain_room(rate_limit_state(format, &lookup, clock::now()), up.max_wait_hint_ms),
            Instant::now(),
        );

        if status.is_success() && ctx.parsed.stream {
            let content_type = up_headers
                .get(header::CONTENT_TYPE)
                .cloned()
                .unwrap_or(HeaderValue::from_static("text/event-stream"));
            let inner: ByteStream = Box::pin(resp.bytes_stream().map_err(|e| std::io::Error::other(e.without_url())));
            let mut primed = Primed::new(
                inner,
                format,
                att,
                Some(admitted.permit),
                Duration::from_millis(up.stream_idle_timeout_ms),
                content_type,
            );
            if ctx.strip_usage {
                primed.strip_usage();
            }
            // H2: hold the stream's opening events until it shows output; a failure before
            // that is retried like any other, and the client never knows.
            if let Some(signal) = primed
                .prime(attempt_deadline, timeout, up.max_buffered_before_first_token_bytes)
                .await
            {
                return failed(primed.into_attempt(), signal);
            }
            return Attempt::Stream(Box::new(primed));
        }

        let body = match tokio::time::timeout_at(attempt_deadline, read_capped(resp, up.max_response_bytes)).await {
            Ok(Ok(b)) => b,
            Ok(Err(signal)) => return failed(att, signal),
            Err(_) => {
                let s = Signal::transport(
                    ErrorClass::Timeout,
                    format!("response body not complete within {} ms", timeout.as_millis()),
                );
                return failed(att, s);
            }
        };
        // One parse serves the classification, the usage and the id.
        let json: Option<Value> = spillway_wire::answer_json(&body);
        let signal = classify_parsed(
            format,
            status.as_u16(),
            &lookup,
            json.as_ref(),
            body.is_empty(),
            clock::now(),
        );
        match signal.class {
            ErrorClass::Success => {
                let usage = json.as_ref().map(|v| Usage::from_json(format, v)).unwrap_or_default();
                let response_id = (ctx.api == Api::Responses)
                    .then(|| json.as_ref()?.get("id")?.as_str().map(str::to_owned))
                    .flatten();
                apply_signal(&mut att, &signal);
                Attempt::Answer(Answer {
                    status,
                    content_type: up_headers
                        .get(header::CONTENT_TYPE)
                        .cloned()
                        .unwrap_or(HeaderValue::from_static("application/json")),
                    body,
                    usage,
                    response_id,
                    att,
                })
            }
            // D3: the provider's own 400/404/413/422 goes back as it came.
            ErrorClass::InvalidRequest => {
                apply_signal(&mut att, &signal);
                Attempt::Rejected(ProviderRefusal {
                    status,
                    body,
                    att,
                    signal,
                })
            }
            _ => failed(att, signal),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemini_client_key_is_not_forwarded() {
        // spec: P3
        let uri: http::Uri = "/v1beta/models/m:streamGenerateContent?key=sk-client&alt=sse"
            .parse()
            .unwrap();
        assert_eq!(
            upstream_url("http://u", Format::Gemini, &uri),
            "http://u/v1beta/models/m:streamGenerateContent?alt=sse"
        );
        let uri: http::Uri = "/v1/chat/completions?foo=1".parse().unwrap();
        assert_eq!(
            upstream_url("http://u/p", Format::OpenAi, &uri),
            "http://u/p/v1/chat/completions?foo=1"
        );
    }

    #[test]
    fn the_parsed_base_gives_the_url_the_text_gives() {
        // spec: P3
        let bases = [
            "http://u",
            "http://u/p",
            "https://api.example.com/v1beta/openai",
            "http://127.0.0.1:9/a%20b",
            "http://u/a/.",
            "http://u/a/b/..",
            "http://u/a//.",
            "http://u/a/b/../c",
        ];
        let uris = [
            "/v1/chat/completions",
            "/v1/chat/completions?foo=1",
            "/v1/chat/completions?&a=1&&b=%20x&",
            "/v1beta/models/m:streamGenerateContent?key=sk-client&alt=sse",
            "/v1beta/models/m:generateContent?key=sk-client",
            "/v1beta/models/gemini-2.5-flash:countTokens?alt=json&key=k&x=%2F",
            "/v1/a/../b/./c?q=a+b",
            "/v1/%7Euser/%2e%2e/x",
        ];
        for base in bases {
            let Some(parsed) = parsed_base(base) else {
                // Its parsed path keeps a trailing slash: the text's way is taken.
                assert!(base.ends_with('.'), "{base}");
                continue;
            };
            for uri in uris {
                let uri: http::Uri = uri.parse().unwrap();
                for format in [Format::OpenAi, Format::Anthropic, Format::Gemini] {
                    let text = reqwest::Url::parse(&upstream_url(base, format, &uri)).unwrap();
                    assert_eq!(upstream_url_on(&parsed, format, &uri), text, "{base} {uri} {format:?}");
                }
            }
        }
        let uri: http::Uri = "/v1beta/models/m:generateContent?key=sk-client".parse().unwrap();
        let url = upstream_url_on(&parsed_base("http://u").unwrap(), Format::Gemini, &uri);
        assert!(!url.as_str().contains("sk-client"), "{url}");
    }

    #[test]
    fn reported_windows_are_held_to_the_longest_believed_wait() {
        let room = RateLimitState {
            remaining_requests: Some(0),
            reset_requests_ms: Some(999_999_999_000),
            remaining_tokens: Some(5),
            reset_tokens_ms: Some(2_000),
        };
        let c = contain_room(room, 600_000);
        assert_eq!((c.reset_requests_ms, c.reset_tokens_ms), (Some(600_000), Some(2_000)));
    }
}
