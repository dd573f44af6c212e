//! K1: whether a fallback route's contract holds for one job: the same endpoint shape (the
//! workflow's validation keeps fallbacks within one format), tool and schema behaviour
//! the workflow approved the route for, a cost cap the job's estimate fits under at the
//! route's price, and the workflow's data boundary (provider and region of every channel
//! that could serve it). Anything that cannot be established is `Unknown`, which sends the
//! work to a person rather than guessing.

use crate::jobs::split_route;
use crate::state::AppState;
use spillway_ledger::JobRecord;
use spillway_policy::Workflow;
use spillway_policy::workflow::FallbackRoute;

#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Holds,
    /// Something the contract needs is not known (no price, no channel): a person decides.
    Unknown(String),
    /// The route leaves the workflow's data boundary.
    DataBoundary(String),
    /// The route is known not to keep the contract (tools, schema, cost).
    Mismatch(String),
}

/// What a request body asks of the model beyond plain text, per format.
fn uses_tools(v: &serde_json::Value) -> bool {
    ["tools", "functions", "tool_choice", "function_call", "toolConfig"]
        .iter()
        .any(|k| v.get(k).is_some_and(|t| !t.is_null()))
}

fn uses_schema(v: &serde_json::Value) -> bool {
    let openai = v
        .get("response_format")
        .and_then(|r| r.get("type"))
        .and_then(|t| t.as_str())
        .is_some_and(|t| t == "json_schema" || t == "json_object");
    let responses = v
        .get("text")
        .and_then(|t| t.get("format"))
        .and_then(|f| f.get("type"))
        .and_then(|t| t.as_str())
        .is_some_and(|t| t == "json_schema" || t == "json_object");
    let gemini = v.get("generationConfig").is_some_and(|g| {
        g.get("responseSchema").is_some()
            || g.get("responseJsonSchema").is_some()
            || g.get("responseMimeType").and_then(|m| m.as_str()) == Some("application/json")
    });
    let anthropic = v.get("output_format").is_some();
    openai || responses || gemini || anthropic
}

/// The contract of fallback `r` for job `j` (whose body, when loaded, shows its tools and
/// schema; without one the job's recorded shape is all there is).
pub fn check(st: &AppState, wf: &Workflow, j: &JobRecord, r: &FallbackRoute) -> Verdict {
    let Some((format, model)) = split_route(&r.to) else {
        return Verdict::Unknown(format!("`{}` is not a route (format/model)", r.to));
    };
    if format.as_str() != j.format {
        return Verdict::Mismatch(format!(
            "{} speaks another format than the job ({}); cross-format fallback is not supported",
            r.to, j.format
        ));
    }
    // Endpoint shape: some channel must serve the model in the job's format.
    let channels: Vec<_> = st
        .channels
        .iter()
        .filter(|c| c.cfg.format == format && c.cfg.serves(model))
        .collect();
    if channels.is_empty() {
        return Verdict::Unknown(format!("no channel serves {} for the {format} format", r.to));
    }
    if let Some(b) = wf
        .fallback
        .data_boundary
        .as_ref()
        .filter(|_| wf.fallback.require_data_boundary_match)
    {
        if !b.providers.is_empty() && !b.providers.contains(&format) {
            return Verdict::DataBoundary(format!(
                "{} is served by {format}, outside the workflow's providers",
                r.to
            ));
        }
        if !b.regions.is_empty() {
            for c in &channels {
                match c.cfg.region.as_deref() {
                    Some(reg) if b.regions.iter().any(|x| x == reg) => {}
                    Some(reg) => {
                        return Verdict::DataBoundary(format!(
                            "channel `{}` serving {} is in region `{reg}`, outside the workflow's regions ({})",
                            c.cfg.name,
                            r.to,
                            b.regions.join(", ")
                        ));
                    }
                    None => {
                        return Verdict::DataBoundary(format!(
                            "channel `{}` serving {} has no `region` in the config, so the workflow's regions ({}) cannot be shown to hold",
                            c.cfg.name,
                            r.to,
                            b.regions.join(", ")
                        ));
                    }
                }
            }
        }
    }
    let body: Option<serde_json::Value> = j.body.as_deref().and_then(|b| serde_json::from_slice(b).ok());
    match &body {
        Some(v) => {
            if wf.fallback.require_equivalent_tools && uses_tools(v) && !r.equivalent_tools {
                return Verdict::Mismatch(format!(
                    "the request uses tools and {} is not approved as tool-equivalent",
                    r.to
                ));
            }
            if wf.fallback.require_schema_match && uses_schema(v) && !r.schema_match {
                return Verdict::Mismatch(format!(
                    "the request asks for structured output and {} is not approved as schema-equivalent",
                    r.to
                ));
            }
        }
        None if wf.fallback.require_equivalent_tools || wf.fallback.require_schema_match => {
            return Verdict::Unknown("the job's body could not be read to check its tools and schema".into());
        }
        None => {}
    }
    if wf.fallback.require_cost_cap {
        let Some(cap) = r.max_cost_usd else {
            return Verdict::Unknown(format!("{} has no cost cap in the workflow", r.to));
        };
        match estimate(st, model, j) {
            Some(c) if c <= cap => {}
            Some(c) => {
                return Verdict::Mismatch(format!(
                    "the job's estimate on {} is ${c:.6}, over the route's cap of ${cap:.6}",
                    r.to
                ));
            }
            None => {
                return Verdict::Unknown(format!(
                    "the pricing catalog has no price for {model}, so the cost cap cannot be checked"
                ));
            }
        }
    }
    Verdict::Holds
}

/// M3: what the job is expected to cost on `model`, at the catalog in force now.
pub fn estimate(st: &AppState, model: &str, j: &JobRecord) -> Option<f64> {
    let pricing = st.accounts.pricing();
    let p = pricing.price(model)?;
    if j.api == "count_tokens" {
        return Some(0.0);
    }
    let t = spillway_wire::usage::Billable {
        input: j.estimated_input_tokens?,
        output: j.estimated_output_tokens.unwrap_or(0),
        ..Default::default()
    };
    Some(p.usd(&t))
}
