//! R1, R2: this instance's place in a fleet. On a shared (PostgreSQL) ledger it writes a
//! heartbeat with its load, takes over instances whose heartbeat went stale (their
//! in-flight requests become `unknown` for an owner, never re-run; their job leases are
//! released) and keeps the list of instances for the console. With a Redis it watches
//! Redis's health (alerting when the fleet's shared limits fall back to each instance's
//! 1/N, and when they come back), renews the concurrency leases it holds, and applies
//! the breaker transitions other instances publish.

use crate::clock;
use crate::shared::{Shared, StateMessage};
use crate::state::{AppState, Severity};
use futures_util::StreamExt;
use serde::Serialize;
use spillway_ledger::{InstanceRow, TakeOver};
use spillway_wire::UnixMs;
use std::collections::HashMap;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use ts_rs::TS;

/// Heartbeats between two reads of the fleet's keys, balances and spend limits.
const ACCOUNTS_EVERY: u64 = 5;

/// This instance in its fleet.
pub struct Fleet {
    /// Its name: stable across restarts.
    pub instance: String,
    /// Fresh per start.
    pub boot: String,
    pub listen: String,
    pub started_at: UnixMs,
    /// The ledger is shared (PostgreSQL): heartbeats, take-overs and job leases are on.
    pub shared_ledger: bool,
    /// Every instance the ledger knows, as of the last heartbeat.
    instances: RwLock<Vec<InstanceRow>>,
    /// Jobs another instance holds the lease of, not tried again before the time given.
    leased_elsewhere: Mutex<HashMap<String, UnixMs>>,
    /// The newest job change this instance has read from the ledger.
    pub jobs_seen: AtomicI64,
}

/// The fleet as the console shows it.
#[derive(Clone, Debug, Serialize, TS)]
pub struct FleetView {
    /// The instance answering.
    pub instance: String,
    /// `postgres` (shared) or `sqlite` (this instance alone).
    pub ledger: String,
    /// The Redis URL without its password, when one is configured.
    pub redis: Option<String>,
    /// Whether Redis answered this instance's last call.
    pub redis_up: Option<bool>,
    /// N: each instance's share of a limit while Redis is unreachable is 1/N.
    pub share_of: u32,
    pub heartbeat_ms: u64,
    pub stale_after_ms: u64,
    pub instances: Vec<InstanceView>,
    /// Summed over the live instances' last heartbeats.
    pub requests_per_s: f64,
    pub in_flight: i64,
}

#[derive(Clone, Debug, Serialize, TS)]
pub struct InstanceView {
    #[serde(flatten)]
    pub row: InstanceRow,
    /// `live`, `stale` (heartbeat late, not yet taken over), `stopped` or `taken_over`.
    pub status: String,
    /// Milliseconds since its last heartbeat.
    pub heartbeat_age_ms: i64,
    pub this: bool,
}

/// The instance's name when the config gives none: the host's name and the port.
pub fn default_name(listen: std::net::SocketAddr) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", listen.port())
}

impl Fleet {
    pub fn new(instance: String, listen: String, shared_ledger: bool) -> Fleet {
        Fleet {
            instance,
            boot: uuid::Uuid::now_v7().simple().to_string(),
            listen,
            started_at: clock::now(),
            shared_ledger,
            instances: RwLock::new(Vec::new()),
            leased_elsewhere: Mutex::new(HashMap::new()),
            jobs_seen: AtomicI64::new(0),
        }
    }

    /// Whether job `id` was found leased by another instance recently.
    pub fn leased_elsewhere(&self, id: &str, now: UnixMs) -> bool {
        let mut m = self.leased_elsewhere.lock().unwrap_or_else(|p| p.into_inner());
        match m.get(id) {
            Some(until) if *until > now => true,
            Some(_) => {
                m.remove(id);
                false
            }
            None => false,
        }
    }

