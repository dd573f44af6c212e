//! The attempt loop of one request: an attempt, the channel's health updated from its
//! signal (D6, E2), the F2 decision, then failover to another channel of the group (D1)
//! or a paced retry — until an answer, or a fail-closed end with D7's status. It reports
//! how the request ended; the request's [`Life`] closes it.
//!
//! The upstream call is a [`Caller`], so tests drive this loop directly on a paused clock
//! with scripted outcomes, and the gateway with real HTTP.

use crate::clock;
use crate::control::Outcome;
use crate::error::GatewayError;
use crate::life::{Answer, End, Life, ProviderRefusal};
use crate::retry::{self, Decision, Failure, Retryability, Stop};
use crate::routing::{self, Admitted};
use crate::state::{AppState, ChannelRt, Severity};
use crate::stream::Primed;
use crate::trace::TraceContext;
use bytes::Bytes;
use http::{HeaderMap, Uri};
use spillway_ledger::{AttemptRecord, Decision as Recorded};
use spillway_wire::{ErrorClass, ErrorKind, Format, ParsedRequest, Signal};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Everything the attempts of one request share.
pub struct Ctx {
    pub format: Format,
    pub api: spillway_wire::Api,
    pub uri: Uri,
    pub headers: HeaderMap,
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
    /// Cancelled when the client hangs up: a request waiting to retry then leaves at once
    /// (its key slot with it) and sends nothing more upstream (C4).
    pub client_gone: tokio_util::sync::CancellationToken,
    /// The route's breaker, retry budget and figures (F4, F5, G).
    pub route: Arc<crate::control::RouteControl>,
    /// G3: the request is a probation probe: one attempt, whose outcome decides.
    pub probe: Option<crate::control::Probe>,
    /// O1: the request's place in a recovery run's gate; its attempts' outcomes are O2's.
    pub gate: Option<crate::control::GateSlot>,
    /// O1: a recovery run's confirm probe: judged on its own route, never a fallback's.
    pub recovery_probe: bool,
    /// D4: the conversation, pinned to the channel that answers it.
    pub conversation: u64,
    /// M2: the gateway asked for the stream's usage (the client did not): the usage-only
    /// chunk is taken out of what the client sees.
    pub strip_usage: bool,
    /// F3, J8: upstream attempts this request may make (its workflow's, the config's, or
    /// one for a job's run).
    pub max_attempts: u32,
    /// J8: the request's workflow (J1, J7: its stream-recovery lane is where a stream
    /// waits to retry).
    pub workflow: Arc<spillway_policy::Workflow>,
    /// A job's run: its workflow's `attempt_timeout_ms` instead of the channel's. A job's
    /// run makes one attempt and never falls back itself: the job decides both.
    pub attempt_timeout: Option<Duration>,
}

/// What one upstream call brought back.
pub enum Attempt {
    /// A complete answer.
    Answer(Answer),
    /// A stream that showed output (or ended cleanly without any).
    Stream(Box<Primed>),
    /// The provider's own 400/404/413/422 (D3): the client gets it as it came.
    Rejected(ProviderRefusal),
    /// The attempt failed before the client saw anything.
    Failed { att: AttemptRecord, signal: Signal },
}

/// Makes an upstream call on an admitted channel slot.
pub trait Caller: Send + Sync + 'static {
    fn call(
        &self,
        st: &AppState,
        ctx: &Ctx,
        att: AttemptRecord,
        admitted: Admitted,
    ) -> impl Future<Output = Attempt> + Send;
}

