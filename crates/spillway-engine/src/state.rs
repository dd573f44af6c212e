//! What every request handler shares: config, channel runtimes, key index, ledger, client,
//! live figures, operator alerts and the shutdown signals.

use crate::{Error, Result};
use serde::Serialize;
use spillway_ledger::Ledger;
use spillway_policy::{Channel, Config, Key};

use spillway_wire::UnixMs;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use ts_rs::TS;

/// How urgent an operator alert is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// A person must act now (a channel's credential refused, the ledger failing).
    Critical,
    /// Worth knowing; it may resolve itself.
    Warning,
    /// Something that was wrong is right again.
    Resolved,
}

/// Something an operator must hear about now (E2, G4): the desktop shell turns these into
/// native notifications, the admin stream forwards them to the console.
#[derive(Clone, Debug, Serialize, TS)]
pub struct OperatorAlert {
    pub at: UnixMs,
    pub severity: Severity,
    pub title: String,
    pub body: String,
    /// The channel or route it is about, when there is one.
    pub subject: Option<String>,
}

/// A channel and its live capacity.
pub struct ChannelRt {
    pub cfg: Channel,
    /// The channel's name, shared with the conversations pinned to it.
    pub name: Arc<str>,
    /// One permit per allowed concurrent upstream call (C1).
    pub permits: Arc<Semaphore>,
    /// Its place in rotation (D6, E2, E3).
    pub health: crate::health::Health,
    /// `cfg.base_url` parsed once ([`crate::upstream::parsed_base`]); `None` for a URL
    /// that call-time parsing handles instead (one the config's validation would have
    /// refused, or whose path keeps a trailing slash).
    pub base: Option<reqwest::Url>,
    /// The header carrying `cfg.api_key`, made once ([`crate::client::key_header`]); its
    /// error if the key cannot be a header value.
    pub key_header: Option<std::result::Result<(http::HeaderName, http::HeaderValue), String>>,
}

impl ChannelRt {
    pub fn new(cfg: Channel) -> ChannelRt {
        Self::with_control(cfg, &Default::default())
    }

    /// A channel whose ejections follow the config's control settings (D5).
    pub fn with_control(cfg: Channel, control: &spillway_policy::ControlSettings) -> ChannelRt {
        let cool = Duration::from_millis(control.ejection_cool_down_ms);
        let outlier = spillway_control::OutlierConfig {
            base_ejection: cool,
            max_ejection: cool.saturating_mul(20),
            ..Default::default()
        };
        ChannelRt {
            base: crate::upstream::parsed_base(&cfg.base_url),
            key_header: cfg.api_key.as_deref().map(|k| crate::client::key_header(cfg.format, k)),
            name: Arc::from(cfg.name.as_str()),
            permits: Arc::new(Semaphore::new(cfg.max_concurrency as usize)),
            cfg,
            health: crate::health::Health::new(outlier),
        }
    }

    pub fn in_flight(&self) -> u32 {
        self.cfg
            .max_concurrency
            .saturating_sub(self.permits.available_permits() as u32)
    }
}

/// A gateway key, its limiters (B1) and its spend (B3).
pub struct KeyRt {
    pub key: Key,
    pub limits: crate::limits::KeyLimits,
    /// Whose balance and daily budget it draws on.
    pub owner: Arc<crate::accounts::OwnerAccount>,
    pub spend: std::sync::Mutex<crate::accounts::KeySpendRt>,
    /// Made from the console or the CLI (revocable), not from the config.
    pub made: bool,
}

/// The two steps of a shutdown (see [`crate::Running::shutdown`]).
#[derive(Default)]
pub struct Shutdown {
    /// First step: stop accepting, end console event streams, answer new requests 503, let
    /// in-flight work finish.
    pub draining: CancellationToken,
    /// Second step (the drain deadline passed, or a second signal): cut what is left and
    /// record it.
    pub cancel: CancellationToken,
    /// Requests open right now (from ingress until their record is closed).
    open: AtomicUsize,
    closed: Notify,
}

impl Shutdown {
    pub fn opened(&self) {
        self.open.fetch_add(1, Ordering::AcqRel);
    }

    pub fn closed(&self) {
        // Only a shutdown waits for the count to reach zero: no wake-up otherwise.
        if self.open.fetch_sub(1, Ordering::AcqRel) == 1 && self.draining.is_cancelled() {
            self.closed.notify_waiters();
        }
    }

