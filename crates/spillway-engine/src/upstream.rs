//! The upstream attempt: the call to the chosen channel, the classification of its
//! outcome (E1), the response to the client (pass-through, streaming event by event, H1)
//! and the ledger records that close the request.

use crate::error::GatewayError;
use crate::failover::Job;
use crate::ingress::now_ms;
use crate::limits::KeySlot;
use crate::routing::Admitted;
use crate::state::AppState;
use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use futures_util::Stream;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::Value;
use spillway_ledger::{AttemptRecord, RequestRecord, RequestState};
use spillway_wire::signal::{ErrorClass, Signal, Visibility, classify_parsed};
use spillway_wire::{
    ErrorKind, Format, SseEvent, SseParser, Usage, classify_stream_error, rate_limit_state, stream_error_event,
};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};
use tokio::sync::OwnedSemaphorePermit;

/// Request headers a provider needs from its client; everything else stays at the gateway
/// (the client's own credentials above all).
const FORWARDED_HEADERS: &[&str] = &[
    "anthropic-version",
    "anthropic-beta",
    "openai-beta",
    "tracestate",
    "accept",
];
/// Longest provider error message kept in the ledger.
const MAX_MESSAGE: usize = 512;

pub(crate) fn truncate(s: String) -> String {
    if s.len() <= MAX_MESSAGE {
        return s;
    }
    let mut end = MAX_MESSAGE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn upstream_url(base: &str, format: Format, uri: &http::Uri) -> String {
    let query: Vec<&str> = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|kv| !kv.is_empty())
        // The client's Gemini key (`?key=`) is the gateway's, not the provider's.
        .filter(|kv| !(format == Format::Gemini && kv.starts_with("key=")))
        .collect();
    if query.is_empty() {
        format!("{base}{}", uri.path())
    } else {
        format!("{base}{}?{}", uri.path(), query.join("&"))
    }
}

/// The A7 headers, on success and on failures after admission alike.
pub(crate) fn gateway_headers(h: &mut HeaderMap, rec: &RequestRecord) {
    let mut set = |name: &'static str, v: &str| {
        if let Ok(v) = HeaderValue::from_str(v) {
            h.insert(name, v);
        }
    };
    set("x-spillway-attempts", &rec.attempts.to_string());
    if let Some(m) = &rec.served_model {
        set("x-spillway-served-model", m);
    }
    if let Some(r) = &rec.route {
        set("x-spillway-route", r);
    }
    if let Some(c) = &rec.channel {
        set("x-spillway-channel", c);
    }
    if let Some(q) = rec.queued_ms {
        set("x-spillway-queued-ms", &q.to_string());
    }
    if let Some(u) = &rec.upstream_request_id {
        set("x-spillway-upstream-request-id", u);
    }
}

/// What the client sees for a failed attempt, and the ledger's message for it.
pub(crate) fn client_error(signal: &Signal, channel: &str) -> GatewayError {
    let (kind, message) = match signal.class {
        ErrorClass::RateLimit => (
            ErrorKind::RateLimited,
            format!("Upstream channel `{channel}` is rate limiting this model. Retry after the indicated delay."),
        ),
        ErrorClass::Overload => (
            ErrorKind::RateLimited,
            format!("Upstream channel `{channel}` is overloaded. Retry shortly."),
        ),
        ErrorClass::Quota => (
            ErrorKind::Upstream,
            format!("Upstream channel `{channel}` has run out of provider quota or billing credit."),
        ),
        ErrorClass::Auth => (
            ErrorKind::Upstream,
            format!(
                "Upstream channel `{channel}` rejected the gateway's provider credential; an operator must fix the channel."
            ),
        ),
        ErrorClass::Timeout => (
            ErrorKind::Upstream,
            format!(
                "Upstream channel `{channel}` timed out ({}).",
                signal.message.as_deref().unwrap_or("no answer in time")
            ),
        ),
        ErrorClass::Unreachable => (
            ErrorKind::Upstream,
            format!("Upstream channel `{channel}` is unreachable."),
        ),
        ErrorClass::MalformedResponse => (
            ErrorKind::Upstream,
            format!("Upstream channel `{channel}` returned a malformed response."),
        ),
        ErrorClass::StreamInterrupted => (
            ErrorKind::Upstream,
            format!("Upstream channel `{channel}` broke off the stream before any output."),
        ),
        _ => (
            ErrorKind::Upstream,
            match signal.http_status {
                Some(s) => format!("Upstream channel `{channel}` failed with HTTP {s}."),
                None => format!("Upstream channel `{channel}` failed."),
            },
        ),
    };
    GatewayError::Upstream {
        kind,
        message,
        retry_after_ms: signal.retry_after_ms,
        futile: false,
    }
}

