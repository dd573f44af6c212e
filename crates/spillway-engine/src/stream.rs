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
    Api, ErrorClass, ErrorKind, Format, Signal, SseEvent, SseParser, UnixMs, Usage, classify_stream_error,
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
    /// The Responses API's id of the response being streamed.
    pub response_id: Option<String>,
    /// M2: bytes of output text seen, to bill a stream cut before its usage came.
    pub text_bytes: u64,
    /// The provider's own end of the stream was seen (`[DONE]`, `message_stop`,
    /// `response.completed`, a Gemini finish reason): a client that hangs up after it has
    /// its whole answer.
    pub finished: bool,
}

impl Watch {
    pub fn new(format: Format) -> Watch {
        Watch {
            parser: SseParser::new(),
            format,
            usage: Usage::default(),
            first_token_at: None,
            stream_error: None,
            response_id: None,
            text_bytes: 0,
            finished: false,
        }
    }

    fn observe(&mut self, chunk: &[u8]) {
        let over = self.parser.over_limit();
        let events = self.parser.push(chunk);
        if !over && self.parser.over_limit() {
            // Once a stream: the bytes still reach the client; only what the event said
            // (output text, usage, an error) goes unseen by the gateway.
            tracing::warn!(
                limit_mib = spillway_wire::MAX_EVENT_BYTES >> 20,
                "a stream event from the provider was over the limit and was not read"
            );
        }
        for ev in events {
            if ev.data == "[DONE]" {
                self.finished = true;
                continue;
            }
            if ev.data.is_empty() {
                continue;
            }
            if ev.event.as_deref() == Some("message_stop")
                || ev.data.contains("\"finishReason\"")
                || ev.data.contains("\"type\":\"response.completed\"")
            {
                self.finished = true;
            }
            // The Responses API repeats the whole text in its `.done` events: only deltas
            // are new text.
            if !ev.data.contains("\"type\":\"response.") || ev.data.contains(".delta\"") {
                self.text_bytes += text_len(&ev.data) as u64;
            }
            // A chunk that names usage without giving it (`"usage":null`, on every chunk of
            // an OpenAI stream that asked for it) is not worth parsing.
            let looks_relevant = self.first_token_at.is_none()
                || ev.data.contains("\"usage\":{")
                || ev.data.contains("\"usage\": {")
                || ev.data.contains("usageMetadata")
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
                // The Responses API names the stored response in its first event.
                if self.response_id.is_none() && v.get("type").and_then(Value::as_str) == Some("response.created") {
                    self.response_id = v.pointer("/response/id").and_then(Value::as_str).map(str::to_owned);
                }
            }
            if let Some(e) = stream_error(&ev, json.as_ref()) {
                self.stream_error = Some(classify_stream_error(self.format, e));
            }
        }
    }
}

/// The length of the output text an event carries (the first `"content"`, `"text"` or
/// `"delta"` string), found without parsing the event: every event of every stream
/// passes here.
fn text_len(data: &str) -> usize {
    const KEYS: [&str; 3] = ["\"content\":", "\"text\":", "\"delta\":"];
    // Gemini writes `"text": "..."`, OpenAI and Anthropic `"text":"..."`.
    let start = KEYS
        .iter()
        .filter_map(|k| {
            let after = memchr::memmem::find(data.as_bytes(), k.as_bytes())? + k.len();
            let rest = &data[after..];
            let value = rest.len() - rest.trim_start().len();
            rest[value..].starts_with('"').then_some(after + value + 1)
        })
        .min();
    let Some(start) = start else {
        return 0;
    };
    let bytes = &data.as_bytes()[start..];
    let mut i = 0;
    let mut n = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => break,
            // An escape is one character of text (`\n`, `\"`, `\u00e9`).
            b'\\' => i += if bytes.get(i + 1) == Some(&b'u') { 6 } else { 2 },
            _ => i += 1,
        }
        n += 1;
    }
    n
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
        // The Responses API: text or a refusal as it comes, a tool call from its start.
        Format::OpenAi if json.and_then(|v| v.get("type")).is_some() => {
            let v = json.unwrap_or(&Value::Null);
            match v.get("type").and_then(Value::as_str).unwrap_or_default() {
                "response.output_text.delta" | "response.refusal.delta" => {
                    v.get("delta").and_then(Value::as_str).is_some_and(|d| !d.is_empty())
                }
                "response.output_item.added" => v
                    .pointer("/item/type")
                    .and_then(Value::as_str)
                    .is_some_and(|t| t != "message" && t != "reasoning"),
                _ => false,
            }
        }
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
    let json = json?;
    // The Responses API: an `error` event is the error itself; a failed response nests it.
    match json.get("type").and_then(Value::as_str) {
        Some("error") if json.get("error").is_none() => return Some(json),
        Some("response.failed") => return json.pointer("/response/error").filter(|e| e.is_object()),
        _ => {}
    }
    let err = json.get("error")?;
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
    /// M2: takes out the usage chunk the gateway asked for and the client did not.
    strip: Option<UsageStrip>,
}

