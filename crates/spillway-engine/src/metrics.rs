//! Live figures for the console: a per-second series over the last 15 minutes (requests,
//! errors, latency, in-flight), running totals per route, and the requests refused before
//! they had a key (counted and listed, never written to the ledger one by one). Updated
//! once per request at its end, read once per second by the admin stream, so the lock is
//! short and cold. Every collection here is bounded, whatever clients send.
//!
//! Latency quantiles are exact to about 1 %: each of the newest seconds keeps an HDR
//! histogram (two significant digits, in microseconds); a second that leaves the
//! headline's 10 s window keeps only its P50 and P95, so 15 minutes of series cost a few
//! bytes a second.

use serde::Serialize;
use spillway_ledger::{RequestRecord, RequestState};
use spillway_wire::{Api, ErrorClass, Format, UnixMs};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};
use ts_rs::TS;

/// Seconds of history the overview charts show.
pub const WINDOW_SECONDS: usize = 15 * 60;
/// Distinct routes tracked one by one; a `*` channel lets clients name any model, so past
/// this many the rest share one row per provider and owner.
const MAX_ROUTES: usize = 256;
/// The model name of that shared row.
pub const OTHER_MODELS: &str = "(other models)";
/// Refusals kept for the console's list.
const RECENT_REJECTIONS: usize = 20;

/// Why a request was refused without a ledger row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    MissingKey,
    InvalidKey,
    /// A Host name the listener does not answer (P1: DNS rebinding).
    ForbiddenHost,
    /// The ledger was refusing writes: the request was answered 503 before anything else,
    /// and a row for it would only have taken room in the spool.
    LedgerUnavailable,
}

/// A request refused without a ledger row: before it had a valid key, or while the ledger
/// refused writes. Counted and listed, not recorded one by one (a flood of them must not
/// fill the disk, nor the spool of a ledger that is down).
#[derive(Clone, Debug, Serialize, TS)]
pub struct Rejection {
    pub at: UnixMs,
    pub reason: RejectReason,
    pub format: Format,
    /// The client's address.
    pub peer: Option<String>,
}

/// A route: provider (wire format), model, owner, and what its requests ask (chat,
/// Responses, embeddings, counting), whose latencies and failures are not alike.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RouteKey {
    pub format: Format,
    pub model: String,
    pub owner: String,
    pub api: Api,
}

impl RouteKey {
    pub fn of(rec: &RequestRecord, api: Api) -> Option<RouteKey> {
        Some(RouteKey {
            format: rec.format,
            model: rec.requested_model.clone()?,
            owner: rec.owner.clone().unwrap_or_default(),
            api,
        })
    }
}
type Hist = hdrhistogram::Histogram<u32>;

/// Seconds that keep their whole histogram: the headline's window and the second being
/// filled.
const LIVE_SECONDS: usize = 11;

fn hist() -> Hist {
    // 1 µs to an hour at two significant digits: about 13 KiB.
    Hist::new_with_bounds(1, 3_600_000_000, 2).expect("static bounds are valid")
}

fn quantile_ms(h: &Hist, q: f64) -> Option<f64> {
    (!h.is_empty()).then(|| h.value_at_quantile(q) as f64 / 1000.0)
}

struct Second {
    /// Unix seconds.
    t: i64,
    requests: u32,
    errors: u32,
    rejected: u32,
    /// Request latencies while the second is live; None once it is folded.
    latency: Option<Box<Hist>>,
    /// P50 and P95 (ms), once folded.
    p50_ms: Option<f64>,
    p95_ms: Option<f64>,
    in_flight_max: i64,
}

impl Second {
    fn new(t: i64) -> Second {
        Second {
            t,
            requests: 0,
            errors: 0,
            rejected: 0,
            latency: None,
            p50_ms: None,
            p95_ms: None,
            in_flight_max: 0,
        }
    }

    /// Keeps the quantiles, drops the histogram.
    fn fold(&mut self) {
        if let Some(h) = self.latency.take() {
            self.p50_ms = quantile_ms(&h, 0.5);
            self.p95_ms = quantile_ms(&h, 0.95);
        }
    }

    fn quantiles(&self) -> (Option<f64>, Option<f64>) {
        match &self.latency {
            Some(h) => (quantile_ms(h, 0.5), quantile_ms(h, 0.95)),
            None => (self.p50_ms, self.p95_ms),
        }
    }
}

/// One second of the overview series.
#[derive(Clone, Debug, Serialize, TS)]
pub struct SeriesPoint {
    /// The start of the second.
    pub at: UnixMs,
    pub requests: u32,
    pub errors: u32,
    /// Refused before they had a valid key.
    pub rejected: u32,
    /// Milliseconds; absent when the second had no finished request.
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub in_flight: i64,
}

