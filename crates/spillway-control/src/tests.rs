//! Every state machine on tokio's paused clock: thresholds at their exact edge.

use crate::Outcome;
use crate::breaker::*;
use crate::budget::*;
use crate::outlier::*;
use std::time::Duration;
use tokio::time::{Instant, advance};

const MS: Duration = Duration::from_millis(1);

fn breaker() -> Breaker {
    Breaker::new(BreakerConfig::default(), Instant::now())
}

/// Feeds `fails` provider failures among `total` attempts, failures spread evenly.
fn feed(b: &mut Breaker, total: usize, fails: usize) -> Option<Transition> {
    let mut t = None;
    for i in 0..total {
        let failed = i * fails / total != (i + 1) * fails / total;
        let o = if failed {
            Outcome::ProviderFailure
        } else {
            Outcome::Success
        };
        if let Some(x) = b.on_attempt(o, 100 * MS, Instant::now()) {
            t = Some(x);
        }
    }
    t
}

#[tokio::test(start_paused = true)]
async fn g1_24_of_50_failures_stay_closed_25_open() {
    // spec: G1
    let mut b = breaker();
    assert_eq!(feed(&mut b, 50, 24), None);
    assert_eq!(b.state(), BreakerState::Closed);
    assert_eq!(b.view(Instant::now()).recent_failures, 24);
    // The window slides: one more failure replacing a success makes 25 of the last 50.
    let mut b = breaker();
    feed(&mut b, 50, 24);
    let t = b
        .on_attempt(Outcome::ProviderFailure, MS, Instant::now())
        .expect("opens");
    assert_eq!(
        (t.from, t.to, t.trigger),
        (BreakerState::Closed, BreakerState::Open, Trigger::ServerErrors)
    );
    assert!(
        t.reason.starts_with("25 of the last 50 attempts failed"),
        "{}",
        t.reason
    );
    assert_eq!(t.figures[0].value, 25.0);
    // Open: nothing goes out, and the refusal says when the first probe is.
    match b.admit(Instant::now()).0 {
        Admission::Refuse { retry_after, .. } => assert_eq!(retry_after, Duration::from_secs(30)),
        a => panic!("{a:?}"),
    }
    // 429s and client errors are not provider failures.
    let mut b = breaker();
    for _ in 0..50 {
        b.on_attempt(Outcome::Neutral, MS, Instant::now());
    }
    assert_eq!(b.state(), BreakerState::Closed);
}

#[tokio::test(start_paused = true)]
async fn g1_429s_for_2_59_stay_closed_3_00_opens() {
    // spec: G1
    let mut b = breaker();
    for _ in 0..179 {
        assert_eq!(b.on_attempt(Outcome::RateLimited, MS, Instant::now()), None);
        advance(Duration::from_secs(1)).await;
    }
    // 2:59 of 429s.
    assert_eq!(b.on_attempt(Outcome::RateLimited, MS, Instant::now()), None);
    assert_eq!(b.view(Instant::now()).rate_limited_for_ms, Some(179_000));
    advance(Duration::from_secs(1)).await;
    let t = b
        .on_attempt(Outcome::RateLimited, MS, Instant::now())
        .expect("3:00 opens");
    assert_eq!(t.trigger, Trigger::RateLimited);
    // One success breaks the run.
    let mut b = breaker();
    b.on_attempt(Outcome::RateLimited, MS, Instant::now());
    advance(Duration::from_secs(120)).await;
    b.on_attempt(Outcome::Success, MS, Instant::now());
    advance(Duration::from_secs(60)).await;
    assert_eq!(b.on_attempt(Outcome::RateLimited, MS, Instant::now()), None);
}

#[tokio::test(start_paused = true)]
async fn g1_p95_wait_above_80_percent_of_the_slo_opens() {
    // spec: G1
    let mut b = breaker();
    b.set_wait_slo(Some(Duration::from_millis(1000)));
    // 19 slow waits: too few samples to judge.
    for _ in 0..19 {
        assert_eq!(b.on_wait(900 * MS, Instant::now()), None);
    }
    // 100 waits whose P95 is exactly 800 ms (80 %): not above, stays closed.
    let mut b = breaker();
    b.set_wait_slo(Some(Duration::from_millis(1000)));
    for i in 0..100u64 {
        let w = if i < 95 { 10 * MS } else { 800 * MS };
        let w = if i == 94 { 800 * MS } else { w };
        assert_eq!(b.on_wait(w, Instant::now()), None, "wait {i}");
    }
    let t = b.on_wait(801 * MS, Instant::now());
    assert!(t.is_none(), "one more slow wait moves the P95 only when it is the 95th");
    for _ in 0..5 {
        if let Some(t) = b.on_wait(900 * MS, Instant::now()) {
            assert_eq!(t.trigger, Trigger::SlowWait);
            assert!(t.reason.contains("1000 ms SLO"), "{}", t.reason);
            return;
        }
    }
    panic!("P95 above 800 ms did not open");
}

