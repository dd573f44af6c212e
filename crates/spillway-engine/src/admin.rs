//! The console's admin API under `/admin/v1/` (JSON, plus a server-sent event stream) and
//! the admin token that guards it (P2). No CORS: a page from another origin gets nothing,
//! and a request that says it comes from another origin is refused outright.

use crate::clock;
use crate::control::RouteControlView;
use crate::metrics::{Headline, Rejection, RouteFigures, SeriesPoint};
use crate::state::AppState;
use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rand::Rng;
use serde::{Deserialize, Serialize};
use spillway_ledger::{
    AttemptRecord, AuditEntry, LedgerFigures, LedgerHealth, PruneReport, Reconcile, Reconciliation, RequestRecord,
    Search,
};
use spillway_wire::{Format, UnixMs};
use std::convert::Infallible;
use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::Duration;
use subtle::ConstantTimeEq;
use ts_rs::TS;

/// How often the live stream sends a tick: the UI's refresh rate, whatever the traffic.
const TICK: Duration = Duration::from_secs(1);

/// The admin token: made on first run, kept in the data directory readable by its owner
/// only (0600), compared in constant time.
#[derive(Clone)]
pub struct AdminToken(String);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

impl AdminToken {
    pub fn new(secret: String) -> AdminToken {
        AdminToken(secret)
    }

    pub fn secret(&self) -> &str {
        &self.0
    }

    pub fn matches(&self, presented: &str) -> bool {
        self.0.as_bytes().ct_eq(presented.as_bytes()).into()
    }

    /// Reads `dir/admin-token`, creating it (mode 0600) on first run.
    pub fn load_or_create(dir: &FsPath) -> std::io::Result<AdminToken> {
        let path = dir.join("admin-token");
        match std::fs::read_to_string(&path) {
            Ok(s) if !s.trim().is_empty() => return Ok(AdminToken(s.trim().to_owned())),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::fs::create_dir_all(dir)?;
        let token = format!(
            "swa_{:032x}{:016x}",
            rand::rng().random::<u128>(),
            rand::rng().random::<u64>()
        );
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600);
        }
        use std::io::Write;
        let mut f = opts.open(&path)?;
        f.write_all(token.as_bytes())?;
        f.sync_all()?;
        Ok(AdminToken(token))
    }
}

/// A channel as the console shows it.
#[derive(Clone, Debug, Serialize, TS)]
pub struct ChannelView {
    pub name: String,
    pub format: Format,
    pub base_url: String,
    /// Whether calls go to a real provider with a key, or to an unauthenticated endpoint
    /// such as the simulator.
    pub has_credential: bool,
    pub models: Vec<String>,
    pub in_flight: u32,
    pub max_concurrency: u32,
    /// Rotation: `ready`, `paced` (a provider's wait hint, D6) or `ejected` (credential or
    /// quota refused, E2), with the reason, time left and E3's reported room.
    pub health: crate::health::HealthView,
}

/// Everything the overview shows, at connect time.
#[derive(Clone, Debug, Serialize, TS)]
pub struct Overview {
    pub now: UnixMs,
    pub headline: Headline,
    pub series: Vec<SeriesPoint>,
    pub routes: Vec<RouteFigures>,
    pub channels: Vec<ChannelView>,
    /// Breakers, retry budgets and amplification per route `format/model` (F4, F5, G4).
    pub control: Vec<RouteControlView>,
    /// Requests refused before they had a valid key, newest first.
    pub rejections: Vec<Rejection>,
    /// Whether the ledger is taking writes.
    pub ledger: LedgerHealth,
    /// Unknown outcomes and duplicates per route, and the ledger's size (N1, I6).
    pub ledger_figures: Option<LedgerFigures>,
    /// J1, J7: lane depths per route and per workflow.
    pub lanes: crate::inbox::LanesView,
}

