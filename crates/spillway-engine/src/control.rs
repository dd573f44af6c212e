//! The control plane in the request path (D4, D5, F4, F5, G1–G4): one breaker, retry
//! budget and set of amplification figures per route (`format/model`), every channel's
//! ejection and share, and the conversations pinned to channels. This module owns what
//! the state machines of `spillway-control` leave to their caller: persisting each
//! transition with its audit entry (in order, durably), restoring them at start-up, and
//! alerting when a breaker opens or a channel is ejected.

use crate::clock;
use crate::state::{AppState, ChannelRt, Severity};
use serde::{Deserialize, Serialize};
pub use spillway_control::Outcome;
use spillway_control::{
    Admission, Amplification, AmplificationView, Breaker, BreakerConfig, BreakerSnapshot, BreakerState, BreakerView,
    OutlierSnapshot, OutlierTransition, RetryBudget, Transition,
};
use spillway_ledger::{AuditEntry, ControlState, Ledger};
use spillway_wire::{ErrorClass, Format, Signal, UnixMs};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use ts_rs::TS;

/// Routes with a breaker of their own; a `*` channel lets clients name any model, so past
/// this many the rest of a format share one.
const MAX_ROUTES: usize = 256;
/// The model part of that shared route.
pub const OTHER_MODELS: &str = "(other models)";
/// A route idle this long may make room for a new one.
const ROUTE_IDLE: Duration = Duration::from_secs(600);
/// Conversations remembered for stickiness; the least recently used go first.
const MAX_PINS: usize = 50_000;
/// F4's window.
const BUDGET_WINDOW: Duration = Duration::from_secs(10);

/// What an attempt's outcome says about the upstream's health.
pub fn outcome_of(signal: &Signal) -> Outcome {
    match signal.class {
        ErrorClass::RateLimit => Outcome::RateLimited,
        ErrorClass::Quota if signal.http_status == Some(429) => Outcome::RateLimited,
        ErrorClass::Overload
        | ErrorClass::ServerError
        | ErrorClass::Transient
        | ErrorClass::Timeout
        | ErrorClass::Unreachable
        | ErrorClass::StreamInterrupted => Outcome::ProviderFailure,
        _ => Outcome::Neutral,
    }
}

struct RouteInner {
    breaker: Breaker,
    budget: RetryBudget,
    amp: Amplification,
    /// When a request last asked for the route: idle closed routes make room for new
    /// ones when the table is full.
    last_used: Instant,
    /// O1: a recovery run's hold on the route, while it has one.
    gate: Option<GateRt>,
    /// Counts the gates the route had, so a slot of an earlier one frees nothing here.
    epochs: u64,
}

/// What a recovery run lets the route do (see `spillway_control::Gate`), and what the
/// request path reports back to it.
struct GateRt {
    run: Arc<str>,
    /// This gate among every gate the route had.
    epoch: u64,
    /// The current share's: O2 judges a stage by the requests it admitted, not by the
    /// stragglers of the stage it stepped back from.
    stage_epoch: u64,
    /// Percent of the route's concurrency; 0 pauses the route.
    share_pct: u8,
    /// Requests admitted at once at that share.
    cap: u32,
    /// Admitted through the gate and not yet ended.
    in_flight: u32,
    jobs_held: bool,
    /// O2: the newest attempt outcomes since the run last looked (wall-clock ms).
    outcomes: std::collections::VecDeque<(Outcome, i64)>,
}

/// Outcomes kept for the run between its looks (every 500 ms): O2 needs the last 20.
const GATE_OUTCOMES: usize = 100;

/// A request let through a recovery run's gate; its end frees the place.
pub struct GateSlot {
    route: Arc<RouteControl>,
    epoch: u64,
    stage_epoch: u64,
}

impl GateSlot {
    /// O2: an attempt of this request ended; it counts while its stage is the gate's.
    pub fn outcome(&self, outcome: Outcome) {
        if outcome == Outcome::Neutral {
            return;
        }
        self.route.with(|i| {
            if let Some(g) = &mut i.gate
                && g.epoch == self.epoch
                && g.stage_epoch == self.stage_epoch
                && g.share_pct > 0
            {
                if g.outcomes.len() >= GATE_OUTCOMES {
                    g.outcomes.pop_front();
                }
                g.outcomes.push_back((outcome, crate::clock::now().0));
            }
        });
    }
}