#[tokio::test(start_paused = true)]
async fn g1_cost_above_a_quarter_of_the_daily_budget_opens() {
    // spec: G1
    let mut b = breaker();
    assert_eq!(b.on_cost(25.0, 100.0, Instant::now()), None);
    assert_eq!(b.on_cost(25.01, 100.0, Instant::now()).unwrap().trigger, Trigger::Cost);
}

#[tokio::test(start_paused = true)]
async fn g1_g3_a_cost_opened_breaker_waits_for_its_hour_to_cool_before_probation() {
    // spec: G1, G3
    let mut b = breaker();
    b.on_cost(30.0, 100.0, Instant::now()).unwrap();
    assert!(!b.cost_probation_due(Instant::now()));
    let cool = b.retry_after(Instant::now()).unwrap();
    advance(cool).await;
    assert!(b.cost_probation_due(Instant::now()));
    // Still too costly: probation waits a minute more, and says why.
    b.postpone_probation(Instant::now() + Duration::from_secs(60), 28.0, 100.0);
    match b.admit(Instant::now()).0 {
        Admission::Refuse { reason, retry_after } => {
            assert!(reason.contains("still cost $28.00"), "{reason}");
            assert_eq!(retry_after, Duration::from_secs(60));
        }
        a => panic!("expected a refusal, got {a:?}"),
    }
    advance(Duration::from_secs(60)).await;
    // Cooled: no postponing; probation starts as for any trigger.
    assert!(b.cost_probation_due(Instant::now()));
    probe(&mut b);
    // Any other trigger never asks.
    let mut other = breaker();
    other.force_open("drill", Instant::now());
    advance(Duration::from_secs(3600)).await;
    assert!(!other.cost_probation_due(Instant::now()));
}

/// Admits a request that must be a probe; returns its probation's number.
fn probe(b: &mut Breaker) -> u64 {
    match b.admit(Instant::now()).0 {
        Admission::Probe(id) => id,
        a => panic!("expected a probe, got {a:?}"),
    }
}

/// Opens `b` and lets its cool-down pass.
async fn to_probation(b: &mut Breaker) {
    feed(b, 25, 25);
    assert_eq!(b.state(), BreakerState::Open);
    advance(Duration::from_secs(30)).await;
}

#[tokio::test(start_paused = true)]
async fn g3_five_probes_one_at_a_time_close_it() {
    // spec: G3, G2
    let mut b = breaker();
    feed(&mut b, 100, 0); // a normal of 100 ms
    to_probation(&mut b).await;
    // Never closed by time alone: an hour on, requests are still refused or probes, never
    // sent as usual.
    advance(Duration::from_secs(3600)).await;
    let (a, t) = b.admit(Instant::now());
    let id = match a {
        Admission::Probe(id) => id,
        a => panic!("{a:?}"),
    };
    assert_eq!(t.unwrap().trigger, Trigger::CoolDownOver);
    // One at a time: a second request while the probe runs is refused.
    assert!(matches!(b.admit(Instant::now()).0, Admission::Refuse { .. }));
    for i in 1..=5 {
        let id = if i > 1 { probe(&mut b) } else { id };
        let t = b.probe_result(id, Outcome::Success, 120 * MS, false, Instant::now());
        if i < 5 {
            assert_eq!(t, None);
            assert_eq!(b.view(Instant::now()).probes_passed, i);
            assert_eq!(b.state(), BreakerState::Probation);
        } else {
            let t = t.expect("closes");
            assert_eq!((t.to, t.trigger), (BreakerState::Closed, Trigger::ProbationPassed));
        }
    }
    assert_eq!(b.admit(Instant::now()).0, Admission::Send);
}

