//! The request ledger (I1, I3): every logical request and every upstream attempt, in a
//! store behind [`LedgerBackend`] (SQLite now; PostgreSQL can implement the same trait).
//!
//! Writes go through one writer task that group-commits whatever is queued (one
//! transaction, multi-row upserts), so the ledger keeps up with thousands of requests per
//! second on two cores. A write that must be durable before the gateway proceeds (a
//! request entering `calling_api`) waits for the commit that carries it. One process
//! writes a ledger: a lock file beside it keeps a second instance out.

mod control;
mod lock;
mod record;
mod sqlite;
mod writer;

pub use control::{AuditEntry, ControlState};
pub use lock::LedgerLock;
pub use record::{
    AttemptRecord, Decision, FailureClass, GatewayClass, MAX_MESSAGE, Page, RequestRecord, RequestState, Search,
    StopReason, truncate,
};
pub use sqlite::{Durability, SqliteBackend};
pub use writer::{Ledger, LedgerHealth};

use async_trait::async_trait;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("ledger database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("ledger migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("cannot create the ledger directory {path}: {source}")]
    Directory { path: String, source: std::io::Error },
    #[error("cannot open the ledger's write-ahead log beside {path}: {source}")]
    Wal { path: String, source: std::io::Error },
    #[error("the ledger writer has stopped")]
    WriterStopped,
    #[error("ledger unavailable: {0}")]
    Unavailable(String),
    #[error(
        "the ledger {path} is in use by another Spillway instance ({holder}); stop it first, or give this one its own ledger (--ledger)"
    )]
    Locked { path: String, holder: String },
    #[error("cannot lock the ledger {path}: {source}")]
    Lock { path: String, source: std::io::Error },
    #[error("ledger row is corrupt: {0}")]
    Corrupt(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// A store the ledger can live in. Batches arrive from the single writer task.
#[async_trait]
pub trait LedgerBackend: Send + Sync + 'static {
    /// Upserts `requests` (each the latest full state of its row) and inserts `attempts`,
    /// atomically.
    async fn write_batch(&self, requests: &[RequestRecord], attempts: &[AttemptRecord]) -> Result<()>;
    async fn get_request(&self, id: &str) -> Result<Option<RequestRecord>>;
    async fn attempts(&self, request_id: &str) -> Result<Vec<AttemptRecord>>;
    /// Newest-first page of requests matching `search`.
    async fn search(&self, search: &Search) -> Result<Page>;
    /// I4: on start-up, requests left in `calling_api` by a crash become `unknown`.
    /// Returns how many.
    async fn mark_interrupted_unknown(&self) -> Result<u64>;
    /// Saves `state` (when given) and appends `audit`, in one durable transaction.
    async fn record_transition(&self, state: Option<&ControlState>, audit: &AuditEntry) -> Result<()>;
    /// Every saved control state.
    async fn control_states(&self) -> Result<Vec<ControlState>>;
    /// The newest audit entries (for `subject` of `kind` when given), newest first.
    async fn audit(&self, kind: Option<&str>, subject: Option<&str>, limit: u32) -> Result<Vec<AuditEntry>>;
    /// Housekeeping the writer must not pay for on its commits (WAL checkpoints).
    /// Returns how many pages (WAL frames) it folded back into the database.
    async fn maintain(&self) -> Result<u64>;
}
