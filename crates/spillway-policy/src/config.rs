//! The gateway config file: raw shape (as written, with locations) and validated shape.

use crate::error::{ConfigError, ConfigErrors, Result};
use crate::sim::Scenario;
use serde::Deserialize;
use serde_saphyr::Spanned;
use sha2::{Digest, Sha256};
use spillway_wire::Format;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8787";
/// A5: bodies over 16 MiB get 413 unless the config says otherwise.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 16 * 1024 * 1024;
/// F3: interactive attempts get 8 s.
pub const DEFAULT_ATTEMPT_TIMEOUT_MS: u64 = 8_000;
const DEFAULT_CHANNEL_CONCURRENCY: u32 = 64;
/// D1, F3: three attempts per request across the channel group.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// F3: an interactive request gets 20 s in all, queueing and retries included.
pub const DEFAULT_TOTAL_DEADLINE_MS: u64 = 20_000;
/// C2: at most 10 s waiting for channel capacity; a config may set less, never more.
pub const MAX_CAPACITY_WAIT_MS: u64 = 10_000;
/// C2: requests waiting for capacity at once, gateway-wide; past it the C2 429 comes at once.
pub const DEFAULT_CAPACITY_QUEUE_MAX: u32 = 1024;

type S<T> = Spanned<T>;

/// Numbers `Ctx::bounded` can check: it words a `1..=MAX` range as "greater than 0".
pub(crate) trait Bounded {
    const ONE: Self;
    const MAX: Self;
}

impl Bounded for u64 {
    const ONE: u64 = 1;
    const MAX: u64 = u64::MAX;
}