impl Drop for GateSlot {
    fn drop(&mut self) {
        self.route.with(|i| {
            if let Some(g) = &mut i.gate
                && g.epoch == self.epoch
            {
                g.in_flight = g.in_flight.saturating_sub(1);
            }
        });
    }
}

/// O1: a recovery run's gate, when one holds the route: paused, or a place among the
/// share of its concurrency the run allows, as the gate's `(epoch, stage epoch)` (`None`
/// when no run holds the route).
fn enter_gate(i: &mut RouteInner) -> Result<Option<(u64, u64)>, Held> {
    let Some(g) = &mut i.gate else {
        return Ok(None);
    };
    if g.share_pct == 0 {
        return Err(Held {
            run: g.run.to_string(),
            reason: "the route is isolated while it recovers".into(),
            paused: true,
        });
    }
    if g.in_flight >= g.cap {
        return Err(Held {
            run: g.run.to_string(),
            reason: format!(
                "resuming at {} % of its concurrency: {} of {} in flight",
                g.share_pct, g.in_flight, g.cap
            ),
            paused: false,
        });
    }
    g.in_flight += 1;
    Ok(Some((g.epoch, g.stage_epoch)))
}

/// Why a recovery run's gate refused a request.
#[derive(Debug)]
pub struct Held {
    pub run: String,
    pub reason: String,
    /// Isolated, not merely full: a client should come back much later.
    pub paused: bool,
}

/// One route's breaker, retry budget and figures.
pub struct RouteControl {
    /// `format/model`.
    pub name: String,
    inner: Mutex<RouteInner>,
    /// Its `/metrics` histograms, registered once (N4).
    pub hists: OnceLock<crate::prom::RouteHistograms>,
}

/// A route as the console shows it.
#[derive(Clone, Debug, Serialize, TS)]
pub struct RouteControlView {
    pub route: String,
    pub breaker: BreakerView,
    pub amplification: AmplificationView,
    /// F4: new requests and retries in the budget's window, and the retries it allows.
    pub budget_requests: u64,
    pub budget_retries: u64,
    pub budget_allowed: u64,
    /// G1's cost trigger: why it is dormant, until a budget is configured.
    pub cost_trigger: String,
}

/// A probation probe in flight; dropped without an outcome, it is given back.
pub struct Probe {
    route: Arc<RouteControl>,
    /// The probation it belongs to.
    id: u64,
    done: bool,
}

impl Drop for Probe {
    fn drop(&mut self) {
        if !self.done {
            let id = self.id;
            self.route.with(|i| i.breaker.probe_abandoned(id));
        }
    }
}

/// What ingress does with a request, per its route's recovery gate and breaker. A
/// request let through a recovery run's gate holds its place (`GateSlot`) until it ends.
pub enum Admit {
    Send(Option<GateSlot>),
    Probe(Probe, Option<GateSlot>),
    Refuse {
        retry_after: Duration,
        reason: String,
    },
    /// O1: a recovery run holds the route: isolated, or its share is in use.
    Held(Held),
}

