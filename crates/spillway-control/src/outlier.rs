//! One channel's health as routing reads it (D4, D5): its latency against its own normal
//! and its recent errors set its share of new conversations; a run of provider failures
//! ejects it for a cool-down that doubles with each ejection in a row, after which it
//! comes back gradually (its share ramps up over as long as the cool-down was). One
//! failure while it ramps sends it straight back out, for longer. So a dead channel costs
//! a handful of attempts per cool-down, not three attempts per request forever. The
//! latency estimate is a peak-EWMA, as linkerd's balancer keeps: it jumps up at once
//! with a slow answer and decays back with time.

use crate::Outcome;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::time::Instant;

#[derive(Clone, Debug)]
pub struct OutlierConfig {
    /// Provider failures in a row that eject (Envoy's `consecutive_5xx`)...
    pub consecutive_failures: u32,
    /// ... when they also make up this share of its last `recent` answers: a channel that
    /// fails a third of its calls meets a run of five now and then, and must not be taken
    /// out for it; one that is dead is, at once (all its recent answers failed).
    pub failure_share: f64,
    pub recent: usize,
    /// The first cool-down; each further ejection in a row doubles it, up to the maximum.
    pub base_ejection: Duration,
    pub max_ejection: Duration,
    /// Healthy this long, the channel's ejection count starts again from zero.
    pub forget_after: Duration,
    /// The peak-EWMA's decay time, and the normal latency's (much slower).
    pub latency_tau: Duration,
    pub normal_tau: Duration,
    /// The least share a slow or erring channel in rotation keeps, so it is still measured.
    pub min_share: f64,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            consecutive_failures: 5,
            failure_share: 0.6,
            recent: 20,
            base_ejection: Duration::from_secs(30),
            max_ejection: Duration::from_secs(600),
            forget_after: Duration::from_secs(600),
            latency_tau: Duration::from_secs(10),
            normal_tau: Duration::from_secs(300),
            min_share: 0.05,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    /// In rotation at the share its latency and errors earn.
    Healthy { since: Instant },
    /// Out of rotation until `until`.
    Ejected {
        until: Instant,
        cool_down: Duration,
        reason: String,
    },
    /// Back in rotation after a cool-down; its share ramps from 10 % to full over `ramp`.
    Recovering { since: Instant, ramp: Duration },
}

/// A channel leaving or re-entering rotation, for the audit log and alerts.
#[derive(Clone, Debug, PartialEq)]
pub struct OutlierTransition {
    /// True when it left rotation.
    pub ejected: bool,
    pub cool_down: Duration,
    /// Ejections in a row, this one included.
    pub ejections: u32,
    pub reason: String,
}

/// The part that survives a restart.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutlierSnapshot {
    /// Milliseconds left of an ejection at the snapshot; None when in rotation.
    pub ejected_for_ms: Option<u64>,
    pub cool_down_ms: u64,
    pub reason: Option<String>,
    pub ejections: u32,
    pub normal_ms: Option<f64>,
}

