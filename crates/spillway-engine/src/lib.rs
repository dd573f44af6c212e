//! The gateway. A request flows one way through these modules: [`server`] (connections and
//! their limits) → [`ingress`] (Host, wire format, auth, cheap refusals, body checks) →
//! [`routing`] (channels that speak the format and serve the model, capacity) →
//! [`failover`] (the attempt loop and its F2 decisions) → [`upstream`] (the call, its
//! classification) → [`stream`] (a stream's pass-through). One [`life::Life`] owns each
//! request from its key to its last record and is the only place that closes it. [`error`]
//! is the one place where a gateway error becomes a status and a body in the caller's
//! format.
//!
//! The library knows nothing of the simulator or the demo: the `spillway` binary and the
//! desktop shell wire those in.

pub mod accounts;
pub mod admin;
pub mod client;
pub mod clock;
pub mod console;
pub mod contract;
pub mod control;
pub mod error;
pub mod failover;
pub mod fleet;
pub mod followup;
pub mod health;
pub mod idempotency;
pub mod inbox;
pub mod ingress;
pub mod jobs;
pub mod life;
pub mod limits;
pub mod metrics;
pub mod models;
pub mod money;
pub mod otel;
pub mod prom;
pub mod recovery;
pub mod retry;
pub mod routing;
pub mod scorecard;
pub mod server;
pub mod shared;
pub mod state;
pub mod stream;
pub mod trace;
pub mod upstream;
pub mod workflows;

#[cfg(test)]
mod tests;

pub use console::Console;
pub use error::GatewayError;
pub use state::AppState;

use spillway_ledger::Ledger;
use spillway_policy::Config;
use state::Severity;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Ledger(#[from] spillway_ledger::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("cannot build the upstream HTTP client: {0}")]
    Client(String),
    #[error("no data directory: set SPILLWAY_DATA_DIR or HOME")]
    NoDataDir,
    #[error("cannot read or create the admin token in {dir}: {source}")]
    AdminToken { dir: String, source: std::io::Error },
    /// The budgets' time zone is not in the system's tz database.
    #[error("{0}")]
    TimeZone(String),
    /// M1: the config's `pricing:` file is missing or invalid.
    #[error("pricing catalog: {0}")]
    Pricing(String),
    #[error("workflow policies: {0}")]
    Workflows(String),
    /// R1, R2: this instance cannot take its place in the fleet.
    #[error("fleet: {0}")]
    Fleet(String),
}

/// Reads and validates the pricing catalog at `path` (M1).
pub fn read_pricing(path: &std::path::Path) -> Result<spillway_policy::Pricing> {
    let text =
        std::fs::read_to_string(path).map_err(|e| Error::Pricing(format!("cannot read {}: {e}", path.display())))?;
    spillway_policy::Pricing::parse(&path.display().to_string(), &text).map_err(|e| Error::Pricing(e.to_string()))
}

pub type Result<T> = std::result::Result<T, Error>;

/// The directory for the default ledger, the admin token and other local state:
/// `$SPILLWAY_DATA_DIR`, else the platform's user data directory + `spillway`.
pub fn data_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("SPILLWAY_DATA_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    dirs::data_dir().map(|d| d.join("spillway")).ok_or(Error::NoDataDir)
}

/// The admin token in the data directory, created on first use.
pub fn admin_token() -> Result<admin::AdminToken> {
    let dir = data_dir()?;
    admin::AdminToken::load_or_create(&dir).map_err(|source| Error::AdminToken {
        dir: dir.display().to_string(),
        source,
    })
}

/// A gateway that is accepting connections.
pub struct Running {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    server_done: watch::Receiver<bool>,
    /// One finish at a time (a second signal may come while the first is finishing).
    finishing: tokio::sync::Mutex<()>,
}

