//! The scorecard (N1–N3): per route and overall, three periods side by side (the 28
//! days before an incident, the incident, the 60 minutes after), and the review flags
//! with who must decide. Every figure is read from the ledger.

use crate::admin::admin_error;
use crate::clock;
use crate::inbox::ledger_down;
use crate::recovery::{ScoreQuery, window_of};
use crate::state::AppState;
use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use spillway_ledger::{DayFigures, ScoreRow};
use spillway_wire::UnixMs;
use std::collections::BTreeMap;
use std::sync::Arc;
use ts_rs::TS;

use crate::recovery::{BEFORE_MS, DAY_MS};
/// N2: the period after an incident.
const AFTER_MS: i64 = 60 * 60_000;

/// N2: one period's figures: each route's row, then `overall`.
#[derive(Clone, Debug, Serialize, TS)]
pub struct ScorePeriod {
    /// `before`, `incident` or `after`.
    pub name: String,
    pub from: UnixMs,
    pub to: UnixMs,
    pub rows: Vec<ScoreRow>,
}

/// N3: something a person must look at, and who.
#[derive(Clone, Debug, Serialize, TS)]
pub struct ReviewFlag {
    pub rule: String,
    pub route: Option<String>,
    pub detail: String,
    /// Who must decide: the application owner, or beyond (budget owner, platform
    /// operations, business owner).
    pub decide: Vec<String>,
    /// Raised beyond the application owner.
    pub escalation: bool,
}

#[derive(Clone, Debug, Serialize, TS)]
pub struct Scorecard {
    pub run: Option<String>,
    /// The run is a drill: its incident was staged.
    pub drill: bool,
    pub route: Option<String>,
    pub periods: Vec<ScorePeriod>,
    pub flags: Vec<ReviewFlag>,
}

const APP_OWNER: &str = "application owner";
const BUDGET_OWNER: &str = "budget owner";
const PLATFORM: &str = "platform operations";
const BUSINESS: &str = "business owner";

fn flag(rule: &str, route: Option<&str>, detail: String, decide: &[&str]) -> ReviewFlag {
    ReviewFlag {
        rule: rule.to_owned(),
        route: route.map(str::to_owned),
        detail,
        escalation: decide.iter().any(|d| *d != APP_OWNER),
        decide: decide.iter().map(|d| (*d).to_owned()).collect(),
    }
}

pub async fn scorecard(State(st): State<Arc<AppState>>, Query(q): Query<ScoreQuery>) -> Response {
    let now = clock::now();
    let window = match window_of(&st, &q).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    if let Some(route) = &q.route
        && crate::jobs::split_route(route).is_none()
    {
        return admin_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("`route`: `format/model`, e.g. `openai/gpt-4o-mini`; `{route}` is not one"),
        );
    }
    // Without a run, the last hour stands for the incident.
    let (run, drill, start, end) = match &window {
        Some((_, drill, start, end, id)) => (Some(id.clone()), *drill, *start, end.unwrap_or(now)),
        None => (None, false, UnixMs(now.0 - AFTER_MS), now),
    };
    let after_to = if end.0 < now.0 {
        UnixMs((end.0 + AFTER_MS).min(now.0))
    } else {
        end
    };
    let route = window.as_ref().map(|w| w.0.clone()).or(q.route.clone());
    let mut periods = Vec::new();
    for (name, from, to) in [
        ("before", UnixMs(start.0 - BEFORE_MS), start),
        ("incident", start, UnixMs(end.0 + 1)),
        ("after", UnixMs(end.0 + 1), UnixMs(after_to.0 + 1)),
    ] {
        // An empty period (the hour after an incident not yet over) still has its
        // `overall` row, of zeros.
        let rows = match st.ledger.store().scorecard(from, UnixMs(to.0.max(from.0)), None).await {
            Ok(r) => r,
            Err(e) => return ledger_down(e),
        };
        periods.push(ScorePeriod {
            name: name.to_owned(),
            from,
            to,
            rows,
        });
    }
    let flags = match flags(&st, now).await {
        Ok(f) => f,
        Err(e) => return ledger_down(e),
    };
    Json(Scorecard {
        run,
        drill,
        route,
        periods,
        flags,
    })
    .into_response()
}

