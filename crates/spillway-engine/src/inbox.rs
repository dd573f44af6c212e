//! The console's inboxes for background work: lane depths (J1, J7), jobs, the owner-review
//! inbox (K3), the dead-letter inbox and its reviewed replays (L1-L3), and the workflow
//! policies with their versions (J8). Every decision names who made it and why, and goes
//! on the audit log in the same transaction as the job it changes.

use crate::admin::{RequestDetail, admin_error, json_body};
use crate::clock;
use crate::contract::{self, Verdict};
use crate::jobs::{self, BACKGROUND, DEAD_LETTER, JobView, LaneDepths, OWNER_REVIEW, QUEUED, REJECTED, REPLAYED};
use crate::money::audit;
use crate::state::AppState;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use spillway_ledger::{JobRecord, Reconciliation, RequestState};
use spillway_wire::UnixMs;
use std::sync::Arc;
use ts_rs::TS;

pub fn router() -> Router<Arc<AppState>> {
    Router::new()
        .route("/admin/v1/lanes", get(lanes))
        .route("/admin/v1/jobs", get(list_jobs))
        .route("/admin/v1/jobs/{id}", get(job_detail))
        .route("/admin/v1/reviews", get(reviews))
        .route("/admin/v1/reviews/{id}/approve", post(approve))
        .route("/admin/v1/reviews/{id}/reject", post(reject))
        .route("/admin/v1/dead-letters", get(dead_letters))
        .route("/admin/v1/dead-letters/replay-preview", post(bulk_preview))
        .route("/admin/v1/dead-letters/replay", post(bulk_replay))
        .route("/admin/v1/dead-letters/{id}", get(dead_letter))
        .route("/admin/v1/dead-letters/{id}/replay", post(replay))
        .route("/admin/v1/policies", get(policies))
        .route("/admin/v1/policies/{workflow}/versions/{version}", get(policy_text))
        .route("/admin/v1/policies/{workflow}/rollback", post(rollback))
}

/// A form refused for missing or wrong fields: every one is named.
#[derive(Clone, Debug, Serialize, TS)]
pub struct FormError {
    pub error: String,
    /// The fields the form is missing (empty when the problem is a value).
    pub missing_fields: Vec<String>,
}

pub(crate) fn form_error(status: StatusCode, error: String, missing: Vec<String>) -> Response {
    (
        status,
        axum::Json(FormError {
            error,
            missing_fields: missing,
        }),
    )
        .into_response()
}

pub(crate) fn missing(fields: Vec<String>) -> Response {
    form_error(
        StatusCode::UNPROCESSABLE_ENTITY,
        format!("Missing required field(s): {}.", fields.join(", ")),
        fields,
    )
}

/// Operators act on jobs once the ledger's open jobs are loaded (a decision made before
/// would be overwritten by the loading copy).
fn not_ready(st: &AppState) -> Option<Response> {
    (!st.jobs.ready.load(std::sync::atomic::Ordering::Acquire)).then(|| {
        admin_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "The gateway is still loading its jobs from the ledger; try again in a moment.",
        )
    })
}

pub(crate) fn ledger_down(e: impl std::fmt::Display) -> Response {
    admin_error(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the ledger could not be read or written: {e}"),
    )
}

/// A present, printable, bounded text field.
pub(crate) fn text_field(v: &Option<String>, max: usize) -> Option<String> {
    let t = v.as_deref()?.trim();
    (!t.is_empty() && t.chars().count() <= max && !t.chars().any(char::is_control)).then(|| t.to_owned())
}

// ---------------------------------------------------------------------------------------
// Lanes and jobs.

/// One workflow's lane limits (J7).
#[derive(Clone, Debug, Serialize, TS)]
pub struct WorkflowLanes {
    pub workflow: String,
    pub version: String,
    pub background_retry: usize,
    pub background_retry_max: u32,
    pub owner_review: usize,
    pub owner_review_max: u32,
    pub dead_letter: usize,
    pub dead_letter_max: u32,
    pub max_concurrency: u32,
    pub max_queue_age_ms: u64,
}

#[derive(Clone, Debug, Serialize, TS)]
pub struct LanesView {
    pub routes: Vec<LaneDepths>,
    pub workflows: Vec<WorkflowLanes>,
    /// Interactive requests waiting for capacity now, gateway-wide, and the most that may.
    pub interactive_admission: u32,
    pub interactive_admission_max: u32,
}

pub fn lanes_view(st: &AppState) -> LanesView {
    let open = st.jobs.open();
    let count = |w: &str, lane: &str| {
        open.iter()
            .filter(|j| j.workflow == w && j.lane.as_deref() == Some(lane))
            .count()
    };
    LanesView {
        routes: st.jobs.depths(st),
        workflows: st
            .workflows
            .all()
            .iter()
            .map(|w| WorkflowLanes {
                workflow: w.name.clone(),
                version: w.version.clone(),
                background_retry: count(&w.name, BACKGROUND),
                background_retry_max: w.background.max_length,
                owner_review: count(&w.name, OWNER_REVIEW),
                owner_review_max: w.owner_review.max_length,
                dead_letter: count(&w.name, DEAD_LETTER),
                dead_letter_max: w.dead_letter.max_length,
                max_concurrency: w.backpressure.max_concurrency,
                max_queue_age_ms: w.background.max_queue_age_ms,
            })
            .collect(),
        interactive_admission: st.capacity_queue.load(std::sync::atomic::Ordering::Relaxed),
        interactive_admission_max: st.config.capacity_queue_max,
    }
}