/// One live update: the newest second and the current tables.
#[derive(Clone, Debug, Serialize, TS)]
pub struct Tick {
    pub now: UnixMs,
    pub headline: Headline,
    pub point: SeriesPoint,
    pub routes: Vec<RouteFigures>,
    pub channels: Vec<ChannelView>,
    pub control: Vec<RouteControlView>,
    pub rejections: Vec<Rejection>,
    pub ledger: LedgerHealth,
    pub ledger_figures: Option<LedgerFigures>,
    pub lanes: crate::inbox::LanesView,
}

/// A request with every attempt.
#[derive(Clone, Debug, Serialize, TS)]
pub struct RequestDetail {
    pub request: RequestRecord,
    pub attempts: Vec<AttemptRecord>,
    /// M1: how the request's cost is computed, at the catalog in force now (its version
    /// is `pricing_version`; a different one is named).
    pub cost_breakdown: Option<String>,
}

/// An admin API error.
#[derive(Clone, Debug, Serialize, TS)]
pub struct AdminError {
    pub error: String,
}

pub(crate) fn admin_error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, axum::Json(AdminError { error: msg.into() })).into_response()
}

fn channels(st: &AppState) -> Vec<ChannelView> {
    st.channels
        .iter()
        .map(|c| ChannelView {
            name: c.cfg.name.clone(),
            format: c.cfg.format,
            base_url: c.cfg.base_url.clone(),
            has_credential: c.cfg.api_key.is_some(),
            models: c.cfg.models.clone(),
            in_flight: c.in_flight(),
            max_concurrency: c.cfg.max_concurrency,
            health: c.health.view(tokio::time::Instant::now()),
        })
        .collect()
}

fn overview(st: &AppState) -> Overview {
    let now_ms = clock::now();
    let now = now_ms.0.div_euclid(1000);
    Overview {
        now: now_ms,
        headline: st.metrics.headline(now),
        series: st.metrics.series(now - crate::metrics::WINDOW_SECONDS as i64 + 1, now),
        routes: st.metrics.routes(),
        channels: channels(st),
        control: st.control.views(st),
        rejections: st.metrics.rejections(),
        ledger: st.ledger.health(),
        ledger_figures: figures(st),
        lanes: crate::inbox::lanes_view(st),
    }
}

fn figures(st: &AppState) -> Option<LedgerFigures> {
    st.ledger_figures.read().unwrap_or_else(|p| p.into_inner()).clone()
}

fn tick(st: &AppState) -> Tick {
    let now_ms = clock::now();
    let now = now_ms.0.div_euclid(1000);
    let point = st.metrics.series(now, now).pop().unwrap_or(SeriesPoint {
        at: UnixMs(now * 1000),
        requests: 0,
        errors: 0,
        rejected: 0,
        p50_ms: None,
        p95_ms: None,
        in_flight: 0,
    });
    Tick {
        now: now_ms,
        headline: st.metrics.headline(now),
        point,
        routes: st.metrics.routes(),
        channels: channels(st),
        control: st.control.views(st),
        rejections: st.metrics.rejections(),
        ledger: st.ledger.health(),
        ledger_figures: figures(st),
        lanes: crate::inbox::lanes_view(st),
    }
}

/// The authority (`host[:port]`) an `Origin` header names.
fn origin_authority(origin: &str) -> Option<&str> {
    origin.split_once("://").map(|(_, rest)| rest.trim_end_matches('/'))
}

async fn require_token(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    // The console is same-origin; a request a browser sends on behalf of another origin is
    // refused before the token is even looked at (no CORS, and no cross-origin answers).
    if let Some(origin) = req.headers().get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        let host = req
            .uri()
            .authority()
            .map(|a| a.as_str())
            .or_else(|| req.headers().get(header::HOST).and_then(|v| v.to_str().ok()));
        if origin_authority(origin) != host || host.is_none() {
            return admin_error(
                StatusCode::FORBIDDEN,
                "The admin API answers its own console only (cross-origin requests are refused).",
            );
        }
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match (presented, &st.admin_token) {
        (Some(p), Some(t)) if t.matches(p) => next.run(req).await,
        (None, _) => admin_error(
            StatusCode::UNAUTHORIZED,
            "Missing admin token. Send it as `Authorization: Bearer <token>` (see `spillway admin-token`).",
        ),
        _ => admin_error(StatusCode::UNAUTHORIZED, "Wrong admin token."),
    }
}