/// What the client is told for a failed attempt.
pub(crate) fn client_error(signal: &Signal, channel: &str) -> GatewayError {
    let (kind, message) = match signal.class {
        ErrorClass::RateLimit => (
            ErrorKind::RateLimited,
            format!("Upstream channel `{channel}` is rate limiting this model. Retry after the indicated delay."),
        ),
        ErrorClass::Overload => (
            ErrorKind::Upstream,
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
            format!(
                "Upstream channel `{channel}` returned an answer the gateway cannot use ({}).",
                signal.message.as_deref().unwrap_or("not the provider's shape")
            ),
        ),
        ErrorClass::StreamInterrupted => (
            ErrorKind::Upstream,
            format!("Upstream channel `{channel}` broke off the stream before any output."),
        ),
        _ => (
            ErrorKind::Upstream,
            match signal.http_status {
                Some(s @ 300..=399) => format!(
                    "Upstream channel `{channel}` answered with a redirect (HTTP {s}), which the gateway does not follow."
                ),
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

/// Runs the request from its first admitted slot to its end.
pub async fn run<C: Caller>(ctx: &mut Ctx, life: &mut Life, caller: &C, first: Admitted) -> End {
    let st = life.st().clone();
    if let Err(e) = life.calling_api(&first.channel.cfg.name, first.waited).await {
        return End::refused(e);
    }
    let max_attempts = ctx.max_attempts;
    let max_hint = st.config.upstream.max_wait_hint_ms;
    let mut admitted = first;
    let mut tried: Vec<String> = Vec::new();
    // K1: attempts made before the request fell back to an approved route; the fallback
    // gets its own attempt budget, within the same deadline. One fallback per request.
    let mut attempts_before_fallback: Option<u32> = None;
    // D7: while every failure is a pacing 429 (or a capacity wait), running out answers
    // 429; any provider failure (5xx, 529, a timeout, an unreachable channel) makes it 502.
    let mut all_paced = true;
    loop {
        let channel = admitted.channel.clone();
        let name = channel.cfg.name.clone();
        if !tried.contains(&name) {
            tried.push(name.clone());
        }
        let att = life.begin_attempt(&name);
        let started = Instant::now();
        let outcome = caller.call(&st, ctx, att, admitted).await;
        life.attempt_returned();
        // D4, D5, G1: what the attempt says about the channel's and the route's health.
        let health = match &outcome {
            Attempt::Answer(_) | Attempt::Stream(_) => Outcome::Success,
            Attempt::Rejected(_) => Outcome::Neutral,
            Attempt::Failed { signal, .. } => crate::control::outcome_of(signal),
        };
        let latency = started.elapsed();
        let now = Instant::now();
        // D5: a channel alone in its group may leave rotation (its upstream is protected);
        // among several, not the last one in rotation (the route's breaker takes over).
        let may_eject = ctx.candidates.len() <= 1
            || ctx
                .candidates
                .iter()
                .any(|c| !Arc::ptr_eq(c, &channel) && c.health.check(0, now).is_ok());
        if let Some(t) = channel.health.observe_outcome(health, latency, now, may_eject) {
            st.control.channel_moved(&st, &channel, t, "gateway");
        }
        ctx.route.on_attempt(&st, health, latency, ctx.probe.as_mut());
        if let Some(g) = &ctx.gate {
            g.outcome(health);
        }
        let (mut att, mut signal) = match outcome {
            Attempt::Answer(a) => {
                st.control.pin(ctx.conversation, &channel);
                return End::Answer(a);
            }
            Attempt::Stream(p) => {
                st.control.pin(ctx.conversation, &channel);
                return End::Stream(p);
            }
            Attempt::Rejected(r) => return End::PassThrough(r),
            Attempt::Failed { att, signal } => (att, signal),
        };
        // A provider asking for an absurd wait is taken to mean the longest wait believed.
        signal.retry_after_ms = signal.retry_after_ms.map(|v| v.min(max_hint));
        att.retry_after_ms = signal.retry_after_ms;
        let now = Instant::now();
        if channel.health.observe_failure(&signal, &name, now) {
            alert_ejection(&st, &signal, &name);
        }
        // R2: a pause or an ejection is the fleet's, not this instance's alone.
        if st.shared.is_some()
            && (matches!(signal.class, ErrorClass::Auth | ErrorClass::Quota)
                || matches!(signal.class, ErrorClass::RateLimit | ErrorClass::Overload)
                    && signal.retry_after_ms.is_some_and(|ms| ms > 0))
        {
            crate::control::share_rotation(&st, &channel);
        }
        all_paced &= signal.class == ErrorClass::RateLimit;

        let remaining = ctx.deadline.saturating_duration_since(now);
        let survey = routing::survey(&ctx.candidates, ctx.tokens, &tried, now);
        let decision = match retry::retryability(signal.class) {
            Retryability::Never => Decision::FailClosed(Stop::NotRetryable),
            // A request on which the provider acts by itself is run again only when the
            // provider answered that it did not start it (rate limit, overload, the
            // channel's key or quota). A timeout, a 5xx, a cut or a reset may have come
            // after a tool ran.
            _ if ctx.parsed.acts_upstream && !retry::provider_did_not_start(signal.class) => {
                Decision::FailClosed(Stop::ProviderMayHaveActed)
            }
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
                    attempts: life.rec.attempts - attempts_before_fallback.unwrap_or(0),
                    max_attempts,
                    hint,
                    failover_ready: survey.untried_ready,
                    remaining,
                };
                retry::decide(f, now, retry::full_jitter)
            }
        };
        // G2: once the route's breaker is not closed (this attempt may have opened it, or
        // it was a probe) nothing more is sent. F4: a retry needs room in the budget.
        let mut budget_wait = None;
        let decision = match decision {
            d @ (Decision::RetryNow { .. } | Decision::Queue { .. }) => {
                if ctx.probe.is_some() || !ctx.route.sending() {
                    Decision::FailClosed(Stop::BreakerOpen)
                } else if ctx.route.retries_held() {
                    Decision::FailClosed(Stop::RecoveryHold)
                } else if let Err(w) = ctx.route.try_retry() {
                    budget_wait = Some(w);
                    Decision::FailClosed(Stop::RetryBudgetExhausted)
                } else {
                    d
                }
            }
            d => d,
        };

        // K1, F2: out of attempts, before any output reached the client (a stream that
        // showed output never comes back here): the workflow's approved fallback, when its
        // contract holds and its breaker lets it send.
        if decision == Decision::FailClosed(Stop::AttemptBudgetExhausted)
            && attempts_before_fallback.is_none()
            && ctx.probe.is_none()
            && !ctx.recovery_probe
            && ctx.attempt_timeout.is_none()
            && let Some((route, candidates, rewritten)) = fallback_for(&st, ctx, life)
        {
            let now = Instant::now();
            let max_wait = ctx.capacity_wait_left.min(ctx.deadline.saturating_duration_since(now));
            let old_candidates = std::mem::replace(&mut ctx.candidates, candidates);
            match routing::admit(&ctx.candidates, ctx.tokens, &[], max_wait, life.wait_guard()).await {
                Ok(a) => {
                    att.decision = Some(Recorded::Failover);
                    att.message = Some(format!(
                        "{}; falling back to {} under workflow `{}`",
                        att.message.as_deref().unwrap_or("attempts exhausted"),
                        route.name,
                        ctx.workflow.name
                    ));
                    life.record_attempt(att).await;
                    if let Some(w) = a.waited {
                        ctx.capacity_wait_left = ctx.capacity_wait_left.saturating_sub(w);
                    }
                    attempts_before_fallback = Some(life.rec.attempts);
                    let (model, uri, body) = rewritten;
                    life.fell_back(&route.name, &model);
                    ctx.parsed.model = model;
                    ctx.uri = uri;
                    ctx.body = body;
                    ctx.route = route;
                    // O1: the fallback is not the held route: its gate place goes back.
                    ctx.gate = None;
                    tried.clear();
                    life.next_attempt(&a.channel.cfg.name, a.waited).await;
                    admitted = a;
                    continue;
                }
                Err(_) => ctx.candidates = old_candidates,
            }
        }
        let delay = match decision {
            Decision::FailClosed(stop) => {
                att.decision = Some(Recorded::FailClosed);
                att.decision_reason = Some(stop);
                let wait = match stop {
                    Stop::BreakerOpen => ctx.route.retry_after(),
                    Stop::RetryBudgetExhausted => budget_wait,
                    _ => None,
                };
                let soonest = wait.or(survey.soonest).or(survey.cooling);
                let err = stopped(life.rec.attempts, &signal, &name, stop, all_paced, soonest);
                return End::Error {
                    err,
                    class: Some(signal.class),
                    att: Some(att),
                };
            }
            Decision::RetryNow { delay } => {
                att.decision = Some(if survey.untried_ready {
                    Recorded::Failover
                } else {
                    Recorded::Retry
                });
                delay
            }
            Decision::Queue { ready_at } => {
                att.decision = Some(Recorded::Wait);
                ready_at.saturating_duration_since(now)
            }
        };
        // J1, J7: a stream waiting to retry before its first token is in the
        // stream-recovery lane; a full lane ends it now rather than queue it.
        let recovering = if ctx.parsed.stream {
            let max = ctx.workflow.stream_recovery.max_length;
            match st.jobs.enter_stream_recovery(max) {
                Some(g) => Some(g),
                None => {
                    att.decision = Some(Recorded::FailClosed);
                    att.decision_reason = Some(Stop::LaneFull);
                    let err = GatewayError::LaneFull {
                        lane: crate::jobs::STREAM_RECOVERY,
                        workflow: ctx.workflow.name.clone(),
                        length: max as usize,
                        max,
                        advice: "Retry after the indicated delay.",
                        retry_after_s: crate::error::retry_after_secs(delay),
                    };
                    return End::Error {
                        err,
                        class: Some(signal.class),
                        att: Some(att),
                    };
                }
            }
        } else {
            None
        };
        att.delay_ms = Some(clock::ms(delay));
        let ready_at = clock::now().plus(delay);
        att.ready_at = Some(ready_at);
        life.record_attempt(att).await;
        if delay > retry::QUEUE_THRESHOLD {
            // F1, I5: a long wait is on record before it starts.
            life.wait_until(ready_at).await;
        }
        // No channel slot is held while waiting (F1); the deadline bounds the wait, and a
        // client that hangs up ends it.
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = ctx.client_gone.cancelled() => return End::refused(GatewayError::ClientGone),
        }
        drop(recovering);

        let now = Instant::now();
        let max_wait = ctx.capacity_wait_left.min(ctx.deadline.saturating_duration_since(now));
        match routing::admit(&ctx.candidates, ctx.tokens, &tried, max_wait, life.wait_guard()).await {
            Ok(_) if ctx.client_gone.is_cancelled() => return End::refused(GatewayError::ClientGone),
            // G2: the breaker may have opened while this request waited to retry.
            Ok(_) if !ctx.route.sending() => {
                let err = stopped(
                    life.rec.attempts,
                    &signal,
                    &name,
                    Stop::BreakerOpen,
                    all_paced,
                    ctx.route.retry_after(),
                );
                return End::Error {
                    err,
                    class: Some(signal.class),
                    att: None,
                };
            }
            Ok(a) => {
                if let Some(w) = a.waited {
                    ctx.capacity_wait_left = ctx.capacity_wait_left.saturating_sub(w);
                }
                life.next_attempt(&a.channel.cfg.name, a.waited).await;
                admitted = a;
            }
            Err(e) => {
                // The loop could not get another slot: the last attempt's class tells why
                // the request failed, the error what the client hears. D7: capacity alone
                // is a 429 only while every attempt so far was paced; after a provider
                // failure it is the provider's 502, with the capacity's retry-after.
                let err = match e {
                    GatewayError::CapacityBusy { retry_after_s }
                    | GatewayError::CapacityQueueFull { retry_after_s }
                        if !all_paced =>
                    {
                        let base = client_error(&signal, &name);
                        GatewayError::Upstream {
                            kind: ErrorKind::Upstream,
                            message: format!(
                                "{base} No channel had room for another attempt within the capacity wait."
                            ),
                            retry_after_ms: Some(retry_after_s.saturating_mul(1000)),
                            futile: false,
                        }
                    }
                    e => e,
                };
                return End::Error {
                    err,
                    class: Some(signal.class),
                    att: None,
                };
            }
        }
    }
}

/// K1: the approved fallback of the request's workflow from its route whose contract
/// holds and whose breaker is closed: its control, its channel group, and the request
/// rewritten for it (model, path, body).
#[allow(clippy::type_complexity)]
fn fallback_for(
    st: &Arc<AppState>,
    ctx: &Ctx,
    life: &Life,
) -> Option<(
    Arc<crate::control::RouteControl>,
    Vec<Arc<ChannelRt>>,
    (String, Uri, Bytes),
)> {
    let from = format!("{}/{}", ctx.format, ctx.parsed.model);
    let routes = ctx.workflow.fallbacks_from(&from);
    if routes.is_empty() || !ctx.workflow.fallback.allowed_before_first_token {
        return None;
    }
    // The contract reads the request as a job would be read: its body, its estimate.
    let probe = spillway_ledger::JobRecord {
        format: ctx.format.as_str().to_owned(),
        api: crate::jobs::api_str(ctx.api).to_owned(),
        body: Some(ctx.body.to_vec()),
        estimated_input_tokens: life.rec.estimated_input_tokens,
        estimated_output_tokens: life.estimated_output_tokens(),
        ..Default::default()
    };
    for r in routes {
        if crate::contract::check(st, &ctx.workflow, &probe, r) != crate::contract::Verdict::Holds {
            continue;
        }
        let (_, model) = crate::jobs::split_route(&r.to)?;
        let route = st.control.route(st, ctx.format, model);
        // O1: a route a recovery run holds takes no one else's overflow.
        if !route.sending() || route.retries_held() {
            continue;
        }
        let candidates = routing::candidates(st, ctx.format, model, None);
        if candidates.is_empty() {
            continue;
        }
        let rewritten = crate::jobs::retarget_request(ctx.format, &ctx.parsed.model, model, &ctx.uri, &ctx.body)?;
        return Some((route, candidates, rewritten));
    }
    None
}

fn alert_ejection(st: &AppState, signal: &Signal, channel: &str) {
    match signal.class {
        ErrorClass::Auth => st.alert(
            Severity::Critical,
            format!("Channel {channel} rejected its provider credential"),
            format!(
                "HTTP {}: the channel is out of rotation; fix the key behind it, then restore it in the console.",
                signal.http_status.unwrap_or(0)
            ),
            Some(channel.to_owned()),
        ),
        ErrorClass::Quota => st.alert(
            Severity::Critical,
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

/// D7: the failure the client gets once the loop stops.
fn stopped(
    attempts: u32,
    signal: &Signal,
    channel: &str,
    stop: Stop,
    all_paced: bool,
    soonest: Option<Duration>,
) -> GatewayError {
    let retry_after = signal.retry_after_ms.map(Duration::from_millis).or(soonest);
    let plural = if attempts == 1 { "attempt" } else { "attempts" };
    let base = client_error(signal, channel);
    if stop == Stop::NoChannelLeft && retry::retryability(signal.class) == Retryability::ChannelFault {
        // The channel's own credential or quota failed and no channel is left: the
        // failure stays visible (E2), and only an operator can change it.
        return GatewayError::Upstream {
            kind: ErrorKind::Upstream,
            message: format!(
                "{base} No other channel serving this model is in rotation; an operator must restore one."
            ),
            retry_after_ms: retry_after.map(clock::ms),
            futile: soonest.is_none(),
        };
    }
    let kind = if all_paced {
        ErrorKind::RateLimited
    } else {
        ErrorKind::Upstream
    };
    let why = match stop {
        Stop::AttemptBudgetExhausted => format!(" Gave up after {attempts} {plural}."),
        Stop::RetryAfterExceedsDeadline => format!(
            " The provider asks for a wait of {} s, past this request's deadline ({attempts} {plural} made).",
            retry_after.map_or(0, |d| d.as_millis().div_ceil(1000))
        ),
        Stop::NoChannelLeft => format!(" No other channel serves this model ({attempts} {plural} made)."),
        Stop::NotRetryable => " The gateway does not retry this outcome; an operator should look at it.".into(),
        Stop::BreakerOpen => format!(
            " The route's circuit breaker is not closed, so nothing more was sent upstream ({attempts} {plural} made)."
        ),
        Stop::RetryBudgetExhausted => format!(
            " The route's retry budget is spent (retries are held to a share of new requests while the upstream fails), so this failure was not retried ({attempts} {plural} made)."
        ),
        _ => String::new(),
    };
    GatewayError::Upstream {
        kind,
        message: format!("{base}{why}"),
        retry_after_ms: retry_after.map(clock::ms),
        // An outcome nobody recognises is held for a person (E2): a client retry cannot
        // tell more.
        futile: stop == Stop::NotRetryable,
    }
}
