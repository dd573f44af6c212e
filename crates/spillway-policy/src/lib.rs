//! Gateway configuration: the YAML contract of `spillway serve --config FILE`, parsed with
//! unknown fields refused, then validated into a [`Config`] the engine can trust. Every
//! error names the file, line and field. Pure: the caller reads the file and supplies the
//! environment lookup, so tests need neither.

mod config;
mod error;
pub mod pricing;
pub mod sim;
pub mod workflow;

pub use config::{
    Budgets, Channel, Config, ControlSettings, DEFAULT_ATTEMPT_TIMEOUT_MS, DEFAULT_CAPACITY_QUEUE_MAX, DEFAULT_LISTEN,
    DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_BODY_BYTES, DEFAULT_TOTAL_DEADLINE_MS, FleetSettings, GeneratedSecret,
    IdempotencySettings, Key, KeySecret, LedgerLocation, MAX_CAPACITY_WAIT_MS, Owner, RecoverySettings, SecretUrl,
    ServerLimits, UpstreamLimits, WebhookUrl, hash_secret, host_name, is_loopback_host, valid_time_zone_name,
};
pub use error::{ConfigError, ConfigErrors, Result};
pub use pricing::{Cost, ModelPrice, Pricing};
pub use workflow::{Priority, Workflow};