async fn get_overview(State(st): State<Arc<AppState>>) -> Response {
    axum::Json(overview(&st)).into_response()
}

async fn events(State(st): State<Arc<AppState>>) -> Response {
    // One full overview, then one small tick per second: the UI's cost does not grow with
    // the gateway's traffic.
    let first = futures_util::stream::once({
        let st = st.clone();
        async move { Event::default().event("overview").json_data(overview(&st)) }
    });
    // Alerts go out as they happen, between ticks.
    let alerts = futures_util::stream::unfold(st.alerts.subscribe(), |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(a) => return Some((Event::default().event("alert").json_data(a), rx)),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    let draining = st.shutdown.draining.clone();
    let ticks = futures_util::stream::unfold(st, |st| async move {
        tokio::time::sleep(TICK).await;
        let ev = Event::default().event("tick").json_data(tick(&st));
        Some((ev, st))
    });
    use futures_util::StreamExt;
    // A shutdown ends the stream, so an open console never holds the gateway up.
    let stream = futures_util::stream::select(first.chain(ticks), alerts)
        .take_until(draining.cancelled_owned())
        .map(|e| Ok::<_, Infallible>(e.unwrap_or_else(|_| Event::default().comment("encode error"))));
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

async fn search(State(st): State<Arc<AppState>>, Query(q): Query<Search>) -> Response {
    match st.ledger.search(&q).await {
        Ok(page) => axum::Json(page).into_response(),
        Err(e) => admin_error(StatusCode::INTERNAL_SERVER_ERROR, format!("ledger search failed: {e}")),
    }
}

async fn detail(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id.len() > 64 {
        return admin_error(StatusCode::NOT_FOUND, "No request with that id.");
    }
    match st.ledger.get_request(&id).await {
        Ok(Some(request)) => match st.ledger.attempts(&id).await {
            Ok(attempts) => {
                let cost_breakdown = cost_breakdown(&st, &request);
                axum::Json(RequestDetail {
                    request,
                    attempts,
                    cost_breakdown,
                })
                .into_response()
            }
            Err(e) => admin_error(StatusCode::INTERNAL_SERVER_ERROR, format!("ledger read failed: {e}")),
        },
        Ok(None) => admin_error(StatusCode::NOT_FOUND, "No request with that id."),
        Err(e) => admin_error(StatusCode::INTERNAL_SERVER_ERROR, format!("ledger read failed: {e}")),
    }
}

/// The final attempt's tokens priced as the request's cost was (see M1, M3).
fn cost_breakdown(st: &AppState, r: &RequestRecord) -> Option<String> {
    let pricing = st.accounts.pricing();
    let model = r.served_model.as_deref().or(r.requested_model.as_deref())?;
    let Some(price) = pricing.price(model) else {
        return Some(format!(
            "unknown: the pricing catalog {} has no price for {model}",
            pricing.version
        ));
    };
    let u = spillway_wire::Usage {
        input_tokens: r.input_tokens,
        output_tokens: r.output_tokens,
        cached_input_tokens: r.cached_input_tokens,
        cache_creation_tokens: r.cache_write_tokens,
        reasoning_tokens: r.reasoning_tokens,
    };
    let b = u.billable(r.format)?;
    let c = price.cost(&b);
    let mut s = format!("{} = ${:.6} ({model}, checked {})", c.breakdown, c.usd, price.checked);
    if let Some(f) = r.failed_cost_usd.filter(|f| *f > 0.0) {
        s.push_str(&format!(" + ${f:.6} for failed attempts"));
    }
    if r.pricing_version.as_deref().is_some_and(|v| v != pricing.version) {
        s.push_str(&format!(
            "; priced when it ran with catalog {}, shown with {}",
            r.pricing_version.as_deref().unwrap_or_default(),
            pricing.version
        ));
    }
    Some(s)
}

/// Who acts and why: every manual change to rotation or a breaker is on the record (G4).
#[derive(Clone, Debug, Deserialize, TS)]
#[serde(deny_unknown_fields)]
pub struct OperatorAction {
    /// The operator's name, as the audit log shows it.
    pub actor: String,
    pub reason: String,
}

/// An operator opens or closes a route's breaker.
#[derive(Clone, Debug, Deserialize, TS)]
#[serde(deny_unknown_fields)]
pub struct BreakerAction {
    /// The route, `format/model` (`openai/gpt-4o-mini`).
    pub route: String,
    pub actor: String,
    pub reason: String,
}

/// The audit log's filter.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    pub kind: Option<String>,
    pub subject: Option<String>,
    pub limit: Option<u32>,
}

/// A name a client sent, as an error shows it: printable ASCII only, at most 64 characters.
pub(crate) fn shown_name(s: &str) -> String {
    s.chars()
        .take(64)
        .map(|c| if c.is_ascii_graphic() { c } else { '?' })
        .collect()
}

/// The actor and reason, checked: both present, printable, bounded. The error is what
/// the 422 says.
pub(crate) fn checked(actor: &str, reason: &str) -> Result<(String, String), String> {
    let (actor, reason) = (actor.trim(), reason.trim());
    let bad = |s: &str, max: usize| s.is_empty() || s.chars().count() > max || s.chars().any(char::is_control);
    if bad(actor, 64) {
        return Err("`actor`: give the operator's name (1-64 printable characters).".into());
    }
    if bad(reason, 500) {
        return Err("`reason`: say why (1-500 printable characters); it goes on the audit log.".into());
    }
    Ok((actor.to_owned(), reason.to_owned()))
}

pub(crate) fn json_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| {
        format!(
            "The body is not the expected JSON: {}",
            e.to_string().split(" at line").next().unwrap_or("")
        )
    })
}

