//! The attempt loop of one request: an attempt, the channel's health updated from its
//! signal (D6, E2), the F2 decision, then failover to another channel of the group (D1)
//! or a paced retry — until an answer, or a fail-closed end with D7's status.

use crate::error::GatewayError;
use crate::ingress::now_ms;
use crate::limits::KeySlot;
use crate::retry::{self, Decision, Failure, Retryability, Stop};
use crate::routing::{self, Admitted};
use crate::state::{AppState, ChannelRt};
use crate::trace::TraceContext;
use crate::upstream::{self, Outcome};
use axum::body::Bytes;
use axum::response::Response;
use http::request::Parts;
use spillway_ledger::{AttemptRecord, RequestRecord, RequestState};
use spillway_wire::{ErrorClass, ErrorKind, Format, ParsedRequest, Signal};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// Everything the attempts of one request share.
pub struct Job {
    pub st: Arc<AppState>,
    pub format: Format,
    pub parts: Parts,
    pub body: Bytes,
    pub parsed: ParsedRequest,
    pub trace: TraceContext,
    /// The channel group (D1): every channel that speaks the format and serves the model.
    pub candidates: Vec<Arc<ChannelRt>>,
    /// E3: tokens the request may use (input estimate plus output cap).
    pub tokens: u64,
    /// F3: the request's deadline, from its receipt.
    pub deadline: Instant,
    /// C2: what is left of the request's capacity-wait allowance.
    pub capacity_wait_left: Duration,
    /// B1: the key's concurrency slot, held until the request (stream included) ends.
    pub key_slot: Option<KeySlot>,
    /// Set when the client has hung up: a request waiting to retry then leaves the queue
    /// and sends nothing more upstream (C4).
    pub client_gone: Arc<AtomicBool>,
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// Runs the request from its first admitted slot to its end.
pub async fn run(mut job: Job, mut rec: RequestRecord, first: Admitted) -> Response {
    let st = job.st.clone();
    let format = job.format;
    rec.state = RequestState::CallingApi;
    rec.admitted_at = Some(now_ms());
    rec.served_model = Some(job.parsed.model.clone());
    rec.channel = Some(first.channel.cfg.name.clone());
    rec.attempts = 1;
    if let Some(w) = first.waited {
        rec.queued_ms = Some(ms(w));
        st.metrics.waited(&rec, ms(w));
    }
    // I3: the request is durably `calling_api` before anything leaves for the provider.
    if let Err(e) = st.ledger.put_request_durable(rec.clone()).await {
        tracing::error!(error = %e, request_id = %rec.id, "ledger unavailable; refusing to call upstream");
        return GatewayError::LedgerUnavailable.into_response(format);
    }
    st.metrics.started(&rec);

    let max_attempts = st.config.max_attempts;
    let mut admitted = first;
    let mut tried: Vec<String> = Vec::new();
    // D7: while every failure is pacing or overload, running out answers 429, else 502.
    let mut all_rate = true;
    loop {
        let channel = admitted.channel.clone();
        let name = channel.cfg.name.clone();
        if !tried.contains(&name) {
            tried.push(name.clone());
        }
        let (r, mut att, signal) = match upstream::attempt(&mut job, rec, admitted).await {
            Outcome::Answer(resp) => return resp,
            Outcome::Failed { rec, att, signal } => (*rec, *att, signal),
        };
        rec = r;
        let now = Instant::now();
        if channel.health.observe_failure(&signal, &name, now) {
            alert_ejection(&st, &signal, &name);
        }
        all_rate &= matches!(signal.class, ErrorClass::RateLimit | ErrorClass::Overload);
        st.metrics.attempt_failed(&rec, signal.class);

        let remaining = job.deadline.saturating_duration_since(now);
        let survey = routing::survey(&job.candidates, job.tokens, &tried, now);
        let decision = match retry::retryability(signal.class) {
            Retryability::Never => Decision::FailClosed(Stop::NotRetryable),
            _ if survey.ready.is_empty() && survey.soonest.is_none() => Decision::FailClosed(Stop::NoChannelLeft),
            _ => {
                // The wait the next target asks for: none when an untried channel is ready;
                // the failed channel's own hint when it is the one to try again; otherwise
                // the soonest pace in the group.
                let hint = if survey.untried_ready {
                    None
                } else if !survey.ready.is_empty() {
                    survey
                        .ready
                        .iter()
                        .any(|c| Arc::ptr_eq(c, &channel))
                        .then_some(signal.retry_after_ms)
                        .flatten()
                        .map(Duration::from_millis)
                } else {
                    survey.soonest
                };
                let f = Failure {
                    visible_output: false,
                    attempts: rec.attempts,
                    max_attempts,
                    hint,
                    failover_ready: survey.untried_ready,
                    remaining,
                };
                retry::decide(f, now, retry::full_jitter)
            }
        };

        let delay = match decision {
            Decision::FailClosed(stop) => {
                att.decision = Some("fail_closed".into());
                att.decision_reason = Some(stop.as_str().into());
                let end = Stopped {
                    stop,
                    all_rate,
                    channel: &name,
                    soonest: survey.soonest,
                };
                return finish(&job, rec, att, &signal, end).await;
            }
            Decision::RetryNow { delay } => {
                att.decision = Some(if survey.untried_ready { "failover" } else { "retry" }.into());
                delay
            }
            Decision::Queue { ready_at } => {
                att.decision = Some("wait".into());
                att.decision_reason = Some("wait_hint_over_2s".into());
                ready_at.saturating_duration_since(now)
            }
        };
        att.delay_ms = Some(ms(delay));
        let ready_at_ms = now_ms() + ms(delay) as i64;
        att.ready_at = Some(ready_at_ms);
        st.ledger.enqueue_attempt(att);
        if delay > retry::QUEUE_THRESHOLD {
            // F1, I5: a long wait is on record before it starts, so a restart knows when
            // the work may resume.
            rec.next_ready_at = Some(ready_at_ms);
            if let Err(e) = st.ledger.put_request_durable(rec.clone()).await {
                tracing::error!(error = %e, request_id = %rec.id, "could not record a retry's ready_at");
            }
        }
        // No channel slot is held while waiting (F1); the deadline bounds the wait.
        tokio::time::sleep(delay).await;
        rec.next_ready_at = None;
        if job.client_gone.load(Ordering::Relaxed) {
            return end_with(&st, rec, format, GatewayError::ClientGone, &signal);
        }

        let now = Instant::now();
        let max_wait = job.capacity_wait_left.min(job.deadline.saturating_duration_since(now));
        let on_wait = || routing::WaitGuard::queued(&st, &rec);
        match routing::admit(
            &job.candidates,
            &job.parsed.model,
            job.tokens,
            &tried,
            max_wait,
            on_wait,
        )
        .await
        {
            Ok(a) if job.client_gone.load(Ordering::Relaxed) => {
                drop(a);
                return end_with(&st, rec, format, GatewayError::ClientGone, &signal);
            }
            Ok(a) => {
                if let Some(w) = a.waited {
                    job.capacity_wait_left = job.capacity_wait_left.saturating_sub(w);
                    rec.queued_ms = Some(rec.queued_ms.unwrap_or(0) + ms(w));
                    st.metrics.waited(&rec, ms(w));
                }
                rec.attempts += 1;
                rec.channel = Some(a.channel.cfg.name.clone());
                admitted = a;
                // I5: the attempt count is on record as each attempt starts.
                st.ledger.enqueue_request(rec.clone());
            }
            Err(e) => return end_with(&st, rec, format, e, &signal),
        }
    }
}

fn alert_ejection(st: &AppState, signal: &Signal, channel: &str) {
    match signal.class {
        ErrorClass::Auth => st.alert(
            "critical",
            format!("Channel {channel} rejected its provider credential"),
            format!(
                "HTTP {}: the channel is out of rotation; fix the key behind it, then restore it in the console.",
                signal.http_status.unwrap_or(0)
            ),
            Some(channel.to_owned()),
        ),
        ErrorClass::Quota => st.alert(
            "critical",
            format!("Channel {channel} is out of provider quota"),
            format!(
                "{}: the channel is out of rotation until {}; raise the quota or billing limit with the provider.",
                signal.provider_error_type.as_deref().unwrap_or("quota"),
                match signal.retry_after_ms {
                    Some(ms) => format!("its reset in {} s", ms.div_ceil(1000)),
                    None => "an operator restores it".into(),
                }
            ),
            Some(channel.to_owned()),
        ),
        _ => {}
    }
}

/// How the loop stopped, for D7's answer.
struct Stopped<'a> {
    stop: Stop,
    /// Every failure was pacing or overload.
    all_rate: bool,
    /// The channel of the last attempt.
    channel: &'a str,
    /// The soonest a channel of the group takes work again.
    soonest: Option<Duration>,
}

