//! A channel's place in rotation: paced by a provider's wait hint (D6), ejected for a
//! refused credential or exhausted quota (E2), cooling down after a run of provider
//! failures (D5, with its share of new work from its latency and errors, D4), and the
//! rate-limit room its last answer reported (E3). A small state machine per channel, on
//! tokio's clock so that tests can run it on a paused one.

use serde::Serialize;
use spillway_control::{Outcome, Outlier, OutlierConfig, OutlierSnapshot, OutlierTransition};
use spillway_wire::{ErrorClass, RateLimitState, Signal};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;
use ts_rs::TS;

/// Where a channel stands.
#[derive(Clone, Debug, PartialEq)]
pub enum Rotation {
    /// Takes new work.
    Ready,
    /// D6: the provider asked for a pause (429 with Retry-After or a reset hint); no new
    /// work until `until`, then back to `Ready` by itself: the provider named the time.
    Paced { until: Instant, reason: String },
    /// E2: the channel's credential was refused or its quota is gone. Out of rotation
    /// until `until` (a reset the provider named) or, without one, until an operator
    /// restores it. Never left by retrying.
    Ejected {
        class: ErrorClass,
        until: Option<Instant>,
        reason: String,
    },
}

/// R2: a channel's place in rotation as the fleet's other instances apply it: a
/// provider's pause (D6), an ejection (E2), or back (an operator's restore).
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct SharedRotation {
    /// `ready`, `paced` or `ejected`.
    pub state: String,
    /// The ejection's signal class (`auth`, `quota`).
    pub class: Option<String>,
    /// Until it comes back by itself, from the moment it was published; None: an
    /// operator must restore it (or it is ready).
    pub back_in_ms: Option<u64>,
    pub reason: String,
}

/// Why a channel cannot take a request now.
#[derive(Clone, Debug, PartialEq)]
pub enum Unavailable {
    /// Back in `Duration` (a pace or a rate-limit window).
    For(Duration, String),
    /// Out until an operator acts, or until a named reset.
    Ejected(Option<Duration>, String),
    /// D5: cooling down after repeated provider failures, back in `Duration`. Not waited
    /// for: a request takes another channel, or fails fast.
    Cooling(Duration, String),
}

#[derive(Debug)]
struct Inner {
    rotation: Rotation,
    /// E3: the provider's last word on remaining room, and when it was said.
    room: RateLimitState,
    room_at: Instant,
    /// D4, D5: latency, errors and ejections.
    outlier: Outlier,
    outlier_cfg: OutlierConfig,
}

/// The health of one channel.
#[derive(Debug)]
pub struct Health {
    inner: Mutex<Inner>,
}

impl Default for Health {
    fn default() -> Self {
        Health::new(OutlierConfig::default())
    }
}

impl Health {
    /// A channel in rotation, ejected by `outlier`'s rules when it keeps failing.
    pub fn new(outlier: OutlierConfig) -> Health {
        Health {
            inner: Mutex::new(Inner {
                rotation: Rotation::Ready,
                room: RateLimitState::default(),
                room_at: Instant::now(),
                outlier: Outlier::new(outlier.clone(), Instant::now()),
                outlier_cfg: outlier,
            }),
        }
    }
}

/// A channel's place in rotation, as the console shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum RotationState {
    /// Takes new work.
    Ready,
    /// A provider's wait hint keeps it out of new work until it passes (D6, E3).
    Paced,
    /// Its credential or quota was refused (E2): out until a reset or an operator.
    Ejected,
    /// Repeated provider failures (D5): out for a cool-down that grows with each ejection.
    Cooling,
    /// Back from a cool-down, its share of new work rising (D5).
    Recovering,
}

