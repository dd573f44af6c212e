//! SQLite in WAL mode: one writer connection owned by the writer task's batches, a small
//! read pool, and checkpoints on their own connection so commits stay short.
//!
//! Durability is SQLite's `synchronous=FULL` in effect — a `calling_api` that was
//! acknowledged survives a power loss, not just a killed process — done as the same sync
//! of the WAL file, but after the commit instead of inside it: the writer commits in
//! NORMAL mode and [`LedgerBackend::sync`] syncs the WAL before any durable write is
//! acknowledged. One sync then covers every commit made before it started, and the next
//! batch is written while it runs instead of waiting behind it.

use crate::{
    AttemptRecord, Decision, Error, FailureClass, LedgerBackend, LedgerLock, Page, RequestRecord, RequestState, Result,
    Search, StopReason,
};
use async_trait::async_trait;
use spillway_wire::{ErrorClass, Format, UnixMs, Visibility};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous};
use sqlx::{AssertSqlSafe, Connection, QueryBuilder, Row, Sqlite, SqliteConnection, SqlitePool};
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::LazyLock;
use std::time::Duration;
use tokio::sync::Mutex;

/// Past this size the checkpoint makes the WAL restart (see `maintain`). Each restart
/// holds the writer for one short checkpoint (a few ms, mostly fsync), so it should be
/// rare: at 1,000 requests/s (~10 KB of WAL each) this is one every ten seconds or so.
const WAL_RESTART_BYTES: u64 = 96 * 1024 * 1024;

/// The WAL file is truncated back to this many bytes after it restarts.
const WAL_SIZE_LIMIT: u64 = WAL_RESTART_BYTES;

/// SQLite allows 32766 bound parameters per statement; stay well under it.
const ROWS_PER_STATEMENT: usize = 500;

const REQUEST_COLUMNS: &str = "id, trace_id, client_request_id, upstream_request_id, key_name, owner, workflow, \
    format, endpoint, route, channel, requested_model, served_model, stream, state, http_status, error_class, \
    error_message, input_tokens, output_tokens, cached_input_tokens, reasoning_tokens, cost_usd, received_at, \
    admitted_at, first_token_at, finished_at, queued_ms, attempts, body_sha256, partial_output_committed, next_ready_at";

/// Columns fixed when a request is first written. Leaving them out of the upsert's SET
/// spares SQLite rewriting their index entries (trace id, client id, time) on every
/// state change.
const IMMUTABLE_REQUEST_COLUMNS: &[&str] = &[
    "id",
    "trace_id",
    "client_request_id",
    "received_at",
    "format",
    "endpoint",
];

/// A state's place on the I3 path, in SQL (see [`RequestState::rank`]).
fn rank_sql(column: &str) -> String {
    let arms: String = RequestState::ALL
        .iter()
        .map(|s| format!(" WHEN '{}' THEN {}", s.as_str(), s.rank()))
        .collect();
    format!("(CASE {column}{arms} ELSE 0 END)")
}

static REQUEST_UPSERT: LazyLock<String> = LazyLock::new(|| {
    let sets: Vec<String> = REQUEST_COLUMNS
        .split(',')
        .map(str::trim)
        .filter(|c| !IMMUTABLE_REQUEST_COLUMNS.contains(c))
        .map(|c| format!("{c} = excluded.{c}"))
        .collect();
    // The store itself refuses to move a request backwards: a finished row never changes
    // through the write path, and an earlier state never overwrites a later one.
    format!(
        " ON CONFLICT(id) DO UPDATE SET {} WHERE {old} < 4 AND {new} >= {old}",
        sets.join(", "),
        old = rank_sql("requests.state"),
        new = rank_sql("excluded.state"),
    )
});

const ATTEMPT_COLUMNS: &str = "request_id, attempt_no, channel, upstream_request_id, http_status, error_class, \
    provider_error_type, retry_after_ms, message, started_at, first_byte_at, finished_at, input_tokens, output_tokens, \
    decision, decision_reason, delay_ms, ready_at, visibility";

/// How far an acknowledged commit survives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// A power loss: the WAL is synced before a durable write is acknowledged (what
    /// `synchronous=FULL` does, moved off the commit). The gateway's.
    Full,
    /// A crashed process only (`synchronous=NORMAL`, no sync). For measuring, never for
    /// serving.
    ProcessCrashOnly,
}