#[tokio::test(start_paused = true)]
async fn g3_each_way_probation_fails_opens_again_for_longer() {
    // spec: G3
    // A failed probe.
    let mut b = breaker();
    feed(&mut b, 100, 0);
    to_probation(&mut b).await;
    let id = probe(&mut b);
    b.probe_result(id, Outcome::Success, 100 * MS, false, Instant::now());
    let id = probe(&mut b);
    let t = b
        .probe_result(id, Outcome::ProviderFailure, 100 * MS, false, Instant::now())
        .unwrap();
    assert_eq!((t.to, t.trigger), (BreakerState::Open, Trigger::ProbeFailed));
    assert!(t.reason.contains("probe 2 of 5"), "{}", t.reason);
    // The cool-down doubled.
    assert_eq!(b.view(Instant::now()).probe_in_ms, Some(60_000));
    advance(Duration::from_secs(60)).await;
    // A 429 probe fails it too; the cool-down doubles again.
    let id = probe(&mut b);
    let t = b
        .probe_result(id, Outcome::RateLimited, MS, false, Instant::now())
        .unwrap();
    assert_eq!(t.trigger, Trigger::ProbeFailed);
    assert_eq!(b.view(Instant::now()).probe_in_ms, Some(120_000));

    // Five successes, but slow: P95 above 1.5 × the normal.
    let mut b = breaker();
    feed(&mut b, 100, 0);
    to_probation(&mut b).await;
    for _ in 0..5 {
        let id = probe(&mut b);
        if let Some(t) = b.probe_result(id, Outcome::Success, 151 * MS, false, Instant::now()) {
            assert_eq!(t.trigger, Trigger::ProbeSlow);
        }
    }
    assert_eq!(b.state(), BreakerState::Open);
    // Exactly 1.5 × passes.
    let mut b = breaker();
    feed(&mut b, 100, 0);
    to_probation(&mut b).await;
    for _ in 0..5 {
        let id = probe(&mut b);
        b.probe_result(id, Outcome::Success, 150 * MS, false, Instant::now());
    }
    assert_eq!(b.state(), BreakerState::Closed);

    // A duplicate.
    let mut b = breaker();
    to_probation(&mut b).await;
    let id = probe(&mut b);
    let t = b.probe_result(id, Outcome::Success, MS, true, Instant::now()).unwrap();
    assert_eq!(t.trigger, Trigger::ProbeDuplicate);

    // A probe the client abandoned is given back, as is one that says nothing (a 400).
    let mut b = breaker();
    to_probation(&mut b).await;
    let id = probe(&mut b);
    b.probe_abandoned(id);
    let id = probe(&mut b);
    b.probe_result(id, Outcome::Neutral, MS, false, Instant::now());
    assert_eq!(b.view(Instant::now()).probes_sent, 0);
    probe(&mut b);
}

#[tokio::test(start_paused = true)]
async fn g3_the_normal_is_a_p95_so_one_long_answer_among_five_probes_passes() {
    // spec: G3
    // A route whose answers mostly take 100 ms and one in ten 1 s (long completions).
    let mut b = breaker();
    for i in 0..200 {
        let l = if i % 10 == 0 { 1000 * MS } else { 100 * MS };
        b.on_attempt(Outcome::Success, l, Instant::now());
    }
    assert_eq!(b.view(Instant::now()).normal_latency_ms, Some(1000.0));
    to_probation(&mut b).await;
    for l in [100, 120, 1100, 90, 110] {
        let id = probe(&mut b);
        b.probe_result(id, Outcome::Success, l * MS, false, Instant::now());
    }
    assert_eq!(
        b.state(),
        BreakerState::Closed,
        "one long answer is this route's normal"
    );
}

#[tokio::test(start_paused = true)]
async fn g3_a_probe_from_an_earlier_probation_does_not_count() {
    // spec: G3
    let mut b = breaker();
    to_probation(&mut b).await;
    let old = probe(&mut b);
    // An operator closes it, then it opens and reaches probation again.
    b.force_close("fixed", Instant::now());
    to_probation(&mut b).await;
    let new = probe(&mut b);
    assert_ne!(old, new);
    // The old probe reports late: ignored, and the new one still runs alone.
    assert_eq!(b.probe_result(old, Outcome::Success, MS, false, Instant::now()), None);
    b.probe_abandoned(old);
    let v = b.view(Instant::now());
    assert_eq!((v.probes_passed, v.probes_sent, v.probe_in_flight), (0, 1, true));
    assert!(matches!(b.admit(Instant::now()).0, Admission::Refuse { .. }));
}