/// What the console shows for a channel's rotation.
#[derive(Clone, Debug, Serialize, TS)]
pub struct HealthView {
    pub state: RotationState,
    pub reason: Option<String>,
    /// Milliseconds until the channel takes new work again; absent when ready, or when
    /// only an operator can restore it.
    pub back_in_ms: Option<u64>,
    /// E3: what the provider last reported as left, while its window runs.
    pub remaining_requests: Option<u64>,
    pub remaining_tokens: Option<u64>,
    /// D4: the factor (0–1) on its configured weight for new conversations.
    pub share: f64,
    /// D4: its latency estimate and its own normal, in ms; absent before any answer.
    pub latency_ms: Option<f64>,
    pub normal_latency_ms: Option<f64>,
    /// Recent provider failures per answer (a moving average, 0–1).
    pub error_rate: f64,
    /// D5: ejections in a row (each doubles the cool-down).
    pub ejections: u32,
}

fn left(until: Instant, now: Instant) -> Duration {
    until.saturating_duration_since(now)
}

impl Health {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// Whether the channel may take a request needing `tokens` (input estimate plus output
    /// cap) now; expired paces and resets are cleared on the way.
    pub fn check(&self, tokens: u64, now: Instant) -> Result<(), Unavailable> {
        self.with(|i| {
            match &i.rotation {
                Rotation::Ready => {}
                Rotation::Paced { until, .. } | Rotation::Ejected { until: Some(until), .. } if *until <= now => {
                    i.rotation = Rotation::Ready;
                }
                Rotation::Paced { until, reason } => return Err(Unavailable::For(left(*until, now), reason.clone())),
                Rotation::Ejected { until, reason, .. } => {
                    return Err(Unavailable::Ejected(until.map(|u| left(u, now)), reason.clone()));
                }
            }
            // An ended cool-down is moved on (and recorded) by the control ticker; here it
            // simply no longer counts.
            if let Some((d, reason)) = i.outlier.ejected(now) {
                return Err(Unavailable::Cooling(d, reason));
            }
            let since = now.saturating_duration_since(i.room_at);
            if let (Some(0), Some(reset)) = (i.room.remaining_requests, i.room.reset_requests_ms) {
                let reset = Duration::from_millis(reset);
                if since < reset {
                    return Err(Unavailable::For(
                        reset - since,
                        "provider reports no requests left in this window".into(),
                    ));
                }
            }
            if let (Some(rem), Some(reset)) = (i.room.remaining_tokens, i.room.reset_tokens_ms) {
                let reset = Duration::from_millis(reset);
                if rem < tokens && since < reset {
                    return Err(Unavailable::For(
                        reset - since,
                        format!("provider reports {rem} tokens left; the request may need {tokens}"),
                    ));
                }
            }
            Ok(())
        })
    }

    /// A request is on its way: count it against the reported room until the provider's
    /// next answer says how much is really left.
    pub fn reserve(&self, tokens: u64) {
        self.with(|i| {
            if let Some(r) = i.room.remaining_requests.as_mut() {
                *r = r.saturating_sub(1);
            }
            if let Some(t) = i.room.remaining_tokens.as_mut() {
                *t = t.saturating_sub(tokens);
            }
        });
    }

    /// E3: the provider's rate-limit headers on any answer.
    pub fn observe_room(&self, room: RateLimitState, now: Instant) {
        if room.is_empty() {
            return;
        }
        self.with(|i| {
            i.room = room;
            i.room_at = now;
        });
    }

