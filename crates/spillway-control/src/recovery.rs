//! A guided recovery run (O1–O4) as a state machine: the checklist's order, the probes'
//! verdict, the staged resume with its automatic step-back (O2), the two-approval gate
//! after a second stop (O3) and the closing conditions (O4).
//!
//! Unlike the breaker, a run lasts long (three 15-minute stages, then a drain) and must
//! survive a restart, so its times are wall-clock milliseconds passed in by the caller and
//! the whole machine serialises. It decides nothing about I/O: the engine applies what
//! [`Recovery::gate`] says to the route, sends the probes, measures the backlog and
//! records every [`Change`] it is handed in the audit.

use crate::Outcome;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use ts_rs::TS;

/// Where a run is in its checklist.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryStep {
    /// Opened; nothing done to the route yet. Isolating turns automatic retries off,
    /// pauses the route's queue and splits its ledger.
    Isolate,
    /// Isolated: the evidence bundle is to be built before anything changes.
    Preserve,
    /// Evidence kept: the policy goes back to its last known good, or the operator says
    /// why nothing needs to.
    RollBack,
    /// Side-effect-free probes, one at a time, until a round passes.
    Confirm,
    /// Traffic comes back in stages (25, 50, 100 % of the route's concurrency), stepping
    /// back one stage at once on O2's triggers.
    Resume,
    /// Full concurrency, retries on: the held jobs drain in deadline order and unknowns
    /// are reconciled.
    Drain,
    /// Backlog and unknowns are 0: the operator closes once O4's conditions hold.
    Close,
    /// Done.
    Closed,
    /// Stopped by an operator before the end; the record is kept.
    Cancelled,
}

impl RecoveryStep {
    /// The checklist an operator walks, in order.
    pub const CHECKLIST: [RecoveryStep; 7] = [
        RecoveryStep::Isolate,
        RecoveryStep::Preserve,
        RecoveryStep::RollBack,
        RecoveryStep::Confirm,
        RecoveryStep::Resume,
        RecoveryStep::Drain,
        RecoveryStep::Close,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryStep::Isolate => "isolate",
            RecoveryStep::Preserve => "preserve",
            RecoveryStep::RollBack => "roll_back",
            RecoveryStep::Confirm => "confirm",
            RecoveryStep::Resume => "resume",
            RecoveryStep::Drain => "drain",
            RecoveryStep::Close => "close",
            RecoveryStep::Closed => "closed",
            RecoveryStep::Cancelled => "cancelled",
        }
    }

    pub fn is_open(self) -> bool {
        !matches!(self, RecoveryStep::Closed | RecoveryStep::Cancelled)
    }

    fn index(self) -> usize {
        RecoveryStep::CHECKLIST.iter().position(|s| *s == self).unwrap_or(7)
    }
}

/// O3: the two people who together may let a twice-stopped run go on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalRole {
    PlatformOperations,
    BusinessOwner,
}

impl ApprovalRole {
    /// In an operator's words.
    pub fn label(self) -> &'static str {
        match self {
            ApprovalRole::PlatformOperations => "platform operations",
            ApprovalRole::BusinessOwner => "business owner",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, TS)]
pub struct Approval {
    pub actor: String,
    pub role: ApprovalRole,
    pub reason: String,
    #[ts(type = "number")]
    pub at: i64,
}

/// The thresholds of one run (a drill shortens the stages).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecoveryConfig {
    /// Share of the route's concurrency at each resume stage, in percent.
    pub stages: Vec<u8>,
    /// How long each stage runs before the next.
    pub stage_ms: i64,
    /// O1: probes in a round, each to succeed.
    pub probes: u32,
    /// O1: a round's P95 may be at most this many times the route's normal latency.
    pub p95_factor: f64,
    /// O2: the outcomes looked at, and how many of them 5xx step back.
    pub window: usize,
    pub server_errors: usize,
    /// O2: 429s without a success in between for this long step back.
    pub rate_limited_ms: i64,
}

impl Default for RecoveryConfig {
    fn default() -> RecoveryConfig {
        RecoveryConfig {
            stages: vec![25, 50, 100],
            stage_ms: 15 * 60_000,
            probes: 5,
            p95_factor: 1.5,
            window: 20,
            server_errors: 5,
            rate_limited_ms: 120_000,
        }
    }
}

