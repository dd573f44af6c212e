//! The stream observer: an upstream SSE stream is held until its first visible output
//! ([`Primed::prime`], H2), then passed through chunk by chunk ([`StreamBody`], H1) while a
//! copy goes through the SSE parser to note the first token, usage and in-stream errors.
//! However the stream ends — the provider finishes, breaks off or goes quiet, the client
//! goes away or stops reading, the gateway shuts down — the request's [`Life`] closes it.

use crate::clock;
use crate::life::{Life, StreamEnd};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::HeaderValue;
use serde_json::Value;
use spillway_ledger::AttemptRecord;
use spillway_wire::{
    ErrorClass, ErrorKind, Format, Signal, SseEvent, SseParser, UnixMs, Usage, classify_stream_error,
    stream_error_event,
};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::WaitForCancellationFutureOwned;

/// An upstream body as a stream of chunks.
pub type ByteStream = Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>;

/// What the parser has seen of a stream so far.
pub struct Watch {
    parser: SseParser,
    format: Format,
    pub usage: Usage,
    pub first_token_at: Option<UnixMs>,
    pub stream_error: Option<Signal>,
}

impl Watch {
    pub fn new(format: Format) -> Watch {
        Watch {
            parser: SseParser::new(),
            format,
            usage: Usage::default(),
            first_token_at: None,
            stream_error: None,
        }
    }

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
                self.first_token_at = Some(clock::now());
            }
            if let Some(v) = &json {
                self.usage.merge(Usage::from_json(self.format, v));
            }
            if let Some(e) = stream_error(&ev, json.as_ref()) {
                self.stream_error = Some(classify_stream_error(self.format, e));
            }
        }
    }
}

