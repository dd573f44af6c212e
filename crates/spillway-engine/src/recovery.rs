//! Guided recovery (O1–O5) and drills: the runs an operator walks through a route's
//! incident, from isolation to a closed incident record. The checklist's rules live in
//! `spillway_control::recovery`; this module owns what they leave to their caller:
//! holding the route (the gate on its `RouteControl`), the evidence bundle, the roll
//! back, the probes, O2's figures, persisting each transition with its audit entry, the
//! incident report, and a drill's conversation with the simulator.

// The admin handlers' early returns are whole responses: operator actions, off the
// request path, where the size of an `Err` costs nothing worth boxing for.
#![allow(clippy::result_large_err)]

use crate::admin::admin_error;
use crate::clock;
use crate::inbox::{form_error, ledger_down, missing, text_field};
use crate::state::{AppState, KeyRt, Severity};
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use spillway_control::{
    Approval, ApprovalRole, Change, CloseChecks, ProbeResult, Recovery, RecoveryConfig, RecoveryStep,
};
use spillway_ledger::{AuditEntry, RecoveryRow, ScoreRow};
use spillway_policy::sim::{Behavior, ErrorFlavor, Fault};
use spillway_wire::{Format, UnixMs};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};
use ts_rs::TS;

/// The audit's kind for every transition of a run.
pub const KIND: &str = "recovery";
/// Runs read back at start-up and listed: the newest.
const KEPT_RUNS: u32 = 200;
/// Rows in an evidence bundle at most.
const EVIDENCE_ROWS: u32 = 20_000;
pub(crate) const DAY_MS: i64 = 86_400_000;
/// N2: the period before an incident: what "normal" is measured over.
pub(crate) const BEFORE_MS: i64 = 28 * DAY_MS;
/// How often open runs look at their route.
const TICK: Duration = Duration::from_millis(500);
/// O2's duplicate and cost checks query the ledger: not at every tick.
const SLOW_CHECK: Duration = Duration::from_secs(2);

/// A request a run sends itself, set in the request's extensions (no client can reach
/// them): it runs as the key an operator named. A confirm probe (`bypass`) goes past the
/// run's own gate and the breaker, one attempt; a drill's load goes through both, as a
/// client's request would.
#[derive(Clone)]
pub struct ProbeRun {
    pub key: Arc<KeyRt>,
    pub bypass: bool,
}

/// A drill's own traffic on its route, requests per second: enough for the breaker to
/// open during the staged incident and for a relapse to show within seconds.
const DRILL_LOAD_RPS: u64 = 8;
/// Drill requests in flight at most (a slow-provider drill holds each for seconds).
const DRILL_LOAD_IN_FLIGHT: usize = 32;

/// An incident a drill tells the simulator to stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum DrillScenario {
    /// Every call answers 429 with a 2 s Retry-After.
    RateLimitStorm,
    /// Every call answers 503.
    ServerErrors,
    /// Every call takes 3 s more.
    SlowProvider,
    /// Every call answers the provider's quota error, 60 s to reset.
    QuotaExhausted,
    /// The provider does the work and the connection drops before the answer: the
    /// gateway sees a connection failure, and the provider may have billed the work.
    DropsAfterCompletion,
}

impl DrillScenario {
    pub const ALL: [DrillScenario; 5] = [
        DrillScenario::RateLimitStorm,
        DrillScenario::ServerErrors,
        DrillScenario::SlowProvider,
        DrillScenario::QuotaExhausted,
        DrillScenario::DropsAfterCompletion,
    ];

    fn label(self) -> &'static str {
        match self {
            DrillScenario::RateLimitStorm => "429 storm",
            DrillScenario::ServerErrors => "5xx burst",
            DrillScenario::SlowProvider => "slow provider",
            DrillScenario::QuotaExhausted => "quota exhaustion",
            DrillScenario::DropsAfterCompletion => "connection drops after completion",
        }
    }

    /// The channel's usual behaviour with the scenario's fault on every call.
    fn behavior(self, usual: &Behavior) -> Behavior {
        let mut b = Behavior {
            script: Vec::new(),
            random_faults: Vec::new(),
            ..usual.clone()
        };
        let status = |status, error, retry_after_s| Fault::Status {
            status,
            error,
            retry_after_s,
            retry_after_date_s: None,
            retry_delay: None,
            message: Some("staged by a Spillway drill".into()),
        };
        match self {
            DrillScenario::RateLimitStorm => b.fault = Some(status(429, Some(ErrorFlavor::RateLimit), Some(2))),
            DrillScenario::ServerErrors => b.fault = Some(status(503, None, None)),
            DrillScenario::SlowProvider => b.latency_ms += 3_000,
            DrillScenario::QuotaExhausted => b.fault = Some(status(429, Some(ErrorFlavor::Quota), Some(60))),
            DrillScenario::DropsAfterCompletion => b.fault = Some(Fault::DropAfterCompletion),
        }
        b
    }
}

// ---------------------------------------------------------------------------------------
// What the console sees.

/// One step of the checklist.
#[derive(Clone, Debug, Serialize, TS)]
pub struct StepView {
    pub step: RecoveryStep,
    /// `done`, `current` or `pending`.
    pub status: String,
    /// What the step checks.
    pub check: String,
    /// What showed it done.
    pub evidence: Option<String>,
    pub done_by: Option<String>,
    pub done_at: Option<UnixMs>,
}

/// O1: the route's ledger since the incident began, split at isolation.
#[derive(Clone, Debug, Serialize, Deserialize, TS)]
pub struct LedgerSplit {
    pub since: UnixMs,
    pub succeeded: u64,
    pub failed: u64,
    pub unknown: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, TS)]
pub struct EvidenceSummary {
    pub requests: u64,
    pub bytes: u64,
    pub sha256: String,
    pub built_by: String,
    pub built_at: UnixMs,
    /// More rows than a bundle holds: the newest were left out.
    pub truncated: bool,
}

/// A workflow policy on the route whose version changed since its last known good.
#[derive(Clone, Debug, Serialize, TS)]
pub struct RollbackCandidate {
    pub workflow: String,
    pub current_version: String,
    pub last_good_version: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, TS)]
pub struct RollbackDone {
    pub actor: String,
    pub reason: String,
    pub at: UnixMs,
    /// None: nothing needed rolling back.
    pub workflow: Option<String>,
    pub from_version: Option<String>,
    pub to_version: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, TS)]
pub struct ProbeView {
    pub n: u32,
    pub ok: bool,
    pub status: Option<u16>,
    pub latency_ms: f64,
    pub request_id: Option<String>,
    pub error: Option<String>,
    pub duplicate: bool,
}

/// O2's figures now.
#[derive(Clone, Debug, Serialize, TS)]
pub struct RecentWindow {
    pub outcomes: u64,
    pub server_errors: u64,
    pub rate_limited_for_ms: Option<u64>,
    pub duplicates: u64,
    pub projected_day_usd: Option<f64>,
    pub daily_budget_usd: Option<f64>,
}

/// The route's scorecard over one resume stage (O1).
#[derive(Clone, Debug, Serialize, Deserialize, TS)]
pub struct StageScore {
    pub stage_pct: u8,
    pub from: UnixMs,
    pub to: UnixMs,
    pub row: ScoreRow,
}

/// O4: a job of the route that missed its deadline during the incident.
#[derive(Clone, Debug, Serialize, TS)]
pub struct Overrun {
    pub id: String,
    pub job_id: String,
    pub deadline_at: UnixMs,
    pub detail: String,
    pub explanation: Option<String>,
    pub explained_by: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, TS)]
pub struct FirstError {
    pub at: UnixMs,
    pub request_id: String,
    pub error_class: Option<String>,
    pub message: Option<String>,
}

/// O5: a change of configuration or policy made during the run.
#[derive(Clone, Debug, Serialize, Deserialize, TS)]
pub struct ConfigChange {
    pub at: UnixMs,
    pub actor: String,
    pub approver: Option<String>,
    pub what: String,
    pub before: Option<String>,
    pub after: Option<String>,
}

/// O5: the incident record.
#[derive(Clone, Debug, Default, Serialize, Deserialize, TS)]
pub struct IncidentRecord {
    /// The route's first failure of the incident (or the run's opening).
    pub started_at: UnixMs,
    /// When the breaker opened, if it did.
    pub detected_at: Option<UnixMs>,
    /// Isolation: the route stopped.
    pub stopped_at: Option<UnixMs>,
    /// The probes passed.
    pub recovered_at: Option<UnixMs>,
    /// Each resume stage's start.
    pub resume_times: Vec<UnixMs>,
    pub closed_at: Option<UnixMs>,
    pub closed_by: Option<String>,
    pub affected_requests: u64,
    pub first_error: Option<FirstError>,
    /// Attempts beyond the first, over the incident.
    pub retries: u64,
    /// What the incident's requests cost, failed attempts included.
    pub spend_usd: f64,
    pub customer_impact: Option<String>,
    pub workarounds: Option<String>,
    pub customer_contacted: bool,
    pub config_changes: Vec<ConfigChange>,
}

#[derive(Clone, Debug, Serialize, Deserialize, TS)]
pub struct Figure {
    pub name: String,
    pub value: f64,
}

/// O5: one transition, with its actor and figures.
#[derive(Clone, Debug, Serialize, Deserialize, TS)]
pub struct RecoveryEvent {
    pub at: UnixMs,
    pub actor: String,
    pub from: RecoveryStep,
    pub to: RecoveryStep,
    pub action: String,
    pub reason: String,
    pub figures: Vec<Figure>,
}

/// A run as the console sees it.
#[derive(Clone, Debug, Serialize, TS)]
pub struct RecoveryView {
    pub id: String,
    pub route: String,
    pub drill: Option<DrillScenario>,
    pub step: RecoveryStep,
    pub reason: String,
    pub opened_by: String,
    pub opened_at: UnixMs,
    pub stages: Vec<u8>,
    pub stage: Option<u32>,
    pub stage_ms: u64,
    pub stage_started_at: Option<UnixMs>,
    pub concurrency_pct: u8,
    pub concurrency_cap: Option<u32>,
    pub route_concurrency: u32,
    pub retries_on: bool,
    pub stops: u32,
    pub held: bool,
    pub approvals: Vec<Approval>,
    pub steps: Vec<StepView>,
    pub split: Option<LedgerSplit>,
    pub evidence: Option<EvidenceSummary>,
    pub rollback_candidates: Vec<RollbackCandidate>,
    pub rollback: Option<RollbackDone>,
    pub probes: Vec<ProbeView>,
    pub probe_rounds: u32,
    pub normal_p95_ms: Option<f64>,
    pub recent: RecentWindow,
    pub stage_scores: Vec<StageScore>,
    pub overruns: Vec<Overrun>,
    pub backlog: u64,
    pub unknowns: u64,
    pub close_missing: Vec<String>,
    pub incident: IncidentRecord,
    pub events: Vec<RecoveryEvent>,
}

#[derive(Clone, Debug, Serialize, TS)]
pub struct RecoverySummary {
    pub id: String,
    pub route: String,
    pub drill: Option<DrillScenario>,
    pub step: RecoveryStep,
    pub stage_pct: Option<u8>,
    pub held: bool,
    pub opened_at: UnixMs,
    pub opened_by: String,
    pub closed_at: Option<UnixMs>,
}

