//! The recovery run on a fake clock: every step in order, each O2 trigger at its exact
//! threshold, the O3 gate, O4's closing conditions.

use super::*;

const STAGE: i64 = 15 * 60_000;

fn run() -> Recovery {
    Recovery::new(RecoveryConfig::default())
}

fn ok(ms: f64) -> ProbeResult {
    ProbeResult {
        ok: true,
        latency_ms: ms,
        duplicate: false,
    }
}

fn approval(actor: &str, role: ApprovalRole, at: i64) -> Approval {
    Approval {
        actor: actor.into(),
        role,
        reason: "the provider confirms the fix".into(),
        at,
    }
}

/// A run walked to the 25 % stage at `t`.
fn resumed(t: i64) -> Recovery {
    let mut r = run();
    r.complete(RecoveryStep::Isolate, "ana", "split".into(), t).unwrap();
    r.complete(RecoveryStep::Preserve, "ana", "bundle".into(), t).unwrap();
    r.complete(RecoveryStep::RollBack, "ana", "nothing changed".into(), t)
        .unwrap();
    r.start_probes(Some(100.0)).unwrap();
    for _ in 0..4 {
        assert_eq!(r.probe(ok(100.0), "ana", t), Ok(None));
    }
    let c = r.probe(ok(100.0), "ana", t).unwrap().unwrap();
    assert_eq!(
        (c.from, c.to, c.action),
        (RecoveryStep::Confirm, RecoveryStep::Resume, "confirmed")
    );
    assert_eq!(r.stage_pct(), Some(25));
    r
}

#[test]
fn o1_steps_go_in_order_and_gate_the_route() {
    // spec: O1
    let mut r = run();
    // Opened, nothing done to the route yet.
    assert_eq!(r.gate(), None);
    assert_eq!(
        r.complete(RecoveryStep::Preserve, "ana", String::new(), 0),
        Err(RecoveryError::WrongStep {
            wanted: RecoveryStep::Preserve,
            now: RecoveryStep::Isolate
        })
    );
    let c = r
        .complete(RecoveryStep::Isolate, "ana", "3 ok / 9 failed / 1 unknown".into(), 10)
        .unwrap();
    assert_eq!(
        (c.from, c.to, c.action),
        (RecoveryStep::Isolate, RecoveryStep::Preserve, "isolated")
    );
    // Isolated: paused, jobs held, retries off (the gate exists).
    assert_eq!(
        r.gate(),
        Some(Gate {
            share_pct: 0,
            jobs_held: true
        })
    );
    assert_eq!(r.done_of(RecoveryStep::Isolate).unwrap().actor, "ana");
    assert_eq!(r.status_of(RecoveryStep::Isolate), "done");
    assert_eq!(r.status_of(RecoveryStep::Preserve), "current");
    assert_eq!(r.status_of(RecoveryStep::Confirm), "pending");
    r.complete(RecoveryStep::Preserve, "ben", "bundle".into(), 20).unwrap();
    r.complete(RecoveryStep::RollBack, "ben", "nothing".into(), 30).unwrap();
    assert_eq!(r.step, RecoveryStep::Confirm);
    assert_eq!(r.gate().unwrap().share_pct, 0);
}

#[test]
fn o1_probes_need_five_successes_within_one_and_a_half_times_normal() {
    // spec: O1
    let r = resumed(0);
    assert_eq!(r.step, RecoveryStep::Resume);

    // A failing probe ends its round at once; the run stays at confirm.
    let mut r = run();
    for s in [RecoveryStep::Isolate, RecoveryStep::Preserve, RecoveryStep::RollBack] {
        r.complete(s, "ana", String::new(), 0).unwrap();
    }
    r.start_probes(Some(100.0)).unwrap();
    r.probe(ok(90.0), "ana", 0).unwrap();
    let e = r
        .probe(
            ProbeResult {
                ok: false,
                latency_ms: 10.0,
                duplicate: false,
            },
            "ana",
            0,
        )
        .unwrap_err();
    assert_eq!(e, "probe 2 failed");
    assert!(!r.probe_wanted());
    assert_eq!(r.step, RecoveryStep::Confirm);

    // A duplicate fails the round.
    r.start_probes(Some(100.0)).unwrap();
    assert_eq!(r.probe_rounds, 2);
    let e = r
        .probe(
            ProbeResult {
                ok: true,
                latency_ms: 10.0,
                duplicate: true,
            },
            "ana",
            0,
        )
        .unwrap_err();
    assert!(e.contains("duplicate"), "{e}");

    // P95 exactly 1.5 × normal passes; just above fails.
    r.start_probes(Some(100.0)).unwrap();
    for _ in 0..4 {
        r.probe(ok(150.0), "ana", 0).unwrap();
    }
    assert!(r.probe(ok(150.1), "ana", 0).unwrap_err().contains("above 1.5"));
    r.start_probes(Some(100.0)).unwrap();
    for _ in 0..4 {
        r.probe(ok(80.0), "ana", 0).unwrap();
    }
    assert!(r.probe(ok(150.0), "ana", 5).unwrap().is_some());
    assert_eq!(r.stage_pct(), Some(25));
    assert_eq!(r.stage_started_at, Some(5));
}

