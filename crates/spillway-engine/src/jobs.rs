//! J1-J7, K1: background jobs. A request with `Prefer: respond-async` becomes a job: its
//! body and everything a later run needs are durable in the ledger before the `202`. The
//! runner releases queued jobs (J4: only once their `ready_at` has come; among those, by
//! priority, then the earlier `ready_at`, then the earlier `created_at`) within a
//! concurrency limit per (owner, provider, model, endpoint), and never on a route whose
//! breaker is open (G2) or, while interactive requests wait for capacity, below the
//! workflow's `shed_priority_below` (J5). A run is an ordinary request through the
//! gateway's own pipeline (keys, breakers, channel failover, idempotency, cost, ledger),
//! so a job is metered and recorded like any request; every run carries the job's
//! idempotency key, so a run that completed is never sent again (I2).
//!
//! How a run ended decides where the job goes next (J6): done; back to the queue with a
//! `ready_at` (a provider's hint, else full jitter capped by the policy); an approved
//! fallback route when its contract holds (K1); the owner-review lane (quota, spend,
//! permission, data boundary, an unknown contract or signal); or the dead letter (out of
//! attempts, past `max_queue_age_ms`, partial output committed, outcome unknown).

use crate::clock;
use crate::error::GatewayError;
use crate::life::{End, Life};
use crate::money::audit;
use crate::state::{AppState, KeyRt};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use rand::Rng;
use serde::Serialize;
use spillway_ledger::{AuditEntry, FailureClass, GatewayClass, JobRecord, RequestRecord, RequestState};
use spillway_policy::Workflow;
use spillway_policy::workflow::{DeadLetterTrigger, FailClosed, FallbackRoute, Priority, ReviewTrigger};
use spillway_wire::{Api, ErrorClass, Format, UnixMs};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use ts_rs::TS;

/// The header that asks for background work (RFC 7240).
pub const PREFER: &str = "prefer";
/// A job's priority, when the client sets one (`low`, `normal`, `high`, `urgent`).
pub const PRIORITY_HEADER: &str = "x-spillway-priority";

/// Headers a run forwards to the provider as the client sent them (versions and betas);
/// nothing else is kept, and never a credential.
const KEPT_HEADERS: &[&str] = &[
    "anthropic-version",
    "anthropic-beta",
    "openai-beta",
    "x-spillway-conversation-id",
];

/// Lanes, as J1 names them.
pub const INTERACTIVE: &str = "interactive_admission";
pub const STREAM_RECOVERY: &str = "stream_recovery";
pub const BACKGROUND: &str = "background_retry";
pub const OWNER_REVIEW: &str = "owner_review";
pub const DEAD_LETTER: &str = "dead_letter";

/// Why a job is in the dead letter when its provider may have acted (H3).
pub const MAY_HAVE_ACTED: &str = "provider_may_have_acted";

/// Job states.
pub const QUEUED: &str = "queued";
pub const RUNNING: &str = "running";
pub const SUCCEEDED: &str = "succeeded";
pub const FAILED: &str = "failed";
pub const REJECTED: &str = "rejected";
pub const REPLAYED: &str = "replayed";

/// Marks a request as a run of a job: the key it runs as (the job's key, known by name;
/// no secret is kept), its deadline, and where the run's final record is handed back.
#[derive(Clone)]
pub struct JobRun {
    pub job_id: String,
    pub key: Arc<KeyRt>,
    pub workflow: Arc<Workflow>,
    pub deadline: Duration,
    pub sink: Arc<Mutex<Option<RunReport>>>,
}

/// How a run ended, handed back by the run's request as it closes.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub rec: RequestRecord,
    /// The provider's own wait hint on the last failed attempt (F1); the gateway's
    /// `retry-after` on its answer is not one.
    pub provider_hint_ms: Option<u64>,
    /// Why the attempt loop stopped, when it failed closed.
    pub stop: Option<spillway_ledger::StopReason>,
}

/// A bulk replay's stop condition (L2).
struct Batch {
    stop_after_failures: u32,
    failures: u32,
    stopped: bool,
}

#[derive(Default)]
struct Inner {
    /// Jobs an operator's action holds (K3, L1): the runner skips them and a second action
    /// is refused, so two decisions never race.
    claimed: std::collections::HashSet<String>,
    /// Every job not yet ended (queued, running, awaiting an owner, in the dead letter),
    /// without its body.
    open: HashMap<String, JobRecord>,
    /// Runs in flight per concurrency key (J4).
    running: HashMap<String, u32>,
    batches: HashMap<String, Batch>,
    /// How long a run takes, smoothed: the 429 of a full lane estimates its restart from it.
    run_ms: f64,
}

/// The jobs of this gateway.
#[derive(Default)]
pub struct Jobs {
    inner: Mutex<Inner>,
    wake: tokio::sync::Notify,
    /// The jobs the ledger held open are loaded: operators may act on them.
    pub ready: std::sync::atomic::AtomicBool,
    /// J1: streams waiting to retry before their first token, now.
    pub stream_recovery: AtomicU32,
}

/// A job as its client and the console see it.
#[derive(Clone, Debug, Serialize, TS)]
pub struct JobView {
    pub job_id: String,
    pub state: String,
    pub lane: Option<String>,
    pub workflow: String,
    pub policy_version: String,
    pub owner_key: String,
    pub key_name: String,
    pub route_key: String,
    pub route_override: Option<String>,
    pub requested_model: String,
    pub served_model: Option<String>,
    pub priority: String,
    pub attempt: u32,
    pub max_attempts: u32,
    pub created_at: UnixMs,
    pub ready_at: UnixMs,
    pub expires_at: UnixMs,
    pub updated_at: UnixMs,
    pub retry_after_ms: Option<u64>,
    pub fallback_policy: Option<String>,
    pub partial_output_committed: bool,
    pub last_error_type: Option<String>,
    pub last_error: Option<String>,
    pub last_status: Option<u16>,
    /// Why it is in its lane.
    pub reason: Option<String>,
    pub estimated_cost_usd: Option<f64>,
    pub cost_usd: Option<f64>,
    pub usage_units: Option<u64>,
    pub idempotency_key: String,
    pub request_ids: Vec<String>,
    pub replay_of: Option<String>,
    pub replayed_by: Option<String>,
    pub batch_id: Option<String>,
    /// K3: the owner's decision, as JSON.
    pub review: Option<String>,
    /// L1: the reviewed replay form, as JSON.
    pub replay: Option<String>,
    pub result_status: Option<u16>,
}

impl JobView {
    pub fn of(j: &JobRecord) -> JobView {
        JobView {
            job_id: j.id.clone(),
            state: j.state.clone(),
            lane: j.lane.clone(),
            workflow: j.workflow.clone(),
            policy_version: j.policy_version.clone(),
            owner_key: j.owner.clone(),
            key_name: j.key_name.clone(),
            route_key: j.route.clone(),
            route_override: j.route_override.clone(),
            requested_model: j.requested_model.clone(),
            served_model: j.served_model.clone(),
            priority: j.priority.clone(),
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            created_at: j.created_at,
            ready_at: j.ready_at,
            expires_at: j.expires_at,
            updated_at: j.updated_at,
            retry_after_ms: j.retry_after_ms,
            fallback_policy: j.fallback_policy.clone(),
            partial_output_committed: j.partial_output_committed,
            last_error_type: j.last_error_type.clone(),
            last_error: j.last_error.clone(),
            last_status: j.last_status,
            reason: j.reason.clone(),
            estimated_cost_usd: j.estimated_cost_usd,
            cost_usd: j.cost_usd,
            usage_units: j.usage_units,
            idempotency_key: j.idempotency_key.clone(),
            request_ids: j.request_ids.clone(),
            replay_of: j.replay_of.clone(),
            replayed_by: j.replayed_by.clone(),
            batch_id: j.batch_id.clone(),
            review: j.review.clone(),
            replay: j.replay.clone(),
            result_status: j.result_status,
        }
    }
}

/// An operator's hold on one job, let go when dropped.
pub struct JobClaim<'a> {
    jobs: &'a Jobs,
    id: String,
}

impl Drop for JobClaim<'_> {
    fn drop(&mut self) {
        self.jobs.lock().claimed.remove(&self.id);
    }
}

/// A stream's place in the stream-recovery lane, given back when dropped.
pub struct StreamRecovery<'a>(&'a AtomicU32);

impl Drop for StreamRecovery<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Lane lengths of one route (J1, J7), as the overview shows them.
#[derive(Clone, Debug, Default, Serialize, TS)]
pub struct LaneDepths {
    pub route: String,
    pub interactive_admission: i64,
    pub stream_recovery: u32,
    pub background_retry: u32,
    /// Of `background_retry`: runs in flight now.
    pub running: u32,
    pub owner_review: u32,
    pub dead_letter: u32,
}

/// Whether `headers` ask for background work: `Prefer: respond-async` (RFC 7240, any case,
/// among other preferences).
pub fn prefers_async(headers: &HeaderMap) -> bool {
    headers.get_all(PREFER).iter().any(|v| {
        v.to_str().is_ok_and(|s| {
            s.split(',').any(|p| {
                p.split(';')
                    .next()
                    .is_some_and(|t| t.trim().eq_ignore_ascii_case("respond-async"))
            })
        })
    })
}

