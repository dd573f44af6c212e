//! What every request handler shares: config, channel runtimes, key index, ledger, client.

use crate::{Error, Result};
use spillway_ledger::Ledger;
use spillway_policy::{Channel, Config, Key};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Something an operator must hear about now (E2, G4): the desktop shell turns these into
/// native notifications, the admin stream forwards them to the console.
#[derive(Clone, Debug, serde::Serialize, ts_rs::TS)]
pub struct OperatorAlert {
    /// Unix milliseconds.
    pub at_ms: i64,
    /// `critical` needs a person now; `warning` may resolve itself.
    pub severity: String,
    pub title: String,
    pub body: String,
    /// The channel or route it is about, when there is one.
    pub subject: Option<String>,
}

/// A channel and its live capacity.
pub struct ChannelRt {
    pub cfg: Channel,
    /// One permit per allowed concurrent upstream call (C1).
    pub permits: Arc<Semaphore>,
    /// Its place in rotation (D6, E2, E3).
    pub health: crate::health::Health,
}

impl ChannelRt {
    pub fn in_flight(&self) -> u32 {
        self.cfg
            .max_concurrency
            .saturating_sub(self.permits.available_permits() as u32)
    }
}

/// A gateway key and its limiters (B1).
pub struct KeyRt {
    pub key: Key,
    pub limits: crate::limits::KeyLimits,
}

pub struct AppState {
    pub config: Config,
    pub channels: Vec<Arc<ChannelRt>>,
    /// Gateway keys by the SHA-256 of their secret (B5): the secret itself is never held.
    pub keys: HashMap<[u8; 32], Arc<KeyRt>>,
    pub ledger: Ledger,
    pub client: reqwest::Client,
    pub metrics: crate::metrics::Metrics,
    pub admin_token: Option<crate::admin::AdminToken>,
    pub ui_dir: Option<std::path::PathBuf>,
    /// Operator alerts, fanned out to every subscriber (desktop notifications, consoles).
    pub alerts: tokio::sync::broadcast::Sender<OperatorAlert>,
}

impl AppState {
    /// Raises an alert; with nobody listening it is only logged.
    pub fn alert(&self, severity: &str, title: String, body: String, subject: Option<String>) {
        tracing::warn!(severity, subject = subject.as_deref().unwrap_or(""), "{title}: {body}");
        let at_ms = crate::ingress::now_ms();
        let _ = self.alerts.send(OperatorAlert {
            at_ms,
            severity: severity.to_owned(),
            title,
            body,
            subject,
        });
    }

    pub fn new(config: Config, ledger: Ledger) -> Result<AppState> {
        let client = reqwest::Client::builder()
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(512)
            // A gateway on a workstation must not send prompts through whatever proxy the
            // desktop session happens to configure.
            .no_proxy()
            .build()
            .map_err(|e| Error::Client(e.to_string()))?;
        let channels = config
            .channels
            .iter()
            .map(|c| {
                Arc::new(ChannelRt {
                    cfg: c.clone(),
                    permits: Arc::new(Semaphore::new(c.max_concurrency as usize)),
                    health: Default::default(),
                })
            })
            .collect();
        let keys = config
            .keys
            .iter()
            .map(|k| {
                let rt = KeyRt {
                    key: k.clone(),
                    limits: crate::limits::KeyLimits::new(k),
                };
                (k.secret.0, Arc::new(rt))
            })
            .collect();
        Ok(AppState {
            config,
            channels,
            keys,
            ledger,
            client,
            metrics: Default::default(),
            admin_token: None,
            ui_dir: None,
            alerts: tokio::sync::broadcast::channel(64).0,
        })
    }
}
