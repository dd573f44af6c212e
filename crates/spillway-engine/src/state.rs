//! What every request handler shares: config, channel runtimes, key index, ledger, client.

use crate::{Error, Result};
use spillway_ledger::Ledger;
use spillway_policy::{Channel, Config, Key};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// A channel and its live capacity.
pub struct ChannelRt {
    pub cfg: Channel,
    /// One permit per allowed concurrent upstream call (C1).
    pub permits: Arc<Semaphore>,
}

pub struct AppState {
    pub config: Config,
    pub channels: Vec<Arc<ChannelRt>>,
    /// Gateway keys by the SHA-256 of their secret (B5): the secret itself is never held.
    pub keys: HashMap<[u8; 32], Arc<Key>>,
    pub ledger: Ledger,
    pub client: reqwest::Client,
    pub metrics: crate::metrics::Metrics,
    pub admin_token: Option<crate::admin::AdminToken>,
    pub ui_dir: Option<std::path::PathBuf>,
}

impl AppState {
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
                })
            })
            .collect();
        let keys = config.keys.iter().map(|k| (k.secret.0, Arc::new(k.clone()))).collect();
        Ok(AppState {
            config,
            channels,
            keys,
            ledger,
            client,
            metrics: Default::default(),
            admin_token: None,
            ui_dir: None,
        })
    }
}
