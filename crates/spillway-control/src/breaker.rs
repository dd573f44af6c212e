//! A route's circuit breaker (G1–G4). Closed, it watches every attempt and every capacity
//! wait of its route; any G1 trigger opens it. Open, nothing is sent: interactive requests
//! are refused at once with the time of the next probe. It never closes by time alone
//! (G3): after a cool-down, probation lets five requests through one at a time, and only
//! five successes within 1.5 × the route's normal latency and without a duplicate close
//! it; anything else opens it again with a doubled cool-down. An operator may open or
//! close it by hand.

use crate::Outcome;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;
use ts_rs::TS;

/// The G1 thresholds and G3's probation, with the spec's values as defaults.
#[derive(Clone, Debug)]
pub struct BreakerConfig {
    /// G1: attempts looked at, and how many provider failures among them open.
    pub window: usize,
    pub failures_to_open: usize,
    /// G1: an unbroken run of 429s this long opens.
    pub rate_limit_run: Duration,
    /// G1: the route's wait SLO; the P95 capacity wait above `wait_slo_share` of it opens.
    /// None: the route has no SLO and the trigger is off.
    pub wait_slo: Option<Duration>,
    pub wait_slo_share: f64,
    /// The P95 wait is taken over the waits of this long, once there are this many.
    pub wait_window: Duration,
    pub wait_min_samples: usize,
    /// G3: probes sent one at a time, and their P95 bound against the normal latency.
    pub probes: u32,
    pub probe_p95_factor: f64,
    /// Time open before probation; doubled by each failed probation, up to the maximum.
    pub cool_down: Duration,
    pub max_cool_down: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            window: 50,
            failures_to_open: 25,
            rate_limit_run: Duration::from_secs(180),
            wait_slo: None,
            wait_slo_share: 0.8,
            wait_window: Duration::from_secs(60),
            wait_min_samples: 20,
            probes: 5,
            probe_p95_factor: 1.5,
            cool_down: Duration::from_secs(30),
            max_cool_down: Duration::from_secs(600),
        }
    }
}

/// Where a breaker stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// Requests are sent; every attempt feeds the G1 triggers.
    Closed,
    /// Nothing is sent; interactive requests fail fast with the time of the next probe.
    Open,
    /// Probes go out one at a time; all must pass for the breaker to close.
    Probation,
}

/// Why a breaker moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// G1: at least 25 of the last 50 attempts were provider failures.
    ServerErrors,
    /// G1: 429s for 3 minutes in a row.
    RateLimited,
    /// G1: the P95 capacity wait passed 80 % of the route's SLO.
    SlowWait,
    /// G1: the last hour's estimated cost passed 25 % of the daily budget.
    Cost,
    /// The cool-down ended: probation begins.
    CoolDownOver,
    /// G3: a probe failed.
    ProbeFailed,
    /// G3: the probes succeeded, but their P95 was above 1.5 × the route's normal latency.
    ProbeSlow,
    /// G3: a probe's side effect happened twice.
    ProbeDuplicate,
    /// G3: every probe passed.
    ProbationPassed,
    /// An operator opened or closed it.
    Operator,
}

/// A named figure behind a transition (G4: "trigger figures").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, TS)]
pub struct Figure {
    pub name: String,
    pub value: f64,
}

fn fig(name: &str, value: f64) -> Figure {
    Figure {
        name: name.to_owned(),
        value,
    }
}

/// A move from one state to another, for the audit log, the console and alerts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, TS)]
pub struct Transition {
    pub from: BreakerState,
    pub to: BreakerState,
    pub trigger: Trigger,
    /// In words, with the figures.
    pub reason: String,
    pub figures: Vec<Figure>,
}

/// What a request may do on this route now.
#[derive(Clone, Debug, PartialEq)]
pub enum Admission {
    /// Send it as usual.
    Send,
    /// Send it as a probation probe: one attempt, and its outcome goes to
    /// [`Breaker::probe_result`] (or [`Breaker::probe_abandoned`]) with this probation's
    /// number, so a probe that outlived its probation cannot count in the next.
    Probe(u64),
    /// Send nothing; the client may try again after `retry_after`.
    Refuse { retry_after: Duration, reason: String },
}

