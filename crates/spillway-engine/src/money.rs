//! The admin API for money (B3–B5, M1, M3): the cost view, the pricing catalog, balances
//! and top-ups, keys made and revoked at run time, and spend limits. Every change is on
//! the audit log, with who and why, before the answer.

use crate::accounts::{KeyView, OwnerView, RouteBudgetView};
use crate::admin::{admin_error, checked, json_body, unprocessable};
use crate::clock;
use crate::state::AppState;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rand::Rng;
use serde::{Deserialize, Serialize};
use spillway_ledger::{AuditEntry, BalanceEntry, CostCell, StoredKey};
use spillway_policy::{ModelPrice, Pricing};
use spillway_wire::{Format, UnixMs};
use std::sync::Arc;
use ts_rs::TS;

/// One model's prices as the console shows them (USD per million tokens).
#[derive(Clone, Debug, Serialize, TS)]
pub struct PriceView {
    pub model: String,
    pub provider: Format,
    pub aliases: Vec<String>,
    pub input: f64,
    pub cached_input: Option<f64>,
    pub cache_write: Option<f64>,
    pub output: f64,
    /// Prompts above this many input tokens are priced at the `long_*` rates.
    pub long_context_above: Option<u64>,
    pub long_input: Option<f64>,
    pub long_output: Option<f64>,
    /// When the price was read (YYYY-MM-DD), and where.
    pub checked: String,
    pub source: String,
    /// M1: checked more than 30 days ago.
    pub stale: bool,
}

/// The catalog in force.
#[derive(Clone, Debug, Serialize, TS)]
pub struct PricingView {
    /// The hash of its text: what each request's `pricing_version` names.
    pub version: String,
    /// `built-in pricing.yaml`, or the config's file.
    pub origin: String,
    pub stale_after_days: i64,
    pub models: Vec<PriceView>,
}

/// Everything the cost view shows.
#[derive(Clone, Debug, Serialize, TS)]
pub struct CostView {
    pub now: UnixMs,
    /// The IANA zone a budget's day is counted in.
    pub time_zone: String,
    pub since: UnixMs,
    pub bucket_ms: i64,
    /// Requests by bucket, owner, key, route and model.
    pub cells: Vec<CostCell>,
    pub owners: Vec<OwnerView>,
    pub keys: Vec<KeyView>,
    pub routes: Vec<RouteBudgetView>,
    pub pricing: PricingView,
    /// Models seen in the window that the catalog has no price for (their cost is
    /// unknown, never zero).
    pub unpriced_models: Vec<String>,
}

fn price_view(m: &ModelPrice, today: i64) -> PriceView {
    PriceView {
        model: m.model.clone(),
        provider: m.provider,
        aliases: m.aliases.clone(),
        input: m.rates.input,
        cached_input: m.rates.cached_input,
        cache_write: m.rates.cache_write,
        output: m.rates.output,
        long_context_above: m.long_context.as_ref().map(|(a, _)| *a),
        long_input: m.long_context.as_ref().map(|(_, r)| r.input),
        long_output: m.long_context.as_ref().map(|(_, r)| r.output),
        checked: m.checked.clone(),
        source: m.source.clone(),
        stale: m.is_stale(today),
    }
}

pub fn pricing_view(p: &Pricing, now: UnixMs) -> PricingView {
    let today = now.0.div_euclid(86_400_000);
    PricingView {
        version: p.version.clone(),
        origin: p.origin.clone(),
        stale_after_days: spillway_policy::pricing::STALE_AFTER_DAYS,
        models: p.models.iter().map(|m| price_view(m, today)).collect(),
    }
}

/// The cost view's window.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostQuery {
    /// How far back, in hours (1 to 24 × 31); 24 by default.
    pub hours: Option<u32>,
}

pub async fn costs(State(st): State<Arc<AppState>>, Query(q): Query<CostQuery>) -> Response {
    let hours = q.hours.unwrap_or(24).clamp(1, 24 * 31);
    let now = clock::now();
    let since = UnixMs(now.0 - i64::from(hours) * 3_600_000);
    // About 48 points whatever the window: a minute at least.
    let bucket_ms = (i64::from(hours) * 3_600_000 / 48).max(60_000);
    // The requests that just closed are in the view.
    if let Err(e) = st.ledger.flush().await {
        return admin_error(StatusCode::SERVICE_UNAVAILABLE, format!("ledger unavailable: {e}"));
    }
    let cells = match st.ledger.store().cost_report(since, bucket_ms).await {
        Ok(c) => c,
        Err(e) => return admin_error(StatusCode::INTERNAL_SERVER_ERROR, format!("cost report failed: {e}")),
    };
    let pricing = st.accounts.pricing();
    let mut unpriced: Vec<String> = cells
        .iter()
        .filter(|c| c.unknown_cost > 0)
        .filter_map(|c| c.model.clone())
        .filter(|m| pricing.price(m).is_none())
        .collect();
    unpriced.sort();
    unpriced.dedup();
    axum::Json(CostView {
        now,
        time_zone: st.accounts.time_zone().to_owned(),
        since,
        bucket_ms,
        cells,
        owners: st.accounts.owners(now),
        keys: st.accounts.keys(),
        routes: st.accounts.routes(now),
        pricing: pricing_view(&pricing, now),
        unpriced_models: unpriced,
    })
    .into_response()
}

