//! Money on the request path (B3–B5, M1, M3, G1's cost trigger): the gateway keys (from
//! the config and made at run time), each owner's balance and day's spend, each key's
//! spend and limit, each route's day and last hour, and the pricing catalog in force.
//!
//! The ledger is the truth and this is its running copy: at start-up every balance is
//! read back as credits minus the requests' costs, and from then on a request's cost is
//! taken here as it closes (its record carries the same cost to the ledger). Nothing on
//! the request path waits for the ledger because of money.

use crate::error::GatewayError;
use crate::limits::KeyLimits;
use crate::state::KeyRt;
use serde::Serialize;
use spillway_ledger::{Ledger, StoredKey};
use spillway_policy::{Config, Key, KeySecret, Pricing};
use spillway_wire::UnixMs;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use ts_rs::TS;

/// Routes whose day and hour are followed in memory (budgeted ones always are).
const MAX_ROUTES: usize = 4096;

/// M3: the output an estimate assumes when the client sets no cap.
pub const ASSUMED_OUTPUT_TOKENS: u64 = 1024;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An owner's running figures.
#[derive(Debug, Default)]
struct OwnerFigures {
    /// Held to a balance (B3): the config seeds one, or a credit is on record. An owner
    /// without is only metered.
    prepaid: bool,
    /// Credits minus costs.
    balance_usd: f64,
    /// The day (in the budgets' time zone) `spent_today` is for.
    day: i32,
    spent_today: f64,
}

/// One owner: whose balance and budget the keys draw on.
pub struct OwnerAccount {
    pub name: String,
    pub daily_budget_usd: Option<f64>,
    figures: Mutex<OwnerFigures>,
}

/// A key's running spend and the limit in force.
#[derive(Debug, Default)]
pub struct KeySpendRt {
    pub spent_usd: f64,
    pub limit_usd: Option<f64>,
}

/// A route's spend: today's, and the last hour's by minute (G1).
#[derive(Debug, Default)]
struct RouteSpend {
    day: i32,
    spent_today: f64,
    /// (minute since the epoch, USD) for the last 60 minutes, oldest first.
    minutes: std::collections::VecDeque<(i64, f64)>,
}

impl RouteSpend {
    fn last_hour(&mut self, minute: i64) -> f64 {
        while self.minutes.front().is_some_and(|(m, _)| *m <= minute - 60) {
            self.minutes.pop_front();
        }
        self.minutes.iter().map(|(_, v)| v).sum()
    }

    fn add(&mut self, minute: i64, usd: f64) {
        match self.minutes.back_mut() {
            Some((m, v)) if *m == minute => *v += usd,
            _ => self.minutes.push_back((minute, usd)),
        }
    }
}

/// A key as the console lists it.
#[derive(Clone, Debug, Serialize, TS)]
pub struct KeyView {
    pub name: String,
    pub owner: String,
    /// `config` or `console` (made at run time, revocable).
    pub origin: String,
    /// The secret's first characters, for made keys.
    pub hint: Option<String>,
    pub rpm: Option<u32>,
    pub max_concurrency: Option<u32>,
    pub spend_limit_usd: Option<f64>,
    pub spent_usd: f64,
    pub created_at: Option<UnixMs>,
    pub created_by: Option<String>,
    pub revoked_at: Option<UnixMs>,
    pub revoked_by: Option<String>,
}

/// An owner as the console shows it.
#[derive(Clone, Debug, Serialize, TS)]
pub struct OwnerView {
    pub name: String,
    /// Credits minus costs; with `prepaid` false the owner is not held to it.
    pub balance_usd: f64,
    pub prepaid: bool,
    pub daily_budget_usd: Option<f64>,
    pub spent_today_usd: f64,
}

/// A route's budget as the console shows it.
#[derive(Clone, Debug, Serialize, TS)]
pub struct RouteBudgetView {
    pub route: String,
    pub daily_budget_usd: Option<f64>,
    pub spent_today_usd: f64,
    pub last_hour_usd: f64,
}

/// What a closed request's cost did to its route: G1's figures.
pub struct RouteHour {
    pub last_hour_usd: f64,
    pub daily_budget_usd: f64,
}