/// Takes the usage-only chunk (`"choices":[]` with `usage`) out of an OpenAI chat stream.
/// Events pass through whole: a chunk ending inside an event holds its tail until the
/// event is complete (the client could not have used half an event anyway).
#[derive(Default)]
struct UsageStrip {
    pending: Vec<u8>,
}

impl UsageStrip {
    fn is_usage_only(event: &[u8]) -> bool {
        let Ok(text) = std::str::from_utf8(event) else {
            return false;
        };
        if !text.contains("\"choices\":[]") {
            return false;
        }
        let data: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim_start)
            .collect::<Vec<_>>()
            .join("\n");
        serde_json::from_str::<Value>(&data).is_ok_and(|v| {
            v.get("choices").and_then(Value::as_array).is_some_and(Vec::is_empty)
                && v.get("usage").is_some_and(Value::is_object)
        })
    }

    /// What of `chunk` goes to the client now.
    fn push(&mut self, chunk: Bytes) -> Bytes {
        let ends_whole = chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n");
        // With usage asked for, OpenAI puts `"usage":null` on every chunk: only a chunk
        // with an empty choices list can be the usage chunk.
        if self.pending.is_empty() && ends_whole && memchr::memmem::find(&chunk, b"\"choices\":[]").is_none() {
            return chunk;
        }
        self.pending.extend_from_slice(&chunk);
        // The end of the last complete event.
        let cut = find_last_boundary(&self.pending);
        let Some(cut) = cut else { return Bytes::new() };
        let rest = self.pending.split_off(cut);
        let whole = std::mem::replace(&mut self.pending, rest);
        let mut out = Vec::with_capacity(whole.len());
        let mut start = 0;
        while start < whole.len() {
            let end = next_boundary(&whole[start..]).map_or(whole.len(), |e| start + e);
            let event = &whole[start..end];
            if !Self::is_usage_only(event) {
                out.extend_from_slice(event);
            }
            start = end;
        }
        Bytes::from(out)
    }

    /// What is left when the upstream ends.
    fn finish(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.pending))
    }
}

/// The end (exclusive) of the first event in `b`: just past its blank line.
///
/// One pass over the line feeds, stopping at the first blank line of either kind: a
/// search for each kind apart would run to the end of `b` for the kind a stream does not
/// use, once per event, and a chunk of many events would cost their count times its size.
fn next_boundary(b: &[u8]) -> Option<usize> {
    memchr::memchr_iter(b'\n', b).find_map(|p| {
        if b.get(p + 1) == Some(&b'\n') {
            Some(p + 2)
        } else if p > 0 && b[p - 1] == b'\r' && b.get(p + 1..p + 3) == Some(b"\r\n") {
            Some(p + 3)
        } else {
            None
        }
    })
}