/// The path and query a job is run on: as submitted, less a Gemini `key=` query
/// parameter (a credential is never stored).
pub fn stored_path(uri: &http::Uri) -> String {
    let path = uri.path();
    match uri.query() {
        None => path.to_owned(),
        Some(q) => {
            let kept: Vec<&str> = q
                .split('&')
                .filter(|kv| !kv.starts_with("key=") && !kv.is_empty())
                .collect();
            if kept.is_empty() {
                path.to_owned()
            } else {
                format!("{path}?{}", kept.join("&"))
            }
        }
    }
}

pub fn new_job_id() -> String {
    format!("job_{:032x}", rand::rng().random::<u128>())
}

/// The route a job runs on next.
pub fn effective_route(j: &JobRecord) -> &str {
    j.route_override.as_deref().unwrap_or(&j.route)
}

/// `format/model` split.
pub fn split_route(route: &str) -> Option<(Format, &str)> {
    let (f, m) = route.split_once('/')?;
    Some((f.parse::<Format>().ok()?, m))
}

/// J4: the concurrency key of a job under `wf`.
fn concurrency_key(j: &JobRecord, wf: &Workflow) -> String {
    use spillway_policy::workflow::ConcurrencyField as F;
    let route = effective_route(j);
    let (provider, model) = route.split_once('/').unwrap_or((route, ""));
    wf.backpressure
        .concurrency_key
        .iter()
        .map(|f| match f {
            F::OwnerKey => j.owner.as_str(),
            F::Provider => provider,
            F::RequestedModel => model,
            F::EndpointType => j.endpoint.as_str(),
        })
        .collect::<Vec<_>>()
        .join("|")
}

fn priority_of(j: &JobRecord) -> Priority {
    Priority::parse(&j.priority).unwrap_or_default()
}

/// The idempotency key a run carries on `route`: the job's own on its route; on another
/// route (another body) one derived from both, as I2 refuses a key reused for a different
/// body.
fn run_key(j: &JobRecord) -> String {
    match &j.route_override {
        Some(r) if *r != j.route => {
            use sha2::Digest;
            let h = hex::encode(&sha2::Sha256::digest(r.as_bytes())[..6]);
            let base: String = j.idempotency_key.chars().take(230).collect();
            format!("{base}#{h}")
        }
        _ => j.idempotency_key.clone(),
    }
}

impl Jobs {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Jobs not yet ended, without bodies.
    pub fn open(&self) -> Vec<JobRecord> {
        let mut v: Vec<JobRecord> = self.lock().open.values().cloned().collect();
        v.sort_by(|a, b| b.created_at.cmp(&a.created_at).then_with(|| b.id.cmp(&a.id)));
        v
    }

    pub fn get(&self, id: &str) -> Option<JobRecord> {
        self.lock().open.get(id).cloned()
    }

    /// The job as it stands: memory is never behind the ledger (a state is shown in
    /// memory as it is saved, and a running job's only there), the ledger has the body
    /// and result.
    pub fn current(&self, stored: JobRecord) -> JobRecord {
        match self.get(&stored.id) {
            Some(mut m) => {
                m.body = stored.body;
                m.result = stored.result;
                m
            }
            None => stored,
        }
    }

    /// J7: jobs of `workflow` in `lane` now.
    fn lane_len(&self, workflow: &str, lane: &str) -> usize {
        self.lock()
            .open
            .values()
            .filter(|j| j.workflow == workflow && j.lane.as_deref() == Some(lane))
            .count()
    }

    /// Lane lengths per route.
    pub fn depths(&self, st: &AppState) -> Vec<LaneDepths> {
        let mut by: std::collections::BTreeMap<String, LaneDepths> = Default::default();
        for r in st.metrics.routes() {
            let route = format!("{}/{}", r.provider, r.model);
            let d = by.entry(route.clone()).or_insert_with(|| LaneDepths {
                route,
                ..Default::default()
            });
            d.interactive_admission += r.queued.max(0);
        }
        for j in self.lock().open.values() {
            let route = effective_route(j).to_owned();
            let d = by.entry(route.clone()).or_insert_with(|| LaneDepths {
                route,
                ..Default::default()
            });
            match j.lane.as_deref() {
                Some(BACKGROUND) => {
                    d.background_retry += 1;
                    if j.state == RUNNING {
                        d.running += 1;
                    }
                }
                Some(OWNER_REVIEW) => d.owner_review += 1,
                Some(DEAD_LETTER) => d.dead_letter += 1,
                _ => {}
            }
        }
        let mut v: Vec<LaneDepths> = by.into_values().collect();
        // Streams waiting to retry are gateway-wide: shown on the first row.
        if let Some(first) = v.first_mut() {
            first.stream_recovery = self.stream_recovery.load(Ordering::Relaxed);
        }
        v
    }

    /// Holds job `id` for one operator action while it is in `lane` (and not held by
    /// another): `Err` says what it is instead.
    pub fn claim(&self, id: &str, lane: &str) -> Result<JobClaim<'_>, String> {
        let mut i = self.lock();
        if i.claimed.contains(id) {
            return Err("another decision on it is in progress".into());
        }
        match i.open.get(id) {
            Some(j) if j.lane.as_deref() == Some(lane) => {}
            Some(j) => return Err(format!("it is `{}`", j.state)),
            None => return Err("it has ended".into()),
        }
        i.claimed.insert(id.to_owned());
        Ok(JobClaim {
            jobs: self,
            id: id.to_owned(),
        })
    }

    /// J1, J7: a place in the stream-recovery lane, while there is one.
    pub fn enter_stream_recovery(&self, max: u32) -> Option<StreamRecovery<'_>> {
        self.stream_recovery
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| StreamRecovery(&self.stream_recovery))
    }

    /// Shows saved jobs in memory, without bodies: a run reads its body back from the
    /// ledger.
    fn show(&self, jobs: Vec<JobRecord>) {
        for mut j in jobs {
            j.body = None;
            j.result = None;
            self.put(j);
        }
    }

    fn put(&self, j: JobRecord) {
        let mut i = self.lock();
        if j.lane.is_some() {
            i.open.insert(j.id.clone(), j);
        } else {
            i.open.remove(&j.id);
        }
        drop(i);
        self.wake.notify_one();
    }
}

/// Saves `jobs` durably (with `audits`), then shows them in memory.
pub async fn save(st: &AppState, jobs: Vec<JobRecord>, audits: &[AuditEntry]) -> Result<(), GatewayError> {
    if let Err(e) = st.ledger.store().save_jobs(&jobs, audits).await {
        tracing::error!(error = %e, "the ledger could not record a job");
        return Err(GatewayError::LedgerUnavailable);
    }
    st.jobs.show(jobs);
    Ok(())
}

/// The runner's save: the ledger first; if it refuses, memory still takes the new state,
/// so a job is never left `running` (or re-filed on every pass) because of an outage. The
/// ledger catches up at the job's next save, and a restart reads its runs again.
async fn save_or_hold(st: &AppState, jobs: Vec<JobRecord>, audits: &[AuditEntry]) {
    if let Err(e) = st.ledger.store().save_jobs(&jobs, audits).await {
        tracing::error!(error = %e, jobs = jobs.len(), "the ledger could not record a job's move; kept in memory");
    }
    st.jobs.show(jobs);
}

/// What ingress hands over for a submission.
pub struct Submission<'a> {
    pub key: Arc<KeyRt>,
    pub workflow: Arc<Workflow>,
    pub format: Format,
    pub api: Api,
    pub path_and_query: String,
    pub headers: &'a HeaderMap,
    pub body: Bytes,
    pub model: String,
    pub idempotency_key: Option<String>,
}

/// The answer to a submission: 202 with where to find the job.
fn accepted(j: &JobRecord, repeat: bool) -> Response {
    let url = format!("/spillway/v1/jobs/{}", j.id);
    let mut r = (
        StatusCode::ACCEPTED,
        axum::Json(serde_json::json!({
            "job_id": j.id, "status_url": url, "state": j.state, "lane": j.lane,
            "workflow": j.workflow, "policy_version": j.policy_version,
        })),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&url) {
        r.headers_mut().insert(http::header::LOCATION, v);
    }
    r.headers_mut()
        .insert("preference-applied", HeaderValue::from_static("respond-async"));
    if repeat {
        r.headers_mut()
            .insert("x-spillway-idempotent-replay", HeaderValue::from_static("true"));
    }
    r
}

