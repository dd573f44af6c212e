//! Per-key limits (B1, B2): requests per minute and concurrent requests, both off unless
//! the key configures them. The rate is a GCRA from `governor` (a full minute's allowance
//! may arrive at once, then it refills evenly); concurrency is a semaphore held until the
//! request, stream included, ends. In a fleet (R2) both live in Redis
//! ([`crate::shared`]); while Redis is unreachable each instance keeps 1/N of them here.

use crate::shared::Shared;
use governor::clock::Clock;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use spillway_policy::Key;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// B2: the longest a request waits for its key to have room.
pub const KEY_WAIT: Duration = Duration::from_secs(2);

/// Limiters kept in this process.
struct Local {
    rate: Option<DefaultDirectRateLimiter>,
    concurrency: Option<Arc<Semaphore>>,
}

/// One key's limiters.
pub struct KeyLimits {
    name: String,
    rpm: Option<u32>,
    max_concurrency: Option<u32>,
    local: Local,
    /// R2: this instance's share while Redis is unreachable: (N, limiters at 1/N), made
    /// when an outage begins and dropped when Redis answers again.
    fallback: Mutex<Option<(u32, Arc<Local>)>>,
    /// Requests admitted on that share, charged to the fleet's rate once Redis is back
    /// (or the outage would add its own allowance to the fleet's).
    unpaid: AtomicU32,
}

/// A concurrency lease held in Redis, given back when dropped.
struct RemoteSlot {
    shared: Arc<Shared>,
    id: String,
}

impl Drop for RemoteSlot {
    fn drop(&mut self) {
        self.shared.release_slot(std::mem::take(&mut self.id));
    }
}

/// Room taken on a key; dropping it gives the concurrency slot back.
#[derive(Default)]
pub struct KeySlot {
    _permit: Option<OwnedSemaphorePermit>,
    _remote: Option<RemoteSlot>,
}

/// The key had no room within [`KEY_WAIT`]: retry after this many whole seconds.
#[derive(Debug, PartialEq, Eq)]
pub struct OverLimit {
    pub retry_after_s: u64,
}

impl Local {
    fn new(rpm: Option<u32>, max_concurrency: Option<u32>, burst: bool) -> Local {
        let rate = rpm.and_then(NonZeroU32::new).map(|rpm| {
            let r = RateLimiter::direct(Quota::per_minute(rpm));
            if !burst && let Some(spent) = NonZeroU32::new(rpm.get() - 1) {
                // A share made mid-outage starts with one request's room, not a minute's
                // burst: the burst may already have been spent through Redis.
                let _ = r.check_n(spent);
            }
            r
        });
        Local {
            rate,
            concurrency: max_concurrency.map(|n| Arc::new(Semaphore::new(n.max(1) as usize))),
        }
    }

