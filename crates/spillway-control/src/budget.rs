//! A route's retry budget (F4) and its amplification figures (F5).
//!
//! The budget: retries may be at most a share (20 %) of the new requests of the last ten
//! seconds, plus a small floor so that a quiet route can still retry its rare failure.
//! Over budget, a failed attempt is not retried: under a wide outage the retries would
//! otherwise take the capacity that first attempts need, and multiply the load on an
//! upstream that is already failing.
//!
//! The figures: upstream attempts ÷ logical requests (amplification) and retried requests
//! that finished well ÷ retried requests (post-retry success), over 1 min, 5 min and 1 h,
//! kept in 10 s buckets.

use serde::Serialize;
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;
use ts_rs::TS;

/// Seconds per bucket of the budget's window.
const BUDGET_BUCKET: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    requests: u64,
    retries: u64,
}

/// F4's sliding window of new requests and retries.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    min_retries: u64,
    window: Duration,
    start: Instant,
    /// (bucket index since `start`, counts), oldest first.
    buckets: VecDeque<(u64, Counts)>,
    /// R2: the other instances' counts over their windows, as last read from the fleet's
    /// Redis: the budget is the fleet's, a second behind at most.
    others: Counts,
}

impl RetryBudget {
    /// Retries ≤ `ratio` × new requests over `window`, never fewer than `min_retries`.
    pub fn new(ratio: f64, min_retries: u64, window: Duration, now: Instant) -> RetryBudget {
        RetryBudget {
            ratio,
            min_retries,
            window: window.max(BUDGET_BUCKET),
            start: now,
            buckets: VecDeque::new(),
            others: Counts::default(),
        }
    }

    fn bucket(&mut self, now: Instant) -> &mut Counts {
        let i = (now.saturating_duration_since(self.start).as_millis() / BUDGET_BUCKET.as_millis()) as u64;
        let keep = (self.window.as_millis() / BUDGET_BUCKET.as_millis()) as u64;
        while self.buckets.front().is_some_and(|(b, _)| b + keep <= i) {
            self.buckets.pop_front();
        }
        if self.buckets.back().is_none_or(|(b, _)| *b < i) {
            self.buckets.push_back((i, Counts::default()));
        }
        &mut self.buckets.back_mut().expect("just pushed").1
    }

    /// This instance's own counts over the window.
    fn own(&mut self, now: Instant) -> Counts {
        self.bucket(now);
        self.buckets.iter().fold(Counts::default(), |a, (_, c)| Counts {
            requests: a.requests + c.requests,
            retries: a.retries + c.retries,
        })
    }

    fn totals(&mut self, now: Instant) -> Counts {
        let own = self.own(now);
        Counts {
            requests: own.requests + self.others.requests,
            retries: own.retries + self.others.retries,
        }
    }

    /// R2: (new requests, retries) of this instance over the window, for the fleet.
    pub fn own_counts(&mut self, now: Instant) -> (u64, u64) {
        let c = self.own(now);
        (c.requests, c.retries)
    }

    /// R2: the other instances' (new requests, retries) over their windows.
    pub fn set_others(&mut self, requests: u64, retries: u64) {
        self.others = Counts { requests, retries };
    }

    /// A new logical request on the route.
    pub fn request(&mut self, now: Instant) {
        self.bucket(now).requests += 1;
    }

    /// Retries the window allows now.
    pub fn allowed(&mut self, now: Instant) -> u64 {
        let t = self.totals(now);
        ((t.requests as f64 * self.ratio).floor() as u64).max(self.min_retries)
    }

    /// Takes a retry from the budget if one is left.
    pub fn try_retry(&mut self, now: Instant) -> bool {
        let allowed = self.allowed(now);
        let t = self.totals(now);
        if t.retries < allowed {
            self.bucket(now).retries += 1;
            true
        } else {
            false
        }
    }

    /// (new requests, retries, retries allowed) in the window now.
    pub fn figures(&mut self, now: Instant) -> (u64, u64, u64) {
        let allowed = self.allowed(now);
        let t = self.totals(now);
        (t.requests, t.retries, allowed)
    }

    /// When the oldest bucket leaves the window (the soonest the budget can grow back).
    pub fn refill_in(&self, now: Instant) -> Duration {
        match self.buckets.front() {
            Some((b, _)) => {
                let ends = self.start + BUDGET_BUCKET * (*b as u32) + self.window;
                ends.saturating_duration_since(now).max(BUDGET_BUCKET)
            }
            None => BUDGET_BUCKET,
        }
    }
}