impl Running {
    /// The first signal: stop accepting, end console event streams, answer new requests
    /// 503, and let in-flight requests (streams included) finish — for at most the
    /// config's drain deadline. Whatever is left then is cut and recorded (an upstream
    /// call cut mid-flight as `unknown`), and the ledger is flushed.
    pub async fn shutdown(&self) -> Result<()> {
        let st = &self.state;
        st.shutdown.draining.cancel();
        let drain = Duration::from_millis(st.config.server.drain_timeout_ms);
        let mut done = self.server_done.clone();
        let drained = tokio::time::timeout(drain, async {
            let _ = done.wait_for(|d| *d).await;
            st.shutdown.all_closed().await;
        })
        .await
        .is_ok();
        if !drained {
            tracing::warn!(
                open = st.shutdown.open_requests(),
                "the drain deadline passed; cutting the requests still open"
            );
        }
        self.finish().await
    }

    /// The second signal: cut everything now, record it, flush the ledger.
    pub async fn abort(&self) -> Result<()> {
        self.state.shutdown.draining.cancel();
        self.finish().await
    }

    async fn finish(&self) -> Result<()> {
        let _one = self.finishing.lock().await;
        let st = &self.state;
        st.shutdown.cancel.cancel();
        // Cut requests record themselves as their tasks and connections let go of them.
        if tokio::time::timeout(Duration::from_secs(3), st.shutdown.all_closed())
            .await
            .is_err()
        {
            tracing::error!(open = st.shutdown.open_requests(), "requests still open after the cut");
        }
        let mut done = self.server_done.clone();
        let _ = tokio::time::timeout(Duration::from_secs(1), done.wait_for(|d| *d)).await;
        // Transitions queued by the last requests reach the ledger before it closes.
        let _ = tokio::time::timeout(Duration::from_secs(3), st.control.flush(&st.ledger)).await;
        if let Some(o) = st.otel.clone() {
            // The SDK's shutdown blocks while it exports what is left.
            let _ = tokio::task::spawn_blocking(move || o.shutdown()).await;
        }
        // Closing twice is harmless: a second finish returns once the first has flushed.
        let closed = st.ledger.close(Duration::from_secs(5)).await;
        fleet::leave(st).await;
        Ok(closed?)
    }
}

/// How the gateway is started, beyond its config.
#[derive(Clone, Default)]
pub struct Options {
    pub ledger_path: PathBuf,
    /// A ledger opened by the caller (tests use one over a store they control); when
    /// absent, `ledger_path` is opened.
    pub ledger: Option<Ledger>,
    /// Overrides the config's `listen`.
    pub listen: Option<SocketAddr>,
    /// Without a token the admin API refuses everything.
    pub admin_token: Option<admin::AdminToken>,
    /// The console served at `/`.
    pub console: Console,
    /// Where traces go (OpenTelemetry), when anywhere.
    pub otel: Option<Arc<otel::Otel>>,
}

/// Opens the ledger and starts serving `config` with the real upstream.
pub async fn start(config: Config, opts: Options) -> Result<Running> {
    start_with(config, opts, Arc::new(upstream::HttpCaller)).await
}