pub struct SqliteBackend {
    /// Held as long as the backend lives: one writing process per ledger.
    _lock: LedgerLock,
    /// The WAL file, synced by [`LedgerBackend::sync`] (absent: no sync, the weaker
    /// durability).
    wal: Option<Arc<std::fs::File>>,
    writer: Mutex<SqliteConnection>,
    readers: SqlitePool,
    /// Checkpoints need a writable connection that is not the writer's.
    maintenance: Mutex<SqliteConnection>,
    /// WAL size past which a checkpoint makes the WAL restart (see `maintain`).
    pub(crate) wal_restart_bytes: u64,
}

fn i(v: Option<u64>) -> Option<i64> {
    v.map(|v| v.min(i64::MAX as u64) as i64)
}

fn u(v: Option<i64>) -> Option<u64> {
    v.map(|v| v.max(0) as u64)
}

impl SqliteBackend {
    /// Takes the ledger's lock, opens (creating if needed) the ledger file at `path` and
    /// applies migrations.
    pub async fn open(path: &Path) -> Result<SqliteBackend> {
        Self::open_with(path, Durability::Full).await
    }

    /// [`SqliteBackend::open`] with the commit durability chosen: the gateway always uses
    /// [`Durability::Full`]; the other exists so `make bench` can say what it costs.
    pub async fn open_with(path: &Path, durability: Durability) -> Result<SqliteBackend> {
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(|source| Error::Directory {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let lock = LedgerLock::acquire(path)?;
        let base = SqliteConnectOptions::from_str("sqlite://")?
            .filename(path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5));
        let mut writer = SqliteConnection::connect_with(
            &base
                .clone()
                .create_if_missing(true)
                // NORMAL: a commit is written, not synced; `sync` syncs the WAL before a
                // durable write is acknowledged (see the module docs).
                .synchronous(SqliteSynchronous::Normal)
                .pragma("wal_autocheckpoint", "0")
                // After a WAL restart the file is cut back to this size, so one burst
                // does not keep its disk space for good.
                .pragma("journal_size_limit", WAL_SIZE_LIMIT.to_string()),
        )
        .await?;
        sqlx::migrate!("./migrations").run(&mut writer).await?;
        let wal = match durability {
            Durability::ProcessCrashOnly => None,
            Durability::Full => {
                // The migrations wrote, so the WAL exists; it keeps its inode for as long
                // as the writer's connection is open (a restart rewinds it, never deletes it).
                let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
                name.push("-wal");
                let wal_err = |source| Error::Wal {
                    path: path.display().to_string(),
                    source,
                };
                let file = std::fs::File::open(path.with_file_name(name)).map_err(wal_err)?;
                file.sync_all().map_err(wal_err)?;
                // A new WAL's directory entry must survive a power loss too.
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
                }
                Some(Arc::new(file))
            }
        };
        let maintenance = SqliteConnection::connect_with(&base).await?;
        let readers = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(base.read_only(true))
            .await?;
        Ok(SqliteBackend {
            _lock: lock,
            wal,
            writer: Mutex::new(writer),
            readers,
            maintenance: Mutex::new(maintenance),
            wal_restart_bytes: WAL_RESTART_BYTES,
        })
    }
}

fn ms(v: Option<i64>) -> Option<UnixMs> {
    v.map(UnixMs)
}