/// One probe's result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProbeResult {
    pub ok: bool,
    pub latency_ms: f64,
    pub duplicate: bool,
}

/// What a transition did, for the audit: `from`/`to` are the steps, `action` names the
/// move (`isolated`, `stepped_back`, `stage_advanced`, ...).
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    pub from: RecoveryStep,
    pub to: RecoveryStep,
    pub action: &'static str,
    pub reason: String,
    pub figures: Vec<(String, f64)>,
}

/// What the route may do right now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gate {
    /// Percent of the route's concurrency new requests may use: 0 pauses it.
    pub share_pct: u8,
    /// Whether the route's background jobs stay held.
    pub jobs_held: bool,
}

/// What O4 still checks at closing, measured by the caller.
#[derive(Clone, Debug, Default)]
pub struct CloseChecks {
    pub backlog: u64,
    pub unknowns: u64,
    pub unexplained_overruns: u64,
    pub customer_contacted: bool,
}

impl CloseChecks {
    /// The unmet conditions, in words; empty when the run may close.
    pub fn missing(&self) -> Vec<String> {
        let mut m = Vec::new();
        if self.backlog > 0 {
            m.push(format!("backlog is {} (must be 0)", self.backlog));
        }
        if self.unknowns > 0 {
            m.push(format!("{} unknown outcome(s) not reconciled", self.unknowns));
        }
        if self.unexplained_overruns > 0 {
            m.push(format!(
                "{} deadline overrun(s) without an explanation",
                self.unexplained_overruns
            ));
        }
        if !self.customer_contacted {
            m.push("customer contact not ticked".to_owned());
        }
        m
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecoveryError {
    /// The action belongs to another step.
    WrongStep {
        wanted: RecoveryStep,
        now: RecoveryStep,
    },
    /// O3: the run waits for two approvals.
    Held,
    NotHeld,
    /// O3: an approval by someone who already approved, or for a role already given.
    SameApprover(String),
    RoleGiven(ApprovalRole),
    /// O4's unmet conditions.
    NotClosable(Vec<String>),
    Ended(RecoveryStep),
}

impl std::fmt::Display for RecoveryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecoveryError::WrongStep { wanted, now } => write!(
                f,
                "the run is at `{}`, not `{}`",
                now.as_str(),
                wanted.as_str()
            ),
            RecoveryError::Held => f.write_str(
                "the run stopped twice: it goes on only after approvals from platform operations and the business owner (O3)",
            ),
            RecoveryError::NotHeld => f.write_str("the run is not waiting for approvals"),
            RecoveryError::SameApprover(a) => write!(f, "{a} already approved: the two approvals must come from two people"),
            RecoveryError::RoleGiven(r) => write!(f, "the {} approval is already given", r.label()),
            RecoveryError::NotClosable(m) => write!(f, "the run cannot close yet: {}", m.join("; ")),
            RecoveryError::Ended(s) => write!(f, "the run is {}", s.as_str()),
        }
    }
}

impl std::error::Error for RecoveryError {}

/// Who completed a step, when, and what showed it done.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepDone {
    pub step: RecoveryStep,
    pub actor: String,
    pub at: i64,
    pub evidence: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recovery {
    pub cfg: RecoveryConfig,
    pub step: RecoveryStep,
    /// Index into `cfg.stages` while resuming.
    pub stage: Option<usize>,
    pub stage_started_at: Option<i64>,
    /// O2 step-backs so far.
    pub stops: u32,
    /// O3: set by the second stop (and any after it) until both approvals arrive.
    pub held_since: Option<i64>,
    pub approvals: Vec<Approval>,
    pub done: Vec<StepDone>,
    /// The current probe round.
    pub probes: Vec<ProbeResult>,
    pub probe_rounds: u32,
    /// The route's normal latency the current round is judged against.
    pub normal_p95_ms: Option<f64>,
    /// The current round passed every check (a held run waits with it for approvals).
    #[serde(default)]
    pub round_passed: bool,
    /// O2: the last outcomes during resume, `true` for a provider failure.
    recent: VecDeque<bool>,
    rate_limited_since: Option<i64>,
}