/// A route whose breaker is not closed and that no run holds: the console offers a run.
#[derive(Clone, Debug, Serialize, TS)]
pub struct RecoverySuggestion {
    pub route: String,
    pub breaker_opened_at: Option<UnixMs>,
    pub reason: String,
}

#[derive(Clone, Debug, Serialize, TS)]
pub struct RecoveryList {
    pub runs: Vec<RecoverySummary>,
    pub suggestions: Vec<RecoverySuggestion>,
    /// Routes served only by simulated channels: the only ones a drill may touch.
    pub drill_routes: Vec<String>,
    pub scenarios: Vec<DrillScenario>,
    /// Keys probes may run as.
    pub probe_keys: Vec<String>,
    /// Every route a channel serves by name.
    pub routes: Vec<String>,
}

// ---------------------------------------------------------------------------------------
// The runs.

/// What a drill changed on the simulator, to put back.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct DrillState {
    /// Each simulated channel's control URL and its behaviour before the drill.
    saved: Vec<(String, Behavior)>,
    incident_ends_at: i64,
    lifted: bool,
    relapse_ends_at: Option<i64>,
    /// The key the drill's own traffic runs as.
    #[serde(default)]
    load_key: Option<String>,
}

/// A run as stored (the ledger's `body`).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Run {
    id: String,
    route: String,
    drill: Option<DrillScenario>,
    reason: String,
    opened_by: String,
    opened_at: UnixMs,
    machine: Recovery,
    split: Option<LedgerSplit>,
    evidence: Option<EvidenceSummary>,
    rollback: Option<RollbackDone>,
    probes: Vec<ProbeView>,
    stage_scores: Vec<StageScore>,
    /// Overrun id → (explanation, who).
    explanations: BTreeMap<String, (String, String)>,
    incident: IncidentRecord,
    events: Vec<RecoveryEvent>,
    drill_state: Option<DrillState>,
    closed_at: Option<UnixMs>,
    /// O2's duplicates found at the last look.
    #[serde(default)]
    duplicates: u64,
}

/// Every run this gateway knows (open ones, and the newest closed), each behind its own
/// lock so a slow action (probes, a bundle) holds only its run.
#[derive(Default)]
pub struct Recoveries {
    runs: Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<Run>>>>,
    /// Each run as listed, kept at every save: the list never waits for a run busy
    /// with its probes.
    summaries: Mutex<BTreeMap<String, RecoverySummary>>,
    /// Route → its open run: one at a time.
    held: Mutex<HashMap<String, String>>,
    /// A simulated channel's control URL → the open drill that staged a fault on it:
    /// two drills on one channel would put back each other's faults as "usual".
    drill_channels: Mutex<HashMap<String, String>>,
    /// Routes under an open drill: their alerts say so and stay off the webhook.
    drilling: RwLock<Vec<String>>,
    /// Routes whose jobs drain in deadline order now (read by the job runner).
    draining: RwLock<Vec<String>>,
    router: OnceLock<axum::Router>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Recoveries {
    /// O1: the routes whose held jobs drain now.
    pub fn draining_routes(&self) -> Vec<String> {
        let d = self.draining.read().unwrap_or_else(|p| p.into_inner());
        if d.is_empty() { Vec::new() } else { d.clone() }
    }

    /// Whether an open drill holds `route`.
    pub fn drilling(&self, route: &str) -> bool {
        self.drilling
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|r| r == route)
    }

    fn all(&self) -> Vec<Arc<tokio::sync::Mutex<Run>>> {
        lock(&self.runs).values().cloned().collect()
    }

    fn get(&self, id: &str) -> Option<Arc<tokio::sync::Mutex<Run>>> {
        lock(&self.runs).get(id).cloned()
    }
}

fn new_run_id() -> String {
    format!("rec_{}", uuid::Uuid::now_v7().simple())
}

/// The channels serving `route` (`format/model`).
fn route_channels<'a>(st: &'a AppState, route: &str) -> Vec<&'a Arc<crate::state::ChannelRt>> {
    let Some((format, model)) = crate::jobs::split_route(route) else {
        return Vec::new();
    };
    st.channels
        .iter()
        .filter(|c| c.cfg.format == format && c.cfg.serves(model))
        .collect()
}

/// Every gateway key not revoked, by name.
fn live_keys(st: &AppState) -> Vec<String> {
    let mut names: Vec<String> = st
        .accounts
        .keys()
        .into_iter()
        .filter(|k| k.revoked_at.is_none())
        .map(|k| k.name)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Every route some channel serves by name, with whether all its channels are simulated.
fn named_routes(st: &AppState) -> BTreeMap<String, bool> {
    let mut routes: BTreeMap<String, bool> = BTreeMap::new();
    for c in &st.channels {
        for m in c.cfg.models.iter().filter(|m| m.as_str() != "*") {
            routes.insert(format!("{}/{m}", c.cfg.format), true);
        }
    }
    for (route, drillable) in routes.iter_mut() {
        *drillable = route_channels(st, route).iter().all(|c| c.cfg.simulated.is_some());
    }
    routes
}

/// The route's channels' concurrency, all together.
fn route_concurrency(st: &AppState, route: &str) -> u32 {
    route_channels(st, route).iter().map(|c| c.cfg.max_concurrency).sum()
}

fn route_control(st: &AppState, route: &str) -> Option<Arc<crate::control::RouteControl>> {
    let (format, model) = crate::jobs::split_route(route)?;
    Some(st.control.route(st, format, model))
}

fn cap_at(share_pct: u8, total: u32) -> u32 {
    (u64::from(total) * u64::from(share_pct)).div_ceil(100).max(1) as u32
}

/// Puts the run's hold on its route (or lifts it), and the drain order.
fn apply(st: &AppState, run: &Run) {
    let Some(rc) = route_control(st, &run.route) else {
        return;
    };
    match run.machine.gate() {
        Some(g) => {
            let cap = cap_at(g.share_pct, route_concurrency(st, &run.route));
            rc.set_gate(Some((&run.id, g.share_pct, cap, g.jobs_held)));
        }
        None => rc.set_gate(None),
    }
    let mark = |list: &RwLock<Vec<String>>, on: bool| {
        let mut l = list.write().unwrap_or_else(|p| p.into_inner());
        l.retain(|r| *r != run.route);
        if on {
            l.push(run.route.clone());
        }
    };
    mark(&st.recoveries.draining, run.machine.step == RecoveryStep::Drain);
    mark(&st.recoveries.drilling, run.is_drill() && run.machine.step.is_open());
}

fn figures_json(figures: &[Figure], drill: bool) -> serde_json::Value {
    let mut v: Vec<serde_json::Value> = figures
        .iter()
        .map(|f| serde_json::json!({"name": f.name, "value": f.value}))
        .collect();
    if drill {
        v.push(serde_json::json!({"name": "drill", "value": 1}));
    }
    serde_json::Value::Array(v)
}

impl Run {
    fn is_drill(&self) -> bool {
        self.drill.is_some()
    }

    /// O5: records a transition (event and audit entry); the caller saves.
    fn record(&mut self, actor: &str, c: &Change) -> AuditEntry {
        self.event(actor, c.from, c.to, c.action, &c.reason, c.figures.clone())
    }

    fn event(
        &mut self,
        actor: &str,
        from: RecoveryStep,
        to: RecoveryStep,
        action: &str,
        reason: &str,
        figures: Vec<(String, f64)>,
    ) -> AuditEntry {
        let figures: Vec<Figure> = figures
            .into_iter()
            .map(|(name, value)| Figure { name, value })
            .collect();
        let at = clock::now();
        let mut f = figures.clone();
        f.push(Figure {
            name: "stops".into(),
            value: f64::from(self.machine.stops),
        });
        let reason_on_record = if self.is_drill() {
            format!("[drill] {} — {reason}", self.route)
        } else {
            format!("{} — {reason}", self.route)
        };
        let mut a = crate::money::audit(
            KIND,
            &self.id,
            actor,
            &format!("{}->{}:{action}", from.as_str(), to.as_str()),
            &reason_on_record,
            figures_json(&f, self.is_drill()),
        );
        a.at = at;
        self.events.push(RecoveryEvent {
            at,
            actor: actor.to_owned(),
            from,
            to,
            action: action.to_owned(),
            reason: reason.to_owned(),
            figures,
        });
        a
    }

    fn row(&self) -> RecoveryRow {
        RecoveryRow {
            id: self.id.clone(),
            route: self.route.clone(),
            drill: self.drill.map(|d| {
                serde_json::to_value(d)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default()
            }),
            step: self.machine.step.as_str().to_owned(),
            opened_at: self.opened_at,
            closed_at: self.closed_at,
            body: serde_json::to_string(self).unwrap_or_default(),
        }
    }

    fn summary(&self) -> RecoverySummary {
        RecoverySummary {
            id: self.id.clone(),
            route: self.route.clone(),
            drill: self.drill,
            step: self.machine.step,
            stage_pct: self.machine.stage_pct(),
            held: self.machine.held(),
            opened_at: self.opened_at,
            opened_by: self.opened_by.clone(),
            closed_at: self.closed_at,
        }
    }

    /// The end of the incident window: closing, or now.
    fn until(&self) -> UnixMs {
        self.closed_at.unwrap_or_else(clock::now)
    }
}

/// Saves the run with its audit entries, durably, then holds the route as it says. The
/// caller changes a copy of the run and keeps it only when this succeeds, so a failed
/// save leaves nothing half done.
async fn save(st: &AppState, run: &Run, audit: &[AuditEntry]) -> Result<(), Response> {
    st.ledger
        .store()
        .save_recovery(&run.row(), audit)
        .await
        .map_err(ledger_down)?;
    apply(st, run);
    settle(st, run);
    Ok(())
}

/// The lists beside the runs: the summary, and an ended run's route and channels freed.
fn settle(st: &AppState, run: &Run) {
    lock(&st.recoveries.summaries).insert(run.id.clone(), run.summary());
    if !run.machine.step.is_open() {
        let mut held = lock(&st.recoveries.held);
        if held.get(&run.route) == Some(&run.id) {
            held.remove(&run.route);
        }
        lock(&st.recoveries.drill_channels).retain(|_, id| *id != run.id);
    }
}

// ---------------------------------------------------------------------------------------
// Start-up and the background look.

/// Reads the runs back (an open run holds its route again at once) and starts the look
/// that moves them along. `router` is the gateway's own, for the probes.
pub async fn start(st: &Arc<AppState>, router: axum::Router) -> spillway_ledger::Result<usize> {
    let _ = st.recoveries.router.set(router);
    let rows = st.ledger.store().recoveries(KEPT_RUNS).await?;
    let mut open = 0;
    for row in rows {
        let run: Run = match serde_json::from_str(&row.body) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(run = %row.id, error = %e, "a recovery run in the ledger could not be read; it is left out");
                continue;
            }
        };
        let mut run = run;
        if run.machine.step.is_open() {
            // Nobody watched the route while the gateway was down.
            run.machine.restart_stage(clock::now().0);
            apply(st, &run);
            lock(&st.recoveries.held).insert(run.route.clone(), run.id.clone());
            if let Some(d) = &run.drill_state {
                for (url, _) in &d.saved {
                    lock(&st.recoveries.drill_channels).insert(url.clone(), run.id.clone());
                }
            }
            open += 1;
        }
        lock(&st.recoveries.summaries).insert(run.id.clone(), run.summary());
        let load = run
            .drill_state
            .as_ref()
            .filter(|_| run.machine.step.is_open())
            .and_then(|d| d.load_key.clone());
        let (id, route) = (run.id.clone(), run.route.clone());
        let cell = Arc::new(tokio::sync::Mutex::new(run));
        lock(&st.recoveries.runs).insert(id, cell.clone());
        if let Some(k) = load {
            drill_load(st, cell, route, k);
        }
    }
    let st2 = st.clone();
    tokio::spawn(async move {
        let mut slow = Instant::now();
        let mut iv = tokio::time::interval(TICK);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            iv.tick().await;
            if st2.shutdown.draining.is_cancelled() {
                return;
            }
            let check = slow.elapsed() >= SLOW_CHECK;
            if check {
                slow = Instant::now();
            }
            for run in st2.recoveries.all() {
                // A run busy with an action (its probes) is looked at next time.
                let Ok(mut held) = run.try_lock() else {
                    continue;
                };
                if held.machine.step.is_open() {
                    let mut r = held.clone();
                    if look(&st2, &mut r, check).await {
                        *held = r;
                    }
                }
            }
        }
    });
    Ok(open)
}

