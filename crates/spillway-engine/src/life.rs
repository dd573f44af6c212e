//! One owner for a request's life, from the moment its key is known until its record is
//! closed: the [`Life`] holds the ledger record, the key's concurrency slot and the live
//! figures, and it is the only thing that closes a request. [`Life::close`] turns how the
//! request ended ([`End`]) into the response, the final record and the metrics, in that one
//! place; a stream closes through the same place when it ends. A `Life` dropped without
//! being closed — a client that hung up while it waited, a shutdown that cut it, a panic —
//! records why on its way out, so no request is ever left without its record.
//!
//! The attempt loop and the upstream call report what happened; they decide nothing about
//! closing.

use crate::clock;
use crate::error::GatewayError;
use crate::limits::KeySlot;
use crate::metrics::RouteKey;
use crate::routing::WaitGuard;
use crate::server::ConnState;
use crate::state::AppState;
use crate::stream::{Primed, StreamBody};
use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use spillway_ledger::{
    AttemptRecord, Decision, FailureClass, GatewayClass, KeyedRequest, Payload, RequestRecord, RequestState,
    StopReason, StoredResponse,
};
use spillway_wire::{ErrorClass, Signal, UnixMs, Usage};
use std::sync::Arc;
use std::time::Duration;

/// A complete answer from the provider, with its attempt.
pub struct Answer {
    pub status: StatusCode,
    pub content_type: HeaderValue,
    pub body: Bytes,
    pub usage: Usage,
    /// The Responses API's id of the stored response, read with the usage.
    pub response_id: Option<String>,
    pub att: AttemptRecord,
}

/// The provider's own 400/404/413/422 (D3): it goes back to the client as it came.
pub struct ProviderRefusal {
    pub status: StatusCode,
    pub body: Bytes,
    pub att: AttemptRecord,
    pub signal: Signal,
}

/// How a request ended, as the attempt loop (or ingress) reports it.
pub enum End {
    /// A complete answer from the provider.
    Answer(Answer),
    /// A stream that showed output (or ended cleanly without): it is passed on, and the
    /// record closes when the stream ends.
    Stream(Box<Primed>),
    /// The provider's own 400/404/413/422, returned as it came (D3).
    PassThrough(ProviderRefusal),
    /// The request failed: refused by the gateway, or the upstream failed and the loop
    /// stopped. `class` is the upstream class of the last attempt, when the failure is
    /// the provider's; `att` that attempt, with the decision that ended the loop.
    Error {
        err: GatewayError,
        class: Option<ErrorClass>,
        att: Option<AttemptRecord>,
    },
    /// The gateway's shutdown cut the request.
    Cancelled,
    /// I2: a repeat of a completed `Idempotency-Key`, answered with its stored response.
    Replay(Box<KeyedRequest>),
}

impl End {
    /// A refusal before anything went upstream.
    pub fn refused(err: GatewayError) -> End {
        End::Error {
            err,
            class: None,
            att: None,
        }
    }
}

/// How a stream ended.
pub enum StreamEnd {
    /// The provider finished (possibly with an error event of its own, noted in the watch).
    Complete,
    /// The upstream broke off or went quiet.
    Broken(ErrorClass, String),
    /// The client went away (or stopped reading and its connection was cut off).
    ClientGone,
    /// The client stopped taking chunks for the write deadline.
    Stalled,
    /// The gateway's shutdown cut it.
    Interrupted,
}

/// The owner of one request's record, slots and figures (see the module docs).
pub struct Life {
    st: Arc<AppState>,
    pub rec: RequestRecord,
    route: Option<RouteKey>,
    key_slot: Option<KeySlot>,
    /// Counted as in flight in the metrics (admitted to a channel).
    admitted: bool,
    /// The attempt whose upstream call is in progress: what a cut leaves behind.
    calling: Option<AttemptRecord>,
    conn: Option<Arc<ConnState>>,
    /// The final record is set and the figures closed; what is left is writing it (which
    /// a drop mid-write finishes synchronously, without closing the figures twice).
    settling: Option<Option<AttemptRecord>>,
    closed: bool,
    /// The route's control (F5's figures), once the route is known.
    control: Option<Arc<crate::control::RouteControl>>,
    /// With trace export on: the request's trace, and its attempts as they end.
    trace: Option<(crate::trace::TraceContext, Vec<AttemptRecord>)>,
    /// I2: the `Idempotency-Key` this request runs under, released once its final record
    /// is committed.
    idem: Option<crate::idempotency::Claim>,
    /// I2: the stream as the client received it, kept for replays (None once too large).
    capture: Option<Vec<u8>>,
    /// I6: the request body, when the config keeps prompts.
    prompt: Option<Bytes>,
    /// What the request asks of the provider (chat, Responses, embeddings, counting).
    pub api: spillway_wire::Api,
    /// B3, B4: the key whose owner pays, once authenticated.
    key: Option<Arc<crate::state::KeyRt>>,
    /// M1: the catalog this request is priced with (one version from estimate to cost).
    pricing: Option<Arc<spillway_policy::Pricing>>,
    /// M3: what the failed attempts so far cost (those that consumed tokens).
    failed_cost: f64,
    /// M3: the output tokens the estimate assumed.
    estimated_output: Option<u64>,
    /// J2: where a job's run hands its report back.
    job_sink: Option<Arc<std::sync::Mutex<Option<crate::jobs::RunReport>>>>,
    /// J2: the last failed attempt's provider wait hint and the loop's stop reason.
    last_hint: Option<u64>,
    last_stop: Option<StopReason>,
}