#[derive(Clone, Debug)]
enum State {
    Closed,
    /// `probe_at` is None when an operator opened it: only an operator closes it.
    Open {
        probe_at: Option<Instant>,
        trigger: Trigger,
        reason: String,
    },
    Probation {
        /// Which probation this is (probes carry it back).
        id: u64,
        sent: u32,
        passed: u32,
        in_flight: bool,
        latencies: Vec<Duration>,
    },
}

/// Successful attempts kept for the route's normal latency.
const NORMAL_SAMPLES: usize = 200;

/// The part of a breaker that survives a restart.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BreakerSnapshot {
    pub state: BreakerState,
    pub trigger: Option<Trigger>,
    pub reason: Option<String>,
    /// Milliseconds from the snapshot to the next probe; None when only an operator can
    /// close it (or when closed).
    pub probe_in_ms: Option<u64>,
    pub reopened: u32,
    pub normal_ms: Option<f64>,
}

/// What the console shows of a breaker.
#[derive(Clone, Debug, Serialize, TS)]
pub struct BreakerView {
    pub state: BreakerState,
    pub trigger: Option<Trigger>,
    pub reason: Option<String>,
    pub in_state_ms: u64,
    /// When open: milliseconds until probation; absent when an operator must close it.
    pub probe_in_ms: Option<u64>,
    pub probes_passed: u32,
    pub probes_sent: u32,
    pub probes_needed: u32,
    pub probe_in_flight: bool,
    /// G1 figures while closed.
    pub recent_failures: u32,
    pub recent_attempts: u32,
    pub failures_to_open: u32,
    pub rate_limited_for_ms: Option<u64>,
    pub rate_limit_run_ms: u64,
    pub wait_p95_ms: Option<f64>,
    pub wait_slo_ms: Option<u64>,
    pub normal_latency_ms: Option<f64>,
    /// Failed probations since it last closed (each doubles the cool-down).
    pub reopened: u32,
}

/// One route's breaker.
#[derive(Debug)]
pub struct Breaker {
    cfg: BreakerConfig,
    state: State,
    since: Instant,
    /// The last `window` attempts while closed: true for a provider failure.
    recent: VecDeque<bool>,
    failures: usize,
    run_429_since: Option<Instant>,
    waits: VecDeque<(Instant, Duration)>,
    /// The normal latency a restart brought back, until new answers give one.
    normal_ms: Option<f64>,
    recent_ok: VecDeque<Duration>,
    reopened: u32,
    probations: u64,
}

/// The nearest-rank P95 of `v` (sorted in place).
fn p95(v: &mut [Duration]) -> Option<Duration> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let rank = ((v.len() as f64) * 0.95).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 60.0 && d.as_secs().is_multiple_of(60) {
        format!("{} min", d.as_secs() / 60)
    } else if s >= 1.0 {
        format!("{s:.0} s")
    } else {
        format!("{:.0} ms", ms(d))
    }
}

impl Breaker {
    pub fn new(cfg: BreakerConfig, now: Instant) -> Breaker {
        Breaker {
            cfg,
            state: State::Closed,
            since: now,
            recent: VecDeque::new(),
            failures: 0,
            run_429_since: None,
            waits: VecDeque::new(),
            normal_ms: None,
            recent_ok: VecDeque::new(),
            reopened: 0,
            probations: 0,
        }
    }

    /// The route's normal latency (ms): the P95 of its last successful attempts while
    /// closed (a P95 against a P95: one long answer among five probes is normal for LLMs),
    /// unchanged while it is open. Computed when asked (probation's end, the console), not
    /// on every answer.
    fn normal(&self) -> Option<f64> {
        if self.recent_ok.is_empty() {
            return self.normal_ms;
        }
        let mut v: Vec<Duration> = self.recent_ok.iter().copied().collect();
        p95(&mut v).map(ms)
    }

    pub fn config(&self) -> &BreakerConfig {
        &self.cfg
    }

    /// The SLO may change with the config; the breaker keeps its state.
    pub fn set_wait_slo(&mut self, slo: Option<Duration>) {
        self.cfg.wait_slo = slo;
    }