/// One look at an open run: the drill's staging, detection, O2's figures, the stages'
/// time, the drain. Returns whether `r` is to be kept: false when a transition could not
/// be saved (the run stays as it was, and the next look tries again).
async fn look(st: &AppState, r: &mut Run, slow: bool) -> bool {
    let now = clock::now();
    let mut audit = Vec::new();
    let mut changed = false;
    if let Some(d) = r.drill_state.clone() {
        let incident_over = !d.lifted && now.0 >= d.incident_ends_at;
        let relapse_over = d.relapse_ends_at.is_some_and(|t| now.0 >= t);
        if incident_over || (relapse_over && d.lifted) {
            // Lifted only once the simulator has its usual behaviour back; else tried
            // again at the next look.
            if restore_sim(st, &d.saved).await {
                if let Some(d) = &mut r.drill_state {
                    d.lifted = true;
                    d.relapse_ends_at = None;
                }
                let step = r.machine.step;
                audit.push(r.event(
                    "simulator",
                    step,
                    step,
                    "drill_fault_lifted",
                    "the simulated provider answers normally again",
                    vec![],
                ));
                changed = true;
            }
        } else if relapse_over {
            // A relapse before the staged incident is over: the incident's fault goes on.
            if let (Some(scenario), Some(d)) = (r.drill, &mut r.drill_state) {
                d.relapse_ends_at = None;
                let _ = stage_on_sim(st, &d.saved, |b| scenario.behavior(b)).await;
            }
        }
    }
    let rc = route_control(st, &r.route);
    changed |= detect(st, r, now);
    // The stage as it stood before anything moved it: the one a score is due for.
    let before = (r.machine.stage_pct(), r.machine.stage_started_at);
    let mut changes: Vec<Change> = Vec::new();
    if r.machine.step == RecoveryStep::Resume
        && let Some(rc) = &rc
    {
        // G2: an open breaker refuses before any attempt: no outcome would ever show it.
        if rc.state() != spillway_control::BreakerState::Closed {
            let why = rc.view("").breaker.reason.unwrap_or_else(|| "it is not closed".into());
            if let Some(c) = r.machine.on_breaker_open(&why, now.0) {
                changes.push(c);
            }
        }
        if changes.is_empty() {
            for (o, at) in rc.take_outcomes() {
                if let Some(c) = r.machine.on_outcome(o, at) {
                    changes.push(c);
                    break;
                }
            }
        }
        if slow && changes.is_empty() {
            let since = UnixMs(r.machine.stage_started_at.unwrap_or(now.0));
            if let Ok(rows) = st
                .ledger
                .store()
                .scorecard(since, UnixMs(now.0 + 1), Some(&r.route))
                .await
            {
                r.duplicates = rows.iter().find(|x| x.route == r.route).map_or(0, |x| x.duplicates);
                if let Some(c) = r.machine.on_duplicates(r.duplicates, now.0) {
                    changes.push(c);
                }
            }
            if changes.is_empty()
                && let Some((projected, cap)) = projected_cost(st, &r.route, now)
                && let Some(c) = r.machine.on_cost(projected, cap, now.0)
            {
                changes.push(c);
            }
        }
    }
    if changes.is_empty()
        && let Some(c) = r.machine.tick(now.0)
    {
        changes.push(c);
    }
    if r.machine.step == RecoveryStep::Drain
        && slow
        && let Ok((backlog, unknowns)) = backlog_and_unknowns(st, &r.route).await
        && let Some(c) = r.machine.drained(backlog, unknowns)
    {
        changes.push(c);
    }
    for c in changes {
        // O1: the scorecard of the stage that just ended, by its time or by a step-back.
        if c.from == RecoveryStep::Resume
            && let (Some(pct), Some(from)) = before
        {
            stage_score(st, r, pct, UnixMs(from), now).await;
        }
        if c.action == "stepped_back" {
            if let Some(d) = &mut r.drill_state
                && d.relapse_ends_at.is_some()
                && d.lifted
            {
                // A staged relapse ends at the step-back it was staged for: one relapse,
                // one stop, so a drill practises O3's second stop on purpose (if the
                // simulator cannot be reached now, the next look tries again).
                let saved = d.saved.clone();
                d.relapse_ends_at = if restore_sim(st, &saved).await {
                    None
                } else {
                    Some(now.0)
                };
            }
            st.alert(
                Severity::Warning,
                format!("Recovery of {} stepped back", r.route),
                c.reason.clone(),
                Some(r.route.clone()),
            );
        }
        let entered = c.to == RecoveryStep::Resume && c.from != RecoveryStep::Resume;
        if entered || c.action == "stage_advanced" {
            r.incident.resume_times.push(now);
        }
        audit.push(r.record("gateway", &c));
        changed = true;
    }
    if !changed {
        return true;
    }
    match save(st, r, &audit).await {
        Ok(()) => true,
        Err(_) => {
            tracing::error!(run = %r.id, "a recovery run's transition could not be saved; the next look tries again");
            false
        }
    }
}

/// O5: detection is the route's breaker opening: recorded the first time the run sees
/// it not closed (at its opening, its isolation or a look). Whether it changed the run.
fn detect(st: &AppState, r: &mut Run, now: UnixMs) -> bool {
    if r.incident.detected_at.is_some() {
        return false;
    }
    let Some(rc) = route_control(st, &r.route) else {
        return false;
    };
    if rc.state() == spillway_control::BreakerState::Closed {
        return false;
    }
    let v = rc.view("");
    r.incident.detected_at = Some(UnixMs(now.0 - v.breaker.in_state_ms as i64));
    true
}

/// O2: the route's projected cost for the day against its daily cap, when it has one:
/// today's spend plus the last hour's pace for the rest of the day.
fn projected_cost(st: &AppState, route: &str, now: UnixMs) -> Option<(f64, f64)> {
    let b = st.accounts.routes(now).into_iter().find(|b| b.route == route)?;
    let cap = b.daily_budget_usd?;
    let day_end = st.accounts.day_start(now).0 + DAY_MS;
    let hours_left = ((day_end - now.0).max(0) as f64) / 3_600_000.0;
    Some((b.spent_today_usd + b.last_hour_usd * hours_left, cap))
}

async fn stage_score(st: &AppState, r: &mut Run, pct: u8, from: UnixMs, to: UnixMs) {
    if let Ok(rows) = st
        .ledger
        .store()
        .scorecard(from, UnixMs(to.0 + 1), Some(&r.route))
        .await
    {
        let row = rows
            .into_iter()
            .find(|x| x.route == r.route)
            .unwrap_or_else(|| ScoreRow {
                route: r.route.clone(),
                ..ScoreRow::default()
            });
        r.stage_scores.push(StageScore {
            stage_pct: pct,
            from,
            to,
            row,
        });
    }
}

/// O4: the route's jobs still waiting (queued, running, or with an owner), and its
/// unreconciled unknowns.
async fn backlog_and_unknowns(st: &AppState, route: &str) -> spillway_ledger::Result<(u64, u64)> {
    let backlog = st
        .jobs
        .open()
        .iter()
        .filter(|j| {
            crate::jobs::effective_route(j) == route
                && matches!(
                    j.state.as_str(),
                    crate::jobs::QUEUED | crate::jobs::RUNNING | crate::jobs::OWNER_REVIEW
                )
        })
        .count() as u64;
    let unknowns = st.ledger.store().route_unknowns(route).await?;
    Ok((backlog, unknowns))
}

// ---------------------------------------------------------------------------------------
// The simulator, for drills.

/// A simulated channel's control URL: its base URL is the simulator's `/{name}`.
fn sim_control_url(base_url: &str, name: &str) -> Option<String> {
    let root = base_url.strip_suffix(&format!("/{name}"))?;
    Some(format!("{root}/_control/channels/{name}"))
}

fn drill_channels(st: &AppState, route: &str) -> Vec<String> {
    route_channels(st, route)
        .into_iter()
        .filter_map(|c| {
            let name = c.cfg.simulated.as_deref()?;
            sim_control_url(&c.cfg.base_url, name)
        })
        .collect()
}

async fn sim_get(st: &AppState, url: &str) -> Result<Behavior, String> {
    #[derive(Deserialize)]
    struct View {
        behavior: Behavior,
    }
    let r = st.client.get(url).send().await.map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("the simulator answered {}", r.status()));
    }
    let bytes = r.bytes().await.map_err(|e| e.to_string())?;
    serde_json::from_slice::<View>(&bytes)
        .map(|v| v.behavior)
        .map_err(|e| e.to_string())
}

async fn sim_put(st: &AppState, url: &str, b: &Behavior) -> Result<(), String> {
    let body = serde_json::to_vec(b).map_err(|e| e.to_string())?;
    let r = st
        .client
        .put(url)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if r.status().is_success() {
        Ok(())
    } else {
        Err(format!("the simulator answered {}", r.status()))
    }
}

/// Puts each simulated channel's usual behaviour back; false if any could not be.
async fn restore_sim(st: &AppState, saved: &[(String, Behavior)]) -> bool {
    let mut all = true;
    for (url, b) in saved {
        if let Err(e) = sim_put(st, url, b).await {
            tracing::warn!(error = %e, "a drill could not put a simulated channel back");
            all = false;
        }
    }
    all
}