async fn lanes(State(st): State<Arc<AppState>>) -> Response {
    axum::Json(lanes_view(&st)).into_response()
}

/// Filters of the job lists.
#[derive(Clone, Debug, Default, Deserialize, Serialize, TS)]
#[serde(default)]
pub struct JobFilter {
    pub state: Option<String>,
    pub lane: Option<String>,
    pub route: Option<String>,
    pub owner: Option<String>,
    pub workflow: Option<String>,
    /// The last error's class (`server_error`, `rate_limit`, `quota`, ...) or the reason
    /// the job is in its lane.
    pub error_class: Option<String>,
    /// Only jobs created at least this long ago.
    pub min_age_ms: Option<u64>,
    /// Only jobs created at most this long ago.
    pub max_age_ms: Option<u64>,
    /// Only these jobs.
    pub ids: Option<Vec<String>>,
    pub limit: Option<u32>,
}

impl JobFilter {
    fn matches(&self, j: &JobRecord, now: UnixMs) -> bool {
        let age = now.0.saturating_sub(j.created_at.0).max(0) as u64;
        self.state.as_ref().is_none_or(|s| *s == j.state)
            && self.lane.as_ref().is_none_or(|l| j.lane.as_deref() == Some(l.as_str()))
            && self
                .route
                .as_ref()
                .is_none_or(|r| *r == j.route || j.route_override.as_deref() == Some(r.as_str()))
            && self.owner.as_ref().is_none_or(|o| *o == j.owner)
            && self.workflow.as_ref().is_none_or(|w| *w == j.workflow)
            && self.error_class.as_ref().is_none_or(|c| {
                j.last_error_type.as_deref() == Some(c.as_str()) || j.reason.as_deref() == Some(c.as_str())
            })
            && self.min_age_ms.is_none_or(|m| age >= m)
            && self.max_age_ms.is_none_or(|m| age <= m)
            && self.ids.as_ref().is_none_or(|ids| ids.contains(&j.id))
    }
}

fn filter_open(st: &AppState, f: &JobFilter) -> Vec<JobRecord> {
    let now = clock::now();
    let limit = f.limit.unwrap_or(500).min(5_000) as usize;
    st.jobs
        .open()
        .into_iter()
        .filter(|j| f.matches(j, now))
        .take(limit)
        .collect()
}

async fn list_jobs(State(st): State<Arc<AppState>>, Query(f): Query<JobFilter>) -> Response {
    let now = clock::now();
    let mut jobs = filter_open(&st, &f);
    // Ended jobs come from the ledger (memory holds only those still open).
    match st.ledger.store().recent_jobs(f.limit.unwrap_or(200).min(1_000)).await {
        Ok(recent) => {
            for j in recent {
                if !jobs.iter().any(|x| x.id == j.id) && j.lane.is_none() && f.matches(&j, now) {
                    jobs.push(j);
                }
            }
        }
        Err(e) => return ledger_down(e),
    }
    jobs.sort_by_key(|j| std::cmp::Reverse(j.created_at));
    axum::Json(jobs.iter().map(JobView::of).collect::<Vec<_>>()).into_response()
}

/// A job with its runs (requests and their attempts).
#[derive(Clone, Debug, Serialize, TS)]
pub struct JobDetail {
    pub job: JobView,
    pub evidence: Vec<RequestDetail>,
}

async fn evidence(st: &AppState, id: &str) -> spillway_ledger::Result<Vec<RequestDetail>> {
    // A run's last records may still wait for the group commit: the evidence is complete.
    st.ledger.flush().await?;
    let mut out = Vec::new();
    for r in st.ledger.store().job_requests(id).await? {
        let attempts = st.ledger.attempts(&r.id).await?;
        out.push(RequestDetail {
            request: r,
            attempts,
            cost_breakdown: None,
        });
    }
    Ok(out)
}

async fn load(st: &AppState, id: &str) -> Result<JobRecord, Response> {
    if id.len() > 64 {
        return Err(admin_error(StatusCode::NOT_FOUND, "No job with that id."));
    }
    match st.ledger.store().job(id).await {
        Ok(Some(j)) => Ok(st.jobs.current(j)),
        Ok(None) => Err(admin_error(StatusCode::NOT_FOUND, "No job with that id.")),
        Err(e) => Err(ledger_down(e)),
    }
}

async fn job_detail(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let j = match load(&st, &id).await {
        Ok(j) => j,
        Err(r) => return r,
    };
    match evidence(&st, &id).await {
        Ok(evidence) => axum::Json(JobDetail {
            job: JobView::of(&j),
            evidence,
        })
        .into_response(),
        Err(e) => ledger_down(e),
    }
}

// ---------------------------------------------------------------------------------------
// K3: owner review.