impl Life {
    pub fn new(st: Arc<AppState>, rec: RequestRecord, conn: Option<Arc<ConnState>>) -> Life {
        st.shutdown.opened();
        Life {
            st,
            rec,
            route: None,
            key_slot: None,
            admitted: false,
            calling: None,
            conn,
            settling: None,
            closed: false,
            control: None,
            trace: None,
            idem: None,
            capture: None,
            prompt: None,
            api: spillway_wire::Api::Generate,
            key: None,
            pricing: None,
            failed_cost: 0.0,
            estimated_output: None,
            job_sink: None,
            last_hint: None,
            last_stop: None,
        }
    }

    /// J2: the request became a background job (its own durable record): it ends here
    /// without a request row of its own, its slots given back.
    pub fn hand_over(mut self) {
        self.release();
    }

    /// J2: the request is a run of a job: its final record is handed back to the runner.
    pub fn set_job_sink(&mut self, sink: Arc<std::sync::Mutex<Option<crate::jobs::RunReport>>>) {
        self.job_sink = Some(sink);
    }

    /// M3: the output the estimate assumed (the client's cap, or the assumed output).
    pub fn estimated_output_tokens(&self) -> Option<u64> {
        self.estimated_output
    }

    /// K1, K2: the request fell back to `route` (`format/model`): it is served by `model`
    /// (priced as it), and its record keeps the model it asked for.
    pub fn fell_back(&mut self, route: &str, model: &str) {
        self.rec.served_model = Some(model.to_owned());
        self.rec.route = Some(route.to_owned());
    }

    /// B4: the key whose owner the request's cost is charged to when it closes.
    pub fn set_key(&mut self, key: Arc<crate::state::KeyRt>) {
        self.key = Some(key);
    }

    /// M3: the cost expected before the call: the input counted from the body, plus the
    /// client's output cap (or [`crate::accounts::ASSUMED_OUTPUT_TOKENS`] without one),
    /// at the catalog's uncached prices. Unknown for an unpriced model.
    pub fn estimate(&mut self, parsed: &spillway_wire::ParsedRequest) {
        use spillway_wire::Api;
        let pricing = self.st.accounts.pricing();
        let input = parsed.estimated_input_tokens;
        self.rec.estimated_input_tokens = Some(input);
        let output = match self.api {
            Api::Embeddings | Api::CountTokens => 0,
            Api::Generate | Api::Responses => parsed
                .max_output_tokens
                .unwrap_or(crate::accounts::ASSUMED_OUTPUT_TOKENS),
        };
        self.estimated_output = Some(output);
        if let Some(p) = pricing.price(&parsed.model) {
            let t = spillway_wire::usage::Billable {
                input,
                output,
                ..Default::default()
            };
            self.rec.estimated_cost_usd = Some(if self.api == Api::CountTokens { 0.0 } else { p.usd(&t) });
            self.rec.pricing_version = Some(pricing.version.clone());
        }
        self.pricing = Some(pricing);
    }

    /// M1: the price of the model the request is served by, when the catalog has one.
    fn price(&self) -> Option<&spillway_policy::ModelPrice> {
        let model = self
            .rec
            .served_model
            .as_deref()
            .or(self.rec.requested_model.as_deref())?;
        self.pricing.as_ref()?.price(model)
    }

    /// M3: what tokens `att` reported cost (a failed attempt can have consumed some).
    fn attempt_cost(&self, att: &AttemptRecord) -> Option<f64> {
        if att.input_tokens.is_none() && att.output_tokens.is_none() {
            return None;
        }
        let u = Usage {
            input_tokens: att.input_tokens,
            output_tokens: att.output_tokens,
            ..Default::default()
        };
        Some(self.price()?.usd(&u.billable(self.rec.format)?))
    }