pub struct Accounts {
    /// Gateway keys by the SHA-256 of their secret (B5): the secret itself is never held.
    keys: RwLock<HashMap<[u8; 32], Arc<KeyRt>>>,
    owners: RwLock<HashMap<String, Arc<OwnerAccount>>>,
    /// Made keys (revoked ones included), for the console.
    made: RwLock<Vec<StoredKey>>,
    routes: Mutex<HashMap<String, RouteSpend>>,
    /// The catalog in force; None until first asked for when it is the built-in one, so
    /// an idle gateway does not hold it.
    pricing: RwLock<Option<Arc<Pricing>>>,
    /// The budgets' day: read from the system's tz database (a compiled-in one costs the
    /// idle gateway over 2 MiB of relocated tables for the few hundred zones it never uses).
    tz: tz::TimeZone,
    tz_name: String,
    route_budgets: BTreeMap<String, f64>,
}

impl Accounts {
    /// The config's keys and owners with fresh figures (no ledger read yet; see
    /// [`Accounts::load`]).
    /// `pricing` is the config's catalog; None for the built-in one (read on first use).
    pub fn new(config: &Config, pricing: Option<Pricing>) -> Result<Accounts, String> {
        let name = config.budgets.time_zone.as_str();
        let tz = if name == "UTC" {
            tz::TimeZone::utc()
        } else {
            tz::TimeZone::from_posix_tz(name).map_err(|e| {
                format!("budgets.time_zone: `{name}` is not in this system's tz database (/usr/share/zoneinfo): {e}")
            })?
        };
        let owners: HashMap<String, Arc<OwnerAccount>> = config
            .owners
            .iter()
            .map(|o| {
                let acct = OwnerAccount {
                    name: o.name.clone(),
                    daily_budget_usd: o.daily_budget_usd,
                    figures: Mutex::new(OwnerFigures {
                        prepaid: o.balance_usd.is_some(),
                        balance_usd: o.balance_usd.unwrap_or(0.0),
                        ..Default::default()
                    }),
                };
                (o.name.clone(), Arc::new(acct))
            })
            .collect();
        let accounts = Accounts {
            keys: RwLock::new(HashMap::new()),
            owners: RwLock::new(owners),
            made: RwLock::new(Vec::new()),
            routes: Mutex::new(HashMap::new()),
            pricing: RwLock::new(pricing.map(Arc::new)),
            tz,
            tz_name: name.to_owned(),
            route_budgets: config.budgets.routes.clone(),
        };
        for k in &config.keys {
            accounts.insert_key(k.clone(), None);
        }
        Ok(accounts)
    }

    fn owner(&self, name: &str) -> Arc<OwnerAccount> {
        if let Some(o) = self.owners.read().unwrap_or_else(|p| p.into_inner()).get(name) {
            return o.clone();
        }
        let mut w = self.owners.write().unwrap_or_else(|p| p.into_inner());
        w.entry(name.to_owned())
            .or_insert_with(|| {
                Arc::new(OwnerAccount {
                    name: name.to_owned(),
                    daily_budget_usd: None,
                    figures: Mutex::new(OwnerFigures::default()),
                })
            })
            .clone()
    }

    fn insert_key(&self, key: Key, made: Option<&StoredKey>) -> Arc<KeyRt> {
        let rt = Arc::new(KeyRt {
            limits: KeyLimits::new(&key),
            owner: self.owner(&key.owner),
            spend: Mutex::new(KeySpendRt {
                spent_usd: 0.0,
                limit_usd: key.spend_limit_usd,
            }),
            made: made.is_some(),
            key,
        });
        self.keys
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(rt.key.secret.0, rt.clone());
        rt
    }