/// J2, J7: a request that asked for background work becomes a job, or is refused.
pub async fn submit(st: &Arc<AppState>, life: Life, s: Submission<'_>) -> Response {
    let wf = s.workflow.clone();
    let priority = match s.headers.get(PRIORITY_HEADER).map(|v| v.to_str().unwrap_or("")) {
        None => wf.background.priority,
        Some(v) => match Priority::parse(v.trim()) {
            Some(p) => p,
            None => {
                let e = spillway_wire::RequestError {
                    field: Some(PRIORITY_HEADER.into()),
                    message: "expected one of low, normal, high, urgent".into(),
                };
                return life.close(End::refused(GatewayError::InvalidRequest(e))).await;
            }
        },
    };
    if wf.background.require_idempotency_key && s.idempotency_key.is_none() {
        return life
            .close(End::refused(GatewayError::JobNeedsIdempotencyKey {
                workflow: wf.name.clone(),
            }))
            .await;
    }
    let body_sha256 = life.rec.body_sha256.clone().unwrap_or_default();
    // I2 for jobs: the same key and body is the same job; another body under the key is refused.
    if let Some(k) = &s.idempotency_key {
        match st.ledger.store().job_by_key(&s.key.key.name, k).await {
            Ok(Some(found)) if found.body_sha256 == body_sha256 && found.path == s.path_and_query => {
                let latest = st.jobs.get(&found.id).unwrap_or(found);
                let r = accepted(&latest, true);
                life.hand_over();
                return r;
            }
            Ok(Some(found)) => {
                return life
                    .close(End::refused(GatewayError::IdempotencyKeyReused { original: found.id }))
                    .await;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::error!(error = %e, "ledger lookup of a job's idempotency key failed");
                return life.close(End::refused(GatewayError::LedgerUnavailable)).await;
            }
        }
    }
    // J7: a full lane takes no more work. A full owner-review or dead-letter lane means
    // nobody is clearing them: taking more would only grow what waits for a person.
    for (lane, max, advice) in [
        (
            BACKGROUND,
            wf.background.max_length,
            "Retry after the indicated delay, when queued jobs have run.",
        ),
        (
            OWNER_REVIEW,
            wf.owner_review.max_length,
            "An operator must work through the owner-review inbox first.",
        ),
        (
            DEAD_LETTER,
            wf.dead_letter.max_length,
            "An operator must work through the dead-letter inbox first.",
        ),
    ] {
        let length = st.jobs.lane_len(&wf.name, lane);
        if length >= max as usize {
            let retry_after_s = if lane == BACKGROUND {
                restart_estimate(st, &wf, length + 1 - max as usize)
            } else {
                300
            };
            let e = GatewayError::LaneFull {
                lane,
                workflow: wf.name.clone(),
                length,
                max,
                advice,
                retry_after_s,
            };
            return life.close(End::refused(e)).await;
        }
    }
    let now = clock::now();
    let id = new_job_id();
    let headers: serde_json::Map<String, serde_json::Value> = KEPT_HEADERS
        .iter()
        .filter_map(|h| {
            let v = s.headers.get(*h)?.to_str().ok()?;
            Some(((*h).to_owned(), serde_json::Value::String(v.to_owned())))
        })
        .collect();
    let route = format!("{}/{}", s.format, s.model);
    let fallbacks: Vec<String> = wf.fallbacks_from(&route).iter().map(|r| r.to.clone()).collect();
    let est_in = life.rec.estimated_input_tokens;
    let job = JobRecord {
        id: id.clone(),
        key_name: s.key.key.name.clone(),
        owner: s.key.key.owner.clone(),
        idempotency_key: s.idempotency_key.clone().unwrap_or_else(|| format!("job:{id}")),
        workflow: wf.name.clone(),
        policy_version: wf.version.clone(),
        format: s.format.as_str().to_owned(),
        api: api_str(s.api).to_owned(),
        path: s.path_and_query.clone(),
        endpoint: life.rec.endpoint.clone(),
        headers: serde_json::Value::Object(headers).to_string(),
        body: Some(s.body.to_vec()),
        body_sha256,
        route: route.clone(),
        requested_model: s.model.clone(),
        served_model: None,
        route_override: None,
        priority: priority.as_str().to_owned(),
        lane: Some(BACKGROUND.into()),
        state: QUEUED.into(),
        attempt: 0,
        max_attempts: wf.background.max_attempts,
        created_at: now,
        ready_at: now,
        expires_at: UnixMs(now.0.saturating_add(wf.background.max_queue_age_ms as i64)),
        updated_at: now,
        retry_after_ms: None,
        partial_output_committed: false,
        last_error_type: None,
        last_error: None,
        last_status: None,
        estimated_cost_usd: life.rec.estimated_cost_usd,
        estimated_input_tokens: est_in,
        estimated_output_tokens: life.estimated_output_tokens(),
        cost_usd: None,
        usage_units: None,
        fallback_policy: Some(if fallbacks.is_empty() {
            "none".to_owned()
        } else {
            format!("{}@{}: {}", wf.name, wf.version, fallbacks.join(", "))
        }),
        request_ids: Vec::new(),
        reason: None,
        result_status: None,
        result_content_type: None,
        result: None,
        review: None,
        replay_of: None,
        replayed_by: None,
        replay: None,
        batch_id: None,
    };
    if let Err(e) = save(st, vec![job.clone()], &[]).await {
        // Two submissions under one key at once: the ledger kept the first (a unique
        // index); this one is answered with it.
        if let Some(k) = &s.idempotency_key
            && let Ok(Some(found)) = st.ledger.store().job_by_key(&s.key.key.name, k).await
            && found.body_sha256 == job.body_sha256
        {
            let r = accepted(&found, true);
            life.hand_over();
            return r;
        }
        return life.close(End::refused(e)).await;
    }
    tracing::info!(job = %id, workflow = %wf.name, route = %route, "background job accepted");
    let r = accepted(&job, false);
    life.hand_over();
    r
}

pub(crate) fn api_str(a: Api) -> &'static str {
    match a {
        Api::Generate => "generate",
        Api::Responses => "responses",
        Api::Embeddings => "embeddings",
        Api::CountTokens => "count_tokens",
    }
}

/// J7: seconds until a full background lane has room for `excess` more jobs, from how
/// long runs take and how many may run at once.
fn restart_estimate(st: &AppState, wf: &Workflow, excess: usize) -> u64 {
    let run_ms = st.jobs.lock().run_ms.max(1_000.0);
    let parallel = f64::from(wf.backpressure.max_concurrency.max(1));
    let s = (excess as f64 * run_ms / parallel / 1000.0).ceil() as u64;
    s.clamp(1, 3_600)
}

// ---------------------------------------------------------------------------------------
// Client API: GET /spillway/v1/jobs/{id} and its result.