pub(crate) fn attempt_record(rec: &RequestRecord, channel: &str, started_at: i64) -> AttemptRecord {
    AttemptRecord {
        request_id: rec.id.clone(),
        attempt_no: rec.attempts,
        channel: channel.to_owned(),
        upstream_request_id: None,
        http_status: None,
        error_class: ErrorClass::Unknown.as_str().to_owned(),
        provider_error_type: None,
        retry_after_ms: None,
        message: None,
        started_at,
        first_byte_at: None,
        finished_at: None,
        input_tokens: None,
        output_tokens: None,
        decision: None,
        decision_reason: None,
        delay_ms: None,
        ready_at: None,
        visibility: None,
    }
}

pub(crate) fn apply_signal(att: &mut AttemptRecord, s: &Signal) {
    att.http_status = s.http_status;
    att.error_class = s.class.as_str().to_owned();
    att.provider_error_type = s.provider_error_type.clone();
    att.retry_after_ms = s.retry_after_ms;
    if s.class != ErrorClass::Success {
        att.visibility = Some(s.visibility.as_str().to_owned());
    }
    // P3: a provider's auth error may quote part of the channel's key; keep none of it.
    att.message = if s.class == ErrorClass::Auth {
        None
    } else {
        s.message.clone().map(truncate)
    };
}

fn apply_usage(rec: &mut RequestRecord, att: &mut AttemptRecord, u: &Usage) {
    rec.input_tokens = u.input_tokens;
    rec.output_tokens = u.output_tokens;
    rec.cached_input_tokens = u.cached_input_tokens;
    rec.reasoning_tokens = u.reasoning_tokens;
    att.input_tokens = u.input_tokens;
    att.output_tokens = u.output_tokens;
}

/// Closes an admitted request: live figures, then the ledger.
pub(crate) async fn record(st: &AppState, rec: RequestRecord, att: AttemptRecord) {
    st.metrics.finished(&rec, true, rec.finished_at.unwrap_or_else(now_ms));
    let ledger = &st.ledger;
    if let Err(e) = ledger.put_attempt(att).await {
        tracing::error!(error = %e, "could not record an attempt");
    }
    if let Err(e) = ledger.put_request(rec).await {
        tracing::error!(error = %e, "could not record a request");
    }
}

/// How one attempt ended.
pub enum Outcome {
    /// The client gets this answer as it is: a success, a stream that showed output, or
    /// the provider's own 400/404/413/422 (D3). The ledger records are taken care of.
    Answer(Response),
    /// The attempt failed before the client saw anything; the attempt loop decides.
    Failed {
        rec: Box<RequestRecord>,
        att: Box<AttemptRecord>,
        signal: Signal,
    },
}

fn failed(rec: RequestRecord, mut att: AttemptRecord, signal: Signal) -> Outcome {
    apply_signal(&mut att, &signal);
    att.finished_at = Some(now_ms());
    Outcome::Failed {
        rec: Box::new(rec),
        att: Box::new(att),
        signal,
    }
}