pub(crate) fn unprocessable(msg: String) -> Response {
    admin_error(StatusCode::UNPROCESSABLE_ENTITY, msg)
}

/// E2, D5: an operator puts an ejected, paced or cooling channel back into rotation, on
/// the record with who and why. A body is optional for older consoles: without one, the
/// audit log says so.
async fn restore_channel(
    State(st): State<Arc<AppState>>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let Some(c) = st.channels.iter().find(|c| c.cfg.name == name) else {
        return admin_error(StatusCode::NOT_FOUND, "No channel by that name.");
    };
    let (actor, reason) = if body.is_empty() {
        ("operator".to_owned(), "restored from the console".to_owned())
    } else {
        match json_body::<OperatorAction>(&body).and_then(|a| checked(&a.actor, &a.reason)) {
            Ok(v) => v,
            Err(m) => return unprocessable(m),
        }
    };
    if c.health.restore() {
        tracing::warn!(channel = %name, actor, "channel restored to rotation by an operator");
        crate::control::share_rotation(&st, c);
        if let Err(e) = st.control.channel_restored(&st, c, &actor, &reason).await {
            return admin_error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("restored, but the ledger could not record it: {e}"),
            );
        }
    }
    axum::Json(channels(&st).into_iter().find(|v| v.name == name)).into_response()
}