async fn reviews(State(st): State<Arc<AppState>>, Query(mut f): Query<JobFilter>) -> Response {
    f.lane = Some(OWNER_REVIEW.into());
    let items: Vec<JobView> = filter_open(&st, &f).iter().map(JobView::of).collect();
    axum::Json(items).into_response()
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Decision {
    reviewer: Option<String>,
    reason: Option<String>,
    /// Approve only: the route the job runs on (its own, or an approved fallback).
    route: Option<String>,
}

// The error is the handler's answer, returned as is on a cold admin path: boxing it buys nothing.
#[allow(clippy::result_large_err)]
fn decision(body: &[u8]) -> Result<(String, String, Option<String>), Response> {
    let d: Decision = if body.iter().all(u8::is_ascii_whitespace) {
        Decision::default()
    } else {
        json_body(body).map_err(|m| form_error(StatusCode::UNPROCESSABLE_ENTITY, m, Vec::new()))?
    };
    let reviewer = text_field(&d.reviewer, 64);
    let reason = text_field(&d.reason, 500);
    let mut gone = Vec::new();
    if reviewer.is_none() {
        gone.push("reviewer".to_owned());
    }
    if reason.is_none() {
        gone.push("reason".to_owned());
    }
    match (reviewer, reason) {
        (Some(a), Some(b)) => Ok((a, b, d.route.map(|r| r.trim().to_owned()).filter(|r| !r.is_empty()))),
        _ => Err(missing(gone)),
    }
}

/// The routes a job may run on after a person's decision: its own, or an approved
/// fallback of its workflow whose contract holds. `Err` says why not.
fn allowed_route(st: &AppState, j: &JobRecord, route: &str) -> Result<(), String> {
    if route == j.route {
        return Ok(());
    }
    let wf = st.workflows.for_job(&j.workflow);
    let Some(r) = wf.fallback_route(&j.route, route) else {
        let approved: Vec<String> = wf.fallbacks_from(&j.route).iter().map(|r| r.to.clone()).collect();
        return Err(format!(
            "`{route}` is neither the job's route ({}) nor an approved fallback of workflow `{}` ({})",
            j.route,
            wf.name,
            if approved.is_empty() {
                "none".to_owned()
            } else {
                approved.join(", ")
            }
        ));
    };
    match contract::check(st, &wf, j, r) {
        Verdict::Holds => Ok(()),
        Verdict::Unknown(why) | Verdict::DataBoundary(why) | Verdict::Mismatch(why) => {
            Err(format!("the fallback contract for `{route}` does not hold: {why}"))
        }
    }
}

/// K3: a decision's form, checked, and the job it is about, held for it: one decision at
/// a time, on a job still awaiting one.
#[allow(clippy::result_large_err)]
#[allow(clippy::type_complexity)]
async fn awaiting_review<'a>(
    st: &'a AppState,
    id: &str,
    body: &[u8],
) -> Result<(String, String, Option<String>, jobs::JobClaim<'a>, JobRecord), Response> {
    let (reviewer, reason, route) = decision(body)?;
    if let Some(r) = not_ready(st) {
        return Err(r);
    }
    let claim = st.jobs.claim(id, OWNER_REVIEW).map_err(|why| {
        admin_error(
            StatusCode::CONFLICT,
            format!("Job {id} is not awaiting an owner: {why}."),
        )
    })?;
    let j = load(st, id).await?;
    Ok((reviewer, reason, route, claim, j))
}

async fn approve(State(st): State<Arc<AppState>>, Path(id): Path<String>, body: axum::body::Bytes) -> Response {
    let (reviewer, reason, route, _claim, mut j) = match awaiting_review(&st, &id, &body).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    if let Some(r) = &route
        && let Err(why) = allowed_route(&st, &j, r)
    {
        return form_error(StatusCode::UNPROCESSABLE_ENTITY, format!("`route`: {why}"), Vec::new());
    }
    let now = clock::now();
    let wf = st.workflows.for_job(&j.workflow);
    let from = j.reason.clone().unwrap_or_default();
    j.review = Some(
        serde_json::json!({"decision": "approved", "reviewer": reviewer, "reason": reason,
            "route": route, "at": now, "trigger": from})
        .to_string(),
    );
    // A route named sends the job there (its own route clears an earlier fallback);
    // none keeps the route it was on.
    if let Some(r) = route {
        j.route_override = (r != j.route).then_some(r);
    }
    // A fresh attempt budget and queue age: the owner decided it should run now.
    j.lane = Some(BACKGROUND.into());
    j.state = QUEUED.into();
    j.attempt = 0;
    j.ready_at = now;
    j.expires_at = UnixMs(now.0.saturating_add(wf.background.max_queue_age_ms as i64));
    j.updated_at = now;
    j.reason = Some("approved by an owner".into());
    j.body = None;
    j.result = None;
    let a = audit(
        "job",
        &j.id,
        &reviewer,
        "review_approved",
        &reason,
        serde_json::json!([{"name": "trigger", "value": from}, {"name": "route", "value": jobs::effective_route(&j)}]),
    );
    if let Err(e) = jobs::save(&st, vec![j.clone()], &[a]).await {
        return e.into_response(spillway_wire::Format::OpenAi);
    }
    tracing::info!(job = %j.id, reviewer, "owner review approved");
    axum::Json(JobView::of(&j)).into_response()
}

async fn reject(State(st): State<Arc<AppState>>, Path(id): Path<String>, body: axum::body::Bytes) -> Response {
    let (reviewer, reason, _, _claim, mut j) = match awaiting_review(&st, &id, &body).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let now = clock::now();
    let from = j.reason.clone().unwrap_or_default();
    j.review = Some(
        serde_json::json!({"decision": "rejected", "reviewer": reviewer, "reason": reason, "at": now, "trigger": from})
            .to_string(),
    );
    j.lane = None;
    j.state = REJECTED.into();
    j.updated_at = now;
    j.body = None;
    j.result = None;
    let a = audit(
        "job",
        &j.id,
        &reviewer,
        "review_rejected",
        &reason,
        serde_json::json!([{"name": "trigger", "value": from}]),
    );
    if let Err(e) = jobs::save(&st, vec![j.clone()], &[a]).await {
        return e.into_response(spillway_wire::Format::OpenAi);
    }
    axum::Json(JobView::of(&j)).into_response()
}

// ---------------------------------------------------------------------------------------
// L1-L3: the dead letter and its replays.