fn request_from_row(r: &SqliteRow) -> Result<RequestRecord> {
    let state: String = r.try_get("state")?;
    let format: String = r.try_get("format")?;
    Ok(RequestRecord {
        id: r.try_get("id")?,
        trace_id: r.try_get("trace_id")?,
        client_request_id: r.try_get("client_request_id")?,
        upstream_request_id: r.try_get("upstream_request_id")?,
        key_name: r.try_get("key_name")?,
        owner: r.try_get("owner")?,
        workflow: r.try_get("workflow")?,
        format: format
            .parse::<Format>()
            .map_err(|_| Error::Corrupt(format!("unknown format `{format}`")))?,
        endpoint: r.try_get("endpoint")?,
        route: r.try_get("route")?,
        channel: r.try_get("channel")?,
        requested_model: r.try_get("requested_model")?,
        served_model: r.try_get("served_model")?,
        stream: r.try_get("stream")?,
        state: RequestState::parse(&state).ok_or_else(|| Error::Corrupt(format!("unknown state `{state}`")))?,
        http_status: r.try_get::<Option<i64>, _>("http_status")?.map(|v| v as u16),
        error_class: r
            .try_get::<Option<String>, _>("error_class")?
            .map(|c| FailureClass::parse(&c)),
        error_message: r.try_get("error_message")?,
        input_tokens: u(r.try_get("input_tokens")?),
        output_tokens: u(r.try_get("output_tokens")?),
        cached_input_tokens: u(r.try_get("cached_input_tokens")?),
        reasoning_tokens: u(r.try_get("reasoning_tokens")?),
        cost_usd: r.try_get("cost_usd")?,
        received_at: UnixMs(r.try_get("received_at")?),
        admitted_at: ms(r.try_get("admitted_at")?),
        first_token_at: ms(r.try_get("first_token_at")?),
        finished_at: ms(r.try_get("finished_at")?),
        queued_ms: u(r.try_get("queued_ms")?),
        attempts: r.try_get::<i64, _>("attempts")? as u32,
        body_sha256: r.try_get("body_sha256")?,
        partial_output_committed: r.try_get("partial_output_committed")?,
        next_ready_at: ms(r.try_get("next_ready_at")?),
    })
}

fn attempt_from_row(r: &SqliteRow) -> Result<AttemptRecord> {
    Ok(AttemptRecord {
        request_id: r.try_get("request_id")?,
        attempt_no: r.try_get::<i64, _>("attempt_no")? as u32,
        channel: r.try_get("channel")?,
        upstream_request_id: r.try_get("upstream_request_id")?,
        http_status: r.try_get::<Option<i64>, _>("http_status")?.map(|v| v as u16),
        error_class: ErrorClass::parse(&r.try_get::<String, _>("error_class")?).unwrap_or(ErrorClass::Unknown),
        provider_error_type: r.try_get("provider_error_type")?,
        retry_after_ms: u(r.try_get("retry_after_ms")?),
        message: r.try_get("message")?,
        started_at: UnixMs(r.try_get("started_at")?),
        first_byte_at: ms(r.try_get("first_byte_at")?),
        finished_at: ms(r.try_get("finished_at")?),
        input_tokens: u(r.try_get("input_tokens")?),
        output_tokens: u(r.try_get("output_tokens")?),
        decision: r
            .try_get::<Option<String>, _>("decision")?
            .and_then(|d| Decision::parse(&d)),
        decision_reason: r
            .try_get::<Option<String>, _>("decision_reason")?
            .and_then(|d| StopReason::parse(&d)),
        delay_ms: u(r.try_get("delay_ms")?),
        ready_at: ms(r.try_get("ready_at")?),
        visibility: r
            .try_get::<Option<String>, _>("visibility")?
            .and_then(|v| Visibility::parse(&v)),
    })
}

fn upsert_requests(chunk: &[RequestRecord]) -> QueryBuilder<Sqlite> {
    let mut q: QueryBuilder<Sqlite> = QueryBuilder::new(format!("INSERT INTO requests ({REQUEST_COLUMNS}) "));
    q.push_values(chunk, |mut b, r| {
        b.push_bind(r.id.clone())
            .push_bind(r.trace_id.clone())
            .push_bind(r.client_request_id.clone())
            .push_bind(r.upstream_request_id.clone())
            .push_bind(r.key_name.clone())
            .push_bind(r.owner.clone())
            .push_bind(r.workflow.clone())
            .push_bind(r.format.as_str())
            .push_bind(r.endpoint.clone())
            .push_bind(r.route.clone())
            .push_bind(r.channel.clone())
            .push_bind(r.requested_model.clone())
            .push_bind(r.served_model.clone())
            .push_bind(r.stream)
            .push_bind(r.state.as_str())
            .push_bind(r.http_status.map(i64::from))
            .push_bind(r.error_class.map(FailureClass::as_str))
            .push_bind(r.error_message.clone())
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
            .push_bind(r.body_sha256.clone())
            .push_bind(r.partial_output_committed)
            .push_bind(r.next_ready_at.map(|t| t.0));
    });
    q.push(&*REQUEST_UPSERT);
    q
}

