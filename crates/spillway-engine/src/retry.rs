//! Retry decisions: which outcomes may be tried again (D2, D3, E2) and the F2 decision
//! taken after every failed attempt. Pure apart from the clock it is handed, so every
//! branch is tested on tokio's paused clock.

use spillway_wire::ErrorClass;
use std::time::Duration;
use tokio::time::Instant;

/// F2: a wait longer than this is not slept through in the handler's hot path: the request
/// is queued with a `ready_at` (recorded in the ledger) and holds no channel slot meanwhile.
pub const QUEUE_THRESHOLD: Duration = Duration::from_millis(2_000);
/// F2: full-jitter back-off base and ceiling.
const BACKOFF_BASE: Duration = Duration::from_millis(500);
const BACKOFF_CAP: Duration = Duration::from_secs(30);

/// What a failed attempt's class allows next (D2, D3, E2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retryability {
    /// Transient on this channel: retry it, or any other channel of the group (D2).
    Transient,
    /// The channel itself refused (its credential or its quota, E2): the channel leaves
    /// rotation and the request may only move to a *different* channel.
    ChannelFault,
    /// Retrying cannot help (D3: 400/404/413/422) or nobody knows whether it can (E2:
    /// unknown codes are held for a person, not retried blindly).
    Never,
}

pub fn retryability(class: ErrorClass) -> Retryability {
    match class {
        ErrorClass::RateLimit
        | ErrorClass::Overload
        | ErrorClass::ServerError
        | ErrorClass::Transient
        | ErrorClass::Timeout
        | ErrorClass::Unreachable
        | ErrorClass::StreamInterrupted => Retryability::Transient,
        ErrorClass::Auth | ErrorClass::Quota => Retryability::ChannelFault,
        // A 2xx the gateway cannot read may have been billed and acted on: a person decides.
        ErrorClass::MalformedResponse | ErrorClass::InvalidRequest | ErrorClass::Unknown | ErrorClass::Success => {
            Retryability::Never
        }
    }
}

/// The provider answered that it refused the attempt before doing any of its work. An
/// unreachable channel is not among them: a reset may come after the request arrived.
pub fn provider_did_not_start(class: ErrorClass) -> bool {
    matches!(
        class,
        ErrorClass::RateLimit | ErrorClass::Overload | ErrorClass::Auth | ErrorClass::Quota
    )
}

/// Why a request stops being retried: the ledger's vocabulary (F2's fail-closed reasons
/// and the class rules), so what is decided here is what the console shows.
pub use spillway_ledger::StopReason as Stop;

/// The F2 outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Stop and answer the client with the failure.
    FailClosed(Stop),
    /// Try again after `delay` (≤ [`QUEUE_THRESHOLD`]; zero for a failover to a ready channel).
    RetryNow { delay: Duration },
    /// Wait until `ready_at` without holding a channel slot, then try again.
    Queue { ready_at: Instant },
}

/// The facts F2 reads after a failed attempt.
#[derive(Clone, Copy, Debug)]
pub struct Failure {
    /// The client already saw output from this attempt.
    pub visible_output: bool,
    /// Attempts made so far, the failed one included (1 after the first failure).
    pub attempts: u32,
    pub max_attempts: u32,
    /// The wait the next target asks for: the provider's hint (Retry-After, reset
    /// headers, Gemini RetryInfo) when the next attempt goes to a channel that gave one.
    pub hint: Option<Duration>,
    /// The next attempt goes to a different channel that is ready now (D1). The hint and
    /// the back-off both protect the channel that failed, which that attempt does not touch.
    pub failover_ready: bool,
    /// Time left before the request's deadline (F3).
    pub remaining: Duration,
}

/// Full jitter: uniformly random in `[0, min(30 s, 500 ms · 2^attempts)]`.
pub fn backoff_ceiling(attempts: u32) -> Duration {
    BACKOFF_BASE
        .checked_mul(1u32.checked_shl(attempts.min(16)).unwrap_or(u32::MAX))
        .unwrap_or(BACKOFF_CAP)
        .min(BACKOFF_CAP)
}

/// F2, in its order. `jitter` draws a uniform duration in `[0, ceiling]`.
pub fn decide(f: Failure, now: Instant, jitter: impl FnOnce(Duration) -> Duration) -> Decision {
    if f.visible_output {
        return Decision::FailClosed(Stop::PartialOutputCommitted);
    }
    if f.attempts >= f.max_attempts {
        // Fallback to another route needs a workflow's contract (K1); plain proxying has none.
        return Decision::FailClosed(Stop::AttemptBudgetExhausted);
    }
    let delay = if f.failover_ready {
        Duration::ZERO
    } else {
        f.hint.unwrap_or_else(|| jitter(backoff_ceiling(f.attempts)))
    };
    // A delay that uses up the whole deadline leaves no time for the attempt itself.
    if delay >= f.remaining {
        return Decision::FailClosed(Stop::RetryAfterExceedsDeadline);
    }
    if delay > QUEUE_THRESHOLD {
        return Decision::Queue { ready_at: now + delay };
    }
    Decision::RetryNow { delay }
}