/// G4: an operator opens or closes a route's breaker with a reason, on the record before
/// the answer.
async fn breaker_action(st: Arc<AppState>, body: axum::body::Bytes, open: bool) -> Response {
    let a: BreakerAction = match json_body(&body) {
        Ok(a) => a,
        Err(m) => return unprocessable(m),
    };
    let (actor, reason) = match checked(&a.actor, &a.reason) {
        Ok(v) => v,
        Err(m) => return unprocessable(m),
    };
    let Some((format, model)) = a.route.split_once('/') else {
        return admin_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "`route`: expected `format/model`, e.g. `openai/gpt-4o-mini`.",
        );
    };
    let Ok(format) = format.parse::<Format>() else {
        return admin_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "`route`: the format is one of openai, anthropic, gemini.",
        );
    };
    if !spillway_wire::request::valid_model_name(model) {
        return unprocessable("`route`: the model part is not a model name.".into());
    }
    let served = st
        .channels
        .iter()
        .any(|c| c.cfg.format == format && c.cfg.serves(model));
    let route = match st.control.get(&a.route) {
        Some(r) => r,
        None if !served => return admin_error(StatusCode::NOT_FOUND, "No channel serves that route."),
        // Past the route table's size, new models share one breaker: forcing it would
        // stop every one of them, which is not what the operator asked for.
        None if !st.control.has_own_route(format, model) => {
            return admin_error(
                StatusCode::CONFLICT,
                "That route has no breaker of its own (the route table is full; new models share one). Nothing was changed.",
            );
        }
        None => st.control.route(&st, format, model),
    };
    match st.control.force(&st, &route, open, &actor, &reason).await {
        Ok(_) => axum::Json(route.view("")).into_response(),
        Err(e) => admin_error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the ledger could not record the change: {e}"),
        ),
    }
}

async fn open_breaker(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    breaker_action(st, body, true).await
}

async fn close_breaker(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    breaker_action(st, body, false).await
}

/// G4: the audit log, newest first.
async fn audit(State(st): State<Arc<AppState>>, Query(q): Query<AuditQuery>) -> Response {
    match st
        .ledger
        .audit(
            q.kind.as_deref(),
            q.subject.as_deref(),
            q.limit.unwrap_or(100).min(1000),
        )
        .await
    {
        Ok(v) => axum::Json::<Vec<AuditEntry>>(v).into_response(),
        Err(e) => admin_error(StatusCode::INTERNAL_SERVER_ERROR, format!("ledger read failed: {e}")),
    }
}

/// The unknown-outcome inbox's filter.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnknownsQuery {
    pub limit: Option<u32>,
}

/// I4: the requests whose outcome is unknown, newest first, each with its evidence (its
/// attempts: channels, upstream request ids, times, errors).
async fn unknowns(State(st): State<Arc<AppState>>, Query(q): Query<UnknownsQuery>) -> Response {
    let list = match st.ledger.unknowns(q.limit.unwrap_or(100).clamp(1, 500)).await {
        Ok(l) => l,
        Err(e) => return admin_error(StatusCode::INTERNAL_SERVER_ERROR, format!("ledger read failed: {e}")),
    };
    let mut out = Vec::with_capacity(list.len());
    for request in list {
        match st.ledger.attempts(&request.id).await {
            Ok(attempts) => out.push(RequestDetail {
                cost_breakdown: cost_breakdown(&st, &request),
                request,
                attempts,
            }),
            Err(e) => return admin_error(StatusCode::INTERNAL_SERVER_ERROR, format!("ledger read failed: {e}")),
        }
    }
    axum::Json(out).into_response()
}

/// A result id an owner attaches: printable, bounded.
fn checked_result_id(r: &Reconcile) -> Result<Option<String>, String> {
    let id = r.result_id.as_deref().map(str::trim).filter(|v| !v.is_empty());
    match (r.outcome, id) {
        (Reconciliation::ConfirmedDone, None) => Err(
            "`result_id`: confirming a request as done needs the result it produced (a response id, a message id)."
                .into(),
        ),
        (_, Some(v)) if v.chars().count() > 256 || v.chars().any(char::is_control) => {
            Err("`result_id`: 1-256 printable characters.".into())
        }
        (_, v) => Ok(v.map(str::to_owned)),
    }
}

