//! Choosing a channel (A4) and taking a slot of its capacity (C1, C2), among the channels
//! that are in rotation and have room for the request (D5, D6, E2, E3), new conversations
//! spread by weight and health and later turns kept on their channel (D4).

use crate::error::GatewayError;
use crate::health::Unavailable;
use crate::state::{AppState, ChannelRt};
use rand::Rng;
use spillway_wire::Format;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

/// Channels that speak `format` and serve `model` (A4, D1: together they are the
/// request's channel group): the highest priority tier first and, within it, the channel
/// `pinned` (the conversation's, D4) first while it is in rotation, then a random order
/// weighted by each channel's configured weight times its health share (D4: latency above
/// its normal and recent errors lower it; a channel back from a cool-down ramps up, D5).
pub fn candidates(state: &AppState, format: Format, model: &str, pinned: Option<&str>) -> Vec<Arc<ChannelRt>> {
    let mut rng = rand::rng();
    let now = Instant::now();
    let mut c: Vec<(bool, i32, f64, &Arc<ChannelRt>)> = state
        .channels
        .iter()
        .filter(|c| c.cfg.format == format && c.cfg.serves(model))
        // Efraimidis–Spirakis: sorting by u^(1/w) draws a weighted order without replacement.
        .map(|c| {
            let w = f64::from(c.cfg.weight.max(1)) * c.health.share(now);
            let key = rng.random::<f64>().powf(1.0 / w.max(1e-6));
            let pin = pinned.is_some_and(|p| *p == *c.cfg.name) && c.health.check(0, now).is_ok();
            (pin, c.cfg.priority, key, c)
        })
        .collect();
    // Priority first: a conversation pinned to a fallback tier goes back to the primary
    // tier once it has a channel again (the operator's order outranks stickiness).
    c.sort_by(|a, b| b.1.cmp(&a.1).then(b.0.cmp(&a.0)).then(b.2.total_cmp(&a.2)));
    c.into_iter().map(|(_, _, _, c)| c.clone()).collect()
}

/// Held while a request waits for capacity; its drop ends the wait, however it ends
/// (admitted, timed out, or the client went away).
pub struct WaitGuard(pub Option<Box<dyn FnOnce() + Send>>);

impl WaitGuard {
    /// Takes a place in the gateway's capacity queue (C2) and counts the request as queued
    /// on its route until the guard drops; refuses at once when the queue is at its
    /// maximum length.
    pub fn queued(st: &Arc<AppState>, route: crate::metrics::RouteKey) -> Result<WaitGuard, GatewayError> {
        use std::sync::atomic::Ordering;
        let max = st.config.capacity_queue_max;
        let taken = st
            .capacity_queue
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1));
        if taken.is_err() {
            return Err(GatewayError::CapacityQueueFull { retry_after_s: 1 });
        }
        st.metrics.queued(&route, 1);
        let st = st.clone();
        Ok(WaitGuard(Some(Box::new(move || {
            st.capacity_queue.fetch_sub(1, Ordering::AcqRel);
            st.metrics.queued(&route, -1);
        }))))
    }
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// A slot on a channel, held until the upstream call (and its stream) ends.
pub struct Admitted {
    pub channel: Arc<ChannelRt>,
    pub permit: OwnedSemaphorePermit,
    /// Time spent waiting for capacity or for a paced channel, when there was a wait.
    pub waited: Option<Duration>,
}

/// Where the group stands for a request right now.
pub struct Survey {
    /// In rotation with room for the request: untried channels first, each part in the
    /// group's weighted order.
    pub ready: Vec<Arc<ChannelRt>>,
    /// Whether any ready channel has not been tried by this request.
    pub untried_ready: bool,
    /// The soonest a paced channel (or a quota with a named reset) takes work again.
    pub soonest: Option<Duration>,
    /// Channels out until an operator restores them, with the reason.
    pub ejected: Vec<(String, String)>,
    /// D5: the soonest a cooling channel is back, and each cooling channel's reason.
    pub cooling: Option<Duration>,
    pub cooling_reasons: Vec<(String, String)>,
}

pub fn survey(candidates: &[Arc<ChannelRt>], tokens: u64, tried: &[String], now: Instant) -> Survey {
    let mut untried = Vec::new();
    let mut again = Vec::new();
    let mut soonest: Option<Duration> = None;
    let mut ejected = Vec::new();
    let mut cooling: Option<Duration> = None;
    let mut cooling_reasons = Vec::new();
    for c in candidates {
        match c.health.check(tokens, now) {
            Ok(()) if tried.contains(&c.cfg.name) => again.push(c.clone()),
            Ok(()) => untried.push(c.clone()),
            Err(Unavailable::For(d, _)) | Err(Unavailable::Ejected(Some(d), _)) => {
                soonest = Some(soonest.map_or(d, |s| s.min(d)));
            }
            Err(Unavailable::Ejected(None, reason)) => ejected.push((c.cfg.name.clone(), reason)),
            Err(Unavailable::Cooling(d, reason)) => {
                cooling = Some(cooling.map_or(d, |s| s.min(d)));
                cooling_reasons.push((c.cfg.name.clone(), reason));
            }
        }
    }
    let untried_ready = !untried.is_empty();
    untried.extend(again);
    Survey {
        ready: untried,
        untried_ready,
        soonest,
        ejected,
        cooling,
        cooling_reasons,
    }
}