/// A uniform draw in `[0, ceiling]`.
pub fn full_jitter(ceiling: Duration) -> Duration {
    use rand::Rng;
    let ms = ceiling.as_millis() as u64;
    Duration::from_millis(rand::rng().random_range(0..=ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure() -> Failure {
        Failure {
            visible_output: false,
            attempts: 1,
            max_attempts: 3,
            hint: None,
            failover_ready: false,
            remaining: Duration::from_secs(19),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn f2_branches_in_order() {
        // spec: F2
        let now = Instant::now();
        let max = |c: Duration| c;
        // Visible output beats everything, even attempts left and no delay.
        let f = Failure {
            visible_output: true,
            failover_ready: true,
            ..failure()
        };
        assert_eq!(decide(f, now, max), Decision::FailClosed(Stop::PartialOutputCommitted));
        // Out of attempts: fail closed even with a channel ready.
        let f = Failure {
            attempts: 3,
            failover_ready: true,
            ..failure()
        };
        assert_eq!(decide(f, now, max), Decision::FailClosed(Stop::AttemptBudgetExhausted));
        // The provider's hint wins over jitter, and past the deadline fails closed.
        let f = Failure {
            hint: Some(Duration::from_secs(30)),
            ..failure()
        };
        assert_eq!(
            decide(f, now, max),
            Decision::FailClosed(Stop::RetryAfterExceedsDeadline)
        );
        // A hint over 2 s queues with ready_at = now + hint.
        let f = Failure {
            hint: Some(Duration::from_secs(5)),
            ..failure()
        };
        assert_eq!(
            decide(f, now, max),
            Decision::Queue {
                ready_at: now + Duration::from_secs(5)
            }
        );
        // A short hint retries now (after the hint).
        let f = Failure {
            hint: Some(Duration::from_millis(300)),
            ..failure()
        };
        assert_eq!(
            decide(f, now, max),
            Decision::RetryNow {
                delay: Duration::from_millis(300)
            }
        );
        // A ready different channel: fail over at once, whatever the failed channel's hint.
        let f = Failure {
            hint: Some(Duration::from_secs(60)),
            failover_ready: true,
            ..failure()
        };
        assert_eq!(decide(f, now, max), Decision::RetryNow { delay: Duration::ZERO });
    }

    #[tokio::test(start_paused = true)]
    async fn f2_full_jitter_without_a_hint() {
        // spec: F2
        let now = Instant::now();
        // The ceiling doubles per attempt: 1 s after the first, 2 s after the second, 30 s cap.
        assert_eq!(backoff_ceiling(1), Duration::from_millis(1000));
        assert_eq!(backoff_ceiling(2), Duration::from_millis(2000));
        assert_eq!(backoff_ceiling(3), Duration::from_millis(4000));
        assert_eq!(backoff_ceiling(7), Duration::from_secs(30));
        assert_eq!(backoff_ceiling(u32::MAX), Duration::from_secs(30));
        let mut seen = None;
        let d = decide(failure(), now, |c| {
            seen = Some(c);
            c / 2
        });
        assert_eq!(seen, Some(Duration::from_secs(1)));
        assert_eq!(
            d,
            Decision::RetryNow {
                delay: Duration::from_millis(500)
            }
        );
        // Exactly 2 s still retries in place; a 4 s draw (after the third failure of five)
        // queues rather than sleeps.
        for (attempts, expected) in [
            (
                2,
                Decision::RetryNow {
                    delay: Duration::from_secs(2),
                },
            ),
            (
                3,
                Decision::Queue {
                    ready_at: now + Duration::from_secs(4),
                },
            ),
        ] {
            let f = Failure {
                attempts,
                max_attempts: 5,
                ..failure()
            };
            assert_eq!(decide(f, now, |c| c), expected, "after {attempts} failures");
        }
        // The draw itself is uniform within the ceiling.
        for _ in 0..200 {
            assert!(full_jitter(Duration::from_millis(1000)) <= Duration::from_millis(1000));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn f1_ready_at_moves_with_the_clock() {
        // spec: F1
        let f = Failure {
            hint: Some(Duration::from_secs(4)),
            ..failure()
        };
        let Decision::Queue { ready_at } = decide(f, Instant::now(), |c| c) else {
            panic!("expected a queue")
        };
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(Instant::now() < ready_at);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(Instant::now() >= ready_at);
        // A hint just under what is left still fits; one that uses it all up does not.
        let f = Failure {
            hint: Some(Duration::from_millis(18_999)),
            ..failure()
        };
        assert!(matches!(decide(f, Instant::now(), |c| c), Decision::Queue { .. }));
        let f = Failure {
            hint: Some(Duration::from_secs(19)),
            ..failure()
        };
        assert_eq!(
            decide(f, Instant::now(), |c| c),
            Decision::FailClosed(Stop::RetryAfterExceedsDeadline)
        );
    }

    #[test]
    fn d2_d3_e2_retryability() {
        // spec: D2, D3, E2
        use ErrorClass::*;
        for c in [
            RateLimit,
            Overload,
            ServerError,
            Transient,
            Timeout,
            Unreachable,
            StreamInterrupted,
        ] {
            assert_eq!(retryability(c), Retryability::Transient, "{c:?}");
        }
        for c in [Auth, Quota] {
            assert_eq!(retryability(c), Retryability::ChannelFault, "{c:?}");
        }
        for c in [InvalidRequest, Unknown, MalformedResponse] {
            assert_eq!(retryability(c), Retryability::Never, "{c:?}");
        }
    }
}