/// One upstream call on the admitted channel. `rec.attempts` already counts it.
pub async fn attempt(job: &mut Job, mut rec: RequestRecord, admitted: Admitted) -> Outcome {
    let st = job.st.clone();
    let format = job.format;
    let channel = admitted.channel.clone();
    let ch = &channel.cfg;
    let left = job.deadline.saturating_duration_since(tokio::time::Instant::now());
    // F3: an attempt gets its own timeout, never more than the request has left.
    let timeout = Duration::from_millis(ch.timeout_ms.unwrap_or(st.config.attempt_timeout_ms)).min(left);
    let timeout_ms = timeout.as_millis() as u64;

    let mut rb = st
        .client
        .post(upstream_url(&ch.base_url, format, &job.parts.uri))
        .header(header::CONTENT_TYPE, "application/json")
        .header("traceparent", job.trace.traceparent())
        .body(job.body.clone());
    for name in FORWARDED_HEADERS {
        if let Some(v) = job.parts.headers.get(*name) {
            rb = rb.header(*name, v.clone());
        }
    }
    if format == Format::Anthropic && !job.parts.headers.contains_key("anthropic-version") {
        rb = rb.header("anthropic-version", "2023-06-01");
    }
    if let Some(key) = &ch.api_key {
        rb = match format {
            Format::OpenAi => rb.bearer_auth(key),
            Format::Anthropic => rb.header("x-api-key", key),
            Format::Gemini => rb.header("x-goog-api-key", key),
        };
    }

    let started_at = now_ms();
    let mut att = attempt_record(&rec, &ch.name, started_at);
    let resp = match tokio::time::timeout(timeout, rb.send()).await {
        Err(_) => {
            let s = Signal::transport(
                ErrorClass::Timeout,
                format!("no response headers within {timeout_ms} ms"),
            );
            return failed(rec, att, s);
        }
        Ok(Err(e)) => {
            let class = if e.is_timeout() {
                ErrorClass::Timeout
            } else {
                ErrorClass::Unreachable
            };
            // reqwest's message names the URL, which holds no secret; keep the cause chain short.
            let s = Signal::transport(class, truncate(format!("{e}")));
            return failed(rec, att, s);
        }
        Ok(Ok(r)) => r,
    };
    att.first_byte_at = Some(now_ms());
    let status = resp.status();
    let up_headers = resp.headers().clone();
    let upstream_request_id = up_headers
        .get(format.upstream_request_id_header())
        .and_then(|v| v.to_str().ok())
        .filter(|v| v.len() <= 256)
        .map(str::to_owned);
    att.upstream_request_id = upstream_request_id.clone();
    rec.upstream_request_id = upstream_request_id;
    let lookup = |name: &str| up_headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    // E3: every answer says how much room the channel has left.
    channel.health.observe_room(
        rate_limit_state(format, &lookup, SystemTime::now()),
        tokio::time::Instant::now(),
    );

    if status.is_success() && job.parsed.stream {
        let content_type = up_headers
            .get(header::CONTENT_TYPE)
            .cloned()
            .unwrap_or(HeaderValue::from_static("text/event-stream"));
        let mut observed = Observed {
            inner: Box::pin(resp.bytes_stream()),
            inner_done: false,
            prefix: VecDeque::new(),
            parser: SseParser::new(),
            usage: Usage::default(),
            format,
            first_token_at: None,
            stream_error: None,
            rec: Some(rec),
            att: Some(att),
            st: st.clone(),
            permit: Some(admitted.permit),
            key_slot: None,
            idle: Box::pin(tokio::time::sleep(timeout)),
            idle_timeout: timeout,
            finished: false,
        };
        // H2: hold the stream's opening events until it shows output; a failure before
        // that is retried like any other, and the client never knows.
        if let Some(signal) = observed.prime().await {
            let (rec, att) = observed.disarm();
            return failed(rec, att, signal);
        }
        observed.key_slot = job.key_slot.take();
        let mut out = Response::new(Body::empty());
        *out.status_mut() = StatusCode::OK;
        let h = out.headers_mut();
        h.insert(header::CONTENT_TYPE, content_type);
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        h.insert("x-accel-buffering", HeaderValue::from_static("no"));
        if let Some(rec) = &observed.rec {
            gateway_headers(h, rec);
        }
        *out.body_mut() = Body::from_stream(observed);
        return Outcome::Answer(out);
    }

    let body = match tokio::time::timeout(timeout, resp.bytes()).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            let s = Signal::transport(
                ErrorClass::StreamInterrupted,
                truncate(format!("reading the response body: {e}")),
            );
            return failed(rec, att, s);
        }
        Err(_) => {
            let s = Signal::transport(
                ErrorClass::Timeout,
                format!("response body not complete within {timeout_ms} ms"),
            );
            return failed(rec, att, s);
        }
    };
    // One parse serves both the classification and the usage.
    let json: Option<Value> = serde_json::from_slice(&body).ok();
    let signal = classify_parsed(
        format,
        status.as_u16(),
        &lookup,
        json.as_ref(),
        body.is_empty(),
        SystemTime::now(),
    );
    match signal.class {
        ErrorClass::Success => {
            let usage = json.as_ref().map(|v| Usage::from_json(format, v)).unwrap_or_default();
            apply_usage(&mut rec, &mut att, &usage);
            apply_signal(&mut att, &signal);
            let now = now_ms();
            att.finished_at = Some(now);
            att.decision = Some("done".into());
            rec.first_token_at = att.first_byte_at;
            rec.finished_at = Some(now);
            rec.state = RequestState::Done;
            rec.http_status = Some(status.as_u16());
            rec.next_ready_at = None;
            let mut out = Response::new(Body::from(body));
            *out.status_mut() = status;
            let h = out.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                up_headers
                    .get(header::CONTENT_TYPE)
                    .cloned()
                    .unwrap_or(HeaderValue::from_static("application/json")),
            );
            gateway_headers(h, &rec);
            record(&st, rec, att).await;
            Outcome::Answer(out)
        }
        ErrorClass::InvalidRequest => {
            // D3: the provider's own 400/404/413/422 goes back as it came; retrying cannot help.
            apply_signal(&mut att, &signal);
            let now = now_ms();
            att.finished_at = Some(now);
            att.decision = Some("passed_through".into());
            att.decision_reason = Some(crate::retry::Stop::NotRetryable.as_str().into());
            let message = signal.message.clone().map(truncate).unwrap_or_default();
            rec.fail(Some(status.as_u16()), signal.class.as_str(), message, now);
            let mut out = Response::new(Body::from(body));
            *out.status_mut() = status;
            let h = out.headers_mut();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            h.insert("x-should-retry", HeaderValue::from_static("false"));
            gateway_headers(h, &rec);
            record(&st, rec, att).await;
            Outcome::Answer(out)
        }
        _ => failed(rec, att, signal),
    }
}