/// N3: the review flags and escalations, now.
pub async fn flags(st: &AppState, now: UnixMs) -> spillway_ledger::Result<Vec<ReviewFlag>> {
    let store = st.ledger.store();
    let mut out = Vec::new();
    let today = UnixMs(now.0 - now.0.rem_euclid(DAY_MS));
    let days = store.daily(UnixMs(today.0 - BEFORE_MS), UnixMs(now.0 + 1)).await?;
    let mut by_route: BTreeMap<&str, Vec<&DayFigures>> = BTreeMap::new();
    for d in &days {
        by_route.entry(d.route.as_str()).or_default().push(d);
    }
    for (route, ds) in &by_route {
        // Amplification above 1.10 on three days of the last seven.
        let week = today.0 - 6 * DAY_MS;
        let high: Vec<f64> = ds
            .iter()
            .filter(|d| d.day.0 >= week && d.attempted > 0)
            .map(|d| d.attempts as f64 / d.attempted as f64)
            .filter(|a| *a > 1.10)
            .collect();
        if high.len() >= 3 {
            out.push(flag(
                "amplification",
                Some(route),
                format!("amplification above 1.10 on {} days of the last 7", high.len()),
                &[APP_OWNER],
            ));
        }
        // Cost per request above the baseline (the days before these two) two days running.
        let per = |d: &DayFigures| (d.priced > 0).then(|| d.cost_usd / d.priced as f64);
        let base: Vec<&&DayFigures> = ds.iter().filter(|d| d.day.0 < today.0 - DAY_MS).collect();
        let (cost, priced) = base
            .iter()
            .fold((0.0, 0u64), |(c, n), d| (c + d.cost_usd, n + d.priced));
        if priced > 0 {
            let baseline = cost / priced as f64;
            let last2: Vec<Option<f64>> = [today.0 - DAY_MS, today.0]
                .iter()
                .map(|day| ds.iter().find(|d| d.day.0 == *day).and_then(|d| per(d)))
                .collect();
            if last2.iter().all(|c| c.is_some_and(|c| c > baseline)) {
                out.push(flag(
                    "cost_per_request",
                    Some(route),
                    format!("cost per request above the 28-day baseline (${baseline:.6}) yesterday and today"),
                    &[APP_OWNER],
                ));
            }
        }
        // An answered request the provider's request id cannot be tied to.
        let untied: u64 = ds
            .iter()
            .filter(|d| d.day.0 >= today.0 - DAY_MS)
            .map(|d| d.untied)
            .sum();
        if untied > 0 {
            out.push(flag(
                "untied_request_ids",
                Some(route),
                format!("{untied} answered request(s) since yesterday carry no provider request id"),
                &[PLATFORM],
            ));
        }
    }
    // Unknowns: any is a flag; ten or more go beyond the application owner.
    let figures = store.figures(UnixMs(0)).await?;
    for c in &figures.unknown_by_route {
        out.push(flag(
            "unknowns",
            Some(&c.route),
            format!("{} unknown outcome(s) to reconcile", c.count),
            &[APP_OWNER],
        ));
    }
    if figures.unknown >= 10 {
        out.push(flag(
            "unknowns_10",
            None,
            format!("{} unknown outcomes in all", figures.unknown),
            &[PLATFORM, BUSINESS],
        ));
    }
    // Two deadline overruns in a month.
    let overruns = store
        .overruns(None, UnixMs(now.0 - 30 * DAY_MS), UnixMs(now.0 + 1))
        .await?;
    let mut per_route: BTreeMap<String, u64> = BTreeMap::new();
    for j in &overruns {
        *per_route.entry(crate::jobs::effective_route(j).to_owned()).or_default() += 1;
    }
    for (route, n) in per_route.iter().filter(|(_, n)| **n >= 2) {
        out.push(flag(
            "deadline_overruns",
            Some(route),
            format!("{n} deadline overruns in the last 30 days"),
            &[APP_OWNER],
        ));
    }
    // Escalations: a spend cap hit.
    for o in st.accounts.owners(now) {
        let broke = o.prepaid && o.balance_usd <= 0.0;
        let capped = o.daily_budget_usd.is_some_and(|b| o.spent_today_usd >= b);
        if broke || capped {
            out.push(flag(
                "spend_cap",
                None,
                format!(
                    "owner {}: {}",
                    o.name,
                    if broke {
                        "prepaid balance used up"
                    } else {
                        "daily budget reached"
                    }
                ),
                &[BUDGET_OWNER],
            ));
        }
    }
    for k in st.accounts.keys() {
        if k.revoked_at.is_none() && k.spend_limit_usd.is_some_and(|l| k.spent_usd >= l) {
            out.push(flag(
                "spend_cap",
                None,
                format!("key {} reached its spend limit", k.name),
                &[BUDGET_OWNER],
            ));
        }
    }
    // 429s spread across several routes in the last hour.
    let hour = store
        .scorecard(UnixMs(now.0 - AFTER_MS), UnixMs(now.0 + 1), None)
        .await?;
    let limited: Vec<&str> = hour
        .iter()
        .filter(|r| r.route != "overall" && r.error_mix.iter().any(|e| e.class == "rate_limit"))
        .map(|r| r.route.as_str())
        .collect();
    if limited.len() >= 2 {
        out.push(flag(
            "rate_limits_across_routes",
            None,
            format!(
                "429s on {} routes in the last hour: {}",
                limited.len(),
                limited.join(", ")
            ),
            &[PLATFORM],
        ));
    }
    // A dead letter that can no longer be cleared before its deadline.
    let late: Vec<String> = st
        .jobs
        .open()
        .into_iter()
        .filter(|j| j.state == crate::jobs::DEAD_LETTER && j.expires_at <= now)
        .map(|j| j.id)
        .collect();
    if !late.is_empty() {
        out.push(flag(
            "dead_letter_deadlines",
            None,
            format!("{} dead-lettered job(s) are past their deadline", late.len()),
            &[BUSINESS],
        ));
    }
    Ok(out)
}