#[test]
fn o1_stages_advance_after_their_time_then_drain() {
    // spec: O1
    let mut r = resumed(0);
    assert_eq!(r.tick(STAGE - 1), None);
    let c = r.tick(STAGE).unwrap();
    assert_eq!(c.action, "stage_advanced");
    assert_eq!(r.stage_pct(), Some(50));
    assert_eq!(r.gate().unwrap().share_pct, 50);
    assert!(r.tick(2 * STAGE - 1).is_none());
    r.tick(2 * STAGE).unwrap();
    assert_eq!(r.stage_pct(), Some(100));
    let c = r.tick(3 * STAGE).unwrap();
    assert_eq!((c.to, c.action), (RecoveryStep::Drain, "resumed"));
    // Drain: the route is left alone, retries back on.
    assert_eq!(r.gate(), None);
    assert_eq!(r.drained(1, 0), None);
    assert_eq!(r.drained(0, 1), None);
    assert_eq!(r.drained(0, 0).unwrap().to, RecoveryStep::Close);
}

#[test]
fn o2_five_server_errors_in_twenty_step_back_four_do_not() {
    // spec: O2
    let mut r = resumed(0);
    r.tick(STAGE).unwrap();
    assert_eq!(r.stage_pct(), Some(50));
    for i in 0..16 {
        assert_eq!(r.on_outcome(Outcome::Success, 100 + i), None);
    }
    for i in 0..4 {
        assert_eq!(r.on_outcome(Outcome::ProviderFailure, 200 + i), None);
    }
    // 4 of the last 20. A client's own 4xx says nothing.
    assert_eq!(r.on_outcome(Outcome::Neutral, 300), None);
    assert_eq!(r.recent(), (20, 4, None));
    let c = r.on_outcome(Outcome::ProviderFailure, 400).unwrap();
    assert_eq!(c.action, "stepped_back");
    assert!(c.reason.contains("5xx in 5 of the last 20"), "{}", c.reason);
    assert_eq!(r.stage_pct(), Some(25));
    assert_eq!(r.stage_started_at, Some(400));
    assert_eq!(r.stops, 1);
    assert!(!r.held());

    // The window slides: failures that fell out of the last 20 no longer count.
    let mut r = resumed(0);
    for _ in 0..4 {
        r.on_outcome(Outcome::ProviderFailure, 1);
    }
    for _ in 0..16 {
        r.on_outcome(Outcome::Success, 2);
    }
    // The oldest failure leaves as this one comes: still 4 of 20.
    assert_eq!(r.on_outcome(Outcome::ProviderFailure, 3), None);
    assert_eq!(r.recent(), (20, 4, None));
}

#[test]
fn o2_429s_for_two_minutes_step_back_a_success_resets() {
    // spec: O2
    let mut r = resumed(0);
    assert_eq!(r.on_outcome(Outcome::RateLimited, 1_000), None);
    assert_eq!(r.on_outcome(Outcome::RateLimited, 120_999), None);
    assert_eq!(r.on_outcome(Outcome::Success, 121_000), None);
    // A success in between starts the span again.
    assert_eq!(r.on_outcome(Outcome::RateLimited, 125_000), None);
    assert_eq!(r.on_outcome(Outcome::RateLimited, 244_999), None);
    let c = r.on_outcome(Outcome::RateLimited, 245_000).unwrap();
    assert!(c.reason.contains("429s for 120 s"), "{}", c.reason);
    // From the first stage, one back is confirm: paused, new probes needed.
    assert_eq!(c.to, RecoveryStep::Confirm);
    assert_eq!(r.gate().unwrap().share_pct, 0);
    assert!(r.probes.is_empty());
}