/// Totals over the last few seconds, for the headline tiles.
#[derive(Clone, Debug, Serialize, TS)]
pub struct Headline {
    /// Averaged over the last 10 s.
    pub requests_per_s: f64,
    /// Errors ÷ finished requests over the last 60 s, 0–1; absent without traffic.
    pub error_rate: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub in_flight: i64,
    /// Requests refused before they had a valid key, over the last 60 s.
    pub rejected_last_minute: u64,
}

/// Running figures for one route (provider, model, owner, API).
#[derive(Clone, Debug, Serialize, TS)]
pub struct RouteFigures {
    pub provider: Format,
    pub model: String,
    pub owner: String,
    pub api: Api,
    pub in_flight: i64,
    /// Waiting for channel capacity right now.
    pub queued: i64,
    pub requests: u64,
    pub succeeded: u64,
    pub failed: u64,
    /// Upstream attempts; attempts ÷ requests is the retry amplification.
    pub attempts: u64,
    /// Failed attempts by E2 class.
    pub errors_by_class: BTreeMap<ErrorClass, u64>,
    /// Requests that waited for capacity or a paced channel, and how long (C2).
    pub waited: u64,
    pub wait_ms_total: u64,
    pub wait_ms_max: u64,
    /// Sum of known costs; `cost_unknown` counts requests whose cost is not known.
    pub cost_usd: f64,
    pub cost_unknown: u64,
}

impl RouteFigures {
    fn new(k: &RouteKey) -> RouteFigures {
        RouteFigures {
            provider: k.format,
            model: k.model.clone(),
            owner: k.owner.clone(),
            api: k.api,
            in_flight: 0,
            queued: 0,
            requests: 0,
            succeeded: 0,
            failed: 0,
            attempts: 0,
            errors_by_class: BTreeMap::new(),
            waited: 0,
            wait_ms_total: 0,
            wait_ms_max: 0,
            cost_usd: 0.0,
            cost_unknown: 0,
        }
    }
}

#[derive(Default)]
struct Inner {
    seconds: VecDeque<Second>,
    routes: BTreeMap<RouteKey, RouteFigures>,
    rejections: VecDeque<Rejection>,
}