/// The nearest-rank percentile of `v` (sorted here).
fn percentile(v: &mut [f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

impl Recovery {
    pub fn new(cfg: RecoveryConfig) -> Recovery {
        Recovery {
            cfg,
            step: RecoveryStep::Isolate,
            stage: None,
            stage_started_at: None,
            stops: 0,
            held_since: None,
            approvals: Vec::new(),
            done: Vec::new(),
            probes: Vec::new(),
            probe_rounds: 0,
            normal_p95_ms: None,
            round_passed: false,
            recent: VecDeque::new(),
            rate_limited_since: None,
        }
    }

    pub fn held(&self) -> bool {
        self.held_since.is_some()
    }

    /// The current stage's share, while resuming.
    pub fn stage_pct(&self) -> Option<u8> {
        self.stage.and_then(|i| self.cfg.stages.get(i).copied())
    }

    /// What the route may do: `None` leaves it alone (before isolation, and from the
    /// drain on, when retries are back).
    pub fn gate(&self) -> Option<Gate> {
        match self.step {
            RecoveryStep::Preserve | RecoveryStep::RollBack | RecoveryStep::Confirm => Some(Gate {
                share_pct: 0,
                jobs_held: true,
            }),
            RecoveryStep::Resume => Some(Gate {
                share_pct: self.stage_pct().unwrap_or(0),
                jobs_held: true,
            }),
            _ => None,
        }
    }

    /// O5: the approvals that count towards the current hold.
    pub fn current_approvals(&self) -> Vec<&Approval> {
        match self.held_since {
            Some(since) => self.approvals.iter().filter(|a| a.at >= since).collect(),
            None => Vec::new(),
        }
    }

    /// The recent window's figures: outcomes, provider failures, and since when 429s
    /// have come without a success.
    pub fn recent(&self) -> (usize, usize, Option<i64>) {
        (
            self.recent.len(),
            self.recent.iter().filter(|f| **f).count(),
            self.rate_limited_since,
        )
    }

    fn open(&self) -> Result<(), RecoveryError> {
        if self.step.is_open() {
            Ok(())
        } else {
            Err(RecoveryError::Ended(self.step))
        }
    }

    fn expect(&self, wanted: RecoveryStep) -> Result<(), RecoveryError> {
        self.open()?;
        if self.step != wanted {
            return Err(RecoveryError::WrongStep { wanted, now: self.step });
        }
        Ok(())
    }

    fn go(&mut self, to: RecoveryStep, action: &'static str, reason: String, figures: Vec<(String, f64)>) -> Change {
        let from = self.step;
        self.step = to;
        Change {
            from,
            to,
            action,
            reason,
            figures,
        }
    }

    /// Completes one of the operator's steps (isolate, preserve, roll back), with what
    /// shows it done.
    pub fn complete(
        &mut self,
        step: RecoveryStep,
        actor: &str,
        evidence: String,
        now: i64,
    ) -> Result<Change, RecoveryError> {
        let next = match step {
            RecoveryStep::Isolate => RecoveryStep::Preserve,
            RecoveryStep::Preserve => RecoveryStep::RollBack,
            RecoveryStep::RollBack => RecoveryStep::Confirm,
            other => {
                return Err(RecoveryError::WrongStep {
                    wanted: other,
                    now: self.step,
                });
            }
        };
        self.expect(step)?;
        self.done.push(StepDone {
            step,
            actor: actor.to_owned(),
            at: now,
            evidence: evidence.clone(),
        });
        let action = match step {
            RecoveryStep::Isolate => "isolated",
            RecoveryStep::Preserve => "evidence_preserved",
            _ => "rolled_back",
        };
        Ok(self.go(next, action, evidence, Vec::new()))
    }

    /// Starts a probe round judged against `normal_p95_ms` (unknown: P95 is not judged).
    pub fn start_probes(&mut self, normal_p95_ms: Option<f64>) -> Result<(), RecoveryError> {
        self.expect(RecoveryStep::Confirm)?;
        self.probes.clear();
        self.round_passed = false;
        self.probe_rounds += 1;
        self.normal_p95_ms = normal_p95_ms;
        Ok(())
    }

    /// Whether the round wants another probe.
    pub fn probe_wanted(&self) -> bool {
        self.step == RecoveryStep::Confirm
            && (self.probes.len() as u32) < self.cfg.probes
            && self.probes.iter().all(|p| p.ok && !p.duplicate)
    }

    /// One probe's result. Returns the round's verdict once it has one: `Ok(Some(change))`
    /// when it passed and the run resumes, `Err(reason)` when it failed (the run stays at
    /// confirm, for another round), `Ok(None)` while probes are still due, or when a held
    /// run passed and waits for its approvals.
    pub fn probe(&mut self, result: ProbeResult, actor: &str, now: i64) -> Result<Option<Change>, String> {
        if self.step != RecoveryStep::Confirm {
            return Err(format!("the run is at `{}`, not `confirm`", self.step.as_str()));
        }
        let n = self.probes.len() + 1;
        let failed = (!result.ok)
            .then(|| format!("probe {n} failed"))
            .or_else(|| result.duplicate.then(|| format!("probe {n} found a duplicate")));
        self.probes.push(result);
        if let Some(why) = failed {
            return Err(why);
        }
        if (self.probes.len() as u32) < self.cfg.probes {
            return Ok(None);
        }
        let mut lat: Vec<f64> = self.probes.iter().map(|p| p.latency_ms).collect();
        let p95 = percentile(&mut lat, 0.95).unwrap_or(0.0);
        if let Some(normal) = self.normal_p95_ms
            && p95 > self.cfg.p95_factor * normal
        {
            return Err(format!(
                "P95 {p95:.0} ms is above {:.1} × the normal {normal:.0} ms",
                self.cfg.p95_factor
            ));
        }
        let judged = match self.normal_p95_ms {
            Some(n) => format!("P95 {p95:.0} ms within {:.1} × normal {n:.0} ms", self.cfg.p95_factor),
            None => format!("P95 {p95:.0} ms (no normal latency on record to judge it by)"),
        };
        let evidence = format!(
            "{} of {} probes succeeded, {judged}, 0 duplicates",
            self.probes.len(),
            self.cfg.probes
        );
        self.done.push(StepDone {
            step: RecoveryStep::Confirm,
            actor: actor.to_owned(),
            at: now,
            evidence: evidence.clone(),
        });
        self.round_passed = true;
        if self.held() {
            return Ok(None);
        }
        Ok(Some(self.resume_at(0, now, "confirmed", evidence, p95)))
    }

    fn resume_at(&mut self, stage: usize, now: i64, action: &'static str, reason: String, p95: f64) -> Change {
        self.stage = Some(stage);
        self.stage_started_at = Some(now);
        self.recent.clear();
        self.rate_limited_since = None;
        let pct = self.stage_pct().unwrap_or(0) as f64;
        self.go(
            RecoveryStep::Resume,
            action,
            reason,
            vec![("stage_pct".into(), pct), ("probe_p95_ms".into(), p95)],
        )
    }

    /// O2: one request's outcome on the route while resuming.
    pub fn on_outcome(&mut self, outcome: Outcome, now: i64) -> Option<Change> {
        if self.step != RecoveryStep::Resume {
            return None;
        }
        match outcome {
            Outcome::Neutral => return None,
            Outcome::Success => self.rate_limited_since = None,
            Outcome::RateLimited => {
                let since = *self.rate_limited_since.get_or_insert(now);
                if now - since >= self.cfg.rate_limited_ms {
                    let secs = (now - since) as f64 / 1000.0;
                    return Some(self.step_back(
                        format!("429s for {secs:.0} s without a success"),
                        vec![("rate_limited_s".into(), secs)],
                        now,
                    ));
                }
            }
            Outcome::ProviderFailure => {}
        }
        self.recent.push_back(outcome == Outcome::ProviderFailure);
        while self.recent.len() > self.cfg.window {
            self.recent.pop_front();
        }
        let failures = self.recent.iter().filter(|f| **f).count();
        if failures >= self.cfg.server_errors {
            let n = self.recent.len();
            return Some(self.step_back(
                format!("5xx in {failures} of the last {n} requests"),
                vec![("server_errors".into(), failures as f64), ("of".into(), n as f64)],
                now,
            ));
        }
        None
    }

    /// O2: duplicates found on the route since the stage began.
    pub fn on_duplicates(&mut self, duplicates: u64, now: i64) -> Option<Change> {
        (self.step == RecoveryStep::Resume && duplicates > 0).then(|| {
            self.step_back(
                format!("{duplicates} duplicate(s): an idempotency key completed twice"),
                vec![("duplicates".into(), duplicates as f64)],
                now,
            )
        })
    }

    /// O2: the route's cost for the day, projected, against its daily cap.
    pub fn on_cost(&mut self, projected_usd: f64, daily_cap_usd: f64, now: i64) -> Option<Change> {
        (self.step == RecoveryStep::Resume && projected_usd > daily_cap_usd).then(|| {
            self.step_back(
                format!("projected cost ${projected_usd:.2} for the day is above the cap ${daily_cap_usd:.2}"),
                vec![
                    ("projected_usd".into(), projected_usd),
                    ("daily_cap_usd".into(), daily_cap_usd),
                ],
                now,
            )
        })
    }

    /// O2, O3: one stage back at once (from the first, back to confirm, paused); the
    /// second stop holds the run for two approvals.
    fn step_back(&mut self, reason: String, mut figures: Vec<(String, f64)>, now: i64) -> Change {
        self.stops += 1;
        self.recent.clear();
        self.rate_limited_since = None;
        if self.stops >= 2 {
            self.held_since = Some(now);
        }
        figures.push(("stops".into(), self.stops as f64));
        let reason = if self.held() {
            format!(
                "{reason}; stop {} of this run: automatic resume needs two approvals (O3)",
                self.stops
            )
        } else {
            reason
        };
        match self.stage {
            Some(i) if i > 0 => {
                self.stage = Some(i - 1);
                self.stage_started_at = Some(now);
                figures.push(("stage_pct".into(), self.stage_pct().unwrap_or(0) as f64));
                let from = self.step;
                Change {
                    from,
                    to: RecoveryStep::Resume,
                    action: "stepped_back",
                    reason,
                    figures,
                }
            }
            _ => {
                self.stage = None;
                self.stage_started_at = None;
                self.probes.clear();
                self.round_passed = false;
                figures.push(("stage_pct".into(), 0.0));
                self.go(RecoveryStep::Confirm, "stepped_back", reason, figures)
            }
        }
    }

    /// Time passing: a stage that has run its time gives way to the next (never while
    /// held); after the last, the drain.
    pub fn tick(&mut self, now: i64) -> Option<Change> {
        if self.step != RecoveryStep::Resume || self.held() {
            return None;
        }
        let (i, started) = (self.stage?, self.stage_started_at?);
        if now - started < self.cfg.stage_ms {
            return None;
        }
        if i + 1 < self.cfg.stages.len() {
            let from = self.stage_pct().unwrap_or(0) as f64;
            self.stage = Some(i + 1);
            self.stage_started_at = Some(now);
            self.recent.clear();
            self.rate_limited_since = None;
            let to = self.stage_pct().unwrap_or(0) as f64;
            Some(Change {
                from: RecoveryStep::Resume,
                to: RecoveryStep::Resume,
                action: "stage_advanced",
                reason: format!(
                    "{from:.0} % ran {} s without a step-back: {to:.0} %",
                    self.cfg.stage_ms / 1000
                ),
                figures: vec![("stage_pct".into(), to)],
            })
        } else {
            self.stage = None;
            self.stage_started_at = None;
            Some(self.go(
                RecoveryStep::Drain,
                "resumed",
                "100 % ran its time: retries back on, the backlog drains in deadline order".into(),
                vec![("stage_pct".into(), 100.0)],
            ))
        }
    }

    /// O3: one of the two approvals a held run needs.
    pub fn approve(&mut self, a: Approval) -> Result<Option<Change>, RecoveryError> {
        self.open()?;
        if !self.held() {
            return Err(RecoveryError::NotHeld);
        }
        let same = |x: &str, y: &str| x.trim().eq_ignore_ascii_case(y.trim());
        let given = self.current_approvals();
        if let Some(g) = given.iter().find(|g| same(&g.actor, &a.actor)) {
            return Err(RecoveryError::SameApprover(g.actor.clone()));
        }
        if given.iter().any(|g| g.role == a.role) {
            return Err(RecoveryError::RoleGiven(a.role));
        }
        let now = a.at;
        self.approvals.push(a);
        if self.current_approvals().len() < 2 {
            return Ok(None);
        }
        self.held_since = None;
        let names: Vec<String> = self
            .approvals
            .iter()
            .rev()
            .take(2)
            .map(|a| format!("{} ({})", a.actor, a.role.label()))
            .collect();
        let reason = format!("approved by {}: automatic resume allowed again", names.join(" and "));
        // The stage starts its time again: it was not watched while held.
        if self.step == RecoveryStep::Resume {
            self.stage_started_at = Some(now);
        }
        let step = self.step;
        // A held run that passed its probes resumes now.
        if step == RecoveryStep::Confirm && self.round_passed {
            return Ok(Some(self.resume_at(0, now, "approved", reason, 0.0)));
        }
        Ok(Some(Change {
            from: step,
            to: step,
            action: "approved",
            reason,
            figures: vec![],
        }))
    }

    /// The drain is over once nothing of the route waits and nothing is unknown.
    pub fn drained(&mut self, backlog: u64, unknowns: u64) -> Option<Change> {
        (self.step == RecoveryStep::Drain && backlog == 0 && unknowns == 0).then(|| {
            self.go(
                RecoveryStep::Close,
                "drained",
                "backlog 0 and unknowns 0".into(),
                vec![("backlog".into(), 0.0), ("unknowns".into(), 0.0)],
            )
        })
    }

    /// O4: closes once every condition holds.
    pub fn close(&mut self, checks: &CloseChecks, actor: &str, now: i64) -> Result<Change, RecoveryError> {
        self.open()?;
        if !matches!(self.step, RecoveryStep::Drain | RecoveryStep::Close) {
            return Err(RecoveryError::WrongStep {
                wanted: RecoveryStep::Close,
                now: self.step,
            });
        }
        let missing = checks.missing();
        if !missing.is_empty() {
            return Err(RecoveryError::NotClosable(missing));
        }
        self.done.push(StepDone {
            step: RecoveryStep::Close,
            actor: actor.to_owned(),
            at: now,
            evidence: "backlog 0, unknowns 0, every overrun explained, customer contacted".into(),
        });
        Ok(self.go(RecoveryStep::Closed, "closed", "O4's conditions hold".into(), vec![]))
    }

    /// G2 during resume: the route's breaker opened again. Nothing reaches the provider,
    /// so O2 has no outcomes to judge: that is a relapse in itself.
    pub fn on_breaker_open(&mut self, reason: &str, now: i64) -> Option<Change> {
        (self.step == RecoveryStep::Resume)
            .then(|| self.step_back(format!("the route's breaker opened again: {reason}"), vec![], now))
    }

    /// After a restart: the stage being resumed starts its time again, since nobody
    /// watched the route while the gateway was down.
    pub fn restart_stage(&mut self, now: i64) {
        if self.step == RecoveryStep::Resume {
            self.stage_started_at = Some(now);
            self.recent.clear();
            self.rate_limited_since = None;
        }
    }

    /// Stops the run where it is; the route is left alone again. Not while held: O3's
    /// two approvals may not be sidestepped by one person cancelling.
    pub fn cancel(&mut self, reason: &str) -> Result<Change, RecoveryError> {
        self.open()?;
        if self.held() {
            return Err(RecoveryError::Held);
        }
        self.stage = None;
        self.held_since = None;
        Ok(self.go(RecoveryStep::Cancelled, "cancelled", reason.to_owned(), vec![]))
    }

    /// Who completed `step`, when, and its evidence (the latest time).
    pub fn done_of(&self, step: RecoveryStep) -> Option<&StepDone> {
        self.done.iter().rev().find(|d| d.step == step)
    }

    /// A checklist step's status relative to where the run is.
    pub fn status_of(&self, step: RecoveryStep) -> &'static str {
        if self.step == RecoveryStep::Cancelled {
            return if self.done_of(step).is_some() {
                "done"
            } else {
                "pending"
            };
        }
        let (s, now) = (step.index(), self.step.index());
        if self.step == RecoveryStep::Closed || s < now {
            "done"
        } else if s == now {
            "current"
        } else {
            "pending"
        }
    }
}

#[cfg(test)]
mod tests;