    /// Applies a failed attempt's signal: D6 pacing for 429s with a hint, E2 ejection for
    /// refused credentials and quota. Returns true when the channel was newly ejected
    /// (the caller alerts once, not per request).
    pub fn observe_failure(&self, s: &Signal, channel: &str, now: Instant) -> bool {
        self.with(|i| match s.class {
            ErrorClass::Auth | ErrorClass::Quota => {
                let already = matches!(i.rotation, Rotation::Ejected { .. });
                let what = if s.class == ErrorClass::Auth {
                    format!(
                        "the provider rejected channel {channel}'s credential (HTTP {})",
                        s.http_status.unwrap_or(0)
                    )
                } else {
                    format!(
                        "channel {channel} is out of provider quota ({})",
                        s.provider_error_type.as_deref().unwrap_or("quota")
                    )
                };
                i.rotation = Rotation::Ejected {
                    class: s.class,
                    // Only a quota with a named reset comes back by itself.
                    until: (s.class == ErrorClass::Quota)
                        .then_some(s.retry_after_ms)
                        .flatten()
                        .map(|ms| now + Duration::from_millis(ms)),
                    reason: what,
                };
                !already
            }
            ErrorClass::RateLimit | ErrorClass::Overload => {
                if let Some(ms) = s.retry_after_ms.filter(|ms| *ms > 0) {
                    let until = now + Duration::from_millis(ms);
                    // A pace never shortens an ejection or a longer pace.
                    match &i.rotation {
                        Rotation::Ejected { .. } => {}
                        Rotation::Paced { until: u, .. } if *u >= until => {}
                        _ => {
                            i.rotation = Rotation::Paced {
                                until,
                                reason: format!(
                                    "HTTP {} asked for a pause of {}",
                                    s.http_status.unwrap_or(429),
                                    if ms % 1000 == 0 {
                                        format!("{} s", ms / 1000)
                                    } else {
                                        format!("{ms} ms")
                                    }
                                ),
                            }
                        }
                    }
                }
                false
            }
            _ => false,
        })
    }

    /// R2: the pace or ejection (or readiness) this channel is in, to publish.
    pub fn shared_rotation(&self, now: Instant) -> SharedRotation {
        self.with(|i| match &i.rotation {
            Rotation::Ready => SharedRotation {
                state: "ready".into(),
                class: None,
                back_in_ms: None,
                reason: String::new(),
            },
            Rotation::Paced { until, reason } => SharedRotation {
                state: "paced".into(),
                class: None,
                back_in_ms: Some(left(*until, now).as_millis() as u64),
                reason: reason.clone(),
            },
            Rotation::Ejected { class, until, reason } => SharedRotation {
                state: "ejected".into(),
                class: Some(class.as_str().to_owned()),
                back_in_ms: until.map(|u| left(u, now).as_millis() as u64),
                reason: reason.clone(),
            },
        })
    }

    /// R2: another instance's pace, ejection or restore of this channel, `elapsed` after
    /// it was published. A pace never shortens an ejection or a longer pace, as here.
    pub fn apply_shared_rotation(&self, r: &SharedRotation, from: &str, elapsed: Duration, now: Instant) {
        let until = r
            .back_in_ms
            .map(|ms| now + Duration::from_millis(ms).saturating_sub(elapsed));
        let reason = format!("{} (seen by instance {from})", r.reason);
        self.with(|i| match r.state.as_str() {
            "ready" => {
                if matches!(i.rotation, Rotation::Paced { .. } | Rotation::Ejected { .. }) {
                    i.rotation = Rotation::Ready;
                }
            }
            "paced" => {
                let Some(until) = until.filter(|u| *u > now) else {
                    return;
                };
                match &i.rotation {
                    Rotation::Ejected { .. } => {}
                    Rotation::Paced { until: u, .. } if *u >= until => {}
                    _ => i.rotation = Rotation::Paced { until, reason },
                }
            }
            "ejected" => {
                let class = r
                    .class
                    .as_deref()
                    .and_then(ErrorClass::parse)
                    .unwrap_or(ErrorClass::Auth);
                if until.is_none_or(|u| u > now) {
                    i.rotation = Rotation::Ejected { class, until, reason };
                }
            }
            _ => {}
        })
    }

    /// An operator put the channel back (E2: "until an owner clears it"; D5: its
    /// cool-down cut short).
    pub fn restore(&self) -> bool {
        self.with(|i| {
            let was = !matches!(i.rotation, Rotation::Ready);
            i.rotation = Rotation::Ready;
            i.room = RateLimitState::default();
            i.outlier.restore_now(Instant::now()) || was
        })
    }