    /// M1–M3: the final attempt's tokens become its cost and the request's (failed
    /// attempts included). The record keeps the tokens as reported; `usage` may carry
    /// estimates standing in for what the provider did not report.
    fn price_request(&mut self, att: &mut AttemptRecord, usage: &Usage) {
        if self.api == spillway_wire::Api::CountTokens {
            // Counting is free at the providers (the ingress set 0).
            return;
        }
        let Some(price) = self.price() else {
            return;
        };
        let failed = self.failed_cost;
        let cost = usage.billable(self.rec.format).map(|b| price.usd(&b));
        att.cost_usd = cost;
        self.rec.cost_usd = cost.map(|c| c + failed);
        self.rec.failed_cost_usd = Some(failed);
    }

    /// A request that ended without an answer: only what its failed attempts consumed
    /// (the provider bills nothing for a refusal, a 5xx or a 429). Unknown when the model
    /// is unpriced.
    fn price_failure(&mut self, att: Option<&mut AttemptRecord>) {
        if self.api == spillway_wire::Api::CountTokens || self.price().is_none() {
            return;
        }
        if let Some(a) = att
            && let Some(c) = self.attempt_cost(a)
        {
            a.cost_usd = Some(c);
            self.failed_cost += c;
        }
        self.rec.cost_usd = Some(self.failed_cost);
        self.rec.failed_cost_usd = Some(self.failed_cost);
    }

    /// I2: the request runs under `key`, which `claim` holds for it. The key is on its
    /// record from here, so it is durable with `calling_api`.
    pub fn run_idempotent(&mut self, key: String, claim: crate::idempotency::Claim) {
        self.rec.idempotency_key = Some(key);
        self.idem = Some(claim);
        self.capture = Some(Vec::new());
    }

    /// Whether the request runs under an `Idempotency-Key`.
    pub fn is_idempotent(&self) -> bool {
        self.idem.is_some()
    }

    /// I6: the config keeps prompts: the body goes into the ledger with the final record.
    pub fn keep_prompt(&mut self, body: Bytes) {
        self.prompt = Some(body);
    }

    /// A stream chunk handed to the client: kept for a replay while within the limit.
    pub(crate) fn captured(&mut self, chunk: &[u8]) {
        let max = self.st.config.idempotency.max_stored_response_bytes as usize;
        if let Some(buf) = &mut self.capture {
            if buf.len() + chunk.len() > max {
                self.capture = None;
            } else {
                buf.extend_from_slice(chunk);
            }
        }
    }

    /// Queues the request's body copies (a completed response for replays, within
    /// `max_stored_response_bytes` as its callers checked; the prompt when kept), ahead of
    /// its final record so that both share a commit.
    fn store_payload(&mut self, response: Option<StoredResponse>) {
        if response.is_none() && self.prompt.is_none() {
            return;
        }
        let window = self.st.config.idempotency.window_ms as i64;
        self.st.ledger.enqueue_payload(Payload {
            request_id: self.rec.id.clone(),
            expires_at: UnixMs(self.rec.received_at.0.saturating_add(window)),
            request_body: self.prompt.take().map(|b| b.to_vec()),
            response,
        });
    }

    pub fn st(&self) -> &Arc<AppState> {
        &self.st
    }

    /// The model is known: the request belongs to its route from here on.
    pub fn set_route(&mut self) {
        self.route = RouteKey::of(&self.rec, self.api);
    }

    /// With trace export on, the request's span is exported when it closes.
    pub fn set_trace(&mut self, t: &crate::trace::TraceContext) {
        if self.st.otel.is_some() {
            self.trace = Some((t.clone(), Vec::new()));
        }
    }

    /// An attempt ended: kept for the request's trace, when there is one.
    fn traced(&mut self, att: &AttemptRecord) {
        if let Some((_, v)) = &mut self.trace {
            v.retain(|a| a.attempt_no != att.attempt_no);
            v.push(att.clone());
        }
    }

    /// The route's breaker let the request through: its end counts in the route's figures.
    pub fn set_control(&mut self, c: Arc<crate::control::RouteControl>) {
        self.control = Some(c);
    }

    /// B1: the key's concurrency slot, held until the request (stream included) ends.
    pub fn hold_key(&mut self, slot: KeySlot) {
        self.key_slot = Some(slot);
    }

