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
use http::{HeaderName, HeaderValue, header};
use serde_json::Value;
use spillway_ledger::AttemptRecord;
use spillway_wire::signal::{ErrorClass, Signal, classify_parsed};
use spillway_wire::{Api, Format, RateLimitState, Usage, rate_limit_state};
use std::time::Duration;
use tokio::time::Instant;

/// Request headers a provider needs from its client; everything else stays at the gateway
/// (the client's own credentials above all).
pub(crate) const FORWARDED_HEADERS: [HeaderName; 5] = [
    HeaderName::from_static("anthropic-version"),
    HeaderName::from_static("anthropic-beta"),
    HeaderName::from_static("openai-beta"),
    HeaderName::from_static("tracestate"),
    header::ACCEPT,
];

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const ANTHROPIC_VERSION: HeaderName = HeaderName::from_static("anthropic-version");

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

/// A call to `channel` carrying `body`, with its key's header: the URL built on the base
/// parsed once when there is one ([`upstream_url_on`]), else from the configured text. An
/// error says why the call cannot be made (and quotes neither the key nor the query).
pub(crate) fn request_to(
    method: http::Method,
    channel: &crate::state::ChannelRt,
    format: Format,
    uri: &http::Uri,
    body: Bytes,
) -> Result<http::Request<crate::client::Body>, String> {
    let url = match &channel.base {
        Some(base) => upstream_url_on(base, format, uri),
        None => reqwest::Url::parse(&upstream_url(&channel.cfg.base_url, format, uri))
            .map_err(|e| format!("the channel's base_url does not make a URL with the request's path: {e}"))?,
    };
    let mut req = http::Request::new(crate::client::Body::new(body));
    *req.method_mut() = method;
    *req.uri_mut() = to_uri(url)?;
    if let Some(key) = &channel.key_header {
        let (name, value) = key.clone()?;
        req.headers_mut().insert(name, value);
    }
    Ok(req)
}