/// A job's status, for the key that submitted it (any other key is told there is none).
pub async fn status_endpoint(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: http::Uri,
) -> Response {
    let (job, format) = match own_job(&st, &id, &headers, &uri).await {
        Ok(j) => j,
        Err(r) => return r,
    };
    let _ = format;
    let mut out = serde_json::to_vec(&JobView::of(&job)).unwrap_or_else(|_| b"{}".to_vec());
    if let Some(body) = job.result.as_deref() {
        // The provider's body exactly as the interactive call returned it: JSON spliced in
        // as it came (no reordering), anything else (a stream's text) as a string.
        // `GET .../result` gives the bytes with their status and content type.
        out.pop();
        out.extend_from_slice(b",\"result_url\":");
        out.extend_from_slice(&serde_json::to_vec(&format!("/spillway/v1/jobs/{}/result", job.id)).unwrap_or_default());
        out.extend_from_slice(b",\"result\":");
        if serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok() {
            out.extend_from_slice(body);
        } else {
            out.extend_from_slice(&serde_json::to_vec(&String::from_utf8_lossy(body)).unwrap_or_default());
        }
        out.push(b'}');
    }
    let mut r = Response::new(Body::from(out));
    r.headers_mut()
        .insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// The result of a job, byte for byte with the provider's status and content type.
pub async fn result_endpoint(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: http::Uri,
) -> Response {
    let (job, format) = match own_job(&st, &id, &headers, &uri).await {
        Ok(j) => j,
        Err(r) => return r,
    };
    match (job.result, job.result_status) {
        (Some(body), Some(status)) => {
            let mut r = Response::new(Body::from(body));
            *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            if let Some(ct) = job
                .result_content_type
                .as_deref()
                .and_then(|c| HeaderValue::from_str(c).ok())
            {
                r.headers_mut().insert(http::header::CONTENT_TYPE, ct);
            }
            r
        }
        _ => crate::error::GatewayError::JobNotDone {
            id: job.id,
            state: job.state,
        }
        .into_response(format),
    }
}

/// The job `id` of the key presenting itself on `req`, with the format to answer in.
async fn own_job(
    st: &Arc<AppState>,
    id: &str,
    headers: &HeaderMap,
    uri: &http::Uri,
) -> Result<(JobRecord, Format), Response> {
    let format = [Format::OpenAi, Format::Anthropic, Format::Gemini]
        .into_iter()
        .find(|f| crate::ingress::authenticate(st, *f, headers, uri).is_ok())
        .unwrap_or(Format::OpenAi);
    let key = match crate::ingress::authenticate(st, format, headers, uri) {
        Ok(k) => k,
        Err(e) => return Err(e.into_response(format)),
    };
    let not_found = || GatewayError::NoSuchJob.into_response(format);
    if id.len() > 64 {
        return Err(not_found());
    }
    match st.ledger.store().job(id).await {
        Ok(Some(j)) if j.key_name == key.key.name => {
            // Memory is ahead of nothing (saves go to the ledger first), but a running job's
            // state is only in memory until its run ends.
            Ok((st.jobs.current(j), format))
        }
        Ok(_) => Err(not_found()),
        Err(e) => {
            tracing::error!(error = %e, "ledger read of a job failed");
            Err(GatewayError::LedgerUnavailable.into_response(format))
        }
    }
}

// ---------------------------------------------------------------------------------------
// The runner.

/// Starts the runner: it releases jobs through `router` (the gateway's own routes).
pub fn start(st: &Arc<AppState>, router: axum::Router) {
    let st = st.clone();
    tokio::spawn(async move {
        if let Err(e) = recover(&st).await {
            tracing::error!(error = %e, "could not load the queued jobs from the ledger; background jobs do not run");
            st.alert(
                crate::state::Severity::Critical,
                "Background jobs are not running".into(),
                format!("The ledger could not list the queued jobs: {e}"),
                None,
            );
            return;
        }
        let draining = st.shutdown.draining.clone();
        loop {
            if st.fleet.shared_ledger {
                refresh(&st).await;
            }
            let next = release(&st, &router).await;
            let wait = next.unwrap_or(Duration::from_secs(1)).min(Duration::from_secs(1));
            tokio::select! {
                _ = draining.cancelled() => return,
                _ = st.jobs.wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    });
}

/// J6, I4: the jobs the ledger holds open come back. A job that may have been running when
/// the gateway stopped is looked at through its runs: a run whose outcome is unknown
/// sends the job to the dead letter (L3: never run again before an owner reconciles it);
/// any other goes back to the queue, where its idempotency key answers a run that did
/// complete from the ledger without calling the provider again.
async fn recover(st: &Arc<AppState>) -> spillway_ledger::Result<()> {
    let open = st.ledger.store().open_jobs().await?;
    let mut changed = Vec::new();
    let mut audits = Vec::new();
    for mut j in open {
        if let Some(b) = j
            .replay
            .as_deref()
            .and_then(|r| serde_json::from_str::<serde_json::Value>(r).ok())
            && let (Some(batch), Some(stop)) = (
                j.batch_id.clone(),
                b.get("stop_after_failures").and_then(|v| v.as_u64()),
            )
        {
            // L2: the stop condition goes on from the batch's failures so far (its jobs
            // back in the dead letter for their own reasons).
            let failed = j.lane.as_deref() == Some(DEAD_LETTER) && j.reason.as_deref() != Some("bulk_replay_stopped");
            let mut inner = st.jobs.lock();
            let b = inner.batches.entry(batch).or_insert(Batch {
                stop_after_failures: stop as u32,
                failures: 0,
                stopped: false,
            });
            b.failures += u32::from(failed);
            b.stopped |= b.failures >= b.stop_after_failures;
        }
        // A job is marked running in memory only (a durable write per release would cost
        // a sync per run), so any job that may have been running is looked at. In a
        // fleet, a run in `calling_api` may be another live instance's (a dead one's jobs
        // come back through its take-over; this instance's own interrupted runs are
        // `unknown` already, and their key answers a second run with a refusal, I2).
        if !st.fleet.shared_ledger
            && (j.state == RUNNING || j.state == QUEUED)
            && look_again(st, &mut j, "after a restart", &mut audits).await?
        {
            changed.push(j.clone());
        }
        st.jobs.put(j);
    }
    st.fleet.jobs_seen.store(clock::now().0, Ordering::Release);
    // Memory holds every open job now: operators may act (their saves come after this
    // one's on the writer connection).
    st.jobs.ready.store(true, Ordering::Release);
    if !changed.is_empty() {
        tracing::info!(
            jobs = changed.len(),
            "jobs that were running when the gateway stopped are back"
        );
        st.ledger.store().save_jobs(&changed, &audits).await?;
    }
    Ok(())
}

/// A job that may have been running when its runner stopped, looked at through its runs
/// as the ledger has them (the job's own row is saved when a run ends, so the run that was
/// cut is found by its job id): one whose outcome is unknown goes to the dead letter;
/// one marked running goes back to the queue. True when `j` changed.
async fn look_again(
    st: &AppState,
    j: &mut JobRecord,
    when: &str,
    audits: &mut Vec<AuditEntry>,
) -> spillway_ledger::Result<bool> {
    let runs = st.ledger.store().job_requests(&j.id).await?;
    for r in &runs {
        if !j.request_ids.contains(&r.id) {
            j.request_ids.push(r.id.clone());
        }
    }
    if runs
        .iter()
        .any(|r| matches!(r.state, RequestState::Unknown | RequestState::CallingApi))
    {
        park(j, DEAD_LETTER, "outcome_unknown");
        j.last_error = Some("the gateway stopped while this job's run was calling the provider; its outcome is unknown. Reconcile the run in the Unknown outcomes inbox before a replay.".into());
        audits.push(audit(
            "job",
            &j.id,
            "gateway",
            "dead_lettered",
            &format!("outcome_unknown {when}"),
            serde_json::json!([]),
        ));
    } else if j.state == RUNNING {
        j.state = QUEUED.into();
        j.ready_at = clock::now();
    } else {
        return Ok(false);
    }
    j.updated_at = clock::now();
    Ok(true)
}

/// R1, I4: the jobs a dead instance held leases on, looked at as a restart looks at its
/// own: a run that may have reached the provider sends its job to the dead letter.
pub async fn adopt(st: &Arc<AppState>, ids: &[String]) {
    let mut changed = Vec::new();
    let mut audits = Vec::new();
    for id in ids {
        let mut j = match st.ledger.store().job(id).await {
            Ok(Some(j)) => j,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(error = %e, job = %id, "could not read a job a dead instance held");
                continue;
            }
        };
        j.body = None;
        j.result = None;
        match look_again(st, &mut j, "after its instance died", &mut audits).await {
            Ok(true) => changed.push(j),
            Ok(false) => st.jobs.put(j),
            Err(e) => tracing::warn!(error = %e, job = %id, "could not look at a job a dead instance held"),
        }
    }
    if !changed.is_empty() {
        save_or_hold(st, changed, &audits).await;
    }
}

/// R1: what other instances did to the queue since this one last looked: their new jobs,
/// and the ones they ran, filed or replayed. A job running here keeps its memory copy.
async fn refresh(st: &AppState) {
    let seen = st.fleet.jobs_seen.load(Ordering::Acquire);
    // A little overlap: two instances' clocks and commits are not in lock-step.
    let rows = match st
        .ledger
        .store()
        .jobs_changed_since(UnixMs(seen.saturating_sub(2_000)))
        .await
    {
        Ok(rows) => rows,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the fleet's job changes");
            return;
        }
    };
    let mut newest = seen;
    let mut inner = st.jobs.lock();
    let mut any = false;
    for j in rows {
        newest = newest.max(j.updated_at.0);
        // Unchanged since memory saw it (the window overlaps the last read), running
        // here, or held by an operator's action: memory stands.
        let keep_ours = inner.claimed.contains(&j.id)
            || inner.open.get(&j.id).is_some_and(|m| {
                m.state == RUNNING || m.updated_at > j.updated_at || m.updated_at == j.updated_at && m.state == j.state
            });
        if keep_ours || j.lane.is_none() && !inner.open.contains_key(&j.id) {
            continue;
        }
        any = true;
        if j.lane.is_some() {
            inner.open.insert(j.id.clone(), j);
        } else {
            inner.open.remove(&j.id);
        }
    }
    drop(inner);
    st.fleet.jobs_seen.store(newest, Ordering::Release);
    if any {
        st.jobs.wake.notify_one();
    }
}

/// R1: takes job `id`'s lease in the shared ledger: the ledger's row (without body or
/// result), which another instance may have changed since memory saw it. None when
/// another instance holds it (or it is no longer due): it is not tried again here for a
/// heartbeat.
async fn take_lease(st: &AppState, id: &str) -> Option<JobRecord> {
    let now = clock::now();
    let until = UnixMs(now.0 + 3 * st.config.fleet.stale_after_ms as i64);
    match st.ledger.store().lease_job(id, &st.fleet.instance, now, until).await {
        Ok(Some(mut fresh)) => {
            fresh.body = None;
            fresh.result = None;
            Some(fresh)
        }
        other => {
            if let Err(e) = other {
                tracing::warn!(error = %e, job = %id, "could not lease a job; it waits");
            }
            st.fleet
                .note_leased_elsewhere(id, UnixMs(now.0 + st.config.fleet.heartbeat_ms as i64));
            None
        }
    }
}

/// R1: a job released to run here is leased first; the ledger's row is what runs. When
/// another instance holds it, memory goes back to what it was.
async fn lease(st: &AppState, mut j: JobRecord, was: UnixMs) -> Option<JobRecord> {
    match take_lease(st, &j.id).await {
        Some(mut fresh) => {
            fresh.state = RUNNING.into();
            fresh.attempt += 1;
            fresh.updated_at = clock::now();
            st.jobs.lock().open.insert(fresh.id.clone(), fresh.clone());
            Some(fresh)
        }
        None => {
            j.state = QUEUED.into();
            j.attempt = j.attempt.saturating_sub(1);
            j.updated_at = was;
            st.jobs.lock().open.insert(j.id.clone(), j);
            None
        }
    }
}

/// R1: a job this pass would file (past its age, nothing in rotation) is leased first
/// on a fleet's ledger, like a run: one instance files it, and never while another runs it.
async fn hold_for_filing(st: &AppState, j: JobRecord) -> Option<JobRecord> {
    if !st.fleet.shared_ledger {
        return Some(j);
    }
    take_lease(st, &j.id).await
}

fn park(j: &mut JobRecord, lane: &str, reason: &str) {
    j.lane = Some(lane.into());
    j.state = lane.into();
    j.reason = Some(reason.into());
}

/// One pass: jobs past their age go to the dead letter; jobs due are released within
/// their limits. Returns when the next queued job becomes due.
async fn release(st: &Arc<AppState>, router: &axum::Router) -> Option<Duration> {
    let now = clock::now();
    let waiting_interactive = st.capacity_queue.load(Ordering::Relaxed) > 0;
    let mut expired = Vec::new();
    let mut blocked = Vec::new();
    let mut go = Vec::new();
    let mut next: Option<i64> = None;
    {
        let mut inner = st.jobs.lock();
        let mut queued: Vec<JobRecord> = inner.open.values().filter(|j| j.state == QUEUED).cloned().collect();
        queued.sort_by(|a, b| {
            priority_of(b)
                .cmp(&priority_of(a))
                .then(a.ready_at.cmp(&b.ready_at))
                .then(a.created_at.cmp(&b.created_at))
                .then(a.id.cmp(&b.id))
        });
        // O1: a draining route's jobs go in deadline order, in the places J4's order gave
        // them among the rest.
        let draining = st.recoveries.draining_routes();
        if !draining.is_empty() {
            let slots: Vec<usize> = (0..queued.len())
                .filter(|i| draining.iter().any(|r| r == effective_route(&queued[*i])))
                .collect();
            let mut by_deadline: Vec<JobRecord> = slots.iter().map(|i| queued[*i].clone()).collect();
            by_deadline.sort_by(|a, b| a.expires_at.cmp(&b.expires_at).then(a.id.cmp(&b.id)));
            for (slot, j) in slots.into_iter().zip(by_deadline) {
                queued[slot] = j;
            }
        }
        for mut j in queued {
            if inner.claimed.contains(&j.id) || st.fleet.shared_ledger && st.fleet.leased_elsewhere(&j.id, now) {
                continue;
            }
            if now >= j.expires_at {
                expired.push(j);
                continue;
            }
            if j.ready_at > now {
                let wait = j.ready_at.0 - now.0;
                next = Some(next.map_or(wait, |n| n.min(wait)));
                continue;
            }
            if st.shutdown.draining.is_cancelled() {
                continue;
            }
            let wf = st.workflows.for_job(&j.workflow);
            // G2, J5: an open breaker pauses the route's background work.
            let Some((format, model)) = split_route(effective_route(&j)) else {
                continue;
            };
            let route = st.control.route(st, format, model);
            // O1: a recovery run holding the route holds its jobs until the drain.
            if route.retry_after().is_some() || route.jobs_held() {
                continue;
            }
            // E2: nothing in rotation: wait for a named reset, or ask a person.
            match rotation(st, effective_route(&j)) {
                Rotation::Open => {}
                Rotation::Waiting => continue,
                Rotation::Blocked(why) => {
                    blocked.push((j, why));
                    continue;
                }
            }
            // J5: low priority sheds first while interactive requests wait for capacity.
            if waiting_interactive && priority_of(&j) < wf.interactive.shed_priority_below {
                continue;
            }
            // J4, F4: per concurrency key; halved while the route is not closed.
            let key = concurrency_key(&j, &wf);
            let key_for_slot = key.clone();
            let mut limit = wf.backpressure.max_concurrency;
            if !route.sending() {
                limit = (limit / 2).max(1);
            }
            let running = inner.running.entry(key).or_insert(0);
            if *running >= limit {
                continue;
            }
            // F4: a job's retry takes from the route's retry budget; over it, the job waits
            // in the queue instead of being sent.
            if j.attempt >= 1 && route.try_retry().is_err() {
                continue;
            }
            *running += 1;
            let was = j.updated_at;
            j.state = RUNNING.into();
            j.attempt += 1;
            j.updated_at = now;
            inner.open.insert(j.id.clone(), j.clone());
            go.push((j, key_for_slot, was));
        }
    }
    for j in expired {
        let Some(mut j) = hold_for_filing(st, j).await else {
            continue;
        };
        j.updated_at = now;
        let reason = DeadLetterTrigger::MaxQueueAgeExceeded;
        j.last_error
            .get_or_insert_with(|| "the job waited past its workflow's max_queue_age_ms".into());
        to_dead_letter_or_fail(st, &mut j, reason.as_str());
        let a = audit(
            "job",
            &j.id,
            "gateway",
            "dead_lettered",
            reason.as_str(),
            serde_json::json!([]),
        );
        let held = batch_failed(st, &j);
        save_or_hold(st, vec![j], &[a]).await;
        if let Some((jobs, audit)) = held {
            save_or_hold(st, jobs, &[audit]).await;
        }
    }
    for (j, why) in blocked {
        let Some(mut j) = hold_for_filing(st, j).await else {
            continue;
        };
        let wf = st.workflows.for_job(&j.workflow);
        let t = if why.contains("credential") {
            ReviewTrigger::PermissionDenied
        } else {
            ReviewTrigger::QuotaOrSpendExhausted
        };
        j.last_error = Some(format!("no channel of {} is in rotation: {why}", effective_route(&j)));
        j.updated_at = now;
        review_or_dead_letter(st, &mut j, &wf, t);
        let a = audit(
            "job",
            &j.id,
            "gateway",
            &format!("to_{}", j.state),
            t.as_str(),
            serde_json::json!([]),
        );
        let held = batch_failed(st, &j);
        save_or_hold(st, vec![j], &[a]).await;
        if let Some((jobs, audit)) = held {
            save_or_hold(st, jobs, &[audit]).await;
        }
    }
    for (j, key, was) in go {
        let slot = RunSlot { st: st.clone(), key };
        let j = if st.fleet.shared_ledger {
            match lease(st, j, was).await {
                Some(j) => j,
                None => continue,
            }
        } else {
            j
        };
        let router = router.clone();
        tokio::spawn(async move { run(slot, router, j).await });
    }
    next.map(|ms| Duration::from_millis(ms.max(0) as u64))
}

/// Dead letter when the workflow sends `reason` there, else the job fails for good.
fn to_dead_letter_or_fail(st: &AppState, j: &mut JobRecord, reason: &str) {
    let wf = st.workflows.for_job(&j.workflow);
    if wf.dead_letter.enter_when.iter().any(|t| t.as_str() == reason) {
        park(j, DEAD_LETTER, reason);
    } else {
        j.lane = None;
        j.state = FAILED.into();
        j.reason = Some(reason.into());
    }
}

/// K1: an interactive request rewritten for a fallback's `model`: the model in the body
/// (OpenAI, Anthropic) or in the path (Gemini). None when the body cannot be rewritten.
pub(crate) fn retarget_request(
    format: Format,
    from: &str,
    model: &str,
    uri: &http::Uri,
    body: &Bytes,
) -> Option<(String, http::Uri, Bytes)> {
    if format == Format::Gemini {
        let pq = uri.path_and_query().map(|p| p.as_str()).unwrap_or(uri.path());
        let rewritten = pq.replacen(&format!("/models/{from}:"), &format!("/models/{model}:"), 1);
        return Some((model.to_owned(), rewritten.parse().ok()?, body.clone()));
    }
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?.insert("model".into(), model.into());
    Some((model.to_owned(), uri.clone(), Bytes::from(serde_json::to_vec(&v).ok()?)))
}

/// The body and path of a run on `route` (the job's own, or a fallback's model).
fn retarget(j: &JobRecord, body: Vec<u8>) -> (String, Vec<u8>) {
    let route = effective_route(j);
    let Some((_, model)) = split_route(route) else {
        return (j.path.clone(), body);
    };
    if model == j.requested_model {
        return (j.path.clone(), body);
    }
    if j.format == "gemini" {
        let path = j.path.replacen(
            &format!("/models/{}:", j.requested_model),
            &format!("/models/{model}:"),
            1,
        );
        return (path, body);
    }
    match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(mut v) => {
            if let Some(o) = v.as_object_mut() {
                o.insert("model".into(), model.into());
            }
            (j.path.clone(), serde_json::to_vec(&v).unwrap_or(body))
        }
        Err(_) => (j.path.clone(), body),
    }
}