#[derive(Debug)]
pub struct Outlier {
    cfg: OutlierConfig,
    state: State,
    consecutive: u32,
    /// The last answers, true for a provider failure, and how many of them failed.
    recent: std::collections::VecDeque<bool>,
    recent_failed: usize,
    ejections: u32,
    /// Peak-EWMA latency (ms) at `seen`, and the normal (ms).
    peak_ms: Option<f64>,
    normal_ms: Option<f64>,
    seen: Instant,
    /// Share of recent answers that were provider failures (EWMA per answer).
    error_rate: f64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl Outlier {
    pub fn new(cfg: OutlierConfig, now: Instant) -> Outlier {
        Outlier {
            cfg,
            state: State::Healthy { since: now },
            consecutive: 0,
            recent: std::collections::VecDeque::new(),
            recent_failed: 0,
            ejections: 0,
            peak_ms: None,
            normal_ms: None,
            seen: now,
            error_rate: 0.0,
        }
    }

    /// Moves on what time alone moves: an ended cool-down, an ended ramp.
    pub fn advance(&mut self, now: Instant) -> Option<OutlierTransition> {
        let first = self.step(now);
        // A cool-down and its ramp may both have passed since the last look.
        while self.step(now).is_some() {}
        first
    }

    fn step(&mut self, now: Instant) -> Option<OutlierTransition> {
        match self.state {
            State::Ejected { until, cool_down, .. } if now >= until => {
                self.state = State::Recovering {
                    since: until,
                    ramp: cool_down,
                };
                self.consecutive = 0;
                // The ramp is what holds it back now; its old errors would hold it twice.
                self.error_rate = 0.0;
                Some(OutlierTransition {
                    ejected: false,
                    cool_down,
                    ejections: self.ejections,
                    reason: format!(
                        "cool-down of {} s over: back in rotation, its share rising over as long",
                        cool_down.as_secs()
                    ),
                })
            }
            State::Recovering { since, ramp } if now >= since + ramp => {
                self.state = State::Healthy { since: since + ramp };
                None
            }
            State::Healthy { since }
                if self.ejections > 0 && now.saturating_duration_since(since) >= self.cfg.forget_after =>
            {
                self.ejections = 0;
                None
            }
            _ => None,
        }
    }

    /// When ejected: how long until it is back, and why it is out.
    pub fn ejected(&self, now: Instant) -> Option<(Duration, String)> {
        match &self.state {
            State::Ejected { until, reason, .. } if now < *until => {
                Some((until.saturating_duration_since(now), reason.clone()))
            }
            _ => None,
        }
    }

    pub fn ejections(&self) -> u32 {
        self.ejections
    }

    pub fn recovering(&self) -> bool {
        matches!(self.state, State::Recovering { .. })
    }

    fn eject(&mut self, why: String, now: Instant) -> OutlierTransition {
        if let State::Healthy { since } = self.state
            && now.saturating_duration_since(since) >= self.cfg.forget_after
        {
            self.ejections = 0;
        }
        let factor = 1u32.checked_shl(self.ejections.min(16)).unwrap_or(u32::MAX);
        let cool_down = self.cfg.base_ejection.saturating_mul(factor).min(self.cfg.max_ejection);
        self.ejections = self.ejections.saturating_add(1);
        let reason = format!(
            "{why}; out of rotation for {} s (ejection {} in a row)",
            cool_down.as_secs(),
            self.ejections
        );
        self.state = State::Ejected {
            until: now + cool_down,
            cool_down,
            reason: reason.clone(),
        };
        self.consecutive = 0;
        OutlierTransition {
            ejected: true,
            cool_down,
            ejections: self.ejections,
            reason,
        }
    }

    fn remember(&mut self, failed: bool) {
        self.recent.push_back(failed);
        self.recent_failed += usize::from(failed);
        while self.recent.len() > self.cfg.recent.max(1) {
            if self.recent.pop_front() == Some(true) {
                self.recent_failed -= 1;
            }
        }
    }

    /// An attempt on the channel ended. Returns the ejection it caused. `may_eject` is
    /// false when the channel is the last of its group in rotation among several: the
    /// route's breaker protects the upstream then, and ejecting it would only turn a
    /// degraded route into a dead one.
    pub fn observe(
        &mut self,
        outcome: Outcome,
        latency: Duration,
        now: Instant,
        may_eject: bool,
    ) -> Option<OutlierTransition> {
        self.advance(now);
        if matches!(outcome, Outcome::Success | Outcome::ProviderFailure) {
            self.remember(outcome == Outcome::ProviderFailure);
        }
        match outcome {
            Outcome::ProviderFailure => {
                self.consecutive += 1;
                self.error_rate += (1.0 - self.error_rate) / 10.0;
                let share = self.recent_failed as f64 / self.recent.len().max(1) as f64;
                match self.state {
                    _ if !may_eject => None,
                    State::Ejected { .. } => None,
                    State::Recovering { .. } => Some(self.eject("failed again while coming back".into(), now)),
                    State::Healthy { .. }
                        if self.consecutive >= self.cfg.consecutive_failures && share >= self.cfg.failure_share =>
                    {
                        let why = format!(
                            "{} provider failures in a row, {} of its last {} answers",
                            self.consecutive,
                            self.recent_failed,
                            self.recent.len()
                        );
                        Some(self.eject(why, now))
                    }
                    State::Healthy { .. } => None,
                }
            }
            Outcome::Success => {
                self.consecutive = 0;
                self.error_rate -= self.error_rate / 10.0;
                self.observe_latency(ms(latency), now);
                None
            }
            // A 429 shows a live upstream pacing us; pacing is D6's business.
            Outcome::RateLimited => {
                self.consecutive = 0;
                None
            }
            Outcome::Neutral => None,
        }
    }

    fn observe_latency(&mut self, l: f64, now: Instant) {
        let dt = now.saturating_duration_since(self.seen).as_secs_f64();
        self.seen = now;
        let decay = |tau: Duration| (-dt / tau.as_secs_f64().max(1e-3)).exp();
        self.peak_ms = Some(match self.peak_ms {
            Some(p) if l < p => {
                let w = decay(self.cfg.latency_tau);
                p * w + l * (1.0 - w)
            }
            _ => l,
        });
        // The normal follows the same estimate over a much longer time: a peak-EWMA sits
        // above the plain mean whenever answers vary, so against the mean every healthy
        // channel would look slow.
        let peak = self.peak_ms.unwrap_or(l);
        self.normal_ms = Some(match self.normal_ms {
            Some(n) => {
                let w = decay(self.cfg.normal_tau);
                n * w + peak * (1.0 - w)
            }
            None => peak,
        });
    }

    /// The latency estimate now: the peak decays back towards the normal while the
    /// channel is not measured, so a channel that got little work for being slow is tried
    /// again.
    pub fn latency_ms(&self, now: Instant) -> Option<f64> {
        let (p, n) = (self.peak_ms?, self.normal_ms?);
        let dt = now.saturating_duration_since(self.seen).as_secs_f64();
        Some(n + (p - n) * (-dt / self.cfg.latency_tau.as_secs_f64().max(1e-3)).exp())
    }

    pub fn normal_ms(&self) -> Option<f64> {
        self.normal_ms
    }

    pub fn error_rate(&self) -> f64 {
        self.error_rate
    }

    /// D4: the factor (0–1) on the channel's configured weight for new conversations.
    pub fn share(&self, now: Instant) -> f64 {
        let ramp = match self.state {
            State::Ejected { until, .. } if now < until => return 0.0,
            // Over, but not yet moved on by `advance`: the ramp's start.
            State::Ejected { .. } => 0.1,
            State::Recovering { since, ramp } if !ramp.is_zero() => {
                let p = now.saturating_duration_since(since).as_secs_f64() / ramp.as_secs_f64();
                0.1 + 0.9 * p.min(1.0)
            }
            _ => 1.0,
        };
        let latency = match (self.latency_ms(now), self.normal_ms) {
            (Some(l), Some(n)) if n > 0.0 && l > n => (n / l).powi(2),
            _ => 1.0,
        };
        let errors = (1.0 - self.error_rate).powi(2);
        (ramp * latency * errors).max(self.cfg.min_share)
    }

    pub fn snapshot(&self, now: Instant) -> OutlierSnapshot {
        let (ejected_for, cool_down, reason) = match &self.state {
            State::Ejected {
                until,
                cool_down,
                reason,
            } => (
                Some(until.saturating_duration_since(now).as_millis() as u64),
                cool_down.as_millis() as u64,
                Some(reason.clone()),
            ),
            State::Recovering { ramp, .. } => (None, ramp.as_millis() as u64, None),
            State::Healthy { .. } => (None, 0, None),
        };
        OutlierSnapshot {
            ejected_for_ms: ejected_for,
            cool_down_ms: cool_down,
            reason,
            ejections: self.ejections,
            normal_ms: self.normal_ms,
        }
    }

    /// An outlier as a snapshot left it, `elapsed` later: an ejection keeps its end.
    pub fn restore(cfg: OutlierConfig, s: &OutlierSnapshot, elapsed: Duration, now: Instant) -> Outlier {
        let mut o = Outlier::new(cfg, now);
        o.ejections = s.ejections;
        o.normal_ms = s.normal_ms;
        let cool_down = Duration::from_millis(s.cool_down_ms);
        match s.ejected_for_ms {
            Some(left) => {
                o.state = State::Ejected {
                    until: now + Duration::from_millis(left).saturating_sub(elapsed),
                    cool_down,
                    reason: s.reason.clone().unwrap_or_default(),
                }
            }
            None if s.ejections > 0 => {
                o.state = State::Recovering {
                    since: now,
                    ramp: cool_down,
                }
            }
            None => {}
        }
        o
    }

    /// An operator put the channel back in rotation at full share.
    pub fn restore_now(&mut self, now: Instant) -> bool {
        let was = !matches!(self.state, State::Healthy { .. });
        self.state = State::Healthy { since: now };
        self.consecutive = 0;
        self.error_rate = 0.0;
        // The operator vouches for it: its next failure starts from the first cool-down.
        self.ejections = 0;
        was
    }
}