async fn dead_letters(State(st): State<Arc<AppState>>, Query(mut f): Query<JobFilter>) -> Response {
    f.lane = Some(DEAD_LETTER.into());
    let items: Vec<JobView> = filter_open(&st, &f).iter().map(JobView::of).collect();
    axum::Json(items).into_response()
}

/// L1: what the ledger says about the job's idempotency key: whether a replay could do
/// its side effect twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum IdempotencyResult {
    /// No run under the key completed a side effect: a replay cannot repeat one.
    NoSideEffectRecorded,
    /// A run under the key completed (or started) a side effect: a replay is refused.
    SideEffectCompleted,
    /// A run under the key has an unknown outcome: refused until an owner reconciles it (L3).
    OutcomeUnknown,
}

impl IdempotencyResult {
    pub fn as_str(self) -> &'static str {
        match self {
            IdempotencyResult::NoSideEffectRecorded => "no_side_effect_recorded",
            IdempotencyResult::SideEffectCompleted => "side_effect_completed",
            IdempotencyResult::OutcomeUnknown => "outcome_unknown",
        }
    }
}

/// The detail of an outcome nobody can reconcile in the ledger (H3): only an owner's
/// override replays it.
const MAY_HAVE_ACTED_DETAIL: &str = "the provider may have acted on this job's behalf (H3) before its run failed";

async fn idempotency_result(st: &AppState, j: &JobRecord) -> spillway_ledger::Result<(IdempotencyResult, String)> {
    // The runs' last records may still wait for the group commit.
    st.ledger.flush().await?;
    let mut runs = st.ledger.store().job_requests(&j.id).await?;
    // The key may have been used outside the job too (the client's own requests under it).
    if let Some(k) = st
        .ledger
        .keyed(&j.key_name, &j.idempotency_key, UnixMs(0), clock::now())
        .await?
        && !runs.iter().any(|r| r.id == k.request.id)
    {
        runs.push(k.request);
    }
    for r in &runs {
        let done = r
            .resolution
            .as_ref()
            .is_some_and(|x| x.reconciliation == Some(Reconciliation::ConfirmedDone));
        if r.result_id().is_some() || r.state == RequestState::SideEffectPending || done {
            return Ok((
                IdempotencyResult::SideEffectCompleted,
                format!("request {} under the key has a side effect on record", r.id),
            ));
        }
    }
    if let Some(r) = runs.iter().find(|r| {
        matches!(
            r.state,
            RequestState::Unknown | RequestState::CallingApi | RequestState::Received
        )
    }) {
        return Ok((
            IdempotencyResult::OutcomeUnknown,
            format!(
                "request {} under the key has an unknown outcome; reconcile it in the Unknown outcomes inbox first",
                r.id
            ),
        ));
    }
    // A run that failed after the provider may have acted is closed as failed, but whether
    // it acted is not known: a person says so with an owner override.
    if j.reason.as_deref() == Some(jobs::MAY_HAVE_ACTED) {
        return Ok((
            IdempotencyResult::OutcomeUnknown,
            format!("{MAY_HAVE_ACTED_DETAIL}; check the provider, then replay with replay_reason.kind owner_override"),
        ));
    }
    Ok((
        IdempotencyResult::NoSideEffectRecorded,
        format!("{} run(s) under the key, none with a side effect on record", runs.len()),
    ))
}

/// A route the replay form offers, with its estimate and whether its contract holds.
#[derive(Clone, Debug, Serialize, TS)]
pub struct RouteChoice {
    pub route: String,
    /// The job's own route, or an approved fallback of its workflow.
    pub kind: String,
    pub estimated_cost_usd: Option<f64>,
    /// None when the route may be chosen; otherwise why not.
    pub refused: Option<String>,
}

#[derive(Clone, Debug, Serialize, TS)]
pub struct DeadLetterDetail {
    pub job: JobView,
    pub evidence: Vec<RequestDetail>,
    /// L1: computed from the ledger now; the form sends back what it showed.
    pub idempotency_result: IdempotencyResult,
    pub idempotency_detail: String,
    /// M3: what a replay on the job's route is expected to cost, at the catalog in force
    /// now (null when the catalog has no price for the model).
    pub estimated_cost_usd: Option<f64>,
    pub pricing_version: String,
    pub routes: Vec<RouteChoice>,
    /// Whether a replay can be accepted at all, and if not why.
    pub replayable: bool,
    pub not_replayable_because: Option<String>,
}

fn choices(st: &AppState, j: &JobRecord) -> Vec<RouteChoice> {
    let wf = st.workflows.for_job(&j.workflow);
    let mut v = vec![RouteChoice {
        route: j.route.clone(),
        kind: "same_route".into(),
        estimated_cost_usd: estimate_on(st, j, &j.route),
        refused: None,
    }];
    for r in wf.fallbacks_from(&j.route) {
        v.push(RouteChoice {
            route: r.to.clone(),
            kind: "approved_fallback".into(),
            estimated_cost_usd: estimate_on(st, j, &r.to),
            refused: allowed_route(st, j, &r.to).err(),
        });
    }
    v
}

fn estimate_on(st: &AppState, j: &JobRecord, route: &str) -> Option<f64> {
    let (_, model) = jobs::split_route(route)?;
    contract::estimate(st, model, j)
}