#[tokio::test(start_paused = true)]
async fn g1_429s_mixed_with_5xx_still_open_after_3_minutes() {
    // spec: G1
    // An incident answering 429 and 529 by turns: not 25 of 50 5xx, but no answer either.
    let mut b = breaker();
    let mut opened = None;
    for s in 0..=200 {
        let o = if s % 3 == 0 {
            Outcome::ProviderFailure
        } else {
            Outcome::RateLimited
        };
        if let Some(t) = b.on_attempt(o, MS, Instant::now()) {
            opened = Some((s, t.trigger));
            break;
        }
        advance(Duration::from_secs(1)).await;
    }
    // The run began with the first 429 (second 1): three minutes later, it opens.
    assert_eq!(opened, Some((181, Trigger::RateLimited)));
}

#[tokio::test(start_paused = true)]
async fn g4_operators_open_and_close_by_hand() {
    // spec: G4
    let mut b = breaker();
    let t = b.force_open("provider incident INC-42", Instant::now()).unwrap();
    assert_eq!((t.to, t.trigger), (BreakerState::Open, Trigger::Operator));
    assert!(t.reason.contains("INC-42"));
    // An operator's breaker never goes to probation by itself, and clients do not hear
    // the operator's own words.
    advance(Duration::from_secs(86_400)).await;
    match b.admit(Instant::now()).0 {
        Admission::Refuse { reason, .. } => assert_eq!(reason, "opened by an operator"),
        a => panic!("{a:?}"),
    }
    assert_eq!(b.force_open("again", Instant::now()), None, "already open by hand");
    let t = b.force_close("incident resolved", Instant::now()).unwrap();
    assert_eq!(t.to, BreakerState::Closed);
    assert_eq!(b.force_close("twice", Instant::now()), None);
}

#[tokio::test(start_paused = true)]
async fn g4_a_restart_keeps_an_open_breaker_open() {
    // spec: G4
    let mut b = breaker();
    feed(&mut b, 100, 0);
    feed(&mut b, 25, 25);
    let snap = b.snapshot(Instant::now());
    let json = serde_json::to_string(&snap).unwrap();
    let back: BreakerSnapshot = serde_json::from_str(&json).unwrap();
    // Restored 10 s later: 20 s of cool-down left, the normal kept.
    let mut r = Breaker::restore(BreakerConfig::default(), &back, Duration::from_secs(10), Instant::now());
    assert_eq!(r.state(), BreakerState::Open);
    let v = r.view(Instant::now());
    assert_eq!(v.probe_in_ms, Some(20_000));
    assert_eq!(v.normal_latency_ms, Some(100.0));
    assert_eq!(v.trigger, Some(Trigger::ServerErrors));
    // A probation cut by a restart starts again, open, with its probe due at once.
    advance(Duration::from_secs(30)).await;
    b.admit(Instant::now());
    assert_eq!(b.state(), BreakerState::Probation);
    let mut r = Breaker::restore(
        BreakerConfig::default(),
        &b.snapshot(Instant::now()),
        Duration::ZERO,
        Instant::now(),
    );
    assert_eq!(r.state(), BreakerState::Open);
    probe(&mut r);
    // An operator's breaker stays theirs.
    let mut b = breaker();
    b.force_open("x", Instant::now());
    let r = Breaker::restore(
        BreakerConfig::default(),
        &b.snapshot(Instant::now()),
        Duration::from_secs(99_999),
        Instant::now(),
    );
    assert_eq!(r.snapshot(Instant::now()).probe_in_ms, None);
}

#[tokio::test(start_paused = true)]
async fn f4_retries_are_at_most_a_fifth_of_new_requests() {
    // spec: F4
    let mut budget = RetryBudget::new(0.2, 0, Duration::from_secs(10), Instant::now());
    for _ in 0..100 {
        budget.request(Instant::now());
    }
    let granted = (0..50).filter(|_| budget.try_retry(Instant::now())).count();
    assert_eq!(granted, 20);
    // The window slides: ten seconds later the old requests no longer pay for retries.
    advance(Duration::from_secs(10)).await;
    assert!(!budget.try_retry(Instant::now()));
    assert_eq!(budget.figures(Instant::now()), (0, 0, 0));
    for _ in 0..10 {
        budget.request(Instant::now());
    }
    assert!(budget.try_retry(Instant::now()) && budget.try_retry(Instant::now()));
    assert!(!budget.try_retry(Instant::now()));
    // A floor lets a quiet route retry its rare failure.
    let mut quiet = RetryBudget::new(0.2, 2, Duration::from_secs(10), Instant::now());
    quiet.request(Instant::now());
    assert!(quiet.try_retry(Instant::now()) && quiet.try_retry(Instant::now()));
    assert!(!quiet.try_retry(Instant::now()));
}