async fn stage_on_sim(
    st: &AppState,
    saved: &[(String, Behavior)],
    f: impl Fn(&Behavior) -> Behavior,
) -> Result<(), String> {
    for (url, b) in saved {
        sim_put(st, url, &f(b)).await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The admin API.

pub fn router() -> Router<Arc<AppState>> {
    Router::new()
        .route("/admin/v1/recoveries", get(list).post(open))
        .route("/admin/v1/recoveries/{id}", get(show))
        .route("/admin/v1/recoveries/{id}/isolate", post(isolate))
        .route("/admin/v1/recoveries/{id}/preserve", post(preserve))
        .route("/admin/v1/recoveries/{id}/evidence", get(evidence))
        .route("/admin/v1/recoveries/{id}/rollback", post(rollback))
        .route("/admin/v1/recoveries/{id}/probes", post(probes))
        .route("/admin/v1/recoveries/{id}/approve", post(approve))
        .route("/admin/v1/recoveries/{id}/explain", post(explain))
        .route("/admin/v1/recoveries/{id}/close", post(close))
        .route("/admin/v1/recoveries/{id}/cancel", post(cancel))
        .route("/admin/v1/recoveries/{id}/relapse", post(relapse))
        .route("/admin/v1/recoveries/{id}/report.md", get(report_md))
        .route("/admin/v1/recoveries/{id}/report.json", get(report_json))
        .route("/admin/v1/scorecard", get(crate::scorecard::scorecard))
}

/// A form's fields, each checked present and printable; the missing ones named at once.
fn fields<const N: usize>(v: [(&str, &Option<String>, usize); N]) -> Result<[String; N], Response> {
    let mut gone = Vec::new();
    let out: Vec<String> = v
        .iter()
        .map(|(name, val, max)| {
            text_field(val, *max).unwrap_or_else(|| {
                gone.push((*name).to_owned());
                String::new()
            })
        })
        .collect();
    if !gone.is_empty() {
        return Err(missing(gone));
    }
    Ok(out
        .try_into()
        .unwrap_or_else(|_| std::array::from_fn(|_| String::new())))
}

fn body<T: serde::de::DeserializeOwned + Default>(b: &[u8]) -> Result<T, Response> {
    if b.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    crate::admin::json_body(b).map_err(|m| form_error(StatusCode::UNPROCESSABLE_ENTITY, m, Vec::new()))
}

fn conflict(msg: impl Into<String>) -> Response {
    admin_error(StatusCode::CONFLICT, msg)
}

fn not_found(id: &str) -> Response {
    admin_error(StatusCode::NOT_FOUND, format!("no recovery run `{id}`"))
}

async fn list(State(st): State<Arc<AppState>>) -> Response {
    let mut runs = Vec::new();
    let mut held_routes = Vec::new();
    for r in st.recoveries.all() {
        let r = r.lock().await;
        if r.machine.step.is_open() {
            held_routes.push(r.route.clone());
        }
        runs.push(r.summary());
    }
    runs.sort_by(|a, b| {
        a.closed_at
            .is_some()
            .cmp(&b.closed_at.is_some())
            .then(b.opened_at.cmp(&a.opened_at))
    });
    let now = clock::now();
    let suggestions = st
        .control
        .views(&st)
        .into_iter()
        .filter(|v| v.breaker.state != spillway_control::BreakerState::Closed && !held_routes.contains(&v.route))
        .map(|v| RecoverySuggestion {
            breaker_opened_at: Some(UnixMs(now.0 - v.breaker.in_state_ms as i64)),
            reason: v
                .breaker
                .reason
                .clone()
                .unwrap_or_else(|| "the breaker is not closed".into()),
            route: v.route,
        })
        .collect();
    let routes = named_routes(&st);
    let probe_keys = live_keys(&st);
    Json(RecoveryList {
        runs,
        suggestions,
        drill_routes: routes.iter().filter(|(_, d)| **d).map(|(r, _)| r.clone()).collect(),
        scenarios: DrillScenario::ALL.to_vec(),
        probe_keys,
        routes: routes.into_keys().collect(),
    })
    .into_response()
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct OpenForm {
    route: Option<String>,
    actor: Option<String>,
    reason: Option<String>,
    drill: Option<DrillScenario>,
    /// The key a drill's own traffic runs as (default: the first live key).
    key: Option<String>,
}

async fn open(State(st): State<Arc<AppState>>, b: Bytes) -> Response {
    let f: OpenForm = match body(&b) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let [route, actor, reason] = match fields([
        ("route", &f.route, 200),
        ("actor", &f.actor, 64),
        ("reason", &f.reason, 500),
    ]) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let Some((format, model)) = crate::jobs::split_route(&route) else {
        return form_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("`route`: `format/model`, e.g. `openai/gpt-4o-mini`; `{route}` is not one"),
            Vec::new(),
        );
    };
    if route_channels(&st, &format!("{format}/{model}")).is_empty() {
        return form_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("`route`: no channel serves `{route}`"),
            Vec::new(),
        );
    }
    let route = format!("{format}/{model}");
    let routes = named_routes(&st);
    if f.drill.is_some() && !routes.get(&route).copied().unwrap_or(false) {
        return conflict(format!(
            "a drill runs only on routes every channel of which is simulated (`sim://`); `{route}` has a real provider's channel"
        ));
    }
    // One open run per route; the check and the insert under one lock.
    let id = new_run_id();
    let now = clock::now();
    let drill_cfg = &st.config.recovery;
    let cfg = RecoveryConfig {
        stage_ms: if f.drill.is_some() {
            drill_cfg.drill_stage_ms
        } else {
            drill_cfg.stage_ms
        } as i64,
        ..RecoveryConfig::default()
    };
    let started_at = incident_start(&st, &route, now).await;
    let mut run = Run {
        id: id.clone(),
        route: route.clone(),
        drill: f.drill,
        reason: reason.clone(),
        opened_by: actor.clone(),
        opened_at: now,
        machine: Recovery::new(cfg),
        split: None,
        evidence: None,
        rollback: None,
        probes: Vec::new(),
        stage_scores: Vec::new(),
        explanations: BTreeMap::new(),
        incident: IncidentRecord {
            started_at,
            ..IncidentRecord::default()
        },
        events: Vec::new(),
        drill_state: None,
        closed_at: None,
        duplicates: 0,
    };
    {
        let mut held = lock(&st.recoveries.held);
        if let Some(other) = held.get(&route) {
            return conflict(format!("run {other} already holds `{route}`"));
        }
        held.insert(route.clone(), id.clone());
    }
    // Until it is saved, the run is not listed; the route is reserved for it.
    let forget = |st: &AppState| {
        lock(&st.recoveries.held).remove(&route);
        lock(&st.recoveries.drill_channels).retain(|_, run| *run != id);
    };
    let what = match f.drill {
        Some(d) => format!("drill ({}) opened: {reason}", d.label()),
        None => format!("opened: {reason}"),
    };
    detect(&st, &mut run, now);
    let mut audit = vec![run.event(
        &actor,
        RecoveryStep::Isolate,
        RecoveryStep::Isolate,
        "opened",
        &what,
        vec![],
    )];
    let load_key = match (&f.drill, text_field(&f.key, 64)) {
        (None, _) => None,
        (Some(_), Some(k)) if st.accounts.key_by_name(&k).is_some() => Some(k),
        (Some(_), Some(k)) => {
            forget(&st);
            return form_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("`key`: no live gateway key named `{k}`"),
                vec!["key".into()],
            );
        }
        (Some(_), None) => match live_keys(&st).as_slice() {
            [only] => Some(only.clone()),
            _ => {
                forget(&st);
                return form_error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "`key`: name the gateway key the drill's own traffic runs as (and is billed to)".into(),
                    vec!["key".into()],
                );
            }
        },
    };
    if let Some(d) = f.drill {
        let urls = drill_channels(&st, &route);
        {
            // Two drills on one simulated channel would each put back the other's fault.
            let mut taken = lock(&st.recoveries.drill_channels);
            if let Some((url, other)) = urls.iter().find_map(|u| taken.get(u).map(|o| (u, o))) {
                let msg =
                    format!("drill {other} already stages a fault on the simulated channel {url}; close it first");
                drop(taken);
                forget(&st);
                return conflict(msg);
            }
            for u in &urls {
                taken.insert(u.clone(), id.clone());
            }
        }
        let mut saved = Vec::new();
        for url in urls {
            match sim_get(&st, &url).await {
                Ok(b) => saved.push((url, b)),
                Err(e) => {
                    forget(&st);
                    return admin_error(
                        StatusCode::BAD_GATEWAY,
                        format!("the simulator could not be reached: {e}"),
                    );
                }
            }
        }
        if let Err(e) = stage_on_sim(&st, &saved, |b| d.behavior(b)).await {
            restore_sim(&st, &saved).await;
            forget(&st);
            return admin_error(StatusCode::BAD_GATEWAY, format!("the simulator refused the drill: {e}"));
        }
        let ends = now.0 + drill_cfg.drill_incident_ms as i64;
        run.drill_state = Some(DrillState {
            saved,
            incident_ends_at: ends,
            lifted: false,
            relapse_ends_at: None,
            load_key: load_key.clone(),
        });
        audit.push(run.event(
            "simulator",
            RecoveryStep::Isolate,
            RecoveryStep::Isolate,
            "drill_fault_staged",
            &format!(
                "the simulator stages a {} on {} for {} s",
                d.label(),
                route,
                drill_cfg.drill_incident_ms / 1000
            ),
            vec![("incident_ms".into(), drill_cfg.drill_incident_ms as f64)],
        ));
    }
    if let Err(e) = save(&st, &run, &audit).await {
        if let Some(d) = &run.drill_state {
            restore_sim(&st, &d.saved).await;
        }
        forget(&st);
        return e;
    }
    let cell = Arc::new(tokio::sync::Mutex::new(run.clone()));
    lock(&st.recoveries.runs).insert(id.clone(), cell.clone());
    if let Some(k) = load_key {
        drill_load(&st, cell, run.route.clone(), k);
    }
    (StatusCode::CREATED, Json(view(&st, &run).await)).into_response()
}

/// A drill's own traffic: one-token requests on the route as `key`, through the gate and
/// the breaker like a client's, until the run drains or ends. Without it an operator
/// practising on the embedded default would wait minutes for the demo's spread-out
/// traffic to open a breaker.
fn drill_load(st: &Arc<AppState>, cell: Arc<tokio::sync::Mutex<Run>>, route: String, key: String) {
    let st = st.clone();
    tokio::spawn(async move {
        let Some(router) = st.recoveries.router.get().cloned() else {
            return;
        };
        let slots = Arc::new(tokio::sync::Semaphore::new(DRILL_LOAD_IN_FLIGHT));
        let mut iv = tokio::time::interval(Duration::from_millis(1000 / DRILL_LOAD_RPS));
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n: u64 = 0;
        loop {
            iv.tick().await;
            if st.shutdown.draining.is_cancelled() {
                return;
            }
            // A run busy with an action (its probes) keeps its step: go on meanwhile.
            if let Ok(r) = cell.try_lock()
                && !matches!(
                    r.machine.step,
                    RecoveryStep::Isolate
                        | RecoveryStep::Preserve
                        | RecoveryStep::RollBack
                        | RecoveryStep::Confirm
                        | RecoveryStep::Resume
                )
            {
                return;
            }
            let (Some(k), Ok(permit)) = (st.accounts.key_by_name(&key), slots.clone().try_acquire_owned()) else {
                continue;
            };
            n += 1;
            let Some(mut req) = synthetic_request(&route, "Spillway drill traffic.", None, &format!("drill-{n}"))
            else {
                return;
            };
            req.extensions_mut().insert(ProbeRun { key: k, bypass: false });
            let router = router.clone();
            tokio::spawn(async move {
                use tower::ServiceExt;
                let Ok(resp) = router.oneshot(req).await;
                let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
                drop(permit);
            });
        }
    });
}