/// Does this stream event carry visible output (the "first token", H2)?
fn carries_output(format: Format, ev: &SseEvent, json: Option<&Value>) -> bool {
    match format {
        // A tool call is visible output from its start (H3), text from its first delta.
        Format::Anthropic => match ev.event.as_deref() {
            Some("content_block_delta") => true,
            Some("content_block_start") => json
                .and_then(|v| v.pointer("/content_block/type"))
                .and_then(Value::as_str)
                .is_some_and(|t| t != "text" && t != "thinking"),
            _ => false,
        },
        Format::OpenAi => json.and_then(|v| v.pointer("/choices/0/delta")).is_some_and(|d| {
            d.get("content").and_then(Value::as_str).is_some_and(|s| !s.is_empty())
                || d.get("tool_calls").is_some_and(|t| !t.is_null())
                || d.get("refusal").and_then(Value::as_str).is_some_and(|s| !s.is_empty())
        }),
        Format::Gemini => json
            .and_then(|v| v.pointer("/candidates/0/content/parts"))
            .and_then(Value::as_array)
            .is_some_and(|p| !p.is_empty()),
    }
}

/// An in-stream error the provider sent as an event (Anthropic `event: error`, an
/// OpenAI/Gemini data line with an `error` object): the error object.
fn stream_error<'a>(ev: &SseEvent, json: Option<&'a Value>) -> Option<&'a Value> {
    let err = json?.get("error")?;
    if ev.event.as_deref().is_some_and(|e| e != "error") {
        return None;
    }
    Some(err)
}

/// The upstream stream, passed through chunk by chunk while a copy goes through the SSE
/// parser to note the first token, usage and errors. When the stream ends — normally, by
/// an upstream failure, or because the client went away (drop) — it closes the request in
/// the ledger and frees the channel slot.
struct Observed {
    inner: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    /// The upstream ended while priming.
    inner_done: bool,
    /// What priming read, sent to the client before anything newer.
    prefix: VecDeque<Bytes>,
    parser: SseParser,
    usage: Usage,
    format: Format,
    first_token_at: Option<i64>,
    stream_error: Option<Signal>,
    rec: Option<RequestRecord>,
    att: Option<AttemptRecord>,
    st: Arc<AppState>,
    permit: Option<OwnedSemaphorePermit>,
    /// The key's concurrency slot (B1), held as long as the stream runs.
    key_slot: Option<KeySlot>,
    /// Fires when the upstream sends nothing for `idle_timeout`.
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_timeout: Duration,
    finished: bool,
}

enum End {
    Complete,
    Broken(ErrorClass, String),
    ClientGone,
}

impl Observed {
    fn observe(&mut self, chunk: &[u8]) {
        for ev in self.parser.push(chunk) {
            if ev.data == "[DONE]" || ev.data.is_empty() {
                continue;
            }
            let looks_relevant = self.first_token_at.is_none()
                || ev.data.contains("usage")
                || ev.data.contains("\"error\"")
                || ev.event.as_deref() == Some("error");
            if !looks_relevant {
                continue;
            }
            let json: Option<Value> = serde_json::from_str(&ev.data).ok();
            if self.first_token_at.is_none() && carries_output(self.format, &ev, json.as_ref()) {
                self.first_token_at = Some(now_ms());
            }
            if let Some(v) = &json {
                self.usage.merge(Usage::from_json(self.format, v));
            }
            if let Some(e) = stream_error(&ev, json.as_ref()) {
                self.stream_error = Some(classify_stream_error(self.format, e));
            }
        }
    }