    pub fn note_leased_elsewhere(&self, id: &str, until: UnixMs) {
        self.leased_elsewhere
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_owned(), until);
    }

    fn row(&self, st: &AppState) -> InstanceRow {
        let load = serde_json::to_string(&st.metrics.headline(clock::now().0 / 1000)).unwrap_or_else(|_| "{}".into());
        InstanceRow {
            id: self.instance.clone(),
            boot: self.boot.clone(),
            listen: self.listen.clone(),
            version: env!("CARGO_PKG_VERSION").into(),
            started_at: self.started_at,
            heartbeat_at: clock::now(),
            stopped_at: None,
            taken_over_by: None,
            unknowns: 0,
            load,
        }
    }

    pub fn view(&self, st: &AppState) -> FleetView {
        let now = clock::now();
        let stale = st.config.fleet.stale_after_ms as i64;
        let rows = self.instances.read().unwrap_or_else(|p| p.into_inner()).clone();
        let rows = if rows.is_empty() { vec![self.row(st)] } else { rows };
        let mut rps = 0.0;
        let mut in_flight = 0;
        let instances: Vec<InstanceView> = rows
            .into_iter()
            .map(|row| {
                let age = now.0 - row.heartbeat_at.0;
                let status = match (&row.stopped_at, &row.taken_over_by) {
                    (Some(_), Some(_)) => "taken_over",
                    (Some(_), None) => "stopped",
                    _ if age > stale => "stale",
                    _ => "live",
                };
                if status == "live" {
                    let load: serde_json::Value = serde_json::from_str(&row.load).unwrap_or_default();
                    rps += load.get("requests_per_s").and_then(|v| v.as_f64()).unwrap_or(0.0);
                    in_flight += load.get("in_flight").and_then(|v| v.as_i64()).unwrap_or(0);
                }
                InstanceView {
                    this: row.id == self.instance,
                    status: status.into(),
                    heartbeat_age_ms: age.max(0),
                    row,
                }
            })
            .collect();
        FleetView {
            instance: self.instance.clone(),
            ledger: if self.shared_ledger { "postgres" } else { "sqlite" }.into(),
            redis: st.shared.as_ref().map(|s| s.redacted.clone()),
            redis_up: st.shared.as_ref().map(|s| s.is_up()),
            share_of: st.shared.as_ref().map_or(1, |s| s.share_of()),
            heartbeat_ms: st.config.fleet.heartbeat_ms,
            stale_after_ms: st.config.fleet.stale_after_ms,
            instances,
            requests_per_s: rps,
            in_flight,
        }
    }
}