    /// D4, D5: an attempt's outcome and latency. Returns an ejection it caused, or a
    /// return to rotation that time brought.
    /// `may_eject` is false for the last channel of a group in rotation (see
    /// [`Outlier::observe`]).
    pub fn observe_outcome(
        &self,
        outcome: Outcome,
        latency: Duration,
        now: Instant,
        may_eject: bool,
    ) -> Option<OutlierTransition> {
        self.with(|i| {
            let back = i.outlier.advance(now);
            i.outlier.observe(outcome, latency, now, may_eject).or(back)
        })
    }

    /// A return to rotation that time alone brought, if any (for the record).
    pub fn advance(&self, now: Instant) -> Option<OutlierTransition> {
        self.with(|i| i.outlier.advance(now))
    }

    /// D4: the factor on the channel's weight for new conversations.
    pub fn share(&self, now: Instant) -> f64 {
        self.with(|i| i.outlier.share(now))
    }

    pub fn outlier_snapshot(&self, now: Instant) -> OutlierSnapshot {
        self.with(|i| i.outlier.snapshot(now))
    }

    pub fn restore_outlier(&self, s: &OutlierSnapshot, elapsed: Duration, now: Instant) {
        self.with(|i| i.outlier = Outlier::restore(i.outlier_cfg.clone(), s, elapsed, now));
    }

    pub fn rotation(&self) -> Rotation {
        self.with(|i| i.rotation.clone())
    }