/// Why no slot was taken.
fn none_left(s: &Survey) -> GatewayError {
    if let Some(d) = s.cooling {
        // D5: the channels come back by themselves; say when, and fail fast meanwhile.
        return GatewayError::ChannelsCoolingDown {
            detail: s
                .cooling_reasons
                .iter()
                .map(|(n, r)| format!("`{n}`: {r}"))
                .collect::<Vec<_>>()
                .join("; "),
            retry_after_s: crate::error::retry_after_secs(d),
        };
    }
    GatewayError::NoChannelInRotation {
        detail: s
            .ejected
            .iter()
            .map(|(n, r)| format!("`{n}`: {r}"))
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// Takes a free slot on the first ready channel that has one (untried channels first).
/// When every ready channel is full, or every channel is paced, waits — at most
/// `max_wait` in all — for whichever frees first (C1, C2, D6); `on_wait` takes the
/// request's place in the queue, or refuses it when the queue is full. Dropping the
/// future leaves the queue (C4).
pub async fn admit(
    candidates: &[Arc<ChannelRt>],
    tokens: u64,
    tried: &[String],
    max_wait: Duration,
    on_wait: impl FnOnce() -> Result<WaitGuard, GatewayError>,
) -> Result<Admitted, GatewayError> {
    let started = Instant::now();
    let deadline = started + max_wait;
    let mut on_wait = Some(on_wait);
    let mut waiting: Option<WaitGuard> = None;
    // Each round either admits, fails, or sleeps until something changes; a handful of
    // rounds covers other requests taking a freed slot first.
    for _ in 0..32 {
        let now = Instant::now();
        let s = survey(candidates, tokens, tried, now);
        for c in &s.ready {
            if let Ok(permit) = c.permits.clone().try_acquire_owned() {
                c.health.reserve(tokens);
                return Ok(Admitted {
                    channel: c.clone(),
                    permit,
                    waited: waiting.is_some().then(|| started.elapsed()),
                });
            }
        }
        if s.ready.is_empty() && s.soonest.is_none() {
            return Err(none_left(&s));
        }
        let left = deadline.saturating_duration_since(now);
        // Nothing frees within the wait: say when something will, if anyone knows.
        if (s.ready.is_empty() && s.soonest.is_some_and(|d| d > left)) || left.is_zero() {
            // Full slots free as calls end (a second is an honest guess); a pace ends when
            // its provider said.
            let retry_after = match (s.ready.is_empty(), s.soonest) {
                (true, Some(d)) => d,
                _ => Duration::from_secs(1),
            };
            return Err(GatewayError::CapacityBusy {
                retry_after_s: crate::error::retry_after_secs(retry_after),
            });
        }
        if waiting.is_none()
            && let Some(f) = on_wait.take()
        {
            waiting = Some(f()?);
        }
        let wake = now + s.soonest.map_or(left, |d| d.min(left));
        let waits = s.ready.iter().map(|c| {
            let c = c.clone();
            Box::pin(async move { c.permits.clone().acquire_owned().await.map(|p| (c, p)) })
        });
        if s.ready.is_empty() {
            tokio::time::sleep_until(wake).await;
            continue;
        }
        if let Ok(Ok(((channel, permit), _))) =
            tokio::time::timeout_at(wake, futures_util::future::select_ok(waits)).await
        {
            // The slot was free; the channel may have been paced meanwhile.
            if channel.health.check(tokens, Instant::now()).is_ok() {
                channel.health.reserve(tokens);
                return Ok(Admitted {
                    channel,
                    permit,
                    waited: Some(started.elapsed()),
                });
            }
        }
    }
    Err(GatewayError::CapacityBusy { retry_after_s: 1 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::ChannelRt;
    use spillway_policy::Channel;
    use spillway_wire::{ErrorClass, Signal};

    fn channel(name: &str, cap: u32) -> Arc<ChannelRt> {
        Arc::new(ChannelRt::new(Channel {
            name: name.into(),
            format: Format::OpenAi,
            base_url: "http://127.0.0.1:9".into(),
            api_key: None,
            models: vec!["*".into()],
            max_concurrency: cap,
            weight: 1,
            priority: 0,
            timeout_ms: None,
            simulated: None,
            region: None,
        }))
    }

    fn no_wait() -> Result<WaitGuard, GatewayError> {
        Ok(WaitGuard(None))
    }

    /// `admit` with C2's 10 s allowance, and how long it took on the paused clock.
    async fn timed(group: &[Arc<ChannelRt>], tried: &[String]) -> (Result<Admitted, GatewayError>, Duration) {
        let t = Instant::now();
        let r = admit(group, 1, tried, Duration::from_secs(10), no_wait).await;
        (r, t.elapsed())
    }

    fn admitted(r: Result<Admitted, GatewayError>) -> Admitted {
        r.unwrap_or_else(|e| panic!("not admitted: {e:?}"))
    }

    /// The `retry-after` of a capacity refusal.
    fn busy(r: Result<Admitted, GatewayError>) -> u64 {
        match r {
            Err(GatewayError::CapacityBusy { retry_after_s }) => retry_after_s,
            Err(e) => panic!("expected CapacityBusy, got {e:?}"),
            Ok(a) => panic!("expected CapacityBusy, admitted on {}", a.channel.cfg.name),
        }
    }

    /// Feeds the channel a failure: `status` with an optional wait hint.
    fn fail(c: &ChannelRt, class: ErrorClass, status: u16, retry_after_ms: Option<u64>) {
        let mut s = Signal::transport(class, status.to_string());
        s.http_status = Some(status);
        s.retry_after_ms = retry_after_ms;
        c.health.observe_failure(&s, &c.cfg.name, Instant::now());
    }

    fn paced(c: &ChannelRt, ms: u64) {
        fail(c, ErrorClass::RateLimit, 429, Some(ms));
    }

    #[tokio::test(start_paused = true)]
    async fn c1_a_full_channel_sends_the_request_to_the_next() {
        // spec: C1
        let (a, b) = (channel("a", 1), channel("b", 1));
        let group = [a.clone(), b.clone()];
        let first = admitted(timed(&group, &[]).await.0);
        assert_eq!(first.channel.cfg.name, "a");
        let second = admitted(timed(&group, &[]).await.0);
        assert_eq!(second.channel.cfg.name, "b");
        assert!(second.waited.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn c2_waits_for_the_first_slot_to_free_then_gives_up() {
        // spec: C2
        let a = channel("a", 1);
        let group = [a.clone()];
        let held = admitted(timed(&group, &[]).await.0);
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            drop(held);
        });
        let (r, took) = timed(&group, &[]).await;
        let waited = admitted(r);
        assert_eq!(waited.waited, Some(Duration::from_secs(3)));
        assert_eq!(took, Duration::from_secs(3));
        release.await.unwrap();
        // Nothing frees within the allowance: 429 after exactly the allowance.
        let (r, took) = timed(&group, &[]).await;
        assert_eq!((busy(r), took), (1, Duration::from_secs(10)));
        drop(waited);
    }

    #[tokio::test(start_paused = true)]
    async fn d6_a_paced_group_is_waited_for_when_the_hint_fits() {
        // spec: D6, C2, F1
        let a = channel("a", 4);
        paced(&a, 2_500);
        let group = [a.clone()];
        let (r, took) = timed(&group, &[]).await;
        assert_eq!(took, Duration::from_millis(2_500));
        assert_eq!(admitted(r).waited, Some(Duration::from_millis(2_500)));
        // A hint past the allowance is refused at once, naming the hint.
        paced(&a, 30_000);
        let (r, took) = timed(&group, &[]).await;
        assert_eq!((busy(r), took), (30, Duration::ZERO));
    }

    #[tokio::test(start_paused = true)]
    async fn d1_untried_channels_come_first() {
        // spec: D1
        let (a, b) = (channel("a", 4), channel("b", 4));
        let group = [a.clone(), b.clone()];
        let got = admitted(timed(&group, &["a".to_owned()]).await.0);
        assert_eq!(got.channel.cfg.name, "b");
        let s = survey(&group, 1, &["a".to_owned(), "b".to_owned()], Instant::now());
        assert!(!s.untried_ready);
        assert_eq!(
            s.ready.len(),
            2,
            "tried channels may be retried when nothing else is left"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn c2_a_full_queue_refuses_at_once() {
        // spec: C2
        let a = channel("a", 1);
        let group = [a.clone()];
        let _held = admitted(timed(&group, &[]).await.0);
        let t = Instant::now();
        let r = admit(&group, 1, &[], Duration::from_secs(10), || {
            Err(GatewayError::CapacityQueueFull { retry_after_s: 1 })
        })
        .await;
        assert!(
            matches!(r, Err(GatewayError::CapacityQueueFull { .. })),
            "{r:?}",
            r = r.as_ref().err()
        );
        assert_eq!(t.elapsed(), Duration::ZERO, "no wait when there is no room to wait");
    }

    #[tokio::test(start_paused = true)]
    async fn e2_an_ejected_group_has_no_channel_left() {
        // spec: E2
        let a = channel("a", 4);
        fail(&a, ErrorClass::Auth, 401, None);
        match timed(&[a], &[]).await.0 {
            Err(GatewayError::NoChannelInRotation { detail, .. }) => assert!(detail.contains("credential"), "{detail}"),
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("admitted to an ejected channel"),
        }
    }
}