#[tokio::test(start_paused = true)]
async fn r2_the_retry_budget_counts_the_fleets_requests_and_retries() {
    // spec: R2, F4
    let mut here = RetryBudget::new(0.2, 0, Duration::from_secs(10), Instant::now());
    for _ in 0..10 {
        here.request(Instant::now());
    }
    // Alone, 10 requests pay for 2 retries; the fleet's other instances had 90 requests
    // and already spent 15 retries: 100 requests allow 20, 5 are left for this one.
    here.set_others(90, 15);
    let granted = (0..10).filter(|_| here.try_retry(Instant::now())).count();
    assert_eq!(granted, 5);
    assert_eq!(here.figures(Instant::now()), (100, 20, 20));
    // What it tells the fleet is its own share only.
    assert_eq!(here.own_counts(Instant::now()), (10, 5));
    // The others spent the whole fleet's budget: none here, whatever the local counts say.
    here.set_others(90, 30);
    assert!(!here.try_retry(Instant::now()));
}

#[tokio::test(start_paused = true)]
async fn f5_amplification_and_post_retry_success_per_window() {
    // spec: F5, F4, N1
    let mut a = Amplification::new(Instant::now());
    // An hour ago: 10 requests of 3 attempts each, none succeeding.
    for _ in 0..10 {
        a.finished(3, false, Instant::now());
    }
    advance(Duration::from_secs(30 * 60)).await;
    // Now: 16 first-time successes, 4 retried once (two succeeded).
    for _ in 0..16 {
        a.finished(1, true, Instant::now());
    }
    for ok in [true, false, true, false] {
        a.finished(2, ok, Instant::now());
    }
    let v = a.view(Instant::now());
    assert_eq!(v.last_1m.amplification, Some(1.2));
    assert_eq!(v.last_1m.post_retry_success, Some(0.5));
    assert_eq!((v.last_1h.requests, v.last_1h.attempts), (30, 54));
    assert!(!v.holding_low_priority, "1.2 is the limit, not above it");
    a.finished(2, true, Instant::now());
    assert!(a.view(Instant::now()).holding_low_priority);
    advance(Duration::from_secs(31 * 60)).await;
    let v = a.view(Instant::now());
    assert_eq!(v.last_1h.requests, 21, "the oldest bucket left the hour");
    // Too few requests hold nothing, whatever their amplification.
    let mut quiet = Amplification::new(Instant::now());
    for _ in 0..19 {
        quiet.finished(3, true, Instant::now());
    }
    assert!(!quiet.holding_low_priority(Instant::now()));
    assert_eq!(v.last_1m, WindowFigures::default());
}

fn outlier() -> Outlier {
    Outlier::new(OutlierConfig::default(), Instant::now())
}

fn fail(o: &mut Outlier, n: u32) -> Option<OutlierTransition> {
    let mut t = None;
    for _ in 0..n {
        if let Some(x) = o.observe(Outcome::ProviderFailure, MS, Instant::now(), true) {
            t = Some(x);
        }
    }
    t
}