/// Runs a released job once and files it where its outcome sends it.
/// A run's place under its concurrency key (J4), given back however the run ends.
struct RunSlot {
    st: Arc<AppState>,
    key: String,
}

impl Drop for RunSlot {
    fn drop(&mut self) {
        if let Some(n) = self.st.jobs.lock().running.get_mut(&self.key) {
            *n = n.saturating_sub(1);
        }
    }
}

async fn run(slot: RunSlot, router: axum::Router, mut j: JobRecord) {
    let st = slot.st.clone();
    let started = tokio::time::Instant::now();
    let wf = st.workflows.for_job(&j.workflow);
    // J8: the job records the version of its workflow its latest run went under.
    j.policy_version = wf.version.clone();
    let outcome = run_once(&st, router, &mut j, &wf).await;
    drop(slot);
    {
        let mut inner = st.jobs.lock();
        let ms = started.elapsed().as_millis() as f64;
        inner.run_ms = if inner.run_ms == 0.0 {
            ms
        } else {
            inner.run_ms * 0.8 + ms * 0.2
        };
    }
    let audits = file(&st, &mut j, &wf, outcome);
    // The ledger has the body already; the save keeps it.
    j.body = None;
    j.updated_at = clock::now();
    // A bulk replay's stop condition holds its other jobs back before this save wakes the
    // runner, or the next one would already be on its way.
    let held = if j.lane.as_deref() != Some(BACKGROUND) && j.state != SUCCEEDED {
        batch_failed(&st, &j)
    } else {
        None
    };
    save_or_hold(&st, vec![j], &audits).await;
    if let Some((jobs, audit)) = held {
        save_or_hold(&st, jobs, &[audit]).await;
    }
}