/// Joins the fleet before the first request with a first heartbeat (opening the shared
/// ledger already refused a name a live instance uses).
pub async fn join(st: &AppState) -> Result<(), String> {
    let f = &st.fleet;
    if !f.shared_ledger {
        return Ok(());
    }
    let now = clock::now();
    let stale = st.config.fleet.stale_after_ms as i64;
    st.ledger
        .store()
        .heartbeat(&f.row(st), UnixMs(now.0 + 3 * stale))
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// On the way out, once the ledger has taken the last records: a request still in
/// `calling_api` (its final record could not be written) becomes `unknown`, as a crash's
/// would (a stopped instance is never taken over), then the instance is marked stopped
/// and its job leases go with it.
pub async fn leave(st: &AppState) {
    if !st.fleet.shared_ledger {
        return;
    }
    let store = st.ledger.store();
    match store.mark_interrupted_unknown().await {
        Ok(0) => {}
        Ok(n) => tracing::warn!(
            requests = n,
            "requests still calling a provider at shutdown are unknown now"
        ),
        Err(e) => tracing::warn!(error = %e, "could not mark this instance's interrupted requests"),
    }
    if let Err(e) = store.instance_stopped(&st.fleet.instance, clock::now()).await {
        tracing::warn!(error = %e, "could not mark this instance stopped in the ledger");
    }
}

/// The heartbeat, the take-overs and Redis's health, until the gateway stops.
pub fn upkeep(st: &Arc<AppState>) {
    if !st.fleet.shared_ledger && st.shared.is_none() {
        return;
    }
    let weak = Arc::downgrade(st);
    let every = Duration::from_millis(st.config.fleet.heartbeat_ms);
    tokio::spawn(async move {
        let mut round = 0u64;
        loop {
            let Some(st) = weak.upgrade() else { return };
            if st.shutdown.cancel.is_cancelled() {
                return;
            }
            if st.fleet.shared_ledger {
                beat(&st, round).await;
            }
            if let Some(sh) = st.shared.clone() {
                redis_health(&st, &sh, round).await;
            }
            round += 1;
            drop(st);
            tokio::time::sleep(every).await;
        }
    });
    if let Some(sh) = st.shared.clone() {
        follow_breakers(st, sh.clone());
        share_budgets(st, sh);
    }
}

async fn beat(st: &Arc<AppState>, round: u64) {
    let f = &st.fleet;
    let store = st.ledger.store();
    let now = clock::now();
    let stale = st.config.fleet.stale_after_ms as i64;
    // Taken over while alive (its heartbeats stalled past stale_after_ms): the survivor
    // made this instance's in-flight requests unknown and released its jobs. It serves on,
    // but an operator must know: its later records of those requests were refused.
    let me = f
        .instances
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .find(|r| r.id == f.instance)
        .cloned();
    if let Ok(rows) = store.instances().await
        && let Some(mine) = rows.iter().find(|r| r.id == f.instance && r.boot == f.boot)
        && let Some(by) = &mine.taken_over_by
        && me.as_ref().is_none_or(|m| m.taken_over_by.is_none())
    {
        st.alert(
            Severity::Critical,
            format!("This instance ({}) was taken over by {by} while it was running", f.instance),
            format!(
                "Its heartbeat was not written for {stale} ms (a stalled process, an overloaded database, or a clock jump). {} request(s) it was sending were marked unknown and its job leases released; it serves on and writes its heartbeat again. Reconcile those requests in Unknown outcomes; raise fleet.stale_after_ms if this recurs.",
                mine.unknowns
            ),
            Some(f.instance.clone()),
        );
    }
    // B3-B5 across the fleet: keys made or revoked, top-ups and spend limits set on other
    // instances, and every instance's spend, read back from the shared ledger.
    if round > 0
        && round.is_multiple_of(ACCOUNTS_EVERY)
        && let Err(e) = st.accounts.load(&st.config, &st.ledger, now).await
    {
        tracing::warn!(error = %e, "could not read the fleet's keys and balances");
    }
    if let Err(e) = store.heartbeat(&f.row(st), UnixMs(now.0 + 3 * stale)).await {
        tracing::warn!(error = %e, "heartbeat not written");
        return;
    }
    match store.take_over(&f.instance, UnixMs(now.0 - stale), now).await {
        Ok(taken) => {
            for t in taken {
                took_over(st, t).await;
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not look for dead instances"),
    }
    match store.instances().await {
        Ok(rows) => {
            let live = rows
                .iter()
                .filter(|r| r.stopped_at.is_none() && now.0 - r.heartbeat_at.0 <= stale)
                .count() as u32;
            if let Some(sh) = &st.shared {
                sh.set_peers(live);
            }
            *f.instances.write().unwrap_or_else(|p| p.into_inner()) = rows;
        }
        Err(e) => tracing::warn!(error = %e, "could not list the fleet's instances"),
    }
}

/// R1, I4: a dead instance's work, found: an alert naming what an owner must look at;
/// its leased jobs are looked at like a restart's (a run that may have reached the
/// provider sends its job to the dead letter, never runs again).
async fn took_over(st: &Arc<AppState>, t: TakeOver) {
    st.alert(
        Severity::Critical,
        format!("Instance {} stopped answering; this instance took its work over", t.instance),
        format!(
            "Its heartbeat is older than {} ms. {} request(s) it was sending are now `unknown` (reconcile them in Unknown outcomes; they are never re-sent automatically); {} job lease(s) released.",
            st.config.fleet.stale_after_ms,
            t.unknowns,
            t.jobs.len()
        ),
        Some(t.instance.clone()),
    );
    if !t.jobs.is_empty() {
        crate::jobs::adopt(st, &t.jobs).await;
    }
}

async fn redis_health(st: &Arc<AppState>, sh: &Arc<Shared>, round: u64) {
    let was_up = sh.is_up();
    match sh.ping().await {
        Ok(()) => {
            sh.set_up(true);
            // An outage too short to be alerted ends quietly.
            if sh.take_outage_alerted() {
                st.alert(
                    Severity::Resolved,
                    "Redis answers again: limits and breakers are the fleet's again".into(),
                    format!(
                        "{} is back; each key's limits are shared across the fleet again.",
                        sh.redacted
                    ),
                    None,
                );
            }
            if !was_up {
                resync_breakers(st, sh).await;
            }
        }
        Err(e) => {
            sh.set_up(false);
            // Alerted once the outage is seen (by a request or this loop), then every
            // thirty rounds while it lasts.
            if sh.mark_outage_alerted() || round.is_multiple_of(30) {
                st.alert(
                    Severity::Critical,
                    "Redis is unreachable: each instance keeps 1/N of every limit".into(),
                    format!(
                        "{}: {}. Until it answers, every key's rate and concurrency on this instance are 1/{} of the configured ones (the fleet together stays within them), and breaker transitions are not shared.",
                        sh.redacted,
                        e.0,
                        sh.share_of()
                    ),
                    None,
                );
            }
        }
    }
}

/// Applies one published transition, unless it is this instance's own.
fn apply(st: &Arc<AppState>, sh: &Shared, raw: &str) {
    let Some(m) = StateMessage::parse(raw) else { return };
    if m.instance == sh.instance {
        return;
    }
    match m.kind.as_str() {
        "breaker" => st.control.apply_shared(st, &m.subject, &m.saved, &m.instance),
        "channel" => st.control.apply_shared_channel(st, &m.subject, &m.saved, &m.instance),
        "rotation" => crate::control::apply_shared_rotation(st, &m.subject, &m.saved, &m.instance),
        _ => {}
    }
}

/// F4 across the fleet: once a second, each route's budget counts go to Redis and the
/// other instances' come back. B2: the concurrency leases this instance holds are renewed
/// every tenth second, well within their time to live, whatever the heartbeat.
fn share_budgets(st: &Arc<AppState>, sh: Arc<Shared>) {
    let weak = Arc::downgrade(st);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        for tick in 0u64.. {
            every.tick().await;
            let Some(st) = weak.upgrade() else { return };
            if st.shutdown.cancel.is_cancelled() {
                return;
            }
            if !sh.is_up() {
                continue;
            }
            if tick.is_multiple_of(10) && sh.renew().await.is_err() {
                continue;
            }
            let now = clock::now().0;
            for rc in st.control.all() {
                match sh.sync_budget(&rc.name, rc.budget_counts(), now).await {
                    Ok((req, ret)) => rc.set_budget_others(req, ret),
                    Err(_) => break,
                }
            }
        }
    });
}

async fn resync_breakers(st: &Arc<AppState>, sh: &Arc<Shared>) {
    if let Ok(all) = sh.breakers().await {
        for raw in all {
            apply(st, sh, &raw);
        }
    }
}

/// G2 across the fleet: the breaker transitions other instances publish, applied as they
/// arrive; after a reconnect, the latest of each route is read first.
fn follow_breakers(st: &Arc<AppState>, sh: Arc<Shared>) {
    let weak = Arc::downgrade(st);
    tokio::spawn(async move {
        loop {
            let Some(st) = weak.upgrade() else { return };
            if st.shutdown.cancel.is_cancelled() {
                return;
            }
            let cancel = st.shutdown.cancel.clone();
            match sh.subscribe().await {
                Ok(mut stream) => {
                    resync_breakers(&st, &sh).await;
                    drop(st);
                    loop {
                        let msg = tokio::select! {
                            _ = cancel.cancelled() => return,
                            m = stream.next() => m,
                        };
                        let Some(msg) = msg else { break };
                        let Some(st) = weak.upgrade() else { return };
                        if let Ok(raw) = msg.get_payload::<String>() {
                            apply(&st, &sh, &raw);
                        }
                    }
                }
                Err(_) => drop(st),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
}
