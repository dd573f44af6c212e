//! `GET /metrics` (N1, N4): the gateway's figures in Prometheus text, through the
//! `metrics` crate and its Prometheus exporter. Latency, queue-wait and TTFT histograms
//! are recorded as requests end; counters and gauges are read from the live figures, the
//! breakers and the channels when scraped, so the request path pays for three histogram
//! samples and nothing else. Every label is bounded: routes are the control plane's
//! (at most 256 per format plus one shared row), owners and channels come from the config,
//! classes and states from enums.

use crate::state::AppState;
use metrics::{Label, Level, Metadata};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use spillway_control::BreakerState;
use std::time::Duration;

/// Histogram buckets in seconds: 1 ms to 2 min.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
];

/// One route's request, queue-wait and TTFT histograms.
pub struct RouteHistograms {
    total: metrics::Histogram,
    wait: metrics::Histogram,
    ttft: metrics::Histogram,
}

impl RouteHistograms {
    /// A finished request: its duration, its capacity wait and, for a stream, its time to
    /// first token.
    pub fn record(&self, total: Duration, wait: Option<Duration>, ttft: Option<Duration>) {
        self.total.record(total.as_secs_f64());
        self.wait.record(wait.unwrap_or_default().as_secs_f64());
        if let Some(t) = ttft {
            self.ttft.record(t.as_secs_f64());
        }
    }
}

/// The gateway's own recorder (never the process-global one: several gateways may share a
/// process, as the tests and the desktop shell do).
pub struct Prom {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
}

impl Default for Prom {
    fn default() -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
            .expect("the bucket list is not empty")
            .build_recorder();
        let handle = recorder.handle();
        Prom { recorder, handle }
    }
}

static META: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

impl Prom {
    fn with<R>(&self, f: impl FnOnce(&dyn metrics::Recorder) -> R) -> R {
        f(&self.recorder)
    }

    /// A route's histograms, registered once: a request then records into them without a
    /// registry lookup.
    pub fn route_histograms(&self, route: &str) -> RouteHistograms {
        self.with(|r| {
            let key = |name: &'static str| metrics::Key::from_parts(name, vec![Label::new("route", route.to_owned())]);
            RouteHistograms {
                total: r.register_histogram(&key("spillway_request_duration_seconds"), &META),
                wait: r.register_histogram(&key("spillway_queue_wait_seconds"), &META),
                ttft: r.register_histogram(&key("spillway_time_to_first_token_seconds"), &META),
            }
        })
    }