    /// What a capacity wait calls to take its place in the queue (C2).
    pub fn wait_guard(&self) -> impl FnOnce() -> Result<WaitGuard, GatewayError> + use<> {
        let (st, route) = (self.st.clone(), self.route.clone());
        move || match route {
            Some(r) => WaitGuard::queued(&st, r),
            None => Ok(WaitGuard(None)),
        }
    }

    /// I3: the first attempt is about to start on `channel`; `calling_api` is durable
    /// before anything leaves for the provider.
    pub async fn calling_api(&mut self, channel: &str, waited: Option<Duration>) -> Result<(), GatewayError> {
        let now = clock::now();
        // The request only becomes this record once the ledger holds it: if it cannot,
        // nothing went upstream and the record must not say otherwise. What changes is
        // kept aside to be put back, rather than the whole record cloned twice (a record
        // is some fifteen strings).
        let r = &mut self.rec;
        let before = (
            r.state,
            r.admitted_at.replace(now),
            std::mem::replace(&mut r.served_model, r.requested_model.clone()),
            r.channel.replace(channel.to_owned()),
            std::mem::replace(&mut r.attempts, 1),
            std::mem::replace(&mut r.queued_ms, waited.map(clock::ms)),
        );
        r.state = RequestState::CallingApi;
        if let Err(e) = self.st.ledger.put_request_durable(self.rec.clone()).await {
            tracing::error!(error = %e, request_id = %self.rec.id, "ledger unavailable; refusing to call upstream");
            let r = &mut self.rec;
            (
                r.state,
                r.admitted_at,
                r.served_model,
                r.channel,
                r.attempts,
                r.queued_ms,
            ) = before;
            return Err(GatewayError::LedgerUnavailable);
        }
        if let Some(r) = &self.route {
            if let Some(w) = waited {
                self.st.metrics.waited(r, clock::ms(w));
            }
            self.st.metrics.started(r, now);
        }
        self.admitted = true;
        Ok(())
    }

    /// An attempt starts on `channel`: its record so far, kept until it returns.
    pub fn begin_attempt(&mut self, channel: &str) -> AttemptRecord {
        let att = AttemptRecord::started(&self.rec.id, self.rec.attempts, channel, clock::now());
        self.calling = Some(att.clone());
        att
    }

    /// The upstream call returned (whatever it brought).
    pub fn attempt_returned(&mut self) {
        self.calling = None;
    }

    /// A failed attempt that the loop goes on from, with its decision.
    pub async fn record_attempt(&mut self, mut att: AttemptRecord) {
        if let Some(c) = self.attempt_cost(&att) {
            att.cost_usd = Some(c);
            self.failed_cost += c;
        }
        self.traced(&att);
        if let Some(r) = &self.route {
            self.st.metrics.attempt_failed(r, att.error_class);
        }
        if let Err(e) = self.st.ledger.put_attempt(att).await {
            tracing::error!(error = %e, "could not record an attempt");
        }
    }

    /// I5: a long wait is on record before it starts, so a restart knows when the work
    /// may resume.
    pub async fn wait_until(&mut self, ready_at: UnixMs) {
        self.rec.next_ready_at = Some(ready_at);
        if let Err(e) = self.st.ledger.put_request_durable(self.rec.clone()).await {
            tracing::error!(error = %e, request_id = %self.rec.id, "could not record a retry's ready_at");
        }
    }

    /// The next attempt is admitted on `channel`; its count is on record as it starts (I5).
    pub async fn next_attempt(&mut self, channel: &str, waited: Option<Duration>) {
        // After a durable wait the ledger says nothing is in flight; the call about to
        // start must be on record before it goes (I3), or a crash would hide it.
        let after_wait = self.rec.next_ready_at.take().is_some();
        self.rec.attempts += 1;
        self.rec.channel = Some(channel.to_owned());
        if let Some(w) = waited {
            self.rec.queued_ms = Some(self.rec.queued_ms.unwrap_or(0) + clock::ms(w));
            if let Some(r) = &self.route {
                self.st.metrics.waited(r, clock::ms(w));
            }
        }
        let written = if after_wait {
            self.st.ledger.put_request_durable(self.rec.clone()).await
        } else {
            self.st.ledger.put_request(self.rec.clone()).await
        };
        if let Err(e) = written {
            tracing::error!(error = %e, "could not record an attempt count");
        }
    }

    /// Why the client is gone: it stopped reading (and was cut off), or it hung up.
    fn gone_class(&self) -> GatewayClass {
        if self.conn.as_ref().is_some_and(|c| c.stalled()) {
            GatewayClass::ClientStalled
        } else {
            GatewayClass::ClientDisconnected
        }
    }

