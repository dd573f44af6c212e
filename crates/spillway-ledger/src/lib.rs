//! The request ledger (I1, I3): every logical request and every upstream attempt, in a
//! store behind [`LedgerBackend`]: SQLite for one gateway, PostgreSQL for a fleet (R1).
//!
//! Writes go through one writer task that group-commits whatever is queued (one
//! transaction, multi-row upserts), so the ledger keeps up with thousands of requests per
//! second on two cores. A write that must be durable before the gateway proceeds (a
//! request entering `calling_api`) waits for the commit that carries it. One process
//! writes a SQLite ledger: a lock file beside it keeps a second instance out. Several
//! instances share a PostgreSQL ledger, each stamping the request rows it writes.

mod accounts;
mod control;
mod fleet;
mod idem;
mod jobs;
mod lock;
mod postgres;
mod record;
mod recovery;
mod sqlite;
#[cfg(test)]
mod testdb;
mod writer;

pub use accounts::{Accounts, BalanceEntry, CostCell, KeySpend, SpendRow, StoredKey};
pub use control::{AuditEntry, ControlState};
pub use fleet::{InstanceRow, TakeOver};
pub use idem::{KeyedRequest, LedgerFigures, Payload, PruneReport, Reconcile, RouteCount, SideEffect, StoredResponse};
pub use jobs::{JobRecord, PolicyVersion};
pub use lock::LedgerLock;
pub use postgres::PgBackend;
pub use record::{
    AttemptRecord, Decision, FailureClass, GatewayClass, MAX_MESSAGE, Page, Reconciliation, RequestRecord,
    RequestState, Resolution, Search, StopReason, truncate,
};
pub use recovery::{DayFigures, ErrorCount, RecoveryRow, ScoreRow, rank};
pub use sqlite::{Durability, SqliteBackend};
pub use writer::{COMMIT_BUCKETS_S, CommitHistogram, Ledger, LedgerHealth};

