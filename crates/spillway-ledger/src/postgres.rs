//! PostgreSQL, for a fleet (R1): several gateway instances share one ledger. This store
//! owns a connection pool and nothing else: every change of more than one statement is
//! one transaction, so an instance sees another's change whole or not at all; each
//! instance stamps the request rows it writes, so its in-flight rows are found when it
//! restarts or when a survivor takes it over; job leases (`FOR UPDATE SKIP LOCKED`) keep
//! two instances from running one job, and idempotency claims keep two from running one
//! key at once.
//!
//! Results match the SQLite store's for the same rows: the same column lists, rank guard
//! and row decoders (shared with `sqlite.rs`), every text column in the byte order SQLite
//! compares in (`COLLATE "C"` in the schema), and ties in orderings broken the way SQLite's
//! rowid breaks them (`seq` columns).

use crate::jobs::JOB_COLUMNS;
use crate::sqlite::{
    ATTEMPT_COLUMNS, ATTEMPT_WIDTH, INSTANCE_COLUMNS, JOB_LIST_COLUMNS, JOB_UPSERT, PAYLOAD_COLUMNS, PAYLOAD_WIDTH,
    REQUEST_COLUMNS, REQUEST_READ_COLUMNS, REQUEST_UPSERT, REQUEST_WIDTH, attempt_from_row, columns, hex_to_uuid, i,
    instance_from_row, job_from_row, ms, rank_sql, request_from_row, taken_over_message, uuid_floor,
};
use crate::{
    Accounts, AttemptRecord, AuditEntry, BalanceEntry, ControlState, CostCell, DayFigures, Decision, Error, ErrorCount,
    FailureClass, InstanceRow, JobRecord, KeySpend, KeyedRequest, LedgerBackend, LedgerFigures, Page, Payload,
    PolicyVersion, PruneReport, Reconcile, Reconciliation, RecoveryRow, RequestRecord, RequestState, Result,
    RouteCount, ScoreRow, Search, SideEffect, SpendRow, StopReason, StoredKey, StoredResponse, TakeOver,
};
use async_trait::async_trait;
use spillway_wire::{UnixMs, Visibility};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::query_builder::Separated;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, QueryBuilder, Row};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::LazyLock;
use std::time::Duration;

/// PostgreSQL takes at most 65535 bound parameters per statement.
const MAX_BINDS: usize = 65_535;

/// Multi-row statements of at most this many rows keep their prepared statement; larger
/// ones (rare, under heavy load) are one-off and would only fill the statement cache.
const CACHED_ROWS: usize = 16;

/// Rows per page of a prune: each page is one short transaction.
const PRUNE_ROWS: i64 = 1000;

/// The most rows of `width` columns one statement can bind.
fn rows_per_statement(width: usize) -> usize {
    (MAX_BINDS / width).max(1)
}

/// A count read back as u64 (counts are BIGINT).
fn count(r: &PgRow, index: usize) -> Result<u64> {
    Ok(r.try_get::<i64, _>(index)?.max(0) as u64)
}

/// `INSERT ... ON CONFLICT` of an attempt: SQLite's `INSERT OR REPLACE`, every column.
static ATTEMPT_UPSERT: LazyLock<String> = LazyLock::new(|| {
    let sets: Vec<String> = columns(ATTEMPT_COLUMNS)
        .filter(|c| *c != "request_id" && *c != "attempt_no")
        .map(|c| format!("{c} = excluded.{c}"))
        .collect();
    format!(
        " ON CONFLICT (request_id, attempt_no) DO UPDATE SET {}",
        sets.join(", ")
    )
});

/// `INSERT ... ON CONFLICT` of a payload: SQLite's `INSERT OR REPLACE`, every column.
static PAYLOAD_UPSERT: LazyLock<String> = LazyLock::new(|| {
    let sets: Vec<String> = columns(PAYLOAD_COLUMNS)
        .filter(|c| *c != "request_id")
        .map(|c| format!("{c} = excluded.{c}"))
        .collect();
    format!(" ON CONFLICT (request_id) DO UPDATE SET {}", sets.join(", "))
});

/// A job save: the row with every column bound, and SQLite's conflict clause.
static JOB_INSERT: LazyLock<String> = LazyLock::new(|| {
    let marks: Vec<String> = (1..=columns(JOB_COLUMNS).count()).map(|k| format!("${k}")).collect();
    format!(
        "INSERT INTO jobs ({JOB_COLUMNS}) VALUES ({}){}",
        marks.join(", "),
        *JOB_UPSERT
    )
});

/// The request rows a batch writes, one per id, in key order. A batch may carry several
/// states of one request; SQLite upserts them one after the other, each guarded like
/// [`REQUEST_UPSERT`] (a finished row never changes, a state never moves back), while one
/// PostgreSQL statement may not touch a row twice. Running the same guard along the batch
/// picks the row SQLite ends with: the first that reaches rank 3, or else the last of the
/// highest rank. Key order makes two instances' batches lock the rows they share in one
/// order, so they never deadlock each other.
fn requests_to_write(requests: &[RequestRecord]) -> Vec<&RequestRecord> {
    let mut by_id: BTreeMap<&str, &RequestRecord> = BTreeMap::new();
    for r in requests {
        by_id
            .entry(r.id.as_str())
            .and_modify(|cur| {
                let rank = cur.state.rank();
                if rank < 3 && r.state.rank() >= rank {
                    *cur = r;
                }
            })
            .or_insert(r);
    }
    by_id.into_values().collect()
}

/// One attempt per (request, number), the last of the batch (SQLite replaces in order).
fn attempts_to_write(attempts: &[AttemptRecord]) -> Vec<&AttemptRecord> {
    let mut by_key: BTreeMap<(&str, u32), &AttemptRecord> = BTreeMap::new();
    for a in attempts {
        by_key.insert((a.request_id.as_str(), a.attempt_no), a);
    }
    by_key.into_values().collect()
}

/// One payload per request, the last of the batch.
fn payloads_to_write(payloads: &[Payload]) -> Vec<&Payload> {
    let mut by_id: BTreeMap<&str, &Payload> = BTreeMap::new();
    for p in payloads {
        by_id.insert(p.request_id.as_str(), p);
    }
    by_id.into_values().collect()
}

/// PostgreSQL text cannot hold NUL, which SQLite stores. A string from a client or a
/// provider carrying one (a model name, an error message) would fail its whole batch, and
/// the writer would retry that batch for ever: the character is dropped.
fn text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', ""))
    } else {
        Cow::Borrowed(s)
    }
}

fn opt_text(s: &Option<String>) -> Option<Cow<'_, str>> {
    s.as_deref().map(text)
}

fn bind_request(b: &mut Separated<'_, Postgres, &'static str>, r: &RequestRecord) {
    b.push_bind(text(&r.id))
        .push_bind(text(&r.trace_id))
        .push_bind(opt_text(&r.client_request_id))
        .push_bind(opt_text(&r.upstream_request_id))
        .push_bind(opt_text(&r.key_name))
        .push_bind(opt_text(&r.owner))
        .push_bind(opt_text(&r.workflow))
        .push_bind(r.format.as_str())
        .push_bind(text(&r.endpoint))
        .push_bind(opt_text(&r.route))
        .push_bind(opt_text(&r.channel))
        .push_bind(opt_text(&r.requested_model))
        .push_bind(opt_text(&r.served_model))
        .push_bind(r.stream)
        .push_bind(r.state.as_str())
        .push_bind(r.http_status.map(i64::from))
        .push_bind(r.error_class.map(FailureClass::as_str))
        .push_bind(opt_text(&r.error_message))
        .push_bind(i(r.input_tokens))
        .push_bind(i(r.output_tokens))
        .push_bind(i(r.cached_input_tokens))
        .push_bind(i(r.reasoning_tokens))
        .push_bind(r.cost_usd)
        .push_bind(r.received_at.0)
        .push_bind(r.admitted_at.map(|t| t.0))
        .push_bind(r.first_token_at.map(|t| t.0))
        .push_bind(r.finished_at.map(|t| t.0))
        .push_bind(i(r.queued_ms))
        .push_bind(i64::from(r.attempts))
        .push_bind(opt_text(&r.body_sha256))
        .push_bind(r.partial_output_committed)
        .push_bind(r.next_ready_at.map(|t| t.0))
        .push_bind(opt_text(&r.idempotency_key))
        .push_bind(opt_text(&r.replay_of))
        .push_bind(opt_text(&r.response_id))
        .push_bind(i(r.cache_write_tokens))
        .push_bind(i(r.estimated_input_tokens))
        .push_bind(r.estimated_cost_usd)
        .push_bind(r.failed_cost_usd)
        .push_bind(opt_text(&r.pricing_version))
        .push_bind(opt_text(&r.policy_version))
        .push_bind(opt_text(&r.job_id));
}