    /// Closes the request with `end`: the response, the final record and the figures,
    /// here and nowhere else. A stream's record closes when the stream ends.
    ///
    /// Boxed: its state (the `Life`, the end, the record being settled) is several KiB,
    /// and a future that awaits it inline reserves that much for its whole life, in
    /// every request in flight, though closing is the last thing a request does.
    pub fn close(self, end: End) -> std::pin::Pin<Box<dyn Future<Output = Response> + Send>> {
        Box::pin(self.close_now(end))
    }

    async fn close_now(mut self, end: End) -> Response {
        let format = self.rec.format;
        let now = clock::now();
        match end {
            End::Answer(Answer {
                status,
                content_type,
                body,
                usage,
                response_id,
                mut att,
            }) => {
                apply_usage(&mut self.rec, &mut att, &usage);
                let mut billed = usage;
                if billed.is_empty() && self.api == spillway_wire::Api::Embeddings {
                    // Gemini's embedContent reports no usage: the input counted before
                    // the call stands in (embeddings have no output).
                    billed.input_tokens = self.rec.estimated_input_tokens;
                }
                self.price_request(&mut att, &billed);
                att.finished_at = Some(now);
                att.decision = Some(Decision::Done);
                self.rec.upstream_request_id = att.upstream_request_id.clone();
                self.rec.first_token_at = att.first_byte_at;
                self.rec.finished_at = Some(now);
                self.rec.state = RequestState::Done;
                self.rec.http_status = Some(status.as_u16());
                if response_id.is_some() {
                    self.rec.response_id = response_id;
                    crate::followup::remember(&self.st, &self.rec);
                }
                self.rec.next_ready_at = None;
                if self.idem.is_some() || self.prompt.is_some() {
                    let fits = body.len() as u64 <= self.st.config.idempotency.max_stored_response_bytes;
                    let copy = (self.idem.is_some() && fits).then(|| StoredResponse {
                        status: status.as_u16(),
                        content_type: content_type.to_str().unwrap_or("application/json").to_owned(),
                        body: body.to_vec(),
                    });
                    self.store_payload(copy);
                }
                let mut out = Response::new(Body::from(body));
                *out.status_mut() = status;
                out.headers_mut().insert(header::CONTENT_TYPE, content_type);
                gateway_headers(out.headers_mut(), &self.rec);
                self.settle(Some(att)).await;
                out
            }
            End::PassThrough(ProviderRefusal {
                status,
                body,
                mut att,
                signal,
            }) => {
                self.price_failure(None);
                att.finished_at = Some(now);
                att.decision = Some(Decision::PassedThrough);
                att.decision_reason = Some(StopReason::NotRetryable);
                self.rec.upstream_request_id = att.upstream_request_id.clone();
                let message = signal.message.clone().unwrap_or_default();
                self.rec.fail(Some(status.as_u16()), signal.class, message, now);
                let mut out = Response::new(Body::from(body));
                *out.status_mut() = status;
                let h = out.headers_mut();
                h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
                h.insert("x-should-retry", HeaderValue::from_static("false"));
                gateway_headers(h, &self.rec);
                self.settle(Some(att)).await;
                out
            }
            End::Error { err, class, mut att } => {
                if let Some(a) = &att {
                    self.last_hint = a.retry_after_ms;
                    self.last_stop = a.decision_reason;
                }
                let gone = matches!(err, GatewayError::ClientGone);
                let class: FailureClass = match (gone, err.class(), class) {
                    (true, _, _) => self.gone_class().into(),
                    (false, Some(g), _) => g.into(),
                    (false, None, Some(c)) => c.into(),
                    (false, None, None) => ErrorClass::Unknown.into(),
                };
                let mut message = err.to_string();
                if self.rec.attempts > 0 && err.class().is_some() {
                    message = format!("{message} (after {} failed attempt(s))", self.rec.attempts);
                }
                // Nobody receives an answer to a client that left.
                let status = (!gone).then(|| err.kind().status());
                self.rec.fail(status, class, message, now);
                if !self.admitted {
                    // C3: nothing went upstream, so nothing is billed.
                    self.rec.cost_usd = Some(0.0);
                } else {
                    self.price_failure(att.as_mut());
                }
                if let Some(u) = att.as_ref().and_then(|a| a.upstream_request_id.clone()) {
                    self.rec.upstream_request_id = Some(u);
                }
                let mut out = err.into_response(format);
                if self.admitted {
                    gateway_headers(out.headers_mut(), &self.rec);
                }
                self.settle(att).await;
                out
            }
            End::Stream(primed) => {
                let content_type = primed.content_type.clone();
                self.rec.upstream_request_id = primed.att.upstream_request_id.clone();
                let mut out = Response::new(Body::empty());
                *out.status_mut() = StatusCode::OK;
                let h = out.headers_mut();
                h.insert(header::CONTENT_TYPE, content_type);
                h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                h.insert("x-accel-buffering", HeaderValue::from_static("no"));
                gateway_headers(h, &self.rec);
                *out.body_mut() = Body::from_stream(StreamBody::new(*primed, self));
                out
            }
            End::Replay(found) => {
                let KeyedRequest {
                    request: original,
                    response,
                } = *found;
                let Some(stored) = response else {
                    let e = GatewayError::IdempotencyNotKept {
                        original: original.id.clone(),
                        result_id: original.result_id().map(str::to_owned),
                    };
                    return self.close(End::refused(e)).await;
                };
                // A logical request of its own, answered from the ledger: nothing went
                // upstream, nothing is billed.
                self.rec.state = RequestState::Done;
                self.rec.http_status = Some(stored.status);
                self.rec.finished_at = Some(now);
                self.rec.replay_of = Some(original.id.clone());
                self.rec.served_model = original.served_model.clone();
                self.rec.cost_usd = Some(0.0);
                let mut out = Response::new(Body::from(stored.body));
                *out.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
                let h = out.headers_mut();
                if let Ok(ct) = HeaderValue::from_str(&stored.content_type) {
                    h.insert(header::CONTENT_TYPE, ct);
                }
                if stored.content_type.starts_with("text/event-stream") {
                    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                }
                gateway_headers(h, &original);
                crate::idempotency::replay_headers(h, &original);
                self.settle(None).await;
                out
            }
            End::Cancelled => {
                let was_calling = self.calling.is_some();
                self.interrupted(now);
                self.settle_now();
                let err = if was_calling {
                    GatewayError::Interrupted
                } else {
                    GatewayError::ShuttingDown
                };
                let mut out = err.into_response(format);
                if self.admitted {
                    gateway_headers(out.headers_mut(), &self.rec);
                }
                out
            }
        }
    }