    /// Reads the stream until it shows output (H2's first token), fails, or ends, keeping
    /// what it read for the client. A failure before output comes back as the attempt's
    /// signal, to be retried: the client has seen nothing yet, not even headers.
    async fn prime(&mut self) -> Option<Signal> {
        use futures_util::StreamExt;
        let limit = self.idle_timeout;
        let deadline = tokio::time::Instant::now() + limit;
        let ms = limit.as_millis();
        loop {
            match tokio::time::timeout_at(deadline, self.inner.next()).await {
                Err(_) => {
                    return Some(Signal::transport(
                        ErrorClass::Timeout,
                        format!("no visible output within {ms} ms"),
                    ));
                }
                Ok(None) => {
                    // Ended without output: a complete (if empty) answer, passed on as is.
                    self.inner_done = true;
                    break;
                }
                Ok(Some(Err(e))) => {
                    return Some(Signal::transport(
                        ErrorClass::StreamInterrupted,
                        truncate(format!("stream broke off before its first token: {e}")),
                    ));
                }
                Ok(Some(Ok(chunk))) => {
                    self.observe(&chunk);
                    self.prefix.push_back(chunk);
                    if self.first_token_at.is_some() {
                        break;
                    }
                    if let Some(mut s) = self.stream_error.take() {
                        s.http_status = Some(200);
                        return Some(s);
                    }
                }
            }
        }
        let idle = tokio::time::Instant::now() + self.idle_timeout;
        self.idle.as_mut().reset(idle);
        None
    }

    /// Takes the records back from a stream that failed while priming; dropping it then
    /// records nothing.
    fn disarm(mut self) -> (RequestRecord, AttemptRecord) {
        self.finished = true;
        let rec = self.rec.take().expect("primed streams hold their records");
        let att = self.att.take().expect("primed streams hold their records");
        (rec, att)
    }

    fn finish(&mut self, end: End) {
        self.finished = true;
        self.permit.take();
        let (Some(mut rec), Some(mut att)) = (self.rec.take(), self.att.take()) else {
            return;
        };
        let now = now_ms();
        apply_usage(&mut rec, &mut att, &self.usage);
        rec.first_token_at = self.first_token_at;
        rec.finished_at = Some(now);
        att.finished_at = Some(now);
        att.http_status = Some(200);
        // The failure's class name (as the ledger spells it) and message.
        let failure: Option<(&str, String)> = match end {
            End::Complete => self.stream_error.take().map(|s| {
                (
                    s.class.as_str(),
                    format!(
                        "provider sent an error event: {}",
                        s.message
                            .as_deref()
                            .or(s.provider_error_type.as_deref())
                            .unwrap_or("error")
                    ),
                )
            }),
            End::Broken(class, m) => Some((class.as_str(), m)),
            End::ClientGone => Some((
                GatewayError::ClientGone.class(),
                "client disconnected before the stream ended".to_owned(),
            )),
        };
        match failure {
            None => {
                rec.state = RequestState::Done;
                rec.http_status = Some(200);
                rec.next_ready_at = None;
                att.error_class = ErrorClass::Success.as_str().to_owned();
                att.decision = Some("done".into());
            }
            Some((class, message)) => {
                let message = truncate(message);
                rec.fail(Some(200), class, message.clone(), now);
                // H2: output the client already saw is committed; it is never replayed.
                rec.partial_output_committed = self.first_token_at.is_some();
                att.error_class = class.to_owned();
                att.message = Some(message);
                att.visibility = Some(
                    if rec.partial_output_committed {
                        Visibility::AfterPartialOutput
                    } else {
                        Visibility::BeforeFirstToken
                    }
                    .as_str()
                    .to_owned(),
                );
                // F2's first rule: once output is visible the request fails closed.
                att.decision = Some("fail_closed".into());
                if rec.partial_output_committed {
                    att.decision_reason = Some(crate::retry::Stop::PartialOutputCommitted.as_str().into());
                }
            }
        }
        self.key_slot.take();
        // Queued synchronously, before the stream reports its end: a graceful shutdown that
        // waits for this connection and then flushes the ledger cannot miss it.
        self.st.metrics.finished(&rec, true, now);
        self.st.ledger.enqueue_attempt(att);
        self.st.ledger.enqueue_request(rec);
    }