/// What one run brought back.
struct Outcome {
    status: StatusCode,
    content_type: Option<String>,
    body: Bytes,
    /// The gateway's `retry-after`: when a refusal that sent nothing may be tried again.
    retry_after_ms: Option<u64>,
    /// The answer was larger than the gateway keeps.
    too_large: bool,
    report: Option<RunReport>,
    replayed: bool,
}

async fn run_once(st: &Arc<AppState>, router: axum::Router, j: &mut JobRecord, wf: &Arc<Workflow>) -> Outcome {
    let failed = |msg: &str| Outcome {
        status: StatusCode::SERVICE_UNAVAILABLE,
        content_type: None,
        body: Bytes::from(msg.to_owned()),
        retry_after_ms: Some(5_000),
        too_large: false,
        report: None,
        replayed: false,
    };
    let full = match st.ledger.store().job(&j.id).await {
        Ok(Some(f)) => f,
        _ => return failed("the job's body could not be read from the ledger"),
    };
    let Some(body) = full.body else {
        // Nothing to send: the job cannot run, now or later.
        return Outcome {
            status: StatusCode::GONE,
            content_type: None,
            body: Bytes::from_static(b"the job's request body is not in the ledger"),
            retry_after_ms: None,
            too_large: false,
            report: None,
            replayed: false,
        };
    };
    // K1's contract reads the body (tools, schema) if the run fails.
    j.body = Some(body.clone());
    let Some(key) = st.accounts.key_by_name(&j.key_name) else {
        return Outcome {
            status: StatusCode::UNAUTHORIZED,
            content_type: None,
            body: Bytes::from_static(b"the job's gateway key no longer exists or was revoked"),
            retry_after_ms: None,
            too_large: false,
            report: None,
            replayed: false,
        };
    };
    let (path, body) = retarget(j, body);
    let sink = Arc::new(Mutex::new(None));
    let mut req = http::Request::builder()
        .method(http::Method::POST)
        .uri(&path)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::HOST, "127.0.0.1")
        .header(crate::idempotency::HEADER, run_key(j))
        .header(crate::workflows::HEADER, &wf.name);
    if let Ok(serde_json::Value::Object(h)) = serde_json::from_str::<serde_json::Value>(&j.headers) {
        for (k, v) in h {
            if let Some(v) = v.as_str() {
                req = req.header(k, v);
            }
        }
    }
    let Ok(mut req) = req.body(Body::from(body)) else {
        return failed("the job's stored request could not be rebuilt");
    };
    req.extensions_mut().insert(JobRun {
        job_id: j.id.clone(),
        key,
        workflow: wf.clone(),
        deadline: Duration::from_millis(wf.background.attempt_timeout_ms),
        sink: sink.clone(),
    });
    use tower::ServiceExt;
    let resp = match router.oneshot(req).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    let status = resp.status();
    let replayed = resp.headers().contains_key("x-spillway-idempotent-replay");
    let content_type = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let retry_after_ms = resp
        .headers()
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|s| s * 1000);
    let limit = st.config.upstream.max_response_bytes as usize;
    let (body, too_large) = match http_body_util::Limited::new(resp.into_body(), limit).collect().await {
        Ok(c) => (c.to_bytes(), false),
        Err(_) => (Bytes::new(), status.is_success()),
    };
    let report = sink.lock().unwrap_or_else(|p| p.into_inner()).take();
    Outcome {
        status,
        content_type,
        body,
        retry_after_ms,
        too_large,
        report,
        replayed,
    }
}

use http_body_util::BodyExt;