async fn detail_of(st: &AppState, j: JobRecord) -> Result<DeadLetterDetail, Response> {
    let ev = evidence(st, &j.id).await.map_err(ledger_down)?;
    let (idem, detail) = idempotency_result(st, &j).await.map_err(ledger_down)?;
    let why_not = match idem {
        IdempotencyResult::SideEffectCompleted => Some(format!("a completed side effect exists for the key: {detail}")),
        IdempotencyResult::OutcomeUnknown => Some(format!("L3: {detail}")),
        IdempotencyResult::NoSideEffectRecorded => None,
    };
    Ok(DeadLetterDetail {
        estimated_cost_usd: estimate_on(st, &j, &j.route),
        pricing_version: st.accounts.pricing().version.clone(),
        routes: choices(st, &j),
        job: JobView::of(&j),
        evidence: ev,
        idempotency_result: idem,
        idempotency_detail: detail,
        replayable: why_not.is_none(),
        not_replayable_because: why_not,
    })
}

async fn dead_letter(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let j = match load(&st, &id).await {
        Ok(j) => j,
        Err(r) => return r,
    };
    if j.lane.as_deref() != Some(DEAD_LETTER) {
        return admin_error(
            StatusCode::NOT_FOUND,
            format!("Job {id} is not in the dead letter (it is `{}`).", j.state),
        );
    }
    match detail_of(&st, j).await {
        Ok(d) => axum::Json(d).into_response(),
        Err(r) => r,
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ReasonIn {
    kind: Option<String>,
    text: Option<String>,
}

/// L1: the replay form. Every field is required.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ReplayForm {
    replay_owner: Option<String>,
    replay_reason: Option<ReasonIn>,
    route_override: Option<String>,
    idempotency_result: Option<String>,
    /// The estimate the operator reviewed: a number of USD, `{"estimated_cost_usd": n}`,
    /// or null inside that object when the catalog had no price.
    cost_reviewed: Option<serde_json::Value>,
    /// Bulk only.
    stop_after_failures: Option<u32>,
    filter: Option<JobFilter>,
}

const REASON_KINDS: &[&str] = &[
    "provider_recovered",
    "product_bug_fixed",
    "quota_changed",
    "owner_override",
];

struct Checked {
    owner: String,
    kind: String,
    text: String,
}

/// The common fields, with every missing one named at once.
// The error is the handler's answer, returned as is on a cold admin path: boxing it buys nothing.
#[allow(clippy::result_large_err)]
fn check_form(f: &ReplayForm, bulk: bool) -> Result<Checked, Response> {
    let owner = text_field(&f.replay_owner, 64);
    let kind = f.replay_reason.as_ref().and_then(|r| text_field(&r.kind, 64));
    let text = f.replay_reason.as_ref().and_then(|r| text_field(&r.text, 500));
    let mut gone = Vec::new();
    if owner.is_none() {
        gone.push("replay_owner");
    }
    match &f.replay_reason {
        None => gone.push("replay_reason"),
        Some(_) => {
            if kind.is_none() {
                gone.push("replay_reason.kind");
            }
            if text.is_none() {
                gone.push("replay_reason.text");
            }
        }
    }
    if !bulk && f.route_override.as_deref().is_none_or(|r| r.trim().is_empty()) {
        gone.push("route_override");
    }
    if !bulk && f.idempotency_result.as_deref().is_none_or(|r| r.trim().is_empty()) {
        gone.push("idempotency_result");
    }
    if f.cost_reviewed.as_ref().is_none_or(serde_json::Value::is_null) {
        gone.push("cost_reviewed");
    }
    if bulk && f.stop_after_failures.is_none() {
        gone.push("stop_after_failures");
    }
    if !gone.is_empty() {
        return Err(missing(gone.into_iter().map(str::to_owned).collect()));
    }
    let kind = kind.unwrap_or_default();
    if !REASON_KINDS.contains(&kind.as_str()) {
        return Err(form_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("`replay_reason.kind`: one of {}.", REASON_KINDS.join(", ")),
            Vec::new(),
        ));
    }
    Ok(Checked {
        owner: owner.unwrap_or_default(),
        kind,
        text: text.unwrap_or_default(),
    })
}