#[tokio::test(start_paused = true)]
async fn d5_ejections_grow_and_come_back_gradually() {
    // spec: D5
    let mut o = outlier();
    assert_eq!(fail(&mut o, 4), None);
    o.observe(Outcome::Success, MS, Instant::now(), true);
    assert_eq!(fail(&mut o, 4), None, "a success breaks the run");
    let t = fail(&mut o, 1).expect("5 in a row eject");
    assert!(t.ejected);
    assert_eq!((t.cool_down, t.ejections), (Duration::from_secs(30), 1));
    assert_eq!(o.share(Instant::now()), 0.0);
    assert_eq!(o.ejected(Instant::now()).unwrap().0, Duration::from_secs(30));
    advance(Duration::from_secs(30)).await;
    let back = o.advance(Instant::now()).expect("back");
    assert!(!back.ejected);
    // Back gradually: a tenth of its share at first, full after as long as the cool-down.
    assert!((o.share(Instant::now()) - 0.1).abs() < 1e-9);
    advance(Duration::from_secs(15)).await;
    assert!((o.share(Instant::now()) - 0.55).abs() < 1e-9);
    // One failure while coming back: out again, for twice as long.
    let t = fail(&mut o, 1).unwrap();
    assert_eq!((t.cool_down, t.ejections), (Duration::from_secs(60), 2));
    advance(Duration::from_secs(60)).await;
    o.advance(Instant::now());
    let t = fail(&mut o, 1).unwrap();
    assert_eq!(t.cool_down, Duration::from_secs(120));
    // Capped.
    for _ in 0..10 {
        let (left, _) = o.ejected(Instant::now()).unwrap();
        advance(left).await;
        o.advance(Instant::now());
        fail(&mut o, 1);
    }
    assert_eq!(o.ejected(Instant::now()).unwrap().0, Duration::from_secs(600));
    // Healthy for ten minutes: the count starts again.
    advance(Duration::from_secs(600 + 600 + 599)).await;
    o.advance(Instant::now());
    assert_eq!(o.ejections(), 13, "healthy for 9:59 only");
    advance(Duration::from_secs(1)).await;
    o.advance(Instant::now());
    assert_eq!(o.ejections(), 0);
    assert_eq!(fail(&mut o, 5).unwrap().cool_down, Duration::from_secs(30));
}

#[tokio::test(start_paused = true)]
async fn d5_a_flaky_channel_is_not_ejected_for_a_run_a_dead_one_is_and_the_last_one_never() {
    // spec: D5
    // Healthy for a while, then a run of five: 5 of its last 20 answers failed. It stays.
    let mut o = outlier();
    for _ in 0..15 {
        o.observe(Outcome::Success, MS, Instant::now(), true);
    }
    assert_eq!(fail(&mut o, 5), None);
    assert!(o.ejected(Instant::now()).is_none());
    // It keeps failing: at 12 in a row, 12 of its last 20, it leaves.
    let t = fail(&mut o, 7).expect("ejected");
    assert!(
        t.reason
            .contains("12 provider failures in a row, 12 of its last 20 answers"),
        "{}",
        t.reason
    );
    // The last channel in rotation of its group is never ejected by its failures.
    let mut last = outlier();
    for _ in 0..30 {
        assert_eq!(last.observe(Outcome::ProviderFailure, MS, Instant::now(), false), None);
    }
    assert!(last.ejected(Instant::now()).is_none());
    assert!(last.share(Instant::now()) < 0.1, "its share says what its errors are");
}

#[tokio::test(start_paused = true)]
async fn d5_an_ejection_survives_a_restart() {
    // spec: D5
    let mut o = outlier();
    fail(&mut o, 5);
    let s = o.snapshot(Instant::now());
    let r = Outlier::restore(OutlierConfig::default(), &s, Duration::from_secs(12), Instant::now());
    assert_eq!(r.ejected(Instant::now()).unwrap().0, Duration::from_secs(18));
    assert_eq!(r.ejections(), 1);
}

#[tokio::test(start_paused = true)]
async fn d4_twice_its_normal_latency_cuts_a_channels_share() {
    // spec: D4
    let mut o = outlier();
    for _ in 0..600 {
        o.observe(Outcome::Success, 100 * MS, Instant::now(), true);
        advance(Duration::from_secs(1)).await;
    }
    assert!((o.share(Instant::now()) - 1.0).abs() < 1e-6);
    // Now twice as slow for a few seconds: the peak jumps, the normal barely moves.
    for _ in 0..3 {
        o.observe(Outcome::Success, 200 * MS, Instant::now(), true);
        advance(Duration::from_millis(100)).await;
    }
    let s = o.share(Instant::now());
    assert!((0.2..0.3).contains(&s), "share {s}");
    // Left alone, the estimate decays back and the channel is tried again.
    advance(Duration::from_secs(60)).await;
    assert!(o.share(Instant::now()) > 0.95);
    // Errors lower it too.
    let mut e = outlier();
    for _ in 0..3 {
        e.observe(Outcome::ProviderFailure, MS, Instant::now(), true);
        e.observe(Outcome::Success, MS, Instant::now(), true);
    }
    assert!(e.share(Instant::now()) < 0.8);
}
