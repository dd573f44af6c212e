//! Per-key limits (B1, B2): requests per minute and concurrent requests, both off unless
//! the key configures them. The rate is a GCRA from `governor` (a full minute's allowance
//! may arrive at once, then it refills evenly); concurrency is a semaphore held until the
//! request, stream included, ends.

use governor::clock::Clock;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use spillway_policy::Key;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// B2: the longest a request waits for its key to have room.
pub const KEY_WAIT: Duration = Duration::from_secs(2);

/// One key's limiters.
pub struct KeyLimits {
    rate: Option<DefaultDirectRateLimiter>,
    concurrency: Option<Arc<Semaphore>>,
}

/// Room taken on a key; dropping it gives the concurrency slot back.
pub struct KeySlot(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

/// The key had no room within [`KEY_WAIT`]: retry after this many whole seconds.
#[derive(Debug, PartialEq, Eq)]
pub struct OverLimit {
    pub retry_after_s: u64,
}

impl KeyLimits {
    pub fn new(key: &Key) -> KeyLimits {
        KeyLimits {
            rate: key
                .rpm
                .and_then(NonZeroU32::new)
                .map(|rpm| RateLimiter::direct(Quota::per_minute(rpm))),
            concurrency: key.max_concurrency.map(|n| Arc::new(Semaphore::new(n.max(1) as usize))),
        }
    }

    /// Takes room for one request, waiting at most `max_wait` for it; `rated: false`
    /// takes a concurrency slot only, not from the rate (token counting, by default).
    pub async fn acquire(&self, max_wait: Duration, rated: bool) -> Result<KeySlot, OverLimit> {
        let deadline = tokio::time::Instant::now() + max_wait;
        let permit = match &self.concurrency {
            None => None,
            Some(sem) => match sem.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => match tokio::time::timeout_at(deadline, sem.clone().acquire_owned()).await {
                    Ok(Ok(p)) => Some(p),
                    // Slots free as requests end; one second is an honest guess at when.
                    _ => return Err(OverLimit { retry_after_s: 1 }),
                },
            },
        };
        if let Some(rate) = self.rate.as_ref().filter(|_| rated) {
            // GCRA tells exactly when the next request conforms; a few rounds cover a race
            // with other requests of the same key taking that moment first.
            for _ in 0..8 {
                match rate.check() {
                    Ok(()) => return Ok(KeySlot(permit)),
                    Err(not_until) => {
                        let wait = not_until.wait_time_from(rate.clock().now());
                        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                        if wait > left {
                            return Err(OverLimit {
                                retry_after_s: crate::error::retry_after_secs(wait),
                            });
                        }
                        tokio::time::sleep(wait).await;
                    }
                }
            }
            return Err(OverLimit { retry_after_s: 1 });
        }
        Ok(KeySlot(permit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spillway_policy::KeySecret;

    fn key(rpm: Option<u32>, max_concurrency: Option<u32>) -> Key {
        Key {
            name: "k".into(),
            owner: "o".into(),
            secret: KeySecret([0; 32]),
            rpm,
            rpm_counts_token_counting: false,
            max_concurrency,
            spend_limit_usd: None,
            workflow: None,
        }
    }

    #[tokio::test]
    async fn b1_limits_are_off_by_default() {
        // spec: B1
        let l = KeyLimits::new(&key(None, None));
        for _ in 0..1000 {
            assert!(l.acquire(Duration::ZERO, true).await.is_ok());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn b2_concurrency_waits_then_refuses() {
        // spec: B2
        let l = KeyLimits::new(&key(None, Some(1)));
        let held = l.acquire(KEY_WAIT, true).await.unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(
            l.acquire(KEY_WAIT, true).await.err(),
            Some(OverLimit { retry_after_s: 1 })
        );
        assert_eq!(started.elapsed(), KEY_WAIT, "waits exactly the 2 s, then refuses");
        // Room that frees within the wait admits the waiter, the moment it frees.
        let l = Arc::new(l);
        let l2 = l.clone();
        let waiter = tokio::spawn(async move {
            let t = tokio::time::Instant::now();
            l2.acquire(KEY_WAIT, true).await.map(|_| t.elapsed())
        });
        tokio::time::sleep(Duration::from_millis(700)).await;
        drop(held);
        assert_eq!(waiter.await.unwrap(), Ok(Duration::from_millis(700)));
    }

    #[tokio::test]
    async fn b2_rate_refusal_names_the_whole_seconds_to_wait() {
        // spec: B2
        let l = KeyLimits::new(&key(Some(2), None));
        assert!(l.acquire(Duration::ZERO, true).await.is_ok());
        assert!(l.acquire(Duration::ZERO, true).await.is_ok());
        // 2 per minute refill one every 30 s: the third is 30 s away, past the 2 s wait.
        let e = l.acquire(KEY_WAIT, true).await.err().unwrap();
        assert!((29..=30).contains(&e.retry_after_s), "{e:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn b1_token_counting_takes_no_rate_unless_the_key_says_so() {
        // spec: B1
        let l = KeyLimits::new(&key(Some(1), None));
        assert!(l.acquire(Duration::ZERO, true).await.is_ok());
        for _ in 0..5 {
            assert!(
                l.acquire(Duration::ZERO, false).await.is_ok(),
                "counting took from the rate"
            );
        }
        assert!(l.acquire(Duration::ZERO, true).await.is_err());
    }
}