fn insert_attempts(chunk: &[AttemptRecord]) -> QueryBuilder<Sqlite> {
    let mut q: QueryBuilder<Sqlite> =
        QueryBuilder::new(format!("INSERT OR REPLACE INTO attempts ({ATTEMPT_COLUMNS}) "));
    q.push_values(chunk, |mut b, a| {
        b.push_bind(a.request_id.clone())
            .push_bind(i64::from(a.attempt_no))
            .push_bind(a.channel.clone())
            .push_bind(a.upstream_request_id.clone())
            .push_bind(a.http_status.map(i64::from))
            .push_bind(a.error_class.as_str())
            .push_bind(a.provider_error_type.clone())
            .push_bind(i(a.retry_after_ms))
            .push_bind(a.message.clone())
            .push_bind(a.started_at.0)
            .push_bind(a.first_byte_at.map(|t| t.0))
            .push_bind(a.finished_at.map(|t| t.0))
            .push_bind(i(a.input_tokens))
            .push_bind(i(a.output_tokens))
            .push_bind(a.decision.map(Decision::as_str))
            .push_bind(a.decision_reason.map(StopReason::as_str))
            .push_bind(i(a.delay_ms))
            .push_bind(a.ready_at.map(|t| t.0))
            .push_bind(a.visibility.map(Visibility::as_str));
    });
    q
}

/// The smallest UUIDv7 string of millisecond `ms`: ids compare as strings in time order.
fn uuid_floor(at: UnixMs) -> String {
    let ms = at.0.clamp(0, (1 << 48) - 1) as u64;
    format!("{:08x}-{:04x}-0000-0000-000000000000", ms >> 16, ms & 0xffff)
}

/// 32 hex digits (a trace id) in UUID form, to look a gateway-made trace id up by key.
fn hex_to_uuid(s: &str) -> Option<String> {
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let s = s.to_ascii_lowercase();
    Some(format!(
        "{}-{}-{}-{}-{}",
        &s[0..8],
        &s[8..12],
        &s[12..16],
        &s[16..20],
        &s[20..32]
    ))
}

/// SQLite's default page size, which the ledger keeps.
const PAGE_BYTES: u64 = 4096;

/// A PASSIVE checkpoint: (frames in the WAL, frames now in the database).
async fn checkpoint(conn: &mut SqliteConnection) -> Result<(u64, u64)> {
    // fetch_all, not fetch_one: a statement left un-stepped keeps a read snapshot open,
    // and a reader on the WAL stops the writer from ever restarting it.
    let rows = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)").fetch_all(conn).await?;
    let Some(row) = rows.first() else { return Ok((0, 0)) };
    // (busy, frames in the WAL, frames checkpointed); -1 when not in WAL mode.
    let (wal, done): (i64, i64) = (row.try_get(1)?, row.try_get(2)?);
    Ok((wal.max(0) as u64, done.max(0) as u64))
}