    /// The shutdown (or a crash of the task) cut the request: an upstream call in flight
    /// leaves its outcome unknown (I4), anything else simply did not happen.
    fn interrupted(&mut self, now: UnixMs) {
        match self.calling.take() {
            Some(mut att) => {
                att.finished_at = Some(now);
                att.message = Some("the gateway stopped during this call; the provider's outcome is unknown".into());
                att.decision = Some(Decision::FailClosed);
                att.decision_reason = Some(StopReason::Interrupted);
                self.rec.end(
                    RequestState::Unknown,
                    None,
                    GatewayClass::Interrupted,
                    "the gateway stopped while this request was calling the provider; its outcome is unknown",
                    now,
                );
                self.traced(&att);
                self.st.ledger.enqueue_attempt(att);
            }
            None => {
                let what = if self.admitted {
                    "the gateway stopped while the request waited to retry; nothing more was sent upstream"
                } else {
                    "the gateway stopped before the request was sent upstream"
                };
                self.rec.fail(None, GatewayClass::Shutdown, what, now);
                if !self.admitted {
                    self.rec.cost_usd = Some(0.0);
                }
            }
        }
    }

    /// A stream ended: its attempt and the request close here, through the same `settle`.
    pub(crate) fn close_stream(&mut self, end: StreamEnd, primed: &mut Primed) {
        let now = clock::now();
        let watch = &mut primed.watch;
        let mut att = primed.att.clone();
        apply_usage(&mut self.rec, &mut att, &watch.usage);
        // M2: a stream cut before its final usage came bills what it produced: the text
        // seen (Anthropic reports a placeholder output count at the start, so a cut
        // stream takes the larger), and the input counted before the call.
        let mut billed = watch.usage;
        let seen = watch.text_bytes.div_ceil(4);
        let complete = matches!(end, StreamEnd::Complete) && watch.stream_error.is_none();
        match billed.output_tokens {
            None if seen > 0 => billed.output_tokens = Some(seen),
            Some(n) if !complete && seen > n => billed.output_tokens = Some(seen),
            _ => {}
        }
        if billed.input_tokens.is_none() && billed.output_tokens.is_some() {
            billed.input_tokens = self.rec.estimated_input_tokens;
        }
        self.price_request(&mut att, &billed);
        self.rec.first_token_at = watch.first_token_at;
        if self.rec.response_id.is_none() {
            self.rec.response_id = watch.response_id.take();
            crate::followup::remember(&self.st, &self.rec);
        }
        att.finished_at = Some(now);
        att.http_status = Some(200);
        let failure: Option<(FailureClass, String, RequestState)> = match end {
            StreamEnd::Complete => watch.stream_error.take().map(|s| {
                (
                    s.class.into(),
                    format!(
                        "provider sent an error event: {}",
                        s.message
                            .as_deref()
                            .or(s.provider_error_type.as_deref())
                            .unwrap_or("error")
                    ),
                    RequestState::Failed,
                )
            }),
            StreamEnd::Broken(class, m) => Some((class.into(), m, RequestState::Failed)),
            StreamEnd::ClientGone => Some((
                self.gone_class().into(),
                "client went away before the stream ended".to_owned(),
                RequestState::Failed,
            )),
            StreamEnd::Stalled => Some((
                GatewayClass::ClientStalled.into(),
                "client stopped reading the stream for the write deadline; its slots were freed".to_owned(),
                RequestState::Failed,
            )),
            // The provider was still producing: what it did in the end is not known.
            StreamEnd::Interrupted => Some((
                GatewayClass::Interrupted.into(),
                "the gateway stopped while the stream was running; the provider's outcome is unknown".to_owned(),
                RequestState::Unknown,
            )),
        };
        match failure {
            None => {
                self.rec.state = RequestState::Done;
                self.rec.http_status = Some(200);
                self.rec.finished_at = Some(now);
                self.rec.next_ready_at = None;
                att.error_class = ErrorClass::Success;
                att.decision = Some(Decision::Done);
                if self.idem.is_some() || self.prompt.is_some() {
                    let copy = self.capture.take().map(|body| StoredResponse {
                        status: 200,
                        content_type: primed.content_type.to_str().unwrap_or("text/event-stream").to_owned(),
                        body,
                    });
                    self.store_payload(copy);
                }
            }
            Some((class, message, state)) => {
                self.rec.end(state, Some(200), class, message.clone(), now);
                // H2: output the client already saw is committed; it is never replayed.
                self.rec.partial_output_committed = watch.first_token_at.is_some();
                if let FailureClass::Upstream(c) = class {
                    att.error_class = c;
                }
                att.message = Some(message);
                att.visibility = Some(if self.rec.partial_output_committed {
                    spillway_wire::Visibility::AfterPartialOutput
                } else {
                    spillway_wire::Visibility::BeforeFirstToken
                });
                // F2's first rule: once output is visible the request fails closed.
                att.decision = Some(Decision::FailClosed);
                att.decision_reason = Some(match end_reason(&class, self.rec.partial_output_committed) {
                    Some(r) => r,
                    None => StopReason::NotRetryable,
                });
            }
        }
        if let Some(r) = &self.route
            && att.error_class != ErrorClass::Success
        {
            self.st.metrics.attempt_failed(r, att.error_class);
        }
        self.traced(&att);
        self.st.ledger.enqueue_attempt(att);
        self.settle_now();
    }