    pub fn state(&self) -> BreakerState {
        match self.state {
            State::Closed => BreakerState::Closed,
            State::Open { .. } => BreakerState::Open,
            State::Probation { .. } => BreakerState::Probation,
        }
    }

    fn cool_down(&self) -> Duration {
        let f = 1u32.checked_shl(self.reopened.min(16)).unwrap_or(u32::MAX);
        self.cfg.cool_down.saturating_mul(f).min(self.cfg.max_cool_down)
    }

    fn clear_windows(&mut self) {
        self.recent.clear();
        self.failures = 0;
        self.run_429_since = None;
        self.waits.clear();
    }

    fn go(&mut self, to: State, trigger: Trigger, reason: String, figures: Vec<Figure>, now: Instant) -> Transition {
        let from = self.state();
        self.state = to;
        self.since = now;
        Transition {
            from,
            to: self.state(),
            trigger,
            reason,
            figures,
        }
    }

    fn open(&mut self, trigger: Trigger, reason: String, mut figures: Vec<Figure>, now: Instant) -> Transition {
        self.clear_windows();
        let cool = self.cool_down();
        figures.push(fig("cool_down_s", cool.as_secs_f64()));
        self.go(
            State::Open {
                probe_at: Some(now + cool),
                trigger,
                reason: reason.clone(),
            },
            trigger,
            reason,
            figures,
            now,
        )
    }

    /// G2, G3: whether a request may go out now. The transition is the cool-down ending.
    pub fn admit(&mut self, now: Instant) -> (Admission, Option<Transition>) {
        let mut moved = None;
        if let State::Open { probe_at: Some(at), .. } = self.state
            && now >= at
        {
            let reason = format!(
                "cool-down over: probation sends {} probes one at a time",
                self.cfg.probes
            );
            self.probations += 1;
            moved = Some(self.go(
                State::Probation {
                    id: self.probations,
                    sent: 0,
                    passed: 0,
                    in_flight: false,
                    latencies: Vec::new(),
                },
                Trigger::CoolDownOver,
                reason,
                Vec::new(),
                now,
            ));
        }
        let probes = self.cfg.probes;
        let retry = self.retry_after(now).unwrap_or_default();
        let a = match &mut self.state {
            State::Closed => Admission::Send,
            State::Open { reason, trigger, .. } => Admission::Refuse {
                retry_after: retry,
                // An operator's own words are for operators (the audit log, the console),
                // not for every API client.
                reason: if *trigger == Trigger::Operator {
                    "opened by an operator".to_owned()
                } else {
                    reason.clone()
                },
            },
            State::Probation {
                id, sent, in_flight, ..
            } if !*in_flight && *sent < probes => {
                *in_flight = true;
                *sent += 1;
                Admission::Probe(*id)
            }
            State::Probation { sent, .. } => Admission::Refuse {
                retry_after: Duration::from_secs(1),
                reason: format!("on probation: probe {sent} of {probes} is running, one at a time"),
            },
        };
        (a, moved)
    }

    /// An attempt on the route ended (closed state; probes report through
    /// [`Breaker::probe_result`]). `latency` is the attempt's time to its answer.
    pub fn on_attempt(&mut self, outcome: Outcome, latency: Duration, now: Instant) -> Option<Transition> {
        if !matches!(self.state, State::Closed) {
            return None;
        }
        let failed = outcome == Outcome::ProviderFailure;
        self.recent.push_back(failed);
        self.failures += usize::from(failed);
        while self.recent.len() > self.cfg.window {
            if self.recent.pop_front() == Some(true) {
                self.failures -= 1;
            }
        }
        match outcome {
            Outcome::RateLimited => {
                let since = *self.run_429_since.get_or_insert(now);
                let run = now.saturating_duration_since(since);
                if run >= self.cfg.rate_limit_run {
                    let reason = format!("every attempt for {} was answered 429", secs(run));
                    return Some(self.open(
                        Trigger::RateLimited,
                        reason,
                        vec![fig("rate_limited_for_s", run.as_secs_f64())],
                        now,
                    ));
                }
            }
            Outcome::Success => {
                // Only an answer ends a run of 429s: 5xx mixed in (an incident answering
                // 429 and 529 by turns) must not hide it.
                self.run_429_since = None;
                self.recent_ok.push_back(latency);
                if self.recent_ok.len() > NORMAL_SAMPLES {
                    self.recent_ok.pop_front();
                }
            }
            _ => {}
        }
        if self.failures >= self.cfg.failures_to_open {
            let (f, n) = (self.failures, self.recent.len());
            let reason = format!(
                "{f} of the last {n} attempts failed (5xx, timeout, unreachable, or no channel left in rotation)"
            );
            return Some(self.open(
                Trigger::ServerErrors,
                reason,
                vec![fig("failed_attempts", f as f64), fig("attempts", n as f64)],
                now,
            ));
        }
        None
    }