    pub fn open_requests(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Waits until no request is open.
    pub async fn all_closed(&self) {
        loop {
            let n = self.closed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.open_requests() == 0 {
                return;
            }
            n.await;
        }
    }
}

pub struct AppState {
    pub config: Config,
    pub channels: Vec<Arc<ChannelRt>>,
    /// Gateway keys, owners' balances, spend and the pricing catalog (B3–B5, M1).
    pub accounts: crate::accounts::Accounts,
    pub ledger: Ledger,
    /// Every call to a channel (attempts, stored-response follow-ups).
    pub upstream: crate::client::UpstreamClient,
    /// Calls off the request path: alert webhooks, the simulator's control API. The same
    /// rules (no redirects, no desktop proxy, bounded connects).
    pub client: reqwest::Client,
    pub metrics: crate::metrics::Metrics,
    pub admin_token: Option<crate::admin::AdminToken>,
    pub console: crate::console::Console,
    /// Operator alerts, fanned out to every subscriber (desktop notifications, consoles).
    pub alerts: tokio::sync::broadcast::Sender<OperatorAlert>,
    pub shutdown: Shutdown,
    /// Requests waiting for channel capacity right now, gateway-wide (C2's queue).
    pub capacity_queue: AtomicU32,
    /// Breakers, retry budgets, amplification, conversation pins (D4, D5, F4, F5, G).
    pub control: crate::control::Control,
    /// `/metrics`' recorder (N4).
    pub prom: crate::prom::Prom,
    /// Trace export, when configured.
    pub otel: Option<Arc<crate::otel::Otel>>,
    /// I2: `Idempotency-Key`s whose requests are running here.
    pub idempotency: crate::idempotency::Claims,
    /// The ledger's own figures (unknowns, duplicates, size), refreshed in the background:
    /// the console reads them every second, the queries behind them are not that cheap.
    pub ledger_figures: std::sync::RwLock<Option<spillway_ledger::LedgerFigures>>,
    /// J8: the workflow policies in force.
    pub workflows: crate::workflows::Workflows,
    /// J1-J7: background jobs not yet ended.
    pub jobs: crate::jobs::Jobs,
    /// O1-O5: guided recovery runs.
    pub recoveries: crate::recovery::Recoveries,
    /// R1, R2: this instance in its fleet (alone on a SQLite ledger).
    pub fleet: crate::fleet::Fleet,
    /// R2: the fleet's Redis, when configured: key limits and breakers are shared.
    pub shared: Option<Arc<crate::shared::Shared>>,
}

impl AppState {
    /// Raises an alert: to every subscriber (consoles, the desktop), to the configured
    /// webhook (G4), and to the log.
    pub fn alert(&self, severity: Severity, title: String, body: String, subject: Option<String>) {
        // A drill's alerts say so, and stay off the webhook: practice must not page anyone.
        let drill = subject.as_deref().is_some_and(|s| self.recoveries.drilling(s));
        let title = if drill { format!("[DRILL] {title}") } else { title };
        tracing::warn!(?severity, subject = subject.as_deref().unwrap_or(""), "{title}: {body}");
        let alert = OperatorAlert {
            at: crate::clock::now(),
            severity,
            title,
            body,
            subject,
        };
        if let (false, Some(url), Ok(rt)) = (
            drill,
            &self.config.alert_webhook_url,
            tokio::runtime::Handle::try_current(),
        ) {
            // Through the upstream client (no redirects, no desktop proxy), bounded, and
            // never waited for: an alert must not hold the request that raised it. The URL
            // may carry a token: it is never logged.
            let req = self
                .client
                .post(&url.0)
                .timeout(Duration::from_secs(5))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(serde_json::to_vec(&alert).unwrap_or_default());
            rt.spawn(async move {
                match req.send().await {
                    Ok(r) if r.status().is_success() => {}
                    Ok(r) => tracing::warn!(status = r.status().as_u16(), "the alert webhook refused an alert"),
                    Err(e) => tracing::warn!(error = %e.without_url(), "the alert webhook could not be reached"),
                }
            });
        }
        let _ = self.alerts.send(alert);
    }

    /// The client for calls off the request path (see [`AppState::client`]), on the
    /// upstream client's TLS: no redirects (a redirect would carry a webhook's token to
    /// whatever host it names), no desktop proxy, bounded connects.
    pub fn side_client(config: &Config, tls: rustls::ClientConfig) -> Result<reqwest::Client> {
        let up = &config.upstream;
        reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_millis(up.connect_timeout_ms))
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(8)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .build()
            .map_err(|e| Error::Client(e.to_string()))
    }

    /// The client to channels ([`crate::client`]) on `tls`.
    pub fn upstream_client(config: &Config, tls: rustls::ClientConfig) -> crate::client::UpstreamClient {
        let up = &config.upstream;
        crate::client::UpstreamClient::new(
            Duration::from_millis(up.connect_timeout_ms),
            Duration::from_millis(up.tcp_keepalive_ms),
            tls,
        )
    }

    pub fn new(config: Config, ledger: Ledger) -> Result<AppState> {
        Self::with_pricing(config, ledger, None)
    }

    /// The same, with the pricing catalog given (a config's `pricing:` file, read by the
    /// caller).
    pub fn with_pricing(config: Config, ledger: Ledger, pricing: Option<spillway_policy::Pricing>) -> Result<AppState> {
        let tls = crate::client::tls_config(Vec::new()).map_err(Error::Client)?;
        let upstream = Self::upstream_client(&config, tls.clone());
        let client = Self::side_client(&config, tls)?;
        let channels = config
            .channels
            .iter()
            .map(|c| Arc::new(ChannelRt::with_control(c.clone(), &config.control)))
            .collect();
        let accounts = crate::accounts::Accounts::new(&config, pricing).map_err(Error::TimeZone)?;
        let workflows = crate::workflows::Workflows::load(config.workflows.as_deref()).map_err(Error::Workflows)?;
        for k in &config.keys {
            if let Some(w) = &k.workflow
                && workflows.get(w).is_none()
            {
                return Err(Error::Workflows(format!(
                    "key `{}`: `workflow: {w}` names no workflow policy in force",
                    k.name
                )));
            }
        }
        Ok(AppState {
            config,
            channels,
            accounts,
            ledger,
            upstream,
            client,
            metrics: Default::default(),
            admin_token: None,
            console: crate::console::Console::None,
            alerts: tokio::sync::broadcast::channel(256).0,
            shutdown: Shutdown::default(),
            capacity_queue: AtomicU32::new(0),
            control: Default::default(),
            prom: Default::default(),
            otel: None,
            idempotency: Default::default(),
            ledger_figures: Default::default(),
            workflows,
            jobs: Default::default(),
            recoveries: Default::default(),
            fleet: crate::fleet::Fleet::new("local".into(), String::new(), false),
            shared: None,
        })
    }
}