impl Bounded for u32 {
    const ONE: u32 = 1;
    const MAX: u32 = u32::MAX;
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    listen: Option<S<String>>,
    /// Host names (besides loopback ones) the listener answers.
    #[serde(default)]
    allowed_hosts: Option<S<Vec<String>>>,
    #[serde(default)]
    server: Option<S<RawServer>>,
    #[serde(default)]
    upstream: Option<S<RawUpstream>>,
    #[serde(default)]
    capacity_queue_max: Option<S<u32>>,
    #[serde(default)]
    simulator: Option<S<Scenario>>,
    #[serde(default)]
    ledger: Option<S<String>>,
    #[serde(default)]
    max_body_bytes: Option<S<u64>>,
    #[serde(default)]
    attempt_timeout_ms: Option<S<u64>>,
    #[serde(default)]
    max_attempts: Option<S<u32>>,
    #[serde(default)]
    total_deadline_ms: Option<S<u64>>,
    #[serde(default)]
    capacity_wait_ms: Option<S<u64>>,
    channels: S<Vec<S<RawChannel>>>,
    #[serde(default)]
    keys: Vec<S<RawKey>>,
    #[serde(default)]
    owners: Vec<S<RawOwner>>,
    #[serde(default)]
    control: Option<S<RawControl>>,
    #[serde(default)]
    recovery: Option<S<RawRecovery>>,
    /// R2: the Redis that holds a fleet's limits, breakers and retry budgets.
    #[serde(default)]
    redis: Option<S<String>>,
    /// R1, R2: this instance's place in a fleet.
    #[serde(default)]
    fleet: Option<S<RawFleet>>,
    /// A bearer token `/metrics` asks for; without one it is open (on loopback).
    #[serde(default)]
    metrics_token: Option<S<String>>,
    /// Where operator alerts are also POSTed as JSON (G4).
    #[serde(default)]
    alert_webhook_url: Option<S<String>>,
    #[serde(default)]
    idempotency: Option<S<RawIdempotency>>,
    /// I6: keep request bodies (prompts) in the ledger; by default only their hash.
    #[serde(default)]
    store_prompts: Option<S<bool>>,
    /// M1: a pricing catalog replacing the built-in one.
    #[serde(default)]
    pricing: Option<S<String>>,
    /// Daily budgets: the day's time zone and per-route amounts.
    #[serde(default)]
    budgets: Option<S<RawBudgets>>,
    /// J8: a directory of workflow policies (`*.yaml`); without it the shipped ones.
    #[serde(default)]
    workflows: Option<S<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBudgets {
    #[serde(default)]
    time_zone: Option<S<String>>,
    /// USD per day by route (`openai/gpt-4.1`).
    #[serde(default)]
    routes: Option<S<std::collections::BTreeMap<String, f64>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIdempotency {
    #[serde(default)]
    window_hours: Option<S<u64>>,
    #[serde(default)]
    max_stored_response_bytes: Option<S<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawControl {
    #[serde(default)]
    retry_budget_percent: Option<S<u32>>,
    #[serde(default)]
    retry_budget_min: Option<S<u32>>,
    #[serde(default)]
    wait_slo_ms: Option<S<u64>>,
    #[serde(default)]
    route_wait_slo_ms: Option<S<std::collections::BTreeMap<String, u64>>>,
    #[serde(default)]
    breaker_cool_down_ms: Option<S<u64>>,
    #[serde(default)]
    ejection_cool_down_ms: Option<S<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFleet {
    #[serde(default)]
    instance: Option<S<String>>,
    #[serde(default)]
    heartbeat_ms: Option<S<u64>>,
    #[serde(default)]
    stale_after_ms: Option<S<u64>>,
    #[serde(default)]
    expected_instances: Option<S<u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRecovery {
    #[serde(default)]
    stage_ms: Option<S<u64>>,
    #[serde(default)]
    drill_stage_ms: Option<S<u64>>,
    #[serde(default)]
    drill_incident_ms: Option<S<u64>>,
    #[serde(default)]
    relapse_ms: Option<S<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    #[serde(default)]
    header_read_timeout_ms: Option<S<u64>>,
    #[serde(default)]
    body_read_timeout_ms: Option<S<u64>>,
    #[serde(default)]
    keep_alive_idle_ms: Option<S<u64>>,
    #[serde(default)]
    write_timeout_ms: Option<S<u64>>,
    #[serde(default)]
    max_connections: Option<S<u32>>,
    #[serde(default)]
    max_http2_streams: Option<S<u32>>,
    #[serde(default)]
    drain_timeout_ms: Option<S<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    #[serde(default)]
    connect_timeout_ms: Option<S<u64>>,
    #[serde(default)]
    first_byte_timeout_ms: Option<S<u64>>,
    #[serde(default)]
    stream_idle_timeout_ms: Option<S<u64>>,
    #[serde(default)]
    tcp_keepalive_ms: Option<S<u64>>,
    #[serde(default)]
    max_response_bytes: Option<S<u64>>,
    #[serde(default)]
    max_buffered_before_first_token_bytes: Option<S<u64>>,
    #[serde(default)]
    max_wait_hint_ms: Option<S<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawChannel {
    name: S<String>,
    format: S<String>,
    base_url: S<String>,
    #[serde(default)]
    api_key_env: Option<S<String>>,
    models: S<Vec<String>>,
    #[serde(default)]
    max_concurrency: Option<S<u32>>,
    #[serde(default)]
    weight: Option<S<u32>>,
    #[serde(default)]
    priority: Option<S<i32>>,
    #[serde(default)]
    timeout_ms: Option<S<u64>>,
    /// `http://` to a host that is not loopback sends prompts and keys in clear text:
    /// refused unless this says so.
    #[serde(default)]
    allow_plain_http: Option<S<bool>>,
    /// The channel exists only while this environment variable is set (a real provider
    /// whose key may or may not be there).
    #[serde(default)]
    only_if_env: Option<S<String>>,
    /// The channel exists only while this environment variable is unset (a simulated
    /// stand-in for a provider without a key).
    #[serde(default)]
    unless_env: Option<S<String>>,
    /// K1: where the channel's provider processes data (`us`, `eu`, ...), for workflows
    /// with a data boundary.
    #[serde(default)]
    region: Option<S<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    name: S<String>,
    owner: S<String>,
    #[serde(default)]
    secret_env: Option<S<String>>,
    #[serde(default)]
    secret_sha256: Option<S<String>>,
    /// With `secret_env` unset, make a fresh secret at start-up (shown once): the demo key.
    #[serde(default)]
    generate_if_unset: Option<S<bool>>,
    #[serde(default)]
    rpm: Option<S<u32>>,
    /// Token counting (free at the providers) takes from `rpm` too; off by default.
    #[serde(default)]
    rpm_counts_token_counting: Option<S<bool>>,
    #[serde(default)]
    max_concurrency: Option<S<u32>>,
    #[serde(default)]
    spend_limit_usd: Option<S<f64>>,
    /// J8: the workflow of the key's requests that name none.
    #[serde(default)]
    workflow: Option<S<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOwner {
    name: S<String>,
    #[serde(default)]
    balance_usd: Option<S<f64>>,
    #[serde(default)]
    daily_budget_usd: Option<S<f64>>,
}

/// A validated gateway config.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    /// Set when `listen` is not a loopback address (P1): the caller warns.
    pub listen_warning: Option<String>,
    /// Host names the listener answers besides loopback ones (lower case, no port).
    pub allowed_hosts: Vec<String>,
    pub server: ServerLimits,
    pub upstream: UpstreamLimits,
    /// Requests waiting for channel capacity at once, gateway-wide (C2).
    pub capacity_queue_max: u32,
    /// Simulated providers to start (the embedded default); channels reach them through
    /// `sim://<name>` until the launcher puts the simulator's address in.
    pub simulator: Option<Scenario>,
    /// Key secrets made at start-up (`generate_if_unset`), to show once.
    pub generated: Vec<GeneratedSecret>,
    pub ledger: Option<LedgerLocation>,
    pub max_body_bytes: u64,
    pub attempt_timeout_ms: u64,
    /// Upstream attempts per request, first one included (D1).
    pub max_attempts: u32,
    /// Everything a request may take, from receipt to its last byte's start (F3).
    pub total_deadline_ms: u64,
    /// Longest wait for channel capacity (C2).
    pub capacity_wait_ms: u64,
    pub channels: Vec<Channel>,
    pub keys: Vec<Key>,
    pub owners: Vec<Owner>,
    pub control: ControlSettings,
    /// O1: guided recovery's stage times, and a drill's.
    pub recovery: RecoverySettings,
    /// R2: the Redis a fleet shares its limits, breakers and retry budgets through.
    pub redis: Option<SecretUrl>,
    /// R1, R2: this instance's name and the fleet's timings.
    pub fleet: FleetSettings,
    /// The SHA-256 of the bearer token `/metrics` asks for, when set (never the token).
    pub metrics_token: Option<KeySecret>,
    /// G4: operator alerts are also POSTed here as JSON. It may carry a token, so it is
    /// never logged (hence no Debug of its own value).
    pub alert_webhook_url: Option<WebhookUrl>,
    /// I2: how `Idempotency-Key`s and the responses kept for them behave.
    pub idempotency: IdempotencySettings,
    /// I6: request bodies are kept (for the idempotency window) instead of only hashed.
    pub store_prompts: bool,
    /// M1: the pricing catalog's path, when the config replaces the built-in one.
    pub pricing: Option<PathBuf>,
    pub budgets: Budgets,
    /// J8: the workflow policy directory, when the config names one.
    pub workflows: Option<PathBuf>,
}

/// I2, I6: idempotency keys and the response copies kept for their repeats.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencySettings {
    /// Keys (scoped by gateway key) and the response copies expire after this.
    pub window_ms: u64,
    /// A response larger than this is not kept: a repeat of its key gets a 409 naming the
    /// original request instead of the replayed body.
    pub max_stored_response_bytes: u64,
}

impl Default for IdempotencySettings {
    fn default() -> Self {
        IdempotencySettings {
            window_ms: 24 * 3_600_000,
            max_stored_response_bytes: 1024 * 1024,
        }
    }
}

/// A webhook's URL: shown as `<webhook>` in debug output, as it often carries a token.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookUrl(pub String);

impl std::fmt::Debug for WebhookUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookUrl(<redacted>)")
    }
}

/// The control plane's settings (F4, G1).
#[derive(Clone, Debug, PartialEq)]
pub struct ControlSettings {
    /// F4: retries allowed per new request over the budget's window (0.2 = 20 %).
    pub retry_budget_ratio: f64,
    /// F4: retries a route may always make in the window, however quiet it is.
    pub retry_budget_min: u32,
    /// G1: the capacity-wait SLO of every route without its own; None turns the P95
    /// wait trigger off.
    pub wait_slo_ms: Option<u64>,
    /// G1: per-route SLOs, keyed `format/model` (`openai/gpt-4o-mini`).
    pub route_wait_slo_ms: std::collections::BTreeMap<String, u64>,
    /// G3: time open before the first probation; doubled by each failed probation.
    pub breaker_cool_down_ms: u64,
    /// D5: a channel's first cool-down after repeated failures; doubled by each ejection
    /// in a row.
    pub ejection_cool_down_ms: u64,
}

impl Default for ControlSettings {
    fn default() -> Self {
        ControlSettings {
            retry_budget_ratio: 0.2,
            retry_budget_min: 3,
            wait_slo_ms: None,
            route_wait_slo_ms: Default::default(),
            breaker_cool_down_ms: 30_000,
            ejection_cool_down_ms: 30_000,
        }
    }
}

impl ControlSettings {
    /// The wait SLO of route `format/model`.
    pub fn wait_slo_ms(&self, route: &str) -> Option<u64> {
        self.route_wait_slo_ms.get(route).copied().or(self.wait_slo_ms)
    }
}

/// Guided recovery (O1) and drills.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoverySettings {
    /// Each resume stage (25, 50, 100 %) of a real run.
    pub stage_ms: u64,
    /// The same in a drill: practice should not take 45 minutes.
    pub drill_stage_ms: u64,
    /// How long a drill's staged fault lasts before the simulated provider recovers.
    pub drill_incident_ms: u64,
    /// A drill's staged relapse: a burst of 503s this long at most; it ends at the
    /// step-back it causes.
    pub relapse_ms: u64,
}

impl Default for RecoverySettings {
    fn default() -> Self {
        RecoverySettings {
            stage_ms: 15 * 60_000,
            drill_stage_ms: 20_000,
            drill_incident_ms: 30_000,
            relapse_ms: 10_000,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LedgerLocation {
    Sqlite(PathBuf),
    /// R1: a PostgreSQL ledger a fleet shares.
    Postgres(SecretUrl),
}

/// A URL that may carry a password (`postgres://user:secret@host/db`): its Debug and
/// [`SecretUrl::redacted`] never show the password.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(pub String);

impl SecretUrl {
    /// The URL with any password replaced by `***`, for logs and the console: the user
    /// info's (which may itself hold a `/`) and a `password=` query parameter's (libpq's
    /// other way of giving one).
    pub fn redacted(&self) -> String {
        let s = &self.0;
        let Some(scheme_end) = s.find("://") else {
            return s.clone();
        };
        let (scheme, rest) = (&s[..scheme_end], &s[scheme_end + 3..]);
        let (main, query) = match rest.find('?') {
            Some(q) => (&rest[..q], Some(&rest[q + 1..])),
            None => (rest, None),
        };
        let main = match main.rfind('@') {
            Some(at) => match main[..at].split_once(':') {
                Some((user, _)) => format!("{user}:***{}", &main[at..]),
                None => main.to_owned(),
            },
            None => main.to_owned(),
        };
        match query {
            None => format!("{scheme}://{main}"),
            Some(q) => {
                let q: Vec<String> = q
                    .split('&')
                    .map(|kv| match kv.split_once('=') {
                        Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                        _ => kv.to_owned(),
                    })
                    .collect();
                format!("{scheme}://{main}?{}", q.join("&"))
            }
        }
    }
}

impl std::fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretUrl({})", self.redacted())
    }
}

/// R1, R2: an instance's place in a fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetSettings {
    /// The instance's name; None: `host:port` of its listener.
    pub instance: Option<String>,
    /// How often an instance writes its heartbeat to the shared ledger.
    pub heartbeat_ms: u64,
    /// An instance whose heartbeat is older than this is dead: a survivor takes its
    /// in-flight requests over (as `unknown`) and its job leases expire.
    pub stale_after_ms: u64,
    /// N in "limits at 1/N while Redis is unreachable"; None: the instances the ledger
    /// last saw alive.
    pub expected_instances: Option<u32>,
}

impl Default for FleetSettings {
    fn default() -> Self {
        FleetSettings {
            instance: None,
            heartbeat_ms: 2_000,
            stale_after_ms: 10_000,
            expected_instances: None,
        }
    }
}

/// What the listener allows its clients (each limit bounds what a slow or hostile client
/// can hold).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// From a request's first byte to the end of its headers (slowloris).
    pub header_read_timeout_ms: u64,
    /// To receive the whole body, once the headers are in.
    pub body_read_timeout_ms: u64,
    /// A keep-alive connection with no request in flight is closed after this.
    pub keep_alive_idle_ms: u64,
    /// A client that stops reading its answer for this long is cut off, freeing its
    /// channel and key slots.
    pub write_timeout_ms: u64,
    /// Open client connections; past it a connection is answered 503 and closed.
    pub max_connections: u32,
    /// Concurrent requests on one HTTP/2 connection.
    pub max_http2_streams: u32,
    /// On shutdown, how long in-flight requests get to finish before they are cut off.
    pub drain_timeout_ms: u64,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            keep_alive_idle_ms: 60_000,
            write_timeout_ms: 30_000,
            max_connections: 1024,
            max_http2_streams: 128,
            drain_timeout_ms: 15_000,
        }
    }
}

/// What the gateway allows its upstreams.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamLimits {
    pub connect_timeout_ms: u64,
    /// From sending the request to the response headers (never more than the attempt's
    /// own timeout).
    pub first_byte_timeout_ms: u64,
    /// A stream that already showed output and then sends nothing for this long is ended.
    pub stream_idle_timeout_ms: u64,
    /// TCP keepalive probes on upstream connections, so a dead peer is noticed.
    pub tcp_keepalive_ms: u64,
    /// Largest non-streaming answer (or error body) read from a provider.
    pub max_response_bytes: u64,
    /// Largest stream prefix held back before its first visible token (H2).
    pub max_buffered_before_first_token_bytes: u64,
    /// Longest wait hint believed (`Retry-After`, reset headers, RetryInfo): a provider
    /// asking for more is taken to mean this.
    pub max_wait_hint_ms: u64,
}