impl RouteControl {
    fn with<R>(&self, f: impl FnOnce(&mut RouteInner) -> R) -> R {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// Saves a transition while the route is still locked, so the ledger keeps them in
    /// the order they happened (the save itself is queued, not awaited).
    fn saved(
        &self,
        st: &AppState,
        i: &RouteInner,
        t: Option<Transition>,
        actor: &str,
        done: Option<oneshot::Sender<spillway_ledger::Result<()>>>,
    ) -> Option<Transition> {
        let t = t?;
        st.control
            .save_breaker(st, &self.name, &t, i.breaker.snapshot(Instant::now()), actor, done);
        Some(t)
    }

    /// O1, G2, G3: whether the request may go out: a recovery run's gate first (it, not
    /// the breaker, decides while it holds the route), then the breaker; one lock for both.
    pub fn admit(self: &Arc<Self>, st: &AppState) -> Admit {
        let now = Instant::now();

        let (a, place, moved) = self.with(|i| {
            i.last_used = now;
            let place = match enter_gate(i) {
                Ok(p) => p,
                Err(h) => return (Err(h), None, None),
            };
            // G1: a cost-opened breaker waits for its last hour to cool before probation.
            if i.breaker.cost_probation_due(now)
                && let Some((hour, budget)) = st.accounts.route_hour(&self.name, crate::clock::now())
                && hour > 0.25 * budget
            {
                i.breaker
                    .postpone_probation(now + Duration::from_secs(60), hour, budget);
            }
            let (a, t) = i.breaker.admit(now);
            if matches!(a, Admission::Refuse { .. }) {
                // Refused after all: the gate's place goes back.
                if place.is_some()
                    && let Some(g) = &mut i.gate
                {
                    g.in_flight = g.in_flight.saturating_sub(1);
                }
            } else {
                i.budget.request(now);
            }
            (Ok(a), place, self.saved(st, i, t, "gateway", None))
        });
        if let Some(t) = moved {
            st.control.announce(st, &self.name, &t);
        }
        let slot = place.map(|(epoch, stage_epoch)| GateSlot {
            route: self.clone(),
            epoch,
            stage_epoch,
        });
        match a {
            Err(held) => Admit::Held(held),
            Ok(Admission::Send) => Admit::Send(slot),
            Ok(Admission::Probe(id)) => Admit::Probe(
                Probe {
                    route: self.clone(),
                    id,
                    done: false,
                },
                slot,
            ),
            Ok(Admission::Refuse { retry_after, reason }) => Admit::Refuse { retry_after, reason },
        }
    }

    /// O1: sets (or lifts, with `None`) a recovery run's hold: `(run, share %, cap, jobs held)`.
    pub fn set_gate(&self, gate: Option<(&str, u8, u32, bool)>) {
        self.with(|i| match gate {
            None => i.gate = None,
            Some((run, share_pct, cap, jobs_held)) => {
                if i.gate.as_ref().is_none_or(|g| *g.run != *run) {
                    i.epochs += 1;
                    i.gate = Some(GateRt {
                        run: Arc::from(run),
                        epoch: i.epochs,
                        stage_epoch: 0,
                        share_pct,
                        cap,
                        in_flight: 0,
                        jobs_held,
                        outcomes: Default::default(),
                    });
                }
                if let Some(g) = &mut i.gate {
                    if g.share_pct != share_pct {
                        g.stage_epoch += 1;
                        g.outcomes.clear();
                    }
                    g.share_pct = share_pct;
                    g.cap = cap;
                    g.jobs_held = jobs_held;
                }
            }
        })
    }

    /// O2: the outcomes the current stage's requests reported since the last look.
    pub fn take_outcomes(&self) -> Vec<(Outcome, i64)> {
        self.with(|i| {
            i.gate
                .as_mut()
                .map(|g| g.outcomes.drain(..).collect())
                .unwrap_or_default()
        })
    }

    /// O1: automatic retries are off while a recovery run holds the route.
    pub fn retries_held(&self) -> bool {
        self.with(|i| i.gate.is_some())
    }

    /// O1: the route's background jobs wait while a recovery run holds it.
    pub fn jobs_held(&self) -> bool {
        self.with(|i| i.gate.as_ref().is_some_and(|g| g.jobs_held))
    }

    /// G1: a request was admitted to a channel after `wait` (or gave up after it).
    pub fn on_wait(&self, st: &AppState, wait: Duration) {
        let now = Instant::now();
        let moved = self.with(|i| {
            let t = i.breaker.on_wait(wait, now);
            self.saved(st, i, t, "gateway", None)
        });
        if let Some(t) = moved {
            st.control.announce(st, &self.name, &t);
        }
    }

    /// An attempt of the route ended; a probe's outcome closes or reopens the breaker.
    pub fn on_attempt(&self, st: &AppState, outcome: Outcome, latency: Duration, probe: Option<&mut Probe>) {
        let now = Instant::now();
        let moved = self.with(|i| {
            let t = match probe {
                Some(p) if !p.done => {
                    p.done = true;
                    // Duplicates come from the idempotency ledger; until it exists no
                    // probe can be known to have run twice.
                    i.breaker.probe_result(p.id, outcome, latency, false, now)
                }
                _ => i.breaker.on_attempt(outcome, latency, now),
            };
            self.saved(st, i, t, "gateway", None)
        });
        if let Some(t) = moved {
            st.control.announce(st, &self.name, &t);
        }
    }

    /// G1's fourth trigger: the route's last hour cost `last_hour_usd` against its
    /// `daily_budget_usd`.
    pub fn on_cost(&self, st: &AppState, last_hour_usd: f64, daily_budget_usd: f64) {
        let now = Instant::now();
        let moved = self.with(|i| {
            let t = i.breaker.on_cost(last_hour_usd, daily_budget_usd, now);
            self.saved(st, i, t, "gateway", None)
        });
        if let Some(t) = moved {
            st.control.announce(st, &self.name, &t);
        }
    }

    /// When an open breaker's next probe is due, if it is open with one due.
    pub fn retry_after(&self) -> Option<Duration> {
        let now = Instant::now();
        // On the request path after every capacity wait: no figures computed here.
        self.with(|i| i.breaker.retry_after(now))
    }

    /// Whether automatic sending may go on (a failed attempt may be followed by another).
    pub fn sending(&self) -> bool {
        self.with(|i| i.breaker.state() == BreakerState::Closed)
    }

    /// F4: takes a retry from the budget; `Err` with when to ask again when none is left.
    pub fn try_retry(&self) -> Result<(), Duration> {
        let now = Instant::now();
        self.with(|i| {
            if i.budget.try_retry(now) {
                Ok(())
            } else {
                Err(i.budget.refill_in(now))
            }
        })
    }

    /// R2: this instance's (new requests, retries) in the budget's window.
    pub fn budget_counts(&self) -> (u64, u64) {
        let now = Instant::now();
        self.with(|i| i.budget.own_counts(now))
    }

    /// R2: the fleet's other instances' (new requests, retries) in their windows.
    pub fn set_budget_others(&self, requests: u64, retries: u64) {
        self.with(|i| i.budget.set_others(requests, retries));
    }

    /// F5: a request of the route ended after `attempts` attempts.
    pub fn finished(&self, attempts: u32, ok: bool) {
        let now = Instant::now();
        self.with(|i| i.amp.finished(attempts, ok, now));
    }

    pub fn view(&self, cost_trigger: &str) -> RouteControlView {
        let now = Instant::now();
        self.with(|i| {
            let (r, t, a) = i.budget.figures(now);
            RouteControlView {
                route: self.name.clone(),
                breaker: i.breaker.view(now),
                amplification: i.amp.view(now),
                budget_requests: r,
                budget_retries: t,
                budget_allowed: a,
                cost_trigger: cost_trigger.to_owned(),
            }
        })
    }

    pub fn state(&self) -> BreakerState {
        self.with(|i| i.breaker.state())
    }

    fn force(
        &self,
        st: &AppState,
        open: bool,
        actor: &str,
        reason: &str,
        done: oneshot::Sender<spillway_ledger::Result<()>>,
    ) -> Option<Transition> {
        let now = Instant::now();
        self.with(|i| {
            let t = if open {
                i.breaker.force_open(reason, now)
            } else {
                i.breaker.force_close(reason, now)
            };
            self.saved(st, i, t, actor, Some(done))
        })
    }
}

/// A breaker or channel state as the ledger keeps it.
#[derive(Serialize, Deserialize)]
struct Saved<T> {
    saved_at: UnixMs,
    #[serde(flatten)]
    state: T,
}

impl<T: Serialize> Saved<T> {
    /// `state` as saved at `at`: the row the ledger keeps and the message the fleet shares.
    fn row(kind: &str, subject: &str, at: UnixMs, state: T) -> Option<ControlState> {
        let state = serde_json::to_string(&Saved { saved_at: at, state }).ok()?;
        Some(ControlState {
            kind: kind.into(),
            subject: subject.to_owned(),
            state,
            updated_at: at,
        })
    }
}

/// One write to the ledger, in the order transitions happened.
struct Persist {
    state: Option<ControlState>,
    audit: AuditEntry,
    done: Option<oneshot::Sender<spillway_ledger::Result<()>>>,
}

/// The persisting task's work: a write, or a flush marker answered once every write
/// queued before it is done.
enum Job {
    Write(Box<Persist>),
    Flush(oneshot::Sender<()>),
}

#[derive(Default)]
struct Pins {
    /// Conversation → (channel, last use tick).
    map: HashMap<u64, (Arc<str>, u64)>,
    tick: u64,
}

/// Every route's control and the conversations' channels.
#[derive(Default)]
pub struct Control {
    /// Per format (its index in `Format::ALL`), by model: found without building the
    /// route's name on every request.
    routes: Mutex<[HashMap<String, Arc<RouteControl>>; 3]>,
    pins: Mutex<Pins>,
    persist: OnceLock<mpsc::UnboundedSender<Job>>,
}

fn format_index(f: Format) -> usize {
    Format::ALL.iter().position(|x| *x == f).unwrap_or(0)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn breaker_config(st: &AppState, route: &str) -> BreakerConfig {
    let c = &st.config.control;
    let cool = Duration::from_millis(c.breaker_cool_down_ms);
    BreakerConfig {
        wait_slo: c.wait_slo_ms(route).map(Duration::from_millis),
        cool_down: cool,
        max_cool_down: cool.saturating_mul(20),
        ..Default::default()
    }
}

fn action(t: &Transition) -> String {
    let s = |b: BreakerState| match b {
        BreakerState::Closed => "closed",
        BreakerState::Open => "open",
        BreakerState::Probation => "probation",
    };
    format!("{}->{}", s(t.from), s(t.to))
}

impl Control {
    /// The route of `model` in `format`, made on first use.
    pub fn route(&self, st: &AppState, format: Format, model: &str) -> Arc<RouteControl> {
        let i = format_index(format);
        let mut routes = lock(&self.routes);
        if let Some(r) = routes[i].get(model) {
            return r.clone();
        }
        let mut total: usize = routes.iter().map(HashMap::len).sum();
        if total >= MAX_ROUTES {
            // Clients name models (a `*` channel serves any): routes nobody used for ten
            // minutes, closed and without figures worth keeping, make room first.
            let now = Instant::now();
            for m in routes.iter_mut() {
                m.retain(|name, r| {
                    name == OTHER_MODELS
                        || r.with(|i| {
                            now.saturating_duration_since(i.last_used) < ROUTE_IDLE
                                || i.breaker.state() != BreakerState::Closed
                                || i.gate.is_some()
                        })
                });
            }
            total = routes.iter().map(HashMap::len).sum();
        }
        let model = if total < MAX_ROUTES { model } else { OTHER_MODELS };
        routes[i]
            .entry(model.to_owned())
            .or_insert_with(|| Arc::new(Self::new_route(st, format!("{format}/{model}"))))
            .clone()
    }

    /// Whether `model` of `format` has (or could get) a breaker of its own rather than the
    /// shared one.
    pub fn has_own_route(&self, format: Format, model: &str) -> bool {
        let routes = lock(&self.routes);
        routes[format_index(format)].contains_key(model) || routes.iter().map(HashMap::len).sum::<usize>() < MAX_ROUTES
    }

    fn new_route(st: &AppState, name: String) -> RouteControl {
        let now = Instant::now();
        let c = &st.config.control;
        RouteControl {
            inner: Mutex::new(RouteInner {
                breaker: Breaker::new(breaker_config(st, &name), now),
                budget: RetryBudget::new(c.retry_budget_ratio, u64::from(c.retry_budget_min), BUDGET_WINDOW, now),
                amp: Amplification::new(now),
                last_used: now,
                gate: None,
                epochs: 0,
            }),
            name,
            hists: OnceLock::new(),
        }
    }

    /// The route named `format/model`, if it has been made.
    pub fn get(&self, route: &str) -> Option<Arc<RouteControl>> {
        let (format, model) = route.split_once('/')?;
        let format = format.parse::<Format>().ok()?;
        lock(&self.routes)[format_index(format)].get(model).cloned()
    }

    /// Every route's view, by name.
    pub fn views(&self, st: &AppState) -> Vec<RouteControlView> {
        let mut routes: Vec<Arc<RouteControl>> = lock(&self.routes).iter().flat_map(|m| m.values().cloned()).collect();
        routes.sort_by(|a, b| a.name.cmp(&b.name));
        let budgets: std::collections::HashMap<String, crate::accounts::RouteBudgetView> = st
            .accounts
            .routes(crate::clock::now())
            .into_iter()
            .map(|b| (b.route.clone(), b))
            .collect();
        routes
            .iter()
            .map(|r| r.view(&cost_trigger(budgets.get(&r.name))))
            .collect()
    }

    /// D4: the channel a conversation was last served by.
    pub fn pinned(&self, conversation: u64) -> Option<Arc<str>> {
        let mut p = lock(&self.pins);
        p.tick += 1;
        let tick = p.tick;
        p.map.get_mut(&conversation).map(|(c, t)| {
            *t = tick;
            c.clone()
        })
    }

    /// D4: `channel` served the conversation; later turns go there while it is in rotation.
    /// Conversation 0 is none (embeddings, token counts, a Responses turn without input).
    pub fn pin(&self, conversation: u64, channel: &ChannelRt) {
        if conversation == 0 {
            return;
        }
        let mut p = lock(&self.pins);
        p.tick += 1;
        let tick = p.tick;
        if let Some((c, t)) = p.map.get_mut(&conversation) {
            *t = tick;
            if **c != *channel.cfg.name {
                *c = channel.name.clone();
            }
            return;
        }
        if p.map.len() >= MAX_PINS {
            // Forget the older half at once: rare, and cheaper than an LRU list per request.
            let mut ticks: Vec<u64> = p.map.values().map(|(_, t)| *t).collect();
            let (_, median, _) = ticks.select_nth_unstable(MAX_PINS / 2);
            let cut = *median;
            p.map.retain(|_, (_, t)| *t > cut);
        }
        p.map.insert(conversation, (channel.name.clone(), tick));
    }

    /// Writes in the order given, on one task, so the latest state is the one kept.
    fn sender(&self, ledger: &Ledger) -> &mpsc::UnboundedSender<Job> {
        self.persist.get_or_init(|| {
            let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
            let ledger = ledger.clone();
            tokio::spawn(async move {
                while let Some(job) = rx.recv().await {
                    let p = match job {
                        Job::Write(p) => *p,
                        Job::Flush(done) => {
                            let _ = done.send(());
                            continue;
                        }
                    };
                    let r = ledger.record_transition(p.state.as_ref(), &p.audit).await;
                    if let Err(e) = &r {
                        tracing::error!(error = %e, subject = %p.audit.subject, "could not record a control transition");
                    }
                    if let Some(done) = p.done {
                        let _ = done.send(r);
                    }
                }
            });
            tx
        })
    }

    fn persist(&self, ledger: &Ledger, p: Persist) {
        if let Err(e) = self.sender(ledger).send(Job::Write(Box::new(p)))
            && let Job::Write(p) = e.0
            && let Some(done) = p.done
        {
            let _ = done.send(Err(spillway_ledger::Error::WriterStopped));
        }
    }

    /// Waits until every transition queued so far is written (a shutdown calls it before
    /// closing the ledger).
    pub async fn flush(&self, ledger: &Ledger) {
        let (tx, rx) = oneshot::channel();
        if self.sender(ledger).send(Job::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// A breaker moved: logged, and alerted when it opens or closes.
    fn announce(&self, st: &AppState, route: &str, t: &Transition) {
        tracing::warn!(route, from = ?t.from, to = ?t.to, trigger = ?t.trigger, "breaker: {}", t.reason);
        match t.to {
            BreakerState::Open if t.from == BreakerState::Closed => st.alert(
                Severity::Critical,
                format!("Breaker open on {route}"),
                format!(
                    "{}. Interactive requests on this route fail fast until probation passes.",
                    t.reason
                ),
                Some(route.to_owned()),
            ),
            BreakerState::Closed => st.alert(
                Severity::Resolved,
                format!("Breaker closed on {route}"),
                t.reason.clone(),
                Some(route.to_owned()),
            ),
            _ => {}
        }
    }

    /// A breaker moved: its state and audit entry are queued for the ledger.
    fn save_breaker(
        &self,
        st: &AppState,
        route: &str,
        t: &Transition,
        snap: BreakerSnapshot,
        actor: &str,
        done: Option<oneshot::Sender<spillway_ledger::Result<()>>>,
    ) {
        let at = clock::now();
        let state = Saved::row("breaker", route, at, snap);
        share(st, state.as_ref());
        let audit = AuditEntry {
            id: 0,
            at,
            kind: "breaker".into(),
            subject: route.to_owned(),
            actor: actor.to_owned(),
            action: action(t),
            trigger: serde_json::to_value(t.trigger)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned)),
            reason: t.reason.clone(),
            figures: serde_json::to_string(&t.figures).ok(),
        };
        self.persist(&st.ledger, Persist { state, audit, done });
    }

    /// R2: every instance's routes.
    pub fn all(&self) -> Vec<Arc<RouteControl>> {
        lock(&self.routes).iter().flat_map(|m| m.values().cloned()).collect()
    }

    /// A channel left or re-entered rotation.
    pub fn channel_moved(&self, st: &AppState, channel: &ChannelRt, t: OutlierTransition, actor: &str) {
        let at = clock::now();
        let name = &channel.cfg.name;
        if t.ejected {
            tracing::warn!(channel = %name, "channel ejected: {}", t.reason);
            st.alert(
                Severity::Warning,
                format!("Channel {name} left rotation"),
                t.reason.clone(),
                Some(name.clone()),
            );
        } else {
            tracing::info!(channel = %name, "channel back: {}", t.reason);
        }
        self.save_channel(
            st,
            channel,
            at,
            actor,
            if t.ejected { "ejected" } else { "back_in_rotation" },
            t.reason,
            None,
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn save_channel(
        &self,
        st: &AppState,
        channel: &ChannelRt,
        at: UnixMs,
        actor: &str,
        action: &str,
        reason: String,
        done: Option<oneshot::Sender<spillway_ledger::Result<()>>>,
    ) {
        let snap = channel.health.outlier_snapshot(Instant::now());
        let state = Saved::row("channel", &channel.cfg.name, at, snap);
        share(st, state.as_ref());
        let audit = AuditEntry {
            id: 0,
            at,
            kind: "channel".into(),
            subject: channel.cfg.name.clone(),
            actor: actor.to_owned(),
            action: action.to_owned(),
            trigger: None,
            reason,
            figures: None,
        };
        self.persist(&st.ledger, Persist { state, audit, done });
    }

    /// An operator restored a channel: on the record before this returns.
    pub async fn channel_restored(
        &self,
        st: &AppState,
        channel: &ChannelRt,
        actor: &str,
        reason: &str,
    ) -> spillway_ledger::Result<()> {
        let (tx, rx) = oneshot::channel();
        self.save_channel(
            st,
            channel,
            clock::now(),
            actor,
            "restored",
            format!("restored by an operator: {reason}"),
            Some(tx),
        );
        rx.await.unwrap_or(Err(spillway_ledger::Error::WriterStopped))
    }

    /// G4: an operator opens (`open`) or closes a breaker, on the record before this
    /// returns. `Ok(false)` when it already was so.
    pub async fn force(
        &self,
        st: &AppState,
        route: &Arc<RouteControl>,
        open: bool,
        actor: &str,
        reason: &str,
    ) -> spillway_ledger::Result<bool> {
        let (tx, rx) = oneshot::channel();
        let Some(t) = route.force(st, open, actor, reason, tx) else {
            return Ok(false);
        };
        self.announce(st, &route.name, &t);
        rx.await.unwrap_or(Err(spillway_ledger::Error::WriterStopped))?;
        Ok(true)
    }

    /// R2: a breaker transition another instance of the fleet published (its saved
    /// snapshot), applied here as the ledger's would be at a restart; not published again.
    pub fn apply_shared(&self, st: &AppState, route: &str, saved: &str, from: &str) {
        let Ok(s) = serde_json::from_str::<Saved<BreakerSnapshot>>(saved) else {
            tracing::warn!(route, from, "unreadable shared breaker state; ignored");
            return;
        };
        let Some((format, model)) = route.split_once('/') else {
            return;
        };
        let Ok(format) = format.parse::<Format>() else { return };
        let rc = self.route(st, format, model);
        let b = Breaker::restore(
            breaker_config(st, &rc.name),
            &s.state,
            Duration::from_millis(clock::now().since(s.saved_at)),
            Instant::now(),
        );
        let (before, after) = (rc.state(), b.state());
        rc.with(|i| i.breaker = b);
        if before != after {
            tracing::warn!(route, from, ?before, ?after, "breaker moved by another instance");
            match after {
                BreakerState::Open => st.alert(
                    Severity::Critical,
                    format!("Breaker open on {route} (opened by instance {from})"),
                    format!(
                        "{}. Shared through Redis: interactive requests on this route fail fast on every instance.",
                        s.state.reason.as_deref().unwrap_or("another instance opened it")
                    ),
                    Some(route.to_owned()),
                ),
                BreakerState::Closed => st.alert(
                    Severity::Resolved,
                    format!("Breaker closed on {route} (closed by instance {from})"),
                    s.state.reason.clone().unwrap_or_default(),
                    Some(route.to_owned()),
                ),
                BreakerState::Probation => {}
            }
        }
    }

    /// R2: a channel's ejection or return another instance published, applied here as
    /// the ledger's would be at a restart.
    pub fn apply_shared_channel(&self, st: &AppState, name: &str, saved: &str, from: &str) {
        let Ok(s) = serde_json::from_str::<Saved<OutlierSnapshot>>(saved) else {
            return;
        };
        let Some(c) = st.channels.iter().find(|c| *c.cfg.name == *name) else {
            return;
        };
        c.health.restore_outlier(
            &s.state,
            Duration::from_millis(clock::now().since(s.saved_at)),
            Instant::now(),
        );
        tracing::info!(channel = name, from, "channel state moved by another instance");
    }

    /// G4, D5: breakers and ejections as the ledger kept them; a restart keeps them.
    pub async fn restore(&self, st: &AppState) -> spillway_ledger::Result<usize> {
        let now = Instant::now();
        let wall = clock::now();
        let mut n = 0;
        for row in st.ledger.control_states().await? {
            let elapsed = |saved: UnixMs| Duration::from_millis(wall.since(saved));
            match row.kind.as_str() {
                "breaker" => {
                    let Ok(s) = serde_json::from_str::<Saved<BreakerSnapshot>>(&row.state) else {
                        tracing::warn!(route = %row.subject, "unreadable saved breaker state; starting closed");
                        continue;
                    };
                    let Some((format, model)) = row.subject.split_once('/') else {
                        continue;
                    };
                    let Ok(format) = format.parse::<Format>() else { continue };
                    let route = self.route(st, format, model);
                    let b = Breaker::restore(breaker_config(st, &route.name), &s.state, elapsed(s.saved_at), now);
                    if b.state() != BreakerState::Closed {
                        tracing::warn!(route = %route.name, "breaker restored {:?}", b.state());
                    }
                    route.with(|i| i.breaker = b);
                    n += 1;
                }
                "channel" => {
                    let Ok(s) = serde_json::from_str::<Saved<OutlierSnapshot>>(&row.state) else {
                        continue;
                    };
                    if let Some(c) = st.channels.iter().find(|c| c.cfg.name == row.subject) {
                        c.health.restore_outlier(&s.state, elapsed(s.saved_at), now);
                        n += 1;
                    }
                }
                _ => {}
            }
        }
        Ok(n)
    }
}

/// R2: a channel's pace, ejection or restore (D6, E2), for the fleet's other instances.
pub fn share_rotation(st: &AppState, channel: &ChannelRt) {
    if st.shared.is_none() {
        return;
    }
    let at = clock::now();
    let state = Saved::row(
        "rotation",
        &channel.cfg.name,
        at,
        channel.health.shared_rotation(Instant::now()),
    );
    share(st, state.as_ref());
}

/// R2: another instance's pace, ejection or restore of a channel, applied here.
pub fn apply_shared_rotation(st: &AppState, name: &str, saved: &str, from: &str) {
    let Ok(s) = serde_json::from_str::<Saved<crate::health::SharedRotation>>(saved) else {
        return;
    };
    let Some(c) = st.channels.iter().find(|c| *c.cfg.name == *name) else {
        return;
    };
    let elapsed = Duration::from_millis(clock::now().since(s.saved_at));
    c.health.apply_shared_rotation(&s.state, from, elapsed, Instant::now());
    tracing::info!(channel = name, from, state = %s.state.state, "channel rotation moved by another instance");
}

/// R2: a breaker's or channel's new state, for the fleet's other instances to apply as it
/// arrives (in the background: a transition must not wait for Redis).
fn share(st: &AppState, state: Option<&ControlState>) {
    if let (Some(sh), Some(c)) = (&st.shared, state) {
        let (sh, c) = (sh.clone(), c.clone());
        tokio::spawn(async move {
            if let Err(e) = sh.publish_state(&c.kind, &c.subject, &c.state).await {
                tracing::warn!(error = %e.0, subject = %c.subject, "transition not shared: Redis is unreachable");
            }
        });
    }
}

/// G1's cost trigger as the console states it: the figures, or why it is dormant.
fn cost_trigger(b: Option<&crate::accounts::RouteBudgetView>) -> String {
    match b.and_then(|b| b.daily_budget_usd.map(|d| (b, d))) {
        Some((b, d)) => format!(
            "last hour ${:.2} of a ${d:.2} daily budget; opens above ${:.2} (25 %)",
            b.last_hour_usd,
            d * 0.25
        ),
        None => "dormant: no daily budget for this route (budgets.routes in the config)".to_owned(),
    }
}

/// Records what time alone changes: channels whose cool-down ended come back (D5), on the
/// record like any other transition; and folds `/metrics`' raw histogram samples. Once a
/// second; stops with the gateway.
pub fn tick(st: &Arc<AppState>) {
    let weak = Arc::downgrade(st);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            every.tick().await;
            let Some(st) = weak.upgrade() else { return };
            if st.shutdown.cancel.is_cancelled() {
                return;
            }
            let now = Instant::now();
            for c in &st.channels {
                if let Some(t) = c.health.advance(now) {
                    st.control.channel_moved(&st, c, t, "gateway");
                }
            }
            st.prom.upkeep();
        }
    });
}