/// The millisecond a UUIDv7 request id begins with.
fn id_ms(id: &str) -> Option<UnixMs> {
    let hex: String = id.chars().filter(|c| *c != '-').take(12).collect();
    i64::from_str_radix(&hex, 16).ok().map(UnixMs)
}

/// O5: when the incident began: the route's first failure in the hour before the run,
/// after its last success (else the run's opening).
async fn incident_start(st: &AppState, route: &str, now: UnixMs) -> UnixMs {
    let from = UnixMs(now.0 - 3_600_000);
    match st
        .ledger
        .store()
        .first_failure(route, from, UnixMs(now.0 + 1), true)
        .await
    {
        // Windows select rows by their id (UUIDv7), stamped just before `received_at`:
        // the id's millisecond keeps the first failure inside.
        Ok(Some(id)) => id_ms(&id).unwrap_or(now),
        _ => now,
    }
}

async fn show(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let Some(cell) = st.recoveries.get(&id) else {
        return not_found(&id);
    };
    let run = cell.lock().await.clone();
    Json(view(&st, &run).await).into_response()
}

fn check_of(step: RecoveryStep) -> &'static str {
    match step {
        RecoveryStep::Isolate => {
            "automatic retries off, the route's queue paused, its ledger split into succeeded / failed / unknown"
        }
        RecoveryStep::Preserve => {
            "an evidence bundle (request, client and provider request ids, errors, times, tokens, result ids; no secret) exported"
        }
        RecoveryStep::RollBack => "each policy on the route back to its last known good, or why nothing needs to",
        RecoveryStep::Confirm => {
            "5 side-effect-free probes one at a time: 100 % success, P95 ≤ 1.5 × normal, 0 duplicates"
        }
        RecoveryStep::Resume => {
            "25 %, 50 %, 100 % of the route's concurrency, stepping back on 5xx in 5 of 20, 2 min of 429s, a duplicate or projected cost over the cap"
        }
        RecoveryStep::Drain => "held jobs drained in deadline order; unknowns reconciled before any replay",
        RecoveryStep::Close => "backlog 0, unknowns 0, every deadline overrun explained, customer contact ticked",
        RecoveryStep::Closed | RecoveryStep::Cancelled => "",
    }
}

async fn overruns(st: &AppState, r: &Run) -> Vec<Overrun> {
    let jobs = st
        .ledger
        .store()
        .overruns(Some(&r.route), r.incident.started_at, UnixMs(r.until().0 + 1))
        .await
        .unwrap_or_default();
    jobs.into_iter()
        .map(|j| {
            let e = r.explanations.get(&j.id);
            Overrun {
                id: j.id.clone(),
                detail: format!(
                    "{} job {}: {}",
                    j.state,
                    j.id,
                    j.last_error.clone().unwrap_or_else(|| "past its deadline".into())
                ),
                job_id: j.id,
                deadline_at: j.expires_at,
                explanation: e.map(|e| e.0.clone()),
                explained_by: e.map(|e| e.1.clone()),
            }
        })
        .collect()
}

async fn rollback_candidates(st: &AppState, r: &Run) -> Vec<RollbackCandidate> {
    let start = r.incident.started_at;
    let good = st
        .ledger
        .store()
        .last_good_versions(&r.route, UnixMs(start.0 - BEFORE_MS), start)
        .await
        .unwrap_or_default();
    good.into_iter()
        .filter_map(|(wf, last_good)| {
            let cur = st.workflows.get(&wf)?;
            (cur.version != last_good).then(|| RollbackCandidate {
                workflow: wf,
                current_version: cur.version.clone(),
                last_good_version: last_good,
            })
        })
        .collect()
}

async fn close_checks(
    st: &AppState,
    r: &Run,
    overruns: &[Overrun],
) -> spillway_ledger::Result<(CloseChecks, u64, u64)> {
    let (backlog, unknowns) = backlog_and_unknowns(st, &r.route).await?;
    Ok((
        CloseChecks {
            backlog,
            unknowns,
            unexplained_overruns: overruns.iter().filter(|o| o.explanation.is_none()).count() as u64,
            customer_contacted: r.incident.customer_contacted,
        },
        backlog,
        unknowns,
    ))
}

async fn view(st: &AppState, r: &Run) -> RecoveryView {
    let m = &r.machine;
    let steps = RecoveryStep::CHECKLIST
        .iter()
        .map(|s| {
            let d = m.done_of(*s);
            StepView {
                step: *s,
                status: m.status_of(*s).to_owned(),
                check: check_of(*s).to_owned(),
                evidence: d.map(|d| d.evidence.clone()),
                done_by: d.map(|d| d.actor.clone()),
                done_at: d.map(|d| UnixMs(d.at)),
            }
        })
        .collect();
    let overruns = overruns(st, r).await;
    let (close_missing, backlog, unknowns) = match close_checks(st, r, &overruns).await {
        Ok((checks, b, u)) => (checks.missing(), b, u),
        Err(e) => (
            vec![format!(
                "the ledger could not be read to check the backlog and unknowns: {e}"
            )],
            0,
            0,
        ),
    };
    let total = route_concurrency(st, &r.route);
    let gate = m.gate();
    let (outcomes, failures, rl_since) = m.recent();
    let now = clock::now();
    let budget = st.accounts.routes(now).into_iter().find(|b| b.route == r.route);
    let projected = projected_cost(st, &r.route, now);
    // O5: an open run's figures so far; a closed one's were fixed at its close.
    let incident = if r.closed_at.is_none() {
        let mut live = r.clone();
        fill_incident(st, &mut live).await;
        live.incident
    } else {
        r.incident.clone()
    };
    let rollback_candidates = if r.machine.step == RecoveryStep::RollBack {
        rollback_candidates(st, r).await
    } else {
        Vec::new()
    };
    RecoveryView {
        id: r.id.clone(),
        route: r.route.clone(),
        drill: r.drill,
        step: m.step,
        reason: r.reason.clone(),
        opened_by: r.opened_by.clone(),
        opened_at: r.opened_at,
        stages: m.cfg.stages.clone(),
        stage: m.stage.map(|s| s as u32),
        stage_ms: m.cfg.stage_ms as u64,
        stage_started_at: m.stage_started_at.map(UnixMs),
        concurrency_pct: gate.map_or(100, |g| g.share_pct),
        concurrency_cap: gate.filter(|g| g.share_pct > 0).map(|g| cap_at(g.share_pct, total)),
        route_concurrency: total,
        retries_on: gate.is_none(),
        stops: m.stops,
        held: m.held(),
        approvals: m.current_approvals().into_iter().cloned().collect(),
        steps,
        split: r.split.clone(),
        evidence: r.evidence.clone(),
        rollback_candidates,
        rollback: r.rollback.clone(),
        probes: r.probes.clone(),
        probe_rounds: m.probe_rounds,
        normal_p95_ms: m.normal_p95_ms,
        recent: RecentWindow {
            outcomes: outcomes as u64,
            server_errors: failures as u64,
            rate_limited_for_ms: rl_since.map(|s| (now.0 - s).max(0) as u64),
            duplicates: r.duplicates,
            projected_day_usd: projected.map(|p| p.0),
            daily_budget_usd: budget.and_then(|b| b.daily_budget_usd),
        },
        stage_scores: r.stage_scores.clone(),
        close_missing: if m.step.is_open() { close_missing } else { Vec::new() },
        overruns,
        backlog,
        unknowns,
        incident,
        events: r.events.clone(),
    }
}

/// Ends an action: saves the changed copy of the run with its audit entries, keeps it,
/// and answers with the run as it now is (or, when the save failed, changes nothing).
async fn commit(
    st: &AppState,
    mut guard: tokio::sync::OwnedMutexGuard<Run>,
    run: Run,
    audit: &[AuditEntry],
) -> Response {
    if let Err(r) = save(st, &run, audit).await {
        return r;
    }
    let v = view(st, &run).await;
    *guard = run;
    Json(v).into_response()
}

/// Locks an open run for an action.
async fn open_run(st: &AppState, id: &str) -> Result<tokio::sync::OwnedMutexGuard<Run>, Response> {
    let cell = st.recoveries.get(id).ok_or_else(|| not_found(id))?;
    let run = cell.lock_owned().await;
    if !run.machine.step.is_open() {
        return Err(conflict(format!("run {id} is {}", run.machine.step.as_str())));
    }
    Ok(run)
}