impl Default for UpstreamLimits {
    fn default() -> Self {
        UpstreamLimits {
            connect_timeout_ms: 5_000,
            first_byte_timeout_ms: DEFAULT_ATTEMPT_TIMEOUT_MS,
            stream_idle_timeout_ms: 30_000,
            tcp_keepalive_ms: 30_000,
            max_response_bytes: 32 * 1024 * 1024,
            max_buffered_before_first_token_bytes: 1024 * 1024,
            max_wait_hint_ms: 600_000,
        }
    }
}

/// A key secret made at start-up. Shown once; the config keeps only its hash.
#[derive(Clone)]
pub struct GeneratedSecret {
    pub key: String,
    pub secret: String,
}

impl std::fmt::Debug for GeneratedSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GeneratedSecret")
            .field("key", &self.key)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// An upstream channel: one provider endpoint with one credential.
#[derive(Clone)]
pub struct Channel {
    pub name: String,
    pub format: Format,
    /// Without a trailing slash; the client's path is appended as sent.
    pub base_url: String,
    /// The upstream credential, read from `api_key_env` (P4). Never printed.
    pub api_key: Option<String>,
    /// `*` serves any model.
    pub models: Vec<String>,
    pub max_concurrency: u32,
    pub weight: u32,
    /// Tiers: a request tries the channels of the highest priority first (primary and
    /// backup channels); `weight` spreads traffic within a tier (D4). Default 0.
    pub priority: i32,
    pub timeout_ms: Option<u64>,
    /// The simulated channel this one stands for (`base_url: sim://<name>`), until the
    /// launcher starts the simulator and puts its address into `base_url`.
    pub simulated: Option<String>,
    /// K1: the data region the channel's provider processes in, when the config says.
    pub region: Option<String>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("name", &self.name)
            .field("format", &self.format)
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("models", &self.models)
            .field("max_concurrency", &self.max_concurrency)
            .field("weight", &self.weight)
            .field("priority", &self.priority)
            .field("simulated", &self.simulated)
            .finish()
    }
}

impl Channel {
    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m == "*" || m == model)
    }
}

/// How a gateway key's secret is known: only ever as a SHA-256 digest (B5).
#[derive(Clone, PartialEq, Eq)]
pub struct KeySecret(pub [u8; 32]);

impl std::fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySecret(<sha256>)")
    }
}

pub fn hash_secret(secret: &str) -> KeySecret {
    KeySecret(Sha256::digest(secret.as_bytes()).into())
}

#[derive(Clone, Debug)]
pub struct Key {
    pub name: String,
    pub owner: String,
    pub secret: KeySecret,
    pub rpm: Option<u32>,
    /// Whether token-counting calls take from `rpm` (they never do unless set).
    pub rpm_counts_token_counting: bool,
    pub max_concurrency: Option<u32>,
    pub spend_limit_usd: Option<f64>,
    /// J8: the workflow of the key's requests that name none (checked by the engine
    /// against the policies it loads).
    pub workflow: Option<String>,
}

#[derive(Clone, Debug)]
pub struct Owner {
    pub name: String,
    /// B4: seeds the owner's balance the first time the ledger meets the owner; after
    /// that the ledger's balance (top-ups, charges) is the truth. Without one (and
    /// without a top-up on record) the owner is not held to a balance (B3 does not apply).
    pub balance_usd: Option<f64>,
    /// Spend per day (in `budgets.time_zone`) past which the owner's requests get 402.
    pub daily_budget_usd: Option<f64>,
}

/// Daily budgets: where a day begins, and what each route may spend in one (G1's cost
/// trigger opens a route's breaker when its last hour cost more than a quarter of it).
#[derive(Clone, Debug)]
pub struct Budgets {
    /// An IANA time zone name (`Europe/Berlin`), `UTC` by default. Checked here for its
    /// shape; the engine reads it from the system's tz database at start-up (this crate
    /// does no I/O), and a name the database lacks stops the start with an error.
    pub time_zone: String,
    pub routes: std::collections::BTreeMap<String, f64>,
}

impl Default for Budgets {
    fn default() -> Budgets {
        Budgets {
            time_zone: "UTC".into(),
            routes: Default::default(),
        }
    }
}

/// Whether `name` has the shape of an IANA time zone name (`UTC`, `Europe/Berlin`,
/// `America/Argentina/Buenos_Aires`, `Etc/GMT+5`): no path tricks.
pub fn valid_time_zone_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('/')
        && !name.contains("..")
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"/_+-".contains(&b))
}

pub(crate) struct Ctx<'a> {
    pub(crate) file: &'a str,
    pub(crate) errors: Vec<ConfigError>,
}

impl Ctx<'_> {
    pub(crate) fn err<T>(&mut self, at: &Spanned<T>, field: impl Into<String>, message: impl Into<String>) {
        self.errors.push(ConfigError {
            file: self.file.to_owned(),
            line: at.referenced.line() as u32,
            column: at.referenced.column() as u32,
            field: field.into(),
            message: message.into(),
        });
    }

    /// An optional number that must lie in `range`; the default when absent. Out of range
    /// is an error naming the field (the default only stands in so validation can go on
    /// and report every error at once).
    pub(crate) fn bounded<T>(
        &mut self,
        v: &Option<Spanned<T>>,
        field: &str,
        range: std::ops::RangeInclusive<T>,
        default: T,
    ) -> T
    where
        T: Copy + PartialOrd + std::fmt::Display + Bounded,
    {
        match v {
            Some(m) if !range.contains(&m.value) => {
                let msg = match (*range.start() == T::ONE, *range.end() == T::MAX) {
                    (true, true) => "must be greater than 0".to_owned(),
                    _ => format!("must be between {} and {}", range.start(), range.end()),
                };
                self.err(m, field, msg);
                default
            }
            Some(m) => m.value,
            None => default,
        }
    }
}

impl Config {
    /// Parses and validates `text`, read from `file` (used in messages and to resolve a
    /// relative ledger path). `env` looks environment variables up; `new_secret` makes a
    /// key secret for a key that asks for one (`generate_if_unset`).
    pub fn parse(
        file: &Path,
        text: &str,
        env: &dyn Fn(&str) -> Option<String>,
        new_secret: &dyn Fn() -> String,
    ) -> Result<Config> {
        let name = file.display().to_string();
        let raw: RawConfig = serde_saphyr::from_str(text).map_err(|e| yaml_error(&name, text, &e))?;
        let base_dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
        raw.validate(&name, &base_dir, env, new_secret)
    }

    /// Points the simulated channels at a running simulator: `url(name)` is the base URL
    /// of simulated channel `name`.
    pub fn resolve_simulator(&mut self, url: &dyn Fn(&str) -> String) {
        for c in &mut self.channels {
            if let Some(name) = &c.simulated {
                c.base_url = url(name);
            }
        }
    }

    /// Whether `host` (a Host header or URL authority, port included or not) is one the
    /// listener answers: a loopback name or address, or one listed in `allowed_hosts`.
    pub fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host);
        is_loopback_host(&name) || self.allowed_hosts.contains(&name)
    }
}

/// The name a Host header or URL authority names: without its port and a trailing dot,
/// in lower case (`Localhost.:8787` is `localhost`, `[::1]:80` is `::1`).
pub fn host_name(host: &str) -> String {
    strip_port(host.trim()).trim_end_matches('.').to_ascii_lowercase()
}

/// `host[:port]` or `[v6]:port` without the port.
fn strip_port(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or_default();
    }
    match host.rsplit_once(':') {
        Some((h, port)) if !h.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

/// `localhost`, `*.localhost` (RFC 6761 keeps them on this machine) or a loopback address.
pub fn is_loopback_host(name: &str) -> bool {
    name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn valid_host_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
}

/// A YAML syntax or type error in `text` (read from `file`), located: the parser knows
/// the position, the line names the field.
pub(crate) fn yaml_error(file: &str, text: &str, e: &serde_saphyr::Error) -> ConfigErrors {
    let (line, column) = e
        .location()
        .map(|l| (l.line() as u32, l.column() as u32))
        .unwrap_or((0, 0));
    let message = e.without_snippet().to_string();
    // The library appends its own position; ours leads the line already.
    let message = message.split(" at line ").next().unwrap_or(&message).trim().to_owned();
    ConfigErrors(vec![ConfigError {
        file: file.to_owned(),
        line,
        column,
        field: key_on_line(text, line).unwrap_or_default(),
        message,
    }])
}

/// The YAML key written on `line`, so a type error ("invalid u32") names its field even
/// though the parser only knows the position.
fn key_on_line(text: &str, line: u32) -> Option<String> {
    let l = text.lines().nth((line as usize).checked_sub(1)?)?;
    let l = l.trim_start().trim_start_matches("- ").trim_start();
    let (key, _) = l.split_once(':')?;
    let ok = !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    ok.then(|| key.to_owned())
}

fn parse_ledger(url: &str, base_dir: &Path) -> std::result::Result<LedgerLocation, String> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let u = SecretUrl(url.to_owned());
        let after = &url[url.find("://").map_or(0, |i| i + 3)..];
        if after.is_empty() {
            return Err(format!(
                "`{}` names no PostgreSQL server; expected postgres://user@host:port/database",
                u.redacted()
            ));
        }
        return Ok(LedgerLocation::Postgres(u));
    }
    let rest = url.strip_prefix("sqlite://").ok_or_else(|| {
        format!(
            "`{}` is not a ledger URL; expected sqlite:///path/to/ledger.db or postgres://user@host:port/database",
            SecretUrl(url.to_owned()).redacted()
        )
    })?;
    if rest.is_empty() {
        return Err("sqlite:// needs a file path, e.g. sqlite:///var/lib/spillway/ledger.db".into());
    }
    let p = PathBuf::from(rest);
    Ok(LedgerLocation::Sqlite(if p.is_absolute() {
        p
    } else {
        base_dir.join(p)
    }))
}

fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

impl RawConfig {
    fn validate(
        self,
        file: &str,
        base_dir: &Path,
        env: &dyn Fn(&str) -> Option<String>,
        new_secret: &dyn Fn() -> String,
    ) -> Result<Config> {
        let mut cx = Ctx {
            file,
            errors: Vec::new(),
        };

        let mut listen: SocketAddr = DEFAULT_LISTEN.parse().map_err(|_| ConfigErrors(vec![]))?;
        let mut listen_warning = None;
        if let Some(l) = &self.listen {
            match l.value.parse::<SocketAddr>() {
                Ok(a) => {
                    listen = a;
                    if !a.ip().is_loopback() {
                        listen_warning = Some(format!(
                            "{file}:{}: listen: {a} is not a loopback address; the gateway is reachable from other machines",
                            l.referenced.line()
                        ));
                    }
                }
                Err(_) => cx.err(
                    l,
                    "listen",
                    format!("`{}` is not HOST:PORT (e.g. 127.0.0.1:8787)", l.value),
                ),
            }
        }

        let ledger = match &self.ledger {
            Some(l) => match parse_ledger(&l.value, base_dir) {
                Ok(loc) => Some(loc),
                Err(m) => {
                    cx.err(l, "ledger", m);
                    None
                }
            },
            None => None,
        };

        let max_body_bytes = cx.bounded(
            &self.max_body_bytes,
            "max_body_bytes",
            1..=u64::MAX,
            DEFAULT_MAX_BODY_BYTES,
        );
        let attempt_timeout_ms = cx.bounded(
            &self.attempt_timeout_ms,
            "attempt_timeout_ms",
            1..=u64::MAX,
            DEFAULT_ATTEMPT_TIMEOUT_MS,
        );
        let max_attempts = cx.bounded(&self.max_attempts, "max_attempts", 1..=10, DEFAULT_MAX_ATTEMPTS);
        let total_deadline_ms = cx.bounded(
            &self.total_deadline_ms,
            "total_deadline_ms",
            1..=u64::MAX,
            DEFAULT_TOTAL_DEADLINE_MS,
        );
        let capacity_wait_ms = match &self.capacity_wait_ms {
            Some(m) if m.value > MAX_CAPACITY_WAIT_MS => {
                cx.err(
                    m,
                    "capacity_wait_ms",
                    format!("must be at most {MAX_CAPACITY_WAIT_MS} (C2 caps capacity waits at 10 s)"),
                );
                MAX_CAPACITY_WAIT_MS
            }
            Some(m) => m.value,
            None => MAX_CAPACITY_WAIT_MS,
        };

        let mut allowed_hosts = Vec::new();
        if let Some(hosts) = &self.allowed_hosts {
            for h in &hosts.value {
                let name = host_name(h);
                if !valid_host_name(&name) {
                    cx.err(hosts, "allowed_hosts", format!("`{h}` is not a host name"));
                } else {
                    allowed_hosts.push(name);
                }
            }
        }
        let d = ServerLimits::default();
        let server = match &self.server {
            None => d,
            Some(sv) => {
                let r = &sv.value;
                ServerLimits {
                    header_read_timeout_ms: cx.bounded(
                        &r.header_read_timeout_ms,
                        "server.header_read_timeout_ms",
                        100..=600_000,
                        d.header_read_timeout_ms,
                    ),
                    body_read_timeout_ms: cx.bounded(
                        &r.body_read_timeout_ms,
                        "server.body_read_timeout_ms",
                        100..=3_600_000,
                        d.body_read_timeout_ms,
                    ),
                    keep_alive_idle_ms: cx.bounded(
                        &r.keep_alive_idle_ms,
                        "server.keep_alive_idle_ms",
                        100..=3_600_000,
                        d.keep_alive_idle_ms,
                    ),
                    write_timeout_ms: cx.bounded(
                        &r.write_timeout_ms,
                        "server.write_timeout_ms",
                        100..=3_600_000,
                        d.write_timeout_ms,
                    ),
                    max_connections: cx.bounded(
                        &r.max_connections,
                        "server.max_connections",
                        1..=1_000_000,
                        d.max_connections,
                    ),
                    max_http2_streams: cx.bounded(
                        &r.max_http2_streams,
                        "server.max_http2_streams",
                        1..=10_000,
                        d.max_http2_streams,
                    ),
                    drain_timeout_ms: cx.bounded(
                        &r.drain_timeout_ms,
                        "server.drain_timeout_ms",
                        0..=600_000,
                        d.drain_timeout_ms,
                    ),
                }
            }
        };
        let d = UpstreamLimits::default();
        let upstream = match &self.upstream {
            None => UpstreamLimits {
                first_byte_timeout_ms: attempt_timeout_ms,
                ..d
            },
            Some(up) => {
                let r = &up.value;
                UpstreamLimits {
                    connect_timeout_ms: cx.bounded(
                        &r.connect_timeout_ms,
                        "upstream.connect_timeout_ms",
                        1..=120_000,
                        d.connect_timeout_ms,
                    ),
                    first_byte_timeout_ms: cx.bounded(
                        &r.first_byte_timeout_ms,
                        "upstream.first_byte_timeout_ms",
                        1..=u64::MAX,
                        attempt_timeout_ms,
                    ),
                    stream_idle_timeout_ms: cx.bounded(
                        &r.stream_idle_timeout_ms,
                        "upstream.stream_idle_timeout_ms",
                        1..=u64::MAX,
                        d.stream_idle_timeout_ms,
                    ),
                    tcp_keepalive_ms: cx.bounded(
                        &r.tcp_keepalive_ms,
                        "upstream.tcp_keepalive_ms",
                        1_000..=7_200_000,
                        d.tcp_keepalive_ms,
                    ),
                    max_response_bytes: cx.bounded(
                        &r.max_response_bytes,
                        "upstream.max_response_bytes",
                        1024..=1 << 30,
                        d.max_response_bytes,
                    ),
                    max_buffered_before_first_token_bytes: cx.bounded(
                        &r.max_buffered_before_first_token_bytes,
                        "upstream.max_buffered_before_first_token_bytes",
                        1024..=64 << 20,
                        d.max_buffered_before_first_token_bytes,
                    ),
                    max_wait_hint_ms: cx.bounded(
                        &r.max_wait_hint_ms,
                        "upstream.max_wait_hint_ms",
                        1_000..=86_400_000,
                        d.max_wait_hint_ms,
                    ),
                }
            }
        };
        let capacity_queue_max = cx.bounded(
            &self.capacity_queue_max,
            "capacity_queue_max",
            0..=1_000_000,
            DEFAULT_CAPACITY_QUEUE_MAX,
        );
        let simulator = self.simulator.as_ref().map(|s| s.value.clone());

        let mut owners = Vec::new();
        let mut owner_names = HashSet::new();
        for (i, o) in self.owners.iter().enumerate() {
            let f = |s: &str| format!("owners[{i}].{s}");
            if !valid_name(&o.value.name.value) {
                cx.err(
                    &o.value.name,
                    f("name"),
                    "must be 1-64 letters, digits, '-', '_' or '.'",
                );
            } else if !owner_names.insert(o.value.name.value.clone()) {
                cx.err(
                    &o.value.name,
                    f("name"),
                    format!("owner `{}` is defined twice", o.value.name.value),
                );
            }
            let balance_usd = o.value.balance_usd.as_ref().map(|b| b.value);
            if let Some(b) = &o.value.balance_usd
                && !b.value.is_finite()
            {
                cx.err(b, f("balance_usd"), "must be a finite number");
            }
            let daily_budget_usd = o.value.daily_budget_usd.as_ref().map(|b| {
                if !b.value.is_finite() || b.value <= 0.0 {
                    cx.err(
                        b,
                        f("daily_budget_usd"),
                        "must be a number greater than 0 (USD per day)",
                    );
                }
                b.value
            });
            owners.push(Owner {
                name: o.value.name.value.clone(),
                balance_usd,
                daily_budget_usd,
            });
        }

        let mut channels = Vec::new();
        let mut channel_names = HashSet::new();
        for (i, c) in self.channels.value.iter().enumerate() {
            let c = &c.value;
            let f = |s: &str| format!("channels[{i}].{s}");
            let set = |name: &str| env(name).is_some_and(|v| !v.is_empty());
            let enabled = match (&c.only_if_env, &c.unless_env) {
                (Some(a), Some(_)) => {
                    cx.err(a, f("only_if_env"), "give either only_if_env or unless_env, not both");
                    true
                }
                (Some(v), None) => set(&v.value),
                (None, Some(v)) => !set(&v.value),
                (None, None) => true,
            };
            if !valid_name(&c.name.value) {
                cx.err(&c.name, f("name"), "must be 1-64 letters, digits, '-', '_' or '.'");
            } else if !channel_names.insert(c.name.value.clone()) {
                cx.err(
                    &c.name,
                    f("name"),
                    format!("channel `{}` is defined twice", c.name.value),
                );
            }
            let format = match c.format.value.parse::<Format>() {
                Ok(fm) => fm,
                Err(m) => {
                    cx.err(&c.format, f("format"), m);
                    Format::OpenAi
                }
            };
            let base_url = c.base_url.value.trim_end_matches('/').to_owned();
            let simulated = base_url.strip_prefix("sim://").map(str::to_owned);
            if let Some(name) = &simulated {
                if !simulator.as_ref().is_some_and(|s| s.channels.contains_key(name)) {
                    cx.err(
                        &c.base_url,
                        f("base_url"),
                        format!("`sim://{name}` names no channel of the `simulator` section"),
                    );
                }
            } else {
                let scheme_ok = base_url.starts_with("http://") || base_url.starts_with("https://");
                let authority = base_url
                    .split("://")
                    .nth(1)
                    .unwrap_or_default()
                    .split('/')
                    .next()
                    .unwrap_or_default();
                let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
                if !scheme_ok || host.is_empty() || authority.contains('@') || base_url.contains(['?', '#', ' ']) {
                    cx.err(
                        &c.base_url,
                        f("base_url"),
                        format!(
                            "`{}` is not an http(s) URL without credentials, query or fragment",
                            c.base_url.value
                        ),
                    );
                } else if base_url.starts_with("http://")
                    && !is_loopback_host(&host_name(host))
                    && !c.allow_plain_http.as_ref().is_some_and(|a| a.value)
                {
                    // Prompts and the channel's key would cross the network in clear text.
                    cx.err(
                        &c.base_url,
                        f("base_url"),
                        format!(
                            "`{}` is plain http:// to a host that is not this machine; use https://, or set `allow_plain_http: true` on the channel if that is really meant",
                            c.base_url.value
                        ),
                    );
                }
            }
            let api_key = match &c.api_key_env {
                Some(_) if !enabled => None,
                Some(e) => match env(&e.value) {
                    // No HTTP header can carry a control character; the usual one is the
                    // line break a key read from a file keeps. The key itself is never quoted.
                    Some(v) if v.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f) => {
                        cx.err(
                            e,
                            f("api_key_env"),
                            format!(
                                "environment variable {} holds a line break or another control character, which no HTTP header can carry (a key read from a file with its newline?)",
                                e.value
                            ),
                        );
                        None
                    }
                    Some(v) if !v.is_empty() => Some(v),
                    _ => {
                        cx.err(
                            e,
                            f("api_key_env"),
                            format!("environment variable {} is not set", e.value),
                        );
                        None
                    }
                },
                None => None,
            };
            if c.models.value.is_empty() {
                cx.err(&c.models, f("models"), "list at least one model, or \"*\" for any");
            }
            for m in &c.models.value {
                if m != "*" && !spillway_wire::request::valid_model_name(m) {
                    cx.err(&c.models, f("models"), format!("`{m}` is not a model name"));
                }
            }
            let max_concurrency = match &c.max_concurrency {
                Some(m) if m.value == 0 => {
                    cx.err(m, f("max_concurrency"), "must be at least 1");
                    1
                }
                Some(m) => m.value,
                None => DEFAULT_CHANNEL_CONCURRENCY,
            };
            let weight = match &c.weight {
                Some(w) if w.value == 0 => {
                    cx.err(
                        w,
                        f("weight"),
                        "must be at least 1 (remove the channel to stop using it)",
                    );
                    1
                }
                Some(w) => w.value,
                None => 1,
            };
            if let Some(t) = &c.timeout_ms
                && t.value == 0
            {
                cx.err(t, f("timeout_ms"), "must be greater than 0");
            }
            if let Some(r) = &c.region {
                let v = r.value.trim();
                if v.is_empty() || v.len() > 32 || !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
                    cx.err(
                        r,
                        f("region"),
                        "a region name: 1-32 letters, digits or '-' (e.g. us, eu, asia-northeast1)",
                    );
                }
            }
            if enabled {
                channels.push(Channel {
                    name: c.name.value.clone(),
                    format,
                    base_url,
                    api_key,
                    models: c.models.value.clone(),
                    max_concurrency,
                    weight,
                    priority: c.priority.as_ref().map_or(0, |p| p.value),
                    timeout_ms: c.timeout_ms.as_ref().map(|t| t.value),
                    simulated,
                    region: c.region.as_ref().map(|r| r.value.trim().to_ascii_lowercase()),
                });
            }
        }
        if channels.is_empty() {
            cx.err(
                &self.channels,
                "channels",
                "at least one channel is required (and in use: check only_if_env / unless_env)",
            );
        }

        let mut keys = Vec::new();
        let mut key_names = HashSet::new();
        let mut secrets = HashSet::new();
        let mut generated = Vec::new();
        for (i, k) in self.keys.iter().enumerate() {
            let at = k;
            let k = &k.value;
            let f = |s: &str| format!("keys[{i}].{s}");
            if !valid_name(&k.name.value) {
                cx.err(&k.name, f("name"), "must be 1-64 letters, digits, '-', '_' or '.'");
            } else if !key_names.insert(k.name.value.clone()) {
                cx.err(&k.name, f("name"), format!("key `{}` is defined twice", k.name.value));
            }
            if !owner_names.contains(&k.owner.value) {
                cx.err(
                    &k.owner,
                    f("owner"),
                    format!("owner `{}` is not listed under `owners`", k.owner.value),
                );
            }
            let generate = k.generate_if_unset.as_ref().is_some_and(|g| g.value);
            if let (true, Some(h)) = (generate, &k.secret_sha256) {
                cx.err(h, f("generate_if_unset"), "needs secret_env, not secret_sha256");
            }
            let secret = match (&k.secret_env, &k.secret_sha256) {
                (Some(e), None) => match env(&e.value).filter(|v| !v.is_empty()) {
                    None if generate => {
                        let secret = new_secret();
                        let hash = hash_secret(&secret);
                        generated.push(GeneratedSecret {
                            key: k.name.value.clone(),
                            secret,
                        });
                        Some(hash)
                    }
                    Some(v) if v.len() >= 16 => Some(hash_secret(&v)),
                    Some(_) => {
                        cx.err(
                            e,
                            f("secret_env"),
                            format!("the secret in {} is shorter than 16 characters", e.value),
                        );
                        None
                    }
                    None => {
                        cx.err(
                            e,
                            f("secret_env"),
                            format!("environment variable {} is not set", e.value),
                        );
                        None
                    }
                },
                (None, Some(h)) => {
                    let mut d = [0u8; 32];
                    match hex::decode_to_slice(h.value.trim(), &mut d) {
                        Ok(()) => Some(KeySecret(d)),
                        Err(_) => {
                            cx.err(h, f("secret_sha256"), "must be 64 hex digits (sha256 of the secret)");
                            None
                        }
                    }
                }
                (Some(e), Some(_)) => {
                    cx.err(e, f("secret_env"), "give either secret_env or secret_sha256, not both");
                    None
                }
                (None, None) => {
                    cx.err(at, format!("keys[{i}]"), "needs secret_env or secret_sha256");
                    None
                }
            };
            if let Some(s) = &secret
                && !secrets.insert(s.0)
            {
                cx.err(
                    &k.name,
                    f("secret_env"),
                    "two keys share one secret; each key needs its own",
                );
            }
            for (name, v) in [("rpm", &k.rpm), ("max_concurrency", &k.max_concurrency)] {
                if let Some(v) = v
                    && v.value == 0
                {
                    cx.err(v, f(name), "must be at least 1 (leave it out for no limit)");
                }
            }
            if let Some(s) = &k.spend_limit_usd
                && !(s.value.is_finite() && s.value >= 0.0)
            {
                cx.err(s, f("spend_limit_usd"), "must be a non-negative number");
            }
            if let Some(secret) = secret {
                keys.push(Key {
                    name: k.name.value.clone(),
                    owner: k.owner.value.clone(),
                    secret,
                    rpm: k.rpm.as_ref().map(|v| v.value),
                    rpm_counts_token_counting: k.rpm_counts_token_counting.as_ref().is_some_and(|v| v.value),
                    max_concurrency: k.max_concurrency.as_ref().map(|v| v.value),
                    spend_limit_usd: k.spend_limit_usd.as_ref().map(|v| v.value),
                    workflow: k.workflow.as_ref().map(|w| w.value.trim().to_owned()),
                });
            }
        }

        let mut recovery = RecoverySettings::default();
        if let Some(r) = &self.recovery {
            let r = &r.value;
            let d = RecoverySettings::default();
            recovery.stage_ms = cx.bounded(&r.stage_ms, "recovery.stage_ms", 1000..=86_400_000, d.stage_ms);
            recovery.drill_stage_ms = cx.bounded(
                &r.drill_stage_ms,
                "recovery.drill_stage_ms",
                500..=3_600_000,
                d.drill_stage_ms,
            );
            recovery.drill_incident_ms = cx.bounded(
                &r.drill_incident_ms,
                "recovery.drill_incident_ms",
                500..=3_600_000,
                d.drill_incident_ms,
            );
            recovery.relapse_ms = cx.bounded(&r.relapse_ms, "recovery.relapse_ms", 500..=600_000, d.relapse_ms);
        }
        let redis = self.redis.as_ref().and_then(|r| {
            let u = SecretUrl(r.value.trim().to_owned());
            if u.0.starts_with("redis://") && u.0.len() > "redis://".len() {
                Some(u)
            } else {
                cx.err(
                    r,
                    "redis",
                    format!("`{}` is not a Redis URL; expected redis://host:port/db", u.redacted()),
                );
                None
            }
        });
        let mut fleet = FleetSettings::default();
        if let Some(f) = &self.fleet {
            let f = &f.value;
            let d = FleetSettings::default();
            if let Some(i) = &f.instance {
                if valid_name(i.value.trim()) {
                    fleet.instance = Some(i.value.trim().to_owned());
                } else {
                    cx.err(
                        i,
                        "fleet.instance",
                        format!("`{}` is not a name: 1-64 of A-Z a-z 0-9 - _ .", i.value),
                    );
                }
            }
            fleet.heartbeat_ms = cx.bounded(&f.heartbeat_ms, "fleet.heartbeat_ms", 100..=60_000, d.heartbeat_ms);
            fleet.stale_after_ms = cx.bounded(
                &f.stale_after_ms,
                "fleet.stale_after_ms",
                500..=600_000,
                d.stale_after_ms,
            );
            if fleet.stale_after_ms < 3 * fleet.heartbeat_ms
                && let Some(v) = f.stale_after_ms.as_ref().or(f.heartbeat_ms.as_ref())
            {
                cx.err(
                    v,
                    "fleet.stale_after_ms",
                    format!(
                        "{} ms is under three heartbeats ({} ms each): a slow heartbeat would make a live instance look dead",
                        fleet.stale_after_ms, fleet.heartbeat_ms
                    ),
                );
            }
            fleet.expected_instances = f
                .expected_instances
                .as_ref()
                .map(|_| cx.bounded(&f.expected_instances, "fleet.expected_instances", 1..=1000, 1));
        }
        let mut control = ControlSettings::default();
        if let Some(c) = &self.control {
            let c = &c.value;
            control.retry_budget_ratio =
                f64::from(cx.bounded(&c.retry_budget_percent, "control.retry_budget_percent", 0..=100, 20)) / 100.0;
            control.retry_budget_min = cx.bounded(&c.retry_budget_min, "control.retry_budget_min", 0..=10_000, 3);
            control.breaker_cool_down_ms = cx.bounded(
                &c.breaker_cool_down_ms,
                "control.breaker_cool_down_ms",
                100..=3_600_000,
                30_000,
            );
            control.ejection_cool_down_ms = cx.bounded(
                &c.ejection_cool_down_ms,
                "control.ejection_cool_down_ms",
                100..=3_600_000,
                30_000,
            );
            control.wait_slo_ms = c
                .wait_slo_ms
                .as_ref()
                .map(|_| cx.bounded(&c.wait_slo_ms, "control.wait_slo_ms", 1..=u64::MAX, 1));
            if let Some(r) = &c.route_wait_slo_ms {
                for (route, ms) in &r.value {
                    let known = Format::ALL
                        .iter()
                        .any(|f| route.strip_prefix(&format!("{f}/")).is_some_and(|m| !m.is_empty()));
                    if !known {
                        cx.err(
                            r,
                            format!("control.route_wait_slo_ms.{route}"),
                            "a route is `format/model`, the format one of openai, anthropic, gemini",
                        );
                    } else if *ms == 0 {
                        cx.err(
                            r,
                            format!("control.route_wait_slo_ms.{route}"),
                            "must be greater than 0",
                        );
                    }
                }
                control.route_wait_slo_ms = r.value.clone();
            }
        }
        let metrics_token = match &self.metrics_token {
            Some(t) if t.value.trim().len() < 16 => {
                cx.err(t, "metrics_token", "must be at least 16 characters");
                None
            }
            Some(t) => Some(hash_secret(t.value.trim())),
            None => None,
        };

        let alert_webhook_url = match &self.alert_webhook_url {
            Some(u) => {
                let v = u.value.trim();
                let ok = (v.starts_with("https://") || v.starts_with("http://"))
                    && v.len() > "https://".len()
                    && !v.chars().any(|c| c.is_whitespace() || c.is_control());
                if !ok {
                    cx.err(u, "alert_webhook_url", "must be an http:// or https:// URL");
                }
                Some(WebhookUrl(v.to_owned()))
            }
            None => None,
        };

        let mut idempotency = IdempotencySettings::default();
        if let Some(i) = &self.idempotency {
            let i = &i.value;
            idempotency.window_ms =
                cx.bounded(&i.window_hours, "idempotency.window_hours", 1..=24 * 90, 24) * 3_600_000;
            idempotency.max_stored_response_bytes = cx.bounded(
                &i.max_stored_response_bytes,
                "idempotency.max_stored_response_bytes",
                0..=64 * 1024 * 1024,
                1024 * 1024,
            );
        }
        let store_prompts = self.store_prompts.as_ref().is_some_and(|v| v.value);
        let pricing = self.pricing.as_ref().map(|p| {
            if p.value.trim().is_empty() {
                cx.err(
                    p,
                    "pricing",
                    "must be the path of a pricing catalog (see policies/pricing.yaml)",
                );
            }
            base_dir.join(p.value.trim())
        });
        let workflows = self.workflows.as_ref().map(|p| {
            if p.value.trim().is_empty() {
                cx.err(
                    p,
                    "workflows",
                    "must be the path of a directory of workflow policies (see policies/workflows)",
                );
            }
            base_dir.join(p.value.trim())
        });
        let mut budgets = Budgets::default();
        if let Some(b) = &self.budgets {
            if let Some(tz) = &b.value.time_zone {
                let name = tz.value.trim();
                if valid_time_zone_name(name) {
                    budgets.time_zone = name.to_owned();
                } else {
                    cx.err(
                        tz,
                        "budgets.time_zone",
                        format!(
                            "`{}` is not an IANA time zone (e.g. UTC, Europe/Berlin, America/New_York)",
                            tz.value
                        ),
                    );
                }
            }
            if let Some(r) = &b.value.routes {
                for (route, usd) in &r.value {
                    if !usd.is_finite() || *usd <= 0.0 {
                        cx.err(
                            r,
                            format!("budgets.routes.{route}"),
                            "must be a number greater than 0 (USD per day)",
                        );
                    } else if !route.contains('/') {
                        cx.err(
                            r,
                            format!("budgets.routes.{route}"),
                            "a route is FORMAT/MODEL, e.g. openai/gpt-4.1",
                        );
                    }
                }
                budgets.routes = r.value.clone();
            }
        }

        if !cx.errors.is_empty() {
            return Err(ConfigErrors(cx.errors));
        }
        Ok(Config {
            idempotency,
            store_prompts,
            pricing,
            budgets,
            workflows,
            control,
            recovery,
            redis,
            fleet,
            metrics_token,
            alert_webhook_url,
            listen,
            listen_warning,
            allowed_hosts,
            server,
            upstream,
            capacity_queue_max,
            simulator,
            generated,
            ledger,
            max_body_bytes,
            attempt_timeout_ms,
            max_attempts,
            total_deadline_ms,
            capacity_wait_ms,
            channels,
            keys,
            owners,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "SPILLWAY_APP_KEY" => Some("sk-app-0123456789abcdef".into()),
            "OPENAI_API_KEY" => Some("sk-upstream".into()),
            "SHORT" => Some("abc".into()),
            "PASTED_KEY" => Some("sk-pasted-secret\n".into()),
            _ => None,
        }
    }

    const GOOD: &str = "\
listen: 127.0.0.1:0
ledger: sqlite://ledger.db
channels:
  - name: openai-a
    format: openai
    base_url: http://127.0.0.1:9001/
    api_key_env: OPENAI_API_KEY
    models: [gpt-4o-mini]
    max_concurrency: 8
    weight: 1