    async fn acquire(&self, max_wait: Duration, rated: bool) -> Result<KeySlot, OverLimit> {
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
        let slot = KeySlot {
            _permit: permit,
            _remote: None,
        };
        if let Some(rate) = self.rate.as_ref().filter(|_| rated) {
            // GCRA tells exactly when the next request conforms; a few rounds cover a race
            // with other requests of the same key taking that moment first.
            for _ in 0..8 {
                match rate.check() {
                    Ok(()) => return Ok(slot),
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
        Ok(slot)
    }
}

impl KeyLimits {
    pub fn new(key: &Key) -> KeyLimits {
        KeyLimits {
            name: key.name.clone(),
            rpm: key.rpm.filter(|r| *r > 0),
            max_concurrency: key.max_concurrency,
            local: Local::new(key.rpm, key.max_concurrency, true),
            fallback: Mutex::new(None),
            unpaid: AtomicU32::new(0),
        }
    }

    /// Takes room for one request, waiting at most `max_wait` for it; `rated: false`
    /// takes a concurrency slot only, not from the rate (token counting, by default).
    /// With `shared` (a fleet's Redis) the room is the fleet's.
    pub async fn acquire(
        &self,
        shared: Option<&Arc<Shared>>,
        max_wait: Duration,
        rated: bool,
    ) -> Result<KeySlot, OverLimit> {
        if self.rpm.is_none() && self.max_concurrency.is_none() {
            return Ok(KeySlot::default());
        }
        let Some(sh) = shared else {
            return self.local.acquire(max_wait, rated).await;
        };
        let started = tokio::time::Instant::now();
        if sh.is_up() {
            let unpaid = self.unpaid.swap(0, Ordering::AcqRel);
            if let (Some(rpm), 1..) = (self.rpm, unpaid)
                && sh.charge(&self.name, rpm, unpaid).await.is_err()
            {
                self.unpaid.fetch_add(unpaid, Ordering::AcqRel);
            }
        }
        if sh.is_up() {
            match self.acquire_shared(sh, max_wait, rated).await {
                Ok(r) => {
                    self.fallback.lock().unwrap_or_else(|p| p.into_inner()).take();
                    return r;
                }
                Err(e) => {
                    tracing::debug!(error = %e.0, key = %self.name, "shared limits unreachable; using this instance's share")
                }
            }
        }
        let share = self.share(sh.share_of());
        let r = share.acquire(max_wait.saturating_sub(started.elapsed()), rated).await;
        if r.is_ok() && rated && self.rpm.is_some() {
            self.unpaid.fetch_add(1, Ordering::AcqRel);
        }
        r
    }

    /// This instance's 1/N of the key's limits, made at the outage's start.
    fn share(&self, n: u32) -> Arc<Local> {
        let mut f = self.fallback.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((had, l)) = f.as_ref()
            && *had == n
        {
            return l.clone();
        }
        let l = Arc::new(Local::new(
            self.rpm.map(|r| (r / n).max(1)),
            self.max_concurrency.map(|c| c.div_ceil(n).max(1)),
            false,
        ));
        *f = Some((n, l.clone()));
        l
    }

    async fn acquire_shared(
        &self,
        sh: &Arc<Shared>,
        max_wait: Duration,
        rated: bool,
    ) -> Result<Result<KeySlot, OverLimit>, crate::shared::Down> {
        let deadline = tokio::time::Instant::now() + max_wait;
        let mut slot = KeySlot::default();
        if let Some(max) = self.max_concurrency {
            loop {
                if let Some(id) = sh.take_slot(&self.name, max.max(1)).await? {
                    slot._remote = Some(RemoteSlot { shared: sh.clone(), id });
                    break;
                }
                if tokio::time::Instant::now() + SLOT_POLL > deadline {
                    return Ok(Err(OverLimit { retry_after_s: 1 }));
                }
                tokio::time::sleep(SLOT_POLL).await;
            }
        }
        let Some(rpm) = self.rpm.filter(|_| rated) else {
            return Ok(Ok(slot));
        };
        for _ in 0..8 {
            let wait = sh.rate(&self.name, rpm).await?;
            if wait.is_zero() {
                return Ok(Ok(slot));
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if wait > left {
                return Ok(Err(OverLimit {
                    retry_after_s: crate::error::retry_after_secs(wait),
                }));
            }
            tokio::time::sleep(wait).await;
        }
        Ok(Err(OverLimit { retry_after_s: 1 }))
    }
}

/// How often a waiting request asks Redis again for a slot held elsewhere.
const SLOT_POLL: Duration = Duration::from_millis(25);

#[cfg(test)]
mod tests {
    use super::*;
    use spillway_policy::{KeySecret, SecretUrl};

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
            assert!(l.acquire(None, Duration::ZERO, true).await.is_ok());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn b2_concurrency_waits_then_refuses() {
        // spec: B2
        let l = KeyLimits::new(&key(None, Some(1)));
        let held = l.acquire(None, KEY_WAIT, true).await.unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(
            l.acquire(None, KEY_WAIT, true).await.err(),
            Some(OverLimit { retry_after_s: 1 })
        );
        assert_eq!(started.elapsed(), KEY_WAIT, "waits exactly the 2 s, then refuses");
        // Room that frees within the wait admits the waiter, the moment it frees.
        let l = Arc::new(l);
        let l2 = l.clone();
        let waiter = tokio::spawn(async move {
            let t = tokio::time::Instant::now();
            l2.acquire(None, KEY_WAIT, true).await.map(|_| t.elapsed())
        });
        tokio::time::sleep(Duration::from_millis(700)).await;
        drop(held);
        assert_eq!(waiter.await.unwrap(), Ok(Duration::from_millis(700)));
    }

    #[tokio::test]
    async fn b2_rate_refusal_names_the_whole_seconds_to_wait() {
        // spec: B2
        let l = KeyLimits::new(&key(Some(2), None));
        assert!(l.acquire(None, Duration::ZERO, true).await.is_ok());
        assert!(l.acquire(None, Duration::ZERO, true).await.is_ok());
        // 2 per minute refill one every 30 s: the third is 30 s away, past the 2 s wait.
        let e = l.acquire(None, KEY_WAIT, true).await.err().unwrap();
        assert!((29..=30).contains(&e.retry_after_s), "{e:?}");
    }

    /// The fleet's Redis for these tests (`make test` starts one), else None after saying
    /// so; `SPILLWAY_REQUIRE_SERVICES=1` makes its absence a failure.
    fn test_redis() -> Option<SecretUrl> {
        match std::env::var("SPILLWAY_TEST_REDIS") {
            Ok(u) if !u.is_empty() => Some(SecretUrl(u)),
            _ if std::env::var("SPILLWAY_REQUIRE_SERVICES").as_deref() == Ok("1") => {
                panic!("SPILLWAY_TEST_REDIS is not set; run `make test`, or scripts/services start DIR")
            }
            _ => {
                eprintln!("skipped the Redis half: SPILLWAY_TEST_REDIS is not set (make test sets it)");
                None
            }
        }
    }

    /// Redis's call timeout in these tests: a debug build beside other tests on two busy
    /// cores can take longer than a gateway's 300 ms, which would read as an outage.
    const SLOW_MACHINE: Duration = Duration::from_secs(5);

    fn unique(prefix: &str) -> String {
        format!("{prefix}-{}", uuid::Uuid::now_v7().simple())
    }

    #[tokio::test]
    async fn r2_three_instances_share_one_rpm() {
        // spec: R2
        let Some(url) = test_redis() else { return };
        let name = unique("rpm");
        let mut k = key(Some(30), None);
        k.name = name;
        let fleet: Vec<(Arc<Shared>, KeyLimits)> = ["a", "b", "c"]
            .iter()
            .map(|i| {
                (
                    Shared::with_timeout(&url, i, None, SLOW_MACHINE).unwrap(),
                    KeyLimits::new(&k),
                )
            })
            .collect();
        let mut admitted = 0;
        let t = std::time::Instant::now();
        for n in 0..90 {
            let (sh, l) = &fleet[n % 3];
            if l.acquire(Some(sh), Duration::ZERO, true).await.is_ok() {
                admitted += 1;
            }
            assert!(sh.is_up(), "Redis answered");
        }
        // A minute's burst of 30 across the three, plus one more each 2 s the 90 calls
        // took (one, unless the machine is very slow).
        let refills = 1 + t.elapsed().as_secs() / 2;
        assert!(
            (30..=30 + refills).contains(&admitted),
            "admitted {admitted} of 90 with rpm 30 on three instances in {:?}",
            t.elapsed()
        );
    }

    #[tokio::test]
    async fn r2_concurrency_is_the_fleets_and_a_slot_comes_back_when_dropped() {
        // spec: R2
        let Some(url) = test_redis() else { return };
        let mut k = key(None, Some(2));
        k.name = unique("conc");
        let (a, b) = (
            Shared::with_timeout(&url, "a", None, SLOW_MACHINE).unwrap(),
            Shared::with_timeout(&url, "b", None, SLOW_MACHINE).unwrap(),
        );
        let (la, lb) = (KeyLimits::new(&k), KeyLimits::new(&k));
        let one = la.acquire(Some(&a), Duration::ZERO, true).await.unwrap();
        let _two = lb.acquire(Some(&b), Duration::ZERO, true).await.unwrap();
        assert_eq!(
            la.acquire(Some(&a), Duration::from_millis(100), true).await.err(),
            Some(OverLimit { retry_after_s: 1 }),
            "two held across the fleet"
        );
        drop(one);
        let t = tokio::time::Instant::now();
        assert!(
            lb.acquire(Some(&b), Duration::from_secs(2), true).await.is_ok(),
            "the slot given back on one instance is taken on another"
        );
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test]
    async fn r2_without_redis_each_instance_keeps_its_share_from_one_request() {
        // spec: R2
        // Nothing listens on port 1: every call fails at once.
        let down = Shared::new(&SecretUrl("redis://127.0.0.1:1/0".into()), "a", Some(3)).unwrap();
        let l = KeyLimits::new(&key(Some(90), Some(4)));
        let first = l.acquire(Some(&down), Duration::ZERO, true).await;
        assert!(first.is_ok(), "a request is never refused because Redis is down");
        assert!(!down.is_up(), "the failure was noticed");
        // 90 a minute on 3 instances: 30 here, one every 2 s, with no minute's burst.
        let e = l.acquire(Some(&down), Duration::ZERO, true).await.err().unwrap();
        assert_eq!(e.retry_after_s, 2, "{e:?}");
        // Concurrency: ceil(4 / 3) = 2 slots here.
        let _a = l.acquire(Some(&down), Duration::ZERO, false).await.unwrap();
        assert!(
            l.acquire(Some(&down), Duration::ZERO, false).await.is_err(),
            "a third slot while the first two are held"
        );
        drop(first);
    }

    #[tokio::test]
    async fn r2_what_a_share_admitted_in_an_outage_is_charged_to_the_fleet_when_redis_is_back() {
        // spec: R2
        let Some(url) = test_redis() else { return };
        let mut k = key(Some(3), None);
        k.name = unique("charge");
        let sh = Shared::with_timeout(&url, "a", Some(1), SLOW_MACHINE).unwrap();
        let l = KeyLimits::new(&k);
        // Redis is taken for gone: this instance's share (all of it, N = 1) admits one.
        sh.set_up(false);
        assert!(l.acquire(Some(&sh), Duration::ZERO, true).await.is_ok());
        sh.set_up(true);
        // Back: the one admitted meanwhile is charged first, so the minute's 3 are 2 now.
        let admitted = {
            let mut n = 0;
            for _ in 0..5 {
                n += usize::from(l.acquire(Some(&sh), Duration::ZERO, true).await.is_ok());
            }
            n
        };
        assert_eq!(admitted, 2);
        // A long outage's admissions never lock the key out past a minute.
        sh.set_up(false);
        for _ in 0..1000 {
            l.unpaid.fetch_add(1, Ordering::AcqRel);
        }
        sh.set_up(true);
        let e = l.acquire(Some(&sh), Duration::ZERO, true).await.err().unwrap();
        assert!(e.retry_after_s <= 60, "{e:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn b1_token_counting_takes_no_rate_unless_the_key_says_so() {
        // spec: B1
        let l = KeyLimits::new(&key(Some(1), None));
        assert!(l.acquire(None, Duration::ZERO, true).await.is_ok());
        for _ in 0..5 {
            assert!(
                l.acquire(None, Duration::ZERO, false).await.is_ok(),
                "counting took from the rate"
            );
        }
        assert!(l.acquire(None, Duration::ZERO, true).await.is_err());
    }
}