use async_trait::async_trait;
use spillway_wire::UnixMs;

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
    #[error(
        "the instance name `{name}` is in use by a live gateway ({listen}, heartbeat {age_ms} ms ago); give this one its own name (fleet.instance or --instance)"
    )]
    InstanceInUse { name: String, listen: String, age_ms: i64 },
    #[error("cannot lock the ledger {path}: {source}")]
    Lock { path: String, source: std::io::Error },
    #[error("ledger row is corrupt: {0}")]
    Corrupt(String),
    #[error("no request with that id")]
    NotFound,
    /// A state change the request's current state does not allow (the message says which).
    #[error("{0}")]
    Conflict(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// A store the ledger can live in. Batches arrive from the single writer task.
#[async_trait]
pub trait LedgerBackend: Send + Sync + 'static {
    /// Upserts `requests` (each the latest full state of its row), inserts `attempts` and
    /// `payloads`, atomically.
    async fn write_batch(
        &self,
        requests: &[RequestRecord],
        attempts: &[AttemptRecord],
        payloads: &[Payload],
    ) -> Result<()>;
    /// [`LedgerBackend::write_batch`] for rows no caller waits on, committed without
    /// waiting for the disk: the commit survives a crash of the process at once, and a
    /// power loss from the next synced commit or [`LedgerBackend::sync`] on, which make
    /// every commit before them durable too. `Ok(false)` (the default) when the store
    /// cannot commit so now; the caller then keeps the rows for a synced commit.
    async fn write_batch_unsynced(
        &self,
        _requests: &[RequestRecord],
        _attempts: &[AttemptRecord],
        _payloads: &[Payload],
    ) -> Result<bool> {
        Ok(false)
    }
    /// Makes every commit so far durable (see [`LedgerBackend::write_batch_unsynced`]).
    async fn sync(&self) -> Result<()> {
        Ok(())
    }
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
    /// The request of gateway key `key_name` whose provider stored the response
    /// `response_id` (OpenAI Responses), newest first.
    async fn by_response_id(&self, key_name: &str, response_id: &str) -> Result<Option<RequestRecord>>;
    /// I2: the newest request that ran under `idempotency_key` for the gateway key
    /// `key_name`, received at or after `since` (older keys have expired), with its stored
    /// response when one is kept and not expired at `now`.
    async fn keyed(
        &self,
        key_name: &str,
        idempotency_key: &str,
        since: UnixMs,
        now: UnixMs,
    ) -> Result<Option<KeyedRequest>>;
    /// I4: an owner's verdict on an `unknown` request, with its audit entry, in one
    /// durable transaction. `Conflict` when the request is not unknown.
    async fn reconcile(&self, id: &str, r: &Reconcile, at: UnixMs) -> Result<RequestRecord>;
    /// I3: the side-effect step. Marking what is already marked is accepted; anything the
    /// request's state does not allow is a `Conflict` naming it.
    async fn side_effect(&self, id: &str, step: &SideEffect, at: UnixMs) -> Result<RequestRecord>;
    /// Unknown requests awaiting an owner, newest first.
    async fn unknowns(&self, limit: u32) -> Result<Vec<RequestRecord>>;
    /// Unknowns and duplicates per route (duplicates among keys received since `since`),
    /// and the ledger's size.
    async fn figures(&self, since: UnixMs) -> Result<LedgerFigures>;
    /// Removes payloads expired at `now` and, when `finished_before` is given, finished
    /// requests received before it: never unknown or unfinished ones, nor those whose
    /// `Idempotency-Key` is still in its window (received at or after `keys_since`).
    /// `vacuum` gives the space back to the file system (slow; for a ledger no gateway is
    /// using).
    async fn prune(
        &self,
        now: UnixMs,
        finished_before: Option<UnixMs>,
        keys_since: UnixMs,
        vacuum: bool,
    ) -> Result<PruneReport>;
    /// B3–B5: every owner's credits, the all-time spend by owner and key, the made keys
    /// and the operators' spend limits.
    async fn accounts(&self) -> Result<Accounts>;
    /// B4: starts each listed owner's balance at its seed, unless the ledger has seeded or
    /// topped the owner up before. Returns the owners seeded now.
    async fn seed_owners(&self, seeds: &[(String, f64)], at: UnixMs) -> Result<Vec<String>>;
    /// A credit (a top-up) with its audit entry, in one durable transaction.
    async fn credit(&self, entry: &BalanceEntry, audit: &AuditEntry) -> Result<()>;
    /// B5: a made key (with its spend limit, when it has one) and its audit entry, in one
    /// durable transaction. `Conflict` when the name is taken.
    async fn create_key(&self, key: &StoredKey, spend_limit: Option<f64>, audit: &AuditEntry) -> Result<()>;
    /// B5: revokes a made key. `NotFound` when there is no such made key.
    async fn revoke_key(&self, name: &str, at: UnixMs, by: &str, audit: &AuditEntry) -> Result<()>;
    /// B3: an operator's spend limit on a key (None lifts it), with its audit entry.
    async fn set_spend_limit(
        &self,
        key_name: &str,
        limit: Option<f64>,
        at: UnixMs,
        by: &str,
        audit: &AuditEntry,
    ) -> Result<()>;
    /// Known costs of requests received since `since`, by owner, key and route.
    async fn spend_since(&self, since: UnixMs) -> Result<Vec<SpendRow>>;
    /// M3, N1: requests received since `since`, costs summed per `bucket_ms`, owner, key,
    /// route and model.
    async fn cost_report(&self, since: UnixMs, bucket_ms: i64) -> Result<Vec<CostCell>>;
    /// J2-J7: saves each job's whole row (a job without its body or result keeps the
    /// stored ones) and appends `audit`, in one durable transaction.
    async fn save_jobs(&self, jobs: &[JobRecord], audit: &[AuditEntry]) -> Result<()>;
    /// A job with its body and result.
    async fn job(&self, id: &str) -> Result<Option<JobRecord>>;
    /// The newest job submitted by gateway key `key_name` under `idempotency_key`.
    async fn job_by_key(&self, key_name: &str, idempotency_key: &str) -> Result<Option<JobRecord>>;
    /// Jobs queued, running, awaiting an owner or in the dead letter (no bodies).
    async fn open_jobs(&self) -> Result<Vec<JobRecord>>;
    /// The newest jobs, in any state (no bodies).
    async fn recent_jobs(&self, limit: u32) -> Result<Vec<JobRecord>>;
    /// The requests that ran for a job, oldest first (its evidence).
    async fn job_requests(&self, job_id: &str) -> Result<Vec<RequestRecord>>;
    /// J8: records a policy version the gateway runs; false when it was known.
    async fn save_policy_version(&self, v: &PolicyVersion) -> Result<bool>;
    /// Every recorded version (of `workflow` when given), newest first per workflow.
    async fn policy_versions(&self, workflow: Option<&str>) -> Result<Vec<PolicyVersion>>;
    /// O1-O5: saves a recovery run's whole row and appends `audit`, in one durable
    /// transaction.
    async fn save_recovery(&self, _run: &RecoveryRow, _audit: &[AuditEntry]) -> Result<()> {
        Err(Error::Unavailable("this store keeps no recovery runs".into()))
    }
    /// O1: keeps a run's evidence bundle, durably.
    async fn save_evidence(&self, _run_id: &str, _bytes: &[u8]) -> Result<()> {
        Err(Error::Unavailable("this store keeps no evidence bundles".into()))
    }
    /// A run's evidence bundle, as kept.
    async fn evidence(&self, _run_id: &str) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }
    /// O4: `route`'s requests whose outcome is unknown, not yet reconciled.
    async fn route_unknowns(&self, _route: &str) -> Result<u64> {
        Ok(0)
    }
    /// O5: the id of `route`'s first provider failure in `[from, to)`; with
    /// `after_last_success`, the first after its last answered request there (where an
    /// incident began).
    async fn first_failure(
        &self,
        _route: &str,
        _from: UnixMs,
        _to: UnixMs,
        _after_last_success: bool,
    ) -> Result<Option<String>> {
        Ok(None)
    }
    /// O1: the P95 latency of `route`'s answered, non-streamed requests in `[from, to)`:
    /// its normal, for a one-token probe to be judged against.
    async fn normal_latency(&self, _route: &str, _from: UnixMs, _to: UnixMs) -> Result<Option<f64>> {
        Ok(None)
    }
    /// The newest runs (open ones first), at most `limit`.
    async fn recoveries(&self, _limit: u32) -> Result<Vec<RecoveryRow>> {
        Ok(Vec::new())
    }
    /// N1: per-route figures of the requests received in `[from, to)` (of `route` only
    /// when given), each route's row then `overall`.
    async fn scorecard(&self, _from: UnixMs, _to: UnixMs, _route: Option<&str>) -> Result<Vec<ScoreRow>> {
        Ok(Vec::new())
    }
    /// N3: per route and UTC day, the figures of requests received in `[from, to)`.
    async fn daily(&self, _from: UnixMs, _to: UnixMs) -> Result<Vec<DayFigures>> {
        Ok(Vec::new())
    }
    /// O1: each workflow's policy version on `route`'s last answered request received
    /// in `[from, to)`: the last known good before an incident.
    async fn last_good_versions(&self, _route: &str, _from: UnixMs, _to: UnixMs) -> Result<Vec<(String, String)>> {
        Ok(Vec::new())
    }
    /// O1: the requests of `route` received in `[from, to)`, oldest first, at most
    /// `limit`, each with its attempts: the evidence bundle's rows.
    async fn route_requests(
        &self,
        _route: &str,
        _from: UnixMs,
        _to: UnixMs,
        _limit: u32,
    ) -> Result<Vec<(RequestRecord, Vec<AttemptRecord>)>> {
        Ok(Vec::new())
    }
    /// O4, N3: jobs of `route` (every route when None) whose deadline fell in `[from, to)`
    /// and that missed it: dead-lettered, or answered after it (no bodies).
    async fn overruns(&self, _route: Option<&str>, _from: UnixMs, _to: UnixMs) -> Result<Vec<JobRecord>> {
        Ok(Vec::new())
    }
    /// R1: upserts the instance's row (its heartbeat and load) and extends every job lease
    /// it holds to `lease_until`.
    async fn heartbeat(&self, _row: &InstanceRow, _lease_until: UnixMs) -> Result<()> {
        Err(Error::Unavailable("this store keeps no instances".into()))
    }
    /// R1: every instance the ledger has seen, live ones first, then by name.
    async fn instances(&self) -> Result<Vec<InstanceRow>> {
        Ok(Vec::new())
    }
    /// R1, I4: takes over each instance other than `by` whose heartbeat is older than
    /// `stale_before` and that has not stopped: in one transaction per instance, its
    /// requests left in `calling_api` become `unknown`, its job leases are released and it
    /// is marked stopped, taken over by `by`. Survivors racing for one instance: exactly
    /// one takes it.
    async fn take_over(&self, _by: &str, _stale_before: UnixMs, _at: UnixMs) -> Result<Vec<TakeOver>> {
        Ok(Vec::new())
    }
    /// R1: marks the instance stopped (a clean shutdown), releasing its job leases.
    async fn instance_stopped(&self, _id: &str, _at: UnixMs) -> Result<()> {
        Ok(())
    }
    /// R1: leases job `id` to `instance` until `until` when it is `queued`, due
    /// (`ready_at <= now`) and not leased to another instance (or that lease expired);
    /// returns the job's whole row (body included) when this instance now holds it.
    /// A save that takes the job out of `running` releases the lease.
    async fn lease_job(&self, _id: &str, _instance: &str, _now: UnixMs, _until: UnixMs) -> Result<Option<JobRecord>> {
        Err(Error::Unavailable("this store leases no jobs".into()))
    }
    /// R1: jobs changed at or after `since` (no bodies), oldest change first: what other
    /// instances did to the queue.
    async fn jobs_changed_since(&self, _since: UnixMs) -> Result<Vec<JobRecord>> {
        Ok(Vec::new())
    }
    /// I2 across a fleet: claims `idempotency_key` of gateway key `key_name` for
    /// `request_id`, run by the store's own instance. None when claimed now; Some(holder
    /// request id) when another request holds it and is still in flight (its row is not
    /// finished and its instance is alive). A claim whose request finished, or whose
    /// instance stopped, is taken over.
    async fn claim_key(
        &self,
        _key_name: &str,
        _idempotency_key: &str,
        _request_id: &str,
        _at: UnixMs,
    ) -> Result<Option<String>> {
        Ok(None)
    }
    /// Drops the claim `request_id` holds (its final record is committed).
    async fn release_key(&self, _key_name: &str, _idempotency_key: &str, _request_id: &str) -> Result<()> {
        Ok(())
    }
    /// Housekeeping the writer must not pay for on its commits (WAL checkpoints).
    /// Returns how many pages (WAL frames) it folded back into the database.
    async fn maintain(&self) -> Result<u64>;
}