#[test]
fn o2_one_duplicate_and_projected_cost_step_back() {
    // spec: O2
    let mut r = resumed(0);
    r.tick(STAGE).unwrap();
    assert_eq!(r.on_duplicates(0, STAGE + 1), None);
    let c = r.on_duplicates(1, STAGE + 1).unwrap();
    assert!(c.reason.contains("duplicate"));
    assert_eq!(r.stage_pct(), Some(25));

    let mut r = resumed(0);
    r.tick(STAGE).unwrap();
    assert_eq!(r.on_cost(10.0, 10.0, STAGE + 1), None);
    let c = r.on_cost(10.01, 10.0, STAGE + 1).unwrap();
    assert!(c.reason.contains("above the cap"));
    assert!(c.figures.contains(&("daily_cap_usd".into(), 10.0)));
    // Not resuming: nothing to step back from.
    let mut r = run();
    assert_eq!(r.on_cost(99.0, 1.0, 0), None);
    assert_eq!(r.on_outcome(Outcome::ProviderFailure, 0), None);
}

#[test]
fn o3_second_stop_holds_until_two_people_in_both_roles_approve() {
    // spec: O3
    let mut r = resumed(0);
    r.tick(STAGE).unwrap();
    r.on_duplicates(1, STAGE + 10).unwrap();
    assert!(!r.held());
    r.tick(2 * STAGE + 10).unwrap();
    assert_eq!(r.stage_pct(), Some(50));
    let c = r.on_duplicates(1, 2 * STAGE + 20).unwrap();
    assert!(r.held());
    assert!(c.reason.contains("two approvals"), "{}", c.reason);
    assert_eq!(r.stage_pct(), Some(25));
    // Held: the stage does not advance however long it runs.
    assert_eq!(r.tick(10 * STAGE), None);
    let approve = |actor: &str, role| approval(actor, role, 10 * STAGE);
    assert_eq!(r.approve(approve("ana", ApprovalRole::PlatformOperations)), Ok(None));
    assert!(r.held());
    // The same person cannot give the second approval, nor a role be given twice.
    assert_eq!(
        r.approve(approve(" ANA ", ApprovalRole::BusinessOwner)),
        Err(RecoveryError::SameApprover("ana".into()))
    );
    assert_eq!(
        r.approve(approve("ben", ApprovalRole::PlatformOperations)),
        Err(RecoveryError::RoleGiven(ApprovalRole::PlatformOperations))
    );
    let c = r.approve(approve("ben", ApprovalRole::BusinessOwner)).unwrap().unwrap();
    assert_eq!(c.action, "approved");
    assert!(!r.held());
    // The stage's time starts again at the approval.
    assert_eq!(r.tick(11 * STAGE - 1), None);
    assert!(r.tick(11 * STAGE).is_some());
    // A later stop holds again, and the earlier approvals do not count.
    r.on_duplicates(1, 11 * STAGE + 1).unwrap();
    assert!(r.held());
    assert!(r.current_approvals().is_empty());
    assert_eq!(
        run().approve(approve("ana", ApprovalRole::BusinessOwner)),
        Err(RecoveryError::NotHeld)
    );
}

#[test]
fn o3_a_held_run_back_at_confirm_resumes_after_approvals() {
    // spec: O3
    let mut r = resumed(0);
    r.on_duplicates(1, 1).unwrap();
    assert_eq!(r.step, RecoveryStep::Confirm);
    r.start_probes(None).unwrap();
    for _ in 0..4 {
        r.probe(ok(10.0), "ana", 2).unwrap();
    }
    assert!(r.probe(ok(10.0), "ana", 2).unwrap().is_some());
    r.on_duplicates(1, 3).unwrap();
    assert!(r.held());
    assert_eq!(r.step, RecoveryStep::Confirm);
    r.start_probes(None).unwrap();
    for _ in 0..5 {
        // Passing while held resumes nothing by itself.
        assert_eq!(r.probe(ok(10.0), "ana", 4), Ok(None));
    }
    assert_eq!(r.step, RecoveryStep::Confirm);
    r.approve(approval("ana", ApprovalRole::BusinessOwner, 5)).unwrap();
    let c = r
        .approve(approval("ben", ApprovalRole::PlatformOperations, 5))
        .unwrap()
        .unwrap();
    assert_eq!((c.to, r.stage_pct()), (RecoveryStep::Resume, Some(25)));
}