/// D7: the failure the client gets once the loop stops.
async fn finish(
    job: &Job,
    mut rec: RequestRecord,
    mut att: AttemptRecord,
    signal: &Signal,
    end: Stopped<'_>,
) -> Response {
    let Stopped {
        stop,
        all_rate,
        channel,
        soonest,
    } = end;
    let retry_after = signal.retry_after_ms.map(Duration::from_millis).or(soonest);
    let n = rec.attempts;
    let plural = if n == 1 { "attempt" } else { "attempts" };
    let base = upstream::client_error(signal, channel);
    let err = match stop {
        // The channel's own credential or quota failed and no channel is left: the
        // failure stays visible (E2), and only an operator can change it.
        Stop::NoChannelLeft if signal_is_channel_fault(signal) => GatewayError::Upstream {
            kind: ErrorKind::Upstream,
            message: format!(
                "{base} No other channel serving model `{}` is in rotation; an operator must restore one.",
                job.parsed.model
            ),
            retry_after_ms: retry_after.map(ms),
            futile: soonest.is_none(),
        },
        _ => {
            let kind = if all_rate {
                ErrorKind::RateLimited
            } else {
                ErrorKind::Upstream
            };
            let why = match stop {
                Stop::AttemptBudgetExhausted => format!(" Gave up after {n} {plural}."),
                Stop::RetryAfterExceedsDeadline => format!(
                    " The provider asks for a wait of {} s, past this request's deadline ({n} {plural} made).",
                    retry_after.map_or(0, |d| d.as_millis().div_ceil(1000))
                ),
                Stop::NoChannelLeft => format!(" No other channel serves this model ({n} {plural} made)."),
                Stop::NotRetryable => " The gateway does not retry this outcome; an operator should look at it.".into(),
                Stop::PartialOutputCommitted => String::new(),
            };
            GatewayError::Upstream {
                kind,
                message: format!("{base}{why}"),
                retry_after_ms: retry_after.map(ms),
                // An outcome nobody recognises is held for a person (E2): a client retry
                // cannot tell more.
                futile: stop == Stop::NotRetryable,
            }
        }
    };
    let at = *att.finished_at.get_or_insert_with(now_ms);
    rec.fail(
        Some(err.kind().status()),
        signal.class.as_str(),
        upstream::truncate(err.to_string()),
        at,
    );
    let mut resp = err.into_response(job.format);
    upstream::gateway_headers(resp.headers_mut(), &rec);
    upstream::record(&job.st, rec, att).await;
    resp
}

fn signal_is_channel_fault(s: &Signal) -> bool {
    retry::retryability(s.class) == Retryability::ChannelFault
}

/// The loop could not get another slot (capacity busy within the wait, or every channel
/// gone): the request ends with that error; the last attempt's signal is its class.
fn end_with(st: &AppState, mut rec: RequestRecord, format: Format, err: GatewayError, last: &Signal) -> Response {
    let now = now_ms();
    let gone = matches!(err, GatewayError::ClientGone);
    rec.fail(
        // Nobody receives an answer to a client that left.
        (!gone).then(|| err.kind().status()),
        if gone { err.class() } else { last.class.as_str() },
        upstream::truncate(format!("{err} (after {} failed attempt(s))", rec.attempts)),
        now,
    );
    st.metrics.finished(&rec, true, now);
    let mut resp = err.into_response(format);
    upstream::gateway_headers(resp.headers_mut(), &rec);
    st.ledger.enqueue_request(rec);
    resp
}