pub async fn pricing(State(st): State<Arc<AppState>>) -> Response {
    axum::Json(pricing_view(&st.accounts.pricing(), clock::now())).into_response()
}

pub async fn keys(State(st): State<Arc<AppState>>) -> Response {
    axum::Json(st.accounts.keys()).into_response()
}

/// B5: a key to make.
#[derive(Clone, Debug, Deserialize, TS)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    pub name: String,
    pub owner: String,
    #[serde(default)]
    pub rpm: Option<u32>,
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    #[serde(default)]
    pub spend_limit_usd: Option<f64>,
    pub actor: String,
    pub reason: String,
}

/// B5: the secret, shown this once, and the key.
#[derive(Clone, Debug, Serialize, TS)]
pub struct MadeKey {
    pub secret: String,
    pub key: KeyView,
}

fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// An audit entry made now, its figures as JSON.
pub(crate) fn audit(
    kind: &str,
    subject: &str,
    actor: &str,
    action: &str,
    reason: &str,
    figures: serde_json::Value,
) -> AuditEntry {
    AuditEntry {
        id: 0,
        at: clock::now(),
        kind: kind.into(),
        subject: subject.into(),
        actor: actor.into(),
        action: action.into(),
        trigger: None,
        reason: reason.into(),
        figures: Some(figures.to_string()),
    }
}

fn check_limit(v: Option<f64>) -> Result<Option<f64>, String> {
    match v {
        Some(l) if !l.is_finite() || !(0.0..=1e9).contains(&l) => {
            Err("`spend_limit_usd`: a number of USD from 0 to 1,000,000,000, or null for no limit.".into())
        }
        v => Ok(v),
    }
}

pub async fn create_key(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let k: NewKey = match json_body(&body) {
        Ok(k) => k,
        Err(m) => return unprocessable(m),
    };
    let (actor, reason) = match checked(&k.actor, &k.reason) {
        Ok(v) => v,
        Err(m) => return unprocessable(m),
    };
    let name = k.name.trim().to_owned();
    if !valid_name(&name) {
        return unprocessable("`name`: 1-64 letters, digits, '-', '_' or '.'.".into());
    }
    if !st.accounts.owner_exists(k.owner.trim()) {
        return unprocessable(format!(
            "`owner`: no owner called `{}`; owners are listed under `owners` in the config.",
            crate::admin::shown_name(k.owner.trim())
        ));
    }
    for (field, v) in [("rpm", k.rpm), ("max_concurrency", k.max_concurrency)] {
        if v.is_some_and(|v| v == 0 || v > 1_000_000) {
            return unprocessable(format!("`{field}`: from 1 to 1,000,000, or leave it out for no limit."));
        }
    }
    let limit = match check_limit(k.spend_limit_usd) {
        Ok(l) => l,
        Err(m) => return unprocessable(m),
    };
    if st.accounts.key_exists(&name) {
        return admin_error(StatusCode::CONFLICT, format!("A key named `{name}` exists already."));
    }
    // B5: 160 random bits; only its hash is kept.
    let secret = format!(
        "sk-sw-{:032x}{:08x}",
        rand::rng().random::<u128>(),
        rand::rng().random::<u32>()
    );
    let hash = spillway_policy::hash_secret(&secret);
    let now = clock::now();
    let stored = StoredKey {
        name: name.clone(),
        owner: k.owner.trim().to_owned(),
        secret_sha256: hex::encode(hash.0),
        hint: secret[..10].to_owned(),
        rpm: k.rpm,
        max_concurrency: k.max_concurrency,
        created_at: now,
        created_by: actor.clone(),
        revoked_at: None,
        revoked_by: None,
    };
    let entry = audit(
        "key",
        &name,
        &actor,
        "created",
        &reason,
        serde_json::json!([{"name": "owner", "value": stored.owner}, {"name": "spend_limit_usd", "value": limit}]),
    );
    match st.ledger.store().create_key(&stored, limit, &entry).await {
        Ok(()) => {}
        Err(spillway_ledger::Error::Conflict(m)) => return admin_error(StatusCode::CONFLICT, m),
        Err(e) => {
            return admin_error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the ledger could not record the key: {e}"),
            );
        }
    }
    st.accounts.add_made_key(&stored, hash, limit);
    tracing::info!(key = %name, owner = %stored.owner, actor, "gateway key made");
    let Some(key) = st.accounts.keys().into_iter().find(|v| v.name == name) else {
        return admin_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the key was made but cannot be listed",
        );
    };
    (StatusCode::CREATED, axum::Json(MadeKey { secret, key })).into_response()
}