#[test]
fn o3_a_held_run_whose_last_round_failed_does_not_resume_on_approval() {
    // spec: O3
    let mut r = resumed(0);
    r.on_duplicates(1, 1).unwrap();
    r.start_probes(None).unwrap();
    for _ in 0..5 {
        r.probe(ok(10.0), "ana", 2).unwrap();
    }
    r.on_duplicates(1, 3).unwrap();
    assert!(r.held());
    // Every probe answered, but too slowly: the round failed.
    r.start_probes(Some(10.0)).unwrap();
    for _ in 0..4 {
        r.probe(ok(100.0), "ana", 4).unwrap();
    }
    assert!(r.probe(ok(100.0), "ana", 4).is_err());
    // A held run cannot be cancelled by one person either.
    assert_eq!(r.cancel("tired"), Err(RecoveryError::Held));
    r.approve(approval("ana", ApprovalRole::BusinessOwner, 5)).unwrap();
    let c = r
        .approve(approval("ben", ApprovalRole::PlatformOperations, 5))
        .unwrap()
        .unwrap();
    assert_eq!((c.to, c.action), (RecoveryStep::Confirm, "approved"));
    assert_eq!(r.step, RecoveryStep::Confirm);
    assert!(r.gate().unwrap().share_pct == 0);
}

#[test]
fn o2_the_breaker_opening_again_steps_back_and_a_restart_restarts_the_stage() {
    // spec: O2
    let mut r = resumed(0);
    r.tick(STAGE).unwrap();
    let c = r.on_breaker_open("25 of 50 failed", STAGE + 5).unwrap();
    assert!(c.reason.contains("breaker opened again"), "{}", c.reason);
    assert_eq!(r.stage_pct(), Some(25));
    assert_eq!(run().on_breaker_open("x", 0), None);
    // Down for an hour mid-stage: the stage is not passed unwatched.
    r.restart_stage(10 * STAGE);
    assert_eq!(r.tick(10 * STAGE + 1), None);
    assert!(r.tick(11 * STAGE).is_some());
}

#[test]
fn o4_closes_only_with_every_condition() {
    // spec: O4
    let mut r = resumed(0);
    assert!(matches!(
        r.close(&CloseChecks::default(), "ana", 0),
        Err(RecoveryError::WrongStep { .. })
    ));
    for t in 1..=3 {
        r.tick(t * STAGE).unwrap();
    }
    r.drained(0, 0).unwrap();
    let checks = CloseChecks {
        backlog: 2,
        unknowns: 1,
        unexplained_overruns: 1,
        customer_contacted: false,
    };
    let Err(RecoveryError::NotClosable(m)) = r.close(&checks, "ana", 0) else {
        panic!("closed with everything missing");
    };
    assert_eq!(m.len(), 4, "{m:?}");
    assert!(m[3].contains("customer contact"));
    let ready = CloseChecks {
        customer_contacted: true,
        ..Default::default()
    };
    let c = r.close(&ready, "ana", 9).unwrap();
    assert_eq!((c.from, c.to), (RecoveryStep::Close, RecoveryStep::Closed));
    assert_eq!(r.status_of(RecoveryStep::Drain), "done");
    assert_eq!(
        r.close(&ready, "ana", 9),
        Err(RecoveryError::Ended(RecoveryStep::Closed))
    );
    assert!(r.cancel("late").is_err());
}

#[test]
fn o5_a_run_serialises_and_comes_back_the_same() {
    // spec: O5
    let mut r = resumed(0);
    r.on_outcome(Outcome::ProviderFailure, 1);
    r.on_outcome(Outcome::RateLimited, 2);
    let text = serde_json::to_string(&r).unwrap();
    let back: Recovery = serde_json::from_str(&text).unwrap();
    assert_eq!(back, r);
    // A 429 is an outcome of the window too, not a 5xx.
    assert_eq!(back.recent(), (2, 1, Some(2)));
}

#[test]
fn a_cancelled_run_leaves_the_route_alone() {
    // spec: O1
    let mut r = run();
    r.complete(RecoveryStep::Isolate, "ana", String::new(), 0).unwrap();
    assert!(r.gate().is_some());
    let c = r.cancel("wrong route").unwrap();
    assert_eq!(c.to, RecoveryStep::Cancelled);
    assert_eq!(r.gate(), None);
    assert_eq!(r.status_of(RecoveryStep::Isolate), "done");
    assert_eq!(r.status_of(RecoveryStep::Preserve), "pending");
}
