//! R2: what a fleet's instances share through Redis: each key's rate (a GCRA whose
//! theoretical arrival time lives in Redis, one atomic script per request) and
//! concurrency (a sorted set of leases that expire unless their holder renews them, so a
//! dead instance's slots free themselves), and breaker transitions (a hash of the latest
//! state per route plus a pub/sub message, applied by every other instance as it
//! arrives).
//!
//! Redis time, not each instance's clock, decides the rate. When Redis cannot be reached
//! an instance fails safe: each key's limits fall to 1/N of the configured ones (N the
//! instances the ledger last saw alive, or `fleet.expected_instances`), starting with no
//! burst, so the fleet together stays within the limit; an alert says so, and the shared
//! limits come back with Redis.

use redis::aio::ConnectionManager;
use redis::{AsyncCommands, Script};
use spillway_policy::SecretUrl;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

/// Longest a Redis call may take before this instance treats Redis as gone: a stuck
/// Redis must not hold requests longer than a missing one does.
pub const CALL_TIMEOUT: Duration = Duration::from_millis(300);
/// A concurrency lease lives this long unless renewed (every third of it).
pub const LEASE_TTL_MS: u64 = 30_000;

const PREFIX: &str = "spillway";
const BREAKERS: &str = "spillway:breakers";
const BREAKER_CHANNEL: &str = "spillway:breaker";
/// Another instance's retry-budget counts older than this are left out (it stopped, or
/// cannot reach Redis).
const BUDGET_FRESH_MS: i64 = 3_000;

/// GCRA on Redis time, in microseconds (Lua's numbers hold them exactly). KEYS[1]: the
/// key's theoretical arrival time. ARGV: emission interval and burst tolerance. Returns 0
/// when the request conforms (and takes its place), else the microseconds until it would.
static GCRA: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local wait = tat - now - tolerance
if wait > 0 then return wait end
local new = tat + interval
redis.call('SET', KEYS[1], string.format('%d', new), 'PX', math.floor((new - now) / 1000) + 1000)
return 0
",
    )
});

/// Charges a key's rate with requests admitted without Redis (during an outage, on an
/// instance's own share): they move its theoretical arrival time on, refusing nothing,
/// and never past a minute from now: what a long outage admitted is older than the
/// window a rate per minute judges, and must not lock the key out for as long again.
/// KEYS[1]: the key's theoretical arrival time; ARGV: emission interval, requests.
static CHARGE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
tat = math.min(tat + tonumber(ARGV[1]) * tonumber(ARGV[2]), now + 60000000)
redis.call('SET', KEYS[1], string.format('%d', tat), 'PX', math.floor((tat - now) / 1000) + 1000)
return 0
",
    )
});

/// A concurrency lease. KEYS[1]: the key's leases (member: lease id, score: expiry ms).
/// ARGV: limit, lease id, ttl. Returns 1 when taken.
static TAKE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) * 2)
  return 1
end
return 0
",
    )
});

/// Renews a held lease. KEYS[1]: the leases; ARGV: lease id, ttl.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
return 1
",
    )
});

/// A rate's emission interval and burst tolerance in microseconds: a minute's allowance
/// at once, then one every interval.
fn gcra_params(rpm: u32) -> (u64, u64) {
    let interval_us = (60_000_000 / u64::from(rpm.max(1))).max(1);
    (interval_us, 60_000_000u64.saturating_sub(interval_us))
}

/// Redis did not answer (or answered with an error): the caller falls back to its local
/// share.
#[derive(Debug)]
pub struct Down(pub String);

impl<E: std::fmt::Display> From<E> for Down {
    fn from(e: E) -> Down {
        Down(e.to_string())
    }
}

/// The fleet's shared state in Redis, as this instance reaches it.
pub struct Shared {
    client: redis::Client,
    conn: ConnectionManager,
    /// This instance's name: messages it published itself are not applied again.
    pub instance: String,
    /// The URL without its password, for the console and logs.
    pub redacted: String,
    up: AtomicBool,
    /// The instances alive at the last heartbeat (the N of 1/N), at least 1.
    peers: AtomicU32,
    /// `fleet.expected_instances`, when set: the N instead of the live count.
    expected: Option<u32>,
    /// Concurrency leases this instance holds (id → key), renewed until released.
    held: Mutex<HashMap<String, String>>,
    /// Redis errors seen; an outage's first one is in the alert.
    pub errors: AtomicU32,
    /// The current outage has been alerted (a request may notice it before the health
    /// loop does: the alert must still go out, once).
    outage_alerted: AtomicBool,
    /// Pub/sub channels are global across a Redis's databases: the channel names the
    /// database, so fleets on one Redis (and parallel tests) stay apart.
    channel: String,
    /// How long a call may take before Redis counts as gone ([`CALL_TIMEOUT`]).
    timeout: Duration,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// A handle on the Redis at `url`; it connects on first use and reconnects by itself.
    pub fn new(url: &SecretUrl, instance: &str, expected: Option<u32>) -> Result<Arc<Shared>, Down> {
        Shared::with_timeout(url, instance, expected, CALL_TIMEOUT)
    }