fn refused(e: spillway_control::RecoveryError) -> Response {
    conflict(e.to_string())
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ActorForm {
    actor: Option<String>,
    reason: Option<String>,
}

async fn isolate(State(st): State<Arc<AppState>>, Path(id): Path<String>, b: Bytes) -> Response {
    let f: ActorForm = match body(&b) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let [actor] = match fields([("actor", &f.actor, 64)]) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let guard = match open_run(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut run = guard.clone();
    let now = clock::now();
    let rows = match st
        .ledger
        .store()
        .scorecard(run.incident.started_at, UnixMs(now.0 + 1), Some(&run.route))
        .await
    {
        Ok(r) => r,
        Err(e) => return ledger_down(e),
    };
    let row = rows.into_iter().find(|x| x.route == run.route).unwrap_or_default();
    let split = LedgerSplit {
        since: run.incident.started_at,
        succeeded: row.succeeded,
        failed: row.failed,
        unknown: row.unknowns,
    };
    let evidence = format!(
        "retries off, queue paused; since {}: {} succeeded / {} failed / {} unknown",
        run.incident.started_at.to_rfc3339(),
        split.succeeded,
        split.failed,
        split.unknown
    );
    let c = match run.machine.complete(RecoveryStep::Isolate, &actor, evidence, now.0) {
        Ok(c) => c,
        Err(e) => return refused(e),
    };
    run.split = Some(split);
    run.incident.stopped_at = Some(now);
    detect(&st, &mut run, now);
    let mut c = c;
    c.figures = vec![
        ("succeeded".into(), row.succeeded as f64),
        ("failed".into(), row.failed as f64),
        ("unknown".into(), row.unknowns as f64),
    ];
    let a = run.record(&actor, &c);
    commit(&st, guard, run, &[a]).await
}

/// O1: the evidence bundle: what happened on the route, every id that ties a request to
/// its client and its provider, and nothing secret (no key, no prompt, no answer).
async fn build_bundle(st: &AppState, r: &Run, now: UnixMs) -> spillway_ledger::Result<(Bytes, u64, bool)> {
    let rows = st
        .ledger
        .store()
        .route_requests(&r.route, r.incident.started_at, UnixMs(now.0 + 1), EVIDENCE_ROWS + 1)
        .await?;
    let truncated = rows.len() as u32 > EVIDENCE_ROWS;
    let requests: Vec<serde_json::Value> = rows
        .iter()
        .take(EVIDENCE_ROWS as usize)
        .map(|(q, atts)| {
            serde_json::json!({
                "request_id": q.id,
                "trace_id": q.trace_id,
                "client_request_id": q.client_request_id,
                "provider_request_id": q.upstream_request_id,
                "key_name": q.key_name,
                "owner": q.owner,
                "workflow": q.workflow,
                "policy_version": q.policy_version,
                "job_id": q.job_id,
                "endpoint": q.endpoint,
                "channel": q.channel,
                "served_model": q.served_model,
                "state": q.state,
                "http_status": q.http_status,
                "error_class": q.error_class,
                "error": q.error_message,
                "received_at": q.received_at,
                "finished_at": q.finished_at,
                "input_tokens": q.input_tokens,
                "output_tokens": q.output_tokens,
                "cost_usd": q.cost_usd,
                "attempts": q.attempts,
                "idempotency_key": q.idempotency_key,
                "result_id": q.result_id(),
                "response_id": q.response_id,
                "reconciliation": q.resolution.as_ref().and_then(|r| r.reconciliation),
                "attempt_log": atts.iter().map(|a| serde_json::json!({
                    "attempt": a.attempt_no,
                    "channel": a.channel,
                    "provider_request_id": a.upstream_request_id,
                    "http_status": a.http_status,
                    "error_class": a.error_class,
                    "provider_error_type": a.provider_error_type,
                    "error": a.message,
                    "retry_after_ms": a.retry_after_ms,
                    "started_at": a.started_at,
                    "finished_at": a.finished_at,
                    "input_tokens": a.input_tokens,
                    "output_tokens": a.output_tokens,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let n = requests.len() as u64;
    let doc = serde_json::json!({
        "run": r.id,
        "drill": r.drill,
        "route": r.route,
        "from": r.incident.started_at,
        "to": now,
        "truncated": truncated,
        "requests": requests,
    });
    let bytes = serde_json::to_vec_pretty(&doc).unwrap_or_default();
    Ok((Bytes::from(bytes), n, truncated))
}

async fn preserve(State(st): State<Arc<AppState>>, Path(id): Path<String>, b: Bytes) -> Response {
    let f: ActorForm = match body(&b) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let [actor] = match fields([("actor", &f.actor, 64)]) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let guard = match open_run(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut run = guard.clone();
    if run.machine.step != RecoveryStep::Preserve {
        return conflict(format!("the run is at `{}`, not `preserve`", run.machine.step.as_str()));
    }
    let now = clock::now();
    let (bytes, n, truncated) = match build_bundle(&st, &run, now).await {
        Ok(b) => b,
        Err(e) => return ledger_down(e),
    };
    let sha = hex::encode(Sha256::digest(&bytes));
    let summary = EvidenceSummary {
        requests: n,
        bytes: bytes.len() as u64,
        sha256: sha.clone(),
        built_by: actor.clone(),
        built_at: now,
        truncated,
    };
    let evidence = format!("{n} requests, {} bytes, sha256 {}", bytes.len(), &sha[..16]);
    let mut c = match run.machine.complete(RecoveryStep::Preserve, &actor, evidence, now.0) {
        Ok(c) => c,
        Err(e) => return refused(e),
    };
    c.figures = vec![("requests".into(), n as f64), ("bytes".into(), bytes.len() as f64)];
    // The very bytes the hash was taken of, kept apart from the request rows a prune
    // may remove.
    if let Err(e) = st.ledger.store().save_evidence(&run.id, &bytes).await {
        return ledger_down(e);
    }
    run.evidence = Some(summary);
    let a = run.record(&actor, &c);
    commit(&st, guard, run, &[a]).await
}

fn attachment(content_type: &str, name: &str, body: Bytes) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type.to_owned()),
            (header::CONTENT_DISPOSITION, format!("attachment; filename=\"{name}\"")),
        ],
        body,
    )
        .into_response()
}

async fn evidence(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let Some(cell) = st.recoveries.get(&id) else {
        return not_found(&id);
    };
    let run = cell.lock().await.clone();
    if run.evidence.is_none() {
        return conflict("the evidence bundle is built at the `preserve` step; it has not been yet");
    }
    let bytes = match st.ledger.store().evidence(&id).await {
        Ok(Some(b)) => Bytes::from(b),
        Ok(None) => return conflict(format!("the evidence bundle of {id} is not in the ledger")),
        Err(e) => return ledger_down(e),
    };
    attachment("application/json", &format!("{id}-evidence.json"), bytes)
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RollbackForm {
    actor: Option<String>,
    reason: Option<String>,
    workflow: Option<String>,
    version: Option<String>,
}

async fn rollback(State(st): State<Arc<AppState>>, Path(id): Path<String>, b: Bytes) -> Response {
    let f: RollbackForm = match body(&b) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let [actor, reason] = match fields([("actor", &f.actor, 64), ("reason", &f.reason, 500)]) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let guard = match open_run(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut run = guard.clone();
    if run.machine.step != RecoveryStep::RollBack {
        return conflict(format!(
            "the run is at `{}`, not `roll_back`",
            run.machine.step.as_str()
        ));
    }
    let now = clock::now();
    let candidates = rollback_candidates(&st, &run).await;
    let done = match text_field(&f.workflow, 100) {
        None => RollbackDone {
            actor: actor.clone(),
            reason: reason.clone(),
            at: now,
            workflow: None,
            from_version: None,
            to_version: None,
        },
        Some(wf) => {
            let to = text_field(&f.version, 64).or_else(|| {
                candidates
                    .iter()
                    .find(|c| c.workflow == wf)
                    .map(|c| c.last_good_version.clone())
            });
            let Some(to) = to else {
                return form_error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!("`workflow` {wf} has no last known good version on this route; name a `version`"),
                    vec!["version".into()],
                );
            };
            let from = st.workflows.get(&wf).map(|w| w.version.clone());
            let why = format!("recovery run {}: {reason}", run.id);
            match crate::workflows::rollback(&st, &wf, &to, &actor, &why).await {
                Ok(_) => {}
                Err(crate::workflows::RollbackError::NotFound(m)) => return admin_error(StatusCode::NOT_FOUND, m),
                Err(crate::workflows::RollbackError::ReadOnly(m)) => return conflict(m),
                Err(crate::workflows::RollbackError::Failed(m)) => {
                    return admin_error(StatusCode::UNPROCESSABLE_ENTITY, m);
                }
            }
            run.incident.config_changes.push(ConfigChange {
                at: now,
                actor: actor.clone(),
                approver: None,
                what: format!("workflow policy `{wf}` rolled back"),
                before: from.clone(),
                after: Some(to.clone()),
            });
            RollbackDone {
                actor: actor.clone(),
                reason: reason.clone(),
                at: now,
                workflow: Some(wf),
                from_version: from,
                to_version: Some(to),
            }
        }
    };
    let evidence = match &done.workflow {
        Some(wf) => format!(
            "{wf}: {} → {}",
            done.from_version.as_deref().unwrap_or("?"),
            done.to_version.as_deref().unwrap_or("?")
        ),
        None if candidates.is_empty() => format!("no policy changed since its last known good: {reason}"),
        None => format!("{} changed polic(ies) kept as they are: {reason}", candidates.len()),
    };
    let c = match run.machine.complete(RecoveryStep::RollBack, &actor, evidence, now.0) {
        Ok(c) => c,
        Err(e) => return refused(e),
    };
    run.rollback = Some(done);
    let a = run.record(&actor, &c);
    commit(&st, guard, run, &[a]).await
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ProbeForm {
    actor: Option<String>,
    key: Option<String>,
}

/// A one-token request in the route's own format, with nothing that could act.
fn probe_request(route: &str, n: u32, run: &str, round: u32) -> Option<http::Request<axum::body::Body>> {
    let id = format!("{run}-probe-{round}-{n}");
    synthetic_request(route, "Spillway recovery probe: reply with one word.", Some(&id), &id)
}

/// A one-token request on `route` in its own format.
fn synthetic_request(
    route: &str,
    prompt: &str,
    idempotency_key: Option<&str>,
    client_id: &str,
) -> Option<http::Request<axum::body::Body>> {
    let (format, model) = crate::jobs::split_route(route)?;
    // An embedding model is probed on its own endpoint: a chat request would fail there
    // however healthy the provider is.
    let embeds = model.contains("embedding");
    let (path, body) = match format {
        Format::OpenAi if embeds => (
            "/v1/embeddings".to_owned(),
            serde_json::json!({"model": model, "input": prompt}),
        ),
        Format::Gemini if embeds => (
            format!("/v1beta/models/{model}:embedContent"),
            serde_json::json!({"content": {"parts": [{"text": prompt}]}}),
        ),
        // `max_completion_tokens`: what every current OpenAI chat model takes (reasoning
        // models refuse `max_tokens`).
        Format::OpenAi => (
            "/v1/chat/completions".to_owned(),
            serde_json::json!({"model": model, "max_completion_tokens": 1, "messages": [{"role": "user", "content": prompt}]}),
        ),
        Format::Anthropic => (
            "/v1/messages".to_owned(),
            serde_json::json!({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": prompt}]}),
        ),
        Format::Gemini => (
            format!("/v1beta/models/{model}:generateContent"),
            serde_json::json!({"contents": [{"role": "user", "parts": [{"text": prompt}]}], "generationConfig": {"maxOutputTokens": 1}}),
        ),
    };
    let mut b = http::Request::builder()
        .method(http::Method::POST)
        .uri(path)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::HOST, "127.0.0.1")
        .header("anthropic-version", "2023-06-01")
        .header("x-client-request-id", client_id);
    if let Some(k) = idempotency_key {
        b = b.header(crate::idempotency::HEADER, k);
    }
    b.body(axum::body::Body::from(body.to_string())).ok()
}

/// O1: the route's normal latency: the P95 of its answered requests over the 28 days
/// before the incident, else what the breaker has seen.
async fn normal_p95(st: &AppState, r: &Run) -> Option<f64> {
    let start = r.incident.started_at;
    let ledger = st
        .ledger
        .store()
        .normal_latency(&r.route, UnixMs(start.0 - BEFORE_MS), start)
        .await
        .ok()
        .flatten();
    ledger.or_else(|| route_control(st, &r.route).and_then(|rc| rc.view("").breaker.normal_latency_ms))
}

async fn probes(State(st): State<Arc<AppState>>, Path(id): Path<String>, b: Bytes) -> Response {
    let f: ProbeForm = match body(&b) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let [actor, key_name] = match fields([("actor", &f.actor, 64), ("key", &f.key, 64)]) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let Some(key) = st.accounts.key_by_name(&key_name) else {
        return form_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("`key`: no live gateway key named `{key_name}`"),
            vec!["key".into()],
        );
    };
    let Some(router) = st.recoveries.router.get().cloned() else {
        return admin_error(StatusCode::SERVICE_UNAVAILABLE, "the gateway is still starting");
    };
    let guard = match open_run(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut run = guard.clone();
    let normal = normal_p95(&st, &run).await;
    if let Err(e) = run.machine.start_probes(normal) {
        return refused(e);
    }
    run.probes.clear();
    let round = run.machine.probe_rounds;
    let round_start = clock::now();
    let mut audit = Vec::new();
    let mut n = 0;
    let mut verdict: Option<Result<Option<Change>, String>> = None;
    while run.machine.probe_wanted() {
        n += 1;
        let Some(mut req) = probe_request(&run.route, n, &run.id, round) else {
            return admin_error(StatusCode::UNPROCESSABLE_ENTITY, "the route cannot be probed");
        };
        req.extensions_mut().insert(ProbeRun {
            key: key.clone(),
            bypass: true,
        });
        let t0 = Instant::now();
        use tower::ServiceExt;
        let resp = match router.clone().oneshot(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
        let status = resp.status();
        let request_id = resp
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let text = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let latency_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let ok = status.is_success();
        let error = (!ok).then(|| {
            let v: serde_json::Value = serde_json::from_slice(&text).unwrap_or_default();
            v.pointer("/error/message")
                .and_then(|m| m.as_str())
                .map(|m| spillway_ledger::truncate(m.to_owned(), 300))
                .unwrap_or_else(|| format!("HTTP {status}"))
        });
        // I2: a key completed upstream more than once on the route since the round
        // began is a duplicate, as the ledger sees it.
        let duplicate = ok && probe_duplicated(&st, &run.route, round_start).await;
        run.probes.push(ProbeView {
            n,
            ok,
            status: Some(status.as_u16()),
            latency_ms,
            request_id,
            error,
            duplicate,
        });
        let v = run.machine.probe(
            ProbeResult {
                ok,
                latency_ms,
                duplicate,
            },
            &actor,
            clock::now().0,
        );
        if !matches!(v, Ok(None)) || !run.machine.probe_wanted() {
            verdict = Some(v);
            break;
        }
    }
    let now = clock::now();
    let step = run.machine.step;
    match verdict {
        Some(Ok(Some(c))) => {
            if let Err(e) = resumed(&st, &mut run, &actor, &c, now).await {
                return ledger_down(e);
            }
            audit.push(run.record(&actor, &c));
        }
        Some(Err(why)) => {
            audit.push(run.event(
                &actor,
                step,
                step,
                "probes_failed",
                &why,
                vec![("probes".into(), f64::from(n))],
            ));
        }
        _ => {
            let why = if run.machine.held() {
                "the probes passed; the run is held until two approvals (O3)".to_owned()
            } else {
                "the probe round ended".to_owned()
            };
            audit.push(run.event(
                &actor,
                step,
                step,
                "probes_passed",
                &why,
                vec![("probes".into(), f64::from(n))],
            ));
        }
    }
    commit(&st, guard, run, &audit).await
}

/// The run resumes (its probes passed, or its approvals came in after they did): the
/// route's breaker closes on the run's word, since from here the run decides, and the
/// incident record notes when.
async fn resumed(st: &AppState, run: &mut Run, actor: &str, c: &Change, now: UnixMs) -> spillway_ledger::Result<()> {
    run.incident.recovered_at.get_or_insert(now);
    run.incident.resume_times.push(now);
    if let Some(rc) = route_control(st, &run.route) {
        let before = rc.state();
        if before != spillway_control::BreakerState::Closed {
            let why = format!("recovery run {} confirmed the route: {}", run.id, c.reason);
            st.control.force(st, &rc, false, actor, &why).await?;
            run.incident.config_changes.push(ConfigChange {
                at: now,
                actor: actor.to_owned(),
                approver: None,
                what: format!("breaker of {} closed by the recovery run", run.route),
                before: Some(format!("{before:?}").to_lowercase()),
                after: Some("closed".into()),
            });
        }
    }
    Ok(())
}

async fn probe_duplicated(st: &AppState, route: &str, since: UnixMs) -> bool {
    match st
        .ledger
        .store()
        .scorecard(since, UnixMs(clock::now().0 + 1), Some(route))
        .await
    {
        Ok(rows) => rows.iter().any(|x| x.route == route && x.duplicates > 0),
        Err(_) => false,
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ApproveForm {
    actor: Option<String>,
    reason: Option<String>,
    role: Option<ApprovalRole>,
}

async fn approve(State(st): State<Arc<AppState>>, Path(id): Path<String>, b: Bytes) -> Response {
    let f: ApproveForm = match body(&b) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let mut gone = Vec::new();
    if text_field(&f.actor, 64).is_none() {
        gone.push("actor".to_owned());
    }
    if f.role.is_none() {
        gone.push("role".to_owned());
    }
    if text_field(&f.reason, 500).is_none() {
        gone.push("reason".to_owned());
    }
    if !gone.is_empty() {
        return missing(gone);
    }
    let (actor, reason) = (
        text_field(&f.actor, 64).unwrap_or_default(),
        text_field(&f.reason, 500).unwrap_or_default(),
    );
    let role = f.role.unwrap_or(ApprovalRole::PlatformOperations);
    let guard = match open_run(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut run = guard.clone();
    let now = clock::now();
    let step = run.machine.step;
    let got = match run.machine.approve(Approval {
        actor: actor.clone(),
        role,
        reason: reason.clone(),
        at: now.0,
    }) {
        Ok(c) => c,
        Err(e) => return refused(e),
    };
    let role_name = role.label();
    let mut audit = vec![run.event(
        &actor,
        step,
        step,
        "approval_given",
        &format!("approved as {role_name}: {reason}"),
        vec![],
    )];
    if let Some(c) = got {
        if c.to == RecoveryStep::Resume
            && step != RecoveryStep::Resume
            && let Err(e) = resumed(&st, &mut run, &actor, &c, now).await
        {
            return ledger_down(e);
        }
        audit.push(run.record(&actor, &c));
    }
    commit(&st, guard, run, &audit).await
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ExplainForm {
    actor: Option<String>,
    overrun: Option<String>,
    explanation: Option<String>,
}

async fn explain(State(st): State<Arc<AppState>>, Path(id): Path<String>, b: Bytes) -> Response {
    let f: ExplainForm = match body(&b) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let [actor, overrun, explanation] = match fields([
        ("actor", &f.actor, 64),
        ("overrun", &f.overrun, 100),
        ("explanation", &f.explanation, 1000),
    ]) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let guard = match open_run(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut run = guard.clone();
    if !overruns(&st, &run).await.iter().any(|o| o.id == overrun) {
        return admin_error(
            StatusCode::NOT_FOUND,
            format!("`overrun`: {overrun} is not a deadline overrun of this run"),
        );
    }
    run.explanations
        .insert(overrun.clone(), (explanation.clone(), actor.clone()));
    let step = run.machine.step;
    let a = run.event(
        &actor,
        step,
        step,
        "overrun_explained",
        &format!("{overrun}: {explanation}"),
        vec![],
    );
    commit(&st, guard, run, &[a]).await
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct CloseForm {
    actor: Option<String>,
    customer_contacted: Option<bool>,
    customer_impact: Option<String>,
    workarounds: Option<String>,
}

async fn close(State(st): State<Arc<AppState>>, Path(id): Path<String>, b: Bytes) -> Response {
    let f: CloseForm = match body(&b) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let [actor] = match fields([("actor", &f.actor, 64)]) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let guard = match open_run(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut run = guard.clone();
    // What the operator wrote is kept even when the run cannot close yet.
    if let Some(c) = f.customer_contacted {
        run.incident.customer_contacted = c;
    }
    if let Some(t) = text_field(&f.customer_impact, 2000) {
        run.incident.customer_impact = Some(t);
    }
    if let Some(t) = text_field(&f.workarounds, 2000) {
        run.incident.workarounds = Some(t);
    }
    let now = clock::now();
    let overruns = overruns(&st, &run).await;
    let checks = match close_checks(&st, &run, &overruns).await {
        Ok((c, _, _)) => c,
        Err(e) => return ledger_down(e),
    };
    let c = match run.machine.close(&checks, &actor, now.0) {
        Ok(c) => c,
        Err(spillway_control::RecoveryError::NotClosable(m)) => {
            if save(&st, &run, &[]).await.is_ok() {
                let mut guard = guard;
                *guard = run.clone();
            }
            return (
                StatusCode::CONFLICT,
                Json(serde_json::json!({"error": format!("the run cannot close yet: {}", m.join("; ")), "missing": m})),
            )
                .into_response();
        }
        Err(e) => return refused(e),
    };
    finish(&st, &mut run, &actor, now).await;
    let mut c = c;
    c.figures = vec![
        ("affected_requests".into(), run.incident.affected_requests as f64),
        ("retries".into(), run.incident.retries as f64),
        ("spend_usd".into(), run.incident.spend_usd),
    ];
    let a = run.record(&actor, &c);
    commit(&st, guard, run, &[a]).await
}

/// The run's end: the incident's figures fixed, the simulator put back (tried a few
/// times: a drill must not leave a channel failing).
async fn finish(st: &AppState, run: &mut Run, actor: &str, now: UnixMs) {
    run.closed_at = Some(now);
    run.incident.closed_at = Some(now);
    run.incident.closed_by = Some(actor.to_owned());
    if let Some(d) = run.drill_state.clone() {
        let mut back = false;
        for _ in 0..3 {
            if restore_sim(st, &d.saved).await {
                back = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if !back {
            st.alert(
                Severity::Critical,
                format!("Drill on {} could not put the simulator back", run.route),
                "a simulated channel may still answer with the drill's fault; restart the gateway to reset the simulator".into(),
                None,
            );
        }
        if let Some(d) = &mut run.drill_state {
            d.lifted = true;
            d.relapse_ends_at = None;
        }
    }
    fill_incident(st, run).await;
}

/// O5: the incident's figures from the ledger: affected requests, first error, retries,
/// spend.
async fn fill_incident(st: &AppState, run: &mut Run) {
    let to = UnixMs(run.until().0 + 1);
    if let Ok(rows) = st
        .ledger
        .store()
        .scorecard(run.incident.started_at, to, Some(&run.route))
        .await
        && let Some(x) = rows.into_iter().find(|x| x.route == run.route)
    {
        run.incident.affected_requests = x.failed + x.unknowns;
        run.incident.retries = x.retries;
        run.incident.spend_usd = x.cost_usd;
    }
    if run.incident.first_error.is_none()
        && let Ok(Some(id)) = st
            .ledger
            .store()
            .first_failure(&run.route, run.incident.started_at, to, false)
            .await
        && let Ok(Some(q)) = st.ledger.store().get_request(&id).await
    {
        run.incident.first_error = Some(FirstError {
            at: q.received_at,
            request_id: q.id.clone(),
            error_class: q.error_class.map(|c| c.as_str().to_owned()),
            message: q.error_message.clone(),
        });
    }
}

async fn cancel(State(st): State<Arc<AppState>>, Path(id): Path<String>, b: Bytes) -> Response {
    let f: ActorForm = match body(&b) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let [actor, reason] = match fields([("actor", &f.actor, 64), ("reason", &f.reason, 500)]) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let guard = match open_run(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut run = guard.clone();
    let c = match run.machine.cancel(&reason) {
        Ok(c) => c,
        Err(e) => return refused(e),
    };
    let now = clock::now();
    finish(&st, &mut run, &actor, now).await;
    let a = run.record(&actor, &c);
    commit(&st, guard, run, &[a]).await
}

async fn relapse(State(st): State<Arc<AppState>>, Path(id): Path<String>, b: Bytes) -> Response {
    let f: ActorForm = match body(&b) {
        Ok(f) => f,
        Err(r) => return r,
    };
    let [actor] = match fields([("actor", &f.actor, 64)]) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let guard = match open_run(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut run = guard.clone();
    let Some(d) = run.drill_state.clone() else {
        return conflict("a relapse is staged only in a drill: this run is a real incident");
    };
    let ms = st.config.recovery.relapse_ms;
    if let Err(e) = stage_on_sim(&st, &d.saved, |b| DrillScenario::ServerErrors.behavior(b)).await {
        return admin_error(
            StatusCode::BAD_GATEWAY,
            format!("the simulator refused the relapse: {e}"),
        );
    }
    let now = clock::now();
    if let Some(d) = &mut run.drill_state {
        d.relapse_ends_at = Some(now.0 + ms as i64);
        // A relapse before the first fault lifted ends both together.
        d.lifted = true;
    }
    let step = run.machine.step;
    let what = format!("the simulator answers 503 on {} for {} s", run.route, ms / 1000);
    let a = run.event(
        &actor,
        step,
        step,
        "drill_relapse_staged",
        &what,
        vec![("relapse_ms".into(), ms as f64)],
    );
    commit(&st, guard, run, &[a]).await
}

// ---------------------------------------------------------------------------------------
// The incident report (O5).

#[derive(Serialize)]
struct Report<'a> {
    run: &'a str,
    drill: Option<DrillScenario>,
    route: &'a str,
    step: RecoveryStep,
    reason: &'a str,
    opened_by: &'a str,
    opened_at: UnixMs,
    incident: &'a IncidentRecord,
    split: &'a Option<LedgerSplit>,
    evidence: &'a Option<EvidenceSummary>,
    rollback: &'a Option<RollbackDone>,
    probes: &'a [ProbeView],
    stops: u32,
    approvals: &'a [Approval],
    stage_scores: &'a [StageScore],
    overruns: Vec<Overrun>,
    events: &'a [RecoveryEvent],
}

async fn report_of(st: &AppState, id: &str) -> Result<(Run, Vec<Overrun>), Response> {
    let cell = st.recoveries.get(id).ok_or_else(|| not_found(id))?;
    let mut run = cell.lock().await.clone();
    if run.closed_at.is_none() {
        fill_incident(st, &mut run).await;
    }
    let o = overruns(st, &run).await;
    Ok((run, o))
}

async fn report_json(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let (run, overruns) = match report_of(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let r = Report {
        run: &run.id,
        drill: run.drill,
        route: &run.route,
        step: run.machine.step,
        reason: &run.reason,
        opened_by: &run.opened_by,
        opened_at: run.opened_at,
        incident: &run.incident,
        split: &run.split,
        evidence: &run.evidence,
        rollback: &run.rollback,
        probes: &run.probes,
        stops: run.machine.stops,
        approvals: &run.machine.approvals,
        stage_scores: &run.stage_scores,
        overruns,
        events: &run.events,
    };
    let bytes = serde_json::to_vec_pretty(&r).unwrap_or_default();
    attachment("application/json", &format!("{id}-incident.json"), Bytes::from(bytes))
}

fn t(at: Option<UnixMs>) -> String {
    at.map_or_else(|| "—".to_owned(), |a| a.to_rfc3339())
}

/// Markdown table cells: a pipe or a line break would end the cell.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}

async fn report_md(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let (run, overruns) = match report_of(&st, &id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let i = &run.incident;
    let mut md = String::new();
    use std::fmt::Write;
    let title = match run.drill {
        Some(d) => format!("DRILL ({}): {}", d.label(), run.route),
        None => format!("Incident: {}", run.route),
    };
    let _ = writeln!(md, "# {title}\n");
    if run.drill.is_some() {
        let _ = writeln!(
            md,
            "> **DRILL.** This incident was staged on simulated channels for practice; no real provider was touched.\n"
        );
    }
    let _ = writeln!(
        md,
        "Recovery run `{}`, {}. Opened by {} at {}: {}\n",
        run.id,
        run.machine.step.as_str(),
        cell(&run.opened_by),
        t(Some(run.opened_at)),
        cell(&run.reason)
    );
    let _ = writeln!(md, "## Timeline\n\n| moment | time |\n|---|---|");
    let _ = writeln!(md, "| start (first error) | {} |", t(Some(i.started_at)));
    let _ = writeln!(md, "| detection (breaker opened) | {} |", t(i.detected_at));
    let _ = writeln!(md, "| stop (isolated) | {} |", t(i.stopped_at));
    let _ = writeln!(md, "| recovery (probes passed) | {} |", t(i.recovered_at));
    for (n, r) in i.resume_times.iter().enumerate() {
        let _ = writeln!(md, "| resume {} | {} |", n + 1, t(Some(*r)));
    }
    let _ = writeln!(md, "| closed | {} |\n", t(i.closed_at));
    let _ = writeln!(md, "## Impact\n");
    let _ = writeln!(md, "- Affected requests: {}", i.affected_requests);
    match &i.first_error {
        Some(e) => {
            let _ = writeln!(
                md,
                "- First error: {} at {}, request `{}`: {}",
                e.error_class.as_deref().unwrap_or("unclassified"),
                t(Some(e.at)),
                e.request_id,
                cell(e.message.as_deref().unwrap_or(""))
            );
        }
        None => {
            let _ = writeln!(md, "- First error: none recorded");
        }
    }
    let _ = writeln!(md, "- Retries: {}", i.retries);
    let _ = writeln!(md, "- Spend, failed attempts included: ${:.4}", i.spend_usd);
    if let Some(s) = &run.split {
        let _ = writeln!(
            md,
            "- At isolation: {} succeeded, {} failed, {} unknown",
            s.succeeded, s.failed, s.unknown
        );
    }
    let _ = writeln!(
        md,
        "- Customer impact: {}",
        cell(i.customer_impact.as_deref().unwrap_or("not recorded"))
    );
    let _ = writeln!(
        md,
        "- Workarounds: {}",
        cell(i.workarounds.as_deref().unwrap_or("not recorded"))
    );
    let _ = writeln!(
        md,
        "- Customer contacted: {}\n",
        if i.customer_contacted { "yes" } else { "no" }
    );
    let _ = writeln!(md, "## Configuration changes\n");
    if i.config_changes.is_empty() {
        let _ = writeln!(md, "None.\n");
    } else {
        let _ = writeln!(
            md,
            "| time | what | by | approver | before | after |\n|---|---|---|---|---|---|"
        );
        for c in &i.config_changes {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} |",
                t(Some(c.at)),
                cell(&c.what),
                cell(&c.actor),
                cell(c.approver.as_deref().unwrap_or("—")),
                cell(c.before.as_deref().unwrap_or("—")),
                cell(c.after.as_deref().unwrap_or("—"))
            );
        }
        let _ = writeln!(md);
    }
    if let Some(e) = &run.evidence {
        let _ = writeln!(
            md,
            "## Evidence\n\n{} requests, {} bytes, SHA-256 `{}`, built by {} at {}.\n",
            e.requests,
            e.bytes,
            e.sha256,
            cell(&e.built_by),
            t(Some(e.built_at))
        );
    }
    if !run.probes.is_empty() {
        let _ = writeln!(
            md,
            "## Last probe round\n\n| # | ok | status | latency ms | request |\n|---|---|---|---|---|"
        );
        for p in &run.probes {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.0} | {} |",
                p.n,
                if p.ok { "yes" } else { "no" },
                p.status.map_or("—".into(), |s| s.to_string()),
                p.latency_ms,
                p.request_id.as_deref().unwrap_or("—")
            );
        }
        let _ = writeln!(md);
    }
    if !run.stage_scores.is_empty() {
        let _ = writeln!(
            md,
            "## Stages\n\n| stage | requests | attempts | success | P95 ms | cost |\n|---|---|---|---|---|---|"
        );
        for s in &run.stage_scores {
            let _ = writeln!(
                md,
                "| {} % | {} | {} | {} | {} | ${:.4} |",
                s.stage_pct,
                s.row.requests,
                s.row.attempts,
                s.row
                    .post_retry_success_rate
                    .map_or("—".into(), |v| format!("{:.1} %", v * 100.0)),
                s.row.p95_ms.map_or("—".into(), |v| format!("{v:.0}")),
                s.row.cost_usd
            );
        }
        let _ = writeln!(md);
    }
    let _ = writeln!(md, "## Stops and approvals\n\n{} stop(s).", run.machine.stops);
    for a in &run.machine.approvals {
        let _ = writeln!(
            md,
            "- {} approved as {} at {}: {}",
            cell(&a.actor),
            a.role.label(),
            t(Some(UnixMs(a.at))),
            cell(&a.reason)
        );
    }
    let _ = writeln!(md);
    if !overruns.is_empty() {
        let _ = writeln!(
            md,
            "## Deadline overruns\n\n| job | deadline | explanation | by |\n|---|---|---|---|"
        );
        for o in &overruns {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} |",
                o.job_id,
                t(Some(o.deadline_at)),
                cell(o.explanation.as_deref().unwrap_or("not explained")),
                cell(o.explained_by.as_deref().unwrap_or("—"))
            );
        }
        let _ = writeln!(md);
    }
    let _ = writeln!(
        md,
        "## Every transition\n\n| time | actor | step | action | reason |\n|---|---|---|---|---|"
    );
    for e in &run.events {
        let _ = writeln!(
            md,
            "| {} | {} | {} → {} | {} | {} |",
            t(Some(e.at)),
            cell(&e.actor),
            e.from.as_str(),
            e.to.as_str(),
            e.action,
            cell(&e.reason)
        );
    }
    attachment(
        "text/markdown; charset=utf-8",
        &format!("{id}-incident.md"),
        Bytes::from(md),
    )
}

#[derive(Deserialize, Default)]
pub struct ScoreQuery {
    pub run: Option<String>,
    pub route: Option<String>,
}

/// The run's incident window for the scorecard: its route, drill flag, start and end.
pub(crate) async fn window_of(
    st: &AppState,
    q: &ScoreQuery,
) -> Result<Option<(String, bool, UnixMs, Option<UnixMs>, String)>, Response> {
    let id = match (&q.run, &q.route) {
        (Some(id), _) => Some(id.clone()),
        (None, Some(route)) => {
            // The route's newest run, if it has one.
            let mut best: Option<(UnixMs, String)> = None;
            for r in st.recoveries.all() {
                let r = r.lock().await;
                if r.route == *route && best.as_ref().is_none_or(|b| r.opened_at > b.0) {
                    best = Some((r.opened_at, r.id.clone()));
                }
            }
            best.map(|b| b.1)
        }
        (None, None) => None,
    };
    let Some(id) = id else {
        return Ok(None);
    };
    let cell = st.recoveries.get(&id).ok_or_else(|| not_found(&id))?;
    let r = cell.lock().await;
    Ok(Some((
        r.route.clone(),
        r.is_drill(),
        r.incident.started_at,
        r.closed_at,
        r.id.clone(),
    )))
}