    fn wait_p95(&mut self, now: Instant) -> Option<Duration> {
        while self
            .waits
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > self.cfg.wait_window)
        {
            self.waits.pop_front();
        }
        if self.waits.len() < self.cfg.wait_min_samples {
            return None;
        }
        let mut v: Vec<Duration> = self.waits.iter().map(|(_, w)| *w).collect();
        p95(&mut v)
    }

    /// A request of the route was admitted after waiting `wait` for capacity (zero when it
    /// did not wait).
    pub fn on_wait(&mut self, wait: Duration, now: Instant) -> Option<Transition> {
        if !matches!(self.state, State::Closed) {
            return None;
        }
        self.waits.push_back((now, wait));
        // Bounded whatever the rate: the newest waits are the ones that matter.
        while self.waits.len() > 4096 {
            self.waits.pop_front();
        }
        let slo = self.cfg.wait_slo?;
        let p = self.wait_p95(now)?;
        let limit = slo.mul_f64(self.cfg.wait_slo_share);
        if p > limit {
            let reason = format!(
                "P95 capacity wait {:.0} ms is above {:.0} % of the route's {} ms SLO",
                ms(p),
                self.cfg.wait_slo_share * 100.0,
                slo.as_millis()
            );
            return Some(self.open(
                Trigger::SlowWait,
                reason,
                vec![fig("wait_p95_ms", ms(p)), fig("wait_slo_ms", ms(slo))],
                now,
            ));
        }
        None
    }

    /// Whether the breaker was opened by its cost trigger and its probation is due: the
    /// caller then checks whether the last hour still costs too much (see
    /// [`Breaker::postpone_probation`]).
    pub fn cost_probation_due(&self, now: Instant) -> bool {
        matches!(self.state, State::Open { probe_at: Some(at), trigger: Trigger::Cost, .. } if now >= at)
    }

    /// G1, G3: a breaker opened for cost stays open while the last hour still costs more
    /// than a quarter of the daily budget: probes would pass (the provider is fine) and the
    /// next request would open it again, an alert and five probes each time. Probation is
    /// asked again at `until`.
    pub fn postpone_probation(&mut self, until: Instant, last_hour_usd: f64, daily_budget_usd: f64) {
        if let State::Open { probe_at, reason, .. } = &mut self.state {
            *probe_at = Some(until);
            *reason = format!(
                "the last hour still cost ${last_hour_usd:.2}, above 25 % of the ${daily_budget_usd:.2} daily budget"
            );
        }
    }

    /// G1's cost trigger: the last hour's estimated cost against the daily budget.
    pub fn on_cost(&mut self, last_hour_usd: f64, daily_budget_usd: f64, now: Instant) -> Option<Transition> {
        if !matches!(self.state, State::Closed) || daily_budget_usd <= 0.0 {
            return None;
        }
        if last_hour_usd > 0.25 * daily_budget_usd {
            let reason = format!(
                "the last hour cost ${last_hour_usd:.2}, above 25 % of the ${daily_budget_usd:.2} daily budget"
            );
            return Some(self.open(
                Trigger::Cost,
                reason,
                vec![
                    fig("last_hour_usd", last_hour_usd),
                    fig("daily_budget_usd", daily_budget_usd),
                ],
                now,
            ));
        }
        None
    }

    fn fail_probation(&mut self, trigger: Trigger, reason: String, figures: Vec<Figure>, now: Instant) -> Transition {
        self.reopened = self.reopened.saturating_add(1);
        self.open(trigger, reason, figures, now)
    }

    /// G3: a probe's outcome. `duplicate` says its side effect was found to have happened
    /// twice (the idempotency ledger's word).
    pub fn probe_result(
        &mut self,
        probation: u64,
        outcome: Outcome,
        latency: Duration,
        duplicate: bool,
        now: Instant,
    ) -> Option<Transition> {
        let probes = self.cfg.probes;
        let State::Probation {
            id,
            sent,
            passed,
            in_flight,
            latencies,
        } = &mut self.state
        else {
            return None;
        };
        if *id != probation {
            return None;
        }
        *in_flight = false;
        let n = *sent;
        if duplicate {
            return Some(self.fail_probation(
                Trigger::ProbeDuplicate,
                format!("probe {n} of {probes} ran its side effect twice"),
                vec![fig("duplicates", 1.0)],
                now,
            ));
        }
        match outcome {
            Outcome::Success => {
                *passed += 1;
                latencies.push(latency);
                if *passed < probes {
                    return None;
                }
                let mut l = std::mem::take(latencies);
                let p = p95(&mut l).unwrap_or_default();
                if let Some(normal) = self.normal()
                    && ms(p) > normal * self.cfg.probe_p95_factor
                {
                    let reason = format!(
                        "all {probes} probes succeeded, but their P95 of {:.0} ms is above {} × the normal {normal:.0} ms",
                        ms(p),
                        self.cfg.probe_p95_factor
                    );
                    return Some(self.fail_probation(
                        Trigger::ProbeSlow,
                        reason,
                        vec![fig("probe_p95_ms", ms(p)), fig("normal_ms", normal)],
                        now,
                    ));
                }
                self.reopened = 0;
                self.clear_windows();
                let reason = format!("all {probes} probes succeeded, P95 {:.0} ms, no duplicate", ms(p));
                Some(self.go(
                    State::Closed,
                    Trigger::ProbationPassed,
                    reason,
                    vec![fig("probe_p95_ms", ms(p))],
                    now,
                ))
            }
            Outcome::ProviderFailure | Outcome::RateLimited => {
                let what = if outcome == Outcome::RateLimited {
                    "was answered 429"
                } else {
                    "failed (5xx, timeout or unreachable)"
                };
                Some(self.fail_probation(
                    Trigger::ProbeFailed,
                    format!("probe {n} of {probes} {what}"),
                    vec![fig("probe", f64::from(n))],
                    now,
                ))
            }
            // The client's own error says nothing about the upstream: the probe is given back.
            Outcome::Neutral => {
                *sent = sent.saturating_sub(1);
                None
            }
        }
    }

    /// A probe ended without an outcome (the client left first): its place is given back.
    pub fn probe_abandoned(&mut self, probation: u64) {
        if let State::Probation {
            id, sent, in_flight, ..
        } = &mut self.state
            && *in_flight
            && *id == probation
        {
            *in_flight = false;
            *sent = sent.saturating_sub(1);
        }
    }

    /// An operator opens it: it stays open until an operator closes it.
    pub fn force_open(&mut self, reason: &str, now: Instant) -> Option<Transition> {
        if matches!(self.state, State::Open { probe_at: None, .. }) {
            return None;
        }
        self.clear_windows();
        let reason = format!("opened by an operator: {reason}");
        Some(self.go(
            State::Open {
                probe_at: None,
                trigger: Trigger::Operator,
                reason: reason.clone(),
            },
            Trigger::Operator,
            reason,
            Vec::new(),
            now,
        ))
    }

    /// An operator closes it, skipping probation: their call, on the record.
    pub fn force_close(&mut self, reason: &str, now: Instant) -> Option<Transition> {
        if matches!(self.state, State::Closed) {
            return None;
        }
        self.reopened = 0;
        self.clear_windows();
        Some(self.go(
            State::Closed,
            Trigger::Operator,
            format!("closed by an operator: {reason}"),
            Vec::new(),
            now,
        ))
    }

    /// An open breaker's trigger, reason and milliseconds to its first probe (none when
    /// only an operator closes it).
    fn open_fields(&self, now: Instant) -> Option<(Trigger, String, Option<u64>)> {
        match &self.state {
            State::Open {
                probe_at,
                trigger,
                reason,
            } => Some((
                *trigger,
                reason.clone(),
                probe_at.map(|at| at.saturating_duration_since(now).as_millis() as u64),
            )),
            _ => None,
        }
    }

    /// When a client may ask again: None while closed; cheap, for the request path.
    pub fn retry_after(&self, now: Instant) -> Option<Duration> {
        match &self.state {
            State::Closed => None,
            // An operator's breaker has no time; a minute is an honest guess.
            State::Open { probe_at, .. } => {
                Some(probe_at.map_or(Duration::from_secs(60), |at| at.saturating_duration_since(now)))
            }
            State::Probation { .. } => Some(Duration::from_secs(1)),
        }
    }

    pub fn snapshot(&self, now: Instant) -> BreakerSnapshot {
        let (trigger, reason, probe_in) = match (&self.state, self.open_fields(now)) {
            (_, Some((t, r, p))) => (Some(t), Some(r), p),
            // A probation cut by a restart starts again from its first probe.
            (State::Probation { .. }, _) => (Some(Trigger::CoolDownOver), None, Some(0)),
            _ => (None, None, None),
        };
        BreakerSnapshot {
            state: self.state(),
            trigger,
            reason,
            probe_in_ms: probe_in,
            reopened: self.reopened,
            normal_ms: self.normal(),
        }
    }

    /// A breaker as a snapshot left it, `elapsed` after it was taken. An open or probing
    /// breaker comes back open (probation restarts from its first probe): a restart never
    /// closes a breaker.
    pub fn restore(cfg: BreakerConfig, s: &BreakerSnapshot, elapsed: Duration, now: Instant) -> Breaker {
        let mut b = Breaker::new(cfg, now);
        b.reopened = s.reopened;
        b.normal_ms = s.normal_ms;
        if s.state != BreakerState::Closed {
            let probe_at = match (s.state, s.probe_in_ms) {
                (BreakerState::Probation, _) => Some(now),
                (_, Some(ms)) => Some(now + Duration::from_millis(ms).saturating_sub(elapsed)),
                (_, None) => None,
            };
            b.state = State::Open {
                probe_at,
                trigger: s.trigger.unwrap_or(Trigger::Operator),
                reason: s
                    .reason
                    .clone()
                    .unwrap_or_else(|| "probation was cut by a restart".to_owned()),
            };
        }
        b
    }

    pub fn view(&mut self, now: Instant) -> BreakerView {
        let wait_p95 = self.wait_p95(now).map(ms);
        let open = self.open_fields(now);
        let (trigger, reason, probe_in, passed, sent, in_flight) = match &self.state {
            State::Closed => (None, None, None, 0, 0, false),
            State::Open { .. } => {
                let (t, r, p) = open.expect("open");
                (Some(t), Some(r), p, 0, 0, false)
            }
            State::Probation {
                sent,
                passed,
                in_flight,
                ..
            } => (
                Some(Trigger::CoolDownOver),
                Some(format!("on probation: {passed} of {} probes passed", self.cfg.probes)),
                None,
                *passed,
                *sent,
                *in_flight,
            ),
        };
        BreakerView {
            state: self.state(),
            trigger,
            reason,
            in_state_ms: now.saturating_duration_since(self.since).as_millis() as u64,
            probe_in_ms: probe_in,
            probes_passed: passed,
            probes_sent: sent,
            probes_needed: self.cfg.probes,
            probe_in_flight: in_flight,
            recent_failures: self.failures as u32,
            recent_attempts: self.recent.len() as u32,
            failures_to_open: self.cfg.failures_to_open as u32,
            rate_limited_for_ms: self
                .run_429_since
                .map(|s| now.saturating_duration_since(s).as_millis() as u64),
            rate_limit_run_ms: self.cfg.rate_limit_run.as_millis() as u64,
            wait_p95_ms: wait_p95,
            wait_slo_ms: self.cfg.wait_slo.map(|d| d.as_millis() as u64),
            normal_latency_ms: self.normal(),
            reopened: self.reopened,
        }
    }
}