/// The estimate the operator acknowledged: `Ok(None)` for an acknowledged unknown.
// The error is the handler's answer, returned as is on a cold admin path: boxing it buys nothing.
#[allow(clippy::result_large_err)]
fn reviewed_estimate(v: &serde_json::Value, field: &str) -> Result<Option<f64>, Response> {
    let bad = || {
        form_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "`cost_reviewed`: send the estimate you reviewed, as `{{\"{field}\": <USD>}}` (null when it was shown as unknown) or as a number."
            ),
            Vec::new(),
        )
    };
    match v {
        serde_json::Value::Number(n) => n.as_f64().map(Some).ok_or_else(bad),
        serde_json::Value::Object(o) => match o.get(field) {
            Some(serde_json::Value::Number(n)) => n.as_f64().map(Some).ok_or_else(bad),
            Some(serde_json::Value::Null) => Ok(None),
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

fn same_money(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => (a * 1e8).round() == (b * 1e8).round(),
        _ => false,
    }
}

fn shown(v: Option<f64>) -> String {
    v.map_or("unknown".to_owned(), |v| format!("${v:.8}"))
}

/// The job a replay creates: the dead letter's request again, with a fresh budget.
fn replay_job(
    st: &AppState,
    old: &JobRecord,
    route: &str,
    form: serde_json::Value,
    batch: Option<String>,
) -> JobRecord {
    let now = clock::now();
    let wf = st.workflows.for_job(&old.workflow);
    let mut j = old.clone();
    j.id = jobs::new_job_id();
    j.route_override = (route != old.route).then(|| route.to_owned());
    j.served_model = None;
    j.lane = Some(BACKGROUND.into());
    j.state = QUEUED.into();
    j.attempt = 0;
    j.max_attempts = wf.background.max_attempts;
    j.created_at = now;
    j.ready_at = now;
    j.expires_at = UnixMs(now.0.saturating_add(wf.background.max_queue_age_ms as i64));
    j.updated_at = now;
    j.retry_after_ms = None;
    j.partial_output_committed = false;
    j.last_error_type = None;
    j.last_error = None;
    j.last_status = None;
    j.cost_usd = None;
    j.usage_units = None;
    j.request_ids = Vec::new();
    j.reason = Some(format!("replay of {}", old.id));
    j.result_status = None;
    j.result_content_type = None;
    j.result = None;
    j.review = None;
    j.replay_of = Some(old.id.clone());
    j.replayed_by = None;
    j.replay = Some(form.to_string());
    j.batch_id = batch;
    j.estimated_cost_usd = estimate_on(st, old, route);
    j
}

async fn replay(State(st): State<Arc<AppState>>, Path(id): Path<String>, body: axum::body::Bytes) -> Response {
    let f: ReplayForm = match json_body(&body) {
        Ok(f) => f,
        Err(m) => return form_error(StatusCode::UNPROCESSABLE_ENTITY, m, Vec::new()),
    };
    let c = match check_form(&f, false) {
        Ok(c) => c,
        Err(r) => return r,
    };
    if let Some(r) = not_ready(&st) {
        return r;
    }
    // L1: one replay of a dead letter, however many clicks.
    let _claim = match st.jobs.claim(&id, DEAD_LETTER) {
        Ok(c) => c,
        Err(why) => {
            return admin_error(
                StatusCode::CONFLICT,
                format!("Job {id} is not in the dead letter: {why}; nothing was replayed."),
            );
        }
    };
    let old = match load(&st, &id).await {
        Ok(j) => j,
        Err(r) => return r,
    };
    let route = f.route_override.as_deref().unwrap_or_default().trim().to_owned();
    if let Err(why) = allowed_route(&st, &old, &route) {
        return form_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("`route_override`: {why}"),
            Vec::new(),
        );
    }
    let (idem, detail) = match idempotency_result(&st, &old).await {
        Ok(v) => v,
        Err(e) => return ledger_down(e),
    };
    match idem {
        IdempotencyResult::SideEffectCompleted => {
            return form_error(
                StatusCode::CONFLICT,
                format!("`idempotency_result`: replay refused: a completed side effect exists for the key ({detail})."),
                Vec::new(),
            );
        }
        IdempotencyResult::OutcomeUnknown
            if detail.starts_with(MAY_HAVE_ACTED_DETAIL) && c.kind == "owner_override" => {}
        IdempotencyResult::OutcomeUnknown => {
            return form_error(
                StatusCode::CONFLICT,
                format!("`idempotency_result`: replay refused until the unknown outcome is reconciled (L3): {detail}."),
                Vec::new(),
            );
        }
        IdempotencyResult::NoSideEffectRecorded => {}
    }
    let sent = f.idempotency_result.as_deref().unwrap_or_default().trim();
    if sent != idem.as_str() {
        return form_error(
            StatusCode::CONFLICT,
            format!(
                "`idempotency_result`: the form showed `{sent}`, but the ledger now says `{}` ({detail}); review the dead letter again.",
                idem.as_str()
            ),
            Vec::new(),
        );
    }
    let now_estimate = estimate_on(&st, &old, &route);
    let reviewed = match reviewed_estimate(
        f.cost_reviewed.as_ref().unwrap_or(&serde_json::Value::Null),
        "estimated_cost_usd",
    ) {
        Ok(v) => v,
        Err(r) => return r,
    };
    if !same_money(reviewed, now_estimate) {
        return form_error(
            StatusCode::CONFLICT,
            format!(
                "`cost_reviewed`: the estimate changed since it was shown ({} then, {} now on {route}); review it again.",
                shown(reviewed),
                shown(now_estimate)
            ),
            Vec::new(),
        );
    }
    let form = serde_json::json!({
        "replay_owner": c.owner, "replay_reason": {"kind": c.kind, "text": c.text},
        "route_override": route, "idempotency_result": idem.as_str(),
        "cost_reviewed": {"estimated_cost_usd": now_estimate}, "at": clock::now(),
    });
    let new = replay_job(&st, &old, &route, form.clone(), None);
    let mut old = old;
    old.lane = None;
    old.state = REPLAYED.into();
    old.replayed_by = Some(new.id.clone());
    old.updated_at = clock::now();
    old.body = None;
    old.result = None;
    let a = audit(
        "replay",
        &old.id,
        &c.owner,
        "replayed",
        &format!("{}: {}", c.kind, c.text),
        serde_json::json!([{"name": "new_job", "value": new.id}, {"name": "route", "value": route},
            {"name": "estimated_cost_usd", "value": now_estimate}, {"name": "idempotency_result", "value": idem.as_str()}]),
    );
    let new_id = new.id.clone();
    if let Err(e) = jobs::save(&st, vec![new, old], &[a]).await {
        return e.into_response(spillway_wire::Format::OpenAi);
    }
    tracing::info!(dead_letter = %id, job = %new_id, owner = %c.owner, "dead letter replayed");
    (
        StatusCode::ACCEPTED,
        axum::Json(serde_json::json!({
            "job_id": new_id, "replay_of": id, "status_url": format!("/spillway/v1/jobs/{new_id}"),
        })),
    )
        .into_response()
}