    /// The key whose secret hashes to `digest`.
    pub fn key(&self, digest: &[u8; 32]) -> Option<Arc<KeyRt>> {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).get(digest).cloned()
    }

    /// Every live key.
    pub fn all_keys(&self) -> Vec<Arc<KeyRt>> {
        self.keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Every key, by name.
    pub(crate) fn key_by_name(&self, name: &str) -> Option<Arc<KeyRt>> {
        self.keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .find(|k| k.key.name == name)
            .cloned()
    }

    pub fn pricing(&self) -> Arc<Pricing> {
        if let Some(p) = self.pricing.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
            return p.clone();
        }
        let mut w = self.pricing.write().unwrap_or_else(|p| p.into_inner());
        // Its stale prices are logged by the pricing upkeep (lib.rs) at its next poll, as
        // any catalog's are: logging here as well said it twice.
        w.get_or_insert_with(|| Arc::new(Pricing::builtin())).clone()
    }

    /// The catalog, if one has been read (the built-in one is read on first use).
    pub fn pricing_if_loaded(&self) -> Option<Arc<Pricing>> {
        self.pricing.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_pricing(&self, p: Pricing) {
        *self.pricing.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(p));
    }

    pub fn time_zone(&self) -> &str {
        &self.tz_name
    }

    /// The offset from UTC at `secs` since the epoch, in seconds.
    fn offset(&self, secs: i64) -> i64 {
        self.tz
            .find_local_time_type(secs)
            .map_or(0, |t| i64::from(t.ut_offset()))
    }

    /// The day `secs` (since the epoch) falls on in the budgets' time zone, counted from
    /// 1970-01-01 there.
    fn day_of(&self, secs: i64) -> i64 {
        (secs + self.offset(secs)).div_euclid(86_400)
    }

    fn day(&self, at: UnixMs) -> i32 {
        self.day_of(at.0.div_euclid(1000)) as i32
    }

    /// The first second in (`lo`, `hi`] whose day is `day` or later: local days only move
    /// forward as time does, so a binary search finds where one begins, clock changes
    /// (a skipped midnight included) and all.
    fn first_second_of(&self, day: i64, mut lo: i64, mut hi: i64) -> i64 {
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.day_of(mid) >= day {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi
    }

    /// When the day of `at` began, in the budgets' time zone.
    pub fn day_start(&self, at: UnixMs) -> UnixMs {
        let secs = at.0.div_euclid(1000);
        let day = self.day_of(secs);
        UnixMs(self.first_second_of(day, secs - 50 * 3600, secs) * 1000)
    }

    /// When the next day begins, as a person reads it: local time and offset.
    fn next_day_label(&self, at: UnixMs) -> String {
        let secs = at.0.div_euclid(1000);
        let next = self.first_second_of(self.day_of(secs) + 1, secs, secs + 50 * 3600);
        let off = self.offset(next);
        let local = chrono::DateTime::from_timestamp(next + off, 0).map(|t| t.naive_utc());
        let sign = if off < 0 { '-' } else { '+' };
        let (h, m) = (off.abs() / 3600, off.abs() % 3600 / 60);
        match local {
            Some(l) => format!("{} (UTC{sign}{h:02}:{m:02})", l.format("%Y-%m-%d %H:%M")),
            None => String::new(),
        }
    }

    /// B3: whether `key` may send a request now: the owner's balance above zero, the
    /// key under its spend limit, the owner under its daily budget.
    pub fn admit(&self, key: &KeyRt, now: UnixMs) -> Result<(), GatewayError> {
        let today = self.day(now);
        {
            let mut o = lock(&key.owner.figures);
            if o.prepaid && o.balance_usd <= 0.0 {
                return Err(GatewayError::InsufficientBalance);
            }
            if o.day != today {
                o.day = today;
                o.spent_today = 0.0;
            }
            if let Some(b) = key.owner.daily_budget_usd
                && o.spent_today >= b
            {
                return Err(GatewayError::DailyBudget {
                    budget: b,
                    resets: self.next_day_label(now),
                });
            }
        }
        let s = lock(&key.spend);
        if s.limit_usd.is_some_and(|l| s.spent_usd >= l) {
            return Err(GatewayError::SpendLimit);
        }
        Ok(())
    }

    /// B4: a closed request's cost, taken from its owner's balance and day, its key's
    /// spend and its route's day and hour. `hour_usd` is what counts towards G1's last
    /// hour (the cost, or the estimate when the cost is unknown). Returns the route's
    /// figures when it has a budget.
    pub fn settle(
        &self,
        key: &KeyRt,
        route: Option<&str>,
        cost_usd: Option<f64>,
        hour_usd: Option<f64>,
        now: UnixMs,
    ) -> Option<RouteHour> {
        let today = self.day(now);
        if let Some(c) = cost_usd.filter(|c| *c != 0.0) {
            {
                let mut o = lock(&key.owner.figures);
                o.balance_usd -= c;
                if o.day != today {
                    o.day = today;
                    o.spent_today = 0.0;
                }
                o.spent_today += c;
            }
            lock(&key.spend).spent_usd += c;
        }
        let route = route?;
        let add = hour_usd.or(cost_usd).unwrap_or(0.0);
        let budget = self.route_budgets.get(route).copied();
        if add == 0.0 && budget.is_none() {
            return None;
        }
        let minute = now.0.div_euclid(60_000);
        let mut routes = lock(&self.routes);
        // Models a `*` channel lets clients name are endless: past this many routes only
        // budgeted ones are followed (their spend is in the ledger all the same).
        if budget.is_none() && routes.len() >= MAX_ROUTES && !routes.contains_key(route) {
            return None;
        }
        let r = routes.entry(route.to_owned()).or_default();
        if r.day != today {
            r.day = today;
            r.spent_today = 0.0;
        }
        r.spent_today += cost_usd.unwrap_or(0.0);
        r.add(minute, add);
        let last_hour_usd = r.last_hour(minute);
        budget.map(|daily_budget_usd| RouteHour {
            last_hour_usd,
            daily_budget_usd,
        })
    }

    /// Reads every balance, spend and made key back from the ledger, seeding the owners
    /// the ledger has not met from the config (B4). Returns the owners seeded now.
    pub async fn load(&self, config: &Config, ledger: &Ledger, now: UnixMs) -> spillway_ledger::Result<Vec<String>> {
        let seeds: Vec<(String, f64)> = config
            .owners
            .iter()
            .filter_map(|o| Some((o.name.clone(), o.balance_usd?)))
            .collect();
        let seeded = ledger.store().seed_owners(&seeds, now).await?;
        let a = ledger.store().accounts().await?;
        // Read again (a fleet's instances do, every few heartbeats): a key revoked
        // elsewhere is refused here too.
        for k in a.keys.iter().filter(|k| k.revoked_at.is_some()) {
            self.keys
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|_, rt| !(rt.made && rt.key.name == k.name));
        }
        for k in a.keys.iter().filter(|k| k.revoked_at.is_none()) {
            let Ok(bytes) = hex::decode(&k.secret_sha256) else {
                continue;
            };
            let Ok(secret) = <[u8; 32]>::try_from(bytes.as_slice()) else {
                continue;
            };
            match self.key_by_name(&k.name) {
                Some(known) if known.made => continue,
                Some(_) => {
                    tracing::warn!(key = %k.name, "a key made in the console has the name of a config key; the config's wins");
                    continue;
                }
                None => {}
            }
            self.insert_key(made_key(k, KeySecret(secret)), Some(k));
        }
        *self.made.write().unwrap_or_else(|p| p.into_inner()) = a.keys.clone();
        let prepaid: std::collections::HashSet<String> = a.prepaid.iter().cloned().collect();
        let mut balance: HashMap<String, f64> = a.credits.into_iter().collect();
        let mut key_spent: HashMap<String, f64> = HashMap::new();
        for row in &a.spend {
            if let Some(o) = &row.owner {
                *balance.entry(o.clone()).or_default() -= row.cost_usd;
            }
            if let Some(k) = &row.key_name {
                *key_spent.entry(k.clone()).or_default() += row.cost_usd;
            }
        }
        for ks in &a.key_spend {
            *key_spent.entry(ks.key_name.clone()).or_default() += ks.folded_usd;
        }
        let today = self.day(now);
        let mut owner_today: HashMap<String, f64> = HashMap::new();
        let mut route_today: HashMap<String, f64> = HashMap::new();
        for row in ledger.store().spend_since(self.day_start(now)).await? {
            if let Some(o) = &row.owner {
                *owner_today.entry(o.clone()).or_default() += row.cost_usd;
            }
            if let Some(r) = &row.route {
                *route_today.entry(r.clone()).or_default() += row.cost_usd;
            }
        }
        let hour = ledger.store().spend_since(UnixMs(now.0 - 3_600_000)).await?;
        for name in &prepaid {
            balance.entry(name.clone()).or_default();
        }
        for (name, b) in &balance {
            let o = self.owner(name);
            let mut f = lock(&o.figures);
            f.prepaid = prepaid.contains(name);
            f.balance_usd = *b;
            f.day = today;
            f.spent_today = owner_today.get(name).copied().unwrap_or(0.0);
        }
        let limits: HashMap<&str, Option<f64>> = a
            .key_spend
            .iter()
            .filter(|k| k.limit_set)
            .map(|k| (k.key_name.as_str(), k.spend_limit_usd))
            .collect();
        for k in self.keys.read().unwrap_or_else(|p| p.into_inner()).values() {
            let mut s = lock(&k.spend);
            s.spent_usd = key_spent.get(&k.key.name).copied().unwrap_or(0.0);
            if let Some(l) = limits.get(k.key.name.as_str()) {
                s.limit_usd = *l;
            }
        }
        let minute = now.0.div_euclid(60_000);
        let mut routes = lock(&self.routes);
        for (route, usd) in route_today {
            let r = routes.entry(route).or_default();
            r.day = today;
            r.spent_today = usd;
        }
        // The last hour is read back as one lump in the current minute: it leaves the
        // window an hour from now, a little late, never early.
        for row in hour {
            if let Some(route) = row.route {
                routes.entry(route).or_default().add(minute, row.cost_usd);
            }
        }
        Ok(seeded)
    }

    /// B5: a made key goes live at once.
    pub fn add_made_key(&self, k: &StoredKey, secret: KeySecret, spend_limit_usd: Option<f64>) {
        let mut key = made_key(k, secret);
        key.spend_limit_usd = spend_limit_usd;
        self.insert_key(key, Some(k));
        self.made.write().unwrap_or_else(|p| p.into_inner()).push(k.clone());
    }

    /// B5: a revoked key is refused from now on.
    pub fn revoke(&self, name: &str, at: UnixMs, by: &str) {
        self.keys
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, k| !(k.made && k.key.name == name));
        for k in self.made.write().unwrap_or_else(|p| p.into_inner()).iter_mut() {
            if k.name == name && k.revoked_at.is_none() {
                k.revoked_at = Some(at);
                k.revoked_by = Some(by.to_owned());
            }
        }
    }

    /// Whether `name` is a key (live) or a made key (revoked too).
    pub fn key_exists(&self, name: &str) -> bool {
        self.key_by_name(name).is_some()
            || self
                .made
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .any(|k| k.name == name)
    }

    /// Whether a made key (not revoked) is called `name`.
    pub fn is_live_made_key(&self, name: &str) -> bool {
        self.key_by_name(name).is_some_and(|k| k.made)
    }

    pub fn set_spend_limit(&self, name: &str, limit: Option<f64>) -> bool {
        match self.key_by_name(name) {
            Some(k) => {
                lock(&k.spend).limit_usd = limit;
                true
            }
            None => false,
        }
    }

    pub fn owner_exists(&self, name: &str) -> bool {
        self.owners.read().unwrap_or_else(|p| p.into_inner()).contains_key(name)
    }

    pub fn credit(&self, owner: &str, usd: f64) {
        let o = self.owner(owner);
        let mut f = lock(&o.figures);
        // A metered owner's first credit is its balance (the ledger writes the opening
        // entry that makes it so).
        if !f.prepaid {
            f.balance_usd = 0.0;
        }
        f.prepaid = true;
        f.balance_usd += usd;
    }

    pub fn owners(&self, now: UnixMs) -> Vec<OwnerView> {
        let today = self.day(now);
        let mut v: Vec<OwnerView> = self
            .owners
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|o| {
                let f = lock(&o.figures);
                OwnerView {
                    name: o.name.clone(),
                    balance_usd: f.balance_usd,
                    prepaid: f.prepaid,
                    daily_budget_usd: o.daily_budget_usd,
                    spent_today_usd: if f.day == today { f.spent_today } else { 0.0 },
                }
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub fn keys(&self) -> Vec<KeyView> {
        let live: Vec<Arc<KeyRt>> = self
            .keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        let made = self.made.read().unwrap_or_else(|p| p.into_inner()).clone();
        let mut v: Vec<KeyView> = live
            .iter()
            .map(|k| {
                let s = lock(&k.spend);
                let m = made.iter().find(|m| k.made && m.name == k.key.name);
                KeyView {
                    name: k.key.name.clone(),
                    owner: k.key.owner.clone(),
                    origin: if k.made { "console" } else { "config" }.into(),
                    hint: m.map(|m| m.hint.clone()),
                    rpm: k.key.rpm,
                    max_concurrency: k.key.max_concurrency,
                    spend_limit_usd: s.limit_usd,
                    spent_usd: s.spent_usd,
                    created_at: m.map(|m| m.created_at),
                    created_by: m.map(|m| m.created_by.clone()),
                    revoked_at: None,
                    revoked_by: None,
                }
            })
            .collect();
        v.extend(made.iter().filter(|m| m.revoked_at.is_some()).map(|m| KeyView {
            name: m.name.clone(),
            owner: m.owner.clone(),
            origin: "console".into(),
            hint: Some(m.hint.clone()),
            rpm: m.rpm,
            max_concurrency: m.max_concurrency,
            spend_limit_usd: None,
            spent_usd: 0.0,
            created_at: Some(m.created_at),
            created_by: Some(m.created_by.clone()),
            revoked_at: m.revoked_at,
            revoked_by: m.revoked_by.clone(),
        }));
        v.sort_by(|a, b| (a.revoked_at.is_some(), &a.name).cmp(&(b.revoked_at.is_some(), &b.name)));
        v
    }

    /// G1: a budgeted route's last hour and daily budget.
    pub fn route_hour(&self, route: &str, now: UnixMs) -> Option<(f64, f64)> {
        let budget = *self.route_budgets.get(route)?;
        let mut routes = lock(&self.routes);
        let hour = routes
            .get_mut(route)
            .map_or(0.0, |r| r.last_hour(now.0.div_euclid(60_000)));
        Some((hour, budget))
    }

    pub fn routes(&self, now: UnixMs) -> Vec<RouteBudgetView> {
        let today = self.day(now);
        let minute = now.0.div_euclid(60_000);
        let mut routes = lock(&self.routes);
        let mut names: Vec<String> = routes.keys().cloned().collect();
        names.extend(self.route_budgets.keys().cloned());
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|name| {
                let r = routes.entry(name.clone()).or_default();
                RouteBudgetView {
                    daily_budget_usd: self.route_budgets.get(&name).copied(),
                    spent_today_usd: if r.day == today { r.spent_today } else { 0.0 },
                    last_hour_usd: r.last_hour(minute),
                    route: name,
                }
            })
            .collect()
    }
}