#[async_trait]
impl LedgerBackend for SqliteBackend {
    async fn write_batch(&self, requests: &[RequestRecord], attempts: &[AttemptRecord]) -> Result<()> {
        let mut conn = self.writer.lock().await;
        // Each statement is a hop to sqlx's SQLite worker thread; a batch of one statement
        // (the common case for a durable `calling_api` write) runs in autocommit and saves
        // the BEGIN and COMMIT hops on the request's critical path.
        let statements = requests.len().div_ceil(ROWS_PER_STATEMENT) + attempts.len().div_ceil(ROWS_PER_STATEMENT);
        if statements == 1 {
            if requests.is_empty() {
                insert_attempts(attempts).build().execute(&mut *conn).await?;
            } else {
                upsert_requests(requests).build().execute(&mut *conn).await?;
            }
            return Ok(());
        }
        let mut tx = conn.begin().await?;
        for chunk in requests.chunks(ROWS_PER_STATEMENT) {
            upsert_requests(chunk).build().execute(&mut *tx).await?;
        }
        for chunk in attempts.chunks(ROWS_PER_STATEMENT) {
            insert_attempts(chunk).build().execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn get_request(&self, id: &str) -> Result<Option<RequestRecord>> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT {REQUEST_COLUMNS} FROM requests WHERE id = ?"
        )))
        .bind(id)
        .fetch_optional(&self.readers)
        .await?;
        row.as_ref().map(request_from_row).transpose()
    }

    async fn attempts(&self, request_id: &str) -> Result<Vec<AttemptRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE request_id = ? ORDER BY attempt_no"
        )))
        .bind(request_id)
        .fetch_all(&self.readers)
        .await?;
        rows.iter().map(attempt_from_row).collect()
    }

    async fn search(&self, s: &Search) -> Result<Page> {
        let limit = s.limit.unwrap_or(50).clamp(1, 500);
        let mut q: QueryBuilder<Sqlite> =
            QueryBuilder::new(format!("SELECT {REQUEST_COLUMNS} FROM requests WHERE 1 = 1"));
        if let Some(before) = &s.before {
            q.push(" AND id < ").push_bind(before.clone());
        }
        // The key is a UUIDv7, which starts with its millisecond timestamp: a time range is
        // a key range, so it needs no index of its own.
        if let Some(from) = s.from_ms {
            q.push(" AND id >= ").push_bind(uuid_floor(from));
        }
        if let Some(to) = s.to_ms {
            q.push(" AND id < ").push_bind(uuid_floor(to));
        }
        if let Some(route) = &s.route {
            q.push(" AND route = ").push_bind(route.clone());
        }
        if let Some(state) = s.state {
            q.push(" AND state = ").push_bind(state.as_str());
        }
        if let Some(needle) = s.q.as_deref().map(str::trim).filter(|n| !n.is_empty()) {
            // One indexed lookup per kind of id; a trace id the gateway made is its request id.
            q.push(" AND id IN (SELECT id FROM requests WHERE id = ")
                .push_bind(needle.to_owned());
            if let Some(as_id) = hex_to_uuid(needle) {
                q.push(" UNION SELECT id FROM requests WHERE id = ").push_bind(as_id);
            }
            q.push(" UNION SELECT id FROM requests WHERE client_request_id = ")
                .push_bind(needle.to_owned());
            q.push(" UNION SELECT id FROM requests WHERE trace_id = ")
                .push_bind(needle.to_owned())
                .push(" AND trace_id <> replace(id, '-', ''))");
        }
        q.push(" ORDER BY id DESC LIMIT ").push_bind(i64::from(limit) + 1);
        let rows = q.build().fetch_all(&self.readers).await?;
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
        let mut conn = self.writer.lock().await;
        let r = sqlx::query(
            "UPDATE requests SET state = 'unknown', error_class = 'interrupted', \
             error_message = 'the gateway stopped while this request was calling the provider' \
             WHERE state = 'calling_api'",
        )
        .execute(&mut *conn)
        .await?;
        Ok(r.rows_affected())
    }

    fn needs_sync(&self) -> bool {
        self.wal.is_some()
    }

    async fn sync(&self) -> Result<()> {
        let Some(wal) = self.wal.clone() else {
            return Ok(());
        };
        // fdatasync, as SQLite's own FULL does on Linux; on a blocking thread, so the
        // writer goes on committing meanwhile.
        tokio::task::spawn_blocking(move || wal.sync_data())
            .await
            .map_err(|e| Error::Unavailable(format!("the ledger sync did not run: {e}")))?
            .map_err(|source| Error::Unavailable(format!("syncing the ledger failed: {source}")))
    }

    async fn maintain(&self) -> Result<u64> {
        // Checkpoints run beside the writer so its commits do not pay for them. But the
        // WAL only restarts (goes back to its start instead of growing) when the writer
        // begins a transaction at a moment the WAL is fully checkpointed, and a writer
        // that commits back to back never meets that moment. So once the WAL is large,
        // the writer is held for a second, short checkpoint of just the frames committed
        // during the first; its next commit then restarts the WAL.
        let mut conn = self.maintenance.lock().await;
        let (wal, done) = checkpoint(&mut conn).await?;
        if wal * PAGE_BYTES < self.wal_restart_bytes {
            return Ok(done);
        }
        let _writer = self.writer.lock().await;
        let (_, tail) = checkpoint(&mut conn).await?;
        Ok(done.max(tail))
    }
}