#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
    in_flight: AtomicI64,
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    fn second(inner: &mut Inner, t: i64) -> &mut Second {
        if inner.seconds.back().is_none_or(|s| s.t < t) {
            inner.seconds.push_back(Second::new(t));
            while inner.seconds.len() > WINDOW_SECONDS {
                inner.seconds.pop_front();
            }
            let n = inner.seconds.len();
            if n > LIVE_SECONDS {
                inner.seconds[n - 1 - LIVE_SECONDS].fold();
            }
        }
        // A late finish for an earlier second lands in the newest one: close enough, and
        // the series stays ordered.
        inner.seconds.back_mut().expect("just pushed")
    }

    /// A request was admitted to a channel.
    pub fn started(&self, route: &RouteKey, now: UnixMs) {
        let n = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.with(|inner| {
            let s = Self::second(inner, now.0.div_euclid(1000));
            s.in_flight_max = s.in_flight_max.max(n);
            Self::route(inner, route).in_flight += 1;
        });
    }

    /// A request is waiting for capacity (`+1`) or stopped waiting (`-1`).
    pub fn queued(&self, route: &RouteKey, delta: i64) {
        self.with(|inner| Self::route(inner, route).queued += delta);
    }

    /// An attempt failed with `class` (retried or not).
    pub fn attempt_failed(&self, route: &RouteKey, class: ErrorClass) {
        self.with(|inner| {
            *Self::route(inner, route).errors_by_class.entry(class).or_default() += 1;
        });
    }

    /// A request waited `ms` for capacity before an attempt.
    pub fn waited(&self, route: &RouteKey, ms: u64) {
        self.with(|inner| {
            let r = Self::route(inner, route);
            r.waited += 1;
            r.wait_ms_total += ms;
            r.wait_ms_max = r.wait_ms_max.max(ms);
        });
    }

    /// A request refused before it had a valid key.
    pub fn rejected(&self, r: Rejection) {
        self.with(|inner| {
            Self::second(inner, r.at.0.div_euclid(1000)).rejected += 1;
            if inner.rejections.len() >= RECENT_REJECTIONS {
                inner.rejections.pop_back();
            }
            inner.rejections.push_front(r);
        });
    }

    /// The latest refusals, newest first.
    pub fn rejections(&self) -> Vec<Rejection> {
        self.with(|inner| inner.rejections.iter().cloned().collect())
    }

    /// The figures of `k`, or of its provider's shared row once [`MAX_ROUTES`] are tracked.
    fn route<'a>(inner: &'a mut Inner, k: &RouteKey) -> &'a mut RouteFigures {
        let key = if inner.routes.contains_key(k) || inner.routes.len() < MAX_ROUTES {
            k.clone()
        } else {
            RouteKey {
                model: OTHER_MODELS.to_owned(),
                ..k.clone()
            }
        };
        inner.routes.entry(key).or_insert_with_key(RouteFigures::new)
    }

    /// The row `k` was counted in: its own, or its provider's shared row when it came past
    /// [`MAX_ROUTES`]. None for a route that never started or queued.
    fn row<'a>(inner: &'a mut Inner, k: &RouteKey) -> Option<&'a mut RouteFigures> {
        if inner.routes.contains_key(k) {
            return inner.routes.get_mut(k);
        }
        let other = RouteKey {
            model: OTHER_MODELS.to_owned(),
            ..k.clone()
        };
        inner.routes.get_mut(&other)
    }

    /// A request of `route` ended. `admitted` says whether [`Metrics::started`] saw it.
    pub fn finished(&self, rec: &RequestRecord, route: Option<&RouteKey>, admitted: bool, now: UnixMs) {
        if admitted {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        let ok = rec.state == RequestState::Done;
        let latency = now.since(rec.received_at);
        self.with(|inner| {
            let s = Self::second(inner, now.0.div_euclid(1000));
            s.requests += 1;
            if !ok {
                s.errors += 1;
            }
            s.latency
                .get_or_insert_with(|| Box::new(hist()))
                .saturating_record(latency.saturating_mul(1000).max(1));
            // Only routes a request reached a channel of (or queued for) have a row: a
            // refused request naming a model nobody serves adds none.
            if let Some(r) = route.and_then(|k| Self::row(inner, k)) {
                if admitted {
                    r.in_flight -= 1;
                }
                r.requests += 1;
                r.attempts += u64::from(rec.attempts);
                if ok {
                    r.succeeded += 1;
                } else {
                    r.failed += 1;
                }
                match rec.cost_usd {
                    Some(c) => r.cost_usd += c,
                    None => r.cost_unknown += 1,
                }
            }
        });
    }

    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The series from `since` (unix seconds) up to `now`, one point per second, gaps
    /// filled with zero traffic.
    pub fn series(&self, since: i64, now: i64) -> Vec<SeriesPoint> {
        let in_flight = self.in_flight();
        self.with(|inner| {
            let mut out = Vec::new();
            let mut it = inner.seconds.iter().peekable();
            for t in since.max(now - WINDOW_SECONDS as i64 + 1)..=now {
                while it.peek().is_some_and(|s| s.t < t) {
                    it.next();
                }
                match it.peek() {
                    Some(s) if s.t == t => out.push(SeriesPoint {
                        at: UnixMs(t * 1000),
                        requests: s.requests,
                        errors: s.errors,
                        rejected: s.rejected,
                        p50_ms: s.quantiles().0,
                        p95_ms: s.quantiles().1,
                        in_flight: if t == now { in_flight } else { s.in_flight_max },
                    }),
                    _ => out.push(SeriesPoint {
                        at: UnixMs(t * 1000),
                        requests: 0,
                        errors: 0,
                        rejected: 0,
                        p50_ms: None,
                        p95_ms: None,
                        in_flight: if t == now { in_flight } else { 0 },
                    }),
                }
            }
            out
        })
    }

    pub fn headline(&self, now: i64) -> Headline {
        let in_flight = self.in_flight();
        self.with(|inner| {
            let mut merged = hist();
            let (mut req10, mut req60, mut err60, mut rej60) = (0u64, 0u64, 0u64, 0u64);
            for s in inner.seconds.iter().filter(|s| s.t > now - 60) {
                req60 += u64::from(s.requests);
                err60 += u64::from(s.errors);
                rej60 += u64::from(s.rejected);
                if s.t > now - 10 {
                    req10 += u64::from(s.requests);
                    if let Some(h) = &s.latency {
                        // Same bounds and precision: adding cannot fail.
                        let _ = merged.add(&**h);
                    }
                }
            }
            Headline {
                requests_per_s: req10 as f64 / 10.0,
                // Errors can never exceed requests: both count the same finished requests.
                error_rate: (req60 > 0).then(|| err60 as f64 / req60 as f64),
                p50_ms: quantile_ms(&merged, 0.5),
                p95_ms: quantile_ms(&merged, 0.95),
                in_flight,
                rejected_last_minute: rej60,
            }
        })
    }

    pub fn routes(&self) -> Vec<RouteFigures> {
        self.with(|inner| inner.routes.values().cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(model: &str, state: RequestState, received_ms: i64) -> RequestRecord {
        let mut r = RequestRecord::received(
            "id".into(),
            "t".into(),
            Format::OpenAi,
            "/v1/chat/completions",
            UnixMs(received_ms),
        );
        r.requested_model = Some(model.into());
        r.owner = Some("team-a".into());
        r.state = state;
        r.attempts = 1;
        r
    }

    #[test]
    fn series_and_routes() {
        let m = Metrics::default();
        let base = 1_000_000_000;
        for i in 0..10 {
            let r = rec(
                "m",
                if i == 9 {
                    RequestState::Failed
                } else {
                    RequestState::Done
                },
                base * 1000 + i * 10,
            );
            let k = RouteKey::of(&r, Api::Generate).unwrap();
            m.started(&k, r.received_at);
            m.finished(&r, Some(&k), true, UnixMs(base * 1000 + i * 10 + 100));
        }
        let s = m.series(base - 2, base + 1);
        assert_eq!(s.len(), 4);
        assert_eq!((s[2].requests, s[2].errors), (10, 1));
        assert!((90.0..=120.0).contains(&s[2].p50_ms.unwrap()), "{:?}", s[2].p50_ms);
        assert_eq!(s[3].requests, 0);
        let h = m.headline(base + 1);
        assert_eq!(h.requests_per_s, 1.0);
        assert_eq!(h.error_rate, Some(0.1));
        assert_eq!(h.in_flight, 0);
        let r = &m.routes()[0];
        assert_eq!(
            (r.requests, r.succeeded, r.failed, r.in_flight, r.cost_unknown),
            (10, 9, 1, 0, 10)
        );
    }

    #[test]
    fn client_named_models_cannot_grow_the_route_table() {
        let m = Metrics::default();
        for i in 0..10_000 {
            let r = rec(&format!("model-{i}"), RequestState::Done, 1_000);
            let k = RouteKey::of(&r, Api::Generate).unwrap();
            m.started(&k, r.received_at);
            m.finished(&r, Some(&k), true, UnixMs(2_000));
        }
        let routes = m.routes();
        assert_eq!(routes.len(), MAX_ROUTES + 1);
        let other = routes.iter().find(|r| r.model == OTHER_MODELS).unwrap();
        assert_eq!((other.requests, other.in_flight), (10_000 - MAX_ROUTES as u64, 0));
        assert_eq!(m.in_flight(), 0);
        for i in 0..100 {
            m.rejected(Rejection {
                at: UnixMs(1_000 + i),
                reason: RejectReason::InvalidKey,
                format: Format::OpenAi,
                peer: None,
            });
        }
        let r = m.rejections();
        assert_eq!((r.len(), r[0].at), (RECENT_REJECTIONS, UnixMs(1_099)));
        assert_eq!(m.headline(1).rejected_last_minute, 100);
    }

    #[test]
    fn no_traffic_is_not_an_error() {
        let m = Metrics::default();
        let h = m.headline(5);
        assert_eq!(h.error_rate, None);
        assert_eq!(h.p50_ms, None);
        assert_eq!(m.series(0, 5).len(), 6);
    }

    #[test]
    fn n1_latency_quantiles_are_exact_to_one_percent_and_old_seconds_fold() {
        // spec: N1
        let m = Metrics::default();
        let base = 1_000_000_000i64;
        // 100 requests in one second at 1..=100 ms, then 20 quiet seconds with one each.
        for i in 1..=100 {
            let mut r = rec("m", RequestState::Done, base * 1000);
            r.received_at = UnixMs(base * 1000 - i);
            m.finished(&r, None, false, UnixMs(base * 1000));
        }
        let h = m.headline(base);
        let (p50, p95) = (h.p50_ms.unwrap(), h.p95_ms.unwrap());
        assert!((50.0..=50.5).contains(&p50), "p50 {p50}");
        assert!((95.0..=96.0).contains(&p95), "p95 {p95}");
        for t in 1..=20 {
            let r = rec("m", RequestState::Done, (base + t) * 1000 - 7);
            m.finished(&r, None, false, UnixMs((base + t) * 1000));
        }
        // The first second left the live window: its quantiles stay, its histogram went.
        let first = m.with(|i| {
            (
                i.seconds[0].latency.is_none(),
                i.seconds.iter().filter(|s| s.latency.is_some()).count(),
            )
        });
        assert_eq!(first, (true, LIVE_SECONDS));
        let s = m.series(base, base);
        assert_eq!((s[0].p50_ms, s[0].p95_ms), (Some(p50), Some(p95)));
        assert_eq!(m.headline(base + 20).p95_ms.map(|v| v.round()), Some(7.0));
    }
}