/// M1: says which prices are older than 30 days (the console flags them where costs are
/// shown; the pricing upkeep logs it within a poll of the catalog being read, then once a
/// day).
pub fn log_stale(p: &Pricing, now: UnixMs) {
    let stale: Vec<&str> = p
        .stale(now.0.div_euclid(86_400_000))
        .map(|m| m.model.as_str())
        .collect();
    if !stale.is_empty() {
        tracing::warn!(
            catalog = %p.version,
            origin = %p.origin,
            "{} prices are older than 30 days (costs still use them): {}",
            stale.len(),
            stale.join(", ")
        );
    }
}

fn made_key(k: &StoredKey, secret: KeySecret) -> Key {
    Key {
        name: k.name.clone(),
        owner: k.owner.clone(),
        secret,
        rpm: k.rpm,
        rpm_counts_token_counting: false,
        max_concurrency: k.max_concurrency,
        spend_limit_usd: None,
        workflow: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn accounts(extra: &str) -> Accounts {
        let y = format!(
            "channels:\n  - {{name: a, format: openai, base_url: 'http://127.0.0.1:9', models: [m]}}\n\
             keys:\n  - {{name: app, owner: team, secret_env: KEY}}\n{extra}"
        );
        let cfg = Config::parse(
            Path::new("t.yaml"),
            &y,
            &|k| (k == "KEY").then(|| "sk-accounts-test-0123456789".into()),
            &|| unreachable!(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        Accounts::new(&cfg, None).unwrap()
    }

    fn at(rfc3339: &str) -> UnixMs {
        UnixMs(
            chrono::DateTime::parse_from_rfc3339(rfc3339)
                .unwrap()
                .timestamp_millis(),
        )
    }

    #[test]
    fn a_day_begins_at_midnight_in_the_configured_time_zone() {
        // spec: B3, G1
        let a = accounts("owners:\n  - {name: team}\nbudgets: {time_zone: Europe/Berlin}\n");
        // 22:30 UTC on 1 December is 23:30 in Berlin: the day began at 23:00 UTC the day before.
        assert_eq!(a.day_start(at("2026-12-01T22:30:00Z")), at("2026-11-30T23:00:00Z"));
        assert_eq!(a.day_start(at("2026-12-01T23:30:00Z")), at("2026-12-01T23:00:00Z"));
        // Summer time: midnight in Berlin is 22:00 UTC.
        assert_eq!(a.day_start(at("2026-07-01T12:00:00Z")), at("2026-06-30T22:00:00Z"));
        // Where a clock change skips midnight (Santiago, 2026-09-06), the day begins at 01:00.
        let cl = accounts("owners:\n  - {name: team}\nbudgets: {time_zone: America/Santiago}\n");
        assert_eq!(cl.day_start(at("2026-09-06T15:00:00Z")), at("2026-09-06T04:00:00Z"));
        assert_eq!(
            accounts("owners:\n  - {name: team}\n").day_start(at("2026-12-01T22:30:00Z")),
            at("2026-12-01T00:00:00Z")
        );
    }

    #[test]
    fn an_owners_daily_budget_refuses_until_the_local_day_turns() {
        // spec: B3
        let a = accounts("owners:\n  - {name: team, daily_budget_usd: 1.0}\nbudgets: {time_zone: Europe/Berlin}\n");
        let key = a.all_keys()[0].clone();
        let evening = at("2026-12-01T22:00:00Z"); // 23:00 in Berlin
        assert!(a.admit(&key, evening).is_ok());
        a.settle(&key, Some("openai/m"), Some(1.0), None, evening);
        match a.admit(&key, at("2026-12-01T22:59:00Z")) {
            Err(GatewayError::DailyBudget { budget, resets }) => {
                assert_eq!(budget, 1.0);
                assert_eq!(resets, "2026-12-02 00:00 (UTC+01:00)");
            }
            other => panic!("{other:?}"),
        }
        // 00:01 in Berlin: a new day, the budget is whole again.
        assert!(a.admit(&key, at("2026-12-01T23:01:00Z")).is_ok());
        // The owner is not prepaid (no balance_usd): spending does not refuse it.
        assert_eq!(a.owners(at("2026-12-01T23:01:00Z"))[0].spent_today_usd, 0.0);
        assert!(!a.owners(evening)[0].prepaid);
    }

    #[test]
    fn the_last_hour_forgets_what_is_older_than_sixty_minutes() {
        // spec: G1
        let a = accounts("owners:\n  - {name: team}\nbudgets: {routes: {openai/m: 10}}\n");
        let key = a.all_keys()[0].clone();
        let t0 = at("2026-12-01T10:00:00Z");
        let h = a.settle(&key, Some("openai/m"), Some(2.0), None, t0).unwrap();
        assert_eq!((h.last_hour_usd, h.daily_budget_usd), (2.0, 10.0));
        let h = a
            .settle(&key, Some("openai/m"), None, Some(0.5), UnixMs(t0.0 + 59 * 60_000))
            .unwrap();
        assert_eq!(h.last_hour_usd, 2.5, "an unknown cost counts at its estimate");
        let h = a
            .settle(&key, Some("openai/m"), Some(0.25), None, UnixMs(t0.0 + 61 * 60_000))
            .unwrap();
        assert_eq!(h.last_hour_usd, 0.75);
        // A route without a budget reports nothing to a breaker.
        assert!(a.settle(&key, Some("openai/other"), Some(5.0), None, t0).is_none());
    }
}