/// [`start`] with `caller` making the upstream calls.
pub async fn start_with<C: failover::Caller>(config: Config, opts: Options, caller: Arc<C>) -> Result<Running> {
    let addr = opts.listen.unwrap_or(config.listen);
    // Bind first: a port in use must not leave a ledger opened (and locked) for nothing.
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Listen { addr, source })?;
    let addr = listener.local_addr().map_err(|source| Error::Listen { addr, source })?;
    let instance = config
        .fleet
        .instance
        .clone()
        .unwrap_or_else(|| fleet::default_name(addr));
    let shared_ledger = matches!(config.ledger, Some(spillway_policy::LedgerLocation::Postgres(_)));
    let ledger = match (opts.ledger, &config.ledger) {
        (Some(l), _) => l,
        (None, Some(spillway_policy::LedgerLocation::Postgres(url))) => {
            Ledger::open_postgres(&url.0, &instance, config.fleet.stale_after_ms as i64).await?
        }
        (None, _) => Ledger::open_sqlite(&opts.ledger_path).await?,
    };
    let shared = match &config.redis {
        Some(url) => {
            Some(shared::Shared::new(url, &instance, config.fleet.expected_instances).map_err(|e| Error::Fleet(e.0))?)
        }
        None => None,
    };
    // The built-in catalog is read when a request first needs it.
    let pricing = config.pricing.as_deref().map(read_pricing).transpose()?;
    let mut state = AppState::with_pricing(config, ledger, pricing)?;
    state.admin_token = opts.admin_token;
    state.console = opts.console;
    state.otel = opts.otel;
    state.fleet = fleet::Fleet::new(instance, addr.to_string(), shared_ledger);
    state.shared = shared;
    // R1: a name a live instance uses is refused before this one touches anything.
    fleet::join(&state).await.map_err(Error::Fleet)?;
    let state = Arc::new(state);
    // G4, D5: open breakers and ejections outlive a restart.
    let restored = state.control.restore(&state).await?;
    if restored > 0 {
        tracing::info!(restored, "breaker and channel states restored from the ledger");
    }
    // B3-B5: balances, spend and made keys, read back before the first request.
    let seeded = state.accounts.load(&state.config, &state.ledger, clock::now()).await?;
    if !seeded.is_empty() {
        tracing::info!(owners = ?seeded, "owners' balances seeded from the config (first time the ledger meets them)");
    }
    pricing_upkeep(&state);
    watch_ledger(&state);
    ledger_upkeep(&state);
    control::tick(&state);
    workflows::upkeep(&state);
    fleet::upkeep(&state);
    let app = ingress::router_with(state.clone(), caller);
    // O1: open recovery runs hold their routes again before the first request, and
    // before the job runner could release a held route's jobs.
    let held = recovery::start(&state, app.clone()).await?;
    if held > 0 {
        tracing::info!(held, "open recovery runs restored from the ledger");
    }
    jobs::start(&state, app.clone());
    let (done_tx, server_done) = watch::channel(false);
    let st = state.clone();
    tokio::spawn(async move {
        server::serve(listener, app, st).await;
        let _ = done_tx.send(true);
    });
    Ok(Running {
        addr,
        state,
        server_done,
        finishing: tokio::sync::Mutex::new(()),
    })
}

/// How often a config's pricing file is looked at for changes.
const PRICING_POLL: std::time::Duration = std::time::Duration::from_secs(2);

/// M1: logs stale prices (within a poll of the catalog's first use, then daily), and
/// reloads a config's `pricing:` file when it changes: a bad edit keeps the catalog in
/// force and says why.
fn pricing_upkeep(st: &Arc<AppState>) {
    let weak = Arc::downgrade(st);
    let path = st.config.pricing.clone();
    tokio::spawn(async move {
        // The file's text, not its timestamp: an edit within the file system's timestamp
        // granularity is still seen. A change is applied once it has held for one poll,
        // so a file caught halfway through being written is not taken.
        let read = |p: &std::path::Path| std::fs::read(p).ok();
        let mut applied = path.as_deref().and_then(read);
        let mut pending: Option<Vec<u8>> = None;
        let mut last_stale_day = i64::MIN;
        loop {
            let Some(st) = weak.upgrade() else { return };
            if st.shutdown.draining.is_cancelled() {
                return;
            }
            if let Some(p) = &path {
                let now_text = read(p);
                if now_text == applied {
                    pending = None;
                } else if now_text != pending {
                    pending = now_text;
                } else {
                    applied = pending.take();
                    match read_pricing(p) {
                        Ok(new) => {
                            let body = format!(
                                "version {} from {}, {} models",
                                new.version,
                                new.origin,
                                new.models.len()
                            );
                            st.accounts.set_pricing(new);
                            st.alert(state::Severity::Resolved, "Pricing catalog reloaded".into(), body, None);
                            last_stale_day = i64::MIN;
                        }
                        Err(e) => st.alert(
                            state::Severity::Warning,
                            "Pricing catalog not reloaded: the edit is invalid; the previous version stays in force"
                                .into(),
                            e.to_string(),
                            None,
                        ),
                    }
                }
            }
            let today = clock::now().0.div_euclid(86_400_000);
            if today != last_stale_day
                && let Some(p) = st.accounts.pricing_if_loaded()
            {
                last_stale_day = today;
                accounts::log_stale(&p, clock::now());
            }
            drop(st);
            tokio::time::sleep(PRICING_POLL).await;
        }
    });
}