    pub fn view(&self, now: Instant) -> HealthView {
        // Expire what has run out before showing it.
        let _ = self.check(0, now);
        self.with(|i| {
            let since = now.saturating_duration_since(i.room_at);
            let live = |reset: Option<u64>| reset.is_some_and(|r| since < Duration::from_millis(r));
            let cooling = i.outlier.ejected(now);
            let (state, reason, back_in) = match &i.rotation {
                Rotation::Ready if cooling.is_some() => {
                    let (d, r) = cooling.expect("checked");
                    (RotationState::Cooling, Some(r), Some(d))
                }
                Rotation::Ready if i.outlier.recovering() => (RotationState::Recovering, None, None),
                Rotation::Ready => (RotationState::Ready, None, None),
                Rotation::Paced { until, reason } => {
                    (RotationState::Paced, Some(reason.clone()), Some(left(*until, now)))
                }
                Rotation::Ejected { until, reason, .. } => (
                    RotationState::Ejected,
                    Some(reason.clone()),
                    until.map(|u| left(u, now)),
                ),
            };
            HealthView {
                state,
                reason,
                back_in_ms: back_in.map(|d| d.as_millis() as u64),
                remaining_requests: i.room.remaining_requests.filter(|_| live(i.room.reset_requests_ms)),
                remaining_tokens: i.room.remaining_tokens.filter(|_| live(i.room.reset_tokens_ms)),
                share: i.outlier.share(now),
                latency_ms: i.outlier.latency_ms(now),
                normal_latency_ms: i.outlier.normal_ms(),
                error_rate: i.outlier.error_rate(),
                ejections: i.outlier.ejections(),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signal(class: ErrorClass, status: u16, retry_after_ms: Option<u64>) -> Signal {
        Signal {
            class,
            http_status: Some(status),
            provider_error_type: None,
            message: None,
            retry_after_ms,
            limit_dimension: None,
            visibility: spillway_wire::signal::Visibility::BeforeFirstToken,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn d6_a_wait_hint_keeps_the_channel_out_until_it_passes() {
        // spec: D6
        let h = Health::default();
        let t0 = Instant::now();
        assert!(!h.observe_failure(&signal(ErrorClass::RateLimit, 429, Some(3000)), "a", t0));
        assert!(matches!(h.check(1, t0), Err(Unavailable::For(d, _)) if d == Duration::from_secs(3)));
        assert_eq!(h.view(t0).reason.as_deref(), Some("HTTP 429 asked for a pause of 3 s"));
        tokio::time::advance(Duration::from_millis(2999)).await;
        assert!(h.check(1, Instant::now()).is_err());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(h.check(1, Instant::now()), Ok(()));
        assert_eq!(h.rotation(), Rotation::Ready);
        // A 429 without a hint does not pace: F2's back-off handles it.
        h.observe_failure(&signal(ErrorClass::RateLimit, 429, None), "a", Instant::now());
        assert_eq!(h.check(1, Instant::now()), Ok(()));
        // A shorter hint never cuts a longer pace short.
        let now = Instant::now();
        h.observe_failure(&signal(ErrorClass::Overload, 529, Some(10_000)), "a", now);
        h.observe_failure(&signal(ErrorClass::RateLimit, 429, Some(1_000)), "a", now);
        assert!(matches!(h.check(1, now), Err(Unavailable::For(d, _)) if d == Duration::from_secs(10)));
    }

    #[tokio::test(start_paused = true)]
    async fn e2_auth_ejects_until_an_operator_restores() {
        // spec: E2
        let h = Health::default();
        let now = Instant::now();
        assert!(h.observe_failure(&signal(ErrorClass::Auth, 401, None), "a", now));
        // A second failure is not a second ejection (one alert, not one per request).
        assert!(!h.observe_failure(&signal(ErrorClass::Auth, 401, None), "a", now));
        tokio::time::advance(Duration::from_secs(86_400)).await;
        assert!(matches!(h.check(1, Instant::now()), Err(Unavailable::Ejected(None, _))));
        assert!(matches!(
            h.rotation(),
            Rotation::Ejected {
                class: ErrorClass::Auth,
                until: None,
                ..
            }
        ));
        // A pace does not replace an ejection.
        h.observe_failure(&signal(ErrorClass::RateLimit, 429, Some(5)), "a", Instant::now());
        assert!(matches!(h.rotation(), Rotation::Ejected { .. }));
        assert!(h.restore());
        assert_eq!(h.check(1, Instant::now()), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn e2_quota_with_a_reset_comes_back_by_itself() {
        // spec: E2
        let h = Health::default();
        h.observe_failure(&signal(ErrorClass::Quota, 429, Some(60_000)), "a", Instant::now());
        let v = h.view(Instant::now());
        assert_eq!((v.state, v.back_in_ms), (RotationState::Ejected, Some(60_000)));
        assert!(v.reason.unwrap().contains("quota"));
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(h.check(1, Instant::now()), Ok(()));
        // Without a reset, quota waits for a person.
        h.observe_failure(&signal(ErrorClass::Quota, 429, None), "a", Instant::now());
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(h.check(1, Instant::now()).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn e3_nothing_goes_to_a_channel_without_room_for_the_estimate() {
        // spec: E3
        let h = Health::default();
        h.observe_room(
            RateLimitState {
                remaining_requests: Some(10),
                reset_requests_ms: Some(1000),
                remaining_tokens: Some(500),
                reset_tokens_ms: Some(6000),
            },
            Instant::now(),
        );
        assert_eq!(h.check(400, Instant::now()), Ok(()));
        h.reserve(400);
        // 100 tokens left by our own count: a 400-token request must wait for the window.
        assert!(matches!(h.check(400, Instant::now()), Err(Unavailable::For(d, _)) if d == Duration::from_secs(6)));
        assert_eq!(h.check(100, Instant::now()), Ok(()));
        assert_eq!(h.view(Instant::now()).remaining_tokens, Some(100));
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(h.check(400, Instant::now()), Ok(()));
        assert_eq!(
            h.view(Instant::now()).remaining_tokens,
            None,
            "a passed window shows nothing"
        );
        // No requests left in the request window.
        h.observe_room(
            RateLimitState {
                remaining_requests: Some(0),
                reset_requests_ms: Some(2000),
                ..Default::default()
            },
            Instant::now(),
        );
        assert!(h.check(1, Instant::now()).is_err());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(h.check(1, Instant::now()), Ok(()));
    }
}