    /// The final record and figures, with backpressure on the ledger's queue.
    async fn settle(&mut self, att: Option<AttemptRecord>) {
        if self.prompt.is_some() {
            self.store_payload(None);
        }
        if let Some(a) = &att {
            self.traced(a);
        }
        self.finish_figures();
        self.settling = Some(att.clone());
        if let Some(a) = att
            && let Err(e) = self.st.ledger.put_attempt(a).await
        {
            tracing::error!(error = %e, "could not record an attempt");
        }
        self.settling = Some(None);
        if let Err(e) = self.st.ledger.put_request(self.rec.clone()).await {
            tracing::error!(error = %e, request_id = %self.rec.id, "could not record a request");
        }
        self.release();
    }

    /// The same, from code that cannot wait (a stream's end in `poll` or `drop`): queued
    /// at once, in order, before the connection reports the response finished, so a
    /// shutdown that waits for the connection and then flushes cannot miss it.
    fn settle_now(&mut self) {
        if self.prompt.is_some() {
            self.store_payload(None);
        }
        self.finish_figures();
        self.st.ledger.enqueue_request(self.rec.clone());
        self.release();
    }

    fn finish_figures(&mut self) {
        if self.admitted
            && let Some(c) = &self.control
        {
            // F5: only requests that reached a channel make attempts.
            c.finished(self.rec.attempts, self.rec.state == RequestState::Done);
        }
        let at = self.rec.finished_at.unwrap_or_else(clock::now);
        if let Some(c) = &self.control {
            let ms = |to: UnixMs| Duration::from_millis(to.since(self.rec.received_at));
            let ttft = self.rec.stream.then_some(self.rec.first_token_at).flatten().map(ms);
            let wait = self.rec.queued_ms.map(Duration::from_millis);
            c.hists
                .get_or_init(|| self.st.prom.route_histograms(&c.name))
                .record(ms(at), wait, ttft);
        }
        // B4: the request's cost is taken from its owner's balance and its key's spend as
        // it closes (its record carries the same cost to the ledger); G1 weighs the
        // route's last hour, at the estimate where the cost is unknown.
        if let Some(k) = &self.key {
            let hour = self
                .rec
                .cost_usd
                .or(self.admitted.then_some(self.rec.estimated_cost_usd).flatten());
            if let Some(h) = self
                .st
                .accounts
                .settle(k, self.rec.route.as_deref(), self.rec.cost_usd, hour, at)
                && let Some(c) = &self.control
            {
                c.on_cost(&self.st, h.last_hour_usd, h.daily_budget_usd);
            }
        }
        if let (Some(o), Some((t, atts))) = (&self.st.otel, self.trace.take()) {
            let mut rec = self.rec.clone();
            rec.finished_at.get_or_insert(at);
            o.record(&t, &rec, &atts);
        }
        self.st
            .metrics
            .finished(&self.rec, self.route.as_ref(), self.admitted, at);
        if let Some(s) = &self.job_sink {
            *s.lock().unwrap_or_else(|p| p.into_inner()) = Some(crate::jobs::RunReport {
                rec: self.rec.clone(),
                provider_hint_ms: self.last_hint,
                stop: self.last_stop,
            });
        }
    }