/// Where a run's outcome sends the job.
enum Verdict {
    Done,
    /// H3: the provider may have acted before the run failed: the dead letter, where only
    /// an owner's override replays it.
    MayHaveActed,
    /// The provider completed the work, but its answer is not here (an earlier run's copy
    /// was not kept, or the answer was over the size limit): done, without a result.
    DoneWithoutResult(&'static str),
    /// The request cannot succeed as it is (the provider or the gateway refused it).
    Invalid,
    Retry {
        counted: bool,
    },
    Review(ReviewTrigger),
    DeadLetter(DeadLetterTrigger),
}

/// E2: where a route's channels stand for background work.
enum Rotation {
    /// Some channel takes work now.
    Open,
    /// Every channel is out for a while (paced, cooling, a quota with a named reset):
    /// the job waits, without a run that could only fail.
    Waiting,
    /// Every channel is out until a person acts (a refused credential, a quota with no
    /// reset): the job goes to owner review, why included.
    Blocked(String),
}

fn rotation(st: &AppState, route: &str) -> Rotation {
    use crate::health::Unavailable;
    let Some((format, model)) = split_route(route) else {
        return Rotation::Open;
    };
    let now = tokio::time::Instant::now();
    let mut blocked = None;
    let mut any = false;
    for c in st
        .channels
        .iter()
        .filter(|c| c.cfg.format == format && c.cfg.serves(model))
    {
        any = true;
        match c.health.check(0, now) {
            Ok(()) => return Rotation::Open,
            Err(Unavailable::Ejected(None, why)) => blocked = Some(why),
            Err(_) => return Rotation::Waiting,
        }
    }
    match blocked {
        Some(why) if any => Rotation::Blocked(why),
        _ => Rotation::Open,
    }
}

fn judge(o: &Outcome, channel_left: bool) -> Verdict {
    let Some(rec) = o.report.as_ref().map(|r| &r.rec) else {
        if o.status.is_success() {
            return Verdict::Done;
        }
        if o.status == StatusCode::UNAUTHORIZED {
            return Verdict::Review(ReviewTrigger::PermissionDenied);
        }
        if o.status == StatusCode::GONE {
            return Verdict::Invalid;
        }
        return Verdict::Retry { counted: false };
    };
    if rec.partial_output_committed {
        return Verdict::DeadLetter(DeadLetterTrigger::PartialOutputCommitted);
    }
    // H3: the provider may have acted (a hosted tool, a background run) before the
    // attempt failed: running it again could act twice, so a person looks first.
    if o.report.as_ref().and_then(|r| r.stop) == Some(spillway_ledger::StopReason::ProviderMayHaveActed) {
        return Verdict::MayHaveActed;
    }
    match rec.state {
        RequestState::Done | RequestState::ApiCompleted | RequestState::SideEffectPending if o.status.is_success() => {
            return Verdict::Done;
        }
        RequestState::Unknown => return Verdict::DeadLetter(DeadLetterTrigger::OutcomeUnknown),
        _ => {}
    }
    let reached = rec.attempts > 0;
    match rec.error_class {
        Some(FailureClass::Upstream(c)) => match c {
            ErrorClass::Quota | ErrorClass::Auth if channel_left => Verdict::Retry { counted: true },
            ErrorClass::Quota => Verdict::Review(ReviewTrigger::QuotaOrSpendExhausted),
            ErrorClass::Auth => Verdict::Review(ReviewTrigger::PermissionDenied),
            ErrorClass::InvalidRequest => Verdict::Invalid,
            // A 2xx the gateway cannot read may be work done: not retried blindly (as for
            // interactive requests), a person looks.
            ErrorClass::Unknown | ErrorClass::MalformedResponse => Verdict::Review(ReviewTrigger::UnknownSignal),
            _ => Verdict::Retry { counted: true },
        },
        Some(FailureClass::Gateway(g)) => match g {
            GatewayClass::InsufficientBalance | GatewayClass::SpendLimit | GatewayClass::DailyBudget => {
                Verdict::Review(ReviewTrigger::QuotaOrSpendExhausted)
            }
            GatewayClass::ClientAuth => Verdict::Review(ReviewTrigger::PermissionDenied),
            GatewayClass::NoChannelInRotation => {
                if rec.error_message.as_deref().is_some_and(|m| m.contains("credential")) {
                    Verdict::Review(ReviewTrigger::PermissionDenied)
                } else {
                    Verdict::Review(ReviewTrigger::QuotaOrSpendExhausted)
                }
            }
            GatewayClass::InvalidBody
            | GatewayClass::UnsupportedMediaType
            | GatewayClass::PayloadTooLarge
            | GatewayClass::NoChannel
            | GatewayClass::IdempotencyKeyReused => Verdict::Invalid,
            GatewayClass::IdempotencyCompleted => {
                Verdict::DoneWithoutResult("an earlier run completed; its response copy is not kept (I2)")
            }
            GatewayClass::IdempotencyUnknown | GatewayClass::Interrupted => {
                Verdict::DeadLetter(DeadLetterTrigger::OutcomeUnknown)
            }
            _ => Verdict::Retry { counted: reached },
        },
        None => Verdict::Retry { counted: reached },
    }
}

/// Files the job after a run; returns the audit entries of its moves.
fn file(st: &AppState, j: &mut JobRecord, wf: &Workflow, o: Outcome) -> Vec<AuditEntry> {
    let now = clock::now();
    let mut audits = Vec::new();
    if let Some(rec) = o.report.as_ref().map(|r| &r.rec) {
        if !j.request_ids.contains(&rec.id) {
            j.request_ids.push(rec.id.clone());
        }
        j.served_model = rec.served_model.clone().or(j.served_model.take());
        if let Some(c) = rec.cost_usd {
            j.cost_usd = Some(j.cost_usd.unwrap_or(0.0) + c);
        }
        let tokens = rec.input_tokens.unwrap_or(0) + rec.output_tokens.unwrap_or(0);
        if tokens > 0 {
            j.usage_units = Some(j.usage_units.unwrap_or(0) + tokens);
        }
        j.partial_output_committed |= rec.partial_output_committed;
        if rec.state != RequestState::Done {
            j.last_error_type = rec.error_class.map(|c| c.as_str().to_owned());
            j.last_error = rec.error_message.clone();
        }
    } else if !o.status.is_success() {
        j.last_error = Some(String::from_utf8_lossy(&o.body).chars().take(500).collect());
    }
    j.last_status = Some(o.status.as_u16());
    j.retry_after_ms = o.retry_after_ms;
    let verdict = if o.too_large {
        Verdict::DoneWithoutResult("the answer was over the gateway's max_response_bytes and is not kept")
    } else {
        // E2: a quota or credential refusal on one channel moves the work to another
        // still in rotation before a person is asked.
        judge(&o, matches!(rotation(st, effective_route(j)), Rotation::Open))
    };
    match verdict {
        Verdict::DoneWithoutResult(why) => {
            j.lane = None;
            j.state = SUCCEEDED.into();
            j.reason = Some(why.into());
            j.result_status = None;
            j.result = None;
        }
        Verdict::Done => {
            j.lane = None;
            j.state = SUCCEEDED.into();
            j.reason = o
                .replayed
                .then(|| "answered from the ledger: an earlier run had completed (I2)".into());
            j.result_status = Some(o.status.as_u16());
            j.result_content_type = o.content_type;
            j.result = Some(o.body.to_vec());
        }
        Verdict::Invalid => {
            j.lane = None;
            j.state = FAILED.into();
            j.reason = Some("invalid_request".into());
            j.result_status = Some(o.status.as_u16());
            j.result_content_type = o.content_type;
            j.result = Some(o.body.to_vec());
        }
        Verdict::Review(t) => {
            review_or_dead_letter(st, j, wf, t);
            audits.push(audit(
                "job",
                &j.id,
                "gateway",
                &format!("to_{}", j.state),
                t.as_str(),
                serde_json::json!([]),
            ));
        }
        Verdict::MayHaveActed => {
            to_dead_letter_or_fail(st, j, DeadLetterTrigger::OutcomeUnknown.as_str());
            if j.lane.as_deref() == Some(DEAD_LETTER) {
                j.reason = Some(MAY_HAVE_ACTED.into());
            }
            audits.push(audit(
                "job",
                &j.id,
                "gateway",
                &format!("to_{}", j.state),
                MAY_HAVE_ACTED,
                serde_json::json!([]),
            ));
        }
        Verdict::DeadLetter(t) => {
            to_dead_letter_or_fail(st, j, t.as_str());
            audits.push(audit(
                "job",
                &j.id,
                "gateway",
                &format!("to_{}", j.state),
                t.as_str(),
                serde_json::json!([]),
            ));
        }
        Verdict::Retry { counted } => {
            if !counted {
                j.attempt = j.attempt.saturating_sub(1);
            }
            if counted && j.attempt >= j.max_attempts {
                // F2: out of attempts: an approved fallback if its contract holds (K1).
                match next_fallback(st, j, wf) {
                    Next::Fallback(r) => {
                        audits.push(audit(
                            "job",
                            &j.id,
                            "gateway",
                            "fallback",
                            &format!("attempts exhausted on {}; contract holds for {}", effective_route(j), r.to),
                            serde_json::json!([{"name": "from", "value": effective_route(j)}, {"name": "to", "value": r.to}]),
                        ));
                        j.route_override = Some(r.to.clone());
                        j.attempt = 0;
                        j.state = QUEUED.into();
                        j.ready_at = now;
                        j.reason = Some(format!("fallback to {}", r.to));
                    }
                    Next::Review(t, why) => {
                        j.last_error = Some(why);
                        review_or_dead_letter(st, j, wf, t);
                        audits.push(audit(
                            "job",
                            &j.id,
                            "gateway",
                            &format!("to_{}", j.state),
                            t.as_str(),
                            serde_json::json!([]),
                        ));
                    }
                    Next::Mismatch(why) => {
                        j.last_error = Some(why);
                        let reason = if wf.fail_closed_when.contains(&FailClosed::FallbackContractMismatch) {
                            FailClosed::FallbackContractMismatch.as_str()
                        } else {
                            DeadLetterTrigger::MaxAttemptsExhausted.as_str()
                        };
                        park(j, DEAD_LETTER, reason);
                        audits.push(audit(
                            "job",
                            &j.id,
                            "gateway",
                            "to_dead_letter",
                            reason,
                            serde_json::json!([]),
                        ));
                    }
                    Next::None => {
                        to_dead_letter_or_fail(st, j, DeadLetterTrigger::MaxAttemptsExhausted.as_str());
                        audits.push(audit(
                            "job",
                            &j.id,
                            "gateway",
                            &format!("to_{}", j.state),
                            DeadLetterTrigger::MaxAttemptsExhausted.as_str(),
                            serde_json::json!([]),
                        ));
                    }
                }
                return audits;
            }
            // F1, F2: the provider's hint, else full jitter capped by the policy.
            let delay = o.retry_after_ms.unwrap_or_else(|| {
                let cap = wf
                    .background
                    .max_backoff_ms
                    .min(500u64.saturating_mul(1 << j.attempt.min(20)));
                rand::rng().random_range(0..=cap.max(1))
            });
            let ready = UnixMs(now.0.saturating_add(delay as i64));
            if ready >= j.expires_at && wf.fail_closed_when.contains(&FailClosed::RetryAfterExceedsDeadline) {
                j.last_error = Some(format!(
                    "the next attempt could not start before the job expires (wait {delay} ms)"
                ));
                // Gave up for time, not for the work: a person may replay it.
                park(j, DEAD_LETTER, FailClosed::RetryAfterExceedsDeadline.as_str());
                audits.push(audit(
                    "job",
                    &j.id,
                    "gateway",
                    &format!("to_{}", j.state),
                    FailClosed::RetryAfterExceedsDeadline.as_str(),
                    serde_json::json!([]),
                ));
                return audits;
            }
            j.state = QUEUED.into();
            j.lane = Some(BACKGROUND.into());
            j.ready_at = ready;
        }
    }
    audits
}

/// J6: owner review when the workflow sends `t` there; otherwise the dead letter, where
/// a person still sees it.
fn review_or_dead_letter(st: &AppState, j: &mut JobRecord, wf: &Workflow, t: ReviewTrigger) {
    if wf.owner_review.enter_when.contains(&t) {
        park(j, OWNER_REVIEW, t.as_str());
    } else {
        let _ = st;
        park(j, DEAD_LETTER, t.as_str());
    }
}

enum Next<'a> {
    Fallback(&'a FallbackRoute),
    Review(ReviewTrigger, String),
    Mismatch(String),
    None,
}

/// K1: the first approved fallback from the job's route, in the policy's order, whose
/// contract holds; one fallback per job (a fallback that failed too goes to a person).
/// When none holds, what the first one lacked decides where the job goes.
fn next_fallback<'a>(st: &AppState, j: &JobRecord, wf: &'a Workflow) -> Next<'a> {
    if !wf.fallback.allowed_before_first_token || j.route_override.is_some() {
        return Next::None;
    }
    let mut first_refusal = None;
    for r in wf.fallbacks_from(&j.route) {
        let next = match crate::contract::check(st, wf, j, r) {
            crate::contract::Verdict::Holds => return Next::Fallback(r),
            crate::contract::Verdict::Unknown(why) => Next::Review(ReviewTrigger::FallbackContractUnknown, why),
            crate::contract::Verdict::DataBoundary(why) => Next::Review(ReviewTrigger::DataBoundaryMismatch, why),
            crate::contract::Verdict::Mismatch(why) => Next::Mismatch(why),
        };
        first_refusal.get_or_insert(next);
    }
    first_refusal.unwrap_or(Next::None)
}