/// L2: what a bulk replay over a filter would do, before it is asked for.
#[derive(Clone, Debug, Serialize, TS)]
pub struct BulkPreview {
    pub count: usize,
    /// The replayable jobs' estimates summed; null when one of them is unknown.
    pub total_estimated_cost_usd: Option<f64>,
    pub unknown_estimates: usize,
    pub replayable: Vec<String>,
    pub refused: Vec<BulkRefused>,
}

#[derive(Clone, Debug, Serialize, TS)]
pub struct BulkRefused {
    pub id: String,
    pub why: String,
}

async fn preview_of(st: &AppState, f: &JobFilter) -> Result<(BulkPreview, Vec<JobRecord>), Response> {
    let mut f = f.clone();
    f.lane = Some(DEAD_LETTER.into());
    let found = filter_open(st, &f);
    let mut total = Some(0.0);
    let mut unknown = 0;
    let mut ok = Vec::new();
    let mut refused = Vec::new();
    for j in found {
        let (idem, detail) = idempotency_result(st, &j).await.map_err(ledger_down)?;
        if idem != IdempotencyResult::NoSideEffectRecorded {
            refused.push(BulkRefused {
                id: j.id.clone(),
                why: format!("{}: {detail}", idem.as_str()),
            });
            continue;
        }
        match estimate_on(st, &j, &j.route) {
            Some(c) => total = total.map(|t| t + c),
            None => {
                unknown += 1;
                total = None;
            }
        }
        ok.push(j);
    }
    Ok((
        BulkPreview {
            count: ok.len(),
            total_estimated_cost_usd: total,
            unknown_estimates: unknown,
            replayable: ok.iter().map(|j| j.id.clone()).collect(),
            refused,
        },
        ok,
    ))
}

async fn bulk_preview(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct In {
        filter: JobFilter,
    }
    let i: In = match json_body(&body) {
        Ok(i) => i,
        Err(m) => return form_error(StatusCode::UNPROCESSABLE_ENTITY, m, Vec::new()),
    };
    match preview_of(&st, &i.filter).await {
        Ok((p, _)) => axum::Json(p).into_response(),
        Err(r) => r,
    }
}

