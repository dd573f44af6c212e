//! Money and keys (B3–B5, M3): owners' credits, keys made outside the config (only the
//! hash of their secret), operators' spend limits, and spend read back from the requests'
//! own costs. A balance is never a counter the request path updates: it is the owner's
//! credits minus its requests' costs, so the ledger alone can always recompute it.

use serde::Serialize;
use spillway_wire::UnixMs;
use ts_rs::TS;

/// A credit to an owner's balance.
#[derive(Clone, Debug, PartialEq, Serialize, TS)]
pub struct BalanceEntry {
    pub owner: String,
    pub at: UnixMs,
    /// `seed` (the config's `balance_usd`, once), `top_up`, `opening` (when a metered
    /// owner gets its first credit: what makes its balance start at that credit), or
    /// `pruned_charges` (the costs of pruned requests, folded in as a negative credit).
    pub kind: String,
    pub amount_usd: f64,
    pub actor: Option<String>,
    pub reason: Option<String>,
}

/// B5: a key made from the console or the CLI. Its secret is never stored.
#[derive(Clone, Debug, PartialEq, Serialize, TS)]
pub struct StoredKey {
    pub name: String,
    pub owner: String,
    /// SHA-256 of the secret, hex.
    #[serde(skip)]
    #[ts(skip)]
    pub secret_sha256: String,
    /// The secret's first characters, so a person can tell keys apart.
    pub hint: String,
    pub rpm: Option<u32>,
    pub max_concurrency: Option<u32>,
    pub created_at: UnixMs,
    pub created_by: String,
    pub revoked_at: Option<UnixMs>,
    pub revoked_by: Option<String>,
}

/// An operator's spend limit on a key, and the spend of its pruned requests.
#[derive(Clone, Debug, PartialEq)]
pub struct KeySpend {
    pub key_name: String,
    /// Whether an operator set the limit (then `spend_limit_usd` overrides the config's,
    /// None lifting it).
    pub limit_set: bool,
    pub spend_limit_usd: Option<f64>,
    pub folded_usd: f64,
}

/// Known costs summed over a group of requests.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpendRow {
    pub owner: Option<String>,
    pub key_name: Option<String>,
    pub route: Option<String>,
    pub cost_usd: f64,
    pub requests: u64,
}

/// What the gateway loads at start-up to know every balance and key.
#[derive(Clone, Debug, Default)]
pub struct Accounts {
    /// Credits per owner.
    pub credits: Vec<(String, f64)>,
    /// Owners held to a balance: seeded by the config or topped up (pruned charges alone
    /// do not make an owner prepaid).
    pub prepaid: Vec<String>,
    /// All-time known costs by owner, key and route.
    pub spend: Vec<SpendRow>,
    pub keys: Vec<StoredKey>,
    pub key_spend: Vec<KeySpend>,
}

/// One cell of the cost report: requests received in one time bucket, by owner, key,
/// route and model.
#[derive(Clone, Debug, Default, PartialEq, Serialize, TS)]
pub struct CostCell {
    /// The bucket's start.
    pub at: UnixMs,
    pub owner: Option<String>,
    pub key_name: Option<String>,
    pub route: Option<String>,
    pub model: Option<String>,
    pub requests: u64,
    /// Requests whose cost is unknown (unpriced model, no usage reported).
    pub unknown_cost: u64,
    pub cost_usd: f64,
    /// The part spent on attempts that did not give the answer.
    pub failed_cost_usd: f64,
    /// Upstream attempts beyond the first, summed.
    pub retries: u64,
    /// Estimates and actuals of the requests that went upstream and have both (so they
    /// compare like with like).
    pub estimated_usd: f64,
    pub estimated_actual_usd: f64,
    pub estimated_input_tokens: u64,
    pub actual_input_tokens: u64,
}