fn bind_attempt(b: &mut Separated<'_, Postgres, &'static str>, a: &AttemptRecord) {
    b.push_bind(text(&a.request_id))
        .push_bind(i64::from(a.attempt_no))
        .push_bind(text(&a.channel))
        .push_bind(opt_text(&a.upstream_request_id))
        .push_bind(a.http_status.map(i64::from))
        .push_bind(a.error_class.as_str())
        .push_bind(opt_text(&a.provider_error_type))
        .push_bind(i(a.retry_after_ms))
        .push_bind(opt_text(&a.message))
        .push_bind(a.started_at.0)
        .push_bind(a.first_byte_at.map(|t| t.0))
        .push_bind(a.finished_at.map(|t| t.0))
        .push_bind(i(a.input_tokens))
        .push_bind(i(a.output_tokens))
        .push_bind(a.decision.map(Decision::as_str))
        .push_bind(a.decision_reason.map(StopReason::as_str))
        .push_bind(i(a.delay_ms))
        .push_bind(a.ready_at.map(|t| t.0))
        .push_bind(a.visibility.map(Visibility::as_str))
        .push_bind(a.cost_usd);
}

fn bind_payload(b: &mut Separated<'_, Postgres, &'static str>, p: &Payload) {
    let r = p.response.as_ref();
    b.push_bind(text(&p.request_id))
        .push_bind(p.expires_at.0)
        .push_bind(p.request_body.as_deref())
        .push_bind(r.map(|r| i64::from(r.status)))
        .push_bind(r.map(|r| text(&r.content_type)))
        .push_bind(r.map(|r| r.body.as_slice()));
}

/// B3: an operator's spend limit on a key (None lifts it), inside a transaction.
async fn upsert_spend_limit(
    conn: &mut PgConnection,
    key_name: &str,
    limit: Option<f64>,
    at: UnixMs,
    by: &str,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO key_spend (key_name, limit_set, spend_limit_usd, set_at, set_by) VALUES ($1, TRUE, $2, $3, $4) \
         ON CONFLICT (key_name) DO UPDATE SET limit_set = TRUE, spend_limit_usd = excluded.spend_limit_usd, \
         set_at = excluded.set_at, set_by = excluded.set_by",
    )
    .bind(key_name)
    .bind(limit)
    .bind(at.0)
    .bind(by)
    .execute(conn)
    .await?;
    Ok(())
}

/// Appends an audit entry inside a transaction.
async fn insert_audit(conn: &mut PgConnection, audit: &AuditEntry) -> Result<()> {
    sqlx::query(
        "INSERT INTO audit (at, kind, subject, actor, action, trigger, reason, figures) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(audit.at.0)
    .bind(&audit.kind)
    .bind(&audit.subject)
    .bind(&audit.actor)
    .bind(&audit.action)
    .bind(&audit.trigger)
    .bind(&audit.reason)
    .bind(&audit.figures)
    .execute(conn)
    .await?;
    Ok(())
}

/// A job's row, inserted or replaced (see `JOB_UPSERT`).
async fn upsert_job(conn: &mut PgConnection, j: &JobRecord) -> Result<()> {
    let request_ids = serde_json::to_string(&j.request_ids).map_err(|e| Error::Corrupt(e.to_string()))?;
    sqlx::query(AssertSqlSafe(JOB_INSERT.as_str()))
        .bind(&j.id)
        .bind(&j.key_name)
        .bind(&j.owner)
        .bind(&j.idempotency_key)
        .bind(&j.workflow)
        .bind(&j.policy_version)
        .bind(&j.format)
        .bind(&j.api)
        .bind(&j.path)
        .bind(&j.endpoint)
        .bind(&j.headers)
        .bind(j.body.as_deref())
        .bind(&j.body_sha256)
        .bind(&j.route)
        .bind(&j.requested_model)
        .bind(&j.served_model)
        .bind(&j.route_override)
        .bind(&j.priority)
        .bind(&j.lane)
        .bind(&j.state)
        .bind(i64::from(j.attempt))
        .bind(i64::from(j.max_attempts))
        .bind(j.created_at.0)
        .bind(j.ready_at.0)
        .bind(j.expires_at.0)
        .bind(j.updated_at.0)
        .bind(i(j.retry_after_ms))
        .bind(j.partial_output_committed)
        .bind(&j.last_error_type)
        .bind(&j.last_error)
        .bind(j.last_status.map(i64::from))
        .bind(j.estimated_cost_usd)
        .bind(i(j.estimated_input_tokens))
        .bind(i(j.estimated_output_tokens))
        .bind(j.cost_usd)
        .bind(i(j.usage_units))
        .bind(&j.fallback_policy)
        .bind(request_ids)
        .bind(&j.reason)
        .bind(j.result_status.map(i64::from))
        .bind(&j.result_content_type)
        .bind(j.result.as_deref())
        .bind(&j.review)
        .bind(&j.replay_of)
        .bind(&j.replayed_by)
        .bind(&j.replay)
        .bind(&j.batch_id)
        .execute(conn)
        .await?;
    Ok(())
}

/// Serialises the transactions that decide from the balance entries whether to add one
/// (a seed, an opening credit): two instances doing it at once would both add it. Plain
/// reads go on; other writers of the table wait for the commit.
async fn lock_balances(conn: &mut PgConnection) -> Result<()> {
    sqlx::query("LOCK TABLE balance_entries IN SHARE ROW EXCLUSIVE MODE")
        .execute(conn)
        .await?;
    Ok(())
}

pub struct PgBackend {
    pool: PgPool,
    /// One connection of its own for heartbeats and take-overs: a request path that holds
    /// every pooled connection must not make a live instance look dead.
    beat: PgPool,
    /// This gateway instance's name, stamped on every request row it inserts.
    instance: String,
}

impl PgBackend {
    /// Connects to `url` (postgres://...), applies `sqlx::migrate!("./migrations/postgres")`, and
    /// returns a store whose request rows are stamped with `instance`.
    pub async fn open(url: &str, instance: &str) -> Result<PgBackend> {
        // The URL may hold a password, so no message here repeats it: sqlx's errors say
        // what failed (a malformed part, a refused connection, a failed login), never the URL.
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| Error::Unavailable(format!("the PostgreSQL ledger URL is not valid: {e}")))?;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.clone())
            .await
            .map_err(|e| Error::Unavailable(format!("cannot reach the PostgreSQL ledger: {e}")))?;
        let beat = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await
            .map_err(|e| Error::Unavailable(format!("cannot reach the PostgreSQL ledger: {e}")))?;
        // sqlx holds an advisory lock while it migrates: instances starting together apply
        // each migration once, the others wait and find it applied.
        sqlx::migrate!("./migrations/postgres").run(&pool).await?;
        Ok(PgBackend {
            pool,
            beat,
            instance: instance.to_owned(),
        })
    }

    /// The database's size on disk, in bytes.
    async fn database_bytes(&self) -> Result<u64> {
        let n: i64 = sqlx::query_scalar("SELECT pg_database_size(current_database())")
            .fetch_one(&self.pool)
            .await?;
        Ok(n.max(0) as u64)
    }
}