pub async fn revoke_key(
    State(st): State<Arc<AppState>>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let a: crate::admin::OperatorAction = match json_body(&body) {
        Ok(a) => a,
        Err(m) => return unprocessable(m),
    };
    let (actor, reason) = match checked(&a.actor, &a.reason) {
        Ok(v) => v,
        Err(m) => return unprocessable(m),
    };
    if !st.accounts.is_live_made_key(&name) {
        let msg = if st.accounts.key_exists(&name) {
            "That key comes from the config (or is revoked already): remove it from the config to retire it."
        } else {
            "No key by that name."
        };
        return admin_error(StatusCode::NOT_FOUND, msg);
    }
    let now = clock::now();
    let entry = audit("key", &name, &actor, "revoked", &reason, serde_json::json!([]));
    match st.ledger.store().revoke_key(&name, now, &actor, &entry).await {
        Ok(()) => {}
        Err(spillway_ledger::Error::NotFound) => return admin_error(StatusCode::NOT_FOUND, "No key by that name."),
        Err(e) => {
            return admin_error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the ledger could not record the revocation: {e}"),
            );
        }
    }
    st.accounts.revoke(&name, now, &actor);
    tracing::warn!(key = %name, actor, "gateway key revoked");
    axum::Json(st.accounts.keys().into_iter().find(|k| k.name == name)).into_response()
}

/// B3: an operator's spend limit on a key; null lifts it.
#[derive(Clone, Debug, Deserialize, TS)]
#[serde(deny_unknown_fields)]
pub struct SpendLimitAction {
    pub spend_limit_usd: Option<f64>,
    pub actor: String,
    pub reason: String,
}

pub async fn set_spend_limit(
    State(st): State<Arc<AppState>>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let a: SpendLimitAction = match json_body(&body) {
        Ok(a) => a,
        Err(m) => return unprocessable(m),
    };
    let (actor, reason) = match checked(&a.actor, &a.reason) {
        Ok(v) => v,
        Err(m) => return unprocessable(m),
    };
    let limit = match check_limit(a.spend_limit_usd) {
        Ok(l) => l,
        Err(m) => return unprocessable(m),
    };
    let Some(before) = st
        .accounts
        .keys()
        .into_iter()
        .find(|k| k.name == name && k.revoked_at.is_none())
    else {
        return admin_error(StatusCode::NOT_FOUND, "No key by that name.");
    };
    let entry = audit(
        "key",
        &name,
        &actor,
        "spend_limit_set",
        &reason,
        serde_json::json!([{"name": "before_usd", "value": before.spend_limit_usd}, {"name": "after_usd", "value": limit}]),
    );
    if let Err(e) = st
        .ledger
        .store()
        .set_spend_limit(&name, limit, clock::now(), &actor, &entry)
        .await
    {
        return admin_error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the ledger could not record the limit: {e}"),
        );
    }
    st.accounts.set_spend_limit(&name, limit);
    axum::Json(st.accounts.keys().into_iter().find(|k| k.name == name)).into_response()
}

/// B4: money added to an owner's balance (a deficit is taken from it first).
#[derive(Clone, Debug, Deserialize, TS)]
#[serde(deny_unknown_fields)]
pub struct TopUp {
    pub amount_usd: f64,
    pub actor: String,
    pub reason: String,
}

pub async fn top_up(State(st): State<Arc<AppState>>, Path(owner): Path<String>, body: axum::body::Bytes) -> Response {
    let t: TopUp = match json_body(&body) {
        Ok(t) => t,
        Err(m) => return unprocessable(m),
    };
    let (actor, reason) = match checked(&t.actor, &t.reason) {
        Ok(v) => v,
        Err(m) => return unprocessable(m),
    };
    if !t.amount_usd.is_finite() || t.amount_usd <= 0.0 || t.amount_usd > 1e9 {
        return unprocessable("`amount_usd`: a number of USD above 0 (at most 1,000,000,000).".into());
    }
    if !st.accounts.owner_exists(&owner) {
        return admin_error(StatusCode::NOT_FOUND, "No owner by that name.");
    }
    let now = clock::now();
    let before = st
        .accounts
        .owners(now)
        .into_iter()
        .find(|o| o.name == owner)
        .map(|o| o.balance_usd);
    let entry = BalanceEntry {
        owner: owner.clone(),
        at: now,
        kind: "top_up".into(),
        amount_usd: t.amount_usd,
        actor: Some(actor.clone()),
        reason: Some(reason.clone()),
    };
    let a = audit(
        "owner",
        &owner,
        &actor,
        "top_up",
        &reason,
        serde_json::json!([{"name": "amount_usd", "value": t.amount_usd}, {"name": "balance_before_usd", "value": before}]),
    );
    if let Err(e) = st.ledger.store().credit(&entry, &a).await {
        return admin_error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the ledger could not record the top-up: {e}"),
        );
    }
    st.accounts.credit(&owner, t.amount_usd);
    tracing::info!(owner = %owner, amount_usd = t.amount_usd, actor, "balance topped up");
    axum::Json(st.accounts.owners(now).into_iter().find(|o| o.name == owner)).into_response()
}