/// L2: a bulk replay: the same reviewed fields, the total estimate shown first, and a stop
/// condition (the batch stops after that many of its jobs fail again). Each job is
/// replayed on its own route.
async fn bulk_replay(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let f: ReplayForm = match json_body(&body) {
        Ok(f) => f,
        Err(m) => return form_error(StatusCode::UNPROCESSABLE_ENTITY, m, Vec::new()),
    };
    let c = match check_form(&f, true) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let stop = f.stop_after_failures.unwrap_or(1);
    if stop == 0 {
        return form_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "`stop_after_failures`: at least 1.".into(),
            Vec::new(),
        );
    }
    if f.route_override.as_deref().is_some_and(|r| r.trim() != "same_route") {
        return form_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "`route_override`: a bulk replay runs each job on its own route (`same_route`); replay one job at a time to choose a fallback.".into(),
            Vec::new(),
        );
    }
    let filter = f.filter.clone().unwrap_or_default();
    let (p, jobs_found) = match preview_of(&st, &filter).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    if jobs_found.is_empty() {
        return form_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "`filter`: no replayable dead letter matches it.".into(),
            Vec::new(),
        );
    }
    let reviewed = match reviewed_estimate(
        f.cost_reviewed.as_ref().unwrap_or(&serde_json::Value::Null),
        "total_estimated_cost_usd",
    ) {
        Ok(v) => v,
        Err(r) => return r,
    };
    // The total is tied to the set it was shown for: the count reviewed must still hold.
    let count = f
        .cost_reviewed
        .as_ref()
        .and_then(|v| v.get("count"))
        .and_then(serde_json::Value::as_u64);
    if count.is_none_or(|c| c as usize != p.count) {
        return form_error(
            StatusCode::CONFLICT,
            format!(
                "`cost_reviewed.count`: the preview's count must come with its total; {} dead letter(s) match now; preview again.",
                p.count
            ),
            Vec::new(),
        );
    }
    if !same_money(reviewed, p.total_estimated_cost_usd) {
        return form_error(
            StatusCode::CONFLICT,
            format!(
                "`cost_reviewed`: the total estimate changed since it was shown ({} then, {} now for {} job(s)); preview again.",
                shown(reviewed),
                shown(p.total_estimated_cost_usd),
                p.count
            ),
            Vec::new(),
        );
    }
    if let Some(r) = not_ready(&st) {
        return r;
    }
    let batch = format!("batch_{}", &jobs::new_job_id()[4..20]);
    let mut saves = Vec::new();
    let mut made = Vec::new();
    let mut claims = Vec::new();
    let mut skipped = p.refused.clone();
    for found in jobs_found {
        // A dead letter replayed or decided on since the preview is left out.
        match st.jobs.claim(&found.id, DEAD_LETTER) {
            Ok(c) => claims.push(c),
            Err(why) => {
                skipped.push(BulkRefused {
                    id: found.id.clone(),
                    why,
                });
                continue;
            }
        }
        // The listing holds no bodies: the replay copies the dead letter's from the ledger.
        let old = match st.ledger.store().job(&found.id).await {
            Ok(Some(j)) => j,
            Ok(None) => continue,
            Err(e) => return ledger_down(e),
        };
        let form = serde_json::json!({
            "replay_owner": c.owner, "replay_reason": {"kind": c.kind, "text": c.text},
            "route_override": old.route, "idempotency_result": "no_side_effect_recorded",
            "cost_reviewed": {"total_estimated_cost_usd": p.total_estimated_cost_usd},
            "stop_after_failures": stop, "batch_id": batch, "at": clock::now(),
        });
        let new = replay_job(&st, &old, &old.route.clone(), form, Some(batch.clone()));
        let mut old = old;
        old.lane = None;
        old.state = REPLAYED.into();
        old.replayed_by = Some(new.id.clone());
        old.updated_at = clock::now();
        old.body = None;
        old.result = None;
        made.push(serde_json::json!({"dead_letter": old.id, "job_id": new.id}));
        saves.push(new);
        saves.push(old);
    }
    let a = audit(
        "replay",
        &batch,
        &c.owner,
        "bulk_replayed",
        &format!("{}: {}", c.kind, c.text),
        serde_json::json!([{"name": "jobs", "value": made.len()}, {"name": "total_estimated_cost_usd", "value": p.total_estimated_cost_usd},
            {"name": "stop_after_failures", "value": stop}, {"name": "filter", "value": serde_json::to_value(&filter).unwrap_or_default()}]),
    );
    jobs::open_batch(&st, &batch, stop);
    if let Err(e) = jobs::save(&st, saves, &[a]).await {
        return e.into_response(spillway_wire::Format::OpenAi);
    }
    (
        StatusCode::ACCEPTED,
        axum::Json(serde_json::json!({
            "batch_id": batch, "replayed": made, "refused": skipped, "stop_after_failures": stop,
            "total_estimated_cost_usd": p.total_estimated_cost_usd,
        })),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------
// J8: policies.

#[derive(Clone, Debug, Serialize, TS)]
pub struct PolicyVersionView {
    pub version: String,
    pub source: String,
    pub loaded_at: UnixMs,
}

#[derive(Clone, Debug, Serialize, TS)]
pub struct PolicyView {
    pub workflow: String,
    pub description: Option<String>,
    pub version: String,
    pub source: String,
    /// Whether it is read from a file that a roll back can write.
    pub editable: bool,
    pub versions: Vec<PolicyVersionView>,
}

#[derive(Clone, Debug, Serialize, TS)]
pub struct PoliciesView {
    /// The directory the policies are read from; null when the built-in ones run.
    pub dir: Option<String>,
    pub workflows: Vec<PolicyView>,
    pub problems: Vec<crate::workflows::PolicyProblem>,
}

async fn policies(State(st): State<Arc<AppState>>) -> Response {
    let versions = match st.ledger.store().policy_versions(None).await {
        Ok(v) => v,
        Err(e) => return ledger_down(e),
    };
    let workflows = st
        .workflows
        .all()
        .iter()
        .map(|w| PolicyView {
            workflow: w.name.clone(),
            description: w.description.clone(),
            version: w.version.clone(),
            source: w.source.clone(),
            editable: st.workflows.file_of(&w.name).is_some(),
            versions: versions
                .iter()
                .filter(|v| v.workflow == w.name)
                .map(|v| PolicyVersionView {
                    version: v.version.clone(),
                    source: v.source.clone(),
                    loaded_at: v.loaded_at,
                })
                .collect(),
        })
        .collect();
    axum::Json(PoliciesView {
        dir: st.workflows.dir().map(|d| d.display().to_string()),
        workflows,
        problems: st.workflows.problems(),
    })
    .into_response()
}

async fn policy_text(State(st): State<Arc<AppState>>, Path((workflow, version)): Path<(String, String)>) -> Response {
    match st.ledger.store().policy_versions(Some(&workflow)).await {
        Ok(v) => match v.into_iter().find(|v| v.version == version) {
            Some(v) => axum::Json(serde_json::json!({"workflow": v.workflow, "version": v.version,
                "source": v.source, "loaded_at": v.loaded_at, "text": v.text}))
            .into_response(),
            None => admin_error(
                StatusCode::NOT_FOUND,
                format!(
                    "Workflow `{}` has no recorded version `{}`.",
                    crate::admin::shown_name(&workflow),
                    crate::admin::shown_name(&version)
                ),
            ),
        },
        Err(e) => ledger_down(e),
    }
}

async fn rollback(State(st): State<Arc<AppState>>, Path(workflow): Path<String>, body: axum::body::Bytes) -> Response {
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct In {
        version: Option<String>,
        actor: Option<String>,
        reason: Option<String>,
    }
    let i: In = match json_body(&body) {
        Ok(i) => i,
        Err(m) => return form_error(StatusCode::UNPROCESSABLE_ENTITY, m, Vec::new()),
    };
    let version = text_field(&i.version, 64);
    let actor = text_field(&i.actor, 64);
    let reason = text_field(&i.reason, 500);
    let mut gone = Vec::new();
    for (n, v) in [("version", &version), ("actor", &actor), ("reason", &reason)] {
        if v.is_none() {
            gone.push(n.to_owned());
        }
    }
    if !gone.is_empty() {
        return missing(gone);
    }
    let (version, actor, reason) = (
        version.unwrap_or_default(),
        actor.unwrap_or_default(),
        reason.unwrap_or_default(),
    );
    match crate::workflows::rollback(&st, &workflow, &version, &actor, &reason).await {
        Ok(w) => axum::Json(serde_json::json!({"workflow": w.name, "version": w.version})).into_response(),
        Err(crate::workflows::RollbackError::NotFound(m)) => admin_error(StatusCode::NOT_FOUND, m),
        Err(crate::workflows::RollbackError::ReadOnly(m)) => admin_error(StatusCode::CONFLICT, m),
        Err(crate::workflows::RollbackError::Failed(m)) => admin_error(StatusCode::UNPROCESSABLE_ENTITY, m),
    }
}