#[async_trait]
impl LedgerBackend for PgBackend {
    async fn write_batch(
        &self,
        requests: &[RequestRecord],
        attempts: &[AttemptRecord],
        payloads: &[Payload],
    ) -> Result<()> {
        if requests.is_empty() && attempts.is_empty() && payloads.is_empty() {
            return Ok(());
        }
        let (requests, attempts, payloads) = (
            requests_to_write(requests),
            attempts_to_write(attempts),
            payloads_to_write(payloads),
        );
        // One transaction, up to three multi-row statements (more only for a batch past
        // the bind limit): all rows or none.
        let mut tx = self.pool.begin().await?;
        // The instance column is written on insert only: a row keeps the instance that
        // first wrote it (the one whose crash would leave it in flight).
        for chunk in requests.chunks(rows_per_statement(REQUEST_WIDTH + 1)) {
            let mut q: QueryBuilder<Postgres> =
                QueryBuilder::new(format!("INSERT INTO requests ({REQUEST_COLUMNS}, instance) "));
            q.push_values(chunk, |mut b, r| {
                bind_request(&mut b, r);
                b.push_bind(&self.instance);
            });
            q.push(&*REQUEST_UPSERT);
            q.build()
                .persistent(chunk.len() <= CACHED_ROWS)
                .execute(&mut *tx)
                .await?;
        }
        for chunk in attempts.chunks(rows_per_statement(ATTEMPT_WIDTH)) {
            let mut q: QueryBuilder<Postgres> = QueryBuilder::new(format!("INSERT INTO attempts ({ATTEMPT_COLUMNS}) "));
            q.push_values(chunk, |mut b, a| bind_attempt(&mut b, a));
            q.push(&*ATTEMPT_UPSERT);
            q.build()
                .persistent(chunk.len() <= CACHED_ROWS)
                .execute(&mut *tx)
                .await?;
        }
        for chunk in payloads.chunks(rows_per_statement(PAYLOAD_WIDTH)) {
            let mut q: QueryBuilder<Postgres> = QueryBuilder::new(format!("INSERT INTO payloads ({PAYLOAD_COLUMNS}) "));
            q.push_values(chunk, |mut b, p| bind_payload(&mut b, p));
            q.push(&*PAYLOAD_UPSERT);
            q.build()
                .persistent(chunk.len() <= CACHED_ROWS)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn get_request(&self, id: &str) -> Result<Option<RequestRecord>> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(request_from_row).transpose()
    }

    async fn attempts(&self, request_id: &str) -> Result<Vec<AttemptRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE request_id = $1 ORDER BY attempt_no"
        )))
        .bind(request_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(attempt_from_row).collect()
    }

    async fn search(&self, s: &Search) -> Result<Page> {
        let limit = s.limit.unwrap_or(50).clamp(1, 500);
        let mut q: QueryBuilder<Postgres> =
            QueryBuilder::new(format!("SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE TRUE"));
        if let Some(before) = &s.before {
            q.push(" AND id < ").push_bind(before);
        }
        // The key is a UUIDv7, which starts with its millisecond timestamp: a time range is
        // a key range (in byte order: the column is COLLATE "C").
        if let Some(from) = s.from_ms {
            q.push(" AND id >= ").push_bind(uuid_floor(from));
        }
        if let Some(to) = s.to_ms {
            q.push(" AND id < ").push_bind(uuid_floor(to));
        }
        if let Some(route) = &s.route {
            q.push(" AND route = ").push_bind(route);
        }
        if let Some(state) = s.state {
            q.push(" AND state = ").push_bind(state.as_str());
        }
        if let Some(api) = s.api {
            let endpoints: Vec<&'static str> = api.endpoints().collect();
            if endpoints.is_empty() {
                // SQLite reads `IN ()` as false; PostgreSQL refuses it.
                q.push(" AND FALSE");
            } else {
                let mut list = q.separated(", ");
                list.push_unseparated(" AND endpoint IN (");
                for e in endpoints {
                    list.push_bind(e);
                }
                list.push_unseparated(")");
            }
        }
        if let Some(needle) = s.q.as_deref().map(str::trim).filter(|n| !n.is_empty()) {
            // One indexed lookup per kind of id; a trace id the gateway made is its request id.
            q.push(" AND id IN (SELECT id FROM requests WHERE id = ")
                .push_bind(needle);
            if let Some(as_id) = hex_to_uuid(needle) {
                q.push(" UNION SELECT id FROM requests WHERE id = ").push_bind(as_id);
            }
            q.push(" UNION SELECT id FROM requests WHERE client_request_id = ")
                .push_bind(needle);
            q.push(" UNION SELECT id FROM requests WHERE trace_id = ")
                .push_bind(needle)
                .push(" AND trace_id <> replace(id, '-', ''))");
        }
        q.push(" ORDER BY id DESC LIMIT ").push_bind(i64::from(limit) + 1);
        let rows = q.build().fetch_all(&self.pool).await?;
        let mut items = rows.iter().map(request_from_row).collect::<Result<Vec<_>>>()?;
        let next = if items.len() > limit as usize {
            items.truncate(limit as usize);
            items.last().map(|r| r.id.clone())
        } else {
            None
        };
        Ok(Page { items, next })
    }

    async fn mark_interrupted_unknown(&self) -> Result<u64> {
        // Only this instance's rows: another instance's `calling_api` rows are its live
        // calls (a survivor takes a dead instance's over, see `take_over`).
        let r = sqlx::query(
            "UPDATE requests SET state = 'unknown', error_class = 'interrupted', \
             error_message = 'the gateway stopped while this request was calling the provider' \
             WHERE state = 'calling_api' AND instance = $1",
        )
        .bind(&self.instance)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected())
    }

    async fn record_transition(&self, state: Option<&ControlState>, audit: &AuditEntry) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        if let Some(c) = state {
            sqlx::query(
                "INSERT INTO control_state (kind, subject, state, updated_at) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (kind, subject) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at",
            )
            .bind(&c.kind)
            .bind(&c.subject)
            .bind(&c.state)
            .bind(c.updated_at.0)
            .execute(&mut *tx)
            .await?;
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn control_states(&self) -> Result<Vec<ControlState>> {
        let rows = sqlx::query("SELECT kind, subject, state, updated_at FROM control_state ORDER BY kind, subject")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(ControlState {
                    kind: r.try_get("kind")?,
                    subject: r.try_get("subject")?,
                    state: r.try_get("state")?,
                    updated_at: UnixMs(r.try_get("updated_at")?),
                })
            })
            .collect()
    }

    async fn audit(&self, kind: Option<&str>, subject: Option<&str>, limit: u32) -> Result<Vec<AuditEntry>> {
        let rows = sqlx::query(
            "SELECT id, at, kind, subject, actor, action, trigger, reason, figures FROM audit \
             WHERE ($1::TEXT IS NULL OR kind = $1) AND ($2::TEXT IS NULL OR subject = $2) ORDER BY id DESC LIMIT $3",
        )
        .bind(kind)
        .bind(subject)
        .bind(i64::from(limit.min(1000)))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(AuditEntry {
                    id: r.try_get("id")?,
                    at: UnixMs(r.try_get("at")?),
                    kind: r.try_get("kind")?,
                    subject: r.try_get("subject")?,
                    actor: r.try_get("actor")?,
                    action: r.try_get("action")?,
                    trigger: r.try_get("trigger")?,
                    reason: r.try_get("reason")?,
                    figures: r.try_get("figures")?,
                })
            })
            .collect()
    }

    async fn by_response_id(&self, key_name: &str, response_id: &str) -> Result<Option<RequestRecord>> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE response_id = $1 AND response_id IS NOT NULL \
             AND key_name = $2 ORDER BY id DESC LIMIT 1"
        )))
        .bind(response_id)
        .bind(key_name)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(request_from_row).transpose()
    }

    async fn keyed(
        &self,
        key_name: &str,
        idempotency_key: &str,
        since: UnixMs,
        now: UnixMs,
    ) -> Result<Option<KeyedRequest>> {
        // The partial index finds the key's rows; the newest is the one that counts (a
        // key whose request failed may run again, as a newer row).
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE key_name = $1 AND idempotency_key = $2 \
             AND idempotency_key IS NOT NULL \
             AND (received_at >= $3 OR state IN ('received', 'calling_api', 'unknown')) ORDER BY id DESC LIMIT 1"
        )))
        .bind(key_name)
        .bind(idempotency_key)
        .bind(since.0)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let request = request_from_row(&row)?;
        let stored = sqlx::query(
            "SELECT response_status, response_content_type, response_body FROM payloads \
             WHERE request_id = $1 AND expires_at > $2 AND response_body IS NOT NULL",
        )
        .bind(&request.id)
        .bind(now.0)
        .fetch_optional(&self.pool)
        .await?;
        let response = match stored {
            Some(r) => Some(StoredResponse {
                status: r.try_get::<i64, _>("response_status")? as u16,
                content_type: r.try_get("response_content_type")?,
                body: r.try_get("response_body")?,
            }),
            None => None,
        };
        Ok(Some(KeyedRequest { request, response }))
    }

    async fn reconcile(&self, id: &str, r: &Reconcile, at: UnixMs) -> Result<RequestRecord> {
        let state = match r.outcome {
            Reconciliation::ConfirmedDone => RequestState::Done,
            Reconciliation::ConfirmedNotExecuted => RequestState::Failed,
        };
        let mut tx = self.pool.begin().await?;
        let changed = sqlx::query(
            "UPDATE requests SET state = $1, reconciliation = $2, reconciled_by = $3, reconciled_reason = $4, \
             reconciled_at = $5, result_id = COALESCE($6, result_id), finished_at = COALESCE(finished_at, $5) \
             WHERE id = $7 AND state = 'unknown'",
        )
        .bind(state.as_str())
        .bind(r.outcome.as_str())
        .bind(&r.actor)
        .bind(&r.reason)
        .bind(at.0)
        .bind(&r.result_id)
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed == 0 {
            tx.rollback().await?;
            return Err(match self.get_request(id).await? {
                None => Error::NotFound,
                Some(cur) => Error::Conflict(format!(
                    "request {id} is `{}`, not unknown: there is nothing to reconcile{}",
                    cur.state.as_str(),
                    cur.reconciled_by()
                        .map(|b| format!(" ({b} reconciled it already)"))
                        .unwrap_or_default()
                )),
            });
        }
        sqlx::query(
            "INSERT INTO audit (at, kind, subject, actor, action, trigger, reason, figures) \
             VALUES ($1, 'request', $2, $3, $4, $5, $6, NULL)",
        )
        .bind(at.0)
        .bind(id)
        .bind(&r.actor)
        .bind(format!("unknown->{}", r.outcome.as_str()))
        .bind(r.result_id.as_ref().map(|v| format!("result id {v}")))
        .bind(&r.reason)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.get_request(id).await?.ok_or(Error::NotFound)
    }

    async fn side_effect(&self, id: &str, step: &SideEffect, at: UnixMs) -> Result<RequestRecord> {
        let changed = match step {
            SideEffect::Pending => sqlx::query(
                "UPDATE requests SET state = 'side_effect_pending', side_effect_at = $1 \
                 WHERE id = $2 AND state IN ('api_completed', 'done') AND result_id IS NULL",
            )
            .bind(at.0)
            .bind(id),
            SideEffect::Done { result_id } => sqlx::query(
                "UPDATE requests SET state = 'done', side_effect_at = $1, result_id = $2 \
                 WHERE id = $3 AND state IN ('api_completed', 'done', 'side_effect_pending') AND result_id IS NULL",
            )
            .bind(at.0)
            .bind(result_id)
            .bind(id),
        }
        .execute(&self.pool)
        .await?
        .rows_affected();
        let cur = self.get_request(id).await?.ok_or(Error::NotFound)?;
        if changed > 0 {
            return Ok(cur);
        }
        // Marking again what is already marked is fine (a client retrying its call).
        let same = match step {
            SideEffect::Pending => cur.state == RequestState::SideEffectPending,
            SideEffect::Done { result_id } => cur.result_id() == Some(result_id.as_str()),
        };
        if same {
            return Ok(cur);
        }
        Err(Error::Conflict(match (cur.result_id(), cur.state) {
            (Some(r), _) => format!("request {id} already has its side effect recorded as done (result id {r})"),
            (None, s) => format!(
                "request {id} is `{}`: a side effect is recorded only for a request whose answer arrived",
                s.as_str()
            ),
        }))
    }

    async fn unknowns(&self, limit: u32) -> Result<Vec<RequestRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE state = 'unknown' ORDER BY id DESC LIMIT $1"
        )))
        .bind(i64::from(limit.clamp(1, 1000)))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(request_from_row).collect()
    }

    async fn figures(&self, since: UnixMs) -> Result<LedgerFigures> {
        let counts = |rows: Vec<PgRow>| -> Result<Vec<RouteCount>> {
            rows.iter()
                .map(|r| {
                    Ok(RouteCount {
                        route: r
                            .try_get::<Option<String>, _>(0)?
                            .unwrap_or_else(|| "(no route)".into()),
                        count: count(r, 1)?,
                    })
                })
                .collect()
        };
        // Ties in count come out by route, a missing route first, as SQLite's grouping
        // leaves them.
        let unknown_by_route = counts(
            sqlx::query(
                "SELECT route, COUNT(*) FROM requests WHERE state = 'unknown' GROUP BY route \
                 ORDER BY 2 DESC, 1 NULLS FIRST",
            )
            .fetch_all(&self.pool)
            .await?,
        )?;
        // A key that completed upstream twice: the thing the idempotency ledger exists to
        // prevent, checked from the rows themselves.
        let duplicates_by_route = counts(
            sqlx::query(
                "SELECT route, COUNT(*) FROM (SELECT MAX(route) AS route FROM requests \
                 WHERE idempotency_key IS NOT NULL AND id >= $1 AND received_at >= $2 \
                 AND state IN ('api_completed', 'side_effect_pending', 'done') \
                 GROUP BY key_name, idempotency_key HAVING COUNT(*) > 1) d GROUP BY route \
                 ORDER BY 2 DESC, 1 NULLS FIRST",
            )
            .bind(uuid_floor(since))
            .bind(since.0)
            .fetch_all(&self.pool)
            .await?,
        )?;
        let p = sqlx::query(
            "SELECT COUNT(*), COALESCE(SUM(COALESCE(octet_length(request_body), 0) \
             + COALESCE(octet_length(response_body), 0)), 0)::BIGINT FROM payloads",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(LedgerFigures {
            unknown: unknown_by_route.iter().map(|c| c.count).sum(),
            unknown_by_route,
            duplicates: duplicates_by_route.iter().map(|c| c.count).sum(),
            duplicates_by_route,
            bytes: self.database_bytes().await?,
            payloads: count(&p, 0)?,
            payload_bytes: count(&p, 1)?,
        })
    }

    async fn prune(
        &self,
        now: UnixMs,
        finished_before: Option<UnixMs>,
        keys_since: UnixMs,
        vacuum: bool,
    ) -> Result<PruneReport> {
        let mut report = PruneReport {
            bytes_before: self.database_bytes().await?,
            ..PruneReport::default()
        };
        // In pages, one short statement each: a prune never holds other writers for long.
        loop {
            let n = sqlx::query(
                "DELETE FROM payloads WHERE request_id IN \
                 (SELECT request_id FROM payloads WHERE expires_at <= $1 LIMIT $2)",
            )
            .bind(now.0)
            .bind(PRUNE_ROWS)
            .execute(&self.pool)
            .await?
            .rows_affected();
            report.payloads += n;
            if n == 0 {
                break;
            }
        }
        if let Some(before) = finished_before {
            // The key range of ids before the cut-off (UUIDv7 ids start with their time).
            // Unknown and unfinished requests stay whatever their age, and so does every
            // request whose `Idempotency-Key` is still inside its window: pruning it would
            // let a repeat run again.
            let floor = uuid_floor(before);
            loop {
                let mut tx = self.pool.begin().await?;
                // The page is picked once and locked: every statement below works on the
                // same rows, whatever other instances write meanwhile (SQLite's single
                // writer gives it that for free).
                let ids: Vec<String> = sqlx::query_scalar(
                    "SELECT id FROM requests WHERE id < $1 AND state IN ('done', 'failed') \
                     AND (idempotency_key IS NULL OR received_at < $2) ORDER BY id LIMIT $3 FOR UPDATE",
                )
                .bind(&floor)
                .bind(keys_since.0)
                .bind(PRUNE_ROWS)
                .fetch_all(&mut *tx)
                .await?;
                if ids.is_empty() {
                    tx.rollback().await?;
                    break;
                }
                // B4: a balance is credits minus the requests' costs, so the costs of the
                // requests pruned now are folded into a credit (and a key's spend) first.
                sqlx::query(
                    "INSERT INTO balance_entries (owner, at, kind, amount_usd, actor, reason) \
                     SELECT owner, $2, 'pruned_charges', -SUM(cost_usd), 'gateway', 'costs of pruned requests' \
                     FROM requests WHERE id = ANY($1) AND owner IS NOT NULL AND cost_usd IS NOT NULL \
                     GROUP BY owner HAVING SUM(cost_usd) <> 0 ORDER BY owner",
                )
                .bind(&ids)
                .bind(now.0)
                .execute(&mut *tx)
                .await?;
                sqlx::query(
                    "INSERT INTO key_spend (key_name, folded_usd) \
                     SELECT key_name, SUM(cost_usd) FROM requests WHERE id = ANY($1) \
                     AND key_name IS NOT NULL AND cost_usd IS NOT NULL GROUP BY key_name HAVING SUM(cost_usd) <> 0 \
                     ORDER BY key_name \
                     ON CONFLICT (key_name) DO UPDATE SET folded_usd = key_spend.folded_usd + excluded.folded_usd",
                )
                .bind(&ids)
                .execute(&mut *tx)
                .await?;
                report.attempts += sqlx::query("DELETE FROM attempts WHERE request_id = ANY($1)")
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                sqlx::query("DELETE FROM payloads WHERE request_id = ANY($1)")
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await?;
                report.requests += sqlx::query("DELETE FROM requests WHERE id = ANY($1)")
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                tx.commit().await?;
            }
        }
        if vacuum {
            // VACUUM refuses to run inside a transaction: a plain statement on a pool
            // connection, sent as a simple query.
            sqlx::raw_sql("VACUUM").execute(&self.pool).await?;
        }
        report.bytes_after = self.database_bytes().await?;
        Ok(report)
    }

    async fn accounts(&self) -> Result<Accounts> {
        let credits = sqlx::query(
            "SELECT owner, COALESCE(SUM(amount_usd), 0)::DOUBLE PRECISION FROM balance_entries \
             GROUP BY owner ORDER BY owner",
        )
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| Ok((r.try_get::<String, _>(0)?, r.try_get::<f64, _>(1)?)))
        .collect::<Result<Vec<_>>>()?;
        let prepaid =
            sqlx::query("SELECT DISTINCT owner FROM balance_entries WHERE kind IN ('seed', 'top_up') ORDER BY owner")
                .fetch_all(&self.pool)
                .await?
                .iter()
                .map(|r| Ok(r.try_get::<String, _>(0)?))
                .collect::<Result<Vec<_>>>()?;
        // Every request ever: the smallest id floor.
        let spend = self.spend_since(UnixMs(0)).await?;
        let keys = sqlx::query(
            "SELECT name, owner, secret_sha256, hint, rpm, max_concurrency, created_at, created_by, revoked_at, \
             revoked_by FROM api_keys ORDER BY created_at, name",
        )
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| {
            Ok(StoredKey {
                name: r.try_get("name")?,
                owner: r.try_get("owner")?,
                secret_sha256: r.try_get("secret_sha256")?,
                hint: r.try_get("hint")?,
                rpm: r.try_get::<Option<i64>, _>("rpm")?.map(|v| v as u32),
                max_concurrency: r.try_get::<Option<i64>, _>("max_concurrency")?.map(|v| v as u32),
                created_at: UnixMs(r.try_get("created_at")?),
                created_by: r.try_get("created_by")?,
                revoked_at: ms(r.try_get("revoked_at")?),
                revoked_by: r.try_get("revoked_by")?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
        // In the order the rows were first written, as SQLite lists them.
        let key_spend =
            sqlx::query("SELECT key_name, limit_set, spend_limit_usd, folded_usd FROM key_spend ORDER BY seq")
                .fetch_all(&self.pool)
                .await?
                .iter()
                .map(|r| {
                    Ok(KeySpend {
                        key_name: r.try_get(0)?,
                        limit_set: r.try_get(1)?,
                        spend_limit_usd: r.try_get(2)?,
                        folded_usd: r.try_get(3)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
        Ok(Accounts {
            credits,
            prepaid,
            spend,
            keys,
            key_spend,
        })
    }

    async fn seed_owners(&self, seeds: &[(String, f64)], at: UnixMs) -> Result<Vec<String>> {
        let mut tx = self.pool.begin().await?;
        lock_balances(&mut tx).await?;
        let mut seeded = Vec::new();
        for (owner, amount) in seeds {
            // The balance starts at the seed whatever the owner spent before it was
            // prepaid (while metered, or in requests pruned since): the credit makes up
            // the difference.
            let n = sqlx::query(
                "INSERT INTO balance_entries (owner, at, kind, amount_usd, actor, reason) \
                 SELECT $1, $2, 'seed', $3 \
                     - (SELECT COALESCE(SUM(amount_usd), 0) FROM balance_entries WHERE owner = $1) \
                     + (SELECT COALESCE(SUM(cost_usd), 0) FROM requests WHERE owner = $1 AND cost_usd IS NOT NULL), \
                     'config', 'balance_usd in the config' \
                 WHERE NOT EXISTS (SELECT 1 FROM balance_entries WHERE owner = $1 AND kind IN ('seed', 'top_up'))",
            )
            .bind(owner)
            .bind(at.0)
            .bind(amount)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n > 0 {
                seeded.push(owner.clone());
            }
        }
        tx.commit().await?;
        Ok(seeded)
    }

    async fn credit(&self, e: &BalanceEntry, audit: &AuditEntry) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        lock_balances(&mut tx).await?;
        // The first money a metered owner gets makes it prepaid: its balance starts at
        // the amount, not at the amount less everything it spent while metered.
        sqlx::query(
            "INSERT INTO balance_entries (owner, at, kind, amount_usd, actor, reason) \
             SELECT $1, $2, 'opening', \
                 (SELECT COALESCE(SUM(cost_usd), 0) FROM requests WHERE owner = $1 AND cost_usd IS NOT NULL) \
                 - (SELECT COALESCE(SUM(amount_usd), 0) FROM balance_entries WHERE owner = $1), \
                 'gateway', 'the owner becomes prepaid: its metered spend is not taken from its first credit' \
             WHERE NOT EXISTS (SELECT 1 FROM balance_entries WHERE owner = $1 AND kind IN ('seed', 'top_up'))",
        )
        .bind(&e.owner)
        .bind(e.at.0)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO balance_entries (owner, at, kind, amount_usd, actor, reason) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&e.owner)
        .bind(e.at.0)
        .bind(&e.kind)
        .bind(e.amount_usd)
        .bind(&e.actor)
        .bind(&e.reason)
        .execute(&mut *tx)
        .await?;
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn create_key(&self, k: &StoredKey, spend_limit: Option<f64>, audit: &AuditEntry) -> Result<()> {
        let conflict = || Error::Conflict(format!("a key named `{}` exists already", k.name));
        let mut tx = self.pool.begin().await?;
        let taken = sqlx::query("SELECT 1 FROM api_keys WHERE name = $1 OR secret_sha256 = $2")
            .bind(&k.name)
            .bind(&k.secret_sha256)
            .fetch_optional(&mut *tx)
            .await?;
        if taken.is_some() {
            return Err(conflict());
        }
        // Another instance may make the same key between the check and the insert: its
        // unique index refuses the second, which is the same conflict.
        sqlx::query(
            "INSERT INTO api_keys (name, owner, secret_sha256, hint, rpm, max_concurrency, created_at, created_by) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&k.name)
        .bind(&k.owner)
        .bind(&k.secret_sha256)
        .bind(&k.hint)
        .bind(k.rpm.map(i64::from))
        .bind(k.max_concurrency.map(i64::from))
        .bind(k.created_at.0)
        .bind(&k.created_by)
        .execute(&mut *tx)
        .await
        .map_err(|e| match e {
            sqlx::Error::Database(d) if d.is_unique_violation() => conflict(),
            e => Error::Database(e),
        })?;
        if spend_limit.is_some() {
            upsert_spend_limit(&mut tx, &k.name, spend_limit, k.created_at, &k.created_by).await?;
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn revoke_key(&self, name: &str, at: UnixMs, by: &str, audit: &AuditEntry) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let n =
            sqlx::query("UPDATE api_keys SET revoked_at = $1, revoked_by = $2 WHERE name = $3 AND revoked_at IS NULL")
                .bind(at.0)
                .bind(by)
                .bind(name)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        if n == 0 {
            return Err(Error::NotFound);
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn set_spend_limit(
        &self,
        key_name: &str,
        limit: Option<f64>,
        at: UnixMs,
        by: &str,
        audit: &AuditEntry,
    ) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        upsert_spend_limit(&mut tx, key_name, limit, at, by).await?;
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn spend_since(&self, since: UnixMs) -> Result<Vec<SpendRow>> {
        // Ordered as SQLite's grouping leaves the groups (a missing value first).
        sqlx::query(
            "SELECT owner, key_name, route, COALESCE(SUM(cost_usd), 0)::DOUBLE PRECISION, COUNT(*) FROM requests \
             WHERE id >= $1 AND cost_usd IS NOT NULL GROUP BY owner, key_name, route \
             ORDER BY 1 NULLS FIRST, 2 NULLS FIRST, 3 NULLS FIRST",
        )
        .bind(uuid_floor(since))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| {
            Ok(SpendRow {
                owner: r.try_get(0)?,
                key_name: r.try_get(1)?,
                route: r.try_get(2)?,
                cost_usd: r.try_get(3)?,
                requests: count(r, 4)?,
            })
        })
        .collect()
    }

    async fn cost_report(&self, since: UnixMs, bucket_ms: i64) -> Result<Vec<CostCell>> {
        let bucket = bucket_ms.max(1000);
        // Sums of BIGINT are NUMERIC in PostgreSQL: cast back. Cells come in SQLite's
        // grouping order (bucket, then owner, key, route and model, a missing value first).
        sqlx::query(
            "SELECT (received_at / $2) * $2 AS b, owner, key_name, route, COALESCE(served_model, requested_model), \
             COUNT(*), COUNT(*) FILTER (WHERE cost_usd IS NULL), COALESCE(SUM(cost_usd), 0)::DOUBLE PRECISION, \
             COALESCE(SUM(failed_cost_usd), 0)::DOUBLE PRECISION, COALESCE(SUM(GREATEST(attempts - 1, 0)), 0)::BIGINT, \
             COALESCE(SUM(CASE WHEN cost_usd IS NOT NULL AND attempts > 0 THEN estimated_cost_usd END), 0) \
                 ::DOUBLE PRECISION, \
             COALESCE(SUM(CASE WHEN estimated_cost_usd IS NOT NULL AND attempts > 0 THEN cost_usd END), 0) \
                 ::DOUBLE PRECISION, \
             COALESCE(SUM(CASE WHEN input_tokens IS NOT NULL THEN estimated_input_tokens END), 0)::BIGINT, \
             COALESCE(SUM(CASE WHEN estimated_input_tokens IS NOT NULL THEN \
                 input_tokens + COALESCE(CASE WHEN format = 'anthropic' THEN COALESCE(cached_input_tokens, 0) \
                 + COALESCE(cache_write_tokens, 0) END, 0) END), 0)::BIGINT \
             FROM requests WHERE id >= $1 AND state NOT IN ('received', 'calling_api') \
             GROUP BY 1, 2, 3, 4, 5 ORDER BY 1, 2 NULLS FIRST, 3 NULLS FIRST, 4 NULLS FIRST, 5 NULLS FIRST",
        )
        .bind(uuid_floor(since))
        .bind(bucket)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| {
            Ok(CostCell {
                at: UnixMs(r.try_get(0)?),
                owner: r.try_get(1)?,
                key_name: r.try_get(2)?,
                route: r.try_get(3)?,
                model: r.try_get(4)?,
                requests: count(r, 5)?,
                unknown_cost: count(r, 6)?,
                cost_usd: r.try_get(7)?,
                failed_cost_usd: r.try_get(8)?,
                retries: count(r, 9)?,
                estimated_usd: r.try_get(10)?,
                estimated_actual_usd: r.try_get(11)?,
                estimated_input_tokens: count(r, 12)?,
                actual_input_tokens: count(r, 13)?,
            })
        })
        .collect()
    }

    async fn save_jobs(&self, jobs: &[JobRecord], audit: &[AuditEntry]) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        for j in jobs {
            upsert_job(&mut tx, j).await?;
        }
        for a in audit {
            insert_audit(&mut tx, a).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn job(&self, id: &str) -> Result<Option<JobRecord>> {
        let row = sqlx::query(AssertSqlSafe(format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1")))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(|r| job_from_row(r, true)).transpose()
    }

    async fn job_by_key(&self, key_name: &str, idempotency_key: &str) -> Result<Option<JobRecord>> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT {list} FROM jobs WHERE key_name = $1 AND idempotency_key = $2 \
             ORDER BY created_at DESC, seq DESC LIMIT 1",
            list = *JOB_LIST_COLUMNS
        )))
        .bind(key_name)
        .bind(idempotency_key)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(|r| job_from_row(r, false)).transpose()
    }

    async fn open_jobs(&self) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {list} FROM jobs WHERE state IN ('queued', 'running', 'owner_review', 'dead_letter') \
             ORDER BY created_at, seq",
            list = *JOB_LIST_COLUMNS
        )))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| job_from_row(r, false)).collect()
    }

    async fn recent_jobs(&self, limit: u32) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {list} FROM jobs ORDER BY created_at DESC, seq DESC LIMIT $1",
            list = *JOB_LIST_COLUMNS
        )))
        .bind(i64::from(limit.min(1000)))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| job_from_row(r, false)).collect()
    }

    async fn job_requests(&self, job_id: &str) -> Result<Vec<RequestRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE job_id = $1 ORDER BY received_at, id"
        )))
        .bind(job_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(request_from_row).collect()
    }

    async fn save_policy_version(&self, v: &PolicyVersion) -> Result<bool> {
        let n = sqlx::query(
            "INSERT INTO policy_versions (workflow, version, source, text, loaded_at) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (workflow, version) DO NOTHING",
        )
        .bind(&v.workflow)
        .bind(&v.version)
        .bind(&v.source)
        .bind(&v.text)
        .bind(v.loaded_at.0)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(n > 0)
    }

    async fn policy_versions(&self, workflow: Option<&str>) -> Result<Vec<PolicyVersion>> {
        let rows = sqlx::query(
            "SELECT workflow, version, source, text, loaded_at FROM policy_versions \
             WHERE ($1::TEXT IS NULL OR workflow = $1) ORDER BY workflow, loaded_at DESC, version",
        )
        .bind(workflow)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(PolicyVersion {
                    workflow: r.try_get("workflow")?,
                    version: r.try_get("version")?,
                    source: r.try_get("source")?,
                    text: r.try_get("text")?,
                    loaded_at: UnixMs(r.try_get("loaded_at")?),
                })
            })
            .collect()
    }

    async fn save_recovery(&self, run: &RecoveryRow, audit: &[AuditEntry]) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO recovery_runs (id, route, drill, step, opened_at, closed_at, body) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (id) DO UPDATE SET step = excluded.step, closed_at = excluded.closed_at, body = excluded.body",
        )
        .bind(&run.id)
        .bind(&run.route)
        .bind(&run.drill)
        .bind(&run.step)
        .bind(run.opened_at.0)
        .bind(run.closed_at.map(|c| c.0))
        .bind(&run.body)
        .execute(&mut *tx)
        .await?;
        for a in audit {
            insert_audit(&mut tx, a).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn recoveries(&self, limit: u32) -> Result<Vec<RecoveryRow>> {
        let rows = sqlx::query(
            "SELECT id, route, drill, step, opened_at, closed_at, body FROM recovery_runs \
             ORDER BY closed_at IS NOT NULL, opened_at DESC, id LIMIT $1",
        )
        .bind(i64::from(limit.clamp(1, 10_000)))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(RecoveryRow {
                    id: r.try_get("id")?,
                    route: r.try_get("route")?,
                    drill: r.try_get("drill")?,
                    step: r.try_get("step")?,
                    opened_at: UnixMs(r.try_get("opened_at")?),
                    closed_at: ms(r.try_get("closed_at")?),
                    body: r.try_get("body")?,
                })
            })
            .collect()
    }

    async fn save_evidence(&self, run_id: &str, bytes: &[u8]) -> Result<()> {
        sqlx::query(
            "INSERT INTO recovery_evidence (run_id, bytes) VALUES ($1, $2) \
             ON CONFLICT (run_id) DO UPDATE SET bytes = excluded.bytes",
        )
        .bind(run_id)
        .bind(bytes)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn evidence(&self, run_id: &str) -> Result<Option<Vec<u8>>> {
        Ok(
            sqlx::query_scalar("SELECT bytes FROM recovery_evidence WHERE run_id = $1")
                .bind(run_id)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    async fn route_unknowns(&self, route: &str) -> Result<u64> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM requests WHERE state = 'unknown' AND route = $1")
            .bind(route)
            .fetch_one(&self.pool)
            .await?;
        Ok(n.max(0) as u64)
    }

    async fn first_failure(
        &self,
        route: &str,
        from: UnixMs,
        to: UnixMs,
        after_last_success: bool,
    ) -> Result<Option<String>> {
        let (lo, hi) = (uuid_floor(from), uuid_floor(to));
        Ok(sqlx::query_scalar(
            "SELECT MIN(id) FROM requests WHERE id >= $1 AND id < $2 AND route = $3 \
             AND state IN ('failed', 'unknown') AND attempts > 0 \
             AND (NOT $4 OR id > COALESCE((SELECT MAX(id) FROM requests WHERE id >= $1 AND id < $2 AND route = $3 \
             AND state = 'done'), ''))",
        )
        .bind(&lo)
        .bind(&hi)
        .bind(route)
        .bind(after_last_success)
        .fetch_one(&self.pool)
        .await?)
    }

    async fn normal_latency(&self, route: &str, from: UnixMs, to: UnixMs) -> Result<Option<f64>> {
        let row = sqlx::query(
            "SELECT v FROM (SELECT finished_at - received_at AS v, \
             ROW_NUMBER() OVER (ORDER BY finished_at - received_at) AS rn, COUNT(*) OVER () AS n \
             FROM requests WHERE id >= $1 AND id < $2 AND route = $3 AND state = 'done' \
             AND NOT stream AND finished_at IS NOT NULL) t WHERE rn = GREATEST(1, (n * 95 + 99) / 100)",
        )
        .bind(uuid_floor(from))
        .bind(uuid_floor(to))
        .bind(route)
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row {
            Some(r) => Some(r.try_get::<i64, _>(0)? as f64),
            None => None,
        })
    }

    async fn scorecard(&self, from: UnixMs, to: UnixMs, route: Option<&str>) -> Result<Vec<ScoreRow>> {
        // Rows by their key: a UUIDv7 id starts with its millisecond (`received_at`).
        let (lo, hi) = (uuid_floor(from), uuid_floor(to));
        let window = "id >= $1 AND id < $2 AND route IS NOT NULL AND ($3::TEXT IS NULL OR route = $3)";
        let mut rows: Vec<ScoreRow> = Vec::new();
        let agg = sqlx::query(AssertSqlSafe(format!(
            "SELECT route, COUNT(*), COALESCE(SUM(attempts), 0)::BIGINT, COUNT(*) FILTER (WHERE attempts > 0), \
             COUNT(*) FILTER (WHERE state = 'done'), COUNT(*) FILTER (WHERE attempts > 1), \
             COUNT(*) FILTER (WHERE state = 'failed'), COUNT(*) FILTER (WHERE state = 'unknown'), \
             COALESCE(SUM(cost_usd), 0)::DOUBLE PRECISION, COUNT(*) FILTER (WHERE cost_usd IS NULL AND attempts > 0), \
             COUNT(*) FILTER (WHERE attempts > 1 AND state = 'done'), \
             COALESCE(SUM(GREATEST(attempts - 1, 0)), 0)::BIGINT \
             FROM requests WHERE {window} GROUP BY route ORDER BY route"
        )))
        .bind(&lo)
        .bind(&hi)
        .bind(route)
        .fetch_all(&self.pool)
        .await?;
        let mut overall = ScoreRow {
            route: "overall".into(),
            ..ScoreRow::default()
        };
        let (mut attempted_all, mut retried_all, mut retried_ok_all) = (0u64, 0u64, 0u64);
        for r in &agg {
            let (requests, attempts, attempted, succeeded) = (count(r, 1)?, count(r, 2)?, count(r, 3)?, count(r, 4)?);
            let (retried, retried_ok) = (count(r, 5)?, count(r, 10)?);
            let row = ScoreRow {
                route: r.try_get(0)?,
                requests,
                attempts,
                retries: count(r, 11)?,
                amplification: (attempted > 0).then(|| attempts as f64 / attempted as f64),
                success_rate: (requests > 0).then(|| succeeded as f64 / requests as f64),
                post_retry_success_rate: (retried > 0).then(|| retried_ok as f64 / retried as f64),
                succeeded,
                failed: count(r, 6)?,
                unknowns: count(r, 7)?,
                cost_usd: r.try_get(8)?,
                unpriced: count(r, 9)?,
                ..ScoreRow::default()
            };
            overall.requests += row.requests;
            overall.attempts += row.attempts;
            overall.retries += row.retries;
            overall.succeeded += row.succeeded;
            overall.failed += row.failed;
            overall.unknowns += row.unknowns;
            overall.cost_usd += row.cost_usd;
            overall.unpriced += row.unpriced;
            attempted_all += attempted;
            retried_all += retried;
            retried_ok_all += retried_ok;
            rows.push(row);
        }
        overall.amplification = (attempted_all > 0).then(|| overall.attempts as f64 / attempted_all as f64);
        overall.success_rate = (overall.requests > 0).then(|| overall.succeeded as f64 / overall.requests as f64);
        overall.post_retry_success_rate = (retried_all > 0).then(|| retried_ok_all as f64 / retried_all as f64);
        let idx = |rows: &[ScoreRow], route: &str| rows.iter().position(|r| r.route == route);

        let mix = sqlx::query(AssertSqlSafe(format!(
            "SELECT route, COALESCE(error_class, 'unclassified'), COUNT(*) FROM requests \
             WHERE {window} AND state = 'failed' GROUP BY 1, 2 ORDER BY 3 DESC, 2, 1"
        )))
        .bind(&lo)
        .bind(&hi)
        .bind(route)
        .fetch_all(&self.pool)
        .await?;
        for r in &mix {
            let (route, class, n): (String, String, u64) = (r.try_get(0)?, r.try_get(1)?, count(r, 2)?);
            if let Some(k) = idx(&rows, &route) {
                rows[k].error_mix.push(ErrorCount {
                    class: class.clone(),
                    count: n,
                });
            }
            match overall.error_mix.iter_mut().find(|e| e.class == class) {
                Some(e) => e.count += n,
                None => overall.error_mix.push(ErrorCount { class, count: n }),
            }
        }
        overall
            .error_mix
            .sort_by(|a, b| b.count.cmp(&a.count).then(a.class.cmp(&b.class)));

        // A key that completed in the window and, counting every completion the ledger
        // holds (before the window too), more than once.
        let dups = sqlx::query(AssertSqlSafe(format!(
            "SELECT route, COUNT(*) FROM (SELECT MAX(w.route) AS route, w.key_name AS k, w.idempotency_key AS i \
             FROM requests w WHERE {window} AND w.idempotency_key IS NOT NULL \
             AND w.state IN ('api_completed', 'side_effect_pending', 'done') GROUP BY w.key_name, w.idempotency_key) d \
             WHERE (SELECT COUNT(*) FROM requests x WHERE x.key_name = d.k AND x.idempotency_key = d.i \
             AND x.state IN ('api_completed', 'side_effect_pending', 'done')) > 1 GROUP BY route"
        )))
        .bind(&lo)
        .bind(&hi)
        .bind(route)
        .fetch_all(&self.pool)
        .await?;
        for r in &dups {
            let (route, n): (String, u64) = (r.try_get(0)?, count(r, 1)?);
            if let Some(k) = idx(&rows, &route) {
                rows[k].duplicates = n;
            }
            overall.duplicates += n;
        }

        // P50 and P95 by nearest rank, one sort per figure: each route's ranks, then the
        // whole window's.
        for (expr, is_wait) in [("finished_at - received_at", false), ("queued_ms", true)] {
            for partition in ["route", "'overall'::TEXT"] {
                let q = format!(
                    "SELECT g, v, rn, n FROM (SELECT g, v, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v) AS rn, \
                     COUNT(*) OVER (PARTITION BY g) AS n FROM (SELECT {partition} AS g, {expr} AS v FROM requests \
                     WHERE {window} AND finished_at IS NOT NULL AND {expr} IS NOT NULL) s) t \
                     WHERE rn = GREATEST(1, (n * 50 + 99) / 100) OR rn = GREATEST(1, (n * 95 + 99) / 100)"
                );
                let got = sqlx::query(AssertSqlSafe(q))
                    .bind(&lo)
                    .bind(&hi)
                    .bind(route)
                    .fetch_all(&self.pool)
                    .await?;
                for r in &got {
                    let (g, v, rn, n): (String, i64, u64, u64) =
                        (r.try_get(0)?, r.try_get(1)?, count(r, 2)?, count(r, 3)?);
                    let row = if g == "overall" && partition != "route" {
                        &mut overall
                    } else if let Some(k) = idx(&rows, &g) {
                        &mut rows[k]
                    } else {
                        continue;
                    };
                    let v = Some(v as f64);
                    if rn == crate::rank(0.5, n) {
                        if is_wait {
                            row.wait_p50_ms = v;
                        } else {
                            row.p50_ms = v;
                        }
                    }
                    if rn == crate::rank(0.95, n) {
                        if is_wait {
                            row.wait_p95_ms = v;
                        } else {
                            row.p95_ms = v;
                        }
                    }
                }
            }
        }
        rows.push(overall);
        Ok(rows)
    }

    async fn daily(&self, from: UnixMs, to: UnixMs) -> Result<Vec<DayFigures>> {
        // SQLite's LIKE ignores ASCII case: ILIKE.
        let rows = sqlx::query(
            "SELECT route, received_at / 86400000 * 86400000 AS day, COUNT(*), COUNT(*) FILTER (WHERE attempts > 0), \
             COALESCE(SUM(attempts), 0)::BIGINT, COALESCE(SUM(cost_usd), 0)::DOUBLE PRECISION, \
             COUNT(*) FILTER (WHERE cost_usd IS NOT NULL AND attempts > 0), \
             COUNT(*) FILTER (WHERE state = 'failed' AND http_status = 429), \
             COUNT(*) FILTER (WHERE state = 'done' AND attempts > 0 AND upstream_request_id IS NULL \
                 AND endpoint NOT ILIKE '%count_tokens%' AND endpoint NOT ILIKE '%countTokens%') \
             FROM requests WHERE id >= $1 AND id < $2 AND route IS NOT NULL GROUP BY 1, 2 ORDER BY 2, 1",
        )
        .bind(uuid_floor(from))
        .bind(uuid_floor(to))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(DayFigures {
                    route: r.try_get(0)?,
                    day: UnixMs(r.try_get(1)?),
                    requests: count(r, 2)?,
                    attempted: count(r, 3)?,
                    attempts: count(r, 4)?,
                    cost_usd: r.try_get(5)?,
                    priced: count(r, 6)?,
                    rate_limited: count(r, 7)?,
                    untied: count(r, 8)?,
                })
            })
            .collect()
    }

    async fn last_good_versions(&self, route: &str, from: UnixMs, to: UnixMs) -> Result<Vec<(String, String)>> {
        // Each workflow's newest answered request (SQLite reads it as the bare columns of
        // the row holding MAX(id)).
        let rows = sqlx::query(
            "SELECT DISTINCT ON (workflow) workflow, policy_version FROM requests \
             WHERE id >= $1 AND id < $2 AND route = $3 AND state = 'done' AND workflow IS NOT NULL \
             AND policy_version IS NOT NULL ORDER BY workflow, id DESC",
        )
        .bind(uuid_floor(from))
        .bind(uuid_floor(to))
        .bind(route)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect()
    }

    async fn route_requests(
        &self,
        route: &str,
        from: UnixMs,
        to: UnixMs,
        limit: u32,
    ) -> Result<Vec<(RequestRecord, Vec<AttemptRecord>)>> {
        let (lo, hi) = (uuid_floor(from), uuid_floor(to));
        let reqs = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_READ_COLUMNS} FROM requests WHERE id >= $1 AND id < $2 AND route = $3 \
             ORDER BY id LIMIT $4"
        )))
        .bind(&lo)
        .bind(&hi)
        .bind(route)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut out: Vec<(RequestRecord, Vec<AttemptRecord>)> = Vec::with_capacity(reqs.len());
        for r in &reqs {
            out.push((request_from_row(r)?, Vec::new()));
        }
        let Some(last) = out.last().map(|(r, _)| r.id.clone()) else {
            return Ok(out);
        };
        // The attempts of the same rows, in one pass over the same key range, in the byte
        // order the merge below compares in (the columns are COLLATE "C").
        let atts = sqlx::query(AssertSqlSafe(format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE request_id >= $1 AND request_id <= $2 \
             AND request_id IN (SELECT id FROM requests WHERE id >= $1 AND id <= $2 AND route = $3) \
             ORDER BY request_id, attempt_no"
        )))
        .bind(&lo)
        .bind(&last)
        .bind(route)
        .fetch_all(&self.pool)
        .await?;
        let mut k = 0;
        for a in &atts {
            let a = attempt_from_row(a)?;
            while k < out.len() && out[k].0.id < a.request_id {
                k += 1;
            }
            if k < out.len() && out[k].0.id == a.request_id {
                out[k].1.push(a);
            }
        }
        Ok(out)
    }

    async fn overruns(&self, route: Option<&str>, from: UnixMs, to: UnixMs) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {list} FROM jobs WHERE expires_at >= $1 AND expires_at < $2 \
             AND ($3::TEXT IS NULL OR COALESCE(route_override, route) = $3) \
             AND ((state = 'dead_letter' AND updated_at >= expires_at) \
             OR (state = 'succeeded' AND updated_at > expires_at)) \
             ORDER BY expires_at, seq LIMIT 1000",
            list = *JOB_LIST_COLUMNS
        )))
        .bind(from.0)
        .bind(to.0)
        .bind(route)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| job_from_row(r, false)).collect()
    }

    async fn heartbeat(&self, row: &InstanceRow, lease_until: UnixMs) -> Result<()> {
        let mut tx = self.beat.begin().await?;
        // A heartbeat means the instance is alive: a restarted one that was marked stopped
        // (or taken over) is live again. Its time is the database's: instances' clocks
        // disagree, and one running ahead would otherwise take every other over.
        sqlx::query(
            "INSERT INTO instances (id, boot, listen, version, started_at, heartbeat_at, stopped_at, taken_over_by, \
             unknowns, load) VALUES ($1, $2, $3, $4, $5, (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT, \
             NULL, NULL, 0, $6) \
             ON CONFLICT (id) DO UPDATE SET boot = excluded.boot, listen = excluded.listen, \
             version = excluded.version, started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at, \
             load = excluded.load, stopped_at = NULL, taken_over_by = NULL, unknowns = 0",
        )
        .bind(&row.id)
        .bind(&row.boot)
        .bind(&row.listen)
        .bind(&row.version)
        .bind(row.started_at.0)
        .bind(&row.load)
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE jobs SET lease_until = $1 WHERE lease_owner = $2")
            .bind(lease_until.0)
            .bind(&row.id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn instances(&self) -> Result<Vec<InstanceRow>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {INSTANCE_COLUMNS} FROM instances ORDER BY (stopped_at IS NULL) DESC, id"
        )))
        .fetch_all(&self.beat)
        .await?;
        rows.iter().map(instance_from_row).collect()
    }

    async fn take_over(&self, by: &str, stale_before: UnixMs, at: UnixMs) -> Result<Vec<TakeOver>> {
        // Heartbeats carry the database's time: staleness is judged on it too, the caller's
        // `at - stale_before` being how old is too old.
        let stale_ms = at.0 - stale_before.0;
        let candidates: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM instances WHERE stopped_at IS NULL AND id <> $2 \
             AND heartbeat_at < (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT - $1 ORDER BY id",
        )
        .bind(stale_ms)
        .bind(by)
        .fetch_all(&self.beat)
        .await?;
        let mut taken = Vec::new();
        for id in candidates {
            let mut tx = self.beat.begin().await?;
            // The claim: survivors racing for one instance queue on its row, and the ones
            // after the first find it stopped (PostgreSQL re-checks the condition on the
            // row the first committed) and leave it. An instance that heartbeated since
            // the candidates were read is not taken either.
            let claimed: Option<String> = sqlx::query_scalar(
                "UPDATE instances SET stopped_at = (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT, \
                 taken_over_by = $1 WHERE id = $2 AND stopped_at IS NULL \
                 AND heartbeat_at < (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT - $3 RETURNING id",
            )
            .bind(by)
            .bind(&id)
            .bind(stale_ms)
            .fetch_optional(&mut *tx)
            .await?;
            if claimed.is_none() {
                tx.rollback().await?;
                continue;
            }
            let unknowns = sqlx::query(
                "UPDATE requests SET state = 'unknown', error_class = 'interrupted', error_message = $1 \
                 WHERE state = 'calling_api' AND instance = $2",
            )
            .bind(taken_over_message(&id))
            .bind(&id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            sqlx::query("UPDATE instances SET unknowns = $1 WHERE id = $2")
                .bind(i(Some(unknowns)))
                .bind(&id)
                .execute(&mut *tx)
                .await?;
            let mut jobs: Vec<String> = sqlx::query_scalar(
                "UPDATE jobs SET lease_owner = NULL, lease_until = NULL WHERE lease_owner = $1 RETURNING id",
            )
            .bind(&id)
            .fetch_all(&mut *tx)
            .await?;
            tx.commit().await?;
            // RETURNING gives no order; SQLite lists them by id.
            jobs.sort_unstable();
            taken.push(TakeOver {
                instance: id,
                unknowns,
                jobs,
            });
        }
        Ok(taken)
    }

    async fn instance_stopped(&self, id: &str, at: UnixMs) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("UPDATE instances SET stopped_at = $1 WHERE id = $2")
            .bind(at.0)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE jobs SET lease_owner = NULL, lease_until = NULL WHERE lease_owner = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn lease_job(&self, id: &str, instance: &str, now: UnixMs, until: UnixMs) -> Result<Option<JobRecord>> {
        // The row is locked while it is checked and leased; an instance that finds it
        // locked by another (leasing or saving it) skips it rather than wait.
        let row = sqlx::query(AssertSqlSafe(format!(
            "UPDATE jobs SET lease_owner = $2, lease_until = $4 \
             WHERE id = (SELECT id FROM jobs WHERE id = $1 AND state = 'queued' AND ready_at <= $3 \
             AND (lease_owner IS NULL OR lease_owner = $2 OR lease_until < $3) FOR UPDATE SKIP LOCKED) \
             RETURNING {JOB_COLUMNS}"
        )))
        .bind(id)
        .bind(instance)
        .bind(now.0)
        .bind(until.0)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(|r| job_from_row(r, true)).transpose()
    }

    async fn jobs_changed_since(&self, since: UnixMs) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {list} FROM jobs WHERE updated_at >= $1 ORDER BY updated_at, id",
            list = *JOB_LIST_COLUMNS
        )))
        .bind(since.0)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| job_from_row(r, false)).collect()
    }

    async fn claim_key(
        &self,
        key_name: &str,
        idempotency_key: &str,
        request_id: &str,
        at: UnixMs,
    ) -> Result<Option<String>> {
        // The holder's request is in flight until its row reaches a final rank (a missing
        // row is one not written yet: the claim comes first) or its instance stops.
        static HOLDER: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT c.request_id, {rank} >= 3, i.stopped_at IS NOT NULL FROM idempotency_claims c \
                 LEFT JOIN requests r ON r.id = c.request_id LEFT JOIN instances i ON i.id = c.instance \
                 WHERE c.key_name = $1 AND c.idempotency_key = $2 FOR UPDATE OF c",
                rank = rank_sql("r.state")
            )
        });
        // A claim released between the insert and the look-up is tried for again.
        for _ in 0..3 {
            let mut tx = self.pool.begin().await?;
            let inserted = sqlx::query(
                "INSERT INTO idempotency_claims (key_name, idempotency_key, request_id, instance, claimed_at) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
            )
            .bind(key_name)
            .bind(idempotency_key)
            .bind(request_id)
            .bind(&self.instance)
            .bind(at.0)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if inserted > 0 {
                tx.commit().await?;
                return Ok(None);
            }
            let held = sqlx::query(AssertSqlSafe(HOLDER.as_str()))
                .bind(key_name)
                .bind(idempotency_key)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(held) = held else {
                tx.rollback().await?;
                continue;
            };
            let (holder, finished, stopped): (String, bool, bool) =
                (held.try_get(0)?, held.try_get(1)?, held.try_get(2)?);
            if holder != request_id && !finished && !stopped {
                tx.rollback().await?;
                return Ok(Some(holder));
            }
            sqlx::query(
                "UPDATE idempotency_claims SET request_id = $3, instance = $4, claimed_at = $5 \
                 WHERE key_name = $1 AND idempotency_key = $2",
            )
            .bind(key_name)
            .bind(idempotency_key)
            .bind(request_id)
            .bind(&self.instance)
            .bind(at.0)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(None);
        }
        Err(Error::Unavailable(
            "the Idempotency-Key's claim kept changing hands; try again".into(),
        ))
    }

    async fn release_key(&self, key_name: &str, idempotency_key: &str, request_id: &str) -> Result<()> {
        sqlx::query("DELETE FROM idempotency_claims WHERE key_name = $1 AND idempotency_key = $2 AND request_id = $3")
            .bind(key_name)
            .bind(idempotency_key)
            .bind(request_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn maintain(&self) -> Result<u64> {
        // PostgreSQL checkpoints and vacuums on its own: nothing for the writer to hand off.
        Ok(0)
    }
}