/// L2: a job of a bulk replay ended badly: once the batch reaches its stop condition, its
/// jobs still queued go back to the dead letter unrun. They leave the queue here, in
/// memory, at once; the caller saves what this returns.
fn batch_failed(st: &AppState, j: &JobRecord) -> Option<(Vec<JobRecord>, AuditEntry)> {
    let batch = j.batch_id.clone()?;
    let mut inner = st.jobs.lock();
    let b = inner.batches.get_mut(&batch)?;
    b.failures += 1;
    if b.stopped || b.failures < b.stop_after_failures {
        return None;
    }
    b.stopped = true;
    let now = clock::now();
    let mut held = Vec::new();
    for x in inner.open.values_mut() {
        if x.batch_id.as_deref() == Some(batch.as_str()) && x.state == QUEUED && x.id != j.id {
            park(x, DEAD_LETTER, "bulk_replay_stopped");
            x.last_error = Some(format!(
                "bulk replay {batch} stopped after its failure limit; this job was not run"
            ));
            x.updated_at = now;
            held.push(x.clone());
        }
    }
    drop(inner);
    let a = audit(
        "replay",
        &batch,
        "gateway",
        "bulk_replay_stopped",
        "the stop condition was reached",
        serde_json::json!([{"name": "held_back", "value": held.len()}]),
    );
    st.alert(
        crate::state::Severity::Warning,
        format!("Bulk replay {batch} stopped"),
        format!(
            "Its failure limit was reached; {} job(s) not yet run went back to the dead letter.",
            held.len()
        ),
        None,
    );
    Some((held, a))
}

/// Starts a bulk replay's stop condition.
pub fn open_batch(st: &AppState, batch: &str, stop_after_failures: u32) {
    st.jobs.lock().batches.insert(
        batch.to_owned(),
        Batch {
            stop_after_failures,
            failures: 0,
            stopped: false,
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(state: RequestState, class: Option<FailureClass>, attempts: u32) -> RequestRecord {
        let mut r = RequestRecord::received(
            "r1".into(),
            "t1".into(),
            Format::OpenAi,
            "/v1/chat/completions",
            UnixMs(0),
        );
        r.state = state;
        r.error_class = class;
        r.attempts = attempts;
        r
    }

    fn outcome(status: u16, rec: Option<RequestRecord>) -> Outcome {
        Outcome {
            status: StatusCode::from_u16(status).unwrap(),
            content_type: None,
            body: Bytes::new(),
            retry_after_ms: None,
            too_large: false,
            report: rec.map(|rec| RunReport {
                rec,
                provider_hint_ms: None,
                stop: None,
            }),
            replayed: false,
        }
    }

    #[test]
    fn j2_prefer_respond_async_is_read_as_rfc_7240_says() {
        // spec: J2
        let mut h = HeaderMap::new();
        assert!(!prefers_async(&h));
        h.insert(PREFER, "return=minimal, Respond-Async; wait=10".parse().unwrap());
        assert!(prefers_async(&h));
        h.insert(PREFER, "respond-asynchronously".parse().unwrap());
        assert!(!prefers_async(&h));
    }

    #[test]
    fn j1_j7_the_stream_recovery_lane_holds_at_most_its_length() {
        // spec: J1, J7
        let jobs = Jobs::default();
        let a = jobs.enter_stream_recovery(2).unwrap();
        let b = jobs.enter_stream_recovery(2).unwrap();
        assert!(jobs.enter_stream_recovery(2).is_none(), "full");
        assert_eq!(jobs.stream_recovery.load(Ordering::Relaxed), 2);
        drop(a);
        assert!(
            jobs.enter_stream_recovery(2).is_some(),
            "a place given back is taken again"
        );
        drop(b);
        assert_eq!(jobs.stream_recovery.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn i6_a_stored_path_never_keeps_a_gemini_key() {
        // spec: I6, P4
        let u: http::Uri = "/v1beta/models/m:streamGenerateContent?key=sk-secret&alt=sse"
            .parse()
            .unwrap();
        assert_eq!(stored_path(&u), "/v1beta/models/m:streamGenerateContent?alt=sse");
        let u: http::Uri = "/v1beta/models/m:generateContent?key=sk-secret".parse().unwrap();
        assert_eq!(stored_path(&u), "/v1beta/models/m:generateContent");
    }

    #[test]
    fn k1_a_fallback_run_carries_the_fallback_model_and_its_own_key() {
        // spec: K1, I2
        let mut j = JobRecord {
            format: "openai".into(),
            path: "/v1/chat/completions".into(),
            route: "openai/gpt-4.1".into(),
            requested_model: "gpt-4.1".into(),
            idempotency_key: "k".into(),
            ..Default::default()
        };
        let body = br#"{"model":"gpt-4.1","messages":[]}"#.to_vec();
        assert_eq!(retarget(&j, body.clone()).1, body, "its own route: the body as sent");
        assert_eq!(run_key(&j), "k");
        j.route_override = Some("openai/gpt-4o-mini".into());
        let (_, b) = retarget(&j, body);
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&b).unwrap()["model"],
            "gpt-4o-mini"
        );
        assert!(run_key(&j).starts_with("k#") && run_key(&j) != "k");
        let g = JobRecord {
            format: "gemini".into(),
            path: "/v1beta/models/gemini-2.5-pro:generateContent".into(),
            route: "gemini/gemini-2.5-pro".into(),
            requested_model: "gemini-2.5-pro".into(),
            route_override: Some("gemini/gemini-2.5-flash".into()),
            ..Default::default()
        };
        assert_eq!(
            retarget(&g, Vec::new()).0,
            "/v1beta/models/gemini-2.5-flash:generateContent"
        );
    }

    #[test]
    fn j6_e2_each_outcome_files_the_job_where_the_rules_say() {
        // spec: J6, E2, L3
        let up = |c| Some(FailureClass::Upstream(c));
        let gw = |c| Some(FailureClass::Gateway(c));
        let v = |status, r, left| match judge(&outcome(status, Some(r)), left) {
            Verdict::Done => "done".to_owned(),
            Verdict::DoneWithoutResult(_) => "done without result".to_owned(),
            Verdict::MayHaveActed => "may have acted".to_owned(),
            Verdict::Invalid => "invalid".to_owned(),
            Verdict::Retry { counted } => format!("retry counted={counted}"),
            Verdict::Review(t) => format!("review {}", t.as_str()),
            Verdict::DeadLetter(t) => format!("dead {}", t.as_str()),
        };
        assert_eq!(v(200, rec(RequestState::Done, None, 1), true), "done");
        assert_eq!(
            v(502, rec(RequestState::Failed, up(ErrorClass::Overload), 1), true),
            "retry counted=true"
        );
        assert_eq!(
            v(502, rec(RequestState::Failed, up(ErrorClass::Quota), 1), false),
            "review quota_or_spend_exhausted"
        );
        // E2: another channel in rotation takes it before a person is asked.
        assert_eq!(
            v(502, rec(RequestState::Failed, up(ErrorClass::Quota), 1), true),
            "retry counted=true"
        );
        assert_eq!(
            v(502, rec(RequestState::Failed, up(ErrorClass::Auth), 1), false),
            "review permission_denied"
        );
        assert_eq!(
            v(402, rec(RequestState::Failed, gw(GatewayClass::SpendLimit), 0), true),
            "review quota_or_spend_exhausted"
        );
        assert_eq!(
            v(502, rec(RequestState::Failed, up(ErrorClass::Unknown), 1), true),
            "review unknown_signal"
        );
        assert_eq!(
            v(400, rec(RequestState::Failed, up(ErrorClass::InvalidRequest), 1), true),
            "invalid"
        );
        assert_eq!(
            v(503, rec(RequestState::Failed, gw(GatewayClass::BreakerOpen), 0), true),
            "retry counted=false"
        );
        assert_eq!(
            v(503, rec(RequestState::Unknown, None, 1), true),
            "dead outcome_unknown"
        );
        assert_eq!(
            v(
                409,
                rec(RequestState::Failed, gw(GatewayClass::IdempotencyUnknown), 0),
                true
            ),
            "dead outcome_unknown"
        );
        let mut partial = rec(RequestState::Failed, up(ErrorClass::StreamInterrupted), 1);
        partial.partial_output_committed = true;
        assert_eq!(v(200, partial, true), "dead partial_output_committed");
    }
}