/// I4: an owner reconciles an unknown request, with name and reason, audited. "Confirmed
/// not executed" lets its idempotency key run again; "confirmed done" never will.
async fn reconcile(State(st): State<Arc<AppState>>, Path(id): Path<String>, body: axum::body::Bytes) -> Response {
    let r: Reconcile = match json_body(&body) {
        Ok(r) => r,
        Err(m) => return unprocessable(m),
    };
    let (actor, reason) = match checked(&r.actor, &r.reason) {
        Ok(v) => v,
        Err(m) => return unprocessable(m),
    };
    let result_id = match checked_result_id(&r) {
        Ok(v) => v,
        Err(m) => return unprocessable(m),
    };
    if id.len() > 64 {
        return admin_error(StatusCode::NOT_FOUND, "No request with that id.");
    }
    let r = Reconcile {
        outcome: r.outcome,
        result_id,
        actor,
        reason,
    };
    match st.ledger.reconcile(&id, &r, clock::now()).await {
        Ok(rec) => {
            tracing::warn!(request_id = %id, actor = %r.actor, outcome = r.outcome.as_str(), "unknown request reconciled");
            axum::Json(rec).into_response()
        }
        Err(spillway_ledger::Error::NotFound) => admin_error(StatusCode::NOT_FOUND, "No request with that id."),
        Err(spillway_ledger::Error::Conflict(m)) => admin_error(StatusCode::CONFLICT, m),
        Err(e) => admin_error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the ledger could not record the reconciliation: {e}"),
        ),
    }
}

/// I4 in bulk: an owner confirms a checked selection of unknown requests as not executed
/// (after a provider outage, or a crash whose calls the provider's logs do not show), one
/// reason for all, each on the audit log. "Confirmed done" needs a result id per request,
/// so it is one at a time.
#[derive(Clone, Debug, Deserialize, TS)]
#[serde(deny_unknown_fields)]
pub struct BulkReconcile {
    /// At most 500 request ids.
    pub ids: Vec<String>,
    pub actor: String,
    pub reason: String,
}

/// What a bulk reconciliation did.
#[derive(Clone, Debug, Serialize, TS)]
pub struct BulkReconciled {
    pub reconciled: u32,
    /// Requests left as they were, with why (no longer unknown, not found).
    pub refused: Vec<BulkRefusal>,
}

#[derive(Clone, Debug, Serialize, TS)]
pub struct BulkRefusal {
    pub id: String,
    pub error: String,
}

async fn reconcile_bulk(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let b: BulkReconcile = match json_body(&body) {
        Ok(b) => b,
        Err(m) => return unprocessable(m),
    };
    let (actor, reason) = match checked(&b.actor, &b.reason) {
        Ok(v) => v,
        Err(m) => return unprocessable(m),
    };
    if b.ids.is_empty() || b.ids.len() > 500 {
        return unprocessable("`ids`: 1 to 500 request ids, the explicit selection.".into());
    }
    let r = Reconcile {
        outcome: Reconciliation::ConfirmedNotExecuted,
        result_id: None,
        actor,
        reason,
    };
    let mut out = BulkReconciled {
        reconciled: 0,
        refused: Vec::new(),
    };
    let mut ids = b.ids;
    ids.sort();
    ids.dedup();
    for id in ids {
        let result = if id.len() > 64 {
            Err(spillway_ledger::Error::NotFound)
        } else {
            st.ledger.reconcile(&id, &r, clock::now()).await
        };
        match result {
            Ok(_) => out.reconciled += 1,
            Err(spillway_ledger::Error::NotFound) => out.refused.push(BulkRefusal {
                id,
                error: "No request with that id.".into(),
            }),
            Err(spillway_ledger::Error::Conflict(m)) => out.refused.push(BulkRefusal { id, error: m }),
            Err(e) => {
                return admin_error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "the ledger stopped taking reconciliations after {} of them: {e}",
                        out.reconciled
                    ),
                );
            }
        }
    }
    tracing::warn!(count = out.reconciled, actor = %r.actor, "unknown requests confirmed not executed in bulk");
    axum::Json(out).into_response()
}

/// The ledger's figures, computed now.
/// R1, R2: the fleet's instances with their heartbeats and load, and Redis's state.
async fn fleet(State(st): State<Arc<AppState>>) -> Response {
    axum::Json(st.fleet.view(&st)).into_response()
}