    fn error_event(&self, message: &str) -> Bytes {
        let id = self.rec.as_ref().map(|r| r.id.as_str()).unwrap_or_default();
        Bytes::from(stream_error_event(self.format, ErrorKind::Upstream, message, id))
    }
}

impl Stream for Observed {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(chunk) = self.prefix.pop_front() {
            return Poll::Ready(Some(Ok(chunk)));
        }
        if self.finished {
            return Poll::Ready(None);
        }
        if self.inner_done {
            self.finish(End::Complete);
            return Poll::Ready(None);
        }
        match self.inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                let deadline = tokio::time::Instant::now() + self.idle_timeout;
                self.idle.as_mut().reset(deadline);
                self.observe(&chunk);
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => {
                let msg = format!("upstream stream broke off: {e}");
                let ev = self.error_event("The upstream stream broke off");
                self.finish(End::Broken(ErrorClass::StreamInterrupted, msg));
                Poll::Ready(Some(Ok(ev)))
            }
            Poll::Ready(None) => {
                self.finish(End::Complete);
                Poll::Ready(None)
            }
            Poll::Pending => match self.idle.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    let ms = self.idle_timeout.as_millis();
                    let ev = self.error_event(&format!("The upstream stream stalled for {ms} ms"));
                    self.finish(End::Broken(
                        ErrorClass::Timeout,
                        format!("upstream sent nothing for {ms} ms"),
                    ));
                    Poll::Ready(Some(Ok(ev)))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl Drop for Observed {
    fn drop(&mut self) {
        if !self.finished {
            self.finish(End::ClientGone);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(event: Option<&str>, data: &str) -> (SseEvent, Option<Value>) {
        (
            SseEvent {
                event: event.map(str::to_owned),
                data: data.to_owned(),
            },
            serde_json::from_str(data).ok(),
        )
    }

    #[test]
    fn h2_first_token_per_format() {
        // spec: H2, H3
        let cases = [
            (
                Format::OpenAi,
                None,
                r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
                false,
            ),
            (
                Format::OpenAi,
                None,
                r#"{"choices":[{"delta":{"content":"Hi"}}]}"#,
                true,
            ),
            (
                Format::OpenAi,
                None,
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#,
                true,
            ),
            (
                Format::OpenAi,
                None,
                r#"{"choices":[],"usage":{"prompt_tokens":1}}"#,
                false,
            ),
            (
                Format::Anthropic,
                Some("message_start"),
                r#"{"type":"message_start"}"#,
                false,
            ),
            (
                Format::Anthropic,
                Some("content_block_start"),
                r#"{"content_block":{"type":"text","text":""}}"#,
                false,
            ),
            (
                Format::Anthropic,
                Some("content_block_start"),
                r#"{"content_block":{"type":"tool_use","name":"x"}}"#,
                true,
            ),
            (
                Format::Anthropic,
                Some("content_block_delta"),
                r#"{"delta":{"type":"text_delta","text":"Hi"}}"#,
                true,
            ),
            (
                Format::Gemini,
                None,
                r#"{"candidates":[{"content":{"parts":[{"text":"Hi"}]}}]}"#,
                true,
            ),
            (
                Format::Gemini,
                None,
                r#"{"usageMetadata":{"promptTokenCount":3}}"#,
                false,
            ),
        ];
        for (format, event, data, expected) in cases {
            let (e, j) = ev(event, data);
            assert_eq!(carries_output(format, &e, j.as_ref()), expected, "{format} {data}");
        }
    }

    #[test]
    fn in_stream_errors_are_noticed() {
        let (e, j) = ev(
            Some("error"),
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        );
        let msg = |v: Option<&Value>| {
            v.and_then(|e| e.get("message"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        assert_eq!(msg(stream_error(&e, j.as_ref())).as_deref(), Some("Overloaded"));
        let (e, j) = ev(None, r#"{"error":{"message":"boom"}}"#);
        assert_eq!(msg(stream_error(&e, j.as_ref())).as_deref(), Some("boom"));
        let (e, j) = ev(Some("content_block_delta"), r#"{"error":"not an error event"}"#);
        assert_eq!(stream_error(&e, j.as_ref()), None);
    }

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
}