/// The URL as hyper takes it. The WHATWG serialization is always a valid URI; the error is
/// for the day it is not.
fn to_uri(url: reqwest::Url) -> Result<http::Uri, String> {
    http::Uri::try_from(String::from(url)).map_err(|e| format!("the channel's URL is not one HTTP can send: {e}"))
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

/// Reads a whole body, refusing one over `max` bytes. A body that comes in one frame (most
/// answers) is kept as it came, not copied.
async fn read_capped(resp: crate::client::Response, max: u64) -> Result<Bytes, Signal> {
    use http_body::Body as _;
    use http_body_util::BodyExt;
    let mut body = resp.into_body();
    if body.size_hint().lower() > max {
        return Err(too_large(max));
    }
    let mut first: Option<Bytes> = None;
    let mut rest = BytesMut::new();
    loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                let Ok(chunk) = frame.into_data() else { continue };
                let had = first.as_ref().map_or(0, Bytes::len) + rest.len();
                if had as u64 + chunk.len() as u64 > max {
                    return Err(too_large(max));
                }
                match &first {
                    None => first = Some(chunk),
                    Some(f) => {
                        if rest.is_empty() {
                            rest.reserve(f.len() + chunk.len());
                            rest.extend_from_slice(f);
                        }
                        rest.extend_from_slice(&chunk);
                    }
                }
            }
            None if rest.is_empty() => return Ok(first.unwrap_or_default()),
            None => return Ok(rest.freeze()),
            Some(Err(e)) => {
                return Err(Signal::transport(
                    ErrorClass::StreamInterrupted,
                    spillway_ledger::truncate(
                        format!("reading the response body: {}", crate::client::describe(&e)),
                        512,
                    ),
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

        let mut req = match request_to(http::Method::POST, &channel, format, &ctx.uri, ctx.body.clone()) {
            Ok(r) => r,
            Err(why) => return failed(att, Signal::transport(ErrorClass::Unreachable, why)),
        };
        let h = req.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Ok(v) = HeaderValue::try_from(ctx.trace.traceparent()) {
            h.insert(TRACEPARENT, v);
        }
        for name in &FORWARDED_HEADERS {
            if let Some(v) = ctx.headers.get(name) {
                h.insert(name, v.clone());
            }
        }
        if format == Format::Anthropic && !ctx.headers.contains_key("anthropic-version") {
            h.insert(ANTHROPIC_VERSION, HeaderValue::from_static("2023-06-01"));
        }

        let resp = match tokio::time::timeout(first_byte, st.upstream.send(req)).await {
            Err(_) => {
                let s = Signal::transport(
                    ErrorClass::Timeout,
                    format!("no response headers within {} ms", first_byte.as_millis()),
                );
                return failed(att, s);
            }
            Ok(Err(e)) => {
                let class = if crate::client::is_timeout(&e) {
                    ErrorClass::Timeout
                } else {
                    ErrorClass::Unreachable
                };
                let s = Signal::transport(class, spillway_ledger::truncate(crate::client::describe(&e), 512));
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
            let inner: ByteStream = Box::pin(
                http_body_util::BodyDataStream::new(resp.into_body())
                    .map_err(|e| std::io::Error::other(crate::client::describe(&e))),
            );
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
                    let url = upstream_url_on(&parsed, format, &uri);
                    assert_eq!(url, text, "{base} {uri} {format:?}");
                    // hyper is handed the same text.
                    assert_eq!(to_uri(url.clone()).unwrap().to_string(), url.as_str(), "{base} {uri}");
                }
            }
        }
        let uri: http::Uri = "/v1beta/models/m:generateContent?key=sk-client".parse().unwrap();
        let url = upstream_url_on(&parsed_base("http://u").unwrap(), Format::Gemini, &uri);
        assert!(!url.as_str().contains("sk-client"), "{url}");
    }

    fn channel(format: Format, base_url: &str, api_key: Option<&str>) -> crate::state::ChannelRt {
        crate::state::ChannelRt::new(spillway_policy::Channel {
            name: "c".into(),
            format,
            base_url: base_url.into(),
            api_key: api_key.map(str::to_owned),
            models: vec!["*".into()],
            max_concurrency: 1,
            weight: 1,
            priority: 0,
            timeout_ms: None,
            simulated: None,
            region: None,
        })
    }

    #[test]
    fn a_call_carries_the_channels_key_in_its_providers_header_and_a_bad_key_is_not_quoted() {
        // spec: P3
        let uri: http::Uri = "/v1beta/models/m:generateContent?key=sk-client&alt=sse"
            .parse()
            .unwrap();
        let ch = channel(Format::Gemini, "https://g.example/p", Some("g-key"));
        let req = request_to(http::Method::POST, &ch, Format::Gemini, &uri, Bytes::from_static(b"{}")).unwrap();
        assert_eq!(req.uri(), "https://g.example/p/v1beta/models/m:generateContent?alt=sse");
        let key = req.headers().get("x-goog-api-key").unwrap();
        assert!(key.is_sensitive());
        assert_eq!(key, "g-key");
        assert!(req.headers().get(header::AUTHORIZATION).is_none());
        // A base the parse-once path leaves alone takes the text's way, to the same URL.
        let ch = channel(Format::OpenAi, "http://u/a//.", None);
        assert!(ch.base.is_none());
        let uri: http::Uri = "/v1/chat/completions".parse().unwrap();
        let req = request_to(http::Method::POST, &ch, Format::OpenAi, &uri, Bytes::new()).unwrap();
        assert_eq!(req.uri(), "http://u/a//v1/chat/completions");
        assert!(req.headers().is_empty());
        // A key with a line break in it (a pasted file) cannot be a header: the call is
        // refused and says why, without the key.
        let ch = channel(Format::OpenAi, "http://u", Some("sk-secret-part\n"));
        let err = request_to(http::Method::POST, &ch, Format::OpenAi, &uri, Bytes::new()).unwrap_err();
        assert!(err.contains("API key"), "{err}");
        assert!(!err.contains("sk-secret"), "{err}");
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