    fn release(&mut self) {
        // The final record is queued: the idempotency key goes back once it is committed.
        if let Some(c) = self.idem.take() {
            c.release();
        }
        self.key_slot.take();
        self.closed = true;
        self.st.shutdown.closed();
    }
}

fn end_reason(class: &FailureClass, committed: bool) -> Option<StopReason> {
    match class {
        _ if committed => Some(StopReason::PartialOutputCommitted),
        FailureClass::Gateway(GatewayClass::ClientDisconnected | GatewayClass::ClientStalled) => {
            Some(StopReason::ClientGone)
        }
        FailureClass::Gateway(GatewayClass::Interrupted) => Some(StopReason::Interrupted),
        _ => None,
    }
}

impl Drop for Life {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        if let Some(att) = self.settling.take() {
            // Dropped while its final record waited for room in the ledger's queue: the
            // record is final already; queue it now.
            if let Some(a) = att {
                self.st.ledger.enqueue_attempt(a);
            }
            self.st.ledger.enqueue_request(self.rec.clone());
            self.release();
            return;
        }
        let now = clock::now();
        if std::thread::panicking() {
            // A bug cut the request short: say so, and keep an in-flight call's
            // outcome honest (unknown).
            let calling = self.calling.take();
            let state = if calling.is_some() {
                RequestState::Unknown
            } else {
                RequestState::Failed
            };
            if let Some(mut att) = calling {
                att.finished_at = Some(now);
                att.decision = Some(Decision::FailClosed);
                att.decision_reason = Some(StopReason::Interrupted);
                self.st.ledger.enqueue_attempt(att);
            }
            self.rec.end(
                state,
                Some(500),
                GatewayClass::InternalError,
                "the gateway failed while handling this request (a bug); see its log",
                now,
            );
        } else if self.st.shutdown.cancel.is_cancelled() || self.calling.is_some() {
            self.interrupted(now);
        } else {
            // C4: the client went away while the request waited; nothing was sent upstream.
            let class = self.gone_class();
            self.rec.fail(None, class, GatewayError::ClientGone.to_string(), now);
            if !self.admitted {
                self.rec.cost_usd = Some(0.0);
            }
        }
        self.settle_now();
    }
}

fn apply_usage(rec: &mut RequestRecord, att: &mut AttemptRecord, u: &Usage) {
    rec.input_tokens = u.input_tokens;
    rec.output_tokens = u.output_tokens;
    rec.cached_input_tokens = u.cached_input_tokens;
    rec.reasoning_tokens = u.reasoning_tokens;
    rec.cache_write_tokens = u.cache_creation_tokens;
    att.input_tokens = u.input_tokens;
    att.output_tokens = u.output_tokens;
}

/// The A7 headers, on success and on failures after admission alike.
pub fn gateway_headers(h: &mut HeaderMap, rec: &RequestRecord) {
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