    /// Folds the histograms' raw samples into their buckets. The exporter keeps every
    /// sample until then, so without a scraper (or between scrapes) this is what bounds
    /// its memory.
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }

    /// The exposition, with counters and gauges read from the gateway now.
    pub fn render(&self, st: &AppState) -> String {
        self.with(|r| {
            let key = |name: &'static str, labels: &[(&'static str, String)]| {
                metrics::Key::from_parts(
                    name,
                    labels
                        .iter()
                        .map(|(k, v)| Label::new(*k, v.clone()))
                        .collect::<Vec<_>>(),
                )
            };
            let counter = |name, labels: &[(&'static str, String)], v: u64| {
                r.register_counter(&key(name, labels), &META).absolute(v)
            };
            let gauge =
                |name, labels: &[(&'static str, String)], v: f64| r.register_gauge(&key(name, labels), &META).set(v);

            for f in st.metrics.routes() {
                let l = [
                    ("route", format!("{}/{}", f.provider, f.model)),
                    ("owner", f.owner.clone()),
                    ("api", f.api.as_str().to_owned()),
                ];
                counter("spillway_requests_total", &l, f.requests);
                counter("spillway_requests_succeeded_total", &l, f.succeeded);
                counter("spillway_requests_failed_total", &l, f.failed);
                counter("spillway_attempts_total", &l, f.attempts);
                gauge("spillway_requests_in_flight", &l, f.in_flight as f64);
                gauge("spillway_requests_queued", &l, f.queued as f64);
                gauge("spillway_cost_usd", &l, f.cost_usd);
                counter("spillway_requests_cost_unknown_total", &l, f.cost_unknown);
                for (class, n) in &f.errors_by_class {
                    let l = [
                        l[0].clone(),
                        l[1].clone(),
                        l[2].clone(),
                        ("class", class.as_str().to_owned()),
                    ];
                    counter("spillway_attempt_failures_total", &l, *n);
                }
            }
            for v in st.control.views(st) {
                let route = || ("route", v.route.clone());
                for (state, name) in [
                    (BreakerState::Closed, "closed"),
                    (BreakerState::Open, "open"),
                    (BreakerState::Probation, "probation"),
                ] {
                    let l = [route(), ("state", name.to_owned())];
                    gauge(
                        "spillway_breaker_state",
                        &l,
                        f64::from(u8::from(v.breaker.state == state)),
                    );
                }
                let b = &v.breaker;
                gauge(
                    "spillway_breaker_recent_failures",
                    &[route()],
                    f64::from(b.recent_failures),
                );
                gauge("spillway_breaker_reopened", &[route()], f64::from(b.reopened));
                gauge("spillway_retry_budget_allowed", &[route()], v.budget_allowed as f64);
                gauge("spillway_retry_budget_used", &[route()], v.budget_retries as f64);
                let a = &v.amplification;
                for (w, f) in [("1m", &a.last_1m), ("5m", &a.last_5m), ("1h", &a.last_1h)] {
                    let l = [route(), ("window", w.to_owned())];
                    if let Some(x) = f.amplification {
                        gauge("spillway_retry_amplification", &l, x);
                    }
                    if let Some(x) = f.post_retry_success {
                        gauge("spillway_post_retry_success_ratio", &l, x);
                    }
                }
                gauge(
                    "spillway_holding_low_priority",
                    &[route()],
                    f64::from(u8::from(a.holding_low_priority)),
                );
            }
            let now = tokio::time::Instant::now();
            for c in &st.channels {
                let h = c.health.view(now);
                let name = || ("channel", c.cfg.name.clone());
                let state = serde_json::to_value(h.state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default();
                for s in ["ready", "paced", "ejected", "cooling", "recovering"] {
                    let l = [name(), ("state", s.to_owned())];
                    gauge("spillway_channel_state", &l, f64::from(u8::from(state == s)));
                }
                gauge("spillway_channel_share", &[name()], h.share);
                gauge("spillway_channel_error_rate", &[name()], h.error_rate);
                gauge("spillway_channel_ejections", &[name()], f64::from(h.ejections));
                gauge("spillway_channel_in_flight", &[name()], f64::from(c.in_flight()));
                if let Some(l) = h.latency_ms {
                    gauge("spillway_channel_latency_seconds", &[name()], l / 1000.0);
                }
            }
            gauge(
                "spillway_capacity_queue_depth",
                &[],
                f64::from(st.capacity_queue.load(std::sync::atomic::Ordering::Relaxed)),
            );
            gauge(
                "spillway_ledger_healthy",
                &[],
                f64::from(u8::from(st.ledger.is_healthy())),
            );
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                // The threads serving requests (`--workers`), for an operator sizing a host.
                gauge("spillway_runtime_workers", &[], rt.metrics().num_workers() as f64);
            }
        });
        let mut out = self.handle.render();
        ledger_commits(&mut out, &st.ledger.commit_histogram());
        out
    }
}

/// The ledger's commit times, written out by hand: the writer counts them itself (the
/// ledger crate records no metrics), into fixed sub-millisecond buckets a disk's sync
/// needs.
fn ledger_commits(out: &mut String, h: &spillway_ledger::CommitHistogram) {
    use std::fmt::Write;
    const NAME: &str = "spillway_ledger_commit_seconds";
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "# HELP {NAME} How long each successful synced ledger commit took (durable writes wait for theirs; rows no request waits on are committed apart without a sync and not counted; a failing store shows in spillway_ledger_healthy).\n# TYPE {NAME} histogram"
    );
    for (le, n) in &h.cumulative {
        let le = if le.is_infinite() {
            "+Inf".to_owned()
        } else {
            le.to_string()
        };
        let _ = writeln!(out, "{NAME}_bucket{{le=\"{le}\"}} {n}");
    }
    let _ = writeln!(out, "{NAME}_sum {}\n{NAME}_count {}", h.sum_seconds, h.count);
}