/// The end (exclusive) of the last complete event in `b`.
fn find_last_boundary(b: &[u8]) -> Option<usize> {
    let lf = memchr::memmem::rfind(b, b"\n\n").map(|i| i + 2);
    let crlf = memchr::memmem::rfind(b, b"\r\n\r\n").map(|i| i + 4);
    lf.max(crlf)
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
            strip: None,
        }
    }

    /// M2: the usage chunk the gateway asked for is not the client's.
    pub fn strip_usage(&mut self) {
        self.strip = Some(UsageStrip::default());
    }

    /// `chunk` as the client gets it.
    fn for_client(&mut self, chunk: Bytes) -> Bytes {
        match &mut self.strip {
            Some(s) => s.push(chunk),
            None => chunk,
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
                    if let Some(rest) = self.strip.as_mut().map(UsageStrip::finish).filter(|r| !r.is_empty()) {
                        self.prefix.push_back(rest);
                    }
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
                    let chunk = self.for_client(chunk);
                    if !chunk.is_empty() {
                        self.prefix.push_back(chunk);
                    }
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
}

/// A stream in flight: its upstream and its request.
struct Active {
    primed: Primed,
    life: Life,
}

impl Active {
    fn finish(mut self, end: StreamEnd) {
        // The channel slot goes back before anything else (C1).
        self.primed.permit.take();
        self.life.close_stream(end, &mut self.primed);
    }
}

/// What the response body and its stall watchdog share. The body only stamps times; the
/// watchdog reads them when it wakes (no wake-up per chunk).
struct Shared {
    active: std::sync::Mutex<Option<Active>>,
    base: Instant,
    /// 1 + milliseconds since `base` when the body last handed a chunk over and has not
    /// been asked for the next since; 0 while it is being asked (or waiting upstream).
    handed: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn take(&self) -> Option<Active> {
        self.active.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The response body of a primed stream: passes it through and closes its request when
/// it ends, however it ends. A client that stops taking chunks — a full socket, or an
/// HTTP/2 stream whose window the client never opens — is found by a watchdog: once a
/// handed-over chunk waits `write_timeout` for the next poll, the request is closed as
/// `client_stalled` and its channel and key slots come free.
pub struct StreamBody {
    shared: std::sync::Arc<Shared>,
    /// Fires when the upstream sends nothing for `idle_timeout`.
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_timeout: Duration,
    /// The gateway's shutdown past its drain deadline.
    cancel: Pin<Box<WaitForCancellationFutureOwned>>,
    format: Format,
    api: Api,
    request_id: String,
}

impl StreamBody {
    pub fn new(primed: Primed, mut life: Life) -> StreamBody {
        // The Responses API names the response in its first event, and a client may
        // follow it up (GET, cancel, its next turn) before this stream ends.
        if let Some(id) = &primed.watch.response_id {
            life.rec.response_id = Some(id.clone());
            crate::followup::remember(life.st(), &life.rec);
        }
        let idle_timeout = primed.idle_timeout;
        let idle = Box::pin(tokio::time::sleep(idle_timeout));
        let cancel = Box::pin(life.st().shutdown.cancel.clone().cancelled_owned());
        let write_timeout = Duration::from_millis(life.st().config.server.write_timeout_ms);
        let format = primed.watch.format;
        let api = life.api;
        let request_id = life.rec.id.clone();
        let shared = std::sync::Arc::new(Shared {
            active: std::sync::Mutex::new(Some(Active { primed, life })),
            base: Instant::now(),
            handed: Default::default(),
        });
        tokio::spawn(watch_stalls(std::sync::Arc::downgrade(&shared), write_timeout));
        StreamBody {
            shared,
            idle,
            idle_timeout,
            cancel,
            format,
            api,
            request_id,
        }
    }

    fn error_event(&self, message: &str) -> Bytes {
        Bytes::from(stream_error_event(
            self.format,
            self.api,
            ErrorKind::Upstream,
            message,
            &self.request_id,
        ))
    }

    fn end(&self, end: StreamEnd) {
        if let Some(a) = self.shared.take() {
            a.finish(end);
        }
    }

    fn end_with_error(&self, end: StreamEnd, message: &str) -> Poll<Option<std::io::Result<Bytes>>> {
        let ev = self.error_event(message);
        self.end(end);
        Poll::Ready(Some(Ok(ev)))
    }

    fn handed_over(&self, chunk: Bytes) -> Poll<Option<std::io::Result<Bytes>>> {
        let ms = self.shared.base.elapsed().as_millis() as u64;
        self.shared.handed.store(ms + 1, std::sync::atomic::Ordering::Release);
        Poll::Ready(Some(Ok(chunk)))
    }
}

/// Closes the stream's request when a chunk it handed over is not followed by a request
/// for the next within `limit` (the client stopped reading). It looks at least every half
/// `limit`, and sleeps exactly to the deadline once a chunk waits, so it is never late.
async fn watch_stalls(shared: std::sync::Weak<Shared>, limit: Duration) {
    use std::sync::atomic::Ordering;
    let mut wait = limit / 2;
    loop {
        tokio::time::sleep(wait).await;
        let Some(sh) = shared.upgrade() else { return };
        let handed = sh.handed.load(Ordering::Acquire);
        if handed == 0 {
            if sh.active.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
                return;
            }
            wait = limit / 2;
            continue;
        }
        let deadline = sh.base + Duration::from_millis(handed - 1) + limit;
        let now = Instant::now();
        if deadline > now {
            wait = deadline - now;
            continue;
        }
        match sh.take() {
            Some(a) => {
                tracing::info!(request_id = %a.life.rec.id, "client stopped reading its stream; its slots are freed");
                a.finish(StreamEnd::Stalled);
            }
            None => return,
        }
        return;
    }
}

impl Stream for StreamBody {
    type Item = std::io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        // Asked for the next chunk: the client is reading.
        self.shared.handed.store(0, std::sync::atomic::Ordering::Release);
        let shared = self.shared.clone();
        let mut guard = shared.active.lock().unwrap_or_else(|p| p.into_inner());
        let Some(active) = guard.as_mut() else {
            return Poll::Ready(None);
        };
        if let Some(chunk) = active.primed.prefix.pop_front() {
            active.life.captured(&chunk);
            drop(guard);
            return self.handed_over(chunk);
        }
        if self.cancel.as_mut().poll(cx).is_ready() {
            drop(guard);
            return self.end_with_error(StreamEnd::Interrupted, "The gateway is shutting down");
        }
        if active.primed.inner_done {
            drop(guard);
            self.end(StreamEnd::Complete);
            return Poll::Ready(None);
        }
        match active.primed.inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                active.primed.watch.observe(&chunk);
                let chunk = active.primed.for_client(chunk);
                if chunk.is_empty() {
                    // All of it held back or taken out: ask the upstream again.
                    drop(guard);
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                active.life.captured(&chunk);
                drop(guard);
                let deadline = Instant::now() + self.idle_timeout;
                self.idle.as_mut().reset(deadline);
                self.handed_over(chunk)
            }
            Poll::Ready(Some(Err(e))) => {
                drop(guard);
                let msg = spillway_ledger::truncate(format!("upstream stream broke off: {e}"), 512);
                self.end_with_error(
                    StreamEnd::Broken(ErrorClass::StreamInterrupted, msg),
                    "The upstream stream broke off",
                )
            }
            Poll::Ready(None) => {
                let rest = active.primed.strip.as_mut().map(UsageStrip::finish).unwrap_or_default();
                if !rest.is_empty() {
                    active.primed.inner_done = true;
                    active.life.captured(&rest);
                    drop(guard);
                    return self.handed_over(rest);
                }
                drop(guard);
                self.end(StreamEnd::Complete);
                Poll::Ready(None)
            }
            Poll::Pending => {
                drop(guard);
                match self.idle.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        let ms = self.idle_timeout.as_millis();
                        self.end_with_error(
                            StreamEnd::Broken(ErrorClass::Timeout, format!("upstream sent nothing for {ms} ms")),
                            &format!("The upstream stream stalled for {ms} ms"),
                        )
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl Drop for StreamBody {
    fn drop(&mut self) {
        if let Some(a) = self.shared.take() {
            let shutting = a.life.st().shutdown.cancel.is_cancelled();
            // I2: a client that leaves an `Idempotency-Key` stream will repeat the key to
            // get its answer: the rest is read and kept, so the repeat gets it whole and
            // the provider is not paid twice.
            if !shutting
                && a.life.is_idempotent()
                && let Ok(rt) = tokio::runtime::Handle::try_current()
            {
                rt.spawn(drain(a, self.idle_timeout));
                return;
            }
            let end = if shutting {
                StreamEnd::Interrupted
            } else if a.primed.watch.finished && a.primed.prefix.is_empty() {
                // SDKs close the connection as soon as they read the provider's end
                // marker, often before the upstream's own end reached the gateway.
                StreamEnd::Complete
            } else {
                StreamEnd::ClientGone
            };
            a.finish(end);
        }
    }
}

/// Reads an idempotent stream its client left to its end (see `StreamBody`'s drop), with
/// the same idle and shutdown limits as a stream someone reads.
async fn drain(mut a: Active, idle: Duration) {
    let cancel = a.life.st().shutdown.cancel.clone();
    while let Some(chunk) = a.primed.prefix.pop_front() {
        a.life.captured(&chunk);
    }
    if a.primed.inner_done {
        return a.finish(StreamEnd::Complete);
    }
    // What is kept for a replay is what the client would have read: the usage chunk it
    // did not ask for taken out, an event held back by the strip added at the end.
    let done = |mut a: Active| {
        if let Some(rest) = a.primed.strip.as_mut().map(UsageStrip::finish) {
            a.life.captured(&rest);
        }
        a.finish(StreamEnd::Complete)
    };
    loop {
        let next = tokio::select! {
            biased;
            _ = cancel.cancelled() => return a.finish(StreamEnd::Interrupted),
            next = tokio::time::timeout(idle, a.primed.inner.next()) => next,
        };
        match next {
            Err(_) => {
                let ms = idle.as_millis();
                return a.finish(StreamEnd::Broken(
                    ErrorClass::Timeout,
                    format!("upstream sent nothing for {ms} ms"),
                ));
            }
            Ok(None) => return done(a),
            Ok(Some(Err(e))) => {
                let msg = spillway_ledger::truncate(format!("upstream stream broke off: {e}"), 512);
                return a.finish(StreamEnd::Broken(ErrorClass::StreamInterrupted, msg));
            }
            Ok(Some(Ok(chunk))) => {
                a.primed.watch.observe(&chunk);
                let chunk = a.primed.for_client(chunk);
                a.life.captured(&chunk);
            }
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn an_event_ends_at_its_first_blank_line_of_either_kind() {
        // spec: M2
        // Every string of up to nine of `\r`, `\n` and `a`: the first blank line is the
        // earlier end of a search for each kind.
        let alphabet = [b'\r', b'\n', b'a'];
        let by_two_searches = |b: &[u8]| {
            let lf = memchr::memmem::find(b, b"\n\n").map(|i| i + 2);
            let crlf = memchr::memmem::find(b, b"\r\n\r\n").map(|i| i + 4);
            match (lf, crlf) {
                (Some(a), Some(c)) => Some(a.min(c)),
                (a, c) => a.or(c),
            }
        };
        for len in 0..=9u32 {
            for n in 0..3usize.pow(len) {
                let text: Vec<u8> = (0..len).map(|i| alphabet[n / 3usize.pow(i) % 3]).collect();
                assert_eq!(
                    super::next_boundary(&text),
                    by_two_searches(&text),
                    "{:?}",
                    String::from_utf8_lossy(&text)
                );
            }
        }
    }

    #[test]
    fn m2_the_usage_chunk_is_taken_out_however_the_stream_is_cut() {
        // spec: M2
        let text = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n";
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\r\n\r\n";
        let done = "data: [DONE]\n\n";
        let stream = format!("{text}{usage}{done}");
        let want = format!("{text}{done}");
        for cut in 0..=stream.len() {
            let mut strip = super::UsageStrip::default();
            let mut out = Vec::new();
            for part in [&stream[..cut], &stream[cut..]] {
                out.extend_from_slice(&strip.push(bytes::Bytes::copy_from_slice(part.as_bytes())));
            }
            out.extend_from_slice(&strip.finish());
            assert_eq!(String::from_utf8(out).unwrap(), want, "cut at {cut}");
        }
        // A chunk with no usage-only event passes through as it came.
        let mut strip = super::UsageStrip::default();
        assert_eq!(&strip.push(bytes::Bytes::from(text))[..], text.as_bytes());
    }

    #[test]
    fn m2_the_text_of_an_event_is_measured_in_every_format() {
        // spec: M2
        assert_eq!(super::text_len(r#"{"choices":[{"delta":{"content":"Hello"}}]}"#), 5);
        assert_eq!(
            super::text_len(r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"a\"b\n"}}"#),
            4
        );
        assert_eq!(
            super::text_len(r#"{"candidates": [{"content": {"parts": [{"text": "caf\u00e9"}]}}]}"#),
            4
        );
        assert_eq!(
            super::text_len(r#"{"type":"response.output_text.delta","delta":"abc"}"#),
            3
        );
        assert_eq!(super::text_len(r#"{"usage":{"prompt_tokens":3}}"#), 0);
    }
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
    fn h2_h3_first_visible_output_per_format() {
        // spec: H2, H3
        // A tool call is visible output from its first event: from there the stream is
        // bound to its channel and fails closed (H3); role and usage chunks are not.
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
                r#"{"candidates":[{"content":{"parts":[{"functionCall":{"name":"x"}}]}}]}"#,
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
}