keys:
  - name: app
    owner: team-a
    secret_env: SPILLWAY_APP_KEY
    rpm: 60
    max_concurrency: 4
owners:
  - name: team-a
    balance_usd: 100
";

    fn parse(text: &str) -> Result<Config> {
        Config::parse(Path::new("/etc/spillway/gw.yaml"), text, &env, &|| {
            "sk-made-at-start-0123456789".into()
        })
    }

    #[test]
    fn a_provider_key_no_header_can_carry_is_refused_without_being_quoted() {
        // spec: P4
        let bad = GOOD.replace("api_key_env: OPENAI_API_KEY", "api_key_env: PASTED_KEY");
        let e = parse(&bad).unwrap_err();
        let lines: Vec<String> = e.0.iter().map(|e| e.to_string()).collect();
        assert!(
            lines
                .iter()
                .any(|l| l.contains("channels[0].api_key_env") && l.contains("PASTED_KEY holds a line break")),
            "{lines:?}"
        );
        assert!(lines.iter().all(|l| !l.contains("sk-pasted")), "{lines:?}");
    }

    #[test]
    fn good_config_parses() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.listen.port(), 0);
        assert_eq!(c.ledger, Some(LedgerLocation::Sqlite("/etc/spillway/ledger.db".into())));
        assert_eq!(c.channels[0].base_url, "http://127.0.0.1:9001");
        assert_eq!(c.channels[0].api_key.as_deref(), Some("sk-upstream"));
        assert_eq!(c.keys[0].secret, hash_secret("sk-app-0123456789abcdef"));
        assert_eq!(c.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        // spec: F3, D1, C2 (the interactive defaults)
        assert_eq!(
            (
                c.attempt_timeout_ms,
                c.max_attempts,
                c.total_deadline_ms,
                c.capacity_wait_ms
            ),
            (8_000, 3, 20_000, 10_000)
        );
        assert!(c.listen_warning.is_none());
        // The upstream key never shows in debug output (P3).
        assert!(!format!("{c:?}").contains("sk-upstream"));
    }

    #[test]
    fn r1_r2_fleet_settings_parse_and_never_show_a_password() {
        // spec: R1, R2
        let good = GOOD.replace(
            "ledger: sqlite://ledger.db",
            "ledger: postgres://gw:s3cret@db:5432/spillway",
        );
        let c = parse(&format!(
            "redis: redis://:r3dis@cache:6379/2\nfleet:\n  instance: gw-1\n  heartbeat_ms: 500\n  stale_after_ms: 3000\n  expected_instances: 3\n{good}"
        ))
        .unwrap();
        let Some(LedgerLocation::Postgres(url)) = &c.ledger else {
            panic!("{:?}", c.ledger)
        };
        assert_eq!(url.redacted(), "postgres://gw:***@db:5432/spillway");
        assert_eq!(
            SecretUrl("postgres://gw:pa/ss@w@db/l?sslmode=disable&password=p2".into()).redacted(),
            "postgres://gw:***@db/l?sslmode=disable&password=***"
        );
        assert_eq!(
            c.redis.as_ref().map(SecretUrl::redacted).as_deref(),
            Some("redis://:***@cache:6379/2")
        );
        assert_eq!(
            c.fleet,
            FleetSettings {
                instance: Some("gw-1".into()),
                heartbeat_ms: 500,
                stale_after_ms: 3000,
                expected_instances: Some(3),
            }
        );
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret") && !shown.contains("r3dis"), "{shown}");
        // Defaults: one instance, named after its host and port at start-up.
        assert_eq!(parse(GOOD).unwrap().fleet, FleetSettings::default());

        let e = parse(&format!(
            "redis: http://:r3dis@cache\nfleet:\n  instance: a b\n  heartbeat_ms: 2000\n  stale_after_ms: 3000\n{}",
            GOOD.replace("ledger: sqlite://ledger.db", "ledger: mysql://u:pw@h/db")
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("gw.yaml:1:8: redis: `http://:***@cache` is not a Redis URL"),
            "{e}"
        );
        assert!(e.contains("gw.yaml:3:13: fleet.instance: `a b` is not a name"), "{e}");
        assert!(
            e.contains("fleet.stale_after_ms: 3000 ms is under three heartbeats"),
            "{e}"
        );
        assert!(e.contains("ledger: `mysql://u:***@h/db` is not a ledger URL"), "{e}");
        assert!(!e.contains("r3dis") && !e.contains(":pw@"), "{e}");
    }

    #[test]
    fn idempotency_settings_parse_and_name_bad_fields() {
        // spec: I2, I6
        let c = parse(GOOD).unwrap();
        assert_eq!(c.idempotency.window_ms, 24 * 3_600_000);
        assert!(!c.store_prompts);
        let c = parse(&format!(
            "idempotency:\n  window_hours: 2\n  max_stored_response_bytes: 1000\nstore_prompts: true\n{GOOD}"
        ))
        .unwrap();
        assert_eq!(
            (
                c.idempotency.window_ms,
                c.idempotency.max_stored_response_bytes,
                c.store_prompts
            ),
            (7_200_000, 1000, true)
        );
        let e = parse(&format!("idempotency:\n  window_hours: 0\n{GOOD}"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gw.yaml:2:17") && e.contains("idempotency.window_hours: must be between 1 and 2160"),
            "{e}"
        );
        let e = parse(&format!("idempotency:\n  window: 3\n{GOOD}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("window"), "{e}");
    }

    #[test]
    fn control_settings_parse_and_name_bad_fields() {
        // spec: F4, G1
        let c = parse(GOOD).unwrap();
        assert_eq!(c.control, ControlSettings::default());
        assert_eq!(c.control.wait_slo_ms("openai/m"), None);
        let c = parse(&format!(
            "control:\n  retry_budget_percent: 10\n  wait_slo_ms: 4000\n  route_wait_slo_ms:\n    openai/fast: 500\nmetrics_token: a-long-enough-token-123\n{GOOD}"
        ))
        .unwrap();
        assert_eq!(c.control.retry_budget_ratio, 0.1);
        assert_eq!(c.control.wait_slo_ms("openai/fast"), Some(500));
        assert_eq!(c.control.wait_slo_ms("openai/other"), Some(4000));
        assert_eq!(c.metrics_token, Some(hash_secret("a-long-enough-token-123")));
        let c = parse(&format!("alert_webhook_url: https://hooks.example/t/SECRET123\n{GOOD}")).unwrap();
        assert_eq!(
            c.alert_webhook_url.as_ref().unwrap().0,
            "https://hooks.example/t/SECRET123"
        );
        assert!(!format!("{c:?}").contains("SECRET123"));
        let e = parse(&format!("alert_webhook_url: hooks.example\n{GOOD}"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("alert_webhook_url: must be an http:// or https:// URL"),
            "{e}"
        );
        assert!(!format!("{c:?}").contains("a-long-enough-token-123"));
        let e = parse(&format!(
            "control:\n  retry_budget_percent: 120\n  route_wait_slo_ms:\n    fast: 500\nmetrics_token: short\n{GOOD}"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("gw.yaml:2:") && e.contains("control.retry_budget_percent"),
            "{e}"
        );
        assert!(e.contains("control.route_wait_slo_ms.fast"), "{e}");
        assert!(e.contains("metrics_token: must be at least 16"), "{e}");
        let e = parse(&format!("control:\n  retry_budjet: 1\n{GOOD}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("retry_budjet"), "{e}");
    }

    #[test]
    fn unknown_field_is_refused_with_line() {
        let e = parse(&GOOD.replace("    weight: 1\n", "    wieght: 1\n")).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("/etc/spillway/gw.yaml:10:"), "{s}");
        assert!(s.contains("wieght"), "{s}");
    }

    #[test]
    fn validation_names_file_line_and_field() {
        let bad = GOOD
            .replace("format: openai", "format: openia")
            .replace("SPILLWAY_APP_KEY", "MISSING_VAR")
            .replace("owner: team-a", "owner: team-b");
        let e = parse(&bad).unwrap_err();
        let lines: Vec<String> = e.0.iter().map(|e| e.to_string()).collect();
        assert!(
            lines.iter().any(|l| l.starts_with("/etc/spillway/gw.yaml:5:")
                && l.contains("channels[0].format")
                && l.contains("openia")),
            "{lines:?}"
        );
        assert!(
            lines.iter().any(|l| l.contains(":14:")
                && l.contains("keys[0].secret_env")
                && l.contains("MISSING_VAR is not set")),
            "{lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.contains(":13:") && l.contains("keys[0].owner") && l.contains("team-b")),
            "{lines:?}"
        );
    }

    #[test]
    fn bad_values() {
        for (from, to, field) in [
            (
                "base_url: http://127.0.0.1:9001/",
                "base_url: ftp://x",
                "channels[0].base_url",
            ),
            (
                "max_concurrency: 8",
                "max_concurrency: 0",
                "channels[0].max_concurrency",
            ),
            ("models: [gpt-4o-mini]", "models: []", "channels[0].models"),
            ("listen: 127.0.0.1:0", "listen: localhost", "listen"),
            ("ledger: sqlite://ledger.db", "ledger: mysql://x", "ledger"),
            (
                "secret_env: SPILLWAY_APP_KEY",
                "secret_env: SHORT",
                "keys[0].secret_env",
            ),
            ("rpm: 60", "rpm: 0", "keys[0].rpm"),
            (
                "api_key_env: OPENAI_API_KEY",
                "api_key_env: NOPE",
                "channels[0].api_key_env",
            ),
        ] {
            let e = parse(&GOOD.replace(from, to)).unwrap_err();
            assert!(e.0.iter().any(|e| e.field == field && e.line > 0), "{to}: {e}");
        }
        for (line, field) in [
            ("max_attempts: 0", "max_attempts"),
            ("max_attempts: 11", "max_attempts"),
            ("total_deadline_ms: 0", "total_deadline_ms"),
            ("capacity_wait_ms: 10001", "capacity_wait_ms"),
        ] {
            let e = parse(&format!("{line}\n{GOOD}")).unwrap_err();
            assert!(e.0.iter().any(|e| e.field == field && e.line == 1), "{line}: {e}");
        }
        let c = parse(&format!("max_attempts: 5\ncapacity_wait_ms: 2000\n{GOOD}")).unwrap();
        assert_eq!(
            (c.max_attempts, c.capacity_wait_ms, c.total_deadline_ms),
            (5, 2000, 20_000)
        );
        let e = parse(&GOOD.replace("max_concurrency: 8", "max_concurrency: lots")).unwrap_err();
        assert!(e.0[0].line == 9 && e.0[0].field == "max_concurrency", "{e}");
    }

    #[test]
    fn p1_non_loopback_listen_warns() {
        // spec: P1
        let c = parse(&GOOD.replace("listen: 127.0.0.1:0", "listen: 0.0.0.0:8787")).unwrap();
        assert!(c.listen_warning.unwrap().contains("not a loopback"));
        let c = parse(&GOOD.replace("listen: 127.0.0.1:0\n", "")).unwrap();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
    }

    #[test]
    fn duplicate_names_and_secret_sha() {
        let dup = GOOD.replace(
            "keys:\n",
            "  - name: openai-a\n    format: openai\n    base_url: http://x\n    models: ['*']\nkeys:\n",
        );
        let e = parse(&dup).unwrap_err();
        assert!(
            e.0.iter()
                .any(|e| e.field == "channels[1].name" && e.message.contains("twice")),
            "{e}"
        );
        let sha = hex::encode(hash_secret("sk-app-0123456789abcdef").0);
        let c = parse(&GOOD.replace("secret_env: SPILLWAY_APP_KEY", &format!("secret_sha256: {sha}"))).unwrap();
        assert_eq!(c.keys[0].secret, hash_secret("sk-app-0123456789abcdef"));
    }

    #[test]
    fn limits_have_defaults_and_bounds() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.server, ServerLimits::default());
        assert_eq!(c.upstream, UpstreamLimits::default());
        assert_eq!(c.capacity_queue_max, DEFAULT_CAPACITY_QUEUE_MAX);
        let c = parse(&format!(
            "server:\n  header_read_timeout_ms: 500\n  max_connections: 8\nupstream:\n  max_wait_hint_ms: 5000\ncapacity_queue_max: 0\n{GOOD}"
        ))
        .unwrap();
        assert_eq!((c.server.header_read_timeout_ms, c.server.max_connections), (500, 8));
        assert_eq!(c.server.write_timeout_ms, ServerLimits::default().write_timeout_ms);
        assert_eq!((c.upstream.max_wait_hint_ms, c.capacity_queue_max), (5000, 0));
        let e = parse(&format!(
            "server:\n  max_connections: 0\n  header_read_timout_ms: 5\n{GOOD}"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("header_read_timout_ms"), "{e}");
        let e = parse(&format!("server:\n  max_connections: 0\n{GOOD}")).unwrap_err();
        assert!(
            e.0.iter().any(|e| e.field == "server.max_connections" && e.line == 2),
            "{e}"
        );
        let e = parse(&format!("upstream:\n  max_wait_hint_ms: 10\n{GOOD}")).unwrap_err();
        assert!(e.0.iter().any(|e| e.field == "upstream.max_wait_hint_ms"), "{e}");
    }

    #[test]
    fn hosts_the_listener_answers() {
        // spec: P1
        let c = parse(&format!(
            "allowed_hosts: [gateway.internal, 'GW.Example.com:8443']\n{GOOD}"
        ))
        .unwrap();
        for ok in [
            "localhost",
            "localhost:8787",
            "127.0.0.1:8787",
            "[::1]:8787",
            "app.localhost",
            "gateway.internal:8787",
            "gw.example.com",
        ] {
            assert!(c.host_allowed(ok), "{ok}");
        }
        for no in [
            "evil.example",
            "gateway.internal.evil.example",
            "10.0.0.5",
            "localhost.evil.example",
            "",
        ] {
            assert!(!c.host_allowed(no), "{no}");
        }
        let e = parse(&format!("allowed_hosts: ['a b']\n{GOOD}")).unwrap_err();
        assert!(e.0.iter().any(|e| e.field == "allowed_hosts"), "{e}");
    }

    #[test]
    fn plain_http_to_another_machine_needs_consent() {
        let remote = GOOD.replace("base_url: http://127.0.0.1:9001/", "base_url: http://10.0.0.7:9001");
        let e = parse(&remote).unwrap_err();
        assert!(
            e.0.iter()
                .any(|e| e.field == "channels[0].base_url" && e.message.contains("allow_plain_http")),
            "{e}"
        );
        let ok = remote.replace("    weight: 1\n", "    weight: 1\n    allow_plain_http: true\n");
        assert!(parse(&ok).is_ok());
        for local in ["http://localhost:9001", "http://[::1]:9001", "https://api.openai.com"] {
            assert!(parse(&GOOD.replace("http://127.0.0.1:9001/", local)).is_ok(), "{local}");
        }
        let e = parse(&GOOD.replace("http://127.0.0.1:9001/", "https://user:pw@api.example.com")).unwrap_err();
        assert!(e.0.iter().any(|e| e.field == "channels[0].base_url"), "{e}");
    }

    #[test]
    fn the_embedded_default_parses_with_and_without_provider_keys() {
        let text = include_str!("../../../policies/demo.yaml");
        let none = |_: &str| None;
        let c = Config::parse(Path::new("demo.yaml"), text, &none, &|| {
            "sk-spillway-demo-generated".into()
        })
        .unwrap();
        assert!(
            c.channels.iter().all(|ch| ch.simulated.is_some()),
            "no key: every channel simulated"
        );
        // Two per provider, and the two background-only batch channels (J2's demo).
        assert_eq!(c.channels.len(), 8);
        assert_eq!(c.generated.len(), 1);
        assert_eq!(c.keys[0].secret, hash_secret("sk-spillway-demo-generated"));
        assert!(!format!("{c:?}").contains("sk-spillway-demo-generated"), "P3");
        let sim = c.simulator.as_ref().unwrap();
        assert!(
            !sim.channels["openai-sim"].random_faults.is_empty(),
            "the primary has a bad day now and then"
        );
        let anthropic = |k: &str| (k == "ANTHROPIC_API_KEY").then(|| "sk-ant-test".to_owned());
        let c = Config::parse(Path::new("demo.yaml"), text, &anthropic, &|| {
            "sk-spillway-demo-generated".into()
        })
        .unwrap();
        let real: Vec<_> = c.channels.iter().filter(|c| c.api_key.is_some()).collect();
        assert_eq!(real.len(), 1);
        assert_eq!(real[0].base_url, "https://api.anthropic.com");
        assert!(real[0].serves("claude-opus-4-1"));
        assert_eq!(c.channels.len(), 6);
        let example = include_str!("../../../policies/example.yaml");
        let env = |k: &str| match k {
            "OPENAI_API_KEY" | "ANTHROPIC_API_KEY" => Some("sk-upstream-example".to_owned()),
            "SPILLWAY_KEY_SUPPORT_BOT" => Some("sk-support-bot-0123456789".to_owned()),
            _ => None,
        };
        let c = Config::parse(Path::new("example.yaml"), example, &env, &|| unreachable!()).unwrap();
        assert!(!c.channels.is_empty() && !c.keys.is_empty());
        // The example states every default it lists.
        assert_eq!(c.control, ControlSettings::default());
    }

    #[test]
    fn sim_channels_must_exist_in_the_simulator_section() {
        let text = "simulator:\n  channels:\n    a: {latency_ms: 5}\nchannels:\n  - {name: x, format: openai, base_url: 'sim://b', models: ['*']}\n";
        let e = parse(text).unwrap_err();
        assert!(
            e.0.iter()
                .any(|e| e.field == "channels[0].base_url" && e.message.contains("sim://b")),
            "{e}"
        );
        let mut c = parse(&text.replace("sim://b", "sim://a")).unwrap();
        c.resolve_simulator(&|n| format!("http://127.0.0.1:9/{n}"));
        assert_eq!(c.channels[0].base_url, "http://127.0.0.1:9/a");
        let e = parse(&text.replace("latency_ms: 5", "latency: 5")).unwrap_err();
        assert!(e.to_string().contains("latency"), "{e}");
    }

    #[test]
    fn empty_or_garbage_file() {
        assert!(parse("").is_err());
        assert!(parse("channels: 5").is_err());
        assert!(parse(": : :\n\t- [").is_err());
    }
}