    /// [`Shared::new`] with another call timeout: tests on a loaded machine give Redis
    /// longer than a gateway would, so that a slow moment does not read as an outage.
    pub(crate) fn with_timeout(
        url: &SecretUrl,
        instance: &str,
        expected: Option<u32>,
        timeout: Duration,
    ) -> Result<Arc<Shared>, Down> {
        let client = redis::Client::open(url.0.as_str()).map_err(|e| Down(format!("{e} ({})", url.redacted())))?;
        let cfg = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), cfg)?;
        let channel = format!(
            "{BREAKER_CHANNEL}:{}",
            client.get_connection_info().redis_settings().db()
        );
        Ok(Arc::new(Shared {
            client,
            conn,
            instance: instance.to_owned(),
            redacted: url.redacted(),
            up: AtomicBool::new(true),
            peers: AtomicU32::new(1),
            expected,
            held: Mutex::new(HashMap::new()),
            errors: AtomicU32::new(0),
            outage_alerted: AtomicBool::new(false),
            channel,
            timeout,
        }))
    }

    async fn timed<T>(&self, f: impl std::future::Future<Output = redis::RedisResult<T>>) -> Result<T, Down> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Down(e.to_string())),
            Err(_) => Err(Down(format!("no answer within {} ms", self.timeout.as_millis()))),
        }
    }

    /// Whether the last call reached Redis.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Records how a call went; returns true when that changed whether Redis is up.
    pub fn set_up(&self, up: bool) -> bool {
        if !up {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.up.swap(up, Ordering::AcqRel) != up
    }

    /// True the first time it is called in an outage: that caller raises the alert.
    pub fn mark_outage_alerted(&self) -> bool {
        !self.outage_alerted.swap(true, Ordering::AcqRel)
    }

    /// True when the outage that ended had been alerted (its recovery is told too).
    pub fn take_outage_alerted(&self) -> bool {
        self.outage_alerted.swap(false, Ordering::AcqRel)
    }

    /// N: this instance's share of every limit is 1/N while Redis is unreachable.
    pub fn share_of(&self) -> u32 {
        self.expected
            .unwrap_or_else(|| self.peers.load(Ordering::Relaxed))
            .max(1)
    }

    pub fn set_peers(&self, n: u32) {
        self.peers.store(n.max(1), Ordering::Relaxed);
    }

    fn conn(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// A round trip, for the health loop.
    pub async fn ping(&self) -> Result<(), Down> {
        let mut c = self.conn();
        self.timed(redis::cmd("PING").query_async::<String>(&mut c))
            .await
            .map(|_| ())
    }

    fn note<T>(&self, r: Result<T, Down>) -> Result<T, Down> {
        if r.is_err() {
            self.set_up(false);
        }
        r
    }

    /// B1 across the fleet: 0 when a request of key `key` (at most `rpm` a minute, a full
    /// minute's burst) may go now, else how long until it may.
    pub async fn rate(&self, key: &str, rpm: u32) -> Result<Duration, Down> {
        let (interval_us, tolerance) = gcra_params(rpm);
        let mut c = self.conn();
        let wait: i64 = self.note(
            self.timed(
                GCRA.key(format!("{PREFIX}:rpm:{key}"))
                    .arg(interval_us)
                    .arg(tolerance)
                    .invoke_async(&mut c),
            )
            .await,
        )?;
        Ok(Duration::from_micros(wait.max(0) as u64))
    }

    /// R2: `n` requests of key `key` admitted on this instance's share while Redis was
    /// unreachable, charged to the fleet's rate now that it is back.
    pub async fn charge(&self, key: &str, rpm: u32, n: u32) -> Result<(), Down> {
        let (interval_us, _) = gcra_params(rpm);
        let mut c = self.conn();
        let _: i64 = self.note(
            self.timed(
                CHARGE
                    .key(format!("{PREFIX}:rpm:{key}"))
                    .arg(interval_us)
                    .arg(n)
                    .invoke_async(&mut c),
            )
            .await,
        )?;
        Ok(())
    }

    /// B2 across the fleet: a concurrency lease on key `key` (at most `max` at once), or
    /// None when all are held.
    pub async fn take_slot(&self, key: &str, max: u32) -> Result<Option<String>, Down> {
        let id = format!("{}:{}", self.instance, uuid::Uuid::now_v7().simple());
        let zkey = format!("{PREFIX}:conc:{key}");
        let mut c = self.conn();
        let took: i64 = self.note(
            self.timed(TAKE.key(&zkey).arg(max).arg(&id).arg(LEASE_TTL_MS).invoke_async(&mut c))
                .await,
        )?;
        if took == 1 {
            lock(&self.held).insert(id.clone(), zkey);
            Ok(Some(id))
        } else {
            Ok(None)
        }
    }

    /// Gives a lease back (in the background: a request's end must not wait for Redis;
    /// a lease that cannot be given back expires).
    pub fn release_slot(self: &Arc<Self>, id: String) {
        let Some(zkey) = lock(&self.held).remove(&id) else {
            return;
        };
        let me = self.clone();
        tokio::spawn(async move {
            let mut c = me.conn();
            let r: Result<i64, Down> = me.timed(c.zrem(&zkey, &id)).await;
            if r.is_err() {
                me.set_up(false);
            }
        });
    }

    /// Renews every lease still held; a holder that died stops renewing, and its leases
    /// expire within [`LEASE_TTL_MS`].
    pub async fn renew(&self) -> Result<(), Down> {
        let held: Vec<(String, String)> = lock(&self.held).iter().map(|(i, k)| (i.clone(), k.clone())).collect();
        let mut c = self.conn();
        for (id, zkey) in held {
            let _: i64 = self.note(
                self.timed(RENEW.key(&zkey).arg(&id).arg(LEASE_TTL_MS).invoke_async(&mut c))
                    .await,
            )?;
        }
        Ok(())
    }

    /// G2, D5 across the fleet: a breaker (`kind` "breaker", subject its route) or channel
    /// ejection (`channel`, its name) transition of this instance, its saved snapshot as
    /// JSON, for every other instance to apply.
    pub async fn publish_state(&self, kind: &str, subject: &str, saved: &str) -> Result<(), Down> {
        let msg = serde_json::json!({ "instance": self.instance, "kind": kind, "subject": subject, "saved": saved })
            .to_string();
        let mut c = self.conn();
        let mut p = redis::pipe();
        p.atomic()
            .hset(BREAKERS, format!("{kind}/{subject}"), &msg)
            .ignore()
            .publish(&self.channel, &msg)
            .ignore();
        self.note(self.timed(p.query_async::<()>(&mut c)).await)
    }

    /// F4 across the fleet: tells Redis this instance's (new requests, retries) on `route`
    /// over the budget's window, and reads the other live instances' sums.
    pub async fn sync_budget(&self, route: &str, own: (u64, u64), now_ms: i64) -> Result<(u64, u64), Down> {
        let key = format!("{PREFIX}:budget:{route}");
        let mut c = self.conn();
        let mut p = redis::pipe();
        p.hset(&key, &self.instance, format!("{} {} {now_ms}", own.0, own.1))
            .ignore()
            .pexpire(&key, BUDGET_FRESH_MS * 10)
            .ignore()
            .hgetall(&key);
        let (all,): (HashMap<String, String>,) = self.note(self.timed(p.query_async(&mut c)).await)?;
        let mut others = (0, 0);
        for (instance, v) in all {
            let mut it = v.split(' ').map(|x| x.parse::<i64>().unwrap_or(0));
            let (req, ret, at) = (it.next().unwrap_or(0), it.next().unwrap_or(0), it.next().unwrap_or(0));
            // A stopped instance's last counts are not the fleet's any more.
            if instance != self.instance && now_ms - at <= BUDGET_FRESH_MS {
                others.0 += req.max(0) as u64;
                others.1 += ret.max(0) as u64;
            }
        }
        Ok(others)
    }

    /// Every breaker's and channel's latest transition as Redis has it (a message each).
    pub async fn breakers(&self) -> Result<Vec<String>, Down> {
        let mut c = self.conn();
        let all: HashMap<String, String> = self.note(self.timed(c.hgetall(BREAKERS)).await)?;
        Ok(all.into_values().collect())
    }

    /// Transitions as other instances publish them, until the connection drops.
    pub async fn subscribe(&self) -> Result<redis::aio::PubSubStream, Down> {
        let mut ps = self.timed(self.client.get_async_pubsub()).await?;
        self.timed(ps.subscribe(&self.channel)).await?;
        Ok(ps.into_on_message())
    }
}

/// A published transition: who published it, of what (`breaker` or `channel`, and its
/// route or channel name), and the saved snapshot.
pub struct StateMessage {
    pub instance: String,
    pub kind: String,
    pub subject: String,
    pub saved: String,
}

impl StateMessage {
    pub fn parse(s: &str) -> Option<StateMessage> {
        let v: serde_json::Value = serde_json::from_str(s).ok()?;
        Some(StateMessage {
            instance: v.get("instance")?.as_str()?.to_owned(),
            kind: v.get("kind")?.as_str()?.to_owned(),
            subject: v.get("subject")?.as_str()?.to_owned(),
            saved: v.get("saved")?.as_str()?.to_owned(),
        })
    }
}