/// Does this stream event carry visible output (the "first token", H2)?
pub fn carries_output(format: Format, ev: &SseEvent, json: Option<&Value>) -> bool {
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

/// An upstream stream with its attempt, held until it shows output.
pub struct Primed {
    inner: ByteStream,
    /// The upstream ended while priming.
    inner_done: bool,
    /// What priming read, sent to the client before anything newer.
    prefix: VecDeque<Bytes>,
    pub watch: Watch,
    pub att: AttemptRecord,
    /// The channel slot (C1), held until the stream ends.
    permit: Option<OwnedSemaphorePermit>,
    /// After the first token: the longest quiet spell before the stream is ended.
    idle_timeout: Duration,
    pub content_type: HeaderValue,
}

impl Primed {
    pub fn new(
        inner: ByteStream,
        format: Format,
        att: AttemptRecord,
        permit: Option<OwnedSemaphorePermit>,
        idle_timeout: Duration,
        content_type: HeaderValue,
    ) -> Primed {
        Primed {
            inner,
            inner_done: false,
            prefix: VecDeque::new(),
            watch: Watch::new(format),
            att,
            permit,
            idle_timeout,
            content_type,
        }
    }

    /// Reads the stream until it shows output (H2's first token), fails, or ends, keeping
    /// what it read for the client. A failure before output comes back as the attempt's
    /// signal, to be retried: the client has seen nothing yet, not even headers. Nothing
    /// past `deadline` (`window` after the attempt began), and at most `max_bytes` held back.
    pub async fn prime(&mut self, deadline: Instant, window: Duration, max_bytes: u64) -> Option<Signal> {
        let mut held = 0u64;
        loop {
            match tokio::time::timeout_at(deadline, self.inner.next()).await {
                Err(_) => {
                    return Some(Signal::transport(
                        ErrorClass::Timeout,
                        format!("no visible output within {} ms", window.as_millis()),
                    ));
                }
                Ok(None) => {
                    // Ended without output: a complete (if empty) answer, passed on as is.
                    self.inner_done = true;
                    return None;
                }
                Ok(Some(Err(e))) => {
                    return Some(Signal::transport(
                        ErrorClass::StreamInterrupted,
                        spillway_ledger::truncate(format!("stream broke off before its first token: {e}"), 512),
                    ));
                }
                Ok(Some(Ok(chunk))) => {
                    held += chunk.len() as u64;
                    self.watch.observe(&chunk);
                    self.prefix.push_back(chunk);
                    if self.watch.first_token_at.is_some() {
                        return None;
                    }
                    if let Some(mut s) = self.watch.stream_error.take() {
                        s.http_status = Some(200);
                        return Some(s);
                    }
                    if held > max_bytes {
                        // A provider that streams this much without a visible token is
                        // misbehaving; holding more would let it fill the gateway's memory.
                        return Some(Signal::transport(
                            ErrorClass::MalformedResponse,
                            format!("the stream sent over {max_bytes} bytes without visible output"),
                        ));
                    }
                }
            }
        }
    }

    /// The attempt's record, for a stream that failed while priming.
    pub fn into_attempt(self) -> AttemptRecord {
        self.att
    }

    fn error_event(&self, request_id: &str, message: &str) -> Bytes {
        Bytes::from(stream_error_event(
            self.watch.format,
            ErrorKind::Upstream,
            message,
            request_id,
        ))
    }
}

/// The response body of a primed stream: passes it through and closes its request when
/// it ends, however it ends.
pub struct StreamBody {
    primed: Primed,
    life: Life,
    /// Fires when the upstream sends nothing for `idle_timeout`.
    idle: Pin<Box<tokio::time::Sleep>>,
    /// The gateway's shutdown past its drain deadline.
    cancel: Pin<Box<WaitForCancellationFutureOwned>>,
    finished: bool,
}

impl StreamBody {
    pub fn new(primed: Primed, life: Life) -> StreamBody {
        let idle = Box::pin(tokio::time::sleep(primed.idle_timeout));
        let cancel = Box::pin(life.st().shutdown.cancel.clone().cancelled_owned());
        StreamBody {
            primed,
            life,
            idle,
            cancel,
            finished: false,
        }
    }

    fn finish(&mut self, end: StreamEnd) {
        self.finished = true;
        // The channel slot goes back before anything else (C1).
        self.primed.permit.take();
        self.life.close_stream(end, &mut self.primed);
    }

    fn end_with_error(&mut self, end: StreamEnd, message: &str) -> Poll<Option<std::io::Result<Bytes>>> {
        let ev = self.primed.error_event(&self.life.rec.id, message);
        self.finish(end);
        Poll::Ready(Some(Ok(ev)))
    }
}

impl Stream for StreamBody {
    type Item = std::io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(chunk) = self.primed.prefix.pop_front() {
            return Poll::Ready(Some(Ok(chunk)));
        }
        if self.finished {
            return Poll::Ready(None);
        }
        if self.cancel.as_mut().poll(cx).is_ready() {
            return self.end_with_error(StreamEnd::Interrupted, "The gateway is shutting down");
        }
        if self.primed.inner_done {
            self.finish(StreamEnd::Complete);
            return Poll::Ready(None);
        }
        match self.primed.inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                let deadline = Instant::now() + self.primed.idle_timeout;
                self.idle.as_mut().reset(deadline);
                self.primed.watch.observe(&chunk);
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => {
                let msg = spillway_ledger::truncate(format!("upstream stream broke off: {e}"), 512);
                self.end_with_error(
                    StreamEnd::Broken(ErrorClass::StreamInterrupted, msg),
                    "The upstream stream broke off",
                )
            }
            Poll::Ready(None) => {
                self.finish(StreamEnd::Complete);
                Poll::Ready(None)
            }
            Poll::Pending => match self.idle.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    let ms = self.primed.idle_timeout.as_millis();
                    self.end_with_error(
                        StreamEnd::Broken(ErrorClass::Timeout, format!("upstream sent nothing for {ms} ms")),
                        &format!("The upstream stream stalled for {ms} ms"),
                    )
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl Drop for StreamBody {
    fn drop(&mut self) {
        if !self.finished {
            let end = if self.life.st().shutdown.cancel.is_cancelled() {
                StreamEnd::Interrupted
            } else {
                StreamEnd::ClientGone
            };
            self.finish(end);
        }
    }
}