async fn ledger_figures(State(st): State<Arc<AppState>>) -> Response {
    let now = clock::now();
    let since = UnixMs(now.0.saturating_sub(st.config.idempotency.window_ms as i64));
    match st.ledger.figures(since).await {
        Ok(f) => {
            *st.ledger_figures.write().unwrap_or_else(|p| p.into_inner()) = Some(f.clone());
            axum::Json(f).into_response()
        }
        Err(e) => admin_error(StatusCode::INTERNAL_SERVER_ERROR, format!("ledger read failed: {e}")),
    }
}

/// A prune from the console: expired response copies, and finished requests older than
/// `older_than_days` when given.
#[derive(Clone, Debug, Deserialize, TS)]
#[serde(deny_unknown_fields)]
pub struct PruneAction {
    pub actor: String,
    pub reason: String,
    #[serde(default)]
    pub older_than_days: Option<u32>,
}

/// I6: prunes the ledger while it serves (no vacuum: the file keeps its size and reuses
/// the space), on the audit log.
async fn prune(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let a: PruneAction = match json_body(&body) {
        Ok(a) => a,
        Err(m) => return unprocessable(m),
    };
    let (actor, reason) = match checked(&a.actor, &a.reason) {
        Ok(v) => v,
        Err(m) => return unprocessable(m),
    };
    if a.older_than_days == Some(0) {
        return unprocessable("`older_than_days`: at least 1 (today's requests are never pruned).".into());
    }
    let now = clock::now();
    let before = a
        .older_than_days
        .map(|d| UnixMs(now.0.saturating_sub(i64::from(d) * 86_400_000)));
    let keys_since = UnixMs(now.0.saturating_sub(st.config.idempotency.window_ms as i64));
    let report: PruneReport = match st.ledger.prune(now, before, keys_since, false).await {
        Ok(r) => r,
        Err(e) => return admin_error(StatusCode::SERVICE_UNAVAILABLE, format!("prune failed: {e}")),
    };
    let entry = report.audit_entry(now, actor, reason, a.older_than_days);
    if let Err(e) = st.ledger.record_transition(None, &entry).await {
        return admin_error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("pruned, but the audit log could not record it: {e}"),
        );
    }
    axum::Json(report).into_response()
}

pub fn router(st: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/admin/v1/unknowns", get(unknowns))
        .route("/admin/v1/unknowns/reconcile", post(reconcile_bulk))
        .route("/admin/v1/requests/{id}/reconcile", post(reconcile))
        .route("/admin/v1/ledger", get(ledger_figures))
        .route("/admin/v1/fleet", get(fleet))
        .route("/admin/v1/ledger/prune", post(prune))
        .route("/admin/v1/channels/{name}/restore", post(restore_channel))
        .route("/admin/v1/breakers/open", post(open_breaker))
        .route("/admin/v1/breakers/close", post(close_breaker))
        .route("/admin/v1/audit", get(audit))
        .route("/admin/v1/overview", get(get_overview))
        .route("/admin/v1/events", get(events))
        .route("/admin/v1/requests", get(search))
        .route("/admin/v1/requests/{id}", get(detail))
        .route("/admin/v1/costs", get(crate::money::costs))
        .route("/admin/v1/pricing", get(crate::money::pricing))
        .route("/admin/v1/keys", get(crate::money::keys).post(crate::money::create_key))
        .route("/admin/v1/keys/{name}/revoke", post(crate::money::revoke_key))
        .route("/admin/v1/keys/{name}/spend-limit", post(crate::money::set_spend_limit))
        .route("/admin/v1/owners/{owner}/top-up", post(crate::money::top_up))
        .merge(crate::inbox::router())
        .merge(crate::recovery::router())
        .route_layer(middleware::from_fn_with_state(st, require_token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p2_token_file_is_private_and_stable() {
        // spec: P2
        let dir = tempfile::tempdir().unwrap();
        let a = AdminToken::load_or_create(dir.path()).unwrap();
        let b = AdminToken::load_or_create(dir.path()).unwrap();
        assert_eq!(a.secret(), b.secret());
        assert!(a.matches(b.secret()));
        assert!(!a.matches("swa_wrong"));
        assert!(!a.matches(""));
        assert!(!format!("{a:?}").contains(a.secret()));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("admin-token"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}