const AMP_BUCKET: Duration = Duration::from_secs(10);
/// Requests over 5 min below which amplification holds nothing.
const HOLD_MIN_REQUESTS: u64 = 20;
const AMP_KEEP: u64 = 360; // one hour

#[derive(Clone, Copy, Debug, Default)]
struct Amp {
    requests: u64,
    attempts: u64,
    retried: u64,
    retried_ok: u64,
}

/// One window of F5's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize, TS)]
pub struct WindowFigures {
    pub requests: u64,
    pub attempts: u64,
    /// Attempts ÷ requests; absent without requests.
    pub amplification: Option<f64>,
    /// Requests that needed more than one attempt.
    pub retried: u64,
    /// Of those, the share that ended well within their deadline; absent when none was retried.
    pub post_retry_success: Option<f64>,
}

/// F5 over the three windows the console shows.
#[derive(Clone, Debug, Default, PartialEq, Serialize, TS)]
pub struct AmplificationView {
    pub last_1m: WindowFigures,
    pub last_5m: WindowFigures,
    pub last_1h: WindowFigures,
    /// F4: amplification over 5 min is above the limit, so new low-priority work is held.
    pub holding_low_priority: bool,
}

/// F5's counts for one route.
#[derive(Debug)]
pub struct Amplification {
    start: Instant,
    buckets: VecDeque<(u64, Amp)>,
    /// F4: amplification over 5 min above which low-priority work is held.
    pub hold_above: f64,
}

impl Amplification {
    pub fn new(now: Instant) -> Amplification {
        Amplification {
            start: now,
            buckets: VecDeque::new(),
            hold_above: 1.2,
        }
    }

    fn index(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.start).as_millis() / AMP_BUCKET.as_millis()) as u64
    }

    fn bucket(&mut self, now: Instant) -> &mut Amp {
        let i = self.index(now);
        while self.buckets.front().is_some_and(|(b, _)| b + AMP_KEEP <= i) {
            self.buckets.pop_front();
        }
        if self.buckets.back().is_none_or(|(b, _)| *b < i) {
            self.buckets.push_back((i, Amp::default()));
        }
        &mut self.buckets.back_mut().expect("just pushed").1
    }

    /// A logical request ended after `attempts` upstream attempts; `ok` when it ended well
    /// within its deadline.
    pub fn finished(&mut self, attempts: u32, ok: bool, now: Instant) {
        let b = self.bucket(now);
        b.requests += 1;
        b.attempts += u64::from(attempts);
        if attempts > 1 {
            b.retried += 1;
            b.retried_ok += u64::from(ok);
        }
    }

    fn window(&self, now: Instant, span: Duration) -> WindowFigures {
        let i = self.index(now);
        let n = (span.as_millis() / AMP_BUCKET.as_millis()) as u64;
        let mut a = Amp::default();
        for (_, c) in self.buckets.iter().filter(|(b, _)| b + n > i) {
            a.requests += c.requests;
            a.attempts += c.attempts;
            a.retried += c.retried;
            a.retried_ok += c.retried_ok;
        }
        WindowFigures {
            requests: a.requests,
            attempts: a.attempts,
            amplification: (a.requests > 0).then(|| a.attempts as f64 / a.requests as f64),
            retried: a.retried,
            post_retry_success: (a.retried > 0).then(|| a.retried_ok as f64 / a.retried as f64),
        }
    }

    /// F4: whether new low-priority work is held now: amplification above the limit over
    /// 5 min, on enough requests for the figure to mean something (a route's first retry
    /// is not a storm).
    pub fn holding_low_priority(&self, now: Instant) -> bool {
        Self::holds(&self.window(now, Duration::from_secs(300)), self.hold_above)
    }

    fn holds(w: &WindowFigures, above: f64) -> bool {
        w.requests >= HOLD_MIN_REQUESTS && w.amplification.is_some_and(|a| a > above)
    }

    pub fn view(&self, now: Instant) -> AmplificationView {
        let last_5m = self.window(now, Duration::from_secs(300));
        AmplificationView {
            last_1m: self.window(now, Duration::from_secs(60)),
            holding_low_priority: Self::holds(&last_5m, self.hold_above),
            last_5m,
            last_1h: self.window(now, Duration::from_secs(3600)),
        }
    }
}