/// How often the ledger's figures (unknowns, duplicates, size) are recomputed.
const FIGURES_EVERY: std::time::Duration = std::time::Duration::from_secs(10);
/// How often expired payload copies are pruned (I6), in figure rounds: hourly.
const PRUNE_EVERY_ROUNDS: u64 = 360;

/// The ledger's own upkeep: its figures for the console, an alert when unknown outcomes
/// wait for an owner (I4) or a key ran twice (N1), and the hourly prune of expired
/// response copies (I6).
fn ledger_upkeep(st: &Arc<AppState>) {
    let weak = Arc::downgrade(st);
    tokio::spawn(async move {
        let (mut unknown, mut duplicates) = (0u64, 0u64);
        for round in 0u64.. {
            let Some(st) = weak.upgrade() else { return };
            if st.shutdown.draining.is_cancelled() {
                return;
            }
            let now = clock::now();
            let since = spillway_wire::UnixMs(now.0.saturating_sub(st.config.idempotency.window_ms as i64));
            // At start-up too: a gateway restarted more often than hourly still prunes.
            if round % PRUNE_EVERY_ROUNDS == 0 {
                match st.ledger.prune(now, None, since, false).await {
                    Ok(r) if r.payloads > 0 => tracing::info!(pruned = r.payloads, "expired response copies pruned"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "pruning expired response copies failed"),
                }
            }
            match st.ledger.figures(since).await {
                Ok(f) => {
                    if f.unknown > unknown {
                        st.alert(
                            Severity::Warning,
                            format!("{} request(s) with an unknown outcome", f.unknown),
                            "The gateway stopped while they were calling a provider, so whether they ran is not known. They are never sent again automatically: reconcile them in the console's Unknown outcomes inbox.".into(),
                            None,
                        );
                    }
                    if f.duplicates > duplicates {
                        st.alert(
                            Severity::Critical,
                            format!("{} idempotency key(s) completed more than once", f.duplicates),
                            "A request under the same Idempotency-Key reached the provider twice. Search the ledger for the key; this should never happen.".into(),
                            None,
                        );
                    }
                    (unknown, duplicates) = (f.unknown, f.duplicates);
                    *st.ledger_figures.write().unwrap_or_else(|p| p.into_inner()) = Some(f);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "ledger figures unavailable");
                    *st.ledger_figures.write().unwrap_or_else(|p| p.into_inner()) = None;
                }
            }
            drop(st);
            tokio::time::sleep(FIGURES_EVERY).await;
        }
    });
}

/// Operators hear at once when the ledger stops taking writes, and when it takes them again.
fn watch_ledger(st: &Arc<AppState>) {
    let mut rx = st.ledger.watch_health();
    let weak = Arc::downgrade(st);
    tokio::spawn(async move {
        let mut was_ok = true;
        while rx.changed().await.is_ok() {
            let h = rx.borrow_and_update().clone();
            let Some(st) = weak.upgrade() else { return };
            if was_ok && !h.ok {
                st.alert(
                    Severity::Critical,
                    "The ledger is refusing writes".into(),
                    format!(
                        "{}. New requests are answered 503 until it takes writes again; finished records wait in memory meanwhile.",
                        h.error.as_deref().unwrap_or("commits fail")
                    ),
                    None,
                );
            } else if !was_ok && h.ok {
                st.alert(
                    Severity::Resolved,
                    "The ledger takes writes again".into(),
                    "The records that waited were written; new requests are admitted again.".into(),
                    None,
                );
            }
            was_ok = h.ok;
        }
    });
}
